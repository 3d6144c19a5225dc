"""The rewriter's view of a model: tensors with dtype and (possibly symbolic) shape, nodes in
topological order, producer/consumer links and constant values. Built by `rewriter.shapes`."""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional, TypeVar

import numpy as np
import onnx

if TYPE_CHECKING:
    from ortfuse.rewriter.shapes import Constants
    from ortfuse.rewriter.weights import WeightStore

Dim = int | str  # a static size, or the name of a symbolic dim ("batch", "seq")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: int  # onnx.TensorProto element type
    shape: tuple[Dim, ...] | None  # None: rank unknown

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)


@dataclass(frozen=True)
class Graph:
    """A shape-inferred model. `model` is a private copy (user shapes applied, value_info filled);
    the caller's model is never touched."""

    model: onnx.ModelProto
    tensors: Mapping[str, TensorInfo]
    constants: Constants  # initializers and Constant-node outputs (rewriter.shapes)
    nodes: tuple[onnx.NodeProto, ...]  # topological order, as in model.graph.node
    producer: Mapping[str, int]  # tensor name -> index into nodes
    consumers: Mapping[str, tuple[int, ...]]  # tensor name -> indices of consuming nodes
    graph_inputs: tuple[str, ...]
    graph_outputs: tuple[str, ...]
    opset: int  # default-domain opset version
    sym_hints: Mapping[str, int] = field(default_factory=dict)  # typical values for symbolic dims (cost model)
    hint_overrides: Mapping[str, int] = field(default_factory=dict)  # the user's own typical values (--dim-hint)
    # the weight store `model`'s stubs name (rewriter.weights), held so that it lives as long as the graph
    store: Optional[WeightStore] = field(default=None, compare=False, repr=False)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def fed(self, name: str) -> bool:
        """An initializer that is also a graph input (IR < 4 style): a user may feed it at run time, so it is
        not a fixed constant to rewrite."""
        return name in _listed_inputs(self)

    def used(self, name: str) -> bool:
        """A tensor some node reads or the graph returns ("" is an absent optional output: never)."""
        return bool(name) and (bool(self.consumers.get(name)) or name in self.graph_outputs)

    def downstream(self, names: Iterable[str]) -> set[str]:
        """`names` and every tensor computed from them (subgraphs' outer reads of them included)."""
        out, todo = set(names), list(names)
        while todo:
            for i in self.consumers.get(todo.pop(), ()):
                for o in self.nodes[i].output:
                    if o and o not in out:
                        out.add(o)
                        todo.append(o)
        return out

    def constant_size(self, name: str) -> Optional[int]:
        """Elements of constant `name`, None where it is none, without converting a weight to numpy."""
        return self.constants.size_of(name) if name in self.constants else None

    def node_label(self, index: int) -> str:
        n = self.nodes[index]
        return f"{n.op_type} '{n.name or n.output[0]}'"

    def axes(self, node: onnx.NodeProto, pos: int = 1) -> list[int] | str | None:
        """An axes operand: the constant input at `pos` (newer opsets) or the `axes` attribute; None when
        neither is given, "runtime" when the input is computed at run time."""
        if len(node.input) > pos and node.input[pos]:
            v = self.constants.get(node.input[pos])
            return "runtime" if v is None else [int(x) for x in np.asarray(v).reshape(-1)]
        a = next((a for a in node.attribute if a.name == "axes"), None)
        return None if a is None else [int(x) for x in onnx.helper.get_attribute_value(a)]


R = TypeVar("R")


def per_graph(fn: Callable[["Graph"], R]) -> Callable[["Graph"], R]:
    """Memoizes fn(graph) for the last few graphs, by identity (ids of collected graphs are reused, hence
    the weak reference). Graphs are immutable, so a result stays valid for the graph's life."""
    memo: dict[int, tuple[weakref.ref, R]] = {}

    @functools.wraps(fn)
    def cached(g: "Graph") -> R:
        hit = memo.get(id(g))
        if hit is not None and hit[0]() is g:
            return hit[1]
        value = fn(g)
        memo[id(g)] = (weakref.ref(g), value)
        if len(memo) > 8:
            memo.pop(next(iter(memo)))
        return value
    return cached


@per_graph
def _listed_inputs(g: Graph) -> frozenset[str]:
    """Every name the model lists as a graph input, initializers included."""
    return frozenset(v.name for v in g.model.graph.input)

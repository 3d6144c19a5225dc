"""Nodes computed from constants alone ("constant cones"): the candidates of ONNX Runtime's constant folding.
`canonical.fold_constant_subgraphs` writes the small ones into the model; `ort_folding` asks ORT which of the
others it folds when a session starts."""
from __future__ import annotations

from typing import Callable, Sequence

import onnx

from ortfuse.rewriter import _proto
from ortfuse.rewriter.graph import Graph

_NONDETERMINISTIC = frozenset({"Bernoulli", "Multinomial", "Dropout"})  # and Random*: a new value each run


def draws(op_type: str) -> bool:
    """An op whose every run draws a new value (two of them are never one value)."""
    return op_type.startswith("Random") or op_type in _NONDETERMINISTIC


def fixed_constant(g: Graph, x: str) -> bool:
    """A constant a user cannot feed another value for: from IR 4, an initializer not listed as a graph input
    (in IR 3 every initializer is listed, and ORT folds them all)."""
    return x in g.constants and not (g.model.ir_version >= 4 and g.fed(x))


def constant_cone(g: Graph, admit: Callable[[onnx.NodeProto], bool] = lambda n: True) -> list[int]:
    """Nodes (topological order) of the default domain, with inputs and outputs, that draw no random value, hold
    no subgraph and read only fixed constants (`fixed_constant`) or tensors such nodes make; `admit` refuses
    more (the cone ends at a node it refuses)."""
    made: set[str] = set()
    nodes: list[int] = []
    for i, n in enumerate(g.nodes):
        ins = [x for x in n.input if x]
        if n.domain not in ("", "ai.onnx") or not any(n.output) or not ins or draws(n.op_type) \
                or _proto.has_subgraph(n) or not admit(n) \
                or not all(x in made or fixed_constant(g, x) for x in ins):
            continue
        nodes.append(i)
        made.update(o for o in n.output if o)
    return nodes


def connected_groups(g: Graph, nodes: Sequence[int], through_constants: bool = False) -> list[list[int]]:
    """`nodes` (topological order) in connected groups, each in topological order: joined by the tensors they
    make, and with `through_constants` by the constants they read in common too."""
    parent = {i: i for i in nodes}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    producer = {o: i for i in nodes for o in g.nodes[i].output if o}
    first_reader: dict[str, int] = {}
    for i in nodes:
        for x in g.nodes[i].input:
            if x in producer:
                parent[root(i)] = root(producer[x])
            elif x and through_constants:
                parent[root(i)] = root(first_reader.setdefault(x, i))
    groups: dict[int, list[int]] = {}
    for i in nodes:
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())

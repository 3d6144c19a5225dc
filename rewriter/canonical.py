"""Canonicalization before the search: Reshape targets computed at run time from Shape/Gather/Concat
chains (as the TorchScript exporter emits them) become constants wherever the inferred shapes
determine them, and the shape computations left without consumers are removed. The result is the
same function, with layout ops the search can fold into index math."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.rewriter.graph import Dim, Graph
from ortfuse.rewriter.shapes import assemble


def _static_target(in_shape: tuple[Dim, ...], out_shape: tuple[Dim, ...]) -> Optional[list[int]]:
    """A constant Reshape target giving `out_shape` from `in_shape` (0 copies the input dim at the
    same position, one -1 is inferred), or None when the shapes do not determine one."""
    target: list[int] = []
    for k, d in enumerate(out_shape):
        if isinstance(d, int):
            if d == 0:
                return None  # 0 means "copy" in Reshape's default mode
            target.append(d)
        elif k < len(in_shape) and in_shape[k] == d:
            target.append(0)
        else:
            target.append(-1)
    return target if target.count(-1) <= 1 else None


def _allowzero(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "allowzero"), 0)


def fold_runtime_shapes(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Reshapes whose target became a constant). `g` is left untouched."""
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    folded = 0
    for node in m.graph.node:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        if node.input[1] in g.constants or _allowzero(node):
            continue
        src, out = g.tensors.get(node.input[0]), g.tensors.get(node.output[0])
        if src is None or out is None or src.shape is None or out.shape is None:
            continue
        target = _static_target(src.shape, out.shape)
        if target is None:
            continue
        name = f"{node.output[0]}__ortfuse_shape"
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(target, np.int64), name))
        node.input[1] = name
        folded += 1
    if not folded:
        return g, 0
    _remove_dead(m)
    tensors = dict(g.tensors)
    for t in m.graph.initializer[len(g.model.graph.initializer):]:
        tensors[t.name] = type(next(iter(g.tensors.values())))(t.name, onnx.TensorProto.INT64, tuple(t.dims))
    return assemble(m, tensors, g.opset), folded


def _remove_dead(m: onnx.ModelProto) -> None:
    """Drop nodes none of whose outputs is used (in reverse order, so whole chains go)."""
    keep_names = {o.name for o in m.graph.output}
    used: set[str] = set(keep_names)
    alive: list[onnx.NodeProto] = []
    for node in reversed(list(m.graph.node)):
        if any(o and o in used for o in node.output) or _has_side_graph(node):
            alive.append(node)
            used.update(i for i in node.input if i)
            for a in node.attribute:  # names read inside subgraphs stay alive
                if a.type == onnx.AttributeProto.GRAPH:
                    used.update(i for n in a.g.node for i in n.input)
    del m.graph.node[:]
    m.graph.node.extend(reversed(alive))
    inits = [t for t in m.graph.initializer if t.name in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(inits)


def _has_side_graph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute) \
        and not node.output

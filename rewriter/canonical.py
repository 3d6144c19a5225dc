"""Canonicalization before the search; each pass gives the same function in a form the search fuses.

* `fold_runtime_shapes`: Reshape targets computed at run time from Shape/Gather/Concat chains (as the
  TorchScript exporter emits them) become constants wherever the inferred shapes determine them.
* `unflatten_gemms`: a Gemm between a Reshape that flattens the leading dims and one that restores them
  (GPT-2's Conv1D: `x.view(-1, K) @ W + b`, then `.view(*lead, N)`) becomes MatMul (+ Add of the bias) on
  the unflattened tensor, so the GEMM's consumers are its direct epilogue and no Reshape with a target
  computed at run time sits between them.
Shape computations left without consumers are removed."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.rewriter import _proto
from ortfuse.rewriter.graph import Dim, Graph, TensorInfo
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


def fold_runtime_shapes(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Reshapes whose target became a constant). `g` is left untouched."""
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    folded = 0
    for node in m.graph.node:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        if node.input[1] in g.constants or _attr(node, "allowzero", 0):
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
    tensors = dict(g.tensors)
    for t in m.graph.initializer[len(g.model.graph.initializer):]:
        tensors[t.name] = TensorInfo(t.name, onnx.TensorProto.INT64, tuple(t.dims))
    _remove_dead(m)
    return assemble(m, tensors, g.opset), folded


def _attr(node: onnx.NodeProto, name: str, default):
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else onnx.helper.get_attribute_value(a)


def _unflatten_plan(g: Graph, i: int) -> Optional[tuple[str, int]]:
    """(x, index of the restoring Reshape) when Gemm node i computes `Reshape(x) @ B (+ C)` with x of shape
    (*lead, K) flattened to (P, K), and its only consumer reshapes the result back to (*lead, N)."""
    n = g.nodes[i]
    if n.op_type != "Gemm" or n.domain not in ("", "ai.onnx") or _attr(n, "transA", 0) \
            or _attr(n, "alpha", 1.0) != 1.0 or _attr(n, "beta", 1.0) != 1.0:
        return None
    flat = g.producer.get(n.input[0])
    y = n.output[0]
    users = g.consumers.get(y, ())
    if flat is None or g.nodes[flat].op_type != "Reshape" or len(users) != 1 or y in g.graph_outputs:
        return None
    restore = g.nodes[users[0]]
    if restore.op_type != "Reshape" or restore.input[0] != y:
        return None
    x = g.nodes[flat].input[0]
    shapes = [g.tensors[t].shape if t in g.tensors else None for t in (x, n.input[0], y, restore.output[0])]
    if any(s is None for s in shapes):
        return None
    xs, fs, ys, rs = shapes
    if len(xs) < 3 or len(fs) != 2 or fs[1] != xs[-1] or rs != tuple(xs[:-1]) + (ys[1],):
        return None
    if len(n.input) > 2 and n.input[2]:
        cs = g.tensors[n.input[2]].shape if n.input[2] in g.tensors else None
        if cs is None or tuple(cs) not in ((ys[1],), (1, ys[1])):  # a bias along N broadcasts the same in N-D
            return None
    return x, users[0]


def unflatten_gemms(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Gemms rewritten). `g` is left untouched."""
    plans = {i: p for i in range(len(g.nodes)) if (p := _unflatten_plan(g, i)) is not None}
    if not plans:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    restores = {r for _, r in plans.values()}
    new_nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(m.graph.node):
        if i in restores:
            continue
        if i not in plans:
            new_nodes.append(node)
            continue
        x, r = plans[i]
        out = g.nodes[r].output[0]
        b = node.input[1]
        if _attr(node, "transB", 0):
            bt = f"{b}__ortfuse_T{i}"
            new_nodes.append(onnx.helper.make_node("Transpose", [b], [bt], name=f"{node.name}/transB", perm=[1, 0]))
            shape = g.tensors[b].shape
            tensors[bt] = TensorInfo(bt, g.tensors[b].dtype, None if shape is None else tuple(reversed(shape)))
            b = bt
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        mm = f"{out}__ortfuse_mm" if bias else out
        new_nodes.append(onnx.helper.make_node("MatMul", [x, b], [mm], name=f"{node.name}/MatMul"))
        if bias:
            tensors[mm] = TensorInfo(mm, g.tensors[out].dtype, g.tensors[out].shape)
            new_nodes.append(onnx.helper.make_node("Add", [mm, bias], [out], name=f"{node.name}/bias"))
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    _remove_dead(m)
    return assemble(m, tensors, g.opset), len(plans)


def _remove_dead(m: onnx.ModelProto) -> None:
    """Drop nodes none of whose outputs is used (in reverse order, so whole chains go), and initializers
    nothing reads. Initializers that are also graph inputs (IR < 4 style) stay: the interface is kept."""
    used: set[str] = {o.name for o in m.graph.output} | {v.name for v in m.graph.input}
    alive: list[onnx.NodeProto] = []
    for node in reversed(list(m.graph.node)):
        if any(o and o in used for o in node.output) or _has_side_graph(node):
            alive.append(node)
            used.update(_proto.node_reads(node))  # names read inside subgraphs (at any depth) stay alive
    del m.graph.node[:]
    m.graph.node.extend(reversed(alive))
    inits = [t for t in m.graph.initializer if t.name in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(inits)


def _has_side_graph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute) \
        and not node.output

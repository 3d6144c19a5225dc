"""Padding a GEMM's constant weight so its rows are 16-byte aligned.

A MatMul (or Gemm) whose N columns make rows of a byte length not divisible by 16 (GPT-2's LM head: 50,257
fp16 logits) leaves cuBLAS without its TMA-fed Hopper kernels: B's and C's leading dimensions are misaligned,
so it falls back to kernels that load elements a few bytes at a time. The weight is constant, so it can be
padded offline with zero columns to the next multiple of 16 bytes; the GEMM then runs aligned on N' columns
and a Slice gives back the first N (the zero columns are never read), as torch.compile's shape padding and
FasterTransformer's padded vocabulary do. The caller decides where that pays (the Slice copies the result
once): `worth(graph, node index, N')`."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.canonical import remove_dead
from ortfuse.rewriter.graph import Graph, TensorInfo
from ortfuse.rewriter.shapes import assemble

ALIGN_BYTES = 16
_DTYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT)


def padded_width(n: int, dtype: int) -> int:
    """The least N' >= n whose rows of N' elements are 16-byte aligned."""
    per = ALIGN_BYTES // int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype)).itemsize)
    return -(-n // per) * per


def candidate(g: Graph, i: int) -> Optional[int]:
    """N' for node i, a GEMM on a constant 2-D weight (and a constant bias, for Gemm) whose output rows are
    misaligned; None otherwise."""
    node = g.nodes[i]
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
        return None
    w, y = node.input[1], node.output[0]
    info, out = g.tensors.get(w), g.tensors.get(y)
    if w not in g.constants or g.fed(w) or info is None or info.shape is None or len(info.shape) != 2 \
            or info.dtype not in _DTYPES or out is None or out.shape is None or len(out.shape) < 2:
        return None
    trans_b = node.op_type == "Gemm" and attr(node, "transB", 0)
    if node.op_type == "Gemm":
        if attr(node, "transA", 0) or (len(node.input) > 2 and node.input[2] and _bias(g, node) is None):
            return None
    n = info.shape[0] if trans_b else info.shape[1]
    wide = padded_width(n, info.dtype)
    return wide if wide != n and out.shape[-1] == n else None


def _bias(g: Graph, node: onnx.NodeProto) -> Optional[np.ndarray]:
    """A Gemm's C when it is a constant broadcast along M (shape (N,), (1, N), or one element)."""
    c = g.constants.get(node.input[2])
    if c is None or g.fed(node.input[2]) or (c.ndim == 2 and c.shape[0] != 1) or c.ndim > 2:
        return None
    return c


def pad_unaligned_gemms(g: Graph, worth: Callable[[Graph, int, int], bool]) -> tuple[Graph, int]:
    """(new graph, number of GEMMs padded); `g` is left untouched."""
    todo = {i: wide for i in range(len(g.nodes)) if (wide := candidate(g, i)) is not None and worth(g, i, wide)}
    if not todo:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    new_nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(m.graph.node):
        if i not in todo:
            new_nodes.append(node)
            continue
        new_nodes.extend(_padded(g, i, todo[i], m, tensors))
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), len(todo)


def _padded(g: Graph, i: int, wide: int, m: onnx.ModelProto, tensors: dict[str, TensorInfo]) -> list[onnx.NodeProto]:
    """The GEMM on the zero-padded weight (and bias) into a new tensor, then the Slice to the old output."""
    node = onnx.NodeProto()
    node.CopyFrom(g.nodes[i])
    base = f"{node.output[0]}__ortfuse_aligned"
    w = g.constants[node.input[1]]
    trans_b = node.op_type == "Gemm" and attr(node, "transB", 0)
    n = w.shape[0] if trans_b else w.shape[1]
    pad = ((0, wide - n), (0, 0)) if trans_b else ((0, 0), (0, wide - n))
    dtype = g.tensors[node.input[1]].dtype
    m.graph.initializer.append(numpy_helper.from_array(np.pad(w, pad), f"{base}_w"))
    tensors[f"{base}_w"] = TensorInfo(f"{base}_w", dtype, (wide, w.shape[1]) if trans_b else (w.shape[0], wide))
    node.input[1] = f"{base}_w"
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        c = _bias(g, node)
        assert c is not None
        if c.size > 1:  # a per-column bias grows with the weight; a scalar broadcasts as it is
            c = np.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, wide - n)])
            m.graph.initializer.append(numpy_helper.from_array(c, f"{base}_c"))
            tensors[f"{base}_c"] = TensorInfo(f"{base}_c", g.tensors[node.input[2]].dtype, c.shape)
            node.input[2] = f"{base}_c"
    y = g.nodes[i].output[0]
    out = g.tensors[y]
    node.output[0] = f"{base}_y"
    tensors[node.output[0]] = TensorInfo(node.output[0], out.dtype, (*out.shape[:-1], wide))
    axis = len(out.shape) - 1
    name = f"{base}/Slice"
    if g.opset < 10:
        return [node, onnx.helper.make_node("Slice", [node.output[0]], [y], name=name, starts=[0], ends=[n],
                                            axes=[axis])]
    bounds = [f"{base}_{what}" for what in ("starts", "ends", "axes")]
    for t, v in zip(bounds, (0, n, axis)):
        m.graph.initializer.append(numpy_helper.from_array(np.asarray([v], np.int64), t))
        tensors[t] = TensorInfo(t, onnx.TensorProto.INT64, (1,))
    return [node, onnx.helper.make_node("Slice", [node.output[0], *bounds], [y], name=name)]

"""Inference-mode BatchNormalization in forms the search fuses.

* After a Conv that only it reads, BatchNormalization folds into the Conv's weight and bias (what ORT's
  ConvBNFusion does at session start, so the Conv costs ORT no more than before), and the Conv's
  epilogue is what follows the BatchNormalization.
* Elsewhere it becomes `x * a + b` with per-channel constants a = scale / sqrt(var + eps),
  b = bias - mean * a: two element-wise ops that join the kernels around them.

BatchNormalization in training mode, with its running statistics read, or with parameters computed at run
time is left as it is."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.customops import scalar
from ortfuse.rewriter import _proto
from ortfuse.rewriter.canonical import remove_dead
from ortfuse.rewriter.graph import Graph, TensorInfo
from ortfuse.rewriter.shapes import assemble


def _affine(g: Graph, bn: onnx.NodeProto) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(a, b) per channel in float64, or None when this BatchNormalization is not a constant affine map."""
    if bn.domain not in ("", "ai.onnx") or len(bn.input) != 5 or any(o for o in bn.output[1:]):
        return None
    if scalar.attr(bn, "training_mode", 0) or not scalar.attr(bn, "spatial", 1):
        return None
    if not all(t in g.constants for t in bn.input[1:]):
        return None
    x = g.tensors.get(bn.input[0])
    if x is None or x.shape is None or len(x.shape) < 2 or x.dtype not in scalar.STORAGE:
        return None
    scale, bias, mean, var = (np.asarray(g.constants[t], np.float64).reshape(-1) for t in bn.input[1:])
    c = x.shape[1]
    if not isinstance(c, int) or {scale.size, bias.size, mean.size, var.size} != {c}:
        return None
    a = scale / np.sqrt(var + float(scalar.attr(bn, "epsilon", 1e-5)))
    return a, bias - mean * a


def _foldable_conv(g: Graph, bn_index: int) -> Optional[int]:
    """The Conv whose output only this BatchNormalization reads, with constant weight (and bias)."""
    x = g.nodes[bn_index].input[0]
    i = g.producer.get(x)
    if i is None or x in g.graph_outputs or g.consumers.get(x) != (bn_index,):
        return None
    conv = g.nodes[i]
    if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or conv.output[0] != x:
        return None
    if conv.input[1] not in g.constants or (len(conv.input) > 2 and conv.input[2] and conv.input[2] not in g.constants):
        return None
    return i


def fold_batchnorms(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of BatchNormalizations rewritten). `g` is left untouched."""
    plans = {i: ab for i, n in enumerate(g.nodes) if n.op_type == "BatchNormalization"
             and (ab := _affine(g, n)) is not None}
    if not plans:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for i, (a, b) in plans.items():
        bn = g.nodes[i]
        base = f"{bn.output[0]}__ortfuse_bn"
        c = _foldable_conv(g, i)
        if c is not None:
            _fold_into_conv(g, m, tensors, c, bn.output[0], base, a, b)
            replaced[i] = []
        else:
            replaced[i] = _affine_nodes(g, m, tensors, bn, base, a, b)
    _proto.splice(m.graph, replaced)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), len(plans)


def _constant(m: onnx.ModelProto, tensors: dict[str, TensorInfo], name: str, value: np.ndarray, dtype: int) -> str:
    arr = value.astype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
    m.graph.initializer.append(numpy_helper.from_array(arr, name))
    tensors[name] = TensorInfo(name, dtype, tuple(arr.shape))
    return name


def _fold_into_conv(g: Graph, m: onnx.ModelProto, tensors: dict[str, TensorInfo], c: int, y: str, base: str,
                    a: np.ndarray, b: np.ndarray) -> None:
    """Conv c now writes the BatchNormalization's output y with weight W * a and bias (bias - mean) * a + beta."""
    conv = m.graph.node[c]
    w_name = conv.input[1]
    w = np.asarray(g.constants[w_name], np.float64)
    dtype = g.tensors[w_name].dtype
    old_bias = np.asarray(g.constants[conv.input[2]], np.float64).reshape(-1) \
        if len(conv.input) > 2 and conv.input[2] else np.zeros(w.shape[0])
    new_w = _constant(m, tensors, f"{base}_w", w * a.reshape(-1, *[1] * (w.ndim - 1)), dtype)
    new_b = _constant(m, tensors, f"{base}_b", old_bias * a + b, dtype)
    del conv.input[1:]
    conv.input.extend([new_w, new_b])
    conv.output[0] = y


def _affine_nodes(g: Graph, m: onnx.ModelProto, tensors: dict[str, TensorInfo], bn: onnx.NodeProto, base: str,
                  a: np.ndarray, b: np.ndarray) -> list[onnx.NodeProto]:
    x = g.tensors[bn.input[0]]
    per_channel = (-1, *[1] * (len(x.shape) - 2))
    scale = _constant(m, tensors, f"{base}_a", a.reshape(per_channel), x.dtype)
    shift = _constant(m, tensors, f"{base}_c", b.reshape(per_channel), x.dtype)
    tensors[f"{base}_mul"] = TensorInfo(f"{base}_mul", x.dtype, x.shape)
    name = bn.name or bn.output[0]
    return [onnx.helper.make_node("Mul", [bn.input[0], scale], [f"{base}_mul"], name=f"{name}/scale"),
            onnx.helper.make_node("Add", [f"{base}_mul", shift], [bn.output[0]], name=f"{name}/shift")]

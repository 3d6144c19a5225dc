"""Resize as an index op: where each output element reads its input (`nearest`) or which inputs it blends
(`linear`, bilinear over H and W), in the coordinate conventions ORT implements (its CPU `Upsample`,
onnxruntime/core/providers/cpu/tensor/upsamplebase.h). `ResizeGeom` is what the lowering needs; `verdict` says
why a Resize stays with ORT."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import onnx

from ortfuse.customops import scalar
from ortfuse.rewriter.graph import Dim, Graph

COORDINATES = ("half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners")
NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


@dataclass(frozen=True)
class ResizeGeom:
    mode: str  # "nearest" | "linear"
    coordinates: str  # one of COORDINATES
    nearest: str  # one of NEAREST
    in_shape: tuple[Dim, ...]
    out_shape: tuple[Dim, ...]
    # per axis: the scale given (float), or None where `sizes` set the output (scale = out / in at run time)
    scales: tuple[Optional[float], ...]
    axes: tuple[int, ...]  # the axes whose size changes (the others are read where they are)


def geometry(g: Graph, node: onnx.NodeProto) -> Union[ResizeGeom, str]:
    """The Resize's geometry, or why it is not computed in a kernel."""
    if g.opset < 11:
        return "Resize before opset 11 (scales only, other conventions)"
    mode = scalar.attr_str(node, "mode", "nearest")
    coordinates = scalar.attr_str(node, "coordinate_transformation_mode", "half_pixel")
    nearest = scalar.attr_str(node, "nearest_mode", "round_prefer_floor")
    if mode not in ("nearest", "linear"):
        return f"mode '{mode}'"
    if coordinates not in COORDINATES:
        return f"coordinate_transformation_mode '{coordinates}'"
    if mode == "nearest" and nearest not in NEAREST:
        return f"nearest_mode '{nearest}'"
    if scalar.attr(node, "antialias", 0) or scalar.attr(node, "axes") is not None or \
            scalar.attr_str(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        return "antialias, axes or a kept aspect ratio"
    x, y = node.input[0], node.output[0]
    in_shape, out_shape = g.tensors[x].shape, g.tensors[y].shape
    if in_shape is None or out_shape is None or len(in_shape) != len(out_shape):
        return "shapes unknown"
    rank = len(in_shape)
    scales_in = node.input[2] if len(node.input) > 2 and node.input[2] else None
    sizes_in = node.input[3] if len(node.input) > 3 and node.input[3] else None
    if scales_in is not None and scales_in not in g.constants:
        return f"its scales '{scales_in}' are computed at run time"
    scales_v = np.asarray(g.constants[scales_in]).reshape(-1) if scales_in is not None else np.zeros(0)
    if not scales_v.size and sizes_in is not None and sizes_in not in g.constants:
        # sizes computed at run time (SegFormer's decode head: the input's N and C through Shape, then H and W):
        # what inference made of them is the output shape, trusted where every dim is static or the input's
        if all(isinstance(o, int) or o == i for i, o in zip(in_shape, out_shape)):
            axes = tuple(a for a in range(rank) if in_shape[a] != out_shape[a])
            if mode == "linear" and not (rank == 4 and set(axes) <= {2, 3}):
                return "linear resize of other than H and W of an NCHW image"
            return ResizeGeom(mode, coordinates, nearest, tuple(in_shape), tuple(out_shape), (None,) * rank, axes)
        return f"its sizes '{sizes_in}' are computed at run time"
    if scales_v.size:
        if scales_v.size != rank or not np.all(scales_v > 0):
            return f"scales {scales_v.tolist()}"
        scales: tuple[Optional[float], ...] = tuple(float(np.float32(s)) for s in scales_v)
    elif sizes_in is not None:
        sizes = np.asarray(g.constants[sizes_in]).reshape(-1)
        if sizes.size != rank or tuple(int(s) for s in sizes) != tuple(out_shape):
            return f"sizes {sizes.tolist()} are not the inferred output shape {out_shape}"
        scales = (None,) * rank
    else:
        return "neither scales nor sizes"
    axes = tuple(a for a in range(rank) if not (in_shape[a] == out_shape[a] and scales[a] in (None, 1.0)))
    if mode == "linear" and not (rank == 4 and set(axes) <= {2, 3}):
        return "linear resize of other than H and W of an NCHW image"
    if mode == "linear" and g.tensors[x].dtype not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                        onnx.TensorProto.BFLOAT16):
        return "linear resize of integers"
    return ResizeGeom(mode, coordinates, nearest, tuple(in_shape), tuple(out_shape), scales, axes)


def verdict(g: Graph, node: onnx.NodeProto) -> Optional[str]:
    geo = geometry(g, node)
    return f"Resize not computed in a kernel: {geo}" if isinstance(geo, str) else None

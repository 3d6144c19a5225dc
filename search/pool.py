"""MaxPool and AveragePool as window ops: like a depthwise Conv, a loop over the window of each output
pixel inside a memory-bound kernel (`_Lowerer.pool_value`), max over the taps inside the image (MaxPool), or
their sum over the taps inside (count_include_pad=0) or over the whole window (=1). `geometry` says why a
pool stays with ORT."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import onnx

from ortfuse.customops import scalar
from ortfuse.rewriter.graph import Dim, Graph
from ortfuse.search import conv, ops

POOLS = frozenset({"MaxPool", "AveragePool"})


@dataclass(frozen=True)
class PoolGeom:
    kind: str  # "max" | "avg"
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int]  # top, left (the end pads only set the output size)
    include_pad: bool  # AveragePool: divide by the whole window
    h: Dim
    w: Dim


def geometry(g: Graph, node: onnx.NodeProto) -> Union[PoolGeom, str]:
    x, y = g.tensors.get(node.input[0]), g.tensors.get(node.output[0])
    if x is None or y is None or x.shape is None or y.shape is None or len(x.shape) != 4:
        return "not a 2-D pool of a known shape"
    if len([o for o in node.output if o]) != 1:
        return "MaxPool's Indices output is read"
    auto_pad = scalar.attr_str(node, "auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID") or scalar.attr(node, "storage_order", 0):
        return f"auto_pad={auto_pad} or a column-major storage order"
    kernel = tuple(scalar.attr(node, "kernel_shape") or ())
    stride = tuple(scalar.attr(node, "strides") or (1, 1))
    dil = tuple(scalar.attr(node, "dilations") or (1, 1))
    pads = tuple(scalar.attr(node, "pads") or (0, 0, 0, 0)) if auto_pad == "NOTSET" else (0, 0, 0, 0)
    if len(kernel) != 2 or len(stride) != 2 or len(dil) != 2 or len(pads) != 4 or min(kernel + stride + dil) < 1 \
            or min(pads) < 0:
        return f"kernel {kernel}, strides {stride}, dilations {dil} or pads {pads} of no 2-D pool"
    kind = "max" if node.op_type == "MaxPool" else "avg"
    if scalar.attr(node, "ceil_mode", 0):
        if kind == "avg":
            return "AveragePool with ceil_mode (windows past the padded image change its divisor)"
        # ORT (as PyTorch) drops a last window that would start past the image and its leading pad, which
        # ONNX's shape inference keeps: only a ceil_mode whose windows all start inside is taken
        for size, out, k, s, d, p in zip(x.shape[2:], y.shape[2:], kernel, stride, dil, pads[:2]):
            if not isinstance(size, int) or not isinstance(out, int) or (out - 1) * s >= size + p:
                return "MaxPool with ceil_mode whose last window starts past the image (or of a symbolic size)"
    ceil = bool(scalar.attr(node, "ceil_mode", 0))
    for axis, (size, out) in enumerate(zip(x.shape[2:], y.shape[2:])):
        if isinstance(size, int) and isinstance(out, int):
            span = size + pads[axis] + pads[axis + 2] - dil[axis] * (kernel[axis] - 1) - 1
            if out != (span + (stride[axis] - 1 if ceil else 0)) // stride[axis] + 1:
                return f"output size {out} along axis {axis + 2} is not the pool's of the input's {size}"
        if not isinstance(size, int) and isinstance(out, int):
            # kernels compute the size from the input's at run time; a static one here came from a merge
            # (ORT's symbolic inference takes a broadcast partner's size, as an Expand to [.., 3, ..] after it)
            return f"output size {out} along axis {axis + 2} does not follow from the symbolic input size {size}"
    return PoolGeom(kind, (int(kernel[0]), int(kernel[1])), (int(stride[0]), int(stride[1])),
                    (int(dil[0]), int(dil[1])), (int(pads[0]), int(pads[1])),
                    bool(scalar.attr(node, "count_include_pad", 0)), x.shape[2], x.shape[3])


def window(g: Graph, node: onnx.NodeProto) -> Optional[tuple[int, int]]:
    """(KH, KW) of a window op (depthwise Conv or pool) whose geometry ortfuse reads; None for anything else."""
    if not is_window(g, node):
        return None
    geo = conv.conv_geometry(g, node) if node.op_type in ops.CONV else geometry(g, node)
    if isinstance(geo, str):
        return None
    return (geo.kh, geo.kw) if node.op_type in ops.CONV else geo.kernel


def is_window(g: Graph, node: onnx.NodeProto) -> bool:
    """A window op that joins memory-bound kernels: a depthwise Conv or a pool."""
    return node.op_type in POOLS or conv.is_depthwise(g, node)

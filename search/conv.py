"""2-D convolutions. A dense one (group 1) is an implicit GEMM: per image b, Y[b] (OC x OH*OW) =
W (OC x C*KH*KW) · im2col(X[b]). A depthwise one (group = C = OC) is memory-bound: each output element is a
KH x KW window of its own channel, computed in place by whatever kernel it joins (`lower`'s value walk).

One place reads a Conv node's geometry, so legality (`legal`), cost (`cost`) and lowering agree on what is
fused and how big the GEMM is. Image sizes may be symbolic: an output size is then floor((H + add) / stride) + 1
of the input's (`out_rule`), which kernels compute at run time (the fused node's `sym_derived`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from ortfuse.customops import scalar
from ortfuse.rewriter.graph import Dim, Graph
from ortfuse.search import ops


@dataclass(frozen=True)
class ConvGeom:
    batch: Dim
    c: int  # input channels
    h: Dim
    w: Dim
    oc: int  # output channels
    kh: int
    kw: int
    oh: Dim
    ow: Dim
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int]  # top, left (bottom/right padding only shows in OH, OW)
    depthwise: bool = False  # group = C = OC: weight [C, 1, KH, KW]
    pad_end: tuple[int, int] = (0, 0)  # bottom, right

    @property
    def k(self) -> int:
        return (1 if self.depthwise else self.c) * self.kh * self.kw

    @property
    def static_image(self) -> bool:
        return all(isinstance(d, int) for d in (self.h, self.w, self.oh, self.ow))

    @property
    def pixels(self) -> int:
        """OH * OW of a static image (`pixels_at` for any)."""
        assert isinstance(self.oh, int) and isinstance(self.ow, int), "symbolic image size"
        return self.oh * self.ow

    def pixels_at(self, hint: Callable[[Dim], int]) -> int:
        return hint(self.oh) * hint(self.ow)

    def out_rule(self, axis: int) -> tuple[int, int]:
        """(add, div) with output size floor((input size + add) / div) + 1 along image axis 0 (H) or 1 (W)."""
        k = (self.kh, self.kw)[axis]
        return self.pad[axis] + self.pad_end[axis] - self.dilation[axis] * (k - 1) - 1, self.stride[axis]

    @property
    def pointwise(self) -> bool:
        """1x1, stride 1, no padding on any side, static image: im2col(X[b]) is X[b] itself, a row-major
        C x H*W matrix."""
        return self.static_image and (self.kh, self.kw, self.stride, self.pad, self.oh, self.ow) == (
            1, 1, (1, 1), (0, 0), self.h, self.w)

    @property
    def padded(self) -> bool:
        """Some tap of some output pixel falls outside the image (reads as zero). On a symbolic image:
        whenever any side is padded."""
        if not self.static_image:
            return self.pad != (0, 0) or self.pad_end != (0, 0)
        reach_h = (self.oh - 1) * self.stride[0] + (self.kh - 1) * self.dilation[0] - self.pad[0]
        reach_w = (self.ow - 1) * self.stride[1] + (self.kw - 1) * self.dilation[1] - self.pad[1]
        return self.pad != (0, 0) or reach_h >= self.h or reach_w >= self.w


def conv_geometry(g: Graph, node) -> Union[ConvGeom, str]:
    """The Conv's geometry, or why ortfuse does not run it as an implicit GEMM."""
    x, w, y = (g.tensors.get(t) for t in (node.input[0], node.input[1], node.output[0]))
    if x is None or w is None or y is None or x.shape is None or w.shape is None or y.shape is None:
        return "shapes of the Conv's data, weight or output are unknown"
    if len(x.shape) != 4 or len(w.shape) != 4 or len(y.shape) != 4:
        return f"a {len(x.shape) - 2}-D convolution; ortfuse fuses 2-D convolutions only"
    group = int(scalar.attr(node, "group", 1))
    auto_pad = scalar.attr_str(node, "auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID"):
        return f"auto_pad={auto_pad}: left to ORT"
    dims = (x.shape[1], *w.shape, y.shape[1])
    if not all(isinstance(d, int) for d in dims):
        return "channels and kernel sizes must be static"
    _, c, h, wd = x.shape
    oc, wc, kh, kw = w.shape
    depthwise = group > 1 and group == c == oc and wc == 1
    if group != 1 and not depthwise:
        return f"grouped convolution (group={group}, {c} -> {oc} channels): left to ORT (cuDNN)"
    if wc * group != c:
        return f"weight has {wc} input channels per group, the data has {c}"
    if y.shape[1] != oc:
        return f"output has {y.shape[1]} channels, the weight {oc}"
    stride = tuple(scalar.attr(node, "strides") or (1, 1))
    dil = tuple(scalar.attr(node, "dilations") or (1, 1))
    pads = tuple(scalar.attr(node, "pads") or (0, 0, 0, 0)) if auto_pad == "NOTSET" else (0, 0, 0, 0)
    if len(stride) != 2 or len(dil) != 2 or len(pads) != 4 or min(stride + dil) < 1 or min(pads) < 0:
        return f"strides {stride}, dilations {dil} or pads {pads} are not those of a 2-D convolution"
    ks = scalar.attr(node, "kernel_shape")
    if ks is not None and tuple(ks) != (kh, kw):
        return f"kernel_shape {tuple(ks)} differs from the weight's {(kh, kw)}"
    geo = ConvGeom(x.shape[0], c, h, wd, oc, kh, kw, y.shape[2], y.shape[3], (int(stride[0]), int(stride[1])),
                   (int(dil[0]), int(dil[1])), (int(pads[0]), int(pads[1])), depthwise, (int(pads[2]), int(pads[3])))
    want: list[Dim] = []
    for axis, (size, out) in enumerate(((h, y.shape[2]), (wd, y.shape[3]))):
        add, div = geo.out_rule(axis)
        if isinstance(size, int):
            want.append((size + add) // div + 1)
            if want[-1] < 1:
                return f"the kernel does not fit the padded {h}x{wd} image"
        elif isinstance(out, int) or (out == size and (add, div) != (-1, 1)):
            # kernels compute the size from the input's at run time; an inferred size must not contradict it
            return f"output size {out} along axis {axis + 2} does not follow from the symbolic input size {size}"
        else:
            want.append(out)
    if tuple(y.shape[1:]) != (oc, *want):
        return f"output shape {tuple(y.shape)} is not the convolution's (batch, {oc}, {want[0]}, {want[1]})"
    return geo


def is_depthwise(g: Graph, node) -> bool:
    if node.op_type != "Conv":
        return False
    geo = conv_geometry(g, node)
    return not isinstance(geo, str) and geo.depthwise


def is_anchor(g: Graph, node) -> bool:
    """A compute-bound anchor (one per GEMM region): MatMul, Gemm or a dense Conv. A depthwise Conv is
    memory-bound and joins kernels like an element-wise op."""
    return node.op_type in ops.ANCHORS and not is_depthwise(g, node)


def direct_operands(geo: ConvGeom, esize: int) -> bool:
    """Both GEMM operands copied by cp.async: a static 1x1 convolution with 16-byte aligned weight and image
    rows."""
    return geo.pointwise and (geo.k * esize) % 16 == 0 and (geo.pixels * esize) % 16 == 0

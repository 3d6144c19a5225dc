"""Pad as an index op: each output element reads its input at the coordinate less the leading pad, or is
the pad value outside it (constant mode), or reads the nearest edge (edge) or the mirror image (reflect).
`PadGeom` is what the lowering needs; `geometry` says why a Pad stays with ORT."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np
import onnx

from ortfuse.customops import scalar
from ortfuse.rewriter.graph import Dim, Graph


@dataclass(frozen=True)
class PadGeom:
    mode: str  # "constant" | "edge" | "reflect"
    begins: tuple[int, ...]  # per axis, negative: a crop
    ends: tuple[int, ...]
    value: float  # constant mode's fill
    in_shape: tuple[Dim, ...]


def geometry(g: Graph, node: onnx.NodeProto) -> Union[PadGeom, str]:
    """The Pad's geometry, or why it is not computed in a kernel."""
    mode = scalar.attr_str(node, "mode", "constant")
    if mode not in ("constant", "edge", "reflect"):
        return f"mode '{mode}'"
    in_shape = g.tensors[node.input[0]].shape
    if in_shape is None:
        return "input shape unknown"
    rank = len(in_shape)
    if g.opset < 11:
        pads = scalar.attr(node, "pads")
        value = float(scalar.attr(node, "value", 0.0))
        axes = list(range(rank))
    else:
        ins = list(node.input) + [""] * (4 - len(node.input))
        if any(t and t not in g.constants for t in ins[1:4]):
            return "its pads, value or axes are computed at run time"
        pads = np.asarray(g.constants[ins[1]]).reshape(-1).tolist() if ins[1] else None
        value = float(np.asarray(g.constants[ins[2]]).reshape(-1)[0]) if ins[2] else 0.0
        axes = [int(a) % rank for a in np.asarray(g.constants[ins[3]]).reshape(-1)] if ins[3] else list(range(rank))
    if pads is None or len(pads) != 2 * len(axes):
        return "pads missing or of the wrong length"
    begins, ends = [0] * rank, [0] * rank
    for k, a in enumerate(axes):
        begins[a], ends[a] = int(pads[k]), int(pads[k + len(axes)])
    if mode == "reflect" and any((b or e) and not (isinstance(in_shape[a], int) and max(b, e) < in_shape[a])
                                 for a, (b, e) in enumerate(zip(begins, ends))):
        return "reflect pads as wide as the axis, or of a symbolic axis"
    if mode != "constant" and any(b < 0 or e < 0 for b, e in zip(begins, ends)):
        return "negative pads outside constant mode"
    return PadGeom(mode, tuple(begins), tuple(ends), value, tuple(in_shape))

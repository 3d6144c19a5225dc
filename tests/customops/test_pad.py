"""Pad as an index op (search/pad.py, `_Lowerer.pad_value`): constant (any fill, crops too), edge and reflect
modes, pads on any axis, fused with the op it feeds and checked in CPU emulation against ORT CPU.
Tolerances: fp32 1e-5, fp16 1e-2 normwise."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, fused_parity, model, node, vi
from ortfuse.customops.target import for_cc
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import plan

F, H = TP.FLOAT, TP.FLOAT16
NP = {F: np.float32, H: np.float16}


def _padded(mode: str, pads, dt: int, value: float = 0.25, opset: int = 18):
    ins = ["x", "p"] + (["v"] if mode == "constant" else [])
    inits = [const("p", pads, np.int64)] + ([const("v", value, NP[dt])] if mode == "constant" else [])
    return model([node("Pad", ins, ["q"], mode=mode), node("Relu", ["q"], ["out"])],
                 [vi("x", dt, ["n", 3, 5, 6])], [vi("out", dt, None)], inits, opset=opset)


@pytest.mark.parametrize("mode,dt", [("constant", F), ("edge", F), ("reflect", F), ("constant", H)])
@pytest.mark.parametrize("pads", [[0, 0, 1, 2, 0, 0, 3, 0], [0, 1, 0, 0, 0, 0, 2, 1]], ids=["hw", "channels"])
def test_modes(mode, dt, pads):
    fused_parity(_padded(mode, pads, dt), {}, {"x": (2, 3, 5, 6)}, ("pointwise",))


def test_negative_pads_crop():
    fused_parity(_padded("constant", [0, 0, -1, 2, 0, 0, 1, -2], F, value=-3.0), {}, {"x": (2, 3, 5, 6)},
                 ("pointwise",))


@pytest.mark.parametrize("mode,pads,why", [("wrap", [0, 0, 1, 1, 0, 0, 1, 1], "mode 'wrap'"),
                                           ("reflect", [0, 0, 5, 0, 0, 0, 0, 0], "as wide as the axis")])
def test_what_stays_with_ort(mode, pads, why):
    m = _padded(mode, pads, F, opset=19)
    g = build_graph(m, {})
    p = plan(g, for_cc(90))
    assert not any(g.nodes[i].op_type == "Pad" for r in p.regions for i in r.nodes)
    assert any(why in r.reason for r in p.rejects), [str(r) for r in p.rejects]

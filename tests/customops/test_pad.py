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


def test_constant_pad_along_a_run_time_axis_reads_only_inside():
    """A zero Pad of an axis of run-time size (a cache that may be empty: ORT may then give a null buffer, and
    emulation passes one) reads the input under the guard that the coordinate is inside it; the output's size
    'p + 3' is a runtime dim. Edge padding of such an axis has nothing to read when it is empty: ORT's."""
    def build(mode):
        return model([node("Pad", ["past", "pads"], ["pp"], mode=mode), node("Relu", ["pp"], ["z"])],
                     [vi("past", TP.FLOAT, ["b", "p", 16])], [vi("z", TP.FLOAT, None)],
                     [const("pads", np.array([0, 2, 0, 0, 1, 0]), np.int64)])
    for p in (3, 0):
        res = fused_parity(build("constant"), None, {"past": (2, p, 16)}, ["pointwise"])
    assert "ofz::load_arg_if<4>(inb" in res.kernels[0].compiled.source
    from ortfuse.api import compile_model
    res = compile_model(build("edge"), None, "sm_90")
    assert "Pad" in {n.op_type for n in res.model.graph.node}
    assert any("edge padding along an axis of run-time size" in str(r) for r in res.plan.refusals)

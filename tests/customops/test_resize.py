"""Resize as an index op (search/resize.py, `_Lowerer.resize_value`): nearest (every nearest_mode) and bilinear,
every coordinate_transformation_mode ORT implements but tf_crop_and_resize, by scales or by sizes (constant,
or computed at run time from the input's shape as SegFormer's decode head does), up and down; fused with
the Add it feeds and checked in CPU emulation against ORT CPU. Tolerances: fp32 1e-5, fp16 1e-2 normwise."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, fused_parity, model, node, resized, vi
from ortfuse.customops.target import for_cc
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import plan

F, H = TP.FLOAT, TP.FLOAT16
NP = {F: np.float32, H: np.float16}
CTM = ("half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners")


@pytest.mark.parametrize("ctm,nearest", [(c, "round_prefer_floor") for c in CTM] + [
    ("half_pixel", m) for m in ("round_prefer_ceil", "floor", "ceil")])
def test_nearest(ctm, nearest):
    # 2x up (FPNs, YOLO) and 1.5 / 0.6 (coordinates landing near half pixels), in one model each
    for scales in ([1, 1, 2, 2], [1, 1, 1.5, 0.6]):
        m, at = resized("nearest", ctm, nearest, F, scales=scales)
        fused_parity(m, {}, at, ("pointwise",))


@pytest.mark.parametrize("ctm", CTM)
@pytest.mark.parametrize("dt", [F, H])
def test_bilinear(ctm, dt):
    for scales in ([1, 1, 2, 2], [1, 1, 1.5, 0.6]):
        m, at = resized("linear", ctm, "floor", dt, scales=scales)
        fused_parity(m, {}, at, ("pointwise",))


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_by_sizes_up_and_down(mode):
    m, _ = resized(mode, "half_pixel", "round_prefer_floor", H, sizes=[2, 3, 9, 1])
    fused_parity(m, {}, None, ("pointwise",))


def test_sizes_computed_at_run_time_from_the_input():
    # SegFormer's decode head: Resize(x, sizes=Concat(Shape(x)[:2], [8, 8])), bilinear, then the Concat it
    # feeds; the sizes are rebuilt in the fused node's function from the input's shape
    nodes = [node("Shape", ["x"], ["s"]), node("Slice", ["s", "z", "two"], ["nc"]),
             node("Concat", ["nc", "hw"], ["sz"], axis=0),
             node("Resize", ["x", "", "", "sz"], ["r"], mode="linear", coordinate_transformation_mode="half_pixel"),
             node("Concat", ["r", "y"], ["out"], axis=1)]
    inits = [const("z", [0], np.int64), const("two", [2], np.int64), const("hw", [8, 8], np.int64)]
    m = model(nodes, [vi("x", F, ["n", 3, 4, 4]), vi("y", F, ["n", 2, 8, 8])], [vi("out", F, None)], inits)
    res = fused_parity(m, {}, {"x": (2, 3, 4, 4), "y": (2, 2, 8, 8)}, ("pointwise",))
    assert not [n.op_type for n in res.model.graph.node if n.domain != "ortfuse"]  # the shape ops went too


@pytest.mark.parametrize("attrs,why", [({"mode": "cubic"}, "mode 'cubic'"),
                                       ({"coordinate_transformation_mode": "tf_crop_and_resize"},
                                        "coordinate_transformation_mode"),
                                       ({"mode": "linear", "scales": [2, 1, 1, 1]}, "other than H and W")])
def test_what_stays_with_ort(attrs, why):
    attrs = dict(attrs)
    scales = attrs.pop("scales", [1, 1, 2, 2])
    nodes = [node("Resize", ["x", "", "sc"], ["r"], **attrs), node("Relu", ["r"], ["out"])]
    m = model(nodes, [vi("x", F, [2, 3, 4, 4])], [vi("out", F, None)], [const("sc", scales, np.float32)])
    g = build_graph(m, {})
    p = plan(g, for_cc(90))
    assert not any(g.nodes[i].op_type == "Resize" for r in p.regions for i in r.nodes)
    assert any(why in r.reason for r in p.rejects), [str(r) for r in p.rejects]

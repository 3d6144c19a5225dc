"""MaxPool and AveragePool as window ops (search/pool.py, `_Lowerer.pool_value`): strides, pads, dilations,
MaxPool's ceil_mode, AveragePool with and without the padding counted; fused with the op they feed (and
PoolFormer's pool(x) - x) and checked in CPU emulation against ORT CPU. Tolerances: fp32 1e-5, fp16 1e-2."""
from __future__ import annotations

import pytest
from onnx import TensorProto as TP

from helpers import fused_parity, model, node, vi
from ortfuse.customops.target import for_cc
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import plan

F, H = TP.FLOAT, TP.FLOAT16
CASES = [("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),  # ResNet's stem
         ("MaxPool", dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2])),  # YOLO's SPPF
         ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
         ("MaxPool", dict(kernel_shape=[2, 2], dilations=[2, 2])),
         ("AveragePool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0)),  # PoolFormer's
         ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),
         ("AveragePool", dict(kernel_shape=[2, 2], strides=[2, 2]))]


def _id(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        return "-".join(f"{k}{''.join(map(str, x)) if isinstance(x, list) else x}" for k, x in v.items())
    return "fp16" if v == H else "fp32"


@pytest.mark.parametrize("op,attrs,dt", [(o, a, F) for o, a in CASES] + [(o, a, H) for o, a in (CASES[0], CASES[4])],
                         ids=_id)
def test_pools(op, attrs, dt):
    m = model([node(op, ["x"], ["p"], **attrs), node("Relu", ["p"], ["out"])], [vi("x", dt, ["n", 3, 9, 8])],
              [vi("out", dt, None)], [], opset=19)
    fused_parity(m, {}, {"x": (2, 3, 9, 8)}, ("pointwise",))


def test_poolformer_token_mixer_is_one_kernel():
    # x + (pool(x) - x): the pool reads x at its window, the rest at the pixel
    m = model([node("AveragePool", ["x"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0),
               node("Sub", ["p", "x"], ["d"]), node("Add", ["x", "d"], ["out"])],
              [vi("x", F, ["n", 8, 7, 7])], [vi("out", F, None)], [], opset=19)
    res = fused_parity(m, {}, {"x": (2, 8, 7, 7)}, ("pointwise",))
    assert not [n for n in res.model.graph.node if n.domain != "ortfuse"]


@pytest.mark.parametrize("op,attrs,why", [
    ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), "ceil_mode"),
    ("MaxPool", dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER"), "auto_pad"),
    # a last window starting in the padding: ORT drops it, ONNX's shape inference keeps it
    ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1), "starts past the image")])
def test_what_stays_with_ort(op, attrs, why):
    m = model([node(op, ["x"], ["p"], **attrs), node("Relu", ["p"], ["out"])], [vi("x", F, [2, 3, 9, 8])],
              [vi("out", F, None)], [], opset=19)
    g = build_graph(m, {})
    p = plan(g, for_cc(90))
    assert not any(g.nodes[i].op_type == op for r in p.regions for i in r.nodes)
    assert any(why in r.reason for r in p.rejects), [str(r) for r in p.rejects]


def test_a_symbolic_pool_size_merged_into_a_broadcast_stays_with_ort():
    # fuzz seed 372 (session 28): ORT's symbolic shape inference takes the size of the Expand target's 3 for
    # the pool's output along H (the broadcast it sees needs 3 or 1; at run time it is 1), so a kernel built on
    # it would iterate 3 rows. The inferred static size contradicts the symbolic input's: the pool is refused,
    # and nothing is fused on the merged size; the model still matches ORT
    from onnx import numpy_helper
    import numpy as np
    m = model([node("MaxPool", ["x"], ["p"], kernel_shape=[2, 3], strides=[2, 2], pads=[1, 2, 1, 2]),
               node("Neg", ["p"], ["q"]), node("Expand", ["q", "to"], ["out"])],
              [vi("x", F, ["n", 4, "h", "w"])], [vi("out", F, None)],
              [numpy_helper.from_array(np.array([1, 1, 3, 1], np.int64), "to")], opset=19)
    g = build_graph(m, {})
    assert g.tensors["p"].shape[2] == 3  # the merge this guards against (if ORT's tool stops it, drop the test)
    res = fused_parity(m, {}, {"x": (2, 4, 1, 3)}, ())
    assert not res.plan.regions
    assert any("does not follow from the symbolic input size" in r.reason for r in res.plan.rejects), \
        [str(r) for r in res.plan.rejects]

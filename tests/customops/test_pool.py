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

"""rewriter.qdq: the quantize/dequantize chains ORT requantizes at a scale of its own, found as ORT finds them."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from ortfuse.api import compile_model
from ortfuse.check import check_models
from ortfuse.report import summary
from ortfuse.rewriter.qdq import merged_pairs, new_merges
from tests.helpers import const, model, node, vi

X = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 2


def chain(s2: float = 0.031, z2: int = 7, reader: bool = False, middle: str = "Cast", fed: bool = False,
          static: bool = True) -> onnx.ModelProto:
    """x -> Q1 -> DQ1 -> `middle` -> Q2 -> DQ2 -> Relu; with `reader`, DQ1 also feeds a Reshape target through
    its Shape (a reader the rewriter folds away where the shape is static)."""
    mid = {"Cast": node("Cast", ["d1"], ["c"], to=TP.FLOAT), "Identity": node("Identity", ["d1"], ["c"]),
           "Relu": node("Relu", ["d1"], ["c"])}[middle]
    nodes = [node("QuantizeLinear", ["x", "s1", "z1"], ["q1"]), node("DequantizeLinear", ["q1", "s1", "z1"], ["d1"]),
             mid, node("QuantizeLinear", ["c", "s2", "z2"], ["q2"]), node("DequantizeLinear", ["q2", "s2", "z2"], ["d2"])]
    if reader:
        nodes += [node("Shape", ["d1"], ["sh"]), node("Reshape", ["d2", "sh"], ["r"]), node("Relu", ["r"], ["y"])]
    else:
        nodes.append(node("Relu", ["d2"], ["y"]))
    inits = [const("s1", 0.05), const("z1", 0, np.int8), const("s2", s2), const("z2", z2, np.int8)]
    inputs = [vi("x", TP.FLOAT, list(X.shape) if static else ["n", 64])]
    if fed:  # an initializer a user may feed (IR >= 4): not a constant to ORT
        inputs.append(vi("s2", TP.FLOAT, []))
    return model(nodes, inputs, [vi("y", TP.FLOAT, None)], inits)


def _ort_merges(m: onnx.ModelProto) -> bool:
    """ORT's own answer: does ORT_ENABLE_BASIC change the model's result from ORT_DISABLE_ALL's?"""
    outs = []
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        outs.append(ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
                    .run(None, {"x": X})[0])
    return not np.array_equal(*outs)


@pytest.mark.parametrize("kw, merged", [
    ({}, True),  # different scales and zero points, a Cast to the same type between: ORT removes it first
    ({"middle": "Identity"}, True),
    ({"reader": True, "static": False}, False),  # DQ1 has another reader
    ({"reader": True}, True),  # ... which ORT's constant folding removes first: the shape it reads is static
    ({"s2": 0.05, "z2": 0}, False),  # the same parameters: ORT merges, exactly
    ({"middle": "Relu"}, False),  # an op between the pairs
    ({"fed": True}, False),  # a scale a user may feed
])
def test_merges_are_found_as_ort_makes_them(kw, merged):
    m = chain(**kw)
    assert bool(merged_pairs(m, lambda t: kw.get("static", True))) == merged
    assert _ort_merges(m) == merged  # the finder and ORT agree


def test_a_merge_the_rewrite_makes_is_said_and_checked_as_written():
    # the rewrite writes the Reshape's target as a constant, so DQ1 loses its Shape reader (a run-time shape,
    # which ORT does not fold) and ORT requantizes the output's chain, not the input's: optimize says so, and
    # check compares the two models as written
    src = chain(reader=True, static=False)
    res = compile_model(src)
    assert len(res.requantized) == 1 and "'DequantizeLinear_d1' (scale 0.05, zero point 0)" in res.requantized[0]
    assert new_merges(src, res.model) == res.requantized
    assert "quantization:         ORT merges 1 chains" in summary(res)
    assert _ort_merges(res.model) and not _ort_merges(src)
    rep = check_models(src, res.model, input_shapes={"x": list(X.shape)})
    assert rep.ok and "ORT merges 1 chains" in rep.model[0].name and rep.model[0].max_abs == 0


def test_a_merge_ort_makes_in_both_models_is_not_said():
    # a static shape: ORT folds the Shape read in the input too, and merges the pairs of both models alike
    src = chain(reader=True)
    res = compile_model(src)
    assert res.requantized == () and "quantization:" not in summary(res)
    assert _ort_merges(src) and _ort_merges(res.model)
    rep = check_models(src, res.model)
    assert rep.ok and rep.model[0].name == "y"

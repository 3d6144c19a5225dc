"""check on quantized models: a kernel's fp32 result within its tolerance of ORT's may round to the other step at a
QuantizeLinear; the outputs are then judged from one quantized tensor to the next (`check._judged_step_by_step`)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP, helper, numpy_helper

from ortfuse.check import check_models
from helpers import model

N = 256


def _quantized(nudge: float = 0.0) -> onnx.ModelProto:
    """x * w -> Q -> DQ -> * 3 + x -> y; `nudge` scales x * w by 1 + nudge before the Q, standing for a kernel's
    rounding (the Q's output keeps its name, as ORT's Q does in an optimized model)."""
    inits = [numpy_helper.from_array(np.array(4.0 / 127, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(np.array(1.7, np.float32), "w"),
             numpy_helper.from_array(np.array(3.0, np.float32), "g"),
             numpy_helper.from_array(np.array(1.0 + nudge, np.float32), "nudge")]
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"])]
    if nudge:
        nodes.append(helper.make_node("Mul", ["xw", "nudge"], ["xw_nudged"]))
    nodes += [helper.make_node("QuantizeLinear", ["xw_nudged" if nudge else "xw", "s", "z"], ["q"], name="Q"),
              helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
              helper.make_node("Mul", ["d", "g"], ["dg"]), helper.make_node("Add", ["dg", "x"], ["y"])]
    return model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [N, N])],
                 [helper.make_tensor_value_info("y", TP.FLOAT, [N, N])], inits)


def test_a_step_off_where_the_float_input_agrees_passes() -> None:
    rep = check_models(_quantized(), _quantized(nudge=4e-6))
    (d,) = rep.model
    assert d.ok and "quantized: given the optimized model's 1 quantized tensors" in d.name, d.line()
    flips = int(d.name.split("of which ")[1].split(" ")[0])
    assert flips > 0, d.line()  # (the nudge moved some elements across a boundary: the plain comparison failed)


def test_a_float_input_off_by_more_than_the_tolerance_fails_and_names_its_quantizer() -> None:
    rep = check_models(_quantized(), _quantized(nudge=1e-3))
    (d,) = rep.model
    assert not d.ok and "the input of QuantizeLinear 'Q'" in d.name, d.line()


def test_an_output_wrong_after_the_last_quantizer_fails() -> None:
    wrong = _quantized(nudge=4e-6)
    for t in wrong.graph.initializer:
        if t.name == "g":
            t.CopyFrom(numpy_helper.from_array(np.array(3.01, np.float32), "g"))
    (d,) = check_models(_quantized(), wrong).model
    assert not d.ok and "even given the optimized model's quantized tensors" in d.name, d.line()

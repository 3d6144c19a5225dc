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


def test_a_kernel_holding_every_quantizer_is_compared_op_by_op() -> None:
    """DQ(a) + DQ(b) -> Q, both int8: ORT's CPU EP fuses it into a QLinearAdd, which requantizes otherwise (a step
    apart in 72 of 65,536 elements at these scales); the CUDA EP, whose arithmetic the kernel follows, runs it op
    by op. The optimized model's main graph then has no QuantizeLinear left: the kernel is still compared with
    the op-by-op reference (`session.disable_quant_qdq`), and is exact."""
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    s = lambda name, v: numpy_helper.from_array(np.array(v, np.float32), name)  # noqa: E731
    nodes = [helper.make_node("DequantizeLinear", ["a", "sa"], ["da"]),
             helper.make_node("DequantizeLinear", ["b", "sb"], ["db"]),
             helper.make_node("Add", ["da", "db"], ["m"]), helper.make_node("QuantizeLinear", ["m", "sy", "zy"], ["y"])]
    m = model(nodes, [helper.make_tensor_value_info(x, TP.INT8, [N, N]) for x in ("a", "b")],
              [helper.make_tensor_value_info("y", TP.INT8, [N, N])],
              [s("sa", 0.0173), s("sb", 0.0291), s("sy", 0.04), numpy_helper.from_array(np.array(0, np.int8), "zy")])
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert not [n for n in res.model.graph.node if n.op_type == "QuantizeLinear"]
    rep = check_models(m, res.model, emulate=True)
    assert rep.ok and rep.kernels, "\n".join(rep.lines())
    assert all(d.max_abs == 0 for _, ds in rep.kernels for d in ds), "\n".join(rep.lines())

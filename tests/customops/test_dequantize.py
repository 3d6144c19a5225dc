"""DequantizeLinear and QuantizeLinear in fused kernels: per tensor and per axis, 8-bit and int32 data, fp32 and
fp16 scales, checked in CPU emulation against ORT CPU on the original model, where a dequantized value and a
quantized one must be exact."""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, helper, numpy_helper

from ortfuse.api import compile_model
from ortfuse.check import check_models
from ortfuse.config import Options
from helpers import fused_parity, model as _model, quantized_add, requantized

RNG = np.random.default_rng(7)


def _ints(shape, dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, int(info.max) + 1, shape).astype(dtype)


def _exact(rep) -> None:
    """Every kernel output equals ORT's bit for bit (the check's own tolerance is looser)."""
    assert rep.ok, "\n".join(rep.lines())
    assert rep.kernels and all(d.max_abs == 0 for _, ds in rep.kernels for d in ds), "\n".join(rep.lines())


def _optimized(m: onnx.ModelProto):
    return compile_model(m, {}, "sm_90", options=Options(archs=(90,)))


@pytest.mark.parametrize("dtype,zero_point", [(np.int8, True), (np.uint8, True), (np.int8, False)])
def test_a_quantized_add_is_one_exact_kernel(dtype, zero_point) -> None:
    m = quantized_add(dtype, zero_point)
    res = fused_parity(m, {}, {"x": [3, 6, 40]}, ["pointwise"])
    (r,) = res.plan.regions  # (x's QuantizeLinear too: x is read as ORT's Q reads it, so q is exact)
    assert sorted(res.graph.nodes[i].op_type for i in r.nodes) == ["Add", "DequantizeLinear", "DequantizeLinear",
                                                                   "QuantizeLinear"]
    _exact(check_models(m, res.model, emulate=True, input_shapes={"x": [3, 6, 40]}))


def test_an_fp16_scale_dequantizes_to_fp16() -> None:
    """ORT stores each dequantized tensor in fp16 before the Add reads it: so does the kernel (the Add of the
    unrounded fp32 products would be an fp16 ulp off now and then). ORT CPU's fp16 Add is itself an ulp off a
    correctly rounded sum now and then, so the CPU shows this in the source only; the CUDA EP's is exact
    (`test_dequantized_values_match_the_cuda_ep_exactly`, tests/runtime/test_gpu_kernels.py)."""
    m = quantized_add(fp16=True)
    res = fused_parity(m, {}, {"x": [2, 6, 40]}, ["pointwise"])
    assert res.model.graph.output[0].type.tensor_type.elem_type == TP.FLOAT16
    src = res.kernels[0].compiled.source
    assert src.count("ofz::round_f16(__fmul_rn(") == src.count("__fmul_rn("), src


def test_an_output_dtype_makes_an_fp16_result_of_an_fp32_scale() -> None:
    """Opset 23's `output_dtype`: fp16 out of fp32 scales (ORT's symbolic shape inference types it fp32 unless
    told: `rewriter._infer._dequantize_linear`), per axis, times an fp16 activation."""
    shape = [3, 8, 64]
    inits = [numpy_helper.from_array(_ints(shape, np.int8), "w"),
             numpy_helper.from_array((RNG.random(8) * 0.05 + 0.01).astype(np.float32), "s")]
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["dw"], axis=1, output_dtype=TP.FLOAT16),
             helper.make_node("Mul", ["x", "dw"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT16, shape)],
               [helper.make_tensor_value_info("y", TP.FLOAT16, None)], inits, opset=23)
    res = fused_parity(m, {}, {}, ["pointwise"])
    assert "ofz::round_f16(__fmul_rn(" in res.kernels[0].compiled.source


def test_the_dequantized_product_is_never_contracted() -> None:
    """On the GPU a product feeding an Add may become one FMA, which rounds once where ORT rounds twice: a
    QuantizeLinear after it could then land a step away. The product is __fmul_rn, which NVRTC never contracts."""
    res = _optimized(quantized_add())
    (k,) = res.kernels
    src = k.compiled.source
    assert "__fmul_rn(" in src and " * 0.0173" not in src and " * 0.0291" not in src, src


@pytest.mark.parametrize("axis,shape", [(1, [2, 5, 3, 7]), (-1, [2, 5, 3, 7]), (0, [2, 5, 3, 7]), (3, [2, 3, 2, 64])])
def test_per_axis_scales_are_read_along_their_axis(axis: int, shape: list[int]) -> None:
    """A constant weight dequantized per channel (axis 1 of [N, C, H, W], as ORT's quantizer does a Conv's
    along its output channels), times an activation; per-axis scales of the innermost axis (read as vectors
    where it is 64 wide) and the leading one too. Broadcasting would align a [C] scale with the innermost axis
    instead."""
    n = shape[axis]
    inits = [numpy_helper.from_array(_ints(shape, np.int8), "w"),
             numpy_helper.from_array((RNG.random(n) * 0.05 + 0.01).astype(np.float32), "s"),
             numpy_helper.from_array(_ints([n], np.int8) // 8, "z")]
    nodes = [helper.make_node("DequantizeLinear", ["w", "s", "z"], ["dw"], axis=axis),
             helper.make_node("Mul", ["x", "dw"], ["p"]), helper.make_node("Relu", ["p"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, shape)],
               [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = fused_parity(m, {}, {}, ["pointwise"])
    assert "DequantizeLinear" in [res.graph.nodes[i].op_type for i in res.plan.regions[0].nodes]
    _exact(check_models(m, res.model, emulate=True))


def test_an_int32_bias_dequantizes_exactly() -> None:
    """An int32 bias with its per-channel scale (the QDQ form of a Conv's bias), added to an activation."""
    inits = [numpy_helper.from_array(RNG.integers(-2 ** 20, 2 ** 20, [16]).astype(np.int32), "b"),
             numpy_helper.from_array((RNG.random(16) * 1e-4).astype(np.float32), "s")]
    nodes = [helper.make_node("DequantizeLinear", ["b", "s"], ["db"], axis=0),
             helper.make_node("Add", ["x", "db"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 16])],
               [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = fused_parity(m, {}, {"x": [9, 16]}, ["pointwise"])
    _exact(check_models(m, res.model, emulate=True, input_shapes={"x": [9, 16]}))


def test_a_convolutions_int32_bias_is_dequantized_on_the_device() -> None:
    """quantize_static's Conv: its int8 weight and int32 bias dequantized per output channel. ORT's CUDA EP has
    no int32 DequantizeLinear, so stock ORT runs the bias's on the CPU EP every call: it becomes a kernel of its
    own (exact), where the weight's, which the CUDA EP runs, stays ORT's (one kernel for one)."""
    w = _ints([8, 4, 3, 3], np.int8)
    inits = [numpy_helper.from_array(w, "w"),
             numpy_helper.from_array((RNG.random(8) * 0.01 + 0.002).astype(np.float32), "sw"),
             numpy_helper.from_array(RNG.integers(-2 ** 20, 2 ** 20, [8]).astype(np.int32), "b"),
             numpy_helper.from_array((RNG.random(8) * 1e-4).astype(np.float32), "sb")]
    nodes = [helper.make_node("DequantizeLinear", ["w", "sw"], ["dw"], axis=0),
             helper.make_node("DequantizeLinear", ["b", "sb"], ["db"], axis=0),
             helper.make_node("Conv", ["x", "dw", "db"], ["y"], pads=[1, 1, 1, 1])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 4, 10, 10])],
               [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = _optimized(m)
    fused = {res.graph.nodes[i].output[0]: r.kind for r in res.plan.regions for i in r.nodes}
    assert fused.get("db") == "pointwise" and "dw" not in fused, fused
    assert "region at DequantizeLinear 'dw': replaces a single ORT kernel" in "\n".join(map(str, res.plan.refusals))
    _exact(check_models(m, res.model, emulate=True, input_shapes={"x": [2, 4, 10, 10]}))


@pytest.mark.parametrize("cap", [None, 64])
def test_biases_of_one_size_are_dequantized_by_one_kernel(cap, monkeypatch) -> None:
    """Four 1x1 Convs, each with its int8 weight and int32 bias: the three 8-channel biases, computed from
    constants alone, are one kernel (one launch where ORT ran three CPU nodes and three copies), the 16-channel
    one another; at a cap of 64 bytes of results a kernel the third 8-channel bias (32 bytes) starts a kernel
    of its own. The weights' DQs, which the CUDA EP runs, stay ORT's."""
    from ortfuse.search import regions
    if cap is not None:
        monkeypatch.setattr(regions, "CONSTANT_KERNEL_BYTES", cap)
    inits, nodes, x = [], [], "x"
    for k, oc in enumerate((8, 8, 16, 8)):
        ic = 16 if k == 3 else 8
        inits += [numpy_helper.from_array(_ints([oc, ic, 1, 1], np.int8), f"w{k}"),
                  numpy_helper.from_array((RNG.random(oc) * 0.01 + 0.002).astype(np.float32), f"sw{k}"),
                  numpy_helper.from_array(RNG.integers(-2 ** 20, 2 ** 20, [oc]).astype(np.int32), f"b{k}"),
                  numpy_helper.from_array((RNG.random(oc) * 1e-4).astype(np.float32), f"sb{k}")]
        nodes += [helper.make_node("DequantizeLinear", [f"w{k}", f"sw{k}"], [f"dw{k}"], axis=0),
                  helper.make_node("DequantizeLinear", [f"b{k}", f"sb{k}"], [f"db{k}"], axis=0),
                  helper.make_node("Conv", [x, f"dw{k}", f"db{k}"], [f"c{k}"]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"] if k < 3 else ["y"])]
        x = f"r{k}"
    m = _model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 8, 6, 6])],
               [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = _optimized(m)
    region_of = {res.graph.nodes[i].output[0]: r.id for r in res.plan.regions for i in r.nodes}
    assert region_of.get("db0") is not None and region_of.get("db0") == region_of.get("db1"), region_of
    assert region_of.get("db2") not in (None, region_of["db0"]), region_of
    assert (region_of.get("db3") == region_of["db0"]) == (cap is None), region_of
    assert not {"dw0", "dw1", "dw2", "dw3"} & set(region_of), region_of
    _exact(check_models(m, res.model, emulate=True, input_shapes={"x": [2, 8, 6, 6]}))


def test_a_quantized_embedding_dequantizes_only_the_rows_it_gathers() -> None:
    """Gather of a dequantized table: ORT dequantizes the whole table on every call; the kernel only the rows."""
    inits = [numpy_helper.from_array(_ints([50, 32], np.int8), "table"),
             numpy_helper.from_array(np.array(0.02, np.float32), "s"),
             numpy_helper.from_array(np.array(1, np.int8), "z")]
    nodes = [helper.make_node("DequantizeLinear", ["table", "s", "z"], ["t"]),
             helper.make_node("Gather", ["t", "ids"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("ids", TP.INT64, ["b", "s"])],
               [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = fused_parity(m, {}, {"ids": [2, 9]}, ["pointwise"])
    assert "table" in res.plan.regions[0].inputs  # the 8-bit table itself


def test_a_quantized_image_is_read_by_the_convolution() -> None:
    """DQ -> Conv (its weight dequantized per output channel by ORT) -> Relu: the Conv reads the 8-bit image."""
    w = _ints([8, 4, 3, 3], np.int8)
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "sx"),
             numpy_helper.from_array(np.array(0, np.uint8), "zx"), numpy_helper.from_array(w, "w"),
             numpy_helper.from_array((RNG.random(8) * 0.01 + 0.002).astype(np.float32), "sw"),
             numpy_helper.from_array(np.zeros(8, np.int8), "zw")]
    nodes = [helper.make_node("DequantizeLinear", ["x", "sx", "zx"], ["dx"]),
             helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["dw"], axis=0),
             helper.make_node("Conv", ["dx", "dw"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TP.UINT8, ["n", 4, 10, 10])],
               [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = fused_parity(m, {}, {"x": [2, 4, 10, 10]}, ["gemm"])
    (r,) = res.plan.regions
    assert {res.graph.nodes[i].output[0] for i in r.nodes} == {"dx", "c", "y"}  # the weight's DQ stays ORT's


@pytest.mark.parametrize("middle", ["add", "muladd"])
def test_a_quantized_result_is_exact(middle: str) -> None:
    """The Q joins the kernel, which writes int8: every sum and product before it rounded once (never an FMA),
    x / scale an IEEE division rounded half to even, as ORT computes them."""
    m = requantized(middle)
    res = fused_parity(m, {}, {"a": [37, 48], "b": [37, 48]}, ["pointwise"])
    (r,) = res.plan.regions
    assert "QuantizeLinear" in [res.graph.nodes[i].op_type for i in r.nodes] and r.outputs == ("y",)
    src = res.kernels[0].compiled.source
    assert "ofz::quantize8(" in src and "__fadd_rn(" in src
    assert not re.search(r"const float v\d+ = \(v\d+ [-+*] ", src), src  # no float op an FMA could take
    _exact(check_models(m, res.model, emulate=True, input_shapes={"a": [37, 48], "b": [37, 48]}))


@pytest.mark.parametrize("downstream", [True, False])
def test_a_value_a_quantizer_elsewhere_reads_is_never_contracted(downstream: bool) -> None:
    """DQ(a) * DQ(b) + DQ(a) in one kernel, read by a QuantizeLinear it does not hold (left to ORT: a negative
    scale). On the GPU the product and the sum could become one FMA, an ulp off ORT's two roundings, and the Q
    a step off; they are rounded one by one (`lower.quantized_cone`). Without the Q after it, the kernel keeps
    plain arithmetic."""
    m = requantized("muladd", scale=-0.037)
    if not downstream:  # the float result is the output
        del m.graph.node[-1]
        m.graph.output[0].CopyFrom(helper.make_tensor_value_info("m", TP.FLOAT, ["n", 48]))
    res = _optimized(m)
    (r,) = res.plan.regions
    assert "QuantizeLinear" not in [res.graph.nodes[i].op_type for i in r.nodes] and r.outputs == ("m",)
    src = res.kernels[0].compiled.source
    plain = re.search(r"const float v\d+ = \(v\d+ [-+*] ", src)
    assert (plain is None) == downstream, src
    if downstream:
        assert "__fadd_rn(" in src and src.count("__fmul_rn(") >= 3, src


@pytest.mark.parametrize("middle,fp16,scale,why", [
    ("sigmoid", False, 0.037, "reaches QuantizeLinear 'Q'"),
    ("reciprocal", False, 0.037, "1 / x, which ORT divides the Mul after it by instead"),
    ("add", True, 0.037, "quantizes FLOAT16"),
    ("add", False, float("inf"), "not a finite positive number")])
def test_a_quantizer_stays_orts_where_a_kernel_could_move_a_step(middle, fp16, scale, why) -> None:
    """After an op a kernel computes otherwise than ORT (a Sigmoid; a reciprocal ORT divides by instead), in half
    precision (ORT rounds op by op), or at a scale that makes x / scale NaN (ORT's CPU and CUDA kernels disagree
    there), the Q stays ORT's. The Sigmoid and the reciprocal's Div and Mul then stay ORT's too
    (`legal.inexact_before_quantizers`), and the Q alone would save nothing: the reason matched is theirs."""
    res = _optimized(requantized(middle, fp16, scale))
    fused = [res.graph.nodes[i].op_type for r in res.plan.regions for i in r.nodes]
    assert "QuantizeLinear" not in fused, fused
    said = [str(r) for r in (*res.plan.rejects, *res.plan.refusals)]
    assert any(why in r for r in said), said


def test_a_quantized_residual_stream_crosses_kernels_exactly() -> None:
    """A quantized transformer's residual stream: MatMul -> Q -> DQ -> Add(x) -> Q -> DQ -> MatMul -> Q -> DQ ->
    Add(the earlier DQ) -> Q. The last Q's value is computed in part from a Q in another kernel, which is ORT's
    value exactly (its own cone is exact): it joins its kernel, where before it stayed ORT's."""
    s = lambda name, v: numpy_helper.from_array(np.array(v, np.float32), name)  # noqa: E731
    inits = [numpy_helper.from_array(_ints([32, 32], np.int8), "w1"),
             numpy_helper.from_array(_ints([32, 32], np.int8), "w2"),
             s("sw", 0.01), s("s1", 0.05), s("s2", 0.07), s("s3", 0.04), s("s4", 0.09),
             numpy_helper.from_array(np.array(2, np.int8), "z")]
    dq = lambda x, sc, y: helper.make_node("DequantizeLinear", [x, sc, "z"], [y])  # noqa: E731
    q = lambda x, sc, y: helper.make_node("QuantizeLinear", [x, sc, "z"], [y], name=y)  # noqa: E731
    nodes = [helper.make_node("DequantizeLinear", ["w1", "sw"], ["dw1"]),
             helper.make_node("DequantizeLinear", ["w2", "sw"], ["dw2"]),
             helper.make_node("MatMul", ["x", "dw1"], ["m1"]), q("m1", "s1", "q1"), dq("q1", "s1", "d1"),
             helper.make_node("Add", ["d1", "x"], ["a1"]), q("a1", "s2", "q2"), dq("q2", "s2", "d2"),
             helper.make_node("MatMul", ["d2", "dw2"], ["m2"]), q("m2", "s3", "q3"), dq("q3", "s3", "d3"),
             helper.make_node("Add", ["d3", "d2"], ["a2"]), q("a2", "s4", "q4")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 32])],
               [helper.make_tensor_value_info("q4", TP.INT8, None)], inits)
    res = _optimized(m)
    fused = {res.graph.nodes[i].output[0] for r in res.plan.regions for i in r.nodes}
    assert {"q2", "q4"} <= fused, (sorted(fused), [str(r) for r in res.plan.refusals])
    _exact(check_models(m, res.model, emulate=True, input_shapes={"x": [64, 32]}))


def test_a_division_before_a_copy_is_an_ieee_division() -> None:
    """DQ, DQ -> Add -> Div(6) -> Slice -> Q: the Div reaches the Q through a Slice (an indexing op), and is
    still an IEEE division, not a product with 1/6 (which moved 211 of 4096 x 48 elements a step)."""
    inits = [numpy_helper.from_array(np.array(0.021, np.float32), "sa"),
             numpy_helper.from_array(np.array(0.013, np.float32), "sb"),
             numpy_helper.from_array(np.array(6.0, np.float32), "six"),
             numpy_helper.from_array(np.array(0.037, np.float32), "sy"),
             numpy_helper.from_array(np.array(-3, np.int8), "zy"),
             numpy_helper.from_array(np.array([1], np.int64), "st"),
             numpy_helper.from_array(np.array([48], np.int64), "en"),
             numpy_helper.from_array(np.array([1], np.int64), "ax")]
    nodes = [helper.make_node("DequantizeLinear", ["a", "sa"], ["da"]),
             helper.make_node("DequantizeLinear", ["b", "sb"], ["db"]), helper.make_node("Add", ["da", "db"], ["m"]),
             helper.make_node("Div", ["m", "six"], ["d"]), helper.make_node("Slice", ["d", "st", "en", "ax"], ["s"]),
             helper.make_node("QuantizeLinear", ["s", "sy", "zy"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("a", TP.INT8, ["n", 48]),
                       helper.make_tensor_value_info("b", TP.UINT8, ["n", 48])],
               [helper.make_tensor_value_info("y", TP.INT8, None)], inits)
    shapes = {"a": [4096, 48], "b": [4096, 48]}
    res = fused_parity(m, {}, shapes, ["pointwise"])
    assert "QuantizeLinear" in [res.graph.nodes[i].op_type for i in res.plan.regions[0].nodes]
    _exact(check_models(m, res.model, emulate=True, input_shapes=shapes))


def test_the_quantizer_rounds_as_the_cuda_ep_at_ties_infinities_and_nan() -> None:
    """`ofz::quantize8` in emulation, as ORT's CUDA kernel computes it (`__float2int_rn(x / scale) + zero_point`
    in int32, clamped): ties to even, infinities and values past 2^31 saturated before the zero point is added
    (so -inf with a negative zero point wraps to the top, as there), NaN to the zero point."""
    from helpers import launch_spec
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "s"),
             numpy_helper.from_array(np.array(-3, np.int8), "z")]
    m = _model([helper.make_node("Neg", ["x"], ["nx"]), helper.make_node("QuantizeLinear", ["nx", "s", "z"], ["y"])],
               [helper.make_tensor_value_info("x", TP.FLOAT, [12])],
               [helper.make_tensor_value_info("y", TP.INT8, [12])], inits)
    (k,) = _optimized(m).kernels
    x = np.array([-0.25, -0.75, 0.25, 0.75, -1.25, np.nan, np.inf, -np.inf, 1e30, -1e30, -70.0, 70.0], np.float32)
    out = np.zeros(12, np.int8)
    launch_spec(k.spec, [x, out], [])
    # -x / 0.5 = 0.5, 1.5, -0.5, -1.5, 2.5 -> 0, 2, -0, -2, 2 (ties to even), then + -3; NaN -> 0 - 3; -inf (x = inf,
    # and x = 1e30) -> INT_MIN, which - 3 wraps to INT_MAX - 2 -> 127 (ORT's CPU kernel gives -128 there); +inf ->
    # INT_MAX - 3 -> 127; 140 - 3 -> 127; -140 - 3 -> -128
    want = np.array([-3, -1, -3, -5, -1, -3, 127, 127, 127, 127, 127, -128], np.int8)
    assert np.array_equal(out, want), out

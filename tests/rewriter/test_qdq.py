"""rewriter.qdq: the quantize/dequantize chains ORT requantizes at a new scale, found as ORT finds them, and the
readers ORT's QDQ passes count kept as the input has them where the rewrite removed one."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP, helper, numpy_helper

from ortfuse.api import compile_model
from ortfuse.check import check_models
from ortfuse.report import markdown, summary
from ortfuse.rewriter.qdq import KEPT_READER, merged_pairs
from helpers import weight_bias_unit

X = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 2


def chain(s2: float = 0.031, z2: int = 7, reader: bool = False, middle: tuple[str, ...] = ("Cast",),
          fed: bool = False, static: bool = True, zero_point=np.int8, domain: str = "", ir: int = 9,
          opset: int = 18, constant_scale: bool = False) -> onnx.ModelProto:
    """x -> Q1 -> DQ1 -> `middle` ops -> Q2 -> DQ2 -> Relu; with `reader`, DQ1 also feeds a Reshape target
    through its Shape (a reader the rewriter writes as a constant)."""
    mids = {"Cast": lambda a, b: helper.make_node("Cast", [a], [b], to=TP.FLOAT),
            "Identity": lambda a, b: helper.make_node("Identity", [a], [b]),
            "Dropout": lambda a, b: helper.make_node("Dropout", [a], [b]),
            "Mul1": lambda a, b: helper.make_node("Mul", [a, "one"], [b]),
            "Relu": lambda a, b: helper.make_node("Relu", [a], [b])}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s1", "z1"], ["q1"], name="Q1", domain=domain),
             helper.make_node("DequantizeLinear", ["q1", "s1", "z1"], ["d1"], name="DQ1", domain=domain)]
    t = "d1"
    for k, op in enumerate(middle):
        nodes.append(mids[op](t, f"m{k}"))
        t = f"m{k}"
    nodes += [helper.make_node("QuantizeLinear", [t, "s2", "z2"], ["q2"], name="Q2", domain=domain),
              helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["d2"], name="DQ2", domain=domain)]
    if reader:
        nodes += [helper.make_node("Shape", ["d1"], ["sh"]), helper.make_node("Reshape", ["d2", "sh"], ["r"]),
                  helper.make_node("Relu", ["r"], ["y"])]
    else:
        nodes.append(helper.make_node("Relu", ["d2"], ["y"]))
    inits = [numpy_helper.from_array(np.asarray(v, dt), n) for n, v, dt in
             (("s1", 0.05, np.float32), ("z1", 0, zero_point), ("s2", s2, np.float32), ("z2", z2, zero_point),
              ("one", 1.0, np.float32))]
    if constant_scale:  # s2 as a Constant node's value_float
        inits = [i for i in inits if i.name != "s2"]
        nodes.insert(0, helper.make_node("Constant", [], ["s2"], value_float=s2))
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT, list(X.shape) if static else ["n", 64])]
    if fed or ir < 4:  # listed as graph inputs: fed by a user (IR >= 4), constants all the same (IR 3 lists all)
        inputs += [helper.make_tensor_value_info(i.name, i.data_type, []) for i in inits if ir < 4 or i.name == "s2"]
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    m = helper.make_model(helper.make_graph(nodes, "t", inputs, [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                                            inits), opset_imports=opsets)
    m.ir_version = ir
    m.graph.output[0].type.CopyFrom(onnx.shape_inference.infer_shapes(m).graph.output[0].type)  # (with a shape)
    return m


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
    ({}, True),  # different scales and zero points, a Cast to fp32 between: ORT removes it first
    ({"middle": ("Identity", "Cast", "Dropout", "Mul1")}, True),  # all removed first
    ({"middle": ()}, True),
    ({"reader": True, "static": False}, False),  # DQ1 has another reader
    ({"reader": True}, True),  # ... which ORT's constant folding removes first: the shape it reads is static
    ({"s2": 0.05, "z2": 0}, False),  # the same parameters: ORT merges, exactly
    ({"middle": ("Relu",)}, False),  # an op between the pairs
    ({"fed": True}, False),  # a scale a user may feed
    ({"ir": 3}, True),  # ... but not before IR 4, where initializers listed as inputs are constants all the same
    ({"zero_point": np.uint8, "z2": 130}, True),
    ({"zero_point": np.int16, "opset": 21}, True),
    ({"domain": "com.microsoft"}, True),
    ({"constant_scale": True}, True),
])
def test_merges_are_found_as_ort_makes_them(kw, merged):
    m = chain(**kw)
    assert bool(merged_pairs(m, lambda t: kw.get("static", True))) == merged
    assert _ort_merges(m) == merged  # the finder and ORT agree


def test_a_reader_the_rewrite_removes_is_kept_for_ort():
    # the rewrite writes the Reshape's target as a constant, and DQ1 would lose its Shape read (of a run-time
    # shape, which ORT does not fold): the output keeps a Size of d1, read by nothing, so ORT merges neither
    # model's chain and the two agree under ORT's defaults
    src = chain(reader=True, static=False)
    res = compile_model(src)
    assert res.kept_readers == ("DequantizeLinear 'DQ1' (read 2 times in the input, once in the output)",)
    assert res.requantized == () and "quantization:" not in summary(res)
    assert "- kept: DequantizeLinear 'DQ1' (read 2 times" in markdown(res, "src.onnx")
    kept = [n for n in res.model.graph.node if n.output[0] == "d1" + KEPT_READER]
    assert len(kept) == 1 and kept[0].op_type == "Size"
    assert not _ort_merges(src) and not _ort_merges(res.model)
    rep = check_models(src, res.model, input_shapes={"x": list(X.shape)})
    assert rep.ok and rep.model[0].name == "y" and rep.model[0].max_abs == 0
    # without it ORT merges the output's chain: check fails, and says why
    res.model.graph.node.remove(kept[0])
    assert _ort_merges(res.model)
    rep = check_models(src, res.model, input_shapes={"x": list(X.shape)})
    assert not rep.ok and "with its DoubleQDQPairsRemover off in both, max rel 0;" in rep.model[0].name


@pytest.mark.parametrize("static", [False, True])
def test_a_reader_is_kept_where_ort_folds_shapes(static):
    # --input-shape makes d1 static in the output (or the model declares it so), and ORT folds a Shape of a
    # static shape: the kept Size it does not fold
    src = chain(reader=True, static=static, middle=("Cast",))
    src.graph.node[-3].op_type = "Size"  # DQ1's reader in the input is a Size (its own DQ1 copy in ORT: no merge)
    src.graph.node.insert(len(src.graph.node) - 2, helper.make_node("Unsqueeze", ["sh", "ax"], ["shu"]))
    src.graph.node[-2].input[1] = "shu"  # Reshape(d2, [Size(d1)]): d2 flattened
    src.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), "ax"))
    src.graph.output[0].type.CopyFrom(onnx.helper.make_tensor_type_proto(TP.FLOAT, None))
    src.graph.output[0].type.CopyFrom(onnx.shape_inference.infer_shapes(src).graph.output[0].type)
    assert not _ort_merges(src) and not merged_pairs(src, lambda t: static)
    res = compile_model(src, None if static else {"x": list(X.shape)})
    assert len(res.kept_readers) == 1 and res.requantized == () and not _ort_merges(res.model)
    assert check_models(src, res.model, input_shapes={"x": list(X.shape)}).ok


def test_a_merge_ort_makes_in_both_models_is_left_alone():
    # a static shape: ORT folds the Shape read in the input too, and merges the pairs of both models alike
    src = chain(reader=True)
    res = compile_model(src)
    assert res.kept_readers == () and res.requantized == () and "quantization:" not in summary(res)
    assert _ort_merges(src) and _ort_merges(res.model)
    rep = check_models(src, res.model)
    assert rep.ok and rep.model[0].name == "y"


def _ort_quantizes(m: onnx.ModelProto, tmp_path) -> bool:
    """ORT's own answer: does ORT_ENABLE_BASIC (where WeightBiasQuantization runs) give the Conv a dequantized
    weight or bias it did not have (its nodes are named after the Conv's)? (A bias quantized at the input's scale
    times the weight's moves by 4e-5 at most here, too little to change the output reliably.)"""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(tmp_path / "basic.onnx")
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return any(n.op_type == "DequantizeLinear" and n.name.startswith(("conv_weight_dq", "conv_bias_dq"))
               for n in onnx.load(so.optimized_model_filepath).graph.node)


@pytest.mark.parametrize("kw, found", [
    ({}, True),  # an fp32 weight and bias
    ({"bias": "none"}, True),  # the weight alone
    ({"weight": "dq"}, True),  # the bias alone (the weight already quantized)
    ({"weight": "dq", "bias": "none"}, False),  # nothing to quantize
    ({"tail": ()}, True), ({"tail": ("Relu", "Clip")}, True),
    ({"tail": ("Sigmoid",)}, False),  # not a Relu or a Clip before the Q
    ({"branch": True}, False),  # the Conv's output has another reader
    ({"input_dq": False}, False),
    ({"op": "Gemm"}, True), ({"op": "Gemm", "bias": "2d"}, False),  # a Gemm's C of two dims is left alone
])
def test_weight_bias_units_are_found_as_ort_quantizes_them(kw, found, tmp_path):
    from ortfuse.rewriter.qdq import weight_bias_units
    m = weight_bias_unit(**kw)
    assert _ort_quantizes(m, tmp_path) == found  # (the model does what the case says it does)
    got = weight_bias_units(m)
    assert bool(got) == found, got
    if found:
        assert {"dx", "c", "qy"} <= got and ("W" in got) == (kw.get("weight") == "dq"), got


def test_a_weight_bias_unit_stays_orts():
    """Fused, the Conv would compute with its fp32 weight on the CUDA EP, where ORT quantizes it in the input; the
    unit stays ORT's whole (on the CPU EP a fused node's function is inlined, and ORT quantizes it there too, so
    only the plan shows the difference: the GPU test runs both)."""
    m = weight_bias_unit()
    res = compile_model(m, {}, "sm_90")
    fused = {res.graph.nodes[i].output[0] for r in res.plan.regions for i in r.nodes}
    assert not fused & {"dx", "c", "t0", "qy"}, fused
    assert any("WeightBiasQuantization" in str(r) for r in res.plan.rejects), [str(r) for r in res.plan.rejects]
    kept = [n.op_type for n in res.model.graph.node if n.domain == ""]
    assert kept[kept.index("Conv") - 1:kept.index("Conv") + 3] == ["DequantizeLinear", "Conv", "Relu", "QuantizeLinear"]


def _ort_units(m: onnx.ModelProto, tmp_path, name: str) -> set[str]:
    """The nodes ORT's BASIC level gives a quantized weight or bias (named after the Conv or Gemm)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return {n.name for n in onnx.load(so.optimized_model_filepath).graph.node
            if n.op_type == "DequantizeLinear" and ("_weight_dq" in n.name or "_bias_dq" in n.name)}


def _padded_gemm_unit() -> onnx.ModelProto:
    """DQ -> Gemm (fp32 weight of 250 columns: rows not 16-byte aligned, which the rewrite pads where the GEMM is
    cuBLAS's) -> Relu -> Q, at 8192 rows."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in
             (("sx", 0.02, np.float32), ("zx", 0, np.int8), ("sy", 0.05, np.float32), ("zy", -10, np.int8))]
    inits += [numpy_helper.from_array((rng.standard_normal((256, 250)) * 0.1).astype(np.float32), "W"),
              numpy_helper.from_array((rng.standard_normal(250) * 0.1).astype(np.float32), "B")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["qx"]),
             helper.make_node("DequantizeLinear", ["qx", "sx", "zx"], ["dx"]),
             helper.make_node("Gemm", ["dx", "W", "B"], ["c"], name="gemm"), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "sy", "zy"], ["qy"]),
             helper.make_node("DequantizeLinear", ["qy", "sy", "zy"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TP.FLOAT, [8192, 256])],
                                            [helper.make_tensor_value_info("y", TP.FLOAT, [8192, 250])], inits),
                          opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


@pytest.mark.parametrize("case", ["conv", "conv_bias_only", "gemm_padded", "listed_inputs"])
def test_ort_quantizes_the_same_units_in_the_output_as_in_the_input(case, tmp_path):
    """Whatever the rewrite does around a unit (padding a Gemm's misaligned weight, fusing its neighbours), ORT's
    WeightBiasQuantization finds in the optimized model the units it finds in the input, and no other."""
    if case == "gemm_padded":
        m = _padded_gemm_unit()
    else:
        m = weight_bias_unit(weight="dq" if case == "conv_bias_only" else "float")
        if case == "listed_inputs":  # initializers also listed as graph inputs: ORT still quantizes them
            m.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                                 for i in m.graph.initializer if i.name in ("W", "B"))
    res = compile_model(m, {}, "sm_90")
    want = _ort_units(m, tmp_path, "in")
    assert want, "the case must be one ORT rewrites"
    assert _ort_units(res.model, tmp_path, "out") == want

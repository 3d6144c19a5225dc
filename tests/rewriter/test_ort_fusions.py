"""rewriter.ort_fusions: which nodes ORT's graph optimizer fuses into one, asked of ORT itself."""
from __future__ import annotations

import numpy as np
import pytest
import onnx
from onnx import TensorProto as TP, helper, numpy_helper

from helpers import gelu_mlp, model
from ortfuse.rewriter.load import load_model
from ortfuse.rewriter import ort_fusions as fusions
from ortfuse.rewriter.ort_fusions import ort_fusion_units
from ortfuse.rewriter.weights import WeightStore, is_stub


def test_orts_gelu_and_gemm_fusions_are_found():
    # ORT makes MatMul + Add one Gemm (a 2-D MatMul) and the five GELU ops one Gelu, on the CPU EP as on the CUDA EP
    assert set(ort_fusion_units(gelu_mlp(True))) == {("Gemm", frozenset({"mm", "h"})),
                                                     ("Gelu", frozenset({"d", "e", "e1", "p", "g"}))}


def test_cpu_only_fusions_are_no_units():
    # DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul: the CPU EP's DynamicQuantizeMatMul, which the CUDA EP
    # never makes, so no unit
    inits = [numpy_helper.from_array(np.random.default_rng(1).integers(-127, 127, (32, 16)).astype(np.int8), "wq"),
             numpy_helper.from_array(np.array(0.01, np.float32), "ws")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "wq", "xz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TP.FLOAT), helper.make_node("Mul", ["xs", "ws"], ["s"]),
             helper.make_node("Mul", ["accf", "s"], ["y"])]
    m = model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 32])],
              [helper.make_tensor_value_info("y", TP.FLOAT, ["n", 16])], inits)
    assert ort_fusion_units(m) == ()


def test_a_model_ort_refuses_says_why():
    m = gelu_mlp()
    m.graph.node.append(helper.make_node("NoSuchOp", ["g"], ["z"], domain="nowhere"))
    m.opset_import.append(helper.make_opsetid("nowhere", 1))
    why = ort_fusion_units(m)
    assert isinstance(why, str) and "NoSuchOp" in why, why


def test_weights_set_aside_go_into_the_probe(monkeypatch):
    # a weight over weights.STUB_BYTES is a stub while optimizing (its bytes in the store): the probe holds its
    # bytes (ORT folds an Add into a Conv's bias only where the weights are constants), or past
    # MAX_PROBE_WEIGHT_BYTES declares it an input, where ORT still fuses around it what needs no constant
    store = WeightStore()
    m = load_model(gelu_mlp(True, k=512), store)
    assert [t.name for t in m.graph.initializer if is_stub(t)] == ["w"]
    assert {op for op, _ in ort_fusion_units(m)} == {"Gemm", "Gelu"}
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array((rng.standard_normal((128, 128, 3, 3)) * 0.05).astype(np.float32), "cw"),
             numpy_helper.from_array(rng.standard_normal((1, 128, 1, 1)).astype(np.float32), "cb"),
             numpy_helper.from_array(np.array(0.02, np.float32), "s")]
    conv = model([helper.make_node("Conv", ["x", "cw"], ["c"], pads=[1, 1, 1, 1]),
                  helper.make_node("Add", ["c", "cb"], ["a"]), helper.make_node("QuantizeLinear", ["a", "s"], ["q"])],
                 [helper.make_tensor_value_info("x", TP.FLOAT, [1, 128, 8, 8])],
                 [helper.make_tensor_value_info("q", TP.UINT8, [1, 128, 8, 8])], inits)
    conv = load_model(conv, store)
    assert ort_fusion_units(conv) == (("Conv", frozenset({"c", "a"})),)
    monkeypatch.setattr(fusions, "MAX_PROBE_WEIGHT_BYTES", 0)
    assert ort_fusion_units(conv) == ()  # (the weight an input: ORT folds nothing into it)
    assert {op for op, _ in ort_fusion_units(m)} == {"Gemm", "Gelu"}


def test_copies_and_shape_arithmetic_make_no_fusion_but_a_transposed_gemm_does():
    # ORT drops an Identity before a graph output, and computes a Reshape's target from Shape, Gather, Concat at
    # load: neither is a fusion of two computations. A Transpose read by a Gemm becomes the Gemm's transA, with
    # the Gemm's name and op: a kernel taking the Transpose would leave ORT another GEMM call
    w = (np.random.default_rng(3).standard_normal((4, 8)) * 0.1).astype(np.float32)
    consts = {"c": np.array(0.5, np.float32), "w": w, "i1": np.array([1], np.int64), "m1": np.array([-1], np.int64)}
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    nodes = [helper.make_node("Mul", ["x", "c"], ["p"]), helper.make_node("Identity", ["p"], ["y"]),
             helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Gather", ["sh", "i1"], ["d1"], axis=0),
             helper.make_node("Concat", ["m1", "d1"], ["tgt"], axis=0),
             helper.make_node("Reshape", ["x", "tgt"], ["r"]), helper.make_node("Transpose", ["r"], ["t"]),
             helper.make_node("Gemm", ["t", "w"], ["z"])]
    m = model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [4, 16])],
              [helper.make_tensor_value_info("y", TP.FLOAT, [4, 16]),
               helper.make_tensor_value_info("z", TP.FLOAT, [16, 8])], inits)
    assert ort_fusion_units(m) == (("Gemm", frozenset({"t", "z"})),)


def test_a_pad_ort_folds_into_a_conv_is_a_unit_and_a_propagated_quantizer_is_none():
    # ORT's PadFusion gives the Conv the Pad's pads (the same op writes the same output); QDQ propagation puts a
    # Q/DQ pair before a Slice a Q reads, renaming the tensor the Slice read, which is no fusion
    w = (np.random.default_rng(4).standard_normal((4, 4, 3, 3)) * 0.1).astype(np.float32)
    consts = {"w": w, "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "six": np.array(6.0, np.float32),
              "s": np.array(0.05, np.float32), "st": np.array([1], np.int64), "en": np.array([4], np.int64),
              "ax": np.array([1], np.int64)}
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"]), helper.make_node("Conv", ["p", "w"], ["c"]),
             helper.make_node("Div", ["c", "six"], ["d"]), helper.make_node("Slice", ["d", "st", "en", "ax"], ["sl"]),
             helper.make_node("QuantizeLinear", ["sl", "s"], ["q"])]
    m = model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [1, 4, 8, 8])],
              [helper.make_tensor_value_info("q", TP.UINT8, [1, 3, 8, 8])], inits)
    assert ort_fusion_units(m) == (("Conv", frozenset({"p", "c"})),)


def test_the_cuda_probe_without_the_cuda_ep_is_a_refusal_not_a_cpu_answer():
    # `provider="cuda"` asks the CUDA EP itself; where a session cannot get it (this machine, CI), the answer is
    # a reason (api falls back to the CPU probe, saying so), never the CPU EP's fusions passed off as the CUDA EP's
    from helpers import cuda_ep_usable
    if cuda_ep_usable():
        pytest.skip("the CUDA EP works here: tests/rewriter/test_ort_fusions_gpu.py asks it")
    why = ort_fusion_units(gelu_mlp(True), provider="cuda")
    assert isinstance(why, str), why
    with pytest.raises(ValueError, match="unknown provider"):
        ort_fusion_units(gelu_mlp(True), provider="rocm")


def test_optimize_asks_the_cpu_ep_without_a_gpu():
    from helpers import cuda_ep_usable
    from ortfuse import api
    assert api._fusion_probe_provider() == ("cuda" if cuda_ep_usable() else "cpu")


def _optimized(m: onnx.ModelProto, tmp_path) -> onnx.ModelProto:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return onnx.load(so.optimized_model_filepath)


def test_copies_between_devices_are_no_fusion_and_hide_none(tmp_path):
    # a CUDA session's saved model has MemcpyToHost / MemcpyFromHost nodes: the writer's output renamed
    # ("g_CUDAExecutionProvider") and the copy writing the input's name, or the copy writing a new name its
    # CPU readers read. Neither may name a unit after the copy, nor split one (as the CUDA probe reads them)
    m = gelu_mlp(True)
    done = _optimized(m, tmp_path)
    gelu = next(n for n in done.graph.node if n.op_type == "Gelu")
    gelu.output[0] = "g_CUDAExecutionProvider"
    done.graph.node.append(helper.make_node("MemcpyToHost", ["g_CUDAExecutionProvider"], ["g"]))
    gemm = next(n for n in done.graph.node if n.op_type == "Gemm")
    for n in done.graph.node:  # the Gelu reads the Gemm's result through a copy to a new name
        n.input[:] = ["h_copy" if x == gemm.output[0] else x for x in n.input]
    done.graph.node.append(helper.make_node("MemcpyFromHost", [gemm.output[0]], ["h_copy"]))
    units = fusions._units(m, done, {})
    assert set(units) == {("Gemm", frozenset({"mm", "h"})), ("Gelu", frozenset({"d", "e", "e1", "p", "g"}))}
    assert not any(n.op_type.startswith("Memcpy") for n in done.graph.node)

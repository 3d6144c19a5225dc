"""rewriter.ort_fusions: which nodes ORT's graph optimizer fuses into one, asked of ORT itself."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP, helper, numpy_helper

from helpers import gelu_mlp, model
from ortfuse.rewriter.load import load_model
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


def test_a_model_ort_refuses_gives_no_units():
    m = gelu_mlp()
    m.graph.node.append(helper.make_node("NoSuchOp", ["g"], ["z"], domain="nowhere"))
    m.opset_import.append(helper.make_opsetid("nowhere", 1))
    assert ort_fusion_units(m) == ()


def test_weights_set_aside_are_the_probes_inputs():
    # a weight over weights.STUB_BYTES is a stub while optimizing (its bytes in the store): the probe declares it an
    # input, and ORT still fuses around it
    m = load_model(gelu_mlp(True, k=512), WeightStore())
    assert [t.name for t in m.graph.initializer if is_stub(t)] == ["w"]
    assert {op for op, _ in ort_fusion_units(m)} == {"Gemm", "Gelu"}

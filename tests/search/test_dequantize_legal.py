"""search.legal: which DequantizeLinear nodes may join a fused kernel, and why the others stay ORT's."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, helper, numpy_helper

from ortfuse.api import compile_model
from ortfuse.config import Options
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.legal import inexact_before_quantizers
from helpers import gelu_mlp, model, plain_attention, quantized_layernorm


def _rejects(m: onnx.ModelProto) -> list[str]:
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    return [str(r) for r in res.plan.rejects]


def _dq_relu_add(x_type: int, opset: int = 18, **dq) -> onnx.ModelProto:
    scale = dq.pop("scale", np.array(0.02, np.float32))
    inits = [numpy_helper.from_array(scale, "s")]
    nodes = [helper.make_node("DequantizeLinear", ["q", "s"], ["d"], name="DQ", **dq),
             helper.make_node("Relu", ["d"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])]
    return model(nodes, [helper.make_tensor_value_info("q", x_type, [4, 32]),
                         helper.make_tensor_value_info("x", TP.FLOAT, [4, 32])],
                 [helper.make_tensor_value_info("y", TP.FLOAT, None)], [*inits], opset=opset)


def test_blocked_quantization_stays_orts() -> None:
    m = _dq_relu_add(TP.INT8, opset=21, axis=1, block_size=8, scale=np.full((4, 4), 0.02, np.float32))
    assert any("'DQ'" in r and "blocked quantization (block_size 8)" in r for r in _rejects(m)), _rejects(m)


def test_16_bit_data_stays_orts() -> None:
    m = _dq_relu_add(TP.INT16, opset=21)
    assert any("'DQ'" in r and "INT16" in r for r in _rejects(m)), _rejects(m)


def test_a_bfloat16_result_stays_orts() -> None:
    nodes = [helper.make_node("DequantizeLinear", ["q", "s"], ["d"], name="DQ", output_dtype=TP.BFLOAT16),
             helper.make_node("Cast", ["d"], ["f"], to=TP.FLOAT), helper.make_node("Add", ["f", "x"], ["y"])]
    m = model(nodes, [helper.make_tensor_value_info("q", TP.INT8, [4, 32]),
                      helper.make_tensor_value_info("x", TP.FLOAT, [4, 32])],
              [helper.make_tensor_value_info("y", TP.FLOAT, None)],
              [numpy_helper.from_array(np.array(0.02, np.float32), "s")], opset=23)
    assert any("'DQ'" in r and "no bfloat16 DequantizeLinear kernel" in r for r in _rejects(m)), _rejects(m)


def _chain(s2: float) -> onnx.ModelProto:
    """x -> Q1 -> DQ1 -> Q2 -> DQ2 -> Relu -> Add x: ORT's DoubleQDQPairsRemover merges the pairs into one at a
    new scale where their parameters differ."""
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "s1"),
             numpy_helper.from_array(np.array(s2, np.float32), "s2"),
             numpy_helper.from_array(np.array(3, np.int8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s1", "z"], ["q1"], name="Q1"),
             helper.make_node("DequantizeLinear", ["q1", "s1", "z"], ["d1"], name="DQ1"),
             helper.make_node("QuantizeLinear", ["d1", "s2", "z"], ["q2"], name="Q2"),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"], name="DQ2"),
             helper.make_node("Relu", ["d2"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])]
    return model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [4, 32])],
                 [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)


def test_a_chain_ort_merges_is_left_to_ort() -> None:
    """Fused, DQ2 would hide the chain from ORT on the CUDA EP in the output only, and the two models would round
    otherwise. (On the CPU EP the fused node's function is inlined and the chain is back: no CPU check sees it.)"""
    m = _chain(0.031)
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    fused = {res.graph.nodes[i].name for r in res.plan.regions for i in r.nodes}
    assert not fused & {"Q1", "DQ1", "Q2", "DQ2"}, fused
    assert any("'DQ2'" in str(r) and "DoubleQDQPairsRemover" in str(r) for r in res.plan.rejects)


def test_a_chain_the_input_merges_is_left_to_ort_where_the_rewrite_breaks_it() -> None:
    """DQ1 -> Identity -> Q2: ORT removes the Identity, then merges the chain; the rewrite folds the Identity too,
    but a chain the input merges is found in the input model, whatever the rewrite leaves."""
    m = _chain(0.031)
    nodes = list(m.graph.node)
    nodes[2].input[0] = "i"
    nodes.insert(2, helper.make_node("Identity", ["d1"], ["i"], name="Id"))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert not {res.graph.nodes[i].name for r in res.plan.regions for i in r.nodes} & {"Q1", "DQ1", "Q2", "DQ2"}


def test_a_chain_of_equal_pairs_is_not_merged_at_a_new_scale() -> None:
    """Pairs of equal parameters: ORT drops them without rounding otherwise, so DQ2 may be fused."""
    res = compile_model(_chain(0.02), {}, "sm_90", options=Options(archs=(90,)))
    assert "DQ2" in {res.graph.nodes[i].name for r in res.plan.regions for i in r.nodes}


@pytest.mark.parametrize("x_type", [TP.INT8, TP.UINT8, TP.INT32])
def test_8_bit_and_int32_data_are_fused(x_type: int) -> None:
    res = compile_model(_dq_relu_add(x_type), {}, "sm_90", options=Options(archs=(90,)))
    assert [sorted(res.graph.nodes[i].op_type for i in r.nodes) for r in res.plan.regions] == \
        [["Add", "DequantizeLinear", "Relu"]]


def test_a_dequantizer_the_rewrite_took_a_reader_from_stays_orts() -> None:
    """DQ -> Softmax -> Q as ORT's CPU EP makes one QLinearSoftmax only where the DQ has one reader; here a Shape
    also reads it, which the rewrite writes as a constant. Fused, the DQ would have one reader in the output's
    inlined function, where ORT's passes can round otherwise than in the input (fuzz seeds 222 and 306 of
    `test_random_quantized_graph_matches_ort` fail so); it stays ORT's, and keeps a reader."""
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s1"),
             numpy_helper.from_array(np.array(1.0 / 256, np.float32), "s2"),
             numpy_helper.from_array(np.array(-128, np.int8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s1", "z"], ["q1"]),
             helper.make_node("DequantizeLinear", ["q1", "s1", "z"], ["d1"], name="DQ1"),
             helper.make_node("Softmax", ["d1"], ["p"]),
             helper.make_node("QuantizeLinear", ["p", "s2", "z"], ["q2"]),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"]),
             helper.make_node("Shape", ["d1"], ["sh"]), helper.make_node("Reshape", ["d2", "sh"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    m = model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 32])],
              [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert any("'DQ1'" in str(r) and "other readers in the input model" in str(r) for r in res.plan.rejects), \
        [str(r) for r in res.plan.rejects]


def _after_sigmoid(tail: list[onnx.NodeProto], out: str, scales: tuple[float, ...] = ()) -> onnx.ModelProto:
    """DQ(a) + DQ(b) -> Sigmoid -> sg (a graph output too) -> Q -> DQ -> dq, then `tail` to `out` (scales s3...)."""
    inits = [numpy_helper.from_array(np.array(v, np.float32), f"s{k}")
             for k, v in enumerate((0.02, 1 / 256, *scales), 1)]
    nodes = [helper.make_node("DequantizeLinear", ["a", "s1"], ["da"]),
             helper.make_node("DequantizeLinear", ["b", "s1"], ["db"]), helper.make_node("Add", ["da", "db"], ["m"]),
             helper.make_node("Sigmoid", ["m"], ["sg"]),
             helper.make_node("QuantizeLinear", ["sg", "s2"], ["q"], name="Q"),
             helper.make_node("DequantizeLinear", ["q", "s2"], ["dq"]), *tail]
    ins = [helper.make_tensor_value_info(t, TP.INT8, [4, 32]) for t in "ab"]
    return model(nodes, ins, [helper.make_tensor_value_info(out, TP.FLOAT, None),
                              helper.make_tensor_value_info("sg", TP.FLOAT, None)], inits)


def _fused(res) -> set[str]:
    return {res.graph.nodes[i].name or res.graph.nodes[i].op_type for r in res.plan.regions for i in r.nodes}


def _stays_orts(res, node: str, q: str, op: str = "QuantizeLinear") -> bool:
    return any(f"'{node}'" in str(r) and f"reaches {op} '{q}'" in str(r) for r in res.plan.rejects)


def test_an_inexact_value_a_fused_quantizer_reads_stays_orts() -> None:
    """Sigmoid's kernel writes sg (a graph output too) and the Q of sg joins the next kernel, which would quantize
    a value the first kernel computed otherwise than ORT (an exp: an ulp, then a step). `api` plans again with the
    Sigmoid left to ORT; the Q then quantizes ORT's value and stays fused."""
    m = _after_sigmoid([helper.make_node("Mul", ["dq", "db"], ["y"])], "y")
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "Sigmoid" not in _fused(res) and "Q" in _fused(res), sorted(_fused(res))
    assert _stays_orts(res, "sg", "Q"), [str(r) for r in res.plan.rejects]


def test_a_layernorm_orts_quantizer_reads_stays_orts() -> None:
    """The quantized BERT's residual stream: DQ + DQ -> Add -> Q -> DQ -> LayerNorm -> Q. The last Q cannot join
    the LayerNorm's kernel (`exact_verdict`); ORT's Q reading the kernel's LayerNorm, whose sums run in another
    order than ORT's, moved elements a step on the GPU (outputs 0.2 off). The LayerNorm stays ORT's, the Add
    stays fused."""
    m = quantized_layernorm()
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "LN" not in _fused(res) and "Add" in _fused(res), sorted(_fused(res))
    assert _stays_orts(res, "LN", "Q"), [str(r) for r in res.plan.rejects]


def test_an_inexact_value_read_through_orts_op_stays_orts() -> None:
    """As above with ORT's CumSum between Sigmoid's kernel and the Q: ORT's op computes what it is given, so the
    kernel's Sigmoid reaches the Q through it (an ulp there is a step at the Q): the Sigmoid stays ORT's."""
    nodes = [helper.make_node("DequantizeLinear", ["a", "s1"], ["da"]),
             helper.make_node("DequantizeLinear", ["b", "s1"], ["db"]), helper.make_node("Add", ["da", "db"], ["m"]),
             helper.make_node("Sigmoid", ["m"], ["sg"]), helper.make_node("CumSum", ["sg", "axis"], ["cs"]),
             helper.make_node("QuantizeLinear", ["cs", "s2"], ["q"], name="Q"),
             helper.make_node("DequantizeLinear", ["q", "s2"], ["dq"]), helper.make_node("Mul", ["dq", "db"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "s1"),
             numpy_helper.from_array(np.array(1 / 32, np.float32), "s2"),
             numpy_helper.from_array(np.array(1, np.int64), "axis")]
    m = model(nodes, [helper.make_tensor_value_info(t, TP.INT8, [4, 32]) for t in "ab"],
              [helper.make_tensor_value_info("y", TP.FLOAT, None), helper.make_tensor_value_info("sg", TP.FLOAT, None)],
              inits)
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "Sigmoid" not in _fused(res) and "Mul" in _fused(res), sorted(_fused(res))
    assert _stays_orts(res, "sg", "Q"), [str(r) for r in res.plan.rejects]


def _sigmoid_into_if(then_nodes: list[onnx.NodeProto], tail: list[onnx.NodeProto]) -> onnx.ModelProto:
    """DQ(a) + DQ(b) -> Sigmoid -> sg, read from the enclosing graph by an If's branches (then: `then_nodes`
    ending in t_out; else: Identity), the If's br then `tail` to y; scales s1, s2."""
    then_b = helper.make_graph(then_nodes, "then", [], [helper.make_tensor_value_info("t_out", TP.FLOAT, [4, 32])])
    else_b = helper.make_graph([helper.make_node("Identity", ["sg"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", TP.FLOAT, [4, 32])])
    nodes = [helper.make_node("DequantizeLinear", ["a", "s1"], ["da"]),
             helper.make_node("DequantizeLinear", ["b", "s1"], ["db"]), helper.make_node("Add", ["da", "db"], ["m"]),
             helper.make_node("Sigmoid", ["m"], ["sg"]),
             helper.make_node("If", ["c"], ["br"], name="If", then_branch=then_b, else_branch=else_b), *tail]
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "s1"),
             numpy_helper.from_array(np.array(1 / 32, np.float32), "s2")]
    return model(nodes, [*(helper.make_tensor_value_info(t, TP.INT8, [4, 32]) for t in "ab"),
                         helper.make_tensor_value_info("c", TP.BOOL, [])],
                 [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)


def test_an_inexact_value_a_quantizer_in_a_branch_reads_stays_orts() -> None:
    """As above with the Q inside an If's branch, reading the Sigmoid's result from the enclosing graph: the walk
    up from quantizers takes the If as one (it reads sg through its body), so the Sigmoid stays ORT's."""
    m = _sigmoid_into_if([helper.make_node("QuantizeLinear", ["sg", "s2"], ["tq"], name="Q"),
                          helper.make_node("DequantizeLinear", ["tq", "s2"], ["t_out"])],
                         [helper.make_node("Mul", ["br", "db"], ["y"])])
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "Sigmoid" not in _fused(res) and "Add" in _fused(res), sorted(_fused(res))
    assert any("'sg'" in str(r) and "reaches If 'If', whose subgraph quantizes" in str(r) for r in res.plan.rejects)


def test_an_inexact_value_read_through_a_branch_stays_orts() -> None:
    """The Q after the If, which returns the Sigmoid's result from its branches (read from the enclosing graph):
    the walk up from the Q goes on through the If's outer reads, so the Sigmoid stays ORT's."""
    m = _sigmoid_into_if([helper.make_node("Identity", ["sg"], ["t_out"])],
                         [helper.make_node("QuantizeLinear", ["br", "s2"], ["q"], name="Q"),
                          helper.make_node("DequantizeLinear", ["q", "s2"], ["dq"]),
                          helper.make_node("Mul", ["dq", "db"], ["y"])])
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "Sigmoid" not in _fused(res) and "Add" in _fused(res), sorted(_fused(res))
    assert _stays_orts(res, "sg", "Q"), [str(r) for r in res.plan.rejects]


def test_orts_own_quantizer_keeps_its_input_exact() -> None:
    """A Q that stays ORT's for its own reason (a scale computed at run time) reads the Sigmoid: the Sigmoid stays
    ORT's too. Q2 after it quantizes ORT's values only (its cone stops at Q) and joins its kernel, exactly."""
    m = _after_sigmoid([helper.make_node("Add", ["dq", "db"], ["y"]),
                        helper.make_node("QuantizeLinear", ["y", "s3"], ["q2"], name="Q2"),
                        helper.make_node("DequantizeLinear", ["q2", "s3"], ["d2"]),
                        helper.make_node("Mul", ["d2", "da"], ["z"])], "z", (0.03,))
    m.graph.node.insert(0, helper.make_node("Abs", ["s2in"], ["s2"]))  # the Q's scale, computed at run time
    m.graph.initializer.remove(next(t for t in m.graph.initializer if t.name == "s2"))
    m.graph.input.append(helper.make_tensor_value_info("s2in", TP.FLOAT, []))
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "Q" not in _fused(res) and "Sigmoid" not in _fused(res) and "Q2" in _fused(res), \
        (sorted(_fused(res)), [str(r) for r in res.plan.rejects])
    assert _stays_orts(res, "sg", "Q"), [str(r) for r in res.plan.rejects]
    from ortfuse.check import check_models
    rep = check_models(m, res.model, emulate=True)
    exact = [d.max_abs for _, ds in rep.kernels for d in ds if d.name == "z"] == [0.0]  # Q2's kernel
    assert rep.ok and exact, "\n".join(rep.lines())


def test_a_dynamic_quantizers_input_stays_exact() -> None:
    """quantize_dynamic's DynamicQuantizeLinear (ORT's: its scale from the tensor's min and max, then steps) reads
    Sigmoid((x + x2) * x) * x + x2: the Sigmoid stays ORT's, the exact ops around it fuse."""
    nodes = [helper.make_node("Add", ["x", "x2"], ["a"]), helper.make_node("Mul", ["a", "x"], ["s"]),
             helper.make_node("Sigmoid", ["s"], ["sg"]),
             helper.make_node("Mul", ["sg", "x"], ["p"]), helper.make_node("Add", ["p", "x2"], ["m"]),
             helper.make_node("DynamicQuantizeLinear", ["m"], ["y", "ys", "yz"], name="DQL")]
    m = model(nodes, [helper.make_tensor_value_info(t, TP.FLOAT, [64, 32]) for t in ("x", "x2")],
              [helper.make_tensor_value_info("y", TP.UINT8, None), helper.make_tensor_value_info("ys", TP.FLOAT, None),
               helper.make_tensor_value_info("yz", TP.UINT8, None)], [])
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "Sigmoid" not in _fused(res), sorted(_fused(res))
    assert _stays_orts(res, "sg", "DQL", "DynamicQuantizeLinear") and {"Add", "Mul"} <= _fused(res), \
        (sorted(_fused(res)), [str(r) for r in res.plan.rejects])
    # and each sum and product is rounded once, as ORT's (no FMA: one ulp at the min or max moves the scale)
    for k in res.kernels:
        src = k.compiled.source
        assert not re.search(r"const float v\d+ = \(v\d+ [-+*] ", src) and "__fmul_rn(" in src, src


def test_an_attention_a_quantizer_reads_stays_orts() -> None:
    """quantize_dynamic's RoBERTa: the attention's result goes to DynamicQuantizeLinear. The attention kernel
    (online softmax, its own sums) is not ORT's MatMul -> Softmax -> MatMul, so the pattern is not taken: attention
    regions, which skip the per-node verdicts, drop such a pattern themselves (before, the re-planning loop never
    ended: each search took the same attention region again); and ORT's MultiHeadAttention is not offered it."""
    m = _dynamically_quantized(plain_attention(TP.FLOAT, mask="none"))
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert all(r.kind != "attention" for r in res.plan.regions), [r.kind for r in res.plan.regions]
    # nor ORT's MultiHeadAttention, which computes it otherwise too (it took the pattern before)
    assert "MultiHeadAttention" not in [n.op_type for n in res.model.graph.node]
    assert "Softmax" not in {res.graph.nodes[i].op_type for r in res.plan.regions for i in r.nodes}
    said = [str(r) for r in (*res.plan.rejects, *res.plan.refusals)]
    assert any("attention not one kernel" in r and "DynamicQuantizeLinear 'DQL'" in r for r in said), said


def test_projections_a_quantizer_reads_are_not_packed() -> None:
    """The same with Q, K and V projected from one input: without the quantizer the three MatMuls become one
    (`pack_sibling_gemms`); with it they stay three, since cuBLAS may sum a packed GEMM in another order."""
    plain = compile_model(plain_attention(TP.FLOAT, mask="none", proj=True), {}, "sm_90",
                          options=Options(archs=(90,)))
    assert [n.op_type for n in plain.model.graph.node].count("MatMul") == 1
    res = compile_model(_dynamically_quantized(plain_attention(TP.FLOAT, mask="none", proj=True)), {}, "sm_90",
                        options=Options(archs=(90,)))
    assert [n.op_type for n in res.model.graph.node].count("MatMul") == 5  # 3 projections, QK and PV


def _dynamically_quantized(m: onnx.ModelProto) -> onnx.ModelProto:
    """`m`'s output y quantized by DynamicQuantizeLinear (quantize_dynamic's form before a MatMulInteger)."""
    m.graph.node.append(helper.make_node("DynamicQuantizeLinear", ["y"], ["yq", "ys", "yz"], name="DQL"))
    (y,) = m.graph.output
    dims = [d.dim_param or d.dim_value for d in y.type.tensor_type.shape.dim]
    del m.graph.output[:]
    m.graph.output.extend([helper.make_tensor_value_info("yq", TP.UINT8, dims),
                           helper.make_tensor_value_info("ys", TP.FLOAT, []),
                           helper.make_tensor_value_info("yz", TP.UINT8, [])])
    return m


def test_a_quantizers_scale_is_kept_exact_too() -> None:
    """A per-row scale computed at run time (Mul -> ReduceL2 -> Add) and read by ORT's Q: the scale moves every
    step of its row, so the ReduceL2 a kernel would sum in its own order stays ORT's."""
    inits = [numpy_helper.from_array(np.array(0.37, np.float32), "c"),
             numpy_helper.from_array(np.array(1e-3, np.float32), "eps"),
             numpy_helper.from_array(np.array([1], np.int64), "ax")]
    nodes = [helper.make_node("Mul", ["x", "c"], ["xc"]),
             helper.make_node("ReduceL2", ["xc", "ax"], ["r"], name="L2", keepdims=0),
             helper.make_node("Add", ["r", "eps"], ["s"]),
             helper.make_node("QuantizeLinear", ["x", "s"], ["q"], name="Q", axis=0),
             helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=0)]
    m = model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [512, 768])],
              [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "L2" not in _fused(res) and _stays_orts(res, "L2", "Q"), \
        (sorted(_fused(res)), [str(r) for r in res.plan.rejects])


def test_a_reciprocal_orts_and_its_product_stay_together() -> None:
    """1 / exp(a + b) * c before a Q: ORT's DivMulFusion makes the Div and the Mul one division, so neither is
    fused (the Mul fused alone, beside ORT's Div, would round the product apart); where the Div's result is a
    graph output too ORT does not fuse them, and both may join kernels (an IEEE division is exact)."""
    def built(div_out: bool) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                 numpy_helper.from_array(np.array(0.02, np.float32), "s")]
        nodes = [helper.make_node("Add", ["a", "b"], ["ab"]), helper.make_node("Exp", ["ab"], ["e"]),
                 helper.make_node("Div", ["one", "e"], ["r"], name="D"),
                 helper.make_node("Mul", ["r", "c"], ["m"], name="M"), helper.make_node("Relu", ["m"], ["rl"]),
                 helper.make_node("QuantizeLinear", ["rl", "s"], ["q"], name="Q"),
                 helper.make_node("DequantizeLinear", ["q", "s"], ["y"])]
        outs = [helper.make_tensor_value_info("y", TP.FLOAT, None)]
        if div_out:
            outs.append(helper.make_tensor_value_info("r", TP.FLOAT, None))
        return model(nodes, [helper.make_tensor_value_info(t, TP.FLOAT, [64, 32]) for t in "abc"], outs, inits)
    fused = compile_model(built(False), {}, "sm_90", options=Options(archs=(90,)))
    assert not {"D", "M"} & _fused(fused), (sorted(_fused(fused)), [str(r) for r in fused.plan.rejects])
    apart = compile_model(built(True), {}, "sm_90", options=Options(archs=(90,)))
    assert {"D", "M"} <= _fused(apart), (sorted(_fused(apart)), [str(r) for r in apart.plan.rejects])
    g = build_graph(built(False), {})
    mul = next(i for i, n in enumerate(g.nodes) if n.name == "M")
    why = inexact_before_quantizers(g, [SimpleNamespace(nodes=(mul,))])  # the Mul fused, the Div ORT's
    assert list(why) == ["m"] and "DivMulFusion" in why["m"], why


def test_a_fusion_of_orts_a_quantizer_reads_stays_whole() -> None:
    """quantize_dynamic's MLP: x @ w + bias, the erf GELU, DynamicQuantizeLinear. In the input ORT runs one Gemm
    and one Gelu (`rewriter.ort_fusions`), each rounding otherwise than the ops apart; a kernel taking the GELU's
    exact ops (the Erf being ORT's) would leave ORT the Erf alone. So nothing of either fusion is fused; without
    the quantizer all of it is one kernel."""
    plain = compile_model(gelu_mlp(), {}, "sm_90", options=Options(archs=(90,)))
    assert [len(r.nodes) for r in plain.plan.regions] == [7]
    aside = gelu_mlp()  # a quantizer the fusions do not reach: they still fuse
    aside.graph.node.append(helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]))
    aside.graph.output.extend([helper.make_tensor_value_info("xq", TP.UINT8, ["n", 32]),
                               helper.make_tensor_value_info("xs", TP.FLOAT, []),
                               helper.make_tensor_value_info("xz", TP.UINT8, [])])
    assert [len(r.nodes) for r in compile_model(aside, {}, "sm_90").plan.regions] == [7]
    res = compile_model(gelu_mlp(dql=True), {}, "sm_90", options=Options(archs=(90,)))
    assert not res.plan.regions, [sorted(res.graph.nodes[i].op_type for i in r.nodes) for r in res.plan.regions]
    said = [str(r) for r in res.plan.rejects]
    assert any("'div'" in r and "as one Gelu" in r for r in said), said
    assert any("'bias_add'" in r and "as one Gemm" in r for r in said), said


def test_a_softmaxs_bias_add_stays_with_it() -> None:
    """Scores + mask -> Softmax -> Q: the Softmax stays ORT's (inexact), and so does the Add, which the CUDA EP makes
    one BiasSoftmax with it (a fusion the CPU EP's probe cannot show); the exact ops before the Add still fuse."""
    inits = [numpy_helper.from_array(np.array(0.125, np.float32), "c"),
             numpy_helper.from_array(np.array(1 / 256, np.float32), "s")]
    nodes = [helper.make_node("Mul", ["x", "c"], ["xs"]), helper.make_node("Relu", ["xs"], ["r"]),
             helper.make_node("Add", ["r", "mask"], ["m"], name="mask_add"), helper.make_node("Softmax", ["m"], ["p"]),
             helper.make_node("QuantizeLinear", ["p", "s"], ["q"], name="Q"),
             helper.make_node("DequantizeLinear", ["q", "s"], ["y"])]
    m = model(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [2, 4, 64, 64]),
                      helper.make_tensor_value_info("mask", TP.FLOAT, [2, 1, 1, 64])],
              [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert "mask_add" not in _fused(res) and "Softmax" not in _fused(res) and {"Mul", "Relu"} <= _fused(res), \
        sorted(_fused(res))
    assert any("'mask_add'" in str(r) and "one BiasSoftmax" in str(r) for r in res.plan.rejects), \
        [str(r) for r in res.plan.rejects]


def test_an_orts_op_split_and_read_by_a_quantizer_stays_whole() -> None:
    """com.microsoft's Gelu in the input (an ORT-optimized model) is one ORT kernel; ortfuse writes it as its five
    ops (`rewriter.contrib`), which a quantizer then reads: none of them fuses (the Erf is inexact, and the exact
    ones apart round otherwise than ORT's Gelu), so `restore` puts the Gelu back for ORT."""
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "c")]
    nodes = [helper.make_node("Mul", ["x", "c"], ["h"]),
             helper.make_node("Gelu", ["h"], ["g"], domain="com.microsoft", name="GELU"),
             helper.make_node("DynamicQuantizeLinear", ["g"], ["y", "ys", "yz"], name="DQL")]
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 48])],
                              [helper.make_tensor_value_info("y", TP.UINT8, ["n", 48]),
                               helper.make_tensor_value_info("ys", TP.FLOAT, []),
                               helper.make_tensor_value_info("yz", TP.UINT8, [])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 9
    res = compile_model(m, {}, "sm_90", options=Options(archs=(90,)))
    assert not any(res.graph.nodes[i].name.startswith("GELU/") for r in res.plan.regions for i in r.nodes), \
        [sorted(res.graph.nodes[i].name for i in r.nodes) for r in res.plan.regions]
    assert "Gelu" in [n.op_type for n in res.model.graph.node]

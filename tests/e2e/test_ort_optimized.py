"""Models run through ORT's transformers optimizer first: its fused ops (BiasGelu, FastGelu, SkipLayerNormalization,
(Skip)SimplifiedLayerNormalization) are written as standard ops, fused into the GEMMs' epilogues like a raw
export's, and match ORT's own kernels; what stays with ORT is ORT's fused op again."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuzz_graphs import random_ort_block
from ort_accepts import assert_ort_accepts
from ortfuse import report
from ortfuse.api import compile_model
from ortfuse.check import check_models
from ortfuse.config import Options

MS = "com.microsoft"
D, F = 64, 256
_lo, _hi = (int(v) for v in os.environ.get("ORTFUSE_FUZZ_ORT_SEEDS", "0:6").split(":"))


def _block(dtype: int, kind: str) -> onnx.ModelProto:
    """One transformer MLP block as ORT's optimizer leaves it: x -> MatMul -> BiasGelu/FastGelu -> MatMul ->
    SkipLayerNormalization(bias) with x as the skip (kind "bert" / "gpt2"), or MatMul -> SiLU gate product ->
    MatMul -> SkipSimplifiedLayerNormalization (kind "llama")."""
    np_t = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(11)
    w = lambda *s, k=1.0: (rng.standard_normal(s) * k).astype(np_t)  # noqa: E731
    inits = {"w1": w(D, F, k=D ** -0.5), "b1": w(F, k=0.1), "w2": w(F, D, k=F ** -0.5), "b2": w(D, k=0.1),
             "g": w(D, k=0.2) + np.ones(D, np_t), "be": w(D, k=0.1)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1")]
    if kind == "llama":
        nodes += [helper.make_node("Sigmoid", ["h"], ["sg"], name="sig"), helper.make_node("Mul", ["h", "sg"], ["a"], name="silu"),
                  helper.make_node("MatMul", ["a", "w2"], ["o"], name="fc2"),
                  helper.make_node("SkipSimplifiedLayerNormalization", ["o", "x", "g"], ["y", "", "", "res"],
                                   name="skipnorm", domain=MS, epsilon=1e-6)]
        del inits["b2"], inits["be"]
    else:
        gelu = ("BiasGelu", ["h", "b1"]) if kind == "bert" else ("FastGelu", ["h", "b1"])
        nodes += [helper.make_node(gelu[0], gelu[1], ["a"], name="gelu", domain=MS),
                  helper.make_node("MatMul", ["a", "w2"], ["o"], name="fc2"),
                  helper.make_node("SkipLayerNormalization", ["o", "x", "g", "be", "b2"], ["y", "", "", "res"],
                                   name="skipnorm", domain=MS, epsilon=1e-5)]
    outs = [helper.make_tensor_value_info(t, dtype, ["batch", "seq", D]) for t in ("y", "res")]
    g = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", dtype, ["batch", "seq", D])], outs,
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_orts_fused_ops_join_the_gemms_and_match(kind, dtype):
    m = _block(dtype, kind)
    before = m.SerializeToString()
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    assert m.SerializeToString() == before
    assert_ort_accepts(res.model)
    kinds = sorted(k.region.kind for k in res.kernels)
    fc1 = next(k for k in res.kernels if any(res.graph.nodes[i].name == "fc1" for i in k.region.nodes))
    absorbed = {res.graph.nodes[i].op_type for i in fc1.region.nodes}
    assert absorbed >= ({"Sigmoid", "Mul"} if kind == "llama" else {"Add", "Mul", "Erf" if kind == "bert" else "Tanh"}), kinds
    assert len(res.contrib) == (1 if kind == "llama" else 2), res.contrib
    assert all(line.endswith("all fused") for line in res.contrib), res.contrib
    left = {n.op_type for n in res.model.graph.node if n.domain != "ortfuse"}
    assert not left & {"Erf", "Tanh", "Pow", "ReduceMean", "Sqrt", "Reciprocal"}, left  # put back, or fused
    rep = check_models(m, res.model, emulate=True, input_shapes={"x": (2, 9, D)}, seed=5)
    assert rep.ok, rep


def _gqa_layer(dtype: int) -> onnx.ModelProto:
    """A decoder layer as onnxruntime-genai's model builder writes one: SimplifiedLayerNormalization, the packed
    QKV MatMul, GroupQueryAttention (rotary inside, its sequence lengths computed from the mask), o_proj,
    SkipSimplifiedLayerNormalization, the gated MLP, SkipSimplifiedLayerNormalization."""
    np_t = helper.tensor_dtype_to_np_dtype(dtype)
    heads, kv, hd, f, maxs = 4, 2, 16, 128, 64
    rng = np.random.default_rng(4)
    inits: list[onnx.TensorProto] = []

    def w(*shape, k=None):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * (k or shape[0] ** -0.5)).astype(np_t),
                                             f"w{len(inits)}"))
        return inits[-1].name

    pos = np.arange(maxs)[:, None] * (10000 ** (-np.arange(0, hd, 2) / hd))[None]
    inits += [numpy_helper.from_array(np.cos(pos).astype(np_t), "cos"),
              numpy_helper.from_array(np.sin(pos).astype(np_t), "sin"),
              numpy_helper.from_array(np.array([1], np.int64), "one")]
    mk = helper.make_node
    nodes = [mk("ReduceSum", ["attention_mask", "one"], ["msum"], keepdims=0), mk("Sub", ["msum", "one"], ["msub"]),
             mk("Cast", ["msub"], ["seqlens_k"], to=TensorProto.INT32), mk("Shape", ["attention_mask"], ["mshape"]),
             mk("Gather", ["mshape", "one"], ["tl"], axis=0), mk("Squeeze", ["tl"], ["tls"]),
             mk("Cast", ["tls"], ["total_len"], to=TensorProto.INT32),
             mk("SimplifiedLayerNormalization", ["x", w(D, k=1.0)], ["n1"], epsilon=1e-6),
             mk("MatMul", ["n1", w(D, (heads + 2 * kv) * hd)], ["qkv"]),
             mk("GroupQueryAttention", ["qkv", "", "", "past_k", "past_v", "seqlens_k", "total_len", "cos", "sin"],
                ["attn", "present_k", "present_v"], domain=MS, num_heads=heads, kv_num_heads=kv, do_rotary=1),
             mk("MatMul", ["attn", w(heads * hd, D)], ["o"]),
             mk("SkipSimplifiedLayerNormalization", ["o", "x", w(D, k=1.0)], ["n2", "", "", "r1"], epsilon=1e-6, domain=MS),
             mk("MatMul", ["n2", w(D, f)], ["gate"]), mk("MatMul", ["n2", w(D, f)], ["up"]),
             mk("Sigmoid", ["gate"], ["sg"]), mk("Mul", ["gate", "sg"], ["silu"]), mk("Mul", ["silu", "up"], ["gu"]),
             mk("MatMul", ["gu", w(f, D)], ["down"]),
             mk("SkipSimplifiedLayerNormalization", ["down", "r1", w(D, k=1.0)], ["y", "", "", "r2"], epsilon=1e-6,
                domain=MS)]
    for k, n in enumerate(nodes):
        n.name = f"{n.op_type}_{k}"
    vi = helper.make_tensor_value_info
    ins = [vi("x", dtype, ["batch", "seq", D]), vi("past_k", dtype, ["batch", kv, "past", hd]),
           vi("past_v", dtype, ["batch", kv, "past", hd]), vi("attention_mask", TensorProto.INT64, ["batch", "total"])]
    outs = [vi("y", dtype, ["batch", "seq", D]), vi("r2", dtype, ["batch", "seq", D]),
            vi("present_k", dtype, ["batch", kv, "total", hd]), vi("present_v", dtype, ["batch", kv, "total", hd])]
    m = helper.make_model(helper.make_graph(nodes, "layer", ins, outs, inits),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
def test_a_model_builder_decoder_layer(dtype):
    # GroupQueryAttention stays with ORT; its norms are split and fused, the gated MLP is one GEMM kernel
    m = _gqa_layer(dtype)
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), dim_hints=(("seq", 1), ("past", 512))))
    assert_ort_accepts(res.model)
    assert "GroupQueryAttention" in {n.op_type for n in res.model.graph.node}
    assert all(line.endswith("all fused") for line in res.contrib) and len(res.contrib) == 3, res.contrib
    assert any(r.kind == "gemm" for r in res.plan.regions)
    shapes = {"x": (2, 1, D), "past_k": (2, 2, 3, 16), "past_v": (2, 2, 3, 16), "attention_mask": (2, 4)}
    rep = check_models(m, res.model, emulate=True, input_shapes=shapes, seed=3)
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("seed", range(_lo, _hi))
def test_random_ort_optimized_blocks_match(seed):
    # fuzz_graphs.random_ort_block: ORT's fused ops in random MLP blocks; ORTFUSE_FUZZ_ORT_SEEDS=lo:hi runs others
    m, shapes = random_ort_block(seed)
    before = m.SerializeToString()
    res = compile_model(m, shapes, "sm_90", options=Options(archs=(90,)))
    assert m.SerializeToString() == before
    assert_ort_accepts(res.model)
    for n, s in ((2, 7), (1, 1)):
        bound = {k: tuple({"n": n, "s": s}.get(d, d) for d in v) for k, v in shapes.items()}
        rep = check_models(m, res.model, emulate=True, input_shapes=bound, seed=seed)
        assert rep.ok, f"seed {seed}\n" + "\n".join(rep.lines())


def test_orts_layer_norm_before_opset_17_never_enters_a_function():
    # ORT 1.31 crashes (SIGSEGV) on its own default-domain ops inside a model-local function; a LayerNormalization
    # at opset 14 that cannot be split (its scale, and so its output, fp32 for an fp16 input) stays in the main graph
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [3, D])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("LayerNormalization", ["r", "g"], ["y"], name="ln", epsilon=1e-5)]
    g = helper.make_graph(nodes, "mixed", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, D])],
                          [numpy_helper.from_array(np.linspace(0.5, 1.5, D, dtype=np.float32), "g")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    assert "LayerNormalization" in {n.op_type for n in res.model.graph.node}
    assert all(n.op_type != "LayerNormalization" for f in res.model.functions for n in f.node)
    assert any("ORT's own op" in r.reason for r in (*res.plan.rejects, *res.plan.refusals))
    assert check_models(m, res.model, emulate=True).ok


def test_a_node_put_back_reads_what_its_split_ops_read_then(monkeypatch):
    # its bias and gamma were an Identity and a Cast of weights, which the canonical passes bypass and fold: the
    # SkipLayerNormalization put back reads the weights they left, not the tensors they removed
    import ortfuse.api as api
    from ortfuse.search.plan import Plan

    h = TensorProto.FLOAT16
    nodes = [helper.make_node("Cast", ["g0"], ["g"], name="castg", to=h),
             helper.make_node("Identity", ["be0"], ["be"], name="idbe"),
             helper.make_node("SkipLayerNormalization", ["x", "s", "g", "be"], ["y"], name="sln", domain=MS)]
    io = [helper.make_tensor_value_info(t, h, [2, 8, D]) for t in ("x", "s", "y")]
    rng = np.random.default_rng(2)
    g = helper.make_graph(nodes, "tied", io[:2], io[2:],
                          [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(D)).astype(np.float32), "g0"),
                           numpy_helper.from_array((0.1 * rng.standard_normal(D)).astype(np.float16), "be0")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    monkeypatch.setattr(api, "search_plan", lambda *a, **k: Plan((), (), ()))
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    assert [n.op_type for n in res.model.graph.node] == ["SkipLayerNormalization"]
    assert_ort_accepts(res.model)
    assert check_models(m, res.model).ok


def test_what_stays_with_ort_is_put_back(monkeypatch):
    # where the search fuses nothing (here: told to), the output holds ORT's fused ops again, not their parts
    import ortfuse.api as api
    from ortfuse.search.plan import Plan

    m = _block(TensorProto.FLOAT16, "gpt2")
    monkeypatch.setattr(api, "search_plan", lambda *a, **k: Plan((), (), ()))
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    assert [(n.op_type, n.domain) for n in res.model.graph.node] == [(n.op_type, n.domain) for n in m.graph.node]
    assert sorted(t.name for t in res.model.graph.initializer) == sorted(t.name for t in m.graph.initializer)
    assert check_models(m, res.model).ok
    assert res.contrib == ("FastGelu 'gelu': its standard ops were left to ORT, so it was put back as it was",
                           "SkipLayerNormalization 'skipnorm': its standard ops were left to ORT, so it was put back "
                           "as it was")
    assert "## ORT's fused ops in the input" in report.markdown(res, "m.onnx")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_orts_fused_ops_on_the_cuda_ep(kind, dtype):
    # ours on the CUDA EP against the original's ORT kernels (BiasGelu, SkipLayerNormalization, ...) there
    m = _block(dtype, kind)
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    rep = check_models(m, res.model, provider="cuda", input_shapes={"x": (2, 77, D)}, seed=7)
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
def test_a_model_builder_decoder_layer_on_the_cuda_ep(dtype):
    m = _gqa_layer(dtype)
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), dim_hints=(("seq", 1), ("past", 512))))
    shapes = {"x": (2, 1, D), "past_k": (2, 2, 3, 16), "past_v": (2, 2, 3, 16), "attention_mask": (2, 4)}
    rep = check_models(m, res.model, provider="cuda", input_shapes=shapes, seed=3)
    assert rep.ok, "\n".join(rep.lines())

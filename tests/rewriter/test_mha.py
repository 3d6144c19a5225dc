"""Attention patterns rewritten to ORT's MultiHeadAttention (rewriter.mha), run on ORT's CPU EP against the
original model on random inputs: Q, K and V read where the exporter's Transposes and Reshapes leave them (no
copy added), the scale and the mask carried over, the output re-viewed for its consumers."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

from helpers import gqa_attention, rope_attention, rope_shapes
from helpers import plain_attention as attention
from ortfuse.feeds import random_feeds
from ortfuse.rewriter.mha import is_mha, to_mha
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.attention import find_attention
from ortfuse.search.ort_attention import forms

TOL = {TP.FLOAT: 1e-5, TP.FLOAT16: 3e-3}  # max abs error over max abs output


def _feeds(m: onnx.ModelProto, b: int, s: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for v in m.graph.input:
        dims = [b if d.dim_param == "batch" else s if d.dim_param == "seq" else s + 4 if d.dim_param == "kv"
                else d.dim_value for d in v.type.tensor_type.shape.dim]
        npdt = helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
        out[v.name] = (rng.standard_normal(dims) * (2.0 if v.name == "mask" else 0.5)).astype(npdt)
    return out


def _run(m: onnx.ModelProto, feeds) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def rewritten(m: onnx.ModelProto):
    g = build_graph(m, {}, {})
    found, refused = forms(g, find_attention(g)[0])
    assert not refused and len(found) == 1, refused
    out = to_mha(g, found)
    onnx.checker.check_model(out.model)
    return g, out


def assert_same(m: onnx.ModelProto, r: onnx.ModelProto, dt: int) -> None:
    for b, s in ((2, 7), (1, 19)):
        feeds = _feeds(m, b, s, seed=b * 100 + s)
        for want, got in zip(_run(m, feeds), _run(r, feeds)):
            assert want.shape == got.shape and np.abs(want).max() > 0.05
            err = np.abs(want.astype(np.float64) - got.astype(np.float64)).max() / np.abs(want).max()
            assert err < TOL[dt], err


@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("mask,scale,kt", [("full", "div", "one"), ("none", "mul", "two"), ("rank2", "none", "one")])
def test_rewrite_reads_the_projections_and_matches_ort(dt, mask, scale, kt):
    m = attention(dt, mask=mask, scale=scale, kt=kt)
    before = m.SerializeToString()
    g, out = rewritten(m)
    ops = [n.op_type for n in out.nodes]
    assert ops.count("MultiHeadAttention") == 1 and "Transpose" not in ops and "Softmax" not in ops, ops
    mha = next(n for n in out.nodes if is_mha(n))
    assert list(mha.input[:3]) == ["q", "k", "v"]  # the exporter's Reshapes and Transposes undone, not copied
    # the output's Transpose back undone; the model's output keeps its name, a Reshape (free in ORT) away
    assert out.nodes[out.producer["y"]].op_type == "Reshape"
    assert any(o.domain == "com.microsoft" for o in out.model.opset_import)
    assert m.SerializeToString() == before  # the input model untouched
    assert_same(m, out.model, dt)


@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16])
def test_scores_cast_to_fp32_around_the_softmax(dt):
    m = attention(dt, softmax_fp32=True)
    _, out = rewritten(m)
    assert [n.op_type for n in out.nodes].count("Cast") == 0
    assert_same(m, out.model, dt)


def test_a_scaled_q_is_transposed_back_and_a_heads_output_transposed_forward():
    """Q scaled after its Transpose: the exporter's Transpose cannot be undone, so one is added; P·V as the
    model's output [B, N, S, D] is transposed back from MultiHeadAttention's [B, S, N*D]."""
    m = attention(TP.FLOAT, q_scaled=True, out="heads")
    _, out = rewritten(m)
    assert [n.op_type for n in out.nodes].count("Transpose") == 3  # the exporter's, ours back, the output
    assert_same(m, out.model, TP.FLOAT)


@pytest.mark.parametrize("make,shapes", [
    (lambda: gqa_attention(TP.FLOAT16, runtime_target=False), {"q": (2, 4, 9, 64), "k": (2, 2, 9, 64),
                                                               "v": (2, 2, 9, 64), "mask": (2, 1, 9, 9)}),
    (lambda: rope_attention(TP.FLOAT, kv_heads=4, head=16), rope_shapes(4, 4, 16, 2, 9)),
], ids=["gqa", "rope"])
def test_operand_paths_stay_with_ort(make, shapes):
    """K and V repeated across grouped query heads, or Q and K rotated: the paths stay as ORT ops in front of
    MultiHeadAttention, which gets the repeated (rotated) heads."""
    m = make()
    g = build_graph(m, {}, {})
    found, refused = forms(g, find_attention(g)[0])
    assert len(found) == 1 and not refused
    out = to_mha(g, found).model
    feeds = random_feeds(m, shapes, seed=3)
    for want, got in zip(_run(m, feeds), _run(out, feeds)):
        err = np.abs(want.astype(np.float64) - got.astype(np.float64)).max() / np.abs(want).max()
        assert err < 3e-3, err


@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16])
def test_projection_biases_go_into_the_node(dt):
    """Q's and K's bias Adds become MultiHeadAttention's bias input (V's part zeros); the MatMuls feed it."""
    m = attention(dt, mask="none", proj=True)
    g = build_graph(m, {}, {})
    found, _ = forms(g, find_attention(g)[0])
    out = to_mha(g, found, biases=True)
    onnx.checker.check_model(out.model)
    ops = [n.op_type for n in out.nodes]
    assert ops.count("Add") == 0 and ops.count("MatMul") == 3, ops
    mha = next(n for n in out.nodes if is_mha(n))
    bias = out.constants[mha.input[3]]
    assert bias.shape == (72,) and not bias[48:].any() and bias[:48].all()
    assert [out.nodes[out.producer[x]].op_type for x in mha.input[:3]] == ["MatMul"] * 3
    for b, s in ((2, 7), (1, 19)):
        feeds = _feeds(m, b, s, seed=s)
        want, got = _run(m, feeds)[0], _run(out.model, feeds)[0]
        assert np.abs(want.astype(np.float64) - got).max() / np.abs(want).max() < TOL[dt]
    assert [n.op_type for n in to_mha(g, found).nodes].count("Add") == 2  # kept without `biases`


@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("scale,factor", [("mul", 0.3), ("div", 0.45), ("none", None)])
def test_the_scale_is_the_scores_not_the_default(dt, scale, factor):
    """MultiHeadAttention's default scale is 1/sqrt(D): the node carries the pattern's own, 1 where it has none."""
    m = attention(dt, head=16, scale=scale, factor=factor, mask="none")
    _, out = rewritten(m)
    mha = next(n for n in out.nodes if is_mha(n))
    got = next(a.f for a in mha.attribute if a.name == "scale")
    assert got == pytest.approx(factor or 1.0, rel=1e-3)
    assert_same(m, out.model, dt)


@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("mask", ["heads", "full", "none"])
def test_cross_attention_with_another_value_head_size(dt, mask):
    """Keys of another length than the queries, V's heads 12 wide against Q's and K's 8, a per-head mask
    [heads, Sq, Sk] unsqueezed to attention_bias' rank."""
    m = attention(dt, head=8, head_v=12, kv="kv", mask=mask)
    _, out = rewritten(m)
    mha = next(n for n in out.nodes if is_mha(n))
    assert list(mha.input[:3]) == ["q", "k", "v"] and "Transpose" not in [n.op_type for n in out.nodes]
    assert_same(m, out.model, dt)


def _masked_rows(feeds: dict[str, np.ndarray], key: str = "mask") -> dict[str, np.ndarray]:
    """The mask of `feeds` with rows as exporters mask them: every key at its dtype's lowest, some keys at it,
    every key -inf (the pattern's Softmax: NaN), some keys -inf."""
    m = feeds[key].copy()
    m[0, 0, 0, :] = np.finfo(m.dtype).min
    m[0, 0, 1, :3] = np.finfo(m.dtype).min
    m[-1, 0, 2, :] = -np.inf
    m[-1, 0, 3, ::2] = -np.inf
    return {**feeds, key: m}


def _floor_nodes(out) -> list[str]:
    return [n.op_type for n in out.nodes if "floored" in n.name]


def test_an_fp32_mask_is_floored_for_the_memory_efficient_kernel():
    """ORT's memory-efficient kernel scales scores + mask by log2(e) in fp32, where float32's lowest becomes
    -inf: a fully masked row would be NaN. The mask reaches the node raised to -1e38 (-inf kept), once for all
    the nodes that read it, and rows masked at float32's lowest, fully or partly, or at -inf keep the pattern's
    results, NaN where it has NaN."""
    m = attention(TP.FLOAT, mask="full")
    _, out = rewritten(m)
    assert sorted(_floor_nodes(out)) == ["Equal", "Max", "Where"]
    mha = next(n for n in out.nodes if is_mha(n))
    assert out.nodes[out.producer[mha.input[5]]].op_type == "Where"
    for b, s in ((2, 7), (1, 19)):
        feeds = _masked_rows(_feeds(m, b, s, seed=s))
        want, got = _run(m, feeds)[0], _run(out.model, feeds)[0]
        rows = want.reshape(b, s, 3, 8)  # [B, S, heads, head]: query rows 0 and 1 of batch 0 are finite
        assert np.isfinite(rows[0, :2]).all() and np.isnan(rows[-1, 2]).all() and np.isfinite(got[0, :2]).all()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_a_constant_fp32_mask_is_floored_offline_and_an_fp16_one_not_at_all():
    m = attention(TP.FLOAT, mask="full")
    feeds = _masked_rows(_feeds(m, 1, 5, seed=1))
    const = onnx.ModelProto()
    const.CopyFrom(m)
    for v in const.graph.input:
        if v.name == "mask":
            for k, d in enumerate(v.type.tensor_type.shape.dim):
                d.dim_value = feeds["mask"].shape[k]
    const.graph.initializer.append(onnx.numpy_helper.from_array(feeds["mask"], "mask"))
    del feeds["mask"]
    inputs = [v for v in const.graph.input if v.name != "mask"]
    del const.graph.input[:]
    const.graph.input.extend(inputs)
    _, out = rewritten(const)
    assert not _floor_nodes(out)
    mha = next(n for n in out.nodes if is_mha(n))
    floored = out.constants[mha.input[5]]
    assert floored.min() == -np.inf and floored[np.isfinite(floored)].min() == np.float32(-1e38)
    np.testing.assert_allclose(_run(out.model, feeds)[0], _run(const, feeds)[0], rtol=1e-4, atol=1e-5, equal_nan=True)
    _, out16 = rewritten(attention(TP.FLOAT16, mask="full"))  # fp16's lowest, -65504, stays finite in fp32
    assert not _floor_nodes(out16)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("s", [256, 197])
def test_masked_rows_on_ort_cuda_kernels(dt, s):
    """On ORT's CUDA EP, where 256 queries (a multiple of 16) send fp32 with a mask to the memory-efficient
    kernel and 197 to the unfused one (fp16: 256 to the memory-efficient kernel, 197 unfused): rows masked at
    the dtype's lowest, fully or partly, or partly at -inf, match the pattern as stock ORT runs it. A row masked
    on every key is where fp16 differs (docs/design.md, "An fp32 mask is floored"): the pattern adds the mask in
    fp16 (its sum rounds to 32s, or to -inf), where MultiHeadAttention adds it in fp32, so a row at fp16's lowest
    is left out; a row of -inf is NaN in the pattern and 0 in MultiHeadAttention's fp16 kernels (both paths, as
    measured on an H200, 2026-11-28), while fp32 keeps the pattern's NaN."""
    m = attention(dt, head=16, mask="full")
    _, out = rewritten(m)
    feeds = _masked_rows(_feeds(m, 2, s, seed=s))
    if dt == TP.FLOAT16:
        feeds["mask"][0, 0, 0, :] = 0
    providers = [("CUDAExecutionProvider", {"use_tf32": "0"})]
    ops = ort.SessionOptions()  # the pattern op by op: no fusion of ORT's may turn it into its own attention
    ops.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(m.SerializeToString(), ops, providers=providers).run(None, feeds)[0]
    got = ort.InferenceSession(out.model.SerializeToString(), ort.SessionOptions(),
                               providers=providers).run(None, feeds)[0]
    rows, want_rows = got.reshape(2, s, 3, 16), want.reshape(2, s, 3, 16)
    assert np.isfinite(rows[0, :2]).all() and np.isnan(want_rows[-1, 2]).all()
    if dt == TP.FLOAT16:
        assert (rows[-1, 2] == 0).all()
        seen = np.ones(rows.shape[:2], bool)
        seen[-1, 2] = False
        got, want = rows[seen], want_rows[seen]
    else:
        assert np.isnan(rows[-1, 2]).all()
    tol = 3e-3 if dt == TP.FLOAT16 else 2e-3  # TF32 in the memory-efficient kernel's GEMMs, if it takes them
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol, equal_nan=True)


def _with_opset(m: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for o in out.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = opset
    return out


def _mask_computed(m: onnx.ModelProto) -> onnx.ModelProto:
    """m with its mask input scaled by 1 in a node: a mask that a node computes, as BERT's is."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for v in out.graph.input:
        if v.name == "mask":
            v.name = "mask_in"
    out.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(1.0, np.float32), "one"))
    out.graph.node.insert(0, helper.make_node("Mul", ["mask_in", "one"], ["mask"], name="mask_scale"))
    return out


@pytest.mark.parametrize("opset,floor", [(17, ["Max", "Equal", "Where"]), (10, ["Clip"]), (7, ["Clip"])])
def test_a_computed_mask_is_floored_after_its_producer(opset, floor):
    """The floor reads the mask where its producer leaves it (the nodes come after it); before opset 11 it is
    one Clip (Max broadcasts a scalar from opset 8 on, Equal compares floats from 11 on), which raises -inf
    too: a row masked at -inf on every key is then uniform, not the pattern's NaN."""
    m = _with_opset(_mask_computed(attention(TP.FLOAT, mask="full")), opset)
    _, out = rewritten(m)
    assert _floor_nodes(out) == floor
    assert [n.op_type for n in out.nodes[:1 + len(floor)]] == ["Mul", *floor]  # right after the mask's producer
    feeds = _masked_rows(_feeds(m, 2, 7, seed=opset), "mask_in")
    if opset < 11:
        feeds["mask_in"][-1, 0, 2, :] = -1e39  # -inf in float32: the row left out below
    want, got = _run(m, feeds)[0], _run(out.model, feeds)[0]
    keep = np.ones(want.shape[:2], bool)
    if opset < 11:
        keep[-1, 2] = False
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-5, equal_nan=True)

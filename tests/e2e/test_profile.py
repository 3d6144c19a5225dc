"""`--profile` without a GPU: the one-region sub-models and the placement decisions, with a stand-in timer
(ORT CPU runs the sub-models; the timings it reports are set by the test). The CUDA timer itself only
runs on a GPU (tests/runtime/test_gpu.py)."""
from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse import profile as prof
from ortfuse.api import compile_model
from ortfuse.check import check_models
from ortfuse.config import Options
from ortfuse.customops.attrs import read_launch
from ortfuse.feeds import random_feeds
from ortfuse.search import legal


def _encoder_block(k: int = 64):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, k)) * 0.2).astype(np.float16)
    b = rng.standard_normal(k).astype(np.float16)
    return model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Relu", ["z"], ["r"]),
                  node("Sigmoid", ["r"], ["s"]), node("Mul", ["s", "r"], ["out"])],
                 [vi("x", TP.FLOAT16, ["n", k])], [vi("out", TP.FLOAT16, None)],
                 [const("w", w, np.float16), const("b", b, np.float16)])


def _stand_in(times, calls):
    """Runs the model on ORT CPU (so it must be a valid model) and reports the time the test set."""
    def timer(m: onnx.ModelProto, feeds, fused: bool) -> float:
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        sess.run(None, dict(feeds))
        calls.append(fused)
        return times["ours"] if fused else times["ort"]
    return timer


def test_region_model_and_fused_model_agree_on_cpu():
    m = _encoder_block()
    res = compile_model(m, {"x": (4, 64)}, "sm_90")
    k = res.kernels[0]
    sub = prof.region_model(res.graph, k.region, {})
    fused = prof.fused_model(sub, k.node)
    feeds = random_feeds(sub, None, seed=1)
    a = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert [n.domain for n in fused.graph.node] == ["ortfuse"]
    np.testing.assert_array_equal(a[0], b[0])


def test_fused_model_of_a_tap_major_conv_gets_its_permuted_weight():
    # the profiled sub-model carries the weight transposed for the kernel, and still runs on ORT CPU
    from helpers import conv_silu_residual
    m, _, at = conv_silu_residual(TP.FLOAT16, 32, 16, 3, 1, (1, 1, 1, 1), 1, 6)
    res = compile_model(m, at(1), "sm_90")
    k = res.kernels[0]
    assert k.node.input_perms == (("w", (0, 2, 3, 1)),)
    sub = prof.region_model(res.graph, k.region, {})
    fused = prof.fused_model(sub, k.node)
    assert [n.input[1] for n in fused.graph.node] == ["w__ortfuse_t0231"]
    feeds = random_feeds(sub, None, seed=1)
    a = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("ours,keep", [(5.0, True), (50.0, False)])
def test_profile_keeps_only_regions_faster_than_ort(monkeypatch, tmp_path, ours, keep):
    calls: list[bool] = []
    monkeypatch.setattr(prof, "cuda_timer", _stand_in({"ort": 10.0, "ours": ours}, calls))
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    opts = Options(archs=(90,), cache=tmp_path, profile=True)
    res = compile_model(_encoder_block(), {"x": (4, 64)}, "sm_90", options=opts)
    assert len(res.placements) == 1 and res.placements[0].keep == keep
    assert len(res.kernels) == (1 if keep else 0)
    assert any(n.domain == "ortfuse" for n in res.model.graph.node) == keep
    # cached: the same optimize measures nothing again
    n = len(calls)
    compile_model(_encoder_block(), {"x": (4, 64)}, "sm_90", options=opts)
    assert len(calls) == n


@pytest.mark.parametrize("padded_us,padded", [(5.0, True), (30.0, False)])
def test_profile_measures_the_padding_of_a_misaligned_gemm(monkeypatch, tmp_path, padded_us, padded):
    # an LM head of 1001 fp16 columns left to cuBLAS: --profile times ORT's MatMul as it is against the padded
    # MatMul + Slice (rewriter.gemm_padding) and pads only where that is faster, whatever the cost model says
    rng = np.random.default_rng(0)
    m = model([node("MatMul", ["x", "w"], ["logits"])], [vi("x", TP.FLOAT16, ["batch", 16, 64])],
              [vi("logits", TP.FLOAT16, ["batch", 16, 1001])],
              [const("w", rng.standard_normal((64, 1001)) * 0.1, np.float16)])
    seen: list[tuple[str, ...]] = []

    def timer(sub: onnx.ModelProto, feeds, fused: bool) -> float:
        outs = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(feeds))
        assert outs[0].shape[-1] == 1001
        ops = tuple(n.op_type for n in sub.graph.node)
        seen.append(ops)
        return {("MatMul",): 20.0, ("MatMul", "Slice"): padded_us}[ops]
    monkeypatch.setattr(prof, "cuda_timer", timer)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    assert ("Slice" in [n.op_type for n in res.model.graph.node]) == padded
    assert seen == [("MatMul",), ("MatMul", "Slice")] * 2  # at the hint and at batch 32
    rep = check_models(m, res.model)
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("unsplit_us,split_kept", [((4.0, 4.0), False), ((9.0, 9.0), True), ((9.0, 3.0), "by size")])
def test_profile_times_attention_with_and_without_its_key_split(monkeypatch, tmp_path, unsplit_us, split_kept):
    # an attention kernel that splits keys across a cluster at small batches is also timed with its keys in one
    # block (split_k 1, the same kernel), and the faster goes into the model
    from helpers import packed_attention

    def timer(sub: onnx.ModelProto, feeds, fused: bool) -> float:
        ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(feeds))
        if not fused:
            return 20.0
        (n,) = [n for n in sub.graph.node if n.domain == "ortfuse"]
        return 6.0 if any(a.name == "split_k" for a in n.attribute) else unsplit_us[feeds["x"].shape[0] > 1]
    monkeypatch.setattr(prof, "cuda_timer", timer)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    m = packed_attention(TP.FLOAT16, 2, 64)
    res = compile_model(m, {"x": ("batch", 256, 384)}, "sm_90", options=Options(archs=(90,), cache=tmp_path,
                                                                                profile=True))
    (k,) = [k for k in res.kernels if k.region.kind == "attention"]
    (pl,) = [p for p in res.placements if p.region == k.region.id]
    (split, _), (unsplit, _) = pl.ours_us
    assert len(split) == 1 and split[0] > 1 and unsplit == prof.UNSPLIT and pl.keep
    assert "keys unsplit" in pl.line()
    (n,) = [n for n in res.model.graph.node if n.domain == "ortfuse"]
    if split_kept == "by size":  # split at batch 1, unsplit at batch 32: kernel variants, each its own split_k
        assert pl.tile == split and [t for _, t in pl.variants] == [prof.UNSPLIT]
        assert [a.name for a in n.attribute if a.name.startswith("split_k")] == ["split_k"]  # the first's only
        rep = check_models(m, res.model, input_shapes={"x": (3, 256, 384), "mask": (3, 1, 1, 256)})
        assert rep.ok, "\n".join(rep.lines())
        return
    assert (k.spec.split_k > 1) == split_kept
    assert any(a.name == "split_k" for a in n.attribute) == split_kept


def test_a_header_change_measures_our_kernels_again_but_not_orts(monkeypatch, tmp_path):
    # the kernel source names its headers (ortfuse_gemm.h ...) without their text: a new epilogue in a
    # header is a new kernel, so its cached time must not be reused; ORT's side is unchanged
    calls: list[bool] = []
    monkeypatch.setattr(prof, "cuda_timer", _stand_in({"ort": 10.0, "ours": 5.0}, calls))
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    opts = Options(archs=(90,), cache=tmp_path, profile=True)
    compile_model(_encoder_block(), {"x": (4, 64)}, "sm_90", options=opts)
    first = list(calls)
    assert True in first and False in first
    monkeypatch.setattr(prof, "headers_digest", lambda: "another header text")
    compile_model(_encoder_block(), {"x": (4, 64)}, "sm_90", options=opts)
    again = calls[len(first):]
    assert again and all(again)  # only our kernels were timed again


def test_profile_picks_the_fastest_tile(monkeypatch, tmp_path):
    # mma.sync tiles (wgmma and TMA tiles of one geometry print the same template head)
    res0 = compile_model(_encoder_block(), {"x": (512, 64)}, "sm_90", options=Options(archs=(90,), wgmma=False))
    tiles = res0.kernels[0].spec.tiles
    assert len(tiles) >= 2
    timer = _stand_in({"ort": 100.0, "ours": 50.0}, [])

    def by_tile(m, feeds, fused):  # the last candidate is the fastest
        us = timer(m, feeds, fused)
        if fused:
            src = next(onnx.helper.get_attribute_value(a) for n in m.graph.node for a in n.attribute
                       if a.name == "source").decode()
            for i, t in enumerate(tiles):
                if f"run<__half, {', '.join(map(str, t[:6]))}," in src:
                    return 9.0 - i
        return us
    monkeypatch.setattr(prof, "cuda_timer", by_tile)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(_encoder_block(), {"x": (512, 64)}, "sm_90", options=Options(archs=(90,), cache=tmp_path,
                                                                                    profile=True, wgmma=False))
    assert res.placements[0].tile == tiles[-1] and res.placements[0].keep
    assert f"run<__half, {', '.join(map(str, tiles[-1][:6]))}," in res.kernels[0].compiled.source


@pytest.mark.parametrize("split_wins", [True, False])
def test_profile_measures_split_k_against_the_same_tile_unsplit(monkeypatch, tmp_path, split_wins):
    # few tiles over a long K: the best tile splits K; --profile also times it unsplit and keeps the faster
    m, k = _encoder_block(k=2048), 2048
    res0 = compile_model(m, {"x": (16, k)}, "sm_90")
    tiles = res0.kernels[0].spec.tiles
    best = tiles[0]
    assert best[6] > 1 and tiles[1] == (*best[:6], 1)

    def timer(mm, feeds, fused):
        src = next((onnx.helper.get_attribute_value(a).decode() for n in mm.graph.node for a in n.attribute
                    if a.name == "source"), "")
        if not fused:
            return 100.0
        if f"run<__half, {', '.join(map(str, best[:6]))}," not in src:
            return 50.0  # other tiles
        return (5.0 if split_wins else 9.0) if f"NoConv, {best[6]}>" in src else 7.0
    monkeypatch.setattr(prof, "cuda_timer", timer)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, {"x": (16, k)}, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    pl = res.placements[0]
    assert pl.keep and pl.tile == (best if split_wins else tiles[1])
    fused = next(n for n in res.model.graph.node if n.domain == "ortfuse")
    assert read_launch(fused).split_k == (best[6] if split_wins else 1)
    assert ("split-K" in pl.line()) and prof.tile_label(tiles[1]) in pl.line()


def test_identical_layers_are_measured_once(monkeypatch, tmp_path):
    k = 32
    rng = np.random.default_rng(5)
    nodes, inits, src = [], [], "x"
    for i in range(3):  # same shapes, different weights and names
        nodes += [node("MatMul", [src, f"w{i}"], [f"y{i}"]), node("Add", [f"y{i}", f"b{i}"], [f"r{i}"])]
        inits += [const(f"w{i}", rng.standard_normal((k, k)).astype(np.float16), np.float16),
                  const(f"b{i}", rng.standard_normal(k).astype(np.float16), np.float16)]
        src = f"r{i}"
    m = model(nodes, [vi("x", TP.FLOAT16, [8, k])], [vi(src, TP.FLOAT16, None)], inits)
    calls: list[bool] = []
    monkeypatch.setattr(prof, "cuda_timer", _stand_in({"ort": 10.0, "ours": 5.0}, calls))
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    assert len(res.placements) == 3 and all(p.keep for p in res.placements)
    # one ORT measurement of the three identical regions, one of their GEMM alone (cuBLAS + our epilogue)
    assert calls.count(False) == 2


def _layernorm_block(k: int = 32):
    rng = np.random.default_rng(1)
    c = lambda name, shape: const(name, (rng.standard_normal(shape) * 0.3).astype(np.float16), np.float16)  # noqa: E731
    return model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Add", ["z", "x"], ["s"]),
                  node("LayerNormalization", ["s", "g"], ["out"], axis=-1)],
                 [vi("x", TP.FLOAT16, [16, k])], [vi("out", TP.FLOAT16, None)],
                 [c("w", (k, k)), c("b", k), c("g", k)])


def _gelu_block(k: int = 32):
    rng = np.random.default_rng(2)
    c = lambda name, shape: const(name, (rng.standard_normal(shape) * 0.3).astype(np.float16), np.float16)  # noqa: E731
    half = lambda name, v: const(name, np.array(v, np.float16), np.float16)  # noqa: E731
    return model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]),
                  node("Div", ["z", "sqrt2"], ["d"]), node("Erf", ["d"], ["e"]), node("Add", ["e", "one"], ["e1"]),
                  node("Mul", ["z", "e1"], ["p"]), node("Mul", ["p", "half"], ["out"])],
                 [vi("x", TP.FLOAT16, [16, k])], [vi("out", TP.FLOAT16, None)],
                 [c("w", (k, k)), c("b", k), half("sqrt2", 1.4142135), half("one", 1.0), half("half", 0.5)])


@pytest.mark.parametrize("fused_us,split_wins", [(4.0, False), (8.0, True)])
@pytest.mark.parametrize("build,kind", [(_layernorm_block, "rowreduce"), (_gelu_block, "pointwise")],
                         ids=["row-wise", "element-wise"])
def test_epilogue_is_measured_against_cublas_plus_our_kernel(monkeypatch, tmp_path, fused_us, split_wins, build, kind):
    # Collage: ORT runs the whole region in 10 us and the GEMM alone in 3 us; our kernel for the epilogue alone
    # (a LayerNorm, or a GELU) takes 2 us, so the split (5 us) wins unless the fused kernel is faster still
    def timer(m: onnx.ModelProto, feeds, fused: bool) -> float:
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(feeds))
        if not fused:
            return 3.0 if [n.op_type for n in m.graph.node] == ["MatMul"] else 10.0
        src = next(onnx.helper.get_attribute_value(a) for a in m.graph.node[0].attribute if a.name == "source")
        return fused_us if b"ortfuse_gemm.h" in src else 2.0
    monkeypatch.setattr(prof, "cuda_timer", timer)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(build(), None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    [pl] = res.placements
    assert pl.split_us == (5.0,) and pl.split == split_wins and pl.keep == (not split_wins)
    fused_kind = "gemm_row" if kind == "rowreduce" else "gemm"
    assert [k.region.kind for k in res.kernels] == ([kind] if split_wins else [fused_kind])
    assert [n.op_type for n in res.model.graph.node if n.domain != "ortfuse"] == (["MatMul"] if split_wins else [])
    assert ("split: cuBLAS + ours" in pl.line()) == split_wins
    assert check_models(build(), res.model, emulate=True).ok


@pytest.mark.parametrize("big_ours,keep", [(100.0, False), (30.0, True)])
def test_profile_times_a_symbolic_batch_at_its_hint_and_at_profile_batch(monkeypatch, tmp_path, big_ours, keep):
    # ours wins at batch 1 (5 vs 10 us); at batch 32 ORT takes 40 us: ours at 100 us loses overall
    # (geometric mean of 0.5 and 2.5 > 1), at 30 us wins
    def timer(m: onnx.ModelProto, feeds, fused: bool) -> float:
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(feeds))
        batch = m.graph.input[0].type.tensor_type.shape.dim[0].dim_value
        return {(1, False): 10.0, (1, True): 5.0, (32, False): 40.0, (32, True): big_ours}[(batch, fused)]
    monkeypatch.setattr(prof, "cuda_timer", timer)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(_encoder_block(), None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    [pl] = res.placements
    assert pl.bindings == ("n=1", "n=32") and pl.ort_us == (10.0, 40.0) and pl.keep == keep
    assert pl.best_us == (5.0, big_ours) and "region 0 (n=1 / n=32): ORT 10.0/40.0 us" in pl.line()
    assert abs(pl.speedup - (np.sqrt(2 * 40 / big_ours) if keep else 1.0)) < 1e-9
    assert len(res.kernels) == (1 if keep else 0)
    from ortfuse.report import markdown
    row = "| 0 | 10.0/40.0 |"
    md = markdown(res, "m.onnx")
    assert "(n=1 / n=32)" in md and row in md and (f"{pl.speedup:.2f}x |" in md)
    # --profile-batch 0: the hint alone, where ours wins
    res = compile_model(_encoder_block(), None, "sm_90",
                        options=Options(archs=(90,), cache=tmp_path, profile=True, profile_batch=0))
    assert res.placements[0].bindings == ("n=1",) and res.placements[0].keep


def test_profiled_sub_models_get_the_shape_tensors_their_region_reads(monkeypatch, tmp_path):
    # A Range whose length is a run-time dim (Shape -> Gather outside the region) and a bool Where: the
    # region reads the length but the kernel does not (`legal.shape_reads`), so the stock-ORT sub-model must
    # carry it as a constant of the binding (2026-11-25, H100: every zoo transformer failed here with "not a
    # graph input, initializer, or output"); the rank-0 bool feed must reach ORT as an array.
    m = model([node("Shape", ["ids"], ["sh"]), node("Gather", ["sh", "one"], ["s"]),
               node("Range", ["zero", "s", "one"], ["p"]), node("Unsqueeze", ["p", "ax0"], ["p2"]),
               node("Unsqueeze", ["p", "ax1"], ["q2"]), node("LessOrEqual", ["p2", "q2"], ["causal"]),
               node("Cast", ["mask"], ["mb"], to=TP.BOOL), node("Unsqueeze", ["mb", "ax1"], ["mb2"]),
               node("And", ["causal", "mb2"], ["keep"]), node("Where", ["keep", "z", "ninf"], ["bias"]),
               node("Neg", ["ids_f"], ["n"]), node("Add", ["n", "bias"], ["out"])],
              [vi("ids", TP.INT64, ["batch", "seq"]), vi("mask", TP.INT64, ["batch", "seq"]),
               vi("ids_f", TP.FLOAT, ["batch", 1, "seq", "seq"])],
              [vi("out", TP.FLOAT, None)],
              [const("one", 1, np.int64), const("zero", 0, np.int64), const("ax0", [0], np.int64),
               const("ax1", [1], np.int64), const("z", 0.0, np.float32), const("ninf", -10000.0, np.float32)])
    plain = compile_model(m, None, "sm_90")
    reads = [legal.shape_reads(plain.graph, k.region.nodes, k.region.inputs) for k in plain.kernels]
    assert any(reads), "the region must read a run-time shape tensor for this test to mean anything"
    calls: list[bool] = []
    monkeypatch.setattr(prof, "cuda_timer", _stand_in({"ort": 10.0, "ours": 5.0}, calls))
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    assert calls and all(p.keep for p in res.placements)
    for k in res.kernels:  # at two bindings, the sub-model's outputs match the fused model's
        for dims in ({"batch": 2, "seq": 5}, {"batch": 3, "seq": 9}):
            sub = prof.region_model(res.graph, k.region, dims)
            feeds = random_feeds(sub, None, seed=2)
            a = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
            b = ort.InferenceSession(prof.fused_model(sub, k.node).SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, feeds)
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


def test_random_feeds_of_rank_0_inputs_are_arrays():
    # ORT refuses numpy scalars ("Unable to handle object of type numpy.bool"): a profiled sub-model can
    # have rank-0 inputs (BERT's and GPT-2's mask regions, 2026-11-25)
    m = model([node("Where", ["c", "x", "y"], ["out"])],
              [vi("c", TP.BOOL, []), vi("x", TP.FLOAT, []), vi("y", TP.FLOAT, [])], [vi("out", TP.FLOAT, None)], [])
    feeds = random_feeds(m, None, seed=0)
    assert all(isinstance(v, np.ndarray) and v.shape == () for v in feeds.values())
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_placements_carry_the_cost_models_estimates(monkeypatch, tmp_path):
    # what the search assumed next to what was measured, at the same bindings, in the line and the report
    from ortfuse import report
    from ortfuse.bench.gpu_suite import model_check
    monkeypatch.setattr(prof, "cuda_timer", _stand_in({"ort": 10.0, "ours": 5.0}, []))
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    m = _encoder_block()
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    pl = res.placements[0]
    assert len(pl.bindings) == 2 and len(pl.model_ort_us) == 2 and len(pl.model_ours_us) == 2
    assert all(t > 0 for t in (*pl.model_ort_us, *pl.model_ours_us))
    assert pl.model_ours_us[1] > pl.model_ours_us[0]  # the batch-32 binding is estimated slower than the hint
    assert "cost model: ORT" in pl.line() and "cost model: ORT, ours" in report.markdown(res, "m.onnx")
    rows = model_check(res)
    assert [(r["kind"], r["ours_us"], r["ort_us"]) for r in rows] == [("gemm", [5.0, 5.0], [10.0, 10.0])]


def test_large_batch_binding_evaluates_dims_derived_from_the_batch():
    # a flatten before the GEMM gives its input a dim "128*batch": at the batch-32 binding the sub-model must
    # be 4096 rows, not the hint's 128 (as cost.bindings evaluates it)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 64)) * 0.2).astype(np.float16)
    m = model([node("Reshape", ["x", "shp"], ["r"]), node("MatMul", ["r", "w"], ["y"]), node("Add", ["y", "b"], ["z"]),
               node("Relu", ["z"], ["out"])],
              [vi("x", TP.FLOAT16, ["batch", 128, 64])], [vi("out", TP.FLOAT16, None)],
              [const("shp", [-1, 64], np.int64), const("w", w, np.float16),
               const("b", rng.standard_normal(64).astype(np.float16), np.float16)])
    res = compile_model(m, None, "sm_90")
    k = next(k for k in res.kernels if k.region.kind == "gemm")
    (hint, _), (big_label, big) = prof.profile_bindings(res.graph, 32)
    assert big_label == "batch=32"
    rows = [prof.region_model(res.graph, k.region, dims).graph.input[0].type.tensor_type.shape.dim[0].dim_value
            for dims in ({}, big)]
    assert rows == [128, 4096]


def _by_source_and_size(rule):
    """A stand-in timer for our kernels by their source and the batch (feeds of more than one row): ORT's
    sub-models take 100 us, ours `rule(source, big)`; every model still runs on ORT CPU."""
    timer = _stand_in({"ort": 100.0, "ours": 50.0}, [])

    def time(sub, feeds, fused):
        us = timer(sub, feeds, fused)
        if not fused:
            return us
        src = next(onnx.helper.get_attribute_value(a) for n in sub.graph.node for a in n.attribute
                   if a.name == "source").decode()
        return rule(src, next(iter(feeds.values())).shape[0] > 1)
    return time


def test_profile_ships_one_kernel_per_size_class_where_the_fastest_tile_changes(monkeypatch, tmp_path):
    # a symbolic batch profiled at n = 1 and n = 32: the stand-in makes the first candidate fastest at 1 and
    # the second at 32, by far; the node carries both, the second from sqrt(1 * 32) = 6 rows on, and each
    # runs (in emulation) where the library would pick it
    from ortfuse.check import check_models
    m = _encoder_block()
    res0 = compile_model(m, None, "sm_90", options=Options(archs=(90,), wgmma=False))
    tiles = res0.kernels[0].spec.tiles
    heads = [f"run<__half, {', '.join(map(str, t[:6]))}," for t in tiles]
    assert heads[0] != heads[1]
    fastest = _by_source_and_size(lambda src, big: 10.0 if heads[1 if big else 0] in src else 30.0)
    monkeypatch.setattr(prof, "cuda_timer", fastest)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True, wgmma=False))
    (pl,) = res.placements
    assert pl.keep and pl.tile == tiles[0] and pl.variants == ((6, tiles[1]),) and pl.best_us == (10.0, 10.0)
    (k,) = res.kernels
    assert [frm for frm, _, _ in k.variants] == [6] and heads[1] in k.variants[0][2].source
    assert res.kernels_compiled == 2  # both counted in the summary
    node = next(n for n in res.model.graph.node if n.domain == "ortfuse")
    launch = read_launch(node)
    assert launch.variant_rows == (-1,) and [frm for frm, _ in launch.variants] == [6]
    assert heads[0] in launch.pick([5]).source and heads[1] in launch.pick([6]).source
    for n in (3, 40):
        rep = check_models(m, res.model, emulate=True, input_shapes={"x": (n, 64)})
        assert rep.ok and len(rep.kernels) == 1, "\n".join(rep.lines())


def test_no_kernel_variants_when_they_gain_little(monkeypatch, tmp_path):
    # the fastest tile changes with the batch, but by 2% only: one kernel
    m = _encoder_block()
    res0 = compile_model(m, None, "sm_90", options=Options(archs=(90,), wgmma=False))
    heads = [f"run<__half, {', '.join(map(str, t[:6]))}," for t in res0.kernels[0].spec.tiles]
    monkeypatch.setattr(prof, "cuda_timer", _by_source_and_size(lambda src, big: 10.0 if (heads[1] in src) == big else 10.2))
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True, wgmma=False))
    assert res.placements[0].variants == () and res.kernels[0].variants == ()
    assert "variants" not in {a.name for n in res.model.graph.node for a in n.attribute}


def test_kernel_variants_never_mix_weight_layouts(monkeypatch, tmp_path):
    # mma.sync reads the weight as stored, wgmma transposed offline: one node stores it once, so the fastest
    # mma.sync tile at batch 1 and the fastest wgmma tile at batch 32 cannot share a node
    rng = np.random.default_rng(0)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Relu", ["y"], ["out"])], [vi("x", TP.FLOAT16, ["b", 128, 256])],
              [vi("out", TP.FLOAT16, None)], [const("w", rng.standard_normal((256, 256)) * 0.1, np.float16)])
    wgmma_big = _by_source_and_size(lambda src, big: 10.0 if src.startswith("// ortfuse: arch-specific") == big else 30.0)
    monkeypatch.setattr(prof, "cuda_timer", wgmma_big)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True, wgmma=True))
    (pl,) = res.placements
    assert {len(t) > 7 and t[7] > 0 for t, _ in pl.ours_us} == {False, True}  # both families measured
    assert pl.variants == () and res.kernels[0].variants == ()


@pytest.mark.parametrize("wgmma,k", [(True, 256), (False, 512)], ids=["wgmma+TMA", "mma.sync"])
def test_without_profile_the_tile_model_ships_a_kernel_per_size_class(wgmma, k):
    # y = relu(x @ w + b), x [batch, 32, k]: the tile model ranks another tile best at batch 32 (1024 rows)
    # than at batch 1 (32 rows), by more than VARIANT_GAIN; without --profile the node carries both, the
    # second from sqrt(32 * 1024) = 181 rows on, as `by_size` sets it from the model's estimates. Each runs
    # (in emulation) where the library picks it. (--profile builds its variants from measurements instead.)
    rng = np.random.default_rng(0)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Relu", ["z"], ["out"])],
              [vi("x", TP.FLOAT16, ["batch", 32, k])], [vi("out", TP.FLOAT16, None)],
              [const("w", rng.standard_normal((k, 512)) * 0.05, np.float16),
               const("b", rng.standard_normal(512), np.float16)])
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), wgmma=wgmma))
    (kern,) = res.kernels
    spec = kern.spec
    assert spec.binding_rows == (32, 1024)
    first, more, _ = prof.by_size(spec.tile_us, spec.binding_rows, spec.tile_us[0][1])
    assert first is not None and [frm for frm, _ in more] == [181]
    assert [frm for frm, _, _ in kern.variants] == [181] and res.kernels_compiled == 2
    best = {b: min(spec.tile_us, key=lambda t: t[1][b])[0] for b in (0, 1)}  # each binding's own best
    assert (first, more[0][1]) == (best[0], best[1]) and best[0] != best[1]
    launch = read_launch(next(n for n in res.model.graph.node if n.domain == "ortfuse"))
    assert launch.pick([5]).source == kern.compiled.source  # the batch dim: 160 rows, then 192
    assert launch.pick([6]).source == kern.variants[0][2].source != kern.compiled.source
    for batch in (1, 8):  # 32 and 256 rows: one on each side
        rep = check_models(m, res.model, emulate=True, input_shapes={"x": (batch, 32, k)})
        assert rep.ok and len(rep.kernels) == 1, "\n".join(rep.lines())


def test_tile_families_are_compared_by_the_kernels_by_size_they_would_ship():
    # Llama's gate GEMM (SmolLM-135M: 576 -> 1536, SiLU): the TMA family's single best tile over batch 1 and
    # 32 is 64 x 64, 2.4x its 128 x 192 at batch 32, so judged by that one tile it lost to mma.sync; judged
    # by the kernels by size it ships (64 x 64 below 724 rows, 128 x 192 from there) it wins both
    rng = np.random.default_rng(0)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Sigmoid", ["y"], ["s"]), node("Mul", ["y", "s"], ["out"])],
              [vi("x", TP.FLOAT16, ["batch", 128, 576])], [vi("out", TP.FLOAT16, None)],
              [const("w", rng.standard_normal((576, 1536)) * 0.05, np.float16)])
    res = compile_model(m, None, "sm_90")
    (kern,) = res.kernels
    assert kern.spec.kernel.tma and [frm for frm, _, _ in kern.variants] == [724]
    assert all(spec.kernel.tma for _, spec in kern.all_kernels())
    rep = check_models(m, res.model, emulate=True, input_shapes={"x": (1, 128, 576)})
    assert rep.ok and len(rep.kernels) == 1, "\n".join(rep.lines())


def test_no_size_variants_for_a_fixed_batch():
    m = _encoder_block()  # x [n, 64] with n fixed by --input-shape: one binding, one kernel
    res = compile_model(m, {"x": (4, 64)}, "sm_90", options=Options(archs=(90,), wgmma=False))
    assert res.kernels[0].spec.binding_rows == () and res.kernels[0].variants == ()


def test_profile_can_ship_the_unranked_tma_mainloops_as_size_variants(monkeypatch, tmp_path):
    # the stand-in makes the ping-pong candidate fastest at batch 1 and the B-multicast one at batch 32: the
    # node carries both (kernel variants by size, each with its own launch rule: clusters of 2 for the
    # multicast one), and each runs in emulation where the library would pick it
    rng = np.random.default_rng(0)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Relu", ["z"], ["out"])],
              [vi("x", TP.FLOAT16, ["n", 128, 128])], [vi("out", TP.FLOAT16, None)],
              [const("w", (rng.standard_normal((128, 128)) * 0.2).astype(np.float16), np.float16),
               const("b", rng.standard_normal(128).astype(np.float16), np.float16)])
    tiles = compile_model(m, None, "sm_90", options=Options(archs=(90,))).kernels[0].spec.tiles
    pp = next(t for t in tiles if t[7:] == (4,))
    mc = next(t for t in tiles if t[7:] == (3,))
    heads = {t: f"run<__half, {', '.join(map(str, t[:6]))}," for t in (pp, mc)}
    tails = {pp: ", 1, 1>", mc: ", 2, 0>"}  # the template's MC and PP

    def fast(src: str, big: bool) -> float:
        t = mc if big else pp
        return 10.0 if heads[t] in src and tails[t] in src else 30.0
    monkeypatch.setattr(prof, "cuda_timer", _by_source_and_size(fast))
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    (pl,) = res.placements
    assert pl.keep and pl.tile == pp and pl.variants == ((724, mc),)
    launch = read_launch(next(n for n in res.model.graph.node if n.domain == "ortfuse"))
    assert (launch.pick([5]).multicast, launch.pick([6]).multicast) == (1, 2)  # 5 x 128 rows < 724 <= 6 x 128
    assert launch.pick([6]).tma[1][1] == mc[1] // 2  # each block of a pair copies half of B's box
    for n in (3, 40):
        rep = check_models(m, res.model, emulate=True, input_shapes={"x": (n, 128, 128)})
        assert rep.ok and len(rep.kernels) == 1, "\n".join(rep.lines())


def test_a_candidate_that_fails_on_the_device_loses_and_the_profile_goes_on(monkeypatch, tmp_path):
    # a kernel the device refuses (a cluster launch it cannot take, a trap) is timed as inf, not cached, and
    # named in the placement; the other candidates decide. A region whose only kernel fails stays with ORT.
    timer = _stand_in({"ort": 100.0, "ours": 50.0}, [])
    rng = np.random.default_rng(1)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Relu", ["z"], ["out"])],
              [vi("x", TP.FLOAT16, ["n", 128, 128])], [vi("out", TP.FLOAT16, None)],
              [const("w", (rng.standard_normal((128, 128)) * 0.2).astype(np.float16), np.float16),
               const("b", rng.standard_normal(128).astype(np.float16), np.float16)])
    pp = [t for t in compile_model(m, None, "sm_90", options=Options(archs=(90,))).kernels[0].spec.tiles
          if t[7:] == (4,)]
    # a ping-pong kernel's template head ends in its MC = 1, PP = 1
    pingpong = re.compile(r"ofz::gemm::run<__half, (\d+, ){9}\w+, 0, ofz::gemm::NoConv, 1, ofz::gemm::NoFold, 1, 0, 1, 1>")

    def failing(sub, feeds, fused):
        if fused:
            src = next(onnx.helper.get_attribute_value(a) for n in sub.graph.node for a in n.attribute
                       if a.name == "source").decode()
            if pingpong.search(src) or "gemm::run<" not in src:  # the ping-pong tiles, and non-GEMM kernels
                raise RuntimeError("CUDA driver error: cluster misconfiguration")
        return timer(sub, feeds, fused)
    monkeypatch.setattr(prof, "cuda_timer", failing)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    (pl,) = res.placements
    assert pp and [t for t, _ in pl.failed] == pp and "cluster misconfiguration" in pl.failed[0][1]
    assert all(ts == (float("inf"),) * 2 for t, ts in pl.ours_us if t in pp)
    assert pl.keep and pl.tile not in pp and "failed: RuntimeError" in pl.line()
    # nothing of the failure was cached: with a timer that works, the tile is measured
    monkeypatch.setattr(prof, "cuda_timer", timer)
    again = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    assert not again.placements[0].failed
    # an element-wise region whose one kernel fails stays with ORT
    monkeypatch.setattr(prof, "cuda_timer", failing)
    ew = model([node("Sigmoid", ["x"], ["s"]), node("Mul", ["s", "x"], ["p"]), node("Tanh", ["p"], ["out"])],
               [vi("x", TP.FLOAT16, [512, 64])], [vi("out", TP.FLOAT16, None)], [])
    res = compile_model(ew, None, "sm_90", options=Options(archs=(90,), cache=tmp_path / "ew", profile=True))
    (pl,) = res.placements
    assert pl.failed and pl.ours_us[0][1] == (float("inf"),) and not pl.keep
    assert [n.op_type for n in res.model.graph.node] == ["Sigmoid", "Mul", "Tanh"]


def test_a_gated_mlp_placed_with_ort_gets_its_two_gemms_back(monkeypatch, tmp_path):
    # the gate and up weights were interleaved for one gated GEMM kernel; when --profile finds ORT faster (and
    # cuBLAS + our epilogue too), ORT runs the region: as the model's two MatMuls, not the packed one plus a
    # strided copy of each half
    from helpers import gated_mlp
    m, (wg, _), (wu, _) = gated_mlp(TP.FLOAT16, 64, 96, ["n", 16])
    calls: list[bool] = []
    monkeypatch.setattr(prof, "cuda_timer", _stand_in({"ort": 10.0, "ours": 50.0}, calls))
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    res = compile_model(m, {"x": (2, 16, 64)}, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    assert calls and not res.kernels
    ops = [n.op_type for n in res.model.graph.node]
    assert ops.count("MatMul") == 2 and "Slice" not in ops, ops
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in res.model.graph.initializer}
    weights = sorted((inits[n.input[1]] for n in res.model.graph.node if n.op_type == "MatMul"), key=lambda a: a[0, 0])
    got = sorted([wg.view(np.float16), wu.view(np.float16)], key=lambda a: a[0, 0])
    for a, b in zip(weights, got):
        np.testing.assert_array_equal(a, b)
    rep = check_models(m, res.model, input_shapes={"x": (2, 16, 64)})
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("mha_us,taken", [(5.0, True), (12.0, False)])
def test_profile_times_ort_multiheadattention_beside_ours_and_ort_ops(monkeypatch, tmp_path, mha_us, taken):
    # an attention pattern ORT's MultiHeadAttention computes is timed three ways (its region's ORT ops, our
    # kernel, MultiHeadAttention on the same feeds) and goes to MultiHeadAttention only where that is fastest
    from helpers import plain_attention
    seen: list[str] = []

    def timer(sub: onnx.ModelProto, feeds, fused: bool) -> float:
        ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, dict(feeds))
        kind = "mha" if any(n.op_type == "MultiHeadAttention" for n in sub.graph.node) else \
            "ours" if fused else "ort"
        seen.append(kind)
        return {"mha": mha_us, "ours": 9.0, "ort": 20.0}[kind]
    monkeypatch.setattr(prof, "cuda_timer", timer)
    monkeypatch.setattr(prof, "device_name", lambda: "test-device")
    m = plain_attention(TP.FLOAT16, heads=2, head=64, mask="full")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), cache=tmp_path, profile=True))
    assert seen[:6] == ["ort", "mha", "ours"] * 2  # at the hint and at batch 32, before the search
    assert any(n.op_type == "MultiHeadAttention" for n in res.model.graph.node) == taken
    assert [r.kind for r in res.plan.regions].count("attention") == (0 if taken else 1)
    assert f"measured {mha_us}/{mha_us} us, our kernel 9.0/9.0, ORT's unfused ops 20.0/20.0" in res.ort_attention[0]
    rep = check_models(m, res.model, emulate=True, input_shapes={t: (2, 9, 128) for t in "qkv"} | {"mask": (2, 1, 9, 9)})
    assert rep.ok, "\n".join(rep.lines())

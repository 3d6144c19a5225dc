"""sm_90a warpgroup-MMA GEMM kernels (`--wgmma`) on the GPU: what the emulator cannot prove, that the
hardware reads our shared-memory descriptors and swizzle as we think it does. fp16 against the stock ORT
CUDA EP on the original model (normwise 1e-2); bf16 against numpy in fp64 on the rounded operands (1e-2).
Every warpgroup layout is forced once, fed by cp.async and by TMA (the tensor maps the library encodes, the
mbarrier ring, setmaxnreg); split-K runs in clusters. Skipped without a working CUDA EP."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP, helper

import ortfuse
from helpers import assert_cuda_graph_replay, bf16, const, model, node, vi
from ortfuse.api import compile_model, fused_kernel, target_for
from ortfuse.check import check_models, compare
from ortfuse.config import Options
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import ARCH_SPECIFIC_LINE, render
from ortfuse.feeds import random_feeds
from ortfuse.rewriter.replace import replace

pytestmark = pytest.mark.gpu
H, BF = TP.FLOAT16, TP.BFLOAT16
WG = Options(archs=(90,), wgmma=True)


def _w(shape, seed, scale=0.2):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _ffn(k: int = 768, n: int = 3072):
    """BERT's FFN up-projection: bias + GELU (erf form) epilogue, fp16."""
    return model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]),
                  node("Div", ["z", "sq2"], ["d"]), node("Erf", ["d"], ["e"]), node("Add", ["e", "one"], ["e1"]),
                  node("Mul", ["z", "e1"], ["g0"]), node("Mul", ["g0", "half"], ["g"])],
                 [vi("x", H, ["batch", "seq", k])], [vi("g", H, None)],
                 [const("w", _w((k, n), 1), np.float16), const("b", _w(n, 2), np.float16),
                  const("sq2", 1.4142135, np.float16), const("one", 1.0, np.float16), const("half", 0.5, np.float16)])


def _wgmma_count(res) -> int:
    return sum(k.compiled.source.startswith(ARCH_SPECIFIC_LINE) for k in res.kernels)


@pytest.mark.parametrize("shape", [(1, 128), (3, 77), (32, 128)])
def test_ffn_on_wgmma_matches_ort(shape):
    m = _ffn()
    res = compile_model(m, None, "sm_90", options=WG)
    assert _wgmma_count(res) == 1
    rep = check_models(m, res.model, provider="cuda", input_shapes={"x": (*shape, 768)})
    assert rep.ok, "\n".join(rep.lines())


def test_tma_gemm_under_cuda_graph_replay():
    # the tensor maps hold the buffers' addresses: encoded at capture, replayed as captured (IOBinding keeps
    # the buffers), and encoded anew when a plain run gets new buffers
    m = _ffn()
    res = compile_model(m, None, "sm_90", options=WG)
    assert any(k.spec.kernel.tma for k in res.kernels)
    feeds = random_feeds(m, {"x": (2, 64, 768)}, seed=11)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
    plain = ortfuse.InferenceSession(res.model, providers=["CUDAExecutionProvider"])
    for shape in ((2, 64, 768), (3, 77, 768), (2, 64, 768)):  # the library's cached maps re-encoded on change
        f = random_feeds(m, {"x": shape}, seed=shape[1])
        assert compare("g", plain.run(None, f)[0], ref.run(None, f)[0]).ok, shape
    want = ref.run(None, feeds)[0]
    assert_cuda_graph_replay(res.model, feeds, {"g": want})


def test_gemm_trans_b_on_wgmma_matches_ort():
    m = model([node("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=0.5, beta=2.0), node("Tanh", ["y"], ["out"])],
              [vi("x", H, [300, 1024])], [vi("out", H, None)],
              [const("w", _w((768, 1024), 3), np.float16), const("c", _w((768,), 4), np.float16)])
    res = compile_model(m, None, "sm_90", options=WG)
    assert _wgmma_count(res) == 1
    rep = check_models(m, res.model, provider="cuda")
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("shape", [(1, 128), (3, 77)])
def test_misaligned_weight_rows_on_tma_match_ort(shape):
    # N = 1001: the [K][N] weight's rows are misaligned, so the TMA family reads it transposed offline and
    # stores the output's odd rows without vectors (session 20, CPU only until run here)
    m = _ffn(k=256, n=1001)
    res = compile_model(m, None, "sm_90", options=WG)
    (k,) = res.kernels
    assert k.spec.kernel.tma and k.spec.input_perms == (("w", (1, 0)),)
    rep = check_models(m, res.model, provider="cuda", input_shapes={"x": (*shape, 256)})
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("shape", [(100, 7), (600, 7)])
def test_layernorm_fold_on_tma_matches_ort(shape, monkeypatch):
    # LayerNorm + MatMul + bias + GELU with the LayerNorm folded into the TMA kernel (session 20, CPU only
    # until run here): the consumers gather the rows' moments from the swizzled A stages
    from ortfuse.search.cost import CostModel
    monkeypatch.setattr(CostModel, "pays", staticmethod(lambda times: True))
    m = _ffn(k=768, n=3072)
    ln = node("LayerNormalization", ["x0", "gam", "bet"], ["x"], axis=-1, epsilon=1e-5)
    m.graph.node.insert(0, ln)
    m.graph.input[0].name = "x0"
    m.graph.initializer.extend([const("gam", _w(768, 7) + 1.0, np.float16), const("bet", _w(768, 8), np.float16)])
    res = compile_model(m, {"x0": (*shape, 768)}, "sm_90", options=WG)
    (k,) = res.kernels
    assert k.spec.kernel.tma and "LayerNormFold<" in k.compiled.source
    rep = check_models(m, res.model, provider="cuda")
    assert rep.ok, "\n".join(rep.lines())


def _bias_model(M: int, K: int, N: int, dt: int, seed: int = 5):
    """y = x @ w + b with the operands' values as fp64 (after rounding to `dt`)."""
    x, w, b = _w((M, K), seed, 0.3), _w((K, N), seed + 1, 0.3), _w((N,), seed + 2, 0.3)
    if dt == H:
        vals = [a.astype(np.float16) for a in (x, w, b)]
        bits = vals
    else:
        bits, vals = zip(*(bf16(a) for a in (x, w, b)))
    inits = [helper.make_tensor(nm, dt, a.shape, a.tobytes(), raw=True) for nm, a in (("w", bits[1]), ("b", bits[2]))]
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["out"])], [vi("x", dt, [M, K])],
              [vi("out", dt, None)], inits)
    ref = vals[0].astype(np.float64) @ vals[1].astype(np.float64) + vals[2].astype(np.float64)
    return m, bits[0], ref


def _forced(m, tile, staged: bool = False):
    """`m`'s one GEMM region lowered with `tile` forced, as a model for the runtime; `staged`: its output rows
    are not 16-byte aligned, so the kernel stores them through shared memory."""
    res = compile_model(m, None, "sm_90", options=WG)
    (k,) = [k for k in res.kernels if k.region.kind == "gemm"]
    spec = lower(res.graph, k.region, target_for((90,), True), tile=tile)
    fk = fused_kernel(k.region, spec, compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WG.cache))
    assert fk.compiled.source.startswith(ARCH_SPECIFIC_LINE) == (len(tile) > 7)  # the warpgroup families
    assert bool(spec.kernel.ops_consts) == staged
    return replace(res.graph, [fk.node])


def _run(fused, x: np.ndarray, dt: int) -> np.ndarray:
    """`fused`'s output as 16-bit patterns: ORT's Python API has no numpy type for bf16, so the input and
    output are host buffers bound with their ONNX element type (ORT copies the result into `out`)."""
    sess = ortfuse.InferenceSession(fused, providers=["CUDAExecutionProvider"])
    assert sess.fused_kernels
    (o,) = sess.get_outputs()
    out = np.zeros([x.shape[0], int(o.shape[1])], np.uint16)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), dt))
    io.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(out, dt))
    sess.run_with_iobinding(io)
    return out


def _as_f64(bits: np.ndarray, dt: int) -> np.ndarray:
    return (bits.view(np.float16).astype(np.float64) if dt == H else
            (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64))


@pytest.mark.parametrize("tile", [
    (64, 64, 64, 16, 64, 4, 1, 1), (128, 128, 64, 16, 128, 5, 1, 1), (64, 256, 64, 16, 256, 4, 1, 1),
    (128, 256, 64, 16, 128, 4, 1, 1), (256, 64, 64, 16, 64, 4, 1, 1), (128, 256, 64, 16, 256, 4, 1, 1),
    (128, 192, 64, 16, 192, 4, 1, 1),
    # fed by TMA in the warp-specialized pipeline (tensor maps encoded by the library, mbarriers, setmaxnreg)
    (64, 64, 64, 16, 64, 4, 1, 2), (128, 128, 64, 16, 128, 7, 1, 2), (128, 192, 64, 16, 192, 4, 1, 2),
    (128, 256, 64, 16, 256, 4, 1, 2), (64, 256, 64, 16, 128, 3, 1, 2), (256, 64, 64, 16, 64, 2, 1, 2),
])
@pytest.mark.parametrize("dt", [H, BF])
def test_every_warpgroup_layout(tile, dt):
    # partial tiles on every axis (M 1000, K 520, N 776)
    m, x, ref = _bias_model(1000, 520, 776, dt)
    got = _as_f64(_run(_forced(m, tile), x, dt), dt)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("tile,dt", [
    # B multicast across pairs of blocks (TMA multicast, remote mbarrier arrivals, a cluster barrier at exit)
    ((64, 64, 64, 16, 64, 4, 1, 3), H), ((128, 192, 64, 16, 192, 5, 1, 3), H), ((128, 256, 64, 16, 256, 4, 1, 3), H),
    ((64, 256, 64, 16, 128, 3, 1, 3), BF),
    # ping-pong consumer warpgroups (turns through bar.sync / bar.arrive, two m64 halves for 128 rows)
    ((64, 192, 64, 16, 192, 4, 1, 4), H), ((128, 128, 64, 32, 128, 5, 1, 4), H), ((64, 256, 64, 16, 256, 3, 1, 4), BF),
    # both
    ((64, 192, 64, 16, 192, 4, 1, 5), H), ((128, 128, 64, 32, 128, 5, 1, 5), BF),
])
def test_multicast_and_pingpong_layouts(tile, dt):
    # partial tiles on every axis (M 1000, K 520, N 776)
    m, x, ref = _bias_model(1000, 520, 776, dt)
    got = _as_f64(_run(_forced(m, tile), x, dt), dt)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("M,tile", [
    (1100, (128, 192, 64, 16, 192, 5, 1, 3)),  # 9 tiles along M: the last pair's second block computes past M
    (40000, (64, 64, 64, 16, 64, 4, 1, 3)),    # 4,069 pairs: persistent clusters loop over them
    (40000, (64, 128, 64, 16, 128, 4, 1, 4)),  # ping-pong: ~30 tiles per block, turns across them
    (40000, (64, 128, 64, 16, 128, 4, 1, 5)),  # and with B multicast, in persistent pairs
])
def test_odd_pairs_and_persistent_loops(M, tile):
    m, x, ref = _bias_model(M, 520, 776, H, seed=12)
    got = _as_f64(_run(_forced(m, tile), x, H), H)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("tile", [
    (128, 128, 32, 64, 32, 3, 1),         # mma.sync
    (128, 256, 64, 16, 128, 4, 1, 1),     # wgmma fed by cp.async
    (128, 256, 64, 16, 256, 4, 1, 2),     # TMA: the LM head's tile in the H100 sweep
    (64, 64, 64, 16, 64, 4, 1, 2),
    (128, 192, 64, 16, 192, 5, 1, 3),     # B multicast
    (128, 128, 64, 32, 128, 5, 1, 4),     # ping-pong: each warpgroup's warps their own slices
])
@pytest.mark.parametrize("dt", [H, BF])
def test_misaligned_rows_stored_through_shared_memory(tile, dt):
    # N = 777: rows of 1,554 bytes, so every family stages its stores (ortfuse_gemm.h for_each_acc_staged);
    # M 1000 and N ragged against every tile, so whole and partial tiles both run
    m, x, ref = _bias_model(1000, 520, 777, dt, seed=21)
    got = _as_f64(_run(_forced(m, tile, staged=True), x, dt), dt)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("split", [2, 4, 8])
def test_split_k_in_clusters(split):
    m, x, ref = _bias_model(64, 4096, 128, H, seed=9)
    got = _as_f64(_run(_forced(m, (64, 64, 64, 16, 64, 4, split, 1)), x, H), H)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def _gated(M: int = 1000, K: int = 576, N: int = 1536):
    """Llama's MLP up to h: SiLU(x Wg) * (x Wu), fp16 (SmolLM-135M's K and N at M rows)."""
    return model([node("MatMul", ["x", "wg"], ["g"]), node("MatMul", ["x", "wu"], ["u"]),
                  node("Sigmoid", ["g"], ["sg"]), node("Mul", ["g", "sg"], ["a"]), node("Mul", ["a", "u"], ["h"])],
                 [vi("x", H, [M, K])], [vi("h", H, None)],
                 [const("wg", _w((K, N), 31, 0.1), np.float16), const("wu", _w((K, N), 32, 0.1), np.float16)])


@pytest.mark.parametrize("tile", [
    None,                                 # as built
    (128, 128, 32, 64, 32, 3, 1),         # mma.sync
    (128, 256, 64, 16, 128, 4, 1, 1),     # wgmma fed by cp.async
    (128, 128, 64, 16, 128, 7, 1, 2),     # TMA
    (64, 64, 64, 16, 64, 4, 4, 1),        # split-K in clusters of 4
])
def test_gated_mlp_as_one_gemm_matches_ort(tile):
    # gate and up interleaved in one weight, each output column's pair in one fragment (rewriter.gemm_packing,
    # lower_gemm's gated epilogue); M 1000 against every tile's rows. Split-K applies within one wave only
    # (tiles.py), so that tile gets 100 x 512 (packed): 16 tiles of 4 blocks (at M 1000 it was refused on the
    # H100, 2026-11-27)
    m = _gated(M=100, N=256) if len(tile or ()) > 6 and tile[6] > 1 else _gated()
    res = compile_model(m, None, "sm_90", options=WG)
    assert [k.region.kind for k in res.kernels] == ["gemm"]
    fused = _forced(m, tile) if tile else res.model
    rep = check_models(m, fused, provider="cuda")
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_tiny_zoo_with_wgmma_on_gpu(name, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("ORTFUSE_CACHE_DIR", str(tmp_path))
    from ortfuse.bench import zoo
    path = str(zoo.build(name, "fp16", tiny=True))
    res = compile_model(path, None, "sm_90", options=WG)
    assert _wgmma_count(res)
    rep = check_models(path, res.model, provider="cuda")
    assert rep.ok, "\n".join(rep.lines())

"""sm_90a warpgroup-MMA GEMM kernels (ortfuse_gemm.h run_wgmma; opt-in `--wgmma`) in CPU emulation. The
emulator's wgmma reads the 128-byte-swizzled shared tiles through their descriptors as the PTX ISA lays
them out, and fails on a missing proxy fence, on a stage overwritten while a wgmma may still read it and on
a swizzle atom that is not 1024-byte aligned. Every kernel also goes through NVRTC and ptxas for sm_90a.
fp16 against ORT CPU (1e-2 normwise), bf16 against numpy in fp64 on the rounded operands (1e-2). Not
verified here: that the hardware reads the descriptors as the emulator does (tests/runtime's GPU tests)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto as TP, helper

from helpers import bf16, const, launch_spec, model, node, vi
from ortfuse.api import compile_model, target_for
from ortfuse.check import check_models
from ortfuse.config import Options
from ortfuse.customops import tiles as tl
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.emulate import EmulationError, compile_emulated
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import ARCH_SPECIFIC_LINE, render
from ortfuse.errors import CompileError
from ortfuse.report import summary
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.regions import plan

H, BF = TP.FLOAT16, TP.BFLOAT16
WGMMA_OPTS = Options(archs=(90,), wgmma=True)


def _w(shape, seed, scale=0.2):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float16)


def _wgmma_kernels(res):
    return [k for k in res.kernels if k.compiled.source.startswith(ARCH_SPECIFIC_LINE)]


def _bias_relu(m: int, k: int, n: int, dt=H):
    np_t = np.float16
    return model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Relu", ["z"], ["out"])],
                 [vi("x", dt, ["n", m, k])], [vi("out", dt, None)],
                 [const("w", _w((k, n), 1), np_t), const("b", _w(n, 2), np_t)])


def test_matmul_epilogue_on_wgmma_with_the_weight_transposed_offline():
    # K = 136 (a partial k tile), N = 328 and 2 x 200 rows (partial tiles): zero-filled edges
    m = _bias_relu(200, 136, 328)
    res = compile_model(m, {"x": ("n", 200, 136)}, "sm_90", options=WGMMA_OPTS)
    (k,) = _wgmma_kernels(res)
    assert k.spec.input_perms == (("w", (1, 0)),)
    assert k.spec.tiles[0][-1] in (1, 2) and k.spec.block % 128 == 0  # wgmma, fed by cp.async or TMA
    # the other families' best stay --profile candidates: mma.sync (7 entries), wgmma by cp.async (1), by TMA (2),
    # TMA with B multicast (3), TMA to ping-pong warpgroups (4) and both (5)
    assert {t[7] if len(t) > 7 else 0 for t in k.spec.tiles} == {0, 1, 2, 3, 4, 5}
    (cc, r), = k.compiled.resources
    assert cc == 90 and r.spill_bytes == 0 and r.wgmma_serialized == ""
    for rows in (1, 2):
        rep = check_models(m, res.model, emulate=True, input_shapes={"x": (rows, 200, 136)})
        assert rep.ok and len(rep.kernels) == 1, "\n".join(rep.lines())


def test_gemm_trans_b_reads_the_weight_as_stored():
    # Gemm(transB=1): B is [N][K] already, so no copy of the weight; alpha and beta in the epilogue
    w, c = _w((96, 256), 3), _w((96,), 4)
    m = model([node("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=0.5, beta=2.0), node("Tanh", ["y"], ["out"])],
              [vi("x", H, [70, 256])], [vi("out", H, None)], [const("w", w, np.float16), const("c", c, np.float16)])
    res = compile_model(m, None, "sm_90", options=WGMMA_OPTS)
    (k,) = _wgmma_kernels(res)
    assert k.spec.input_perms == ()
    rep = check_models(m, res.model, emulate=True)
    assert rep.ok, "\n".join(rep.lines())


def test_wgmma_is_the_sm90_default_and_can_be_turned_off(monkeypatch):
    # on by default where every target is sm_90 (measured faster end to end on the H200, 2026-11-26); off on
    # request (--no-wgmma, ORTFUSE_WGMMA=0) for a model that runs on later GPUs through PTX; never with sm_80
    monkeypatch.delenv("ORTFUSE_WGMMA", raising=False)
    m, shapes = _bias_relu(256, 256, 256), {"x": ("n", 256, 256)}
    assert Options().wgmma is None and _wgmma_kernels(compile_model(m, shapes, "sm_90"))
    res = compile_model(m, shapes, "sm_90", options=Options(archs=(90,), wgmma=False))
    assert not _wgmma_kernels(res) and "sm_90 GPUs only" not in summary(res)
    assert "sm_90 GPUs only" in summary(compile_model(m, shapes, "sm_90"))
    both = compile_model(m, shapes, "sm_80,sm_90", options=Options(archs=(80, 90)))
    assert not _wgmma_kernels(both) and not target_for((80, 90), True).wgmma and target_for((90,), True).wgmma
    monkeypatch.setenv("ORTFUSE_WGMMA", "0")
    assert Options().wgmma is False
    monkeypatch.setenv("ORTFUSE_WGMMA", "1")
    assert Options().wgmma is True


def test_an_arch_specific_kernel_is_not_built_for_other_archs(tmp_path):
    src = ARCH_SPECIFIC_LINE + "\n" + WG64
    with pytest.raises(CompileError, match="sm_90a"):
        compile_kernel(src, "wg64", (80, 90), tmp_path)


def _init(name: str, arr: np.ndarray, dt: int):
    # fp16 or bf16 bit patterns as an initializer of element type `dt`
    return helper.make_tensor(name, dt, arr.shape, arr.tobytes(), raw=True)


def _region(m):
    g = build_graph(m, {})
    tgt = target_for((90,), True)
    (r,) = plan(g, tgt).regions
    return g, r, tgt


@pytest.mark.parametrize("tile", [
    (64, 64, 64, 16, 64, 4, 1, 1),      # one warpgroup, n64
    (128, 128, 64, 16, 128, 5, 1, 1),   # two along M, n128
    (64, 256, 64, 16, 256, 4, 1, 1),    # n256: 128 accumulators per thread
    (128, 256, 64, 16, 128, 4, 1, 1),   # 2 x 2 warpgroups
    (256, 64, 64, 16, 64, 4, 1, 1),     # four along M
])
@pytest.mark.parametrize("dt", [H, BF])
def test_every_warpgroup_layout(tile, dt):
    # y = x @ w + b at M = 150, N = 200, K = 200 (partial tiles on every axis), each tile forced
    M, K, N = 150, 200, 200
    rng = np.random.default_rng(5)
    x32, w32, b32 = (rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((M, K), (K, N), (N,)))
    if dt == H:
        (x, xv), (w, wv), (b, bv) = ((a.astype(np.float16), a.astype(np.float16).astype(np.float64)) for a in (x32, w32, b32))
    else:
        (x, xv), (w, wv), (b, bv) = (bf16(a) for a in (x32, w32, b32))
    npt = np.float16 if dt == H else np.uint16
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["out"])], [vi("x", dt, [M, K])],
              [vi("out", dt, None)], [_init("w", w, dt), _init("b", b, dt)])
    g, r, tgt = _region(m)
    spec = lower(g, r, tgt, tile=tile)
    assert spec.kernel.arch_specific and spec.input_perms == (("w", (1, 0)),) and spec.block == tl.GemmTile.of_candidate(tile).threads
    out = np.zeros((M, N), npt)
    launch_spec(spec, [x, np.ascontiguousarray(w.T), b, out], [])
    ref = np.asarray(xv, np.float64) @ np.asarray(wv, np.float64) + np.asarray(bv, np.float64)
    got = out.astype(np.float64) if dt == H else (out.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    if dt == H:  # ptxas keeps the wgmma pipeline (no serialization) and spills nothing
        ck = compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WGMMA_OPTS.cache)
        ((_, res),) = ck.resources
        assert res.spill_bytes == 0 and res.wgmma_serialized == "", res


def test_split_k_in_clusters():
    # M = 64, N = 128, K = 2048: two tiles, so the k loop splits over clusters of 4 (distributed shared memory)
    M, K, N = 64, 2048, 128
    w = _w((K, N), 6, 0.05)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Relu", ["y"], ["out"])], [vi("x", H, [M, K])],
              [vi("out", H, None)], [const("w", w, np.float16)])
    g, r, tgt = _region(m)
    spec = lower(g, r, tgt, tile=(64, 64, 64, 16, 64, 4, 4, 1))
    assert spec.split_k == 4
    x = _w((M, K), 7)
    out = np.zeros((M, N), np.float16)
    launch_spec(spec, [x, np.ascontiguousarray(w.T), out], [])
    ref = np.maximum(x.astype(np.float64) @ w.astype(np.float64), 0)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_tile_model_prefers_wgmma_for_large_gemms_only_where_enabled():
    on, off = target_for((90,), True), target_for((90,), False)
    big = (4096, 3072, 768, 1)
    wg = tl.rank_tiles(on, *big, 2, tl.WGMMA_F16, True)[0]
    mma = tl.rank_tiles(off, *big, 2, tl.MMA_F16, True)[0]
    assert wg.tile.wgmma and wg.est_us < mma.est_us
    assert all(not r.tile.wgmma for r in tl.rank_tiles(on, *big, 2, tl.MMA_F16, True, top_k=100))
    # a row-wise epilogue runs on wgmma tiles only split across a cluster, and never on the TMA tiles
    row_wg = tl.rank_tiles(on, 4096, 768, 768, 1, 2, tl.WGMMA_F16, True, row=True, top_k=100)
    assert row_wg and all(tl.row_split(768, r.tile) > 1 for r in row_wg)
    assert not tl.rank_tiles(on, 4096, 768, 768, 1, 2, tl.WS_F16, True, row=True)


# One warpgroup: D [64][64] = A [64][64] . B [64 n][64 k]^T through four m64n64k16 steps, both tiles copied
# with cp.async into the 128-byte swizzle. NO_PROXY_FENCE, OVERWRITE (a stage written before wait_group) and
# MISALIGN (tiles not 1024-byte aligned in the shared window) are the misuses the emulator must report.
WG64 = r"""
#include "ortfuse_kernel.h"
#ifndef NO_PROXY_FENCE
#define NO_PROXY_FENCE 0
#endif
#ifndef OVERWRITE
#define OVERWRITE 0
#endif
#ifndef MISALIGN
#define MISALIGN 0
#endif
extern "C" __global__ void __launch_bounds__(128) wg64(const OfzArgs a) {
  OFZ_DYNAMIC_SMEM(__half, smem);
  __half* As = MISALIGN ? smem : smem + ((1024u - (ofz::smem_u32(smem) & 1023u)) & 1023u) / 2;
  __half* Bs = As + 64 * 64;
  const __half* A = (const __half*)a.ptr[0];
  const __half* B = (const __half*)a.ptr[1];
  float* D = (float*)a.ptr[2];
  const int tid = threadIdx.x;
  for (int i = 0; i < 4; ++i) {  // 512 chunks per operand: row r, 16-byte chunk c stored at c ^ (r % 8)
    const int r = tid / 8 + 16 * i, c = tid % 8, dst = (r / 8) * 512 + (r % 8) * 64 + (c ^ (r % 8)) * 8;
    ofz::cp_async16(As + dst, A + r * 64 + c * 8, 16);
    ofz::cp_async16(Bs + dst, B + r * 64 + c * 8, 16);
  }
  ofz::cp_async_commit();
  ofz::cp_async_wait<0>();
  if (!NO_PROXY_FENCE) ofz::fence_proxy_async();
  __syncthreads();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  ofz::wgmma_fence_operand(d);
  ofz::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk)
    ofz::wgmma_m64k16<64, __half>(d, ofz::wgmma_desc(ofz::smem_u32(As) + kk * 32u), ofz::wgmma_desc(ofz::smem_u32(Bs) + kk * 32u));
  ofz::wgmma_commit();
  if (OVERWRITE) Bs[tid] = __float2half(1.0f);
  ofz::wgmma_wait<0>();
  ofz::wgmma_fence_operand(d);
  const int w = tid / 32, l = tid % 32, g = l / 4, t = l % 4;
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) D[(16 * w + g + 8 * (e / 2)) * 64 + 8 * j + 2 * t + e % 2] = d[4 * j + e];
}
OFZ_EMU_ENTRY(wg64)
"""
WG64_SMEM = 1024 + 2 * 64 * 64 * 2


def _wg64(defs: str = ""):
    rng = np.random.default_rng(8)
    a, b = (rng.standard_normal((64, 64)).astype(np.float16) for _ in range(2))
    d = np.zeros((64, 64), np.float32)
    compile_emulated(defs + WG64).launch("wg64", 1, 128, [a, b, d], smem=WG64_SMEM)
    return d, a.astype(np.float64) @ b.astype(np.float64).T


def test_emulated_wgmma_reads_the_swizzled_layout():
    d, ref = _wg64()
    np.testing.assert_allclose(d, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("defs,message", [
    ("#define NO_PROXY_FENCE 1\n", "fence.proxy.async"),
    ("#define OVERWRITE 1\n", "changed before wgmma.wait_group"),
    ("#define MISALIGN 1\n", "1024-byte aligned"),
])
def test_emulated_wgmma_reports_misuse(defs, message):
    with pytest.raises(EmulationError, match=message):
        _wg64(defs)


def test_wgmma_intrinsics_compile_for_sm90a(tmp_path):
    ck = compile_kernel(ARCH_SPECIFIC_LINE + "\n" + WG64, "wg64", (90,), tmp_path)
    assert [cc for cc, _ in ck.cubins] == [90] and b".target sm_90a" in ck.ptx


def test_every_wgmma_form_reaches_ptx_with_its_accumulators(tmp_path):
    # the six specializations (n64/128/256 x f16/bf16) as ptxas sees them: N/2 accumulator registers each
    calls = "\n".join(
        f"  {{ float d[{n // 2}]; for (int i = 0; i < {n // 2}; ++i) d[i] = o[i];\n"
        f"    ofz::wgmma_m64k16<{n}, {t}>(d, ofz::wgmma_desc(ofz::smem_u32(s)), ofz::wgmma_desc(ofz::smem_u32(s) + 32u));\n"
        f"    ofz::wgmma_commit(); ofz::wgmma_wait<0>(); for (int i = 0; i < {n // 2}; ++i) o[i] = d[i]; }}"
        for n in (64, 128, 256) for t in ("__half", "__nv_bfloat16"))
    src = (f"{ARCH_SPECIFIC_LINE}\n#include \"ortfuse_kernel.h\"\n"
           f"extern \"C\" __global__ void __launch_bounds__(128) forms(const OfzArgs a) {{\n"
           f"  OFZ_DYNAMIC_SMEM(__half, s);\n  float* o = (float*)a.ptr[0] + threadIdx.x * 128;\n"
           f"  ofz::wgmma_fence();\n{calls}\n}}\nOFZ_EMU_ENTRY(forms)\n")
    ptx = compile_kernel(src, "forms", (90,), tmp_path).ptx.decode()
    found = [(m.group(1), m.group(2), len(m.group(3).split(",")))
             for m in re.finditer(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(b?f16)\.\S+ \{([^}]*)\}", ptx)]
    assert sorted(found) == sorted((str(n), t, n // 2) for n in (64, 128, 256) for t in ("f16", "bf16"))


def test_tiny_bert_with_wgmma_end_to_end():
    # the zoo's tiny BERT (fp16) optimized with --wgmma: its plain GEMMs on wgmma, the model against ORT CPU
    pytest.importorskip("transformers")
    from ortfuse.bench import zoo
    path = str(zoo.build("bert", "fp16", tiny=True))
    res = compile_model(path, None, "sm_90", options=WGMMA_OPTS)
    assert _wgmma_kernels(res)
    assert f"; {len({k.compiled.entry for k in _wgmma_kernels(res)})} wgmma kernels for sm_90a only" in summary(res)
    tma = len({k.compiled.entry for k in res.kernels if k.spec.kernel.tma})
    assert tma and f" ({tma} fed by TMA)" in summary(res)
    rep = check_models(path, res.model, emulate=True)
    assert rep.ok, "\n".join(rep.lines())


def test_a_forced_wgmma_tile_where_wgmma_cannot_run_is_a_lowering_error():
    # fp32: no wgmma form; the forced wgmma tile is refused by name, not lowered as something else
    from ortfuse.customops.lower import LoweringError
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Relu", ["y"], ["out"])], [vi("x", TP.FLOAT, [64, 64])],
              [vi("out", TP.FLOAT, None)], [const("w", np.ones((64, 64)) * 0.1)])
    g, r, tgt = _region(m)
    with pytest.raises(LoweringError, match="does not apply"):
        lower(g, r, tgt, tile=(64, 64, 64, 16, 64, 4, 1, 1))

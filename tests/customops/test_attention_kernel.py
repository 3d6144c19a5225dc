"""The flash-attention template (customops/include/ortfuse_attention.h), hand-instantiated the way generated
code will use it: layout functors for [B,H,S,D], BERT's [B,S,H*D] and a transposed K, score functors for a
plain scale, an additive padding mask and a causal mask. Run in CPU emulation against numpy (Sq and Sk
not multiples of the tiles, fp32/fp16/bf16 storage) and compiled with NVRTC for sm_90."""
from __future__ import annotations

import dataclasses
import re

from dataclasses import dataclass
from typing import Optional

import ml_dtypes
import numpy as np
import pytest

from helpers import sass_or_skip
from ortfuse.bench.sass import loops
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.emulate import compile_emulated

B, H, SQ, SK = 2, 2, 37, 45
STORAGE = {"f32": ("float", np.float32), "f16": ("__half", np.float16), "bf16": ("__nv_bfloat16", ml_dtypes.bfloat16)}

# Arguments: ptr = q, k, v, o, mask ([B, Sk] fp32, read by Padding only); dim = B, Sq, Sk.
PRELUDE = r"""
#include "ortfuse_kernel.h"
#include "ortfuse_attention.h"
#define DEV __device__ __forceinline__ static
constexpr int H = 2;
// [B, H, S, D]; S is dim[SDIM] (1: queries, 2: keys)
template <int D, int SDIM> struct Bhsd {
  DEV ofz_i64 offset(const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 s, ofz_i64 d) { return ((b * H + h) * a.dim[SDIM] + s) * D + d; }
};
// [B, S, H*D]: the projections as BERT, GPT-2 and ViT feed their Reshape + Transpose
template <int D, int SDIM> struct Bshd {
  DEV ofz_i64 offset(const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 s, ofz_i64 d) { return (b * a.dim[SDIM] + s) * (H * D) + h * D + d; }
};
// Kᵀ stored as [B, H, D, Sk] (a path that stopped at the transposed K)
template <int D> struct Bhds {
  DEV ofz_i64 offset(const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 s, ofz_i64 d) { return ((b * H + h) * D + d) * a.dim[2] + s; }
};
template <int D> struct Plain {
  DEV float score(const OfzArgs&, ofz_i64, ofz_i64, ofz_i64, ofz_i64, float qk) { return qk * (1.0f / sqrtf((float)D)); }
};
template <int D> struct Scaled {  // Plain, marked a bare scale: the tensor-core kernel keeps raw qk (log2_scale)
  DEV float score(const OfzArgs&, ofz_i64, ofz_i64, ofz_i64, ofz_i64, float qk) { return qk * (1.0f / sqrtf((float)D)); }
  DEV float log2_scale(const OfzArgs&) { return 1.4426950408889634f / sqrtf((float)D); }
};
template <int D> struct Padding {  // scores * scale + mask[b, j]
  DEV float score(const OfzArgs& a, ofz_i64 b, ofz_i64, ofz_i64, ofz_i64 j, float qk) {
    return qk * (1.0f / sqrtf((float)D)) + ((const float*)a.ptr[4])[b * a.dim[2] + j];
  }
};
template <int D> struct Causal {  // Where(j <= i, scores * scale, -inf)
  DEV float score(const OfzArgs&, ofz_i64, ofz_i64, ofz_i64 i, ofz_i64 j, float qk) {
    return j > i ? ofz::attn::neg_inf() : qk * (1.0f / sqrtf((float)D));
  }
};
template <int D> struct CausalEnd : Causal<D> {  // Causal with its frontier: units skip the tiles past their rows
  DEV ofz_i64 key_end(const OfzArgs&, ofz_i64 i, ofz_i64, ofz_i64) { return i + 1; }
};
template <int D> struct CausalTail {  // queries after Sk - Sq cached keys (bottom-right), with the frontier
  DEV float score(const OfzArgs&, ofz_i64, ofz_i64, ofz_i64 i, ofz_i64 j, float qk);
  DEV ofz_i64 key_end(const OfzArgs& a, ofz_i64 i, ofz_i64 sq, ofz_i64 sk) { return i + 1 + sk - sq; }
};
template <int D> struct CausalStrict {  // j >= i hidden (row 0 sees no key), with the frontier
  DEV float score(const OfzArgs&, ofz_i64, ofz_i64, ofz_i64 i, ofz_i64 j, float qk) {
    return j >= i ? ofz::attn::neg_inf() : qk * (1.0f / sqrtf((float)D));
  }
  DEV ofz_i64 key_end(const OfzArgs&, ofz_i64 i, ofz_i64, ofz_i64) { return i; }
};
template <int D> struct Window {  // keys i - 39 .. i (a sliding window of 40), with both sides of the frontier
  DEV float score(const OfzArgs&, ofz_i64, ofz_i64, ofz_i64 i, ofz_i64 j, float qk) {
    return j > i || j < i - 39 ? ofz::attn::neg_inf() : qk * (1.0f / sqrtf((float)D));
  }
  DEV ofz_i64 key_end(const OfzArgs&, ofz_i64 i, ofz_i64, ofz_i64) { return i + 1; }
  DEV ofz_i64 key_begin(const OfzArgs&, ofz_i64 i, ofz_i64, ofz_i64) { return i - 39; }
};
template <int D> struct WindowTail {  // Window after Sk - Sq cached keys
  DEV float score(const OfzArgs& a, ofz_i64, ofz_i64, ofz_i64 i, ofz_i64 j, float qk) {
    const ofz_i64 p = i + a.dim[2] - a.dim[1];
    return j > p || j < p - 39 ? ofz::attn::neg_inf() : qk * (1.0f / sqrtf((float)D));
  }
  DEV ofz_i64 key_end(const OfzArgs&, ofz_i64 i, ofz_i64 sq, ofz_i64 sk) { return i + 1 + sk - sq; }
  DEV ofz_i64 key_begin(const OfzArgs&, ofz_i64 i, ofz_i64 sq, ofz_i64 sk) { return i - 39 + sk - sq; }
};
// Grouped-query heads packed as lower_attention packs them: one K/V head ([B, Sk, D]) serves the H query heads
// ([B, Sq, H*D]); packed row r of a unit is row r % Sq of query head r / Sq (Dims: 1 head, H * Sq rows)
template <int D> struct PackedQ {
  DEV ofz_i64 offset(const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 s, ofz_i64 d) {
    return (b * a.dim[1] + s % a.dim[1]) * (H * D) + (h * H + s / a.dim[1]) * D + d;
  }
};
template <int D> struct OneKv {
  DEV ofz_i64 offset(const OfzArgs& a, ofz_i64 b, ofz_i64, ofz_i64 s, ofz_i64 d) { return (b * a.dim[2] + s) * D + d; }
};
template <int D> struct PackedWindowTail {  // WindowTail over packed rows: the functors take a head's own row
  DEV float score(const OfzArgs& a, ofz_i64, ofz_i64, ofz_i64 r, ofz_i64 j, float qk) {
    const ofz_i64 p = r % a.dim[1] + a.dim[2] - a.dim[1];
    return j > p || j < p - 39 ? ofz::attn::neg_inf() : qk * (1.0f / sqrtf((float)D));
  }
  DEV ofz_i64 group(const OfzArgs&) { return H; }
  DEV ofz_i64 key_end(const OfzArgs&, ofz_i64 i, ofz_i64 sq, ofz_i64 sk) { return i + 1 + sk - sq; }
  DEV ofz_i64 key_begin(const OfzArgs&, ofz_i64 i, ofz_i64 sq, ofz_i64 sk) { return i - 39 + sk - sq; }
};
template <int D> __device__ __forceinline__ float CausalTail<D>::score(const OfzArgs& a, ofz_i64, ofz_i64, ofz_i64 i,
                                                                       ofz_i64 j, float qk) {
  return j > i + (a.dim[2] - a.dim[1]) ? ofz::attn::neg_inf() : qk * (1.0f / sqrtf((float)D));
}
"""


@dataclass(frozen=True)
class Case:
    dtype: str
    d: int
    dv: int
    layout: str  # "bhsd" | "bshd" | "kt" (Q, V, O as bshd, K as [B, H, D, Sk])
    score: str  # "plain" | "scaled" (plain, as a bare scale) | "padding" | "causal" | "causal_end" | "causal_tail"
    #             | "causal_strict" | "window" | "window_tail"
    kernel: str = "simt"  # "simt" | "tensor_core"
    affine: bool = False  # tensor_core's AFFINE: K/V/Q copies step one row stride (these layouts are affine)

    @property
    def entry(self) -> str:
        return f"attn_{self.kernel}_{self.dtype}_{self.d}_{self.dv}_{self.layout}_{self.score}" + "_affine" * self.affine

    @property
    def block_m(self) -> int:  # SimtTile / MmaTile::BLOCK_M
        return 32 if self.kernel == "simt" else 64

    @property
    def block_n(self) -> int:  # SimtTile / MmaTile::BLOCK_N
        wide = max(self.d, self.dv) > 64
        return (16 if wide else 32) if self.kernel == "simt" else (32 if wide else 64)

    @property
    def smem(self) -> int:  # MmaTile::SMEM_BYTES (the SIMT kernel uses static shared memory)
        if self.kernel == "simt":
            return 0
        bn = self.block_n
        return 2 * (64 * (self.d + 8) + 2 * bn * (self.d + 8) + 2 * bn * (self.dv + 8))


CASES = [Case("f32", 32, 32, lay, sc) for lay in ("bhsd", "bshd") for sc in ("plain", "padding", "causal")] + [
    Case(dt, 32, 32, "bshd", sc) for dt in ("f16", "bf16") for sc in ("padding", "causal")] + [
    Case("f32", 128, 128, "bhsd", "padding"), Case("f16", 128, 128, "bshd", "causal"),
    Case("f32", 40, 24, "kt", "plain"), Case("f32", 3, 5, "bhsd", "padding")] + [
    Case(dt, 64, 64, lay, sc, "tensor_core") for dt in ("f16", "bf16") for lay in ("bhsd", "bshd")
    for sc in ("padding", "causal")] + [
    Case("f16", 128, 128, "bshd", "padding", "tensor_core"), Case("bf16", 32, 64, "bhsd", "plain", "tensor_core"),
    Case("f16", 16, 16, "bshd", "causal", "tensor_core")] + [
    Case(dt, d, d, "bshd", "scaled", "tensor_core") for dt in ("f16", "bf16") for d in (16, 64, 128)] + [
    Case(dt, d, d, "bshd", sc, kernel) for dt, d, kernel in (("f32", 32, "simt"), ("f16", 64, "tensor_core"),
                                                             ("bf16", 128, "tensor_core"))
    for sc in ("causal_end", "causal_tail")] + [Case("f16", 64, 64, "bshd", "causal_strict", "tensor_core")] + [
    Case("f32", 32, 32, "bshd", "window"), Case("f16", 64, 64, "bshd", "window", "tensor_core"),
    Case("f16", 64, 64, "bshd", "window_tail", "tensor_core")]
CASES += [dataclasses.replace(c, affine=True) for c in CASES if c.kernel == "tensor_core"]


def _kernel(c: Case) -> str:
    t = STORAGE[c.dtype][0]
    lay = {"bhsd": "Bhsd", "bshd": "Bshd", "kt": "Bshd"}[c.layout]
    k = f"Bhds<{c.d}>" if c.layout == "kt" else f"{lay}<{c.d}, 2>"
    score = {"plain": "Plain", "scaled": "Scaled", "padding": "Padding", "causal": "Causal", "causal_end": "CausalEnd",
             "causal_tail": "CausalTail", "causal_strict": "CausalStrict", "window": "Window",
             "window_tail": "WindowTail"}[c.score]
    return (f"extern \"C\" __global__ void __launch_bounds__(128) {c.entry}(const OfzArgs a) {{\n"
            f"  ofz::attn::{c.kernel}<{t}, {c.d}, {c.dv}, {lay}<{c.d}, 1>, {k}, {lay}<{c.dv}, 2>, {lay}<{c.dv}, 1>, "
            f"{score}<{c.d}>{', true' if c.affine else ''}>(a, (const {t}*)a.ptr[0], (const {t}*)a.ptr[1], (const {t}*)a.ptr[2], ({t}*)a.ptr[3], "
            f"ofz::attn::Dims{{a.dim[0], H, a.dim[1], a.dim[2]}});\n}}\nOFZ_EMU_ENTRY({c.entry})\n")


PACKED = [Case("f32", 32, 32, "bshd", "packed_window_tail"), Case("f16", 64, 64, "bshd", "packed_window_tail", "tensor_core")]


def _packed_kernel(c: Case) -> str:
    t = STORAGE[c.dtype][0]
    return (f"extern \"C\" __global__ void __launch_bounds__(128) {c.entry}(const OfzArgs a) {{\n"
            f"  ofz::attn::{c.kernel}<{t}, {c.d}, {c.dv}, PackedQ<{c.d}>, OneKv<{c.d}>, OneKv<{c.dv}>, PackedQ<{c.dv}>, "
            f"PackedWindowTail<{c.d}>>(a, (const {t}*)a.ptr[0], (const {t}*)a.ptr[1], (const {t}*)a.ptr[2], ({t}*)a.ptr[3], "
            f"ofz::attn::Dims{{a.dim[0], 1, H * a.dim[1], a.dim[2]}});\n}}\nOFZ_EMU_ENTRY({c.entry})\n")


SOURCE = PRELUDE + "".join(_kernel(c) for c in CASES) + "".join(_packed_kernel(c) for c in PACKED)


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORTFUSE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def mod():
    return compile_emulated(SOURCE)


def _layout(x: np.ndarray, layout: str) -> np.ndarray:
    """[B, H, S, D] -> the kernel's storage layout."""
    if layout == "bhsd":
        return np.ascontiguousarray(x)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1))


def _reference(q, k, v, mask, causal: bool, tail: bool = False, shift: int = 0, window: int = 0) -> np.ndarray:
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]) + mask[:, None, None, :]
    if causal:  # key j hidden from query i where j > p + shift, or j <= p - window (p: i, or i + Sk - Sq: `tail`)
        i, j = np.arange(s.shape[2])[:, None], np.arange(s.shape[3])[None, :]
        p = i + (s.shape[3] - s.shape[2] if tail else 0)
        s = np.where((j > p + shift) | ((j <= p - window) if window else False), -np.inf, s)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    tot = e.sum(-1, keepdims=True)
    return (e / np.where(tot > 0, tot, 1.0)) @ v  # all-masked rows: 0, as the kernel documents


def _run(mod, c: Case, mask: np.ndarray, sq: int = SQ, sk: int = SK, seed: int = 0,
         traffic: Optional[list] = None, cluster: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    npt = STORAGE[c.dtype][1]
    q, k, v = (rng.standard_normal((B, H, s, d)).astype(npt).astype(np.float64)
               for s, d in ((sq, c.d), (sk, c.d), (sk, c.dv)))
    lay = "bshd" if c.layout == "kt" else c.layout
    store = [_layout(x, lay).astype(npt) for x in (q, k, v)]
    if c.layout == "kt":
        store[1] = np.ascontiguousarray(k.transpose(0, 1, 3, 2)).astype(npt)
    out = np.zeros_like(_layout(np.zeros((B, H, sq, c.dv)), lay), dtype=npt)
    args = [x.view(np.uint16) if c.dtype == "bf16" else x for x in (*store, out)]
    grid = -(-B * H * sq // c.block_m)  # units B*H*Sq, BLOCK_M per block: may be fewer blocks than row tiles
    t = mod.launch(c.entry, grid * cluster, 128, [*args, mask.astype(np.float32)], [B, sq, sk], c.smem,
                   cluster=cluster, count_smem=traffic is not None)
    if traffic is not None:
        traffic.append(t)
    got = out.astype(np.float64)
    if lay == "bshd":
        got = got.reshape(B, sq, H, c.dv).transpose(0, 2, 1, 3)
    return got, _reference(q, k, v, mask if c.score == "padding" else np.zeros_like(mask),
                           c.score.startswith("causal") or c.score.startswith("window"),
                           c.score in ("causal_tail", "window_tail"), -1 if c.score == "causal_strict" else 0,
                           40 if c.score.startswith("window") else 0)


def _launch_bshd(mod, c: Case, q: np.ndarray, k: np.ndarray, v: np.ndarray, cluster: int = 1) -> np.ndarray:
    """The case's kernel on [B, H, S, D] operands of its storage type, laid out [B, S, H*D]; O as [B, H, Sq, Dv]."""
    sq, sk = q.shape[2], k.shape[2]
    store = [_layout(x.astype(np.float64), "bshd").astype(x.dtype) for x in (q, k, v)]
    out = np.zeros((B, sq, H * c.dv), dtype=q.dtype)
    args = [x.view(np.uint16) if c.dtype == "bf16" else x for x in (*store, out)]
    mod.launch(c.entry, -(-B * H * sq // c.block_m) * cluster, 128, [*args, np.zeros((B, sk), np.float32)],
               [B, sq, sk], c.smem, cluster=cluster)
    return out.astype(np.float64).reshape(B, sq, H, c.dv).transpose(0, 2, 1, 3)


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _padding_mask(sk: int = SK) -> np.ndarray:
    m = np.zeros((B, sk))
    m[0, 30:] = -np.inf  # trailing padding
    m[1, :33] = -np.inf  # every key of the first tile masked, then live keys: the rescale guard
    return m


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.entry)
def test_matches_numpy(mod, c: Case):
    got, ref = _run(mod, c, _padding_mask())
    assert np.isfinite(got).all()
    assert _rel(got, ref) <= (1e-5 if c.dtype == "f32" else 1e-2), _rel(got, ref)


@pytest.mark.parametrize("sq,sk", [(1, 1), (5, 3), (33, 70), (70, 130)])
@pytest.mark.parametrize("kernel,dtype,affine,score", [("simt", "f32", False, "padding"),
                                                       ("tensor_core", "f16", False, "padding"),
                                                       ("tensor_core", "f16", True, "padding"),
                                                       ("tensor_core", "f16", True, "scaled")])
def test_odd_sizes(mod, sq: int, sk: int, kernel: str, dtype: str, affine: bool, score: str):
    c = Case(dtype, 32, 32, "bshd", "padding") if kernel == "simt" else \
        Case("f16", 64, 64, "bshd", score, kernel, affine)
    mask = np.zeros((B, sk))
    mask[1, sk // 2:] = -1e30  # finite mask values, as exporters emit
    got, ref = _run(mod, c, mask, sq, sk, seed=1)
    assert _rel(got, ref) <= (1e-5 if dtype == "f32" else 1e-2)


@pytest.mark.parametrize("c", [Case("f32", 32, 32, "bhsd", "padding"),
                               Case("f16", 64, 64, "bhsd", "padding", "tensor_core")], ids=lambda c: c.kernel)
def test_fully_masked_rows_are_zero_not_nan(mod, c: Case):
    mask = np.zeros((B, SK))
    mask[1] = -np.inf
    got, ref = _run(mod, c, mask)
    assert np.isfinite(got).all() and not got[1].any()
    assert _rel(got, ref) <= (1e-5 if c.dtype == "f32" else 1e-2)


@pytest.mark.parametrize("c", [Case("f32", 32, 32, "bhsd", "padding"),
                               Case("f16", 64, 64, "bhsd", "padding", "tensor_core")], ids=lambda c: c.kernel)
def test_rows_masked_with_the_lowest_float_average_v(mod, c: Case):
    # exporters mask with fp32's lowest finite value: a row masked everywhere has equal scores (-3.4e38,
    # the q·k term rounded away), so softmax is uniform. Its terms are taken as 2^((s - max)·log2e): the
    # difference first, since s·log2e - max·log2e would round the exponent by ~1e31
    mask = np.zeros((B, SK))
    mask[1] = np.finfo(np.float32).min
    mask[0, 20:] = np.finfo(np.float32).min
    got, ref = _run(mod, c, mask)
    assert np.isfinite(got).all()
    assert _rel(got, ref) <= (1e-5 if c.dtype == "f32" else 1e-2)


@pytest.mark.parametrize("cluster", [2, 3, 4])
@pytest.mark.parametrize("sk", [45, 130, 300])
@pytest.mark.parametrize("c", [Case("f16", 64, 64, "bshd", "padding", "tensor_core", True),
                               Case("bf16", 32, 64, "bhsd", "plain", "tensor_core"),
                               Case("f16", 64, 64, "bshd", "scaled", "tensor_core", True),
                               Case("f16", 128, 128, "bshd", "padding", "tensor_core")], ids=lambda c: c.entry)
def test_keys_split_across_a_cluster(mod, c: Case, sk: int, cluster: int):
    # clusters of 2-4 blocks share each unit's key tiles and merge their rows' states through distributed
    # shared memory: 45 keys (one tile: the other blocks hold no key, only -inf), 130 and 300 (uneven
    # shares, the last tile partial); padding masks the first 33 keys of one batch item, the rest of the other
    mask = np.zeros((B, sk))
    mask[0, sk - 7:] = -np.inf
    mask[1, :33] = -np.inf
    got, ref = _run(mod, c, mask, 37, sk, seed=2, cluster=cluster)
    assert np.isfinite(got).all()
    assert _rel(got, ref) <= 1e-2, _rel(got, ref)


def test_a_cluster_of_blocks_that_all_see_masked_keys_stores_zeros(mod):
    c = Case("f16", 64, 64, "bhsd", "padding", "tensor_core")
    mask = np.zeros((B, 130))
    mask[1] = -np.inf  # batch item 1: every key of every block
    got, ref = _run(mod, c, mask, 37, 130, cluster=2)
    assert np.isfinite(got).all() and not got[1].any()
    assert _rel(got, ref) <= 1e-2


def test_compiles_with_nvrtc(tmp_path):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    ck = compile_kernel(SOURCE, CASES[0].entry, (90,), tmp_path)
    assert ck.cubins[0][0] == 90 and len(ck.cubins[0][1]) > 0


def test_tensor_core_output_is_stored_as_words(tmp_path):
    # a thread's two adjacent output columns go out as one 4-byte store (16 per thread at d 64), not 32 2-byte
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    c = Case("f16", 64, 64, "bshd", "padding", "tensor_core")
    ptx = compile_kernel(PRELUDE + _kernel(c), c.entry, (90,), tmp_path).ptx.decode()
    stores = re.findall(r"\bst\.global[\.\w]*", ptx)
    assert stores and all(s in ("st.global.b32", "st.global.u32") for s in stores), set(stores)


@pytest.mark.parametrize("c", [c for c in CASES if c.kernel == "tensor_core"], ids=lambda c: c.entry)
def test_tensor_core_shared_memory_traffic_is_conflict_free(mod, c: Case):
    # every ldmatrix and cp.async is served without bank conflicts (ortfuse_emu.h counts the wavefronts);
    # head sizes 16 and 32 (rows of 2 and 4 chunks) needed chunk_place's quarter-warp rows
    traffic: list = []
    got, ref = _run(mod, c, np.zeros((B, 128)), 64, 128, traffic=traffic)
    (t,) = traffic
    assert t.exact and t.cp_async == t.cp_async_ideal and t.ldmatrix == t.ldmatrix_ideal, t
    assert t.ldmatrix > 0 and t.cp_async > 0
    assert _rel(got, ref) <= 1e-2


def _sass(c: Case, tmp_path) -> list[tuple[int, str]]:
    """The case's kernel compiled for sm_90 and disassembled (the test skipped without NVRTC or cuobjdump)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    sass = sass_or_skip()
    return sass(dict(compile_kernel(PRELUDE + _kernel(c), c.entry, (90,), tmp_path).cubins)[90])


def test_tensor_core_key_tile_loop(tmp_path):
    # The SASS of one key tile (d 64, 64 keys; a thread scores 2 rows x 16 keys): exponentials are one
    # MUFU.EX2 each with no denormal fix-up (ex2.approx.ftz), the K/V copies are unrolled (no loop inside
    # the tile loop), and a mask that is the same for every row (Padding reads mask[b, j]) is 16 loads on
    # a whole tile, where the partial tile's checked path loads per score (32)
    ins = _sass(Case("f16", 64, 64, "bshd", "padding", "tensor_core"), tmp_path)
    back = loops(ins)
    mma = [a for a, t in ins if "HMMA" in t]
    lo, hi = min(((l, h) for l, h in back if sum(l <= x <= h for x in mma) == 64), key=lambda r: r[1] - r[0])
    body = [(a, t) for a, t in ins if lo <= a <= hi]
    assert not [1 for l, h in back if lo <= l and h < hi], "a loop inside the key-tile loop"
    assert sum("MUFU.EX2" in t for _, t in body) == 32 + 2  # the scores, and each row's rescale
    assert not [t for _, t in ins if "-126" in t], "a denormal fix-up around MUFU.EX2"
    (start, end), = [(a, int(re.search(r"0x([0-9a-f]+)", t).group(1), 16)) for a, t in body if t.startswith("BSSY")]
    branch, target = next((a, int(re.search(r"BRA\s+0x([0-9a-f]+)", t).group(1), 16))
                          for a, t in body if start < a < end and re.match(r"@!?P\d+ BRA", t))
    loads = lambda a0, a1: sum(1 for a, t in body if a0 < a < a1 and "LDG.E" in t and "LDGSTS" not in t)
    assert sorted((loads(branch, target), loads(target - 1, end))) == [16, 32]


def test_a_bare_scale_is_one_ffma_a_term(tmp_path):
    # Scaled (a score that is only qk times a constant, log2_scale): each softmax term is 2^(qk·k - base·k),
    # one FFMA before its MUFU.EX2, where Plain's score multiplies, subtracts the base and multiplies by
    # log2 e. In the key loop: the 32 rescaled accumulators' FMULs (and each row's few) remain
    def loop(c: Case) -> list[str]:
        ins = _sass(c, tmp_path)
        back = loops(ins)
        mma = [a for a, t in ins if "HMMA" in t]
        lo, hi = min(((l, h) for l, h in back if sum(l <= x <= h for x in mma) == 64), key=lambda r: r[1] - r[0])
        return [t for a, t in ins if lo <= a <= hi]

    def count(body: list[str], op: str) -> int:
        return sum(1 for t in body if re.search(rf"\b{op}\b", t))
    plain, scaled = (loop(Case("f16", 64, 64, "bshd", sc, "tensor_core", True)) for sc in ("plain", "scaled"))
    assert count(scaled, "FMUL") <= 40 < 90 <= count(plain, "FMUL"), (count(scaled, "FMUL"), count(plain, "FMUL"))
    assert count(scaled, "FFMA") >= 32 and count(scaled, "MUFU.EX2") == 32 + 2


def test_simt_tile_copies_keep_one_column_a_thread(tmp_path):
    # SASS (sm_90; skipped without cuobjdump): the SIMT kernel's Q, K and V copies (loops with global loads and
    # no FFMA) spend about 9 instructions an element (36 per 4: each thread keeps one column where the head
    # size divides the block and steps over rows); dealt out in order they cost 33 (signed division, 64-bit
    # offsets from scratch)
    ins = _sass(Case("f32", 64, 64, "bshd", "plain", "simt"), tmp_path)
    back = loops(ins)
    copies = [body for body in ([t for a, t in ins if lo <= a <= hi] for lo, hi in back)
              if any(re.search(r"\bLDG\b", t) for t in body) and not any("FFMA" in t for t in body)]
    assert len(copies) == 3, len(copies)  # Q's, K's, V's
    for body in copies:
        ldg = sum(1 for t in body if re.search(r"\bLDG\b", t))
        assert len(body) <= 12 * ldg, (len(body), ldg)


FRONTIER = [Case("f32", 32, 32, "bshd", "causal_end"), Case("f16", 64, 64, "bshd", "causal_end", "tensor_core", True),
            Case("bf16", 128, 128, "bshd", "causal_tail", "tensor_core"), Case("f32", 32, 32, "bshd", "causal_tail")]


@pytest.mark.parametrize("c,sq,sk,cluster", [
    (c, sq, sk, cluster) for c in FRONTIER for sq, sk in ((130, 130), (37, 200), (1, 45), (70, 70), (130, 131))
    for cluster in ((1, 3) if c.kernel == "tensor_core" else (1,)) if c.score == "causal_tail" or sq == sk],
    ids=lambda x: x.entry if isinstance(x, Case) else str(x))
def test_a_causal_frontier_skips_the_key_tiles_past_each_unit(mod, c: Case, sq: int, sk: int, cluster: int):
    # key_end: a unit visits only the key tiles before its last row's frontier. V is NaN at every key of the
    # tiles past the first unit's frontier: P·V would make its rows NaN (0 · NaN) had it visited one; the
    # units that visit them are NaN. The outputs with V finite match the reference. (Clusters are the
    # tensor-core kernel's; a top-left frontier is taken at Sq = Sk; at 37 over 200 and 1 over 45 no tile
    # lies past the first unit; at 130 over 131 the first unit's last row sees the first key of the second
    # tile: a frontier one key short would skip it, and the reference would differ.)
    past = sk - sq if c.score == "causal_tail" else 0
    first_end = min(c.block_m, sq) + past  # the first unit's frontier (its last row's + 1)
    bn = c.block_n
    poisoned = -(-first_end // bn) * bn  # keys of the tiles the first unit never visits
    rng = np.random.default_rng(5)
    npt = STORAGE[c.dtype][1]
    q, k, v = (rng.standard_normal((B, H, s, c.d)).astype(npt) for s in (sq, sk, sk))
    v_bad = v.copy()
    v_bad[:, :, poisoned:] = np.nan
    outs = [_launch_bshd(mod, c, q, k, vv, cluster) for vv in (v, v_bad)]
    ref = _reference(*(x.astype(np.float64) for x in (q, k, v)), np.zeros((B, sk)), True, c.score == "causal_tail")
    assert _rel(outs[0], ref) <= (1e-5 if c.dtype == "f32" else 1e-2), _rel(outs[0], ref)
    if c.dtype == "f32":  # row by row: a frontier one key short loses one key of a unit's last row
        assert np.abs(outs[0] - ref).max() <= 1e-5
    # a unit's rows are clean where the tiles before its last row's frontier end before the poisoned keys;
    # the others visit a poisoned tile (0 · NaN, or a NaN they see)
    last = np.minimum((np.arange(sq) // c.block_m + 1) * c.block_m, sq) - 1
    clean = -(-(last + 1 + past) // bn) * bn <= poisoned
    assert clean[: min(c.block_m, sq)].all()
    assert np.array_equal(outs[1][:, :, clean], outs[0][:, :, clean])
    assert np.isnan(outs[1][:, :, ~clean]).all()


@pytest.mark.parametrize("sq,sk,cluster", [(1, 45, 1), (1, 45, 2), (65, 130, 1)])
def test_a_unit_with_no_visible_key_visits_no_tile(mod, sq: int, sk: int, cluster: int):
    # j >= i hidden: row 0 sees no key, so a unit of one row has a frontier at 0 and visits nothing (its row is
    # 0, as every row that sees no key); with 65 rows the first unit's frontier is 63
    c = Case("f16", 64, 64, "bshd", "causal_strict", "tensor_core", True)
    got, ref = _run(mod, c, np.zeros((B, sk)), sq, sk, seed=3, cluster=cluster)
    assert np.isfinite(got).all() and not got[:, :, 0].any()
    assert _rel(got, ref) <= 1e-2 if sq > 1 else not got.any()


@pytest.mark.parametrize("c,cluster,sq,sk", [(Case("f32", 32, 32, "bshd", "window"), 1, 200, 200)] + [
    (Case("f16", 64, 64, "bshd", "window", "tensor_core", True), n, 200, 200) for n in (1, 2)] + [
    (Case("f16", 64, 64, "bshd", "window_tail", "tensor_core", True), n, sq, 200) for n in (1, 2) for sq in (37, 130)],
    ids=lambda x: x.entry if isinstance(x, Case) else str(x))
def test_a_sliding_window_skips_the_key_tiles_before_it(mod, c: Case, cluster: int, sq: int, sk: int):
    # key_begin: a unit starts at the tile of its first row's first visible key (after Sk - Sq cached keys for
    # window_tail). V is NaN at the keys of the first tile: the units whose first row's window starts past that
    # tile never visit it and stay finite
    bn = c.block_n
    rng = np.random.default_rng(9)
    npt = STORAGE[c.dtype][1]
    q = rng.standard_normal((B, H, sq, c.d)).astype(npt)
    k, v = (rng.standard_normal((B, H, sk, c.d)).astype(npt) for _ in range(2))
    v_bad = v.copy()
    v_bad[:, :, :bn] = np.nan
    outs = [_launch_bshd(mod, c, q, k, vv, cluster) for vv in (v, v_bad)]
    past = sk - sq if c.score == "window_tail" else 0
    ref = _reference(*(x.astype(np.float64) for x in (q, k, v)), np.zeros((B, sk)), True, bool(past), window=40)
    assert np.abs(outs[0] - ref).max() <= (1e-5 if c.dtype == "f32" else 2e-2)
    first = (np.arange(sq) // c.block_m) * c.block_m  # each row's unit's first row
    clean = first - 39 + past >= bn  # the unit's tiles start past the poisoned one
    assert clean.any() and np.array_equal(outs[1][:, :, clean], outs[0][:, :, clean])
    assert np.isnan(outs[1][:, :, ~clean]).all()


@pytest.mark.parametrize("c,cluster,sq,sk", [(c, n, sq, sk) for c in PACKED for n in ((1, 2) if c.kernel == "tensor_core" else (1,))
                                             for sq, sk in ((1, 200), (1, 41), (37, 200), (37, 100), (130, 200))],
                         ids=lambda x: x.entry if isinstance(x, Case) else str(x))
def test_packed_query_heads_skip_the_tiles_outside_a_window(mod, c: Case, cluster: int, sq: int, sk: int):
    # grouped-query heads packed into a unit's rows (`S::group`): a unit within one head's rows visits the tiles
    # of those rows' window, a unit across heads those of every row. V is NaN in one key tile at a time: a
    # unit's rows stay finite exactly where KeyBound.unit_spans (the cost model's mirror of the kernel) says
    # it does not visit that tile. A generation step (one row a head) reads only its window's tiles.
    from ortfuse.customops.key_bound import KeyBound
    rng = np.random.default_rng(11)
    npt = STORAGE[c.dtype][1]
    q = rng.standard_normal((B, H, sq, c.d)).astype(npt)
    k, v = (rng.standard_normal((B, 1, sk, d)).astype(npt) for d in (c.d, c.dv))
    bn, tiles = c.block_n, -(-sk // c.block_n)

    def run(vv: np.ndarray) -> np.ndarray:
        out = np.zeros((B, sq, H * c.dv), dtype=npt)
        mod.launch(c.entry, -(-B * H * sq // c.block_m) * cluster, 128,
                   [q.transpose(0, 2, 1, 3).reshape(B, sq, -1).copy(), k[:, 0].copy(), vv[:, 0].copy(), out,
                    np.zeros((B, sk), np.float32)], [B, sq, sk], c.smem, cluster=cluster)
        return out.astype(np.float64).reshape(B, sq, H, c.dv).transpose(0, 2, 1, 3)

    got = run(v)
    kk, vv = (np.repeat(x.astype(np.float64), H, axis=1) for x in (k, v))
    ref = _reference(q.astype(np.float64), kk, vv, np.zeros((B, sk)), True, True, window=40)
    assert np.abs(got - ref).max() <= (1e-5 if c.dtype == "f32" else 2e-2)
    spans = KeyBound(True, 0, (True, -39)).unit_spans(sq, sk, c.block_m, bn, H)
    unit = (np.arange(H)[:, None] * sq + np.arange(sq)[None, :]) // c.block_m  # [head, row] -> its unit
    for tile in range(tiles):
        bad = v.copy()
        bad[:, :, tile * bn:(tile + 1) * bn] = np.nan
        poisoned = run(bad)
        clean = np.array([[not spans[u][0] <= tile < spans[u][1] for u in row] for row in unit])
        assert np.array_equal(poisoned[:, clean], got[:, clean])
        assert np.isnan(poisoned[:, ~clean]).all()
    if sq == 1:  # a generation step: keys Sk - 40 .. Sk - 1 in every unit
        assert spans == [((sk - 40) // bn if sk > 40 else 0, tiles)]

"""ortfuse_gemm.h on its own: hand-written `Ops` callbacks around `ofz::gemm::run`, every math kind and
operand mode, tiles of one to eight warps, 2-4 pipeline stages, partial tiles in M, N and K, run in the
emulator against numpy. fp16/bf16/fp32 results agree to fp32 rounding; tf32 to its 10-bit mantissa."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import bf16

from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.emulate import compile_emulated
from ortfuse.customops import tiles
from ortfuse.customops.tiles import MMA_BF16, MMA_F16, MMA_TF32, SIMT, WGMMA_F16, GemmTile

ELEM = {MMA_F16: "__half", MMA_BF16: "__nv_bfloat16", MMA_TF32: "float", SIMT: "float", WGMMA_F16: "__half"}
ROW, COL, GENERIC = 0, 1, 2


def source(math_: int, tile: GemmTile, a_mode: int, b_mode: int, split: int = 1) -> str:
    """C[b] = A[b] @ B[b]: t0 = A [B][M][K], t1 = B [B][K][N] (COL: [B][N][K]), t2 = C fp32 [B][M][N];
    dims M, N, K, batch. `split`: the template's SPLIT (split-K across the blocks of a cluster)."""
    t = ELEM[math_]
    b_index = "n * a.dim[2] + k" if b_mode == COL else "k * a.dim[1] + n"
    return f'''#include "ortfuse_kernel.h"
#include "ortfuse_gemm.h"
struct ops {{
  static __device__ ofz_i64 a_base(const OfzArgs& a, ofz_i64 b) {{ return b * a.dim[0] * a.dim[2]; }}
  static __device__ ofz_i64 b_base(const OfzArgs& a, ofz_i64 b) {{ return b * a.dim[1] * a.dim[2]; }}
  static __device__ float a_load(const OfzArgs& a, ofz_i64 b, ofz_i64 m, ofz_i64 k) {{
    return ofz::to_f32(((const {t}*)a.ptr[0])[b * a.dim[0] * a.dim[2] + m * a.dim[2] + k]); }}
  static __device__ float b_load(const OfzArgs& a, ofz_i64 b, ofz_i64 k, ofz_i64 n) {{
    return ofz::to_f32(((const {t}*)a.ptr[1])[b * a.dim[1] * a.dim[2] + {b_index}]); }}
  static __device__ void epi1(const OfzArgs& a, ofz_i64 b, ofz_i64 m, ofz_i64 n, float v) {{
    ((float*)a.ptr[2])[(b * a.dim[0] + m) * a.dim[1] + n] = v; }}
  static __device__ void epi2(const OfzArgs& a, ofz_i64 b, ofz_i64 m, ofz_i64 n, float v0, float v1) {{
    epi1(a, b, m, n, v0); epi1(a, b, m, n + 1, v1); }}
}};
extern "C" __global__ void gemm_test(const OfzArgs a) {{
  ofz::gemm::run<{t}, {tile.bm}, {tile.bn}, {tile.bk}, {tile.wm}, {tile.wn}, {tile.stages}, {a_mode}, {b_mode},
                 {math_}, ops, 0, ofz::gemm::NoConv, {split}>(a, 0, 1, a.dim[3], a.dim[0], a.dim[1], a.dim[2]);
}}
OFZ_EMU_ENTRY(gemm_test)
'''


def _operands(math_: int, shape: tuple[int, ...], rng) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal(shape).astype(np.float32)
    if math_ in (MMA_F16, WGMMA_F16):
        h = x.astype(np.float16)
        return h, h.astype(np.float32)
    if math_ == MMA_BF16:
        return bf16(x)
    return x, x


def _tf32(x: np.ndarray) -> np.ndarray:
    return ((x.view(np.uint32) + 0x1000) & 0xFFFFE000).view(np.float32)


CASES = [  # math, tile, (M, N, K, batch), a_mode, b_mode
    (MMA_F16, GemmTile(64, 64, 32, 32, 32, 3), (70, 72, 96, 2), ROW, ROW),
    (MMA_F16, GemmTile(32, 64, 64, 32, 16, 2), (70, 72, 96, 1), ROW, COL),
    (MMA_F16, GemmTile(128, 32, 32, 32, 32, 4), (70, 40, 48, 1), GENERIC, GENERIC),
    (MMA_F16, GemmTile(16, 16, 64, 16, 16, 4), (5, 8, 40, 3), ROW, ROW),
    (MMA_F16, GemmTile(64, 128, 32, 32, 32, 3), (33, 136, 64, 1), ROW, ROW),  # 8 warps
    (MMA_F16, GemmTile(64, 64, 128, 16, 32, 4), (70, 72, 328, 1), ROW, ROW),  # BK 128 (the template allows it)
    (MMA_F16, GemmTile(32, 64, 128, 16, 32, 3), (37, 40, 200, 2), ROW, COL),
    (MMA_F16, GemmTile(32, 32, 128, 16, 16, 3), (37, 40, 200, 1), GENERIC, GENERIC),
    (MMA_BF16, GemmTile(64, 32, 32, 32, 16, 3), (37, 40, 48, 2), ROW, COL),
    (MMA_BF16, GemmTile(32, 32, 32, 16, 16, 2), (37, 40, 48, 1), GENERIC, ROW),
    (MMA_TF32, GemmTile(32, 32, 16, 16, 16, 3), (37, 40, 48, 2), ROW, ROW),
    (MMA_TF32, GemmTile(32, 32, 32, 32, 16, 2), (37, 40, 48, 1), GENERIC, COL),
    (SIMT, GemmTile(32, 64, 16, 16, 32, 2), (37, 40, 48, 2), ROW, COL),
    (SIMT, GemmTile(16, 16, 32, 8, 16, 4), (37, 40, 48, 1), ROW, GENERIC),
]


@pytest.mark.parametrize("math_,tile,dims,a_mode,b_mode", CASES)
def test_gemm_template(math_, tile, dims, a_mode, b_mode):
    m, n, k, batch = dims
    rng = np.random.default_rng(m * n + k)
    a, av = _operands(math_, (batch, m, k), rng)
    b, bv = _operands(math_, (batch, k, n), rng)
    b_mem = np.ascontiguousarray(b.transpose(0, 2, 1)) if b_mode == COL else b
    c = np.full((batch, m, n), np.nan, np.float32)
    esize = a.itemsize
    grid = batch * -(-m // tile.bm) * -(-n // tile.bn)
    compile_emulated(source(math_, tile, a_mode, b_mode)).launch(
        "gemm_test", grid, tile.threads, [a, b_mem, c], [m, n, k, batch], tile.smem_bytes(esize, b_mode == COL))
    if math_ == MMA_TF32:
        ref = _tf32(av) @ _tf32(bv)
    else:
        ref = av.astype(np.float64) @ bv.astype(np.float64)
    rel = np.linalg.norm(c - ref) / np.linalg.norm(ref)
    assert rel < 1e-6, rel
    if math_ == MMA_TF32:
        assert np.linalg.norm(c - av @ bv) / np.linalg.norm(ref) > 1e-5  # tf32 really was used


def test_capped_grid_strides_over_tiles():
    tile = GemmTile(16, 16, 32, 16, 16, 2)
    m, n, k = 40, 48, 32
    rng = np.random.default_rng(9)
    a, av = _operands(MMA_F16, (1, m, k), rng)
    b, bv = _operands(MMA_F16, (1, k, n), rng)
    c = np.full((1, m, n), np.nan, np.float32)
    compile_emulated(source(MMA_F16, tile, ROW, ROW)).launch("gemm_test", 2, 32, [a, b, c], [m, n, k, 1],
                                                             tile.smem_bytes(2, False))
    np.testing.assert_allclose(c[0], av[0] @ bv[0], rtol=1e-5, atol=1e-5)


SPLIT_CASES = [  # math, tile, (M, N, K, batch), a_mode, b_mode, cluster: ragged k ranges and tiles, empty ranks
    (MMA_F16, GemmTile(32, 64, 32, 16, 32, 3), (37, 72, 520, 2), ROW, ROW, 4),
    (MMA_F16, GemmTile(64, 32, 64, 32, 16, 2), (70, 40, 200, 1), ROW, COL, 3),
    (MMA_BF16, GemmTile(16, 16, 32, 16, 16, 4), (5, 8, 72, 3), GENERIC, GENERIC, 8),  # 3 k tiles, 8 ranks
    (MMA_TF32, GemmTile(32, 32, 16, 16, 16, 3), (37, 40, 152, 1), ROW, ROW, 2),
    (SIMT, GemmTile(16, 16, 32, 8, 16, 2), (37, 40, 300, 1), ROW, GENERIC, 5),
    (MMA_F16, GemmTile(32, 32, 32, 16, 16, 3), (37, 40, 296, 1), ROW, ROW, 1),  # split kernel, cluster of one
]


@pytest.mark.parametrize("math_,tile,dims,a_mode,b_mode,cluster", SPLIT_CASES)
def test_split_k_across_a_cluster(math_, tile, dims, a_mode, b_mode, cluster):
    """Clusters of `cluster` blocks split each tile's K and reduce through each other's shared memory: the
    same result as one block per tile, for any cluster size (including ranks with no k tile)."""
    m, n, k, batch = dims
    rng = np.random.default_rng(m + n * k)
    a, av = _operands(math_, (batch, m, k), rng)
    b, bv = _operands(math_, (batch, k, n), rng)
    b_mem = np.ascontiguousarray(b.transpose(0, 2, 1)) if b_mode == COL else b
    esize = a.itemsize
    tiles = batch * -(-m // tile.bm) * -(-n // tile.bn)
    smem = max(tile.smem_bytes(esize, b_mode == COL), tile.bm * (tile.bn + 4) * 4)
    mod = compile_emulated(source(math_, tile, a_mode, b_mode, split=8))
    c = np.full((batch, m, n), np.nan, np.float32)
    mod.launch("gemm_test", tiles * cluster, tile.threads, [a, b_mem, c], [m, n, k, batch], smem, cluster=cluster)
    unsplit = np.full_like(c, np.nan)
    compile_emulated(source(math_, tile, a_mode, b_mode)).launch(
        "gemm_test", tiles, tile.threads, [a, b_mem, unsplit], [m, n, k, batch], tile.smem_bytes(esize, b_mode == COL))
    ref = (_tf32(av) @ _tf32(bv)) if math_ == MMA_TF32 else av.astype(np.float64) @ bv.astype(np.float64)
    assert np.linalg.norm(c - ref) / np.linalg.norm(ref) < 1e-6
    assert np.isfinite(c).all()  # every element written
    assert np.linalg.norm(c - unsplit) / np.linalg.norm(unsplit) < 1e-6  # only the summation order differs
    if cluster > 1:  # two clusters per grid stride: the loop over tiles steps by clusters, not blocks
        half = np.full_like(c, np.nan)
        mod.launch("gemm_test", cluster * 2, tile.threads, [a, b_mem, half], [m, n, k, batch], smem, cluster=cluster)
        np.testing.assert_array_equal(half, c)


@pytest.mark.parametrize("math_", [MMA_F16, MMA_BF16, MMA_TF32, SIMT])
def test_gemm_template_compiles_for_the_gpu(math_, tmp_path):
    tile = GemmTile(64, 64, 32, 32, 32, 3) if math_ != SIMT else GemmTile(32, 64, 16, 16, 32, 2)
    ck = compile_kernel(source(math_, tile, ROW, COL), "gemm_test", (80, 90), tmp_path)
    assert [cc for cc, _ in ck.cubins] == [80, 90] and ck.ptx


def test_split_k_template_compiles_for_sm_90(tmp_path):
    """The cluster instructions (special registers, barrier.cluster, mapa) assemble for sm_90; the same source
    compiles for sm_80, where the cluster helpers report clusters of one."""
    ck = compile_kernel(source(MMA_F16, GemmTile(64, 64, 32, 32, 32, 3), ROW, COL, split=4), "gemm_test", (80, 90),
                        tmp_path)
    assert [cc for cc, _ in ck.cubins] == [80, 90]


def test_headers_have_no_generic_lambdas():
  """NVRTC 13.0 (pyproject allows >= 13.0) takes a generic lambda's call operator for a host function and
  rejects the kernel; 13.5 accepts it, so only this check keeps CI honest about the older compiler."""
  import re
  from ortfuse.customops.compile import INCLUDE_DIR
  for header in sorted(Path(INCLUDE_DIR).glob("*.h")):
    for no, line in enumerate(header.read_text().splitlines(), 1):
      assert not re.search(r"\[[&=]?[\w, &]*\]\s*\(\s*(const\s+)?auto\b", line), f"{header.name}:{no}: {line.strip()}"


TRAFFIC_CASES = [  # tile, a_mode, b_mode: rows of 4 chunks (BK 32), 8 chunks (BK 64), 2 chunks (BN 16), fp32 rows
    (MMA_F16, GemmTile(128, 128, 32, 32, 64, 3), ROW, ROW),
    (MMA_F16, GemmTile(128, 128, 32, 32, 64, 3), ROW, COL),
    (MMA_BF16, GemmTile(64, 128, 64, 32, 64, 3), ROW, COL),
    (MMA_F16, GemmTile(32, 256, 32, 32, 64, 3), ROW, ROW),
    (MMA_F16, GemmTile(64, 64, 64, 16, 32, 4), ROW, ROW),
    (MMA_F16, GemmTile(16, 16, 64, 16, 16, 4), ROW, ROW),
    (MMA_TF32, GemmTile(32, 32, 16, 16, 16, 3), ROW, COL),
    (WGMMA_F16, GemmTile(128, 128, 64, 16, 128, 4, wgmma=True), ROW, COL),
]


@pytest.mark.parametrize("math_,tile,a_mode,b_mode", TRAFFIC_CASES)
def test_shared_memory_traffic_is_conflict_free_and_what_the_tile_model_charges(math_, tile, a_mode, b_mode):
    """The emulator counts the shared-memory wavefronts of every ldmatrix and cp.async (ortfuse_emu.h): each
    is served without bank conflicts, and their conflict-free count is the tile model's charge
    (GemmTile.smem_*_per_ktile) per k tile and block. Before chunk_place, the cp.async stores of 64-byte rows
    (BK 32 in fp16) took two wavefronts per quarter-warp."""
    m, n, k, grid = 2 * tile.bm, tile.bn, 4 * tile.bk, 2
    rng = np.random.default_rng(3)
    a, _ = _operands(math_, (1, m, k), rng)
    b, _ = _operands(math_, (1, k, n), rng)
    b_mem = np.ascontiguousarray(b.transpose(0, 2, 1)) if b_mode == COL else b
    c = np.zeros((1, m, n), np.float32)
    esize = a.itemsize
    t = compile_emulated(source(math_, tile, a_mode, b_mode)).launch(
        "gemm_test", grid, tile.threads, [a, b_mem, c], [m, n, k, 1], tile.smem_bytes(esize, b_mode == COL),
        count_smem=True)
    assert t.exact and t.cp_async == t.cp_async_ideal and t.ldmatrix == t.ldmatrix_ideal, t
    ktiles = grid * (k // tile.bk)
    assert t.cp_async_ideal == ktiles * tile.smem_writes_per_ktile(esize, (tiles.DIRECT, tiles.DIRECT))
    if math_ in (MMA_F16, MMA_BF16):  # fragments through ldmatrix (tf32 loads scalars; wgmma reads no registers)
        assert t.ldmatrix_ideal == ktiles * tile.smem_reads_per_ktile(math_)
    else:
        assert t.ldmatrix == 0

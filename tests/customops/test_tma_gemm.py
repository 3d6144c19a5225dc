"""The TMA warp-specialized wgmma GEMM (ortfuse_gemm.h run_wgmma_ws; `--wgmma`, sm_90a) in CPU emulation: the
emulator's mbarriers and TMA tile copies (ortfuse_emu.h), every consumer layout forced against numpy in
fp64 on the rounded operands (fp16 and bf16, 1e-2 normwise, ragged M, N and K), several tiles per block
(the ring's phases carried across tiles), and each kernel through NVRTC and ptxas for sm_90a with no
spills and no serialized wgmma. The geometry the native library encodes its tensor maps with is checked
through the CPU probe op in tests/runtime/test_node_format.py. Not verified here: that the hardware's TMA
and mbarriers behave as the emulator's (tests/runtime/test_gpu_wgmma.py)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, launch_spec, model, node, raw_init, rounded_operands, vi
from ortfuse.api import compile_model, target_for
from ortfuse.check import check_models
from ortfuse.config import Options
from ortfuse.customops import tiles as tl
from ortfuse.customops.attrs import read_launch
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.emulate import EmulationError, compile_emulated, tma_geometry
from ortfuse.customops.lower import LoweringError, lower
from ortfuse.customops.printer import ARCH_SPECIFIC_LINE, render
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.regions import plan

H, BF = TP.FLOAT16, TP.BFLOAT16
WG = Options(archs=(90,), wgmma=True)


def _bias(M: int, K: int, N: int, dt: int, seed: int = 5):
    """y = x @ w + b: the model, x's bits, w's bits, b's bits and the fp64 reference on the rounded values."""
    (x, xv), (w, wv), (b, bv) = rounded_operands(((M, K), (K, N), (N,)), dt, seed)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["out"])], [vi("x", dt, [M, K])],
              [vi("out", dt, None)], [raw_init("w", w, dt), raw_init("b", b, dt)])
    return m, x, w, b, xv @ wv + bv


def _lowered(m, tile=None):
    g = build_graph(m, {})
    tgt = target_for((90,), True)
    (r,) = plan(g, tgt).regions
    return lower(g, r, tgt, tile=tile)


def _as_f64(bits: np.ndarray, dt: int) -> np.ndarray:
    return bits.astype(np.float64) if dt == H else (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("tile", [
    (64, 64, 64, 16, 64, 4, 1, 2),      # one consumer warpgroup
    (128, 128, 64, 16, 128, 7, 1, 2),   # two along M: setmaxnreg, a deep ring
    (128, 192, 64, 16, 192, 4, 1, 2),   # n192 (BERT's N = 768 in 4 tiles)
    (128, 256, 64, 16, 256, 4, 1, 2),   # n256: 128 accumulators per consumer thread
    (64, 256, 64, 16, 128, 3, 1, 2),    # two along N
    (256, 64, 64, 16, 64, 2, 1, 2),     # four along M, a two-stage ring
])
@pytest.mark.parametrize("dt", [H, BF])
def test_every_consumer_layout(tile, dt):
    # M = 150, K = 200, N = 200: partial tiles on every axis (TMA zero-fills past the matrices)
    M, K, N = 150, 200, 200
    m, x, w, b, ref = _bias(M, K, N, dt)
    spec = _lowered(m, tile)
    t = tl.GemmTile.of_candidate(tile)
    assert spec.kernel.tma and spec.kernel.arch_specific and spec.block == t.consumers + 128
    assert spec.tma == ((0, t.bm, dt), (1, t.bn, dt)) and spec.input_perms == (("w", (1, 0)),)
    out = np.zeros((M, N), x.dtype)
    launch_spec(spec, [x, np.ascontiguousarray(w.T), b, out], [])
    got = _as_f64(out, dt)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    if dt == H:  # ptxas: the consumers' registers fit (setmaxnreg where two warpgroups compute), no spills
        ck = compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WG.cache)
        ((_, res),) = ck.resources
        assert res.spill_bytes == 0 and res.wgmma_serialized == "", res
        ptx = ck.ptx.decode()
        assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait.parity" in ptx
        assert ("setmaxnreg.inc.sync.aligned.u32 232" in ptx) == t.moves_registers == (t.consumers == 256)
        if t.moves_registers:  # setmaxnreg moves registers within the launch's 384 x 168: ptxas must take all
            assert res.regs == 168, res


@pytest.mark.parametrize("dt", [H, BF])
def test_weight_with_misaligned_rows_is_transposed_offline(dt):
    # N = 203: the [K][N] weight's rows are not 16-byte aligned (GPT-2's 50,257 logits), so mma.sync gathers
    # it element by element; transposed offline its [N][K] rows are (K = 200), so the warpgroup families take
    # it as a copied K-major operand, and the output's odd rows are stored without vectors
    M, K, N = 150, 200, 203
    m, x, w, b, ref = _bias(M, K, N, dt, seed=9)
    spec = _lowered(m)
    assert spec.kernel.tma and spec.input_perms == (("w", (1, 0)),)
    out = np.zeros((M, N), x.dtype)
    launch_spec(spec, [x, np.ascontiguousarray(w.T), b, out], [])
    assert np.linalg.norm(_as_f64(out, dt) - ref) / np.linalg.norm(ref) < 1e-2


def test_blocks_carry_the_ring_across_tiles():
    # persistent: on a device of 2 SMs the 3 x 4 tiles run in 2 x blocks_per_sm blocks, each running several
    # tiles through one ring of 3 stages, so the stage and phase of a k tile continue from the previous
    # tile's (K = 328: 6 k tiles, not a multiple of the ring)
    M, K, N = 150, 328, 200
    m, x, w, b, ref = _bias(M, K, N, H, seed=7)
    spec = _lowered(m, (64, 64, 64, 16, 64, 3, 1, 2))
    assert 1 <= spec.blocks_per_sm and 2 * spec.blocks_per_sm < 12
    out = np.zeros((M, N), np.float16)
    launch_spec(spec, [x, np.ascontiguousarray(w.T), b, out], [], sms=2)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_symbolic_batch_folds_into_the_maps_rows():
    # x [n, 77, 264]: the batch folds into M, so A's map has n * 77 rows and tiles straddle batch items
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((264, 136)) * 0.2).astype(np.float16)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Relu", ["y"], ["out"])], [vi("x", H, ["n", 77, 264])],
              [vi("out", H, None)], [const("w", w, np.float16)])
    res = compile_model(m, {"x": ("n", 77, 264)}, "sm_90", options=WG)
    (k,) = [k for k in res.kernels if k.spec.kernel.tma]
    launch = read_launch(next(n for n in res.model.graph.node if n.domain == "ortfuse"))
    assert launch.tma == k.spec.tma and launch.tma[0][0] == 0
    for n in (1, 3):
        rep = check_models(m, res.model, emulate=True, input_shapes={"x": (n, 77, 264)})
        assert rep.ok and len(rep.kernels) == 1, "\n".join(rep.lines())


def test_large_gemms_take_the_tma_family_and_keep_the_others_as_candidates():
    m, *_ = _bias(4096, 768, 768, H)  # BERT-base's projections at batch 32
    spec = _lowered(m)
    assert spec.kernel.tma and spec.tiles[0][7] == 2
    # --profile measures each family's best, the best unsplit TMA tile with B multicast (kind 3) and the best
    # ping-pong tile without (4) and with it (5), which the model does not rank until measured
    assert {t[7] if len(t) > 7 else 0 for t in spec.tiles} == {0, 1, 2, 3, 4, 5} and spec.multicast == 1
    best = next(r.tile for r in tl.rank_tiles(target_for((90,), True), 4096, 768, 768, 1, 2, tl.WS_F16, True,
                                                top_k=10**6) if r.split == 1)
    assert best.multicast_twin().candidate(1) in spec.tiles
    assert tl.rank_pingpong(target_for((90,), True), 4096, 768, 768, 1, 2)[0].tile.candidate(1) in spec.tiles
    # without --wgmma: no warpgroup tiles at all
    g = build_graph(m, {})
    off = target_for((90,), False)
    (r,) = plan(g, off).regions
    assert not lower(g, r, off).kernel.tma


def test_a_batched_weight_is_not_for_the_tma_family():
    # one tensor map per operand cannot hold a weight per batch item
    rng = np.random.default_rng(4)
    bw = (rng.standard_normal((2, 128, 128)) * 0.2).astype(np.float16)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Relu", ["y"], ["out"])], [vi("x", H, [2, 128, 128])],
              [vi("out", H, None)], [const("w", bw, np.float16)])
    spec = _lowered(m)
    assert not spec.kernel.tma and all(len(t) < 8 or t[7] != 2 for t in spec.tiles)
    with pytest.raises(LoweringError, match="does not apply"):
        _lowered(m, (64, 64, 64, 16, 64, 4, 1, 2))


@pytest.mark.parametrize("tile", [(64, 64, 64, 16, 64, 4, 4, 2), (128, 128, 64, 16, 128, 3, 2, 2)])
def test_split_k_in_clusters(tile):
    # M = 64 or 128, N = 128, K = 2048: few tiles, so each tile's k loop splits over a cluster; the consumers
    # reduce through distributed shared memory in their drained stages (a named barrier first)
    M, K, N = tile[0], 2048, 128
    m, x, w, b, ref = _bias(M, K, N, H, seed=6)
    spec = _lowered(m, tile)
    assert spec.kernel.tma and spec.split_k == tile[6]
    out = np.zeros((M, N), np.float16)
    launch_spec(spec, [x, np.ascontiguousarray(w.T), b, out], [])
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    ck = compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WG.cache)
    ((_, res),) = ck.resources
    assert res.spill_bytes == 0 and res.wgmma_serialized == "" and "barrier.cluster" in ck.ptx.decode()


def test_split_k_refuses_a_second_tile_per_cluster():
    # split-K reduces in the drained stages, right only when no producer refills them for a next tile: a
    # launch that gives a cluster two tiles (the library never does) traps instead of racing
    m, x, w, b, _ = _bias(256, 256, 128, H, seed=8)
    spec = _lowered(m, (128, 128, 64, 16, 128, 4, 2, 2))
    out = np.zeros((256, 128), np.float16)
    with pytest.raises(EmulationError, match="__trap"):
        compile_emulated(render(spec.kernel)).launch(spec.kernel.name, 2, spec.block,
                                                     [x, np.ascontiguousarray(w.T), b, out], [], spec.smem, cluster=2,
                                                     tma=spec.tma)


def test_tile_model_counts_the_producer_and_the_barriers():
    t = tl.GemmTile(128, 256, 64, 16, 256, 4, wgmma=True, tma=True)
    assert t.consumers == 256 and t.threads == 384 and t.candidate(1) == (128, 256, 64, 16, 256, 4, 1, 2)
    assert tl.GemmTile.of_candidate(t.candidate(1)) == t and t.family == 2
    assert t.smem_bytes(2, True) == 4 * (128 + 256) * 64 * 2 + tl.WGMMA_SLACK + 16 * 4
    assert t.reg_limit(65536) == tl.WS_CONSUMER_REGS  # setmaxnreg: 128 x 40 + 256 x 232 = 384 x 168
    assert tl.GemmTile(64, 64, 64, 16, 64, 4, wgmma=True, tma=True).reg_limit(65536) == 255
    on = target_for((90,), True)
    # a long K over few tiles splits, and the partial tile then needs its buffer after the barriers
    assert tl.rank_tiles(on, 64, 128, 4096, 1, 2, tl.WS_F16, True, top_k=1)[0].split > 1
    assert t.smem_bytes(2, True, split=2) == max(t.smem_bytes(2, True), tl.WGMMA_SLACK + 16 * 4 + 128 * 260 * 4)
    # resident blocks per SM from the shared memory an SM holds (228 KiB on sm_90, 1 KiB more per block)
    r = tl.estimate_tile(on, tl.GemmTile(64, 64, 64, 16, 64, 5, wgmma=True, tma=True), 150, 200, 200, 1, 2,
                         tl.WS_F16, True, split=1)
    assert r.blocks_per_sm == 228 * 1024 // (tl.GemmTile(64, 64, 64, 16, 64, 5, wgmma=True, tma=True)
                                              .smem_bytes(2, True) + 1024) == 2
    # at BERT-base's batch-32 FFN shape the model takes N = 192 tiles (one wave of 128 tiles on 132 SMs)
    best = tl.rank_tiles(on, 4096, 768, 3072, 1, 2, tl.WS_F16, True, top_k=1)[0]
    assert best.tile.bn == 192 and best.tile.tma


# ---- the emulator's mbarriers and TMA copies, on a hand-written kernel ----------------------------------------
# One block: thread 0 initializes a barrier, expects BYTES and has the TMA copy a BOX_ROWS x 64 fp16 box at
# (BOX_C0, BOX_C1) into shared memory; every thread then waits (unless NO_WAIT) and copies the shared bytes out as
# they lie (swizzled). EXTRA_ARRIVALS, USE_BEFORE_INIT, a wrong BYTES, NEVER (nobody arrives) and NO_WAIT without
# WAIT_AFTER (the block exits with the copy in flight) are misuse the emulator must report.
TMA_KERNEL = r"""
#include "ortfuse_kernel.h"
#ifndef NO_WAIT
#define NO_WAIT 0
#endif
#ifndef EXTRA_ARRIVALS
#define EXTRA_ARRIVALS 0
#endif
#ifndef USE_BEFORE_INIT
#define USE_BEFORE_INIT 0
#endif
#ifndef BYTES
#define BYTES (BOX_ROWS * 128)
#endif
#ifndef NEVER
#define NEVER 0
#endif
#ifndef NO_READ
#define NO_READ 0
#endif
#ifndef WAIT_AFTER
#define WAIT_AFTER 0
#endif
extern "C" __global__ void __launch_bounds__(128) tma_box(const OfzArgs a, const __grid_constant__ OfzTma maps) {
  OFZ_DYNAMIC_SMEM(unsigned char, smem);
  unsigned char* tile = smem + ((1024u - (ofz::smem_u32(smem) & 1023u)) & 1023u);
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(tile + BOX_ROWS * 128);
  if (threadIdx.x == 0) {
    if (!USE_BEFORE_INIT) ofz::mbar_init(bar, 1);
    ofz::mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0 && !NEVER) {
    ofz::mbar_arrive_expect_tx(bar, (unsigned)BYTES);
    ofz::tma_load_2d(tile, &maps.map[0], BOX_C0, BOX_C1, bar);
    for (int i = 0; i < EXTRA_ARRIVALS; ++i) ofz::mbar_arrive(bar);
  }
  if (!NO_WAIT) ofz::mbar_wait(bar, 0u);
  unsigned char* out = (unsigned char*)a.ptr[1];
  if (!NO_READ)
    for (int i = threadIdx.x; i < BOX_ROWS * 128; i += 128) out[i] = tile[i];
  if (WAIT_AFTER) {  // everyone has read before anyone waits
    __syncthreads();
    ofz::mbar_wait(bar, 0u);
  }
}
OFZ_EMU_ENTRY_TMA(tma_box)
"""


def _tma_box(rows: int, c0: int, c1: int, defs: str = "", src_shape=(40, 100)):
    x = (np.arange(np.prod(src_shape)) % 2000 - 1000).astype(np.float16).reshape(src_shape)
    out = np.zeros(rows * 128, np.uint8)
    mod = compile_emulated(f"#define BOX_ROWS {rows}\n#define BOX_C0 {c0}\n#define BOX_C1 {c1}\n{defs}{TMA_KERNEL}")
    mod.launch("tma_box", 1, 128, [x, out], [], 1024 + rows * 128 + 8, tma=((0, rows, H), (0, rows, H)))
    return x, out


def _swizzled_box(x: np.ndarray, rows: int, c0: int, c1: int) -> np.ndarray:
    """The box as TMA lays it out: row r at 128 r bytes, its 16-byte chunk c at chunk c ^ (r % 8), zeros outside
    the tensor (the tile starts 1024-byte aligned, so the swizzle depends on r alone)."""
    box = np.zeros((rows, 64), np.float16)
    for r in range(rows):
        for e in range(64):
            if 0 <= c1 + r < x.shape[0] and 0 <= c0 + e < x.shape[1]:
                box[r, e] = x[c1 + r, c0 + e]
    out = np.zeros((rows, 8, 8), np.float16)
    for r in range(rows):
        for c in range(8):
            out[r, c ^ (r % 8)] = box[r, 8 * c:8 * c + 8]
    return out.reshape(-1).view(np.uint8)


@pytest.mark.parametrize("rows,c0,c1", [(16, 0, 0), (32, 64, 24), (8, 40, 3)])
def test_emulated_tma_copies_a_swizzled_zero_filled_box(rows, c0, c1):
    # (32, 64, 24): rows 24..55 of 40 and columns 64..127 of 100: both edges zero-filled
    x, out = _tma_box(rows, c0, c1)
    np.testing.assert_array_equal(out, _swizzled_box(x, rows, c0, c1))
    assert tma_geometry(x.shape, 2, rows) == (100, 40, 200, 64, rows)


@pytest.mark.parametrize("defs,message", [
    ("#define EXTRA_ARRIVALS 1\n", "more arrivals"),
    ("#define USE_BEFORE_INIT 1\n", "before mbarrier.init"),
    ("#define BYTES 1024\n", "more than the mbarrier expected"),  # expects fewer bytes than the box
    ("#define BYTES 8192\n", "deadlock.*mbarrier waits"),  # expects more: nobody completes the phase
    ("#define NEVER 1\n", "deadlock.*128 at mbarrier waits"),
])
def test_emulated_mbarriers_report_misuse(defs, message):
    with pytest.raises(EmulationError, match=message):
        _tma_box(32, 0, 0, defs)


def test_reading_a_tma_tile_without_waiting_reads_stale_bytes():
    # the copy lands only when some thread waits on its barrier: a kernel that reads first (and waits after)
    # reads what was there (the emulator fills shared memory with 0xff)
    x, out = _tma_box(16, 0, 0, "#define NO_WAIT 1\n#define WAIT_AFTER 1\n")
    assert (out == 0xFF).all()


def test_tma_intrinsics_compile_for_sm90a(tmp_path):
    src = ARCH_SPECIFIC_LINE + "\n#define BOX_ROWS 32\n#define BOX_C0 0\n#define BOX_C1 0\n" + TMA_KERNEL
    ck = compile_kernel(src, "tma_box", (90,), tmp_path)
    ptx = ck.ptx.decode()
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in ptx
    assert "mbarrier.arrive.expect_tx" in ptx and "fence.mbarrier_init" in ptx


def test_emulated_tma_reports_a_block_that_exits_with_copies_in_flight():
    # nobody waits: the copy is still queued when the block ends (on a GPU it would land in freed memory)
    with pytest.raises(EmulationError, match="exited with TMA copies in flight"):
        _tma_box(16, 0, 0, "#define NO_WAIT 1\n#define NO_READ 1\n")


def test_tma_kernels_take_their_maps_as_grid_constants_and_pin_registers_when_moving_them():
    # the tensor map must live in the parameter space (a local copy is not readable by the TMA unit), and a
    # kernel that moves registers with setmaxnreg asks for one block per SM: ptxas then allocates exactly 168
    # (with __launch_bounds__(384) alone it dropped setmaxnreg for a 128 x 64 tile at 58 registers, warning C7508)
    m, *_ = _bias(150, 200, 200, H)
    moving = _lowered(m, (128, 64, 64, 16, 64, 4, 1, 2))
    plain = _lowered(m, (64, 192, 64, 16, 192, 4, 1, 2))
    assert "const __grid_constant__ OfzTma ofz_tma" in render(plain.kernel)
    assert "__launch_bounds__(384, 1)" in render(moving.kernel) and "__launch_bounds__(256)" in render(plain.kernel)
    for spec, moves in ((moving, True), (plain, False)):
        ck = compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WG.cache)
        ((_, res),) = ck.resources
        assert ("setmaxnreg" in ck.ptx.decode()) == moves
        assert res.regs == 168 if moves else res.spill_bytes == 0


# ---- B multicast: pairs of blocks along M share B's tiles (run_wgmma_ws MC = 2) ------------------------------
@pytest.mark.parametrize("tile,M,sms,dt", [
    ((64, 64, 64, 16, 64, 4, 1, 3), 150, 0, H),      # 3 tiles along M: the last pair's second block computes past M
    ((128, 192, 64, 16, 192, 5, 1, 3), 300, 0, H),   # BERT's N = 768 tile, setmaxnreg
    ((64, 128, 64, 16, 128, 3, 1, 3), 330, 2, H),    # 2 SMs: each cluster loops over groups, the rings' phases carry on
    ((64, 128, 64, 16, 128, 3, 1, 3), 330, 2, BF),
])
def test_b_multicast_pairs(tile, M, sms, dt):
    # K = 328: 6 k tiles, not a multiple of any ring; N = 200: a partial column tile
    K, N = 328, 200
    m, x, w, b, ref = _bias(M, K, N, dt, seed=11)
    spec = _lowered(m, tile)
    t = tl.GemmTile.of_candidate(tile)
    assert t.mcast == 2 and spec.multicast == 2 and spec.block == t.consumers + 128
    # each block copies half of B's box; a unit is a pair of tiles along M
    assert spec.tma == ((0, t.bm, dt), (1, t.bn // 2, dt)) and spec.units_ceil[0][1] == 2 * t.bm
    _check_both_orders(spec, x, w, b, ref, dt, sms)
    if dt == H:
        ck = compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WG.cache)
        ((_, res),) = ck.resources
        assert res.spill_bytes == 0 and res.wgmma_serialized == "", res
        ptx = ck.ptx.decode()
        assert "multicast::cluster" in ptx and "mbarrier.arrive.release.cluster.shared::cluster" in ptx
        assert "barrier.cluster.arrive" in ptx


def _check_both_orders(spec, x, w, b, ref, dt, sms):
    """The kernel against `ref` in emulation, in round-robin thread order and with the cluster's first block
    run ahead as far as its barriers allow (lowest_first): a stage refilled before the other block of a
    multicast pair released it fails there (checked: consumers releasing only their own block's stage)."""
    for lowest_first in (False, True):
        out = np.zeros((ref.shape[0], ref.shape[1]), x.dtype)
        launch_spec(spec, [x, np.ascontiguousarray(w.T), b, out], [], sms=sms, lowest_first=lowest_first)
        got = _as_f64(out, dt)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2, lowest_first


def test_b_multicast_is_a_profile_candidate_the_model_does_not_rank():
    on = target_for((90,), True)
    t = tl.GemmTile(128, 192, 64, 16, 192, 5, wgmma=True, tma=True)
    twin = t.multicast_twin()
    assert twin.candidate(1) == (128, 192, 64, 16, 192, 5, 1, 3) and tl.GemmTile.of_candidate(twin.candidate(1)) == twin
    assert twin.threads == t.threads and twin.smem_bytes(2, True) == t.smem_bytes(2, True) and twin.family == 2
    assert tl.GemmTile(128, 192, 64, 16, 192, 5, wgmma=True).multicast_twin() is None  # no TMA, no multicast
    # B's tiles cross from L2 once per pair: at BERT's 4096 x 768 x 768 the re-read traffic binds, and halving
    # B's part of it lowers the estimate; no split-K in a multicast cluster
    plain, pair = (tl.estimate_tile(on, x, 4096, 768, 768, 1, 2, tl.WS_F16, True, split=1) for x in (t, twin))
    assert pair.est_us < plain.est_us
    assert tl.estimate_tile(on, twin, 64, 128, 4096, 1, 2, tl.WS_F16, True, split=2) is None
    # an odd tile count along M pads the last pair: 3 tiles of 128 rows estimate as 4
    odd = tl.estimate_tile(on, twin, 384, 768, 768, 1, 2, tl.WS_F16, True, split=1)
    even = tl.estimate_tile(on, twin, 512, 768, 768, 1, 2, tl.WS_F16, True, split=1)
    assert odd.est_us == even.est_us
    # not in the ranking (default builds keep unicast TMA until the GPU measures the pair)
    assert all(r.tile.mcast == 1 for r in tl.rank_tiles(on, 4096, 768, 768, 1, 2, tl.WS_F16, True, top_k=10**6))


# One cluster of two blocks: each copies its 16-row half of a 32-row box into both blocks (TMA multicast), so
# each block's barrier counts its own half and its peer's; each block writes its 32 rows out. EARLY_EXIT: block 1
# leaves at once, and block 0 arrives on block 1's barrier after a cluster barrier (which an exited block no
# longer holds up). MASK: the blocks the copies land in.
MC_KERNEL = r"""
#include "ortfuse_kernel.h"
#ifndef EARLY_EXIT
#define EARLY_EXIT 0
#endif
#ifndef MASK
#define MASK 3
#endif
extern "C" __global__ void __launch_bounds__(128) mc_box(const OfzArgs a, const __grid_constant__ OfzTma maps) {
  OFZ_DYNAMIC_SMEM(unsigned char, smem);
  unsigned char* tile = smem + ((1024u - (ofz::smem_u32(smem) & 1023u)) & 1023u);
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(tile + 32 * 128);
  const unsigned rank = ofz::cluster_rank();
  if (threadIdx.x == 0) {
    ofz::mbar_init(bar, 1);
    ofz::mbar_fence_init();
  }
  ofz::cluster_sync();
  if (EARLY_EXIT) {
    if (rank == 1) return;
    ofz::cluster_sync();
    if (threadIdx.x == 0) ofz::mbar_arrive_cluster(bar, 1);
    return;
  }
  if (threadIdx.x == 0) {
    ofz::mbar_arrive_expect_tx(bar, 32 * 128);
    ofz::tma_load_2d_multicast(tile + rank * 16 * 128, &maps.map[0], 0, (int)rank * 16, bar, (unsigned short)MASK);
  }
  ofz::mbar_wait(bar, 0u);
  unsigned char* out = (unsigned char*)a.ptr[1] + rank * 32 * 128;
  for (int i = threadIdx.x; i < 32 * 128; i += 128) out[i] = tile[i];
  ofz::cluster_sync();
}
OFZ_EMU_ENTRY_TMA(mc_box)
"""


def _mc_box(defs: str = ""):
    x = (np.arange(40 * 100) % 2000 - 1000).astype(np.float16).reshape(40, 100)
    out = np.zeros(2 * 32 * 128, np.uint8)
    compile_emulated(defs + MC_KERNEL).launch("mc_box", 2, 128, [x, out], [], 1024 + 32 * 128 + 8, cluster=2,
                                              tma=((0, 16, H),))
    return x, out


def test_emulated_multicast_lands_in_every_block_of_the_mask():
    x, out = _mc_box()
    want = _swizzled_box(x, 32, 0, 0)
    np.testing.assert_array_equal(out[:32 * 128], want)
    np.testing.assert_array_equal(out[32 * 128:], want)


@pytest.mark.parametrize("defs,message", [
    ("#define EARLY_EXIT 1\n", "mbar_arrive_cluster to block 1, whose threads have all exited"),
    ("#define MASK 4\n", "multicast mask 0x4 in a 2-block cluster"),
])
def test_emulated_cluster_copies_and_arrivals_report_misuse(defs, message):
    with pytest.raises(EmulationError, match=message):
        _mc_box(defs)


def test_multicast_intrinsics_compile_for_sm90a(tmp_path):
    ptx = [compile_kernel(ARCH_SPECIFIC_LINE + "\n" + defs + MC_KERNEL, "mc_box", (90,), tmp_path).ptx.decode()
           for defs in ("", "#define EARLY_EXIT 1\n")]
    assert ".multicast::cluster" in ptx[0] and "mbarrier.arrive.release.cluster.shared::cluster" in ptx[1]


# ---- ping-pong: the block's two consumer warpgroups take its tiles in turn (pingpong_consumers) ---------------
@pytest.mark.parametrize("tile,M,sms,dt", [
    ((64, 192, 64, 16, 192, 4, 1, 4), 150, 0, H),    # 3 x 2 tiles, one per block: warpgroup 1 idles
    ((128, 128, 64, 32, 128, 5, 1, 4), 300, 0, H),   # two m64 halves per warpgroup
    ((128, 128, 64, 32, 128, 5, 1, 4), 300, 0, BF),
    ((64, 128, 64, 16, 128, 3, 1, 4), 330, 1, H),    # one SM: 6 x 2 tiles through 1 or 2 blocks, turns across tiles
    ((64, 256, 64, 16, 256, 3, 1, 4), 270, 2, H),    # 5 tiles on up to 2 x blocks_per_sm blocks: odd counts
    # with B multicast: pairs of blocks run the same tile sequence, each warpgroup releasing stages in both
    ((64, 192, 64, 16, 192, 4, 1, 5), 150, 0, H),    # 3 tiles along M: the last pair's second block past M
    ((128, 128, 64, 32, 128, 3, 1, 5), 650, 2, H),   # 6 pairs x 2 on up to 2 clusters: turns across tiles
])
def test_pingpong_warpgroups(tile, M, sms, dt):
    K, N = 328, 200
    m, x, w, b, ref = _bias(M, K, N, dt, seed=13)
    spec = _lowered(m, tile)
    t = tl.GemmTile.of_candidate(tile)
    assert t.pingpong and t.consumers == 256 and spec.block == 384 and t.moves_registers
    assert spec.tma == ((0, t.bm, dt), (1, t.bn // t.mcast, dt)) and spec.multicast == t.mcast
    _check_both_orders(spec, x, w, b, ref, dt, sms)
    if dt == H:  # setmaxnreg: 232 per consumer thread holds a 128-accumulator tile without spills
        ck = compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WG.cache)
        ((_, res),) = ck.resources
        assert res.spill_bytes == 0 and res.wgmma_serialized == "" and res.regs == 168, res
        ptx = ck.ptx.decode()
        assert {"bar.arrive 2", "bar.arrive 3", "bar.sync 2", "bar.sync 3"} <= set(re.findall(r"bar\.\w+ \d", ptx))


def test_pingpong_is_a_profile_candidate_the_model_does_not_rank():
    on = target_for((90,), True)
    t = tl.GemmTile(64, 192, 64, 16, 192, 4, wgmma=True, tma=True, pingpong=True)
    assert t.candidate(1) == (64, 192, 64, 16, 192, 4, 1, 4) and tl.GemmTile.of_candidate(t.candidate(1)) == t
    assert t.threads == 384 and t.reg_limit(65536) == tl.WS_CONSUMER_REGS
    assert t.multicast_twin().candidate(1)[7] == 5 and tl.GemmTile.of_candidate(t.multicast_twin().candidate(1)).pingpong
    ranked = tl.rank_pingpong(on, 4096, 2304, 768, 1, 2)
    assert ranked and all(r.tile.pingpong and r.split == 1 for r in ranked)
    assert {(r.tile.bm, r.tile.bn) for r in ranked} == {(64, 128), (64, 192), (64, 256), (128, 128)}
    assert tl.estimate_tile(on, t, 64, 128, 4096, 1, 2, tl.WS_F16, True, split=2) is None
    assert all(not r.tile.pingpong for r in tl.rank_tiles(on, 4096, 2304, 768, 1, 2, tl.WS_F16, True, top_k=10**6))


# Named barriers: warps 0-1 bar.sync at 1 for 128 threads; warps 2-3 bar.arrive there (and go on), unless
# NO_SYNC, where nobody syncs and the arrivals are left over at exit.
NAMED_KERNEL = r"""
#include "ortfuse_kernel.h"
#ifndef NO_SYNC
#define NO_SYNC 0
#endif
extern "C" __global__ void __launch_bounds__(128) named(const OfzArgs a) {
  int* out = (int*)a.ptr[0];
  __shared__ int flag;
  if (threadIdx.x == 64) flag = 7;
  if (threadIdx.x < 64) {
    if (!NO_SYNC) {
      ofz::named_barrier_sync<1>(128);
      out[threadIdx.x] = flag;
    }
  } else {
    ofz::named_barrier_arrive<1>(128);
    out[threadIdx.x] = 1;
  }
}
OFZ_EMU_ENTRY(named)
"""


def test_emulated_bar_arrive_releases_the_syncing_warps_and_a_dangling_one_is_reported():
    out = np.zeros(128, np.int32)
    compile_emulated(NAMED_KERNEL).launch("named", 1, 128, [out], [])
    assert (out[:64] == 7).all() and (out[64:] == 1).all()
    with pytest.raises(EmulationError, match="64 of 128 threads arrived at named barrier 1"):
        compile_emulated("#define NO_SYNC 1\n" + NAMED_KERNEL).launch("named", 1, 128, [np.zeros(128, np.int32)], [])

"""GEMM tile configurations, constructed rather than guessed (Roller's rTile).

A tile is aligned to the hardware by construction: warp tiles are whole mma fragments (16 x 16 for
m16n8k16, 4 x 8 lanes for SIMT), the k step copies whole 16-byte chunks and, for 16-bit types, rows of 64
or 128 bytes (one or two 128-byte transactions per pair of rows). Candidates grow from the smallest such
tile; each is kept only while registers, shared memory and threads fit the hardware table entry, and
they are ranked by an analytic estimate for the busiest SM (Roller's "aligned with the number of SMs":
ceil(tiles / SMs) tiles of padded work each): the largest of its tensor/FMA time, its instruction-issue
time, its shared-memory time (operand writes and fragment reads at one 128-byte wavefront per clock),
its memory latency not covered by the pipeline's stages, DRAM time for the unique bytes and L2 time for
the re-read tile traffic. The top K are kept with the kernel so a
profiling step can pick among them on the real device.

Hopper (sm_90a, opt-in): warpgroup tiles for `wgmma.mma_async` (ortfuse_gemm.h run_wgmma): BK 64, warps of
16 rows x WN (64, 128, 192 or 256) columns, four of them along M per warpgroup, 4-6 stages; ranked by the
same estimate at the wgmma peak share, alongside the mma.sync tiles (lower_gemm keeps the faster family and
offers the others' best to --profile). The same warpgroups fed by TMA in a warp-specialized pipeline
(run_wgmma_ws: `tma` tiles, one producer warpgroup more, 3-7 stages, no copy instructions in the
consumers' k loop, every stage but the one being read in flight) are a third family, at their own share.

Split-K (sm_90 clusters, ortfuse_gemm.h): when a GEMM has fewer tiles than SMs and a long K, S blocks of a
cluster can share each tile, each running 1/S of its k tiles, then reduce through distributed shared
memory. Each tile is estimated at every S up to the target's cluster size that keeps the grid within one
wave and each block at least two k tiles; its best S (plus the reduction's cost) is what it ranks by."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ortfuse.customops.target import Target

MMA_F16, MMA_BF16, MMA_TF32, SIMT, WGMMA_F16, WGMMA_BF16 = 0, 1, 2, 3, 4, 5  # ofz::gemm::Math
WS_F16, WS_BF16 = 6, 7  # kWsWgmmaF16 / kWsWgmmaBF16: the TMA warp-specialized wgmma mainloop
WS = (WS_F16, WS_BF16)
WGMMA = (WGMMA_F16, WGMMA_BF16, *WS)  # warpgroup tiles, fed by cp.async or by TMA
WGMMA_OF = {MMA_F16: WGMMA_F16, MMA_BF16: WGMMA_BF16}
WS_OF = {MMA_F16: WS_F16, MMA_BF16: WS_BF16}
WGMMA_BK = 64  # one 128-byte swizzle row of 16-bit elements
WGMMA_SLACK = 1024  # dynamic shared memory added so the stages can start 1024-byte aligned
WS_PRODUCER = 128  # the TMA mainloop's producer warpgroup
MULTICAST = 2  # blocks per cluster sharing B through TMA multicast (GemmTile.mcast)
# registers per thread of a TMA tile with two consumer warpgroups (384 threads): 168 at launch, the
# producer gives back to 40 and the consumers take 232 (setmaxnreg; ortfuse_gemm.h WsRegs)
WS_CONSUMER_REGS = 232
MAX_REGS = 255
ROW_SLOTS = 4  # ortfuse_gemm.h kRowSlots: a row split across a cluster keeps this many floats per row
ROW_PHASES_TYPICAL = 2  # reductions of a LayerNorm or Softmax row pass: the cluster barriers the estimate charges
REG_OVERHEAD = 40  # addresses, loop counters, epilogue temporaries (estimate)
# Issue cost of one k tile, in instructions per thread (counted in the sm_90 SASS of generated kernels with
# cuobjdump, rounded): a cp.async chunk (advance its address, check k, issue), an operand element staged
# through registers (an im2col tap or an IR b_load: index math, bounds, load, shared store), the loop itself.
ISSUE_PER_CHUNK = 8
ISSUE_PER_STAGED = 30
# An element of the tap-major im2col gather (predicated load at a fixed channel stride, zero select, shared
# store): 7.8 per element in ResNet-50's 3x3 Conv kernels (cuobjdump, 2026-11-24), against 30 before.
ISSUE_PER_TAP = 8
ISSUE_PER_KTILE = 30
# Registers per thread and k tile: a cp.async chunk keeps its address (2), shared offset, k position and
# live flag; a staged element costs about 4 (ptxas -v on sm_90 im2col kernels with 8 to 48 staged
# elements: the value plus the index math the compiler keeps live to overlap the loads).
REGS_PER_CHUNK = 5
REGS_PER_STAGED = 4
# How an operand reaches shared memory (the `staged` pair, A then B): copied by cp.async, loaded element
# by element through registers (prologue math, the im2col gather), by the tap-major im2col gather, or (A
# only) copied by cp.async and read back once for the LayerNorm fold's row moments (no split-K).
DIRECT, ELEMENTS, TAPS, NORMED = 0, 1, 2, 3
# A third entry of `staged` (how the output leaves): STAGE_OUT, its epilogue goes through a slice of shared
# memory per warp (ortfuse_gemm.h for_each_acc_staged: outputs whose rows are not 16-byte aligned).
STAGE_OUT = 1
STAGE_SLICE_BYTES = 8 * 40 * 4  # a warp's slice: 8 rows of kStageLd floats

# The row moments of one 16-byte chunk of A (ortfuse_gemm.h RowMoments::add: a shared load, conversions,
# deviations from the shift, their sum and sum of squares), instructions per thread: the sm_90 SASS k loop of
# a 64x64x64 fp16 tile (4 chunks per thread) holds 238 instructions more than the plain tile's 190, of which
# ~18 per chunk sit in the branch taken once per tile (2026-11-25). And the registers a chunk slot keeps.
ISSUE_PER_MOMENT_CHUNK = 45
REGS_PER_MOMENT_CHUNK = 4


def stages_out(staged: tuple[int, ...]) -> bool:
    """Whether `staged` has the output leave through shared memory (its third entry STAGE_OUT)."""
    return len(staged) > 2 and staged[2] == STAGE_OUT


@dataclass(frozen=True)
class GemmTile:
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int

    @property
    def threads(self) -> int:
        return self.consumers + (WS_PRODUCER if self.tma else 0)

    @property
    def consumers(self) -> int:
        """Threads that compute (all of them but a TMA tile's producer warpgroup; a ping-pong tile has two
        warpgroups, each a whole tile)."""
        return (2 if self.pingpong else 1) * (self.bm // self.wm) * (self.bn // self.wn) * 32

    wgmma: bool = False  # a warpgroup-MMA tile (sm_90a): see the module docstring
    tma: bool = False  # fed by TMA in the warp-specialized pipeline (a wgmma tile)
    # a TMA tile whose clusters of `mcast` blocks take tiles stacked along M and share B's: each copies 1/mcast
    # of B's box into all of them (TMA multicast; ortfuse_gemm.h run_wgmma_ws MC)
    mcast: int = 1
    # a TMA tile computed by one warpgroup while the block's other one computes the next tile (ortfuse_gemm.h
    # pingpong_consumers): BM 64 or 128 (WM = BM / 4 rows per warp), WN = BN
    pingpong: bool = False

    @property
    def family(self) -> int:
        """0: warp-level MMA (mma.sync, tf32, SIMT); 1: wgmma fed by cp.async; 2: wgmma fed by TMA."""
        return 2 if self.tma else 1 if self.wgmma else 0

    @property
    def moves_registers(self) -> bool:
        """A TMA tile with two consumer warpgroups (384 threads): the producer hands its registers over to them
        (setmaxnreg; ortfuse_gemm.h WsRegs, which must agree), 232 each where a 384-thread block has 168 (a
        64 x 256 consumer tile holds 128 accumulators; split-K's reduction needs room too). Its kernel asks for
        one block per SM, so ptxas allocates exactly 168 at launch (without it, ptxas may drop setmaxnreg)."""
        return self.tma and self.consumers == 256

    def reg_limit(self, regs_per_sm: int) -> int:
        """Registers a computing thread may use: one block's share of the SM (in steps of 8), or a TMA tile's
        consumer share after setmaxnreg."""
        if self.moves_registers:
            return WS_CONSUMER_REGS
        return min(MAX_REGS, regs_per_sm // self.threads // 8 * 8)

    def smem_bytes(self, esize: int, b_nk: bool, row: bool = False, split: int = 1, row_cluster: int = 1,
                   stage_out: bool = False) -> int:
        """Dynamic shared memory of ortfuse_gemm.h's Layout: skewed A and B tiles per stage (wgmma: swizzled,
        unskewed, plus alignment slack); with a row-wise epilogue or split-K, at least the fp32 [BM][BN + 4]
        tile buffer (which reuses the drained stages), followed under split-K by the row epilogue's
        reduction scratch, and with a row split across a cluster by that scratch, the reductions' slots and the
        block's copy of the cluster's slots. A staged epilogue's slices, one per warp, come last."""
        if stage_out and not row:  # (ortfuse_gemm.h stage_slice: the end of the window, 16-byte aligned)
            return -(-self.smem_bytes(esize, b_nk, row, split, row_cluster) // 16) * 16 + \
                self.threads // 32 * STAGE_SLICE_BYTES
        pad = 0 if self.wgmma else 16 // esize
        a = self.bm * (self.bk + pad)
        b = self.bn * (self.bk + pad) if b_nk else self.bk * (self.bn + pad)
        # before the stages: the alignment slack, and a TMA ring's two mbarriers per stage
        base = (WGMMA_SLACK if self.wgmma else 0) + (16 * self.stages if self.tma else 0)
        pipeline = base + self.stages * (a + b) * esize
        buffer = self.bm * (self.bn + 4) * 4
        if split > 1:  # the partial tile in the drained stages (a TMA kernel's start after its barriers)
            return max(pipeline, (base if self.tma else 0) + buffer + (row_scratch_bytes(self) if row else 0))
        if row and row_cluster > 1:  # the slots, and the gathered copy of every block's (ortfuse_gemm.h)
            return max(pipeline, buffer + row_scratch_bytes(self) + (1 + row_cluster) * ROW_SLOTS * self.bm * 4)
        return max(pipeline, buffer) if row else pipeline

    def block_smem_bytes(self, esize: int, b_nk: bool, row: bool = False, split: int = 1, fold: bool = False,
                         row_cluster: int = 1, stage_out: bool = False) -> int:
        """All shared memory of a block: the dynamic bytes (with a staged epilogue's slices) plus the row
        epilogue's static scratch and the LayerNorm fold's rstd per row."""
        fold_rstd = 4 * self.bm if fold else 0
        static = row_scratch_bytes(self) if row and row_cluster == 1 else 0
        return self.smem_bytes(esize, b_nk, row, split, row_cluster, stage_out) + static + fold_rstd

    def regs(self, math_: int, esize: int = 2, staged: tuple[int, int] = (DIRECT, DIRECT)) -> int:
        """Registers per thread: accumulators, fragments, the copies' addresses and the staged elements."""
        acc = self.wm * self.wn // 32
        if self.wgmma:  # operands stay in shared memory; a copy's chunk steps from one pointer per operand
            return acc + REG_OVERHEAD + 8
        frags = (self.wm // 16) * 4 + (self.wn // 8) * 2 if math_ != SIMT else self.wm // 4 + self.wn // 8
        chunks, elems, taps = self.operand_work(esize, staged)
        moments = self.moment_chunks(esize) * REGS_PER_MOMENT_CHUNK if staged[0] == NORMED else 0
        return acc + frags + REG_OVERHEAD + chunks * REGS_PER_CHUNK + (elems + taps) * REGS_PER_STAGED + moments

    def moment_chunks(self, esize: int) -> int:
        """A's 16-byte chunks per thread and k tile (the LayerNorm fold's row moments read each once)."""
        return -(-(self.bm * self.bk * esize // 16) // self.threads)

    def operand_work(self, esize: int, staged: tuple[int, int]) -> tuple[int, int, int]:
        """(cp.async chunks, staged elements, tap-major gather elements) per thread and k tile; `staged` says
        how A and B are loaded (DIRECT, ELEMENTS or TAPS; a bool reads as DIRECT / ELEMENTS)."""
        chunk = 16 // esize
        counts = [0, 0, 0]
        for how, size in zip(staged, (self.bm * self.bk, self.bk * self.bn)):
            per = -(-size // self.threads)
            how = DIRECT if how == NORMED else how
            counts[int(how)] += per if how else -(-per // chunk)
        return counts[0], counts[1], counts[2]

    def issue_per_ktile(self, math_: int, esize: int, staged: tuple[int, int]) -> int:
        """Instructions each thread (so each warp) issues per k tile: the math's shared loads and MMA/FMA
        instructions, the operand copies, the loop."""
        if self.tma:  # per consumer warp: the wgmmas, fences, commit, wait, the mbarrier wait and release
            return self.bk // 16 + 10 + ISSUE_PER_KTILE
        if self.wgmma:  # per warp: one wgmma per k16 step, the fences, commit and wait
            math_ops = self.bk // 16 + 6
        elif math_ == SIMT:
            mt, nt = self.wm // 4, self.wn // 8
            math_ops = self.bk * (mt + nt + mt * nt)
        else:
            mt, nt = self.wm // 16, self.wn // 8
            step = 16 if math_ != MMA_TF32 else 8
            frag = mt + -(-nt // 2) if math_ != MMA_TF32 else 4 * mt + 2 * nt  # ldmatrix, or tf32 converts
            math_ops = (self.bk // step) * (frag + mt * nt)
        chunks, elems, taps = self.operand_work(esize, staged)
        moments = self.moment_chunks(esize) * ISSUE_PER_MOMENT_CHUNK if staged[0] == NORMED else 0
        return (math_ops + chunks * ISSUE_PER_CHUNK + elems * ISSUE_PER_STAGED + taps * ISSUE_PER_TAP + ISSUE_PER_KTILE
                + moments)

    def smem_wavefronts_per_ktile(self, math_: int, esize: int, staged: tuple[int, int], line: int = 128) -> int:
        """Shared-memory wavefronts (one `line`-byte access per clock per SM) a block spends per k tile: its
        operand writes and its warps' fragment reads (below). ortfuse_emu.h counts both for ldmatrix and
        cp.async launches (tests/customops/test_smem_traffic.py)."""
        moments = -(-self.bm * self.bk * esize // line) if staged[0] == NORMED else 0  # A read back once
        return self.smem_writes_per_ktile(esize, staged, line) + self.smem_reads_per_ktile(math_) + moments

    def smem_writes_per_ktile(self, esize: int, staged: tuple[int, int], line: int = 128) -> int:
        """The operands written into the stage: cp.async chunks by the byte (TileCopy places every
        quarter-warp's chunks in distinct banks), register-staged elements one warp store each."""
        warps = self.threads // 32
        writes = 0
        for how, size in zip(staged, (self.bm * self.bk, self.bk * self.bn)):
            writes += -(-size * esize // line) if how in (DIRECT, NORMED) else -(-size // self.threads) * warps
        return writes

    def smem_reads_per_ktile(self, math_: int) -> int:
        """Every warp's fragment reads: ldmatrix.x4 is 4 wavefronts (one per 8 x 8 matrix), a warp's scalar
        or broadcast load 1. wgmma reads its operands through the async proxy, whose shared-memory
        bandwidth NVIDIA does not document: not charged (to measure on the device)."""
        if self.wgmma:
            return 0
        if math_ == SIMT:
            per_warp = self.bk * (self.wm // 4 + self.wn // 8)
        elif math_ == MMA_TF32:  # scalar fragment loads: 4 per A tile, 2 per B tile per k8 step
            per_warp = (self.bk // 8) * (4 * (self.wm // 16) + 2 * (self.wn // 8))
        else:  # ldmatrix.x4: one per 16 x 16 A tile, one per pair of 16 x 8 B tiles, per k16 step
            per_warp = (self.bk // 16) * 4 * (self.wm // 16 + -(-(self.wn // 8) // 2))
        return (self.threads // 32) * per_warp

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        return (self.bm, self.bn, self.bk, self.wm, self.wn, self.stages)

    def candidate(self, split: int) -> tuple[int, ...]:
        """The --profile candidate: (BM, BN, BK, WM, WN, STAGES, SPLIT), plus a trailing 1 for a wgmma tile
        (2: fed by TMA, 3: fed by TMA with B multicast across pairs of blocks, 4: fed by TMA to ping-pong
        warpgroups, 5: both)."""
        if not self.wgmma:
            return (*self.as_tuple(), split)
        kind = (2 + (self.mcast > 1) + 2 * self.pingpong) if self.tma else 1
        return (*self.as_tuple(), split, kind)

    @staticmethod
    def of_candidate(t: Sequence[int]) -> "GemmTile":
        kind = t[7] if len(t) > 7 else 0
        return GemmTile(*t[:6], wgmma=kind in (1, 2, 3, 4, 5), tma=kind in (2, 3, 4, 5),
                        mcast=MULTICAST if kind in (3, 5) else 1, pingpong=kind in (4, 5))

    def multicast_twin(self) -> Optional["GemmTile"]:
        """This TMA tile (cooperative or ping-pong) with B multicast across pairs of blocks (None where that does
        not apply: not a TMA tile, or half of B's box not whole 8-row swizzle atoms)."""
        if not self.tma or self.mcast > 1 or (self.bn // MULTICAST) % 8:
            return None
        return dataclasses.replace(self, mcast=MULTICAST)


# A GEMM gets one kernel per size class (the fastest tile at each binding, picked per run by the library from
# the rows) where that beats the fastest single tile by this factor (geometric mean): `by_size`, on measured
# times (profile) or the tile model's (api._size_variants, and lowering's comparison of tile families)
VARIANT_GAIN = 1.05
Times = tuple[float, ...]  # microseconds per call, one per binding
Variants = tuple[tuple[int, tuple[int, ...]], ...]  # a GEMM's further kernels by size: (rows from, tile)


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(max(float(x), 1e-9)) for x in xs) / len(xs))


def by_size(per_tile: Sequence[tuple[tuple[int, ...], Times]], rows: Sequence[int],
            best: Times) -> tuple[Optional[tuple[int, ...]], Variants, Optional[Times]]:
    """Kernel variants by size from the times of each tile at each binding: (the smallest bindings' tile,
    ((rows from, tile), ...), the times so built) with a threshold at the geometric mean of neighbouring
    bindings' rows where the fastest tile changes; (None, (), None) where one tile is fastest everywhere,
    the bindings do not differ in size, or the variants gain less than VARIANT_GAIN over `best` (the
    fastest single tile of all)."""
    if len(per_tile) < 2 or len(set(rows)) < len(rows) or not all(t for t, _ in per_tile):
        return None, (), None
    order = sorted(range(len(rows)), key=lambda b: rows[b])
    fastest = [min(per_tile, key=lambda x: x[1][b])[0] for b in order]
    combo = tuple(min(ts[b] for _, ts in per_tile) for b in range(len(rows)))
    if len(set(fastest)) == 1 or geomean(best) < VARIANT_GAIN * geomean(combo):
        return None, (), None
    more = []
    for i in range(1, len(order)):
        if fastest[i] != fastest[i - 1]:
            more.append((int(round(math.sqrt(rows[order[i - 1]] * rows[order[i]]))), fastest[i]))
    return fastest[0], tuple(more), combo


@dataclass(frozen=True)
class Ranked:
    tile: GemmTile
    est_us: float
    blocks_per_sm: int
    split: int = 1  # blocks of a cluster that share each tile's K (the kernel's SPLIT)


def _candidates(math_: int, esize: int) -> list[GemmTile]:
    out = []
    if math_ in WGMMA:  # (consumer) warpgroups of 64 x WN, at most 4; TMA: one box per operand (BN <= 256)
        tma = math_ in WS
        for wn in (64, 128, 192, 256):
            for wg_m in (1, 2, 4):
                for wg_n in (1, 2):
                    if wg_m * wg_n > 4 or (tma and wn * wg_n > 256):
                        continue
                    for stages in ((3, 4, 5, 6, 7) if tma else (4, 5, 6)):
                        out.append(GemmTile(64 * wg_m, wn * wg_n, WGMMA_BK, 16, wn, stages, wgmma=True, tma=tma))
        return out
    if math_ == SIMT:
        warp = [(wm, wn) for wm in (8, 16, 32) for wn in (16, 32, 64) if wm * wn // 32 <= 64]
        bks = (16, 32)
    else:
        warp = [(wm, wn) for wm in (16, 32, 64) for wn in (16, 32, 64)]
        bks = (32, 64) if esize == 2 else (16, 32)
    for wm, wn in warp:
        for wr in (1, 2, 4):
            for wc in (1, 2, 4):
                if wr * wc > 8:
                    continue
                for bk in bks:
                    for stages in (2, 3, 4):
                        out.append(GemmTile(wm * wr, wn * wc, bk, wm, wn, stages))
    return out


def _pingpong_candidates() -> list[GemmTile]:
    """Ping-pong TMA tiles: a warpgroup's whole tile, at most 128 accumulators per thread (64 x 128, 64 x 192,
    64 x 256, 128 x 128), 3-7 stages."""
    return [GemmTile(bm, bn, WGMMA_BK, bm // 4, bn, stages, wgmma=True, tma=True, pingpong=True)
            for bm, bn in ((64, 128), (64, 192), (64, 256), (128, 128)) for stages in (3, 4, 5, 6, 7)]


def rank_pingpong(tgt: Target, m: int, n: int, k: int, batch: int, esize: int) -> list[Ranked]:
    """The ping-pong TMA tiles that fit, best first by the estimate (which does not see what they are for: the
    epilogue they overlap with MMAs). Not in `rank_tiles` until a GPU measures them: --profile candidates and
    the sweep's family "wgmma+TMA pingpong"."""
    out = [r for r in (_estimate(tgt, t, 1, m, n, k, batch, esize, WS_F16, True, False, (DIRECT, DIRECT))
                       for t in _pingpong_candidates()) if r is not None]
    out.sort(key=lambda r: (r.est_us, -r.tile.bm * r.tile.bn, -r.tile.stages, r.tile.as_tuple()))
    return out


def family(math_: int) -> int:
    """The tile family (GemmTile.family) a math runs on."""
    return 2 if math_ in WS else 1 if math_ in WGMMA else 0


def row_scratch_bytes(t: GemmTile) -> int:
    """Static shared memory of the row-wise epilogue (ortfuse_gemm.h row_scratch: a float per warp)."""
    return 4 * (t.threads // 32)


def row_split(n: int, t: GemmTile) -> int:
    """Blocks of a cluster that share a row-wise epilogue's rows when the tile is narrower than the N-column
    row (ortfuse_gemm.h RSPLIT: block r takes columns r*BN ..); 1 when the tile spans the row."""
    return max(1, -(-n // t.bn))


def _row_cluster_candidates(tgt: Target, math_: int, esize: int, n: int) -> list[GemmTile]:
    """Any GEMM tile narrower than the row whose blocks, ceil(N / BN) of them, fit in one cluster (sm_90): the
    row split across the cluster. Not the TMA tiles (their producer warpgroup cannot join the row pass)."""
    if tgt.max_cluster < 2 or math_ in WS:
        return []
    return [t for t in _candidates(math_, esize) if t.bn < n and 2 <= row_split(n, t) <= tgt.max_cluster]


def _row_candidates(math_: int, esize: int, n: int) -> list[GemmTile]:
    """Tiles whose BN covers a whole row of N: the warps along N split it into whole fragments."""
    out = []
    frag = 8 if math_ == SIMT else 16
    wms = (4, 8, 16) if math_ == SIMT else (16, 32)
    bks = (16, 32) if math_ == SIMT or esize == 4 else (32, 64)
    for wm in wms:
        for wr in (1, 2, 4):
            for wc in (1, 2, 4, 8):
                if wr * wc > 8:
                    continue
                wn = -(-n // (wc * frag)) * frag
                if (wc - 1) * wn >= n:  # the last warp column would hold only padding
                    continue
                if math_ == SIMT and wm * wn // 32 > 64:
                    continue
                for bk in bks:
                    for stages in (2, 3):
                        out.append(GemmTile(wm * wr, wn * wc, bk, wm, wn, stages))
    return out


def _estimate(tgt: Target, t: GemmTile, split: int, m: int, n: int, k: int, batch: int, esize: int, math_: int,
              b_nk: bool, row: bool, staged: tuple[int, int]) -> Optional[Ranked]:
    """The tile's time with `split` blocks per tile, or None where it does not fit or split-K does not apply."""
    rsplit = row_split(n, t) if row else 1
    if rsplit > 1 and (split > 1 or rsplit > tgt.max_cluster or t.tma):
        return None  # a row split across a cluster: no split-K in the same cluster, no TMA producer
    regs = t.regs(math_, esize, staged)
    if t.block_smem_bytes(esize, b_nk, row, split, staged[0] == NORMED, rsplit, stages_out(staged)) > \
            tgt.smem_per_block or regs > MAX_REGS or \
            t.threads > tgt.max_threads_per_block or (t.tma and regs > t.reg_limit(tgt.regs_per_sm)):
        return None
    if t.mcast > 1 and (split > 1 or tgt.max_cluster < t.mcast or not t.tma):
        return None  # B multicast: clusters of mcast blocks along M, no split-K in them
    if t.pingpong and (split > 1 or row or not t.tma):
        return None  # ping-pong: whole tiles per warpgroup, a plain epilogue
    if t.tma:  # a block holds its launch's per-thread count (setmaxnreg only moves registers between its warps)
        regs = tgt.regs_per_sm // t.threads // 8 * 8 if t.moves_registers else -(-regs // 8) * 8
    # do not pad a small problem into a huge tile: at most one partial tile's worth of waste per axis
    if (t.bm > 16 and t.bm // 2 >= m) or (t.bn > 16 and t.bn // 2 >= n and not row):
        return None
    block_smem = t.block_smem_bytes(esize, b_nk, row, split, staged[0] == NORMED, rsplit, stages_out(staged)) + \
        tgt.smem_reserved_per_block
    blocks_per_sm = min(tgt.smem_per_sm // block_smem, tgt.regs_per_sm // (regs * t.threads),
                        tgt.max_threads_per_sm // t.threads, 32)
    if blocks_per_sm < 1:
        return None
    # B multicast: tiles in groups of mcast along M (a last odd group's other block computes a tile past M)
    tiles_m = -(-m // t.bm)
    tiles_m = -(-tiles_m // t.mcast) * t.mcast
    tiles = batch * tiles_m * -(-n // t.bn)
    ktiles_all = -(-k // t.bk)
    if split > 1 and (tiles * split > tgt.sm_count or ktiles_all < 2 * split or staged[0] == NORMED):
        return None  # split only within one wave, each block keeps a pipeline's worth of k tiles, whole rows of A
    blocks = tiles * split
    ktiles = -(-ktiles_all // split)  # the busiest block's share
    kp = ktiles * t.bk
    share = 1.0 if math_ == SIMT else tgt.wgmma_ws_share if math_ in WS else tgt.wgmma_share if math_ in WGMMA \
        else tgt.mma_sync_share
    peak = (tgt.mma_tf32_tflops if math_ == MMA_TF32 else tgt.fp32_tflops if math_ == SIMT
            else tgt.mma_f16_tflops) * 1e12 * share
    # the busiest SM decides: it runs ceil(blocks / SMs) blocks, up to blocks_per_sm at once sharing its
    # tensor cores (or FMA units), one per scheduler, so fewer than 4 resident warps leave some idle
    per_sm = math.ceil(blocks / tgt.sm_count)
    warps = t.consumers // 32
    resident_warps = min(per_sm, blocks_per_sm) * warps
    sm_rate = peak / tgt.sm_count * min(1.0, resident_warps / 4)
    t_math = per_sm * 2.0 * t.bm * t.bn * kp / sm_rate
    unique = esize * batch * (m * k + k * n + m * n)
    reread = esize * tiles * (t.bm + t.bn / t.mcast) * ktiles_all * t.bk  # multicast: B once per cluster
    t_mem = max(unique / (tgt.dram_gbps * 1e9), reread / (tgt.dram_gbps * tgt.l2_over_dram * 1e9))
    # instruction issue: an SM issues at most one instruction per clock for each of its 4 schedulers,
    # and a warp uses one; element-wise operand loads make a tile issue-bound long before the tensor
    # cores are
    rate = min(4, resident_warps)
    t_issue = per_sm * ktiles * warps * t.issue_per_ktile(math_, esize, staged) / (rate * tgt.clock_ghz * 1e9)
    # latency: a block keeps stages - 1 k tiles in flight (run_wgmma's cp.async ring: stages - 2), so each k
    # tile waits at least a memory round trip / that many; the SM runs its blocks in ceil(per_sm /
    # blocks_per_sm) rounds. This is what binds a long K loop over few tiles (small M at batch 1), and
    # what split-K divides
    rounds = math.ceil(per_sm / blocks_per_sm)
    in_flight = t.stages - (2 if t.wgmma and not t.tma else 1)
    t_lat = rounds * ktiles * tgt.mem_latency_ns * 1e-9 / in_flight
    # shared memory (Roller's L1 level): the SM's one wavefront per clock carries every block's operand
    # writes and its warps' fragment reads, so narrow warp tiles, which re-read A or B per warp, are
    # bound here long before the tensor cores are (a 16 x 64 warp tile at about 1.4x the mma.sync time)
    t_smem = per_sm * ktiles * t.smem_wavefronts_per_ktile(math_, esize, staged, tgt.smem_bytes_per_clk) / (
        tgt.clock_ghz * 1e9)
    est = max(t_math, t_mem, t_issue, t_lat, t_smem) * 1e6
    if split > 1:  # two cluster barriers, and each block reads its rows of the S - 1 other partial tiles
        remote = (split - 1) / split * t.bm * t.bn * 4
        est += 2 * tgt.cluster_sync_ns * 1e-3 + remote / (tgt.dsmem_gbps_per_sm * 1e3)
    if rsplit > 1:  # a barrier per reduction (two: LayerNorm, Softmax) and one after the pass, per tile
        est += math.ceil(per_sm / blocks_per_sm) * (ROW_PHASES_TYPICAL + 1) * tgt.cluster_sync_ns * 1e-3
    return Ranked(t, est, blocks_per_sm, split)


def epilogue_us(tgt: Target, r: Ranked, m: int, n: int, batch: int, branches: float) -> float:
    """What an epilogue with `branches` per output element adds to a ranked tile, at the split the runtime
    launches it with: after the mainloop, on the tile's computing threads (split-K: each block its 1/S of
    the rows), one element after another (Target.epilogue_branch_clocks). Not in the tile ranking: one
    measured shape calibrates it, too little to re-rank tiles by."""
    tiles = batch * -(-m // r.tile.bm) * -(-n // r.tile.bn)
    split = runtime_split(r.split, tiles, tgt.sm_count)
    rounds = math.ceil(math.ceil(tiles * split / tgt.sm_count) / r.blocks_per_sm)
    per_thread = r.tile.bm * r.tile.bn / split / r.tile.consumers  # elements each computing thread finishes
    return rounds * per_thread * branches * tgt.epilogue_branch_clocks / (tgt.clock_ghz * 1e3)


def _best_split(tgt: Target, t: GemmTile, *args, only: Optional[int] = None) -> Optional[Ranked]:
    """The tile at its best split (1, 2, 4 ... up to the target's cluster size; or `only` that one); ties
    keep the smaller."""
    best = None
    split = 1
    while split <= tgt.max_cluster:
        r = _estimate(tgt, t, split, *args) if only in (None, split) else None
        if r is not None and (best is None or r.est_us < best.est_us):
            best = r
        split *= 2
    return best


def estimate_tile(tgt: Target, t: GemmTile, m: int, n: int, k: int, batch: int, esize: int, math_: int, b_nk: bool,
                  row: bool = False, staged: tuple[int, int] = (DIRECT, DIRECT),
                  split: Optional[int] = None) -> Optional[Ranked]:
    """One given tile (a profiling candidate, a user's choice) at its best split, or at `split`; None if it
    does not fit (or that split does not apply)."""
    return _best_split(tgt, t, m, n, k, batch, esize, math_, b_nk, row, staged, only=split)


def rank_tiles(tgt: Target, m: int, n: int, k: int, batch: int, esize: int, math_: int, b_nk: bool,
               top_k: int = 4, row: bool = False, staged: tuple[int, int] = (DIRECT, DIRECT),
               bk_divides: int = 0) -> list[Ranked]:
    """Feasible tiles for a (batch x) M x N x K GEMM, best first (dims at their typical values), each at its
    best split-K. `row`: only tiles spanning whole rows (N <= BN), for a row-wise epilogue. `staged`: how A and
    B reach shared memory (DIRECT: cp.async; ELEMENTS: element loads through registers, for prologue math
    or the im2col gather; TAPS: the tap-major gather). `bk_divides`: only tiles whose BK divides it (the
    tap-major gather's channel count)."""
    return list(_ranked(tgt, m, n, k, batch, esize, math_, b_nk, row, tuple(staged), bk_divides)[:top_k])


@functools.lru_cache(maxsize=4096)
def _ranked(tgt: Target, m: int, n: int, k: int, batch: int, esize: int, math_: int, b_nk: bool, row: bool,
            staged: tuple[int, int], bk_divides: int) -> tuple[Ranked, ...]:
    """Every feasible tile, best first (memoized: a model's repeated layers lower the same GEMM many times)."""
    ranked = []
    # a whole row per tile leaves no room for the wgmma pipeline's stages: wgmma tiles only split the row
    # across a cluster
    cands = ((_row_candidates(math_, esize, n) if math_ not in WGMMA else []) +
             _row_cluster_candidates(tgt, math_, esize, n)) if row else _candidates(math_, esize)
    for t in cands:
        if bk_divides and bk_divides % t.bk:
            continue
        r = _best_split(tgt, t, m, n, k, batch, esize, math_, b_nk, row, staged)
        if r is not None:
            ranked.append(r)
    # ties (issue- or DRAM-bound tiles): the larger tile, then 3 stages (CUTLASS's sm_80 default: latency
    # the model does not see is still hidden, and a 2-stage ring of staged operands costs local memory); a
    # TMA ring holds no registers per stage, so there the deepest that fits (as CUTLASS's Hopper kernels)
    ranked.sort(key=lambda r: (r.est_us, -r.tile.bm * r.tile.bn, -r.tile.stages if r.tile.tma else
                               abs(r.tile.stages - 3), r.split, r.tile.as_tuple()))
    return tuple(ranked)


def launch_blocks(grid: int, split_k: int, blocks_per_sm: int, sm_count: int, row_cluster: int = 1,
                  multicast: int = 1) -> tuple[int, int]:
    """(blocks, blocks per cluster) the native library launches (ofz_spec_resolve) for `grid` work blocks on a
    device of `sm_count` SMs: a row split's clusters of exactly row_cluster blocks (the grid counts them
    already), B multicast's clusters of exactly `multicast` blocks (the grid counts clusters; persistent, at
    most blocks_per_sm per SM), split-K clusters within one wave, else a persistent kernel's grid capped at
    blocks_per_sm per SM (re-exported as `attrs.launch_blocks`)."""
    if row_cluster > 1:
        if grid % row_cluster:
            raise ValueError(f"{grid} blocks do not form clusters of {row_cluster}")
        return grid, row_cluster
    cluster = multicast if multicast > 1 else runtime_split(split_k, grid, sm_count)
    if blocks_per_sm > 0 and sm_count > 0 and (cluster == 1 or multicast > 1):  # persistent, in whole clusters
        grid = min(grid, max(1, blocks_per_sm * sm_count // cluster))
    return grid * cluster, cluster


def runtime_split(split_k: int, grid: int, sm_count: int) -> int:
    """Blocks per cluster a kernel compiled for `split_k` launches with on a grid of `grid` tiles: the largest
    power of two up to split_k that keeps the split grid within one wave (the native library's
    ofz_spec_cluster; re-exported as `attrs.cluster_for`)."""
    c = 1
    while grid > 0 and 2 * c <= split_k and grid * 2 * c <= sm_count:
        c *= 2
    return c


Shape = tuple[int, int, int, int]  # (m, n, k, batch) at one binding of the symbolic dims


def clear_caches() -> None:
    """Forget memoized rankings (tests that swap the candidate generator)."""
    _ranked.cache_clear()
    _joint.cache_clear()


def estimate_at(tgt: Target, r: Ranked, shape: Shape, esize: int, math_: int, b_nk: bool, row: bool = False,
                staged: tuple[int, int] = (DIRECT, DIRECT)) -> float:
    """A ranked tile's estimate at another binding, at the split the runtime launches it with there."""
    m, n, k, batch = shape
    split = runtime_split(r.split, batch * -(-m // r.tile.bm) * -(-n // r.tile.bn), tgt.sm_count)
    for s in dict.fromkeys((split, 1)):
        e = estimate_tile(tgt, r.tile, m, n, k, batch, esize, math_, b_nk, row, staged, s)
        if e is not None:
            return e.est_us
    return math.inf


def rank_for_bindings(tgt: Target, shapes: Sequence[Shape], esize: int, math_: int, b_nk: bool, top_k: int = 4,
                      row: bool = False, staged: tuple[int, int] = (DIRECT, DIRECT),
                      bk_divides: int = 0) -> list[Ranked]:
    """`rank_tiles` for a kernel that serves several bindings of its symbolic dims (batch 1 and batch 32: one
    compiled tile runs both). Tiles are ranked by the geometric mean over the bindings of their estimate
    over that binding's best tile's, so a tile that is best at batch 1 but half as fast as another at batch
    32 loses to one a little slower at batch 1. `est_us` stays the first binding's. The first binding's best
    tile is always among the `top_k`, last if it did not rank there; the other bindings' bests follow."""
    return list(_joint(tgt, tuple(map(tuple, shapes)), esize, math_, b_nk, top_k, row, tuple(staged), bk_divides))


@functools.lru_cache(maxsize=1024)
def _joint(tgt: Target, shapes: tuple[Shape, ...], esize: int, math_: int, b_nk: bool, top_k: int, row: bool,
           staged: tuple[int, int], bk_divides: int) -> tuple[Ranked, ...]:
    m, n, k, batch = shapes[0]
    ranked = rank_tiles(tgt, m, n, k, batch, esize, math_, b_nk, 10**6, row, staged, bk_divides)
    order = list(range(len(ranked)))
    own_best = [ranked[0]] if ranked else []  # each binding's best tile
    if len(shapes) > 1 and ranked:
        score = [math.log(r.est_us / ranked[0].est_us) for r in ranked]
        for shape in shapes[1:]:
            best = rank_tiles(tgt, *shape[:3], shape[3], esize, math_, b_nk, 1, row, staged, bk_divides)
            for i, r in enumerate(ranked if best else ()):
                score[i] += math.log(max(estimate_at(tgt, r, shape, esize, math_, b_nk, row, staged), 1e-9) /
                                     best[0].est_us)
            own_best += [r for r in ranked if best and r.tile == best[0].tile][:1]
        order.sort(key=lambda i: (score[i], i))  # ties: rank_tiles's order
    out = [ranked[i] for i in order][:top_k]
    # the first binding's own best stays a candidate, so `--profile` can overrule the model's other figures
    if ranked and ranked[0] not in out:
        out = [*out[:top_k - 1], ranked[0]]
    # and every binding's own best (a split-K tile at batch 1, a wide one at 32; for a row-wise epilogue a
    # whole-row tile and a split row): --profile then has each to time, and may ship them as variants by size
    out += [r for r in dict.fromkeys(own_best) if r not in out]
    return tuple(with_both_row_kinds(out, [ranked[i] for i in order], n) if row else out)


def with_both_row_kinds(cands: Sequence[Ranked], pool: Sequence[Ranked], n: int) -> list[Ranked]:
    """A row-wise epilogue's candidates plus, for each kind of tile they lack (one spanning the N-column row, one
    splitting it across a cluster: different kernels, which --profile should both time), the first of `pool`."""
    out = list(cands)
    for split in (False, True):
        if not any((row_split(n, r.tile) > 1) == split for r in out):
            out += [r for r in pool if (row_split(n, r.tile) > 1) == split][:1]
    return out


# ---- the attention kernel's tiles (ortfuse_attention.h), for the lowering and the cost model ----------------
THREADS = 128
SIMT_BLOCK_M, MMA_BLOCK_M = 32, 64
MMA_MIN_BLOCKS = 4
KEY_SPLIT_MAX = 4  # ortfuse_attention.h kMaxKeySplit


def simt_block_n(d: int, dv: int) -> int:
    """SimtTile<D, DV>::BLOCK_N: keys per tile."""
    return 16 if d > 64 or dv > 64 else 32


def mma_block_n(d: int, dv: int) -> int:
    """MmaTile<D, DV>::BLOCK_N: keys per tile."""
    return 32 if d > 64 or dv > 64 else 64


def mma_smem_bytes(d: int, dv: int, esize: int = 2) -> int:
    """MmaTile<D, DV>::SMEM_BYTES of ortfuse_attention.h."""
    bn, pad = mma_block_n(d, dv), 8
    return esize * (MMA_BLOCK_M * (d + pad) + 2 * bn * (d + pad) + 2 * bn * (dv + pad))


def key_split(tgt: Target, d: int, dv: int, sk_hint: int) -> int:
    """Blocks of a cluster that may share a unit's keys (the node's split_k; the library launches clusters only
    while the units fit in one wave: small batches): up to KEY_SPLIT_MAX and the key tiles at the hint, where
    the target has clusters and the merge's state fits the tile's shared memory (MmaTile::SPLIT_STATE_BYTES)."""
    if (4 + dv // 2) * THREADS * 4 > mma_smem_bytes(d, dv):
        return 1
    return max(1, min(KEY_SPLIT_MAX, tgt.max_cluster, -(-sk_hint // mma_block_n(d, dv))))


def attention_clocks(tgt: Target, mma: bool, units: int, keys: int, block_n: int, split: int,
                     work: float = 1.0, rope_pairs: int = 0, visible: float = 1.0, longest: int = 0) -> float:
    """Core clocks of our attention kernel (Target.attn_*): the longer of one block's chain over its share of
    a unit's key tiles (the split the library launches: `runtime_split`, clusters only while the units fit one
    wave; `longest`: the most tiles a unit visits, 0 for every tile) and the SMs' time over every unit's
    tiles; `work`: a tile's work over the fitted tile's; `rope_pairs`: column pairs of a K tile the kernel
    rotates (`Target.attn_rope_pair_clocks`); `visible`: the share of the units' tiles visited (a causal
    frontier)."""
    tile, per_sm = ((tgt.attn_mma_tile_clocks, tgt.attn_mma_sm_clocks) if mma else
                    (tgt.attn_simt_tile_clocks, tgt.attn_simt_sm_clocks))
    rope = rope_pairs / THREADS * tgt.attn_rope_pair_clocks
    tiles = longest or -(-keys // block_n)
    c = runtime_split(split, units, tgt.sm_count)
    chain = tgt.attn_fixed_clocks + (tgt.attn_split_clocks if c > 1 else 0.0) + -(-tiles // c) * (tile * work + rope)
    return max(chain, units * keys / block_n * visible * (per_sm * work + rope) / tgt.sm_count)  # a last tile's share

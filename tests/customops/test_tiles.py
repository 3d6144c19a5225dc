"""The tile model (customops/tiles.py): every ranked tile fits the hardware table entry, and the estimate
follows the busiest SM: idle SMs add nothing, one tile too many doubles the time, and a long K loop over
few tiles is bound by memory latency, which deeper pipelines and split-K (sm_90 clusters) cover."""
from __future__ import annotations

import dataclasses

import pytest

from ortfuse.customops import target, tiles
from ortfuse.customops.tiles import MMA_F16, MMA_TF32, SIMT, GemmTile

H100 = target.for_cc(90)
H100_UNSPLIT = dataclasses.replace(H100, max_cluster=1)  # the tile model without split-K


def _est(tile: GemmTile, m: int, n: int, k: int, math_: int = MMA_F16, tgt: target.Target = H100_UNSPLIT) -> float:
    r = tiles.estimate_tile(tgt, tile, m, n, k, 1, 2 if math_ == MMA_F16 else 4, math_, False)
    assert r is not None, f"{tile} not feasible for {m}x{n}x{k}"
    return r.est_us


@pytest.mark.parametrize("cc", sorted(target.TABLE))
@pytest.mark.parametrize("math_,esize", [(MMA_F16, 2), (MMA_TF32, 4), (SIMT, 4)])
@pytest.mark.parametrize("row", [False, True])
def test_ranked_tiles_fit_the_hardware(cc, math_, esize, row):
    tgt = target.for_cc(cc)
    for m, n, k in ((128, 768, 768), (4096, 3072, 768), (7, 33, 20)):
        ranked = tiles.rank_tiles(tgt, m, n, k, 1, esize, math_, False, top_k=50, row=row)
        assert ranked or row, (cc, m, n, k)  # a row-spanning tile may not fit in shared memory
        for r in ranked:
            t = r.tile
            rsplit = tiles.row_split(n, t) if row else 1
            assert t.block_smem_bytes(esize, False, row, row_cluster=rsplit) <= tgt.smem_per_block
            assert t.regs(math_, esize) <= tiles.MAX_REGS and t.threads <= tgt.max_threads_per_block
            assert r.blocks_per_sm >= 1 and r.est_us > 0
            # a row spans the tile, or the blocks of one cluster (sm_90: no split-K in the same cluster)
            assert rsplit == 1 or (rsplit <= tgt.max_cluster and r.split == 1 and not t.tma)
        assert [r.est_us for r in ranked] == sorted(r.est_us for r in ranked)


def test_tiles_on_idle_sms_run_concurrently():
    # 24 tiles on 132 SMs take as long as one tile alone (the busiest SM runs one either way)
    t = GemmTile(64, 64, 64, 16, 32, 4)
    assert _est(t, 128, 768, 768) == pytest.approx(_est(t, 64, 64, 768))


def test_one_tile_more_than_the_sms_doubles_the_time():
    t = GemmTile(128, 128, 32, 32, 64, 2)  # fp32 SIMT: bound by the SM's issue rate, not by memory
    full = _est(t, 128 * 132, 128, 2048, SIMT)  # 132 tiles
    assert _est(t, 128 * 132 + 1, 128, 2048, SIMT) == pytest.approx(2 * full, rel=0.02)


def test_long_k_loops_over_few_tiles_want_deep_pipelines():
    # BERT-base FFN down-projection at batch 1: 24 tiles, 48 k tiles each; latency binds, not math, until
    # the deep pipeline meets the shared-memory bound
    shallow, deep = GemmTile(64, 64, 64, 32, 32, 2), GemmTile(64, 64, 64, 32, 32, 4)
    assert _est(deep, 128, 768, 3072) < _est(shallow, 128, 768, 3072) / 1.5
    best = tiles.rank_tiles(H100, 128, 768, 3072, 1, 2, MMA_F16, False, top_k=1)[0].tile
    assert best.stages >= 3


def test_split_k_where_few_tiles_run_a_long_k_loop():
    # BERT-base FFN down-projection at batch 1 (128 x 768 x 3072): few tiles, 96 k tiles of 32. Splitting K
    # over a cluster fills idle SMs; the grid stays within one wave and each block keeps >= 2 k tiles
    best = tiles.rank_tiles(H100, 128, 768, 3072, 1, 2, MMA_F16, False, top_k=1)[0]
    unsplit = tiles.rank_tiles(H100_UNSPLIT, 128, 768, 3072, 1, 2, MMA_F16, False, top_k=1)[0]
    assert best.split > 1 and best.est_us < unsplit.est_us
    t = best.tile
    assert -(-128 // t.bm) * -(-768 // t.bn) * best.split <= H100.sm_count
    assert -(-3072 // t.bk) >= 2 * best.split
    # the same tile unsplit is slower by more than the reduction costs
    assert _est(t, 128, 768, 3072) > best.est_us


@pytest.mark.parametrize("m,n,k", [(4096, 768, 3072), (128, 768, 64)])
def test_no_split_k_when_the_grid_is_full_or_k_is_short(m, n, k):
    for r in tiles.rank_tiles(H100, m, n, k, 1, 2, MMA_F16, False, top_k=50):
        assert r.split == 1


def test_no_split_k_without_clusters():
    for cc in (80, 86, 89):
        assert all(r.split == 1 for r in tiles.rank_tiles(target.for_cc(cc), 128, 768, 3072, 1, 2, MMA_F16, False,
                                                          top_k=50))


def test_split_k_tiles_reserve_the_partial_tile():
    t = GemmTile(16, 768, 32, 16, 96, 2)  # a row-wise epilogue's tile
    assert t.smem_bytes(2, False, row=True, split=4) == max(t.smem_bytes(2, False),
                                                             16 * 772 * 4 + tiles.row_scratch_bytes(t))
    assert t.smem_bytes(2, False, split=4) == max(t.smem_bytes(2, False), 16 * 772 * 4)
    assert t.smem_bytes(2, False, split=1) == t.smem_bytes(2, False)


def test_tap_major_gather_is_cheaper_to_issue_and_keeps_bk_dividing_the_channels():
    t = GemmTile(128, 64, 64, 32, 32, 3)
    staged = t.issue_per_ktile(MMA_F16, 2, (tiles.DIRECT, tiles.ELEMENTS))
    taps = t.issue_per_ktile(MMA_F16, 2, (tiles.DIRECT, tiles.TAPS))
    assert t.operand_work(2, (tiles.DIRECT, tiles.TAPS)) == (4, 0, 16)
    assert taps == staged - 16 * (tiles.ISSUE_PER_STAGED - tiles.ISSUE_PER_TAP)
    ranked = tiles.rank_tiles(H100, 256, 3136, 576, 1, 2, MMA_F16, False, top_k=50,
                              staged=(tiles.DIRECT, tiles.TAPS), bk_divides=32)
    assert ranked and {r.tile.bk for r in ranked} == {32}


@pytest.mark.parametrize("n, k, row", [(2304, 768, False), (3072, 768, False), (768, 768, True), (768, 3072, True)])
def test_a_symbolic_batch_gets_a_tile_for_batch_1_and_batch_32(n, k, row):
    """BERT-base's GEMMs (M = batch x 128): the batch-1 best tile takes 1.2-2x the batch-32 best's time at
    batch 32 in the model; the tile chosen for both stays near the best at each."""
    b1, b32 = (128, n, k, 1), (4096, n, k, 1)
    both = tiles.rank_for_bindings(H100, [b1, b32], 2, MMA_F16, False, row=row)
    only1 = tiles.rank_tiles(H100, *b1[:3], 1, 2, MMA_F16, False, top_k=1, row=row)[0]
    best32 = tiles.rank_tiles(H100, *b32[:3], 1, 2, MMA_F16, False, top_k=1, row=row)[0].est_us
    # the top 4 by the joint score, then each binding's own best where it is not among them; a row-wise
    # epilogue's candidates hold both a tile spanning the row and a row split across a cluster
    assert 4 <= len(both) <= 6
    assert not row or {tiles.row_split(n, r.tile) > 1 for r in both} == {False, True}
    tile32 = tiles.rank_tiles(H100, *b32[:3], 1, 2, MMA_F16, False, top_k=1, row=row)[0].tile
    assert any(r.tile == tile32 for r in both)  # --profile may time it, and ship it for large batches
    assert both[0].est_us == tiles.estimate_tile(
        H100, both[0].tile, *b1[:3], 1, 2, MMA_F16, False, row, split=both[0].split).est_us  # batch 1's figure
    at32 = lambda r: tiles.estimate_at(H100, r, b32, 2, MMA_F16, False, row)  # noqa: E731
    assert at32(only1) > 1.2 * best32 and only1 in both  # still a --profile candidate
    if row:  # the whole-row tile wins batch 1 by far, a row split across a cluster batch 32: both are candidates
        assert tiles.row_split(n, tile32) > 1
    else:
        assert at32(both[0]) < 1.15 * best32 and both[0].est_us < 1.4 * only1.est_us
    # one binding: rank_tiles (a row-wise epilogue's list may end with the other kind of row tile)
    assert tiles.rank_for_bindings(H100, [b1], 2, MMA_F16, False, row=row)[:4] == tiles.rank_tiles(
        H100, *b1[:3], 1, 2, MMA_F16, False, row=row)


def test_runtime_split_keeps_the_split_grid_in_one_wave():
    assert [tiles.runtime_split(8, g, 132) for g in (1, 16, 17, 33, 66, 67, 200)] == [8, 8, 4, 4, 2, 1, 1]
    assert tiles.runtime_split(1, 4, 132) == 1


def test_narrow_warp_tiles_are_bound_by_shared_memory():
    # BERT-base FFN up-projection at batch 32 (4096 x 3072 x 768): a 16 x 64 warp tile re-reads B for every 16
    # rows, so its ldmatrix traffic outruns the tensor cores; 64 x 64 warp tiles are math-bound. Without the
    # shared-memory term both were priced at the mma.sync peak.
    narrow, wide = GemmTile(64, 128, 64, 16, 64, 3), GemmTile(128, 256, 32, 64, 64, 3)
    for t in (narrow, wide):  # 128 B per clock per SM: ldmatrix.x4 = 4 wavefronts
        mt, nt, warps = t.wm // 16, t.wn // 8, t.threads // 32
        assert t.smem_reads_per_ktile(MMA_F16) == warps * (t.bk // 16) * 4 * (mt + nt // 2)
        assert t.smem_writes_per_ktile(2, (tiles.DIRECT, tiles.DIRECT)) == (t.bm + t.bn) * t.bk * 2 // 128
    assert _est(narrow, 4096, 3072, 768) > 1.5 * _est(wide, 4096, 3072, 768)
    best = tiles.rank_tiles(H100, 4096, 3072, 768, 1, 2, MMA_F16, False, top_k=5)
    assert all(r.tile.wm * r.tile.wn >= 64 * 64 for r in best), best
    # the narrow tile's time is its busiest SM's wavefronts at one per clock
    per_sm = -(-(4096 // 64) * (3072 // 128) // H100.sm_count)
    waves = per_sm * (768 // 64) * narrow.smem_wavefronts_per_ktile(MMA_F16, 2, (tiles.DIRECT, tiles.DIRECT))
    assert _est(narrow, 4096, 3072, 768) == pytest.approx(waves / (H100.clock_ghz * 1e3))

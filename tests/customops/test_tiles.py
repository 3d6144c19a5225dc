"""The tile model (customops/tiles.py): every ranked tile fits the hardware table entry, and the estimate
follows the busiest SM: idle SMs add nothing, one tile too many doubles the time, and a long K loop over
few tiles is bound by memory latency, which deeper pipelines cover."""
from __future__ import annotations

import pytest

from ortfuse.customops import target, tiles
from ortfuse.customops.tiles import MMA_F16, MMA_TF32, SIMT, GemmTile

H100 = target.for_cc(90)


def _est(tile: GemmTile, m: int, n: int, k: int, math_: int = MMA_F16) -> float:
    ranked = tiles.rank_tiles(H100, m, n, k, 1, 2 if math_ == MMA_F16 else 4, math_, False, top_k=10_000)
    hit = [r.est_us for r in ranked if r.tile == tile]
    assert hit, f"{tile} not feasible for {m}x{n}x{k}"
    return hit[0]


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
            assert t.block_smem_bytes(esize, False, row) <= tgt.smem_per_block
            assert t.regs(math_, esize) <= tiles.MAX_REGS and t.threads <= tgt.max_threads_per_block
            assert r.blocks_per_sm >= 1 and r.est_us > 0
            assert not row or t.bn >= n
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
    # BERT-base FFN down-projection at batch 1: 24 tiles, 48 k tiles each; latency binds, not math
    shallow, deep = GemmTile(64, 64, 64, 16, 32, 2), GemmTile(64, 64, 64, 16, 32, 4)
    assert _est(deep, 128, 768, 3072) < _est(shallow, 128, 768, 3072) / 2.5
    best = tiles.rank_tiles(H100, 128, 768, 3072, 1, 2, MMA_F16, False, top_k=1)[0].tile
    assert best.stages >= 3

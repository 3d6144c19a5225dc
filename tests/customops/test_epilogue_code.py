"""The GEMM epilogue's machine code (sm_90a, no GPU needed). On the H200 (2026-11-26) every GEMM family spent a
fixed ~18 us on a 4096 x 768 output: each bias load waited for the store before it (a possible alias) and
each pair of halves was stored as two 2-byte stores. Inputs are now read through `ofz::load_arg` (the
read-only path, movable past stores), pairs are stored as one word, and a whole tile's epilogue has no
per-fragment branch, so ptxas issues its loads ahead of its stores."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from ortfuse.bench import sweep


def _kernel(family: str, m: int = 4096, n: int = 768, k: int = 768):
    cand = next(c for f, c, _ in sweep.candidates(m, n, k, 1) if f == family)
    built = sweep.GemmCase.of((m, n, k)).build(cand, Path(tempfile.mkdtemp()))
    return built.source, built.compiled


@pytest.mark.parametrize("family", list(sweep.FAMILIES))
def test_bias_is_read_through_the_read_only_path_and_pairs_are_stored_whole(family):
    src, ck = _kernel(family)
    assert "ofz::load_arg<2>(t2 + gn" in src  # the bias: an input, so `const`, so the read-only overload
    ptx = ck.ptx.decode()
    assert "ld.global.nc.b32" in ptx
    stores = set(re.findall(r"\bst\.global[\.\w]*", ptx))
    assert stores & {"st.global.v2.u16", "st.global.v2.b16", "st.global.b32", "st.global.u32"}, stores
    assert dict(ck.resources)[90].spill_bytes == 0


def test_a_whole_tiles_bias_loads_issue_ahead_of_its_stores():
    try:
        from ortfuse.bench.sass import cuobjdump, sass
        cuobjdump()
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"no cuobjdump (a developer tool): {err}")
    _, ck = _kernel("wgmma+TMA")
    ops = [ins for _, ins in sass(dict(ck.cubins)[90]) if "LDG" in ins or "STG" in ins]
    run = best = 0
    for ins in ops:
        run = run + 1 if "LDG.E.CONSTANT" in ins else 0
        best = max(best, run)
    # 128 x 192 tile, a warpgroup's 64 x 192: 24 column pairs per thread, each bias pair loaded once
    assert best >= 16, ops[:40]
    assert not any("STG.E.U16" in ins for ins in ops[-60:])  # the whole-tile path's stores are words


def test_split_k_reduction_reads_a_chunk_of_partial_sums_together():
    # batch-1 BERT FFN-down (128x768x3072, split 8 in clusters): each thread reads the cluster's partial sums
    # of four column pairs before their epilogues; one pair at a time left one remote-read latency per pair
    try:
        from ortfuse.bench.sass import cuobjdump, sass
        cuobjdump()
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"no cuobjdump (a developer tool): {err}")
    _, ck = _kernel("mma.sync", 128, 768, 3072)
    ops = [ins.split()[1] if ins.startswith("@") else ins.split()[0] for _, ins in sass(dict(ck.cubins)[90])]
    ops = [op for op in ops if op.startswith(("LD", "ST"))]  # the memory instructions, in program order
    run = best = 0
    for op in ops:
        run = run + 1 if op.startswith("LD.E") else 0
        best = max(best, run)
    assert best >= 40, best  # 4 pairs x 2 columns x the 7 other blocks' partials (and its own)

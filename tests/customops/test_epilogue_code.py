"""The GEMM epilogue's machine code (sm_90a, no GPU needed). On the H200 (2026-11-26) every GEMM family spent a
fixed ~18 us on a 4096 x 768 output: each bias load waited for the store before it (a possible alias) and
each pair of halves was stored as two 2-byte stores. Inputs are now read through `ofz::load_arg` (the
read-only path, movable past stores), pairs are stored as one word, and a whole tile's epilogue has no
per-fragment branch, so ptxas issues its loads ahead of its stores."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from helpers import const, launch_spec, model, node, sass_or_skip, vi
from ortfuse.api import target_for
from ortfuse.bench import sweep
from ortfuse.bench.sass import loops
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import render
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.regions import plan


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
    sass = sass_or_skip()
    _, ck = _kernel("wgmma+TMA")
    ops = [ins for _, ins in sass(dict(ck.cubins)[90]) if "LDG" in ins or "STG" in ins]
    run = best = 0
    for ins in ops:
        run = run + 1 if "LDG.E.128.CONSTANT" in ins else 0
        best = max(best, run)
    # 128 x 192 tile, a warpgroup's 64 x 192: per thread 6 groups of 8 columns on each of 2 rows; the 6
    # bias vectors load together, then the 12 16-byte stores (epi8, after the quads' exchange)
    assert best >= 6, ops[-60:]
    assert sum("STG.E.128" in ins for ins in ops) == 12, ops[-60:]


@pytest.mark.parametrize("family", list(sweep.FAMILIES))
def test_whole_tiles_store_16_byte_vectors(family):
    # a quad of threads held 16 contiguous bytes per row as four 4-byte pairs, so each warp store filled half
    # of every 32-byte sector (H200 Nsight Compute, 2026-11-26); whole tiles now exchange pairs within the
    # quad and read and write 8 columns per access
    src, ck = _kernel(family)
    assert "void epi8(" in src and "ofz::load_arg<8>(t2 + gn" in src
    ptx = ck.ptx.decode()
    assert "st.global.v4.b32" in ptx and "ld.global.nc.v4.b32" in ptx and "shfl.sync.bfly" in ptx
    assert dict(ck.resources)[90].spill_bytes == 0


def _bias_region(dt_in, dt_bias, n):
    rng = np.random.default_rng(3)
    np_in = {TP.FLOAT16: np.float16, TP.FLOAT: np.float32}
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Cast", ["z"], ["out"], to=TP.FLOAT16)],
              [vi("x", dt_in, [64, 64])], [vi("out", TP.FLOAT16, None)],
              [const("w", rng.standard_normal((64, n)).astype(np_in[dt_in]), np_in[dt_in]),
               const("b", rng.standard_normal(n).astype(np_in[dt_bias]), np_in[dt_bias])])
    g = build_graph(m, {})
    (r,) = plan(g, target_for((90,), False)).regions
    return render(lower(g, r, target_for((90,), False)).kernel)


def test_epi8_only_where_every_access_takes_eight_lanes():
    assert "void epi8(" in _bias_region(TP.FLOAT16, TP.FLOAT16, 256)
    assert "void epi8(" not in _bias_region(TP.FLOAT16, TP.FLOAT16, 196)  # rows of 196: not whole groups of 8
    assert "void epi8(" not in _bias_region(TP.FLOAT, TP.FLOAT, 256)  # fp32 lanes: 8 would be 32 bytes


@pytest.mark.parametrize("tile", [(64, 64, 32, 32, 32, 3, 1), (64, 128, 32, 32, 64, 3, 1),
                                  (64, 128, 64, 16, 128, 4, 1, 1), (128, 64, 64, 16, 64, 4, 1, 1),
                                  (64, 128, 64, 16, 128, 4, 1, 2)])  # mma.sync, wgmma, wgmma fed by TMA
def test_epi8_matches_ort(tile):
    # y = gelu(x @ w + b) + r on whole tiles (128 x 256) and partial ones (M = 200): mma.sync and wgmma
    # accumulators through the quads' exchange, against ORT on the CPU
    rng = np.random.default_rng(11)
    M, K, N = 200, 96, 256
    x, r = (rng.standard_normal(s).astype(np.float16) for s in ((M, K), (M, N)))
    w, b = (rng.standard_normal(s).astype(np.float16) * 0.2 for s in ((K, N), (N,)))
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Gelu", ["z"], ["gz"]),
               node("Add", ["gz", "r"], ["out"])], [vi("x", TP.FLOAT16, [M, K]), vi("r", TP.FLOAT16, [M, N])],
              [vi("out", TP.FLOAT16, None)], [const("w", w, np.float16), const("b", b, np.float16)], opset=20)
    g = build_graph(m, {})
    tgt = target_for((90,), len(tile) > 7)
    (region,) = plan(g, tgt).regions
    spec = lower(g, region, tgt, tile=tile)
    assert "void epi8(" in render(spec.kernel)
    values = {"x": x, "r": r, "w": w, "b": b}
    for t, perm in spec.input_perms:
        values[t] = np.ascontiguousarray(np.transpose(values[t], perm))
    out = np.full((M, N), np.nan, np.float16)
    launch_spec(spec, [values[i] for i in spec.inputs] + [out], [])
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "r": r})[0]
    err = np.abs(out.astype(np.float64) - want.astype(np.float64)).max() / np.abs(want.astype(np.float64)).max()
    assert err < 1e-2, err


@pytest.mark.parametrize("family,shape", [("mma.sync", (128, 768, 3072)), ("mma.sync", (1024, 768, 768)),
                                          ("wgmma+TMA", (1024, 768, 768))])
def test_split_k_reduction_reads_a_chunk_of_partial_sums_together(family, shape):
    # batch-1 BERT FFN-down (split 8) and M = 1024 (split 2 and 4, where split-K tiles measured 2-4x their
    # unsplit tile on the H200): each thread reads every split's partial of 8 / S column groups (one at S = 8),
    # 16 bytes each, before any sum; before, one column pair at a time waited for its reads behind a run-time integer
    # division, so at S = 2 and 4 every pair cost a distributed shared-memory round trip
    sass = sass_or_skip()
    # At S <= 4 the groups are 8 columns wide and their sums leave through epi8 (16-byte stores; session 17),
    # at S = 8 they stay 4 wide, so that the reads in flight stay 8
    import re
    _, ck = _kernel(family, *shape)
    code = sass(dict(ck.cubins)[90])
    ins = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in code]
    reads = [i for i, op in enumerate(ins) if op == "LD.E.128"]  # generic: the peers' shared memory
    mem = [op for op in ins[reads[0]:reads[-1] + 1] if op.startswith(("LD", "ST"))]
    assert len(reads) == 8 and mem == ["LD.E.128"] * 8, mem
    assert not any(op.startswith("I2F") for op in ins[reads[0] - 40:reads[-1] + 1])  # no run-time division
    assert dict(ck.resources)[90].spill_bytes == 0
    back = loops(code)
    first = code[reads[0]][0]
    lo, hi = min(((lo, hi) for lo, hi in back if lo <= first <= hi), key=lambda r: r[1] - r[0])
    wide = sum(1 for (a, _), op in zip(code, ins) if lo <= a <= hi and op == "STG.E.128")
    assert (wide > 0) == (shape != (128, 768, 3072)), wide  # the split-8 FFN-down stays 4 wide

"""bench/sweep.py on the CPU: which tiles each shape gets (every family, the model's best first), that each
forced kernel and both ORT baselines are valid models, and the report. Device times need the GPU; here a
stand-in timer runs every model once on ORT's CPU EP (fused nodes through their function bodies) and
returns a figure per kind."""
from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort

from ortfuse.bench import sweep
from ortfuse.runtime import FallbackWarning, InferenceSession


def _timer(calls: list):
    def timer(model, feeds, fused: bool) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            sess = (InferenceSession(model, providers=["CPUExecutionProvider"]) if fused else
                    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]))
        (out,) = sess.run(None, dict(feeds))
        assert np.isfinite(out.astype(np.float32)).all()
        ops = tuple(n.op_type for n in model.graph.node)
        calls.append(ops)
        return 5.0 if fused else 4.0 if ops == ("MatMul",) else 8.0
    return timer


def test_sweep_times_each_family_against_cublas_and_the_ort_region():
    calls: list = []
    (res,) = sweep.run([(256, 192, 128)], per_family=2, timer=_timer(calls))
    assert res.cublas_us == 4.0 and res.ort_region_us == 8.0
    fams = [r.family for r in res.rows]
    # the TMA family's tiles again with B multicast across pairs of blocks, and ping-pong tiles without and with
    # it: families of their own
    assert sorted(set(fams)) == sorted(sweep.NAMES) and len(fams) == 12
    assert all(r.us == 5.0 and r.est_us > 0 and r.regs > 0 and r.spill_bytes == 0 for r in res.rows)
    assert [r.tile[7] if len(r.tile) > 7 else 0 for r in res.rows] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [r.tile[:7] for r in res.rows[6:8]] == [r.tile[:7] for r in res.rows[4:6]]
    assert [r.tile[:7] for r in res.rows[10:]] == [r.tile[:7] for r in res.rows[8:10]]
    assert calls[:2] == [("MatMul",), ("MatMul", "Add")] and len(calls) == 14
    text = sweep.render_md([res])
    assert "wgmma+TMA" in text and "cuBLAS (ORT MatMul) 4.0 us" in text
    assert "wgmma+TMA: best tile / cuBLAS median 1.25" in text
    assert "wgmma+TMA pingpong multicast best / wgmma+TMA best: 256x192x128 1.00" in text


def test_shapes_parse_from_the_command_line():
    assert sweep._shape("4096x768x3072") == (4096, 768, 3072)
    import argparse
    import pytest
    with pytest.raises(argparse.ArgumentTypeError):
        sweep._shape("4096x768")


def test_a_failing_tile_is_recorded_and_the_sweep_goes_on():
    # a kernel that fails at launch (a bad tensor map, a trap) marks its row; the others are still timed
    calls: list = []
    inner = _timer(calls)
    count = {"fused": 0}

    def timer(model, feeds, fused: bool) -> float:
        if fused:
            count["fused"] += 1
            if count["fused"] == 1:
                raise RuntimeError("CUDA error: an illegal instruction was encountered")
        return inner(model, feeds, fused)

    seen: list = []
    (res,) = sweep.run([(256, 192, 128)], per_family=1, timer=timer, on_shape=lambda r: seen.append(len(r)))
    assert seen == [1]
    failed = [r for r in res.rows if r.error]
    assert len(failed) == 1 and "illegal instruction" in failed[0].error and np.isnan(failed[0].us)
    assert all(r.us == 5.0 for r in res.rows if not r.error)
    text = sweep.render_md([res])
    assert "failed: RuntimeError" in text and "1 tile(s) failed to run" in text


def test_a_shape_the_cost_model_leaves_to_ort_is_still_swept():
    # the plan may keep a GEMM on cuBLAS (e.g. 128x768x768 at batch 1); the sweep times our tiles regardless
    from ortfuse.api import target_for
    from ortfuse.rewriter.shapes import build_graph
    from ortfuse.search.regions import plan
    g = build_graph(sweep.gemm_model(128, 768, 768), {})
    r = sweep.forced_region(g)
    assert r.kind == "gemm" and len(r.nodes) == 2 and r.traffic.fused_bytes > 0
    assert [x.nodes for x in plan(g, target_for(sweep.ARCHS, True)).regions] in ([], [r.nodes])


def test_diagnostics_time_each_familys_best_tile_without_its_stores_and_unflushed():
    calls: list = []
    warm: list = []

    def noflush(model, feeds, fused):
        warm.append(fused)
        return 3.0

    (res,) = sweep.run([(256, 192, 128)], per_family=2, timer=_timer(calls), ablate=True, no_flush=True,
                       noflush_timer=noflush)
    plain = [r for r in res.rows if not r.variant]
    ablated = [r for r in res.rows if r.variant == "no epilogue"]
    unflushed = [r for r in res.rows if r.variant == "no L2 flush"]
    assert len(plain) == 12 and len(ablated) == 6 and len(unflushed) == 6
    assert {r.family for r in ablated} == set(sweep.NAMES)
    assert all(r.us == 3.0 for r in unflushed) and res.cublas_noflush_us == 3.0 and warm.count(False) == 1
    # the ablated kernel ran on the CPU through its function body, so its figure is the stand-in's; what
    # matters here is that it is a different kernel: compiled with the ablation define
    text = sweep.render_md([res])
    assert "(no epilogue)" in text and "best tile, no epilogue:" in text and "cuBLAS, no L2 flush: 256x192x128 4.0 -> 3.0 us" in text
    assert "best tile / cuBLAS median 1.25" in text  # the diagnostics do not count as tiles


def test_the_ablation_define_removes_the_epilogue_stores(tmp_path):
    # compiled for sm_90a: the ablated kernel keeps its TMA copies and wgmma; its stores sit behind the
    # never-true compare with 1e-38 (0f006CE3EE in PTX), which the real kernel does not have
    case = sweep.GemmCase.of((256, 192, 128))
    cand = [c for f, c, _ in sweep.candidates(256, 192, 128, 1) if f == "wgmma+TMA"][0]
    full, cut = case.build(cand, tmp_path), case.build(cand, tmp_path, ablate=True)
    assert cut.source != full.source and sweep.ABLATE in cut.source
    ptx_full, ptx_cut = full.compiled.ptx.decode(), cut.compiled.ptx.decode()
    assert "wgmma.mma_async" in ptx_cut and "cp.async.bulk.tensor" in ptx_cut
    assert "0F006CE3EE" in ptx_cut.upper() and "0F006CE3EE" not in ptx_full.upper()


def test_the_ablation_of_a_split_k_tile_leaves_out_its_reduction(tmp_path):
    # a split-K tile's epilogue is its reduction through the peers' shared memory (mapa) and the stores:
    # ablated, neither is left (before, the reduction stayed in and "no epilogue" timed it)
    case = sweep.GemmCase.of((1024, 768, 768))
    cand = [c for f, c, _ in sweep.candidates(1024, 768, 768, 1) if f == "mma.sync"][0]
    assert cand[6] > 1, cand  # split-K
    full, cut = case.build(cand, tmp_path), case.build(cand, tmp_path, ablate=True)
    ptx_full, ptx_cut = full.compiled.ptx.decode(), cut.compiled.ptx.decode()
    assert "mapa" in ptx_full and "mapa" not in ptx_cut and "mma.sync" in ptx_cut


def test_an_epilogue_is_also_timed_as_cublas_plus_our_kernel():
    # --epilogue softsign: the forced region holds a division by a tensor; the sweep adds ORT's bare MatMul +
    # our element-wise kernel for the epilogue alone (each a valid model here), and the estimates carry the
    # branch's term (the GELU's, branch-free, not)
    calls: list = []
    (res,) = sweep.run([(256, 192, 128)], per_family=1, timer=_timer(calls), epilogue="softsign")
    (plain,) = sweep.run([(256, 192, 128)], per_family=1, timer=_timer([]))
    (gelu,) = sweep.run([(256, 192, 128)], per_family=1, timer=_timer([]), epilogue="gelu")
    assert res.epilogue == "softsign" and res.split_us == 4.0 + 5.0 and gelu.split_us == 9.0
    # ORT's MatMul, ORT's region, our epilogue kernel, then one fused GEMM per family
    assert calls[:2] == [("MatMul",), ("MatMul", "Add", "Abs", "Add", "Div")] and len(calls) == 6
    assert all(s.est_us > p.est_us for s, p in zip(res.rows, plain.rows))
    # B multicast and ping-pong are timed with the bias alone
    assert [g.est_us for g in gelu.rows] == [p.est_us for p in plain.rows
                                            if p.family in sweep.FAMILIES]
    assert {r.family for r in (*res.rows, *gelu.rows)} <= set(sweep.FAMILIES)
    text = sweep.render_md([res, gelu])
    assert "fp16 + bias + softsign" in text and "fp16 + bias + GELU" in text
    assert "cuBLAS + our epilogue kernel 9.0 us" in text
    assert "best fused tile vs cuBLAS + our epilogue kernel (us): 256x192x128 5.0 fused vs 9.0" in text


def test_the_gated_epilogue_sweeps_a_gated_mlps_gemm():
    # --epilogue gated: the interleaved weight's GEMM with SiLU(gate) * up, half as many outputs; cuBLAS + our
    # gated element-wise kernel beside it, and each family's kernel a valid model of it
    calls: list = []
    (res,) = sweep.run([(256, 192, 128)], per_family=1, timer=_timer(calls), epilogue="gated")
    assert calls[0] == ("MatMul",) and calls[1] == ("MatMul", "Slice", "Slice", "Sigmoid", "Mul", "Mul")
    assert res.split_us == 9.0 and len(res.rows) == len(sweep.FAMILIES)
    assert "gated SiLU(gate) * up" in sweep.render_md([res])


def test_a_row_wise_epilogue_sweeps_both_row_kinds_and_its_ablation_drops_the_row_pass(tmp_path):
    # --epilogue layernorm (BERT's post-attention block): row-wise tiles of mma.sync and wgmma (no TMA tiles
    # split a row), each family with a tile splitting the 768-column row across a cluster and mma.sync with
    # one spanning it too; cuBLAS + our row kernel beside them. Ablated, a split-row kernel keeps its MMAs and
    # loses its cluster barriers, gathers and stores.
    from ortfuse.customops import tiles as tl
    calls: list = []
    (res,) = sweep.run([(256, 768, 128)], per_family=1, timer=_timer(calls), epilogue="layernorm")
    assert calls[:2] == [("MatMul",), ("MatMul", "Add", "Add", "LayerNormalization")] and res.split_us == 4.0 + 5.0
    assert {r.family for r in res.rows} == set(sweep.ROW_FAMILIES)
    kinds = {(r.family, tl.row_split(768, tl.GemmTile.of_candidate(r.tile)) > 1) for r in res.rows}
    assert {("mma.sync", True), ("mma.sync", False), ("wgmma", True)} <= kinds
    assert "fp16 + bias + residual + LayerNorm" in sweep.render_md([res])
    case = sweep.GemmCase.of((256, 768, 128), "layernorm")
    cand = next(c for f, c, _ in sweep.candidates(256, 768, 128, 1, row=True)
                if f == "wgmma" and tl.row_split(768, tl.GemmTile.of_candidate(c)) > 1)
    full, cut = case.build(cand, tmp_path), case.build(cand, tmp_path, ablate=True)
    ptx_full, ptx_cut = full.compiled.ptx.decode(), cut.compiled.ptx.decode()
    assert "barrier.cluster" in ptx_full and "mapa" in ptx_full and "wgmma.mma_async" in ptx_cut
    assert "barrier.cluster" not in ptx_cut and "mapa" not in ptx_cut


def test_the_summary_sets_each_unranked_tma_mainloop_against_the_ranked_one():
    def row(family, us, kind):
        return sweep.SweepRow((4096, 768, 768), family, (128, 192, 64, 16, 192, 5, 1, kind), us, 7.5, 168, 0)
    rows = (row("wgmma+TMA", 18.0, 2), row("wgmma+TMA", 20.0, 2), row(sweep.MULTICAST, 15.3, 3),
            row(sweep.PINGPONG, 19.8, 4))
    lines = sweep.summary([sweep.ShapeResult((4096, 768, 768), 12.9, 26.2, rows)])
    assert "wgmma+TMA multicast best / wgmma+TMA best: 4096x768x768 0.85" in lines
    assert "wgmma+TMA pingpong best / wgmma+TMA best: 4096x768x768 1.10" in lines
    assert not any(line.startswith(sweep.PINGPONG_MULTICAST + " best /") for line in lines)  # not timed


def test_direct_stores_time_the_fragment_stores_beside_the_staged_ones(tmp_path):
    # N = 203 fp16: misaligned rows, so the kernel stages its stores; the diagnostic variant compiles the
    # fragment stores instead (OFZ_DIRECT_STORES), which leaves the staging's warp barriers and its 8-byte
    # shared stores out of the PTX
    case = sweep.GemmCase.of((256, 203, 128))
    cand = [c for f, c, _ in sweep.candidates(256, 203, 128, 1) if f == "wgmma+TMA"][0]
    full, direct = case.build(cand, tmp_path), case.build(cand, tmp_path, variant="direct stores")
    assert "kStageOut" in full.source and sweep.DIRECT in direct.source and sweep.DIRECT not in full.source
    ptx_full, ptx_direct = full.compiled.ptx.decode(), direct.compiled.ptx.decode()
    assert ptx_full.count("bar.warp.sync") > ptx_direct.count("bar.warp.sync")
    assert "st.shared.v2.f32" in ptx_full and "st.shared.v2.f32" not in ptx_direct
    calls: list = []
    (res,) = sweep.run([(256, 203, 128)], per_family=1, timer=_timer(calls), direct_stores=True)
    rows = [r for r in res.rows if r.variant == "direct stores"]
    assert {r.family for r in rows} == set(sweep.NAMES)
    (aligned,) = sweep.run([(256, 208, 128)], per_family=1, timer=_timer(calls), direct_stores=True)
    assert not [r for r in aligned.rows if r.variant]  # nothing staged there: no diagnostic to time
    assert "best tile, direct stores:" in sweep.render_md([res])


def test_a_misaligned_shape_beside_its_padded_twin_gives_the_store_factor():
    # stand-in times: the misaligned shape's best tile 10 us slower than its twin's, its fragment stores 40;
    # the factor is 1 + the difference over the misaligned output's DRAM time at the H100's bandwidth
    rows = lambda shape, us, direct=None: sweep.ShapeResult(  # noqa: E731
        shape, 100.0, 200.0, tuple([sweep.SweepRow(shape, "wgmma+TMA", (128, 256, 64, 16, 256, 4, 1, 2), us, 1.0, 168, 0)] +
                                   ([sweep.SweepRow(shape, "wgmma+TMA", (128, 256, 64, 16, 256, 4, 1, 2), direct, 1.0,
                                                    168, 0, "", "direct stores")] if direct else [])))
    results = [rows((4096, 50257, 768), 560.0, 1600.0), rows((4096, 50264, 768), 550.0)]
    (line,) = sweep.misaligned_lines(results, dram_gbps=3350.0)
    dram_us = 4096 * 50257 * 2 / 3350e3
    assert line.startswith("wgmma+TMA, 4096x50257x768 misaligned: 560.0 vs 550.0 us aligned")
    assert f"store factor {1 + 10 / dram_us:.2f}" in line and f"factor {1 + 1050 / dram_us:.2f}" in line
    assert sweep.misaligned_lines(results[:1]) == []  # no twin, no line

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
    assert sorted(set(fams)) == sorted(sweep.FAMILIES) and len(fams) == 6
    assert all(r.us == 5.0 and r.est_us > 0 and r.regs > 0 and r.spill_bytes == 0 for r in res.rows)
    assert [r.tile[7] if len(r.tile) > 7 else 0 for r in res.rows] == [0, 0, 1, 1, 2, 2]
    assert calls[:2] == [("MatMul",), ("MatMul", "Add")] and len(calls) == 8
    text = sweep.render_md([res])
    assert "wgmma+TMA" in text and "cuBLAS (ORT MatMul) 4.0 us" in text
    assert "wgmma+TMA: best tile / cuBLAS median 1.25" in text


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

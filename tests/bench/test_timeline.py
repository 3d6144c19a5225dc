"""bench/timeline.py on the CPU: the analysis of a profiled inference (spans, gaps, overlap, groups, fused
nodes) on synthetic kernels and a synthetic Chrome trace. The profiling itself needs a GPU and CUPTI."""
from __future__ import annotations

import pytest

from ortfuse.bench import timeline as tl
from ortfuse.bench.timeline import Kernel


def _run(offset: float = 0.0) -> list[Kernel]:
    # ortfuse A 0-10, a cuBLAS GEMM 12-20, ortfuse B 18-25 overlapping it (a programmatic dependent launch),
    # an ORT kernel 30-31
    return [Kernel("ofz_a", 0 + offset, 10), Kernel("sm90_xmma_gemm_f16f16", 12 + offset, 8),
            Kernel("ofz_b_pdl", 18 + offset, 7), Kernel("void onnxruntime::cuda::_Slice", 30 + offset, 1)]


def test_figures_split_a_run_into_busy_time_gaps_and_overlap():
    f = tl.figures(_run())
    assert (f.kernels, f.span_us, f.busy_us) == (4, 31, 24)  # busy: 0-10, 12-25, 30-31
    assert (f.gap_us, f.overlap_us) == (7, 2)  # gaps 10-12 and 25-30; B overlaps the GEMM by 2
    assert f.by_group == {"ortfuse": (2, 17), "library": (1, 8), "ORT": (1, 1)}
    assert tl.figures([]).kernels == 0


def test_medians_over_runs():
    slow = [Kernel(k.name, k.start_us, k.dur_us * 2) for k in _run()]
    med = tl.median_figures([_run(), _run(100.0), slow])
    assert med.span_us == 31 and med.by_group["ortfuse"] == (2, 17)


def test_per_node_sums_device_time_and_the_gap_before_by_fused_node():
    runs = [_run(), _run(50.0)]
    nodes = tl.per_node(runs, {"ofz_a": "ortfuse_region_1", "ofz_b_pdl": "ortfuse_region_2"})
    assert [(t.node, t.launches, t.device_us, t.gap_us) for t in nodes] == [
        ("ortfuse_region_1", 1, 10, 0), ("ortfuse_region_2", 1, 7, 0)]
    # a gap before a kernel counts from the latest end so far
    nodes = tl.per_node([[Kernel("ofz_a", 0, 5), Kernel("ofz_a", 9, 5)]], {})
    assert [(t.node, t.launches, t.device_us, t.gap_us) for t in nodes] == [("ofz_a", 2, 10, 4)]


def test_kernels_come_from_the_trace_kernel_events_only():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "ofz_b", "ts": 20.5, "dur": 3.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0, "dur": 4.0},
        {"ph": "X", "cat": "kernel", "name": "ofz_a", "ts": 10.0, "dur": 2.5},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0.0}]}
    assert tl.kernels_of_trace(trace) == [Kernel("ofz_a", 10.0, 2.5), Kernel("ofz_b", 20.5, 3.0)]


def test_render_lists_variants_and_the_slowest_nodes():
    runs = [_run()]
    text = tl.render("gpt2-fp16.onnx", 1, {"ortfuse": tl.median_figures(runs)},
                     tl.per_node(runs, {"ofz_a": "ortfuse_region_1"}), 1)
    assert "| ortfuse | 4 | 31.0 | 24.0 | 7.0 | 2.0 | 2 / 17.0 | 1 / 8.0 | 1 / 1.0 |" in text
    assert text.index("ortfuse_region_1") < text.index("ofz_b_pdl")


def test_without_a_cuda_ep_it_says_so(monkeypatch, capsys):
    from ortfuse import runtime
    monkeypatch.setattr(runtime, "_cuda_usable", lambda providers, options: False)
    with pytest.raises(SystemExit) as err:
        tl.main(["m.onnx"])
    assert err.value.code == 2 and "needs a working CUDA execution provider" in capsys.readouterr().err


def test_a_graph_variant_ort_refuses_is_listed_not_fatal(monkeypatch, tmp_path):
    # stock ORT cannot capture a quantized model's graph (its int32 DequantizeLinear runs on the CPU EP): the
    # session fails to create, and the timeline goes on with the other variants
    import json

    from ortfuse import runtime

    def runner(v, *a):
        if v == "ort+cudagraph":
            raise RuntimeError("FAIL : This session cannot use the graph capture feature as requested")
        return lambda: None
    monkeypatch.setattr(runtime, "_cuda_usable", lambda providers, options: True)
    monkeypatch.setattr(tl, "_runner", runner)
    monkeypatch.setattr(tl, "profile_runs", lambda run, runs: [_run()])
    assert tl.main(["m.onnx", "--variants", "ort,ort+cudagraph", "--md", str(tmp_path / "t.md"),
                    "--json", str(tmp_path / "t.json")]) == 0
    text = (tmp_path / "t.md").read_text()
    assert "| ort | 4 |" in text and "| ort+cudagraph | not run: FAIL : This session cannot use the graph" in text
    assert list(json.loads((tmp_path / "t.json").read_text())["skipped"]) == ["ort+cudagraph"]


def test_a_failing_plain_variant_still_fails(monkeypatch):
    from ortfuse import runtime

    def runner(v, *a):
        raise RuntimeError("no such model")
    monkeypatch.setattr(runtime, "_cuda_usable", lambda providers, options: True)
    monkeypatch.setattr(tl, "_runner", runner)
    with pytest.raises(RuntimeError, match="no such model"):
        tl.main(["m.onnx", "--variants", "ort"])


@pytest.mark.gpu
def test_a_tiny_model_profiled_on_the_gpu(tmp_path, monkeypatch):
    # CUPTI sees ortfuse's kernels (launched through the driver API, programmatic dependent launches here)
    # as well as ORT's, also inside CUDA graphs
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    from ortfuse.api import optimize
    from ortfuse.bench import zoo
    from ortfuse.config import Options
    from ortfuse.rewriter.replace import save_model
    monkeypatch.setenv("ORTFUSE_CACHE_DIR", str(tmp_path))
    src = zoo.build("gpt2", dtype="fp16", tiny=True)
    out = tmp_path / "gpt2.ortfuse.onnx"
    save_model(optimize(src, None, "sm_90", options=Options(archs=(90,), pdl=True)), out)
    save_model(optimize(src, None, "sm_90", options=Options(archs=(90,), pdl=False)), tmp_path / "plain.onnx")
    assert tl.main([str(src), "--optimized", str(out), "--beside", str(tmp_path / "plain.onnx"), "--runs", "2",
                    "--json", str(tmp_path / "t.json")]) == 0
    rep = json.loads((tmp_path / "t.json").read_text())
    for v in ("ortfuse", "ortfuse+cudagraph", "ortfuse-beside", "ortfuse-beside+cudagraph"):
        assert rep["figures"][v]["by_group"]["ortfuse"][0] > 3, rep["figures"][v]
    assert "ortfuse" not in rep["figures"]["ort"]["by_group"]
    assert rep["nodes"] and all(n["node"].startswith("ortfuse_region_") for n in rep["nodes"])

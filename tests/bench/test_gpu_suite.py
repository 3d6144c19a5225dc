"""The GPU suite's report plumbing, fed with a CPU benchmark (the suite itself needs CUDA)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import onnx

from ortfuse.bench import gpu_suite, harness, zoo


def test_report_results_and_merge(tmp_path):
  path = zoo.build("bert", tiny=True)
  res = harness.run_bench(path, optimized_path=path, batches=(1,), provider="cpu", runs=5, warmup=1,
                          out_dir=tmp_path / "w", chart=False)
  entry = {"model": "bert", "dtype": "fp32", "tiny": True, "optimize": {"seconds": 1.5, "input_shapes": {"x": ["n", 3, 64, 64]}},
           "parity": {"ok": True}, "bench": json.loads(json.dumps(asdict(res)))}
  part = tmp_path / "a"
  part.mkdir()
  (part / "report.json").write_text(json.dumps({"started": "now", "env": {}, "entries": [entry],
                                                "pytest": {"rc": 1, "summary": "1 failed", "seconds": 1}}))
  later = tmp_path / "b"
  later.mkdir()
  vit = {**entry, "model": "vit"}
  (later / "report.json").write_text(json.dumps({"started": "later", "env": {}, "entries": [{**entry, "parity": {"ok": False}}, vit],
                                                 "pytest": {"rc": 0, "summary": "9 passed", "seconds": 1}}))
  merged = gpu_suite.merge(tmp_path / "out", [part / "report.json", later / "report.json"])
  # the later call's bert fp32 replaces the earlier one; its pytest run is the one reported
  assert [(e["model"], e["parity"]["ok"], e["measured"]) for e in merged["entries"]] == [
      ("bert", False, "later"), ("vit", True, "later")]
  assert merged["pytest"]["rc"] == 0 and merged["merged_from"] == ["now", "later"]
  assert "Measured now, later on" in (tmp_path / "out" / "report.md").read_text()
  merged = gpu_suite.merge(tmp_path / "out", [later / "report.json", part / "report.json"])
  results = (tmp_path / "out" / "results.md").read_text()
  assert "| bert | fp32 | 1 |" in results and "(1.00x)" not in results.split("| bert")[1].split("|")[4]
  assert "image sizes fixed" in results and "bert fp32: x:nx3x64x64" in results
  assert "ok" in results and "python -m ortfuse.bench.gpu_suite" in results
  assert (tmp_path / "out" / "chart.png").stat().st_size > 0


def test_per_kernel_section(tmp_path):
  from ortfuse.bench import kernels
  rows = [kernels.KernelRow((0, 4), "gemm", "MatMul 4096x768x768 fp16 + Add", "batch=32", 12.0,
                            "cuBLAS (ORT MatMul alone)", 10.0, 20.0, 2 * 4096 * 768 * 768),
          kernels.KernelRow((1,), "attention", "attention 32x12 heads", "batch=32", 30.0,
                            "ORT MultiHeadAttention (mask as attention_bias)", 40.0, 90.0, 1e9,
                            {"MHA, no mask": 25.0})]
  text = kernels.render(rows)
  assert "0 of 1 (kernel, binding) rows; median ours/library 1.20" in text
  assert "with the same mask: 1 of 1" in text and "fastest MHA variant (any mask form, or none) 0 of 1" in text
  entry = {"model": "bert", "dtype": "fp16", "kernels": {"rows": kernels.as_json(rows), "table": text,
                                                          "summary": kernels.summary(rows)}}
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "report.json").write_text(json.dumps({"started": "now", "env": {}, "entries": [entry]}))
  gpu_suite.merge(tmp_path / "out", [tmp_path / "a" / "report.json"])
  report, results = ((tmp_path / "out" / f).read_text() for f in ("report.md", "results.md"))
  assert "## Per kernel" in results and "**bert fp16**: GEMM/Conv + epilogue within 15%" in results
  assert "| 0, 4 | MatMul 4096x768x768" in report and "| 0, 4 |" not in results


def test_cost_model_check_against_the_profile():
  # measured / estimated per kind and binding, identical layers once (the second gemm row repeats the first)
  row = {"kind": "gemm", "bindings": ["batch=1", "batch=32"], "ort_us": [10.0, 80.0], "ours_us": [12.0, 90.0],
         "model_ort_us": [5.0, 40.0], "model_ours_us": [4.0, 30.0]}
  other = {**row, "ort_us": [20.0, 40.0], "ours_us": [6.0, 60.0]}
  attn = {**row, "kind": "attention", "ours_us": [8.0, 45.0]}
  lines = gpu_suite.model_check_lines([row, dict(row), other, attn])
  assert lines == ["attention (1 distinct): batch=1: ours 2.00, ORT 2.00; batch=32: ours 1.50, ORT 2.00",
                   "gemm (2 distinct): batch=1: ours 2.25, ORT 3.00; batch=32: ours 2.50, ORT 1.50"]
  report = {"started": "now", "env": {}, "entries": [
      {"model": "bert", "dtype": "fp16", "optimize": {"model_check": [row, attn]}, "bench": {}}]}
  text = gpu_suite.render(report)
  assert "## Cost model against --profile" in text and "**bert fp16**: attention (1 distinct)" in text
  assert "Cost model against" not in gpu_suite.render(report, results=True)


def test_rows_say_what_the_optimize_used_beyond_the_defaults(monkeypatch):
  # so a run with folds off (or wgmma off) merges next to the default one instead of replacing it
  monkeypatch.delenv("ORTFUSE_WGMMA", raising=False)
  monkeypatch.delenv("ORTFUSE_LN_FOLD", raising=False)
  assert gpu_suite.variant_label() == ""
  monkeypatch.setenv("ORTFUSE_LN_FOLD", "off")
  assert gpu_suite.variant_label() == " ln-fold=off"
  monkeypatch.setenv("ORTFUSE_WGMMA", "1")  # the sm_90 default, said explicitly
  assert gpu_suite.variant_label() == " ln-fold=off"
  monkeypatch.setenv("ORTFUSE_WGMMA", "0")
  assert gpu_suite.variant_label() == " no-wgmma ln-fold=off"
  assert gpu_suite.variant_label(profile=False) == " no-wgmma ln-fold=off no-profile"


def test_sweep_summary_in_the_report_and_merge(tmp_path):
  # the sweep's summary lines reach report.md (not results.md); merge keeps the last call's sweep
  sweep = {"shapes": [], "seconds": 1.0, "summary": ["wgmma+TMA: best tile / cuBLAS median 1.10 (range 1.00-1.20)"]}
  part = tmp_path / "a"
  part.mkdir()
  (part / "report.json").write_text(json.dumps({"started": "now", "env": {}, "entries": [], "sweep": sweep}))
  merged = gpu_suite.merge(tmp_path / "out", [part / "report.json"])
  assert merged["sweep"] == sweep
  assert "GEMM tile sweep (bench/sweep.py, sweep.md): wgmma+TMA: best tile" in (tmp_path / "out" / "report.md").read_text()
  assert "GEMM tile sweep" not in (tmp_path / "out" / "results.md").read_text()


def test_a_second_build_beside_the_first_gets_a_line_of_its_own():
  rows = [{"variant": v, "batch": b, "median_ms": ms} for v, b, ms in (
      ("ortfuse", 1, 0.6), ("ortfuse-beside", 1, 0.5), ("ortfuse+cudagraph", 1, 0.5),
      ("ortfuse-beside+cudagraph", 1, 0.4), ("ortfuse", 32, 3.0), ("ortfuse-beside", 32, None))]
  report = {"entries": [{"model": "gpt2 no-profile", "dtype": "fp16", "beside": {"label": "pdl", "path": "x"},
                         "bench": {"batches": [1, 32], "rows": rows}},
                        {"model": "bert", "dtype": "fp16", "bench": {"batches": [1], "rows": rows[:2]}}]}
  (line,) = [ln for ln in gpu_suite.beside_lines(report) if ln]
  assert line == ("gpt2 no-profile fp16, built with pdl beside the row's build (same run): batch 1: 0.500 against "
                  "0.600 ms (1.20x); batch 1 graph: 0.400 against 0.500 ms (1.25x).")
  assert "built with pdl" in gpu_suite.render(report)


def test_the_report_says_where_each_rows_time_went():
  entry = {"model": "gpt2", "dtype": "fp16", "build_s": 23.0, "optimize": {"seconds": 20.8}, "parity_s": 9.1,
           "bench_s": 40.2, "bench": {"batches": [], "rows": []}}
  text = gpu_suite.render({"entries": [entry]})
  assert "- seconds: build 23.0, optimize 20.8, parity 9.1, bench 40.2" in text
  assert "seconds:" not in gpu_suite.render({"entries": [entry]}, results=True)


def test_a_failing_parity_shows_its_lines_and_the_trace(monkeypatch):
  # a row failing parity on the GPU: the report says why, and where the values first part, while the machine
  # that could say it is still there (session 51's quantized BERT failed on the GPU alone)
  import ortfuse.check as check
  import ortfuse.divergence as divergence

  class Rep:
    ok = False

    def lines(self):
      return ["whole model:", "  FAIL y (from one quantized tensor to the next, ...)"]

  class Tr:
    def lines(self, limit):
      return ["3 shared tensors compared, 1 differ", "ORIGIN q (from ortfuse_region_2): 1 of 8 elements differ"]
  monkeypatch.setattr(check, "check_models", lambda *a, **k: Rep())
  monkeypatch.setattr(divergence, "trace_models", lambda *a, **k: Tr())
  monkeypatch.setattr(gpu_suite.harness, "make_feeds", lambda *a, **k: {})
  monkeypatch.setattr(gpu_suite.zoo, "read_sidecar", lambda *a: {})
  monkeypatch.setattr("onnx.load", lambda *a, **k: None)
  par = gpu_suite._parity(Path("m.onnx"), Path("o.onnx"))
  assert par["ok"] is False and par["trace"][1].startswith("ORIGIN q"), par
  text = gpu_suite.render({"entries": [{"model": "bert", "dtype": "qdq", "parity": par}]})
  assert "- parity: FAIL y (from one quantized tensor" in text and "- trace: ORIGIN q (from ortfuse_region_2)" in text


def test_a_beside_build_is_named_by_its_options(tmp_path, monkeypatch):
  # the second build's Options overrides name it in the report and reach its compile
  from helpers import model, node, vi
  assert gpu_suite.beside_label({"pdl": True}) == "pdl" and gpu_suite.beside_label({"pdl": False}) == "no pdl"
  assert gpu_suite.beside_label({"k_rope": "once"}) == "--k-rope once"
  assert gpu_suite.beside_label({"key_frontier": False}) == "no key frontier"
  assert gpu_suite.beside_label({"ort_attention": "off"}) == "--ort-attention off"
  seen = {}

  def fake_compile(src, shapes, arch, options):
    seen["k_rope"] = options.k_rope
    raise RuntimeError("stopped after the options")
  monkeypatch.setattr("ortfuse.api.compile_model", fake_compile)
  src = tmp_path / "m.onnx"
  onnx.save(model([node("Relu", ["x"], ["y"])], [vi("x", 1, [2])], [vi("y", 1, None)]), str(src))
  got = gpu_suite._optimize(src, tmp_path, False, k_rope="once")
  assert seen == {"k_rope": "once"} and "stopped after the options" in got["note"], got

"""The GPU suite's report plumbing, fed with a CPU benchmark (the suite itself needs CUDA)."""
from __future__ import annotations

import json
from dataclasses import asdict

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

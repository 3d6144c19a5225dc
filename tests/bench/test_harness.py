from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortfuse.bench import harness, zoo


def test_feeds_are_valid_and_never_zero():
  path = zoo.build("bert", tiny=True)
  feeds = harness.make_feeds(onnx.load(str(path)), batch=4, meta=zoo.read_sidecar(path))
  ids, mask = feeds["input_ids"], feeds["attention_mask"]
  assert ids.shape == (4, 16) and ids.dtype == np.int64
  assert ids.min() >= 0 and ids.max() < 1000 and ids.any()
  assert mask[0].all() and set(np.unique(mask)) <= {0, 1} and mask.sum(axis=1).min() >= 12


def test_feeds_without_sidecar_use_the_embedding_table():
  path = zoo.build("bert", tiny=True)
  feeds = harness.make_feeds(onnx.load(str(path)), batch=2, dims={"sequence": 8})
  assert feeds["input_ids"].shape == (2, 8) and feeds["input_ids"].max() < 1000


def test_cpu_bench_writes_table_json_and_chart(tmp_path):
  path = zoo.build("bert", tiny=True)
  res = harness.run_bench(path, optimized_path=path, batches=(1, 4), provider="cpu", runs=15, warmup=2,
                          out_dir=tmp_path)
  rows = [r for r in res.rows if r.median_ms is not None]
  assert {(r.variant, r.batch) for r in rows} == {("ort", 1), ("ort", 4), ("ortfuse", 1), ("ortfuse", 4)}
  for r in rows:
    assert 0 < r.median_ms <= r.p90_ms and r.runs >= 5 and r.throughput > 0
    assert r.vs_ort > 0 and r.ideal_fraction > 0
  assert res.row("ort", 1).vs_ort == 1.0
  assert res.row("ortfuse", 4).max_abs_diff == 0.0           # same model: identical outputs
  assert res.work[4]["flops"] > res.work[1]["flops"] > 0
  for kind in ("markdown", "json", "chart"):
    assert (tmp_path / res.files[kind].split("/")[-1]).stat().st_size > 0
  data = json.loads((tmp_path / res.files["json"].split("/")[-1]).read_text())
  assert data["provider"] == "cpu" and len(data["rows"]) == 4
  assert "| 4 | ortfuse |" in res.to_markdown()


def test_a_second_ortfuse_model_is_timed_beside_the_first(tmp_path):
  # --beside: another build of the same model in the same run (on the CPU the model itself, so the outputs agree
  # exactly); its rows compare with the ortfuse rows side by side
  path = zoo.build("bert", tiny=True)
  res = harness.run_bench(path, optimized_path=path, batches=(2,), provider="cpu", runs=5, warmup=1,
                          out_dir=tmp_path, beside_path=path)
  assert {r.variant for r in res.rows if r.median_ms} == {"ort", "ortfuse", "ortfuse-beside"}
  assert res.row("ortfuse-beside", 2).max_abs_diff == 0.0 and res.row("ortfuse-beside", 2).vs_ort > 0
  assert "| 2 | ortfuse-beside |" in res.to_markdown() and Path(res.files["chart"]).stat().st_size > 0


def test_pinned_dims_diagnostic_runs_the_same_model(tmp_path):
  path = zoo.build("bert", tiny=True)
  res = harness.run_bench(path, optimized_path=path, batches=(2,), provider="cpu", runs=5, warmup=1,
                          out_dir=tmp_path, variants=["ort+static"], chart=False)
  row = res.row("ort+static", 2)
  assert row.median_ms and row.max_abs_diff is not None and row.max_abs_diff < 1e-4
  assert "| 2 | ort+static |" in res.to_markdown()


def test_missing_optimizer_or_variant_is_a_note_not_a_crash(tmp_path):
  path = zoo.build("bert", tiny=True)
  res = harness.run_bench(path, batches=(1,), provider="cpu", runs=5, warmup=1, out_dir=tmp_path,
                          variants=["ort", "ort+cudagraph", "ortfuse", "ortfuse+cudagraph"], chart=False)
  assert res.row("ort", 1).median_ms > 0
  assert res.row("ort+cudagraph", 1).note == "CUDA only" and res.row("ortfuse+cudagraph", 1).note == "CUDA only"
  try:
    import ortfuse
    has_optimize = hasattr(ortfuse, "optimize")
  except ImportError:
    has_optimize = False
  if not has_optimize:
    assert res.row("ortfuse", 1).median_ms is None and any("ortfuse.optimize" in n for n in res.notes)


def test_ort_transformers_baseline_on_cpu(tmp_path):
  path = zoo.build("bert", tiny=True)
  res = harness.run_bench(path, optimized_path=path, batches=(2,), provider="cpu", runs=5, warmup=1,
                          out_dir=tmp_path, variants=["ort", "ort-transformers"], chart=False)
  row = res.row("ort-transformers", 2)
  assert row.median_ms > 0 and row.max_abs_diff < 1e-4
  assert any("Attention" in n for n in res.notes)


def test_ortfuse_on_the_ort_transformers_model_on_cpu(tmp_path):
  path = zoo.build("bert", tiny=True)
  res = harness.run_bench(path, optimized_path=path, batches=(1, 2), provider="cpu", runs=3, warmup=1,
                          out_dir=tmp_path, variants=["ort", "ort-transformers+ortfuse"], chart=False)
  for batch in (1, 2):
    row = res.row("ort-transformers+ortfuse", batch)
    assert row.median_ms > 0 and row.max_abs_diff < 1e-4, row
  assert sum("ort-transformers+ortfuse optimized" in n for n in res.notes) == 1  # one build for both batches
  fused = onnx.load(str(tmp_path / f"{Path(path).stem}.ort-transformers.ortfuse.onnx"), load_external_data=False)
  assert {"BiasGelu", "SkipLayerNormalization"}.isdisjoint(n.op_type for n in fused.graph.node)  # all fused
  assert any(n.domain == "ortfuse" for n in fused.graph.node)


def test_cli_arguments_wire_to_main(tmp_path, capsys):
  path = zoo.build("bert", tiny=True)
  parser = argparse.ArgumentParser()
  harness.add_arguments(parser)
  args = parser.parse_args([str(path), "--optimized", str(path), "--batch", "1", "--provider", "cpu",
                            "--out", str(tmp_path), "--runs", "5", "--warmup", "1", "--dim", "sequence=8"])
  assert harness.main(args) == 0
  assert "| 1 | ortfuse |" in capsys.readouterr().out


def test_optimize_end_to_end_on_cpu(tmp_path):
  ortfuse = pytest.importorskip("ortfuse")
  if not hasattr(ortfuse, "optimize"):
    pytest.skip("ortfuse.optimize not implemented yet")
  path = zoo.build("bert", tiny=True)
  ortfuse.optimize(str(path), input_shapes=None, arch="sm_90")    # fails here with ortfuse's own traceback
  res = harness.run_bench(path, batches=(1,), provider="cpu", runs=5, warmup=1, out_dir=tmp_path, chart=False)
  assert res.optimize_s is not None and res.optimize_s > 0, res.notes
  row = res.row("ortfuse", 1)
  assert row.median_ms > 0 and row.max_abs_diff < 1e-4


def test_a_runner_that_counts_its_own_peak_memory_reports_it(tmp_path, monkeypatch):
  # torch.compile rows: torch's allocator peak, not the device-wide delta (which earlier rows' ORT arenas and
  # torch's cached blocks make meaningless); here a stand-in runner on the CPU path of the same code
  path = zoo.build("bert", tiny=True)
  ctx = harness._Ctx(str(path), onnx.load(str(path)), zoo.read_sidecar(path), "cpu", tmp_path, None, [])
  out = [np.zeros(2, np.float32)]
  monkeypatch.setattr(harness, "_torch_runner",
                      lambda c, f: harness._Runner(lambda: None, lambda: out, None, lambda: 3.0 * 2 ** 20))
  row, got = harness._measure(ctx, "torch.compile", 1, [{}], None, {"warmup": 1, "runs": 5, "max_seconds": 1.0})
  assert row.note == "" and row.peak_mem_mb == 3.0 and row.median_ms is not None


def test_a_quantized_zoo_model_end_to_end_on_cpu(tmp_path):
  """The zoo's qdq dtype (quantize_static of the fp32 model): optimized (its DequantizeLinear nodes fuse), timed
  against stock ORT on the CPU fallback; the float baselines say why they do not apply."""
  from ortfuse.api import compile_model
  from ortfuse.rewriter.replace import save_model
  path = zoo.build("bert", "qdq", tiny=True)
  res = compile_model(str(path), None, "sm_90")
  fused = [res.graph.nodes[i].op_type for r in res.plan.regions for i in r.nodes]
  assert "DequantizeLinear" in fused
  out = tmp_path / "bert-qdq.ortfuse.onnx"
  save_model(res.model, out)
  bench = harness.run_bench(path, optimized_path=out, batches=(2,), provider="cpu", runs=3, warmup=1,
                            out_dir=tmp_path, variants=["ort", "ort-transformers", "ortfuse"], chart=False)
  assert bench.row("ortfuse", 2).median_ms > 0 and bench.row("ortfuse", 2).max_abs_diff == 0.0
  assert "optimizes float models" in bench.row("ort-transformers", 2).note


def test_the_arena_knob_reads_same_pow2_or_nothing(monkeypatch):
  from ortfuse.bench import harness
  monkeypatch.delenv(harness.ARENA_ENV, raising=False)
  assert harness._arena_options() == {}
  monkeypatch.setenv(harness.ARENA_ENV, "same")
  assert harness._arena_options() == {"arena_extend_strategy": "kSameAsRequested"}
  monkeypatch.setenv(harness.ARENA_ENV, "twice")
  with pytest.raises(ValueError, match="expected 'same' or 'pow2'"):
    harness._arena_options()

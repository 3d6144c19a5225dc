"""GPU suite: everything that needs the lent H100/H200, in as few device calls as possible.

    python -m ortfuse.bench.gpu_suite OUTDIR [--models bert vit ...] [--dtypes fp32 fp16] [--batches 1,32]
    python -m ortfuse.bench.gpu_suite OUTDIR --merge A/report.json B/report.json   # join chunks, no GPU

Steps, each recorded and never fatal to the next: `pytest -m gpu`; the fused-node overhead (bench/overhead.py);
build the zoo on the machine (it has
torch and transformers; nothing large is carried); per model and dtype: `ortfuse.optimize`, whole-model
parity through `ortfuse.check.check_models(..., provider="cuda")`, and `harness.run_bench` in a fresh
subprocess (so one model's imports, torch's above all, cannot perturb the next one's ORT timings).
OUTDIR receives few files (the device tool returns at most 8): report.md, report.json, results.md,
pytest-gpu.log, pytest-gpu.xml, chart.png. Per-model outputs stay in --work.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from . import harness, zoo

REGENERATE = ("python -m ortfuse.bench.gpu_suite OUTDIR  (on the GPU machine; bench/README.md gives the "
              "device call), then copy OUTDIR/results.md to docs/results.md")


def _pytest(out: Path) -> dict[str, Any]:
  start = time.perf_counter()
  cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short",
         f"--junitxml={out / 'pytest-gpu.xml'}", "tests"]
  try:  # a hung kernel fails its test instead of the whole call (pytest-timeout is on the GPU image)
    import pytest_timeout  # noqa: F401
    cmd[5:5] = ["--timeout", "180"]
  except ImportError:
    pass
  proc = subprocess.run(cmd, capture_output=True, text=True)
  (out / "pytest-gpu.log").write_text(proc.stdout + proc.stderr)
  tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
  return {"rc": proc.returncode, "summary": tail, "seconds": round(time.perf_counter() - start, 1)}


def _overhead(work: Path) -> dict[str, Any]:
  """Issue 3's acceptance figure: per-call cost of a fused node over a native ORT op (bench/overhead.py),
  in a subprocess so it runs on a fresh CUDA context."""
  out = {}
  for dtype in ("fp32", "fp16"):
    js = work / f"overhead-{dtype}.json"
    cmd = [sys.executable, "-m", "ortfuse.bench.overhead", "--dtype", dtype, "--json", str(js)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out[dtype] = json.loads(js.read_text()) if proc.returncode == 0 and js.exists() else {
        "error": (proc.stdout + proc.stderr)[-2000:]}
  return out


def _parity(src: Path, opt: Path) -> dict[str, Any]:
  try:
    from ortfuse.check import check_models
  except ImportError as err:
    return {"ok": None, "note": f"ortfuse.check unavailable: {err}"}
  try:
    import onnx
    meta = zoo.read_sidecar(src)
    shapes = {k: v.shape for k, v in harness.make_feeds(onnx.load(str(src)), batch=2, meta=meta).items()}
    report = check_models(str(src), str(opt), provider="cuda", input_shapes=shapes)
    out: dict[str, Any] = {"ok": bool(report.ok), "lines": report.lines()}
    if not report.ok:  # where the two models' values first part (`check --trace`), while the machine is here
      out["trace"] = _trace(src, opt, shapes)
    return out
  except Exception as err:  # noqa: BLE001 - recorded in the report
    return {"ok": False, "note": f"{type(err).__name__}: {err}"}


def _trace(src: Path, opt: Path, shapes: dict[str, Any], limit: int = 30) -> list[str]:
  """The first lines of `ortfuse check --trace` on the GPU (its origins first), or why it could not run."""
  try:
    from ortfuse.divergence import trace_models
    return trace_models(str(src), str(opt), provider="cuda", input_shapes=shapes).lines(limit=limit)
  except Exception as err:  # noqa: BLE001 - recorded in the report
    return [f"trace failed: {type(err).__name__}: {err}"]


def _optimize(src: Path, work: Path, profile: bool = True, **overrides: Any) -> dict[str, Any]:
  """`overrides`: Options fields set otherwise (a second build, written beside the first), e.g. layout="model"."""
  tag = "".join(f".{k.replace('_', '-')}-{v}" for k, v in overrides.items())
  out = work / f"{src.stem}{tag}.ortfuse.onnx"
  try:
    import onnx
    import ortfuse
    start = time.perf_counter()
    from ortfuse import report
    from ortfuse.api import _archs, compile_model
    from ortfuse.config import Options
    arch = harness._arch()  # type: ignore[attr-defined]
    # --profile: each region and GEMM tile is timed against ORT's own kernels for the same sub-graph
    proto = onnx.load(str(src), load_external_data=False)
    meta = zoo.read_sidecar(src)
    shapes = zoo.fixed_image_shapes(proto, meta)
    opts = Options(archs=_archs(arch), profile=profile, dim_hints=zoo.dim_hints(proto, meta, shapes))
    opts = dataclasses.replace(opts, **overrides)
    res = compile_model(str(src), shapes, arch, options=opts)
    seconds = time.perf_counter() - start
    model = res.stubbed  # (its weights stay in the store; `save` streams them out)
    res.save(out)
    (work / f"{out.name.removesuffix('.ortfuse.onnx')}.report.md").write_text(report.markdown(res, str(src)))
    fused = sum(1 for n in model.graph.node if n.domain == "ortfuse")
    placements = [pl.line() for pl in res.placements]
    return {"path": str(out), "seconds": round(seconds, 2), "fused_nodes": fused, "placements": placements,
            "model_check": model_check(res), "input_shapes": {k: list(v) for k, v in (shapes or {}).items()}}
  except Exception as err:  # noqa: BLE001 - the model is still benchmarked without an ortfuse row
    return {"path": None, "note": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}


def model_check(res: Any) -> list[dict[str, Any]]:
  """Per profiled region: the measured times (ORT's, our fastest candidate) next to the cost model's."""
  kinds = {r.id: r.kind for r in res.plan.regions}
  kinds.update({k.region.id: k.region.kind for k in res.kernels})
  return [{"region": pl.region, "kind": kinds.get(pl.region, "?"), "bindings": list(pl.bindings),
           "ort_us": list(pl.ort_us), "ours_us": list(pl.best_us), "model_ort_us": list(pl.model_ort_us),
           "model_ours_us": list(pl.model_ours_us)}
          for pl in res.placements if pl.model_ort_us is not None and pl.model_ours_us is not None]


def model_check_lines(rows: list[dict[str, Any]]) -> list[str]:
  """Per region kind and binding: the median of measured / estimated, ours and ORT's (1 = the cost model
  was right; 3 = it assumed a third of the time). Identical layers count once."""
  seen, groups = set(), {}
  for r in rows:
    key = (r["kind"], tuple(r["ort_us"]), tuple(r["ours_us"]))
    if key in seen:
      continue
    seen.add(key)
    groups.setdefault(r["kind"], []).append(r)
  out = []
  for kind, rs in sorted(groups.items()):
    cells = []
    for i, b in enumerate(rs[0]["bindings"]):
      ours = float(np.median([r["ours_us"][i] / r["model_ours_us"][i] for r in rs]))
      ort = float(np.median([r["ort_us"][i] / r["model_ort_us"][i] for r in rs]))
      cells.append(f"{b}: ours {ours:.2f}, ORT {ort:.2f}")
    out.append(f"{kind} ({len(rs)} distinct): " + "; ".join(cells))
  return out


def _bench(src: Path, opt: str | None, batches: str, work: Path, variants: str | None,
           beside: str | None = None) -> dict[str, Any]:
  """Run the harness in a subprocess; return its JSON result (or the failure)."""
  cmd = [sys.executable, "-m", "ortfuse.bench.harness", str(src), "--provider", "cuda", "--batch", batches,
         "--out", str(work)]
  if opt:
    cmd += ["--optimized", opt]
  if beside:
    cmd += ["--beside", beside]
  if variants:
    cmd += ["--variants", variants]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  js = work / f"{src.stem}.cuda.json"
  if proc.returncode != 0 or not js.exists():
    return {"error": (proc.stdout + proc.stderr)[-3000:]}
  return json.loads(js.read_text())


def _kernels(src: Path, work: Path, batches: str) -> dict[str, Any]:
  """Issue 5's per-kernel figures (bench/kernels.py) in a subprocess: each GEMM/Conv kernel with its
  epilogue against the library's bare call, each attention against ORT's MultiHeadAttention."""
  big = max(int(b) for b in batches.split(","))
  js, md = work / f"{src.stem}.kernels.json", work / f"{src.stem}.kernels.md"
  cmd = [sys.executable, "-m", "ortfuse.bench.kernels", str(src), "--batch", str(big), "--json", str(js), "--md", str(md)]
  start = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0 or not js.exists():
    return {"error": (proc.stdout + proc.stderr)[-3000:]}
  text = md.read_text()
  return {"rows": json.loads(js.read_text()), "table": text, "seconds": round(time.perf_counter() - start, 1),
          "summary": [ln for ln in text.splitlines() if ln and not ln.startswith("|")]}


def _sweep(out: Path, work: Path) -> dict[str, Any]:
  """Issue 5's GEMM tile sweep (bench/sweep.py) in a subprocess: every family's best tiles forced on the zoo's
  GEMM shapes against cuBLAS. OUTDIR gets sweep.md."""
  js = work / "sweep.json"
  cmd = [sys.executable, "-m", "ortfuse.bench.sweep", "--json", str(js), "--md", str(out / "sweep.md")]
  start = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if not js.exists():
    return {"error": (proc.stdout + proc.stderr)[-3000:]}
  text = (out / "sweep.md").read_text()
  return {"shapes": json.loads(js.read_text()), "seconds": round(time.perf_counter() - start, 1),
          "summary": [ln for ln in text.splitlines() if ln and not ln.startswith(("|", "#"))]}


def variant_label(profile: bool = True) -> str:
  """What the rows' optimize used beyond the defaults, appended to the model name so runs of one model with
  and without it merge side by side: " no-wgmma" ($ORTFUSE_WGMMA=0, which --no-wgmma sets for this process
  and its children; wgmma is the sm_90 default since 2026-11-26, so rows before then read " +wgmma" for it),
  " ln-fold=off|on" ($ORTFUSE_LN_FOLD, --ln-fold), " pdl" ($ORTFUSE_PDL=1, --pdl), " no-profile" (optimized
  without --profile)."""
  from ortfuse.config import Options
  opts = Options(archs=(90,))
  return (" no-wgmma" if opts.wgmma is False else "") + (f" ln-fold={opts.ln_fold}" if opts.ln_fold != "auto" else "") \
      + (" pdl" if opts.pdl else "") + ("" if profile else " no-profile")


def run_suite(out: Path, models: list[str], dtypes: list[str], batches: str, work: Path, tiny: bool,
              run_tests: bool, variants: str | None, exporter: str = "torchscript",
              kernels: bool = False, sweep: bool = False, profile: bool = True,
              beside: dict[str, Any] | None = None) -> dict[str, Any]:
  """`profile`: optimize with --profile (measured placement and tiles); without it the rows read
  'NAME no-profile' (the default build: the cost model's placement, the tile model's kernel variants).
  `beside`: Options fields for a second build (e.g. {"layout": "model"}, {"pdl": True}), timed in the same
  run as the harness's ortfuse-beside rows."""
  out.mkdir(parents=True, exist_ok=True)
  work.mkdir(parents=True, exist_ok=True)
  report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "env": harness._env(), "entries": []}
  if run_tests:
    report["pytest"] = _pytest(out)
    report["overhead"] = _overhead(work)
  if sweep:
    report["sweep"] = _sweep(out, work)
    _write(out, report)
  for name in models:
    if exporter != "torchscript" and zoo.MODELS[name].shipped is not None:
      continue  # shipped files are not exported
    for dtype in dtypes:
      label = name if exporter == "torchscript" else f"{name} ({exporter})"
      label += variant_label(profile)  # e.g. without --profile: merged with the profiled row, both show
      entry: dict[str, Any] = {"model": label, "dtype": dtype, "tiny": tiny}
      report["entries"].append(entry)
      try:
        start = time.perf_counter()
        src = zoo.build(name, dtype, tiny, exporter=exporter)
        entry["build_s"] = round(time.perf_counter() - start, 1)
      except Exception as err:  # noqa: BLE001
        entry["error"] = f"zoo build failed: {type(err).__name__}: {err}"
        continue
      entry["optimize"] = _optimize(src, work, profile)
      opt = entry["optimize"].get("path")
      start = time.perf_counter()
      entry["parity"] = _parity(src, Path(opt)) if opt else {"ok": None, "note": "no optimized model"}
      entry["parity_s"] = round(time.perf_counter() - start, 1)  # where a step's time goes (device time is scarce)
      other = None
      if beside and opt:
        entry["beside"] = {"label": beside_label(beside), **_optimize(src, work, profile, **beside)}
        other = entry["beside"].get("path")
      start = time.perf_counter()
      entry["bench"] = _bench(src, opt, batches, work, variants, other)
      entry["bench_s"] = round(time.perf_counter() - start, 1)
      if kernels:
        entry["kernels"] = _kernels(src, work, batches)
      _write(out, report)                        # after every model: a cut-off call keeps what it had
  return report


def _write(out: Path, report: dict[str, Any]) -> None:
  (out / "report.json").write_text(json.dumps(report, indent=1))
  (out / "report.md").write_text(render(report))
  (out / "results.md").write_text(render(report, results=True))
  results = [_as_result(e["bench"]) for e in report["entries"] if e.get("bench", {}).get("rows")]
  if results:
    harness.plot(results, out / "chart.png")


def _as_result(d: dict[str, Any]) -> harness.BenchResult:
  fields = {k: v for k, v in d.items() if k in harness.BenchResult.__dataclass_fields__}
  fields["rows"] = [harness.Row(**r) for r in d["rows"]]
  fields["work"] = {int(k): v for k, v in d.get("work", {}).items()}
  return harness.BenchResult(**fields)


def render(report: dict[str, Any], results: bool = False) -> str:
  """Markdown for report.md, or for docs/results.md (`results`: the summary users read, with provenance)."""
  env = report.get("env", {})
  lines = ["# ortfuse results" if results else "# GPU suite report", "",
           f"Measured {', '.join(map(str, report.get('merged_from') or [report.get('started', '?')]))} on "
           f"{_device(report)}; onnxruntime-gpu "
           f"{env.get('onnxruntime-gpu', env.get('onnxruntime', '?'))}, torch {env.get('torch', '?')}.",
           f"Regenerate: `{REGENERATE}`.", "",
           "Latency is the median of many runs after warm-up, inputs and outputs on the device (IOBinding); "
           "'vs ORT' is stock ORT CUDA EP's median over this row's, from the same run (>1 is faster); "
           "'of ideal' is the roofline limit (bytes at the measured copy bandwidth, matrix FLOPs at the "
           "measured GEMM rate) over the median.", ""]
  if "pytest" in report and not results:
    p = report["pytest"]
    lines += [f"`pytest -m gpu`: rc {p['rc']}, {p['summary']} ({p['seconds']} s).", ""]
  for dtype, o in report.get("overhead", {}).items():
    if "per_node_us" in o:
      lines.append(f"Fused-node overhead ({dtype}, {o['ops']} chained Neg[{o['size']}] nodes, bench/overhead.py): "
                   f"{o['per_node_us']:+.2f} us per node over ORT's native op (native {o['native_us']:.1f} us, "
                   f"fused {o['fused_us']:.1f} us per run; target <= 3 us).")
    else:
      lines.append(f"Fused-node overhead ({dtype}): failed: {str(o.get('error'))[-300:]}")
  if report.get("overhead"):
    lines.append("")
  sw = report.get("sweep")
  if sw and not results:
    lines += ["GEMM tile sweep (bench/sweep.py, sweep.md): " + ("; ".join(sw.get("summary", [])) or
                                                            f"failed: {str(sw.get('error'))[-300:]}"), ""]
  lines += ["| model | dtype | batch | ORT ms | ORT+graph | ORT-transformers | torch.compile | ortfuse | "
            "ortfuse+graph | ortfuse of ideal | parity | optimize s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
  for e in report["entries"]:
    rows = e.get("bench", {}).get("rows", [])
    parity = e.get("parity", {}).get("ok")
    ptxt = {True: "ok", False: "FAIL", None: "—"}[parity]
    opt_s = e.get("optimize", {}).get("seconds")
    for b in e.get("bench", {}).get("batches", []) or [None]:
      by = {r["variant"]: r for r in rows if r["batch"] == b}
      stock = by.get("ort", {})

      def cell(v: str) -> str:
        r = by.get(v, {})
        return f"{r['median_ms']:.3f} ({r['vs_ort']:.2f}x)" if r.get("median_ms") and r.get("vs_ort") else "—"
      ours = by.get("ortfuse", {})
      frac = f"{100 * ours['ideal_fraction']:.0f}%" if ours.get("ideal_fraction") else "—"
      lines.append(f"| {e['model']} | {e['dtype']} | {b if b is not None else '—'} | "
                   f"{stock.get('median_ms') and format(stock['median_ms'], '.3f') or '—'} | "
                   f"{cell('ort+cudagraph')} | {cell('ort-transformers')} | {cell('torch.compile')} | "
                   f"{cell('ortfuse')} | {cell('ortfuse+cudagraph')} | {frac} | {ptxt} | "
                   f"{opt_s if opt_s is not None else '—'} |")
  lines += geomean_lines(report)
  lines += beside_lines(report)
  fixed = [f"{e['model']} {e['dtype']}: " + zoo.shapes_text(shapes)
           for e in report["entries"] if (shapes := e.get("optimize", {}).get("input_shapes"))]
  if fixed:
    lines += ["", "Optimized with image sizes fixed (`--input-shape`: static sizes give ortfuse's Conv kernels "
              "their static gather; ORT's baselines run the model as shipped): " + "; ".join(fixed) + "."]
  per_kernel = [(e, e["kernels"]) for e in report["entries"] if e.get("kernels")]
  if per_kernel:
    lines += ["", "## Per kernel (bench/kernels.py: device time, L2 flushed; GEMM + epilogue against the library's "
              "bare call, attention against ORT's MultiHeadAttention)", ""]
    for e, k in per_kernel:
      body = k.get("summary") or [f"failed: {str(k.get('error'))[-300:]}"]
      lines += [f"**{e['model']} {e['dtype']}**: " + " ".join(body)]
      if not results and k.get("table"):
        lines += ["", k["table"]]
  checks = [(e, rows) for e in report["entries"] if (rows := e.get("optimize", {}).get("model_check"))]
  if checks and not results:
    lines += ["", "## Cost model against --profile (median of measured / estimated per region kind)", ""]
    for e, rows in checks:
      lines += [f"**{e['model']} {e['dtype']}**: " + " | ".join(model_check_lines(rows))]
  if not results:
    for e in report["entries"]:
      notes = [e.get("error"), e.get("optimize", {}).get("note"), e.get("parity", {}).get("note"),
               e.get("bench", {}).get("error")] + e.get("bench", {}).get("notes", [])
      notes += [f"{r['variant']} b{r['batch']}: {r['note']}" for r in e.get("bench", {}).get("rows", []) if r.get("note")]
      par = e.get("parity", {})
      if par.get("ok") is False:  # what failed, and where the values first part (the trace's origins first)
        notes += [f"parity: {ln.strip()}" for ln in par.get("lines", [])[:8]]
        notes += [f"trace: {ln.strip()}" for ln in par.get("trace", [])[:16]]
      notes = [n for n in notes if n]
      steps = [(k, e.get(f"{k}_s", e.get(k, {}).get("seconds") if isinstance(e.get(k), dict) else None))
               for k in ("build", "optimize", "parity", "bench")]
      if any(s is not None for _, s in steps):
        notes.append("seconds: " + ", ".join(f"{k} {s}" for k, s in steps if s is not None))
      if notes:
        lines += ["", f"**{e['model']} {e['dtype']}**", ""] + [f"- {str(n)[:400]}" for n in notes]
  return "\n".join(lines) + "\n"


def beside_label(overrides: dict[str, Any]) -> str:
  """The second build's name in the report: its options as flags ("pdl", "no pdl", "--layout model")."""
  flags = {"pdl": "pdl", "key_frontier": "key frontier"}
  return ", ".join(("" if v else "no ") + flags[k] if k in flags else f"--{k.replace('_', '-')} {v}"
                   for k, v in overrides.items())


def beside_lines(report: dict[str, Any]) -> list[str]:
  """Each entry's second build (`--beside-pdl`, `--beside-layout`) against its first, same run: median ms and the
  ratio."""
  out = []
  for e in report["entries"]:
    if "beside" not in e:
      continue
    rows = e.get("bench", {}).get("rows", [])
    cells = []
    for b in e.get("bench", {}).get("batches", []):
      by = {r["variant"]: r.get("median_ms") for r in rows if r["batch"] == b}
      for mine, other in (("ortfuse", "ortfuse-beside"), ("ortfuse+cudagraph", "ortfuse-beside+cudagraph")):
        if by.get(mine) and by.get(other):
          cells.append(f"batch {b}{' graph' if 'graph' in mine else ''}: {by[other]:.3f} against {by[mine]:.3f} ms "
                       f"({by[mine] / by[other]:.2f}x)")
    out.append(f"{e['model']} {e['dtype']}, built with {e['beside']['label']} beside the row's build (same run): "
               + ("; ".join(cells) or f"no figures ({e['beside'].get('note', 'see notes')})") + ".")
  return ["", *out] if out else []


# (variant, its baseline): ortfuse against stock ORT, and with CUDA graphs on both sides
GEOMEANS = (("ortfuse", "ort"), ("ortfuse+cudagraph", "ort+cudagraph"), ("ortfuse", "ort+cudagraph"))


def geomean_lines(report: dict[str, Any]) -> list[str]:
  """Per batch: the geometric mean over the model rows (every dtype) of baseline median / variant median,
  only over rows where both ran."""
  out = []
  batches = sorted({r["batch"] for e in report["entries"] for r in e.get("bench", {}).get("rows", [])})
  for b in batches:
    parts = []
    for variant, base in GEOMEANS:
      ratios = []
      for e in report["entries"]:
        by = {r["variant"]: r for r in e.get("bench", {}).get("rows", []) if r["batch"] == b}
        if by.get(variant, {}).get("median_ms") and by.get(base, {}).get("median_ms"):
          ratios.append(by[base]["median_ms"] / by[variant]["median_ms"])
      if ratios:
        gm = float(np.exp(np.mean(np.log(ratios))))
        parts.append(f"{variant} over {base} {gm:.2f}x ({len(ratios)} rows)")
    if parts:
      out.append(f"Geometric mean at batch {b}: " + "; ".join(parts) + ".")
  return ["", *out] if out else []


def _device(report: dict[str, Any]) -> str:
  for e in report.get("entries", []):
    dev = e.get("bench", {}).get("device")
    if dev:
      return str(dev.get("name"))
  return "?"


def merge(out: Path, parts: list[Path]) -> dict[str, Any]:
  """Join the report.json of several calls (each under the 10-minute limit) into one report."""
  reports = [json.loads(p.read_text()) for p in parts]
  entries: dict[tuple[str, str], dict[str, Any]] = {}
  for r in reports:  # a later call's measurement of a model and dtype replaces an earlier one's
    for e in r["entries"]:
      entries.pop((e["model"], e["dtype"]), None)
      entries[(e["model"], e["dtype"])] = {**e, "measured": r.get("started")}
  merged = {**reports[0], "entries": list(entries.values()), "merged_from": [r.get("started") for r in reports]}
  for key in ("pytest", "overhead", "sweep"):  # from the last call that ran them
    found = [r[key] for r in reports if key in r]
    if found:
      merged[key] = found[-1]
    else:
      merged.pop(key, None)
  out.mkdir(parents=True, exist_ok=True)
  _write(out, merged)
  return merged


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m ortfuse.bench.gpu_suite", description=__doc__.splitlines()[0])
  p.add_argument("out", type=Path)
  p.add_argument("--models", nargs="*", default=list(zoo.MODELS), choices=list(zoo.MODELS),
                 help="zoo models (none: only the tests, the overhead and the sweep)")
  p.add_argument("--dtypes", nargs="+", default=list(zoo.DTYPES), choices=list(zoo.ALL_DTYPES))
  p.add_argument("--batches", default="1,32")
  p.add_argument("--variants", help="harness variants (default: all)")
  p.add_argument("--tiny", action="store_true", help="tiny zoo configs (a quick smoke run)")
  p.add_argument("--exporter", default="torchscript", choices=zoo.EXPORTERS,
                 help="how the zoo's PyTorch models are exported (dynamo needs onnxscript on the machine)")
  p.add_argument("--no-tests", action="store_true", help="skip `pytest -m gpu`")
  p.add_argument("--kernels", action="store_true",
                 help="also time every GEMM/Conv/attention kernel against cuBLAS/cuDNN/MultiHeadAttention")
  p.add_argument("--wgmma", action=argparse.BooleanOptionalAction, default=None,
                 help="sm_90a wgmma GEMM kernels in the optimize (the sm_90 default); --no-wgmma sets "
                      "ORTFUSE_WGMMA=0 and model rows read 'NAME no-wgmma'")
  p.add_argument("--ln-fold", choices=("auto", "on", "off"),
                 help="LayerNorm folds for the optimize (sets ORTFUSE_LN_FOLD; rows read 'NAME ln-fold=off')")
  p.add_argument("--beside-pdl", action="store_true",
                 help="also build each model with programmatic dependent launches toggled and time it in the same "
                      "run (harness --beside): 'built with pdl beside the row's build' lines")
  p.add_argument("--beside-layout", choices=("auto", "blocks", "model"),
                 help="also build each model with this --layout mode and time it in the same run (harness "
                      "--beside): 'built with --layout MODE beside the row's build' lines")
  p.add_argument("--beside-ort-attention", choices=("auto", "on", "off"),
                 help="also build each model with this --ort-attention mode and time it in the same run (harness "
                      "--beside): 'built with --ort-attention MODE beside the row's build' lines")
  p.add_argument("--beside-k-rope", choices=("auto", "kernel", "once"),
                 help="also build each model with this --k-rope mode and time it in the same run (harness "
                      "--beside): 'built with --k-rope MODE beside the row's build' lines")
  p.add_argument("--beside-no-key-frontier", action="store_true",
                 help="also build each model without causal frontiers (every attention key tile visited) and time "
                      "it in the same run (harness --beside): 'built with no key frontier beside the row's build'")
  p.add_argument("--pdl", action="store_true",
                 help="optimize with programmatic dependent launches (sets ORTFUSE_PDL=1); rows read 'NAME pdl'")
  p.add_argument("--no-profile", action="store_true",
                 help="optimize without --profile (the default build); model rows read 'NAME no-profile'")
  p.add_argument("--sweep", action="store_true",
                 help="also run the GEMM tile sweep (bench/sweep.py: every family's tiles against cuBLAS)")
  p.add_argument("--work", type=Path, help="folder for models and per-model results (default: a temp dir)")
  p.add_argument("--merge", nargs="+", type=Path, metavar="REPORT_JSON", help="only merge earlier reports")
  p.add_argument("--wheels", type=Path, help="folder of carried wheels for the shipped models (no registry there)")
  args = p.parse_args(argv)
  if args.merge:
    merge(args.out, args.merge)
    return 0
  if args.wgmma is not None:
    os.environ["ORTFUSE_WGMMA"] = "1" if args.wgmma else "0"
  if args.ln_fold:
    os.environ["ORTFUSE_LN_FOLD"] = args.ln_fold
  if args.pdl:
    os.environ["ORTFUSE_PDL"] = "1"
  work = args.work or Path(tempfile.mkdtemp(prefix="ortfuse-suite-"))
  os.environ.setdefault("ORTFUSE_CACHE_DIR", str(work / "zoo"))
  if args.wheels:
    zoo.wheel_dir().mkdir(parents=True, exist_ok=True)
    for whl in args.wheels.glob("*.whl"):
      shutil.copy2(whl, zoo.wheel_dir() / whl.name)
  from ortfuse.config import Options
  beside = {"pdl": not Options().pdl} if args.beside_pdl else {"layout": args.beside_layout} if args.beside_layout \
      else {"ort_attention": args.beside_ort_attention} if args.beside_ort_attention \
      else {"k_rope": args.beside_k_rope} if args.beside_k_rope \
      else {"key_frontier": False} if args.beside_no_key_frontier else None
  report = run_suite(args.out, args.models, args.dtypes, args.batches, work, args.tiny, not args.no_tests,
                     args.variants, args.exporter, args.kernels, args.sweep, not args.no_profile, beside)
  _write(args.out, report)
  print((args.out / "report.md").read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

"""Where one inference's GPU time goes, kernel by kernel: every kernel's device time and the idle gap before
it, for stock ORT and for the ortfuse model on the CUDA EP, with and without CUDA graphs.

At batch 1 the GPU suite's rows are far from their roofline (GPT-2 fp16: 0.53 ms with CUDA graphs against
an ideal 0.12 ms), and the per-kernel figures (`kernels.py`: each kernel alone, L2 flushed) do not say how
much of a whole run is kernels and how much is the GPU waiting between them. This does: kernels are
recorded by CUPTI through torch.profiler (every kernel of the process, whoever launched it: ORT, cuBLAS,
cuDNN or ortfuse's library through the driver API), one profiled inference at a time after warm-up, inputs
and outputs on the device (IOBinding, as the harness times them). Per variant: the span from the first
kernel's start to the last one's end, the time some kernel ran (the union of their intervals), the gaps
(span minus that), the overlap (kernels running at once: programmatic dependent launches, `--pdl`), and the
same by who launched them (ortfuse; the libraries: cuBLAS, cuDNN; ORT's own kernels); then each of
ortfuse's kernels by the fused node it belongs to. Medians over the profiled runs.

    python -m ortfuse.bench.timeline MODEL.onnx --optimized OUT.onnx [--beside OTHER.onnx] [--batch 1]
        [--runs 5] [--variants ort,ortfuse,ort+cudagraph,ortfuse+cudagraph] [--md OUT.md] [--json OUT.json]

`--beside` adds a second ortfuse build (another option, e.g. `--pdl`) as the ortfuse-beside variants.

Needs a CUDA EP and torch with CUDA (CUPTI); the analysis itself is plain Python (tested on the CPU)."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import onnx

VARIANTS = ("ort", "ortfuse", "ort+cudagraph", "ortfuse+cudagraph")
BESIDE = ("ortfuse-beside", "ortfuse-beside+cudagraph")  # with --beside
# who launched a kernel, from its name: ours are `ofz_<digest>`; the libraries' (cuBLAS, cuBLASLt, CUTLASS,
# cuDNN's GEMM-based convolutions) carry these markers; the rest are ORT's own CUDA kernels
LIBRARY_MARKERS = ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "gemv")


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def group_of(name: str) -> str:
    if name.startswith("ofz_"):
        return "ortfuse"
    low = name.lower()
    return "library" if any(m in low for m in LIBRARY_MARKERS) else "ORT"


def busy_us(kernels: Sequence[Kernel]) -> float:
    """Time at least one kernel ran: the length of the union of their intervals."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        if k.end_us <= end:
            continue
        total += k.end_us - max(k.start_us, end)
        end = k.end_us
    return total


@dataclass(frozen=True)
class RunFigures:
    """One inference: span, busy (union), gaps, overlap (sum of kernel times over busy), per group."""
    kernels: int
    span_us: float
    busy_us: float
    gap_us: float
    overlap_us: float
    by_group: dict[str, tuple[int, float]]  # group -> (kernels, summed device time)


def figures(kernels: Sequence[Kernel]) -> RunFigures:
    if not kernels:
        return RunFigures(0, 0.0, 0.0, 0.0, 0.0, {})
    span = max(k.end_us for k in kernels) - min(k.start_us for k in kernels)
    busy = busy_us(kernels)
    groups: dict[str, tuple[int, float]] = {}
    for k in kernels:
        n, t = groups.get(group_of(k.name), (0, 0.0))
        groups[group_of(k.name)] = (n + 1, t + k.dur_us)
    return RunFigures(len(kernels), span, busy, span - busy, sum(k.dur_us for k in kernels) - busy, groups)


def median_figures(runs: Sequence[Sequence[Kernel]]) -> RunFigures:
    """Field-wise medians over runs (a group's figures over the runs that have it)."""
    each = [figures(r) for r in runs]
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    groups = sorted({g for f in each for g in f.by_group})
    return RunFigures(int(med([f.kernels for f in each])), med([f.span_us for f in each]),
                      med([f.busy_us for f in each]), med([f.gap_us for f in each]),
                      med([f.overlap_us for f in each]),
                      {g: (int(med([f.by_group[g][0] for f in each if g in f.by_group])),
                           med([f.by_group[g][1] for f in each if g in f.by_group])) for g in groups})


@dataclass(frozen=True)
class NodeTime:
    node: str  # the fused node (or the kernel name where no node owns it)
    launches: int
    device_us: float  # summed device time of its kernels in one inference (median over runs)
    gap_us: float  # summed idle time right before them


def per_node(runs: Sequence[Sequence[Kernel]], owner: dict[str, str]) -> list[NodeTime]:
    """ortfuse's kernels by fused node (`owner`: kernel entry -> node name), slowest first: per run the summed
    device time and the idle gap before each of its kernels, then medians over runs."""
    acc: dict[str, list[tuple[int, float, float]]] = {}
    for run in runs:
        ordered = sorted(run, key=lambda k: k.start_us)
        mine: dict[str, tuple[int, float, float]] = {}
        end = None
        for k in ordered:
            gap = max(0.0, k.start_us - end) if end is not None else 0.0
            end = k.end_us if end is None else max(end, k.end_us)
            if group_of(k.name) != "ortfuse":
                continue
            node = owner.get(k.name, k.name)
            n, d, g = mine.get(node, (0, 0.0, 0.0))
            mine[node] = (n + 1, d + k.dur_us, g + gap)
        for node, v in mine.items():
            acc.setdefault(node, []).append(v)
    out = [NodeTime(node, int(statistics.median(v[0] for v in vals)), statistics.median(v[1] for v in vals),
                    statistics.median(v[2] for v in vals)) for node, vals in acc.items()]
    return sorted(out, key=lambda t: -t.device_us)


def kernels_of_trace(trace: dict[str, Any]) -> list[Kernel]:
    """The kernel events of a Chrome trace written by torch.profiler (category "kernel"; microseconds)."""
    return sorted((Kernel(e["name"], float(e["ts"]), float(e.get("dur", 0.0)))
                   for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and e.get("ph") == "X"),
                  key=lambda k: k.start_us)


def owners(optimized: onnx.ModelProto) -> dict[str, str]:
    """Kernel entry -> the fused node that launches it (every kernel variant of the node)."""
    from ortfuse.customops.attrs import read_launch
    out = {}
    for n in optimized.graph.node:
        if n.domain == "ortfuse":
            for launch in read_launch(n).kernels():
                out[launch.entry] = n.name
    return out


def profile_runs(run: Callable[[], None], runs: int, warmup: int = 10) -> list[list[Kernel]]:
    """`runs` inferences, each under its own torch.profiler session (CUDA activities), after `warmup`."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        run()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            path = Path(tmp) / f"run{i}.json"
            prof.export_chrome_trace(str(path))
            out.append(kernels_of_trace(json.loads(path.read_text())))
    return out


def _runner(variant: str, model_path: str, optimized: Optional[str], batch: int,
            beside: Optional[str] = None) -> Callable[[], None]:
    """The harness's way of running a variant (IOBinding, device-resident data; CUDA graphs with fixed
    addresses), for one input set."""
    from ortfuse.bench import harness, zoo
    model = onnx.load(model_path, load_external_data=False)
    feeds = [harness.make_feeds(model, batch, None, 0, zoo.read_sidecar(model_path))]
    fused = variant.startswith("ortfuse")
    optimized = beside if variant.startswith("ortfuse-beside") else optimized
    if fused and not optimized:
        raise ValueError(f"variant {variant} needs --optimized (or --beside)")
    ctx = harness._Ctx(model_path, model, None, "cuda", Path("."), optimized, [])
    path, cls = (optimized, harness._ortfuse_session_cls(ctx)) if fused else (model_path, None)
    if not variant.endswith("+cudagraph"):
        return harness._ort_runner(harness._session(path, "cuda", cls=cls), feeds, "cuda").run
    ref = harness._session(model_path, "cuda")
    shapes = {o.name: (r.shape, r.dtype) for o, r in zip(ref.get_outputs(), ref.run(None, feeds[0]))}
    sess = harness._session(path, "cuda", cuda_opts={"enable_cuda_graph": "1"},
                            static_dims=harness._static_dims(ctx, feeds), cls=cls)
    return harness._ort_runner(sess, feeds, "cuda", shapes).run


def render(model: str, batch: int, results: dict[str, RunFigures], nodes: list[NodeTime], runs: int,
           top: int = 25, skipped: Optional[dict[str, str]] = None) -> str:
    lines = [f"### {Path(model).name}, batch {batch}: one inference on the GPU ({runs} profiled runs, medians)", "",
             "| variant | kernels | span us | busy us | gaps us | overlap us | ortfuse: n / us | library: n / us | "
             "ORT: n / us |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v, f in results.items():
        cell = lambda g: f"{f.by_group[g][0]} / {f.by_group[g][1]:.1f}" if g in f.by_group else "—"  # noqa: E731
        lines.append(f"| {v} | {f.kernels} | {f.span_us:.1f} | {f.busy_us:.1f} | {f.gap_us:.1f} | "
                     f"{f.overlap_us:.1f} | {cell('ortfuse')} | {cell('library')} | {cell('ORT')} |")
    for v, why in (skipped or {}).items():
        lines.append(f"| {v} | not run: {why} | | | | | | | |")
    if nodes:
        lines += ["", f"ortfuse's fused nodes, slowest first (the first {top}; device time and the idle gap "
                  "before their kernels, per inference):", "", "| node | launches | device us | gap before us |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {t.node} | {t.launches} | {t.device_us:.1f} | {t.gap_us:.1f} |" for t in nodes[:top]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--optimized", help="the ortfuse model (needed for the ortfuse variants)")
    ap.add_argument("--beside", help="a second ortfuse model of the input: the ortfuse-beside variants")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--md", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from ortfuse.runtime import _cuda_usable
    if not _cuda_usable(["CUDAExecutionProvider"], None):
        ap.error("needs a working CUDA execution provider (and torch with CUDA, for CUPTI)")
    variants = [v.strip() for v in a.variants.split(",") if v.strip()] + (list(BESIDE) if a.beside else [])
    if unknown := [v for v in variants if v not in VARIANTS + BESIDE]:
        ap.error(f"unknown variants {unknown}: expected some of {', '.join(VARIANTS + BESIDE)}")
    results: dict[str, RunFigures] = {}
    nodes: list[NodeTime] = []
    raw: dict[str, list[list[dict[str, Any]]]] = {}
    owner = owners(onnx.load(a.optimized, load_external_data=False)) if a.optimized else {}
    skipped: dict[str, str] = {}
    for v in variants:
        try:
            run = _runner(v, a.model, a.optimized, a.batch, a.beside)
        except Exception as e:  # noqa: BLE001 -- ORT refusing a session (graph capture of a partitioned model)
            if not v.endswith("+cudagraph"):
                raise
            skipped[v] = " ".join(str(e).split())[:200]
            continue
        runs = profile_runs(run, a.runs)
        results[v] = median_figures(runs)
        raw[v] = [[asdict(k) for k in r] for r in runs]
        if v == "ortfuse":
            nodes = per_node(runs, owner)
    text = render(a.model, a.batch, results, nodes, a.runs, skipped=skipped)
    print(text)
    if a.md:
        a.md.write_text(text)
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "optimized": a.optimized, "batch": a.batch,
                                      "figures": {v: asdict(f) for v, f in results.items()},
                                      "nodes": [asdict(t) for t in nodes], "kernels": raw, "skipped": skipped},
                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

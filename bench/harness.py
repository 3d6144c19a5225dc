"""Benchmark harness: one model, several ways of running it, timed in the same process and compared.

Variants (each a row per batch; any that cannot run here becomes a row with a note instead of a number):
  ort            stock onnxruntime, ORT_ENABLE_ALL, the model as given (the reference for every ratio)
  ort+cudagraph  the same with enable_cuda_graph=1, static shapes, pre-allocated outputs (CUDA only)
  ort-transformers  after onnxruntime.transformers.optimizer.optimize_model (bert / gpt2 / vit only)
  torch.compile  the zoo's PyTorch source module through torch.compile (CUDA torch only)
  ortfuse        ortfuse's optimized model through ortfuse.InferenceSession
  ortfuse+cudagraph  the same with enable_cuda_graph=1, like ort+cudagraph (CUDA only): the like-for-like
                 comparison where launch overhead is what separates stock ORT from ortfuse
  ort+static     diagnostic, not run by default: stock ORT with the symbolic dims pinned as ort+cudagraph
                 pins them, but no graph; separates what pinning changes from what the graph does
  ort-transformers+ortfuse
                 diagnostic, not run by default: ortfuse applied to the ort-transformers model (its fused ops
                 written as standard ops where a GEMM can take them: rewriter/contrib.py), for users who
                 start from a model ORT's optimizer already fused
  ortfuse-beside, ortfuse-beside+cudagraph
                 with `--beside OTHER.onnx` only: a second ortfuse build of the model (another option, e.g.
                 --pdl) timed like ortfuse and ortfuse+cudagraph in the same run, so the two compare side by side

Timing: host clock around each synchronous Run (ORT synchronizes its stream at the end of Run; torch is
synchronized explicitly), after warm-up; median and p90 of many runs. On CUDA, inputs and outputs stay on
the device through IOBinding, and three input sets rotate (one for CUDA graphs, whose addresses are fixed).
Peak memory on CUDA is device-wide used memory (cudaMemGetInfo) at its highest after warm-up and after the
timed runs, less what was used before the session was made: it covers ORT's arena, cuDNN workspaces and
graph pools, which per-framework counters miss. torch.compile rows report torch's own peak of reserved
memory instead (the caching allocator keeps earlier rows' memory, so the device-wide delta is not theirs).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import onnx

from ortfuse import ortvalues
from ortfuse.feeds import bind_dims

from . import roofline, zoo

log = logging.getLogger(__name__)

# torch.compile runs last: importing torch slows ORT's CPU thread pool 2-4x on the 2-core CI machine
# (measured here), so nothing in a CPU run imports torch and GPU runs import it only at the end.
VARIANTS = ("ort", "ort+cudagraph", "ort-transformers", "ortfuse", "ortfuse+cudagraph", "torch.compile")
DIAGNOSTIC = ("ort+static", "ort-transformers+ortfuse")  # only when asked for (--variants)
BESIDE = ("ortfuse-beside", "ortfuse-beside+cudagraph")  # with a second ortfuse model (`beside_path`)
CPU_VARIANTS = ("ort", "ortfuse")
DEFAULTS = {"cuda": dict(runs=200, warmup=20, max_seconds=10.0), "cpu": dict(runs=20, warmup=3, max_seconds=3.0)}
INPUT_SETS = 3                     # rotated on CUDA so repeated runs do not measure one cached input


@dataclass
class Row:
  variant: str
  batch: int
  median_ms: float | None = None
  p90_ms: float | None = None
  runs: int = 0
  throughput: float | None = None          # samples per second at the median
  peak_mem_mb: float | None = None
  vs_ort: float | None = None              # stock ORT median / this median: > 1 is faster than stock
  ideal_fraction: float | None = None      # roofline ideal / median: 1.0 is the limit
  max_abs_diff: float | None = None        # against stock ORT's outputs on the same inputs
  note: str = ""


@dataclass
class BenchResult:
  model: str
  optimized: str | None
  provider: str
  batches: list[int]
  rows: list[Row]
  device: dict[str, Any]
  work: dict[int, dict[str, Any]] = field(default_factory=dict)     # batch -> Work + ideal
  optimize_s: float | None = None
  notes: list[str] = field(default_factory=list)
  env: dict[str, str] = field(default_factory=dict)
  files: dict[str, str] = field(default_factory=dict)

  def row(self, variant: str, batch: int) -> Row | None:
    return next((r for r in self.rows if r.variant == variant and r.batch == batch), None)

  def to_markdown(self) -> str:
    lines = [f"### {Path(self.model).name} ({self.provider})", "",
             f"Device: {self.device.get('name')} ({_si(self.device.get('bandwidth'), 'B/s')} copy, "
             f"{_si(self.device.get('flops', {}).get('fp16'), 'FLOP/s')} fp16 / "
             f"{_si(self.device.get('flops', {}).get('fp32'), 'FLOP/s')} fp32 matmul, measured)."]
    if self.optimize_s is not None:
      lines.append(f"ortfuse optimize time: {self.optimize_s:.2f} s.")
    for b, w in sorted(self.work.items()):
      lines.append(f"Batch {b}: {w['flops'] / 1e9:.4g} GFLOP, {w['bytes'] / 1e6:.4g} MB moved at least; "
                   f"ideal {w['ideal_ms']:.3f} ms ({w['bound']}-bound).")
    lines += [""] + [f"Note: {n}" for n in self.notes] + [""] if self.notes else [""]
    lines += ["| batch | variant | median ms | p90 ms | vs ORT | samples/s | peak MB | of ideal | max abs diff | note |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in self.rows:
      lines.append(f"| {r.batch} | {r.variant} | {_f(r.median_ms, 3)} | {_f(r.p90_ms, 3)} | "
                   f"{_f(r.vs_ort, 2, 'x')} | {_f(r.throughput, 1)} | {_f(r.peak_mem_mb, 0)} | "
                   f"{_f(None if r.ideal_fraction is None else 100 * r.ideal_fraction, 1, '%')} | "
                   f"{_f(r.max_abs_diff, 2, '', 'e')} | {r.note} |")
    return "\n".join(lines) + "\n"


def _f(x: float | None, digits: int, suffix: str = "", fmt: str = "f") -> str:
  return "—" if x is None else f"{x:.{digits}{fmt}}{suffix}"


def _si(x: float | None, unit: str) -> str:
  if not x:
    return "?"
  for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
    if x >= div:
      return f"{x / div:.1f} {p}{unit}"
  return f"{x:.0f} {unit}"


# --- inputs ------------------------------------------------------------------------------------------

_NP = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT64: np.int64,
       onnx.TensorProto.INT32: np.int32, onnx.TensorProto.BOOL: np.bool_, onnx.TensorProto.DOUBLE: np.float64,
       onnx.TensorProto.BFLOAT16: onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16)}


def make_feeds(model: onnx.ModelProto, batch: int, dims: dict[str, int] | None = None, seed: int = 0,
               meta: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
  """Random valid inputs: floats uniform in range (never all zero), ids in the vocabulary, masks of ones
  with padding at the end of every row but the first. A symbolic dim leading an input is the batch."""
  rng = np.random.default_rng(seed)
  specs = {s.name: s for s in zoo.info_from_sidecar(meta).inputs} if meta else {}
  dims = {**(zoo.info_from_sidecar(meta).dims if meta else {}), **(dims or {})}
  inits = {i.name for i in model.graph.initializer}
  # one value per dim name across inputs; a name leading an input is the batch; expressions of names
  # (a decoder's mask over "past_sequence_length + 1") are evaluated from theirs
  bound = bind_dims(model, fixed={**dims, "batch": batch}, default=lambda name, leading: batch if leading else 128)
  feeds = {}
  for inp in model.graph.input:
    if inp.name in inits:
      continue
    t = inp.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else bound[d.dim_param] if d.dim_param else batch if i == 0
             else 128 for i, d in enumerate(t.shape.dim)]
    np_type = _NP[t.elem_type]
    spec = specs.get(inp.name)
    kind = spec.kind if spec else ("mask" if "mask" in inp.name else "ids" if np.issubdtype(np_type, np.integer) else "random")
    if kind == "mask":
      arr = np.ones(shape, np_type)
      seq = shape[-1]
      for row in range(1, shape[0]):                    # row 0 unpadded, others up to a quarter padding
        arr[row, seq - int(rng.integers(0, seq // 4 + 1)):] = 0
    elif kind == "ids":
      high = int(spec.high) if spec else _vocab(model, inp.name)
      arr = rng.integers(int(spec.low) if spec else 0, high, shape).astype(np_type)
    else:
      low, high = (spec.low, spec.high) if spec else (-1.0, 1.0)
      arr = rng.uniform(low, high, shape).astype(np_type)
    feeds[inp.name] = arr
  return feeds


def _vocab(model: onnx.ModelProto, name: str) -> int:
  """Rows of the embedding table an id input gathers from; 2 for type ids; else 100."""
  shapes = {i.name: list(i.dims) for i in model.graph.initializer}
  for node in model.graph.node:
    if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name and node.input[0] in shapes:
      return shapes[node.input[0]][0]
  return 2 if "type" in name else 100


# --- running -----------------------------------------------------------------------------------------

class _Runner:
  """A synchronous `run()` plus `first_outputs()` (outputs for input set 0, as numpy); `peak_bytes`, where
  set, is the runner's own peak memory, which replaces the device-wide figure."""
  def __init__(self, run: Callable[[], None], first_outputs: Callable[[], list[np.ndarray]], keep: Any = None,
               peak_bytes: Callable[[], float] | None = None):
    self.run, self.first_outputs, self._keep, self.peak_bytes = run, first_outputs, keep, peak_bytes


# `ORTFUSE_BENCH_ARENA=same`: every CUDA session's arena grows by what is asked (kSameAsRequested) rather than
# doubling (ORT's default, kNextPowerOfTwo), so peak memory reads as what the model needs, not where the last
# doubling landed (session 51: ViT fp32 at batch 32 2,176 MB against stock ORT's 1,288, while our build's live
# tensors at their peak, in the graph's order, total 166 MB against the input's 241: a doubling or not is the
# question). Timing stays the default's unless this is set; the run's notes say when it is.
ARENA_ENV = "ORTFUSE_BENCH_ARENA"


def _arena_options() -> dict[str, str]:
  how = os.environ.get(ARENA_ENV, "")
  if how in ("", "pow2"):
    return {}
  if how != "same":
    raise ValueError(f"{ARENA_ENV}={how!r}: expected 'same' or 'pow2'")
  return {"arena_extend_strategy": "kSameAsRequested"}


def _session(path: str, provider: str, cls: Any = None, cuda_opts: dict[str, str] | None = None,
             static_dims: dict[str, int] | None = None) -> Any:
  import onnxruntime as ort
  so = ort.SessionOptions()
  so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
  so.log_severity_level = 3
  for name, value in (static_dims or {}).items():
    so.add_free_dimension_override_by_name(name, value)
  providers: list[Any] = ["CPUExecutionProvider"]
  if provider == "cuda":
    providers.insert(0, ("CUDAExecutionProvider", {**_arena_options(), **(cuda_opts or {})}))
  return (cls or ort.InferenceSession)(path, sess_options=so, providers=providers)


def _ort_runner(sess: Any, feed_sets: list[dict[str, np.ndarray]], provider: str,
                out_shapes: dict[str, tuple[tuple[int, ...], Any]] | None = None) -> _Runner:
  """CPU: plain run over rotating inputs. CUDA: IOBinding with device inputs; outputs on the device,
  pre-allocated when `out_shapes` is given (CUDA graphs need fixed addresses)."""
  if provider == "cpu":
    cycle = itertools.cycle(feed_sets)
    bf16 = any(o.type == "tensor(bfloat16)" for o in sess.get_outputs()) or \
        any(ortvalues.is_bf16(v) for v in feed_sets[0].values())
    call = (lambda f: ortvalues.run(sess, None, f)) if bf16 else (lambda f: sess.run(None, f))  # (decided once)
    return _Runner(lambda: call(next(cycle)), lambda: call(feed_sets[0]))
  import onnxruntime as ort
  keep, bindings = [], []
  for feeds in feed_sets:
    b = sess.io_binding()
    for name, arr in feeds.items():
      v = ortvalues.to_ortvalue(arr, "cuda", 0)
      keep.append(v)
      b.bind_ortvalue_input(name, v)
    for o in sess.get_outputs():
      if out_shapes:
        shape, dtype = out_shapes[o.name]
        dtype = onnx.TensorProto.BFLOAT16 if np.dtype(dtype).name == "bfloat16" else dtype  # (no numpy type to ORT)
        v = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", 0)
        keep.append(v)
        b.bind_ortvalue_output(o.name, v)
      else:
        b.bind_output(o.name, "cuda")
    bindings.append(b)
  cycle = itertools.cycle(bindings)

  def run() -> None:
    b = next(cycle)
    sess.run_with_iobinding(b)
    b.synchronize_outputs()

  def first() -> list[np.ndarray]:
    sess.run_with_iobinding(bindings[0])
    return [ortvalues.to_numpy(v) for v in bindings[0].get_outputs()]
  return _Runner(run, first, keep)


def _time(run: Callable[[], None], warmup: int, runs: int, max_seconds: float,
          probe: Callable[[], float | None]) -> tuple[list[float], float | None]:
  """Per-run seconds after warm-up, stopping at `runs` or `max_seconds` (but at least 5 runs)."""
  for _ in range(warmup):
    run()
  peak = probe()
  times: list[float] = []
  deadline = time.perf_counter() + max_seconds
  while len(times) < runs and (len(times) < 5 or time.perf_counter() < deadline):
    t0 = time.perf_counter()
    run()
    times.append(time.perf_counter() - t0)
  after = probe()
  return times, None if peak is None else max(peak, after or 0.0)


def _gpu_used() -> float | None:
  """Device-wide used bytes (cudaMemGetInfo through CuPy, else torch); None without either."""
  try:
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    return float(total - free)
  except Exception:  # noqa: BLE001 - fall through to torch
    pass
  try:
    import torch
    if torch.cuda.is_available():
      free, total = torch.cuda.mem_get_info()
      return float(total - free)
  except ImportError:
    pass
  return None


# --- variants ----------------------------------------------------------------------------------------

@dataclass
class _Ctx:
  model_path: str
  model: onnx.ModelProto
  meta: dict[str, Any] | None
  provider: str
  out_dir: Path
  optimized: str | None
  notes: list[str]
  beside: str | None = None  # a second ortfuse model (the ortfuse-beside rows)
  ortfuse_on_ort_transformers: str | None = None  # made on first use (the ort-transformers+ortfuse rows)


def _prepare_ort_transformers(ctx: _Ctx) -> str:
  from onnxruntime.transformers.optimizer import optimize_model
  info = zoo.info_from_sidecar(ctx.meta) if ctx.meta else None
  if info is None or info.ort_model_type is None:
    raise _Skip("no onnxruntime.transformers model type fits this model")
  if ctx.meta.get("dtype") == "qdq":  # (its recipe starts from the fp32 source, which is not this model)
    raise _Skip("onnxruntime.transformers optimizes float models")
  out = ctx.out_dir / f"{Path(ctx.model_path).stem}.ort-transformers.onnx"
  if not out.exists():
    src = ctx.meta.get("fp32_source") or ctx.model_path   # the usual recipe: fuse in fp32, then convert
    opt = optimize_model(src, model_type=info.ort_model_type, num_heads=info.num_heads,
                         hidden_size=info.hidden_size, use_gpu=ctx.provider == "cuda")
    if ctx.meta.get("fp32_source"):
      opt.convert_float_to_float16(keep_io_types=False)
    opt.save_model_to_file(str(out))
    ctx.notes.append(f"ort-transformers fused ops: {opt.get_fused_operator_statistics()}")
  return str(out)


def _prepare_ortfuse_on_ort_transformers(ctx: _Ctx) -> str:
  """ortfuse's build of the ort-transformers model, made once a run (as the ortfuse row's model is)."""
  if ctx.ortfuse_on_ort_transformers is None:
    path, seconds = _optimize(_prepare_ort_transformers(ctx), ctx.out_dir,
                              _arch() if ctx.provider == "cuda" else "sm_90", ctx.notes)
    if path is None:
      raise _Skip("ortfuse could not optimize the ort-transformers model (see notes)")
    ctx.notes.append(f"ort-transformers+ortfuse optimized in {seconds:.1f} s")
    ctx.ortfuse_on_ort_transformers = path
  return ctx.ortfuse_on_ort_transformers


def _ortfuse_session_cls(ctx: _Ctx) -> Any:
  try:
    from ortfuse import InferenceSession  # type: ignore[attr-defined]
    return InferenceSession
  except ImportError:
    import onnxruntime as ort
    ctx.notes.append("ortfuse.InferenceSession unavailable: the ortfuse row ran on stock ORT "
                     "(model-local functions inlined)")
    return ort.InferenceSession


def _torch_runner(ctx: _Ctx, feed_sets: list[dict[str, np.ndarray]]) -> _Runner:
  import torch
  if ctx.provider != "cuda" or not torch.cuda.is_available():
    raise _Skip("needs torch with CUDA")
  if not ctx.meta:
    raise _Skip("no PyTorch source (not a zoo model)")
  if ctx.meta.get("dtype") == "qdq":
    raise _Skip("the PyTorch source is the float model, not the quantized one")
  module, info = zoo.torch_module(ctx.meta["zoo"], ctx.meta.get("tiny", False))
  half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(ctx.meta.get("dtype", ""))
  module = module.cuda().eval()
  if half is not None:
    module = module.to(half)
  names, outputs = [s.name for s in info.inputs], info.outputs
  compiled = torch.compile(module)

  def tensor(a: np.ndarray) -> Any:  # (torch takes no ml_dtypes array: bf16 goes over as its bits)
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype.name == "bfloat16" else torch.from_numpy(a)
  args = [[tensor(f[n]).cuda() for n in names] for f in feed_sets]
  cycle = itertools.cycle(args)

  @torch.no_grad()
  def call(a: list[Any]) -> Any:
    res = compiled(**dict(zip(names, a)))
    return [res[o] for o in outputs]

  def run() -> None:
    call(next(cycle))
    torch.cuda.synchronize()
  # torch's caching allocator keeps what earlier rows reserved and ORT's arenas of the rows before stay
  # allocated, so the device-wide delta says nothing about this row (2026-11-26: 90-738 MB, ORT's arena);
  # torch's own peak of reserved memory does, weights and inputs included
  torch.cuda.reset_peak_memory_stats()
  return _Runner(run, lambda: [t.float().cpu().numpy() for t in call(args[0])], (module, compiled),
                 lambda: float(torch.cuda.max_memory_reserved()))


class _Skip(Exception):
  """A variant that does not apply here; its message becomes the row's note."""


def _static_dims(ctx: _Ctx, feed_sets: list[dict[str, np.ndarray]]) -> dict[str, int]:
  """Each symbolic input dim at its size in this batch's inputs (free-dimension overrides)."""
  return {d.dim_param: feed_sets[0][i.name].shape[k] for i in ctx.model.graph.input if i.name in feed_sets[0]
          for k, d in enumerate(i.type.tensor_type.shape.dim) if d.dim_param}


def _measure(ctx: _Ctx, variant: str, batch: int, feed_sets: list[dict[str, np.ndarray]],
             ref: list[np.ndarray] | None, opts: dict[str, Any]) -> tuple[Row, list[np.ndarray] | None]:
  row = Row(variant, batch)
  base = _gpu_used() if ctx.provider == "cuda" else None
  probe = (lambda: _gpu_used()) if base is not None else (lambda: None)
  runner = None
  try:
    if variant == "ort":
      runner = _ort_runner(_session(ctx.model_path, ctx.provider), feed_sets, ctx.provider)
    elif variant == "ort+static":
      runner = _ort_runner(_session(ctx.model_path, ctx.provider, static_dims=_static_dims(ctx, feed_sets)),
                           feed_sets, ctx.provider)
    elif variant in ("ort+cudagraph", "ortfuse+cudagraph", "ortfuse-beside+cudagraph"):
      if ctx.provider != "cuda":
        raise _Skip("CUDA only")
      if ref is None:
        raise _Skip("needs the stock ORT row's output shapes")
      fused = variant != "ort+cudagraph"
      path = ctx.beside if variant.startswith("ortfuse-beside") else ctx.optimized
      if fused and path is None:
        raise _Skip("no optimized model (see notes)")
      static = _static_dims(ctx, feed_sets)
      sess = _session(path if fused else ctx.model_path, "cuda", cuda_opts={"enable_cuda_graph": "1"},
                      static_dims=static, cls=_ortfuse_session_cls(ctx) if fused else None)
      shapes = {o.name: (r.shape, r.dtype) for o, r in zip(sess.get_outputs(), ref)}
      runner = _ort_runner(sess, feed_sets[:1], "cuda", shapes)
    elif variant == "ort-transformers":
      runner = _ort_runner(_session(_prepare_ort_transformers(ctx), ctx.provider), feed_sets, ctx.provider)
    elif variant == "ort-transformers+ortfuse":
      runner = _ort_runner(_session(_prepare_ortfuse_on_ort_transformers(ctx), ctx.provider,
                                    cls=_ortfuse_session_cls(ctx)), feed_sets, ctx.provider)
    elif variant == "torch.compile":
      runner = _torch_runner(ctx, feed_sets)
    elif variant in ("ortfuse", "ortfuse-beside"):
      path = ctx.beside if variant == "ortfuse-beside" else ctx.optimized
      if path is None:
        raise _Skip("no optimized model (see notes)")
      runner = _ort_runner(_session(path, ctx.provider, cls=_ortfuse_session_cls(ctx)), feed_sets, ctx.provider)
    else:
      raise _Skip(f"unknown variant {variant!r}")
    times, peak = _time(runner.run, opts["warmup"], opts["runs"], opts["max_seconds"], probe)
    outs = [np.asarray(o) for o in runner.first_outputs()]
    ms = np.asarray(times) * 1e3
    row.median_ms, row.p90_ms, row.runs = float(np.median(ms)), float(np.percentile(ms, 90)), len(times)
    row.throughput = batch / (row.median_ms / 1e3)
    if runner.peak_bytes is not None:
      row.peak_mem_mb = runner.peak_bytes() / 2 ** 20
    elif peak is not None and base is not None:
      row.peak_mem_mb = (peak - base) / 2 ** 20
    if ref is not None:
      row.max_abs_diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                             for a, b in zip(outs, ref))
    return row, outs
  except _Skip as why:
    row.note = str(why)
  except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others' numbers
    log.warning("%s at batch %d failed: %s", variant, batch, err)
    row.note = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
  finally:
    del runner
    gc.collect()
  return row, None


def _optimize(model_path: str, out_dir: Path, arch: str, notes: list[str]) -> tuple[str | None, float | None]:
  out = out_dir / f"{Path(model_path).stem}.ortfuse.onnx"
  try:
    import ortfuse
    start = time.perf_counter()
    shapes = zoo.fixed_image_shapes(onnx.load(model_path, load_external_data=False), zoo.read_sidecar(model_path))
    if shapes:
      notes.append("ortfuse optimized with image sizes fixed: " + zoo.shapes_text(shapes))
    result = ortfuse.compile_model(model_path, input_shapes=shapes, arch=arch)  # type: ignore[attr-defined]
    seconds = time.perf_counter() - start
    result.save(out)
    return str(out), seconds
  except Exception as err:  # noqa: BLE001 - missing or failing optimize only removes the ortfuse row
    notes.append(f"ortfuse.optimize unavailable or failed, no ortfuse row: {type(err).__name__}: {err}")
    return None, None


def _arch() -> str:
  """sm_XY of CUDA device 0 (through CuPy), sm_90 when unknown."""
  try:
    import cupy
    return f"sm_{cupy.cuda.Device(0).compute_capability}"
  except Exception:  # noqa: BLE001 - no CUDA here: the project's default target
    return "sm_90"


def run_bench(model_path: str | Path, optimized_path: str | Path | None = None, batches: Sequence[int] = (1, 8, 32),
              provider: str = "cuda", runs: int | None = None, warmup: int | None = None,
              out_dir: str | Path = "bench-out", variants: Sequence[str] | None = None,
              dims: dict[str, int] | None = None, max_seconds: float | None = None,
              chart: bool = True, beside_path: str | Path | None = None) -> BenchResult:
  """Benchmark `model_path` (and its ortfuse-optimized form) at each batch; write <stem>.md/.json/.png to
  `out_dir`. Without `optimized_path`, `ortfuse.optimize` makes it (its time is `optimize_s`).
  `beside_path`: a second ortfuse model, timed in the same run as the ortfuse-beside rows."""
  if provider not in DEFAULTS:
    raise ValueError(f"provider must be 'cuda' or 'cpu', got {provider!r}")
  opts = dict(DEFAULTS[provider])
  opts.update({k: v for k, v in (("runs", runs), ("warmup", warmup), ("max_seconds", max_seconds)) if v is not None})
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  model_path = str(model_path)
  model = onnx.load(model_path, load_external_data=False)
  meta = zoo.read_sidecar(model_path)
  notes: list[str] = []
  if provider == "cuda" and _arena_options():
    notes.append(f"{ARENA_ENV}: every CUDA session's arena grows by what is asked (kSameAsRequested)")
  optimize_s = None
  if optimized_path is None:
    opt, optimize_s = _optimize(model_path, out, _arch() if provider == "cuda" else "sm_90", notes)
  else:
    opt = str(optimized_path)
  ctx = _Ctx(model_path, model, meta, provider, out, opt, notes, str(beside_path) if beside_path else None)
  chosen = list(variants or (VARIANTS if provider == "cuda" else CPU_VARIANTS))
  if beside_path:  # beside the ortfuse rows, before torch.compile's (which imports torch: see VARIANTS)
    at = len(chosen) - (chosen[-1] == "torch.compile")
    chosen[at:at] = [v for v in BESIDE[:2 if provider == "cuda" else 1] if v not in chosen]
  if "ort" not in chosen:
    chosen.insert(0, "ort")                      # every ratio is against stock ORT in the same run
  result = BenchResult(model_path, opt, provider, list(batches), [], {}, optimize_s=optimize_s,
                       notes=notes, env=_env())
  shapes: dict[int, dict[str, list[int]]] = {}
  for batch in batches:
    feed_sets = [make_feeds(model, batch, dims, seed, meta) for seed in range(INPUT_SETS if provider == "cuda" else 1)]
    shapes[batch] = {k: list(v.shape) for k, v in feed_sets[0].items()}
    ref: list[np.ndarray] | None = None
    for variant in chosen:
      row, outs = _measure(ctx, variant, batch, feed_sets, ref, opts)
      if variant == "ort":
        ref = outs
      result.rows.append(row)
  # Ceilings are measured after the timed runs: BLAS threads left spinning would slow the first variant.
  device = roofline.measure_device(provider)
  result.device = asdict(device)
  for batch in batches:
    ideal = _work(model_path, shapes[batch], device, notes)
    if ideal:
      result.work[batch] = ideal
    stock = result.row("ort", batch)
    for row in result.rows:
      if row.batch == batch and row.median_ms:
        row.vs_ort = stock.median_ms / row.median_ms if stock and stock.median_ms else None
        row.ideal_fraction = ideal["ideal_ms"] / row.median_ms if ideal else None
  _write(result, out, chart)
  return result


def _work(model_path: str, shapes: dict[str, list[int]], device: roofline.Device,
          notes: list[str]) -> dict[str, Any] | None:
  try:
    work = roofline.count_work(model_path, shapes)
  except Exception as err:  # noqa: BLE001 - no roofline column rather than no benchmark
    notes.append(f"roofline unavailable: {err}")
    return None
  ideal = roofline.ideal_time(work, device)
  return {**asdict(work), "bytes": work.bytes, "ideal_ms": ideal.seconds * 1e3, "memory_ms": ideal.memory_s * 1e3,
          "compute_ms": ideal.compute_s * 1e3, "bound": ideal.bound}


def _env() -> dict[str, str]:
  """Versions from package metadata: importing torch here would slow every ORT CPU row."""
  import platform
  from importlib import metadata
  env = {"python": platform.python_version(), "machine": platform.node()}
  for dist in ("onnxruntime-gpu", "onnxruntime", "onnx", "torch", "transformers", "ortfuse"):
    try:
      env[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      pass
  return env


def _write(result: BenchResult, out: Path, chart: bool) -> None:
  result.notes[:] = list(dict.fromkeys(result.notes))   # variants repeat per batch; say each thing once
  stem = Path(result.model).stem + f".{result.provider}"
  md, js = out / f"{stem}.md", out / f"{stem}.json"
  result.files = {"markdown": str(md), "json": str(js)}
  if chart:
    result.files["chart"] = str(out / f"{stem}.png")
    plot([result], out / f"{stem}.png")
  md.write_text(result.to_markdown())
  js.write_text(json.dumps(asdict(result), indent=1))


def plot(results: Sequence[BenchResult], path: str | Path) -> None:
  """Median latency (p90 as error bar) and speed-up vs stock ORT, per model and batch, one bar per variant."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups = [(Path(r.model).stem, b, r) for r in results for b in r.batches]
  variants = [v for v in (*VARIANTS, *DIAGNOSTIC, *BESIDE)
              if any(r.row(v, b) and r.row(v, b).median_ms for _, b, r in groups)]
  fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(groups) + 4), 4.5))
  width = 0.8 / max(1, len(variants))
  for i, v in enumerate(variants):
    xs = [g + (i - (len(variants) - 1) / 2) * width for g in range(len(groups))]
    rows = [r.row(v, b) for _, b, r in groups]
    med = [row.median_ms if row and row.median_ms else 0 for row in rows]
    err = [(row.p90_ms - row.median_ms) if row and row.median_ms else 0 for row in rows]
    axes[0].bar(xs, med, width, yerr=[[0] * len(err), err], label=v)
    axes[1].bar(xs, [row.vs_ort if row and row.vs_ort else 0 for row in rows], width, label=v)
  labels = [f"{name}\nb{b}" for name, b, _ in groups]
  for ax, title in ((axes[0], "median latency, ms (bar to p90)"), (axes[1], "speed-up vs stock ORT (same run)")):
    ax.set_xticks(range(len(groups)), labels, fontsize=7)
    ax.set_title(title, fontsize=9)
  axes[0].set_yscale("log")
  axes[1].axhline(1.0, color="k", lw=0.8)
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(str(path), dpi=110)
  plt.close(fig)


# --- command line (wired as `ortfuse bench`) ---------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("model", help="input ONNX model")
  parser.add_argument("--optimized", help="ortfuse-optimized model (default: run ortfuse.optimize)")
  parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
  parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
  parser.add_argument("--out", default="bench-out", help="folder for the .md, .json and .png results")
  parser.add_argument("--runs", type=int, help="timed runs per row (default 200 on CUDA, 20 on CPU)")
  parser.add_argument("--warmup", type=int, help="untimed runs first (default 20 on CUDA, 3 on CPU)")
  parser.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS + DIAGNOSTIC)}")
  parser.add_argument("--beside", metavar="OTHER.onnx",
                      help="a second ortfuse model of the same input, timed in the same run (ortfuse-beside rows)")
  parser.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                      help="value of a symbolic input dim other than the batch, e.g. sequence=128")


def main(args: argparse.Namespace) -> int:
  dims = {k: int(v) for k, v in (d.split("=", 1) for d in args.dim)}
  result = run_bench(args.model, args.optimized, [int(b) for b in args.batch.split(",")], args.provider,
                     args.runs, args.warmup, args.out, args.variants.split(",") if args.variants else None, dims,
                     beside_path=args.beside)
  print(result.to_markdown())
  print("\n".join(f"wrote {p}" for p in result.files.values()))
  return 0


if __name__ == "__main__":
  _p = argparse.ArgumentParser(prog="python -m ortfuse.bench.harness")
  add_arguments(_p)
  raise SystemExit(main(_p.parse_args()))

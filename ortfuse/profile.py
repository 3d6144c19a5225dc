"""`--profile`: measured placement (Collage) and tile choice (Roller's top-K) on the GPU at optimize time.

Each fused region becomes two one-region models on the same random device-resident inputs: the stock-ORT
sub-model (the region's original nodes) and the fused model (our node; one per kept tile candidate for
GEMMs). Both run on ORT's CUDA EP through IOBinding, warm-up then the median of many runs. Our kernel is
kept only where it is faster, with its fastest tile. Timings are cached in <cache>/profile.json keyed by
the sub-model's signature (ops, attributes, dtypes, concrete shapes; not names or weight values), the
kernel source and the device, so identical layers are measured once and a second optimize measures
nothing. Everything except the timer runs on the CPU too, which is
how the tests check the sub-model construction and the decisions.

A kernel serves every batch size, so each region is timed at several bindings of the symbolic dims
(`profile_bindings`: the cost model's hints, usually batch 1, and the batch dim at `Options.profile_batch`):
a GEMM tile that wins at batch 1 can lose to cuBLAS at batch 32 (seen on the H100, 2026-11-24). Verdicts
use the geometric mean over the bindings of the time ratios, each binding weighing the same."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import helper

from ortfuse import ortvalues
from ortfuse.customops.compile import atomic_write, headers_digest
from ortfuse.customops.tiles import Times, Variants, by_size, geomean  # noqa: F401 - re-exported
from ortfuse.errors import OrtfuseError
from ortfuse.feeds import random_feeds
from ortfuse.rewriter.graph import Graph
from ortfuse.rewriter.replace import FusedNode, replace
from ortfuse.rewriter.shapes import build_graph, hints_at_batch
from ortfuse.search import legal
from ortfuse.search.plan import Region

WARMUP, RUNS = 10, 50
# A model -> median microseconds. The default times on the CUDA EP; tests pass a CPU stand-in.
Timer = Callable[[onnx.ModelProto, Mapping[str, np.ndarray], bool], float]


def key_split(split_k: int) -> tuple[int]:
    """An attention kernel's candidate launched with its keys split across up to `split_k` blocks."""
    return (split_k,)


UNSPLIT = key_split(1)  # its keys in one block


def tile_label(t: tuple[int, ...]) -> str:
    """A GEMM candidate (BM, BN, BK, WM, WN, STAGES, SPLIT[, WGMMA]) as 'BMxBNxBK/WMxWN/STAGES' plus
    ' split-K S' and ' wgmma' (' wgmma+TMA': fed by TMA); an attention kernel's key split."""
    if not t:
        return "kernel"
    if len(t) == 1:
        return "keys unsplit" if t == UNSPLIT else f"keys split {t[0]}"
    label = f"{t[0]}x{t[1]}x{t[2]}/{t[3]}x{t[4]}/{t[5]}"
    family = {1: " wgmma", 2: " wgmma+TMA", 3: " wgmma+TMA multicast 2", 4: " wgmma+TMA pingpong",
              5: " wgmma+TMA pingpong multicast 2"}.get(t[7] if len(t) > 7 else 0, "")
    return label + (f" split-K {t[6]}" if len(t) > 6 and t[6] > 1 else "") + family


def us_text(ts: Times) -> str:
    return "/".join(f"{t:.1f}" for t in ts)


@dataclass(frozen=True)
class Placement:
    """The measured verdict for one region: every time is a tuple over `bindings`."""

    region: int
    bindings: tuple[str, ...]  # e.g. ("batch=1", "batch=32")
    ort_us: Times
    ours_us: tuple[tuple[tuple[int, ...], Times], ...]  # (tile, or () for non-GEMM kernels; times)
    keep: bool
    tile: tuple[int, ...]  # the fastest tile (GEMMs), else ()
    # row-wise GEMM epilogues: cuBLAS (ORT) for the GEMM alone + our kernel for the rest, and whether
    # that split won over both the fused kernel and ORT
    split_us: Optional[Times] = None
    split: bool = False
    # the cost model's estimates at the same bindings (ORT's kernels, our kernel), to calibrate it against
    # what was measured
    model_ort_us: Optional[Times] = None
    model_ours_us: Optional[Times] = None
    # GEMMs: further kernels by size (`tile` runs below the first threshold), and the times of the node so
    # built (each binding's kernel)
    variants: Variants = ()
    by_size_us: Optional[Times] = None
    # candidates that failed on the device (a launch it refused, a trap): (tile, the error); timed as inf
    failed: tuple[tuple[tuple[int, ...], str], ...] = ()

    @property
    def best_us(self) -> Times:
        if self.variants and self.by_size_us is not None:
            return self.by_size_us
        return min((ts for _, ts in self.ours_us), key=geomean)

    @property
    def speedup(self) -> float:
        """ORT over the kept choice (ours, the split, or ORT itself: 1.0), geometric mean over the bindings."""
        kept = self.split_us if self.split else self.best_us if self.keep else self.ort_us
        assert kept is not None
        return geomean([o / k for o, k in zip(self.ort_us, kept)])

    def line(self) -> str:
        verdict = "split: cuBLAS + ours" if self.split else "ours" if self.keep else "ORT"
        if self.keep and self.variants:
            verdict += f" ({tile_label(self.tile)}" + "".join(f"; from {r} rows {tile_label(v)}"
                                                              for r, v in self.variants) + ")"
        tiles = ", ".join(f"{tile_label(t)} {us_text(ts)}" for t, ts in self.ours_us)
        split = f", split {us_text(self.split_us)} us" if self.split_us is not None else ""
        model = (f"; cost model: ORT {us_text(self.model_ort_us)}, ours {us_text(self.model_ours_us)} us"
                 if self.model_ort_us is not None and self.model_ours_us is not None else "")
        failed = "".join(f"; {tile_label(t)} failed: {e}" for t, e in self.failed)
        return (f"region {self.region} ({' / '.join(self.bindings)}): ORT {us_text(self.ort_us)} us, "
                f"ours [{tiles}] us{split} -> {verdict}{model}{failed}")


def wins(ours: Times, ort: Times) -> bool:
    """Ours is faster: the geometric mean of ours/ORT over the bindings is below 1."""
    return geomean([a / b for a, b in zip(ours, ort)]) < 1.0


def profile_bindings(g: Graph, batch: int) -> list[tuple[str, dict[str, int]]]:
    """(label, dims) to profile at: the symbolic dims at their hints, then also the graph inputs' leading
    (batch) dims at `batch` when they are symbolic and `batch` differs from their hint (0: hints only)."""
    names = [d for t in g.graph_inputs if (s := g.tensors[t].shape) for d in s if isinstance(d, str)]
    names = list(dict.fromkeys(names))
    hints = {d: int(g.sym_hints.get(d, 1)) for d in names}

    def label(dims: Mapping[str, int]) -> str:
        return ", ".join(f"{d}={v}" for d, v in {**hints, **dims}.items()) or "static shapes"
    out = [(label({}), {})]
    if not batch:
        return out
    # every dim at the large batch, expressions of it ("128*batch" after a flatten) included, as the cost
    # model's own bindings evaluate them (`cost.bindings`)
    big = {d: v for d, v in hints_at_batch(g, batch).items() if v != g.sym_hints.get(d)}
    if big:
        out.append((label({d: v for d, v in big.items() if d in hints}), big))
    return out


def _concrete(g: Graph, t: str, dims: Mapping[str, int]) -> list[int]:
    shape = g.tensors[t].shape
    assert shape is not None
    return [d if isinstance(d, int) else int(dims.get(d, g.sym_hints.get(d, 1))) for d in shape]


def _shape_reads(g: Graph, region: Region, dims: Mapping[str, int]) -> list[onnx.TensorProto]:
    """The run-time shape tensors the region reads but the kernel does not (`legal.shape_reads`: a Range's
    length, an Expand's target), as constants at this binding: the sub-model has no producer for them."""
    out = []
    reads = legal.shape_reads(g, region.nodes, region.inputs)
    if reads is None:  # lowering refuses such a region first; say so rather than build a broken sub-model
        raise OrtfuseError(f"region {region.id}: a run-time shape it reads is not made of its inputs' dims")
    for x, parts in reads:
        vals = [v if k < 0 else _concrete(g, region.inputs[k], dims)[v] for k, v in parts]
        dtype = helper.tensor_dtype_to_np_dtype(g.tensors[x].dtype)
        out.append(onnx.numpy_helper.from_array(np.array(vals if g.tensors[x].shape else vals[0], dtype), x))
    return out


def region_model(g: Graph, region: Region, dims: Mapping[str, int]) -> onnx.ModelProto:
    """The region's original nodes as a model of their own: non-constant inputs become graph inputs with
    concrete shapes, constants and the shape tensors the region reads become initializers."""
    return _sub_model(g, region.nodes, region.inputs, region.outputs, dims, f"region_{region.id}",
                      _shape_reads(g, region, dims))


def node_model(g: Graph, i: int, dims: Mapping[str, int]) -> onnx.ModelProto:
    """Node i alone as a model, as region_model builds a region's."""
    n = g.nodes[i]
    return _sub_model(g, (i,), tuple(dict.fromkeys(t for t in n.input if t)), tuple(t for t in n.output if t),
                      dims, f"node_{i}")


def _sub_model(g: Graph, nodes: Sequence[int], inputs: Sequence[str], outputs: Sequence[str],
               dims: Mapping[str, int], name: str, more_inits: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    chosen = [g.nodes[i] for i in nodes]
    needed = {t for n in chosen for t in n.input if t}
    produced = {o for n in chosen for o in n.output}
    inits = [onnx.numpy_helper.from_array(np.asarray(g.constants[t]), t)
             for t in sorted(needed - produced) if t in g.constants] + list(more_inits)
    graph = helper.make_graph(chosen, name, [helper.make_tensor_value_info(t, g.tensors[t].dtype, _concrete(g, t, dims))
                                             for t in inputs if t not in g.constants],
                              [helper.make_tensor_value_info(t, g.tensors[t].dtype, _concrete(g, t, dims))
                               for t in outputs], inits)
    m = helper.make_model(graph, opset_imports=list(g.model.opset_import))
    m.ir_version = min(g.model.ir_version or 10, 10)
    return m


def fused_model(sub: onnx.ModelProto, node: FusedNode) -> onnx.ModelProto:
    """`sub` (from region_model) with its nodes replaced by the fused node."""
    sg = build_graph(sub, {})
    return replace(sg, [dataclasses.replace(node, node_indices=tuple(range(len(sg.nodes))))])


def _session(model: onnx.ModelProto, fused: bool, cuda_options: Mapping[str, str]):
    import onnxruntime as ort

    from ortfuse.runtime import InferenceSession
    # ORT as it runs by default, which is what a region left to it runs: its CUDA EP's use_tf32 is on, so
    # fp32 MatMul/Conv run on TF32. (Timed with use_tf32 0 until 2026-11-25, the profile kept fp32 GEMMs
    # that tied with exact-fp32 cuBLAS while the default ORT beat them: ViT fp32 at batch 32, 0.45x.)
    providers = [("CUDAExecutionProvider", dict(cuda_options))]
    if fused:
        sess = InferenceSession(model, providers=providers)
        if not sess.fused_kernels:
            raise OrtfuseError("ortfuse: --profile needs the CUDA execution provider (onnxruntime-gpu on a GPU)")
    else:
        sess = ort.InferenceSession(model.SerializeToString(), providers=providers)
        if "CUDAExecutionProvider" not in sess.get_providers():
            raise OrtfuseError("ortfuse: --profile needs the CUDA execution provider (onnxruntime-gpu on a GPU)")
    return sess


def bound_run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], fused: bool,
              cuda_options: Optional[Mapping[str, str]] = None, run_options=None) -> Callable[[], None]:
    """A session of `model` on the CUDA EP with `feeds` and its outputs bound on the device (IOBinding), as
    one call that runs it once."""
    sess = _session(model, fused, cuda_options or {})
    io = sess.io_binding()
    keep = []
    for name, arr in feeds.items():
        v = ortvalues.to_ortvalue(arr, "cuda", 0)
        keep.append(v)
        io.bind_ortvalue_input(name, v)
    for o in sess.get_outputs():
        io.bind_output(o.name, "cuda", 0)

    def run() -> None:
        sess.run_with_iobinding(io, run_options)
    run.keep = (sess, io, keep)  # type: ignore[attr-defined]
    return run


def host_timer(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], fused: bool) -> float:
    """Median microseconds of a synchronous run on the CUDA EP by the host clock, inputs and outputs on the
    device: what a caller waits, ORT's per-run overhead included (the fused-node overhead measurement)."""
    run = bound_run(model, feeds, fused)
    for _ in range(WARMUP):
        run()
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _floor_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    m = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "floor", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def cuda_timer(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], fused: bool) -> float:
    """Microseconds the region costs a pipelined model run (ortfuse.gpu_timer): the longer of its median
    device time and its median enqueue time past ORT's per-run floor. The host clock where CuPy cannot
    reach the GPU."""
    from ortfuse import gpu_timer
    if clock() != gpu_timer.CLOCK:
        return host_timer(model, feeds, fused)
    t = gpu_timer.shared()
    opts, ro = t.cuda_options(), t.run_options()
    try:
        timing = t.time(bound_run(model, feeds, fused, opts, ro), WARMUP, RUNS)
        floor = t.session_floor_us(lambda: bound_run(_floor_model(), {"x": np.ones(1, np.float32)}, False, opts, ro),
                                   RUNS)
        return timing.cost_us(floor)
    except RuntimeError as e:
        raise OrtfuseError(f"ortfuse --profile: the device clock failed ({e}); set {CLOCK_ENV}=host to profile "
                           "with the host clock") from e


def device_timer(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], fused: bool,
                 flush_l2: bool = True) -> float:
    """Median device microseconds of one run (ortfuse.gpu_timer), host overhead excluded: kernel against
    kernel (bench/kernels.py); without `flush_l2` the L2 keeps what the previous run left. Needs the GPU."""
    from ortfuse import gpu_timer
    t = gpu_timer.shared(flush_l2)
    return t.time(bound_run(model, feeds, fused, t.cuda_options(), t.run_options()), WARMUP, RUNS).gpu_us


CLOCK_ENV = "ORTFUSE_PROFILE_CLOCK"  # "host" forces the host clock


# How a cached timing was measured, in every cache key: bumped when the measurement changes (2026-11-25:
# ORT with its default options (TF32), the floor re-timed, RunOptions without the per-run exception)
MEASURE = "m2"


def clock() -> str:
    """Which clock `cuda_timer` uses here (part of every cache key: the two do not mix)."""
    from ortfuse import gpu_timer
    if os.environ.get(CLOCK_ENV, "").lower() == "host" or not gpu_timer.available():
        return "host clock"
    return gpu_timer.CLOCK


def device_name() -> str:
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no driver: the CPU stand-in timer
        return "cpu"


class _Cache:
    def __init__(self, path: Optional[Path]):
        self.path = path
        self.data: dict[str, float] = {}
        if path is not None and path.exists():
            try:
                self.data = json.loads(path.read_text())
            except ValueError:
                self.data = {}

    def get(self, key: str, measure: Callable[[], float]) -> float:
        if key not in self.data:
            self.data[key] = measure()
        return self.data[key]

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps(self.data, indent=0, sort_keys=True).encode())


def signature(sub: onnx.ModelProto) -> str:
    """What a region's timing depends on: ops, attributes, dtypes and shapes, with tensor names replaced by
    their order of appearance and weights by their shape, so identical layers share one measurement."""
    ids: dict[str, int] = {}

    def tid(t: str) -> str:
        return str(ids.setdefault(t, len(ids))) if t else "-"
    g = sub.graph
    parts = [f"in {tid(v.name)} {v.type.tensor_type.elem_type} {[d.dim_value for d in v.type.tensor_type.shape.dim]}"
             for v in g.input]
    parts += [f"w {tid(t.name)} {t.data_type} {list(t.dims)}" for t in g.initializer]
    for n in g.node:
        attrs = sorted((a.name, a.SerializeToString()) for a in n.attribute)
        parts.append(f"{n.domain}:{n.op_type} {[tid(x) for x in n.input]} {[tid(x) for x in n.output]} {attrs}")
    parts += [f"out {tid(v.name)}" for v in g.output]
    return "\n".join(parts)


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _source(node: FusedNode) -> bytes:
    """The kernel's source and the node's integer launch attributes (split_k, blocks_per_sm, ...): the same
    kernel launched otherwise is another candidate."""
    src = next((helper.get_attribute_value(a) for a in node.attributes if a.name == "source"), b"")
    ints = sorted((a.name, a.i) for a in node.attributes if a.type == onnx.AttributeProto.INT)
    return src + repr(ints).encode()


def _measuring(timer: Optional[Timer], device: Optional[str],
               cache_path: Optional[Path]) -> tuple[Timer, str, "_Cache"]:
    """The timer (the CUDA one by default), the device key of cached times, and the cache."""
    return timer or cuda_timer, device or f"{device_name()} / {clock()} / {MEASURE}", _Cache(cache_path)


def place(g: Graph, regions: Sequence[Region], candidates: Callable[[Region], Sequence[tuple[tuple[int, ...], FusedNode]]],
          bindings: Sequence[tuple[str, Mapping[str, int]]], cache_path: Optional[Path],
          timer: Optional[Timer] = None, device: Optional[str] = None) -> list[Placement]:
    """Time every region against its stock-ORT sub-model at each binding. `candidates(region)` yields
    (tile, fused node) pairs: one per tile candidate for GEMMs, one ((), node) otherwise."""
    timer, dev, cache = _measuring(timer, device, cache_path)
    headers = headers_digest()
    out = []
    try:
        for r in regions:
            cands = list(candidates(r))
            ort_us: list[float] = []
            ours: list[list[float]] = [[] for _ in cands]
            failed: dict[tuple[int, ...], str] = {}
            for _, dims in bindings:
                sub = region_model(g, r, dims)
                feeds = random_feeds(sub, None, seed=r.id)
                sig = signature(sub)
                ort_us.append(cache.get(_digest("ort", sig, dev), lambda: timer(sub, feeds, False)))
                for (tile, node), ts in zip(cands, ours):
                    # the kernel's source includes the headers: a change there (an epilogue, a mainloop) is
                    # another kernel, whose time is measured afresh
                    us, err = _time_ours(cache, _digest("ours", sig, _source(node), headers, dev),
                                         lambda: timer(fused_model(sub, node), feeds, True))
                    ts.append(us)
                    if err:
                        failed.setdefault(tile, err)
            per_tile = tuple((tile, tuple(ts)) for (tile, _), ts in zip(cands, ours))
            best_tile, best = min(per_tile, key=lambda x: geomean(x[1]))
            # kernels by size share the node's tensors: only tiles that read the weight the same way
            # (mma.sync reads it as stored, wgmma transposed offline) go together
            rows = [_rows(g, r, dims) for _, dims in bindings]
            layouts = [node.input_perms for _, node in cands]
            first, more, combo = None, (), None
            for layout in dict.fromkeys(layouts):
                group = [pt for pt, lay in zip(per_tile, layouts) if lay == layout]
                f, m, c = by_size(group, rows, best)
                if f is not None and (combo is None or geomean(c) < geomean(combo)):
                    first, more, combo = f, m, c
            pl = Placement(r.id, tuple(label for label, _ in bindings), tuple(ort_us), per_tile, False,
                           first or best_tile, variants=more, by_size_us=combo, failed=tuple(failed.items()))
            out.append(dataclasses.replace(pl, keep=wins(pl.best_us, tuple(ort_us))))
    finally:
        cache.save()
    return out


def padding_wins(g: Graph, i: int, bindings: Sequence[tuple[str, Mapping[str, int]]], cache_path: Optional[Path],
                 timer: Optional[Timer] = None, device: Optional[str] = None) -> tuple[bool, Times, Times]:
    """Whether GEMM node i runs faster in ORT with its weight padded to 16-byte rows and its result sliced
    (rewriter.gemm_padding) than as it is, timed at each binding and cached like `place`: (padded wins, ORT
    as it is, padded + Slice)."""
    from ortfuse.rewriter.gemm_padding import pad_unaligned_gemms
    timer, dev, cache = _measuring(timer, device, cache_path)
    plain: list[float] = []
    padded: list[float] = []
    try:
        for _, dims in bindings:
            sub = node_model(g, i, dims)
            wide, count = pad_unaligned_gemms(build_graph(sub, {}), lambda *_: True)
            if not count:  # aligned at this binding after all: nothing to gain
                return False, (), ()
            feeds = random_feeds(sub, None, seed=i)
            plain.append(cache.get(_digest("ort", signature(sub), dev), lambda: timer(sub, feeds, False)))
            padded.append(cache.get(_digest("ort", signature(wide.model), dev), lambda: timer(wide.model, feeds, False)))
    finally:
        cache.save()
    return wins(tuple(padded), tuple(plain)), tuple(plain), tuple(padded)


def _time_ours(cache: "_Cache", key: str, run: Callable[[], float]) -> tuple[float, str]:
    """Our kernel's time (cached), or (inf, the error) where it fails on the device (a launch the device refuses,
    a trap): that candidate loses, and the failure is not cached."""
    try:
        return cache.get(key, run), ""
    except Exception as e:  # noqa: BLE001 - reported by the caller
        return math.inf, f"{type(e).__name__}: {str(e)[:200]}"


def _rows(g: Graph, r: Region, dims: Mapping[str, int]) -> int:
    """The rows that pick a kernel variant at this binding (attrs.variant_rows: the first output's dims but
    its innermost)."""
    return int(np.prod(_concrete(g, r.outputs[0], dims)[:-1]))


def time_split(g: Graph, gemm: Region, rest: Region, rest_node: FusedNode,
               bindings: Sequence[tuple[str, Mapping[str, int]]], cache_path: Optional[Path],
               timer: Optional[Timer] = None, device: Optional[str] = None) -> Times:
    """The alternative to a row-wise GEMM epilogue: ORT's time for the GEMM alone (cuBLAS) plus our kernel
    for the rest of the region, at each binding, measured and cached like `place` (our kernel failing on the
    device: inf, not cached)."""
    timer, dev, cache = _measuring(timer, device, cache_path)
    headers = headers_digest()
    out = []
    try:
        for _, dims in bindings:
            sub = region_model(g, gemm, dims)
            feeds = random_feeds(sub, None, seed=gemm.id)
            t_gemm = cache.get(_digest("ort", signature(sub), dev), lambda: timer(sub, feeds, False))
            rsub = region_model(g, rest, dims)
            rfeeds = random_feeds(rsub, None, seed=rest.id)
            t_rest, _ = _time_ours(cache, _digest("ours", signature(rsub), _source(rest_node), headers, dev),
                                   lambda: timer(fused_model(rsub, rest_node), rfeeds, True))
            out.append(t_gemm + t_rest)
    finally:
        cache.save()
    return tuple(out)


def mha_model(sub: onnx.ModelProto) -> Optional[onnx.ModelProto]:
    """`sub` (an attention region's region_model) with its pattern as ORT's MultiHeadAttention
    (`rewriter.mha`), or None where that does not compute it."""
    from ortfuse.rewriter.mha import to_mha
    from ortfuse.search.attention import find_attention
    from ortfuse.search.ort_attention import forms
    sg = build_graph(sub, {})
    found, _ = forms(sg, find_attention(sg)[0])
    return to_mha(sg, found).model if len(found) == 1 else None


def time_attention(g: Graph, region: Region, ours: Optional[FusedNode],
                   bindings: Sequence[tuple[str, Mapping[str, int]]], cache_path: Optional[Path],
                   timer: Optional[Timer] = None, device: Optional[str] = None) -> tuple[Times, Times, Times]:
    """An attention region's three backends at each binding, measured and cached like `place`: (ORT's
    unfused ops, our kernel `ours` (inf where None or where it fails on the device), ORT's
    MultiHeadAttention (inf where it does not compute the pattern))."""
    timer, dev, cache = _measuring(timer, device, cache_path)
    headers = headers_digest()
    ort_us, ours_us, mha_us = [], [], []
    try:
        for _, dims in bindings:
            sub = region_model(g, region, dims)
            feeds = random_feeds(sub, None, seed=region.id)
            ort_us.append(cache.get(_digest("ort", signature(sub), dev), lambda: timer(sub, feeds, False)))
            mha = mha_model(sub)
            mha_us.append(math.inf if mha is None else
                          cache.get(_digest("ort", signature(mha), dev), lambda: timer(mha, feeds, False)))
            us = math.inf
            if ours is not None:
                us, _ = _time_ours(cache, _digest("ours", signature(sub), _source(ours), headers, dev),
                                   lambda: timer(fused_model(sub, ours), feeds, True))
            ours_us.append(us)
    finally:
        cache.save()
    return tuple(ort_us), tuple(ours_us), tuple(mha_us)

"""`--profile`: measured placement (Collage) and tile choice (Roller's top-K) on the GPU at optimize time.

Each fused region becomes two one-region models on the same random device-resident inputs: the stock-ORT
sub-model (the region's original nodes) and the fused model (our node; one per kept tile candidate for
GEMMs). Both run on ORT's CUDA EP through IOBinding, warm-up then the median of many runs. Our kernel is
kept only where it is faster, with its fastest tile. Timings are cached in <cache>/profile.json keyed by
the sub-model's signature (ops, attributes, dtypes, concrete shapes; not names or weight values), the
kernel source and the device, so identical layers are measured once and a second optimize measures
nothing. Everything except the timer runs on the CPU too, which is
how the tests check the sub-model construction and the decisions."""
from __future__ import annotations

import dataclasses

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import helper

from ortfuse.customops.compile import atomic_write
from ortfuse.errors import OrtfuseError
from ortfuse.feeds import random_feeds
from ortfuse.rewriter.graph import Graph
from ortfuse.rewriter.replace import FusedNode, replace
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.plan import Region

WARMUP, RUNS = 10, 50
# A model -> median microseconds. The default times on the CUDA EP; tests pass a CPU stand-in.
Timer = Callable[[onnx.ModelProto, Mapping[str, np.ndarray], bool], float]


def tile_label(t: tuple[int, ...]) -> str:
    """A GEMM candidate (BM, BN, BK, WM, WN, STAGES, SPLIT) as 'BMxBNxBK/WMxWN/STAGES' plus ' split-K S'."""
    if not t:
        return "kernel"
    label = f"{t[0]}x{t[1]}x{t[2]}/{t[3]}x{t[4]}/{t[5]}"
    return label + (f" split-K {t[6]}" if len(t) > 6 and t[6] > 1 else "")


@dataclass(frozen=True)
class Placement:
    """The measured verdict for one region."""

    region: int
    ort_us: float
    ours_us: tuple[tuple[tuple[int, ...], float], ...]  # (tile, or () for non-GEMM kernels; median us)
    keep: bool
    tile: tuple[int, ...]  # the fastest tile (GEMMs), else ()
    # row-wise GEMM epilogues: cuBLAS (ORT) for the GEMM alone + our kernel for the rest, and whether
    # that split won over both the fused kernel and ORT
    split_us: Optional[float] = None
    split: bool = False

    @property
    def best_us(self) -> float:
        return min(us for _, us in self.ours_us)

    def line(self) -> str:
        verdict = "split: cuBLAS + ours" if self.split else "ours" if self.keep else "ORT"
        tiles = ", ".join(f"{tile_label(t)} {us:.1f}" for t, us in self.ours_us)
        split = f", split {self.split_us:.1f} us" if self.split_us is not None else ""
        return f"region {self.region}: ORT {self.ort_us:.1f} us, ours [{tiles}] us{split} -> {verdict}"


def _concrete(g: Graph, t: str, dims: Mapping[str, int]) -> list[int]:
    shape = g.tensors[t].shape
    assert shape is not None
    return [d if isinstance(d, int) else int(dims.get(d, g.sym_hints.get(d, 1))) for d in shape]


def region_model(g: Graph, region: Region, dims: Mapping[str, int]) -> onnx.ModelProto:
    """The region's original nodes as a model of their own: non-constant inputs become graph inputs with
    concrete shapes, constants become initializers."""
    nodes = [g.nodes[i] for i in region.nodes]
    needed = {t for n in nodes for t in n.input if t}
    produced = {o for n in nodes for o in n.output}
    inits = [onnx.numpy_helper.from_array(np.asarray(g.constants[t]), t)
             for t in sorted(needed - produced) if t in g.constants]
    inputs = [helper.make_tensor_value_info(t, g.tensors[t].dtype, _concrete(g, t, dims))
              for t in region.inputs if t not in g.constants]
    outputs = [helper.make_tensor_value_info(t, g.tensors[t].dtype, _concrete(g, t, dims)) for t in region.outputs]
    graph = helper.make_graph(nodes, f"region_{region.id}", inputs, outputs, inits)
    m = helper.make_model(graph, opset_imports=list(g.model.opset_import))
    m.ir_version = min(g.model.ir_version or 10, 10)
    return m


def fused_model(sub: onnx.ModelProto, node: FusedNode) -> onnx.ModelProto:
    """`sub` (from region_model) with its nodes replaced by the fused node."""
    sg = build_graph(sub, {})
    return replace(sg, [dataclasses.replace(node, node_indices=tuple(range(len(sg.nodes))))])


def cuda_timer(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], fused: bool) -> float:
    """Median microseconds per run on the CUDA EP, inputs and outputs on the device (IOBinding; the run
    returns once the outputs are ready)."""
    import onnxruntime as ort

    from ortfuse.runtime import InferenceSession
    providers = [("CUDAExecutionProvider", {"use_tf32": "0"})]
    if fused:
        sess = InferenceSession(model, providers=providers)
        if not sess.fused_kernels:
            raise OrtfuseError("ortfuse: --profile needs the CUDA execution provider (onnxruntime-gpu on a GPU)")
    else:
        sess = ort.InferenceSession(model.SerializeToString(), providers=providers)
        if "CUDAExecutionProvider" not in sess.get_providers():
            raise OrtfuseError("ortfuse: --profile needs the CUDA execution provider (onnxruntime-gpu on a GPU)")
    io = sess.io_binding()
    keep = []
    for name, arr in feeds.items():
        v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), "cuda", 0)
        keep.append(v)
        io.bind_ortvalue_input(name, v)
    for o in sess.get_outputs():
        io.bind_output(o.name, "cuda", 0)
    for _ in range(WARMUP):
        sess.run_with_iobinding(io)
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


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


def place(g: Graph, regions: Sequence[Region], candidates: Callable[[Region], Sequence[tuple[tuple[int, ...], FusedNode]]],
          dims: Mapping[str, int], cache_path: Optional[Path], timer: Optional[Timer] = None,
          device: Optional[str] = None) -> list[Placement]:
    """Time every region against its stock-ORT sub-model. `candidates(region)` yields (tile, fused node)
    pairs: one per tile candidate for GEMMs, one ((), node) otherwise."""
    timer = timer or cuda_timer
    dev = device or device_name()
    cache = _Cache(cache_path)
    out = []
    try:
        for r in regions:
            sub = region_model(g, r, dims)
            feeds = random_feeds(sub, None, seed=r.id)
            sig = signature(sub)
            ort_us = cache.get(_digest("ort", sig, dev), lambda: timer(sub, feeds, False))
            ours = []
            for tile, node in candidates(r):
                src = next((helper.get_attribute_value(a) for a in node.attributes if a.name == "source"), b"")
                key = _digest("ours", sig, src, dev)
                ours.append((tile, cache.get(key, lambda: timer(fused_model(sub, node), feeds, True))))
            best_tile, best = min(ours, key=lambda x: x[1])
            out.append(Placement(r.id, ort_us, tuple(ours), best < ort_us, best_tile))
    finally:
        cache.save()
    return out


def time_split(g: Graph, gemm: Region, rest: Region, rest_node: FusedNode, dims: Mapping[str, int],
               cache_path: Optional[Path], timer: Optional[Timer] = None, device: Optional[str] = None) -> float:
    """The alternative to a row-wise GEMM epilogue: ORT's time for the GEMM alone (cuBLAS) plus our kernel
    for the rest of the region, measured and cached like `place`."""
    timer = timer or cuda_timer
    dev = device or device_name()
    cache = _Cache(cache_path)
    try:
        sub = region_model(g, gemm, dims)
        feeds = random_feeds(sub, None, seed=gemm.id)
        t_gemm = cache.get(_digest("ort", signature(sub), dev), lambda: timer(sub, feeds, False))
        rsub = region_model(g, rest, dims)
        rfeeds = random_feeds(rsub, None, seed=rest.id)
        src = next((helper.get_attribute_value(a) for a in rest_node.attributes if a.name == "source"), b"")
        t_rest = cache.get(_digest("ours", signature(rsub), src, dev),
                           lambda: timer(fused_model(rsub, rest_node), rfeeds, True))
    finally:
        cache.save()
    return t_gemm + t_rest

"""Roofline context: the least time a model can take on a device, so every latency reads as a fraction of it.

Work is counted from the shape-inferred ONNX graph at concrete input shapes:
  * FLOPs: MatMul, Gemm, Conv and ConvTranspose only (2 per multiply-add); elementwise work is ignored.
  * bytes: every initializer once, plus the graph inputs and outputs: the minimum any run must move.
Device ceilings are measured, not taken from a datasheet (METHOD.md): a large device-to-device copy
(bytes read + bytes written) and a large matrix product on random data, per dtype. On the CPU the same
code path uses a numpy copy and a numpy float32 matmul, so CI exercises it.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclass(frozen=True)
class Device:
  """Measured ceilings of one device."""
  name: str
  bandwidth: float                  # bytes/s, copy read+write
  flops: dict[str, float]           # dtype ("fp32" | "fp16") -> FLOP/s of a large matrix product
  method: str                       # how the numbers were measured

  def peak(self, dtype: str) -> float:
    return self.flops.get(dtype) or self.flops["fp32"]


@dataclass(frozen=True)
class Work:
  """What one inference must do at one set of input shapes."""
  flops: int
  weight_bytes: int
  io_bytes: int
  dtype: str                        # "fp16" when most weight bytes are fp16 or bf16, else "fp32"

  @property
  def bytes(self) -> int:
    return self.weight_bytes + self.io_bytes


@dataclass(frozen=True)
class Ideal:
  memory_s: float                   # bytes / bandwidth
  compute_s: float                  # flops / matrix throughput

  @property
  def seconds(self) -> float:
    return max(self.memory_s, self.compute_s)

  @property
  def bound(self) -> str:
    return "memory" if self.memory_s >= self.compute_s else "compute"


def ideal_time(work: Work, device: Device) -> Ideal:
  return Ideal(work.bytes / device.bandwidth, work.flops / device.peak(work.dtype))


# --- counting ----------------------------------------------------------------------------------------

def _itemsize(elem_type: int) -> int:
  return int(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)


def _fix_inputs(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
  """A copy with the named graph inputs' dims made concrete."""
  model = onnx.ModelProto.FromString(model.SerializeToString())
  for inp in model.graph.input:
    if inp.name in shapes:
      dims = inp.type.tensor_type.shape.dim
      for d, v in zip(dims, shapes[inp.name]):
        d.Clear()
        d.dim_value = int(v)
  return model


def _infer(model: onnx.ModelProto, strict: bool) -> onnx.ModelProto:
  """Shapes everywhere. ONNX's inference with data propagation first; ORT's symbolic inference (which
  handles more Shape->Reshape chains) only when asked, since importing it pulls in torch when installed."""
  if not strict:
    return onnx.shape_inference.infer_shapes(model, data_prop=True)
  from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
  return SymbolicShapeInference.infer_shapes(model, auto_merge=True)


def _shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
  known: dict[str, list[int]] = {}
  for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
    t = vi.type.tensor_type
    if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
      known[vi.name] = [d.dim_value for d in t.shape.dim]
  for init in model.graph.initializer:
    known[init.name] = list(init.dims)
  return known


def _node_flops(node: onnx.NodeProto, shp: dict[str, list[int]]) -> int | None:
  """FLOPs of one matrix node, None when a needed shape is unknown."""
  ins = [shp.get(n) for n in node.input]
  out = shp.get(node.output[0]) if node.output else None
  if out is None:
    return None
  if node.op_type in ("MatMul", "MatMulInteger"):
    return None if ins[0] is None else 2 * int(np.prod(out)) * ins[0][-1]
  if node.op_type == "Gemm":
    if ins[0] is None:
      return None
    trans_a = next((a.i for a in node.attribute if a.name == "transA"), 0)
    return 2 * int(np.prod(out)) * (ins[0][0] if trans_a else ins[0][1])
  if node.op_type == "Conv":
    w = ins[1]
    return None if w is None else 2 * int(np.prod(out)) * int(np.prod(w[1:]))
  if node.op_type == "ConvTranspose":
    x, w = ins[0], ins[1]
    return None if x is None or w is None else 2 * int(np.prod(x)) * int(np.prod(w[1:]))
  return 0


MATRIX_OPS = ("MatMul", "MatMulInteger", "Gemm", "Conv", "ConvTranspose")


def count_work(model_or_path: onnx.ModelProto | str | Path, input_shapes: dict[str, list[int]]) -> Work:
  """Count the work of one run at `input_shapes` (every graph input that has a symbolic dim must be given)."""
  model = model_or_path if isinstance(model_or_path, onnx.ModelProto) else onnx.load(str(model_or_path))
  fixed = _fix_inputs(model, input_shapes)
  for strict in (False, True):
    inferred = _infer(fixed, strict)
    shp = _shapes(inferred)
    flops, unknown = 0, []
    for node in inferred.graph.node:        # count on the unoptimized model: fused nodes hide their work
      if node.op_type in MATRIX_OPS:
        f = _node_flops(node, shp)
        if f is None:
          unknown.append(node.name or node.op_type)
        else:
          flops += f
    if not unknown:
      break
  if unknown:
    raise ValueError(f"shapes unknown for {len(unknown)} matrix nodes, e.g. {unknown[:3]}")
  weight_bytes, by_type = 0, {}
  for init in inferred.graph.initializer:
    n = int(np.prod(init.dims)) * _itemsize(init.data_type)
    weight_bytes += n
    by_type[init.data_type] = by_type.get(init.data_type, 0) + n
  io_bytes = 0
  for vi in list(inferred.graph.input) + list(inferred.graph.output):
    if vi.name in shp:
      io_bytes += int(np.prod(shp[vi.name])) * _itemsize(vi.type.tensor_type.elem_type)
  half = by_type.get(TensorProto.FLOAT16, 0) + by_type.get(TensorProto.BFLOAT16, 0)
  dtype = "fp16" if half > by_type.get(TensorProto.FLOAT, 0) else "fp32"  # (bf16 runs at fp16's tensor-core rate)
  return Work(flops, weight_bytes, io_bytes, dtype)


# --- measuring the device ----------------------------------------------------------------------------

def _median_s(fn: Any, sync: Any, reps: int, best: bool = False) -> float:
  """Median (or best) seconds of `fn` after one warm-up run."""
  fn()
  sync()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    sync()
    times.append(time.perf_counter() - t0)
  return float(np.min(times) if best else np.median(times))


@functools.lru_cache(maxsize=None)
def measure_device(provider: str = "cpu") -> Device:
  """Measure copy bandwidth and matrix throughput of the device `provider` ("cpu" | "cuda") runs on."""
  if provider == "cuda":
    try:
      return _measure_cupy()          # CuPy first: importing torch perturbs later ORT timings
    except ImportError:
      return _measure_torch_cuda()
  return _measure_cpu()


def _measure_cpu() -> Device:
  n = 64 << 20                                        # 64 MiB, well past the caches of this machine class
  src, dst = np.random.rand(n // 8), np.empty(n // 8)
  # Best of several: a shared 2-core VM is noisy, and a ceiling is what the machine can reach.
  copy_s = _median_s(lambda: np.copyto(dst, src), lambda: None, 10, best=True)
  m = 2048
  a, b = np.random.rand(m, m).astype(np.float32), np.random.rand(m, m).astype(np.float32)
  mm_s = _median_s(lambda: a @ b, lambda: None, 5, best=True)
  fp32 = 2 * m ** 3 / mm_s
  import platform
  # ORT's CPU EP computes most fp16 ops through fp32, so the fp32 rate stands for both.
  return Device(platform.processor() or platform.machine(), 2 * n / copy_s, {"fp32": fp32, "fp16": fp32},
                "numpy: 64 MiB copyto (read+write), 2048^3 float32 matmul; best of 10 / 5")


def _measure_torch_cuda() -> Device:
  import torch
  if not torch.cuda.is_available():
    raise ImportError("torch without CUDA")
  n = 1 << 30
  src = torch.randn(n // 4, device="cuda")
  dst = torch.empty_like(src)
  copy_s = _median_s(lambda: dst.copy_(src), torch.cuda.synchronize, 20)
  flops = {}
  m = 8192
  for dtype, tdt in (("fp16", torch.float16), ("fp32", torch.float32)):
    a, b = torch.randn(m, m, device="cuda", dtype=tdt), torch.randn(m, m, device="cuda", dtype=tdt)
    # fp32 through TF32: ORT's CUDA EP may use it, so the ceiling must admit it.
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    flops[dtype] = 2 * m ** 3 / _median_s(lambda: a @ b, torch.cuda.synchronize, 10)
    torch.backends.cuda.matmul.allow_tf32 = prev
  del src, dst
  torch.cuda.empty_cache()
  return Device(torch.cuda.get_device_name(), 2 * n / copy_s, flops,
                "torch: 1 GiB device copy (read+write); 8192^3 matmul on random data, fp32 with TF32 allowed; median")


def _measure_cupy() -> Device:
  import cupy as cp
  n = 1 << 30
  src = cp.random.rand(n // 4, dtype=cp.float32)
  dst = cp.empty_like(src)
  sync = cp.cuda.Device().synchronize
  copy_s = _median_s(lambda: dst.__setitem__(slice(None), src), sync, 20)
  flops = {}
  m = 8192
  from cupy._core import _routines_linalg as linalg
  for dtype, cdt in (("fp16", cp.float16), ("fp32", cp.float32)):
    a = cp.random.rand(m, m, dtype=cp.float32).astype(cdt)
    b = cp.random.rand(m, m, dtype=cp.float32).astype(cdt)
    # fp32 through TF32, as ORT's CUDA EP runs fp32 MatMuls by default (use_tf32): without it the ceiling
    # is CUDA cores' and ORT's own fp32 rows come out at twice the "ideal" (2026-11-27, H100)
    prev = linalg.get_compute_type(cdt)
    if dtype == "fp32":
      linalg.set_compute_type(cdt, linalg.COMPUTE_TYPE_TF32)
    try:
      flops[dtype] = 2 * m ** 3 / _median_s(lambda: a @ b, sync, 10)
    finally:
      linalg.set_compute_type(cdt, prev)
  name = cp.cuda.runtime.getDeviceProperties(0)["name"]
  return Device(name.decode() if isinstance(name, bytes) else str(name), 2 * n / copy_s, flops,
                "cupy: 1 GiB device copy (read+write); 8192^3 matmul on random data, fp32 with TF32 allowed; median")


def matmul_model(b: int, m: int, k: int, n: int) -> onnx.ModelProto:
  """[b,m,k] input times a [k,n] weight: a model whose work is easy to count by hand (tests, sanity)."""
  w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "w")
  graph = helper.make_graph(
    [helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", m, k])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", m, n])], [w])
  return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

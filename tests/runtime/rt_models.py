"""Model builders for the runtime tests: probe nodes, fused nodes in the docs/design.md format, and the
hand-written test kernel. Every model gets ir_version 10."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

PROBE = ("ortfuse.probe", 1)
FUSED = ("ortfuse", 1)
FUSED_TYPE = "Fused_0123456789"

# Index of each entry of Probe's FACTS output (mirrors the enum in customops/native/ofz_probe.c).
FACTS = [
    "tag_len", "ints_sum", "ints_count", "ctx_inputs", "ctx_outputs", "info_inputs", "info_outputs",
    "node_name_len", "device_id", "mem_is_cpu", "last_dtype", "last_rank", "last_dim_sum", "last_count",
    "last_value_type", "last_int64_sum", "stream_is_null", "table_dtype",
]
PLAN_LEN = 37  # [grid, block, smem, chosen cc (0 = PTX), image bytes, units, d0..d15, cluster, 2 x TMA map (6),
#             the kernel variant run, 1 if a programmatic dependent launch]


def model(nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
          outputs: Sequence[onnx.ValueInfoProto], domains: Sequence[tuple[str, int]] = (),
          functions: Sequence[onnx.FunctionProto] = ()) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "t", list(inputs), list(outputs))
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, v) for d, v in domains]
    m = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    m.ir_version = 10
    return m


def vi(name: str, dtype: int, shape: Sequence[Any] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def u8(data: bytes) -> onnx.TensorProto:
    return numpy_helper.from_array(np.frombuffer(data, dtype=np.uint8).copy())


def fused_attrs(*, entry: str = "k", cubins: dict[int, bytes] | None = None, ptx: bytes = b"// ptx\n",
                block: int = 128, smem: int = 0, sym_dims: Sequence[int] = (), units: Sequence[int] = (),
                units_per_block: int = 128, out_dtypes: Sequence[int] = (), out_ranks: Sequence[int] = (),
                out_dims: Sequence[int] = (), version: int = 1) -> dict[str, Any]:
    """Attributes of a fused node (docs/design.md, "The fused node")."""
    cubins = {80: b"\x7fELF-fake-sm80", 90: b"\x7fELF-fake-sm90!"} if cubins is None else cubins
    attrs: dict[str, Any] = dict(
        ortfuse_version=version, entry=entry, cubin_archs=sorted(cubins), ptx=u8(ptx), block=block, smem=smem,
        sym_dims=list(sym_dims), units=list(units), units_per_block=units_per_block,
        out_dtypes=list(out_dtypes), out_ranks=list(out_ranks), out_dims=list(out_dims))
    for cc, data in cubins.items():
        attrs[f"cubin_{cc}"] = u8(data)
    return attrs


def make_fused_node(inputs: Sequence[str], outputs: Sequence[str], name: str = "fused_0",
                    op_type: str = FUSED_TYPE, domain: str = "ortfuse", **attrs: Any) -> onnx.NodeProto:
    node = helper.make_node(op_type, list(inputs), list(outputs), name=name, domain=domain)
    # empty lists need an explicit type, so build every attribute by hand
    for key, value in attrs.items():
        if isinstance(value, list):
            node.attribute.append(helper.make_attribute(key, value, attr_type=onnx.AttributeProto.INTS))
        else:
            node.attribute.append(helper.make_attribute(key, value))
    return node


def axpy_function(op_type: str = FUSED_TYPE) -> onnx.FunctionProto:
    """The original sub-graph of the test region: Z = X * 2 + Y, W = X - Y (the function body)."""
    nodes = [
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32))),
        helper.make_node("Mul", ["X", "two"], ["X2"]),
        helper.make_node("Add", ["X2", "Y"], ["Z"]),
        helper.make_node("Sub", ["X", "Y"], ["D"]),
        helper.make_node("Cast", ["D"], ["W"], to=T.FLOAT16),
    ]
    return helper.make_function("ortfuse", op_type, ["X", "Y"], ["Z", "W"], nodes,
                                [helper.make_opsetid("", 17)])


def axpy_model(op_type: str = FUSED_TYPE, n: int | str = "N", cubins: dict[int, bytes] | None = None,
               ptx: bytes = b"// ptx\n", **attr_overrides: Any) -> onnx.ModelProto:
    """X, Y: float[n, 4] -> Z = 2X + Y (float), W = X - Y (float16), as one fused node plus its function."""
    attrs = fused_attrs(entry="ofz_test_axpy", cubins=cubins, ptx=ptx, sym_dims=[0, 0], units=[-1, 4],
                        units_per_block=128,
                        out_dtypes=[T.FLOAT, T.FLOAT16], out_ranks=[2, 2], out_dims=[-1, 4, -1, 4])
    attrs.update(attr_overrides)
    node = make_fused_node(["X", "Y"], ["Z", "W"], op_type=op_type, **attrs)
    return model([node], [vi("X", T.FLOAT, [n, 4]), vi("Y", T.FLOAT, [n, 4])],
                 [vi("Z", T.FLOAT, [n, 4]), vi("W", T.FLOAT16, [n, 4])], [FUSED], [axpy_function(op_type)])


def axpy_reference(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x * 2 + y, (x - y).astype(np.float16)


AXPY_SOURCE = r"""
#include "ortfuse_kernel.h"
extern "C" __global__ void ofz_test_axpy(const OfzArgs a) {
  const float* x = static_cast<const float*>(a.ptr[0]);
  const float* y = static_cast<const float*>(a.ptr[1]);
  float* z = static_cast<float*>(a.ptr[2]);
  __half* w = static_cast<__half*>(a.ptr[3]);
  const long long n = a.dim[0] * 4;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    z[i] = x[i] * 2.0f + y[i];
    w[i] = __float2half(x[i] - y[i]);
  }
}
OFZ_EMU_ENTRY(ofz_test_axpy)
"""

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nvrtc_compile(source: str, arch: str) -> bytes:
    """Compiles `source` with NVRTC (works without a GPU): arch "sm_90" gives a cubin, "compute_75" PTX."""
    import nvidia.cu13
    from cupy_backends.cuda.libs import nvrtc

    from ortfuse.customops.compile import read_cubin

    includes = [os.path.join(nvidia.cu13.__path__[0], "include"), os.path.join(REPO, "customops", "include")]
    prog = nvrtc.createProgram(source, "ofz_test.cu", [], [])
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", *[f"--include-path={p}" for p in includes]]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return read_cubin(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)

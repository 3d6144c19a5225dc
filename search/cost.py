"""Profitability: a Welder-style DRAM traffic model. Swap `CostModel` to change the policy; nothing
here decides correctness."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx

from ortfuse.customops.target import Target
from ortfuse.rewriter.graph import Graph
from ortfuse.search import ops
from ortfuse.search.plan import Region, Reject, Traffic


def tensor_bytes(g: Graph, t: str) -> int:
    info = g.tensors[t]
    assert info.shape is not None
    n = 1
    for d in info.shape:
        n *= d if isinstance(d, int) else g.sym_hints.get(d, 128)
    return n * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(info.dtype)).itemsize


def traffic(g: Graph, region: Region) -> Traffic:
    """Unfused: each ORT kernel reads its data inputs and writes its outputs. Fused: the region reads
    its inputs and writes its outputs once (row passes re-read from L1/L2, not DRAM)."""
    unfused = launches = 0
    for i in region.nodes:
        n = g.nodes[i]
        if n.op_type in ops.FREE_IN_ORT:
            continue
        launches += 1
        seen = {t for _, t in ops.data_inputs(n)} | {o for o in n.output if o and o in g.tensors}
        unfused += sum(tensor_bytes(g, t) for t in seen if t in g.tensors and g.tensors[t].shape is not None)
    fused = sum(tensor_bytes(g, t) for t in (*region.inputs, *region.outputs))
    return Traffic(unfused, fused, launches)


def gemm_flops(g: Graph, node: onnx.NodeProto) -> float:
    """2 * M * N * K * batch of a MatMul/Gemm, symbolic dims at their hints."""
    a, y = g.tensors[node.input[0]].shape, g.tensors[node.output[0]].shape
    assert a is not None and y is not None
    trans_a = node.op_type == "Gemm" and any(x.name == "transA" and x.i for x in node.attribute)
    k = a[-2] if trans_a else a[-1]
    n = 2.0 * (k if isinstance(k, int) else g.sym_hints.get(k, 128))
    for d in y:
        n *= d if isinstance(d, int) else g.sym_hints.get(d, 128)
    return n


@dataclass(frozen=True)
class CostModel:
    target: Target
    tf32: bool = False

    def time_us(self, bytes_moved: int, launches: int) -> float:
        return bytes_moved / (self.target.dram_gbps * 1e3) + launches * self.target.launch_us

    def gemm_us(self, g: Graph, node: onnx.NodeProto) -> tuple[float, int]:
        """(roofline time of the bare GEMM as cuBLAS would run it, its DRAM bytes)."""
        tgt = self.target
        dtype = g.tensors[node.input[0]].dtype
        peak = tgt.mma_f16_tflops if dtype != onnx.TensorProto.FLOAT else (
            tgt.mma_tf32_tflops if self.tf32 else tgt.fp32_tflops)
        moved = sum(tensor_bytes(g, t) for t in (node.input[0], node.input[1], node.output[0]))
        return max(gemm_flops(g, node) / (peak * 1e6), moved / (tgt.dram_gbps * 1e3)), moved

    def verdict(self, g: Graph, region: Region) -> Optional[Reject]:
        """None if fusing the region pays, else why not."""
        tr = region.traffic
        label = f"region at {g.node_label(region.nodes[0])}"
        if tr.unfused_launches < 2:
            return Reject(label, "replaces a single ORT kernel: no traffic or launch saved")
        if region.kind == "gemm":
            # cuBLAS + separate epilogue kernels vs our GEMM (assumed gemm_vs_cublas as fast) with the
            # epilogue's traffic gone
            node = next(g.nodes[i] for i in region.nodes if g.nodes[i].op_type in ops.GEMM)
            mm_us, mm_bytes = self.gemm_us(g, node)
            unfused = mm_us + self.time_us(max(tr.unfused_bytes - mm_bytes, 0), tr.unfused_launches)
            fused = mm_us / self.target.gemm_vs_cublas + self.time_us(max(tr.fused_bytes - mm_bytes, 0), 1)
            if fused >= unfused:
                return Reject(label, f"GEMM + epilogue estimated at {fused:.1f} us fused vs {unfused:.1f} us "
                                     "as cuBLAS + ORT kernels")
            return None
        if self.time_us(tr.fused_bytes, 1) >= self.time_us(tr.unfused_bytes, tr.unfused_launches):
            return Reject(label, "estimated no faster than the ORT kernels it replaces")
        return None

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


@dataclass(frozen=True)
class CostModel:
    target: Target

    def time_us(self, bytes_moved: int, launches: int) -> float:
        return bytes_moved / (self.target.dram_gbps * 1e3) + launches * self.target.launch_us

    def verdict(self, g: Graph, region: Region) -> Optional[Reject]:
        """None if fusing the region pays, else why not."""
        tr = region.traffic
        label = f"region at {g.node_label(region.nodes[0])}"
        if tr.unfused_launches < 2:
            return Reject(label, "replaces a single ORT kernel: no traffic or launch saved")
        if self.time_us(tr.fused_bytes, 1) >= self.time_us(tr.unfused_bytes, tr.unfused_launches):
            return Reject(label, "estimated no faster than the ORT kernels it replaces")
        return None

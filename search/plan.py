"""The search stage's output: regions to fuse, and every refusal with its reason."""
from __future__ import annotations

from dataclasses import dataclass

from ortfuse.rewriter.graph import Dim


@dataclass(frozen=True)
class Reject:
    """A 'no' with its reason: `subject` names the node (or region) refused."""

    subject: str
    reason: str

    def __str__(self) -> str:
        return f"{self.subject}: {self.reason}"


@dataclass(frozen=True)
class Traffic:
    """Welder-style DRAM traffic estimate, symbolic dims at their typical values."""

    unfused_bytes: int  # every op reads its inputs and writes its outputs
    fused_bytes: int  # the region reads its inputs once and writes its outputs once
    unfused_launches: int  # ORT kernels the region replaces (free layout ops excluded)

    @property
    def saved_bytes(self) -> int:
        return self.unfused_bytes - self.fused_bytes


@dataclass(frozen=True)
class Region:
    id: int
    kind: str  # "pointwise" | "rowreduce" | "gemm" | "gemm_row" (GEMM + row-wise epilogue) | "attention"
    nodes: tuple[int, ...]  # indices into Graph.nodes, topological order
    inputs: tuple[str, ...]  # element-data tensors read (kernel arguments), first use first
    outputs: tuple[str, ...]  # tensors written (used outside the region or graph outputs)
    space: tuple[Dim, ...]  # pointwise: shape iterated; rowreduce: the reduced tensor's shape
    traffic: Traffic


@dataclass(frozen=True)
class Plan:
    regions: tuple[Region, ...]
    rejects: tuple[Reject, ...]  # nodes that cannot join any region, and why
    refusals: tuple[Reject, ...]  # merges and regions that were legal candidates but refused

    def validate(self, num_nodes: int) -> None:
        """Regions are disjoint and index real nodes (Hidet's sanity_check_partition)."""
        seen: set[int] = set()
        for r in self.regions:
            for n in r.nodes:
                if n in seen or not 0 <= n < num_nodes:
                    raise AssertionError(f"region {r.id}: node {n} repeated or out of range")
                seen.add(n)

"""Per-call cost of a fused node over a native ORT op of the same size (issue 3: at most 3 us).

Two models of one shape: a chain of N native `Neg` ops (ORT's own CUDA kernel each) and the same chain
with every op replaced by an ortfuse node running our generated kernel for that op. Kernels this small
are launch-bound, so (fused median - native median) / N is what our op's dispatch costs on top of a
native kernel: the Compute call through the custom-op ABI, symbolic-dim resolution, output allocation
and the launch. The input's batch dim stays symbolic, as in real models. Both models run in one process,
alternating, on device-resident inputs and outputs (IOBinding); medians of many runs after warm-up.

    python -m ortfuse.bench.overhead [--ops 64] [--size 4096] [--dtype fp32] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortfuse.api import fused_kernel, target_for
from ortfuse.config import cache_dir
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import render
from ortfuse.rewriter.replace import replace
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import legal
from ortfuse.search.plan import Reject

DTYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}
Timer = Callable[[onnx.ModelProto, Mapping[str, np.ndarray], bool], float]


@dataclass(frozen=True)
class Overhead:
    ops: int
    size: int
    dtype: str
    native_us: float  # median per run of the native chain
    fused_us: float  # median per run of the fused chain
    rounds: int

    @property
    def per_node_us(self) -> float:
        return (self.fused_us - self.native_us) / self.ops

    def line(self) -> str:
        return (f"{self.ops} x Neg[{self.size}] {self.dtype}: native {self.native_us:.1f} us, fused "
                f"{self.fused_us:.1f} us per run -> {self.per_node_us:+.2f} us per node "
                f"(median of {self.rounds} alternating rounds)")


def chain_models(ops: int = 64, size: int = 4096, dtype: str = "fp32",
                 archs: Sequence[int] = (80, 90)) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(native chain, the same chain with each op as its own ortfuse node)."""
    dt = DTYPES[dtype]
    names = [f"t{i}" for i in range(ops + 1)]
    nodes = [helper.make_node("Neg", [names[i]], [names[i + 1]], name=f"neg{i}") for i in range(ops)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("t0", dt, ["batch", size])],
                              [helper.make_tensor_value_info(names[-1], dt, ["batch", size])])
    native = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    native.ir_version = 9
    g = build_graph(native, {})
    tgt = target_for(archs)
    fused_nodes = []
    for i in range(ops):
        region = legal.classify(g, {i})
        assert not isinstance(region, Reject), region
        region = type(region)(i, region.kind, region.nodes, region.inputs, region.outputs, region.space,
                              region.traffic)
        spec = lower(g, region, tgt)
        ck = compile_kernel(render(spec.kernel), spec.kernel.name, tuple(archs), cache_dir())
        fused_nodes.append(fused_kernel(region, spec, ck).node)
    return native, replace(g, fused_nodes)


def measure(native: onnx.ModelProto, fused: onnx.ModelProto, feeds: Mapping[str, np.ndarray], timer: Timer,
            rounds: int = 7) -> tuple[float, float]:
    """Median over alternating rounds of each model's median time per run (microseconds)."""
    nat, fus = [], []
    for _ in range(rounds):
        nat.append(timer(native, feeds, False))
        fus.append(timer(fused, feeds, True))
    return statistics.median(nat), statistics.median(fus)


def run(ops: int = 64, size: int = 4096, dtype: str = "fp32", batch: int = 1, timer: Timer | None = None,
        rounds: int = 7, archs: Sequence[int] = (80, 90)) -> Overhead:
    if timer is None:
        from ortfuse.profile import host_timer
        timer = host_timer
    native, fused = chain_models(ops, size, dtype, archs)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((batch, size)) + 0.5).astype(onnx.helper.tensor_dtype_to_np_dtype(DTYPES[dtype]))
    nat, fus = measure(native, fused, {"t0": x}, timer, rounds)
    return Overhead(ops, size, dtype, nat, fus, rounds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ortfuse.bench.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=64)
    p.add_argument("--size", type=int, default=4096, help="elements per row (batch 1)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    res = run(args.ops, args.size, args.dtype, rounds=args.rounds)
    print(res.line())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(res), "per_node_us": res.per_node_us}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

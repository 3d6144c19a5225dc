"""A GEMM with misaligned rows, as ORT runs it and padded (rewriter.gemm_padding): GPT-2's LM head by default.

    python -m ortfuse.bench.unaligned [--shapes 4096x50257x768 128x50257x768] [--json OUT] [--md OUT]

For each MxNxK (fp16): ORT's MatMul on the [K, N] weight (cuBLAS on misaligned rows), the padded MatMul
alone (N rounded up to 16-byte rows) and the padded MatMul + its Slice back to N (what `ortfuse optimize`
writes), device time on random device-resident inputs, L2 flushed (ortfuse.profile.device_timer). The last
column is what `Target.unaligned_gemm_slowdown` stands for: ORT's time over the roofline estimate of the
aligned GEMM. Needs a GPU; the CPU tests run it with a stand-in timer."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortfuse.bench.kernels import Timer
from ortfuse.customops.target import for_cc
from ortfuse.profile import node_model
from ortfuse.rewriter.gemm_padding import pad_unaligned_gemms, padded_width
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.cost import CostModel

SHAPES = ((4096, 50257, 768), (128, 50257, 768))


@dataclass(frozen=True)
class Row:
    m: int
    n: int
    k: int
    ort_us: float  # the MatMul on misaligned rows
    padded_gemm_us: float  # the padded MatMul alone
    padded_us: float  # the padded MatMul + Slice
    roofline_us: float  # the aligned GEMM's roofline estimate (CostModel.gemm_us)

    @property
    def speedup(self) -> float:
        return self.ort_us / self.padded_us

    @property
    def slowdown(self) -> float:
        return self.ort_us / self.roofline_us


def gemm_model(m: int, n: int, k: int, seed: int = 0) -> onnx.ModelProto:
    w = (np.random.default_rng(seed).standard_normal((k, n)) * 0.05).astype(np.float16)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="lm_head")], "unaligned",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [m, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [m, n])],
                          [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def measure(m: int, n: int, k: int, timer: Timer, cc: int = 90) -> Row:
    model = gemm_model(m, n, k)
    g = build_graph(model, {})
    padded, count = pad_unaligned_gemms(g, lambda *_: True)
    if count != 1:
        raise ValueError(f"{m}x{n}x{k}: the weight's rows are aligned, nothing to pad")
    feeds = {"x": (np.random.default_rng(1).standard_normal((m, k)) * 0.5).astype(np.float16)}
    roof = CostModel(for_cc(cc)).gemm_us(g, g.nodes[0])[0]
    gemm = next(i for i, node in enumerate(padded.nodes) if node.op_type == "MatMul")
    return Row(m, n, k, timer(model, feeds, False), timer(node_model(padded, gemm, {}), feeds, False),
               timer(padded.model, feeds, False), roof)


def render(rows: Sequence[Row]) -> str:
    lines = ["| M x N x K fp16 | ORT MatMul us | padded MatMul us | padded + Slice us | speedup | "
             "ORT / aligned roofline |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.m}x{r.n}x{r.k} (N' {padded_width(r.n, TensorProto.FLOAT16)}) | {r.ort_us:.1f} | "
                     f"{r.padded_gemm_us:.1f} | {r.padded_us:.1f} | {r.speedup:.2f} | {r.slowdown:.1f} |")
    return "\n".join(lines)


def run(shapes: Sequence[tuple[int, int, int]] = SHAPES, timer: Optional[Timer] = None) -> list[Row]:
    if timer is None:
        from ortfuse.profile import device_timer
        timer = device_timer
    return [measure(m, n, k, timer) for m, n, k in shapes]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ortfuse.bench.unaligned", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=[f"{m}x{n}x{k}" for m, n, k in SHAPES], metavar="MxNxK")
    p.add_argument("--json", type=Path)
    p.add_argument("--md", type=Path)
    a = p.parse_args(argv)
    rows = run([tuple(int(x) for x in s.split("x")) for s in a.shapes])  # type: ignore[misc]
    text = render(rows)
    print(text)
    if a.md:
        a.md.write_text(text + "\n")
    if a.json:
        a.json.write_text(json.dumps([{**asdict(r), "speedup": r.speedup, "slowdown": r.slowdown} for r in rows],
                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

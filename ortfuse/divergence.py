"""Where an optimized model's values first part from the original's (`ortfuse check --trace`).

`check` says whether the outputs agree; when they do not, this says where the difference begins. Both models run
on the same random inputs, each also returning every tensor the two share: the optimized model's fused nodes'
inputs and outputs and its ORT nodes' outputs (all of them named as in the original). In the optimized model's
node order, a tensor that differs while every input of the node computing it agrees bit for bit is an *origin*:
the difference starts in that node (a fused kernel computing otherwise than ORT's ops, or one of ORT's own ops
computing otherwise in the two graphs: another fusion, another library algorithm). A node whose inputs already
differ a little (an ulp a GEMM's other summation order gives) is an origin of what that does downstream: its
line lists its inputs' bitwise differences, so a QuantizeLinear a step off can be told from one whose input
moved.

Returning intermediate tensors can change what ORT's graph optimizations do in either model (a fusion needs a
tensor nobody else reads); the trace describes the models as they ran with those outputs."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np
import onnx

from ortfuse.check import (_on_cpu, _reference, _run, _seeded, _session, _with_outputs, _with_pins, compare,
                           pinned_shapes)
from ortfuse.errors import InputError, ParityError
from ortfuse.feeds import random_feeds
from ortfuse.rewriter.load import load_model


@dataclass(frozen=True)
class TensorDiff:
    """One shared tensor, the optimized model's value against the original's."""
    name: str
    producer: str  # the node computing it in the optimized model: "ortfuse_region_3" or "MatMul 'name'"
    elements: int
    differing: int  # elements not bit for bit equal (NaN equal to NaN)
    max_abs: float  # the largest difference (for integers: in steps)
    max_rel: float  # check.compare's normwise relative error (integers: elements differing)
    ok: bool  # within check's tolerance for the tensor (integers: equal)
    origin: bool = False  # differs although every input of its producer is bit for bit equal
    inputs: tuple[str, ...] = ()  # its producer's shared inputs that differ: "name: n of N bitwise, max rel r"

    def line(self) -> str:
        what = "ORIGIN " if self.origin else ""
        verdict = "ok" if self.ok else "FAIL"
        s = (f"{what}{self.name} (from {self.producer}): {self.differing} of {self.elements} elements differ, "
             f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g} [{verdict}]")
        return s + "".join(f"\n    input {i}" for i in self.inputs)


@dataclass(frozen=True)
class Trace:
    diffs: tuple[TensorDiff, ...]  # every shared tensor that differs, in the optimized model's node order
    compared: int  # shared tensors compared

    @property
    def origins(self) -> tuple[TensorDiff, ...]:
        return tuple(d for d in self.diffs if d.origin)

    def lines(self, limit: int = 20) -> list[str]:
        out = [f"{self.compared} shared tensors compared, {len(self.diffs)} differ "
               f"({sum(not d.ok for d in self.diffs)} beyond check's tolerance), {len(self.origins)} origins"]
        first = [d for d in self.diffs if d.origin or not d.ok][:limit]
        out += [d.line() for d in first]
        return out


def _bitwise(a: np.ndarray, b: np.ndarray) -> int:
    """Elements of a and b that differ bit for bit (NaNs of any payload equal); all of them if shapes differ."""
    if a.shape != b.shape:
        return max(a.size, b.size)
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        x, y = a.astype(np.float64), b.astype(np.float64)
        same = (x == y) & (np.signbit(x) == np.signbit(y)) | (np.isnan(x) & np.isnan(y))
        return int(a.size - np.count_nonzero(same))
    return int(np.count_nonzero(a != b))


def _label(node: onnx.NodeProto) -> str:
    return node.name if node.domain == "ortfuse" else f"{node.op_type} '{node.name}'"


def trace_models(original, optimized, provider: str = "cpu", input_shapes: Optional[Mapping[str, Sequence]] = None,
                 seed: int = 0) -> Trace:
    """Both models on `check`'s random inputs (the same seed gives the same inputs), every shared tensor compared."""
    src, opt = load_model(original), load_model(optimized)
    (src, _), (opt, _) = _seeded(src), _seeded(opt)
    feeds = random_feeds(src, _with_pins(pinned_shapes(opt), input_shapes or {}), seed)
    inits = {i.name for i in (*src.graph.initializer, *opt.graph.initializer)}
    computed = {o for n in src.graph.node for o in n.output if o}
    order: list[tuple[str, onnx.NodeProto]] = []  # shared tensors in the optimized model's node order
    seen: set[str] = set()
    for n in opt.graph.node:
        for t in (*(n.input if n.domain == "ortfuse" else ()), *n.output):
            if t and t not in seen and t in computed and t not in inits:
                seen.add(t)
                order.append((t, n))
    names = [t for t, _ in order]
    label = os.fspath(original) if isinstance(original, (str, os.PathLike)) else "the original model"
    if provider == "cuda":
        from ortfuse.runtime import InferenceSession
        providers: list = [("CUDAExecutionProvider", {"use_tf32": "0"})]
        ref = _run(_reference(_with_outputs(src, names), providers, label), names, feeds, original, InputError)
        got = _run(_session(_with_outputs(opt, names), providers, cls=InferenceSession), names, feeds, optimized,
                   ParityError)
    elif provider == "cpu":
        (rm, rsh), (om, osh) = (_on_cpu(_with_outputs(src, names), label),
                                _on_cpu(_with_outputs(opt, names), "the optimized model"))
        ref = _run(_reference(rm, ["CPUExecutionProvider"], label), names, feeds, original, InputError, rsh)
        got = _run(_session(om, ["CPUExecutionProvider"]), names, feeds, optimized, ParityError, osh)
    else:
        raise InputError(f"unknown provider '{provider}': expected cpu or cuda")
    ref_of, got_of = dict(zip(names, ref)), dict(zip(names, got))
    bitwise = {t: _bitwise(got_of[t], ref_of[t]) for t in names}
    producer = {t: n for t, n in order if t in n.output}
    diffs = []
    for t, n in order:
        if not bitwise[t] or producer.get(t) is not n:  # (a fused node's input: judged where it is computed)
            continue
        a, r = got_of[t], ref_of[t]
        d = compare(t, a, r)
        steps = (float(np.abs(a.astype(np.int64) - r.astype(np.int64)).max(initial=0))
                 if a.dtype.kind in "iu" and a.shape == r.shape else d.max_abs)
        shared_in = [x for x in dict.fromkeys(n.input) if x in bitwise]
        moved = [x for x in shared_in if bitwise[x]]
        inputs = tuple(f"{x}: {bitwise[x]} of {ref_of[x].size} bitwise, "
                       f"max rel {compare(x, got_of[x], ref_of[x]).max_rel:.3g}" for x in moved)
        diffs.append(TensorDiff(t, _label(n), int(r.size), bitwise[t], steps, d.max_rel, d.ok, not moved, inputs))
    return Trace(tuple(diffs), len(names))

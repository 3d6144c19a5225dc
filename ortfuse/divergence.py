"""Where an optimized model's values first part from the original's (`ortfuse check --trace`).

`check` says whether the outputs agree; when they do not, this says where the difference begins. Both models run
on the same random inputs, each also returning every tensor the two share: the optimized model's fused nodes'
inputs and outputs and its ORT nodes' outputs (all of them named as in the original). In the optimized model's
node order, a tensor that differs while every shared tensor the node computing it reads is equal (through
tensors the rewrite made, a copy or a packed weight, to the shared ones they come from) is an *origin*: the
difference starts in that node (a fused kernel computing otherwise than ORT's ops, or one of ORT's own ops
computing otherwise in the two graphs: another fusion, another library algorithm). A node whose inputs already
differ a little (an ulp a GEMM's other summation order gives) is not an origin: its line lists its inputs'
differences, so a QuantizeLinear a step off can be told from one whose input moved. A node with several outputs
is judged per output against all its inputs.

Returning intermediate tensors can change what ORT's graph optimizations do in either model (a fusion needs a
tensor nobody else reads): the graph outputs are also compared with both models run plainly, and the trace says
where the two runs disagree about them."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np
import onnx

from ortfuse.check import (CUDA_PARITY, Diff, _dtypes, _on_cpu, _reference, _run, _seeded, _session, _with_outputs,
                           _with_pins, compare, pinned_shapes)
from ortfuse.errors import InputError, ParityError
from ortfuse.feeds import random_feeds
from ortfuse.rewriter.load import load_model


@dataclass(frozen=True)
class TensorDiff:
    """One shared tensor, the optimized model's value against the original's."""
    name: str
    producer: str  # the node computing it in the optimized model: "ortfuse_region_3" or "MatMul 'name'"
    elements: int
    differing: int  # elements not equal (NaN equal to NaN, 0 to -0)
    max_abs: float  # the largest difference (for integers: in steps)
    max_rel: float  # check.compare's normwise relative error (integers: elements differing)
    ok: bool  # within check.compare's default tolerance (fp32 1e-5, fp16 1e-2; integers equal), not --tf32's
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
    outputs: tuple[Diff, ...] = ()  # the graph outputs of the two models run plainly (no tensor returned besides)

    @property
    def origins(self) -> tuple[TensorDiff, ...]:
        return tuple(d for d in self.diffs if d.origin)

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.diffs) and all(d.ok for d in self.outputs)

    def lines(self, limit: Optional[int] = 20) -> list[str]:
        out = [f"{self.compared} shared tensors compared, {len(self.diffs)} differ "
               f"({sum(not d.ok for d in self.diffs)} beyond the default tolerance), {len(self.origins)} origins"]
        shown = [d for d in self.diffs if d.origin or not d.ok]
        out += [d.line() for d in shown[:limit]]
        if limit is not None and len(shown) > limit:
            out.append(f"... and {len(shown) - limit} more")
        out.append("graph outputs, both models run without the traced outputs (ORT fuses otherwise where a tensor "
                   "is returned):")
        out += [f"  {d.line()}" for d in self.outputs]
        traced_fail = {d.name for d in self.diffs if not d.ok}
        if any(not d.ok and d.name not in traced_fail for d in self.outputs):
            out.append("  an output that fails plainly agrees when traced: the difference is in what ORT fuses, "
                       "which returning the tensors prevents")
        return out


def _bitwise(a: np.ndarray, b: np.ndarray) -> int:
    """Elements of a and b that differ (NaNs of any payload equal, and 0 equal to -0: a sign alone changes no
    value an op downstream computes but a division's); all of them if shapes differ."""
    if a.shape != b.shape:
        return max(a.size, b.size)
    if a.dtype.kind in "biu" and b.dtype.kind in "biu":
        return int(np.count_nonzero(a != b))
    x, y = a.astype(np.float64), b.astype(np.float64)  # (fp16, bf16 and float8 convert exactly)
    return int(a.size - np.count_nonzero((x == y) | (np.isnan(x) & np.isnan(y))))


def _label(node: onnx.NodeProto) -> str:
    return node.name if node.domain == "ortfuse" else f"{node.op_type} '{node.name}'"


def _on_device(sess, which: str) -> None:
    """ORT falls back to the CPU EP with a warning where CUDA cannot load: a trace of that compares ORT's CPU
    with itself, which says nothing of the kernels."""
    if sess.get_providers()[:1] != ["CUDAExecutionProvider"]:
        raise InputError(f"{which}: the CUDA execution provider is not active here (providers "
                         f"{sess.get_providers()}): --provider cuda needs a working CUDA setup")


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
    types = _dtypes(src, [t for t, _ in order])
    order = [(t, n) for t, n in order if types.get(t)]  # tensors only (a sequence is not returned)
    names = [t for t, _ in order]
    if not names:
        raise InputError("the two models share no computed tensor to compare (the optimized model is not one "
                         "of the original's)")
    outs = [o.name for o in opt.graph.output]
    label = os.fspath(original) if isinstance(original, (str, os.PathLike)) else "the original model"
    if provider == "cuda":
        from ortfuse.runtime import InferenceSession
        providers: list = [CUDA_PARITY]

        def both(ref_model: onnx.ModelProto, opt_model: onnx.ModelProto, wanted: list[str]) -> tuple[list, list]:
            rs = _reference(ref_model, providers, label)
            os_ = _session(opt_model, providers, cls=InferenceSession)
            _on_device(rs, label)
            _on_device(os_, "the optimized model")
            return (_run(rs, wanted, feeds, original, InputError),
                    _run(os_, wanted, feeds, optimized, ParityError))
    elif provider == "cpu":
        def both(ref_model: onnx.ModelProto, opt_model: onnx.ModelProto, wanted: list[str]) -> tuple[list, list]:
            (rm, rsh), (om, osh) = _on_cpu(ref_model, label), _on_cpu(opt_model, "the optimized model")
            return (_run(_reference(rm, ["CPUExecutionProvider"], label), wanted, feeds, original, InputError, rsh),
                    _run(_session(om, ["CPUExecutionProvider"]), wanted, feeds, optimized, ParityError, osh))
    else:
        raise InputError(f"unknown provider '{provider}': expected cpu or cuda")
    plain_ref, plain_got = both(src, opt, outs)
    plain = tuple(compare(o, g, r) for o, g, r in zip(outs, plain_got, plain_ref))
    ref, got = both(_with_outputs(src, names), _with_outputs(opt, names), names)
    ref_of, got_of = dict(zip(names, ref)), dict(zip(names, got))
    bitwise = {t: _bitwise(got_of[t], ref_of[t]) for t in names}
    producer = {t: n for t, n in order if t in n.output}
    made_by = {o: n for n in opt.graph.node for o in n.output if o}

    def moved_before(n: onnx.NodeProto) -> list[str]:
        """The shared tensors n reads that differ, looking through tensors the rewrite made (a copy, a packed
        weight: not in the original) to the shared ones they are computed from."""
        out, stack, walked = [], list(n.input), set()
        while stack:
            x = stack.pop()
            if not x or x in walked:
                continue
            walked.add(x)
            if x in bitwise:
                if bitwise[x]:
                    out.append(x)
            elif x in made_by and x not in inits:
                stack.extend(made_by[x].input)
        return list(dict.fromkeys(out))

    diffs = []
    for t, n in order:
        if not bitwise[t] or producer.get(t) is not n:  # (a fused node's input: judged where it is computed)
            continue
        a, r = got_of[t], ref_of[t]
        d = compare(t, a, r)
        steps = (float(np.abs(a.astype(np.float64) - r.astype(np.float64)).max(initial=0))
                 if a.dtype.kind in "iu" and a.shape == r.shape else d.max_abs)
        moved = moved_before(n)
        inputs = tuple(f"{x}: {bitwise[x]} of {ref_of[x].size} differ, "
                       f"max rel {compare(x, got_of[x], ref_of[x]).max_rel:.3g}" for x in moved)
        diffs.append(TensorDiff(t, _label(n), int(r.size), bitwise[t], steps, d.max_rel, d.ok, not moved, inputs))
    return Trace(tuple(diffs), len(names), plain)

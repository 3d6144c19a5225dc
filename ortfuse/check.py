"""Parity checks: the optimized model against the original, and each fused kernel (run in CPU
emulation) against ORT on its original sub-graph, on the same random inputs."""
from __future__ import annotations

import dataclasses
import os
import tempfile
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort

from ortfuse import ortvalues
from ortfuse.bf16_shadow import Shadow, computes_in_bf16, shadow
from ortfuse.errors import InputError, ParityError
from ortfuse.feeds import random_feeds
from ortfuse.rewriter import _proto
from ortfuse.rewriter.constant_cones import draws
from ortfuse.rewriter.load import load_model
from ortfuse.rewriter.replace import save_model

# Normwise relative error: max|out - ref| / max(max|ref|, 1e-6). fp32 kernels compute in fp32;
# half-precision outputs are rounded once, where ORT rounds after every op.
RTOL = {"fp32": 1e-5, "fp16": 1e-2}
# fp32 models optimized with tf32 GEMMs (metadata "ortfuse.tf32"): 10-bit mantissa operands, normwise
TF32_RTOL = 5e-3
# Both models on the CUDA EP: fp32 GEMMs and Convs in fp32 (ORT's default runs them on TF32), and each Conv's
# cuDNN algorithm by cuDNN's heuristic, which picks the same one for the same convolution every time (ORT's
# default, EXHAUSTIVE, times the candidates in each session and may pick another in each, summing in another
# order: a quantized CNN's Qs then differ by a step between two runs of the same model).
CUDA_PARITY = ("CUDAExecutionProvider", {"use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC"})
# The smallest scale an output of these ops is measured against. ORT CPU's Sigmoid (MLAS) has an absolute
# error of up to 1e-7 (measured against float64 on [-20, 0]: 23% relative at -15, 0 below -18), so an
# output whose values are all saturated near 0 is compared on the scale of the op's range, not of its values.
RANGE_FLOOR = {"Sigmoid": 0.1}
# fp16 has no relative precision below its normal range: its subnormals are 2^-24 apart, so a value stored
# there is off by up to half that however it was computed. An fp16 tensor is measured on a scale of at least
# that spacing over the tolerance (an error of one subnormal step passes), e.g. MobileNetV2's fp16 zoo model,
# whose random-weight activations sit near 1e-6 (ORT's own fp16 is off its fp32 result by 6% there).
FP16_SUBNORMAL_STEP = 2.0 ** -24
# A half-precision model whose output ORT's own graph optimizations move past the tolerance (a BatchNorm
# with variances near fp16's subnormal range, amplifying every rounding) is held to this multiple of that move.
CONDITIONING_FACTOR = 2.0
# ... but an fp16 kernel output is never held to more than this (one ill-conditioned element widens the
# tolerance of the whole output: past 5e-2 a kernel scaling its result or dropping a K tile could pass)
MAX_CONDITIONED_RTOL = 5e-2
# ... and an fp32 kernel output never to more than this (its sub-graph cancels: x * a + b near 0 after a norm)
MAX_CONDITIONED_RTOL_FP32 = 1e-3
REF_SUFFIX = "__ortfuse_original"  # a QuantizeLinear output of the original model, given the optimized model's


@dataclass(frozen=True)
class Diff:
    name: str
    max_abs: float
    max_rel: float
    tol: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_rel)) and self.max_rel <= self.tol

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g} (tol {self.tol:g})"


@dataclass(frozen=True)
class CheckReport:
    model: tuple[Diff, ...]
    kernels: tuple[tuple[str, tuple[Diff, ...]], ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = ()  # how the comparison was set up, where that is not the plain run

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.model) and all(d.ok for _, ds in self.kernels for d in ds)

    def lines(self) -> list[str]:
        out = [f"note: {n}" for n in self.notes] + ["whole model:"] + [f"  {d.line()}" for d in self.model]
        for node, diffs in self.kernels:
            out += [f"kernel {node}:"] + [f"  {d.line()}" for d in diffs]
        return out


def _is_half(a: np.ndarray) -> bool:
    return a.dtype == np.float16 or a.dtype.name == "bfloat16"


def _tol(a: np.ndarray) -> float:
    return RTOL["fp16"] if _is_half(a) else RTOL["fp32"]


def compare(name: str, out: np.ndarray, ref: np.ndarray, tol: Optional[float] = None, floor: float = 1e-6,
            fp16: bool = False) -> Diff:
    """Normwise relative error: max|out - ref| / max(max|ref|, floor); integers and booleans exactly.
    `fp16`: `out` was stored in fp16 (so is it when either array is fp16): the floor covers one subnormal step."""
    if out.shape != ref.shape:
        return Diff(f"{name} (shape {out.shape} vs {ref.shape})", float("inf"), float("inf"), 0.0)
    if out.dtype == np.bool_ or out.dtype.kind in "iu":
        bad = float(np.count_nonzero(out != ref))
        return Diff(name, bad, bad, 0.0)
    o, r = out.astype(np.float64), ref.astype(np.float64)
    finite = np.isfinite(r)
    # NaN where ORT has NaN, and infinities of the same sign
    if not np.array_equal(finite, np.isfinite(o)) or not np.array_equal(o[~finite], r[~finite], equal_nan=True):
        return Diff(f"{name} (non-finite values differ)", float("inf"), float("inf"), tol or _tol(ref))
    err = np.abs(o[finite] - r[finite])
    max_abs = float(err.max()) if err.size else 0.0
    tol = tol if tol is not None else _tol(ref)
    if (fp16 or out.dtype == np.float16 or ref.dtype == np.float16) and tol > 0:
        floor = max(floor, FP16_SUBNORMAL_STEP / tol)
    scale = max(float(np.abs(r[finite]).max()) if err.size else 0.0, floor)
    return Diff(name, max_abs, max_abs / scale, tol)


def _options(level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
             **config: str) -> ort.SessionOptions:
    """Session options of the check's sessions: ORT quiet (a failing Run is reported once, by _run), `level`, and
    session config entries. The default level is everything but the layout transformations: at ORT_ENABLE_ALL,
    ORT 1.31.1's CPU EP kills the process creating a session for some valid models (torch's
    nn.MultiheadAttention exported and converted to fp16; fuzz seed 1587), which no error handling here can
    report. The reference is ORT's either way."""
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.graph_optimization_level = level
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    return so


def _session(model: onnx.ModelProto, providers: Sequence, so: Optional[ort.SessionOptions] = None,
             cls: type = ort.InferenceSession, disabled: Sequence[str] = ()) -> ort.InferenceSession:
    """A session of `cls` on `model` (`so`: `_options()` where None; `disabled`: ORT graph transformers left
    out): given its bytes, or over 2 GB (which protobuf cannot serialize) a temporary copy written with external
    data, removed once ORT has read it."""
    so = so or _options()
    kw = {"disabled_optimizers": list(disabled)} if disabled else {}
    if not _proto.is_large(model):
        return cls(model.SerializeToString(), so, providers=list(providers), **kw)
    with tempfile.TemporaryDirectory(prefix="ortfuse-check-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        save_model(model, path)  # (streamed: the weights are not copied into a clone first)
        return cls(path, so, providers=list(providers), **kw)


# ORT 1.31.1's TransposeOptimizer (its level-1 instance, and the level-2 one for the CPU EP) on a quantized graph:
# with the QDQ passes off it returns a graph output read between two Transposes with Q/DQ pairs around them in
# the other Transpose's shape (QDQ fuzz seeds 2394, 2534: the input model alone gives [2, 2, 136] for
# [2, 136, 2]); with them on, it puts a Q/DQ pair on a graph output that a Transpose -> Q also reads (seeds 453,
# 603: docs/design.md)
TRANSPOSE_OPTIMIZERS = ("TransposeOptimizer", "TransposeOptimizer_CPUExecutionProvider")


def _reference(model: onnx.ModelProto, providers: Sequence, label: str) -> ort.InferenceSession:
    """A session on the original model; ORT refusing it (an op it has no kernel for) is a question about the
    input, said as such, not a parity failure."""
    try:
        return _session(model, providers)
    except Exception as e:  # ORT raises its own exception types, one per status code
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"ORT cannot load {label}: {msg}") from e


def _inlined(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx.inliner.inline_local_functions(model); the inliner serializes what it is given, which protobuf cannot
    over 2 GB, so it gets the model without initializers (top-level names stay) and they are put back."""
    out = onnx.inliner.inline_local_functions(_proto.without_initializers(model))
    out.graph.initializer.extend(model.graph.initializer)
    return out


def _dtypes(model: onnx.ModelProto, names: Optional[Sequence[str]] = None) -> dict[str, int]:
    """Element types of `names` (default: every node output). ONNX's type inference serves (symbolic shape
    inference of the inlined PP-OCR detector took 28 s); the full inference runs only for a tensor it left
    untyped."""
    from ortfuse.rewriter._infer import infer_dtypes
    from ortfuse.rewriter.shapes import build_graph
    types = infer_dtypes(model)
    wanted = names if names is not None else [o for n in model.graph.node for o in n.output if o]
    if any(n not in types for n in wanted):
        types.update({n: t.dtype for n, t in build_graph(model, {}).tensors.items() if n not in types})
    return types


def _with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of `model` that also returns the named intermediate tensors (typed: see _dtypes)."""
    types = _dtypes(model, names)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for n in names:
        if n not in have:
            m.graph.output.append(onnx.helper.make_tensor_value_info(n, types[n], None))
            have.add(n)
    return m


def _on_cpu(model: onnx.ModelProto, label: str) -> tuple[onnx.ModelProto, Optional[Shadow]]:
    """What ORT's CPU EP runs for `model`: the model, or where it computes in bfloat16 (which ORT's CPU EP
    cannot) its fp32 shadow (ortfuse.bf16_shadow), local functions inlined first."""
    if not computes_in_bf16(model):
        return model, None
    flat = _inlined(model) if model.functions else model
    types = _dtypes(flat)  # (an inference error is the model's, not bf16's)
    try:
        sh = shadow(flat, types, label)
    except InputError as e:
        raise InputError(f"{e}; ORT's CPU EP has no bfloat16 arithmetic, so check it on a GPU (--provider cuda)") from e
    return sh.model, sh


def check_models(original, optimized, provider: str = "cpu", emulate: bool = False,
                 input_shapes: Optional[Mapping[str, Sequence]] = None, seed: int = 0) -> CheckReport:
    """Run both models on the same random inputs; with `emulate`, also run every fused kernel of
    `optimized` in CPU emulation on the real tensors it sees and compare with ORT's sub-graph."""
    src, opt = load_model(original), load_model(optimized)
    (src, drawn), (opt, _) = _seeded(src), _seeded(opt)
    notes = (f"random draws ({drawn}) given fixed seeds in both models, so that their outputs compare (each "
             "session draws anew otherwise)",) if drawn else ()
    feeds = random_feeds(src, _with_pins(pinned_shapes(opt), input_shapes or {}), seed)
    fused = [n for n in opt.graph.node if n.domain == "ortfuse"]
    label = os.fspath(original) if isinstance(original, (str, os.PathLike)) else "the original model"
    if provider == "cuda":
        from ortfuse.runtime import InferenceSession
        providers: list = [CUDA_PARITY]
        ref_sess, out_sess = _reference(src, providers, label), _session(opt, providers, cls=InferenceSession)
        ref_model, out_model, ref_sh, out_sh = src, opt, None, None
    elif provider == "cpu":
        (ref_model, ref_sh), (out_model, out_sh) = _on_cpu(src, label), _on_cpu(opt, "the optimized model")
        providers = ["CPUExecutionProvider"]
        ref_sess, out_sess = _reference(ref_model, providers, label), _session(out_model, providers)
    else:
        raise InputError(f"unknown provider '{provider}': expected cpu or cuda")
    out_names = [o.name for o in opt.graph.output]
    # the original failing is a question of shapes; the optimized model failing where it ran is ours
    ref_vals = dict(zip(out_names, _run(ref_sess, out_names, feeds, original, InputError, ref_sh)))
    out_vals = _run(out_sess, out_names, feeds, optimized, ParityError, out_sh)
    tf32 = any(p.key == "ortfuse.tf32" and p.value == "1" for p in opt.metadata_props)
    tol32 = TF32_RTOL if tf32 else None
    half_fed = _half_fed(src)  # fp32 outputs computed from half-precision data carry its rounding
    floors = _range_floors(src)
    model_diffs = tuple(compare(n, o, ref_vals[n], _tol_for(ref_vals[n], RTOL["fp16"] if n in half_fed else tol32),
                                floors.get(n, 1e-6))
                        for n, o in zip(out_names, out_vals))
    if not all(d.ok for d in model_diffs) and computes_in_bf16(src):
        model_diffs = _judged_against_fp32(model_diffs, src, feeds, out_names, ref_vals, out_vals, floors, half_fed)
    if not all(d.ok for d in model_diffs):
        model_diffs = _judged_by_conditioning(model_diffs, ref_model, ref_sh, providers, feeds,
                                              out_names, ref_vals, out_vals, floors)
    # (the original's: the optimized model's may all be inside fused nodes)
    quantized = any(n.op_type == "QuantizeLinear" for n in _proto.deep_nodes(src.graph.node))
    if not all(d.ok for d in model_diffs) and quantized:
        model_diffs = _judged_step_by_step(model_diffs, (ref_model, ref_sh), (out_model, out_sh, type(out_sess)),
                                           providers, feeds, out_names, out_vals, floors)
    if not all(d.ok for d in model_diffs) and quantized:
        model_diffs = _explained_by_ort_passes(model_diffs, (ref_model, ref_sh), (out_model, out_sh, type(out_sess)),
                                               providers, feeds, out_names, floors)
    del ref_sess, out_sess, ref_model, out_model, src  # (their weights: the probe below holds its own)
    kernels: tuple = ()
    if emulate and fused:
        # ORT CPU on the optimized model with its functions inlined (each fused node's original sub-graph,
        # after the rewriter's canonicalization), also returning every fused node's inputs and outputs
        probe = _with_outputs(_inlined(opt), [t for n in fused for t in (*n.input, *n.output)])
        names = [o.name for o in probe.graph.output]
        floors = _range_floors(probe)
        probe_model, probe_sh = _on_cpu(probe, "the optimized model")
        del probe  # (a bf16 model's shadow holds fp32 copies of its weights: one model in memory, not two)
        # a quantized model's fused sub-graphs computed as written, op by op, as the kernels compute them: ORT's QDQ
        # passes off. Its CPU EP would make a DQ -> Add -> Q a QLinearAdd, which requantizes otherwise (a step
        # apart at times); the CUDA EP has no such fusion, but other passes this turns off do run there
        # (WeightBiasQuantization, QDQ propagation): what they change in the original only `--provider cuda` sees.
        # ORT's other fusions stay on (a kernel computing `1 / x * y` where ORT divides once must show), but not
        # its TransposeOptimizer, which gives a tensor between two Transposes in the other's shape
        so = _options(**{"session.disable_quant_qdq": "1"}) if quantized else None
        values = dict(zip(names, _run(_session(probe_model, ["CPUExecutionProvider"], so,
                                               disabled=TRANSPOSE_OPTIMIZERS if quantized else ()),
                                      names, feeds, optimized, ParityError, probe_sh)))
        del probe_model
        bodies = {f.name: f for f in opt.functions if f.domain == "ortfuse"}
        from ortfuse.customops.attrs import read_launch
        from ortfuse.customops.emulate import compile_emulated_all
        compile_emulated_all(k.source for n in fused for k in read_launch(n).kernels())  # g++ in parallel
        kernels = tuple((n.name, _emulate_node(n, values, tol32, floors, bodies.get(n.op_type))) for n in fused)
    return CheckReport(model_diffs, kernels, notes)


def _seeded(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """`model`, or a copy in which every node that draws random values without a seed has one, derived from its
    first output's name (the same in the original and the optimized model, which never fuses a draw), and a
    count of them by op ("1 RandomUniformLike"; empty where there are none). ORT seeds each such kernel once, so
    two fresh sessions draw the same values."""
    def unseeded(nodes: Sequence[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
        for n in nodes:
            if draws(n.op_type) and n.domain in ("", "ai.onnx") and not any(a.name == "seed" for a in n.attribute) \
                    and (n.op_type != "Dropout" or len(n.input) > 2 and bool(n.input[2])):  # draws in training
                yield n
            for sub in _proto._subgraphs(n):
                yield from unseeded(sub.node)

    def bodies(m: onnx.ModelProto) -> list[Sequence[onnx.NodeProto]]:
        return [m.graph.node, *(f.node for f in m.functions)]

    if not any(True for nodes in bodies(model) for _ in unseeded(nodes)):
        return model, ""
    model = _proto.copy_model(model)
    counts: dict[str, int] = {}
    for nodes in bodies(model):
        for n in list(unseeded(nodes)):
            value = zlib.crc32(n.output[0].encode()) % (1 << 20)
            n.attribute.append(onnx.helper.make_attribute("seed", value if n.op_type == "Dropout" else float(value)))
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return model, ", ".join(f"{k} {op}" for op, k in sorted(counts.items()))


def _judged_against_fp32(diffs: tuple[Diff, ...], src: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                         names: Sequence[str], ref: Mapping[str, np.ndarray], out: Sequence[np.ndarray],
                         floors: Mapping[str, float], half_fed: set[str]) -> tuple[Diff, ...]:
    """Failing outputs of a bf16 model computed from half-precision data (`half_fed`; others keep their
    verdict). Two bf16 computations that round at different places (ORT op by op,
    a kernel once) differ by a few of bf16's steps (2^-8) however right both are: 1e-2 is under three. Both
    are approximations of the model's computation in fp32 (the unrounded shadow, on ORT's CPU EP), so ours
    is held to that: within 1e-2 of it, or within CONDITIONING_FACTOR times ORT's own distance from it."""
    flat = _inlined(src) if src.functions else src
    try:
        twin = shadow(flat, {}, "the original model", rounded=False)
    except InputError as e:  # (on the CUDA EP: ORT's verdict stands, and says why it was not judged again)
        return tuple(d if d.ok or n not in half_fed else dataclasses.replace(d, name=f"{d.name} (bf16, not judged "
                                                                             f"against fp32: {e})")
                     for d, n in zip(diffs, names))
    exact = dict(zip(names, _run(_session(twin.model, ["CPUExecutionProvider"]), names, feeds,
                                 "the original model", InputError, twin)))
    judged = []
    for d, n, o in zip(diffs, names, out):
        if d.ok or n not in half_fed or (ref[n].dtype.kind != "f" and not _is_half(ref[n])):
            judged.append(d)
            continue
        own = compare(n, ref[n], exact[n], 1.0, floors.get(n, 1e-6))
        if not np.isfinite(own.max_rel):  # op by op overflowed where fp32 did not: nothing to scale by
            judged.append(d)
            continue
        tol = max(RTOL["fp16"], CONDITIONING_FACTOR * own.max_rel)
        redo = compare(n, o, exact[n], tol, floors.get(n, 1e-6))
        judged.append(Diff(f"{n} (bf16, vs the model in fp32: ORT's bf16 is {own.max_rel:.3g} from it; "
                           f"{d.max_rel:.3g} from ORT's)", redo.max_abs, redo.max_rel, redo.tol))
    return tuple(judged)


def _judged_by_conditioning(diffs: tuple[Diff, ...], src: onnx.ModelProto, sh: Optional[Shadow],
                            providers: Sequence, feeds: Mapping[str, np.ndarray], names: Sequence[str],
                            ref: Mapping[str, np.ndarray], out: Sequence[np.ndarray],
                            floors: Mapping[str, float]) -> tuple[Diff, ...]:
    """Failing outputs of an ill-conditioned model: where ORT's own graph optimizations (the session's, ORT_ENABLE_EXTENDED on
    the CPU, against ORT_DISABLE_ALL, the same model and inputs) change a half-precision output by more than its tolerance, the
    output cannot be held to that tolerance; ours is then held to CONDITIONING_FACTOR times ORT's change."""
    so = _options(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    plain = dict(zip(names, _run(_session(src, providers, so), names, feeds, "the original model", InputError, sh)))
    judged = []
    for d, n, o in zip(diffs, names, out):
        own = compare(n, plain[n], ref[n], d.tol, floors.get(n, 1e-6))
        if d.ok or own.ok or not _is_half(ref[n]):
            judged.append(d)
            continue
        redo = compare(n, o, ref[n], CONDITIONING_FACTOR * own.max_rel, floors.get(n, 1e-6))
        judged.append(Diff(f"{n} (ill-conditioned: ORT's own graph optimizations change it by {own.max_rel:.3g})",
                           redo.max_abs, redo.max_rel, redo.tol))
    return tuple(judged)


def _quantizers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """The main graph's QuantizeLinear nodes by output, but for those whose output the graph returns."""
    returned = {o.name for o in model.graph.output}
    return {n.output[0]: n for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.domain in ("", "ai.onnx") and n.output[0] not in returned}


def _judged_step_by_step(diffs: tuple[Diff, ...], ref: tuple, out: tuple, providers: Sequence,
                         feeds: Mapping[str, np.ndarray], names: Sequence[str], out_vals: Sequence[np.ndarray],
                         floors: Mapping[str, float]) -> tuple[Diff, ...]:
    """Failing outputs of a quantized model, judged from one quantized tensor to the next. A QuantizeLinear
    (ORT's in both models) rounds its float input to a step: where a kernel's fp32 result is within its
    tolerance of ORT's but on the other side of a rounding boundary, the quantized tensor is a step off there,
    and everything computed from it differs by that step, however right the kernel. So:
    - the original model runs again with each such tensor (a QuantizeLinear's output both models have) taken
      from the optimized model's run instead of its own QuantizeLinear;
    - every QuantizeLinear's float input must then agree within the tolerance (the optimized model's value
      against the original's, both computed from the same quantized tensors before it), and the quantized
      values a step apart at most;
    - and the failing output must agree within the tolerance with the original's, given those tensors.
    The optimized model's run returning its quantized tensors must give the outputs its plain run gave (within
    the tolerance: returning a tensor can change what ORT's quantization passes do), else the verdict stands."""
    (ref_model, ref_sh), (out_model, out_sh, cls) = ref, out
    qs, ref_qs = _quantizers(out_model), _quantizers(ref_model)
    cut = {t: ref_qs[t] for t in qs if t in ref_qs}
    if not cut or ref_sh is not None or out_sh is not None:
        return diffs
    floats = {t: (qs[t].input[0], n.input[0]) for t, n in cut.items()}  # (optimized's, original's) Q input
    wanted = [*names, *cut, *(x for x, _ in floats.values())]
    try:
        got = dict(zip(wanted, _run(_session(_with_outputs(out_model, wanted[len(names):]), providers, cls=cls),
                                    wanted, feeds, "the optimized model", ParityError)))
    except (InputError, ParityError):
        return diffs
    if not all(compare(n, got[n], o, d.tol, floors.get(n, 1e-6)).ok for n, o, d in zip(names, out_vals, diffs)):
        return diffs
    pinned = _proto.copy_model(ref_model)
    for n in pinned.graph.node:
        if n.op_type == "QuantizeLinear" and n.output and n.output[0] in cut:
            t = n.output[0]
            n.output[0] = t + REF_SUFFIX
            dtype = onnx.helper.np_dtype_to_tensor_dtype(got[t].dtype)
            pinned.graph.input.append(onnx.helper.make_tensor_value_info(t, dtype, list(got[t].shape)))
            pinned.graph.output.append(onnx.helper.make_tensor_value_info(t + REF_SUFFIX, dtype, None))
    ref_wanted = [*names, *(t + REF_SUFFIX for t in cut), *(x for _, x in floats.values())]
    pinned = _with_outputs(pinned, ref_wanted[len(names):])
    pinned_feeds = {**feeds, **{t: got[t] for t in cut}}
    try:
        given = dict(zip(ref_wanted, _run(_session(pinned, providers), ref_wanted, pinned_feeds, "the original model",
                                          InputError)))
    except (InputError, ParityError):
        return diffs
    flips, bad = 0, ""
    for t, (x_out, x_ref) in floats.items():
        d = compare(x_out, got[x_out], given[x_ref])
        steps = np.abs(got[t].astype(np.int64) - given[t + REF_SUFFIX].astype(np.int64))
        if not d.ok or steps.max(initial=0) > 1:
            bad = bad or (f"the input of QuantizeLinear '{cut[t].name or t}': max rel {d.max_rel:.3g} (tol {d.tol:g}), "
                          f"{int(steps.max(initial=0))} steps apart at most")
        flips += int(np.count_nonzero(steps))
    judged = []
    for d, n, o in zip(diffs, names, out_vals):
        if d.ok:
            judged.append(d)
            continue
        redo = compare(n, o, given[n], d.tol, floors.get(n, 1e-6))
        if bad:
            judged.append(dataclasses.replace(d, name=f"{n} (from one quantized tensor to the next, {bad})"))
        elif not redo.ok:
            judged.append(dataclasses.replace(d, name=f"{n} (max rel {redo.max_rel:.3g} even given the optimized "
                                                      f"model's quantized tensors)"))
        else:
            judged.append(Diff(f"{n} (quantized: given the optimized model's {len(cut)} quantized tensors, of which "
                               f"{flips} elements are a step off where their float inputs agree; {d.max_rel:.3g} "
                               f"from the original's own)", redo.max_abs, redo.max_rel, redo.tol))
    return tuple(judged)


def _explained_by_ort_passes(diffs: tuple[Diff, ...], ref: tuple, out: tuple, providers: Sequence,
                             feeds: Mapping[str, np.ndarray], names: Sequence[str],
                             floors: Mapping[str, float]) -> tuple[Diff, ...]:
    """Failing outputs of a quantized model, run again in both models with ORT's DoubleQDQPairsRemover off
    (`rewriter.qdq`: ORT merges a chain of one model at a new scale, which `optimize` names where it cannot keep
    the input's merges), then with its TransposeOptimizer off (it puts a Q/DQ pair on a graph output a Transpose
    -> Q also reads, where a Reshape in the other model hid the pattern: `TRANSPOSE_OPTIMIZERS`, QDQ fuzz seed
    603). An output that then agrees still fails, as it differs under ORT's defaults; its line says where the
    difference comes from."""
    attempts = ((_options(**{"session.disable_double_qdq_remover": "1"}), (),
                 "ORT requantizes a quantize/dequantize chain of one model only, at a new scale: with its "
                 "DoubleQDQPairsRemover off in both, max rel {:.3g}; see optimize's report"),
                (_options(), TRANSPOSE_OPTIMIZERS,
                 "ORT's TransposeOptimizer rewrites one model otherwise than the other: with it off in both, max "
                 "rel {:.3g} (its Q/DQ pairs on a graph output: docs/design.md)"))
    (ref_model, ref_sh), (out_model, out_sh, cls) = ref, out
    judged = list(diffs)
    todo = {i for i, d in enumerate(diffs) if not d.ok}
    for so, disabled, why in attempts:
        if not todo:
            break
        try:
            again_ref = _run(_session(ref_model, providers, so, disabled=disabled), names, feeds, "the original model",
                             InputError, ref_sh)
            again_out = _run(_session(out_model, providers, so, cls, disabled), names, feeds, "the optimized model",
                             ParityError, out_sh)
        except (InputError, ParityError):  # (the verdict stands as it is)
            continue
        for i in sorted(todo):
            d, n = judged[i], names[i]
            again = compare(n, again_out[i], again_ref[i], d.tol, floors.get(n, 1e-6))
            if again.ok:
                judged[i] = dataclasses.replace(d, name=f"{d.name} ({why.format(again.max_rel)})")
                todo.discard(i)
    return tuple(judged)


def pinned_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Graph-input dims that `model` fixes (`optimize --input-shape` pins them); None where symbolic."""
    inits = {i.name for i in model.graph.initializer}
    return {vi.name: [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                      for d in vi.type.tensor_type.shape.dim]
            for vi in model.graph.input if vi.name not in inits}


def _run(sess: ort.InferenceSession, names: Sequence[str], feeds: Mapping[str, np.ndarray],
         model, error: type, sh: Optional[Shadow] = None) -> list:
    """The named outputs of `sess` on `feeds` (any dtype, bf16 included); `sh`: the session runs that shadow."""
    try:
        if sh is not None:
            return [sh.restored(n, v) for n, v in zip(names, ortvalues.run(sess, names, sh.feeds(feeds)))]
        return ortvalues.run(sess, names, feeds)
    except Exception as e:  # ORT raises its own exception types, one per status code
        shapes = ", ".join(f"{k}:{'x'.join(map(str, v.shape))}" for k, v in feeds.items())
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = os.fspath(model) if isinstance(model, (str, os.PathLike)) else "the model"
        hint = " (give the shapes it expects with --input-shape)" if error is InputError else ""
        raise error(f"ORT could not run {where} on random inputs {shapes}{hint}: {msg}") from e


def _with_pins(pinned: Mapping[str, Sequence], given: Mapping[str, Sequence]) -> dict[str, list]:
    """The user's shapes over the optimized model's pinned dims (a symbolic dim given takes the pin);
    a given dim that contradicts a pin is an error."""
    shapes = {k: list(v) for k, v in pinned.items()}
    for name, dims in given.items():
        fixed = pinned.get(name) or [None] * len(dims)
        if len(fixed) != len(dims) or any(f is not None and isinstance(g, int) and f != g for f, g in zip(fixed, dims)):
            want = "x".join("?" if f is None else str(f) for f in fixed)
            raise InputError(f"--input-shape {name}:{'x'.join(map(str, dims))} contradicts the optimized "
                             f"model, which was compiled for {name}:{want}")
        shapes[name] = [g if isinstance(g, int) else f for f, g in zip(fixed, dims)]
    return shapes


def _range_floors(model: onnx.ModelProto) -> dict[str, float]:
    """Scale floors (RANGE_FLOOR) for the tensors the listed ops produce."""
    return {o: RANGE_FLOOR[n.op_type] for n in model.graph.node if n.op_type in RANGE_FLOOR for o in n.output}


_HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _half_fed(model: onnx.ModelProto) -> set[str]:
    """Tensors computed from fp16/bf16 data: half graph inputs, initializers and Constants, Cast-to-half
    outputs, and everything downstream of them."""
    g = model.graph
    fed = {v.name for v in g.input if v.type.tensor_type.elem_type in _HALF}
    return _fed_by(g.node, fed | {t.name for t in g.initializer if t.data_type in _HALF})


def _fed_by(nodes: Sequence[onnx.NodeProto], seeds: set[str], types: tuple[int, ...] = _HALF) -> set[str]:
    """`seeds` and the tensors computed from them or from a Cast to, or a Constant of, one of `types`; not through
    a Shape or Size, whose values are a tensor's dims (a run-time Expand target read from a half input)."""
    fed, grew = set(seeds), True
    while grew:  # (to a fixed point: a function body need not be in topological order)
        grew = False
        for n in nodes:
            if n.op_type in ("Shape", "Size"):
                continue
            to_half = n.op_type == "Cast" and any(a.name == "to" and a.i in types for a in n.attribute)
            const_half = n.op_type == "Constant" and any(a.name == "value" and a.t.data_type in types
                                                         for a in n.attribute)
            outs = [o for o in n.output if o]
            if (to_half or const_half or any(t in fed for t in n.input)) and not fed.issuperset(outs):
                fed.update(outs)
                grew = True
    return fed


def _tol_for(ref: np.ndarray, tol32: Optional[float]) -> Optional[float]:
    return tol32 if tol32 is not None and ref.dtype == np.float32 else None


def _fp32_twin(body: onnx.FunctionProto, inputs: Sequence[np.ndarray], outputs: Sequence[str]) -> list[np.ndarray]:
    """A fused node's sub-graph run by ORT CPU in fp32 on its (half-precision) inputs: its fp32 shadow, where
    fp16/bf16 inputs, weights, Constants and Casts are fp32, so no intermediate is rounded."""
    feeds = dict(zip(body.input, inputs))
    m = _body_model(body, feeds)
    twin = shadow(m, {}, f"function {body.name}", rounded=False, types=_HALF)
    got = dict(zip(body.output, _session(twin.model, ["CPUExecutionProvider"]).run(None, twin.feeds(feeds))))
    return [got[o] for o in outputs]


def _body_model(body: onnx.FunctionProto, feeds: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A model of a fused node's sub-graph with inputs typed as `feeds`."""
    ins = [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in feeds.items()]
    return onnx.helper.make_model(onnx.helper.make_graph(list(body.node), "body", ins,
                                                         [onnx.ValueInfoProto(name=o) for o in body.output]),
                                  opset_imports=list(body.opset_import), ir_version=10)


def _judged_against_fp64(d: Diff, out: np.ndarray, ref: np.ndarray, exact: np.ndarray, floor: float) -> Diff:
    """An fp32 kernel output `out` that failed against ORT's `ref`, judged against `exact` (fp64) element by
    element: |out - exact| within d.tol of the scale plus CONDITIONING_FACTOR |ref - exact| (at most
    MAX_CONDITIONED_RTOL_FP32 of the scale). Unchanged where ORT is within the tolerance's half of exact
    everywhere (no element of it is ill-conditioned) or either has non-finite values."""
    o, r, x = out.astype(np.float64), ref.astype(np.float64), exact.astype(np.float64)
    if o.shape != x.shape or not (np.isfinite(o).all() and np.isfinite(r).all() and np.isfinite(x).all()):
        return d
    scale = max(float(np.abs(x).max()) if x.size else 0.0, floor)
    own = np.abs(r - x)
    if CONDITIONING_FACTOR * float(own.max()) <= d.tol * scale:
        return d
    allowance = np.minimum(CONDITIONING_FACTOR * own, MAX_CONDITIONED_RTOL_FP32 * scale)
    excess = float(np.max(np.abs(o - x) - allowance)) / scale
    return Diff(f"{d.name} (vs fp64, element by element: ORT's fp32 is itself up to {float(own.max()) / scale:.3g} "
                f"from it; ours {d.max_rel:.3g} from ORT's)", float(np.abs(o - x).max()), max(excess, 0.0), d.tol)


def _fp64_twin(body: onnx.FunctionProto, inputs: Sequence[np.ndarray], outputs: Sequence[str]) -> list[np.ndarray]:
    """A fused node's fp32 sub-graph run by onnx's reference evaluator in fp64: fp32 inputs, Constants,
    ConstantOfShape values and Casts to fp32 made fp64 (its Erf stays fp32-accurate: onnx's rounds to fp32)."""
    feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in zip(body.input, inputs)}
    m = _body_model(body, feeds)
    for n in m.graph.node:
        if n.op_type == "ConstantOfShape" and not n.attribute:  # (its default value is an fp32 zero)
            n.attribute.append(onnx.helper.make_attribute("value", onnx.numpy_helper.from_array(np.zeros(1))))
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == onnx.TensorProto.FLOAT:
                a.t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
            elif n.op_type == "Constant" and a.name in ("value_float", "value_floats"):
                value = np.array(a.f if a.name == "value_float" else list(a.floats), np.float64)
                a.CopyFrom(onnx.helper.make_attribute("value", onnx.numpy_helper.from_array(value)))
            elif n.op_type == "Cast" and a.name == "to" and a.i == onnx.TensorProto.FLOAT:
                a.i = onnx.TensorProto.DOUBLE
    return _evaluated(m, body, feeds, outputs)


def _op_by_op(body: onnx.FunctionProto, inputs: Sequence[np.ndarray], outputs: Sequence[str]) -> list[np.ndarray]:
    """A fused node's sub-graph run by onnx's reference evaluator, which rounds every half-precision
    intermediate to its type as the CUDA EP stores it (ORT's CPU EP computes half chains in fp32)."""
    feeds = dict(zip(body.input, inputs))
    return _evaluated(_body_model(body, feeds), body, feeds, outputs)


def _evaluated(m: onnx.ModelProto, body: onnx.FunctionProto, feeds: Mapping[str, np.ndarray],
               outputs: Sequence[str]) -> list[np.ndarray]:
    """`outputs` (of `body`) of `m`, a model of `body`, run by onnx's reference evaluator on `feeds`."""
    from onnx.reference import ReferenceEvaluator
    with np.errstate(all="ignore"):  # a Cast of inf to an integer, as the model itself may do
        got = dict(zip(body.output, ReferenceEvaluator(m).run(None, feeds)))
    return [np.asarray(got[o]) for o in outputs]


def _op_by_op_drift(body: onnx.FunctionProto, inputs: Sequence[np.ndarray], output: str, exact: np.ndarray,
                    floor: float) -> float:
    """How far the op-by-op half-precision result of `output` is from its fp32 computation `exact` (0 where the
    reference evaluator cannot run the sub-graph, or overflows)."""
    try:
        (got,) = _op_by_op(body, inputs, [output])
    except Exception:  # noqa: BLE001 -- an op or type the reference evaluator lacks: no allowance
        return 0.0
    drift = compare(output, np.asarray(got, np.float32), exact, 1.0, floor).max_rel
    return drift if np.isfinite(drift) else 0.0


def _emulate_node(node: onnx.NodeProto, values: Mapping[str, np.ndarray],
                  tol32: Optional[float] = None, floors: Mapping[str, float] = {},
                  body: Optional[onnx.FunctionProto] = None) -> tuple[Diff, ...]:
    from ortfuse.customops.attrs import launch_blocks, read_launch
    from ortfuse.customops.emulate import compile_emulated
    from ortfuse.customops.target import for_cc
    launch = read_launch(node)
    inputs = [np.ascontiguousarray(values[t]) for t in node.input]
    launch = launch.pick([int(inputs[i].shape[axis]) for i, axis in launch.sym_dims])  # as the library does
    # per output: computed from half-precision data (half inputs, or a Cast to half in the body), and from bf16
    if body is not None:
        half_in = {t for t, a in zip(body.input, inputs) if _is_half(a)}
        bf16_in = {t for t, a in zip(body.input, inputs) if a.dtype.name == "bfloat16"}
        half_fed, bf16_fed = _fed_by(body.node, half_in), _fed_by(body.node, bf16_in, (onnx.TensorProto.BFLOAT16,))
        fed = [o in half_fed for o in body.output]
        fed_bf16 = [o in bf16_fed for o in body.output]
    else:
        fed = [any(_is_half(a) for a in inputs)] * len(node.output)
        fed_bf16 = [any(a.dtype.name == "bfloat16" for a in inputs)] * len(node.output)
    dims = launch.dims([a.shape for a in inputs])
    outs = [np.zeros(s, dtype=onnx.helper.tensor_dtype_to_np_dtype(dt))
            for s, dt in zip(launch.output_shapes(dims), launch.out_dtypes)]
    for o in outs:  # poison, so an element the kernel never writes shows up
        if o.dtype.kind == "f":
            o.fill(np.nan)
    grid = launch.grid(dims)
    if grid:
        # clusters (split-K, a row split) and persistent grids as the native library would launch them on the
        # newest compiled arch
        sms = for_cc(max(launch.archs)).sm_count if launch.archs else 0
        blocks, cluster = launch_blocks(grid, launch.split_k, launch.blocks_per_sm, sms, launch.row_cluster,
                                        launch.multicast)
        compile_emulated(launch.source).launch(launch.entry, blocks, launch.block, [*inputs, *outs], dims,
                                                 launch.smem, cluster, launch.arg_align, tma=launch.tma)
    # fp32 outputs computed from half-precision data carry its rounding
    diffs = [compare(t, o, values[t], _tol_for(values[t], RTOL["fp16"] if f else tol32), floors.get(t, 1e-6))
             for t, o, f in zip(node.output, outs, fed)]
    if body is not None and any(fed):
        # a discrete result (an integer or bool) of a half-precision chain (from half inputs, or from integers
        # cast to half: T5's relative position buckets): the kernel rounds op by op as the CUDA EP does, ORT's
        # CPU EP computes the chain in fp32; equal to the op-by-op reference, it passes
        discrete = [i for i, (d, o) in enumerate(zip(diffs, outs)) if fed[i] and not d.ok and o.dtype.kind in "biu"]
        try:
            refs = _op_by_op(body, inputs, [body.output[i] for i in discrete]) if discrete else []
        except Exception:  # an op or type the reference evaluator lacks: ORT's verdict stands
            refs = []
        for i, r in zip(discrete, refs):
            d = compare(node.output[i], outs[i], r.astype(outs[i].dtype))
            n = int(np.count_nonzero(outs[i] != values[node.output[i]]))
            diffs[i] = dataclasses.replace(d, name=f"{d.name} (vs op-by-op half precision; ORT's CPU EP, in fp32, "
                                                   f"differs in {n} elements, by up to {diffs[i].max_abs:.0f})")
    single = [i for i, (d, o) in enumerate(zip(diffs, outs)) if not d.ok and not fed[i] and o.dtype == np.float32]
    if single and body is not None:
        # an fp32 output whose sub-graph cancels (a normalized value scaled and shifted to near 0, then a Relu
        # that keeps only those): ORT's op-by-op fp32 is itself that far from the exact result there, and a
        # kernel rounding elsewhere cannot be held closer to ORT's than ORT is to it. Judged against the
        # sub-graph in fp64 (onnx's reference evaluator), element by element: within the tolerance of the
        # output's scale plus CONDITIONING_FACTOR times ORT's own distance there, that allowance at most
        # MAX_CONDITIONED_RTOL_FP32 of the scale (so a sub-graph ill-conditioned in one channel excuses nothing
        # in the others).
        try:
            exact = _fp64_twin(body, inputs, [body.output[i] for i in single])
        except Exception:  # noqa: BLE001 -- an op the reference evaluator lacks in fp64: ORT's verdict stands
            exact = []
        for i, r in zip(single, exact):
            diffs[i] = _judged_against_fp64(diffs[i], outs[i], values[node.output[i]], r,
                                            floors.get(node.output[i], 1e-6))
    half = [i for i, (d, o) in enumerate(zip(diffs, outs))
            if not d.ok and (_is_half(o) or (fed[i] and o.dtype == np.float32))]  # (fp32: cast from half)
    if half and body is not None:
        # ORT CPU rounds every fp16 intermediate (a variance as E[x^2] - E[x]^2 loses digits that way); the
        # kernel rounds once. The contract is fp16 within 1e-2 of the fp32 computation: judge against that.
        # A half-precision result gets no closer than its op-by-op result where a kernel must round an
        # intermediate too (bf16's 8 bits; attention's probabilities; a GEMM's fp16 operands, which a
        # cancellation after it can amplify past 1e-2): it is held to 1e-2 or to CONDITIONING_FACTOR times that
        # result's own distance from fp32, whichever is larger. For bf16 that result is ORT's (op by op on the
        # CPU too, in the fp32 shadow); for fp16 it is the reference evaluator's (ORT's CPU EP computes an fp16
        # chain of ops it lacks in fp32, skipping the roundings the CUDA EP makes), and at most MAX_CONDITIONED_RTOL.
        ref = _fp32_twin(body, inputs, [body.output[i] for i in half])
        for i, r in zip(half, ref):
            t, floor = node.output[i], floors.get(node.output[i], 1e-6)
            tol, why = RTOL["fp16"], {"float16": "ORT's fp16"}.get(outs[i].dtype.name, "op by op in half precision, it")
            if fed_bf16[i] or outs[i].dtype.name == "bfloat16":
                drift = compare(t, values[t].astype(np.float32), r, 1.0, floor).max_rel
                drift = drift if np.isfinite(drift) else 0.0  # (op by op overflowed: 1e-2 stands)
                tol, why = max(tol, CONDITIONING_FACTOR * drift), f"op by op in bf16 (itself {drift:.3g} from fp32), it"
            elif not compare(t, outs[i].astype(np.float32), r, tol, floor, fp16=outs[i].dtype == np.float16).ok:
                drift = _op_by_op_drift(body, inputs, body.output[i], r, floor)
                if CONDITIONING_FACTOR * drift > tol:
                    tol = min(CONDITIONING_FACTOR * drift, MAX_CONDITIONED_RTOL)
                    why = f"op by op in fp16 (itself {drift:.3g} from fp32), ORT's"
            d = compare(t, outs[i].astype(np.float32), r, tol, floor, fp16=outs[i].dtype == np.float16)
            diffs[i] = dataclasses.replace(d, name=f"{d.name} (vs fp32: {why} differs by {diffs[i].max_rel:.3g})")
    return tuple(diffs)

"""Which nodes of a model ONNX Runtime's graph optimizer fuses into one node when a session starts: a GELU
written as Div, Erf, Add, Mul, Mul becomes one Gelu (with the bias Add before it one BiasGelu); an Add before a
LayerNormalization one SkipLayerNormalization; MatMul and a scaling Mul one FusedMatMul; MatMul and a bias Add
one Gemm; `1 / x * y` one Div. The fused kernel rounds otherwise than the ops it replaces, which parity tolerates
in float, but not where a quantizer reads the value: a kernel of ours taking one of those ops leaves ORT the rest
unfused in the output, where the input ran them fused (`search.legal.inexact_before_quantizers`).

Those fusions are ORT's to know, so ORT is asked: the model as a probe optimized on the CPU EP at the extended
level, with the CPU EP's own fusions disabled (its QDQ node units, MatMulInteger's, Gemm's activation: the CUDA
EP makes none of them, and they would take nodes the CUDA EP's fusions take). A node of the optimized model that
stands for two or more computing nodes of the input (those whose results it no longer has: not shape arithmetic,
copies of a name, constants or quantizers) is a fusion. The CPU EP's fusions are the CUDA EP's at this level
but for a few only the CUDA EP makes (BiasSoftmax: `legal._orts_pair`) and the activations ORT's CUDA Conv does
not take (Sigmoid, ...: reported, which keeps more with ORT than needed). The weights go into the probe up to
MAX_PROBE_WEIGHT_BYTES (ORT folds a Mul or a BatchNormalization into a Conv's constant weight); a larger model's
are made inputs, and such folds are not seen.

Where a session really gets the CUDA EP (a GPU at optimize time), the probe runs there instead (`provider="cuda"`),
nothing disabled: every fusion as the user's session makes it, the CPU EP's own ones on the nodes ORT places on
the CPU included (quantize_dynamic's DynamicQuantizeLinear and uint8 MatMulInteger have no CUDA kernel in
1.31.1; MatMulIntegerToFloatFusion, which the others build on, starts from the float Mul after them, which the
CUDA EP runs, so the stand-in's disabling them should agree: tests/rewriter/test_ort_fusions_gpu.py checks it).
The saved model of a CUDA session holds its copies between devices (MemcpyToHost / MemcpyFromHost), dropped
before the units are read."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import onnx

from ortfuse.rewriter import _proto
from ortfuse.rewriter._infer import infer_dtypes
from ortfuse.rewriter.weights import filled, is_stub

MAX_PROBE_WEIGHT_BYTES = 1 << 29
# the CPU EP's own fusions (ORT's graph_transformer_utils.cc registers them for `cpu_ep` alone)
_CPU_ONLY = ("QDQSelectorActionTransformer", "QDQS8ToU8Transformer", "GemmActivationFusion",
             "MatMulIntegerToFloatFusion", "DynamicQuantizeMatMulFusion", "NhwcTransformer", "NchwcTransformer")
# nodes that count for no computation of a fusion: constants, copies of a name, quantizers (a Q/DQ pair that a
# transpose is pushed through), data movement (a Transpose another one cancels, a Reshape ORT rewrote)
_NO_COMPUTE = frozenset({"Constant", "Identity", "Shape", "Size", "QuantizeLinear", "DequantizeLinear",
                         "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Cast"})
_MATRIX = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "ConvInteger"})
_POOLS = frozenset({"MaxPool", "AveragePool"})
_INTEGERS = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL})

Units = tuple[tuple[str, frozenset[str]], ...]


def _op(n: onnx.NodeProto) -> tuple[str, str]:
    return ("" if n.domain in ("", "ai.onnx") else n.domain, n.op_type)


def ort_fusion_units(model: onnx.ModelProto, dtypes: Optional[Mapping[str, int]] = None,
                     provider: str = "cpu") -> Union[Units, str]:
    """(the fusion, the first outputs of the input's nodes it stands for) for each fusion ORT's optimizer makes in
    `model`; or why ORT refused the probe (nothing is known then). `dtypes`: the element type of each tensor
    (shape inference's, where not given). `provider`: "cpu" (the CPU EP standing in for the CUDA EP) or "cuda"
    (the CUDA EP itself; a session that does not get it is a refusal)."""
    import onnxruntime as ort

    if provider not in ("cpu", "cuda"):
        raise ValueError(f"unknown provider {provider!r}: expected cpu or cuda")

    probe = _proto.copy_model(model)
    inits = probe.graph.initializer
    stubs = [t for t in inits if is_stub(t)]
    inline = sum(_proto.dims_bytes(t.data_type, tuple(t.dims)) or 0 for t in stubs) <= MAX_PROBE_WEIGHT_BYTES
    kept = [filled(t) if is_stub(t) and inline else t for t in inits if inline or not is_stub(t)]
    del inits[:]
    inits.extend(kept)
    if not inline:
        listed = {i.name for i in probe.graph.input}  # (before IR 4, initializers are listed as inputs too)
        probe.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                 for t in stubs if t.name not in listed)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.log_severity_level = 4
    with tempfile.TemporaryDirectory(prefix="ortfuse-fusions-") as tmp:
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        try:
            if provider == "cuda":
                sess = ort.InferenceSession(probe.SerializeToString(), so,
                                            providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                                            enable_fallback=0)
                got = sess.get_providers()
                del sess  # (its copy of the weights on the device)
                if "CUDAExecutionProvider" not in got:
                    return "the session did not get the CUDA execution provider"
            else:
                ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"],
                                     disabled_optimizers=list(_CPU_ONLY))
            done = onnx.load(so.optimized_model_filepath, load_external_data=False)
        except Exception as e:  # noqa: BLE001 (ORT refusing the probe: its message says why)
            return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _units(model, done, infer_dtypes(model) if dtypes is None else dtypes)


_COPIES = frozenset({"MemcpyToHost", "MemcpyFromHost"})


def _without_copies(done: onnx.ModelProto, names: set[str]) -> None:
    """`done` without the copies between devices a CUDA session inserts, in place: each joins the two names it
    links under the one the input model has (`names`: ORT renames the writer's output where the copy writes
    the input's name), so a fused node is found by what it writes and reads."""
    rename: dict[str, str] = {}
    copies = [n for n in done.graph.node if n.op_type in _COPIES]
    for n in copies:
        src, dst = n.input[0], n.output[0]
        if dst in names:
            rename[src] = dst
        else:
            rename[dst] = src

    def final(x: str) -> str:
        seen = set()
        while x in rename and x not in seen:  # (copies in a chain)
            seen.add(x)
            x = rename[x]
        return x
    keep = [n for n in done.graph.node if n.op_type not in _COPIES]
    for n in keep:
        n.input[:] = [final(x) if x else x for x in n.input]
        n.output[:] = [final(x) if x else x for x in n.output]
    del done.graph.node[:]
    done.graph.node.extend(keep)


def _units(model: onnx.ModelProto, done: onnx.ModelProto, dtypes: Mapping[str, int]) -> Units:
    """The fusions `done` (the optimized probe) makes of `model`'s nodes: each node of `done` with the input's
    nodes whose results it no longer has, walking back from what it writes (see the module's docstring)."""
    writer = {o: n for n in model.graph.node for o in n.output if o}
    _without_copies(done, set(writer) | {i.name for i in model.graph.input})
    present = {o for n in done.graph.node for o in n.output} | {t.name for t in done.graph.initializer} | \
        {i.name for i in done.graph.input}
    units = []
    for n in done.graph.node:
        if n.op_type == "Cast":  # (the CPU EP's casts around a half-precision op it lacks: no fusion)
            continue
        unit: dict[str, onnx.NodeProto] = {}
        todo = [writer[o] for o in n.output if o in writer]
        while todo:
            w = todo.pop()
            key = next((o for o in w.output if o), "")
            if key in unit:
                continue
            unit[key] = w
            todo.extend(writer[x] for x in w.input if x and x in writer and x not in present)
        if not unit:
            continue
        computing = {k for k, w in unit.items() if w.op_type not in _NO_COMPUTE and w.domain in ("", "ai.onnx")
                     and not all(dtypes.get(o) in _INTEGERS for o in w.output if o)}
        if _op(n) != _op(writer[next(o for o in n.output if o in writer)]):  # a new op: Gelu, Gemm, Div of a Mul
            if len(computing) > 1:
                what = n.op_type if n.op_type not in _NO_COMPUTE else \
                    " + ".join(sorted(unit[k].op_type for k in computing))
                units.append((what, frozenset(computing)))
        elif n.op_type in _MATRIX | _POOLS:  # the same op taking a Transpose (transA) or a Pad (its pads)
            folded = {k for k, w in unit.items() if w.op_type in ("Transpose", "Pad")}
            if folded:
                units.append((n.op_type, frozenset(folded | {next(o for o in n.output if o in writer)})))
        # (else the same op, where ORT moved nodes around it: QDQ propagation's Q/DQ pair before a Slice renames
        # the tensor the Slice read, which is no fusion)
    return tuple(units)


def with_splits(units: Units, g_nodes: Sequence[onnx.NodeProto], splits: Sequence) -> Units:
    """`units` with the ORT ops ortfuse split into standard ops (`rewriter.contrib`: a Gelu, a
    SkipLayerNormalization, ...), each one kernel in the input, as units of their split nodes in `g_nodes` (not
    ONNX's Split, whose Slices copy); units sharing a node merge (ORT made a BiasGelu of an Add and a Gelu
    the input already had)."""
    first = {n.name: next((o for o in n.output if o), "") for n in g_nodes if n.name}
    sets = [(op, set(names)) for op, names in units]
    for s in splits:
        if s.original.op_type != "Split":
            names = {first[x] for part in s.parts for x in part.names if first.get(x)}
            sets.append((s.original.op_type, names))
    merged: list[tuple[str, set[str]]] = []
    for op, names in sets:
        for other in [m for m in merged if m[1] & names]:
            merged.remove(other)
            op, names = f"{other[0]} + {op}", other[1] | names
        merged.append((op, names))
    return tuple((op, frozenset(names)) for op, names in merged if len(names) > 1)

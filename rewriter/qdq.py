"""Quantize/dequantize nodes keep the readers ORT's QDQ passes count, as the input has them.

ORT rewrites a quantized model by its QuantizeLinear and DequantizeLinear nodes' readers. DoubleQDQPairsRemover
(ORT_ENABLE_BASIC and above, every execution provider) turns Q1 -> DQ1 -> Q2 -> DQ2 into Q1 -> DQ2 where Q1,
DQ1 and Q2 have no other reader; where the pairs' scales or zero points differ, it requantizes at a new scale
covering both ranges, which rounds otherwise. The QDQ selectors (ORT_ENABLE_EXTENDED, CPU EP) make DQ -> op -> Q
one quantized kernel (QLinearSoftmax, ...) where DQ has no other reader. Before them, ORT removes Casts to the
same type, Identities and Dropouts, a Mul or Div by 1 and an Add or Sub of 0, and the Shape reads of a tensor
whose shape is static (constant folding; a Size read gets a DQ of its own instead).

The rewriter removes readers a quantized model had (the Shape reads of a tensor whose shape arithmetic it writes
as constants: a quantized Mistral's embedding; a Log on a branch a constant Where never takes), and ORT then
rounds the output otherwise than the input. `keep_readers_as_input` gives each Q or DQ output that had two
readers or more and has one left a Size read whose output nothing reads (ORT runs it on the host, from the
tensor's shape, and never folds it). `merged_pairs` finds the chains DoubleQDQPairsRemover merges at a new
scale, so that `optimize` names any the output still has and the input does not.

Main graph only (a chain inside an If branch is not looked at), and an Expand to the same shape between DQ1 and
Q2, which ORT also removes, is not followed."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import onnx

from ortfuse.rewriter import _proto
from ortfuse.rewriter.weights import array_of

_DOMAINS = ("", "ai.onnx", "com.microsoft")  # (ORT's contrib Q/DQ merge as the standard ones do)
_ZERO_POINT_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16)
KEPT_READER = "__ortfuse_kept_reader"  # the output suffix of a Size kept for ORT's sake


def _constants(model: onnx.ModelProto) -> dict[str, tuple[int, object]]:
    """(element type, TensorProto or numpy scalar) of what ORT reads as constant initializers: initializers a user
    cannot feed (from IR 4 those not listed as graph inputs; before IR 4 ORT lets none be fed) and Constant nodes'
    values. Nothing is converted here (the weights are among them)."""
    fed = {i.name for i in model.graph.input} if model.ir_version >= 4 else set()
    out: dict[str, tuple[int, object]] = {t.name: (t.data_type, t) for t in model.graph.initializer if t.name not in fed}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            a = next(iter(n.attribute), None)
            if a is not None and a.name == "value":
                out[n.output[0]] = (a.t.data_type, a.t)
            elif a is not None and a.name == "value_float":
                out[n.output[0]] = (onnx.TensorProto.FLOAT, np.float32(a.f))
    return out


def _scalar(consts: dict, name: str) -> Optional[tuple[int, float]]:
    """(element type, value) of a one-element constant; None for anything else."""
    if name not in consts:
        return None
    dt, v = consts[name]
    if isinstance(v, np.generic):
        return dt, float(v)
    if not _proto.fixed_size(v.data_type) or int(np.prod(v.dims)) != 1:
        return None
    return dt, float(np.asarray(array_of(v)).reshape(-1)[0])


def _params(n: onnx.NodeProto, consts: dict) -> Optional[tuple[str, str, float, int, int]]:
    """A Q or DQ node's (scale name, zero-point name, scale, zero point, zero-point type) where both are scalar
    constants of the types the merge handles; None otherwise (it needs an explicit zero point)."""
    if len(n.input) < 3 or not n.input[2]:
        return None
    s, z = _scalar(consts, n.input[1]), _scalar(consts, n.input[2])
    if s is None or z is None or s[0] != onnx.TensorProto.FLOAT or z[0] not in _ZERO_POINT_TYPES:
        return None
    return n.input[1], n.input[2], s[1], int(z[1]), z[0]


def _same(a: tuple, b: tuple) -> bool:
    return (a[0], a[1]) == (b[0], b[1]) or (a[3] == b[3] and abs(a[2] - b[2]) < 1e-20)


def _passes_value(n: onnx.NodeProto, consts: dict) -> bool:
    """A node ORT removes before merging, as one that passes its input through: a Cast to fp32 (DQ1's type: a
    merged pair's scale is fp32), an Identity, a Dropout, x * 1, x / 1, x + 0, x - 0."""
    if n.domain not in ("", "ai.onnx"):
        return False
    if n.op_type in ("Identity", "Dropout"):
        return len([o for o in n.output if o]) == 1
    if n.op_type == "Cast":
        return any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in n.attribute)
    if n.op_type in ("Mul", "Div", "Add", "Sub") and len(n.input) == 2:
        v = _scalar(consts, n.input[1])
        return v is not None and v[1] == (1.0 if n.op_type in ("Mul", "Div") else 0.0)
    return False


def merged_pairs(model: onnx.ModelProto, static: Callable[[str], bool] = lambda t: False) -> dict[str, str]:
    """Q2's name (or output) -> a line naming both pairs, for each chain Q1 -> DQ1 -> [nodes ORT removes] -> Q2 ->
    DQ2 of the main graph that DoubleQDQPairsRemover rewrites with pairs of different parameters.
    `static(t)`: tensor t's shape is known in full, so ORT's constant folding removes a Shape of it."""
    return {q2.name or q2.output[0]: (f"'{dq1.name or dq1.output[0]}' (scale {p1[2]:.4g}, zero point {p1[3]}) -> "
                                      f"'{q2.name or q2.output[0]}' (scale {p2[2]:.4g}, zero point {p2[3]})")
            for _, dq1, q2, _, p1, p2, _ in _merged_chains(model, static)}


def merged_chain_outputs(model: onnx.ModelProto) -> frozenset[str]:
    """The outputs of every node of every chain DoubleQDQPairsRemover may merge at a new scale (Q1, DQ1, the nodes it
    removes between them, Q2, DQ2), counting no Shape as a reader (so a superset of `merged_pairs`' chains): a
    fused kernel must not compute one, or ORT would merge the chain in the input and not in the output."""
    return frozenset(n.output[0] for c in _merged_chains(model, lambda t: True) for n in (*c[:4], *c[6]))


MERGED_CHAIN = ("a Q -> DQ -> Q -> DQ chain ORT merges at a new scale (DoubleQDQPairsRemover) reads it or computes "
                "it: left to ORT, which would not merge it inside a fused node")
WEIGHT_BIAS = ("ORT's WeightBiasQuantization (every execution provider) quantizes the float weight or bias of a Conv, "
               "ConvTranspose or Gemm between a DequantizeLinear and a QuantizeLinear, where a kernel would compute "
               "in fp32: the unit stays ORT's, as ORT sees it in the input")


def weight_bias_units(model: onnx.ModelProto) -> frozenset[str]:
    """The outputs of the nodes of every unit ORT's WeightBiasQuantization may rewrite in `model` (its selector,
    read in ORT's weight_bias_quantization.cc): a Conv, ConvTranspose or Gemm reading a DequantizeLinear of one
    scale, whose output reaches a QuantizeLinear through Relu or Clip nodes with one reader each, with a weight
    computed from constants or dequantized, and a bias computed from constants. ORT quantizes that weight
    (int8, per tensor) and the bias (int32 at the input's scale times the weight's), so the unit computes
    otherwise than its float ops; a fused node holding any of its nodes hides it from ORT in the output only.
    ORT runs the pass after its other level-1 rewrites, so the walk also passes what those remove or fold first
    (Identity, Dropout, a Cast, x * 1, x + 0; after a Conv an Add or Mul of a constant and a BatchNormalization,
    which ORT folds into it; a MatMul then an Add of a constant, which ORT makes a Gemm) and the ops ORT's QDQ
    propagation moves a Q or DQ across (Reshape, Transpose, Squeeze, Unsqueeze, MaxPool, Pad). Op types are
    compared alone, as ORT does (a com.microsoft Q counts), and an initializer counts whether or not a graph
    input lists it. A superset of ORT's units (its per-channel checks are not made), which costs fusion only.
    Main graph only."""
    g = model.graph
    if not any(n.op_type == "DequantizeLinear" for n in g.node):
        return frozenset()
    consts = {t.name for t in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    producer = {o: n for n in g.node for o in n.output if o}
    readers_of: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for t in dict.fromkeys(t for t in n.input if t):
            readers_of.setdefault(t, []).append(n)
    dims = {t.name: tuple(t.dims) for t in g.initializer}
    # tensors computed from constants alone (ORT's constant folding makes them constants), not through a DQ
    # (which it keeps): in one pass, the nodes being in order
    from_constants = set(consts)
    for n in g.node:
        if n.op_type != "DequantizeLinear" and any(n.input) and all(x in from_constants for x in n.input if x):
            from_constants.update(o for o in n.output if o)
    constant = from_constants.__contains__

    passes = ("Identity", "Dropout", "Cast", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "MaxPool", "Pad",
              "Flatten")

    def removed(n: onnx.NodeProto) -> bool:  # a node ORT removes, folds or moves a Q/DQ across first
        return n.op_type in passes or (n.op_type in ("Mul", "Div", "Add", "Sub") and len(n.input) == 2 and
                                       (constant(n.input[0]) or constant(n.input[1])))

    out: set[str] = set()
    for n in g.node:
        gemm_like = n.op_type == "MatMul" and len(readers_of.get(n.output[0], [])) == 1 and \
            readers_of[n.output[0]][0].op_type == "Add"
        if (n.op_type not in ("Conv", "ConvTranspose", "Gemm") and not gemm_like) or len(n.input) < 2:
            continue
        unit, cur = [n], producer.get(n.input[0])
        while cur is not None and cur.op_type != "DequantizeLinear" and removed(cur) and len(cur.output) == 1:
            unit.append(cur)
            cur = producer.get(cur.input[0]) if cur.input else None
        if cur is None or cur.op_type != "DequantizeLinear":
            continue
        unit.append(cur)
        q, at, after = None, n, []
        while len([o for o in at.output if o]) == 1 and len(readers_of.get(at.output[0], [])) == 1:
            nxt = readers_of[at.output[0]][0]
            if nxt.op_type == "QuantizeLinear":
                q = nxt
                break
            if nxt.op_type not in ("Relu", "Clip", "BatchNormalization") and not removed(nxt):
                break
            after.append(nxt)
            at = nxt
        if q is None:
            continue
        unit += [*after, q]
        bias = n.input[2] if len(n.input) > 2 and n.input[2] else None
        if bias is not None and (not constant(bias) or len(dims.get(bias, (0,))) != 1):
            continue  # (ORT quantizes a constant bias of one dim only, and then the unit too)
        # (ORT folds an Add of a constant or a BatchNormalization into a Conv's bias, and makes MatMul + Add a Gemm)
        folded = bool(after) and after[0].op_type in ("Add", "Sub", "BatchNormalization")
        w = producer.get(n.input[1])
        if w is not None and w.op_type == "DequantizeLinear":
            if bias is None and not folded:
                continue  # a dequantized weight and no bias: nothing to quantize
            unit.append(w)
        elif not constant(n.input[1]):
            continue
        out.update(o for x in unit for o in x.output if o)
    return frozenset(out)


READERS_CHANGED = ("its output has other readers in the input model than here (ORT's quantization passes count them): "
                   "left to ORT, so that the output keeps them")


def left_to_ort(model: onnx.ModelProto, merged_before: frozenset[str], readers_before: dict[str, int],
                static: Callable[[str], bool] = lambda t: False,
                weight_bias_before: frozenset[str] = frozenset()) -> dict[str, str]:
    """Outputs of the nodes of `model` (the graph searched) that must stay ORT's nodes, with the reason, for
    ORT's quantization passes, which look at the nodes themselves: every node of a chain DoubleQDQPairsRemover
    merges in the input (`merged_before`: its `merged_chain_outputs`) or here; every node of a unit
    WeightBiasQuantization rewrites in the input (`weight_bias_before`: its `weight_bias_units`; not one the
    rewrite made, which kept ORT's would be quantized in the output alone); and a
    Q or DQ whose readers the rewrite changed (`readers_before`: the input's `readers`), which
    `keep_readers_as_input` can give a reader back in the main graph only, not inside a fused node's function."""
    out = dict.fromkeys(weight_bias_before, WEIGHT_BIAS)
    out.update(dict.fromkeys(merged_before | merged_chain_outputs(model), MERGED_CHAIN))
    out.update({t: READERS_CHANGED for t, k in readers(model, static).items() if k != readers_before.get(t, k)})
    return out


def _merged_chains(model: onnx.ModelProto, static: Callable[[str], bool]) -> list[tuple]:
    """(Q1, DQ1, Q2, DQ2, DQ1's parameters, Q2's, the nodes between DQ1 and Q2) of each chain `merged_pairs`
    describes."""
    g = model.graph
    if not any(n.op_type == "DequantizeLinear" for n in g.node):
        return []
    consts = _constants(model)
    read_by = _read_by(g, static)
    outputs = {o.name for o in g.output}
    producer = {o: n for n in g.node for o in n.output if o}

    def only_reader(t: str) -> Optional[onnx.NodeProto]:
        rs = read_by.get(t, [])
        return rs[0] if len(rs) == 1 and t not in outputs else None

    def op(n: Optional[onnx.NodeProto], op_type: str) -> bool:
        return n is not None and n.op_type == op_type and n.domain in _DOMAINS

    found = []
    for dq1 in g.node:
        q1 = producer.get(dq1.input[0]) if op(dq1, "DequantizeLinear") else None
        if not op(q1, "QuantizeLinear") or only_reader(q1.output[0]) is not dq1:
            continue
        q2, between = only_reader(dq1.output[0]), []
        while q2 is not None and _passes_value(q2, consts):
            between.append(q2)
            q2 = only_reader(q2.output[0])
        dq2 = only_reader(q2.output[0]) if op(q2, "QuantizeLinear") else None
        if not op(dq2, "DequantizeLinear"):
            continue
        p = [_params(n, consts) for n in (q1, dq1, q2, dq2)]
        if any(x is None for x in p) or not _same(p[0], p[1]) or not _same(p[2], p[3]) or p[1][4] != p[2][4] \
                or _same(p[1], p[2]):
            continue
        found.append((q1, dq1, q2, dq2, p[1], p[2], tuple(between)))
    return found


def _read_by(g: onnx.GraphProto, static: Callable[[str], bool]) -> dict[str, list[onnx.NodeProto]]:
    """Each tensor's reading nodes as ORT counts them: a subgraph reading it counts (ORT's implicit inputs); a
    Shape of a static shape does not, as ORT folds it first (a Size of one it folds too, but only after giving
    it a DQ of its own)."""
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        if n.op_type == "Shape" and n.domain in ("", "ai.onnx") and static(n.input[0]):
            continue
        for x in _proto.node_reads(n):
            out.setdefault(x, []).append(n)
    return out


def readers(model: onnx.ModelProto, static: Callable[[str], bool] = lambda t: False) -> dict[str, int]:
    """How many readers each QuantizeLinear or DequantizeLinear output of the main graph has as ORT counts them
    (`_read_by`; a graph output counts as one)."""
    g = model.graph
    outs = [n.output[0] for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.domain in _DOMAINS]
    if not outs:
        return {}
    read_by, returned = _read_by(g, static), {o.name for o in g.output}
    return {t: len(read_by.get(t, ())) + (t in returned) for t in outs}


def keep_readers_as_input(before: dict[str, int], merged_before: dict[str, str], out: onnx.ModelProto,
                          static: Callable[[str], bool] = lambda t: False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Gives each Q or DQ output of `out` (the optimized model, changed in place) that had two readers or more in
    the input (`before`: its `readers`) and has one left a Size read whose output nothing reads, so ORT sees it
    read twice, as in the input. Returns a line for each so kept, and one for each chain ORT still merges at a new
    scale in one model only (`merged_before`: the input's `merged_pairs`)."""
    kept = []
    now = readers(out, static)
    producer = {n.output[0]: n for n in out.graph.node if n.output and n.output[0] in now}
    for t, k in now.items():
        if k == 1 and before.get(t, 0) >= 2:
            n = producer[t]
            out.graph.node.append(onnx.helper.make_node("Size", [t], [t + KEPT_READER], name=t + KEPT_READER))
            kept.append(f"{n.op_type} '{n.name or t}' (read {before[t]} times in the input, once in the output)")
    after = merged_pairs(out, static)
    left = [f"{line} (in the output only)" for k, line in after.items() if k not in merged_before]
    left += [f"{line} (in the input only)" for k, line in merged_before.items() if k not in after]
    return tuple(kept), tuple(left)

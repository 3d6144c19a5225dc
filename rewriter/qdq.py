"""Quantize/dequantize pairs ONNX Runtime merges at a scale of its own.

ORT's DoubleQDQPairsRemover (ORT_ENABLE_BASIC and above, on every execution provider) turns Q1 -> DQ1 -> Q2 ->
DQ2 into Q1 -> DQ2 where DQ1 and Q2 have no other reader. Where the two pairs' scales or zero points differ, it
requantizes at a scale of its own (the intersection of the two ranges), which rounds differently from the model
as written: a model's results then depend on which tensors have other readers. Casts to the same type and
Identities between DQ1 and Q2 are removed before it (CastElimination, EliminateIdentity).

The rewriter removes readers a quantized model had (the Shape reads of a tensor whose shape arithmetic it
folds), so an optimized model can have such a merge where the input had none. `merged_pairs` finds them, so
that `optimize` says so and `check` can tell ORT's rounding from ours."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import onnx

from ortfuse.rewriter import _proto
from ortfuse.rewriter.weights import array_of

_ZERO_POINT_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)


def _constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Initializers a user cannot feed (from IR 4, those not listed as graph inputs) and Constant nodes' values:
    what ORT reads as constant initializers."""
    fed = {i.name for i in model.graph.input} if model.ir_version >= 4 else {i.name for i in model.graph.initializer}
    out = {t.name: t for t in model.graph.initializer if t.name not in fed}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None:
                out[n.output[0]] = value
    return out


def _params(n: onnx.NodeProto, consts: dict[str, onnx.TensorProto]) -> Optional[tuple[str, str, float, int, int]]:
    """A Q or DQ node's (scale name, zero-point name, scale, zero point, zero-point type) where both are scalar
    constants of the types DoubleQDQPairsRemover handles; None otherwise."""
    if len(n.input) < 3 or not n.input[2] or n.input[1] not in consts or n.input[2] not in consts:
        return None
    s, z = consts[n.input[1]], consts[n.input[2]]
    if s.data_type != onnx.TensorProto.FLOAT or z.data_type not in _ZERO_POINT_TYPES:
        return None
    sv, zv = np.asarray(array_of(s)).reshape(-1), np.asarray(array_of(z)).reshape(-1)
    if sv.size != 1 or zv.size != 1:
        return None
    return n.input[1], n.input[2], float(sv[0]), int(zv[0]), z.data_type


def _same(a: tuple, b: tuple) -> bool:
    return (a[0], a[1]) == (b[0], b[1]) or (a[3] == b[3] and abs(a[2] - b[2]) < 1e-20)


def merged_pairs(model: onnx.ModelProto, static: Callable[[str], bool] = lambda t: False) -> dict[str, str]:
    """Q2's name (or output) -> a line saying which pairs ORT merges at a scale of its own, for each chain
    Q1 -> DQ1 -> [Casts to the same type, Identities] -> Q2 -> DQ2 of the main graph that DoubleQDQPairsRemover
    rewrites and whose pairs' scales or zero points differ. `static(t)`: tensor t's shape is known in full, so
    ORT's constant folding (which runs first) removes a Shape or Size reading it."""
    g = model.graph
    consts = _constants(model)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        if n.op_type in ("Shape", "Size") and n.domain in ("", "ai.onnx") and static(n.input[0]):
            continue
        for x in _proto.node_reads(n):  # (a subgraph's reads of outer names count, as ORT's implicit inputs do)
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in g.output}
    producer = {o: n for n in g.node for o in n.output if o}

    def only_reader(t: str) -> Optional[onnx.NodeProto]:
        rs = readers.get(t, [])
        return rs[0] if len(rs) == 1 and t not in outputs else None

    def plain(n: onnx.NodeProto) -> bool:
        return n.domain in ("", "ai.onnx")

    found: dict[str, str] = {}
    for dq1 in g.node:
        if dq1.op_type != "DequantizeLinear" or not plain(dq1):
            continue
        q1 = producer.get(dq1.input[0])
        if q1 is None or q1.op_type != "QuantizeLinear" or not plain(q1) or only_reader(q1.output[0]) is not dq1:
            continue
        q2 = only_reader(dq1.output[0])  # (DQ1 is fp32: a supported pair's scale is)
        while q2 is not None and plain(q2) and (q2.op_type == "Identity" or q2.op_type == "Cast" and any(
                a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in q2.attribute)):
            q2 = only_reader(q2.output[0])
        if q2 is None or q2.op_type != "QuantizeLinear" or not plain(q2):
            continue
        dq2 = only_reader(q2.output[0])
        if dq2 is None or dq2.op_type != "DequantizeLinear" or not plain(dq2):
            continue
        p = [_params(n, consts) for n in (q1, dq1, q2, dq2)]
        if any(x is None for x in p) or not _same(p[0], p[1]) or not _same(p[2], p[3]) or p[1][4] != p[2][4] \
                or _same(p[1], p[2]):
            continue
        found[q2.name or q2.output[0]] = (f"'{dq1.name or dq1.output[0]}' (scale {p[1][2]:.4g}, zero point "
                                          f"{p[1][3]}) -> '{q2.name or q2.output[0]}' (scale {p[2][2]:.4g}, zero "
                                          f"point {p[2][3]})")
    return found


def new_merges(before: onnx.ModelProto, after: onnx.ModelProto,
               static: Callable[[str], bool] = lambda t: False) -> tuple[str, ...]:
    """The merges of `merged_pairs` in `after` that `before` does not have, as lines."""
    old = merged_pairs(before, static)
    return tuple(line for k, line in merged_pairs(after, static).items() if k not in old)

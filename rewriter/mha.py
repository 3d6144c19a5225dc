"""ORT's own fused attention for an attention pattern: `com.microsoft.MultiHeadAttention`, a stock kernel of
ORT's CUDA EP (flash attention for 16-bit data without a bias, memory-efficient or unfused kernels otherwise;
its CPU EP runs it too). Collage's third backend for an attention region, beside our kernel and ORT's unfused
ops: the search decides which (`ortfuse.api._ort_attention_chosen`).

The pattern's two MatMuls, score ops and Softmax become one MultiHeadAttention node. It reads Q, K and V as
[B, S, heads * D] and writes [B, Sq, heads * Dv], so each operand is re-viewed from the pattern's
[B, heads, S, D] tensors (Kᵀ for K): a Transpose that undoes the exporter's own reads the tensor before it
instead (no copy), a Reshape that merges the last two dims reads the exporter's unmerged tensor. What the
output's consumers transpose back is read the same way from the node's result. The layout paths of the
pattern stay as they are for ORT (Reshapes cost nothing there; the search may fuse the rest).

Which patterns MultiHeadAttention computes exactly is `search.ort_attention`'s to say (`MhaForm`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.rewriter import _proto
from ortfuse.rewriter.canonical import remove_dead
from ortfuse.rewriter.graph import Dim, Graph, TensorInfo
from ortfuse.rewriter.shapes import assemble

DOMAIN = "com.microsoft"
OP = "MultiHeadAttention"
DTYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16})
BNSD_TO_BSND = (0, 2, 1, 3)  # Q, V and the output: [B, N, S, D] <-> [B, S, N, D] (its own inverse)
KT_TO_BSND = (0, 3, 1, 2)  # Kᵀ [B, N, D, S] -> [B, S, N, D]
# An fp32 attention_bias' floor. ORT's memory-efficient kernel (CUDA, fp32 from 256 keys or queries) multiplies
# scores + bias by log2(e) in fp32: a bias of float32's lowest (what exporters mask with) becomes -inf there, so a
# query row masked on every key gives NaN where the pattern's Softmax gives a uniform row, and the NaN reaches
# every row through the next layer's keys. Raised to -1e38 a finite bias keeps its probabilities (e^-1e38 is 0
# beside any visible score) unless every key of a row is below the floor; -inf is kept as it is.
BIAS_FLOOR = -1e38


@dataclass(frozen=True)
class MhaForm:
    """An attention pattern as MultiHeadAttention computes it."""
    softmax: str  # the pattern's Softmax (its name, or output where unnamed): how reports name it
    q: str  # Q [B, N, Sq, D] (the scores MatMul's first input)
    kt: str  # Kᵀ [B, N, D, Sk] (its second)
    v: str  # V [B, N, Sk, Dv] (the second MatMul's second input)
    out: str  # P·V [B, N, Sq, Dv]
    heads: int
    d: int
    dv: int
    scale: float  # the scores' scalar factor (MultiHeadAttention's `scale`)
    bias: Optional[str]  # the additive mask (`attention_bias`), if any
    dtype: int
    nodes: tuple[int, ...]  # the nodes the attention node replaces: MatMuls, score ops, Softmax, prob ops

    def signature(self, g: Graph) -> tuple:
        """Forms that cost the same: one decision serves them all (a model's layers)."""
        shape = lambda t: tuple(g.tensors[t].shape or ())  # noqa: E731
        return (self.dtype, self.heads, self.d, self.dv, shape(self.q), shape(self.kt),
                shape(self.bias) if self.bias else None)


class _Emitter:
    """New nodes and tensors for one rewrite, named uniquely after a prefix."""

    def __init__(self, g: Graph, m: onnx.ModelProto, tensors: dict[str, TensorInfo]):
        self.g, self.m, self.tensors = g, m, tensors
        self.nodes: list[onnx.NodeProto] = []
        self.taken = set(tensors) | {t.name for t in m.graph.initializer}
        self.floored: dict[str, str] = {}  # mask -> the mask the nodes read (`_bias_floored`)
        self.after: dict[str, list[onnx.NodeProto]] = {}  # nodes placed after a mask's producer

    def name(self, base: str) -> str:
        k, out = 0, base
        while out in self.taken:
            k += 1
            out = f"{base}_{k}"
        self.taken.add(out)
        return out

    def const(self, base: str, values: Sequence[float] | float, dtype: int = onnx.TensorProto.INT64) -> str:
        """A new initializer of `values` (a list, or a scalar) as `dtype`."""
        t = self.name(base)
        v = np.asarray(values, onnx.helper.tensor_dtype_to_np_dtype(dtype))
        self.m.graph.initializer.append(numpy_helper.from_array(v, t))
        self.tensors[t] = TensorInfo(t, dtype, v.shape)
        return t

    def node(self, op: str, inputs: list[str], base: str, shape: tuple[Dim, ...], dtype: int,
             out: Optional[str] = None, domain: str = "", **attrs) -> str:
        y = out or self.name(base)
        self.nodes.append(onnx.helper.make_node(op, inputs, [y], name=self.name(f"{base}/{op}"), domain=domain,
                                                **attrs))
        self.tensors[y] = TensorInfo(y, dtype, shape)
        return y


def _compose(first: Sequence[int], then: Sequence[int]) -> tuple[int, ...]:
    """The one permutation of Transpose(Transpose(x, first), then)."""
    return tuple(first[i] for i in then)


def _transposed(e: _Emitter, x: str, perm: tuple[int, ...], base: str) -> str:
    """x transposed by `perm`: the tensor before the exporter's Transposes where they undo it (no copy)."""
    g, t, acc = e.g, x, perm
    shape = g.tensors[x].shape
    want = tuple(shape[i] for i in perm)
    while (p := g.producer.get(t)) is not None and g.nodes[p].op_type in ("Transpose", "Identity") \
            and g.nodes[p].domain in ("", "ai.onnx"):
        node = g.nodes[p]
        first = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if node.op_type == "Transpose" and first is None:
            break
        acc, t = (acc if first is None else _compose(first, acc)), node.input[0]
        if acc == tuple(range(len(acc))) and t in g.tensors and g.tensors[t].shape == want:
            return t
    return e.node("Transpose", [x], base, want, g.tensors[x].dtype, perm=list(perm))


def _heads_merged(e: _Emitter, x: str, base: str) -> str:
    """x [B, S, N, D] as [B, S, N * D]: the exporter's tensor before its Reshape where that is it."""
    g = e.g
    b, s, n, d = e.tensors[x].shape
    want = (b, s, n * d)
    p = g.producer.get(x)
    if p is not None and g.nodes[p].op_type == "Reshape":
        src = g.nodes[p].input[0]
        if src in g.tensors and tuple(g.tensors[src].shape or ()) == want:
            return src
    return e.node("Reshape", [x, e.const(f"{base}_shape", [0, 0, -1])], base, want, e.tensors[x].dtype)


def _bias_floored(e: _Emitter, bias: str) -> str:
    """An fp32 mask with its finite values below BIAS_FLOOR raised to it: a constant's values where it has
    such values, otherwise Where(mask == -inf, mask, Max(mask, floor)) (before opset 11 one Clip, which raises
    -inf too) once per mask, after its producer."""
    g = e.g
    if bias in e.floored:
        return e.floored[bias]
    info = g.tensors[bias]
    c = None if g.fed(bias) else g.constants.get(bias)
    if c is not None:
        v = np.asarray(c, np.float32)
        out = bias
        if (np.isfinite(v) & (v < BIAS_FLOOR)).any():
            out = e.name(f"{bias}/floored")
            kept = np.where(np.isneginf(v), v, np.maximum(v, np.float32(BIAS_FLOOR))).astype(np.float32)
            e.m.graph.initializer.append(numpy_helper.from_array(kept, out))
            e.tensors[out] = TensorInfo(out, info.dtype, info.shape)
    else:
        outer, e.nodes = e.nodes, []
        base = f"{bias}/floored"
        if g.opset >= 11:  # Equal on floats, Max broadcasting a scalar
            out = e.node("Max", [bias, e.const(f"{base}/floor", BIAS_FLOOR, info.dtype)], base, info.shape,
                         info.dtype)
            ninf = e.node("Equal", [bias, e.const(f"{base}/ninf", -np.inf, info.dtype)], base, info.shape,
                          onnx.TensorProto.BOOL)
            out = e.node("Where", [ninf, bias, out], base, info.shape, info.dtype)
        else:  # Clip's bound an attribute (opset 6-10); -inf is raised too: a row of -inf keys gets a uniform row
            out = e.node("Clip", [bias], base, info.shape, info.dtype, min=BIAS_FLOOR)
        e.after[bias], e.nodes = e.nodes, outer
    e.floored[bias] = out
    return out


def _replacement(e: _Emitter, f: MhaForm) -> dict[str, str]:
    """Emit f's nodes; returns the aliases of tensors the output's consumers re-view."""
    g = e.g
    base = f"{f.softmax}/mha"
    q = _heads_merged(e, _transposed(e, f.q, BNSD_TO_BSND, f"{base}/q"), f"{base}/q")
    k = _heads_merged(e, _transposed(e, f.kt, KT_TO_BSND, f"{base}/k"), f"{base}/k")
    v = _heads_merged(e, _transposed(e, f.v, BNSD_TO_BSND, f"{base}/v"), f"{base}/v")
    inputs = [q, k, v]
    if f.bias is not None:
        bias, rank = f.bias, len(g.tensors[f.bias].shape)
        if f.dtype == onnx.TensorProto.FLOAT:
            bias = _bias_floored(e, bias)
        if rank < 4:
            shape = (1,) * (4 - rank) + tuple(e.tensors[bias].shape)
            axes = list(range(4 - rank))
            if g.opset >= 13:
                bias = e.node("Unsqueeze", [bias, e.const(f"{base}/bias_axes", axes)], f"{base}/bias", shape, f.dtype)
            else:
                bias = e.node("Unsqueeze", [bias], f"{base}/bias", shape, f.dtype, axes=axes)
        inputs += ["", "", bias]
    b, _, sq, _ = g.tensors[f.q].shape
    merged = e.node(OP, inputs, base, (b, sq, f.heads * f.dv), f.dtype, domain=DOMAIN, num_heads=f.heads,
                    scale=float(f.scale))
    split = e.node("Reshape", [merged, e.const(f"{base}/out_shape", [0, 0, f.heads, f.dv])], f"{base}/out",
                   (b, sq, f.heads, f.dv), f.dtype)
    e.node("Transpose", [split], f"{base}/out", (b, f.heads, sq, f.dv), f.dtype, out=f.out, perm=list(BNSD_TO_BSND))
    alias: dict[str, str] = {}
    for c in g.consumers.get(f.out, ()):  # the exporter's Transpose back (and Reshape merging the heads)
        node = g.nodes[c]
        perm = next((tuple(a.ints) for a in node.attribute if a.name == "perm"), None)
        if node.op_type != "Transpose" or perm is None or _compose(BNSD_TO_BSND, perm) != (0, 1, 2, 3) \
                or node.output[0] in g.graph_outputs:
            continue
        alias[node.output[0]] = split
        for r in g.consumers.get(node.output[0], ()):
            rn = g.nodes[r]
            if rn.op_type == "Reshape" and rn.output[0] not in g.graph_outputs and \
                    tuple(g.tensors[rn.output[0]].shape or ()) == e.tensors[merged].shape:
                alias[rn.output[0]] = merged
    return alias


def to_mha(g: Graph, chosen: Sequence[MhaForm], biases: bool = False) -> Graph:
    """g with each form's nodes replaced by ORT's MultiHeadAttention (g is left untouched). `biases`: a
    projection's bias Add that only the node reads goes into its `bias` input (`_take_biases`)."""
    if not chosen:
        return g
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    e = _Emitter(g, m, tensors)
    removed = {i for f in chosen for i in f.nodes}
    at: dict[int, list[onnx.NodeProto]] = {}
    alias: dict[str, str] = {}
    for f in chosen:
        e.nodes = []
        alias.update(_replacement(e, f))
        at[max(f.nodes)] = e.nodes  # where P·V was: every input is computed by then
    for mask, nodes in e.after.items():  # a floored mask: after its producer's nodes (first for an input)
        at.setdefault(g.producer.get(mask, -1), []).extend(nodes)
    new_nodes: list[onnx.NodeProto] = list(at.get(-1, ()))
    for i, node in enumerate(m.graph.node):
        if i not in removed:
            new_nodes.append(node)
        new_nodes.extend(at.get(i, ()))
    _proto.read_instead(new_nodes, alias)
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    if not any(o.domain == DOMAIN for o in m.opset_import):
        m.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    remove_dead(m)
    if biases and _take_biases(g, m, e):
        remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides)


def _take_biases(g: Graph, m: onnx.ModelProto, e: _Emitter) -> int:
    """Each MultiHeadAttention's Q, K or V computed by an Add of a constant vector along its last axis that
    nothing else reads: the node reads the Add's other operand and adds the vector itself (its `bias` input,
    [D + D + Dv], zeros where an operand has none). ORT's MultiHeadAttention adds it in the kernel that lays
    Q, K and V out for the attention, so BERT's three fp32 bias Adds left to ORT are three kernels less.
    Returns how many Adds were taken."""
    producer = {o: n for n in m.graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in m.graph.node:
        for x in _proto.node_reads(n):  # a subgraph's reads too
            readers[x] = readers.get(x, 0) + 1
    outputs = {o.name for o in m.graph.output}
    taken = 0
    for node in m.graph.node:
        if not is_mha(node) or len(node.input) < 3 or (len(node.input) > 3 and node.input[3]):
            continue
        parts: list[Optional[np.ndarray]] = []
        sources: list[str] = []
        for x in node.input[:3]:
            width = e.tensors[x].shape[-1]
            add = producer.get(x)
            vec, other = None, x
            if add is not None and add.op_type == "Add" and add.domain in ("", "ai.onnx") and readers.get(x) == 1 \
                    and x not in outputs:
                for a, b in ((0, 1), (1, 0)):
                    c = None if g.fed(add.input[b]) else g.constants.get(add.input[b])
                    src = e.tensors.get(add.input[a])
                    if c is not None and np.asarray(c).shape == (width,) and src is not None \
                            and src.shape == e.tensors[x].shape and src.dtype == e.tensors[x].dtype:
                        vec, other = np.asarray(c), add.input[a]
                        break
            parts.append(vec)
            sources.append(other)
        if all(v is None for v in parts):
            continue
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(e.tensors[node.input[0]].dtype))
        joined = np.concatenate([v.astype(dtype) if v is not None else np.zeros(e.tensors[x].shape[-1], dtype)
                                 for v, x in zip(parts, node.input[:3])])
        name = e.name(f"{node.name}/bias")
        m.graph.initializer.append(numpy_helper.from_array(joined, name))
        e.tensors[name] = TensorInfo(name, e.tensors[node.input[0]].dtype, (len(joined),))
        while len(node.input) < 4:
            node.input.append("")
        node.input[3] = name
        for k, src in enumerate(sources):
            node.input[k] = src
        taken += sum(v is not None for v in parts)
    return taken


def is_mha(node: onnx.NodeProto) -> bool:
    return node.op_type == OP and node.domain == DOMAIN

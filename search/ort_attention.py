"""Which attention patterns ORT's MultiHeadAttention computes exactly (`rewriter.mha` rewrites them): scores
[B, heads, Sq, Sk] with a static head count; scalar scales before at most one additive mask of the attention's
dtype that has every query row and key ([B or 1, heads or 1, Sq, Sk], lower ranks broadcast); fp32 or fp16
(ORT's CPU EP has no bf16 kernel). Anything else is a reason, as text, that reports show. The operand paths
stay ORT's whatever they hold (a rotary embedding, K and V repeated across grouped query heads): the
whole-model estimate prices them."""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import onnx

from ortfuse.rewriter.graph import Dim, Graph
from ortfuse.rewriter.mha import DTYPES, MhaForm
from ortfuse.search import legal
from ortfuse.search.attention import AttentionPattern


def _scalar(g: Graph, t: str) -> Optional[float]:
    """A one-element constant's value; None for anything else, an initializer a user may feed included."""
    if g.constant_size(t) != 1 or g.fed(t):  # (a mask constant is not converted to find out)
        return None
    return float(np.asarray(g.constants[t]).reshape(-1)[0])


def mha_form(g: Graph, p: AttentionPattern) -> MhaForm | str:
    """The pattern as MultiHeadAttention computes it, or why it cannot be."""
    qk, pv = g.nodes[p.qk], g.nodes[p.pv]
    q, kt, v, out = qk.input[0], qk.input[1], pv.input[1], pv.output[0]
    dtype = g.tensors[q].dtype
    if dtype not in DTYPES:
        return f"{onnx.TensorProto.DataType.Name(dtype).lower()} data (MultiHeadAttention here: fp32 or fp16)"
    shapes = [g.tensors[t].shape for t in (q, kt, v, out, qk.output[0])]
    if any(s is None or len(s) != 4 for s in shapes):
        return "scores not [batch, heads, queries, keys]"
    (b, n, sq, d), (_, _, _, sk), (_, _, _, dv) = shapes[0], shapes[1], shapes[2]
    if not all(isinstance(x, int) for x in (n, d, dv)):
        return "a head count or head size known only at run time"
    if shapes[1] != (b, n, d, sk) or shapes[2] != (b, n, sk, dv) or shapes[3] != (b, n, sq, dv) \
            or any(g.tensors[t].dtype != dtype for t in (kt, v, out)):
        return "Q, K and V of different batches, heads or types"
    scale, bias, t = 1.0, None, qk.output[0]
    for i in p.score_ops:
        node = g.nodes[i]
        if t not in node.input:
            return f"{g.node_label(i)} is not on the scores' chain"
        others = [x for x in node.input if x != t]
        c = _scalar(g, others[0]) if len(others) == 1 else None
        if node.op_type in ("Mul", "Div") and c is not None and bias is None and (node.op_type == "Mul" or c):
            if node.op_type == "Div" and node.input[0] != t:
                return f"{g.node_label(i)} divides by the scores"
            scale = scale * c if node.op_type == "Mul" else scale / c
        elif node.op_type == "Add" and len(others) == 1 and c is None and bias is None:
            why = _bias_fit(g, others[0], (b, n, sq, sk), dtype)
            if why:
                return why
            bias = others[0]
        elif node.op_type not in ("Cast", "Identity") or g.tensors[node.output[0]].dtype not in \
                (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            return f"{g.node_label(i)} on the scores (MultiHeadAttention: scalar scales, then one additive mask)"
        t = node.output[0]
    if bias is not None and dtype == onnx.TensorProto.FLOAT and g.opset < 6:
        return "an fp32 mask before opset 6 (its floor is a Clip: rewriter.mha.BIAS_FLOOR)"
    if scale == 0.0:  # MultiHeadAttention reads a scale of 0 as its default, 1 / sqrt(D)
        return "scores scaled by 0"
    if bias is not None and any(g.nodes[i].op_type not in ("Cast", "Identity") for i in p.prob_ops):
        return "a NaN guard on the probabilities of masked scores"
    removed = (p.qk, *p.score_ops, p.softmax, *p.prob_ops, p.pv)
    return MhaForm(softmax_name(g, p.softmax), q, kt, v, out, n, d, dv, scale, bias, dtype, tuple(sorted(removed)))


def softmax_name(g: Graph, i: int) -> str:
    """How a form names its pattern: the Softmax's name, or its output where unnamed."""
    return g.nodes[i].name or g.nodes[i].output[0]


def _bias_fit(g: Graph, m: str, scores: tuple[Dim, ...], dtype: int) -> Optional[str]:
    """Why mask `m` is not MultiHeadAttention's attention_bias for these scores, or None."""
    info = g.tensors.get(m)
    if info is None or info.shape is None or len(info.shape) > 4:
        return f"a mask '{m}' of unknown or higher rank"
    if info.dtype != dtype:
        return f"a mask '{m}' of another type than the attention's"
    shape = (1,) * (4 - len(info.shape)) + tuple(info.shape)
    if tuple(shape[2:]) != tuple(scores[2:]):
        return f"a mask {list(info.shape)} broadcast over query rows or keys (attention_bias has them all)"
    if any(x not in (1, s) for x, s in zip(shape[:2], scores[:2])):
        return f"a mask {list(info.shape)} that does not broadcast to the scores {list(scores)}"
    return None


def forms(g: Graph, patterns: Iterable[AttentionPattern]) -> tuple[list[MhaForm], list[tuple[str, str]]]:
    """(forms, (Softmax, reason) for the patterns that have none). A pattern whose values a quantizer reads keeps
    ORT's MatMul, Softmax and MatMul: MultiHeadAttention computes them otherwise, and an ulp there moves a
    quantized element a step (`legal.quantizer_readers`; quantize_dynamic's attention output)."""
    out, refused = [], []
    readers = legal.quantizer_readers(g)
    for p in patterns:
        q = next((readers[i] for i in p.nodes if i in readers), None)
        f = mha_form(g, p) if q is None else (f"its values reach {legal.quantizer_label(g, q)}, which rounds them "
                                             "to steps, and MultiHeadAttention computes them otherwise than ORT's "
                                             "MatMul, Softmax and MatMul")
        if isinstance(f, str):
            refused.append((g.node_label(p.softmax), f))
        else:
            out.append(f)
    return out, refused

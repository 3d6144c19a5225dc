"""ONNX's Attention (opset 23 on: torch's exporter writes it for `scaled_dot_product_attention` from opset 23)
written as the standard ops an exporter writes for attention, so the search fuses it, with the layout ops and
rotary embeddings around it, into one attention kernel; `rewriter.contrib` puts it back where nothing fused it.

The function is ORT 1.31.1's kernel's, as measured on its CPU EP (tests/rewriter/test_onnx_attention.py):
  * scores = Q·Kᵀ · scale (1/√head size by default); then softcap · tanh(scores / softcap) where softcap is set;
  * then the mask: a bool mask keeps the entries it marks true, a float one is added; is_causal hides key j
    from query i where j > i + the past's length (upper-left aligned without a past, as ORT does). Both
    become one additive bias, as torch's exporter writes a bool mask before opset 23 (Where(mask, 0, -inf)),
    so its ops fuse as an exported mask's do. The causal rule is a constant over static lengths, and over
    symbolic ones (no past) j <= i over two iotas, which each attention kernel computes in place (a copy
    for each layer: `iota.isolate_iotas`);
  * Softmax over the keys; a row that sees no key gives 0, as in ORT (a float mask entry at or below its
    type's lowest value counts as hidden: ORT gives 0 for such a row, not the mean of V); then ·V.
The ops are in the data's type, as an exporter writes them (the fused kernel accumulates in fp32).
Grouped-query heads: query head h reads key/value head h // (Hq / Hkv), written as Llama's repeat_kv writes it
(Unsqueeze, Expand, Reshape), which the kernel reads in place. 3-D inputs [B, S, H·D] (q_num_heads,
kv_num_heads) are split into heads and the output merged back. past_key and past_value go before the new keys
along the sequence (present_key, present_value).

Not split (left to ORT as it is): is_causal over query or key counts that are not static after a past (ORT's
rule for one query after a past depends on the counts at run time); head
sizes over the attention kernel's 128 (no kernel of ours would take it: ORT's kernel, not its ops unfused);
opset 25's sliding windows (any attribute but opset 23's and 24's); the qk_matmul_output output in use; opset
24's nonpad_kv_seqlen; inputs that are not one float type; unknown ranks; head counts or sizes that are not
static; a scale <= 0; a mask neither bool nor the data's type, or whose last dim is neither 1 nor the keys'
count (a symbol under another name may be). ORT's kernel refuses more masks than that at run time (any
smaller than [Sq, T], [B, 1, 1, T] padding masks among them, and a past without present outputs): these ops
broadcast them, as ONNX's function does."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.canonical import broadcast
from ortfuse.rewriter.graph import Dim, Graph, TensorInfo

if TYPE_CHECKING:
    from ortfuse.rewriter.contrib import _Builder

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_ATTRIBUTES = frozenset({"is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode", "scale", "softcap",
                         "softmax_precision"})  # opset 23's and 24's
_F32 = TensorProto.FLOAT
_LOWEST = {TensorProto.FLOAT: float(np.finfo(np.float32).min), TensorProto.FLOAT16: float(np.finfo(np.float16).min),
           TensorProto.BFLOAT16: -3.3895313892515355e38}  # bf16's lowest: (2 - 2^-7) * 2^127


def splittable(g: Graph, n: onnx.NodeProto) -> bool:
    """Whether `n` (an Attention in the default domain) can be written as standard ops computing the same."""
    from ortfuse.search.attention import MAX_HEAD_DIM
    if g.opset not in (23, 24) or any(a.name not in _ATTRIBUTES for a in n.attribute) \
            or len(n.output) > 3 and n.output[3] and g.used(n.output[3]) or len(n.input) > 6 and n.input[6]:
        return False  # (opset 25 adds sliding windows: a function these ops do not compute)
    q, k, v = (g.tensors.get(x) for x in n.input[:3])
    if any(t is None or t.shape is None or t.dtype not in _FLOATS for t in (q, k, v)) \
            or len({q.dtype, k.dtype, v.dtype}) != 1 or not (len(q.shape) == len(k.shape) == len(v.shape) in (3, 4)):
        return False
    heads = _heads(n, q.shape, k.shape, v.shape)
    if heads is None or max(heads[2:]) > MAX_HEAD_DIM or attr(n, "scale", 1.0) <= 0:
        return False  # (no attention kernel would take it: ORT's kernel, not its ops unfused)
    past = [g.tensors.get(n.input[j]) if len(n.input) > j and n.input[j] else None for j in (4, 5)]
    if (past[0] is None) != (past[1] is None) or any(p is not None and (p.dtype != q.dtype or p.rank != 4)
                                                      for p in past):
        return False
    axis = 1 if len(q.shape) == 3 else 2
    keys, rows, new = _keys(g, n, k.shape), q.shape[axis], k.shape[axis]
    if attr(n, "is_causal", 0) and not all(isinstance(x, int) for x in (keys, rows, new)) and past[0] is not None:
        return False  # (ORT's rule for one query after a past depends on the lengths at run time)
    mask = g.tensors.get(n.input[3]) if len(n.input) > 3 and n.input[3] else None
    if len(n.input) > 3 and n.input[3] and (mask is None or mask.shape is None):
        return False
    if mask is not None:
        last = mask.shape[-1] if mask.shape else 1
        # (two symbolic counts under different names, as Mistral's sliding-window cache has them, are one at run
        # time or ORT's kernel and the split's Add both refuse)
        named = isinstance(last, str) and isinstance(keys, str)
        if mask.dtype not in (TensorProto.BOOL, q.dtype) or len(mask.shape) > 4 \
                or (last not in (1, keys) and not named):
            return False
    return True


def expand(b: "_Builder", n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    """The standard ops (appended to `b`); nothing that can be put back alone."""
    g = b.g
    q, k, v = n.input[:3]
    dt = b.dtype(q)
    hq, hk, d, dv = _heads(n, *(g.tensors[x].shape for x in (q, k, v)))
    three_d = len(g.tensors[q].shape) == 3
    if three_d:
        q, k, v = (_split_heads(b, x, h, size) for x, h, size in ((q, hq, d), (k, hk, d), (v, hk, dv)))
    mask = n.input[3] if len(n.input) > 3 else ""
    past_k, past_v = (n.input[j] if len(n.input) > j else "" for j in (4, 5))
    k, v = (_with_past(b, x, p, n.output[j] if len(n.output) > j else "")
            for x, p, j in ((k, past_k, 1), (v, past_v, 2)))
    if hq != hk:
        k, v = _repeat_heads(b, k, hq // hk, hq), _repeat_heads(b, v, hq // hk, hq)
    kt_shape = _perm(b.tensors[k].shape, (0, 1, 3, 2))
    kt = b.op("Transpose", [k], k, shape=kt_shape, perm=[0, 1, 3, 2])
    qs, ks = b.tensors[q].shape, b.tensors[k].shape
    # the scale's root on each operand, as torch's exporter writes it before opset 23: fp16 scores that
    # ORT's MatMul computes unscaled overflow sooner than its Attention kernel's
    scale = attr(n, "scale", None)
    root = b.scalar(float(np.sqrt(float(scale) if scale is not None else 1.0 / float(np.sqrt(d)))), dt)
    s = b.op("MatMul", [b.op("Mul", [q, root], q), b.op("Mul", [kt, root], kt)], q, shape=(*qs[:3], ks[2]))
    cap = float(attr(n, "softcap", 0.0) or 0.0)
    if cap > 0.0:  # (ORT caps before the mask: a hidden entry stays hidden)
        t = b.op("Tanh", [b.op("Div", [s, b.scalar(cap, dt)], s)], s)
        s = b.op("Mul", [t, b.scalar(cap, dt)], s)
    bias = _bias(b, n, mask, dt, qs[2], ks[2])
    if bias:
        s = b.op("Add", [s, bias], s)
    p = b.op("Softmax", [s], s, axis=-1)
    if mask:  # a row that sees no key: Softmax gives NaN there, ORT's kernel 0 (the fused kernel: 0 already)
        p = b.op("Where", [b.op("IsNaN", [p], p, dtype=TensorProto.BOOL), b.scalar(0.0, dt), p], p)
    y_shape = (*qs[:3], b.tensors[v].shape[3])
    if not three_d:
        b.op("MatMul", [p, v], p, out=n.output[0], shape=y_shape)
        return ()
    y = b.op("MatMul", [p, v], p, shape=y_shape)
    merged = b.op("Transpose", [y], y, shape=_perm(y_shape, (0, 2, 1, 3)), perm=[0, 2, 1, 3])
    b.op("Reshape", [merged, b.ints([0, 0, hq * dv])], merged, out=n.output[0], shape=(*qs[:1], qs[2], hq * dv))
    return ()


def _bias(b: "_Builder", n: onnx.NodeProto, mask: str, dt: int, sq: Dim, t: Dim) -> str:
    """The additive bias of the mask and the causal rule together ("" for none), in the data's type, as
    torch's exporter writes a boolean mask (Where(mask, 0, -inf)) before opset 23; computed from the mask
    alone, so its ops fuse into one kernel of their own, as an exported mask's do. One for every Attention
    with the same mask and causal rule (a model's layers): written once, read by each."""
    k = b.g.tensors[n.input[1]].shape
    causal = None
    if attr(n, "is_causal", 0):
        new = k[1] if len(k) == 3 else k[2]
        causal = (sq, t, t - new) if _static(sq, t, new) else ("iota", sq, t)
    key = ("attention bias", mask, dt, causal)
    if key not in b.memo:
        b.memo[key] = _new_bias(b, n, mask, dt, sq, t)
    return b.memo[key]


def _new_bias(b: "_Builder", n: onnx.NodeProto, mask: str, dt: int, sq: Dim, t: Dim) -> str:
    seen = _causal_rule(b, n, sq, t) if attr(n, "is_causal", 0) else None
    zero, neg_inf = b.scalar(0.0, dt), b.scalar(float("-inf"), dt)

    def causal_bias() -> str:
        if isinstance(seen, np.ndarray):
            return _constant(b, np.where(seen, 0.0, -np.inf), dt)
        return b.op("Where", [seen, zero, neg_inf], seen, dtype=dt)
    if not mask:  # the causal rule alone: a constant bias (nothing for a fold to replace, so restore finds
        return causal_bias() if seen is not None else ""  # every split op), or the iotas' Where
    if b.dtype(mask) != TensorProto.BOOL:  # at or below the type's lowest: hidden, as ORT treats it
        wide = mask if b.dtype(mask) == _F32 else b.op("Cast", [mask], mask, dtype=_F32, to=_F32)
        low = b.op("LessOrEqual", [wide, b.scalar(_LOWEST[dt], _F32)], wide, dtype=TensorProto.BOOL)
        bias = b.op("Where", [low, neg_inf, mask], mask)
        if seen is not None:
            bias = b.op("Add", [bias, causal_bias()], bias, shape=_with_rows(b.tensors[bias].shape, sq, t))
        return bias
    if seen is not None:
        rule = _constant(b, seen, TensorProto.BOOL) if isinstance(seen, np.ndarray) else seen
        mask = b.op("And", [mask, rule], mask, shape=_with_rows(b.tensors[mask].shape, sq, t))
    return b.op("Where", [mask, zero, neg_inf], mask, dtype=dt)


def _with_rows(shape: tuple[Dim, ...], sq: Dim, t: Dim) -> tuple[Dim, ...]:
    """A mask's shape broadcast with the causal rule's [Sq, T] (where a dim is another name for T, the mask's)."""
    return broadcast(shape, (sq, t)) or broadcast(shape, (sq, shape[-1] if shape else t)) or tuple(shape)


def _heads(n: onnx.NodeProto, q: tuple[Dim, ...], k: tuple[Dim, ...], v: tuple[Dim, ...]
           ) -> Optional[tuple[int, int, int, int]]:
    """(query heads, key/value heads, head size of Q and K, of V), all static, query heads a multiple of the
    key/value heads; None where not so."""
    if len(q) == 4:
        hq, hk, d, dv, vk = q[1], k[1], q[3], v[3], v[1]
        if k[3] != d:
            return None
    else:
        hq, hk = attr(n, "q_num_heads", 0), attr(n, "kv_num_heads", 0)
        if not all(isinstance(x, int) for x in (q[2], k[2], v[2])) or hq <= 0 or hk <= 0 \
                or q[2] % hq or k[2] % hk or v[2] % hk or q[2] // hq != k[2] // hk:
            return None
        d, dv, vk = q[2] // hq, v[2] // hk, hk
    if not all(isinstance(x, int) and x > 0 for x in (hq, hk, d, dv, vk)) or vk != hk or hq % hk:
        return None
    return hq, hk, d, dv


def _keys(g: Graph, n: onnx.NodeProto, k: tuple[Dim, ...]) -> Optional[Dim]:
    """The keys' count (past and new): the present key's dim as inferred, else the new keys' count where there
    is no past; None where unknown."""
    present = g.tensors.get(n.output[1]) if len(n.output) > 1 and n.output[1] else None
    if present is not None and present.shape is not None and len(present.shape) == 4:
        return present.shape[2]
    if len(n.input) > 4 and n.input[4]:
        past = g.tensors[n.input[4]].shape[2]
        new = k[1] if len(k) == 3 else k[2]
        return past + new if isinstance(past, int) and isinstance(new, int) else None
    return k[1] if len(k) == 3 else k[2]


def _perm(shape: tuple[Dim, ...], perm: tuple[int, ...]) -> tuple[Dim, ...]:
    return tuple(shape[p] for p in perm)


def _split_heads(b: "_Builder", x: str, heads: int, size: int) -> str:
    """[B, S, H·D] -> [B, H, S, D]."""
    bs, s, _ = b.tensors[x].shape
    r = b.op("Reshape", [x, b.ints([0, 0, heads, size])], x, shape=(bs, s, heads, size))
    return b.op("Transpose", [r], r, shape=(bs, heads, s, size), perm=[0, 2, 1, 3])


def _with_past(b: "_Builder", x: str, past: str, present: str) -> str:
    """The keys (or values) after the past's along the sequence, written to `present` where it is used."""
    out = present if present and b.g.used(present) else None
    if not past:
        return b.op("Identity", [x], x, out=out) if out else x
    known = b.g.tensors.get(present) if present else None
    pd, xd = b.tensors[past].shape[2], b.tensors[x].shape[2]
    if known is not None and known.shape is not None and len(known.shape) == 4:
        total: Dim = known.shape[2]
    else:
        total = pd + xd if isinstance(pd, int) and isinstance(xd, int) else f"{pd} + {xd}"
    shape = (*b.tensors[x].shape[:2], total, b.tensors[x].shape[3])
    return b.op("Concat", [past, x], x, out=out, shape=shape, axis=2)


def _repeat_heads(b: "_Builder", x: str, times: int, heads: int) -> str:
    """[B, Hkv, T, D] -> [B, Hkv·times, T, D], each head repeated `times` times in place (repeat_kv)."""
    bs, hk, t, d = b.tensors[x].shape
    u = b.op("Unsqueeze", [x, b.ints([2])], x, shape=(bs, hk, 1, t, d))
    e = b.op("Expand", [u, b.ints([1, 1, times, 1, 1])], u, shape=(bs, hk, times, t, d))
    return b.op("Reshape", [e, b.ints([0, heads, -1, d])], e, shape=(bs, heads, t, d))


def _static(*dims: Dim) -> bool:
    return all(isinstance(x, int) for x in dims)


def _causal_rule(b: "_Builder", n: onnx.NodeProto, sq: Dim, t: Dim) -> Union[np.ndarray, str, None]:
    """[Sq, T] bools: key j is seen by query i where j <= i + the past's length (T - the new keys); None for
    one query after a past, which ORT's kernel lets see every key (attention.cc: is_causal && !(q == 1 &&
    past > 0)), however many keys are new. A constant over static lengths; over symbolic ones (no past:
    `splittable`) j <= i over two iotas read through Shape, which the attention kernel computes in place."""
    k = b.g.tensors[n.input[1]].shape
    new = k[1] if len(k) == 3 else k[2]
    if not _static(sq, t, new):
        axis = 1 if len(k) == 3 else 2
        i = b.op("Unsqueeze", [_iota(b, n.input[0], axis, sq), b.ints([1])], "", shape=(sq, 1),
                 dtype=TensorProto.INT64)
        return b.op("LessOrEqual", [_iota(b, n.input[1], axis, t), i], "", shape=(sq, t), dtype=TensorProto.BOOL)
    past = t - new
    if sq == 1 and past > 0:
        return None
    return np.arange(t)[None, :] <= np.arange(sq)[:, None] + past


def _iota(b: "_Builder", x: str, axis: int, length: Dim) -> str:
    """Range(0, x's dim at `axis`): the dim read as torch's exporter reads a sym_size (Shape with start and end)."""
    size = b.op("Shape", [x], "", shape=(1,), dtype=TensorProto.INT64, start=axis, end=axis + 1)
    scalar = b.op("Squeeze", [size], "", shape=(), dtype=TensorProto.INT64)
    zero, one = b.scalar(0, TensorProto.INT64), b.scalar(1, TensorProto.INT64)
    return b.op("Range", [zero, scalar, one], "", shape=(length,), dtype=TensorProto.INT64)


def _constant(b: "_Builder", value: np.ndarray, dtype: int) -> str:
    name = b.name("causal")
    b.initializers.append(helper.make_tensor(name, dtype, value.shape, value.astype(np.float32).reshape(-1).tolist())
                          if dtype == TensorProto.BFLOAT16 else
                          numpy_helper.from_array(value.astype(helper.tensor_dtype_to_np_dtype(dtype)), name))
    b.tensors[name] = TensorInfo(name, dtype, tuple(value.shape))
    b.constants.append(name)
    return name


def declined(g: Graph, regions: Sequence, splits: Sequence) -> tuple[set[int], int]:
    """(ids of the regions to leave out, how many ONNX Attentions that puts back): an Attention the search took
    no attention kernel for goes back to ORT whole (`contrib.restore`), ORT's fused kernel rather than its ops
    unfused around a kernel of ours (the softmax alone, say), where leaving out the regions that hold its split
    ops costs nothing else: every split op still in `g` (a fold may have replaced some), those regions holding
    split ops of such Attentions alone (not a rotary embedding's, not a projection's epilogue), and what its
    split ops make read by no other node (a later layer's split ops may read the first layer's mask bias where
    that layer goes back too)."""
    at = {n.name: i for i, n in enumerate(g.nodes)}
    attention = {i for r in regions if r.kind == "attention" for i in r.nodes}
    mine: dict[int, set[int]] = {}
    for k, s in enumerate(splits):
        names = s.parts[0].names
        if s.original.op_type == "Attention" and s.original.domain in ("", "ai.onnx") \
                and all(x in at for x in names) and not any(at[x] in attention for x in names):
            mine[k] = {at[x] for x in names}
    while True:
        ours = set().union(*mine.values()) if mine else set()
        touched = [r for r in regions if ours & set(r.nodes)]
        made = {k: {o for i in nodes for o in g.nodes[i].output if o} - set(splits[k].original.output)
                for k, nodes in mine.items()}
        bad = {k for k, nodes in mine.items()
               if any(nodes & set(r.nodes) and not set(r.nodes) <= ours for r in touched)
               or any(c not in ours for o in made[k] for c in g.consumers.get(o, ()))}
        if not bad:
            return {r.id for r in touched}, len(mine)
        for k in bad:
            del mine[k]

"""ONNX's RotaryEmbedding (opset 23 on: torch's exporter writes it for transformers' apply_rotary_pos_emb from
opset 23) written as the ops transformers' rotate_half exports, which the attention search folds into the
kernel that reads Q or K (`search.attention.Rope`); `rewriter.contrib` puts it back where nothing fused it.

The function (ONNX's, and ORT 1.31.1's kernel's where ORT runs it; tests/rewriter/test_onnx_rotary.py):
with R the rotary_embedding_dim (0: the head size) and cos, sin [B, S, R/2] (or gathered from [P, R/2] caches
at position_ids), out = x[..., :R] * Concat(cos, cos) + Concat(-x[..., R/2:R], x[..., :R/2]) * Concat(sin, sin),
then x[..., R:] unchanged, over the heads of x [B, H, S, D] (or [B, S, H·D] with num_heads). ORT's kernel
refuses caches of batch 1 for a larger batch, which torch's exporter writes; ONNX's function broadcasts them,
and so do these ops.

Not split: interleaved rotation; sizes not static (head size, R); data or caches not one float type; opsets
after 24 or attributes other than opset 23's (a later version's function is not known to be this one)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import onnx
from onnx import TensorProto

from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.constant_cones import draws
from ortfuse.rewriter.graph import Dim, Graph

if TYPE_CHECKING:
    from ortfuse.rewriter.contrib import _Builder

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def splittable(g: Graph, n: onnx.NodeProto) -> bool:
    """Whether `n` (a RotaryEmbedding in the default domain) can be written as the rotate_half ops."""
    if g.opset not in (23, 24) or attr(n, "interleaved", 0) or len(n.input) < 3 \
            or any(a.name not in ("interleaved", "num_heads", "rotary_embedding_dim") for a in n.attribute):
        return False
    x, cos, sin = (g.tensors.get(t) for t in n.input[:3])
    if any(t is None or t.shape is None or t.dtype not in _FLOATS for t in (x, cos, sin)) \
            or len({x.dtype, cos.dtype, sin.dtype}) != 1 or len(x.shape) not in (3, 4):
        return False
    head = _head(n, x.shape)
    rot = attr(n, "rotary_embedding_dim", 0) or head
    positions = len(n.input) > 3 and bool(n.input[3])
    half = cos.shape[-1] if cos.shape else None
    return head is not None and rot % 2 == 0 and 0 < rot <= head and half == rot // 2 \
        and cos.shape == sin.shape and len(cos.shape) == (2 if positions else 3)


def expand(b: "_Builder", n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    """The rotate_half ops (appended to `b`); nothing that can be put back alone."""
    x, cos, sin = n.input[:3]
    shape = b.tensors[x].shape
    head = _head(n, shape)
    rot = attr(n, "rotary_embedding_dim", 0) or head
    positions = n.input[3] if len(n.input) > 3 else ""
    if len(shape) == 3:  # [B, S, H·D] -> [B, S, H, D], the caches broadcast over H (axis 2)
        heads = shape[2] // head
        xx = b.op("Reshape", [x, b.ints([0, 0, heads, head])], x, shape=(shape[0], shape[1], heads, head))
        rows, at = (shape[0], shape[1]), 2
    else:
        xx, rows, at = x, (shape[0], shape[2]), 1
    cos_full, sin_full = (_cache(b, c, positions, rows, rot, at) for c in (cos, sin))
    part = _slice(b, xx, 0, rot) if rot < head else xx
    low, high = _slice(b, part, 0, rot // 2), _slice(b, part, rot // 2, rot)
    turned = b.op("Concat", [b.op("Neg", [high], high), low], part, axis=-1)
    last = len(shape) == 4 and rot == head
    out = b.op("Add", [b.op("Mul", [part, cos_full], part), b.op("Mul", [turned, sin_full], part)], part,
               out=n.output[0] if last else None)
    if rot < head:
        out = b.op("Concat", [out, _slice(b, xx, rot, head)], xx, axis=-1,
                   out=n.output[0] if len(shape) == 4 else None)
    if len(shape) == 3:
        b.op("Reshape", [out, b.ints([0, 0, shape[2]])], x, out=n.output[0], shape=shape)
    return ()


def _head(n: onnx.NodeProto, shape: tuple[Dim, ...]) -> int | None:
    """The head size: x's last dim (4-D), or its hidden size over num_heads (3-D); None where not static."""
    if len(shape) == 4:
        return shape[3] if isinstance(shape[3], int) else None
    heads = attr(n, "num_heads", 0)
    return shape[2] // heads if isinstance(shape[2], int) and heads > 0 and shape[2] % heads == 0 else None


def _slice(b: "_Builder", x: str, start: int, end: int) -> str:
    shape = b.tensors[x].shape
    return b.op("Slice", [x, b.ints([start]), b.ints([end]), b.ints([-1])], x, shape=(*shape[:-1], end - start))


def _cache(b: "_Builder", c: str, positions: str, rows: tuple[Dim, Dim], rot: int, at: int) -> str:
    """cos or sin for every element of x's rotated part: [B, S, R/2] (gathered at the positions), twice along
    the last axis, with a unit axis for the heads at `at`. One for every RotaryEmbedding whose cache is the
    same computation: torch's exporter writes the cos and sin again for each (Q and K of every layer), which
    would be a kernel each."""
    key = ("rotary cache", _cone(b.g, c, {}), positions, rot, at)
    if key not in b.memo:
        b.memo[key] = (_new_cache(b, c, positions, rows, rot, at), c)
    prepared, source = b.memo[key]
    if source != c:  # (put back, the node reads the tensor this one was prepared from: the same value)
        b.substitutes[c] = source
    return prepared


def _cone(g: Graph, t: str, memo: dict, depth: int = 0) -> tuple:
    """What computes `t`, as a value: its producers' ops, attributes and which output, down to constants and
    graph inputs (by name); `t` itself past MAX_CONE levels, at an op of another domain or a random one."""
    if t in memo:
        return memo[t]
    p = g.producer.get(t)
    n = g.nodes[p] if p is not None else None
    if n is None or depth >= MAX_CONE or n.domain not in ("", "ai.onnx") or t in g.constants or draws(n.op_type):
        memo[t] = ("tensor", t)
    else:
        memo[t] = (n.op_type, list(n.output).index(t), tuple(sorted(a.SerializeToString() for a in n.attribute)),
                   tuple(_cone(g, x, memo, depth + 1) if x else () for x in n.input))
    return memo[t]


MAX_CONE = 16  # levels followed back from a cache (positions, inverse frequencies, a product, cos)


def _new_cache(b: "_Builder", c: str, positions: str, rows: tuple[Dim, Dim], rot: int, at: int) -> str:
    if positions:
        c = b.op("Gather", [c, positions], c, shape=(*rows, rot // 2), axis=0)
    lead = b.tensors[c].shape[:-1]
    both = b.op("Concat", [c, c], c, shape=(*lead, rot), axis=-1)
    return b.op("Unsqueeze", [both, b.ints([at])], both, shape=(*lead[:at], 1, *lead[at:], rot))

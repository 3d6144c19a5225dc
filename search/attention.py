"""Attention as exporters emit it: MatMul(Q, Kᵀ) → element-wise score ops (scale, mask) → Softmax over the
last axis → (Cast) → MatMul(P, V), with the layout ops around it that fold into a kernel's addressing.

One matcher serves every exporter variant. It starts at each Softmax and walks the graph one local rule
at a time: back to the scores MatMul, forward to the MatMul with V, then along the layout paths of Q, K,
V and the output. A path stops at the first tensor that is also used outside the pattern (that tensor
becomes the kernel input) or at the first node that is not a layout op or a scalar scale. Every refusal
is a `Reject` naming the Softmax and the rule that failed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NoReturn

import onnx

from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.graph import Graph, per_graph
from ortfuse.search import ops
from ortfuse.search.ops import ELEMENTWISE
from ortfuse.search.plan import Reject

# ortfuse_attention.h keeps one row of Q and of the output accumulator in registers per thread group.
MAX_HEAD_DIM = 128
# Longest element-wise chain between the two MatMuls we accept; exporters emit 1 to 3 (scale, mask, Cast).
MAX_SCORE_OPS = 8
# Ops between the Softmax and the MatMul with V: only value-preserving ones (exporters add Casts).
PROB_OPS = frozenset({"Cast", "Identity"})  # and the NaN guard of scaled_dot_product_attention (_nan_guard)
# Layout ops that fold into a kernel's element-offset functions. An Expand (with a constant target) reads
# its input at 0 along the broadcast axes: grouped-query attention's K and V repeated across the query heads
# (Llama's repeat_kv: Unsqueeze, Expand, Reshape) are read where they are, never materialized.
LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand"})
# Ops that select a part of their input, on operand paths only: the Split of a packed QKV projection
# (GPT-2's c_attn, BERT's after `rewriter.gemm_packing.pack_sibling_gemms`) and constant Slices fold into
# the offset as a start along one axis. All of a Split's outputs must stay inside the pattern.
SELECT_OPS = frozenset({"Split", "Slice"})
# Kernel storage types: fp32 accumulation of fp32 / fp16 / bf16 data.
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


@dataclass(frozen=True)
class Rope:
    """A rotary embedding on the Q or K path, as HF's apply_rotary_pos_emb exports it: out = x * cos +
    Concat(-x[..., R/2:], x[..., :R/2]) * sin (rotate_half), x [.., S, R] on the path; partial (GPT-NeoX,
    Phi-2): the first R of D columns rotated so and the rest passed through, Concat(rope(x[..., :R]),
    x[..., R:]). The kernel rotates the rows it loads; cos and sin (broadcast over heads) are read where the
    rotation needs them."""
    out: str  # the rotated tensor (the path continues from it toward the MatMul)
    x: str  # the tensor rotated (the path continues from it toward the kernel input)
    nodes: tuple[int, ...]  # Mul, Slice, Slice, Neg, Concat, Mul, Add (partial: and Slice, Slice, Concat)
    rotated: str  # the rotation's Add: `out`, or (partial) the first part of out's Concat
    within: str  # the tensor the rotation reads: `x`, or (partial) its first R columns
    half: int  # R / 2: columns c and c + R / 2 are rotated together


@dataclass(frozen=True)
class AttentionPattern:
    qk: int  # the MatMul producing the scores [.., Sq, Sk]
    pv: int  # the MatMul(probabilities, V)
    softmax: int  # Softmax over the last axis
    score_ops: tuple[int, ...]  # element-wise nodes between qk and softmax, topological order
    prob_ops: tuple[int, ...]  # Cast/Identity nodes (and an IsNaN, Where guard) between softmax and pv, in order
    q_path: tuple[int, ...]  # layout and scalar-scale nodes from q to qk's first input, topological order
    k_path: tuple[int, ...]  # same, from k to qk's second input (Kᵀ)
    v_path: tuple[int, ...]  # same, from v to pv's second input
    out_path: tuple[int, ...]  # layout nodes after pv, topological order; possibly empty
    q: str  # kernel inputs: the tensors at the far ends of the paths
    k: str
    v: str
    output: str  # the last tensor of out_path, or pv's output
    extra_inputs: tuple[str, ...]  # non-scalar tensors the score ops read (masks), first use first
    nodes: tuple[int, ...]  # every node above, sorted
    q_rope: Rope | None = None  # a rotary embedding on the Q path (its nodes are in q_path)
    k_rope: Rope | None = None


class _NoMatch(Exception):
    """Internal: the reason one Softmax is not an attention pattern (becomes a Reject)."""


def _refuse(reason: str) -> NoReturn:
    raise _NoMatch(reason)


@per_graph
def find_attention(g: Graph) -> tuple[tuple[AttentionPattern, ...], tuple[Reject, ...]]:
    """Every Softmax either yields an AttentionPattern or a Reject saying why not (once per graph: the
    search, the rewriter's packing check and the lowering all ask)."""
    found: list[AttentionPattern] = []
    rejects: list[Reject] = []
    owner: dict[int, int] = {}  # node -> the Softmax of the pattern holding it: patterns are disjoint
    for i, n in enumerate(g.nodes):
        if n.op_type != "Softmax" or n.domain not in ("", "ai.onnx"):
            continue
        try:
            p = _find(g, i, k_rope=True)
        except _NoMatch as e:
            rejects.append(Reject(g.node_label(i), str(e)))
            continue
        shared = sorted(set(p.nodes) & owner.keys())
        if shared:  # (one attention's output read by the next through layout ops alone: no projection between)
            rejects.append(Reject(g.node_label(i), f"its path shares {g.node_label(shared[0])} with the attention "
                                                   f"at {g.node_label(owner[shared[0]])}"))
            continue
        found.append(p)
        owner.update(dict.fromkeys(p.nodes, i))
    return tuple(found), tuple(rejects)


@per_graph
def k_rope_outside(g: Graph) -> dict[int, AttentionPattern]:
    """By Softmax, each pattern of `find_attention` that rotates K, matched again with K's path stopping at the
    rotary embedding's output: the kernel reads K rotated once by other nodes instead of rotating every K
    tile it loads (each of a head's query-row units, and each query head of a group, rotates them again)."""
    out = {}
    for p in find_attention(g)[0]:
        if p.k_rope is not None:
            try:
                out[p.softmax] = _find(g, p.softmax, k_rope=False)
            except _NoMatch:
                pass
    return out


def pattern_of(g: Graph, nodes: Iterable[int]) -> AttentionPattern | None:
    """The pattern (`find_attention`'s, or one of `k_rope_outside`) whose nodes are exactly `nodes`."""
    key = tuple(sorted(nodes))
    return next((p for p in (*find_attention(g)[0], *k_rope_outside(g).values()) if p.nodes == key), None)


def _find(g: Graph, sm: int, k_rope: bool) -> AttentionPattern:
    select = True
    pat = _match(g, sm, select, runtime=True, k_rope=k_rope)
    if _leaking_selects(g, pat):  # e.g. K and V also returned as a KV cache: stop at the Split
        select = False
        pat = _match(g, sm, select, runtime=True, k_rope=k_rope)
    if not _targets_rebuilt(g, pat):  # stop at Reshapes whose run-time targets cannot be rebuilt
        pat = _match(g, sm, select, runtime=False, k_rope=k_rope)
    return pat


def absorbed_selects(g: Graph, k_rope: str = "auto") -> set[str]:
    """Names of the Split/Slice nodes that an attention pattern reads through (they cost no kernel), and,
    unless K's rotary embedding stays in the kernel (`k_rope` "kernel", `--k-rope`), that it still reads
    through with the rotation outside it (`k_rope_outside`): a packed projection's Split that K leaves for
    its rotation is better as a Slice per result (`rewriter.gemm_packing`), so the rotation's kernel reads K
    through its own Slice where the search takes it out of the attention."""
    outside = k_rope_outside(g) if k_rope != "kernel" else {}
    return {g.nodes[i].name for p in find_attention(g)[0] for i in outside.get(p.softmax, p).nodes
            if g.nodes[i].op_type in SELECT_OPS and i in p.nodes}


def _targets_rebuilt(g: Graph, pat: AttentionPattern) -> bool:
    """Whether the run-time shapes the pattern's Reshapes read are made of its inputs' dims
    (`legal.shape_reads`), so the fused node's function can rebuild them."""
    return _rebuilt(g, set(pat.nodes))


def _rebuilt(g: Graph, nodes: set[int]) -> bool:
    """Whether the run-time shapes these nodes read (Reshape targets, Range lengths) are made of their
    inputs' dims (`legal.shape_reads`)."""
    from ortfuse.search import legal
    inputs, _ = legal.region_io(g, nodes)
    return legal.shape_reads(g, nodes, inputs) is not None


def _leaking_selects(g: Graph, pat: AttentionPattern) -> bool:
    """Whether a Split/Slice in the pattern has an output used outside it (then it cannot be absorbed)."""
    inside = set(pat.nodes)
    for i in inside:
        n = g.nodes[i]
        if n.op_type in SELECT_OPS:
            for o in n.output:
                if o in g.graph_outputs or not set(g.consumers.get(o, ())) <= inside:
                    return True
    return False


def _match(g: Graph, sm: int, select: bool, runtime: bool = False, k_rope: bool = True) -> AttentionPattern:
    scores = _shape(g, g.nodes[sm].input[0])
    axis = attr(g.nodes[sm], "axis", -1 if g.opset >= 13 else 1)
    if len(scores) < 2 or not -len(scores) <= axis < len(scores) or axis % len(scores) != len(scores) - 1:
        _refuse(f"Softmax over axis {axis} of a rank-{len(scores)} tensor, not the last axis")
    qk, score_ops = _scores_back(g, sm)
    prob_ops, pv = _probs_forward(g, sm)
    q_path, q, q_rope = _rotated_path_back(g, g.nodes[qk].input[0], qk, select, runtime)
    k_path, k, k_rope = _rotated_path_back(g, g.nodes[qk].input[1], qk, select, runtime, k_rope)
    v_path, v = _path_back(g, g.nodes[pv].input[1], pv, select, runtime)
    (q_path, q), (k_path, k), (v_path, v) = _joined_paths(g, ((q_path, q), (k_path, k), (v_path, v)), select, runtime)
    out_path, output = _path_forward(g, g.nodes[pv].output[0], runtime)
    nodes = (qk, pv, sm, *score_ops, *prob_ops, *q_path, *k_path, *v_path, *out_path)  # paths may share a Split
    _check_shapes(g, qk, pv, nodes)
    chain = {g.nodes[qk].output[0], *(g.nodes[p].output[0] for p in score_ops)}
    for p in score_ops:
        n = g.nodes[p]
        into = next(x for x in n.input if x in chain)
        if n.op_type != "Reshape" and _shape(g, n.output[0]) != _shape(g, into):
            _refuse(f"{g.node_label(p)} broadcasts the scores {_shape(g, into)} to {_shape(g, n.output[0])}")
    if _shape(g, g.nodes[pv].input[0]) != _shape(g, g.nodes[qk].output[0]):
        _refuse(f"the probabilities reach {g.node_label(pv)} as {_shape(g, g.nodes[pv].input[0])}, the scores "
                f"are {_shape(g, g.nodes[qk].output[0])}")
    extra = _extra_inputs(g, qk, score_ops)
    cones = {x: _computed_input(g, x, set(score_ops)) for x in extra}
    for x, cone in cones.items():
        if cone and _rebuilt(g, set(nodes) | cone):
            nodes += tuple(cone)
        else:
            cones[x] = frozenset()
    return AttentionPattern(qk, pv, sm, score_ops, prob_ops, q_path, k_path, v_path, out_path, q, k, v, output,
                            tuple(x for x in extra if not cones[x]), tuple(sorted(set(nodes))), q_rope, k_rope)


# ---- the score chain: MatMul → element-wise ops → Softmax ------------------------------------------------

def _scores_back(g: Graph, sm: int) -> tuple[int, tuple[int, ...]]:
    """(qk MatMul, score ops in topological order), walking back from the Softmax input."""
    t, ops = g.nodes[sm].input[0], []
    while True:
        p = g.producer.get(t)
        if p is None:
            _refuse(f"the Softmax input '{t}' is not computed by a MatMul")
        n = g.nodes[p]
        _single_use(g, t, "scores")
        if n.op_type == "MatMul" and n.domain in ("", "ai.onnx"):
            return p, tuple(reversed(ops))
        regroup = _regroups_batch(g, n)
        if (n.op_type not in ELEMENTWISE and not regroup) or n.domain not in ("", "ai.onnx"):
            _refuse(f"the scores come from {g.node_label(p)}, not from a MatMul through element-wise ops")
        if len(ops) == MAX_SCORE_OPS:
            _refuse(f"more than {MAX_SCORE_OPS} element-wise ops between the MatMul and the Softmax")
        _check_score_op(g, p, t)
        ops.append(p)
        t = n.input[0] if regroup else _chain_input(g, p, MAX_SCORE_OPS - len(ops))


def _regroups_batch(g: Graph, n: onnx.NodeProto) -> bool:
    """A Reshape that only splits or merges the leading (batch and head) dims of scores or probabilities,
    keeping the last two (queries, keys): BLOOM's and DeBERTa's [B*H, Sq, Sk] viewed as [B, H, Sq, Sk] around
    the mask and back. Its target may be computed at run time (rebuilt from the region's dims)."""
    if n.op_type != "Reshape" or n.domain not in ("", "ai.onnx"):
        return False
    src, out = (g.tensors[t].shape if t in g.tensors else None for t in (n.input[0], n.output[0]))
    return src is not None and out is not None and len(src) >= 3 and len(out) >= 3 and \
        tuple(src[-2:]) == tuple(out[-2:]) and None not in src and None not in out


def _chain_input(g: Graph, p: int, depth: int) -> str:
    """The input of score op `p` that leads back to the scores MatMul (the others are masks, constants)."""
    n = g.nodes[p]
    leads = [x for x in dict.fromkeys(n.input) if x and x not in g.constants and _reaches_matmul(g, x, depth)]
    if not leads:
        _refuse(f"no MatMul before {g.node_label(p)} within {MAX_SCORE_OPS} element-wise ops")
    if len(leads) > 1:
        _refuse(f"{g.node_label(p)} combines two MatMul results ({', '.join(leads)})")
    external = [x for x in n.input if x and x != leads[0] and x not in g.constants]
    if len(external) > 1:
        _refuse(f"{g.node_label(p)} reads {len(external)} non-constant tensors besides the scores")
    return leads[0]


def _reaches_matmul(g: Graph, t: str, depth: int) -> bool:
    p = g.producer.get(t)
    if p is None:
        return False
    n = g.nodes[p]
    if n.op_type == "MatMul":
        return True
    if depth > 0 and _regroups_batch(g, n):
        return _reaches_matmul(g, n.input[0], depth - 1)
    return depth > 0 and n.op_type in ELEMENTWISE and any(
        _reaches_matmul(g, x, depth - 1) for x in n.input if x and x not in g.constants)


def _check_score_op(g: Graph, p: int, out: str) -> None:
    info = g.info(out)
    if info.dtype not in FLOAT_TYPES:
        _refuse(f"{g.node_label(p)} yields {onnx.TensorProto.DataType.Name(info.dtype)} scores")


def _extra_inputs(g: Graph, qk: int, score_ops: tuple[int, ...]) -> tuple[str, ...]:
    """Tensors the score ops read besides the chain itself, scalar constants excluded (they fold into code)."""
    chain = {g.nodes[qk].output[0], *(g.nodes[p].output[0] for p in score_ops)}
    extra: dict[str, None] = {}
    for p in score_ops:
        for x in g.nodes[p].input[:1] if g.nodes[p].op_type == "Reshape" else g.nodes[p].input:
            if x and x not in chain and not _scalar_const(g, x):
                extra[x] = None
    return tuple(extra)


def _computed_input(g: Graph, t: str, readers: set[int]) -> frozenset[int]:
    """The nodes computing score input `t` from Range iotas and constants alone (`iota.iota_cone`: a causal rule
    as ONNX's Attention is split over symbolic lengths, or torch's Trilu mask rewritten), read by nothing but
    each other and `readers`, each Range of a length the kernel knows: the kernel computes `t` from the
    element's coordinates, so no [Sq, T] tensor is made or read. (`isolate_iotas` gave every reader its own
    copy; a mask also reading a tensor, a padding mask, is read as it is: a kernel of its own makes it once
    for every layer.) Empty where `t` is not such a tensor."""
    from ortfuse.rewriter import iota
    from ortfuse.search import legal
    cone = iota.iota_cone(g, t, {}) or frozenset()
    inside = cone | readers
    for i in cone:
        n = g.nodes[i]
        if n.op_type == "Range" and legal.range_length_verdict(g, n) is not None \
                or n.op_type != "Range" and not all(x in g.constants for x in ops.meta_inputs(n)) \
                or any(o in g.graph_outputs or not set(g.consumers.get(o, ())) <= inside for o in n.output):
            return frozenset()
    return cone


# ---- probabilities: Softmax → Cast/Identity → MatMul(P, V) ---------------------------------------------

def _probs_forward(g: Graph, sm: int) -> tuple[tuple[int, ...], int]:
    t, ops = g.nodes[sm].output[0], []
    while True:
        guard = _nan_guard(g, t)
        if guard is not None:  # the kernel's rows that see only -inf are 0 already (ortfuse_attention.h)
            ops.extend(guard)
            t = g.nodes[guard[1]].output[0]
            continue
        users = set(g.consumers.get(t, ()))
        if t in g.graph_outputs or len(users) != 1:
            _refuse("probabilities used outside the attention")
        c = next(iter(users))
        n = g.nodes[c]
        if n.op_type == "MatMul" and n.domain in ("", "ai.onnx"):
            if n.input[0] != t or n.input[1] == t:
                _refuse(f"probabilities are not the left operand of {g.node_label(c)}")
            return tuple(ops), c
        if (n.op_type not in PROB_OPS and not _regroups_batch(g, n)) or n.domain not in ("", "ai.onnx") \
                or len(ops) == MAX_SCORE_OPS:
            _refuse(f"probabilities feed {g.node_label(c)}, not a MatMul with V")
        if g.info(n.output[0]).dtype not in FLOAT_TYPES:
            _refuse(f"{g.node_label(c)} casts the probabilities to a non-float type")
        ops.append(c)
        t = n.output[0]


def _nan_guard(g: Graph, t: str) -> tuple[int, int] | None:
    """(IsNaN, Where) of Where(IsNaN(p), 0, p) on the probabilities `t`, as torch's scaled_dot_product_attention
    exports (transformers' default attention): rows whose every score is -inf become 0 instead of NaN. None if
    `t` is not read exactly so."""
    users = set(g.consumers.get(t, ()))
    if t in g.graph_outputs or len(users) != 2:
        return None
    isnan = next((c for c in users if g.nodes[c].op_type == "IsNaN"), None)
    where = next((c for c in users if g.nodes[c].op_type == "Where"), None)
    if isnan is None or where is None:
        return None
    flag, n = g.nodes[isnan].output[0], g.nodes[where]
    if (flag in g.graph_outputs or set(g.consumers.get(flag, ())) != {where} or list(n.input) != [flag, n.input[1], t]
            or not _scalar_const(g, n.input[1]) or float(g.constants[n.input[1]].reshape(-1)[0]) != 0.0
            or g.info(n.output[0]).shape != g.info(t).shape or any(
                g.nodes[i].domain not in ("", "ai.onnx") for i in (isnan, where))):
        return None
    return isnan, where


# ---- layout paths -----------------------------------------------------------------------------------------

def _joined_paths(g: Graph, paths: tuple[tuple[tuple[int, ...], str], ...], select: bool,
                  runtime: bool) -> tuple[tuple[tuple[int, ...], str], ...]:
    """Operand paths that stop at one tensor read by nothing but their first nodes (the Slices of a packed
    QKV projection, one per operand: ONNX's Split as `rewriter.contrib` writes it) continue back from it
    together, each with the shared part first, as paths through one Split do; not to a tensor lacking one of
    the symbolic dims the shared one has (a kernel reading it could not compute that dim: LeViT's batch,
    merged into its rows before the Reshape that splits the heads)."""
    out = list(paths)
    for t in dict.fromkeys(src for _, src in paths):
        ends = [k for k, (path, src) in enumerate(paths) if src == t and path]
        readers = set(g.consumers.get(t, ()))
        if len(ends) < 2 or t in g.graph_outputs or readers != {paths[k][0][0] for k in ends}:
            continue
        shared, src = _path_back(g, t, readers, select, runtime)
        dims, src_dims = (g.tensors[x].shape if x in g.tensors else None for x in (t, src))
        if shared and dims is not None and src_dims is not None \
                and {d for d in dims if isinstance(d, str)} <= set(src_dims):
            for k in ends:
                out[k] = (shared + paths[k][0], src)
    return tuple(out)


def _rotated_path_back(g: Graph, t: str, user: int, select: bool, runtime: bool = False,
                       rope_ok: bool = True) -> tuple[tuple[int, ...], str, Rope | None]:
    """`_path_back`, continued through one rotary embedding (`_rope_at`) where the path stops at one (and
    `rope_ok`)."""
    path, src = _path_back(g, t, user, select, runtime)
    if not rope_ok:
        return path, src, None
    users = {path[0]} if path else {user}
    rope = _rope_at(g, src, users) or _partial_rope_at(g, src, users)
    if rope is None:
        return path, src, None
    x_users = {c for c in g.consumers.get(rope.x, ())}
    before, src = _path_back(g, rope.x, x_users, select, runtime)
    return before + tuple(sorted(rope.nodes)) + path, src, rope


def _rope_at(g: Graph, t: str, users: set[int]) -> Rope | None:
    """The rotary embedding computing `t` (read by `users` alone), or None: Add(Mul(x, cos), Mul(Concat(
    Neg(Slice(x, D/2:D)), Slice(x, 0:D/2)), sin)) over the last axis of x (either operand order), every
    intermediate read only inside it, cos and sin not computed from x."""
    if t in g.graph_outputs or set(g.consumers.get(t, ())) != users:
        return None
    add = g.producer.get(t)
    if add is None or g.nodes[add].op_type != "Add" or len(g.nodes[add].input) != 2:
        return None

    def made(x: str, op: str) -> int | None:
        p = g.producer.get(x)
        return p if p is not None and g.nodes[p].op_type == op and g.nodes[p].domain in ("", "ai.onnx") else None

    for first, second in (tuple(g.nodes[add].input), tuple(reversed(g.nodes[add].input))):
        m1, m2 = made(first, "Mul"), made(second, "Mul")
        if m1 is None or m2 is None:
            continue
        for cat_in in g.nodes[m2].input:
            cat = made(cat_in, "Concat")
            if cat is None or len(g.nodes[cat].input) != 2:
                continue
            neg, low = made(g.nodes[cat].input[0], "Neg"), made(g.nodes[cat].input[1], "Slice")
            high = made(g.nodes[neg].input[0], "Slice") if neg is not None else None
            if high is None or low is None:
                continue
            x = g.nodes[low].input[0]
            if g.nodes[high].input[0] != x or x not in g.nodes[m1].input:
                continue
            shape = g.tensors[x].shape if x in g.tensors else None
            if not shape or not isinstance(shape[-1], int) or shape[-1] % 2:
                continue
            half, last = shape[-1] // 2, len(shape) - 1
            try:
                halves = [select_start(g, g.nodes[s], g.nodes[s].output[0]) for s in (low, high)]
            except (ValueError, KeyError):
                continue
            if halves != [{last: 0}, {last: half}] or attr(g.nodes[cat], "axis", 0) % len(shape) != last or \
                    any(g.tensors[g.nodes[s].output[0]].shape != shape[:-1] + (half,) for s in (low, high)):
                continue
            cos = next(i for i in g.nodes[m1].input if i != x) if list(g.nodes[m1].input).count(x) == 1 else None
            sin = next(i for i in g.nodes[m2].input if i != cat_in) if list(g.nodes[m2].input).count(cat_in) == 1 \
                else None
            nodes = (m1, low, high, neg, cat, m2, add)
            inner = {g.nodes[i].output[0] for i in nodes if i != add}
            if cos is None or sin is None or any(
                    o in g.graph_outputs or not set(g.consumers.get(o, ())) <= set(nodes) for o in inner) or \
                    set(g.consumers.get(x, ())) != {m1, low, high} or x in g.graph_outputs:
                continue
            if any(_computed_from(g, c, x) for c in (cos, sin)) or \
                    any(g.tensors[c].shape is None or g.tensors[c].shape[-1:] != (shape[-1],) for c in (cos, sin)):
                continue
            return Rope(t, x, nodes, t, x, half)
    return None


def _partial_rope_at(g: Graph, t: str, users: set[int]) -> Rope | None:
    """A partial rotary embedding computing `t`: Concat(rope(Slice(x, 0:R)), Slice(x, R:D)) over the last axis,
    the rope as `_rope_at` finds it, x read by the two Slices alone."""
    if t in g.graph_outputs or set(g.consumers.get(t, ())) != users:
        return None
    cat = g.producer.get(t)
    if cat is None or g.nodes[cat].op_type != "Concat" or len(g.nodes[cat].input) != 2:
        return None
    first, rest = g.nodes[cat].input
    inner = _rope_at(g, first, {cat})
    low, high = g.producer.get(inner.x) if inner else None, g.producer.get(rest)
    if inner is None or low is None or high is None or any(g.nodes[i].op_type != "Slice" for i in (low, high)):
        return None
    x = g.nodes[low].input[0]
    shape = g.tensors[x].shape if x in g.tensors else None
    if g.nodes[high].input[0] != x or not shape or not isinstance(shape[-1], int) or x in g.graph_outputs or \
            set(g.consumers.get(x, ())) != {low, high} or set(g.consumers.get(rest, ())) != {cat}:
        return None
    last, r = len(shape) - 1, 2 * inner.half
    try:
        starts = [select_start(g, g.nodes[s], g.nodes[s].output[0]) for s in (low, high)]
    except (ValueError, KeyError):
        return None
    if starts != [{last: 0}, {last: r}] or attr(g.nodes[cat], "axis", 0) % len(shape) != last or \
            g.tensors[inner.x].shape != shape[:-1] + (r,) or g.tensors[rest].shape != shape[:-1] + (shape[-1] - r,):
        return None
    return Rope(t, x, inner.nodes + (low, high, cat), inner.rotated, inner.x, inner.half)


def _computed_from(g: Graph, t: str, x: str, depth: int = 8) -> bool:
    if t == x:
        return True
    p = g.producer.get(t)
    return depth > 0 and p is not None and any(_computed_from(g, i, x, depth - 1) for i in g.nodes[p].input if i)


def _path_back(g: Graph, t: str, user: int | set[int], select: bool,
               runtime: bool = False) -> tuple[tuple[int, ...], str]:
    """Nodes from the path's input to `t` (consumed by `user`, or by exactly the nodes of a set), and that
    input. The walk stops before a tensor used anywhere else, and at the first node that is not a foldable
    layout op, scalar scale or (when `select`) Split/Slice; (unless `runtime`) at a Reshape whose target is
    computed at run time."""
    path: list[int] = []
    users = user if isinstance(user, set) else {user}
    while t not in g.graph_outputs and set(g.consumers.get(t, ())) == users:
        p = g.producer.get(t)
        src = None if p is None else _path_source(g, p, scale_ok=True, select_ok=select, runtime_ok=runtime)
        if src is None:
            break
        path.append(p)
        t, users = src, {p}
    return tuple(reversed(path)), t


def _path_forward(g: Graph, t: str, runtime: bool = False) -> tuple[tuple[int, ...], str]:
    path: list[int] = []
    while t not in g.graph_outputs:
        users = set(g.consumers.get(t, ()))
        if len(users) != 1:
            break
        c = next(iter(users))
        if _path_source(g, c, scale_ok=False, runtime_ok=runtime) != t:
            break
        path.append(c)
        t = g.nodes[c].output[0]
    return tuple(path), t


def _path_source(g: Graph, p: int, scale_ok: bool, select_ok: bool = False, runtime_ok: bool = False) -> str | None:
    """The data input of node `p` if it may sit on a path: a layout op whose shape/axes/perm are
    constants (or, when `runtime_ok`, a Reshape whose target is computed at run time and whose shapes are
    inferred: the fused node rebuilds it, `_targets_rebuilt`), (when `scale_ok`) a Mul/Div by a scalar
    constant (the 1/sqrt(d) scale applied to Q or K), or (when `select_ok`) a Split or unit-step Slice whose
    starts `select_start` can compute."""
    n = g.nodes[p]
    if n.domain not in ("", "ai.onnx"):
        return None
    if select_ok and n.op_type in SELECT_OPS:
        if any(x and x not in g.constants for x in n.input[1:]):
            return None
        try:
            for o in n.output:
                select_start(g, n, o)
        except ValueError:
            return None
        return n.input[0]
    if len(n.output) != 1:
        return None
    if n.op_type in LAYOUT_OPS:
        src, out = (g.tensors[t].shape if t in g.tensors else None for t in (n.input[0], n.output[0]))
        if src is None or out is None:
            return None
        if any(x and x not in g.constants for x in n.input[1:]) and not (
                runtime_ok and n.op_type == "Reshape" and None not in src and None not in out):
            return None  # a shape or axes computed at run time
        if n.op_type == "Expand" and (len(src) > len(out) or any(
                s not in (1, d) for s, d in zip(src, out[len(out) - len(src):]))):
            return None  # not a broadcast of its input to the inferred shape
        return n.input[0]
    if scale_ok and n.op_type == "Mul" and len(n.input) == 2:
        a, b = n.input
        if _scalar_const(g, b) and a not in g.constants:
            return a
        if _scalar_const(g, a) and b not in g.constants:
            return b
    if scale_ok and n.op_type == "Div" and len(n.input) == 2:
        if _scalar_const(g, n.input[1]) and n.input[0] not in g.constants:
            return n.input[0]
    return None


def select_start(g: Graph, n: onnx.NodeProto, out: str, strided: bool = False) -> dict[int, int]:
    """Where output `out` of Split/Slice `n` starts in its input: {axis: first index} (unit steps only, or
    `strided`: any positive constant steps, which `slice_steps` gives). Split starts come from the inferred
    sizes of the outputs before it, so every form of the op (sizes as input, attribute or num_outputs) reads
    the same. Raises ValueError when they are not static."""
    info = g.tensors.get(n.input[0])
    src = None if info is None else info.shape
    if src is None:
        raise ValueError(f"shape of '{n.input[0]}' unknown")
    rank = len(src)
    if n.op_type == "Split":
        axis = attr(n, "axis", 0) % rank
        start = 0
        for o in n.output[:list(n.output).index(out)]:
            shape = g.info(o).shape if o in g.tensors else None
            if shape is None or not isinstance(shape[axis], int):
                raise ValueError(f"Split output '{o}' has no static size along axis {axis}")
            start += shape[axis]
        return {axis: start}
    assert n.op_type == "Slice"
    if g.opset < 10:
        raise ValueError("Slice before opset 10")
    inputs = list(n.input) + [""] * (5 - len(n.input))
    starts, _, axes, steps = (g.constants[x].reshape(-1).tolist() if x else None for x in inputs[1:5])
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    result: dict[int, int] = {}
    for s0, a, st in zip(starts, axes, steps):
        a %= rank
        dim = src[a]
        if not (st == 1 or (strided and st > 1)) or not isinstance(dim, int):
            raise ValueError(f"Slice of axis {a}: only {'positive' if strided else 'unit'} steps on static dims "
                             f"fold into offsets")
        first = min(max(s0 + dim if s0 < 0 else s0, 0), dim)
        result[a] = first
    return result


def slice_steps(g: Graph, n: onnx.NodeProto) -> dict[int, int]:
    """{axis: step} of a Slice with constant steps (1 where none are given)."""
    inputs = list(n.input) + [""] * (5 - len(n.input))
    rank = len(g.tensors[n.input[0]].shape or ())
    starts = g.constants[inputs[1]].reshape(-1).tolist()
    axes = g.constants[inputs[3]].reshape(-1).tolist() if inputs[3] else list(range(len(starts)))
    steps = g.constants[inputs[4]].reshape(-1).tolist() if inputs[4] else [1] * len(starts)
    return {int(a) % rank: int(st) for a, st in zip(axes, steps)}


# ---- checks -------------------------------------------------------------------------------------------------

def _check_shapes(g: Graph, qk: int, pv: int, nodes: Iterable[int]) -> None:
    for i in nodes:
        n = g.nodes[i]
        for t in (*n.input, *n.output):
            if t and t not in g.constants:
                _shape(g, t)
    for m in (qk, pv):
        for t in g.nodes[m].input:
            if len(_shape(g, t)) < 2:
                _refuse(f"{g.node_label(m)} has a 1-D operand '{t}'")
    dtype = g.info(g.nodes[qk].output[0]).dtype
    if dtype not in FLOAT_TYPES:
        _refuse(f"scores of type {onnx.TensorProto.DataType.Name(dtype)}")
    for what, dim in (("head size", _shape(g, g.nodes[qk].input[0])[-1]),
                      ("value head size", _shape(g, g.nodes[pv].input[1])[-1])):
        if not isinstance(dim, int):
            _refuse(f"{what} '{dim}' is not static")
        if dim > MAX_HEAD_DIM:
            _refuse(f"{what} {dim} exceeds the kernel's {MAX_HEAD_DIM}")


def _single_use(g: Graph, t: str, what: str) -> None:
    if t in g.graph_outputs or len(set(g.consumers.get(t, ()))) != 1:
        _refuse(f"{what} '{t}' used outside the attention")


def _shape(g: Graph, t: str) -> tuple:
    info = g.tensors.get(t)
    if info is None or info.shape is None:
        _refuse(f"shape of '{t}' unknown")
    return info.shape


def _scalar_const(g: Graph, t: str) -> bool:
    return t in g.constants and g.constants[t].size == 1



"""Attention region -> kernel IR: one call of `ofz::attn::simt` or `ofz::attn::tensor_core`
(include/ortfuse_attention.h) with callbacks printed from IR:
* Q.offset / K.offset / V.offset: element offset of (b, h, s, d) in the tensor the kernel reads, walking
  back through the pattern's Reshape/Transpose path (scalar scales on the path move into the score; a
  Split or Slice adds its start, so Q, K and V may be parts of one packed projection);
* Q.rope / K.rope (a rotary embedding on the path, `search.attention.Rope`): the rotated value at (b, h, s, d)
  from x there and x at the partner column d -+ R/2, the rotation's ops walked with those two values, so the
  kernel rotates the Q and K rows it has loaded (cos and sin are read at the rotation's own coordinates);
  Q.rope_half / K.rope_half: R / 2 (D / 2 unless the rotation is partial);
* O.offset: the same for the result, walking forward through the output path;
* S.score: the element-wise ops between the two MatMuls (scale, mask) at (b, h, i, j) from the Q·Kᵀ value;
  a mask proven the same along an axis (`customops.invariance`: a padding mask materialized per query
  row) is read at coordinate 0 there.
The tensor-core variant needs fp16/bf16 data, head sizes that are multiples of 16, and rows contiguous
in d starting 16-byte aligned (AFFINE when Q's, K's and V's offsets are also affine in the sequence
index); the SIMT variant takes the rest."""
from __future__ import annotations

import itertools

import onnx

from ortfuse.customops import ir, scalar, target as hw
from ortfuse.customops.tiles import MMA_BLOCK_M, MMA_MIN_BLOCKS, SIMT_BLOCK_M, THREADS, key_split, mma_smem_bytes
from ortfuse.customops.invariance import invariant_axes
from ortfuse.customops.key_bound import key_bound
from ortfuse.customops.ir import F32, I64, Expr, Var
from ortfuse.customops.lower import KernelSpec, LoweringError, _Lowerer, _Scope, _storage
from ortfuse.rewriter.graph import Dim, Graph
from ortfuse.search.attention import SELECT_OPS, AttentionPattern, pattern_of, select_start
from ortfuse.search.plan import Region

C_ELEM = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}
LOG2E = 1.4426950408889634  # ortfuse_attention.h's


def _pattern(g: Graph, region: Region) -> AttentionPattern:
    p = pattern_of(g, region.nodes)
    if p is None:
        raise LoweringError("the region is not an attention pattern")
    return p


def _eval(e: Expr, env: dict[str, int]) -> int:
    if isinstance(e, ir.Const):
        return int(e.value)
    if isinstance(e, Var):
        return env[e.name]
    assert isinstance(e, ir.Op), e
    a = [_eval(x, env) for x in e.args]
    return {"add": lambda: a[0] + a[1], "sub": lambda: a[0] - a[1], "mul": lambda: a[0] * a[1],
            "div": lambda: a[0] // a[1], "mod": lambda: a[0] % a[1], "min": lambda: min(a)}[e.fn]()


def _linear_in(f: ir.Func, var: str) -> bool:
    """Whether f's result is affine in `var`: it enters through additions and multiplications by terms free of
    it only (degree 0 or 1). A Reshape that splits or merges the sequence axis divides the index: piecewise
    (windows of tokens), whatever the window."""
    defs = {s.var.name: s.value for s in f.body if isinstance(s, ir.Let)}

    def degree(e: Expr) -> int:  # 0, 1, or 2 for "not affine"
        if isinstance(e, ir.Const):
            return 0
        if isinstance(e, Var):
            return 1 if e.name == var else degree(defs[e.name]) if e.name in defs else 0
        assert isinstance(e, ir.Op), e
        ds = [degree(x) for x in e.args]
        if e.fn in ("add", "sub"):
            return max(ds)
        if e.fn == "mul":
            return min(sum(ds), 2)
        return 0 if not any(ds) else 2
    return f.result is not None and degree(f.result) <= 1


def _bare_scale(f: ir.Func, qk: str) -> float | None:
    """c where the score function is qk · c alone (multiplications and divisions by constants: no mask, no
    other op), else None."""
    defs = {s.var.name: s.value for s in f.body if isinstance(s, ir.Let)}

    def scale(e: Expr) -> float | None:
        if isinstance(e, Var):
            return 1.0 if e.name == qk else scale(defs[e.name]) if e.name in defs else None
        if not isinstance(e, ir.Op) or e.fn not in ("mul", "div") or len(e.args) != 2:
            return None
        x, y = e.args
        if e.fn == "mul" and isinstance(x, ir.Const):
            x, y = y, x
        if not isinstance(y, ir.Const) or not float(y.value):
            return None
        c = scale(x)
        return None if c is None else c * float(y.value) if e.fn == "mul" else c / float(y.value)
    return scale(f.result) if f.result is not None else None


def _run(f: ir.Func, env: dict[str, int]) -> int:
    env = dict(env)
    for s in f.body:
        assert isinstance(s, ir.Let)
        env[s.var.name] = _eval(s.value, env)
    assert f.result is not None
    return _eval(f.result, env)


class _AttnLowerer(_Lowerer):
    def __init__(self, graph: Graph, region: Region, tgt: hw.Target, bound: bool = False):
        super().__init__(graph, region, tgt, dict(graph.sym_hints))
        self.bound = bound
        self.p = _pattern(graph, region)
        self.qk_node = graph.nodes[self.p.qk]
        self.qk_value: Expr = Var("qk", F32)
        # masks constant along some axes (a padding mask materialized per query row) are read at 0 there:
        # the two query rows a thread scores then share one load per key
        self.fixed = {t: invariant_axes(graph, t, tgt) for t in self.p.extra_inputs}
        self.ropes = {r.out: r for r in (self.p.q_rope, self.p.k_rope) if r is not None}
        # while a rope callback is printed: (x, d at the rotation's coordinates, x at d, x at the partner column)
        self.rope_sub: tuple[str, Expr, Var, Var] | None = None
        # merged operands ([B*H, S, D]): (the merged index b * H + h, b, h, (B, H)), so a Reshape from the
        # [B, H, S, D] tensor they view passes b and h through instead of dividing the merged index again
        self.merged_heads: tuple[Expr, Var, Var, tuple] | None = None

    def reshape_index(self, idx: tuple[Expr, ...], out: tuple, inp: tuple) -> tuple[Expr, ...]:
        m = self.merged_heads
        if m is not None and idx and idx[0] == m[0] and len(inp) == len(out) + 1 and tuple(inp[:2]) == m[3] \
                and tuple(inp[2:]) == tuple(out[1:]):
            return (m[1], m[2], *idx[1:])
        return super().reshape_index(idx, out, inp)

    def value(self, t: str, idx: tuple[Expr, ...]) -> Expr:
        if self.rope_sub is not None and t == self.rope_sub[0]:
            _, d, here, partner = self.rope_sub
            return here if idx[-1] == d else partner
        return super().value(t, idx)

    def load(self, t: str, idx: tuple[Expr, ...]) -> Expr:
        fixed = self.fixed.get(t)
        if fixed:
            idx = tuple(ir.i64(0) if a in fixed else c for a, c in enumerate(idx))
        return super().load(t, idx)

    def node_value(self, node: onnx.NodeProto, pos: int, idx: tuple[Expr, ...]) -> Expr:
        if node is self.qk_node:
            return self.qk_value
        return super().node_value(node, pos, idx)

    def back(self, t: str, idx: tuple[Expr, ...], source: str) -> tuple[Expr, float]:
        """Offset in `source` of element `idx` of `t`, and the product of scalar scales on the way."""
        idx, scale = self.walk(t, idx, source)
        return self.linearize(idx, self._shape(source)), scale

    def walk(self, t: str, idx: tuple[Expr, ...], until: str) -> tuple[tuple[Expr, ...], float]:
        """Element `idx` of `t` as an index of `until`, up its operand path, and the product of scalar scales on
        the way (a rotary embedding passes the index through: its rows are rotated in the kernel)."""
        scale = 1.0
        shape = self._shape(t)
        idx = tuple(ir.i64(0) if d == 1 else i for i, d in zip(idx, shape))
        while t != until:
            if t in self.ropes:
                t = self.ropes[t].x
                continue
            node = self.producer.get(t)
            if node is None:
                raise LoweringError(f"'{t}' is not produced inside the attention region")
            op = node.op_type
            if op == "Transpose":
                perm = scalar.transpose_perm(node, len(idx))
                inv: list[Expr] = [ir.i64(0)] * len(perm)
                for j, p in enumerate(perm):
                    inv[p] = idx[j]
                idx, t = tuple(inv), node.input[0]
            elif op == "Expand":  # a broadcast: the input is read at 0 along its axes of size 1
                idx, t = self.broadcast(idx, self._shape(node.input[0])), node.input[0]
            elif op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten"):
                idx, t = self.reshape_index(idx, self._shape(t), self._shape(node.input[0])), node.input[0]
            elif op in SELECT_OPS:
                try:
                    starts = select_start(self.g, node, t)
                except ValueError as e:
                    raise LoweringError(f"{op} on an attention operand path: {e}") from None
                idx = tuple(ir.add(i, ir.i64(starts[a])) if starts.get(a) else i for a, i in enumerate(idx))
                t = node.input[0]
            elif op in ("Mul", "Div"):
                consts = [x for x in node.input if x in self.g.constants and self.g.constants[x].size == 1]
                data = [x for x in node.input if x not in consts]
                if len(consts) != 1 or len(data) != 1 or (op == "Div" and node.input[1] != consts[0]):
                    raise LoweringError(f"{op} on an attention operand path is not a scale by a constant")
                c = float(self.g.constants[consts[0]].reshape(-1)[0])
                scale = scale * c if op == "Mul" else scale / c
                t = data[0]
            else:
                raise LoweringError(f"{op} on an attention operand path")
        return idx, scale

    def rope(self, t: str, rope, transposed: bool, at) -> ir.Func:
        """`<Q|K>.rope(b, h, s, d, x, xp)`: the rotary embedding's output at the kernel's (b, h, s, d) of the
        operand `t`, from x there and x at the partner column (xp); `at` maps the kernel's (h, s) to the
        operand's (packed query heads)."""
        vb, vh, vs_, vd = (Var(n, I64) for n in ("ab", "ah", "as", "ad"))
        here, partner = Var("rx", F32), Var("rp", F32)

        def build() -> Expr:
            h, s = at(vh, vs_)
            idx, _ = self.walk(t, (vb, h, vd, s) if transposed else (vb, h, s, vd), rope.out)
            self.rope_sub = (rope.within, idx[-1], here, partner)
            try:  # (a partial rotation's columns past R are not rotated: the kernel asks for d < R only)
                return self.value(rope.rotated, idx)
            finally:
                self.rope_sub = None
        return self.func(f"{'K' if transposed else 'Q'}.rope", (vb, vh, vs_, vd, here, partner), build)

    def rope_half(self, rope, transposed: bool) -> ir.Func:
        """`<Q|K>.rope_half()`: R / 2, the distance between the columns rotated together (D / 2 unless partial)."""
        return self.func(f"{'K' if transposed else 'Q'}.rope_half", (), lambda: ir.i64(rope.half))

    def forward(self, idx: tuple[Expr, ...]) -> Expr:
        t = self.g.nodes[self.p.pv].output[0]
        for n in self.p.out_path:
            node = self.g.nodes[n]
            out = node.output[0]
            if node.op_type == "Transpose":
                perm = scalar.transpose_perm(node, len(idx))
                idx = tuple(idx[p] for p in perm)
            else:
                idx = self.reshape_index(idx, self._shape(t), self._shape(out))
            t = out
        return self.linearize(idx, self._shape(self.p.output))

    def attention(self) -> tuple[ir.Kernel, tuple[int, ...], tuple, int, int]:
        p, g = self.p, self.g
        q_op, kt_op = self.qk_node.input[0], self.qk_node.input[1]
        pv = g.nodes[p.pv]
        v_op = pv.input[1]
        qs, ks, vs, ss = (self._shape(t) for t in (q_op, kt_op, v_op, self.qk_node.output[0]))
        # [batch, heads, seq, head] operands, or [batch * heads, seq, head] ones (BLOOM's, DeBERTa's bmm): the
        # kernel's (batch, heads) are then those of the scores' [batch, heads, seq, seq] view around the mask,
        # the operands read at batch * heads + head; without such a view, the merged index with one head
        merged = all(len(s) == 3 for s in (qs, ks, vs, ss))
        if not merged and not all(len(s) == 4 for s in (qs, ks, vs, ss)):
            raise LoweringError("attention operands are not [batch, heads, seq, head] or [batch * heads, seq, "
                                "head] tensors")
        vb, vh, vs_, vd = (Var(n, I64) for n in ("ab", "ah", "as", "ad"))
        softmax_in = g.nodes[p.softmax].input[0]
        sm_shape = self._shape(softmax_in)
        viewed = merged and len(sm_shape) == 4 and tuple(sm_shape[-2:]) == tuple(ss[-2:])
        if viewed:
            heads = self.dim(sm_shape[1])
            bh = ir.add(ir.mul(vb, heads), vh)
            self.merged_heads = (bh, vb, vh, tuple(sm_shape[:2]))
            at = lambda b, h, x, y: (bh, x, y)  # noqa: E731
            ss4 = tuple(sm_shape)
        else:
            at = (lambda b, h, x, y: (b, x, y)) if merged else (lambda b, h, x, y: (b, h, x, y))  # noqa: E731
            ss4 = (ss[0], 1, *ss[1:]) if merged else ss
        d, dv = qs[-1], vs[-1]
        if not (isinstance(d, int) and isinstance(dv, int)) or max(d, dv) > 128:
            raise LoweringError(f"head sizes {d}, {dv}: static sizes up to 128 are fused")
        storage = _storage(g.tensors[p.q].dtype, f"attention input '{p.q}'")
        if any(_storage(g.tensors[t].dtype, t) != storage for t in (p.k, p.v, p.output)):
            raise LoweringError("attention inputs and output of different element types")
        if storage not in C_ELEM:
            raise LoweringError(f"{storage} attention is left to ORT")

        vi, vj = Var("ai", I64), Var("aj", I64)
        scales = []
        sq_dim = self.dim(ss4[2])
        group = 1  # query heads packed per K/V head (see below)

        def q_at(h: Expr, s: Expr) -> tuple[Expr, Expr]:  # a query row's head and row, packed or not
            if group == 1:
                return h, s
            return ir.add(ir.mul(h, ir.i64(group)), ir.idiv(s, sq_dim)), ir.imod(s, sq_dim)

        def kv_h(h: Expr) -> Expr:  # the first query head of a packed group reads its K/V head
            return h if group == 1 else ir.mul(h, ir.i64(group))

        def layout(t: str, src: str, transposed: bool):
            def build() -> Expr:
                h, s = (kv_h(vh), vs_) if t != q_op else q_at(vh, vs_)
                off, sc = self.back(t, at(vb, h, vd, s) if transposed else at(vb, h, s, vd), src)
                scales.append(sc)
                return off
            return build

        def build_funcs() -> list[ir.Func]:
            scales.clear()
            params = (vb, vh, vs_, vd)
            return [self.func("Q.offset", params, layout(q_op, p.q, False)),
                    self.func("K.offset", params, layout(kt_op, p.k, True)),
                    self.func("V.offset", params, layout(v_op, p.v, False)),
                    self.func("O.offset", params, lambda: self.forward(at(vb, *q_at(vh, vs_), vd)))]

        funcs = build_funcs()
        # Grouped-query attention with K and V repeated across G query heads (folded into their offsets): the
        # G heads' query rows are packed into one unit's rows (row r of group h: head h * G + r / Sq, row
        # r % Sq), so a generation step's few rows fill the tile and each K/V tile is read once per group,
        # not once per head (flash-decoding's packing); units and the key split see G times fewer heads.
        # Only where the rows leave the tile room (Sq's hint below BLOCK_M: a generation step, at its
        # `--dim-hint` or static): at a prompt's Sq the units are the same, and the divided Q offsets cost
        # registers and the affine row loads of Q (2026-11-27 review: 128 -> 158 registers in SmolLM's kernel).
        # A rotation of K after the repeat may differ per query head: its index at the rotation's output is
        # probed with K's and V's offsets.
        block_rows = MMA_BLOCK_M if storage in ("f16", "bf16") else SIMT_BLOCK_M
        if not merged and self.hint(ss4[2]) < block_rows:
            probes = funcs[1:3]
            if p.k_rope is not None:
                probes = probes + [self.func("K.rope_at", (vb, vh, vs_, vd),
                                             lambda: self.back(kt_op, at(vb, vh, vd, vs_), p.k_rope.out)[0])]
            group = self.kv_group(probes, ss4[1])
            if group > 1:
                funcs = build_funcs()
        ropes = [f for op, r, tr in ((q_op, p.q_rope, False), (kt_op, p.k_rope, True)) if r is not None
                 for f in (self.rope(op, r, tr, q_at if not tr else lambda h, s: (kv_h(h), s)),
                           self.rope_half(r, tr))]
        scale = scales[0] * scales[1] * scales[2]
        if scales[2] != 1.0:
            raise LoweringError("a scale on the V path")
        qk = Var("qk", F32)
        self.qk_value = ir.Op("mul", (qk, ir.Const(scale, F32)), F32) if scale != 1.0 else qk
        def score() -> Expr:  # the Softmax input at the scores' element (b, h, i, j): through a batch regroup
            if viewed:  # the kernel's index is the view's
                return self.value(softmax_in, (vb, vh, vi, vj))
            idx = at(vb, *q_at(vh, vi), vj)  # the same offset in both (search.attention._regroups_batch)
            return self.value(softmax_in, idx if sm_shape == ss else self.reshape_index(idx, ss, sm_shape))
        funcs.append(self.func("S.score", (vb, vh, vi, vj, qk), score))
        # a causal frontier: each unit visits the key tiles before its last row's, and from its first row's far
        # side (packed query heads: rows of a head, `S.group` maps them; a generation step's one row a head
        # sees every key but a sliding window's far side)
        bound = key_bound(g, p) if self.tgt.key_frontier else None
        if bound is not None:
            if group > 1:
                funcs.append(self.func("S.group", (), lambda: ir.i64(group)))
            vsq, vsk = Var("asq", I64), Var("ask", I64)

            def key(shift: int, tail: bool) -> Expr:  # i + shift (+ Sk - Sq)
                return ir.add(ir.add(vi, ir.i64(shift)), ir.Op("sub", (vsk, vsq), I64) if tail else ir.i64(0))
            funcs.append(self.func("S.key_end", (vi, vsq, vsk), lambda: key(1 + bound.shift, bound.tail)))
            if bound.low is not None:
                funcs.append(self.func("S.key_begin", (vi, vsq, vsk), lambda: key(bound.low[1], bound.low[0])))
        funcs += ropes

        mma = storage in ("f16", "bf16") and d % 16 == 0 and dv % 16 == 0 and self.aligned(funcs[:4], (d, d, dv, dv))
        bare = _bare_scale(funcs[4], qk.name) if mma else None
        if bare is not None and 1e-30 < bare * LOG2E < 1e30:  # no mask: the softmax terms fold the scale into one
            # FFMA (a normal fp32 constant: a denormal one flushes to 0 under ftz, 0 · -inf is NaN)
            funcs.append(self.func("S.log2_scale", (), lambda: ir.Const(bare * LOG2E, F32)))
        block_m = MMA_BLOCK_M if mma else SIMT_BLOCK_M
        terms = [self.encode(x) for x in ss4]
        sizes = [self.dim(x) for x in ss4]
        if group > 1:  # G times fewer heads of G times the rows
            terms[1] = ss4[1] // group
            sizes[1], sizes[2] = ir.i64(ss4[1] // group), ir.mul(sizes[2], ir.i64(group))
        dims = ir.Op("attn_dims", tuple(sizes), I64)
        ptrs = tuple(Var(f"t{self.args[t]}", storage) for t in (p.q, p.k, p.v)) + (
            Var(f"t{self.out_args[p.output]}", storage),)
        targs = (C_ELEM[storage], str(d), str(dv), "OPS::Q", "OPS::K", "OPS::V", "OPS::O", "OPS::S")
        affine_q, affine_kv = _linear_in(funcs[0], "as"), all(_linear_in(f, "as") for f in funcs[1:3])
        if mma and (affine_q or affine_kv):  # Q's, and K's and V's, offsets affine in the sequence index
            targs += ("true" if affine_q else "false", "true" if affine_kv else "false")
        call = ir.Call("ofz::attn::tensor_core" if mma else "ofz::attn::simt", targs, ptrs + (dims,))
        self.scopes = [_Scope(set())]
        self.emit(call)
        # the tensor-core kernel copies Q, K and V tiles with 16-byte cp.async
        aligned = tuple((self.args[t], 16) for t in (p.q, p.k, p.v)) if mma else ()
        # bound: four blocks per SM (128 registers) for head sizes up to 64, where ptxas took more without the
        # bound (BERT's: 141, 3 blocks per SM) and does not spill under it (api._attention_occupancy)
        min_blocks = MMA_MIN_BLOCKS if self.bound and mma and max(d, dv) <= 64 else 0
        kernel = self.kernel(THREADS, 0, ("ortfuse_attention.h",), tuple(funcs), aligned, min_blocks=min_blocks)
        smem = mma_smem_bytes(d, dv) if mma else 0
        if smem > self.tgt.smem_per_block:
            raise LoweringError(f"attention tile needs {smem} bytes of shared memory")
        split = key_split(self.tgt, d, dv, self.hint(ss4[3])) if mma else 1
        return kernel, tuple(terms[:2]), (((terms[2],) + ((group,) if group > 1 else ()), block_m),), smem, split

    def kv_group(self, kv: list[ir.Func], heads: Dim) -> int:
        """The most query heads G (dividing the static head count) whose K and V offsets are those of their
        group's first head, probed at several sizes of every symbolic dim (repeat_kv's Expand folded into the
        offsets gives G = heads / kv_heads); 1 where there is none."""
        if not isinstance(heads, int) or heads < 2:
            return 1
        envs = []
        for v in (1, 3, 7, 13):  # every runtime dim, derived and summed ones included (a KV cache's span)
            env = {f"d{k}": v + k for k in range(self.num_dims)}
            for b, s, d in itertools.product((0, 1), (0, 5), (0, 3)):
                envs.append({**env, "ab": b, "as": s, "ad": d})
        try:
            for g in range(heads, 1, -1):
                if heads % g == 0 and all(_run(f, {**env, "ah": h}) == _run(f, {**env, "ah": h // g * g})
                                          for f in kv for env in envs for h in range(heads)):
                    return g
        except (KeyError, ZeroDivisionError):  # an offset the probe cannot evaluate: not packed
            return 1
        return 1

    def aligned(self, layouts: list[ir.Func], widths: tuple[int, ...]) -> bool:
        """Rows contiguous in d and starting on 16 bytes, probed at several sizes of every symbolic dim
        (the offsets are polynomials in them; odd sizes expose an odd stride)."""
        for v in (1, 3, 7, 13):
            env = {f"d{k}": v for k in range(len(self.sym_pairs))}
            for f, w in zip(layouts, widths):
                for b, h, s in itertools.product((0, 1), (0, 2), (0, 1, 5)):
                    env.update(ab=b, ah=h, **{"as": s})
                    base = _run(f, {**env, "ad": 0})
                    if base % 8 or any(_run(f, {**env, "ad": x}) != base + x for x in (1, w - 1)):
                        return False
        return True


def lower_attention(graph: Graph, region: Region, tgt: hw.Target, bound: bool = False) -> KernelSpec:
    """`bound`: the tensor-core kernel asks ptxas for MMA_MIN_BLOCKS blocks per SM (head sizes up to 64)."""
    lw = _AttnLowerer(graph, region, tgt, bound)
    kernel, units, units_ceil, smem, split = lw.attention()
    shapes = lw.output_shapes()
    return KernelSpec(kernel, tuple(region.inputs), tuple(region.outputs), tuple(lw.sym_pairs), units, 1,
                      tuple(graph.tensors[o].dtype for o in region.outputs), shapes, smem, units_ceil,
                      split_k=split, sym_derived=tuple(lw.derived), sym_sums=tuple(lw.sums),
                      sym_products=tuple(lw.products), dim_checks=tuple(lw.sum_checks))


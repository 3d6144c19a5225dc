"""GEMM region -> kernel IR: one MatMul/Gemm/Conv (the anchor) with its prologue and epilogue ops.

The kernel body is one call of `ofz::gemm::run` (include/ortfuse_gemm.h); the region's own ops become the
`Ops` callbacks, printed from IR by the same value walk as every other kernel:
* operands the template copies itself (cp.async) when they are region inputs in plain row-major (A, B)
  or column-major (Gemm transB) layout with 16-byte aligned rows; otherwise `a_load` / `b_load` evaluate
  the operand element by element, through any prologue ops (casts, scaling, transposes, broadcasts);
* `epi2` / `epi1` compute every region output at one or two adjacent columns from the accumulator, with
  16-bit pairs stored as one access when the row length is even;
* gated pairs (a gated MLP's SiLU(x Wg) * (x Wu) packed by `rewriter.gemm_packing` with the gate's and the
  up projection's columns alternating: two Slices of step 2 are all that reads the GEMM's result): `epi2`
  gets the two values of one output column, and the outputs are half as wide as the GEMM;
* row-wise epilogue (region kind "gemm_row": a Softmax, LayerNorm or Reduce* over the GEMM's N axis): the
  tile spans whole rows; `row_in` evaluates X, the one tensor between the GEMM and its reductions, into a
  shared-memory row buffer, and `row` runs the rest of the region as a row-reduction pass over that buffer.
When B has no batch dims, the batch dims of A fold into M, so the whole activation is one tall GEMM.
A 2-D Conv (group 1) is an implicit GEMM per image: the weight is A, im2col of the image is B (gathered
with zero padding by the template's 32-bit `kIm2col` mode, by `b_load` for images past 2^31 elements, or
copied directly for an aligned 1x1 convolution), the pixels are the columns."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import onnx

from ortfuse.customops import ir, scalar, target as hw, tiles as tl
from ortfuse.customops.ir import F32, I64, Expr, Var
from ortfuse.customops.lower import KernelSpec, LoweringError, RowSplit, _Lowerer, _Scope, _storage, slice_index
from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.gemm_padding import padded_width
from ortfuse.rewriter.graph import Dim, Graph
from ortfuse.rewriter.layernorm_fold import LayerNormFold
from ortfuse.search import conv, legal, norm_fold, ops
from ortfuse.search.cost import bindings
from ortfuse.search.plan import Region

ROW, COL, GENERIC, IM2COL = 0, 1, 2, 3  # ofz::gemm::Mode
GATHER32_LIMIT = 2 ** 31  # kIm2col indexes one image with 32-bit ints
MATH_OF = {"f16": tl.MMA_F16, "bf16": tl.MMA_BF16}
C_ELEM = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}
ROW_PTR = "f32p"  # float* parameters of the row-wise callbacks
ROW_UNROLL = 8  # a row-wise epilogue's row loop: at most this many rows' chains interleaved per warp
TAP_MAJOR_PERM = (0, 2, 3, 1)  # a Conv weight [OC][C][KH][KW] as the tap-major gather's A: [OC][KH][KW][C]


def row_input(graph: Graph, region: Region, anchor: int, prologue: Optional[int] = None) -> str:
    """X of a row-wise epilogue: the one tensor computed from the GEMM result, before any reduction, that
    the rest of the region (or the outside) reads (`prologue`: a folded LayerNorm, not one of those
    reductions). Where several are read (an RMSNorm exported as Cast, Pow, ReduceMean, ..., x * rstd: the
    cast x and x ** 2), the last tensor that every path from the GEMM to them runs through: the row pass
    recomputes the others from it element by element. Raises when there is none but the GEMM's result."""
    nodes = set(region.nodes)

    def downstream(seeds: set[int]) -> set[int]:
        seen, stack = set(seeds), list(seeds)
        while stack:
            for o in graph.nodes[stack.pop()].output:
                for c in graph.consumers.get(o, ()) if o else ():
                    if c in nodes and c not in seen:
                        seen.add(c)
                        stack.append(c)
        return seen

    after = downstream({i for i in nodes if graph.nodes[i].op_type in ops.REDUCTIONS and i != prologue})
    pre = downstream({anchor}) - after
    frontier = sorted({o for i in pre for o in graph.nodes[i].output if o and (
        o in region.outputs or any(c in nodes and c not in pre for c in graph.consumers.get(o, ())))})
    if len(frontier) == 1:
        return frontier[0]
    y = graph.nodes[anchor].output[0]
    producer = {o: i for i in pre for o in graph.nodes[i].output if o}

    def dominates(x: str) -> bool:  # no frontier tensor is computed from y along a path that avoids x
        memo: dict[str, bool] = {}

        def around(t: str) -> bool:  # t depends on y without passing x
            if t == x:
                return False
            if t == y:
                return True
            if t not in memo:
                p = producer.get(t)
                memo[t] = p is not None and p != anchor and any(around(i) for i in graph.nodes[p].input if i)
            return memo[t]
        return not any(around(t) for t in frontier)

    for i in sorted(pre - {anchor}, reverse=True):  # node order is topological: the latest first
        for x in graph.nodes[i].output:
            if x and dominates(x):
                return x
    raise LoweringError(f"a row-wise epilogue needs one tensor between the GEMM and its reductions, "
                        f"found {frontier}")


class _GemmLowerer(_Lowerer):
    def __init__(self, graph: Graph, region: Region, tgt: hw.Target, tf32: bool,
                 tile: Optional[tuple[int, ...]] = None):
        super().__init__(graph, region, tgt, dict(graph.sym_hints))
        # one kernel serves every batch: its tile is chosen at the bindings the cost model prices the fusion at
        # (batch 1, and batch 32 when the batch is symbolic)
        self.binding_hints = [self.hint] + [
            (lambda d, h=gb.sym_hints: d if isinstance(d, int) else h.get(d, 128)) for _, gb in bindings(graph)[1:]]
        anchors = [i for i in region.nodes if conv.is_anchor(graph, graph.nodes[i])]
        if len(anchors) != 1:
            raise LoweringError(f"a GEMM kernel holds exactly one MatMul/Gemm/Conv, this region has {len(anchors)}")
        self.anchor_index = anchors[0]
        self.anchor = graph.nodes[anchors[0]]
        self.tf32 = tf32
        self.forced_tile = tile
        self.tile_us: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()
        self.binding_rows: tuple[int, ...] = ()
        self.acc: dict[Expr, Expr] = {}  # column expression -> accumulator value at that column
        self.out_idx: tuple[Expr, ...] = ()
        self.fold = norm_fold.in_region(graph, region.nodes)  # a LayerNorm prologue (search/norm_fold.py)
        self.row_mode = any(graph.nodes[i].op_type in ops.REDUCTIONS for i in region.nodes
                            if not (self.fold and i == self.fold.norm))
        self.row_tensor = row_input(graph, region, anchors[0], self.fold.norm if self.fold else None) \
            if self.row_mode else None
        self.row_local: Optional[Expr] = None  # row pass: the row within the tile (row buffer index)
        # (terms, limit): products of runtime dims the kernel needs below limit (its 32-bit gather)
        self.limits: list[tuple[tuple[int, ...], int]] = []
        self.row_ld = 0
        # constant inputs the kernel reads transposed: (tensor, perm), materialized by the rewriter
        self.input_perms: list[tuple[str, tuple[int, ...]]] = []
        self.ln_fold: Optional[LayerNormFold] = None
        self.tma: tuple[tuple[int, int, int], ...] = ()  # KernelSpec.tma
        self.blocks_per_sm = 0  # KernelSpec.blocks_per_sm
        self.row_cluster = 1  # KernelSpec.row_cluster
        self.multicast = 1  # KernelSpec.multicast
        self.tma_shapes: list[tl.Shape] = []  # the bindings' (m, n, k, batch) where TMA tiles are candidates
        self.stage_out = False  # the epilogue goes through shared memory (misaligned_rows)
        self.gated: Optional[int] = None  # gated pairs: the outputs' width, half the GEMM's (legal.gated_reads)
        self.gated_reads: tuple[onnx.NodeProto, ...] = ()  # their Slices from column 0 and from column 1

    # ------------------------------------------------------------------ X from the row buffer
    def value(self, t: str, idx: tuple[Expr, ...]) -> Expr:
        if t != self.row_tensor or self.row_local is None:
            return super().value(t, idx)
        if idx[:-1] != self.row_idx:
            raise LoweringError(f"'{t}' is read at another row than the one being reduced")
        hit = self.lookup((t, idx))
        if hit is not None:
            return hit
        col = idx[-1] if self.split_row is None else ir.add(idx[-1], ir.mul(self.split_row.n0, ir.i64(-1)))
        off = ir.add(ir.mul(self.row_local, ir.i64(self.row_ld)), col)
        return self.remember((t, idx), self.bind(ir.Op("rowbuf", (off,), F32), "x"))

    # ------------------------------------------------------------------ the anchor's value in the epilogue
    def node_value(self, node: onnx.NodeProto, pos: int, idx: tuple[Expr, ...]) -> Expr:
        if node is not self.anchor:
            return super().node_value(node, pos, idx)
        if idx[:-1] != self.out_idx[:-1] or idx[-1] not in self.acc:
            raise LoweringError("the GEMM result is read at another element than the one being stored "
                                "(a layout change or reduction after the GEMM)")
        v = self.acc[idx[-1]]
        if node.op_type == "Conv" and len(node.input) > 2 and node.input[2]:
            v = ir.Op("add", (v, self.value(node.input[2], (idx[1],))), F32)  # bias per output channel
        if node.op_type == "Gemm":
            alpha = float(attr(node, "alpha", 1.0))
            if alpha != 1.0:
                v = ir.Op("mul", (v, ir.Const(alpha, F32)), F32)
            if len(node.input) > 2 and node.input[2]:
                c = node.input[2]
                beta = float(attr(node, "beta", 1.0))
                cv = self.value(c, self.broadcast(idx, self._shape(c)))
                v = ir.Op("add", (v, ir.Op("mul", (cv, ir.Const(beta, F32)), F32) if beta != 1.0 else cv), F32)
        return v

    # ------------------------------------------------------------------ helpers
    def esize(self, storage: str) -> int:
        return {"f16": 2, "bf16": 2, "f32": 4}[storage]

    def operand_math(self, a: str, b: str, what: str) -> tuple[str, int, int]:
        """(storage type, ofz::gemm::Math, element size) of a GEMM or Conv with operands a and b."""
        storage = _storage(self.g.tensors[a].dtype, f"{what} operand '{a}'")
        if storage != _storage(self.g.tensors[b].dtype, f"{what} operand '{b}'"):
            raise LoweringError(f"{what} operands of different element types")
        if storage not in C_ELEM:
            raise LoweringError(f"{storage} {what}s are left to ORT")
        return storage, MATH_OF.get(storage, tl.MMA_TF32 if self.tf32 else tl.SIMT), self.esize(storage)

    def static(self, d: Dim) -> Optional[int]:
        return d if isinstance(d, int) else None

    # ------------------------------------------------------------------ epilogues
    def lanes8(self, inner: Dim, outs: list[str]) -> bool:
        """Whether an epilogue can take 8 adjacent columns as one 16-byte vector per access: the row holds
        whole groups of 8 16-bit lanes (vector_width: every input and output of the region) and none of
        `outs` is transposed."""
        return isinstance(inner, int) and inner % 8 == 0 and self.vector_width(inner) == 8 and all(
            (p := self.perms.get(o)) is None or p[-1] == len(p) - 1 for o in outs)

    def misaligned_rows(self, inner: Dim) -> bool:
        """Whether a region output stores rows of `inner` (static) elements along the GEMM's columns that are
        not 16-byte aligned: GPT-2's 50,257 fp16 logits, which the fragments' pairs would store as scalars."""
        if not isinstance(inner, int):
            return False
        return any(padded_width(inner, self.g.tensors[o].dtype) != inner
                   for o in self.r.outputs if (p := self.perms.get(o)) is None or p[-1] == len(p) - 1)

    def gated_epilogue(self, funcs: list[ir.Func], vb: Var, vm: Var, vn: Var, out_prefix, half: int) -> None:
        """epi2 (and epi8) of gated pairs: GEMM columns n, n + 1 (n even) are the two Slices' elements at
        output column n / 2; epi8's 8 columns are 4 outputs, stored as one vector. The template calls epi2 at
        even columns of an even-width GEMM alone, and mma fragments hold such pairs, so epi1 is empty."""
        self.inner_dim = half
        outs = list(self.r.outputs)

        def store(vals: list[Var]) -> None:
            c0 = self.bind(ir.idiv(vn, ir.i64(2)), "gc")
            self.lanes, self.lane_base = tuple(ir.add(c0, ir.i64(j)) for j in range(len(vals) // 2)), None
            self.vec = len(self.lanes)
            prefix = out_prefix(vb, vm)
            # the GEMM column each Slice reads at output column c (2c, 2c + 1), as its lowering computes it
            self.acc = {slice_index(self.g, sl, prefix + (c,))[-1]: vals[2 * j + first]
                        for j, c in enumerate(self.lanes) for first, sl in enumerate(self.gated_reads)}
            self.out_idx = prefix + (self.lanes[0],)
            self.store_outputs(outs, lambda lane: prefix + (lane,), None)
            return None

        v0, v1 = Var("acc0", F32), Var("acc1", F32)
        funcs.append(self.func("epi2", (vb, vm, vn, v0, v1), lambda: store([v0, v1])))
        funcs.append(self.func("epi1", (vb, vm, vn, v0), lambda: None))
        if half % 4 == 0 and self.vector_width(half) >= 4:
            vs = [Var(f"acc{j}", F32) for j in range(8)]
            funcs.append(self.func("epi8", (vb, vm, vn, *vs), lambda: store(vs)))

    def epilogue(self, funcs: list[ir.Func], vb: Var, vm: Var, vn: Var, out_prefix, inner: Dim,
                 col_index=lambda n: (n,), rows8: bool = False) -> None:
        """epi2 / epi1: every region output at two adjacent columns (16-bit pairs as one store), or one.
        Column n of the GEMM is output index out_prefix(b, m) + col_index(n); its last axis has `inner`
        elements (a Conv's column is an (oh, ow) pixel). The template passes pairs at even n only, so a pair
        shares its row when `inner` is even. `rows8`: also rows8, rows m .. m + 7 at column n (the staged
        epilogue's), whose inputs that do not vary along the column are read once for the 8."""
        v0, v1 = Var("acc0", F32), Var("acc1", F32)
        self.inner_dim = inner
        outs = list(self.r.outputs)

        def store(cols: list[tuple[Expr, Var]], vec: int) -> None:
            self.vec = vec
            for chunk in ([cols] if vec > 1 else [[c] for c in cols]):
                first = col_index(chunk[0][0])
                trail = [first[:-1] + (ir.add(first[-1], ir.i64(j)),) for j in range(len(chunk))]
                self.lanes, self.lane_base = tuple(t[-1] for t in trail), None
                self.acc = {t[-1]: v for t, (_, v) in zip(trail, chunk)}
                prefix = out_prefix(vb, vm) + first[:-1]
                self.out_idx = prefix + (self.lanes[0],)
                self.store_outputs(outs, lambda lane: prefix + (lane,), None)
            return None

        def store_rows(rows: list[tuple[Expr, Var]]) -> None:  # one element per row, all at column vn
            first = col_index(vn)
            self.vec, self.lanes, self.lane_base = 1, (first[-1],), None
            for m, v in rows:
                self.acc = {first[-1]: v}
                prefix = out_prefix(vb, m) + first[:-1]
                self.out_idx = prefix + (first[-1],)
                self.store_outputs(outs, lambda lane: prefix + (lane,), None)

        if rows8:
            vs = [Var(f"acc{j}", F32) for j in range(8)]
            rows = [(vm if j == 0 else ir.add(vm, ir.i64(j)), v) for j, v in enumerate(vs)]
            funcs.append(self.func("rows8", (vb, vm, vn, *vs), lambda: store_rows(rows)))
        pair_vec = 2 if isinstance(inner, int) and inner % 2 == 0 else 1
        n1 = ir.add(vn, ir.i64(1))
        funcs.append(self.func("epi2", (vb, vm, vn, v0, v1), lambda: store([(vn, v0), (n1, v1)], pair_vec)))
        funcs.append(self.func("epi1", (vb, vm, vn, v0), lambda: store([(vn, v0)], 1)))
        # epi8: 8 adjacent columns as one 16-byte vector per access (the template's whole tiles on mma
        # fragments exchange pairs within each quad to get them)
        if self.lanes8(inner, outs):
            vs = [Var(f"acc{j}", F32) for j in range(8)]
            cols = [(vn if j == 0 else ir.add(vn, ir.i64(j)), v) for j, v in enumerate(vs)]
            funcs.append(self.func("epi8", (vb, vm, vn, *vs), lambda: store(cols, 8)))

    def row_epilogue(self, funcs: list[ir.Func], vb: Var, out_prefix, y_s: tuple[Dim, ...],
                     tile: tl.GemmTile) -> tuple[str, ...]:
        """row_in (X from the accumulator) and row (the reductions and outputs over the row buffer); split
        across a cluster (N > BN: ortfuse_gemm.h), row_part0.. too, one per reduction. Returns the template's
        ROW_TPR, and the Geo, SPLIT, Fold, RSPLIT, PHASES arguments when split."""
        assert self.row_tensor is not None
        x = self.row_tensor
        if self._shape(x) != y_s or tuple(self.r.space) != y_s:
            raise LoweringError(f"the row-wise epilogue reduces '{x}' of shape {self._shape(x)}, "
                                f"not the GEMM's shape {y_s}")
        vm, vn, v0 = Var("gm", I64), Var("gn", I64), Var("acc0", F32)

        def row_in() -> Expr:
            # X stays fp32 in the buffer, like every intermediate of a fused chain (rounded only when stored)
            self.vec, self.lanes, self.acc = 1, (vn,), {vn: v0}
            self.out_idx = out_prefix(vb, vm) + (vn,)
            v = self.value(x, self.out_idx)
            if v.ctype != F32:
                raise LoweringError(f"'{x}' is not a floating-point tensor")
            return v

        funcs.append(self.func("row_in", (vb, vm, vn, v0), row_in))
        if self.lanes8(y_s[-1], [x]):
            # row_in8: X at 8 adjacent columns from their accumulators, each input one 16-byte vector, into
            # the row buffer (the template's whole 8-column groups; the per-element row_in with 64-bit bounds
            # checks was ~20 instructions an element in SASS)
            vs = [Var(f"acc{j}", F32) for j in range(8)]

            def row_in8() -> None:
                self.vec, self.inner_dim = 8, y_s[-1]
                self.lanes = tuple(vn if j == 0 else ir.add(vn, ir.i64(j)) for j in range(8))
                self.lane_base = None
                self.acc = dict(zip(self.lanes, vs))
                prefix = out_prefix(vb, vm)
                self.out_idx = prefix + (vn,)
                for j, lane in enumerate(self.lanes):
                    self.emit(ir.RowPut(ir.i64(j), self.value(x, prefix + (lane,)), "ofz_row"))
                return None

            funcs.append(self.func("row_in8", (vb, vm, vn, *vs, Var("ofz_row", ROW_PTR)), row_in8))
        N = y_s[-1]
        rsplit = tl.row_split(int(N), tile)
        if rsplit > self.tgt.max_cluster:
            raise LoweringError(f"a {N}-column row over tiles of {tile.bn} columns needs clusters of {rsplit} blocks; "
                                f"the target has at most {self.tgt.max_cluster}")
        self.inner_dim = N
        self.vec = self.vector_width(N)
        # a warp per row (its reductions are shuffles alone; a row over several warps meets at two block
        # barriers per reduction), more only where the tile has fewer rows than the block has warps
        self.tpr = 32
        while tile.threads // self.tpr > tile.bm and tile.threads % (2 * self.tpr) == 0:
            self.tpr *= 2
        span = min(int(N), tile.bn)
        while self.vec > 1 and self.tpr * (self.vec // 2) >= span:  # every lane busy, one pass over the columns
            self.vec //= 2
        self.row_ld = tile.bn + 4  # ortfuse_gemm.h Layout::kRowLd
        rpb = tile.threads // self.tpr
        vm0, vrows = Var("gm0", I64), Var("grows", I64)
        vn0, vn1 = Var("gn0", I64), Var("gn1", I64)
        buffers = (Var("ofz_row", ROW_PTR), Var("ofz_scratch", ROW_PTR))

        def row() -> None:
            self.acc = {}
            tid = ir.Op("thread_idx", (), I64)
            self.bind_named("rlane", ir.Op("mod", (tid, ir.i64(self.tpr)), I64))
            rsub = self.bind(ir.Op("div", (tid, ir.i64(self.tpr)), I64), "rsub")

            def index(rowc: Expr) -> tuple[Expr, ...]:
                self.row_local = rowc
                return out_prefix(vb, self.bind(ir.add(vm0, rowc), "gmr"))

            # the tile's rows, unrolled: each row's chain (buffer loads, warp reduction, combine) is short
            # and waits on latency, so a warp interleaves several rows' chains
            self.loop("r0", ir.i64(0), ir.i64(tile.bm), ir.i64(rpb),
                      lambda r0: self.row_pass(y_s, ir.add(r0, rsub), vrows, index),
                      unroll=min(ROW_UNROLL, -(-tile.bm // rpb)))
            self.row_local = None
            return None

        self.row_span = span
        if rsplit == 1:
            try:
                funcs.append(self.func("row", (vb, vm0, vrows, *buffers), row))
            finally:
                self.row_span = None
            return (str(self.tpr),)
        xs = self.split_row = RowSplit(vn0, vn1, tile.bm, rsplit)
        try:
            params = (vb, vm0, vrows, vn0, vn1, *buffers, Var("ofz_slots", ROW_PTR))
            self.func("row", params, row)  # discovery: the reductions in the order the pass completes them
            if not 1 <= len(xs.order) <= tl.ROW_SLOTS:
                raise LoweringError(f"{len(xs.order)} row reductions; a row split across a cluster takes 1 to "
                                    f"{tl.ROW_SLOTS}")
            for p in range(len(xs.order)):
                xs.phase, xs.reduced = p, False
                funcs.append(self.func(f"row_part{p}", params, row))
                if not xs.reduced:
                    raise LoweringError("the row reductions depend on one another in an order the cluster split "
                                        "cannot phase")
            xs.phase = len(xs.order)
            funcs.append(self.func("row", params, row))
        finally:
            self.split_row, self.row_span = None, None
        return (str(self.tpr), "ofz::gemm::NoConv", "1", "ofz::gemm::NoFold", str(rsplit), str(len(xs.order)))

    # ------------------------------------------------------------------ Conv as an implicit GEMM
    def im2col(self, x: str, geo: conv.ConvGeom, vb: Expr, vk: Expr, vn: Expr) -> Expr:
        """B[b][k][n] of the implicit GEMM: X at tap k = (c, kh, kw) of output pixel n = (oh, ow), zero in
        the padding (read at an in-bounds index, then selected away)."""
        c, kh, kw = self.unravel(vk, (geo.c, geo.kh, geo.kw))
        oh, ow = self.unravel(vn, (geo.oh, geo.ow))
        (sh, sw), (dh, dw), (ph, pw) = geo.stride, geo.dilation, geo.pad
        h = self.bind(ir.add(ir.add(ir.mul(oh, ir.i64(sh)), ir.mul(kh, ir.i64(dh))), ir.i64(-ph)), "ih")
        w = self.bind(ir.add(ir.add(ir.mul(ow, ir.i64(sw)), ir.mul(kw, ir.i64(dw))), ir.i64(-pw)), "iw")
        if not geo.padded:
            return self.value(x, (vb, c, h, w))

        def within(i: Expr, n: Dim) -> Expr:
            return ir.Op("and", (ir.Op("ge", (i, ir.i64(0)), ir.BOOL), ir.Op("lt", (i, self.dim(n)), ir.BOOL)), ir.BOOL)

        inside = self.bind(ir.Op("and", (within(h, geo.h), within(w, geo.w)), ir.BOOL), "inb")
        at = tuple(self.bind(ir.Op("select", (inside, i, ir.i64(0)), I64), "i") for i in (h, w))
        v = self.value(x, (vb, c) + at)
        return ir.Op("select", (inside, v, ir.Const(0.0, F32)), F32)

    def conv_gemm(self):
        """Per image b: Y[b] (OC x OH*OW) = W (OC x C*KH*KW) . im2col(X[b]); the epilogue stores pixel n of
        channel m at Y[b][m][n / OW][n % OW]. A 16-byte aligned 1x1 convolution copies both operands with
        cp.async; otherwise the weight and/or the im2col operand are loaded element by element (the template's
        32-bit gather, image sizes static or read at run time; `b_load`'s 64-bit gather for an image past 2^31
        elements or one computed in the kernel)."""
        node, g = self.anchor, self.g
        geo = conv.conv_geometry(g, node)
        if isinstance(geo, str):
            raise LoweringError(geo)
        if self.row_mode:
            raise LoweringError("a reduction after a Conv: row-wise epilogues follow MatMul/Gemm only")
        x_t, w_t, y_t = node.input[0], node.input[1], node.output[0]
        storage, math_, es = self.operand_math(x_t, w_t, "Conv")
        y_s = self._shape(y_t)
        for o in self.r.outputs:
            if self._shape(o) != y_s and o not in self.perms:
                raise LoweringError(f"output '{o}' of shape {self._shape(o)} is neither the Conv's shape {y_s} "
                                    f"nor a transpose of it")
        vb, vm, vn, vk = Var("gb", I64), Var("gm", I64), Var("gn", I64), Var("gk", I64)
        region_input = lambda t: t in self.args and t not in self.producer  # noqa: E731
        a_mode = ROW if region_input(w_t) and (geo.k * es) % 16 == 0 else GENERIC
        if region_input(x_t) and geo.pointwise and (geo.pixels * es) % 16 == 0:
            b_mode = ROW
        elif region_input(x_t) and geo.k < GATHER32_LIMIT and (not geo.static_image or max(
                geo.c * geo.h * geo.w, geo.pixels) < GATHER32_LIMIT):
            b_mode = IM2COL  # the template's 32-bit gather; on a symbolic image its sizes are checked at launch
            if not geo.static_image:
                self.limits = [((self.encode(geo.c), self.encode(geo.h), self.encode(geo.w)), GATHER32_LIMIT),
                               ((self.encode(geo.oh), self.encode(geo.ow)), GATHER32_LIMIT)]
        else:
            b_mode = GENERIC  # b_load's 64-bit gather: an image past 2^31 elements, or X computed in-kernel
        # tap-major K (each k tile in one tap) when C allows it and the copied weight is tap-major as it is (1x1)
        # or may be permuted offline: a constant no user can feed, read by nothing else in the region
        one_tap = geo.kh * geo.kw == 1
        readers = [i for i in g.consumers.get(w_t, ()) if i in self.r.nodes]
        permutable = w_t in g.constants and not g.fed(w_t) and readers == [self.anchor_index]
        shapes = [(geo.oc, geo.pixels_at(h), geo.k, h(geo.batch)) for h in self.binding_hints]
        dims = (shapes, es, math_, a_mode, b_mode)
        ranked, chosen = self.choose_tile(*dims)
        taps = False
        if b_mode == IM2COL and a_mode == ROW and geo.c % 16 == 0 and (one_tap or permutable):
            t_ranked, t_chosen = self.choose_tile(*dims, geo.c)
            if t_chosen is not None and (self.forced_tile or t_chosen.est_us <= chosen.est_us):
                ranked, chosen, taps = t_ranked, t_chosen, True
        if taps and not one_tap:
            self.input_perms.append((w_t, TAP_MAJOR_PERM))
        funcs: list[ir.Func] = []
        if a_mode == ROW:
            funcs.append(self.func("a_base", (vb,), lambda: ir.i64(0)))
        else:
            funcs.append(self.func("a_load", (vb, vm, vk), lambda: self.value(
                w_t, (vm,) + self.unravel(vk, (geo.c, geo.kh, geo.kw)))))
        if b_mode in (ROW, IM2COL):
            funcs.append(self.func("b_base", (vb,), lambda: self.linearize((vb,) + (ir.i64(0),) * 3, self._shape(x_t))))
        else:
            funcs.append(self.func("b_load", (vb, vk, vn), lambda: self.im2col(x_t, geo, vb, vk, vn)))
        self.epilogue(funcs, vb, vm, vn, lambda b, m: self.unravel(b, (geo.batch,)) + self.unravel(m, (geo.oc,)),
                      geo.ow, lambda n: self.unravel(n, (geo.oh, geo.ow)))
        (sh, sw), (dh, dw), (ph, pw) = geo.stride, geo.dilation, geo.pad
        h, w, ow = (self.encode(d) for d in (geo.h, geo.w, geo.ow))  # runtime dims as -(k + 1)
        targs = ("0", f"ofz::gemm::Conv2d<{geo.c}, {h}, {w}, {geo.kh}, {geo.kw}, {sh}, {sw}, {dh}, {dw}, "
                      f"{ph}, {pw}, {ow}{', 1' if taps else ''}>") if b_mode == IM2COL else ()
        return self.finish(funcs, chosen, ranked, storage, math_, (a_mode, self.args[w_t] if a_mode == ROW else 0),
                           (b_mode, self.args[x_t] if b_mode in (ROW, IM2COL) else 0), [self.encode(geo.batch)],
                           [geo.oc], [self.encode(geo.oh), self.encode(geo.ow)], geo.k, targs)

    # ------------------------------------------------------------------ the kernel
    def gemm(self) -> tuple[ir.Kernel, tuple[int, ...], tuple[tuple[tuple[int, ...], int], ...], int, tuple, int]:
        if self.anchor.op_type in ops.CONV:
            return self.conv_gemm()
        node, g = self.anchor, self.g
        a_t, b_t, y_t = node.input[0], node.input[1], node.output[0]
        a_s, b_s, y_s = self._shape(a_t), self._shape(b_t), self._shape(y_t)
        if len(a_s) < 2 or len(b_s) < 2:
            raise LoweringError("matrix-vector products (rank-1 MatMul operands) are left to ORT")
        trans_a = node.op_type == "Gemm" and bool(attr(node, "transA", 0))
        trans_b = node.op_type == "Gemm" and bool(attr(node, "transB", 0))
        storage, math_, es = self.operand_math(a_t, b_t, "GEMM")
        M, N = y_s[-2], y_s[-1]
        K = a_s[-2] if trans_a else a_s[-1]
        reads = None if self.row_mode else legal.gated_reads(g, self.r.nodes, self.anchor_index)
        if reads is not None:
            self.gated, self.gated_reads = int(N) // 2, reads
            if math_ == tl.SIMT:
                raise LoweringError("gated pairs need tensor-core fragments (16-bit operands, or fp32 with --tf32)")
            for o in self.r.outputs:
                if self._shape(o) != y_s[:-1] + (self.gated,) or o in self.perms:
                    raise LoweringError(f"output '{o}' of shape {self._shape(o)} is not the gated pairs' "
                                        f"{y_s[:-1] + (self.gated,)}")
        for o in self.r.outputs if self.gated is None else ():
            if self._shape(o) != y_s and o not in self.perms and not (
                    self.row_mode and self._shape(o) in (y_s[:-1], y_s[:-1] + (1,))):
                raise LoweringError(f"output '{o}' of shape {self._shape(o)} is neither the GEMM's shape {y_s} "
                                    f"nor a transpose of it")
        if self.row_mode and self.static(N) is None:
            raise LoweringError("a row-wise epilogue needs a static row length N")

        batch_shape = tuple(y_s[:-2])
        fold = all(d == 1 for d in b_s[:-2]) and not trans_a
        # kernel coordinates (b, m, n) -> output index; operand element indices
        vb, vm, vn, vk = Var("gb", I64), Var("gm", I64), Var("gn", I64), Var("gk", I64)

        def out_prefix(b: Expr, m: Expr) -> tuple[Expr, ...]:
            if fold:
                return self.unravel(m, batch_shape + (M,))
            return self.unravel(b, batch_shape) + (m,) if batch_shape else (m,)

        def operand_index(t: str, shape: tuple[Dim, ...], b: Expr, m_or_k: Expr, k_or_n: Expr, is_a: bool,
                          trans: bool) -> tuple[Expr, ...]:
            pre = out_prefix(b, m_or_k) if is_a else out_prefix(b, ir.i64(0))
            batch_idx = self.broadcast(pre[:-1], shape[:-2]) if len(shape) > 2 else ()
            if is_a:
                row, col = pre[-1], k_or_n
            else:
                row, col = m_or_k, k_or_n
            return batch_idx + ((col, row) if trans else (row, col))

        # operand modes
        k_static = self.static(K)
        n_static = self.static(N)
        a_direct = (a_t in self.args and a_t not in self.producer and not trans_a and k_static is not None
                    and (k_static * es) % 16 == 0)
        fold_targ = self.fold_operand(es, b_s) if self.fold else None
        if fold_targ:  # the kernel multiplies the LayerNorm's input X, copied like any row-major A
            a_t, a_direct = self.fold.x, True
        b_input = b_t in self.args and b_t not in self.producer
        if b_input and trans_b and k_static is not None and (k_static * es) % 16 == 0:
            b_mode = COL
        elif b_input and not trans_b and n_static is not None and (n_static * es) % 16 == 0:
            b_mode = ROW
        else:
            b_mode = GENERIC
        a_mode = ROW if a_direct else GENERIC

        funcs: list[ir.Func] = []
        if a_mode == ROW:
            funcs.append(self.func("a_base", (vb,), lambda: self.linearize(
                operand_index(a_t, a_s, vb, ir.i64(0), ir.i64(0), True, False), a_s) if not fold else ir.i64(0)))
        else:
            funcs.append(self.func("a_load", (vb, vm, vk), lambda: self.value(
                a_t, operand_index(a_t, a_s, vb, vm, vk, True, trans_a))))
        def b_base() -> ir.Func:
            return self.func("b_base", (vb,), lambda: self.linearize(
                operand_index(b_t, b_s, vb, ir.i64(0), ir.i64(0), False, False), b_s))
        if b_mode != GENERIC:
            funcs.append(b_base())
        else:
            funcs.append(self.func("b_load", (vb, vk, vn), lambda: self.value(
                b_t, operand_index(b_t, b_s, vb, vk, vn, False, trans_b))))

        if self.gated is not None:
            self.gated_epilogue(funcs, vb, vm, vn, out_prefix, self.gated)
        elif not self.row_mode:
            # mma fragments (not SIMT lanes) store such rows through shared memory, a warp a row at a time
            self.stage_out = math_ != tl.SIMT and self.misaligned_rows(N)
            self.epilogue(funcs, vb, vm, vn, out_prefix, N, rows8=self.stage_out)

        # tile construction
        shapes = [(h(M) * (math.prod(h(d) for d in batch_shape) if fold else 1), h(N), h(K),
                   1 if fold else math.prod(h(d) for d in batch_shape)) for h in self.binding_hints]
        ranked, chosen = self.choose_tile(shapes, es, math_, a_mode, b_mode)
        fam_ranked = ranked  # the chosen family's candidates (the others' bests join `ranked` for --profile)
        k_aligned = not trans_b and k_static is not None and (k_static * es) % 16 == 0
        wg_b = self.wgmma_operand(b_t, b_s, b_mode, math_, a_mode, k_aligned)
        if wg_b is not None:
            # the warpgroup families: cp.async-fed, and TMA-fed where both operands are whole 2-D matrices
            # (the batch folded into M, the weight 2-D: one tensor map each); a folded LayerNorm's moments are
            # gathered by the mma.sync and the TMA mainloops only
            tma_ok = fold and len(b_s) == 2 and not self.row_mode
            fams = [(math_, ranked, chosen, b_mode == COL)]
            for fam_math in ((() if fold_targ else (tl.WGMMA_OF[math_],)) + ((tl.WS_OF[math_],) if tma_ok else ())):
                try:
                    f_ranked, f_chosen = self.choose_tile(shapes, es, fam_math, a_mode, COL)
                except LoweringError:  # no tile of the family fits (a row-wise epilogue's row too long for a cluster)
                    continue
                fams.append((fam_math, f_ranked, f_chosen, True))
                if fam_math in tl.WS:
                    self.tma_shapes = shapes
            if self.forced_tile is not None:
                want = tl.GemmTile.of_candidate(self.forced_tile).family
                pick = next((i for i, f in enumerate(fams) if f[2] is not None and tl.family(f[0]) == want), 0)
            else:
                # ties go to the later family (the user opted in to wgmma; TMA issues no copies): where traffic
                # or latency binds them alike, their lower issue cost is what the estimate does not see
                times = [self.family_us(f[1], f[2], shapes, es, f[0], f[3]) if f[2] is not None else math.inf
                         for f in fams]
                pick = min(range(len(fams)), key=lambda i: (times[i], -i))
            math_, ranked, chosen, _ = fams[pick]
            fam_ranked = ranked
            # --profile measures the other families' best too
            ranked = list(ranked) + [f[1][0] for i, f in enumerate(fams) if i != pick and f[1]]
            if self.row_mode:  # only mma.sync tiles span a row: both kinds across the families
                ranked = tl.with_both_row_kinds(ranked, [r for f in fams for r in f[1]], int(N))
            if pick > 0:
                if b_mode != COL:  # a constant [K][N] weight, transposed offline
                    self.input_perms.append((b_t, (1, 0)))
                if b_mode == GENERIC:  # its misaligned [K][N] rows were gathered; the [N][K] ones are copied
                    funcs = [f for f in funcs if f.name != "b_load"] + [b_base()]
                b_mode = COL
        if chosen is None:  # a forced tile of a family this GEMM cannot use, or that does not fit it
            raise LoweringError(f"tile {self.forced_tile} does not apply to this GEMM")
        self.size_estimates(fam_ranked, shapes, es, math_, a_mode, b_mode)
        targs: tuple[str, ...] = ()
        if self.row_mode:
            targs = self.row_epilogue(funcs, vb, out_prefix, y_s, chosen.tile)
            self.row_cluster = int(targs[4]) if len(targs) > 4 else 1
        if fold_targ:
            if chosen.split > 1:
                raise LoweringError("the LayerNorm fold cannot split K")
            targs = (targs[0] if targs else "0", "ofz::gemm::NoConv", "1", fold_targ, *targs[4:])

        batch_terms = [] if fold else [self.encode(d) for d in batch_shape]
        m_terms = ([self.encode(d) for d in batch_shape] if fold else []) + [self.encode(M)]
        a_arg = self.args[a_t] if a_mode != GENERIC else 0
        b_arg = self.args[b_t] if b_mode != GENERIC else 0
        return self.finish(funcs, chosen, ranked, storage, math_, (a_mode, a_arg), (b_mode, b_arg), batch_terms,
                           m_terms, [self.encode(N)], K, targs)

    def fold_operand(self, es: int, b_s: tuple[Dim, ...]) -> str:
        """The template's Fold argument for the region's LayerNorm prologue, or a LoweringError: X is a region
        input with 16-byte rows, the weight 2-D, and the slots the rewriter fills with folded constants
        (gamma, beta, the GEMM's bias) read by their own op alone in the region."""
        f = self.fold
        assert f is not None
        if f.x not in self.args or f.x in self.producer:
            raise LoweringError("the LayerNorm's input is computed in the region")
        if (f.k * es) % 16:
            raise LoweringError(f"the LayerNorm fold copies rows of X whole: {f.k} elements are not 16-byte rows")
        if len(b_s) != 2:
            raise LoweringError("the LayerNorm fold needs a 2-D weight")
        owner = {f.scale: f.norm, f.bias: f.norm, f.gemm_bias: f.bias_add if f.bias_add is not None else f.anchor}
        for t, reader in owner.items():
            if t and [i for i in self.g.consumers.get(t, ()) if i in self.r.nodes] != [reader]:
                raise LoweringError(f"'{t}' is also read by another op of the region")
        self.ln_fold = LayerNormFold(f.weight, f.scale, f.bias, f.gemm_bias, f.trans_b)
        return f"ofz::gemm::LayerNormFold<{int(np.float32(f.epsilon).view(np.uint32))}u>"

    def wgmma_operand(self, b_t: str, b_s: tuple[Dim, ...], b_mode: int, math_: int, a_mode: int,
                      k_aligned: bool = False) -> Optional[int]:
        """B's mode before a warpgroup-MMA kernel may run this GEMM, or None: the target has wgmma (and the user
        opted in), 16-bit operands, A copied, a row-wise epilogue only split across a cluster, and B K-major:
        stored [N][K] (Gemm transB) or a constant [K][N] weight that nothing else reads and no user can feed,
        transposed offline. Such a weight may have rows of any length (N = 50,257 logits: GENERIC here) when
        K's are 16-byte aligned (`k_aligned`), which is what the transposed rows are."""
        if not self.tgt.wgmma or math_ not in tl.WGMMA_OF or a_mode != ROW or \
                (self.row_mode and self.tgt.max_cluster < 2):
            return None
        if b_mode == COL:
            return COL
        g = self.g
        readers = [i for i in g.consumers.get(b_t, ()) if i in self.r.nodes]
        if (b_mode == ROW or (b_mode == GENERIC and k_aligned)) and len(b_s) == 2 and b_t in g.constants and \
                not g.fed(b_t) and readers == [self.anchor_index]:
            return b_mode
        return None

    def staged(self, a_mode: int, b_mode: int, taps: int = 0) -> tuple[int, int]:
        """How A and B reach shared memory, and whether the output leaves through it, as the tile model
        charges it (tiles.rank_tiles' `staged`)."""
        return (tl.ELEMENTS if a_mode == GENERIC else tl.NORMED if self.fold else tl.DIRECT,
                tl.TAPS if taps else tl.ELEMENTS if b_mode in (GENERIC, IM2COL) else tl.DIRECT) + \
            ((tl.STAGE_OUT,) if self.stage_out else ())

    def size_estimates(self, ranked: list[tl.Ranked], shapes: list[tl.Shape], es: int, math_: int,
                       a_mode: int, b_mode: int) -> None:
        """KernelSpec.tile_us / binding_rows for the chosen family's candidates (the chosen one first). Not for
        row-wise epilogues (their split rows launch clusters per size) or a single binding."""
        if self.row_mode or len(shapes) < 2 or not ranked:
            return
        staged = self.staged(a_mode, b_mode)
        self.tile_us = tuple((r.tile.candidate(r.split), tuple(
            tl.estimate_at(self.tgt, r, sh, es, math_, b_mode == COL, staged=staged) for sh in shapes)) for r in ranked)
        self.binding_rows = tuple(m * batch for m, _, _, batch in shapes)

    def joint_us(self, r: tl.Ranked, shapes: list[tl.Shape], es: int, math_: int, b_nk: bool) -> float:
        """A chosen tile's estimate over the bindings (geometric mean), to compare tile families."""
        return tl.geomean([tl.estimate_at(self.tgt, r, sh, es, math_, b_nk, self.row_mode) for sh in shapes])

    def family_us(self, ranked: list[tl.Ranked], chosen: tl.Ranked, shapes: list[tl.Shape], es: int, math_: int,
                  b_nk: bool) -> float:
        """A tile family's time over the bindings, to compare families: its chosen tile's joint estimate or,
        where `tiles.by_size` would build kernel variants from the family's candidates (as the build then
        does: api._size_variants, or --profile's measurements), those variants' (Llama's gate GEMM, 1536 x
        576: the TMA family's one tile for both batch 1 and 32 is 64 x 64, 2.4x its 128 x 192 at batch 32, so
        the family lost to mma.sync though its variants win both)."""
        if self.row_mode or len(shapes) < 2 or self.forced_tile is not None:
            return self.joint_us(chosen, shapes, es, math_, b_nk)  # one tile serves every size
        times = {r.tile.candidate(r.split): tuple(tl.estimate_at(self.tgt, r, sh, es, math_, b_nk, self.row_mode)
                                                  for sh in shapes) for r in ranked}
        single = times[chosen.tile.candidate(chosen.split)]
        _, _, combo = tl.by_size(list(times.items()), [m * batch for m, _, _, batch in shapes], single)
        return tl.geomean(combo or single)

    def choose_tile(self, shapes: list[tl.Shape], es: int, math_: int, a_mode: int, b_mode: int,
                    taps: int = 0) -> tuple[list[tl.Ranked], Optional[tl.Ranked]]:
        """The ranked candidates and the chosen one (the best over the bindings' (m, n, k, batch) `shapes`, or
        the forced tile at its best split). `taps`: the channel count of a tap-major gather, which BK must
        divide; then (_, None) where no tile fits."""
        m, n, k, batch = shapes[0]
        staged = self.staged(a_mode, b_mode, taps)
        ranked = tl.rank_for_bindings(self.tgt, shapes, es, math_, b_mode == COL, row=self.row_mode, staged=staged,
                                      bk_divides=taps)
        if taps and (not ranked or (self.forced_tile and taps % self.forced_tile[2])):
            return ranked, None
        if not ranked:
            raise LoweringError("no GEMM tile fits the hardware table entry" +
                                (f" with a {n}-column row in one tile" if self.row_mode else ""))
        if not self.forced_tile:
            return ranked, ranked[0]
        forced = tl.GemmTile.of_candidate(self.forced_tile)
        if forced.family != tl.family(math_):
            return ranked, None  # the forced tile is of another family
        split = self.forced_tile[6] if len(self.forced_tile) > 6 else None
        chosen = tl.estimate_tile(self.tgt, forced, m, n, k, batch, es, math_, b_mode == COL, self.row_mode, staged,
                                  split)
        if chosen is None and split not in (None, 1):
            raise LoweringError(f"tile {self.forced_tile[:6]} cannot split K {split} ways here")
        return ranked, chosen or tl.Ranked(forced, math.inf, 1)

    def finish(self, funcs: list[ir.Func], chosen: tl.Ranked, ranked: list[tl.Ranked], storage: str, math_: int,
               a: tuple[int, int], b: tuple[int, int], batch_terms: list[int], m_terms: list[int], n_terms: list[int],
               K: Dim, targs: tuple[str, ...] = ()):
        """The kernel: one `ofz::gemm::run` call over batch x M x N x K (M and N products of encoded dims);
        a and b are (mode, argument);
        targs: the template's ROW_TPR and Geo arguments where they differ from the defaults."""
        es = self.esize(storage)
        tile, split = chosen.tile, chosen.split
        # B multicast: a unit is a cluster's group of tiles stacked along M
        units_ceil = ((tuple(m_terms), tile.bm * tile.mcast), (tuple(n_terms), tile.bn))
        if split > 1:  # ROW_TPR, Geo, SPLIT
            targs = (targs[0] if targs else "0", targs[1] if len(targs) > 1 else "ofz::gemm::NoConv", str(split))
        if tile.mcast > 1 or tile.pingpong:  # ROW_TPR, Geo, SPLIT, Fold, RSPLIT, PHASES at their defaults; MC, PP
            assert not targs and split == 1, "B multicast and ping-pong: a plain epilogue, no split-K"
            targs = ("0", "ofz::gemm::NoConv", "1", "ofz::gemm::NoFold", "1", "0", str(tile.mcast),
                     "1" if tile.pingpong else "0")
        call = ir.Call("ofz::gemm::run",
                       (C_ELEM[storage], *(str(v) for v in tile.as_tuple()), str(a[0]), str(b[0]), str(math_), "OPS",
                        *targs),
                       (ir.i64(a[1]), ir.i64(b[1]), self.product(batch_terms), self.product(m_terms), self.product(n_terms),
                        self.dim(K), *((ir.Op("tma_maps", (), I64),) if tile.tma else ())))
        if tile.tma:  # the tensor maps of A and B: (input, box rows, element type); boxes are 64 wide
            assert not batch_terms and a[0] == ROW and b[0] == COL, "TMA operands are whole 2-D matrices"
            elem = {"f16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[storage]
            self.tma = ((a[1], tile.bm, elem), (b[1], tile.bn // tile.mcast, elem))  # multicast: B's box in parts
            self.multicast = tile.mcast
            # persistent: the producer fills the ring with the next tile while the consumers store this one
            self.blocks_per_sm = chosen.blocks_per_sm
        self.scopes = [_Scope(set())]
        self.emit(call)
        # cp.async reads the row- and column-major operands in 16-byte chunks
        aligned = tuple((arg, 16) for mode, arg in (a, b) if mode in (ROW, COL))
        # __launch_bounds__'s blocks per SM: a TMA tile that moves registers needs exactly its share; a row split
        # across a cluster gets the tile model's count, without which ptxas capped a 256-thread mma.sync tile
        # of 182 registers at 128 and spilled (NVRTC 13.5)
        min_blocks = 1 if tile.moves_registers else chosen.blocks_per_sm if self.row_cluster > 1 else 0
        # a staged epilogue's slices: one per warp of the block (ortfuse_gemm.h StageOut)
        consts = (("kStageOut", tile.threads // 32),) if self.stage_out else ()
        kernel = self.kernel(tile.threads, 0, ("ortfuse_gemm.h",), tuple(funcs), aligned, tile.wgmma, tile.tma,
                             min_blocks, consts)
        smem = tile.smem_bytes(es, b[0] == COL, self.row_mode, split, self.row_cluster, self.stage_out)
        if tile.block_smem_bytes(es, b[0] == COL, self.row_mode, split, self.fold is not None, self.row_cluster,
                                 self.stage_out) > self.tgt.smem_per_block:
            raise LoweringError(f"GEMM tile needs {smem} bytes of shared memory")
        candidates = [r.tile.candidate(r.split) for r in ranked]
        if ranked[0].split > 1 and ranked[0].tile.candidate(1) not in candidates:
            candidates.insert(1, ranked[0].tile.candidate(1))  # --profile measures the split itself
        if any(r.tile.tma for r in ranked) and self.fold is None:  # (neither mainloop gathers a fold's moments)
            candidates += [c for c in dict.fromkeys(self.unranked_candidates(es)) if c not in candidates]
        return kernel, tuple(batch_terms), units_ceil, smem, tuple(candidates), split


    def unranked_candidates(self, es: int) -> list[tuple[int, ...]]:
        """--profile candidates of the TMA mainloops the tile model does not rank until a GPU has measured them
        (docs/design.md, "B multicast" and "Ping-pong consumers"): at each binding, the best unsplit TMA tile
        with B multicast, and the best ping-pong tile without and with it."""
        out = []
        for m, n, k, batch in self.tma_shapes:
            ranked = tl.rank_tiles(self.tgt, m, n, k, batch, es, tl.WS_F16, True, top_k=10**6)
            best = [r.tile for r in ranked if r.split == 1][:1] + [r.tile for r in tl.rank_pingpong(
                self.tgt, m, n, k, batch, es)[:1]]
            out += [t.candidate(1) for t in best if t.pingpong and self.fits(t, es)]
            twins = [t.multicast_twin() for t in best]
            out += [t.candidate(1) for t in twins if t is not None and self.tgt.max_cluster >= t.mcast and
                    self.fits(t, es)]
        return out

    def fits(self, t: tl.GemmTile, es: int) -> bool:
        """Whether a TMA tile ranked without this kernel's staging slices still fits beside them."""
        return t.block_smem_bytes(es, True, stage_out=self.stage_out) <= self.tgt.smem_per_block


def lower_gemm(graph: Graph, region: Region, tgt: hw.Target, tf32: bool = False,
               tile: Optional[tuple[int, ...]] = None) -> KernelSpec:
    lw = _GemmLowerer(graph, region, tgt, tf32, tile)
    kernel, units, units_ceil, smem, ranked, split = lw.gemm()
    shapes = lw.output_shapes()
    return KernelSpec(kernel, tuple(region.inputs), tuple(region.outputs), tuple(lw.sym_pairs), units, 1,
                      tuple(graph.tensors[o].dtype for o in region.outputs), shapes, smem, units_ceil, ranked, split,
                      tuple(lw.derived), tuple(lw.limits), input_perms=tuple(lw.input_perms), ln_fold=lw.ln_fold,
                      tma=lw.tma, blocks_per_sm=lw.blocks_per_sm, row_cluster=lw.row_cluster, multicast=lw.multicast,
                      tile_us=lw.tile_us, binding_rows=lw.binding_rows, sym_sums=tuple(lw.sums),
                      sym_products=tuple(lw.products), dim_checks=tuple(lw.sum_checks))


"""Region -> kernel IR.

The lowering evaluates the region's tensors element by element: `value(t, idx)` is the expression for
`t[idx]`, built by walking back through producers (broadcasting, layout ops as index maps,
reductions as row passes) to loads of the region's inputs. Each value is bound once (`Let`) in the
outermost loop it can live in, so row-invariant work (reduction results, their rsqrt) is hoisted.

Two kernel shapes:
* pointwise: one thread per VEC consecutive elements of the iteration space (grid-stride loop);
* rowreduce: TPR threads per row of the reduced tensor; each reduction is a pass over the row
  (fp32 accumulation, warp shuffles + shared memory), then a last pass writes the outputs.
Loads and stores along the innermost axis become 16-byte vector accesses when its size allows."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Container, Optional

import numpy as np
import onnx

from ortfuse.customops import ir, scalar, target as hw
from ortfuse.customops.ir import BOOL, F32, I64, Expr, Var
from ortfuse.rewriter import iota
from ortfuse.rewriter.graph import Dim, Graph
from ortfuse.rewriter.layernorm_fold import LayerNormFold
from ortfuse.search import conv, legal, ops, pad, pool, resize
from ortfuse.search.plan import Region


class LoweringError(Exception):
    """The region cannot be one kernel of the shapes above; the message is the reason."""


@dataclass
class RowSplit:
    """A row pass split across a thread-block cluster (lower_gemm's row-wise epilogue over N > BN columns,
    ortfuse_gemm.h): the block's columns [n0, n1), the tile's rows (`bm`, a slot's stride), the reductions in
    the order the pass completes them, and the pass being generated: `phase` None discovers that order;
    phase p < len(order) reduces the block's share of reduction p into its slot (earlier ones combined over
    the cluster, later ones not needed); len(order) is the final pass, every reduction combined."""

    n0: Expr
    n1: Expr
    bm: int
    rsplit: int  # the cluster's blocks (RSPLIT)
    order: list = dataclasses.field(default_factory=list)
    phase: Optional[int] = None
    reduced: bool = False  # phase p produced its reduction


@dataclass(frozen=True)
class KernelSpec:
    """A lowered region: the kernel and everything the fused node needs to launch it."""

    kernel: ir.Kernel
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    sym_dims: tuple[tuple[int, int], ...]  # runtime dim k = inputs[i].shape[axis]
    units: tuple[int, ...]  # product; t >= 0 constant, t < 0 -> dim[-t-1]
    units_per_block: int
    out_dtypes: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]  # encoded like units
    smem: int = 0  # dynamic shared memory bytes
    units_ceil: tuple[tuple[tuple[int, ...], int], ...] = ()  # (terms, div): units *= ceil(prod(terms) / div)
    # GEMM: ranked candidates (BM, BN, BK, WM, WN, STAGES, SPLIT) for --profile; a split best tile is
    # followed by the same tile unsplit, so the split is measured too
    tiles: tuple[tuple[int, ...], ...] = ()
    # GEMM split-K: launched in clusters of up to this many blocks that share each tile's K (1 = never)
    split_k: int = 1
    # runtime dims after sym_dims: dim len(sym_dims) + j = floor((term + add) / div) + 1 for (term, add, div):
    # a Conv's output size on a symbolic image
    sym_derived: tuple[tuple[int, int, int], ...] = ()
    # (terms, limit): the product of the terms must stay below limit (a symbolic image in a 32-bit gather),
    # checked before each launch
    dim_limits: tuple[tuple[tuple[int, ...], int], ...] = ()
    # per argument (inputs, then outputs): the byte alignment its address needs for the kernel's vector
    # accesses (1: none), checked before each launch
    arg_align: tuple[int, ...] = ()
    # constant inputs the kernel reads in another layout: (tensor, perm) -> the fused node is given
    # Transpose(tensor, perm), which the rewriter stores as a new initializer
    input_perms: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # run-time shape tensors the region's ops read (Range limits, Expand targets), as dims of the inputs
    # (`legal.shape_reads`); the fused node's function body rebuilds them from the inputs' shapes
    shape_reads: tuple["legal.ShapeRead", ...] = ()
    # (input, axis, term): an input axis whose size the kernel assumes, checked at launch: term < 0 is runtime
    # dim -(term + 1), else a size (shape inference may have merged dims that differ at run time)
    dim_checks: tuple[tuple[int, int, int], ...] = ()
    # a LayerNorm folded into the GEMM: the rewriter gives the kernel folded constants in three input slots
    ln_fold: Optional[LayerNormFold] = None
    # operands the tensor memory accelerator copies (sm_90a TMA GEMMs): (input, box rows, ONNX element type)
    # for A then B; the library encodes a 2-D tensor map of each per launch: the input's last dim by the
    # product of the others, boxes of 64 x box rows in the 128-byte swizzle (kernel parameter OfzTma)
    tma: tuple[tuple[int, int, int], ...] = ()
    # persistent kernels (a TMA GEMM: its producer fills the next tile's stages while the consumers store
    # this one): the grid is capped at this many blocks per SM of the device (0: one block per work unit)
    blocks_per_sm: int = 0
    # a GEMM whose row-wise epilogue is split across a cluster (ortfuse_gemm.h RSPLIT): launched in clusters of
    # exactly this many blocks, on sm_90+ only (1: no such split)
    row_cluster: int = 1
    # a TMA GEMM whose clusters share B's tiles by multicast (ortfuse_gemm.h run_wgmma_ws MC): launched in
    # clusters of exactly this many blocks, its units counting clusters (1: none)
    multicast: int = 1
    # GEMM: the tile model's estimate of each candidate of the chosen tile family at each binding of the
    # symbolic dims (batch 1, and batch 32 where the batch is symbolic), and the rows (the first output's
    # leading dims) at each: kernel variants by size where no --profile measures them
    tile_us: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()
    binding_rows: tuple[int, ...] = ()
    # runtime dims after the derived ones: the sum of two terms each (a Concat of run-time spans: a KV cache's
    # past and new tokens)
    sym_sums: tuple[tuple[int, int], ...] = ()
    # the rules of sym_sums that multiply their two terms instead (a Reshape flattening run-time axes: "79*batch")
    sym_products: tuple[int, ...] = ()

    @property
    def block(self) -> int:
        return self.kernel.block


class _Scope:
    def __init__(self, names: set[str]):
        self.stmts: list[ir.Stmt] = []
        self.memo: dict[object, Expr] = {}
        self.names = names


MAX_RUNTIME_DIMS = 16  # OFZ_MAX_DIMS, the kernel ABI's (customops/include/ortfuse_args.h)
_IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf}
ROW_COLUMN_GROUPS = 4  # a GEMM row epilogue's column loop of at most this many trips is printed straight-line
# a long row's column loops (each thread at least this many vectors: more rows than threads cover, as a
# GroupNorm's group or a big softmax) run this many columns a trip, their loads first (`row_loop`), where one
# load in flight each left a lone block streaming ~8 GB/s (GroupNorm(32, 320) at 64x64, n=1: 40.5 us on an
# H100, 2026-11-27); the hand-unrolled loops are not measured yet
ROW_LONG_UNROLL = 4
_COMBINE = {"sum": "add", "max": "fmax", "min": "fmin"}


def _even_chunks(items: list, most: int) -> list[list]:
    """`items` in order, in the fewest chunks of at most `most`, their sizes differing by at most one."""
    n = -(-len(items) // most) if items else 0
    size, extra = divmod(len(items), n) if n else (0, 0)
    out, at = [], 0
    for k in range(n):
        step = size + (k < extra)
        out.append(items[at:at + step])
        at += step
    return out


def slice_index(g: Graph, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> tuple[Expr, ...]:
    """The element of a Slice's input that its output holds at `idx`: start + coordinate * step per axis."""
    from ortfuse.search.attention import slice_steps

    starts, steps = legal.slice_starts(g, node), slice_steps(g, node)
    return tuple(ir.add(ir.mul(c, ir.i64(steps.get(a, 1))), ir.i64(starts.get(a, 0))) for a, c in enumerate(idx))


def _storage(dtype: int, what: str) -> str:
    s = scalar.STORAGE.get(dtype)
    if s is None:
        raise LoweringError(f"{what} has element type {onnx.TensorProto.DataType.Name(dtype)}, which ortfuse does not fuse")
    return s


def dim_factors(d: str, known: Container[str]) -> Optional[list[str]]:
    """`d`'s factors where it is a product of sizes and `known` dims ("2*seq", "batch*sequence",
    "64*floor(h/2)"): split at the top level only, and none with another operator there ("2*p + s" is a sum,
    even where "p + s" is a dim)."""
    parts, depth, start = [], 0, 0
    for k, c in enumerate(d):
        depth += (c == "(") - (c == ")")
        if depth == 0 and c in "+-/":
            return None
        if depth == 0 and c == "*":
            parts.append(d[start:k].strip())
            start = k + 1
    parts.append(d[start:].strip())
    if len(parts) < 2 or not all(p.isdigit() or p in known for p in parts):
        return None
    return parts


class _Lowerer:
    def __init__(self, graph: Graph, region: Region, tgt: hw.Target, hints: dict[str, int]):
        self.g, self.r, self.tgt, self.hints = graph, region, tgt, hints
        self.producer = {o: graph.nodes[i] for i in region.nodes for o in graph.nodes[i].output if o}
        self.args = {t: k for k, t in enumerate(region.inputs)}
        self.out_args = {t: len(region.inputs) + k for k, t in enumerate(region.outputs)}
        self.dims: dict[str, int] = {}
        self.sym_pairs: list[tuple[int, int]] = []
        for i, t in enumerate(region.inputs):
            for axis, d in enumerate(self._shape(t)):
                if isinstance(d, str) and d not in self.dims:
                    self.dims[d] = len(self.sym_pairs)
                    self.sym_pairs.append((i, axis))
        # a Conv's output size on a symbolic image, from its input's: dim n_sym + j is
        # floor((d[src] + add) / div) + 1 for derived[j] = (src term, add, div)
        self.derived: list[tuple[int, int, int]] = []
        self.sums: list[tuple[int, int]] = []  # after the derived ones (`_sum_of`, `_product_dim`)
        self.products: list[int] = []  # the rules of `sums` that multiply their terms instead
        for i in region.nodes:
            n = graph.nodes[i]
            geo = conv.conv_geometry(graph, n) if n.op_type in ops.CONV else None
            if geo is None or isinstance(geo, str):
                continue
            for axis, (size, out) in enumerate(((geo.h, geo.oh), (geo.w, geo.ow))):
                if isinstance(out, str) and out not in self.dims and isinstance(size, str) and size in self.dims:
                    add, div = geo.out_rule(axis)
                    self.dims[out] = self.num_dims
                    self.derived.append((-self.dims[size] - 1, add, div))
                    self.hints.setdefault(out, (self.hint(size) + add) // div + 1)
        # a Concat's span that an input declares too (a mask over "past + seq" beside the Concat of the past and
        # the new tokens): bound from that input, so checked at launch against the sum of the spans it joins
        self.sum_checks: list[tuple[int, int, int]] = []
        for i in region.nodes:
            n = graph.nodes[i]
            out = graph.tensors.get(n.output[0]) if n.op_type == "Concat" else None
            if out is None or not out.shape:
                continue
            axis = scalar.attr(n, "axis", 0) % len(out.shape)
            d, spans = out.shape[axis], [self._shape(x)[axis] for x in n.input if x]
            if isinstance(d, str) and d in self.dims and self.dims[d] < len(self.sym_pairs) and \
                    all(isinstance(x, int) or x in self.dims for x in spans):
                terms = [x if isinstance(x, int) else -self.dims[x] - 1 for x in spans]
                self.sum_checks.append((*self.sym_pairs[self.dims[d]], self._sum_of(terms)))
        # outputs that are transposes of the iteration space: stored at the permuted index
        space = tuple(region.space)
        self.perms: dict[str, tuple[int, ...]] = {}
        for o in region.outputs:
            p = legal.output_perm(graph, set(region.nodes), o, space) if self._shape(o) != space else None
            if p is not None and p != tuple(range(len(space))):
                self.perms[o] = p
        # outputs that are reshapes of a row kernel's space (`legal.output_view`): stored at the linear offset
        self.views = {o for o in region.outputs if region.kind == "rowreduce" and o not in self.perms
                      and self._shape(o) != space and legal.output_view(graph, set(region.nodes), o, space)}
        # index tuples known to address a row-major tensor of a shape at a linear offset, and the space index
        # at each such offset: a Reshape between them maps the one to the other with no index arithmetic
        self.linear_of: dict[tuple[tuple[Expr, ...], tuple[Dim, ...]], Expr] = {}
        self.index_at: dict[tuple[Expr, tuple[Dim, ...]], tuple[Expr, ...]] = {}
        self.scopes = [_Scope(set())]
        self.defs: dict[str, Expr] = {}  # what each bound variable holds (the div/mod merge reads it)
        self.count = 0
        self.lanes: tuple[Expr, ...] = ()
        self.vec = 1
        self.inner_dim: Optional[Dim] = None
        self.row_idx: Optional[tuple[Expr, ...]] = None
        self.row_depth = 0
        self.tpr = 0
        self.split_row: Optional[RowSplit] = None
        self.row_c: Optional[Expr] = None  # row_pass: the row (clamped) and whether it exists
        # while set, every load is made under this condition (a Concat operand that may be empty at run time)
        self.guard: Optional[Expr] = None
        self.row_active: Optional[Expr] = None
        # the most columns a row pass covers where they are static (a GEMM row-wise epilogue's tile or row, a
        # short row kernel's row), so a column loop of a few trips is printed straight-line (column_groups)
        self.row_span: Optional[int] = None
        self.row_unroll = 0  # a long row's column loops: columns a trip (ROW_LONG_UNROLL, `row_loop`)
        # the lanes' first column where it is a multiple of VEC (the lanes then are it + 0 .. VEC - 1): a read
        # whose offset is it plus multiples of VEC and a constant is one aligned vector load (`_lane_vector`)
        self.lane_base: Optional[Expr] = None  # a Var, or 0 where the row is one vector
        self.lane_vec = 1  # the VEC lane_base is a multiple of
        # constant inputs read in another layout (`KernelSpec.input_perms`): loads index them permuted
        self.permuted: dict[str, tuple[int, ...]] = {}
        self.laid_out: set[str] = set()  # constants whose layout (permuted or not) is decided
        # while set, values are bound no further out than this scope (by index): reads the code must repeat
        # rather than hold (a window's weights: held across a row loop, 49 vectors spilled)
        self.floor: Optional[int] = None

    # ------------------------------------------------------------------ shapes and dims
    def _shape(self, t: str) -> tuple[Dim, ...]:
        info = self.g.tensors.get(t)
        if info is None or info.shape is None:
            raise LoweringError(f"shape of '{t}' is unknown")
        return info.shape

    def dim(self, d: Dim) -> Expr:
        if isinstance(d, int):
            return ir.i64(d)
        if d in self.dims:
            return Var(f"d{self.dims[d]}", I64)
        # exporters' derived dims such as "2*seq": products of known dims
        terms = dim_factors(d, self.dims)
        if terms:
            out: Expr = ir.i64(1)
            for p in terms:
                out = ir.mul(out, ir.i64(int(p)) if p.isdigit() else Var(f"d{self.dims[p]}", I64))
            return out
        if self._sum_dim(d):
            return Var(f"d{self.dims[d]}", I64)
        raise LoweringError(f"dim '{d}' cannot be computed from the region's inputs")

    def _sum_dim(self, d: str) -> bool:
        """Whether `d` is (now) a runtime dim: a sum of dims the kernel has, small multiples of them and constants
        ("past + seq", "p + 2*s", "seq + 1", as symbolic inference writes them; a Concat along a run-time axis)."""
        terms: list[int] = []
        for part in (p.strip() for p in d.split(" + ")):
            k, _, name = part.rpartition("*")  # "2*s": s added twice (a Concat of s-spans)
            if part.isdigit():
                terms.append(int(part))
            elif name in self.dims and (not k or (k.isdigit() and 1 <= int(k) <= 8)):
                terms += [-self.dims[name] - 1] * (int(k) if k else 1)
            else:
                return False
        if len(terms) < 2:
            return False
        self.dims[d] = -self._sum_of(terms) - 1
        return True

    def _sum_of(self, terms: list[int], product: bool = False) -> int:
        """The term of a new runtime dim that is the sum (or product) of `terms` (encoded like `units`): a chain
        of sym_sums rules, each adding (multiplying) one term."""
        acc = terms[0]
        for t in terms[1:]:
            if product:
                self.products.append(len(self.sums))
            self.sums.append((acc, t))
            acc = -self.num_dims  # the rule just added is runtime dim num_dims - 1
        return acc

    def _product_dim(self, d: str) -> bool:
        """Whether `d` is (now) a runtime dim: a product of dims the kernel has and sizes ("79*batch",
        "batch*sequence": a Reshape that flattens run-time axes together, as torch's MultiheadAttention's
        output does)."""
        parts = dim_factors(d, self.dims)
        if not parts or all(p.isdigit() for p in parts):
            return False
        self.dims[d] = -self._sum_of([int(p) if p.isdigit() else -self.dims[p] - 1 for p in parts], True) - 1
        return True

    def encode(self, d: Dim) -> int:
        if isinstance(d, int):
            return d
        if d in self.dims or self._product_dim(d) or self._sum_dim(d):  # "8*batch": one product rule
            return -self.dims[d] - 1
        raise LoweringError(f"output dim '{d}' is not a dim of any region input")

    def output_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The region's output shapes encoded like `units`, once the kernel is built (they may add sums and
        products), its runtime dims checked against the kernel ABI's."""
        shapes = tuple(tuple(self.encode(d) for d in self._shape(o)) for o in self.r.outputs)
        if self.num_dims > MAX_RUNTIME_DIMS:
            raise LoweringError(f"more than {MAX_RUNTIME_DIMS} symbolic dims in one kernel")
        return shapes

    @property
    def num_dims(self) -> int:
        """Runtime dims: those bound from input shapes, then the derived ones, then the sums and products
        (which `dim` and `encode` add as they meet them)."""
        return len(self.sym_pairs) + len(self.derived) + len(self.sums)

    def hint(self, d: Dim) -> int:
        return d if isinstance(d, int) else self.hints.get(d, 128)

    # ------------------------------------------------------------------ emission
    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def _scope_for(self, *es: Expr) -> _Scope:
        """The innermost scope holding a variable the expressions read (the outermost if none), but never one
        outside the `floor` scope while that is set."""
        fv = frozenset().union(*(ir.free_vars(e) for e in es))
        for k in range(len(self.scopes) - 1, -1, -1):
            if self.scopes[k].names & fv or (self.floor is not None and k <= self.floor):
                return self.scopes[k]
        return self.scopes[0]

    def bind(self, e: Expr, stem: str = "v") -> Expr:
        if isinstance(e, (ir.Const, Var)):
            return e
        scope = self._scope_for(e)
        v = Var(self.fresh(stem), e.ctype)
        self.defs[v.name] = e
        scope.stmts.append(ir.Let(v, e))
        scope.names.add(v.name)
        return v

    def bind_once(self, e: Expr, stem: str = "v") -> Expr:
        """`bind`, reusing the variable an equal expression was bound to where it is in scope."""
        key = ("bound", e)
        hit = self.lookup(key)
        if hit is None:
            hit = self.bind(e, stem)
            self.remember(key, hit)
        return hit

    def emit(self, s: ir.Stmt) -> None:
        self.scopes[-1].stmts.append(s)

    def define(self, name: str) -> None:
        self.scopes[-1].names.add(name)

    def lookup(self, key: object) -> Optional[Expr]:
        for s in reversed(self.scopes):
            if key in s.memo:
                return s.memo[key]
        return None

    def remember(self, key: object, e: Expr) -> Expr:
        (self._scope_for(e) if not isinstance(e, ir.Const) else self.scopes[-1]).memo[key] = e
        return e

    def loop(self, var: str, start: Expr, stop: Expr, step: Expr, body: Callable[[Var], None],
             unroll: int = 0) -> None:
        """`for var in [start, stop) by step`; `unroll`: its `#pragma unroll` factor."""
        v = Var(var, I64)
        self.scopes.append(_Scope({var}))
        body(v)
        inner = self.scopes.pop()
        self.emit(ir.For(v, start, stop, step, tuple(inner.stmts), unroll))

    def row_loop(self, var: str, start: Expr, stop: Expr, step: Expr, body: Callable[[Var], None],
                 unroll: int = 0) -> None:
        """A row pass's column loop; `unroll` > 1: unrolled by hand, `unroll` columns a trip, each trip's
        reads (up to ROW_READ_AHEAD) issued before its math (`ir.loads_first`), then the remaining columns one
        a trip. Left to `#pragma unroll`, ptxas kept one or two loads in flight (GroupNorm's rows at n=1, a
        block an SM: measured 40 us for 32 rows of 80 KB on an H100, 2026-11-27)."""
        if unroll <= 1:
            self.loop(var, start, stop, step, body)
            return
        span = ir.mul(step, ir.i64(unroll))
        # this lane's columns: ceil((stop - start) / step); its whole trips of `unroll` end at `whole`
        cols = ir.Op("div", (ir.add(ir.Op("max", (ir.Op("sub", (stop, start), I64), ir.i64(0)), I64),
                                    ir.add(step, ir.i64(-1))), step), I64)
        whole = self.bind(ir.add(start, ir.mul(ir.mul(ir.Op("div", (cols, ir.i64(unroll)), I64), ir.i64(unroll)),
                                               step)), "cend")
        v = Var(var, I64)
        self.scopes.append(_Scope({var}))
        for k in range(unroll):
            body(v if k == 0 else self.bind(ir.add(v, ir.mul(step, ir.i64(k))), "c"))
        inner = self.scopes.pop()
        self.emit(ir.For(v, start, whole, span, ir.loads_first(tuple(inner.stmts), hw.ROW_READ_AHEAD)))
        self.loop(self.fresh("c"), whole, stop, step, body)

    def column_groups(self, start: Expr, stop: Expr) -> Optional[list[tuple[Expr, Expr]]]:
        """A row pass whose columns are static (`row_span` at most: a GEMM's row-wise epilogue, or a row kernel
        of short rows): where its column loop (TPR threads, VEC columns each) runs at most ROW_COLUMN_GROUPS
        times, one (first column, whether it is one of the row's) per trip, the column clamped to the pass's
        first so that it can be read either way. The caller computes each unconditionally and selects (a reduction's identity) or guards
        (a store): straight-line code, which an unrolled row loop interleaves across rows; a loop or a branch
        per row kept each row's load, reduce and combine chain waiting in turn."""
        if self.row_span is None:
            return None
        step = self.tpr * self.vec
        trips = -(-self.row_span // step)
        if trips > ROW_COLUMN_GROUPS:
            return None
        key = ("column_groups", start, stop)  # one set per row pass: its reductions and stores share the loads
        hit = self.lookup(key)
        if hit is not None:
            return hit
        first = self.split_row.n0 if self.split_row is not None else ir.i64(0)
        out = []
        for t in range(trips):
            c = self.bind(ir.add(start, ir.i64(t * step)) if t else start, "c")
            valid = self.bind(ir.Op("lt", (c, stop), BOOL), "cin")
            out.append((self.bind(ir.Op("select", (valid, c, first), I64), "cs"), valid))
        self._scope_for(out[0][0]).memo[key] = out  # where their Lets are
        return out

    # ------------------------------------------------------------------ index math
    def linearize(self, idx: tuple[Expr, ...], shape: tuple[Dim, ...]) -> Expr:
        """The row-major offset of idx in `shape`. A coordinate bound as x + constant (a window's tap) adds
        x's term and the constant's apart, so the taps of one window share one base and differ by constants
        (addresses an immediate offset apart)."""
        coords = self._merge_divmod([(i, self.dim(d)) for i, d in zip(idx, shape) if d != 1])
        off: Expr = ir.i64(0)
        shift: Expr = ir.i64(0)
        stride: Expr = ir.i64(1)
        for i, de in reversed(coords):
            bound = self.defs.get(i.name) if isinstance(i, Var) else None
            if isinstance(bound, ir.Op) and bound.fn == "add" and isinstance(bound.args[1], ir.Const) \
                    and bound.ctype == I64:
                shift = ir.add(shift, ir.mul(bound.args[1], stride))
                i = bound.args[0]
            off = ir.add(off, ir.mul(i, stride))
            stride = ir.mul(stride, de)
        return ir.add(off, shift)

    def _merge_divmod(self, coords: list[tuple[Expr, Expr]]) -> list[tuple[Expr, Expr]]:
        """Adjacent coordinates (x / D, x % D) over dims (A, D) become x over A * D, and ((x / D) % E, x % D)
        over (E, D) become x % (E * D): the offset is the same for every x >= 0, and a contiguous access needs
        no division at all (an unravelled row index that is linearized again, as in a GEMM epilogue storing
        [batch, seq, N] rows)."""
        k = 0
        while k + 1 < len(coords):
            (hi, dh), (lo, dl) = coords[k], coords[k + 1]
            q = self.defs.get(hi.name) if isinstance(hi, Var) else None
            r = self.defs.get(lo.name) if isinstance(lo, Var) else None
            lane: Expr = ir.i64(0)  # x % D + j: a lane's column after its vector's (unravel)
            if isinstance(r, ir.Op) and r.fn == "add" and isinstance(r.args[0], Var) and \
                    isinstance(r.args[1], ir.Const):
                r, lane = self.defs.get(r.args[0].name), r.args[1]
            merged: Optional[Expr] = None
            if isinstance(r, ir.Op) and r.fn == "mod" and r.args[1] == dl:
                quot = ir.Op("div", r.args, I64)  # x / D, as `unravel` binds it
                if q == quot:
                    merged = ir.add(r.args[0], lane)
                elif isinstance(q, ir.Op) and q.fn == "mod" and q.args[1] == dh and isinstance(q.args[0], Var) \
                        and self.defs.get(q.args[0].name) == quot:
                    merged = ir.add(ir.imod(r.args[0], ir.mul(dh, dl)), lane)
            if merged is None:
                k += 1
                continue
            coords[k:k + 2] = [(merged, ir.mul(dh, dl))]
            k = max(k - 1, 0)  # the merged coordinate may pair with the one before it
        return coords

    def unravel(self, lin: Expr, shape: tuple[Dim, ...]) -> tuple[Expr, ...]:
        split = self._lane_split(lin) if shape and isinstance(shape[-1], int) and shape[-1] % self.vec == 0 \
            else None
        if split is not None:  # a lane's index is its vector's, plus the lane on the innermost axis
            base, j = split
            out = self.unravel_plain(base, shape)
            return out[:-1] + (self.bind(ir.add(out[-1], ir.i64(j)), "i"),) if j else out
        return self.unravel_plain(lin, shape)

    def unravel_plain(self, lin: Expr, shape: tuple[Dim, ...]) -> tuple[Expr, ...]:
        out: list[Expr] = []
        for k, d in enumerate(reversed(shape)):
            if d == 1:
                out.append(ir.i64(0))
            elif k == len(shape) - 1:
                out.append(lin)
            else:
                de = self.dim(d)  # bound once: the lanes of a vector share their vector's index (unravel)
                out.append(self.bind_once(ir.imod(lin, de), "i"))
                lin = self.bind_once(ir.idiv(lin, de), "i")
        return tuple(reversed(out))

    def view_index(self, idx: tuple[Expr, ...], offset: Expr, shape: tuple[Dim, ...]) -> tuple[Expr, ...]:
        """The index, in an output view of `shape`, of the space's element at `idx` (linear `offset`)."""
        at = self.unravel(offset, shape)
        self.linear_of[(at, tuple(shape))] = offset
        self.index_at[(offset, tuple(self.r.space))] = tuple(idx)
        return at

    @staticmethod
    def broadcast(idx: tuple[Expr, ...], shape: tuple[Dim, ...]) -> tuple[Expr, ...]:
        lead = len(idx) - len(shape)
        if lead < 0:
            raise LoweringError("input of higher rank than the output")
        return tuple(ir.i64(0) if d == 1 else idx[lead + k] for k, d in enumerate(shape))

    def reshape_index(self, idx: tuple[Expr, ...], out: tuple[Dim, ...], inp: tuple[Dim, ...]) -> tuple[Expr, ...]:
        """Index into a Reshape/Squeeze/Unsqueeze/Flatten input: size-1 dims dropped, common leading
        and trailing dims passed through, the middle re-linearized."""
        lin = self.linear_of.get((tuple(idx), tuple(out)))
        if lin is not None:  # an output view's index: the input's element at the same offset
            at = self.index_at.get((lin, tuple(inp)))
            if at is None:  # a view of a view: followed further by its offset
                at = self.unravel(lin, inp)
                self.linear_of[(at, tuple(inp))] = lin
            return at
        keep_o = [k for k, d in enumerate(out) if d != 1]
        keep_i = [k for k, d in enumerate(inp) if d != 1]
        od, idim = [out[k] for k in keep_o], [inp[k] for k in keep_i]
        oi = [idx[k] for k in keep_o]
        p = 0
        while p < min(len(od), len(idim)) and od[p] == idim[p]:
            p += 1
        s = 0
        while s < min(len(od), len(idim)) - p and od[-1 - s] == idim[-1 - s]:
            s += 1
        mid_o, mid_i = od[p:len(od) - s], idim[p:len(idim) - s]
        mid = self.unravel(self.linearize(tuple(oi[p:len(oi) - s]), tuple(mid_o)), tuple(mid_i)) if mid_i else ()
        coords = oi[:p] + list(mid) + oi[len(oi) - s:]
        full = [ir.i64(0)] * len(inp)
        for k, c in zip(keep_i, coords):
            full[k] = c
        return tuple(full)

    # ------------------------------------------------------------------ values
    def value(self, t: str, idx: tuple[Expr, ...]) -> Expr:
        key = (t, idx) if self.guard is None else (t, idx, self.guard)  # a guarded value is 0 off its guard
        hit = self.lookup(key)
        if hit is not None:
            return hit
        const = self.g.constants.get(t)
        if t not in self.producer and const is not None and const.size == 1:
            return self.remember(key, self.literal(const, t))
        if t in self.producer:
            node = self.producer[t]
            e = self.node_value(node, list(node.output).index(t), idx)
        else:
            e = self.load(t, idx)
        return self.remember(key, self.bind(e))

    def literal(self, arr: np.ndarray, t: str) -> ir.Const:
        st = ir.compute_type(_storage(self.g.tensors[t].dtype, f"constant '{t}'"))
        v = arr.reshape(-1)[0].item()
        return ir.Const(bool(v) if st == "bool" else float(v) if st == F32 else int(v), st)

    def load(self, t: str, idx: tuple[Expr, ...]) -> Expr:
        if t not in self.args:
            raise LoweringError(f"'{t}' is read but is not a region input")
        shape = self._shape(t)
        perm = self.permuted.get(t)
        if perm is not None:  # the kernel is given Transpose(t, perm)
            shape, idx = tuple(shape[p] for p in perm), tuple(idx[p] for p in perm)
        storage = _storage(self.g.tensors[t].dtype, f"input '{t}'")
        guard = self.guard
        vector = self.vec > 1 and idx and idx[-1] in self.lanes and shape[-1] == self.inner_dim
        if guard is not None and not (vector and not self._reads_any(guard, self.lanes)):
            # read only where the guard holds (the C ternary evaluates one branch); a guard that differs
            # between the lanes of a vector (a Concat along the innermost axis) reads lane by lane
            load = ir.Load(self.args[t], self.linearize(idx, shape), storage)
            return ir.Op("select", (guard, load, ir.const(False if load.ctype == BOOL else 0, load.ctype)),
                         load.ctype)
        if not vector and guard is None and self.vec > 1:
            lv = self._lane_vector(t, idx, shape, storage)
            if lv is not None:
                return lv
        if vector:
            lane = self.lanes.index(idx[-1])
            base = idx[:-1] + (self.lanes[0],)
            key = ("vec", t, base) if guard is None else ("vec", t, base, guard)
            name = self.lookup(key)
            if name is None:
                off = self.linearize(base, shape)
                nm = self.fresh("x")
                scope = self._scope_for(off, *((guard,) if guard is not None else ()))
                scope.stmts.append(ir.VecLoad(nm, self.args[t], off, self.vec, storage, guard))
                scope.names.add(nm)
                name = Var(nm, storage)
                scope.memo[key] = name
            return ir.Lane(name.name, lane, storage)
        return ir.Load(self.args[t], self.linearize(idx, shape), storage)

    def set_lanes(self, first: Expr, aligned: bool) -> None:
        """The lanes first + 0 .. VEC - 1; `aligned`: `first` is a multiple of VEC (the loops that make it)."""
        self.lanes = tuple(ir.add(first, ir.i64(l)) for l in range(self.vec))
        self.lane_base, self.lane_vec = (first if aligned else None), self.vec

    def _lane_vector(self, t: str, idx: tuple[Expr, ...], shape: tuple[Dim, ...], storage: str) -> Optional[Expr]:
        """A lane's element of `t` read out of the one aligned VEC-vector that holds it, where its offset is the
        lanes' (aligned) first column plus multiples of VEC plus a constant: a row read through a view of
        another shape (a GroupNorm's group, a Reshape's input), whose index is not the lanes' own. The vector
        lies inside `t` since its innermost size is a multiple of VEC. None where that does not hold."""
        split = self._lane_split(self.linearize(idx, shape)) if shape and isinstance(shape[-1], int) and \
            shape[-1] % self.vec == 0 else None
        if split is None:
            return None
        base, j = split
        key = ("lanevec", t, base)
        name = self.lookup(key)
        if name is None:
            nm = self.fresh("x")
            scope = self._scope_for(base)
            scope.stmts.append(ir.VecLoad(nm, self.args[t], base, self.vec, storage, None))
            scope.names.add(nm)
            name = Var(nm, storage)
            scope.memo[key] = name
        return ir.Lane(name.name, j, storage)

    def _lane_split(self, off: Expr) -> Optional[tuple[Expr, int]]:
        """(v, j) with `off` = v + j, 0 <= j < VEC and v a multiple of VEC, where `off` is the aligned lanes'
        first column plus multiples of VEC (not reading it) plus a constant; else None."""
        first = self.lane_base
        if first is None or self.vec == 1 or self.lane_vec % self.vec:
            return None
        terms: list[Expr] = []

        def flatten(e: Expr, depth: int = 4) -> None:  # through bound sums (a lane's column after its vector's),
            # not through the lanes' first column itself (an unrolled row loop's later columns: `row_loop`)
            if depth and isinstance(e, Var) and e != first and isinstance(self.defs.get(e.name), ir.Op) and \
                    self.defs[e.name].fn == "add":
                flatten(self.defs[e.name], depth - 1)
            elif isinstance(e, ir.Op) and e.fn == "add" and e.ctype == I64:
                flatten(e.args[0], depth)
                flatten(e.args[1], depth)
            else:
                terms.append(e)
        flatten(off)
        const = sum(int(e.value) for e in terms if isinstance(e, ir.Const))
        rest = [e for e in terms if not isinstance(e, ir.Const)]
        if isinstance(first, ir.Const):  # one vector a row (the innermost size is VEC): lanes 0 .. VEC - 1
            if int(first.value) % self.vec:
                return None
            first = ir.i64(0)
        elif rest.count(first) == 1:
            rest.remove(first)
        else:  # the first column bound as x + K, which `linearize` split apart (an unrolled copy's first lane)
            d = self.defs.get(first.name) if isinstance(first, Var) else None
            if not (isinstance(d, ir.Op) and d.fn == "add" and isinstance(d.args[1], ir.Const) and
                    rest.count(d.args[0]) == 1):
                return None
            rest.remove(d.args[0])
            const -= int(d.args[1].value)
        # (a negative constant, a tap's or a crop's `x - k` split apart by `linearize`, is fine: the offset is
        # a valid one, so with j = const mod VEC the aligned base is too)
        if any((isinstance(first, Var) and first.name in ir.free_vars(e)) or not self._multiple_of(e, self.vec)
               for e in rest):
            return None
        base: Expr = first
        for e in rest:
            base = ir.add(base, e)
        return ir.add(base, ir.i64(const - const % self.vec)), const % self.vec

    def _multiple_of(self, e: Expr, k: int, depth: int = 8) -> bool:
        """Whether the index expression `e` is a multiple of `k` for every value of its variables (through the
        variables' bound definitions)."""
        if isinstance(e, ir.Const):
            return int(e.value) % k == 0
        if depth and isinstance(e, Var) and e.name in self.defs:
            return self._multiple_of(self.defs[e.name], k, depth - 1)
        if isinstance(e, ir.Op) and e.fn == "mul":
            return any(self._multiple_of(a, k, depth - 1) for a in e.args)
        if isinstance(e, ir.Op) and e.fn in ("add", "sub"):
            return all(self._multiple_of(a, k, depth - 1) for a in e.args)
        return False

    def guarded_value(self, t: str, idx: tuple[Expr, ...], cond: Expr) -> Expr:
        """`value(t, idx)` with every load made only where `cond` (and any guard already set) holds: an input
        that may be empty at run time is never touched outside it."""
        outer = self.guard
        self.guard = self.bind_once(cond if outer is None else ir.Op("and", (outer, cond), BOOL), "inb")
        try:
            return self.value(t, idx)
        finally:
            self.guard = outer

    def _reads_any(self, e: Expr, of: tuple[Expr, ...]) -> bool:
        """Whether `e` depends on a variable of the expressions `of`, through the variables bound since."""
        targets = frozenset().union(*(ir.free_vars(x) for x in of))
        seen: set[str] = set()
        todo = list(ir.free_vars(e))
        while todo:
            v = todo.pop()
            if v in targets:
                return True
            if v not in seen:
                seen.add(v)
                if v in self.defs:
                    todo.extend(ir.free_vars(self.defs[v]))
        return False

    def node_value(self, node: onnx.NodeProto, pos: int, idx: tuple[Expr, ...]) -> Expr:
        op = node.op_type
        if op == "Conv":
            return self.depthwise_value(node, idx)
        if op in ops.WINDOW:
            return self.pool_value(node, idx)
        if op == "Range":  # an iota: start + i * delta (legal.range_length_verdict checked the length)
            start, delta = (iota.const_int(self.g, x) for x in (node.input[0], node.input[2]))
            ct = ir.compute_type(_storage(self.g.tensors[node.output[0]].dtype, "Range output"))
            v = ir.add(ir.i64(start), ir.mul(idx[0], ir.i64(delta)))
            return v if ct == I64 else ir.Op("cast", (v,), ct)
        if op == "Gather":
            return self.gather_value(node, idx)
        if op == "Concat":
            return self.concat_value(node, idx)
        if op == "Slice":  # the start plus the coordinate times the step (legal.slice_verdict)
            return self.value(node.input[0], slice_index(self.g, node, idx))
        if op == "Resize":
            return self.resize_value(node, idx)
        if op == "Pad":
            return self.pad_value(node, idx)
        out_shape = self._shape(node.output[pos])
        if op in ops.LAYOUT:
            src = node.input[0]
            in_shape = self._shape(src)
            if op == "Transpose":
                perm = scalar.transpose_perm(node, len(in_shape))
                inv = [ir.i64(0)] * len(perm)
                for j, p in enumerate(perm):
                    inv[p] = idx[j]
                return self.value(src, tuple(inv))
            if op == "Expand":
                return self.value(src, self.broadcast(idx, in_shape))
            return self.value(src, self.reshape_index(idx, out_shape, in_shape))
        if op in ops.REDUCTIONS:
            return self.reduction_value(node, idx)
        args: list[Optional[Expr]] = []
        for k, x in enumerate(node.input):
            at = self.per_axis_index(node, idx) if op in scalar.QUANTIZERS and k > 0 else None
            args.append(self.value(x, at or self.broadcast(idx, self._shape(x))) if x else None)
        if scalar.sees_stored(node):
            args = [self.as_stored(x, a) if a is not None else None for x, a in zip(node.input, args)]
        out_storage = _storage(self.g.tensors[node.output[pos]].dtype, f"output of {node.op_type}")
        quantized = node.output[pos] in self.quantized_cone
        discrete = quantized or node.output[pos] in self.discrete_cone
        if op == "Div" and (discrete or any(scalar.sees_stored(self.g.nodes[c])
                                            for c in self.g.consumers.get(node.output[0], ()))):
            # a step op (or a Cast) downstream would see the ulp a reciprocal may move: IEEE division
            value = scalar.exact_div(args[0], args[1])
        else:
            try:
                value = scalar.apply(node, args, out_storage)
            except scalar.UnsupportedOp as e:
                raise LoweringError(str(e)) from None
            if quantized:  # each sum and product rounded once, as ORT's (no FMA)
                value = scalar.uncontracted(value)
        # and, in half precision, every rounding the CUDA EP does op by op; a dequantized value always, as ORT
        # stores it (exact: a QuantizeLinear after the region may read it)
        rounded = discrete or op == "DequantizeLinear"
        return scalar.round_to(out_storage, value) if rounded and out_storage in ("f16", "bf16") else value

    def per_axis_index(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> Optional[tuple[Expr, ...]]:
        """A (De)QuantizeLinear's scale and zero point, one per element of its `axis`, read at that axis's coordinate
        (not as ONNX broadcasting would align them, with the innermost axis); None for one scale for the tensor."""
        scale = self._shape(node.input[1])
        if len(scale) != 1 or scale[0] == 1:
            return None
        return (idx[scalar.attr(node, "axis", 1) % len(idx)],)

    @functools.cached_property
    def quantized_cone(self) -> frozenset[str]:
        """Tensors of the region a QuantizeLinear reads through element-wise ops (`legal.exact_verdict`: only
        ops a kernel computes as ORT's do): part of the discrete cone, and with no FMA contraction either. A
        quantizer outside the region counts too where it reads one of the region's outputs through any ops
        (another kernel's exact ones, `legal.inexact_before_quantizers`, or ORT's): a product this kernel
        contracted into an FMA, or a division it made a reciprocal's product, would reach it an ulp off, and
        the quantized value a step off."""
        seeds = [n for n in (self.g.nodes[i] for i in self.r.nodes) if n.op_type == "QuantizeLinear"]
        readers = legal.quantizer_readers(self.g)  # (the nodes whose values a quantizer reads, through any ops)
        read = [t for t in self.r.outputs if self.g.producer.get(t) in readers]
        return self._cone_of(seeds, ("elementwise", "layout", "indexing", "window"), read)

    @functools.cached_property
    def discrete_cone(self) -> frozenset[str]:
        """Tensors of the region that a step op (Floor, a comparison, ...) or a Cast to an integer or bool
        reads through element-wise ops, where an ulp anywhere may move a discrete result (T5's relative
        position buckets: Div, Log, Div, Mul, then a Cast to int64): their Divs are IEEE divisions, as ORT's,
        and half-precision ones are rounded to their storage type op by op, as the CUDA EP stores them (ORT's
        CPU EP computes such a chain in fp32: `ortfuse check` judges a discrete difference against both)."""
        return self._cone_of([n for n in (self.g.nodes[i] for i in self.r.nodes) if n.op_type in scalar.STEP_OPS or (
            n.op_type == "Cast" and scalar.STORAGE.get(scalar.attr(n, "to")) not in scalar.FLOAT_STORAGE)])

    def _cone_of(self, seeds: list[onnx.NodeProto], kinds: tuple[str, ...] = ("elementwise", "layout"),
                 tensors: tuple[str, ...] | list[str] = ()) -> frozenset[str]:
        """Tensors of the region that `seeds` (and the region's own `tensors`) read through ops of `kinds`
        (`ops.kind_of`)."""
        cone: set[str] = set()
        stack = [x for n in seeds for x in n.input if x] + list(tensors)
        while stack:
            t = stack.pop()
            node = self.producer.get(t)
            if t in cone or node is None or ops.kind_of(node.op_type) not in kinds:
                continue
            cone.add(t)
            stack.extend(x for _, x in ops.data_inputs(node))
        return frozenset(cone)

    def gather_value(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> Expr:
        """Gather at idx: the index j read from `indices` at idx's axis..axis+q coordinates (negative j counts
        from the end), then `data` at j on `axis`. An index still out of range gives 0, as ORT's CUDA kernel
        does (its CPU kernel raises); the load itself then reads element 0, never out of bounds."""
        data, indices = node.input[0], node.input[1]
        ds, q = self._shape(data), len(self._shape(indices))
        axis = scalar.attr(node, "axis", 0) % len(ds)
        j = self.value(indices, tuple(idx[axis:axis + q]))
        if j.ctype != I64:
            j = ir.Op("cast", (j,), I64)
        n = self.dim(ds[axis])
        j = self.bind(ir.Op("select", (ir.Op("lt", (j, ir.i64(0)), BOOL), ir.add(j, n), j), I64), "g")
        inside = self.bind(ir.Op("and", (ir.Op("ge", (j, ir.i64(0)), BOOL), ir.Op("lt", (j, n), BOOL)), BOOL), "inb")
        at = self.bind(ir.Op("select", (inside, j, ir.i64(0)), I64), "i")
        v = self.value(data, tuple(idx[:axis]) + (at,) + tuple(idx[axis + q:]))
        zero = ir.Const(False if v.ctype == BOOL else 0.0 if v.ctype == F32 else 0, v.ctype)
        return ir.Op("select", (inside, v, zero), v.ctype)

    def resize_value(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> Expr:
        """Resize at idx, as ORT's CPU Upsample computes it (fp32): each resized axis maps its coordinate to
        the input's (`_original`); nearest reads the pixel its nearest_mode picks, clamped into the input;
        linear (H and W) clamps the coordinate into the input and blends the pixels on either side by
        their distances, dx2*dy2*X11 + dx1*dy2*X21 + dx2*dy1*X12 + dx1*dy1*X22 in ORT's order (both sides
        0.5 where they are one pixel, at the border)."""
        geo = resize.geometry(self.g, node)
        if isinstance(geo, str):
            raise LoweringError(f"Resize '{node.name}': {geo}")
        x = node.input[0]
        f32 = lambda v: ir.Const(float(v), F32)  # noqa: E731
        coord = list(idx)
        picks: dict[int, tuple[Expr, Expr, Expr, Expr]] = {}  # axis -> (i1, i2, d1, d2)
        for a in geo.axes:
            n_in, n_out = self.dim(geo.in_shape[a]), self.dim(geo.out_shape[a])
            last = self.bind(ir.add(n_in, ir.i64(-1)), "i")
            xo = self.bind(self._original(geo, a, idx[a], n_in, n_out), "rc")
            if geo.mode == "nearest":
                f = self.bind(ir.Op("floor", (xo,), F32), "rc")
                frac = ir.Op("sub", (xo, f), F32)
                up = {"floor": None, "ceil": ir.Op("gt", (frac, f32(0.0)), BOOL),
                      "round_prefer_ceil": ir.Op("ge", (frac, f32(0.5)), BOOL),
                      "round_prefer_floor": ir.Op("gt", (frac, f32(0.5)), BOOL)}[geo.nearest]
                i = ir.Op("cast", (f,), I64)
                if up is not None:
                    i = ir.Op("select", (up, ir.add(i, ir.i64(1)), i), I64)
                i = ir.Op("min", (ir.Op("max", (i, ir.i64(0)), I64), last), I64)
                coord[a] = self.bind(i, "i")
                continue
            xo = self.bind(ir.Op("fmax", (f32(0.0), ir.Op("fmin", (xo, ir.Op("cast", (last,), F32)), F32)), F32), "rc")
            i1 = self.bind(ir.Op("min", (ir.Op("cast", (xo,), I64), last), I64), "i")
            i2 = self.bind(ir.Op("min", (ir.add(i1, ir.i64(1)), last), I64), "i")
            same = ir.Op("eq", (i1, i2), BOOL)
            d1 = ir.Op("abs", (ir.Op("sub", (xo, ir.Op("cast", (i1,), F32)), F32),), F32)
            d2 = ir.Op("abs", (ir.Op("sub", (xo, ir.Op("cast", (i2,), F32)), F32),), F32)
            picks[a] = (i1, i2, self.bind(ir.Op("select", (same, f32(0.5), d1), F32), "rc"),
                        self.bind(ir.Op("select", (same, f32(0.5), d2), F32), "rc"))
        if geo.mode == "nearest":
            return self.value(x, tuple(coord))
        # ORT's bilinear: y (H) and x (W); an axis not resized reads its own coordinate with weights 1 and 0
        one = (coord[2], coord[2], f32(0.0), f32(1.0))
        y1, y2, dy1, dy2 = picks.get(2, one)
        x1, x2, dx1, dx2 = picks.get(3, (coord[3], coord[3], f32(0.0), f32(1.0)))
        at = lambda yy, xx: self.value(x, (coord[0], coord[1], yy, xx))  # noqa: E731
        terms = [(dx2, dy2, at(y1, x1)), (dx1, dy2, at(y1, x2)), (dx2, dy1, at(y2, x1)), (dx1, dy1, at(y2, x2))]
        out: Optional[Expr] = None
        for wx, wy, v in terms:
            t = ir.Op("mul", (ir.Op("mul", (wx, wy), F32), v), F32)
            out = t if out is None else ir.Op("add", (out, t), F32)
        assert out is not None
        return out

    def pad_value(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> Expr:
        """Pad at idx: the input at the coordinate less each leading pad; outside the input the fill (constant
        mode: the load clamped in bounds, the value selected away), the nearest edge (edge), or the mirror
        image about the edge pixel (reflect, pads narrower than the axis)."""
        geo = pad.geometry(self.g, node)
        if isinstance(geo, str):
            raise LoweringError(f"Pad '{node.name}': {geo}")
        # a padded axis of run-time size may be empty (ORT may then give a null buffer): the input is read only
        # inside it; edge and reflect modes have nothing to read there, so they stay with ORT
        runtime = any(isinstance(geo.in_shape[a], str) for a, (b, e) in enumerate(zip(geo.begins, geo.ends)) if b or e)
        if runtime and geo.mode != "constant":
            raise LoweringError(f"Pad '{node.name}': {geo.mode} padding along an axis of run-time size (it may be empty)")
        coord, inside = list(idx), []
        for a, (b, e) in enumerate(zip(geo.begins, geo.ends)):
            if not b and not e:
                continue
            n = self.dim(geo.in_shape[a])
            last = ir.add(n, ir.i64(-1))
            c = self.bind(ir.add(idx[a], ir.i64(-b)), "i") if b else idx[a]
            lo, hi = ir.Op("lt", (c, ir.i64(0)), BOOL), ir.Op("gt", (c, last), BOOL)
            if geo.mode == "reflect":  # one mirror: |c| below, 2(n - 1) - c above
                c = ir.Op("select", (lo, ir.mul(c, ir.i64(-1)), c), I64)
                c = ir.Op("select", (hi, ir.add(ir.mul(last, ir.i64(2)), ir.mul(c, ir.i64(-1))), c), I64)
            else:
                if geo.mode == "constant":
                    inside.append(ir.Op("not", (ir.Op("or", (lo, hi), BOOL),), BOOL))
                c = ir.Op("min", (ir.Op("max", (c, ir.i64(0)), I64), last), I64)
            coord[a] = self.bind(c, "i")
        if not inside:
            return self.value(node.input[0], tuple(coord))
        ok: Expr = inside[0]
        for more in inside[1:]:
            ok = ir.Op("and", (ok, more), BOOL)
        if runtime:  # read under the guard that the coordinate is inside
            ok = self.bind_once(ok, "inb")
            v = self.guarded_value(node.input[0], tuple(coord), ok)
        else:
            v = self.value(node.input[0], tuple(coord))
            ok = self.bind(ok, "inb")
        fill = ir.Const(bool(geo.value) if v.ctype == BOOL else geo.value if v.ctype == F32 else int(geo.value),
                        v.ctype)
        return ir.Op("select", (ok, v, fill), v.ctype)

    def _original(self, geo, a: int, c: Expr, n_in: Expr, n_out: Expr) -> Expr:
        """The input coordinate (fp32) of output coordinate `c` on axis `a`, in ORT's float arithmetic."""
        f32 = lambda v: ir.Const(float(v), F32)  # noqa: E731
        xr = ir.Op("cast", (c,), F32)
        scale = f32(geo.scales[a]) if geo.scales[a] is not None else \
            ir.Op("div", (ir.Op("cast", (n_out,), F32), ir.Op("cast", (n_in,), F32)), F32)
        if geo.coordinates == "asymmetric":
            return ir.Op("div", (xr, scale), F32)
        if geo.coordinates == "align_corners":
            num = ir.Op("mul", (xr, ir.Op("cast", (ir.add(n_in, ir.i64(-1)),), F32)), F32)
            v = ir.Op("div", (num, ir.Op("cast", (ir.add(n_out, ir.i64(-1)),), F32)), F32)
            return ir.Op("select", (ir.Op("eq", (n_out, ir.i64(1)), BOOL), f32(0.0), v), F32)
        v = ir.Op("sub", (ir.Op("div", (ir.Op("add", (xr, f32(0.5)), F32), scale), F32), f32(0.5)), F32)
        if geo.coordinates == "pytorch_half_pixel":
            return ir.Op("select", (ir.Op("gt", (n_out, ir.i64(1)), BOOL), v, f32(0.0)), F32)
        return v

    def concat_value(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> Expr:
        """Concat at idx: the input whose span along the axis holds idx's coordinate there. Every input is
        read (at a coordinate clamped into its span, so in bounds) and the value selected: a handful of
        inputs at most (`ops.MAX_CONCAT_INPUTS`). Spans known only at run time (a KV cache's past, which is
        empty at the first step) may be empty: each input is then read under the guard that the coordinate
        is in its span, so an empty one is never touched."""
        ins = [x for x in node.input if x]
        rank = len(idx)
        axis = scalar.attr(node, "axis", 0) % rank
        runtime = any(isinstance(self._shape(x)[axis], str) for x in ins)
        c, start = idx[axis], ir.i64(0)
        picks: list[tuple[Optional[Expr], Expr]] = []
        for k, x in enumerate(ins):
            n = self.dim(self._shape(x)[axis])
            end = ir.add(start, n)
            local = self.bind_once(ir.add(c, ir.mul(start, ir.i64(-1))), "i") if start != ir.i64(0) else c
            if k < len(ins) - 1:  # clamp into [0, n - 1]; the last input is reached only past the others
                local = self.bind_once(ir.Op("select", (ir.Op("lt", (local, n), BOOL), local,
                                                   ir.add(n, ir.i64(-1))), I64), "i")
            if k:
                local = self.bind_once(ir.Op("select", (ir.Op("lt", (local, ir.i64(0)), BOOL), ir.i64(0), local), I64),
                                       "i")
            before = self.bind_once(ir.Op("lt", (c, end), BOOL), "inb") if k < len(ins) - 1 else None
            at = tuple(idx[:axis]) + (local,) + tuple(idx[axis + 1:])
            if runtime:  # c in [start, end): past the inputs before this one and before its end
                after = ir.Op("ge", (c, start), BOOL) if k else None
                cond = before if after is None else after if before is None else ir.Op("and", (before, after), BOOL)
                v = self.guarded_value(x, at, cond)
            else:
                v = self.value(x, at)
            picks.append((before, v))
            start = end
        out = picks[-1][1]
        for cond, v in reversed(picks[:-1]):
            out = ir.Op("select", (cond, v, out), v.ctype)
        return out

    def as_stored(self, tensor: str, value: Expr) -> Expr:
        """`value` rounded to `tensor`'s half-precision storage type, as ORT would have stored it (see
        `scalar.sees_stored`); a no-op for other types and for values that are loads already."""
        storage = _storage(self.g.tensors[tensor].dtype, f"input {tensor}")
        if storage not in ("f16", "bf16") or isinstance(value, (ir.Load, ir.Lane, ir.Const)):
            return value  # loads and constants are exact in their storage type already
        return scalar.round_to(storage, value)

    def depthwise_value(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> Expr:
        """A depthwise Conv at (b, c, oh, ow): input x weight over the KH x KW window of channel c, from the
        bias; taps in the zero padding contribute nothing. Windows of at most WINDOW_UNROLL taps are
        straight-line (every tap's offsets constants), each image read made only inside the image (a guarded
        load, zero outside); larger ones loop, reading an in-bounds element and selecting zero.

        Where c is one of a vector's lanes (a kernel walking the image channels-last), every lane's window is
        computed together: each tap's position and bounds once, its image read once for all lanes (one vector
        load where the image is channels-last in memory), and the weight read as a [1, KH, KW, C] constant
        (`input_perms`) so that the lanes' weights are one vector too. The other lanes' values are remembered
        for their own walks."""
        geo = conv.conv_geometry(self.g, node)
        if isinstance(geo, str) or not geo.depthwise:
            raise LoweringError(f"{node.op_type} '{node.name}': only depthwise convolutions join memory-bound kernels")
        x, w = node.input[0], node.input[1]
        b, c, oh, ow = idx
        lanes = self.lanes if self.guard is None and self.vec > 1 and c in self.lanes else (c,)
        if w not in self.laid_out:  # decided at its first read, for every read (only this Conv reads it)
            self.laid_out.add(w)
            if len(lanes) > 1 and w in self.args and w in self.g.constants \
                    and set(self.g.consumers.get(w, ())) == {self.g.producer[node.output[0]]}:
                self.permuted[w] = (1, 2, 3, 0)
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        accs = [Var(self.fresh("win"), F32) for _ in lanes]
        for acc, lane in zip(accs, lanes):
            self.emit(ir.Decl(acc, self.value(bias, (lane,)) if bias else ir.Const(0.0, F32)))
            self.define(acc.name)
        dims = (self.dim(geo.h), self.dim(geo.w))

        def position(k: Expr, axis: int) -> Expr:
            o = (oh, ow)[axis]
            return ir.add(ir.mul(o, ir.i64(geo.stride[axis])),
                          ir.add(ir.mul(k, ir.i64(geo.dilation[axis])), ir.i64(-geo.pad[axis])))

        def within(e: Expr, axis: int) -> Expr:
            return ir.Op("and", (ir.Op("ge", (e, ir.i64(0)), BOOL), ir.Op("lt", (e, dims[axis]), BOOL)), BOOL)

        def operands(kh: Expr, kw: Expr, at: tuple[Expr, ...], inside: Optional[Expr], guarded: bool,
                     lanes_: tuple[Expr, ...]) -> list[tuple[Expr, Expr]]:
            """(image, weight) of tap (kh, kw) for each of `lanes_` at image position `at`; `inside`: whether
            it is in the image, the image read under it where `guarded` (zero outside), else read at `at`
            (clamped in) and selected away."""
            out = []
            for lane in lanes_:
                self.floor, outer = len(self.scopes) - 1, self.floor  # reloaded per pixel from L1, not held
                try:
                    wv = self.value(w, (lane, ir.i64(0), kh, kw))
                finally:
                    self.floor = outer
                if inside is None:
                    xv = self.value(x, (b, lane) + at)
                elif guarded:  # a guarded load is zero outside; a value computed from one need not be
                    xv = self.guarded_value(x, (b, lane) + at, inside)
                    if not isinstance(self.defs.get(xv.name) if isinstance(xv, Var) else xv, (ir.Lane, ir.Load)):
                        xv = ir.Op("select", (inside, xv, ir.Const(0.0, F32)), F32)
                else:
                    xv = ir.Op("select", (inside, self.value(x, (b, lane) + at), ir.Const(0.0, F32)), F32)
                out.append((xv, wv))
            return out

        def accumulate(kh: Expr, kw: Expr, at: tuple[Expr, ...], inside: Optional[Expr], guarded: bool) -> None:
            for acc, (xv, wv) in zip(accs, operands(kh, kw, at, inside, guarded, lanes)):
                self.emit(ir.Assign(acc, ir.Op("fma", (xv, wv, acc), F32)))

        if geo.kh * geo.kw <= hw.WINDOW_UNROLL:
            rows = [self.bind_once(position(ir.i64(k), 0), "i") for k in range(geo.kh)]
            cols = [self.bind_once(position(ir.i64(k), 1), "i") for k in range(geo.kw)]
            row_in = [self.bind_once(within(e, 0), "inb") if geo.padded else None for e in rows]
            col_in = [self.bind_once(within(e, 1), "inb") if geo.padded else None for e in cols]
            for kh in range(geo.kh):
                taps = []
                for kw in range(geo.kw):
                    conds = [e for e in (row_in[kh], col_in[kw]) if e is not None]
                    inside = None if not conds else conds[0] if len(conds) == 1 else \
                        self.bind_once(ir.Op("and", tuple(conds), BOOL), "inb")
                    taps.append((ir.i64(kh), ir.i64(kw), (rows[kh], cols[kw]), inside))
                # a kernel row's reads first (the first lane's value makes a vector's load), then its math, at
                # most WINDOW_READ_AHEAD taps at a time (a 1x63 row read at once spilled): ptxas issues them
                # together, where tap by tap each waited for its load (a memory latency per tap, which binds
                # a warp alone on its SM: ConvNeXt's later stages at batch 1)
                for batch in _even_chunks(taps, hw.WINDOW_READ_AHEAD):
                    for tap in batch:
                        operands(*tap, guarded=True, lanes_=lanes[:1])
                    for tap in batch:
                        accumulate(*tap, guarded=True)
        else:
            def tap(t: Var) -> None:
                kh, kw = self.unravel(t, (geo.kh, geo.kw))
                coords = tuple(self.bind(position(k, a), "i") for a, k in enumerate((kh, kw)))
                at = coords
                inside: Optional[Expr] = None
                if geo.padded:
                    inside = self.bind(ir.Op("and", tuple(within(e, a) for a, e in enumerate(coords)), BOOL), "inb")
                    at = tuple(self.bind(ir.Op("select", (inside, e, ir.i64(0)), I64), "i") for e in coords)
                accumulate(kh, kw, at, inside, guarded=False)

            self.loop(self.fresh("tap"), ir.i64(0), ir.i64(geo.kh * geo.kw), ir.i64(1), tap)
        out = node.output[0]
        mine: Optional[Var] = None
        for acc, lane in zip(accs, lanes):
            result = Var(self.fresh("dw"), F32)
            self.emit(ir.Let(result, acc))
            self.define(result.name)
            if lane == c:
                mine = result
            else:  # the walk of that lane's value finds it
                self.remember((out, (b, lane, oh, ow)), result)
        assert mine is not None
        return mine

    def pool_value(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> Expr:
        """A pool at (b, c, oh, ow), as ORT's CPU pools compute it: the taps of the window row by row, max over
        those inside the image (MaxPool), or their sum divided by how many are inside (AveragePool,
        count_include_pad=0) or by the window's size (=1)."""
        geo = pool.geometry(self.g, node)
        if isinstance(geo, str):
            raise LoweringError(f"{node.op_type} '{node.name}': {geo}")
        x = node.input[0]
        b, c, oh, ow = idx
        acc = Var(self.fresh("win"), F32)
        self.emit(ir.Decl(acc, ir.Const(float("-inf") if geo.kind == "max" else 0.0, F32)))
        self.define(acc.name)
        count = Var(self.fresh("n"), F32) if geo.kind == "avg" and not geo.include_pad else None
        if count is not None:
            self.emit(ir.Decl(count, ir.Const(0.0, F32)))
            self.define(count.name)

        def tap(t: Var) -> None:
            kh, kw = self.unravel(t, geo.kernel)
            coords = tuple(self.bind(ir.add(ir.mul(o, ir.i64(s)), ir.add(ir.mul(k, ir.i64(d)), ir.i64(-p))), "i")
                           for o, k, s, d, p in zip((oh, ow), (kh, kw), geo.stride, geo.dilation, geo.pad))
            inside = self.bind(ir.Op("and", tuple(
                ir.Op("and", (ir.Op("ge", (e, ir.i64(0)), BOOL), ir.Op("lt", (e, n), BOOL)), BOOL)
                for e, n in zip(coords, (self.dim(geo.h), self.dim(geo.w)))), BOOL), "inb")
            at = tuple(self.bind(ir.Op("select", (inside, e, ir.i64(0)), I64), "i") for e in coords)
            v = self.value(x, (b, c) + at)
            if geo.kind == "max":
                self.emit(ir.Assign(acc, ir.Op("select", (inside, ir.Op("fmax", (acc, v), F32), acc), F32)))
            else:
                self.emit(ir.Assign(acc, ir.Op("add", (acc, ir.Op("select", (inside, v, ir.Const(0.0, F32)), F32)),
                                               F32)))
                if count is not None:
                    self.emit(ir.Assign(count, ir.Op("add", (count, ir.Op("select", (
                        inside, ir.Const(1.0, F32), ir.Const(0.0, F32)), F32)), F32)))

        self.loop(self.fresh("tap"), ir.i64(0), ir.i64(geo.kernel[0] * geo.kernel[1]), ir.i64(1), tap)
        if geo.kind == "avg":
            div = count if count is not None else ir.Const(float(geo.kernel[0] * geo.kernel[1]), F32)
            out: Expr = scalar.exact_div(acc, div)
        else:
            out = acc
        result = Var(self.fresh("pool"), F32)
        self.emit(ir.Let(result, out))
        self.define(result.name)
        return result

    # ------------------------------------------------------------------ reductions
    def reduction_value(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> Expr:
        if self.row_idx is None:
            raise LoweringError(f"{node.op_type} needs a row-reduction kernel")
        x = node.input[0]
        xs = self._shape(x)
        if xs != tuple(self.r.space):
            raise LoweringError(f"{node.op_type} reduces a {xs} tensor, the region reduces {self.r.space}")
        out_rank = len(self._shape(node.output[0]))
        row = idx[:len(xs) - 1]
        if tuple(row) != self.row_idx or (out_rank == len(xs) and node.op_type.startswith("Reduce") and idx[-1] != ir.i64(0)):
            raise LoweringError(f"{node.op_type} result is consumed at another row (layout change after the reduction)")
        # a mean over a static count multiplies by its reciprocal (within an ulp of the quotient: no IEEE
        # division, whose slow-path branch per row kept an unrolled row loop's rows apart)
        count = xs[-1]
        mean_of = ((lambda s: ir.Op("mul", (s, ir.Const(1.0 / count, F32)), F32)) if isinstance(count, int) and count > 0
                   else (lambda s: ir.Op("div", (s, ir.Op("cast", (self.dim(count),), F32)), F32)))
        elem = lambda c: self.value(x, self.row_idx + (c,))  # noqa: E731
        op = node.op_type
        if op in ("ReduceSum", "ReduceMean"):
            s = self.row_reduce("sum", elem, (x, "sum"))
            return mean_of(s) if op == "ReduceMean" else s
        if op in ("ReduceSumSquare", "ReduceL2"):  # (one sum of squares serves both)
            s = self.row_reduce("sum", lambda c: self.bind(ir.Op("mul", (elem(c), elem(c)), F32)), (x, "ssq"))
            return s if op == "ReduceSumSquare" else ir.Op("sqrt", (s,), F32)
        if op == "ReduceL1":
            return self.row_reduce("sum", lambda c: self.bind(ir.Op("abs", (elem(c),), F32)), (x, "l1"))
        if op == "ReduceLogSum":
            return ir.Op("log", (self.row_reduce("sum", elem, (x, "sum")),), F32)
        if op in ("ReduceMax", "ReduceMin"):
            return self.row_reduce(op[6:].lower(), elem, (x, op[6:].lower()))
        if op == "ReduceLogSumExp":  # max + log(sum(exp(x - max))), as ORT computes it (no overflow)
            m = self.row_reduce("max", elem, (x, "max"))
            s = self.row_reduce("sum", lambda c: self.bind(ir.Op("exp", (ir.Op("sub", (elem(c), m), F32),), F32)),
                                (x, "sumexp"))
            # a row of -inf (every key masked) or with a +inf: the max itself, as ONNX and ORT give (x - max is NaN)
            lse = ir.Op("add", (m, ir.Op("log", (s,), F32)), F32)
            return ir.Op("select", (ir.Op("isinf", (m,), BOOL), m, lse), F32)
        if op in ("Softmax", "LogSoftmax"):
            m = self.row_reduce("max", elem, (x, "max"))
            shifted = lambda c: self.bind(ir.Op("sub", (elem(c), m), F32))  # noqa: E731
            s = self.row_reduce("sum", lambda c: self.bind(ir.Op("exp", (shifted(c),), F32)), (x, "sumexp"))
            if op == "Softmax":
                inv = self.bind(ir.Op("div", (ir.Const(1.0, F32), s), F32))
                return ir.Op("mul", (ir.Op("exp", (shifted(idx[-1]),), F32), inv), F32)
            return ir.Op("sub", (shifted(idx[-1]), self.bind(ir.Op("log", (s,), F32))), F32)
        # LayerNormalization (axis = -1) and InstanceNormalization ([N, C, L]): two passes, like ORT
        mean = self.bind(mean_of(self.row_reduce("sum", elem, (x, "sum"))))
        cent = lambda c: self.bind(ir.Op("sub", (elem(c), mean), F32))  # noqa: E731
        var = mean_of(self.row_reduce("sum", lambda c: self.bind(ir.Op("mul", (cent(c), cent(c)), F32)), (x, "var")))
        eps = float(scalar.attr(node, "epsilon", 1e-5))
        inv = self.bind(ir.Op("rsqrt", (ir.Op("add", (var, ir.Const(eps, F32)), F32),), F32))
        y: Expr = ir.Op("mul", (cent(idx[-1]), inv), F32)
        for k, fn in ((1, "mul"), (2, "add")):
            if len(node.input) > k and node.input[k]:
                w = node.input[k]  # LayerNorm's over the row, InstanceNorm's per channel
                at = (idx[1],) if op == "InstanceNormalization" else self.broadcast(idx, self._shape(w))
                y = ir.Op(fn, (y, self.value(w, at)), F32)
        return y

    def row_reduce(self, kind: str, elem: Callable[[Expr], Expr], key: object) -> Expr:
        memo_key = ("reduce", kind, key)
        hit = self.lookup(memo_key)
        if hit is not None:
            return hit
        xs = self.split_row
        at: Optional[int] = None  # generating a split row's phases: this reduction's phase
        if xs is not None and xs.phase is not None:
            if memo_key not in xs.order:
                raise LoweringError("a row reduction the cluster split did not see")
            at = xs.order.index(memo_key)
        saved_scopes, saved_lanes, saved_base = self.scopes, self.lanes, self.lane_base
        self.scopes = self.scopes[:self.row_depth]
        if at is not None and at > xs.phase:  # reduced in a later phase: nothing this phase stores uses it
            result = Var(self.fresh("r"), F32)
            self.emit(ir.Let(result, ir.Const(1.0, F32)))
        elif at is not None and at < xs.phase:  # every block's partial, combined in rank order
            assert self.row_c is not None
            result = Var(self.fresh("r"), F32)
            slot = ir.add(ir.i64(at * xs.bm), self.row_c)
            self.emit(ir.Let(result, ir.Op(f"xrow_{kind}", (slot, ir.i64(xs.rsplit), ir.i64(xs.bm)), F32)))
        else:
            acc = Var(self.fresh("acc"), F32)
            self.emit(ir.Decl(acc, ir.Const(_IDENTITY[kind], F32)))
            self.define(acc.name)
            c_dim = self.dim(self.r.space[-1]) if xs is None else xs.n1

            def body(cb: Var) -> None:
                self.set_lanes(cb, aligned=xs is None)
                for lane in self.lanes:
                    self.emit(ir.Assign(acc, ir.Op(_COMBINE[kind], (acc, elem(lane)), F32)))

            start = ir.mul(Var("rlane", I64), ir.i64(self.vec))
            if xs is not None:
                start = ir.add(xs.n0, start)
            groups = self.column_groups(start, c_dim)
            if groups is None:
                self.row_loop(self.fresh("c"), start, c_dim, ir.i64(self.tpr * self.vec), body,
                              unroll=self.row_unroll if xs is None else 0)
            for cs, valid in groups or ():
                self.set_lanes(cs, aligned=xs is None)
                for lane in self.lanes:
                    x = ir.Op("select", (valid, elem(lane), ir.Const(_IDENTITY[kind], F32)), F32)
                    self.emit(ir.Assign(acc, ir.Op(_COMBINE[kind], (acc, x), F32)))
            self.emit(ir.RowReduce(acc, kind, self.tpr))
            if xs is not None and at is not None:  # phase `at`: the block's partial into the row's slot
                assert self.row_c is not None and self.row_active is not None
                lead = ir.Op("and", (self.row_active, ir.Op("eq", (Var("rlane", I64), ir.i64(0)), BOOL)), BOOL)
                self.emit(ir.If(lead, (ir.RowPut(ir.add(ir.i64(at * xs.bm), self.row_c), acc),)))
                xs.reduced = True
            elif xs is not None:
                xs.order.append(memo_key)
            result = Var(self.fresh("r"), F32)
            self.emit(ir.Let(result, acc))
        self.define(result.name)
        self.scopes[-1].memo[memo_key] = result
        self.scopes, self.lanes, self.lane_base = saved_scopes, saved_lanes, saved_base
        return result

    # ------------------------------------------------------------------ kernels
    def vector_width(self, inner: Dim) -> int:
        if not isinstance(inner, int):
            return 1
        itemsize = max(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.g.tensors[t].dtype)).itemsize
                       for t in (*self.r.inputs, *self.r.outputs))
        return hw.vector_lanes(inner, itemsize, self.tgt.vector_bytes)

    def store_outputs(self, outs: list[str], idx_of: Callable[[Expr], tuple[Expr, ...]], guard: Optional[Expr]) -> None:
        """Every output at the iteration-space index idx_of(lane) of each lane: one vector store when the
        lanes run along the output's innermost axis, else one store per lane (a transposed output)."""
        stores: list[ir.Stmt] = []
        for o in outs:
            shape = self._shape(o)
            storage = _storage(self.g.tensors[o].dtype, f"output '{o}'")
            if o in self.views:  # stored at the element's offset in the space, read at its index in o's shape
                offsets = [self.linearize(idx_of(lane), tuple(self.r.space)) for lane in self.lanes]
                vals = [self.value(o, self.view_index(idx_of(lane), off, shape))
                        for lane, off in zip(self.lanes, offsets)]
                if len(vals) > 1:
                    stores.append(ir.VecStore(self.out_args[o], offsets[0], tuple(vals), storage))
                else:
                    stores.append(ir.Store(self.out_args[o], offsets[0], vals[0], storage))
                continue
            perm = self.perms.get(o)
            at = (lambda lane: tuple(idx_of(lane)[k] for k in perm)) if perm else idx_of  # noqa: E731
            vals = [self.value(o, at(lane)) for lane in self.lanes]
            if len(vals) > 1 and (perm is None or perm[-1] == len(perm) - 1):
                stores.append(ir.VecStore(self.out_args[o], self.linearize(at(self.lanes[0]), shape), tuple(vals), storage))
            else:
                stores.extend(ir.Store(self.out_args[o], self.linearize(at(lane), shape), v, storage)
                              for lane, v in zip(self.lanes, vals))
        if guard is None:
            self.scopes[-1].stmts.extend(stores)
        elif stores:
            self.emit(ir.If(guard, tuple(stores)))

    def pointwise(self) -> tuple[ir.Kernel, tuple[int, ...], int]:
        space = tuple(self.r.space)
        block = hw.POINTWISE_BLOCK
        self.inner_dim = space[-1] if space else 1
        self.vec = self.vector_width(self.inner_dim) if space else 1
        units_terms = [self.encode(d) for d in space[:-1]]
        if space:  # the innermost axis counts in vectors
            units_terms.append(space[-1] // self.vec if isinstance(space[-1], int) else self.encode(space[-1]))
        units = self.bind(self.product(units_terms), "units")
        tid = ir.Op("add", (ir.Op("mul", (ir.Op("block_idx", (), I64), ir.i64(block)), I64), ir.Op("thread_idx", (), I64)), I64)
        stride = ir.Op("mul", (ir.Op("grid_dim", (), I64), ir.i64(block)), I64)

        def body(u: Var) -> None:
            if not space:
                self.lanes, self.lane_base = (ir.i64(0),), None
                self.store_outputs(list(self.r.outputs), lambda lane: (), None)
                return
            inner_units = ir.idiv(self.dim(self.inner_dim), ir.i64(self.vec))
            cb = self.bind(ir.mul(ir.imod(u, inner_units), ir.i64(self.vec)), "cb")
            prefix = self.unravel(self.bind(ir.idiv(u, inner_units), "i"), space[:-1]) if len(space) > 1 else ()
            self.set_lanes(cb, aligned=True)
            self.store_outputs(list(self.r.outputs), lambda lane: prefix + (lane,), None)

        self.loop("u", tid, units, stride, body)
        return self.kernel(block, 0), tuple(units_terms), block

    def product(self, terms: list[int]) -> Expr:
        out: Expr = ir.i64(1)
        for t in terms:
            out = ir.mul(out, ir.i64(t) if t >= 0 else Var(f"d{-t - 1}", I64))
        return out

    def rowreduce(self) -> tuple[ir.Kernel, tuple[int, ...], int]:
        space = tuple(self.r.space)
        if not space:
            raise LoweringError("reduction of a scalar")
        c = space[-1]
        if isinstance(c, int) and c < 1:
            raise LoweringError("rows of no columns (an empty tensor)")
        self.inner_dim = c
        self.vec = self.vector_width(c)
        if isinstance(c, int) and c <= 32 * self.vec * hw.ROW_KERNEL_GROUPS:
            # a warp per row (or a share of one: a row of fewer than 32 vectors), its columns straight-line
            # (column_groups): each element read once and kept in registers for every reduction and output, the
            # reductions shuffles alone (a row across warps met at two block barriers per reduction, and each
            # pass's loop re-read the row from the caches)
            self.tpr, self.row_span = hw.short_row_threads(-(-c // self.vec)), c
        else:
            self.tpr = self.row_threads(c, hw.ROW_MAX_THREADS)
            if self.hint(c) >= ROW_LONG_UNROLL * self.tpr * self.vec:
                self.row_unroll = ROW_LONG_UNROLL
        block = max(self.tpr, hw.ROW_MIN_BLOCK)
        rpb = block // self.tpr
        rows_terms = [self.encode(d) for d in space[:-1]]
        rows = self.bind(self.product(rows_terms), "rows")
        tid = ir.Op("thread_idx", (), I64)
        self.bind_named("rlane", ir.Op("mod", (tid, ir.i64(self.tpr)), I64))
        rsub = self.bind(ir.Op("div", (tid, ir.i64(self.tpr)), I64), "rsub")
        start = ir.Op("mul", (ir.Op("block_idx", (), I64), ir.i64(rpb)), I64)
        step = ir.Op("mul", (ir.Op("grid_dim", (), I64), ir.i64(rpb)), I64)

        def row_body(row0: Var) -> None:
            self.row_pass(space, ir.add(row0, rsub), rows, lambda rowc: self.unravel(rowc, space[:-1]))

        self.loop("row0", start, rows, step, row_body)
        return self.kernel(block, block // 32), tuple(rows_terms), rpb

    def row_pass(self, space: tuple[Dim, ...], row_expr: Expr, rows: Expr,
                 row_index: Callable[[Expr], tuple[Expr, ...]]) -> None:
        """One row of the reduced tensor per TPR threads (`rlane` bound): its reductions, then its row-shaped
        outputs (by the row's first thread) and full outputs (the row's threads, VEC elements each).
        Rows past `rows` compute on the last row and store nothing, so every thread joins every reduction."""
        row = self.bind(row_expr, "row")
        active = self.bind(ir.Op("lt", (row, rows), "bool"), "active")
        rowc = self.bind(ir.imin(row, ir.Op("sub", (rows, ir.i64(1)), I64)), "rowc")
        self.row_depth = len(self.scopes)
        self.row_c, self.row_active = rowc, active
        self.row_idx = row_index(rowc)
        full = [o for o in self.r.outputs if self._shape(o) == space or o in self.perms or o in self.views]
        rowwise = [o for o in self.r.outputs if o not in full]
        for o in rowwise:
            oshape = self._shape(o)
            if oshape not in (space[:-1], space[:-1] + (1,)):
                raise LoweringError(f"output '{o}' of shape {oshape} is neither the reduced tensor's shape nor its row shape")
        xs = self.split_row
        c_start = ir.mul(Var("rlane", I64), ir.i64(self.vec))
        c_stop = self.dim(space[-1])
        if xs is not None:
            c_start, c_stop = ir.add(xs.n0, c_start), xs.n1
        if xs is not None and xs.phase is not None and xs.phase < len(xs.order):
            # a reduction phase: every output's value is built (so its reductions are reached) into a scope
            # that is dropped; only the reductions (in the row's scope) and their slot stores remain
            # (at a column of its own, so nothing that reads a column is hoisted out of the dropped scope)
            col = Var(self.fresh("c"), I64)
            self.scopes.append(_Scope({col.name}))
            self.lanes, self.lane_base = (col,), None
            for o in full:
                at = self.row_idx + (col,)
                perm = self.perms.get(o)
                if o in self.views:
                    self.value(o, self.view_index(at, self.linearize(at, space), self._shape(o)))
                else:
                    self.value(o, tuple(at[k] for k in perm) if perm else at)
            for o in rowwise:
                self.value(o, self.row_idx + ((ir.i64(0),) if len(self._shape(o)) == len(space) else ()))
            self.scopes.pop()
            return
        self.lanes, self.lane_base = (ir.i64(0),), None
        lead = ir.Op("and", (active, ir.Op("eq", (Var("rlane", I64), ir.i64(0)), "bool")), "bool")
        if xs is not None:  # split across a cluster: the row-shaped outputs are the first block's
            lead = ir.Op("and", (lead, ir.Op("eq", (xs.n0, ir.i64(0)), BOOL)), BOOL)
        for o in rowwise:  # written once per row, by the row's first thread
            keep = (ir.i64(0),) if len(self._shape(o)) == len(space) else ()
            self.store_outputs([o], lambda lane: self.row_idx + keep, lead)
        if full:
            def col_body(cb: Var) -> None:
                self.set_lanes(cb, aligned=xs is None)
                self.store_outputs(full, lambda lane: self.row_idx + (lane,), active)
            groups = self.column_groups(c_start, c_stop)
            if groups is None:
                self.row_loop(self.fresh("c"), c_start, c_stop, ir.i64(self.tpr * self.vec), col_body,
                              unroll=self.row_unroll if xs is None else 0)
            for cs, valid in groups or ():
                self.set_lanes(cs, aligned=xs is None)
                self.store_outputs(full, lambda lane: self.row_idx + (lane,),
                                   self.bind(ir.Op("and", (active, valid), BOOL), "st"))

    def row_threads(self, c: Dim, cap: int) -> int:
        """Threads per row: about ROW_VECTORS_PER_THREAD vectors each, a power of two in [32, cap]."""
        return hw.long_row_threads(math.ceil(self.hint(c) / self.vec), cap)

    def func(self, name: str, params: tuple[Var, ...], build: Callable[[], Optional[Expr]]) -> ir.Func:
        """A template callback: `build()` emits into a fresh scope where `params` are bound and returns
        the result expression (None: void)."""
        saved = self.scopes
        self.scopes = [_Scope({p.name for p in params})]
        result = build()
        body = tuple(self.scopes[0].stmts)
        self.scopes = saved
        return ir.Func(name, params, body, result)

    def bind_named(self, name: str, e: Expr) -> None:
        self.emit(ir.Let(Var(name, e.ctype), e))
        self.define(name)

    def kernel(self, block: int, scratch: int, headers: tuple[str, ...] = (),
               funcs: tuple[ir.Func, ...] = (), aligned: tuple[tuple[int, int], ...] = (),
               arch_specific: bool = False, tma: bool = False, min_blocks: int = 0,
               ops_consts: tuple[tuple[str, int], ...] = ()) -> ir.Kernel:
        params = tuple(ir.Param(k, t, _storage(self.g.tensors[t].dtype, f"'{t}'"), False) for t, k in self.args.items())
        params += tuple(ir.Param(k, t, _storage(self.g.tensors[t].dtype, f"'{t}'"), True) for t, k in self.out_args.items())
        body = tuple(self.scopes[0].stmts)
        # named by content (template callbacks included), tensor names left out: identical layers share
        # one compiled kernel
        anon = tuple(ir.Param(p.arg, "", p.storage, p.is_output) for p in params)
        key = repr(ir.Kernel("", block, anon, self.num_dims, scratch, body, headers, funcs, aligned, arch_specific,
                             tma, min_blocks, ops_consts=ops_consts))
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        return ir.Kernel(f"ofz_{digest}", block, params, self.num_dims, scratch, body, headers, funcs, aligned,
                         arch_specific, tma, min_blocks, ops_consts=ops_consts)


def lower(graph: Graph, region: Region, tgt: hw.Target, tf32: bool = False,
          tile: Optional[tuple[int, ...]] = None, bound: bool = False) -> KernelSpec:
    """Raises LoweringError with the reason when the region is not one kernel. `tf32`: fp32 GEMMs may
    run on tf32 tensor cores (the user opted in). `tile`: a GEMM candidate from `KernelSpec.tiles` to use
    instead of the top-ranked one (profiling); without its 7th entry (SPLIT), at its best split. `bound`:
    a tensor-core attention kernel asks ptxas for its blocks per SM (api._attention_occupancy)."""
    if len(region.inputs) + len(region.outputs) > 32:
        raise LoweringError("more than 32 tensors in one kernel")
    reads = legal.shape_reads(graph, region.nodes, region.inputs)
    if reads is None:
        raise LoweringError("a run-time shape (a Range's length, an Expand's or Reshape's target, a Resize's sizes) is not made of the region's input dims")
    spec = _lower_kind(graph, region, tgt, tf32, tile, bound)
    if tgt.pdl:  # the same kernel, launched so that it may overlap its predecessor: a name of its own
        spec = dataclasses.replace(spec, kernel=dataclasses.replace(
            spec.kernel, name=spec.kernel.name + "_pdl", pdl=True, prefetch=prefetched(graph, region, spec, tgt)))
    checks = tuple(sorted(dim_checks(graph, spec) + spec.dim_checks))  # grouped by input: one shape query each
    if len(checks) > MAX_DIM_CHECKS:
        raise LoweringError(f"{len(checks)} input dims to check at launch; the node format holds {MAX_DIM_CHECKS}")
    return dataclasses.replace(spec, arg_align=ir.arg_alignment(spec.kernel, len(spec.inputs) + len(spec.outputs)),
                               shape_reads=reads, dim_checks=checks,
                               dim_limits=spec.dim_limits + slice_limits(graph, region, spec))


def prefetched(graph: Graph, region: Region, spec: KernelSpec, tgt: hw.Target) -> tuple[tuple[int, int], ...]:
    """(input, bytes) a GEMM kernel launched as a programmatic dependent launch prefetches into L2 before it
    waits for its predecessor: its constant inputs (weights, biases: read whole, written by no kernel), while
    they take at most half the L2. Not for other kernels, whose constants are small or gathered (an
    embedding table is read a row at a time)."""
    if region.kind not in ("gemm", "gemm_row"):
        return ()
    out = []
    for i, t in enumerate(spec.inputs):
        info = graph.tensors[t]
        if t in graph.constants and not graph.fed(t) and all(isinstance(d, int) for d in info.shape):
            size = math.prod(info.shape) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(info.dtype)).itemsize
            out.append((i, int(size)))
    return tuple(out) if sum(b for _, b in out) <= tgt.l2_bytes // 2 else ()


def slice_limits(graph: Graph, region: Region, spec: KernelSpec) -> tuple[tuple[tuple[int, ...], int], ...]:
    """dim_limits for each Slice with a run-time end (`legal.slice_runtime_end`): the dim it is read as
    must fit the sliced axis, or the kernel would read past it where ORT's Slice would have clamped (and
    the model failed further on): the launch is refused instead."""
    bound = _bound_dims(graph, spec)
    out = []
    for i in region.nodes:
        n = graph.nodes[i]
        run_time = legal.slice_runtime_end(graph, n) if n.op_type == "Slice" else None
        if run_time is not None:
            if run_time[1] not in bound:
                raise LoweringError(f"Slice '{n.name}': its length {run_time[1]} is not a dim of the kernel")
            out.append(((-bound[run_time[1]] - 1,), run_time[2] + 1))
    return tuple(out)


def _bound_dims(graph: Graph, spec: KernelSpec) -> dict[Dim, int]:
    """symbolic dim -> the runtime dim k the kernel binds it to (`KernelSpec.sym_dims`, first binding)."""
    bound: dict[Dim, int] = {}
    for k, (i, axis) in enumerate(spec.sym_dims):
        bound.setdefault(graph.tensors[spec.inputs[i]].shape[axis], k)
    return bound


MAX_DIM_CHECKS = 64  # the native library's bound (OFZ_MAX_TERMS triples)


def dim_checks(graph: Graph, spec: KernelSpec) -> tuple[tuple[int, int, int], ...]:
    """(input, axis, term) for every input axis carrying a symbolic dim bound at another input (term -(k + 1):
    runtime dim k), which shape inference may have merged with it in a broadcast, or which graph inputs
    declare alike though a user may feed them unalike (the two tensors computed from different ones of
    them: attention's mask beside its hidden states): checked at each launch. Dims it cannot have merged
    (`iota.trusted_dims`), read where they come from the same inputs as where bound, need no check: each
    checked input costs the launch a shape query (about 0.1 us). (A graph input inferred static where it is
    declared symbolic is refused by `legal.classify`; the node format's checks also take sizes, term >= 0.)"""
    trusted, bound = iota.trusted_dims(graph), _bound_dims(graph, spec)
    shared, ancestry = iota.shared_declarers(graph), iota.input_ancestry(graph)

    def sources(t: str, d: str) -> frozenset[str]:  # the graph inputs declaring d that t is computed from
        return ancestry.get(t, frozenset()) & shared[d]

    def unchecked(i: int, d: str) -> bool:
        """d at input i is the size the kernel bound: a trusted dim that, where several graph inputs
        declare it, comes from the same ones as at the binding input."""
        if d not in trusted:
            return False
        return d not in shared or sources(spec.inputs[i], d) == sources(spec.inputs[spec.sym_dims[bound[d]][0]], d)

    out = [(i, axis, -bound[d] - 1) for i, t in enumerate(spec.inputs)
           for axis, d in enumerate(graph.tensors[t].shape or ())
           if isinstance(d, str) and d in bound and spec.sym_dims[bound[d]] != (i, axis) and not unchecked(i, d)]
    if len(out) > MAX_DIM_CHECKS:
        raise LoweringError(f"{len(out)} input dims to check at launch; the node format holds {MAX_DIM_CHECKS}")
    return tuple(out)


def _lower_kind(graph: Graph, region: Region, tgt: hw.Target, tf32: bool,
                tile: Optional[tuple[int, ...]], bound: bool) -> KernelSpec:
    if region.kind in ("gemm", "gemm_row"):
        from ortfuse.customops.lower_gemm import lower_gemm
        return lower_gemm(graph, region, tgt, tf32, tile)
    if region.kind == "attention":
        from ortfuse.customops.lower_attention import lower_attention
        return lower_attention(graph, region, tgt, bound)
    lw = _Lowerer(graph, region, tgt, dict(graph.sym_hints))
    if region.kind == "pointwise":
        k, units, per_block = lw.pointwise()
    else:
        k, units, per_block = lw.rowreduce()
    shapes = lw.output_shapes()
    return KernelSpec(k, tuple(region.inputs), tuple(region.outputs), tuple(lw.sym_pairs), units, per_block,
                      tuple(graph.tensors[o].dtype for o in region.outputs), shapes,
                      sym_derived=tuple(lw.derived), sym_sums=tuple(lw.sums), sym_products=tuple(lw.products),
                      dim_checks=tuple(lw.sum_checks),
                      input_perms=tuple(lw.permuted.items()))


"""The kernel IR: scalar expressions and a few statements, printed to CUDA by `customops.printer`.

Expressions are frozen dataclasses, so equal trees compare equal: the lowering uses that for CSE and
for recognising the vector lane of an index. Index arithmetic is folded as it is built (`add`, `mul`,
...), so the printed source stays readable and offsets that are constant cost nothing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

# Compute types. Storage types (what a tensor holds) add f16/bf16, which compute as f32.
F32, I64, I32, BOOL, U8, I8 = "f32", "i64", "i32", "bool", "u8", "i8"
STORAGE_TYPES = ("f32", "f16", "bf16", "i64", "i32", "bool", "u8", "i8")
STORAGE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "bool": 1, "u8": 1, "i8": 1}


def compute_type(storage: str) -> str:
    return F32 if storage in ("f16", "bf16") else storage


@dataclass(frozen=True)
class Const:
    value: Union[float, int, bool]
    ctype: str


@dataclass(frozen=True)
class Var:
    name: str
    ctype: str


@dataclass(frozen=True)
class Op:
    """A pure operation from the printer's table (`add`, `exp`, `select`, `cast`, ...)."""

    fn: str
    args: tuple["Expr", ...]
    ctype: str


@dataclass(frozen=True)
class Load:
    """Element `offset` of kernel argument `arg`, converted to its compute type."""

    arg: int
    offset: "Expr"
    storage: str

    @property
    def ctype(self) -> str:
        return compute_type(self.storage)


@dataclass(frozen=True)
class Lane:
    """Element `lane` of a vector loaded by `VecLoad`, converted to its compute type."""

    vec: str
    lane: int
    storage: str

    @property
    def ctype(self) -> str:
        return compute_type(self.storage)


Expr = Union[Const, Var, Op, Load, Lane]


# ----------------------------------------------------------------------------- statements
@dataclass(frozen=True)
class Let:
    var: Var
    value: Expr


@dataclass(frozen=True)
class Decl:
    """A mutable local (accumulators)."""

    var: Var
    init: Expr


@dataclass(frozen=True)
class Assign:
    var: Var
    value: Expr


@dataclass(frozen=True)
class For:
    var: Var
    start: Expr
    stop: Expr
    step: Expr
    body: tuple["Stmt", ...]
    unroll: int = 0  # > 0: `#pragma unroll` with this factor (a loop of a known trip count)


@dataclass(frozen=True)
class If:
    cond: Expr
    body: tuple["Stmt", ...]


@dataclass(frozen=True)
class VecLoad:
    name: str
    arg: int
    offset: Expr
    width: int
    storage: str
    guard: Optional[Expr] = None  # load only where it holds; the vector is zeros elsewhere


@dataclass(frozen=True)
class Store:
    arg: int
    offset: Expr
    value: Expr
    storage: str


@dataclass(frozen=True)
class VecStore:
    arg: int
    offset: Expr
    values: tuple[Expr, ...]
    storage: str


@dataclass(frozen=True)
class RowReduce:
    """`var = ofz::row_reduce<op, tpr>(var, scratch)`: all threads of the block execute it."""

    var: Var
    op: str  # "sum" | "max" | "min"
    tpr: int


@dataclass(frozen=True)
class RowPut:
    """`<buffer>[offset] = value` in a GEMM row-wise epilogue's shared memory (ortfuse_gemm.h): "ofz_slots", a row
    reduction's partial over the block's columns for the cluster's other blocks (a row split across a
    cluster; read back combined by Op("xrow_<op>", (offset, RSPLIT, BM)), both constants), or "ofz_row",
    row_in8's values of X into the row buffer."""

    offset: Expr
    value: Expr
    buffer: str = "ofz_slots"


@dataclass(frozen=True)
class Comment:
    text: str


@dataclass(frozen=True)
class Call:
    """The kernel body as one call of a header template: `fn<targs...>(a, args...)`. A template argument
    "OPS" (or "OPS::X") names the struct of the kernel's `funcs` (or its nested struct X)."""

    fn: str
    targs: tuple[str, ...]
    args: tuple["Expr", ...]


Stmt = Union[Let, Decl, Assign, For, If, VecLoad, Store, VecStore, RowReduce, RowPut, Comment, Call]


@dataclass(frozen=True)
class Func:
    """A device function a template calls back, printed as a static member of the kernel's `Ops` struct
    (a name "X.f" puts f in the nested struct X). Its body sees the kernel's tensors (t<k>) and dims
    (d<k>) as the kernel body does."""

    name: str
    params: tuple[Var, ...]
    body: tuple[Stmt, ...]
    result: Optional[Expr] = None  # None: void


@dataclass(frozen=True)
class Param:
    arg: int
    name: str
    storage: str
    is_output: bool


@dataclass(frozen=True)
class Kernel:
    name: str
    block: int
    params: tuple[Param, ...]
    num_dims: int
    scratch_floats: int  # __shared__ floats for row reductions (0: none)
    body: tuple[Stmt, ...]
    headers: tuple[str, ...] = ()  # extra template headers from customops/include
    funcs: tuple[Func, ...] = ()  # members of the `Ops` struct the body's template calls
    # (argument, bytes): tensors the template code itself reads in aligned vectors (cp.async's 16 bytes)
    aligned: tuple[tuple[int, int], ...] = ()
    # arch-specific instructions (sm_90a's wgmma): the cubin is built for sm_90a, which runs on sm_90 only
    arch_specific: bool = False
    # the kernel takes tensor maps (OfzTma `ofz_tma`) as a second parameter: its TMA operands
    tma: bool = False
    # __launch_bounds__'s minimum blocks per SM (0: not given): a kernel that moves registers between its
    # warpgroups (setmaxnreg) needs ptxas to allocate exactly its share of the SM at launch
    min_blocks: int = 0
    # launched as a programmatic dependent launch (Target.pdl): the body opens with ofz::grid_dependency_sync,
    # after an L2 prefetch of `prefetch`'s (argument, bytes), constants no kernel writes (lower.prefetched)
    pdl: bool = False
    prefetch: tuple[tuple[int, int], ...] = ()
    # (name, value): `static constexpr int` members of the `Ops` struct, settings the template reads
    # (ortfuse_gemm.h StageOut: kStageOut)
    ops_consts: tuple[tuple[str, int], ...] = ()


def arg_alignment(kernel: Kernel, n_args: int) -> tuple[int, ...]:
    """The byte alignment each argument's address needs (1: none): the widest vector access on it, from
    the body's and the template callbacks' VecLoad/VecStore and the template's own `aligned` accesses.
    A GPU faults on a misaligned vector access, so the fused node carries this and the launch checks it."""
    need = [1] * n_args
    for arg, nbytes in kernel.aligned:
        need[arg] = max(need[arg], nbytes)

    def visit(body: tuple[Stmt, ...]) -> None:
        for s in body:
            if isinstance(s, VecLoad):
                need[s.arg] = max(need[s.arg], s.width * STORAGE_BYTES[s.storage])
            elif isinstance(s, VecStore):
                need[s.arg] = max(need[s.arg], len(s.values) * STORAGE_BYTES[s.storage])
            elif isinstance(s, (For, If)):
                visit(s.body)

    visit(kernel.body)
    for f in kernel.funcs:
        visit(f.body)
    return tuple(need)


# ----------------------------------------------------------------------------- folding builders
def const(value: Union[int, float, bool], ctype: str) -> Const:
    return Const(value, ctype)


def i64(value: int) -> Const:
    return Const(int(value), I64)


def _is(e: Expr, v: Union[int, float]) -> bool:
    return isinstance(e, Const) and e.value == v and not isinstance(e.value, bool)


def add(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and isinstance(b, Const) and a.ctype == I64 == b.ctype:
        return i64(int(a.value) + int(b.value))
    if _is(a, 0):
        return b
    if _is(b, 0):
        return a
    return Op("add", (a, b), a.ctype)


def mul(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and isinstance(b, Const) and a.ctype == I64 == b.ctype:
        return i64(int(a.value) * int(b.value))
    if _is(a, 0) or _is(b, 0):
        return i64(0) if a.ctype == I64 else Op("mul", (a, b), a.ctype)
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    return Op("mul", (a, b), a.ctype)


def idiv(a: Expr, b: Expr) -> Expr:
    """Index division (non-negative operands)."""
    if _is(b, 1):
        return a
    if isinstance(a, Const) and isinstance(b, Const):
        return i64(int(a.value) // int(b.value))
    return Op("div", (a, b), I64)


def imod(a: Expr, b: Expr) -> Expr:
    if _is(b, 1):
        return i64(0)
    if isinstance(a, Const) and isinstance(b, Const):
        return i64(int(a.value) % int(b.value))
    return Op("mod", (a, b), I64)


def imin(a: Expr, b: Expr) -> Expr:
    return Op("min", (a, b), I64)


def free_vars(e: Expr) -> frozenset[str]:
    if isinstance(e, Var):
        return frozenset((e.name,))
    if isinstance(e, Op):
        out: frozenset[str] = frozenset()
        for a in e.args:
            out |= free_vars(a)
        return out
    if isinstance(e, Load):
        return free_vars(e.offset)
    if isinstance(e, Lane):
        return frozenset((e.vec,))
    return frozenset()


def _reads(s: Stmt) -> frozenset[str]:
    """Names a statement (and anything nested in it) reads."""
    exprs: tuple = ()
    nested: tuple = ()
    if isinstance(s, (Let, Assign)):
        exprs = (s.value,)
    elif isinstance(s, Decl):
        exprs = (s.init,)
    elif isinstance(s, For):
        exprs, nested = (s.start, s.stop, s.step), s.body
    elif isinstance(s, If):
        exprs, nested = (s.cond,), s.body
    elif isinstance(s, (VecLoad, Store)):
        exprs = (s.offset,) + ((s.value,) if isinstance(s, Store) else (s.guard,) if s.guard is not None else ())
    elif isinstance(s, VecStore):
        exprs = (s.offset, *s.values)
    elif isinstance(s, RowReduce):
        return frozenset((s.var.name,))
    elif isinstance(s, RowPut):
        exprs = (s.offset, s.value)
    elif isinstance(s, Call):
        exprs = s.args
    out: frozenset[str] = frozenset()
    for e in exprs:
        out |= free_vars(e)
    for b in nested:
        out |= _reads(b)
    return out


def loads_first(body: tuple[Stmt, ...], most: int) -> tuple[Stmt, ...]:
    """`body` with its first `most` reads moved ahead of the math: each vector load, each `Let` of a load,
    and the index and guard `Let`s they need (integer and bool values computed from such statements or from
    outside the body), in their order, then the rest in theirs. Nothing moves past a statement it reads from,
    so the result computes the same values; ptxas then has those reads of an unrolled loop body in flight at
    once, where it left each next to its use. Reads past `most` keep their place (a window's taps, already
    issued a kernel row at a time, would otherwise all be held at once: 180 loads a trip for a 3x3)."""
    early: list[Stmt] = []
    late: list[Stmt] = []
    defined: set[str] = set()  # names the body defines or assigns
    moved: set[str] = set()  # names the early part defines
    reads = 0
    for st in body:
        read = isinstance(st, VecLoad) or (isinstance(st, Let) and isinstance(st.value, Load))
        movable = (read and reads < most) or (isinstance(st, Let) and not read and st.var.ctype in (I64, BOOL))
        if movable and all(n in moved or n not in defined for n in _reads(st)):
            early.append(st)
            reads += read
            moved |= _writes(st)
        else:
            late.append(st)
        defined |= _writes(st)
    return tuple(early + late)


def _writes(s: Stmt) -> frozenset[str]:
    """Names a statement (and anything nested in it) defines or assigns."""
    if isinstance(s, VecLoad):
        return frozenset((s.name,))
    if isinstance(s, (Let, Decl, Assign, RowReduce)):
        return frozenset((s.var.name,))
    if isinstance(s, For):
        return frozenset((s.var.name,)).union(*(_writes(b) for b in s.body))
    if isinstance(s, If):
        return frozenset().union(*(_writes(b) for b in s.body))
    return frozenset()


def live(body: tuple[Stmt, ...], result: Optional[Expr] = None) -> tuple[Stmt, ...]:
    """`body` without the `Let`s nothing reads (index math made redundant by the div/mod merge, for
    example); repeated until none is left, so whole dead chains go."""
    while True:
        used = free_vars(result) if result is not None else frozenset()
        for s in body:
            used |= _reads(s)
        pruned = _drop_lets(body, used)
        if pruned == body:
            return body
        body = pruned


def _drop_lets(body: tuple[Stmt, ...], used: frozenset[str]) -> tuple[Stmt, ...]:
    out: list[Stmt] = []
    for s in body:
        if isinstance(s, Let) and s.var.name not in used:
            continue
        if isinstance(s, For):
            s = For(s.var, s.start, s.stop, s.step, _drop_lets(s.body, used), s.unroll)
        elif isinstance(s, If):
            s = If(s.cond, _drop_lets(s.body, used))
        out.append(s)
    return tuple(out)

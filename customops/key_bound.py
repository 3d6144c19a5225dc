"""Causal frontiers: where an attention's scores are masked past a diagonal, so its kernel may skip key tiles.

A decoder's mask hides key j from query row i where j > i (a prompt), or j > i + past (queries after a cache):
every such score is -inf, or a finite mask value far below the row's scores, its softmax term 0, so the
tiles of keys past a unit's last row contribute nothing and the kernel need not visit them
(`ortfuse_attention.h`, `key_end`). The property is proved on the graph: the score ops and the cone computing
each mask they read (HF's `Where(causal & padding, 0, -inf)` made from Range iotas and the padding input,
the Trilu of ones TorchScript writes for `is_causal`, ONNX Attention's rule) are lowered symbolically at a
generic (i, j) by the kernel lowering's own evaluator, and the expression is searched for a condition that
is false, and a value that is masked, wherever j > i + c.

A mask value counts when it lies at least MASK_DEPTH below the scores (-inf, or a lowest finite value:
ORT's fp16 converter turns -inf into -65504). With -inf the kernel's result is unchanged on every row (but
for NaN or inf inputs at skipped keys). With a finite value, a row that sees no key at all (left padding's
first rows) is a softmax over every key in ORT and over the keys of the tiles its unit visits here (0 where
none): such rows mean nothing (docs/design.md). A window's far side (j < i + c masked) is found the same
way. Nothing found: no frontier, and the kernel visits every tile as before."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Union

import ml_dtypes
import numpy as np
import onnx

from ortfuse.customops import ir, scalar, target as hw
from ortfuse.customops.ir import F32, I32, I64, Expr, Var
from ortfuse.customops.lower import LoweringError, _Lowerer, _storage
from ortfuse.rewriter.graph import Graph, per_graph
from ortfuse.search import ops
from ortfuse.search.attention import AttentionPattern
from ortfuse.search.plan import Region, Traffic

ROW, KEY = "ai", "aj"  # the kernel's score coordinates (lower_attention's names)
# A mask value at least this far below the scores (fp16's lowest -65504, fp32's -3.4e38, BERT's -10000, -inf)
# gives a term e^(s - max) under 2^-126 (0 in the kernel's flushing exponentials) while the row's scores
# are within MASK_DEPTH - 88 of each other
MASK_DEPTH = 1e4
MAX_CONE = 256  # mask nodes followed back from the score ops
_FLAG_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL})  # `bounds`


@dataclass(frozen=True)
class KeyBound:
    """Every score of query row i is masked at keys j > i + shift (+ Sk - Sq where `tail`: queries that follow a
    cache of Sk - Sq keys, bottom-right aligned), and where `low` = (tail, shift) is given, at keys
    j < i + shift (+ Sk - Sq) too (a sliding window's far side)."""
    tail: bool
    shift: int
    low: Optional[tuple[bool, int]] = None

    def end(self, i: int, sq: int, sk: int) -> int:
        """The first key past row i's frontier."""
        return i + 1 + self.shift + (sk - sq if self.tail else 0)

    def begin(self, i: int, sq: int, sk: int) -> int:
        """Row i's first key not masked by the far side (0 without one)."""
        return 0 if self.low is None else i + self.low[1] + (sk - sq if self.low[0] else 0)

    def unit_spans(self, sq: int, sk: int, block_m: int, block_n: int, group: int = 1) -> list[tuple[int, int]]:
        """The key tiles [lo, hi) each query-row unit of a head visits (ortfuse_attention.h unit_key_tiles);
        `group`: query heads packed into a unit's rows (G heads' sq rows each)."""
        tiles, out, rows = -(-sk // block_n), [], sq * group
        for i0 in range(0, rows, block_m):
            first, last = i0, min(i0 + block_m, rows) - 1
            if group > 1:
                first, last = (first % sq, last % sq) if first // sq == last // sq else (0, sq - 1)
            hi = min(tiles, max(0, -(-self.end(last, sq, sk) // block_n)))
            out.append((min(hi, max(0, self.begin(first, sq, sk) // block_n)), hi))
        return out

    def unit_tiles(self, sq: int, sk: int, block_m: int, block_n: int, group: int = 1) -> list[int]:
        """How many key tiles each query-row unit of a head visits."""
        return [hi - lo for lo, hi in self.unit_spans(sq, sk, block_m, block_n, group)]

    def visible_share(self, sq: int, sk: int, block_m: int, block_n: int, group: int = 1) -> float:
        """The share of (query-row unit, key tile) pairs a kernel with these tiles visits."""
        seen = self.unit_tiles(sq, sk, block_m, block_n, group)
        return sum(seen) / (-(-sk // block_n) * len(seen)) if sq and sk else 1.0


# A linear integer form: {name: coefficient} over the row, the key and runtime dims, and a constant.
_Lin = tuple[tuple[tuple[str, int], ...], int]


def _lin(terms: dict[str, int], const: int) -> _Lin:
    return tuple(sorted((k, v) for k, v in terms.items() if v)), const


def _combine(a: _Lin, b: _Lin, sign: int = 1) -> _Lin:
    t = dict(a[0])
    for k, v in b[0]:
        t[k] = t.get(k, 0) + sign * v
    return _lin(t, a[1] + sign * b[1])


def _scale(a: _Lin, k: int) -> _Lin:
    return _lin({n: v * k for n, v in a[0]}, a[1] * k)


class _Always:
    """The value is -inf at every (i, j)."""


ALWAYS = _Always()
Frontier = Union[_Lin, _Always, None]  # c: -inf (or false) wherever j > i + c, as a form free of i and j


_FOLD = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
         "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
         "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "and": lambda a, b: bool(a and b),
         "or": lambda a, b: bool(a or b), "not": lambda a: not a, "neg": lambda a: -a}


def _fold(e: Expr, defs: dict[str, Expr], depth: int = 0) -> Optional[Union[int, bool]]:
    """The value of an integer or bool expression of constants alone (a Gather's index arithmetic on a
    constant index), else None."""
    while isinstance(e, Var) and e.name in defs:
        e = defs[e.name]
    if isinstance(e, ir.Const):
        return e.value if isinstance(e.value, bool) or e.ctype != F32 else None
    if not isinstance(e, ir.Op) or depth > 32:
        return None
    if e.fn == "select":
        c = _fold(e.args[0], defs, depth + 1)
        return None if c is None else _fold(e.args[1] if c else e.args[2], defs, depth + 1)
    rule = _FOLD.get(e.fn)
    args = [_fold(a, defs, depth + 1) for a in e.args]
    return None if rule is None or any(a is None for a in args) else rule(*args)


def _name_form(name: str) -> _Lin:
    """A symbolic dim's name as a linear form over names: "past_sequence + sequence", "2*s + 1"; any other
    name is itself."""
    terms: dict[str, int] = {}
    const = 0
    for part in (x.strip() for x in name.split(" + ")):
        k, _, base = part.rpartition("*")
        if part.isdigit():
            const += int(part)
        elif k.isdigit() and _NAME.fullmatch(base):
            terms[base] = terms.get(base, 0) + int(k)
        elif _NAME.fullmatch(part):
            terms[part] = terms.get(part, 0) + 1
        else:  # a difference, a product of names, a Min(...): the whole name is one unknown size
            return _lin({name: 1}, 0)
    return _lin(terms, const)


_NAME = re.compile(r"[A-Za-z_][^\s+\-*/(),]*")  # one symbol: no operators, not a number


class _Analysis:
    """`sign` 1: frontiers c with everything masked past j > i + c; -1: the far side, masked at j < i + c."""

    def __init__(self, defs: dict[str, Expr], dims: dict[str, _Lin], sign: int = 1,
                 flags: frozenset[int] = frozenset()):
        self.defs, self.dims, self.sign, self.flags = defs, dims, sign, flags  # flags: see `bounds`

    def resolve(self, e: Expr) -> Expr:
        while True:
            while isinstance(e, Var) and e.name in self.defs:
                e = self.defs[e.name]
            if not (isinstance(e, ir.Op) and e.fn == "select"):
                return e
            c = _fold(e.args[0], self.defs)  # a select on a known condition (a Gather's bounds check)
            if c is None:
                return e
            e = e.args[1] if c else e.args[2]

    def linear(self, e: Expr) -> Optional[_Lin]:
        """e as a linear form over the row, the key and the runtime dims, else None. Integers are i64 or i32 (a
        position past 2^31 is not an attention's) and floats are exact below 2^24 (16M positions): casts to
        narrower types, which wrap, end the form."""
        e = self.resolve(e)
        if isinstance(e, ir.Const):
            v = e.value
            exact = 2 ** 24 if e.ctype == F32 else 2 ** 31
            return _lin({}, int(v)) if not isinstance(v, bool) and float(v).is_integer() and abs(v) < exact \
                else None
        if isinstance(e, Var):
            if e.name in (ROW, KEY):
                return _lin({e.name: 1}, 0)
            return self.dims.get(e.name)
        if not isinstance(e, ir.Op):
            return None
        a = [self.linear(x) for x in e.args] if e.fn in ("add", "sub", "mul", "neg", "cast") else []
        if any(x is None for x in a) or not a:
            return None
        if e.fn == "add":
            return _combine(a[0], a[1])
        if e.fn == "sub":
            return _combine(a[0], a[1], -1)
        if e.fn == "neg":
            return _scale(a[0], -1)
        if e.fn == "cast":  # an integer as a float (exact below 2^24) or as another wide integer type
            inner = self.resolve(e.args[0])
            return a[0] if inner.ctype in (I64, I32) and e.ctype in (I64, I32, F32) else None
        x, y = a
        if not x[0]:
            return _scale(y, x[1])
        if not y[0]:
            return _scale(x, y[1])
        return None

    def condition(self, e: Expr, negate: bool = False) -> Frontier:
        """c where (e, or its negation) implies j <= i + c (j >= i + c for the far side)."""
        e = self.resolve(e)
        if not isinstance(e, ir.Op):
            return None
        f = e.fn
        if f == "not":
            return self.condition(e.args[0], not negate)
        if f in ("and", "or"):
            a, b = (self.condition(x, negate) for x in e.args)
            return _either(a, b, self.sign) if (f == "and") != negate else _both(a, b, self.sign)
        if f == "select":  # Where(c, True, False) or Where(c, False, True)
            ind = self.indicator(e)
            if ind is not None and {ind[1], ind[2]} == {True, False}:
                return self.condition(ind[0], negate != (not ind[1]))
            return None
        if f in ("ne", "eq"):  # an indicator of a condition tested against one of its two values
            for x, k in ((e.args[0], e.args[1]), (e.args[1], e.args[0])):
                ind, k = self.indicator(x), self.resolve(k)
                if ind is None or not isinstance(k, ir.Const) or ind[1] == ind[2] or k.value not in ind[1:]:
                    continue
                return self.condition(ind[0], negate != ((k.value == ind[1]) != (f == "eq")))
        if f not in ("le", "lt", "ge", "gt", "eq", "ne"):
            return None
        x, y = (self.linear(a) for a in e.args)
        if x is None or y is None:
            return None
        d = _combine(x, y, -1)  # the relation is d (op) 0
        if negate:
            f = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}[f]
        forms = {"le": [(d, False)], "lt": [(d, True)], "ge": [(_scale(d, -1), False)],
                 "gt": [(_scale(d, -1), True)], "eq": [(d, False), (_scale(d, -1), False)], "ne": []}[f]
        for g, strict in forms:  # g <= 0 (or < 0): a frontier where g = sign (j - i) + r
            t = dict(g[0])
            if t.pop(KEY, 0) == self.sign and t.pop(ROW, 0) == -self.sign:
                r = _scale(_lin(t, g[1]), -self.sign)  # sign (j - i) <= -r: j <= i - r, or j >= i + r
                return _combine(r, _lin({}, self.sign), -1) if strict else r
        return None

    def score_like(self, e: Expr) -> bool:
        """Whether e is the scores themselves: qk under positive scales, casts and a tanh cap (Gemma 2's)."""
        e = self.resolve(e)
        if isinstance(e, Var):
            return e.name == "qk"
        if not isinstance(e, ir.Op):
            return False
        if e.fn in ("cast", "round_f16", "round_bf16", "tanh"):
            return self.score_like(e.args[0])
        if e.fn in ("mul", "div"):
            x, y = (self.resolve(a) for a in e.args)
            if e.fn == "mul" and isinstance(x, ir.Const):
                x, y = y, x
            return isinstance(y, ir.Const) and isinstance(y.value, float) and 0 < y.value < math.inf \
                and self.score_like(x)
        return False

    def lift(self, y: Expr, s: int, depth: float) -> Optional[float]:
        """How far s·y may raise a value masked `depth` deep: 0 for the scores themselves (the depth is measured
        against them), the positive part of a constant-built bound, 0 for anything but -inf added to -inf (only
        +inf or NaN lifts it; -inf - -inf is NaN, so a subtracted mask does); None where unknown."""
        if self.score_like(y):
            return 0.0
        b = self.bounds(y)
        if b is not None:
            v = b[1] if s > 0 else -b[0]
            return max(0.0, v) if v < math.inf else None
        return 0.0 if depth == math.inf and (s > 0 or self.masked(y) is None) else None

    def bounds(self, e: Expr) -> Optional[tuple[float, float]]:
        """(lowest, highest) of e built from constants (selects, sums, differences, products, negations,
        roundings) and key-padding flags: an element of an integer graph input named a mask (kernel argument
        in `flags`) is 0 or 1, as ORT's own attention fusions take attention_mask (legacy exports'
        (1 - m) * lowest); other integer inputs (position ids, cache positions) are unknown."""
        e = self.resolve(e)
        if isinstance(e, ir.Const):
            v = e.value
            return None if isinstance(v, bool) or math.isnan(float(v)) else (float(v), float(v))
        if isinstance(e, ir.Load):
            return (0.0, 1.0) if e.arg in self.flags else None
        if not isinstance(e, ir.Op):
            return None
        args = [self.bounds(a) for a in e.args[1:]] if e.fn == "select" else [self.bounds(a) for a in e.args]
        if e.fn not in ("select", "add", "sub", "mul", "neg", "cast", "round_f16", "round_bf16") or \
                any(a is None for a in args):
            return None
        if e.fn == "select":
            return min(args[0][0], args[1][0]), max(args[0][1], args[1][1])
        if e.fn == "add":
            return args[0][0] + args[1][0], args[0][1] + args[1][1]
        if e.fn == "sub":
            return args[0][0] - args[1][1], args[0][1] - args[1][0]
        if e.fn == "mul":
            products = [x * y for x in args[0] for y in args[1]]
            return None if any(math.isnan(v) for v in products) else (min(products), max(products))
        lo, hi = args[0]
        if e.fn == "neg":
            return -hi, -lo
        if e.fn == "cast" and e.ctype in (F32, I64, I32) and self.resolve(e.args[0]).ctype in (I64, I32) and \
                max(-lo, hi) < 2 ** 24:
            return lo, hi  # an integer as a float, exactly
        inner, exact = self.resolve(e.args[0]), 2 ** 11 if e.fn == "round_f16" else 2 ** 8
        if e.fn in ("round_f16", "round_bf16") and isinstance(inner, ir.Op) and inner.fn == "cast" and \
                self.resolve(inner.args[0]).ctype in (I64, I32) and max(-lo, hi) <= exact:
            return lo, hi  # a small integer, exact in 16 bits
        return lo - abs(lo) * 2.0 ** -8, hi + abs(hi) * 2.0 ** -8  # a rounding moves a value by under 2^-8 of it

    def indicator(self, e: Expr) -> Optional[tuple[Expr, object, object]]:
        """(c, value where c, value where not c) for Where(c, a, b) of constants or a bool cast to a number, and
        for such an indicator plus, minus or times a finite constant ((1 - keep) * lowest, `~keep * -1e9`)."""
        e = self.resolve(e)
        if not isinstance(e, ir.Op):
            return None
        if e.fn == "cast" and self.resolve(e.args[0]).ctype == "bool":
            return e.args[0], 1, 0
        if e.fn in ("round_f16", "round_bf16"):  # (a cast to a 16-bit type): its two values rounded
            found = self.indicator(e.args[0])
            if found is None or any(isinstance(v, bool) for v in found[1:]):
                return None
            dt = np.float16 if e.fn == "round_f16" else ml_dtypes.bfloat16
            return found[0], float(dt(found[1])), float(dt(found[2]))
        if e.fn == "select":
            a, b = (self.resolve(x) for x in e.args[1:])
            if isinstance(a, ir.Const) and isinstance(b, ir.Const):
                return e.args[0], a.value, b.value
        if e.fn in ("add", "sub", "mul") and e.ctype == F32:
            x, y = (self.resolve(a) for a in e.args)
            for ind, k, left in ((x, y, True), (y, x, False)):
                if not isinstance(k, ir.Const) or isinstance(k.value, bool) or not math.isfinite(float(k.value)):
                    continue
                found = self.indicator(ind)
                if found is None or any(isinstance(v, bool) for v in found[1:]):
                    continue
                c, v = found[0], np.float32(k.value)
                op = {"add": lambda a: a + v, "mul": lambda a: a * v,
                      "sub": (lambda a: a - v) if left else (lambda a: v - a)}[e.fn]
                with np.errstate(all="ignore"):  # (in f32, as the kernel computes them)
                    a, b = (float(op(np.float32(x))) for x in found[1:])
                return (c, a, b) if math.isfinite(a) and math.isfinite(b) and a != b else None
        return None

    def masked(self, e: Expr) -> Optional[_Masked]:
        """(c, depth) where e lies `depth` below the scores' own values (at least: the mask's magnitude, inf
        for -inf) wherever j > i + c (j < i + c for the far side)."""
        e = self.resolve(e)
        if isinstance(e, ir.Const):
            v = e.value
            return (ALWAYS, -float(v)) if e.ctype == F32 and v <= -MASK_DEPTH else None
        if not isinstance(e, ir.Op):
            return None
        f, args = e.fn, e.args
        if f == "select":
            cond, x, y = args
            mx, my = self.masked(x), self.masked(y)
            return _first(_masked_both(mx, my, self.sign), _masked_under(self.condition(cond), my, self.sign),
                          _masked_under(self.condition(cond, True), mx, self.sign))
        ind = self.indicator(e) if f in ("add", "sub", "mul") else None
        if ind is not None:  # a constant-built two-valued mask: as the select of its two values
            return self.masked(ir.Op("select", (ind[0], ir.Const(ind[1], F32), ir.Const(ind[2], F32)), F32))
        if f in ("add", "sub"):  # a masked operand plus (minus) one that cannot lift it back
            found = []
            for x, y, s in ((args[0], args[1], 1), (args[1], args[0], 1)) if f == "add" else ((*args, -1),):
                m = self.masked(x)
                lift = None if m is None else self.lift(y, s, m[1])
                if lift is not None and m[1] - lift > 0:
                    found.append((m[0], m[1] - lift))
            return max(found, key=lambda m: m[1], default=None)
        if f in ("fmin", "fmin_nan", "min"):  # a clamp lowers the visible scores too: -inf alone survives it
            return next((m for m in map(self.masked, args) if m is not None and m[1] == math.inf), None)
        if f in ("fmax", "fmax_nan", "max"):
            return _masked_both(self.masked(args[0]), self.masked(args[1]), self.sign)
        if f in ("round_f16", "round_bf16"):  # finite values move by up to half an ulp
            m = self.masked(args[0])
            return None if m is None else (m[0], m[1] * (1 - 2.0 ** (-9 if f == "round_bf16" else -12)))
        if f == "cast":
            return self.masked(args[0]) if e.ctype == F32 else None
        if f in ("mul", "div"):
            x, y = (self.resolve(a) for a in args)
            if f == "mul" and isinstance(x, ir.Const):
                x, y = y, x
            m = self.masked(x)
            if m is not None and isinstance(y, ir.Const) and isinstance(y.value, float) and 0 < y.value < math.inf:
                return m[0], m[1] * y.value if f == "mul" else m[1] / y.value
        return None


_Masked = tuple[Union[_Lin, _Always], float]


def _first(*ms: Optional[_Masked]) -> Optional[_Masked]:
    return next((m for m in ms if m is not None), None)


def _masked_both(a: Optional[_Masked], b: Optional[_Masked], sign: int) -> Optional[_Masked]:
    """Both masked: past both frontiers, as deep as the shallower."""
    if a is None or b is None:
        return None
    c = _both(a[0], b[0], sign)
    return None if c is None else (c, min(a[1], b[1]))


def _masked_under(cond: Frontier, m: Optional[_Masked], sign: int) -> Optional[_Masked]:
    """The masked branch of a select taken past the condition's frontier."""
    if cond is None or m is None:
        return None
    c = _both(cond, m[0], sign)
    return None if c is None else (c, m[1])


def _either(a: Frontier, b: Frontier, sign: int = 1) -> Frontier:
    """A frontier of a conjunction (either one holds): the tighter where comparable (the smaller c, or the
    larger on the far side)."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, _Always) or isinstance(b, _Always):
        return ALWAYS
    return (a if a[1] * sign <= b[1] * sign else b) if a[0] == b[0] else a


def _both(a: Frontier, b: Frontier, sign: int = 1) -> Frontier:
    """A frontier of a disjunction (both must hold): the looser, where comparable."""
    if a is None or b is None:
        return None
    if isinstance(a, _Always):
        return b
    if isinstance(b, _Always):
        return a
    return (a if a[1] * sign >= b[1] * sign else b) if a[0] == b[0] else None


class _MaskLowerer(_Lowerer):
    """The kernel lowering's evaluator over the score ops and the masks' cones, the scores a free variable."""

    def __init__(self, g: Graph, region: Region, qk_out: str):
        super().__init__(g, region, hw.for_cc(90), dict(g.sym_hints))
        self.qk_out = qk_out

    def value(self, t: str, idx: tuple[Expr, ...]) -> Expr:
        if t == self.qk_out:
            return Var("qk", F32)
        node = self.producer.get(t)
        if node is not None and node.op_type == "Slice" and node.input[1] not in self.g.constants:
            return self.value(node.input[0], self.run_time_slice(node, idx))
        return super().value(t, idx)

    def run_time_slice(self, node: onnx.NodeProto, idx: tuple[Expr, ...]) -> tuple[Expr, ...]:
        """The input element a Slice with starts computed at run time holds at `idx` (GPT-2's bias buffer
        sliced from Sk - Sq): each start (unit steps, constant axes) must be a form over dims that is never
        negative, so ORT reads from it unclamped wherever its output has the inferred length."""
        axes = self.g.constants.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        given = node.input[4] if len(node.input) > 4 else ""
        steps = self.g.constants.get(given) if given else np.ones(1, np.int64)
        if axes is None or steps is None or (np.asarray(steps) != 1).any():
            raise LoweringError(f"Slice '{node.name}': run-time starts with axes or steps that are not constant "
                                f"ones")
        out = list(idx)
        for k, a in enumerate(np.asarray(axes).reshape(-1).tolist()):
            start = self.value(node.input[1], (ir.i64(k),))
            form = _Analysis(self.defs, self.dim_forms()).linear(start)
            if form is None or form[1] < 0 or any(v < 0 for _, v in form[0]):
                raise LoweringError(f"Slice '{node.name}': a run-time start that may be negative")
            a %= len(idx)
            out[a] = ir.add(out[a], start)
        return tuple(out)

    def load(self, t: str, idx: tuple[Expr, ...]) -> Expr:
        """An element of a Shape at a constant index is that dim (a cache's length: HF's query positions); an
        element of a triangular constant is its rule (`_triangle`: a static causal mask, GPT-2's bias buffer)."""
        const = self.g.constants.get(t)
        tri = _triangle(const) if const is not None and len(idx) >= 2 else None
        if tri is not None:
            k, inside, outside = tri
            ct = ir.compute_type(_storage(self.g.tensors[t].dtype, f"constant '{t}'"))
            cond = ir.Op("le", (idx[-1], ir.add(idx[-2], ir.i64(k))), "bool")
            return ir.Op("select", (cond, ir.const(inside, ct), ir.const(outside, ct)), ct)
        i = self.g.producer.get(t)
        node = self.g.nodes[i] if i is not None else None
        if node is not None and node.op_type == "Shape" and len(idx) == 1:
            k, src = _fold(idx[0], self.defs), self.g.tensors.get(node.input[0])
            if isinstance(k, int) and not isinstance(k, bool) and src is not None and src.shape is not None:
                dims = src.shape[slice(scalar.attr(node, "start", 0), scalar.attr(node, "end", None))]
                if 0 <= k < len(dims):
                    return self.dim(dims[k])
        return super().load(t, idx)

    def dim(self, d) -> Expr:
        """Any symbolic dim: one no input binds is still a name (the analysis never runs the code)."""
        try:
            return super().dim(d)
        except LoweringError:
            self.dims[d] = 10_000 + len(self.dims)
            return Var(f"d{self.dims[d]}", I64)

    def dim_forms(self) -> dict[str, _Lin]:
        """Each dim variable as a linear form over dim names ("past_sequence + sequence" - "sequence" is
        "past_sequence")."""
        return {f"d{k}": _name_form(name) for name, k in self.dims.items()}


def _triangle(a: np.ndarray) -> Optional[tuple[int, object, object]]:
    """(k, inside, outside) where every [.., r, c] slice of constant `a` is `inside` for c <= r + k and
    `outside` elsewhere (two values, the same for every leading index), else None."""
    if a.ndim < 2 or a.size > 1 << 24 or a.shape[-1] < 2:
        return None
    rows, cols = a.shape[-2:]
    flat = a.reshape(-1, rows, cols)
    m = flat[0]
    if not (flat == m).all():
        return None
    values = np.unique(m)
    if len(values) != 2:
        return None
    for inside, outside in ((values[0], values[1]), (values[1], values[0])):
        lengths = (m == inside).sum(axis=1)
        partial = [int(n) - 1 - r for r, n in enumerate(lengths) if 0 < n < cols]
        if not partial or len(set(partial)) != 1:
            continue
        k = partial[0]
        want = np.arange(cols)[None, :] <= np.arange(rows)[:, None] + k
        if np.array_equal(m == inside, want):
            return k, inside.item(), outside.item()
    return None


def _cone(g: Graph, p: AttentionPattern) -> Optional[tuple[list[int], list[str]]]:
    """The score ops and every node computing their masks by element-wise, layout and index ops (stopping at
    graph inputs, constants and other ops, whose tensors are read as unknown values), and those tensors."""
    nodes = set(p.score_ops)
    chain = {g.nodes[p.qk].output[0], *(o for i in p.score_ops for o in g.nodes[i].output)}
    leaves: dict[str, None] = {}
    stack = [x for i in p.score_ops for _, x in ops.data_inputs(g.nodes[i]) if x not in chain]
    seen: set[str] = set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        i = g.producer.get(t)
        n = g.nodes[i] if i is not None else None
        if n is None or t in g.constants or n.domain not in ("", "ai.onnx") or \
                ops.kind_of(n.op_type) not in ("elementwise", "layout", "indexing"):
            const = g.constants.get(t)
            if const is None or const.size != 1:
                leaves[t] = None
            continue
        nodes.add(i)
        if len(nodes) > MAX_CONE:
            return None
        stack.extend(x for _, x in ops.data_inputs(n))
        if n.op_type == "Slice" and len(n.input) > 1 and n.input[1] not in g.constants:
            stack.append(n.input[1])  # starts computed at run time: their shape arithmetic (`run_time_slice`)
    return sorted(nodes), list(leaves)


def _classify(c: _Lin, sq: _Lin, sk: _Lin) -> Optional[KeyBound]:
    if not c[0]:
        return KeyBound(False, c[1])
    rest = _combine(c, _combine(sk, sq, -1), -1)
    return KeyBound(True, rest[1]) if not rest[0] else None


@per_graph
def _memo(g: Graph) -> dict[int, Optional[KeyBound]]:
    return {}


def key_bound(g: Graph, p: AttentionPattern) -> Optional[KeyBound]:
    """The causal frontier of pattern `p`'s scores, None where none is proved."""
    memo = _memo(g)
    if p.softmax not in memo:
        memo[p.softmax] = _find(g, p)
    return memo[p.softmax]


def _find(g: Graph, p: AttentionPattern) -> Optional[KeyBound]:
    if not p.score_ops:
        return None
    found = _cone(g, p)
    if found is None:
        return None
    nodes, leaves = found
    qk_out = g.nodes[p.qk].output[0]
    softmax_in = g.nodes[p.softmax].input[0]
    region = Region(-1, "pointwise", tuple(nodes), (qk_out, *leaves), (), (), Traffic(0, 0, 0))
    try:
        lw = _MaskLowerer(g, region, qk_out)
        shape = lw._shape(softmax_in)
        if len(shape) < 2:
            return None
        idx = tuple(Var(f"ax{k}", I64) for k in range(len(shape) - 2)) + (Var(ROW, I64), Var(KEY, I64))
        f = lw.func("score", idx, lambda: lw.value(softmax_in, idx))
        dims = lw.dim_forms()
        sq, sk = (_Analysis({}, dims).linear(lw.dim(d)) for d in shape[-2:])
    except (LoweringError, scalar.UnsupportedOp, ValueError, KeyError, ZeroDivisionError, IndexError):
        return None
    if sq is None or sk is None or f.result is None:
        return None
    defs = {s.var.name: s.value for s in f.body if isinstance(s, ir.Let)}
    flags = frozenset(k for k, t in enumerate(region.inputs) if t in g.graph_inputs and t not in g.constants
                      and g.tensors[t].dtype in _FLAG_TYPES and "mask" in t.lower())
    sides = []
    for sign in (1, -1):
        m = _Analysis(defs, dims, sign, flags).masked(f.result)
        ok = m is not None and not isinstance(m[0], _Always) and m[1] >= MASK_DEPTH
        sides.append(_classify(m[0], sq, sk) if ok else None)
    up, low = sides
    return None if up is None else KeyBound(up.tail, up.shift, None if low is None else (low.tail, low.shift))


__all__ = ["KeyBound", "key_bound"]

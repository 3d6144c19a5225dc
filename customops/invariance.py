"""Axes along which a tensor's value is provably constant, from the element-wise cone that computes it.

Exporters materialize attention masks per query row: transformers 5 builds BERT's padding mask as
[batch, 1, Sq, Sk] from `attention_mask[b, j]` and a `q_idx >= 0` term that is always true. An attention
kernel that knows the mask is the same for every query row reads row 0 only, so the two query rows a thread
scores share one load per key instead of one per score.

The proof lowers the cone (element-wise, layout and Range ops back to graph inputs, constants and any other
op) at a symbolic index, one variable per axis, and asks which variables the value depends on. Coordinates
are non-negative, which settles the comparisons such masks carry (`i >= 0`, `0 <= i`); `and`/`or`/`select`
with a settled operand drop the other side. Anything the cone cannot lower makes no claim."""
from __future__ import annotations

import functools
from typing import Optional

from ortfuse.customops import ir, target as hw
from ortfuse.customops.ir import I64, Expr, Var
from ortfuse.customops.lower import LoweringError, _Lowerer
from ortfuse.rewriter import iota
from ortfuse.rewriter.graph import Graph
from ortfuse.search import ops
from ortfuse.search.plan import Region, Traffic

CONE_OPS = ops.ELEMENTWISE | ops.LAYOUT | {"Range"}
MAX_CONE = 64  # nodes; a larger cone stops there (its frontier tensors count as inputs)


def invariant_axes(g: Graph, t: str, tgt: hw.Target) -> frozenset[int]:
    """Axes of `t` whose coordinate does not change its value (size-1 axes included)."""
    shape = tuple(g.tensors[t].shape or ()) if t in g.tensors else ()
    if not shape:
        return frozenset()
    ones = frozenset(a for a, d in enumerate(shape) if d == 1)
    nodes = _cone(g, t)
    if not nodes:
        return ones
    made = {o for i in nodes for o in g.nodes[i].output if o}
    inputs = sorted({x for i in nodes for _, x in ops.data_inputs(g.nodes[i]) if x not in made})
    region = Region(-1, "pointwise", tuple(sorted(nodes)), tuple(inputs), (t,), shape, Traffic(0, 0, 0))
    xs = tuple(Var(f"coord{a}", I64) for a in range(len(shape)))  # names no lowering binds
    try:
        lw = _Lowerer(g, region, tgt, dict(g.sym_hints))
        value = lw.value(t, xs)
    except (LoweringError, ValueError):
        return ones
    used = _Deps(lw.defs, {x.name for x in xs}).deps(value)
    return ones | frozenset(a for a, x in enumerate(xs) if x.name not in used)


def _cone(g: Graph, t: str) -> set[int]:
    nodes: set[int] = set()
    stack = [t]
    while stack and len(nodes) < MAX_CONE:
        i = g.producer.get(stack.pop())
        if i is None or i in nodes or not _in_cone(g, g.nodes[i]):
            continue
        nodes.add(i)
        stack.extend(x for _, x in ops.data_inputs(g.nodes[i]))
    return nodes


def _in_cone(g: Graph, node) -> bool:
    """An op the cone lowers: element-wise and layout ops, and Range iotas with constant start and step."""
    if node.op_type not in CONE_OPS or node.domain not in ("", "ai.onnx"):
        return False
    return node.op_type != "Range" or all(iota.const_int(g, x) is not None for x in (node.input[0], node.input[2]))


class _Deps:
    """Index variables an expression's value depends on, through the lowerer's bound variables. Memoized per
    expression: bound variables are shared (x * x, chains of them), which would make the walks exponential."""

    def __init__(self, defs: dict[str, Expr], coords: set[str]):
        self.defs, self.coords = defs, coords
        self.nonneg = functools.cache(self._nonneg)
        self.truth = functools.cache(self._truth)
        self.deps = functools.cache(self._deps)

    def _def(self, e: Expr) -> Optional[Expr]:
        return self.defs.get(e.name) if isinstance(e, Var) else None

    def _nonneg(self, e: Expr) -> bool:
        """e >= 0 for every index: coordinates and integer arithmetic on them, and their conversion to float
        (>= 0 or +inf; float arithmetic is left out, where inf * 0 would be NaN)."""
        if isinstance(e, ir.Const):
            return not isinstance(e.value, bool) and e.value >= 0
        if isinstance(e, Var):
            d = self._def(e)
            return e.name in self.coords if d is None else self.nonneg(d)
        if isinstance(e, ir.Op) and (e.fn == "cast" or e.ctype == I64 and e.fn in ("add", "mul", "div", "mod", "min", "max")):
            return all(self.nonneg(a) for a in e.args)
        return False

    def _truth(self, e: Expr) -> Optional[bool]:
        """The value of a bool expression where it is settled for every index, else None."""
        if isinstance(e, ir.Const):
            return bool(e.value) if e.ctype == "bool" else None
        if isinstance(e, Var):
            d = self._def(e)
            return None if d is None else self.truth(d)
        if not isinstance(e, ir.Op) or e.ctype != "bool":
            return None
        a = e.args
        at_most_zero = lambda x: isinstance(x, ir.Const) and not isinstance(x.value, bool) and x.value <= 0
        if e.fn == "ge" and self.nonneg(a[0]) and at_most_zero(a[1]) or \
                e.fn == "le" and at_most_zero(a[0]) and self.nonneg(a[1]):
            return True
        if e.fn == "lt" and self.nonneg(a[0]) and at_most_zero(a[1]) or \
                e.fn == "gt" and at_most_zero(a[0]) and self.nonneg(a[1]):
            return False
        if e.fn in ("and", "or"):
            known = [self.truth(x) for x in a]
            absorbing = e.fn == "or"  # or: any True settles it; and: any False
            if absorbing in known:
                return absorbing
            return None if None in known else not absorbing
        if e.fn == "not":
            v = self.truth(a[0])
            return None if v is None else not v
        return None

    def _deps(self, e: Expr) -> frozenset[str]:
        if isinstance(e, ir.Const) or self.truth(e) is not None:
            return frozenset()
        if isinstance(e, Var):
            d = self._def(e)
            return frozenset({e.name} & self.coords) if d is None else self.deps(d)
        if isinstance(e, ir.Load):
            return self.deps(e.offset)
        if isinstance(e, ir.Op):
            args = e.args
            if e.fn == "select":
                c = self.truth(args[0])
                if c is not None:
                    return self.deps(args[1] if c else args[2])
            elif e.fn in ("and", "or"):  # an operand that cannot change the result drops out
                args = tuple(x for x in args if self.truth(x) is not (e.fn == "and"))
            return frozenset().union(*(self.deps(x) for x in args))
        raise TypeError(f"unexpected expression {e!r}")  # Lane: the cone lowers without vector loads

"""Element-wise work: the instructions a fused kernel issues per output element for the ops it evaluates, and
the per-element branches among them, from the functions our printer emits (`target.FN_INSTRUCTIONS`,
`target.FN_BRANCHES`, counted in sm_90 SASS). The cost model charges instructions where they could outlast
an element-wise kernel's traffic, and branches in a GEMM epilogue, where they serialize the tile's elements."""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import onnx

from ortfuse.customops import ir, scalar
from ortfuse.customops.target import FN_BRANCHES, FN_INSTRUCTIONS, WINDOW_TAP_INSTRUCTIONS
from ortfuse.rewriter.graph import Dim, Graph
from ortfuse.search import ops, pool


def _ops(e: ir.Expr) -> Iterator[ir.Op]:
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, ir.Op):
            yield x
            stack.extend(x.args)


def expr_work(e: ir.Expr) -> tuple[float, float]:
    """(instructions, branches) of one evaluation of `e` (every operation counted, shared sub-trees once per
    use)."""
    fns = [op.fn for op in _ops(e)]
    return sum(FN_INSTRUCTIONS.get(f, 1.0) for f in fns), sum(FN_BRANCHES.get(f, 0.0) for f in fns)


def node_work(g: Graph, node: onnx.NodeProto) -> tuple[float, float]:
    """(instructions, branches) per output element of `node` as our kernels evaluate it (scalar.RULES, so a
    division by a constant is the multiply it lowers to, unless a step op or Cast reads the quotient: then
    IEEE division, as the lowering keeps it); ops that move data cost nothing, other ops without a rule one
    instruction."""
    if node.op_type in ops.FREE_IN_ORT or node.op_type in ops.LAYOUT:
        return 0.0, 0.0
    kernel = pool.window(g, node)
    if kernel is not None:  # a loop over the window's taps
        return WINDOW_TAP_INSTRUCTIONS * kernel[0] * kernel[1], 0.0
    if node.op_type not in scalar.RULES or not node.output or node.output[0] not in g.tensors:
        return 1.0, 0.0
    args: list = []
    for i, t in enumerate(node.input):
        info = g.tensors.get(t) if t else None
        storage = scalar.STORAGE.get(info.dtype) if info is not None else None
        if storage is None:
            args.append(None)
            continue
        ctype = ir.compute_type(storage)
        v = g.constants.get(t)
        if v is not None and np.asarray(v).size == 1:
            x = np.asarray(v).reshape(-1)[0]
            args.append(ir.Const(bool(x) if ctype == ir.BOOL else float(x) if ctype == ir.F32 else int(x), ctype))
        else:
            args.append(ir.Var(f"x{i}", ctype))
    out = scalar.STORAGE.get(g.tensors[node.output[0]].dtype)
    try:
        if node.op_type == "Div" and len(args) == 2 and None not in args and \
                any(scalar.sees_stored(g.nodes[c]) for c in g.consumers.get(node.output[0], ())):
            return expr_work(scalar.exact_div(args[0], args[1]))  # as the lowering keeps it (_Lowerer.node_value)
        return expr_work(scalar.apply(node, args, out or "f32"))
    except (scalar.UnsupportedOp, KeyError, TypeError, ValueError, IndexError):
        return 1.0, 0.0


def dim_hint(g: Graph, d: Dim) -> int:
    """A dim at its typical value: a symbolic one at its hint (128 where the graph has none)."""
    return d if isinstance(d, int) else g.sym_hints.get(d, 128)


def elements(g: Graph, t: str) -> int:
    info = g.tensors[t]
    assert info.shape is not None
    return int(np.prod([dim_hint(g, d) for d in info.shape], dtype=np.int64))


def work(g: Graph, nodes: Iterable[int]) -> tuple[float, float]:
    """(instructions, branches), thread-level, of the ops `nodes` over all their output elements."""
    ins = br = 0.0
    for i in nodes:
        n = g.nodes[i]
        if n.output and n.output[0] in g.tensors and g.tensors[n.output[0]].shape is not None:
            a, b = node_work(g, n)
            ins, br = ins + a * elements(g, n.output[0]), br + b * elements(g, n.output[0])
    return ins, br


def epilogue_per_element(g: Graph, nodes: Iterable[int], anchor: int) -> tuple[float, float]:
    """(instructions, branches) per element of the GEMM/Conv `anchor`'s output that the region `nodes`
    evaluates after it (its epilogue: the nodes its result reaches within the region; a prologue's ops run in
    the mainloop)."""
    inside = set(nodes)
    after: set[int] = set()
    stack = [anchor]
    while stack:
        for t in g.nodes[stack.pop()].output:
            for c in g.consumers.get(t, ()):
                if c in inside and c not in after:
                    after.add(c)
                    stack.append(c)
    out = g.nodes[anchor].output[0]
    if not after or out not in g.tensors or g.tensors[out].shape is None:
        return 0.0, 0.0
    ins, br = work(g, after)
    return ins / max(elements(g, out), 1), br / max(elements(g, out), 1)

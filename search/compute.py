"""Element-wise work in instructions: what a fused kernel issues per output element for the ops it
evaluates, from the functions our printer emits (`target.FN_INSTRUCTIONS`, counted in sm_90 SASS). The cost
model charges it where the math, not DRAM, binds: a GEMM epilogue, which runs after the mainloop on the
tile's few threads, and element-wise kernels with long chains (erf, sin, pow)."""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import onnx

from ortfuse.customops import ir, scalar
from ortfuse.customops.target import FN_INSTRUCTIONS
from ortfuse.rewriter.graph import Graph
from ortfuse.search import ops


def _ops(e: ir.Expr) -> Iterator[ir.Op]:
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, ir.Op):
            yield x
            stack.extend(x.args)


def expr_instructions(e: ir.Expr) -> float:
    """Instructions of one evaluation of `e` (every operation counted, shared sub-trees once per use)."""
    return sum(FN_INSTRUCTIONS.get(op.fn, 1.0) for op in _ops(e))


def node_instructions(g: Graph, node: onnx.NodeProto) -> float:
    """Per output element of `node` as our kernels evaluate it (scalar.RULES, so a division by a constant is
    the multiply it lowers to); ops that move data cost nothing, other ops without a rule one."""
    if node.op_type in ops.FREE_IN_ORT or node.op_type in ops.LAYOUT:
        return 0.0
    if node.op_type not in scalar.RULES or not node.output or node.output[0] not in g.tensors:
        return 1.0
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
        return expr_instructions(scalar.apply(node, args, out or "f32"))
    except (scalar.UnsupportedOp, KeyError, TypeError, ValueError, IndexError):
        return 1.0


def elements(g: Graph, t: str) -> int:
    info = g.tensors[t]
    assert info.shape is not None
    return int(np.prod([d if isinstance(d, int) else g.sym_hints.get(d, 128) for d in info.shape], dtype=np.int64))


def instructions(g: Graph, nodes: Iterable[int]) -> float:
    """Instructions (thread-level) the ops `nodes` issue over all their output elements."""
    total = 0.0
    for i in nodes:
        n = g.nodes[i]
        if n.output and n.output[0] in g.tensors and g.tensors[n.output[0]].shape is not None:
            total += node_instructions(g, n) * elements(g, n.output[0])
    return total


def epilogue_per_element(g: Graph, nodes: Iterable[int], anchor: int) -> float:
    """Instructions per element of the GEMM/Conv `anchor`'s output that the region `nodes` evaluates after
    it (its epilogue: the nodes its result reaches within the region; a prologue's ops run in the mainloop)."""
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
        return 0.0
    return instructions(g, after) / max(elements(g, out), 1)

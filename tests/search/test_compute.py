"""search.compute: instructions and branches per element of the ops our kernels evaluate (target.FN_INSTRUCTIONS,
target.FN_BRANCHES)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi

from ortfuse.customops.target import FN_BRANCHES, FN_INSTRUCTIONS
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import compute


def _graph(nodes, inits, dtype=TP.FLOAT16):
    return build_graph(model(nodes, [vi("x", dtype, [4, 8])], [vi(nodes[-1].output[0], dtype, None)], inits), {})


def test_ops_count_what_they_lower_to():
    h = lambda name, v: const(name, np.asarray(v, np.float16), np.float16)  # noqa: E731
    g = _graph([node("Div", ["x", "c"], ["d"]), node("Erf", ["d"], ["e"]), node("Div", ["e", "x"], ["q"]),
                node("Sigmoid", ["q"], ["s"]), node("Reshape", ["s", "shape"], ["r"]), node("Add", ["r", "c"], ["out"])],
               [h("c", 1.4142135), const("shape", [8, 4], np.int64)])
    per = [compute.node_work(g, n) for n in g.nodes]
    # a division by a constant is its reciprocal's multiply; by a tensor, IEEE division, with its branch;
    # Sigmoid is 1 / (1 + exp(-x)) through the fast reciprocal, branch-free; a Reshape moves no data
    assert per == [(1.0, 0.0), (FN_INSTRUCTIONS["erf"], 0.0), (FN_INSTRUCTIONS["div"], FN_BRANCHES["div"]),
                   (1 + 1 + FN_INSTRUCTIONS["exp"] + FN_INSTRUCTIONS["recip_fast"], 0.0), (0.0, 0.0), (1.0, 0.0)]
    ins, br = compute.work(g, range(len(g.nodes)))
    assert ins == pytest.approx(32 * sum(p[0] for p in per)) and br == 32.0


def test_the_epilogue_is_what_follows_the_gemm():
    # a Cast of A before the MatMul runs in the mainloop (per A element), not in the epilogue
    g = build_graph(model([node("Cast", ["x"], ["xh"], to=TP.FLOAT16), node("MatMul", ["xh", "w"], ["y"]),
                           node("Tanh", ["y"], ["t"]), node("Mul", ["t", "y"], ["out"])],
                          [vi("x", TP.FLOAT, [16, 32])], [vi("out", TP.FLOAT16, None)],
                          [const("w", np.ones((32, 64), np.float16), np.float16)]), {})
    assert compute.epilogue_per_element(g, range(4), 1) == pytest.approx((FN_INSTRUCTIONS["tanh"] + 1, 0.0))
    assert compute.epilogue_per_element(g, [0, 1], 1) == (0.0, 0.0)


def test_a_division_a_step_op_reads_stays_a_division():
    # Floor(x / c) must see the IEEE quotient (a reciprocal may move it across an integer): the lowering keeps
    # the division there, and the count charges it with its branch
    h = lambda name, v: const(name, np.asarray(v, np.float32), np.float32)  # noqa: E731
    g = _graph([node("Div", ["x", "c"], ["d"]), node("Floor", ["d"], ["out"])], [h("c", 3.0)], TP.FLOAT)
    assert compute.node_work(g, g.nodes[0]) == (FN_INSTRUCTIONS["div"], FN_BRANCHES["div"])

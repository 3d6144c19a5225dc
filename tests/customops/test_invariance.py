"""customops.invariance: which axes of a tensor its element-wise cone leaves it constant along."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse.customops import target as hw
from ortfuse.customops.invariance import invariant_axes
from ortfuse.rewriter.shapes import build_graph

TGT = hw.for_cc(90)


def _axes(cond_nodes, extra_inits=(), inputs=None) -> frozenset[int]:
    nodes = [node("Shape", ["km"], ["kms"]), node("Gather", ["kms", "one"], ["s"], axis=0),
             node("Range", ["zero", "s", "one"], ["iq"]), node("Unsqueeze", ["iq", "ax"], ["q4"]),  # [1, 1, S, 1]
             node("Cast", ["km"], ["kb"], to=TP.BOOL), node("Unsqueeze", ["kb", "ax12"], ["kb4"]),  # [B, 1, 1, S]
             *cond_nodes, node("Where", ["cond", "zf", "low"], ["mask"])]
    inits = [const("zero", 0, np.int64), const("one", 1, np.int64), const("ax", [0, 1, 3], np.int64),
             const("ax12", [1, 2], np.int64), const("zf", 0.0), const("low", -3.0e38), *extra_inits]
    ins = [vi("km", TP.INT64, ["batch", "seq"]), *(inputs or [])]
    g = build_graph(model(nodes, ins, [vi("mask", TP.FLOAT, None)], inits))
    return invariant_axes(g, "mask", TGT)


@pytest.mark.parametrize("cmp,axes", [
    ("GreaterOrEqual", {1, 2}),  # i >= 0: true for every coordinate, so the padding mask is the same per row
    ("Less", {0, 1, 2, 3}),  # i < 0: false everywhere, so the And is false and the mask one constant
    ("LessOrEqual", {1}), ("Greater", {1})])  # i <= 0, i > 0: vary with the row
def test_padding_mask_built_per_query_row(cmp, axes):
    assert _axes([node(cmp, ["q4", "zero"], ["qc"]), node("And", ["qc", "kb4"], ["cond"])]) == axes


def test_causal_mask_depends_on_the_row():
    nodes = [node("Unsqueeze", ["iq", "ax012"], ["k4"]), node("LessOrEqual", ["k4", "q4"], ["qc"]),
             node("And", ["qc", "kb4"], ["cond"])]
    assert _axes(nodes, [const("ax012", [0, 1, 2], np.int64)]) == {1}


def test_a_row_dependent_input_is_read_per_row():
    # the condition also reads a [B, 1, S, S] input: nothing but its size-1 axis is proven
    nodes = [node("GreaterOrEqual", ["q4", "zero"], ["qc"]), node("And", ["qc", "kb4"], ["c1"]),
             node("And", ["c1", "full"], ["cond"])]
    assert _axes(nodes, inputs=[vi("full", TP.BOOL, ["batch", 1, "seq", "seq"])]) == {1}


def test_or_with_a_settled_true_operand_is_constant():
    # (i >= 0) or anything is true everywhere: the Where picks 0 for every element
    assert _axes([node("GreaterOrEqual", ["q4", "zero"], ["qc"]), node("Or", ["qc", "kb4"], ["cond"])]) == {0, 1, 2, 3}


def test_a_range_with_a_runtime_step_is_an_input_of_the_cone():
    # Range(0, S, step) with `step` a graph input: not an iota the cone computes, so the mask is read as it is
    nodes = [node("Shape", ["km"], ["kms"]), node("Gather", ["kms", "one"], ["s"], axis=0),
             node("Range", ["zero", "s", "step"], ["iq"]), node("Unsqueeze", ["iq", "ax"], ["q4"]),
             node("Cast", ["km"], ["kb"], to=TP.BOOL), node("Unsqueeze", ["kb", "ax12"], ["kb4"]),
             node("GreaterOrEqual", ["q4", "zero"], ["qc"]), node("And", ["qc", "kb4"], ["cond"]),
             node("Where", ["cond", "zf", "low"], ["mask"])]
    inits = [const("zero", 0, np.int64), const("one", 1, np.int64), const("ax", [0, 1, 3], np.int64),
             const("ax12", [1, 2], np.int64), const("zf", 0.0), const("low", -3.0e38)]
    ins = [vi("km", TP.INT64, ["batch", "seq"]), vi("step", TP.INT64, [])]
    g = build_graph(model(nodes, ins, [vi("mask", TP.FLOAT, None)], inits))
    assert invariant_axes(g, "mask", TGT) == {1}


def test_float_arithmetic_on_coordinates_settles_nothing():
    # float(i) >= 0 holds, but float(i) * c >= 0 is not claimed: float products can be NaN (inf * 0)
    cast = [node("Cast", ["q4"], ["qf"], to=TP.FLOAT)]
    assert _axes([*cast, node("GreaterOrEqual", ["qf", "zf"], ["qc"]), node("And", ["qc", "kb4"], ["cond"])]) == {1, 2}
    scaled = [*cast, node("Mul", ["qf", "two"], ["q2"]), node("GreaterOrEqual", ["q2", "zf"], ["qc"]),
              node("And", ["qc", "kb4"], ["cond"])]
    assert _axes(scaled, [const("two", 2.0)]) == {1}


def test_shared_subexpressions_are_walked_once():
    # 60 squarings of the row coordinate: each value read twice by the next, 2^60 paths through the cone
    nodes = [node("Cast", ["q4"], ["f0"], to=TP.FLOAT)]
    nodes += [node("Mul", [f"f{i}", f"f{i}"], [f"f{i + 1}"]) for i in range(60)]
    nodes += [node("GreaterOrEqual", ["f60", "zf"], ["qc"]), node("And", ["qc", "kb4"], ["cond"])]
    assert _axes(nodes) == {1}

"""Run-time Reshape targets (Shape/Gather/Concat chains) become constants where shapes determine them."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse.rewriter.canonical import _static_target, fold_runtime_shapes
from ortfuse.rewriter.shapes import build_graph


def _exporter_style_split_heads():
    nodes = [node("Shape", ["x"], ["s"]), node("Gather", ["s", "i0"], ["b"], axis=0),
             node("Gather", ["s", "i1"], ["n"], axis=0), node("Unsqueeze", ["b", "ax"], ["b1"]),
             node("Unsqueeze", ["n", "ax"], ["n1"]), node("Concat", ["b1", "n1", "heads", "dh"], ["shp"], axis=0),
             node("Add", ["x", "bias"], ["xb"]), node("Reshape", ["xb", "shp"], ["r"]),
             node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3])]
    inits = [const("i0", 0, np.int64), const("i1", 1, np.int64), const("ax", [0], np.int64),
             const("heads", [4], np.int64), const("dh", [8], np.int64), const("bias", np.arange(32) / 32)]
    return model(nodes, [vi("x", TP.FLOAT, ["batch", "seq", 32])], [vi("y", TP.FLOAT, ["batch", 4, "seq", 8])], inits)


def test_static_target():
    assert _static_target(("b", "s", 32), ("b", "s", 4, 8)) == [0, 0, 4, 8]
    assert _static_target(("b", "s", 32), ("b*s", 32)) == [-1, 32]
    assert _static_target(("b", "s", 32), ("s", "b", 32)) is None  # two unknowns


def test_fold_keeps_the_function_and_drops_shape_ops():
    m = _exporter_style_split_heads()
    g = build_graph(m, {})
    g2, n = fold_runtime_shapes(g)
    assert n == 1
    assert {x.op_type for x in g2.nodes} == {"Add", "Reshape", "Transpose"}
    x = np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32)
    run = lambda mm: ort.InferenceSession(mm.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_array_equal(run(m), run(g2.model))
    assert g.model.graph.node[0].op_type == "Shape"  # the input graph is untouched

"""Small models built with onnx.helper for the rewriter tests (imported as a plain module: pytest puts
this folder on sys.path)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR = 8


def make_model(nodes, inputs, outputs, initializers=(), opset=OPSET, **kw) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers), **kw)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = IR
    return model


def vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def mlp() -> onnx.ModelProto:
    """x[batch,4] -> MatMul(w) -> Add(b) -> Mul(0.5 from a Constant node) -> Relu -> y; also z = Exp(h)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")
    nodes = [
        helper.make_node("Constant", [], ["half"], name="c_half", value_float=0.5),
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "b"], ["h"], name="add"),
        helper.make_node("Mul", ["h", "half"], ["s"], name="mul"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
        helper.make_node("Exp", ["h"], ["z"], name="exp"),
    ]
    return make_model(nodes, [vi("x", ["batch", 4])], [vi("y", ["batch", 3]), vi("z", ["batch", 3])], [w, b])


def exporter_reshape() -> onnx.ModelProto:
    """The exporter idiom: Reshape target built from Shape -> Gather -> Unsqueeze -> Concat."""
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, dtype=np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], name="shape"),
        helper.make_node("Gather", ["shp", "i0"], ["d0"], name="g0", axis=0),
        helper.make_node("Gather", ["shp", "i1"], ["d1"], name="g1", axis=0),
        helper.make_node("Unsqueeze", ["d0", "ax0"], ["u0"], name="u0"),
        helper.make_node("Unsqueeze", ["d1", "ax0"], ["u1"], name="u1"),
        helper.make_node("Concat", ["u0", "u1", "heads"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["y"], name="transpose", perm=[0, 2, 1, 3]),
    ]
    inits = [i64("i0", 0), i64("i1", 1), i64("ax0", [0]), i64("heads", [2, 4])]
    return make_model(nodes, [vi("x", ["batch_size", "sequence_length", 8])], [vi("y", [None] * 4)], inits)


def broadcast() -> onnx.ModelProto:
    """a[batch, seq, 8] + bias[8], times mask[batch, 1, 1]; output shape left undeclared."""
    bias = numpy_helper.from_array(np.arange(8, dtype=np.float32), "bias")
    nodes = [
        helper.make_node("Add", ["a", "bias"], ["t"], name="add"),
        helper.make_node("Mul", ["t", "mask"], ["y"], name="mul"),
    ]
    inputs = [vi("a", ["batch", "seq", 8]), vi("mask", ["batch", 1, 1])]
    return make_model(nodes, inputs, [vi("y", [None] * 3)], [bias])


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

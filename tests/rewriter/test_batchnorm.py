"""Inference BatchNormalization: folded into the Conv only it reads, else a per-channel scale and shift;
the function is unchanged (ORT on the rewritten graph against ORT on the original), and the result fuses."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from helpers import const, fused_parity, model, node, vi
from ortfuse.rewriter.batchnorm import fold_batchnorms
from ortfuse.rewriter.shapes import build_graph

C = 6


def _bn_params(prefix: str, np_dt, seed: int = 1) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    return [const(f"{prefix}s", rng.uniform(0.5, 1.5, C), np_dt), const(f"{prefix}b", rng.standard_normal(C) * 0.3, np_dt),
            const(f"{prefix}m", rng.standard_normal(C) * 0.3, np_dt), const(f"{prefix}v", rng.uniform(0.2, 2.0, C), np_dt)]


def _bn(x: str, y: str, prefix: str = "bn", **attrs) -> onnx.NodeProto:
    return node("BatchNormalization", [x, f"{prefix}s", f"{prefix}b", f"{prefix}m", f"{prefix}v"], [y],
                epsilon=1e-3, **attrs)


def _conv_bn(dtype=TP.FLOAT, conv_bias: bool = True, act: str = "Sigmoid") -> onnx.ModelProto:
    """x -> Conv 3x3 -> BatchNormalization -> act; and Add(x, x) -> BatchNormalization -> act (not after a Conv)."""
    np_dt = np.float16 if dtype == TP.FLOAT16 else np.float32
    rng = np.random.default_rng(0)
    inits = [const("w", rng.standard_normal((C, C, 3, 3)) * 0.2, np_dt), *_bn_params("bn", np_dt),
             *_bn_params("p", np_dt, 2)] + ([const("cb", rng.standard_normal(C) * 0.1, np_dt)] if conv_bias else [])
    nodes = [node("Conv", ["x", "w", "cb"] if conv_bias else ["x", "w"], ["c"], pads=[1, 1, 1, 1]), _bn("c", "n"),
             node(act, ["n"], ["y"]), node("Add", ["x", "x"], ["a"]), _bn("a", "m", "p"), node(act, ["m"], ["z"])]
    return model(nodes, [vi("x", dtype, ["batch", C, 8, 8])], [vi("y", dtype, None), vi("z", dtype, None)], inits)


def _run(m: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("conv_bias", [True, False])
def test_batchnorm_folds_into_its_conv_or_becomes_scale_and_shift(conv_bias):
    m = _conv_bn(conv_bias=conv_bias)
    g = build_graph(m, {})
    g2, n = fold_batchnorms(g)
    assert n == 2
    assert [x.op_type for x in g2.nodes] == ["Conv", "Sigmoid", "Add", "Mul", "Add", "Sigmoid"]
    assert g2.nodes[0].output[0] == "n" and len(g2.nodes[0].input) == 3
    assert "w" not in {t.name for t in g2.model.graph.initializer}  # the unfolded weight is dropped
    x = np.random.default_rng(5).standard_normal((2, C, 8, 8)).astype(np.float32)
    for want, got in zip(_run(m, x), _run(g2.model, x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert [x.op_type for x in g.nodes].count("BatchNormalization") == 2  # the input graph is untouched


def test_batchnorm_left_alone_when_not_a_constant_affine_map():
    rng = np.random.default_rng(0)
    params = _bn_params("bn", np.float32)
    # the Conv's output is read twice: not folded, but still a scale and shift
    shared = model([node("Conv", ["x", "w"], ["c"]), _bn("c", "y"), node("Relu", ["c"], ["z"])],
                   [vi("x", TP.FLOAT, [1, C, 4, 4])], [vi("y", TP.FLOAT, None), vi("z", TP.FLOAT, None)],
                   [const("w", rng.standard_normal((C, C, 1, 1)), np.float32), *params])
    g, n = fold_batchnorms(build_graph(shared, {}))
    assert n == 1 and [x.op_type for x in g.nodes] == ["Conv", "Mul", "Add", "Relu"]
    # scale computed at run time; training mode (its running statistics are outputs): unchanged
    runtime = model([node("Relu", ["s"], ["s2"]),
                     node("BatchNormalization", ["x", "s2", "bnb", "bnm", "bnv"], ["y"])],
                    [vi("x", TP.FLOAT, [1, C, 4, 4]), vi("s", TP.FLOAT, [C])], [vi("y", TP.FLOAT, None)], params[1:])
    stats = model([node("BatchNormalization", ["x", "bns", "bnb", "bnm", "bnv"], ["y", "rm", "rv"], training_mode=1)],
                  [vi("x", TP.FLOAT, [1, C, 4, 4])], [vi("y", TP.FLOAT, None), vi("rm", TP.FLOAT, None),
                                                      vi("rv", TP.FLOAT, None)], params)
    for m in (runtime, stats):
        g = build_graph(m, {})
        assert fold_batchnorms(g) == (g, 0)


@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
def test_conv_batchnorm_activation_fuses_and_matches_ort(dtype):
    """Conv + folded BatchNormalization + Sigmoid is one GEMM kernel; Add + scale/shift + Sigmoid one
    element-wise kernel; both checked in emulation against ORT on the model with BatchNormalization."""
    shapes = {"x": ("batch", C, 8, 8)}
    fused_parity(_conv_bn(dtype), shapes, {"x": (2, C, 8, 8)}, ["gemm", "pointwise"])

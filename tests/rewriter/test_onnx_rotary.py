"""rewriter.onnx_rotary: ONNX's RotaryEmbedding (opset 23) written as transformers' rotate_half ops, computing
what ORT's kernel computes (and ONNX's reference where ORT refuses the caches torch's exporter writes)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP, helper
from onnx.reference import ReferenceEvaluator

from helpers import onnx_rotary
from ortfuse.rewriter import build_graph, load_model
from ortfuse.rewriter.contrib import restore, split_contrib_ops

FORMS = [("", 0), ("", 8), ("positions", 0), ("positions", 6), ("3d", 0), ("3d", 8), ("3d positions", 0)]


def _run(m: onnx.ModelProto, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _feeds(m: onnx.ModelProto, b: int = 2, s: int = 5) -> dict:
    rng = np.random.default_rng(1)
    out = {}
    for v in m.graph.input:
        dims = [{"batch": b, "seq": s}.get(d.dim_param, d.dim_value) for d in v.type.tensor_type.shape.dim]
        np_t = helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
        out[v.name] = rng.integers(0, 32, dims).astype(np_t) if v.name == "pos" else \
            rng.standard_normal(dims).astype(np_t)
    return out


@pytest.mark.parametrize("form,rot", FORMS)
@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16], ids=["fp32", "fp16"])
def test_split_computes_what_orts_kernel_computes(form, rot, dt):
    m = onnx_rotary(dt, form, rot=rot)
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    assert len(splits) == 1 and "RotaryEmbedding" not in {n.op_type for n in split.model.graph.node}
    feeds = _feeds(m)
    tol = 1e-5 if dt == TP.FLOAT else 4e-3
    np.testing.assert_allclose(_run(split.model, feeds).astype(np.float32), _run(m, feeds).astype(np.float32),
                               rtol=tol, atol=tol)


def test_caches_of_batch_one_broadcast_as_in_onnxs_function():
    # torch's exporter writes cos and sin [1, S, R/2]; ORT's kernel refuses them for batch 2, ONNX's
    # reference (its function) broadcasts them: so do the split ops
    m = onnx_rotary(TP.FLOAT, "b1", rot=8)
    feeds = _feeds(m)
    with pytest.raises(Exception, match="cos_cache"):
        _run(m, feeds)
    split, _ = split_contrib_ops(build_graph(load_model(m)))
    want = ReferenceEvaluator(m).run(None, feeds)[0]
    np.testing.assert_allclose(_run(split.model, feeds), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_run(split.model, _feeds(m, b=1)), _run(m, _feeds(m, b=1)), rtol=1e-5, atol=1e-5)


def test_restore_and_refusals():
    m = onnx_rotary(TP.FLOAT, "3d", rot=8)
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    out = onnx.ModelProto()
    out.CopyFrom(split.model)
    assert len(restore(out, splits)) == 1
    assert [(n.op_type, list(n.input)) for n in out.graph.node] == [(n.op_type, list(n.input)) for n in m.graph.node]
    interleaved = onnx_rotary(TP.FLOAT)
    interleaved.graph.node[0].attribute.append(helper.make_attribute("interleaved", 1))
    symbolic = onnx_rotary(TP.FLOAT)
    symbolic.graph.input[0].type.tensor_type.shape.dim[3].dim_param = "head"
    odd = onnx_rotary(TP.FLOAT, rot=6)
    odd.graph.input[1].type.tensor_type.shape.dim[2].dim_value = 4  # (caches not R/2 wide)
    for label, bad in (("interleaved", interleaved), ("symbolic head", symbolic), ("cache width", odd)):
        _, splits = split_contrib_ops(build_graph(load_model(bad)))
        assert not splits, label


def test_caches_computed_alike_are_prepared_once():
    # torch's exporter computes cos and sin again for every RotaryEmbedding: the split prepares one full-width
    # cache for all that compute the same (here Cos and Sin of one angle tensor, twice each)
    dt = TP.FLOAT
    nodes = [helper.make_node(op, ["theta"], [f"{op.lower()}{k}"]) for k in (1, 2) for op in ("Cos", "Sin")]
    nodes += [helper.make_node("RotaryEmbedding", [x, f"cos{k}", f"sin{k}"], [f"y{k}"], name=f"rope{k}")
              for k, x in ((1, "x1"), (2, "x2"))]
    shape = ["batch", 3, "seq", 16]
    m = helper.make_model(helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info(x, dt, shape) for x in ("x1", "x2")] +
        [helper.make_tensor_value_info("theta", dt, ["batch", "seq", 8])],
        [helper.make_tensor_value_info(y, dt, shape) for y in ("y1", "y2")]),
        opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    assert len(splits) == 2
    doubled = [n for n in split.model.graph.node if n.op_type == "Concat" and n.input[0] == n.input[1]]
    assert [n.input[0] for n in doubled] == ["cos1", "sin1"]
    made = {o for n in split.model.graph.node for o in n.output}
    assert not {"cos2", "sin2"} & made  # (nothing reads them now: they go, not left for ORT to run)
    feeds = _feeds(m)
    for a, b in zip(_run_all(split.model, feeds), _run_all(m, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    out = onnx.ModelProto()  # where nothing fused them both go back, the second reading cos1 and sin1
    out.CopyFrom(split.model)
    assert len(restore(out, splits)) == 2
    assert sorted(list(n.input) for n in out.graph.node if n.op_type == "RotaryEmbedding") == \
        [["x1", "cos1", "sin1"], ["x2", "cos1", "sin1"]]
    for a, b in zip(_run_all(out, feeds), _run_all(m, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _run_all(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)

"""GEMM weights padded to 16-byte rows: the padded GEMM + Slice computes what the GEMM did, only where the
rows were misaligned, and the cost model pads only where the library's misaligned kernels cost more than the
Slice's copy."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse.customops.target import for_cc
from ortfuse.report import markdown
from ortfuse.rewriter.gemm_padding import candidate, pad_unaligned_gemms, padded_width
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.cost import CostModel

NP = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}


def _w(shape, dt, seed=1):
    return (np.random.default_rng(seed).standard_normal(shape) * 0.2).astype(NP[dt])


def lm_head(dt=TP.FLOAT16, k=64, n=1001):
    """LayerNorm + MatMul on a constant [K, N] weight to logits of a graph output (GPT-2's last two ops)."""
    return model([node("LayerNormalization", ["x", "g", "b"], ["h"], axis=-1, epsilon=1e-5),
                  node("MatMul", ["h", "w"], ["logits"])],
                 [vi("x", dt, ["batch", "seq", k])], [vi("logits", dt, ["batch", "seq", n])],
                 [const("g", _w(k, dt, 2) + 1, NP[dt]), const("b", _w(k, dt, 3), NP[dt]),
                  const("w", _w((k, n), dt), NP[dt])])


def gemm_head(trans_b: int, bias_shape, dt=TP.FLOAT, k=32, n=37):
    w = _w((n, k) if trans_b else (k, n), dt)
    return model([node("Gemm", ["x", "w", "c"], ["y"], transB=trans_b, alpha=0.5, beta=2.0)],
                 [vi("x", dt, ["batch", k])], [vi("y", dt, ["batch", n])],
                 [const("w", w, NP[dt]), const("c", _w(bias_shape, dt, 4), NP[dt])])


def _run(m: onnx.ModelProto, feeds) -> np.ndarray:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_padded_width():
    assert padded_width(50257, TP.FLOAT16) == 50264
    assert padded_width(50257, TP.FLOAT) == 50260
    assert padded_width(768, TP.FLOAT16) == 768


@pytest.mark.parametrize("dt", [TP.FLOAT16, TP.FLOAT])
def test_padded_lm_head_gives_the_same_logits(dt):
    m = lm_head(dt)
    g = build_graph(m, {})
    i = next(i for i, n in enumerate(g.nodes) if n.op_type == "MatMul")
    assert candidate(g, i) == padded_width(1001, dt)
    before = m.SerializeToString()
    out, count = pad_unaligned_gemms(g, lambda *_: True)
    assert count == 1 and m.SerializeToString() == before  # the input model is untouched
    ops = [n.op_type for n in out.nodes]
    assert ops == ["LayerNormalization", "MatMul", "Slice"]
    w = out.constants[out.nodes[1].input[1]]
    assert w.shape == (64, padded_width(1001, dt)) and not w[:, 1001:].any()
    assert out.tensors["logits"].shape == ("batch", "seq", 1001)
    assert "w" not in {t.name for t in out.model.graph.initializer}  # the unpadded weight had no other reader
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 5, 64)).astype(NP[dt])}
    np.testing.assert_array_equal(_run(out.model, feeds), _run(m, feeds))


@pytest.mark.parametrize("trans_b,bias_shape", [(0, (37,)), (1, (37,)), (1, (1, 37)), (0, (1,)), (1, ())])
def test_padded_gemm_with_bias(trans_b, bias_shape):
    m = gemm_head(trans_b, bias_shape)
    out, count = pad_unaligned_gemms(build_graph(m, {}), lambda *_: True)
    assert count == 1 and [n.op_type for n in out.nodes] == ["Gemm", "Slice"]
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)}
    np.testing.assert_allclose(_run(out.model, feeds), _run(m, feeds), rtol=1e-6, atol=1e-6)


def test_what_is_left_alone():
    aligned = lm_head(n=1024)
    g = build_graph(aligned, {})
    assert candidate(g, 1) is None
    # a weight computed at run time, a Gemm whose C is per row, transA
    runtime_w = model([node("MatMul", ["x", "w"], ["y"])], [vi("x", TP.FLOAT, [4, 8]), vi("w", TP.FLOAT, [8, 5])],
                      [vi("y", TP.FLOAT, [4, 5])])
    assert candidate(build_graph(runtime_w, {}), 0) is None
    per_row = gemm_head(0, (4, 37))
    assert candidate(build_graph(per_row, {"x": [4, 32]}), 0) is None
    trans_a = model([node("Gemm", ["x", "w"], ["y"], transA=1)], [vi("x", TP.FLOAT, [8, 4])],
                    [vi("y", TP.FLOAT, [4, 5])], [const("w", _w((8, 5), TP.FLOAT))])
    assert candidate(build_graph(trans_a, {}), 0) is None
    out, count = pad_unaligned_gemms(build_graph(lm_head(), {}), lambda *_: False)
    assert count == 0


def test_a_shared_weight_stays_for_its_other_readers():
    m = lm_head()
    m.graph.node.append(node("Gather", ["w", "idx"], ["row"], axis=0))
    m.graph.initializer.append(const("idx", [0, 3], np.int64))
    m.graph.output.append(vi("row", TP.FLOAT16, [2, 1001]))
    out, count = pad_unaligned_gemms(build_graph(m, {}), lambda *_: True)
    assert count == 1 and "w" in out.constants and out.nodes[-1].input[0] == "w"


def test_cost_model_pads_large_misaligned_gemms_on_sm90_only():
    def pays(cc: int, k: int, n: int) -> bool:
        g = build_graph(lm_head(k=k, n=n), {})
        return CostModel(for_cc(cc)).padding_pays(g, 1, padded_width(n, TP.FLOAT16))

    assert pays(90, 768, 50257)  # GPT-2's LM head
    assert not pays(90, 64, 3)  # a classifier head: the Slice's launch costs more than the library loses
    assert not pays(80, 768, 50257)  # no misaligned slowdown observed there: never padded


def test_optimize_pads_the_lm_head_and_keeps_the_logits():
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options

    m = lm_head(k=256, n=8001)
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    ops = [n.op_type for n in res.model.graph.node]
    assert "Slice" in ops and "MatMul" in ops
    mm = next(n for n in res.model.graph.node if n.op_type == "MatMul")
    w = next(t for t in res.model.graph.initializer if t.name == mm.input[1])
    assert list(w.dims) == [256, 8008]
    rep = check_models(m, res.model, emulate=True, input_shapes={"x": (2, 7, 256)})
    assert rep.ok, "\n".join(rep.lines())


def _head_with_epilogue():
    """The LM head with a bias + Tanh epilogue on its 8001 (misaligned) columns."""
    m = lm_head(k=256, n=8001)
    m.graph.node[-1].output[0] = "y"
    m.graph.node.extend([node("Add", ["y", "bias"], ["z"]), node("Tanh", ["z"], ["logits"])])
    m.graph.initializer.append(const("bias", _w(8001, TP.FLOAT16, 5), np.float16))
    return m


def test_a_gemm_the_search_fuses_is_not_padded():
    # our GEMM stages its misaligned rows through shared memory (Target.staged_store_factor), so the search
    # fuses the bias + Tanh into it and the weight stays unpadded: no Slice, no padded copy
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    m = _head_with_epilogue()
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    assert [(r.kind, [res.graph.nodes[i].op_type for i in r.nodes]) for r in res.plan.regions] == [
        ("gemm", ["MatMul", "Add", "Tanh"])]
    assert "Slice" not in [n.op_type for n in res.model.graph.node]
    assert ("kStageOut", res.kernels[0].spec.block // 32) in res.kernels[0].spec.kernel.ops_consts
    assert "stores staged through shared memory" in markdown(res, "lm_head")  # the report says so
    rep = check_models(m, res.model, emulate=True, input_shapes={"x": (2, 3, 256)})
    assert rep.ok, "\n".join(rep.lines())


def test_an_epilogue_on_misaligned_rows_reads_the_padded_gemm_through_its_slice(monkeypatch):
    # where our stores to misaligned rows cost what the H100 measured for the fragments' scalar stores (5.7x),
    # the GEMM goes to cuBLAS on the padded weight and the Slice joins the bias + Tanh in one kernel of ours:
    # no extra copy
    import dataclasses

    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    from ortfuse.customops import target
    h100 = target.TABLE[90]
    monkeypatch.setitem(target.TABLE, 90, dataclasses.replace(h100, staged_store_factor=h100.unaligned_store_factor))
    m = _head_with_epilogue()
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    assert [(r.kind, [res.graph.nodes[i].op_type for i in r.nodes]) for r in res.plan.regions] == [
        ("pointwise", ["Slice", "Add", "Tanh"])]
    assert [n.op_type for n in res.model.graph.node if n.domain != "ortfuse"] == ["LayerNormalization", "MatMul"]
    w = next(i for i in res.model.graph.initializer if i.name == res.model.graph.node[1].input[1])
    assert list(w.dims) == [256, 8008]
    rep = check_models(m, res.model, emulate=True, input_shapes={"x": (2, 3, 256)})
    assert rep.ok, "\n".join(rep.lines())


def test_a_gemm_a_quantizer_reads_is_not_padded():
    # cuBLAS may sum the padded GEMM in another order than the GEMM of the input, and an ulp moves the quantized
    # logits a step: a GEMM whose values a QuantizeLinear reads stays as it is (without the Q it is padded)
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    m = lm_head(TP.FLOAT, k=256, n=8001)
    m.graph.node[-1].output[0] = "y"
    m.graph.node.append(node("QuantizeLinear", ["y", "s"], ["logits"]))
    m.graph.initializer.append(const("s", np.array(0.05, np.float32), np.float32))
    m.graph.output[0].type.tensor_type.elem_type = TP.UINT8
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    assert [n.op_type for n in res.model.graph.node] == ["LayerNormalization", "MatMul", "QuantizeLinear"]
    mm = next(n for n in res.model.graph.node if n.op_type == "MatMul")
    assert list(next(t for t in res.model.graph.initializer if t.name == mm.input[1]).dims) == [256, 8001]

"""rewriter.onnx_attention: ONNX's Attention (opset 23) written as standard ops computing what ORT's own kernel
computes (measured here against ORT 1.31's CPU kernel), put back where nothing fused it, and left alone where
the function would change."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP, helper

from helpers import onnx_attention, vi
from ortfuse.rewriter import build_graph, load_model
from ortfuse.rewriter.contrib import restore, split_contrib_ops

FORMS = ["", "bool", "float", "static causal", "static bool causal", "static float causal", "past",
         "static past causal", "static bool past causal", "static cross causal", "gqa", "static gqa past causal",
         "3d", "3d gqa past float", "static 3d gqa past causal float", "scale", "cap bool",
         "static cap float causal scale", "static decode past causal", "static decode past causal bool",
         "causal", "bool causal", "float causal", "cross causal", "3d gqa causal", "cap causal scale"]
TOL = {TP.FLOAT: 1e-5, TP.FLOAT16: 4e-3}


def _run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(m: onnx.ModelProto, b: int = 2, s: int = 5, past: int = 3, kv: int = 7, seed: int = 0) -> dict:
    """Random inputs; a mask hides about a third of the keys, and for batch 1 every key of query row 2
    (bool False; float: -inf, or its type's lowest value in row 3)."""
    rng = np.random.default_rng(seed)
    sizes = {"batch": b, "seq": s, "past": past, "kv": kv, "past + seq": past + s, "total": s}
    feeds = {}
    for v in m.graph.input:
        shape = [sizes[d.dim_param] if d.dim_param else d.dim_value for d in v.type.tensor_type.shape.dim]
        dt = v.type.tensor_type.elem_type
        if dt == TP.BOOL:
            a = rng.random(shape) > 0.3
            a[..., 0] = True
            if shape[-2] > 3:
                a[1, :, 2] = False
        elif v.name == "m":
            a = np.where(rng.random(shape) > 0.3, rng.standard_normal(shape), -np.inf)
            a[..., 0] = 0.5
            np_t = helper.tensor_dtype_to_np_dtype(dt)
            if shape[-2] > 3:
                a[1, :, 2], a[1, :, 3] = -np.inf, np.finfo(np_t).min
        else:
            a = rng.standard_normal(shape)
        feeds[v.name] = a.astype(helper.tensor_dtype_to_np_dtype(dt))
    return feeds


def _model(form: str, dt: int) -> onnx.ModelProto:
    gqa = "gqa" in form
    return onnx_attention(dt, form, heads=4, kv_heads=2 if gqa else 4)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16], ids=["fp32", "fp16"])
def test_split_computes_what_orts_kernel_computes(form, dt):
    m = _model(form, dt)
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    assert len(splits) == 1
    ops = {n.op_type for n in split.model.graph.node}
    assert "Attention" not in ops and "Softmax" in ops
    feeds = _feeds(m)
    want, got = _run(m, feeds), _run(split.model, feeds)
    for a, b, name in zip(want, got, [o.name for o in m.graph.output]):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=TOL[dt], atol=TOL[dt],
                                   err_msg=f"{form}: {name}")
    if ("bool" in form or "float" in form) and "decode" not in form:  # the rows that see no key: 0, as in ORT
        assert not np.isnan(got[0]).any()
        row = got[0][1, :, 2] if "3d" not in form else got[0][1, 2]
        assert np.all(row == 0)


def test_a_row_whose_float_mask_is_the_lowest_value_gives_zero_as_in_ort():
    m = _model("float", TP.FLOAT)
    feeds = _feeds(m)
    feeds["m"][1, :, 3] = np.finfo(np.float32).min  # (every key: ORT gives 0, plain Softmax the mean of V)
    want = _run(m, feeds)[0]
    assert np.all(want[1, :, 3] == 0)
    split, _ = split_contrib_ops(build_graph(load_model(m)))
    np.testing.assert_allclose(_run(split.model, feeds)[0], want, rtol=1e-5, atol=1e-5)


def test_restore_puts_back_the_attention_nothing_fused():
    for form in ("static bool past causal", "3d gqa past float", "cap bool", "bool causal", "causal"):
        m = _model(form, TP.FLOAT)
        split, splits = split_contrib_ops(build_graph(load_model(m)))
        out = onnx.ModelProto()
        out.CopyFrom(split.model)
        assert len(restore(out, splits)) == 1, form
        assert [(n.op_type, list(n.input), list(n.output)) for n in out.graph.node] == \
            [(n.op_type, list(n.input), list(n.output)) for n in m.graph.node], form
        assert not out.graph.initializer, form


def test_not_split_where_the_function_would_change():
    # the scores returned (qk_matmul_output), a mask shorter than the keys, heads not static, mixed types
    qk = _model("", TP.FLOAT)
    n = qk.graph.node[0]
    n.output.extend(["", "", "qk"])
    qk.graph.output.append(vi("qk", TP.FLOAT, ["batch", 4, "seq", "seq"]))
    short = onnx_attention(TP.FLOAT, "bool")
    short.graph.input[3].type.tensor_type.shape.dim[3].dim_param = ""
    short.graph.input[3].type.tensor_type.shape.dim[3].dim_value = 4
    short.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 5  # (static keys: 5)
    for x in short.graph.input[1:3]:
        x.type.tensor_type.shape.dim[2].dim_value = 5
    heads = _model("", TP.FLOAT)
    for x in heads.graph.input:
        x.type.tensor_type.shape.dim[1].dim_param = "heads"
    mixed = _model("", TP.FLOAT)
    mixed.graph.input[2].type.tensor_type.elem_type = TP.FLOAT16
    nonpad = onnx_attention(TP.FLOAT, "", opset=24)
    nonpad.graph.node[0].input.extend(["", "", "", "lens"])
    nonpad.graph.input.append(vi("lens", TP.INT64, ["batch"]))
    # (is_causal over symbolic lengths after a past: ORT's rule for one query depends on the lengths at run time)
    causal = onnx_attention(TP.FLOAT, "bool past causal")
    for label, m in (("qk output", qk), ("short mask", short), ("symbolic heads", heads), ("mixed", mixed),
                     ("nonpad_kv_seqlen", nonpad), ("causal", causal)):
        _, splits = split_contrib_ops(build_graph(load_model(m)))
        assert not splits, label


@pytest.mark.parametrize("s,kv", [(7, 3), (3, 7), (1, 4), (6, 6)])
def test_causal_over_symbolic_lengths_is_upper_left(s, kv):
    # no past: query i sees keys j <= i whatever the two counts (ORT's kernel, torch's is_causal), computed from
    # two iotas read through Shape at run time, so one split model serves every length
    for form in ("cross causal", "cross bool causal", "3d gqa causal"):
        m = _model(form, TP.FLOAT)
        split, splits = split_contrib_ops(build_graph(load_model(m)))
        assert len(splits) == 1 and "Range" in {n.op_type for n in split.model.graph.node}, form
        feeds = _feeds(m, s=s, kv=kv if "cross" in form else s)
        np.testing.assert_allclose(_run(split.model, feeds)[0], _run(m, feeds)[0], rtol=1e-5, atol=1e-5,
                                   err_msg=form)


def test_opset_24_splits_the_same():
    m = onnx_attention(TP.FLOAT, "static bool past causal", opset=24)
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    assert len(splits) == 1
    feeds = _feeds(m)
    for a, b in zip(_run(m, feeds), _run(split.model, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_not_split_past_its_opsets_head_sizes_or_scales():
    window = onnx_attention(TP.FLOAT, "", opset=25)  # (25: sliding windows, a function the ops do not compute)
    window.graph.node[0].attribute.append(helper.make_attribute("left_window_size", 2))
    wide = onnx_attention(TP.FLOAT, "", head=256)  # (no attention kernel of ours takes it)
    negative = onnx_attention(TP.FLOAT, "")
    negative.graph.node[0].attribute.append(helper.make_attribute("scale", -0.5))
    for label, m in (("opset 25", onnx_attention(TP.FLOAT, "", opset=25)), ("window", window), ("head 256", wide),
                     ("scale", negative)):
        _, splits = split_contrib_ops(build_graph(load_model(m)))
        assert not splits, label


def test_the_scale_is_on_the_operands_before_the_product():
    # ORT's kernel scales inside its product; an fp16 Q·Kᵀ computed unscaled by ORT's MatMul and then scaled
    # overflows sooner (16 products of 64 * 64 are 65536, past fp16's largest). So the scale's root goes on
    # each operand, as torch's exporter writes it before opset 23. (ORT's CPU EP computes fp16 MatMuls in fp32,
    # so the overflow itself shows on a GPU only: the graph is checked here.)
    m = onnx_attention(TP.FLOAT16, "bool scale")
    split, _ = split_contrib_ops(build_graph(load_model(m)))
    g = split.model.graph
    made = {o: n for n in g.node for o in n.output}
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    qk = next(n for n in g.node if n.op_type == "MatMul" and made.get(n.input[0]) is not None)
    roots = [made[x] for x in qk.input]
    assert [r.op_type for r in roots] == ["Mul", "Mul"]
    factors = [float(consts[next(x for x in r.input if x in consts)]) for r in roots]
    assert abs(factors[0] * factors[1] - 0.3) < 1e-3 and not any(n.op_type == "Mul" and made.get(n.input[0]) is qk
                                                                 for n in g.node)
    feeds = _feeds(m)
    feeds["q"] = np.full_like(feeds["q"], 64.0)
    feeds["k"] = np.full_like(feeds["k"], 64.0)
    np.testing.assert_allclose(_run(split.model, feeds)[0].astype(np.float32),
                               _run(m, feeds)[0].astype(np.float32), rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("form", ["bool", "static causal", "static bool causal"])
def test_layers_share_one_bias(form):
    # a model's layers read one mask: its bias (and the causal rule's constant) is written once, not per layer
    m = onnx_attention(TP.FLOAT, form)
    first = m.graph.node[0]
    second = onnx.NodeProto()
    second.CopyFrom(first)
    second.name, second.input[0] = "attention_2", "y1"
    first.output[0] = "y1"
    m.graph.node.append(second)
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    assert len(splits) == 2
    nodes = split.model.graph.node
    guards = {n.output[0] for n in nodes if n.op_type == "IsNaN"}
    assert sum(n.op_type == "Where" and n.input[0] not in guards for n in nodes) == ("bool" in form)
    assert sum("causal" in t.name for t in split.model.graph.initializer) == ("causal" in form)
    feeds = _feeds(m)
    np.testing.assert_allclose(_run(split.model, feeds)[0], _run(m, feeds)[0], rtol=1e-5, atol=1e-5)
    out = onnx.ModelProto()  # and where nothing fused them, both go back (the first's bias read by the second)
    out.CopyFrom(split.model)
    assert len(restore(out, splits)) == 2
    assert [(n.op_type, list(n.input)) for n in out.graph.node] == [(n.op_type, list(n.input)) for n in m.graph.node]
    assert [t.name for t in out.graph.initializer] == [t.name for t in m.graph.initializer]


def test_a_mask_whose_count_has_another_name_is_split():
    # Mistral's sliding-window cache: the keys are "past + seq - Max(0, past - 4095)", its mask's last dim
    # "past + seq"; equal at run time (or ORT's kernel and the split's Add both refuse the model)
    m = onnx_attention(TP.FLOAT, "bool")
    m.graph.input[3].type.tensor_type.shape.dim[3].dim_param = "total"
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    assert len(splits) == 1
    feeds = _feeds(m)
    np.testing.assert_allclose(_run(split.model, feeds)[0], _run(m, feeds)[0], rtol=1e-5, atol=1e-5)

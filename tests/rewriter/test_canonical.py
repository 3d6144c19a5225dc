"""Canonicalization: run-time Reshape targets become constants where shapes determine them, flattened Gemms
become MatMuls, zero Pads become the padding of the Convs they feed, Identities of constants and Expands to
the shape their input has are bypassed, sibling MatMuls sharing an input are packed into one, small tensors
computed from static dims become constants."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from helpers import const, gqa_attention, model, node, rotary, vi
from ortfuse.rewriter.canonical import (_merge_groups, _static_target, broadcast, bypass_broadcast_expands,
                                        bypass_lone_concats, bypass_noop_expands, explicit_auto_pads,
                                        fold_constant_identities, fold_constant_subgraphs, fold_conv_pads,
                                        fold_runtime_shapes, fold_small_values, merge_regrouped_transposes,
                                        sink_constant_expands, trusted_dim, unflatten_gemms)
from ortfuse.rewriter.gemm_packing import pack_sibling_gemms
from ortfuse.rewriter.shapes import build_graph


def _exporter_style_split_heads(allowzero: int = 0):
    nodes = [node("Shape", ["x"], ["s"]), node("Gather", ["s", "i0"], ["b"], axis=0),
             node("Gather", ["s", "i1"], ["n"], axis=0), node("Unsqueeze", ["b", "ax"], ["b1"]),
             node("Unsqueeze", ["n", "ax"], ["n1"]), node("Concat", ["b1", "n1", "heads", "dh"], ["shp"], axis=0),
             node("Add", ["x", "bias"], ["xb"]), node("Reshape", ["xb", "shp"], ["r"], allowzero=allowzero),
             node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3])]
    inits = [const("i0", 0, np.int64), const("i1", 1, np.int64), const("ax", [0], np.int64),
             const("heads", [4], np.int64), const("dh", [8], np.int64), const("bias", np.arange(32) / 32)]
    return model(nodes, [vi("x", TP.FLOAT, ["batch", "seq", 32])], [vi("y", TP.FLOAT, ["batch", 4, "seq", 8])], inits)


def test_static_target():
    assert _static_target(("b", "s", 32), ("b", "s", 4, 8)) == [0, 0, 4, 8]
    assert _static_target(("b", "s", 32), ("b*s", 32)) == [-1, 32]
    assert _static_target(("b", "s", 32), ("s", "b", 32)) is None  # two unknowns


@pytest.mark.parametrize("allowzero", [0, 1])  # torch.export writes allowzero=1 with targets of actual sizes
def test_fold_keeps_the_function_and_drops_shape_ops(allowzero):
    m = _exporter_style_split_heads(allowzero)
    g = build_graph(m, {})
    g2, n = fold_runtime_shapes(g)
    assert n == 1
    assert {x.op_type for x in g2.nodes} == {"Add", "Reshape", "Transpose"}
    reshape = next(x for x in g2.nodes if x.op_type == "Reshape")
    assert not any(a.name == "allowzero" for a in reshape.attribute)  # its 0 entries copy dims
    for shape in ((2, 5, 32), (0, 5, 32), (3, 0, 32)):  # 0-sized dims stay 0-sized
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        run = lambda mm: ort.InferenceSession(mm.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
        np.testing.assert_array_equal(run(m), run(g2.model))
    assert g.model.graph.node[0].op_type == "Shape"  # the input graph is untouched


def _conv1d(trans_b: int = 0, alpha: float = 1.0, act: bool = True, dtype=TP.FLOAT, tail=(40,)):
    """GPT-2's Conv1D as exported: x.view(-1, K) -> Gemm(W, b) -> .view(*x.shape[:-1], N) with the target
    computed at run time, then a GELU-like epilogue."""
    k, n = 24, 40
    np_dt = np.float16 if dtype == TP.FLOAT16 else np.float32
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((n, k) if trans_b else (k, n)) * 0.2).astype(np_dt)
    nodes = [node("Reshape", ["x", "flat"], ["x2"]),
             node("Gemm", ["x2", "w", "b"], ["y2"], transB=trans_b, alpha=alpha),
             node("Shape", ["x"], ["s"]), node("Slice", ["s", "s0", "s1"], ["lead"]),
             node("Concat", ["lead", "nn"], ["shp"], axis=0), node("Reshape", ["y2", "shp"], ["y"])]
    if act:
        nodes += [node("Tanh", ["y"], ["t"]), node("Mul", ["y", "t"], ["out"])]
    inits = [const("flat", [-1, k], np.int64), const("w", w, np_dt), const("b", rng.standard_normal(n) * 0.1, np_dt),
             const("s0", [0], np.int64), const("s1", [-1], np.int64), const("nn", list(tail), np.int64)]
    out = "out" if act else "y"
    return model(nodes, [vi("x", dtype, ["batch", "seq", k])], [vi(out, dtype, ["batch", "seq", *tail])], inits)


def _run(m, x):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_unflatten_gemm_between_reshapes():
    x = np.random.default_rng(0).standard_normal((2, 5, 24)).astype(np.float32)
    for trans_b in (0, 1):
        m = _conv1d(trans_b)
        g = build_graph(m, {})
        g2, n = unflatten_gemms(g)
        assert n == 1
        ops = [x.op_type for x in g2.nodes]
        assert "Gemm" not in ops and "Shape" not in ops and ops.count("Reshape") == 0, ops
        assert ops.count("MatMul") == 1 and ops.count("Add") == 1 and ops.count("Transpose") == trans_b
        mm = next(x for x in g2.nodes if x.op_type == "MatMul")
        assert list(mm.input)[0] == "x" and g2.tensors[mm.output[0]].shape == ("batch", "seq", 40)
        np.testing.assert_allclose(_run(g2.model, x), _run(m, x), rtol=1e-5, atol=1e-6)
        assert any(x.op_type == "Gemm" for x in g.model.graph.node)  # the input graph is untouched


def test_unflatten_leaves_other_gemms_alone():
    assert unflatten_gemms(build_graph(_conv1d(alpha=0.5), {}))[1] == 0  # alpha != 1 is no plain MatMul
    assert unflatten_gemms(build_graph(_conv1d(act=False), {}))[1] == 1  # restoring a graph output is fine
    assert unflatten_gemms(build_graph(_conv1d(act=False, tail=(4, 10)), {}))[1] == 0  # a head split, not a restore
    # a second consumer of the flat result keeps the Gemm
    m = _conv1d()
    m.graph.node.append(node("Relu", ["y2"], ["r2"]))
    m.graph.output.append(vi("r2", TP.FLOAT, ["batch*seq", 40]))
    assert unflatten_gemms(build_graph(m, {}))[1] == 0


def test_unflattened_gemm_fuses_its_epilogue():
    # after the rewrite, bias + Tanh + Mul are the GEMM's epilogue: one gemm kernel, parity in emulation
    from helpers import fused_parity
    res = fused_parity(_conv1d(dtype=TP.FLOAT16), {"x": ("batch", "seq", 24)}, {"x": (3, 7, 24)}, ("gemm",))
    assert {x.op_type for i in res.kernels[0].region.nodes for x in [res.graph.nodes[i]]} >= {"MatMul", "Add", "Tanh"}


def _merged_heads_projection(dtype=TP.FLOAT):
    """torch.export's attention output projection: [B, H, S, D] -> Transpose -> one Reshape to [B*S, H*D]
    (constant target), Gemm, then back to [B, S, N] through a Reshape with allowzero=1 whose target holds the
    actual sizes, computed at run time; a Relu epilogue."""
    h, d, n = 4, 6, 40
    np_dt = np.float16 if dtype == TP.FLOAT16 else np.float32
    rng = np.random.default_rng(5)
    nodes = [node("Transpose", ["x"], ["xt"], perm=[0, 2, 1, 3]),
             node("Reshape", ["xt", "flat"], ["x2"], allowzero=1),
             node("Gemm", ["x2", "w", "b"], ["y2"]),
             node("Shape", ["x"], ["s"]), node("Gather", ["s", "bs"], ["lead"], axis=0),
             node("Concat", ["lead", "nn"], ["shp"], axis=0),
             node("Reshape", ["y2", "shp"], ["y"], allowzero=1), node("Relu", ["y"], ["out"])]
    inits = [const("flat", [-1, h * d], np.int64), const("w", rng.standard_normal((h * d, n)) * 0.2, np_dt),
             const("b", rng.standard_normal(n) * 0.1, np_dt), const("bs", [0, 2], np.int64), const("nn", [n], np.int64)]
    return model(nodes, [vi("x", dtype, ["batch", h, "seq", d])], [vi("out", dtype, ["batch", "seq", n])], inits)


def test_unflatten_a_gemm_whose_flatten_also_merges_the_heads():
    m = _merged_heads_projection()
    g = build_graph(m, {})
    g2, n = unflatten_gemms(g)
    assert n == 1
    ops = [x.op_type for x in g2.nodes]
    assert "Gemm" not in ops and "Shape" not in ops and ops.count("Reshape") == 1, ops
    merge = next(x for x in g2.nodes if x.op_type == "Reshape")
    assert g2.tensors[merge.output[0]].shape == ("batch", "seq", 24)
    mm = next(x for x in g2.nodes if x.op_type == "MatMul")
    assert list(mm.input)[0] == merge.output[0] and g2.tensors[mm.output[0]].shape == ("batch", "seq", 40)
    for shape in ((2, 4, 5, 6), (1, 4, 1, 6), (0, 4, 3, 6)):  # a 0-sized batch stays 0-sized
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(_run(g2.model, x)[0], _run(m, x)[0], rtol=1e-5, atol=1e-6)


def test_merged_heads_projection_fuses_its_epilogue():
    from helpers import fused_parity
    shapes = {"x": ("batch", 4, "seq", 6)}
    res = fused_parity(_merged_heads_projection(TP.FLOAT16), shapes, {"x": (3, 4, 7, 6)}, ("gemm",))
    assert {res.graph.nodes[i].op_type for i in res.kernels[0].region.nodes} >= {"MatMul", "Add", "Relu"}


def test_initializers_listed_as_inputs_stay_in_the_interface():
    # IR < 4 style: every initializer is also a graph input; the shape constants the rewrite no longer
    # reads must not become inputs without a value
    m = _conv1d()
    m.graph.input.extend(vi(t.name, t.data_type, list(t.dims)) for t in m.graph.initializer)
    g2, n = unflatten_gemms(build_graph(m, {}))
    assert n == 1
    inits = {t.name for t in g2.model.graph.initializer}
    assert {v.name for v in g2.model.graph.input} - inits == {"x"}
    x = np.random.default_rng(1).standard_normal((2, 5, 24)).astype(np.float32)
    np.testing.assert_allclose(_run(g2.model, x), _run(m, x), rtol=1e-5, atol=1e-6)


def _pad_conv(begin=(1, 2), end=(3, 1), value=0.0, mode="constant", second_user="Conv", channels=(0, 0)):
    """MobileNetV2-style padding: pads computed from constants (ConstantOfShape + Concat), a Pad feeding a
    depthwise Conv that has padding of its own, and a second consumer of the padded tensor."""
    c = 4 + sum(channels)
    nodes = [node("ConstantOfShape", ["one"], ["zero"], value=onnx.helper.make_tensor("v", TP.INT64, [1], [0])),
             node("Concat", ["zero", "cb", "hwb", "zero", "ce", "hwe"], ["pads"], axis=0),
             node("Pad", ["x", "pads", "cval"], ["xp"], mode=mode),
             node("Conv", ["xp", "w"], ["y"], group=c, kernel_shape=[3, 3], pads=[1, 0, 0, 1]),
             node(second_user, ["xp", "w2"] if second_user == "Conv" else ["xp"], ["y2"])]
    inits = [const("one", [1], np.int64), const("cb", [channels[0]], np.int64), const("ce", [channels[1]], np.int64),
             const("hwb", list(begin), np.int64), const("hwe", list(end), np.int64), const("cval", value),
             const("w", np.linspace(-1, 1, c * 9).reshape(c, 1, 3, 3)),
             const("w2", np.linspace(-1, 1, 8 * c * 9).reshape(8, c, 3, 3))]
    return model(nodes, [vi("x", TP.FLOAT, ["n", 4, 7, 6])], [vi("y", TP.FLOAT, None), vi("y2", TP.FLOAT, None)], inits)


def _run(m, x):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_zero_pad_becomes_the_convs_padding():
    m = _pad_conv()
    g = build_graph(m, {})
    g2, n = fold_conv_pads(g)
    assert n == 1
    assert [x.op_type for x in g2.nodes] == ["Conv", "Conv"]
    assert [list(a.ints) for a in g2.nodes[0].attribute if a.name == "pads"] == [[1 + 1, 0 + 2, 0 + 3, 1 + 1]]
    assert [list(a.ints) for a in g2.nodes[1].attribute if a.name == "pads"] == [[1, 2, 3, 1]]
    x = np.random.default_rng(0).standard_normal((2, 4, 7, 6)).astype(np.float32)
    for a, b in zip(_run(m, x), _run(g2.model, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert any(x.op_type == "Pad" for x in g.model.graph.node)  # the input graph is untouched


@pytest.mark.parametrize("kwargs", [dict(value=0.5), dict(mode="reflect"), dict(second_user="Relu"),
                                    dict(channels=(1, 0))])
def test_pads_that_are_not_conv_padding_stay(kwargs):
    # a non-zero value, another mode, a consumer that is not a Conv, padding of the channels
    g = build_graph(_pad_conv(**kwargs), {})
    assert fold_conv_pads(g)[1] == 0


def _auto_padded(hw, op: str, mode: str, k: int, s: int, **extra):
    """x [n, 4, hw, hw] -> `op` with auto_pad `mode`, kernel k x k (or k x k-1), stride s -> Relu."""
    kw = k - 1 if k > 2 else k
    if op == "Conv":
        first = node("Conv", ["x", "w"], ["c"], auto_pad=mode, strides=[s, s], **extra)
        inits = [const("w", np.random.default_rng(k).standard_normal((4, 4, k, kw)) * 0.3)]
    else:
        first = node(op, ["x"], ["c"], auto_pad=mode, kernel_shape=[k, kw], strides=[s, s], **extra)
        inits = []
    return model([first, node("Relu", ["c"], ["y"])], [vi("x", TP.FLOAT, ["n", 4, hw, hw])], [vi("y", TP.FLOAT, None)],
                 inits)


@pytest.mark.parametrize("op,mode,k,s,hw,extra", [
    ("Conv", "SAME_UPPER", 3, 2, 17, {}), ("Conv", "SAME_LOWER", 4, 2, 16, {}), ("Conv", "SAME_UPPER", 5, 1, "h", {}),
    ("Conv", "SAME_LOWER", 2, 3, 13, {}), ("MaxPool", "SAME_UPPER", 3, 2, 9, {}),
    ("AveragePool", "SAME_LOWER", 4, 2, 11, {}), ("AveragePool", "SAME_UPPER", 3, 1, "h", dict(count_include_pad=1))])
def test_auto_pad_same_becomes_the_pads_ort_computes(op, mode, k, s, hw, extra):
    # the pads ORT computes for SAME (the odd one at the end for UPPER, the start for LOWER), where they do
    # not depend on a symbolic image size (stride 1): the same results, bit for bit, and no auto_pad left
    m = _auto_padded(hw, op, mode, k, s, **extra)
    g = build_graph(m, {})
    g2, n = explicit_auto_pads(g)
    assert n == 1 and all(a.name != "auto_pad" for a in g2.nodes[0].attribute)
    assert any(a.name == "auto_pad" for a in g.nodes[0].attribute)  # the input graph is untouched
    x = np.random.default_rng(1).standard_normal((2, 4, 17 if hw == "h" else hw, 17 if hw == "h" else hw))
    for a, b in zip(_run(m, x.astype(np.float32)), _run(g2.model, x.astype(np.float32))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("hw,s,extra", [("h", 2, {}), (16, 2, dict(dilations=[2, 2])), (7, 4, {})])
def test_auto_pads_that_depend_on_the_image_or_that_ort_refuses_stay(hw, s, extra):
    # a strided Conv over a symbolic image (the pads follow its size), dilations (ORT refuses SAME with them),
    # a total under zero (kernel 1 x 1 at stride 4 over 7: ORT pads by -1 at the end)
    k = 1 if s == 4 else 3
    g = build_graph(_auto_padded(hw, "Conv", "SAME_UPPER", k, s, **extra), {})
    assert explicit_auto_pads(g)[1] == 0


def test_a_zero_pad_before_a_valid_conv_becomes_its_padding():
    # EfficientNet's strided depthwise Convs: ZeroPad2d, then a Conv with auto_pad VALID
    m = model([node("Pad", ["x", "p"], ["xp"]), node("Conv", ["xp", "w"], ["y"], auto_pad="VALID", strides=[2, 2])],
              [vi("x", TP.FLOAT, ["n", 4, 9, 9])], [vi("y", TP.FLOAT, None)],
              [const("p", [0, 0, 0, 1, 0, 0, 1, 2], np.int64),
               const("w", np.random.default_rng(0).standard_normal((4, 4, 3, 3)))])
    g2, n = fold_conv_pads(build_graph(m, {}))
    assert n == 1 and [x.op_type for x in g2.nodes] == ["Conv"]
    assert {a.name: list(a.ints) for a in g2.nodes[0].attribute}["pads"] == [0, 1, 1, 2]
    x = np.random.default_rng(1).standard_normal((2, 4, 9, 9)).astype(np.float32)
    np.testing.assert_allclose(_run(m, x)[0], _run(g2.model, x)[0], rtol=1e-6, atol=1e-6)


def _standardized_conv(tied: bool = False, qdq: bool = False):
    """BiT's weight standardization: (w - mean) / sqrt(var + eps) over each output channel, computed from the
    weight at run time, then the Conv; `tied`: the raw weight also feeds an output; `qdq`: an int8 weight
    dequantized instead."""
    rng = np.random.default_rng(0)
    if qdq:
        nodes = [node("DequantizeLinear", ["wq", "sc"], ["ws"])]
        inits = [const("wq", rng.integers(-100, 100, (8, 4, 3, 3)), np.int8), const("sc", 0.01)]
    else:
        nodes = [node("ReduceMean", ["w", "axes"], ["m"]), node("Sub", ["w", "m"], ["d"]),
                 node("Mul", ["d", "d"], ["d2"]), node("ReduceMean", ["d2", "axes"], ["v"]),
                 node("Add", ["v", "eps"], ["ve"]), node("Sqrt", ["ve"], ["sd"]), node("Div", ["d", "sd"], ["ws"])]
        inits = [const("w", rng.standard_normal((8, 4, 3, 3))), const("axes", [1, 2, 3], np.int64), const("eps", 1e-6)]
    nodes.append(node("Conv", ["x", "ws"], ["y"], pads=[1, 1, 1, 1]))
    outs = [vi("y", TP.FLOAT, None)]
    if tied:
        nodes.append(node("Add", ["w", "w"], ["w2"]))
        nodes.append(node("Mul", ["w2", "eps"], ["w3"]))
        nodes.append(node("ReduceSum", ["w3", "axes"], ["tie"]))
        outs.append(vi("tie", TP.FLOAT, None))
    return model(nodes, [vi("x", TP.FLOAT, ["n", 4, 6, 6])], outs, inits)


def test_a_weight_computed_from_constants_becomes_one_as_ort_folds_it():
    m = _standardized_conv()
    g = build_graph(m, {})
    g2, n = fold_constant_subgraphs(g)
    assert n == 1 and [x.op_type for x in g2.nodes] == ["Conv"] and g2.nodes[0].input[1] in g2.constants
    assert len(g2.model.graph.initializer) == 1  # the raw weight and the reduction's constants went with it
    x = np.random.default_rng(1).standard_normal((2, 4, 6, 6)).astype(np.float32)
    np.testing.assert_array_equal(_run(m, x)[0], _run(g2.model, x)[0])  # ORT's own kernels computed it
    assert len(g.nodes) == 8  # the input graph is untouched


def test_graph_outputs_and_qdq_stay_computed():
    # a graph output computed from the weight: its producer stays (the output is the model's interface), what it
    # reads folds (2 values: the standardized weight and 2 x w x eps); an int8 weight's DequantizeLinear stays
    g2, n = fold_constant_subgraphs(build_graph(_standardized_conv(tied=True), {}))
    assert n == 2 and sorted(x.op_type for x in g2.nodes) == ["Conv", "ReduceSum"]
    g3, n = fold_constant_subgraphs(build_graph(_standardized_conv(qdq=True), {}))
    assert n == 0 and [x.op_type for x in g3.nodes] == ["DequantizeLinear", "Conv"]


def test_a_large_value_that_keeps_its_source_alive_stays(monkeypatch):
    # a tied embedding: the table is gathered and read transposed by the LM head; folding the Transpose would
    # store the table twice
    from ortfuse.rewriter import canonical
    monkeypatch.setattr(canonical, "MAX_FOLD_GROWTH", 1024)
    table = np.random.default_rng(0).standard_normal((50, 16)).astype(np.float32)
    m = model([node("Gather", ["emb", "ids"], ["h"]), node("Transpose", ["emb"], ["embt"], perm=[1, 0]),
               node("MatMul", ["h", "embt"], ["logits"])],
              [vi("ids", TP.INT64, ["b", "s"])], [vi("logits", TP.FLOAT, None)], [const("emb", table)])
    assert fold_constant_subgraphs(build_graph(m, {}))[1] == 0
    monkeypatch.setattr(canonical, "MAX_FOLD_GROWTH", 1 << 16)
    assert fold_constant_subgraphs(build_graph(m, {}))[1] == 1


def _fold_case(kind: str) -> onnx.ModelProto:
    """Constant-only computations that must stay computed (or go unevaluated): `kind` names which."""
    w = const("w", np.arange(16).reshape(4, 4) / 16)
    x = vi("x", TP.FLOAT, [4, 4])
    if kind == "overridable":  # an initializer listed as a graph input: a user may feed another value
        return model([node("Transpose", ["w"], ["wt"]), node("MatMul", ["x", "wt"], ["y"])],
                     [x, vi("w", TP.FLOAT, [4, 4])], [vi("y", TP.FLOAT, None)], [w])
    if kind == "if_body":  # the Transpose is also read inside a branch, which the renaming does not reach
        branch = onnx.helper.make_graph([node("Add", ["x", "wt"], ["o"])], "b", [], [vi("o", TP.FLOAT, None)])
        return model([node("Transpose", ["w"], ["wt"]), node("MatMul", ["x", "wt"], ["mm"]),
                      node("ReduceSum", ["mm"], ["s"], keepdims=0), node("Greater", ["s", "zero"], ["c"]),
                      onnx.helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)],
                     [x], [vi("y", TP.FLOAT, None)], [w, const("zero", 0.0)])
    # "huge": a 1-element constant broadcast to 4096 x 4096 (a mask): too big to add, never computed
    return model([node("Expand", ["one", "shape"], ["big"]), node("Add", ["xb", "big"], ["y"])],
                 [vi("xb", TP.FLOAT, [4096, 4096])], [vi("y", TP.FLOAT, None)],
                 [const("one", [1.0]), const("shape", [4096, 4096], np.int64)])


@pytest.mark.parametrize("kind", ["overridable", "if_body", "huge"])
def test_constant_computations_that_stay(kind, monkeypatch):
    from ortfuse.rewriter import canonical
    if kind == "huge":
        monkeypatch.setattr(canonical, "_run_on_ort", lambda *a: pytest.fail("a 64 MiB value was computed"))
    g = build_graph(_fold_case(kind), {})
    g2, n = fold_constant_subgraphs(g)
    assert n == 0 and g2 is g


def test_a_group_ort_cannot_run_leaves_the_others_folded():
    # all groups run in one ORT session; ORT's CPU has no int16 Relu, so that session fails and each group
    # runs alone: the Transpose of w still folds, the int16 group stays
    m = model([node("Transpose", ["w"], ["wt"]), node("Add", ["x", "wt"], ["a"]),
               node("Cast", ["v"], ["vb"], to=TP.INT16), node("Relu", ["vb"], ["v2"]),
               node("Cast", ["v2"], ["vf"], to=TP.FLOAT), node("Add", ["a", "vf"], ["y"])],
              [vi("x", TP.FLOAT, [4, 4])], [vi("y", TP.FLOAT, None)],
              [const("w", np.arange(16).reshape(4, 4)), const("v", np.ones((4, 4)))])
    g2, n = fold_constant_subgraphs(build_graph(m, {}))
    assert n == 1 and "Transpose" not in [x.op_type for x in g2.nodes]
    assert [x.op_type for x in g2.nodes].count("Cast") == 2


def test_a_folded_value_gets_a_name_of_its_own():
    m = model([node("Transpose", ["w"], ["wt"]), node("Add", ["x", "wt"], ["a"]),
               node("Relu", ["x"], ["wt__ortfuse_value"]), node("Add", ["a", "wt__ortfuse_value"], ["y"])],
              [vi("x", TP.FLOAT, [4, 4])], [vi("y", TP.FLOAT, None)], [const("w", np.arange(16).reshape(4, 4))])
    g2, n = fold_constant_subgraphs(build_graph(m, {}))
    assert n == 1 and [t.name for t in g2.model.graph.initializer] == ["wt__ortfuse_value1"]
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    np.testing.assert_array_equal(_run(m, x)[0], _run(g2.model, x)[0])


# ---- Identity of a constant, sibling MatMuls ---------------------------------------------------------------

def _siblings(biases=(True, True, True), shared_weight=False, opset=18, dtype=TP.FLOAT, extra_identity_out=False):
    """x [b, s, 16] @ Wq / Wk / Wv [16, 8|8|12] (+ bias), each result consumed by its own Relu. The biases are
    one zero initializer shared through Identities (as the TorchScript exporter writes equal weights)."""
    np_dt = np.float16 if dtype == TP.FLOAT16 else np.float32
    rng = np.random.default_rng(5)
    widths = (8, 8, 12)
    nodes, inits, outs = [], [], []
    for k, (w, b) in enumerate(zip(widths, biases)):
        nodes.append(node("MatMul", ["x", f"w{k}"], [f"y{k}"]))
        inits.append(const(f"w{k}", rng.standard_normal((16, w)) * 0.3, np_dt))
        last = f"y{k}"
        if b:
            nodes += [node("Identity", [f"bsrc{k}"], [f"b{k}"]), node("Add", [f"b{k}", last], [f"z{k}"])]
            inits.append(const(f"bsrc{k}", rng.standard_normal(w) * 0.1, np_dt))
            last = f"z{k}"
        nodes.append(node("Relu", [last], [f"out{k}"]))
        outs.append(vi(f"out{k}", dtype, None))
    if shared_weight:
        nodes.append(node("MatMul", ["x2", "w0"], ["extra"]))
        outs.append(vi("extra", dtype, None))
    if extra_identity_out:
        nodes.append(node("Identity", ["bsrc0"], ["bcopy"]))
        outs.append(vi("bcopy", dtype, None))
    inputs = [vi("x", dtype, ["b", "s", 16])] + ([vi("x2", dtype, ["b", 16])] if shared_weight else [])
    return model(nodes, inputs, outs, inits, opset=opset)


def _feeds(m):
    rng = np.random.default_rng(1)
    out = {}
    for v in m.graph.input:
        shape = [3 if d.dim_param else d.dim_value for d in v.type.tensor_type.shape.dim]
        np_dt = np.float16 if v.type.tensor_type.elem_type == TP.FLOAT16 else np.float32
        out[v.name] = rng.standard_normal(shape).astype(np_dt)
    return out


def _same_function(m1, m2):
    feeds = _feeds(m1)
    run = lambda mm: ort.InferenceSession(mm.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    for a, b in zip(run(m1), run(m2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_identities_of_constants_are_bypassed_unless_graph_outputs():
    m = _siblings(extra_identity_out=True)
    g2, n = fold_constant_identities(build_graph(m, {}))
    assert n == 3
    assert [x.output[0] for x in g2.nodes if x.op_type == "Identity"] == ["bcopy"]
    assert {x.input[0] for x in g2.nodes if x.op_type == "Add"} == {"bsrc0", "bsrc1", "bsrc2"}
    _same_function(m, g2.model)


def test_a_concat_of_one_input_is_bypassed_unless_a_graph_output():
    # DynamicCache's trace: Concat([past]) read by Shape only (a copy of the cache for its size), and one that
    # is a graph output, which stays
    m = model([node("Concat", ["past"], ["c1"], axis=2), node("Shape", ["c1"], ["sh"]),
               node("Concat", ["past"], ["c2"], axis=0), node("Relu", ["past"], ["r"]),
               node("Concat", ["r", "c2"], ["c3"], axis=0)],
              [vi("past", TP.FLOAT, ["b", 2, "p", 4])],
              [vi("sh", TP.INT64, None), vi("c2", TP.FLOAT, None), vi("c3", TP.FLOAT, None)])
    g2, n = bypass_lone_concats(build_graph(m, {}))
    assert n == 1
    assert [(x.op_type, list(x.input)) for x in g2.nodes] == [("Shape", ["past"]), ("Concat", ["past"]),
                                                               ("Relu", ["past"]), ("Concat", ["r", "c2"])]
    _same_function(m, g2.model)


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
def test_sibling_matmuls_with_biases_become_one_matmul_add_split(opset, dtype):
    m = _siblings(opset=opset, dtype=dtype)
    g = build_graph(m, {})
    g1, _ = fold_constant_identities(g)
    g2, n = pack_sibling_gemms(g1)
    assert n == 3
    assert [x.op_type for x in g2.nodes] == ["MatMul", "Add", "Split", "Relu", "Relu", "Relu"]
    split = g2.nodes[2]
    assert list(split.output) == ["z0", "z1", "z2"]
    assert g2.tensors[g2.nodes[0].output[0]].shape == ("b", "s", 28)
    assert g2.constants[g2.nodes[0].input[1]].dtype == (np.float16 if dtype == TP.FLOAT16 else np.float32)
    _same_function(m, g2.model)
    assert [x.op_type for x in g.model.graph.node].count("MatMul") == 3  # the input graph is untouched


def test_siblings_without_a_bias_each_pack_only_the_matmuls():
    m = _siblings(biases=(True, False, True))
    g2, n = pack_sibling_gemms(fold_constant_identities(build_graph(m, {}))[0])
    assert n == 3
    assert [x.op_type for x in g2.nodes][:2] == ["MatMul", "Split"]
    assert sum(x.op_type == "Add" for x in g2.nodes) == 2  # the biases stay on the split results
    _same_function(m, g2.model)


def test_a_packing_no_attention_splits_is_sliced_where_every_slice_is_fused():
    # a decoder's Q, K and V feed rotary kernels, not attention directly: no Split is kept, so each result is
    # a Slice of the packed MatMul, kept only if the search fuses every Slice and fused none of the MatMuls
    m = _siblings(biases=(False, False, False))
    g = build_graph(m, {})
    results = {g.nodes[i].output[0] for i in range(len(g.nodes)) if g.nodes[i].op_type == "MatMul"}
    never = lambda gr: set()  # noqa: E731
    sliced, n = pack_sibling_gemms(g, never, lambda gr: results if gr is not g else set())
    assert n == 3 and [x.op_type for x in sliced.nodes].count("Slice") == 3
    assert sum(x.op_type == "MatMul" for x in sliced.nodes) == 1
    _same_function(m, sliced.model)
    assert pack_sibling_gemms(g, never, lambda gr: set())[1] == 0  # a Slice left to ORT: undone
    assert pack_sibling_gemms(g, never, lambda gr: results)[1] == 0  # our GEMMs already (epilogues fused)


def test_a_biased_packing_is_sliced_even_where_one_of_its_gemms_was_ours():
    # Qwen2's KV-cache step: Q's GEMM took its bias (ours), K and V went to cuBLAS and their biases into the
    # cache kernels; packed with the biases, one GEMM takes all three as its epilogue and its Slices feed those
    # kernels (kept only where the search fuses every Slice)
    m = _siblings()
    g = fold_constant_identities(build_graph(m, {}))[0]
    mms = [i for i, x in enumerate(g.nodes) if x.op_type == "MatMul"]
    adds = {g.nodes[c].output[0] for i in mms for c in g.consumers[g.nodes[i].output[0]]
            if g.nodes[c].op_type == "Add"}
    ours, never = {g.nodes[mms[0]].output[0]}, (lambda gr: set())
    sliced, n = pack_sibling_gemms(g, never, lambda gr: ours if gr is g else adds)
    assert n == 3 and [x.op_type for x in sliced.nodes].count("Slice") == 3
    assert sum(x.op_type == "MatMul" for x in sliced.nodes) == 1
    _same_function(m, sliced.model)
    assert pack_sibling_gemms(g, never, lambda gr: ours if gr is g else set())[1] == 0  # a Slice left to ORT


def test_a_weight_used_elsewhere_is_not_packed():
    m = _siblings(shared_weight=True)
    g2, n = pack_sibling_gemms(fold_constant_identities(build_graph(m, {}))[0])
    assert n == 2  # Wk and Wv only
    assert sum(x.op_type == "MatMul" for x in g2.nodes) == 3
    _same_function(m, g2.model)


def test_packings_the_caller_does_not_keep_are_undone():
    g1, _ = fold_constant_identities(build_graph(_siblings(), {}))
    seen = []

    def keep(packed):
        seen.append([x.op_type for x in packed.nodes].count("Split"))
        return set()
    g2, n = pack_sibling_gemms(g1, keep)
    assert seen == [1] and n == 0 and g2 is g1


def _mask_expand(src: str):
    """transformers 5's mask tail: And broadcasts [B,1,S,1] & [B,1,1,S] to [B,1,S,S], then an Expand to
    [B,1,S,S] computed on the host from the dims, then Where. `src` is what the Expand reads."""
    nodes = [node("And", ["a", "b"], ["ab"]),
             node("Shape", ["b"], ["sb"]), node("Shape", ["a"], ["sa"]),
             node("Gather", ["sb", "i0"], ["nb"], axis=0), node("Gather", ["sb", "i3"], ["ns"], axis=0),
             node("Unsqueeze", ["nb", "ax0"], ["nb1"]), node("Unsqueeze", ["ns", "ax0"], ["ns1"]),
             node("Concat", ["nb1", "one", "ns1", "ns1"], ["target"], axis=0),
             node("Expand", [src, "target"], ["e"]),
             node("Where", ["e", "zero", "low"], ["y"])]
    inits = [const("i0", 0, np.int64), const("i3", 3, np.int64), const("ax0", [0], np.int64),
             const("one", [1], np.int64), const("zero", 0.0), const("low", -1e9)]
    return model(nodes, [vi("a", TP.BOOL, ["B", 1, "S", 1]), vi("b", TP.BOOL, ["B", 1, 1, "S"])],
                 [vi("y", TP.FLOAT, ["B", 1, "S", "S"])], inits)


@pytest.mark.parametrize("src,bypassed", [("ab", True), ("b", False)])
def test_an_expand_to_the_shape_its_input_has_is_bypassed(src, bypassed):
    m = _mask_expand(src)
    g = build_graph(m, {})
    g2, n = bypass_noop_expands(g)
    assert n == int(bypassed)
    ops = {x.op_type for x in g2.nodes}
    assert ops == ({"And", "Where"} if bypassed else {x.op_type for x in g.nodes})  # the host shape ops go too
    rng = np.random.default_rng(2)
    feeds = {"a": rng.integers(0, 2, (2, 1, 5, 1)).astype(bool), "b": rng.integers(0, 2, (2, 1, 1, 5)).astype(bool)}
    run = lambda mm: ort.InferenceSession(mm.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]  # noqa: E731
    np.testing.assert_array_equal(run(g2.model), run(m))


def _cpu(m, feeds):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_small_values_from_static_dims_become_constants_and_symbolic_ones_stay():
    m = rotary(seq_slice=True)
    g = build_graph(m, {})
    g2, n = fold_small_values(g)
    assert n == 1  # the half-width Slice bound (its Shape stays: the sequence's Slice reads it)
    slices = {x.output[0]: x for x in g2.nodes if x.op_type == "Slice"}
    assert all(t in g2.constants for k in ("x1", "x2") for t in slices[k].input[1:])
    assert [int(np.asarray(g2.constants[slices["x1"].input[2]]).item())] == [16]
    assert slices["z"].input[2] not in g2.constants  # the sequence length is known at run time only
    assert {x.op_type for x in g2.nodes} - {"Shape", "Gather", "Unsqueeze"} == \
        {"Transpose", "Slice", "Neg", "Concat", "Mul", "Add"}  # Div and Cast went with the folded bound
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in (("x", (2, 5, 4, 32)), ("cos", (5, 32)),
                                                                        ("sin", (5, 32)))}
    for want, got in zip(_cpu(m, feeds), _cpu(g2.model, feeds)):
        np.testing.assert_array_equal(want, got)
    assert any(x.op_type == "Div" for x in g.model.graph.node)  # the input graph is untouched


@pytest.mark.parametrize("ends,steps", [([2**63 - 1], None), ([4], [1])])
def test_a_sliced_static_dim_becomes_a_constant(ends, steps):
    # TorchScript's scaled_dot_product_attention scale, 1 / sqrt(q.size(-1)) with q.size(-1) as
    # Slice(Shape(q), [-1], [max]), on each of Q and Kᵀ as a root: a constant the attention kernel folds in
    # (the sequence dim before it is symbolic, and not read)
    nodes = [node("Shape", ["q"], ["qs"]), node("Slice", ["qs", "st", "en", "ax"] + (["sp"] if steps else []), ["d"]),
             node("Cast", ["d"], ["df"], to=TP.FLOAT), node("Sqrt", ["df"], ["r"]), node("Div", ["one", "r"], ["sc"]),
             node("Sqrt", ["sc"], ["root"]), node("Mul", ["q", "root"], ["y"])]
    inits = [const("st", [-1], np.int64), const("en", ends, np.int64), const("ax", [0], np.int64),
             const("one", np.array(1.0, np.float32))] + ([const("sp", steps, np.int64)] if steps else [])
    m = model(nodes, [vi("q", TP.FLOAT, ["B", 4, "S", 16])], [vi("y", TP.FLOAT, None)], inits)
    g2, n = fold_small_values(build_graph(m, {}))
    assert n == 1 and [x.op_type for x in g2.nodes] == ["Mul"]
    feeds = {"q": np.random.default_rng(0).standard_normal((2, 4, 5, 16)).astype(np.float32)}
    np.testing.assert_array_equal(_cpu(m, feeds)[0], _cpu(g2.model, feeds)[0])
    # a symbolic dim picked stays computed
    inits[0] = const("st", [-2], np.int64)
    inits[1] = const("en", [-1], np.int64)
    g3 = build_graph(model(nodes, [vi("q", TP.FLOAT, ["B", 4, "S", 16])], [vi("y", TP.FLOAT, None)], inits), {})
    assert fold_small_values(g3)[1] == 0


def test_what_ort_folds_at_session_start_is_folded_and_large_random_or_output_values_are_not():
    nodes = [node("ConstantOfShape", ["shp"], ["ones"], value=onnx.helper.make_tensor("v", TP.INT64, [1], [1])),
             node("Mul", ["ones", "k"], ["neg"]), node("Equal", ["tgt", "neg"], ["eq"]),
             node("Where", ["eq", "ones", "tgt"], ["fixed"]), node("Expand", ["x", "fixed"], ["y"]),
             node("ConstantOfShape", ["big"], ["wide"]), node("Add", ["x", "wide"], ["z"]),
             node("Shape", ["x"], ["out_shape"]), node("Bernoulli", ["half"], ["coin"]),
             node("Add", ["x", "coin"], ["c"])]
    inits = [const("shp", [3], np.int64), const("k", -1, np.int64), const("tgt", [2, -1, 8], np.int64),
             const("big", [4, 100], np.int64), const("half", [0.5])]
    outs = [vi("y", TP.FLOAT, [2, 4, 8]), vi("z", TP.FLOAT, [1, 4, 100]), vi("out_shape", TP.INT64, [3]),
            vi("c", TP.FLOAT, [1, 4, 1])]
    m = model(nodes, [vi("x", TP.FLOAT, [1, 4, 1])], outs, inits)
    g2, n = fold_small_values(build_graph(m, {}))
    assert n == 1 and any(x.op_type == "Shape" for x in g2.nodes)  # a graph output stays computed
    expand = next(x for x in g2.nodes if x.op_type == "Expand")
    assert expand.input[1] in g2.constants and list(g2.constants[expand.input[1]]) == [2, 1, 8]
    assert any(x.op_type == "ConstantOfShape" for x in g2.nodes)  # 400 elements: data, left to ORT
    assert any(x.op_type == "Bernoulli" for x in g2.nodes)  # a new draw each run


def test_repeat_kv_expand_targets_become_constants_and_symbolic_broadcasts_stay():
    m = gqa_attention(TP.FLOAT, heads=6, kv_heads=2, head=8)
    g2, n = fold_runtime_shapes(build_graph(m, {}))
    assert n == 4  # two Expands, two Reshapes
    for e in (x for x in g2.nodes if x.op_type == "Expand"):
        assert list(g2.constants[e.input[1]]) == [1, 1, 3, 1, 1]
    rng = np.random.default_rng(1)
    feeds = {"q": rng.standard_normal((2, 6, 5, 8)), "k": rng.standard_normal((2, 2, 5, 8)),
             "v": rng.standard_normal((2, 2, 5, 8)), "mask": rng.standard_normal((2, 1, 5, 5))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    np.testing.assert_array_equal(_cpu(m, feeds)[0], _cpu(g2.model, feeds)[0])
    # broadcasting a 1 to a symbolic dim needs the dim's run-time value: the target stays computed
    nodes = [node("Shape", ["y"], ["ys"]), node("Expand", ["x", "ys"], ["z"]), node("Add", ["z", "y"], ["w"])]
    m2 = model(nodes, [vi("x", TP.FLOAT, [1, "seq"]), vi("y", TP.FLOAT, ["batch", "seq"])], [vi("w", TP.FLOAT, None)])
    assert fold_runtime_shapes(build_graph(m2, {}))[1] == 0


def test_an_expression_oftrusted_dims_is_trusted():
    # a KV cache's concatenation has 'past + seq' keys: known at run time exactly when past and seq are
    trusted = frozenset({"batch", "past", "seq"})
    assert trusted_dim("past + seq", trusted) and trusted_dim("floor(seq/2)", trusted) and trusted_dim("seq", trusted)
    assert not trusted_dim("past + unk__3", trusted) and not trusted_dim("total", trusted)


def test_a_target_with_one_entry_computed_at_run_time_gets_minus_one_there():
    # MobileViT's unfold: [batch * 2, 2, 4] with the first entry computed in floats (here through a Ceil, which
    # shape inference does not follow: it mints new symbols for every output dim); the other entries are
    # constants, so that entry is -1, the same value
    nodes = [node("Shape", ["x"], ["s"]), node("Gather", ["s", "i0"], ["b"], axis=0),
             node("Cast", ["b"], ["bf"], to=TP.FLOAT), node("Div", ["bf", "half"], ["q0"]), node("Ceil", ["q0"], ["q"]),
             node("Cast", ["q"], ["qi"], to=TP.INT64), node("Unsqueeze", ["qi", "ax"], ["e0"]),
             node("Concat", ["e0", "two", "four"], ["shp"], axis=0), node("Reshape", ["x", "shp"], ["r"]),
             node("Relu", ["r"], ["y"])]
    inits = [const("i0", 0, np.int64), const("half", 0.5), const("ax", [0], np.int64), const("two", [2], np.int64),
             const("four", [4], np.int64)]
    m = model(nodes, [vi("x", TP.FLOAT, ["batch", 4, 4])], [vi("y", TP.FLOAT, None)], inits)
    g = build_graph(m, {})
    assert not any(isinstance(d, int) for d in g.tensors["r"].shape)  # what inference made of it
    g2, n = fold_runtime_shapes(g)
    assert n == 1
    reshape = next(x for x in g2.nodes if x.op_type == "Reshape")
    assert list(np.asarray(g2.constants[reshape.input[1]])) == [-1, 2, 4]
    assert build_graph(g2.model, {}).tensors["r"].shape == ("2*batch", 2, 4)
    x = np.random.default_rng(0).standard_normal((3, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(_run(m, x), _run(g2.model, x))


def test_a_merge_taints_only_what_is_computed_from_where_it_happened():
    # z's shape comes from a Reshape whose target inference cannot follow (new symbols), and an Add with a
    # [1, 8] constant merges its last dim into 8; y = Relu(x) has a static 8 of its own. Reading y's dim is
    # folded to a constant, reading w's (the Add's) is not: at run time it may be 1
    from ortfuse.rewriter.shapes import merge_tainted, merged_sizes

    nodes = [node("Relu", ["x"], ["y"]), node("Shape", ["x"], ["s"]), node("Gather", ["s", "i0"], ["b"], axis=0),
             node("Cast", ["b"], ["bf"], to=TP.FLOAT), node("Ceil", ["bf"], ["bc"]),
             node("Cast", ["bc"], ["bi"], to=TP.INT64),
             node("Unsqueeze", ["bi", "ax"], ["b1"]), node("Concat", ["b1", "eight"], ["shp"], axis=0),
             node("Reshape", ["x", "shp"], ["z"]), node("Add", ["z", "c"], ["w"]),
             node("Shape", ["y"], ["sy"]), node("Gather", ["sy", "i1"], ["ny"], axis=0),
             node("Shape", ["w"], ["sw"]), node("Gather", ["sw", "i1"], ["nw"], axis=0),
             node("Range", ["zero", "ny", "one"], ["ry"]), node("Range", ["zero", "nw", "one"], ["rw"])]
    inits = [const("i0", 0, np.int64), const("i1", 1, np.int64), const("ax", [0], np.int64),
             const("eight", [8], np.int64), const("c", np.ones((1, 8))), const("zero", 0, np.int64),
             const("one", 1, np.int64)]
    outs = [vi("w", TP.FLOAT, None), vi("ry", TP.INT64, None), vi("rw", TP.INT64, None)]
    m = model(nodes, [vi("x", TP.FLOAT, ["batch", 8])], outs, inits)
    g = build_graph(m, {})
    assert 8 in merged_sizes(g)
    tainted = merge_tainted(g)
    assert tainted is not None and {"z", "w", "sw"} <= tainted and not {"y", "sy"} & tainted
    g2, _ = fold_small_values(g)
    ranges = {x.output[0]: x for x in g2.nodes if x.op_type == "Range"}
    assert ranges["ry"].input[1] in g2.constants and ranges["rw"].input[1] not in g2.constants


def test_a_merged_expression_taints_what_is_computed_from_its_minted_symbols():
    # SAM's window un-partition: a tensor of minted dims (a Reshape through a Ceil) sliced to its first 8 has
    # 'Min(8, minted)' there, which an Add with a [1, 8] constant merges into 8. Only what is computed from the
    # Reshape is suspect; before, any merged expression made every tensor so, and SAM kept all its shape
    # arithmetic (and its attention) from the search
    from ortfuse.rewriter.shapes import merge_tainted, merges_into_sizes

    nodes = [node("Relu", ["x"], ["y"]), node("Shape", ["x"], ["s"]), node("Gather", ["s", "i0"], ["b"], axis=0),
             node("Cast", ["b"], ["bf"], to=TP.FLOAT), node("Ceil", ["bf"], ["bc"]),
             node("Cast", ["bc"], ["bi"], to=TP.INT64), node("Unsqueeze", ["bi", "ax"], ["b1"]),
             node("Concat", ["b1", "e8"], ["shp"], axis=0), node("Reshape", ["x", "shp"], ["z"]),
             node("Slice", ["z", "s0", "e8", "ax1"], ["zs"]), node("Add", ["zs", "c"], ["w"]),
             node("Shape", ["y"], ["sy"]), node("Gather", ["sy", "i1"], ["ny"], axis=0),
             node("Shape", ["w"], ["sw"]), node("Gather", ["sw", "i1"], ["nw"], axis=0),
             node("Range", ["zero", "ny", "one"], ["ry"]), node("Range", ["zero", "nw", "one"], ["rw"])]
    inits = [const("i0", 0, np.int64), const("i1", 1, np.int64), const("ax", [0], np.int64),
             const("ax1", [1], np.int64), const("s0", [0], np.int64), const("e8", [8], np.int64),
             const("c", np.ones((1, 8))), const("zero", 0, np.int64), const("one", 1, np.int64)]
    outs = [vi("w", TP.FLOAT, None), vi("ry", TP.INT64, None), vi("rw", TP.INT64, None)]
    g = build_graph(model(nodes, [vi("x", TP.FLOAT, ["batch", 8])], outs, inits), {})
    merged = merges_into_sizes(g)
    assert list(merged.values()) == [8] and next(iter(merged)).startswith("Min(8, Reshape_")
    tainted = merge_tainted(g)
    assert tainted is not None and {"z", "zs", "w", "sw"} <= tainted and not {"y", "sy"} & tainted
    g2, _ = fold_small_values(g)
    ranges = {x.output[0]: x for x in g2.nodes if x.op_type == "Range"}
    assert ranges["ry"].input[1] in g2.constants and ranges["rw"].input[1] not in g2.constants


def test_a_merged_expression_taints_what_was_merged_into_its_names():
    # z's minted dim meets an input's 't' in an Add and becomes 't'; z sliced to its first 8 is 'Min(8, t)',
    # merged into 8. z is not computed from the input declaring t, but carries t: it is suspect too (review of
    # session 46's first version, which folded the Range bound to 8 where it is 1 at n = t = 1)
    from ortfuse.rewriter.shapes import merge_tainted

    nodes = [node("Shape", ["x"], ["s"]), node("Gather", ["s", "i1"], ["b"], axis=0),
             node("Cast", ["b"], ["bf"], to=TP.FLOAT), node("Ceil", ["bf"], ["bc"]),
             node("Cast", ["bc"], ["bi"], to=TP.INT64), node("Unsqueeze", ["bi", "ax"], ["b1"]),
             node("Concat", ["one1", "b1"], ["shp"], axis=0), node("Reshape", ["x", "shp"], ["z"]),
             node("Add", ["z", "c"], ["zc"]), node("Slice", ["z", "s0", "e8", "ax1"], ["zs"]),
             node("Add", ["zs", "k"], ["w"]), node("Shape", ["zs"], ["sz"]), node("Gather", ["sz", "i1"], ["nz"], axis=0),
             node("Range", ["zero", "nz", "one"], ["rz"])]
    inits = [const("i1", 1, np.int64), const("ax", [0], np.int64), const("one1", [1], np.int64),
             const("ax1", [1], np.int64), const("s0", [0], np.int64), const("e8", [8], np.int64),
             const("k", np.ones((1, 8))), const("zero", 0, np.int64), const("one", 1, np.int64)]
    outs = [vi("zc", TP.FLOAT, None), vi("w", TP.FLOAT, None), vi("rz", TP.INT64, None)]
    m = model(nodes, [vi("x", TP.FLOAT, [1, "n"]), vi("c", TP.FLOAT, [1, "t"])], outs, inits)
    g = build_graph(m, {})
    tainted = merge_tainted(g)
    assert tainted is None or {"z", "zs", "sz", "nz", "rz"} <= tainted
    g2, _ = fold_small_values(g)
    assert next(x for x in g2.nodes if x.op_type == "Range").input[1] not in g2.constants
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    rep = check_models(m, compile_model(m, None, "sm_90").model, emulate=True, input_shapes={"x": [1, 1], "c": [1, 1]})
    assert rep.ok, "\n".join(rep.lines())


def _folded_agrees(m, feeds):
    """The model with its small values folded computes what the model does, on `feeds`."""
    g2, _ = fold_small_values(fold_runtime_shapes(build_graph(m, {}))[0])
    folded = onnx.ModelProto()
    folded.CopyFrom(g2.model)
    del folded.graph.value_info[:]  # inferred with the merge: the optimized model carries none (replace)
    for v in folded.graph.input:  # nor the merged size in place of the declared dim
        v.CopyFrom(next(w for w in m.graph.input if w.name == v.name))
    run = lambda mm: ort.InferenceSession(mm.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    for a, b in zip(run(m), run(folded)):
        np.testing.assert_array_equal(a, b)


def test_a_merge_taints_every_input_declaring_the_symbol():
    # a and b both declare 's'; the MatMul with a [5, 3, 4] weight merges 's' into 5: Relu(a)'s first dim may
    # still be 1 at run time, so its Shape is not a constant
    nodes = [node("Relu", ["a"], ["ra"]), node("MatMul", ["ra", "w"], ["y"]), node("Relu", ["b"], ["rb"]),
             node("Shape", ["ra"], ["sa"]), node("Cast", ["sa"], ["saf"], to=TP.FLOAT), node("Add", ["rb", "c"], ["o2"])]
    m = model(nodes, [vi("a", TP.FLOAT, ["s", 2, 3]), vi("b", TP.FLOAT, ["s", 2, 3])],
              [vi("y", TP.FLOAT, None), vi("saf", TP.FLOAT, None), vi("o2", TP.FLOAT, None)],
              [const("w", np.ones((5, 3, 4))), const("c", 1.0)])
    x = np.ones((1, 2, 3), np.float32)
    _folded_agrees(m, {"a": x, "b": x})


def test_a_merge_is_traced_to_its_tensor_by_name_after_folds_remove_nodes():
    # the first Tile's output dims are minted by inference and merged into [2, 5] by the Add; the Reshape's
    # fold removes the Shape before it, so the node index in the minted name then points at the other Tile:
    # the merge is traced by tensor name, and Shape(A) stays run-time
    nodes = [node("Shape", ["x0"], ["s0"]), node("Reshape", ["x0", "s0"], ["r0"]),
             node("Tile", ["z", "t"], ["A"]), node("Tile", ["r0", "c"], ["r1"]), node("Add", ["A", "x"], ["B"]),
             node("Shape", ["A"], ["sA"]), node("Cast", ["sA"], ["sAf"], to=TP.FLOAT), node("Add", ["r1", "one"], ["o2"])]
    m = model(nodes, [vi("x0", TP.FLOAT, [3]), vi("z", TP.FLOAT, [1, 1]), vi("t", TP.INT64, [2]),
                      vi("x", TP.FLOAT, [2, 5])],
              [vi("B", TP.FLOAT, None), vi("sAf", TP.FLOAT, None), vi("o2", TP.FLOAT, None)],
              [const("one", 1.0), const("c", [2], np.int64)])
    feeds = {"x0": np.ones(3, np.float32), "z": np.ones((1, 1), np.float32), "t": np.array([2, 1], np.int64),
             "x": np.ones((2, 5), np.float32)}
    _folded_agrees(m, feeds)


def test_a_bf16_weight_computed_from_constants_folds_through_the_fp32_shadow():
    """ORT's CPU EP has no bf16 ReduceMean, Sub or Sqrt, so ORT's own constant folding leaves a bf16 BiT weight
    standardization to run on the GPU, op by op; it folds here to those values: each op in fp32, each result
    rounded to bf16 (numpy below, the same order). (Conv stays fp32 at this opset: the folded weight is the
    Cast of the bf16 result.)"""
    import ml_dtypes

    from ortfuse.bench.bf16 import to_bf16
    m = to_bf16(_standardized_conv())
    assert next(t for t in m.graph.initializer if t.name == "w").data_type == TP.BFLOAT16
    g2, n = fold_constant_subgraphs(build_graph(m, {}))
    assert n == 1 and [x.op_type for x in g2.nodes if x.op_type != "Cast"] == ["Conv"]
    got = np.asarray(g2.constants[next(x for x in g2.nodes if x.op_type == "Conv").input[1]], np.float32)

    def bf(a):
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    w = onnx.numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "w")).astype(np.float32)
    eps = bf(np.float32(np.float16(1e-6)))  # (the fp16 conversion's value, retyped)
    d = bf(w - bf(w.mean(axis=(1, 2, 3), keepdims=True)))
    var = bf(bf(d * d).mean(axis=(1, 2, 3), keepdims=True))
    want = bf(d / bf(np.sqrt(bf(var + eps))))
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)


def _regrouped_key(back: str = "transposed", k_out: bool = False, batch="B"):
    """torch.export's Kᵀ in scaled_dot_product_attention: k [B, 4, S, 16] -> Reshape [-1, S, 16] ->
    Transpose (0, 2, 1) -> Reshape [B, 4, 16, S], both targets computed from Shape(k) on the host; then
    q @ Kᵀ. `back`: "transposed" (the dims of k in the transposed order), or "plain" (k's own order, a
    reinterpretation of the transposed data)."""
    nodes = [node("Shape", ["k"], ["shp"]),
             node("Slice", ["shp", "m2", "m1"], ["s"]), node("Slice", ["shp", "m1", "big"], ["d"]),
             node("Slice", ["shp", "z", "m2"], ["bh"]),
             node("Concat", ["m1", "s", "d"], ["t1"], axis=0),
             node("Concat", ["bh", "d", "s"] if back == "transposed" else ["bh", "s", "d"], ["t2"], axis=0),
             node("Reshape", ["k", "t1"], ["k3"]), node("Transpose", ["k3"], ["kt3"], perm=[0, 2, 1]),
             node("Reshape", ["kt3", "t2"], ["kt"]), node("MatMul", ["q", "kt"], ["y"])]
    inits = [const(n, [v], np.int64) for n, v in (("m2", -2), ("m1", -1), ("big", 2**62), ("z", 0))]
    outs = [vi("y", TP.FLOAT, None)] + ([vi("kt3", TP.FLOAT, None)] if k_out else [])
    qs = [batch, 4, "S", 16] if back == "transposed" else [batch, 4, "S", "S"]
    return model(nodes, [vi("q", TP.FLOAT, qs), vi("k", TP.FLOAT, [batch, 4, "S", 16])], outs, inits)


@pytest.mark.parametrize("batch", ["B", 2])
def test_a_reshape_transpose_reshape_that_regroups_dims_is_one_transpose(batch):
    m = _regrouped_key(batch=batch)
    g2, n = merge_regrouped_transposes(build_graph(m, {}))
    assert n == 1
    assert [(x.op_type, [a.ints for a in x.attribute]) for x in g2.nodes] == \
        [("Transpose", [[0, 1, 3, 2]]), ("MatMul", [])]  # the host shape ops went with the Reshapes
    rng = np.random.default_rng(3)
    b = batch if isinstance(batch, int) else 3
    feeds = {"q": rng.standard_normal((b, 4, 5, 16)).astype(np.float32),
             "k": rng.standard_normal((b, 4, 5, 16)).astype(np.float32)}
    np.testing.assert_allclose(_cpu(g2.model, feeds)[0], _cpu(m, feeds)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(back="plain"), dict(k_out=True)], ids=["reinterpreted", "read-elsewhere"])
def test_regroupings_that_are_not_one_transpose_stay(kw):
    g = build_graph(_regrouped_key(**kw), {})
    g2, n = merge_regrouped_transposes(g)
    assert n == 0 and g2 is g


@pytest.mark.parametrize("xs,ys,groups", [
    (("B", 4, "S", 16), ("4*B", "S", 16), [(0, 1), (2,), (3,)]),
    (("B", 4, "S", 16), ("B", 4, "S", 16), [(0,), (1,), (2,), (3,)]),
    (("B", "S", 4, 16), ("B", "S", 64), [(0,), (1,), (2, 3)]),
    ((2, 3, 4), (2, 12), [(0,), (1, 2)]),
    (("B", 1, "S", 16), ("B", "S", 16), None),  # a dim dropped, not merged
    (("B", "S", 64), ("B", "S", 4, 16), None),  # a split
    ((2, 3, 4), (6, 2, 2), None),
])
def test_merge_groups(xs, ys, groups):
    assert _merge_groups(xs, ys) == groups


def _vit_mask(other: str = "scores"):
    """torch.export's attention mask of a ViT: an all-true constant [1, 1, 6, 1] expanded to [B, 1, 6, 6] (the
    batch read through Shape on the host), Where(mask, 0, -inf), added to the scores [B, 2, 6, 6] (`other`:
    "scores", or "narrow", a [B, 2, 6, 1] tensor the expanded mask widens)."""
    nodes = [node("Shape", ["x"], ["nb"], start=0, end=1), node("Concat", ["nb", "one", "six", "six"], ["tgt"], axis=0),
             node("Expand", ["ge", "tgt"], ["m"]), node("Where", ["m", "zero", "low"], ["bias"]),
             node("Add", ["x" if other == "scores" else "n", "bias"], ["s"]), node("Softmax", ["s"], ["y"], axis=-1)]
    inits = [const("one", [1], np.int64), const("six", [6], np.int64), const("ge", np.ones((1, 1, 6, 1), bool), bool),
             const("zero", 0.0), const("low", -np.inf)]
    ins = [vi("x", TP.FLOAT, ["B", 2, 6, 6])] + ([vi("n", TP.FLOAT, ["B", 2, 6, 1])] if other != "scores" else [])
    return model(nodes, ins, [vi("y", TP.FLOAT, None)], inits)


def test_a_broadcast_constant_mask_folds_and_the_scores_read_it_unexpanded():
    m = _vit_mask()
    g, sunk = sink_constant_expands(build_graph(m, {}))
    assert sunk == 1  # Where(Expand(ge), 0, -inf) -> Expand(Where(ge, 0, -inf))
    g, folded = fold_constant_subgraphs(g)
    assert folded == 1
    g, bypassed = bypass_broadcast_expands(g)
    assert bypassed == 1  # the Add broadcasts the [1, 1, 6, 1] mask over [B, 2, 6, 6] itself
    assert [x.op_type for x in g.nodes] == ["Add", "Softmax"]  # the host's Shape and Concat went too
    feeds = {"x": np.random.default_rng(4).standard_normal((3, 2, 6, 6)).astype(np.float32)}
    np.testing.assert_allclose(_cpu(g.model, feeds)[0], _cpu(m, feeds)[0], rtol=1e-6)


def test_an_expand_that_widens_the_result_stays():
    m = _vit_mask(other="narrow")
    g, _ = sink_constant_expands(build_graph(m, {}))
    g, _ = fold_constant_subgraphs(g)
    g2, bypassed = bypass_broadcast_expands(g)
    assert bypassed == 0 and "Expand" in {x.op_type for x in g2.nodes}  # [B, 2, 6, 1] + [1, 1, 6, 1] is narrower
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((3, 2, 6, 6)).astype(np.float32),
             "n": rng.standard_normal((3, 2, 6, 1)).astype(np.float32)}
    np.testing.assert_allclose(_cpu(g2.model, feeds)[0], _cpu(m, feeds)[0], rtol=1e-6)


def test_an_op_on_an_expanded_constant_and_a_computed_tensor_is_not_moved():
    nodes = [node("Shape", ["x"], ["shp"]), node("Expand", ["c", "shp"], ["e"]), node("Mul", ["e", "x"], ["y"])]
    m = model(nodes, [vi("x", TP.FLOAT, ["B", 4])], [vi("y", TP.FLOAT, None)], [const("c", np.ones((1, 4)))])
    g = build_graph(m, {})
    assert sink_constant_expands(g) == (g, 0)


@pytest.mark.parametrize("shapes,out", [
    ([("B", 2, 6, 6), (1, 1, 6, 1)], ("B", 2, 6, 6)), ([(6,), ("B", 1, 1)], ("B", 1, 6)), ([(2, 3), (3, 2)], None),
    ([(), (4,)], (4,)), ([("B", 1), ("S", 1)], None)])
def test_broadcast(shapes, out):
    assert broadcast(*shapes) == out


def test_two_expands_read_by_one_op_are_judged_together():
    # each alone could go (the other still widens the Add to [5]); both together would leave [1]
    nodes = [node("Expand", ["x1", "s"], ["e1"]), node("Expand", ["x2", "s"], ["e2"]), node("Add", ["e1", "e2"], ["y"])]
    m = model(nodes, [vi("x1", TP.FLOAT, [1]), vi("x2", TP.FLOAT, [1])], [vi("y", TP.FLOAT, None)],
              [const("s", [5], np.int64)])
    g = build_graph(m, {})
    assert bypass_broadcast_expands(g) == (g, 0)


def test_an_expand_to_a_dim_inference_merged_stays():
    # Add(Expand(x, Shape(b)), a) with a [T], b [U]: inference names both T (or U), but T may be 1 at run time
    nodes = [node("Shape", ["b"], ["sb"]), node("Expand", ["x", "sb"], ["e"]), node("Add", ["e", "a"], ["y"])]
    m = model(nodes, [vi("x", TP.FLOAT, [1]), vi("a", TP.FLOAT, ["T"]), vi("b", TP.FLOAT, ["U"])],
              [vi("y", TP.FLOAT, None)])
    g = build_graph(m, {})
    assert bypass_broadcast_expands(g)[1] == 0


def test_a_regrouping_over_merged_dims_stays():
    # x [P, Q, R] -> [-1, R] -> Transpose -> [R, Q, P]: a Transpose only if Q is P, which inference assumed from
    # an Add of [P] and [Q] elsewhere (Q = 1 at run time broadcasts)
    nodes = [node("Shape", ["x"], ["sx"]),
             node("Slice", ["sx", "i2", "i3"], ["r"]), node("Slice", ["sx", "i1", "i2"], ["q"]),
             node("Slice", ["sx", "i0", "i1"], ["p"]),
             node("Concat", ["m1", "r"], ["t1"], axis=0), node("Concat", ["r", "q", "p"], ["t2"], axis=0),
             node("Reshape", ["x", "t1"], ["x2"]), node("Transpose", ["x2"], ["xt"], perm=[1, 0]),
             node("Reshape", ["xt", "t2"], ["y"]), node("Add", ["a", "b"], ["z"])]
    inits = [const(f"i{k}", [k], np.int64) for k in range(4)] + [const("m1", [-1], np.int64)]
    m = model(nodes, [vi("x", TP.FLOAT, ["P", "Q", "R"]), vi("a", TP.FLOAT, ["P"]), vi("b", TP.FLOAT, ["Q"])],
              [vi("y", TP.FLOAT, None), vi("z", TP.FLOAT, None)], inits)
    g = build_graph(m, {})
    assert merge_regrouped_transposes(g) == (g, 0)


def test_a_chain_on_an_expanded_scalar_moves_before_the_expand():
    # Expand(2.0, Shape(x)) -> Neg -> Mul by a constant -> Add to x: the chain computes on the scalar (shape (),
    # which broadcasts like any other), the Expand after it
    nodes = [node("Shape", ["x"], ["shp"]), node("Expand", ["two", "shp"], ["e"]), node("Neg", ["e"], ["n"]),
             node("Mul", ["n", "three"], ["m"]), node("Add", ["x", "m"], ["y"])]
    m = model(nodes, [vi("x", TP.FLOAT, ["B", 4])], [vi("y", TP.FLOAT, None)],
              [const("two", 2.0), const("three", 3.0)])
    g, sunk = sink_constant_expands(build_graph(m, {}))
    assert sunk == 2
    g, _ = fold_constant_subgraphs(g)
    g, bypassed = bypass_broadcast_expands(g)
    assert bypassed == 1 and [x.op_type for x in g.nodes] == ["Add"]
    feeds = {"x": np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)}
    np.testing.assert_allclose(_cpu(g.model, feeds)[0], _cpu(m, feeds)[0], rtol=1e-6)


@pytest.mark.parametrize("ir,listed,folded", [(8, True, 0), (8, False, 1), (3, True, 1)])
def test_small_values_of_initializers_a_user_may_feed_stay(ir, listed, folded):
    """An initializer listed as a graph input (IR 4 on) may be fed another value at run time: a small value
    computed from it (a Reshape target) is not folded. In IR 3 every initializer is listed and fixed."""
    m = model([node("Add", ["c", "c"], ["s"]), node("Reshape", ["x", "s"], ["y"])],
              [vi("x", TP.FLOAT, [2, 4]), *([vi("c", TP.INT64, [2])] if listed else [])], [vi("y", TP.FLOAT, None)],
              [const("c", [1, 4], np.int64)])
    m.ir_version = ir
    g, n = fold_small_values(build_graph(m, {}))
    assert n == folded and [x.op_type for x in g.nodes] == (["Reshape"] if folded else ["Add", "Reshape"])


def test_a_gemm_a_quantizer_reads_stays_a_gemm():
    # cuBLAS adds a Gemm's bias in its epilogue, where MatMul + Add rounds twice: a Gemm whose values a
    # QuantizeLinear reads is not unflattened (an ulp moves a quantized element a step); without the Q it is
    from ortfuse.api import compile_model
    m = _conv1d(act=False)
    assert "Gemm" not in [n.op_type for n in compile_model(m, None, "sm_90").model.graph.node]
    m.graph.node.append(node("QuantizeLinear", ["y", "qs"], ["q"]))
    m.graph.initializer.append(const("qs", np.array(0.05, np.float32), np.float32))
    m.graph.output[0].CopyFrom(vi("q", TP.UINT8, ["batch", "seq", 40]))
    res = compile_model(m, None, "sm_90")
    assert "Gemm" in [n.op_type for n in res.model.graph.node], [n.op_type for n in res.model.graph.node]

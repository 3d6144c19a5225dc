"""rewriter.contrib: ORT's fused ops written as standard ops (same function as ORT's own kernel) and put back."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import rw_models as M
from ortfuse.rewriter import build_graph, load_model
from ortfuse.rewriter.contrib import restore, split_contrib_ops

MS = "com.microsoft"
H = 48
F16 = TensorProto.FLOAT16
F32 = TensorProto.FLOAT


def _model(node: onnx.NodeProto, ins: dict[str, tuple], weights: dict[str, np.ndarray], outs: dict[str, tuple],
           dtype: int, opset: int = M.OPSET) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    m = M.make_model([node], [M.vi(k, s, dtype) for k, s in ins.items()], [M.vi(k, s, dtype) for k, s in outs.items()],
                     inits, opset=opset)
    m.opset_import.append(helper.make_opsetid(MS, 1))
    return m


def _cases(dtype: int) -> list[tuple[str, onnx.ModelProto]]:
    np_t = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(3)
    w = lambda *s: (rng.standard_normal(s) * 0.5 + 1.0).astype(np_t)  # noqa: E731
    x3, out = {"x": (2, 5, H)}, {"y": (2, 5, H)}
    skip = {"x": (2, 5, H), "s": (2, 5, H)}
    sn = lambda op, ins, outs=("y",), **a: helper.make_node(op, ins, list(outs), name="n", domain=MS, **a)  # noqa: E731
    return [
        ("Gelu", _model(sn("Gelu", ["x"]), x3, {}, out, dtype)),
        ("BiasGelu", _model(sn("BiasGelu", ["x", "b"]), x3, {"b": w(H)}, out, dtype)),
        ("FastGelu", _model(sn("FastGelu", ["x"]), x3, {}, out, dtype)),
        ("FastGelu+bias", _model(sn("FastGelu", ["x", "b"]), x3, {"b": w(H)}, out, dtype)),
        ("QuickGelu", _model(sn("QuickGelu", ["x"], alpha=1.5), x3, {}, out, dtype)),
        ("SkipLayerNormalization", _model(sn("SkipLayerNormalization", ["x", "s", "g", "be", "b"], epsilon=1e-5),
                                          skip, {"g": w(H), "be": w(H), "b": w(H)}, out, dtype)),
        ("SkipLayerNormalization+sum", _model(sn("SkipLayerNormalization", ["x", "s", "g"], ["y", "", "", "sum"]),
                                              skip, {"g": w(H)}, {"y": (2, 5, H), "sum": (2, 5, H)}, dtype)),
        ("SkipSimplifiedLayerNormalization", _model(
            sn("SkipSimplifiedLayerNormalization", ["x", "s", "g"], ["y", "", "", "sum"], epsilon=1e-6),
            skip, {"g": w(H)}, {"y": (2, 5, H), "sum": (2, 5, H)}, dtype)),
        ("SkipSimplifiedLayerNormalization+bias", _model(
            sn("SkipSimplifiedLayerNormalization", ["x", "s", "g", "b"], ["y", "", "", "sum"], epsilon=1e-6),
            skip, {"g": w(H), "b": w(H)}, {"y": (2, 5, H), "sum": (2, 5, H)}, dtype)),
        ("SimplifiedLayerNormalization", _model(
            helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], name="n", epsilon=1e-6),
            x3, {"g": w(H)}, out, dtype)),
        ("SkipLayerNormalization@opset14", _model(sn("SkipLayerNormalization", ["x", "s", "g", "be", "b"], epsilon=1e-5),
                                                  skip, {"g": w(H), "be": w(H), "b": w(H)}, out, dtype, opset=14)),
        ("LayerNormalization@opset14", _model(  # ORT's own before 17
            helper.make_node("LayerNormalization", ["x", "g", "be"], ["y"], name="n", epsilon=1e-5),
            x3, {"g": w(H), "be": w(H)}, out, dtype, opset=14)),
        ("LayerNormalization@opset14-nobias", _model(
            helper.make_node("LayerNormalization", ["x", "g"], ["y"], name="n", epsilon=1e-5),
            x3, {"g": w(H)}, out, dtype, opset=14)),
        ("SimplifiedLayerNormalization@opset18", _model(
            helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], name="n", epsilon=1e-6),
            x3, {"g": w(H)}, out, dtype, opset=18)),
        ("RMSNormalization@opset23", _model(  # ONNX's own
            helper.make_node("RMSNormalization", ["x", "g"], ["y"], name="n", epsilon=1e-6),
            x3, {"g": w(H)}, out, dtype, opset=23)),
        ("RMSNormalization@opset23-default-eps", _model(
            helper.make_node("RMSNormalization", ["x", "g"], ["y"], name="n", axis=-1),
            x3, {"g": w(H)}, out, dtype, opset=23)),
    ]


def _run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no re-fusing the standard ops
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


LABELS = [label for label, _ in _cases(F32)]


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_split_computes_what_orts_kernel_computes(dtype, label):
    for m in [dict(_cases(dtype))[label]]:
        g = build_graph(load_model(m))
        split, splits = split_contrib_ops(g)
        assert len(splits) == 1, label
        assert all(n.domain == "" and n.op_type not in ("SimplifiedLayerNormalization", "RMSNormalization")
                   for n in split.model.graph.node), label
        assert m.opset_import[0].version >= 17 or "LayerNormalization" not in {n.op_type for n in split.model.graph.node}
        rng = np.random.default_rng(0)
        np_t = helper.tensor_dtype_to_np_dtype(dtype)
        feeds = {v.name: (rng.standard_normal((2, 5, H)) * 2).astype(np_t) for v in m.graph.input}
        want, got = _run(m, feeds), _run(split.model, feeds)
        for a, b in zip(want, got):
            tol = 1e-5 if dtype == F32 else 4e-3
            np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=tol, atol=tol, err_msg=label)


def test_restore_puts_back_every_node_nothing_fused():
    for label, m in _cases(F32):
        g = build_graph(load_model(m))
        split, splits = split_contrib_ops(g)
        out = onnx.ModelProto()
        out.CopyFrom(split.model)
        assert len(restore(out, splits)) == 1, label
        assert [(n.op_type, n.domain, list(n.input), list(n.output)) for n in out.graph.node] == \
            [(n.op_type, n.domain, list(n.input), list(n.output)) for n in m.graph.node], label
        assert sorted(t.name for t in out.graph.initializer) == sorted(t.name for t in m.graph.initializer), label


def _fuse(m: onnx.ModelProto, names: set[str]) -> None:
    """Stand-in for a fused region: the named nodes become one node of another domain."""
    nodes = [n for n in m.graph.node if n.name in names]
    made = {o for n in nodes for o in n.output}
    read = [x for n in nodes for x in n.input if x not in made]
    keep = [n for n in m.graph.node if n.name not in names]
    outs = [o for o in made if any(o in n.input for n in keep) or o in {v.name for v in m.graph.output}]
    fused = helper.make_node("Fused", read, outs, name="fused", domain="ortfuse")
    del m.graph.node[:]
    m.graph.node.extend(keep + [fused])


def test_restore_puts_back_the_norm_when_the_add_was_fused():
    label, m = next(c for c in _cases(F32) if c[0] == "SkipSimplifiedLayerNormalization")
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    out = onnx.ModelProto()
    out.CopyFrom(split.model)
    _fuse(out, {n.name for n in out.graph.node if n.op_type == "Add" and n.output[0] == "sum"})
    assert len(restore(out, splits)) == 1
    assert [n.op_type for n in out.graph.node] == ["Fused", "SimplifiedLayerNormalization"]
    assert list(out.graph.node[1].input) == ["sum", "g"] and list(out.graph.node[1].output) == ["y"]
    assert not {t.name for t in out.graph.initializer} - {"g"}  # the split's scalars went with it


def test_restore_leaves_a_split_whose_ops_were_fused():
    label, m = next(c for c in _cases(F32) if c[0] == "SkipLayerNormalization")
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    out = onnx.ModelProto()
    out.CopyFrom(split.model)
    _fuse(out, {n.name for n in out.graph.node if n.op_type == "Add"})  # the sum went into a GEMM's epilogue
    assert restore(out, splits) == ()
    assert sorted(n.op_type for n in out.graph.node) == ["Fused", "LayerNormalization"]


def test_not_split_where_the_function_would_change():
    x = {"x": (2, 5, H)}
    g4 = np.ones(H, np.float32)
    stats = _model(helper.make_node("SkipLayerNormalization", ["x", "s", "g"], ["y", "mean"], name="n", domain=MS),
                   {"x": (2, 5, H), "s": (2, 5, H)}, {"g": g4}, {"y": (2, 5, H), "mean": (2, 5, 1)}, F32)
    stats.graph.output[1].type.tensor_type.elem_type = F32
    inner_axis = _model(helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], name="n", axis=1),
                        x, {"g": np.ones((5, H), np.float32)}, {"y": (2, 5, H)}, F32)
    mixed = _model(helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], name="n"),
                   x, {"g": np.ones(H, np.float16)}, {"y": (2, 5, H)}, F32)
    mixed.graph.output[0].type.tensor_type.elem_type = F16
    double = _model(helper.make_node("Gelu", ["x"], ["y"], name="n", domain=MS), x, {}, {"y": (2, 5, H)},
                    TensorProto.DOUBLE)
    two_axes = _model(helper.make_node("RMSNormalization", ["x", "g"], ["y"], name="n", axis=1),
                      x, {"g": np.ones((5, H), np.float32)}, {"y": (2, 5, H)}, F32, opset=23)
    for m in (stats, inner_axis, mixed, double, two_axes):
        g = build_graph(load_model(m))
        assert split_contrib_ops(g) == (g, ())


def test_restore_puts_back_the_layer_norm_before_opset_17_when_the_add_was_fused():
    label, m = next(c for c in _cases(F16) if c[0] == "SkipLayerNormalization@opset14")
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    out = onnx.ModelProto()
    out.CopyFrom(split.model)
    _fuse(out, {n.name for n in out.graph.node if n.op_type == "Add" and "s" in n.input})
    assert len(restore(out, splits)) == 1
    ln = next(n for n in out.graph.node if n.op_type == "LayerNormalization")
    assert list(ln.input[1:]) == ["g", "be"] and list(ln.output) == ["y"] and ln.domain == ""


def test_the_bias_add_is_shaped_as_the_operand_it_joins():
    # the skip is a MatMul's 2-D (S, H) result, the input 3-D: the bias joins the GEMM's operand, and is that shape
    w = numpy_helper.from_array(np.ones((8, H), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["p", "w"], ["pe"], name="mm"),
             helper.make_node("SkipLayerNormalization", ["x", "pe", "g", "", "b"], ["y"], name="n", domain=MS)]
    m = _model(nodes[1], {"x": (2, 5, H)}, {"g": np.ones(H, np.float32), "b": np.ones(H, np.float32)},
               {"y": (2, 5, H)}, F32)
    m.graph.node.insert(0, nodes[0])
    m.graph.input.append(M.vi("p", [5, 8]))
    m.graph.initializer.append(w)
    split, _ = split_contrib_ops(build_graph(load_model(m)))
    add = next(n for n in split.model.graph.node if n.op_type == "Add" and "b" in n.input)
    assert list(add.input) == ["pe", "b"] and split.tensors[add.output[0]].shape == (5, H)


def test_split_names_are_fresh():
    label, m = next(c for c in _cases(F32) if c[0] == "BiasGelu")
    taken = helper.make_node("Relu", ["y"], ["n/ortfuse_Add_out"], name="n/ortfuse_Add")
    m.graph.node.append(taken)
    m.graph.output[0].name = "n/ortfuse_Add_out"
    split, _ = split_contrib_ops(build_graph(load_model(m)))
    names = [n.name for n in split.model.graph.node]
    outs = [o for n in split.model.graph.node for o in n.output]
    assert len(set(names)) == len(names) and len(set(outs)) == len(outs)


def _onnx_split(form: str) -> onnx.ModelProto:
    """ONNX's Split of x [B, 3, 10] along the last axis into three outputs, each read by a Relu, in the forms
    exporters write it: sizes as an input (opset 13 on), num_outputs (18 on: ceil-sized parts 4, 4, 2),
    the `split` attribute (before 13), or equal parts (no sizes)."""
    ins = ["x", "sizes"] if form == "input" else ["x"]
    attrs = {"num_outputs": 3} if form == "num_outputs" else {"split": [3, 3, 4]} if form == "attribute" else {}
    outs = ["a", "b"] if form == "equal" else ["a", "b", "c"]
    nodes = [helper.make_node("Split", ins, outs, name="split", axis=-1, **attrs)] + \
        [helper.make_node("Relu", [o], [f"{o}_r"], name=f"relu_{o}") for o in outs]
    inits = [numpy_helper.from_array(np.array([2, 5, 3], np.int64), "sizes")] if form == "input" else []
    opset = {"input": 18, "num_outputs": 18, "attribute": 11, "equal": 13}[form]
    sizes = {"input": [2, 5, 3], "num_outputs": [4, 4, 2], "attribute": [3, 3, 4], "equal": [5, 5]}[form]
    return M.make_model(nodes, [M.vi("x", ["B", 3, 10])], [M.vi(f"{o}_r", ["B", 3, k]) for o, k in zip(outs, sizes)],
                        inits, opset=opset)


@pytest.mark.parametrize("form", ["input", "num_outputs", "attribute", "equal"])
def test_an_onnx_split_is_one_slice_per_output_and_put_back_where_none_fused(form):
    m = _onnx_split(form)
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    assert len(splits) == 1
    assert sorted({n.op_type for n in split.model.graph.node}) == ["Relu", "Slice"]
    x = np.random.default_rng(1).standard_normal((2, 3, 10)).astype(np.float32)
    for a, b in zip(_run(m, {"x": x}), _run(split.model, {"x": x})):
        np.testing.assert_array_equal(a, b)
    out = onnx.ModelProto()
    out.CopyFrom(split.model)
    assert len(restore(out, splits)) == 1  # nothing fused: the Split as it was, its sizes too
    assert [(n.op_type, list(n.input)) for n in out.graph.node if n.op_type == "Split"] == \
        [("Split", ["x", "sizes"] if form == "input" else ["x"])]
    assert sorted(t.name for t in out.graph.initializer) == sorted(t.name for t in m.graph.initializer)
    onnx.checker.check_model(out, full_check=True)


def test_a_split_with_one_slice_fused_keeps_the_others_as_slices():
    m = _onnx_split("input")
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    out = onnx.ModelProto()
    out.CopyFrom(split.model)
    first = next(n for n in out.graph.node if n.op_type == "Slice" and n.output[0] == "a")
    _fuse(out, {first.name, "relu_a"})
    assert restore(out, splits) == ()
    assert sorted(n.op_type for n in out.graph.node) == ["Fused", "Relu", "Relu", "Slice", "Slice"]


def test_a_split_of_a_symbolic_dim_into_equal_parts_stays():
    nodes = [helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=-1, num_outputs=2)]
    m = M.make_model(nodes, [M.vi("x", ["B", "S"])], [M.vi("a", ["B", "H"]), M.vi("b", ["B", "H"])], opset=18)
    assert split_contrib_ops(build_graph(load_model(m)))[1] == ()


def test_splits_slice_cannot_write_or_ort_refuses_stay():
    # before opset 10 Slice takes its starts as attributes; 4 into 3 leaves the last part empty (ORT refuses it)
    old = M.make_model([helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=1, split=[16, 48])],
                       [M.vi("x", ["B", 64])], [M.vi("a", ["B", 16]), M.vi("b", ["B", 48])], opset=9)
    empty = M.make_model([helper.make_node("Split", ["x"], ["a", "b", "c"], name="split", axis=1, num_outputs=3)],
                         [M.vi("x", ["B", 4])], [M.vi(o, ["B", 2]) for o in "ab"] + [M.vi("c", ["B", 0])], opset=18)
    for m in (old, empty):
        assert split_contrib_ops(build_graph(load_model(m)))[1] == ()


def test_a_split_not_put_back_leaves_no_unread_sizes():
    m = _onnx_split("input")
    split, splits = split_contrib_ops(build_graph(load_model(m)))
    out = onnx.ModelProto()
    out.CopyFrom(split.model)
    out.graph.initializer.append(numpy_helper.from_array(np.array([2, 5, 3], np.int64), "sizes"))  # still there
    _fuse(out, {n.name for n in out.graph.node if n.op_type == "Slice" and n.output[0] == "a"} | {"relu_a"})
    restore(out, splits)
    assert "sizes" not in {t.name for t in out.graph.initializer}

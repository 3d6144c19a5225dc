"""rewriter.load: reading files, external data, refusals."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import rw_models as M
from ortfuse.errors import InputError, UnsupportedError
from ortfuse.rewriter import build_graph, load_model


def test_loads_file_and_leaves_it_untouched(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save_model(M.mlp(), path)
    before = M.sha256(path)
    model = load_model(path)
    model.graph.node[0].name = "changed"  # a private copy: editing it changes nothing on disk
    assert M.sha256(path) == before
    assert len(model.graph.node) == 6


def test_proto_argument_is_copied():
    original = M.mlp()
    model = load_model(original)
    model.graph.ClearField("node")
    assert len(original.graph.node) == 6


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="nope.onnx: no such file"):
        load_model(tmp_path / "nope.onnx")


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(InputError, match="not a file"):
        load_model(tmp_path)


@pytest.mark.parametrize("content", [b"hello, this is not a model\n", b"\xff\xfe\x00garbage" * 10, b""])
def test_not_onnx(tmp_path, content):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(InputError, match=r"bad\.onnx: not an ONNX model") as e:
        load_model(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.9, 0.99])
def test_truncated(tmp_path, fraction):
    data = M.mlp().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(InputError, match=r"cut\.onnx: "):
        load_model(path)


def test_external_data_round_trip(tmp_path):
    model = M.mlp()
    want = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    path = tmp_path / "ext.onnx"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.weights", size_threshold=0)  # moves the bytes out of `model`
    assert (tmp_path / "ext.weights").exists()
    loaded = load_model(path)
    for t in loaded.graph.initializer:
        assert t.data_location == onnx.TensorProto.DEFAULT
        np.testing.assert_array_equal(numpy_helper.to_array(t), want[t.name])
    graph = build_graph(loaded)
    np.testing.assert_array_equal(graph.constants["w"], want["w"])
    assert graph.tensors["y"].shape == ("batch", 3)


def test_external_data_file_missing(tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save_model(M.mlp(), path, save_as_external_data=True, location="ext.weights", size_threshold=0)
    (tmp_path / "ext.weights").unlink()
    with pytest.raises(InputError, match="ext.onnx"):
        load_model(path)


def test_proto_with_unloaded_external_data_is_refused(tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save_model(M.mlp(), path, save_as_external_data=True, location="ext.weights", size_threshold=0)
    with pytest.raises(InputError, match="pass the model's path"):
        load_model(onnx.load(path, load_external_data=False))


def test_unknown_op_names_node_and_op():
    model = M.make_model([helper.make_node("FancyOp", ["x"], ["y"], name="weird", domain="acme")],
                         [M.vi("x", [2])], [M.vi("y", [2])])
    model.opset_import.append(helper.make_opsetid("acme", 1))
    with pytest.raises(UnsupportedError, match="'weird' uses op acme::FancyOp"):
        load_model(model)


def test_unknown_default_domain_op():
    model = M.make_model([helper.make_node("Frobnicate", ["x"], ["y"], name="f")], [M.vi("x", [2])], [M.vi("y", [2])])
    with pytest.raises(UnsupportedError, match="ai.onnx::Frobnicate"):
        load_model(model)


def test_op_newer_than_model_opset_is_unknown():
    # Gelu joined the default domain at opset 20
    model = M.make_model([helper.make_node("Gelu", ["x"], ["y"], name="g")], [M.vi("x", [2])], [M.vi("y", [2])])
    with pytest.raises(UnsupportedError, match="Gelu"):
        load_model(model)


def test_contrib_and_function_ops_are_accepted():
    fn = helper.make_function("local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", M.OPSET)])
    nodes = [helper.make_node("FastGelu", ["x"], ["g"], name="fg", domain="com.microsoft"),
             helper.make_node("Twice", ["g"], ["y"], name="tw", domain="local")]
    model = M.make_model(nodes, [M.vi("x", [2])], [M.vi("y", [2])])
    model.opset_import.extend([helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("local", 1)])
    model.functions.append(fn)
    assert len(load_model(model).graph.node) == 2
    model.graph.node[0].op_type = "NotAContribOp"
    with pytest.raises(UnsupportedError, match="com.microsoft::NotAContribOp"):
        load_model(model)


def test_orts_own_default_domain_ops_are_accepted(tmp_path):
    # ORT's transformers optimizer writes SimplifiedLayerNormalization, and LayerNormalization before opset
    # 17, in the default domain: ORT defines both there, ONNX (and its checker) does not
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["s"], name="rms", epsilon=1e-6),
             helper.make_node("LayerNormalization", ["s", "w", "w"], ["y"], name="ln", axis=-1)]
    model = M.make_model(nodes, [M.vi("x", [2, 4])], [M.vi("y", [2, 4])], [w], opset=14)
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path)
    for source in (model, path):
        assert [n.domain for n in load_model(source).graph.node] == ["", ""]
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 14)]  # the checker's detour undone
    model.graph.node[0].op_type = "FrobnicatedLayerNormalization"
    with pytest.raises(UnsupportedError, match="ai.onnx::FrobnicatedLayerNormalization"):
        load_model(model)
    model.graph.node[0].op_type = "SimplifiedLayerNormalization"
    model.graph.node[1].input[0] = "nowhere"  # the rest of the checker still applies
    with pytest.raises(InputError, match="invalid ONNX model"):
        load_model(model)


def test_orts_own_ops_in_a_subgraph_are_accepted():
    # a merged decoder's If branch after ORT's optimizer: its RMSNorm is ORT's SimplifiedLayerNormalization
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    branch = lambda name: helper.make_graph(  # noqa: E731
        [helper.make_node("SimplifiedLayerNormalization", ["x", "w"], [f"{name}_y"], name=f"{name}_rms")], name, [],
        [M.vi(f"{name}_y", [2, 4])])
    node = helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch("then"), else_branch=branch("else"))
    model = M.make_model([node], [M.vi("c", [], onnx.TensorProto.BOOL), M.vi("x", [2, 4])], [M.vi("y", [2, 4])], [w])
    before = model.SerializeToString()
    assert len(load_model(model).graph.node) == 1
    assert model.SerializeToString() == before


def test_raw_bytes_must_match_dims_as_ort_requires(tmp_path):
    # large raw initializers are checked here, not by a second parse in the checker; ORT refuses any mismatch
    # (the checker, too few bytes only)
    for n in (299, 301):
        w = numpy_helper.from_array(np.ones(300, np.float32), "w")
        w.raw_data = np.ones(n, np.float32).tobytes()
        model = M.make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [M.vi("x", [300])],
                             [M.vi("y", [300])], [w])
        path = tmp_path / f"m{n}.onnx"
        onnx.save_model(model, path)
        for source in (model, path):
            with pytest.raises(InputError, match=f"initializer 'w' holds {4 * n} bytes of raw data; its dims "
                                                 r"\[300\] and type need 1200"):
                load_model(source)


def test_checker_failure_is_one_line_naming_the_node():
    model = M.make_model([helper.make_node("Relu", ["missing"], ["y"], name="r")], [M.vi("x", [2])], [M.vi("y", [2])])
    with pytest.raises(InputError, match="invalid ONNX model") as e:
        load_model(model)
    assert "\n" not in str(e.value) and "node: name: r OpType: Relu is not output" in str(e.value)
    # a complaint whose node the checker names only in its context below (ORT's quantizer raised the opset of
    # a Llama to 21 and left ReduceMean's axes as an attribute)
    model = M.make_model([helper.make_node("ReduceMean", ["x"], ["y"], name="norm/mean", axes=[-1])],
                         [M.vi("x", [2, 3])], [M.vi("y", [2, 1])], opset=18)
    with pytest.raises(InputError) as e:
        load_model(model)
    assert str(e.value) == ("model: invalid ONNX model: Unrecognized attribute: axes for operator ReduceMean "
                            "(node 'norm/mean', ReduceMean)")


def test_dtype_policy():
    ok = M.make_model([helper.make_node("Identity", ["x"], ["y"])], [M.vi("x", [2], onnx.TensorProto.STRING)],
                      [M.vi("y", [2], onnx.TensorProto.STRING)])
    load_model(ok)  # strings are ORT's business: never fused, not refused
    bad = M.make_model([helper.make_node("Identity", ["x"], ["y"])], [M.vi("x", [2], onnx.TensorProto.FLOAT6E2M3)],
                       [M.vi("y", [2], onnx.TensorProto.FLOAT6E2M3)], opset=25)
    with pytest.raises(InputError, match="graph input 'x' has element type FLOAT6E2M3"):
        load_model(bad)


def test_non_topological_model_is_sorted(tmp_path):
    model = M.mlp()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    path = tmp_path / "unsorted.onnx"
    onnx.save_model(model, path)
    loaded = load_model(path)
    seen = {"x", "w", "b"}
    for n in loaded.graph.node:
        assert all(i in seen for i in n.input)
        seen.update(n.output)


def test_cycle_is_an_input_error():
    nodes = [helper.make_node("Relu", ["b"], ["a"], name="ra"), helper.make_node("Relu", ["a"], ["b"], name="rb")]
    model = M.make_model(nodes, [M.vi("x", [2])], [M.vi("b", [2])])
    with pytest.raises(InputError, match="cycle through node Relu"):
        load_model(model)


def test_size_bound_is_at_least_the_serialized_size_without_serializing_weights():
    """`_proto.is_large` asks ByteSize() (which serializes every weight) only near the limit: the bound it
    takes first must never be under the true size, whatever way a tensor holds its data."""
    import numpy as np
    from onnx import TensorProto as TP, helper, numpy_helper

    from ortfuse.rewriter import _proto

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 33)).astype(np.float32), "raw32"),
             numpy_helper.from_array(rng.standard_normal(7).astype(np.float16), "raw16"),
             helper.make_tensor("floats", TP.FLOAT, [5], [1.5, -2.0, 3.0, 0.0, 1e30]),
             helper.make_tensor("ints", TP.INT64, [3], [-1, 2**40, 7]),
             helper.make_tensor("int8s", TP.INT8, [4], [-1, -128, 5, 0]),
             helper.make_tensor("int4", TP.INT4, [5], [-1, 2, 3, -8, 7]),
             helper.make_tensor("strings", TP.STRING, [2], [b"ab", b"c" * 300])]
    ext = numpy_helper.from_array(np.ones(4, np.float32), "ext")
    ext.ClearField("raw_data")
    ext.data_location = TP.EXTERNAL
    ext.external_data.add(key="location", value="w.bin")
    inits.append(ext)
    node = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.arange(300, dtype=np.float32)))
    both = numpy_helper.from_array(np.ones(8, np.float32), "both")  # raw bytes and a typed field: serialized
    both.float_data.extend([1.0] * 5000)
    inits.append(both)
    odd = numpy_helper.from_array(np.ones(3, np.uint8), "odd")
    odd.data_type = 999  # a type this onnx does not know: counted as serialized, no KeyError
    inits.append(odd)
    graph = helper.make_graph([node, helper.make_node("Identity", ["x"], ["y"], doc_string="d" * 500)], "gé" * 300,
                              [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, ["n", 3])], inits)
    m = helper.make_model(graph, doc_string="modèle " * 100)
    m.metadata_props.add(key="k", value="v" * 1000)
    m.configuration.add(name="c" * 10000)
    exact = m.ByteSize()
    assert exact <= _proto._size_bound(m) <= exact + 4096 + 200 * len(inits)


def test_a_value_info_retyping_an_initializer_is_dropped(tmp_path):
    # onnxruntime's fp16 converter on a torch.export model: a Resize's scales stay an fp32 initializer, their
    # value_info entry says fp16; ORT runs it (the initializer rules), ONNX's strict inference refuses it
    import onnxruntime as ort

    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, [1, 2, 4, 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, [1, 2, 8, 8])
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    g = helper.make_graph([helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")], "g", [x], [y],
                          [scales], value_info=[helper.make_tensor_value_info("scales", onnx.TensorProto.FLOAT16, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    path = tmp_path / "m.onnx"
    onnx.save_model(m, str(path))
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # ORT loads it
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(m, strict_mode=True)
    loaded = load_model(path)
    assert [v.name for v in loaded.graph.value_info] == []
    assert build_graph(loaded).tensors["y"].shape == (1, 2, 8, 8)
    assert len(onnx.load(str(path)).graph.value_info) == 1  # the file is left as it was

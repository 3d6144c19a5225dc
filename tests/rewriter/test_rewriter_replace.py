"""rewriter.replace: fused nodes with function fallbacks, validation, atomic save."""
from __future__ import annotations

import importlib
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import rw_models as M
from ortfuse.errors import InputError
from ortfuse.rewriter import FusedNode, _proto, build_graph, load_model, replace, save_model

replace_mod = importlib.import_module("ortfuse.rewriter.replace")  # the package exports a function of that name

VERSION_ATTR = (helper.make_attribute("ortfuse_version", 1),)


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def fused(nodes, inputs, outputs, k=0, op="Fused_0123456789") -> FusedNode:
    return FusedNode(f"ortfuse_region_{k}", op, tuple(nodes), tuple(inputs), tuple(outputs), VERSION_ATTR)


@pytest.fixture
def mlp_graph():
    return build_graph(load_model(M.mlp()))


# mlp: 0 c_half, 1 matmul, 2 add, 3 mul, 4 relu, 5 exp
def test_replace_runs_like_the_original(mlp_graph):
    model = replace(mlp_graph, [fused([2, 3, 4], ["mm", "b"], ["h", "y"])])
    onnx.checker.check_model(model, full_check=False)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Fused_0123456789", "Exp"]
    node = model.graph.node[1]
    assert node.domain == "ortfuse" and node.name == "ortfuse_region_0"
    assert list(node.input) == ["mm", "b"] and list(node.output) == ["h", "y"]
    assert helper.get_attribute_value(node.attribute[0]) == 1
    assert ("ortfuse", 1) in {(o.domain, o.version) for o in model.opset_import}
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    for got, want in zip(run(model, {"x": x}), run(mlp_graph.model, {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_function_body_embeds_scalar_constant(mlp_graph):
    model = replace(mlp_graph, [fused([2, 3, 4], ["mm", "b"], ["h", "y"])])
    (fn,) = model.functions
    assert (fn.domain, fn.name) == ("ortfuse", "Fused_0123456789")
    assert list(fn.input) == ["in0", "in1"] and list(fn.output) == ["out0", "out1"]
    assert [n.op_type for n in fn.node] == ["Constant", "Add", "Mul", "Relu"]
    assert helper.get_attribute_value(fn.node[0].attribute[0]) == 0.5
    assert {(o.domain, o.version) for o in fn.opset_import} == {("", M.OPSET)}
    # the Constant node outside is dead now; the initializer 'b' is still passed as an input
    assert "Constant" not in [n.op_type for n in model.graph.node]
    assert {t.name for t in model.graph.initializer} == {"w", "b"}


def test_constant_input_passed_transposed(mlp_graph):
    # the MatMul's region reads w [4, 3] transposed: the node gets a new [3, 4] initializer, the function
    # transposes it back, the original (read by nothing else now) goes
    import dataclasses
    f = dataclasses.replace(fused([1, 2], ["x", "w", "b"], ["h"]), input_perms=(("w", (1, 0)),))
    model = replace(mlp_graph, [f])
    node = next(n for n in model.graph.node if n.domain == "ortfuse")
    assert list(node.input) == ["x", "w__ortfuse_t10", "b"]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(inits["w__ortfuse_t10"], mlp_graph.constants["w"].T)
    assert "w" not in inits
    (fn,) = model.functions
    assert fn.node[0].op_type == "Transpose" and list(fn.node[0].input) == ["in1"]
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    for got, want in zip(run(model, {"x": x}), run(mlp_graph.model, {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_constant_transposed_by_a_perm_that_is_not_its_own_inverse():
    # y = x + w with w [2, 3, 4] passed as [3, 4, 2] (perm 1, 2, 0; its inverse is 2, 0, 1)
    w = np.random.default_rng(2).standard_normal((2, 3, 4)).astype(np.float16)
    f16 = onnx.TensorProto.FLOAT16
    m = M.make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [M.vi("x", [2, 3, 4], f16)],
                     [M.vi("y", [2, 3, 4], f16)], [numpy_helper.from_array(w, "w")])
    import dataclasses
    g = build_graph(load_model(m))
    model = replace(g, [dataclasses.replace(fused([0], ["x", "w"], ["y"]), input_perms=(("w", (1, 2, 0)),))])
    t = next(t for t in model.graph.initializer if t.name == "w__ortfuse_t120")
    assert t.data_type == onnx.TensorProto.FLOAT16 and list(t.dims) == [3, 4, 2]
    assert helper.get_attribute_value(model.functions[0].node[0].attribute[0]) == [2, 0, 1]
    x = np.random.default_rng(3).standard_normal((2, 3, 4)).astype(np.float16)
    np.testing.assert_array_equal(run(model, {"x": x})[0], x + w)


@pytest.mark.parametrize("perms,message", [
    ((("w", (0, 0)),), "not a permutation"),
    ((("x", (1, 0)),), "not a constant input"),
])
def test_bad_input_perms_are_refused(mlp_graph, perms, message):
    import dataclasses
    with pytest.raises(ValueError, match=message):
        replace(mlp_graph, [dataclasses.replace(fused([1, 2], ["x", "w", "b"], ["h"]), input_perms=perms)])


def test_unused_initializer_is_removed_and_value_info_pruned(mlp_graph):
    model = replace(mlp_graph, [fused([1, 2, 3, 4], ["x"], ["h", "y"])])  # w and b embedded
    assert not model.graph.initializer
    assert {vi.name for vi in model.graph.value_info} == {"h"}
    fn = model.functions[0]
    assert [n.op_type for n in fn.node[:3]] == ["Constant"] * 3
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(run(model, {"x": x})[0], run(mlp_graph.model, {"x": x})[0], rtol=1e-6)


def test_fused_output_value_info_kept(mlp_graph):
    model = replace(mlp_graph, [fused([1, 2], ["x", "w", "b"], ["h"])])
    assert {vi.name for vi in model.graph.value_info} >= {"h"}
    assert "mm" not in {vi.name for vi in model.graph.value_info}


def test_ir_version_in_range(mlp_graph):
    mlp_graph.model.ir_version = 14  # what onnx 1.23 writes by default
    model = replace(mlp_graph, [fused([5], ["h"], ["z"])])
    assert model.ir_version == 13
    old = build_graph(load_model(M.mlp()))
    old.model.ir_version = 7
    assert replace(old, [fused([5], ["h"], ["z"])]).ir_version == 8


def test_ir_version_follows_opset():
    assert _proto.target_ir_version(M.make_model([], [], [], opset=21)) == 10
    assert _proto.target_ir_version(M.make_model([], [], [], opset=11)) == 8


def test_two_regions_sharing_an_op_type_share_one_function():
    # two identical Add->Relu chains
    nodes = [helper.make_node("Add", ["x", "one"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Add", ["b", "one"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    graph = build_graph(load_model(M.make_model(nodes, [M.vi("x", [3])], [M.vi("y", [3])], [one])))
    model = replace(graph, [fused([0, 1], ["x"], ["b"], 0), fused([2, 3], ["b"], ["y"], 1)])
    assert len(model.functions) == 1 and not model.graph.initializer
    x = np.array([-3, 0, 2], np.float32)
    np.testing.assert_allclose(run(model, {"x": x})[0], [1, 2, 4])


def test_same_op_type_for_different_bodies_is_refused(mlp_graph):
    with pytest.raises(ValueError, match="already used for a different sub-graph"):
        replace(mlp_graph, [fused([4], ["s"], ["y"], 0), fused([5], ["h"], ["z"], 1)])


def test_fused_node_moves_to_a_valid_position():
    # region {0, 2} depends on node 1: the fused node must come after it
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="n0"), helper.make_node("Exp", ["x"], ["e"], name="n1"),
             helper.make_node("Add", ["a", "e"], ["y"], name="n2")]
    graph = build_graph(load_model(M.make_model(nodes, [M.vi("x", [2])], [M.vi("y", [2])])))
    model = replace(graph, [fused([0, 2], ["x", "e"], ["y"])])
    assert [n.op_type for n in model.graph.node] == ["Exp", "Fused_0123456789"]
    np.testing.assert_allclose(run(model, {"x": np.array([0, 1], np.float32)})[0], [1 - 0, np.e - 1], rtol=1e-6)


def test_replace_leaves_graph_model_untouched(mlp_graph):
    before = mlp_graph.model.SerializeToString()
    replace(mlp_graph, [fused([2, 3, 4], ["mm", "b"], ["h", "y"])])
    assert mlp_graph.model.SerializeToString() == before


# ---- validation: each inconsistency is a ValueError ----

@pytest.mark.parametrize("regions, message", [
    ([fused([2, 3], ["mm", "b"], ["h", "s"], 0), fused([3, 4], ["h"], ["y"], 1)], "both contain Mul"),
    ([fused([], [], [])], "empty region"),
    ([fused([9], [], [])], "out of range"),
    ([fused([2, 3, 4], ["b"], ["h", "y"])], "'mm' is read by the region but is neither"),
    ([fused([2, 3, 4], ["mm", "b", "x"], ["h", "y"])], "input 'x' is not read"),
    ([fused([2, 3, 4], ["mm", "b", "s"], ["h", "y"])], "input 's' is not read"),
    ([fused([2, 3, 4], ["mm", "b"], ["y"])], "'h' is used outside the region"),
    ([fused([2, 3], ["mm", "b"], ["h"])], "'s' is used outside the region"),
    ([fused([2, 3, 4], ["mm", "b"], ["h", "y", "mm"])], "output 'mm' is not produced"),
    ([fused([2, 3, 4], ["mm", "mm"], ["h", "y"])], "duplicate inputs"),
    ([FusedNode("add", "Fused_x", (5,), ("h",), ("z",))], "already in use"),
])
def test_inconsistent_regions(mlp_graph, regions, message):
    with pytest.raises(ValueError, match=message):
        replace(mlp_graph, regions)


def test_cycle_after_contraction():
    # 0 -> 1 -> 2 and 0 -> 2: fusing {0, 2} around 1 would need 1 both before and after the region
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="n0"), helper.make_node("Exp", ["a"], ["e"], name="n1"),
             helper.make_node("Add", ["a", "e"], ["y"], name="n2")]
    graph = build_graph(load_model(M.make_model(nodes, [M.vi("x", [2])], [M.vi("y", [2])])))
    with pytest.raises(ValueError, match="cycle.*ortfuse_region_0"):
        replace(graph, [fused([0, 2], ["x", "e"], ["a", "y"])])


def test_control_flow_is_not_fused():
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["o1"])], "then", [], [M.vi("o1", [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["o2"])], "else", [], [M.vi("o2", [2])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    model = M.make_model(nodes, [M.vi("c", [], onnx.TensorProto.BOOL), M.vi("x", [2])], [M.vi("y", [2])])
    graph = build_graph(load_model(model))
    with pytest.raises(ValueError, match="control-flow"):
        replace(graph, [fused([0], ["c", "x"], ["y"])])


# ---- save ----

def test_save_round_trip_and_input_untouched(tmp_path):
    src = tmp_path / "in.onnx"
    onnx.save_model(M.mlp(), src)
    digest = M.sha256(src)
    graph = build_graph(load_model(src))
    model = replace(graph, [fused([2, 3, 4], ["mm", "b"], ["h", "y"])])
    out = tmp_path / "out.onnx"
    save_model(model, out)
    assert M.sha256(src) == digest
    assert sorted(os.listdir(tmp_path)) == ["in.onnx", "out.onnx"]
    again = load_model(out)
    assert again.ir_version == model.ir_version <= 13
    onnx.checker.check_model(str(out))
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(run(again, {"x": x})[1], run(graph.model, {"x": x})[1])


def test_save_sets_ir_version_without_touching_the_model(tmp_path):
    model = M.mlp()
    model.ir_version = 14
    save_model(model, tmp_path / "m.onnx")
    assert model.ir_version == 14
    assert onnx.load(tmp_path / "m.onnx").ir_version == 13


def test_failed_save_leaves_no_temp_file(tmp_path, monkeypatch):
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(replace_mod.os, "replace", broken_replace)
    with pytest.raises(InputError, match="out.onnx: cannot write"):
        save_model(M.mlp(), out)
    assert os.listdir(tmp_path) == ["out.onnx"] and out.read_bytes() == b"previous"


def test_failed_large_save_leaves_no_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(_proto, "PROTOBUF_LIMIT", 64)
    monkeypatch.setattr(replace_mod.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(InputError):
        save_model(M.mlp(), tmp_path / "out.onnx")
    assert os.listdir(tmp_path) == []


def test_save_to_missing_folder(tmp_path):
    with pytest.raises(InputError, match="folder does not exist"):
        save_model(M.mlp(), tmp_path / "no" / "m.onnx")


def test_large_model_saved_with_external_data(tmp_path, monkeypatch):
    w = numpy_helper.from_array(np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Tanh", ["m"], ["y"])]
    source = M.make_model(nodes, [M.vi("x", ["n", 64])], [M.vi("y", ["n", 64])], [w])
    monkeypatch.setattr(_proto, "PROTOBUF_LIMIT", 64)  # every model counts as "over 2 GB"
    graph = build_graph(load_model(source))
    model = replace(graph, [fused([1], ["m"], ["y"])])  # checked by path
    before = model.SerializeToString()
    save_model(model, tmp_path / "big.onnx")
    assert model.SerializeToString() == before
    assert sorted(os.listdir(tmp_path)) == ["big.onnx", "big.onnx.data"]
    monkeypatch.undo()
    assert (tmp_path / "big.onnx").stat().st_size < 64 * 64 * 4
    again = load_model(tmp_path / "big.onnx")
    x = np.ones((3, 64), np.float32)
    np.testing.assert_allclose(run(again, {"x": x})[0], run(source, {"x": x})[0], rtol=1e-6)


def test_the_structural_check_reads_no_weights_and_still_catches_a_dangling_input():
    """`replace` checks its output with the large raw initializers emptied (they were checked at load or come
    from numpy): the weightless copy keeps every name, type and small tensor, the checker still refuses a
    node reading a tensor nothing produces, and the model itself is untouched."""
    from onnx import TensorProto as TP

    from ortfuse.rewriter import _proto

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    small = numpy_helper.from_array(np.ones(4, np.float32), "b")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])],
                          "g", [helper.make_tensor_value_info("x", TP.FLOAT, [4, 64])],
                          [helper.make_tensor_value_info("z", TP.FLOAT, [4, 64])], [w, small])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    m.metadata_props.add(key="k", value="v")
    before = m.SerializeToString()
    light = _proto._weightless(m)
    assert [(t.name, list(t.dims)) for t in light.graph.initializer] == [("w", [0]), ("b", [4])]
    assert light.metadata_props[0].value == "v" and light.opset_import[0].version == 17
    _proto.check_model(m, weights=False)
    m.graph.node[1].input[0] = "nowhere"
    with pytest.raises(onnx.checker.ValidationError):
        _proto.check_model(m, weights=False)
    m.graph.node[1].input[0] = "y"
    assert m.SerializeToString() == before

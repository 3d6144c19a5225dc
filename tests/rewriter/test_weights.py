"""rewriter.weights: large weights kept out of the protobuf while optimizing (stubs into a store), read back
through Constants, mapped from external data, and written out byte for byte."""
from __future__ import annotations

import gc
import importlib
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import rw_models as M
from ortfuse.errors import InputError
from ortfuse.rewriter import _infer, _proto, build_graph, load_model, weights
from ortfuse.rewriter.replace import save_model

replace_mod = importlib.import_module("ortfuse.rewriter.replace")  # the package exports a function of that name


@pytest.fixture
def small_stubs(monkeypatch):
    """Tensors over 64 bytes go to the store, so the tests' tiny weights do."""
    monkeypatch.setattr(weights, "STUB_BYTES", 64)


def _mlp_with_extras() -> onnx.ModelProto:
    """A MatMul weight (fp32), a bf16 and an int64 initializer over 64 bytes, a small bias, metadata, value_info,
    a function: every field around the initializers that the writer must place in order."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.arange(8, dtype=np.float32), "b")
    idx = numpy_helper.from_array(np.arange(24, dtype=np.int64) % 8, "idx")
    bf16 = (rng.standard_normal(40).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncated
    bf = helper.make_tensor("bf", TP.BFLOAT16, [40], bf16.tobytes(), raw=True)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Gather", ["a", "idx"], ["y"], axis=1),
             helper.make_node("Cast", ["bf"], ["bf32"], to=TP.FLOAT), helper.make_node("ReduceSum", ["bf32"], ["s"],
                                                                                        keepdims=0)]
    m = M.make_model(nodes, [M.vi("x", ["n", 16])], [M.vi("y", ["n", 24]), M.vi("s", [])], [w, b, idx, bf])
    m.graph.value_info.append(M.vi("m", ["n", 8]))
    m.metadata_props.add(key="k", value="v")
    m.doc_string = "doc"
    return m


def test_load_into_a_store_leaves_stubs_that_constants_read(small_stubs):
    src = _mlp_with_extras()
    want = {t.name: numpy_helper.to_array(t) for t in src.graph.initializer}
    store = weights.WeightStore()
    model = load_model(src, store)
    stubbed = {t.name for t in model.graph.initializer if weights.is_stub(t)}
    assert stubbed == {"w", "idx", "bf"}  # the bias (32 bytes) stays in the proto
    assert store.nbytes == 16 * 8 * 4 + 24 * 8 + 40 * 2 and model.ByteSize() < 700
    assert all(t.HasField("raw_data") for t in src.graph.initializer)  # the caller's model is untouched
    g = build_graph(model)
    for name, value in want.items():
        np.testing.assert_array_equal(g.constants[name], value)
    assert not g.constants["w"].flags.writeable  # a view of the store's bytes
    with pytest.raises(ValueError):
        g.constants["w"][0, 0] = 1
    assert g.tensors["y"].shape == ("n", 24)  # shape inference ran on the stubbed model (int64 stub filled)


def test_materialized_and_written_models_are_the_original(small_stubs):
    src = _mlp_with_extras()
    src.functions.append(helper.make_function("local", "F", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])],
                                              [helper.make_opsetid("", 17)]))
    store = weights.WeightStore()
    model = load_model(src, store)
    full = weights.materialized(model)
    assert not weights.has_stubs(full) and weights.has_stubs(model)
    assert full.SerializeToString() == load_model(src).SerializeToString()
    f = io.BytesIO()
    weights.write_materialized(model, f)
    assert f.getvalue() == full.SerializeToString()  # byte for byte, field order included


def test_saved_stubbed_model_runs_like_the_source(tmp_path, small_stubs):
    src = _mlp_with_extras()
    store = weights.WeightStore()
    model = load_model(src, store)
    save_model(model, tmp_path / "out.onnx")
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    want = ort.InferenceSession(src.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_large_save_streams_stubs_into_the_data_file(tmp_path, small_stubs, monkeypatch):
    src = _mlp_with_extras()
    store = weights.WeightStore()
    model = load_model(src, store)
    monkeypatch.setattr(_proto, "PROTOBUF_LIMIT", 64)  # every model counts as "over 2 GB"
    monkeypatch.setattr(replace_mod, "EXTERNAL_BYTES", 100)  # and w (512 bytes) and idx (192) go to its data
    assert _proto.is_large(model)
    save_model(model, tmp_path / "big.onnx")
    monkeypatch.undo()
    again = onnx.load(str(tmp_path / "big.onnx"), load_external_data=False)
    assert {t.name for t in again.graph.initializer if t.data_location == TP.EXTERNAL} == {"w", "idx"}
    assert weights.has_stubs(model)  # left as it was
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "big.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    want = ort.InferenceSession(src.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_is_large_counts_the_stubs_bytes(small_stubs, monkeypatch):
    store = weights.WeightStore()
    model = load_model(_mlp_with_extras(), store)
    full = weights.materialized(model).ByteSize()
    monkeypatch.setattr(_proto, "PROTOBUF_LIMIT", full - 8)
    assert model.ByteSize() < full - 8 and _proto.is_large(model)
    bound = model.ByteSize() + sum(weights.stub_bytes(t) + 16 for t in weights.stubs(model))  # stubs' framing
    assert full <= bound <= full + sum(16 + t.ByteSize() for t in weights.stubs(model))  # (stubs' own fields)
    monkeypatch.setattr(_proto, "PROTOBUF_LIMIT", bound + 1)
    assert not _proto.is_large(model)


def test_new_weights_of_a_stubbed_model_join_its_store(small_stubs):
    store = weights.WeightStore()
    model = load_model(_mlp_with_extras(), store)
    before = len(store)
    model.graph.initializer.append(numpy_helper.from_array(np.ones((8, 8), np.float32), "new"))
    g = build_graph(model)  # `assemble` sets new weights aside
    assert weights.is_stub(next(t for t in g.model.graph.initializer if t.name == "new")) and len(store) == before + 1
    store.keep_only([g.model])
    assert len(store) == before + 1
    store.keep_only([])
    assert len(store) == 0


def test_a_model_without_a_store_is_left_as_it_is(small_stubs):
    model = load_model(_mlp_with_extras())
    assert not weights.has_stubs(build_graph(model).model) and weights.set_aside(model) == 0


def test_a_stub_outliving_its_store_says_so(small_stubs):
    store = weights.WeightStore()
    model = load_model(_mlp_with_extras(), store)
    g = build_graph(model)
    del store
    gc.collect()
    np.testing.assert_array_equal(g.constants["idx"] % 8, g.constants["idx"])  # the graph holds the store
    del g
    gc.collect()
    w = next(t for t in model.graph.initializer if t.name == "w")
    with pytest.raises(RuntimeError, match="'w': its weight store was released"):
        weights.array_of(w)


# ---- external data, memory-mapped --------------------------------------------------------------------------

def _external(tmp_path, threshold: int = 0):
    """The model saved with its tensors in ext.bin beside it, in a folder of its own under tmp_path."""
    src = _mlp_with_extras()
    (tmp_path / "model").mkdir()
    path = tmp_path / "model" / "ext.onnx"
    onnx.save_model(onnx.load_from_string(src.SerializeToString()), path, save_as_external_data=True,
                    all_tensors_to_one_file=True, location="ext.bin", size_threshold=threshold)
    return src, path


def test_external_data_is_mapped_not_read(tmp_path):
    src, path = _external(tmp_path)
    store = weights.WeightStore()
    model = load_model(path, store)
    assert {t.name for t in model.graph.initializer if weights.is_stub(t)} == {"w", "b", "idx", "bf"}
    buf = weights.buffer_of(next(t for t in model.graph.initializer if t.name == "w"))
    assert isinstance(buf.base, np.memmap) or isinstance(buf, np.memmap)
    g = build_graph(model)
    for t in src.graph.initializer:
        np.testing.assert_array_equal(g.constants[t.name], numpy_helper.to_array(t))


def _edit_external(path, name: str, **entries: str) -> None:
    m = onnx.load(str(path), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.name == name)
    for e in t.external_data:
        if e.key in entries:
            e.value = entries.pop(e.key)
    for k, v in entries.items():
        t.external_data.add(key=k, value=v)
    onnx.save_model(m, str(path))


@pytest.mark.parametrize("edit,message", [
    ({"length": "12"}, r"ext\.onnx: initializer 'w': external data holds 12 bytes, its dims \[16, 8\] need 512"),
    ({"offset": "100000"}, r"initializer 'w': external data \[100000, 100512\) lies beyond the end of ext\.bin"),
    ({"location": "../ext.bin"}, r"initializer 'w': external data location '\.\./ext\.bin' lies outside"),
    ({"location": "gone.bin"}, r"initializer 'w': external data file 'gone\.bin' not found"),
])
def test_bad_external_references_name_the_initializer(tmp_path, edit, message):
    _, path = _external(tmp_path)
    (tmp_path / "ext.bin").write_bytes((path.parent / "ext.bin").read_bytes())  # what '../ext.bin' would read
    _edit_external(path, "w", **edit)
    with pytest.raises(InputError, match=message):
        load_model(path, weights.WeightStore())


def test_skeleton_keeps_integer_stubs_readable(small_stubs):
    store = weights.WeightStore()
    model = load_model(_mlp_with_extras(), store)
    sk = _infer._skeleton(model)
    idx = next(t for t in sk.graph.initializer if t.name == "idx")
    assert not weights.is_stub(idx) and numpy_helper.to_array(idx).tolist() == [k % 8 for k in range(24)]


def test_a_stubbed_model_given_to_load_model_is_filled(small_stubs):
    """`replace` returns stubs into the graph's store; `check_models` and `load_model` take such a model as any."""
    store = weights.WeightStore()
    model = load_model(_mlp_with_extras(), store)
    again = load_model(model)
    assert not weights.has_stubs(again) and again.SerializeToString() == weights.materialized(model).SerializeToString()


def test_unknown_fields_and_segments_survive_the_store(small_stubs):
    """Fields a newer onnx writes (unknown to this one) stay where protobuf keeps them, and a tensor with a
    `segment` (a message field) is stubbed and filled like any other."""
    src = _mlp_with_extras()
    w = next(t for t in src.graph.initializer if t.name == "w")
    w.segment.begin, w.segment.end = 0, 128
    m = onnx.ModelProto()
    m.ParseFromString(src.SerializeToString() + bytes([0x98, 0x06, 0x05]))  # ModelProto field 99 = 5
    g = onnx.GraphProto()
    g.ParseFromString(m.graph.SerializeToString() + bytes([0xA2, 0x06, 0x02, 0x68, 0x69]))  # field 100 = b"hi"
    m.graph.CopyFrom(g)
    store = weights.WeightStore()
    model = load_model(m, store)
    assert weights.is_stub(next(t for t in model.graph.initializer if t.name == "w"))
    full = weights.materialized(model)
    assert full.SerializeToString() == load_model(m).SerializeToString()
    f = io.BytesIO()
    weights.write_materialized(model, f)
    assert f.getvalue() == full.SerializeToString() and f.getvalue().endswith(bytes([0x98, 0x06, 0x05]))


def test_stubs_of_another_process_are_refused(tmp_path, small_stubs):
    store = weights.WeightStore()
    model = load_model(_mlp_with_extras(), store)
    foreign = onnx.ModelProto()
    foreign.CopyFrom(model)
    for t in foreign.graph.initializer:
        for e in t.external_data:
            e.value = e.value.replace(weights._TOKEN, "0" * 32)  # as another process names its stores
    with pytest.raises(InputError, match="initializer 'w' is a stub of a weight store that is gone"):
        load_model(foreign)
    onnx.save_model(model, str(tmp_path / "stubbed.onnx"))  # written as is, by mistake
    with pytest.raises(InputError, match=r"stubbed\.onnx: initializer 'w' is a stub of ortfuse's weight store"):
        load_model(tmp_path / "stubbed.onnx")


def test_negative_dims_in_external_data_are_refused(tmp_path):
    _, path = _external(tmp_path)
    m = onnx.load(str(path), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.name == "w")
    t.dims[0] = -1
    onnx.save_model(m, str(path))
    with pytest.raises(InputError, match=r"initializer 'w': negative dims \[-1, 8\]"):
        load_model(path, weights.WeightStore())


def test_compile_model_keeps_stubs_for_its_result_only(small_stubs):
    """`compile_model` keeps its result's weights in the store (`save` streams them); `replace` called by anyone
    else, `result.model` and `ortfuse.InferenceSession(result.stubbed)` give or take filled models."""
    import ortfuse
    from ortfuse.api import compile_model
    from ortfuse.rewriter.replace import replace

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    g = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32) + 1, "g")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Tanh", ["m"], ["t"]),
             helper.make_node("Mul", ["t", "g"], ["u"]), helper.make_node("Sigmoid", ["u"], ["y"])]
    src = M.make_model(nodes, [M.vi("x", ["n", 16])], [M.vi("y", ["n", 16])], [w, g])
    res = compile_model(src, None, "sm_90")
    assert weights.has_stubs(res.stubbed) and not weights.has_stubs(res.model) and res.kernels
    assert not weights.has_stubs(replace(res.graph, [k.node for k in res.kernels]))
    x = rng.standard_normal((3, 16)).astype(np.float32)
    want = ort.InferenceSession(src.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with pytest.warns(ortfuse.runtime.FallbackWarning):
        sess = ortfuse.InferenceSession(res.stubbed, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)

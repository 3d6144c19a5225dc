"""The CPU probe op `ortfuse.probe::Probe` makes every ORT ABI slot of libortfuse_ops observable: a wrong
slot index changes a value below, fails a load or raises instead of the expected message."""
from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from ortfuse.runtime import CONFIG_KEY, library_path
from rt_models import FACTS, PROBE, model, vi

CPU = ["CPUExecutionProvider"]
ATTRS = dict(alpha=2.5, beta=3, ints=[1, 2, 3, 10], floats=[0.5, 0.25, 4.0], tag="hello probe",
             table=numpy_helper.from_array(np.array([[1.0, 2.0], [3.5, -1.0]], np.float32)))


def probe_model(inputs=None, name: str = "probe_node", out_types=(T.FLOAT, T.INT64, T.FLOAT), **overrides):
    attrs = {**ATTRS, **overrides}
    inputs = inputs or [vi("X", T.FLOAT, ["batch", 3]), vi("D", T.DOUBLE, [2]), vi("I", T.INT64, [2, 5])]
    node = helper.make_node("Probe", [i.name for i in inputs], ["Y", "F", "S"], name=name, domain=PROBE[0],
                            **{k: v for k, v in attrs.items() if v is not None})
    outputs = [vi(n, t, None) for n, t in zip(["Y", "F", "S"], out_types)]
    return model([node], inputs, outputs, [PROBE])


def session(m, options: ort.SessionOptions | None = None) -> ort.InferenceSession:
    options = options or ort.SessionOptions()
    options.register_custom_ops_library(library_path())
    return ort.InferenceSession(m.SerializeToString(), options, providers=CPU)


def feeds(batch: int = 2) -> dict[str, np.ndarray]:
    return {"X": np.arange(batch * 3, dtype=np.float32).reshape(batch, 3),
            "D": np.array([1.0, 2.0]), "I": np.arange(10, dtype=np.int64).reshape(2, 5)}


def test_probe_values_cover_every_slot() -> None:
    sess = session(probe_model())
    f = feeds()
    y, facts, sums = sess.run(None, f)
    np.testing.assert_allclose(y, f["X"] * 2.5 + 3)  # float (85) and int (86) attributes, GetOutput (91)
    got = dict(zip(FACTS, facts.tolist()))
    assert got == {
        "tag_len": len("hello probe"),        # string attribute (87)
        "ints_sum": 16, "ints_count": 4,      # ints attribute (163)
        "ctx_inputs": 3, "ctx_outputs": 3,    # 88, 89
        "info_inputs": 3, "info_outputs": 3,  # 230, 231
        "node_name_len": len("probe_node"),   # 244
        "device_id": 0, "mem_is_cpu": 1,      # 278 -> 77 -> 72 / 71
        "last_dtype": T.INT64, "last_rank": 2, "last_dim_sum": 7, "last_count": 10,  # 65, 60, 61, 62, 64
        "last_value_type": 1, "last_int64_sum": 45,  # 67, 51
        "stream_is_null": 1,                  # 193 gives NULL on the CPU EP
        "table_dtype": T.FLOAT,               # tensor attribute (236, 78)
    }
    np.testing.assert_allclose(sums, [4.75, 5.5, 3, 2.5])  # floats (162), tensor sum, count, alpha


def test_probe_shape_inference_sets_dtypes_and_shapes() -> None:
    sess = session(probe_model())  # 267-272, 57-59, 63: outputs declared without shapes
    outs = {o.name: (o.type, o.shape) for o in sess.get_outputs()}
    assert outs == {"Y": ("tensor(float)", ["batch", 3]), "F": ("tensor(int64)", [len(FACTS)]),
                    "S": ("tensor(float)", [4])}


def test_probe_inferred_dtype_is_enforced() -> None:
    # Without our InferOutputShapeFn ORT would guess float for F; declaring float must now fail.
    with pytest.raises(Exception, match="(?i)type"):
        session(probe_model(out_types=(T.FLOAT, T.FLOAT, T.FLOAT)))


def test_probe_batch_sizes_and_int64_table() -> None:
    table = numpy_helper.from_array(np.array([5, 6, 7], np.int64))
    sess = session(probe_model(table=table))
    for batch in (1, 4, 0):
        y, facts, sums = sess.run(None, feeds(batch))
        assert y.shape == (batch, 3)
        assert facts[FACTS.index("table_dtype")] == T.INT64
        assert sums[1] == 18


def test_probe_compute_error_names_node() -> None:
    sess = session(probe_model(fail=1, name="failing_probe"))
    with pytest.raises(Exception, match="failing_probe.*failed on request"):
        sess.run(None, feeds())


def test_probe_create_error_names_node() -> None:
    with pytest.raises(Exception, match="refusing_probe.*refused creation"):
        session(probe_model(fail_create=1, name="refusing_probe"))


def test_probe_shape_inference_error_is_swallowed_by_ort() -> None:
    # ORT 1.31 ignores an error status from InferOutputShapeFn (not even logged): the load succeeds and
    # the outputs keep their declared, shapeless types. So the fused op validates fully at create time.
    sess = session(probe_model(fail_infer=1))
    assert [o.shape for o in sess.get_outputs()] == [[], [], []]
    assert sess.run(["Y"], feeds())[0].shape == (2, 3)


@pytest.mark.parametrize("missing", ["alpha", "beta", "ints", "floats", "tag", "table"])
def test_probe_missing_attribute_is_an_error(missing: str) -> None:
    with pytest.raises(Exception, match=f"probe_node.*attribute '{missing}'"):
        session(probe_model(**{missing: None}))


def test_probe_too_many_ints_is_an_error() -> None:
    with pytest.raises(Exception, match="at most 64"):
        session(probe_model(ints=list(range(65))))


def test_probe_domain_shared_by_sessions_and_options() -> None:
    first = session(probe_model())
    second = session(probe_model(name="other"))
    np.testing.assert_allclose(first.run(["Y"], feeds())[0], second.run(["Y"], feeds())[0])
    del first
    assert second.run(["F"], feeds())[0][FACTS.index("node_name_len")] == len("other")


def test_bad_op_type_list_is_refused() -> None:
    options = ort.SessionOptions()
    options.add_session_config_entry(CONFIG_KEY, "Fused_ok, bad-name")
    with pytest.raises(Exception, match="bad op type 'bad-name'"):
        options.register_custom_ops_library(library_path())


def test_library_loads_without_cuda_and_exports_one_symbol() -> None:
    lib = ctypes.CDLL(library_path())  # libcuda is dlopened lazily, never at load time
    assert hasattr(lib, "RegisterCustomOps")
    nm = subprocess.run(["nm", "-D", "--defined-only", library_path()], capture_output=True, text=True)
    if nm.returncode == 0:
        assert [line.split()[-1] for line in nm.stdout.splitlines()] == ["RegisterCustomOps"]
    ldd = subprocess.run(["ldd", library_path()], capture_output=True, text=True)
    if ldd.returncode == 0:
        assert "onnxruntime" not in ldd.stdout and "libcuda" not in ldd.stdout

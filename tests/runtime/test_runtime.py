"""ortfuse.runtime on a machine without a working CUDA EP: the fallback to function bodies, `register`,
the library build."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

import ortfuse
from ortfuse.errors import OrtfuseError
from ortfuse.runtime import (CONFIG_KEY, FallbackWarning, _cuda_usable, cuda_active, fused_op_types, library_path,
                             register)
from rt_models import FUSED, FUSED_TYPE, axpy_model, axpy_reference, model, vi

CPU = ["CPUExecutionProvider"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def feeds(n: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {"X": rng.standard_normal((n, 4), np.float32), "Y": rng.standard_normal((n, 4), np.float32)}


def fallback_warnings(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, FallbackWarning)]


@pytest.mark.parametrize("providers", [CPU, ["CUDAExecutionProvider", "CPUExecutionProvider"]])
def test_fallback_runs_function_with_one_warning(providers: list[str]) -> None:
    if "CUDAExecutionProvider" in providers and _cuda_usable(providers, None):
        pytest.skip("CUDA EP works here: no fallback (the fake cubins would be loaded)")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        sess = ortfuse.InferenceSession(axpy_model(), providers=providers)
    found = fallback_warnings(record)
    assert len(found) == 1 and "function bodies" in str(found[0].message)
    assert found[0].filename == __file__  # points at the caller
    assert isinstance(sess, ort.InferenceSession) and not sess.fused_kernels and not cuda_active(sess)
    f = feeds()
    z, w = sess.run(None, f)
    ref_z, ref_w = axpy_reference(f["X"], f["Y"])
    np.testing.assert_allclose(z, ref_z, rtol=1e-6)
    np.testing.assert_array_equal(w, ref_w)


def test_fallback_from_path_and_bytes(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(axpy_model(), path)
    f = feeds(2)
    for source in (str(path), path, axpy_model().SerializeToString()):
        with pytest.warns(FallbackWarning):
            sess = ortfuse.InferenceSession(source, providers=CPU)
        np.testing.assert_allclose(sess.run(["Z"], f)[0], axpy_reference(f["X"], f["Y"])[0], rtol=1e-6)


def test_fallback_keeps_user_options_and_io_binding() -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    with pytest.warns(FallbackWarning):
        sess = ortfuse.InferenceSession(axpy_model(), options, providers=CPU)
    assert sess.get_session_options().intra_op_num_threads == 1
    with pytest.raises(RuntimeError):
        options.get_session_config_entry(CONFIG_KEY)  # the library was never registered
    f = feeds(4)
    io = sess.io_binding()
    io.bind_cpu_input("X", f["X"])
    io.bind_cpu_input("Y", f["Y"])
    io.bind_output("Z")
    io.bind_output("W")
    sess.run_with_iobinding(io)
    np.testing.assert_allclose(io.copy_outputs_to_cpu()[0], axpy_reference(f["X"], f["Y"])[0], rtol=1e-6)


def test_model_without_fused_nodes_is_plain() -> None:
    m = model([helper.make_node("Relu", ["X"], ["Z"])], [vi("X", T.FLOAT, [2])], [vi("Z", T.FLOAT, [2])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sess = ortfuse.InferenceSession(m, providers=CPU)
    assert sess.run(None, {"X": np.array([-1, 2], np.float32)})[0].tolist() == [0, 2]


def test_register_then_cpu_session_is_refused_by_ort() -> None:
    # A registered CUDA-only op shadows the function: ORT will not place the node on the CPU EP.
    options = ort.SessionOptions()
    assert register(options, axpy_model()) == [FUSED_TYPE]
    assert options.get_session_config_entry(CONFIG_KEY) == FUSED_TYPE
    with pytest.raises(Exception, match=f"NOT_IMPLEMENTED.*{FUSED_TYPE}"):
        ort.InferenceSession(axpy_model().SerializeToString(), options, providers=CPU)


def test_register_twice() -> None:
    options = ort.SessionOptions()
    register(options, axpy_model())
    register(options, axpy_model())  # same op types: no-op
    with pytest.raises(OrtfuseError, match="fresh SessionOptions"):
        register(options, axpy_model(op_type="Fused_abcdefabcd"))


def test_fused_op_types_walks_subgraphs() -> None:
    inner = helper.make_graph([helper.make_node("Fused_aaaaaaaaaa", ["X"], ["Z"], domain="ortfuse")], "b", [],
                              [vi("Z", T.FLOAT, [2])])
    node = helper.make_node("If", ["C"], ["Z"], then_branch=inner, else_branch=inner)
    top = helper.make_node("Fused_bbbbbbbbbb", ["Z"], ["Q"], domain="ortfuse")
    m = model([node, top], [vi("C", T.BOOL, []), vi("X", T.FLOAT, [2])], [vi("Q", T.FLOAT, [2])], [FUSED])
    assert fused_op_types(m) == ["Fused_aaaaaaaaaa", "Fused_bbbbbbbbbb"]


def test_library_path_points_at_the_built_library() -> None:
    path = library_path()
    assert os.path.isabs(path) and path.endswith("libortfuse_ops.so") and os.path.isfile(path)


def test_build_without_compiler_says_so(tmp_path) -> None:
    env = {**os.environ, "CC": "no-such-cc", "PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp_path / "b")], cwd=REPO,
                         env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "ortfuse: no C compiler found" in out.stderr + out.stdout


def test_build_produces_the_library(tmp_path) -> None:
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ortfuse" / "customops" / "libortfuse_ops.so").is_file()


def test_gpu_test_kernel_compiles_with_nvrtc() -> None:
    # NVRTC needs no GPU: keep the kernel of test_gpu.py compiling against customops/include.
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    pytest.importorskip("nvidia.cu13")
    from rt_models import AXPY_SOURCE, nvrtc_compile

    assert nvrtc_compile(AXPY_SOURCE, "sm_90")[:4] == b"\x7fELF"
    assert b".entry ofz_test_axpy" in nvrtc_compile(AXPY_SOURCE, "compute_75")

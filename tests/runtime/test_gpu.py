"""The fused CUDA op in ORT's CUDA EP, against numpy. Skipped unless the CUDA EP really works
(tests/conftest.py). The kernel is tests/runtime/rt_models.py::AXPY_SOURCE compiled with NVRTC."""
from __future__ import annotations

import ctypes
import functools
import json
import warnings
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

import ortfuse
from ortfuse.runtime import FallbackWarning, register
from rt_models import AXPY_SOURCE, axpy_model, axpy_reference, nvrtc_compile

pytestmark = pytest.mark.gpu
CUDA = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]


@functools.lru_cache(maxsize=None)
def device_cc() -> int:
    """Compute capability of device 0 as an int (90 for sm_90), from the driver."""
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0
    assert cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0
    return major.value * 10 + minor.value


@functools.lru_cache(maxsize=None)
def cubin() -> bytes:
    return nvrtc_compile(AXPY_SOURCE, f"sm_{device_cc()}")


@functools.lru_cache(maxsize=None)
def ptx() -> bytes:
    return nvrtc_compile(AXPY_SOURCE, "compute_75")


def gpu_model(op_type: str = "Fused_00000000a1", n: Any = "N", use_ptx: bool = False,
              cubins: dict[int, bytes] | None = None, **overrides: Any):
    """The axpy model with real images: a cubin for this device (none with use_ptx) and PTX for compute_75."""
    if cubins is None:
        cubins = {} if use_ptx else {device_cc(): cubin()}
    return axpy_model(op_type=op_type, n=n, cubins=cubins, ptx=ptx(), **overrides)


def fused_session(m, **kwargs: Any) -> ortfuse.InferenceSession:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        sess = ortfuse.InferenceSession(m, providers=kwargs.pop("providers", CUDA), **kwargs)
    assert sess.fused_kernels
    return sess


def feeds(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + n)
    return {"X": rng.standard_normal((n, 4), np.float32), "Y": rng.standard_normal((n, 4), np.float32)}


def check(outputs: list[np.ndarray], f: dict[str, np.ndarray]) -> None:
    z, w = outputs
    ref_z, ref_w = axpy_reference(f["X"], f["Y"])
    assert z.shape == ref_z.shape and w.dtype == np.float16
    np.testing.assert_allclose(z, ref_z, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w.astype(np.float32), ref_w.astype(np.float32), rtol=1e-3, atol=1e-3)


def test_fused_kernel_matches_numpy_for_several_bindings_of_n(tmp_path) -> None:
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "prof")
    sess = fused_session(gpu_model(), sess_options=options)
    for n in (1, 7, 32, 1000, 0, 4097, 100_000):
        f = feeds(n)
        check(sess.run(None, f), f)
    with open(sess.end_profiling()) as fh:
        events = [e for e in json.load(fh) if e.get("cat") == "Node"]
    placed = {e["args"].get("op_name"): e["args"].get("provider") for e in events}
    assert placed.get("Fused_00000000a1") == "CUDAExecutionProvider"


def test_ptx_is_jit_compiled_when_no_cubin_matches() -> None:
    try:
        sess = fused_session(gpu_model(use_ptx=True))
    except Exception as e:  # a driver older than NVRTC's PTX ISA cannot JIT it: not our bug
        if "PTX" in str(e) and "UNSUPPORTED" in str(e).upper():
            pytest.skip(f"driver cannot JIT this PTX: {e}")
        raise
    f = feeds(513)
    check(sess.run(None, f), f)


def test_io_binding_with_device_tensors() -> None:
    sess = fused_session(gpu_model())
    f = feeds(300)
    io = sess.io_binding()
    for name, value in f.items():
        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0))
    io.bind_output("Z", "cuda", 0)
    io.bind_output("W", "cuda", 0)
    sess.run_with_iobinding(io)
    outs = io.get_outputs()
    assert all(o.device_name().lower() == "cuda" for o in outs)
    check(io.copy_outputs_to_cpu(), f)


def test_misaligned_device_buffer_is_refused_and_the_session_keeps_working() -> None:
    # the node declares 16-byte vector access on X: a buffer bound 4 bytes past an allocation must give an
    # error naming the node, not a GPU fault that would poison the CUDA context
    sess = fused_session(gpu_model(n=64, arg_align=[16, 4, 4, 2]))
    f = feeds(64)
    big = ort.OrtValue.ortvalue_from_numpy(np.concatenate([[0.0], f["X"].ravel()]).astype(np.float32), "cuda", 0)
    io = sess.io_binding()
    io.bind_input("X", "cuda", 0, np.float32, [64, 4], big.data_ptr() + 4)
    io.bind_ortvalue_input("Y", ort.OrtValue.ortvalue_from_numpy(f["Y"], "cuda", 0))
    io.bind_output("Z", "cuda", 0)
    io.bind_output("W", "cuda", 0)
    with pytest.raises(Exception, match="input 0 is at address 0x[0-9a-f]+, which is not 16-byte aligned"):
        sess.run_with_iobinding(io)
    io.bind_ortvalue_input("X", ort.OrtValue.ortvalue_from_numpy(f["X"], "cuda", 0))
    sess.run_with_iobinding(io)
    check(io.copy_outputs_to_cpu(), f)


def test_cuda_graph_capture_and_replay() -> None:
    providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1", "use_tf32": "0"}), "CPUExecutionProvider"]
    sess = fused_session(gpu_model(n=64), providers=providers)
    f = feeds(64)
    x = ort.OrtValue.ortvalue_from_numpy(f["X"], "cuda", 0)
    y = ort.OrtValue.ortvalue_from_numpy(f["Y"], "cuda", 0)
    z = ort.OrtValue.ortvalue_from_shape_and_type((64, 4), np.float32, "cuda", 0)
    w = ort.OrtValue.ortvalue_from_shape_and_type((64, 4), np.float16, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("X", x)
    io.bind_ortvalue_input("Y", y)
    io.bind_ortvalue_output("Z", z)
    io.bind_ortvalue_output("W", w)
    for _ in range(3):  # two warm-up runs, the third captures
        sess.run_with_iobinding(io)
        check([z.numpy(), w.numpy()], f)
    for seed in (1, 2):  # replays see new data in the same buffers
        g = feeds(64, seed=seed)
        x.update_inplace(g["X"])
        y.update_inplace(g["Y"])
        sess.run_with_iobinding(io)
        check([z.numpy(), w.numpy()], g)


def test_two_sessions_in_one_process() -> None:
    a1 = fused_session(gpu_model("Fused_00000000a1"))
    a2 = fused_session(gpu_model("Fused_00000000a1"))
    b = fused_session(gpu_model("Fused_00000000b2"))
    for n in (5, 77):
        f = feeds(n)
        for sess in (a1, b, a2):
            check(sess.run(None, f), f)
    del a1  # destroying one session's kernels leaves the others' modules alone
    f = feeds(9)
    check(a2.run(None, f), f)
    check(b.run(None, f), f)


def test_register_by_hand_on_a_cuda_session() -> None:
    m = gpu_model()
    options = ort.SessionOptions()
    register(options, m)
    sess = ort.InferenceSession(m.SerializeToString(), options, providers=CUDA)
    f = feeds(10)
    check(sess.run(None, f), f)


@pytest.mark.parametrize("overrides,message", [
    (dict(ortfuse_version=3), "ortfuse_version 3"),
    (dict(entry="no_such_kernel"), "cuModuleGetFunction"),
    (dict(smem=1 << 24), "16777216 bytes of shared memory"),
    (dict(sym_dims=[0]), "odd length"),
])
def test_bad_attributes_are_errors_not_crashes(overrides: dict, message: str) -> None:
    with pytest.raises(Exception, match=f"fused_0.*({message})"):
        ortfuse.InferenceSession(gpu_model(**overrides), providers=CUDA)


def test_garbage_cubin_is_an_error() -> None:
    m = gpu_model(cubins={device_cc(): b"\x7fELF not really a cubin"})
    with pytest.raises(Exception, match="fused_0.*loading the cubin"):
        ortfuse.InferenceSession(m, providers=CUDA)

"""ortfuse.gpu_timer on the GPU: the device time it reports leaves ORT's per-run host overhead out, and
tracks the bytes a memory-bound op must move. Skipped without the CUDA EP (tests/conftest.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ortfuse import gpu_timer, profile

pytestmark = pytest.mark.gpu


def _neg(n: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])
    m = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _time(n: int) -> tuple[gpu_timer.Timing, float]:
    feeds = {"x": np.random.default_rng(0).standard_normal(n).astype(np.float32)}
    t = gpu_timer.shared()
    run = profile.bound_run(_neg(n), feeds, False, t.cuda_options(), t.run_options())
    return t.time(run, warmup=10, runs=30), profile.host_timer(_neg(n), feeds, False)


def test_device_time_excludes_the_per_run_host_overhead():
    assert gpu_timer.available()
    timing, host_us = _time(1024)
    # one tiny kernel: a few microseconds of device time; the host clock sees ORT's whole Run
    assert 0 < timing.gpu_us < 15.0, timing
    assert timing.gpu_us < host_us / 2, (timing, host_us)


def test_device_time_follows_the_bytes_moved():
    small, _ = _time(1 << 22)  # 16 MiB read + 16 MiB written
    large, _ = _time(1 << 26)  # 256 MiB + 256 MiB: 16x the bytes
    assert 8.0 < large.gpu_us / small.gpu_us < 20.0, (small, large)
    gbps = 2 * 4 * (1 << 26) / (large.gpu_us * 1e3)
    assert 500 < gbps < 5000, gbps  # HBM: H100 ~3 TB/s


def test_profile_clock_is_the_gpu_timer():
    assert profile.clock() == gpu_timer.CLOCK
    feeds = {"x": np.ones(1 << 20, np.float32) * 3}
    assert 0 < profile.cuda_timer(_neg(1 << 20), feeds, False) < profile.host_timer(_neg(1 << 20), feeds, False)

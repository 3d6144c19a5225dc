"""The GPU timer's spin kernel compiles (NVRTC works without a GPU); its timing is tested in test_gpu_timer.py."""
from __future__ import annotations

from ortfuse import gpu_timer
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.target import TABLE


def test_spin_kernel_compiles_for_every_arch_in_the_table(tmp_path):
    ck = compile_kernel(gpu_timer._SPIN, "ofz_spin", tuple(TABLE), tmp_path)
    assert sorted(cc for cc, _ in ck.cubins) == sorted(TABLE) and all(b for _, b in ck.cubins)
    assert b"globaltimer" in ck.ptx


def test_run_options_state_the_graph_annotation():
    # without the key, onnxruntime's run_with_iobinding pays an exception per run (~35 us of host time),
    # which the profile would charge to every region as enqueue time
    import time

    from ortfuse import gpu_timer
    ro = gpu_timer.GpuTimer.run_options()
    assert ro.get_run_config_entry("gpu_graph_id") == "0"
    assert ro.get_run_config_entry("disable_synchronize_execution_providers") == "1"
    from onnxruntime.capi import onnxruntime_inference_collection as c
    lookup = getattr(c, "_graph_annotation_id", None)
    if lookup is not None:  # the wrapper's own per-run lookup is cheap with it
        t0 = time.perf_counter()
        for _ in range(200):
            lookup(ro)
        assert (time.perf_counter() - t0) / 200 < 10e-6

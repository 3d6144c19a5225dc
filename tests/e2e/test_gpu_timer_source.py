"""The GPU timer's spin kernel compiles (NVRTC works without a GPU); its timing is tested in test_gpu_timer.py."""
from __future__ import annotations

from ortfuse import gpu_timer
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.target import TABLE


def test_spin_kernel_compiles_for_every_arch_in_the_table(tmp_path):
    ck = compile_kernel(gpu_timer._SPIN, "ofz_spin", tuple(TABLE), tmp_path)
    assert sorted(cc for cc, _ in ck.cubins) == sorted(TABLE) and all(b for _, b in ck.cubins)
    assert b"globaltimer" in ck.ptx

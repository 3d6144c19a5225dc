"""bench/groupnorm.py on the CPU: its models are valid ONNX at every listed size, each optimizes to one row
kernel, and without a GPU the profiling entry point says so (exit 2) instead of failing."""
from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto

from ortfuse.api import compile_model
from ortfuse.bench import groupnorm


@pytest.mark.parametrize("c,groups,side", groupnorm.SIZES)
def test_sizes_build_and_fuse(c, groups, side):
    m = groupnorm.group_norm(TensorProto.FLOAT16, c, groups, hw=(side, side))
    onnx.checker.check_model(m, full_check=True)
    res = compile_model(m, None, "sm_90")
    assert [r.kind for r in res.plan.regions] == ["rowreduce"]


def test_without_a_gpu_it_says_so(capsys):
    from ortfuse.runtime import _cuda_usable
    if _cuda_usable(["CUDAExecutionProvider", "CPUExecutionProvider"], None):
        pytest.skip("a GPU is here: the entry point would profile")
    assert groupnorm.main([]) == 2
    assert "--profile needs the CUDA execution provider" in capsys.readouterr().out

"""Whether ORT accepts an optimized graph, checked without a GPU: a copy of the native library whose fused op
is registered for the CPU EP (built here with -DOFZ_FUSED_EP) takes the model through ORT's session creation:
graph resolution with our shape inference, partitioning and graph optimization, up to kernel creation,
which stops at the missing CUDA driver. An output dim that shape inference leaves unusable ends there (in
2026-11-27's GPU run, a dim_value of -1 aborted the process inside ONNX's Slice shape inference)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from ortfuse.runtime import CONFIG_KEY, fused_op_types

NATIVE = Path(__file__).resolve().parents[1] / "customops" / "native"
# kernel creation on a machine without a driver; with one, the session is simply created
NO_DRIVER = "CUDA driver unavailable"
# The CPU EP alone casts fp16 values around CPU nodes it has no fp16 kernel for (InsertCastTransformer, which
# knows only its built-in kernels), our node included; our shape inference then refuses the float it is
# given. On the CUDA EP this cannot happen, so the check ends there for such a graph.
CPU_ONLY_CASTS = "InsertedPrecisionFreeCast"


def cpu_ep_library() -> Path:
    """The CPU-EP copy of libortfuse_ops.so, built once per source state (skips where no C compiler exists)."""
    sources = sorted(NATIVE.glob("*.c"))
    digest = hashlib.sha256()
    for p in sorted(NATIVE.glob("*.[ch]")) + sorted((NATIVE.parent / "include").glob("*.h")):
        digest.update(p.name.encode() + p.read_bytes())
    out = Path(tempfile.gettempdir()) / f"ortfuse-cpu-ep-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = next((c for c in (cc.split()[0], "cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler to build the CPU-EP copy of the native library")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-O1", "-fPIC", "-fvisibility=hidden",
                    '-DOFZ_FUSED_EP="CPUExecutionProvider"', "-shared", "-o", str(tmp), *map(str, sources), "-ldl"],
                   check=True, capture_output=True)
    os.replace(tmp, out)  # atomic: test workers may build it at once
    return out


def assert_ort_accepts(model: onnx.ModelProto) -> None:
    """Session creation of `model` with the CPU-EP copy gets as far as kernel creation (see the module doc)."""
    types = fused_op_types(model)
    if not types:
        return
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry(CONFIG_KEY, ",".join(types))
    so.register_custom_ops_library(str(cpu_ep_library()))
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        assert NO_DRIVER in str(e) or CPU_ONLY_CASTS in str(e), f"ORT refused the optimized graph before kernel creation: {e}"

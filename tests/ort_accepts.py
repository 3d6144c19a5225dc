"""Whether ORT accepts an optimized graph, checked without a GPU: a copy of the native library whose fused op
is registered for the CPU EP (built here with -DOFZ_FUSED_EP) takes the model through ORT's session creation:
graph resolution with our shape inference, partitioning and graph optimization, up to kernel creation,
which stops at the missing CUDA driver. An output dim that shape inference leaves unusable ends there (in
2026-11-27's GPU run, a dim_value of -1 aborted the process inside ONNX's Slice shape inference)."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import warnings
from pathlib import Path

import onnx
import onnxruntime as ort

from ortfuse.runtime import CONFIG_KEY, fused_op_types

NATIVE = Path(__file__).resolve().parents[1] / "customops" / "native"
# our kernel creation ran: it stops at the missing driver (or, on a GPU, at whatever it refuses there)
OUR_KERNEL = "ortfuse: node '"
# The CPU EP alone casts fp16 values around CPU nodes it has no fp16 kernel for (InsertCastTransformer, which
# knows only its built-in kernels), our node included, and the graph's re-resolution then refuses the float
# our shape inference does not give. On the CUDA EP this cannot happen; the check ends there (after the
# load's shape inference, before ORT's later optimizations), with a warning saying so.
CPU_ONLY_CASTS = re.compile(r"Type \(tensor\(float\)\) of output arg \(InsertedPrecisionFreeCast_[^)]*\) of node "
                            r"\(ortfuse_region_\d+\) does not match expected type \(tensor\(float16\)\)")


def cpu_ep_library() -> Path | None:
    """The CPU-EP copy of libortfuse_ops.so, built once per source state; None where no C compiler exists."""
    sources = sorted(NATIVE.glob("*.c"))
    digest = hashlib.sha256()
    for p in sorted(NATIVE.glob("*.[ch]")) + sorted((NATIVE.parent / "include").glob("*.h")):
        digest.update(p.name.encode() + p.read_bytes())
    out = Path(tempfile.gettempdir()) / f"ortfuse-cpu-ep-{os.getuid()}-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = next((c for c in (cc.split()[0], "cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        return None
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    r = subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-O1", "-fPIC", "-fvisibility=hidden",
                        '-DOFZ_FUSED_EP="CPUExecutionProvider"', "-shared", "-o", str(tmp), *map(str, sources), "-ldl"],
                       capture_output=True, text=True)
    if r.returncode:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building the CPU-EP copy of the native library failed:\n{r.stderr[-3000:]}")
    os.replace(tmp, out)  # atomic: test workers may build it at once
    return out


def assert_ort_accepts(model: onnx.ModelProto) -> None:
    """Session creation of `model` with the CPU-EP copy gets as far as kernel creation (see the module doc)."""
    types = fused_op_types(model)
    lib = cpu_ep_library() if types else None
    if lib is None:
        if types:
            warnings.warn("no C compiler: ORT's acceptance of the optimized graph is not checked")
        return
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry(CONFIG_KEY, ",".join(types))
    so.register_custom_ops_library(str(lib))
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        if CPU_ONLY_CASTS.search(str(e)):
            warnings.warn("the CPU EP cast an fp16 node's values to float: ORT's acceptance checked up to there")
            return
        assert OUR_KERNEL in str(e), f"ORT refused the optimized graph before kernel creation: {e}"

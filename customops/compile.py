"""CUDA source -> cubin per arch + PTX, through CuPy's NVRTC binding (works without a GPU or driver),
with a content-addressed disk cache. The only module that touches NVRTC."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ortfuse.errors import CompileError

INCLUDE_DIR = Path(__file__).resolve().parent / "include"


@dataclass(frozen=True)
class CompiledKernel:
    entry: str
    source: str
    cubins: tuple[tuple[int, bytes], ...]  # (compute capability, cubin)
    ptx: bytes  # for the lowest arch, JIT-compiled by the driver on newer GPUs
    ptx_arch: int


def _cuda_include() -> str:
    try:
        import nvidia.cu13  # the nvidia-cuda-runtime wheel ships cuda_fp16.h / cuda_bf16.h here
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise CompileError("nvidia-cuda-runtime (13.x) is not installed: cuda_fp16.h is missing") from e
    return os.path.join(list(nvidia.cu13.__path__)[0], "include")


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


def nvrtc_version() -> str:
    return ".".join(map(str, _nvrtc().getVersion()))


def _options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", "-std=c++17", f"-I{_cuda_include()}", f"-I{INCLUDE_DIR}"]


def headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(INCLUDE_DIR.glob("*.h")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _run_nvrtc(source: str, entry: str, arch: str, dump: Path) -> bytes:
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, f"{entry}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, _options(arch))
        except Exception as e:
            log = nvrtc.getProgramLog(prog)
            dump.parent.mkdir(parents=True, exist_ok=True)
            dump.write_text(source)
            first = next((ln for ln in log.splitlines() if "error" in ln), str(e))
            raise CompileError(f"NVRTC failed for {entry} ({arch}): {first.strip()} -- source: {dump}; "
                               f"repro: nvcc -arch={arch.replace('compute', 'sm')} -std=c++17 -I{INCLUDE_DIR} "
                               f"-cubin {dump}\n{log}") from None
        return nvrtc.getCUBIN(prog) if arch.startswith("sm_") else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def compile_kernel(source: str, entry: str, archs: Sequence[int], cache: Path) -> CompiledKernel:
    """Cubins for every arch and PTX for the lowest, cached under cache/kernels/<key>/."""
    key = hashlib.sha256("\0".join([source, entry, ",".join(map(str, sorted(archs))), headers_digest(),
                                    nvrtc_version()]).encode()).hexdigest()[:24]
    folder = cache / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    low = min(archs)
    cubins = []
    for cc in sorted(archs):
        path = folder / f"sm_{cc}.cubin"
        if not path.exists():
            atomic_write(path, _run_nvrtc(source, entry, f"sm_{cc}", folder / "kernel.cu"))
        cubins.append((cc, path.read_bytes()))
    ptx_path = folder / f"compute_{low}.ptx"
    if not ptx_path.exists():
        atomic_write(ptx_path, _run_nvrtc(source, entry, f"compute_{low}", folder / "kernel.cu"))
    if not (folder / "kernel.cu").exists():
        atomic_write(folder / "kernel.cu", source.encode())
        atomic_write(folder / "meta.json", json.dumps({"entry": entry, "archs": sorted(archs),
                                                        "nvrtc": nvrtc_version()}).encode())
    return CompiledKernel(entry, source, tuple(cubins), ptx_path.read_bytes(), low)

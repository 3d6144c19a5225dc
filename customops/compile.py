"""CUDA source -> cubin per arch + PTX, through CuPy's NVRTC binding (works without a GPU or driver),
with a content-addressed disk cache. The only module that touches NVRTC."""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ortfuse.errors import CompileError

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
CACHE_FORMAT = "3"  # bumped when cached files change meaning (2: whole cubins, see `read_cubin`; 3: spill retry)


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one cubin: registers per thread, local-memory spill traffic, stack frame, and
    why it serialized the kernel's wgmma instructions if it did (each then waits for the previous one)."""
    regs: int
    spill_bytes: int  # spill stores + spill loads
    stack_bytes: int
    wgmma_serialized: str = ""  # ptxas's reason ("Potential Performance Loss: ..."); "" when pipelined

    @staticmethod
    def parse(log: str, entry: Optional[str] = None) -> Optional["Resources"]:
        """From ptxas -v output; with `entry`, only that kernel's part (not a non-inlined callee's)."""
        if entry is not None:
            parts = re.split(r"(?=ptxas info\s*: Compiling entry function )", log)
            log = next((x for x in parts if f"entry function '{entry}'" in x), "")
        regs = re.search(r"Used (\d+) registers", log)
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        if not regs or not frame:
            return None
        stack, stores, loads = map(int, frame.groups())
        serial = re.search(r"wgmma\.mma_async instructions are serialized due to ([^\n]*?)(?: in the function|$)", log,
                           re.M)
        return Resources(int(regs.group(1)), stores + loads, stack, serial.group(1).strip() if serial else "")


@dataclass(frozen=True)
class CompiledKernel:
    entry: str
    source: str
    cubins: tuple[tuple[int, bytes], ...]  # (compute capability, cubin)
    ptx: bytes  # for the lowest arch, JIT-compiled by the driver on newer GPUs
    ptx_arch: int
    resources: tuple[tuple[int, Resources], ...] = ()  # (compute capability, ptxas report) per cubin


def _cuda_include() -> str:
    try:
        import nvidia.cu13  # the nvidia-cuda-runtime wheel ships cuda_fp16.h / cuda_bf16.h here
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise CompileError("nvidia-cuda-runtime (13.x) is not installed: cuda_fp16.h is missing") from e
    return os.path.join(list(nvidia.cu13.__path__)[0], "include")


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


@functools.lru_cache(maxsize=1)
def _libnvrtc() -> ctypes.CDLL:
    """The libnvrtc CuPy loaded (dlopen of a loaded path returns the same handle), else the wheel's."""
    _nvrtc().getVersion()  # makes CuPy load it
    try:
        with open("/proc/self/maps") as f:
            paths = [ln.split()[-1] for ln in f if "/libnvrtc.so" in ln]
    except OSError:  # pragma: no cover - not Linux
        paths = []
    if not paths:  # pragma: no cover
        import nvidia.cu13
        paths = sorted(glob.glob(os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libnvrtc.so*")))
    if not paths:  # pragma: no cover
        raise CompileError("libnvrtc is not loaded and the nvidia-cuda-nvrtc wheel has none")
    return ctypes.CDLL(paths[0])


def read_cubin(prog: int) -> bytes:
    """The whole cubin. CuPy's `getCUBIN` drops its last byte (it strips a NUL as for PTX, but a cubin has
    none), so the size comes from NVRTC itself."""
    lib = _libnvrtc()
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) != 0:
        raise CompileError("nvrtcGetCUBINSize failed")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf) != 0:
        raise CompileError("nvrtcGetCUBIN failed")
    image = buf.raw
    check_elf(image)
    return image


def check_elf(image: bytes) -> None:
    """Raises CompileError unless `image` is a 64-bit ELF whose section and program header tables lie
    inside it (a truncated cubin fails here instead of in the driver)."""
    if len(image) < 64 or image[:5] != b"\x7fELF\x02":
        raise CompileError("NVRTC returned something that is not a 64-bit ELF cubin")
    phoff, shoff = struct.unpack_from("<QQ", image, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 54)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if end > len(image):
        raise CompileError(f"cubin of {len(image)} bytes is truncated: its header tables end at byte {end}")


def nvrtc_version() -> str:
    return ".".join(map(str, _nvrtc().getVersion()))


def _options(arch: str) -> list[str]:
    verbose = ["--ptxas-options=-v"] if arch.startswith("sm_") else []  # registers and spills, in the log
    return [f"--gpu-architecture={arch}", "-std=c++17", f"-I{_cuda_include()}", f"-I{INCLUDE_DIR}", *verbose]


def headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(INCLUDE_DIR.glob("*.h")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _run_nvrtc(source: str, entry: str, arch: str, dump: Path, extra: Sequence[str] = ()
               ) -> tuple[bytes, str, bytes]:
    """(cubin or PTX, NVRTC's log, PTX). A real arch (sm_XX) yields both its cubin and the PTX ptxas read,
    which is the PTX a compute_XX compile gives (tests/customops/test_kernels.py checks it): one NVRTC run
    serves both. `extra`: more NVRTC options."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, f"{entry}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, _options(arch) + list(extra))
        except Exception as e:
            log = nvrtc.getProgramLog(prog)
            dump.parent.mkdir(parents=True, exist_ok=True)
            dump.write_text(source)
            first = next((ln for ln in log.splitlines() if "error" in ln), str(e))
            raise CompileError(f"NVRTC failed for {entry} ({arch}): {first.strip()} -- source: {dump}; "
                               f"repro: nvcc -arch={arch.replace('compute', 'sm')} -std=c++17 -I{INCLUDE_DIR} "
                               f"-cubin {dump}\n{log}") from None
        ptx = nvrtc.getPTX(prog)
        image = read_cubin(prog) if arch.startswith("sm_") else ptx
        return image, nvrtc.getProgramLog(prog), ptx
    finally:
        nvrtc.destroyProgram(prog)


def arch_suffix(source: str, archs: Sequence[int], entry: str) -> str:
    """'a' for a kernel with arch-specific instructions (printer.ARCH_SPECIFIC_LINE: sm_90a's wgmma), which
    is built for sm_90a and runs on sm_90 devices only; '' otherwise."""
    from ortfuse.customops.printer import ARCH_SPECIFIC_LINE
    if not source.startswith(ARCH_SPECIFIC_LINE):
        return ""
    if set(archs) != {90}:
        raise CompileError(f"{entry} uses sm_90a instructions (wgmma) and cannot be built for "
                           f"{', '.join(f'sm_{a}' for a in sorted(archs))}")
    return "a"


def register_cap(source: str, entry: str) -> int:
    """The registers a thread of `entry` may use under its `__launch_bounds__(block[, min blocks])`: the
    register file (64 K) over the threads that must fit on an SM, in ptxas's steps of 8, at most 255."""
    m = re.search(rf"__launch_bounds__\((\d+)(?:,\s*(\d+))?\)\s*{re.escape(entry)}\(", source)
    if not m:
        return 255
    threads = int(m.group(1)) * max(int(m.group(2) or 1), 1)
    return max(min(255, 65536 // threads // 8 * 8), 16)


def _without_spills(source: str, entry: str, arch: str, dump: Path, image: bytes, res: Resources
                    ) -> tuple[bytes, Resources]:
    """A build of a kernel that spills, again with the register cap its launch bounds allow made explicit.
    ptxas's default target can settle far below that cap: NVRTC 13.5 built a ConvNeXt window row kernel
    (straight-line, 3,000 lines, read tap by tap) on 40 registers with a 2.7 KB stack frame of spills
    (4.9 KB of spill traffic), and on 140 without any once told --maxrregcount=255. The build with fewer
    spill bytes is kept; a retry NVRTC refuses keeps the first. A spilling kernel costs two NVRTC runs. The
    PTX shipped for newer GPUs carries no cap (the option is ptxas's), so the driver's JIT may spill there."""
    cap = register_cap(source, entry)
    try:
        image2, log2, _ = _run_nvrtc(source, entry, arch, dump, (f"--maxrregcount={cap}",))
    except CompileError:
        return image, res
    res2 = Resources.parse(log2, entry)
    if res2 is not None and res2.spill_bytes < res.spill_bytes:
        return image2, res2
    return image, res


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def compile_kernel(source: str, entry: str, archs: Sequence[int], cache: Path) -> CompiledKernel:
    """Cubins for every arch and PTX for the lowest, cached under cache/kernels/<key>/."""
    key = hashlib.sha256("\0".join([CACHE_FORMAT, source, entry, ",".join(map(str, sorted(archs))), headers_digest(),
                                    nvrtc_version()]).encode()).hexdigest()[:24]
    folder = cache / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    low = min(archs)
    suffix = arch_suffix(source, archs, entry)
    cubins, resources = [], []
    for cc in sorted(archs):
        path, info = folder / f"sm_{cc}.cubin", folder / f"sm_{cc}.json"
        if not path.exists() or not info.exists():
            image, log, ptx = _run_nvrtc(source, entry, f"sm_{cc}{suffix}", folder / "kernel.cu")
            res = Resources.parse(log, entry)
            if res is not None and res.spill_bytes:
                image, res = _without_spills(source, entry, f"sm_{cc}{suffix}", folder / "kernel.cu", image, res)
            atomic_write(info, json.dumps(res.__dict__ if res else None).encode())
            atomic_write(path, image)
            if cc == low:
                atomic_write(folder / f"compute_{low}.ptx", ptx)
        cubins.append((cc, path.read_bytes()))
        fields = json.loads(info.read_text())
        if fields:
            resources.append((cc, Resources(**fields)))
    ptx_path = folder / f"compute_{low}.ptx"
    if not ptx_path.exists():
        atomic_write(ptx_path, _run_nvrtc(source, entry, f"compute_{low}{suffix}", folder / "kernel.cu")[0])  # older cache
    if not (folder / "kernel.cu").exists():
        atomic_write(folder / "kernel.cu", source.encode())
        atomic_write(folder / "meta.json", json.dumps({"entry": entry, "archs": sorted(archs),
                                                        "nvrtc": nvrtc_version()}).encode())
    return CompiledKernel(entry, source, tuple(cubins), ptx_path.read_bytes(), low, tuple(resources))

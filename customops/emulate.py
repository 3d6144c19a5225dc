"""Run kernel sources on the CPU: g++ builds the very CUDA source NVRTC gets, through `ortfuse_emu.h`
(-DORTFUSE_EMU), into a shared library loaded with ctypes. For tests and `ortfuse check --emulate`.

Tensor arguments are C-contiguous numpy arrays whose memory the kernel reads and writes in place:
fp32/fp64/int*/uint* as the matching numpy dtype, fp16 as np.float16, bf16 as np.uint16 bit patterns
(or an ml_dtypes.bfloat16 array), bool as np.bool_ (one byte per element, as ONNX stores it).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from ortfuse.config import cache_dir, emu_opt_level
from ortfuse.customops.compile import INCLUDE_DIR, atomic_write, headers_digest
from ortfuse.errors import CompileError

CXX = "g++"
BASE_FLAGS = ("-std=c++17", "-fPIC", "-shared", "-DORTFUSE_EMU", "-fno-strict-aliasing",
              "-fvisibility=hidden", "-Wno-unknown-pragmas", "-Wno-attributes")


def cxx_flags() -> tuple[str, ...]:
    """g++'s flags, at the -O level of $ORTFUSE_EMU_OPT (config.emu_opt_level)."""
    return (*BASE_FLAGS, f"-O{emu_opt_level()}")


MAX_TENSORS, MAX_DIMS = 32, 16  # OFZ_MAX_TENSORS / OFZ_MAX_DIMS in ortfuse_kernel.h


class EmulationError(RuntimeError):
    """A launch failed inside the emulator: deadlock, misuse of a warp primitive, bad launch shape."""


@dataclass(frozen=True)
class SmemTraffic:
    """Shared-memory wavefronts (128 bytes per clock per SM) of an emulated launch's ldmatrix loads and
    cp.async stores, as the banks served them and as they would be without bank conflicts (ortfuse_emu.h).
    `exact`: every warp's cp.async stores could be paired into instructions (no lane issued fewer)."""
    ldmatrix: int
    ldmatrix_ideal: int
    cp_async: int
    cp_async_ideal: int
    exact: bool


class _OfzArgs(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p * MAX_TENSORS), ("dim", ctypes.c_longlong * MAX_DIMS)]


class _OfzTma(ctypes.Structure):  # OfzTma: two 128-byte tensor maps, 128-byte aligned
    _fields_ = [("map", (ctypes.c_ulonglong * 16) * 2)]


TENSOR_MAP_MAGIC = 0x50414d4f53544f46  # ortfuse_emu.h kTensorMapMagic
TMA_BOX_INNER = 64  # elements along K per box: one 128-byte swizzle row of 16-bit elements


def tma_geometry(shape: Sequence[int], itemsize: int, box_rows: int) -> tuple[int, int, int, int, int]:
    """A TMA operand's 2-D tensor map as the native library encodes it (ofz_spec_tma): (dim0, dim1,
    stride1 in bytes, box0, box1): the last dim by the product of the others."""
    dim0 = int(shape[-1]) if len(shape) else 1
    dim1 = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return dim0, dim1, dim0 * itemsize, TMA_BOX_INNER, box_rows


def _tensor_maps(args: Sequence[np.ndarray], tma: Sequence[tuple[int, int, int]]) -> ctypes.Array:
    """OfzTma for an emulated launch, in 128-byte aligned memory (the emulator's own map layout)."""
    raw = (ctypes.c_ubyte * (ctypes.sizeof(_OfzTma) + 128))()
    maps = _OfzTma.from_buffer(raw, (-ctypes.addressof(raw)) % 128)
    for j, (i, box_rows, _) in enumerate(tma):
        a = args[i]
        dim0, dim1, stride1, box0, box1 = tma_geometry(a.shape, a.itemsize, box_rows)
        for k, v in enumerate((TENSOR_MAP_MAGIC, a.ctypes.data, dim0, dim1, stride1, box0, box1, a.itemsize)):
            maps.map[j][k] = v
    return maps


class EmulatedModule:
    """One compiled source; `launch` runs any of its `OFZ_EMU_ENTRY` kernels."""

    def __init__(self, path: Path, source_path: Path) -> None:
        self.path = path
        self.source_path = source_path
        self._lib = ctypes.CDLL(str(path))
        self._lib.ofz_emu_last_error.restype = ctypes.c_char_p
        self._lib.ofz_emu_set_dynamic_smem.argtypes = [ctypes.c_ulonglong]
        self._lib.ofz_emu_smem_traffic_enable.argtypes = [ctypes.c_int]
        self._lib.ofz_emu_smem_traffic.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
        self._lock = threading.Lock()  # smem setting + launch form one step

    def launch(self, entry: str, grid: int, block: int, args: Sequence[np.ndarray], dims: Sequence[int] = (),
               smem: int = 0, cluster: int = 1, align: Optional[Sequence[int]] = None,
               count_smem: bool = False, tma: Sequence[tuple[int, int, int]] = (),
               lowest_first: bool = False) -> Optional[SmemTraffic]:
        """Run `entry` on a 1-D grid: `args` are the inputs then the (preallocated) outputs, `dims` the
        runtime symbolic dims, `smem` the dynamic shared memory bytes (per block), `cluster` the blocks per
        thread-block cluster (a divisor of `grid`). `align`: the node's arg_align (1 for none); each argument
        then runs from a copy at the weakest address it allows, so a vector access wider than declared
        fails here as it would fault on a GPU. `count_smem`: return the launch's shared-memory traffic. `tma`:
        the kernel's TMA operands (KernelSpec.tma), whose tensor maps are built here from the arguments.
        `lowest_first`: run the lowest-numbered runnable thread whenever one parks (else round-robin), so a
        cluster's first block runs ahead of the others as far as its barriers allow."""
        if align is not None and count_smem:
            raise ValueError(f"{entry}: count_smem with align is not supported")
        if align is not None:
            if len(align) != len(args):
                raise ValueError(f"{entry}: {len(align)} alignments for {len(args)} arguments")
            placed = [_placed(a, int(n)) for a, n in zip(args, align)]
            self.launch(entry, grid, block, placed, dims, smem, cluster, tma=tma, lowest_first=lowest_first)
            for a, p in zip(args, placed):
                if a.flags.writeable:  # the outputs (read-only inputs stay as they are)
                    a[...] = p
            return
        if len(args) > MAX_TENSORS or len(dims) > MAX_DIMS:
            raise ValueError(f"{entry}: at most {MAX_TENSORS} tensors and {MAX_DIMS} dims "
                             f"(got {len(args)}, {len(dims)})")
        if not (0 < grid < 2**31 and 0 < block <= 1024 and smem >= 0 and 1 <= cluster <= 8 and grid % cluster == 0):
            raise ValueError(f"{entry}: invalid launch grid={grid} block={block} smem={smem} cluster={cluster}")
        try:
            fn = getattr(self._lib, f"ofz_emu_{entry}")
        except AttributeError:
            raise ValueError(f"{self.source_path} has no OFZ_EMU_ENTRY({entry})") from None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.POINTER(_OfzArgs)] + (
            [ctypes.POINTER(_OfzTma)] if tma else [])
        packed = _OfzArgs()
        for i, a in enumerate(args):
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise ValueError(f"{entry}: argument {i} must be a C-contiguous numpy array")
            packed.ptr[i] = a.ctypes.data if a.size else no_memory()  # an empty tensor has no memory
        for i, d in enumerate(dims):
            packed.dim[i] = int(d)
        counts = (ctypes.c_ulonglong * 5)()
        with self._lock:
            self._lib.ofz_emu_set_dynamic_smem(smem)
            self._lib.ofz_emu_smem_traffic_enable(int(count_smem))
            self._lib.ofz_emu_set_schedule(int(lowest_first))
            try:
                rc = fn(grid, block, cluster, ctypes.byref(packed), *((ctypes.byref(_tensor_maps(args, tma)),) if tma
                                                                        else ()))
                self._lib.ofz_emu_smem_traffic(counts)
            finally:
                self._lib.ofz_emu_smem_traffic_enable(0)
                self._lib.ofz_emu_set_schedule(0)
            msg = self._lib.ofz_emu_last_error().decode(errors="replace") if rc else ""
        if rc:
            raise EmulationError(f"{msg} (source: {self.source_path})")
        return SmemTraffic(*map(int, counts[:4]), bool(counts[4])) if count_smem else None


@functools.lru_cache(maxsize=None)
def no_memory() -> Optional[int]:
    """An empty tensor's address in emulation: 64 GiB of address space reserved with no access (Linux), so a
    kernel that reads one faults at any offset a buffer could have had, where ORT's null (None elsewhere) only
    faults near 0."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot_none, private_anonymous_noreserve = 0, 0x02 | 0x20 | 0x4000
    addr = libc.mmap(None, 1 << 36, prot_none, private_anonymous_noreserve, -1, 0)
    return None if addr in (None, ctypes.c_void_p(-1).value) else addr


def _placed(a: np.ndarray, align: int) -> np.ndarray:
    """A copy of `a` at an address that is a multiple of max(align, itemsize) but not of twice that."""
    n = max(align, a.itemsize)
    raw = np.empty(a.nbytes + 4 * n, np.uint8)
    off = (-raw.ctypes.data) % (2 * n) + n
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def compile_emulated(source: str) -> EmulatedModule:
    """Build `source` for the host (cached on disk by source, flags, headers and compiler) and load it."""
    compiler = _compiler_version()
    key = hashlib.sha256("\0".join([source, " ".join(cxx_flags()), compiler, headers_digest()]).encode())
    return _load(key.hexdigest()[:24], source)


def compile_emulated_all(sources: Iterable[str], jobs: Optional[int] = None) -> None:
    """Build many sources at once, `jobs` g++ processes at a time (default: one per CPU), so later
    `compile_emulated` calls find them built."""
    todo = list(dict.fromkeys(sources))
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), jobs or os.cpu_count() or 1))) as pool:
        for _ in pool.map(compile_emulated, todo):
            pass


# The kernel headers, parsed once into a precompiled header: they are a third of each kernel's build time.
PCH_HEADERS = ("ortfuse_kernel.h", "ortfuse_gemm.h", "ortfuse_attention.h")
_pch_lock = threading.Lock()


def _pch_flags() -> tuple[str, ...]:
    """`-include` flags for the precompiled kernel headers (built on first use, cached by headers, flags and
    compiler); () if g++ cannot build one, and kernels then parse the headers themselves."""
    key = hashlib.sha256("\0".join([" ".join(cxx_flags()), " ".join(PCH_HEADERS), _compiler_version(),
                                    headers_digest()]).encode())
    folder = cache_dir() / "emu" / f"pch-{key.hexdigest()[:16]}"
    header, gch = folder / "ortfuse_pch.h", folder / "ortfuse_pch.h.gch"
    with _pch_lock:
        if header.exists() and gch.exists():
            return ("-include", str(header))
        if (folder / "failed").exists():
            return ()
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(header, "".join(f'#include "{h}"\n' for h in PCH_HEADERS).encode())
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".gch")
        os.close(fd)
        flags = [f for f in cxx_flags() if f != "-shared"]
        proc = subprocess.run([CXX, *flags, f"-I{INCLUDE_DIR}", "-x", "c++-header", str(header), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            Path(tmp).unlink(missing_ok=True)  # g++ may have removed it
            atomic_write(folder / "failed", proc.stderr.encode())
            return ()
        os.replace(tmp, gch)
        return ("-include", str(header))


@functools.lru_cache(maxsize=None)
def _load(key: str, source: str) -> EmulatedModule:
    folder = cache_dir() / "emu" / key
    folder.mkdir(parents=True, exist_ok=True)
    cu, so = folder / "kernel.cu", folder / "kernel.so"
    if not cu.exists():
        atomic_write(cu, source.encode())
    if not so.exists():
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".so")
        os.close(fd)
        cmd = [CXX, *cxx_flags(), f"-I{INCLUDE_DIR}", *_pch_flags(), "-x", "c++", str(cu), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            Path(tmp).unlink(missing_ok=True)  # g++ may have removed it
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
            raise CompileError(f"g++ failed on {cu}: {first}\nrepro: {' '.join(cmd[:-1])} {so}\n{proc.stderr}")
        os.replace(tmp, so)  # atomic: concurrent builders of the same key write identical files
    return EmulatedModule(so, cu)


@functools.lru_cache(maxsize=None)
def _compiler_version() -> str:
    if shutil.which(CXX) is None:
        raise CompileError(f"{CXX} not found on PATH: the CPU emulation of kernels needs a C++17 host compiler")
    out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0] if out else CXX

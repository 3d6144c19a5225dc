"""Build hook: compiles the native op library customops/native/*.c into
`ortfuse/customops/libortfuse_ops.so` (a plain shared library, not a Python extension).

Used by `pip install .`, `pip install -e .` (the library lands in customops/ beside the sources) and
`make native` (`setup.py build_ext --inplace`). Needs only a C11 compiler and libdl; CUDA is loaded at
run time with dlopen.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "customops" / "native"
LIB_NAME = "libortfuse_ops.so"
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-O2", "-Wall", "-Wextra", "-fPIC", "-fvisibility=hidden"]


class NativeLibrary(Extension):
    """A shared library built from C sources with our own flags (no Python headers, no PyInit)."""


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        for name in ("cc", "gcc", "clang"):
            if shutil.which(name):
                return [name]
        raise CompileError(
            f"ortfuse: no C compiler found (tried {cc[0] if cc else 'cc'}, gcc, clang); install one to build {LIB_NAME}"
        )
    return cc


class BuildNative(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        # Called both with the dotted name and with its last part; both map onto LIB_NAME.
        *package, base = fullname.split(".")
        if base == LIB_NAME[: -len(".so")]:
            return os.path.join(*package, LIB_NAME)
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, NativeLibrary):
            return super().build_extension(ext)
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*_compiler(), *CFLAGS, "-shared", "-o", str(out), *ext.sources, "-ldl"]
        self.announce(" ".join(cmd), level=2)
        try:
            subprocess.run(cmd, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise CompileError(f"ortfuse: building {LIB_NAME} failed: {e}") from e


setup(
    ext_modules=[
        NativeLibrary(
            "ortfuse.customops.libortfuse_ops",
            sources=sorted(str(p.relative_to(HERE)) for p in NATIVE.glob("*.c")),
            depends=[str(p.relative_to(HERE)) for p in NATIVE.glob("*.h")],
        )
    ],
    cmdclass={"build_ext": BuildNative},
)

"""Static look at the GEMM and attention kernels of a model, no GPU needed: ptxas's registers and spills, and
the size of the k-loop (attention: the key-tile loop) in the sm_90 SASS (instructions per MMA/FMA: how
issue-bound the mainloop is). A loop with loops inside (runtime trip counts) counts their bodies once, so
its figure is marked as a lower bound; an attention loop counts both its whole-tile and its partial-tile
score paths.

    python -m ortfuse.bench.sass MODEL.onnx [--arch sm_90]
    python -m ortfuse.bench.sass --functions [--arch sm_90]

The second form counts the SASS instructions of each fp32 math function the printer emits, per element, and
its per-element branches (BSSY convergence regions): customops.target.FN_INSTRUCTIONS and FN_BRANCHES, which
the cost model charges for element-wise kernels and GEMM epilogues.

Needs `cuobjdump` and the `nvdisasm` it calls (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm), a
developer tool only; ortfuse itself never runs it."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ortfuse import api


def cuobjdump() -> str:
    try:
        import nvidia.cu13
        for root in nvidia.cu13.__path__:
            path = os.path.join(root, "bin", "cuobjdump")
            if os.access(path, os.X_OK):
                return path
    except ImportError:
        pass
    path = shutil.which("cuobjdump")
    if not path:
        raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    return path


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction in the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = cuobjdump()
        env = {**os.environ, "NVDISASM_PATH": os.path.dirname(tool)}  # the wheels put both in one bin folder
        run = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, env=env)
        if run.returncode:
            raise RuntimeError(f"cuobjdump failed: {run.stderr.strip()}")
        out = run.stdout
    return [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", out)]


@dataclass(frozen=True)
class KLoop:
    instructions: int  # in the innermost loop holding the math
    math: int  # HMMA / FFMA among them
    inner_loops: int  # backward branches inside it: its count is then a lower bound per iteration


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(target, branch address) of every backward branch: each loop's first and last instruction."""
    out = []
    for a, t in ins:
        m = re.search(r"\bBRA\s+(?:`\(.*?\)\s+)?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            out.append((int(m.group(1), 16), a))
    return out


def k_loop(ins: list[tuple[int, str]], math: str = r"\b(HMMA|FFMA)\b") -> Optional[KLoop]:
    """The innermost backward branch's body that contains an MMA (or FFMA for SIMT kernels); `math`: the
    instructions that count as such (attention: HMMA alone, its FFMAs are the softmax's)."""
    mathops = [a for a, t in ins if re.search(math, t)]
    back = loops(ins)
    best: Optional[tuple[int, int]] = None
    for lo, hi in back:
        if any(lo <= x <= hi for x in mathops) and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    if best is None:
        return None
    body = [u for b, u in ins if best[0] <= b <= best[1]]
    inner = sum(1 for lo, hi in back if best[0] <= lo and hi < best[1])
    return KLoop(len(body), sum(1 for u in body if re.search(math, u)), inner)


# Eight independent elements per thread, as a GEMM epilogue's or a vectorized kernel's lanes: the count is
# what the scheduler issues, not one chain's latency. `{e}` is the printed expression of `v` (and `w`).
_FN_KERNEL = """#include "ortfuse_kernel.h"
extern "C" __global__ void ofz_fn(const float* __restrict__ x, float* __restrict__ y) {{
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * 16;
#pragma unroll
  for (int j = 0; j < 8; ++j) {{
    const float v = x[i + j], w = x[i + 8 + j];
    y[i + j] = {e};
  }}
}}
"""
FN_ELEMENTS = 8


def fn_instructions(arch: str = "sm_90") -> dict[str, tuple[float, float]]:
    """(SASS instructions, branches) per element of every fp32 function of the printer's table (its argument
    loaded, its result stored; the kernel that stores `v` is subtracted)."""
    from ortfuse.customops import ir, printer
    from ortfuse.customops.compile import _run_nvrtc  # NVRTC with the options ortfuse compiles with

    v, w = ir.Var("v", ir.F32), ir.Var("w", ir.F32)

    def count(e: str) -> tuple[int, int]:
        with tempfile.TemporaryDirectory() as tmp:
            image, _, _ = _run_nvrtc(_FN_KERNEL.format(e=e), "ofz_fn", arch, Path(tmp) / "k.cu")
        main_line = []
        for _, t in sass(image):  # up to the first EXIT: the slow paths (IEEE division's, sin's large
            if re.search(r"\bEXIT\b", t):  # arguments) are subroutines placed after it
                break
            main_line.append(t)
        return len(main_line), sum(1 for t in main_line if re.search(r"\bBSSY\b", t))

    base1, base2 = count("v")[0], count("(v + w)")[0]
    out = {}
    for fn in FN_UNARY + FN_BINARY:
        args = (v,) if fn in FN_UNARY else (v, w)
        base = base1 if fn in FN_UNARY else base2 - FN_ELEMENTS  # the add of the binary baseline
        n, branches = count(printer.expr(ir.Op(fn, args, ir.F32)))
        out[fn] = ((n - base) / FN_ELEMENTS, branches / FN_ELEMENTS)
    return out


FN_UNARY = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "erf", "tanh", "sin", "cos", "floor", "ceil",
            "round", "log1p", "recip_fast")
FN_BINARY = ("add", "mul", "div", "pow", "fmax_nan", "fmin_nan", "fmod")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.sass", description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--functions", action="store_true", help="instructions per element of each fp32 function")
    args = ap.parse_args(argv)
    if args.functions:
        print("function   instructions  branches  (per element)")
        for fn, (n, b) in fn_instructions(args.arch).items():
            print(f"{fn:10s} {n:12.2f} {b:9.2f}")
        return 0
    if not args.model:
        ap.error("a model, or --functions")
    res = api.compile_model(args.model, arch=args.arch)
    cc = int(args.arch.split("_")[-1])
    seen = set()
    print("| kernel | kind | template call | registers | spill bytes | k-loop instructions | MMA/FMA | per MMA |")
    print("|---|---|---|---|---|---|---|---|")
    for k in res.kernels:
        if k.compiled.entry in seen or k.region.kind not in ("gemm", "gemm_row", "attention"):
            continue
        seen.add(k.compiled.entry)
        call = re.search(r"ofz::(?:gemm::run|attn::\w+)<([^(]*)>\(", k.compiled.source)
        tmpl = re.sub(r"ofz_\w+_ops", "Ops", call.group(1)) if call else ""
        r = dict(k.compiled.resources).get(cc)
        tc = k.region.kind == "attention" and "attn::tensor_core" in k.compiled.source
        loop = k_loop(sass(dict(k.compiled.cubins)[cc]), r"\bHMMA\b" if tc else r"\b(HMMA|FFMA)\b")
        bound = "≥ " if loop and loop.inner_loops else ""
        per = f"{bound}{loop.instructions / loop.math:.1f}" if loop and loop.math else "-"
        print(f"| `{k.compiled.entry}` | {k.region.kind} | `{tmpl}` | {r.regs if r else '-'} | "
              f"{r.spill_bytes if r else '-'} | {loop.instructions if loop else '-'} | "
              f"{loop.math if loop else '-'} | {per} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

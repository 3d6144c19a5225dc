"""Static look at the GEMM kernels of a model, no GPU needed: ptxas's registers and spills, and the size of
the k-loop in the sm_90 SASS (instructions per MMA/FMA: how issue-bound the mainloop is). A loop with
loops inside (runtime trip counts) counts their bodies once, so its figure is marked as a lower bound.

    python -m ortfuse.bench.sass MODEL.onnx [--arch sm_90]

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


def k_loop(ins: list[tuple[int, str]]) -> Optional[KLoop]:
    """The innermost backward branch's body that contains an MMA (or FFMA for SIMT kernels)."""
    mathops = [a for a, t in ins if re.search(r"\b(HMMA|FFMA)\b", t)]
    back = []  # (target, branch address) of every backward branch
    for a, t in ins:
        m = re.search(r"\bBRA\s+(?:`\(.*?\)\s+)?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            back.append((int(m.group(1), 16), a))
    best: Optional[tuple[int, int]] = None
    for lo, hi in back:
        if any(lo <= x <= hi for x in mathops) and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    if best is None:
        return None
    body = [u for b, u in ins if best[0] <= b <= best[1]]
    inner = sum(1 for lo, hi in back if best[0] <= lo and hi < best[1])
    return KLoop(len(body), sum(1 for u in body if re.search(r"\b(HMMA|FFMA)\b", u)), inner)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.sass", description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    res = api.compile_model(args.model, arch=args.arch)
    cc = int(args.arch.split("_")[-1])
    seen = set()
    print("| kernel | kind | template call | registers | spill bytes | k-loop instructions | MMA/FMA | per MMA |")
    print("|---|---|---|---|---|---|---|---|")
    for k in res.kernels:
        if k.compiled.entry in seen or k.region.kind not in ("gemm", "gemm_row"):
            continue
        seen.add(k.compiled.entry)
        call = re.search(r"ofz::gemm::run<([^(]*)>\(", k.compiled.source)
        tmpl = re.sub(r"ofz_\w+_ops", "Ops", call.group(1)) if call else ""
        r = dict(k.compiled.resources).get(cc)
        loop = k_loop(sass(dict(k.compiled.cubins)[cc]))
        bound = "≥ " if loop and loop.inner_loops else ""
        per = f"{bound}{loop.instructions / loop.math:.1f}" if loop and loop.math else "-"
        print(f"| `{k.compiled.entry}` | {k.region.kind} | `{tmpl}` | {r.regs if r else '-'} | "
              f"{r.spill_bytes if r else '-'} | {loop.instructions if loop else '-'} | "
              f"{loop.math if loop else '-'} | {per} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

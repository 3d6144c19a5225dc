"""Nsight Compute view of one GEMM shape (issue 5): cuBLAS (ORT's bare MatMul) and each family's best tile
of ours (bench/sweep.py's forced kernels) run `--runs` times each, in one process, so that

    ncu --clock-control none -k regex:'ofz_|nvjet|gemm|xmma' --section SpeedOfLight ... \\
        python -m ortfuse.bench.ncu_gemm 4096x3072x768

profiles the same kernels the sweep times, side by side. It prints which kernel name is which tile. Needs
the GPU (ORT's CUDA EP with ortfuse's op library); no timing of its own."""
from __future__ import annotations

import argparse
import warnings
from typing import Optional

from ortfuse.bench import sweep
from ortfuse.profile import tile_label


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.ncu_gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", type=sweep._shape, help="MxNxK, fp16 with a bias")
    ap.add_argument("--per-family", type=int, default=1)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args(argv)
    import onnxruntime as ort

    from ortfuse.runtime import InferenceSession
    case = sweep.GemmCase.of(a.shape)
    cuda = ["CUDAExecutionProvider"]
    print("{}x{}x{}: cuBLAS = ORT's MatMul alone".format(*a.shape))
    sess = ort.InferenceSession(case.alone.SerializeToString(), providers=cuda)
    for _ in range(a.runs):
        sess.run(None, dict(case.alone_feeds))
    for family, cand, _ in sweep.candidates(*a.shape, a.per_family):
        built = case.build(cand)
        print(f"{built.name} = {family} {tile_label(cand)}")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to the function body would profile ORT, not us
            fs = InferenceSession(built.model, providers=cuda)
        for _ in range(a.runs):
            fs.run(None, dict(case.feeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

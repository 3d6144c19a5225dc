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

from ortfuse.api import fused_kernel, target_for
from ortfuse.bench import sweep
from ortfuse.bench.kernels import anchor_region
from ortfuse.config import Options
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import render
from ortfuse.feeds import random_feeds
from ortfuse.profile import fused_model, region_model, tile_label
from ortfuse.rewriter.shapes import build_graph


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.ncu_gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", type=sweep._shape, help="MxNxK, fp16 with a bias")
    ap.add_argument("--per-family", type=int, default=1)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args(argv)
    import onnxruntime as ort

    from ortfuse.runtime import InferenceSession
    m, n, k = a.shape
    g = build_graph(sweep.gemm_model(m, n, k), {})
    tgt = target_for(sweep.ARCHS, True)
    region = sweep.forced_region(g)
    sub = region_model(g, region, {})
    feeds = random_feeds(sub, None, seed=m + n + k)
    alone = region_model(g, anchor_region(g, region), {})
    cuda = ["CUDAExecutionProvider"]
    print(f"{m}x{n}x{k}: cuBLAS = ORT's MatMul alone")
    sess = ort.InferenceSession(alone.SerializeToString(), providers=cuda)
    for _ in range(a.runs):
        sess.run(None, random_feeds(alone, None, seed=1))
    opts = Options(archs=sweep.ARCHS, wgmma=True)
    for family, cand, _ in sweep.candidates(m, n, k, a.per_family):
        spec = lower(g, region, tgt, tile=cand)
        ck = compile_kernel(render(spec.kernel), spec.kernel.name, sweep.ARCHS, opts.cache)
        print(f"{spec.kernel.name} = {family} {tile_label(cand)}")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to the function body would profile ORT, not us
            fs = InferenceSession(fused_model(sub, fused_kernel(region, spec, ck).node), providers=cuda)
        for _ in range(a.runs):
            fs.run(None, dict(feeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

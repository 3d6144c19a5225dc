"""Nsight Compute view of a model's fused attention (issue 5): our kernel for its first attention region and
ORT's MultiHeadAttention of the same size and mask (as bench/kernels.py times them), each run `--runs`
times in one process, so that

    ncu --clock-control none -k regex:'ofz_|fmha|flash|[Aa]ttention|cutlass' --section SpeedOfLight ... \\
        python -m ortfuse.bench.ncu_attention bert fp16 --batch 32

profiles both side by side (H200, 2026-11-26: BERT batch 32, ours 30.0 us against MultiHeadAttention's
21.7). MODEL is a zoo name (built or taken from the cache) or an .onnx path. Needs the GPU; no timing of
its own."""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Optional

from ortfuse.api import compile_model
from ortfuse.bench.kernels import _at, attention_size, mha_model
from ortfuse.feeds import random_feeds
from ortfuse.profile import fused_model, profile_bindings, region_model


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.ncu_attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="zoo model name (bert, gpt2, vit) or an .onnx path")
    ap.add_argument("dtype", nargs="?", default="fp16", choices=("fp16", "fp32"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args(argv)
    import onnxruntime as ort

    from ortfuse.runtime import InferenceSession
    import onnx

    from ortfuse.bench import zoo
    from ortfuse.config import Options
    path = a.model
    if not Path(path).exists():
        path = str(zoo.build(a.model, a.dtype, False))
    # at the zoo's own sizes, as the suite optimizes it (a decoder's generation step packs grouped-query heads)
    proto = onnx.load(path, load_external_data=False)
    meta = zoo.read_sidecar(Path(path))
    shapes = zoo.fixed_image_shapes(proto, meta)
    res = compile_model(path, shapes, "sm_90", Options(archs=(90,), ort_attention="off",  # our kernel, profiled
                                                       dim_hints=zoo.dim_hints(proto, meta, shapes)))
    k = next((k for k in res.kernels if k.region.kind == "attention"), None)
    if k is None:  # none lowers, or the cost model leaves each to ORT (fp32 at ViT-B's size)
        print(f"{path}: no attention region of ours; the report's refusals say why")
        return 1
    g, r = res.graph, k.region
    label, dims = profile_bindings(g, a.batch)[-1]
    sub = region_model(g, r, dims)
    feeds = random_feeds(sub, None, seed=r.id)
    try:
        size = attention_size(_at(g, dims), r)
    except Exception as e:  # noqa: BLE001 - a size the kernel table cannot state: profile ours alone
        size, why = None, e
    cuda = ["CUDAExecutionProvider"]
    print(f"{k.compiled.entry} = ours, {size.text() if size else 'size unknown'} ({label})")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the function body would profile ORT, not us
        ours = InferenceSession(fused_model(sub, k.node), providers=cuda)
    for _ in range(a.runs):
        ours.run(None, feeds)
    try:
        if size is None:
            raise why
        mha, mha_feeds = mha_model(size, seed=r.id)
    except Exception as e:  # noqa: BLE001 - ours is profiled; ORT's MultiHeadAttention only where it can be built
        print(f"no MultiHeadAttention to profile beside it: {e}")
        return 0
    print("then ORT's MultiHeadAttention with the same mask (attention_bias)")
    sess = ort.InferenceSession(mha.SerializeToString(), providers=cuda)
    for _ in range(a.runs):
        sess.run(None, mha_feeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The `ortfuse` command: optimize, check, bench, demo."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ortfuse.config import K_ROPE_MODES, LAYOUT_MODES, LN_FOLD_MODES, ORT_ATTENTION_MODES
from ortfuse.errors import InputError, OrtfuseError


def _progress():
    start = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:5.1f}s] {msg}", file=sys.stderr, flush=True)
    return say


def _check_paths(src: str, dst: str) -> None:
    if not os.path.exists(src):
        raise InputError(f"{src}: no such file")
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise InputError(f"{dst}: refusing to overwrite the input model")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise InputError(f"{dst}: folder {parent} does not exist")


def _dim_hints(specs: list[str]) -> tuple[tuple[str, int], ...]:
    """NAME=VALUE pairs (--dim-hint), each name once."""
    out: dict[str, int] = {}
    for spec in specs:
        name, eq, value = spec.rpartition("=")
        value = value.strip()
        if not eq or not name or not (value.isascii() and value.isdigit()) or len(value) > 9:
            raise InputError(f"--dim-hint '{spec}': expected NAME=VALUE, e.g. sequence=1")
        if name in out:
            raise InputError(f"--dim-hint: '{name}' given twice")
        out[name] = int(value)
    return tuple(out.items())


def cmd_optimize(a: argparse.Namespace) -> int:
    from ortfuse import report
    from ortfuse.api import compile_model
    from ortfuse.rewriter.replace import save_model

    _check_paths(a.input, a.output)
    say = _progress()
    from ortfuse.api import _archs
    from ortfuse.config import Options
    archs = _archs(a.arch)
    if a.wgmma and archs != (90,):
        raise InputError(f"--wgmma builds sm_90a kernels, which run on sm_90 only: use --arch sm_90 "
                         f"(got {a.arch})")
    opts = Options(archs=archs, tf32=a.tf32, profile=a.profile, profile_batch=a.profile_batch,
                   dim_hints=_dim_hints(a.dim_hint),
                   **({"wgmma": a.wgmma} if a.wgmma is not None else {}),
                   **({"ln_fold": a.ln_fold} if a.ln_fold else {}),
                   **({"layout": a.layout} if a.layout else {}),
                   **({"ort_attention": a.ort_attention} if a.ort_attention else {}),
                   **({"k_rope": a.k_rope} if a.k_rope else {}),
                   **({"pdl": a.pdl} if a.pdl is not None else {}))
    result = compile_model(a.input, a.input_shape, a.arch, options=opts, progress=say)
    say(f"writing {a.output}")
    result.save(a.output)
    if a.report:
        Path(a.report).write_text(report.markdown(result, a.input))
    if a.explain:
        print("\n".join(report.explain(result)) or "every memory-bound op was fused")
    print(report.summary(result))
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    from ortfuse.check import check_models
    from ortfuse.rewriter.shapes import parse_input_shapes

    shapes = parse_input_shapes(a.input_shape) if a.input_shape else None
    if a.trace:
        if a.emulate:
            raise InputError("--trace and --emulate: give one (the trace runs the models as they are)")
        from ortfuse.divergence import trace_models
        tr = trace_models(a.input, a.output, provider=a.provider, input_shapes=shapes, seed=a.seed)
        print("\n".join(tr.lines(limit=None)))
        return 0 if tr.ok else 1
    rep = check_models(a.input, a.output, provider=a.provider, emulate=a.emulate, input_shapes=shapes, seed=a.seed)
    print("\n".join(rep.lines()))
    n_kernels = len(rep.kernels)
    verdict = "PASS" if rep.ok else "FAIL"
    print(f"parity {verdict}: {len(rep.model)} model outputs"
          + (f", {n_kernels} fused kernels in emulation" if a.emulate else "") + f" ({a.provider})")
    return 0 if rep.ok else 1


def cmd_demo(a: argparse.Namespace) -> int:
    from ortfuse import report
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.demo import encoder
    from ortfuse.rewriter.replace import save_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    src, dst = out / "demo_encoder.onnx", out / "demo_encoder.ortfuse.onnx"
    save_model(encoder(), src)
    print(f"built-in model: {src} (2-layer BERT-style encoder, decomposed LayerNorm/GELU/Softmax)")
    result = compile_model(src, ["hidden_states:1x128x128", "attention_mask:1x128"] if a.static else None,
                           a.arch, progress=_progress())
    result.save(dst)
    (out / "report.md").write_text(report.markdown(result, str(src)))
    print(report.summary(result))
    rep = check_models(src, dst, provider="cpu", emulate=True, input_shapes={"hidden_states": (2, 16, 128),
                                                                            "attention_mask": (2, 16)})
    print("\n".join(rep.lines()))
    print(f"parity {'PASS' if rep.ok else 'FAIL'}: whole model through ORT CPU and "
          f"{len(rep.kernels)} fused kernels in CPU emulation vs ORT (fp32 rel tol 1e-5)")
    return 0 if rep.ok else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ortfuse", description="Fuse ONNX models into CUDA custom ops for ONNX Runtime.")
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("optimize", help="fuse IN into OUT")
    o.add_argument("input")
    o.add_argument("output")
    o.add_argument("--input-shape", action="append", default=[], metavar="NAME:1x128",
                   help="fix an input's shape (repeatable); dims not given stay symbolic")
    o.add_argument("--dim-hint", action="append", default=[], metavar="NAME=VALUE",
                   help="the typical value of a symbolic dim, for the cost model only: the shapes stay symbolic "
                        "(repeatable; a decoder's generation step: sequence=1, past_sequence=512)")
    o.add_argument("--arch", default="sm_90", help="target arch(s), comma separated, e.g. sm_80,sm_90")
    o.add_argument("--wgmma", action=argparse.BooleanOptionalAction, default=None,
                   help="Hopper warpgroup-MMA (wgmma) GEMM kernels: sm_90a cubins, which run on sm_90 GPUs (H100, "
                        "H200) only. On by default where every --arch is sm_90 (BERT/GPT-2 fp16 at batch 32 "
                        "1.3-1.5x over stock ORT with them on an H200, 1.0-1.1x without); --no-wgmma keeps the "
                        "output portable to later GPUs through PTX (also ORTFUSE_WGMMA=0/1)")
    o.add_argument("--ln-fold", choices=LN_FOLD_MODES, default=None,
                   help="LayerNorms folded into the 16-bit GEMMs that read them: where the whole-model estimate "
                        "gains (auto, the default), wherever they can (on), or never (off); also ORTFUSE_LN_FOLD")
    o.add_argument("--layout", choices=LAYOUT_MODES, default=None,
                   help="residual streams a model's blocks transpose around (ConvNeXt's NCHW stream, its blocks "
                        "channels-last): kept in the blocks' layout where the whole-model estimate gains, stream "
                        "by stream (auto, the default), wherever that saves copies (blocks), or never (model); "
                        "also ORTFUSE_LAYOUT")
    o.add_argument("--ort-attention", choices=ORT_ATTENTION_MODES, default=None,
                   help="attention patterns handed to ORT's own fused MultiHeadAttention where the whole-model "
                        "estimate gains over the plan without it (our attention kernel, its ops fused otherwise or "
                        "ORT's unfused ops; auto, the default), wherever it computes them (on), or never (off); "
                        "also ORTFUSE_ORT_ATTENTION")
    o.add_argument("--k-rope", choices=K_ROPE_MODES, default=None,
                   help="K's rotary embedding in an attention pattern (prompts without a KV cache, rotary "
                        "encoders): applied by our attention kernel to every K tile it loads (kernel), once "
                        "before the kernel (once), or as the whole-model estimate prefers (auto, the default); "
                        "also ORTFUSE_K_ROPE")
    o.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="programmatic dependent launches where every --arch is sm_90+: each kernel may start while "
                        "the one before it finishes, and waits for it before touching memory. Off by default "
                        "until measured (also ORTFUSE_PDL=1/0)")
    o.add_argument("--tf32", action="store_true",
                   help="let fp32 MatMul/Gemm use tf32 tensor cores (10-bit mantissa, like ORT's use_tf32=1)")
    o.add_argument("--profile", action="store_true",
                   help="on a GPU: time each fused region and each GEMM tile candidate against ORT's own "
                        "kernels for the same sub-graph and keep the faster (cached per device)")
    o.add_argument("--profile-batch", type=int, default=32, metavar="N",
                   help="--profile times a symbolic batch dim at its hint and at N too; verdicts use the "
                        "geometric mean over both (default 32; 0: the hint only)")
    o.add_argument("--report", help="write a markdown report here")
    o.add_argument("--explain", action="store_true", help="list why candidate ops were not fused")
    o.set_defaults(fn=cmd_optimize)
    c = sub.add_parser("check", help="parity of OUT against IN")
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    c.add_argument("--emulate", action="store_true", help="also run every fused kernel in CPU emulation")
    c.add_argument("--trace", action="store_true",
                   help="instead: where the two models' values first differ (every tensor both compute, in order)")
    c.add_argument("--input-shape", action="append", default=[], metavar="NAME:2x16")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(fn=cmd_check)
    d = sub.add_parser("demo", help="optimize the built-in encoder and check it")
    d.add_argument("--out", default="out/demo")
    d.add_argument("--arch", default="sm_80,sm_90")
    d.add_argument("--static", action="store_true", help="fix batch=1, seq=128 instead of symbolic dims")
    d.set_defaults(fn=cmd_demo)
    try:
        from ortfuse.bench import harness
        b = sub.add_parser("bench", help="latency of IN (and OUT) against the baselines")
        harness.add_arguments(b)
        b.set_defaults(fn=harness.main)
    except ImportError:  # the bench extra is optional
        pass
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except OrtfuseError as e:
        print(f"ortfuse: error: {e}".splitlines()[0], file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())

"""All configuration: the frozen `Options` and the only place that reads environment variables."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ortfuse.errors import InputError


def cache_dir() -> Path:
    """$ORTFUSE_CACHE_DIR, else $XDG_CACHE_HOME/ortfuse, else ~/.cache/ortfuse."""
    env = os.environ.get("ORTFUSE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ortfuse"


def dump_dir() -> Path | None:
    """$ORTFUSE_DUMP: a folder where every generated kernel source is written."""
    env = os.environ.get("ORTFUSE_DUMP")
    return Path(env) if env else None


def debug() -> bool:
    """$ORTFUSE_DEBUG=1: validate every stage boundary (also on in tests)."""
    return os.environ.get("ORTFUSE_DEBUG", "0") not in ("", "0")


def emu_opt_level() -> str:
    """$ORTFUSE_EMU_OPT: g++'s -O level for emulated kernels, 0-3 (default 2). The tests take 1: their tensors
    are small, so building dominates, and -O1 builds in two thirds of -O2's time."""
    level = os.environ.get("ORTFUSE_EMU_OPT", "") or "2"
    if level not in ("0", "1", "2", "3"):
        raise InputError(f"ORTFUSE_EMU_OPT={level!r}: expected 0, 1, 2 or 3")
    return level


LN_FOLD_MODES = ("auto", "on", "off")
LAYOUT_MODES = ("auto", "blocks", "model")
ORT_ATTENTION_MODES = ("auto", "on", "off")
K_ROPE_MODES = ("auto", "kernel", "once")


def _tristate(env: str) -> bool | None:
    """An on/off environment setting: unset or empty -> None (the default), "0" -> False, else True."""
    return None if env == "" else env != "0"


@dataclass(frozen=True)
class Options:
    archs: tuple[int, ...] = (90,)  # cubins built for these compute capabilities; PTX for the lowest
    cache: Path = field(default_factory=cache_dir)
    dump: Path | None = field(default_factory=dump_dir)
    jobs: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    tf32: bool = False  # fp32 GEMMs may use tf32 tensor cores (10-bit mantissa); recorded in the model
    profile: bool = False  # time every region against ORT on the GPU and keep the faster (ortfuse.profile)
    profile_batch: int = 32  # --profile also times a symbolic batch dim at this value (0: at its hint only)
    # sm_90a warpgroup-MMA GEMM kernels. None (the default): where every target arch is sm_90 (measured on an
    # H200, 2026-11-26: BERT / GPT-2 fp16 at batch 32 1.28x / 1.51x over stock ORT with them, 0.98x / 1.12x
    # without); sm_90a code runs on sm_90 GPUs only, not on later ones through PTX, so False keeps the output
    # portable; True insists (an error unless every target is sm_90). $ORTFUSE_WGMMA=1 / 0 sets it too.
    wgmma: bool | None = field(default_factory=lambda: _tristate(os.environ.get("ORTFUSE_WGMMA", "")))
    # LayerNorms folded into the GEMMs that read them: "auto" where the cost model says the whole model gains,
    # "on" wherever they can, "off" never ($ORTFUSE_LN_FOLD; docs/design.md, LayerNorm prologues)
    ln_fold: str = field(default_factory=lambda: os.environ.get("ORTFUSE_LN_FOLD", "auto") or "auto")
    # residual streams that blocks transpose around (ConvNeXt): kept in the blocks' layout where the
    # whole-model estimate gains, chain by chain ("auto"), wherever that saves copies ("blocks"), or left in
    # the model's ("model") ($ORTFUSE_LAYOUT; rewriter.layout)
    layout: str = field(default_factory=lambda: os.environ.get("ORTFUSE_LAYOUT", "auto") or "auto")
    # attention patterns handed to ORT's own fused MultiHeadAttention (rewriter.mha) where the whole-model
    # estimate gains over the plan without it (our kernel, its ops fused otherwise or ORT's unfused ops: "auto"),
    # wherever it computes them ("on"), or never ("off") ($ORTFUSE_ORT_ATTENTION)
    ort_attention: str = field(default_factory=lambda: os.environ.get("ORTFUSE_ORT_ATTENTION", "auto") or "auto")
    # K's rotary embedding (a decoder's prompt without a cache, rotary encoders): applied by our attention kernel
    # to every K tile it loads ("kernel"), once before it by the nodes' own kernel ("once"), or as the
    # whole-model estimate prefers ("auto") ($ORTFUSE_K_ROPE; search.regions._grow)
    k_rope: str = field(default_factory=lambda: os.environ.get("ORTFUSE_K_ROPE", "auto") or "auto")
    # programmatic dependent launches where every target arch is sm_90+ (Target.pdl): off until measured on a
    # GPU ($ORTFUSE_PDL=1 turns them on)
    pdl: bool = field(default_factory=lambda: _tristate(os.environ.get("ORTFUSE_PDL", "")) is True)
    # attention kernels skip the key tiles past a causal frontier the graph's mask proves (customops.key_bound;
    # Target.key_frontier): on unless $ORTFUSE_KEY_FRONTIER=0 (a switch to time both builds side by side)
    key_frontier: bool = field(
        default_factory=lambda: _tristate(os.environ.get("ORTFUSE_KEY_FRONTIER", "")) is not False)
    # (name, value): typical values of symbolic dims for the cost model, the shapes left symbolic (--dim-hint;
    # a decoder's generation step: sequence=1)
    dim_hints: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.archs:
            raise ValueError("at least one target arch is needed")
        if self.ln_fold not in LN_FOLD_MODES:  # (a user's setting, so an input error)
            raise InputError(f"LayerNorm fold mode '{self.ln_fold}' (ORTFUSE_LN_FOLD): expected one of "
                             f"{', '.join(LN_FOLD_MODES)}")
        if self.ort_attention not in ORT_ATTENTION_MODES:
            raise InputError(f"ORT attention mode '{self.ort_attention}' (ORTFUSE_ORT_ATTENTION): expected one of "
                             f"{', '.join(ORT_ATTENTION_MODES)}")
        if self.k_rope not in K_ROPE_MODES:
            raise InputError(f"K rotation mode '{self.k_rope}' (ORTFUSE_K_ROPE): expected one of "
                             f"{', '.join(K_ROPE_MODES)}")
        if self.layout not in LAYOUT_MODES:
            raise InputError(f"layout mode '{self.layout}' (ORTFUSE_LAYOUT): expected one of "
                             f"{', '.join(LAYOUT_MODES)}")

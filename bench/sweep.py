"""GEMM tile sweep (issue 5): plain fp16 GEMMs with a bias, each of the tile model's best tiles of every family
forced in turn (warp-level mma.sync; wgmma fed by cp.async; wgmma fed by TMA in the warp-specialized
pipeline; with the bias alone also the TMA mainloops the model does not rank yet: B multicast across pairs
of blocks, ping-pong warpgroups, both), timed on the device against ORT's bare MatMul (cuBLAS) and ORT's
MatMul + Add, with the model's estimate and ptxas's registers beside each figure. It tells the mainloops
apart on the same shapes, and the tile model's estimates from the measurements (the ratio measured /
estimated per family).

    python -m ortfuse.bench.sweep [--shapes 4096x768x768 128x3072x768 ...] [--per-family 6] [--ablate]
                                  [--no-flush] [--direct-stores] [--epilogue bias|gelu|layernorm|gated|...]
                                  [--json OUT] [--md OUT]

Times are device time (ortfuse.profile.device_timer: events, L2 flushed before each run), medians of many
runs on random device-resident inputs. Diagnostics of each family's best tile: `--ablate` times it again
compiled without its epilogue's stores (OFZ_ABLATE_EPILOGUE in ortfuse_gemm.h; its output is wrong, its
mainloop is the real one), so the difference is what the stores cost (a split-K tile's: its reduction
through distributed shared memory and the stores; before 2026-11-26 its reduction stayed in); `--no-flush` times it and cuBLAS with
the L2 as the previous run left it; `--direct-stores` times it storing output rows that are not 16-byte
aligned from the mma fragments (OFZ_DIRECT_STORES), against the staged stores it ships with (GPT-2's LM
head beside its padded twin, whose "misaligned" summary lines give the store factors: `--shapes
4096x50257x768 4096x50264x768`). `--epilogue gelu` adds BERT's exported erf GELU after the bias: then each
shape also times cuBLAS followed by the epilogue as our own kernel (what placement weighs a fused epilogue
against), and the estimates include the epilogue term (Target.epilogue_branch_clocks, which such rows
calibrate: `softsign` divides by a tensor, IEEE division with its per-element branch; the erf GELU and
SiLU have had none since 2026-11-26). `--epilogue layernorm` is a row-wise epilogue (BERT's bias + residual +
LayerNorm): the row-wise tiles of mma.sync and wgmma, splitting the row across a cluster and spanning it,
against cuBLAS + our row kernel; `--ablate` then leaves out the row pass, its cluster barriers and its
stores. `--epilogue gated` is a gated MLP's GEMM (N the interleaved gate and up columns, no bias: Llama's
`--shapes 4096x3072x576 128x3072x576`), its epilogue SiLU(gate) * up into N / 2 outputs, against cuBLAS alone
and cuBLAS + the gated element-wise kernel. Needs an sm_90 GPU; the CPU tests run it with a stand-in timer."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortfuse.api import fused_kernel, target_for
from ortfuse.bench.kernels import Timer, anchor_region
from ortfuse.config import Options
from ortfuse.customops import tiles as tl
from ortfuse.customops.compile import CompiledKernel, compile_kernel
from ortfuse.customops.lower import LoweringError, lower
from ortfuse.customops.printer import render
from ortfuse.customops.target import for_cc
from ortfuse.feeds import random_feeds
from ortfuse.profile import fused_model, region_model, tile_label
from ortfuse.rewriter.gemm_padding import padded_width
from ortfuse.rewriter.graph import Graph
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import compute, legal
from ortfuse.search.cost import traffic
from ortfuse.search.plan import Region

# BERT-base / ViT-B projections and FFN at batch 32 x 128 tokens and at batch 1, GPT-2's QKV
SHAPES = ((4096, 768, 768), (4096, 3072, 768), (4096, 768, 3072), (4096, 2304, 768), (128, 768, 768),
          (128, 3072, 768), (128, 768, 3072))
FAMILIES = {"mma.sync": tl.MMA_F16, "wgmma": tl.WGMMA_F16, "wgmma+TMA": tl.WS_F16}
# the TMA family's tiles again with B multicast across pairs of blocks (GemmTile.multicast_twin), which the
# tile model does not rank until measured: a family of its own in the tables
MULTICAST = "wgmma+TMA multicast"
# and the ping-pong TMA tiles (tiles.rank_pingpong), likewise unranked
PINGPONG = "wgmma+TMA pingpong"
PINGPONG_MULTICAST = "wgmma+TMA pingpong multicast"  # both
NAMES = (*FAMILIES, MULTICAST, PINGPONG, PINGPONG_MULTICAST)
EPILOGUES = {"bias": "bias", "gelu": "bias + GELU", "silu": "bias + SiLU", "softsign": "bias + softsign",
             "layernorm": "bias + residual + LayerNorm", "gated": "gated SiLU(gate) * up, N / 2 outputs"}
ROW_EPILOGUES = ("layernorm",)  # a row-wise epilogue (gemm_row): its own tiles, TMA's not among them
ROW_FAMILIES = ("mma.sync", "wgmma")
ARCHS = (90,)


@dataclass(frozen=True)
class SweepRow:
    shape: tuple[int, int, int]  # M, N, K
    family: str
    tile: tuple[int, ...]  # the --profile candidate
    us: float
    est_us: float  # the tile model's estimate
    regs: int
    spill_bytes: int
    error: str = ""  # a launch or timing failure (us is then nan): one tile's failure does not end the sweep
    variant: str = ""  # "" or one of VARIANTS (a diagnostic of the family's best tile)

    @property
    def tflops(self) -> float:
        m, n, k = self.shape
        return 2.0 * m * n * k / (self.us * 1e6)


@dataclass(frozen=True)
class ShapeResult:
    shape: tuple[int, int, int]
    cublas_us: float  # ORT's MatMul alone
    ort_region_us: float  # ORT's MatMul + Add
    rows: tuple[SweepRow, ...]
    cublas_noflush_us: Optional[float] = None  # with --no-flush: cuBLAS with the L2 as its last run left it
    epilogue: str = "bias"  # one of EPILOGUES
    split_us: Optional[float] = None  # GELU: cuBLAS + the epilogue as our own kernel


def gemm_model(m: int, n: int, k: int, seed: int = 0, epilogue: str = "bias") -> onnx.ModelProto:
    """y = x @ w + b in fp16, the weight and bias constant (as in the zoo's linear layers); `epilogue` "gelu":
    then GELU(y) as BERT's export spells it (x / sqrt(2) with a fp16 constant, Erf, + 1, * x, * 0.5); "silu":
    y * Sigmoid(y); "softsign": y / (1 + |y|), a division by a tensor (IEEE, with its per-element branch);
    "layernorm": LayerNorm(y + r) over the row, r a second input (a row-wise epilogue); "gated": no bias, w
    a gated MLP's gate and up weights interleaved column by column (rewriter.gemm_packing), SiLU(y[:, 0::2]) *
    y[:, 1::2]: [m, n / 2] (Llama's is 3072 columns wide, K 576)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float16)
    b = (rng.standard_normal(n) * 0.1).astype(np.float16)
    mk = helper.make_node
    nodes = [mk("MatMul", ["x", "w"], ["y"]), mk("Add", ["y", "b"], ["out" if epilogue == "bias" else "z"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [m, k])]
    out_n = n
    if epilogue == "gated":
        nodes, inits = nodes[:1], inits[:1]
        for first, name in enumerate(("g", "u")):
            bounds = [f"{name}_{what}" for what in ("starts", "ends", "axes", "steps")]
            inits += [numpy_helper.from_array(np.array([v], np.int64), t) for t, v in zip(bounds, (first, n, 1, 2))]
            nodes.append(mk("Slice", ["y", *bounds], [name]))
        nodes += [mk("Sigmoid", ["g"], ["sg"]), mk("Mul", ["g", "sg"], ["a"]), mk("Mul", ["a", "u"], ["out"])]
        out_n = n // 2
    elif epilogue == "layernorm":  # BERT's post-attention block: LayerNorm(x @ w + b + residual)
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT16, [m, n]))
        nodes += [mk("Add", ["z", "r"], ["s"]), mk("LayerNormalization", ["s", "g", "beta"], ["out"], axis=-1,
                                                   epsilon=1e-12)]
        inits += [numpy_helper.from_array((1.0 + rng.standard_normal(n) * 0.1).astype(np.float16), "g"),
                  numpy_helper.from_array((rng.standard_normal(n) * 0.1).astype(np.float16), "beta")]
    elif epilogue == "gelu":
        nodes += [mk("Div", ["z", "sqrt2"], ["d"]), mk("Erf", ["d"], ["e"]), mk("Add", ["e", "one"], ["e1"]),
                  mk("Mul", ["z", "e1"], ["p"]), mk("Mul", ["p", "half"], ["out"])]
        inits += [numpy_helper.from_array(np.array(v, np.float16), name)
                  for name, v in (("sqrt2", 1.4142135), ("one", 1.0), ("half", 0.5))]
    elif epilogue == "silu":
        nodes += [mk("Sigmoid", ["z"], ["s"]), mk("Mul", ["z", "s"], ["out"])]
    elif epilogue == "softsign":
        nodes += [mk("Abs", ["z"], ["a"]), mk("Add", ["a", "one"], ["d"]), mk("Div", ["z", "d"], ["out"])]
        inits.append(numpy_helper.from_array(np.array(1.0, np.float16), "one"))
    elif epilogue != "bias":
        raise ValueError(f"unknown epilogue '{epilogue}': expected one of {sorted(EPILOGUES)}")
    g = helper.make_graph(nodes, "gemm", inputs,
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT16, [m, out_n])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def candidates(m: int, n: int, k: int, per_family: int, epi: float = 0.0, row: bool = False,
               multicast: bool = True) -> list[tuple[str, tuple[int, ...], float]]:
    """(family, candidate, estimate) for the model's best `per_family` tiles of each family at this shape;
    `epi`: the epilogue's branches per element, whose term the estimate includes (not the ranking, as in
    the lowering). `row`: tiles for a row-wise epilogue, each family's best tile spanning the row and best
    splitting it across a cluster among them (placement weighs both kinds). `multicast`: the TMA family's best
    two again with B multicast (MULTICAST), and the best two ping-pong TMA tiles (PINGPONG), also with
    B multicast (PINGPONG_MULTICAST)."""
    tgt = target_for(ARCHS, True)
    out = []
    for name, math_ in FAMILIES.items():
        if row and name not in ROW_FAMILIES:
            continue
        ranked = tl.rank_tiles(tgt, m, n, k, 1, 2, math_, math_ in tl.WGMMA, top_k=10**6, row=row)
        picked = tl.with_both_row_kinds(ranked[:per_family], ranked, n) if row else ranked[:per_family]
        for r in picked:
            out.append((name, r.tile.candidate(r.split), r.est_us + tl.epilogue_us(tgt, r, m, n, 1, epi)))
        if math_ == tl.WS_F16 and multicast and not row:
            twins = (tl.estimate_tile(tgt, t, m, n, k, 1, 2, math_, True, split=1)
                     for t in (r.tile.multicast_twin() for r in picked[:2] if r.split == 1) if t is not None)
            out += [(MULTICAST, r.tile.candidate(1), r.est_us + tl.epilogue_us(tgt, r, m, n, 1, epi))
                    for r in twins if r is not None]
            pp = tl.rank_pingpong(tgt, m, n, k, 1, 2)[:2]
            out += [(PINGPONG, r.tile.candidate(1), r.est_us + tl.epilogue_us(tgt, r, m, n, 1, epi)) for r in pp]
            twins = (tl.estimate_tile(tgt, t, m, n, k, 1, 2, math_, True, split=1)
                     for t in (r.tile.multicast_twin() for r in pp) if t is not None)
            out += [(PINGPONG_MULTICAST, r.tile.candidate(1), r.est_us + tl.epilogue_us(tgt, r, m, n, 1, epi))
                    for r in twins if r is not None]
    return out


def forced_region(g) -> Region:
    """MatMul + Add as one region whatever the cost model says (at some shapes it leaves the GEMM to ORT)."""
    r = legal.classify(g, set(range(len(g.nodes))))
    if not isinstance(r, Region):
        raise ValueError(f"the sweep's GEMM does not fuse: {r}")
    return dataclasses.replace(r, id=0, traffic=traffic(g, r))


ABLATE = "#define OFZ_ABLATE_EPILOGUE 1\n"  # ortfuse_gemm.h: the plain epilogue's stores left out
# ortfuse_gemm.h: outputs with misaligned rows stored from the fragments, not staged through shared memory
DIRECT = "#define OFZ_DIRECT_STORES 1\n"
# diagnostics of each family's best tile (--ablate, --no-flush, --direct-stores), and their kernels' defines
VARIANTS = ("no epilogue", "no L2 flush", "direct stores")
DEFINES = {"no epilogue": ABLATE, "direct stores": DIRECT}


@dataclass(frozen=True)
class Built:
    name: str  # the kernel's entry point
    source: str
    compiled: CompiledKernel
    model: onnx.ModelProto  # the region's sub-model with the fused node in its place


@dataclass(frozen=True)
class GemmCase:
    """One shape of the sweep: its forced region, the region's sub-model (ORT's MatMul + Add) and ORT's bare
    MatMul (cuBLAS), each with random inputs; `build` makes our kernel for a tile (bench/ncu_gemm.py too)."""
    shape: tuple[int, int, int]
    g: Graph
    region: Region
    sub: onnx.ModelProto
    feeds: dict
    alone: onnx.ModelProto
    alone_feeds: dict
    epilogue: str = "bias"

    @classmethod
    def of(cls, shape: tuple[int, int, int], epilogue: str = "bias") -> "GemmCase":
        m, n, k = shape
        g = build_graph(gemm_model(m, n, k, epilogue=epilogue), {})
        region = forced_region(g)
        sub = region_model(g, region, {})
        alone = region_model(g, anchor_region(g, region), {})
        return cls(shape, g, region, sub, random_feeds(sub, None, seed=m + n + k), alone,
                   random_feeds(alone, None, seed=1), epilogue)

    @property
    def row(self) -> bool:
        return self.epilogue in ROW_EPILOGUES

    @property
    def epi(self) -> float:
        """The epilogue's per-element branches (search.compute)."""
        return compute.epilogue_per_element(self.g, self.region.nodes, anchor_region(self.g, self.region).nodes[0])[1]

    def rest(self, cache: Optional[Path] = None) -> tuple[onnx.ModelProto, dict]:
        """The epilogue alone as our own kernel (everything but the GEMM, one element-wise region), with its
        inputs: the model cuBLAS + ours times after ORT's bare MatMul."""
        a = anchor_region(self.g, self.region).nodes[0]
        r = legal.classify(self.g, set(self.region.nodes) - {a})  # element-wise, or a row kernel
        if not isinstance(r, Region):
            raise ValueError(f"the sweep's epilogue is not one kernel: {r}")
        r = dataclasses.replace(r, id=1, traffic=traffic(self.g, r))
        spec = lower(self.g, r, target_for(ARCHS, True))
        ck = compile_kernel(render(spec.kernel), spec.kernel.name, ARCHS, cache or Options(archs=ARCHS, wgmma=True).cache)
        sub = region_model(self.g, r, {})
        return fused_model(sub, fused_kernel(r, spec, ck).node), random_feeds(sub, None, seed=2)

    def build(self, cand: tuple[int, ...], cache: Optional[Path] = None, ablate: bool = False,
              variant: str = "") -> Built:
        """Our kernel at tile `cand` (LoweringError if this GEMM cannot take it); `ablate` (the variant
        "no epilogue"): without its epilogue's stores; "direct stores": misaligned rows not staged."""
        spec = lower(self.g, self.region, target_for(ARCHS, True), tile=cand)
        src = render(spec.kernel)
        define = DEFINES.get("no epilogue" if ablate else variant, "")
        if define:
            src = src.replace('#include "ortfuse_kernel.h"', define + '#include "ortfuse_kernel.h"', 1)
        ck = compile_kernel(src, spec.kernel.name, ARCHS, cache or Options(archs=ARCHS, wgmma=True).cache)
        return Built(spec.kernel.name, src, ck, fused_model(self.sub, fused_kernel(self.region, spec, ck).node))


def _build_all(case: GemmCase, cands: Sequence[tuple[int, ...]], cache: Optional[Path],
               variant: str = "") -> dict[tuple[int, ...], Optional[Built]]:
    """Our kernel at each candidate (None where this GEMM cannot take it), compiled side by side (NVRTC
    releases the GIL): one after another, a shape's up to 20 candidates add up on the device machine."""
    def build(cand: tuple[int, ...]) -> Optional[Built]:
        try:
            return case.build(cand, cache, variant=variant)
        except LoweringError:
            return None
    with ThreadPoolExecutor(max_workers=max(1, min(len(cands), os.cpu_count() or 1))) as pool:
        return dict(zip(cands, pool.map(build, cands)))


def sweep_shape(shape: tuple[int, int, int], timer: Timer, per_family: int = 6, cache: Optional[Path] = None,
                ablate: bool = False, noflush: Optional[Timer] = None, epilogue: str = "bias",
                direct_stores: bool = False) -> ShapeResult:
    """Every family's best tiles at one shape; with `ablate` each family's fastest again without its epilogue
    stores, with `noflush` (a timer that leaves the L2 warm) cuBLAS and those tiles again, unflushed, with
    `direct_stores` again storing misaligned rows from the fragments (where the kernel stages them); with
    another epilogue than the bias, cuBLAS + the epilogue as our kernel too."""
    case = GemmCase.of(shape, epilogue)
    cublas = timer(case.alone, case.alone_feeds, False)
    ort_region = timer(case.sub, case.feeds, False)
    split = None
    if epilogue != "bias":
        rest, rest_feeds = case.rest(cache)
        split = cublas + timer(rest, rest_feeds, True)

    epi = case.epi if epilogue not in ("bias", *ROW_EPILOGUES) else 0.0
    # B multicast and ping-pong are mainloop questions: timed with the bias alone
    cands = candidates(*shape, per_family, epi, case.row, epilogue == "bias")
    prebuilt = _build_all(case, [c[1] for c in cands], cache)

    def one(family: str, cand: tuple[int, ...], est: float, variant: str = "") -> Optional[SweepRow]:
        built = prebuilt[cand] if variant not in DEFINES and cand in prebuilt else \
            _build_all(case, [cand], cache, variant if variant in DEFINES else "")[cand]
        if built is None:
            return None  # a tile this GEMM cannot take (the ranking's shapes are the lowering's)
        res = dict(built.compiled.resources).get(ARCHS[0])
        clock = noflush if variant == "no L2 flush" and noflush else timer
        err = ""
        try:
            us = clock(built.model, case.feeds, True)
        except Exception as exc:  # noqa: BLE001 - recorded in the row
            us, err = math.nan, f"{type(exc).__name__}: {str(exc)[:300]}"
        return SweepRow(shape, family, cand, us, est, res.regs if res else 0, res.spill_bytes if res else 0, err,
                        variant)

    rows = [r for r in (one(*c) for c in cands) if r is not None]
    # fp16 rows that are not 16-byte aligned: the kernels stage their stores
    staged = padded_width(shape[1], TensorProto.FLOAT16) != shape[1]
    variants = [v for v, on in zip(VARIANTS, (ablate, noflush is not None, direct_stores and staged)) if on]
    for name in NAMES if variants else ():
        best = _best(rows, name)
        if best is not None:
            rows += [r for r in (one(name, best.tile, best.est_us, v) for v in variants) if r is not None]
    cublas_warm = noflush(case.alone, case.alone_feeds, False) if noflush else None
    return ShapeResult(shape, cublas, ort_region, tuple(rows), cublas_warm, epilogue, split)


def run(shapes: Sequence[tuple[int, int, int]] = SHAPES, per_family: int = 6, timer: Optional[Timer] = None,
        on_shape: Optional[Callable[[list[ShapeResult]], None]] = None, ablate: bool = False,
        no_flush: bool = False, noflush_timer: Optional[Timer] = None, epilogue: str = "bias",
        direct_stores: bool = False) -> list[ShapeResult]:
    """Every shape in turn; `on_shape` sees the results so far after each (a cut-off run keeps them)."""
    if timer is None:
        from ortfuse.profile import device_timer
        timer = device_timer
        if no_flush and noflush_timer is None:
            noflush_timer = functools.partial(device_timer, flush_l2=False)
    out: list[ShapeResult] = []
    for s in shapes:
        out.append(sweep_shape(s, timer, per_family, ablate=ablate, noflush=noflush_timer if no_flush else None,
                               epilogue=epilogue, direct_stores=direct_stores))
        if on_shape:
            on_shape(out)
    return out


def summary(results: Sequence[ShapeResult]) -> list[str]:
    """Per family: its best tile over cuBLAS per shape, and the median of measured / estimated; with the
    diagnostics, the share of the best tile's time its epilogue stores take, and what a warm L2 changes."""
    out = []
    for name in NAMES:
        best = [_best(res.rows, name) for res in results]
        ratios = [b.us / res.cublas_us for b, res in zip(best, results) if b is not None]
        model = [r.us / r.est_us for res in results for r in res.rows
                 if r.family == name and r.est_us > 0 and not r.error and not r.variant]
        failed = sum(1 for res in results for r in res.rows if r.family == name and r.error)
        if failed:
            out.append(f"{name}: {failed} tile(s) failed to run (rows marked 'failed')")
        if ratios:
            out.append(f"{name}: best tile / cuBLAS median {float(np.median(ratios)):.2f} (range "
                       f"{min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} shapes; measured / estimated "
                       f"median {float(np.median(model)):.2f}")
        for variant in VARIANTS:
            pairs = [(b, v) for b, res in zip(best, results) if b is not None
                     for v in res.rows if v.variant == variant and v.family == name and v.tile == b.tile and not v.error]
            if pairs:
                cells = ", ".join(f"{'x'.join(map(str, b.shape))} {b.us:.1f} -> {v.us:.1f} us" for b, v in pairs)
                out.append(f"{name} best tile, {variant}: {cells}")
    # the unranked TMA mainloops against the ranked one, shape by shape: whether the tile model should rank them
    for name in (MULTICAST, PINGPONG, PINGPONG_MULTICAST):
        pairs = [(res.shape, _best(res.rows, name), _best(res.rows, "wgmma+TMA")) for res in results]
        cells = [f"{'x'.join(map(str, s))} {b.us / t.us:.2f}" for s, b, t in pairs if b is not None and t is not None]
        if cells:
            out.append(f"{name} best / wgmma+TMA best: " + ", ".join(cells))
    warm = [f"{'x'.join(map(str, r.shape))} {r.cublas_us:.1f} -> {r.cublas_noflush_us:.1f} us"
            for r in results if r.cublas_noflush_us is not None]
    if warm:
        out.append("cuBLAS, no L2 flush: " + ", ".join(warm))
    out += misaligned_lines(results)
    split = [f"{'x'.join(map(str, r.shape))} {min((x.us for x in r.rows if not x.error and not x.variant), default=math.nan):.1f}"
             f" fused vs {r.split_us:.1f}" for r in results if r.split_us is not None]
    if split:
        out.append("best fused tile vs cuBLAS + our epilogue kernel (us): " + ", ".join(split))
    return out


def misaligned_lines(results: Sequence[ShapeResult], dram_gbps: Optional[float] = None) -> list[str]:
    """For each shape whose fp16 rows are not 16-byte aligned and that ran beside its padded twin (N rounded
    up to 8 columns: `--shapes 4096x50257x768 4096x50264x768`), per family: the best tile's time on both and
    the store factor it implies, 1 + (misaligned - aligned) / the misaligned output's DRAM time (what
    Target.staged_store_factor stands for; with --direct-stores, the old fragment stores' too, what
    Target.unaligned_store_factor stands for)."""
    bw = dram_gbps or for_cc(ARCHS[0]).dram_gbps
    by_shape = {r.shape: r for r in results}
    out = []
    for res in results:
        m, n, k = res.shape
        twin = by_shape.get((m, padded_width(n, TensorProto.FLOAT16), k))
        if twin is None or twin is res:
            continue
        dram_us = m * n * 2 / (bw * 1e3)
        for name in NAMES:
            mis, al = _best(res.rows, name), _best(twin.rows, name)
            if mis is None or al is None:
                continue
            cells = [f"{mis.us:.1f} vs {al.us:.1f} us aligned, store factor {1 + (mis.us - al.us) / dram_us:.2f}"]
            direct = [v for v in res.rows if v.variant == "direct stores" and v.family == name and v.tile == mis.tile
                      and not v.error]
            cells += [f"direct stores {v.us:.1f} us, factor {1 + (v.us - al.us) / dram_us:.2f}" for v in direct]
            out.append(f"{name}, {m}x{n}x{k} misaligned: " + "; ".join(cells))
    return out


def _best(rows: Sequence[SweepRow], family: str) -> Optional[SweepRow]:
    """The family's fastest tile that ran (its diagnostics aside)."""
    return min((r for r in rows if r.family == family and not r.error and not r.variant),
               key=lambda r: r.us, default=None)


def render_md(results: Sequence[ShapeResult]) -> str:
    lines = []
    for res in results:
        m, n, k = res.shape
        flops = 2.0 * m * n * k
        split = f", cuBLAS + our epilogue kernel {res.split_us:.1f} us" if res.split_us is not None else ""
        lines += [f"### {m}x{n}x{k} fp16 + {EPILOGUES[res.epilogue]}: cuBLAS (ORT MatMul) {res.cublas_us:.1f} us "
                  f"({flops / (res.cublas_us * 1e6):.0f} TFLOP/s), ORT's region {res.ort_region_us:.1f} us{split}", "",
                  "| family | tile | us | TFLOP/s | / cuBLAS | estimate us | regs | spill |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(res.rows, key=lambda r: (bool(r.error), r.us)):
            if r.error:
                lines.append(f"| {r.family} | {tile_label(r.tile)} | failed: {r.error} | | | {r.est_us:.1f} | "
                             f"{r.regs} | {r.spill_bytes} |")
                continue
            label = tile_label(r.tile) + (f" ({r.variant})" if r.variant else "")
            lines.append(f"| {r.family} | {label} | {r.us:.1f} | {r.tflops:.0f} | "
                         f"{r.us / res.cublas_us:.2f} | {r.est_us:.1f} | {r.regs} | {r.spill_bytes} |")
        lines.append("")
    return "\n".join([*lines, *summary(results)]) + "\n"


def as_json(results: Sequence[ShapeResult]) -> list[dict]:
    return [{**asdict(res), "rows": [{**asdict(r), "tflops": r.tflops} for r in res.rows]} for res in results]


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"bad shape '{text}': expected MxNxK, e.g. 4096x768x768")
    return int(parts[0]), int(parts[1]), int(parts[2])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=_shape, default=list(SHAPES), metavar="MxNxK")
    ap.add_argument("--per-family", type=int, default=6, help="the model's best N tiles of each family")
    ap.add_argument("--ablate", action="store_true",
                    help="also time each family's best tile without its epilogue stores (mainloop alone)")
    ap.add_argument("--no-flush", action="store_true",
                    help="also time cuBLAS and each family's best tile without flushing the L2 before a run")
    ap.add_argument("--direct-stores", action="store_true",
                    help="also time each family's best tile storing misaligned rows from the fragments instead "
                         "of through shared memory (where it stages them)")
    ap.add_argument("--epilogue", choices=sorted(EPILOGUES), default="bias",
                    help="the GEMM's epilogue: its bias, or bias + BERT's erf GELU, SiLU, softsign (a division), "
                         "residual + LayerNorm (a row-wise epilogue), or a gated MLP's SiLU(gate) * up over "
                         "interleaved columns (no bias)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    a = ap.parse_args(argv)

    def write(results: list[ShapeResult]) -> None:
        if a.md:
            a.md.write_text(render_md(results))
        if a.json:
            a.json.write_text(json.dumps(as_json(results), indent=1))

    results = run(a.shapes, a.per_family, on_shape=write, ablate=a.ablate, no_flush=a.no_flush, epilogue=a.epilogue,
                  direct_stores=a.direct_stores)
    print(render_md(results))
    return 0 if all(math.isfinite(r.us) for res in results for r in res.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

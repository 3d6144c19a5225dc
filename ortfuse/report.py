"""Human-readable output of `optimize`: the closing summary, `--explain`, and the markdown report."""
from __future__ import annotations

import re

from ortfuse.api import OptimizeResult
from ortfuse.profile import tile_label, us_text
from ortfuse.rewriter.ort_folding import left_folded
from ortfuse.rewriter.shapes import merges_into_sizes
from ortfuse.search import conv, legal, ops
from ortfuse.search.attention import k_rope_outside, pattern_of


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _merged_note(r: OptimizeResult) -> list[str]:
    """A line where candidates were refused because shape inference merged a symbolic dim into a size (an
    export that computes with its traced length, Mamba's unrolled scan): --input-shape is the way out."""
    refused = {m.group(1) for x in r.plan.refusals if legal.MERGED_DIM in x.reason
               for m in [re.search(r"input '(.*)' axis", x.reason)] if m}
    if not refused:
        return []
    sizes = merges_into_sizes(r.graph)
    what = ", ".join(f"'{s}' into {v}" for s, v in sorted(sizes.items())) or "symbolic dims into sizes"
    declaring = [vi.name for vi in r.graph.model.graph.input
                 if any(d.dim_param in sizes for d in vi.type.tensor_type.shape.dim)]
    return [f"merged dims:          shape inference merged {what}: the regions reading {len(refused)} tensors of "
            "a merged size were left to ORT (the dim might be 1 at run time); if the model runs only at that size, "
            "give the shapes of " + (", ".join(declaring) or "the inputs") + " with --input-shape"]


def summary(r: OptimizeResult) -> str:
    pct = 100.0 * r.memory_bound_fused / r.memory_bound_ops if r.memory_bound_ops else 0.0
    absorbed = sum(len(k.region.nodes) for k in r.kernels)
    g = r.graph
    inputs = {d for t in g.graph_inputs for d in g.tensors[t].shape or () if isinstance(d, str)}
    hints = ", ".join(f"{k}={v}" for k, v in sorted(g.sym_hints.items()) if k in inputs) or "static shapes"
    wgmma = len({e for k in r.kernels for e, spec in k.all_kernels() if spec.kernel.arch_specific})
    tma = len({e for k in r.kernels for e, spec in k.all_kernels() if spec.kernel.tma})
    kinds = {}
    for k in r.kernels:
        kinds[k.region.kind] = kinds.get(k.region.kind, 0) + 1
    by_kind = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    runtime_convs = sum(1 for k in r.kernels for i in k.region.nodes if g.nodes[i].op_type in ops.CONV
                        and not isinstance(geo := conv.conv_geometry(g, g.nodes[i]), str) and not geo.static_image)
    note = ([f"symbolic image sizes: {runtime_convs} fused Convs index images of run-time size (fix the sizes with "
             "--input-shape for static index math)"] if runtime_convs else [])
    chains = sum(1 for k in r.kernels if k.region.kind == "gemm" for i in k.region.nodes
                 if conv.is_anchor(g, g.nodes[i]) and g.nodes[i].op_type in ops.CONV
                 and g.producer.get(g.nodes[i].input[0]) in k.region.nodes)
    if chains:
        note.append(f"conv chains:          {chains} Convs compute their input image in their gather (never written)")
    gated = sum(1 for k in r.kernels if k.region.kind == "gemm" for i in k.region.nodes
                if conv.is_anchor(g, g.nodes[i]) and legal.gated_reads(g, k.region.nodes, i) is not None)
    if gated:
        note.append(f"gated GEMMs:          {gated} GEMMs compute a gated activation's two halves (gate and up "
                    "interleaved) and write its product")
    pats = [pattern_of(g, k.region.nodes) for k in r.kernels if k.region.kind == "attention"]
    ropes = sum((p.q_rope is not None) + (p.k_rope is not None) for p in pats if p is not None)
    if ropes:
        note.append(f"rotary embeddings:    {ropes} applied by the attention kernels to the Q and K rows they load")
    outside = sum(1 for p in pats if p is not None and p.softmax in k_rope_outside(g) and p.k_rope is None)
    if outside:
        note.append(f"rotated keys:         {outside} attention kernels read K rotated once before them (not on "
                    "every K tile they load)")
    frontier = sum(1 for k in r.kernels if any(f.name == "S.key_end" for f in k.spec.kernel.funcs))
    window = sum(1 for k in r.kernels if any(f.name == "S.key_begin" for f in k.spec.kernel.funcs))
    if frontier:
        note.append(f"causal frontiers:     {frontier} attention kernels skip the key tiles past their query rows' "
                    "diagonal (their mask hides every key there)"
                    + (f"; {window} also those before a sliding window" if window else ""))
    folds = sum(1 for k in r.kernels if k.spec.ln_fold is not None)
    if folds:
        note.append(f"LayerNorm prologues:  {folds} LayerNorms folded into the GEMMs that read them (--ln-fold)")
    pdl = [k for k in r.kernels if k.spec.kernel.pdl]
    if pdl:
        fetch = sum(1 for k in pdl if k.spec.kernel.prefetch)
        note.append(f"dependent launches:   {len(pdl)} kernels may start while the one before finishes (--pdl, sm_90+)"
                    + (f"; {fetch} prefetch their weights into L2 first" if fetch else ""))
    note += _merged_note(r)
    if r.requantized:
        note.append(f"quantization:         ORT merges {len(r.requantized)} quantize/dequantize chain"
                    f"{'s' if len(r.requantized) > 1 else ''} at a new scale in one of the two models only (--report "
                    "names them): under ORT's graph optimizations their results differ by that rounding")
    left = len(left_folded(g, {i for k in r.kernels for i in k.region.nodes}))
    if left:
        note.append(f"constant cones:       {left} ops computed from constants alone left to ORT, which folds them "
                    "when a session starts")
    return "\n".join(note + [
        f"regions fused:        {len(r.kernels)}" + (f" ({by_kind})" if by_kind else ""),
        f"ops absorbed:         {absorbed} (memory-bound ops fused: {r.memory_bound_fused}/{r.memory_bound_ops} = {pct:.0f}%)",
        f"nodes:                {r.nodes_before} -> {r.nodes_after}",
        f"kernels compiled:     {r.kernels_compiled} distinct, for {', '.join(f'sm_{a}' for a in r.archs)} (+PTX)"
        + (f"; {wgmma} wgmma kernels for sm_90a only" if wgmma else "")
        + (f" ({tma} fed by TMA)" if tma else "")
        + ("; the model runs on sm_90 GPUs only (--no-wgmma: portable)" if wgmma else ""),
        f"est. DRAM saved:      {_mb(r.bytes_saved)} per inference ({hints})",
        f"time:                 {r.seconds:.1f} s",
    ])


def _is_candidate(subject: str) -> bool:
    return ops.kind_of(subject.split(" ", 1)[0]) is not None


def explain(r: OptimizeResult) -> list[str]:
    """Why ops ortfuse fuses (and candidate merges/regions) were not fused."""
    lines = [f"not fused: {x}" for x in r.plan.rejects if _is_candidate(x.subject)]
    lines += [f"refused:   {x}" for x in r.plan.refusals]
    lines += [f"retiled:   {k.node.name}: {k.retiled}" for k in r.kernels if k.retiled]
    return lines


def markdown(r: OptimizeResult, source: str) -> str:
    est = dict(r.estimates)
    where = " / ".join(w for w, _, _ in next(iter(est.values()), ()))
    out = [f"# ortfuse report: {source}", "", "```", summary(r), "```", "", "## Fused regions", "",
           "| node | kind | ops | iteration space | kernel | block | registers (spill bytes) | "
           f"DRAM bytes unfused → fused | est. us, ours vs ORT's ops ({where or 'hints'}) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for k in r.kernels:
        ops_list = " ".join(r.graph.nodes[i].op_type for i in k.region.nodes)
        t = k.region.traffic
        res = ", ".join(f"sm_{cc}: {x.regs}" + (f" ({x.spill_bytes})" if x.spill_bytes else "")
                        + (f", wgmma serialized: {x.wgmma_serialized}" if x.wgmma_serialized else "")
                        for cc, x in k.compiled.resources) or "-"
        shared = "keys split across clusters of up to" if k.region.kind == "attention" else "split-K up to"
        split = f", {shared} {k.spec.split_k}" if k.spec.split_k > 1 else \
            f", rows split across clusters of {k.spec.row_cluster}" if k.spec.row_cluster > 1 else ""
        if k.spec.kernel.ops_consts:  # (ortfuse_gemm.h kStageOut: rows not 16-byte aligned)
            split += ", stores staged through shared memory"
        by_size = "".join(f"; from {frm} rows `{vck.entry}` ({vspec.block})" for frm, vspec, vck in k.variants)
        out.append(f"| {k.node.name} | {k.region.kind} | {ops_list} | {k.region.space} | `{k.compiled.entry}`"
                   f"{by_size} | {k.spec.block}{split} | {res} | {t.unfused_bytes:,} → {t.fused_bytes:,} | "
                   f"{' / '.join(f'{o:.1f} vs {a:.1f}' for _, o, a in est.get(k.node.name, ())) or '—'} |")
    if r.placements:
        out += ["", "## Measured placement (--profile: median us per call, ORT's kernels vs ours)", "",
                f"Each cell gives one time per binding ({' / '.join(r.placements[0].bindings)}); 'ORT / kept' "
                "is the geometric mean over the bindings of ORT's time over the kept choice's.", "",
                "| region | ORT | ours (per tile) | cuBLAS + ours (epilogue alone) | kept | ORT / kept | cost model: ORT, ours |",
                "|---|---|---|---|---|---:|---|"]
        for pl in r.placements:
            failed = dict(pl.failed)
            tiles = "; ".join(f"{tile_label(t)}: " + (f"failed ({failed[t]})" if t in failed else us_text(ts))
                              for t, ts in pl.ours_us)
            split = us_text(pl.split_us) if pl.split_us is not None else "—"
            kept = "split" if pl.split else "ours" if pl.keep else "ORT"
            if pl.keep and pl.variants:
                kept += f" by size: {tile_label(pl.tile)}" + "".join(f"; from {r} rows {tile_label(v)}" for r, v in pl.variants)
            elif pl.keep and len(pl.ours_us) > 1:
                kept += f": {tile_label(pl.tile)}"
            model = (f"{us_text(pl.model_ort_us)}, {us_text(pl.model_ours_us)}"
                     if pl.model_ort_us is not None and pl.model_ours_us is not None else "—")
            out.append(f"| {pl.region} | {us_text(pl.ort_us)} | {tiles} | {split} | {kept} | {pl.speedup:.2f}x | {model} |")
    if r.layout:
        out += ["", "## Residual-stream layout (rewriter.layout)", ""] + [f"- {x}" for x in r.layout]
    if r.ort_attention:
        out += ["", "## ORT's fused attention (rewriter.mha)", ""] + [f"- {x}" for x in r.ort_attention]
    if r.contrib:
        out += ["", "## ORT's fused ops in the input (rewriter.contrib)", ""] + [f"- {x}" for x in r.contrib]
    if r.kept_readers or r.requantized:
        out += ["", "## Quantize/dequantize nodes (rewriter.qdq)", "",
                "ORT rewrites a quantized model by its quantize/dequantize nodes' readers (DoubleQDQPairsRemover "
                "merges two pairs at a new scale, the QDQ selectors make quantized kernels) where a tensor has one "
                "reader; each one the rewrite left with one keeps a second, a Size of it.", ""]
        out += [f"- kept: {x}" for x in r.kept_readers]
        out += [f"- merged at a new scale in one model only: {x}" for x in r.requantized]
    out += ["", "## Not fused", ""] + [f"- {x}" for x in explain(r)]
    return "\n".join(out) + "\n"

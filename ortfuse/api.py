"""`optimize`: the whole pipeline as a recipe, one stage per line."""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import onnx

from ortfuse.config import Options
from ortfuse.customops import attrs
from ortfuse.customops.compile import CompiledKernel, compile_kernel
from ortfuse.customops.key_bound import key_bound
from ortfuse.customops.lower import KernelSpec, LoweringError, lower
from ortfuse.customops.printer import render
from ortfuse.customops.target import Target, parse_arch
from ortfuse.errors import OrtfuseError
from ortfuse.rewriter.batchnorm import fold_batchnorms
from ortfuse.rewriter.canonical import (bypass_broadcast_expands, bypass_lone_concats, bypass_noop_expands,
                                        explicit_auto_pads, fold_constant_identities, fold_constant_subgraphs,
                                        fold_conv_pads, fold_runtime_shapes, fold_small_values,
                                        merge_regrouped_transposes, sink_constant_expands, unflatten_gemms)
from ortfuse.rewriter import _proto, onnx_attention
from ortfuse.rewriter.contrib import notes as contrib_notes, restore as restore_contrib_ops, split_contrib_ops
from ortfuse.rewriter.layout import chain_heads, sink_transposes
from ortfuse.rewriter.gemm_packing import deinterleave_unfused, interleave_halves, pack_sibling_gemms
from ortfuse.rewriter.gemm_padding import pad_unaligned_gemms
from ortfuse.rewriter.graph import Graph
from ortfuse.rewriter.iota import fold_iota_gathers, isolate_iotas, trilus_as_iotas
from ortfuse.rewriter.load import load_model
from ortfuse.rewriter.qdq import (keep_readers_as_input, left_to_ort, merged_chain_outputs, merged_pairs, readers,
                                  weight_bias_units)
from ortfuse.rewriter.mha import MhaForm, is_mha, to_mha
from ortfuse.rewriter.ort_folding import left_folded
from ortfuse.rewriter.ort_fusions import ort_fusion_units, with_splits
from ortfuse.rewriter.replace import FusedNode, replace, save_model
from ortfuse.rewriter.shapes import build_graph, check_dim_hints, merged_sizes, minted_dims, parse_input_shapes
from ortfuse.rewriter.weights import WeightStore, materialized
from ortfuse.search import ops, ort_attention
from ortfuse.search.attention import absorbed_selects, find_attention
from ortfuse.search.cost import CostModel, at_binding, bindings
from ortfuse.search.legal import QUANTIZING, inexact_before_quantizers, quantizer_readers
from ortfuse.search.plan import Plan, Region
from ortfuse.search.regions import plan as search_plan

ModelLike = Union[str, Path, onnx.ModelProto]
TF32_KEY = "ortfuse.tf32"
Shapes = Union[Mapping[str, Sequence[Union[int, str]]], Sequence[str], None]
Progress = Callable[[str], None]


@dataclass(frozen=True)
class FusedKernel:
    region: Region
    spec: KernelSpec
    compiled: CompiledKernel
    node: FusedNode
    retiled: str = ""  # why the top-ranked GEMM tile was replaced after compiling (ptxas spilled it)
    # further kernels of the node by size, (rows from, spec, kernel): `--profile` measured another tile
    # fastest at a larger binding (attrs.node_attributes)
    variants: tuple[tuple[int, KernelSpec, CompiledKernel], ...] = ()

    def all_kernels(self) -> list[tuple[str, KernelSpec]]:
        """(entry, spec) of every kernel the node carries."""
        return [(self.compiled.entry, self.spec), *((ck.entry, spec) for _, spec, ck in self.variants)]


@dataclass(frozen=True)
class OptimizeResult:
    stubbed: onnx.ModelProto  # the result, its large weights stubs into `weights` (what `save` streams out)
    graph: Graph
    plan: Plan
    kernels: tuple[FusedKernel, ...]
    nodes_before: int
    nodes_after: int
    memory_bound_ops: int  # ops of the classes ortfuse fuses (ORT-free layout ops excluded)
    memory_bound_fused: int
    kernels_compiled: int  # distinct kernel sources
    bytes_saved: int  # estimated DRAM bytes per inference, symbolic dims at their hints
    seconds: float
    archs: tuple[int, ...]
    placements: tuple = ()  # ortfuse.profile.Placement per region when profiled on the GPU
    layout: tuple[str, ...] = ()  # each residual stream's layout decision, with its estimate (`_layout_chosen`)
    ort_attention: tuple[str, ...] = ()  # each kind of attention pattern's MultiHeadAttention decision, or why none
    weights: Optional[WeightStore] = None  # the large weights of `stubbed` and `graph` (rewriter.weights)
    contrib: tuple[str, ...] = ()  # each of ORT's fused ops in the input: fused as standard ops, or put back
    requantized: tuple[str, ...] = ()  # quantize/dequantize chains ORT merges in one of the models only (rewriter.qdq)
    kept_readers: tuple[str, ...] = ()  # Q/DQ outputs that keep a second reader (a Size) for ORT's sake (rewriter.qdq)
    # per fused node, the cost model's (binding, ours us, ORT's us) at each binding it judges by (the hints, batch
    # 32): what a kernel-by-kernel timeline on a GPU is compared with
    estimates: tuple[tuple[str, tuple[tuple[str, float, float], ...]], ...] = ()

    @functools.cached_property
    def model(self) -> onnx.ModelProto:
        """The optimized model, every weight in it (made on first use: one more copy of the weights)."""
        return materialized(self.stubbed)

    def save(self, path: Union[str, Path]) -> None:
        """Writes the optimized model as `rewriter.replace.save_model` does, streaming the weights from the
        store (over 2 GB into "<name>.data") rather than copying them into one model first."""
        save_model(self.stubbed, path)


def _archs(arch: Union[str, Sequence[str]]) -> tuple[int, ...]:
    names = arch.split(",") if isinstance(arch, str) else list(arch)
    return tuple(sorted({parse_arch(a.strip()).cc for a in names if a.strip()}))


def target_for(archs: Sequence[int], wgmma: bool = False, pdl: bool = False, key_frontier: bool = True) -> Target:
    """The newest arch's table entry with the smallest shared memory and cluster size of all targets: one
    kernel source (and its tiles) must launch on every arch it is compiled for. wgmma kernels only where
    every arch has them and `wgmma` is set (Options.wgmma: unless the user turned them off); programmatic
    dependent launches likewise (Options.pdl); causal frontiers as Options.key_frontier says."""
    return dataclasses.replace(parse_arch(f"sm_{max(archs)}"),
                               smem_per_block=min(parse_arch(f"sm_{a}").smem_per_block for a in archs),
                               max_cluster=min(parse_arch(f"sm_{a}").max_cluster for a in archs),
                               wgmma=wgmma and all(parse_arch(f"sm_{a}").wgmma for a in archs),
                               pdl=pdl and all(parse_arch(f"sm_{a}").pdl for a in archs), key_frontier=key_frontier)


def _shapes(input_shapes: Shapes) -> dict:
    if input_shapes is None:
        return {}
    if isinstance(input_shapes, Mapping):
        return {k: tuple(v) for k, v in input_shapes.items()}
    return parse_input_shapes(list(input_shapes))


_UNNAMED = re.compile(r"unk__\d+")  # SymbolicShapeInference's name for a dim it could not compute


def _pinned_symbolic(model: onnx.ModelProto, graph: Graph) -> set[str]:
    """The graph inputs `--input-shape` made static where the model declares a dim symbolic (or no shape)."""
    declared = {vi.name: vi.type.tensor_type for vi in model.graph.input}
    out = set()
    for t in graph.graph_inputs:
        tt = declared.get(t)
        if tt is None or not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
            info = graph.tensors.get(t)
            if info is not None and info.is_static:
                out.add(t)
    return out


def _shapes_settled(graph: Graph, shapes: dict, folded: int, say: Progress) -> Graph:
    """Shape inference again where the folds made run-time shape arithmetic constant and the first pass could
    not follow it: it minted symbols for the dims (a kernel cannot bind those: Swin's window Pad, whose pads
    come from the image size) or merged a symbolic dim into a size (a region reading it is refused: DINOv2
    resizes its position embeddings to a grid whose side is computed through Pow, and their token count met
    the patches' in an Add; MobileViT's unfold Reshapes take targets computed from the batch, whose one
    run-time entry becomes -1 once the rest folds, `canonical._one_entry_unknown`, one transformer stage a
    round, the next stage's shapes read from this one's), or left it without a dim's name or a rank (torch's
    nn.MultiheadAttention unflattens its packed projection to a target whose Slice bounds come from a Mod of
    constants: once folded, the heads' shapes are known). Rounds go on while they fold something and the
    unknowns go away (at most 8); none runs where inference knew every dim (the usual case)."""
    def unknown(gr: Graph) -> int:  # merged sizes, minted dims, dims nobody could name, ranks nobody knows
        outputs = [gr.tensors.get(o) for n in gr.nodes if n.domain in ("", "ai.onnx") for o in n.output if o]
        unnamed = {d for t in outputs if t is not None for d in t.shape or () if isinstance(d, str)
                   and _UNNAMED.fullmatch(d)}
        return len(merged_sizes(gr)) + len(minted_dims(gr)) + len(unnamed) + \
            sum(1 for t in outputs if t is not None and t.shape is None)

    before = unknown(graph)
    counts = [before]
    for _ in range(8):
        if not folded or not unknown(graph) or (len(counts) > 2 and counts[-1] >= counts[-3]):
            break
        m = onnx.ModelProto()
        m.CopyFrom(graph.model)
        # inferred afresh, not read back; but what only the exporter could say (outputs of other domains' ops)
        made_elsewhere = {o for n in m.graph.node if n.domain not in ("", "ai.onnx") for o in n.output}
        keep = [v for v in m.graph.value_info if v.name in made_elsewhere]
        del m.graph.value_info[:]
        m.graph.value_info.extend(keep)
        again = build_graph(m, shapes, graph.hint_overrides)
        if unknown(again) > unknown(graph):
            break
        again, a = fold_runtime_shapes(again)
        again, b = fold_small_values(again)
        again, c = fold_runtime_shapes(again)  # targets whose other entries the small values just made constant
        graph, folded = again, a + b + c
        counts.append(unknown(graph))
    if unknown(graph) < before:
        say(f"shapes inferred again after folding: {before - unknown(graph)} unknown dims and merged sizes resolved")
    return graph


def _layout_chosen(graph: Graph, plan_of: Callable[[Graph], Plan], cost: CostModel,
                   always: bool = False) -> tuple[Graph, list[str]]:
    """`graph` with each residual stream kept in its blocks' layout (`rewriter.layout`) where the whole-model
    estimate of the two plans says that pays, chain by chain (ConvNeXt's stages differ: the depthwise Convs
    it lets into row kernels cost issue slots that the DRAM traffic saved must cover, `CostModel.window_us`
    and `row_lane_use`), and a line per stream saying what was decided. `always`: every stream where that
    saves transposed copies (`--layout blocks`)."""
    if always:
        sunk, n = sink_transposes(graph)
        return sunk, [f"{n} residual ops kept in their blocks' layout (--layout blocks)"] if n else []
    notes = []
    for head in chain_heads(graph):
        trial, n = sink_transposes(graph, lambda h: h == head)
        if not n:
            continue
        times = cost.plan_times(trial, plan_of(trial), plan_of(graph), graph)
        kept = cost.pays(times)
        where = "kept in its blocks' layout" if kept else "left in the model's layout"
        notes.append(f"the residual stream of {n} ops from '{head}' {where}: estimated {cost.figures(times)} "
                     f"in the model's")
        if kept:
            graph = trial
    return graph, notes


def _ort_attention_chosen(graph: Graph, plan_of: Callable[[Graph], Plan], cost: CostModel, mode: str = "auto",
                          measure: Optional[Callable[[Graph, MhaForm], Optional[tuple[bool, str]]]] = None
                          ) -> tuple[Graph, list[str]]:
    """`graph` with attention patterns handed to ORT's MultiHeadAttention (`rewriter.mha`) where the
    whole-model estimate of the two plans gains (Collage's third backend: the plan without it holds the
    search's choice of our kernel, its ops fused otherwise or ORT's unfused ops), or where `measure`
    (--profile) times it faster than our kernel and ORT's unfused ops; one decision per kind of pattern (a
    model's layers are one), and a line per kind saying what was decided.
    `mode` "on": wherever MultiHeadAttention computes the pattern."""
    if mode == "off":
        return graph, []
    found, refused = ort_attention.forms(graph, find_attention(graph)[0])
    notes = [f"attention at {where} stays: not ORT's MultiHeadAttention ({why})" for where, why in refused]
    frontier = cost.target.key_frontier
    for sig in dict.fromkeys(_attention_kind(graph, f, frontier) for f in found):
        # the forms on the graph as rewritten so far (node indices move; the tensors they read do not)
        now = [f for f in ort_attention.forms(graph, find_attention(graph)[0])[0]
               if _attention_kind(graph, f, frontier) == sig]
        if not now:
            continue
        like = f"{len(now)} attention pattern{'s' if len(now) > 1 else ''} like Softmax '{now[0].softmax}'"
        # the projections' bias Adds into the node's bias input where the estimate says that gains (the plan
        # without the node first: each of the three is planned once)
        if mode != "on":
            plan_of(graph)
        trial, biased = to_mha(graph, now), to_mha(graph, now, biases=True)
        if any(is_mha(n) and len(n.input) > 3 and n.input[3] for n in biased.nodes) and \
                cost.pays(cost.plan_times(biased, plan_of(biased), plan_of(trial), trial)):
            trial, like = biased, like + " (the projections' bias Adds taken in)"
        if mode == "on":
            notes.append(f"{like} -> ORT's MultiHeadAttention (--ort-attention on)")
            graph = trial
            continue
        verdict = measure(graph, now[0]) if measure else None
        if verdict is None:
            times = cost.plan_times(trial, plan_of(trial), plan_of(graph), graph)
            verdict = cost.pays(times), (f"the model estimated at {cost.figures(times)} without it (our "
                                         "kernel, its ops fused otherwise or ORT's unfused ops)")
        taken, why = verdict
        notes.append(f"{like} {'-> ORT' if taken else 'not to ORT'}'s MultiHeadAttention: {why}")
        if taken:
            graph = trial
    return graph, notes


def _quantizer_read(g: Graph) -> frozenset[str]:
    """Outputs of the nodes whose values a quantizer reads (`legal.quantizer_readers`)."""
    return frozenset(o for i in quantizer_readers(g) for o in g.nodes[i].output if o)


def _attention_kind(g: Graph, form: MhaForm, frontier: bool) -> tuple:
    """Forms one MultiHeadAttention decision serves: the same signature and, where our kernel skips key tiles
    past a causal frontier, the same frontier (a model's global and sliding-window layers cost it apart)."""
    if not frontier:
        return form.signature(g)
    pat = next((p for p in find_attention(g)[0] if p.softmax in form.nodes), None)
    return form.signature(g), None if pat is None else key_bound(g, pat)


def _attention_measured(tgt: Target, opts: Options, cost: CostModel
                        ) -> Callable[[Graph, MhaForm], Optional[tuple[bool, str]]]:
    """--profile's verdict on handing an attention pattern to ORT's MultiHeadAttention: (taken, the times)
    where it beats both our kernel (its key split as the cost model chooses it) and ORT's unfused ops at
    every profiled binding's geometric mean, or None where the pattern is no region of its own (the
    estimate decides, against a plan that takes every attention region as ours: --profile offers them all).
    The measure is of the form without the projections' biases; whether the node takes them in is the
    estimate's."""
    from ortfuse import profile as prof
    from ortfuse.search.regions import attention_region, lowering_check

    def measure(g: Graph, form: MhaForm) -> Optional[tuple[bool, str]]:
        pat = next(p for p in find_attention(g)[0] if p.softmax in form.nodes)
        region = attention_region(g, pat, lowering_check(tgt, opts.tf32))
        node: Optional[FusedNode] = None
        if isinstance(region, Region):
            try:
                node = _attention_split(g, cost, _after_ptxas(g, tgt, opts,
                                                              _relowered(g, tgt, opts, region))).node
            except (LoweringError, OrtfuseError):  # our kernel does not take part; the other two are timed
                pass
        else:  # a kernel that does not lower: timed without it, where the pattern is a region of its own
            region = attention_region(g, pat, lambda *_: None)
            if not isinstance(region, Region):
                return None
        region = dataclasses.replace(region, id=0)  # (random_feeds' seed)
        ort_us, ours_us, mha_us = prof.time_attention(g, region, node, prof.profile_bindings(g, opts.profile_batch),
                                                      opts.cache / "profile.json")
        taken = prof.wins(mha_us, ort_us) and prof.wins(mha_us, ours_us)
        return taken, (f"measured {prof.us_text(mha_us)} us, our kernel {prof.us_text(ours_us)}, ORT's unfused ops "
                       f"{prof.us_text(ort_us)}")
    return measure


def _fusion_probe_provider() -> str:
    """"cuda" where a session really gets the CUDA EP (ORT's fusions are then asked of the EP the model will run
    on), else "cpu" (`rewriter.ort_fusions`)."""
    from ortfuse import gpu_timer
    if not gpu_timer.available():  # (no device: not even trying the CUDA EP, whose failure ORT logs loudly)
        return "cpu"
    from ortfuse.runtime import CUDA_EP, _cuda_usable
    return "cuda" if _cuda_usable([CUDA_EP, "CPUExecutionProvider"], None) else "cpu"


def _orts_fusions(model: onnx.ModelProto, graph: Graph, say: Progress) -> tuple[tuple[str, frozenset[str]], ...]:
    """ORT's fusions of several ops in `model` (`rewriter.ort_fusions`), asked of the CUDA EP where a session gets
    it, else of the CPU EP standing in; none where ORT refuses the probe (the log says which happened)."""
    dtypes = {t: info.dtype for t, info in graph.tensors.items()}
    ep = _fusion_probe_provider()
    units = ort_fusion_units(model, dtypes, ep)
    if isinstance(units, str) and ep == "cuda":
        say(f"ORT refused the probe of its own fusions on the CUDA EP ({units}): the CPU EP stands in")
        ep, units = "cpu", ort_fusion_units(model, dtypes, "cpu")
    if isinstance(units, str):
        say(f"ORT refused the probe of its own fusions on the {ep.upper()} EP ({units}): those a quantizer reads "
            "are not known, and a kernel may take part of one")
        return ()
    say(f"ORT's own fusions ({len(units)}) asked of its {ep.upper()} EP"
        + (" (standing in for the CUDA EP)" if ep == "cpu" else ""))
    return units


def _op_counts(nodes: Iterable[onnx.NodeProto]) -> str:
    """'3 SkipLayerNormalization, 2 BiasGelu', most first."""
    return ", ".join(f"{k} {op}" for op, k in collections.Counter(n.op_type for n in nodes).most_common())


def _counts_as_memory_bound(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx") and ops.kind_of(node.op_type) not in (None, "gemm") \
        and node.op_type not in ops.FREE_IN_ORT


def compile_model(model_or_path: ModelLike, input_shapes: Shapes = None, arch: Union[str, Sequence[str]] = "sm_90",
                  options: Optional[Options] = None, progress: Optional[Progress] = None) -> OptimizeResult:
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    archs = _archs(arch)
    opts = options or Options(archs=archs)
    if options is not None and options.archs != archs:
        opts = dataclasses.replace(options, archs=archs)
    tgt = target_for(archs, opts.wgmma is not False, opts.pdl, opts.key_frontier)
    if opts.wgmma and not tgt.wgmma:
        say("wgmma kernels not used: every target arch must be sm_90 (" + ", ".join(f"sm_{a}" for a in archs) + ")")

    say("loading model")
    store = WeightStore()  # the weights stay here while every rewrite copies the model (rewriter.weights)
    model = load_model(model_or_path, store)
    say("inferring shapes")
    graph = build_graph(model, _shapes(input_shapes), dict(opts.dim_hints))
    # (ORT folds the Shape reads of static shapes before it merges quantize/dequantize pairs; a dim pinned by
    # --input-shape is symbolic in the input as it runs without ortfuse, and so is every tensor computed from it)
    static_shapes = {t for t, info in graph.tensors.items() if info.is_static}
    static_before = (static_shapes - graph.downstream(_pinned_symbolic(model, graph))).__contains__
    qdq_readers, merged_before = readers(model, static_before), merged_pairs(model, static_before)
    merged_in_input = merged_chain_outputs(model)  # (in the input as ORT runs it)
    weight_bias_in_input = weight_bias_units(model)
    # ORT's fusions of several ops in the input, where a quantizer may read them (`legal.inexact_before_quantizers`)
    quantized = any(n.op_type in QUANTIZING for n in _proto.deep_nodes(model.graph.node))
    fusion_units = _orts_fusions(model, graph, say) if quantized else ()
    del model  # the graph holds its own copy: one copy of the weights less from here on
    check_dim_hints(graph)
    graph, splits = split_contrib_ops(graph)
    fusion_units = with_splits(fusion_units, graph.nodes, splits) if quantized else ()
    if splits:
        say(f"{len(splits)} ops the search does not take as they are ({_op_counts(s.original for s in splits)}) "
            "written as the standard ops it fuses")
    graph, gathers = fold_iota_gathers(graph)
    if gathers:
        say(f"{gathers} Gathers of a flattened tensor at its own index (exported masks) became Reshapes")
    graph, trilus = trilus_as_iotas(graph)
    if trilus:
        say(f"{trilus} causal masks made by Trilu over run-time lengths became iotas a kernel computes")
    graph, folded = fold_runtime_shapes(graph)
    if folded:
        say(f"{folded} Reshape targets computed at run time became constants")
    graph, _ = sink_constant_expands(graph)
    graph, weights = fold_constant_subgraphs(graph)
    if weights:
        say(f"{weights} tensors computed from constants alone became constants (as ORT folds them)")
    graph, small = fold_small_values(graph)
    if small:
        say(f"{small} small tensors computed from constants and static dims became constants")
    graph = _shapes_settled(graph, _shapes(input_shapes), folded + small, say)
    # (ORT quantizes a Gemm's weight, not a MatMul's; and a MatMul + Add rounds where a Gemm's bias does not)
    graph, unflattened = unflatten_gemms(graph, weight_bias_in_input | _quantizer_read(graph))
    if unflattened:
        say(f"{unflattened} Gemms between flattening Reshapes became MatMuls on the unflattened tensor")
    graph, _ = fold_constant_identities(graph)
    graph, _ = bypass_lone_concats(graph)
    graph, _ = bypass_noop_expands(graph)
    graph, _ = bypass_broadcast_expands(graph)
    graph, _ = merge_regrouped_transposes(graph)
    graph, _ = isolate_iotas(graph)
    # --profile times a row-wise GEMM epilogue against cuBLAS + our row kernel, so it plans them by the tile
    # model alone; without it the measured floor (Target.row_epilogue_floor) prices them
    plan_tgt = dataclasses.replace(tgt, row_epilogue_floor=1.0) if opts.profile else tgt
    # and it times every GEMM epilogue against cuBLAS + the epilogue as our kernel, so it fuses wherever the
    # fused kernel beats ORT and lets the measurement choose between the two (and so for attention regions)
    cost = CostModel(plan_tgt, opts.tf32, splits_measured=opts.profile, attention_measured=opts.profile)

    # (graph, plan) of the last three searches: the packing's last trial is often the graph searched, the
    # layout choice plans two graphs, the MultiHeadAttention choice three
    searched: dict[int, tuple[Graph, Plan]] = {}

    def compact(g: Graph) -> Graph:
        """Drops the weights that only discarded graphs read (the rewrites' trials, replaced weights): `g` and
        the searched graphs are the only ones alive here."""
        store.keep_only([g.model, *(h.model for h, _ in searched.values())])
        return g

    def plan_of(g: Graph) -> Plan:
        hit = searched.pop(id(g), None)  # least recently used first
        if hit is None or hit[0] is not g:
            while len(searched) > 2:
                del searched[next(iter(searched))]
            ort_qdq = left_to_ort(g.model, merged_in_input, qdq_readers, static_before, weight_bias_in_input)
            found = search_plan(g, plan_tgt, cost, tf32=opts.tf32, ln_fold=opts.ln_fold, k_rope=opts.k_rope,
                                ort_qdq=ort_qdq)
            # a kernel's inexact value that a quantizer reads (through any ops) goes back to ORT; each search leaves
            # more nodes to ORT, so this ends
            while inexact := inexact_before_quantizers(g, found.regions, fusion_units):
                if stuck := sorted(inexact.keys() & ort_qdq.keys()):  # kept where the search was told to leave it
                    raise AssertionError(f"internal error: kernels still compute {stuck[:3]}, which a quantizer "
                                         "reads and which should stay ORT's")
                ort_qdq = {**ort_qdq, **inexact}
                found = search_plan(g, plan_tgt, cost, tf32=opts.tf32, ln_fold=opts.ln_fold, k_rope=opts.k_rope,
                                    ort_qdq=ort_qdq)
            hit = (g, found)
        searched[id(g)] = hit
        return hit[1]

    def fused_outputs(g: Graph) -> set[str]:  # the outputs of the nodes the search would fuse in g
        return {o for r in plan_of(g).regions for i in r.nodes for o in g.nodes[i].output if o}

    graph, mha_notes = _ort_attention_chosen(graph, plan_of, cost, opts.ort_attention,
                                             _attention_measured(tgt, opts, cost) if opts.profile else None)
    for note in mha_notes:
        say(note)
    # a Split an attention pattern reads through is kept whether or not the pattern's region is taken: with
    # Slices instead, ORT's alternative to the region gains three Slice kernels, and the estimate then takes
    # the attention the Split form leaves to ORT (ViT-B fp32); not one whose K may leave the attention for its
    # rotary embedding (`absorbed_selects`)
    # (GEMMs whose values a quantizer reads stay as they are: cuBLAS may sum a packed or padded GEMM in
    # another order, and an ulp there moves a quantized element a step; `legal.quantizer_readers`)
    graph, packed = pack_sibling_gemms(graph, lambda g: absorbed_selects(g, opts.k_rope), fused_outputs,
                                       weight_bias_in_input | _quantizer_read(graph))
    graph = compact(graph)
    if packed:
        say(f"{packed} MatMuls sharing an input became one MatMul per group, split or sliced where kernels read them")
    graph, halved = interleave_halves(graph, fused_outputs)
    graph = compact(graph)
    if halved:
        say(f"{halved} MatMuls whose two halves a gated activation combines got their halves interleaved, so one "
            "kernel computes both")
    # a GEMM the search fuses stays as it is (our kernel with its epilogue); one left to cuBLAS is padded where
    # that pays: as --profile measures it, else as the cost model estimates it
    pays = _padding_measured(opts, say) if opts.profile else cost.padding_pays
    graph, aligned = pad_unaligned_gemms(graph, lambda g, i, wide: g.nodes[i].output[0] not in fused_outputs(g)
                                         and g.nodes[i].output[0] not in weight_bias_in_input
                                         and i not in quantizer_readers(g) and pays(g, i, wide))
    graph = compact(graph)
    if aligned:
        say(f"{aligned} GEMMs left to cuBLAS with misaligned rows got weights padded to 16-byte rows (and a "
            "Slice of the result)")
    graph, explicit = explicit_auto_pads(graph)
    if explicit:
        say(f"{explicit} Convs and pools with auto_pad SAME got the explicit pads ORT computes for them")
    graph, padded = fold_conv_pads(graph)
    if padded:
        say(f"{padded} zero Pads became the padding of the Convs they feed")
    graph, normed = fold_batchnorms(graph)
    graph = compact(graph)
    if normed:
        say(f"{normed} BatchNormalizations folded into their Convs or became a per-channel scale and shift")
    layout_notes: list[str] = []
    if opts.layout != "model":  # on the graph the search gets (each chain planned both ways)
        graph, layout_notes = _layout_chosen(graph, plan_of, cost, always=opts.layout == "blocks")
        graph = compact(graph)
        for note in layout_notes:
            say(note)
    say(f"searching {len(graph.nodes)} nodes for fusion regions")
    the_plan = plan_of(graph)
    searched.clear()  # earlier graphs (and their weights) are not planned again
    say(f"lowering {len(the_plan.regions)} regions")
    specs = [(r, lower(graph, r, tgt, opts.tf32)) for r in the_plan.regions]
    sources = {spec.kernel.name: render(spec.kernel) for _, spec in specs}
    say(f"compiling {len(sources)} kernels for {', '.join(f'sm_{a}' for a in archs)}")
    if opts.dump:
        opts.dump.mkdir(parents=True, exist_ok=True)
        for name, src in sources.items():
            (opts.dump / f"{name}.cu").write_text(src)
    with ThreadPoolExecutor(max_workers=opts.jobs) as pool:
        compiled = dict(zip(sources, pool.map(lambda kv: compile_kernel(kv[1], kv[0], archs, opts.cache),
                                              sources.items())))
        kernels = [fused_kernel(region, spec, compiled[spec.kernel.name]) for region, spec in specs]
        kernels = list(pool.map(lambda k: _after_ptxas(graph, tgt, opts, k), kernels))
        if not opts.profile:  # --profile chooses variants (and attention's key split) from measurements
            kernels = [_attention_split(graph, cost, k) for k in kernels]
            kernels = list(pool.map(lambda k: _size_variants(graph, tgt, opts, k), kernels))
    placements: tuple = ()
    if opts.profile:
        kernels, placements = _profile(graph, tgt, opts, kernels, say)
    say("rewriting the graph")
    out, back, kernels, the_plan = _rewritten(graph, kernels, the_plan, splits, say)
    kept_readers, requantized = keep_readers_as_input(qdq_readers, merged_before, out, static_shapes.__contains__)
    if kept_readers:
        say(f"{len(kept_readers)} quantize/dequantize outputs keep a second reader (a Size), so that ORT rewrites "
            "their pairs as in the input")
    if back:
        say(f"{len(back)} of those ops put back where the search left their standard ops to ORT (or their norm or "
            "GELU)")
    if opts.tf32:  # `ortfuse check` loosens the fp32 tolerance for such models
        onnx.helper.set_model_props(out, {**{p.key: p.value for p in out.metadata_props}, TF32_KEY: "1"})
    store.keep_only([out, graph.model])  # weights the rewrites replaced (the packed GEMMs' parts) go
    fused = {i for k in kernels for i in k.region.nodes}
    folded = left_folded(graph, fused)  # ORT computes those once, when a session starts
    mb = [i for i, n in enumerate(graph.nodes) if _counts_as_memory_bound(n) and i not in folded]
    return OptimizeResult(out, graph, the_plan, tuple(kernels), len(graph.nodes), len(out.graph.node), len(mb),
                          sum(1 for i in mb if i in fused), len({e for k in kernels for e, _ in k.all_kernels()}),
                          sum(k.region.traffic.saved_bytes for k in kernels),
                          time.perf_counter() - t0, archs, placements, tuple(layout_notes), tuple(mha_notes), store,
                          contrib_notes(out, splits, back),
                          requantized, kept_readers, _estimates(graph, cost, kernels))


def _estimates(graph: Graph, cost: CostModel, kernels: Sequence[FusedKernel]
               ) -> tuple[tuple[str, tuple[tuple[str, float, float], ...]], ...]:
    """Each fused node's estimated time as our kernel and as ORT's ops, at each binding the search judges by."""
    out = []
    for k in kernels:
        times = []
        for where, gb in bindings(graph):
            r = at_binding(gb, k.region, graph)
            times.append((where.strip() or "hints", cost.ours_us(gb, r), cost.ort_us(gb, r)))
        out.append((k.node.name, tuple(times)))
    return tuple(out)


def _rewritten(graph: Graph, kernels: list[FusedKernel], plan: Plan, splits: tuple, say: Progress
               ) -> tuple[onnx.ModelProto, tuple, list[FusedKernel], Plan]:
    """The output model (fused nodes in, split ops put back where nothing fused them), what was put back, and
    the kernels and plan it has. An ONNX Attention whose attention kernel the search declined goes back to
    ORT whole (`onnx_attention.declined`): the kernels that took some of its ops are left out, where that
    puts it back."""
    def rewrite(ks: list[FusedKernel]) -> tuple[onnx.ModelProto, tuple]:
        out = replace(graph, [k.node for k in ks], stubs=True)
        undone = deinterleave_unfused(out)
        if undone:
            say(f"{undone} interleaved gated MatMuls left to ORT were split back into their two GEMMs")
        return out, restore_contrib_ops(out, splits)

    # (the kernels' regions, not the plan's: --profile may have handed a region back to ORT)
    drop, count = onnx_attention.declined(graph, [k.region for k in kernels], splits)
    if drop:
        kept = [k for k in kernels if k.region.id not in drop]
        out, back = rewrite(kept)
        whole = sum(1 for s, part in back if s.original.op_type == "Attention" and part is s.parts[0])
        if whole >= count:
            say(f"{count} ONNX Attention ops the search took no attention kernel for went back to ORT whole "
                f"({len(kernels) - len(kept)} kernels that took some of their ops left out)")
            return out, back, kept, dataclasses.replace(
                plan, regions=tuple(r for r in plan.regions if r.id not in drop))
    return (*rewrite(kernels), kernels, plan)


def fused_kernel(region: Region, spec: KernelSpec, ck: CompiledKernel,
                 variants: Sequence[tuple[int, KernelSpec, CompiledKernel]] = ()) -> FusedKernel:
    entries = "+".join([ck.entry, *(f"{frm}:{v.entry}" for frm, _, v in variants)])
    tag = hashlib.sha256(f"{entries}/{region.id}/{','.join(region.outputs)}".encode()).hexdigest()[:10]
    for _, vspec, _ in variants:  # one node: the same inputs, weight layouts and outputs
        if (vspec.input_perms, vspec.outputs, vspec.out_shapes) != (spec.input_perms, spec.outputs, spec.out_shapes):
            raise OrtfuseError(f"region {region.id}: kernel variants that disagree on the node's tensors")
    node = FusedNode(f"ortfuse_region_{region.id}", f"Fused_{tag}", region.nodes, region.inputs,
                     region.outputs, tuple(attrs.node_attributes(spec, ck, variants)), spec.input_perms,
                     spec.shape_reads, spec.ln_fold)
    return FusedKernel(region, spec, ck, node, variants=tuple(variants))


def _built(region: Region, spec: KernelSpec, opts: Options) -> FusedKernel:
    """A lowered region compiled for the target archs into its node."""
    return fused_kernel(region, spec, compile_kernel(render(spec.kernel), spec.kernel.name, opts.archs, opts.cache))


def _relowered(graph: Graph, tgt, opts: Options, region: Region, tile: Optional[tuple[int, ...]] = None) -> FusedKernel:
    """The region lowered again (at a GEMM `tile`) and compiled: a spill check's, a size variant's, a profile
    candidate's or a split's kernel."""
    return _built(region, lower(graph, region, tgt, opts.tf32, tile=tile), opts)


def spill_bytes(ck: CompiledKernel) -> int:
    """The most local-memory spill traffic ptxas reported for any of the kernel's cubins."""
    return max((r.spill_bytes for _, r in ck.resources), default=0)


def _after_ptxas(graph: Graph, tgt, opts: Options, k: FusedKernel) -> FusedKernel:
    """What ptxas reported may rebuild a kernel: a GEMM tile that spills, an attention kernel over its
    registers for 4 blocks per SM."""
    if k.region.kind == "attention":
        return _attention_occupancy(graph, tgt, opts, k)
    return _without_spills(graph, tgt, opts, k)


def _without_spills(graph: Graph, tgt, opts: Options, k: FusedKernel) -> FusedKernel:
    """Roller's tiles come from a register estimate; ptxas has the last word. A GEMM whose top-ranked tile
    spills is rebuilt with the next ranked candidate that does not (or, failing that, spills least)."""
    first = spill_bytes(k.compiled)
    if k.region.kind not in ("gemm", "gemm_row") or not first or len(k.spec.tiles) < 2:
        return k
    from ortfuse.profile import tile_label

    best, least, best_tile = k, first, k.spec.tiles[0]
    for tile in k.spec.tiles[1:]:
        try:
            cand = _relowered(graph, tgt, opts, k.region, tile)
        except LoweringError:
            continue
        if spill_bytes(cand.compiled) < least:
            best, least, best_tile = cand, spill_bytes(cand.compiled), tile
        if not least:
            break
    if best is k:
        return k
    note = (f"tile {tile_label(k.spec.tiles[0])} spilled {first} bytes; {tile_label(best_tile)} "
            + (f"spills {least}" if least else "does not"))
    return dataclasses.replace(best, retiled=note)


def _size_variants(graph: Graph, tgt, opts: Options, k: FusedKernel) -> FusedKernel:
    """Kernel variants by size from the tile model (where no --profile measures them): the tile it ranks best
    at each binding of a symbolic batch (a split-K tile for batch 1's few rows, a wide one for batch 32's),
    thresholds and the gain required as `tiles.by_size` sets them (for --profile, from measured times). Kept
    only where every variant compiles without spilling and agrees with the others on the node's tensors."""
    from ortfuse.customops.tiles import by_size

    if k.retiled or len(k.spec.tile_us) < 2 or len(k.spec.binding_rows) < 2:
        return k
    from ortfuse.customops.attrs import variant_rows
    if any(t < 0 and -t - 1 >= len(k.spec.sym_dims) for t in variant_rows(k.spec)):
        return k  # the library picks a variant from dims bound at inputs, before it derives or sums others
    first, more, _ = by_size(k.spec.tile_us, k.spec.binding_rows, k.spec.tile_us[0][1])
    if first is None:
        return k
    try:
        main = k if first == k.spec.tiles[0] else _relowered(graph, tgt, opts, k.region, first)
        built = [(frm, _relowered(graph, tgt, opts, k.region, tile)) for frm, tile in more]
        if any(spill_bytes(x.compiled) for x in (main, *(v for _, v in built))):
            return k
        return fused_kernel(k.region, main.spec, main.compiled, [(frm, v.spec, v.compiled) for frm, v in built])
    except (LoweringError, OrtfuseError):  # a tile that does not lower here, or variants that disagree
        return k


def _attention_split(graph: Graph, cost: CostModel, k: FusedKernel) -> FusedKernel:
    """A tensor-core attention kernel keeps its keys split across a cluster (split_k, the same kernel) only
    where the cost model says the split pays at the hints (a decode step's 9 key tiles a unit), else one block
    walks a unit's keys (BERT at batch 1, 2 tiles a unit: 8.3 us unsplit against 11.9 split on an H100).
    After ptxas: a kernel compiled again under a blocks-per-SM bound is lowered with the split anew."""
    if k.region.kind != "attention" or k.spec.split_k < 2 or cost.attention_split(graph, k.region) > 1:
        return k
    return dataclasses.replace(fused_kernel(k.region, dataclasses.replace(k.spec, split_k=1), k.compiled),
                               retiled=k.retiled)


def _attention_occupancy(graph: Graph, tgt, opts: Options, k: FusedKernel) -> FusedKernel:
    """A tensor-core attention kernel (head sizes up to 64) for which ptxas took more registers than
    MMA_MIN_BLOCKS blocks per SM leave (BERT-base's: 141, 3 blocks), compiled again asking for those blocks
    (__launch_bounds__(128, 4)), and kept where it does not spill more. Bounded, ptxas rematerializes values
    (BERT's: ~45 instructions more per key tile), so a kernel that fits unbounded stays so (GPT-2's: 128)."""
    from ortfuse.customops.tiles import MMA_MIN_BLOCKS, THREADS

    regs = max((r.regs for _, r in k.compiled.resources), default=0)
    if regs * THREADS * MMA_MIN_BLOCKS <= tgt.regs_per_sm:
        return k
    spec = lower(graph, k.region, tgt, opts.tf32, bound=True)
    if not spec.kernel.min_blocks:  # no bound for this kernel (SIMT, head sizes over 64)
        return k
    cand = _built(k.region, spec, opts)
    if spill_bytes(cand.compiled) > spill_bytes(k.compiled):
        return k
    return dataclasses.replace(cand, retiled=f"{regs} registers (fewer than {MMA_MIN_BLOCKS} blocks per SM); "
                                             f"bounded to {MMA_MIN_BLOCKS} blocks it does not spill more")


def _padding_measured(opts: Options, say: Progress) -> Callable[[Graph, int, int], bool]:
    """--profile's padding decision: ORT's GEMM as it is against padded + sliced, timed on the GPU."""
    from ortfuse import profile as prof

    def pays(g: Graph, i: int, wide: int) -> bool:
        bindings = prof.profile_bindings(g, opts.profile_batch)
        won, plain, padded = prof.padding_wins(g, i, bindings, opts.cache / "profile.json")
        if plain:
            say(f"{g.node_label(i)} padded to {wide} columns: ORT {prof.us_text(plain)} us as it is, "
                f"{prof.us_text(padded)} us padded + Slice -> {'padded' if won else 'as it is'}")
        return won
    return pays


def _profile(graph: Graph, tgt, opts: Options, kernels: list[FusedKernel], say: Progress):
    """Measured placement on the GPU (ortfuse.profile): drop regions ORT runs faster, pick GEMM tiles."""
    from ortfuse import profile as prof

    built: dict[tuple[int, tuple[int, ...]], FusedKernel] = {}

    def candidates(region: Region):
        k = next(k for k in kernels if k.region.id == region.id)
        if region.kind == "attention" and k.spec.split_k > 1:
            # the same kernel with its keys in one block: the library launches the split in clusters at small
            # batches only, where it may gain or lose (BERT fp16 at batch 1 on an H100: 12.0 us against
            # MultiHeadAttention's 9.2, 2026-11-26)
            whole = fused_kernel(region, dataclasses.replace(k.spec, split_k=1), k.compiled)
            split = prof.key_split(k.spec.split_k)
            built[(region.id, split)], built[(region.id, prof.UNSPLIT)] = k, whole  # (kernel variants: each its split_k)
            return [(split, k.node), (prof.UNSPLIT, whole.node)]
        if region.kind not in ("gemm", "gemm_row") or len(k.spec.tiles) < 2:
            return [((), k.node)]
        # compiled side by side (NVRTC releases the GIL): a TMA GEMM has up to 13 candidates
        with ThreadPoolExecutor(max_workers=opts.jobs) as pool:
            fks = list(pool.map(lambda tile: _relowered(graph, tgt, opts, region, tile), k.spec.tiles))
        out = []
        for tile, fk in zip(k.spec.tiles, fks):
            built[(region.id, tile)] = fk
            out.append((tile, fk.node))
        return out

    say(f"profiling {len(kernels)} regions against ORT on the GPU")
    cache = opts.cache / "profile.json"
    bindings = prof.profile_bindings(graph, opts.profile_batch)
    say("profiling at " + "; ".join(label for label, _ in bindings) + f"; timer: {prof.clock()}")
    placements = prof.place(graph, [k.region for k in kernels], candidates, bindings, cache)
    chosen, final = [], []
    # the graph at each binding, made once (each is a new Graph: its per-graph analyses start afresh)
    at_binding = [dataclasses.replace(graph, sym_hints={**graph.sym_hints, **dims}) if dims else graph
                  for _, dims in bindings]
    for k, pl in zip(kernels, placements):
        try:  # a diagnostic: never what decides, so never what fails a profile
            pl = dataclasses.replace(pl, **_model_estimates(tgt, opts, k.region, at_binding))
        except Exception as e:  # noqa: BLE001
            say(f"region {k.region.id}: no cost-model estimate for the placement report ({type(e).__name__}: {e})")
        split = _epilogue_alone(graph, tgt, opts, k.region) if k.region.kind in ("gemm", "gemm_row") else None
        if split is not None:  # Collage: also measure cuBLAS + our kernel for the rest
            gemm, rest = split
            split_us = prof.time_split(graph, gemm, rest.region, rest.node, bindings, cache)
            split_wins = prof.wins(split_us, pl.ort_us) and prof.wins(split_us, pl.best_us)
            pl = dataclasses.replace(pl, split_us=split_us, split=split_wins)
            pl = dataclasses.replace(pl, keep=pl.keep and not pl.split)
            if pl.split:
                chosen.append(rest)
        say(pl.line())
        final.append(pl)
        if pl.keep:
            fk = built.get((k.region.id, pl.tile), k)
            if pl.variants:  # one kernel per size class: each tile as compiled for the profile
                more = [(frm, built[(k.region.id, t)].spec, built[(k.region.id, t)].compiled) for frm, t in pl.variants]
                fk = fused_kernel(k.region, fk.spec, fk.compiled, more)
            chosen.append(fk)
    return chosen, tuple(final)


def _model_estimates(tgt: Target, opts: Options, region: Region,
                     at_binding: Sequence[Graph]) -> dict[str, tuple[float, ...]]:
    """The cost model's times for the region at the profiled bindings (the graph at each), ORT's and ours,
    for the placement report: what --profile measured next to what the search assumed."""
    from ortfuse.search.cost import CostModel, traffic
    cm = CostModel(tgt, opts.tf32)
    ort_us, ours_us = [], []
    for gb in at_binding:
        r = dataclasses.replace(region, traffic=traffic(gb, region))
        ort_us.append(cm.ort_us(gb, r))
        ours_us.append(cm.ours_us(gb, r))
    return {"model_ort_us": tuple(ort_us), "model_ours_us": tuple(ours_us)}


def _epilogue_alone(graph: Graph, tgt, opts: Options, region: Region) -> Optional[tuple[Region, FusedKernel]]:
    """A GEMM region as (the GEMM alone, our kernel for its epilogue), or None if the rest is not one
    kernel (a LayerNorm folded in, a Conv's image computed in its gather). The rest keeps the region's id:
    it takes the region's place when it wins."""
    from ortfuse.search import legal, norm_fold
    from ortfuse.search.conv import is_anchor
    from ortfuse.search.cost import traffic

    if norm_fold.in_region(graph, region.nodes) is not None:
        return None  # the rest would hold the LayerNorm before the GEMM and the epilogue after it
    anchor = next(i for i in region.nodes if is_anchor(graph, graph.nodes[i]))
    if any(p in region.nodes for t in graph.nodes[anchor].input for p in (graph.producer.get(t),)):
        return None  # a prologue: the rest would be two pieces, before and after the GEMM
    rest = legal.classify(graph, set(region.nodes) - {anchor})
    if not isinstance(rest, Region):
        return None
    rest = dataclasses.replace(rest, id=region.id)
    rest = dataclasses.replace(rest, traffic=traffic(graph, rest))
    try:
        fk = _relowered(graph, tgt, opts, rest)
    except LoweringError:
        return None
    i, o = legal.region_io(graph, {anchor})
    gemm = Region(region.id, "gemm", (anchor,), tuple(i), tuple(o), region.space, rest.traffic)
    return gemm, fk



def optimize(model_or_path: ModelLike, input_shapes: Shapes = None, arch: Union[str, Sequence[str]] = "sm_90",
             options: Optional[Options] = None) -> onnx.ModelProto:
    """Fuse memory-bound chains of `model_or_path` into compiled CUDA custom ops; returns a new model
    that runs in stock ONNX Runtime (our kernels with `ortfuse.InferenceSession`, the original
    sub-graphs through model-local functions otherwise). The input is never modified."""
    return compile_model(model_or_path, input_shapes, arch, options).model




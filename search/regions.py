"""Region growth in three phases:
0. attention: each pattern `search.attention` recognises becomes one region (its nodes are claimed) where
   the cost model prefers our kernel to ORT's ops (and, on CUDA cores, the whole model to its nodes fused
   otherwise: `_grow`);
   LayerNorm prologues: a LayerNormalization read only by a MatMul/Gemm's A operand joins that GEMM's
   region (`search.norm_fold`). Whether the folds pay depends on what their absence leaves the kernels
   that produce X (a row-wise epilogue, or a separate kernel), so the search runs with and without them
   and the cost model keeps the plan it estimates faster for the whole model;
1. memory-bound ops: greedy merging along producer->consumer edges in topological order. A merge is
   kept only if `legal` allows it and the merged group still lowers to one kernel; a group takes along the
   iota cones it reads (Range and the ops computed from it alone), which have no kernel of their own;
2. GEMM epilogues: each MatMul/Gemm/Conv absorbs the group that consumes its result when the merged region
   lowers to one GEMM kernel (a group with a row reduction over the GEMM's N axis becomes a row-wise
   epilogue, one tile spanning each row) and the cost model says it beats cuBLAS followed by the group
   as its own kernel; element-wise groups left reading one GEMM's result in the same iteration space
   (siblings: a decoder's present key and value, both made from the packed projection) then merge into one
   kernel, which reads the result once and launches once; groups ORT's CUDA EP would run on its CPU EP (an
   int32 bias's DequantizeLinear) computed from constants alone in one space are one kernel too;
3. conv chains: a Conv whose image is computed by a group of element-wise ops (a depthwise Conv with its
   activation, typically: MobileNet's depthwise -> pointwise pair) takes that group into its im2col gather
   when nothing else reads the group's result, so the intermediate image is never written; the cost model
   weighs the recomputation (once per tile of output channels, per tap) against the saved write, read and
   launch.
The cost model then keeps the regions that pay."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import onnx

from ortfuse.customops.target import Target
from ortfuse.rewriter import ort_folding
from ortfuse.rewriter.graph import Graph
from ortfuse.search import conv, legal, norm_fold, ops, pool
from ortfuse.search.attention import AttentionPattern, find_attention, k_rope_outside
from ortfuse.search.cost import CostModel, attention_geometry, cpu_ep_nodes, tensor_bytes, traffic
from ortfuse.search.plan import Plan, Region, Reject, Traffic

# Lowering check: raises with a reason when a candidate region is not one kernel.
Check = Callable[[Graph, Region], Optional[str]]
# Times the regions are grown again after dropping the LayerNorm folds whose GEMM region was refused.
REGROWS = 3


def lowering_check(tgt: Target, tf32: bool) -> Check:
    """Lowers each candidate once per graph: a plan grows its regions several times (with and without the
    LayerNorm folds, the attention kinds both ways), and each growth meets the same candidates again (GPT-2
    fp16: 2,340 checks, 814 of them distinct)."""
    from ortfuse.customops.lower import LoweringError, lower

    memo: dict[tuple, Optional[str]] = {}
    graphs: dict[int, Graph] = {}  # every graph checked stays alive with the memo, so its id is not reused

    def check(g: Graph, region: Region) -> Optional[str]:
        key = (id(g), region.kind, region.nodes, region.inputs, region.outputs, region.space)
        if key not in memo:
            graphs[id(g)] = g
            try:
                lower(g, region, tgt, tf32)
                memo[key] = None
            except LoweringError as e:
                memo[key] = str(e)
        return memo[key]
    return check


def _candidate(g: Graph, nodes: set[int], check: Check) -> Region | Reject:
    r = legal.classify(g, nodes)
    if isinstance(r, Reject):
        return r
    why = legal.host_verdict(g, r.inputs) or legal.folded_verdict(g, nodes, r.outputs) or check(g, r)
    return Reject(f"region at {g.node_label(min(nodes))}", why) if why else r


def attention_region(g: Graph, pat: AttentionPattern, check: Check) -> Region | Reject:
    """The pattern as a region (id -1) our attention kernel computes, or why it is not one."""
    inputs, outputs = legal.region_io(g, set(pat.nodes))
    if outputs != [pat.output]:
        return Reject(g.node_label(pat.softmax), f"attention has outputs {outputs}, not just its result")
    shape = g.tensors[pat.output].shape
    r = Region(-1, "attention", pat.nodes, tuple(inputs), tuple(outputs), tuple(shape or ()), Traffic(0, 0, 0))
    why = legal.host_verdict(g, r.inputs) or legal.merged_verdict(g, pat.nodes, r.inputs) or check(g, r)
    if why:
        return Reject(g.node_label(pat.softmax), f"attention not lowered: {why}")
    return dataclasses.replace(r, traffic=traffic(g, r))


@dataclass(frozen=True)
class _Found:
    """An attention region the search may take, its kind (the shapes and types of the scores' operands and of
    V: regions of one kind cost the same, a model's layers), and where K's rotary embedding can stay outside
    the kernel (`k_rope_outside`), the region without it (`--k-rope auto` tries both)."""
    region: Region
    kind: tuple
    k_once: Optional[Region] = None


def _attention(g: Graph, cost: CostModel, check: Check, refusals: list[Reject], k_rope: str) -> list[_Found]:
    """Each attention pattern that lowers and whose kernel the cost model prefers to ORT's unfused ops (fp32
    attention runs on CUDA cores in ours, on TF32 MatMuls in ORT), or every one where `--profile` measures
    both. The nodes of one refused stay free for the phases after. `k_rope`: a K rotated by a rotary
    embedding is rotated in the kernel ("kernel"), once before it ("once"; in the kernel where only that
    form is taken), or either ("auto")."""
    found, rejects = find_attention(g)
    refusals.extend(rejects)
    outside = k_rope_outside(g) if k_rope != "kernel" else {}
    out = []
    for pat in found:
        alt = outside.get(pat.softmax)
        forms = [pat] if alt is None else [alt, pat] if k_rope == "once" else [pat, alt]
        taken: list[Region] = []
        why: list[Reject] = []
        for p in forms:
            r = attention_region(g, p, check)
            if isinstance(r, Region) and not cost.attention_measured:
                r = cost.verdict(g, r) or r
            if isinstance(r, Region):
                taken.append(r)
            else:
                why.append(r)
        if not taken:  # (each form's reason once)
            refusals.extend(dict.fromkeys(why))
            continue
        ts = (*g.nodes[pat.qk].input[:2], g.nodes[pat.pv].input[1])
        kind = tuple((tuple(g.tensors[t].shape or ()), g.tensors[t].dtype) for t in ts)
        out.append(_Found(taken[0], kind, taken[1] if len(taken) > 1 and k_rope == "auto" else None))
    return out


def plan(g: Graph, tgt: Target, cost: Optional[CostModel] = None, check: Optional[Check] = None,
         tf32: bool = False, ln_fold: str = "auto", k_rope: str = "auto",
         ort_qdq: Optional[Mapping[str, str]] = None) -> Plan:
    """The regions to fuse. `ln_fold`: LayerNorm prologues where the whole model gains ("auto"), wherever
    they apply ("on"), or never ("off"). `k_rope`: K's rotary embedding in the attention kernel ("kernel"),
    once before it ("once"), or where the whole model gains ("auto"; `_grow`). `ort_qdq`: outputs of nodes
    that stay ORT's for its quantization passes, with the reason (`legal.node_verdict`)."""
    cost = cost or CostModel(tgt, tf32)
    check = check or lowering_check(tgt, tf32)
    ort_qdq = ort_qdq or {}
    found = norm_fold.candidates(g) if ln_fold != "off" else {}
    folds = {i: f for i, f in found.items() if isinstance(f, norm_fold.NormFold)}
    unfit = tuple(Reject(f"LayerNorm before {g.node_label(i)}", f) for i, f in found.items() if isinstance(f, str))
    without = _grow(g, cost, check, {}, k_rope, ort_qdq) if ln_fold != "on" or not folds else None
    if not folds:
        assert without is not None
        return dataclasses.replace(without, refusals=without.refusals + unfit)
    folded = _grow(g, cost, check, folds, k_rope, ort_qdq)
    for _ in range(REGROWS):  # a fold whose GEMM went to ORT took its LayerNorm along: grow again without it
        kept = {i: f for i, f in folds.items() if any(i in r.nodes for r in folded.regions)}
        if len(kept) == len(folds):
            break

        def dropped(i: int, f: norm_fold.NormFold) -> Reject:  # with the last refusal naming its LN or GEMM
            said = [r.reason for r in folded.refusals
                    if g.node_label(f.norm) in r.subject or g.node_label(i) in r.subject]
            return Reject(f"{g.node_label(f.norm)} into {g.node_label(i)} as its prologue",
                          f"its GEMM's region was refused ({said[-1] if said else 'see above'}), so the LayerNorm "
                          f"stays out")
        unfit += tuple(dropped(i, f) for i, f in folds.items() if i not in kept)
        folds = kept
        folded = _grow(g, cost, check, folds, k_rope, ort_qdq)
    if ln_fold == "on" or not folds:
        return dataclasses.replace(folded, refusals=folded.refusals + unfit)
    without = without or _grow(g, cost, check, {}, k_rope, ort_qdq)
    times = cost.plan_times(g, folded, without)
    if cost.pays(times):
        return dataclasses.replace(folded, refusals=folded.refusals + unfit)
    why = Reject(f"{len(folds)} LayerNorm prologues", f"the whole model estimated at {cost.figures(times)} with "
                                                      f"the LayerNorms folded into their GEMMs")
    return dataclasses.replace(without, refusals=without.refusals + unfit + (why,))


CONSTANT_KERNEL_BYTES = 1 << 20  # phase 2c: the most bytes one kernel of constants-only groups may write


def _from_constants(g: Graph, grp: frozenset[int]) -> bool:
    """Whether the group reads initializers and Constant nodes alone (so nothing it reads is computed in the
    graph; an initializer a user may feed is still read at run time)."""
    made = {o for n in grp for o in g.nodes[n].output}
    return all(t in g.constants for n in grp for _, t in ops.data_inputs(g.nodes[n]) if t not in made)


def _output_bytes(g: Graph, grp: frozenset[int]) -> int:
    """Bytes of the group's results that nodes outside it or the graph's outputs read."""
    outs = {o for n in grp for o in g.nodes[n].output if o and (o in g.graph_outputs or any(
        c not in grp for c in g.consumers.get(o, ())))}
    return sum(tensor_bytes(g, t) for t in outs)


def _grow(g: Graph, cost: CostModel, check: Check, folds: dict[int, "norm_fold.NormFold"], k_rope: str,
          ort_qdq: Mapping[str, str]) -> Plan:
    """The phases above, with `folds` (by anchor) as LayerNorm prologues. An attention region on CUDA cores
    (fp32: the kernel has no TF32 path; 16-bit heads not multiples of 16) that beats ORT's unfused ops may
    still lose to its nodes fused otherwise: its score ops and Softmax as a row kernel, P·V as a GEMM with
    its epilogue, the scores' MatMul cuBLAS's on TF32 (ViT-B fp32 at batch 32: our kernel measured 394 us a
    layer against 344 for ORT's ops, 2026-11-27; the estimate of ORT's ops matched, so its parts price the
    alternative). So each kind of such region (`_attention`: a model's layers are one) stays only where the
    whole-model estimate gains with it (`CostModel.attention_plan_verdict`). The tensor-core kernel was
    measured 2.4-4.3x faster than ORT's ops for its region (BERT fp16, 2026-11-26), and a second search per
    kind would cost half again the optimize time (SmolLM's decode step: 31 s to 49 s), so its kinds are not
    tried both ways. --profile times each region against ORT's unfused ops instead.

    First, each kind whose K a rotary embedding rotates (`_Found.k_once`, with `k_rope` "auto") is tried with
    K rotated once before the kernel, by whatever the search makes of the rotation's nodes, instead of by the
    kernel on every K tile it loads (each of a head's query tiles, and each query head of a group, again):
    the whole-model estimate decides (`CostModel.attention_us` charges the kernel's rotation per tile)."""
    refusals: list[Reject] = []
    found = []
    for f in _attention(g, cost, check, refusals, k_rope):
        # a node a quantizer reads must stay ORT's (`legal.inexact_before_quantizers`): the phases leave it so
        why = next((ort_qdq[o] for i in f.region.nodes for o in g.nodes[i].output if o in ort_qdq), None)
        if why:
            refusals.append(Reject(g.node_label(f.region.nodes[0]), f"attention not one kernel: {why}"))
        else:
            found.append(f)
    kind_of = {r: f.kind for f in found for r in (f.region, f.k_once) if r is not None}
    kept = [f.region for f in found]
    best = _grow_with(g, cost, check, folds, kept, list(refusals), ort_qdq)
    notes: dict[tuple, Reject] = {}  # by kind: where K is rotated, and why
    for kind in dict.fromkeys(f.kind for f in found if f.k_once is not None):
        swap = {f.region: f.k_once for f in found if f.kind == kind and f.k_once is not None}
        where = f"K's rotary embedding in the attention at {g.node_label(next(iter(swap)).nodes[0])}"
        why = cost.rotation_trial(g, list(swap.items()))
        if why:
            notes[kind] = Reject(where, f"rotated by the kernel on every K tile it loads ({len(swap)} of this kind): "
                                        f"{why}")
            continue
        trial_kept = [swap.get(r, r) for r in kept]
        trial = _grow_with(g, cost, check, folds, trial_kept, list(refusals), ort_qdq)
        times = cost.plan_times(g, trial, best)
        if cost.pays(times):
            notes[kind] = Reject(where, f"rotated once before the kernel, not by it on every K tile it loads "
                                        f"({len(swap)} of this kind): the whole model estimated at {cost.figures(times)}")
            best, kept = trial, trial_kept
        else:
            back = [(w, b, a) for w, a, b in times]
            notes[kind] = Reject(where, f"rotated by the kernel on every K tile it loads, not once before it "
                                        f"({len(swap)} of this kind): the whole model estimated at {cost.figures(back)}")
    best = dataclasses.replace(best, refusals=best.refusals + tuple(notes.values()))
    if cost.attention_measured:
        return best
    declined: list[Reject] = []
    for kind in dict.fromkeys(f.kind for f in found):
        mine = [r for r in kept if kind_of[r] == kind]
        if attention_geometry(g, mine[0]).mma:
            continue
        without = _grow_with(g, cost, check, folds, [r for r in kept if r not in mine], list(refusals),
                             ort_qdq)
        why = cost.attention_plan_verdict(g, best, without, len(mine))
        if why:  # with the reasons of the kinds declined before this one (each trial starts without them)
            declined += [Reject(f"region at {g.node_label(r.nodes[0])}", why) for r in mine]
            notes.pop(kind, None)  # (no attention kernel of this kind rotates K)
            best = dataclasses.replace(without, refusals=without.refusals + tuple(notes.values()) + tuple(declined))
            kept = [r for r in kept if r not in mine]
    return best


def _grow_with(g: Graph, cost: CostModel, check: Check, folds: dict[int, "norm_fold.NormFold"],
               attention: list[Region], refusals: list[Reject], ort_qdq: Mapping[str, str]) -> Plan:
    """The phases after attention, with `attention`'s regions taken. Where a GEMM took a group without the
    views it ends with (`_phases`), the phases run again without that and the whole-model estimate decides:
    the rest of the group may do better merged on with other groups, through the views (OPT fp16's residual
    Adds were 5.5% slower in the estimate without the peel)."""
    peeling, peels = _phases(g, cost, check, folds, attention, list(refusals), True, ort_qdq)
    if not peels:
        return peeling
    plain, _ = _phases(g, cost, check, folds, attention, list(refusals), False, ort_qdq)
    times = cost.plan_times(g, peeling, plain)
    if cost.pays(times):
        chosen, how = peeling, (f"taken without the views they end with (left to ORT): the whole model estimated "
                                f"at {cost.figures(times)} without that")
    else:
        chosen, how = plain, (f"not taken without the views they end with: the whole model estimated at "
                              f"{cost.figures([(w, b, a) for w, a, b in times])} with that")
    where = f"{peels} group{'s' if peels > 1 else ''} of GEMM epilogues"
    return dataclasses.replace(chosen, refusals=chosen.refusals + (Reject(where, how),))


def _phases(g: Graph, cost: CostModel, check: Check, folds: dict[int, "norm_fold.NormFold"],
            attention: list[Region], refusals: list[Reject], peel: bool,
            ort_qdq: Mapping[str, str]) -> tuple[Plan, int]:
    """The phases after attention, with `attention`'s regions taken, and how many GEMMs took a group without
    the views it ends with (`peel`)."""
    rejects: list[Reject] = []
    peels = 0
    claimed = {n for r in attention for n in r.nodes}
    group_of: dict[int, frozenset[int]] = {}
    gemms: list[int] = []
    for i in range(len(g.nodes)):
        if i in claimed:
            continue
        why = legal.node_verdict(g, i, ort_qdq)
        if why is not None:
            rejects.append(why)
        elif conv.is_anchor(g, g.nodes[i]):
            gemms.append(i)
        else:
            group_of[i] = frozenset((i,))
    claimed_folds = {i: frozenset(f.nodes) for i, f in folds.items()
                     if i in gemms and all(n in group_of for n in f.nodes)}  # not rejected, nor attention's
    for nodes in claimed_folds.values():
        for n in nodes:
            del group_of[n]

    # nodes computed from Range iotas (and constants, and Slices of them sized by a dim) alone: no kernel of their own (nothing binds their
    # dims), but recomputed inside the kernel that reads them (an iota costs an add), so a group taking their
    # result takes them along. Constant-only cones stay out: ORT folds them at session start.
    def sized_by_dims(n: onnx.NodeProto) -> bool:  # a Range, or a Slice of a constant with a run-time end
        return n.op_type == "Range" or (n.op_type == "Slice" and legal.slice_runtime_end(g, n) is not None)

    sourceless: set[int] = set()
    for i in sorted(group_of):
        reads = [t for _, t in ops.data_inputs(g.nodes[i])]
        if all(t in g.constants or g.producer.get(t) in sourceless for t in reads) and \
                (sized_by_dims(g.nodes[i]) or any(g.producer.get(t) in sourceless for t in reads)):
            sourceless.add(i)

    def closure(a: set[int]) -> set[int]:
        """a with the iota cones its nodes read (not a GEMM's operands: their prologue is not an iota)."""
        stack = [n for n in a if not conv.is_anchor(g, g.nodes[n])]
        while stack:
            for _, t in ops.data_inputs(g.nodes[stack.pop()]):
                p = g.producer.get(t)
                if p in sourceless and p not in a and group_of[p] <= sourceless:
                    a |= group_of[p]
                    stack.extend(group_of[p])
        return a

    def merge(a: set[int], label: str, pays: Optional[Callable[[Region], Optional[str]]] = None,
              quiet: bool = False) -> bool:
        closed = closure(set(a))
        if closed != a and attempt(closed, label, pays, quiet=True):
            return True
        return attempt(a, label, pays, quiet)

    def attempt(a: set[int], label: str, pays: Optional[Callable[[Region], Optional[str]]],
                quiet: bool = False) -> bool:
        """Merge a into one group if it is a legal candidate that pays; refusals are recorded unless quiet
        (the caller tries without the iotas next)."""
        why: Optional[str] = "merging would create a cycle" if legal.creates_cycle(g, a, group_of) else None
        cand = _candidate(g, a, check) if why is None else None
        if isinstance(cand, Reject):
            why = cand.reason
        elif cand is not None and pays:
            why = pays(cand)
        if why:
            if not quiet:
                refusals.append(Reject(label, why))
            return False
        frozen = frozenset(a)
        for n in frozen:
            group_of[n] = frozen
        return True

    refused_for: dict[int, set[int]] = {}  # node -> producers whose groups it could not join
    for i in sorted(group_of):
        if i not in sourceless and closure(set(group_of[i])) != group_of[i]:
            attempt(closure(set(group_of[i])), f"{g.node_label(i)} + the iota it reads", None)
        refused: dict[int, frozenset[int]] = {}  # producer -> i's group when merging them was refused
        for _, t in ops.data_inputs(g.nodes[i]):
            p = g.producer.get(t)
            if p is None or p not in group_of or group_of[p] == group_of[i]:
                continue
            if _view_for_windows(g, i, t):
                refusals.append(Reject(f"{g.node_label(p)} + {g.node_label(i)}", _VIEW_FOR_WINDOWS.format(
                    g.node_label(i), t)))
                continue
            if merge(set(group_of[p] | group_of[i]), f"{g.node_label(p)} + {g.node_label(i)}"):
                continue
            # with the groups p's own group could not take: a window op whose image is read channels-last is
            # legal only once the kernel also iterates channels-last (SegFormer's depthwise Conv between the
            # tokens' Transposes), which no two-group step reaches
            held = {group_of[q] for m in group_of[p] for q in refused_for.get(m, ())} - {group_of[p], group_of[i]}
            if held and attempt(set(group_of[p] | group_of[i]).union(*held), "", None, quiet=True):
                continue
            refused[p] = group_of[i]
            refused_for.setdefault(i, set()).add(p)
        # producers refused while i's group was smaller merge with the grown one (a cycle through a group that
        # i's then joined: rotary embeddings, x * cos + rotate_half(x) * sin, x's Transpose in the first
        # product's group and read by the other)
        again = {group_of[p] for p, grp in refused.items() if grp != group_of[i] and group_of[p] != group_of[i]}
        if again:
            merge(set(group_of[i]).union(*again), f"{g.node_label(i)} + the groups it reads")

    def with_traffic(r: Region) -> Region:
        return Region(r.id, r.kind, r.nodes, r.inputs, r.outputs, r.space, traffic(g, r))

    def beats_split(grp: frozenset[int], mine: Optional[frozenset[int]] = None) -> Callable[[Region], Optional[str]]:
        """Fusing pays only if it beats cuBLAS (or the GEMM's own kernel `mine`, with its LayerNorm folded in)
        followed by the group as its own kernel."""
        def pays(merged: Region) -> Optional[str]:
            alone = legal.classify(g, set(grp))
            base = legal.classify(g, set(mine)) if mine is not None else None
            if isinstance(alone, Reject) or isinstance(base, Reject):
                return None
            return cost.split_verdict(g, with_traffic(merged), with_traffic(alone),
                                      with_traffic(base) if base is not None else None)
        return pays

    offered: set[int] = set()  # anchors with an epilogue candidate (fused or refused with its reason)
    for i in gemms:  # phase 2: epilogues (element-wise, or row-wise when a reduction follows)
        group_of[i] = frozenset((i,)) | claimed_folds.get(i, frozenset())
        for n in claimed_folds.get(i, ()):
            group_of[n] = group_of[i]
        add = folds[i].bias_add if i in claimed_folds else None  # a fold's bias Add is part of the GEMM's result
        for c in g.consumers.get(g.nodes[i if add is None else add].output[0], ()):
            grp = group_of.get(c)
            if grp is None or i in grp:
                continue
            offered.add(i)
            label = f"{g.node_label(i)} + epilogue at {g.node_label(c)}"
            mine = group_of[i] if i in claimed_folds else None
            peeled = legal.without_trailing_views(g, grp) \
                if peel and not any(conv.is_anchor(g, g.nodes[n]) for n in grp) else None
            if merge(set(group_of[i] | grp), label, beats_split(grp, mine), quiet=peeled is not None) \
                    or peeled is None:
                continue
            # the group without the Reshapes it ends with (a GEMM stores its own space; ORT aliases a view),
            # which join it where they flatten run-time axes (`sym_products`): OPT's residual Adds before its
            # [batch * sequence, hidden] view
            for n in grp:
                group_of[n] = peeled if n in peeled else frozenset((n,))
            if merge(set(group_of[i] | peeled), label, beats_split(peeled, mine), quiet=True):
                peels += 1
                continue
            for n in grp:
                group_of[n] = grp
            merge(set(group_of[i] | grp), label, beats_split(grp, mine))  # (refused again: the reason kept)

    def pointwise_space(grp: frozenset[int]) -> Optional[tuple]:
        r = legal.classify(g, set(grp))
        return None if isinstance(r, Reject) or r.kind != "pointwise" else tuple(r.space)

    for i in gemms:  # phase 2b: element-wise groups reading one GEMM's result (with its epilogue) in the same space
        # are one kernel (a decoder's present key and value, both made from the packed projection): one launch,
        # one read
        sibs: list[frozenset[int]] = []
        gemm = group_of.get(i, frozenset((i,)))  # with its epilogue (a bias), if it took one
        for t in (o for n in gemm for o in g.nodes[n].output):
            for c in g.consumers.get(t, ()):
                grp = group_of.get(c)
                if grp is not None and i not in grp and grp not in sibs and pointwise_space(grp) is not None:
                    sibs.append(grp)
        for k, grp in enumerate(sibs):
            for other in sibs[k + 1:]:
                a, b = group_of[min(grp)], group_of[min(other)]  # as merged so far
                if a != b and pointwise_space(a) == pointwise_space(b):
                    attempt(set(a | b), f"siblings reading {g.node_label(i)}", None, quiet=True)

    # phase 2c: groups that ORT's CUDA EP would run on its CPU EP (an int32 bias's DequantizeLinear,
    # `cost.cpu_ep_nodes`) and that read constants alone, in one space, are one kernel: a quantized CNN's
    # biases in a launch per channel count, where ORT ran a CPU node and a copy each. Up to
    # CONSTANT_KERNEL_BYTES of results a kernel (they all live from the start of a run); groups ORT folds
    # (none of these: ORT never folds a DequantizeLinear) are left out.
    hosted: dict[tuple, list[frozenset[int]]] = {}
    for grp in sorted(set(group_of.values()), key=min):
        if cpu_ep_nodes(g, grp) and _from_constants(g, grp) and not grp & ort_folding.folded_nodes(g) \
                and (space := pointwise_space(grp)) is not None:
            hosted.setdefault(space, []).append(grp)
    for grps in hosted.values():
        into = grps[0]
        for other in grps[1:]:
            a = group_of[min(into)]
            if _output_bytes(g, a | other) > CONSTANT_KERNEL_BYTES or not attempt(
                    set(a | other), f"computed from constants alone with {g.node_label(min(a))}", None, quiet=True):
                into = other  # the next kernel starts here

    for i in gemms:  # phase 3: conv chains
        _take_prologue(g, i, group_of, merge, cost, with_traffic, refusals)

    regions: list[Region] = []
    for r in attention:
        regions.append(dataclasses.replace(r, id=len(regions)))
    for group in sorted(set(group_of.values()), key=min):
        if len(group) == 1 and conv.is_anchor(g, g.nodes[min(group)]):
            lib = "cuDNN" if g.nodes[min(group)].op_type in ops.CONV else "cuBLAS"
            why = "its epilogue was not fused (see above)" if min(group) in offered else "no epilogue to fuse"
            refusals.append(Reject(g.node_label(min(group)), f"{why}: left to ORT ({lib})"))
            continue
        cand = _candidate(g, set(group), check)
        if isinstance(cand, Reject):
            refusals.append(cand)
            continue
        cand = with_traffic(Region(len(regions), cand.kind, cand.nodes, cand.inputs, cand.outputs, cand.space,
                                   cand.traffic))
        why = cost.verdict(g, cand)
        if why:
            refusals.append(why)
            continue
        regions.append(cand)
    result = Plan(tuple(regions), tuple(rejects), tuple(refusals))
    result.validate(len(g.nodes))
    return result, peels


_VIEW_FOR_WINDOWS = ("{} only rearranges '{}' for window ops, which read it through the layout op as a view; "
                     "in its producer's kernel it would be written a second time, rearranged")


def _view_for_windows(g: Graph, i: int, t: str) -> bool:
    """Layout op i reads `t`, which others read too, and only window ops read its result (a depthwise Conv
    reading a residual stream kept channels-last, `rewriter.layout`): it stays out of t's producer's group, so
    the windows' kernel reads t through it rather than the producer writing t twice."""
    node = g.nodes[i]
    if ops.kind_of(node.op_type) != "layout" or t in g.graph_outputs or len(g.consumers.get(t, ())) < 2:
        return False
    readers = [c for o in node.output if o for c in g.consumers.get(o, ())]
    return bool(readers) and all(pool.is_window(g, g.nodes[c]) for c in readers) \
        and not any(o in g.graph_outputs for o in node.output)


def _take_prologue(g: Graph, anchor: int, group_of: dict[int, frozenset[int]],
                   merge: Callable[..., bool], cost: CostModel, with_traffic: Callable[[Region], Region],
                   refusals: list[Reject]) -> None:
    """Phase 3 for one Conv: fold the element-wise group computing its image into its gather."""
    node = g.nodes[anchor]
    if node.op_type not in ops.CONV:
        return
    p = g.producer.get(node.input[0])
    grp, mine = group_of.get(p) if p is not None else None, group_of[anchor]
    if grp is None or anchor in grp or any(conv.is_anchor(g, g.nodes[n]) for n in grp):
        return
    label = f"{g.node_label(p)} into {g.node_label(anchor)} as its image"
    prologue = legal.classify(g, set(grp))
    if isinstance(prologue, Reject) or prologue.kind != "pointwise":
        return  # reductions stay separate kernels
    for t in prologue.outputs:
        if t in g.graph_outputs or any(c not in mine for c in g.consumers.get(t, ())):
            refusals.append(Reject(label, f"'{t}' is also read outside the Conv's kernel, so it is written anyway"))
            return
    rest = legal.classify(g, set(mine))
    if isinstance(rest, Reject):  # the Conv's own group has no kernel (its refusal is reported with it)
        return
    rest_region = with_traffic(rest)

    def pays(merged: Region) -> Optional[str]:
        return cost.prologue_verdict(g, with_traffic(merged), rest_region, with_traffic(prologue))
    merge(set(grp | mine), label, pays)

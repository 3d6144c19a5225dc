"""Profitability: a Welder-style DRAM traffic model. Swap `CostModel` to change the policy; nothing
here decides correctness. Symbolic dims take their typical values (batch 1); with a symbolic batch, one
optimized model serves every batch, so a fusion is judged at batch 1 and batch 32 together."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import onnx

from ortfuse.customops import tiles
from ortfuse.customops.target import (ROW_KERNEL_GROUPS, ROW_MAX_THREADS, ROW_MIN_BLOCK, ROW_VECTORS_PER_THREAD,
                                      WINDOW_READ_AHEAD, WINDOW_UNROLL, Target, long_row_threads,
                                      short_row_threads, vector_lanes)
from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.gemm_padding import padded_width
from ortfuse.rewriter.graph import Graph, per_graph
from ortfuse.rewriter.mha import is_mha
from ortfuse.rewriter.ort_folding import folded_nodes
from ortfuse.rewriter.shapes import THROUGHPUT_BATCH, hints_at_batch
from ortfuse.search import compute, conv, legal, norm_fold, ops, pool
from ortfuse.search.attention import AttentionPattern, pattern_of
from ortfuse.search.plan import Plan, Region, Reject, Traffic

# Ops ORT runs on shape metadata (on the host, or folded at session start): no kernel time.
_HOST_OPS = frozenset({"Shape", "Size", "Constant", "ConstantOfShape"})


def tensor_bytes(g: Graph, t: str) -> int:
    return compute.elements(g, t) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.tensors[t].dtype)).itemsize


def traffic(g: Graph, region: Region) -> Traffic:
    """Unfused: each ORT kernel reads its data inputs and writes its outputs. Fused: the region reads
    its inputs and writes its outputs once (row passes re-read from L1/L2, not DRAM)."""
    kernels = [g.nodes[i] for i in region.nodes if g.nodes[i].op_type not in ops.FREE_IN_ORT]
    members = [g.nodes[i] for i in region.nodes]
    fused = sum(read_bytes(g, members, t) for t in region.inputs) + sum(tensor_bytes(g, t) for t in region.outputs)
    return Traffic(sum(node_bytes(g, n) for n in kernels), fused, len(kernels))


def read_bytes(g: Graph, readers: list[onnx.NodeProto], t: str) -> int:
    """Bytes of t that `readers` read: all of it, except a table only Gathers read (an embedding), of
    which they read the rows they gather, or a tensor only unit-step Slices read (one result of a packed
    projection: K's columns, read by its rotary embedding's kernel), of which they read their blocks: at most
    their outputs' size."""
    users = [n for n in readers if t in n.input]
    if users and all(list(n.input).index(t) == 0 and t not in n.input[1:] and
                     (n.op_type == "Gather" or _unit_slice(g, n)) and
                     n.output[0] in g.tensors and g.tensors[n.output[0]].shape is not None for n in users):
        return min(tensor_bytes(g, t), sum(tensor_bytes(g, n.output[0]) for n in users))
    return tensor_bytes(g, t)


def _unit_slice(g: Graph, n: onnx.NodeProto) -> bool:
    """A Slice (opset 10+: bounds as inputs) whose steps are all 1 or -1 (contiguous blocks)."""
    if n.op_type != "Slice" or n.domain not in ("", "ai.onnx") or len(n.input) < 3:
        return False
    steps = n.input[4] if len(n.input) > 4 else ""
    return not steps or steps in g.constants and bool(np.all(np.abs(np.asarray(g.constants[steps])) == 1))


def node_bytes(g: Graph, n: onnx.NodeProto) -> int:
    """DRAM bytes of one ORT kernel: its data inputs read and its outputs written."""
    known = lambda t: t in g.tensors and g.tensors[t].shape is not None  # noqa: E731
    reads = {t for _, t in ops.data_inputs(n) if known(t)}
    writes = {o for o in n.output if o and known(o)} - reads
    return sum(read_bytes(g, [n], t) for t in reads) + sum(tensor_bytes(g, t) for t in writes)


def cpu_ep_nodes(g: Graph, nodes: Iterable[int]) -> list[int]:
    """Those of `nodes` ORT's CUDA EP has no kernel for (`ops.CPU_EP_ONLY`): it runs them on the CPU EP and
    copies their results to the device every run, where a fused kernel computes them on the device."""
    return [i for i in nodes if (n := g.nodes[i]).op_type in ops.CPU_EP_ONLY
            and n.input and g.tensors[n.input[0]].dtype in ops.CPU_EP_ONLY[n.op_type]]


def ort_conv_folds(g: Graph, region: Region) -> list[int]:
    """Region nodes stock ORT folds into its own cuDNN FusedConv on the CUDA EP (ConvActivationFusion:
    fp32 only; Conv -> Relu, or Conv -> Add -> Relu, each link the producer's only consumer). The Conv is
    the region's anchor or, for a region without one, a Conv outside it that ORT runs and whose only
    consumer starts the region: fusing such a region takes those ops out of ORT's FusedConv."""
    anchor = _fold_anchor(g, region)
    if anchor is None or g.tensors[g.nodes[anchor].input[0]].dtype != onnx.TensorProto.FLOAT:
        return []

    def lone(i: int) -> Optional[int]:
        out = g.nodes[i].output[0]
        cs = g.consumers.get(out, ())
        return cs[0] if len(cs) == 1 and out not in g.graph_outputs and cs[0] in region.nodes else None

    nxt = lone(anchor)
    if nxt is None:
        return []
    if g.nodes[nxt].op_type == "Relu":
        return [nxt]
    after = lone(nxt) if g.nodes[nxt].op_type == "Add" else None
    return [nxt, after] if after is not None and g.nodes[after].op_type == "Relu" else []


def _fold_anchor(g: Graph, region: Region) -> Optional[int]:
    """The Conv `ort_conv_folds` starts from: the region's own, else a Conv producer outside it."""
    convs = [i for i in region.nodes if g.nodes[i].op_type in ops.CONV]
    if convs:
        return next((i for i in convs if conv.is_anchor(g, g.nodes[i])), convs[0])
    return next((p for i in region.nodes for _, t in ops.data_inputs(g.nodes[i])
                 for p in (g.producer.get(t),) if p is not None and p not in region.nodes
                 and g.nodes[p].op_type in ops.CONV and conv.is_anchor(g, g.nodes[p])), None)


def gemm_dims(g: Graph, node: onnx.NodeProto) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a MatMul/Gemm/Conv as our kernel tiles it, symbolic dims at their hints: A's batch
    dims fold into M when B has none; a Conv is one GEMM per image."""
    hint = functools.partial(compute.dim_hint, g)
    if node.op_type in ops.CONV:  # per image: (OC x C*KH*KW) . (C*KH*KW x OH*OW)
        geo = conv.conv_geometry(g, node)
        assert not isinstance(geo, str), geo
        return hint(geo.batch), geo.oc, geo.pixels_at(hint), geo.k
    a, b, y = (g.tensors[t].shape for t in (node.input[0], node.input[1], node.output[0]))
    assert a is not None and b is not None and y is not None
    trans_a = node.op_type == "Gemm" and any(x.name == "transA" and x.i for x in node.attribute)
    batch = int(np.prod([hint(d) for d in y[:-2]])) if len(y) > 2 else 1
    m, n, k = hint(y[-2]), hint(y[-1]), hint(a[-2] if trans_a else a[-1])
    if all(d == 1 for d in b[:-2]) and not trans_a:
        m, batch = m * batch, 1
    return batch, m, n, k


def gemm_flops(g: Graph, node: onnx.NodeProto) -> float:
    """2 * M * N * K * batch of a MatMul/Gemm/Conv, symbolic dims at their hints."""
    batch, m, n, k = gemm_dims(g, node)
    return 2.0 * batch * m * n * k


def _row_itemsize(g: Graph, region: Region) -> int:
    """Bytes of the widest element a row kernel reads or writes: its vectors' width follows it."""
    return max(int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.tensors[t].dtype)).itemsize)
               for t in (*region.inputs, *region.outputs))


@dataclass(frozen=True)
class AttentionGeometry:
    mma: bool  # the tensor-core kernel (16-bit data, head sizes multiples of 16), else SIMT
    d: int
    dv: int
    keys: int  # Sk
    block_m: int  # query rows per unit
    block_n: int  # keys per tile
    units: int  # blocks' work items: (batch, head) pairs times query-row tiles, grouped-query heads packed
    key_tiles: int  # a unit's key tiles
    rope_pairs: int = 0  # column pairs of each K tile the kernel rotates (K's rotary embedding in the pattern)
    visible: float = 1.0  # the share of (unit, key tile) pairs the kernel visits (a causal frontier: key_bound)
    longest: int = 0  # the most key tiles one unit visits (0: every tile; fewer under a window or packed rows)
    reach: float = 1.0  # the share of a head's key tiles some unit visits (K's and V's DRAM reads: a window's)
    kv_bytes: int = 0  # K's and V's bytes the region reads (each tensor once, as `traffic`; not one holding Q)

    @property
    def work(self) -> float:
        """A key tile's work over the fitted tile's (head sizes 64), at least half: latency stays."""
        ref = 128 * (64 * 64 if self.mma else 32 * 32)
        return max(0.5, (self.d + self.dv) * self.block_m * self.block_n / ref)


def _attention_pattern(g: Graph, region: Region) -> AttentionPattern:
    p = pattern_of(g, region.nodes)
    assert p is not None, f"not an attention pattern: {region.nodes}"
    return p


def attention_geometry(g: Graph, region: Region, frontier: bool = True) -> AttentionGeometry:
    """The attention kernel's work as `customops.lower_attention` lays it out, symbolic dims at g's hints: the
    tensor-core kernel for 16-bit data and head sizes multiples of 16 (the lowering also needs rows 16-byte
    aligned: a misaligned packing runs SIMT, priced here as tensor cores); grouped-query heads packed into one
    unit's rows where the scores have a static head count, K's path repeats its heads (repeat_kv's Expand)
    and the query rows leave the tile room (the lowering proves the grouping on the offsets). `frontier`: each
    unit visits only the key tiles before a proven causal frontier (Target.key_frontier)."""
    p = _attention_pattern(g, region)
    hint = functools.partial(compute.dim_hint, g)
    raw = g.tensors[g.nodes[p.qk].output[0]].shape
    s = [hint(d) for d in raw]
    bh, sq, sk = int(np.prod(s[:-2], dtype=np.int64)), s[-2], s[-1]
    d = hint(g.tensors[g.nodes[p.qk].input[0]].shape[-1])
    dv = hint(g.tensors[g.nodes[p.pv].output[0]].shape[-1])
    sixteen = g.tensors[p.q].dtype in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    mma = sixteen and d % 16 == 0 and dv % 16 == 0
    bm = tiles.MMA_BLOCK_M if mma else tiles.SIMT_BLOCK_M
    bn = (tiles.mma_block_n if mma else tiles.simt_block_n)(d, dv)
    group = 1
    if len(raw) == 4 and isinstance(raw[1], int) and sq < (tiles.MMA_BLOCK_M if sixteen else tiles.SIMT_BLOCK_M):
        for i in p.k_path:
            n = g.nodes[i]
            if n.op_type == "Expand" and compute.elements(g, n.input[0]):
                rep = compute.elements(g, n.output[0]) // compute.elements(g, n.input[0])
                group = rep if rep > 1 and raw[1] % rep == 0 else 1
    units = bh // group * -(-sq * group // bm)
    pairs = bn * p.k_rope.half if p.k_rope is not None else 0
    from ortfuse.customops.key_bound import key_bound  # (the lowering's evaluator imports the search)
    bound = key_bound(g, p) if frontier else None
    spans = bound.unit_spans(sq, sk, bm, bn, group) if bound is not None and sq and sk else []
    seen, key_tiles = [hi - lo for lo, hi in spans], -(-sk // bn)
    visible = sum(seen) / (len(seen) * key_tiles) if seen else 1.0
    reach = (max(hi for _, hi in spans) - min(lo for lo, _ in spans)) / key_tiles if spans else 1.0
    members = [g.nodes[i] for i in region.nodes]
    kv_bytes = sum(read_bytes(g, members, t) for t in {p.k, p.v} - {p.q})
    return AttentionGeometry(mma, d, dv, sk, bm, bn, units, key_tiles, pairs, visible, max(seen, default=0),
                             min(1.0, reach), kv_bytes)


def bindings(g: Graph) -> tuple[tuple[str, Graph], ...]:
    """(label, graph) for each binding of the symbolic dims a fusion is judged at: the hints (batch 1) and,
    when the batch is symbolic, batch THROUGHPUT_BATCH."""
    large = _at_throughput_batch(g)
    return (("", g),) if large is None else (("", g), (f" at batch {THROUGHPUT_BATCH}", large))


@per_graph
def _at_throughput_batch(g: Graph) -> Optional[Graph]:
    """`g` with its symbolic dims at batch THROUGHPUT_BATCH (one object per graph, so caches keyed by graph hit),
    None where the batch is not symbolic. (Memoized apart from `g` itself: a memo value holding its own key
    would keep the graph, and its model, alive past the memo's weak reference.)"""
    large = hints_at_batch(g, THROUGHPUT_BATCH)
    return None if large == dict(g.sym_hints) else dataclasses.replace(g, sym_hints=large)


def at_binding(g: Graph, region: Region, base: Graph) -> Region:
    """`region` with its traffic at g's binding (its own when g is the graph it was built on)."""
    return region if g is base else dataclasses.replace(region, traffic=traffic(g, region))



@dataclass(frozen=True)
class CostModel:
    target: Target
    tf32: bool = False
    # `ortfuse optimize --profile` times each fused GEMM epilogue against cuBLAS + the epilogue as our own
    # kernel (ortfuse.profile.time_split), so the plan fuses wherever that beats ORT and the measurement
    # decides; the estimate decides only what it cannot measure (a GEMM with a LayerNorm folded in)
    splits_measured: bool = False
    # and it times each attention region against ORT's ops for it, so the search offers every one that lowers
    attention_measured: bool = False

    def time_us(self, bytes_moved: int, launches: int) -> float:
        return bytes_moved / (self.target.dram_gbps * 1e3) + launches * self.target.launch_us

    def _math(self, g: Graph, node: onnx.NodeProto) -> int:
        dtype = g.tensors[node.input[0]].dtype
        return tiles.MMA_F16 if dtype != onnx.TensorProto.FLOAT else (tiles.MMA_TF32 if self.tf32 else tiles.SIMT)

    def gemm_us(self, g: Graph, node: onnx.NodeProto, ours: bool = False,
                wgmma_ok: bool = True) -> tuple[float, int]:
        """(roofline time of the bare GEMM as cuBLAS would run it, its DRAM bytes); `ours`: at the tensor-core
        rate our kernels can reach (`Target.mma_sync_share`, or `wgmma_share` for 16-bit GEMMs where wgmma
        kernels are enabled and the region may use them: `wgmma_ok` false for a folded LayerNorm under a
        row-wise epilogue, which runs on the mma.sync mainloop)."""
        tgt = self.target
        math_ = self._math(g, node)
        if not ours and math_ == tiles.SIMT:
            math_ = tiles.MMA_TF32  # ORT's CUDA EP runs fp32 MatMul/Conv on TF32 by default (use_tf32)
        peak = {tiles.MMA_F16: tgt.mma_f16_tflops, tiles.MMA_TF32: tgt.mma_tf32_tflops,
                tiles.SIMT: tgt.fp32_tflops}[math_]
        if ours and math_ != tiles.SIMT:
            peak *= tgt.wgmma_share if wgmma_ok and self._wgmma(math_, node) else tgt.mma_sync_share
        moved = sum(tensor_bytes(g, t) for t in (node.input[0], node.input[1], node.output[0]))
        return max(gemm_flops(g, node) / (peak * 1e6), moved / (tgt.dram_gbps * 1e3)), moved

    def _wgmma(self, math_: int, node: onnx.NodeProto) -> bool:
        """Whether our kernel for this GEMM may be a wgmma one: enabled for the target, 16-bit, and a MatMul or
        Gemm (Conv's implicit GEMM stays on mma.sync)."""
        return self.target.wgmma and math_ == tiles.MMA_F16 and node.op_type in ops.GEMM

    def row_penalty(self, g: Graph, node: onnx.NodeProto) -> float:
        """How much slower our GEMM gets when one tile must span a whole row (row-wise epilogue): the tile
        model's best row-spanning tile over its best tile. Few, narrow tiles cost parallelism at small M."""
        batch, m, n, k = gemm_dims(g, node)
        es = int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.tensors[node.input[0]].dtype)).itemsize)
        math_ = self._math(g, node)
        trans = {x.name: x.i for x in node.attribute if x.name in ("transA", "transB")}
        b_nk = node.op_type == "Gemm" and bool(trans.get("transB"))
        # as the lowering picks operand modes: 16-byte aligned rows are copied, others staged in registers
        staged = (bool(trans.get("transA")) or (k * es) % 16 != 0, ((k if b_nk else n) * es) % 16 != 0)
        free = tiles.rank_tiles(self.target, m, n, k, batch, es, math_, b_nk, top_k=1, staged=staged)
        row = tiles.rank_tiles(self.target, m, n, k, batch, es, math_, b_nk, top_k=1, row=True, staged=staged)
        if not free or not row:
            return math.inf
        return max(1.0, row[0].est_us / free[0].est_us)

    def fold_penalty(self, g: Graph, node: onnx.NodeProto, wgmma_ok: bool = True) -> float:
        """How much slower our GEMM gets with a LayerNorm folded in (the row moments it gathers from A, no
        split-K): the tile model's best folded tile over its best plain one, on the TMA mainloop where the
        GEMM may use wgmma (`wgmma_ok`, as gemm_us) and a TMA tile fits it, else on mma.sync (as the lowering
        falls back)."""
        batch, m, n, k = gemm_dims(g, node)
        es = int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.tensors[node.input[0]].dtype)).itemsize)
        b_nk = node.op_type == "Gemm" and any(x.name == "transB" and x.i for x in node.attribute)
        b_staged = ((k if b_nk else n) * es) % 16 != 0
        math_ = self._math(g, node)
        kinds = [(math_, b_nk, b_staged)]
        if wgmma_ok and self._wgmma(math_, node):
            kinds.insert(0, (tiles.WS_F16, True, False))  # as the lowering: B read as [N][K]
        for math_, b_nk, b_staged in kinds:
            args = (self.target, m, n, k, batch, es, math_, b_nk)
            free = tiles.rank_tiles(*args, top_k=1, staged=(tiles.DIRECT, b_staged))
            folded = tiles.rank_tiles(*args, top_k=1, staged=(tiles.NORMED, b_staged))
            if free and folded:
                return max(1.0, folded[0].est_us / free[0].est_us)
        return math.inf

    def padding_pays(self, g: Graph, i: int, wide: int) -> bool:
        """Whether GEMM node i runs faster with its weight padded to `wide` columns (rewriter.gemm_padding): the
        library on misaligned rows (`Target.unaligned_gemm_slowdown`) against it on the wider aligned GEMM plus
        the Slice copying the result (read wide, write N, one launch), over the bindings."""
        node = g.nodes[i]
        n = g.tensors[node.output[0]].shape[-1]
        times = []
        for where, gb in bindings(g):
            bare, _ = self.gemm_us(gb, node)
            out = tensor_bytes(gb, node.output[0])
            padded = bare * wide / n + self.time_us(out + out * wide // n, 1)
            times.append((where, padded, bare * self.target.unaligned_gemm_slowdown))
        return _pays(times)

    def plan_times(self, g: Graph, plan: Plan, other: Plan, other_g: Optional[Graph] = None
                   ) -> list[tuple[str, float, float]]:
        """(binding, plan's time, other's time) for two plans of the same graph, or `other` of `other_g` (the
        same function rewritten, with the same inputs): each region as ours_us, each node outside the regions
        as ORT runs it (cuBLAS/cuDNN for an anchor, one kernel for any other op; the ops ORT aliases, runs
        on the host or folds when a session starts cost nothing)."""
        og = g if other_g is None else other_g
        return [(where, self._plan_us(gb, g, plan), self._plan_us(ob, og, other))
                for (where, gb), (_, ob) in zip(bindings(g), bindings(og))]

    def _plan_us(self, gb: Graph, g: Graph, plan: Plan) -> float:
        inside = {i for r in plan.regions for i in r.nodes} | folded_nodes(g)  # ORT folds those at start
        total = sum(self.ours_us(gb, at_binding(gb, r, g)) for r in plan.regions)
        for i, n in enumerate(g.nodes):
            if i in inside or n.op_type in ops.FREE_IN_ORT or n.op_type in _HOST_OPS:
                continue
            if conv.is_anchor(g, n) and not (n.op_type in ops.CONV and isinstance(conv.conv_geometry(g, n), str)):
                total += self.gemm_us(gb, n)[0] + self.target.launch_us
            elif is_mha(n):
                total += self.mha_us(gb, n)
            else:  # other ops, and a Conv we cannot describe (1-D): by their bytes, the same in both plans
                total += self.time_us(node_bytes(gb, n), 1)
        return total

    @staticmethod
    def pays(times: list[tuple[str, float, float]]) -> bool:
        return _pays(times)

    @staticmethod
    def figures(times: list[tuple[str, float, float]]) -> str:
        return ", ".join(f"{ours:.1f} us vs {alt:.1f} us{where}" for where, ours, alt in times)

    def _anchor(self, g: Graph, region: Region) -> onnx.NodeProto:
        return next(g.nodes[i] for i in region.nodes if conv.is_anchor(g, g.nodes[i]))

    def ours_us(self, g: Graph, region: Region) -> float:
        """Estimated time of the region as one of our kernels."""
        tr = region.traffic
        if region.kind in ("pointwise", "rowreduce"):  # DRAM-bound, unless its math is longer
            lanes = self.row_lane_use(g, region) if region.kind == "rowreduce" else 1.0
            return max(self.time_us(tr.fused_bytes, 1),
                       self.target.launch_us + self.compute_us(g, region.nodes) / lanes,
                       self.target.launch_us + self.window_us(g, region),
                       self.few_rows_us(g, region) if region.kind == "rowreduce" else 0.0,
                       self.window_chain_us(g, region))
        if region.kind == "attention":
            return self.attention_us(g, region)
        if region.kind not in ("gemm", "gemm_row"):
            return self.time_us(tr.fused_bytes, 1)
        node = self._anchor(g, region)
        folded = norm_fold.in_region(g, region.nodes) is not None
        # a folded LayerNorm's moments are gathered on the TMA mainloop, or on mma.sync under a row-wise epilogue
        wgmma_ok = not (folded and region.kind == "gemm_row")
        mm_us, mm_bytes = self.gemm_us(g, node, ours=True, wgmma_ok=wgmma_ok)
        mm_us /= self.speed_vs_library(g, node, region)  # assumed until --profile measures it
        rest = self.time_us(max(tr.fused_bytes - mm_bytes, 0), 1) + self.epilogue_us(g, region) + \
            self.unaligned_store_us(g, region, node)
        if folded:  # the tile model's folded tile, but never under the measured floor over the whole kernel
            plain = mm_us + rest
            mm_us *= self.fold_penalty(g, node, wgmma_ok)
            if region.kind != "gemm_row":
                return max(mm_us + rest, plain * self.target.ln_fold_floor)
        if region.kind != "gemm_row":
            return mm_us + rest
        # the tile model's row tile, but never under the measured floor over the plain kernel as a whole
        # (launch and fixed costs included: at batch 1 they are most of it)
        return max(mm_us * self.row_penalty(g, node) + rest, (mm_us + rest) * self.target.row_epilogue_floor)

    def attention_us(self, g: Graph, region: Region, split: Optional[int] = None) -> float:
        """Our attention kernel (ortfuse_attention.h) at `tiles.attention_clocks`, never under its DRAM traffic.
        The units are the lowering's: query rows in tiles of BLOCK_M per (batch, head), grouped-query heads
        packed into one unit's rows at a generation step's few rows. `split`: the kernel's key split (split_k),
        else the one `attention_split` gives it."""
        tgt, geo = self.target, attention_geometry(g, region, self.target.key_frontier)
        clk = tiles.attention_clocks(tgt, geo.mma, geo.units, geo.keys, geo.block_n,
                                     self._split(geo) if split is None else split, geo.work, geo.rope_pairs,
                                     geo.visible, geo.longest)
        # (K and V outside every unit's tiles are never read: a window's far side in a generation step)
        dram = max(region.traffic.fused_bytes - (1.0 - geo.reach) * geo.kv_bytes, 0)
        return max(self.time_us(dram, 1), tgt.launch_us + clk / (tgt.clock_ghz * 1e3))

    def mha_us(self, g: Graph, node: onnx.NodeProto) -> float:
        """ORT's MultiHeadAttention (`rewriter.mha`) at g's hints: the path ORT takes for its dtype, bias and
        head sizes (`Target.mha_*`; flash attention for 16-bit data without an attention_bias and with equal
        head sizes up to 256, multiples of 8), never under its DRAM traffic; plus, where the node adds the
        projections' biases (its `bias` input), one kernel reading and writing Q, K and V (assumed: ORT lays
        them out with the bias added before the attention)."""
        tgt = self.target
        hint = functools.partial(compute.dim_hint, g)
        b, sq, hd = (hint(d) for d in g.tensors[node.input[0]].shape)
        sk, hdv = (hint(d) for d in g.tensors[node.input[2]].shape[1:])
        heads = max(1, attr(node, "num_heads", 1))
        masked = len(node.input) > 5 and bool(node.input[5])  # an attention_bias
        flops = 2.0 * b * sq * sk * (hd + hdv)  # over every head: N (D + Dv) = hd + hdv
        d, dv = hd // heads, hdv // heads
        if g.tensors[node.input[0]].dtype == onnx.TensorProto.FLOAT:
            fixed, per_tile, tflops = tgt.mha_fp32_us
            tflops = tgt.mha_fp32_bias_tflops if masked else tflops
        elif masked or d != dv or d % 8 or d > 256:  # with an attention_bias ORT's memory-efficient kernel
            fixed, per_tile, tflops = tgt.mha_bias_us  # wants the query rows a multiple of 8
            tflops = tflops if sq % 8 == 0 else tgt.mha_bias_unaligned_tflops
        else:
            fixed, per_tile, tflops = tgt.mha_flash_us
        qkv = [t for t in node.input[:3] if t]
        bytes_moved = sum(tensor_bytes(g, t) for t in (*node.input, *node.output) if t)
        us = max(self.time_us(bytes_moved, 1), tgt.launch_us + fixed + per_tile * -(-sk // 64) + flops / (tflops * 1e6))
        if len(node.input) > 3 and node.input[3]:
            us += self.time_us(2 * sum(tensor_bytes(g, t) for t in qkv), 1)
        return us

    def attention_split(self, g: Graph, region: Region) -> int:
        """The key split (split_k) of a tensor-core attention kernel: the most the kernel allows
        (`tiles.key_split`) where splitting beats one block's walk over a unit's keys at g's hints, else 1
        (a cluster costs about two key tiles: BERT's 2 tiles a unit lose to it, a decode step's 9 gain)."""
        return self._split(attention_geometry(g, region, self.target.key_frontier))

    def _split(self, geo: AttentionGeometry) -> int:
        tgt = self.target
        most = tiles.key_split(tgt, geo.d, geo.dv, geo.keys) if geo.mma else 1
        if most < 2:
            return 1
        at = [tiles.attention_clocks(tgt, True, geo.units, geo.keys, geo.block_n, s, geo.work, geo.rope_pairs,
                                     geo.visible, geo.longest) for s in (1, most)]
        return most if at[1] < at[0] else 1

    def row_lane_use(self, g: Graph, region: Region) -> float:
        """The share of a row kernel's issued lanes that hold columns: a row of at most ROW_KERNEL_GROUPS
        vectors a lane is a warp's or a power-of-two share of one (`_Lowerer.rowreduce`), whose last group
        may leave lanes idle (ConvNeXt's 96 fp16 channels: 12 vectors on 16 lanes); longer rows fill their
        threads."""
        threads = self.row_threads(g, region)
        if threads is None:
            return 1.0
        vectors, tpr = threads
        return vectors / (tpr * -(-vectors // tpr))

    def row_threads(self, g: Graph, region: Region) -> Optional[tuple[int, int]]:
        """A row kernel's (vectors a row, threads a row) where its rows are short (at most ROW_KERNEL_GROUPS
        vectors a lane of a warp: `_Lowerer.rowreduce`); None for longer or symbolic rows."""
        c = region.space[-1] if region.space else None
        if not isinstance(c, int) or c <= 0:
            return None
        vectors = -(-c // vector_lanes(c, _row_itemsize(g, region), self.target.vector_bytes))
        if vectors > 32 * ROW_KERNEL_GROUPS:
            return None
        return vectors, short_row_threads(vectors)

    def few_rows_us(self, g: Graph, region: Region) -> float:
        """A row kernel with fewer rows than SMs (GroupNorm's groups at batch 1, each row C/groups x H x W long)
        runs a block per row on that many SMs, each streaming what one block keeps in flight over the DRAM
        latency (Little's law: ROW_MAX_THREADS threads x ROW_VECTORS_PER_THREAD vectors each, assumed, not
        measured). Symbolic dims at g's binding; 0 where the rows fill the GPU or have no hint."""
        rows = [d if isinstance(d, int) else g.sym_hints.get(d) for d in region.space[:-1]]
        if None in rows or math.prod(rows) >= self.target.sm_count:
            return 0.0
        per_block = ROW_MAX_THREADS * self.target.vector_bytes * ROW_VECTORS_PER_THREAD / self.target.mem_latency_ns
        return region.traffic.fused_bytes / max(math.prod(rows), 1) / (per_block * 1e3) + self.target.launch_us

    def unaligned_store_us(self, g: Graph, region: Region, node: onnx.NodeProto) -> float:
        """What a MatMul/Gemm region's outputs with rows not 16-byte aligned add to our kernel: a multiple of
        their aligned DRAM time, the excess. On mma fragments they are staged through shared memory
        (`Target.staged_store_factor`); SIMT lanes store them element by element, rows apart
        (`Target.unaligned_store_factor`), and so does a gated epilogue (its outputs leave as scalar pairs)."""
        anchor = next((i for i in region.nodes if g.nodes[i] is node), None)
        gated = anchor is not None and legal.gated_reads(g, region.nodes, anchor) is not None
        staged = self._math(g, node) != tiles.SIMT and not gated
        factor = self.target.staged_store_factor if staged else self.target.unaligned_store_factor
        if node.op_type not in ops.GEMM or factor <= 1.0:
            return 0.0
        slow = sum(tensor_bytes(g, t) for t in region.outputs
                   if (shape := g.tensors[t].shape) and len(shape) >= 2 and isinstance(shape[-1], int) and
                   padded_width(shape[-1], g.tensors[t].dtype) != shape[-1])
        return (factor - 1.0) * slow / (self.target.dram_gbps * 1e3)

    def compute_us(self, g: Graph, nodes: Iterable[int]) -> float:
        """The instructions of element-wise `nodes` at the issue peak: a kernel of many resident warps hides
        its chains' latency (search.compute)."""
        warp_instructions = compute.work(g, nodes)[0] / 32  # at 4 per clock per SM
        return warp_instructions / 4 / self.target.sm_count / (self.target.clock_ghz * 1e3)

    def window_us(self, g: Graph, region: Region) -> float:
        """The window ops' (depthwise Convs', pools') tap reads in a memory-bound kernel: each output element
        reads its image once per tap. The reads are served at L1's rate (the same 128-byte wavefront per clock
        as shared memory, `smem_bytes_per_clk`) where the taps of the pixels one block walks together overlap,
        and from L2 where they do not: along a kernel row, R consecutive pixels read R + KW - 1 distinct ones.
        R is a warp's 32 lanes where the kernel walks W (NCHW order), and a row kernel's block of rows, one
        pixel each, where it walks channels-last (`legal.image_layout`: 16 bytes of channels a lane; a short
        row's share of a warp, `row_threads`, else a warp a pixel). Assumed from the access pattern, not
        measured."""
        tgt = self.target
        l1 = l2 = 0.0
        members = set(region.nodes)
        short = self.row_threads(g, region) if region.kind == "rowreduce" else None
        row_pixels = ROW_MIN_BLOCK // (short[1] if short else 32)
        for i in members:
            n = g.nodes[i]
            kernel = pool.window(g, n)
            if kernel is None:
                continue
            kh, kw = kernel
            reads = kh * kw * tensor_bytes(g, n.output[0])
            pixels = row_pixels if legal.image_layout(g, n.input[0], members) == "channels-last" else 32
            l1 += reads
            l2 += reads * (pixels + kw - 1) / (pixels * kw)
        return max(l1 / (tgt.smem_bytes_per_clk * tgt.sm_count * tgt.clock_ghz * 1e3),
                   l2 / (tgt.dram_gbps * tgt.l2_over_dram * 1e3))

    def window_chain_us(self, g: Graph, region: Region) -> float:
        """A row kernel walking straight-line depthwise windows channels-last takes at least one thread's chain:
        its tap reads in rounds (a kernel row's reads of a vector group together, at most WINDOW_READ_AHEAD
        taps: `depthwise_value`), each round a memory latency, then its instructions issued one a clock. Many
        warps hide this; a warp alone on its SM does not (ConvNeXt-T's later stages kept channels-last at
        batch 1: 196 and 49 rows for 132 SMs, measured 1.47x slower than the model's layout on an H100,
        2026-11-27, when its reads waited tap by tap: ptxas kept 2 in flight). 0 for other kernels: pointwise
        kernels, windows walked in NCHW order (each lane its own window), pools' and large windows' loops are
        not modelled. Rounds at `mem_latency_ns` are assumed (most taps hit L1 or L2: an upper bound), not
        measured."""
        if region.kind != "rowreduce" or not region.space:
            return 0.0
        members = set(region.nodes)
        rounds = 0
        for i in members:
            n = g.nodes[i]
            kernel = pool.window(g, n)
            if kernel is None or n.op_type not in ops.CONV or kernel[0] * kernel[1] > WINDOW_UNROLL:
                continue
            if legal.image_layout(g, n.input[0], members) != "channels-last":
                return 0.0
            rounds += kernel[0] * -(-kernel[1] // WINDOW_READ_AHEAD)
        if not rounds:
            return 0.0
        dims = [compute.dim_hint(g, d) for d in region.space]
        short = self.row_threads(g, region)
        if short:
            vectors, tpr = short
        else:
            vectors = -(-dims[-1] // vector_lanes(dims[-1], _row_itemsize(g, region), self.target.vector_bytes))
            tpr = long_row_threads(vectors)
        threads = max(math.prod(dims[:-1]) * tpr, 1)
        per_thread = compute.work(g, region.nodes)[0] / threads
        return self.target.launch_us + -(-vectors // tpr) * rounds * self.target.mem_latency_ns / 1e3 + \
            per_thread / (self.target.clock_ghz * 1e3)

    def epilogue_us(self, g: Graph, region: Region) -> float:
        """What a GEMM region's epilogue adds to our kernel: its per-element branches, which serialize the
        tile's elements after the mainloop (tiles.epilogue_us), on the tile model's best tile for the GEMM.
        The tiles are still ranked without it: one measured shape calibrates it
        (Target.epilogue_branch_clocks), too little to let it move small GEMMs onto small tiles."""
        node = self._anchor(g, region)
        anchor = next(i for i in region.nodes if g.nodes[i] is node)
        epi = compute.epilogue_per_element(g, region.nodes, anchor)[1]
        if not epi:
            return 0.0
        batch, m, n, k = gemm_dims(g, node)
        es = int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.tensors[node.input[0]].dtype)).itemsize)
        b_nk = node.op_type == "Gemm" and any(x.name == "transB" and x.i for x in node.attribute)
        math_ = self._math(g, node)
        if self._wgmma(math_, node) and not (region.kind == "gemm_row" and norm_fold.in_region(g, region.nodes)):
            math_, b_nk = tiles.WS_F16, True  # as gemm_us: TMA-fed wgmma tiles, B read as [N][K]
        best = tiles.rank_tiles(self.target, m, n, k, batch, es, math_, b_nk, top_k=1,
                                row=region.kind == "gemm_row")
        return tiles.epilogue_us(self.target, best[0], m, n, batch, epi) if best else 0.0

    def speed_vs_library(self, g: Graph, node: onnx.NodeProto, region: Optional[Region] = None) -> float:
        """Our kernel's speed relative to cuBLAS/cuDNN: a Conv whose im2col operand is gathered element by
        element (anything but a 16-byte aligned 1x1 convolution of an image read from memory) gets the
        implicit-GEMM factor."""
        if node.op_type in ops.CONV:
            geo = conv.conv_geometry(g, node)
            assert not isinstance(geo, str), geo
            es = int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.tensors[node.input[0]].dtype)).itemsize)
            computed = region is not None and g.producer.get(node.input[0]) in region.nodes
            if computed or not conv.direct_operands(geo, es):
                return self.target.implicit_gemm_vs_cudnn
            return self.target.direct_conv_vs_cudnn
        return self.target.gemm_vs_cublas

    def recompute_us(self, g: Graph, merged: Region, prologue: Region) -> float:
        """Extra time of a Conv computing its image in its gather: every tile of output channels evaluates
        each image element once per kernel tap, re-reading the prologue's inputs (from L2) that often."""
        node = self._anchor(g, merged)
        batch, m, n, k = gemm_dims(g, node)
        es = int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(g.tensors[node.input[0]].dtype)).itemsize)
        best = tiles.rank_tiles(self.target, m, n, k, batch, es, self._math(g, node), False, top_k=1,
                                staged=(False, True))
        m_tiles = -(-m // best[0].tile.bm) if best else m
        geo = conv.conv_geometry(g, node)
        assert not isinstance(geo, str), geo
        reads = m_tiles * geo.kh * geo.kw - 1
        inputs = sum(tensor_bytes(g, t) for t in prologue.inputs)
        return reads * inputs / (self.target.dram_gbps * self.target.l2_over_dram * 1e3)

    def prologue_verdict(self, g: Graph, merged: Region, conv_region: Region, prologue: Region) -> Optional[str]:
        """None if a Conv that computes its image in its gather (`merged`) beats the image computed by its own
        kernel (`prologue`, ours) followed by the Conv as it stood (`conv_region`: ours with its epilogue, or
        cuDNN when it is the bare Conv) over the bindings of `bindings` (`_pays`)."""
        node = self._anchor(g, merged)
        times = []
        for where, gb in bindings(g):
            m, pr, cr = at_binding(gb, merged, g), at_binding(gb, prologue, g), at_binding(gb, conv_region, g)
            fused = self.ours_us(gb, m) + self.recompute_us(gb, m, pr)
            alone = (self.gemm_us(gb, node)[0] + self.target.launch_us if len(cr.nodes) == 1
                     else self.ours_us(gb, cr))
            times.append((where, fused, alone + self.ours_us(gb, pr)))
        if not _pays(times):
            return f"estimated at {_figures(times)} with the image computed by its own kernel"
        return None

    def ort_us(self, g: Graph, region: Region) -> float:
        """Estimated time of the region's nodes as stock ORT runs them: cuBLAS/cuDNN for the anchor (with the
        activations ORT folds into its own FusedConv), one kernel per other op."""
        tr = region.traffic
        host = self.target.host_node_us * len(cpu_ep_nodes(g, region.nodes))
        folded = [g.nodes[i] for i in ort_conv_folds(g, region)]
        chain = {g.nodes[a].output[0] for a in (_fold_anchor(g, region),) if a is not None}
        residual = sum(tensor_bytes(g, t) for n in folded if n.op_type == "Add" for t in n.input
                       if g.producer.get(t) not in region.nodes and t not in chain)  # FusedConv's Z input
        rest = tr.unfused_bytes - sum(node_bytes(g, n) for n in folded) + residual
        launches = tr.unfused_launches - len(folded)
        if region.kind == "attention":  # its two MatMuls at ORT's rate (TF32 for fp32), where over their bytes
            p = _attention_pattern(g, region)
            return host + self.time_us(rest, launches) + sum(
                max(0.0, us - node_bytes(g, n) / (self.target.dram_gbps * 1e3))
                for n in (g.nodes[p.qk], g.nodes[p.pv]) for us in (self.gemm_us(g, n)[0],))
        if region.kind not in ("gemm", "gemm_row"):
            return host + self.time_us(rest, launches)
        mm_us, mm_bytes = self.gemm_us(g, self._anchor(g, region))
        return host + mm_us + self.time_us(max(rest - mm_bytes, 0), launches)

    def verdict(self, g: Graph, region: Region) -> Optional[Reject]:
        """None if fusing the region pays over the bindings of `bindings` (`_pays`), else why not."""
        label = f"region at {g.node_label(region.nodes[0])}"
        if region.traffic.unfused_launches < 2 and not cpu_ep_nodes(g, region.nodes):
            return Reject(label, "replaces a single ORT kernel: no traffic or launch saved")
        folded = ort_conv_folds(g, region)
        if folded and not set(region.nodes) - set(folded) - {_fold_anchor(g, region)}:
            return Reject(label, "stock ORT fuses this itself (cuDNN FusedConv with its Relu, fp32)")
        times = [(where, self.ours_us(gb, r), self.ort_us(gb, r))
                 for where, gb in bindings(g) for r in (at_binding(gb, region, g),)]
        if not _pays(times):
            what = {"gemm": "GEMM + epilogue", "gemm_row": "GEMM + row-wise epilogue",
                    "attention": "attention kernel"}.get(region.kind, "fused kernel")
            return Reject(label, f"{what} estimated at {_figures(times)} as ORT runs it")
        return None

    def rotation_trial(self, g: Graph, pairs: list[tuple[Region, Region]]) -> Optional[str]:
        """None where rotating K once before the kernel might pay for the (kernel, once) attention regions of
        `pairs`; else why not, without searching the model that way: at every binding, what the kernels'
        rotation of K on every tile costs is under what a kernel of its own would (a launch, K read and
        written, per region)."""
        figures = []
        for where, gb in bindings(g):
            saved = sum(self.attention_us(gb, at_binding(gb, a, g)) - self.attention_us(gb, at_binding(gb, b, g))
                        for a, b in pairs)
            own = sum(self.time_us(2 * tensor_bytes(gb, _attention_pattern(gb, b).k), 1) for _, b in pairs)
            if saved >= own:
                return None
            figures.append(f"{saved:.1f} us vs {own:.1f} us{where}")
        return f"that rotation estimated under the launches and K traffic of rotating K once: {', '.join(figures)}"

    def attention_plan_verdict(self, g: Graph, ours: Plan, without: Plan, count: int) -> Optional[str]:
        """None if the plan with `count` attention regions of one kind ours beats the plan with their nodes fused
        otherwise over the bindings of `bindings` (`_pays`), else why not."""
        times = self.plan_times(g, ours, without)
        if _pays(times):
            return None
        return f"attention kernel ({count} of this kind) against its nodes fused otherwise: the whole model " \
               f"estimated at {self.figures(times)}"

    def split_verdict(self, g: Graph, merged: Region, group: Region, base: Optional[Region] = None) -> Optional[str]:
        """None if a GEMM with `group` fused in beats cuBLAS/cuDNN followed by `group` as our own kernel over
        the bindings of `bindings` (`_pays`); `base`: the GEMM's region before the merge where it is already
        ours (a LayerNorm folded in), instead of cuBLAS. Leaving all of it to ORT (whose FusedConv may absorb
        the group) is judged afterwards, by `verdict` on the merged region."""
        if self.splits_measured and base is None:
            return None
        lib = "our GEMM" if base is not None else "cuDNN" if self._anchor(g, merged).op_type in ops.CONV else "cuBLAS"
        times = []
        for where, gb in bindings(g):
            m, grp = at_binding(gb, merged, g), at_binding(gb, group, g)
            first = self.ours_us(gb, at_binding(gb, base, g)) if base is not None else \
                self.gemm_us(gb, self._anchor(gb, m))[0] + self.target.launch_us
            times.append((where, self.ours_us(gb, m), first + self.ours_us(gb, grp)))
        if not _pays(times):
            return f"estimated at {_figures(times)} as {lib} + a separate {group.kind} kernel"
        return None


def _pays(times: list[tuple[str, float, float]]) -> bool:
    """Fused beats the alternative in the geometric mean of the speedups over the bindings (the measure
    the benchmarks report): a large win at one batch size may outweigh a small loss at the other."""
    return math.prod(ours / alt for _, ours, alt in times) < 1.0


def _figures(times: list[tuple[str, float, float]]) -> str:
    return ", ".join(f"{ours:.1f} us fused vs {alt:.1f} us{where}" for where, ours, alt in times)

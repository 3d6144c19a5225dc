"""GEMM packing before the search, each pass giving the same function in a form one kernel computes.

* `pack_sibling_gemms`: MatMuls that multiply one activation by different constant weights (BERT's and
  ViT's query, key and value projections), each with its bias Add, become one MatMul on the concatenated
  weights, one Add and a Split: one GEMM launch with a wider N instead of several. The caller says which
  packings to keep (only those whose Split a consumer reads through, so no copy kernel is added); one whose
  Split no attention reads whole is tried with a Slice per result (a decoder's K read by its own rotary
  kernel where a KV cache returns it) and kept where the search fuses every Slice and none of the MatMuls
  had its epilogue fused. A pair of
  equally wide MatMuls left over (a gated MLP's gate and up projections, SiLU(x Wg) * (x Wu)) is tried
  interleaved: the packed weight's columns alternate between the two, and two Slices of step 2 give the
  results back, so one GEMM kernel holds each output column's gate and up values in one fragment pair
  (`legal.gated_reads`); kept where the search fuses the packed MatMul (with both Slices, which the
  lowering requires).
* `interleave_halves`: a MatMul whose weight already holds both (Phi-3's gate_up_proj, chunked in two by a
  Split or two Slices) gets the halves' columns interleaved the same way, its Split or Slices replaced by
  Slices of step 2; kept where the search fuses the MatMul.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.rewriter import weights
from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.canonical import remove_dead
from ortfuse.rewriter.graph import Graph, TensorInfo
from ortfuse.rewriter.shapes import assemble


def _packable_weight(g: Graph, i: int, x: str) -> Optional[str]:
    """The weight of MatMul node i if it computes x @ W with W a 2-D constant used by this node alone."""
    n = g.nodes[i]
    if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or n.input[0] != x or n.input[1] == x:
        return None
    w = n.input[1]
    info = g.tensors.get(w)
    if w not in g.constants or w in g.graph_outputs or info is None or info.shape is None or len(info.shape) != 2 \
            or set(g.consumers.get(w, ())) != {i}:
        return None
    return w


def _bias_add(g: Graph, i: int, n_cols: int) -> Optional[tuple[int, str]]:
    """(Add node, bias) when MatMul i's result is only consumed by an Add of a constant [N] bias."""
    y = g.nodes[i].output[0]
    users = set(g.consumers.get(y, ()))
    if y in g.graph_outputs or len(users) != 1:
        return None
    a = next(iter(users))
    add = g.nodes[a]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2 or add.input[0] == add.input[1]:
        return None
    b = add.input[1] if add.input[0] == y else add.input[0]
    info = g.tensors.get(b)
    if b not in g.constants or info is None or info.shape != (n_cols,) or info.dtype != g.tensors[y].dtype:
        return None
    return a, b


@dataclass(frozen=True)
class _Pack:
    x: str
    matmuls: tuple[int, ...]
    weights: tuple[str, ...]
    adds: tuple[int, ...]  # one per MatMul, or empty when not every MatMul has a bias Add
    biases: tuple[str, ...]

    @property
    def base(self) -> str:  # the prefix of the packing's node and tensor names
        return f"{self.x}__ortfuse_packed_{self.matmuls[0]}"

    @property
    def split_name(self) -> str:
        return f"{self.base}/Split"

    @property
    def slice_names(self) -> tuple[str, ...]:  # the Slice form: one Slice per result
        return tuple(f"{self.split_name}{k}" for k in range(len(self.matmuls)))

    def results(self, g: Graph) -> tuple[str, ...]:
        """The tensors the packing's Split or Slices give back: each MatMul's result, or its bias Add's."""
        return tuple(g.nodes[i].output[0] for i in (self.adds or self.matmuls))


def _sibling_packs(g: Graph) -> list[_Pack]:
    packs = []
    for x, users in g.consumers.items():
        info = g.tensors.get(x)
        if x in g.constants or info is None or info.shape is None or len(info.shape) < 2:
            continue
        groups: dict[tuple, list[tuple[int, str]]] = {}
        for i in sorted(set(users)):
            w = _packable_weight(g, i, x)
            if w is not None and g.tensors[w].shape[0] == info.shape[-1]:
                groups.setdefault((g.tensors[w].dtype, g.tensors[w].shape[0]), []).append((i, w))
        for members in groups.values():
            if len(members) < 2:
                continue
            adds = [_bias_add(g, i, g.tensors[w].shape[1]) for i, w in members]
            biased = all(a is not None for a in adds)
            packs.append(_Pack(x, tuple(i for i, _ in members), tuple(w for _, w in members),
                               tuple(a[0] for a in adds) if biased else (), tuple(a[1] for a in adds) if biased else ()))
    return packs


def _apply_packs(g: Graph, packs: list[_Pack], sliced: frozenset[_Pack] = frozenset(),
                 interleaved: frozenset[_Pack] = frozenset()) -> Graph:
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    removed = {i for p in packs for i in (*p.matmuls, *p.adds)}
    at = {p.matmuls[0]: p for p in packs}
    new_nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(m.graph.node):
        if i in at:
            new_nodes.extend(_packed_nodes(g, at[i], m, tensors, at[i] in sliced, at[i] in interleaved))
        if i not in removed:
            new_nodes.append(node)
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides)


def _packed_nodes(g: Graph, p: _Pack, m: onnx.ModelProto, tensors: dict[str, TensorInfo],
                  sliced: bool = False, interleaved: bool = False) -> list[onnx.NodeProto]:
    """MatMul on the concatenated weights (+ Add of the concatenated biases) + Split into the old results, or
    (`sliced`, opset 13 on) one Slice per result, which a kernel reading it can absorb on its own, or
    (`interleaved`, two MatMuls of one width, opset 10 on) the columns alternating between the two weights and
    a Slice of step 2 per result."""
    base = p.base
    sizes = [g.tensors[w].shape[1] for w in p.weights]
    dtype = g.tensors[p.weights[0]].dtype
    x_shape = g.tensors[p.x].shape
    out_shape = (*x_shape[:-1], sum(sizes))

    def packed_of(parts: list[np.ndarray]) -> np.ndarray:  # along the last axis, interleaved or one after another
        if interleaved:
            return np.stack(parts, -1).reshape(*parts[0].shape[:-1], -1)
        return np.concatenate(parts, -1)
    m.graph.initializer.append(numpy_helper.from_array(packed_of([g.constants[w] for w in p.weights]), f"{base}_w"))
    nodes = [onnx.helper.make_node("MatMul", [p.x, f"{base}_w"], [f"{base}_mm"], name=f"{base}/MatMul")]
    tensors[f"{base}_mm"] = TensorInfo(f"{base}_mm", dtype, out_shape)
    tensors[f"{base}_w"] = TensorInfo(f"{base}_w", dtype, (x_shape[-1], sum(sizes)))
    packed, results = f"{base}_mm", [g.nodes[i].output[0] for i in p.matmuls]
    if p.adds:
        m.graph.initializer.append(numpy_helper.from_array(packed_of([g.constants[b] for b in p.biases]),
                                                           f"{base}_b"))
        tensors[f"{base}_b"] = TensorInfo(f"{base}_b", dtype, (sum(sizes),))
        nodes.append(onnx.helper.make_node("Add", [packed, f"{base}_b"], [f"{base}_add"], name=f"{base}/Add"))
        tensors[f"{base}_add"] = TensorInfo(f"{base}_add", dtype, out_shape)
        packed, results = f"{base}_add", [g.nodes[a].output[0] for a in p.adds]
    axis = len(out_shape) - 1
    if sliced or interleaved:
        for k, (res, name) in enumerate(zip(results, p.slice_names)):
            bounds = [f"{name}_{what}" for what in ("starts", "ends", "axes", "steps")[:4 if interleaved else 3]]
            start = k if interleaved else sum(sizes[:k])
            values = (k, sum(sizes), axis, len(sizes)) if interleaved else (start, start + sizes[k], axis)
            for t, v in zip(bounds, values):
                m.graph.initializer.append(numpy_helper.from_array(np.asarray([v], np.int64), t))
                tensors[t] = TensorInfo(t, onnx.TensorProto.INT64, (1,))
            nodes.append(onnx.helper.make_node("Slice", [packed, *bounds], [res], name=name))
    elif g.opset >= 13:
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(sizes, np.int64), f"{base}_sizes"))
        tensors[f"{base}_sizes"] = TensorInfo(f"{base}_sizes", onnx.TensorProto.INT64, (len(sizes),))
        nodes.append(onnx.helper.make_node("Split", [packed, f"{base}_sizes"], results, name=p.split_name, axis=axis))
    else:
        nodes.append(onnx.helper.make_node("Split", [packed], results, name=p.split_name, axis=axis, split=sizes))
    return nodes


def pack_sibling_gemms(g: Graph, keep: Optional[Callable[[Graph], set[str]]] = None,
                       fused: Optional[Callable[[Graph], set[str]]] = None,
                       as_they_are: frozenset[str] = frozenset()) -> tuple[Graph, int]:
    """(new graph, number of MatMuls packed). `keep(packed graph)` names the Split nodes worth keeping. A
    packing whose Split is not named is tried with one Slice per result instead, where `fused(graph)` (the
    outputs of the nodes the search fuses) has none of its MatMuls in `g` (a GEMM with its epilogue fused
    stays ours) or where every MatMul has a bias Add (packed, they are the one GEMM's epilogue: Qwen2's Q took
    its bias, K and V went to cuBLAS), and kept where it has every Slice in that graph (each absorbed by the
    kernel reading it: a decoder's Q and K by their rotary embedding's, V by the attention's); pairs of one
    width still undone are tried interleaved and kept where the search fuses their packed MatMul; the others
    are undone. `as_they_are`: outputs of nodes that stay as they are (their MatMuls or bias Adds are not
    packed). `g` is left untouched."""
    packs = [p for p in _sibling_packs(g)
             if not any(o in as_they_are for i in (*p.matmuls, *p.adds) for o in g.nodes[i].output)]
    if not packs:
        return g, 0
    packed = _apply_packs(g, packs)
    if keep is not None:
        wanted = keep(packed)
        kept = [p for p in packs if p.split_name in wanted]
        rest = frozenset(p for p in packs if p not in kept)
        sliced: frozenset[_Pack] = frozenset()
        trial = g
        if rest and fused is not None and g.opset >= 13:
            ours = fused(g)
            rest = frozenset(p for p in rest if p.adds or not any(g.nodes[i].output[0] in ours for i in p.matmuls))
            if rest:
                trial = _apply_packs(g, [p for p in packs if p in kept or p in rest], rest)
                absorbed = fused(trial)
                sliced = frozenset(p for p in rest if set(p.results(g)) <= absorbed)
        final = [p for p in packs if p in kept or p in sliced]
        # pairs left over, interleaved (a gated MLP's gate and up projections: one kernel for both)
        pairs = [p for p in packs if p not in final and len(p.matmuls) == 2 and not p.adds and
                 len({g.tensors[w].shape for w in p.weights}) == 1] if fused is not None and g.opset >= 13 else []
        mixed: frozenset[_Pack] = frozenset()
        if pairs:
            trial2 = _apply_packs(g, final + pairs, sliced, frozenset(pairs))
            absorbed = fused(trial2)
            mixed = frozenset(p for p in pairs if f"{p.base}_mm" in absorbed and set(p.results(g)) <= absorbed)
        if mixed and len(mixed) == len(pairs):
            packed, packs = trial2, final + pairs  # the graph the search has just seen
        elif final != packs or sliced or mixed:
            # every packing tried as Slices kept: the graph the search has just seen (and the caller may have
            # its plan of)
            final = [p for p in packs if p in final or p in mixed]
            packed = trial if sliced and sliced == rest and not mixed else \
                _apply_packs(g, final, sliced, mixed) if final else g
            packs = final
    return packed, sum(len(p.matmuls) for p in packs)


def _halves(g: Graph, i: int) -> Optional[tuple[str, tuple[int, ...], tuple[str, str]]]:
    """(weight, the Split or Slice nodes, (first half, second half)) where MatMul i computes x @ W with W a
    [K, 2N] constant only it reads, and its result is read only by one Split or two unit-step Slices cutting
    the last axis into its two halves."""
    from ortfuse.search import legal
    from ortfuse.search.attention import slice_steps

    n = g.nodes[i]
    if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx"):
        return None
    w, y = n.input[1], n.output[0]
    ws, ys = (g.tensors[t].shape if t in g.tensors else None for t in (w, y))
    if w not in g.constants or g.fed(w) or set(g.consumers.get(w, ())) != {i} or not ws or len(ws) != 2 or \
            ws[1] % 2 or not ys or y in g.graph_outputs:
        return None
    last, half = len(ys) - 1, ws[1] // 2
    users = sorted(set(g.consumers.get(y, ())))
    nodes = [g.nodes[u] for u in users]
    try:
        if len(nodes) == 1 and nodes[0].op_type == "Split" and len(nodes[0].output) == 2:
            sp = nodes[0]
            if attr(sp, "axis", 0) % len(ys) != last or \
                    any(o not in g.tensors or g.tensors[o].shape != ys[:-1] + (half,) for o in sp.output):
                return None
            return w, tuple(users), (sp.output[0], sp.output[1])
        if len(nodes) == 2 and all(s.op_type == "Slice" and legal.slice_verdict(g, s) is None for s in nodes):
            firsts = {}
            for s in nodes:
                starts = legal.slice_starts(g, s)
                if set(starts) != {last} or set(slice_steps(g, s).values()) != {1} or \
                        g.tensors[s.output[0]].shape != ys[:-1] + (half,):
                    return None
                firsts[starts[last]] = s.output[0]
            if set(firsts) == {0, half}:
                return w, tuple(users), (firsts[0], firsts[half])
    except (ValueError, KeyError, IndexError):
        return None
    return None


def _interleaved(g: Graph, found: dict[int, tuple[str, tuple[int, ...], tuple[str, str]]]) -> Graph:
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    cut = {u for _, users, _ in found.values() for u in users}
    new_nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(m.graph.node):
        if i in cut:
            continue
        if i not in found:
            new_nodes.append(node)
            continue
        w, _, results = found[i]
        k, n2 = g.tensors[w].shape
        base = f"{node.output[0]}__ortfuse_interleaved"
        packed = np.stack([g.constants[w][:, :n2 // 2], g.constants[w][:, n2 // 2:]], -1).reshape(k, n2)
        m.graph.initializer.append(numpy_helper.from_array(packed, f"{base}_w"))
        tensors[f"{base}_w"] = TensorInfo(f"{base}_w", g.tensors[w].dtype, (k, n2))
        mm = onnx.NodeProto()
        mm.CopyFrom(node)
        mm.input[1] = f"{base}_w"
        new_nodes.append(mm)
        axis = len(g.tensors[node.output[0]].shape) - 1
        for first, res in enumerate(results):
            bounds = [f"{base}_{first}_{what}" for what in ("starts", "ends", "axes", "steps")]
            for t, v in zip(bounds, (first, n2, axis, 2)):
                m.graph.initializer.append(numpy_helper.from_array(np.asarray([v], np.int64), t))
                tensors[t] = TensorInfo(t, onnx.TensorProto.INT64, (1,))
            new_nodes.append(onnx.helper.make_node("Slice", [node.output[0], *bounds], [res], name=f"{base}/Slice{first}"))
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides)


def interleave_halves(g: Graph, fused: Callable[[Graph], set[str]]) -> tuple[Graph, int]:
    """(new graph, number of MatMuls interleaved): each MatMul `_halves` finds that the search leaves to ORT
    in `g` is tried with its weight's two halves interleaved column by column and read back by Slices of
    step 2, and kept where the search then fuses it (`fused(graph)`: the outputs of the nodes it fuses; a
    gated MLP's one GEMM kernel, `legal.gated_reads`). `g` is left untouched."""
    if g.opset < 13:
        return g, 0
    found = {i: h for i in range(len(g.nodes)) if (h := _halves(g, i)) is not None}
    if not found:
        return g, 0
    ours = fused(g)
    found = {i: h for i, h in found.items() if g.nodes[i].output[0] not in ours}
    if not found:
        return g, 0
    trial = _interleaved(g, found)
    absorbed = fused(trial)
    kept = {i: h for i, h in found.items() if g.nodes[i].output[0] in absorbed and set(h[2]) <= absorbed}
    if len(kept) == len(found):
        return trial, len(kept)
    return (_interleaved(g, kept), len(kept)) if kept else (g, 0)


def deinterleave_unfused(m: onnx.ModelProto) -> int:
    """Gated pairs ORT runs after all, split back in the output model `m` (in place; the number undone):
    MatMul(x, W) with W a weight ortfuse interleaved (its name says so, only this MatMul reads it) whose result
    only two Slices of step 2 read, from column 0 and column 1, become MatMul(x, W[:, 0::2]) and
    MatMul(x, W[:, 1::2]), the two GEMMs the model had. `--profile` may place the gated region with ORT, where
    the packing would otherwise leave a strided copy of each half behind."""
    inits = {t.name: t for t in m.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in m.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in m.graph.output}
    drop: set[int] = set()
    new_inits: list[onnx.TensorProto] = []
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for k, n in enumerate(m.graph.node):
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or n.input[1] not in inits or \
                "__ortfuse_" not in n.input[1] or len(readers.get(n.input[1], ())) != 1 or n.output[0] in outputs:
            continue
        w = weights.array_of(inits[n.input[1]])
        halves = _strided_halves(readers.get(n.output[0], ()), inits, w)
        if w.ndim != 2 or w.shape[1] % 2 or halves is None:
            continue
        mms = []
        for first, sl in enumerate(halves):
            name = f"{n.input[1]}__half{first}"
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w[:, first::2]), name))
            mms.append(onnx.helper.make_node("MatMul", [n.input[0], name], [sl.output[0]], name=f"{n.name}/half{first}"))
        replaced[k] = mms
        drop.update(id(sl) for sl in halves)
        drop.add(id(inits[n.input[1]]))
    if not replaced:
        return 0
    nodes = []
    for k, n in enumerate(m.graph.node):
        if k in replaced:
            nodes.extend(replaced[k])
        elif id(n) not in drop:
            nodes.append(n)
    keep_inits = [t for t in m.graph.initializer if id(t) not in drop]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep_inits + new_inits)
    weights.set_aside(m)
    remove_dead(m)
    made = {o for n in m.graph.node for o in n.output}
    infos = [v for v in m.graph.value_info if v.name in made]  # the packed result is gone
    del m.graph.value_info[:]
    m.graph.value_info.extend(infos)
    return len(replaced)


def _strided_halves(users: list[onnx.NodeProto], inits: dict, w: np.ndarray) -> Optional[tuple[onnx.NodeProto, ...]]:
    """The two Slices (column 0, column 1) of step 2 on the last axis that are a packed MatMul's only readers."""
    if len(users) != 2 or any(u.op_type != "Slice" or len(u.input) < 5 for u in users):
        return None
    found: dict[int, onnx.NodeProto] = {}
    axes = set()
    for u in users:
        vals = [weights.array_of(inits[x]).reshape(-1) if x in inits else None for x in u.input[1:5]]
        if any(v is None or v.size != 1 for v in vals):
            return None
        start, end, axis, step = (int(v[0]) for v in vals)
        if step != 2 or axis == 0 or start not in (0, 1) or end < w.shape[1]:
            return None
        found[start] = u
        axes.add(axis)
    # one axis, the last: the packings that name their weights so slice nowhere else
    return (found[0], found[1]) if set(found) == {0, 1} and len(axes) == 1 else None


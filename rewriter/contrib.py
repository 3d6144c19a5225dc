"""ONNX Runtime's own fused ops split into the standard ops the search fuses, and put back where it fused none.

ONNX's own RMSNormalization (opset 23) is split the same way, so it joins the GEMM before it as Llama's
exported RMSNorm chain does, and is put back where nothing fused it; and ONNX's Attention (opset 23), as the
ops the attention search fuses into one kernel (`rewriter.onnx_attention`), and its RotaryEmbedding as the
rotate_half ops that kernel folds in (`rewriter.onnx_rotary`). So is ONNX's Split (torch.export writes
`chunk` and `split` as one, where TorchScript wrote Slices): one Slice per output, each an indexed read the
kernel of its reader takes (ShuffleNet's channel split, YOLO's C2f), the Split put back where all of them stay
with ORT (a KV cache's projection).

A model run through `onnxruntime.transformers`' optimizer (or optimum's ORTOptimizer) carries ORT's fused ops
in place of the exporter's: BiasGelu or FastGelu after a MatMul, SkipLayerNormalization after the next one,
(Skip)SimplifiedLayerNormalization in Llamas, and LayerNormalization before opset 17 (ORT's own op then, in
the default domain). The search knows none of them, so such a model's GEMMs had nothing to fuse. And ORT 1.31
crashes on its default-domain ops inside a model-local function, which a fused node's fallback is, so none of
them may go into a region as it is. `split_contrib_ops` writes each as the standard ops an exporter writes for
it (the erf or tanh GELU, Add + LayerNormalization, or the LayerNorm's own ops before opset 17, the RMSNorm
chain Llama's exporter writes; fp16 norms computed in fp32 between Casts), so the search plans them as it
plans a raw export. `restore` then puts back, in the output model, each
node whose split ops all stayed with ORT (or the tail of one: the RMSNorm of a SkipSimplifiedLayerNormalization
whose Add went into a GEMM's epilogue), in the main graph, so ORT runs the kernels it ran before wherever we
fuse nothing.

Split only where the result is the same function: float, float16 or bfloat16; the statistics outputs (mean,
inverse standard deviation) unused; RMSNorm over the last axis with a scale of the input's type."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortfuse.rewriter import _proto, onnx_attention, onnx_rotary
from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.canonical import remove_dead
from ortfuse.rewriter.graph import Dim, Graph, TensorInfo
from ortfuse.rewriter.shapes import assemble

MS = "com.microsoft"
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_SPLIT = {(MS, "Gelu"), (MS, "BiasGelu"), (MS, "FastGelu"), (MS, "QuickGelu"),
          (MS, "SkipLayerNormalization"), (MS, "SkipSimplifiedLayerNormalization"), ("", "SimplifiedLayerNormalization"),
          ("", "LayerNormalization"), ("", "RMSNormalization"), ("", "Split"), ("", "Attention"),
          ("", "RotaryEmbedding")}
# (the default-domain ones as ORT's own: LayerNormalization before 17; and ONNX's RMSNormalization, opset 23)
_NORMS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
          "LayerNormalization", "RMSNormalization")
# ONNX's own ops split as ORT's are (the search knows only their standard ops)
_ONNX_SPLIT = frozenset({"RMSNormalization", "Split", "Attention", "RotaryEmbedding"})
_TANH_GELU_C = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True, eq=False)
class Part:
    """Split nodes (by name) and the node that computes what they compute; `reads[k]` is the split node and input
    slot that read the node's k-th input, so a put-back node reads what that slot reads then (a later pass may
    have bypassed an Identity of a weight or folded a Cast of one), or None where no split node reads it."""
    names: tuple[str, ...]
    node: onnx.NodeProto
    reads: tuple[Optional[tuple[str, int]], ...]


@dataclass(frozen=True, eq=False)
class Split:
    """One ORT node written as standard ops. `parts`: the whole first, then tails that can be put back alone;
    `constants`: the scalars it added; `kept`: constant inputs of the original that no split op reads (a
    Split's sizes), added back with it."""
    original: onnx.NodeProto
    parts: tuple[Part, ...]
    constants: tuple[str, ...]
    kept: tuple[onnx.TensorProto, ...] = ()


def split_contrib_ops(g: Graph) -> tuple[Graph, tuple[Split, ...]]:
    """(new graph, the nodes split); `g` is left untouched."""
    todo = [i for i, n in enumerate(g.nodes) if (_domain(n), n.op_type) in _SPLIT and _splittable(g, n)]
    if not todo:
        return g, ()
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    b = _Builder(g, tensors, {n.name for n in g.nodes} | {o for n in g.nodes for o in n.output} | set(g.tensors))
    new_nodes: list[onnx.NodeProto] = []
    splits: list[Split] = []
    substituted = False
    at = set(todo)
    for i, n in enumerate(g.nodes):
        if i not in at:
            new_nodes.append(n)
            continue
        b.start(n)
        tails = _EXPAND[n.op_type](b, n)
        new_nodes.extend(b.nodes)
        whole = n
        if b.substitutes:  # put back, it reads the tensors of the same value the split ops read instead
            whole = onnx.NodeProto()
            whole.CopyFrom(n)
            _proto.read_instead([whole], b.substitutes)
            substituted = True
        parts = [_part(b.nodes, node) for node in (whole, *tails)]
        read = {x for node in b.nodes for x in node.input}
        kept = tuple(numpy_helper.from_array(np.asarray(g.constants[x]), x) for x in n.input[1:]
                     if x and x not in read and x in g.constants)
        splits.append(Split(n, tuple(parts), tuple(b.constants), kept))
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    m.graph.initializer.extend(b.initializers)
    if substituted:  # what only a split node now reading another's tensor read goes (a later layer's cos, sin)
        remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), tuple(splits)


def _part(nodes: list[onnx.NodeProto], node: onnx.NodeProto) -> Part:
    """The split `nodes` that compute `node` (the whole split; a tail's start after the node making its first
    input), with the slot that reads each of its inputs."""
    start = next((k + 1 for k, n in enumerate(nodes) if node.input[0] in n.output), 0)
    tail = nodes[start:]

    def reader(x: str) -> Optional[tuple[str, int]]:
        return next(((n.name, j) for n in tail for j, y in enumerate(n.input) if y == x), None) if x else None

    return Part(tuple(n.name for n in tail), node, tuple(reader(x) for x in node.input))


def restore(m: onnx.ModelProto, splits: tuple[Split, ...]) -> tuple[tuple[Split, Part], ...]:
    """Put back (in place, in the output model `m`) each split node, or tail of one, whose split ops are all
    still there and read by nothing else, reading what its split ops read now; drops the scalars no node reads
    any more. Returns what was put back."""
    if not splits:
        return ()
    by_name = {n.name: n for n in m.graph.node}
    readers: dict[str, set[str]] = {}
    for n in m.graph.node:
        for x in _proto.node_reads(n):
            readers.setdefault(x, set()).add(n.name)
    outputs = {o.name for o in m.graph.output}
    known = {v.name for v in m.graph.input} | {t.name for t in m.graph.initializer} | \
        {o for n in m.graph.node for o in n.output}
    gone: set[str] = set()
    dead: set[str] = set()  # what the split ops put back made (the node made its outputs alone)
    back: list[onnx.NodeProto] = []
    done: list[tuple[Split, Part]] = []
    progress = True
    while progress:  # again while one put back frees another (layers' Attentions sharing one mask bias)
        progress = False
        for s in splits:
            missing = [t for t in s.kept if t.name not in known]  # (a Split's sizes, which no Slice read)
            known |= {t.name for t in missing}
            for part in s.parts:
                if any(x not in by_name or x in gone for x in part.names):
                    continue
                made = {o for x in part.names for o in by_name[x].output if o}
                inner = made - set(part.node.output)
                if any(t in outputs or not readers.get(t, set()) - gone <= set(part.names) for t in inner):
                    continue
                node = onnx.NodeProto()
                node.CopyFrom(part.node)
                for k, read in enumerate(part.reads):
                    if read is not None:
                        node.input[k] = by_name[read[0]].input[read[1]]
                if any(x and (x not in known or x in made or x in dead) for x in node.input):
                    continue  # (not seen) it would read what nothing else makes: the split ops stay, which are right
                gone.update(part.names)
                dead |= inner
                back.append(node)
                done.append((s, part))
                progress = True
                m.graph.initializer.extend(t for t in missing if t.name in node.input)
                missing = [t for t in missing if t.name not in node.input]
            known -= {t.name for t in missing}
    if back:
        remaining = [n for n in m.graph.node if n.name not in gone]
        del m.graph.node[:]
        m.graph.node.extend(remaining + back)
        _proto.sort_nodes(m.graph)
    read = {x for n in m.graph.node for x in _proto.node_reads(n)} | outputs | {v.name for v in m.graph.input}
    added = {c for s in splits for c in s.constants} | {t.name for s in splits for t in s.kept}
    keep = [t for t in m.graph.initializer if t.name not in added or t.name in read]
    if len(keep) < len(m.graph.initializer):
        del m.graph.initializer[:]
        m.graph.initializer.extend(keep)
    if not back:
        return ()
    made = {o for n in m.graph.node for o in n.output}
    vis = [v for v in m.graph.value_info if v.name in made or v.name in read]
    if len(vis) < len(m.graph.value_info):
        del m.graph.value_info[:]
        m.graph.value_info.extend(vis)
    return tuple(done)


def notes(m: onnx.ModelProto, splits: tuple[Split, ...], back: tuple[tuple[Split, Part], ...]) -> tuple[str, ...]:
    """One line a split node of the output model `m`: fused, put back (or its tail), or in part left to ORT."""
    put = {id(s): p for s, p in back}
    present = {n.name for n in m.graph.node}
    lines = []
    for s in splits:
        label = f"{s.original.op_type} '{s.original.name or s.original.output[0]}'"
        part = put.get(id(s))
        left = [x for x in s.parts[0].names if x in present]
        if part is s.parts[0]:
            lines.append(f"{label}: its standard ops were left to ORT, so it was put back as it was")
        elif part is not None:
            lines.append(f"{label}: its Add fused, its {part.node.op_type} put back as ORT's op")
        elif left:
            ops = ", ".join(sorted({n.op_type for n in m.graph.node if n.name in set(left)}))
            lines.append(f"{label}: written as standard ops, fused but for {len(left)} left to ORT ({ops})")
        else:
            lines.append(f"{label}: written as standard ops, all fused")
    return tuple(lines)


def _domain(n: onnx.NodeProto) -> str:
    return "" if n.domain == "ai.onnx" else n.domain


def _splittable(g: Graph, n: onnx.NodeProto) -> bool:
    if n.op_type == "Attention" and _domain(n) == "":
        return onnx_attention.splittable(g, n)
    if n.op_type == "RotaryEmbedding" and _domain(n) == "":
        return onnx_rotary.splittable(g, n)
    x = g.tensors.get(n.input[0])
    if n.op_type == "Split" and _domain(n) == "":  # (Slice takes its starts as inputs from opset 10)
        return g.opset >= 10 and x is not None and x.shape is not None and _split_sizes(g, n) is not None \
            and any(g.used(o) for o in n.output)
    if x is None or x.dtype not in _FLOATS:
        return False
    if _domain(n) == "" and n.op_type not in _ONNX_SPLIT and not _proto.ort_default_domain_op(g.model, n):
        return False  # ONNX's own LayerNormalization (17 on): the search takes it as it is
    if n.op_type in _NORMS:
        stats = n.output[1:3] if n.op_type.startswith("Skip") or n.op_type == "LayerNormalization" else n.output[1:2]
        if any(g.used(o) for o in stats) or x.shape is None:
            return False
    if n.op_type in ("SimplifiedLayerNormalization", "LayerNormalization", "RMSNormalization"):
        scale = g.tensors.get(n.input[1])
        axis = attr(n, "axis", -1)
        if scale is None or scale.dtype != x.dtype or attr(n, "stash_type", 1) != 1 \
                or axis not in (-1, len(x.shape) - 1):
            return False
    return True


@dataclass
class _Builder:
    """New nodes, tensors and scalar constants for one split node at a time, with names no one else has."""
    g: Graph
    tensors: dict[str, TensorInfo]
    taken: set[str]
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    constants: list[str] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    base: str = ""
    memo: dict = field(default_factory=dict)  # tensors split nodes share (one attention bias for every layer)
    substitutes: dict = field(default_factory=dict)  # the node's inputs whose value a shared tensor holds

    def start(self, n: onnx.NodeProto) -> None:
        self.nodes, self.constants, self.substitutes = [], [], {}
        self.base = n.name or n.output[0]

    def name(self, what: str) -> str:
        k, name = 0, f"{self.base}/ortfuse_{what}"
        while name in self.taken:
            k += 1
            name = f"{self.base}/ortfuse_{what}_{k}"
        self.taken.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], like: str, out: Optional[str] = None,
           shape: Optional[tuple[Dim, ...]] = None, dtype: Optional[int] = None, **attrs) -> str:
        """A node computing a tensor shaped as `like` (or `shape`), of `like`'s dtype (or `dtype`)."""
        name = self.name(op_type)
        out = out or self.name(f"{op_type}_out")
        ref = self.tensors.get(like)
        self.tensors[out] = TensorInfo(out, dtype if dtype is not None else ref.dtype,
                                       shape if shape is not None else ref.shape)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=name, **attrs))
        return out

    def scalar(self, value: float, dtype: int) -> str:
        name = self.name("const")
        arr = np.array(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
        self.initializers.append(numpy_helper.from_array(arr, name) if dtype != TensorProto.BFLOAT16
                                 else helper.make_tensor(name, dtype, [], [float(value)]))
        self.tensors[name] = TensorInfo(name, dtype, ())
        self.constants.append(name)
        return name

    def dtype(self, t: str) -> int:
        return self.tensors[t].dtype

    def ints(self, values: list[int]) -> str:
        """A 1-D int64 constant (a Slice's starts, ends or axes)."""
        name = self.name("ints")
        self.initializers.append(numpy_helper.from_array(np.array(values, np.int64), name))
        self.tensors[name] = TensorInfo(name, TensorProto.INT64, (len(values),))
        self.constants.append(name)
        return name


def _erf_gelu(b: _Builder, x: str, out: str) -> None:
    """x * 0.5 * (1 + erf(x / sqrt(2))), as torch exports nn.GELU()."""
    dt = b.dtype(x)
    e = b.op("Erf", [b.op("Div", [x, b.scalar(math.sqrt(2.0), dt)], x)], x)
    b.op("Mul", [b.op("Mul", [x, b.op("Add", [e, b.scalar(1.0, dt)], x)], x), b.scalar(0.5, dt)], x, out=out)


def _tanh_gelu(b: _Builder, x: str, out: str) -> None:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), as torch exports GELU(approximate='tanh')."""
    dt = b.dtype(x)
    cube = b.op("Mul", [b.op("Mul", [x, x], x), x], x)
    inner = b.op("Add", [x, b.op("Mul", [cube, b.scalar(0.044715, dt)], x)], x)
    t = b.op("Tanh", [b.op("Mul", [inner, b.scalar(_TANH_GELU_C, dt)], x)], x)
    b.op("Mul", [b.op("Mul", [x, b.scalar(0.5, dt)], x), b.op("Add", [t, b.scalar(1.0, dt)], x)], x, out=out)


def _gelu(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    _erf_gelu(b, n.input[0], n.output[0])
    return ()


def _bias_gelu(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    s = b.op("Add", [n.input[0], n.input[1]], n.input[0])
    _erf_gelu(b, s, n.output[0])
    return (helper.make_node("Gelu", [s], [n.output[0]], name=b.name("Gelu"), domain=MS),)


def _fast_gelu(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    biased = len(n.input) > 1 and bool(n.input[1])
    x = b.op("Add", [n.input[0], n.input[1]], n.input[0]) if biased else n.input[0]
    _tanh_gelu(b, x, n.output[0])
    return (helper.make_node("FastGelu", [x], [n.output[0]], name=b.name("FastGelu"), domain=MS),) if biased else ()


def _quick_gelu(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    x = n.input[0]
    sig = b.op("Sigmoid", [b.op("Mul", [x, b.scalar(attr(n, "alpha", 1.702), b.dtype(x))], x)], x)
    b.op("Mul", [x, sig], x, out=n.output[0])
    return ()


def _skip_sum(b: _Builder, n: onnx.NodeProto, bias: str) -> str:
    """input + skip (+ bias): the bias joins whichever of the two a GEMM computes, as in the exported graph."""
    x, skip = n.input[0], n.input[1]
    if _from_gemm(b.g, skip) and not _from_gemm(b.g, x):
        x, skip = skip, x
    out = n.output[3] if len(n.output) > 3 and n.output[3] else None
    if bias:
        x = b.op("Add", [x, bias], x)  # shaped as that operand (a skip may broadcast)
    return b.op("Add", [x, skip], n.input[0], out=out)


def _from_gemm(g: Graph, t: str) -> bool:
    return t in g.producer and g.nodes[g.producer[t]].op_type in ("MatMul", "Gemm")


def _row_mean(b: _Builder, x: str) -> str:
    """ReduceMean over the last axis, kept."""
    row = (*b.tensors[x].shape[:-1], 1)
    if b.g.opset < 18:
        return b.op("ReduceMean", [x], x, shape=row, axes=[-1], keepdims=1)
    axes = b.name("axes")
    b.initializers.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
    b.tensors[axes] = TensorInfo(axes, TensorProto.INT64, (1,))
    b.constants.append(axes)
    return b.op("ReduceMean", [x, axes], x, shape=row, keepdims=1)


def _widened(b: _Builder, x: str) -> str:
    return x if b.dtype(x) == TensorProto.FLOAT else b.op("Cast", [x], x, dtype=TensorProto.FLOAT, to=TensorProto.FLOAT)


def _narrowed(b: _Builder, wide: str, like: str) -> str:
    return wide if b.dtype(like) == TensorProto.FLOAT else b.op("Cast", [wide], like, to=b.dtype(like))


def _inv_std(b: _Builder, mean_sq: str, eps: float) -> str:
    """1 / sqrt(mean_sq + eps)."""
    f = TensorProto.FLOAT
    return b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [mean_sq, b.scalar(eps, f)], mean_sq)], mean_sq)], mean_sq)


def _rms_norm(b: _Builder, x: str, scale: str, eps: float, out: str) -> None:
    """x * 1 / sqrt(mean(x^2) + eps) * scale over the last axis, in fp32 (as Llama's exporter writes it)."""
    wide = _widened(b, x)
    sq = b.op("Pow", [wide, b.scalar(2.0, TensorProto.FLOAT)], wide)
    normed = b.op("Mul", [wide, _inv_std(b, _row_mean(b, sq), eps)], wide)
    b.op("Mul", [_narrowed(b, normed, x), scale], x, out=out)


def _layer_norm_ops(b: _Builder, x: str, scale: str, beta: str, eps: float, out: str) -> None:
    """(x - mean) / sqrt(var + eps) * scale (+ beta) over the last axis, in fp32: ONNX's LayerNormalization before
    opset 17, which ORT defines as its own op and cannot run inside a model-local function."""
    wide = _widened(b, x)
    d = b.op("Sub", [wide, _row_mean(b, wide)], wide)
    var = _row_mean(b, b.op("Mul", [d, d], d))
    scaled = b.op("Mul", [_narrowed(b, b.op("Mul", [d, _inv_std(b, var, eps)], d), x), scale], x,
                  out=None if beta else out)
    if beta:
        b.op("Add", [scaled, beta], x, out=out)


def _skip_layer_norm(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    bias = n.input[4] if len(n.input) > 4 else ""
    s = _skip_sum(b, n, bias)
    beta = n.input[3] if len(n.input) > 3 else ""
    eps = attr(n, "epsilon", 1e-12)
    norm = helper.make_node("LayerNormalization", [s, n.input[2], *([beta] if beta else [])], [n.output[0]],
                            name=b.name("LayerNormalization"), axis=-1, epsilon=eps)
    if b.g.opset >= 17:
        b.nodes.append(norm)
        b.tensors[n.output[0]] = TensorInfo(n.output[0], b.dtype(s), b.tensors[s].shape)
        return ()
    _layer_norm_ops(b, s, n.input[2], beta, eps, n.output[0])
    return (norm,)  # before 17: ORT's own LayerNormalization, in the main graph only


def _layer_norm(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    _layer_norm_ops(b, n.input[0], n.input[1], n.input[2] if len(n.input) > 2 else "", attr(n, "epsilon", 1e-5),
                    n.output[0])
    return ()


def _skip_simplified_layer_norm(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    bias = n.input[3] if len(n.input) > 3 else ""
    s = _skip_sum(b, n, bias)
    eps = attr(n, "epsilon", 1e-12)
    _rms_norm(b, s, n.input[2], eps, n.output[0])
    return (helper.make_node("SimplifiedLayerNormalization", [s, n.input[2]], [n.output[0]],
                             name=b.name("SimplifiedLayerNormalization"), axis=-1, epsilon=eps),)


def _simplified_layer_norm(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    _rms_norm(b, n.input[0], n.input[1], attr(n, "epsilon", 1e-5), n.output[0])
    return ()


def _split_sizes(g: Graph, n: onnx.NodeProto) -> Optional[list[int]]:
    """The sizes of a Split's outputs along its axis: its `split` input (opset 13 on) or attribute, else equal
    parts of a static dim (`num_outputs` from opset 18: ceil-sized, the last one smaller); None where they
    are not constants or do not fit a static dim."""
    shape = g.tensors[n.input[0]].shape or ()
    axis = attr(n, "axis", 0)
    if not -len(shape) <= axis < len(shape):
        return None
    dim = shape[axis]
    count = len(n.output)
    if len(n.input) > 1 and n.input[1]:
        given = g.constants.get(n.input[1])
        sizes = None if given is None else [int(v) for v in np.asarray(given).reshape(-1)]
    elif attr(n, "split", None) is not None:
        sizes = [int(v) for v in attr(n, "split", None)]
    elif not isinstance(dim, int):
        return None
    else:  # (ORT refuses a count whose ceil-sized parts leave the last one empty: so do we)
        part = -(-dim // count)
        if part * (count - 1) >= dim and count > 1:
            return None
        sizes = [min(part, dim - part * k) for k in range(count)]
    if sizes is None or len(sizes) != count or any(v < 0 for v in sizes) \
            or (isinstance(dim, int) and sum(sizes) != dim):
        return None
    return sizes


def _split(b: _Builder, n: onnx.NodeProto) -> tuple[onnx.NodeProto, ...]:
    """One Slice per output, named as it (an output nothing reads gets none)."""
    x = n.input[0]
    axis = attr(n, "axis", 0)
    start = 0
    for out, size in zip(n.output, _split_sizes(b.g, n) or ()):
        if out and b.g.used(out):
            shape = tuple(size if k == axis % len(b.tensors[x].shape) else d
                          for k, d in enumerate(b.tensors[x].shape))
            b.op("Slice", [x, b.ints([start]), b.ints([start + size]), b.ints([axis])], x, out=out, shape=shape)
        start += size
    return ()


_EXPAND = {"Gelu": _gelu, "BiasGelu": _bias_gelu, "FastGelu": _fast_gelu, "QuickGelu": _quick_gelu,
           "SkipLayerNormalization": _skip_layer_norm,
           "SkipSimplifiedLayerNormalization": _skip_simplified_layer_norm,
           "SimplifiedLayerNormalization": _simplified_layer_norm, "LayerNormalization": _layer_norm,
           # ONNX's (opset 23; torch's exporter writes it for F.rms_norm): the same function, its own
           # body's ops (x * 1 / sqrt(mean(x^2) + eps) in stash_type fp32, cast back, times scale)
           "RMSNormalization": _simplified_layer_norm, "Split": _split,
           # ONNX's (opset 23 on), in rewriter/onnx_attention.py and onnx_rotary.py
           "Attention": onnx_attention.expand, "RotaryEmbedding": onnx_rotary.expand}

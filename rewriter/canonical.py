"""Canonicalization before the search; each pass gives the same function in a form the search fuses.

* `fold_runtime_shapes`: Reshape targets computed at run time from Shape/Gather/Concat chains (as the
  TorchScript exporter emits them, or torch.export with `allowzero=1`) become constants wherever the inferred
  shapes determine them, if need be for a source further back through a chain of reshapes; so do Expand
  targets whose entries other than 1 are static (Llama's repeat_kv for grouped-query attention).
  (`rewriter.iota.fold_iota_gathers` runs first: Gathers at a tensor's own index become Reshapes.)
* `unflatten_gemms`: a Gemm between a Reshape that flattens the leading dims and one that restores them
  (GPT-2's Conv1D: `x.view(-1, K) @ W + b`, then `.view(*lead, N)`) becomes MatMul (+ Add of the bias) on
  the unflattened tensor, so the GEMM's consumers are its direct epilogue and no Reshape with a target
  computed at run time sits between them. Where the flattening Reshape also merges static inner dims into K
  (torch.export's `[B, S, H, D] -> [B*S, H*D]` before the attention's output projection), a Reshape to
  `[B, S, H*D]` takes its place.
* `fold_small_values`: small tensors computed from constants and static dims (a Slice's end read through
  Shape, a ConstantOfShape of a constant) become constants, as ORT's constant folding makes them.
* `explicit_auto_pads`: a Conv's or pool's auto_pad SAME_UPPER / SAME_LOWER becomes the `pads` ORT computes
  for it, where they do not depend on a symbolic image size (TF-converted models, HF's EfficientNet).
* `fold_conv_pads`: a zero Pad of the spatial dims feeding only Convs (the TF-style "same" padding HF's
  MobileNetV2 and EfficientNet compute from constants) becomes the Convs' own `pads` (an auto_pad VALID
  Conv's too), as ORT's PadFusion does after its
  constant folding; otherwise a Conv we fuse would leave ORT a Pad kernel it never ran before.
* `bypass_noop_expands`: an Expand to the shape its input already has is bypassed (its host-computed
  target goes with it).
* `fold_constant_identities`: an Identity of a constant (the TorchScript exporter's way of sharing equal
  weights, such as zero biases) is bypassed, so its consumers see a constant, as ORT's constant folding
  gives them.
* `bypass_lone_concats`: a Concat of one input (a copy ORT would run) is bypassed.
* `sink_constant_expands`: an element-wise op on a constant broadcast by an Expand to a run-time shape (and on
  other constants) computes on the constant itself, the Expand after it; so the op folds with the constants
  (torch.export's all-true attention mask of a ViT: `Where(Expand(c, [B, 1, S, S]), 0, -inf)`).
* `bypass_broadcast_expands`: an Expand whose every reader broadcasts its output to a shape it would reach from
  the Expand's input as well goes, its readers reading the input (an additive mask: the scores broadcast it
  anyway).
* `merge_regrouped_transposes`: a Reshape that merges adjacent dims, a Transpose of the merged tensor and a
  Reshape that splits the dims again (torch.export's scaled_dot_product_attention transposes K so:
  `[B, H, S, D] -> [B*H, S, D] -> [B*H, D, S] -> [B, H, D, S]`) become the one Transpose they compute.
* `rewriter.gemm_packing`: sibling MatMuls packed into one, gated pairs interleaved (run after these).
Shape computations left without consumers are removed. BatchNormalization: `rewriter.batchnorm`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.rewriter import _proto
from ortfuse.rewriter.attrs import attr
from ortfuse.rewriter.constant_cones import connected_groups, constant_cone, draws, fixed_constant
from ortfuse.rewriter.graph import Dim, Graph, TensorInfo
from ortfuse.rewriter.shapes import assemble, dim_names, merge_tainted, merged_sizes


def _static_target(in_shape: tuple[Dim, ...], out_shape: tuple[Dim, ...]) -> Optional[list[int]]:
    """A constant Reshape target giving `out_shape` from `in_shape` (0 copies the input dim at the
    same position, one -1 is inferred), or None when the shapes do not determine one."""
    target: list[int] = []
    for k, d in enumerate(out_shape):
        if isinstance(d, int):
            if d == 0:
                return None  # 0 means "copy" in Reshape's default mode
            target.append(d)
        elif k < len(in_shape) and in_shape[k] == d:
            target.append(0)
        else:
            target.append(-1)
    return target if target.count(-1) <= 1 else None


def _one_entry_unknown(g: Graph, node: onnx.NodeProto) -> Optional[list[int]]:
    """A Reshape target built by a Concat whose parts are constants but one entry computed at run time
    (MobileViT's unfold: [batch * C * rows, patch, cols, patch], the first entry from the batch through
    Shape, Mul and Cast): that entry is -1, which Reshape infers to the same value (the element count is the
    input's), and shape inference can then follow the batch through it. None where the target is not so."""
    p = g.producer.get(node.input[1])
    cat = g.nodes[p] if p is not None else None
    if cat is None or cat.op_type != "Concat" or cat.domain not in ("", "ai.onnx"):
        return None
    target: list[int] = []
    unknown = 0
    for x in cat.input:
        if x in g.constants:
            target.extend(int(v) for v in np.asarray(g.constants[x]).reshape(-1))
        elif (g.tensors.get(x) is not None and g.tensors[x].shape == (1,)):
            target.append(-1)
            unknown += 1
        else:
            return None
    zero_means_zero = any(a.name == "allowzero" and a.i for a in node.attribute)
    if unknown != 1 or target.count(-1) != 1 or (zero_means_zero and 0 in target):
        return None
    return target


RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")  # row-major reshapes: any chain of them is one


def _reshape_sources(g: Graph, t: str) -> list[str]:
    """t, then the inputs of the reshape-like ops that produce it one after another, as long as each
    intermediate is read by nothing else (so it goes once a Reshape reads further back)."""
    out = [t]
    while len(g.consumers.get(out[-1], ())) == 1 and out[-1] in g.producer:
        node = g.nodes[g.producer[out[-1]]]
        if node.op_type not in RESHAPES or node.domain not in ("", "ai.onnx"):
            break
        out.append(node.input[0])
    return out


def trusted_dim(d: str, trusted: frozenset[str]) -> bool:
    """A symbolic dim every tensor inferred with it has at run time: a trusted graph-input dim
    (`iota.trusted_dims`) or an expression of such dims only (a KV cache's 'past + seq')."""
    names = dim_names(d, trusted)
    return d in trusted or (bool(names) and names <= trusted)


def _static_expand_target(g: Graph, node: onnx.NodeProto, trusted: frozenset[str],
                          merged: frozenset[int]) -> Optional[list[int]]:
    """A constant Expand target giving the inferred output shape: 1 where the input has the output's dim
    (a symbolic one only if every tensor with it has that size at run time: `trusted_dim`), the output's
    static dim where the input has 1 or no dim; None otherwise (Llama's repeat_kv: [B, KV, 1, S, D] to
    [B, KV, R, S, D] is [1, 1, R, 1, 1])."""
    src, out = g.tensors.get(node.input[0]), g.tensors.get(node.output[0])
    if src is None or out is None or src.shape is None or out.shape is None or len(out.shape) < len(src.shape):
        return None
    lead = len(out.shape) - len(src.shape)
    target: list[int] = []
    for k, d in enumerate(out.shape):
        s = src.shape[k - lead] if k >= lead else None
        if s == d and (trusted_dim(d, trusted) if isinstance(d, str) else d not in merged or d == 1):
            target.append(1)
        elif isinstance(d, int) and s in (None, 1):
            target.append(d)
        else:
            return None
    return target


def fold_runtime_shapes(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Reshapes and Expands whose target became a constant). `g` is left untouched.
    Where the Reshape's own input does not determine a target, it may read further back through a chain of
    reshapes (transformers 5's masks flatten to [-1] first) and take the target from there."""
    from ortfuse.rewriter.iota import trusted_dims

    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    folded = 0
    trusted, merged = trusted_dims(g), merged_sizes(g)
    tainted = merge_tainted(g) if merged else frozenset()
    for node in m.graph.node:
        if node.op_type == "Expand" and node.domain in ("", "ai.onnx") and node.input[1] not in g.constants:
            target = _static_expand_target(g, node, trusted, merged)
            if target is not None:
                name = f"{node.output[0]}__ortfuse_shape"
                m.graph.initializer.append(numpy_helper.from_array(np.asarray(target, np.int64), name))
                node.input[1] = name
                folded += 1
            continue
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        if node.input[1] in g.constants:
            continue
        out = g.tensors.get(node.output[0])
        if out is None or out.shape is None:
            continue
        # an output computed from where inference merged a symbolic dim into a size: its static dims may be
        # that size, or built from it (a product), where the run has 1 (a broadcast); its target stays
        suspect = merged and (tainted is None or node.output[0] in tainted) and \
            any(isinstance(d, int) and d != 1 for d in out.shape)
        target = None
        for src in () if suspect else _reshape_sources(g, node.input[0]):
            info = g.tensors.get(src)
            target = None if info is None or info.shape is None else _static_target(info.shape, out.shape)
            if target is not None:
                node.input[0] = src
                break
        if target is None:
            target = _one_entry_unknown(g, node)
        if target is None:
            continue
        name = f"{node.output[0]}__ortfuse_shape"
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(target, np.int64), name))
        node.input[1] = name
        # torch.export writes allowzero=1 with targets of actual sizes; the constant's 0 entries copy dims
        # (the shapes say the output dim is the input's there, so a 0-sized dim still stays 0)
        keep = [a for a in node.attribute if a.name != "allowzero"]
        del node.attribute[:]
        node.attribute.extend(keep)
        folded += 1
    if not folded:
        return g, 0
    tensors = dict(g.tensors)
    for t in m.graph.initializer[len(g.model.graph.initializer):]:
        tensors[t.name] = TensorInfo(t.name, onnx.TensorProto.INT64, tuple(t.dims))
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), folded


def _unflatten_plan(g: Graph, i: int) -> Optional[tuple[str, int, int]]:
    """(x, index of the restoring Reshape, how many trailing dims of x form K) when Gemm node i computes
    `Reshape(x) @ B (+ C)` with x of shape (*lead, *inner), prod(inner) = K, flattened to (P, K), and its only
    consumer reshapes the result back to (*lead, N). inner is x's last dim alone (GPT-2's Conv1D through
    TorchScript) or several static dims (torch.export merges the attention heads in the same Reshape)."""
    n = g.nodes[i]
    if n.op_type != "Gemm" or n.domain not in ("", "ai.onnx") or attr(n, "transA", 0) \
            or attr(n, "alpha", 1.0) != 1.0 or attr(n, "beta", 1.0) != 1.0:
        return None
    flat = g.producer.get(n.input[0])
    y = n.output[0]
    users = g.consumers.get(y, ())
    if flat is None or g.nodes[flat].op_type != "Reshape" or len(users) != 1 or y in g.graph_outputs:
        return None
    restore = g.nodes[users[0]]
    if restore.op_type != "Reshape" or restore.input[0] != y:
        return None
    x = g.nodes[flat].input[0]
    shapes = [g.tensors[t].shape if t in g.tensors else None for t in (x, n.input[0], y, restore.output[0])]
    if any(s is None for s in shapes):
        return None
    xs, fs, ys, rs = shapes
    if len(fs) != 2 or len(rs) < 2 or rs[-1] != ys[1]:
        return None
    lead, inner = tuple(rs[:-1]), tuple(xs[len(rs) - 1:])
    if not inner or tuple(xs[:len(lead)]) != lead or not all(isinstance(d, int) for d in inner) \
            or fs[1] != int(np.prod(inner)):
        return None
    if len(n.input) > 2 and n.input[2]:
        cs = g.tensors[n.input[2]].shape if n.input[2] in g.tensors else None
        if cs is None or tuple(cs) not in ((ys[1],), (1, ys[1])):  # a bias along N broadcasts the same in N-D
            return None
    return x, users[0], len(inner)


def unflatten_gemms(g: Graph, as_they_are: frozenset[str] = frozenset()) -> tuple[Graph, int]:
    """(new graph, number of Gemms rewritten); `as_they_are`: outputs of Gemms left as they are. `g` is left
    untouched."""
    plans = {i: p for i in range(len(g.nodes))
             if g.nodes[i].output[0] not in as_they_are and (p := _unflatten_plan(g, i)) is not None}
    if not plans:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    restores = {p[1] for p in plans.values()}
    new_nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(m.graph.node):
        if i in restores:
            continue
        if i not in plans:
            new_nodes.append(node)
            continue
        x, r, n_inner = plans[i]
        out = g.nodes[r].output[0]
        if n_inner > 1:  # x's inner dims become K first: (*lead, *inner) -> (*lead, K), lead dims copied
            lead, k = g.tensors[x].shape[:-n_inner], int(np.prod(g.tensors[x].shape[-n_inner:]))
            xk, target = f"{x}__ortfuse_k{i}", f"{x}__ortfuse_k{i}_shape"
            m.graph.initializer.append(numpy_helper.from_array(np.asarray([0] * len(lead) + [k], np.int64), target))
            tensors[target] = TensorInfo(target, onnx.TensorProto.INT64, (len(lead) + 1,))
            tensors[xk] = TensorInfo(xk, g.tensors[x].dtype, (*lead, k))
            new_nodes.append(onnx.helper.make_node("Reshape", [x, target], [xk], name=f"{node.name}/merge"))
            x = xk
        b = node.input[1]
        if attr(node, "transB", 0):
            bt = f"{b}__ortfuse_T{i}"
            new_nodes.append(onnx.helper.make_node("Transpose", [b], [bt], name=f"{node.name}/transB", perm=[1, 0]))
            shape = g.tensors[b].shape
            tensors[bt] = TensorInfo(bt, g.tensors[b].dtype, None if shape is None else tuple(reversed(shape)))
            b = bt
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        mm = f"{out}__ortfuse_mm" if bias else out
        new_nodes.append(onnx.helper.make_node("MatMul", [x, b], [mm], name=f"{node.name}/MatMul"))
        if bias:
            tensors[mm] = TensorInfo(mm, g.tensors[out].dtype, g.tensors[out].shape)
            new_nodes.append(onnx.helper.make_node("Add", [mm, bias], [out], name=f"{node.name}/bias"))
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), len(plans)


def remove_dead(m: onnx.ModelProto) -> None:
    """Drop nodes none of whose outputs is used (in reverse order, so whole chains go), and initializers
    nothing reads. Initializers that are also graph inputs (IR < 4 style) stay: the interface is kept."""
    used: set[str] = {o.name for o in m.graph.output} | {v.name for v in m.graph.input}
    alive: list[onnx.NodeProto] = []
    for node in reversed(list(m.graph.node)):
        if any(o and o in used for o in node.output) or _has_side_graph(node):
            alive.append(node)
            used.update(_proto.node_reads(node))  # names read inside subgraphs (at any depth) stay alive
    if len(alive) < len(m.graph.node):
        del m.graph.node[:]
        m.graph.node.extend(reversed(alive))
    # deleted in place: extending a repeated field copies each message, a model's weights included
    for k in reversed([k for k, t in enumerate(m.graph.initializer) if t.name not in used]):
        del m.graph.initializer[k]


def _has_side_graph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute) \
        and not node.output


MAX_CHAIN = 32  # nodes evaluated to find one constant (a pad computation), more is not a small constant


def _evaluate(g: Graph, t: str) -> Optional[np.ndarray]:
    """Tensor t's value when it is a constant or computed from constants by at most MAX_CHAIN nodes of the
    default domain (evaluated once with onnx's reference evaluator), else None."""
    if t in g.constants:
        return np.asarray(g.constants[t])
    chain: dict[int, onnx.NodeProto] = {}
    leaves: set[str] = set()
    stack = [t]
    while stack:
        x = stack.pop()
        if x in g.constants:
            leaves.add(x)
            continue
        i = g.producer.get(x)
        if i is None or g.nodes[i].domain not in ("", "ai.onnx") or not g.nodes[i].input \
                or g.nodes[i].op_type.startswith("Random"):
            return None
        if i not in chain:
            chain[i] = g.nodes[i]
            if len(chain) > MAX_CHAIN:
                return None
            stack.extend(y for y in g.nodes[i].input if y)
    got = _run_nodes([chain[i] for i in sorted(chain)], {x: np.asarray(g.constants[x]) for x in sorted(leaves)},
                     [t], g.opset)
    return None if got is None else got[0]  # None: an op the reference evaluator lacks, the Pad simply stays


def _run_nodes(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], outputs: list[str],
               opset: int) -> Optional[list[np.ndarray]]:
    """`outputs` of `nodes` (topological order) on constant `inputs`, by onnx's reference evaluator; None
    where it cannot say (an op or a case it lacks)."""
    from onnx.reference import ReferenceEvaluator
    inits = [numpy_helper.from_array(v, x) for x, v in inputs.items()]
    graph = onnx.helper.make_graph(nodes, "const", [], [onnx.helper.make_empty_tensor_value_info(o) for o in outputs],
                                   inits)
    try:
        m = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
        return [np.asarray(v) for v in ReferenceEvaluator(m).run(None, {})]
    except Exception:
        return None


def _spatial_pads(g: Graph, pad: onnx.NodeProto) -> Optional[list[int]]:
    """[top, left, bottom, right] of a constant-mode zero Pad of a 4-D tensor's last two dims, else None."""
    x = g.tensors.get(pad.input[0])
    if x is None or x.shape is None or len(x.shape) != 4 or attr(pad, "mode", b"constant") != b"constant" \
            or len(pad.input) < 2 or (len(pad.input) > 3 and pad.input[3]):
        return None
    if len(pad.input) > 2 and pad.input[2]:
        value = _evaluate(g, pad.input[2])
        if value is None or value.size != 1 or float(value.reshape(-1)[0]) != 0.0:
            return None
    pads = _evaluate(g, pad.input[1])
    if pads is None or pads.shape != (8,):
        return None
    p = [int(v) for v in pads]
    if p[0] or p[1] or p[4] or p[5] or min(p) < 0:
        return None
    return [p[2], p[3], p[6], p[7]]


def _set_pads(node: onnx.NodeProto, pads: list[int]) -> None:
    """`node`'s padding made explicit: `pads` and no auto_pad."""
    keep = [a for a in node.attribute if a.name not in ("pads", "auto_pad")]
    del node.attribute[:]
    node.attribute.extend(keep + [onnx.helper.make_attribute("pads", pads)])


def _auto_pads(g: Graph, n: onnx.NodeProto) -> Optional[list[int]]:
    """[top, left, bottom, right] that ORT computes for a 2-D Conv's or pool's auto_pad SAME_UPPER / SAME_LOWER
    (total ceil(in / stride) - 1) * stride + kernel - in, the odd one at the end / the start), where they do not
    depend on a symbolic image size (stride 1, or a static size); None otherwise, or where ORT itself would not
    pad that way (dilations, which it refuses with SAME; a negative total; ceil_mode)."""
    mode = attr(n, "auto_pad", b"NOTSET")
    x = g.tensors.get(n.input[0])
    if mode not in (b"SAME_UPPER", b"SAME_LOWER") or x is None or x.shape is None or len(x.shape) != 4 \
            or attr(n, "pads") is not None or attr(n, "ceil_mode", 0):
        return None
    kernel = attr(n, "kernel_shape")
    if kernel is None and n.op_type == "Conv" and len(n.input) > 1 and n.input[1] in g.tensors:
        kernel = (g.tensors[n.input[1]].shape or ())[2:]
    strides = list(attr(n, "strides") or (1, 1))
    if kernel is None or len(kernel) != 2 or not all(isinstance(k, int) for k in kernel) or len(strides) != 2 \
            or any(d != 1 for d in attr(n, "dilations") or (1, 1)):
        return None
    merged = merged_sizes(g)  # a size shape inference merged a symbolic dim into may be 1 at run time
    tainted = merge_tainted(g) if merged else frozenset()
    suspect = merged if tainted is None or x.name in tainted else frozenset()
    head, tail = [], []
    for size, k, s in zip(x.shape[2:], kernel, strides):
        if s != 1 and (not isinstance(size, int) or size in suspect):
            return None
        total = k - 1 if s == 1 else (-(-size // s) - 1) * s + k - size
        if total < 0:
            return None
        first = (total + 1) // 2 if mode == b"SAME_LOWER" else total // 2
        head.append(first)
        tail.append(total - first)
    return head + tail


def explicit_auto_pads(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Convs and pools whose auto_pad SAME_UPPER / SAME_LOWER became explicit `pads`: the
    padding ORT computes for them, `_auto_pads`; TF-converted models and HF's EfficientNet write them).
    `g` is left untouched."""
    plans = {i: p for i, n in enumerate(g.nodes)
             if n.op_type in ("Conv", "MaxPool", "AveragePool") and n.domain in ("", "ai.onnx")
             and (p := _auto_pads(g, n)) is not None}
    if not plans:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    for i, p in plans.items():
        _set_pads(m.graph.node[i], p)
    return assemble(m, dict(g.tensors), g.opset, g.hint_overrides), len(plans)


def fold_conv_pads(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Pads folded into the Convs they feed). `g` is left untouched."""
    plans: dict[int, list[int]] = {}
    for i, n in enumerate(g.nodes):
        if n.op_type != "Pad" or n.domain not in ("", "ai.onnx") or n.output[0] in g.graph_outputs:
            continue
        users = g.consumers.get(n.output[0], ())
        if not users or any(g.nodes[c].op_type != "Conv" or g.nodes[c].input[0] != n.output[0]
                            or attr(g.nodes[c], "auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID")
                            or (attr(g.nodes[c], "auto_pad", b"NOTSET") == b"VALID" and attr(g.nodes[c], "pads"))
                            for c in users):
            continue
        p = _spatial_pads(g, n)
        if p is not None:
            plans[i] = p
    if not plans:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    for i, p in plans.items():
        pad = g.nodes[i]
        for c in g.consumers[pad.output[0]]:
            conv = m.graph.node[c]
            _set_pads(conv, [a + b for a, b in zip(attr(conv, "pads", [0, 0, 0, 0]), p)])
            conv.input[0] = pad.input[0]
    remove_dead(m)
    return assemble(m, dict(g.tensors), g.opset, g.hint_overrides), len(plans)


# ---- small values computed from static shapes -----------------------------------------------------------

MAX_SMALL_VALUE = 64  # elements: a folded value is a shape, axes or bounds, never data
def shape_dims(g: Graph, shape_node: onnx.NodeProto) -> Optional[tuple[Dim, ...]]:
    """The (inferred, possibly symbolic) dims a Shape node outputs, its start/end attributes applied."""
    x = g.tensors.get(shape_node.input[0])
    if x is None or x.shape is None:
        return None
    start, end = attr(shape_node, "start", 0), attr(shape_node, "end", len(x.shape))
    return tuple(x.shape[slice(start, end)])  # negative and out-of-range bounds clamp as the spec says


def _static_dims(g: Graph, shape_node: onnx.NodeProto, merged: frozenset[int]) -> Optional[list[Optional[int]]]:
    """The dims a Shape node reports (`shape_dims`): an int where static, None where symbolic or of a size
    shape inference merged a symbolic dim into (1 at run time, maybe) where the tensor is computed from where
    that merge happened (`shapes.merge_tainted`)."""
    dims = shape_dims(g, shape_node)
    if dims is None:
        return None
    tainted = merge_tainted(g) if merged else frozenset()
    suspect = merged if tainted is None or shape_node.input[0] in tainted else frozenset()
    return [d if isinstance(d, int) and d not in suspect else None for d in dims]


def _shape_read(g: Graph, node: onnx.NodeProto, merged: frozenset[int]) -> Optional[np.ndarray]:
    """The value of a Shape node, or of a Gather or Slice of one at constant indices (TorchScript's
    `q.size(-1)` for scaled_dot_product_attention's default scale: Slice(Shape(q), [-1], [max])), when every
    dim it reads is static; else None."""
    if node.op_type == "Shape":
        dims = _static_dims(g, node, merged)
        return None if dims is None or None in dims else np.asarray(dims, np.int64)
    src = g.nodes[g.producer[node.input[0]]] if node.op_type in ("Gather", "Slice") and node.input[0] in g.producer \
        else None
    if src is None or src.op_type != "Shape":
        return None
    if node.op_type == "Slice":
        return _sliced_shape(g, node, _static_dims(g, src, merged))
    if not fixed_constant(g, node.input[1]) or attr(node, "axis", 0) != 0:
        return None
    dims = _static_dims(g, src, merged)
    idx = np.asarray(g.constants[node.input[1]])
    if dims is None or idx.dtype.kind not in "iu" or not np.all((-len(dims) <= idx) & (idx < len(dims))):
        return None
    picked = [dims[int(k)] for k in idx.reshape(-1)]
    return None if None in picked else np.asarray(picked, np.int64).reshape(idx.shape)


def vector_slice(g: Graph, node: onnx.NodeProto) -> Optional[slice]:
    """Slice(v, [start], [end][, [0]][, [1]]) of a 1-D tensor (a shape) with constant arguments, as the Python
    slice that picks the same entries (ONNX clamps a unit-step Slice's bounds as Python does); else None."""
    args = [np.asarray(g.constants[x]).reshape(-1) if fixed_constant(g, x) else None for x in node.input[1:5]]
    if len(node.input) < 3 or any(a is None or a.size != 1 or a.dtype.kind not in "iu"
                                  for x, a in zip(node.input[1:5], args) if x):
        return None
    if len(args) > 2 and node.input[3] and int(args[2][0]) not in (0, -1) \
            or len(args) > 3 and node.input[4] and int(args[3][0]) != 1:
        return None
    return slice(int(args[0][0]), int(args[1][0]))


def _sliced_shape(g: Graph, node: onnx.NodeProto, dims: Optional[list[Optional[int]]]) -> Optional[np.ndarray]:
    """A Shape's `dims` picked by a Slice of constant arguments (`vector_slice`), where every dim it picks is
    static; else None."""
    at = vector_slice(g, node)
    picked = dims[at] if dims is not None and at is not None else [None]
    return None if None in picked else np.asarray(picked, np.int64)


def fold_small_values(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of constants that replace computed tensors). A tensor of at most MAX_SMALL_VALUE elements
    computed from constants and static dims (read through Shape, or a Gather or Slice of one) is a constant, as ORT's
    constant folding makes it at session start: TorchScript's `x[..., : x.shape[-1] // 2]` in rotary
    embeddings (Shape, Gather, Div, Cast, Unsqueeze) becomes a constant Slice end the search computes in a
    kernel, and what ORT would fold anyway (a ConstantOfShape of a constant) is not taken for device data by
    the search. `g` is left untouched."""
    merged = merged_sizes(g)
    known: dict[str, np.ndarray] = {}

    def small(t: str) -> bool:
        info = g.tensors.get(t)
        return info is not None and info.shape is not None and all(isinstance(d, int) for d in info.shape) \
            and int(np.prod(info.shape)) <= MAX_SMALL_VALUE

    for n in g.nodes:  # topological order: a node's inputs are known before it is reached
        outs = [o for o in n.output if o]
        if n.domain not in ("", "ai.onnx") or not outs or not n.input or draws(n.op_type) \
                or any(o in g.graph_outputs or o in g.constants or not small(o) for o in outs) \
                or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            continue
        if n.op_type in ("Shape", "Gather", "Slice"):
            v = _shape_read(g, n, merged)
            if v is not None:
                known[outs[0]] = v
                continue
        args = {x: known[x] if x in known else np.asarray(g.constants[x]) for x in dict.fromkeys(n.input)
                if x and (x in known or fixed_constant(g, x))}  # (not an initializer a user may feed)
        if len(args) != len({x for x in n.input if x}):
            continue
        res = _run_nodes([n], args, list(n.output), g.opset)
        if res is not None and len(res) == len(n.output):
            known.update((o, v) for o, v in zip(n.output, res) if o)
    if not known:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    names: dict[str, str] = {}
    for node in m.graph.node:
        if all(o in known for o in node.output if o):
            continue  # folded itself: goes with the dead code
        for k, x in enumerate(node.input):
            if x in known:
                if x not in names:
                    names[x] = f"{x}__ortfuse_value"
                    v = known[x]
                    if x in g.tensors:
                        v = v.astype(onnx.helper.tensor_dtype_to_np_dtype(g.tensors[x].dtype))
                    m.graph.initializer.append(numpy_helper.from_array(v, names[x]))
                    tensors[names[x]] = TensorInfo(names[x], onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                node.input[k] = names[x]
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), len(names)


# ---- subgraphs of constants (weights computed at run time) -------------------------------------------------

MAX_FOLD_GROWTH = 1 << 16  # bytes a fold may add to the model (values that keep their sources alive)
MAX_FOLD_SOURCE = 1 << 30  # bytes of constants one fold may read, and of any tensor it makes (all in memory)
# ORT keeps QDQ pairs for its quantized kernels; an Identity of a constant is bypassed, not copied
# (`fold_constant_identities`: a tiny model's copies would fit the growth limit where a real model's would not)
_NOT_FOLDED = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Identity"})


def fold_constant_subgraphs(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of constants that replace computed tensors). Tensors computed from constants alone
    (HF BiT's weight standardization, a weight norm, a Cast of a weight) become constants, as ORT's constant
    folding makes them when a session starts, and computed by ORT's CPU kernels (those folding runs), so the
    values are the ones stock ORT runs with: the search sees constant weights where it saw computed ones. Per
    connected group of such nodes, only where the model grows by at most MAX_FOLD_GROWTH bytes (a transposed
    copy of a tied embedding, or a mask broadcast from a small constant, stays computed): checked on the
    inferred sizes before anything runs, and on the values after. Left alone: Quantize/DequantizeLinear (ORT
    keeps them for its quantized kernels), Identity (`fold_constant_identities` bypasses it), initializers a
    user may override (listed as graph inputs, IR 4 on), tensors read inside an If/Loop body or of other than
    tensor type. `g` is left untouched."""
    listed = {v.name for v in g.model.graph.input}
    nodes = constant_cone(g, lambda n: n.op_type not in _NOT_FOLDED and all(
        o not in g.graph_outputs and _static_bytes(g, o) is not None for o in n.output if o))
    if not nodes:
        return g, 0
    computed = {o: i for i in nodes for o in g.nodes[i].output if o}  # tensor -> the node making it
    chosen = set(nodes)
    plans = [p for members in connected_groups(g, nodes, through_constants=True)
             if (p := _fold_plan(g, members, chosen, computed, listed))]
    folded: dict[str, np.ndarray] = {}
    if plans:  # one ORT session for every group; should ORT fail one (or they be too big together), each alone
        leaves = sorted({x for p in plans for x in p.leaves})
        together = _run_on_ort([g.nodes[i] for p in plans for i in p.members],
                               {x: np.asarray(g.constants[x]) for x in leaves}, [t for p in plans for t in p.frontier],
                               g) if sum(np.asarray(g.constants[x]).nbytes for x in leaves) <= MAX_FOLD_SOURCE else None
        for p in plans:
            values = {t: together[t] for t in p.frontier} if together is not None else \
                _run_on_ort([g.nodes[i] for i in p.members], {x: np.asarray(g.constants[x]) for x in p.leaves},
                            list(p.frontier), g)
            if values is not None and all(isinstance(v, np.ndarray) for v in values.values()) \
                    and sum(v.nbytes for v in values.values()) - p.freed <= MAX_FOLD_GROWTH:
                folded.update(values)
    if not folded:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    taken = set(g.tensors) | {t.name for t in m.graph.initializer} | {o for n in m.graph.node for o in n.output}
    names: dict[str, str] = {}
    for t, v in folded.items():
        name, k = f"{t}__ortfuse_value", 1
        while name in taken:
            name, k = f"{t}__ortfuse_value{k}", k + 1
        taken.add(name)
        names[t] = name
        m.graph.initializer.append(numpy_helper.from_array(v, name))
        tensors[name] = TensorInfo(name, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), tuple(v.shape))
    for node in m.graph.node:
        for k, x in enumerate(node.input):
            if x in names:
                node.input[k] = names[x]
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), len(folded)


def _static_bytes(g: Graph, t: str) -> Optional[int]:
    """Bytes of tensor t by its inferred static shape and element type; None where unknown (or not a tensor)."""
    info = g.tensors.get(t)
    if info is None or info.shape is None or not all(isinstance(d, int) for d in info.shape) or not info.dtype \
            or info.dtype in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    return int(np.prod(info.shape, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(info.dtype).itemsize


@dataclass(frozen=True)
class _FoldPlan:
    """One connected group of constant-only nodes to evaluate: its nodes, the tensors read outside it, the
    constants it reads, and the bytes of those only it reads (which go with it)."""
    members: tuple[int, ...]
    frontier: tuple[str, ...]
    leaves: tuple[str, ...]
    freed: int


def _fold_plan(g: Graph, members: list[int], chosen: set[int], computed: dict[str, int],
               listed: set[str]) -> Optional[_FoldPlan]:
    """The group's plan where folding it adds at most MAX_FOLD_GROWTH bytes to the model by the inferred sizes
    (less the constants only the group reads, which go; not those listed as graph inputs, which stay) and no
    tensor it makes exceeds MAX_FOLD_SOURCE; None otherwise (checked again on the computed values)."""
    inside = set(members)
    outs = [o for i in members for o in g.nodes[i].output if o]
    frontier = [t for t in outs if any(k not in chosen for k in g.consumers.get(t, ()))]
    if not frontier or any(t not in g.nodes[k].input for t in frontier for k in g.consumers.get(t, ())):
        return None  # nothing read outside, or a read inside an If/Loop body (only inputs are renamed)
    leaves = sorted({x for i in members for x in g.nodes[i].input if x and x not in computed})
    freed = sum(np.asarray(g.constants[x]).nbytes for x in leaves
                if x not in listed and x not in g.graph_outputs and set(g.consumers.get(x, ())) <= inside)
    sizes = [_static_bytes(g, o) or 0 for o in outs]
    if sum(_static_bytes(g, t) or 0 for t in frontier) - freed > MAX_FOLD_GROWTH \
            or max(sizes, default=0) > MAX_FOLD_SOURCE \
            or sum(np.asarray(g.constants[x]).nbytes for x in leaves) > MAX_FOLD_SOURCE:
        return None
    return _FoldPlan(tuple(members), tuple(frontier), tuple(leaves), freed)


def _run_on_ort(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], outputs: list[str],
                g: Graph) -> Optional[dict[str, np.ndarray]]:
    """`outputs` of `nodes` on constant `inputs`, by ONNX Runtime's CPU kernels with its graph optimizations off
    (what its constant folding runs); None where ORT cannot (an op it lacks on the CPU). bf16, for which the CPU
    EP has almost no kernels (so ORT itself leaves such nodes to run on the GPU), runs as its fp32 shadow: each
    op in fp32, each bf16 result rounded to bf16, as the CUDA EP computes them op by op."""
    import onnxruntime as ort

    from ortfuse.bf16_shadow import computes_in_bf16, shadow

    graph = onnx.helper.make_graph(nodes, "fold", [], [onnx.helper.make_empty_tensor_value_info(o) for o in outputs],
                                   [numpy_helper.from_array(v, x) for x, v in inputs.items()])
    m = onnx.helper.make_model(graph, opset_imports=list(g.model.opset_import))
    m.ir_version = _proto.MAX_IR_VERSION
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        sh = None
        if computes_in_bf16(m):
            sh = shadow(m, {o: g.tensors[o].dtype for n in nodes for o in n.output if o in g.tensors}, "fold")
            m = sh.model
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        got = sess.run(outputs, {})
        return {o: sh.restored(o, v) if sh is not None else v for o, v in zip(outputs, got)}
    except Exception:  # noqa: BLE001 -- ORT refused or failed: the nodes simply stay
        return None


# ---- Identity of a constant ---------------------------------------------------------------------------------

def fold_constant_identities(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Identities bypassed). `g` is left untouched."""
    alias: dict[str, str] = {}
    for n in g.nodes:
        if n.op_type != "Identity" or n.domain not in ("", "ai.onnx") or n.output[0] in g.graph_outputs:
            continue
        src = alias.get(n.input[0], n.input[0])
        users = g.consumers.get(n.output[0], ())
        if src in g.constants and all(n.output[0] in g.nodes[c].input for c in users):  # no subgraph reads
            alias[n.output[0]] = src
    return _bypass(g, alias)


def bypass_lone_concats(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Concats bypassed): a Concat of a single input is a copy, which ORT runs as a kernel.
    transformers' DynamicCache traces them: each layer's key and value when the cache starts empty (a CausalLM
    exported as it comes), and the first layer's cached key read only by Shape when it does not (at a past of
    512 and batch 32, a 3 MB copy for a shape). Its consumers read the input. `g` is left untouched."""
    alias: dict[str, str] = {}
    for n in g.nodes:
        ins = [x for x in n.input if x]
        if n.op_type != "Concat" or n.domain not in ("", "ai.onnx") or len(ins) != 1 \
                or n.output[0] in g.graph_outputs:
            continue
        users = g.consumers.get(n.output[0], ())
        if all(n.output[0] in g.nodes[c].input for c in users):  # no subgraph reads it
            alias[n.output[0]] = alias.get(ins[0], ins[0])
    return _bypass(g, alias)


def _bypass(g: Graph, alias: dict[str, str]) -> tuple[Graph, int]:
    """Consumers of each tensor in `alias` read its value instead; what is left unread goes."""
    if not alias:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    _proto.read_instead(m.graph.node, alias)
    remove_dead(m)
    return assemble(m, dict(g.tensors), g.opset, g.hint_overrides), len(alias)


# ---- Expand to the shape its input already has -------------------------------------------------------------

def bypass_noop_expands(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Expands bypassed): an Expand whose input already has the output's (inferred,
    possibly symbolic) shape copies it. transformers 5 expands its mask to [B, 1, S, S] after an And that
    broadcast it there already, with the target computed on the host by a dozen shape ops, which go too."""
    alias: dict[str, str] = {}
    # sizes shape inference merged a symbolic dim into: an input dim of that size may be the symbol, 1 at
    # run time, which the Expand broadcasts
    merged = merged_sizes(g)
    for n in g.nodes:
        if n.op_type != "Expand" or n.domain not in ("", "ai.onnx") or n.output[0] in g.graph_outputs:
            continue
        src, out = g.tensors.get(n.input[0]), g.tensors.get(n.output[0])
        users = g.consumers.get(n.output[0], ())
        if src is None or out is None or src.shape is None or src.shape != out.shape or src.dtype != out.dtype:
            continue
        if any(isinstance(d, int) and d in merged for d in src.shape):
            continue
        if all(n.output[0] in g.nodes[c].input for c in users):  # no subgraph reads it
            alias[n.output[0]] = alias.get(n.input[0], n.input[0])
    return _bypass(g, alias)


# ---- Expands of constants: broadcast late, or not at all ------------------------------------------------------

# element-wise ops whose inputs broadcast multidirectionally (not PRelu: its slope broadcasts to X only)
BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where", "Equal",
                          "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "BitShift"})
_ELEMENTWISE_ON_CONSTANTS = BROADCASTING | {"Not", "Neg", "Abs", "Cast", "Sign", "Reciprocal", "Sqrt", "Exp", "Log"}


def broadcast(*shapes: tuple[Dim, ...]) -> Optional[tuple[Dim, ...]]:
    """Multidirectional broadcast of (possibly symbolic) shapes; None where dims neither match nor are 1."""
    rank = max(map(len, shapes), default=0)
    out: list[Dim] = []
    for k in range(rank):
        dims = {s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0} - {1}
        if len(dims) > 1:
            return None
        out.append(next(iter(dims)) if dims else 1)
    return tuple(out)


def sink_constant_expands(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of element-wise ops moved before the Expand that fed them): `op(Expand(c, s), k...)`
    with c and every k constant becomes `Expand(op(c, k...), s)` (the same values: broadcasting composes), and
    so on down a chain of such ops; `fold_constant_subgraphs` then folds each `op(c, k...)` as ORT would. Static
    shapes only on the constant side; `g` is left untouched."""
    default = ("", "ai.onnx")
    small: dict[str, tuple[str, str]] = {}  # tensor -> (the constant-side tensor it broadcasts, the target)
    for n in g.nodes:
        if n.op_type == "Expand" and n.domain in default and n.input[0] in g.constants \
                and n.input[1] not in g.constants and n.output[0] not in g.graph_outputs:
            small[n.output[0]] = (n.input[0], n.input[1])
    if not small:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    shape = {t: tuple(np.asarray(g.constants[t]).shape) for t, _ in small.values()}
    before: dict[int, list[onnx.NodeProto]] = {}
    for i, n in enumerate(g.nodes):
        ins = [x for x in n.input if x]
        fed = [x for x in ins if x in small]
        if n.op_type not in _ELEMENTWISE_ON_CONSTANTS or n.domain not in default or len(n.output) != 1 or not fed \
                or len({small[x][1] for x in fed}) != 1 or n.output[0] in g.graph_outputs \
                or not all(x in small or x in g.constants for x in ins) or n.output[0] not in g.tensors:
            continue
        sides = [small[x][0] if x in small else x for x in ins]
        out_shape = broadcast(*(shape[x] if x in shape else tuple(np.asarray(g.constants[x]).shape) for x in sides))
        if out_shape is None:
            continue
        out, target = n.output[0], small[fed[0]][1]
        t = f"{out}__ortfuse_unexpanded"
        c = onnx.NodeProto()
        c.CopyFrom(n)
        for k, x in enumerate(c.input):
            c.input[k] = small[x][0] if x in small else x
        c.output[0] = t
        c.name = f"{n.name or out}/unexpanded"
        tensors[t] = TensorInfo(t, g.tensors[out].dtype, out_shape)
        shape[t] = out_shape
        small[out] = (t, target)
        before[i] = [c, onnx.helper.make_node("Expand", [t, target], [out], name=f"{n.name or out}/expand")]
    if not before:
        return g, 0
    nodes = [x for i, n in enumerate(m.graph.node) for x in before.get(i, [n])]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), len(before)


def bypass_broadcast_expands(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Expands bypassed): an Expand whose every reader is an element-wise op of several
    inputs that broadcasts to the shape it would reach from the Expand's input as well (its other inputs
    broadcast there anyway) goes, its readers reading its input; with it go the host ops computing its target
    (torch.export's expanded all-true mask). Where some reader needs the Expand (or it is a graph output), a
    fused kernel indexes it as cheaply as its input, so it stays. A reader of several Expands is judged with
    all of those it bypasses bypassed. Not across sizes shape inference merged a symbolic dim into, nor
    symbolic dims it merged with another (either may be 1 at run time: `iota.broadcast_merged_dims`). `g` is
    left untouched."""
    shape = _unmerged_shapes(g)
    default = ("", "ai.onnx")

    def bypassable_reader(c: int, t: str) -> bool:
        k = g.nodes[c]
        return k.op_type in BROADCASTING and k.domain in default and len(k.output) == 1 and t in k.input

    gone = {n.output[0]: n.input[0] for n in g.nodes if n.op_type == "Expand" and n.domain in default
            and shape(n.input[0]) is not None and n.output[0] not in g.graph_outputs and g.consumers.get(n.output[0])
            and all(bypassable_reader(c, n.output[0]) for c in g.consumers[n.output[0]])}  # (not a subgraph read)
    while True:
        reads: dict[int, list[str]] = {}  # reader -> its inputs, the Expands that go bypassed
        kept: set[str] = set()
        for c in sorted({c for t in gone for c in g.consumers[t]}):
            ins = [gone.get(x, x) for x in g.nodes[c].input]
            shapes = [shape(x) for x in ins if x]
            out = shape(g.nodes[c].output[0])
            if out is not None and None not in shapes and broadcast(*shapes) == out:  # type: ignore[arg-type]
                reads[c] = ins
            else:
                kept |= {x for x in g.nodes[c].input if x in gone}
        if not kept:
            break
        gone = {t: x for t, x in gone.items() if t not in kept}
    if not gone:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    for c, ins in reads.items():
        del m.graph.node[c].input[:]
        m.graph.node[c].input.extend(ins)
    remove_dead(m)
    return assemble(m, dict(g.tensors), g.opset, g.hint_overrides), len(gone)


def _unmerged_shapes(g: Graph) -> Callable[[str], Optional[tuple[Dim, ...]]]:
    """A tensor's inferred shape where no dim of it is a size or a name shape inference merged a symbolic dim
    into (`merged_sizes`, `iota.broadcast_merged_dims`), else None: such a dim may really be 1, or another
    dim, at run time."""
    from ortfuse.rewriter.iota import broadcast_merged_dims

    sizes, names = merged_sizes(g), broadcast_merged_dims(g)

    def shape(t: str) -> Optional[tuple[Dim, ...]]:
        info = g.tensors.get(t)
        if info is None or info.shape is None or any(d in sizes if isinstance(d, int) else d in names
                                                     for d in info.shape):
            return None
        return info.shape
    return shape


# ---- Reshape, Transpose, Reshape back: one Transpose ----------------------------------------------------------

def _merge_groups(xs: tuple[Dim, ...], ys: tuple[Dim, ...]) -> Optional[list[tuple[int, ...]]]:
    """For a Reshape from `xs` to `ys` that merges one run of adjacent dims (or none), the dims of xs each
    dim of ys holds, else None. Equal leading dims keep their index in a row-major reshape (the element
    count to their right is the same on both sides), so do equal trailing ones; what lies between must be
    one dim of ys, the run's product (the reshape keeps the element count)."""
    n, m = len(xs), len(ys)
    a = 0
    while a < min(n, m) and xs[a] == ys[a]:
        a += 1
    b = 0
    while b < min(n, m) - a and xs[n - 1 - b] == ys[m - 1 - b]:
        b += 1
    if (n - a - b, m - a - b) == (0, 0):
        return [(i,) for i in range(n)]
    if m - a - b != 1 or n - a - b < 1:
        return None
    return [(i,) for i in range(a)] + [tuple(range(a, n - b))] + [(i,) for i in range(n - b, n)]


def merge_regrouped_transposes(g: Graph) -> tuple[Graph, int]:
    """(new graph, number of Reshape → Transpose → Reshape chains now one Transpose): where the first Reshape
    merges a run of adjacent dims (`_merge_groups`), and the second gives exactly the source's dims in the
    transposed order of the groups, the chain is Transpose(x) with the groups' perm expanded. The tensors
    between are read by nothing else. Shapes are the inferred ones, with no dim shape inference merged
    (`_unmerged_shapes`). `g` is left untouched."""
    shape = _unmerged_shapes(g)
    default = ("", "ai.onnx")

    def single_use(t: str, user: int) -> bool:
        return t not in g.graph_outputs and g.consumers.get(t, ()) == (user,)

    replaced: dict[int, onnx.NodeProto] = {}
    for i, split in enumerate(g.nodes):
        if split.op_type != "Reshape" or split.domain not in default:
            continue
        t_i = g.producer.get(split.input[0])
        transpose = None if t_i is None else g.nodes[t_i]
        if transpose is None or transpose.op_type != "Transpose" or transpose.domain not in default \
                or not single_use(transpose.output[0], i):
            continue
        r_i = g.producer.get(transpose.input[0])
        merge = None if r_i is None else g.nodes[r_i]
        if merge is None or merge.op_type != "Reshape" or merge.domain not in default \
                or not single_use(merge.output[0], t_i):
            continue
        xs, ys, zs = shape(merge.input[0]), shape(merge.output[0]), shape(split.output[0])
        if xs is None or ys is None or zs is None:
            continue
        groups = _merge_groups(xs, ys)
        perm = attr(transpose, "perm", None)
        perm = list(range(len(ys)))[::-1] if perm is None else list(perm)
        if groups is None or sorted(perm) != list(range(len(ys))):
            continue
        full = [x for p in perm for x in groups[p]]
        if full == list(range(len(xs))) or tuple(xs[x] for x in full) != zs:
            continue
        replaced[i] = onnx.helper.make_node("Transpose", [merge.input[0]], [split.output[0]],
                                            name=f"{transpose.name or transpose.output[0]}/regrouped", perm=full)
    if not replaced:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    nodes = [replaced.get(i, n) for i, n in enumerate(m.graph.node)]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    remove_dead(m)
    return assemble(m, dict(g.tensors), g.opset, g.hint_overrides), len(replaced)

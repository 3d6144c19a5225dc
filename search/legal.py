"""Legality: can a node join a fused kernel, and can two groups of nodes become one kernel?
Only correctness lives here; whether fusing pays is `search.cost`'s call."""
from __future__ import annotations

import collections
from typing import Container, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np
import onnx

from ortfuse.customops import scalar
from ortfuse.rewriter import _proto
from ortfuse.rewriter.ort_folding import folded_nodes
from ortfuse.rewriter.graph import Dim, Graph, per_graph
from ortfuse.search import conv, norm_fold, ops, pad, pool, resize
from ortfuse.search.plan import Region, Reject, Traffic


def _reduction_verdict(g: Graph, node: onnx.NodeProto, rank: int) -> Optional[str]:
    op = node.op_type
    if op.startswith("Reduce"):
        axes = g.axes(node)
        if axes == "runtime":
            return "axes computed at run time: left to ORT"
        if axes is None or len(axes) == 0:
            return "reduces over all axes; ortfuse fuses innermost-axis reductions only"
        if any(not -rank <= a < rank for a in axes):
            return f"axes {axes} out of range for a rank-{rank} tensor: left to ORT"
        if sorted(a % rank for a in axes) != [rank - 1]:
            return f"reduces over axes {axes}; ortfuse fuses innermost-axis reductions only"
        return None
    if op == "InstanceNormalization":
        return None if rank == 3 else (f"InstanceNormalization of a rank-{rank} tensor: ortfuse fuses rank 3 "
                                       f"(one spatial axis, as GroupNorm's export normalizes) only")
    default = 1 if op in ("Softmax", "LogSoftmax") and g.opset < 13 else -1
    axis = scalar.attr(node, "axis", default)
    if not -rank <= axis < rank:
        return f"axis {axis} out of range for a rank-{rank} tensor: left to ORT"
    if axis % rank != rank - 1:
        return f"{op} over axis {axis} of a rank-{rank} tensor; only the innermost axis is fused"
    if op == "LayerNormalization" and any(o and (g.consumers.get(o) or o in g.graph_outputs) for o in node.output[1:]):
        return "LayerNormalization's Mean/InvStdDev outputs are used"
    return None


def range_length_verdict(g: Graph, node: onnx.NodeProto) -> Optional[str]:
    """None when a Range's output length is a dim the kernel knows: its start and delta are integer
    constants and its limit is a constant or, for Range(0, n, 1), a dim read through Shape (`iota.scalar`)
    equal to the output's dim. The limit itself is never read by the kernel."""
    from ortfuse.rewriter import iota

    start, delta = (iota.const_int(g, t) for t in (node.input[0], node.input[2]))
    out = g.tensors.get(node.output[0])
    if start is None or delta is None or delta == 0:
        return "start or delta is not an integer constant"
    if out is None or out.shape is None or len(out.shape) != 1:
        return "output length unknown"
    limit, length = iota.scalar(g, node.input[1]), out.shape[0]
    if limit is None:
        return "its limit is computed at run time by ops ortfuse does not follow"
    if not limit[1]:
        if length != max(-(-(limit[0] - start) // delta), 0):
            return f"output length {length} disagrees with Range({start}, {limit[0]}, {delta})"
        return None
    if (start, delta) != (0, 1) or limit != iota.coef_of(length):
        return f"a run-time length other than a dim ({length}) of Range({start}, n, {delta})"
    return None


def slice_runtime_end(g: Graph, node: onnx.NodeProto) -> Optional[tuple[int, Dim, int]]:
    """(axis, output dim, room) of a Slice whose one end is computed at run time: Slice(x, [0], [n], [axis])
    with n a dim read through Shape, equal to the output's dim there (`iota.scalar`), on an axis of static
    size `room`; None for a Slice whose ends are constants. Raises ValueError for other forms."""
    from ortfuse.rewriter import iota

    ends = node.input[2] if len(node.input) > 2 else ""
    if ends in g.constants:
        return None
    src, out = g.tensors[node.input[0]].shape or (), g.tensors[node.output[0]].shape or ()
    starts = g.constants.get(node.input[1])
    axes = g.constants.get(node.input[3]) if len(node.input) > 3 and node.input[3] else np.zeros(1, np.int64)
    if starts is None or axes is None or np.asarray(starts).size != 1 or np.asarray(axes).size != 1:
        raise ValueError("its starts and axes are not one constant each")
    axis = int(np.asarray(axes).reshape(())) % len(src)
    n = out[axis]
    if int(np.asarray(starts).reshape(())) != 0 or not isinstance(src[axis], int) or not isinstance(n, str) \
            or iota.scalar(g, ends) != iota.coef_of(n):
        raise ValueError("a run-time end other than a dim of the output, from 0, along an axis of static size")
    return axis, n, src[axis]


def slice_starts(g: Graph, node: onnx.NodeProto) -> dict[int, int]:
    """{axis: first index read} of a Slice with constant starts and positive constant steps
    (`attention.select_start`; the steps: `attention.slice_steps`), or {axis: 0} for the run-time-end form
    (`slice_runtime_end`). Raises ValueError for other forms."""
    from ortfuse.search.attention import select_start

    run_time = slice_runtime_end(g, node)
    return {run_time[0]: 0} if run_time is not None else select_start(g, node, node.output[0], strided=True)


def slice_verdict(g: Graph, node: onnx.NodeProto) -> Optional[str]:
    """None when a Slice is an index op (`slice_starts`: positive constant steps, constant starts, and
    constant ends or one run-time end that is a dim, whose fit the launch checks)."""
    if any(x and x not in g.constants for x in list(node.input[1:2]) + list(node.input[3:5])):
        return "its starts, axes or steps are computed at run time"
    try:
        slice_starts(g, node)
    except (ValueError, KeyError, IndexError) as e:
        return str(e)
    return None


def _indexing_verdict(g: Graph, node: onnx.NodeProto) -> Optional[str]:
    if node.op_type == "Range":
        why = range_length_verdict(g, node)
        return f"Range not computed in a kernel: {why}" if why else None
    if node.op_type == "Slice":
        why = slice_verdict(g, node)
        return f"Slice not computed in a kernel: {why}" if why else None
    if node.op_type == "Resize":
        return resize.verdict(g, node)
    if node.op_type == "Pad":
        geo = pad.geometry(g, node)
        return f"Pad not computed in a kernel: {geo}" if isinstance(geo, str) else None
    if node.op_type == "Concat":
        ins = [x for x in node.input if x]
        rank = len(g.tensors[node.output[0]].shape or ())
        axis = scalar.attr(node, "axis", 0)
        if not -rank <= axis < rank:
            return f"axis {axis} out of range for a rank-{rank} tensor: left to ORT"
        if not 1 < len(ins) <= ops.MAX_CONCAT_INPUTS:
            return f"Concat of {len(ins)} inputs: ortfuse fuses 2 to {ops.MAX_CONCAT_INPUTS}"
        if any(len(g.tensors[x].shape or ()) != rank for x in ins):
            return "inputs of different ranks"
        spans = [g.tensors[x].shape[axis % rank] for x in ins]
        if any(isinstance(d, int) and d < 1 for d in spans):  # run-time spans may be empty: read under guards
            return f"spans {spans} along the axis: a static span must be non-empty"
        return None
    data, indices = (g.tensors[t] for t in node.input[:2])
    rank = len(data.shape or ())
    axis = scalar.attr(node, "axis", 0)
    if not rank:
        return "Gather from a scalar"
    if not -rank <= axis < rank:
        return f"axis {axis} out of range for a rank-{rank} tensor: left to ORT"
    if indices.dtype not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return "indices are not int32/int64"
    return None


GEMM_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
_HALF_TYPES = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


def quantizer_verdict(g: Graph, n: onnx.NodeProto) -> Optional[str]:
    """None where a DequantizeLinear or QuantizeLinear computes in a kernel exactly as ORT's
    (`scalar._dequantize`, `scalar._quantize`): one scale (and zero point) for the tensor or one per element of
    `axis` (`lower.per_axis_index`); else why not. A DQ's data is 8-bit or int32 and a Q's result 8-bit (the
    element types a kernel stores that they have: `node_verdict` refuses the others); a Q quantizes fp32 (in
    half precision ORT rounds its input op by op, `exact_verdict`)."""
    x = g.tensors[n.input[0]]
    if n.op_type == "DequantizeLinear" and g.tensors[n.output[0]].dtype == onnx.TensorProto.BFLOAT16:
        return "a bfloat16 result: ORT 1.31 has no bfloat16 DequantizeLinear kernel, so it stays ORT's to refuse"
    if n.op_type == "QuantizeLinear":
        if x.dtype != onnx.TensorProto.FLOAT:
            return f"quantizes {onnx.TensorProto.DataType.Name(x.dtype)}: only fp32 inputs are quantized in a kernel"
        scale = g.constants.get(n.input[1])
        if scale is None:
            return "its scale is computed at run time: left to ORT"
        precision = scalar.attr(n, "precision", 0)
        if g.tensors[n.input[1]].dtype != onnx.TensorProto.FLOAT or precision not in (0, onnx.TensorProto.FLOAT):
            return "x / scale in another precision than fp32 (its scale's type or `precision`): left to ORT"
        s = np.asarray(scale, np.float64)
        if not (np.all(np.isfinite(s)) and np.all(s >= np.finfo(np.float32).tiny)):
            return ("a scale that is not a finite positive number (x / scale is then NaN or infinite for some x, which "
                    "ORT's CPU and CUDA kernels quantize differently): left to ORT")
    if scalar.attr(n, "block_size", 0):
        return f"blocked quantization (block_size {scalar.attr(n, 'block_size')}): left to ORT"
    scale, rank = g.tensors[n.input[1]].shape, len(x.shape or ())
    if len(scale) > 1:
        return f"a rank-{len(scale)} scale (blocked quantization): left to ORT"
    if len(scale) == 1 and scale[0] != 1:
        axis = scalar.attr(n, "axis", 1)
        if rank == 0 or not -rank <= axis < rank or scale[0] != x.shape[axis % rank]:
            return f"a scale of {scale[0]} elements for axis {axis} of a {list(x.shape)} input: left to ORT"
    return None


# Ops a kernel computes exactly as ORT's ops do, given the same fp32 inputs, where a step op reads them
# (`lower.discrete_cone`: each sum and product rounded once, IEEE division): arithmetic, selections, copies.
# A QuantizeLinear too: it is only admitted where its own input is exact (`exact_verdict`), and no kernel computes
# an inexact value any quantizer reads (`inexact_before_quantizers`).
# Not Pad or MaxPool: ORT folds a Pad into the MaxPool after it (its padding then is -inf, not the Pad's value),
# which a fused node hides from it; and the kernel's MaxPool drops a NaN where cuDNN's keeps it.
EXACT_OPS = frozenset({
    "DequantizeLinear", "QuantizeLinear", "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "Max", "Min", "Clip",
    "Identity", "Where", "Cast", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or",
    "Xor", "IsNaN", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Flatten", "Gather", "Slice", "Concat",
    "Range",
})


def _inexact(g: Graph, p: int) -> Optional[str]:
    """Why node p's output may differ from ORT's by an ulp in a kernel (None where it cannot): an op outside
    EXACT_OPS, a half-precision tensor, or a Div of a constant numerator (ORT's DivMulFusion makes
    `Mul(y, Div(1, x))` one `Div(y, x)`, rounded once where the kernel rounds twice)."""
    n = g.nodes[p]
    half = [x for x in (*n.input, *n.output) if x in g.tensors and g.tensors[x].dtype in _HALF_TYPES]
    if n.op_type not in EXACT_OPS:
        return g.node_label(p)
    if half:
        return f"half-precision '{half[0]}'"
    if _div_mul(g, p) is not None:
        return f"{g.node_label(p)} (1 / x, which ORT divides the Mul after it by instead)"
    return None


def _reader_edges(g: Graph, t: str) -> list[int]:
    """The nodes reading tensor t, one entry per input slot (ORT's output edges)."""
    return [c for c in g.consumers.get(t, ()) for x in g.nodes[c].input if x == t]


def _div_mul(g: Graph, p: int) -> Optional[int]:
    """The Mul that ORT's DivMulFusion makes one division with Div node p (`1 / x * y` -> `y / x`, rounded once,
    where a kernel rounds the reciprocal and the product), or None: p divides a one-element constant equal to 1,
    its result is no graph output, and its one reader is that Mul (read in ORT's div_mul_fusion.cc)."""
    n = g.nodes[p]
    if n.op_type != "Div" or n.output[0] in g.graph_outputs:
        return None
    one = g.constants.get(n.input[0])
    if one is None or np.size(one) != 1 or float(np.asarray(one, np.float64).reshape(-1)[0]) != 1.0:
        return None
    edges = _reader_edges(g, n.output[0])
    return edges[0] if len(edges) == 1 and g.nodes[edges[0]].op_type == "Mul" else None


def _cone(g: Graph, q: int, within: Container[int]) -> Iterator[int]:
    """The nodes of `within` that QuantizeLinear q's input is computed by, within it (the walk stops at another
    QuantizeLinear: exact where admitted, its own cone is its own verdict's)."""
    stack, seen = [g.nodes[q].input[0]], set()
    while stack:
        t = stack.pop()
        p = g.producer.get(t)
        if t in seen or p is None or p not in within:
            continue
        seen.add(t)
        yield p
        if g.nodes[p].op_type not in ("QuantizeLinear", "Shape", "Size"):  # (a shape is no value of its input)
            stack.extend(x for _, x in ops.data_inputs(g.nodes[p]))


# ops that round float inputs to steps: a Q, ORT's dynamic quantizers (the scale from the tensor's min and max;
# com.microsoft's DynamicQuantizeMatMul quantizes its A so)
QUANTIZING = frozenset({"QuantizeLinear", "DynamicQuantizeLinear", "DynamicQuantizeMatMul"})


@per_graph
def quantizer_readers(g: Graph) -> dict[int, int]:
    """Each node whose value a quantizer reads (its data, scale or zero point), through any ops and any of their
    inputs up to the previous QuantizeLinear (its value is its own cone's) or a shape (no value of its input),
    with the nearest such quantizer: one breadth-first walk up from every quantizer, each tensor once. An ulp in
    such a node's value moves an element a step at the quantizer, so whatever computes it must compute it exactly
    as ORT does in the input. A node with a quantizer in a subgraph (If, Loop, Scan bodies, at any depth) counts
    as one for every tensor it reads, its bodies' reads from outside included: the walk does not follow values
    through the bodies, so any of them may reach the quantizer."""
    readers: dict[int, int] = {}
    todo = collections.deque((x, q) for q, n in enumerate(g.nodes) if n.op_type in QUANTIZING for x in n.input if x)
    todo.extend((x, q) for q, n in enumerate(g.nodes) if _proto.has_subgraph(n)
                and any(m.op_type in QUANTIZING for sub in _proto._subgraphs(n) for m in _proto.deep_nodes(sub.node))
                for x in _proto.node_reads(n) if x)
    seen: set[str] = set()
    while todo:
        t, q = todo.popleft()
        p = g.producer.get(t)
        if t in seen or p is None:
            continue
        seen.add(t)
        readers.setdefault(p, q)
        if g.nodes[p].op_type not in ("QuantizeLinear", "Shape", "Size"):
            todo.extend((x, q) for x in _proto.node_reads(g.nodes[p]) if x)  # (a body's outer reads too)
    return readers


def quantizer_label(g: Graph, q: int) -> str:
    """The node `quantizer_readers` names, said as a quantizer: a node whose subgraph holds one says so."""
    return g.node_label(q) + ("" if g.nodes[q].op_type in QUANTIZING else ", whose subgraph quantizes")


def inexact_before_quantizers(g: Graph, regions: Iterable[Region],
                              units: Sequence[tuple[str, frozenset[str]]] = ()) -> dict[str, str]:
    """The outputs of fused nodes a kernel computes otherwise than ORT (`_inexact`: a LayerNorm's sums in another
    order, an exp, a GEMM) whose value reaches a quantizer, fused or ORT's (`quantizer_readers`: through any ops,
    kernels' and ORT's, since ORT computes what it is given: a LayerNorm read by ORT's MatMul reaches the Q after
    it), with the reason: `api` plans again with those nodes left to ORT. An ulp there moves an element a step at
    the quantizer, where the quantized value must equal ORT's (on the GPU, a LayerNorm kernel read by ORT's Q put
    the quantized BERT's outputs 0.2 off; on the CPU a fused node runs ORT's own ops, which hid it). ORT's
    DivMulFusion makes `1 / x * y` one division: such a Div and its Mul stay ORT's together. A quantizer's own
    kernel holds only exact ops before it (`exact_verdict`).
    ORT runs the nodes left to it as it runs them in the input only where none of its fusions of several ops
    (`units`: `rewriter.ort_fusions`, a GELU as one Gelu, an Add and a LayerNorm as one SkipLayerNormalization;
    and the ORT ops ortfuse split, `rewriter.contrib`) spans a fused node: one a quantizer reads stays ORT's
    whole, where a kernel would take part of it (its exact ops too: ORT's fused kernel rounds otherwise than the
    ops apart)."""
    owner = {i for r in regions for i in r.nodes}
    out: dict[str, str] = {}
    readers = quantizer_readers(g)
    for op, names in units:
        nodes = {g.producer[t] for t in names if t in g.producer}
        q = next((readers[i] for i in sorted(nodes) if i in readers), None)
        if q is None or not nodes & owner:
            continue
        reason = (f"in the input ORT computes it with {len(nodes) - 1} more nodes as one {op}, whose value reaches "
                  f"{quantizer_label(g, q)}, which rounds it to a step: left to ORT with them")
        out.update((o, reason) for i in sorted(nodes & owner) for o in g.nodes[i].output if o)
    for p, q in readers.items():
        why = _inexact(g, p) if p in owner else None
        if why:
            reason = (f"its value reaches {quantizer_label(g, q)}, which rounds it to a step, and a kernel computes "
                      f"{why} otherwise than ORT (an element could move a step): left to ORT")
            out.update((o, reason) for o in g.nodes[p].output if o)
        pair = _orts_pair(g, p)
        if pair is not None and pair[0] in owner and (why or p not in owner):
            out[g.nodes[pair[0]].output[0]] = (
                f"its value reaches {quantizer_label(g, q)}, which rounds it to a step, and ORT makes it and "
                f"{g.node_label(p)} one {pair[1]}, which rounds otherwise than the two apart: left to ORT with it")
    return out


def _orts_pair(g: Graph, p: int) -> Optional[tuple[int, str]]:
    """The node ORT fuses with node p where the CPU EP's probe (`rewriter.ort_fusions`) may not show it, and the
    fusion: the Mul of a `1 / x` Div (DivMulFusion: `y / x`), the Add that only a last-axis Softmax reads (the CUDA
    EP's BiasSoftmaxFusion: a superset of its conditions, which also look at how the Add broadcasts)."""
    n = g.nodes[p]
    if n.op_type == "Div":
        mul = _div_mul(g, p)
        return None if mul is None else (mul, "Div (DivMulFusion)")
    if n.op_type == "Softmax" and n.input[0] not in g.graph_outputs:
        add = g.producer.get(n.input[0])
        rank = len(g.tensors[n.output[0]].shape or ())
        axis = scalar.attr(n, "axis", -1 if g.opset >= 13 else 1)
        if add is not None and g.nodes[add].op_type == "Add" and _reader_edges(g, n.input[0]) == [p] and rank \
                and axis % rank == rank - 1:
            return add, "BiasSoftmax"
    return None


def exact_verdict(g: Graph, nodes: Iterable[int]) -> Optional[str]:
    """None where every QuantizeLinear of the group reads a value the kernel computes exactly as ORT does: only
    `EXACT_OPS` between it and the group's inputs, on fp32 and integer tensors. A QuantizeLinear rounds to a
    step: a kernel's ulp elsewhere (a GEMM's other summation order, an exp, fp16 rounded once where ORT rounds
    op by op) would move an element a step, where the quantized output must equal ORT's."""
    members = set(nodes)
    for q in (i for i in members if g.nodes[i].op_type == "QuantizeLinear"):
        why = next((w for p in _cone(g, q, members) for w in (_inexact(g, p),) if w), None)
        if why:
            return (f"{g.node_label(q)} quantizes a value computed from {why}, which a kernel computes otherwise "
                    f"than ORT (an element could move a step): it stays ORT's")
    return None


def node_verdict(g: Graph, i: int, ort_qdq: Optional[Mapping[str, str]] = None) -> Optional[Reject]:
    """None if node i may join a fused kernel, else the reason it may not. `ort_qdq`: outputs of nodes that stay
    ORT's for its quantization passes, which look at the nodes themselves (`qdq.left_to_ort`), with the reason."""
    n = g.nodes[i]
    label = g.node_label(i)
    if n.domain not in ("", "ai.onnx"):
        return Reject(label, f"op of domain '{n.domain}': left to ORT")
    kind = ops.kind_of(n.op_type)
    if kind is None:
        return Reject(label, "not a memory-bound op ortfuse fuses: left to ORT")
    if _proto.ort_default_domain_op(g.model, n):
        # LayerNormalization before opset 17 (rewriter.contrib writes it as its ops where it can): ORT 1.31
        # crashes on its own default-domain ops inside a model-local function, which a fused node's fallback is
        return Reject(label, f"{n.op_type} at opset {g.opset} is ORT's own op, which ORT cannot run inside a "
                             "fused node's function: left to ORT")
    used_outputs = [o for o in n.output if o][:1] if n.op_type == "LayerNormalization" else [o for o in n.output if o]
    for t in [t for _, t in ops.data_inputs(n)] + used_outputs:
        info = g.tensors.get(t)
        if info is None or info.shape is None:
            return Reject(label, f"shape of '{t}' could not be inferred")
        if info.dtype not in scalar.STORAGE:
            return Reject(label, f"'{t}' has element type {onnx.TensorProto.DataType.Name(info.dtype)}, not fused")
    why = next((ort_qdq[t] for t in n.output if t in (ort_qdq or {})), None)
    if why:
        return Reject(label, why)
    if n.op_type in scalar.QUANTIZERS:
        why = quantizer_verdict(g, n)
        if why:
            return Reject(label, why)
    if kind == "indexing":
        why = _indexing_verdict(g, n)
        return Reject(label, why) if why else None
    if kind == "window":
        geo = pool.geometry(g, n)
        return Reject(label, f"{n.op_type} not computed in a kernel: {geo}") if isinstance(geo, str) else None
    for t in ops.meta_inputs(n):
        if n.op_type == "Expand" and expand_target(g, n) is not None:
            continue  # a run-time target: the kernel broadcasts to the inferred shape (`shape_reads`)
        if n.op_type == "Reshape" and t == n.input[1] and None not in (g.tensors[n.output[0]].shape or (None,)):
            continue  # a run-time target: the inferred shape, if its dims are the region's (`shape_reads`)
        if t not in g.constants:
            return Reject(label, f"its shape/axes input '{t}' is computed at run time, not a constant")
    if n.op_type == "Cast" and scalar.attr(n, "to") not in scalar.STORAGE:
        return Reject(label, f"Cast to element type {scalar.attr(n, 'to')}, not fused")
    if kind == "gemm":
        a, b = (g.tensors[t] for t in n.input[:2])
        if a.dtype not in GEMM_TYPES:
            return Reject(label, f"{onnx.TensorProto.DataType.Name(a.dtype)} GEMMs are left to ORT")
        if n.op_type in ops.CONV:
            geo = conv.conv_geometry(g, n)
            if isinstance(geo, str):
                return Reject(label, geo)
        elif (a.rank or 0) < 2 or (b.rank or 0) < 2:
            return Reject(label, "matrix-vector product (rank-1 operand): left to ORT")
    if kind == "reduction":
        shape = g.tensors[n.input[0]].shape
        assert shape is not None
        if not shape:
            return Reject(label, "reduction of a scalar")
        if scalar.STORAGE[g.tensors[n.output[0]].dtype] not in scalar.FLOAT_STORAGE:
            return Reject(label, "integer reductions are left to ORT")
        why = _reduction_verdict(g, n, len(shape))
        if why:
            return Reject(label, why)
    return None


def output_perm(g: Graph, nodes: set[int], t: str, space: tuple[Dim, ...]) -> Optional[tuple[int, ...]]:
    """p such that tensor t, at the element a kernel computes for index idx of its iteration space, is read at
    (idx[p[0]], idx[p[1]], ...): t is a space-shaped tensor seen through the region's Transposes (and the
    element-wise ops around them). None when no such chain leads back to the space. The lowering's value
    walk stays the judge: a GEMM epilogue that would read the accumulator elsewhere is refused."""
    memo: dict[str, Optional[tuple[int, ...]]] = {}

    def walk(x: str) -> Optional[tuple[int, ...]]:
        if x in memo:
            return memo[x]
        memo[x] = None
        shape = g.tensors[x].shape if x in g.tensors else None
        i = g.producer.get(x)
        n = g.nodes[i] if i is not None and i in nodes else None
        p: Optional[tuple[int, ...]] = None
        if shape is not None and n is not None and n.op_type == "Transpose":
            perm = scalar.transpose_perm(n, len(shape))
            p_in = walk(n.input[0])
            p = None if p_in is None else tuple(p_in[k] for k in perm)
        elif shape is not None and n is not None and ops.kind_of(n.op_type) == "elementwise":
            p = next((q for _, y in ops.data_inputs(n) if y in g.tensors and g.tensors[y].shape == shape
                      for q in [walk(y)] if q is not None), None)
        if p is None and shape is not None and tuple(shape) == tuple(space):
            p = tuple(range(len(space)))
        memo[x] = p
        return p

    return walk(t)


def output_view(g: Graph, nodes: set[int], t: str, space: tuple[Dim, ...]) -> bool:
    """True if tensor t holds, in row-major order, the elements a kernel computes over its iteration space in
    row-major order, under another shape: a space-shaped tensor seen through the region's Reshapes (Squeeze,
    Unsqueeze, Flatten) and the element-wise ops around them, as GroupNorm's export views its [N, G, L]
    normalization as the [N, C, H, W] image before the affine tail. The kernel stores it at the element's
    linear offset."""
    memo: dict[str, bool] = {}

    def walk(x: str) -> bool:
        if x not in memo:
            memo[x] = False
            shape = g.tensors[x].shape if x in g.tensors else None
            i = g.producer.get(x)
            n = g.nodes[i] if i is not None and i in nodes and shape is not None else None
            if n is not None and n.op_type in _VIEW_OPS:
                src = n.input[0]
                memo[x] = tuple(g.tensors[src].shape or ()) == tuple(space) or walk(src)
            elif n is not None and ops.kind_of(n.op_type) == "elementwise":
                memo[x] = any(walk(y) for _, y in ops.data_inputs(n) if y in g.tensors and g.tensors[y].shape == shape)
        return memo[x]

    return walk(t)


_VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})  # keep the elements' row-major order


def without_trailing_views(g: Graph, nodes: frozenset[int]) -> Optional[frozenset[int]]:
    """`nodes` without the view ops (Reshape, Squeeze, ...) they end with, read by none of them, whose outputs
    have a product of run-time dims ("batch*sequence", "16*batch": blocks that flatten the batch with the
    sequence or the windows, whose views are a kernel's outputs since `sym_products`), where that leaves a
    non-empty group that is not only layout ops; else None. (Only those: peeling any view was estimated 4.7%
    slower on Funnel, whose GEMMs, once they take their bias, are no longer padded to aligned rows.)"""
    def product_out(i: int) -> bool:
        out = g.tensors.get(g.nodes[i].output[0])
        return out is not None and any(isinstance(d, str) and "*" in d for d in out.shape or ())

    rest = set(nodes)
    while True:
        ends = {i for i in rest if g.nodes[i].op_type in _VIEW_OPS and product_out(i) and not any(
            c in rest for o in g.nodes[i].output if o for c in g.consumers.get(o, ()))}
        if not ends:
            break
        rest -= ends
    if rest == set(nodes) or not rest or all(ops.kind_of(g.nodes[i].op_type) == "layout" for i in rest):
        return None
    return frozenset(rest)


def region_io(g: Graph, nodes: set[int]) -> tuple[list[str], list[str]]:
    """(data inputs in first-use order, outputs) of a group. Scalar constants become literals."""
    produced = {o for i in nodes for o in g.nodes[i].output if o}
    inputs: list[str] = []
    outputs: list[str] = []
    for i in sorted(nodes):
        for _, t in ops.data_inputs(g.nodes[i]):
            if t in produced or t in inputs or g.constant_size(t) == 1:
                continue
            inputs.append(t)
        for o in g.nodes[i].output:
            if o and o in g.tensors and (o in g.graph_outputs or any(c not in nodes for c in g.consumers.get(o, ()))):
                outputs.append(o)
    return inputs, outputs


SMALL_CONSTANT = 100  # elements: what ORT's CPU fallback counts as a small initializer


@per_graph
def host_tensors(g: Graph) -> frozenset[str]:
    """Tensors ORT's CUDA EP computes in host memory: Shape/Size outputs and what nodes derive from them alone.
    ORT (framework/fallback_cpu_capability.cc) places a node that reads such a tensor on the CPU when every
    other input is a small constant or a graph input and none is fp16/bf16, unless the node's CUDA kernel reads
    that host tensor on the host itself (Reshape's shape, Slice's starts, ...: `ops.CUDA_HOST_INPUTS`), which
    keeps it on the GPU. Nodes the CUDA EP has no kernel for are not modelled (ORT runs them on the CPU)."""
    host: set[str] = set()
    for n in g.nodes:
        if n.op_type in ("Shape", "Size") and n.domain in ("", "ai.onnx"):
            host.update(o for o in n.output if o)
        elif _host_placed(g, [t for t in n.input if t], host, _cuda_host_inputs(n)):
            host.update(o for o in n.output if o)
    return frozenset(host)


def _cuda_host_inputs(n: onnx.NodeProto) -> set[str]:
    at = ops.CUDA_HOST_INPUTS.get(n.op_type, frozenset()) if n.domain in ("", "ai.onnx") else frozenset()
    return {t for k, t in enumerate(n.input) if t and k in at}


def _host_placed(g: Graph, inputs: list[str], host: set[str] | frozenset[str], on_host: set[str] = frozenset()) -> bool:
    """ORT's walk for one node (inputs `on_host`: what its kernel reads from host memory by definition)."""
    if not any(t in host for t in inputs):
        return False  # not reached by ORT's walk from host tensors
    for t in inputs:
        info = g.tensors.get(t)
        if info is not None and info.dtype in _HALF_TYPES:  # ORT never moves half-precision tensors to the CPU
            return False
        const = g.constants.get(t)
        if t in g.graph_inputs or (const is not None and const.size <= SMALL_CONSTANT):
            continue
        if t not in host or t in on_host:
            return False
    return True


def host_verdict(g: Graph, inputs: tuple[str, ...] | list[str]) -> Optional[str]:
    """Why a fused node with these inputs cannot run: ORT's CUDA EP would hand it to the CPU EP, which has no
    kernel for it (session creation fails), or None."""
    if not inputs:
        return "reads no tensor (a constant): left to ORT's constant folding"
    if _host_placed(g, list(inputs), host_tensors(g)):
        return ("shape arithmetic on host tensors (Shape/Size-derived): ORT's CUDA EP places it on the CPU, "
                "where a fused node has no kernel")
    return None


def folded_verdict(g: Graph, nodes: Iterable[int], outputs: Iterable[str]) -> Optional[str]:
    """Why a region of these nodes must not be fused, as ORT's constant folding would compute them once, when
    a session starts (`rewriter.ort_folding`), where a fused node, which ORT cannot fold, runs on every call
    and keeps ORT from folding what reads it; or None. Refused: a region whose every node ORT folds, and one
    whose output a node ORT folds reads (a region may compute through folded nodes where only run-time work
    reads them: a Transpose or a broadcast of a constant costs it no more than reading the folded tensor)."""
    folded = folded_nodes(g)
    if not folded:
        return None
    inside = set(nodes)
    if inside <= folded:
        return "computed from constants alone: ORT folds it when a session starts"
    for t in outputs:
        reader = next((c for c in g.consumers.get(t, ()) if c in folded and c not in inside), None)
        if reader is not None:
            return f"{g.node_label(reader)}, which ORT folds when a session starts, reads its output '{t}'"
    return None


# A run-time shape tensor a region reads, rebuilt from its inputs' shapes: (tensor, parts), each part
# (k, axis) = inputs[k].shape[axis], or (-1, v) = the constant v. A rank-0 tensor has one part.
ShapeRead = tuple[str, tuple[tuple[int, int], ...]]


def expand_target(g: Graph, node: onnx.NodeProto) -> Optional[tuple[Dim, ...]]:
    """A target that gives an Expand its inferred output shape: 1 where its input already has the output's
    dim, the output's dim elsewhere; None when the output shape is not known."""
    out, src = g.tensors[node.output[0]].shape, g.tensors[node.input[0]].shape
    if out is None or src is None or len(out) < len(src):
        return None
    lead = len(out) - len(src)
    return tuple(1 if k >= lead and src[k - lead] == d else d for k, d in enumerate(out))


# A kernel's lanes walk its innermost axis: in a row reduction the reduced one, in a pointwise kernel the
# output's. Where that is the channel axis of a depthwise Conv's NCHW image, every tap of every lane is its
# own memory transaction (ConvNeXt-T's depthwise 7x7 + Transpose + LayerNorm as one row kernel, H100
# 2026-11-25: 1.0-5.8x slower than cuDNN + ORT's Transpose and LayerNorm at batch 1, 9.7-28x at batch 32).
_DEPTHWISE_ACROSS = ("{}: a depthwise Conv computed {} reads its taps across channels, one memory transaction "
                     "per element, so it stays a separate kernel")


def _depthwise_across(g: Graph, nodes: Iterable[int]) -> Optional[tuple[int, bool]]:
    """(a depthwise Conv or pool of `nodes`, whether the kernel walks it transposed) where the kernel's lanes
    would read its taps across channels: its
    image is NCHW in memory and its output reaches a Transpose inside `nodes` (the kernel iterates a transposed
    order of the image), or its image is channels-last in memory (read through layout ops, `image_layout`)
    and its output reaches none (the kernel walks W while memory steps along C). Element-wise ops and
    Reshapes keep an order; a depthwise window reads well in its image's memory order."""
    members = set(nodes)
    for i in sorted(members):
        if not pool.is_window(g, g.nodes[i]):
            continue
        stack, seen, transposed = [i], set(), False
        while stack:
            j = stack.pop()
            if j in seen:
                continue
            seen.add(j)
            transposed |= g.nodes[j].op_type == "Transpose"
            stack += [c for o in g.nodes[j].output if o for c in g.consumers.get(o, ()) if c in members]
        channels_last = image_layout(g, g.nodes[i].input[0], members) == "channels-last"
        if transposed != channels_last:
            return i, transposed
    return None


def image_layout(g: Graph, t: str, members: set[int]) -> Optional[str]:
    """How a depthwise Conv's image `t` lies in memory where it is read through ops of the region that keep
    its elements in place (`_tap_chain`: Transposes, Reshapes that keep the axis and the dims before it,
    element-wise ops with constants) from a tensor the region reads: "channels-last" where its channel axis
    (1) is that tensor's innermost one (SegFormer's Mix-FFN: tokens [B, H*W, C] viewed as NCHW), "nchw" where
    its W axis is, None where the chain does not say."""
    chain = _tap_chain(g, t, members)
    if chain is None:
        return None
    src = _chain_input(g, g.nodes[chain[-1]]) if chain else t
    shape = g.tensors[src].shape if src else None
    if shape is None:
        return None
    axis = len(shape) - 1  # the memory's innermost axis, followed forward to the image
    for p in reversed(chain):
        n = g.nodes[p]
        if n.op_type not in _TAP_LAYOUT:
            continue  # element-wise: the same shape
        src_shape, out = g.tensors[n.input[0]].shape, g.tensors[n.output[0]].shape
        if out is None or src_shape is None:
            return None
        if n.op_type == "Transpose":
            perm = scalar.transpose_perm(n, len(src_shape))
            axis = perm.index(axis)
        else:  # a Reshape (Squeeze, Unsqueeze) keeps the axis where the dims before it and the axis itself stay
            axis = next((b for b in range(len(out)) if tuple(out[:b]) == tuple(src_shape[:axis])
                         and out[b] == src_shape[axis]), None)
            if axis is None:
                return None
    return {1: "channels-last", 3: "nchw"}.get(axis)


def _chain_input(g: Graph, n: onnx.NodeProto) -> Optional[str]:
    """The input a tap chain follows through `n`: a layout op's data, an element-wise op's one non-constant
    input (None if it has several)."""
    if n.op_type in _TAP_LAYOUT:
        return n.input[0]
    reads = [t for _, t in ops.data_inputs(n) if t not in g.constants]
    return reads[0] if len(reads) == 1 else None


_TAP_LAYOUT = ops.LAYOUT - {"Expand"}  # a broadcast is no view of the image's memory


def _tap_chain(g: Graph, t: str, members: set[int]) -> Optional[list[int]]:
    """The ops of `members` that compute a depthwise Conv's image `t` from one tensor the region reads, last
    first, where every one is cheap to evaluate again at each tap of the window: layout ops (index arithmetic)
    and, before a Transpose, element-wise ops whose other operands are constants (SegFormer's bias Add of the
    tokens the window reads transposed: an add on values the cache holds). None where a producer in `members`
    is anything else: recomputed at every tap, it would read its other tensors once per tap. An element-wise
    producer of an image read in its own layout stays out: it is the epilogue of the GEMM before it, and the
    window a prologue of the GEMM after it (MobileNetV2's conv chains, `_take_prologue`)."""
    chain: list[int] = []
    transposed = False
    while g.producer.get(t) in members:
        p = g.producer[t]
        n = g.nodes[p]
        nxt = _chain_input(g, n)
        if nxt is None or (n.op_type not in _TAP_LAYOUT and (not transposed or ops.kind_of(n.op_type) != "elementwise"
                                                             or g.tensors[nxt].shape != g.tensors[t].shape)):
            return None
        transposed |= n.op_type == "Transpose"
        chain.append(p)
        t = nxt
    return chain


def shape_reads(g: Graph, nodes: Iterable[int], inputs: Sequence[str]) -> Optional[tuple[ShapeRead, ...]]:
    """The run-time shape tensors the region's ops read but the kernel does not (its dims say the same):
    each Range limit computed at run time (Range(0, n, 1) with n a dim, `range_length_verdict`), each
    Expand or Reshape target and each Resize's sizes computed at run time, rebuilt from the inputs' shapes
    (a Reshape's as its output's dims, 0 and -1 resolved). None when a
    dim is no input's, or one shape inference may have merged (`iota.trusted_dims`)."""
    from ortfuse.rewriter import iota
    from ortfuse.rewriter.canonical import trusted_dim

    trusted = iota.trusted_dims(g)  # a dim shape inference merged in a broadcast may differ between inputs

    def part(d: Dim) -> Optional[tuple[int, int]]:
        if isinstance(d, int):
            return (-1, d)
        if not trusted_dim(d, trusted):  # a trusted input dim, or arithmetic on such dims ('4*batch')
            return None
        return next(((k, a) for k, t in enumerate(inputs) for a, e in enumerate(g.tensors[t].shape or ())
                     if e == d), None)

    out: dict[str, tuple[tuple[int, int], ...]] = {}
    members = set(nodes)
    for i in sorted(members):
        n = g.nodes[i]
        if n.op_type == "Slice":
            run_time = slice_runtime_end(g, n)
            if run_time is not None and n.input[2] not in out:
                p = part(run_time[1])
                if p is None or p[0] < 0:
                    return None
                out[n.input[2]] = (p,)
            continue
        if n.op_type == "Resize":  # sizes computed at run time (`resize.geometry`): the output's dims
            sizes = n.input[3] if len(n.input) > 3 else ""
            if sizes and sizes not in g.constants and sizes not in out:
                parts = [part(d) for d in g.tensors[n.output[0]].shape or ()]
                if not parts or any(p is None for p in parts):
                    return None
                out[sizes] = tuple(p for p in parts if p is not None)
            continue
        if n.op_type == "Reshape":  # a target computed at run time: the output's dims (torch's x.view(y.shape))
            target = n.input[1]
            if target not in g.constants and target not in out:
                dims = g.tensors[n.output[0]].shape or ()
                parts = [part(d) for d in dims]
                if sum(p is None for p in parts) == 1:  # one dim no input has ('12*batch'): -1, the rest fix it
                    parts = [(-1, -1) if p is None else p for p in parts]
                readers = [c for c in g.consumers.get(target, ()) if c in members]
                if any(p is None for p in parts) or any(g.nodes[c].op_type != "Reshape" or g.nodes[c].input[1] != target
                                                        or g.tensors[g.nodes[c].output[0]].shape != dims for c in readers):
                    return None  # the rebuilt target is the same only for Reshapes that it gives one shape
                out[target] = tuple(p for p in parts if p is not None)
            continue
        if n.op_type not in ("Range", "Expand") or n.input[1] in g.constants or n.input[1] in out:
            continue
        if n.op_type == "Range":
            length = (g.tensors[n.output[0]].shape or (None,))[0]
            if range_length_verdict(g, n) or not isinstance(length, str):
                return None  # a limit computed at run time must be a dim itself (static ones are constants by now)
            dims: Optional[tuple[Dim, ...]] = (length,)
        else:
            dims = expand_target(g, n)
            readers = [c for c in g.consumers.get(n.input[1], ()) if c in members]
            if not dims or any(g.nodes[c].op_type != "Expand" or list(g.nodes[c].input).index(n.input[1]) != 1
                               or expand_target(g, g.nodes[c]) != dims for c in readers):
                return None  # the rebuilt target is the same only for Expands that it gives one shape
            out_dims = g.tensors[n.output[0]].shape or ()
            if any(isinstance(d, str) and d not in trusted for d in out_dims):
                return None  # a 1 kept for an input dim equal to a merged output dim may not be 1 at run time
        parts = [part(d) for d in dims]
        if any(p is None for p in parts) or (n.op_type == "Range" and parts[0][0] < 0):
            return None
        out[n.input[1]] = tuple(p for p in parts if p is not None)
    return tuple(out.items())


MERGED_DIM = "a size it merged a symbolic dim into"  # in the refusals below (the summary counts them)


def _merged_input_verdict(g: Graph, inputs: Sequence[str]) -> Optional[str]:
    """An input whose static dim may be a symbolic one shape inference merged into that size where they met
    in a broadcast (`_infer.recorded_merges`): at run time it may be 1 there, and a kernel built for the size
    would read past it, so the region is left to ORT. Constants and declared sizes are facts."""
    from ortfuse.rewriter import iota
    from ortfuse.rewriter.shapes import merged_sizes

    sizes = merged_sizes(g)
    if not sizes:
        return None
    declared = iota.declared_dims(g)
    for t in inputs:
        for axis, d in enumerate(g.tensors[t].shape or ()):
            if d in sizes and t not in g.constants and declared.get((t, axis)) != d:
                return (f"input '{t}' axis {axis}: shape inference took it for {d}, {MERGED_DIM} (it may be 1 at "
                        f"run time): left to ORT")
    return None


def merged_verdict(g: Graph, nodes: Iterable[int], inputs: Sequence[str]) -> Optional[str]:
    """`_merged_input_verdict`, and a tensor the region computes whose static dim may be a symbol shape
    inference minted and merged into that size (`shapes.merge_tainted`: computed from where such a symbol
    was minted): a broadcast of dims the tool could not compare (Min(256, s) against s) is 1 there at run
    time, and a kernel built for the size would compute and write that many."""
    from ortfuse.rewriter.shapes import merge_tainted, merged_sizes

    why = _merged_input_verdict(g, inputs)
    sizes = merged_sizes(g)
    if why or not sizes:
        return why
    tainted = merge_tainted(g)
    for i in sorted(nodes):
        for t in g.nodes[i].output:
            if not t or t not in g.tensors or (tainted is not None and t not in tainted):
                continue
            for axis, d in enumerate(g.tensors[t].shape or ()):
                if d in sizes:
                    return (f"'{t}' axis {axis}: shape inference took it for {d}, {MERGED_DIM} (it may be 1 at "
                            f"run time): left to ORT")
    return None


def gated_reads(g: Graph, nodes: Iterable[int], anchor: int) -> Optional[tuple[onnx.NodeProto, onnx.NodeProto]]:
    """The Slices from column 0 and from column 1 where GEMM `anchor`'s [.., N] result is read in the region
    `nodes` by exactly these two Slices of its last axis, of step 2, and by nothing else (a gated MLP packed by
    `rewriter.gemm_packing` with its gate and up columns alternating: the region's outputs are N / 2 wide); else
    None."""
    from ortfuse.search.attention import slice_steps

    y = g.nodes[anchor].output[0]
    shape = g.tensors[y].shape or ()
    inside = set(nodes)
    readers = [i for i in g.consumers.get(y, ()) if i in inside]
    if not shape or y in g.graph_outputs or not isinstance(shape[-1], int) or shape[-1] % 2 or len(readers) != 2 \
            or len(readers) != len(set(g.consumers.get(y, ()))):
        return None
    last, firsts = len(shape) - 1, {}
    for i in readers:
        n = g.nodes[i]
        if n.op_type != "Slice" or slice_verdict(g, n) is not None:
            return None
        starts = slice_starts(g, n)
        if slice_steps(g, n) != {last: 2} or set(starts) != {last} or \
                g.tensors[n.output[0]].shape != shape[:-1] + (shape[-1] // 2,):
            return None
        firsts[starts[last]] = n
    return (firsts[0], firsts[1]) if set(firsts) == {0, 1} else None


def classify(g: Graph, nodes: set[int]) -> Region | Reject:
    """The kernel shape a group would take, or why it has none. Traffic is filled in by the caller."""
    label = f"region of {len(nodes)} ops starting at {g.node_label(min(nodes))}"
    inputs, outputs = region_io(g, nodes)
    if not outputs:
        return Reject(label, "computes nothing that is used")
    why = merged_verdict(g, nodes, inputs) or exact_verdict(g, nodes)
    if why:
        return Reject(label, why)
    if shape_reads(g, nodes, inputs) is None:
        return Reject(label, "a run-time shape (a Range's length, an Expand's or Reshape's target, a Resize's "
                             "sizes) is not made of the region's input dims")
    if all(ops.kind_of(g.nodes[i].op_type) == "layout" for i in nodes):
        return Reject(label, "only layout ops")
    shapes = {o: g.tensors[o].shape for o in outputs}
    gemms = [i for i in nodes if conv.is_anchor(g, g.nodes[i])]
    fold = norm_fold.in_region(g, nodes) if gemms else None  # a LayerNorm prologue is not a row epilogue
    reductions = [i for i in nodes if g.nodes[i].op_type in ops.REDUCTIONS and not (fold and i == fold.norm)]
    empty = Traffic(0, 0, 0)
    if gemms:
        if len(gemms) > 1:
            return Reject(label, "two GEMMs in one region")
        space = tuple(g.tensors[g.nodes[gemms[0]].output[0]].shape or ())
        if reductions and g.nodes[gemms[0]].op_type in ops.CONV:
            return Reject(label, "a reduction after a Conv: row-wise epilogues follow MatMul/Gemm only")
        rows = (space[:-1], space[:-1] + (1,)) if reductions else ()
        if not reductions and gated_reads(g, nodes, gemms[0]) is not None:
            rows = (space[:-1] + (space[-1] // 2,),)  # gated pairs: outputs half as wide as the GEMM
        for i in reductions:  # row-wise epilogue: reductions over the GEMM's rows
            if g.tensors[g.nodes[i].input[0]].shape != space:
                return Reject(label, f"{g.node_label(i)} reduces a tensor of another shape than the GEMM's {space}")
        for o, s in shapes.items():
            if s != space and s not in rows and output_perm(g, nodes, o, space) is None:
                return Reject(label, f"output '{o}' of shape {s} is neither the GEMM's shape {space} nor a "
                                     f"transpose of it")
        kind = "gemm_row" if reductions else "gemm"
        return Region(-1, kind, tuple(sorted(nodes)), tuple(inputs), tuple(outputs), space, empty)
    for i in nodes:
        if pool.is_window(g, g.nodes[i]) and _tap_chain(g, g.nodes[i].input[0], set(nodes)) is None:
            return Reject(label, f"{g.node_label(i)} reads its input at neighbouring pixels: its producer "
                                 f"would be recomputed for every tap, so it stays a separate kernel")
    if not reductions:
        # the iteration space: an output's shape that every other output is (a transpose of)
        space = next((s for s in shapes.values() if all(
            t == s or output_perm(g, nodes, o, s) is not None for o, t in shapes.items())), None)
        if space is None:
            return Reject(label, "outputs of different shapes would need separate iteration spaces")
        across = _depthwise_across(g, nodes)
        if across is not None:
            how = "in a transposed order" if across[1] else "in NCHW order over a channels-last image"
            return Reject(label, _DEPTHWISE_ACROSS.format(g.node_label(across[0]), how))
        return Region(-1, "pointwise", tuple(sorted(nodes)), tuple(inputs), tuple(outputs), tuple(space), empty)
    spaces = {g.tensors[g.nodes[i].input[0]].shape for i in reductions}
    if len(spaces) > 1:
        return Reject(label, f"reductions over differently shaped tensors {sorted(map(str, spaces))}")
    space: tuple[Dim, ...] = tuple(spaces.pop() or ())
    across = _depthwise_across(g, nodes)
    if across is not None:
        how = "inside a row reduction over a transpose of its image" if across[1] else \
            "inside a row reduction, in NCHW order over a channels-last image"
        return Reject(label, _DEPTHWISE_ACROSS.format(g.node_label(across[0]), how))
    row = space[:-1]
    for o, s in shapes.items():
        if s not in (space, row, row + (1,)) and output_perm(g, nodes, o, space) is None \
                and not output_view(g, set(nodes), o, space):
            return Reject(label, f"output '{o}' of shape {s} is neither the reduced tensor's shape (a "
                                 f"transpose or reshape of it) nor its row shape")
    return Region(-1, "rowreduce", tuple(sorted(nodes)), tuple(inputs), tuple(outputs), space, empty)


def creates_cycle(g: Graph, merged: set[int], group_of: Mapping[int, frozenset[int]]) -> bool:
    """True if some path leaves `merged` and comes back (through other nodes or other groups):
    the contracted graph would have a cycle."""
    limit = max(merged)
    stack = [c for n in merged for o in g.nodes[n].output if o for c in g.consumers.get(o, ()) if c not in merged]
    seen: set[int] = set()
    while stack:
        x = stack.pop()
        if x in seen or x > limit:
            continue
        members = group_of.get(x, frozenset((x,)))
        seen |= members
        for m in members:
            for o in g.nodes[m].output:
                for c in g.consumers.get(o, ()) if o else ():
                    if c in merged:
                        return True
                    if c not in seen:
                        stack.append(c)
    return False

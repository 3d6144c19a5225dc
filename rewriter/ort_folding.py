"""What ONNX Runtime's constant folding computes when a session starts: the tensors made from constants alone
that it turns into initializers, so that they cost nothing at run time. `fold_constant_subgraphs` writes the
small ones into the model itself; those too big to write (a relative-position bias gathered from its table,
each layer's [heads, S, S]) stay nodes, and ORT folds them in memory. A fused node must not take them in: ORT
cannot fold a custom op, nor anything after it, so they would run on every call.

ORT folds a node when its inputs are all initializers (not ones a user may feed) or folded, it draws no random
value, has no subgraph, is not a DequantizeLinear (kept for its quantized kernels), and its CPU EP has a kernel
for it: an fp16 Gemm or Exp, a bf16 Exp, stays a node that runs on every call. That last condition is only
ORT's to know, so ORT is asked: the candidate nodes, with the constants they read, as a model of their own
that ORT optimizes at its basic level (where its folding runs), each candidate tensor read by a Concat with a
graph input (which ORT cannot fold); the tensors the Concats then read as initializers are the folded ones.
Copies (Transpose, Reshape, Gather, ...) of the common element types fold without asking: the CPU EP has them
for every such type. Should ORT refuse the probe, each connected group is asked alone; a group ORT still
refuses, or one reading more than MAX_PROBE_BYTES of constants, counts as not folded (the fusing stays as it
was before this module)."""
from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import numpy_helper

from ortfuse.rewriter import _proto
from ortfuse.rewriter.constant_cones import connected_groups, constant_cone
from ortfuse.rewriter.graph import Graph, per_graph

MAX_PROBE_BYTES = 1 << 28  # constants one probe may copy into its model (a group reading more is not asked)
_COPIES = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Gather", "Concat",
                     "Slice"})
_COMMON = frozenset({TP.FLOAT, TP.DOUBLE, TP.FLOAT16, TP.BFLOAT16, TP.INT8, TP.INT16, TP.INT32, TP.INT64, TP.UINT8,
                     TP.UINT16, TP.UINT32, TP.UINT64, TP.BOOL})
_ANSWERS: OrderedDict[bytes, frozenset[str]] = OrderedDict()  # probe model -> its folded tensors (the search
# plans several graphs of one model: layouts, packings, attention choices; their constant cones are the same)


@per_graph
def fold_candidates(g: Graph) -> tuple[int, ...]:
    """Nodes (topological order) whose inputs are all fixed constants or outputs of such nodes: what ORT's
    folding may compute, before asking whether its CPU EP has their kernels."""
    return tuple(constant_cone(g, lambda n: all(o in g.tensors for o in n.output if o)))


@per_graph
def ort_folded(g: Graph) -> frozenset[str]:
    """Tensors ORT's constant folding makes initializers when a session starts."""
    groups = connected_groups(g, fold_candidates(g))
    done: set[str] = set()
    asked: list[list[int]] = []
    for group in groups:
        if all(_copies(g, g.nodes[i]) for i in group):
            done.update(o for i in group for o in g.nodes[i].output if o)
        elif _leaf_bytes(g, group) <= MAX_PROBE_BYTES:
            asked.append(group)
    if asked:
        together = _ask(g, [i for group in asked for i in group]) \
            if _leaf_bytes(g, [i for group in asked for i in group]) <= MAX_PROBE_BYTES else None
        for group in asked if together is None else ():
            done.update(_ask(g, group) or ())
        done.update(together or ())
    return frozenset(done)


@per_graph
def folded_nodes(g: Graph) -> frozenset[int]:
    """Indices of the nodes ORT folds away (every output folded)."""
    done = ort_folded(g)
    if not done:
        return frozenset()
    return frozenset(i for i in fold_candidates(g) if all(o in done for o in g.nodes[i].output if o))


def left_folded(g: Graph, fused: set[int] | frozenset[int]) -> frozenset[int]:
    """The folded nodes outside the `fused` ones: what ORT folds in the output model (a region never cuts a
    folded chain: `search.legal.folded_verdict`)."""
    return folded_nodes(g) - frozenset(fused)


def _copies(g: Graph, n: onnx.NodeProto) -> bool:
    return n.op_type in _COPIES and all(g.tensors[t].dtype in _COMMON for t in [*n.input, *n.output] if t)


def _leaf_bytes(g: Graph, nodes: Sequence[int]) -> int:
    made = {o for i in nodes for o in g.nodes[i].output if o}
    leaves = {x for i in nodes for x in g.nodes[i].input if x and x not in made}
    return sum(_proto.dims_bytes(g.tensors[x].dtype, g.tensors[x].shape) or 0
               if x in g.tensors and g.tensors[x].is_static else 0 for x in leaves)


def _ask(g: Graph, indices: Sequence[int]) -> frozenset[str] | None:
    """What ORT folds of these nodes, or None where it refuses the probe model (cached by that model's
    structure: node wiring, attributes and the constants' types and shapes, not their values)."""
    import onnxruntime as ort

    nodes = [g.nodes[i] for i in indices]
    made = {o for n in nodes for o in n.output if o}
    leaves = sorted({x for n in nodes for x in n.input if x and x not in made})
    probe_nodes: list[onnx.NodeProto] = []
    for k, n in enumerate(nodes):
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = f"ortfuse_probe_n{k}"
        probe_nodes.append(c)
    inputs, outputs, extra = [], [], []
    watched: dict[str, str] = {}  # the Concat reading a candidate tensor -> that tensor
    for k, t in enumerate(sorted(made)):
        info = g.tensors[t]
        if info.shape is None or info.dtype not in _COMMON:
            continue  # no Concat to write (rank unknown, a type Concat lacks): the tensor counts as not folded
        read = t
        if not info.shape:  # Concat needs rank 1: an Unsqueeze, which folds with it
            read = f"ortfuse_probe_u{k}"
            if g.opset >= 13:
                extra.append(numpy_helper.from_array(np.asarray([0], np.int64), f"ortfuse_probe_axes{k}"))
                probe_nodes.append(onnx.helper.make_node("Unsqueeze", [t, f"ortfuse_probe_axes{k}"], [read]))
            else:
                probe_nodes.append(onnx.helper.make_node("Unsqueeze", [t], [read], axes=[0]))
        fed, out, name = f"ortfuse_probe_in{k}", f"ortfuse_probe_out{k}", f"ortfuse_probe_c{k}"
        dims = [f"ortfuse_probe_d{k}_{a}" for a in range(max(len(info.shape), 1))]
        inputs.append(onnx.helper.make_tensor_value_info(fed, info.dtype, dims))
        outputs.append(onnx.helper.make_tensor_value_info(out, info.dtype, None))
        probe_nodes.append(onnx.helper.make_node("Concat", [read, fed], [out], name=name, axis=0))
        watched[name] = t
    if not watched:
        return frozenset()
    opsets = [o for o in g.model.opset_import if o.domain in ("", "ai.onnx")] or \
        [onnx.helper.make_opsetid("", g.opset)]
    shape_only = [onnx.helper.make_tensor_value_info(x, g.tensors[x].dtype, g.tensors[x].shape) for x in leaves]
    key = onnx.helper.make_model(onnx.helper.make_graph(probe_nodes, "p", inputs + shape_only, outputs),
                                 opset_imports=opsets).SerializeToString()
    if key in _ANSWERS:
        _ANSWERS.move_to_end(key)
        return _ANSWERS[key]
    inits = [numpy_helper.from_array(np.asarray(g.constants[x]), x) for x in leaves] + extra
    m = onnx.helper.make_model(onnx.helper.make_graph(probe_nodes, "ortfuse_folding_probe", inputs, outputs, inits),
                               opset_imports=opsets)
    m.ir_version = _proto.MAX_IR_VERSION
    with tempfile.TemporaryDirectory(prefix="ortfuse-fold-") as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.log_severity_level = 4
        so.optimized_model_filepath = str(Path(tmp) / "probe.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "probe.bin")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        try:
            ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            optimized = onnx.load(so.optimized_model_filepath, load_external_data=False)
        except Exception:  # noqa: BLE001 -- ORT refused the probe (a kernel it lacks, a type): not an answer
            return None
    # a folded tensor is an initializer the Concat reads (by another name where ORT eliminated its node: an
    # Identity, an Unsqueeze of an initializer)
    constant = {t.name for t in optimized.graph.initializer}
    answer = frozenset(watched[n.name] for n in optimized.graph.node if n.name in watched and n.input[0] in constant)
    _ANSWERS[key] = answer
    if len(_ANSWERS) > 32:
        _ANSWERS.popitem(last=False)
    return answer

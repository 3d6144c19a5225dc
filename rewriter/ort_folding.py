"""What ONNX Runtime's constant folding computes when a session starts: the tensors made from constants alone
that it turns into initializers, so that they cost nothing at run time. `fold_constant_subgraphs` writes the
small ones into the model itself; those too big to write (a relative-position bias gathered from its table,
each layer's [heads, S, S]) stay nodes, and ORT folds them in memory. A fused node must not take them in: ORT
cannot fold a custom op, nor anything after it, so they would run on every call.

ORT folds a node when its inputs are all initializers (not ones a user may feed) or folded, it draws no random
value, has no subgraph, is not a graph output, is not a DequantizeLinear (kept for its quantized kernels), and
its CPU EP has a kernel for it: an fp16 Gemm or Exp, a bf16 anything, stays a node that runs on each call.
That last condition is only ORT's to know, so ORT is asked: the candidate nodes, with the constants they read,
as a model of their own that ORT optimizes at its basic level (where its folding runs), each candidate tensor
read by a Concat with a graph input (which ORT cannot fold); the tensors that come out as initializers are the
folded ones."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.rewriter import _proto
from ortfuse.rewriter.canonical import draws
from ortfuse.rewriter.graph import Graph, per_graph

_KEPT = frozenset({"DequantizeLinear"})  # ORT's folding skips them unless QDQ handling is off


@per_graph
def fold_candidates(g: Graph) -> tuple[int, ...]:
    """Nodes (topological order) whose inputs are all fixed constants or outputs of such nodes: what ORT's
    folding may compute, before asking whether its CPU EP has their kernels."""
    made: set[str] = set()
    nodes: list[int] = []
    for i, n in enumerate(g.nodes):
        outs = [o for o in n.output if o]
        ins = [x for x in n.input if x]
        if not outs or not ins or n.op_type in _KEPT or draws(n.op_type) or _proto.has_subgraph(n) \
                or any(o in g.graph_outputs or o not in g.tensors for o in outs) \
                or not all(x in made or (x in g.constants and not g.fed(x)) for x in ins):
            continue
        nodes.append(i)
        made.update(outs)
    return tuple(nodes)


@per_graph
def ort_folded(g: Graph) -> frozenset[str]:
    """Tensors ORT's constant folding makes initializers when a session starts (empty where ORT refuses the
    probe: nothing is assumed folded then)."""
    candidates = fold_candidates(g)
    return _probe(g, candidates) if candidates else frozenset()


@per_graph
def folded_nodes(g: Graph) -> frozenset[int]:
    """Indices of the nodes ORT folds away (every output folded)."""
    done = ort_folded(g)
    if not done:
        return frozenset()
    return frozenset(i for i in fold_candidates(g) if all(o in done for o in g.nodes[i].output if o))


def _probe(g: Graph, candidates: tuple[int, ...]) -> frozenset[str]:
    import onnxruntime as ort

    nodes = [g.nodes[i] for i in candidates]
    made = {o for n in nodes for o in n.output if o}
    leaves = sorted({x for n in nodes for x in n.input if x and x not in made})
    probe_nodes: list[onnx.NodeProto] = []
    inits_extra: list[onnx.TensorProto] = []
    for k, n in enumerate(nodes):
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = f"n{k}"
        probe_nodes.append(c)
    inputs, outputs = [], []
    watched: dict[str, str] = {}  # the Concat reading a candidate tensor -> that tensor
    for k, t in enumerate(sorted(made)):
        shape = g.tensors[t].shape
        if shape is None:
            continue  # rank unknown: no Concat to write; the tensor counts as not folded
        read = t
        if not shape:  # Concat needs rank 1: an Unsqueeze, which folds with it
            read = f"probe_u{k}"
            if g.opset >= 13:
                axes = f"probe_axes{k}"
                inits_extra.append(numpy_helper.from_array(np.asarray([0], dtype=np.int64), axes))
                probe_nodes.append(onnx.helper.make_node("Unsqueeze", [t, axes], [read], name=f"u{k}"))
            else:
                probe_nodes.append(onnx.helper.make_node("Unsqueeze", [t], [read], name=f"u{k}", axes=[0]))
        fed, out = f"probe_in{k}", f"probe_out{k}"
        dtype = g.tensors[t].dtype
        inputs.append(onnx.helper.make_tensor_value_info(fed, dtype, [f"d{k}_{a}" for a in range(max(len(shape), 1))]))
        outputs.append(onnx.helper.make_tensor_value_info(out, dtype, None))
        probe_nodes.append(onnx.helper.make_node("Concat", [read, fed], [out], name=f"c{k}", axis=0))
        watched[f"c{k}"] = t
    inits = [numpy_helper.from_array(np.asarray(g.constants[x]), x) for x in leaves] + inits_extra
    graph = onnx.helper.make_graph(probe_nodes, "ort_folding_probe", inputs, outputs, inits)
    opsets = [o for o in g.model.opset_import if o.domain in ("", "ai.onnx")] or \
        [onnx.helper.make_opsetid("", g.opset)]
    m = onnx.helper.make_model(graph, opset_imports=opsets)
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
            out = onnx.load(so.optimized_model_filepath, load_external_data=False)
        except Exception:  # noqa: BLE001 -- ORT refused the probe (a kernel it lacks): assume nothing folds
            return frozenset()
    # a folded tensor is an initializer the Concat reads (by another name where ORT eliminated its node:
    # an Identity, an Unsqueeze of an initializer)
    constant = {t.name for t in out.graph.initializer}
    return frozenset(watched[n.name] for n in out.graph.node if n.name in watched and n.input[0] in constant)

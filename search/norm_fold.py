"""LayerNorm prologues: a LayerNormalization whose only reader is a MatMul/Gemm's A operand (pre-LN
transformers: ln_1 -> QKV, ln_2 -> FC1) folds into that GEMM's kernel (docs/design.md, "LayerNorm
prologues"). With W' = diag(gamma) W, c = colsum(W') and d = beta W made offline,

    LN(X) W = rstd * (X W' - mean * c) + d    (per row of X),

so the kernel multiplies X itself, gathers each row's mean and rstd from the A tiles it already streams
through shared memory, and corrects the accumulators before the epilogue (ortfuse_gemm.h). The normalized
tensor is never written, and the kernel that produced X no longer needs a row-spanning tile for the
LayerNorm. This module says which LayerNorms qualify; the lowering and the rewriter do the rest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import onnx

from ortfuse.customops import scalar
from ortfuse.rewriter.layernorm_fold import folded_weight
from ortfuse.rewriter.graph import Graph, per_graph
from ortfuse.search import ops

# Layout ops between the LayerNorm and the GEMM that keep the last axis (HF Conv1D's view(-1, hidden)).
ROW_LAYOUT = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
DTYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


@dataclass(frozen=True)
class NormFold:
    norm: int  # the LayerNormalization node
    chain: tuple[int, ...]  # layout nodes from its output to the GEMM's A
    anchor: int  # the MatMul/Gemm
    x: str  # the LayerNorm's input: the GEMM kernel's A
    scale: str
    bias: str  # "" without one
    epsilon: float
    weight: str  # the GEMM's B, a constant read by nothing else
    trans_b: bool
    k: int  # the normalized length = the GEMM's K

    @property
    def nodes(self) -> tuple[int, ...]:
        return (self.norm, *self.chain)


def _fed(g: Graph, t: str) -> bool:
    """An initializer the user may override at run time (also a graph input)."""
    return any(v.name == t for v in g.model.graph.input)


def find(g: Graph, anchor: int) -> Union[NormFold, str, None]:
    """The LayerNorm feeding `anchor`'s A operand as a NormFold; a reason (str) when there is one that cannot
    fold; None when A does not come from a LayerNormalization."""
    return _all(g).get(anchor)


@per_graph
def _all(g: Graph) -> dict[int, Union[NormFold, str]]:
    found = {}
    for i, n in enumerate(g.nodes):
        if n.op_type in ops.GEMM:
            f = _find(g, i)
            if f is not None:
                found[i] = f
    return found


def _find(g: Graph, anchor: int) -> Union[NormFold, str, None]:
    node = g.nodes[anchor]
    if node.op_type not in ops.GEMM:
        return None
    chain: list[int] = []
    t = node.input[0]
    while True:
        p = g.producer.get(t)
        if p is None:
            return None
        pn = g.nodes[p]
        if pn.op_type == "LayerNormalization":
            break
        if pn.op_type not in ROW_LAYOUT or len(chain) > 4:
            return None
        chain.append(p)
        t = pn.input[0]
    norm = g.nodes[p]
    users = chain[::-1][1:] + [anchor]  # each tensor of the chain, LayerNorm output first, has one reader
    for producer, reader in zip([p] + chain[::-1], users):
        out = g.nodes[producer].output[0]
        if out in g.graph_outputs or list(g.consumers.get(out, ())) != [reader]:
            return "the LayerNorm's result is also read elsewhere, so it is written anyway"
    shape = lambda x: g.tensors[x].shape if x in g.tensors else None  # noqa: E731
    x = norm.input[0]
    xs = shape(x)
    if not xs or not isinstance(xs[-1], int):
        return "the normalized length is not static"
    k = xs[-1]
    for q in [p] + chain:
        s = shape(g.nodes[q].output[0])
        if not s or s[-1] != k:
            return f"{g.node_label(q)} changes the last axis between the LayerNorm and the GEMM"
    if any(o and (g.consumers.get(o) or o in g.graph_outputs) for o in norm.output[1:]):
        return "the LayerNorm's Mean/InvStdDev outputs are used"
    axis = scalar.attr(norm, "axis", -1)
    if axis % len(xs) != len(xs) - 1:
        return f"the LayerNorm normalizes from axis {axis}, not the last axis only"
    if scalar.attr(norm, "stash_type", 1) != 1:
        return "the LayerNorm computes in its input precision (stash_type 0)"
    if node.op_type == "Gemm":
        if scalar.attr(node, "transA", 0) or float(scalar.attr(node, "alpha", 1.0)) != 1.0:
            return "a Gemm with transA or alpha"
    trans_b = node.op_type == "Gemm" and bool(scalar.attr(node, "transB", 0))
    scale, bias, weight = norm.input[1], norm.input[2] if len(norm.input) > 2 else "", node.input[1]
    dtype = g.tensors[x].dtype
    if dtype not in DTYPES:
        return f"{onnx.TensorProto.DataType.Name(dtype)} data"
    for what, c in (("scale", scale), ("bias", bias), ("weight", weight)):
        if c and (c not in g.constants or _fed(g, c)):
            return f"the {what} '{c}' is not a constant"
        if c and g.tensors[c].dtype != dtype:
            return f"the {what} '{c}' has another element type than the data"
    if len({scale, bias, weight} - {""}) < 2 + bool(bias):
        return "the scale, bias and weight are not distinct tensors"
    for c in (scale, bias):
        if c and np.asarray(g.constants[c]).shape != (k,):
            return f"'{c}' is not a vector of the normalized length {k}"
    w = np.asarray(g.constants[weight])
    if w.ndim != 2 or w.shape[1 if trans_b else 0] != k:
        return f"the weight '{weight}' is not a {k}-row matrix"
    if list(g.consumers.get(weight, ())) != [anchor]:
        return f"the weight '{weight}' is also read elsewhere: scaling it by the LayerNorm's gamma would copy it"
    if not np.isfinite(folded_weight(w, np.asarray(g.constants[scale]), trans_b)).all():
        return "the weight scaled by the LayerNorm's gamma overflows its element type"
    return NormFold(p, tuple(chain[::-1]), anchor, x, scale, bias, float(scalar.attr(norm, "epsilon", 1e-5)), weight,
                    trans_b, k)


def in_region(g: Graph, nodes: frozenset[int] | set[int] | tuple[int, ...]) -> Optional[NormFold]:
    """The NormFold a region holds (its LayerNorm and the GEMM it feeds both inside), if any."""
    members = set(nodes)
    for i, f in _all(g).items():
        if i in members and isinstance(f, NormFold) and set(f.nodes) <= members:
            return f
    return None

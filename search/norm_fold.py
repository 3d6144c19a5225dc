"""LayerNorm prologues: a LayerNormalization whose only reader is a MatMul/Gemm's A operand (pre-LN
transformers: ln_1 -> QKV, ln_2 -> FC1) folds into that GEMM's kernel (docs/design.md, "LayerNorm
prologues"). With W'' = diag(gamma) W centered per column and b' = b + beta W made offline
(rewriter/layernorm_fold.py),

    LN(X) W + b = rstd * (X W'') + b'    (per row of X),

so the kernel multiplies X itself, gathers each row's rstd from the A tiles it already streams through
shared memory, and scales the accumulators before the epilogue (ortfuse_gemm.h). The normalized tensor is
never written, and the kernel that produced X no longer needs a row-spanning tile for the LayerNorm. A
non-zero beta needs a bias vector added to the GEMM's result to carry beta W (the Add that follows, or a
Gemm's C). This module says which LayerNorms qualify; the lowering and the rewriter do the rest."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import onnx

from ortfuse.customops import scalar
from ortfuse.rewriter.layernorm_fold import needs_bias
from ortfuse.rewriter.graph import Graph, per_graph
from ortfuse.search import ops

# Layout ops between the LayerNorm and the GEMM that keep the last axis (HF Conv1D's view(-1, hidden)).
ROW_LAYOUT = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
# 16-bit data only: folding changes where the product rounds (W'' is rounded, the normalized activations are
# not), by about one rounding of either, well inside fp16/bf16 parity but at the size of fp32's 1e-5; and
# fp32 GEMMs (SIMT) gain nothing from it (the cost model rejected every fp32 zoo fold).
DTYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


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
    gemm_bias: str  # the bias vector that carries beta W ("" where beta is absent or zero)
    bias_add: Optional[int]  # the Add of gemm_bias to the GEMM's result (None: none, or a Gemm's C)

    @property
    def nodes(self) -> tuple[int, ...]:
        """The nodes that join the GEMM's region with it."""
        return (self.norm, *self.chain) + ((self.bias_add,) if self.bias_add is not None else ())


def find(g: Graph, anchor: int) -> Union[NormFold, str, None]:
    """The LayerNorm feeding `anchor`'s A operand as a NormFold; a reason (str) when there is one that cannot
    fold; None when A does not come from a LayerNormalization."""
    return candidates(g).get(anchor)


@per_graph
def candidates(g: Graph) -> dict[int, Union[NormFold, str]]:
    """`find` for every MatMul/Gemm whose A comes from a LayerNormalization, by anchor."""
    found = {}
    for i, n in enumerate(g.nodes):
        if n.op_type in ops.GEMM:
            f = _find(g, i)
            if f is not None:
                found[i] = f
    return found


def _find(g: Graph, anchor: int) -> Union[NormFold, str, None]:
    node = g.nodes[anchor]
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
    forward = [p] + chain[::-1]  # the LayerNorm, then the layout ops in order: each has one reader, the next
    for producer, reader in zip(forward, forward[1:] + [anchor]):
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
        return f"{onnx.TensorProto.DataType.Name(dtype)} data: LayerNorms fold into 16-bit GEMMs only"
    for what, c in (("scale", scale), ("bias", bias), ("weight", weight)):
        if c and (c not in g.constants or g.fed(c)):
            return f"the {what} '{c}' is not a constant"
        if c and g.tensors[c].dtype != dtype:
            return f"the {what} '{c}' has another element type than the data"
    if len({scale, bias, weight} - {""}) < 2 + bool(bias):
        return "the scale, bias and weight are not distinct tensors"  # each slot gets its own folded data
    for c in (scale, bias):
        if c and tuple(g.tensors[c].shape or ()) != (k,):
            return f"'{c}' is not a vector of the normalized length {k}"
    ws = tuple(g.tensors[weight].shape or ())
    if len(ws) != 2 or ws[1 if trans_b else 0] != k:
        return f"the weight '{weight}' is not a {k}-row matrix"
    if list(g.consumers.get(weight, ())) != [anchor]:
        return f"the weight '{weight}' is also read elsewhere: scaling it by the LayerNorm's gamma would copy it"
    w = np.asarray(g.constants[weight])
    gamma = np.asarray(g.constants[scale], dtype=np.float64)
    if not 2 * np.abs(gamma).max() * float(np.abs(w).max()) < 65504:  # fp16's largest (bf16's is more)
        return "the weight scaled by the LayerNorm's gamma could overflow its element type"
    gemm_bias, bias_add = "", None
    n_out = w.shape[0 if trans_b else 1]
    if needs_bias(g.constants[bias] if bias else None):
        found = _gemm_bias(g, anchor, n_out, dtype)
        if isinstance(found, str):
            return found
        gemm_bias, bias_add = found
        if gemm_bias in (scale, bias, weight):
            return f"the GEMM's bias '{gemm_bias}' is also the LayerNorm's scale, bias or the weight"
    return NormFold(p, tuple(chain[::-1]), anchor, x, scale, bias, float(scalar.attr(norm, "epsilon", 1e-5)), weight,
                    trans_b, k, gemm_bias, bias_add)


def _gemm_bias(g: Graph, anchor: int, n: int, dtype: int) -> Union[tuple[str, Optional[int]], str]:
    """The constant bias vector added to the GEMM's result, which takes beta W: a Gemm's C, or the one Add
    reading the result with a constant of N elements along the last axis. A reason where there is none."""
    node = g.nodes[anchor]
    why = "the LayerNorm's beta needs a bias vector added to the GEMM's result to fold into"

    def vector(t: str) -> bool:
        if t not in g.constants or g.fed(t) or g.tensors[t].dtype != dtype:
            return False
        shape = np.asarray(g.constants[t]).shape
        return len(shape) >= 1 and shape[-1] == n and int(np.prod(shape)) == n

    if node.op_type == "Gemm":
        if len(node.input) > 2 and node.input[2]:
            c = node.input[2]
            ok = vector(c) and float(scalar.attr(node, "beta", 1.0)) == 1.0
            return (c, None) if ok else why + " (a Gemm's C of N elements, with beta 1)"
        return why
    out = node.output[0]
    users = g.consumers.get(out, ())
    if out in g.graph_outputs or len(users) != 1 or g.nodes[users[0]].op_type != "Add":
        return why
    add = g.nodes[users[0]]
    other = add.input[1] if add.input[0] == out else add.input[0]
    if other == out or not vector(other) or g.tensors[add.output[0]].shape != g.tensors[out].shape:
        return why
    return other, users[0]  # (other readers keep reading b: the fused node is given its own b')


def in_region(g: Graph, nodes: frozenset[int] | set[int] | tuple[int, ...]) -> Optional[NormFold]:
    """The NormFold a region holds (its LayerNorm and the GEMM it feeds both inside), if any."""
    members = set(nodes)
    for i, f in candidates(g).items():
        if i in members and isinstance(f, NormFold) and set(f.nodes) <= members:
            return f
    return None

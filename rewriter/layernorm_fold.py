"""The rewriter's side of a LayerNorm folded into the GEMM that reads it (search/norm_fold.py, docs/design.md
"LayerNorm prologues"): the constants the kernel reads instead of the weight, gamma and beta, and the fused
node's function body, which must compute what the node's inputs now mean."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper


@dataclass(frozen=True)
class LayerNormFold:
    """Inputs of a fused node that carry folded constants: the weight's slot gets W' = diag(gamma) W, the
    scale's slot c = colsum(W') and the bias's slot d = beta W (both fp32 [N]). The function body runs the
    LayerNorm without its affine part (scale 1, no bias), the GEMM on W', then adds d."""
    norm_output: str  # the LayerNormalization's output inside the region
    product: str  # the GEMM's output
    weight: str
    scale: str
    bias: str  # "" without one
    trans_b: bool


def folded_weight(w: np.ndarray, gamma: np.ndarray, trans_b: bool) -> np.ndarray:
    """W' = diag(gamma) W in W's dtype (rows of a [K][N] weight, columns of a transposed [N][K] one)."""
    g = gamma.astype(np.float64)
    return (w.astype(np.float64) * (g[None, :] if trans_b else g[:, None])).astype(w.dtype)


def folded_constants(w: np.ndarray, gamma: np.ndarray, beta: Optional[np.ndarray],
                     trans_b: bool) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """(W', c, d): c = the column sums of W' as stored (so the mean's term cancels X W' exactly where X is
    constant along the row) and d = beta W, both fp32 vectors of N, summed in float64."""
    wf = folded_weight(w, gamma, trans_b)
    wk = wf.astype(np.float64).T if trans_b else wf.astype(np.float64)  # [K][N]
    c = wk.sum(axis=0).astype(np.float32)
    d = None
    if beta is not None:
        w64 = w.astype(np.float64).T if trans_b else w.astype(np.float64)
        d = (beta.astype(np.float64) @ w64).astype(np.float32)
    return wf, c, d


def fold_body(body: list[onnx.NodeProto], fold: LayerNormFold, rename: dict[str, str], k: int, dtype: int) -> None:
    """Rewrites the function body (nodes already renamed by `rename`) in place for the fold: the LayerNorm
    gets a ones scale and no bias, and d (the bias slot, fp32) is added to the GEMM's result."""
    y, p = rename[fold.norm_output], rename[fold.product]
    ones = numpy_helper.from_array(np.ones(k, np.float32), "lnf_one")
    if dtype != onnx.TensorProto.FLOAT:
        body.insert(0, onnx.helper.make_node("Cast", ["lnf_one32"], ["lnf_one"], to=dtype))
        ones.name = "lnf_one32"
    body.insert(0, onnx.helper.make_node("Constant", [], [ones.name], value=ones))
    for n in body:
        if n.op_type == "LayerNormalization" and n.output[0] == y:
            n.input[1] = "lnf_one"
            del n.input[2:]
        if p in n.output and fold.bias:
            n.output[list(n.output).index(p)] = "lnf_p"
    if fold.bias:
        at = next(j for j, n in enumerate(body) if "lnf_p" in n.output) + 1
        d = rename[fold.bias]
        if dtype != onnx.TensorProto.FLOAT:
            body.insert(at, onnx.helper.make_node("Cast", [d], ["lnf_d"], to=dtype))
            d, at = "lnf_d", at + 1
        body.insert(at, onnx.helper.make_node("Add", ["lnf_p", d], [p]))

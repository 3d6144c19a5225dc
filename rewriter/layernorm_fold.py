"""The rewriter's side of a LayerNorm folded into the GEMM that reads it (search/norm_fold.py, docs/design.md
"LayerNorm prologues"): the constants the fused node gets in place of the weight, gamma, beta and the GEMM's
bias. Its function body stays the region's own sub-graph, on those constants:

    LN(X; gamma, beta) W + b  =  LN(X; 1, 0) W'' + b'    with  W'' = diag(gamma) W - colmean(diag(gamma) W),
                                                              b' = b + beta W.

Rows of LN(X; 1, 0) sum to zero, so centering W'' changes nothing there; and since each column of W'' sums
to zero, X W'' = (X - mean) W'' for any row X: the kernel multiplies X itself and only scales each row's
result by 1/sqrt(var + eps). The columns are made to sum to zero as stored (rounded), or a large row mean
would leave its multiple of the rounding residue in the result."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

# Making a column of W'' sum to zero as stored: rounds of flipping elements to their other neighbour (each
# to the side it was rounded away from, so its error stays within one ulp), the cheapest flips first, from
# the CANDIDATES cheapest per column.
FLIP_ROUNDS = 6
CANDIDATES = 64


@dataclass(frozen=True)
class LayerNormFold:
    """Slots of a fused node that carry folded constants (module docstring)."""
    weight: str  # the GEMM's B: gets W''
    scale: str  # the LayerNorm's gamma: gets ones
    bias: str  # the LayerNorm's beta ("" without one): gets zeros
    gemm_bias: str  # the bias added to the GEMM's result ("" where beta is absent or zero): gets b + beta W
    trans_b: bool


def folded_weight(w: np.ndarray, gamma: np.ndarray, trans_b: bool) -> np.ndarray:
    """W'' in W's dtype and layout ([K][N], or [N][K] for a transposed B): gamma-scaled, each column
    centered and rounded so that its stored elements sum to zero (`_zero_sums`)."""
    # worked on as [N][K] rows (each a column of W), contiguous for the per-column reductions
    nk = np.ascontiguousarray(w.astype(np.float64) if trans_b else w.astype(np.float64).T)
    nk *= gamma.astype(np.float64)[None, :]
    nk -= nk.mean(axis=1, keepdims=True)
    out = nk.astype(w.dtype)
    _zero_sums(out, nk)
    return np.ascontiguousarray(out if trans_b else out.T)


def _zero_sums(out: np.ndarray, exact: np.ndarray) -> None:
    """Rounds each row of `out` (the rounded `exact`, whose rows sum to zero) to the other neighbour of some
    of its elements until the row's stored sum is as near zero as its elements' spacing allows. A flip moves
    an element rounded towards the residue's side by one step the other way: its error, at most half a step,
    becomes at most one step, and the cheapest flips (errors nearest half a step) go first."""
    if out.shape[1] < 2:
        return
    c = min(CANDIDATES, out.shape[1])
    live = np.arange(out.shape[0])
    for _ in range(FLIP_ROUNDS):
        sub = out[live]
        r32 = sub.astype(np.float32)  # element values and their errors: fp32 resolves a 16-bit ulp exactly
        res = r32.sum(axis=1, dtype=np.float64)
        live, sub, r32, res = live[res != 0], sub[res != 0], r32[res != 0], res[res != 0]
        if not len(live):
            return
        exact32 = exact[live].astype(np.float32)
        rows = np.arange(len(live))[:, None]
        side = np.sign(res).astype(np.float32)[:, None]
        moved = _neighbour(sub, -side)
        m32 = moved.astype(np.float32)
        step = np.abs(m32 - r32)
        err = (r32 - exact32) * side  # > 0: rounded towards the residue's side
        cost = np.where((err > 0) & np.isfinite(m32) & (step < 2 * np.abs(res)[:, None]), step - 2 * err, np.inf)
        pick = np.argpartition(cost, c - 1, axis=1)[:, :c]
        pick = np.take_along_axis(pick, np.argsort(np.take_along_axis(cost, pick, axis=1), axis=1), axis=1)
        ok = np.isfinite(np.take_along_axis(cost, pick, axis=1))
        st = np.where(ok, np.take_along_axis(step, pick, axis=1), 0.0).astype(np.float64)
        cum = np.cumsum(st, axis=1)
        take = ok & (cum - st / 2 < np.abs(res)[:, None])  # each flip brings the sum strictly nearer zero
        if not take.any():
            return
        r, k = np.broadcast_to(rows, pick.shape)[take], pick[take]
        sub[r, k] = moved[r, k]
        out[live] = sub


def _neighbour(a: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """The next representable value of each element of the float array `a` towards the sign of `direction`
    (broadcast), by stepping its IEEE bits (float16, bfloat16, float32)."""
    uint = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    bits = a.view(uint).astype(np.int32 if a.dtype.itemsize == 2 else np.int64)
    top = 1 << (8 * a.dtype.itemsize - 1)
    up = direction > 0
    away = (bits >= top) ^ up  # moving away from zero: the magnitude's bits grow
    stepped = bits + (away.astype(np.int8) * 2 - 1)
    zero = (bits & (top - 1)) == 0
    if zero.any():  # from +-0 to the smallest subnormal
        stepped[zero] = np.where(np.broadcast_to(up, a.shape)[zero], 1, top + 1)
    return stepped.astype(uint).view(a.dtype)


def folded_bias(w: np.ndarray, beta: np.ndarray, b: np.ndarray, trans_b: bool) -> np.ndarray:
    """b' = b + beta W, in b's dtype and shape, summed in float64."""
    wk = w.astype(np.float64).T if trans_b else w.astype(np.float64)
    return (b.astype(np.float64) + (beta.astype(np.float64) @ wk).reshape(b.shape)).astype(b.dtype)


def fold_constants(fold: LayerNormFold, constants) -> dict[str, np.ndarray]:
    """{slot: new data} for a fold, from the graph's constants."""
    w, gamma = np.asarray(constants[fold.weight]), np.asarray(constants[fold.scale])
    out = {fold.weight: folded_weight(w, gamma, fold.trans_b), fold.scale: np.ones_like(gamma)}
    if fold.bias:
        beta = np.asarray(constants[fold.bias])
        out[fold.bias] = np.zeros_like(beta)
        if fold.gemm_bias:
            out[fold.gemm_bias] = folded_bias(w, beta, np.asarray(constants[fold.gemm_bias]), fold.trans_b)
    return out


def needs_bias(beta: Optional[np.ndarray]) -> bool:
    """Whether beta W must go into a bias after the GEMM (beta present and not all zeros)."""
    return beta is not None and bool(np.any(np.asarray(beta, dtype=np.float64) != 0))

"""Gated MLPs as one GEMM: SiLU(x Wg) * (x Wu) (Llama) and GELU(x Wg) * (x Wu) (GeGLU). The rewriter packs the
two weights with their columns alternating (rewriter.gemm_packing), two Slices of step 2 read the halves back, and
the GEMM kernel's epilogue gets each output column's gate and up values as one fragment pair
(legal.gated_reads, lower_gemm's gated epilogue). Checked in CPU emulation: through the whole optimizer
against ORT CPU on the original model (fp16 1e-2, tf32 5e-3 normwise), and each tile family forced on the
packed graph against numpy in fp64 on the rounded operands (fp16 and bf16, 1e-2; partial tiles on every
axis, split-K). The same kernels on the GPU: tests/runtime/test_gpu_wgmma.py."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import (const, fused_parity, gated_mlp, launch_spec, model, node, raw_init, rounded_operands,
                     sass_or_skip, vi)
from ortfuse.api import compile_model, target_for
from ortfuse.config import Options
from ortfuse.customops.lower import lower

F, H, BF = TP.FLOAT, TP.FLOAT16, TP.BFLOAT16


def test_gated_mlp_is_one_gemm_kernel_with_interleaved_weights():
    # a Llama MLP at a symbolic batch: the gate and up projections become one GEMM over the packed weight,
    # whose epilogue writes h; the down projection with the residual is a second GEMM kernel
    K, N = 64, 96
    m, (wg, _), (wu, _) = gated_mlp(H, K, N, ("n", 7), down=True)
    for rows in (1, 3):
        res = fused_parity(m, {"x": ("n", 7, K)}, {"x": (rows, 7, K)}, ("gemm", "gemm"))
    assert not [n for n in res.model.graph.node if n.op_type in ("MatMul", "Slice")]
    (gated,) = [k for k in res.kernels if any(res.graph.nodes[i].op_type == "Slice" for i in k.region.nodes)]
    region_ops = sorted(res.graph.nodes[i].op_type for i in gated.region.nodes)
    assert region_ops == ["MatMul", "Mul", "Mul", "Sigmoid", "Slice", "Slice"], region_ops
    packed = next(i for i in gated.region.nodes if res.graph.nodes[i].op_type == "MatMul")
    w = res.graph.constants[res.graph.nodes[packed].input[1]]
    assert w.shape == (K, 2 * N)
    assert np.array_equal(w[:, 0::2], wg) and np.array_equal(w[:, 1::2], wu)  # columns alternate
    assert "epi8" in gated.compiled.source  # 4 outputs per 8 columns, stored as one vector


def test_geglu_and_odd_output_widths():
    # the tanh GELU on the gate; N = 50: 100 GEMM columns, outputs whose rows are 4-byte aligned only (no epi8)
    m, _, _ = gated_mlp(H, 40, 50, (5, 3), gelu=True, seed=8)
    res = fused_parity(m, {}, None, ("gemm",))
    assert "epi8" not in res.kernels[0].compiled.source


def test_fp32_pairs_need_tf32():
    # fp32 without tf32 runs on SIMT lanes, which hold single columns: the packing is undone and the gate's
    # GEMM keeps its own epilogue; with --tf32 the pairs are fragments again and the MLP is one kernel
    m, _, _ = gated_mlp(F, 64, 96, (3, 7), seed=4)
    res = compile_model(m, None, "sm_80,sm_90", options=Options(archs=(80, 90)))
    assert not any(n.op_type == "Slice" for n in res.graph.nodes)
    res = fused_parity(m, {}, None, ("gemm",), tf32=True)
    assert sum(res.graph.nodes[i].op_type == "Slice" for i in res.kernels[0].region.nodes) == 2


def _packed(dt: int, M: int, K: int, N: int, seed: int):
    """The gated MLP's packed graph and GEMM region (sm_90, wgmma on), the packed weight's bits and the fp64
    reference SiLU(x Wg) * (x Wu) on the rounded operands."""
    m, (wg, wgv), (wu, wuv) = gated_mlp(dt, K, N, (M,), seed=seed)
    ((x, xv),) = rounded_operands(((M, K),), dt, seed + 1)
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), wgmma=True))
    (k,) = res.kernels
    g = xv @ wgv
    ref = g / (1.0 + np.exp(-g)) * (xv @ wuv)
    return res.graph, k.region, x, np.stack([wg, wu], -1).reshape(K, 2 * N), ref


def _as_f64(bits: np.ndarray, dt: int) -> np.ndarray:
    return bits.astype(np.float64) if dt == H else (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("tile", [
    (128, 128, 32, 64, 32, 3, 1),         # mma.sync
    (64, 64, 32, 32, 32, 3, 2),           # mma.sync, split-K in clusters of 2
    (64, 64, 64, 16, 64, 4, 1, 1),        # wgmma fed by cp.async
    (128, 256, 64, 16, 128, 4, 1, 1),
    (64, 64, 64, 16, 64, 4, 4, 1),        # split-K in clusters of 4
    (128, 128, 64, 16, 128, 7, 1, 2),     # TMA, two consumer warpgroups
    (128, 192, 64, 16, 192, 5, 1, 3),     # B multicast
    (128, 128, 64, 32, 128, 5, 1, 4),     # ping-pong consumers
])
@pytest.mark.parametrize("dt", [H, BF])
def test_every_tile_family_stores_gated_pairs(tile, dt):
    # M 150, K 520, 2N = 200 GEMM columns: partial tiles on every axis
    M, K, N = 150, 520, 100
    g, region, x, w, ref = _packed(dt, M, K, N, seed=11)
    spec = lower(g, region, target_for((90,), True), tile=tile)
    assert spec.split_k == tile[6]
    if spec.input_perms:  # the warpgroup families read the packed weight transposed, as the rewriter stores it
        w = np.ascontiguousarray(w.T)
    out = np.zeros((M, N), x.dtype)
    launch_spec(spec, [x, w, out], [])
    got = _as_f64(out, dt)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_siblings_that_are_not_gated_stay_apart():
    # two projections of x of one width with epilogues of their own: no region reads both halves, so the
    # interleaved packing is tried, not fused, and undone (each GEMM keeps its own epilogue kernel)
    (wa, _), (wb, _) = rounded_operands(((64, 96), (64, 96)), H, 6)
    m = model([node("MatMul", ["x", "wa"], ["a"]), node("MatMul", ["x", "wb"], ["b"]), node("Relu", ["a"], ["ra"]),
               node("Tanh", ["b"], ["tb"])], [vi("x", H, ["n", 7, 64])], [vi("ra", H, None), vi("tb", H, None)],
              [raw_init("wa", wa, H), raw_init("wb", wb, H)])
    res = fused_parity(m, {"x": ("n", 7, 64)}, {"x": (2, 7, 64)}, ("gemm", "gemm"))
    assert not any(n.op_type == "Slice" for n in res.graph.nodes)
    assert sorted(res.graph.nodes[i].input[1] for k in res.kernels for i in k.region.nodes
                  if res.graph.nodes[i].op_type == "MatMul") == ["wa", "wb"]


def test_whole_tiles_store_four_outputs_at_once():
    # Llama's shape (K 576, N 1536 a projection) at 128 rows a batch: the whole-tile epilogue stores the 4
    # fp16 outputs of each 8 columns as one 8-byte word (ofz::store_vec: NVVM split a uint2 store in two)
    sass = sass_or_skip()
    m, _, _ = gated_mlp(H, 576, 1536, ("batch", 128), seed=2)
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    (k,) = res.kernels
    ops = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in sass(dict(k.compiled.cubins)[90])]
    stores = [op for op in ops if op.startswith("STG")]
    assert "STG.E.64" in stores and "STG.E" not in stores, stores  # partial tiles: one 2-byte store a pair
    assert dict(k.compiled.resources)[90].spill_bytes == 0


@pytest.mark.parametrize("chunk", ["split", "slices"])
def test_a_weight_holding_both_halves_is_interleaved(chunk):
    # Phi-3's gate_up_proj: one [K, 2N] weight, its result chunked in two (a Split, or two Slices as some
    # exporters write chunk) and combined by SiLU(gate) * up: the halves' columns are interleaved offline
    K, N = 64, 48
    ((w, _),) = rounded_operands(((K, 2 * N),), H, 12)
    cut = [node("Split", ["y", "sizes"], ["g", "u"], axis=-1)] if chunk == "split" else [
        node("Slice", ["y", "z", "n", "ax"], ["g"]), node("Slice", ["y", "n", "n2", "ax"], ["u"])]
    m = model([node("MatMul", ["x", "w"], ["y"]), *cut, node("Sigmoid", ["g"], ["sg"]), node("Mul", ["g", "sg"], ["a"]),
               node("Mul", ["a", "u"], ["h"])], [vi("x", H, ["n", 5, K])], [vi("h", H, None)],
              [raw_init("w", w, H), const("sizes", [N, N], np.int64), const("z", [0], np.int64),
               const("n", [N], np.int64), const("n2", [2 * N], np.int64), const("ax", [-1], np.int64)])
    res = fused_parity(m, {"x": ("n", 5, K)}, {"x": (2, 5, K)}, ("gemm",))
    (k,) = res.kernels
    mm = next(res.graph.nodes[i] for i in k.region.nodes if res.graph.nodes[i].op_type == "MatMul")
    packed = res.graph.constants[mm.input[1]]
    assert np.array_equal(packed[:, 0::2], w[:, :N]) and np.array_equal(packed[:, 1::2], w[:, N:])
    assert not any(n.op_type in ("MatMul", "Split", "Slice") for n in res.model.graph.node)

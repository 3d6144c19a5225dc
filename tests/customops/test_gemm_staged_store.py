"""The staged GEMM epilogue (ortfuse_gemm.h for_each_acc_staged): outputs whose rows are not 16-byte aligned
(GPT-2's 50,257 fp16 logits) leave through a shared-memory slice per warp, a row at a time, instead of as
the fragments' scalar stores. In CPU emulation against numpy in fp64 on the rounded operands (fp16 and
bf16, 1e-2 normwise) for every tile family, ragged M and N; which kernels stage (and which do not); the
slices' shared memory in the tile model. Not verified here: its speed
(bench/device_call.sh sweep-unaligned, `--direct-stores`)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import launch_spec, model, node, raw_init, rounded_operands, vi
from ortfuse.api import target_for
from ortfuse.customops import tiles as tl
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import render
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import legal
from ortfuse.search.cost import traffic
from ortfuse.search.regions import plan

H, BF, F = TP.FLOAT16, TP.BFLOAT16, TP.FLOAT


def _gelu_bias(M: int, K: int, N: int, dt: int, seed: int = 11):
    """y = tanh(x @ w + b): the model, the operands' bits and the fp64 reference on the rounded values."""
    (x, xv), (w, wv), (b, bv) = rounded_operands(((M, K), (K, N), (N,)), dt, seed)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Tanh", ["z"], ["out"])],
              [vi("x", dt, [M, K])], [vi("out", dt, None)], [raw_init("w", w, dt), raw_init("b", b, dt)])
    ref = np.tanh(xv @ wv + bv)
    return m, x, w, b, ref


def _lowered(m, wgmma: bool, tile=None):
    g = build_graph(m, {})
    tgt = target_for((90,), wgmma)
    (r,) = plan(g, tgt).regions
    return lower(g, r, tgt, tile=tile)


def _as_f64(bits: np.ndarray, dt: int) -> np.ndarray:
    if dt == BF:
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.astype(np.float64)


def _check(spec, x, w, b, ref, dt):
    t = tl.GemmTile.of_candidate(spec.tiles[0]) if spec.tiles else None
    weight = np.ascontiguousarray(w.T) if spec.input_perms else w
    out = np.zeros(ref.shape, x.dtype)
    launch_spec(spec, [x, weight, b, out], [])
    got = _as_f64(out, dt)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-2, (err, t)


@pytest.mark.parametrize("tile,wgmma", [
    ((64, 64, 32, 32, 32, 3, 1), False),              # mma.sync: 2 x 4 fragments per warp, N ragged
    ((128, 128, 32, 64, 32, 3, 1), False),            # mma.sync: four 16-row fragments per warp
    ((32, 48, 32, 16, 16, 3, 1), False),              # mma.sync: two 8-column groups per pass, not four
    ((64, 128, 64, 16, 128, 4, 1), True),             # wgmma fed by cp.async (B read transposed)
    ((128, 192, 64, 16, 192, 4, 1, 2), True),         # TMA, two consumer warpgroups
    ((64, 64, 64, 16, 64, 4, 1, 2), True),            # TMA, one consumer warpgroup
    ((128, 192, 64, 16, 192, 4, 1, 3), True),         # TMA, B multicast across a pair of blocks
    ((128, 128, 64, 32, 128, 5, 1, 4), True),         # TMA, ping-pong: each warpgroup's warps their own slices
])
@pytest.mark.parametrize("dt", [H, BF])
def test_misaligned_rows_are_stored_through_shared_memory(tile, wgmma, dt):
    # N = 203: rows of 406 bytes; M = 150 and N ragged against every tile; K = 192 (16-byte rows, so the
    # warpgroup families can read the weight transposed offline)
    M, K, N = 150, 192, 203
    m, x, w, b, ref = _gelu_bias(M, K, N, dt)
    spec = _lowered(m, wgmma, tile)
    assert spec.split_k == 1  # (split-K's reduction stores rows of its own: split_epilogue)
    assert ("kStageOut", spec.block // 32) in spec.kernel.ops_consts
    src = render(spec.kernel)
    assert f"static constexpr int kStageOut = {spec.block // 32};" in src and "epi8" not in src and "rows8" in src
    _check(spec, x, w, b, ref, dt)


def test_several_tiles_per_block_reuse_the_slices():
    # a small grid of SMs: each persistent TMA block stores several tiles through the same slices
    M, K, N = 300, 128, 333
    m, x, w, b, ref = _gelu_bias(M, K, N, H, seed=3)
    spec = _lowered(m, True, (64, 64, 64, 16, 64, 4, 1, 2))
    out = np.zeros(ref.shape, x.dtype)
    launch_spec(spec, [x, np.ascontiguousarray(w.T), b, out], [], sms=3)
    assert np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("n,dt,wgmma,staged", [
    (200, H, True, False),   # 400-byte rows: 16-byte vectors (epi8), nothing staged
    (203, H, True, True),
    (204, H, False, True),   # 408-byte rows: 8-byte aligned only
    (203, F, False, False),  # fp32 without tf32: SIMT lanes, not fragments
])
def test_which_kernels_stage(n, dt, wgmma, staged):
    m, *_ = _gelu_bias(64, 64, n, dt)
    spec = _lowered(m, wgmma)
    assert bool(spec.kernel.ops_consts) == staged
    assert ("static constexpr int kStageOut" in render(spec.kernel)) == staged


def test_pairs_on_even_unaligned_rows_stage_too():
    # 204 fp16 columns: 408-byte rows, 8-byte aligned only; pairs were 4-byte stores rows apart
    m, x, w, b, ref = _gelu_bias(40, 64, 204, H, seed=7)
    spec = _lowered(m, False)
    assert spec.kernel.ops_consts == (("kStageOut", spec.block // 32),)
    _check(spec, x, w, b, ref, H)


def test_rows8_reads_a_bias_once_for_its_eight_rows():
    # the staged epilogue's whole tiles store 8 rows of one column per call: the bias (indexed by the column
    # alone) is one load in rows8, where the tanh and the store happen 8 times
    m, *_ = _gelu_bias(64, 64, 203, H)
    src = render(_lowered(m, True).kernel)
    body = src[src.index("rows8("):]
    body = body[:body.index("\n  }")]
    assert body.count("t2[") + body.count("t2 +") == 1 and body.count("tanhf(") == 8
    assert body.count("t3[") + body.count("t3 +") == 8


def test_the_slices_count_in_the_tile_model():
    tile = tl.GemmTile(128, 128, 64, 16, 128, 7, wgmma=True, tma=True)
    tgt = target_for((90,), True)
    plain = tile.block_smem_bytes(2, True)
    staged = tile.block_smem_bytes(2, True, stage_out=True)
    assert staged - plain == tile.threads // 32 * tl.STAGE_SLICE_BYTES == 12 * 1280
    # the 7-stage ring fits alone and not beside the slices
    assert plain <= tgt.smem_per_block < staged
    shape = (4096, 50257, 768, 1)
    direct = tl.rank_tiles(tgt, *shape, 2, tl.WS_F16, True, top_k=10**6)
    out = tl.rank_tiles(tgt, *shape, 2, tl.WS_F16, True, top_k=10**6, staged=(tl.DIRECT, tl.DIRECT, tl.STAGE_OUT))
    assert any(r.tile == tile for r in direct) and not any(r.tile == tile for r in out)
    assert all(r.tile.block_smem_bytes(2, True, stage_out=True) <= tgt.smem_per_block for r in out)


@pytest.mark.parametrize("m_rows", [128, 4096])
def test_every_profile_candidate_lowers_beside_the_slices(m_rows):
    # --profile lowers each of spec.tiles; the unranked TMA candidates (ping-pong, B multicast) come from a
    # ranking without the slices, so those that no longer fit beside them (a 7-stage 128x128 ring) are left out
    m, *_ = _gelu_bias(m_rows, 768, 50257, H)
    g = build_graph(m, {})
    tgt = target_for((90,), True)
    r = legal.classify(g, set(range(len(g.nodes))))  # (whatever the search would choose for it)
    r = dataclasses.replace(r, id=0, traffic=traffic(g, r))
    spec = lower(g, r, tgt)
    assert spec.kernel.ops_consts and len(spec.tiles) > 2
    for cand in spec.tiles:
        lowered = lower(g, r, tgt, tile=cand)
        assert lowered.kernel.ops_consts, cand

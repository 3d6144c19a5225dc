"""A GEMM's row-wise epilogue split across a thread-block cluster (sm_90, ortfuse_gemm.h RSPLIT): tiles narrower
than the row, ceil(N / BN) blocks of a cluster per row tile, one cluster barrier per reduction. Each case
forces a tile, runs the kernel in CPU emulation in the clusters the native library launches, and compares
every output with ORT CPU on the original graph (random non-zero inputs). Tolerances: fp32 1e-4, fp16 1e-2,
relative to the output's scale (at least 1)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from helpers import const, launch_spec, model, node, sass_or_skip, vi
from ortfuse.api import compile_model, target_for
from ortfuse.bench.sass import loops
from ortfuse.customops import tiles as tl
from ortfuse.config import Options
from ortfuse.customops.attrs import read_launch
from ortfuse.customops.emulate import EmulationError, compile_emulated
from ortfuse.customops.lower import LoweringError, lower
from ortfuse.customops.printer import render
from ortfuse.customops.target import for_cc
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.regions import plan

# row-wise epilogue kernels: their regions planned by the tile model alone (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("row_tiles_priced_by_the_tile_model")

F, H = TP.FLOAT, TP.FLOAT16
TOL = {F: 1e-4, H: 1e-2}


def _arr(shape, dt, seed, scale=0.5, shift=0.0):
    v = (np.random.default_rng(seed).standard_normal(shape) * scale + shift).astype(np.float32)
    return v if dt == F else v.astype(np.float16)


def _layernorm(dt, m: int, k: int, n: int):
    """LayerNorm(x @ w + b + r) over N, the residual sum an output too (BERT's post-LN block)."""
    inits = {"w": _arr((k, n), dt, 1, 0.2), "b": _arr(n, dt, 2), "g": _arr(n, dt, 3, 0.5, 1.0), "beta": _arr(n, dt, 4)}
    nodes = [node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Add", ["z", "r"], ["s"]),
             node("LayerNormalization", ["s", "g", "beta"], ["out"], axis=-1, epsilon=1e-5)]
    return nodes, [vi("x", dt, [m, k]), vi("r", dt, [m, n])], [vi("out", dt, None), vi("s", dt, None)], inits


def _softmax(dt, m: int, k: int, n: int):
    inits = {"w": _arr((k, n), dt, 5, 0.3)}
    nodes = [node("MatMul", ["x", "w"], ["y"]), node("Softmax", ["y"], ["p"], axis=-1), node("Mul", ["p", "r"], ["out"])]
    return nodes, [vi("x", dt, [m, k]), vi("r", dt, [m, n])], [vi("out", dt, None)], inits


def _decomposed(dt, m: int, k: int, n: int):
    """LayerNorm as exporters spell it, the row mean an output (written once per row, by the first block)."""
    inits = {"w": _arr((k, n), dt, 7, 0.3), "two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32)}
    nodes = [node("MatMul", ["x", "w"], ["y"]), node("Relu", ["y"], ["h"]),
             node("ReduceMean", ["h"], ["mu"], axes=[-1], keepdims=1), node("Sub", ["h", "mu"], ["d"]),
             node("Pow", ["d", "two"], ["d2"]), node("ReduceMean", ["d2"], ["var"], axes=[-1], keepdims=1),
             node("Add", ["var", "eps"], ["ve"]), node("Sqrt", ["ve"], ["sd"]), node("Div", ["d", "sd"], ["out"]),
             node("ReduceMax", ["h"], ["mx"], axes=[-1], keepdims=0)]
    return nodes, [vi("x", dt, [m, k])], [vi("out", dt, None), vi("mu", dt, None), vi("mx", dt, None)], inits


def _build(case, dt, m, k, n):
    nodes, ins, outs, inits = case(dt, m, k, n)
    return model(nodes, ins, outs, [const(name, v, v.dtype) for name, v in inits.items()], opset=17), inits


def _run_forced(case, dt, m, k, n, tile, wgmma=False):
    """The region lowered with `tile` on sm_90, run in emulation; returns the spec after comparing to ORT."""
    onnx_model, inits = _build(case, dt, m, k, n)
    g = build_graph(onnx_model, {})
    tgt = target_for((90,), wgmma)
    (region,) = plan(g, tgt).regions
    assert region.kind == "gemm_row"
    spec = lower(g, region, tgt, tile=tile)
    feeds = {i.name: _arr([d.dim_value for d in i.type.tensor_type.shape.dim], dt, 10 + j, 1.0)
             for j, i in enumerate(onnx_model.graph.input)}
    want = dict(zip([o.name for o in onnx_model.graph.output],
                    ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
                    .run(None, feeds)))
    values = {**feeds, **inits}
    for t, perm in spec.input_perms:
        values[t] = np.ascontiguousarray(np.transpose(values[t], perm))
    outs = [np.full(want[o].shape, np.nan, want[o].dtype) for o in spec.outputs]
    launch_spec(spec, [values[i] for i in spec.inputs] + outs, [])
    for o, got in zip(spec.outputs, outs):
        ref = want[o].astype(np.float64)
        err = np.abs(got.astype(np.float64) - ref).max() / max(1.0, np.abs(ref).max())
        assert err < TOL[dt], (o, err)
    return spec


@pytest.mark.parametrize("dt,m,k,n,tile", [
    (F, 45, 64, 96, (32, 32, 16, 16, 16, 2, 1)),           # SIMT, 3 blocks a row, 2 partial row tiles
    (H, 45, 64, 100, (32, 32, 32, 16, 16, 3, 1)),          # 4 blocks, the last with 4 of the 100 columns
    (H, 70, 96, 256, (64, 64, 32, 32, 32, 3, 1)),          # mma.sync 4 blocks
    (F, 21, 32, 600, (4, 256, 16, 4, 32, 2, 1)),           # 64 threads a row: reductions across warps
])
def test_layernorm_split_across_a_cluster(dt, m, k, n, tile):
    spec = _run_forced(_layernorm, dt, m, k, n, tile)
    assert spec.row_cluster == tl.row_split(n, tl.GemmTile(*tile[:6])) > 1 and spec.split_k == 1
    targs = spec.kernel.body[0].targs
    assert targs[-2:] == (str(spec.row_cluster), "2")  # RSPLIT, and two phases (mean, variance)
    assert int(targs[11]) == (64 if tile[0] == 4 else 32)  # ROW_TPR


@pytest.mark.parametrize("dt,tile", [(H, (64, 192, 64, 16, 192, 4, 1, 1)), (H, (64, 128, 64, 16, 64, 4, 1, 1))])
def test_wgmma_tiles_split_bert_width_rows(dt, tile):
    # 768 columns: 4 blocks of 192 (one warpgroup of n192) or 6 of 128 (two warpgroups along N); 130 rows
    spec = _run_forced(_layernorm, dt, 130, 64, 768, tile, wgmma=True)
    assert spec.kernel.arch_specific and spec.row_cluster == 768 // tile[1]


def test_softmax_split_across_a_cluster():
    # two reductions of another kind (the row max, then the sum of exponentials from the global max)
    spec = _run_forced(_softmax, H, 37, 32, 100, (32, 32, 32, 16, 16, 3, 1))
    assert spec.row_cluster == 4


def test_decomposed_layernorm_with_row_shaped_outputs():
    # three reductions (mean, variance, max); the row mean and max are written by the cluster's first block
    spec = _run_forced(_decomposed, F, 45, 32, 96, (32, 32, 16, 16, 16, 2, 1))
    assert spec.kernel.body[0].targs[-2:] == ("3", "3")


def test_a_split_row_kernel_launched_without_its_cluster_traps():
    # every block of a cluster holds part of each row: launched otherwise the kernel must not store a thing
    onnx_model, inits = _build(_layernorm, F, 32, 32, 96)
    g = build_graph(onnx_model, {})
    tgt = target_for((90,), False)
    (region,) = plan(g, tgt).regions
    spec = lower(g, region, tgt, tile=(32, 32, 16, 16, 16, 2, 1))
    values = {"x": _arr((32, 32), F, 1), "r": _arr((32, 96), F, 2), **inits}
    arrays = [values[i] for i in spec.inputs] + [np.zeros((32, 96), np.float32) for _ in spec.outputs]
    with pytest.raises(EmulationError, match="__trap"):
        compile_emulated(render(spec.kernel)).launch(spec.kernel.name, 3, spec.block, arrays, [], spec.smem, 1,
                                                     spec.arg_align)


def test_no_row_split_without_clusters():
    # sm_80 has no clusters: only tiles spanning the row, and a forced narrower one is refused with the reason
    onnx_model, _ = _build(_layernorm, H, 64, 64, 256)
    g = build_graph(onnx_model, {})
    assert all(tl.row_split(256, r.tile) == 1
               for r in tl.rank_tiles(for_cc(80), 4096, 256, 64, 1, 2, tl.MMA_F16, False, top_k=100, row=True))
    (region,) = plan(g, for_cc(80)).regions
    with pytest.raises(LoweringError, match="clusters of 4 blocks; the target has at most 1"):
        lower(g, region, for_cc(80), tile=(64, 64, 32, 32, 32, 3, 1))


def test_bert_batch32_shape_picks_a_split_row_and_carries_the_cluster():
    # BERT-base's attention output block at batch 32 (4096 x 768 x 768 + residual + LayerNorm): the tile model
    # prefers 128-row wgmma tiles split over a cluster to 32 x 768 whole-row tiles (B re-read by 128 blocks);
    # the fused node carries the cluster size and its candidates both kinds of tile for --profile. (The
    # mma.sync tiles it ranks first there, 64 x 64 warp tiles, spill under ptxas, as they do in a plain GEMM,
    # so without wgmma the spill check falls back to the whole-row tile.)
    onnx_model, _ = _build(_layernorm, H, 4096, 768, 768)
    res = compile_model(onnx_model, None, "sm_90", options=Options(archs=(90,), wgmma=True))
    (k,) = res.kernels
    launch = read_launch(next(n for n in res.model.graph.node if n.domain == "ortfuse"))
    assert k.spec.kernel.arch_specific and k.spec.row_cluster == launch.row_cluster == 4 and not k.retiled
    assert {tl.row_split(768, tl.GemmTile.of_candidate(t)) > 1 for t in k.spec.tiles} == {False, True}


def test_split_row_kernel_tells_ptxas_its_blocks_per_sm(tmp_path):
    # __launch_bounds__(256, 1): without the second figure ptxas (NVRTC 13.5) gave this 128 x 128 tile (64 x 32
    # warps) 128 registers and spilled 28-32 bytes; told one block per SM, as the tile model counts, 182 and none
    from ortfuse.customops.compile import compile_kernel
    onnx_model, _ = _build(_layernorm, H, 4096, 768, 768)
    g = build_graph(onnx_model, {})
    tgt = target_for((90,), False)
    (region,) = plan(g, tgt).regions
    spec = lower(g, region, tgt, tile=(128, 128, 32, 64, 32, 3, 1))
    assert spec.row_cluster == 6 and spec.kernel.min_blocks == 1
    ck = compile_kernel(render(spec.kernel), spec.kernel.name, (90,), tmp_path)
    assert "__launch_bounds__(256, 1)" in ck.source
    assert max(r.spill_bytes for _, r in ck.resources) == 0, ck.resources


@pytest.mark.parametrize("wgmma,tile", [(False, (32, 64, 32, 16, 32, 3, 1)), (True, (64, 64, 64, 16, 64, 4, 1, 1))])
def test_symbolic_batch_and_sequence(wgmma, tile):
    # x [batch, seq, k] as exporters give it (the rows are batch x seq, bound per run): 4 blocks of a 200-column
    # row, checked through the fused model at two bindings against ORT CPU
    from ortfuse.api import fused_kernel
    from ortfuse.check import check_models
    from ortfuse.customops.compile import compile_kernel
    from ortfuse.rewriter.replace import replace
    k, n = 64, 200
    nodes, _, outs, inits = _layernorm(H, 1, k, n)
    m = model(nodes, [vi("x", H, ["batch", "seq", k]), vi("r", H, ["batch", "seq", n])], outs,
              [const(name, v, v.dtype) for name, v in inits.items()])
    opts = Options(archs=(90,), wgmma=wgmma)
    res = compile_model(m, {"x": ("batch", "seq", k), "r": ("batch", "seq", n)}, "sm_90", options=opts)
    (region,) = [x.region for x in res.kernels if x.region.kind == "gemm_row"]
    spec = lower(res.graph, region, target_for((90,), wgmma), tile=tile)
    assert spec.row_cluster == 4
    fk = fused_kernel(region, spec, compile_kernel(render(spec.kernel), spec.kernel.name, (90,), opts.cache))
    for shape in ((3, 7), (2, 33)):
        rep = check_models(m, replace(res.graph, [fk.node]), emulate=True,
                           input_shapes={"x": (*shape, k), "r": (*shape, n)})
        assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("tile", [(128, 128, 64, 16, 64, 4, 1, 1),  # wgmma, 6 blocks of 128 columns
                                  (32, 768, 32, 16, 192, 3, 1)])   # mma.sync, the whole row in one block
def test_row_epilogue_sass_is_straight_line(tile, tmp_path):
    # BERT's 4096 x 768 x 768 + residual + LayerNorm. After the k-loop the only loop is row_in8's over the
    # tile's 8-column groups: the row passes are unrolled over rows and columns (no branch per row); a split
    # row reads the other blocks' slots only in its gathers (one LD per thread and 768 slots per phase, two
    # phases), never per row; no IEEE division (the means multiply by 1 / 768); no spills.
    import re

    from ortfuse.customops.compile import compile_kernel
    sass = sass_or_skip()
    onnx_model, _ = _build(_layernorm, H, 4096, 768, 768)
    g = build_graph(onnx_model, {})
    tgt = target_for((90,), True)
    (region,) = plan(g, tgt).regions
    spec = lower(g, region, tgt, tile=tile)
    ck = compile_kernel(render(spec.kernel), spec.kernel.name, (90,), tmp_path)
    assert max(r.spill_bytes for _, r in ck.resources) == 0, ck.resources
    ins = sass(dict(ck.cubins)[90])
    back = loops(ins)
    mma = [a for a, t in ins if re.search(r"\bH(G)?MMA\b", t)]
    k_end = min(((lo, hi) for lo, hi in back if any(lo <= x <= hi for x in mma)), key=lambda r: r[1] - r[0])[1]
    after = [(lo, hi) for lo, hi in back if lo > k_end]
    epi = [t for a, t in ins if a > k_end]
    assert len(after) == 1, after  # row_in8's groups
    (lo, hi), = after
    assert any("LDG.E.128" in t for a, t in ins if lo <= a <= hi)  # 16-byte input loads
    assert not [t for t in epi if "FCHK" in t]
    dsmem = sum(1 for t in epi if re.search(r"\bLD\.E\b", t))
    assert dsmem == (4 if spec.row_cluster == 6 else 0), dsmem


@pytest.mark.parametrize("seed", range(12))
def test_random_row_epilogues_match_ort(seed):
    # Random row-wise epilogues (LayerNorm, Softmax; the decomposed LayerNorm with row-shaped outputs in fp32) at
    # random sizes, each on a tile drawn from the kernel's own candidates (what --profile times: spanning the
    # row or split across a cluster, split-K or not, mma.sync / SIMT / wgmma): the row pass's column groups with
    # lanes past the row, the gathered slots, row_in8 and the split-K reduction at sizes no fixed case has
    rng = np.random.default_rng(seed)
    dt = H if seed % 4 else F
    case = (_layernorm, _softmax, _decomposed if dt == F else _layernorm)[seed % 3]
    wgmma = dt == H and seed % 2 == 1
    m, k = int(rng.integers(1, 70)), int(rng.choice([64, 128, 1024] if wgmma else [16, 32, 64, 1024] if dt == H else [16, 32, 64]))
    n = int(rng.integers(1, 110)) * 8 if seed % 3 != 1 else int(rng.integers(8, 900)) * (2 if dt == H else 1)
    onnx_model, _ = _build(case, dt, m, k, n)
    g = build_graph(onnx_model, {})
    tgt = target_for((90,), wgmma)
    (region,) = plan(g, tgt).regions
    tiles = lower(g, region, tgt).tiles
    tile = tiles[int(rng.integers(0, len(tiles)))]
    spec = _run_forced(case, dt, m, k, n, tile, wgmma=wgmma)
    assert spec.row_cluster == tl.row_split(n, tl.GemmTile.of_candidate(tile)), (m, n, k, tile)


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_row_epilogue_in_groups_of_eight(split):
    # a whole-row tile at split-K 2 and 4: the reduction's column groups are 8 wide and X goes through row_in8
    # (at 8 splits they stay 4 wide, covered by the random cases above)
    spec = _run_forced(_layernorm, H, 40, 1024, 768, (16, 768, 32, 16, 96, 3, split))
    assert spec.split_k == split and spec.row_cluster == 1 and "row_in8" in render(spec.kernel)

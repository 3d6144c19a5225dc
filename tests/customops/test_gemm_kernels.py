"""GEMM regions end to end: graph -> search -> lowering -> NVRTC (sm_80, sm_90) -> CPU emulation, against
ORT CPU on the original graph (random non-zero inputs). fp32 normwise tolerance 1e-5 (SIMT fp32), fp16
1e-2, tf32 (opt-in) 5e-3; bf16 against numpy in fp64 on the bf16-rounded operands, 1e-2."""
from __future__ import annotations


import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

from helpers import bf16, const, fused_parity, launch_spec, model, node, vi
from ortfuse.config import cache_dir
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import render
from ortfuse.customops.target import parse_arch
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import legal

F, H, BF = TP.FLOAT, TP.FLOAT16, TP.BFLOAT16
NP = {F: np.float32, H: np.float16}


def _run(m, shapes, check_shapes, tf32=False, kinds=("gemm",)):
    return fused_parity(m, shapes, check_shapes, kinds, tf32)


def _w(shape, dt, seed, scale=0.2):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(NP[dt])


@pytest.mark.parametrize("dt", [F, H])
def test_bias_residual_relu_epilogue_symbolic_rows(dt):
    # x [n, 7, 64] @ w [64, 48] + b, + residual r, Relu; the MatMul result is also a graph output
    k, n = 64, 48
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Add", ["z", "r"], ["s"]),
               node("Relu", ["s"], ["out"])],
              [vi("x", dt, ["n", 7, k]), vi("r", dt, ["n", 7, n])], [vi("out", dt, None), vi("y", dt, None)],
              [const("w", _w((k, n), dt, 1), NP[dt]), const("b", _w(n, dt, 2), NP[dt])])
    for rows in (1, 3):
        res = _run(m, {"x": ("n", 7, k), "r": ("n", 7, n)}, {"x": (rows, 7, k), "r": (rows, 7, n)})
    spec = res.kernels[0].spec
    assert spec.units_ceil and spec.tiles and spec.smem > 0
    assert len(res.kernels[0].region.outputs) == 2


@pytest.mark.parametrize("dt", [F, H])
def test_odd_sizes_use_generic_operand_loads(dt):
    # K = 33 and N = 29: rows are not 16-byte aligned, so both operands go through a_load / b_load
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Tanh", ["z"], ["out"])],
              [vi("x", dt, [5, 33])], [vi("out", dt, None)],
              [const("w", _w((33, 29), dt, 3), NP[dt]), const("b", _w(29, dt, 4), NP[dt])])
    res = _run(m, {}, None)
    src = res.kernels[0].compiled.source
    assert "a_load" in src and "b_load" in src


def test_fp32_on_tf32_tensor_cores_when_opted_in():
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Relu", ["z"], ["out"])],
              [vi("x", F, [4, 9, 32])], [vi("out", F, None)],
              [const("w", _w((32, 40), F, 5)), const("b", _w(40, F, 6))])
    plain = _run(m, {}, None)
    tf32 = _run(m, {}, None, tf32=True)
    assert "ofz::gemm::run<float" in plain.kernels[0].compiled.source
    math_ = {r.kernels[0].spec.kernel.body[0].targs[9] for r in (plain, tf32)}
    assert math_ == {"3", "2"}  # SIMT without the option, tf32 mma with it
    assert any(p.key == "ortfuse.tf32" for p in tf32.model.metadata_props)


@pytest.mark.parametrize("b_shape", [(2, 3, 32, 24), (3, 32, 24)])
def test_batched_matmul_with_broadcast_and_scale(b_shape):
    # per-batch B (no folding of batch dims into M), optionally broadcast over the leading batch dim
    m = model([node("MatMul", ["a", "bm"], ["y"]), node("Mul", ["y", "s"], ["out"])],
              [vi("a", H, [2, 3, 17, 32]), vi("bm", H, list(b_shape))], [vi("out", H, None)],
              [const("s", 0.125, np.float16)])
    _run(m, {}, None)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 1), (1, 0), (1, 1)])
def test_gemm_transposes_alpha_beta(trans_a, trans_b):
    k, n, rows = 64, 48, 10
    a_shape = [k, rows] if trans_a else [rows, k]
    w = _w((n, k) if trans_b else (k, n), H, 7)
    m = model([node("Gemm", ["x", "w", "c"], ["y"], transA=trans_a, transB=trans_b, alpha=0.5, beta=2.0),
               node("Relu", ["y"], ["out"])],
              [vi("x", H, a_shape)], [vi("out", H, None)], [const("w", w, np.float16), const("c", _w(n, H, 8), np.float16)])
    res = _run(m, {}, None)
    targs = res.kernels[0].spec.kernel.body[0].targs
    assert targs[7] == ("2" if trans_a else "0") and targs[8] == ("1" if trans_b else "0")  # A, B modes


@pytest.mark.usefixtures("row_tiles_priced_by_the_tile_model")
def test_lone_gemm_stays_with_ort_and_softmax_becomes_a_row_epilogue():
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "x"], ["z"]),
               node("Softmax", ["z"], ["out"], axis=-1), node("MatMul", ["out", "w"], ["y2"])],
              [vi("x", F, [8, 16])], [vi("y2", F, None)], [const("w", _w((16, 16), F, 9))])
    res = _run(m, {}, None, kinds=("gemm_row",))
    assert "no epilogue to fuse" in " | ".join(r.reason for r in res.plan.refusals)


def test_prologue_cast_and_transpose_fold_into_operand_loads():
    # y = Cast(x fp32 -> bf16) @ Transpose(wt) + b: both prologues become a_load / b_load (no ORT Cast or
    # Transpose kernel); bf16 tensor cores; checked against numpy on the rounded operands
    nodes = [node("Cast", ["x"], ["xh"], to=BF), node("Transpose", ["wt"], ["w"], perm=[1, 0]),
             node("MatMul", ["xh", "w"], ["y"]), node("Add", ["y", "b"], ["out"])]
    m = model(nodes, [vi("x", F, ["n", 40]), vi("wt", BF, [24, 40]), vi("b", BF, [24])], [vi("out", BF, None)])
    g = build_graph(m, {})
    region = legal.classify(g, {0, 1, 2, 3})
    assert region.kind == "gemm"
    spec = lower(g, region, parse_arch("sm_90"))
    src = render(spec.kernel)
    assert "a_load" in src and "b_load" in src and "__nv_bfloat16" in src
    compile_kernel(src, spec.kernel.name, (80, 90), cache_dir())
    rng = np.random.default_rng(11)
    x = rng.standard_normal((13, 40)).astype(np.float32)
    wt, wtv = bf16(rng.standard_normal((24, 40)))
    b, bv = bf16(rng.standard_normal(24))
    out = np.zeros((13, 24), np.uint16)
    args = {"x": x, "wt": wt, "b": b}
    launch_spec(spec, [args[t] for t in spec.inputs] + [out], [13])
    ref = bf16(x)[1].astype(np.float64) @ wtv.T.astype(np.float64) + bv
    got = (out.astype(np.uint32) << 16).view(np.float32)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-2


def test_kernels_named_by_content_share_compiles():
    # two identical layers: one kernel source
    k = 32
    nodes, inits = [], []
    src = "x"
    for i in range(2):
        nodes += [node("MatMul", [src, f"w{i}"], [f"y{i}"]), node("Add", [f"y{i}", f"b{i}"], [f"z{i}"]),
                  node("Relu", [f"z{i}"], [f"r{i}"])]
        inits += [const(f"w{i}", _w((k, k), H, 20 + i), np.float16), const(f"b{i}", _w(k, H, 30 + i), np.float16)]
        src = f"r{i}"
    m = model(nodes, [vi("x", H, ["n", k])], [vi(src, H, None)], inits)
    res = _run(m, {"x": ("n", k)}, {"x": (5, k)}, kinds=("gemm", "gemm"))
    assert res.kernels_compiled == 1
    assert isinstance(res.model, onnx.ModelProto)


@pytest.mark.parametrize("dt", [F, H])
def test_transposed_output_epilogue(dt):
    # ConvNeXt's block end: x [n, 5, 6, 32] (NHWC) @ w + b, * gamma, back to NCHW, + residual r [n, 48, 5, 6].
    # The output is stored transposed (one store per column); the NHWC intermediate is an output too.
    k, n = 32, 48
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Mul", ["z", "gamma"], ["s"]),
               node("Transpose", ["s"], ["st"], perm=[0, 3, 1, 2]), node("Add", ["st", "r"], ["out"])],
              [vi("x", dt, ["n", 5, 6, k]), vi("r", dt, ["n", n, 5, 6])], [vi("out", dt, None), vi("s", dt, None)],
              [const("w", _w((k, n), dt, 1), NP[dt]), const("b", _w(n, dt, 2), NP[dt]),
               const("gamma", _w(n, dt, 3, 1.0), NP[dt])])
    for rows in (1, 3):
        res = _run(m, {"x": ("n", 5, 6, k), "r": ("n", n, 5, 6)}, {"x": (rows, 5, 6, k), "r": (rows, n, 5, 6)})
    src = res.kernels[0].compiled.source
    assert "Transpose" in [res.graph.nodes[i].op_type for i in res.kernels[0].region.nodes]
    epi2 = src[src.index(" epi2("):src.index(" epi1(")]
    # the NHWC output s (t5) stores two columns as one access; the NCHW output (t6) stores each column
    assert epi2.count("store_vec<2>(t5") == 1 and epi2.count("t6[") == 2 and epi2.count("t4[") == 2, epi2
    assert "(gm % 30LL)" in epi2  # (h, w) of the unravelled row merge back into one remainder


def test_transpose_of_a_transpose_is_still_the_gemm_element():
    # out = Transpose(Transpose(y)) reads y at the element being stored; a permuted index that reads the GEMM
    # elsewhere (y + Transpose(y) of a square y) cannot be one epilogue: the region is refused, never wrong
    k, n = 16, 16
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Transpose", ["y"], ["t1"], perm=[0, 2, 1]),
               node("Relu", ["t1"], ["r1"]), node("Transpose", ["r1"], ["out"], perm=[2, 0, 1])],
              [vi("x", F, [2, 16, k])], [vi("out", F, None)], [const("w", _w((k, n), F, 1))])
    res = _run(m, {}, None)
    assert res.kernels[0].spec.kernel.funcs
    sq = model([node("MatMul", ["x", "w"], ["y"]), node("Transpose", ["y"], ["t1"], perm=[0, 2, 1]),
                node("Add", ["y", "t1"], ["out"])], [vi("x", F, [2, 16, k])], [vi("out", F, None)],
               [const("w", _w((k, n), F, 1))])
    from ortfuse.api import compile_model
    r = compile_model(sq, None, "sm_90")
    assert all(x.region.kind != "gemm" or "Transpose" not in [r.graph.nodes[i].op_type for i in x.region.nodes]
               for x in r.kernels)

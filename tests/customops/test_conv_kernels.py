"""Conv as an implicit GEMM with its epilogue: graph -> search -> lowering -> NVRTC (sm_80, sm_90) -> CPU
emulation, against ORT CPU on the original graph (random non-zero inputs). fp32 normwise tolerance 1e-5
(SIMT fp32), fp16 1e-2 (tensor cores, fp32 accumulation)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, conv_chain, conv_silu_residual, fused_parity, mix_ffn, model, node, vi

F, H = TP.FLOAT, TP.FLOAT16
NP = {F: np.float32, H: np.float16}


def _w(shape, dt, seed, scale=0.2):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(NP[dt])


@pytest.mark.parametrize("dt", [F, H])
@pytest.mark.parametrize("geom,loads", [
    ((8, 16, 3, 1, (1, 1, 1, 1), 1, 9), ("im2col",)),             # 3x3 same padding: im2col gathered
    ((8, 16, 1, 1, (0, 0, 0, 0), 1, 8), ()),                       # 1x1: both operands by cp.async
    ((3, 16, 7, 2, (3, 3, 3, 3), 1, 11), ("a_load", "im2col")),   # ResNet stem: 3 channels, weight rows unaligned
    ((8, 24, 3, 2, (1, 1, 1, 1), 2, 10), ("im2col",)),            # stride 2, dilation 2
    ((16, 8, 1, 2, (0, 0, 0, 0), 1, 9), ("im2col",)),             # 1x1 stride 2 (downsample shortcut)
    ((8, 16, 3, 1, (0, 1, 2, 0), 1, 7), ("im2col",)),             # asymmetric padding
    ((8, 16, 1, 1, (0, 0, 1, 1), 1, 7), ("im2col",)),             # 1x1 padded at the bottom/right only
])
def test_conv_epilogue_parity(dt, geom, loads):
    m, shapes, at = conv_silu_residual(dt, *geom)
    for n in (1, 3):
        res = fused_parity(m, shapes, at(n), ("gemm",))
    src = res.kernels[0].compiled.source
    assert ("a_load" in src) == ("a_load" in loads)
    assert ("ofz::gemm::Conv2d<" in src) == ("im2col" in loads)
    assert "b_load" not in src
    assert "ofz::gemm::run<" in src


@pytest.mark.parametrize("dt", [F, H])
@pytest.mark.parametrize("geom", [(8, 16, 3, 1, (1, 1, 1, 1), 1, 9), (8, 24, 3, 2, (0, 1, 2, 0), 2, 10)])
def test_gather_of_an_image_past_32_bit_indices_falls_back_to_b_load(dt, geom, monkeypatch):
    # images of 2^31 elements and more are gathered through the IR's 64-bit b_load; the limit is lowered so
    # that path runs at a size the emulator can hold
    from ortfuse.customops import lower_gemm
    monkeypatch.setattr(lower_gemm, "GATHER32_LIMIT", 100)
    m, shapes, at = conv_silu_residual(dt, *geom)
    res = fused_parity(m, shapes, at(2), ("gemm",))
    src = res.kernels[0].compiled.source
    assert "b_load" in src and "ofz::gemm::Conv2d<" not in src


def test_conv_without_bias_and_with_its_result_also_a_graph_output():
    m, shapes, at = conv_silu_residual(H, 8, 16, 3, 1, (1, 1, 1, 1), 1, 6, bias=False)
    m.graph.output.append(vi("y", H, ["n", 16, 6, 6]))
    res = fused_parity(m, shapes, at(2), ("gemm",))
    assert len(res.kernels[0].region.outputs) == 2


def test_contiguous_store_needs_no_division():
    # the pixel index n unravels to (oh, ow) for the epilogue's value walk, but the store of [b][oc][oh][ow]
    # linearizes back to b * OC*OH*OW + oc * OH*OW + n
    m, shapes, at = conv_silu_residual(H, 8, 16, 1, 1, (0, 0, 0, 0), 1, 8)
    res = fused_parity(m, shapes, at(1), ("gemm",))
    src = res.kernels[0].compiled.source
    epi = src[src.index("epi2("):src.index("epi1(")]
    assert not re.search(r"[/%] \d+LL", epi), epi


@pytest.mark.parametrize("dt", [F, H])
def test_static_unit_dims(dt):
    # batch 1, one output channel and a one-pixel-high output: size-1 dims the value walk broadcasts to 0
    m = model([node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[0, 1, 0, 1]),
               node("Add", ["y", "r"], ["z"]), node("Tanh", ["z"], ["out"])],
              [vi("x", dt, [1, 5, 3, 7]), vi("r", dt, [1, 1, 1, 7])], [vi("out", dt, None)],
              [const("w", _w((1, 5, 3, 3), dt, 3), NP[dt]), const("b", _w(1, dt, 4), NP[dt])])
    fused_parity(m, {}, None, ("gemm",))


@pytest.mark.parametrize("dt", [F, H])
@pytest.mark.parametrize("c,k,s,p,d,hw", [(8, 3, 1, 1, 1, 9), (8, 3, 2, 1, 1, 10), (6, 7, 1, 3, 1, 8),
                                          (4, 3, 1, 0, 2, 9), (4, 9, 1, 4, 1, 11)])  # 81 taps: a loop
def test_depthwise_conv_joins_a_pointwise_kernel(dt, c, k, s, p, d, hw):
    # MobileNetV2's depthwise Conv + ReLU6: a window loop per output element, zero padding selected away
    m = model([node("Conv", ["x", "w", "b"], ["y"], group=c, kernel_shape=[k, k], strides=[s, s], pads=[p] * 4,
                    dilations=[d, d]), node("Clip", ["y", "lo", "hi"], ["out"])],
              [vi("x", dt, ["n", c, hw, hw])], [vi("out", dt, None)],
              [const("w", _w((c, 1, k, k), dt, 5, 0.3), NP[dt]), const("b", _w(c, dt, 6), NP[dt]),
               const("lo", 0.0, NP[dt]), const("hi", 0.5, NP[dt])])
    res = fused_parity(m, {}, {"x": (2, c, hw, hw)}, ("pointwise",))
    src = res.kernels[0].compiled.source
    assert "fmaf(" in src and ("for (ofz_i64 tap" in src) == (k * k > 64)


def test_depthwise_conv_inside_a_layernorm_kernel():
    # ConvNeXt: depthwise 7x7 -> NCHW->NHWC Transpose -> LayerNorm over channels, one row kernel
    c = 16
    m = model([node("Conv", ["x", "w", "b"], ["y"], group=c, kernel_shape=[7, 7], pads=[3] * 4),
               node("Transpose", ["y"], ["t"], perm=[0, 2, 3, 1]),
               node("LayerNormalization", ["t", "g", "beta"], ["out"], axis=-1, epsilon=1e-6)],
              [vi("x", F, ["n", c, 5, 6])], [vi("out", F, None)],
              [const("w", _w((c, 1, 7, 7), F, 7)), const("b", _w(c, F, 8)), const("g", 1 + _w(c, F, 9)),
               const("beta", _w(c, F, 10))])
    fused_parity(m, {}, {"x": (2, c, 5, 6)}, ("rowreduce",))


@pytest.mark.parametrize("dt", [F, H])
def test_convs_on_symbolic_images_compute_their_output_sizes_at_run_time(dt):
    # a stride-2 dense Conv + SiLU (one GEMM kernel; im2col gathered at run-time sizes), then a
    # depthwise Conv with stride (2, 1) and asymmetric pads + ReLU6 (one pointwise kernel): one optimized model,
    # checked at several image sizes down to the smallest the kernels fit
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    from ortfuse.customops.attrs import read_launch

    c, oc = 8, 16
    m = model([node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
               node("Sigmoid", ["y"], ["sg"]), node("Mul", ["y", "sg"], ["a"]),
               node("Conv", ["a", "dw"], ["d"], group=oc, kernel_shape=[3, 3], strides=[2, 1], pads=[0, 1, 1, 0]),
               node("Clip", ["d", "lo", "hi"], ["out"])],
              [vi("x", dt, ["n", c, "h", "w"])], [vi("out", dt, None)],
              [const("w", _w((oc, c, 3, 3), dt, 1), NP[dt]), const("b", _w(oc, dt, 2), NP[dt]),
               const("dw", _w((oc, 1, 3, 3), dt, 3, 0.3), NP[dt]), const("lo", 0.0, NP[dt]), const("hi", 0.5, NP[dt])])
    res = compile_model(m, None, "sm_80,sm_90", options=Options(archs=(80, 90)))
    assert sorted(r.kind for r in res.plan.regions) == ["gemm", "pointwise"], [str(r) for r in res.plan.refusals]
    for k in res.kernels:
        assert k.spec.sym_derived, k.region.kind  # the Conv's output size, from the input's
    gemm = next(k for k in res.kernels if k.region.kind == "gemm")
    assert "b_load" not in gemm.compiled.source  # the template's gather, its sizes read at run time
    assert re.search(r"ofz::gemm::Conv2d<8, -\d+, -\d+, 3, 3, 2, 2, 1, 1, 1, 1, -\d+>", gemm.compiled.source)
    assert len(gemm.spec.dim_limits) == 2  # C*H*W and the pixel count below 2^31, checked at launch
    for shape in [(1, c, 9, 13), (2, c, 16, 5), (1, c, 3, 3)]:
        rep = check_models(m, res.model, emulate=True, input_shapes={"x": shape})
        assert rep.ok and len(rep.kernels) == 2, "\n".join(rep.lines())
    # the depthwise Conv's window (3x3, pads 0 + 1 on each axis) needs a 2x2 input: smaller is an error, as in
    # the native library
    dw_node = next(n for n in res.model.graph.node if n.domain == "ortfuse" and "a" in n.input)
    launch = read_launch(dw_node)
    shapes = [(1, oc, 5, 2)] * len(dw_node.input)  # only the activation's dims are symbolic
    assert launch.dims(shapes)[-2:] == [2, 1]  # floor((5 - 2) / 2) + 1, 2 - 1
    with pytest.raises(ValueError, match="image size of 1 is smaller than a Conv's"):
        launch.dims([(1, oc, 5, 1)] * len(dw_node.input))


def test_symbolic_image_past_the_32_bit_gather_is_refused_at_launch(monkeypatch):
    # the limit is lowered so that an image the emulator holds crosses it: below it the kernel runs, above it
    # the launch is refused with the reason (the native library checks the same dim_limits)
    from ortfuse.customops import lower_gemm
    from ortfuse.customops.attrs import read_launch

    monkeypatch.setattr(lower_gemm, "GATHER32_LIMIT", 1000)
    m, _, _ = conv_silu_residual(F, 8, 16, 3, 1, (1, 1, 1, 1), 1, 9)
    m.graph.input[0].CopyFrom(vi("x", F, ["n", 8, "h", "w"]))
    m.graph.input[1].CopyFrom(vi("r", F, ["n", 16, "h", "w"]))
    res = fused_parity(m, {}, {"x": (2, 8, 10, 12), "r": (2, 16, 10, 12)}, ("gemm",))  # 8 * 10 * 12 < 1000
    (k,) = res.kernels
    assert "ofz::gemm::Conv2d<" in k.compiled.source and k.spec.dim_limits
    launch = read_launch(next(n for n in res.model.graph.node if n.domain == "ortfuse"))
    with pytest.raises(ValueError, match="a size of 1056 exceeds what this kernel was built for"):
        launch.dims([(1, 8, 11, 12)] * 4)  # 8 * 11 * 12 = 1056


@pytest.mark.parametrize("dt", [F, H])
@pytest.mark.parametrize("c,oc,s,hw,check", [
    (16, 16, 1, ("h", "w"), [(2, 16, 9, 11), (1, 16, 4, 3)]),  # + residual Add; image size read at run time
    (24, 160, 2, (10, 10), [(2, 24, 10, 10)]),                   # several tiles of output channels recompute it
    (8, 24, 1, (7, 9), [(3, 8, 7, 9)]),                         # odd sizes
])
def test_depthwise_conv_is_computed_in_the_pointwise_convs_gather(dt, c, oc, s, hw, check):
    # the depthwise Conv + ReLU6 image never reaches memory: the 1x1 Conv's b_load evaluates it per element
    m = conv_chain(dt, c, oc, s, hw=hw)
    for shape in check:
        res = fused_parity(m, None, {"x": shape}, ("gemm",))
    src = res.kernels[0].compiled.source
    assert "b_load" in src and "fmaf(" in src  # the window loop inside the GEMM's operand load
    assert [n.domain for n in res.model.graph.node] == ["ortfuse"]  # one node: no ORT Conv or Clip left


def test_conv_chain_stays_two_kernels_when_the_image_is_also_read_elsewhere():
    m = conv_chain(H, 16, 32, 1, hw=(8, 8), also_out=True)
    res = fused_parity(m, None, {"x": (1, 16, 8, 8)}, ("pointwise",))
    assert any("is also read outside the Conv's kernel" in r.reason for r in res.plan.refusals)


def test_conv_chain_into_a_3x3_conv_is_weighed_by_the_cost_model():
    # a 3x3 Conv evaluates each image element at 9 taps per tile of output channels: at batch 32 in fp32
    # (SIMT) that recomputation costs more than writing the image once
    m = conv_chain(F, 16, 32, 1, k2=3, hw=("h", "w"))
    res = fused_parity(m, None, {"x": (2, 16, 9, 11)}, ("pointwise",))
    why = next(r.reason for r in res.plan.refusals if "as its image" in r.subject)
    assert "with the image computed by its own kernel" in why and "at batch 32" in why


def test_fp32_conv_chain_is_fused_though_ort_folds_its_relu():
    # stock ORT runs this as two kernels (the depthwise Conv, then FusedConv 1x1 + Relu): the chain still saves
    # one, so the "ORT fuses this itself" rule must count the depthwise Conv as work ORT does separately
    m = model([node("Conv", ["x", "dw"], ["d"], group=16, kernel_shape=[3, 3], pads=[1] * 4),
               node("Conv", ["d", "pw", "pb"], ["y"], kernel_shape=[1, 1]), node("Relu", ["y"], ["out"])],
              [vi("x", F, ["n", 16, 8, 8])], [vi("out", F, None)],
              [const("dw", _w((16, 1, 3, 3), F, 1, 0.3)), const("pw", _w((32, 16, 1, 1), F, 2, 0.3)),
               const("pb", _w(32, F, 3))])
    fused_parity(m, None, {"x": (2, 16, 8, 8)}, ("gemm",))


TAPS_FLAG = re.compile(r"ofz::gemm::Conv2d<[^>]*, 1>")  # the template's tap-major gather


@pytest.mark.parametrize("dt", [F, H])
@pytest.mark.parametrize("geom,permuted", [
    ((32, 16, 3, 1, (1, 1, 1, 1), 1, 9), True),     # 3x3 same padding
    ((64, 24, 3, 2, (0, 1, 2, 0), 2, 13), True),    # stride 2, dilation 2, asymmetric padding, 5x5 output
    ((32, 8, 5, 1, (2, 2, 2, 2), 1, 6), True),      # 5x5 taps, output columns fewer than a tile
    ((32, 16, 1, 1, (0, 0, 0, 0), 1, 7), False),    # 1x1 on 49 pixels (rows unaligned: gathered), weight as is
    ((64, 16, 1, 2, (0, 0, 0, 0), 1, 9), False),    # 1x1 stride 2 (downsample shortcut)
])
def test_tap_major_gather(dt, geom, permuted):
    # C a multiple of BK: k runs over (kh, kw, c), each k tile in one tap, and the weight is given to the
    # fused node permuted offline to [OC][KH][KW][C]; the optimized model still runs without CUDA (its
    # function transposes the weight back)
    m, shapes, at = conv_silu_residual(dt, *geom)
    for n in (1, 3):
        res = fused_parity(m, shapes, at(n), ("gemm",))
    assert TAPS_FLAG.search(res.kernels[0].compiled.source)
    (fn,) = [n for n in res.model.graph.node if n.domain == "ortfuse"]
    inits = {t.name: t for t in res.model.graph.initializer}
    if permuted:
        assert res.kernels[0].spec.input_perms == (("w", (0, 2, 3, 1)),)
        assert fn.input[1] == "w__ortfuse_t0231" and "w" not in inits  # the original is no longer read
        oc, c, k = geom[1], geom[0], geom[2]
        assert list(inits[fn.input[1]].dims) == [oc, k, k, c]
        assert res.model.functions[0].node[0].op_type == "Transpose"
    else:
        assert res.kernels[0].spec.input_perms == () and fn.input[1] == "w"


@pytest.mark.parametrize("dt,taps", [(H, False), (F, True)])
def test_tap_major_gather_needs_a_bk_that_divides_the_channels(dt, taps):
    # 16 channels: fp16 tiles have BK 32 or 64 (channel-major gather, weight as is); fp32 tiles BK 16
    m, shapes, at = conv_silu_residual(dt, 16, 16, 3, 1, (1, 1, 1, 1), 1, 8)
    res = fused_parity(m, shapes, at(2), ("gemm",))
    src = res.kernels[0].compiled.source
    assert bool(TAPS_FLAG.search(src)) == taps and "ofz::gemm::Conv2d<16," in src
    assert bool(res.kernels[0].spec.input_perms) == taps
    for tile in res.kernels[0].spec.tiles:  # every --profile candidate keeps the layout the weight was given
        assert not taps or 16 % tile[2] == 0


def test_tap_major_gather_on_symbolic_images():
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options

    c, oc = 32, 16
    m = model([node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
               node("Relu", ["y"], ["out"])],
              [vi("x", H, ["n", c, "h", "w"])], [vi("out", H, None)],
              [const("w", _w((oc, c, 3, 3), H, 1), np.float16), const("b", _w(oc, H, 2), np.float16)])
    res = compile_model(m, None, "sm_80,sm_90", options=Options(archs=(80, 90)))
    (k,) = res.kernels
    assert re.search(r"ofz::gemm::Conv2d<32, -\d+, -\d+, 3, 3, 2, 2, 1, 1, 1, 1, -\d+, 1>", k.compiled.source)
    for shape in [(1, c, 9, 13), (2, c, 16, 5), (1, c, 2, 2)]:
        rep = check_models(m, res.model, emulate=True, input_shapes={"x": shape})
        assert rep.ok and len(rep.kernels) == 1, "\n".join(rep.lines())


def test_tap_major_weight_shared_with_a_conv_left_to_ort():
    # one weight, two Convs: the fused one reads a permuted copy, the bare one (no epilogue: left to ORT)
    # still reads the original
    c, oc = 32, 32
    m = model([node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), node("Relu", ["y"], ["a"]),
               node("Conv", ["a", "w"], ["out"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
              [vi("x", H, ["n", c, 8, 8])], [vi("out", H, None)], [const("w", _w((oc, c, 3, 3), H, 1), np.float16)])
    res = fused_parity(m, {"x": ("n", c, 8, 8)}, {"x": (2, c, 8, 8)}, ("gemm",))
    inits = {t.name for t in res.model.graph.initializer}
    assert inits == {"w", "w__ortfuse_t0231"}
    assert [n.input[1] for n in res.model.graph.node if n.op_type == "Conv"] == ["w"]


@pytest.mark.parametrize("dt,tile,c,oc,hw", [
    (F, (16, 128, 16, 16, 64, 2), 64, 16, 11),   # 64 threads, BN 128: each thread gathers two pixels
    (H, (64, 16, 64, 16, 16, 2), 64, 64, 11),    # 128 threads, BN 16: one pixel, 8 channels apart per element
    (H, (16, 16, 32, 16, 16, 3), 256, 16, 4),    # one output tile, 2304-long K: split across a cluster
])
def test_tap_major_gather_tiles(dt, tile, c, oc, hw, monkeypatch, request):
    from ortfuse.customops import tiles
    monkeypatch.setattr(tiles, "_candidates", lambda math_, esize: [tiles.GemmTile(*tile)])
    tiles.clear_caches()  # rankings are memoized: none from before, none of this tile after
    request.addfinalizer(tiles.clear_caches)
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options

    m, shapes, at = conv_silu_residual(dt, c, oc, 3, 1, (1, 1, 1, 1), 1, hw)
    split = hw == 4  # split-K needs sm_90 alone, and batch 1 at optimize time (not the symbolic batch's hint)
    if split:
        res = compile_model(m, at(1), "sm_90", options=Options(archs=(90,)))
        rep = check_models(m, res.model, emulate=True, input_shapes=at(1))
        assert rep.ok and len(rep.kernels) == 1, "\n".join(rep.lines())
    else:
        res = fused_parity(m, shapes, at(2), ("gemm",))
    k = res.kernels[0]
    assert TAPS_FLAG.search(k.compiled.source) and k.spec.tiles[0][:6] == tile
    assert (k.spec.split_k > 1) == split


def test_weight_a_user_can_feed_is_not_permuted():
    # an initializer also listed as a graph input (older exporters) may be fed at run time: gathered
    # channel-major, the weight passed as it is
    m, shapes, at = conv_silu_residual(H, 32, 16, 3, 1, (1, 1, 1, 1), 1, 6)
    m.graph.input.append(vi("w", H, [16, 32, 3, 3]))
    res = fused_parity(m, shapes, at(1), ("gemm",))
    assert not TAPS_FLAG.search(res.kernels[0].compiled.source) and res.kernels[0].spec.input_perms == ()


def test_forced_tile_whose_bk_does_not_divide_the_channels_gathers_channel_major():
    # --profile and the spill fallback re-lower with a forced tile: BK 64 on 32 channels cannot be tap-major
    from ortfuse.api import compile_model
    from ortfuse.customops.lower import lower
    from ortfuse.customops.printer import render
    from ortfuse.customops.target import for_cc

    m, _, at = conv_silu_residual(H, 32, 16, 3, 1, (1, 1, 1, 1), 1, 6)
    res = compile_model(m, at(1), "sm_90")
    spec = lower(res.graph, res.kernels[0].region, for_cc(90), tile=(32, 32, 64, 16, 16, 3))
    src = render(spec.kernel)
    assert spec.input_perms == ()
    assert not TAPS_FLAG.search(src) and "ofz::gemm::run<__half, 32, 32, 64," in src
    spec = lower(res.graph, res.kernels[0].region, for_cc(90), tile=(32, 32, 32, 16, 16, 3))
    assert spec.input_perms == (("w", (0, 2, 3, 1)),) and TAPS_FLAG.search(render(spec.kernel))


@pytest.mark.parametrize("dt", [F, H])
def test_depthwise_conv_over_tokens_matches_ort(dt):
    # SegFormer's Mix-FFN: bias, Transpose and Reshape to an image, depthwise 3x3, back to tokens, Relu: one
    # kernel that reads the tokens at each tap through both layout changes
    res = fused_parity(mix_ffn(dt, c=16, hw=7), {}, {"x": (2, 49, 16)}, ("pointwise",))
    assert "fmaf(" in res.kernels[0].compiled.source


@pytest.mark.parametrize("dt", [F, H])
def test_convnext_stage_in_its_blocks_layout_matches_ort(dt):
    # --layout blocks: the residual stream stays channels-last, so each later block's depthwise 7x7 is computed
    # inside its LayerNorm's row kernel (lanes on channels, one vector load a tap for all of a vector's lanes,
    # its weight a [1, 7, 7, C] constant) and each block's residual Add is its last GEMM's plain epilogue
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    from helpers import convnext_stage
    m = convnext_stage(dt, c=16, depth=3, tail="ln")
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), layout="blocks", ln_fold="off"))
    ops = [(r.kind, {res.graph.nodes[i].op_type for i in r.nodes}) for r in res.plan.regions]
    windows = [o for kind, o in ops if kind == "rowreduce" and "Conv" in o]
    assert len(windows) == 2, ops  # blocks 1 and 2 (block 0's Conv reads the stage's NCHW input: cuDNN)
    assert sum(kind == "gemm" and "Transpose" not in o and {"Mul", "Add"} <= o for kind, o in ops) >= 2, ops
    perms = {p for k in res.kernels for p in k.spec.input_perms}
    assert {("b1_dw_w", (1, 2, 3, 0)), ("b2_dw_w", (1, 2, 3, 0))} <= perms, perms
    src = next(k.compiled.source for k in res.kernels if "b1_dw_w" in dict(k.spec.input_perms))
    body = src.split("for (ofz_i64 row0", 1)[1]
    assert "load_arg_if<" in body and "for (" not in body.split("row_reduce")[0]  # taps unrolled
    # each kernel row's 7 image reads (guarded vector loads) come before its math: tap by tap, ptxas let each
    # wait for its load, a memory latency a tap for a warp alone on its SM
    reads = [ln for ln in body.splitlines() if "load_arg_if<" in ln or "fmaf(" in ln]
    assert sum("load_arg_if<" in ln for ln in reads) == 49
    starts = [i for i, ln in enumerate(reads) if "load_arg_if<" in ln and (i == 0 or "fmaf(" in reads[i - 1])]
    assert len(starts) == 7 and all(all("load_arg_if<" in ln for ln in reads[i:i + 7]) for i in starts), reads
    assert any("rearranges" in str(x) for x in res.plan.refusals)
    rep = check_models(m, res.model, emulate=True, input_shapes={"x": (2, 16, 7, 7)})
    assert rep.ok, "\n".join(rep.lines())
    assert len(rep.kernels) == len(res.kernels)


@pytest.mark.parametrize("dt,kinds", [(TP.FLOAT, ("gemm",)), (TP.FLOAT16, ("gemm", "pointwise"))])
def test_auto_padded_convs_run_as_our_kernels(dt, kinds):
    # auto_pad SAME_UPPER (a strided 3x3 over an odd image: one more pad at the end) and SAME_LOWER (a
    # depthwise 4x4: one more at the start) take the pads ORT computes (`canonical.explicit_auto_pads`), so
    # the Conv + SiLU is our GEMM kernel and the depthwise Conv + Relu ours in fp16 (fp32: cuDNN's FusedConv)
    np_dt = np.float16 if dt == TP.FLOAT16 else np.float32
    rng = np.random.default_rng(3)
    m = model([node("Conv", ["x", "w", "b"], ["c"], auto_pad="SAME_UPPER", strides=[2, 2]),
               node("Sigmoid", ["c"], ["sg"]), node("Mul", ["c", "sg"], ["a"]),
               node("Conv", ["a", "dw"], ["d"], auto_pad="SAME_LOWER", group=16), node("Relu", ["d"], ["y"])],
              [vi("x", dt, ["n", 8, 15, 15])], [vi("y", dt, None)],
              [const("w", rng.standard_normal((16, 8, 3, 3)) * 0.2, np_dt),
               const("b", rng.standard_normal(16) * 0.1, np_dt),
               const("dw", rng.standard_normal((16, 1, 4, 4)) * 0.2, np_dt)])
    fused_parity(m, None, {"x": (2, 8, 15, 15)}, kinds)

"""Conv as a GEMM anchor in the search: geometry, refusals with reasons, the implicit-GEMM dims the cost
model uses, and ORT's own Conv + Relu fusion (fp32 CUDA EP) counted on ORT's side."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, mix_ffn, model, node, vi
from ortfuse.customops.target import for_cc
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import conv, plan
from ortfuse.search.cost import CostModel, gemm_dims, ort_conv_folds

H100 = for_cc(90)
F, H = TP.FLOAT, TP.FLOAT16
NP = {F: np.float32, H: np.float16}


def _conv_act(dt, act="Relu", x_shape=("n", 8, 10, 10), w_shape=(16, 8, 3, 3), **attrs):
    attrs = {"pads": [1, 1, 1, 1], **attrs}
    return model([node("Conv", ["x", "w"], ["y"], **attrs), node(act, ["y"], ["out"])],
                 [vi("x", dt, list(x_shape))], [vi("out", dt, None)],
                 [const("w", np.full(w_shape, 0.1), NP[dt])])


def _plan(m):
    g = build_graph(m, {})
    return g, plan(g, H100)


def test_geometry_and_gemm_dims():
    m = _conv_act(H, strides=[2, 2], pads=[1, 0, 2, 1])
    g = build_graph(m, {})
    geo = conv.conv_geometry(g, g.nodes[0])
    assert (geo.oh, geo.ow, geo.k, geo.pad, geo.padded, geo.pointwise) == (6, 5, 72, (1, 0), True, False)
    assert gemm_dims(g, g.nodes[0]) == (g.sym_hints.get("n", 128), 16, 30, 72)  # symbolic batch at its hint
    one = build_graph(_conv_act(H, x_shape=("n", 8, 8, 8), w_shape=(16, 8, 1, 1), pads=[0, 0, 0, 0]), {})
    geo = conv.conv_geometry(one, one.nodes[0])
    assert geo.pointwise and not geo.padded and conv.direct_operands(geo, 2)
    assert not conv.direct_operands(dataclasses.replace(geo, h=10, w=10, oh=10, ow=10), 2)  # 200-byte rows


def test_symbolic_image_sizes_follow_the_output_rule():
    # ORT's inference writes the output sizes as expressions of the input's
    g = build_graph(_conv_act(H, x_shape=("n", 8, "h", "w"), strides=[2, 1], pads=[1, 0, 2, 1]), {})
    geo = conv.conv_geometry(g, g.nodes[0])
    assert not isinstance(geo, str) and not geo.static_image and geo.padded and not geo.pointwise
    assert (geo.oh, geo.ow) == ("floor(h/2) + 1", "w - 1")
    assert (geo.out_rule(0), geo.out_rule(1)) == ((0, 2), (-2, 1))  # floor((h + 3 - 2 - 1) / 2) + 1; w + 1 - 2
    assert geo.pixels_at(lambda d: {"floor(h/2) + 1": 6, "w - 1": 9}[d]) == 54
    g, p = _plan(_conv_act(H, "Sigmoid", x_shape=("n", 8, "h", "w")))
    assert [r.kind for r in p.regions] == ["gemm"], [str(r) for r in p.rejects]


def test_an_inferred_size_that_contradicts_the_conv_is_refused():
    # a stride-2 Conv whose output size the graph gives as the input's own "h"
    g = build_graph(_conv_act(H, "Sigmoid", x_shape=("n", 8, "h", "w"), strides=[2, 2]), {})
    g.tensors["y"] = dataclasses.replace(g.tensors["y"], shape=("n", 16, "h", "w"))
    assert "output size h along axis 2 does not follow from the symbolic input size h" in \
        conv.conv_geometry(g, g.nodes[0])


@pytest.mark.parametrize("kwargs,reason", [
    (dict(w_shape=(16, 4, 3, 3), group=2), "grouped convolution (group=2, 8 -> 16 channels)"),
    (dict(auto_pad="SAME_UPPER", pads=None), "auto_pad=SAME_UPPER"),
    (dict(x_shape=("n", 8, 10), w_shape=(16, 8, 3), pads=[1, 1]), "1-D convolution"),
    (dict(x_shape=("n", 8, 3, 3), w_shape=(16, 8, 3, 3), pads=[0, 0, 0, 0], dilations=[2, 2]), "does not fit"),
])
def test_refusals_name_the_reason(kwargs, reason):
    if kwargs.get("pads", 0) is None:
        kwargs.pop("pads")
        m = model([node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER"), node("Sigmoid", ["y"], ["out"])],
                  [vi("x", H, ["n", 8, 10, 10])], [vi("out", H, None)], [const("w", np.full((16, 8, 3, 3), 0.1), np.float16)])
    else:
        m = _conv_act(H, "Sigmoid", **kwargs)
    g, p = _plan(m)
    assert not p.regions
    assert any(reason in r.reason and r.subject.startswith("Conv") for r in p.rejects), [str(r) for r in p.rejects]


def test_fp32_conv_relu_is_left_to_orts_fused_conv():
    g, p = _plan(_conv_act(F))
    assert not p.regions
    assert any("stock ORT fuses this itself" in r.reason for r in p.refusals), [str(r) for r in p.refusals]


def test_fp16_conv_relu_fuses_and_fp32_conv_sigmoid_fuses():
    # ORT's CUDA EP folds only Relu (and Add + Relu) into FusedConv, and only in fp32
    for dt, act in ((H, "Relu"), (F, "Sigmoid")):
        g, p = _plan(_conv_act(dt, act))
        assert [r.kind for r in p.regions] == ["gemm"], [str(r) for r in p.refusals]
        assert ort_conv_folds(g, p.regions[0]) == []


def test_orts_folds_are_not_counted_as_extra_kernels():
    # fp32 Conv -> Add(residual) -> Relu -> Mul: ORT runs FusedConv(+Z, Relu) and Mul, two kernels
    m = model([node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]), node("Add", ["y", "r"], ["z"]),
               node("Relu", ["z"], ["a"]), node("Mul", ["a", "s"], ["out"])],
              [vi("x", F, [1, 8, 10, 10]), vi("r", F, [1, 16, 10, 10])], [vi("out", F, None)],
              [const("w", np.full((16, 8, 3, 3), 0.1)), const("s", np.full((16, 1, 1), 0.5))])
    g, p = _plan(m)
    (r,) = p.regions
    assert ort_conv_folds(g, r) == [1, 2]
    cm = CostModel(H100)
    mm_us, _ = cm.gemm_us(g, g.nodes[0])
    # ORT: FusedConv (+ the residual read) and one Mul kernel
    assert cm.ort_us(g, r) < mm_us + 3 * H100.launch_us
    assert cm.ort_us(g, r) > mm_us + 2 * H100.launch_us


def test_add_relu_after_an_ort_conv_stays_in_orts_fused_conv():
    # the Conv is not ours (grouped), so ORT runs it as FusedConv(+Z, Relu): fusing the
    # Add + Relu into a kernel of ours would take them out of it and add a pass over the tensor
    m = model([node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], group=2), node("Add", ["y", "r"], ["z"]),
               node("Relu", ["z"], ["out"])],
              [vi("x", F, ["n", 8, "h", "w"]), vi("r", F, ["n", 16, "h", "w"])], [vi("out", F, None)],
              [const("w", np.full((16, 4, 3, 3), 0.1))])
    g, p = _plan(m)
    assert not p.regions, [str(r) for r in p.regions]
    assert any("stock ORT fuses this itself" in r.reason and r.subject.startswith("region at Add")
               for r in p.refusals), [str(r) for r in p.refusals]
    # in fp16 ORT has no FusedConv, so the pair is worth one kernel
    g, p = _plan(model([node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], group=2), node("Add", ["y", "r"], ["z"]),
                        node("Relu", ["z"], ["out"])],
                       [vi("x", H, ["n", 8, "h", "w"]), vi("r", H, ["n", 16, "h", "w"])], [vi("out", H, None)],
                       [const("w", np.full((16, 4, 3, 3), 0.1), np.float16)]))
    assert [r.kind for r in p.regions] == ["pointwise"], [str(r) for r in p.refusals]


def test_depthwise_conv_is_memory_bound_and_keeps_its_producer_apart():
    # Relu -> depthwise Conv -> Clip: the Conv joins the Clip; the Relu would be recomputed for each of the
    # 9 taps, so it is not merged in (and alone it does not pay)
    m = model([node("Relu", ["x"], ["r"]), node("Conv", ["r", "w"], ["y"], group=8, pads=[1, 1, 1, 1]),
               node("Clip", ["y", "lo", "hi"], ["out"])],
              [vi("x", H, ["n", 8, 10, 10])], [vi("out", H, None)],
              [const("w", np.full((8, 1, 3, 3), 0.1), np.float16), const("lo", 0.0, np.float16),
               const("hi", 6.0, np.float16)])
    g, p = _plan(m)
    assert [(r.kind, r.nodes) for r in p.regions] == [("pointwise", (1, 2))]
    assert any("neighbouring pixels" in r.reason for r in p.refusals), [str(r) for r in p.refusals]
    assert not conv.is_anchor(g, g.nodes[1]) and conv.is_depthwise(g, g.nodes[1])


def test_fp32_depthwise_conv_relu_is_left_to_orts_fused_conv():
    g, p = _plan(_conv_act(F, w_shape=(8, 1, 3, 3), group=8))
    assert not p.regions
    assert any("stock ORT fuses this itself" in r.reason for r in p.refusals), [str(r) for r in p.refusals]


@pytest.mark.parametrize("after,transposed", [("softmax", False), ("flatten", False), ("transpose", True),
                                               ("square", True)])
def test_depthwise_conv_joins_a_row_kernel_only_in_its_own_layout(after, transposed):
    # lanes of a row kernel walk the reduced axis: W of the Conv's NCHW output is fine (Softmax over W, or
    # over H*W after a Reshape); the channels after a Transpose (ConvNeXt's dwconv -> NHWC -> LayerNorm, also
    # when C = H = W keeps the shape) would make each tap its own memory transaction: refused, with its reason
    c = 6 if after == "square" else 8
    w = np.random.default_rng(0).standard_normal((c, 1, 3, 3)).astype(np.float32)
    nodes = [node("Conv", ["x", "w"], ["c"], group=c, pads=[1, 1, 1, 1], kernel_shape=[3, 3])]
    inits = [const("w", w)]
    if transposed:
        nodes += [node("Transpose", ["c"], ["t"], perm=[0, 2, 3, 1]), node("Softmax", ["t"], ["y"], axis=-1)]
    elif after == "flatten":
        nodes += [node("Reshape", ["c", "shp"], ["t"]), node("Softmax", ["t"], ["y"], axis=-1)]
        inits.append(const("shp", [0, c, 36], np.int64))
    else:
        nodes += [node("Softmax", ["c"], ["y"], axis=-1)]
    m = model(nodes, [vi("x", TP.FLOAT, ["n", c, 6, 6])], [vi("y", TP.FLOAT, None)], inits)
    g = build_graph(m, {})
    p = plan(g, H100)
    rows = [r for r in p.regions if r.kind == "rowreduce"]
    conv_in_row = any(any(g.nodes[i].op_type == "Conv" for i in r.nodes) for r in rows)
    assert conv_in_row != transposed, [str(x) for x in p.refusals]
    assert transposed == any("a depthwise Conv computed" in str(x) and "across channels" in str(x) for x in p.refusals)


def test_depthwise_conv_over_tokens_is_one_kernel_with_both_transposes():
    # the window reads the tokens where they lie (channels innermost) and the kernel walks them in that order:
    # the bias Add, both Transposes and the Conv are one pointwise kernel (the Add re-evaluated per tap)
    g, p = _plan(mix_ffn(H))
    assert [(r.kind, r.nodes) for r in p.regions] == [("pointwise", tuple(range(7)))], [str(r) for r in p.refusals]


@pytest.mark.parametrize("back,bias,why", [(False, "const", "in NCHW order over a channels-last image"),
                                           (True, "input", "neighbouring pixels")])
def test_depthwise_conv_over_tokens_refusals(back, bias, why):
    # walked in NCHW order the taps of consecutive lanes are C elements apart; an Add of a second tensor would
    # read that tensor once per tap
    g, p = _plan(mix_ffn(H, back, bias))
    assert not any(any(g.nodes[i].op_type == "Conv" for i in r.nodes) and
                   any(g.nodes[i].op_type == "Add" for i in r.nodes) for r in p.regions), p.regions
    assert any(why in r.reason for r in p.refusals), [str(r) for r in p.refusals]


def test_window_cost_counts_its_taps_and_a_row_kernels_idle_lanes():
    # a depthwise 7x7 in a row kernel issues ~3.5 instructions per output element and tap (SASS, 2026-11-27);
    # ConvNeXt's 96 fp16 channels (12 vectors) fill 12 of a half warp's 16 lanes, 768 fill all, 200 (25
    # vectors) 25 of 32; each tap also reads the image once, from L1 where the block's pixels share it and
    # from L2 where they do not
    from helpers import convnext_stage
    from ortfuse.customops.target import WINDOW_TAP_INSTRUCTIONS
    from ortfuse.rewriter.layout import sink_transposes
    from ortfuse.search import compute
    g = build_graph(convnext_stage(H, c=96, depth=2, hw=14, tail="ln"), {})
    dw = next(i for i, n in enumerate(g.nodes) if n.op_type == "Conv")
    assert compute.node_work(g, g.nodes[dw]) == (49 * WINDOW_TAP_INSTRUCTIONS, 0.0)
    sunk, n = sink_transposes(g)
    assert n == 2
    cost = CostModel(H100)
    p = plan(sunk, H100, cost)
    row = next(r for r in p.regions if r.kind == "rowreduce" and any(sunk.nodes[i].op_type == "Conv" for i in r.nodes))
    assert cost.row_lane_use(sunk, row) == 12 / 16
    assert cost.row_lane_use(sunk, dataclasses.replace(row, space=row.space[:-1] + (768,))) == 1.0
    assert cost.row_lane_use(sunk, dataclasses.replace(row, space=row.space[:-1] + (200,))) == 25 / 32
    # the image read 49 times: at L1's rate, or from L2 where the block's 8 pixels (rows, 16 lanes each)
    # share only 8 + 6 of every 8 x 7 taps of a kernel row (channels-last; a warp's 32 pixels in NCHW order)
    reads = 49 * 2 * 96 * 14 * 14  # bytes, batch 1
    l1 = reads / (H100.smem_bytes_per_clk * H100.sm_count * H100.clock_ghz * 1e3)
    l2 = reads * 14 / 56 / (H100.dram_gbps * H100.l2_over_dram * 1e3)
    assert cost.window_us(sunk, row) == pytest.approx(max(l1, l2))
    # at batch 1 (196 pixels of 16 lanes: under a warp an SM) one thread's chain binds: 7 rounds of reads
    # (a kernel row's together), each a memory latency, then its instructions one a clock
    from ortfuse.search.cost import bindings
    idle = cost.compute_us(sunk, row.nodes) / (12 / 16)
    chain = H100.launch_us + 7 * H100.mem_latency_ns / 1e3 + \
        compute.work(sunk, row.nodes)[0] / (14 * 14 * 16) / (H100.clock_ghz * 1e3)
    assert cost.window_chain_us(sunk, row) == pytest.approx(chain)
    assert chain > H100.launch_us + idle > max(l1, l2) and cost.ours_us(sunk, row) == pytest.approx(chain)
    # at batch 32 the issue slots bind, idle lanes included; the chain is the same
    (_, big), = bindings(sunk)[1:]
    idle = cost.compute_us(big, row.nodes) / (12 / 16)
    assert cost.window_chain_us(big, row) == pytest.approx(chain)
    assert H100.launch_us + idle > chain and cost.ours_us(big, row) == pytest.approx(H100.launch_us + idle)
    # a longer row (768 fp32 channels: 192 vectors on 128 threads, two groups a lane) counts each group's rounds
    g = build_graph(convnext_stage(F, c=768, depth=2, hw=7, tail="ln"), {})
    sunk, _ = sink_transposes(g)
    p = plan(sunk, H100, cost)
    row = next(r for r in p.regions if r.kind == "rowreduce" and any(sunk.nodes[i].op_type == "Conv" for i in r.nodes))
    assert cost.row_threads(sunk, row) is None
    chain = H100.launch_us + 2 * 7 * H100.mem_latency_ns / 1e3 + \
        compute.work(sunk, row.nodes)[0] / (7 * 7 * 128) / (H100.clock_ghz * 1e3)
    assert cost.window_chain_us(sunk, row) == pytest.approx(chain)
    # pointwise kernels' windows (SegFormer's Mix-FFN over its tokens) are not modelled
    g, p = _plan(mix_ffn(H))
    assert all(cost.window_chain_us(g, r) == 0.0 for r in p.regions)

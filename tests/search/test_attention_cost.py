"""The attention kernel's price (`search.cost.attention_geometry`, `CostModel.attention_us`) against the H100
device times it was fitted on, and the placement it drives: fp32 attention, which ours runs on CUDA cores
and ORT on TF32 MatMuls, is left to ORT at ViT-B's size; at fp16, and at small fp32 sizes, it is ours."""
from __future__ import annotations

import dataclasses

import pytest
from onnx import TensorProto as TP

from helpers import gqa_attention, packed_attention

from ortfuse.customops.target import for_cc
from ortfuse.rewriter.canonical import fold_runtime_shapes
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import legal
from ortfuse.search.attention import find_attention
from ortfuse.search.cost import CostModel, attention_geometry, bindings, traffic
from ortfuse.search.plan import Region, Traffic
from ortfuse.search.regions import plan

H100 = for_cc(90)


def _attention(m, hints):
    g, _ = fold_runtime_shapes(build_graph(m, {}, hints))
    return g, plan(g, H100)


def _region(g) -> Region:
    """The graph's one attention pattern as a region, whether the plan takes it or not."""
    (pat,), _ = find_attention(g)
    inputs, outputs = legal.region_io(g, set(pat.nodes))
    return Region(0, "attention", pat.nodes, tuple(inputs), tuple(outputs), (), Traffic(0, 0, 0))


# (dtype, sequence, key split, measured us at batch 1 and 32, launch included): --profile's times on an H100
# (warm L2; docs/gpu, 2026-11-26/27), BERT's and ViT's first attention region, 12 heads of 64
MEASURED = [(TP.FLOAT16, 128, 1, (8.3, 24.6)), (TP.FLOAT16, 128, 2, (11.9, 24.6)), (TP.FLOAT, 197, 1, (69.7, 393.7))]


@pytest.mark.parametrize("dt,seq,split,measured", MEASURED)
def test_attention_estimate_tracks_the_measured_kernel(dt, seq, split, measured):
    g, _ = fold_runtime_shapes(build_graph(packed_attention(dt, 12, 64), {}, {"seq": seq}))
    r, cm = _region(g), CostModel(H100)
    got = [cm.attention_us(gb, dataclasses.replace(r, traffic=traffic(gb, r)), split) - H100.launch_us
           for _, gb in bindings(g)]
    assert len(got) == 2 and all(abs(est / meas - 1) < 0.15 for est, meas in zip(got, measured)), (got, measured)


def test_keys_split_only_where_it_pays():
    # a cluster costs about two key tiles: BERT's 2 tiles a unit stay in one block (8.3 us against 11.9 split,
    # measured), 16 tiles split across 4 blocks; no split where the clusters would not fit one wave (12 heads x
    # 16 query tiles: 192 units for 132 SMs)
    cm = CostModel(H100)
    for heads, seq, split in ((12, 128, 1), (2, 1024, 4), (12, 1024, 1)):
        g, _ = fold_runtime_shapes(build_graph(packed_attention(TP.FLOAT16, heads, 64), {}, {"seq": seq}))
        assert cm.attention_split(g, _region(g)) == split, (heads, seq)


def test_fp32_attention_at_vit_size_is_left_to_ort():
    # ViT-B fp32 on the H100 (session 31): ours 69.7 / 393.7 us, ORT's ops 56.5 / 346.6 (--profile, batch 1 / 32)
    g, p = _attention(packed_attention(TP.FLOAT, 12, 64), {"seq": 197})
    assert not [r for r in p.regions if r.kind == "attention"]
    why = [r.reason for r in p.refusals if "attention kernel estimated" in r.reason]
    assert len(why) == 1 and "at batch 32 as ORT runs it" in why[0], p.refusals
    # its Softmax and score ops are then free for the memory-bound phases
    assert any(g.nodes[i].op_type == "Softmax" for r in p.regions for i in r.nodes)


@pytest.mark.parametrize("dt,heads,head,seq", [(TP.FLOAT16, 12, 64, 197), (TP.FLOAT16, 2, 64, 128),
                                               (TP.FLOAT, 3, 24, 128)])
def test_attention_that_pays_is_ours(dt, heads, head, seq):
    g, p = _attention(packed_attention(dt, heads, head), {"seq": seq})
    assert [r.kind for r in p.regions].count("attention") == 1, p.refusals


def test_fp32_attention_that_beats_ort_but_not_its_nodes_fused_otherwise_is_not_ours():
    # BERT-base's fp32 attention: the CUDA-core kernel beats ORT's unfused ops for its region, but the whole
    # model is estimated faster with the score ops and Softmax as a row kernel and P·V (with its Transpose) as
    # our GEMM; ViT-B fp32 took the kernel on that first comparison alone and ran 0.94x stock ORT at batch 32
    # (H200, session 41)
    g, p = _attention(packed_attention(TP.FLOAT, 12, 64), {"seq": 128})
    r = _region(g)
    assert CostModel(H100).verdict(g, dataclasses.replace(r, traffic=traffic(g, r))) is None
    assert "attention" not in [r.kind for r in p.regions]
    assert {"rowreduce", "gemm"} <= {r.kind for r in p.regions}
    (why,) = [x for x in p.refusals if "against its nodes fused otherwise" in x.reason]
    assert why.reason.startswith("attention kernel (1 of this kind)") and "at batch 32" in why.reason
    # with tensor cores the kernel is not tried both ways: the same pattern in fp16 stays ours
    g16, p16 = _attention(packed_attention(TP.FLOAT16, 12, 64), {"seq": 128})
    assert [r.kind for r in p16.regions].count("attention") == 1


@pytest.mark.parametrize("model,seq", [
    (lambda: packed_attention(TP.FLOAT16, 2, 64), 128), (lambda: packed_attention(TP.FLOAT, 3, 24), 37),
    (lambda: packed_attention(TP.FLOAT16, 2, 64), 1024),
    (lambda: gqa_attention(TP.FLOAT16, 9, 3, 64), 1), (lambda: gqa_attention(TP.FLOAT16, 9, 3, 64), 128),
    (lambda: gqa_attention(TP.FLOAT16, 6, 2, 40), 40), (lambda: gqa_attention(TP.FLOAT, 4, 1, 32), 1)],
    ids=["packed-fp16", "packed-fp32", "packed-fp16-long", "gqa-step", "gqa-prompt", "gqa-fp16-simt", "gqa-fp32-step"])
def test_geometry_is_the_lowered_kernels(model, seq):
    # the units the cost model prices are the ones the library launches at the hints (grouped-query heads
    # packed at a generation step's one row, 16-bit SIMT kernels grouped below 64 rows as tensor-core ones),
    # and the key split it picks is the node's
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    from ortfuse.customops.attrs import read_launch

    res = compile_model(model(), {}, "sm_90", Options(archs=(90,), dim_hints=(("seq", seq),)))
    (k,) = [k for k in res.kernels if k.region.kind == "attention"]
    g = res.graph
    launch = read_launch(next(n for n in res.model.graph.node if n.name == k.node.name))
    hint = lambda d: d if isinstance(d, int) else g.sym_hints[d]  # noqa: E731
    dims = [hint(g.tensors[k.region.inputs[i]].shape[a]) for i, a in launch.sym_dims]
    geo = attention_geometry(g, k.region)
    assert geo.units == launch.grid(dims), (geo, dims)
    assert k.spec.split_k == CostModel(H100).attention_split(g, k.region)


def test_profile_is_offered_every_attention_region():
    # --profile times our kernel against ORT's ops per region, so the estimate does not refuse one beforehand
    g, _ = fold_runtime_shapes(build_graph(packed_attention(TP.FLOAT, 12, 64), {}, {"seq": 197}))
    p = plan(g, H100, CostModel(H100, attention_measured=True))
    assert [r.kind for r in p.regions].count("attention") == 1


def test_fp32_attention_left_to_ort_keeps_parity():
    # at ViT-B's size (the hint) fp32 attention goes to ORT; the scale, mask and Softmax between its MatMuls
    # become a row kernel and P.V takes the output Transpose as its epilogue; the packed QKV's Split is one
    # Slice per head tensor (rewriter.contrib), each with its head Transpose one copy kernel (ORT ran the
    # Split and three Transposes): all match ORT in emulation
    from helpers import fused_parity

    m = packed_attention(TP.FLOAT, 12, 64)
    res = fused_parity(m, {}, {"x": (2, 9, 2304), "mask": (2, 1, 1, 9)},
                       ["gemm", "pointwise", "pointwise", "pointwise", "rowreduce"], dim_hints=[("seq", 197)])
    assert any("attention kernel estimated" in r.reason for r in res.plan.refusals)


def test_k_rotation_in_the_kernel_is_charged_per_tile():
    # rotating K in the kernel costs each unit Target.attn_rope_pair_clocks per pair of a K tile it loads: at
    # 64 query rows a head that is under a rotation kernel's launch and traffic at both batch sizes (not worth
    # a second search), at 1024 rows (16 units a head, 16 tiles each) over it at batch 32
    from helpers import rope_attention
    from ortfuse.search.attention import k_rope_outside

    cm = CostModel(H100)
    saved = {}
    for seq in (64, 1024):
        g, _ = fold_runtime_shapes(build_graph(rope_attention(TP.FLOAT16), {}, {"seq": seq}))
        (pat,), _ = find_attention(g)
        alt = k_rope_outside(g)[pat.softmax]
        inside, once = (Region(0, "attention", p.nodes, tuple(legal.region_io(g, set(p.nodes))[0]), (p.output,), (),
                               Traffic(0, 0, 0)) for p in (pat, alt))
        geo = attention_geometry(g, inside)
        assert geo.rope_pairs == geo.block_n * 32 and attention_geometry(g, once).rope_pairs == 0
        saved[seq] = cm.attention_us(g, dataclasses.replace(inside, traffic=traffic(g, inside))) - \
            cm.attention_us(g, dataclasses.replace(once, traffic=traffic(g, once)))
        why = cm.rotation_trial(g, [(inside, once)])
        assert (why is None) == (seq == 1024), (seq, why)
    assert 0 < saved[64] < H100.launch_us and saved[64] < saved[1024], saved  # (batch 1)

"""GroupNorm as exporters emit it (Reshape to [n, groups, -1], InstanceNormalization, Reshape back to the image
by a target computed at run time, the per-channel affine, SiLU) as one row kernel: the rows are the groups,
the output a view of them in the image's shape (`legal.output_view`), the affine read at each element's
channel. Checked in CPU emulation against ORT CPU. Tolerances: fp32 1e-5, fp16 1e-2 normwise."""
from __future__ import annotations

import pytest
from onnx import TensorProto as TP

from helpers import const, fused_parity, model, node, vi
from ortfuse.bench.groupnorm import group_norm
from ortfuse.customops.target import for_cc
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import plan

F, H = TP.FLOAT, TP.FLOAT16


@pytest.mark.parametrize("dt", [F, H], ids=["fp32", "fp16"])
@pytest.mark.parametrize("c,groups", [(8, 4), (6, 1), (6, 6)], ids=["groups", "poolformer-1", "per-channel"])
def test_group_norm_is_one_row_kernel(dt, c, groups):
    res = fused_parity(group_norm(dt, c, groups), {}, {"x": (2, c, 5, 6)}, ("rowreduce",))
    assert [n.op_type for n in res.model.graph.node if n.domain != "ortfuse"] == []


def test_symbolic_image_size():
    # H and W symbolic: the row length C/groups*H*W and the back Reshape's target are read at run time
    m = group_norm(F, 8, 2, hw=("h", "w"))
    for hw in ((5, 6), (3, 9)):
        fused_parity(m, {}, {"x": (2, 8, *hw)}, ("rowreduce",))


def test_view_of_a_view():
    # [n, G, L] -> [n, C, H*W] (the affine there) -> [n, C, H, W]: an index followed through both by offset
    fused_parity(group_norm(F, 8, 2, silu=False, view_of_view=True), {}, {"x": (2, 8, 5, 6)}, ("rowreduce",))


def test_instance_norm_of_an_image_stays_with_ort():
    m = model([node("InstanceNormalization", ["x", "s", "b"], ["y"]), node("Relu", ["y"], ["out"])],
              [vi("x", F, [2, 3, 4, 5])], [vi("out", F, None)], [const("s", [1, 2, 3]), const("b", [0, 1, 0])])
    g = build_graph(m, {})
    p = plan(g, for_cc(90))
    assert not any(g.nodes[i].op_type == "InstanceNormalization" for r in p.regions for i in r.nodes)
    assert any("rank-4" in r.reason for r in p.rejects), [str(r) for r in p.rejects]


def test_a_long_group_is_read_in_vectors_with_its_loops_unrolled():
    # PoolFormer's one group at 32x32 (65536 fp16 a row): the group, read through the [n, C, H, W] -> [n, G, L]
    # view, is one 16-byte load per 8 columns (it was 8 scalar loads), the column loops are unrolled by hand
    # (ROW_LONG_UNROLL: 4 columns a trip, their loads first, then one a trip for the rest), and the
    # per-channel affine is read once per vector: the 8 lanes share its index
    res = fused_parity(group_norm(H, 64, 1, hw=(32, 32)), {}, {"x": (2, 64, 32, 32)}, ("rowreduce",))
    (k,) = res.kernels
    src = k.compiled.source
    body = src[src.index("__global__"):]
    assert "#pragma unroll" not in body and "t0[" not in body
    assert body.count("load_arg<8>(t0") == 3 * (4 + 1), body  # the two reductions and the output pass
    assert body.count("ofz::to_f32(t1[") == 4 + 1, body
    loops = body.split("for (ofz_i64 c")[1:]
    unrolled = [lp for lp in loops if "16384LL)" in lp.split("{")[0]]
    assert len(unrolled) == 3
    for lp in unrolled:  # every read of the trip before the first use of a loaded vector
        lines = lp.split("}")[0].splitlines()
        reads = [i for i, ln in enumerate(lines) if "load_arg<8>(t0" in ln]
        uses = [i for i, ln in enumerate(lines) if "ofz::to_f32(x" in ln]
        assert len(reads) == 4 and max(reads) < min(uses), lines

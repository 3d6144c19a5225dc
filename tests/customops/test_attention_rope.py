"""Rotary embeddings inside the attention kernel (search.attention.Rope, lower_attention's Q.rope / K.rope,
ortfuse_attention.h rotate_rows): Llama's q * cos + rotate_half(q) * sin on Q and on K (before grouped-query
attention's repeat), or GPT-NeoX's on their first columns only, becomes a rotation of the rows the kernel
loads, so no kernel writes the rotated Q and K.
Run in CPU emulation against ORT CPU on the original graph: the tensor-core kernel (fp16, head 64, key tiles
full and partial) and the SIMT kernel (fp32; fp16 at head 24), normwise 1e-2 (fp16) and 1e-5 (fp32)."""
from __future__ import annotations

import pytest
from onnx import TensorProto as TP

from helpers import fused_parity, rope_attention, rope_shapes

F, H = TP.FLOAT, TP.FLOAT16


@pytest.mark.parametrize("dt,head", [(H, 64), (F, 64), (H, 24), (H, 128)])
def test_q_and_k_rotated_inside_the_attention_kernel(dt, head):
    m = rope_attention(dt, head=head)
    for b, s in ((2, 37), (1, 100), (2, 1)):  # one partial key tile; a full and a partial one; one row a head
        # (planned at 64 rows: at the default 128 the fp32 kernel, on CUDA cores, loses to a row kernel + cuBLAS)
        res = fused_parity(m, rope_shapes(4, 2, head, "batch", "seq"), rope_shapes(4, 2, head, b, s), ["attention"],
                           dim_hints=[("seq", 64)] if dt == F else ())
    (r,) = res.plan.regions
    assert [res.graph.nodes[i].op_type for i in r.nodes].count("Neg") == 2
    src = res.kernels[0].compiled.source
    assert ("ofz::attn::tensor_core" in src) == (dt == H and head % 16 == 0)
    assert src.count("rope(const OfzArgs&") == 2
    assert not any(n.op_type in ("Neg", "Concat") for n in res.model.graph.node)


@pytest.mark.parametrize("dt", [H, F])
def test_rotated_grouped_query_heads_packed_at_a_generation_step(dt):
    # Llama rotates K before repeat_kv: at a generation step (--dim-hint seq=1) the 2 query heads of each K/V
    # head share a unit (rows rotated at their own head and row), and the kernel serves a prompt too
    m = rope_attention(dt, head=64)
    for b, s in ((2, 1), (1, 37)):
        res = fused_parity(m, rope_shapes(4, 2, 64, "batch", "seq"), rope_shapes(4, 2, 64, b, s), ["attention"],
                           dim_hints=[("seq", 1)])
    assert res.kernels[0].spec.units[1] == 2 and res.kernels[0].spec.units_ceil[0][0][1:] == (2,)


@pytest.mark.parametrize("dt,head,rot", [(H, 64, 32), (F, 32, 8)])
def test_a_partial_rotation_rotates_the_first_columns_only(dt, head, rot):
    # GPT-NeoX / Phi-2: the first `rot` columns rotated (pairs rot / 2 apart), the rest passed through
    m = rope_attention(dt, head=head, rot=rot)
    res = fused_parity(m, rope_shapes(4, 2, head, "batch", "seq", rot), rope_shapes(4, 2, head, 2, 70, rot),
                       ["attention"])
    (r,) = res.plan.regions
    assert [res.graph.nodes[i].op_type for i in r.nodes].count("Concat") == 4  # rotate_half's and the halves'
    src = res.kernels[0].compiled.source
    assert ("ofz::attn::tensor_core" in src) == (dt == H) and f"return {rot // 2}LL;" in src


def test_a_rotated_k_also_returned_stays_its_own_kernel():
    # the rotated K is a present-key output: its rotation is written anyway, so only Q's joins the attention
    m = rope_attention(H, k_out=True)
    res = fused_parity(m, rope_shapes(4, 2, 64, "batch", "seq"), rope_shapes(4, 2, 64, 2, 37), ["attention", "pointwise"])
    att = next(r for r in res.plan.regions if r.kind == "attention")
    assert [res.graph.nodes[i].op_type for i in att.nodes].count("Neg") == 1
    assert res.kernels[[k.region.kind for k in res.kernels].index("attention")].compiled.source.count(
        "rope(const OfzArgs&") == 1


def test_a_rotation_other_than_rotate_half_is_not_absorbed():
    # Concat(x1, -x2) is a different rotation: it stays an element-wise kernel per Q and K
    m = rope_attention(H, swapped=True)
    res = fused_parity(m, rope_shapes(4, 2, 64, "batch", "seq"), rope_shapes(4, 2, 64, 2, 37),
                       ["attention", "pointwise", "pointwise"])
    assert "rope(" not in next(k for k in res.kernels if k.region.kind == "attention").compiled.source


@pytest.mark.parametrize("dt,head,rot", [(H, 64, 0), (F, 64, 0), (H, 64, 32)])
def test_k_rotated_once_before_the_kernel(dt, head, rot):
    # --k-rope once: K's rotation is a kernel of its own (K read and written once), the attention reads the
    # rotated K and rotates only Q's rows
    m = rope_attention(dt, head=head, rot=rot)
    for b, s in ((2, 37), (1, 100)):
        res = fused_parity(m, rope_shapes(4, 2, head, "batch", "seq", rot), rope_shapes(4, 2, head, b, s, rot),
                           ["attention", "pointwise"], dim_hints=[("seq", 64)] if dt == F else (), k_rope="once")
    att = next(r for r in res.plan.regions if r.kind == "attention")
    rot_ops = next(r for r in res.plan.regions if r.kind == "pointwise")
    assert [res.graph.nodes[i].op_type for i in att.nodes].count("Neg") == 1
    assert [res.graph.nodes[i].op_type for i in rot_ops.nodes].count("Neg") == 1
    assert res.kernels[[k.region.kind for k in res.kernels].index("attention")].compiled.source.count(
        "rope(const OfzArgs&") == 1
    assert not any(r.subject.startswith("K's rotary") for r in res.plan.refusals)  # nothing was weighed


@pytest.mark.parametrize("seq,once", [(64, False), (4096, True)])
def test_the_estimate_rotates_k_once_for_long_prompts(seq, once):
    # --k-rope auto: each of a head's Sq / 64 query tiles (and each of a group's 2 query heads) rotates every K
    # tile again in the kernel; one rotation kernel costs a launch and K's traffic. At 64 rows a head that is
    # not worth even trying; at 4096 the whole model gains with K rotated once (our kernel's plans only: there
    # the estimate would hand the attention to ORT's MultiHeadAttention)
    m = rope_attention(H, head=64)
    res = fused_parity(m, rope_shapes(4, 2, 64, "batch", "seq"), rope_shapes(4, 2, 64, 2, 37),
                       ["attention", "pointwise"] if once else ["attention"], dim_hints=[("seq", seq)],
                       ort_attention="off")
    (note,) = [r for r in res.plan.refusals if r.subject.startswith("K's rotary")]
    if once:
        assert note.reason.startswith("rotated once before the kernel") and "whole model estimated" in note.reason
    else:
        assert "launches and K traffic of rotating K once" in note.reason


def test_k_rope_kernel_keeps_the_rotation_in_the_kernel():
    # --k-rope kernel: no second form weighed, whatever the estimate would say (4096 rows: once, above)
    m = rope_attention(H, head=64)
    res = fused_parity(m, rope_shapes(4, 2, 64, "batch", "seq"), rope_shapes(4, 2, 64, 2, 37), ["attention"],
                       dim_hints=[("seq", 4096)], ort_attention="off", k_rope="kernel")
    assert not any(r.subject.startswith("K's rotary") for r in res.plan.refusals)
    assert res.kernels[0].compiled.source.count("rope(const OfzArgs&") == 2


def test_rotation_loops_keep_one_column_pair_a_thread():
    # SASS (sm_90; skipped without cuobjdump): a rotation loop without MMAs loads the cos and sin of each pair's
    # two columns (4 LDG a pair) and spends about 6 instructions per load (97 per 4 pairs: each thread keeps
    # one column pair and steps over rows); dealing pairs out in order cost 231 (signed division, a bound
    # branch per pair, 64-bit index math)
    import re
    from helpers import sass_or_skip
    from ortfuse.api import compile_model
    from ortfuse.bench.sass import loops
    from ortfuse.config import Options
    sass = sass_or_skip()
    res = compile_model(rope_attention(H, head=64), None, "sm_90", Options(archs=(90,), k_rope="kernel"))
    ins = sass(dict(res.kernels[0].compiled.cubins)[90])
    bodies = [[t for a, t in ins if lo <= a <= hi] for lo, hi in loops(ins)]
    rotations = [body for body in bodies if not any("HMMA" in t for t in body) and any("LDG" in t for t in body)]
    assert len(rotations) == 2, [len(b) for b in bodies]  # Q's, K's
    for body in rotations:
        ldg = sum(1 for t in body if re.search(r"\bLDG\b", t))
        assert ldg % 4 == 0 and len(body) <= 7 * ldg, (len(body), ldg)

"""Attention regions lowered from graphs and run in CPU emulation against ORT: Q, K and V read from one
packed projection through a Split or Slices (the start folds into each operand's offset), on the SIMT
kernel (fp32) and the tensor-core kernel (fp16), at several sequence lengths of one compiled kernel."""
from __future__ import annotations

import pytest
from onnx import TensorProto as TP

from helpers import fused_parity, packed_attention


@pytest.mark.parametrize("select", ["split", "slice"])
@pytest.mark.parametrize("dt,heads,head", [(TP.FLOAT, 3, 24), (TP.FLOAT16, 2, 64)])
def test_packed_qkv(select, dt, heads, head):
    m = packed_attention(dt, heads, head, select)
    hd = heads * head
    shapes = {"x": ("batch", "seq", 3 * hd), "mask": ("batch", 1, 1, "seq")}
    for b, s in ((2, 37), (1, 70)):
        res = fused_parity(m, shapes, {"x": (b, s, 3 * hd), "mask": (b, 1, 1, s)}, ["attention"])
    src = res.kernels[0].compiled.source
    assert ("ofz::attn::tensor_core" in src) == (dt == TP.FLOAT16)
    assert [res.graph.nodes[i].op_type for i in res.plan.regions[0].nodes].count(select.capitalize()) == \
        (1 if select == "split" else 3)


def test_split_shared_with_a_kv_output_stays_with_ort():
    m = packed_attention(TP.FLOAT16, 2, 64, "split", kv_out=True)
    shapes = {"x": ("batch", "seq", 384), "mask": ("batch", 1, 1, "seq")}
    res = fused_parity(m, shapes, {"x": (2, 37, 384), "mask": (2, 1, 1, 37)}, ["attention"])
    assert "Split" in [n.op_type for n in res.model.graph.node]

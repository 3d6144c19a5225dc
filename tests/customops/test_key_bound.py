"""Causal frontiers (customops/key_bound.py): a mask built in the graph from Range iotas (and a padding input)
that is -inf past a diagonal lets the attention kernel skip the key tiles past each unit's rows
(`S.key_end`, ortfuse_attention.h). The analysis is checked on the forms exporters write and on forms that
must not qualify (a padding mask alone, the lowest finite float, a frontier that depends on the batch);
whole models are then run in CPU emulation against ORT CPU on the original graph (fp16 1e-2, fp32 1e-5
normwise, `check --emulate`)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse.customops.key_bound import KeyBound, key_bound
from ortfuse.search.attention import find_attention

HEADS, HEAD = 2, 64


def causal_attention(dt: int, form: str = "and", past: bool = False) -> onnx.ModelProto:
    """Self-attention on q, k, v [B, S, HEADS*HEAD] with its mask made in the graph as HF's masking utilities
    and TorchScript write it. `form`: "and" (Where(j <= i & padding, 0, -inf)), "greater" (Where(j > i, -inf,
    0) plus a padding bias), "shifted" (j < i + 3), "window" (j <= i & j > i - 64), "min" (as "and" at the
    lowest finite float), "padding" (no causal rule), "batch" (j <= i + b: differs per batch item), "trilu"
    (TorchScript's is_causal: a Trilu of ones, Where(tril == 0, -inf, 0)). `past`: K and V are a past
    [B, HEADS, P, HEAD] joined with the new keys, the query positions P + i (HF's cache_position)."""
    npdt = onnx.helper.tensor_dtype_to_np_dtype(dt)
    low = np.finfo(npdt).min if form == "min" else -np.inf
    n = [node("Reshape", ["q", "shp4"], ["q4"]), node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
         node("Reshape", ["k", "shp4"], ["k4"]), node("Transpose", ["k4"], ["kn"], perm=[0, 2, 1, 3]),
         node("Reshape", ["v", "shp4"], ["v4"]), node("Transpose", ["v4"], ["vn"], perm=[0, 2, 1, 3])]
    inputs = [vi(x, dt, ["batch", "seq", HEADS * HEAD]) for x in "qkv"]
    inputs.append(vi("attention_mask", TP.INT64, ["batch", "past + seq" if past else "seq"]))
    if past:
        inputs += [vi("past_k", dt, ["batch", HEADS, "past", HEAD]), vi("past_v", dt, ["batch", HEADS, "past", HEAD])]
        n += [node("Concat", ["past_k", "kn"], ["kh"], axis=2), node("Concat", ["past_v", "vn"], ["vh"], axis=2),
              node("Shape", ["past_k"], ["pshape"]), node("Gather", ["pshape", "two"], ["plen"], axis=0)]
    else:
        n += [node("Identity", ["kn"], ["kh"]), node("Identity", ["vn"], ["vh"])]
    n += [node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["qh", "kt"], ["s0"]),
          node("Mul", ["s0", "scale"], ["s1"]),
          # iotas: query positions (after the past) and key positions
          node("Shape", ["q"], ["qshape"]), node("Gather", ["qshape", "one"], ["slen"], axis=0),
          node("Shape", ["kh"], ["kshape"]), node("Gather", ["kshape", "two"], ["tlen"], axis=0),
          node("Range", ["zero", "slen", "one"], ["qr0"]), node("Range", ["zero", "tlen", "one"], ["kr"])]
    n.append(node("Add", ["qr0", "plen"], ["qr"]) if past else node("Identity", ["qr0"], ["qr"]))
    n += [node("Unsqueeze", ["qr", "ax1"], ["qi"]), node("Unsqueeze", ["kr", "ax0"], ["kj"]),
          node("Unsqueeze", ["attention_mask", "ax12"], ["am4"]), node("Cast", ["am4"], ["pad"], to=TP.BOOL)]
    if form in ("and", "min", "window", "shifted", "batch"):
        if form == "shifted":
            n += [node("Add", ["qi", "three"], ["qi3"]), node("Less", ["kj", "qi3"], ["causal"])]
        elif form == "batch":  # i + b: a frontier that is not one diagonal for the whole batch
            n += [node("Shape", ["q"], ["bshape"]), node("Gather", ["bshape", "zero1"], ["blen"], axis=0),
                  node("Range", ["zero", "blen", "one"], ["br"]), node("Unsqueeze", ["br", "ax123"], ["b4"]),
                  node("Add", ["qi", "b4"], ["qib"]), node("LessOrEqual", ["kj", "qib"], ["causal"])]
        else:
            n.append(node("LessOrEqual", ["kj", "qi"], ["causal"]))
        if form == "window":
            n += [node("Sub", ["qi", "width"], ["qi4"]), node("Greater", ["kj", "qi4"], ["inwin"]),
                  node("And", ["causal", "inwin"], ["causal_w"])]
        n += [node("And", ["causal_w" if form == "window" else "causal", "pad"], ["keep"]),
              node("Where", ["keep", "zf", "low"], ["bias"])]
    elif form == "greater":
        n += [node("Greater", ["kj", "qi"], ["hide"]), node("Where", ["hide", "low", "zf"], ["cbias"]),
              node("Where", ["pad", "zf", "low"], ["pbias"]), node("Add", ["cbias", "pbias"], ["bias"])]
    elif form == "trilu":
        n += [node("ConstantOfShape", ["sshape"], ["ones"], value=onnx.helper.make_tensor("v", TP.FLOAT, [1], [1.0])),
              node("Trilu", ["ones"], ["tril"], upper=0), node("Equal", ["tril", "zf32"], ["hide"]),
              node("Where", ["hide", "low", "zf"], ["bias"])]
    else:
        n.append(node("Where", ["pad", "zf", "low"], ["bias"]))
    if form == "trilu":
        n.append(node("Concat", ["slen1", "slen1"], ["sshape"], axis=0))
        n.append(node("Unsqueeze", ["slen", "ax0"], ["slen1"]))
    n += [node("Add", ["s1", "bias"], ["s2"]), node("Softmax", ["s2"], ["p"], axis=-1),
          node("MatMul", ["p", "vh"], ["o"]), node("Transpose", ["o"], ["o4"], perm=[0, 2, 1, 3]),
          node("Reshape", ["o4", "shp3"], ["y"])]
    i64 = np.int64
    inits = [const("shp4", [0, 0, HEADS, HEAD], i64), const("shp3", [0, 0, HEADS * HEAD], i64),
             const("scale", 1 / np.sqrt(HEAD), npdt), const("zero", 0, i64), const("zero1", [0], i64),
             const("one", 1, i64), const("two", 2, i64), const("three", 3, i64), const("width", 64, i64),
             const("ax0", [0], i64), const("ax1", [1], i64), const("ax12", [1, 2], i64),
             const("ax123", [1, 2, 3], i64), const("zf", 0, npdt), const("low", low, npdt),
             const("zf32", 0, np.float32)]
    return model(n, inputs, [vi("y", dt, ["batch", "seq", HEADS * HEAD])], inits)


def _bound(m: onnx.ModelProto):
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), ort_attention="off"))
    (p,), _ = find_attention(res.graph)
    return key_bound(res.graph, p), res


@pytest.mark.parametrize("form,want", [("and", KeyBound(False, 0)), ("greater", KeyBound(False, 0)),
                                       ("shifted", KeyBound(False, 2)), ("window", KeyBound(False, 0)),
                                       ("trilu", KeyBound(False, 0)), ("min", None), ("padding", None),
                                       ("batch", None)])
def test_the_frontiers_exporters_write(form: str, want):
    got, res = _bound(causal_attention(TP.FLOAT16, form))
    assert got == want
    src = next(k.compiled.source for k in res.kernels if k.region.kind == "attention")
    assert ("key_end(" in src) == (want is not None)
    if want is not None:
        assert f"return (ai + {1 + want.shift}LL);" in src
    from ortfuse.report import summary
    assert ("causal frontiers:     1 attention kernels skip" in summary(res)) == (want is not None)


def test_queries_after_a_past_have_a_bottom_right_frontier():
    got, res = _bound(causal_attention(TP.FLOAT16, "and", past=True))
    assert got == KeyBound(True, 0)
    src = next(k.compiled.source for k in res.kernels if k.region.kind == "attention")
    assert "key_end(" in src and "(ask - asq)" in src


def test_visible_share():
    # 130 queries over 130 keys in units of 64 rows and tiles of 64 keys: 1 + 2 + 3 of 9 pairs; after a past
    # of 70 keys, 37 queries see 2 of 2 tiles at most (107 keys)
    assert KeyBound(False, 0).visible_share(130, 130, 64, 64) == pytest.approx(6 / 9)
    assert KeyBound(True, 0).visible_share(37, 107, 64, 64) == 1.0
    assert KeyBound(False, 0).visible_share(4096, 4096, 64, 64) == pytest.approx((64 * 65 / 2) / 64 ** 2)
    assert KeyBound(False, -200).visible_share(128, 128, 64, 64) == 0.0


@pytest.mark.parametrize("form,past,dt", [("and", False, TP.FLOAT16), ("greater", False, TP.FLOAT),
                                          ("window", False, TP.FLOAT16), ("and", True, TP.FLOAT16),
                                          ("trilu", False, TP.FLOAT16)])
def test_skipping_kernels_match_ort(form: str, past: bool, dt: int):
    # the feeds pad the last quarter of the keys of every batch item but the first; 130 queries: three units
    # of 64 rows (the first visits one key tile of three, the second two); 37 rows after a past of 5; one row
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    m = causal_attention(dt, form, past)
    # (fp32 planned at 16 rows: at 64 and more its CUDA-core kernel loses to a row kernel + cuBLAS here)
    hints = (("seq", 16),) if dt == TP.FLOAT else ()
    res = compile_model(m, None, "sm_80,sm_90", options=Options(archs=(80, 90), ort_attention="off", dim_hints=hints))
    att = [k for k in res.kernels if k.region.kind == "attention"]
    assert att and "key_end(" in att[0].compiled.source
    for b, s, p in ((2, 130, 70), (1, 37, 5), (2, 1, 9)):
        shapes = {"q": [b, s, HEADS * HEAD], "k": [b, s, HEADS * HEAD], "v": [b, s, HEADS * HEAD],
                  "attention_mask": [b, s + p if past else s]}
        if past:
            shapes.update(past_k=[b, HEADS, p, HEAD], past_v=[b, HEADS, p, HEAD])
        rep = check_models(m, res.model, emulate=True, input_shapes=shapes)
        assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("form,seq", [("and", 4096), ("and", 128), ("padding", 4096)])
def test_the_estimate_counts_the_visited_tiles(form: str, seq: int):
    # the cost model's geometry at the sequence hint: (1 + 2 + ... + 64) of 64 x 64 unit-tile pairs at 4096
    # rows in units and tiles of 64; 3 of 4 at 128; every pair without a frontier
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    from ortfuse.search.cost import attention_geometry
    res = compile_model(causal_attention(TP.FLOAT16, form), None, "sm_90",
                        options=Options(archs=(90,), ort_attention="off", dim_hints=(("seq", seq),)))
    (r,) = [r for r in res.plan.regions if r.kind == "attention"]
    tiles = seq // 64
    want = (tiles * (tiles + 1) / 2) / tiles ** 2 if form == "and" else 1.0
    assert attention_geometry(res.graph, r).visible == pytest.approx(want)

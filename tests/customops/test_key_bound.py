"""Causal frontiers (customops/key_bound.py): a mask built in the graph from Range iotas (and a padding input),
or a constant triangle, that is -inf (or at least 1e4 below the scores) past a diagonal lets the attention
kernel skip the key tiles past each unit's rows (`S.key_end`; a sliding window's far side: `S.key_begin`;
ortfuse_attention.h). The analysis is checked on the forms exporters write and on forms that must not qualify
(a padding mask alone, a mask of -100, a frontier that depends on the batch); whole models are then run in
CPU emulation against ORT CPU on the original graph (fp16 1e-2, fp32 1e-5 normwise, `check --emulate`)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

from helpers import CAUSAL_HEAD as HEAD, CAUSAL_HEADS as HEADS, causal_attention
from ortfuse.customops.key_bound import KeyBound, key_bound
from ortfuse.search.attention import find_attention


def _bound(m: onnx.ModelProto):
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), ort_attention="off"))
    (p,), _ = find_attention(res.graph)
    return key_bound(res.graph, p), res


def _matches_ort(m: onnx.ModelProto, res, past: bool, bindings, kv_heads: int = HEADS) -> None:
    """The optimized model against ORT CPU on the original, in emulation, at (batch, queries, past) bindings."""
    from ortfuse.check import check_models
    for b, s, p in bindings:
        shapes = {"q": [b, s, HEADS * HEAD], "k": [b, s, kv_heads * HEAD], "v": [b, s, kv_heads * HEAD],
                  "attention_mask": [b, s + p if past else s]}
        if past:
            shapes.update(past_k=[b, kv_heads, p, HEAD], past_v=[b, kv_heads, p, HEAD])
        rep = check_models(m, res.model, emulate=True, input_shapes=shapes)
        assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("form,want", [("and", KeyBound(False, 0)), ("greater", KeyBound(False, 0)),
                                       ("shifted", KeyBound(False, 2)), ("window", KeyBound(False, 0, (False, -63))),
                                       ("trilu", KeyBound(False, 0)), ("min", KeyBound(False, 0)),
                                       ("shallow", None), ("padding", None), ("batch", None)])
def test_the_frontiers_exporters_write(form: str, want):
    got, res = _bound(causal_attention(TP.FLOAT16, form))
    assert got == want
    src = next(k.compiled.source for k in res.kernels if k.region.kind == "attention")
    assert ("key_end(" in src) == (want is not None)
    if want is not None:
        assert f"return (ai + {1 + want.shift}LL);" in src
        assert ("key_begin(" in src) == (want.low is not None)
    from ortfuse.report import summary
    assert ("causal frontiers:     1 attention kernels skip" in summary(res)) == (want is not None)
    assert ("1 also those before a sliding window" in summary(res)) == (want is not None and want.low is not None)


def test_a_constant_lower_triangle_is_its_rule():
    # a static causal mask as a constant (a [1, 1, 70, 70] tril of bools): its elements are read as
    # j <= i, so the frontier is found and the kernels match ORT (70 rows: two units, the first one tile)
    dt = TP.FLOAT16
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    m = causal_attention(dt, "const", seq=70)
    got, res = _bound(m)
    assert got == KeyBound(False, 0)
    res = compile_model(m, None, "sm_80,sm_90", options=Options(archs=(80, 90), ort_attention="off"))
    assert any(f.name == "S.key_end" for k in res.kernels for f in k.spec.kernel.funcs)
    rep = check_models(m, res.model, emulate=True, input_shapes={"q": [2, 70, 128], "k": [2, 70, 128],
                                                                  "v": [2, 70, 128], "attention_mask": [2, 70]})
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("past", [False, True])
def test_a_triangle_sliced_at_run_time_is_its_rule_shifted(past: bool):
    # GPT-2's bias buffer before transformers 4.4x: a [1, 1, 512, 512] lower triangle sliced to rows Sk - Sq ..
    # Sk - 1 (starts computed from shapes at run time) and keys 0 .. Sk - 1: row i reads buffer row i + Sk - Sq,
    # so the frontier is bottom-right (top-left without a past, where Sk - Sq is 0)
    m = causal_attention(TP.FLOAT16, "sliced", past)
    got, res = _bound(m)
    assert got == KeyBound(past, 0)
    src = next(k.compiled.source for k in res.kernels if k.region.kind == "attention")
    assert "key_end(" in src and ("(ask - asq)" in src) == past
    _matches_ort(m, res, past, ((2, 130, 70), (1, 37, 5)))


def test_a_run_time_start_that_may_be_negative_proves_nothing():
    # the same buffer sliced from Sq - Sk (minus the past's length): ORT would wrap a negative start, so the
    # rows read are not i + start and no frontier is claimed
    m = causal_attention(TP.FLOAT16, "sliced", True)
    (sub,) = [n for n in m.graph.node if n.op_type == "Sub" and list(n.input) == ["tlen", "slen"]]
    sub.input[:] = ["slen", "tlen"]
    assert _bound(m)[0] is None


def test_triangles():
    from ortfuse.customops.key_bound import _triangle
    assert _triangle(np.tril(np.ones((4, 6), bool), 1)) == (1, True, False)
    assert _triangle(np.where(np.tril(np.ones((5, 5), bool)), 0.0, -np.inf)[None]) == (0, 0.0, -np.inf)
    assert _triangle(np.triu(np.ones((5, 5), bool))) == (-1, False, True)  # the complement of j <= i - 1
    assert _triangle(np.ones((5, 5), bool)) is None and _triangle(np.eye(5, dtype=bool)) is None
    two = np.stack([np.tril(np.ones((4, 4))), np.tril(np.ones((4, 4)), -1)])
    assert _triangle(two) is None  # differs along a leading axis


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
    # a window of 64 keys (j in i - 63 .. i) over 256 rows: 1 + 2 + 2 + 2 of 16 (units 2 and 3 start a tile later)
    assert KeyBound(False, 0, (False, -63)).visible_share(256, 256, 64, 64) == pytest.approx(7 / 16)


@pytest.mark.parametrize("form,past,dt", [("and", False, TP.FLOAT16), ("greater", False, TP.FLOAT),
                                          ("window", False, TP.FLOAT16), ("and", True, TP.FLOAT16),
                                          ("trilu", False, TP.FLOAT16), ("min", False, TP.FLOAT16),
                                          ("min", True, TP.FLOAT)])
def test_skipping_kernels_match_ort(form: str, past: bool, dt: int):
    # the feeds pad the last quarter of the keys of every batch item but the first; 130 queries: three units
    # of 64 rows (the first visits one key tile of three, the second two); 37 rows after a past of 5; one row
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    m = causal_attention(dt, form, past)
    # (fp32 planned at 16 rows: at 64 and more its CUDA-core kernel loses to a row kernel + cuBLAS here)
    hints = ((("seq", 16),) + ((("past", 16),) if past else ())) if dt == TP.FLOAT else ()
    res = compile_model(m, None, "sm_80,sm_90", options=Options(archs=(80, 90), ort_attention="off", dim_hints=hints))
    att = [k for k in res.kernels if k.region.kind == "attention"]
    assert att and "key_end(" in att[0].compiled.source
    _matches_ort(m, res, past, ((2, 130, 70), (1, 37, 5), (2, 1, 9)))


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


def test_the_switch_keeps_every_tile(monkeypatch):
    # ORTFUSE_KEY_FRONTIER=0 (Options.key_frontier): the kernel visits every key tile, and the cost model built
    # on that target prices every tile (the GPU suite times both builds side by side)
    from ortfuse.api import compile_model, target_for
    from ortfuse.config import Options
    from ortfuse.search.cost import CostModel
    monkeypatch.setenv("ORTFUSE_KEY_FRONTIER", "0")
    # (at batch 8: 1024 units of 64 rows, many waves, where the tiles' sum decides; at batch 1 the 128 units fit
    # one wave and the last unit's 64 tiles, visited either way, are the time)
    opts = Options(archs=(90,), ort_attention="off", dim_hints=(("seq", 4096), ("batch", 8)))
    assert not opts.key_frontier
    res = compile_model(causal_attention(TP.FLOAT16, "and"), None, "sm_90", options=opts)
    (k,) = [k for k in res.kernels if k.region.kind == "attention"]
    assert not any(f.name == "S.key_end" for f in k.spec.kernel.funcs)
    on, off = (CostModel(target_for((90,), True, key_frontier=x)).attention_us(res.graph, k.region) for x in (1, 0))
    assert on < 0.75 * off, (on, off)  # about half the tiles at 4096 rows


@pytest.mark.parametrize("form", ["window", "and"])
def test_packed_query_heads_keep_the_frontier(form: str):
    # grouped-query heads (one K/V head for both query heads) after a past, planned for a generation step: the
    # heads are packed into one unit's rows and the kernel gets `S.group` with the frontier, so a step reads
    # only the window's K and V tiles (2 of 4 at 200 cached keys); the estimate counts those tiles and bytes.
    # The kernels match ORT at a step, a few queries and a prompt (units across both heads).
    from ortfuse.api import compile_model, target_for
    from ortfuse.config import Options
    from ortfuse.search.cost import CostModel, attention_geometry
    m = causal_attention(TP.FLOAT16, form, past=True, kv_heads=1)
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), ort_attention="off",
                                                          dim_hints=(("seq", 1), ("past", 200))))
    (k,) = [k for k in res.kernels if k.region.kind == "attention"]
    names = {f.name for f in k.spec.kernel.funcs}
    assert {"S.group", "S.key_end"} <= names and ("S.key_begin" in names) == (form == "window")
    assert k.spec.units_ceil[0][0][1:] == (HEADS,)  # packed
    geo = attention_geometry(res.graph, k.region)
    assert (geo.visible, geo.reach, geo.longest) == ((0.5, 0.5, 2) if form == "window" else (1.0, 1.0, 4))
    if form == "window":  # at 4096 cached keys a step's unit visits 2 of 65 tiles, not all of them
        long = compile_model(m, None, "sm_90", options=Options(archs=(90,), ort_attention="off", dim_hints=(
            ("seq", 1), ("past", 4096))))
        (r,) = [r for r in long.plan.regions if r.kind == "attention"]
        on, off = (CostModel(target_for((90,), True, key_frontier=x)).attention_us(long.graph, r) for x in (1, 0))
        assert on < 0.5 * off, (on, off)
    _matches_ort(m, res, True, ((2, 1, 200), (1, 3, 150), (2, 70, 100)), kv_heads=1)


def test_a_mask_keeps_its_depth_only_where_nothing_can_lift_it():
    # IR-level: (frontier c, depth) of score expressions; a finite mask plus or minus an operand of unknown or
    # opposite sign is not masked (it could be lifted back), -inf survives anything but -inf subtracted
    import math

    from ortfuse.customops import key_bound as kb
    from ortfuse.customops.ir import F32, I64, Const, Op, Var
    i, j, qk, ext = Var("ai", I64), Var("aj", I64), Var("qk", F32), Var("ext", F32)
    causal, pad = Op("le", (j, i), "bool"), Op("ne", (Var("x", I64), Const(0, I64)), "bool")

    def where(c, a, b):
        return Op("select", (c, Const(a, F32), Const(b, F32)), F32)

    def op(fn, a, b):
        return Op(fn, (a, b), F32)

    def depth(e):
        m = kb._Analysis({}, {}, 1).masked(e)
        return None if m is None else (m[0], m[1])
    c0 = ((), 0)
    assert depth(op("add", qk, where(causal, 0.0, -65504.0))) == (c0, 65504.0)
    assert depth(op("add", op("add", qk, where(causal, 0.0, -1e4)), where(pad, 0.0, -1e4))) == (c0, 1e4)
    assert depth(op("sub", op("add", qk, where(causal, 0.0, -65504.0)), Const(3.0, F32))) == (c0, 65504.0)
    assert depth(op("mul", op("add", qk, where(causal, 0.0, -65504.0)), Const(0.125, F32))) == (c0, 8188.0)
    assert depth(op("sub", op("add", qk, where(causal, 0.0, -65504.0)), ext)) is None
    assert depth(op("sub", op("add", qk, where(causal, 0.0, -1e4)), where(pad, 0.0, -1e4))) is None
    assert depth(op("add", op("add", qk, where(causal, 0.0, -1e4)), op("mul", where(pad, 0.0, -1e4),
                                                                      Const(-1.0, F32)))) is None
    assert depth(op("fmin", op("add", qk, where(causal, 0.0, -15000.0)), Const(-12000.0, F32))) is None
    assert depth(op("add", ext, where(causal, 0.0, -math.inf))) == (c0, math.inf)
    assert depth(op("sub", op("add", qk, where(causal, 0.0, -math.inf)), ext)) == (c0, math.inf)
    assert depth(op("sub", op("add", qk, where(causal, 0.0, -math.inf)), where(causal, 0.0, -math.inf))) is None
    # a key-padding flag (an element of an integer graph input: kernel argument 1 here) is 0 or 1, so legacy
    # exports' (1 - m) * lowest adds at most 0; another argument's element could be anything
    from ortfuse.customops.ir import Load

    def legacy(arg: int):
        flag = Op("cast", (Load(arg, Var("aj", I64), "i64"),), F32)
        pad = op("mul", op("sub", Const(1.0, F32), flag), Const(-65504.0, F32))
        m = kb._Analysis({}, {}, 1, frozenset({1})).masked(op("add", op("add", qk, where(causal, 0.0, -65504.0)), pad))
        return None if m is None else (m[0], m[1])
    assert legacy(1) == (c0, 65504.0) and legacy(2) is None


def _edited(m: onnx.ModelProto, after: str, nodes, inits=(), inputs=()) -> onnx.ModelProto:
    """m with `nodes` inserted after the node producing `after` (which they may rename), and more inputs."""
    from onnx import numpy_helper
    g = m.graph
    at = next(k for k, n in enumerate(g.node) if after in n.output) + 1
    for k, n in enumerate(nodes):
        g.node.insert(at + k, n)
    g.initializer.extend(numpy_helper.from_array(np.asarray(v, dtype=dt), name) for name, v, dt in inits)
    g.input.extend(inputs)
    onnx.checker.check_model(m)
    return m


def test_what_must_prove_nothing():
    # forms found unsound in review (session 45), each a frontier claimed where the model with legitimate
    # inputs has a visible key past it:
    from onnx import helper
    # an integer input that is not a mask (position ids) lifting a finite mask: only inputs named masks are 0/1
    # flags (with -inf nothing finite lifts it)
    from onnx import numpy_helper
    m = causal_attention(TP.FLOAT, "and")
    next(t for t in m.graph.initializer if t.name == "low").CopyFrom(numpy_helper.from_array(np.float32(-1e5), "low"))
    next(n for n in m.graph.node if n.output[0] == "s2").input[1] = "bias2"
    m = _edited(m, "bias", [helper.make_node("Unsqueeze", ["position_ids", "ax12"], ["pos4"]),
                            helper.make_node("Cast", ["pos4"], ["posf"], to=TP.FLOAT),
                            helper.make_node("Mul", ["posf", "slope"], ["posb"]),
                            helper.make_node("Add", ["bias", "posb"], ["bias2"])],
                [("slope", 1000.0, np.float32)],
                [helper.make_tensor_value_info("position_ids", TP.INT64, ["batch", "seq"])])
    assert _bound(m)[0] is None
    # steps computed at run time (-1: a reversed read of the keys), not unit steps
    m = causal_attention(TP.FLOAT16, "and")
    le = next(n for n in m.graph.node if n.op_type == "LessOrEqual")
    le.input[:], le.output[:] = ["kj", "qit"], ["rev"]
    m.graph.node.insert(list(m.graph.node).index(le), helper.make_node("Add", ["qi", "tlen"], ["qit"]))
    m = _edited(m, "rev", [helper.make_node("Unsqueeze", ["tlen", "ax0"], ["tlen1"]),
                           helper.make_node("Div", ["tlen1", "tlen1"], ["one_rt"]),
                           helper.make_node("Sub", ["zero1", "one_rt"], ["step_rt"]),
                           helper.make_node("Slice", ["rev", "tlen1", "imin", "ax1", "step_rt"], ["causal"])],
                [("imin", [np.iinfo(np.int64).min], np.int64)])
    assert _bound(m)[0] is None
    # an indicator whose two values are one in f32: (j > i) + 1e8 == 1e8 holds everywhere
    m = causal_attention(TP.FLOAT, "and")
    le = next(n for n in m.graph.node if n.op_type == "LessOrEqual")
    le.op_type, le.output[0] = "Greater", "hide"
    m = _edited(m, "hide", [helper.make_node("Cast", ["hide"], ["hidef"], to=TP.FLOAT),
                            helper.make_node("Add", ["hidef", "big"], ["ind"]),
                            helper.make_node("Equal", ["ind", "big"], ["causal"])], [("big", 1e8, np.float32)])
    assert _bound(m)[0] is None


def test_dim_names_as_forms():
    from ortfuse.customops.key_bound import _name_form
    assert _name_form("past_sequence + sequence") == ((("past_sequence", 1), ("sequence", 1)), 0)
    assert _name_form("2*s + 1") == ((("s", 2),), 1)
    for opaque in ("-seq + total", "2*total - 1", "Min(256, s)", "s*t"):  # one unknown size each
        assert _name_form(opaque) == (((opaque, 1),), 0)

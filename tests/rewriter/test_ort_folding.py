"""What ORT's constant folding computes when a session starts (`rewriter.ort_folding`), and that the search
leaves such work to it: a fused node, which ORT cannot fold, would run it on every call."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

import helpers
from helpers import const, model, node, vi
from ortfuse.api import compile_model
from ortfuse.check import check_models
from ortfuse.rewriter.ort_folding import fold_candidates, folded_nodes, ort_folded
from ortfuse.rewriter.shapes import build_graph

S, H, R = 64, 16, 255  # a relative-position bias: each of H heads' [S, S] gathered from an [R, H] table


def _relative_bias(dt: int, cone: str = "exp") -> onnx.ModelProto:
    """BEiT's shape of the problem: a bias computed from constants alone (a table gathered at a constant index,
    then element-wise work), too big to write into the model (H x S x S > 64 KB in 16 bits), read by an op
    ortfuse does not fuse (ScatterND, as BEiT's own index arithmetic), then added to the attention scores."""
    rng = np.random.default_rng(0)
    npt = onnx.helper.tensor_dtype_to_np_dtype(dt)
    table = const("table", rng.standard_normal((R, H)).astype(npt), npt)
    index = const("index", rng.integers(0, R, S * S), np.int64)
    nodes = [node("Gather", ["table", "index"], ["g"], axis=0), node("Reshape", ["g", "shp"], ["r"]),
             node("Transpose", ["r"], ["t"], perm=[2, 0, 1])]
    if cone == "exp":  # element-wise work on the gathered bias: exp(t) * 0.5 + 1
        nodes += [node("Exp", ["t"], ["e"]), node("Mul", ["e", "half"], ["m"]), node("Add", ["m", "one"], ["bias"])]
    else:
        nodes += [node("Mul", ["t", "half"], ["m"]), node("Add", ["m", "one"], ["bias"])]
    nodes += [node("ScatterND", ["bias", "at", "upd"], ["b2"]), node("Add", ["scores", "b2"], ["s1"]),
              node("Softmax", ["s1"], ["y"], axis=-1)]
    inits = [table, index, const("shp", [S, S, H], np.int64), const("half", 0.5, npt), const("one", 1.0, npt),
             const("at", [[0, 0, 0]], np.int64)]
    return model(nodes, [vi("scores", dt, ["b", H, S, S]), vi("upd", dt, [1])], [vi("y", dt, ["b", H, S, S])],
                 inits)


def _ort_alone(m: onnx.ModelProto) -> tuple[set[str], set[str]]:
    """(initializers, node outputs) of the model as ORT's own optimizer leaves it (CPU EP, basic level)."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.log_severity_level = 4
        so.optimized_model_filepath = str(Path(tmp) / "o.onnx")
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        out = onnx.load(so.optimized_model_filepath).graph
        return {t.name for t in out.initializer}, {o for n in out.node for o in n.output}


@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16])
def test_the_probe_agrees_with_ort_on_the_whole_model(dt):
    # fp32: the whole cone folds. fp16: the Gather, Reshape and Transpose fold (copies, kernels for every type
    # on the CPU EP), the Exp does not (no fp16 CPU kernel), nor what follows it
    m = _relative_bias(dt)
    g = build_graph(m, {})
    cone = {"g", "r", "t", "e", "m", "bias"}
    assert {o for i in fold_candidates(g) for o in g.nodes[i].output} == cone
    want = cone if dt == TP.FLOAT else {"g", "r", "t"}
    assert ort_folded(g) == want
    assert {g.nodes[i].output[0] for i in folded_nodes(g)} == want
    # ORT alone on the whole model: the value it keeps of the cone (the last folded one a node reads) is folded
    # by the probe's word, and nothing the probe calls folded is left a node (the rest of the cone is: in fp16
    # under names ORT's inserted Casts give it)
    values, computed = _ort_alone(m)
    assert values & cone and values & cone <= want
    assert not computed & want


def _exp_of(w: onnx.TensorProto, dtype: int, outputs=("y",), ir: int | None = None, fed: bool = False):
    """x + Exp(w) (and whatever `outputs` names besides y)."""
    x = vi("x", dtype, [4])
    m = model([node("Exp", ["w"], ["e"]), node("Add", ["x", "e"], ["y"])], [x, *([vi("w", dtype, [4])] if fed else [])],
              [vi(o, dtype, [4]) for o in outputs], [w])
    if ir is not None:
        m.ir_version = ir
    return m


def test_what_ort_folds_and_what_it_does_not(monkeypatch):
    from ortfuse.rewriter import ort_folding
    asked = []
    real = ort_folding._ask
    monkeypatch.setattr(ort_folding, "_ask", lambda g, i: asked.append(len(i)) or real(g, i))
    w = const("w", np.arange(4, dtype=np.float32) / 4)
    w16 = const("w", (np.arange(4) / 4).astype(np.float16), np.float16)
    q = model([node("DequantizeLinear", ["q", "sc"], ["e"]), node("Add", ["x", "e"], ["y"])],
              [vi("x", TP.FLOAT, [4])], [vi("y", TP.FLOAT, [4])], [const("q", [1, 2, 3, 4], np.int8), const("sc", 0.5)])
    draw = model([node("RandomUniformLike", ["w"], ["e"]), node("Add", ["x", "e"], ["y"])],
                 [vi("x", TP.FLOAT, [4])], [vi("y", TP.FLOAT, [4])], [w])
    cases = {  # model -> (candidates, folded)
        "fp32 Exp": (_exp_of(w, TP.FLOAT), {"e"}, {"e"}),
        "a graph output": (_exp_of(w, TP.FLOAT, outputs=("y", "e")), {"e"}, {"e"}),  # ORT 1.31 folds those too
        "fp16 Exp": (_exp_of(w16, TP.FLOAT16), {"e"}, set()),  # no fp16 Exp on the CPU EP
        "DequantizeLinear": (q, {"e"}, set()),  # kept for ORT's quantized kernels
        "fed, IR 4 on": (_exp_of(w, TP.FLOAT, fed=True), set(), set()),  # a user may feed another w
        "fed, IR 3": (_exp_of(w, TP.FLOAT, fed=True, ir=3), {"e"}, {"e"}),  # every initializer is listed then
        "a draw": (draw, set(), set()),
    }
    for kind, (m, candidates, folded) in cases.items():
        g = build_graph(m, {})
        assert {o for i in fold_candidates(g) for o in g.nodes[i].output} == candidates, kind
        assert ort_folded(g) == folded, kind
    assert len(asked) == 5  # every case with a candidate asked ORT


def test_a_group_ort_refuses_leaves_the_others_folded(monkeypatch):
    # bf16 Exp has no CPU kernel at all (ORT refuses the probe model): its group is asked alone, not folded, and
    # the fp32 group beside it still is
    from ortfuse.rewriter import ort_folding
    asked = []
    real = ort_folding._ask
    monkeypatch.setattr(ort_folding, "_ask", lambda g, i: asked.append(len(i)) or real(g, i))
    bits = (np.arange(4, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    wb = helpers.raw_init("wb", bits, TP.BFLOAT16)
    m = model([node("Exp", ["wb"], ["eb"]), node("Cast", ["eb"], ["ef"], to=TP.FLOAT),
               node("Exp", ["w"], ["e"]), node("Mul", ["e", "e"], ["e2"]),
               node("Add", ["x", "ef"], ["y0"]), node("Add", ["y0", "e2"], ["y"])],
              [vi("x", TP.FLOAT, [4])], [vi("y", TP.FLOAT, [4])], [wb, const("w", np.arange(4) / 4)])
    g = build_graph(m, {})
    assert ort_folded(g) == {"e", "e2"}
    assert asked == [4, 2, 2]  # both groups together, then each alone


def test_copies_fold_without_asking_and_answers_are_reused(monkeypatch):
    from ortfuse.rewriter import ort_folding
    ort_folding._ANSWERS.clear()
    asked = []
    real = ort.InferenceSession
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: asked.append(1) or real(*a, **k))
    table = const("emb", np.random.default_rng(0).standard_normal((50, 16)).astype(np.float32))
    tied = model([node("Transpose", ["emb"], ["embt"], perm=[1, 0]), node("MatMul", ["x", "embt"], ["y"])],
                 [vi("x", TP.FLOAT, ["b", 16])], [vi("y", TP.FLOAT, None)], [table])
    assert ort_folded(build_graph(tied, {})) == {"embt"} and asked == []  # a tied LM head's Transpose
    w = const("w", np.arange(4, dtype=np.float32) / 4)
    assert ort_folded(build_graph(_exp_of(w, TP.FLOAT), {})) == {"e"}
    assert ort_folded(build_graph(_exp_of(w, TP.FLOAT), {})) == {"e"}  # another graph of the same model
    assert len(asked) == 1  # one session: the second graph's probe model is the first's


def test_a_scalar_and_an_eliminated_identity_fold():
    # a rank-0 value (the probe reads it through an Unsqueeze) and an Identity ORT removes rather than folds
    m = model([node("Identity", ["w"], ["i"]), node("Exp", ["i"], ["e"]), node("ReduceSum", ["e"], ["s"], keepdims=0),
               node("Mul", ["x", "s"], ["y"])], [vi("x", TP.FLOAT, [4])], [vi("y", TP.FLOAT, [4])],
              [const("w", np.arange(4, dtype=np.float32))])
    g = build_graph(m, {})
    assert g.tensors["s"].shape == ()
    assert ort_folded(g) == {"i", "e", "s"}


@pytest.mark.parametrize("side", [False, True])
def test_a_cone_ort_folds_is_not_fused(side, monkeypatch):
    # Gather -> Reshape -> Transpose -> Exp -> Mul -> Add: ORT folds it all. `side`: run-time work also reads
    # the Mul (a graph output m * u, u an input), so a region computing m with it would keep ORT from folding
    # the Add after m, and is refused for that
    from ortfuse.report import summary
    from ortfuse.search import cost
    m = _relative_bias(TP.FLOAT)
    if side:
        m.graph.node.append(node("Mul", ["m", "upd"], ["pe"]))
        m.graph.output.append(vi("pe", TP.FLOAT, [H, S, S]))
    res = compile_model(m, None, "sm_90")
    names = {"g", "r", "t", "e", "m", "bias"}
    cone = {i for i, n in enumerate(res.graph.nodes) if n.output[0] in names}
    assert len(cone) == len(names) and cone == folded_nodes(res.graph)
    assert not any(set(r.nodes) & cone for r in res.plan.regions)
    assert any("ORT folds it when a session starts" in x.reason for x in res.plan.refusals)
    if side:
        assert any("Add 'Add_bias', which ORT folds when a session starts, reads its output 'm'" in x.reason
                   for x in res.plan.refusals)
    # the output model's own candidates are the cone: ORT folds there what the search left it
    out = build_graph(res.model, {})
    assert {out.nodes[i].output[0] for i in fold_candidates(out)} == names
    line = next(x for x in summary(res).splitlines() if x.startswith("constant cones:"))
    assert line.split()[2] == str(len(names))
    # the plan estimate prices the cone at zero: without that, a kernel a node that ORT would run (not the
    # Reshape, which ORT aliases)
    from ortfuse.search import ops
    runs = [i for i in cone if res.graph.nodes[i].op_type not in ops.FREE_IN_ORT]
    with_folds = cost.CostModel(_target()).plan_times(res.graph, res.plan, res.plan)[0][1]
    monkeypatch.setattr(cost, "folded_nodes", lambda g: frozenset())
    without = cost.CostModel(_target()).plan_times(res.graph, res.plan, res.plan)[0][1]
    assert len(runs) == 5 and without - with_folds >= len(runs) * _target().launch_us
    rep = check_models(m, res.model, emulate=True, input_shapes={"scores": (2, H, S, S)})
    assert rep.ok, "\n".join(rep.lines())


def _target():
    from ortfuse.api import target_for
    return target_for([90])


@pytest.mark.parametrize("cone", ["exp", "affine"])
def test_a_cone_ort_cannot_fold_is_fused(cone):
    # fp16 Exp, Mul and Add have no CPU kernel: ORT runs them (and what follows) on every call, so a kernel of
    # ours may; the Gather and Reshape before them fold (the Transpose folds too, but a kernel reading through
    # it costs nothing more)
    m = _relative_bias(TP.FLOAT16, cone=cone)
    res = compile_model(m, None, "sm_90")
    fused = {res.graph.nodes[i].output[0] for r in res.plan.regions for i in r.nodes}
    assert {"m", "bias"} <= fused and not fused & {"g", "r"}
    rep = check_models(m, res.model, emulate=True, input_shapes={"scores": (2, H, S, S)})
    assert rep.ok, "\n".join(rep.lines())

"""What ORT's constant folding computes when a session starts (`rewriter.ort_folding`), and that the search
leaves such work to it: a fused node, which ORT cannot fold, would run it on every call."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

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


def _ort_folds_alone(m: onnx.ModelProto) -> set[str]:
    """The tensors ORT's own optimizer turns into initializers in the whole model (CPU EP, basic level)."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.log_severity_level = 4
        so.optimized_model_filepath = str(Path(tmp) / "o.onnx")
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return {t.name for t in onnx.load(so.optimized_model_filepath).graph.initializer}


@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16])
def test_the_probe_agrees_with_ort_on_the_whole_model(dt):
    # fp32: the whole cone folds. fp16: the Gather, Reshape and Transpose fold (copies, kernels for every type
    # on the CPU EP), the Exp does not (no fp16 CPU kernel), nor what follows it
    m = _relative_bias(dt)
    g = build_graph(m, {})
    cone = {"g", "r", "t", "e", "m", "bias"}
    assert {o for i in fold_candidates(g) for o in g.nodes[i].output} == cone
    want = {"g", "r", "t", "e", "m", "bias"} if dt == TP.FLOAT else {"g", "r", "t"}
    assert ort_folded(g) == want
    # ORT alone keeps only the cone's last value (the one a non-folded node reads): it must be one the probe
    # calls folded, and nothing the probe calls folded may be left a node
    kept = _ort_folds_alone(m) & cone
    assert kept and kept <= want
    assert {g.nodes[i].output[0] for i in folded_nodes(g)} == want


def test_what_ort_does_not_fold():
    x = vi("x", TP.FLOAT, [4])
    w = const("w", np.arange(4, dtype=np.float32))
    cases = {
        # an initializer a user may feed (listed as a graph input)
        "fed": model([node("Exp", ["w"], ["e"]), node("Add", ["x", "e"], ["y"])], [x, vi("w", TP.FLOAT, [4])],
                     [vi("y", TP.FLOAT, [4])], [w]),
        # a graph output
        "output": model([node("Exp", ["w"], ["e"]), node("Add", ["x", "e"], ["y"])], [x],
                        [vi("y", TP.FLOAT, [4]), vi("e", TP.FLOAT, [4])], [w]),
        # a draw
        "random": model([node("RandomUniformLike", ["w"], ["e"]), node("Add", ["x", "e"], ["y"])], [x],
                        [vi("y", TP.FLOAT, [4])], [w]),
        # ORT keeps a DequantizeLinear of a constant for its quantized kernels
        "dq": model([node("DequantizeLinear", ["q", "sc"], ["e"]), node("Add", ["x", "e"], ["y"])], [x],
                    [vi("y", TP.FLOAT, [4])], [const("q", [1, 2, 3, 4], np.int8), const("sc", 0.5)]),
    }
    for kind, m in cases.items():
        assert ort_folded(build_graph(m, {})) == frozenset(), kind


def test_a_scalar_and_an_eliminated_identity_fold():
    # a rank-0 value (the probe reads it through an Unsqueeze) and an Identity ORT removes rather than folds
    m = model([node("Identity", ["w"], ["i"]), node("Exp", ["i"], ["e"]), node("ReduceSum", ["e"], ["s"], keepdims=0),
               node("Mul", ["x", "s"], ["y"])], [vi("x", TP.FLOAT, [4])], [vi("y", TP.FLOAT, [4])],
              [const("w", np.arange(4, dtype=np.float32))])
    g = build_graph(m, {})
    assert g.tensors["s"].shape == ()
    assert ort_folded(g) == {"i", "e", "s"}


def test_a_cone_ort_folds_is_not_fused():
    m = _relative_bias(TP.FLOAT, cone="affine")  # Gather -> Reshape -> Transpose -> Mul -> Add: ORT folds it all
    res = compile_model(m, None, "sm_90")
    cone = {i for i, n in enumerate(res.graph.nodes) if n.output[0] in {"g", "r", "t", "m", "bias"}}
    assert len(cone) == 5 and cone <= folded_nodes(res.graph)
    assert not any(set(r.nodes) & cone for r in res.plan.regions)
    assert any("ORT folds it when a session starts" in x.reason for x in res.plan.refusals)
    # in the output every node on the cone still reads initializers only: ORT folds it there too
    out = res.model.graph
    made = {o for n in out.node for o in n.output}
    consts = {t.name for t in out.initializer}
    for n in out.node:
        if any(o in {"g", "r", "t", "m", "bias"} for o in n.output):
            assert n.domain in ("", "ai.onnx") and all(x in consts or x in {"g", "r", "t", "m"} for x in n.input), n
    assert made  # (the fused nodes are what follows the ScatterND)
    rep = check_models(m, res.model, emulate=True, input_shapes={"scores": (2, H, S, S)})
    assert rep.ok, "\n".join(rep.lines())


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

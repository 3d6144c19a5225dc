"""bfloat16 models end to end on the CPU: ORT's CPU EP has no bf16 Add or MatMul, so `check` runs the model's
fp32 shadow (every bf16 tensor rounded as it is produced) and feeds every kernel, in emulation, the bf16
values it would see; ORT's Python binding, which has no numpy bf16, gets and returns such tensors as bits."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from helpers import model, node, vi, wrong_gelu
from ortfuse import ortvalues
from ortfuse.api import compile_model
from ortfuse.bench.bf16 import to_bf16, without_bf16
from ortfuse.bf16_shadow import computes_in_bf16, shadow
from ortfuse.check import _dtypes, check_models
from ortfuse.cli import main
from ortfuse.demo import encoder
from ortfuse.errors import InputError
from ortfuse.feeds import random_feeds

BF = ml_dtypes.bfloat16


def _bf(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(BF).astype(np.float32)


def _block() -> onnx.ModelProto:
    """x [2, 5, 16] bf16 -> MatMul, bias Add, Softmax, Mul by a constant, Cast to fp32."""
    rng = np.random.default_rng(1)
    w = onnx.numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32).astype(BF), "w")
    b = onnx.numpy_helper.from_array(rng.standard_normal(16).astype(np.float32).astype(BF), "b")
    nodes = [node("MatMul", ["x", "w"], ["mm"]), node("Add", ["mm", "b"], ["z"]),
             node("Softmax", ["z"], ["p"], axis=-1),
             onnx.helper.make_node("Constant", [], ["k"], value=onnx.numpy_helper.from_array(np.array(3.3, BF), "k")),
             node("Mul", ["p", "k"], ["y"]), node("Cast", ["y"], ["y32"], to=TP.FLOAT)]
    return model(nodes, [vi("x", TP.BFLOAT16, [2, 5, 16])], [vi("y", TP.BFLOAT16, None), vi("y32", TP.FLOAT, None)],
                 [w, b])


def test_shadow_rounds_every_op_as_a_bf16_model_does():
    m = _block()
    assert computes_in_bf16(m) and not computes_in_bf16(encoder(layers=1, hidden=16, heads=2, ffn=32))
    sh = shadow(m, _dtypes(m))
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32).astype(BF)
    sess = ort.InferenceSession(sh.model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, y32 = (sh.restored(n, v) for n, v in zip(["y", "y32"], sess.run(["y", "y32"], sh.feeds({"x": x}))))
    assert y.dtype == BF and y32.dtype == np.float32
    # the reference, op by op in fp32 with each bf16 result rounded (what the CUDA EP computes)
    w, b = (onnx.numpy_helper.to_array(t).astype(np.float32) for t in m.graph.initializer)
    z = _bf(_bf(x.astype(np.float32) @ w) + b)
    e = np.exp(z - z.max(-1, keepdims=True))
    want = _bf(_bf(e / e.sum(-1, keepdims=True)) * _bf(3.3))
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=0, atol=2 ** -9)  # within one bf16 rounding
    assert np.array_equal(y32, y.astype(np.float32))
    unrounded = (x.astype(np.float32) @ w)
    assert not np.array_equal(_bf(unrounded), unrounded)  # (the rounding is there to see)


def test_bf16_values_through_orts_python_binding():
    m = _block()
    feeds = random_feeds(m)
    assert feeds["x"].dtype == BF and np.unique(feeds["x"].astype(np.float32)).size > 100  # random normal
    x = ortvalues.to_ortvalue(feeds["x"])
    assert x.data_type() == "tensor(bfloat16)" and np.array_equal(ortvalues.to_numpy(x).view(np.uint16),
                                                                   feeds["x"].view(np.uint16))
    cast = model([node("Cast", ["x"], ["f"], to=TP.FLOAT), node("Cast", ["f"], ["y"], to=TP.BFLOAT16)],
                 [vi("x", TP.BFLOAT16, [2, 5, 16])], [vi("y", TP.BFLOAT16, [2, 5, 16]), vi("f", TP.FLOAT, None)])
    sess = ort.InferenceSession(cast.SerializeToString(), providers=["CPUExecutionProvider"])
    y, f = ortvalues.run(sess, ["y", "f"], feeds)
    assert y.dtype == BF and np.array_equal(y.view(np.uint16), feeds["x"].view(np.uint16))
    assert np.array_equal(f, feeds["x"].astype(np.float32))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("bf16")
    src = d / "in.onnx"
    onnx.save(to_bf16(encoder(layers=1, hidden=64, heads=2, ffn=128)), str(src))
    return src, d / "out.onnx"


def test_bf16_encoder_optimizes_and_checks_in_emulation(demo, capsys):
    src, dst = demo
    assert main(["optimize", str(src), str(dst)]) == 0
    m = onnx.load(str(dst))
    fused = [n for n in m.graph.node if n.domain == "ortfuse"]
    assert len(fused) >= 4
    sources = " ".join(a.s.decode() for n in fused for a in n.attribute if a.type == onnx.AttributeProto.STRING)
    assert "__nv_bfloat16" in sources  # the kernels store bf16
    capsys.readouterr()
    assert main(["check", str(src), str(dst), "--emulate"]) == 0
    out = capsys.readouterr().out
    assert "parity PASS" in out and out.count("kernel ") == len(fused), out


def test_bf16_check_detects_a_wrong_kernel(demo, tmp_path, capsys):
    src, dst = demo
    bad = tmp_path / "bad.onnx"
    wrong_gelu(src, dst, bad)
    capsys.readouterr()
    assert main(["check", str(src), str(bad), "--emulate"]) == 1
    out = capsys.readouterr().out
    # the kernel, still right, differs from its (wrong) sub-graph. (The whole model, which runs that sub-graph,
    # moves by about 0.5% here, within bf16's tolerance: the LayerNorm after it dilutes the change.)
    assert any("FAIL" in k for k in out.split("kernel ")[1:]), out


def test_bf16_with_subgraphs_is_a_clear_error(tmp_path):
    then = onnx.helper.make_graph([node("Identity", ["x"], ["t"])], "then", [], [vi("t", TP.BFLOAT16, [4])])
    other = onnx.helper.make_graph([node("Neg", ["x"], ["e"])], "else", [], [vi("e", TP.BFLOAT16, [4])])
    m = model([node("Add", ["x", "x"], ["s"]), node("If", ["c"], ["y"], then_branch=then, else_branch=other),
               node("Mul", ["y", "s"], ["z"])],
              [vi("x", TP.BFLOAT16, [4]), vi("c", TP.BOOL, [])], [vi("z", TP.BFLOAT16, [4])])
    with pytest.raises(InputError, match="If/Loop/Scan"):
        check_models(m, m)


def test_to_bf16_keeps_ops_without_bf16_at_the_opset_in_fp32():
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    m = model([node("MatMul", ["x", "w"], ["a"]), node("Cos", ["a"], ["c"]), node("Sin", ["a"], ["s"]),
               node("Add", ["c", "s"], ["y"])], [vi("x", TP.FLOAT, [2, 8])], [vi("y", TP.FLOAT, None)], [w], opset=17)
    assert without_bf16(m) == {"Cos", "Sin"}
    b = to_bf16(m)
    onnx.checker.check_model(b, full_check=True)  # valid: Cos and Sin stay fp32 (one Cast feeds both)
    types = _dtypes(b)
    trig = [n for n in b.graph.node if n.op_type in ("Cos", "Sin")]
    assert types["a"] == types["y"] == TP.BFLOAT16 and {types[t] for n in trig for t in (*n.input, *n.output)} == {TP.FLOAT}
    assert b.graph.initializer[0].data_type == TP.BFLOAT16
    res = compile_model(b, None, "sm_90")
    rep = check_models(b, res.model, emulate=True)
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_zoo_tiny_bf16_in_emulation(name, tmp_path, monkeypatch):
    """Real exports in bf16 (Llama's rotary Cos/Sin and ViT's patch Conv stay fp32 at opset 17)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("ORTFUSE_CACHE_DIR", str(tmp_path))
    from ortfuse.bench import zoo
    path = zoo.build(name, dtype="bf16", tiny=True)
    res = compile_model(path, None, "sm_90")
    assert "attention" in [r.kind for r in res.plan.regions]
    rep = check_models(path, res.model, emulate=True)
    assert rep.ok, "\n".join(rep.lines())
    assert len(rep.kernels) == len(res.kernels)


def _chain(factors, dtype=TP.BFLOAT16) -> onnx.ModelProto:
    """y = x * f0 * f1 * ... in `dtype`, one Mul a factor (each product rounded to bf16 by ORT)."""
    nodes, inits, t = [], [], "x"
    for i, f in enumerate(factors):
        inits.append(onnx.numpy_helper.from_array(np.array(f, np.float32).astype(BF), f"f{i}"))
        nodes.append(node("Mul", [t, f"f{i}"], [f"m{i}"]))
        t = f"m{i}"
    nodes.append(node("Identity", [t], ["y"]))
    return model(nodes, [vi("x", TP.BFLOAT16, [64, 64])], [vi("y", TP.BFLOAT16, None)], inits)


def test_bf16_outputs_are_judged_against_the_model_in_fp32():
    """Rounded op by op, 40 Muls drift from the exact product by several bf16 steps; one Mul by the product
    (as a kernel computes it, rounding once) is further than 1e-2 from ORT's op-by-op result but nearer the
    fp32 computation than ORT is: it passes, and says why. A product 8% off (ORT drifts 1.9% here) fails."""
    factors = [float(f) for f in 1.0 + np.random.default_rng(2).uniform(-0.3, 0.3, 40)]
    src = _chain(factors)
    exact = float(np.prod([np.float32(np.array(f, np.float32).astype(BF)) for f in factors]))
    for scale, ok in ((1.0, True), (1.08, False)):
        rep = check_models(src, _chain([exact * scale]), input_shapes={"x": [64, 64]})
        assert rep.ok == ok, "\n".join(rep.lines())
        assert "vs the model in fp32" in rep.model[0].name


def _rounded(sh, tensor: str) -> bool:
    """Whether the shadow rounds `tensor` to bf16 after the op that computes it."""
    return any(n.op_type == "Cast" and n.output[0] == f"{tensor}__bf16" for n in sh.model.graph.node)


def test_shadow_rounds_every_op_that_computes_values():
    """A Scatter that adds and a Dropout told it trains (which scales) compute; plain ones only move values."""
    i = onnx.numpy_helper.from_array(np.array([[0, 1]], np.int64), "i")
    t = onnx.numpy_helper.from_array(np.array(True), "t")
    m = model([node("ScatterElements", ["x", "i", "u"], ["sa"], axis=1, reduction="add"),
               node("ScatterElements", ["x", "i", "u"], ["sn"], axis=1),
               node("ScatterElements", ["x", "i", "u"], ["sm"], axis=1, reduction="max"),
               node("Dropout", ["x", "", "t"], ["dt"]), node("Dropout", ["x"], ["dn"])],
              [vi("x", TP.BFLOAT16, [2, 4]), vi("u", TP.BFLOAT16, [1, 2])],
              [vi(o, TP.BFLOAT16, [2, 4]) for o in ("sa", "sn", "sm", "dt", "dn")], [i, t])
    sh = shadow(m, _dtypes(m))
    assert {o: _rounded(sh, o) for o in ("sa", "sn", "sm", "dt", "dn")} == \
        {"sa": True, "sn": False, "sm": False, "dt": True, "dn": False}


def test_shadow_retypes_only_element_type_attributes():
    """EyeLike's dtype is a type; another domain's `to` is that op's business; a BitCast of bf16 bits has no
    fp32 shadow and is refused by name."""
    g = onnx.helper.make_graph([node("EyeLike", ["x"], ["e"], dtype=TP.BFLOAT16), node("Add", ["e", "x"], ["y"]),
                                onnx.helper.make_node("Pack", ["y"], ["z"], domain="com.example", to=TP.BFLOAT16)],
                               "g", [vi("x", TP.BFLOAT16, [4, 4])], [vi("z", TP.BFLOAT16, [4, 4])])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18),
                                                 onnx.helper.make_opsetid("com.example", 1)])
    sh = shadow(m, {"e": TP.BFLOAT16, "y": TP.BFLOAT16, "z": TP.BFLOAT16})
    eye, pack = (next(n for n in sh.model.graph.node if n.op_type == op) for op in ("EyeLike", "Pack"))
    assert eye.attribute[0].i == TP.FLOAT and pack.attribute[0].i == TP.BFLOAT16
    bits = onnx.helper.make_model(onnx.helper.make_graph(
        [node("BitCast", ["x"], ["b"], to=TP.INT16)], "g", [vi("x", TP.BFLOAT16, [4])], [vi("b", TP.INT16, [4])]))
    with pytest.raises(InputError, match="node 'BitCast_b' .BitCast. reinterprets bits"):
        shadow(bits, {"b": TP.INT16})


def test_bf16_on_the_gpu_with_subgraphs_keeps_orts_verdict():
    """Where the model's fp32 computation cannot be built (If/Loop/Scan bodies), a failing bf16 output is not
    judged again, and the report says why; it never raises the CPU path's advice to use the GPU."""
    from ortfuse.check import Diff, _judged_against_fp32
    then = onnx.helper.make_graph([node("Identity", ["x"], ["t"])], "then", [], [vi("t", TP.BFLOAT16, [4])])
    other = onnx.helper.make_graph([node("Neg", ["x"], ["e"])], "else", [], [vi("e", TP.BFLOAT16, [4])])
    m = model([node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
              [vi("x", TP.BFLOAT16, [4]), vi("c", TP.BOOL, [])], [vi("y", TP.BFLOAT16, [4])])
    bad = Diff("y", 0.5, 0.05, 1e-2)
    y = np.ones(4, np.float32).astype(BF)
    (d,) = _judged_against_fp32((bad,), m, {}, ["y"], {"y": y}, [y], {}, {"y"})
    assert not d.ok and "not judged against fp32" in d.name and "--provider cuda" not in d.name

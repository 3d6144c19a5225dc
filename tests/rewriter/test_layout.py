"""rewriter.layout: residual streams kept in their blocks' layout. Each rewrite is checked against ORT CPU on
the original model (random inputs): the values must not change, since the same ops run on the same values."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from helpers import convnext_stage, vi
from ortfuse.rewriter.layout import chain_heads, sink_transposes
from ortfuse.rewriter.shapes import build_graph

F = onnx.TensorProto.FLOAT


def _run(m: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    m = onnx.ModelProto.FromString(m.SerializeToString())
    m.ir_version = min(m.ir_version, 10)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _x(c: int = 16, hw: int = 7, n: int = 2) -> np.ndarray:
    return np.random.default_rng(3).standard_normal((n, c, hw, hw)).astype(np.float32)


@pytest.mark.parametrize("tail,depth,sunk", [("out", 3, 3), ("ln", 3, 3), ("mean", 3, 3), ("ln", 1, 1),
                                             ("mean", 2, 0), ("mean", 1, 0), ("out", 1, 0)])
def test_stage_streams_sink_only_where_copies_are_saved(tail, depth, sunk):
    # gains: each later block's depthwise Conv (computed channels-last) and a Transpose undoing the chain's (the
    # next stage's LayerNorm); costs: each stream a reader needs as it was (the output, the global pool)
    m = convnext_stage(F, depth=depth, tail=tail)
    before = m.SerializeToString()
    g = build_graph(m, {})
    new, n = sink_transposes(g)
    assert n == sunk
    assert m.SerializeToString() == before and g.model.graph.node == build_graph(m, {}).model.graph.node
    if not n:
        assert new is g
        return
    adds = [x for x in new.nodes if x.op_type == "Add" and x.name.endswith("/sunk")]
    assert len(adds) == depth
    for a in adds:  # neither operand of a chain op is a Transpose's output any more, but the first's stream
        producers = [new.nodes[new.producer[t]].op_type for t in a.input if t in new.producer]
        assert producers.count("Transpose") <= (1 if a is adds[0] else 0), (a.name, producers)
    x = _x()
    for want, got in zip(_run(m, x), _run(new.model, x)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_next_stages_layernorm_reads_the_sunk_stream_without_transposes():
    g = build_graph(convnext_stage(F, depth=2, tail="ln"), {})
    new, n = sink_transposes(g)
    assert n == 2
    ln = next(x for x in new.nodes if x.op_type == "LayerNormalization" and x.output[0] == "nln")
    assert ln.input[0].endswith("__ortfuse_sunk")
    # left: each block's Conv output to channels-last (2), the first block's stream read channels-last, the
    # second block's Conv reading the stream back as NCHW (a view its kernel takes), the stage output's; gone:
    # both blocks' Transposes back and the next LayerNorm's Transpose in
    kept = sorted(x.input[0] for x in new.nodes if x.op_type == "Transpose")
    assert kept == sorted(["b0_dw", "b1_dw", "x", "b0_s__ortfuse_sunk", "nln"]), kept


def test_an_interior_stream_read_elsewhere_keeps_its_chain():
    m = convnext_stage(F, depth=3, tail="ln")
    m.graph.output.append(vi("b0_s", F, None))  # the first block's stream is also an output
    new, n = sink_transposes(build_graph(m, {}))
    assert n == 0


def test_chains_are_taken_by_head():
    g = build_graph(convnext_stage(F, depth=3, tail="ln"), {})
    heads = chain_heads(g)
    assert heads == ["b0_s"]
    assert sink_transposes(g, lambda h: False)[1] == 0
    assert sink_transposes(g, lambda h: h == "b0_s")[1] == 3


@pytest.mark.parametrize("seed", range(12))
def test_random_chains_keep_their_values(seed):
    # chains of Add/Sub/Mul/Div with the transposed operand on either side, 3-D permutations, readers that
    # undo the chain's Transpose (gains) or need a stream as it was (a Relu, a graph output): whatever is
    # rewritten computes what ORT computes on the original
    rng = np.random.default_rng(seed)
    perm = [(0, 2, 1), (1, 2, 0), (2, 0, 1), (1, 0, 2)][seed % 4]
    inv = [perm.index(a) for a in range(3)]
    shape = (2, 3, 4)
    tshape = [shape[p] for p in inv]  # Transpose(a, perm) has `shape`
    depth = int(rng.integers(1, 5))
    nodes, inputs, outputs, s = [], [vi("x", F, list(shape))], [], "x"
    for k in range(depth):
        inputs.append(vi(f"a{k}", F, tshape))
        nodes.append(onnx.helper.make_node("Transpose", [f"a{k}"], [f"t{k}"], perm=list(perm), name=f"T{k}"))
        op = ["Add", "Sub", "Mul", "Div"][int(rng.integers(0, 4))]
        ins = [s, f"t{k}"] if rng.random() < 0.5 else [f"t{k}", s]
        nodes.append(onnx.helper.make_node(op, ins, [f"y{k}"], name=f"op{k}"))
        s = f"y{k}"
        for r in range(int(rng.integers(0 if k < depth - 1 else 1, 3))):
            if rng.random() < 0.8:
                nodes.append(onnx.helper.make_node("Transpose", [s], [f"u{k}_{r}"], perm=inv, name=f"U{k}_{r}"))
                nodes.append(onnx.helper.make_node("Relu", [f"u{k}_{r}"], [f"o{k}_{r}"], name=f"R{k}_{r}"))
            else:
                nodes.append(onnx.helper.make_node("Relu", [s], [f"o{k}_{r}"], name=f"R{k}_{r}"))
            outputs.append(vi(f"o{k}_{r}", F, None))
    outputs.append(vi(s, F, None))
    m = onnx.helper.make_model(onnx.helper.make_graph(nodes, "t", inputs, outputs),
                               opset_imports=[onnx.helper.make_opsetid("", 18)])
    m.ir_version = 9
    g = build_graph(m, {})
    new, n = sink_transposes(g)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32) + 3}
    feeds |= {f"a{k}": rng.standard_normal(tshape).astype(np.float32) + 2 for k in range(depth)}

    def run(model):
        model = onnx.ModelProto.FromString(model.SerializeToString())
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    want, got = run(m), run(new.model)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} (seed {seed}, {n} ops sunk)")
    assert [o.name for o in new.model.graph.output] == [o.name for o in m.graph.output]


def test_an_undoing_transpose_that_is_a_graph_output_saves_no_copy():
    # it keeps its name, so it still reads the stream as it was: no gain, and the chain is left alone
    nodes = [onnx.helper.make_node("Transpose", ["a0"], ["t0"], perm=[0, 2, 1]),
             onnx.helper.make_node("Sub", ["x", "t0"], ["y0"]),
             onnx.helper.make_node("Transpose", ["a1"], ["t1"], perm=[0, 2, 1]),
             onnx.helper.make_node("Div", ["y0", "t1"], ["y1"]),
             onnx.helper.make_node("Transpose", ["y0"], ["u0"], perm=[0, 2, 1]),
             onnx.helper.make_node("Transpose", ["y1"], ["u1"], perm=[0, 2, 1])]
    m = onnx.helper.make_model(onnx.helper.make_graph(
        nodes, "t", [vi("x", F, [2, 3, 4]), vi("a0", F, [2, 4, 3]), vi("a1", F, [2, 4, 3])],
        [vi("u0", F, None), vi("u1", F, None)]), opset_imports=[onnx.helper.make_opsetid("", 18)])
    m.ir_version = 9
    assert sink_transposes(build_graph(m, {}))[1] == 0

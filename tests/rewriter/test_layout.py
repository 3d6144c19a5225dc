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

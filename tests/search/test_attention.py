"""Attention matcher (search/attention.py): hand-built graphs for each variant and each refusal, then every
layer of the tiny BERT, GPT-2 and ViT exports (fp32 and fp16)."""
from __future__ import annotations

import numpy as np
import pytest
import onnx
from onnx import TensorProto as TP

from helpers import const, model, node, packed_attention, vi

from ortfuse.rewriter.canonical import fold_runtime_shapes
from ortfuse.rewriter.graph import Graph
from ortfuse.rewriter.load import load_model
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search.attention import AttentionPattern, find_attention

F = TP.FLOAT
B, S, H, D = "batch", "seq", 4, 16


def _graph(nodes, inputs, outputs, inits=()) -> Graph:
    g, _ = fold_runtime_shapes(build_graph(model(nodes, inputs, outputs, inits), {}))
    return g


def _bert_like(scale_on_q: bool = False, extra_outputs=(), softmax_axis: int = -1, head: int = D) -> Graph:
    """BERT's self-attention as the TorchScript exporter writes it: projections [B, S, H*D] reshaped and
    transposed per head, Kᵀ as Transpose(0,2,3,1), scores scaled, plus a [B,1,1,S] padding mask."""
    hd = H * head
    nodes = [
        node("Reshape", ["xq", "shp4"], ["q4"]), node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
        node("Reshape", ["xk", "shp4"], ["k4"]), node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        node("Reshape", ["xv", "shp4"], ["v4"]), node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
    ]
    if scale_on_q:
        nodes += [node("Mul", ["qh", "scale"], ["qs"]), node("MatMul", ["qs", "kt"], ["s0"]),
                  node("Identity", ["s0"], ["s1"])]
    else:
        nodes += [node("MatMul", ["qh", "kt"], ["s0"]), node("Div", ["s0", "scale"], ["s1"])]
    nodes += [
        node("Add", ["s1", "mask"], ["s2"]), node("Softmax", ["s2"], ["p"], axis=softmax_axis),
        node("MatMul", ["p", "vh"], ["o"]), node("Transpose", ["o"], ["o4"], perm=[0, 2, 1, 3]),
        node("Reshape", ["o4", "shp3"], ["y"]),
    ]
    inputs = [vi(x, F, [B, S, hd]) for x in ("xq", "xk", "xv")] + [vi("mask", F, [B, 1, 1, S])]
    outputs = [vi("y", F, None)] + [vi(t, F, None) for t in extra_outputs]
    inits = [const("shp4", [0, 0, H, head], np.int64), const("shp3", [0, 0, hd], np.int64),
             const("scale", np.sqrt(head))]
    return _graph(nodes, inputs, outputs, inits)


def _core(score_nodes, last: str, inputs=(), inits=(), k_shape=(2, H, D, 37)) -> Graph:
    """q [2,H,37,D] · kt → score_nodes (ending in tensor `last`) → Softmax → · v [2,H,37,D]."""
    nodes = [node("MatMul", ["q", "kt"], ["s0"]), *score_nodes, node("Softmax", [last], ["p"], axis=-1),
             node("MatMul", ["p", "v"], ["y"])]
    ins = [vi("q", F, [2, H, 37, D]), vi("kt", F, list(k_shape)), vi("v", F, [2, H, 37, D]), *inputs]
    return _graph(nodes, ins, [vi("y", F, None)], inits)


def _one(g: Graph) -> AttentionPattern:
    found, rejects = find_attention(g)
    assert not rejects, [str(r) for r in rejects]
    assert len(found) == 1
    return found[0]


def _reason(g: Graph) -> str:
    found, rejects = find_attention(g)
    assert not found and len(rejects) == 1
    assert rejects[0].subject.startswith("Softmax")
    return rejects[0].reason


def _ops(g: Graph, idx) -> list[str]:
    return [g.nodes[i].op_type for i in idx]


def test_bert_layout_matches_with_paths_and_mask():
    g = _bert_like()
    p = _one(g)
    assert (p.q, p.k, p.v, p.output) == ("xq", "xk", "xv", "y")
    assert _ops(g, p.q_path) == _ops(g, p.k_path) == _ops(g, p.v_path) == ["Reshape", "Transpose"]
    assert _ops(g, p.score_ops) == ["Div", "Add"] and p.prob_ops == ()
    assert _ops(g, p.out_path) == ["Transpose", "Reshape"]
    assert p.extra_inputs == ("mask",)
    assert p.nodes == tuple(range(len(g.nodes)))  # the whole graph is the pattern
    assert _ops(g, [p.qk, p.softmax, p.pv]) == ["MatMul", "Softmax", "MatMul"]


def test_scale_applied_to_q_joins_the_q_path():
    g = _bert_like(scale_on_q=True)
    p = _one(g)
    assert _ops(g, p.q_path) == ["Reshape", "Transpose", "Mul"]
    assert _ops(g, p.score_ops) == ["Identity", "Add"]
    assert p.q == "xq"


def test_transpose_of_transpose_on_k():
    nodes = [node("Transpose", ["kb"], ["kh"], perm=[0, 2, 1, 3]), node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]),
             node("MatMul", ["q", "kt"], ["s0"]), node("Mul", ["s0", "c"], ["s1"]), node("Softmax", ["s1"], ["p"]),
             node("MatMul", ["p", "v"], ["y"])]
    g = _graph(nodes, [vi("q", F, [2, H, 37, D]), vi("kb", F, [2, 37, H, D]), vi("v", F, [2, H, 37, D])],
               [vi("y", F, None)], [const("c", 0.25)])
    p = _one(g)
    assert p.k == "kb" and _ops(g, p.k_path) == ["Transpose", "Transpose"]
    assert p.q_path == p.v_path == p.out_path == () and p.extra_inputs == ()


def test_causal_where_mask():
    g = _core([node("Mul", ["s0", "c"], ["s1"]), node("Where", ["keep", "s1", "ninf"], ["s2"])], "s2",
              [vi("keep", TP.BOOL, [1, 1, 37, 37])], [const("c", 0.25), const("ninf", -np.inf)])
    p = _one(g)
    assert _ops(g, p.score_ops) == ["Mul", "Where"] and p.extra_inputs == ("keep",)


def test_non_scalar_constant_mask_is_an_extra_input():
    g = _core([node("Add", ["bias", "s0"], ["s1"])], "s1", inits=[const("bias", np.zeros((1, 1, 37, 37)))])
    assert _one(g).extra_inputs == ("bias",)


def test_probability_casts_join_the_pattern():
    nodes = [node("MatMul", ["q", "kt"], ["s0"]), node("Softmax", ["s0"], ["p"]), node("Cast", ["p"], ["pc"], to=F),
             node("Cast", ["pc"], ["pc2"], to=F), node("MatMul", ["pc2", "v"], ["y"])]
    g = _graph(nodes, [vi("q", F, [2, H, 37, D]), vi("kt", F, [2, H, D, 37]), vi("v", F, [2, H, 37, D])],
               [vi("y", F, None)])
    assert _ops(g, _one(g).prob_ops) == ["Cast", "Cast"]


def _guarded(fill: float = 0.0, flag_out: bool = False) -> Graph:
    """Softmax → Where(IsNaN(p), fill, p) → MatMul, as torch's scaled_dot_product_attention exports."""
    nodes = [node("MatMul", ["q", "kt"], ["s0"]), node("Softmax", ["s0"], ["p"]), node("IsNaN", ["p"], ["nan"]),
             node("Where", ["nan", "fill", "p"], ["pz"]), node("MatMul", ["pz", "v"], ["y"])]
    g = _graph(nodes, [vi("q", F, [2, H, 37, D]), vi("kt", F, [2, H, D, 37]), vi("v", F, [2, H, 37, D])],
               [vi("y", F, None)] + ([vi("nan", TP.BOOL, None)] if flag_out else []), [const("fill", fill)])
    return g


def test_nan_guard_of_scaled_dot_product_attention_joins_the_pattern():
    g = _guarded()
    assert _ops(g, _one(g).prob_ops) == ["IsNaN", "Where"]


@pytest.mark.parametrize("fill,flag_out", [(1.0, False), (0.0, True)], ids=["fills-one", "flag-read-outside"])
def test_other_nan_selects_stay_outside(fill, flag_out):
    assert _reason(_guarded(fill, flag_out)) == "probabilities used outside the attention"


def test_path_stops_where_a_tensor_is_shared():
    # the transposed K is also a graph output: it becomes the kernel input, the path stays empty
    p = _one(_bert_like(extra_outputs=("kt",)))
    assert p.k == "kt" and p.k_path == ()
    # the per-head V is used twice (by the pattern and as an output): V's path stops below it
    p = _one(_bert_like(extra_outputs=("v4",)))
    assert p.v == "v4" and len(p.v_path) == 1
    # the attention output after the Transpose is used elsewhere: out_path ends there
    p = _one(_bert_like(extra_outputs=("o4",)))
    assert p.output == "o4" and len(p.out_path) == 1


def test_bert_layout_with_head_size_128_matches_and_129_does_not():
    assert _one(_bert_like(head=128)).q == "xq"
    assert "head size 129 exceeds" in _reason(_bert_like(head=129))


# ---- refusals -------------------------------------------------------------------------------------------

def test_softmax_not_over_last_axis():
    assert "Softmax over axis 1" in _reason(_bert_like(softmax_axis=1))


def test_probabilities_used_outside():
    assert _reason(_bert_like(extra_outputs=("p",))) == "probabilities used outside the attention"


def test_scores_used_outside():
    assert "'s1' used outside the attention" in _reason(_bert_like(extra_outputs=("s1",)))


def test_softmax_of_a_graph_input_or_a_gemm():
    g = _graph([node("Softmax", ["x"], ["y"])], [vi("x", F, [4, 8])], [vi("y", F, None)])
    assert "not computed by a MatMul" in _reason(g)
    g = _graph([node("Gemm", ["x", "w"], ["s"]), node("Softmax", ["s"], ["p"]), node("MatMul", ["p", "e"], ["y"])],
               [vi("x", F, [4, 8]), vi("w", F, [8, 5]), vi("e", F, [5, 3])], [vi("y", F, None)])
    assert "not from a MatMul through element-wise ops" in _reason(g)


def test_non_elementwise_op_in_the_score_chain():
    g = _core([node("Transpose", ["s0"], ["s1"], perm=[0, 1, 3, 2])], "s1")
    assert "Transpose" in _reason(g) and "element-wise" in _reason(g)


def test_batch_regroup_in_the_score_chain_joins_the_pattern():
    # [2, H, 37, 37] scores viewed as [2*H, 37, 37] around a bias and back: only the leading dims regroup
    g = _core([node("Reshape", ["s0", "m3"], ["s1"]), node("Add", ["s1", "bias"], ["s2"]),
               node("Reshape", ["s2", "m4"], ["s3"])], "s3", [vi("bias", F, [2 * H, 1, 37])],
              [const("m3", [2 * H, 37, 37], np.int64), const("m4", [2, H, 37, 37], np.int64)])
    p = _one(g)
    assert _ops(g, p.score_ops) == ["Reshape", "Add", "Reshape"] and p.extra_inputs == ("bias",)


def test_reshape_of_the_query_or_key_axis_in_the_score_chain():
    g = _core([node("Reshape", ["s0", "m3"], ["s1"]), node("Reshape", ["s1", "m4"], ["s2"])], "s2", (),
              [const("m3", [2, H * 37, 37], np.int64), const("m4", [2, H, 37, 37], np.int64)])
    assert "Reshape" in _reason(g) and "element-wise" in _reason(g)


def test_probabilities_regrouped_otherwise_than_the_scores():
    # the probabilities reach the MatMul with V merged ([2*H, 37, 37]) while the scores are [2, H, 37, 37]
    nodes = [node("MatMul", ["q", "kt"], ["s0"]), node("Softmax", ["s0"], ["p"], axis=-1),
             node("Reshape", ["p", "m3"], ["p3"]), node("MatMul", ["p3", "v"], ["y"])]
    g = _graph(nodes, [vi("q", F, [2, H, 37, D]), vi("kt", F, [2, H, D, 37]), vi("v", F, [2 * H, 37, D])],
               [vi("y", F, None)], [const("m3", [2 * H, 37, 37], np.int64)])
    assert "the probabilities reach" in _reason(g)


def test_scores_combining_two_matmuls():
    g = _core([node("MatMul", ["q", "r"], ["s1"]), node("Add", ["s0", "s1"], ["s2"])], "s2",
              [vi("r", F, [2, H, D, 37])])
    assert "combines two MatMul results" in _reason(g)


def test_score_op_with_two_outside_tensors():
    g = _core([node("Where", ["keep", "s0", "fill"], ["s1"])], "s1",
              [vi("keep", TP.BOOL, [1, 1, 37, 37]), vi("fill", F, [1, 1, 37, 37])])
    assert "2 non-constant tensors besides the scores" in _reason(g)


def test_mask_that_broadcasts_the_scores():
    g = _core([node("Add", ["s0", "m"], ["s1"])], "s1", [vi("m", F, [2, H, 37, 37])], k_shape=(2, 1, D, 37))
    assert _one(g).k == "kt"  # K shared by the heads: the scores are already [2, H, 37, 37]
    nodes = [node("MatMul", ["q", "kt"], ["s0"]), node("Add", ["s0", "m"], ["s1"]), node("Softmax", ["s1"], ["p"]),
             node("MatMul", ["p", "v"], ["y"])]
    g = _graph(nodes, [vi("q", F, [2, 1, 37, D]), vi("kt", F, [2, 1, D, 37]), vi("v", F, [2, 1, 37, D]),
                       vi("m", F, [2, H, 37, 37])], [vi("y", F, None)])
    assert "broadcasts the scores" in _reason(g)


def test_probabilities_not_multiplied_by_v():
    g = _graph([node("MatMul", ["q", "kt"], ["s0"]), node("Softmax", ["s0"], ["p"]), node("Relu", ["p"], ["y"])],
               [vi("q", F, [2, H, 37, D]), vi("kt", F, [2, H, D, 37])], [vi("y", F, None)])
    assert "probabilities feed Relu" in _reason(g)
    g = _graph([node("MatMul", ["q", "kt"], ["s0"]), node("Softmax", ["s0"], ["p"]), node("MatMul", ["w", "p"], ["y"])],
               [vi("q", F, [2, H, 37, D]), vi("kt", F, [2, H, D, 37]), vi("w", F, [2, H, 5, 37])], [vi("y", F, None)])
    assert "not the left operand" in _reason(g)


def test_symbolic_head_size():
    nodes = [node("MatMul", ["q", "kt"], ["s0"]), node("Softmax", ["s0"], ["p"]), node("MatMul", ["p", "v"], ["y"])]
    g = _graph(nodes, [vi("q", F, [2, H, 37, "d"]), vi("kt", F, [2, H, "d", 37]), vi("v", F, [2, H, 37, D])],
               [vi("y", F, None)])
    assert "head size 'd' is not static" in _reason(g)


def test_double_scores():
    Dt = TP.DOUBLE
    g = _graph([node("MatMul", ["q", "kt"], ["s0"]), node("Softmax", ["s0"], ["p"]), node("MatMul", ["p", "v"], ["y"])],
               [vi("q", Dt, [2, 37, D]), vi("kt", Dt, [2, D, 37]), vi("v", Dt, [2, 37, D])], [vi("y", Dt, None)])
    assert "scores of type DOUBLE" in _reason(g)


@pytest.mark.parametrize("select", ["split", "slice"])
def test_packed_projection_is_read_through_its_split_or_slices(select):
    g, _ = fold_runtime_shapes(build_graph(packed_attention(F, H, D, select), {}))
    p = _one(g)
    assert p.q == p.k == p.v == "x"
    first = ["Split"] if select == "split" else ["Slice"]
    assert _ops(g, p.q_path) == _ops(g, p.v_path) == first + ["Reshape", "Transpose"]
    assert _ops(g, p.k_path) == first + ["Reshape", "Transpose"]
    assert p.nodes == tuple(range(len(g.nodes)))  # the shared Split appears once


def test_split_with_an_output_leaving_the_pattern_stays_outside():
    g, _ = fold_runtime_shapes(build_graph(packed_attention(F, H, D, "split", kv_out=True), {}))
    p = _one(g)
    assert (p.q, p.k, p.v) == ("xq", "xk", "xv")
    assert "Split" not in _ops(g, p.nodes)


def test_slice_with_a_step_stays_outside():
    m = packed_attention(F, H, D, "slice")
    m.graph.node[1].input.append("two")  # the K slice: steps [2]
    m.graph.initializer.append(const("two", [2], np.int64))
    m.graph.node[1].input[2] = "e_far"
    m.graph.initializer.append(const("e_far", [3 * H * D], np.int64))
    g, _ = fold_runtime_shapes(build_graph(m, {}))
    p = _one(g)
    assert p.q == p.v == "x" and p.k == "xk"


# ---- real exports -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORTFUSE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        from ortfuse.bench import zoo as z
        yield z


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_every_layer_of_exported_models(zoo, name: str, dtype: str):
    module, info = zoo.torch_module(name, tiny=True)
    layers = module.config.num_hidden_layers
    g, _ = fold_runtime_shapes(build_graph(load_model(zoo.build(name, dtype=dtype, tiny=True)), {}))
    found, rejects = find_attention(g)
    assert not rejects, [str(r) for r in rejects]
    assert len(found) == layers
    seen: set[int] = set()
    for p in found:
        assert not seen & set(p.nodes)
        seen |= set(p.nodes)
        hd = info.hidden_size
        # projections in, [B, S, H*D] out: all layout folded; GPT-2's packed c_attn [B*S, 3*H*D] is read
        # through the Reshape to [B, S, 3*H*D] (its target computed at run time) and its Split (one tensor for
        # Q, K and V)
        packed = name == "gpt2"
        assert g.info(p.output).shape[-1] == hd and g.info(p.output).rank == 3
        for t in (p.q, p.k, p.v):
            assert g.info(t).shape[-1] == (3 * hd if packed else hd) and g.info(t).rank == (2 if packed else 3)
        assert (p.q == p.k == p.v) == packed
        assert _ops(g, p.k_path) == (["Reshape", "Split", "Reshape", "Transpose"] if packed else ["Reshape", "Transpose"])
        assert g.nodes[p.k_path[-1]].attribute[0].ints == [0, 2, 3, 1]
        assert _ops(g, p.out_path) == ["Transpose", "Reshape"]
        assert _ops(g, p.score_ops) == (["Mul"] if name == "vit" else ["Mul", "Add"])
        assert _ops(g, p.prob_ops) == {"bert": [], "gpt2": ["Cast"], "vit": ["Cast", "Cast"]}[name]
        assert len(p.extra_inputs) == (0 if name == "vit" else 1)


@pytest.mark.parametrize("also_out", [False, True])
def test_operand_paths_through_slices_of_one_tensor_continue_back_together(also_out):
    # Q, K and V as three Slices of one tensor that a layout op makes (an ONNX Split as rewriter.contrib writes it,
    # after GPTBigCode's Unsqueeze): the paths go on through the layout op together, to the projection itself,
    # unless that tensor is read elsewhere too (here: a graph output)
    m = packed_attention(TP.FLOAT, 2, 8, select="slice")
    m.graph.input[0].name = "x0"
    m.graph.node.insert(0, node("Reshape", ["x0", "flat"], ["x"]))
    m.graph.initializer.append(const("flat", [0, 0, 48], np.int64))
    if also_out:
        m.graph.output.append(vi("x", TP.FLOAT, ["batch", "seq", 48]))
    (pat,), _ = find_attention(build_graph(m, {}))
    assert pat.q == pat.k == pat.v == ("x" if also_out else "x0")


@pytest.mark.parametrize("dt", [TP.FLOAT, TP.FLOAT16], ids=["fp32", "fp16"])
def test_a_split_packed_projection_behind_a_layout_op_is_one_attention_kernel(dt):
    # GPTBigCode's c_attn: Unsqueeze, then a Split (one Slice per operand after rewriter.contrib): the attention
    # kernel reads the projection itself; checked against ORT in emulation
    from helpers import fused_parity

    m = packed_attention(dt, 2, 8)
    m.graph.input[0].name = "x0"
    m.graph.input[0].type.tensor_type.shape.dim.insert(1, onnx.TensorShapeProto.Dimension(dim_value=1))
    m.graph.node.insert(0, node("Squeeze", ["x0", "one"], ["x"]))
    m.graph.initializer.append(const("one", [1], np.int64))
    res = fused_parity(m, {}, {"x0": (2, 1, 5, 48), "mask": (2, 1, 1, 5)}, ["attention"])
    assert [n.domain for n in res.model.graph.node] == ["ortfuse"]  # the Squeeze too


def test_joined_operand_paths_stop_where_a_symbolic_dim_is_merged_away():
    # LeViT: the packed projection's rows are batch x tokens merged; the Reshape that splits them makes the tensor
    # the Slices read. A kernel reading the merged rows could not compute `batch`: the paths stop at the Reshape
    m = packed_attention(TP.FLOAT, 2, 8, select="slice")
    m.graph.input[0].name = "x0"
    dims = m.graph.input[0].type.tensor_type.shape.dim
    del dims[:]
    for d in ("rows", 48):
        dims.add(**({"dim_param": d} if isinstance(d, str) else {"dim_value": d}))
    m.graph.node.insert(0, node("Reshape", ["x0", "split_rows"], ["x"]))
    m.graph.initializer.append(const("split_rows", [-1, 5, 48], np.int64))
    (pat,), _ = find_attention(build_graph(m, {}))
    assert pat.q == pat.k == pat.v == "x"


def _causal_iota_attention(layers: int, shared: bool) -> Graph:
    """`layers` attentions over q, k, v [B, H, S, D], each adding Where(Range(S) <= Unsqueeze(Range(S)), 0,
    -inf) to its scores: its own iotas, or (`shared`) the first layer's for all."""
    nodes, inits = [], [const("zero", np.array(0, np.int64), np.int64), const("one", np.array(1, np.int64), np.int64),
                        const("ax1", [1], np.int64), const("f0", np.array(0.0, np.float32), np.float32),
                        const("ninf", np.array(-np.inf, np.float32), np.float32)]
    x = "q"
    for k in range(layers):
        p = "" if shared else f"l{k}_"
        if not shared or k == 0:
            nodes += [node("Shape", ["q"], [p + "sz"], start=2, end=3), node("Squeeze", [p + "sz"], [p + "n"]),
                      node("Range", ["zero", p + "n", "one"], [p + "i"]),
                      node("Unsqueeze", [p + "i", "ax1"], [p + "iu"]),
                      node("Range", ["zero", p + "n", "one"], [p + "j"]),
                      node("LessOrEqual", [p + "j", p + "iu"], [p + "seen"]),
                      node("Where", [p + "seen", "f0", "ninf"], [p + "bias"])]
        nodes += [node("Transpose", ["k"], [f"kt{k}"], perm=[0, 1, 3, 2]),
                  node("MatMul", [x, f"kt{k}"], [f"s{k}"]), node("Add", [f"s{k}", p + "bias"], [f"b{k}"]),
                  node("Softmax", [f"b{k}"], [f"p{k}"], axis=-1), node("MatMul", [f"p{k}", "v"], [f"y{k}"])]
        x = f"y{k}"
    ins = [vi(t, F, [B, H, S, D]) for t in "qkv"]
    return _graph(nodes, ins, [vi(x, F, [B, H, S, D])], inits)


@pytest.mark.parametrize("layers,shared", [(1, False), (2, False), (2, True)])
def test_a_causal_rule_over_iotas_is_computed_in_the_kernel_unless_shared(layers, shared):
    # a score input made of Range iotas and constants alone, read by nothing else, joins the pattern (the kernel
    # computes it from the element's coordinates); one read by two patterns stays a tensor each reads
    g = _causal_iota_attention(layers, shared)
    pats, rejects = find_attention(g)
    assert len(pats) == layers and not rejects
    for p in pats:
        ops_in = [g.nodes[i].op_type for i in p.nodes]
        assert (ops_in.count("Range") == 2) == (not shared)
        assert p.extra_inputs == (("bias",) if shared else ())


def test_k_rope_outside_is_the_pattern_without_k_rotation():
    # the variant the search weighs (--k-rope): K's path stops at its rotary embedding's output, which the
    # kernel reads as K; Q's rotation stays in; `pattern_of` finds either by its nodes
    from helpers import rope_attention
    from ortfuse.search.attention import k_rope_outside, pattern_of

    g, _ = fold_runtime_shapes(build_graph(rope_attention(TP.FLOAT16), {}))
    (pat,), _ = find_attention(g)
    alt = k_rope_outside(g)[pat.softmax]
    assert pat.k_rope is not None and alt.k_rope is None and alt.q_rope == pat.q_rope
    assert alt.k == pat.k_rope.out == "k" and pat.k == "xk"
    left = {g.nodes[i].name or g.nodes[i].op_type for i in set(pat.nodes) - set(alt.nodes)}
    assert len(left) == 8 and set(alt.nodes) < set(pat.nodes), left  # K's 7 rotation nodes and its Transpose
    assert pattern_of(g, alt.nodes) == alt and pattern_of(g, pat.nodes) == pat
    assert pattern_of(g, pat.nodes[1:]) is None
    # a rotated K that is also returned (a KV cache's present key) is outside the pattern already
    g2, _ = fold_runtime_shapes(build_graph(rope_attention(TP.FLOAT16, k_out=True), {}))
    assert not k_rope_outside(g2)


def test_attentions_joined_by_layout_ops_alone_stay_disjoint():
    # one attention's output read as the next one's Q through Transpose/Reshape alone (no projection between):
    # the second pattern's Q path would take the first one's output layout ops. Patterns are disjoint (a node
    # is computed by one kernel), so the later one is refused with the shared node, and the model optimizes
    # (it failed the plan's disjointness check) and matches ORT
    from helpers import stacked_attention
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    m = stacked_attention(TP.FLOAT16, ["and", "and"], projected=False)
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), ort_attention="off"))
    found, rejects = find_attention(res.graph)  # (the optimizer's graph: its layout ops folded)
    assert len(found) == 1 and any("shares" in r.reason and "with the attention at" in r.reason for r in rejects)
    assert [r.kind for r in res.plan.regions].count("attention") == 1
    shapes = {x: [2, 37, 128] for x in ("q", "k", "v", "l1_k", "l1_v")}
    shapes.update(attention_mask=[2, 37], l1_attention_mask=[2, 37])
    rep = check_models(m, res.model, emulate=True, input_shapes=shapes)
    assert rep.ok, "\n".join(rep.lines())

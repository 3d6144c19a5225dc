"""Index ops inside kernels: Gather (embedding lookups, any axis, int32/int64, negative indices), Range
iotas (transformers' position ids and masks), Slice (positive steps too) and Concat (rotary embeddings), each
checked in CPU emulation and through the fused node's function body (ORT CPU, functions inlined) against ORT on the
original model. Tolerances: fp32 1e-5, fp16 1e-2 normwise."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

from helpers import const, flattened, fused_parity, launch_spec, model, node, rotary, vi
from ortfuse.api import compile_model
from ortfuse.customops.attrs import read_launch
from ortfuse.customops.lower import dim_factors, lower
from ortfuse.customops.target import parse_arch

F, H = TP.FLOAT, TP.FLOAT16
NP = {F: np.float32, H: np.float16}
I64 = np.int64


def _embeddings(dt: int, index_dtype=TP.INT64) -> onnx.ModelProto:
    """BERT/GPT-2 embeddings: word and token-type lookups, positions from Range(0, seq) (the dim read from
    input_ids' shape), summed and normalized."""
    rng = np.random.default_rng(3)
    tab = lambda *s: rng.standard_normal(s).astype(NP[dt])  # noqa: E731
    ids = "ids" if index_dtype == TP.INT64 else "ids32"
    nodes = ([] if index_dtype == TP.INT64 else [node("Cast", ["ids"], ["ids32"], to=index_dtype)]) + [
        node("Gather", ["words", ids], ["we"]),
        node("Gather", ["types", "tt"], ["te"]),
        node("Shape", ["ids"], ["sh"]), node("Gather", ["sh", "one"], ["seq"]),
        node("Range", ["zero", "seq", "one"], ["pos"]), node("Unsqueeze", ["pos", "ax0"], ["pos2"]),
        node("Gather", ["positions", "pos2"], ["pe"]),
        node("Add", ["we", "te"], ["s1"]), node("Add", ["s1", "pe"], ["s2"]),
        node("LayerNormalization", ["s2", "gamma", "beta"], ["y"], axis=-1)]
    inits = [const("words", tab(1000, 64), NP[dt]), const("types", tab(2, 64), NP[dt]),
             const("positions", tab(40, 64), NP[dt]), const("gamma", tab(64), NP[dt]), const("beta", tab(64), NP[dt]),
             const("one", 1, I64), const("zero", 0, I64), const("ax0", [0], I64)]
    return model(nodes, [vi("ids", TP.INT64, ["batch", "seq"]), vi("tt", TP.INT64, ["batch", "seq"])],
                 [vi("y", dt, None)], inits)


@pytest.mark.parametrize("dt,index_dtype", [(F, TP.INT64), (H, TP.INT64), (H, TP.INT32)])
def test_embeddings_are_one_kernel(dt, index_dtype):
    m = _embeddings(dt, index_dtype)
    shapes = {"ids": ("batch", "seq"), "tt": ("batch", "seq")}
    res = fused_parity(m, shapes, {"ids": (3, 17), "tt": (3, 17)}, ["rowreduce"])
    # the Range's length comes from input_ids' shape inside the function body; nothing else is left
    assert [n.op_type for n in res.model.graph.node] == [res.kernels[0].node.op_type]
    node_ = res.kernels[0].node
    assert [(x, [(node_.inputs[k], axis) for k, axis in parts]) for x, parts in node_.shape_reads] == \
        [("seq", [("ids", 1)])]
    # an embedding table is charged for the rows gathered (at the hints: batch 1, seq 128), at most itself
    item, rows = np.dtype(NP[dt]).itemsize, 128
    want = sum(min(n, rows) * 64 * item for n in (1000, 2, 40)) + 2 * 64 * item + 2 * rows * 8 + rows * 64 * item
    assert res.kernels[0].region.traffic.fused_bytes == want


def test_gather_on_inner_axis_with_negative_indices():
    """Gather along axis 1 of a [R, C] tensor computed in the region, indices negative (k - 4, k random in
    {0, 1}: counted from the end)."""
    m = model([node("Mul", ["x", "two"], ["x2"]), node("Sub", ["k", "four"], ["kn"]),
               node("Gather", ["x2", "kn"], ["g"], axis=1), node("Add", ["g", "b"], ["y"])],
              [vi("x", F, ["r", 4]), vi("k", TP.INT64, [2, 2]), vi("b", F, ["r", 2, 2])], [vi("y", F, None)],
              [const("two", 2.0), const("four", 4, I64)])
    fused_parity(m, {"x": ("r", 4), "k": (2, 2), "b": ("r", 2, 2)}, {"x": (5, 4), "k": (2, 2), "b": (5, 2, 2)},
                 ["pointwise"])


def test_out_of_range_index_gives_zero_like_the_cuda_ep():
    """ORT's CUDA Gather writes 0 for an index outside [-n, n) (its CPU kernel raises): so do we, and the
    load stays in bounds."""
    m = model([node("Gather", ["tab", "ids"], ["g"]), node("Add", ["g", "one"], ["y"])],
              [vi("tab", F, [6, 8]), vi("ids", TP.INT64, ["n"])], [vi("y", F, None)], [const("one", 1.0)])
    res = compile_model(m, {"tab": (6, 8), "ids": ("n",)}, "sm_90")
    spec = lower(res.graph, res.plan.regions[0], parse_arch("sm_90"))
    tab = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    ids = np.array([0, 5, -1, -6, 6, -7, 1000, -(2 ** 40)], I64)
    out = np.full((len(ids), 8), np.nan, np.float32)
    launch_spec(spec, [tab, ids, out], [len(ids)])
    inside = (ids >= -6) & (ids < 6)
    want = np.where(inside[:, None], tab[np.where(inside, ids % 6, 0)], 0.0) + 1.0
    np.testing.assert_array_equal(out, want)


def _causal_mask(dt: int) -> onnx.ModelProto:
    """GPT-2's mask as transformers 5 exports it: key position <= query position (two iotas over the
    sequence dim read from the mask's shape) and the padding mask, as an additive bias."""
    nodes = [node("Shape", ["mask"], ["sh"]), node("Gather", ["sh", "one"], ["s"]),
             node("Range", ["zero", "s", "one"], ["q"]),
             node("Unsqueeze", ["q", "ax1"], ["q2"]),  # [S, 1]
             node("Unsqueeze", ["q", "ax0"], ["k2"]),  # [1, S]
             node("LessOrEqual", ["k2", "q2"], ["causal"]),  # [S, S]
             node("Cast", ["mask"], ["mb"], to=TP.BOOL), node("Unsqueeze", ["mb", "ax1"], ["mb2"]),  # [B, 1, S]
             node("And", ["causal", "mb2"], ["keep"]),  # [B, S, S]
             node("Where", ["keep", "z", "ninf"], ["bias"])]
    return model(nodes, [vi("mask", TP.INT64, ["batch", "seq"])], [vi("bias", dt, None)],
                 [const("one", 1, I64), const("zero", 0, I64), const("ax0", [0], I64), const("ax1", [1], I64),
                  const("z", 0.0, NP[dt]), const("ninf", -10000.0, NP[dt])])


@pytest.mark.parametrize("dt", [F, H])
def test_causal_mask_from_iotas_is_one_kernel(dt):
    m = _causal_mask(dt)
    res = fused_parity(m, {"mask": ("batch", "seq")}, {"mask": (3, 9)}, ["pointwise"])
    assert [n.op_type for n in res.model.graph.node] == [res.kernels[0].node.op_type]


def test_shared_iota_is_copied_for_each_kernel():
    """One Range read by an embedding lookup and by a mask: each kernel computes its own copy."""
    m = _causal_mask(F)
    g = m.graph
    g.node.extend([node("Unsqueeze", ["q", "ax0"], ["q3"]), node("Gather", ["positions", "q3"], ["pe"]),
                   node("Add", ["pe", "x"], ["h"]), node("Softmax", ["h"], ["y"], axis=-1)])
    g.input.append(vi("x", F, ["batch", "seq", 16]))
    g.output.append(vi("y", F, ["batch", "seq", 16]))
    g.initializer.append(const("positions", np.random.default_rng(1).standard_normal((32, 16))))
    res = fused_parity(m, {"mask": ("batch", "seq"), "x": ("batch", "seq", 16)},
                       {"mask": (2, 7), "x": (2, 7, 16)}, ["pointwise", "rowreduce"])
    assert len(res.model.graph.node) == 2


@pytest.mark.parametrize("start,delta,why", [
    (1, 1, "a run-time length other than a dim"),
    (0, 2, "a run-time length other than a dim"),
])
def test_range_whose_length_is_not_a_dim_stays_with_ort(start, delta, why):
    m = _causal_mask(F)
    for i in m.graph.initializer:
        if i.name == "zero":
            i.CopyFrom(const("zero", start, I64))
    m.graph.initializer.append(const("step", delta, I64))
    for n in m.graph.node:
        if n.op_type == "Range":
            n.input[2] = "step"
    res = compile_model(m, {"mask": ("batch", "seq")}, "sm_90")
    assert any("Range" in r.subject and why in r.reason for r in res.plan.rejects), [str(r) for r in res.plan.rejects]
    assert any(n.op_type == "Range" for n in res.model.graph.node)


@pytest.mark.parametrize("dt", [F, H])
def test_vit_class_token_concat_fuses_with_the_position_add_and_layernorm(dt):
    """ViT's embeddings: the class token [B, 1, D] concatenated before the patches [B, N, D] (read through
    the patch projection's Reshape + Transpose), plus position embeddings, then LayerNorm."""
    rng = np.random.default_rng(4)
    w = lambda *s: rng.standard_normal(s).astype(NP[dt])  # noqa: E731
    m = model([node("Reshape", ["conv", "flat"], ["r"]), node("Transpose", ["r"], ["p"], perm=[0, 2, 1]),
               node("Concat", ["cls", "p"], ["x"], axis=1), node("Add", ["x", "pos"], ["e"]),
               node("LayerNormalization", ["e", "g", "b"], ["y"], axis=-1)],
              [vi("conv", dt, ["batch", 32, 7, 7]), vi("cls", dt, ["batch", 1, 32])], [vi("y", dt, None)],
              [const("flat", [0, 32, -1], I64), const("pos", w(1, 50, 32), NP[dt]), const("g", w(32), NP[dt]),
               const("b", w(32), NP[dt])])
    res = fused_parity(m, {"conv": ("batch", 32, 7, 7), "cls": ("batch", 1, 32)},
                       {"conv": (3, 32, 7, 7), "cls": (3, 1, 32)}, ["rowreduce"])
    # the Transpose and Concat kernels are in ours; the Reshape before them is left to ORT, which aliases it
    assert [n.op_type for n in res.model.graph.node] == ["Reshape", res.kernels[0].node.op_type]


def test_concat_of_computed_tensors_on_any_axis():
    """Three inputs along axis 1 (spans 5, 3, 2) and two along the last axis, the ops on either side in the
    same kernel. With spans of run-time size the same graph is one kernel too: its output's span is the sum
    of theirs (`sym_sums` rules: s + t + 2), and each input is read only where the coordinate is in its span,
    so an empty one (s = 0, t = 0: emulation passes it as a null pointer, as ORT may) is never touched."""
    def build(s, t):
        return model([node("Relu", ["a"], ["ra"]), node("Neg", ["b"], ["nb"]),
                      node("Concat", ["ra", "nb", "c"], ["x"], axis=1), node("Mul", ["x", "two"], ["y"]),
                      node("Concat", ["y", "y"], ["z0"], axis=-1), node("Sigmoid", ["z0"], ["z"])],
                     [vi("a", F, ["n", s, 6]), vi("b", F, ["n", t, 6]), vi("c", F, ["n", 2, 6])], [vi("z", F, None)],
                     [const("two", 2.0)])
    shapes = {"a": ("n", 5, 6), "b": ("n", 3, 6), "c": ("n", 2, 6)}
    res = fused_parity(build(5, 3), shapes, {k: (2, *v[1:]) for k, v in shapes.items()}, ["pointwise"])
    assert len(res.model.graph.node) == 1
    m = build("s", "t")
    for s, t in ((4, 3), (0, 3), (4, 0), (0, 0)):
        res = fused_parity(m, None, {"a": (2, s, 6), "b": (2, t, 6), "c": (2, 2, 6)}, ["pointwise"])
    assert len(res.model.graph.node) == 1
    fused = next(n for n in res.model.graph.node if n.domain == "ortfuse")
    spec = read_launch(fused)
    assert len(spec.sym_sums) == 2 and spec.out_shapes[0][1] == -(len(spec.sym_dims) + 2)  # (s + t) + 2
    given = {"a": (3, 4, 6), "b": (3, 5, 6), "c": (3, 2, 6)}
    assert spec.dims([given[x] for x in fused.input])[-2:] == [9, 11]


def test_an_input_declaring_the_concat_span_is_checked_against_its_sum():
    """A mask declared over "p + s" beside the Concat of the past and new masks: the kernel binds the span from
    the mask, so each launch checks it against p + s (an input ORT would refuse is an error, never a read past
    the new mask's end)."""
    m = model([node("Concat", ["pm", "nm"], ["c"], axis=-1), node("Cast", ["c"], ["cb"], to=TP.BOOL),
               node("Where", ["cb", "x", "neg"], ["y"])],
              [vi("pm", TP.INT64, ["b", "p"]), vi("nm", TP.INT64, ["b", "s"]), vi("x", F, ["b", "p + s"])],
              [vi("y", F, None)], [const("neg", -1e4)])
    for p, s in ((3, 2), (0, 2)):
        res = fused_parity(m, None, {"pm": (2, p), "nm": (2, s), "x": (2, p + s)}, ["pointwise"])
    fused = next(n for n in res.model.graph.node if n.domain == "ortfuse")
    spec = read_launch(fused)
    shapes = {"pm": (2, 3), "nm": (2, 0), "x": (2, 5)}
    with pytest.raises(ValueError, match="has size 5 at axis 1, but the kernel was built for 3 there \\(the spans"):
        spec.dims([shapes[t] for t in fused.input])


@pytest.mark.parametrize("dt", [F, H])
def test_kv_cache_concat_joins_the_kernel_and_reads_the_past_by_vectors(dt):
    """A decoder's present key: the past [B, H, P, D] (empty at the first step) and the new tokens' key, scaled
    from [B, S, H*D] and transposed, concatenated along the sequence: one kernel writing the present, each input
    read by vectors under the guard that the row is one of its rows."""
    h, d = 2, 16
    m = model([node("Reshape", ["k", "shape"], ["k4"]), node("Transpose", ["k4"], ["kt"], perm=[0, 2, 1, 3]),
               node("Mul", ["kt", "scale"], ["ks"]), node("Concat", ["past", "ks"], ["present"], axis=2)],
              [vi("k", dt, ["batch", "seq", h * d]), vi("past", dt, ["batch", h, "past_seq", d])],
              [vi("present", dt, None)],
              [const("shape", [0, 0, h, d], I64), const("scale", 0.5, NP[dt])])
    for past, seq in ((5, 1), (0, 3), (7, 4)):
        res = fused_parity(m, None, {"k": (2, seq, h * d), "past": (2, h, past, d)}, ["pointwise"])
    assert [n.op_type for n in res.model.graph.node] == ["Reshape", res.kernels[0].node.op_type]
    src = res.kernels[0].compiled.source
    width = 8 if dt == H else 4
    # the past and the new key (its innermost dim is D too), each one guarded vector load per D-chunk
    assert src.count(f"ofz::load_arg_if<{width}>(inb") == 2 and "ofz::load_arg<" not in src, src


def test_gemm_reading_a_gathered_iota_keeps_its_epilogue():
    """Gather(pos, Range) feeding a MatMul: the iota is not a GEMM prologue, so the GEMM + bias + Relu region
    forms as it would without it, and the lookup is its own kernel."""
    rng = np.random.default_rng(0)
    m = model([node("Shape", ["x"], ["sh"]), node("Gather", ["sh", "one"], ["s"]),
               node("Range", ["zero", "s", "one"], ["q"]), node("Gather", ["pos", "q"], ["e"]),
               node("Add", ["e", "x"], ["ex"]), node("MatMul", ["ex", "w"], ["mm"]), node("Add", ["mm", "bias"], ["y0"]),
               node("Relu", ["y0"], ["y"])],
              [vi("x", H, ["b", "s", 64])], [vi("y", H, None)],
              [const("bias", rng.standard_normal(64), np.float16), const("one", 1, I64), const("zero", 0, I64),
               const("pos", rng.standard_normal((128, 64)), np.float16),
               const("w", rng.standard_normal((64, 64)) * 0.1, np.float16)])
    fused_parity(m, {"x": ("b", "s", 64)}, {"x": (2, 16, 64)}, ["gemm", "pointwise"])


def test_nested_shared_iotas_give_each_kernel_its_own_copy():
    """q = Range; a, b = Unsqueezes of q; a causal Where + Softmax reads a and b, another Softmax reads b:
    both kernels take their iotas in (the copies of b's cone and of q's must not share a Range)."""
    m = model([node("Shape", ["x"], ["sh"]), node("Gather", ["sh", "one"], ["s"]),
               node("Range", ["zero", "s", "one"], ["q"]),
               node("Unsqueeze", ["q", "ax0"], ["a"]), node("Unsqueeze", ["q", "ax1"], ["b"]),
               node("LessOrEqual", ["a", "b"], ["le"]), node("Where", ["le", "x", "ninf"], ["w"]),
               node("Softmax", ["w"], ["y1"], axis=-1),
               node("Cast", ["b"], ["bf"], to=H), node("Add", ["bf", "x2"], ["t"]), node("Softmax", ["t"], ["y2"], axis=-1)],
              [vi("x", H, ["b", "s", "s"]), vi("x2", H, ["b", "s", 8])], [vi("y1", H, None), vi("y2", H, None)],
              [const("one", 1, I64), const("zero", 0, I64), const("ax0", [0], I64), const("ax1", [1], I64),
               const("ninf", -1e4, np.float16)])
    res = fused_parity(m, {"x": ("b", "s", "s"), "x2": ("b", "s", 8)}, {"x": (2, 6, 6), "x2": (2, 6, 8)},
                       ["rowreduce", "rowreduce"])
    assert len(res.model.graph.node) == 2


@pytest.mark.parametrize("dt", [F, H])
def test_class_token_expanded_to_a_run_time_batch_joins_the_kernel(dt):
    """torch's cls_token.expand(B, -1, -1) as exported: the target [B, -1, -1] built from the image's shape,
    its -1s replaced through Equal/Where; the Expand joins the Concat + position add + LayerNorm kernel, the
    function body rebuilds its target from the patches' shape, and the shape arithmetic goes."""
    rng = np.random.default_rng(5)
    w = lambda *s: rng.standard_normal(s).astype(NP[dt])  # noqa: E731
    m = model([node("Shape", ["p"], ["sh"]), node("Gather", ["sh", "zero"], ["b"]),
               node("Unsqueeze", ["b", "ax0"], ["b1"]), node("Concat", ["b1", "m1", "m1"], ["tgt0"], axis=0),
               node("Equal", ["tgt0", "m1"], ["eq"]), node("Where", ["eq", "ones", "tgt0"], ["tgt"]),
               node("Expand", ["cls", "tgt"], ["clsb"]),
               node("Concat", ["clsb", "p"], ["x"], axis=1), node("Add", ["x", "pos"], ["e"]),
               node("LayerNormalization", ["e", "g", "beta"], ["y"], axis=-1)],
              [vi("p", dt, ["batch", 49, 32])], [vi("y", dt, None)],
              [const("cls", w(1, 1, 32), NP[dt]), const("pos", w(1, 50, 32), NP[dt]), const("g", w(32), NP[dt]),
               const("beta", w(32), NP[dt]), const("zero", 0, I64), const("ax0", [0], I64),
               const("m1", [-1], I64), const("ones", [1, 1, 1], I64)])
    res = fused_parity(m, {"p": ("batch", 49, 32)}, {"p": (3, 49, 32)}, ["rowreduce"])
    fused = res.kernels[0].node
    assert [n.op_type for n in res.model.graph.node] == [fused.op_type]
    assert [(x, [(fused.inputs[k] if k >= 0 else None, a) for k, a in parts]) for x, parts in fused.shape_reads] == \
        [("tgt", [("p", 0), (None, 1), (None, 1)])]


def test_position_ids_sliced_from_a_buffer_fuse_and_a_too_long_sequence_is_refused():
    """BERT's position ids: a Slice of a constant arange buffer [1, 16] up to the sequence length read
    from input_ids' shape, then the position lookup. The Slice joins the embeddings kernel (its end rebuilt
    in the function body); a sequence past the buffer, where ORT's Slice would clamp and the model fail
    further on, is refused at launch instead of read past the buffer."""
    from ortfuse.customops.attrs import read_launch

    rng = np.random.default_rng(6)
    m = model([node("Gather", ["words", "ids"], ["we"]),
               node("Shape", ["ids"], ["sh"]), node("Gather", ["sh", "one"], ["s"]),
               node("Unsqueeze", ["s", "ax0"], ["s1"]),
               node("Slice", ["buf", "zero1", "s1", "one1"], ["pid"]),
               node("Gather", ["positions", "pid"], ["pe"]), node("Add", ["we", "pe"], ["x"]),
               node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)],
              [vi("ids", TP.INT64, ["batch", "seq"])], [vi("y", F, None)],
              [const("words", rng.standard_normal((30, 16))), const("positions", rng.standard_normal((16, 16))),
               const("buf", np.arange(16).reshape(1, 16), I64), const("g", rng.standard_normal(16)),
               const("b", rng.standard_normal(16)), const("one", 1, I64), const("ax0", [0], I64),
               const("zero1", [0], I64), const("one1", [1], I64)])
    res = fused_parity(m, {"ids": ("batch", "seq")}, {"ids": (2, 9)}, ["rowreduce"])
    assert [n.op_type for n in res.model.graph.node] == [res.kernels[0].node.op_type]
    launch = read_launch(res.model.graph.node[0])
    shapes = {"ids": (2, 16), "words": (30, 16), "buf": (1, 16), "positions": (16, 16), "g": (16,), "b": (16,)}
    args = [shapes[t] for t in res.kernels[0].node.inputs]
    launch.dims(args)  # a sequence of 16 fits the buffer
    with pytest.raises(ValueError, match="a size of 17 exceeds what this kernel was built for \\(< 17"):
        launch.dims([(2, 17) if t == "ids" else shapes[t] for t in res.kernels[0].node.inputs])


def test_slice_with_constant_bounds_is_an_index_op():
    m = model([node("Slice", ["x", "st", "en", "ax"], ["s"]), node("Mul", ["s", "two"], ["y0"]),
               node("Add", ["y0", "r"], ["y"])],
              [vi("x", F, ["n", 9, 8]), vi("r", F, ["n", 3, 4])], [vi("y", F, ["n", 3, 4])],
              [const("st", [2, -6], I64), const("en", [5, -2], I64), const("ax", [1, 2], I64), const("two", 2.0)])
    res = fused_parity(m, {"x": ("n", 9, 8), "r": ("n", 3, 4)}, {"x": (2, 9, 8), "r": (2, 3, 4)}, ["pointwise"])
    assert len(res.model.graph.node) == 1


@pytest.mark.parametrize("dt", [F, H])
def test_strided_slices_are_index_ops(dt):
    # positive steps: every other column from 1 (ends clamped), every third row from -8; an odd step count
    m = model([node("Slice", ["x", "st", "en", "ax", "sp"], ["s"]), node("Mul", ["s", "two"], ["y0"]),
               node("Add", ["y0", "r"], ["y"])],
              [vi("x", dt, ["n", 9, 8]), vi("r", dt, ["n", 3, 4])], [vi("y", dt, ["n", 3, 4])],
              [const("st", [-8, 1], I64), const("en", [9, 99], I64), const("ax", [1, 2], I64),
               const("sp", [3, 2], I64), const("two", 2.0, NP[dt])])
    res = fused_parity(m, {"x": ("n", 9, 8), "r": ("n", 3, 4)}, {"x": (2, 9, 8), "r": (2, 3, 4)}, ["pointwise"])
    assert len(res.model.graph.node) == 1


@pytest.mark.parametrize("dt", [F, H])
def test_rotary_embedding_is_one_kernel(dt):
    # its Slice bound (Shape, Gather, Div) is folded; x * cos and rotate_half(x) * sin then merge, though
    # one pair at a time a path between their groups runs outside (the Transpose both read)
    res = fused_parity(rotary(dt), {}, {"x": (2, 5, 4, 32), "cos": (5, 32), "sin": (5, 32)}, ("pointwise",))
    ops = sorted(res.graph.nodes[i].op_type for i in res.plan.regions[0].nodes)
    assert ops == sorted(["Transpose", "Slice", "Slice", "Neg", "Concat", "Mul", "Mul", "Add"])
    assert len(res.model.graph.node) == 1  # the Shape arithmetic went with the fold


@pytest.mark.parametrize("s,heads", [(12, 0), ("s", 0), ("s", 3)])
def test_an_output_flattening_run_time_axes(s, heads):
    """torch's MultiheadAttention (WavLM, Swin's windows): a sequence-first [s, n, c] tensor transposed and
    flattened to [n * s, c] for the out-projection. The kernel's output rows are a product of run-time dims
    ("12*n", "n*s", "3*n*s": one `sym_products` rule per factor after the first, node format 2), which the
    node computes."""
    inner = (heads, 8) if heads else (8,)
    for n, s_ in ((3, 12), (1, 12), (0, 12)) if s == 12 else ((3, 7), (2, 1), (0, 4)):
        res = fused_parity(flattened(s, heads), None, {"x": (s_, n, *inner)}, ["pointwise"])
    assert len(res.model.graph.node) == 1
    fused = next(x for x in res.model.graph.node if x.domain == "ortfuse")
    spec = read_launch(fused)
    rules = 2 if heads else 1
    assert spec.sym_products == tuple(range(rules)) and len(spec.sym_sums) == rules
    assert spec.output_shapes(spec.dims([(12, 5, *inner)])) == [[12 * 5 * (heads or 1), 8]]
    assert next(a.i for a in fused.attribute if a.name == "ortfuse_version") == 2


@pytest.mark.gpu
def test_an_output_flattening_run_time_axes_on_the_cuda_ep():
    """The product rule in the native library: the output's rows, its shape inference and the grid."""
    from ortfuse.check import check_models

    m = flattened("s")
    res = compile_model(m, None, "sm_90")
    for n, s in ((3, 7), (2, 1), (0, 4), (5, 40)):
        rep = check_models(m, res.model, provider="cuda", input_shapes={"x": (s, n, 8)})
        assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("d,factors", [
    ("79*batch", ["79", "batch"]), ("batch*sequence", ["batch", "sequence"]), ("3*n*s", ["3", "n", "s"]),
    ("64*floor(h/2)", ["64", "floor(h/2)"]), ("floor(h*2)*3", ["floor(h*2)", "3"]),
    ("2*p + s", None), ("p + s*2", None), ("w - 1*3", None), ("6*batch/2", None), ("batch", None),
    ("batch*other", None),
])
def test_dim_factors_split_products_at_the_top_level(d, factors):
    assert dim_factors(d, {"batch", "sequence", "n", "s", "p", "p + s", "floor(h/2)", "floor(h*2)", "w"}) == factors

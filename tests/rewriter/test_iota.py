"""fold_iota_gathers (rewriter/iota.py): transformers 5's padding mask gathers the flattened mask at its own
row-major index, b * S + j over iotas from Range; that Gather becomes a Reshape of the mask, and the index
arithmetic (host shape ops) goes. Index forms that are not the identity stay Gathers."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse.rewriter.canonical import fold_runtime_shapes
from ortfuse.rewriter.iota import (Affine, affine, broadcast_merged_dims, fold_iota_gathers, isolate_iotas, stride,
                                   trilus_as_iotas)
from ortfuse.rewriter.shapes import build_graph


def _padding_mask(b_dim: int = 0, s_dim: int = 1, scale: str = "S", start: int = 0, delta: int = 1,
                  flatten: str = "flatten"):
    """mask [B, S] int64 -> bool [B, 1, 1, S] as transformers 5 exports it (torch.onnx, TorchScript):
    Gather(Flatten(Cast(mask)), Unsqueeze(Range(B)) * S + Unsqueeze(Range(S))), then Reshape(-1) and
    Reshape to the index's runtime shape. The keyword arguments break the identity for negative tests."""
    nodes = [node("Cast", ["mask"], ["mb"], to=TP.BOOL),
             node("Shape", ["mb"], ["shp"]),
             node("Gather", ["shp", "i0"], ["nb"], axis=0), node("Gather", ["shp", "i1"], ["ns"], axis=0),
             node("Range", ["r0", "nb" if b_dim == 0 else "ns", "r1"], ["ib"]),
             node("Range", ["rs", "ns", "rd"], ["js"]),
             node("Unsqueeze", ["ib", "ax123"], ["ib4"]), node("Unsqueeze", ["js", "ax012"], ["js4"]),
             node("Gather", ["shp", "i1v"], ["stride"], axis=0),
             node("Mul", ["ib4", "stride" if scale == "S" else "seven"], ["off"]),
             node("Add", ["js4", "off"], ["idx"]),
             node("Flatten", ["mb"], ["flat"], axis=2) if flatten == "flatten"
             else node("Reshape", ["mb", "minus1"], ["flat"]),
             node("Gather", ["flat", "idx"], ["g"], axis=0),
             node("Reshape", ["g", "minus1"], ["g1"]),
             node("Shape", ["idx"], ["ishape"]),
             node("Reshape", ["g1", "ishape"], ["out"])]
    inits = [const("i0", 0, np.int64), const("i1", 1, np.int64), const("i1v", [1], np.int64),
             const("r0", 0, np.int64), const("r1", 1, np.int64), const("rs", start, np.int64),
             const("rd", delta, np.int64), const("ax123", [1, 2, 3], np.int64), const("ax012", [0, 1, 2], np.int64),
             const("seven", 7, np.int64), const("minus1", [-1], np.int64)]
    return model(nodes, [vi("mask", TP.INT64, ["B", "S"])], [vi("out", TP.BOOL, None)], inits)


def _run(m, mask):
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"mask": mask})[0]


def _fold(m):
    g = build_graph(m, {})
    g2, n = fold_iota_gathers(g)
    g3, _ = fold_runtime_shapes(g2)
    return g, g3, n


@pytest.mark.parametrize("flatten", ["flatten", "reshape"])
def test_padding_mask_gather_becomes_a_reshape(flatten):
    m = _padding_mask(flatten=flatten)
    g, g3, n = _fold(m)
    a = affine(g, "idx")
    assert a == Affine(("B", 1, 1, "S"), ((0, (1, ("S",))), (3, (1, ()))), 0)
    assert n == 1
    assert {x.op_type for x in g3.nodes} == {"Cast", "Reshape"}  # the index arithmetic and both Gathers went
    assert g3.tensors["out"].shape == ("B", 1, 1, "S")
    rng = np.random.default_rng(0)
    for shape in ((3, 5), (1, 7), (2, 1)):
        mask = rng.integers(0, 2, shape).astype(np.int64)
        want = _run(m, mask)
        np.testing.assert_array_equal(want, mask.astype(bool)[:, None, None, :])
        np.testing.assert_array_equal(_run(g3.model, mask), want)
    assert g.model.graph.node[-1].op_type == "Reshape" and len(g.nodes) == len(m.graph.node)  # input untouched


@pytest.mark.parametrize("kw", [dict(b_dim=1), dict(scale="7"), dict(start=1), dict(delta=2)],
                         ids=["iota-over-S-on-the-batch-axis", "wrong-stride", "range-from-1", "range-step-2"])
def test_other_index_forms_stay_gathers(kw):
    m = _padding_mask(**kw)
    g = build_graph(m, {})
    g2, n = fold_iota_gathers(g)
    assert n == 0 and g2 is g


def test_stride_and_affine_of_symbolic_dims():
    assert stride(("B", "S", 4), 0) == (4, ("S",)) and stride(("B", "S", 4), 2) == (1, ())
    g = build_graph(_padding_mask(), {})
    assert affine(g, "js4") == Affine((1, 1, 1, "S"), ((3, (1, ())),), 0)
    assert affine(g, "off") == Affine(("B", 1, 1, 1), ((0, (1, ("S",))),), 0)
    assert affine(g, "mb") is None  # not an integer tensor


def _padding_mask_nd(swap: bool = False, offset: bool = False):
    """The same mask as torch.export writes it: GatherND(Cast(mask), Concat(Unsqueeze(Expand(b), -1),
    Unsqueeze(Expand(j), -1))) with the iotas expanded to [B, 1, 1, S]. `swap`: (j, b) columns; `offset`:
    b + j in the first column."""
    nodes = [node("Cast", ["mask"], ["mb"], to=TP.BOOL),
             node("Shape", ["mask"], ["nb1"], start=0, end=1), node("Squeeze", ["nb1"], ["nb"]),
             node("Shape", ["mask"], ["ns1"], start=1, end=2), node("Squeeze", ["ns1"], ["ns"]),
             node("Range", ["r0", "nb", "r1"], ["ib"]), node("Range", ["r0", "ns", "r1"], ["js"]),
             node("Unsqueeze", ["ib", "ax123"], ["ib4"]), node("Unsqueeze", ["js", "ax012"], ["js4"]),
             node("Max", ["ib4", "js4"], ["mx"]), node("Shape", ["mx"], ["full"]),
             node("Expand", ["ib4", "full"], ["ibx"]), node("Expand", ["js4", "full"], ["jsx"])]
    first, second = ("jsx", "ibx") if swap else ("ibx", "jsx")
    if offset:
        nodes.append(node("Add", ["ibx", "jsx"], ["sum"]))
        first = "sum"
    nodes += [node("Unsqueeze", [first, "last"], ["c0"]), node("Unsqueeze", [second, "last"], ["c1"]),
              node("Concat", ["c0", "c1"], ["idx"], axis=-1), node("GatherND", ["mb", "idx"], ["out"])]
    inits = [const("r0", 0, np.int64), const("r1", 1, np.int64), const("ax123", [1, 2, 3], np.int64),
             const("ax012", [0, 1, 2], np.int64), const("last", [-1], np.int64)]
    return model(nodes, [vi("mask", TP.INT64, ["B", "S"])], [vi("out", TP.BOOL, None)], inits)


def test_torch_export_gather_nd_mask_becomes_a_reshape():
    m = _padding_mask_nd()
    g, g3, n = _fold(m)
    assert n == 1 and {x.op_type for x in g3.nodes} == {"Cast", "Reshape"}
    mask = np.random.default_rng(1).integers(0, 2, (3, 6)).astype(np.int64)
    np.testing.assert_array_equal(_run(g3.model, mask), _run(m, mask))
    np.testing.assert_array_equal(_run(m, mask), mask.astype(bool)[:, None, None, :])


@pytest.mark.parametrize("kw", [dict(swap=True), dict(offset=True)], ids=["columns-swapped", "b-plus-j"])
def test_other_gather_nd_indices_stay(kw):
    g = build_graph(_padding_mask_nd(**kw), {})
    assert fold_iota_gathers(g) == (g, 0)

def _same_on_ort(m, g2, feeds) -> None:
    """The rewritten graph computes exactly what the model does (ORT CPU)."""
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(g2.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def _shared_iota():
    """x [B, S, 4] -> Relu; the sequence length read from Relu's output (an intermediate), a Range over it
    read by two consumers: a position lookup and a causal comparison."""
    nodes = [node("Relu", ["x"], ["h"]),
             node("Shape", ["h"], ["shp"]), node("Gather", ["shp", "i1"], ["ns"], axis=0),
             node("Range", ["r0", "ns", "r1"], ["pos"]),
             node("Unsqueeze", ["pos", "ax0"], ["row"]), node("Unsqueeze", ["pos", "ax1"], ["col"]),
             node("LessOrEqual", ["row", "col"], ["causal"]),
             node("Gather", ["table", "row"], ["pe"]),
             node("Add", ["h", "pe"], ["y"])]
    inits = [const("i1", 1, np.int64), const("r0", 0, np.int64), const("r1", 1, np.int64),
             const("ax0", [0], np.int64), const("ax1", [1], np.int64),
             const("table", np.arange(40, dtype=np.float32).reshape(10, 4))]
    return model(nodes, [vi("x", TP.FLOAT, ["B", "S", 4])], [vi("y", TP.FLOAT, None), vi("causal", TP.BOOL, None)],
                 inits)


def test_isolate_iotas_reads_dims_from_inputs_and_copies_shared_iotas():
    m = _shared_iota()
    g = build_graph(m, {})
    g2, n = isolate_iotas(g)
    # one dim read moved to the graph input; the Range copied for its second Unsqueeze, and the Range +
    # Unsqueeze read by both the comparison and the lookup copied for the lookup
    assert n == 3
    shapes = [x for x in g2.nodes if x.op_type == "Shape"]
    assert [s.input[0] for s in shapes] == ["x"]
    ranges = [x for x in g2.nodes if x.op_type == "Range"]
    assert len(ranges) == 3 and all(len(g2.consumers[r.output[0]]) == 1 for r in ranges)
    assert g2.tensors[ranges[1].output[0]].shape == ("S",)
    x = np.random.default_rng(0).standard_normal((2, 7, 4)).astype(np.float32)
    _same_on_ort(m, g2, {"x": x})
    assert isolate_iotas(g2)[1] == 0  # nothing left to do


@pytest.mark.parametrize("dt", [np.int64, np.int32])
@pytest.mark.parametrize("ends", [[-1], [2**31 - 1]], ids=["next", "past-the-end"])
@pytest.mark.parametrize("whole", [{}, {"start": 0}], ids=["shape", "shape-from-0"])
def test_isolate_iotas_reads_a_sliced_dim_from_the_input(ends, dt, whole):
    # torch's x.size(-2) / x.size(-1) as Slice(Shape(h), [k], [k + 1 or past the end]): read from x, so the
    # intermediate h is not kept just for its shape (DeBERTa's attention views its scores so); the new starts
    # and ends keep the integer type of the axes (one type for all of a Slice's indices). torch.export writes
    # the whole shape as Shape(h, start=0)
    start = [-2] if ends == [-1] else [-1]
    nodes = [node("Relu", ["x"], ["h"]), node("Shape", ["h"], ["shp"], **whole),
             node("Slice", ["shp", "st", "en", "ax"], ["d1"]), node("Concat", ["d1", "d1"], ["tgt"], axis=0),
             node("Reshape", ["h", "tgt"], ["y"])]
    inits = [const("st", start, dt), const("en", ends, dt), const("ax", [0], dt)]
    m = model(nodes, [vi("x", TP.FLOAT, ["S", "S"])], [vi("y", TP.FLOAT, None)], inits)
    g2, n = isolate_iotas(build_graph(m, {}))
    assert n == 1 and [x.input[0] for x in g2.nodes if x.op_type == "Shape"] == ["x"]
    _same_on_ort(m, g2, {"x": np.random.default_rng(0).standard_normal((5, 5)).astype(np.float32)})


def test_isolate_iotas_makes_static_limits_constant():
    nodes = [node("Relu", ["x"], ["h"]), node("Shape", ["h"], ["shp"]), node("Gather", ["shp", "i2"], ["n4"], axis=0),
             node("Range", ["r0", "n4", "r1"], ["pos"]), node("Cast", ["pos"], ["pf"], to=TP.FLOAT),
             node("Add", ["h", "pf"], ["y"]), node("Mul", ["h", "pf"], ["z"])]
    inits = [const("i2", 2, np.int64), const("r0", 0, np.int64), const("r1", 1, np.int64)]
    m = model(nodes, [vi("x", TP.FLOAT, ["B", "S", 4])], [vi("y", TP.FLOAT, None), vi("z", TP.FLOAT, None)], inits)
    g = build_graph(m, {})
    g2, n = isolate_iotas(g)
    assert n == 2  # the static dim 4 became the Range's constant limit, and the shared Cast of the iota copied
    assert not [x for x in g2.nodes if x.op_type == "Shape"]
    assert [int(g2.constants[x.input[1]]) for x in g2.nodes if x.op_type == "Range"] == [4, 4]
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    _same_on_ort(m, g2, {"x": x})


def test_isolate_iotas_copies_overlapping_cones_once_per_reader():
    """A reader of two shared iotas built on one Range (Add(row, col), row and col also read elsewhere) gets
    one copy of the Range, not two with the same name; a dim read as Gather(Shape(h), [1]) keeps its rank."""
    nodes = [node("Relu", ["x"], ["h"]),
             node("Shape", ["h"], ["shp"]), node("Gather", ["shp", "i1v"], ["ns1"], axis=0),
             node("Squeeze", ["ns1", "ax0"], ["ns"]),
             node("Range", ["r0", "ns", "r1"], ["pos"]),
             node("Unsqueeze", ["pos", "ax0"], ["row"]), node("Unsqueeze", ["pos", "ax1"], ["col"]),
             node("Neg", ["row"], ["nrow"]), node("Neg", ["col"], ["ncol"]),
             node("Add", ["row", "col"], ["grid"]),
             node("Cast", ["grid"], ["gf"], to=TP.FLOAT), node("Add", ["h", "gf"], ["y"])]
    inits = [const("i1v", [1], np.int64), const("r0", 0, np.int64), const("r1", 1, np.int64),
             const("ax0", [0], np.int64), const("ax1", [1], np.int64)]
    m = model(nodes, [vi("x", TP.FLOAT, ["B", "S", "S"])],
              [vi("y", TP.FLOAT, None), vi("nrow", TP.INT64, None), vi("ncol", TP.INT64, None)], inits)
    g = build_graph(m, {})
    g2, n = isolate_iotas(g)
    assert n == 4  # the dim read; pos copied for col; row and col copied for the Add, on one Range copy
    assert len([x for x in g2.nodes if x.op_type == "Range"]) == 3
    x = np.random.default_rng(0).standard_normal((2, 5, 5)).astype(np.float32)
    _same_on_ort(m, g2, {"x": x})


def test_dims_merged_in_a_broadcast_are_not_rebased():
    """Sum(a[s], b[t]): shape inference merges s and t, though either may be 1 at run time (a = [1], b = [5]
    gives 5 elements). A dim read from the sum must stay read from the sum."""
    m = model([node("Sum", ["a", "b"], ["c"]), node("Shape", ["c"], ["sh"]), node("Gather", ["sh", "zero"], ["n"])],
              [vi("b", TP.FLOAT, ["t"]), vi("a", TP.FLOAT, ["s"])], [vi("n", TP.INT64, None), vi("c", TP.FLOAT, None)],
              [const("zero", 0, np.int64)])
    g = build_graph(m, {})
    assert {"s", "t"} <= broadcast_merged_dims(g)
    g2, n = isolate_iotas(g)
    assert n == 0 and g2 is g
    feeds = {"a": np.ones(1, np.float32), "b": np.ones(5, np.float32)}
    got = ort.InferenceSession(g2.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert int(got[0]) == 5


def _sym_size_positions(axis: int):
    """torch.export's position ids: the sequence length as Squeeze(Shape(h, start=k, end=k + 1)) (its
    sym_size), read from an intermediate h; Range over it, looked up in a table and added to h."""
    nodes = [node("Relu", ["x"], ["h"]), node("Shape", ["h"], ["shp"], start=axis, end=axis + 1),
             node("Squeeze", ["shp"], ["n"]), node("Range", ["r0", "n", "r1"], ["pos"]),
             node("Gather", ["table", "pos"], ["pe"], axis=0), node("Add", ["h", "pe"], ["y"])]
    inits = [const("r0", 0, np.int64), const("r1", 1, np.int64),
             const("table", np.arange(40, dtype=np.float32).reshape(10, 4))]
    return model(nodes, [vi("x", TP.FLOAT, ["B", "S", 4])], [vi("y", TP.FLOAT, None)], inits)


def test_a_sym_size_dim_is_read_from_the_input_and_its_range_is_computed_in_the_kernel():
    from ortfuse.search.legal import range_length_verdict

    m = _sym_size_positions(1)
    g = build_graph(m, {})
    rng = next(i for i, x in enumerate(g.nodes) if x.op_type == "Range")
    assert range_length_verdict(g, g.nodes[rng]) is None  # the limit is the output's dim "S"
    g2, n = isolate_iotas(g)
    assert n == 1
    shape = next(x for x in g2.nodes if x.op_type == "Shape")
    assert shape.input[0] == "x" and {a.name: a.i for a in shape.attribute} == {"start": 1, "end": 2}
    _same_on_ort(m, g2, {"x": np.random.default_rng(0).standard_normal((2, 7, 4)).astype(np.float32)})


def test_a_sym_size_of_a_static_dim_becomes_a_constant_limit():
    # Shape(h, start=-1) reads the static 4 (negative starts count from the end, as ONNX clamps them)
    nodes = [node("Relu", ["x"], ["h"]), node("Shape", ["h"], ["shp"], start=-1),
             node("Squeeze", ["shp"], ["n"]), node("Range", ["r0", "n", "r1"], ["pos"]),
             node("Cast", ["pos"], ["pf"], to=TP.FLOAT), node("Add", ["h", "pf"], ["y"])]
    inits = [const("r0", 0, np.int64), const("r1", 1, np.int64)]
    m = model(nodes, [vi("x", TP.FLOAT, ["B", "S", 4])], [vi("y", TP.FLOAT, None)], inits)
    g2, n = isolate_iotas(build_graph(m, {}))
    assert n == 1 and [int(g2.constants[x.input[1]]) for x in g2.nodes if x.op_type == "Range"] == [4]
    assert not [x for x in g2.nodes if x.op_type == "Shape"]
    _same_on_ort(m, g2, {"x": np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)})


def test_a_shape_of_several_dims_is_not_a_scalar():
    from ortfuse.rewriter.iota import scalar

    nodes = [node("Shape", ["x"], ["shp"], start=1), node("Shape", ["x"], ["one"], start=1, end=2)]
    g = build_graph(model(nodes, [vi("x", TP.FLOAT, ["B", "S", 4])], [vi("shp", TP.INT64, None),
                                                                      vi("one", TP.INT64, None)]), {})
    assert scalar(g, "shp") is None and scalar(g, "one") == (1, ("S",))


@pytest.mark.parametrize("via", ["shape", "gather"])
def test_a_range_limit_inference_merged_into_a_size_stays_computed(via):
    # inp [S] meets a [4] constant in an Add: inference calls S 4, but S may be 1 at run time (broadcast)
    read = [node("Shape", ["x"], ["d1"], start=0, end=1), node("Squeeze", ["d1"], ["d"])] if via == "shape" else \
        [node("Shape", ["x"], ["sx"]), node("Gather", ["sx", "z1"], ["d"], axis=0)]
    nodes = [node("Relu", ["inp"], ["x"]), node("Add", ["x", "c"], ["z"]), *read, node("Range", ["r0", "d", "r1"], ["y"])]
    m = model(nodes, [vi("inp", TP.FLOAT, ["S"])], [vi("y", TP.INT64, None), vi("z", TP.FLOAT, None)],
              [const("c", np.ones(4)), const("r0", 0, np.int64), const("r1", 1, np.int64), const("z1", 0, np.int64)])
    g2, n = isolate_iotas(build_graph(m, {}))
    assert not any(x.op_type == "Range" and x.input[1] in g2.constants for x in g2.nodes)


def _trilu_mask(dt: int = TP.FLOAT, upper: int = 0, k=None, source: str = "expand", static: bool = False):
    """The causal mask torch exports for scaled_dot_product_attention(is_causal=True): ones [Sq, T] of `dt`
    (their dims read as Slice(Shape(q), [-2], [-1]) and of k), Trilu (`k`: the name of its k input), then
    Where(Equal(., 0), -inf, 0) added to the fp32 scores [B, Sq, T] (a bool or integer Trilu: kept where true
    or nonzero)."""
    onnx = __import__("onnx")
    npdt = onnx.helper.tensor_dtype_to_np_dtype(dt)
    nodes = [node("Shape", ["q"], ["qs"], start=0), node("Shape", ["k"], ["ks"]),
             node("Slice", ["qs", "m2", "m1"], ["sq"]), node("Slice", ["ks", "m2", "m1"], ["t"]),
             node("Concat", ["sq", "t"], ["hw"], axis=0)]
    nodes.append(node("Expand", ["one", "hw"], ["ones"]) if source == "expand" else
                 node("ConstantOfShape", ["hw"], ["ones"], value=onnx.helper.make_tensor("v", dt, [1], [1])))
    nodes.append(node("Trilu", ["ones"] + ([k] if k else []), ["tri"], upper=upper))
    if dt in (TP.FLOAT, TP.FLOAT16):
        nodes += [node("Equal", ["tri", "zero"], ["hidden"]), node("Cast", ["hidden"], ["hid32"], to=TP.FLOAT),
                  node("Mul", ["hid32", "big"], ["bias"]), node("Sub", ["s", "bias"], ["y"])]
    else:
        nodes += [node("Cast", ["tri"], ["keep"], to=TP.BOOL), node("Where", ["keep", "s", "low"], ["y"])]
    inits = [const("m2", [-2], np.int64), const("m1", [-1], np.int64), const("one", np.array(1, npdt), npdt),
             const("zero", np.array(0, npdt), npdt), const("big", np.array(1e4, np.float32), np.float32),
             const("low", np.array(-1e4, np.float32), np.float32), const("kk", np.array(1, np.int64), np.int64),
             const("kneg", np.array(-2, np.int64), np.int64)]
    sq, t = (5, 7) if static else ("S", "T")
    f = TP.FLOAT
    return model(nodes, [vi("q", f, ["B", sq, 4]), vi("k", f, ["B", t, 4]), vi("s", f, ["B", sq, t])],
                 [vi("y", f, None)], inits)


@pytest.mark.parametrize("upper,k,source,dt", [
    (0, None, "expand", TP.FLOAT), (0, None, "expand", TP.FLOAT16), (1, "kk", "expand", TP.FLOAT),
    (0, "kk", "constant_of_shape", TP.FLOAT16), (0, "kneg", "expand", TP.FLOAT), (1, "kneg", "expand", TP.INT64),
    (0, None, "expand", TP.BOOL), (0, "kk", "constant_of_shape", TP.BOOL)])
def test_a_trilu_causal_mask_becomes_iotas(upper, k, source, dt):
    # no Trilu, Expand or [Sq, T] ones are left: Where(j <= i + k, 1, 0) over two Ranges whose limits are the
    # dims read through Shape (a bool one: the comparison itself, ORT having no bool Where); the same values at
    # every length, queries fewer or more than keys
    m = _trilu_mask(dt, upper, k, source)
    g2, n = trilus_as_iotas(build_graph(m, {}))
    ops = [x.op_type for x in g2.nodes]
    assert n == 1 and not {"Trilu", "Expand", "ConstantOfShape"} & set(ops) and ops.count("Range") == 2
    rng = np.random.default_rng(0)
    for sq, t in ((5, 9), (9, 5), (1, 1), (6, 6)):
        feeds = {x: rng.standard_normal(shape).astype(np.float32)
                 for x, shape in (("q", (2, sq, 4)), ("k", (2, t, 4)), ("s", (2, sq, t)))}
        _same_on_ort(m, g2, feeds)


def test_trilus_that_are_not_such_a_mask_stay():
    # a Trilu of data, of ones expanded to a constant target (folded to a constant elsewhere)
    static = _trilu_mask(static=True)
    for x in static.graph.node:
        if x.op_type == "Expand":
            x.input[1] = "hw_c"
    static.graph.initializer.append(__import__("onnx").numpy_helper.from_array(np.array([5, 7], np.int64), "hw_c"))
    data = _trilu_mask()
    for x in data.graph.node:
        if x.op_type == "Trilu":
            x.input[0] = "s"
    for m in (static, data):
        g = build_graph(m, {})
        assert trilus_as_iotas(g) == (g, 0)

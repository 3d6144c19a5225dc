"""Running shape inference: ONNX Runtime's symbolic inference first (it resolves the Shape/Gather/Concat
chains exporters use for Reshape targets and keeps dims symbolic), ONNX's own inference as fallback.

Both run on skeletons: large non-integer weights reduced to dtype and dims (stubs for ONNX's inference,
graph inputs for symbolic inference, which would otherwise copy the model and read every constant operand
of an element-wise op as a value). ONNX's inference serializes the model: over the protobuf limit it goes
through onnx.shape_inference.infer_shapes_path."""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from typing import Callable, Union

import numpy as np
import onnx

from ortfuse.rewriter import _proto
from ortfuse.rewriter.weights import filled

log = logging.getLogger(__name__)

STRIP_BYTES = 1024  # ONNX data propagation only reads small integer tensors (shape values)
_SHAPE_DTYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
_STRIPPED = "ortfuse-stripped-weight"  # reading it fails loudly rather than yielding wrong values


class ShapeInferenceError(Exception):
    """ONNX's strict inference rejected the model; the message names the node."""


def infer_value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Type and shape of every tensor inference could determine, by name. ONNX's strict inference with
    type checking always runs (on the skeleton: it needs dtypes, dims and small integer tensors only), so
    a model ORT would refuse (an op's inputs bound to different types, a string fed to Abs, an axis out
    of range) is refused here too, naming the node, whether or not symbolic inference coped with it."""
    checked = _onnx(_skeleton(model))
    weightless, weights = _skeleton(model, as_inputs=True)
    inferred, complete, merges = _symbolic(weightless)
    record_merges(model, merges)
    if inferred is None:
        return _collect(checked)
    infos = {k: v for k, v in _collect(inferred).items() if k not in weights}
    if not complete:  # symbolic gave up on some nodes: let ONNX fill what it can
        for name, vi in _collect(checked).items():
            infos.setdefault(name, vi)
    return infos


def infer_dtypes(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every tensor ONNX's strict type inference reaches, initializers included: no
    symbolic shapes (sympy can take tens of seconds on an inlined model with Resizes)."""
    types = {n: vi.type.tensor_type.elem_type for n, vi in _collect(_onnx(_skeleton(model))).items()
             if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def _skeleton(model: onnx.ModelProto, as_inputs: bool = False
              ) -> Union[onnx.ModelProto, tuple[onnx.ModelProto, frozenset[str]]]:
    """Everything inference reads, with big non-integer initializers reduced to dtype and dims: stubs that
    fail loudly when read (ONNX's inference), or (`as_inputs`) graph inputs, returned with their names.
    Symbolic inference reads every constant input of an element-wise op as a value (a bias converted to
    numpy), and copies the model and each node's initializers: a weight is only a shape to it."""
    sk = _proto.without_initializers(model)
    g, src = sk.graph, model.graph
    listed, weights = {v.name for v in src.input}, set()
    for t in src.initializer:
        if t.data_type in _SHAPE_DTYPES or _proto.tensor_bytes(t) <= STRIP_BYTES \
                or (as_inputs and t.name in listed):  # (fed like an input already: kept whole, IR < 4 style)
            g.initializer.append(filled(t))  # (a weight store's stub filled: inference may read it)
            continue
        if as_inputs:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims))
            weights.add(t.name)
            continue
        stub = g.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        stub.data_location = onnx.TensorProto.EXTERNAL
        stub.external_data.add(key="location", value=_STRIPPED)
    return (sk, frozenset(weights)) if as_inputs else sk


MERGES_KEY = "ortfuse.shape_merges"  # on the rewriter's private copy only; `replace` drops it


MINTED_KEY = "ortfuse.minted_by"  # likewise: the tensor each merged minted symbol came from
# SymbolicShapeInference's names for the dims it mints: <Op>_<node index>_o<output>__d<axis>
MINTED = re.compile(r"([A-Za-z0-9]+)_(\d+)_o(\d+)__d(\d+)")


def record_merges(model: onnx.ModelProto, merges: dict) -> None:
    """Notes on `model` (metadata) which symbolic dims inference merged into which (a name or a size), and for
    each merged symbol inference minted, the tensor it minted it for (by name: node positions change as the
    rewriter folds; "" where the name says no node of `model`)."""
    props = [p for p in model.metadata_props if p.key not in (MERGES_KEY, MINTED_KEY)]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    if merges:
        model.metadata_props.add(key=MERGES_KEY, value=json.dumps({str(k): v for k, v in merges.items()}))
        minted = {}
        for sym in merges:  # a minted symbol, or each one in an expression (Min(8, Reshape_340_o0__d1))
            for found in MINTED.finditer(str(sym)):
                i, k = int(found.group(2)), int(found.group(3))
                n = model.graph.node[i] if i < len(model.graph.node) else None
                ok = n is not None and n.op_type == found.group(1) and k < len(n.output)
                minted[found.group(0)] = n.output[k] if ok else ""
        model.metadata_props.add(key=MINTED_KEY, value=json.dumps(minted))


def minted_by(model: onnx.ModelProto) -> dict:
    """{merged minted symbol, or one in a merged expression: the tensor it was minted for, or ""} as
    `record_merges` noted it."""
    return next((json.loads(p.value) for p in model.metadata_props if p.key == MINTED_KEY), {})


def recorded_merges(model: onnx.ModelProto) -> dict:
    """{symbol: the name or size it was merged into} as `record_merges` noted it."""
    return next((json.loads(p.value) for p in model.metadata_props if p.key == MERGES_KEY), {})


def _symbolic(model: onnx.ModelProto) -> tuple[onnx.ModelProto | None, bool, dict]:
    """(inferred model, complete, merges) or (None, False, {}) when symbolic inference fails. merges: the
    symbolic dims the tool merged (auto_merge: dims meeting in a broadcast) into another name or a size.

    Drives SymbolicShapeInference's loop ourselves: its infer_shapes() writes a debug model into the
    current directory when inference is incomplete, and we want partial results instead of an error."""
    if (_proto.opset_of(model) or 0) < 7:
        return None, False, {}
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # guess_output_rank=False: an unknown shape is safer for fusion than a guessed one.
        ssi = SymbolicShapeInference(2**31 - 1, True, False, 0)
        ssi.dispatcher_.setdefault("ConvTranspose", lambda node: _conv_transpose(ssi, node))
        own_conv_pool = ssi._compute_conv_pool_shape
        ssi._compute_conv_pool_shape = lambda node, channels_last=False: _same_padded(ssi, node, channels_last,
                                                                                      own_conv_pool)
        own_resize = ssi.dispatcher_.get("Resize")
        if own_resize is not None:
            ssi.dispatcher_["Resize"] = lambda node: _resize(ssi, node, own_resize)
        opset = _proto.opset_of(model) or 0
        axes_inputs = (("ReduceSum",) if opset >= 13 else ()) + (AXES_INPUT_FROM_18 if opset >= 18 else ())
        for op in axes_inputs:
            ssi.dispatcher_[op] = lambda node: _reduce_axes_input(ssi, node)
        # the tool's rules for these are com.microsoft's ops of the same name (and assert on ONNX's own, opset
        # 23): ONNX's single-node inference, which the tool runs on every node first, is what they need
        for op in ("Attention", "RotaryEmbedding"):
            own = ssi.dispatcher_.get(op)
            if own is not None:
                ssi.dispatcher_[op] = lambda node, own=own: None if node.domain in ("", "ai.onnx") else own(node)
        for op in ("DequantizeLinear", "QuantizeLinear"):
            own = ssi.dispatcher_.get(op)
            if own is not None:
                ssi.dispatcher_[op] = lambda node, own=own: _output_dtype(ssi, node, own)
        own_split = ssi.dispatcher_.get("Split")
        if own_split is not None:
            ssi.dispatcher_["Split"] = lambda node: _split(ssi, node, own_split)
        ssi._preprocess(model)
        complete = False
        while ssi.run_:
            complete = ssi._infer_impl()
        ssi._update_output_from_vi()
        merges = {str(k): (int(v) if isinstance(v, int) else str(v)) for k, v in ssi.suggested_merge_.items()}
        return ssi.out_mp_, bool(complete), merges
    except Exception as e:  # the tool raises bare Exception/AssertionError on models it cannot handle
        log.debug("symbolic shape inference failed, falling back to ONNX: %s", e)
        return None, False, {}


# Reductions whose axes became an input at opset 18 (ReduceSum's did at 13). The tool's rule for an axes input
# serves ReduceSum and ReduceMean only: for the others, ONNX's single-node inference cannot read axes that a Constant
# node makes, and gives the output new symbolic dims (SwinV2's ReduceL2 at opset 22: no shape folded after it).
# The tool's rule itself takes empty axes for no reduction (noop_with_empty_axes=0 reduces every axis) and
# asserts on run-time axes with keepdims=0, which fails the whole inference: `_reduce_axes_input` covers both.
AXES_INPUT_FROM_18 = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                      "ReduceMin", "ReduceProd", "ReduceSumSquare")


def _output_dtype(ssi, node: onnx.NodeProto, own: Callable[[onnx.NodeProto], None]) -> None:
    """The tool's rules type a DequantizeLinear's output as its scale and a QuantizeLinear's as its zero point (else
    uint8); an `output_dtype` (Q: opset 21, DQ: 23) says otherwise (an fp16 result of an fp32 scale, which the tool
    typed fp32 and a kernel reading it would have loaded so)."""
    from onnxruntime.tools.symbolic_shape_infer import get_attribute
    own(node)
    dtype = get_attribute(node, "output_dtype", 0)
    if dtype:
        ssi.known_vi_[node.output[0]].type.tensor_type.elem_type = dtype


def _reduce_axes_input(ssi, node: onnx.NodeProto) -> None:
    """A reduction's output shape where axes is an input; and a ReduceProd of a shape vector (its element
    count, as a Reshape target computes it) as a value, as the tool's rule for the attribute form gives it."""
    from onnxruntime.tools.symbolic_shape_infer import get_attribute, sympy_reduce_product
    keep = get_attribute(node, "keepdims", 1)
    given = len(node.input) > 1 and bool(node.input[1])
    axes = ssi._try_get_value(node, 1) if given else None
    if given and axes is None:  # computed at run time: the rank only, where it is kept
        if keep:
            ssi._infer_ReduceSum(node)
        return
    axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    if axes is not None and len(axes) > 0:
        ssi._infer_ReduceSum(node)
    else:  # no axes: every axis, or none with noop_with_empty_axes
        shape = ssi._get_shape(node, 0)
        if shape is None:
            return
        out = shape if get_attribute(node, "noop_with_empty_axes", 0) else ([1] * len(shape) if keep else [])
        ssi.known_vi_[node.output[0]].CopyFrom(onnx.helper.make_tensor_value_info(
            node.output[0], ssi.known_vi_[node.input[0]].type.tensor_type.elem_type, out))
    if node.op_type == "ReduceProd" and not keep:
        data = ssi._try_get_value(node, 0)
        every = not axes and not get_attribute(node, "noop_with_empty_axes", 0)  # (None or [])
        whole = axes in ([0], [-1]) or every
        if data is not None and np.ndim(data) == 1 and whole:
            ssi.sympy_data_[node.output[0]] = sympy_reduce_product(ssi._get_int_or_float_values(node)[0])


def _split(ssi, node: onnx.NodeProto, own) -> None:
    """A Split into equal parts (no sizes given) of a static dim: ONNX's ceil-sized parts, the last one smaller
    (`num_outputs`, opset 18). The tool's rule divides the dim by the output count and truncates: a Split
    of 10 into 3 came out 3, 3, 3, not 4, 4, 2. Everything else: the tool's rule."""
    from onnxruntime.tools.symbolic_shape_infer import get_attribute

    shape = ssi._get_shape(node, 0)
    given = (len(node.input) > 1 and node.input[1]) or get_attribute(node, "split") is not None
    axis = get_attribute(node, "axis", 0)
    count = len(node.output)
    if given or shape is None or not -len(shape) <= axis < len(shape) or not isinstance(shape[axis], int) \
            or shape[axis] % count == 0:
        own(node)
        return
    axis %= len(shape)
    part = -(-shape[axis] // count)
    elem = ssi.known_vi_[node.input[0]].type.tensor_type.elem_type
    for k, out in enumerate(node.output):
        dims = [*shape[:axis], min(part, max(shape[axis] - part * k, 0)), *shape[axis + 1:]]
        ssi.known_vi_[out].CopyFrom(onnx.helper.make_tensor_value_info(out, elem, dims))


def _same_padded(ssi, node: onnx.NodeProto, channels_last: bool, own):
    """A Conv's or pool's output shape, the tool's, but ceil(in / stride) along every spatial axis for auto_pad
    SAME_UPPER / SAME_LOWER where an input size is symbolic: the tool's rule assumes no remainder there and
    takes floor(in / stride) (a stride-2 Conv over [h, 1] came out [floor(h/2), 0])."""
    import sympy
    from onnxruntime.tools.symbolic_shape_infer import get_attribute, is_literal

    shape = own(node, channels_last)
    if get_attribute(node, "auto_pad", b"NOTSET") not in (b"SAME_UPPER", b"SAME_LOWER") or channels_last \
            or get_attribute(node, "pads") is not None:
        return shape
    x = ssi._get_sympy_shape(node, 0)
    rank = len(x) - 2
    strides = get_attribute(node, "strides", [1] * rank)
    if rank < 1 or len(shape) != rank + 2 or len(strides) != rank or all(is_literal(d) for d in x[2:]):
        return shape  # static sizes: ONNX's own inference, which the tool keeps, is right
    shape[2:] = [sympy.Integer(-(-int(d) // s)) if is_literal(d) else d if s == 1 else sympy.ceiling(d / s)
                 for d, s in zip(x[2:], strides)]
    return shape


def _conv_transpose(ssi, node: onnx.NodeProto) -> None:
    """ConvTranspose's output shape with symbolic spatial dims (the tool has no rule for it: its output
    dims would be fresh names unrelated to the input). Only the explicit-pads form; others stay as the
    tool leaves them."""
    import sympy
    from onnxruntime.tools.symbolic_shape_infer import get_attribute, get_shape_from_sympy_shape

    vi = ssi.known_vi_[node.output[0]]
    auto_pad = get_attribute(node, "auto_pad", b"NOTSET")
    x, w = ssi._get_sympy_shape(node, 0), ssi._get_sympy_shape(node, 1)
    rank = len(x) - 2
    if (get_attribute(node, "output_shape") is not None or auto_pad not in (b"NOTSET", b"VALID")
            or rank < 1 or len(w) != rank + 2):
        if len(vi.type.tensor_type.shape.dim) == 0:
            vi.type.tensor_type.elem_type = onnx.TensorProto.UNDEFINED  # what the tool itself does
        return
    strides = get_attribute(node, "strides", [1] * rank)
    dilations = get_attribute(node, "dilations", [1] * rank)
    out_pad = get_attribute(node, "output_padding", [0] * rank)
    pads = get_attribute(node, "pads", [0] * (2 * rank))
    spatial = [s * (d - 1) + op + (k - 1) * dl + 1 - pads[i] - pads[i + rank]
               for i, (d, k, s, dl, op) in enumerate(zip(x[2:], w[2:], strides, dilations, out_pad))]
    shape = [x[0], w[1] * get_attribute(node, "group", 1), *[sympy.simplify(d) for d in spatial]]
    ssi._update_computed_dims(shape)
    elem = ssi.known_vi_[node.input[0]].type.tensor_type.elem_type
    vi.CopyFrom(onnx.helper.make_tensor_value_info(node.output[0], elem, get_shape_from_sympy_shape(shape)))


def _resize(ssi, node: onnx.NodeProto, fallback) -> None:
    """Resize to whole-number sizes (a feature pyramid upsampling to its lateral map's dims) or by whole-number
    scales (each output dim is the input dim times the scale, exactly). The tool's own rule simplifies
    floor(...) with sympy, which on the nested floor expressions of strided Convs over symbolic image sizes
    took 11 of the 14 s of PP-OCR's detector's inference; other forms still go to it."""
    import sympy
    from onnxruntime.tools.symbolic_shape_infer import get_attribute, get_opset, get_shape_from_sympy_shape

    scales = ssi._try_get_value(node, 2) if len(node.input) > 2 and node.input[2] else None
    sizes = ssi._try_get_value(node, 3) if len(node.input) > 3 and node.input[3] else None
    x = ssi._get_sympy_shape(node, 0)
    # each dim by a whole scale, or a static dim by any scale (ORT: int64(float(scale) * float(dim))): a
    # symbolic batch kept at scale 1 stays itself, where the tool's rule would mint floor(1.0*batch)
    scaled = sizes is None and scales is not None and len(scales) == len(x) and all(
        (float(k) == int(k) and k >= 1) or isinstance(d, int) or getattr(d, "is_Integer", False)
        for d, k in zip(x, scales))
    exact = sizes is not None and len(sizes) > 0 and all(sympy.sympify(d).is_integer for d in sizes)
    if get_opset(ssi.out_mp_) <= 10 or not (exact or scaled) \
            or get_attribute(node, "coordinate_transformation_mode") == b"tf_crop_and_resize" \
            or get_attribute(node, "axes") is not None:
        fallback(node)
        return
    if exact:  # sizes that are already whole (the lateral map's own dims, from its Shape): used as they are
        shape = [sympy.sympify(d) for d in sizes]
    else:
        shape = [d * sympy.Integer(int(k)) if float(k) == int(k) and k >= 1
                 else sympy.Integer(int(np.float32(k) * np.float32(int(d)))) for d, k in zip(x, scales)]
    ssi._update_computed_dims(shape)
    elem = ssi.known_vi_[node.input[0]].type.tensor_type.elem_type
    ssi.known_vi_[node.output[0]].CopyFrom(
        onnx.helper.make_tensor_value_info(node.output[0], elem, get_shape_from_sympy_shape(shape)))


def _onnx(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX's strict inference with type checking; ShapeInferenceError names the node it rejects."""
    try:
        if not _proto.is_large(model):
            return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
        with tempfile.TemporaryDirectory(prefix="ortfuse-infer-") as tmp:
            src, dst = os.path.join(tmp, "in.onnx"), os.path.join(tmp, "out.onnx")
            _proto.save_external(model, src, "in.onnx.data")
            onnx.shape_inference.infer_shapes_path(src, dst, check_type=True, strict_mode=True, data_prop=True)
            return onnx.load(dst, load_external_data=False)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
        lines = str(e).strip().splitlines()
        raise ShapeInferenceError(lines[0] if lines else type(e).__name__) from None


def _collect(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    g = model.graph
    out: dict[str, onnx.ValueInfoProto] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.WhichOneof("value") is not None:
            out[vi.name] = vi
    return out

"""bfloat16 models for the zoo and the coverage sweep: an fp32 export converted as its fp16 twin is
(onnxruntime's `convert_float_to_float16(keep_io_types=False)`), then every fp16 tensor retyped to bf16.
Ops whose schema at the model's opset takes fp16 but not bf16 for an input or output (Cos, Sin, Conv and
the pools before opset 22, ConstantOfShape's output before 20, Dropout for its ratio and Resize for its
scales: 65 ops at opset 17, 19 at 22) stay in fp32 between Casts, as the converter keeps the ops it is told
to block: the model is valid ONNX. Values go fp32 -> fp16 -> bf16 (the converter clamps constants to fp16's
range: attention masks
stay finite), the same model as the fp16 row, in the other half-precision type.

ONNX Runtime has no converter to bf16; an exporter writes one from a bf16 module (torch.onnx.export's dynamo
exporter does, with static shapes), which the zoo's `--exporter dynamo` path does not try."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ortfuse.rewriter import _proto

F16, BF16 = TensorProto.FLOAT16, TensorProto.BFLOAT16


def opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def without_bf16(model: onnx.ModelProto) -> set[str]:
    """Default-domain ops of `model` with a type (of an input or output) that takes fp16 but not bf16 at the
    model's opset: Cos's input before opset 22, ConstantOfShape's output before opset 20."""
    blocked = set()
    version = opset(model)
    for op in {n.op_type for n in _proto.deep_nodes(model.graph.node) if n.domain in ("", "ai.onnx")}:
        try:
            schema = onnx.defs.get_schema(op, version)
        except onnx.defs.SchemaError:
            continue
        used = {p.type_str for p in (*schema.inputs, *schema.outputs)}
        for c in schema.type_constraints:
            allowed = set(c.allowed_type_strs)
            if c.type_param_str in used and "tensor(float16)" in allowed and "tensor(bfloat16)" not in allowed:
                blocked.add(op)
    return blocked


def to_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The bf16 model of fp32 `model` (see the module's docstring); `model` is not changed."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    blocked = sorted(set(DEFAULT_OP_BLOCK_LIST) | without_bf16(model))
    half = convert_float_to_float16(model, keep_io_types=False, op_block_list=blocked)
    _drop_repeats(half.graph)
    _retype(half.graph)
    _proto.sort_nodes(half.graph)  # the converter appends some of its Casts at the end
    return half


def retyped(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of fp16 `model` with every fp16 tensor bf16 (values rounded to nearest even)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _retype(out.graph)
    return out


def _drop_repeats(g: onnx.GraphProto) -> None:
    """Drop second copies of a node. The converter gives each blocked node a Cast of its inputs to fp32, named
    after the input: two blocked nodes reading one tensor (Llama's Cos and Sin of one angle) get the same
    Cast twice, which breaks single assignment."""
    seen, keep = set(), []
    for n in g.node:
        key = n.SerializeToString(deterministic=True)
        if key not in seen:
            seen.add(key)
            keep.append(n)
    if len(keep) < len(g.node):
        del g.node[:]
        g.node.extend(keep)


def _bf16_tensor(t: TensorProto) -> TensorProto:
    import ml_dtypes
    a = numpy_helper.to_array(t).astype(np.float32).astype(ml_dtypes.bfloat16)
    out = TensorProto(name=t.name, data_type=BF16, dims=t.dims, raw_data=a.view(np.uint16).tobytes())
    return out


def _retype(g: onnx.GraphProto) -> None:
    for v in [*g.input, *g.output, *g.value_info]:
        if v.type.tensor_type.elem_type == F16:
            v.type.tensor_type.elem_type = BF16
    for t in g.initializer:
        if t.data_type == F16:
            t.CopyFrom(_bf16_tensor(t))
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == F16:
                a.i = BF16
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F16:
                a.t.CopyFrom(_bf16_tensor(a.t))
            elif a.type == onnx.AttributeProto.GRAPH:
                _retype(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    _retype(sub)

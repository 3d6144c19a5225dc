"""bfloat16 models on ORT's CPU EP, which has bf16 kernels for few ops (Cast, not Add or MatMul): the model's
fp32 shadow, which computes every op in fp32 and rounds each bf16 tensor to bf16 as it is produced (a Cast to
bf16 and back). Its values are the bf16 model's, op by op, as the CUDA EP computes them (each op in fp32 and
its output stored in bf16); every value the shadow holds where the model has bf16 is a bf16 value, so it
converts back exactly. `ortfuse check` runs it where the model computes in bf16 and the EP is the CPU's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.errors import InputError
from ortfuse.rewriter import _proto

BF16, FLOAT = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
# Ops whose outputs are some of their inputs' values (moved, selected, negated): bf16 values in, bf16 out, so
# the shadow needs no rounding after them.
EXACT = frozenset({
    "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice", "Gather",
    "GatherElements", "GatherND", "Expand", "Tile", "Where", "Pad", "DepthToSpace", "SpaceToDepth", "ScatterND",
    "ScatterElements", "Max", "Min", "Neg", "Abs", "Relu", "ReduceMax", "ReduceMin", "MaxPool", "Dropout",
})
# Attributes that name an element type (Cast's target, the generators' dtype)
_TYPE_ATTRS = frozenset({"to", "dtype"})


def computes_in_bf16(model: onnx.ModelProto) -> bool:
    """Whether any tensor of `model` is bfloat16: a graph input, output, initializer or typed value, a Cast's
    target, a constant, inside subgraphs and model-local functions too."""
    g = model.graph
    typed = [*g.input, *g.output, *g.value_info]
    if any(v.type.tensor_type.elem_type == BF16 for v in typed) or any(t.data_type == BF16 for t in g.initializer):
        return True
    nodes = [*_proto.deep_nodes(g.node), *(n for f in model.functions for n in _proto.deep_nodes(f.node))]
    return any(_bf16_attr(a) for n in nodes for a in n.attribute)


def _bf16_attr(a: onnx.AttributeProto) -> bool:
    return (a.name in _TYPE_ATTRS and a.type == onnx.AttributeProto.INT and a.i == BF16) or \
        (a.type == onnx.AttributeProto.TENSOR and a.t.data_type == BF16)


def _fp32_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


@dataclass(frozen=True)
class Shadow:
    """`model`'s fp32 shadow; `bf16`: the names of the tensors that are bfloat16 in the original (the shadow
    holds them as fp32 with bf16 values)."""
    model: onnx.ModelProto
    bf16: frozenset[str]
    rounded: bool = True

    def feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The original's inputs for the shadow: bf16 arrays as fp32 (exact)."""
        return {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in feeds.items()}

    def restored(self, name: str, value: np.ndarray) -> np.ndarray:
        """A shadow value as the original's dtype (exact where rounded: it holds a bf16 value); unrounded, the
        fp32 value itself."""
        import ml_dtypes
        return value.astype(ml_dtypes.bfloat16) if name in self.bf16 and self.rounded else value


def shadow(model: onnx.ModelProto, dtypes: Mapping[str, int], label: str = "model", rounded: bool = True) -> Shadow:
    """The fp32 shadow of `model` (no model-local functions: inline them first). `dtypes`: the element type of
    every tensor the graph's nodes produce (type inference's). The weights are converted, so the shadow holds
    fp32 copies of the bf16 ones. `rounded=False`: no rounding at all, the model's computation in fp32 (its
    bf16 constants, weights and inputs as they are), the reference a bf16 result is an approximation of."""
    if model.functions:
        raise ValueError("shadow() takes a model whose local functions are inlined")
    g = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for a in n.attribute):
        raise InputError(f"{label}: a bfloat16 model with If/Loop/Scan bodies: ORT's CPU EP cannot run it and "
                         "the CPU's fp32 reference does not convert subgraphs; check it on a GPU (--provider cuda)")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    og = out.graph
    bf16 = {v.name for v in [*g.input, *g.output, *g.value_info] if v.type.tensor_type.elem_type == BF16}
    bf16 |= {t.name for t in g.initializer if t.data_type == BF16}
    bf16 |= {name for name, dt in dtypes.items() if dt == BF16}
    for v in [*og.input, *og.output, *og.value_info]:
        if v.type.tensor_type.elem_type == BF16:
            v.type.tensor_type.elem_type = FLOAT
    for i, t in enumerate(og.initializer):
        if t.data_type == BF16:
            og.initializer[i].CopyFrom(_fp32_tensor(t))
    taken = {t for n in g.node for t in (*n.input, *n.output)} | {v.name for v in g.input}
    nodes: list[onnx.NodeProto] = []
    for n in og.node:
        for a in n.attribute:
            if a.name in _TYPE_ATTRS and a.type == onnx.AttributeProto.INT and a.i == BF16:
                a.i = FLOAT
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == BF16:
                a.t.CopyFrom(_fp32_tensor(a.t))
        nodes.append(n)
        if not rounded or (n.op_type in EXACT and n.domain in ("", "ai.onnx")):
            continue
        for k, o in enumerate(n.output):
            if o and o in bf16:  # computed in fp32: round it to bf16, under its own name
                raw = _fresh(f"{o}__fp32", taken)
                mid = _fresh(f"{o}__bf16", taken)
                n.output[k] = raw
                nodes += [onnx.helper.make_node("Cast", [raw], [mid], to=BF16, name=_fresh(f"{mid}_round", taken)),
                          onnx.helper.make_node("Cast", [mid], [o], to=FLOAT, name=_fresh(f"{o}_widen", taken))]
    del og.node[:]
    og.node.extend(nodes)
    return Shadow(out, frozenset(bf16), rounded)


def _fresh(name: str, taken: set[str]) -> str:
    k, out = 0, name
    while out in taken:
        k += 1
        out = f"{name}_{k}"
    taken.add(out)
    return out

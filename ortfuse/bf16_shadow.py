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

BF16, F16, FLOAT = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
# Ops whose outputs are some of their inputs' values (moved, selected, negated): bf16 values in, bf16 out, so
# the shadow needs no rounding after them. (Rounding a bf16 value again changes nothing: a missing op costs two
# Casts, a wrong one a wrong reference.)
EXACT = frozenset({
    "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice", "Gather",
    "GatherElements", "GatherND", "Expand", "Tile", "Where", "Pad", "DepthToSpace", "SpaceToDepth", "ScatterND",
    "ScatterElements", "Max", "Min", "Neg", "Abs", "Relu", "ReduceMax", "ReduceMin", "MaxPool", "Dropout",
})
# The default-domain attributes that name an element type, by op (ONNX's schemas: every INT attribute named
# for a type). Not BitCast's `to` (a reinterpretation of bits has no fp32 shadow), not stash_type (a compute
# precision, fp32 already), not other domains' attributes.
_TYPE_ATTRS = {
    "Cast": "to", "EyeLike": "dtype", "Bernoulli": "dtype", "Multinomial": "dtype", "RandomNormal": "dtype",
    "RandomNormalLike": "dtype", "RandomUniform": "dtype", "RandomUniformLike": "dtype",
    "SequenceEmpty": "dtype", "DequantizeLinear": "output_dtype", "BlackmanWindow": "output_datatype",
    "HammingWindow": "output_datatype", "HannWindow": "output_datatype", "MelWeightMatrix": "output_datatype",
}


def computes_in_bf16(model: onnx.ModelProto) -> bool:
    """Whether any tensor of `model` is bfloat16: a graph input, output, initializer or typed value, a Cast's
    target, a constant, inside subgraphs and model-local functions too."""
    g = model.graph
    typed = [*g.input, *g.output, *g.value_info]
    if any(v.type.tensor_type.elem_type == BF16 for v in typed) or any(t.data_type == BF16 for t in g.initializer):
        return True
    nodes = [*_proto.deep_nodes(g.node), *(n for f in model.functions for n in _proto.deep_nodes(f.node))]
    return any(_type_attr(n, a, (BF16,)) or _tensor_attr(a, (BF16,)) or
               (n.op_type == "BitCast" and a.name == "to" and a.i == BF16) for n in nodes for a in n.attribute)


def _default_domain(n: onnx.NodeProto) -> bool:
    return n.domain in ("", "ai.onnx")


def _type_attr(n: onnx.NodeProto, a: onnx.AttributeProto, types: tuple[int, ...]) -> bool:
    """Whether `a` is an element-type attribute of `n` naming one of `types`."""
    return _default_domain(n) and _TYPE_ATTRS.get(n.op_type) == a.name and a.type == onnx.AttributeProto.INT \
        and a.i in types


def _tensor_attr(a: onnx.AttributeProto, types: tuple[int, ...]) -> bool:
    return a.type == onnx.AttributeProto.TENSOR and a.t.data_type in types


def _moves_values(n: onnx.NodeProto) -> bool:
    """Whether every output value of `n` is one of its input values (EXACT): not a Scatter that adds or
    multiplies, not a Dropout told whether it trains (in training it scales)."""
    if not _default_domain(n) or n.op_type not in EXACT:
        return False
    if n.op_type in ("ScatterND", "ScatterElements"):
        return all(a.s in (b"", b"none", b"max", b"min") for a in n.attribute if a.name == "reduction")
    return n.op_type != "Dropout" or len([t for t in n.input[2:] if t]) == 0


def _fp32_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


@dataclass(frozen=True)
class Shadow:
    """`model`'s fp32 shadow; `bf16`: the names of the tensors that are bfloat16 (or another of `types`) in the
    original (the shadow holds them as fp32, with bf16 values where `rounded`)."""
    model: onnx.ModelProto
    bf16: frozenset[str]
    rounded: bool = True
    types: tuple[int, ...] = (BF16,)

    def feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The original's inputs for the shadow: arrays of the shadowed types as fp32 (exact)."""
        return {k: v.astype(np.float32) if onnx.helper.np_dtype_to_tensor_dtype(v.dtype) in self.types else v
                for k, v in feeds.items()}

    def restored(self, name: str, value: np.ndarray) -> np.ndarray:
        """A shadow value as the original's dtype (exact where rounded: it holds a bf16 value); unrounded, the
        fp32 value itself."""
        import ml_dtypes
        return value.astype(ml_dtypes.bfloat16) if name in self.bf16 and self.rounded else value


def shadow(model: onnx.ModelProto, dtypes: Mapping[str, int], label: str = "model", rounded: bool = True,
           types: tuple[int, ...] = (BF16,)) -> Shadow:
    """The fp32 shadow of `model` (no model-local functions: inline them first). `dtypes`: the element type of
    every tensor the graph's nodes produce (type inference's; unused unrounded: pass {}). The weights are
    converted, so the shadow holds fp32 copies of the bf16 ones. `rounded=False`: no rounding at all, the
    model's computation in fp32 (its bf16 constants, weights and inputs as they are), the reference a bf16
    result is an approximation of; then `types` may add fp16, for a half-precision model computed in fp32."""
    if model.functions:
        raise ValueError("shadow() takes a model whose local functions are inlined")
    if rounded and types != (BF16,):
        raise ValueError("shadow() rounds to bf16 only")
    g = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for a in n.attribute):
        raise InputError(f"{label}: If/Loop/Scan bodies, which the fp32 shadow of a bfloat16 model does not convert")
    bitcast = next((n for n in g.node if n.op_type == "BitCast" and _default_domain(n)), None)
    if bitcast is not None:
        raise InputError(f"{label}: node '{bitcast.name}' (BitCast) reinterprets bits, which the fp32 shadow of a "
                         "bfloat16 model cannot")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    og = out.graph
    half = {v.name for v in [*g.input, *g.output, *g.value_info] if v.type.tensor_type.elem_type in types}
    half |= {t.name for t in g.initializer if t.data_type in types}
    half |= {name for name, dt in dtypes.items() if dt in types}
    for v in [*og.input, *og.output, *og.value_info]:
        if v.type.tensor_type.elem_type in types:
            v.type.tensor_type.elem_type = FLOAT
    for i, t in enumerate(og.initializer):
        if t.data_type in types:
            og.initializer[i].CopyFrom(_fp32_tensor(t))
    taken = {t for n in g.node for t in (*n.input, *n.output)} | {v.name for v in g.input}
    nodes: list[onnx.NodeProto] = []
    for n in og.node:
        for a in n.attribute:
            if _type_attr(n, a, types):
                a.i = FLOAT
            elif _tensor_attr(a, types):
                a.t.CopyFrom(_fp32_tensor(a.t))
        nodes.append(n)
        if not rounded or _moves_values(n):
            continue
        for k, o in enumerate(n.output):
            if o and o in half:  # computed in fp32: round it to bf16, under its own name
                raw = _fresh(f"{o}__fp32", taken)
                mid = _fresh(f"{o}__bf16", taken)
                n.output[k] = raw
                nodes += [onnx.helper.make_node("Cast", [raw], [mid], to=BF16, name=_fresh(f"{mid}_round", taken)),
                          onnx.helper.make_node("Cast", [mid], [o], to=FLOAT, name=_fresh(f"{o}_widen", taken))]
    del og.node[:]
    og.node.extend(nodes)
    return Shadow(out, frozenset(half), rounded, tuple(types))


def _fresh(name: str, taken: set[str]) -> str:
    k, out = 0, name
    while out in taken:
        k += 1
        out = f"{name}_{k}"
    taken.add(out)
    return out

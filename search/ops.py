"""What ortfuse knows about each ONNX op: which class of fusion it can join, and which of its inputs
are element data (kernel arguments) versus shape/axes metadata (constant, folded into index math)."""
from __future__ import annotations

from onnx import TensorProto as TP

ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Erf", "Tanh", "Sigmoid", "Relu", "Exp",
    "Log", "Neg", "Abs", "Cast", "Where", "Clip", "Min", "Max", "Gelu", "LeakyRelu", "Elu",
    "HardSigmoid", "HardSwish", "Softplus", "Mish", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign",
    "Identity", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "DequantizeLinear", "QuantizeLinear",
})
# Reductions over the innermost axis, with the row-wise composites exporters and ORT use (InstanceNormalization
# of a [N, C, L] tensor: GroupNorm as torch exports it, between Reshapes to [N, groups, -1] and back).
REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1",
                        "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "Softmax", "LogSoftmax", "LayerNormalization",
                        "InstanceNormalization"})
# Compute-bound anchors: one per region, with element-wise prologue/epilogue ops around it. A Conv runs as
# an implicit GEMM (search.conv).
GEMM = frozenset({"MatMul", "Gemm"})
CONV = frozenset({"Conv"})
ANCHORS = GEMM | CONV
# Index ops: Gather reads its data input at positions given by its (integer) indices, evaluated in the
# kernel; Range is an iota computed from the element's coordinate (its length comes from the region's dims);
# Concat reads the input whose span along the axis holds the coordinate; a unit-step Slice reads its input
# at the coordinate plus its start; a Resize reads its input at the pixel its coordinate maps to (nearest), or
# blends the four around it (bilinear): `search.resize`; a Pad reads its input at the coordinate less the leading
# pad, or gives the fill outside it (`search.pad`).
INDEXING = frozenset({"Gather", "Range", "Concat", "Slice", "Resize", "Pad"})
MAX_CONCAT_INPUTS = 4  # a fused Concat evaluates every input at each element and selects one
# Pure data movement: folded into the index math of the ops around them.
LAYOUT = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Flatten"})
# Layout ops ORT runs without a kernel (it aliases the buffer): fusing them saves no traffic.
FREE_IN_ORT = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})

# The reductions whose axes are input 1 (opset 18 on; ReduceSum from 13).
AXES_INPUT_REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceProd",
                         "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp")

# Input positions that carry shapes or axes, not element data.
META_INPUTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}), **{op: frozenset({1}) for op in AXES_INPUT_REDUCTIONS},
    "Range": frozenset({0, 1, 2}),  # start and delta become literals; limit only sets the length
    "Slice": frozenset({1, 2, 3, 4}),  # starts fold into the index; ends only set the length
    "Resize": frozenset({1, 2, 3}),  # roi, scales, sizes: constants folded into the index math
    "Pad": frozenset({1, 2, 3}),  # pads, constant_value, axes: constants folded into the index math
}

# Inputs that ORT's CUDA kernels read from host memory (KernelDefBuilder's OrtMemTypeCPUInput, checked in ORT's
# providers/cuda sources): a Shape-derived tensor there does not pull the node onto the CPU
# (`legal.host_tensors`). Range is not one: its CUDA kernel copies start, limit and delta from the device.
CUDA_HOST_INPUTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Squeeze": frozenset({1}), "Unsqueeze": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}), "Resize": frozenset({1, 2, 3}), "Upsample": frozenset({1}),
    "Pad": frozenset({1, 2}), "ConstantOfShape": frozenset({0}), "Tile": frozenset({1}), "CumSum": frozenset({1}),
    **{op: frozenset({1}) for op in AXES_INPUT_REDUCTIONS},
}

# Ops whose data element types (input 0) ORT's CUDA EP has no kernel for: it hands such a node to the CPU EP,
# copies its result to the device on every run, and a session with it cannot capture CUDA graphs. A
# DequantizeLinear of int32 data: the bias quantize_static writes for every Conv and Gemm (ORT's CUDA
# registrations are int8, uint8, int4 and float8 data: providers/cuda/tensor/quantize_linear.cc). Seen on an
# H200 (2026-11-29): stock ORT refused CUDA graphs on the zoo's quantized BERT and ResNet-50.
CPU_EP_ONLY: dict[str, frozenset[int]] = {"DequantizeLinear": frozenset({TP.INT32})}

# Window ops: each output pixel reads a window of its input, like a depthwise Conv (`search.pool`).
WINDOW = frozenset({"MaxPool", "AveragePool"})


def kind_of(op_type: str) -> str | None:
    if op_type in ELEMENTWISE:
        return "elementwise"
    if op_type in WINDOW:
        return "window"
    if op_type in REDUCTIONS:
        return "reduction"
    if op_type in LAYOUT:
        return "layout"
    if op_type in INDEXING:
        return "indexing"
    if op_type in ANCHORS:
        return "gemm"
    return None


def data_inputs(node) -> list[tuple[int, str]]:
    """(position, tensor) of the inputs that are element data."""
    meta = META_INPUTS.get(node.op_type, frozenset())
    return [(i, t) for i, t in enumerate(node.input) if t and i not in meta]


def meta_inputs(node) -> list[str]:
    meta = META_INPUTS.get(node.op_type, frozenset())
    return [t for i, t in enumerate(node.input) if t and i in meta]

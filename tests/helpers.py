"""Small model builders shared by the tests (ir_version set on every model)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def model(nodes, inputs, outputs, inits=(), opset: int = 18) -> onnx.ModelProto:
    g = helper.make_graph(list(nodes), "t", list(inputs), list(outputs), list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    # outputs declared without a shape get the inferred one (the checker wants a shape field)
    inferred = onnx.shape_inference.infer_shapes(m)
    for out, inf in zip(m.graph.output, inferred.graph.output):
        if not out.type.tensor_type.HasField("shape"):
            out.type.CopyFrom(inf.type)
    return m


def vi(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def node(op: str, inputs, outputs, **attrs) -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op}_{'_'.join(outputs)}", **attrs)


def bf16(x) -> tuple[np.ndarray, np.ndarray]:
    """fp32 -> (bf16 bit patterns as uint16, round to nearest even; the fp32 values they hold)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def fused_parity(m: onnx.ModelProto, shapes, check_shapes, kinds, tf32: bool = False):
    """Optimize `m` for sm_80 and sm_90, assert the region kinds, and check every kernel in CPU emulation
    against ORT CPU on the original model (random non-zero inputs). Returns the OptimizeResult."""
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options

    res = compile_model(m, shapes, "sm_80,sm_90", options=Options(archs=(80, 90), tf32=tf32))
    got = sorted(r.kind for r in res.plan.regions)
    assert got == sorted(kinds), (got, [str(r) for r in res.plan.refusals])
    for ck in (k.compiled for k in res.kernels):
        assert [cc for cc, _ in ck.cubins] == [80, 90]
    rep = check_models(m, res.model, emulate=True, input_shapes=check_shapes)
    assert rep.ok, "\n".join(rep.lines())
    assert len(rep.kernels) == len(res.kernels)
    return res


def _rand(shape, dtype: int, seed: int, scale: float = 0.2) -> np.ndarray:
    arr = np.random.default_rng(seed).standard_normal(shape) * scale
    return arr.astype(helper.tensor_dtype_to_np_dtype(dtype))


def _out_hw(hw: int, k: int, s: int, pads: tuple[int, int], d: int) -> int:
    return (hw + pads[0] + pads[1] - d * (k - 1) - 1) // s + 1


def conv_silu_residual(dt, c, oc, k, s, pads, d, hw, bias=True):
    """Conv (+ bias) + residual add + SiLU (x * sigmoid(x)): ORT runs four kernels, we run one."""
    oh, ow = _out_hw(hw, k, s, (pads[0], pads[2]), d), _out_hw(hw, k, s, (pads[1], pads[3]), d)
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    w, b = _rand((oc, c, k, k), dt, 1), _rand((oc,), dt, 2)
    inits = [const("w", w, w.dtype)] + ([const("b", b, b.dtype)] if bias else [])
    m = model([node("Conv", inputs, ["y"], kernel_shape=[k, k], strides=[s, s], pads=list(pads), dilations=[d, d]),
               node("Add", ["y", "r"], ["z"]), node("Sigmoid", ["z"], ["sg"]), node("Mul", ["z", "sg"], ["out"])],
              [vi("x", dt, ["n", c, hw, hw]), vi("r", dt, ["n", oc, oh, ow])], [vi("out", dt, None)], inits)
    return m, {"x": ("n", c, hw, hw), "r": ("n", oc, oh, ow)}, lambda n: {"x": (n, c, hw, hw), "r": (n, oc, oh, ow)}

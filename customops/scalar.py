"""Per-element semantics of the element-wise ONNX ops, as kernel-IR expressions.

Floats compute in fp32 (half types are widened on load and narrowed on store); integers and bools in
their own C type. Each rule gets the node, its already-evaluated inputs (None for an absent optional
input) and the ONNX storage type of its output, and returns one expression."""
from __future__ import annotations

import math
import struct
from typing import Callable, Optional, Sequence

import onnx

from ortfuse.customops import ir
from ortfuse.customops.ir import F32, Const, Expr, Op
# re-exported: scalar.attr, attr_str and transpose_perm serve the lowerers
from ortfuse.rewriter.attrs import attr, attr_str, transpose_perm  # noqa: F401

# ONNX element type -> IR storage type. Anything else is left to ORT.
STORAGE = {
    onnx.TensorProto.FLOAT: "f32", onnx.TensorProto.FLOAT16: "f16", onnx.TensorProto.BFLOAT16: "bf16",
    onnx.TensorProto.INT64: "i64", onnx.TensorProto.INT32: "i32", onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.UINT8: "u8", onnx.TensorProto.INT8: "i8",
}
FLOAT_STORAGE = ("f32", "f16", "bf16")


class UnsupportedOp(Exception):
    """The op (or this use of it) has no element-wise lowering; the message says why."""


def f32(v: float) -> Const:
    return Const(float(v), F32)


def _op(fn: str, *args: Expr, ctype: Optional[str] = None) -> Expr:
    return Op(fn, tuple(args), ctype or args[0].ctype)


def _as(e: Expr, ctype: str) -> Expr:
    if e.ctype == ctype:
        return e
    if isinstance(e, Const):
        v = e.value
        return Const(bool(v) if ctype == "bool" else float(v) if ctype == F32 else int(v), ctype)
    if ctype == "bool":
        return _op("ne", e, Const(0, e.ctype) if e.ctype != F32 else f32(0), ctype="bool")
    return Op("cast", (e,), ctype)


def _float_or_int(fn_float: str, fn_int: str) -> Callable[[Sequence[Expr]], Expr]:
    def build(a: Sequence[Expr]) -> Expr:
        return _op(fn_float if a[0].ctype == F32 else fn_int, *a)
    return build


def _binary(fn: str):
    return lambda n, a, out: _op(fn, a[0], _as(a[1], a[0].ctype))


def _div(n, a, out):
    """x / c for a constant c with a normal fp32 reciprocal is x * (1 / c): within about an ulp of fp32 (the
    fused chain keeps fp32 where ORT rounds every fp16 op), where IEEE division is a ~10-instruction
    sequence with a slow path on the GPU (exported GELUs divide by sqrt(2) in every GEMM epilogue)."""
    x, d = a[0], _as(a[1], a[0].ctype)
    if x.ctype == F32 and isinstance(d, Const) and d.value != 0 and math.isfinite(d.value):
        r = 1.0 / float(d.value)
        if 1.1754944e-38 <= abs(r) <= 3.4028234e38:  # a normal fp32 number
            return _op("mul", x, f32(struct.unpack("<f", struct.pack("<f", r))[0]))
    return exact_div(x, d)


_RN = {"add": "add_rn", "sub": "sub_rn", "mul": "mul_rn"}


def uncontracted(e: Expr) -> Expr:
    """`e` with its fp32 sums, differences and products each rounded once (`*_rn`: never contracted into an FMA),
    down to the values other nodes computed (bound variables): as ORT's ops compute them one by one."""
    if not isinstance(e, Op):
        return e
    args = tuple(uncontracted(x) for x in e.args)
    fn = _RN.get(e.fn, e.fn) if e.ctype == F32 else e.fn
    return Op(fn, args, e.ctype)


def exact_div(x: Expr, d: Expr) -> Expr:
    return _op("div", x, _as(d, x.ctype))


def _compare(fn: str):
    return lambda n, a, out: _op(fn, a[0], _as(a[1], a[0].ctype), ctype="bool")


def _unary_float(fn: str):
    def build(n, a, out):
        if a[0].ctype != F32:
            raise UnsupportedOp(f"{n.op_type} on integers")
        return _op(fn, a[0])
    return build


def _pow(n, a, out):
    x, y = a
    if x.ctype != F32:
        raise UnsupportedOp("Pow on integers")
    if isinstance(y, Const):
        e = float(y.value)
        if e == 1.0:
            return x
        if e == 2.0:
            return _op("mul", x, x)
        if e == 3.0:
            return _op("mul", _op("mul", x, x), x)
        if e == 0.5:
            return _op("sqrt", x)
        if e == -1.0:
            return _op("div", f32(1), x)
    return _op("pow", x, _as(y, F32))


def _variadic(fn_float: str, fn_int: str):
    def build(n, a, out):
        acc = a[0]
        for b in a[1:]:
            acc = _op(fn_float if acc.ctype == F32 else fn_int, acc, _as(b, acc.ctype))
        return acc
    return build


def _clip(n, a, out):
    x = a[0]
    lo = a[1] if len(a) > 1 else None
    hi = a[2] if len(a) > 2 else None
    if lo is None and attr(n, "min") is not None:
        lo = f32(attr(n, "min"))
    if hi is None and attr(n, "max") is not None:
        hi = f32(attr(n, "max"))
    fmax, fmin = ("fmax_nan", "fmin_nan") if x.ctype == F32 else ("max", "min")
    if lo is not None:
        x = _op(fmax, x, _as(lo, x.ctype))
    if hi is not None:
        x = _op(fmin, x, _as(hi, x.ctype))
    return x


def _cast(n, a, out):
    x = a[0]
    target = STORAGE.get(attr(n, "to"))
    if target is None:
        raise UnsupportedOp(f"Cast to element type {attr(n, 'to')}")
    if target in ("f16", "bf16"):
        return round_to(target, _as(x, F32))
    return _as(x, target)


def round_to(storage: str, e: Expr) -> Expr:
    """fp32 `e` rounded to half-precision `storage` (once: rounding twice the same way is a no-op)."""
    fn = f"round_{storage}"
    return e if isinstance(e, Op) and e.fn == fn else _op(fn, e)


def _gelu(n, a, out):
    x = a[0]
    if attr(n, "approximate", "none") in ("tanh", b"tanh"):
        inner = _op("mul", f32(math.sqrt(2.0 / math.pi)),
                    _op("add", x, _op("mul", f32(0.044715), _op("mul", _op("mul", x, x), x))))
        return _op("mul", _op("mul", f32(0.5), x), _op("add", f32(1), _op("tanh", inner)))
    return _op("mul", _op("mul", f32(0.5), x), _op("add", f32(1), _op("erf", _op("mul", x, f32(math.sqrt(0.5))))))


def _sigmoid(x: Expr) -> Expr:
    """1 / (1 + e^-x) with the GPU's fast reciprocal (within 2 ulp of fp32; 0 once e^-x passes 2^126, where
    the quotient is under 2^-126): IEEE division's slow-path check is a per-element branch, which serialized
    a GEMM epilogue's elements on the H200 (Target.epilogue_branch_clocks). The divisor is at least 1, so
    the denormal divisors that rule the fast reciprocal out elsewhere never occur."""
    return _op("recip_fast", _op("add", f32(1), _op("exp", _op("neg", x))))


def _hard_sigmoid(x: Expr, alpha: float, beta: float) -> Expr:
    return _op("fmax_nan", f32(0), _op("fmin_nan", f32(1), _op("add", _op("mul", f32(alpha), x), f32(beta))))


def _softplus(x: Expr) -> Expr:
    """log(1 + e^x) as max(x, 0) + log1p(e^-|x|): exp never overflows (log1p(exp(x)) is inf above 88)."""
    return _op("add", _op("fmax", x, f32(0)), _op("log1p", _op("exp", _op("neg", _op("abs", x)))))


def _neg(n, a, out):
    return _op("neg", a[0])


def _abs(n, a, out):
    return _op("abs" if a[0].ctype == F32 else "iabs", a[0])


def _dequantize(n, a, out):
    """(x - zero_point) * scale as ORT computes it: the difference in int32, converted to fp32 (exact for 8-bit
    inputs), one rounded product that is never contracted into an FMA with what reads it (a step-exact value
    for a QuantizeLinear downstream, as ORT's). A per-axis scale is read at the axis's coordinate
    (`lower.per_axis_index`)."""
    v = _as(a[0], "i32")
    if len(a) > 2:
        v = _op("sub", v, _as(a[2], "i32"))
    return _op("mul_rn", _as(v, F32), _as(a[1], F32))


QUANTIZERS = ("DequantizeLinear", "QuantizeLinear")
QUANTIZED_RANGE = {"i8": (-128, 127), "u8": (0, 255)}


def _quantize(n, a, out):
    """saturate(rint(x / scale) + zero_point) as ORT's CUDA kernel computes it (`ofz::quantize8`), into the 8-bit
    output type."""
    lo, hi = QUANTIZED_RANGE[out]
    zp = _as(a[2], "i32") if len(a) > 2 else Const(0, "i32")
    q = Op("quantize8", (_as(a[0], F32), _as(a[1], F32), zp, Const(lo, "i32"), Const(hi, "i32")), "i32")
    return _as(q, out)


def _where(n, a, out):
    c, x, y = a
    ct = x.ctype if x.ctype == y.ctype else F32
    return _op("select", _as(c, "bool"), _as(x, ct), _as(y, ct), ctype=ct)


RULES: dict[str, Callable[[onnx.NodeProto, list, str], Expr]] = {
    "Add": _binary("add"), "Sub": _binary("sub"), "Mul": _binary("mul"),
    "Div": _div, "Pow": _pow,
    "Sqrt": _unary_float("sqrt"), "Exp": _unary_float("exp"), "Log": _unary_float("log"),
    "Erf": _unary_float("erf"), "Tanh": _unary_float("tanh"), "Sin": _unary_float("sin"),
    "Cos": _unary_float("cos"), "Floor": _unary_float("floor"), "Ceil": _unary_float("ceil"),
    "Round": _unary_float("round"),
    "Reciprocal": lambda n, a, out: _op("div", f32(1), a[0]),
    "Sigmoid": lambda n, a, out: _sigmoid(a[0]),
    "Relu": lambda n, a, out: _op("fmax_nan", a[0], f32(0)) if a[0].ctype == F32 else _op("max", a[0], Const(0, a[0].ctype)),
    "LeakyRelu": lambda n, a, out: _op("select", _op("ge", a[0], f32(0), ctype="bool"), a[0],
                                       _op("mul", f32(attr(n, "alpha", 0.01)), a[0])),
    "Elu": lambda n, a, out: _op("select", _op("ge", a[0], f32(0), ctype="bool"), a[0],
                                 _op("mul", f32(attr(n, "alpha", 1.0)), _op("sub", _op("exp", a[0]), f32(1)))),
    "HardSigmoid": lambda n, a, out: _hard_sigmoid(a[0], attr(n, "alpha", 0.2), attr(n, "beta", 0.5)),
    "HardSwish": lambda n, a, out: _op("mul", a[0], _hard_sigmoid(a[0], 1.0 / 6.0, 0.5)),
    "Softplus": lambda n, a, out: _softplus(a[0]),
    "Mish": lambda n, a, out: _op("mul", a[0], _op("tanh", _softplus(a[0]))),
    "Neg": _neg, "Abs": _abs, "Identity": lambda n, a, out: a[0],
    "Sign": lambda n, a, out: _op("sub", _as(_op("gt", a[0], Const(0, a[0].ctype) if a[0].ctype != F32 else f32(0), ctype="bool"), a[0].ctype),
                                  _as(_op("lt", a[0], Const(0, a[0].ctype) if a[0].ctype != F32 else f32(0), ctype="bool"), a[0].ctype)),
    "Cast": _cast, "Where": _where, "Clip": _clip, "Gelu": _gelu,
    "Min": _variadic("fmin_nan", "min"), "Max": _variadic("fmax_nan", "max"),
    "Equal": _compare("eq"), "Less": _compare("lt"), "Greater": _compare("gt"),
    "LessOrEqual": _compare("le"), "GreaterOrEqual": _compare("ge"),
    "Not": lambda n, a, out: _op("not", _as(a[0], "bool")),
    "And": lambda n, a, out: _op("and", _as(a[0], "bool"), _as(a[1], "bool")),
    "Or": lambda n, a, out: _op("or", _as(a[0], "bool"), _as(a[1], "bool")),
    "Xor": lambda n, a, out: _op("xor", _as(a[0], "bool"), _as(a[1], "bool")),
    "IsNaN": lambda n, a, out: _op("isnan", a[0], ctype="bool"),
    "DequantizeLinear": _dequantize, "QuantizeLinear": _quantize,
}


STEP_OPS = frozenset({"Floor", "Ceil", "Round", "Sign", "QuantizeLinear", "Equal", "Less", "Greater", "LessOrEqual",
                      "GreaterOrEqual"})


def sees_stored(node: onnx.NodeProto) -> bool:
    """Whether the op must see its inputs rounded to the tensors' storage type (`lower.as_stored`), where
    the fused kernel otherwise keeps the fp32 value a half-precision tensor would round: a step op, where
    an ulp can move the output by a step, and a Cast, whose fp32 (or integer) result must be the stored
    value's (mixed-precision exports upcast fp16 tensors before LayerNorm or Softmax)."""
    return node.op_type in STEP_OPS or node.op_type == "Cast"


def apply(node: onnx.NodeProto, args: list[Optional[Expr]], out_storage: str) -> Expr:
    """The element value of `node`'s output, converted to the output's compute type."""
    rule = RULES.get(node.op_type)
    if rule is None:
        raise UnsupportedOp(f"{node.op_type} has no element-wise lowering")
    if node.op_type != "Clip":  # Clip's optional min/max keep their positions
        args = [a for a in args if a is not None]
    return _as(rule(node, args, out_storage), ir.compute_type(out_storage))

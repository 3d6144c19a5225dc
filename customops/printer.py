"""Prints a `customops.ir.Kernel` as CUDA C. Deterministic: the same kernel prints the same source,
so generated kernels can be golden-tested and content-addressed."""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import Callable

from ortfuse.customops import ir

# f32p: a GEMM row-wise epilogue's row buffer, scratch and slots, disjoint
C_TYPE = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16", "i64": "ofz_i64", "i32": "int",
          "bool": "bool", "u8": "unsigned char", "i8": "signed char", "f32p": "float* __restrict__"}
REDUCE_OP = {"sum": "ofz::SumOp", "max": "ofz::MaxOp", "min": "ofz::MinOp"}


def _f32(args: list[str]) -> str:
    return args[0]


# fn -> printer of the already-printed arguments. Float functions are the fp32 CUDA math library.
FN: dict[str, Callable[[list[str]], str]] = {
    "add": lambda a: f"({a[0]} + {a[1]})",
    "sub": lambda a: f"({a[0]} - {a[1]})",
    "mul": lambda a: f"({a[0]} * {a[1]})",
    "div": lambda a: f"({a[0]} / {a[1]})",
    # fp32 only, never contracted into an FMA: a product or sum rounded once, as ORT's op rounds it
    "mul_rn": lambda a: f"__fmul_rn({a[0]}, {a[1]})",
    "add_rn": lambda a: f"__fadd_rn({a[0]}, {a[1]})",
    "sub_rn": lambda a: f"__fsub_rn({a[0]}, {a[1]})",
    "quantize8": lambda a: f"ofz::quantize8({a[0]}, {a[1]}, {a[2]}, {a[3]}, {a[4]})",  # scalar._quantize
    "recip_fast": lambda a: f"__fdividef(1.0f, {a[0]})",  # fp32 only: MUFU.RCP, within 2 ulp, no branch
    "mod": lambda a: f"({a[0]} % {a[1]})",
    "fmod": lambda a: f"fmodf({a[0]}, {a[1]})",
    "neg": lambda a: f"(-{a[0]})",
    "min": lambda a: f"min({a[0]}, {a[1]})",
    "max": lambda a: f"max({a[0]}, {a[1]})",
    "fmin": lambda a: f"fminf({a[0]}, {a[1]})",
    "fmax": lambda a: f"fmaxf({a[0]}, {a[1]})",
    "fmax_nan": lambda a: f"ofz::fmax_nan({a[0]}, {a[1]})",
    "fmin_nan": lambda a: f"ofz::fmin_nan({a[0]}, {a[1]})",
    "fma": lambda a: f"fmaf({a[0]}, {a[1]}, {a[2]})",
    "lt": lambda a: f"({a[0]} < {a[1]})",
    "le": lambda a: f"({a[0]} <= {a[1]})",
    "gt": lambda a: f"({a[0]} > {a[1]})",
    "ge": lambda a: f"({a[0]} >= {a[1]})",
    "eq": lambda a: f"({a[0]} == {a[1]})",
    "ne": lambda a: f"({a[0]} != {a[1]})",
    "and": lambda a: f"({a[0]} && {a[1]})",
    "or": lambda a: f"({a[0]} || {a[1]})",
    "xor": lambda a: f"({a[0]} != {a[1]})",
    "not": lambda a: f"(!{a[0]})",
    "select": lambda a: f"({a[0]} ? {a[1]} : {a[2]})",
    "abs": lambda a: f"fabsf({a[0]})",
    "iabs": lambda a: f"({a[0]} < 0 ? -{a[0]} : {a[0]})",
    "exp": lambda a: f"expf({a[0]})",
    "log": lambda a: f"logf({a[0]})",
    "sqrt": lambda a: f"sqrtf({a[0]})",
    "rsqrt": lambda a: f"rsqrtf({a[0]})",
    "pow": lambda a: f"powf({a[0]}, {a[1]})",
    "erf": lambda a: f"erff({a[0]})",
    "tanh": lambda a: f"tanhf({a[0]})",
    "sin": lambda a: f"sinf({a[0]})",
    "cos": lambda a: f"cosf({a[0]})",
    "floor": lambda a: f"floorf({a[0]})",
    "ceil": lambda a: f"ceilf({a[0]})",
    "round": lambda a: f"rintf({a[0]})",
    "log1p": lambda a: f"log1pf({a[0]})",
    "isnan": lambda a: f"isnan({a[0]})",
    "isinf": lambda a: f"isinf({a[0]})",
    "thread_idx": lambda a: "((ofz_i64)threadIdx.x)",
    "block_idx": lambda a: "((ofz_i64)blockIdx.x)",
    "grid_dim": lambda a: "((ofz_i64)gridDim.x)",
    "round_f16": lambda a: f"ofz::round_f16({a[0]})",
    "round_bf16": lambda a: f"ofz::round_bf16({a[0]})",
    "rowbuf": lambda a: f"ofz_row[{a[0]}]",  # GEMM row-wise epilogue: the fp32 row buffer (ortfuse_gemm.h)
    # a row split across a cluster: every block's partial of a row reduction (slot, RSPLIT, BM), combined
    # from the block's gathered copy (ortfuse_gemm.h)
    **{f"xrow_{k}": (lambda op: lambda a: f"ofz::gemm::row_combine<{op}, {a[1]}, {a[2]}>(ofz_slots, {a[0]})")(op)
       for k, op in REDUCE_OP.items()},
    "attn_dims": lambda a: f"ofz::attn::Dims{{{a[0]}, {a[1]}, {a[2]}, {a[3]}}}",
    "tma_maps": lambda a: "(&ofz_tma)",  # a TMA kernel's tensor maps (its second parameter)
}


def _literal(c: ir.Const) -> str:
    v = c.value
    if c.ctype == "bool":
        return "true" if v else "false"
    if c.ctype == "f32":
        f = float(v)
        if math.isnan(f) or math.isinf(f):
            bits = struct.unpack("<I", struct.pack("<f", f))[0]
            return f"ofz::f32_bits(0x{bits:08x}u)"
        text = repr(float(struct.unpack("<f", struct.pack("<f", f))[0]))
        return f"{text}f" if ("e" in text or "." in text) else f"{text}.0f"
    if c.ctype == "i64":
        return f"{int(v)}LL"
    return f"(({C_TYPE[c.ctype]}){int(v)})"


def expr(e: ir.Expr) -> str:
    if isinstance(e, ir.Const):
        return _literal(e)
    if isinstance(e, ir.Var):
        return e.name
    if isinstance(e, ir.Load):
        return _convert_in(f"t{e.arg}[{expr(e.offset)}]", e.storage)
    if isinstance(e, ir.Lane):
        return _convert_in(f"{e.vec}[{e.lane}]", e.storage)
    if e.fn == "cast":
        return f"(({C_TYPE[e.ctype]}){expr(e.args[0])})"
    return FN[e.fn]([expr(a) for a in e.args])


def _convert_in(text: str, storage: str) -> str:
    return f"ofz::to_f32({text})" if storage in ("f16", "bf16") else text


def _convert_out(text: str, storage: str) -> str:
    if storage in ("f16", "bf16"):
        return f"ofz::from_f32<{C_TYPE[storage]}>({text})"
    return f"(({C_TYPE[storage]}){text})"


def _stmt(s: ir.Stmt, ind: str, out: list[str]) -> None:
    if isinstance(s, ir.Let):
        out.append(f"{ind}const {C_TYPE[s.var.ctype]} {s.var.name} = {expr(s.value)};")
    elif isinstance(s, ir.Decl):
        out.append(f"{ind}{C_TYPE[s.var.ctype]} {s.var.name} = {expr(s.init)};")
    elif isinstance(s, ir.Assign):
        out.append(f"{ind}{s.var.name} = {expr(s.value)};")
    elif isinstance(s, ir.For):
        v = s.var.name
        if s.unroll:
            out.append(f"{ind}#pragma unroll {s.unroll}")
        out.append(f"{ind}for (ofz_i64 {v} = {expr(s.start)}; {v} < {expr(s.stop)}; {v} += {expr(s.step)}) {{")
        for b in s.body:
            _stmt(b, ind + "  ", out)
        out.append(f"{ind}}}")
    elif isinstance(s, ir.If):
        out.append(f"{ind}if ({expr(s.cond)}) {{")
        for b in s.body:
            _stmt(b, ind + "  ", out)
        out.append(f"{ind}}}")
    elif isinstance(s, ir.VecLoad) and s.guard is not None:  # an argument that may be empty: read under the guard
        out.append(f"{ind}{C_TYPE[s.storage]} {s.name}[{s.width}];")
        out.append(f"{ind}ofz::load_arg_if<{s.width}>({expr(s.guard)}, t{s.arg} + {expr(s.offset)}, {s.name});")
    elif isinstance(s, ir.VecLoad):
        out.append(f"{ind}{C_TYPE[s.storage]} {s.name}[{s.width}];")
        out.append(f"{ind}ofz::load_arg<{s.width}>(t{s.arg} + {expr(s.offset)}, {s.name});")
    elif isinstance(s, ir.Store):
        out.append(f"{ind}t{s.arg}[{expr(s.offset)}] = {_convert_out(expr(s.value), s.storage)};")
    elif isinstance(s, ir.VecStore):
        vals = ", ".join(_convert_out(expr(v), s.storage) for v in s.values)
        out.append(f"{ind}{{ const {C_TYPE[s.storage]} o_[{len(s.values)}] = {{{vals}}};")
        out.append(f"{ind}  ofz::store_vec<{len(s.values)}>(t{s.arg} + {expr(s.offset)}, o_); }}")
    elif isinstance(s, ir.RowReduce):
        out.append(f"{ind}{s.var.name} = ofz::row_reduce<{REDUCE_OP[s.op]}, {s.tpr}>({s.var.name}, ofz_scratch);")
    elif isinstance(s, ir.RowPut):
        out.append(f"{ind}{s.buffer}[{expr(s.offset)}] = {expr(s.value)};")
    elif isinstance(s, ir.Comment):
        out.append(f"{ind}// {s.text}")
    elif isinstance(s, ir.Call):
        targs = ", ".join(s.targs)
        args = "".join(f", {expr(x)}" for x in s.args)
        out.append(f"{ind}{s.fn}<{targs}>(a{args});")
    else:  # pragma: no cover - the IR is closed
        raise TypeError(f"unknown statement {s!r}")


def _prelude(k: ir.Kernel, ind: str, out: list[str]) -> None:
    """Typed tensor pointers t<k> and runtime dims d<k> from the argument struct `a`."""
    for p in k.params:
        qual = "" if p.is_output else "const "
        out.append(f"{ind}{qual}{C_TYPE[p.storage]}* __restrict__ t{p.arg} = ({qual}{C_TYPE[p.storage]}*)a.ptr[{p.arg}];")
    for d in range(k.num_dims):
        out.append(f"{ind}const ofz_i64 d{d} = a.dim[{d}];")


def _ops_struct(k: ir.Kernel, out: list[str]) -> None:
    out.append(f"struct {k.name}_ops {{")
    out += [f"  static constexpr int {name} = {value};" for name, value in k.ops_consts]
    nested: dict[str, list[ir.Func]] = {}
    for f in k.funcs:
        nested.setdefault(f.name.split(".")[0] if "." in f.name else "", []).append(f)
    for group, funcs in nested.items():
        ind = "  "
        if group:
            out.append(f"  struct {group} {{")
            ind = "    "
        for f in funcs:
            ret = C_TYPE[f.result.ctype] if f.result is not None else "void"
            params = "".join(f", {C_TYPE[v.ctype]} {v.name}" for v in f.params)
            name = f.name.split(".")[-1]
            out.append(f"{ind}static __device__ __forceinline__ {ret} {name}(const OfzArgs& a{params}) {{")
            _prelude(k, ind + "  ", out)
            for s in ir.live(f.body, f.result):
                _stmt(s, ind + "  ", out)
            if f.result is not None:
                out.append(f"{ind}  return {expr(f.result)};")
            out.append(f"{ind}}}")
        if group:
            out.append("  };")
    out.append("};")
    out.append("")


# First line of a kernel built for the arch-specific target (sm_90a): compile.py reads it.
ARCH_SPECIFIC_LINE = "// ortfuse: arch-specific (sm_90a) kernel"


def render(k: ir.Kernel) -> str:
    """CUDA source of the kernel, including the shared header and the emulation entry."""
    out = ([ARCH_SPECIFIC_LINE] if k.arch_specific else []) + [
        '#include "ortfuse_kernel.h"', *[f'#include "{h}"' for h in k.headers], ""]
    if k.funcs:
        _ops_struct(k, out)
        ops = f"{k.name}_ops"
        k = dataclasses.replace(k, body=tuple(
            ir.Call(s.fn, tuple(ops + t[3:] if t.startswith("OPS") else t for t in s.targs), s.args)
            if isinstance(s, ir.Call) else s for s in k.body))
    params = "const OfzArgs a" + (", const __grid_constant__ OfzTma ofz_tma" if k.tma else "")
    bounds = f"{k.block}, {k.min_blocks}" if k.min_blocks else f"{k.block}"
    out.append(f'extern "C" __global__ void __launch_bounds__({bounds}) {k.name}({params}) {{')
    if k.pdl:
        out.extend(f"  ofz::prefetch_l2_share(a.ptr[{arg}], {size}LL);" for arg, size in k.prefetch)
        out.append("  ofz::grid_dependency_sync();")
    _prelude(k, "  ", out)
    if k.scratch_floats:
        out.append(f"  __shared__ float ofz_scratch[{k.scratch_floats}];")
    for s in ir.live(k.body):
        _stmt(s, "  ", out)
    out.append("}")
    out.append(f"OFZ_EMU_ENTRY{'_TMA' if k.tma else ''}({k.name})")
    return "\n".join(out) + "\n"

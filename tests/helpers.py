"""Small model builders shared by the tests (ir_version set on every model)."""
from __future__ import annotations

import functools
from typing import Sequence

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


def flattened(s, heads: int = 0) -> onnx.ModelProto:
    """SiLU of a sequence-first [s, n, 8] fp32 tensor (or [s, n, heads, 8]), transposed and flattened to
    [n * s (* heads), 8], as torch's MultiheadAttention flattens its output: a product of run-time dims."""
    inner = [heads, 8] if heads else [8]
    return model([node("Sigmoid", ["x"], ["g"]), node("Mul", ["x", "g"], ["y"]),
                  node("Transpose", ["y"], ["t"], perm=[1, 0, *range(2, 2 + len(inner))]),
                  node("Reshape", ["t", "flat"], ["z"])],
                 [vi("x", onnx.TensorProto.FLOAT, [s, "n", *inner])], [vi("z", onnx.TensorProto.FLOAT, None)],
                 [const("flat", [-1, 8], np.int64)])


def bf16(x) -> tuple[np.ndarray, np.ndarray]:
    """fp32 -> (bf16 bit patterns as uint16, round to nearest even; the fp32 values they hold)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def raw_init(name: str, bits: np.ndarray, dtype: int) -> onnx.TensorProto:
    """An initializer of ONNX element type `dtype` holding `bits` as they are (bf16 patterns as uint16)."""
    return helper.make_tensor(name, dtype, bits.shape, bits.tobytes(), raw=True)


def rounded_operands(shapes, dtype: int, seed: int, scale: float = 0.3) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random operands of `shapes` in `dtype` (fp32, fp16 or bf16): (storage bits, their values in fp64), so
    a reference computed in fp64 sees exactly what the kernel reads."""
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        a = rng.standard_normal(s).astype(np.float32) * scale
        if dtype == onnx.TensorProto.BFLOAT16:
            bits, vals = bf16(a)
        else:
            bits = a.astype(np.float16) if dtype == onnx.TensorProto.FLOAT16 else a
            vals = bits
        out.append((bits, np.asarray(vals, np.float64)))
    return out


def fused_parity(m: onnx.ModelProto, shapes, check_shapes, kinds, tf32: bool = False, dim_hints=(), **options):
    """Optimize `m` for sm_80 and sm_90 (`dim_hints`: `--dim-hint` pairs; `options`: more `Options` fields),
    assert the region kinds, and check every kernel in CPU emulation against ORT CPU on the original model
    (random non-zero inputs). Returns the OptimizeResult."""
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options

    res = compile_model(m, shapes, "sm_80,sm_90", options=Options(archs=(80, 90), tf32=tf32,
                                                                  dim_hints=tuple(dim_hints), **options))
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


def packed_attention(dt, heads: int, head: int, select: str = "split", kv_out: bool = False,
                     mask: bool = True) -> onnx.ModelProto:
    """Self-attention reading Q, K and V from one packed projection x [B, S, 3*H*D], as GPT-2's c_attn
    (and BERT after QKV packing) feed it: `select` is "split" (one Split) or "slice" (three Slices).
    Heads reshaped and transposed, Kᵀ by Transpose(0,2,3,1), scores scaled and masked by a [B,1,1,S]
    padding mask (`mask` False: none, as ViT's). `kv_out`: K also returned (a KV cache), so the Split cannot
    be absorbed."""
    hd = heads * head
    if select == "split":
        nodes = [node("Split", ["x", "sizes"], ["xq", "xk", "xv"], axis=2)]
        inits = [const("sizes", [hd, hd, hd], np.int64)]
    else:
        nodes = [node("Slice", ["x", f"start{i}", f"end{i}", "ax"], [t]) for i, t in enumerate(("xq", "xk", "xv"))]
        inits = [c for i in range(3) for c in (const(f"start{i}", [i * hd], np.int64),
                                               const(f"end{i}", [(i + 1) * hd], np.int64))]
        inits.append(const("ax", [-1], np.int64))
    nodes += [
        node("Reshape", ["xq", "shp4"], ["q4"]), node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
        node("Reshape", ["xk", "shp4"], ["k4"]), node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        node("Reshape", ["xv", "shp4"], ["v4"]), node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
        node("MatMul", ["qh", "kt"], ["s0"]), node("Div", ["s0", "scale"], ["s1"]),
        node("Add", ["s1", "mask"], ["s2"]), node("Softmax", ["s2"], ["p"], axis=-1),
        node("MatMul", ["p", "vh"], ["o"]), node("Transpose", ["o"], ["o4"], perm=[0, 2, 1, 3]),
        node("Reshape", ["o4", "shp3"], ["y"]),
    ]
    npdt = helper.tensor_dtype_to_np_dtype(dt)
    inits += [const("shp4", [0, 0, heads, head], np.int64), const("shp3", [0, 0, hd], np.int64),
              const("scale", np.sqrt(head), npdt)]
    inputs = [vi("x", dt, ["batch", "seq", 3 * hd]), vi("mask", dt, ["batch", 1, 1, "seq"])]
    if not mask:
        nodes = [n for n in nodes if n.op_type != "Add"]
        nodes[[n.op_type for n in nodes].index("Softmax")].input[0] = "s1"
        inputs = inputs[:1]
    outputs = [vi("y", dt, None)] + ([vi("xk", dt, None)] if kv_out else [])
    return model(nodes, inputs, outputs, inits)


def conv_chain(dt, c, oc, s, k2=1, hw=("h", "w"), residual=True, also_out=False):
    """MobileNet's inverted-residual tail: depthwise 3x3 (stride s) + ReLU6 -> k2 x k2 Conv to oc channels
    (+ the block's input when shapes allow)."""
    nodes = [node("Conv", ["x", "dw", "db"], ["d"], group=c, kernel_shape=[3, 3], strides=[s, s], pads=[1] * 4),
             node("Clip", ["d", "lo", "hi"], ["a"]),
             node("Conv", ["a", "pw", "pb"], ["y"], kernel_shape=[k2, k2], pads=[k2 // 2] * 4)]
    npdt = helper.tensor_dtype_to_np_dtype(dt)
    inits = [const("dw", _rand((c, 1, 3, 3), dt, 1, 0.3), npdt), const("db", _rand(c, dt, 2), npdt),
             const("lo", 0.0, npdt), const("hi", 6.0, npdt),
             const("pw", _rand((oc, c, k2, k2), dt, 3, 0.3), npdt), const("pb", _rand(oc, dt, 4), npdt)]
    outs = ["y"]
    if residual and s == 1 and oc == c:
        nodes.append(node("Add", ["y", "x"], ["z"]))
        outs = ["z"]
    if also_out:
        outs.append("a")
    return model(nodes, [vi("x", dt, ["n", c, *hw])], [vi(o, dt, None) for o in outs], inits)


def launch_spec(spec, arrays, dims, sms: int = 0, lowest_first: bool = False) -> None:
    """Run a lowered kernel (customops.lower's KernelSpec) in CPU emulation with the grid and cluster the
    native library would launch on an sm_90 device (or one of `sms` SMs) for these dims (`lowest_first`:
    EmulatedModule.launch's thread order)."""
    import math

    from ortfuse.customops.attrs import launch_blocks
    from ortfuse.customops.emulate import compile_emulated
    from ortfuse.customops.printer import render
    from ortfuse.customops.target import parse_arch
    units = math.prod(t if t >= 0 else dims[-t - 1] for t in spec.units)
    for terms, div in spec.units_ceil:
        units *= -(-math.prod(t if t >= 0 else dims[-t - 1] for t in terms) // div)
    grid = -(-units // spec.units_per_block)
    blocks, cluster = launch_blocks(grid, spec.split_k, spec.blocks_per_sm, sms or parse_arch("sm_90").sm_count,
                                    spec.row_cluster, spec.multicast)
    compile_emulated(render(spec.kernel)).launch(spec.kernel.name, blocks, spec.block, arrays, dims, spec.smem,
                                                 cluster, spec.arg_align, tma=spec.tma, lowest_first=lowest_first)


def assert_cuda_graph_replay(optimized, feeds, want, runs: int = 3) -> None:
    """`optimized` through ortfuse on the CUDA EP with CUDA graphs: inputs and outputs bound to device buffers
    (a graph replays its captured addresses), the first run captures, the others replay; every run's
    outputs against `want` (output name -> expected array)."""
    import onnxruntime as ort

    import ortfuse
    from ortfuse.check import compare
    sess = ortfuse.InferenceSession(optimized, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    assert sess.fused_kernels
    io = sess.io_binding()
    for k, v in feeds.items():
        io.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
    outs = {k: ort.OrtValue.ortvalue_from_shape_and_type(r.shape, r.dtype, "cuda", 0) for k, r in want.items()}
    for k, v in outs.items():
        io.bind_ortvalue_output(k, v)
    for _ in range(runs):
        sess.run_with_iobinding(io)
        for k, r in want.items():
            assert compare(k, outs[k].numpy(), r).ok, k


def sass_or_skip():
    """bench/sass.py's `sass` (cuobjdump's instructions of a cubin), or the test skipped where the developer
    tool is not installed (CI)."""
    import pytest
    try:
        from ortfuse.bench.sass import cuobjdump, sass
        cuobjdump()
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"no cuobjdump (a developer tool): {err}")
    return sass


def rotary(dt: int = onnx.TensorProto.FLOAT, seq_slice: bool = False) -> onnx.ModelProto:
    """Rotary embedding as TorchScript exports Llama's `q * cos + rotate_half(q) * sin` after the heads'
    transpose: rotate_half slices at `x.shape[-1] // 2`, computed through Shape, Gather, Div, Cast and
    Unsqueeze. `seq_slice` adds an output sliced along the sequence at a run-time end read from a symbolic dim."""
    np_dt = np.float16 if dt == onnx.TensorProto.FLOAT16 else np.float32
    nodes = [node("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]), node("Shape", ["t"], ["s"]),
             node("Gather", ["s", "i3"], ["d"], axis=0), node("Div", ["d", "two"], ["h"]),
             node("Cast", ["h"], ["hc"], to=onnx.TensorProto.INT64), node("Unsqueeze", ["hc", "ax0"], ["h1"]),
             node("Slice", ["t", "zero", "h1", "last"], ["x1"]), node("Slice", ["t", "h1", "big", "last"], ["x2"]),
             node("Neg", ["x2"], ["n2"]), node("Concat", ["n2", "x1"], ["rot"], axis=-1),
             node("Mul", ["t", "cos"], ["a"]), node("Mul", ["rot", "sin"], ["b"]), node("Add", ["a", "b"], ["y"])]
    inits = [const("i3", 3, np.int64), const("two", 2, np.int64), const("ax0", [0], np.int64),
             const("zero", [0], np.int64), const("big", [2**62], np.int64), const("last", [-1], np.int64)]
    outputs = [vi("y", dt, ["batch", 4, "seq", 32])]
    if seq_slice:
        nodes += [node("Gather", ["s", "i2"], ["n"], axis=0), node("Unsqueeze", ["n", "ax0"], ["n1"]),
                  node("Slice", ["t", "zero", "n1", "two1"], ["z"])]
        inits += [const("i2", 2, np.int64), const("two1", [2], np.int64)]
        outputs.append(vi("z", dt, ["batch", 4, "seq", 32]))
    return model(nodes, [vi("x", dt, ["batch", "seq", 4, 32]), vi("cos", dt, ["seq", 32]), vi("sin", dt, ["seq", 32])],
                 outputs, inits)


def gqa_attention(dt: int, heads: int = 4, kv_heads: int = 2, head: int = 64, runtime_target: bool = True):
    """Grouped-query attention as TorchScript exports Llama's eager attention: q [B, H, S, D] and k, v
    [B, KV, S, D] (inputs), K and V repeated across the query heads by repeat_kv (Unsqueeze, Expand to
    [B, KV, H/KV, S, D], Reshape to [B, H, S, D]), the Expand's target computed at run time from Shape when
    `runtime_target`, scores scaled, an additive mask [B, 1, S, S], Softmax, P @ V."""
    np_dt = np.float16 if dt == onnx.TensorProto.FLOAT16 else np.float32
    rep = heads // kv_heads
    nodes = [node("Shape", ["q"], ["qs"]), node("Gather", ["qs", "i0"], ["b"], axis=0),
             node("Gather", ["qs", "i2"], ["s"], axis=0), node("Unsqueeze", ["b", "ax0"], ["b1"]),
             node("Unsqueeze", ["s", "ax0"], ["s1"])]
    if runtime_target:
        nodes.append(node("Concat", ["b1", "kvn", "repn", "s1", "dn"], ["tgt"], axis=0))
    nodes.append(node("Concat", ["b1", "hn", "s1", "dn"], ["flat"], axis=0))
    for t in ("k", "v"):
        nodes += [node("Unsqueeze", [t, "ax2"], [f"{t}5"]),
                  node("Expand", [f"{t}5", "tgt" if runtime_target else "tgtc"], [f"{t}e"]),
                  node("Reshape", [f"{t}e", "flat"], [f"{t}r"])]
    nodes += [node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["qk"]),
              node("Mul", ["qk", "scale"], ["sc"]), node("Add", ["sc", "mask"], ["sm"]),
              node("Softmax", ["sm"], ["p"], axis=-1), node("MatMul", ["p", "vr"], ["o"])]
    inits = [const("i0", 0, np.int64), const("i2", 2, np.int64), const("ax0", [0], np.int64),
             const("ax2", [2], np.int64), const("kvn", [kv_heads], np.int64), const("repn", [rep], np.int64),
             const("hn", [heads], np.int64), const("dn", [head], np.int64), const("scale", head ** -0.5, np_dt),
             const("tgtc", [1, 1, rep, 1, 1], np.int64)]
    return model(nodes, [vi("q", dt, ["batch", heads, "seq", head]), vi("k", dt, ["batch", kv_heads, "seq", head]),
                         vi("v", dt, ["batch", kv_heads, "seq", head]), vi("mask", dt, ["batch", 1, "seq", "seq"])],
                 [vi("o", dt, ["batch", heads, "seq", head])], inits)


def _rope(x: str, out: str, half: int, swapped: bool = False) -> list[onnx.NodeProto]:
    """out = x * cos + rotate_half(x) * sin (`swapped`: Concat(x1, -x2), which is not rotate_half)."""
    cat = [f"{out}_x1", f"{out}_n2"] if swapped else [f"{out}_n2", f"{out}_x1"]
    return [node("Slice", [x, "zero", f"h{half}", "last"], [f"{out}_x1"]),
            node("Slice", [x, f"h{half}", "big", "last"], [f"{out}_x2"]),
            node("Neg", [f"{out}_x2"], [f"{out}_n2"]), node("Concat", cat, [f"{out}_rot"], axis=-1),
            node("Mul", [x, "cos"], [f"{out}_a"]), node("Mul", [f"{out}_rot", "sin"], [f"{out}_b"]),
            node("Add", [f"{out}_a", f"{out}_b"], [out])]


def rope_attention(dt: int, heads: int = 4, kv_heads: int = 2, head: int = 64, k_out: bool = False,
                    swapped: bool = False, rot: int = 0) -> onnx.ModelProto:
    """Llama's attention from head-split projections: xq [B, S, H, D] and xk [B, S, KV, D] transposed to
    heads-first and rotated (cos, sin [1, 1, S, D]), K (and V) repeated across the query heads, scaled scores,
    an additive mask, Softmax, P @ V. `k_out`: the rotated K is also an output (a KV cache's present key).
    `rot`: only the first `rot` columns rotated, the rest passed through (GPT-NeoX, Phi-2; cos, sin [.., rot])."""
    np_dt = np.float16 if dt == onnx.TensorProto.FLOAT16 else np.float32
    rep = heads // kv_heads
    r = rot or head
    nodes = [node("Transpose", ["xq"], ["tq"], perm=[0, 2, 1, 3]), node("Transpose", ["xk"], ["tk"], perm=[0, 2, 1, 3])]
    for t in ("q", "k"):
        if not rot:
            nodes += _rope(f"t{t}", t, r // 2, swapped)
            continue
        nodes += [node("Slice", [f"t{t}", "zero", f"h{rot}", "last"], [f"t{t}_rot"]),
                  node("Slice", [f"t{t}", f"h{rot}", "big", "last"], [f"t{t}_pass"]),
                  *_rope(f"t{t}_rot", f"{t}_r", r // 2, swapped),
                  node("Concat", [f"{t}_r", f"t{t}_pass"], [t], axis=-1)]
    for t in ("k", "v"):
        nodes += [node("Unsqueeze", [t, "ax2"], [f"{t}5"]), node("Expand", [f"{t}5", "tgt"], [f"{t}e"]),
                  node("Reshape", [f"{t}e", "flat"], [f"{t}r"])]
    nodes += [node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["qk"]),
              node("Mul", ["qk", "scale"], ["sc"]), node("Add", ["sc", "mask"], ["sm"]),
              node("Softmax", ["sm"], ["p"], axis=-1), node("MatMul", ["p", "vr"], ["o"])]
    inits = [const("zero", [0], np.int64), const(f"h{r // 2}", [r // 2], np.int64), const("big", [2**62], np.int64),
             const("last", [-1], np.int64), const("ax2", [2], np.int64), const("tgt", [1, 1, rep, 1, 1], np.int64),
             const("flat", [0, heads, -1, head], np.int64), const("scale", head ** -0.5, np_dt)]
    outputs = [vi("o", dt, ["batch", heads, "seq", head])] + ([vi("k", dt, ["batch", kv_heads, "seq", head])]
                                                             if k_out else [])
    return model(nodes, [vi("xq", dt, ["batch", "seq", heads, head]), vi("xk", dt, ["batch", "seq", kv_heads, head]),
                         vi("v", dt, ["batch", kv_heads, "seq", head]), vi("cos", dt, [1, 1, "seq", r]),
                         vi("sin", dt, [1, 1, "seq", r]), vi("mask", dt, ["batch", 1, "seq", "seq"])],
                 outputs, inits + ([const(f"h{rot}", [rot], np.int64)] if rot else []))


def rope_shapes(heads: int, kv: int, head: int, b, s, rot: int = 0) -> dict:
    return {"xq": (b, s, heads, head), "xk": (b, s, kv, head), "v": (b, kv, s, head), "cos": (1, 1, s, rot or head),
            "sin": (1, 1, s, rot or head), "mask": (b, 1, s, s)}


def gated_mlp(dt: int, K: int, N: int, rows, seed: int = 3, gelu: bool = False, down: bool = False):
    """x [rows..., K] -> SiLU(x Wg) * (x Wu) (or GELU's tanh form on the gate), then x + h Wd where `down`:
    the model and the (bits, fp64 values) of Wg and of Wu."""
    (wg, wgv), (wu, wuv), (wd, _) = rounded_operands(((K, N), (K, N), (N, K)), dt, seed)
    act = [node("Sigmoid", ["g"], ["sg"]), node("Mul", ["g", "sg"], ["a"])] if not gelu else [
        node("Mul", ["g", "g"], ["g2"]), node("Mul", ["g2", "g"], ["g3"]), node("Mul", ["g3", "c1"], ["t0"]),
        node("Add", ["g", "t0"], ["t1"]), node("Mul", ["t1", "c2"], ["t2"]), node("Tanh", ["t2"], ["t3"]),
        node("Add", ["t3", "one"], ["t4"]), node("Mul", ["g", "t4"], ["t5"]), node("Mul", ["t5", "half"], ["a"])]
    nodes = [node("MatMul", ["x", "wg"], ["g"]), node("MatMul", ["x", "wu"], ["u"]), *act,
             node("Mul", ["a", "u"], ["h"])]
    inits = [raw_init("wg", wg, dt), raw_init("wu", wu, dt)]
    if gelu:
        np_t = np.float16 if dt == onnx.TensorProto.FLOAT16 else np.float32
        inits += [const(n, v, np_t) for n, v in (("c1", 0.044715), ("c2", 0.7978845608), ("one", 1.0), ("half", 0.5))]
    out = "h"
    if down:
        nodes += [node("MatMul", ["h", "wd"], ["d"]), node("Add", ["d", "x"], ["y"])]
        inits.append(raw_init("wd", wd, dt))
        out = "y"
    return model(nodes, [vi("x", dt, [*rows, K])], [vi(out, dt, None)], inits), (wg, wgv), (wu, wuv)


def mix_ffn(dt, back: bool = True, bias: str = "const", c: int = 8, hw: int = 6):
    """SegFormer's Mix-FFN core: tokens x [n, H*W, C] (+ bias) transposed and reshaped to [n, C, H, W], a depthwise
    3x3 Conv, then (`back`) reshaped and transposed back to tokens and a Relu. `bias`: "const" (a GEMM's bias,
    constant) or "input" (a second tensor, read at every tap if recomputed)."""
    rng = np.random.default_rng(0)
    npdt = helper.tensor_dtype_to_np_dtype(dt)
    nodes = [node("Add", ["x", "b"], ["xb"]), node("Transpose", ["xb"], ["t"], perm=[0, 2, 1]),
             node("Reshape", ["t", "img"], ["im"]),
             node("Conv", ["im", "w", "cb"], ["y"], group=c, kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    if back:
        nodes += [node("Reshape", ["y", "flat"], ["f"]), node("Transpose", ["f"], ["ft"], perm=[0, 2, 1]),
                  node("Relu", ["ft"], ["out"])]
    else:
        nodes += [node("Relu", ["y"], ["out"])]
    inputs = [vi("x", dt, ["n", hw * hw, c])] + ([vi("b", dt, ["n", hw * hw, c])] if bias == "input" else [])
    inits = [const("w", rng.standard_normal((c, 1, 3, 3)) * 0.3, npdt),
             const("cb", rng.standard_normal(c) * 0.1, npdt),
             const("img", [0, c, hw, hw], np.int64), const("flat", [0, c, hw * hw], np.int64)]
    if bias == "const":
        inits.append(const("b", rng.standard_normal(c) * 0.1, npdt))
    return model(nodes, inputs, [vi("out", dt, None)], inits)


def nan_guarded(dt, masked: str):
    """packed_attention as torch's scaled_dot_product_attention exports it: the probabilities read through
    Where(IsNaN(p), 0, p), so a query row whose every key is masked with -inf gives 0 where Softmax gives
    NaN. The mask is a constant [2, 1, 1, 37]: batch 1 masked everywhere (`masked`: "-inf" or fp16's / fp32's
    lowest finite value), batch 0 past key 30."""
    head = 64 if dt == onnx.TensorProto.FLOAT16 else 24
    m = packed_attention(dt, 2, head)
    g = m.graph
    npdt = helper.tensor_dtype_to_np_dtype(dt)
    mask = np.zeros((2, 1, 1, 37), npdt)
    mask[0, ..., 30:] = -np.inf
    mask[1] = -np.inf if masked == "-inf" else np.finfo(npdt).min
    for n in g.node:
        if n.op_type == "Softmax":
            n.output[0] = "p_raw"
    at = [i for i, n in enumerate(g.node) if n.op_type == "Softmax"][0] + 1
    for k, n in enumerate([node("IsNaN", ["p_raw"], ["p_nan"]), node("Where", ["p_nan", "zf", "p_raw"], ["p"])]):
        g.node.insert(at + k, n)
    del g.input[1]
    g.initializer.extend([const("mask", mask, npdt), const("zf", 0.0, npdt)])
    return m, 3 * 2 * head


def resized(mode: str, ctm: str, nearest: str, dt: int, scales=None, sizes=None, hw=(5, 7)):
    """Resize(x) + y, x [n, 3, *hw]: by constant `scales`, or constant `sizes` (batch 2)."""
    ins = ["x", "", "sc"] if scales is not None else ["x", "", "", "sz"]
    nodes = [node("Resize", ins, ["r"], mode=mode, coordinate_transformation_mode=ctm, nearest_mode=nearest),
             node("Add", ["r", "y"], ["out"])]
    if scales is not None:
        out_hw = [int(np.floor(d * s)) for d, s in zip(hw, scales[2:])]
        inits, n = [const("sc", scales, np.float32)], "n"
    else:
        out_hw, inits, n = list(sizes[2:]), [const("sz", sizes, np.int64)], 2
    m = model(nodes, [vi("x", dt, [n, 3, *hw]), vi("y", dt, [n, 3, *out_hw])], [vi("out", dt, None)], inits)
    return m, {"x": (2, 3, *hw), "y": (2, 3, *out_hw)} if n == "n" else None


def merged_heads_attention(dt, heads: int = 4, head: int = 16, mask: str = "add"):
    """Attention over batch and heads merged, as BLOOM's and DeBERTa's exports compute it: q, k, v [n, s, H, d]
    transposed to heads-major and reshaped to [n*H, s, d] (targets computed at run time from Shape(q)), bmm
    scores scaled, viewed as [n, H, s, s] for the mask, Softmax, viewed back, bmm with V, and the result viewed
    as [n, H, s, d]. mask "add" (BLOOM's): a per-row ALiBi bias [n*H, 1, s] added before the view, then an
    additive [n, 1, s, s] mask; "where" (DeBERTa's masked_fill): Where(bool mask, lowest, scores), and no
    input has the merged dim n*H (the rebuilt targets take -1 there)."""
    npdt = helper.tensor_dtype_to_np_dtype(dt)
    i64 = np.int64
    nodes = [node("Transpose", [x], [x + "h"], perm=[0, 2, 1, 3]) for x in ("q", "k", "v")]
    nodes += [node("Shape", ["qh"], ["sq"]), node("Gather", ["sq", "i0"], ["n1"]), node("Gather", ["sq", "i2"], ["s1"]),
              node("Mul", ["n1", "hh"], ["nh"]), node("Concat", ["nh", "s1", "dd"], ["t3"], axis=0),
              node("Reshape", ["qh", "t3"], ["q3"]), node("Reshape", ["kh", "t3"], ["k3"]),
              node("Reshape", ["vh", "t3"], ["v3"]), node("Transpose", ["k3"], ["kt"], perm=[0, 2, 1]),
              node("MatMul", ["q3", "kt"], ["sc"]), node("Mul", ["sc", "scale"], ["ss"]),
              node("Concat", ["n1", "hh", "s1", "s1"], ["t4"], axis=0)]
    inputs = [vi(x, dt, ["n", "s", heads, head]) for x in ("q", "k", "v")]
    if mask == "add":
        nodes += [node("Shape", ["bias"], ["sb"]), node("Gather", ["sb", "i3"], ["sb3"]),
                  node("Concat", ["m1", "one", "sb3"], ["tb"], axis=0), node("Reshape", ["bias", "tb"], ["bias3"]),
                  node("Add", ["ss", "bias3"], ["sa"]), node("Reshape", ["sa", "t4"], ["s4"]),
                  node("Add", ["s4", "mask"], ["sm_in"])]
        inputs += [vi("bias", dt, ["n", heads, 1, "s"]), vi("mask", dt, ["n", 1, "s", "s"])]
    else:
        nodes += [node("Reshape", ["ss", "t4"], ["s4"]), node("Where", ["mask", "lowest", "s4"], ["sm_in"])]
        inputs += [vi("mask", onnx.TensorProto.BOOL, ["n", 1, "s", "s"])]
    nodes += [node("Softmax", ["sm_in"], ["p4"], axis=-1), node("Concat", ["nh", "s1", "s1"], ["tp"], axis=0),
              node("Reshape", ["p4", "tp"], ["p3"]), node("MatMul", ["p3", "v3"], ["o3"]),
              node("Concat", ["n1", "hh", "s1", "dd"], ["to"], axis=0), node("Reshape", ["o3", "to"], ["out"])]
    inits = [const("i0", [0], i64), const("i2", [2], i64), const("i3", [3], i64), const("hh", [heads], i64),
             const("dd", [head], i64), const("m1", [-1], i64), const("one", [1], i64),
             const("scale", 1 / np.sqrt(head), npdt), const("lowest", np.finfo(npdt).min, npdt)]
    return model(nodes, inputs, [vi("out", dt, None)], inits)


def convnext_stage(dt: int, c: int = 16, depth: int = 3, hw: int = 7, tail: str = "out") -> onnx.ModelProto:
    """A ConvNeXt stage as transformers exports it: per block a depthwise 7x7 Conv of the NCHW residual stream,
    a Transpose to channels-last, LayerNorm, Linear, erf GELU, Linear, the layer scale, a Transpose back and
    the residual Add. `tail`: "out" (the stream is the output), "ln" (the next stage's LayerNorm through its
    Transposes), "mean" (the classifier's global average pool)."""
    rng = np.random.default_rng(11)
    npdt = helper.tensor_dtype_to_np_dtype(dt)

    def w(name, shape, scale):
        return const(name, rng.standard_normal(shape) * scale, npdt)

    nodes, inits, s = [], [const("sqrt2", np.sqrt(2.0), npdt), const("one", 1.0, npdt),
                           const("half", 0.5, npdt)], "x"
    for k in range(depth):
        p = f"b{k}_"
        inits += [w(p + "dw_w", (c, 1, 7, 7), 0.15), w(p + "dw_b", c, 0.1),
                  const(p + "g", 1 + rng.standard_normal(c) * 0.1, npdt),
                  w(p + "beta", c, 0.1), w(p + "w1", (c, 4 * c), 0.25), w(p + "b1", 4 * c, 0.1),
                  w(p + "w2", (4 * c, c), 0.15), w(p + "b2", c, 0.1), w(p + "gamma", c, 0.5)]
        out = "out" if k == depth - 1 and tail == "out" else p + "s"
        nodes += [node("Conv", [s, p + "dw_w", p + "dw_b"], [p + "dw"], group=c, kernel_shape=[7, 7], pads=[3] * 4),
                  node("Transpose", [p + "dw"], [p + "t"], perm=[0, 2, 3, 1]),
                  node("LayerNormalization", [p + "t", p + "g", p + "beta"], [p + "ln"], axis=-1, epsilon=1e-6),
                  node("MatMul", [p + "ln", p + "w1"], [p + "h"]), node("Add", [p + "h", p + "b1"], [p + "hb"]),
                  node("Div", [p + "hb", "sqrt2"], [p + "d"]), node("Erf", [p + "d"], [p + "e"]),
                  node("Add", [p + "e", "one"], [p + "e1"]), node("Mul", [p + "hb", p + "e1"], [p + "m"]),
                  node("Mul", [p + "m", "half"], [p + "gelu"]),
                  node("MatMul", [p + "gelu", p + "w2"], [p + "o"]), node("Add", [p + "o", p + "b2"], [p + "ob"]),
                  node("Mul", [p + "ob", p + "gamma"], [p + "os"]),
                  node("Transpose", [p + "os"], [p + "back"], perm=[0, 3, 1, 2]),
                  node("Add", [s, p + "back"], [out])]
        s = out
    if tail == "ln":
        inits += [w("n_g", c, 0.1), w("n_b", c, 0.1)]
        nodes += [node("Transpose", [s], ["nt"], perm=[0, 2, 3, 1]),
                  node("LayerNormalization", ["nt", "n_g", "n_b"], ["nln"], axis=-1, epsilon=1e-6),
                  node("Transpose", ["nln"], ["out"], perm=[0, 3, 1, 2])]
    elif tail == "mean":
        inits.append(const("axes", [2, 3], np.int64))
        nodes.append(node("ReduceMean", [s, "axes"], ["out"], keepdims=0))
    return model(nodes, [vi("x", dt, ["n", c, hw, hw])], [vi("out", dt, None)], inits)


def short_rows(dt: int, hidden: int) -> onnx.ModelProto:
    """A residual add, then the LayerNorm and the Softmax of its rows, added: one row kernel over rows of
    `hidden` columns (['n', 5, hidden] inputs y and r)."""
    np_dt = helper.tensor_dtype_to_np_dtype(dt)
    rng = np.random.default_rng(hidden)
    inits = {"g": rng.standard_normal(hidden) * 0.5 + 1.0, "beta": rng.standard_normal(hidden) * 0.2}
    return model([node("Add", ["y", "r"], ["s"]),
                  node("LayerNormalization", ["s", "g", "beta"], ["ln"], axis=-1, epsilon=1e-5),
                  node("Softmax", ["s"], ["p"], axis=-1), node("Add", ["ln", "p"], ["out"])],
                 [vi("y", dt, ["n", 5, hidden]), vi("r", dt, ["n", 5, hidden])], [vi("out", dt, None)],
                 [const(k, v, np_dt) for k, v in inits.items()])


def plain_attention(dt, heads=3, head=8, mask="full", scale="div", kt="one", softmax_fp32=False, q_scaled=False,
                    out="merged", proj=False, factor=None, head_v=None, kv="seq", mask_after="") -> onnx.ModelProto:
    """Attention on three projections q [B, S, heads*head], k [B, KV, heads*head], v [B, KV, heads*head_v] as
    exporters write it (`kv`: the keys' dim name, "seq" for self-attention). `mask`: "none", "full"
    [B, 1, S, KV], "rank2" [S, KV], "heads" [heads, S, KV], "rows" [B, 1, 1, KV] (broadcast over query rows),
    "wide" (an fp32 mask added to scores cast to fp32 in a 16-bit model); `scale`: "div", "mul" or "none", by
    `factor` (default 1/sqrt(head)); `mask_after`: "scale" (a Mul by 0.5 after the mask), "mask" (a second
    mask); `kt`: Kᵀ by one Transpose(0,2,3,1) or "two" (0,2,1,3 then 0,1,3,2); `softmax_fp32`: scores cast
    to fp32 around the Softmax; `q_scaled`: Q scaled by a scalar after its Transpose; `out`: "merged"
    (Transpose back + Reshape) or "heads" (P·V is the model's output); `proj`: q, k, v projected from one
    input x [B, S, heads*head] by MatMuls, Q's and K's with a bias Add (V's without; self-attention)."""
    hd, head_v = heads * head, head_v or head
    npdt = helper.tensor_dtype_to_np_dtype(dt)
    nodes = [node("Reshape", ["q", "shp4"], ["q4"]),
             node("Transpose", ["q4"], ["qh0" if q_scaled else "qh"], perm=[0, 2, 1, 3]),
             node("Reshape", ["k", "shp4"], ["k4"]), node("Reshape", ["v", "shp4v"], ["v4"]),
             node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3])]
    if q_scaled:
        nodes.append(node("Mul", ["qh0", "qscale"], ["qh"]))
    if kt == "one":
        nodes.append(node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]))
    else:
        nodes += [node("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3]),
                  node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2])]
    nodes.append(node("MatMul", ["qh", "kt"], ["s0"]))
    s = "s0"
    if scale != "none":
        nodes.append(node("Div" if scale == "div" else "Mul", [s, "scale"], ["s1"]))
        s = "s1"
    inputs = [vi("q", dt, ["batch", "seq", hd]), vi("k", dt, ["batch", kv, hd]), vi("v", dt, ["batch", kv, heads * head_v])]
    inits = []
    if proj:
        rng = np.random.default_rng(7)
        inputs = [vi("x", dt, ["batch", "seq", hd])]
        for t in "qkv":
            inits.append(const(f"w{t}", rng.standard_normal((hd, hd)) * 0.3, npdt))
            nodes.insert(0, node("MatMul", ["x", f"w{t}"], [f"{t}m" if t != "v" else "v"]))
            if t != "v":
                inits.append(const(f"b{t}", rng.standard_normal(hd) * 0.5, npdt))
                nodes.insert(1, node("Add", [f"{t}m", f"b{t}"], [t]))
    if mask == "wide":
        nodes.append(node("Cast", [s], ["sw"], to=onnx.TensorProto.FLOAT))
        inputs.append(vi("mask", onnx.TensorProto.FLOAT, ["batch", 1, "seq", kv]))
        nodes += [node("Add", ["sw", "mask"], ["s2"]), node("Softmax", ["s2"], ["p0"], axis=-1),
                  node("Cast", ["p0"], ["p"], to=dt)]
    else:
        if mask != "none":
            shape = {"full": ["batch", 1, "seq", kv], "rank2": ["seq", kv], "heads": [heads, "seq", kv],
                     "rows": ["batch", 1, 1, kv]}[mask]
            inputs.append(vi("mask", dt, shape))
            nodes.append(node("Add", [s, "mask"], ["s2"]))
            s = "s2"
        if mask_after == "scale":
            nodes.append(node("Mul", [s, "half"], ["s4"]))
            s = "s4"
        elif mask_after == "mask":
            inputs.append(vi("mask2", dt, ["batch", 1, "seq", kv]))
            nodes.append(node("Add", [s, "mask2"], ["s4"]))
            s = "s4"
        if softmax_fp32:
            nodes += [node("Cast", [s], ["s3"], to=onnx.TensorProto.FLOAT), node("Softmax", ["s3"], ["p0"], axis=-1),
                      node("Cast", ["p0"], ["p"], to=dt)]
        else:
            nodes.append(node("Softmax", [s], ["p"], axis=-1))
    nodes.append(node("MatMul", ["p", "vh"], ["o"]))
    if out == "merged":
        nodes += [node("Transpose", ["o"], ["o4"], perm=[0, 2, 1, 3]), node("Reshape", ["o4", "shp3"], ["y"])]
        outputs = [vi("y", dt, ["batch", "seq", heads * head_v])]
    else:
        outputs = [vi("o", dt, ["batch", heads, "seq", head_v])]
    if factor is None:
        factor = 1 / np.sqrt(head)
    value = 1 / factor if scale == "div" else factor
    inits += [const("shp4", [0, 0, heads, head], np.int64), const("shp4v", [0, 0, heads, head_v], np.int64),
              const("shp3", [0, 0, heads * head_v], np.int64), const("scale", value, npdt),
              const("qscale", 0.7, npdt), const("half", 0.5, npdt)]
    return model(nodes, inputs, outputs, inits)


def wrong_gelu(src, dst, out) -> None:
    """Optimize `src` to `dst` (unless there), then write to `out` a copy whose fused GELU's function body
    computes Tanh where its kernel computes Erf: `check --emulate` must fail on it."""
    from pathlib import Path

    from ortfuse.cli import main
    if not Path(dst).exists():
        main(["optimize", str(src), str(dst)])
    m = onnx.load(str(dst))
    f = next(f for f in m.functions if any(n.op_type == "Erf" for n in f.node))
    for n in f.node:
        if n.op_type == "Erf":
            n.op_type = "Tanh"
    onnx.save(m, str(out))


def norm_reductions(dt: int) -> onnx.ModelProto:
    """Row reductions beyond the sums (opset 18, axes from a Constant node): F.normalize's x / max(||x||, eps),
    a sum of squares sharing ReduceL2's, ReduceL1, ReduceLogSum of |x| and ReduceLogSumExp, over x [r, 50]."""
    npd = helper.tensor_dtype_to_np_dtype(dt)
    ax = helper.make_node("Constant", [], ["ax"], value=numpy_helper.from_array(np.array([-1], np.int64)))
    return model([ax, node("ReduceL2", ["x", "ax"], ["n2"], keepdims=1), node("Max", ["n2", "eps"], ["nc"]),
                  node("Div", ["x", "nc"], ["y"]), node("ReduceSumSquare", ["x", "ax"], ["ss"], keepdims=0),
                  node("ReduceL1", ["x", "ax"], ["l1"], keepdims=0), node("Abs", ["x"], ["ab"]),
                  node("ReduceLogSum", ["ab", "ax"], ["ls"], keepdims=0),
                  node("ReduceLogSumExp", ["x", "ax"], ["lse"], keepdims=0), node("Add", ["ss", "l1"], ["a"]),
                  node("Add", ["ls", "lse"], ["b"]), node("Sub", ["a", "b"], ["z"])],
                 [vi("x", dt, ["r", 50])], [vi("y", dt, None), vi("z", dt, None)], [const("eps", 1e-6, npd)],
                 opset=18)


def onnx_attention(dt: int, form: str = "", heads: int = 4, kv_heads: int = 4, head: int = 16,
                   mask_value=None, opset: int = 23) -> onnx.ModelProto:
    """One ONNX Attention node (opset 23) over graph inputs q, k, v [batch, H, seq, D] ("3d" in `form`:
    [batch, seq, H·D]). `form` words: "bool" / "float" a mask input m [batch, 1, seq, keys] ("const": a constant
    [2, 1, 5, keys] instead (with "static": batch 2), row 2 of batch 1 all hidden: False, or `mask_value` for a
    float mask); "causal";
    "past" (past_key/past_value inputs [batch, Hkv, past, D], present outputs; keys = "past + seq");
    "cross" (keys and values over their own length "kv"); "scale" (0.3); "cap" (softcap 2); "static" (seq 5,
    past 3, kv 7: is_causal is split only over static lengths); "decode" (with "static past": one query, two
    new keys)."""
    three = "3d" in form
    keys = "past + seq" if "past" in form else "kv" if "cross" in form else "seq"
    new_kv = "kv" if "cross" in form else "seq"
    if "static" in form:  # seq 5, past 3, kv 7 ("decode": one query after a past of 3, two new keys)
        keys, new_kv = {"past + seq": 8, "kv": 7, "seq": 5}[keys], {"kv": 7, "seq": 5}[new_kv]
    seq, past = (5, 3) if "static" in form else ("seq", "past")
    if "decode" in form:
        seq, new_kv, keys = 1, 2, 5
    batch = 2 if "const" in form else "batch"

    def shaped(h: int, s):
        return [batch, s, h * head] if three else [batch, h, s, head]

    ins = [vi("q", dt, shaped(heads, seq)), vi("k", dt, shaped(kv_heads, new_kv)),
           vi("v", dt, shaped(kv_heads, new_kv))]
    names, inits = ["q", "k", "v"], []
    if "bool" in form or "float" in form:
        mdt = onnx.TensorProto.BOOL if "bool" in form else dt
        if "const" in form:
            npdt = bool if "bool" in form else helper.tensor_dtype_to_np_dtype(dt)
            rng = np.random.default_rng(5)
            mask = rng.random((2, 1, 5, 5)) > 0.3 if "bool" in form else \
                np.where(rng.random((2, 1, 5, 5)) > 0.3, 0.0, -np.inf)
            mask[..., 0] = True if "bool" in form else rng.standard_normal()
            mask[1, 0, 2] = False if "bool" in form else mask_value
            inits.append(const("m", mask.astype(npdt), npdt))
        else:
            ins.append(vi("m", mdt, [batch, 1, seq, keys]))
        names.append("m")
    outs, out_vis = ["y"], [vi("y", dt, shaped(heads, seq))]
    if "past" in form:
        names += [""] * (4 - len(names)) + ["pk", "pv"]
        ins += [vi(p, dt, [batch, kv_heads, past, head]) for p in ("pk", "pv")]
        outs += ["present_k", "present_v"]
        out_vis += [vi(p, dt, [batch, kv_heads, keys, head]) for p in ("present_k", "present_v")]
    attrs = {"q_num_heads": heads, "kv_num_heads": kv_heads} if three else {}
    attrs.update({"is_causal": 1} if "causal" in form else {})
    attrs.update({"scale": 0.3} if "scale" in form else {})
    attrs.update({"softcap": 2.0} if "cap" in form else {})
    n = helper.make_node("Attention", names, outs, name="attention", **attrs)
    return model([n], ins, out_vis, inits, opset=opset)


def onnx_rotary(dt: int, form: str = "", heads: int = 3, head: int = 16, rot: int = 0) -> onnx.ModelProto:
    """One ONNX RotaryEmbedding (opset 23) of x [batch, heads, seq, head] ("3d": [batch, seq, heads·head]) with
    cos and sin inputs [batch, seq, R/2] ("b1": [1, seq, R/2], as torch's exporter writes them; "positions":
    [32, R/2] caches and position_ids [batch, seq]); `rot`: rotary_embedding_dim (0: the head size); "attention":
    q and k rotated, then ONNX's Attention (grouped: 1 key/value head) reading them."""
    half = (rot or head) // 2
    shape = ["batch", "seq", heads * head] if "3d" in form else ["batch", heads, "seq", head]
    cache = [32, half] if "positions" in form else [1 if "b1" in form else "batch", "seq", half]
    ins = [vi("c", dt, cache), vi("s", dt, cache)] + ([vi("pos", onnx.TensorProto.INT64, ["batch", "seq"])]
                                                        if "positions" in form else [])
    extra = ["pos"] if "positions" in form else []
    attrs = {"rotary_embedding_dim": rot} if rot else {}
    attrs.update({"num_heads": heads} if "3d" in form else {})
    if "attention" not in form:
        n = helper.make_node("RotaryEmbedding", ["x", "c", "s", *extra], ["y"], name="rope", **attrs)
        return model([n], [vi("x", dt, shape)] + ins, [vi("y", dt, shape)], opset=23)
    three = "3d" in form
    kv = ["batch", "seq", head] if three else ["batch", 1, "seq", head]
    k_attrs = dict(attrs, num_heads=1) if three else attrs
    nodes = [helper.make_node("RotaryEmbedding", ["q", "c", "s", *extra], ["qr"], name="rope_q", **attrs),
             helper.make_node("RotaryEmbedding", ["k", "c", "s", *extra], ["kr"], name="rope_k", **k_attrs),
             helper.make_node("Attention", ["qr", "kr", "v"], ["y"], name="attention",
                              **({"q_num_heads": heads, "kv_num_heads": 1} if three else {}))]
    return model(nodes, [vi("q", dt, shape), vi("k", dt, kv), vi("v", dt, kv)] + ins, [vi("y", dt, shape)],
                 opset=23)


CAUSAL_HEADS, CAUSAL_HEAD = 2, 64  # causal_attention's heads and head size
SLICED_MAX = 512  # the "sliced" form's buffer: the most positions (GPT-2's n_positions)


def stacked_attention(dt: int, forms: Sequence[str], projected: bool = True) -> onnx.ModelProto:
    """causal_attention blocks of `forms`, each one's output the next one's q (through a [hd, hd] MatMul where
    `projected`, else directly: two attention patterns joined by layout ops alone); the later blocks' k, v and
    masks are inputs of their own (prefixed "l1_", ...)."""
    from onnx import compose
    hd = CAUSAL_HEADS * CAUSAL_HEAD
    m = causal_attention(dt, forms[0])
    w = (np.random.default_rng(0).standard_normal((hd, hd)) / np.sqrt(hd)).astype(helper.tensor_dtype_to_np_dtype(dt))
    for k, form in enumerate(forms[1:], 1):
        out = m.graph.output[0].name
        if projected:
            proj = model([node("MatMul", ["y", "w"], ["q"])], [vi("y", dt, ["batch", "seq", hd])],
                         [vi("q", dt, ["batch", "seq", hd])], [const("w", w, w.dtype)])
            m = compose.merge_models(m, proj, io_map=[(out, "y")], prefix2=f"p{k}_")
            out = f"p{k}_q"
        m = compose.merge_models(m, causal_attention(dt, form), io_map=[(out, "q")], prefix2=f"l{k}_")
    m.ir_version = 10
    return m


def causal_attention(dt: int, form: str = "and", past: bool = False, seq="seq", kv_heads: int = CAUSAL_HEADS
                     ) -> onnx.ModelProto:
    """Self-attention on q, k, v [B, S, heads * head] (CAUSAL_HEADS, CAUSAL_HEAD) with its mask made in the graph
    as HF's masking utilities and TorchScript write it. `form`: "and" (Where(j <= i & padding, 0, -inf)),
    "greater" (Where(j > i, -inf, 0) plus a padding bias), "shifted" (j < i + 3), "window" (j <= i and
    j > i - 64), "min" (as "and" at the lowest finite float), "shallow" (as "and" at -100: too shallow to
    zero a term), "padding" (no causal rule), "batch" (j <= i + b:
    differs per batch item), "trilu" (TorchScript's is_causal: a Trilu of ones, Where(tril == 0, -inf, 0)),
    "const" (a constant [1, 1, seq, seq] lower triangle of bools at a static `seq`, Where(tril, 0, lowest)
    plus a padding bias), "sliced" (as "const" from a [1, 1, SLICED_MAX, SLICED_MAX] buffer sliced at run time
    to rows Sk - Sq .. Sk - 1 and keys 0 .. Sk - 1: GPT-2's `bias` buffer before transformers 4.4x).
    `past`: K and V are a past [B, heads, P, head] joined with the new keys, the query positions P + i (HF's
    cache_position). `kv_heads` below CAUSAL_HEADS: k, v and the past have that many heads, repeated across
    the query heads after the past (Llama's repeat_kv: Unsqueeze, Expand, Reshape)."""
    TP, hd, kvd = onnx.TensorProto, CAUSAL_HEADS * CAUSAL_HEAD, kv_heads * CAUSAL_HEAD
    npdt = helper.tensor_dtype_to_np_dtype(dt)
    low = np.finfo(npdt).min if form == "min" else -100.0 if form == "shallow" else -np.inf
    n = [node("Reshape", ["q", "shp4"], ["q4"]), node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
         node("Reshape", ["k", "shp4kv"], ["k4"]), node("Transpose", ["k4"], ["kn"], perm=[0, 2, 1, 3]),
         node("Reshape", ["v", "shp4kv"], ["v4"]), node("Transpose", ["v4"], ["vn"], perm=[0, 2, 1, 3])]
    inputs = [vi("q", dt, ["batch", seq, hd])] + [vi(x, dt, ["batch", seq, kvd]) for x in "kv"]
    inputs.append(vi("attention_mask", TP.INT64, ["batch", "past + seq" if past else seq]))
    kh, vh = ("kc", "vc") if kv_heads != CAUSAL_HEADS else ("kh", "vh")
    if past:
        inputs += [vi(x, dt, ["batch", kv_heads, "past", CAUSAL_HEAD]) for x in ("past_k", "past_v")]
        n += [node("Concat", ["past_k", "kn"], [kh], axis=2), node("Concat", ["past_v", "vn"], [vh], axis=2),
              node("Shape", ["past_k"], ["pshape"]), node("Gather", ["pshape", "two"], ["plen"], axis=0)]
    else:
        n += [node("Identity", ["kn"], [kh]), node("Identity", ["vn"], [vh])]
    if kv_heads != CAUSAL_HEADS:  # repeat_kv
        for t in ("k", "v"):
            n += [node("Unsqueeze", [f"{t}c", "ax2"], [f"{t}5"]), node("Expand", [f"{t}5", "rep"], [f"{t}e"]),
                  node("Reshape", [f"{t}e", "shpkv"], [f"{t}h"])]
    n += [node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["qh", "kt"], ["s0"]),
          node("Mul", ["s0", "scale"], ["s1"]),
          # iotas: query positions (after the past) and key positions
          node("Shape", ["q"], ["qshape"]), node("Gather", ["qshape", "one"], ["slen"], axis=0),
          node("Shape", ["kh"], ["kshape"]), node("Gather", ["kshape", "two"], ["tlen"], axis=0),
          node("Range", ["zero", "slen", "one"], ["qr0"]), node("Range", ["zero", "tlen", "one"], ["kr"])]
    n.append(node("Add", ["qr0", "plen"], ["qr"]) if past else node("Identity", ["qr0"], ["qr"]))
    n += [node("Unsqueeze", ["qr", "ax1"], ["qi"]), node("Unsqueeze", ["kr", "ax0"], ["kj"]),
          node("Unsqueeze", ["attention_mask", "ax12"], ["am4"]), node("Cast", ["am4"], ["pad"], to=TP.BOOL)]
    if form in ("and", "min", "shallow", "window", "shifted", "batch"):
        if form == "shifted":
            n += [node("Add", ["qi", "three"], ["qi3"]), node("Less", ["kj", "qi3"], ["causal"])]
        elif form == "batch":  # i + b: a frontier that is not one diagonal for the whole batch
            n += [node("Shape", ["q"], ["bshape"]), node("Gather", ["bshape", "zero1"], ["blen"], axis=0),
                  node("Range", ["zero", "blen", "one"], ["br"]), node("Unsqueeze", ["br", "ax123"], ["b4"]),
                  node("Add", ["qi", "b4"], ["qib"]), node("LessOrEqual", ["kj", "qib"], ["causal"])]
        else:
            n.append(node("LessOrEqual", ["kj", "qi"], ["causal"]))
        if form == "window":
            n += [node("Sub", ["qi", "width"], ["qi4"]), node("Greater", ["kj", "qi4"], ["inwin"]),
                  node("And", ["causal", "inwin"], ["causal_w"])]
        n += [node("And", ["causal_w" if form == "window" else "causal", "pad"], ["keep"]),
              node("Where", ["keep", "zf", "low"], ["bias"])]
    elif form == "const":
        tril = np.tril(np.ones((seq, seq), bool))[None, None]
        n += [node("Where", ["tril", "zf", "lowest"], ["cbias"]), node("Where", ["pad", "zf", "lowest"], ["pbias"]),
              node("Add", ["cbias", "pbias"], ["bias"])]
    elif form == "sliced":  # GPT-2's bias buffer before transformers 4.4x: bias[:, :, Sk - Sq:Sk, :Sk]
        tril = np.tril(np.ones((SLICED_MAX, SLICED_MAX), bool))[None, None]
        n += [node("Sub", ["tlen", "slen"], ["off"]), node("Unsqueeze", ["off", "ax0"], ["off1"]),
              node("Unsqueeze", ["tlen", "ax0"], ["tlen1"]),
              node("Slice", ["tril", "off1", "tlen1", "ax2"], ["rows"]),
              node("Slice", ["rows", "zero1", "tlen1", "ax3"], ["cm"]),
              node("Where", ["cm", "zf", "lowest"], ["cbias"]), node("Where", ["pad", "zf", "lowest"], ["pbias"]),
              node("Add", ["cbias", "pbias"], ["bias"])]
    elif form == "greater":
        n += [node("Greater", ["kj", "qi"], ["hide"]), node("Where", ["hide", "low", "zf"], ["cbias"]),
              node("Where", ["pad", "zf", "low"], ["pbias"]), node("Add", ["cbias", "pbias"], ["bias"])]
    elif form == "trilu":
        n += [node("ConstantOfShape", ["sshape"], ["ones"], value=helper.make_tensor("v", TP.FLOAT, [1], [1.0])),
              node("Trilu", ["ones"], ["tril"], upper=0), node("Equal", ["tril", "zf32"], ["hide"]),
              node("Where", ["hide", "low", "zf"], ["bias"])]
    else:
        n.append(node("Where", ["pad", "zf", "low"], ["bias"]))
    if form == "trilu":
        n.append(node("Concat", ["slen1", "slen1"], ["sshape"], axis=0))
        n.append(node("Unsqueeze", ["slen", "ax0"], ["slen1"]))
    n += [node("Add", ["s1", "bias"], ["s2"]), node("Softmax", ["s2"], ["p"], axis=-1),
          node("MatMul", ["p", "vh"], ["o"]), node("Transpose", ["o"], ["o4"], perm=[0, 2, 1, 3]),
          node("Reshape", ["o4", "shp3"], ["y"])]
    i64 = np.int64
    inits = [const("shp4", [0, 0, CAUSAL_HEADS, CAUSAL_HEAD], i64), const("shp3", [0, 0, hd], i64),
             const("shp4kv", [0, 0, kv_heads, CAUSAL_HEAD], i64), const("ax2", [2], i64),
             const("rep", [1, 1, CAUSAL_HEADS // kv_heads, 1, 1], i64),
             const("shpkv", [0, CAUSAL_HEADS, -1, CAUSAL_HEAD], i64),
             const("scale", 1 / np.sqrt(CAUSAL_HEAD), npdt), const("zero", 0, i64), const("zero1", [0], i64),
             const("one", 1, i64), const("two", 2, i64), const("three", 3, i64), const("width", 64, i64),
             const("ax0", [0], i64), const("ax1", [1], i64), const("ax12", [1, 2], i64),
             const("ax123", [1, 2, 3], i64), const("zf", 0, npdt), const("low", low, npdt),
             const("zf32", 0, np.float32)]
    if form in ("const", "sliced"):
        inits += [const("tril", tril, np.bool_), const("lowest", np.finfo(npdt).min, npdt)]
    if form == "sliced":
        inits.append(const("ax3", [3], i64))
    return model(n, inputs, [vi("y", dt, ["batch", seq, hd])], inits)


def quantized_add(dtype=np.int8, zero_point: bool = True, fp16: bool = False, batch: bool = True) -> onnx.ModelProto:
    """x (float) -> Q -> DQ, plus DQ of a constant, then Add -> y: the QDQ form of an Add. The Q stays ORT's.
    `batch`: x has a leading batch dim (else the Add does not broadcast)."""
    ft = onnx.TensorProto.FLOAT16 if fp16 else onnx.TensorProto.FLOAT
    fnp = np.float16 if fp16 else np.float32
    info = np.iinfo(dtype)
    zp = [numpy_helper.from_array(np.array(3 if dtype == np.int8 else 128, dtype), "zx"),
          numpy_helper.from_array(np.array(-5 if dtype == np.int8 else 120, dtype), "zc")] if zero_point else []
    inits = [numpy_helper.from_array(np.array(0.0173, fnp), "sx"), numpy_helper.from_array(np.array(0.0291, fnp), "sc"),
             numpy_helper.from_array(
                 np.random.default_rng(7).integers(info.min, int(info.max) + 1, (6, 40)).astype(dtype), "c"), *zp]
    z = (lambda n: [n]) if zero_point else (lambda n: [])
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", *z("zx")], ["qx"]),
             helper.make_node("DequantizeLinear", ["qx", "sx", *z("zx")], ["dx"]),
             helper.make_node("DequantizeLinear", ["c", "sc", *z("zc")], ["dc"]),
             helper.make_node("Add", ["dx", "dc"], ["y"])]
    return model(nodes, [helper.make_tensor_value_info("x", ft, ["b", 6, 40] if batch else [6, 40])],
                 [helper.make_tensor_value_info("y", ft, None)], inits, opset=19 if fp16 else 18)  # (fp16 DQ: 19)


def requantized(middle: str = "add", fp16: bool = False, scale: float = 0.037) -> onnx.ModelProto:
    """DQ(a), DQ(b) -> `middle` -> Q -> y (int8): the QDQ form of an op, with its output quantized. `middle`:
    "add"; "muladd" (a * b + a: a product an FMA could fuse with the sum); "sigmoid" (of the sum); "reciprocal"
    (1 / (a + 2) * b)."""
    ft, fnp = (onnx.TensorProto.FLOAT16, np.float16) if fp16 else (onnx.TensorProto.FLOAT, np.float32)
    inits = [numpy_helper.from_array(np.array(0.021, fnp), "sa"), numpy_helper.from_array(np.array(0.013, fnp), "sb"),
             numpy_helper.from_array(np.array(scale, fnp), "sy"), numpy_helper.from_array(np.array(-3, np.int8), "zy")]
    nodes = [helper.make_node("DequantizeLinear", ["a", "sa"], ["da"]),
             helper.make_node("DequantizeLinear", ["b", "sb"], ["db"])]
    if middle == "muladd":
        nodes += [helper.make_node("Mul", ["da", "db"], ["p"]), helper.make_node("Add", ["p", "da"], ["m"])]
    elif middle == "reciprocal":  # 1 / (a + 2) * b: ORT makes the Div and the Mul one division
        inits.append(numpy_helper.from_array(np.array(1.0, fnp), "one"))
        inits.append(numpy_helper.from_array(np.array(2.0, fnp), "two"))
        nodes += [helper.make_node("Add", ["da", "two"], ["a2"]), helper.make_node("Div", ["one", "a2"], ["r"]),
                  helper.make_node("Mul", ["r", "db"], ["m"])]
    else:
        nodes.append(helper.make_node("Add", ["da", "db"], ["m"]))
        if middle == "sigmoid":
            nodes.append(helper.make_node("Sigmoid", ["m"], ["m2"]))
    nodes.append(helper.make_node("QuantizeLinear", [nodes[-1].output[0], "sy", "zy"], ["y"], name="Q"))
    return model(nodes, [helper.make_tensor_value_info("a", onnx.TensorProto.INT8, ["n", 48]),
                         helper.make_tensor_value_info("b", onnx.TensorProto.UINT8, ["n", 48])],
                 [helper.make_tensor_value_info("y", onnx.TensorProto.INT8, None)], inits, opset=19 if fp16 else 18)


def gelu_mlp(dql: bool = False, k: int = 32) -> onnx.ModelProto:
    """x [n, k] @ w + bias, then the erf GELU as exporters write it (Div, Erf, Add, Mul, Mul); with `dql` its result
    goes to DynamicQuantizeLinear, as quantize_dynamic writes the input of the next MatMulInteger."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((k, 48)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal(48) * 0.1).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array(1.4142135381698608, np.float32), "sqrt2"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "bias"], ["h"], name="bias_add"),
             helper.make_node("Div", ["h", "sqrt2"], ["d"], name="div"), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["p"]),
             helper.make_node("Mul", ["p", "half"], ["g"])]
    outs = [helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, ["n", 48])]
    if dql:
        nodes.append(helper.make_node("DynamicQuantizeLinear", ["g"], ["y", "ys", "yz"], name="DQL"))
        outs = [helper.make_tensor_value_info("y", onnx.TensorProto.UINT8, ["n", 48]),
                helper.make_tensor_value_info("ys", onnx.TensorProto.FLOAT, []),
                helper.make_tensor_value_info("yz", onnx.TensorProto.UINT8, [])]
    return model(nodes, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", k])], outs, inits)


def quantized_layernorm(rows: int | str = 4, width: int = 32) -> onnx.ModelProto:
    """A quantized residual stream as quantize_static writes BERT's: DQ(a) + DQ(c) -> Add -> Q -> DQ ->
    LayerNormalization -> Q -> DQ -> y, a, c int8 [rows, width]."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(np.array(v, np.float32), f"s{k}") for k, v in enumerate((0.02, 0.03, 0.035), 1)]
    inits += [numpy_helper.from_array(rng.uniform(0.5, 1.5, width).astype(np.float32), "g"),
              numpy_helper.from_array(rng.uniform(-0.1, 0.1, width).astype(np.float32), "b"),
              numpy_helper.from_array(np.array(4, np.int8), "z")]
    nodes = [helper.make_node("DequantizeLinear", ["a", "s1"], ["da"]),
             helper.make_node("DequantizeLinear", ["c", "s1"], ["dc"]), helper.make_node("Add", ["da", "dc"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "s2", "z"], ["mq"]),
             helper.make_node("DequantizeLinear", ["mq", "s2", "z"], ["md"]),
             helper.make_node("LayerNormalization", ["md", "g", "b"], ["ln"], name="LN", axis=-1),
             helper.make_node("QuantizeLinear", ["ln", "s3", "z"], ["q"], name="Q"),
             helper.make_node("DequantizeLinear", ["q", "s3", "z"], ["y"])]
    return model(nodes, [helper.make_tensor_value_info(t, onnx.TensorProto.INT8, [rows, width]) for t in "ac"],
                 [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)


def weight_bias_unit(weight: str = "float", bias: str = "float", tail: tuple[str, ...] = ("Relu",),
                     branch: bool = False, input_dq: bool = True, op: str = "Conv") -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv (or Gemm) -> `tail` -> Q -> DQ -> Sigmoid: `weight` "float" (an fp32 initializer) or
    "dq" (an int8 one dequantized); `bias` "float", "none" or "2d" (a [1, O] initializer, for a Gemm's C);
    `branch`: the Conv's output is also read by a Sigmoid; `input_dq`: the Conv reads x itself."""
    rng = np.random.default_rng(5)
    c, o = 8, 16
    conv = op == "Conv"
    w_shape = (o, c, 3, 3) if conv else (c, o)
    w = (rng.standard_normal(w_shape) * 0.2).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in
             (("sx", 0.02, np.float32), ("zx", 0, np.int8), ("sy", 0.05, np.float32), ("zy", -10, np.int8),
              ("sw", 0.004, np.float32))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["qx"]),
             helper.make_node("DequantizeLinear", ["qx", "sx", "zx"], ["dx"])]
    if weight == "dq":
        inits.append(numpy_helper.from_array(np.clip(np.round(w / 0.004), -127, 127).astype(np.int8), "Wq"))
        nodes.append(helper.make_node("DequantizeLinear", ["Wq", "sw"], ["W"]))
    else:
        inits.append(numpy_helper.from_array(w, "W"))
    ins = ["dx" if input_dq else "x", "W"]
    if bias != "none":
        b = (rng.standard_normal(o) * 0.1).astype(np.float32)
        inits.append(numpy_helper.from_array(b.reshape(1, o) if bias == "2d" else b, "B"))
        ins.append("B")
    nodes.append(helper.make_node(op, ins, ["c"], name="conv", **({"pads": [1, 1, 1, 1]} if conv else {})))
    t = "c"
    for k, op_ in enumerate(tail):
        nodes.append(helper.make_node(op_, [t], [f"t{k}"]))
        t = f"t{k}"
    nodes += [helper.make_node("QuantizeLinear", [t, "sy", "zy"], ["qy"], name="Qy"),
              helper.make_node("DequantizeLinear", ["qy", "sy", "zy"], ["dy"]),
              helper.make_node("Sigmoid", ["dy"], ["y"])]
    outs = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)]
    if branch:
        nodes.append(helper.make_node("Sigmoid", ["c"], ["y2"]))
        outs.append(helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, None))
    x_shape = [2, c, 6, 6] if conv else [4, c]
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)
    m = helper.make_model(helper.make_graph(nodes, "t", [x], outs, inits), opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return onnx.shape_inference.infer_shapes(m)


@functools.lru_cache(maxsize=None)
def cuda_ep_usable() -> bool:
    """True if an ONNX Runtime session actually gets the CUDA EP (not just lists it as available)."""
    try:
        import onnxruntime as ort

        if hasattr(ort, "preload_dlls"):
            try:
                ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels, when installed
            except Exception:
                pass
        from ortfuse.runtime import _cuda_usable

        return _cuda_usable(["CUDAExecutionProvider", "CPUExecutionProvider"], None)
    except Exception:
        return False

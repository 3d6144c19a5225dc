"""`check --trace` (ortfuse.divergence): where an optimized model's values first part from the original's."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP, numpy_helper

from ortfuse.cli import main
from ortfuse.divergence import trace_models
from helpers import const, model, node, vi

N = 64


def _original() -> onnx.ModelProto:
    """x * 1.5 + 0.25 -> Relu -> CumSum (left to ORT) -> + x -> Sigmoid: a kernel, ORT's CumSum, a kernel."""
    inits = [const("a", 1.5), const("b", 0.25), const("axis", np.array(1, np.int64), np.int64)]
    nodes = [node("Mul", ["x", "a"], ["xa"]), node("Add", ["xa", "b"], ["xb"]), node("Relu", ["xb"], ["r"]),
             node("CumSum", ["r", "axis"], ["m"]), node("Add", ["m", "x"], ["s"]), node("Sigmoid", ["s"], ["y"])]
    for i, n in enumerate(nodes):
        n.name = f"n{i}_{n.op_type}"
    return model(nodes, [vi("x", TP.FLOAT, ["batch", N])], [vi("y", TP.FLOAT, ["batch", N])], inits)


def _optimized() -> onnx.ModelProto:
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    res = compile_model(_original(), None, "sm_90", options=Options(archs=(90,)))
    assert sum(n.domain == "ortfuse" for n in res.model.graph.node) == 2, [n.op_type for n in res.model.graph.node]
    return res.model


def _tampered(m: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """`m` with the fused body that computes Relu's input scaled by 1 + 2^-10 (on the CPU, ORT runs a fused
    node's body); the name of that fused node."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for f in out.functions:
        if any(n.op_type == "Relu" for n in f.node):
            relu = next(n for n in f.node if n.op_type == "Relu")
            f.node.insert(0, onnx.helper.make_node("Constant", [], ["k_tamper"],
                                                   value=numpy_helper.from_array(np.array(1 + 2.0 ** -10, np.float32))))
            f.node.insert(list(f.node).index(relu), onnx.helper.make_node("Mul", [relu.input[0], "k_tamper"],
                                                                            ["tampered"]))
            relu.input[0] = "tampered"
            return out, next(n.name for n in out.graph.node if n.op_type == f.name)
    raise AssertionError("no fused body with the Relu")


def test_an_untouched_optimization_traces_clean() -> None:
    tr = trace_models(_original(), _optimized(), input_shapes={"x": (4, N)})
    assert tr.compared >= 3 and all(d.ok for d in tr.diffs), "\n".join(tr.lines())


def test_a_kernel_that_computes_otherwise_is_the_origin_and_what_it_feeds_is_not() -> None:
    bad, fused = _tampered(_optimized())
    tr = trace_models(_original(), bad, input_shapes={"x": (4, N)})
    first = tr.diffs[0]
    assert first.origin and first.producer == fused and not first.ok and first.name == "r", "\n".join(tr.lines())
    cs = next(d for d in tr.diffs if d.name == "m")  # ORT's CumSum, after it: moved by its input only
    assert not cs.origin and cs.producer == "CumSum 'n3_CumSum'" and cs.inputs[0].startswith("r: "), cs.line()
    assert [d.name for d in tr.origins] == ["r"] and not tr.ok


def _pair(a: float, extra: list[onnx.NodeProto] = (), signed_zero: bool = False) -> onnx.ModelProto:
    """x * a -> [extra: xa renamed] -> CumSum (ORT's) -> Sigmoid; `signed_zero`: also x * 0 (-0 for x < 0, or
    |x| * 0: +0) added to the result, which changes no value downstream."""
    inits = [const("a", a), const("axis", np.array(1, np.int64), np.int64), const("zero", 0.0)]
    src = extra[-1].output[0] if extra else "xa"
    nodes = [node("Mul", ["x", "a"], ["xa"]), *extra, node("CumSum", [src, "axis"], ["m"])]
    if signed_zero:
        nodes += [node("Abs", ["x"], ["ax"]), node("Mul", ["ax" if signed_zero == "abs" else "x", "zero"], ["xz"]),
                  node("Add", ["m", "xz"], ["mz"]), node("Sigmoid", ["mz"], ["y"])]
    else:
        nodes.append(node("Sigmoid", ["m"], ["y"]))
    for i, n in enumerate(nodes):
        n.name = f"n{i}_{n.op_type}"
    return model(nodes, [vi("x", TP.FLOAT, [4, N])], [vi("y", TP.FLOAT, [4, N])], inits)


def test_a_node_reading_a_tensor_the_rewrite_made_is_judged_through_it() -> None:
    """The optimized model copies xa to a tensor the original lacks (as the rewrite's iota copies and packed
    weights are): the CumSum after the copy is not an origin, since xa, which the copy reads, moved."""
    copy = node("Identity", ["xa"], ["xa__ortfuse_copy0"])
    tr = trace_models(_pair(1.5), _pair(1.5 * (1 + 2.0 ** -10), [copy]))
    assert [d.name for d in tr.origins] == ["xa"], "\n".join(tr.lines())
    cs = next(d for d in tr.diffs if d.name == "m")
    assert not cs.origin and cs.inputs[0].startswith("xa: "), cs.line()


def test_a_sign_of_zero_is_no_difference() -> None:
    """x * 0 is -0 where x < 0, |x| * 0 never: equal values, so neither listed nor hiding the Add after it as
    an origin when the Add itself computes otherwise."""
    src, opt = _pair(1.5, signed_zero=True), _pair(1.5, signed_zero="abs")
    assert trace_models(src, opt).diffs == ()
    for n in opt.graph.node:
        if n.op_type == "Add":
            n.op_type = "Sub"  # m - 0: the same value, so still nothing differs
    assert trace_models(src, opt).diffs == ()


def test_the_plain_outputs_are_compared_too() -> None:
    """Returning every tensor stops ORT's fusions: Q1 -> DQ1 -> Q2 -> DQ2 at two scales is merged by ORT into
    one requantization in the original alone (the optimized model puts a Max(d, d) between, which ORT keeps).
    Traced, both models run unmerged and agree; run plainly, the outputs differ, and the trace says so."""
    def chain(guard: bool) -> onnx.ModelProto:
        inits = [const("s1", 0.02), const("s2", 0.037), const("z", np.array(3, np.int8), np.int8)]
        nodes = [node("QuantizeLinear", ["x", "s1", "z"], ["q1"]), node("DequantizeLinear", ["q1", "s1", "z"], ["d1"])]
        if guard:
            nodes.append(node("Max", ["d1", "d1"], ["d1m"]))
        nodes += [node("QuantizeLinear", ["d1m" if guard else "d1", "s2", "z"], ["q2"]),
                  node("DequantizeLinear", ["q2", "s2", "z"], ["y"])]
        for i, n in enumerate(nodes):
            n.name = f"n{i}_{n.op_type}"
        return model(nodes, [vi("x", TP.FLOAT, [64, N])], [vi("y", TP.FLOAT, [64, N])], inits)
    tr = trace_models(chain(False), chain(True))
    assert not tr.ok and not tr.outputs[0].ok and all(d.ok for d in tr.diffs), "\n".join(tr.lines())
    assert "an output that fails plainly agrees when traced" in "\n".join(tr.lines())


def test_the_cli_prints_the_trace_and_fails_on_a_difference(tmp_path, capsys) -> None:
    from ortfuse.rewriter.replace import save_model
    bad, _ = _tampered(_optimized())
    save_model(_original(), tmp_path / "in.onnx")
    save_model(bad, tmp_path / "out.onnx")
    assert main(["check", str(tmp_path / "in.onnx"), str(tmp_path / "out.onnx"), "--trace",
                 "--input-shape", "x:4x64"]) == 1
    out = capsys.readouterr().out
    assert "ORIGIN r (from ortfuse_region_" in out and "origins" in out.splitlines()[0], out
    assert "graph outputs, both models run without the traced outputs" in out and "[FAIL]" in out, out


@pytest.mark.gpu
def test_a_quantized_chain_traces_exact_on_the_gpu() -> None:
    """On the GPU the kernels run: a quantized residual stream fused across kernels must give ORT's int8 values
    bit for bit (session 51's BERT QDQ parity failure is what this tool was built to find)."""
    from ortfuse.runtime import _cuda_usable
    if not _cuda_usable(["CUDAExecutionProvider"], None):
        pytest.skip("needs a working CUDA execution provider")
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    from test_check_quantized import _quantized
    src = _quantized()
    res = compile_model(src, None, "sm_90", options=Options(archs=(90,)))
    tr = trace_models(src, res.model, provider="cuda")
    assert not [d for d in tr.diffs if d.name == "q" or not d.ok], "\n".join(tr.lines())

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
    assert [d.name for d in tr.origins] == ["r"]


def test_the_cli_prints_the_trace_and_fails_on_a_difference(tmp_path, capsys) -> None:
    from ortfuse.rewriter.replace import save_model
    bad, _ = _tampered(_optimized())
    save_model(_original(), tmp_path / "in.onnx")
    save_model(bad, tmp_path / "out.onnx")
    assert main(["check", str(tmp_path / "in.onnx"), str(tmp_path / "out.onnx"), "--trace",
                 "--input-shape", "x:4x64"]) == 1
    out = capsys.readouterr().out
    assert "ORIGIN r (from ortfuse_region_" in out and "origins" in out.splitlines()[0], out


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

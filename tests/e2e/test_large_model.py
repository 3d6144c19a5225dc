"""A model over 2 GB end to end: optimized from its external data (memory-mapped), written with "<name>.data",
checked against ORT on the CPU with every fused kernel emulated. Opt-in (ORTFUSE_LARGE_TEST=1): it writes
~4.8 GB to a temporary folder and needs ~10 GB of memory for the two ORT sessions of the check."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

pytestmark = pytest.mark.skipif(os.environ.get("ORTFUSE_LARGE_TEST") != "1",
                                reason="writes ~4.8 GB: set ORTFUSE_LARGE_TEST=1")

D, F, LAYERS = 2048, 8192, 18  # 18 x 2 x 64 MiB of fp32 weights: 2.42 GB
_OPTIMIZE = ("import sys; from ortfuse.cli import main; rc = main(sys.argv[1:]); "
             "print(next(line for line in open('/proc/self/status') if line.startswith('VmHWM:')).split()[1]); "
             "sys.exit(rc)")


def _mlp_stack(path) -> int:
    """Pre-LayerNorm MLP blocks with residuals, saved with external data; returns the weights' bytes."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for k in range(LAYERS):
        p = f"l{k}"
        for name, value in ((f"{p}.g", 1 + 0.1 * rng.standard_normal(D, dtype=np.float32)),
                            (f"{p}.b", 0.1 * rng.standard_normal(D, dtype=np.float32)),
                            (f"{p}.w1", 0.02 * rng.standard_normal((D, F), dtype=np.float32)),
                            (f"{p}.b1", 0.02 * rng.standard_normal(F, dtype=np.float32)),
                            (f"{p}.w2", 0.02 * rng.standard_normal((F, D), dtype=np.float32)),
                            (f"{p}.b2", 0.02 * rng.standard_normal(D, dtype=np.float32))):
            inits.append(numpy_helper.from_array(value, name))
        nodes += [helper.make_node("LayerNormalization", [x, f"{p}.g", f"{p}.b"], [f"{p}.ln"], axis=-1),
                  helper.make_node("MatMul", [f"{p}.ln", f"{p}.w1"], [f"{p}.m1"]),
                  helper.make_node("Add", [f"{p}.m1", f"{p}.b1"], [f"{p}.a1"]),
                  helper.make_node("Relu", [f"{p}.a1"], [f"{p}.r"]),
                  helper.make_node("MatMul", [f"{p}.r", f"{p}.w2"], [f"{p}.m2"]),
                  helper.make_node("Add", [f"{p}.m2", f"{p}.b2"], [f"{p}.a2"]),
                  helper.make_node("Add", [x, f"{p}.a2"], [f"{p}.out"])]
        x = f"{p}.out"
    graph = helper.make_graph(nodes, "mlp_stack", [helper.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", D])],
                              [helper.make_tensor_value_info(x, TP.FLOAT, ["batch", "seq", D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    weights = sum(t.ByteSize() for t in model.graph.initializer)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{path.name}.data", size_threshold=1024)
    return weights


def test_optimize_and_check_a_model_over_2gb(tmp_path):
    from ortfuse.check import check_models

    src, out = tmp_path / "big.onnx", tmp_path / "out" / "big.ortfuse.onnx"
    out.parent.mkdir()
    weights = _mlp_stack(src)
    assert weights > 2**31
    # the child's own high-water mark (its rusage would count the pages of this process it was forked from)
    run = subprocess.run([sys.executable, "-c", _OPTIMIZE, "optimize", str(src), str(out)], check=True,
                         capture_output=True, text=True)
    peak = int(run.stdout.split()[-1]) * 1024  # VmHWM, kB
    # the weights are mapped, not copied: 2.8 GB peak for 2.42 GB of weights (2026-11-28); 9 GB, then a crash
    # serializing the output, before the weight store
    assert peak < 1.5 * weights, f"optimize peaked at {peak / 1e9:.2f} GB"
    assert (out.parent / "big.ortfuse.onnx.data").stat().st_size >= weights
    assert out.stat().st_size < 2**24
    rep = check_models(src, out, provider="cpu", emulate=True, input_shapes={"x": (2, 5, D)})
    assert rep.ok and rep.kernels, "\n".join(rep.lines())

"""A fused node that carries one GEMM kernel per size class (`--profile` where the fastest tile changes with
the batch) on the GPU: the library loads every variant's module and runs the one the rows pick, each with
its own launch geometry and, for TMA kernels, its own tensor maps. y = relu(x @ w + b), fp16, against the
stock ORT CUDA EP on the original model at batches on both sides of the threshold, run after run in one
session. Skipped without a CUDA EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse.api import compile_model, fused_kernel, target_for
from ortfuse.check import check_models
from ortfuse.config import Options
from ortfuse.customops.attrs import read_launch
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import render
from ortfuse.rewriter.replace import replace

pytestmark = pytest.mark.gpu
WG = Options(archs=(90,), wgmma=True)


def _gemm(k: int = 768, n: int = 768):
    rng = np.random.default_rng(0)
    return model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Relu", ["z"], ["out"])],
                 [vi("x", TP.FLOAT16, ["batch", 128, k])], [vi("out", TP.FLOAT16, None)],
                 [const("w", rng.standard_normal((k, n)) * 0.05, np.float16),
                  const("b", rng.standard_normal(n) * 0.2, np.float16)])


@pytest.mark.parametrize("small,big", [
    ((64, 64, 64, 16, 64, 7, 1, 2), (128, 192, 64, 16, 192, 4, 1, 2)),  # TMA both: a map set per variant
    ((64, 64, 64, 16, 64, 4, 4, 1), (128, 128, 64, 16, 128, 4, 1, 2)),  # wgmma split-K in clusters, then TMA
    ((64, 64, 32, 32, 32, 3, 4), (128, 256, 32, 64, 64, 3, 1)),          # mma.sync both (the weight as stored)
])
def test_the_rows_pick_the_kernel(small, big):
    m = _gemm()
    res = compile_model(m, None, "sm_90", options=WG)
    (k,) = res.kernels
    tgt = target_for((90,), True)
    built = []
    for tile in (small, big):
        spec = lower(res.graph, k.region, tgt, tile=tile)
        built.append((spec, compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WG.cache)))
    fk = fused_kernel(k.region, *built[0], [(1024, *built[1])])  # from batch 8 (1024 rows) on
    opt = replace(res.graph, [fk.node])
    launch = read_launch(next(n for n in opt.graph.node if n.domain == "ortfuse"))
    assert launch.pick([7]).entry == built[0][1].entry and launch.pick([8]).entry == built[1][1].entry
    rep = check_models(m, opt, provider="cuda", input_shapes={"x": (32, 128, 768)})
    assert rep.ok, "\n".join(rep.lines())
    # one session, the sizes alternating across the threshold: each variant's module, grid and maps
    import onnxruntime as ort

    from ortfuse.runtime import InferenceSession
    ours = InferenceSession(opt, providers=["CUDAExecutionProvider"])
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch in (1, 32, 7, 8, 2, 32, 1):
        x = rng.standard_normal((batch, 128, 768)).astype(np.float16)
        got, want = ours.run(None, {"x": x})[0].astype(np.float64), ref.run(None, {"x": x})[0].astype(np.float64)
        assert np.abs(got - want).max() <= 1e-2 * max(1.0, np.abs(want).max()), batch

"""GEMM row-wise epilogues split across thread-block clusters (sm_90) on the GPU: what the emulator cannot
prove, that the hardware's cluster launch, barrier and distributed shared memory reads do what the
emulation does. LayerNorm(x @ w + b + r) and its residual sum, fp16, against the stock ORT CUDA EP on the
original model (check_models' fp16 tolerances), the tile forced: mma.sync and wgmma tiles, 3 to 6 blocks a
row, partial row tiles and a row whose last block holds a part of its columns. Skipped without a CUDA EP."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse.api import compile_model, fused_kernel, target_for
from ortfuse.check import check_models
from ortfuse.config import Options
from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.lower import lower
from ortfuse.customops.printer import render
from ortfuse.rewriter.replace import replace

# row-wise epilogue kernels: their regions planned by the tile model alone (tests/conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("row_tiles_priced_by_the_tile_model")]
H = TP.FLOAT16
WG = Options(archs=(90,), wgmma=True)


def _layernorm_block(rows: int, k: int, n: int):
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((k, n)) * 0.05, "b": rng.standard_normal(n) * 0.2,
             "g": rng.standard_normal(n) * 0.5 + 1.0, "beta": rng.standard_normal(n) * 0.2}
    return model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Add", ["z", "r"], ["s"]),
                  node("LayerNormalization", ["s", "g", "beta"], ["out"], axis=-1, epsilon=1e-5)],
                 [vi("x", H, [rows, k]), vi("r", H, [rows, n])], [vi("out", H, None), vi("s", H, None)],
                 [const(name, v, np.float16) for name, v in inits.items()])


@pytest.mark.parametrize("n,tile", [
    (768, (128, 256, 32, 64, 32, 3, 1)),           # mma.sync, 3 blocks a row
    (776, (64, 128, 32, 32, 32, 3, 1)),            # mma.sync, 7 blocks, the last with 8 columns
    (768, (128, 192, 64, 16, 192, 4, 1, 1)),       # wgmma, 4 blocks of 192
    (768, (128, 128, 64, 16, 64, 4, 1, 1)),        # wgmma, 6 blocks of two warpgroups along N
])
def test_layernorm_row_split_across_a_cluster(n, tile):
    for rows in (1000, 4096):
        m = _layernorm_block(rows, 768, n)
        res = compile_model(m, None, "sm_90", options=WG)
        (k,) = [k for k in res.kernels if k.region.kind == "gemm_row"]
        spec = lower(res.graph, k.region, target_for((90,), True), tile=tile)
        assert spec.row_cluster > 1
        fk = fused_kernel(k.region, spec, compile_kernel(render(spec.kernel), spec.kernel.name, (90,), WG.cache))
        rep = check_models(m, replace(res.graph, [fk.node]), provider="cuda")
        assert rep.ok, "\n".join(rep.lines())


def test_bert_width_block_picks_a_split_row_and_matches_ort():
    # what `--wgmma` builds for BERT-base's post-attention block at batch 32, end to end
    m = _layernorm_block(4096, 768, 768)
    res = compile_model(m, None, "sm_90", options=WG)
    assert any(k.spec.row_cluster > 1 for k in res.kernels)
    rep = check_models(m, res.model, provider="cuda")
    assert rep.ok, "\n".join(rep.lines())

"""Programmatic dependent launches (`--pdl`, Target.pdl) on the GPU: every kernel may start while the one
before it finishes and waits for it itself (ortfuse_kernel.h grid_dependency_sync). A wait missing or misplaced
would let a kernel read its predecessor's output early: whole models of back-to-back fused kernels against
the stock CUDA EP, run after run and under CUDA-graph replay (fp16 tolerance 1e-2, normwise). Skipped without
a working CUDA EP (tests/conftest.py)."""
from __future__ import annotations

import onnxruntime as ort
import pytest

import ortfuse
from helpers import assert_cuda_graph_replay
from ortfuse.api import compile_model
from ortfuse.check import check_models, compare
from ortfuse.config import Options
from ortfuse.customops.attrs import read_launch
from ortfuse.feeds import random_feeds

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["gpt2", "bert", "resnet50"])
def test_zoo_tiny_with_pdl_matches_the_cuda_ep(name, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("ORTFUSE_CACHE_DIR", str(tmp_path))
    from ortfuse.bench import zoo
    path = zoo.build(name, dtype="fp16", tiny=True)
    res = compile_model(path, None, "sm_90", options=Options(archs=(90,), pdl=True))
    fused = [n for n in res.model.graph.node if n.domain == "ortfuse"]
    assert len(fused) > 3 and all(k.pdl for n in fused for k in read_launch(n).kernels())
    rep = check_models(path, res.model, provider="cuda")
    assert rep.ok, "\n".join(rep.lines())
    feeds = random_feeds(res.model, None, seed=7)
    ref = ort.InferenceSession(path, providers=[("CUDAExecutionProvider", {"use_tf32": "0"})])
    names = [o.name for o in ref.get_outputs()]
    want = dict(zip(names, ref.run(None, feeds)))
    sess = ortfuse.InferenceSession(res.model, providers=["CUDAExecutionProvider"])
    assert sess.fused_kernels
    for _ in range(20):
        for out, got in zip(names, sess.run(None, feeds)):
            assert compare(out, got, want[out]).ok, out
    assert_cuda_graph_replay(res.model, feeds, want, runs=10)

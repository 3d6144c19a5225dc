"""Programmatic dependent launches (Target.pdl, `--pdl`): kernels built for them open with
ofz::grid_dependency_sync (griddepcontrol.wait, then launch_dependents, sm_90 only) and carry the node
attribute `pdl` that makes the library launch them so; off by default, and off where a target arch lacks them.
The launch itself runs on a GPU only (tests/runtime/test_gpu_pdl.py)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, model, node, vi
from ortfuse.api import compile_model, target_for
from ortfuse.check import check_models
from ortfuse.config import Options
from ortfuse.customops.attrs import read_launch

SYNC = "ofz::grid_dependency_sync();"


def _block():
    """MatMul + bias + erf GELU (BERT's FFN) and Softmax(x * 0.5): a GEMM and a row kernel."""
    rng = np.random.default_rng(0)
    k, n = 768, 3072
    w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float16)  # noqa: E731
    return model([node("MatMul", ["x", "w"], ["p"]), node("Add", ["p", "b"], ["z"]),
                  node("Div", ["z", "sq2"], ["d"]), node("Erf", ["d"], ["e"]), node("Add", ["e", "one"], ["e1"]),
                  node("Mul", ["z", "e1"], ["g0"]), node("Mul", ["g0", "half"], ["g"]),
                  node("Mul", ["x", "half"], ["h"]), node("Softmax", ["h"], ["out"], axis=-1)],
                 [vi("x", TP.FLOAT16, ["n", 128, k])], [vi("g", TP.FLOAT16, None), vi("out", TP.FLOAT16, None)],
                 [const("w", w(k, n), np.float16), const("b", w(n), np.float16), const("sq2", 1.4142135, np.float16),
                  const("one", 1.0, np.float16), const("half", 0.5, np.float16)])


def test_pdl_kernels_wait_first_and_say_so_in_their_nodes():
    m = _block()
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), pdl=True))
    assert len(res.kernels) >= 2
    for k in res.kernels:
        src = k.compiled.source
        body = src[src.index(f"{k.compiled.entry}(const OfzArgs a"):]
        lines = [ln.strip() for ln in body.splitlines()[1:]]
        first = next(i for i, ln in enumerate(lines) if not ln.startswith("ofz::prefetch_l2_share("))
        assert lines[first] == SYNC, body[:400]  # before any access to memory but constants' prefetch
        assert k.compiled.entry.endswith("_pdl")
        ptx = k.compiled.ptx.decode() if isinstance(k.compiled.ptx, bytes) else k.compiled.ptx
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
        # the GEMM prefetches its weight and bias (768 x 3072 and 3072 fp16) first; the row kernel nothing
        fetch = [line.strip() for line in body.splitlines()[1:] if "prefetch_l2_share" in line]
        if k.region.kind == "gemm":
            sizes = sorted(int(f.split(", ")[1].rstrip("LL);")) for f in fetch)
            assert sizes == [3072 * 2, 768 * 3072 * 2] and "cp.async.bulk.prefetch.L2.global" in ptx, fetch
        else:
            assert not fetch
    assert all(read_launch(n).pdl for n in res.model.graph.node if n.domain == "ortfuse")
    from ortfuse.report import summary
    assert "dependent launches:   2 kernels may start while the one before finishes (--pdl, sm_90+); 1 prefetch " \
        "their weights into L2 first" in summary(res)
    rep = check_models(m, res.model, emulate=True, input_shapes={"x": (2, 128, 768)})  # a no-op on the host
    assert rep.ok, "\n".join(rep.lines())


@pytest.mark.parametrize("archs,pdl", [((90,), False), ((80, 90), True), ((80,), True)])
def test_no_pdl_by_default_nor_where_an_arch_lacks_it(archs, pdl):
    res = compile_model(_block(), None, ",".join(f"sm_{a}" for a in archs), options=Options(archs=archs, pdl=pdl))
    assert res.kernels
    for k in res.kernels:
        assert SYNC not in k.compiled.source and not k.compiled.entry.endswith("_pdl")
    assert not any(read_launch(n).pdl for n in res.model.graph.node if n.domain == "ortfuse")
    assert not target_for(archs, True, pdl).pdl


def test_the_environment_turns_it_on(monkeypatch):
    monkeypatch.delenv("ORTFUSE_PDL", raising=False)
    assert not Options().pdl
    monkeypatch.setenv("ORTFUSE_PDL", "1")
    assert Options().pdl and target_for((90,), True, Options().pdl).pdl
    monkeypatch.setenv("ORTFUSE_PDL", "0")
    assert not Options().pdl

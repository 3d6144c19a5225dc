"""bench/kernels.py on the CPU: which regions get rows, what each is compared with, and that ORT's
MultiHeadAttention baseline computes the attention we think it does. Device times need the GPU; here a
stand-in timer runs every model once on ORT's CPU EP (so each must be a valid model) and returns a
figure per kind."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from ortfuse.api import compile_model
from ortfuse.bench import kernels, zoo
from ortfuse.runtime import FallbackWarning, InferenceSession


def _cpu_timer(calls: list):
    def timer(model: onnx.ModelProto, feeds, fused: bool) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            sess = (InferenceSession(model, providers=["CPUExecutionProvider"]) if fused else
                    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]))
        outs = sess.run(None, dict(feeds))
        assert all(np.isfinite(o).all() for o in outs if o.dtype.kind == "f")
        ops = {n.op_type for n in model.graph.node}
        calls.append(ops)
        return 10.0 if fused else 30.0 if "MultiHeadAttention" in ops else 20.0
    return timer


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_rows_cover_gemms_and_attention_at_two_batches(name):
    res = compile_model(str(zoo.build(name, "fp32", tiny=True)))
    calls: list = []
    rows = kernels.measure(res, batch=4, timer=_cpu_timer(calls))
    kinds = {r.kind for r in rows}
    assert "attention" in kinds and kinds & {"gemm", "gemm_row"}
    assert {b for r in rows for b in ("batch=1", "batch=4") if b in r.binding} == {"batch=1", "batch=4"}
    attn = [r for r in rows if r.kind == "attention"]
    # transformers 5 hands both an additive [batch, 1, seq, seq] mask: the same function is the bias form
    assert all(r.library == "ORT MultiHeadAttention (mask as attention_bias)" and "additive mask" in r.what
               for r in attn)
    assert all(set(r.extra) == {"MHA, key padding", "MHA, causal + key padding", "MHA, no mask"} for r in attn)
    assert sum("MultiHeadAttention" in ops for ops in calls) == 4 * len(attn)
    gemm = [r for r in rows if r.kind != "attention"]
    assert all(r.library.startswith("cuBLAS") and r.flops > 0 for r in gemm)
    assert all(r.ours_us == 10.0 and r.library_us == 20.0 and r.vs_library == 0.5 for r in gemm)
    # identical layers are measured once: tiny models have 2 layers, so regions pair up
    assert any(len(r.regions) >= 2 for r in rows)
    assert sum(len(r.regions) for r in rows) == 2 * sum(1 for k in res.kernels if k.region.kind in kernels.KINDS)
    text = kernels.render(rows)
    assert "within 15%" in text and "MultiHeadAttention" in text


def _reference(feeds, s: kernels.AttentionSize, mask: str) -> np.ndarray:
    q, k, v = (feeds[n].astype(np.float64).reshape(s.batch, -1, s.heads, dim).transpose(0, 2, 1, 3)
               for n, dim in (("query", s.d), ("key", s.d), ("value", s.dv)))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(s.d)
    if mask in ("padding", "causal+padding", "causal"):
        keep = feeds["key_padding_mask"][:, None, None, :].astype(bool) if mask != "causal" else True
        if mask in ("causal+padding", "causal"):
            keep = keep & np.tril(np.ones((s.sq, s.sk), bool))[None, None]
        scores = np.where(keep, scores, -1e30)
    elif mask == "bias":
        scores = scores + feeds["attention_bias"].astype(np.float64)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(s.batch, s.sq, s.heads * s.dv)


@pytest.mark.parametrize("mask", ["none", "padding", "causal", "causal+padding", "bias"])
def test_multihead_attention_baseline_computes_the_same_attention(mask):
    s = kernels.AttentionSize(3, 2, 12, 12, 8, 8, TensorProto.FLOAT, mask)
    model, feeds = kernels.mha_model(s)
    onnx.checker.check_model(model)
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert out.shape == (3, 12, 16)
    np.testing.assert_allclose(out, _reference(feeds, s, mask), rtol=1e-4, atol=1e-5)


def test_a_causal_rule_the_kernel_computes_is_timed_against_causal_mha():
    # ONNX's Attention with is_causal over a dynamic sequence: no mask tensor, the rule computed in the kernel;
    # ORT's MultiHeadAttention baseline is its unidirectional form, not attention without a mask
    from helpers import onnx_attention
    res = compile_model(onnx_attention(TensorProto.FLOAT16, "causal"))
    (r,) = [r for r in res.plan.regions if r.kind == "attention"]
    size = kernels.attention_size(res.graph, r)
    assert size.mask == "causal" and "causal rule" in size.text()
    assert any(a.name == "unidirectional" and a.i == 1 for a in kernels.mha_model(size)[0].graph.node[0].attribute)


@pytest.mark.gpu
def test_device_times_on_the_gpu():
    """The real timer end to end on tiny BERT fp16: every row measured, ORT's MultiHeadAttention included."""
    res = compile_model(str(zoo.build("bert", "fp16", tiny=True)))
    rows = kernels.measure(res, batch=8)
    assert rows and all(r.ours_us > 0 and r.library_us > 0 and r.ort_region_us > 0 for r in rows)
    assert all(v > 0 for r in rows for v in r.extra.values())
    assert any(r.kind == "attention" for r in rows)


def test_with_wgmma_the_other_instruction_families_are_timed_alongside():
    # fp16 MatMul + bias + Relu with wgmma enabled: each GEMM row also times the best tile of each family not
    # chosen (mma.sync, wgmma fed by cp.async, wgmma fed by TMA), all as fused nodes
    from helpers import const, model, node, vi
    from ortfuse.config import Options
    rng = np.random.default_rng(0)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Relu", ["z"], ["out"])],
              [vi("x", TensorProto.FLOAT16, ["n", 256, 512])], [vi("out", TensorProto.FLOAT16, None)],
              [const("w", rng.standard_normal((512, 1024)) * 0.05, np.float16),
               const("b", rng.standard_normal(1024), np.float16)])
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), wgmma=True))
    calls: list = []
    rows = kernels.measure(res, batch=2, timer=_cpu_timer(calls))
    assert rows and all(r.kind == "gemm" for r in rows)
    first = res.kernels[0].spec.tiles[0]
    chosen = {0: "mma.sync", 1: "wgmma", 2: "wgmma+TMA"}[first[7] if len(first) > 7 else 0]
    for r in rows:
        assert len(r.extra) == 2 and all(v == 10.0 for v in r.extra.values())
        families = {"mma.sync" if k.startswith("mma.sync") else k.split()[-1] for k in r.extra}
        assert families == {"mma.sync", "wgmma", "wgmma+TMA"} - {chosen}, r.extra


def test_ncu_attention_runs_our_kernel_and_multiheadattention(monkeypatch, capsys):
    # bench/ncu_attention.py's wiring on the CPU (Nsight Compute needs the GPU): both sessions built from the
    # model's first attention region at the large batch, each run --runs times
    from ortfuse import runtime
    from ortfuse.bench import ncu_attention
    runs: list[str] = []
    plain, ours = ort.InferenceSession, runtime.InferenceSession

    class Cpu:
        def __init__(self, model, providers=None, fused=False):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FallbackWarning)
                self.s = ours(model, providers=["CPUExecutionProvider"]) if fused else \
                    plain(model, providers=["CPUExecutionProvider"])
            self.ops = {n.op_type for n in (model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)).graph.node}

        def run(self, names, feeds):
            runs.append("mha" if "MultiHeadAttention" in self.ops else "ours")
            return self.s.run(names, feeds)
    monkeypatch.setattr(runtime, "InferenceSession", lambda m, providers=None: Cpu(m, fused=True))
    monkeypatch.setattr(ort, "InferenceSession", lambda m, providers=None: Cpu(m))
    assert ncu_attention.main([str(zoo.build("bert", "fp32", tiny=True)), "--batch", "4", "--runs", "2"]) == 0
    assert runs == ["ours", "ours", "mha", "mha"]
    assert "= ours" in capsys.readouterr().out

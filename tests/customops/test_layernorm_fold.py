"""LayerNorm prologues (search/norm_fold.py, rewriter/layernorm_fold.py, ortfuse_gemm.h's LayerNormFold):
a LayerNormalization read only by a GEMM's A operand folds into the GEMM kernel. End to end: graph ->
search -> lowering -> NVRTC (sm_80, sm_90) -> CPU emulation, each kernel against ORT CPU on its function
body and the optimized model (functions inlined) against ORT CPU on the original, random non-zero inputs;
tolerances: fp32 1e-5, fp16 1e-2 (check_models' defaults); bf16 against numpy in fp64, 1e-2."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

from helpers import bf16, const, fused_parity, launch_spec, model, node, vi
from ortfuse.customops import tiles
from ortfuse.customops.lower import lower
from ortfuse.errors import InputError
from ortfuse.customops.target import for_cc, parse_arch
from ortfuse.rewriter.layernorm_fold import LayerNormFold, fold_constants, folded_weight
from ortfuse.rewriter.shapes import build_graph
from ortfuse.search import legal, norm_fold
from ortfuse.search.cost import CostModel

F, H, BF = TP.FLOAT, TP.FLOAT16, TP.BFLOAT16
NP = {F: np.float32, H: np.float16}


@pytest.fixture
def folds_pay(monkeypatch):
    """Correctness tests take the folds whatever the whole-model estimate says."""
    monkeypatch.setattr(CostModel, "pays", staticmethod(lambda times: True))


def _w(shape, dt, seed, scale=0.2, offset=0.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale + offset).astype(NP[dt])


def _pre_ln(dt, k, n, beta=True, reshape=False, gemm=False):
    """LayerNorm(x) -> [Reshape to rows] -> MatMul w (or Gemm transB with its bias) + b -> Relu."""
    ln_in = ["x", "g", "beta"] if beta else ["x", "g"]
    nodes = [node("LayerNormalization", ln_in, ["y"], axis=-1, epsilon=1e-5)]
    a = "y"
    if reshape:
        nodes.append(node("Reshape", ["y", "rows"], ["y2"]))
        a = "y2"
    if gemm:
        nodes.append(node("Gemm", [a, "wt", "c"], ["p"], transB=1))
    else:
        nodes.append(node("MatMul", [a, "w"], ["p"]))
    nodes += [node("Add", ["p", "b"], ["z"]), node("Relu", ["z"], ["out"])]
    inits = [const("w", _w((k, n), dt, 1), NP[dt]), const("wt", _w((n, k), dt, 5), NP[dt]),
             const("c", _w(n, dt, 6), NP[dt]), const("b", _w(n, dt, 2), NP[dt]),
             const("g", _w(k, dt, 3, 0.5, 1.0), NP[dt]), const("beta", _w(k, dt, 4, 0.5), NP[dt]),
             const("rows", [-1, k], np.int64)]
    used = {t for nd in nodes for t in nd.input}
    rows = ["n", k] if gemm else ["n", 7, k]  # Gemm takes matrices
    return model(nodes, [vi("x", dt, rows)], [vi("out", dt, None)], [i for i in inits if i.name in used])


def _folded(res) -> list:
    return [k for k in res.kernels if "LayerNormFold<" in k.compiled.source]


def test_layernorm_folds_into_the_gemm(folds_pay):
    dt = H
    k, n = 64, 96
    res = fused_parity(_pre_ln(dt, k, n), {"x": ("n", 7, k)}, {"x": (3, 7, k)}, ("gemm",))  # 21 rows: a partial tile
    assert len(_folded(res)) == 1
    # the weight, gamma, beta and bias slots carry W'', ones, zeros and b + beta W; the function body is the
    # region's own sub-graph on them
    node_ = next(nd for nd in res.model.graph.node if nd.domain == "ortfuse")
    assert sorted(t for t in node_.input if "__ortfuse_ln" in t) == [
        "b__ortfuse_ln_w", "beta__ortfuse_ln_w", "g__ortfuse_ln_w", "w__ortfuse_ln"]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in res.model.graph.initializer}
    assert not {"w", "g", "beta", "b"} & set(inits)  # no copy of the weight stays behind
    assert (inits["g__ortfuse_ln_w"] == 1).all() and (inits["beta__ortfuse_ln_w"] == 0).all()
    assert np.abs(inits["w__ortfuse_ln"].astype(np.float64).sum(axis=0)).max() < 1e-4  # columns sum to ~zero
    body = next(f for f in res.model.functions if f.domain == "ortfuse")
    assert [nd.op_type for nd in body.node] == ["LayerNormalization", "MatMul", "Add", "Relu"]


def test_rows_far_from_zero_mean(folds_pay):
    # rows with mean 20 and std 0.25: the kernel's X W'' is mean * colsum(W'') + (X - mean) W'', so the
    # columns of W'' must sum to zero as stored (else 80x their rounding residue, relative to the deviations,
    # lands in the result), and the moments must not lose the variance under the mean
    k, n = 128, 64
    m = _pre_ln(H, k, n)
    x = (np.random.default_rng(9).standard_normal((2, 7, k)) * 0.25 + 20).astype(np.float16)
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    import onnxruntime as ort
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,)))
    assert len(_folded(res)) == 1
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    spec = res.kernels[0].spec
    node_ = next(nd for nd in res.model.graph.node if nd.domain == "ortfuse")
    vals = {t.name: onnx.numpy_helper.to_array(t) for t in res.model.graph.initializer} | {"x": x}
    out = np.zeros((2, 7, n), np.float16)
    launch_spec(spec, [vals[t] for t in node_.input] + [out], [2])
    ref = np.maximum(want.astype(np.float64), 0)
    assert np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max() < 1e-2


def test_reshaped_rows_ragged_k_and_no_beta(folds_pay):
    dt = H
    # GPT-2's Conv1D: LayerNorm -> Reshape(-1, k) -> MatMul (static rows: the search leaves a GEMM whose output
    # has a computed symbolic dim to ORT); K 72 leaves a partial k tile; no beta: no d
    k, n = 72, 40
    res = fused_parity(_pre_ln(dt, k, n, beta=False, reshape=True), {"x": (3, 7, k)}, None, ("gemm",))
    src = _folded(res)[0].compiled.source
    assert "LayerNormFold<" in src


def test_gemm_trans_b_with_its_own_bias(folds_pay):
    dt = H
    k, n = 64, 48
    res = fused_parity(_pre_ln(dt, k, n, gemm=True), {"x": ("n", k)}, {"x": (19, k)}, ("gemm",))
    assert len(_folded(res)) == 1


@pytest.mark.parametrize("rows", [19, 700])  # mma.sync; the TMA mainloop (its weight transposed offline)
def test_bf16_against_numpy(rows):
    k, n = 64, 80
    m = _pre_ln(F, k, n)  # built in fp32, retyped to bf16 below
    for t in m.graph.initializer:
        if t.data_type == F:
            t.CopyFrom(onnx.helper.make_tensor(t.name, BF, t.dims, bf16(onnx.numpy_helper.to_array(t))[0].tobytes(),
                                               raw=True))
    for v in (*m.graph.input, *m.graph.output):
        v.type.tensor_type.elem_type = BF
    g = build_graph(m, {"x": (rows // 7 + 1, 7, k)})
    fold = norm_fold.find(g, 1)
    assert isinstance(fold, norm_fold.NormFold)
    region = legal.classify(g, {0, 1, 2, 3})
    assert region.kind == "gemm"
    spec = lower(g, region, parse_arch("sm_90"))
    assert spec.ln_fold is not None
    c = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
    assert spec.ln_fold == LayerNormFold("w", "g", "beta", "b", False)
    assert spec.kernel.tma == (rows > 100)
    b = rows // 7 + 1
    x_bits, xv = bf16(np.random.default_rng(4).standard_normal((b, 7, k)) * 2 + 1)
    slots = {"x": x_bits} | {t: v.view(np.uint16) for t, v in (c | fold_constants(spec.ln_fold, c)).items()}
    for t, perm in spec.input_perms:
        slots[t] = np.ascontiguousarray(np.transpose(slots[t], perm))
    out = np.zeros((b, 7, n), np.uint16)
    launch_spec(spec, [slots[t] for t in spec.inputs] + [out], [b])
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    mu, var = xv.mean(-1, keepdims=True), xv.var(-1, keepdims=True)
    y = (xv - mu) / np.sqrt(var + 1e-5) * f64(c["g"]) + f64(c["beta"])
    ref = np.maximum(y @ f64(c["w"]) + f64(c["b"]), 0)
    got = (out.astype(np.uint32) << 16).view(np.float32)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-2


def test_pre_ln_layer_leaves_plain_epilogues(folds_pay):
    # x1 = x + LN1(x) W1 + b1; out = LN2(x1) W2 + b2: both LayerNorms fold, so the residual sum is a plain
    # epilogue of the first GEMM (no row-spanning tile) and no LayerNorm kernel is left
    k = 64
    m = model([node("LayerNormalization", ["x", "g1", "e1"], ["y1"], axis=-1),
               node("MatMul", ["y1", "w1"], ["p1"]), node("Add", ["p1", "b1"], ["z1"]), node("Add", ["z1", "x"], ["x1"]),
               node("LayerNormalization", ["x1", "g2", "e2"], ["y2"], axis=-1),
               node("MatMul", ["y2", "w2"], ["p2"]), node("Add", ["p2", "b2"], ["out"])],
              [vi("x", H, ["n", 7, k])], [vi("out", H, None), vi("x1", H, None)],
              [const(f"w{i}", _w((k, k), H, i), np.float16) for i in (1, 2)] +
              [const(f"b{i}", _w(k, H, 10 + i), np.float16) for i in (1, 2)] +
              [const(f"g{i}", _w(k, H, 20 + i, 0.3, 1.0), np.float16) for i in (1, 2)] +
              [const(f"e{i}", _w(k, H, 30 + i), np.float16) for i in (1, 2)])
    res = fused_parity(m, {"x": ("n", 7, k)}, {"x": (3, 7, k)}, ("gemm", "gemm"))
    assert len(_folded(res)) == 2


def test_what_does_not_fold():
    k = 64
    h = lambda s: _w(s, H, 1)  # noqa: E731
    m = model([node("LayerNormalization", ["x", "g", "e"], ["y"], axis=-1),  # post-LN: y is also the residual
               node("MatMul", ["y", "w"], ["p"]), node("Add", ["p", "y"], ["o1"]),
               node("LayerNormalization", ["x", "g", "e"], ["y2"], axis=-1),  # weight read by two GEMMs
               node("MatMul", ["y2", "ws"], ["p2"]), node("MatMul", ["x", "ws"], ["p3"]),
               node("LayerNormalization", ["x", "gi", "e"], ["y4"], axis=-1),  # gamma fed at run time
               node("MatMul", ["y4", "w4"], ["p4"]),
               node("LayerNormalization", ["x", "g", "e"], ["y5"], axis=-1),  # beta, but no bias to carry beta W
               node("MatMul", ["y5", "w5"], ["p5"])],
              [vi("x", H, ["n", k]), vi("gi", H, [k])],
              [vi("o1", H, None), vi("p2", H, None), vi("p3", H, None), vi("p4", H, None), vi("p5", H, None)],
              [const("w", h((k, k)), np.float16), const("ws", h((k, k)), np.float16),
               const("w4", h((k, k)), np.float16), const("w5", h((k, k)), np.float16), const("g", h(k), np.float16),
               const("e", h(k), np.float16)])
    g = build_graph(m, {})
    assert "also read elsewhere, so it is written" in norm_fold.find(g, 1)
    assert "scaling it by the LayerNorm's gamma would copy it" in norm_fold.find(g, 4)
    assert "is not a constant" in norm_fold.find(g, 7)
    assert norm_fold.find(g, 5) is None  # A is a graph input
    assert "needs a bias vector added to the GEMM's result" in norm_fold.find(g, 9)


def test_folded_tiles_never_split_k():
    # BERT-base's FFN down-projection at batch 1: the plain tile splits K across a cluster; a fold cannot
    tgt = for_cc(90)
    plain = tiles.rank_tiles(tgt, 128, 768, 3072, 1, 2, tiles.MMA_F16, False, top_k=50)
    folded = tiles.rank_tiles(tgt, 128, 768, 3072, 1, 2, tiles.MMA_F16, False, top_k=50, staged=(tiles.NORMED, 0))
    assert any(r.split > 1 for r in plain) and folded and all(r.split == 1 for r in folded)
    t = folded[0].tile
    assert t.issue_per_ktile(tiles.MMA_F16, 2, (tiles.NORMED, 0)) > t.issue_per_ktile(tiles.MMA_F16, 2, (0, 0))


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_folded_weight_columns_sum_to_zero_as_stored(dtype):
    # centered and rounded, then flipped to the other neighbour where that brings a column's sum to zero:
    # the sums shrink by more than 30x while no element moves further than one step from its exact value
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((300, 70)) * 0.05 + 0.01).astype(dt)
    gamma = (rng.standard_normal(300) * 0.3 + 1).astype(dt)
    wf = folded_weight(w, gamma, False).astype(np.float64)
    exact = w.astype(np.float64) * gamma.astype(np.float64)[:, None]
    exact -= exact.mean(axis=0)
    plain = exact.astype(dt).astype(np.float64)
    assert np.abs(wf.sum(axis=0)).max() < np.abs(plain.sum(axis=0)).max() / 30
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - (10 if dt == np.float16 else 7))
    ulp = np.maximum(ulp, 2.0 ** -24 if dt == np.float16 else 0.0)  # fp16 subnormals
    assert (np.abs(wf - exact) <= ulp * 1.0001).all()
    assert np.array_equal(folded_weight(np.ascontiguousarray(w.T), gamma, True), wf.T.astype(dt))


def test_fp32_does_not_fold():
    g = build_graph(_pre_ln(F, 64, 96), {})
    assert "LayerNorms fold into 16-bit GEMMs only" in norm_fold.find(g, 1)


def test_fold_modes():
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    m = _pre_ln(H, 64, 96)
    for mode, folded in (("on", 1), ("off", 0)):
        res = compile_model(m, {"x": ("n", 7, 64)}, "sm_90", options=Options(archs=(90,), ln_fold=mode))
        assert len(_folded(res)) == folded
    with pytest.raises(InputError, match="LayerNorm fold mode 'sometimes'"):
        Options(ln_fold="sometimes")


@pytest.mark.parametrize("seed", range(4))
def test_random_pre_ln_blocks(seed):
    # random shapes and structure: K (ragged k tiles), N, rows, epsilon, beta zero or not, the bias Add in
    # either operand order or a Gemm's C, an Unsqueeze between the LayerNorm and the MatMul
    rng = np.random.default_rng(100 + seed)
    k, n = int(rng.choice([16, 24, 40, 64, 72, 136])), int(rng.choice([8, 24, 48, 80]))
    gemm, chain, zero_beta = rng.random() < 0.3, rng.random() < 0.4, rng.random() < 0.3
    w = lambda shape, s=0.3, off=0.0: (rng.standard_normal(shape) * s + off).astype(np.float16)  # noqa: E731
    nodes = [node("LayerNormalization", ["x", "g", "beta"], ["y"], axis=-1, epsilon=float(rng.choice([1e-5, 1e-12])))]
    a = "y"
    if chain and not gemm:
        nodes.append(node("Unsqueeze", ["y", "ax0"], ["y2"]))
        a = "y2"
    if gemm:
        nodes.append(node("Gemm", [a, "wt", "c"], ["out0"], transB=1))
        x_shape, inits = ["n", k], [const("wt", w((n, k)), np.float16), const("c", w(n), np.float16)]
    else:
        order = ["p", "b"] if rng.random() < 0.5 else ["b", "p"]
        nodes += [node("MatMul", [a, "w"], ["p"]), node("Add", order, ["out0"])]
        x_shape, inits = ["n", 5, k], [const("w", w((k, n)), np.float16), const("b", w(n), np.float16)]
    nodes.append(node("Tanh", ["out0"], ["out"]))
    beta = np.zeros(k, np.float16) if zero_beta else w(k)
    inits += [const("g", w(k, 0.3, 1.0), np.float16), const("beta", beta, np.float16),
              const("ax0", [0], np.int64)]
    used = {t for nd in nodes for t in nd.input}
    m = model(nodes, [vi("x", H, x_shape)], [vi("out", H, None)], [i for i in inits if i.name in used])
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), ln_fold="on"))
    assert len(_folded(res)) == 1, [str(r) for r in res.plan.refusals]
    rows = int(rng.integers(1, 40))
    rep = check_models(m, res.model, emulate=True, input_shapes={"x": [rows] + x_shape[1:]})
    assert rep.ok, "\n".join(rep.lines())


def test_constant_rows_with_a_tiny_epsilon():
    # a row with no deviation normalizes to 0 (ORT: beta): the kernel's accumulator still holds the rounding
    # of mean * colsum(W''), which 1/sqrt(1e-12) would blow up; its rstd is 0 instead
    k, n = 128, 64
    m = _pre_ln(H, k, n)
    ln = next(nd for nd in m.graph.node if nd.op_type == "LayerNormalization")
    next(a for a in ln.attribute if a.name == "epsilon").f = 1e-12
    x = np.random.default_rng(2).standard_normal((2, 7, k)).astype(np.float16)
    x[0, :3] = np.float16(1.5)
    x[1, 4] = np.float16(-40)
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    import onnxruntime as ort
    res = compile_model(m, None, "sm_90", options=Options(archs=(90,), ln_fold="on"))
    assert len(_folded(res)) == 1
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    node_ = next(nd for nd in res.model.graph.node if nd.domain == "ortfuse")
    vals = {t.name: onnx.numpy_helper.to_array(t) for t in res.model.graph.initializer} | {"x": x}
    out = np.zeros((2, 7, n), np.float16)
    launch_spec(res.kernels[0].spec, [vals[t] for t in node_.input] + [out], [2])
    ref = want.astype(np.float64)
    assert np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max() < 1e-2


def test_a_folded_gemm_is_priced_and_lowered_on_the_tma_mainloop_with_wgmma(folds_pay):
    # since session 20 the TMA mainloop gathers the fold's moments too: with wgmma enabled a folded region is
    # priced at the wgmma rate and lowered to a TMA kernel (before, mma.sync: 2.0-2.6x slower at 4096 rows)
    from ortfuse.api import target_for
    from ortfuse.customops.lower import lower
    from ortfuse.search.regions import plan
    g = build_graph(_pre_ln(H, 768, 3072), {"x": (600, 7, 768)})  # 4200 rows: compute-bound
    on, off = target_for((90,), True), target_for((90,), False)
    (r,) = [r for r in plan(g, on).regions if r.kind == "gemm" and norm_fold.in_region(g, r.nodes)]
    assert CostModel(on).ours_us(g, r) < 0.9 * CostModel(off).ours_us(g, r)
    spec = lower(g, r, on)
    assert spec.kernel.tma and spec.input_perms == (("w", (1, 0)),)
    # under a row-wise epilogue the fold stays on mma.sync, and so does its price
    anchor = next(g.nodes[i] for i in r.nodes if g.nodes[i].op_type == "MatMul")
    assert CostModel(on).gemm_us(g, anchor, ours=True)[0] < CostModel(on).gemm_us(g, anchor, ours=True, wgmma_ok=False)[0]


@pytest.mark.parametrize("k,n", [(200, 520), (768, 768)])  # K 200: a ragged last k tile in the swizzled stage
def test_fold_on_the_tma_mainloop_matches_ort(folds_pay, k, n):
    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.config import Options
    m = _pre_ln(H, k, n)
    res = compile_model(m, {"x": (100, 7, k)}, "sm_90", options=Options(archs=(90,)))
    (kern,) = _folded(res)
    assert kern.spec.kernel.tma
    ((_, rsc),) = kern.compiled.resources
    assert rsc.spill_bytes == 0
    rep = check_models(m, res.model, emulate=True)
    assert rep.ok, "\n".join(rep.lines())


def test_whole_model_estimate_keeps_the_measured_fold_floor():
    # GPT-2's FFN-up (768 -> 3072) with its LayerNorm, at 4096 rows: the folded kernel is priced at least
    # Target.ln_fold_floor times the plain one (measured on an H100: folding lost to our row kernel + GEMM),
    # so "auto" leaves the LayerNorm as its own kernel on sm_90; with the floor at 1.0 the tile model alone
    # prices the fold, and the same graph folds (at one binding, so one figure each)
    import dataclasses
    from ortfuse.search.regions import plan
    k, n = 768, 3072
    g = build_graph(_pre_ln(H, k, n), {"x": (585, 7, k)})  # 4095 rows
    tgt = for_cc(90)
    assert tgt.ln_fold_floor > 1.0
    cost = CostModel(tgt)
    folded = plan(g, tgt, cost, ln_fold="on")
    plain = plan(g, tgt, cost, ln_fold="off")
    fold_region = next(r for r in folded.regions if r.kind == "gemm")
    gemm_region = next(r for r in plain.regions if r.kind == "gemm")
    assert norm_fold.in_region(g, fold_region.nodes) is not None
    assert cost.ours_us(g, fold_region) >= tgt.ln_fold_floor * cost.ours_us(g, gemm_region) * 0.999
    auto = plan(g, tgt, cost)
    assert not any(norm_fold.in_region(g, r.nodes) for r in auto.regions)
    assert any("LayerNorm prologues" in r.subject for r in auto.refusals)
    free = dataclasses.replace(tgt, ln_fold_floor=1.0)
    assert any(norm_fold.in_region(g, r.nodes) for r in plan(g, free, CostModel(free)).regions)

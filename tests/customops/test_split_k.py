"""Split-K GEMMs end to end (sm_90 clusters): regions whose tiles are too few for the SMs and whose K is
long are lowered with SPLIT > 1, carry `split_k` on the fused node, and run in CPU emulation in clusters of
the size the native library picks for an H100 (ortfuse.customops.attrs.cluster_for), against ORT CPU. The
symbolic batch is bound to sizes that give different cluster sizes, including none."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import _rand, const, model, node, vi
from ortfuse.api import compile_model
from ortfuse.check import check_models
from ortfuse.config import Options
from ortfuse.customops.attrs import cluster_for, read_launch
from ortfuse.customops.target import for_cc
from ortfuse.report import markdown

H100_SMS = for_cc(90).sm_count


def _matmul_act(dt, k: int, n: int, act: str):
    """y = act(x @ w + b), x [b, 37, k]: a handful of tiles over a long K."""
    w, b = _rand((k, n), dt, 1, scale=0.05), _rand((n,), dt, 2)
    nodes = [node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"])]
    if act == "silu":
        nodes += [node("Sigmoid", ["z"], ["s"]), node("Mul", ["z", "s"], ["out"])]
    else:
        nodes += [node("Relu", ["z"], ["out"])]
    return model(nodes, [vi("x", dt, ["b", 37, k])], [vi("out", dt, None)],
                 [const("w", w, w.dtype), const("b", b, b.dtype)]), {"x": ("b", 37, k)}, lambda bs: {"x": (bs, 37, k)}


def _matmul_layernorm(dt, k: int, n: int):
    """LayerNorm(x @ w + b + r) over N: a row-wise epilogue (whole rows per tile), split over K."""
    w, b = _rand((k, n), dt, 3, scale=0.05), _rand((n,), dt, 4)
    g, beta = _rand((n,), dt, 5) + 1, _rand((n,), dt, 6)
    nodes = [node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Add", ["z", "r"], ["s"]),
             node("LayerNormalization", ["s", "g", "beta"], ["out"], axis=-1, epsilon=1e-5)]
    inits = [const(nm, v, v.dtype) for nm, v in (("w", w), ("b", b), ("g", g), ("beta", beta))]
    return (model(nodes, [vi("x", dt, ["b", 16, k]), vi("r", dt, ["b", 16, n])], [vi("out", dt, None)], inits),
            {"x": ("b", 16, k), "r": ("b", 16, n)}, lambda bs: {"x": (bs, 16, k), "r": (bs, 16, n)})


def _conv_relu_residual(dt, c: int, oc: int, hw: int):
    """Relu(Conv3x3(x) + bias + r) on a small image with many channels: K = 9 C, few pixels."""
    w, b = _rand((oc, c, 3, 3), dt, 7, scale=0.05), _rand((oc,), dt, 8)
    nodes = [node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             node("Add", ["y", "r"], ["z"]), node("Relu", ["z"], ["out"])]
    return (model(nodes, [vi("x", dt, ["b", c, hw, hw]), vi("r", dt, ["b", oc, hw, hw])], [vi("out", dt, None)],
                  [const("w", w, w.dtype), const("b", b, b.dtype)]),
            {"x": ("b", c, hw, hw), "r": ("b", oc, hw, hw)}, lambda bs: {"x": (bs, c, hw, hw), "r": (bs, oc, hw, hw)})


CASES = [
    ("fp16 MatMul+bias+SiLU", lambda: _matmul_act(TP.FLOAT16, 1024, 72, "silu"), "gemm"),
    ("fp32 SIMT MatMul+bias+Relu", lambda: _matmul_act(TP.FLOAT, 2048, 40, "relu"), "gemm"),
    # 45 columns: the reduction's last 16-byte group of a row holds one column, the one before a pair and more
    ("fp32 SIMT MatMul+bias+Relu, odd N", lambda: _matmul_act(TP.FLOAT, 2048, 45, "relu"), "gemm"),
    ("fp16 MatMul+bias+SiLU, odd N", lambda: _matmul_act(TP.FLOAT16, 1024, 45, "silu"), "gemm"),
    ("fp16 MatMul+residual+LayerNorm", lambda: _matmul_layernorm(TP.FLOAT16, 1536, 96), "gemm_row"),
    ("fp16 Conv3x3+residual+Relu", lambda: _conv_relu_residual(TP.FLOAT16, 256, 64, 6), "gemm"),
]


@pytest.mark.usefixtures("row_tiles_priced_by_the_tile_model")
@pytest.mark.parametrize("name,build,kind", CASES, ids=[c[0] for c in CASES])
def test_split_k_kernels_match_ort(name, build, kind):
    m, shapes, at = build()
    res = compile_model(m, shapes, "sm_90", options=Options(archs=(90,)))
    assert [r.kind for r in res.plan.regions] == [kind], [str(r) for r in res.plan.refusals]
    launch = read_launch(next(n for n in res.model.graph.node if n.domain == "ortfuse"))
    assert launch.split_k > 1, name
    assert f"split-K up to {launch.split_k}" in markdown(res, name)  # the report shows it
    clusters = set()
    for batch in (1, 2, 5):
        feeds = at(batch)
        shape = {**feeds, **{i.name: tuple(i.dims) for i in res.model.graph.initializer}}
        dims = launch.dims([shape[i] for i in launch_inputs(res)])
        clusters.add(cluster_for(launch.split_k, launch.grid(dims), H100_SMS))
        rep = check_models(m, res.model, emulate=True, input_shapes=feeds, seed=batch)
        assert rep.ok and rep.kernels, "\n".join(rep.lines())
    assert max(clusters) > 1, clusters  # the split really ran at some batch


def launch_inputs(res) -> list[str]:
    return list(next(n for n in res.model.graph.node if n.domain == "ortfuse").input)


def test_no_split_k_when_an_arch_without_clusters_is_targeted():
    m, shapes, _ = _matmul_act(TP.FLOAT16, 1024, 72, "silu")
    res = compile_model(m, shapes, "sm_80,sm_90", options=Options(archs=(80, 90)))
    fused = next(n for n in res.model.graph.node if n.domain == "ortfuse")
    assert read_launch(fused).split_k == 1
    assert "split_k" not in {a.name for a in fused.attribute}


def random_split_k_case(seed: int):
    """A seeded GEMM or Conv with few tiles and a long K and a random epilogue: (model, shapes, shapes at a
    batch). K sometimes breaks 16-byte row alignment, so operands are also staged element by element."""
    rng = np.random.default_rng(seed)
    dt = TP.FLOAT16 if rng.random() < 0.6 else TP.FLOAT
    k = int(rng.choice([384, 520, 1000, 1001, 1536, 2056]))
    n = int(rng.choice([24, 40, 64, 96, 136]))
    form = str(rng.choice(["matmul", "gemm", "row", "conv"]))
    inits, inputs, nodes = [], [], []

    def weight(name, shape, scale=0.05):
        w = _rand(shape, dt, int(rng.integers(1 << 30)), scale=scale)
        inits.append(const(name, w, w.dtype))
        return name

    if form == "conv":
        c, hw, ks = int(rng.choice([64, 112, 256])), int(rng.choice([4, 6, 9])), int(rng.choice([1, 3]))
        x_shape, y_shape = ("b", c, hw, hw), ("b", n, hw, hw)
        nodes.append(node("Conv", ["x", weight("w", (n, c, ks, ks)), weight("cb", (n,), 0.2)], ["y"],
                          kernel_shape=[ks, ks], pads=[ks // 2] * 4))
    elif form == "gemm":  # 2-D, B stored [N][K] (transB)
        x_shape, y_shape = ("b", k), ("b", n)
        nodes.append(node("Gemm", ["x", weight("w", (n, k)), weight("cb", (n,), 0.2)], ["y"], transB=1,
                          alpha=float(rng.choice([1.0, 0.5]))))
    else:
        rows = int(rng.choice([1, 5, 16, 33]))
        x_shape, y_shape = ("b", rows, k), ("b", rows, n)
        nodes += [node("MatMul", ["x", weight("w", (k, n))], ["y0"]), node("Add", ["y0", weight("cb", (n,), 0.2)], ["y"])]
    inputs.append(vi("x", dt, list(x_shape)))
    last = "y"
    if rng.random() < 0.5:  # residual
        inputs.append(vi("r", dt, list(y_shape)))
        nodes.append(node("Add", [last, "r"], ["res"]))
        last = "res"
    if form == "row":
        if rng.random() < 0.5:
            nodes.append(node("LayerNormalization", [last, weight("g", (n,), 1.0), weight("be", (n,), 0.2)], ["out"],
                              axis=-1, epsilon=1e-5))
        else:
            nodes.append(node("Softmax", [last], ["out"], axis=-1))
    else:
        act = str(rng.choice(["Relu", "Tanh", "Sigmoid"]))
        nodes.append(node(act, [last], ["out"]))
    m = model(nodes, inputs, [vi("out", dt, None)], inits)
    shapes = {i.name: tuple(d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim) for i in inputs}
    return m, shapes, lambda bs: {nm: tuple(bs if d == "b" else d for d in s) for nm, s in shapes.items()}


@pytest.mark.parametrize("seed", range(8))
def test_random_split_k_geometry_matches_ort(seed):
    m, shapes, at = random_split_k_case(seed)
    res = compile_model(m, shapes, "sm_90", options=Options(archs=(90,)))
    for batch in (1, 3):
        rep = check_models(m, res.model, emulate=True, input_shapes=at(batch), seed=seed)
        assert rep.ok, "\n".join(rep.lines())


def test_random_split_k_cases_do_split():
    splits = []
    for seed in range(8):
        m, shapes, _ = random_split_k_case(seed)
        res = compile_model(m, shapes, "sm_90", options=Options(archs=(90,)))
        splits += [k.spec.split_k for k in res.kernels if k.spec.tiles]
    assert sum(s > 1 for s in splits) >= 4, splits

"""The fused-node format (docs/design.md) through the CPU probe op `ortfuse.probe::Plan`, which shares the
parse / image choice / shape binding / shape inference code of the CUDA op and reports its launch plan."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T

from ortfuse.customops.attrs import cluster_for, launch_blocks
from ortfuse.runtime import library_path
from rt_models import PLAN_LEN, PROBE, fused_attrs, make_fused_node, model, vi

CPU = ["CPUExecutionProvider"]


def plan_model(n: Any = "N", cc: int = 90, name: str = "plan_node", inputs: list | None = None,
               outputs: list | None = None, **overrides: Any):
    attrs = fused_attrs(entry="ofz_test_axpy", sym_dims=[0, 0], units=[-1, 4], units_per_block=128,
                        out_dtypes=[T.FLOAT, T.FLOAT16], out_ranks=[2, 2], out_dims=[-1, 4, -1, 4])
    attrs.update(overrides)
    attrs = {k: v for k, v in attrs.items() if v is not None}
    inputs = inputs or [vi("X", T.FLOAT, [n, 4]), vi("Y", T.FLOAT, [n, 4])]
    outputs = outputs or [vi("Z", T.FLOAT, None), vi("W", T.FLOAT16, None), vi("P", T.INT64, None)]
    node = make_fused_node([i.name for i in inputs], [o.name for o in outputs], name=name, op_type="Plan",
                           domain=PROBE[0], probe_cc=cc, **attrs)
    return model([node], inputs, outputs, [PROBE])


def session(m) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library_path())
    return ort.InferenceSession(m.SerializeToString(), options, providers=CPU)


def run(sess: ort.InferenceSession, n: int) -> list[np.ndarray]:
    x = np.ones((n, 4), np.float32)
    return sess.run(None, {"X": x, "Y": x})


def test_symbolic_dims_bind_to_each_run() -> None:
    sess = session(plan_model())
    for n in (1, 33, 1000, 0):
        z, w, plan = run(sess, n)
        assert z.shape == (n, 4) and z.dtype == np.float32 and not z.any()
        assert w.shape == (n, 4) and w.dtype == np.float16
        grid, block, smem, _, _, units = plan[:6]
        assert (units, block, smem) == (4 * n, 128, 0)
        assert grid == -(-4 * n // 128)  # ceil; 0 means no launch
        assert plan[6] == n and not plan[7:22].any() and plan[22] == 1  # no clusters


def test_shape_inference_copies_symbols_and_values() -> None:
    outs = {o.name: (o.type, o.shape) for o in session(plan_model()).get_outputs()}
    assert outs == {"Z": ("tensor(float)", ["N", 4]), "W": ("tensor(float16)", ["N", 4]),
                    "P": ("tensor(int64)", [PLAN_LEN])}
    outs = {o.name: o.shape for o in session(plan_model(n=6)).get_outputs()}
    assert outs["Z"] == [6, 4]


def test_unknown_input_dims_stay_unknown() -> None:
    inputs = [vi("X", T.FLOAT, None), vi("Y", T.FLOAT, None)]  # rank unknown: inference leaves dims open
    sess = session(plan_model(inputs=inputs))
    z, _, plan = run(sess, 5)
    assert z.shape == (5, 4) and plan[6] == 5


# a Conv's output size on a symbolic image: d1 = floor((d0 - 1) / 2) + 1 (3x3, stride 2, pads 1 + 1) and
# d2 = floor((d1 + 0) / 3) + 1 from it, as sym_derived (term, add, div) triples
DERIVED = dict(sym_derived=[-1, -1, 2, -2, 0, 3], units=[-2, -3], out_dims=[-2, 4, -3, 4])


@pytest.mark.parametrize("n", [1, 2, 7, 640])
def test_derived_dims_follow_the_conv_output_rule(n: int) -> None:
    z, w, plan = run(session(plan_model(**DERIVED)), n)
    d1 = (n - 1) // 2 + 1
    d2 = d1 // 3 + 1
    assert list(plan[6:9]) == [n, d1, d2] and not plan[9:22].any()
    assert z.shape == (d1, 4) and w.shape == (d2, 4) and plan[5] == d1 * d2


def test_shape_inference_computes_derived_dims_from_known_sizes() -> None:
    outs = {o.name: o.shape for o in session(plan_model(n=13, **DERIVED)).get_outputs()}
    assert outs["Z"] == [7, 4] and outs["W"] == [3, 4]
    outs = {o.name: o.shape for o in session(plan_model(**DERIVED)).get_outputs()}
    assert outs["Z"] == ["(N-1)/2+1", 4] and outs["W"] == ["((N-1)/2+1)/3+1", 4]  # from a symbol: its formula


# a Concat's span along a run-time axis: d1 = d0 + 3 and d2 = d1 + d0, as sym_sums (term, term) pairs
SUMS = dict(sym_sums=[-1, 3, -2, -1], units=[-2, -3], out_dims=[-2, 4, -3, 4])


@pytest.mark.parametrize("n", [0, 1, 9])
def test_sum_dims_add_their_terms(n: int) -> None:
    z, w, plan = run(session(plan_model(**SUMS)), n)
    assert list(plan[6:9]) == [n, n + 3, 2 * n + 3] and not plan[9:22].any()
    assert z.shape == (n + 3, 4) and w.shape == (2 * n + 3, 4) and plan[5] == (n + 3) * (2 * n + 3)


def test_an_input_declaring_a_sum_is_checked_against_it() -> None:
    # Y's rows declared the Concat's span (a mask over past + new beside the Concat of the two): n + 3 here
    sess = session(plan_model(name="sum_node", sym_sums=[-1, 3], dim_checks=[1, 0, -2]))
    with pytest.raises(Exception, match="sum_node.*input 1 has size 4 at axis 0, but the kernel was built for 7 "
                                        "there \\(the spans a Concat joins along it, summed"):
        run(sess, 4)
    z, _, plan = sess.run(None, {"X": np.ones((4, 4), np.float32), "Y": np.ones((7, 4), np.float32)})
    assert list(plan[6:8]) == [4, 7]


def test_shape_inference_computes_sums_from_known_sizes() -> None:
    outs = {o.name: o.shape for o in session(plan_model(n=5, **SUMS)).get_outputs()}
    assert outs["Z"] == [8, 4] and outs["W"] == [13, 4]
    outs = {o.name: o.shape for o in session(plan_model(**SUMS)).get_outputs()}
    assert outs["Z"] == ["N+3", 4] and outs["W"] == ["N+3+N", 4]  # from a symbol: its formula


# run-time axes flattened together (a Reshape to "79*batch"): d1 = d0 * 3, d2 = d1 + d0 and d3 = d2 * d0, as
# sym_sums pairs of which sym_products names the multiplying ones (node format 2)
PRODUCTS = dict(ortfuse_version=2, sym_sums=[-1, 3, -2, -1, -3, -1], sym_products=[0, 2], units=[-2, -4],
                out_dims=[-2, 4, -4, 4])


@pytest.mark.parametrize("n", [0, 1, 6])
def test_product_dims_multiply_their_terms(n: int) -> None:
    z, w, plan = run(session(plan_model(**PRODUCTS)), n)
    assert list(plan[6:10]) == [n, 3 * n, 4 * n, 4 * n * n] and not plan[10:22].any()
    assert z.shape == (3 * n, 4) and w.shape == (4 * n * n, 4) and plan[5] == 3 * n * 4 * n * n


def test_shape_inference_computes_products_from_known_sizes() -> None:
    outs = {o.name: o.shape for o in session(plan_model(n=5, **PRODUCTS)).get_outputs()}
    assert outs["Z"] == [15, 4] and outs["W"] == [100, 4]
    outs = {o.name: o.shape for o in session(plan_model(**PRODUCTS)).get_outputs()}
    assert outs["Z"] == ["N*3", 4] and outs["W"] == ["(N*3+N)*N", 4]  # a factor that is a sum in parentheses
    outs = {o.name: o.shape for o in session(plan_model(n="w - 1", **PRODUCTS)).get_outputs()}
    assert outs["Z"] == ["(w - 1)*3", 4] and outs["W"] == ["((w - 1)*3+w - 1)*(w - 1)", 4]


def test_shape_inference_names_every_dim_it_cannot_size() -> None:
    """ORT makes an unnamed output dim dim_value -1, and ONNX's Slice shape inference downstream then aborted the
    process (2026-11-27, H100). A dim without a name at the input gets one of its own, shared by the outputs
    that use it and equal to nothing else; a formula too long for a name gets one of its own too."""
    inputs = [vi("X", T.FLOAT, [None, 4]), vi("Y", T.FLOAT, [None, 4])]
    outs = {o.name: o.shape for o in session(plan_model(inputs=inputs, **SUMS)).get_outputs()}
    (z,), (w,) = outs["Z"][:1], outs["W"][:1]
    assert z.startswith("ortfuse_unk_") and z.endswith("+3") and w == f"{z}+{z[:-2]}", outs
    m = plan_model(inputs=inputs, **SUMS)  # a second node on the same inputs: its dims are not claimed equal
    second = onnx.NodeProto()
    second.CopyFrom(m.graph.node[0])
    second.name, second.output[:] = "plan_node_2", ["Z2", "W2", "P2"]
    m.graph.node.append(second)
    m.graph.output.extend([vi(o, t, None) for o, t in (("Z2", T.FLOAT), ("W2", T.FLOAT16), ("P2", T.INT64))])
    outs = {o.name: o.shape for o in session(m).get_outputs()}
    assert outs["Z"][0] != outs["Z2"][0] and outs["Z"][0].endswith("+3") and outs["Z2"][0].endswith("+3"), outs
    long_name = [vi("X", T.FLOAT, ["n" * 126, 4]), vi("Y", T.FLOAT, ["n" * 126, 4])]
    outs = {o.name: o.shape for o in session(plan_model(inputs=long_name, **SUMS)).get_outputs()}
    assert outs["Z"][0].startswith("ortfuse_unk_") and outs["W"][0].startswith("ortfuse_unk_")  # 128 chars or more


def test_a_slice_after_a_runtime_dim_creates_its_session() -> None:
    """The case that aborted: ORT's Slice shape inference on our output's runtime dim (a Pad's h + 2 here), in a
    process of its own so that an abort fails this test, not the run."""
    import subprocess
    import sys
    code = (
        "import numpy as np, onnx\n"
        "from onnx import TensorProto as T, helper\n"
        "import test_node_format as t\n"
        "from helpers import const, vi\n"
        "m = t.plan_model(inputs=[vi('X', T.FLOAT, [None, 4]), vi('Y', T.FLOAT, [None, 4])], **t.SUMS)\n"
        "m.graph.node.append(helper.make_node('Slice', ['Z', 's0', 's1'], ['S']))\n"
        "m.graph.initializer.extend([const('s0', [1], np.int64), const('s1', [3], np.int64)])\n"
        "m.graph.output.append(vi('S', T.FLOAT, None))\n"
        "print(t.session(m).get_outputs()[-1].shape)\n")
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests / "runtime")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_an_image_smaller_than_the_kernel_is_an_error_naming_the_node() -> None:
    # 7x7 kernel, no padding: the input size must be at least 7
    rule = dict(sym_derived=[-1, -7, 1], units=[-2], out_dims=[-2, 4, -2, 4])
    sess = session(plan_model(name="small_node", **rule))
    assert run(sess, 7)[0].shape == (1, 4)
    with pytest.raises(Exception, match="small_node.*image size of 6 is smaller than a Conv's kernel"):
        run(sess, 6)
    sess = session(plan_model(name="small_node", n=5, **rule))  # shape inference leaves the size unknown
    with pytest.raises(Exception, match="small_node.*image size of 5 is smaller than a Conv's kernel"):
        run(sess, 5)


def test_dim_limits_refuse_a_launch_past_a_kernels_32_bit_range() -> None:
    # 4 * d0 must stay below 100 (a 32-bit gather's image size, scaled down)
    sess = session(plan_model(name="limit_node", dim_limits=[2, -1, 4, 100]))
    assert run(sess, 24)[2][5] == 96
    with pytest.raises(Exception, match="limit_node.*a size of 100.*exceeds what this kernel was built for \\(< 100: an image"):
        run(sess, 25)


def _bound_at(io: ort.IOBinding, name: str, buf: np.ndarray, offset: int, n: int, output: bool = False) -> None:
    """Binds `name` as an [n, 4] fp32 tensor `offset` bytes past a 256-byte boundary inside `buf`."""
    start = (-buf.ctypes.data) % 256 + offset
    args = (name, "cpu", 0, np.float32, [n, 4], buf.ctypes.data + start)
    (io.bind_output if output else io.bind_input)(*args)


@pytest.mark.parametrize("offset,where", [(0, None), (16, None), (4, "input 0"), (8, "input 0"),
                                          (-4, "output 0")])
def test_arg_align_refuses_a_misaligned_buffer_naming_the_node_and_argument(offset: int, where: str | None) -> None:
    # X is read in 16-byte vectors, Z written in 8-byte ones; Y and W are accessed element by element
    sess = session(plan_model(name="align_node", arg_align=[16, 4, 8, 2]))
    buf = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    io = sess.io_binding()
    _bound_at(io, "X", buf, max(offset, 0), 3)
    _bound_at(io, "Y", buf, 1024 + 4, 3)  # 4-byte aligned only: enough for Y
    out = np.empty(2048, np.float32)
    _bound_at(io, "Z", out, 4 if offset < 0 else 8, 3, output=True)
    io.bind_output("W")
    io.bind_output("P")
    if where is None:
        sess.run_with_iobinding(io)
        assert io.copy_outputs_to_cpu()[2][0] == 1  # grid: one block for 12 units
    else:
        with pytest.raises(Exception, match=f"align_node.*{where} is at address 0x[0-9a-f]+, which is not "
                                            f"{16 if where == 'input 0' else 8}-byte aligned"):
            sess.run_with_iobinding(io)


@pytest.mark.parametrize("cc,chosen,size", [(90, 90, 15), (80, 80, 14), (86, 80, 14), (89, 80, 14),
                                            (75, 0, 8), (100, 0, 8), (120, 0, 8)])
def test_image_choice(cc: int, chosen: int, size: int) -> None:
    *_, plan = run(session(plan_model(cc=cc)), 1)  # fake cubins of 14/15 bytes, PTX 7 bytes (+NUL)
    assert (plan[3], plan[4]) == (chosen, size - (1 if chosen == 0 else 0))


def test_units_with_several_terms_and_constant_outputs() -> None:
    sess = session(plan_model(sym_dims=[0, 0, 1, 1], units=[-1, -2, 3], units_per_block=7,
                              out_ranks=[1, 2], out_dims=[5, -2, -1]))
    z, w, plan = run(sess, 3)
    assert z.shape == (5,) and w.shape == (4, 3)
    assert plan[5] == 3 * 4 * 3 and plan[0] == -(-36 // 7) and list(plan[6:8]) == [3, 4]


def test_units_ceil_counts_tiles() -> None:
    # GEMM grids: units = d0 * ceil(d1 / 3) * ceil(100 * d0 / 128) = 3 * 2 * 3 for inputs X [3, 4], Y [3, 4]
    sess = session(plan_model(sym_dims=[0, 0, 1, 1], units=[-1], units_ceil=[1, -2, 3, 2, 100, -1, 128],
                              units_per_block=1,
                              out_ranks=[1, 2], out_dims=[5, -2, -1]))
    *_, plan = run(sess, 3)
    assert plan[5] == 3 * 2 * 3 and plan[0] == 18


@pytest.mark.parametrize("n,cluster", [(1, 8), (4, 8), (8, 4), (16, 2), (17, 1), (33, 1), (0, 1)])
def test_split_k_clusters_fill_one_wave_of_sms(n: int, cluster: int) -> None:
    # a split-K GEMM's 4 * n tiles on a 132-SM device: clusters of the largest power of two up to split_k = 8
    # that keeps tiles * cluster <= 132; the grid counts blocks (tiles * cluster)
    *_, plan = run(session(plan_model(units_per_block=1, split_k=8, probe_sm_count=132)), n)
    assert plan[22] == cluster and plan[0] == 4 * n * cluster and plan[5] == 4 * n
    assert cluster == cluster_for(8, 4 * n, 132)  # the rule the emulated checks launch with


@pytest.mark.parametrize("overrides", [dict(split_k=8), dict(split_k=1, probe_sm_count=132), dict()])
def test_no_clusters_without_split_k_or_without_a_device_that_has_them(overrides: dict) -> None:
    *_, plan = run(session(plan_model(units_per_block=1, **overrides)), 2)
    assert plan[22] == 1 and plan[0] == 8


@pytest.mark.parametrize("n,split_k,sms,blocks,cluster", [
    (100, 1, 132, 264, 1),   # 400 tiles, 2 blocks per SM: capped at 264
    (10, 1, 132, 40, 1),     # fewer tiles than the cap: one block each
    (100, 1, 0, 400, 1),     # no device count (the CPU probe's default): no cap
    (8, 4, 132, 128, 4),     # split-K clusters fit one wave: they win, no cap
    (100, 4, 132, 264, 1),   # too many tiles to split: capped
])
def test_persistent_kernels_cap_their_grid(n, split_k, sms, blocks, cluster) -> None:
    # a persistent kernel (TMA GEMM) loops over its tiles: at most blocks_per_sm x SMs blocks, as the emulated
    # checks launch it (attrs.launch_blocks)
    *_, plan = run(session(plan_model(units_per_block=1, split_k=split_k, blocks_per_sm=2, probe_sm_count=sms)), n)
    assert (plan[0], plan[22], plan[5]) == (blocks, cluster, 4 * n)
    assert launch_blocks(4 * n, split_k, 2, sms) == (blocks, cluster)


@pytest.mark.parametrize("n,sms", [(1, 0), (1, 132), (40, 132)])
def test_a_row_split_launches_clusters_of_exactly_its_size(n: int, sms: int) -> None:
    # a row split across a cluster: the grid (4 * n tiles, a row's tiles adjacent) is launched as is, in
    # clusters of exactly row_cluster blocks, with or without a device count and past one wave
    *_, plan = run(session(plan_model(units_per_block=1, row_cluster=4, probe_sm_count=sms)), n)
    assert (plan[0], plan[22], plan[5]) == (4 * n, 4, 4 * n)
    assert launch_blocks(4 * n, 1, 0, sms, 4) == (4 * n, 4)


def test_a_row_split_whose_grid_does_not_form_clusters_is_refused() -> None:
    with pytest.raises(Exception, match="plan_node.*4 blocks do not form clusters of 3"):
        run(session(plan_model(units_per_block=1, row_cluster=3)), 1)
    with pytest.raises(ValueError, match="do not form clusters of 3"):
        launch_blocks(4, 1, 0, 132, 3)


@pytest.mark.parametrize("n,sms,blocks", [
    (1, 0, 8),        # 4 clusters' groups, no device count: one cluster each
    (10, 132, 80),    # 40 groups under the cap of 2 x 132 / 2 = 132 clusters
    (100, 132, 264),  # 400 groups: capped at 132 clusters of 2, each looping over groups
    (100, 1, 2),      # one SM: still one whole cluster
])
def test_b_multicast_launches_persistent_clusters_of_exactly_its_size(n: int, sms: int, blocks: int) -> None:
    # B multicast (TMA GEMM): a unit is a cluster's group of tiles along M; the grid counts clusters, capped
    # at blocks_per_sm x SMs blocks in whole clusters
    *_, plan = run(session(plan_model(units_per_block=1, multicast=2, blocks_per_sm=2, probe_sm_count=sms)), n)
    assert (plan[0], plan[22], plan[5]) == (blocks, 2, 4 * n)
    assert launch_blocks(4 * n, 1, 2, sms, 1, 2) == (blocks, 2)


@pytest.mark.parametrize("overrides", [dict(multicast=9), dict(multicast=2, split_k=2), dict(multicast=2, row_cluster=2),
                                       dict(multicast=0)])
def test_a_bad_multicast_names_the_node(overrides: dict) -> None:
    with pytest.raises(Exception, match="plan_node.*multicast"):
        session(plan_model(**overrides))


@pytest.mark.parametrize("overrides", [dict(row_cluster=9), dict(row_cluster=2, split_k=2), dict(row_cluster=0)])
def test_a_bad_row_cluster_names_the_node(overrides: dict) -> None:
    with pytest.raises(Exception, match="plan_node.*row_cluster"):
        session(plan_model(**overrides))


def test_a_bad_blocks_per_sm_names_the_node() -> None:
    with pytest.raises(Exception, match="plan_node.*blocks_per_sm = 40"):
        session(plan_model(blocks_per_sm=40))


@pytest.mark.parametrize("sym", [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 1]])
def test_several_dims_of_one_input(sym) -> None:
    # dims of one input listed together (one shape query) or interleaved with another input's
    inputs = [vi("X", T.FLOAT, ["a", "b"]), vi("Y", T.FLOAT, ["c", "d"])]
    sess = session(plan_model(inputs=inputs, sym_dims=sym, units=[-1, -2, -3], out_dims=[-1, -2, -1, -2]))
    shapes = ((3, 5), (7, 2))
    *_, plan = sess.run(None, {"X": np.ones(shapes[0], np.float32), "Y": np.ones(shapes[1], np.float32)})
    dims = [shapes[sym[2 * k]][sym[2 * k + 1]] for k in range(3)]
    assert list(plan[6:9]) == dims and plan[5] == dims[0] * dims[1] * dims[2]


BAD_NODES = [
    (dict(ortfuse_version=3), "ortfuse_version 3; this library reads versions 1 to 2"),
    (dict(ortfuse_version=0), "ortfuse_version 0"),
    (dict(entry=None), "attribute 'entry'"),
    (dict(entry=""), "'entry' is empty"),
    (dict(block=0), "block = 0"),
    (dict(block=2048), "block = 2048"),
    (dict(smem=-1), "smem"),
    (dict(units_per_block=0), "units_per_block"),
    (dict(sym_dims=[0]), "odd length"),
    (dict(sym_dims=[2, 0]), "does not name an input"),
    (dict(units=[-3]), "units\\[0\\] = -3"),
    (dict(units_ceil=[2, -1]), "units_ceil group at 0 has count 2"),
    (dict(units_ceil=[1, -1, 0]), "divisor at 2 = 0"),
    (dict(units_ceil=[1, -5, 4]), "units_ceil\\[0\\] = -5"),
    (dict(sym_derived=[-1, 0]), "sym_derived has length 2"),
    (dict(sym_derived=[-2, 0, 1]), "sym_derived\\[0\\] = -2 names runtime dim 1 but only 1"),
    (dict(sym_derived=[-1, 0, 0]), "rule 0 has divisor 0"),
    (dict(sym_derived=[-1, 0, 1], units=[-3]), "units\\[0\\] = -3 names runtime dim 2 but only 2"),
    (dict(sym_sums=[-1, 3, -1]), "sym_sums has odd length 3"),
    (dict(sym_sums=[-1, -2]), "sym_sums\\[1\\] = -2 names runtime dim 1 but only 1"),
    (dict(sym_sums=[-1, 3], units=[-3]), "units\\[0\\] = -3 names runtime dim 2 but only 2"),
    (dict(sym_sums=[-1, 3], sym_products=[0]), "sym_products needs ortfuse_version 2, the node has 1"),
    (dict(ortfuse_version=2, sym_sums=[-1, 3], sym_products=[1]), "sym_products\\[0\\] = 1 names no sym_sums rule"),
    (dict(ortfuse_version=2, sym_products=[0]), "sym_products\\[0\\] = 0 names no sym_sums rule \\(0 rules\\)"),
    (dict(dim_limits=[2, -1]), "dim_limits group at 0 has count 2"),
    (dict(dim_limits=[1, -1, 0]), "dim_limits limit at 2 = 0"),
    (dict(dim_limits=[1, -9, 5]), "dim_limits\\[0\\] = -9"),
    (dict(arg_align=[16, 4]), "arg_align has 2 entries, expected one per input and output \\(4\\)"),
    (dict(arg_align=[16, 4, 3, 1]), "arg_align\\[2\\] = 3, expected a power of two"),
    (dict(arg_align=[512, 4, 4, 1]), "arg_align\\[0\\] = 512"),
    (dict(arg_align=[0, 4, 4, 1]), "arg_align\\[0\\] = 0"),
    (dict(dim_checks=[1, 0]), "dim_checks has length 2"),
    (dict(dim_checks=[2, 0, 0]), "dim_checks triple 0 = \\(2, 0, 0\\) does not name"),
    (dict(dim_checks=[1, 0, -2]), "dim_checks triple 0 = \\(1, 0, -2\\) does not name"),
    (dict(split_k=0), "split_k = 0"),
    (dict(split_k=16), "split_k = 16, expected 1..8"),
    (dict(out_dims=[-1, 4, -1, -7]), "out_dims\\[3\\]"),
    (dict(out_ranks=[2]), "out_ranks 1 entries"),
    (dict(out_ranks=[2, 1]), "out_ranks sum to 3"),
    (dict(cubin_archs=[90, 95]), "cubin_95"),
    (dict(cubin_archs=[5]), "not a compute capability"),
    (dict(ptx=None, cubin_archs=[]), "attribute 'ptx'"),
]


@pytest.mark.parametrize("overrides,message", BAD_NODES)
def test_bad_attributes_fail_at_create_naming_the_node(overrides: dict, message: str) -> None:
    cc = 95 if overrides.get("cubin_archs") == [90, 95] else 90
    with pytest.raises(Exception, match=f"node 'bad_node'.*{message}|{message}.*bad_node"):
        session(plan_model(name="bad_node", cc=cc, **overrides))


def test_string_outputs_are_refused() -> None:
    outputs = [vi("Z", T.FLOAT, None), vi("W", T.STRING, None), vi("P", T.INT64, None)]
    with pytest.raises(Exception, match="bad_node.*out_dtypes\\[1\\] = 8 is not a supported"):
        session(plan_model(name="bad_node", outputs=outputs, out_dtypes=[T.FLOAT, T.STRING]))


def test_cubin_must_be_uint8() -> None:
    import onnx.numpy_helper as nh

    with pytest.raises(Exception, match="bad_node.*'cubin_90' must be a non-empty uint8 tensor"):
        session(plan_model(name="bad_node", cubin_90=nh.from_array(np.zeros(4, np.float32))))


def test_too_many_tensors() -> None:
    inputs = [vi(f"I{i}", T.FLOAT, [2]) for i in range(31)]
    outputs = [vi("Z", T.FLOAT, None), vi("W", T.FLOAT, None), vi("P", T.INT64, None)]
    with pytest.raises(Exception, match="big_node.*31 inputs and 2 outputs.*at most 32"):
        session(plan_model(name="big_node", inputs=inputs, outputs=outputs, sym_dims=[], units=[8],
                           out_dtypes=[T.FLOAT, T.FLOAT], out_dims=[2, 4, 2, 4]))


def test_run_time_shape_error_names_node() -> None:
    inputs = [vi("X", T.FLOAT, None), vi("Y", T.FLOAT, None)]
    sess = session(plan_model(name="axis_node", inputs=inputs, sym_dims=[0, 5]))
    with pytest.raises(Exception, match="axis_node.*axis 5 of input 0, which has rank 2"):
        run(sess, 3)


def test_dim_checks_refuse_inputs_whose_shared_symbolic_dim_differs() -> None:
    """X and Y carry one symbolic dim (X's binds it, term -1), and Y's second axis is assumed 4 (term 4); a Y
    of another size at run time is an error naming the node, not a kernel reading Y out of bounds."""
    sess = session(plan_model(name="merged_node", dim_checks=[1, 0, -1, 1, 1, 4]))
    assert run(sess, 3)[0].shape == (3, 4)
    with pytest.raises(Exception, match="merged_node.*input 1 has size 5 at axis 0, but the kernel was built for 3 "
                                        "there \\(axis 0 of input 0"):
        sess.run(None, {"X": np.ones((3, 4), np.float32), "Y": np.ones((5, 4), np.float32)})
    sess = session(plan_model(name="static_node", dim_checks=[1, 1, 5]))
    with pytest.raises(Exception, match="static_node.*input 1 has size 4 at axis 1, but the kernel was built for 5 "
                                        "there \\(a size"):
        run(sess, 3)


def _tma_plan(x: np.ndarray, y: np.ndarray, tma: list) -> np.ndarray:
    inputs = [vi("X", T.FLOAT16, ["N", *x.shape[1:]]), vi("Y", T.FLOAT16, list(y.shape))]
    *_, plan = session(plan_model(inputs=inputs, tma=tma)).run(None, {"X": x, "Y": y})
    return plan


def test_tma_operands_get_2d_tensor_maps() -> None:
    # A [N, 3, 72] (the batch folded into its rows) and B [200, 72]: the maps the CUDA op would encode, as the
    # emulator's launches build them (emulate.tma_geometry)
    from ortfuse.customops.emulate import tma_geometry
    x, y = np.ones((5, 3, 72), np.float16), np.ones((200, 72), np.float16)
    plan = _tma_plan(x, y, [0, 128, T.FLOAT16, 1, 192, T.FLOAT16])
    assert list(plan[23:29]) == [*tma_geometry(x.shape, 2, 128), T.FLOAT16] == [72, 15, 144, 64, 128, T.FLOAT16]
    assert list(plan[29:35]) == [*tma_geometry(y.shape, 2, 192), T.FLOAT16]
    assert not _tma_plan(x, y, [])[23:].any()  # a kernel without TMA operands has no maps


@pytest.mark.parametrize("tma,message", [
    ([0, 128, T.FLOAT16], "tma has 3 entries"),
    ([0, 300, T.FLOAT16, 1, 64, T.FLOAT16], "is not \\(an input, 1..256 box rows"),
    ([0, 64, T.FLOAT, 1, 64, T.FLOAT16], "fp16 or bf16"),
])
def test_bad_tma_attributes_name_the_node(tma, message) -> None:
    x, y = np.ones((2, 3, 72), np.float16), np.ones((200, 72), np.float16)
    with pytest.raises(Exception, match=f"plan_node.*{message}"):
        _tma_plan(x, y, tma)


def test_an_operand_tma_cannot_copy_is_refused_by_name() -> None:
    # rows of 36 halves are 72 bytes: not a multiple of the 16 bytes a tensor map's stride must be
    x, y = np.ones((2, 3, 36), np.float16), np.ones((200, 72), np.float16)
    with pytest.raises(Exception, match="plan_node.*input 0 .*cannot be copied by TMA"):
        _tma_plan(x, y, [0, 64, T.FLOAT16, 1, 64, T.FLOAT16])


def _two_variants(**more: Any) -> dict[str, Any]:
    # variant 1 (rows >= 100): another kernel with 256-thread blocks, 64 units each, its own images
    from rt_models import u8
    v1 = {"entry@1": "ofz_big", "cubin_archs@1": [90], "cubin_90@1": u8(b"\x7fELF-big-sm90!!!!"),
          "ptx@1": u8(b"// big\n"), "block@1": 256, "smem@1": 4096, "units@1": [-1, 4], "units_per_block@1": 64,
          "split_k@1": 1}
    return {"variants": 2, "variant_rows": [-1], "variant_from": [100], **v1, **more}


def test_a_node_runs_the_kernel_variant_its_size_picks() -> None:
    sess = session(plan_model(**_two_variants()))
    for n, variant in ((1, 0), (99, 0), (100, 1), (4096, 1)):
        _, _, plan = run(sess, n)
        grid, block, smem, cc, image, units = plan[:6]
        assert plan[-2] == variant and units == 4 * n and cc == 90
        if variant:
            assert (block, smem, grid, image) == (256, 4096, -(-4 * n // 64), len(b"\x7fELF-big-sm90!!!!"))
        else:
            assert (block, smem, grid, image) == (128, 0, -(-4 * n // 128), len(b"\x7fELF-fake-sm90!"))


@pytest.mark.parametrize("overrides,message", [
    (dict(variants=5), "variants = 5, expected 1..4"),
    (dict(variant_from=[100, 200]), "variant_from has 2 entries, expected 1"),
    (dict(variant_from=[0]), "variant_from must rise from 1"),
    (dict(variants=3, variant_from=[100, 50]), "variant_from must rise from 1 \\(entry 1 is 50\\)"),
    (dict(variant_rows=[-3]), "variant_rows\\[0\\] = -3 names runtime dim 2 but only 1"),
    (dict(**{"entry@1": None}), "attribute 'entry@1'"),
    (dict(**{"cubin_90@1": None}), "cubin_90@1"),
])
def test_bad_variant_attributes_name_the_node(overrides: dict, message: str) -> None:
    attrs = _two_variants(**overrides)
    with pytest.raises(Exception, match=f"bad_node.*{message}"):
        session(plan_model(name="bad_node", **attrs))


@pytest.mark.parametrize("cc,pdl,want", [(90, 1, 1), (80, 1, 0), (90, None, 0), (90, 0, 0)])
def test_a_programmatic_dependent_launch_where_the_kernel_asks_and_the_device_has_them(cc, pdl, want) -> None:
    _, _, plan = run(session(plan_model(cc=cc, pdl=pdl)), 3)
    assert plan[-1] == want and plan[-2] == 0


def test_a_bad_pdl_names_the_node() -> None:
    with pytest.raises(Exception, match="plan_node.*pdl = 2, expected 0 or 1"):
        session(plan_model(pdl=2))


def test_a_compiled_node_with_products_through_the_library() -> None:
    """The compiler's node format 2 read by the native library (the probe op takes the compiled node's
    attributes): [s, n, 3, 8] flattened to [3 * n * s, 8], two product rules."""
    from helpers import flattened

    from ortfuse.api import compile_model

    fused = next(x for x in compile_model(flattened("s", 3), None, "sm_90").model.graph.node
                 if x.domain == "ortfuse")
    node = onnx.helper.make_node("Plan", list(fused.input), [*fused.output, "P"], name="compiled", domain=PROBE[0])
    node.attribute.extend(fused.attribute)
    node.attribute.append(onnx.helper.make_attribute("probe_cc", 90))
    m = model([node], [vi("x", T.FLOAT, ["s", "n", 3, 8])], [vi(fused.output[0], T.FLOAT, None),
                                                               vi("P", T.INT64, None)], [PROBE])
    sess = session(m)
    assert sess.get_outputs()[0].shape == ["3*n*s", 8]
    z, plan = sess.run(None, {"x": np.ones((7, 2, 3, 8), np.float32)})
    assert z.shape == (42, 8) and list(plan[6:10]) == [7, 2, 6, 42]

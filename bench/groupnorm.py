"""GroupNorm + SiLU as exporters emit it, at a diffusion UNet's latent sizes: the model builder the tests
share, and

    python -m ortfuse.bench.groupnorm [--batch 8]

which (on a GPU) optimizes each size with `--profile` and prints the measured placement, ORT's
InstanceNormalization and four element-wise kernels against our one row kernel, beside the cost model's
estimates (`CostModel.few_rows_us`: a row per block where the groups are fewer than the SMs)."""
from __future__ import annotations

import argparse
from typing import Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# (channels, groups, latent side): a Stable Diffusion UNet's three GroupNorm widths at their latent sizes
# (512x512 images), then PoolFormer-S12's first stage (one group over the whole image)
SIZES = ((320, 32, 64), (640, 32, 32), (1280, 32, 16), (64, 1, 56))


def _node(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", **attrs)


def _const(name: str, value, dtype) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def group_norm(dt: int, c: int = 8, groups: int = 4, hw: tuple = (5, 6), silu: bool = True,
               view_of_view: bool = False) -> onnx.ModelProto:
    """GroupNorm as torch exports it (x [n, C, H, W], H and W as given: ints or names): Reshape to
    [n, groups, -1], InstanceNormalization (scale and bias per group), Reshape back to Shape(x) (a target
    computed at run time), the affine tail per channel, then SiLU (`silu`). `view_of_view`: back through
    [n, C, H*W] (the affine there) before the image shape."""
    rng = np.random.default_rng(1)
    npdt = helper.tensor_dtype_to_np_dtype(dt)
    nodes = [_node("Reshape", ["x", "grp"], ["xg"]),
             _node("InstanceNormalization", ["xg", "s", "b"], ["yn"], epsilon=1e-5)]
    if view_of_view:
        nodes += [_node("Reshape", ["yn", "flat"], ["yf"]), _node("Mul", ["yf", "gamma"], ["ya"]),
                  _node("Add", ["ya", "beta"], ["yb"]), _node("Shape", ["x"], ["xs"]),
                  _node("Reshape", ["yb", "xs"], ["y"])]
        affine = (c, 1)
    else:
        nodes += [_node("Shape", ["x"], ["xs"]), _node("Reshape", ["yn", "xs"], ["yr"]),
                  _node("Mul", ["yr", "gamma"], ["ya"]), _node("Add", ["ya", "beta"], ["y"])]
        affine = (c, 1, 1)
    if silu:
        nodes += [_node("Sigmoid", ["y"], ["sg"]), _node("Mul", ["y", "sg"], ["out"])]
    else:
        nodes += [_node("Identity", ["y"], ["out"])]
    inits = [_const("grp", [0, groups, -1], np.int64), _const("flat", [0, c, -1], np.int64),
             _const("s", 1 + 0.2 * rng.standard_normal(groups), npdt),
             _const("b", 0.1 * rng.standard_normal(groups), npdt),
             _const("gamma", 1 + 0.2 * rng.standard_normal(affine), npdt),
             _const("beta", 0.1 * rng.standard_normal(affine), npdt)]
    graph = helper.make_graph(nodes, "group_norm", [helper.make_tensor_value_info("x", dt, ["n", c, *hw])],
                              [helper.make_tensor_value_info("out", dt, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    m.graph.output[0].type.CopyFrom(onnx.shape_inference.infer_shapes(m).graph.output[0].type)
    return m


def main(argv: Optional[list[str]] = None) -> int:
    from ortfuse.api import compile_model
    from ortfuse.config import Options
    from ortfuse.errors import OrtfuseError

    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.groupnorm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="--profile times batch 1 and this batch")
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args(argv)
    for c, groups, side in SIZES:
        m = group_norm(TensorProto.FLOAT16, c, groups, hw=(side, side))
        try:
            res = compile_model(m, None, a.arch, options=Options(profile=True, profile_batch=a.batch))
        except OrtfuseError as e:  # no GPU here
            print(e)
            return 2
        print(f"GroupNorm({groups}, {c}) + SiLU at {side}x{side}, fp16:")
        for p in res.placements:
            print("  " + p.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

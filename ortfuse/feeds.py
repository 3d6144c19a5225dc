"""Random, never all-zero model inputs of the right dtype and shape."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ortfuse.errors import InputError

# Values for symbolic input dims when the user gives none: small, so CPU checks stay fast.
DEFAULT_DIMS = {"batch": 2}
DEFAULT_DIM = 8


def _dim_value(d: onnx.TensorShapeProto.Dimension, given: Sequence | None, k: int) -> int:
    if given is not None and isinstance(given[k], int):
        return given[k]
    if d.HasField("dim_value") and d.dim_value > 0:
        return d.dim_value
    name = d.dim_param.lower()
    return next((v for key, v in DEFAULT_DIMS.items() if key in name), DEFAULT_DIM)


def _index_bound(model: onnx.ModelProto, name: str) -> int | None:
    """For an integer input used as Gather indices, the size of the gathered axis."""
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == name and n.input[0] in inits:
            axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
            return int(numpy_helper.to_array(inits[n.input[0]]).shape[axis])
    return None


def random_feeds(model: onnx.ModelProto, shapes: Mapping[str, Sequence] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    inits = {i.name for i in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        given = shapes.get(vi.name)
        if given is not None and tt.HasField("shape") and len(given) != len(tt.shape.dim):
            raise InputError(f"input '{vi.name}' has rank {len(tt.shape.dim)}; the shape given for it, "
                             f"{'x'.join(map(str, given))}, has rank {len(given)}")
        dims = [_dim_value(d, given, k) for k, d in enumerate(tt.shape.dim)]
        dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if dt.kind == "f":
            feeds[vi.name] = rng.standard_normal(dims).astype(dt)
        elif dt == np.bool_:
            feeds[vi.name] = rng.random(dims) < 0.7
        elif "mask" in vi.name.lower():
            m = np.ones(dims, dt)
            if m.ndim >= 2 and m.shape[-1] > 2:
                m[..., -(m.shape[-1] // 4):] = 0  # some padding on every row
                m[0] = 1  # and one row with none
            feeds[vi.name] = m
        else:
            hi = _index_bound(model, vi.name) or 2
            feeds[vi.name] = rng.integers(0, hi, dims).astype(dt)
    return {k: np.asarray(v) for k, v in feeds.items()}  # rank 0: numpy scalars, which ORT refuses

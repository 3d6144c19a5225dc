"""Random, never all-zero model inputs of the right dtype and shape."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import onnx

from ortfuse.errors import InputError
from ortfuse.rewriter.shapes import dim_names, eval_dim, is_dim_expression

# Values for symbolic input dims when the user gives none: small, so CPU checks stay fast.
DEFAULT_DIMS = {"batch": 2}
DEFAULT_DIM = 8


def default_dim(name: str, leading: bool = False) -> int:
    """The value a symbolic dim nobody gave takes in a check: small, so CPU checks stay fast."""
    return next((v for key, v in DEFAULT_DIMS.items() if key in name.lower()), DEFAULT_DIM)


def bind_dims(model: onnx.ModelProto, shapes: Mapping[str, Sequence] | None = None,
              fixed: Mapping[str, int] | None = None,
              default: Callable[[str, bool], int] = default_dim) -> dict[str, int]:
    """A value for every symbolic dim the graph inputs declare, one per name across all inputs: the value of
    a shape given for an input (`shapes`: ints, other entries left open), else `fixed`, else
    default(name, leading: the name leads some input). A dim that is an expression of others
    ("past_sequence_length + 1", as optimum names a decoder's attention mask) is evaluated from theirs, and
    a value given for one solves for its one unbound name."""
    shapes, fixed = shapes or {}, dict(fixed or {})
    inits = {i.name for i in model.graph.initializer}
    dims = [(vi.name, k, d.dim_param) for vi in model.graph.input if vi.name not in inits
            for k, d in enumerate(vi.type.tensor_type.shape.dim) if d.dim_param]
    plain = {p for _, _, p in dims if not is_dim_expression(p)}
    given: dict[str, int] = {}
    solve: list[tuple[str, int]] = []
    for name, k, p in dims:
        g = shapes.get(name)
        if g is not None and k < len(g) and isinstance(g[k], int):
            if p in plain:
                given.setdefault(p, g[k])  # the first input's; a shape given for an input is used as given
            else:
                solve.append((p, g[k]))
    bound = {**fixed, **given}
    for text, value in solve:
        _solve_for(text, value, bound, plain)
    leading = {p for _, k, p in dims if k == 0}
    for p in sorted(plain - bound.keys()):
        bound[p] = default(p, p in leading)
    for _, _, p in dims:
        if p not in bound:
            v = eval_dim(p, bound, lambda n: default(n, False))
            bound[p] = v if v is not None and v >= 0 else default(p, p in leading)
    return bound


def _solve_for(text: str, value: int, bound: dict[str, int], plain: set[str]) -> None:
    """Bind the one name of dim expression `text` that `bound` lacks so that `text` equals `value`, where
    `text` is linear in it (past + 1, 2*seq); otherwise leave it to its default."""
    free = sorted(n for n in dim_names(text, plain) if n not in bound)
    if len(free) != 1:
        return
    at0, at1 = (eval_dim(text, {**bound, free[0]: x}, lambda n: DEFAULT_DIM) for x in (0, 1))
    if at0 is None or at1 is None or at1 == at0 or (value - at0) % (at1 - at0):
        return
    x = (value - at0) // (at1 - at0)
    if x >= 0 and eval_dim(text, {**bound, free[0]: x}, lambda n: DEFAULT_DIM) == value:  # an empty past: 0
        bound[free[0]] = x


def _index_bound(model: onnx.ModelProto, name: str) -> int | None:
    """For an integer input used as Gather indices, the size of the gathered axis."""
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == name and n.input[0] in inits:
            axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
            return int(inits[n.input[0]].dims[axis])  # (dims: a table kept as external data is not read)
    return None


def _dequantized(model: onnx.ModelProto, name: str) -> bool:
    """Whether an integer input is read as a DequantizeLinear's quantized data."""
    return any(n.op_type == "DequantizeLinear" and n.input and n.input[0] == name for n in model.graph.node)


def random_feeds(model: onnx.ModelProto, shapes: Mapping[str, Sequence] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    inits = {i.name for i in model.graph.initializer}
    bound = bind_dims(model, shapes)
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        given = shapes.get(vi.name)
        if given is not None and tt.HasField("shape") and len(given) != len(tt.shape.dim):
            raise InputError(f"input '{vi.name}' has rank {len(tt.shape.dim)}; the shape given for it, "
                             f"{'x'.join(map(str, given))}, has rank {len(given)}")
        dims = [given[k] if given is not None and isinstance(given[k], int)
                else d.dim_value if d.HasField("dim_value") and d.dim_value > 0
                else bound.get(d.dim_param, DEFAULT_DIM) for k, d in enumerate(tt.shape.dim)]
        dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if dt.kind == "f" or dt.name == "bfloat16":  # (ml_dtypes' bfloat16 is a void kind to numpy)
            feeds[vi.name] = rng.standard_normal(dims).astype(dt)
        elif dt == np.bool_:
            feeds[vi.name] = rng.random(dims) < 0.7
        elif "mask" in vi.name.lower():
            m = np.ones(dims, dt)
            if m.ndim >= 2 and m.shape[-1] > 2:
                m[..., -(m.shape[-1] // 4):] = 0  # some padding on every row
                m[0] = 1  # and one row with none
            feeds[vi.name] = m
        elif dt.itemsize == 1 and _dequantized(model, vi.name):  # 8-bit quantized data: its whole range
            info = np.iinfo(dt)
            feeds[vi.name] = rng.integers(info.min, int(info.max) + 1, dims).astype(dt)
        else:
            hi = _index_bound(model, vi.name) or 2
            feeds[vi.name] = rng.integers(0, hi, dims).astype(dt)
    return {k: np.asarray(v) for k, v in feeds.items()}  # rank 0: numpy scalars, which ORT refuses

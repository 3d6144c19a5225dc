"""Random but valid ONNX graphs for the differential fuzz test: chains and DAGs of the element-wise,
broadcast, reduction, row-wise, layout and GEMM ops ortfuse fuses, with ops it does not fuse mixed in, a
symbolic batch dim, graph outputs in the middle of would-be regions, shapes chosen to hit vector-width
and tile edges, and opset 17 (reduction axes as attributes) for a quarter of the seeds. One seed gives one
model; everything is deterministic in the seed."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

Shape = tuple  # dims: int, or "n" (the symbolic batch)
OPSET = 18
OLD_OPSET = 17  # Reduce* other than ReduceSum still take axes as an attribute there
UNARY = ("Relu", "Tanh", "Sigmoid", "Abs", "Neg", "Erf", "Softplus", "Sin", "Floor", "HardSwish", "Elu")
# fp16 models get no step ops (Floor, comparisons): ORT's CPU reference is a few fp16 ulps off the ONNX
# semantics the fused kernels follow (some fp16 ops run in fp16 arithmetic; others run in fp32 between
# inserted Casts whose round trips ORT then removes, so an fp16 tensor is never rounded), and a step op
# turns an ulp into a whole step. tests/customops/test_kernels.py checks those ops against numpy instead.
# Sin of a large fp16 value is as sensitive: its argument's ulp is a visible fraction of a period.
STEP = ("Floor", "Sin")
POSITIVE_ONLY = ("Sqrt", "Log", "Reciprocal")
BINARY = ("Add", "Sub", "Mul", "Max", "Min")
REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin")
# Ops ortfuse leaves to ORT: regions must end at them and resume after.
FOREIGN = ("CumSum", "Tile")
WINDOW = ("Conv", "Pad", "Resize", "MaxPool", "AveragePool")  # ops whose output size follows the image's
LAST_DIMS = (1, 2, 3, 7, 8, 16, 17, 33, 64, 67)


@dataclass
class _Builder:
    rng: np.random.Generator
    dtype: int
    opset: int = OPSET
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    values: dict = field(default_factory=dict)  # the pool later steps draw from: name -> shape
    consts: dict = field(default_factory=dict)  # initializer name -> shape
    produced: list = field(default_factory=list)  # names made by nodes, in order
    # draws for variations added later (auto_pad, computed weights), apart so older seeds keep their graphs
    alt: np.random.Generator | None = None
    late: np.random.Generator | None = None  # session 38's forms (torch.export's): apart again, as `alt`

    @property
    def np_dtype(self):
        return helper.tensor_dtype_to_np_dtype(self.dtype)

    def fresh(self, stem: str) -> str:
        return f"{stem}{len(self.nodes)}_{len(self.inits)}"

    def add(self, op: str, ins: list[str], shape: Shape, pool: bool = True, **attrs) -> str:
        """Append a node; its output joins the pool of values later steps draw from unless `pool` is
        False (a bool or a value of another dtype)."""
        out = self.fresh(op.lower())
        self.nodes.append(helper.make_node(op, ins, [out], name=f"{op}_{out}", **attrs))
        if pool:
            self.values[out] = shape
            self.produced.append(out)
        return out

    def const(self, value: np.ndarray, stem: str = "c", dtype=None) -> str:
        name = self.fresh(stem)
        arr = np.asarray(value, dtype=dtype or self.np_dtype)
        self.inits.append(numpy_helper.from_array(arr, name))
        self.consts[name] = arr.shape
        return name

    def shape(self, name: str) -> Shape:
        return self.values[name] if name in self.values else self.consts[name]

    def axes(self, *axes: int) -> str:
        return self.const(np.array(axes), "ax", np.int64)

    def reduce(self, op: str, x: str, axes: tuple[int, ...], out: Shape, keepdims: int) -> str:
        """A Reduce* node with `axes` as an input (opset 18; ReduceSum from 13) or, before, an attribute."""
        if self.opset >= 18 or op == "ReduceSum":
            return self.add(op, [x, self.axes(*axes)], out, keepdims=keepdims)
        return self.add(op, [x], out, axes=list(axes), keepdims=keepdims)

    def standardized(self, w: str, shape: tuple[int, ...]) -> str:
        """Constant weight `w` standardized per output channel at run time (BiT's convolutions): the graph
        computes it from the constant, which `canonical.fold_constant_subgraphs` folds."""
        def mean(x: str) -> str:
            if self.opset >= 18:
                return self.add("ReduceMean", [x, self.axes(1, 2, 3)], shape[:1] + (1, 1, 1), False, keepdims=1)
            return self.add("ReduceMean", [x], shape[:1] + (1, 1, 1), False, axes=[1, 2, 3], keepdims=1)
        d = self.add("Sub", [w, mean(w)], shape, False)
        var = mean(self.add("Mul", [d, d], shape, False))
        sd = self.add("Sqrt", [self.add("Add", [var, self.const(np.array(1e-3))], shape[:1] + (1, 1, 1), False)],
                      shape[:1] + (1, 1, 1), False)
        return self.add("Div", [d, sd], shape, False)

    def random_const(self, shape: tuple[int, ...]) -> str:
        v = self.rng.uniform(0.3, 1.2, shape) * self.rng.choice([-1.0, 1.0], shape)
        return self.const(v)

    def pick(self) -> str:
        """A live value, biased towards the newest so chains grow."""
        names = list(self.values)
        if self.produced and self.rng.random() < 0.7:
            return self.produced[-1]
        return names[int(self.rng.integers(len(names)))]

    def broadcast_partner(self, shape: Shape) -> str:
        """A value y with x op y valid for x of `shape`: an existing same-shape value, a new input or a
        constant whose shape is `shape` with some dims set to 1 or leading dims dropped."""
        same = [n for n, s in self.values.items() if s == shape]
        r = self.rng.random()
        if same and r < 0.35:
            return same[int(self.rng.integers(len(same)))]
        dims = [d if self.rng.random() < 0.5 else 1 for d in shape]
        drop = int(self.rng.integers(0, len(dims)))
        dims = dims[drop:] if self.rng.random() < 0.4 else dims
        if r < 0.6 and any(d == "n" for d in dims):
            name = f"in{len(self.inputs)}"
            self.inputs.append(helper.make_tensor_value_info(name, self.dtype, list(dims)))
            self.values[name] = tuple(dims)
            return name
        return self.random_const(tuple(1 if d == "n" else d for d in dims))

    def positive(self, x: str) -> str:
        a = self.add("Abs", [x], self.shape(x))  # (x may be a constant: broadcast_partner's)
        return self.add("Add", [a, self.const(np.array(0.5))], self.shape(x))

    def step(self) -> None:
        x = self.pick()
        s = self.values[x]
        r = self.rng.random()
        rank = len(s)
        static_last = isinstance(s[-1], int)
        if rank == 4 and s[0] == "n" and all(isinstance(d, int) for d in s[1:]) and self.rng.random() < 0.3:
            self.conv(x, s) if self.rng.random() < 0.6 else self.window(x, s)
            return
        if self.rng.random() < 0.2:
            self.rare(x, s)
            return
        if r < 0.2:
            unary = UNARY if self.dtype == TP.FLOAT else tuple(u for u in UNARY if u not in STEP)
            self.add(str(self.rng.choice(unary)), [x], s)
        elif r < 0.26:
            self.add(str(self.rng.choice(POSITIVE_ONLY)), [self.positive(x)], s)
        elif r < 0.5:
            y = self.broadcast_partner(s)
            out = np.broadcast_shapes(*(tuple(1 if d == "n" else d for d in v) for v in (s, self.shape(y))))
            shape = tuple("n" if "n" in (_at(s, i, len(out)), _at(self.shape(y), i, len(out))) else d
                          for i, d in enumerate(out))
            self.add(str(self.rng.choice(BINARY)), [x, y] if self.rng.random() < 0.5 else [y, x], shape)
        elif r < 0.55 and self.dtype == TP.FLOAT:
            y = self.broadcast_partner(s)
            if self.shape(y) != s:
                y = self.add("Add", [x, self.add("Mul", [y, self.const(np.array(0.0))], self.shape(y))], s)
            c = self.add("Greater", [x, y], s, pool=False)
            self.add("Where", [c, x, self.add("Mul", [y, self.const(np.array(0.5))], s)], s)
        elif r < 0.62 and static_last and s[-1] > 1:
            keep = int(self.rng.random() < 0.6) or rank == 1
            out = s[:-1] + ((1,) if keep else ())
            self.reduce(str(self.rng.choice(REDUCE)), x, (-1,), out, keep)
        elif r < 0.66 and rank >= 3 and isinstance(s[1], int):
            out = (s[0], 1) + s[2:]
            self.reduce(str(self.rng.choice(REDUCE)), x, (1,), out, 1)
        elif r < 0.71:
            self.add("Softmax", [x], s, axis=-1)
        elif r < 0.76 and static_last:
            scale, bias = self.random_const((s[-1],)), self.random_const((s[-1],))
            # a spread across the row first: LayerNorm of a row that is constant up to rounding (an Expand,
            # a Gram matrix of near-equal rows) divides rounding noise by sqrt(eps), in ORT as in ours
            x = self.add("Add", [x, self.random_const((s[-1],))], s)
            self.add("LayerNormalization", [x, scale, bias], s, axis=-1, epsilon=1e-5)
        elif r < 0.81 and rank >= 2:
            perm = list(self.rng.permutation(rank))
            self.add("Transpose", [x], tuple(s[p] for p in perm), perm=perm)
        elif r < 0.85 and rank >= 3 and isinstance(s[-1], int) and isinstance(s[-2], int):
            out = s[:-2] + (s[-2] * s[-1],)
            self.add("Reshape", [x, self.const(np.array([0] * (rank - 2) + [-1]), "shape", np.int64)], out)
        elif r < 0.88:
            if self.dtype == TP.FLOAT16:
                f = self.add("Cast", [x], s, pool=False, to=TP.FLOAT)
                self.add("Cast", [self.add("Tanh", [f], s, pool=False)], s, to=TP.FLOAT16)
            else:
                self.add("Clip", [x, self.const(np.array(-0.8)), self.const(np.array(0.9))], s)
        elif r < 0.92 and static_last:
            k = int(self.rng.choice([8, 16, 24, 40]))
            w = self.const(self.rng.uniform(-1, 1, (s[-1], k)) / np.sqrt(s[-1]), "w")
            out = self.add("MatMul", [x, w], s[:-1] + (k,))
            if self.rng.random() < 0.7:
                self.add("Add", [out, self.random_const((k,))], s[:-1] + (k,))
        elif r < 0.94 and rank >= 3 and all(isinstance(d, int) for d in s[-2:]):
            perm = list(range(rank - 2)) + [rank - 1, rank - 2]  # x @ x^T per batch: attention-score shaped
            xt = self.add("Transpose", [x], s[:-2] + (s[-1], s[-2]), perm=perm)
            self.add("MatMul", [x, xt], s[:-1] + (s[-2],))
        elif r < 0.96:
            op = str(self.rng.choice(FOREIGN)) if static_last else "CumSum"
            if op == "CumSum":
                self.add(op, [x, self.const(np.array(rank - 1), "ax", np.int64)], s)
            else:
                reps = [1] * (rank - 1) + [2]
                self.add(op, [x, self.const(np.array(reps), "reps", np.int64)], s[:-1] + (s[-1] * 2,))
        else:
            y = self.pick()
            if self.values[y] == s and y != x:
                self.add("Add", [x, y], s)  # joins two branches: a DAG, not a chain


    def rare(self, x: str, s: Shape) -> None:
        """The less common fusible forms: Expand, Unsqueeze/Squeeze, Flatten, Pow, Div, LogSoftmax, a
        Softmax not over the last axis; a sum of squares, L2 or L1 norm or log-sum-exp over the last one; Gemm
        with transB and alpha, MatMul with a batched constant weight, and values scaled to extremes."""
        rank, static = len(s), [isinstance(d, int) for d in s]
        if self.late is not None and self.late.random() < 0.3:
            self.exported(x, s)
            return
        kind = str(self.rng.choice(["expand", "unsqueeze", "flatten", "pow", "div", "logsoftmax", "softmax1",
                                    "sumsquare", "gemm", "batched", "extreme", "gather", "iota", "concat", "expand_rt", "slice"]))
        if kind == "extreme" and self.dtype == TP.FLOAT:
            # overflow paths (fp32 only: ORT CPU's fp16 kernels overflow in places of their own), through ops
            # that saturate there; a huge value left in the pool would meet Sin (noise at 1e8) or inf - inf.
            # No tiny values: exp(x) - 1 near 0 differs by an ulp of exp between any two libms.
            big = self.add("Mul", [x, self.const(np.array(self.rng.choice([300.0, 3000.0])))], s, pool=False)
            op = str(self.rng.choice(["Softplus", "Sigmoid", "Tanh", "Erf", "Elu", "HardSwish", "Softmax",
                                      "LogSoftmax"]))
            unbounded = op in ("Softplus", "Elu", "HardSwish", "LogSoftmax")
            out = self.add(op, [big], s, pool=not unbounded, **({"axis": -1} if "Softmax" in op else {}))
            if unbounded:  # brought back to O(1), and only that joins the pool
                self.add("Mul", [out, self.const(np.array(1e-3))], s)
        elif kind == "gather":  # constant indices (some negative) along an axis of static size
            axes = [i for i in range(rank) if static[i] and s[i] > 1]
            if axes:
                a = axes[int(self.rng.integers(len(axes)))]
                k = int(self.rng.choice([1, 3, s[a]]))
                idx = self.const(self.rng.integers(-s[a], s[a], (k,)), "idx", np.int64)
                out = s[:a] + (k,) + s[a + 1:]
                self.add("Mul", [self.add("Gather", [x, idx], out, pool=False, axis=a), self.const(np.array(1.5))], out)
        elif kind == "concat":  # x between a constant and a computed tensor along a static axis
            axes = [i for i in range(rank) if static[i]]
            if axes:
                a = axes[int(self.rng.integers(len(axes)))]
                k = int(self.rng.choice([1, 2, 5]))
                if "n" in s:  # a constant cannot carry the symbolic batch: broadcast one of x's shape from x
                    k = s[a]
                    c = self.add("Add", [self.random_const(tuple(1 if d == "n" else d for d in s)),
                                         self.add("Mul", [x, self.const(np.array(0.0))], s, pool=False)], s, pool=False)
                else:
                    c = self.random_const(s[:a] + (k,) + s[a + 1:])
                y = self.add("Neg", [x], s, pool=False)
                self.add("Concat", [c, x, y], s[:a] + (k + 2 * s[a],) + s[a + 1:], axis=a)
        elif kind == "slice":  # constant bounds (negative starts, ends past the dim) on a static axis
            axes = [i for i in range(rank) if static[i] and s[i] > 2]
            if axes:
                a = axes[int(self.rng.integers(len(axes)))]
                lo = int(self.rng.integers(-s[a], s[a] - 1))
                start = lo + s[a] if lo < 0 else lo
                out = s[:a] + (s[a] - start,) + s[a + 1:]
                self.add("Relu", [self.add("Slice", [x, self.const(np.array([lo]), "st", np.int64),
                                                     self.const(np.array([s[a] + 7]), "en", np.int64),
                                                     self.axes(a)], out, pool=False)], out)
        elif kind == "expand_rt" and s[0] == "n" and all(static[1:]):
            # a constant expanded to x's batch read at run time (torch's expand(B, -1, ...)), then added
            b = self.add("Gather", [self.add("Shape", [x], (rank,), pool=False), self.const(np.array([0]), "i", np.int64)],
                         (1,), pool=False)
            tgt = self.add("Concat", [b, self.const(np.array([-1] * (rank - 1)), "m", np.int64)], (rank,), pool=False,
                           axis=0)
            tgt = self.add("Where", [self.add("Equal", [tgt, self.const(np.array(-1), "m", np.int64)], (rank,), pool=False),
                                     self.const(np.ones(rank), "one", np.int64), tgt], (rank,), pool=False)
            c = self.add("Expand", [self.random_const((1,) + s[1:]), tgt], s, pool=False)
            self.add("Add", [x, c], s)
        elif kind == "iota":  # x + 0.1 * position along an axis, its length read from x's shape at run time
            a = int(self.rng.integers(rank))
            dim = self.add("Gather", [self.add("Shape", [x], (rank,), pool=False), self.const(np.array(a), "i", np.int64)],
                           (), pool=False)
            pos = self.add("Range", [self.const(np.array(0), "r", np.int64), dim, self.const(np.array(1), "r", np.int64)],
                           (s[a],), pool=False)
            pos = self.add("Cast", [pos], (s[a],), pool=False, to=self.dtype)
            if a < rank - 1:
                pos = self.add("Unsqueeze", [pos, self.axes(*range(1, rank - a))], (s[a],) + (1,) * (rank - 1 - a),
                               pool=False)
            self.add("Add", [x, self.add("Mul", [pos, self.const(np.array(0.1))], (s[a],), pool=False)], s)
        elif kind == "expand":
            ones = [i for i, d in enumerate(s) if d == 1]
            if not ones:
                x = self.add("Unsqueeze", [x, self.axes(rank)], s + (1,))
                s, ones = s + (1,), [rank]
            i = ones[int(self.rng.integers(len(ones)))]
            target = [1] * len(s)
            target[i] = 3
            self.add("Expand", [x, self.const(np.array(target), "shape", np.int64)], s[:i] + (3,) + s[i + 1:])
        elif kind == "unsqueeze" and rank < 5:
            a = int(self.rng.integers(1, rank + 1))
            u = self.add("Unsqueeze", [x, self.axes(a)], s[:a] + (1,) + s[a:])
            self.add("Squeeze", [self.add("Relu", [u], s[:a] + (1,) + s[a:]), self.axes(a)], s)
        elif kind == "flatten" and rank >= 3 and all(static[1:]):
            self.add("Flatten", [x], (s[0], int(np.prod(s[1:]))), axis=1)
        elif kind == "pow":
            e = float(self.rng.choice([2.0, 3.0, 0.5]))
            self.add("Pow", [self.positive(x), self.const(np.array(e))], s)
        elif kind == "div":
            y = self.broadcast_partner(s)
            if self.shape(y) == s:
                self.add("Div", [x, self.positive(y)], s)
        elif kind == "logsoftmax":
            self.add("LogSoftmax", [x], s, axis=-1)
        elif kind == "softmax1" and rank >= 3:
            self.add("Softmax", [x], s, axis=1)
        elif kind == "sumsquare" and static[-1]:  # or another norm-like reduction over the row
            op = str(self.rng.choice(["ReduceSumSquare", "ReduceL2", "ReduceL1", "ReduceLogSumExp"]))
            self.reduce(op, x, (-1,), s[:-1] + (1,), 1)
        elif kind == "gemm" and rank == 2 and static[-1]:
            k = int(self.rng.choice([8, 24]))
            w = self.const(self.rng.uniform(-1, 1, (k, s[-1])) / np.sqrt(s[-1]), "w")
            self.add("Gemm", [x, w, self.random_const((k,))], (s[0], k), transB=1, alpha=0.5, beta=1.5)
        elif kind == "batched" and rank >= 3 and all(static[-3:]):
            k = int(self.rng.choice([8, 16]))
            w = self.const(self.rng.uniform(-1, 1, (s[-3], s[-1], k)) / np.sqrt(s[-1]), "w")
            self.add("MatMul", [x, w], s[:-1] + (k,))

    def exported(self, x: str, s: Shape) -> None:
        """torch.export's forms: a Split into uneven parts along a static axis (sizes as an input, or
        num_outputs at opset 18), Kᵀ's Reshape [-1, a, b] -> Transpose -> Reshape [.., b, a] with targets read
        through Shape, and an all-true mask expanded to x's run-time shape, Where(mask, 0, -10) added to x."""
        rng, rank = self.late, len(s)
        kind = str(rng.choice(["split", "regroup", "mask"]))
        axes = [i for i in range(rank) if isinstance(s[i], int) and s[i] > 2]
        if kind == "split" and axes:
            a = axes[int(rng.integers(len(axes)))]
            count = int(rng.integers(2, min(3, s[a]) + 1))
            if self.opset >= 18 and rng.random() < 0.5 and -(-s[a] // count) * (count - 1) < s[a]:
                part = -(-s[a] // count)
                sizes, ins, attrs = [min(part, s[a] - part * k) for k in range(count)], [x], {"num_outputs": count}
            else:
                cuts = sorted(rng.choice(np.arange(1, s[a]), count - 1, replace=False).tolist())
                sizes = [e - b for b, e in zip([0, *cuts], [*cuts, s[a]])]
                ins, attrs = [x, self.const(np.array(sizes), "sz", np.int64)], {}
            outs = [self.fresh("part") + f"_{k}" for k in range(count)]
            self.nodes.append(helper.make_node("Split", ins, outs, name=f"Split_{outs[0]}", axis=a - rank, **attrs))
            for o, n, op in zip(outs, sizes, ("Relu", "Neg", "Sigmoid")):
                self.add(op, [o], s[:a] + (n,) + s[a + 1:])
        elif kind == "regroup" and rank >= 3 and all(isinstance(d, int) for d in s[-2:]):
            shp = self.add("Shape", [x], (rank,), pool=False)
            lead = self.add("Slice", [shp, self.const(np.array([0]), "z", np.int64),
                                      self.const(np.array([-2]), "m2", np.int64)], (rank - 2,), pool=False)
            tail = [self.const(np.array([d]), "d", np.int64) for d in s[-2:]]
            merged = self.add("Reshape", [x, self.add("Concat", [self.const(np.array([-1]), "m1", np.int64), *tail], (3,),
                                                      pool=False, axis=0)], (None, *s[-2:]), pool=False)
            t = self.add("Transpose", [merged], (None, s[-1], s[-2]), pool=False, perm=[0, 2, 1])
            back = self.add("Concat", [lead, tail[1], tail[0]], (rank,), pool=False, axis=0)
            self.add("Reshape", [t, back], s[:-2] + (s[-1], s[-2]))
        elif kind == "mask" and isinstance(s[-1], int):
            mask = self.const(np.ones((1,) * (rank - 1) + (s[-1],), bool), "mask", np.bool_)
            e = self.add("Expand", [mask, self.add("Shape", [x], (rank,), pool=False)], s, pool=False)
            bias = self.add("Where", [e, self.const(np.array(0.0)), self.const(np.array(-10.0))], s, pool=False)
            self.add("Add", [x, bias], s)

    def window(self, x: str, s: Shape) -> None:
        """An index or window op on NCHW `s`: Pad (constant with a random fill, crops among the pads; edge;
        reflect), Resize (nearest in any nearest_mode, or bilinear; any coordinate mode; by scales up or
        down, or by sizes), MaxPool or AveragePool (strides, pads, dilations, ceil_mode, the padding counted
        or not), a depthwise Conv over tokens (SegFormer's Mix-FFN: the image is [n, h*w, c] around it), or
        GroupNorm as torch exports it; then an op the kernel can end in."""
        _, c, h, w = s
        kinds = ["pad", "resize", "pool", "tokens", "groupnorm"] + ["convnext"] * (self.rng.random() < 0.25)
        kind = str(self.rng.choice(kinds))
        if kind == "pad":
            mode = str(self.rng.choice(["constant", "edge", "reflect"]))
            lim = [0, 1, min(2, h - 1), min(2, w - 1)]  # no batch pads; reflect needs pads under the dim
            if mode == "reflect":
                lim[1] = min(1, c - 1)  # ORT refuses a reflect pad of a 1-wide axis (seed 600: one channel)
            pads = [int(self.rng.integers(0, lim[i % 4] + 1)) for i in range(8)]
            if mode == "constant" and self.rng.random() < 0.3:  # a crop on a spatial side, never of a whole
                side = int(self.rng.choice([2, 3, 6, 7]))  # axis (seed 1208: a Conv then read an empty image,
                if s[side % 4] + pads[side % 4] + pads[side % 4 + 4] - pads[side] - 1 >= 1:  # which ORT refuses)
                    pads[side] = -1
            ins = [x, self.const(np.array(pads), "pads", np.int64)]
            if mode == "constant":
                ins.append(self.const(np.array(float(self.rng.choice([0.0, 0.25, -1.5])))))
            out = tuple(d + pads[i] + pads[i + 4] if i else d for i, d in enumerate(s))
            out = self.add("Pad", ins, out, mode=mode)
        elif kind == "resize":
            mode = str(self.rng.choice(["nearest", "linear"]))
            ctm = str(self.rng.choice(["half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners"]))
            attrs = dict(mode=mode, coordinate_transformation_mode=ctm)
            if mode == "nearest":
                attrs["nearest_mode"] = str(self.rng.choice(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))
            if self.rng.random() < 0.6:
                sc = [float(self.rng.choice([2.0, 0.5, 1.5, 0.6])) for _ in range(2)]
                ins = [x, "", self.const(np.array([1.0, 1.0] + sc), "sc", np.float32)]
                out = ("n", c, int(np.floor(h * sc[0])), int(np.floor(w * sc[1])))
                if min(out[2:]) < 1:
                    return
            else:
                hw = [int(self.rng.integers(1, 2 * h + 1)), int(self.rng.integers(1, 2 * w + 1))]
                # sizes of the batch and channels read from x at run time, the spatial ones constant
                nc = self.add("Slice", [self.add("Shape", [x], (4,), pool=False), self.const(np.array([0]), "z", np.int64),
                                        self.const(np.array([2]), "two", np.int64)], (2,), pool=False)
                ins = [x, "", "", self.add("Concat", [nc, self.const(np.array(hw), "hw", np.int64)], (4,), pool=False,
                                           axis=0)]
                out = ("n", c) + tuple(hw)
            out = self.add("Resize", ins, out, **attrs)
        elif kind == "pool":
            op = str(self.rng.choice(["MaxPool", "AveragePool"]))
            k = [int(self.rng.choice([1, 2, 3])) for _ in range(2)]
            stride = int(self.rng.choice([1, 1, 2]))
            pads = [int(self.rng.integers(0, kk)) for kk in k] * 2  # under the kernel, as ONNX requires
            attrs = dict(kernel_shape=k, strides=[stride] * 2, pads=pads)
            dil = 1
            if op == "MaxPool":
                dil = int(self.rng.choice([1, 1, 2]))
                attrs.update(dilations=[dil] * 2, ceil_mode=int(self.rng.random() < 0.3))
            else:
                attrs["count_include_pad"] = int(self.rng.random() < 0.5)
            size = [(d + 2 * p - dil * (kk - 1) - 1) for d, p, kk in zip((h, w), pads, k)]
            ceil = attrs.get("ceil_mode", 0)
            floor = [v // stride + 1 for v in size]
            size = [(v + (stride - 1 if ceil else 0)) // stride + 1 for v in size]
            if ceil and any((o - 1) * stride >= d + p for o, d, p in zip(size, (h, w), pads[:2])):
                # ORT drops a last window that starts past the image and its leading pad, ONNX's shape
                # inference keeps it: such a model disagrees with itself, so it is not generated
                attrs["ceil_mode"], size = 0, floor
            same = [-(-h // stride), -(-w // stride)]
            # (ORT refuses the negative padding that "same" asks of a kernel narrower than its stride: a
            # condition after the draw, so the seeds drawn before it keep their graphs)
            if self.alt is not None and dil == 1 and not attrs.get("ceil_mode") and self.alt.random() < 0.25 \
                    and all((o - 1) * stride + kk >= d for o, kk, d in zip(same, k, (h, w))):
                del attrs["pads"]  # TF's "same" padding
                attrs["auto_pad"] = str(self.alt.choice(["SAME_UPPER", "SAME_LOWER"]))
                size = same
            if min(size) < 1:
                return
            out = self.add(op, [x], ("n", c) + tuple(size), **attrs)
        elif kind == "groupnorm":  # torch's export: [n, groups, -1], InstanceNormalization, back to Shape(x)
            groups = int(self.rng.choice([d for d in (1, 2, 4, c) if c % d == 0]))
            xg = self.add("Reshape", [x, self.const(np.array([0, groups, -1]), "shape", np.int64)],
                          ("n", groups, c // groups * h * w), pool=False)
            yn = self.add("InstanceNormalization", [xg, self.random_const((groups,)), self.random_const((groups,))],
                          ("n", groups, c // groups * h * w), pool=False, epsilon=1e-5)
            y = self.add("Reshape", [yn, self.add("Shape", [x], (4,), pool=False)], s, pool=False)
            out = self.add("Add", [self.add("Mul", [y, self.random_const((c, 1, 1))], s, pool=False),
                                   self.random_const((c, 1, 1))], s)
        elif kind == "convnext":  # ConvNeXt's blocks: a depthwise KxK of the NCHW stream, LayerNorm and a scale
            # channels-last, back to NCHW and the residual Add (rewriter.layout may keep the stream channels-last)
            k = int(self.rng.choice([3, 7]))
            cl = ("n", h, w, c)
            out = x
            for _ in range(int(self.rng.integers(1, 4))):
                wt = self.const(self.rng.uniform(-1, 1, (c, 1, k, k)) / k, "w")
                dw = self.add("Conv", [out, wt, self.random_const((c,))], s, pool=False, group=c, kernel_shape=[k, k],
                              pads=[k // 2] * 4)
                t = self.add("Transpose", [dw], cl, pool=False, perm=[0, 2, 3, 1])
                ln = self.add("LayerNormalization", [t, self.random_const((c,)), self.random_const((c,))], cl,
                              pool=False, axis=-1, epsilon=1e-5)
                back = self.add("Transpose", [self.add("Mul", [ln, self.random_const((c,))], cl, pool=False)], s,
                                pool=False, perm=[0, 3, 1, 2])
                out = self.add("Add", [out, back], s)
        else:  # [n, c, h, w] -> tokens [n, h*w, c] -> (image -> depthwise 3x3 -> tokens) -> back
            tok = self.add("Transpose", [self.add("Reshape", [x, self.const(np.array([0, c, h * w]), "shape", np.int64)],
                                                  ("n", c, h * w), pool=False)], ("n", h * w, c), pool=False, perm=[0, 2, 1])
            img = self.add("Reshape", [self.add("Transpose", [tok], ("n", c, h * w), pool=False, perm=[0, 2, 1]),
                                       self.const(np.array([0, c, h, w]), "shape", np.int64)], s, pool=False)
            wt = self.const(self.rng.uniform(-1, 1, (c, 1, 3, 3)) / 3.0, "w")
            dw = self.add("Conv", [img, wt, self.random_const((c,))], s, pool=False, group=c, kernel_shape=[3, 3],
                          pads=[1, 1, 1, 1])
            back = self.add("Transpose", [self.add("Reshape", [dw, self.const(np.array([0, c, h * w]), "shape", np.int64)],
                                                   ("n", c, h * w), pool=False)], ("n", h * w, c), pool=False, perm=[0, 2, 1])
            self.add("Add", [back, tok], ("n", h * w, c))
            return
        if self.rng.random() < 0.6:
            self.add(str(self.rng.choice(["Relu", "Sigmoid", "Neg"])), [out], self.values[out])

    def conv(self, x: str, s: Shape) -> None:
        """A Conv on NCHW `s`: random kernel, stride, padding, dilation and groups (depthwise among them),
        with a bias half of the time, then maybe an activation and a residual the epilogue can take."""
        _, c, h, w = s
        group = int(self.rng.choice([1, 1, c] + ([2] if c % 2 == 0 else [])))
        oc = c if group == c else int(self.rng.choice([4, 8, 12]))  # divisible by the other groups (1, 2)
        kh, kw = (int(self.rng.choice([1, 3])), int(self.rng.choice([1, 3]))) if self.rng.random() < 0.8 else (2, 5)
        stride, dil = int(self.rng.choice([1, 1, 2])), int(self.rng.choice([1, 1, 2]))
        pads = [int(self.rng.integers(0, k)) for k in (kh, kw)] * 2
        oh = (h + pads[0] + pads[2] - dil * (kh - 1) - 1) // stride + 1
        ow = (w + pads[1] + pads[3] - dil * (kw - 1) - 1) // stride + 1
        padding: dict = dict(pads=pads)
        if self.alt is not None and dil == 1 and self.alt.random() < 0.25:  # TF's "same" padding
            padding = dict(auto_pad=str(self.alt.choice(["SAME_UPPER", "SAME_LOWER"])))
            oh, ow = -(-h // stride), -(-w // stride)
        if oh < 1 or ow < 1:
            return
        wshape = (oc, c // group, kh, kw)
        wt = self.const(self.rng.uniform(-1, 1, wshape) / np.sqrt(c // group * kh * kw), "w")
        if self.alt is not None and self.alt.random() < 0.2:
            wt = self.standardized(wt, wshape)
        ins = [x, wt] + ([self.random_const((oc,))] if self.rng.random() < 0.5 else [])
        out = self.add("Conv", ins, ("n", oc, oh, ow), group=group, kernel_shape=[kh, kw], strides=[stride] * 2,
                       dilations=[dil] * 2, **padding)
        if self.rng.random() < 0.5:
            out = self.add(str(self.rng.choice(["Relu", "Sigmoid", "HardSwish"])), [out], ("n", oc, oh, ow))
        if (oc, oh, ow) == (c, h, w) and self.rng.random() < 0.5:
            self.add("Add", [out, x], s)


def _at(shape: Shape, i: int, rank: int):
    """Dim i of `shape` right-aligned to `rank` dims (1 where it has none)."""
    j = i - (rank - len(shape))
    return shape[j] if j >= 0 else 1


def random_model(seed: int) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """(model, {input: shape with "n"}) for one seed."""
    rng = np.random.default_rng(seed)
    dtype = TP.FLOAT if rng.random() < 0.6 else TP.FLOAT16
    b = _Builder(rng, dtype, OLD_OPSET if rng.random() < 0.25 else OPSET)
    b.alt = np.random.default_rng(seed + 1_000_003)
    b.late = np.random.default_rng(seed + 2_000_003)
    rank = int(rng.integers(2, 5))
    shape = ("n",) + tuple(int(rng.choice([2, 3, 5, 8])) for _ in range(rank - 2)) + (int(rng.choice(LAST_DIMS[3:])),)
    if rank == 4 and rng.random() < 0.5:  # an image: channels, then a small spatial map
        shape = ("n", int(rng.choice([3, 4, 8, 16])), int(rng.choice([5, 8, 9])), int(rng.choice([6, 7, 8])))
    b.inputs.append(helper.make_tensor_value_info("x", dtype, list(shape)))
    b.values["x"] = shape
    for _ in range(int(rng.integers(4, 14))):
        b.step()
    outs = [b.produced[-1]] if b.produced else ["x"]
    extra = [n for n in b.produced[:-1] if rng.random() < 0.15]
    outputs = [helper.make_tensor_value_info(n, dtype, None) for n in outs + extra[:2]]
    g = helper.make_graph(b.nodes, f"fuzz{seed}", b.inputs, outputs, b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", b.opset)])
    m.ir_version = 9
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    for out, inf in zip(m.graph.output, inferred.graph.output):
        out.type.CopyFrom(inf.type)
    return m, {i.name: b.values[i.name] for i in b.inputs}


def symbolic_image(m: onnx.ModelProto, shapes: dict[str, tuple]) -> tuple[onnx.ModelProto, dict[str, tuple]] | None:
    """The random model with its image input's height and width declared symbolic ("h", "w") and its outputs'
    shapes left to inference, if it has an image input and a Conv or window op; shapes map "h", "w" to the sizes the
    graph was built for (its constants fit those)."""
    x = shapes.get("x", ())
    if len(x) != 4 or not any(n.op_type in WINDOW for n in m.graph.node):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(m)
    dims = out.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "h", "w"
    for o in out.graph.output:
        for d in o.type.tensor_type.shape.dim:
            d.Clear()
    return out, {**shapes, "x": ("n", x[1], "h", "w"), "sizes": (x[2], x[3])}


@dataclass
class _Parts:
    """Nodes and initializers of a generated graph: `const` adds a weight of the graph's type (or `dt`), `add`
    a node named after its first output."""
    npdt: type
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)

    def const(self, name: str, value, dt=None) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dt or self.npdt), name))
        return name

    def add(self, op: str, ins, outs, **attrs) -> str:
        self.nodes.append(helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", **attrs))
        return outs[0]


def random_attention(seed: int) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """(model, {input: shape}) of one attention block in one of the layouts exporters emit: Q/K/V from
    projections of x (separate MatMuls, or one packed MatMul read through Split or Slices; or K/V from a
    memory of another length, cross-attention), heads
    split by Reshape + Transpose, Kᵀ by one 4-D Transpose or two, a scale on the scores (Mul or Div) or on
    Q, an optional mask (additive [n,1,1,Sk] or [n,1,Sq,Sk], a boolean keep-mask, or causal: Where on a
    constant, or over a symbolic length torch's Trilu of ones sized through Shape), an
    optional Cast around the Softmax (mixed precision), heads merged back. Batch is symbolic ("n"), the
    sequence symbolic ("s") for half the seeds; sizes hit odd lengths and head dims up to 128."""
    rng = np.random.default_rng(seed)
    alt = np.random.default_rng(seed + 1_000_003)  # variations added later: older seeds keep their blocks
    dtype = TP.FLOAT if rng.random() < 0.5 else TP.FLOAT16
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    heads, head = int(rng.choice([1, 2, 3, 4])), int(rng.choice([8, 16, 24, 32, 40, 64, 80, 128]))
    seq = int(rng.choice([1, 5, 16, 33, 64, 77]))
    sdim = "s" if rng.random() < 0.5 else seq
    hidden = heads * head
    parts = _Parts(npdt)
    nodes, inits, const, add = parts.nodes, parts.inits, parts.const, parts.add

    def weight(name, cols):
        return const(name, rng.uniform(-1, 1, (hidden, cols)) / np.sqrt(hidden))

    packing = str(rng.choice(["separate", "split", "slice", "cross"]))
    kdim = sdim  # key/value length: the memory's for cross-attention (encoder-decoder exporters)
    if packing == "cross":
        kdim = "m" if rng.random() < 0.5 else int(rng.choice([3, 17, 40]))
        q = add("MatMul", ["x", weight("wq", hidden)], ["xq"])
        k, v = (add("MatMul", ["mem", weight(f"w{t}", hidden)], [f"x{t}"]) for t in "kv")
    elif packing == "separate":
        q, k, v = (add("MatMul", ["x", weight(f"w{t}", hidden)], [f"x{t}"]) for t in "qkv")
    else:
        qkv = add("MatMul", ["x", weight("wqkv", 3 * hidden)], ["qkv"])
        if rng.random() < 0.5:
            qkv = add("Add", [qkv, const("bqkv", rng.uniform(-0.2, 0.2, 3 * hidden))], ["qkvb"])
        if packing == "split":
            q, k, v = (f"x{t}" for t in "qkv")
            add("Split", [qkv, const("sizes", [hidden] * 3, np.int64)], [q, k, v], axis=2)
        else:
            q, k, v = (add("Slice", [qkv, const(f"st{i}", [i * hidden], np.int64),
                                     const(f"en{i}", [(i + 1) * hidden], np.int64), const(f"ax{i}", [2], np.int64)],
                           [f"x{t}"]) for i, t in enumerate("qkv"))
    if packing in ("separate", "cross") and alt.random() < 0.4:  # biased projections (BERT's, Qwen2's)
        q, k, v = (add("Add", [const(f"b{t}", alt.uniform(-0.2, 0.2, hidden)), y], [f"{y}b"])
                   for t, y in zip("qkv", (q, k, v)))
    shp4 = const("shp4", [0, 0, heads, head], np.int64)
    qh = add("Transpose", [add("Reshape", [q, shp4], ["q4"])], ["qh"], perm=[0, 2, 1, 3])
    k4 = add("Reshape", [k, shp4], ["k4"])
    if rng.random() < 0.5:
        kt = add("Transpose", [k4], ["kt"], perm=[0, 2, 3, 1])
    else:
        kt = add("Transpose", [add("Transpose", [k4], ["kh"], perm=[0, 2, 1, 3])], ["kt"], perm=[0, 1, 3, 2])
    vh = add("Transpose", [add("Reshape", [v, shp4], ["v4"])], ["vh"], perm=[0, 2, 1, 3])
    scale = str(rng.choice(["mul", "div", "q", "none"]))
    if scale == "q":
        qh = add("Mul", [qh, const("qscale", 1 / np.sqrt(head))], ["qs"])
    s = add("MatMul", [qh, kt], ["s0"])
    if scale == "mul":
        s = add("Mul", [s, const("scale", 1 / np.sqrt(head))], ["s1"])
    elif scale == "div":
        s = add("Div", [s, const("scale", np.sqrt(head))], ["s1"])
    inputs = [helper.make_tensor_value_info("x", dtype, ["n", sdim, hidden])]
    if packing == "cross":
        inputs.append(helper.make_tensor_value_info("mem", dtype, ["n", kdim, hidden]))
    mask = str(rng.choice(["none", "padding", "full", "bool", "causal"])) if seq > 1 else "none"
    if mask == "padding":
        inputs.append(helper.make_tensor_value_info("mask", dtype, ["n", 1, 1, kdim]))
        s = add("Add", [s, "mask"], ["s2"])
    elif mask == "full":  # one additive mask per query row, shared by the heads
        inputs.append(helper.make_tensor_value_info("mask", dtype, ["n", 1, sdim, kdim]))
        s = add("Add", ["mask", s], ["s2"])
    elif mask == "bool":  # keep-mask from an input, masked scores set to the dtype's lowest value
        inputs.append(helper.make_tensor_value_info("keep", TP.BOOL, ["n", 1, 1, kdim]))
        s = add("Where", ["keep", s, const("low", np.finfo(npdt).min)], ["s2"])
    elif mask == "causal" and sdim == seq and packing != "cross":
        keep = np.tril(np.ones((seq, seq), bool))[None, None]
        s = add("Where", [const("keep", keep, np.bool_), s, const("ninf", np.finfo(npdt).min)], ["s2"])
    elif mask == "causal" and packing != "cross":  # over a symbolic length: torch's Trilu of ones sized by Shape
        dims = [add("Slice", [add("Shape", [qh], ["qshape"]), const("m2", [-2], np.int64), const("m1", [-1], np.int64)],
                    ["rows"]),
                add("Slice", [add("Shape", [kt], ["kshape"]), const("m1b", [-1], np.int64),
                              const("end", [2**63 - 1], np.int64)], ["cols"])]
        hw = add("Concat", dims, ["hw"], axis=0)
        ones = add("Expand", [const("one", np.array(1.0)), hw], ["ones"]) if alt.random() < 0.5 else \
            add("ConstantOfShape", [hw], ["ones"], value=helper.make_tensor("v", dtype, [1], [1.0]))
        hidden_ = add("Equal", [add("Trilu", [ones], ["tri"], upper=0), const("zero", np.array(0.0))], ["hidden"])
        s = add("Add", [s, add("Where", [hidden_, const("ninf", np.array(-np.inf)), const("zero2", np.array(0.0))],
                              ["bias"])], ["s2"])
    upcast = dtype == TP.FLOAT16 and rng.random() < 0.3
    if upcast:
        s = add("Cast", [s], ["s32"], to=TP.FLOAT)
    p = add("Softmax", [s], ["p"], axis=-1)
    if upcast:
        p = add("Cast", [p], ["p16"], to=TP.FLOAT16)
    o = add("MatMul", [p, vh], ["o"])
    if rng.random() < 0.8:  # heads merged back, or the per-head output [n, H, S, D] returned as it is
        o = add("Transpose", [o], ["o4"], perm=[0, 2, 1, 3])
        o = add("Reshape", [o, const("shp3", [0, 0, hidden], np.int64)], ["y"])
    else:
        o = add("Identity", [o], ["y"])
    g = helper.make_graph(nodes, f"attn{seed}", inputs, [helper.make_tensor_value_info("y", dtype, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 9
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    m.graph.output[0].type.CopyFrom(inferred.graph.output[0].type)
    return m, {i.name: tuple(d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim) for i in inputs}


MUTATIONS = ("drop_initializer", "dangling_input", "bad_attribute", "cycle", "duplicate_output", "string_input",
             "repeated_perm", "axis_out_of_range", "wrong_rank_initializer", "unknown_op", "truncated_bytes",
             "no_opset", "double_initializer")


def corrupt(m: onnx.ModelProto, seed: int) -> tuple[str, onnx.ModelProto | bytes]:
    """(mutation, a copy of `m` broken one way, or its truncated bytes) for the bad-input fuzz test."""
    rng = np.random.default_rng(seed)
    kind = str(rng.choice(MUTATIONS))
    if kind == "truncated_bytes":
        return kind, m.SerializeToString()[: int(rng.integers(10, 200))]
    m = onnx.ModelProto.FromString(m.SerializeToString())
    g, nodes = m.graph, list(m.graph.node)
    n = nodes[int(rng.integers(len(nodes)))]
    if kind == "drop_initializer" and len(g.initializer):
        del g.initializer[int(rng.integers(len(g.initializer)))]
    elif kind == "dangling_input":
        n.input[0] = "does_not_exist"
    elif kind == "bad_attribute":
        n.attribute.append(helper.make_attribute("axis", "not an int"))
    elif kind == "cycle" and len(nodes) > 1:
        nodes[0].input[0] = nodes[-1].output[0]
    elif kind == "duplicate_output" and len(nodes) > 1:
        nodes[1].output[0] = nodes[0].output[0]
    elif kind == "string_input":
        g.input[0].type.tensor_type.elem_type = TP.STRING
    elif kind == "repeated_perm":
        n.op_type, n.input[1:] = "Transpose", []
        del n.attribute[:]
        n.attribute.append(helper.make_attribute("perm", [0, 0]))
    elif kind == "axis_out_of_range":
        n.op_type, n.input[1:] = "Softmax", []
        del n.attribute[:]
        n.attribute.append(helper.make_attribute("axis", 7))
    elif kind == "wrong_rank_initializer" and len(g.initializer):
        t = g.initializer[0]
        t.CopyFrom(numpy_helper.from_array(np.ones((5, 5, 5), helper.tensor_dtype_to_np_dtype(t.data_type)), t.name))
    elif kind == "unknown_op":
        n.op_type = "NoSuchOp"
    elif kind == "no_opset":
        del m.opset_import[:]
    elif kind == "double_initializer":
        for t in g.initializer:
            if t.data_type in (TP.FLOAT, TP.FLOAT16):
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
                break
    return kind, m


def random_cache(seed: int) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """(model, {input: shape}) of a KV-cache-like Concat along an axis of run-time size: a cached input
    ("past", its span "p", empty at a first step) and one or two tensors computed from "x" (span "s", or a
    static one), in a random order along a random axis (the innermost too), element-wise ops after it, the
    concatenation itself an output for half the seeds (the present key or value)."""
    rng = np.random.default_rng(seed)
    dtype = TP.FLOAT if rng.random() < 0.5 else TP.FLOAT16
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    rank = int(rng.integers(3, 5))
    base = ["n"] + [int(rng.choice([2, 3, 4])) for _ in range(rank - 2)] + [int(rng.choice([4, 8, 16, 17]))]
    axis = int(rng.integers(1, rank))
    new_span = "s" if rng.random() < 0.6 else int(rng.choice([1, 3]))
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=npdt), name))
        return name

    def add(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=f"{op}_{out}", **attrs))
        return out

    shape = lambda span: base[:axis] + [span] + base[axis + 1:]  # noqa: E731
    inputs = [helper.make_tensor_value_info("past", dtype, shape("p")),
              helper.make_tensor_value_info("x", dtype, shape(new_span))]
    row = [1] * (rank - 1) + [base[-1]] if axis != rank - 1 else [1] * rank
    new = add("Mul", ["x", const("scale", rng.uniform(0.5, 2.0, row))], "xs")
    parts = ["past", add(str(rng.choice(["Neg", "Tanh", "Sigmoid"])), [new], "xn")]
    if rng.random() < 0.3:  # a third part: the new tokens again, shifted
        parts.append(add("Add", [new, const("shift", 0.25)], "xa"))
    order = [parts[i] for i in rng.permutation(len(parts))]
    cat = add("Concat", order, "present", axis=axis - rank if rng.random() < 0.5 else axis)
    y = add("Relu", [add("Add", [cat, const("bias", rng.uniform(-1, 1, row))], "cb")], "y")
    outputs = [helper.make_tensor_value_info(y, dtype, None)]
    if rng.random() < 0.5:
        outputs.append(helper.make_tensor_value_info(cat, dtype, None))
    g = helper.make_graph(nodes, f"cache{seed}", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 9
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    for out, inf in zip(m.graph.output, inferred.graph.output):
        out.type.CopyFrom(inf.type)
    return m, {i.name: tuple(d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim) for i in inputs}


def random_ort_block(seed: int) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """(model, {input: shape}) of 1-3 transformer MLP blocks as onnxruntime.transformers' optimizer leaves them:
    MatMul -> BiasGelu / FastGelu (with or without its bias) / Gelu / QuickGelu / SiLU -> MatMul ->
    SkipLayerNormalization (optional beta and bias) or SkipSimplifiedLayerNormalization (optional bias), its
    residual sum sometimes read by the next block or returned, its skip either operand; an optional
    SimplifiedLayerNormalization or LayerNormalization (ORT's, in the default domain at opset 14) at the end.
    fp32 or fp16; batch symbolic ("n"), the sequence symbolic ("s") for half the seeds; hidden sizes odd or
    aligned."""
    rng = np.random.default_rng(seed)
    dtype = TP.FLOAT if rng.random() < 0.5 else TP.FLOAT16
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    hidden, ffn = int(rng.choice([24, 40, 64, 72, 96])), int(rng.choice([48, 64, 100, 128, 192]))
    seq = int(rng.choice([1, 5, 16, 33]))
    sdim = "s" if rng.random() < 0.5 else seq
    opset = 17 if rng.random() < 0.7 else 14
    nodes, inits, outputs = [], [], []
    ms = "com.microsoft"

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=npdt), name))
        return name

    def add(op, ins, outs, domain="", **attrs):
        nodes.append(helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", domain=domain, **attrs))
        return outs[0]

    x = "x"
    for layer in range(int(rng.integers(1, 4))):
        p = f"l{layer}_"
        w1 = const(p + "w1", rng.uniform(-1, 1, (hidden, ffn)) / np.sqrt(hidden))
        b1 = const(p + "b1", rng.uniform(-0.2, 0.2, ffn))
        h = add("MatMul", [x, w1], [p + "h"])
        act = str(rng.choice(["BiasGelu", "FastGelu", "FastGelu-nobias", "Gelu", "QuickGelu", "silu"]))
        if act == "BiasGelu":
            a = add("BiasGelu", [h, b1], [p + "a"], ms)
        elif act == "FastGelu":
            a = add("FastGelu", [h, b1], [p + "a"], ms)
        elif act == "silu":
            a = add("Mul", [h, add("Sigmoid", [h], [p + "sg"])], [p + "a"])
        else:
            hb = add("Add", [h, b1], [p + "hb"])
            a = add(act.split("-")[0], [hb], [p + "a"], ms, **({"alpha": 1.5} if act == "QuickGelu" else {}))
        w2 = const(p + "w2", rng.uniform(-1, 1, (ffn, hidden)) / np.sqrt(ffn))
        o = add("MatMul", [a, w2], [p + "o"])
        gamma = const(p + "g", 1 + rng.uniform(-0.3, 0.3, hidden))
        ins = [o, x] if rng.random() < 0.7 else [x, o]
        summed = rng.random() < 0.5
        outs = [p + "y", "", "", p + "sum"] if summed else [p + "y"]
        eps = float(rng.choice([1e-5, 1e-6, 1e-12]))
        if rng.random() < 0.6:
            beta = const(p + "be", rng.uniform(-0.2, 0.2, hidden)) if rng.random() < 0.7 else ""
            bias = const(p + "b2", rng.uniform(-0.2, 0.2, hidden)) if rng.random() < 0.7 else ""
            extra = [beta, bias] if bias else [beta] if beta else []
            y = add("SkipLayerNormalization", [*ins, gamma, *extra], outs, ms, epsilon=eps)
        else:
            bias = [const(p + "b2", rng.uniform(-0.2, 0.2, hidden))] if rng.random() < 0.5 else []
            y = add("SkipSimplifiedLayerNormalization", [*ins, gamma, *bias], outs, ms, epsilon=eps)
        if summed:
            outputs.append(p + "sum")
        x = y
    last = rng.random()
    if last < 0.3:
        x = add("SimplifiedLayerNormalization", [x, const("fg", 1 + rng.uniform(-0.3, 0.3, hidden))], ["yn"],
                epsilon=1e-6)
    elif last < 0.5:
        x = add("LayerNormalization", [x, const("fg", 1 + rng.uniform(-0.3, 0.3, hidden)),
                                       const("fb", rng.uniform(-0.2, 0.2, hidden))], ["yn"], epsilon=1e-5)
    outputs.append(x)
    inputs = [helper.make_tensor_value_info("x", dtype, ["n", sdim, hidden])]
    g = helper.make_graph(nodes, f"ortblock{seed}", inputs,
                          [helper.make_tensor_value_info(t, dtype, ["n", sdim, hidden]) for t in outputs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(ms, 1)])
    m.ir_version = 8
    return m, {"x": ("n", sdim, hidden)}


def random_onnx_attention(seed: int) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """(model, {input: shape}) of 1-2 layers of ONNX's Attention (opset 23, as torch's exporter writes SDPA
    there) in the forms ORT 1.31's kernel runs: Q, K, V projected from x and split into heads ([n, H, s, D]
    through Reshape and Transpose) or left 3-D (q_num_heads, kv_num_heads); grouped key/value heads; a bool
    or float mask [n, 1, s, T] or [s, T] shared by the layers (a float one hides some rows' every key with
    -inf or its type's lowest); is_causal without a past (any lengths); a past of "m" keys (present outputs);
    a scale, a softcap; ONNX's RotaryEmbedding on Q and K (4-D, caches [n, s, R/2], partial R). fp32 or
    fp16; the sequence symbolic ("s") or static."""
    rng = np.random.default_rng(seed)
    dtype = TP.FLOAT if rng.random() < 0.5 else TP.FLOAT16
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    kv_heads = int(rng.choice([1, 2, 3]))
    heads = kv_heads * int(rng.choice([1, 2]))
    head = int(rng.choice([8, 16, 24, 64]))
    hidden = int(rng.choice([32, 48]))
    seq = int(rng.choice([3, 7, 16]))
    static = rng.random() < 0.4
    sdim = seq if static else "s"
    three = rng.random() < 0.3
    past = rng.random() < 0.35
    causal = not past and rng.random() < 0.5
    mask = str(rng.choice(["none", "bool", "float"]))
    mask_rank = 4 if rng.random() < 0.7 else 2
    rope = not three and rng.random() < 0.4
    keys = f"m + {sdim}" if past else sdim
    parts = _Parts(npdt)
    nodes, inits, const, add = parts.nodes, parts.inits, parts.const, parts.add
    inputs, outputs = [helper.make_tensor_value_info("x", dtype, ["n", sdim, hidden])], []
    shapes: dict[str, tuple] = {"x": ("n", sdim, hidden)}

    def vi(name, shape, dt=dtype):
        inputs.append(helper.make_tensor_value_info(name, dt, list(shape)))
        shapes[name] = tuple(shape)
        return name

    m = ""
    if mask != "none":
        m = vi("mask", ["n", 1, sdim, keys] if mask_rank == 4 else [sdim, keys], TP.BOOL if mask == "bool" else dtype)
    rot = int(rng.choice([head, head // 2])) if rope and head % 4 == 0 else 0
    if rot:
        vi("cos", ["n", sdim, rot // 2])
        vi("sin", ["n", sdim, rot // 2])
    x = "x"
    for layer in range(int(rng.integers(1, 3))):
        p = f"l{layer}_"
        proj = {}
        for w, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            y = add("MatMul", [x, const(p + "w" + w, rng.uniform(-1, 1, (hidden, h * head)) / np.sqrt(hidden))],
                    [p + w + "2"])
            if not three:
                r = add("Reshape", [y, const(p + w + "_sh", [0, 0, h, head], np.int64)], [p + w + "3"])
                y = add("Transpose", [r], [p + w], perm=[0, 2, 1, 3])
            proj[w] = y
        if rot:
            for w, h in (("q", heads), ("k", kv_heads)):
                proj[w] = add("RotaryEmbedding", [proj[w], "cos", "sin"], [p + w + "_rope"],
                              **({"rotary_embedding_dim": rot} if rot != head else {}))
        names = [proj["q"], proj["k"], proj["v"], m]
        outs = [p + "att"]
        if past:
            names += [vi(p + "past_k", ["n", kv_heads, "m", head]), vi(p + "past_v", ["n", kv_heads, "m", head])]
            outs += [p + "present_k", p + "present_v"]
            outputs += [(o, ["n", kv_heads, keys, head]) for o in outs[1:]]
        attrs = {"q_num_heads": heads, "kv_num_heads": kv_heads} if three else {}
        if causal:
            attrs["is_causal"] = 1
        if rng.random() < 0.3:
            attrs["scale"] = float(rng.choice([0.1, 0.25, 0.5]))
        if rng.random() < 0.2:
            attrs["softcap"] = float(rng.choice([2.0, 20.0]))
        while names and not names[-1]:
            names.pop()
        att = add("Attention", names, outs, **attrs)
        if not three:
            att = add("Reshape", [add("Transpose", [att], [p + "att_t"], perm=[0, 2, 1, 3]),
                                  const(p + "o_sh", [0, 0, heads * head], np.int64)], [p + "att_m"])
        x = add("Add", [x, add("MatMul", [att, const(p + "wo", rng.uniform(-1, 1, (heads * head, hidden)) /
                                                      np.sqrt(heads * head))], [p + "o"])], [p + "y"])
    outputs.insert(0, (x, ["n", sdim, hidden]))
    g = helper.make_graph(nodes, f"onnxattention{seed}", inputs,
                          [helper.make_tensor_value_info(t, dtype, s) for t, s in outputs], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model, shapes


CAUSAL_FORMS = ("le", "ge", "not_gt", "lt", "trilu", "sliced", "window", "none")


def random_causal_mask(seed: int) -> tuple[onnx.ModelProto, dict[str, tuple], dict]:
    """(model, {input: shape}, {"past", "form", "value", "scale", "padding", "kv"}) of one attention block
    [n, s, 2 * head] whose mask the graph builds as exporters do, for the causal-frontier analysis
    (customops/key_bound.py): query positions Range(0, Sq) (after a past of P cached keys: plus P, read
    through Shape) against key positions Range(0, Sk), compared one of several ways with a diagonal shift c
    (`CAUSAL_FORMS`: j <= i + c and its rewritings, a Trilu of ones, GPT-2's buffer sliced at run time from
    Sk - Sq, a sliding window, or no causal rule), as int64 or float positions; with a key-padding mask (bool,
    or int64 flags added as (1 - m) * low), a mask value from -inf to one too shallow to hide a key (-100),
    applied by Where or added (or an indicator times it), and a positive scale after it; K and V of one head
    for both query heads ("kv" 1: repeat_kv after the cache) for some seeds. Every row keeps a
    visible key (c >= 0, no padding under a window), so the kernels must match ORT exactly whatever the
    analysis proves."""
    rng = np.random.default_rng(seed)
    dtype = TP.FLOAT16 if rng.random() < 0.6 else TP.FLOAT
    npdt = helper.tensor_dtype_to_np_dtype(dtype)
    heads, head = 2, 64 if dtype == TP.FLOAT16 else 32
    hd = heads * head
    form = str(rng.choice(CAUSAL_FORMS))
    past = form not in ("trilu",) and rng.random() < 0.5
    alt = np.random.default_rng(seed + 1_000_003)  # variations added later: older seeds keep their blocks
    kv = 1 if alt.random() < 0.3 else heads  # one K/V head for both query heads (Llama's repeat_kv)
    parts = _Parts(npdt)
    const, add = parts.const, parts.add
    i64 = np.int64
    shp4 = const("shp4", [0, 0, heads, head], i64)
    shp4kv = const("shp4kv", [0, 0, kv, head], i64)
    inputs = [helper.make_tensor_value_info("q", dtype, ["n", "s", hd])] + \
        [helper.make_tensor_value_info(x, dtype, ["n", "s", kv * head]) for x in "kv"]
    qh, kn, vn = (add("Transpose", [add("Reshape", [x, shp4 if x == "q" else shp4kv], [f"{x}4"])], [f"{x}h"],
                      perm=[0, 2, 1, 3]) for x in "qkv")
    if past:
        inputs += [helper.make_tensor_value_info(x, dtype, ["n", kv, "p", head]) for x in ("past_k", "past_v")]
        kh, vh = (add("Concat", [p, x], [f"{x}c"], axis=2) for p, x in (("past_k", kn), ("past_v", vn)))
    else:
        kh, vh = kn, vn
    if kv != heads:  # repeat_kv after the cache: Unsqueeze, Expand, Reshape
        kh, vh = (add("Reshape", [add("Expand", [add("Unsqueeze", [x, const(f"{x}_ax2", [2], i64)], [f"{x}5"]),
                                                  const(f"{x}_rep", [1, 1, heads // kv, 1, 1], i64)], [f"{x}e"]),
                                   const(f"{x}_shp", [0, heads, -1, head], i64)], [f"{x}r"]) for x in (kh, vh))
    s = add("Mul", [add("MatMul", [qh, add("Transpose", [kh], ["kt"], perm=[0, 1, 3, 2])], ["s0"]),
                    const("scale", 1 / np.sqrt(head))], ["s1"])

    def length(t: str, axis: int, name: str) -> str:  # a dim read through Shape + Gather (a scalar)
        return add("Gather", [add("Shape", [t], [f"{name}_shape"]), const(f"{name}_ax", axis, i64)], [name], axis=0)

    sq, sk = length(qh, 2, "sq"), length(kh, 2, "sk")
    zero, one = const("zero", 0, i64), const("one", 1, i64)
    qi = add("Range", [zero, sq, one], ["qi0"])
    if past:
        qi = add("Add", [qi, length("past_k", 2, "plen")], ["qi1"])
    qi = add("Unsqueeze", [qi, const("ax1", [1], i64)], ["qi"])
    kj = add("Unsqueeze", [add("Range", [zero, sk, one], ["kj0"]), const("ax0", [0], i64)], ["kj"])
    if rng.random() < 0.3:  # float positions (compared after a Cast)
        qi, kj = (add("Cast", [x], [f"{x}f"], to=TP.FLOAT) for x in (qi, kj))
    pdt = np.float32 if qi.endswith("f") else i64
    c = int(rng.integers(0, 4))
    shifted = add("Add", [qi, const("c", c, pdt)], ["qic"])
    keep = None
    if form == "le":
        keep = add("LessOrEqual", [kj, shifted], ["keep"])
    elif form == "ge":
        keep = add("GreaterOrEqual", [shifted, kj], ["keep"])
    elif form == "not_gt":
        keep = add("Not", [add("Greater", [kj, shifted], ["hide"])], ["keep"])
    elif form == "lt":
        keep = add("Less", [kj, add("Add", [shifted, const("c1", 1, pdt)], ["qic1"])], ["keep"])
    elif form == "trilu":  # torch's is_causal: a Trilu of ones over [Sq, Sk]
        hw = add("Concat", [add("Unsqueeze", [x, const(f"{x}_u", [0], i64)], [f"{x}1"]) for x in (sq, sk)], ["hw"],
                 axis=0)
        ones = add("ConstantOfShape", [hw], ["ones"], value=helper.make_tensor("v", TP.FLOAT, [1], [1.0]))
        keep = add("Cast", [add("Trilu", [ones, const("tri_k", c, i64)], ["tri"], upper=0)], ["keep"], to=TP.BOOL)
    elif form == "sliced":  # GPT-2's buffer: bias[:, :, Sk - Sq:Sk, :Sk]
        buf = const("buf", np.tril(np.ones((256, 256), bool), c)[None, None], np.bool_)
        start = add("Unsqueeze", [add("Sub", [sk, sq], ["off"]), const("u0", [0], i64)], ["off1"])
        end = add("Unsqueeze", [sk, const("u1", [0], i64)], ["sk1"])
        rows = add("Slice", [buf, start, end, const("a2", [2], i64)], ["rows"])
        keep = add("Slice", [rows, const("z1", [0], i64), end, const("a3", [3], i64)], ["keep"])
    elif form == "window":
        w = int(rng.choice([5, 40, 64, 100]))
        near = add("Greater", [kj, add("Sub", [qi, const("w", w, pdt)], ["qiw"])], ["near"])
        keep = add("And", [add("LessOrEqual", [kj, shifted], ["before"]), near], ["keep"])
    value = float(rng.choice([-np.inf, np.finfo(npdt).min, -1e4, -100.0] + ([-1e9] if dtype == TP.FLOAT else [])))
    low = const("low", value, npdt)
    padding = form != "window" and str(rng.choice(["none", "bool", "flags"]))
    if padding in ("bool", "flags"):
        inputs.append(helper.make_tensor_value_info("attention_mask", TP.INT64, ["n", "p + s" if past else "s"]))
        am = add("Unsqueeze", ["attention_mask", const("ax12", [1, 2], i64)], ["am4"])
    if padding == "bool":
        pad = add("Cast", [am], ["pad"], to=TP.BOOL)
        keep = pad if keep is None else add("And", [keep, pad], ["keep_pad"])
    if keep is not None:
        if value != -np.inf and rng.random() < 0.3:  # an indicator times the mask value, added
            hide = add("Cast", [add("Not", [keep], ["nk"])], ["nkf"], to=dtype)
            s = add("Add", [s, add("Mul", [hide, low], ["cb"])], ["s2"])
        elif rng.random() < 0.5:
            s = add("Where", [keep, s, low], ["s2"])
        else:
            s = add("Add", [s, add("Where", [keep, const("zf", 0.0), low], ["cb"])], ["s2"])
    if padding == "flags":  # legacy exports: (1 - m) * low, added (at a finite low: 0 * -inf is NaN)
        flags = add("Sub", [const("onef", 1.0), add("Cast", [am], ["amf"], to=dtype)], ["inv"])
        flow = low if value != -np.inf else const("flow", np.finfo(npdt).min)
        s = add("Add", [s, add("Mul", [flags, flow], ["pb"])], ["s3"])
    scale = 0.5 if rng.random() < 0.3 else 1.0
    if scale != 1.0:
        s = add("Mul", [s, const("half", scale)], ["s4"])
    o = add("MatMul", [add("Softmax", [s], ["p"], axis=-1), vh], ["o"])
    add("Reshape", [add("Transpose", [o], ["o4"], perm=[0, 2, 1, 3]), const("shp3", [0, 0, hd], i64)], ["y"])
    g = helper.make_graph(parts.nodes, f"mask{seed}", inputs,
                          [helper.make_tensor_value_info("y", dtype, ["n", "s", hd])], parts.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 9
    onnx.checker.check_model(m)
    shapes = {i.name: tuple(d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim) for i in inputs}
    return m, shapes, {"past": past, "form": form, "value": value, "scale": scale, "padding": padding, "kv": kv}


def random_quantized(seed: int, folder) -> tuple[onnx.ModelProto, dict[str, tuple]] | None:
    """`random_model(seed)` quantized as users quantize for ORT (onnxruntime.quantization.quantize_static, QDQ
    format: QuantizeLinear/DequantizeLinear pairs around the ops it quantizes), calibrated on one random batch;
    int8 or uint8, per-tensor or per-channel weights (per tensor where ORT cannot run the per-channel model),
    symmetric activations or not, by the seed. None for an fp16 seed (ORT's quantizer takes fp32 models).
    `folder`: where the quantizer's files go."""
    import os

    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from ortfuse.feeds import random_feeds

    m, shapes = random_model(seed)
    if m.graph.input[0].type.tensor_type.elem_type != TP.FLOAT:
        return None
    rng = np.random.default_rng(seed + 3_000_017)
    src, dst = os.path.join(folder, f"fuzz{seed}.onnx"), os.path.join(folder, f"fuzz{seed}-qdq.onnx")
    onnx.save_model(m, src)
    bound = {k: [2 if d == "n" else d for d in v] for k, v in shapes.items()}

    class OneBatch(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = [random_feeds(m, bound, seed)]

        def get_next(self):
            return self.batches.pop() if self.batches else None

    kind = QuantType.QInt8 if rng.random() < 0.5 else QuantType.QUInt8
    per_channel, symmetric = bool(rng.random() < 0.5), bool(rng.random() < 0.3)
    for per_channel in dict.fromkeys((per_channel, False)):
        quantize_static(src, dst, OneBatch(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                        activation_type=kind, weight_type=QuantType.QInt8, extra_options={"ActivationSymmetric": symmetric})
        q = onnx.load(dst)
        q.ir_version = min(q.ir_version, 9)
        try:  # per channel, a batched MatMul's weights get zero points ORT's QLinearMatMul refuses (seed 744)
            ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, OneBatch().get_next())
        except Exception:  # noqa: BLE001 -- quantized per tensor instead
            continue
        break
    return q, shapes

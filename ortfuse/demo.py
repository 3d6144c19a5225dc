"""The built-in demo model: a small BERT-style encoder written with onnx.helper, random weights, and
LayerNorm, GELU and Softmax decomposed the way exporters emit them."""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, seed: int, dtype: int):
        self.rng = np.random.default_rng(seed)
        self.np = helper.tensor_dtype_to_np_dtype(dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def const(self, value, name: str | None = None, np_dtype=None) -> str:
        self.n += 1
        name = name or f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=np_dtype or self.np), name))
        return name

    def weight(self, *shape: int, scale: float = 0.05) -> str:
        return self.const(self.rng.standard_normal(shape) * scale)

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self.n += 1
        out = f"{op_type.lower()}_{self.n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"{op_type}_{self.n}", **attrs))
        return out

    def layer_norm(self, x: str, hidden: int) -> str:
        axes = self.const([-1], np_dtype=np.int64)
        mean = self.op("ReduceMean", x, axes)
        d = self.op("Sub", x, mean)
        var = self.op("ReduceMean", self.op("Pow", d, self.const(2.0)), axes)
        std = self.op("Sqrt", self.op("Add", var, self.const(1e-12)))
        return self.op("Add", self.op("Mul", self.op("Div", d, std), self.weight(hidden, scale=1.0)),
                       self.weight(hidden))

    def gelu(self, x: str) -> str:
        erf = self.op("Erf", self.op("Div", x, self.const(math.sqrt(2.0))))
        return self.op("Mul", self.op("Mul", x, self.op("Add", erf, self.const(1.0))), self.const(0.5))

    def softmax(self, x: str) -> str:
        axes = self.const([-1], np_dtype=np.int64)
        e = self.op("Exp", self.op("Sub", x, self.op("ReduceMax", x, axes)))
        return self.op("Div", e, self.op("ReduceSum", e, axes))

    def linear(self, x: str, n_in: int, n_out: int) -> str:
        return self.op("Add", self.op("MatMul", x, self.weight(n_in, n_out)), self.weight(n_out))


def encoder(layers: int = 2, hidden: int = 128, heads: int = 4, ffn: int = 512, seed: int = 0,
            dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """Inputs `hidden_states` [batch, seq, hidden] and `attention_mask` [batch, seq] (int64)."""
    b = _Builder(seed, dtype)
    dh = hidden // heads
    mask = b.op("Unsqueeze", "attention_mask", b.const([1, 2], np_dtype=np.int64))
    mask = b.op("Mul", b.op("Sub", b.const(1.0), b.op("Cast", mask, to=dtype)), b.const(-10000.0))
    x = "hidden_states"
    split = b.const([0, 0, heads, dh], np_dtype=np.int64)
    merge = b.const([0, 0, hidden], np_dtype=np.int64)
    for _ in range(layers):
        q, k, v = (b.op("Reshape", b.linear(x, hidden, hidden), split) for _ in range(3))
        q = b.op("Transpose", q, perm=[0, 2, 1, 3])
        k = b.op("Transpose", k, perm=[0, 2, 3, 1])
        v = b.op("Transpose", v, perm=[0, 2, 1, 3])
        scores = b.op("Add", b.op("Div", b.op("MatMul", q, k), b.const(math.sqrt(dh))), mask)
        ctx = b.op("Transpose", b.op("MatMul", b.softmax(scores), v), perm=[0, 2, 1, 3])
        attn = b.linear(b.op("Reshape", ctx, merge), hidden, hidden)
        x = b.layer_norm(b.op("Add", attn, x), hidden)
        ff = b.linear(b.gelu(b.linear(x, hidden, ffn)), ffn, hidden)
        x = b.layer_norm(b.op("Add", ff, x), hidden)
    out = b.op("Identity", x)
    graph = helper.make_graph(
        b.nodes, "ortfuse_demo_encoder",
        [helper.make_tensor_value_info("hidden_states", dtype, ["batch", "seq", hidden]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info(out, dtype, ["batch", "seq", hidden])], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="ortfuse-demo")
    model.ir_version = 9
    return model

"""bench/unaligned.py on the CPU: the three models it times are valid and compute the same logits, and the
report. Device times need the GPU; here a stand-in timer runs each model on ORT's CPU EP."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ortfuse.bench import unaligned


def test_unaligned_bench_times_ort_and_the_padded_gemm():
    outs: list[tuple[tuple[str, ...], np.ndarray]] = []

    def timer(model, feeds, fused: bool) -> float:
        assert not fused
        (out,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        ops = tuple(n.op_type for n in model.graph.node)
        outs.append((ops, out))
        return {("MatMul",): 40.0 if out.shape[1] % 8 else 10.0, ("MatMul", "Slice"): 12.0}[ops]

    (row,) = unaligned.run([(16, 1001, 64)], timer=timer)
    assert [(ops, out.shape) for ops, out in outs] == [(("MatMul",), (16, 1001)), (("MatMul",), (16, 1008)),
                                                        (("MatMul", "Slice"), (16, 1001))]
    np.testing.assert_array_equal(outs[1][1][:, :1001], outs[0][1])
    np.testing.assert_array_equal(outs[2][1], outs[0][1])
    assert (row.ort_us, row.padded_gemm_us, row.padded_us) == (40.0, 10.0, 12.0)
    assert abs(row.speedup - 40 / 12) < 1e-9 and row.roofline_us > 0
    assert "16x1001x64 (N' 1008)" in unaligned.render([row])

"""bench/overhead.py on the CPU: the two chains are built and agree (the fused one through its inlined
functions), and the measurement alternates models. The CUDA timing itself runs in the GPU suite."""
from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort

from ortfuse.bench import overhead


def test_chains_agree_and_measurement_alternates():
    native, fused = overhead.chain_models(ops=5, size=256, archs=(90,))
    assert [n.op_type for n in native.graph.node] == ["Neg"] * 5
    assert [n.domain for n in fused.graph.node] == ["ortfuse"] * 5
    entries = {a.s for n in fused.graph.node for a in n.attribute if a.name == "entry"}
    assert len(entries) == 1  # one node per op, all running one kernel
    outputs: dict[bool, np.ndarray] = {}
    order: list[bool] = []

    def cpu_timer(model, feeds, is_fused: bool) -> float:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        t0 = time.perf_counter()
        outputs[is_fused] = sess.run(None, dict(feeds))[0]
        order.append(is_fused)
        return (time.perf_counter() - t0) * 1e6

    res = overhead.run(ops=5, size=256, timer=cpu_timer, rounds=3, archs=(90,))
    assert order == [False, True] * 3
    x = np.random.default_rng(0).standard_normal((1, 256)) + 0.5
    np.testing.assert_allclose(outputs[False], -x.astype(np.float32), rtol=1e-6)  # five negations
    np.testing.assert_array_equal(outputs[True], outputs[False])
    assert res.native_us > 0 and res.fused_us > 0 and "per node" in res.line()

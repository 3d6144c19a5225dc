"""Which nodes of a model ONNX Runtime's graph optimizer fuses into one node when a session starts: a GELU
written as Div, Erf, Add, Mul, Mul becomes one Gelu; a LayerNorm written as its ops one LayerNormalization; an
Add before a LayerNormalization one SkipLayerNormalization; MatMul and a scaling Mul one FusedMatMul; `1 / x * y`
one Div. The fused kernel rounds otherwise than the ops it replaces, which parity tolerates in float, but not
where a quantizer reads the value: a kernel of ours taking one of those ops leaves ORT the rest unfused in the
output, where the input ran them fused (`search.legal.inexact_before_quantizers`).

Those fusions are ORT's to know, so ORT is asked: the model as a probe (its weights over `weights.STUB_BYTES`
made graph inputs: the fusions look at small constants, an epsilon or a 0.5, and at shapes) optimized on the CPU
EP at the extended level, without the QDQ and other CPU-only fusions (MatMulInteger's: the CUDA EP has none of
them); each node of the optimized model whose op is not the op that wrote its output in the input is a fusion,
of the input's nodes between its inputs and its outputs. The CPU EP's fusions are the CUDA EP's at this level
but for a few the CUDA EP adds (BiasSoftmax, ...), which the probe cannot show. A model ORT refuses to optimize
gives no units."""
from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from ortfuse.rewriter import _proto
from ortfuse.rewriter.weights import is_stub

# ops only the CPU EP's fusions make (ORT's graph_transformer_utils.cc: `cpu_ep` alone): not in the CUDA EP's run
_CPU_ONLY = frozenset({("com.microsoft", "MatMulIntegerToFloat"), ("com.microsoft", "DynamicQuantizeMatMul"),
                       ("com.microsoft", "FusedGemm"), ("com.microsoft", "QLinearAdd"),
                       ("com.microsoft", "QLinearMul"), ("com.microsoft", "QLinearSigmoid"),
                       ("com.microsoft", "QLinearLeakyRelu"), ("com.microsoft", "QLinearSoftmax"),
                       ("com.microsoft", "QLinearConcat"), ("com.microsoft", "QLinearAveragePool"),
                       ("com.microsoft", "QLinearGlobalAveragePool"), ("", "QLinearConv"), ("", "QLinearMatMul"),
                       ("com.microsoft", "NhwcMaxPool"), ("com.microsoft", "QGemm")})


def _op(n: onnx.NodeProto) -> tuple[str, str]:
    return ("" if n.domain in ("", "ai.onnx") else n.domain, n.op_type)


def ort_fusion_units(model: onnx.ModelProto) -> tuple[tuple[str, frozenset[str]], ...]:
    """(the fused op, the first outputs of the input's nodes it replaces) for each node ORT's optimizer makes of
    two or more of `model`'s nodes; () where ORT refuses the probe."""
    import onnxruntime as ort

    probe = _proto.copy_model(model)
    inits = probe.graph.initializer
    stubs = [t for t in inits if is_stub(t)]
    kept = [t for t in inits if not is_stub(t)]
    del inits[:]
    inits.extend(kept)
    listed = {i.name for i in probe.graph.input}  # (before IR 4, initializers are listed as inputs too)
    probe.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in stubs if t.name not in listed)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    so.log_severity_level = 4
    with tempfile.TemporaryDirectory(prefix="ortfuse-fusions-") as tmp:
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        try:
            ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
            done = onnx.load(so.optimized_model_filepath, load_external_data=False)
        except Exception:  # noqa: BLE001 (ORT refusing the probe: nothing is known, nothing is kept apart)
            return ()
    writer = {o: n for n in model.graph.node for o in n.output if o}
    present = {o for n in done.graph.node for o in n.output} | {t.name for t in done.graph.initializer} | \
        {i.name for i in done.graph.input}
    units = []
    for n in done.graph.node:
        outs = [o for o in n.output if o in writer]
        if not outs or _op(n) in _CPU_ONLY or all(_op(writer[o]) == _op(n) for o in outs):
            continue
        unit, todo = set(), [writer[o] for o in outs]
        while todo:
            w = todo.pop()
            if w.output[0] in unit:
                continue
            unit.add(w.output[0])
            todo.extend(writer[x] for x in w.input if x and x in writer and x not in present)
        if len(unit) > 1:
            units.append((n.op_type, frozenset(unit)))
    return tuple(units)

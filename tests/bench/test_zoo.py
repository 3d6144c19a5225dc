from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ortfuse.bench import harness, zoo


def _run(path) -> list[np.ndarray]:
  model = onnx.load(str(path))
  feeds = harness.make_feeds(model, batch=2, meta=zoo.read_sidecar(path))
  sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
  return sess.run(None, feeds)


def test_tiny_bert_builds_loads_and_keeps_dynamic_axes(zoo_cache):
  path = zoo.build("bert", tiny=True)
  assert path.parent == zoo_cache and path.exists()
  meta = zoo.read_sidecar(path)
  assert meta["exporter"].startswith("torch.onnx.export(dynamo=False)") and meta["source"] == "transformers.BertModel"
  model = onnx.load(str(path))
  dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
  assert dims == {n: ["batch", "sequence"] for n in ("input_ids", "attention_mask", "token_type_ids")}
  hidden, pooled = _run(path)
  assert hidden.shape == (2, 16, 64) and pooled.shape == (2, 64)
  assert np.isfinite(hidden).all() and np.abs(hidden).max() > 0
  assert zoo.build("bert", tiny=True) == path           # cached: same file, no re-export


def test_tiny_fp16_is_a_real_fp16_graph(zoo_cache):
  path = zoo.build("bert", "fp16", tiny=True)
  model = onnx.load(str(path))
  types = {i.data_type for i in model.graph.initializer if i.dims and len(i.dims) >= 2}
  assert types == {onnx.TensorProto.FLOAT16}
  assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
  ref, out = _run(zoo.build("bert", "fp32", tiny=True))[0], _run(path)[0]
  assert np.isfinite(out).all()
  assert np.abs(out.astype(np.float32) - ref).max() < 5e-2   # same weights, fp16 rounding


@pytest.mark.parametrize("name", ["gpt2", "vit", "resnet50"])
def test_other_tiny_architectures_run(name):
  outs = _run(zoo.build(name, tiny=True))
  assert all(np.isfinite(o).all() for o in outs)


def test_unknown_model_is_refused():
  with pytest.raises(KeyError, match="unknown zoo model"):
    zoo.build("alexnet")


def test_dynamo_export_names_the_dims_and_matches_the_torchscript_export(zoo_cache):
  pytest.importorskip("onnxscript")
  path = zoo.build("bert", tiny=True, exporter="dynamo")
  assert path != zoo.build("bert", tiny=True) and "dynamo" in path.name
  meta = zoo.read_sidecar(path)
  assert meta["exporter"].startswith("torch.onnx.export(dynamo=True)") and meta["opset"] >= 18
  model = onnx.load(str(path))
  dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
  assert dims == {n: ["batch", "sequence"] for n in ("input_ids", "attention_mask", "token_type_ids")}
  for a, b in zip(_run(path), _run(zoo.build("bert", tiny=True))):  # the same module, seeded the same
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bad_exporter_requests_are_refused():
  with pytest.raises(ValueError, match="exporter must be one of"):
    zoo.build("bert", exporter="tflite")
  with pytest.raises(ValueError, match="ships as an ONNX file"):
    zoo.build("magika", exporter="dynamo")


def test_tiny_decoder_step_runs_at_any_number_of_new_tokens(zoo_cache):
  # a generation step: the cache in, present keys and values (past + new) out; the tracer saw one new token,
  # and the file must still run a prompt of several after the past
  path = zoo.build("llama_decode", tiny=True)
  model = onnx.load(str(path))
  dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
  assert dims["attention_mask"] == ["batch", zoo.TOTAL] and dims["past_key_values.1.value"] == ["batch", 2, zoo.PAST, 16]
  sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
  for new in (1, 3):
    feeds = harness.make_feeds(model, batch=2, dims={"sequence": new}, meta=zoo.read_sidecar(path))
    assert feeds["attention_mask"].shape == (2, 16 + new)
    logits, key, *_ = sess.run(None, feeds)
    assert logits.shape == (2, new, 1000) and key.shape == (2, 2, 16 + new, 16) and np.isfinite(logits).all()
    assert np.array_equal(key[:, :, :16], feeds["past_key_values.0.key"])  # the cache comes through unchanged
  # the suite optimizes it for the step it measures (--dim-hint): one new token after the zoo's cache
  assert zoo.dim_hints(model, zoo.read_sidecar(path)) == (("past_sequence", 16), ("sequence", 1))
  bert = zoo.build("bert", tiny=True)
  assert zoo.dim_hints(onnx.load(str(bert)), zoo.read_sidecar(bert)) == (("sequence", 16),)  # tiny: 16 tokens


def test_tiny_qdq_is_the_fp32_model_quantized_as_users_do(zoo_cache):
  path = zoo.build("bert", "qdq", tiny=True)
  meta = zoo.read_sidecar(path)
  assert meta["dtype"] == "qdq" and "quantize_static" in meta["quantizer"]
  ops = {n.op_type for n in onnx.load(str(path)).graph.node}
  assert {"QuantizeLinear", "DequantizeLinear", "MatMul"} <= ops
  ref, out = _run(zoo.build("bert", "fp32", tiny=True))[0], _run(path)[0]
  assert np.isfinite(out).all() and np.abs(out - ref).max() < 0.5 * np.abs(ref).max()  # int8 rounding, same weights

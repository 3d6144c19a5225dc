"""Run ortfuse models in stock ONNX Runtime.

A fused node (domain `ortfuse`, docs/design.md) has two implementations: the native library's CUDA
kernel and the model-local FunctionProto holding the original sub-graph. ORT prefers a registered custom
op over the function, and a CUDA-only custom op cannot run anywhere else, so the library may only be
registered when the CUDA execution provider is really active; otherwise the functions are inlined and
the model runs unfused on any EP.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import onnx
import onnxruntime as ort
from onnx import helper

from ortfuse.errors import OrtfuseError
from ortfuse.rewriter import weights

FUSED_DOMAIN = "ortfuse"
CONFIG_KEY = "ortfuse.op_types"
LIB_NAME = "libortfuse_ops.so"
CUDA_EP = "CUDAExecutionProvider"

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto]
Providers = Sequence[Union[str, tuple[str, dict[Any, Any]]]]


class FallbackWarning(RuntimeWarning):
    """The fused kernels are not used; the model runs through the fused nodes' function bodies."""


def library_path() -> str:
    """Absolute path of the native op library (built by `pip install` or `make native`)."""
    import ortfuse.customops as pkg

    for folder in pkg.__path__:
        path = Path(folder) / LIB_NAME
        if path.is_file():
            return str(path.resolve())
    raise OrtfuseError(
        f"ortfuse: native library {LIB_NAME} is not built (looked in {list(pkg.__path__)}); "
        "run `make native` or `pip install -e .`"
    )


def cuda_active(session: ort.InferenceSession) -> bool:
    """True if the session really runs on the CUDA EP (`ort.get_device()` says "GPU" even when the CUDA
    libraries failed to load; the session's provider list does not)."""
    return CUDA_EP in session.get_providers()


def fused_op_types(model: onnx.ModelProto) -> list[str]:
    """Sorted op types of all `ortfuse`-domain nodes, sub-graphs included."""
    found: set[str] = set()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if node.domain == FUSED_DOMAIN:
                found.add(node.op_type)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                for sub in attr.graphs:
                    walk(sub)

    walk(model.graph)
    return sorted(found)


def _load(model_or_path: ModelSource) -> tuple[onnx.ModelProto, str | bytes]:
    """The model (for inspection, external data not loaded) and what to hand to ORT."""
    if isinstance(model_or_path, onnx.ModelProto):
        if weights.has_stubs(model_or_path):  # OptimizeResult.stubbed: its weights filled for ORT
            model_or_path = weights.materialized(model_or_path)
        return model_or_path, model_or_path.SerializeToString()
    if isinstance(model_or_path, bytes):
        return onnx.load_from_string(model_or_path), model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        path = os.fspath(model_or_path)
        return onnx.load(path, load_external_data=False), path
    raise TypeError(f"ortfuse: cannot load a model from {type(model_or_path).__name__}")


def _config_entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # ORT raises for a missing key
        return None


def register(sess_options: ort.SessionOptions, model_or_path: ModelSource) -> list[str]:
    """Registers the native library on `sess_options` for the model's fused op types and returns them.

    A session created from these options must have the CUDA EP active: ORT then refuses any other
    placement of a fused node ("NOT_IMPLEMENTED: Could not find an implementation for Fused_..."), it
    does not fall back to the function. `InferenceSession` checks this for you. Calling it again on the
    same options for the same op types is a no-op; for other op types it raises (use fresh options).
    """
    model, _ = _load(model_or_path)
    types = ",".join(fused_op_types(model))
    current = _config_entry(sess_options, CONFIG_KEY)
    if current is not None:
        if current == types:
            return fused_op_types(model)
        raise OrtfuseError(
            f"ortfuse: these SessionOptions already carry the ortfuse library for op types [{current}]; "
            "use a fresh SessionOptions for each model"
        )
    lib = library_path()
    sess_options.add_session_config_entry(CONFIG_KEY, types)
    sess_options.register_custom_ops_library(lib)
    return fused_op_types(model)


def _probe_model() -> bytes:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "ortfuse_cuda_probe", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


_cuda_usable_cache: dict[str, bool] = {}


def _cuda_usable(providers: Providers | None, provider_options: Sequence[dict[Any, Any]] | None) -> bool:
    """Whether a session with these providers really gets the CUDA EP (cached per configuration)."""
    names = [p if isinstance(p, str) else p[0] for p in providers or []]
    if CUDA_EP not in names:
        return False
    key = repr((list(providers or []), list(provider_options or [])))
    if key not in _cuda_usable_cache:
        opts = ort.SessionOptions()
        opts.log_severity_level = 4  # the real session logs any CUDA load failure once
        try:
            probe = ort.InferenceSession(_probe_model(), opts, providers, provider_options, enable_fallback=0)
            _cuda_usable_cache[key] = cuda_active(probe)
        except (RuntimeError, ValueError):
            _cuda_usable_cache[key] = False
    return _cuda_usable_cache[key]


def _library_free_copy(options: ort.SessionOptions | None) -> ort.SessionOptions | None:
    """Options without the library, copying the public settings (config entries cannot be listed)."""
    if options is None:
        return None
    fresh = ort.SessionOptions()
    for name in dir(options):
        if name.startswith("_") or callable(getattr(options, name)):
            continue
        try:
            setattr(fresh, name, getattr(options, name))
        except (AttributeError, TypeError):
            pass  # read-only property
    return fresh


class InferenceSession(ort.InferenceSession):
    """Drop-in for `onnxruntime.InferenceSession` that runs ortfuse models.

    With the CUDA EP active, the native library is registered on `sess_options` (which it mutates) and
    the fused kernels run. Otherwise the fused nodes run through their function bodies and one
    `FallbackWarning` says so. `fused_kernels` tells which happened.
    """

    def __init__(
        self,
        path_or_model: ModelSource,
        sess_options: ort.SessionOptions | None = None,
        providers: Providers | None = None,
        provider_options: Sequence[dict[Any, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        model, source = _load(path_or_model)
        op_types = fused_op_types(model)
        self.fused_kernels = False
        if not op_types:
            super().__init__(source, sess_options, providers, provider_options, **kwargs)
            return
        reason = "the CUDA execution provider is not active"
        if _cuda_usable(providers, provider_options):
            options = sess_options if sess_options is not None else ort.SessionOptions()
            register(options, model)
            try:  # ORT's own CPU fallback cannot help once the library is registered: report errors as is
                super().__init__(source, options, providers, provider_options, **{"enable_fallback": 0, **kwargs})
                if cuda_active(self):
                    self.fused_kernels = True
                    return
            except (RuntimeError, ValueError) as e:
                if "NOT_IMPLEMENTED" not in str(e) and "Could not find an implementation" not in str(e):
                    raise
                reason = f"ONNX Runtime could not place the fused nodes ({str(e).splitlines()[0]})"
            sess_options = _library_free_copy(sess_options)
        super().__init__(source, sess_options, providers, provider_options, **kwargs)
        warnings.warn(
            f"ortfuse: {reason}; providers {self.get_providers()}: the {len(op_types)} fused op type(s) run "
            "through their ONNX function bodies, not the fused CUDA kernels",
            FallbackWarning,
            stacklevel=2,
        )

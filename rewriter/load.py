"""Reading a model: a private, validated copy with external data loaded.

Dtype policy: ops ortfuse does not fuse stay with ONNX Runtime, so we refuse only what ORT itself cannot
load. Observed on ORT 1.31: graph inputs/outputs of element types 1..26 (float .. int2) load (some have
no kernels, which is ORT's business at session time); UNDEFINED, FLOAT6E2M3/FLOAT6E3M2 (27, 28) and
unknown numbers fail at load ("Invalid tensor data type"). Non-tensor values (sequence, map, optional)
pass through; they never enter a fused region.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterable, Optional

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from ortfuse.errors import InputError, UnsupportedError
from ortfuse.rewriter import _proto, weights

log = logging.getLogger(__name__)

ORT_LOADABLE_DTYPES = range(1, 27)  # see the module docstring
# Domains whose ops ORT implements beyond the ONNX standard ones (names checked against ORT's schemas).
ORT_CONTRIB_DOMAINS = ("com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc")
FUSED_DOMAIN = "ortfuse"

ModelSource = onnx.ModelProto | str | os.PathLike


def load_model(model_or_path: ModelSource, store: Optional[weights.WeightStore] = None) -> onnx.ModelProto:
    """A private copy of the model, external data loaded, nodes topologically sorted, checked.
    With `store`, the graph's large weights go there and the copy keeps stubs (`rewriter.weights`); those in
    external data files are memory-mapped, not read. Raises InputError (unreadable or invalid model) or
    UnsupportedError (an op no runtime knows)."""
    if isinstance(model_or_path, onnx.ModelProto):
        label, path = "model", None
        if any(external_data_helper.uses_external_data(t) and not weights.is_stub(t)
               for t in _all_tensors(model_or_path)):
            raise InputError("model: tensors refer to external data; pass the model's path instead")
        gone = next((t.name for t in model_or_path.graph.initializer if weights.is_stub(t) and not weights.live(t)),
                    None)
        if gone is not None:
            raise InputError(f"model: initializer '{gone}' is a stub of a weight store that is gone (released, or "
                             "another process's: keep the OptimizeResult whose model you use)")
        model = weights.materialized(model_or_path)  # (a copy; OptimizeResult.stubbed's stubs filled)
    else:
        path = Path(os.fspath(model_or_path))
        label = str(path)
        model = _read(path, store)
    check_ops(model, label)
    check_io_dtypes(model, label)
    try:
        moved = _proto.sort_nodes(model.graph)
    except ValueError as e:
        raise InputError(f"{label}: {e}") from None
    _check(model, label)
    _drop_initializer_value_infos(model)
    if store is not None:
        weights.set_aside(model, store)  # checked first: the checker reads the bytes that stay in the proto
    return model


def _drop_initializer_value_infos(model: onnx.ModelProto) -> None:
    """value_info entries that name an initializer go: the initializer declares its own type and dims, and
    ORT reads those. torch.export lists its initializers in value_info too, and onnxruntime's fp16
    converter retypes those entries to fp16 where it keeps an initializer fp32 (a Resize's scales), which
    ONNX's strict type inference then refuses."""
    inits = {t.name for t in model.graph.initializer}
    keep = [v for v in model.graph.value_info if v.name not in inits]
    if len(keep) != len(model.graph.value_info):
        del model.graph.value_info[:]
        model.graph.value_info.extend(keep)


def _all_tensors(model: onnx.ModelProto) -> Iterable[onnx.TensorProto]:
    return external_data_helper._get_all_tensors(model)  # initializers and tensor attributes, nested


def _read(path: Path, store: Optional[weights.WeightStore] = None) -> onnx.ModelProto:
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: not a file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise InputError(f"{path}: not an ONNX model or truncated ({_first_line(e)})") from None
    # Protobuf parses many byte strings "successfully"; a real model has these fields, and a file cut
    # after the graph loses opset_import (serialized after it).
    if model.ir_version <= 0 or not model.HasField("graph") or not model.opset_import:
        raise InputError(f"{path}: not an ONNX model or truncated (no IR version, graph or opset import)")
    stub = next((t.name for t in _all_tensors(model) if weights.is_stub(t)), None)
    if stub is not None:
        raise InputError(f"{path}: initializer '{stub}' is a stub of ortfuse's weight store, not data (a model "
                         "written from OptimizeResult.stubbed: write it with OptimizeResult.save)")
    try:
        if store is not None:
            weights.map_external(model, path.parent, str(path), store)
        for t in _all_tensors(model):  # (as onnx's load_external_data_for_model, the mapped ones passed by)
            if external_data_helper.uses_external_data(t) and not weights.is_stub(t):
                external_data_helper.load_external_data_for_tensor(t, str(path.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as e:
        raise InputError(f"{path}: cannot load external data ({_first_line(e)})") from None
    return model


def _check(model: onnx.ModelProto, label: str) -> None:
    """ONNX's checker on the model with its large raw initializers emptied (`_proto.check_model(weights=False)`:
    no second parse of the file, no serialization of the weights, at any size), and those initializers' byte
    counts checked here against their dims and type, exactly, as ORT checks them (the checker refuses too few
    bytes only)."""
    for t in model.graph.initializer:
        if _proto.emptied_for_check(t) and not weights.is_stub(t):
            need, have = _proto.dims_bytes(t.data_type, t.dims), len(t.raw_data)
            if need is not None and have != need:
                raise InputError(f"{label}: invalid ONNX model: initializer '{t.name}' holds {have} bytes of raw data; "
                                 f"its dims {list(t.dims)} and type need {need}")
    try:
        _proto.check_model(model, weights=False)
    except onnx.checker.ValidationError as e:
        raise InputError(f"{label}: invalid ONNX model: {_checker_message(e)}") from None


def _checker_message(e: BaseException) -> str:
    """The checker's complaint on one line, naming the node its context names ("==> Context: Bad node spec for
    node. Name: X OpType: Y", lines below a complaint that alone does not say which node)."""
    main, _, context = " ".join(str(e).split()).partition(" ==> Context: ")
    node = re.search(r"Name: (.*?) OpType: (\S+)", context)
    if node and node.group(1) not in main:
        main += f" (node '{node.group(1)}', {node.group(2)})"
    return main or type(e).__name__


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_ops(model: onnx.ModelProto, label: str = "model") -> None:
    """Every node's op must be known to ONNX (default and ai.onnx.ml domains, at the model's opset),
    to ORT's contrib domains, or be a model-local function. UnsupportedError otherwise."""
    functions = {(f.domain, f.name) for f in model.functions}
    contrib = _proto.ort_schemas()  # None: this ORT build does not list them, so its domains are trusted
    for node in _proto.deep_nodes(model.graph.node):
        domain = "" if node.domain == "ai.onnx" else node.domain
        if (node.domain, node.op_type) in functions:
            continue
        if domain in ("", "ai.onnx.ml"):
            known = _onnx_has(node.op_type, _proto.opset_of(model, domain), domain)
            known = known or (domain == "" and _proto.ort_default_domain_op(model, node))
        elif domain in ORT_CONTRIB_DOMAINS:
            known = contrib is None or (domain, node.op_type) in contrib
        else:
            known = False
        if not known:
            where = f"{domain or 'ai.onnx'}::{node.op_type}"
            raise UnsupportedError(f"{label}: node '{node.name or node.output[0]}' uses op {where}, "
                                   "which neither ONNX nor ONNX Runtime defines")


def _onnx_has(op_type: str, version: int | None, domain: str) -> bool:
    if version is None:
        return True  # a missing opset import is reported by the checker with its own message
    try:
        onnx.defs.get_schema(op_type, version, domain)
        return True
    except onnx.defs.SchemaError:
        return False


def check_io_dtypes(model: onnx.ModelProto, label: str = "model") -> None:
    """Refuse graph inputs/outputs whose tensor element type ORT cannot load (module docstring)."""
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for v in values:
            if v.type.WhichOneof("value") != "tensor_type":
                continue
            dt = v.type.tensor_type.elem_type
            if dt not in ORT_LOADABLE_DTYPES:
                name = onnx.TensorProto.DataType.Name(dt) if dt in onnx.TensorProto.DataType.values() else dt
                raise InputError(f"{label}: graph {kind} '{v.name}' has element type {name}, "
                                 "which ONNX Runtime cannot load")

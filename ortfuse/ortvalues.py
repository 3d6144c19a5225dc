"""Arrays in and out of ONNX Runtime sessions whatever their element type. ORT's Python binding maps numpy
dtypes to tensor types, and has no numpy type for bfloat16: it refuses an ml_dtypes.bfloat16 array as an
input and cannot return a bfloat16 output as an array. Such tensors travel here as their 16-bit patterns
(an OrtValue typed bfloat16 over uint16 data), so a bf16 model runs as any other."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx

BF16 = onnx.TensorProto.BFLOAT16


def is_bf16(a: np.ndarray) -> bool:
    return a.dtype.name == "bfloat16"


def to_ortvalue(arr: np.ndarray, device: str = "cpu", device_id: int = 0) -> Any:
    """An OrtValue holding `arr` on `device` (cpu or cuda); bfloat16 arrays included."""
    import onnxruntime as ort
    arr = np.ascontiguousarray(arr)
    if not is_bf16(arr):
        return ort.OrtValue.ortvalue_from_numpy(arr, device, device_id)
    v = ort.OrtValue.ortvalue_from_shape_and_type(list(arr.shape), BF16, device, device_id)
    v.update_inplace(arr.view(np.uint16))
    return v


def to_numpy(value: Any) -> np.ndarray:
    """A host array of OrtValue `value` (on any device); a bfloat16 tensor as an ml_dtypes.bfloat16 array."""
    import ml_dtypes
    import onnxruntime as ort
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    bits = np.empty(value.shape(), np.uint16)
    if bits.size:
        ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, BF16).update_inplace(value)  # a copy into `bits`
    return bits.view(ml_dtypes.bfloat16)


def run(sess: Any, names: Sequence[str] | None, feeds: Mapping[str, np.ndarray], run_options: Any = None
        ) -> list[np.ndarray]:
    """sess.run(names, feeds), bfloat16 inputs and outputs included: those go through OrtValues."""
    names = list(names) if names is not None else [o.name for o in sess.get_outputs()]
    bf16_out = any(o.type == "tensor(bfloat16)" for o in sess.get_outputs() if o.name in names)
    if not bf16_out and not any(is_bf16(np.asarray(v)) for v in feeds.values()):
        return sess.run(names, dict(feeds), run_options)
    values = sess.run_with_ort_values(names, {k: to_ortvalue(np.asarray(v)) for k, v in feeds.items()}, run_options)
    return [to_numpy(v) for v in values]

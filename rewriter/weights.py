"""Weights kept out of the protobuf while optimizing.

Every rewrite returns a new `Graph` over its own copy of the model (the input is never modified), and a
protobuf copy copies every weight. So at load the large raw initializers move into a `WeightStore` (bytes
read once, or memory-mapped straight from a model's external data file) and the model keeps a stub: name,
dtype and dims, with an external-data location naming the store and the key. Copies then cost the graph.

Stubs never leave the process: `Constants` reads them through `array_of`, ONNX's checker and shape inference
run on skeletons without them, ORT sub-models are built from numpy values, and the writer (`replace.save_model`)
or `materialized` puts the bytes back. A stub read after its store is gone raises rather than yield zeros.
"""
from __future__ import annotations

import itertools
import os
import sys
import uuid
import weakref
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional, TypeVar

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from ortfuse.errors import InputError

STUB_BYTES = 64 * 1024  # raw initializers above this live in the store (matrices; biases and shapes stay)
PREFIX = "ortfuse-weights:"  # location of a stub: ortfuse-weights:<process token>.<store id>/<key>
_TOKEN = uuid.uuid4().hex  # stubs saved by mistake and read in another process name none of its stores

# element types whose raw bytes numpy reads as they are (little-endian, fixed size): zero-copy views
_VIEWABLE = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
             onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT8: np.int8, onnx.TensorProto.UINT8: np.uint8,
             onnx.TensorProto.INT16: np.int16, onnx.TensorProto.UINT16: np.uint16, onnx.TensorProto.INT32: np.int32,
             onnx.TensorProto.UINT32: np.uint32, onnx.TensorProto.INT64: np.int64,
             onnx.TensorProto.UINT64: np.uint64, onnx.TensorProto.BOOL: np.bool_} \
    if sys.byteorder == "little" else {}

_M = TypeVar("_M", onnx.ModelProto, onnx.GraphProto)
_live: "weakref.WeakValueDictionary[int, WeightStore]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


class WeightStore:
    """Read-only byte buffers (uint8 arrays: bytes taken from a proto, or a memory-mapped file's slices) by
    key. Alive while anything holds it: `compile_model` for its run, then its `OptimizeResult`."""

    def __init__(self) -> None:
        self.id = next(_ids)
        self._data: dict[str, np.ndarray] = {}
        self._keys = itertools.count()
        _live[self.id] = self

    def put(self, buf: np.ndarray) -> str:
        key = str(next(self._keys))
        buf.flags.writeable = False
        self._data[key] = buf
        return key

    def get(self, key: str) -> Optional[np.ndarray]:
        return self._data.get(key)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._data.values())

    def __len__(self) -> int:
        return len(self._data)

    def keep_only(self, models: Iterable[onnx.ModelProto]) -> None:
        """Drops the buffers no stub of `models` names (weights that rewrites replaced)."""
        refs = (_ref(t) for m in models for t in m.graph.initializer)
        used = {ref[1] for ref in refs if ref is not None and ref[0] == self.id}
        for key in [k for k in self._data if k not in used]:
            del self._data[key]


def _ref(t: onnx.TensorProto) -> Optional[tuple[int, str]]:
    """(store id, key) of a stub, None for any other tensor."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    loc = next((e.value for e in t.external_data if e.key == "location"), "")
    if not loc.startswith(PREFIX):
        return None
    owner, _, key = loc[len(PREFIX):].partition("/")
    token, _, sid = owner.partition(".")
    return (int(sid) if token == _TOKEN and sid.isdigit() else -1), key  # -1: no store of this process


def is_stub(t: onnx.TensorProto) -> bool:
    return _ref(t) is not None


def live(t: onnx.TensorProto) -> bool:
    """A stub whose store is alive in this process (False for any other tensor)."""
    ref = _ref(t)
    return ref is not None and ref[0] in _live and _live[ref[0]].get(ref[1]) is not None


def has_stubs(model: onnx.ModelProto) -> bool:
    return any(is_stub(t) for t in model.graph.initializer)


def store_of(model: onnx.ModelProto) -> Optional[WeightStore]:
    """The store `model`'s stubs name (None: it has none)."""
    for t in model.graph.initializer:
        if (ref := _ref(t)) is not None:
            return _store(ref[0], t.name)
    return None


def _store(sid: int, name: str) -> WeightStore:
    store = _live.get(sid)
    if store is None:
        why = "was released (keep the OptimizeResult whose model or graph you use)" if sid >= 0 else \
            "belongs to another process (a stubbed model written as is: write OptimizeResult.save's output)"
        raise RuntimeError(f"initializer '{name}': its weight store {why}")
    return store


def buffer_of(t: onnx.TensorProto) -> np.ndarray:
    """A stub's bytes (read-only uint8)."""
    ref = _ref(t)
    assert ref is not None, f"{t.name} is not a stub"
    buf = _store(ref[0], t.name).get(ref[1])
    if buf is None:
        raise RuntimeError(f"initializer '{t.name}': its weight store dropped it (a weight no live graph reads)")
    return buf


def stub_bytes(t: onnx.TensorProto) -> int:
    return buffer_of(t).nbytes


def array_of(t: onnx.TensorProto) -> np.ndarray:
    """numpy_helper.to_array(t), stubs included; a stub of a plain numeric type comes back as a read-only view of
    the store's bytes (no copy)."""
    if not is_stub(t):
        return numpy_helper.to_array(t)
    buf = buffer_of(t)
    dims = tuple(int(d) for d in t.dims)
    np_type = _VIEWABLE.get(t.data_type)
    if np_type is not None:
        return buf.view(np_type).reshape(dims)
    return numpy_helper.to_array(filled(t))


def filled(t: onnx.TensorProto) -> onnx.TensorProto:
    """`t` itself, or for a stub a new tensor holding its bytes from the store."""
    if not is_stub(t):
        return t
    out = bare(t)
    out.raw_data = buffer_of(t).tobytes()
    return out


_RAW_DATA = onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number
_DATA_FIELDS = frozenset(onnx.TensorProto.DESCRIPTOR.fields_by_name[f].number
                         for f in ("raw_data", "external_data", "data_location"))


def bare(t: onnx.TensorProto) -> onnx.TensorProto:
    """`t` without its data: every field but raw_data, the external-data entries and data_location."""
    from ortfuse.rewriter import _proto
    return _proto.copied_where(t, lambda k: k not in _DATA_FIELDS)


def _stub(t: onnx.TensorProto, store: WeightStore, key: str) -> onnx.TensorProto:
    out = bare(t)
    out.data_location = onnx.TensorProto.EXTERNAL
    out.external_data.add(key="location", value=f"{PREFIX}{_TOKEN}.{store.id}/{key}")
    return out


def set_aside(model: onnx.ModelProto, store: Optional[WeightStore] = None) -> int:
    """Moves `model`'s raw graph initializers over STUB_BYTES into `store` (default: the store its stubs name;
    none: the model is left as it is), in place; returns how many moved."""
    from ortfuse.rewriter import _proto
    store = store_of(model) if store is None else store
    if store is None:
        return 0
    inits = model.graph.initializer
    moved = 0
    for k, t in enumerate(inits):
        if not _proto.raw_only(t) or _proto.tensor_bytes(t) <= STUB_BYTES:
            continue
        data = t.raw_data  # one copy out of the proto, whose own is freed just below
        inits[k].CopyFrom(_stub(t, store, store.put(np.frombuffer(data, np.uint8))))
        moved += 1
    return moved


def materialized(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose stubs hold their bytes again (`model` itself is not changed)."""
    from ortfuse.rewriter import _proto
    out = _proto.copy_model(model)  # (fields this onnx does not know kept, as protobuf keeps them)
    inits = out.graph.initializer
    for k, t in enumerate(model.graph.initializer):
        if is_stub(t):
            inits[k].CopyFrom(filled(t))
    return out


def write_materialized(model: onnx.ModelProto, f: BinaryIO) -> None:
    """Writes the serialization of `materialized(model)` to `f`, byte for byte, one weight at a time: protobuf
    writes fields in field-number order and a nested message as tag, length and bytes, so the initializers
    (GraphProto field 5) go between the graph's lower and higher fields once their lengths are known."""
    from ortfuse.rewriter import _proto
    graph_no, init_no = _proto._GRAPH, _proto._INITIALIZER
    g = model.graph
    sizes = [_filled_size(t) for t in g.initializer]
    g_lo = _proto.copied_where(g, lambda k: k < init_no).SerializeToString()
    g_hi = _fields_from(g, init_no + 1).SerializeToString()
    g_len = len(g_lo) + len(g_hi) + sum(_field_size(init_no, n) for n in sizes)
    f.write(_proto.copied_where(model, lambda k: k < graph_no).SerializeToString())
    if model.HasField("graph"):
        f.write(_tag(graph_no) + _varint(g_len) + g_lo)
        for t, n in zip(g.initializer, sizes):
            data = filled(t).SerializeToString()
            assert len(data) == n, f"initializer '{t.name}': {len(data)} bytes, {n} expected"
            f.write(_tag(init_no) + _varint(n))
            f.write(data)
        f.write(g_hi)
    f.write(_fields_from(model, graph_no + 1).SerializeToString())


def _fields_from(msg: _M, number: int) -> _M:
    """A copy of `msg` with its fields from `number` on, and the fields this onnx does not know (protobuf writes
    those last). Only for a message whose fields below `number` are cheap to copy: a stubbed graph or model."""
    out = type(msg)()
    out.CopyFrom(msg)
    for fd, _ in out.ListFields():
        if fd.number < number:
            out.ClearField(fd.name)
    return out


def _filled_size(t: onnx.TensorProto) -> int:
    """filled(t).ByteSize() without filling it: a stub's bytes come back as raw_data."""
    return _field_size(_RAW_DATA, stub_bytes(t)) + bare(t).ByteSize() if is_stub(t) else t.ByteSize()


def _field_size(number: int, n: int) -> int:
    """Bytes of a length-delimited field of `n` bytes."""
    return len(_tag(number)) + len(_varint(n)) + n


def _tag(number: int) -> bytes:
    return _varint(number << 3 | 2)  # wire type 2: length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


# ---- external data, memory-mapped ------------------------------------------------------------------------

def map_external(model: onnx.ModelProto, base: Path, label: str, store: WeightStore) -> None:
    """Graph initializers held in external data files become stubs over memory-mapped slices of those files (in
    place; read as pages are touched, never copied whole). Each reference is checked: the file lies in `base`'s
    folder, exists, and holds the bytes the tensor's dims ask for."""
    from ortfuse.rewriter import _proto
    maps: dict[Path, np.ndarray] = {}
    inits = model.graph.initializer
    for k, t in enumerate(inits):
        if not external_data_helper.uses_external_data(t):
            continue
        info = external_data_helper.ExternalDataInfo(t)
        where = f"{label}: initializer '{t.name}'"
        path = _inside(base, info.location, where)
        if path not in maps:
            maps[path] = _map(path, where)
        data = maps[path]
        offset = int(info.offset or 0)
        if any(d < 0 for d in t.dims):
            raise InputError(f"{where}: negative dims {list(t.dims)}")
        want = _proto.dims_bytes(t.data_type, t.dims)
        length = int(info.length) if info.length is not None else want
        if length is None or want is None:
            raise InputError(f"{where}: external data of element type "
                             f"{onnx.TensorProto.DataType.Name(t.data_type)} cannot be read by its size")
        if length != want:
            raise InputError(f"{where}: external data holds {length} bytes, its dims {list(t.dims)} need {want}")
        if offset < 0 or offset + length > data.size:
            raise InputError(f"{where}: external data [{offset}, {offset + length}) lies beyond the end of "
                             f"{path.name} ({data.size} bytes)")
        inits[k].CopyFrom(_stub(t, store, store.put(data[offset:offset + length])))


def _inside(base: Path, location: str, where: str) -> Path:
    root = base.resolve()
    path = (root / location).resolve()
    if os.path.isabs(location) or root not in path.parents:
        raise InputError(f"{where}: external data location '{location}' lies outside the model's folder")
    if not path.is_file():
        raise InputError(f"{where}: external data file '{location}' not found beside the model")
    return path


def _map(path: Path, where: str) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, np.uint8)
    try:
        return np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise InputError(f"{where}: cannot map external data file {path.name} ({e})") from None


def stubs(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    return (t for t in model.graph.initializer if is_stub(t))

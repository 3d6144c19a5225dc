"""The fused node's attributes (docs/design.md, "The fused node"): written from a KernelSpec and a
CompiledKernel, read back for emulation and checks. The native library reads the same fields."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortfuse.customops.compile import CompiledKernel
from ortfuse.customops.lower import KernelSpec
from ortfuse.customops.tiles import launch_blocks  # noqa: F401 - the launch rule, re-exported
from ortfuse.customops.tiles import runtime_split as cluster_for  # noqa: F401 - the launch rule, re-exported

# the newest node format: 2 is 1 with sym_products (written only by nodes that have them, so older libraries
# refuse those and read the rest)
NODE_FORMAT_VERSION = 2
DOMAIN = "ortfuse"


def _bytes_tensor(name: str, data: bytes) -> onnx.TensorProto:
    return numpy_helper.from_array(np.frombuffer(data, dtype=np.uint8).copy(), name)


def _ints(name: str, values: Sequence[int]) -> onnx.AttributeProto:
    return helper.make_attribute(name, [int(v) for v in values], attr_type=onnx.AttributeProto.INTS)


def node_attributes(spec: KernelSpec, ck: CompiledKernel,
                    variants: Sequence[tuple[int, KernelSpec, CompiledKernel]] = ()) -> list[onnx.AttributeProto]:
    """The node's attributes; `variants`: further kernels of the same region as (rows from, spec, kernel),
    thresholds rising: the library runs the last whose threshold the rows reach (`variant_rows`: the
    product of the first output's dims but its innermost), else the first kernel."""
    shared = [
        helper.make_attribute("ortfuse_version", NODE_FORMAT_VERSION if spec.sym_products else 1),
        _ints("sym_dims", [v for pair in spec.sym_dims for v in pair]),
        _ints("out_dtypes", list(spec.out_dtypes)),
        _ints("out_ranks", [len(s) for s in spec.out_shapes]),
        _ints("out_dims", [d for s in spec.out_shapes for d in s]),
        *([_ints("sym_derived", [v for rule in spec.sym_derived for v in rule])] if spec.sym_derived else []),
        *([_ints("sym_sums", [v for rule in spec.sym_sums for v in rule])] if spec.sym_sums else []),
        *([_ints("sym_products", spec.sym_products)] if spec.sym_products else []),
        *([_ints("dim_checks", [v for c in spec.dim_checks for v in c])] if spec.dim_checks else []),
    ]
    out = shared + _kernel_attributes(spec, ck, "")
    if variants:
        rows = variant_rows(spec)
        if any(-t - 1 >= len(spec.sym_dims) for t in rows if t < 0):
            raise ValueError(f"{ck.entry}: kernel variants need rows made of bound dims, got {rows}")
        out += [helper.make_attribute("variants", 1 + len(variants)), _ints("variant_rows", rows),
                _ints("variant_from", [frm for frm, _, _ in variants])]
        for i, (_, vspec, vck) in enumerate(variants, 1):
            out += _kernel_attributes(vspec, vck, f"@{i}")
    return out


def variant_rows(spec: KernelSpec) -> list[int]:
    """The terms whose product picks a node's kernel variant: the first output's dims but its innermost."""
    return list(spec.out_shapes[0][:-1])


def _kernel_attributes(spec: KernelSpec, ck: CompiledKernel, sfx: str) -> list[onnx.AttributeProto]:
    """One kernel's own attributes (each one `_own`, so that a variant reads back its own and not the first
    kernel's); a variant's carry its suffix (`entry@1`)."""
    def attr(name: str, value) -> onnx.AttributeProto:
        assert _own(name), name
        return helper.make_attribute(name + sfx, value)

    def ints(name: str, values: Sequence[int]) -> onnx.AttributeProto:
        assert _own(name), name
        return _ints(name + sfx, values)
    return [
        attr("entry", ck.entry),
        ints("cubin_archs", [cc for cc, _ in ck.cubins]),
        *[attr(f"cubin_{cc}", _bytes_tensor(f"cubin_{cc}", b)) for cc, b in ck.cubins],
        attr("ptx", _bytes_tensor("ptx", ck.ptx)),
        attr("block", spec.block),
        attr("smem", spec.smem),
        ints("units", list(spec.units)),
        attr("units_per_block", spec.units_per_block),
        *([ints("units_ceil", [v for terms, div in spec.units_ceil for v in (len(terms), *terms, div)])]
          if spec.units_ceil else []),
        *([attr("split_k", spec.split_k)] if spec.split_k > 1 else []),
        *([ints("dim_limits", [v for terms, lim in spec.dim_limits for v in (len(terms), *terms, lim)])]
          if spec.dim_limits else []),
        *([ints("arg_align", list(spec.arg_align))] if any(v > 1 for v in spec.arg_align) else []),
        *([ints("tma", [v for t in spec.tma for v in t])] if spec.tma else []),
        *([attr("blocks_per_sm", spec.blocks_per_sm)] if spec.blocks_per_sm else []),
        *([attr("row_cluster", spec.row_cluster)] if spec.row_cluster > 1 else []),
        *([attr("multicast", spec.multicast)] if spec.multicast > 1 else []),
        *([attr("pdl", 1)] if spec.kernel.pdl else []),
        attr("source", ck.source),
    ]


@dataclass(frozen=True)
class Launch:
    """A fused node's launch rule, decoded."""

    entry: str
    source: str
    block: int
    smem: int
    sym_dims: tuple[tuple[int, int], ...]
    units: tuple[int, ...]
    units_per_block: int
    units_ceil: tuple[tuple[tuple[int, ...], int], ...]  # (terms, divisor)
    out_dtypes: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    split_k: int = 1  # most blocks per cluster that share a GEMM tile's K
    archs: tuple[int, ...] = ()  # compute capabilities of the cubins
    sym_derived: tuple[tuple[int, int, int], ...] = ()  # (term, add, div): floor((term + add) / div) + 1
    dim_limits: tuple[tuple[tuple[int, ...], int], ...] = ()  # (terms, limit): product below limit
    arg_align: tuple[int, ...] = ()  # per argument (inputs, then outputs): the byte alignment it needs
    dim_checks: tuple[tuple[int, int, int], ...] = ()  # (input, axis, term): must equal the term (like units)
    tma: tuple[tuple[int, int, int], ...] = ()  # (input, box rows, element type): KernelSpec.tma
    blocks_per_sm: int = 0  # a persistent kernel's grid cap per SM (0: none)
    row_cluster: int = 1  # exact blocks per cluster of a row split across a cluster (1: none)
    multicast: int = 1  # exact blocks per cluster of a TMA GEMM sharing B (the grid counts clusters; 1: none)
    pdl: bool = False  # launched as a programmatic dependent launch on sm_90+ (ir.Kernel.pdl)
    sym_sums: tuple[tuple[int, int], ...] = ()  # (term, term): runtime dims after the derived ones, their sum
    sym_products: tuple[int, ...] = ()  # the rules of sym_sums that multiply their terms instead
    # further kernels of the node: (rows from, launch), and the terms whose product is the rows
    variants: tuple[tuple[int, "Launch"], ...] = ()
    variant_rows: tuple[int, ...] = ()

    def pick(self, dims: Sequence[int]) -> "Launch":
        """The kernel the library runs at these dims: the last variant whose threshold the rows reach."""
        rows = math.prod(self.resolve(self.variant_rows, dims))
        chosen = self
        for frm, launch in self.variants:
            if rows >= frm:
                chosen = launch
        return chosen

    def kernels(self) -> list["Launch"]:
        return [self, *(launch for _, launch in self.variants)]

    def dims(self, input_shapes: Sequence[Sequence[int]]) -> list[int]:
        """The kernel's runtime dims: bound from the inputs' shapes, then derived (a Conv's output size), then
        sums (a Concat's span along a run-time axis) or products (run-time axes flattened together); other
        inputs' axes checked against them."""
        dims = [int(input_shapes[i][axis]) for i, axis in self.sym_dims]
        for t, add, div in self.sym_derived:
            size = t if t >= 0 else dims[-t - 1]
            if size + add < 0:
                raise ValueError(f"{self.entry}: an image size of {size} is smaller than a Conv's padded kernel "
                                 f"({-add} with padding)")
            dims.append((size + add) // div + 1)
        products = set(self.sym_products)
        for j, (a, b) in enumerate(self.sym_sums):  # a Concat's span along a run-time axis, or a flattened one
            dims.append((math.prod if j in products else sum)(self.resolve((a, b), dims)))
        for i, axis, t in self.dim_checks:
            shape, want = input_shapes[i], self.resolve([t], dims)[0]
            if axis >= len(shape) or int(shape[axis]) != want:
                got = f"size {shape[axis]} at axis {axis}" if axis < len(shape) else f"rank {len(shape)}, no axis {axis}"
                why = ("axis %d of input %d, which shape inference took for it" % self.sym_dims[-t - 1][::-1]
                       if 0 < -t <= len(self.sym_dims) else "the spans a Concat joins along it, summed" if t < 0
                       else "a size shape inference took for it")
                raise ValueError(f"{self.entry}: input {i} has {got}, but the kernel was built for {want} there "
                                 f"({why})")
        for terms, limit in self.dim_limits:
            if math.prod(self.resolve(terms, dims)) >= limit:
                raise ValueError(f"{self.entry}: a size of {math.prod(self.resolve(terms, dims))} exceeds what this "
                                 f"kernel was built for (< {limit}: an image's elements or pixels for its 32-bit "
                                 f"gather, or a sequence for a table it slices); fix the size when optimizing "
                                 f"(--input-shape), or give a shorter input")
        return dims

    def resolve(self, terms: Sequence[int], dims: Sequence[int]) -> list[int]:
        return [t if t >= 0 else dims[-t - 1] for t in terms]

    def grid(self, dims: Sequence[int]) -> int:
        units = math.prod(self.resolve(self.units, dims))
        for terms, div in self.units_ceil:
            units *= -(-math.prod(self.resolve(terms, dims)) // div)
        return -(-units // self.units_per_block)

    def output_shapes(self, dims: Sequence[int]) -> list[list[int]]:
        return [self.resolve(s, dims) for s in self.out_shapes]


def read_launch(node: onnx.NodeProto) -> Launch:
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if a.get("ortfuse_version") not in range(1, NODE_FORMAT_VERSION + 1):
        raise ValueError(f"node '{node.name}': ortfuse node format {a.get('ortfuse_version')} is not 1 to "
                         f"{NODE_FORMAT_VERSION}")
    first = _read_kernel(node, a, "")
    n = int(a.get("variants", 1))
    if n == 1:
        return first
    more = tuple((int(frm), _read_kernel(node, a, f"@{i}")) for i, frm in enumerate(a["variant_from"], 1))
    if len(more) != n - 1:
        raise ValueError(f"node '{node.name}': {n} kernel variants but {len(more) + 1} thresholds")
    return dataclasses.replace(first, variants=more, variant_rows=tuple(a["variant_rows"]))


def _read_kernel(node: onnx.NodeProto, a: dict, sfx: str) -> Launch:
    """Kernel `sfx` of the node (its own attributes carry the suffix; the shared ones do not)."""
    mine: dict = {}
    for key, value in a.items():
        base, at, tag = key.partition("@")
        if not _own(base):
            mine.setdefault(base, value)  # shared (no variant carries its own)
        elif at + tag == sfx:
            mine[base] = value
    a = mine
    sym = list(a["sym_dims"])
    ranks, flat = list(a["out_ranks"]), list(a["out_dims"])
    shapes, pos = [], 0
    for r in ranks:
        shapes.append(tuple(flat[pos:pos + r]))
        pos += r
    ceil, limits = _groups(a.get("units_ceil", [])), _groups(a.get("dim_limits", []))
    derived, checks, tma = list(a.get("sym_derived", [])), list(a.get("dim_checks", [])), list(a.get("tma", []))
    sums = list(a.get("sym_sums", []))
    src = a["source"]
    return Launch(a["entry"].decode() if isinstance(a["entry"], bytes) else a["entry"],
                  src.decode() if isinstance(src, bytes) else src, int(a["block"]), int(a["smem"]),
                  tuple(zip(sym[0::2], sym[1::2])), tuple(a["units"]), int(a["units_per_block"]),
                  tuple(ceil),
                  tuple(a["out_dtypes"]), tuple(shapes), int(a.get("split_k", 1)), tuple(a.get("cubin_archs", ())),
                  tuple(zip(derived[0::3], derived[1::3], derived[2::3])), tuple(limits),
                  tuple(a.get("arg_align", [1] * (len(node.input) + len(node.output)))),
                  tuple(zip(checks[0::3], checks[1::3], checks[2::3])), tuple(zip(tma[0::3], tma[1::3], tma[2::3])),
                  int(a.get("blocks_per_sm", 0)), int(a.get("row_cluster", 1)), int(a.get("multicast", 1)),
                  bool(a.get("pdl", 0)), tuple(zip(sums[0::2], sums[1::2])), tuple(a.get("sym_products", ())))


# a kernel's own attributes (`_kernel_attributes`); a variant's carry its suffix
_KERNEL_KEYS = frozenset({"entry", "cubin_archs", "ptx", "block", "smem", "units", "units_per_block", "units_ceil",
                          "split_k", "dim_limits", "arg_align", "tma", "blocks_per_sm", "row_cluster", "multicast",
                          "pdl", "source"})


def _own(key: str) -> bool:
    return key in _KERNEL_KEYS or key.startswith("cubin_") and key[6:].isdigit()


def _groups(flat: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
    """(count, terms..., value) groups: units_ceil's and dim_limits' encoding."""
    out, k = [], 0
    while k < len(flat):
        n = flat[k]
        out.append((tuple(flat[k + 1:k + 1 + n]), flat[k + 1 + n]))
        k += n + 2
    return out

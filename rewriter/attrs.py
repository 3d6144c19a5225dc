"""Reading a node's attributes (one helper for every stage)."""
from __future__ import annotations

from typing import Any, Sequence

import onnx


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of attribute `name` of `node` (an int, float, string, tensor or list), else `default`."""
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else onnx.helper.get_attribute_value(a)


def attr_str(node: onnx.NodeProto, name: str, default: str) -> str:
    """A string attribute (onnx gives bytes) as str, else `default`."""
    v = attr(node, name, default)
    return v.decode() if isinstance(v, bytes) else v


def transpose_perm(node: onnx.NodeProto, rank: int) -> list[int]:
    """A Transpose's perm: its attribute, else the axes reversed (ONNX's default)."""
    perm = attr(node, "perm")
    return list(perm) if perm else list(reversed(range(rank)))


def inverse_perm(perm: Sequence[int]) -> tuple[int, ...]:
    """The perm that undoes `perm`."""
    inv = [0] * len(perm)
    for k, p in enumerate(perm):
        inv[p] = k
    return tuple(inv)

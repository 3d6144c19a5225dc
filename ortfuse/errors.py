"""Errors the user sees. Each carries a one-line message naming the file, node or tensor at fault."""
from __future__ import annotations


class OrtfuseError(Exception):
    """Base class. The CLI prints `ortfuse: error: <message>` and exits with `exit_code`."""

    exit_code = 2


class InputError(OrtfuseError):
    """The input model or an option is unusable: not ONNX, truncated, contradictory shapes, ..."""


class UnsupportedError(OrtfuseError):
    """The model uses something ortfuse refuses to handle (e.g. an op no runtime knows)."""


class CompileError(OrtfuseError):
    """NVRTC or the host compiler rejected a generated kernel. The message names the dumped source."""

    exit_code = 3


class ParityError(OrtfuseError):
    """`ortfuse check` found outputs that differ beyond tolerance."""

    exit_code = 1

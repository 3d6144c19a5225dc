"""ortfuse: an offline fusion compiler for ONNX models whose output runs in stock ONNX Runtime."""
from ortfuse.api import FusedKernel, OptimizeResult, compile_model, optimize
from ortfuse.errors import CompileError, InputError, OrtfuseError, ParityError, UnsupportedError
from ortfuse.runtime import InferenceSession, register

__all__ = ["optimize", "compile_model", "OptimizeResult", "FusedKernel", "OrtfuseError", "InputError",
           "UnsupportedError", "CompileError", "ParityError"]
__all__ += ["InferenceSession", "register"]

"""ONNX in and out: load, shapes, and sub-graph replacement."""
from ortfuse.rewriter.graph import Graph, TensorInfo

__all__ = ["Graph", "TensorInfo"]

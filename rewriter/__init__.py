"""ONNX in and out: load, shapes, and sub-graph replacement."""
from ortfuse.rewriter.graph import Graph, TensorInfo
from ortfuse.rewriter.load import load_model
from ortfuse.rewriter.replace import FusedNode, replace, save_model
from ortfuse.rewriter.shapes import build_graph, parse_input_shapes

__all__ = ["FusedNode", "Graph", "TensorInfo", "build_graph", "load_model", "parse_input_shapes", "replace",
           "save_model"]

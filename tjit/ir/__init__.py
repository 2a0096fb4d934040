"""tjit's graph IR (after seed 003): types, views, axis strategies, ops, nodes, graphs."""
from .dtype import DType
from .graph import (Const, Contiguous, Cumulative, Dot, Elementwise, Extern, ExternCall, Gather, Graph, GraphBuilder,
                    GraphNode, GraphOp, Input, Iota, Mutation, Operand, Reduce, Scatter, ViewOp, Window, bind_operands,
                    copies_its_source, covered_memory, format_graph, per_node, toposort)
from .ops import NO_GRAD, OPS, OpDef, op_def
from .strategy import Auto, AxisStrategy, Sequential, Thread, ThreadGroup
from .view import View, contiguous_strides, nested_axes, strides_nest

__all__ = [
    "DType", "View", "contiguous_strides", "AxisStrategy", "Auto", "Sequential", "Thread", "ThreadGroup",
    "GraphOp", "Input", "Const", "ViewOp", "Contiguous", "Elementwise", "Reduce", "Cumulative", "Gather",
    "Iota", "Window", "Dot", "Scatter", "Extern", "ExternCall", "Operand", "bind_operands",
    "GraphNode", "Graph", "GraphBuilder", "copies_its_source", "Mutation", "per_node", "toposort", "format_graph",
    "OPS", "OpDef", "NO_GRAD", "op_def",
]

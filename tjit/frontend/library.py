"""Aten ops tjit does not generate run as library calls: the op itself, on memory.

An op with no IR translation (a sort, a matmul, a convolution, ...) becomes an ExternCall:
its tensor operands are read from memory (an input or a view of one, a buffer a kernel
writes, another call's result), so values computed by fused kernels are materialised
first; its results are Extern nodes that later kernels load like any buffer. The fused
work before and after the call still fuses: only the call itself is a boundary.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import UnsupportedOpError
from ..ir import Const, Contiguous, DType, Extern, ExternCall, GraphNode, Input, Operand, View, ViewOp

MEMORY = (Input, Contiguous, Extern)  # nodes whose value lives in memory a library call can read


def reads_memory(node: GraphNode) -> bool:
    """The node is memory (an input, a buffer, a call's result) or a strided view of one."""
    base = node.src[0] if isinstance(node.op, ViewOp) else node
    return isinstance(base.op, MEMORY)


def library_call(cv, node: fx.Node, target, args: tuple, kwargs: dict) -> Any:
    """Run `target` (an aten OpOverload) as a library call on the converted args: returns
    its results as Extern nodes, in the structure the op returns them."""
    if not isinstance(target, torch._ops.OpOverload):
        raise UnsupportedOpError(str(target), "not an aten op (tjit runs aten ops it does not generate as library "
                                 "calls)", target=node.target)
    if target._schema.is_mutable:
        raise UnsupportedOpError(str(target), "an op that writes one of its arguments in place and has no "
                                 "functional form", target=node.target)
    operands: list[GraphNode] = []

    def placeholder(value):
        if not isinstance(value, GraphNode):
            return value
        operands.append(value if reads_memory(value) else _in_memory(cv, value))
        return Operand(len(operands) - 1)

    call = ExternCall(target, tree_map(placeholder, tuple(args)), tree_map(placeholder, dict(kwargs)))
    results, spec = tree_flatten(node.meta["val"])
    nodes, k = [], 0
    for result in results:
        if isinstance(result, torch.Tensor):
            view = View(tuple(result.shape), tuple(result.stride()))
            nodes.append(cv.b.node(Extern(call, k), DType.from_torch(result.dtype), tuple(operands), view))
            k += 1
        else:
            nodes.append(result)
    return tree_unflatten(nodes, spec)


def _in_memory(cv, value: GraphNode) -> GraphNode:
    """A computed value (or a literal) written to a buffer by a kernel, for a call to read."""
    if isinstance(value.op, Const) or (isinstance(value.op, ViewOp) and isinstance(value.src[0].op, Const)):
        return cv.b.node(Contiguous(), value.dtype, (value,), View.contiguous(value.shape))
    return cv.materialize(value)

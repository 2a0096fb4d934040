"""Aten ops tjit does not generate run as library calls: the op itself, on memory.

An op with no IR translation (a sort, a matmul, a convolution, ...) becomes an ExternCall:
its tensor operands are read from memory (an input or a view of one, a buffer a kernel
writes, another call's result), so values computed by fused kernels are materialised
first; its results are Extern nodes that later kernels load like any buffer. The fused
work before and after the call still fuses: only the call itself is a boundary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import UnsupportedOpError
from ..ir import Const, Contiguous, DType, Extern, ExternCall, GraphNode, Input, Operand, View, ViewOp
from .overlap import is_non_overlapping_and_dense

MEMORY = (Input, Contiguous, Extern)  # nodes whose value lives in memory a library call can read


def reads_memory(node: GraphNode) -> bool:
    """The node is memory (an input, a buffer, a call's result) or a strided view of one
    that torch can express (torch has no negative strides: a flipped view is copied)."""
    base = node.src[0] if isinstance(node.op, ViewOp) else node
    return isinstance(base.op, MEMORY) and all(stride >= 0 for stride in node.view.strides)


def library_call(cv, node: fx.Node, target, args: tuple, kwargs: dict) -> Any:
    """Run `target` (an aten OpOverload) as a library call on the converted args: returns
    its results as Extern nodes, in the structure the op returns them."""
    if not isinstance(target, torch._ops.OpOverload):
        raise UnsupportedOpError(str(target), "not an aten op (tjit runs aten ops it does not generate as library "
                                 "calls)", target=node.target)
    if not target._schema.returns:
        raise UnsupportedOpError(str(target), "an op that returns nothing (a check that raises on bad data): tjit "
                                 "has no step for it yet", target=node.target)
    if target._schema.is_mutable:
        raise UnsupportedOpError(str(target), "an op that writes one of its arguments in place and has no "
                                 "functional form", target=node.target)
    operands: list[GraphNode] = []
    traced = iter(leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
                  for leaf in tree_flatten((tuple(node.args), dict(node.kwargs)))[0])

    def placeholder(value):
        meta = next(traced)
        if not isinstance(value, GraphNode):
            return value
        operands.append(with_traced_layout(cv, in_memory(cv, value), meta))
        return Operand(len(operands) - 1)

    bound_args, bound_kwargs = tree_map(placeholder, (tuple(args), dict(kwargs)))
    call = ExternCall(target, bound_args, bound_kwargs)
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


def with_traced_layout(vb, operand: GraphNode, meta) -> GraphNode:
    """The operand in the layout the trace gave it: tjit drops copies that change only the
    layout (`.contiguous()`), but an op may rely on one it was handed (embedding_bag's
    indices), so a dense traced layout is written out as such first."""
    if not isinstance(meta, torch.Tensor) or meta.numel() <= 1 or _same_strides(operand.view, meta):
        return operand
    if not is_non_overlapping_and_dense(meta):
        return operand  # an op handed a strided window reads it through its strides
    order = sorted(range(meta.dim()), key=lambda d: (-meta.stride(d), d))  # outermost first
    permuted = vb.view(operand, ("permute", tuple(order)))
    dense = vb.b.node(Contiguous(), operand.dtype, (permuted,), View.contiguous(permuted.shape))
    back = tuple(order.index(d) for d in range(meta.dim()))
    return vb.view(dense, ("permute", back))


def _same_strides(view: View, meta: torch.Tensor) -> bool:
    return all(size == 1 or a == b for size, a, b in zip(meta.shape, view.strides, meta.stride()))


def in_memory(vb, value: GraphNode) -> GraphNode:
    """The value as memory a library call can read: as it is when it already is memory (or a
    view of it), else written to a buffer by a kernel (literals too)."""
    if reads_memory(value):
        return value
    if isinstance(value.op, Const) or (isinstance(value.op, ViewOp) and isinstance(value.src[0].op, Const)):
        return vb.b.node(Contiguous(), value.dtype, (value,), View.contiguous(value.shape))
    return vb.materialize(value)


@dataclass(frozen=True, eq=False)
class ExternGradient:
    """The gradient of result `index` of a library call with respect to its operands `wrt`,
    computed by torch's own derivative formula for the op (torch.autograd.grad), itself run
    as a library call: called with the call's operands and the result's gradient, it returns
    one gradient per operand in `wrt`."""
    call: ExternCall
    index: int
    wrt: tuple[int, ...]

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *operands, grad = tensors
        with torch.enable_grad():
            # the op runs again: operands without a gradient are copies, since some ops write
            # into them although their schema does not say so (a batch norm's running stats)
            leaves = [t.detach().requires_grad_() if k in self.wrt else t.clone() for k, t in enumerate(operands)]

            def bind(arg):
                return leaves[arg.index] if isinstance(arg, Operand) else arg

            result = self.call.target(*tree_map(bind, self.call.args), **tree_map(bind, self.call.kwargs))
            out = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)][self.index]
            wrt = [leaves[k] for k in self.wrt]
            grads = torch.autograd.grad(out, wrt, grad, allow_unused=True) if out.requires_grad else [None] * len(wrt)
        return tuple(torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads))

    def __str__(self) -> str:
        return f"grad[{self.index}] of {self.call.name}"


def library_call_gradient(vb, node: GraphNode, grad: GraphNode, value, wanted) -> list[Optional[GraphNode]]:
    """Gradients of a library call's result `node` (an Extern node) for each of its operands
    whose gradient is `wanted`, given the result's gradient: one library call running torch's
    derivative formula on the operands' forward values (`value`: forward node -> its value
    in the backward graph)."""
    wrt = tuple(k for k, s in enumerate(node.src) if s.dtype.is_float and wanted(s))
    if not wrt:
        return [None] * len(node.src)
    operands = tuple(in_memory(vb, value(s)) for s in node.src) + (in_memory(vb, grad),)
    call = ExternCall(ExternGradient(node.op.call, node.op.index, wrt), tuple(Operand(k) for k in range(len(operands))),
                      {})
    grads: list[Optional[GraphNode]] = [None] * len(node.src)
    for j, k in enumerate(wrt):
        src = node.src[k]
        grads[k] = vb.b.node(Extern(call, j), src.dtype, operands, View.contiguous(src.shape))
    return grads

"""Gradients through complex values, all of them library calls.

Complex values exist in the IR only as call operands and results (inputs, library-call
results, views of them): no kernel computes them. Their gradients do not either: the
gradient of a library call whose operands or results are complex is torch's own derivative
formula for the op, traced (autograd/library_grad.py) with its complex ops run as library
calls, or torch's backward run as one call; the gradient of a view of a complex value is one
call that adds the view's gradient into zeros of the source's layout; contributions to one
complex value's gradient are summed by a call of aten.add. Gradients follow torch's
convention (the conjugate Wirtinger derivative, as torch.autograd gives): each step is
torch's own formula, so their composition is eager's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import UnsupportedOpError
from ..frontend.library import in_memory
from ..ir import Contiguous, Extern, ExternCall, GraphNode, Input, Operand, View, ViewOp, nested_axes
from .library_grad import library_gradient


def touches_complex(node: GraphNode) -> bool:
    """The node's value or one of its sources is complex: its gradient is library calls only."""
    return node.dtype.is_complex or any(s.dtype.is_complex for s in node.src)


def complex_vjp(vb, node: GraphNode, grad: GraphNode, value, wanted: Callable[[GraphNode], bool]) \
        -> list[Optional[GraphNode]]:
    """The gradient of each of the node's sources (None where none is wanted), as vjp gives,
    for a node that touches complex values."""
    op = node.op
    if isinstance(op, Input):
        return []
    if isinstance(op, Extern):
        return library_gradient(vb, node, grad, value, wanted)
    if isinstance(op, Contiguous):
        return [grad]
    if isinstance(op, ViewOp):
        return [view_gradient(vb, grad, node.view, node.src[0])]
    raise UnsupportedOpError(type(op).__name__, f"a gradient through a {node.dtype!r} value computed by a "
                             "kernel: tjit computes complex values in library calls only")


def complex_sum(vb, contributions: list[GraphNode]) -> GraphNode:
    """The sum of a complex value's gradient contributions, by library calls of aten.add."""
    total = contributions[0]
    for c in contributions[1:]:
        operands = (in_memory(vb, total), in_memory(vb, c))
        call = ExternCall(torch.ops.aten.add.Tensor, (Operand(0), Operand(1)), {})
        total = call.results[0] = vb.b.node(Extern(call, 0), total.dtype, operands, View.contiguous(total.shape))
    return total


@dataclass(frozen=True)
class ViewGradient:
    """The gradient of `src` (shape, strides, offset in its storage) read through the view
    (shape, strides, offset in the same storage) whose gradient the call is handed: zeros in
    the source's layout, plus each view element's gradient added at the element it read
    (twice-read elements get the sum). Returned dense (row-major)."""
    view: tuple[tuple[int, ...], tuple[int, ...], int]
    src: tuple[tuple[int, ...], tuple[int, ...], int]

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        at_view, at_src = _positions(*self.view, grad.device), _positions(*self.src, grad.device)
        extent = 1 + max(int(at_view.max()) if at_view.numel() else 0, int(at_src.max()) if at_src.numel() else 0)
        flat = torch.zeros(extent, dtype=grad.dtype, device=grad.device)
        flat.index_add_(0, at_view.reshape(-1), grad.reshape(-1))
        return flat[at_src]

    def __str__(self) -> str:
        return "view_gradient"


def _positions(shape, strides, offset, device) -> torch.Tensor:
    """The storage offset of each element of a strided view (negative strides included)."""
    found = torch.full(tuple(shape), offset, dtype=torch.int64, device=device)
    for d, (n, st) in enumerate(zip(shape, strides)):
        found = found + (torch.arange(n, device=device) * st).view([n if k == d else 1 for k in range(len(shape))])
    return found


def view_gradient(vb, grad: GraphNode, view: View, src: GraphNode) -> GraphNode:
    """The gradient of a complex source read through a strided view: one library call."""
    if nested_axes(src.view) is None:
        raise UnsupportedOpError("view", f"the gradient of a source with overlapping strides {list(src.view.strides)} "
                                 f"(shape {list(src.shape)}); pass a contiguous tensor")
    call = ExternCall(ViewGradient((view.shape, view.strides, view.offset),
                                   (src.shape, src.view.strides, src.view.offset)), (Operand(0),), {})
    call.results[0] = found = vb.b.node(Extern(call, 0), grad.dtype, (in_memory(vb, grad),),
                                        View.contiguous(src.shape))
    return found


def as_call_result(vb, node: GraphNode) -> GraphNode:
    """A complex gradient as a dense call result, the form in which the backward returns it
    (no kernel copies complex values): itself when it is one, else a library call's copy
    (a view of a call's result, an incoming gradient)."""
    dense = View.contiguous(node.shape)
    if isinstance(node.op, Extern) and node.op.index is not None and \
            all(n == 1 or a == b for n, a, b in zip(node.shape, node.view.strides, dense.strides)) and \
            node.view.offset == 0:
        return node
    call = ExternCall(torch.ops.aten.clone.default, (Operand(0),), {"memory_format": torch.contiguous_format})
    call.results[0] = found = vb.b.node(Extern(call, 0), node.dtype, (in_memory(vb, node),), dense)
    return found

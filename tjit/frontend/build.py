"""Building IR values: the operations the frontend's op table and the autograd rules share.

Views are pushed to the leaves (a movement op on an elementwise value is applied to its
operands instead, since elementwise ops commute with index remapping), so inside the IR a
ViewOp only ever reads an Input, a Const or a materialised buffer; indexed reads are pushed
the same way. Both are memoised, so the same view of the same value is one node.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ir import (Const, Contiguous, Cumulative, DType, Elementwise, Extern, Gather, GraphBuilder, GraphNode, Input, Reduce,
                  View, ViewOp)

ViewFn = tuple  # ("permute", dims) etc.: a hashable description of a movement op


def apply_view_desc(view: View, desc: ViewFn) -> Optional[View]:
    kind, *args = desc
    return getattr(view, kind)(*args)


class ValueBuilder:
    """Creates IR values in one GraphBuilder."""

    def __init__(self, builder: Optional[GraphBuilder] = None, indices_checked: bool = False):
        """indices_checked: every index an indexed read will use is known to be in range (a
        backward graph: its forward checked them)."""
        self.b = builder or GraphBuilder()
        self.indices_checked = indices_checked
        self._view_memo: dict[tuple, GraphNode] = {}

    def const(self, value, dtype: DType) -> GraphNode:
        return self.b.const(_coerce_scalar(value, dtype), dtype)

    def elementwise(self, op: str, operands: list[GraphNode], dtype: DType) -> GraphNode:
        shape = operands[0].shape
        assert all(o.shape == shape for o in operands), f"{op}: operand shapes differ {[o.shape for o in operands]}"
        return self.b.node(Elementwise(op), dtype, tuple(operands), View.contiguous(shape))

    def cast(self, node: GraphNode, dtype: DType) -> GraphNode:
        if node.dtype == dtype:
            return node
        if isinstance(node.op, Const):
            return self.const(node.op.value, dtype)
        return self.elementwise("cast", [node], dtype)

    def reduce(self, op: str, value: GraphNode, axes, dtype: Optional[DType] = None,
               grad_to_first: bool = False) -> GraphNode:
        """`op` over `axes` of value, keeping them as size-1 axes. Reducing only size-1 axes
        is the identity (argmax: index 0), so a Reduce node never has the shape of its input."""
        rank = len(value.shape)
        axes = tuple(sorted({a % rank for a in axes})) if rank else ()
        dtype = dtype or value.dtype
        if all(value.shape[a] == 1 for a in axes):
            return self.const(0, dtype) if op in ("argmax", "argmin") else self.cast(value, dtype)
        shape = tuple(1 if d in axes else s for d, s in enumerate(value.shape))
        return self.b.node(Reduce(op, axes, grad_to_first=grad_to_first), dtype, (value,), View.contiguous(shape))

    def scan(self, op: str, value: GraphNode, axis: int, dtype: Optional[DType] = None) -> GraphNode:
        """The running `op` of value along `axis` (same shape). Along a size-1 axis it is the
        identity (argmax: index 0)."""
        dtype = dtype or value.dtype
        if not value.shape or value.shape[axis % len(value.shape)] == 1:
            if op in ("argmax", "argmin"):
                return self.expand_to(self.const(0, dtype), value.shape)
            return self.cast(value, dtype)
        return self.b.node(Cumulative(op, axis % len(value.shape)), dtype, (value,), View.contiguous(value.shape))

    def gather(self, node: GraphNode, axis: int, index: GraphNode, wrap_negative: bool = False,
               what: str = "gather") -> GraphNode:
        """node[i with coordinate `axis` replaced by index[i]], shaped like index (whose other
        sizes are at most node's). Pushed through elementwise ops, like views, so the read
        lands on the leaves: a gathered log_softmax gathers its input and reuses the row
        values (cross-entropy stays one kernel)."""
        key = (id(node), "gather", axis, id(index), wrap_negative)
        found = self._view_memo.get(key)
        if found is None:
            found = self._view_memo[key] = self._gather_uncached(node, axis, index, wrap_negative, what)
        return found

    def _gather_uncached(self, node, axis, index, wrap_negative, what) -> GraphNode:
        shape = index.shape
        if isinstance(node.op, Elementwise):
            src = [self.gather(s, axis, index, wrap_negative, what) for s in node.src]
            return self.b.node(node.op, node.dtype, tuple(src), View.contiguous(shape))
        if isinstance(node.op, ViewOp) and node.view.strides[axis] == 0 and \
                (isinstance(node.src[0].op, (Const, Reduce)) or self.indices_checked):
            # a literal or a row value, constant along the axis: any in-range index reads the
            # same value (a broadcast input is still gathered, so its index is checked, unless
            # that was done before)
            view = View(shape, node.view.strides, node.view.offset)
            base = node.src[0]
            if view == base.view and isinstance(base.op, Reduce):
                return base
            return self.b.node(ViewOp(), node.dtype, (base,), view)
        if not (node.is_leaf and not isinstance(node.op, Const)) and not isinstance(node.op, Contiguous):
            node = self.materialize(node)
        return self.b.node(Gather(axis, wrap_negative, what), node.dtype, (node, index), View.contiguous(shape))

    def materialize(self, node: GraphNode) -> GraphNode:
        if isinstance(node.op, (Contiguous, Input, Const, Extern)):
            return node
        return self.b.node(Contiguous(), node.dtype, (node,), View.contiguous(node.shape))

    def view(self, node: GraphNode, desc: ViewFn) -> GraphNode:
        """Apply a movement op, pushing it through elementwise nodes to the leaves."""
        key = (id(node), desc)
        found = self._view_memo.get(key)
        if found is None:
            found = self._view_memo[key] = self._view_uncached(node, desc)
        return found

    def _view_uncached(self, node: GraphNode, desc: ViewFn) -> GraphNode:
        if isinstance(node.op, Elementwise):
            pushed = [self._try_view(s, desc) for s in node.src]
            if all(p is not None for p in pushed):
                shape = pushed[0].shape
                return self.b.node(node.op, node.dtype, tuple(pushed), View.contiguous(shape))
            node = self.materialize(node)
        if isinstance(node.op, ViewOp):
            new = apply_view_desc(node.view, desc)
            base = node.src[0]
            if new is not None and (not isinstance(base.op, Gather) or _keeps_elements(base.view, new)):
                return base if new == base.view and isinstance(base.op, (Reduce, Gather)) else \
                    self.b.node(ViewOp(), node.dtype, node.src, new)
            node = self.materialize(node)
        if isinstance(node.op, Gather) and _keeps_elements(node.view, apply_view_desc(node.view, desc)):
            # a gathered value squeezed, unsqueezed or broadcast stays in registers (cross-entropy's row)
            return self.b.node(ViewOp(), node.dtype, (node,), apply_view_desc(node.view, desc))
        if not isinstance(node.op, (Input, Const, Contiguous, Reduce, Extern)):
            node = self.materialize(node)
        new = apply_view_desc(node.view, desc)
        if new is None:  # an input whose layout cannot be reshaped as a view: copy it dense
            node = self.b.node(Contiguous(), node.dtype, (node,), View.contiguous(node.shape))
            new = apply_view_desc(node.view, desc)
        return node if new == node.view else self.b.node(ViewOp(), node.dtype, (node,), new)

    def _try_view(self, node: GraphNode, desc: ViewFn) -> Optional[GraphNode]:
        if isinstance(node.op, (ViewOp, Input, Const, Contiguous, Reduce, Extern)):
            return None if apply_view_desc(node.view, desc) is None else self.view(node, desc)
        return self.view(node, desc)

    def expand_to(self, node: GraphNode, shape: tuple[int, ...]) -> GraphNode:
        shape = tuple(shape)
        if node.shape == shape:
            return node
        return self.view(node, ("expand", shape))


def _keeps_elements(dense: View, view: Optional[View]) -> bool:
    """`view` of a dense value only inserts, removes or broadcasts axes: every element keeps
    its place among the others."""
    def placed(v):
        return [(n, s) for n, s in zip(v.shape, v.strides) if n != 1 and s != 0]
    return view is not None and view.offset == 0 and placed(view) == placed(dense)


def _coerce_scalar(value, dtype: DType):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if dtype is DType.bool:
        return bool(value)
    if dtype.is_int:
        return int(value)
    return float(value)

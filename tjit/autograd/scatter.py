"""Scatter-add gradients moved back through the views and copies between a gather and the
input it reads.

A gather's table is an input seen through a view (embedding and index_select insert and
broadcast axes so that the table has the result's rank; `w[1:]`, `w.t()` are views too),
sometimes through a dense copy of one (a reshape that no view expresses) or a cast. The
scatter-add the gather's gradient is (vjp.ScatterGrad) is therefore aimed at the view, and
moved back to the input it reads. Moving it back is index arithmetic, fused into the
backward kernels like any other: each gathered element's storage offset in the viewed
buffer (offset + sum of coordinate * stride, with the data index on the gathered axis),
turned into the buffer's own row-major element index, which is where its gradient goes.
The moved scatter-add is "flat" (axis None): into the gradient viewed as one dimension.
Into an input's or a computed value's gradient alike, the scatter-adds then become IR
Scatters (scatter_added), computed by the backward's kernels.
"""
from __future__ import annotations

from typing import Optional

from ..ir import (Contiguous, DType, Elementwise, GraphNode, Input, Scatter, View, ViewOp, contiguous_strides,
                  copies_its_source, nested_axes)
from .algebra import Algebra
from .vjp import ScatterGrad


def scatter_into_source(alg: Algebra, node: GraphNode, s: ScatterGrad) -> Optional[ScatterGrad]:
    """The scatter-add `s` into `node`'s value as one into its source's (None when the
    source is a computed value, which cannot receive one)."""
    op = node.op
    if copies_its_source(node):  # the same elements, in the same (row-major) order
        return s
    if isinstance(op, Elementwise) and op.op == "cast":
        src = node.src[0]
        return ScatterGrad(s.axis, s.index, alg.cast(s.values, src.dtype), s.what) if src.dtype.is_float else None
    if not isinstance(op, ViewOp):
        return None
    src = node.src[0]
    if not isinstance(src.op, (Input, Contiguous)):
        return None
    offset = _storage_offsets(alg, node.view, s)
    index = element_index(alg, offset, src)
    return None if index is None else ScatterGrad(None, index, s.values, s.what)


def scatter_added(alg: Algebra, node: GraphNode, scattered: list[ScatterGrad],
                  base: Optional[GraphNode] = None) -> GraphNode:
    """The scatter-adds into node's gradient, as a value: `base` (node's dense gradient, or
    zeros) with each one's values added at their elements (IR Scatters: the backward fills a
    buffer and adds into it with tl.atomic_add, fused with the work computing the values, in
    float32 for 16-bit floats)."""
    work = DType.float32 if node.dtype.is_low_precision else node.dtype
    total = alg.zeros(node.shape, work) if base is None else alg.cast(base, work)
    for s in scattered:
        offsets = _storage_offsets(alg, View.contiguous(node.shape), s)
        total = alg.vb.b.node(Scatter(accumulate=True, checked=False, what=s.what), work,
                              (total, offsets, alg.cast(s.values, work)), View.contiguous(node.shape))
    return alg.cast(total, node.dtype)


def _storage_offsets(alg: Algebra, view: View, s: ScatterGrad) -> GraphNode:
    """Where, in the buffer `view` reads, each element `s` adds into lies (int64, shaped
    like s.index)."""
    index = alg.cast(s.index, DType.int64)
    shape = index.shape
    if s.axis is not None:
        # the element at p is the view's element at p with the gathered coordinate replaced
        strides = tuple(0 if d == s.axis else st for d, st in enumerate(view.strides))
        return alg.add(alg.positions(View(shape, strides, view.offset)), alg.mul(index, view.strides[s.axis]))
    # a flat index into the view's elements, row-major: its coordinates, then their offsets
    total, rest = alg.add(alg.zeros(shape, DType.int64), view.offset), index
    for size, dense, stride in zip(view.shape, contiguous_strides(view.shape), view.strides):
        if size == 1:
            continue
        coordinate = alg.ew("floordiv", rest, dense)
        rest = alg.sub(rest, alg.mul(coordinate, dense))
        if stride:
            total = alg.add(total, alg.mul(coordinate, stride))
    return total


def element_index(alg: Algebra, offset: GraphNode, src: GraphNode) -> Optional[GraphNode]:
    """Storage offsets in src's buffer as src's row-major element indices (None when two of
    src's elements share memory)."""
    view = src.view if isinstance(src.op, Input) else View.contiguous(src.shape)
    dense = contiguous_strides(src.shape)
    kept = [d for d, n in enumerate(src.shape) if n != 1]
    if all(view.strides[d] == dense[d] for d in kept) and view.offset == 0:
        return offset  # laid out row-major: the offset is the index
    layout = nested_axes(src.view)
    if layout is None:
        return None
    rest, index = alg.sub(offset, view.offset) if view.offset else offset, None
    for d, stride in zip(layout[0], layout[2]):
        coordinate = alg.ew("floordiv", rest, stride)
        rest = alg.sub(rest, alg.mul(coordinate, stride))
        term = alg.mul(coordinate, dense[d])
        index = term if index is None else alg.add(index, term)
    return index if index is not None else alg.zeros(offset.shape, DType.int64)

"""The gradient of a strided view: each element of the source buffer gets the sum of the
view's gradient over the view positions that read it.

A ViewOp reads its source's buffer at offset + sum(i_k * stride_k), and the source (an
input with the caller's strides, or a dense buffer) holds its own elements at offsets given
by its view. The transpose goes in three steps:

1. broadcast axes (stride 0) are summed away, size-1 axes dropped, negative strides flipped,
   and the axes sorted by decreasing stride: the gradient now lists the view's elements in
   increasing offset order;
2. if the view reads every element of the source exactly once (permute, reshape, flip,
   transpose of any of them), the source lists the same offsets in the same order, so the
   gradient is a reshape and permute of the sorted one;
3. otherwise (slices, selects, strided windows) each source element finds its view position
   from its own offset by mixed-radix division, and reads the gradient there with an indexed
   read, or 0 if no view position reads it.

Views that read an element twice through two different index tuples (overlapping
as_strided windows) are refused.
"""
from __future__ import annotations

import math

from ..errors import UnsupportedOpError
from ..ir import DType, GraphNode, View, contiguous_strides
from .algebra import Algebra


def view_transpose(alg: Algebra, grad: GraphNode, view: View, src: GraphNode) -> GraphNode:
    grad, sizes, strides, offset = _sorted_by_stride(alg, grad, view)
    source = _layout(src)
    if source is None:
        raise UnsupportedOpError("view", f"the gradient of a source with overlapping strides {list(src.view.strides)} "
                                 f"(shape {list(src.shape)}); pass a contiguous tensor")
    if not _disjoint(sizes, strides):
        raise UnsupportedOpError("as_strided", f"the gradient of a view that reads elements more than once "
                                 f"(sizes {sizes}, strides {strides})")
    order, src_sizes, src_strides = source
    if offset == src.view.offset and _coalesce(sizes, strides) == _coalesce(src_sizes, src_strides):
        return _reordered(alg, grad, src, order, src_sizes)
    return _embedded(alg, grad, sizes, strides, offset, src)


def _sorted_by_stride(alg: Algebra, grad: GraphNode, view: View):
    """(gradient, sizes, strides, offset) with broadcast and size-1 axes gone, strides
    positive and decreasing."""
    broadcast = [k for k, (n, s) in enumerate(zip(view.shape, view.strides)) if s == 0 and n != 1]
    if broadcast:
        grad = alg.sum(grad, broadcast)
    kept = [k for k, (n, s) in enumerate(zip(view.shape, view.strides)) if n != 1 and k not in broadcast]
    sizes = [view.shape[k] for k in kept]
    strides = [view.strides[k] for k in kept]
    grad = alg.view(grad, "reshape", tuple(sizes))
    offset = view.offset
    flipped = [k for k, s in enumerate(strides) if s < 0]
    if flipped:
        grad = alg.view(grad, "flip", tuple(flipped))
        for k in flipped:
            offset += (sizes[k] - 1) * strides[k]
            strides[k] = -strides[k]
    order = sorted(range(len(sizes)), key=lambda k: -strides[k])
    if order != list(range(len(sizes))):
        grad = alg.view(grad, "permute", tuple(order))
    return grad, [sizes[k] for k in order], [strides[k] for k in order], offset


def _layout(src: GraphNode):
    """(axis order by decreasing stride, sizes, strides) of the source's non-unit axes, or
    None if two of its elements share memory."""
    kept = [d for d, n in enumerate(src.shape) if n != 1]
    if any(src.view.strides[d] <= 0 for d in kept):
        return None
    order = sorted(kept, key=lambda d: -src.view.strides[d])
    sizes = [src.shape[d] for d in order]
    strides = [src.view.strides[d] for d in order]
    return (order, sizes, strides) if _disjoint(sizes, strides) else None


def _disjoint(sizes, strides) -> bool:
    """Sorted by decreasing stride, no two index tuples reach the same offset: every stride
    is larger than the span of the axes after it."""
    span = 0
    for n, s in reversed(list(zip(sizes, strides))):
        if s <= span:
            return False
        span += (n - 1) * s
    return True


def _coalesce(sizes, strides) -> list[tuple[int, int]]:
    """Merge neighbouring axes that are contiguous with each other (so a reshape that
    splits or merges axes gives the same form)."""
    merged: list[list[int]] = []
    for n, s in zip(sizes, strides):
        if merged and merged[-1][1] == n * s:
            merged[-1] = [merged[-1][0] * n, s]
        else:
            merged.append([n, s])
    return [tuple(m) for m in merged]


def _reordered(alg: Algebra, grad: GraphNode, src: GraphNode, order, src_sizes) -> GraphNode:
    """The view reads every source element once: both list them in offset order."""
    flat = alg.view(grad, "reshape", tuple(src_sizes))
    inverse = sorted(range(len(order)), key=lambda k: order[k])
    if inverse != list(range(len(order))):
        flat = alg.view(flat, "permute", tuple(inverse))
    return alg.view(flat, "reshape", tuple(src.shape))


def _embedded(alg: Algebra, grad: GraphNode, sizes, strides, offset, src: GraphNode) -> GraphNode:
    """Each source element reads the gradient at the view position that reads its offset,
    found by mixed-radix division (the strides are sorted and disjoint), or gets 0."""
    if not src.shape:
        raise UnsupportedOpError("view", "the gradient of a partial view of a 0-d tensor")
    rest = alg.sub(alg.positions(src.view), offset)
    inside = alg.test("ge", rest, 0)
    position = None
    for n, s, w in zip(sizes, strides, contiguous_strides(sizes)):
        i = alg.ew("floordiv", rest, s)
        inside = alg.both(inside, alg.test("lt", i, n))
        rest = alg.sub(rest, alg.mul(i, s))
        term = alg.mul(i, w)
        position = term if position is None else alg.add(position, term)
    inside = alg.both(inside, alg.test("eq", rest, 0))
    position = alg.where(inside, position if position is not None else alg.zeros(src.shape, DType.int64), 0)
    lead, count = tuple(src.shape[:-1]), math.prod(sizes)
    table = alg.expand(alg.view(grad, "reshape", (1,) * len(lead) + (count,)), lead + (count,))
    picked = alg.vb.gather(table, len(src.shape) - 1, position, what="view backward")
    return alg.where(inside, picked, 0.0)

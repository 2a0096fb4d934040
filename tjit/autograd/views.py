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
3. otherwise, when the view is a slice or fixed index of each source axis (narrow, chunk,
   select, x[::2], transposed or not), the gradient is padded back axis by axis: an indexed
   read along each sliced axis (0 where the slice skips), a mask along each fixed one;
4. else (a strided window mixing axes) each source element finds its view position from
   its own offset by mixed-radix division, and reads the gradient there with an indexed
   read, or 0 if no view position reads it.

A view that reads an element twice through two different index tuples (overlapping
as_strided windows, unfold with a step below its size) has a scatter-add gradient.
"""
from __future__ import annotations

import math

from ..errors import UnsupportedOpError
from ..ir import DType, GraphNode, View, contiguous_strides, nested_axes, strides_nest
from .algebra import Algebra


def view_transpose(alg: Algebra, grad: GraphNode, view: View, src: GraphNode):
    """The source's gradient: a GraphNode, or a ScatterGrad for overlapping windows."""
    source = nested_axes(src.view)
    if source is None:
        raise UnsupportedOpError("view", f"the gradient of a source whose strides {list(src.view.strides)} overlap or "
                                 f"interleave (shape {list(src.shape)}); pass a contiguous tensor")
    grad, view = _split_like_source(alg, grad, view, source)
    sorted_grad, sizes, strides, offset = _sorted_by_stride(alg, grad, view)
    if not strides_nest(sizes, strides):
        return _overlapping(alg, grad, view, src)
    grad = sorted_grad
    order, src_sizes, src_strides = source
    if offset == src.view.offset and _coalesce(sizes, strides) == _coalesce(src_sizes, src_strides):
        return _reordered(alg, grad, src, order, src_sizes)
    window = _per_axis_window(sizes, strides, offset, src, order)
    if window is not None:
        return alg.placed(grad, lambda piece: _padded(alg, piece, window, src))
    return alg.placed(grad, lambda piece: _embedded(alg, piece, sizes, strides, offset, src))


def _split_like_source(alg: Algebra, grad: GraphNode, view: View, source) -> tuple[GraphNode, View]:
    """A view that broadcasts, with each of its axes that spans several source axes (a
    reshape merged them: a norm's [b, t, 1] statistics read as [b*t, d]) split into those
    axes, so the broadcast axes are summed over the source's own axes: the same rows, in
    the same shape, as the reduction that made the source, and the two fuse."""
    if not any(s == 0 and n != 1 for n, s in zip(view.shape, view.strides)):
        return grad, view
    _, src_sizes, src_strides = source
    shape, strides = [], []
    for n, s in zip(view.shape, view.strides):
        run = _source_run(n, s, src_sizes, src_strides)
        shape += [m for m, _ in run] if run else [n]
        strides += [t for _, t in run] if run else [s]
    if len(shape) == len(view.shape):
        return grad, view
    return alg.view(grad, "reshape", tuple(shape)), View(tuple(shape), tuple(strides), view.offset)


def _source_run(n: int, stride: int, src_sizes, src_strides) -> list[tuple[int, int]]:
    """The consecutive source axes (sorted by decreasing stride, each contiguous with the
    next) that one view axis of size n and this stride reads, when there are several."""
    for last, s in enumerate(src_strides):
        if s != stride or n <= 1:
            continue
        first, total = last, src_sizes[last]
        while total < n and first > 0 and src_strides[first - 1] == src_sizes[first] * src_strides[first]:
            first -= 1
            total *= src_sizes[first]
        if total == n and first < last:
            return list(zip(src_sizes[first:last + 1], src_strides[first:last + 1]))
    return []


def _overlapping(alg: Algebra, grad: GraphNode, view: View, src: GraphNode):
    """A view that reads source elements more than once (overlapping windows: as_strided,
    unfold with a step below its size): each source element gets the sum of the gradient
    over the view elements that read it, a scatter-add at each view element's row-major
    index in the source."""
    from .scatter import element_index  # (scatter imports vjp, which imports this module)
    from .vjp import ScatterGrad
    index = element_index(alg, alg.positions(view), src)
    return ScatterGrad(None, index, grad, "a view whose windows overlap")


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


def _per_axis_window(sizes, strides, offset, src: GraphNode, order):
    """The view as a slice (start, step, size) or a fixed index (start, 0, 1) of each source
    axis, its axes in the view's (sorted) order, or None when it is not one (a reshape
    mixing axes, say). Keyed by source axis: (start, step, size, position in the view)."""
    rest, starts = offset - src.view.offset, {}
    for d in order:
        starts[d], rest = divmod(rest, src.view.strides[d]) if rest >= 0 else (-1, rest)
    if rest != 0 or any(not 0 <= starts[d] < src.shape[d] for d in order):
        return None
    window, free = {}, list(order)
    for k, (n, s) in enumerate(zip(sizes, strides)):
        d = next((d for d in free if s % src.view.strides[d] == 0), None)
        if d is None:
            return None
        step = s // src.view.strides[d]
        if starts[d] + (n - 1) * step >= src.shape[d]:
            return None
        window[d] = (starts[d], step, n, k)
        free.remove(d)
    for d in free:
        window[d] = (starts[d], 0, 1, None)
    return window


def _padded(alg: Algebra, grad: GraphNode, window: dict, src: GraphNode) -> GraphNode:
    """Per source axis, the gradient moved to where the view read: an indexed read along
    each sliced axis (0 where the slice skips), a one-hot mask along each fixed index."""
    by_axis = sorted(d for d, w in window.items() if w[3] is not None)
    into_axes = [window[d][3] for d in by_axis]  # the gradient's axes, in source axis order
    if into_axes != sorted(into_axes):
        grad = alg.view(grad, "permute", tuple(into_axes))
    shape = tuple(window[d][2] if d in window else 1 for d in range(len(src.shape)))
    grad = alg.view(grad, "reshape", shape)
    for d, (start, step, n, k) in sorted(window.items()):
        if k is not None:
            continue
        target = tuple(src.shape[a] if a == d else s for a, s in enumerate(grad.shape))
        hit = alg.test("eq", alg.coordinate(target, d), start)
        grad = alg.where(hit, alg.expand(grad, target), 0.0)
    for d in by_axis:
        start, step, n, _ = window[d]
        if (start, step, n) == (0, 1, src.shape[d]):
            continue
        target = tuple(src.shape[a] if a == d else s for a, s in enumerate(grad.shape))
        offset = alg.sub(alg.coordinate(target, d), start)
        position = alg.ew("floordiv", offset, step)
        inside = alg.both(alg.both(alg.test("ge", offset, 0), alg.test("lt", position, n)),
                          alg.test("eq", alg.sub(offset, alg.mul(position, step)), 0))
        picked = alg.vb.gather(grad, d, alg.where(inside, position, 0), what="slice backward")
        grad = alg.where(inside, picked, 0.0)
    return grad


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

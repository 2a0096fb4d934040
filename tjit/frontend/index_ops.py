"""aten indexed reads -> IR Gather nodes: gather, embedding, index_select, x[idx].

Each is written as one Gather along one axis of a table that has the result's rank: the
table is the input viewed (size-1 axes inserted and expanded, which costs nothing) so
that every result coordinate but the gathered one reads the table directly.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedOpError
from ..ir import DType, GraphNode, Scatter, View
from .aten_ops import out_shape, register
from .build import in_range_or_minus_one, known_in_range
from .library import library_call

aten = torch.ops.aten


def _index(cv, node, index: GraphNode) -> GraphNode:
    # eager's gather checks the index type only when it reads an index: any integer type
    # passes when there is none
    empty_gather = node.target.overloadpacket is aten.gather and index.dtype.is_int and 0 in index.shape
    if index.dtype not in (DType.int64, DType.int32) and not empty_gather:
        raise UnsupportedOpError(str(node.target), f"index tensors must be int64 or int32, got {index.dtype!r}")
    return cv.cast(index, DType.int64)


@register(aten.gather)
def _gather(cv, node, x, dim, index, sparse_grad=False):
    index = _index(cv, node, index)
    if 0 in index.shape:  # eager reads nothing, and checks no more (an index of another rank passes)
        return cv.expand_to(cv.const(0, x.dtype), index.shape)
    if not x.shape:  # a 0-d input is read as a line of one element
        line = index if index.shape else cv.view(index, ("reshape", (1,)))
        found = cv.gather(cv.view(x, ("reshape", (1,))), 0, line, what="gather along dimension 0")
        return found if index.shape else cv.view(found, ("reshape", ()))
    dim %= len(x.shape)
    return cv.gather(x, dim, index, what=f"gather along dimension {dim}")


@register(aten.index_select)
def _index_select(cv, node, x, dim, index):
    index = _index(cv, node, index)
    shape = out_shape(node)
    if not x.shape:
        return x
    dim %= len(x.shape)
    spread = tuple(s if d == dim else 1 for d, s in enumerate(shape))
    index = cv.expand_to(cv.view(index, ("reshape", spread)), shape)
    return cv.gather(cv.expand_to(x, tuple(s if d == dim else shape[d] for d, s in enumerate(x.shape))),
                     dim, index, what=f"index_select along dimension {dim}")


@register(aten.embedding)
def _embedding(cv, node, *args, **kwargs):
    """weight's rows at indices. The gradient of the row padding_idx (>= 0) is zero, as eager's:
    the rows read at that index pass their values through a stop_gradient. A gradient scaled
    by each index's count in the batch is eager's: the library call. (sparse=True gets the
    same values as a dense gradient: tjit's backward makes strided tensors only.)"""
    weight, indices, padding_idx, scale_grad_by_freq, _ = _embedding_arguments(*args, **kwargs)
    if scale_grad_by_freq:
        return library_call(cv, node, node.target, args, kwargs)
    index = _index(cv, node, indices)
    rows = _take_rows(cv, node, weight, index, 0, False, "embedding (a row of weight)")
    if padding_idx < 0 or not weight.dtype.is_float:
        return rows
    at_padding = cv.elementwise("eq", [index, cv.expand_to(cv.const(padding_idx, DType.int64), index.shape)], DType.bool)
    at_padding = cv.expand_to(cv.view(at_padding, ("reshape", tuple(index.shape) + (1,))), rows.shape)
    return cv.elementwise("where", [at_padding, cv.elementwise("stop_gradient", [rows], rows.dtype), rows], rows.dtype)


def _embedding_arguments(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return weight, indices, padding_idx, scale_grad_by_freq, sparse


@register(aten.index)
def _index_tensor(cv, node, x, indices):
    tensors = [(k, i) for k, i in enumerate(indices) if i is not None]
    if any(i.dtype is DType.bool for _, i in tensors):
        raise UnsupportedOpError(str(node.target), "indexing with a boolean mask (its result's shape depends on the "
                                                   "data) is not supported yet")
    if len(tensors) > 1:
        return _index_several(cv, node, x, indices)
    k, index = tensors[0]
    return _take_rows(cv, node, x, _index(cv, node, index), k, True, f"indexing dimension {k}")


def _index_several(cv, node, x: GraphNode, indices) -> GraphNode:
    """x[..., i, ..., j, ...]: one read of x at each result element's coordinates (those of
    an index wrapped when negative; one out of range is reported)."""
    indexed = [k for k, i in enumerate(indices) if i is not None]
    coords, checked = _indexed_coordinates(cv, node, x.shape, indices, out_shape(node))
    return cv.read_at(x, coords, checked=checked, what=f"index of a tensor of shape {list(x.shape)} along dimensions "
                                                    f"{indexed}")


def _indexed_coordinates(cv, node, x_shape, indices, shape) -> tuple[list[GraphNode], bool]:
    """For x[indices] of shape `shape`, each element's coordinates in x (int64 values of
    `shape`; -1 where an index is out of range), and whether any may be."""
    indexed = [k for k, i in enumerate(indices) if i is not None]
    sliced = [k for k in range(len(x_shape)) if k not in indexed]
    rank = len(shape) - len(sliced)  # the broadcast index dims
    start = _index_dims_start(indices)
    index_dims = range(start, start + rank)
    kept = [d for d in range(len(shape)) if d not in index_dims]
    coords = []
    for k in range(len(x_shape)):
        if k in sliced:
            coords.append(cv.cast(cv.coordinate(shape, kept[sliced.index(k)]), DType.int64))
            continue
        index = _index(cv, node, indices[k])
        spread = (1,) * (start + rank - len(index.shape)) + tuple(index.shape) + (1,) * (len(shape) - start - rank)
        coords.append(in_range_or_minus_one(cv, cv.expand_to(cv.view(index, ("reshape", spread)), shape), x_shape[k]))
    return coords, not all(known_in_range(c, n) for c, n in zip(coords, x_shape))


def _indexed_shape(x_shape, indices) -> tuple[int, ...]:
    """The shape of x[indices]: the index tensors broadcast together; their dims replace the
    indexed dims where those are adjacent, else come first (torch's rule)."""
    broadcast = tuple(torch.broadcast_shapes(*[i.shape for i in indices if i is not None]))
    rest = [n for k, n in enumerate(x_shape) if k >= len(indices) or indices[k] is None]
    start = _index_dims_start(indices)
    return tuple(rest[:start]) + broadcast + tuple(rest[start:])


def _index_dims_start(indices) -> int:
    """Where x[indices]'s broadcast index dims start: at the first indexed dim when the
    indexed dims are adjacent, else first."""
    indexed = [k for k, i in enumerate(indices) if i is not None]
    return indexed[0] if indexed == list(range(indexed[0], indexed[-1] + 1)) else 0


# what index_put adds with tl.atomic_add (the other types' adds stay library calls)
ATOMIC_ADD_TYPES = (DType.float32, DType.float64, DType.int32, DType.int64)


@register(aten.index_put, aten._unsafe_index_put)
def _index_put(cv, node, *args, **kwargs):
    """x with values written (or added) at x[indices]: a Scatter of the values broadcast to
    x[indices]'s shape, at each element's offset in x's row-major buffer. Masks (bool,
    uint8), adds of types without an atomic add and 0-d tensors run as the library call."""
    x, indices, values, accumulate = _index_put_arguments(*args, **kwargs)
    tensors = [i for i in indices if i is not None]
    if not tensors or any(i.dtype not in (DType.int64, DType.int32) for i in tensors) or not x.shape or \
            accumulate and x.dtype not in ATOMIC_ADD_TYPES:
        functional = getattr(aten, node.target.overloadpacket.__name__.rstrip("_"))
        return library_call(cv, node, getattr(functional, node.target._overloadname), args, kwargs)
    shape = _indexed_shape(x.shape, indices)
    coords, checked = _indexed_coordinates(cv, node, x.shape, indices, shape)
    offsets = cv.element_offset(coords, View.contiguous(x.shape), checked)
    values = cv.expand_to(cv.cast(values, x.dtype), shape)
    what = "index_put with indices " + ", ".join("None" if i is None else "tensor" for i in indices)
    op = Scatter(accumulate=bool(accumulate), checked=checked, what=what)
    return cv.b.node(op, x.dtype, (x, offsets, values), View.contiguous(x.shape))


@register(aten.scatter, aten.scatter_add, aten.scatter_reduce)
def _scatter(cv, node, *args, **kwargs):
    """x.scatter(dim, index, src or value), x.scatter_add(...), x.scatter_reduce(..., "sum")
    (including x): src[p] written (added) at x's element p with coordinate `dim` replaced by
    index[p], for every p of index's shape. An index outside [0, x.size(dim)) raises
    IndexError, as eager's. Other reductions (and scatters of 0-d tensors) run as the
    library call."""
    x, dim, index, src, reduce, include_self = _scatter_arguments(node, *args, **kwargs)
    accumulate = reduce == "sum" or node.target.overloadpacket is aten.scatter_add
    if reduce not in (None, "sum") or not include_self or not x.shape or len(index.shape) != len(x.shape) or \
            accumulate and x.dtype not in ATOMIC_ADD_TYPES:
        functional = getattr(aten, node.target.overloadpacket.__name__.rstrip("_"))
        return library_call(cv, node, getattr(functional, node.target._overloadname), args, kwargs)
    dim %= len(x.shape)
    shape = tuple(index.shape)
    at = in_range_or_minus_one(cv, _index(cv, node, index), x.shape[dim], wrap=False)
    coords = [at if d == dim else cv.cast(cv.coordinate(shape, d), DType.int64) for d in range(len(shape))]
    checked = not known_in_range(at, x.shape[dim])
    offsets = cv.element_offset(coords, View.contiguous(x.shape), checked)
    if isinstance(src, GraphNode) and src.shape:
        for d, n in enumerate(shape):  # src is read at index's positions only
            src = cv.view(src, ("slice", d, 0, n, 1)) if src.shape[d] != n else src
    values = cv.expand_to(cv.cast(src if isinstance(src, GraphNode) else cv.const(src, x.dtype), x.dtype), shape)
    op = Scatter(accumulate=accumulate, checked=checked, what=f"{node.target.overloadpacket.__name__} along "
                                                              f"dimension {dim}")
    return cv.b.node(op, x.dtype, (x, offsets, values), View.contiguous(x.shape))


def _scatter_arguments(node, x, dim, index, src, reduce=None, *, include_self=True):
    """(x, dim, index, src or value, reduce, include_self) of any scatter overload; scatter's
    own `reduce` ("add", "multiply": deprecated) goes to the library call."""
    if node.target.overloadpacket is aten.scatter and reduce is not None:
        return x, dim, index, src, "deprecated " + reduce, include_self
    return x, dim, index, src, reduce, include_self


def _index_put_arguments(x, indices, values, accumulate=False):
    return x, indices, values, accumulate


def _take_rows(cv, node, table: GraphNode, index: GraphNode, dim: int, wrap: bool, what: str) -> GraphNode:
    """table.shape[:dim] + index.shape + table.shape[dim+1:], reading table[..., index, ...]:
    a Gather along the last index axis of the table with index's other axes inserted."""
    shape = out_shape(node)
    if index.shape == ():
        index = cv.view(index, ("reshape", (1,)))
    rank = len(index.shape)
    axis = dim + rank - 1
    for _ in range(rank - 1):
        table = cv.view(table, ("unsqueeze", dim))
    wide = list(shape) if shape else [1]
    if len(wide) != len(table.shape):  # a 0-dim index: the result has no index axis
        wide.insert(axis, 1)
    table = cv.expand_to(table, tuple(s if d == axis else wide[d] for d, s in enumerate(table.shape)))
    lead = tuple(index.shape) + (1,) * (len(wide) - dim - rank)
    index = cv.view(index, ("reshape", (1,) * dim + lead))
    index = cv.expand_to(index, tuple(wide))
    result = cv.gather(table, axis, index, wrap, what)
    return result if tuple(result.shape) == tuple(shape) else cv.view(result, ("reshape", tuple(shape)))

"""aten indexed reads -> IR Gather nodes: gather, embedding, index_select, x[idx].

Each is written as one Gather along one axis of a table that has the result's rank: the
table is the input viewed (size-1 axes inserted and expanded, which costs nothing) so
that every result coordinate but the gathered one reads the table directly.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedOpError
from ..ir import DType, GraphNode
from .aten_ops import out_shape, register

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
def _embedding(cv, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return _take_rows(cv, node, weight, _index(cv, node, indices), 0, False, "embedding (a row of weight)")


@register(aten.index)
def _index_tensor(cv, node, x, indices):
    tensors = [(k, i) for k, i in enumerate(indices) if i is not None]
    if len(tensors) != 1 or tensors[0][1].dtype is DType.bool:
        raise UnsupportedOpError(str(node.target), "indexing with one integer tensor is supported; several index "
                                                   "tensors or a boolean mask are not yet")
    k, index = tensors[0]
    return _take_rows(cv, node, x, _index(cv, node, index), k, True, f"indexing dimension {k}")


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

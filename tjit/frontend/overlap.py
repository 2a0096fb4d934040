"""Eager's memory-overlap checks for in-place writes, applied at trace time.

Eager refuses an in-place op whose written-to tensor has elements sharing one address
(`x.expand(2, 3).add_(1)`), or whose input partially overlaps it (`x.add_(x.t())`,
`x[1:].copy_(x[:-1])`): the result would depend on the order elements are visited. The
fake tensors tjit traces with do not run those checks, so the converter runs them here,
with eager's rules (ATen's MemoryOverlap.cpp) and eager's messages.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import EagerError, UnsupportedOpError
from ..ir.view import View

INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a single "
                    "memory location. Please clone() the tensor before performing the operation.")
PARTIAL_OVERLAP = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a "
                   "single memory location. Please clone() the tensor before performing the operation.")


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Its elements fill a contiguous range of memory exactly once, in some axis order."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Eager's MemOverlap::Yes: a stride-0 axis of size > 1 (other layouts are 'too hard'
    and allowed)."""
    if is_non_overlapping_and_dense(t):
        return False
    return any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride()))


def in_one_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both have elements, and in one storage (compared as storages, not addresses: fake
    tensors' storages have none)."""
    return a.numel() != 0 and b.numel() != 0 and \
        StorageWeakRef(a.untyped_storage()).cdata == StorageWeakRef(b.untyped_storage()).cdata


def _layouts_known(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every size, stride and offset of both is a number (not a symbol of a shape class)."""
    numbers = [*a.shape, *a.stride(), a.storage_offset(), *b.shape, *b.stride(), b.storage_offset()]
    return all(isinstance(n, int) for n in numbers)


def bytes_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The two tensors share a byte of memory (of any element sizes); where a size, stride
    or offset is a symbol, they may."""
    if not in_one_storage(a, b):
        return False
    if not _layouts_known(a, b):
        return True
    from ..analysis import addresses
    return not addresses.disjoint(addresses.bytes_reached(a), addresses.bytes_reached(b))


def partially_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Eager's MemOverlapStatus::Partial: both dense, in one storage, and their byte ranges
    intersect without being the same tensor layout."""
    if not in_one_storage(a, b):
        return False
    if not (is_non_overlapping_and_dense(a) and is_non_overlapping_and_dense(b)):
        return False  # eager's 'too hard': allowed
    a_begin, b_begin = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    a_end, b_end = a_begin + a.numel() * a.element_size(), b_begin + b.numel() * b.element_size()
    if (a_begin, a_end) == (b_begin, b_end):
        return a.stride() != b.stride()
    return a_begin < b_end and b_begin < a_end


# in-place ops that write one number to every element, which eager runs on a tensor whose
# elements share memory (x.expand(4, 5).fill_(1): whichever write lands last, the memory holds
# the number). Not fill_ of a tensor (eager copies it, and refuses), nor masked_fill_ (its
# unmasked elements keep their own values).
WRITES_OF_ONE_CONSTANT = frozenset({"aten.fill_.Scalar", "aten.zero_.default"})


def addressed_once(t: torch.Tensor) -> torch.Tensor:
    """The view of t's memory with each broadcast (stride 0) dimension cut to one element:
    the addresses t holds, each once."""
    if t.numel() == 0 or all(st != 0 or n <= 1 for n, st in zip(t.shape, t.stride())):
        return t
    return t.as_strided([1 if st == 0 else n for n, st in zip(t.shape, t.stride())], t.stride(), t.storage_offset())


def check_in_place(op: str, written: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Raise eager's error when an in-place `op` writing `written` and reading `inputs`
    is one eager refuses; refuse one whose result eager leaves to the order it visits
    elements in (read_after_written)."""
    if has_internal_overlap(written) and op not in WRITES_OF_ONE_CONSTANT:
        raise EagerError(f"{op}: {INTERNAL_OVERLAP}")
    for t in inputs:
        if t is not written and partially_overlaps(written, t):
            raise EagerError(f"{op}: {PARTIAL_OVERLAP}")
        if t is not written and read_after_written(written, t):
            raise UnsupportedOpError(op, "an in-place write whose input reads memory that the op writes earlier in "
                                         "eager's order (`x[::3].add_(x[:43])` reads row 3 after writing it): eager, "
                                         "which finds the case too hard to check, reads the new values there; tjit "
                                         "reads every input before it writes. clone() the input")


# in-place ops whose other tensor arguments eager checks for any overlap with the written
# tensor, the same memory included (ATen's assert_no_overlap: `x.scatter_add_(0, i, x)`,
# `x.index_add_(0, i, x)`, which decomposes to index_put_, raise), not only a partial one
NO_OVERLAP_AT_ALL = frozenset({"scatter_", "scatter_add_", "scatter_reduce_", "index_put_", "_index_put_impl_",
                               "put_", "index_copy_", "index_add_"})


def check_no_overlap_at_all(op, written: torch.Tensor, others: list[torch.Tensor]) -> None:
    """For an op of NO_OVERLAP_AT_ALL: eager's error when one of `others` (its tensor
    arguments other than the written one, which may be the written tensor itself) shares
    memory with it: the same tensor layout, or dense layouts that meet. (Layouts that are not
    dense are eager's 'too hard': allowed.)"""
    if op.overloadpacket.__name__ not in NO_OVERLAP_AT_ALL:
        return
    for t in others:
        same = in_one_storage(written, t) and (t.shape, t.stride(), t.storage_offset()) == \
            (written.shape, written.stride(), written.storage_offset())
        if same or partially_overlaps(written, t):
            raise EagerError(f"{op}: {PARTIAL_OVERLAP}")


def read_after_written(written: torch.Tensor, t: torch.Tensor) -> bool:
    """An input `t` of an elementwise in-place op, in the written tensor's storage, that
    reads an address the op writes before it reads it, when visiting elements in increasing
    address of the written tensor, as eager does (analysis.addresses.read_after_written): the
    case eager's check calls too hard (a layout that is not dense) and allows, whose answer
    differs from reading every input first. Inputs of another element size meeting the
    written bytes at all count too; sizes that are symbols are not checked."""
    if not in_one_storage(written, t):
        return False
    if not _layouts_known(written, t) or t.dim() > written.dim():
        return False
    if t.element_size() != written.element_size():
        return bytes_meet(written, t)
    from ..analysis import addresses
    # the input broadcast to the written shape, as the op reads it
    lead = written.dim() - t.dim()
    strides = [0] * lead + [0 if n == 1 else s for n, s in zip(t.shape, t.stride())]
    read = View(tuple(written.shape), tuple(strides), t.storage_offset())
    return addresses.read_after_written(read, View(tuple(written.shape), tuple(written.stride()),
                                                   written.storage_offset()))


class EagersOverlapChecks(TorchDispatchMode):
    """The checks above on each aten op the traced function calls, before any decomposition
    (entered inside make_fx's modes, around each of the function's calls that may write:
    trace.GradModeWatch): an in-place op
    (`x.addcmul_(x.t(), z)`) or out= op (`torch.logaddexp(a, b, out=view_of_a)`) that torch
    decomposes reaches the converter as a functional op and a copy of its fresh result, whose
    overlap with the inputs no later check can see. Elementwise ops get TensorIterator's
    checks (check_in_place), the indexed writes of NO_OVERLAP_AT_ALL theirs; other ops are
    checked where they are converted (convert.py, out_variants.py)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            _check_call(func, schema, args, kwargs)
        return func(*args, **kwargs)


def _check_call(func, schema, args: tuple, kwargs: dict) -> None:
    values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
    writes = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
    written = [v for v, w in zip(values, writes) if w and isinstance(v, torch.Tensor)]
    if len(written) != 1:
        return
    read = [t for v, w in zip(values, writes) if not w for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
    if torch.Tag.out in func.tags:
        from .out_variants import check_out_overlaps, functional_overload
        functional = functional_overload(func)
        if functional is not None:
            check_out_overlaps(func, functional, written, read)
    elif _pointwise(func):
        check_in_place(str(func), written[0], read)
    check_no_overlap_at_all(func, written[0], read)


def _pointwise(func) -> bool:
    """An elementwise op, or the in-place form of one (heaviside_ has not the tag heaviside has)."""
    if torch.Tag.pointwise in func.tags:
        return True
    name = func.overloadpacket.__name__
    functional = getattr(getattr(torch.ops.aten, name[:-1], None), func._overloadname, None) \
        if name.endswith("_") else None
    return functional is not None and torch.Tag.pointwise in functional.tags

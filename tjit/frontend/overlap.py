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

from ..errors import EagerError

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


def partially_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Eager's MemOverlapStatus::Partial: both dense, in one storage, and their byte ranges
    intersect without being the same tensor layout."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if not (is_non_overlapping_and_dense(a) and is_non_overlapping_and_dense(b)):
        return False  # eager's 'too hard': allowed
    if StorageWeakRef(a.untyped_storage()).cdata != StorageWeakRef(b.untyped_storage()).cdata:
        return False
    a_begin, b_begin = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    a_end, b_end = a_begin + a.numel() * a.element_size(), b_begin + b.numel() * b.element_size()
    if (a_begin, a_end) == (b_begin, b_end):
        return a.stride() != b.stride()
    return a_begin < b_end and b_begin < a_end


def check_in_place(op: str, written: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Raise eager's error when an in-place `op` writing `written` and reading `inputs`
    is one eager refuses."""
    if has_internal_overlap(written):
        raise EagerError(f"{op}: {INTERNAL_OVERLAP}")
    for t in inputs:
        if t is not written and partially_overlaps(written, t):
            raise EagerError(f"{op}: {PARTIAL_OVERLAP}")

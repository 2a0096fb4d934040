"""Exact answers about the memory a view reaches, with integer sets (islpy).

A view is an affine map from its index space to element offsets in its storage,
{ [i0, ..., ik] -> [offset + i0*s0 + ... + ik*sk] : 0 <= id < nd }, and the addresses it
reaches are that map's range. Whether a view reaches an address twice, whether two views of
one storage meet, and where, are questions about these sets that islpy answers exactly for
any strides (negative, zero, overlapping windows), where rules over strides and extents can
only answer conservatively.

Layering (after seed 004, only the parts tjit uses): one isl context per thread (isl objects
are not thread-safe and two contexts' objects never mix); isl objects free themselves when
collected; islpy's operators are the algebra (`a & b` intersects, `a <= b` is a subset).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

from ..ir.view import View

if TYPE_CHECKING:
    import islpy as isl

_local = threading.local()


def context() -> "isl.Context":
    """This thread's isl context: every set built here belongs to it. (islpy is imported on
    first use: most programs never need a set, the extents answer.)"""
    ctx = getattr(_local, "context", None)
    if ctx is None:
        import islpy
        ctx = _local.context = islpy.Context()
    return ctx


def access_map(view: View) -> "isl.Map":
    """{ [i] -> [address] }: each index of the view to the element offset it reaches."""
    import islpy as isl
    indices = [f"i{d}" for d in range(view.ndim)]
    address = " + ".join([str(view.offset)] + [f"{s}*i{d}" for d, s in enumerate(view.strides)])
    bounds = " and ".join(f"0 <= i{d} < {n}" for d, n in enumerate(view.shape)) or "true"
    return isl.Map.read_from_str(context(), f"{{ [{', '.join(indices)}] -> [a] : a = {address} and {bounds} }}")


def addresses(view: View) -> "isl.Set":
    """The element offsets the view reaches."""
    return access_map(view).range()


def overlaps_itself(view: View) -> bool:
    """Two different indices of the view reach one address (an expanded or overlapping-window
    view: writing through it races with itself)."""
    return not access_map(view).is_injective()


def shared_addresses(a: View, b: View) -> "isl.Set":
    """The offsets both views reach (views of one storage, offsets from one base)."""
    return addresses(a) & addresses(b)


def disjoint(a: View, b: View) -> bool:
    """No address is reached by both views."""
    if a.numel == 0 or b.numel == 0:
        return True
    if a == b:
        return False
    (a_low, a_high), (b_low, b_high) = extent(a), extent(b)
    if a_high < b_low or b_high < a_low:  # (the common answers, without building sets)
        return True
    return shared_addresses(a, b).is_empty()


def extent(view: View) -> tuple[int, int]:
    """The lowest and highest address a non-empty view reaches."""
    low = view.offset + sum((n - 1) * s for n, s in zip(view.shape, view.strides) if s < 0)
    high = view.offset + sum((n - 1) * s for n, s in zip(view.shape, view.strides) if s > 0)
    return low, high


def within(inner: View, outer: View) -> bool:
    """Every address `inner` reaches, `outer` reaches too."""
    return addresses(inner) <= addresses(outer)


def meets_only_where_tied(read: View, write: View, tied: Sequence[int]) -> bool:
    """Over one index space (two views of one shape): every read index and write index that
    reach one address agree along the `tied` axes. (Programs that own whole rows, tied along
    the axes they split: no program reads an address another one writes.)"""
    import islpy as isl
    meets = access_map(read).apply_range(access_map(write).reverse())  # { read index -> write index }
    ins, outs = [f"i{d}" for d in range(read.ndim)], [f"j{d}" for d in range(read.ndim)]
    equal = " and ".join(f"i{d} = j{d}" for d in tied) or "true"
    return meets <= isl.Map.read_from_str(context(), f"{{ [{', '.join(ins)}] -> [{', '.join(outs)}] : {equal} }}")


def read_after_written(read: View, write: View) -> bool:
    """Over one index space (an elementwise in-place op: index k reads read(k) and writes
    write(k)), visited in increasing write address, as eager visits it: some index reads an
    address that an index visited before it wrote. (`x[::3].add_(x[:43])`: index 3 reads row
    3, which index 1 wrote; `x[:, :-1].add_(x[:, 1:])` reads each address before it is
    written.)"""
    import islpy as isl
    meets = access_map(read).apply_range(access_map(write).reverse())  # { k -> i : write(i) = read(k) }
    below = isl.Map.read_from_str(context(), "{ [a] -> [b] : b < a }")
    earlier = access_map(write).apply_range(below).apply_range(access_map(write).reverse())  # write(i) < write(k)
    return not (meets & earlier).is_empty()


def tensors_meet(a, b) -> bool:
    """Two torch tensors share a byte of memory (of any dtypes: compared byte by byte)."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return not disjoint(bytes_reached(a), bytes_reached(b))


def bytes_reached(t) -> View:
    """The bytes a tensor reaches, as a view of its storage's bytes."""
    size = t.element_size()
    return View(tuple(t.shape) + (size,), tuple(s * size for s in t.stride()) + (1,), t.storage_offset() * size)


def pairwise_disjoint(views: Sequence[View]) -> bool:
    return all(disjoint(views[i], views[j]) for i in range(len(views)) for j in range(i))

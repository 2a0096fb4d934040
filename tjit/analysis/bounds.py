"""Proofs that a kernel's accesses stay inside the memory they address.

Each access of a generated kernel reaches the addresses of its view over the kernel's
iteration box (along a gathered axis, any coordinate of the table; for a product's operand,
the rows and columns its k loop walks). Those must lie in what the pointer is bound to: an
input's own layout, or the elements of an output or a slab buffer. For a dense target that is
an interval and the view's extent decides it; for a strided input the address sets are
compared exactly (addresses.py). A failure names the access and a counterexample: an index
of the view and the address it reaches.

What this proves is the views' arithmetic (offsets, strides, sizes: where a wrong view
offset reads past a buffer), not the generated text's index and mask code, which is
produced from these views by codegen.
"""
from __future__ import annotations

from typing import Optional

from ..ir.view import View
from .addresses import access_map, addresses, extent


def reached(view: View, gather: Optional[tuple[int, int, int]] = None, offsets_of: Optional[View] = None) -> View:
    """The view whose addresses an access can reach: with a gathered axis (its stride and the
    table's size along it), every coordinate along that axis; for a flat gather (offsets_of:
    the view whose elements' offsets its index holds, in range or masked off), those elements."""
    if offsets_of is not None:
        return View(offsets_of.shape, offsets_of.strides, view.offset + offsets_of.offset)
    if gather is None:
        return view
    stride, size, _ = gather
    return View(view.shape + (size,), view.strides + (stride,), view.offset)


def outside(view: View, allowed: View) -> Optional[str]:
    """None when every address `view` reaches is one `allowed` reaches; otherwise a
    counterexample: an index of the view and the address outside."""
    if view.numel == 0:
        return None
    low, high = extent(view)
    if allowed.numel and allowed.is_dense() and 0 <= low and high < allowed.numel:  # an interval: the extent decides
        return None
    if allowed.numel and addresses(view) <= addresses(allowed):
        return None
    import islpy as isl  # (only to name a counterexample)
    stray = addresses(view) - addresses(allowed) if allowed.numel else addresses(view)
    address = stray.sample_point().get_coordinate_val(isl.dim_type.set, 0).to_python()
    point = access_map(view).intersect_range(isl.Set.read_from_str(stray.get_ctx(), f"{{ [{address}] }}"))
    index = point.domain().sample_point()
    coordinates = [index.get_coordinate_val(isl.dim_type.set, d).to_python() for d in range(view.ndim)]
    return f"index {coordinates} reaches element {address}, outside the {allowed.numel} it may address"

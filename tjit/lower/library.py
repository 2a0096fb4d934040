"""The plan of a library call step (see frontend/library.py): what it reads and writes,
and where its results go.

Its accesses use the kernels' vocabulary (BufferRef, Access), so liveness, donation and
explain see a library call as one more step that reads some buffers and writes others.
An op with an out= form writes its results into memory tjit gives it: the slab (or a
donated input) for the results the steps after it read, memory of their own for the
results the function returns. An op without one allocates its results itself (torch).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..frontend.library import STORAGE_ADDRESSED
from ..ir import ExternCall, GraphNode, Input
from .codegen import Access, BufferRef
from .fusion import ExternStep, buffer_of


@dataclass
class LibraryPlan:
    name: str
    call: ExternCall
    operands: tuple[GraphNode, ...]
    results: list[GraphNode]
    accesses: list[Access]
    # the op's out= overload and its out arguments, one per result, when the call writes
    # into memory tjit gives it (None: torch allocates the results)
    out_form: Optional[torch._ops.OpOverload] = None
    out_names: tuple[str, ...] = ()
    in_slab: tuple[GraphNode, ...] = ()  # the results that live in planned memory
    scratch: list = field(default_factory=list)
    grid: tuple = (0,)
    writes_anything: bool = True

    @property
    def bytes_read(self) -> int:
        return sum(a.view.numel * a.buffer.dtype.itemsize for a in self.accesses if not a.store)

    @property
    def bytes_written(self) -> int:
        return sum(a.view.numel * a.buffer.dtype.itemsize for a in self.accesses if a.store)

    @property
    def torch_allocated(self) -> list[GraphNode]:
        """Results the slab does not hold: allocated per call (by torch, or for out=)."""
        placed = {id(r) for r in self.in_slab}
        return [r for r in self.results if id(r) not in placed]


def plan_library_call(step: ExternStep, returned: frozenset[int] = frozenset()) -> LibraryPlan:
    """returned: ids of the results the function returns as they are (they never live in
    the slab, which the next call reuses)."""
    accesses = []
    for operand in step.operands:
        base = buffer_of(operand)
        ref = BufferRef("input", base.op.name, base.dtype) if isinstance(base.op, Input) else \
            BufferRef("buffer", "", base.dtype, base)
        accesses.append(Access(ref, operand.view, False))
    accesses += [Access(BufferRef("buffer", "", r.dtype, r), r.view, True) for r in step.results]
    name = "tjit_library_" + str(step.call.target).replace(".", "_")
    plan = LibraryPlan(name, step.call, step.operands, step.results, accesses)
    form = writable_out_form(step.call)
    if form is not None:
        plan.out_form, plan.out_names = form
        # one result per call: an op's out= code may take another path when its results
        # share a storage, as slab buffers do (linalg_qr.out fails an internal assert)
        placeable = [r for r in step.results if id(r) not in returned and r.view.is_dense()]
        plan.in_slab = (max(placeable, key=lambda r: r.view.numel * r.dtype.itemsize),) if placeable else ()
    return plan


def writable_out_form(call: ExternCall) -> Optional[tuple[torch._ops.OpOverload, tuple[str, ...]]]:
    """The call's out= overload, where tjit can hand it every result's memory: an op that
    writes no operand in place, draws no seeded numbers, addresses no storage directly and
    returns tensors whose sizes tracing fixed (each has its node). (A derivative run as one
    call, autograd/library_grad.py's ExternGradient, is no aten op: it has none.)"""
    if not isinstance(call.target, torch._ops.OpOverload) or call.writes or call.seed is not None \
            or call.target in STORAGE_ADDRESSED:
        return None
    form = out_overload(call.target)
    if form is None or sorted(call.results) != list(range(len(form[1]))):
        return None
    return form


@functools.cache
def out_overload(target: torch._ops.OpOverload) -> Optional[tuple[torch._ops.OpOverload, tuple[str, ...]]]:
    """The overload of the same op that takes the functional one's arguments plus one
    keyword-only out tensor per returned tensor (mm -> mm.out, sort.stable ->
    sort.values_stable, max.dim -> max.dim_max), with the out arguments' names."""
    schema = target._schema
    returns = schema.returns
    if not returns or any(str(r.type) != "Tensor" or r.alias_info is not None for r in returns):
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    packet = getattr(torch.ops.aten, schema.name.split("::")[-1], None) if schema.name.startswith("aten::") else None
    for overload in packet.overloads() if packet is not None else ():
        candidate = getattr(packet, overload)
        args = candidate._schema.arguments
        outs = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
        rest = [(a.name, str(a.type)) for a in args if a.alias_info is None or not a.alias_info.is_write]
        if rest == wanted and len(outs) == len(returns) and all(a.kwarg_only and str(a.type) == "Tensor" for a in outs):
            return candidate, tuple(a.name for a in outs)
    return None

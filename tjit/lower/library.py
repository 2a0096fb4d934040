"""The plan of a library call step (see frontend/library.py): what it reads and writes.

Its accesses use the kernels' vocabulary (BufferRef, Access), so liveness, donation and
explain see a library call as one more step that reads some buffers and writes others.
Its results are allocated by torch when the op runs, not in the slab.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import ExternCall, GraphNode, Input
from .codegen import Access, BufferRef, Check
from .fusion import ExternStep, buffer_of


@dataclass
class LibraryPlan:
    name: str
    call: ExternCall
    operands: tuple[GraphNode, ...]
    results: list[GraphNode]
    accesses: list[Access]
    scratch: list = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    grid: tuple = (0,)
    writes_anything: bool = True

    @property
    def bytes_read(self) -> int:
        return sum(a.view.numel * a.buffer.dtype.itemsize for a in self.accesses if not a.store)

    @property
    def bytes_written(self) -> int:
        return sum(a.view.numel * a.buffer.dtype.itemsize for a in self.accesses if a.store)


def plan_library_call(step: ExternStep) -> LibraryPlan:
    accesses = []
    for operand in step.operands:
        base = buffer_of(operand)
        ref = BufferRef("input", base.op.name, base.dtype) if isinstance(base.op, Input) else \
            BufferRef("buffer", "", base.dtype, base)
        accesses.append(Access(ref, operand.view, False))
    accesses += [Access(BufferRef("buffer", "", r.dtype, r), r.view, True) for r in step.results]
    name = "tjit_library_" + str(step.call.target).replace(".", "_")
    return LibraryPlan(name, step.call, step.operands, step.results, accesses)

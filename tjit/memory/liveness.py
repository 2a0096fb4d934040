"""Which buffers live in the slab, and when: liveness over the kernel launch order.

Storage classes (seed 002): TRANSIENT values (materialised intermediates and the partials of
grid reductions) live in the slab, at offsets reused by liveness; PERSISTENT values (the
caller's inputs and the function's constants) are bound in place and never copied; graph
outputs escape (the caller keeps them), so they are allocated per call and never live in the
slab. STATE (tensors saved for backward) arrives with autograd.

A buffer is born at the step of the kernel that writes it and dies after the last kernel
that reads it: its interval is [first, end) over launch steps. Sizes are rounded up to the
slab's alignment; a zero-size buffer takes no room.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import DType
from .planner import DEFAULT_ALIGNMENT, MemoryPlan, make_plan


PLAN_BUDGET_S = 0.02


@dataclass(frozen=True)
class SlabBuffer:
    key: tuple  # how the executor names it: ("buffer", id(node)) or ("scratch", step, name)
    name: str
    shape: tuple[int, ...]
    dtype: DType
    first: int  # launch step that writes it
    end: int  # one past the last step that reads it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def interval(self) -> tuple[int, int, int]:
        padded = -(-self.nbytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
        return padded, self.first, self.end


def transient_buffers(plans, torch_allocated: frozenset[int] = frozenset()
                      ) -> tuple[list[SlabBuffer], dict[tuple, tuple]]:
    """The slab's buffers for the steps run in the order of `plans` (KernelPlans, and
    LibraryPlans, which read and write buffers too), and the buffers that live in another's
    memory (key -> that buffer's key: accumulated_in_place). torch_allocated: ids of the
    library calls' results that the slab does not hold (a call without an out= form
    allocates its own)."""
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    info: dict[tuple, tuple] = {}
    for step, plan in enumerate(plans):
        for access in plan.accesses:
            ref = access.buffer
            if ref.kind != "buffer" or id(ref.node) in torch_allocated:
                continue  # inputs are bound in place
            key = ("buffer", id(ref.node))
            if access.store or key not in info:  # named after the kernel that writes it
                info[key] = (f"{ref.name}@{plan.name[5:]}", ref.node.shape, ref.dtype)
            if access.store:
                first.setdefault(key, step)
            last[key] = max(last.get(key, step), step)
        for ref in plan.scratch:
            key = ("scratch", step, ref.name)
            info[key] = (f"{ref.name}@{plan.name[5:]}", (plan.grid[0],), ref.dtype)
            first[key], last[key] = step, step
    aliases = accumulated_in_place(plans, info, last)
    return [SlabBuffer(key, *info[key], first.get(key, last[key]), last[key] + 1)
            for key in info if key not in aliases], aliases


ACCUMULATING = frozenset({"aten.addmm.default"})  # out = self + mat1 @ mat2, whose out may be self


def accumulated_in_place(plans, info: dict[tuple, tuple], last: dict[tuple, int]) -> dict[tuple, tuple]:
    """A running total that library calls accumulate (a recurrent weight's gradient: addmm
    of each step's contribution into the total of the steps before) is written into the
    memory of the total it reads, when that read is its last: one buffer for the chain,
    rather than two overlapping ones per call (eager's autograd adds each contribution into
    the gradient in place too). Result key -> the key of the buffer whose memory it takes
    (the chain's first); `last` then extends that buffer to the chain's last reader."""
    aliases: dict[tuple, tuple] = {}
    for step, plan in enumerate(plans):
        if getattr(plan, "call", None) is None or plan.call.name not in ACCUMULATING or not plan.in_slab:
            continue
        total, result = plan.operands[0], plan.in_slab[0]
        key, into = ("buffer", id(result)), ("buffer", id(total))
        read_again = any(a.buffer.node is total for a in plan.accesses[1:] if not a.store)
        if into not in info or key not in info or last[into] != step or read_again \
                or (total.shape, total.dtype, total.view) != (result.shape, result.dtype, result.view):
            continue
        root = aliases.get(into, into)
        aliases[key] = root
        last[root] = max(last[root], last[key])
    return aliases


def plan_memory(plans, torch_allocated: frozenset[int] = frozenset()
                ) -> tuple[MemoryPlan, list[SlabBuffer], dict[tuple, tuple]]:
    """Offsets of every transient buffer in one slab (see tjit.memory.plan_offsets), and the
    buffers that live in another's memory (see transient_buffers)."""
    buffers, aliases = transient_buffers(plans, torch_allocated)
    return plan_slab(buffers), buffers, aliases


def plan_slab(buffers: list[SlabBuffer]) -> MemoryPlan:
    """A checked slab plan for these buffers."""
    # a compile should stay fast: most graphs hit the lower bound at once, the rest get a
    # short search (the planner always keeps the best of its baselines)
    plan = make_plan([b.interval for b in buffers], [b.name for b in buffers], time_budget_s=PLAN_BUDGET_S)
    plan.check()  # a plan that overlaps two live buffers would be silently wrong: never ship one
    return plan

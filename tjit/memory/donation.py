"""Donated inputs: the caller gives up a tensor, and its memory hosts intermediates.

`tjit.compile(fn, donate=("x",))` promises that the caller will not use x after the call.
A buffer born after the last kernel that reads x can then live in x's memory instead of
the slab (first fit, by birth). After the call x becomes a DonatedTensor: every torch
operation on it raises, instead of reading what the kernels left in its memory. (Views of
x taken before the call are given up with it; their contents are undefined.) The memory
itself goes back when the caller drops x.
"""
from __future__ import annotations

import torch

from .liveness import SlabBuffer
from .planner import DEFAULT_ALIGNMENT


class DonatedTensor(torch.Tensor):
    """What a donated tensor becomes after the call: unusable, with a message saying why."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(f"{name}: this tensor was donated to a tjit compiled function (donate=...) and its "
                           "memory has been reused; it cannot be used any more")


def give_up(t: torch.Tensor) -> None:
    t.__class__ = DonatedTensor


def last_read_step(plans, name: str) -> int:
    """The launch step of the last kernel that reads input `name` (-1: none does)."""
    last = -1
    for step, plan in enumerate(plans):
        if any(a.buffer.kind == "input" and a.buffer.name == name and not a.store for a in plan.accesses):
            last = step
    return last


def place_in_donated(buffers: list[SlabBuffer], free_from: int, capacity: int) -> dict[tuple, int]:
    """Byte offsets inside a donated region of `capacity` bytes, free from step `free_from`,
    for the buffers that fit there (first fit by birth; no two overlap in time and bytes)."""
    placed: dict[tuple, int] = {}
    taken: list[tuple[int, int, int, int]] = []  # (offset, end, first, last step + 1)
    for b in sorted(buffers, key=lambda b: (b.first, -b.nbytes)):
        size = b.interval[0]
        if b.first < free_from or size == 0 or size > capacity:
            continue
        offset = 0
        for lo, hi, first, end in sorted(t for t in taken if t[2] < b.end and b.first < t[3]):
            if offset + size <= lo:
                break
            offset = max(offset, -(-hi // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT)
        if offset + size <= capacity:
            placed[b.key] = offset
            taken.append((offset, offset + size, b.first, b.end))
    return placed

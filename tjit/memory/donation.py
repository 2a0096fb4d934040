"""Donated inputs: the caller gives up a tensor, and its memory hosts intermediates.

`tjit.compile(fn, donate=("x",))` promises that the caller will not use x after the call.
A buffer born after the last kernel that reads x can then live in x's memory instead of
the slab (first fit, by birth). After the call x becomes a DonatedTensor: every torch
operation on it raises, instead of reading what the kernels left in its memory. (Views of
x taken before the call are given up with it; their contents are undefined.) The memory
itself goes back when the caller drops x.

A backward that runs once gives up the values the forward saved for it the same way: the
buffers it makes after it has read a saved value may live in that value's tape block
(place_in_regions with freed_when_read, pipeline.with_tape_donated).
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


def place_in_regions(buffers: list[SlabBuffer], regions: dict, freed_when_read: bool = False
                     ) -> dict[object, dict[tuple, int]]:
    """Region -> {buffer key: byte offset} for the buffers that fit in donated regions
    (region -> (step it is free from, capacity in bytes)), by birth, each in the smallest
    region where it fits then. freed_when_read: each region is freed once it is no longer
    needed (a saved value's tape block, after its last read), so hosting a buffer holds it
    until the buffer dies: a buffer then goes only where it keeps its region no longer than
    the region is held already, or fills at least half of it (a small buffer that lives long
    would hold a large block for little)."""
    placed: dict[object, dict[tuple, int]] = {}
    taken: dict[object, list[tuple[int, int, int, int]]] = {r: [] for r in regions}  # (offset, end, first, end step)
    held_until = {region: free_from for region, (free_from, _) in regions.items()}
    for b in sorted(buffers, key=lambda b: (b.first, -b.nbytes)):
        size = b.interval[0]
        if size == 0:
            continue
        fits = [(capacity, region, offset) for region, (free_from, capacity) in regions.items()
                if b.first >= free_from and (not freed_when_read or b.end <= held_until[region] or 2 * size >= capacity)
                and (offset := _first_fit(taken[region], b, size)) + size <= capacity]
        if fits:
            _, region, offset = min(fits, key=lambda fit: fit[0])
            placed.setdefault(region, {})[b.key] = offset
            taken[region].append((offset, offset + size, b.first, b.end))
            held_until[region] = max(held_until[region], b.end)
    return placed


def _first_fit(taken: list[tuple[int, int, int, int]], b: SlabBuffer, size: int) -> int:
    """The lowest aligned offset where b fits beside what is taken during its lifetime."""
    offset = 0
    for lo, hi, first, end in sorted(t for t in taken if t[2] < b.end and b.first < t[3]):
        if offset + size <= lo:
            break
        offset = max(offset, -(-hi // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT)
    return offset

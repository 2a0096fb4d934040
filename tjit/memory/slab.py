"""Slabs: one block of device memory per compiled graph, device and calling thread.

A slab is allocated on a graph's first call on that device and thread and kept: every
later call binds its intermediates to the same planned offsets, so a steady-state call
makes no allocator call for them. Two threads never share a slab (each has its own), so
they can call one compiled function at once. With TJIT_PREALLOCATE_MB, slabs are carved
from one reservation made up front per device; `release()` gives everything back (the
next call allocates again). `stats()` reports the pool, after seed 001's statistics API.
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

SLAB_ALIGNMENT = 256  # slabs carved from a reservation start at multiples of this


@dataclass
class Slab:
    memory: torch.Tensor  # uint8
    views: dict = field(default_factory=dict)  # buffer key -> typed view at its offset


class SlabPool:
    def __init__(self):
        self._lock = threading.Lock()
        self._owners: "weakref.WeakSet" = weakref.WeakSet()  # objects holding slabs (Executables)
        self._reserved: dict[torch.device, list] = {}  # device -> [reservation, bytes used]
        self.allocations = 0
        self.reuse_hits = 0

    def allocate(self, nbytes: int, device: torch.device, owner) -> torch.Tensor:
        """A new slab of nbytes (from the reservation when one is made and has room)."""
        with self._lock:
            self._owners.add(owner)
            self.allocations += 1
            carved = self._carve(nbytes, torch.device(device))
        return carved if carved is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _carve(self, nbytes: int, device: torch.device):
        if device not in self._reserved:
            mb = float(os.environ.get("TJIT_PREALLOCATE_MB", "0") or 0)
            if mb <= 0:
                return None
            self._reserved[device] = [torch.empty(int(mb * 2**20), dtype=torch.uint8, device=device), 0]
        reservation, used = self._reserved[device]
        start = -(-used // SLAB_ALIGNMENT) * SLAB_ALIGNMENT
        if start + nbytes > reservation.numel():
            return None
        self._reserved[device][1] = start + nbytes
        return reservation[start:start + nbytes]

    def register(self, owner) -> None:
        """An object that holds memory between calls without a slab (status words)."""
        with self._lock:
            self._owners.add(owner)

    def note_reuse(self) -> None:
        self.reuse_hits += 1

    def stats(self) -> dict:
        slabs = [s for owner in list(self._owners) for s in owner.slabs()]
        in_use = sum(s.memory.numel() for s in slabs)
        reserved = sum(r.numel() for r, _ in self._reserved.values())
        own = sum(s.memory.numel() for s in slabs if not any(_inside(s.memory, r) for r, _ in self._reserved.values()))
        words = sum(owner.words_bytes() for owner in list(self._owners))
        return {"reserved_bytes": reserved + own, "slab_count": len(slabs), "in_use_bytes": in_use,
                "allocations": self.allocations, "reuse_hits": self.reuse_hits, "status_bytes": words}

    def release(self) -> None:
        with self._lock:
            for owner in list(self._owners):
                owner.release_slabs()
            self._reserved.clear()


def _inside(t: torch.Tensor, reservation: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == reservation.untyped_storage().data_ptr()


POOL = SlabPool()


def stats() -> dict:
    """reserved_bytes (slabs and reservations held), slab_count, in_use_bytes (bytes of live
    slabs), allocations (slabs allocated since start), reuse_hits (calls that reused one),
    status_bytes (the status and counter words compiled functions keep, per launch),
    and tape_bytes / tape_blocks: values saved for backward that an autograd graph still
    holds (zero once backward has run, or the outputs were dropped)."""
    from ..autograd import tape
    found = POOL.stats()
    found["tape_bytes"], found["tape_blocks"] = tape.live_bytes()
    return found


def release() -> None:
    """Give back every slab and reservation; the next call of a compiled function allocates
    its slab again."""
    POOL.release()

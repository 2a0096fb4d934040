"""Slabs: one block of device memory per device and calling thread, shared by the compiled
graphs that thread runs.

Every compiled graph (a function's forward, its backward, each graph of a model) plans its
intermediates as offsets in a slab of its own size. Runs on one thread never overlap, and
nothing in a slab outlives the run that wrote it, so the graphs a thread runs share one
block, the arena, as large as the largest slab among them: a training step holds
max(forward, backward) between calls, not their sum. The arena is allocated on the first
run on that device and thread and kept: a later run binds its intermediates to the same
offsets (its typed views into the arena are made once), so a steady-state call makes no
allocator call for them. A graph with a larger slab grows the arena (a new block; the
graphs holding views into the old one make them again); when the graphs that needed the
largest slab are gone, the arena is let go of and the next run allocates it again at the
size the remaining graphs need. A run that starts while another holds its thread's arena
(a library call that runs a compiled function inside a run) gets a slab of its own for that
run. Two threads never share an arena, so they can call one compiled function at once.
With TJIT_PREALLOCATE_MB, arenas are carved from one reservation made up front per device;
`release()` gives everything back (the next call allocates again). `stats()` reports the
pool, after seed 001's statistics API.
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

SLAB_ALIGNMENT = 256  # slabs carved from a reservation start at multiples of this


@dataclass
class Slab:
    """A graph's slab: `memory`, its bytes (the start of its thread's arena, or a block of
    its own), and its buffers' typed views there."""
    memory: torch.Tensor  # uint8
    views: dict = field(default_factory=dict)  # buffer key -> typed view at its offset
    arena: Optional["Arena"] = None  # None: memory of its own, for one nested run


@dataclass(eq=False)
class Arena:
    memory: torch.Tensor  # uint8
    busy: bool = False  # a run holds it


class SlabPool:
    def __init__(self):
        # reentrant: an owner's finalizer (which shrinks its arena) may run inside the pool's own
        # code, whenever the garbage collector does
        self._lock = threading.RLock()
        self._owners: "weakref.WeakSet" = weakref.WeakSet()  # objects holding views or status words (Executables)
        self._arenas: dict[tuple, Arena] = {}  # (device, thread id) -> its arena
        # (device, thread id) -> owner -> the slab size it needs there: an arena larger than all
        # the live owners need is let go of
        self._needs: dict[tuple, "weakref.WeakKeyDictionary"] = {}
        self._reserved: dict[torch.device, list] = {}  # device -> [reservation, bytes used]
        self.allocations = 0
        self.reuse_hits = 0

    def acquire(self, nbytes: int, device, owner) -> Optional[Arena]:
        """This thread's arena on `device`, grown to at least nbytes, held by the caller's run
        until `done`; None when a run on this thread holds it already."""
        key = (torch.device(device), threading.get_ident())
        with self._lock:
            self._owners.add(owner)
            needs = self._needs.setdefault(key, weakref.WeakKeyDictionary())
            if owner not in needs:
                weakref.finalize(owner, self._shrink, key)
            needs[owner] = nbytes
            arena = self._arenas.get(key)
            if arena is not None and arena.busy:
                return None
            if arena is None or arena.memory.numel() < nbytes:
                if arena is not None:  # grown: nobody may keep the old block alive through its views
                    for other in list(self._owners):
                        other.forget_slab(key)
                arena = self._arenas[key] = Arena(self._new(nbytes, key[0]))
                self.allocations += 1
            else:
                self.reuse_hits += 1
            arena.busy = True
            return arena

    @staticmethod
    def done(arena: Arena) -> None:
        arena.busy = False

    def withdraw(self, owner) -> None:
        """An owner that stops running (a form of a graph that another form replaced): it
        needs no slab now, so an arena larger than the other owners need is let go of (a
        later run of it acquires one again)."""
        with self._lock:
            keys = [key for key, needs in self._needs.items() if needs.pop(owner, None) is not None]
        owner.forget_slab(None)
        for key in keys:
            self._shrink(key)

    def _shrink(self, key) -> None:
        """A graph that ran on this thread is gone: let go of the arena if it is larger than
        the graphs left need (the next run allocates what they need)."""
        with self._lock:
            arena = self._arenas.get(key)
            needs = self._needs.get(key, {})
            if arena is not None and not arena.busy and arena.memory.numel() > max(needs.values(), default=0):
                for other in list(self._owners):
                    other.forget_slab(key)
                del self._arenas[key]

    def _new(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A new block of nbytes (from the reservation when one is made and has room)."""
        carved = self._carve(nbytes, device)
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

    def stats(self) -> dict:
        arenas = [a.memory for a in list(self._arenas.values())]
        in_use = sum(m.numel() for m in arenas)
        reserved = sum(r.numel() for r, _ in self._reserved.values())
        own = sum(m.numel() for m in arenas if not any(_inside(m, r) for r, _ in self._reserved.values()))
        words = sum(owner.words_bytes() for owner in list(self._owners))
        return {"reserved_bytes": reserved + own, "slab_count": len(arenas), "in_use_bytes": in_use,
                "allocations": self.allocations, "reuse_hits": self.reuse_hits, "status_bytes": words}

    def release(self) -> None:
        with self._lock:
            for owner in list(self._owners):
                owner.forget_slab(None)
            self._arenas.clear()
            self._reserved.clear()
            # the graphs that ran need nothing now: each states its need again when it runs (an
            # arena a later run makes is then sized, and let go of, by the graphs running since)
            self._needs.clear()


def _inside(t: torch.Tensor, reservation: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == reservation.untyped_storage().data_ptr()


POOL = SlabPool()


def stats() -> dict:
    """reserved_bytes (arenas and reservations held), slab_count (arenas: one per device and
    thread that ran a compiled graph), in_use_bytes (bytes of the arenas), allocations
    (arenas allocated or grown since start), reuse_hits (runs that reused one),
    status_bytes (the status and counter words compiled functions keep, per launch),
    and tape_bytes / tape_blocks: values saved for backward that an autograd graph still
    holds (zero once backward has run, or the outputs were dropped)."""
    from ..autograd import tape
    found = POOL.stats()
    found["tape_bytes"], found["tape_blocks"] = tape.live_bytes()
    return found


def release() -> None:
    """Give back every arena and reservation; the next call of a compiled function allocates
    its thread's arena again."""
    POOL.release()

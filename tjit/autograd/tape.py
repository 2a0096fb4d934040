"""The tape: memory that holds values the forward saved for backward.

Seed 001's hybrid cleanup, on torch's autograd: plain intermediates live in the reusable
slab and are dead once their last kernel has run (the planner decides that statically);
each value saved for backward gets a block of its own per call (allocated right before the
kernel that writes it), handed to torch as a saved tensor, so a backward that runs once can
free each as soon as it has read it. Torch frees saved tensors as soon as backward has consumed them (unless
retain_graph), or with the autograd graph when the outputs are dropped without backward,
so the block lives exactly as long as backward may need it. The tape tracks the blocks
only weakly, to report how many bytes are held.
"""
from __future__ import annotations

import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_lock = threading.Lock()
_blocks: list[tuple[StorageWeakRef, int]] = []


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A new tape block (uint8) for a saved value."""
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    with _lock:
        _prune()
        _blocks.append((StorageWeakRef(block.untyped_storage()), nbytes))
    return block


def live_bytes() -> tuple[int, int]:
    """(bytes, blocks) of tape memory still held by some autograd graph."""
    with _lock:
        _prune()
        return sum(n for _, n in _blocks), len(_blocks)


def _prune() -> None:
    _blocks[:] = [(ref, n) for ref, n in _blocks if not ref.expired()]

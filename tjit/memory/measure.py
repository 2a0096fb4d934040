"""Measuring what a piece of code allocates: the peak of its allocations, by the allocator.

`measure_peak(device)` is a context manager; on leaving it, `.peak` is the most bytes that
allocations made inside it held at once, counted by the device's allocator:
`torch.cuda.max_memory_allocated` against the bytes allocated on entry on a GPU (the caching
allocator's block sizes), and on the CPU every allocation and release the CPU allocator
reports to torch's profiler (`profile_memory=True`), folded in order. Memory allocated before
(inputs, parameters, slabs already held) is not counted; memory it frees is counted as freed
on a GPU (the allocator's total drops), and left out on the CPU (the profiler knows the size
of blocks allocated while it runs only): measure code that frees only what it allocates.

This is what `tjit.explain(...).peak_memory` predicts, measured: the tests compare them.
"""
from __future__ import annotations

from typing import Optional

import torch


class measure_peak:
    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak: Optional[int] = None
        self.allocations = 0  # how many allocations were made inside (CPU only: the profiler's count)
        self._profile = None

    def __enter__(self) -> "measure_peak":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile
            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        self._profile.__exit__(*exc)
        self.peak, self.allocations = _fold(_allocation_events(self._profile))


def _allocation_events(prof) -> list[tuple[int, int, int]]:
    """(time, bytes, address) of every CPU allocation (bytes > 0) and release (< 0) the
    profiler saw, in the order they happened."""
    from torch._C._profiler import _EventType
    found = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            found.append((event.start_time_ns, fields.alloc_size, fields.ptr))
    return sorted(found)


def _fold(events) -> tuple[int, int]:
    """The peak of live bytes over allocations made in the window (a release of a block
    allocated before the window, whose size the profiler does not know, is left out)."""
    live: dict[int, int] = {}
    current = peak = count = 0
    for _, nbytes, address in events:
        if nbytes > 0:
            live[address] = nbytes
            current += nbytes
            count += 1
            peak = max(peak, current)
        elif address in live:
            current -= live.pop(address)
    return peak, count

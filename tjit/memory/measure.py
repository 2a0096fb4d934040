"""Measuring what a piece of code allocates: the peak of its allocations, by the allocator.

`measure_peak(device)` is a context manager; on leaving it, `.peak` is the most bytes that
allocations made inside it held at once, counted by the device's allocator:
`torch.cuda.max_memory_allocated` against the bytes allocated on entry on a GPU (the caching
allocator's block sizes), and on the CPU every allocation and release the CPU allocator
reports to torch's profiler (`profile_memory=True`), folded in order. Memory allocated before
(inputs, parameters, slabs already held) is not counted; memory it frees is counted as freed
on a GPU (the allocator's total drops), and left out on the CPU (the profiler knows the size
of blocks allocated while it runs only): measure code that frees only what it allocates.
On the CPU, `.planned_peak` is the peak without the memory an aten op allocates and frees
before it returns (a flash attention's workspace): what a plan can see, and predicts.

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
        self.planned_peak: Optional[int] = None  # (CPU only) the peak without aten ops' own workspace
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
        events = _allocation_events(self._profile)
        self.peak, self.allocations = _fold(events)
        self.planned_peak = _fold([e for e in events if not e[3]])[0]


def _allocation_events(prof) -> list[tuple[int, int, int, bool]]:
    """(time, bytes, address, inside one op) of every CPU allocation (bytes > 0) and release
    (< 0) the profiler saw, in the order they happened; `inside one op`: the block was
    released before the outermost aten op that allocated it returned (the op's workspace),
    and so was its release."""
    from torch._C._profiler import _EventType
    found = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            op_end = _outermost_op_end(event) if fields.alloc_size > 0 else None  # (a release's is not needed)
            found.append((event.start_time_ns, fields.alloc_size, fields.ptr, op_end))
    found.sort(key=lambda e: e[:3])
    workspace, open_blocks = set(), {}  # indices of workspace events; address -> its allocation's index
    for k, (time, nbytes, address, _) in enumerate(found):
        if nbytes > 0:
            open_blocks[address] = k
        elif address in open_blocks:
            start = open_blocks.pop(address)
            if found[start][3] is not None and time <= found[start][3]:
                workspace.update((start, k))
    return [(time, nbytes, address, k in workspace) for k, (time, nbytes, address, _) in enumerate(found)]


def _outermost_op_end(event) -> Optional[int]:
    """When the outermost aten op around an allocation returned (None outside any)."""
    end, parent = None, event.parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            end = parent.end_time_ns
        parent = parent.parent
    return end


def _fold(events) -> tuple[int, int]:
    """The peak of live bytes over allocations made in the window (a release of a block
    allocated before the window, whose size the profiler does not know, is left out)."""
    live: dict[int, int] = {}
    current = peak = count = 0
    for _, nbytes, address, *_ in events:
        if nbytes > 0:
            live[address] = nbytes
            current += nbytes
            count += 1
            peak = max(peak, current)
        elif address in live:
            current -= live.pop(address)
    return peak, count

"""Peak memory, predicted from the plan: what a call (or a training step) allocates, in order.

The runtime's allocations are all decided at compile time: a call allocates its tape block
when it starts and each output right before the step that first writes it; its library
calls allocate the results the slab does not hold (and copy some operands) at their step,
and it lets go of each such result after its last reader. Autograd adds the incoming
gradient and the backward's own call, which frees each saved value after its last reader.
Each of those is an `Allocation` event here (the code that allocates says what it allocates:
Executable.allocations, library.call_allocations, GradExecutable.training_step_memory);
folding them in order gives the most bytes alive at once.

What is counted: memory tjit keeps between calls (`held`: the arena that holds the slabs, and
the per-launch status and counter words) plus everything a call allocates and has not released yet: outputs,
gradients handed back, the tape (values saved for backward), library calls' results and the
operand copies they make, the incoming gradient of `loss.backward()`. What is not: inputs and
parameters (alive before the call), and memory an aten op allocates and frees inside itself
(a convolution's workspace), which no plan sees.

Sizes are what the allocator counts: the exact bytes on the CPU, whole 512-byte blocks in
CUDA's caching allocator (what `torch.cuda.max_memory_allocated` adds up).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

CUDA_BLOCK = 512  # the caching allocator rounds every allocation up to a multiple of this


def allocated_bytes(nbytes: int, device_type: str) -> int:
    """What the device's allocator counts for a tensor of nbytes (0 allocates nothing)."""
    if nbytes <= 0:
        return 0
    if device_type == "cuda":
        return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
    return nbytes


def strided_bytes(shape, stride, itemsize: int) -> int:
    """Bytes of the storage torch.empty_strided(shape, stride) allocates."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))) * itemsize


@dataclass(frozen=True)
class Allocation:
    """One allocation (bytes > 0) or the release of an earlier one (bytes < 0, same key)."""
    key: object  # names the block: a release carries its allocation's key
    bytes: int
    kind: str  # what it is: "output", "tape", "library result", "gradient", ...
    what: str  # which one, for the text: "output out0", "aten.mm result 0"
    where: str  # when: "forward start", "forward step 3 (aten.mm.default)", ...


def release(allocations: Iterable[Allocation], where: str) -> list[Allocation]:
    return [Allocation(a.key, -a.bytes, a.kind, a.what, where) for a in allocations if a.bytes > 0]


def relabel(events: list[Allocation], keys: set, kind: str) -> list[Allocation]:
    """The events with the blocks of these keys counted as `kind`."""
    return [replace(e, kind=kind) if e.key in keys else e for e in events]


@dataclass
class PeakMemory:
    """The predicted peak of a call or training step (see the module text)."""
    held: dict[str, int]  # memory kept between calls: slabs, status words
    events: list[Allocation]  # the call's allocations and releases, in order
    device_type: str = "cpu"
    what: str = "call"  # "call" or "training step" (forward + backward of dense gradients)
    peak: int = 0  # held + the most bytes the events hold at once
    at: str = ""  # where that is first reached
    alive_at_peak: dict[str, int] = field(default_factory=dict)  # kind -> bytes alive then (held included)

    def __post_init__(self):
        live: dict[object, Allocation] = {}
        current = best = 0
        best_live: dict[object, Allocation] = {}
        for event in self.events:
            if event.bytes > 0:
                live[event.key] = event
                current += event.bytes
                if current > best:
                    best, best_live, self.at = current, dict(live), event.where
            elif event.key in live:
                current -= live.pop(event.key).bytes
        self.peak = sum(self.held.values()) + best
        alive: dict[str, int] = dict(self.held)
        for event in best_live.values():
            alive[event.kind] = alive.get(event.kind, 0) + event.bytes
        self.alive_at_peak = {k: v for k, v in alive.items() if v}
        if not self.at:
            self.at = "between calls (the call allocates nothing)"

    @property
    def per_call(self) -> int:
        """The peak without the memory held between calls."""
        return self.peak - sum(self.held.values())

    def __str__(self) -> str:
        lines = [f"peak memory of a {self.what}: {self.peak} B, reached at {self.at}",
                 "  held between calls: " + (", ".join(f"{k} {v} B" for k, v in self.held.items() if v) or "nothing"),
                 "  alive at the peak: " + ", ".join(f"{k} {v} B" for k, v in self.alive_at_peak.items())]
        if self.device_type == "cuda":
            lines.append(f"  (sizes in the caching allocator's {CUDA_BLOCK}-byte blocks)")
        return "\n".join(lines)


def describe_events(events: list[Allocation], limit: Optional[int] = None) -> str:
    """The events as lines (for debugging and explain's verbose form)."""
    rows = [f"  {'+' if e.bytes > 0 else '-'}{abs(e.bytes):>10d} B  {e.kind:<18s} {e.what}  ({e.where})"
            for e in events[:limit]]
    return "\n".join(rows)

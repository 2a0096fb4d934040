"""Process-wide counters that make caching behaviour observable (and testable)."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, fields


@dataclass
class Counters:
    traces: int = 0  # a function traced (make_fx) and lowered (a cache miss)
    specialised: int = 0  # a cache miss lowered from its shape class's symbolic trace, not traced
    # a trace with number arguments as literals, made once per shape class to check the one with
    # them as runtime numbers (frontend/number_check.py); not converted or lowered, not in traces
    number_checks: int = 0
    cache_hits: int = 0  # a call served by an existing trace
    disk_loads: int = 0  # a cache miss served by an entry an earlier process stored (runtime/disk_cache.py)
    kernels_generated: int = 0  # distinct kernel sources loaded
    kernel_compiles: int = 0  # distinct (kernel source, constexprs) launched: one Triton build each
    launches: int = 0  # Triton kernels launched
    library_calls: int = 0  # aten ops run as library calls (see tjit/frontend/library.py)
    # wall seconds spent compiling (compiling()): tracing, planning, lowering, loading kernels;
    # what a first call costs beyond its kernels' run, measured without them
    compile_seconds: float = 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def snapshot(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


counters = Counters()


_phase = threading.local()
_clock = time.perf_counter


@contextlib.contextmanager
def compiling():
    """Times a compile phase into counters.compile_seconds. A phase inside another (a
    backward's kernels loaded while it compiles) is counted once, in the outermost."""
    depth = getattr(_phase, "depth", 0)
    _phase.depth = depth + 1
    start = _clock() if depth == 0 else None
    try:
        yield
    finally:
        _phase.depth = depth
        if start is not None:
            counters.compile_seconds += _clock() - start

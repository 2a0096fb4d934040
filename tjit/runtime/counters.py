"""Process-wide counters that make caching behaviour observable (and testable)."""
from __future__ import annotations

import contextlib
import gc
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
    """Times a compile phase into counters.compile_seconds, with the cyclic garbage collector
    paused (collection_paused). A phase inside another (a backward's kernels loaded while it
    compiles) is counted once, in the outermost."""
    depth = getattr(_phase, "depth", 0)
    if depth:
        _phase.depth = depth + 1
        try:
            yield
        finally:
            _phase.depth = depth
        return
    _phase.depth = 1
    start = _clock()
    try:
        with collection_paused():
            yield
    finally:
        _phase.depth = 0
        counters.compile_seconds += _clock() - start


_pausing = 0  # threads inside collection_paused
_paused_gc = False  # whether collection_paused turned the collector off (and so turns it on)
_pause_lock = threading.Lock()


@contextlib.contextmanager
def collection_paused():
    """The cyclic garbage collector off while a compile runs (in any thread), as it was after.

    A compile allocates many objects that reference each other (FX nodes, fake tensors, IR
    nodes), most of them dead when it ends. With the collector on, the ones alive at a young
    collection are promoted, and their count soon triggers a full collection, which walks the
    whole heap (a model's process holds hundreds of thousands of objects: 0.3-0.6 s here, about
    one per model compile) and finds almost nothing to free. Paused, the first young
    collection after the compile frees that garbage, examining only what the compile
    allocated. A user who turned the collector off keeps it off."""
    global _pausing, _paused_gc
    with _pause_lock:
        if _pausing == 0 and gc.isenabled():
            gc.disable()
            _paused_gc = True
        _pausing += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pausing -= 1
            if _pausing == 0 and _paused_gc:
                _paused_gc = False
                gc.enable()

#!/usr/bin/env python
"""Symbolic trace time, with and without the fake results frontend/symbolic_metas.py builds
directly, beside a concrete trace of the same function (the median of 7 traces each, in one
process, the two symbolic variants interleaved per function).

    python bench/symbolic_trace.py

A symbolic trace is what a shape class's second size costs (frontend/shape_class.py), and
every trace of a Dynamo graph with dynamic sizes.
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tjit.frontend.trace as trace  # noqa: E402

TARGETS = torch.zeros(64, dtype=torch.long)
FUNCTIONS = {
    "cumsum": lambda x, w: torch.cumsum(x * w, -1),
    "log_softmax": lambda x, w: F.log_softmax(x * w, -1),
    "layer_norm": lambda x, w: F.layer_norm(x, (256,), w),
    "cross_entropy": lambda x, w: F.cross_entropy(x * w, TARGETS),
    "softmax": lambda x, w: torch.softmax(x * w, -1),
}


def median_ms(fn, n: int = 7) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


def main() -> None:
    x, w = torch.randn(64, 256), torch.randn(256)
    direct = trace.symbolic_meta
    print(f"{'function':14s} {'symbolic, decompositions':>25s} {'symbolic, direct':>17s} {'concrete':>9s}   (ms)")
    for name, fn in FUNCTIONS.items():
        row = []
        for meta in (lambda *args: NotImplemented, direct):
            trace.symbolic_meta = meta
            trace.trace_symbolic(fn, (x, w), {})  # (first-use costs paid)
            row.append(median_ms(lambda: trace.trace_symbolic(fn, (x, w), {})))
        trace.symbolic_meta = direct
        trace.trace_concrete(fn, (x, w), {})
        row.append(median_ms(lambda: trace.trace_concrete(fn, (x, w), {})))
        print(f"{name:14s} {row[0]:25.1f} {row[1]:17.1f} {row[2]:9.1f}")


if __name__ == "__main__":
    main()

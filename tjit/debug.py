"""TJIT_DEBUG: what tjit prints as it works (to stderr).

  TJIT_DEBUG=1  one line per compile: kernels, eager ops, trace/lower/codegen times
  TJIT_DEBUG=2  + the IR after tracing and the kernel grouping after fusion
  TJIT_DEBUG=3  + every generated kernel's Triton source
  TJIT_DEBUG=4  + one line per kernel launch: grid, constexprs, bytes moved, wall time

TJIT_POISON=1 fills every buffer tjit allocates with NaN (floats) or a sentinel before
the kernels write it, so a test catches an element a kernel forgot to write.
"""
from __future__ import annotations

import os
import sys


def level() -> int:
    try:
        return int(os.environ.get("TJIT_DEBUG", "0"))
    except ValueError:
        return 0


def log(min_level: int, text: str) -> None:
    if level() >= min_level:
        print(f"[tjit] {text}", file=sys.stderr)


def log_program(graph, program) -> None:
    """The IR (level 2), each kernel's grouping (level 2) and source (level 3)."""
    log(2, "IR:\n" + str(graph))
    for k, (group, plan) in enumerate(zip(program.groups, program.kernels)):
        log(2, f"kernel {k} {plan.name}: shape {list(plan.shape)}, stores "
               f"{[type(s.target).__name__ for s in group.stores]}; " + "; ".join(d.describe() for d in plan.space.loop_dims))
        log(3, "source:\n" + plan.source)


def log_launch(plan, seconds: float) -> None:
    log(4, f"launch {plan.name} grid={plan.grid} {plan.constexprs} shape={list(plan.shape)} "
           f"read={plan.bytes_read}B write={plan.bytes_written}B {seconds * 1e6:.0f}us")


def poisoning() -> bool:
    return os.environ.get("TJIT_POISON", "0") not in ("", "0")


def poison(t) -> None:
    import torch
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)

"""Launching a kernel again straight through the binary Triton compiled for it.

`kernel[grid](*args)` runs Triton's JITFunction.run on every call: it binds the arguments,
computes the specialisation of each (divisibility by 16, ints equal to 1) and looks the binary
up. On an H100 under cProfile (an MLP block in bfloat16, 3 launches and 2 library calls
per call): 75 us per launch, a call host-bound at 407 us against 137 us of GPU kernels. A
tjit launch's ints are fixed for its Program and its pointers' types by the call's guard,
so what Triton would specialise on comes down to the pointers' alignment: the executor keys
the binary by that (and the device) and launches it again through the binary's own
launcher, as JITFunction.run itself does after its lookup.

Only where this Triton's CompiledKernel has the launcher interface that JITFunction.run
uses (Triton 3.4 on: `knobs`, `run`, `function`, `packed_metadata`), and never while launch
hooks are set (profilers such as proton set them and read each launch's metadata).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

try:
    from triton import knobs
except ImportError:  # (an older Triton: every launch goes through JITFunction.run)
    knobs = None


class Binaries:
    """The compiled binaries of one launch, by (device, its pointers' alignment)."""

    enabled = True  # (off: every launch through JITFunction.run, as bench/gpu.py's comparison needs)

    def __init__(self, fn: Any, param_names: list[str], constexprs: dict, grid: tuple):
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        names = list(getattr(fn, "arg_names", ()))
        params = list(param_names)
        # the arguments JITFunction.run passes the launcher: the runtime ones, then the constexprs
        self.tail = [constexprs[n] for n in names[len(params):]] \
            if names[:len(params)] == params and set(names[len(params):]) <= constexprs.keys() else None
        self.found: dict[tuple, tuple] = {}

    def usable(self) -> bool:
        return self.tail is not None and knobs is not None

    def launch(self, key: tuple, args: list) -> bool:
        """Launch the binary kept under `key`; False where there is none (or hooks are set)."""
        binary = self.found.get(key)
        if binary is None or knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None:
            return False
        run, function, metadata = binary
        run(*self.grid, torch._C._cuda_getCurrentRawStream(key[0]), function, metadata, None, None, None,
            *args, *self.tail)
        return True

    def keep(self, key: tuple, kernel: Any) -> None:
        """Keep the binary JITFunction.run returned for a launch under `key`."""
        found = _launcher_of(kernel)
        if found is not None:
            self.found[key] = found


def _launcher_of(kernel: Any) -> Optional[tuple]:
    if hasattr(kernel, "result"):  # (a compile run in the background: done once the launch returned)
        kernel = kernel.result()
    try:
        return kernel.run, kernel.function, kernel.packed_metadata
    except AttributeError:
        return None

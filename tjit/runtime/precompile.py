"""On a GPU, a Program's kernels are compiled side by side before its first launch.

Triton compiles a kernel the first time it is launched (per argument specialisation), on the
launching thread, so a Program's first call would compile its kernels one after another: a
training step's 40-80 kernels take seconds. Triton's compile lets go of the GIL in its MLIR and
LLVM passes and while ptxas runs, so a pool of threads compiles them in parallel (the ViT
training step's 46 kernel launches for sm_90 on the 2-core CPU machine: 8.5 s on one thread,
5.1 s on two: bench/precompile.py). Inductor compiles its kernels in parallel workers too.

`precompile` calls each kernel's `warmup` with the arguments its launch will have inside
`triton.AsyncCompileMode` over that pool: the compiles run there, and each lands in the
kernel's own cache under the key its launch computes, so the launch finds it. Memory a call
binds only when its step comes (an output, a buffer apart, a library call's result) is stood
in for by a `MockTensor` of its type, which Triton takes as 16-byte aligned, as fresh
allocations are; where it is not, the launch compiles its own binary, as it does today. So is
a kernel whose compile fails here: its launch compiles it again and raises what Triton raises.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("TJIT_PRECOMPILE", "1") != "0"


def workers() -> int:
    """Threads compiling at once: TJIT_COMPILE_THREADS, or one per CPU core this process may
    use, at most 32."""
    if os.environ.get("TJIT_COMPILE_THREADS"):
        return max(1, int(os.environ["TJIT_COMPILE_THREADS"]))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cores = os.cpu_count() or 1
    return max(1, min(32, cores))


def _compile_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers(), thread_name_prefix="tjit-compile")
        return _pool


def precompile(launches: list, memory: dict) -> int:
    """Compile the kernels of these launches (executor.Launch) in parallel, with the arguments
    `memory` binds now and stand-ins for the rest. Returns how many compiles it started; 0
    where Triton compiles asynchronously already (a caller's own AsyncCompileMode, which
    cannot be nested) or cannot (a Triton without AsyncCompileMode): each launch then
    compiles its kernel, as it always did."""
    import triton
    async_compile = getattr(triton, "AsyncCompileMode", None)  # (Triton 3.5 and later)
    if async_compile is None:
        return 0
    from triton.runtime import _async_compile
    if _async_compile.active_mode.get() is not None:
        return 0
    started = 0
    with async_compile(_compile_pool(), ignore_errors=True):
        for launch in launches:
            warm = getattr(launch.fn, "warmup", None)
            if warm is None:  # (an interpreted kernel)
                continue
            try:
                warm(*launch_arguments(launch, memory), grid=launch.plan.grid, num_warps=launch.plan.num_warps,
                     num_stages=launch.plan.num_stages, **launch.constexprs)
            except Exception:  # noqa: BLE001  (only a head start: the launch compiles it, and raises, as before)
                continue
            started += 1
    return started


def launch_arguments(launch, memory: dict) -> list:
    """The arguments the launch will be given, as far as they are known before the call's
    first step: the tensors bound already, a MockTensor of the right type for the others."""
    from triton.runtime.jit import MockTensor
    args = []
    for (key, value), template in zip(launch.bound, launch.args_template):
        if key is None:
            args.append(value)
        elif key in memory:
            args.append(memory[key])
        else:
            args.append(MockTensor(template.dtype.torch))
    return args

"""tjit: a Triton kernel-generating JIT for PyTorch.

    @tjit.compile
    def f(x, y): ...

traces f into tjit's graph IR, fuses its work into as few Triton kernels as possible and
runs them: on CUDA tensors as compiled kernels, on CPU tensors through Triton's
interpreter. See DESIGN.md for the pipeline.
"""
from .runtime.interpreter import choose_interpreter_before_triton_import

choose_interpreter_before_triton_import()

from typing import Callable, Mapping, Optional, Sequence  # noqa: E402

from .errors import CompileArgumentError, EagerError, IndexOutOfBoundsError, TjitError, UnsupportedOpError  # noqa: E402
from .explain import Explanation, explain  # noqa: E402
from .ir import Auto, AxisStrategy, Sequential, Thread, ThreadGroup  # noqa: E402
from .runtime.compiled import CompiledFunction  # noqa: E402
from .runtime.counters import counters  # noqa: E402
from .runtime.dynamo_backend import register_dynamo_backend  # noqa: E402


def compile(fn: Optional[Callable] = None, *,
            axis_strategies: Optional[Mapping[str, Sequence[AxisStrategy]]] = None, donate: Sequence[str] = (),
            dynamic: Optional[bool] = None):
    """Compile `fn` (usable as @tjit.compile or @tjit.compile(...)).

    axis_strategies: force the mapping of kernel axes, keyed by graph output name
    ("out0", "out1", ... in return order) or "*" for every kernel; one AxisStrategy per
    axis of that kernel's iteration space.
    donate: names of tensor arguments the caller gives up: their memory may hold
    intermediates once the kernels are done reading them, and is freed after the call
    (using such a tensor afterwards raises).
    dynamic: as torch.compile's. A call at new sizes needs no new trace once the function
    was traced with symbolic sizes (frontend/shape_class.py): None (the default) traces so
    at the second size of a shape class, True at the first, False never (one trace per size).
    """
    if fn is None:
        return lambda f: CompiledFunction(f, axis_strategies, donate, dynamic=dynamic)
    return CompiledFunction(fn, axis_strategies, donate, dynamic=dynamic)


register_dynamo_backend()

__all__ = ["compile", "explain", "Explanation", "counters", "TjitError", "UnsupportedOpError", "EagerError",
           "CompileArgumentError", "IndexOutOfBoundsError", "AxisStrategy", "Auto", "Sequential", "Thread", "ThreadGroup"]

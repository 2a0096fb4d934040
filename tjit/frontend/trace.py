"""Trace a Python function into an aten FX graph with torch's own machinery.

make_fx runs the function on fake tensors (no real compute), records every aten op after
torch's core decompositions, and annotates each node with torch's own answer for its
dtype, shape, strides and storage, which the converter relies on. Python scalars and
other non-tensor arguments are specialised: they are part of the cache key.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedOpError
from .convert import Conversion, Converter


@functools.lru_cache(maxsize=None)
def decomposition_table():
    from torch._decomp import core_aten_decompositions
    table = dict(core_aten_decompositions())
    # tjit translates these directly: with fewer and more exact IR ops than their
    # decompositions, and with eager's dtype checks, which the decompositions skip (silu of
    # an int tensor must raise as eager does, not return a value)
    for op in KEPT_WHOLE:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    return table


aten = torch.ops.aten
KEPT_WHOLE = (aten.clamp_min, aten.clamp_max, aten.silu, aten.softplus, aten.mish, aten.hardsigmoid, aten.hardswish,
              aten.frac, aten.celu, aten.selu, aten.lerp, aten.addcmul, aten.addcdiv,
              aten.detach)  # its decomposition (alias) would lose where the gradient stops


def fake_trace(fn: Callable, tensors: list) -> torch.fx.GraphModule:
    """make_fx on fake copies of the tensors. (The first call in a process also imports
    torch._dynamo, which make_fx uses internally: about a second, once.)"""
    return make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake",
                   _allow_non_fake_inputs=True)(*tensors)


class GradModeWatch(TorchFunctionMode):
    """Notes whether the function calls torch with grad mode off (a `torch.no_grad()` block
    inside it): the aten graph does not show that, and tjit's backward would not know."""

    def __init__(self):
        super().__init__()
        self.saw_no_grad = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not torch.is_grad_enabled() and func is not torch._C._set_grad_enabled:  # tracing toggles it too
            self.saw_no_grad = True
        return func(*args, **(kwargs or {}))


def flatten_arguments(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) per argument, in the order the function declares them."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        if kwargs:
            raise
        return [(f"arg{k}", a) for k, a in enumerate(args)]
    flat = []
    for name, value in bound.arguments.items():
        param = bound.signature.parameters[name]
        if param.kind is param.VAR_POSITIONAL:
            flat += [(f"{name}{k}", v) for k, v in enumerate(value)]
        elif param.kind is param.VAR_KEYWORD:
            flat += [(f"{name}_{k}", v) for k, v in value.items()]
        else:
            flat.append((name, value))
    return flat


def trace(fn: Callable, args: tuple, kwargs: dict) -> Conversion:
    flat = flatten_arguments(fn, args, kwargs)
    tensor_names = [name for name, v in flat if isinstance(v, torch.Tensor)]
    tensors = [v for _, v in flat if isinstance(v, torch.Tensor)]

    def with_tensors(*traced):
        it = iter(traced)
        values = {name: (next(it) if isinstance(v, torch.Tensor) else v) for name, v in flat}
        return _call_with(fn, args, kwargs, flat, values)

    watch = GradModeWatch()
    try:
        with torch.enable_grad(), watch:
            gm = fake_trace(with_tensors, [t.detach() for t in tensors])
    except UnsupportedOpError:
        raise
    except Exception as e:  # data-dependent control flow and the like
        raise UnsupportedOpError(getattr(fn, "__name__", str(fn)), f"tracing failed: {type(e).__name__}: {e}") from e
    try:
        conversion = Converter(gm, tensor_names).run()
        conversion.stops_gradients = watch.saw_no_grad
        return conversion
    except UnsupportedOpError as e:
        if e.where or e.target is None:
            raise
        raise UnsupportedOpError(e.op, e.reason, locate_call(with_tensors, tensors, e.target)) from None


class _Found(Exception):
    pass


def locate_call(fn: Callable, tensors: list, target) -> str:
    """The user's line that calls aten op `target`: re-run fn on fake copies of its tensors
    (the real ones stay untouched) and stop at the first dispatch of that op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    import traceback

    packet = getattr(target, "overloadpacket", target)

    class Locator(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is target or getattr(func, "overloadpacket", None) is packet:
                frames = [f for f in traceback.extract_stack()
                          if "/torch/" not in f.filename and "/tjit/" not in f.filename]
                raise _Found(f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "")
            return func(*args, **(kwargs or {}))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fakes = [mode.from_tensor(t) for t in tensors]
        with mode, Locator():
            fn(*fakes)
    except _Found as found:
        return str(found)
    except Exception:
        return ""
    return ""


def _call_with(fn, args, kwargs, flat, values):
    """Call fn with the traced tensors in place of the real ones, keeping its call shape."""
    names = [name for name, _ in flat]
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return fn(*[values[n] for n in names])
    new_args, new_kwargs = [], {}
    for name, value in bound.arguments.items():
        param = bound.signature.parameters[name]
        if param.kind is param.VAR_POSITIONAL:
            new_args += [values[f"{name}{k}"] for k in range(len(value))]
        elif param.kind is param.VAR_KEYWORD:
            new_kwargs.update({k: values[f"{name}_{k}"] for k in value})
        elif param.kind is param.KEYWORD_ONLY:
            new_kwargs[name] = values[name]
        else:
            new_args.append(values[name])
    return fn(*new_args, **new_kwargs)

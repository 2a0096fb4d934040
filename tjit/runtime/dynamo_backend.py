"""`torch.compile(fn, backend="tjit")`: Dynamo hands us an FX graph of torch calls; tjit
compiles it like any other Python function (the GraphModule is callable)."""
from __future__ import annotations

from typing import Callable

import torch


def tjit_backend(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    from .compiled import CompiledFunction
    compiled = CompiledFunction(gm.forward)

    def run(*args):
        return compiled(*args)

    return run


def register_dynamo_backend() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend
    if "tjit" not in _BACKENDS:
        register_backend(name="tjit")(tjit_backend)

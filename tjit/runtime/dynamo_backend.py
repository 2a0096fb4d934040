"""`torch.compile(fn, backend="tjit")`: Dynamo hands us an FX graph of torch calls; tjit
compiles it like any other Python function (the GraphModule is callable). A graph tjit
refuses runs eagerly, with a warning (split.py)."""
from __future__ import annotations

from typing import Callable

import torch


def tjit_backend(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    from .split import graph_backend
    return graph_backend(gm, example_inputs)


def register_dynamo_backend() -> None:
    """The installed package registers "tjit" through the `torch_dynamo_backends` entry
    point, which Dynamo reads lazily. Importing Dynamo here would cost seconds, so the
    backend is registered directly only when Dynamo is already loaded (or tjit is used
    from a source tree without being installed: then call this after importing Dynamo)."""
    import sys
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.backends.registry import _BACKENDS, register_backend
    if "tjit" not in _BACKENDS:
        register_backend(name="tjit")(tjit_backend)

"""`torch.compile(fn, backend="tjit")`: Dynamo hands us an FX graph of torch calls; tjit
compiles it like any other Python function (the GraphModule is callable). A graph tjit
refuses runs eagerly, with a warning (split.py)."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional

import torch

# torch.compile's modes. tjit has no autotuning or CUDA graphs to turn on, so each compiles as
# "default" does; a name outside these is refused, as Inductor refuses it.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def tjit_backend(gm: torch.fx.GraphModule, example_inputs, mode: Optional[str] = None,
                 options: Optional[Mapping[str, Any]] = None) -> Callable:
    """Dynamo's backend. `torch.compile(..., mode=..., options=...)` passes those on: any of
    torch's modes is accepted (and changes nothing), options (Inductor's configuration) are
    ignored with a warning that names them."""
    if mode is not None and mode not in MODES:
        raise RuntimeError(f"torch.compile(backend='tjit'): unrecognized mode={mode!r}, should be one of: "
                           f"{', '.join(MODES)}")
    if options:
        warnings.warn(f"torch.compile(backend='tjit') ignores options {sorted(map(str, options))} "
                      "(tjit has no configuration through torch.compile)", stacklevel=2)
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

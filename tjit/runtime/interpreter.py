"""Where kernels run: Triton's interpreter for CPU tensors, compiled kernels for CUDA.

Triton binds `tl.sum`, `tl.max`, ... when it is imported, so the interpreter must be
chosen before that: `tjit` sets TRITON_INTERPRET=1 on import when no CUDA device is
present and triton is not imported yet.
"""
from __future__ import annotations

import os
import sys

import torch

from ..errors import CompileArgumentError


def choose_interpreter_before_triton_import() -> None:
    if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def restore_patches_after_device_calls() -> None:
    """Work around Triton's interpreter leaving `tl` patched after a call to a @triton.jit
    helper inside a kernel (tl.sigmoid, tl.cdiv, tjit's own helpers): it patches the
    language for the helper and never restores it, which breaks every later compile for a
    real GPU in the same process. Same behaviour, with the patch scope restored."""
    from triton.runtime import interpreter as ti
    if getattr(ti.InterpretedFunction.__call__, "_tjit_restores", False):
        return

    def call(self, *args, **kwargs):
        scope = ti._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    call._tjit_restores = True
    ti.InterpretedFunction.__call__ = call


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(device: torch.device) -> None:
    if device.type == "cpu" and not interpreting():
        raise CompileArgumentError(
            "tjit runs CPU tensors through Triton's interpreter, which must be chosen before triton is "
            "imported: set TRITON_INTERPRET=1 in the environment (tjit does so itself on machines without CUDA)")
    if device.type == "cuda" and interpreting():
        return  # the interpreter runs CUDA tensors too (slowly)
    if device.type not in ("cpu", "cuda"):
        raise CompileArgumentError(f"tjit cannot run tensors on device {device}")

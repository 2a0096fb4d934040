"""Batch norm as aten ops tjit generates: reductions and elementwise work it fuses.

torch's core aten decompositions leave batch norm whole, so it would run as a library call
(and its gradient as torch's backward, running the op again). Here every batch norm op
is decomposed, as Inductor's table does, into `var_mean` over the batch and spatial axes, the
normalisation, and, in training mode, the running statistics' update as `copy_` into them:
in-place writes tjit makes as eager does. tjit's own autograd then differentiates the
reductions, so the backward is a few fused reduction kernels too.

These follow torch's decompositions (torch/_decomp/decompositions.py:
native_batch_norm_helper) where they agree with eager, and eager where they do not:
  * the mean and the variance's type on CPU is the parameters' (float32 for a float16 or
    bfloat16 input whose weight or running statistics are float32: "mixed type"), not
    always the input's;
  * with one value per channel, the unbiased variance of the running update is 0/0 (NaN),
    as eager's var_sum / (n - 1), rather than a ZeroDivisionError while tracing;
  * an empty input raises eager's error (the decomposition would compute NaN statistics);
  * the running statistics are updated in the computation type and rounded once.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
from torch._decomp.decompositions import _get_batch_norm_reserve_tensor
from torch._prims_common import get_computation_dtype

from ..errors import EagerError

aten = torch.ops.aten


def _stats_dtype(input: Tensor, *params: Optional[Tensor]) -> torch.dtype:
    """The type of the batch mean and inverse std eager returns."""
    if input.device.type != "cpu":
        return get_computation_dtype(input.dtype)  # CUDA: the accumulate type
    mixed = input.dtype in (torch.float16, torch.bfloat16) and \
        any(p is not None and p.dtype == torch.float32 for p in params)
    return torch.float32 if mixed else input.dtype


def _broadcast(v: Tensor, rank: int) -> Tensor:
    """A per-channel vector shaped to broadcast over an input of `rank` axes (N, C, ...)."""
    return v.reshape((-1,) + (1,) * (rank - 2))


def batch_norm(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], running_mean: Optional[Tensor],
               running_var: Optional[Tensor], training: bool, momentum: float, eps: float,
               functional: bool = False):
    """(output, mean, invstd, new running mean, new running var). In training mode the running
    statistics (when given) are updated in place, unless `functional`: then only returned."""
    if input.numel() == 0:
        raise EagerError(f"input tensor must have at least one element, but got input_sizes = {list(input.shape)}")
    acc = get_computation_dtype(input.dtype)
    axes = [0] + list(range(2, input.dim()))
    rank = input.dim()
    stats = _stats_dtype(input, weight, bias, running_mean, running_var)
    new_mean, new_var = running_mean, running_var
    if training:
        var, mean = torch.var_mean(input.to(acc), dim=axes, correction=0, keepdim=True)
        invstd = torch.rsqrt(var + eps)
        output = (input.to(acc) - mean) * invstd
        mean, var, invstd = (t.reshape(-1) for t in (mean, var, invstd))
        if running_mean is not None:  # (eager's running statistics carry no gradient)
            new_mean = (mean.detach() * momentum + running_mean.to(acc) * (1 - momentum)).to(running_mean.dtype)
        if running_var is not None:
            n = input.numel() // input.shape[1]
            # eager's var_sum / (n - 1): with one value per channel 0 / 0, NaN
            unbiased = var.detach() * (n / (n - 1)) if n > 1 else var.detach() * float("nan")
            new_var = (unbiased * momentum + running_var.to(acc) * (1 - momentum)).to(running_var.dtype)
        if not functional:
            for buffer, new in ((running_mean, new_mean), (running_var, new_var)):
                if buffer is not None:
                    buffer.copy_(new)
        save_mean, save_invstd = mean.to(stats), invstd.to(stats)
    else:
        for name, value in (("running_mean", running_mean), ("running_var", running_var)):
            if value is None:  # (F.batch_norm's message; the aten ops themselves crash eager)
                raise EagerError(f"{name} must be defined in evaluation mode")
        mean = running_mean.to(acc)
        invstd = 1 / torch.sqrt(running_var.to(acc) + eps)
        output = (input.to(acc) - _broadcast(mean, rank)) * _broadcast(invstd, rank)
        if input.device.type == "cpu":  # CPU eager returns no statistics in eval mode, CUDA the running ones
            save_mean, save_invstd = input.new_zeros((0,), dtype=stats), input.new_zeros((0,), dtype=stats)
        else:
            save_mean, save_invstd = mean.to(stats), invstd.to(stats)
    if weight is not None:
        output = output * _broadcast(weight.to(acc), rank)
    if bias is not None:
        output = output + _broadcast(bias.to(acc), rank)
    return output.to(input.dtype), save_mean, save_invstd, new_mean, new_var


def _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)[:3]


def _legit_no_stats(input, weight, bias, training, momentum, eps):
    return batch_norm(input, weight, bias, None, None, training, momentum, eps)[:3]


def _legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


def _legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, functional=True)


def _reserve(input, weight, bias, running_mean, running_var, eps, training) -> Tensor:
    """The (cuDNN-only) reserve result of _batch_norm_with_update / _no_update: empty unless cuDNN."""
    return _get_batch_norm_reserve_tensor(input, weight, bias, running_mean, running_var, eps, training)


def _with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out = batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out[:3] + (_reserve(input, weight, bias, running_mean, running_var, eps, True),)


def _with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps):
    out = batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps, functional=True)
    return out[:3] + (_reserve(input, weight, bias, running_mean, running_var, eps, True),) + out[3:]


def _no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out = batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)
    return out[:3] + (_reserve(input, weight, bias, running_mean, running_var, eps, False),)


@functools.lru_cache(maxsize=None)
def batch_norm_decompositions() -> dict:
    """aten batch norm op -> its decomposition, for trace.py's decomposition table."""
    return {
        aten.native_batch_norm.default: _native_batch_norm,
        aten._native_batch_norm_legit.default: _native_batch_norm,
        aten._native_batch_norm_legit.no_stats: _legit_no_stats,
        aten._native_batch_norm_legit_no_training.default: _legit_no_training,
        aten._native_batch_norm_legit_functional.default: _legit_functional,
        aten._batch_norm_with_update.default: _with_update,
        aten._batch_norm_with_update_functional.default: _with_update_functional,
        aten._batch_norm_no_update.default: _no_update,
    }

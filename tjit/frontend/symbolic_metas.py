"""Fake results of a few ops for a symbolic trace, computed directly.

With symbolic sizes, torch's fake tensor mode computes an op that has no symbol-aware C++
meta function by running its Python decomposition (torch._refs): cumsum becomes a masked
sum over an [n, n] triangle, log_softmax and layer_norm a dozen ops, each reasoning about
symbols. That costs 10-60 ms per op and makes a symbolic trace (the second size of a shape
class, frontend/shape_class.py) several times a concrete one. The ops here have a plain
result: their input's shape, contiguous, and a dtype by a fixed rule (the C++ meta
functions' `set_output_raw_strided(0, input.sizes(), {}, ...)`), so it is built directly.
An argument outside the plain cases (a dtype the op refuses, a shape that does not match)
gives NotImplemented, and the fake mode computes the op as before, with its errors.
tests/test_shape_classes.py checks each against the concrete fake mode's result.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

aten = torch.ops.aten


def _empty(mode, like: torch.Tensor, shape, dtype: torch.dtype):
    from torch._subclasses.fake_tensor import FakeTensor
    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), device=like.device)


def _dim_fits(x: torch.Tensor, dim) -> bool:
    return isinstance(dim, int) and -max(x.dim(), 1) <= dim < max(x.dim(), 1)


def _cumulative(mode, x, dim, dtype: Optional[torch.dtype] = None):
    """cumsum, cumprod: integer (and bool) inputs sum to int64 unless a dtype is given."""
    if not _dim_fits(x, dim) or x.is_complex():
        return NotImplemented
    integral = not x.is_floating_point()
    return _empty(mode, x, x.shape, dtype or (torch.int64 if integral else x.dtype))


def _softmax_like(mode, x, dim, half_to_float: bool):
    """_softmax, _log_softmax of a floating input, in its type (half_to_float, which only
    CUDA's float16 allows, is left to the fake mode)."""
    if not _dim_fits(x, dim) or not x.is_floating_point() or half_to_float:
        return NotImplemented
    return _empty(mode, x, x.shape, x.dtype)


def _layer_norm(mode, x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """native_layer_norm: the output, and the mean and rstd over the normalized dimensions
    (kept, of size 1), all in the input's type as the fake mode gives them."""
    k = len(normalized_shape)
    if not x.is_floating_point() or k == 0 or k > x.dim() or \
            any(p is not None and (p.dtype != x.dtype or list(p.shape) != list(normalized_shape)) for p in (weight, bias)):
        return NotImplemented
    if tuple(x.shape[x.dim() - k:]) != tuple(normalized_shape):
        return NotImplemented
    statistics = (*x.shape[:x.dim() - k], *([1] * k))
    return _empty(mode, x, x.shape, x.dtype), _empty(mode, x, statistics, x.dtype), _empty(mode, x, statistics, x.dtype)


SYMBOLIC_METAS: dict[torch._ops.OpOverload, Callable] = {
    aten.cumsum.default: _cumulative,
    aten.cumprod.default: _cumulative,
    aten._softmax.default: _softmax_like,
    aten._log_softmax.default: _softmax_like,
    aten.native_layer_norm.default: _layer_norm,
}


def symbolic_meta(mode, func, args: tuple, kwargs: dict):
    """The op's fake result built directly (see the module text), or NotImplemented."""
    meta = SYMBOLIC_METAS.get(func)
    if meta is None or not any(isinstance(a, torch.Tensor) and a._has_symbolic_sizes_strides for a in args):
        return NotImplemented
    return meta(mode, *args, **kwargs)

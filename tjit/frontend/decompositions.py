"""Decompositions of tjit's own where torch's differ from eager in what tjit needs.

- `logsumexp`: torch's (torch._refs.logsumexp) shifts the rows by their max before the
  exponentials, and tjit differentiates what it traced: log(sum(exp(x - m))) + m does not
  depend on m, but its gradient through m is a tie test (which elements equal the max)
  divided by the count of ties. Where the backward computes x again in another rounding (a
  product its gradient kernels recompute on their own tiles), that count can be 0: NaN
  gradients. Eager's gradient is exp(x - result), with no tie test; here the max is
  detached, so the gradient is that too.
- `binary_cross_entropy`: torch's takes logs clamped at -100, whose derivative where the
  input is exactly 0 or 1 (a saturated sigmoid) is inf times the clamp's 0: NaN. Eager's
  gradient for the input is (input - target) / max((1 - input) * input, 1e-12); here the loss
  is torch's, with that gradient.
- `native_group_norm` of a 16-bit input with float32 weight or bias on the CPU (a group norm
  under autocast): eager accepts the mix, but the op's meta function gives its mean and rstd
  the input's type where the CPU kernel writes float32, so the op run as a library call
  fails; here it is torch's decomposition (torch._refs), computed in float32 and fused as
  batch norm is. Other group norms stay library calls.
- `index_add`: torch's decomposition checks the number of indices but not eager's "source
  tensor shape must match self tensor shape, excluding the specified dimension", so a
  source of the wrong shape was broadcast into a result where eager raises.
- `upsample_*` (F.interpolate): torch's decompositions compute any output size, where eager
  refuses an empty one ("Input and output sizes should be greater than 0": a scale of 0.5
  over one row) and an input empty past its batch dimension ("Non-empty 4D data tensor
  expected"); here eager's checks follow torch's decomposition (and an upsample kept whole,
  a library call, is checked by the trace's fake mode: its meta function does not either).
- `pixel_unshuffle` of an empty tensor on the CPU: eager's kernel returns a copy of the input,
  in the input's shape (PixelShuffle.cpp), where torch's decomposition gives the unshuffled
  shape (as eager's CUDA kernel does); here it is eager's copy, after the decomposition's
  checks.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch._refs
from torch._decomp.decompositions import apply_loss_reduction, pw_cast_for_opmath
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND
from torch._prims_common.wrappers import elementwise_type_promotion_wrapper, out_wrapper

aten = torch.ops.aten


@elementwise_type_promotion_wrapper(type_promoting_args=("self",),
                                    type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT)
def logsumexp(self: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """torch._refs.logsumexp with its shift detached (see the module text)."""
    dims = tuple(dim) if isinstance(dim, Iterable) else (dim,)
    if self.numel() == 0:
        return torch.sum(torch.exp(self), dims, keepdim).log()
    maxes = torch.amax(torch.real(self), dims, keepdim=True).detach()
    maxes = torch.masked_fill(maxes, maxes.abs() == float("inf"), 0)
    maxes_squeezed = maxes if keepdim else torch.squeeze(maxes, dims)
    return torch.sum(torch.exp(self - maxes), dims, keepdim).log().add(maxes_squeezed)


@out_wrapper()
@pw_cast_for_opmath
def binary_cross_entropy(self: torch.Tensor, target: torch.Tensor, weight=None, reduction: int = 1) -> torch.Tensor:
    """torch's decomposition of the loss, with eager's gradient for the input (see the module
    text): the loss of the input detached, plus a term whose value is 0 and whose gradient is
    eager's."""
    given = self.detach()
    loss = (target - 1) * torch.maximum(torch.log1p(-given), self.new_full((), -100)) \
        - target * torch.maximum(torch.log(given), self.new_full((), -100))
    slope = (given - target.detach()) / torch.clamp_min((1 - given) * given, 1e-12)
    if weight is not None:
        loss, slope = loss * weight, slope * weight.detach()
    along = self * slope
    return apply_loss_reduction(loss - (along.detach() - along), reduction)  # (x - 0 keeps the sign of a zero x)


def index_add(decomposition):
    """torch's decomposition of an index_add overload, after eager's shape check."""
    def checked(x, dim, index, source, *args, **kwargs):
        if x.dim() > 1 and source.dim() > 0:
            dim = dim % x.dim()
            kept = [n for d, n in enumerate(x.shape) if d != dim]
            torch._check(source.dim() == x.dim() and [n for d, n in enumerate(source.shape) if d != dim] == kept,
                         lambda: "source tensor shape must match self tensor shape, excluding the specified "
                                 f"dimension. Got self.shape = {list(x.shape)} source.shape = {list(source.shape)}")
        return decomposition(x, dim, index, source, *args, **kwargs)
    return checked


UPSAMPLES = (aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d, aten._upsample_nearest_exact1d,
             aten._upsample_nearest_exact2d, aten._upsample_nearest_exact3d, aten.upsample_linear1d,
             aten.upsample_bilinear2d, aten.upsample_trilinear3d, aten.upsample_bicubic2d,
             aten._upsample_bilinear2d_aa, aten._upsample_bicubic2d_aa)


def upsample(decomposition):
    """torch's decomposition of an upsample overload, with eager's checks of its sizes (see the
    module text)."""
    def checked(input, *args, **kwargs):
        result = decomposition(input, *args, **kwargs)
        check_upsample_sizes(input, result)
        return result
    return checked


def check_upsample_sizes(input: torch.Tensor, result: torch.Tensor) -> None:
    """Eager's checks of an upsample's sizes, in eager's order, with its messages."""
    names = "DHW"[3 - (input.dim() - 2):]
    sizes = lambda shape: ", ".join(f"{n}: {s}" for n, s in zip(names, shape[2:]))  # noqa: E731
    torch._check(all(n > 0 for n in (*input.shape[2:], *result.shape[2:])),
                 lambda: f"Input and output sizes should be greater than 0, but got input ({sizes(input.shape)})"
                         f"{' and' if input.dim() == 3 else ''} output ({sizes(result.shape)})")
    torch._check(math.prod(input.shape[1:]) != 0, lambda: f"Non-empty {input.dim()}D data tensor expected but got "
                                                          f"a tensor with sizes {list(input.shape)}")


def pixel_unshuffle(decomposition):
    """torch's decomposition of pixel_unshuffle, with eager's CPU result for an empty input
    (see the module text)."""
    def as_eager(input, *args, **kwargs):
        result = decomposition(input, *args, **kwargs)
        return input.clone() if input.numel() == 0 and input.device.type == "cpu" else result
    return as_eager


def group_norm_of_mixed_types(input, weight, bias, *args):
    """torch's decomposition for a 16-bit input with float32 parameters on the CPU (see the
    module text); NotImplemented (the op whole) otherwise."""
    mixed = input.device.type == "cpu" and input.dtype in (torch.float16, torch.bfloat16) and \
        any(p is not None and p.dtype == torch.float32 for p in (weight, bias))
    return torch._refs.native_group_norm(input, weight, bias, *args) if mixed else NotImplemented


def tjit_decompositions(table: dict) -> dict:
    """The entries above, for a table that holds torch's (index_add's, upsample's and
    pixel_unshuffle's wrap torch's own; pixel_unshuffle's functional form only, as its out=
    form must write its out tensor, and only where torch's table has it)."""
    unshuffle = aten.pixel_unshuffle.default
    return {aten.logsumexp.default: logsumexp, aten.binary_cross_entropy.default: binary_cross_entropy,
            aten.native_group_norm.default: group_norm_of_mixed_types} | \
        wrapped(table, (aten.index_add, aten.index_add_), index_add) | wrapped(table, UPSAMPLES, upsample) | \
        ({unshuffle: pixel_unshuffle(table[unshuffle])} if unshuffle in table else {})


def wrapped(table: dict, ops, wrapper) -> dict:
    """wrapper(torch's decomposition) for each overload of ops that the table decomposes."""
    keys = [getattr(op, overload) for op in ops for overload in op.overloads()]
    return {key: wrapper(table[key]) for key in keys if key in table}

"""aten reductions and normalisations -> IR Reduce nodes (and the math around them).

Each reduction is built keepdim (tjit.ir.Reduce keeps the reduced axes as size 1) and
then viewed to torch's result shape, so the value broadcasts back over its input with a
plain expand view, which is what lets the lowering keep it in registers. float16/bfloat16
inputs are accumulated in float32 and integer sums in int64, as eager does; the result
types always come from torch's own meta functions (node.meta["val"]).
"""
from __future__ import annotations

import math

import torch

from ..errors import UnsupportedOpError, as_eager_error
from ..ir import Contiguous, DType, GraphNode, toposort
from .aten_ops import X, opmath, out_dtype, register

aten = torch.ops.aten


# -- helpers ---------------------------------------------------------------------------------
def reduced_axes(x: GraphNode, dim) -> tuple[int, ...]:
    """torch's `dim` argument (None, [], an int or a list) as axes of x; None/[] is all."""
    rank = len(x.shape)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(rank))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({d % rank for d in dims})) if rank else ()


def as_result(cv, node, value: GraphNode, index: int = None) -> GraphNode:
    """A keepdim value viewed (and cast) to torch's result shape and type."""
    val = node.meta["val"] if index is None else node.meta["val"][index]
    value = cv.cast(value, DType.from_torch(val.dtype))
    shape = tuple(val.shape)
    if value.shape == shape:
        return value
    if not value.shape:  # a literal standing for an identity reduction (argmax over a size-1 axis)
        return cv.expand_to(value, shape)
    return cv.view(value, ("reshape", shape))  # keepdim and torch's shape differ by size-1 axes only


def count(x: GraphNode, axes) -> int:
    return math.prod(x.shape[a] for a in axes)


def accumulate_type(node, x: GraphNode, dtype=None) -> DType:
    """The type eager accumulates in: the result type, float32 for 16-bit floats."""
    return opmath(out_dtype(node) if dtype is None else DType.from_torch(dtype))


def accumulated(cv, node, x: GraphNode) -> GraphNode:
    """x as eager's accumulating kernels read it: converted to the result type first (a
    float32 input summed with dtype=float16 is rounded to float16), then widened."""
    return cv.cast(cv.cast(x, out_dtype(node)), accumulate_type(node, x))


def keepdim_view(cv, value: GraphNode, shape) -> GraphNode:
    """A keepdim row value broadcast back over the reduced input's shape."""
    return cv.expand_to(value, tuple(shape))


# -- plain reductions ------------------------------------------------------------------------
@register(aten.sum)
def _sum(cv, node, x, dim=None, keepdim=False, dtype=None):
    return as_result(cv, node, cv.reduce("add", accumulated(cv, node, x), reduced_axes(x, dim)))


@register(aten.prod)
def _prod(cv, node, x, dim=None, keepdim=False, dtype=None):
    return as_result(cv, node, cv.reduce("mul", accumulated(cv, node, x), reduced_axes(x, dim)))


@register(aten.mean)
def _mean(cv, node, x, dim=None, keepdim=False, dtype=None):
    axes = reduced_axes(x, dim)
    acc = accumulate_type(node, x)
    total = X(cv, node, cv.reduce("add", accumulated(cv, node, x), axes), acc)
    return as_result(cv, node, _scaled(cv, total, 1.0 / count(x, axes) if count(x, axes) else math.nan))


def _scaled(cv, value: X, factor: float) -> GraphNode:
    """value * factor on a keepdim value (X's broadcasting is to the node's output shape,
    which a keepdim value need not have, so this builds the op directly)."""
    return cv.elementwise("mul", [value.value, cv.expand_to(cv.const(factor, value.dtype), value.value.shape)],
                          value.dtype)


@register(aten.amax, aten.amin)
def _amax(cv, node, x, dim=(), keepdim=False):
    op = "max" if node.target.overloadpacket is aten.amax else "min"
    _refuse_empty(node, x, reduced_axes(x, dim), op)
    return as_result(cv, node, cv.reduce(op, x, reduced_axes(x, dim)))


@register(aten.max, aten.min)
def _max(cv, node, x, dim=None, keepdim=False):
    op = "max" if node.target.overloadpacket is aten.max else "min"
    if isinstance(dim, GraphNode) or not isinstance(node.meta["val"], (tuple, list)) and dim is not None:
        raise UnsupportedOpError(str(node.target), "elementwise max/min of two tensors goes through maximum")
    axes = reduced_axes(x, dim)
    _refuse_empty(node, x, axes, op, whole=dim is None)
    with_indices = isinstance(node.meta["val"], (tuple, list))
    values = cv.reduce(op, x, axes, grad_to_first=with_indices)
    if not with_indices:
        return as_result(cv, node, values)
    indices = cv.reduce("arg" + op, _arg_operand(cv, x), axes, DType.int64)
    return as_result(cv, node, values, 0), as_result(cv, node, indices, 1)


@register(aten.argmax, aten.argmin)
def _argmax(cv, node, x, dim=None, keepdim=False):
    op = "argmax" if node.target.overloadpacket is aten.argmax else "argmin"
    if x.dtype is DType.bool:
        raise UnsupportedOpError(str(node.target), f"{op}() does not support bool input (eager refuses it too)")
    if dim is None and len(x.shape) > 1:  # over the flattened tensor
        x = cv.view(x, ("reshape", (math.prod(x.shape),)))
    axes = reduced_axes(x, dim)
    _refuse_empty(node, x, axes, op)
    return as_result(cv, node, cv.reduce(op, _arg_operand(cv, x), axes, DType.int64))


def _arg_operand(cv, x: GraphNode) -> GraphNode:
    return cv.cast(x, DType.int8) if x.dtype is DType.bool else x


def _refuse_empty(node, x: GraphNode, axes, op: str, whole: bool = False) -> None:
    """Eager's error for a max, min or arg-reduction over no elements (it has no identity);
    whole: the call named no dim."""
    if whole and 0 in x.shape:
        raise as_eager_error(RuntimeError(f"{op}(): Expected reduction dim to be specified for input.numel() == 0. "
                                          "Specify the reduction dim with the 'dim' argument."))
    empty = [a for a in axes if x.shape[a] == 0] or ([0] if not axes and 0 in x.shape else [])
    if empty:
        raise as_eager_error(IndexError(f"{op}(): Expected reduction dim {empty[0]} to have non-zero size."))


@register(aten.any, aten.all)
def _any(cv, node, x, dim=None, keepdim=False):
    op = "max" if node.target.overloadpacket is aten.any else "min"
    truth = cv.cast(x, DType.bool)
    return as_result(cv, node, cv.reduce(op, truth, reduced_axes(x, dim)))


# -- moments ---------------------------------------------------------------------------------
def moments(cv, node, x: GraphNode, axes, acc: DType):
    """(mean, sum of squared deviations) as keepdim values. The mean is taken of x shifted by
    its first element per row (shift + sum(x - shift) / n; no shift when that element is
    not finite), which is exact for a constant row, as eager's Welford is (layer_norm of a
    constant row is exactly 0). Written as reductions whose second reads the first; the
    lowering computes them in one pass (Welford) when it loops."""
    n = count(x, axes)
    xs = cv.cast(x, acc)
    first = None  # the keepdim shift
    if n and axes:
        first = _first_element(cv, xs, axes)
        finite = cv.elementwise("lt", [cv.elementwise("abs", [first], acc),
                                       cv.expand_to(cv.const(math.inf, acc), first.shape)], DType.bool)
        first = cv.elementwise("where", [finite, first, cv.expand_to(cv.const(0.0, acc), first.shape)], acc)
        first = cv.elementwise("stop_gradient", [first], acc)  # the results do not depend on it
        shift = cv.expand_to(first, xs.shape)
        xs_shifted = cv.elementwise("add", [xs, cv.elementwise("neg", [shift], acc)], acc)
    else:
        xs_shifted = xs
    mean = _scaled(cv, X(cv, node, cv.reduce("add", xs_shifted, axes), acc), 1.0 / n if n else math.nan)
    if first is not None:
        mean = cv.elementwise("add", [mean, first], acc)
    squares = _squared_deviations(cv, xs, keepdim_view(cv, mean, xs.shape))
    if x.dtype is DType.float32 and acc is DType.float64:
        # float32 accumulated in double (eager's CPU Welford): the value is the double's, the
        # gradient 2 (x - mean) / n centres on the mean rounded to float32, as eager's
        # var_backward (and batch norm's backward, from its saved float32 mean) does. The
        # backward then needs only float32 statistics: a batch norm saves eager's bytes
        rounded = cv.cast(cv.cast(mean, DType.float32), acc)
        surrogate = _squared_deviations(cv, xs, keepdim_view(cv, rounded, xs.shape))
        squares = cv.elementwise("straight_through", [surrogate, squares], acc)
    return mean, cv.reduce("add", squares, axes)


def _squared_deviations(cv, xs: GraphNode, centre: GraphNode) -> GraphNode:
    """(xs - centre)^2, with no gradient through the centre: the sum of squared deviations
    does not depend on the mean it subtracts (its derivative there, -2 sum(x - mean), is 0),
    so the gradient does not go through it: that saves the backward a reduction of what the
    mean's gradient gets from it (torch's var_backward, 2 (x - mean) / n, is the same)."""
    centre = cv.elementwise("stop_gradient", [centre], xs.dtype)
    centered = cv.elementwise("add", [xs, cv.elementwise("neg", [centre], xs.dtype)], xs.dtype)
    return cv.elementwise("mul", [centered, centered], xs.dtype)


def _first_element(cv, xs: GraphNode, axes) -> GraphNode:
    """Each row's first element, keepdim: read through a view where that reads memory that
    exists anyway (a load per row); else picked out of the row the kernel already holds (a
    sum of the row masked to its first element), since viewing a computed value that does
    not commute with views (an embedding lookup) would write the whole value to memory."""
    first = xs
    for axis in axes:
        first = cv.view(first, ("slice", axis, 0, 1, 1))
    if not _materialized(first) - _materialized(xs):
        return first
    at_start = None
    for axis in axes:
        index = cv.coordinate(xs.shape, axis)
        test = cv.elementwise("eq", [index, cv.expand_to(cv.const(0, index.dtype), xs.shape)], DType.bool)
        at_start = test if at_start is None else cv.elementwise("logical_and", [at_start, test], DType.bool)
    zero = cv.expand_to(cv.const(0.0, xs.dtype), xs.shape)
    return cv.reduce("add", cv.elementwise("where", [at_start, xs, zero], xs.dtype), axes)


def _materialized(value: GraphNode) -> set[int]:
    return {id(n) for n in toposort([value]) if isinstance(n.op, Contiguous)}


def variance(cv, node, x, axes, correction, acc):
    mean, m2 = moments(cv, node, x, axes, acc)
    divisor = max(count(x, axes) - (1 if correction is None else correction), 0)
    var = _scaled(cv, X(cv, node, m2, acc), 1.0 / divisor if divisor else math.inf)
    if divisor == 0:  # eager divides by zero: 0/0 = nan, x/0 = inf
        var = cv.elementwise("truediv", [m2, cv.expand_to(cv.const(0.0, acc), m2.shape)], acc)
    return mean, var


def _moment_dtype(node, x: GraphNode, what: str) -> DType:
    """The type var and std accumulate in: eager's. On the CPU, eager's Welford accumulates
    float32 in double (its var of a row with a large mean and a small spread is exact to 1e-7
    where float32's loses three digits, and it squares 1e20 without overflow); on CUDA in
    float32; 16-bit floats in float32 on both."""
    if not x.dtype.is_float:
        raise UnsupportedOpError(str(node.target), f"{what} of a {x.dtype!r} tensor (eager needs floats too)")
    results = [t for t in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
    if x.dtype is DType.float32 and results and results[0].device.type == "cpu":
        return DType.float64
    return opmath(x.dtype)


@register(aten.var)
def _var(cv, node, x, dim=None, *, correction=None, keepdim=False):
    acc = _moment_dtype(node, x, "var")
    return as_result(cv, node, variance(cv, node, x, reduced_axes(x, dim), correction, acc)[1])


@register(aten.var_mean)
def _var_mean(cv, node, x, dim=None, *, correction=None, keepdim=False):
    acc = _moment_dtype(node, x, "var_mean")
    mean, var = variance(cv, node, x, reduced_axes(x, dim), correction, acc)
    return as_result(cv, node, var, 0), as_result(cv, node, mean, 1)


@register(aten.std)
def _std(cv, node, x, dim=None, *, correction=None, keepdim=False):
    acc = _moment_dtype(node, x, "std")
    return as_result(cv, node, _root(cv, variance(cv, node, x, reduced_axes(x, dim), correction, acc)[1]))


@register(aten.std_mean)
def _std_mean(cv, node, x, dim=None, *, correction=None, keepdim=False):
    acc = _moment_dtype(node, x, "std_mean")
    mean, var = variance(cv, node, x, reduced_axes(x, dim), correction, acc)
    return as_result(cv, node, _root(cv, var), 0), as_result(cv, node, mean, 1)


def _root(cv, var: GraphNode) -> GraphNode:
    """sqrt(var), with eager's zero gradient where var is 0 (a constant row), not inf * 0."""
    return cv.elementwise("sqrt", [_zero_slope_at_zero(cv, var)], var.dtype)


@register(aten.linalg_vector_norm)
def _vector_norm(cv, node, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    acc = accumulate_type(node, x, dtype)
    if not acc.is_float:
        raise UnsupportedOpError(str(node.target), f"vector_norm of a {x.dtype!r} tensor (eager needs floats too)")
    axes = reduced_axes(x, dim)
    mag = cv.elementwise("abs", [cv.cast(x, acc)], acc)
    ord = float(ord)
    if ord == math.inf or ord == -math.inf:
        _refuse_empty(node, x, axes, "vector_norm(ord=inf)")
        return as_result(cv, node, cv.reduce("max" if ord > 0 else "min", mag, axes))
    if ord == 0:
        nonzero = cv.cast(cv.elementwise("ne", [mag, cv.expand_to(cv.const(0.0, acc), mag.shape)], DType.bool), acc)
        return as_result(cv, node, cv.reduce("add", nonzero, axes))
    if ord == 1:
        return as_result(cv, node, cv.reduce("add", mag, axes))
    if ord == 2:
        total = cv.reduce("add", cv.elementwise("mul", [mag, mag], acc), axes)
        return as_result(cv, node, cv.elementwise("sqrt", [_zero_slope_at_zero(cv, total)], acc))
    if ord < 1:  # |x| ** p has an infinite slope at 0, where eager's subgradient is 0
        zero = _is_zero(cv, mag)
        one = cv.expand_to(cv.const(1.0, acc), mag.shape)
        at_zero = cv.expand_to(cv.const(0.0 if ord > 0 else math.inf, acc), mag.shape)
        powered = cv.elementwise("pow", [cv.elementwise("where", [zero, one, mag], acc),
                                         cv.expand_to(cv.const(ord, acc), mag.shape)], acc)
        powered = cv.elementwise("where", [zero, at_zero, powered], acc)
    else:
        powered = cv.elementwise("pow", [mag, cv.expand_to(cv.const(ord, acc), mag.shape)], acc)
    total = _zero_slope_at_zero(cv, cv.reduce("add", powered, axes))
    inv = cv.expand_to(cv.const(1.0 / ord, acc), total.shape)
    return as_result(cv, node, cv.elementwise("pow", [total, inv], acc))


def _is_zero(cv, v: GraphNode) -> GraphNode:
    return cv.elementwise("eq", [v, cv.expand_to(cv.const(0.0, v.dtype), v.shape)], DType.bool)


def _zero_slope_at_zero(cv, total: GraphNode) -> GraphNode:
    """The same value, through which no gradient flows where it is 0: a norm's root
    (sqrt, ** (1/p)) has an infinite slope at 0, where eager's subgradient is 0 (its
    formula masks norm == 0) and differentiating the root would give inf * 0 = NaN."""
    zero = _is_zero(cv, total)
    return cv.elementwise("where", [zero, cv.expand_to(cv.const(0.0, total.dtype), total.shape), total], total.dtype)


# -- normalisations --------------------------------------------------------------------------
def _shifted_exp(cv, x: GraphNode, dim: int, acc: DType):
    """(x - max, exp(x - max), sum of it) over `dim`, all in `acc`, keepdim. The lowering
    recognises sum(exp(a - c)) and computes it online (one read) when it loops."""
    xs = cv.cast(x, acc)
    m = cv.elementwise("stop_gradient", [cv.reduce("max", xs, (dim,))], acc)  # the results do not depend on it
    shifted = cv.elementwise("add", [xs, cv.elementwise("neg", [keepdim_view(cv, m, xs.shape)], acc)], acc)
    e = cv.elementwise("exp", [shifted], acc)
    return shifted, e, cv.reduce("add", e, (dim,))


@register(aten._softmax, aten._log_softmax)
def _softmax(cv, node, x, dim, half_to_float=False):
    acc = opmath(out_dtype(node))
    log = node.target.overloadpacket is aten._log_softmax
    if not x.shape:  # one element: as a line of one (1, log: 0; NaN at inf, -inf or NaN, as eager)
        return cv.view(_softmax(cv, node, cv.view(x, ("reshape", (1,))), 0, half_to_float), ("reshape", ()))
    shifted, e, s = _shifted_exp(cv, x, dim, acc)
    if not log:
        return cv.elementwise("truediv", [e, keepdim_view(cv, s, e.shape)], acc)
    log_s = cv.elementwise("log", [s], acc)
    return cv.elementwise("add", [shifted, cv.elementwise("neg", [keepdim_view(cv, log_s, shifted.shape)], acc)],
                          acc)


@register(aten._safe_softmax)
def _safe_softmax(cv, node, x, dim, dtype=None):
    """softmax, with 0 (not NaN) for a row of nothing but -inf (attention rows that are
    masked out). Eager computes softmax and then selects 0 for such rows, and its backward is
    softmax's, through the selected output (0 there); differentiating that selection instead
    would meet softmax's NaN in the row it drops. So the row is computed safely: its max
    taken as 0 (exp(-inf) = 0, nothing else changes: its max is never subtracted from a
    finite value) and its sum of 0 divided as 1, which gives eager's 0 and a finite
    gradient, and leaves other rows exactly softmax (and the backward's loop body softmax's)."""
    out = out_dtype(node)
    acc = opmath(out)
    if not x.shape:  # one element: the same over a line of one (0 at -inf, NaN at inf or NaN)
        return cv.view(_safe_softmax(cv, node, cv.view(x, ("reshape", (1,))), 0, dtype), ("reshape", ()))
    dim %= len(x.shape)
    xs = cv.cast(cv.cast(x, out), acc)
    m = cv.reduce("max", xs, (dim,))
    empty = cv.elementwise("eq", [m, cv.expand_to(cv.const(-math.inf, acc), m.shape)], DType.bool)
    m = cv.elementwise("where", [empty, cv.expand_to(cv.const(0.0, acc), m.shape), m], acc)
    m = cv.elementwise("stop_gradient", [m], acc)  # the results do not depend on it
    shifted = cv.elementwise("add", [xs, cv.elementwise("neg", [keepdim_view(cv, m, xs.shape)], acc)], acc)
    e = cv.elementwise("exp", [shifted], acc)
    s = cv.reduce("add", e, (dim,))
    # s + 1 where s is 0, else s + 0 (exact): the gradient reaches s as through s itself
    none = cv.elementwise("eq", [s, cv.expand_to(cv.const(0.0, acc), s.shape)], DType.bool)
    one = cv.elementwise("where", [none, cv.expand_to(cv.const(1.0, acc), s.shape),
                                   cv.expand_to(cv.const(0.0, acc), s.shape)], acc)
    s = cv.elementwise("add", [s, cv.elementwise("stop_gradient", [one], acc)], acc)
    return cv.elementwise("truediv", [e, keepdim_view(cv, s, e.shape)], acc)


@register(aten.native_layer_norm)
def _layer_norm(cv, node, x, normalized_shape, weight, bias, eps):
    acc = opmath(x.dtype)
    axes = tuple(range(len(x.shape) - len(normalized_shape), len(x.shape)))
    mean, m2 = moments(cv, node, x, axes, acc)
    n = count(x, axes)
    var = _scaled(cv, X(cv, node, m2, acc), 1.0 / n if n else math.nan)
    rstd = cv.elementwise("rsqrt", [cv.elementwise("add", [var, cv.expand_to(cv.const(eps, acc), var.shape)], acc)],
                          acc)
    xs = cv.cast(x, acc)
    y = cv.elementwise("add", [xs, cv.elementwise("neg", [keepdim_view(cv, mean, xs.shape)], acc)], acc)
    y = cv.elementwise("mul", [y, keepdim_view(cv, rstd, xs.shape)], acc)
    for param, op in ((weight, "mul"), (bias, "add")):
        if param is not None:
            y = cv.elementwise(op, [y, cv.expand_to(cv.cast(param, acc), xs.shape)], acc)
    val = node.meta["val"]
    return (cv.cast(y, DType.from_torch(val[0].dtype)), as_result(cv, node, mean, 1), as_result(cv, node, rstd, 2))


# -- scans -----------------------------------------------------------------------------------
@register(aten.cumsum, aten.cumprod)
def _cumsum(cv, node, x, dim, *, dtype=None):
    op = "add" if node.target.overloadpacket is aten.cumsum else "mul"
    return cv.scan(op, accumulated(cv, node, x), dim)


@register(aten.cummax, aten.cummin)
def _cummax(cv, node, x, dim):
    op = "max" if node.target.overloadpacket is aten.cummax else "min"
    x = _arg_operand(cv, x)
    return (as_result(cv, node, cv.scan(op, x, dim), 0),
            as_result(cv, node, cv.scan("arg" + op, x, dim, DType.int64), 1))


@register(aten.logcumsumexp)
def _logcumsumexp(cv, node, x, dim):
    acc = opmath(out_dtype(node))
    if not acc.is_float:
        raise UnsupportedOpError(str(node.target), f"logcumsumexp of a {x.dtype!r} tensor (eager needs floats too)")
    return cv.scan("logaddexp", cv.cast(x, acc), dim)

"""aten op -> IR translation table.

Every handler gets the converter, the FX node (its meta 'val' is torch's own answer for
the result's dtype and shape, so torch's type promotion is never re-implemented here) and
the op's arguments with tensors already converted to GraphNodes. Composite math
(gelu, softplus, ...) is written in terms of the few IR elementwise ops.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.fx as fx

from ..errors import UnsupportedOpError
from ..ir import DType, GraphNode

aten = torch.ops.aten
HANDLERS: dict[object, Callable] = {}


def register(*ops):
    def wrap(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn
    return wrap


# -- helpers ---------------------------------------------------------------------------------
def out_dtype(node: fx.Node) -> DType:
    return DType.from_torch(node.meta["val"].dtype)


def out_shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def operand(cv, x, dtype: DType, shape) -> GraphNode:
    node = cv.cast(x, dtype) if isinstance(x, GraphNode) else cv.const(x, dtype)
    return cv.expand_to(node, shape)


def compute(cv, node, op, args, dtype: DType = None, result: DType = None) -> GraphNode:
    """`op` over `args` (nodes or scalars) broadcast to the node's shape, computed in `dtype`."""
    result = result or out_dtype(node)
    dtype = dtype or result
    shape = out_shape(node)
    return cv.elementwise(op, [operand(cv, a, dtype, shape) for a in args], result)


def common_dtype(node: fx.Node, *positions: int) -> DType:
    """torch's promoted type of the given arguments (Python scalars count as wrapped numbers)."""
    vals = [_promotion_stand_in(node.args[p]) for p in positions]
    return DType.from_torch(torch.result_type(*vals))


def _promotion_stand_in(arg):
    """A meta tensor with the argument's dtype and zero-dim-ness: all that promotion reads."""
    if isinstance(arg, fx.Node):
        val = arg.meta["val"]
        return torch.empty(() if val.dim() == 0 else (1,), dtype=val.dtype, device="meta")
    return arg


class X:
    """Tiny expression helper so composite ops read like math: x*c + y etc."""

    def __init__(self, cv, node: fx.Node, value: GraphNode, dtype: DType):
        self.cv, self.node, self.value, self.dtype = cv, node, value, dtype

    def _lift(self, other):
        return other.value if isinstance(other, X) else other

    def op(self, name, *others, result=None):
        args = [self.value] + [self._lift(o) for o in others]
        res = result or self.dtype
        return X(self.cv, self.node, compute(self.cv, self.node, name, args, self.dtype, res), res)

    def __add__(self, o): return self.op("add", o)
    def __radd__(self, o): return self.op("add", o)
    def __mul__(self, o): return self.op("mul", o)
    def __rmul__(self, o): return self.op("mul", o)
    def __neg__(self): return self.op("neg")
    def __sub__(self, o): return self + (-(o if isinstance(o, X) else self.wrap(o)))
    def __rsub__(self, o): return self.wrap(o) + (-self)
    def __truediv__(self, o): return self.op("truediv", o)
    def __gt__(self, o): return self.op("gt", o, result=DType.bool)
    def __lt__(self, o): return self.op("lt", o, result=DType.bool)

    def wrap(self, scalar):
        return X(self.cv, self.node, operand(self.cv, scalar, self.dtype, out_shape(self.node)), self.dtype)

    def where(self, a, b):
        """self is a boolean condition: pick a where it holds, else b."""
        dtype = a.dtype if isinstance(a, X) else b.dtype
        shape = out_shape(self.node)
        picked = self.cv.elementwise("where", [self.value, operand(self.cv, self._lift(a), dtype, shape),
                                               operand(self.cv, self._lift(b), dtype, shape)], dtype)
        return X(self.cv, self.node, picked, dtype)


def x_of(cv, node, arg, dtype=None) -> X:
    dtype = dtype or out_dtype(node)
    return X(cv, node, operand(cv, arg, dtype, out_shape(node)), dtype)


# -- arithmetic ---------------------------------------------------------------------------------
@register(aten.add)
def _add(cv, node, a, b, alpha=1):
    if alpha != 1:
        b = compute(cv, node, "mul", [b, alpha])
    return compute(cv, node, "add", [a, b])


@register(aten.sub)
def _sub(cv, node, a, b, alpha=1):
    if alpha != 1:
        b = compute(cv, node, "mul", [b, alpha])
    return compute(cv, node, "add", [a, compute(cv, node, "neg", [b])])


@register(aten.rsub)
def _rsub(cv, node, a, b, alpha=1):
    return _sub(cv, node, b, a, alpha)


@register(aten.mul)
def _mul(cv, node, a, b):
    return compute(cv, node, "mul", [a, b])


@register(aten.div)
def _div(cv, node, a, b, rounding_mode=None):
    op = {None: "truediv", "trunc": "truncdiv", "floor": "floordiv"}[rounding_mode]
    return compute(cv, node, op, [a, b])


@register(aten.floor_divide)
def _floor_divide(cv, node, a, b):
    return compute(cv, node, "floordiv", [a, b])


@register(aten.remainder)
def _remainder(cv, node, a, b):
    return compute(cv, node, "rem", [a, b])


@register(aten.fmod)
def _fmod(cv, node, a, b):
    return compute(cv, node, "fmod", [a, b])


@register(aten.pow)
def _pow(cv, node, base, exponent):
    dtype = out_dtype(node)
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        special = _pow_by_scalar(cv, node, base, exponent, dtype)
        if special is not None:
            return special
        if not dtype.is_float:
            raise UnsupportedOpError("aten.pow", f"integer power by {exponent} (only small exponents 0..4)")
    if not dtype.is_float:
        raise UnsupportedOpError("aten.pow", "integer tensor exponents")
    if isinstance(base, (int, float)) and base == 2:
        return compute(cv, node, "exp2", [exponent])
    return compute(cv, node, "pow", [base, exponent])


def _pow_by_scalar(cv, node, base, e, dtype):
    """The exponents eager computes exactly with multiplications or roots."""
    x = x_of(cv, node, base)
    if e == 0:
        return x.wrap(1).value
    if e == int(e) and 1 <= e <= 4:
        acc = x
        for _ in range(int(e) - 1):
            acc = acc * x
        return acc.value
    if not dtype.is_float:
        return None
    table = {0.5: lambda: x.op("sqrt"), -0.5: lambda: x.op("rsqrt"), -1: lambda: x.op("recip"),
             -2: lambda: (x * x).op("recip")}
    return table[e]().value if e in table else None


# -- unary math -----------------------------------------------------------------------------------
def _unary(ir_op):
    def handler(cv, node, x):
        return compute(cv, node, ir_op, [x])
    return handler


for _name, _ir in {
    "neg": "neg", "abs": "abs", "reciprocal": "recip", "sign": "sign", "sgn": "sign",
    "exp": "exp", "exp2": "exp2", "expm1": "expm1", "log": "log", "log2": "log2", "log1p": "log1p",
    "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin", "acos": "acos",
    "atan": "atan", "sinh": "sinh", "cosh": "cosh", "tanh": "tanh", "asinh": "asinh", "acosh": "acosh",
    "atanh": "atanh", "sigmoid": "sigmoid", "erf": "erf", "floor": "floor", "ceil": "ceil", "trunc": "trunc",
}.items():
    register(getattr(aten, _name))(_unary(_ir))


@register(aten.round)
def _round(cv, node, x, decimals=0):
    if decimals:
        scale = 10.0 ** decimals
        return (x_of(cv, node, x) * scale).op("round").op("truediv", scale).value
    return compute(cv, node, "round", [x])


@register(aten.log10)
def _log10(cv, node, x):
    return (x_of(cv, node, x).op("log2") * math.log10(2.0)).value


@register(aten.frac)
def _frac(cv, node, x):
    v = x_of(cv, node, x)
    return (v - v.op("trunc")).value


@register(aten.atan2)
def _atan2(cv, node, a, b):
    return compute(cv, node, "atan2", [a, b])


@register(aten.isnan)
def _isnan(cv, node, x):
    return compute(cv, node, "isnan", [x], DType.from_torch(node.args[0].meta["val"].dtype))


@register(aten.isinf)
def _isinf(cv, node, x):
    return compute(cv, node, "isinf", [x], DType.from_torch(node.args[0].meta["val"].dtype))


@register(aten.relu)
def _relu(cv, node, x):
    return compute(cv, node, "max", [x, 0])


@register(aten.gelu)
def _gelu(cv, node, x, approximate="none"):
    v = x_of(cv, node, x)
    if approximate == "tanh":
        inner = (v + v * v * v * 0.044715) * math.sqrt(2.0 / math.pi)
        return (v * 0.5 * (inner.op("tanh") + 1)).value
    return (v * 0.5 * ((v * (1.0 / math.sqrt(2.0))).op("erf") + 1)).value


@register(aten.silu)
def _silu(cv, node, x):
    v = x_of(cv, node, x)
    return (v * v.op("sigmoid")).value


@register(aten.softplus)
def _softplus(cv, node, x, beta=1, threshold=20):
    v = x_of(cv, node, x)
    scaled = v * beta
    soft = scaled.op("exp").op("log1p") / beta
    return (scaled > threshold).where(v, soft).value


@register(aten.elu)
def _elu(cv, node, x, alpha=1, scale=1, input_scale=1):
    v = x_of(cv, node, x)
    neg = (v * input_scale).op("expm1") * (alpha * scale)
    return (v > 0).where(v * scale, neg).value


@register(aten.leaky_relu)
def _leaky_relu(cv, node, x, negative_slope=0.01):
    v = x_of(cv, node, x)
    return (v > 0).where(v, v * negative_slope).value


@register(aten.hardtanh)
def _hardtanh(cv, node, x, min_val=-1.0, max_val=1.0):
    return _clamp(cv, node, x, min_val, max_val)


@register(aten.clamp, aten.clamp_min, aten.clamp_max)
def _clamp(cv, node, x, min=None, max=None):
    if node.target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        min, max = None, min
    dtype = out_dtype(node)
    value = operand(cv, x, dtype, out_shape(node))
    if min is not None:
        value = compute(cv, node, "max", [value, min])
    if max is not None:
        value = compute(cv, node, "min", [value, max])
    return value


@register(aten.maximum)
def _maximum(cv, node, a, b):
    return compute(cv, node, "max", [a, b])


@register(aten.minimum)
def _minimum(cv, node, a, b):
    return compute(cv, node, "min", [a, b])


@register(aten.where)
def _where(cv, node, cond, a, b):
    return select(cv, node, operand(cv, cond, DType.bool, out_shape(node)), a, b)


def select(cv, node, cond: GraphNode, a, b) -> GraphNode:
    dtype, shape = out_dtype(node), out_shape(node)
    return cv.elementwise("where", [cond, operand(cv, a, dtype, shape), operand(cv, b, dtype, shape)], dtype)


# -- comparisons, logic, bits -------------------------------------------------------------------------
def _compare(ir_op):
    def handler(cv, node, a, b):
        return compute(cv, node, ir_op, [a, b], common_dtype(node, 0, 1), DType.bool)
    return handler


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    register(getattr(aten, _name))(_compare(_name))


def _logical(ir_op):
    def handler(cv, node, *args):
        operands = [compute(cv, node, "ne", [a, 0], _arg_dtype(node, k), DType.bool) for k, a in enumerate(args)]
        return compute(cv, node, ir_op, operands, DType.bool)
    return handler


for _name in ("logical_and", "logical_or", "logical_xor", "logical_not"):
    register(getattr(aten, _name))(_logical(_name))


def _bitwise(ir_op, logical_op):
    def handler(cv, node, *args):
        if out_dtype(node) is DType.bool:
            return compute(cv, node, logical_op, list(args))
        return compute(cv, node, ir_op, list(args))
    return handler


register(aten.bitwise_and)(_bitwise("bitwise_and", "logical_and"))
register(aten.bitwise_or)(_bitwise("bitwise_or", "logical_or"))
register(aten.bitwise_xor)(_bitwise("bitwise_xor", "logical_xor"))
register(aten.bitwise_not)(_bitwise("bitwise_not", "logical_not"))
register(aten.bitwise_left_shift, aten.__lshift__)(_bitwise("shl", None))
register(aten.bitwise_right_shift, aten.__rshift__)(_bitwise("shr", None))


def _arg_dtype(node: fx.Node, k: int) -> DType:
    arg = node.args[k]
    if isinstance(arg, fx.Node):
        return DType.from_torch(arg.meta["val"].dtype)
    return DType.from_torch(torch.result_type(torch.tensor(0), arg)) if not isinstance(arg, bool) else DType.bool


# -- casts, copies, creation ---------------------------------------------------------------------
@register(aten._to_copy, aten.clone, aten.lift_fresh_copy, aten.alias, aten.detach, aten.positive)
def _copy_like(cv, node, x, *args, **kwargs):
    if isinstance(x, GraphNode) and node.meta["val"].device != node.args[0].meta["val"].device:
        raise UnsupportedOpError(str(node.target), "moving a tensor to another device")
    return cv.cast(x, out_dtype(node))


HANDLERS[torch.ops.prims.convert_element_type.default] = _copy_like


@register(aten.copy)
def _copy(cv, node, dst, src, non_blocking=False):
    return operand(cv, src, out_dtype(node), out_shape(node))


@register(aten.copy_)
def _copy_(cv, node, dst, src, non_blocking=False):
    return cv.assign(node.args[0], operand(cv, src, out_dtype(node), out_shape(node)))


@register(aten.fill)
def _fill(cv, node, dst, value):
    return operand(cv, value, out_dtype(node), out_shape(node))


@register(aten.zero)
def _zero(cv, node, dst):
    return operand(cv, 0, out_dtype(node), out_shape(node))


@register(aten.full, aten.full_like, aten.zeros_like, aten.ones_like, aten.scalar_tensor,
          aten.zeros, aten.ones, aten.empty, aten.empty_like, aten.new_full, aten.new_zeros, aten.new_ones,
          aten.new_empty)
def _full(cv, node, *args, **kwargs):
    fill = {aten.full: 1, aten.full_like: 1, aten.new_full: 2, aten.scalar_tensor: 0}.get(node.target.overloadpacket)
    value = args[fill] if fill is not None else (1 if "ones" in node.target.overloadpacket.__name__ else 0)
    # Uninitialised memory (empty) is filled with zeros: any value is a correct answer for it.
    return operand(cv, value, out_dtype(node), out_shape(node))


# -- views -------------------------------------------------------------------------------------
@register(aten.view, aten._unsafe_view, aten.reshape)
def _reshape(cv, node, x, shape):
    return cv.view(x, ("reshape", tuple(out_shape(node))))


@register(aten.permute)
def _permute(cv, node, x, dims):
    return cv.view(x, ("permute", tuple(dims)))


@register(aten.t)
def _t(cv, node, x):
    return x if len(x.shape) < 2 else cv.view(x, ("permute", (1, 0)))


@register(aten.transpose)
def _transpose(cv, node, x, d0, d1):
    dims = list(range(len(x.shape)))
    if dims:
        dims[d0], dims[d1] = dims[d1], dims[d0]
    return cv.view(x, ("permute", tuple(dims)))


@register(aten.expand)
def _expand(cv, node, x, shape, implicit=False):
    return cv.expand_to(x, out_shape(node))


@register(aten.slice)
def _slice(cv, node, x, dim=0, start=None, end=None, step=1):
    return cv.view(x, ("slice", dim, start, end, step))


@register(aten.select)
def _select(cv, node, x, dim, index):
    return cv.view(x, ("select", dim, index))


@register(aten.unsqueeze)
def _unsqueeze(cv, node, x, dim):
    return cv.view(x, ("unsqueeze", dim))


@register(aten.squeeze)
def _squeeze(cv, node, x, dims=None):
    if isinstance(dims, int):
        dims = (dims,)
    return cv.view(x, ("squeeze", None if dims is None else tuple(dims)))


@register(aten.flip)
def _flip(cv, node, x, dims):
    return cv.view(x, ("flip", tuple(dims)))

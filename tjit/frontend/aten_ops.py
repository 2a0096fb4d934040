"""aten op -> IR translation table.

Every handler gets the converter, the FX node (its meta 'val' is torch's own answer for
the result's dtype and shape, so torch's type promotion is never re-implemented here) and
the op's arguments with tensors already converted to GraphNodes. Composite math
(gelu, softplus, ...) is written in terms of the few IR elementwise ops.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from ..errors import UnsupportedOpError
from ..ir import OPS, DType, GraphNode, OpDef
from .scalars import is_symbolic_number

aten = torch.ops.aten
HANDLERS: dict[object, Callable] = {}


def register(*ops):
    """Register a handler; whatever it computes is cast to torch's result dtype at the end
    (composite math is computed in float32 for float16/bfloat16, as eager's opmath does)."""
    def wrap(fn):
        @functools.wraps(fn)
        def handler(cv, node, *args, **kwargs):
            value = fn(cv, node, *args, **kwargs)
            val = node.meta.get("val")
            if isinstance(value, GraphNode) and isinstance(val, torch.Tensor):
                value = cv.cast(value, DType.from_torch(val.dtype))
            return value
        for op in ops:
            HANDLERS[op] = handler
        return fn
    return wrap


# -- helpers ---------------------------------------------------------------------------------
def out_dtype(node: fx.Node) -> DType:
    return DType.from_torch(node.meta["val"].dtype)


def out_shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def operand(cv, x, dtype: DType, shape) -> GraphNode:
    return cv.expand_to(in_type(cv, x, dtype), shape)


def in_type(cv, x, dtype: DType) -> GraphNode:
    """A tensor or Python scalar converted to `dtype` (float16/bfloat16 round, ints wrap)."""
    return cv.cast(x, dtype) if isinstance(x, GraphNode) else cv.const(representable(x, dtype), dtype)


def representable(value, dtype: DType):
    """A Python scalar as the nearest value of `dtype`, as eager converts scalars: constants
    then stay exact however often they are re-typed (a cast of a constant just re-types it)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if dtype is DType.bool:
        return bool(value)
    if dtype.is_float:
        value = float(value)
        if dtype is DType.float64 or value != value:
            return value
        return torch.tensor(value, dtype=torch.float64).to(dtype.torch).item()
    value = int(value)
    bits = dtype.itemsize * 8
    value &= (1 << bits) - 1
    return value - (1 << bits) if dtype.is_signed_int and value >= 1 << (bits - 1) else value


def opmath(dtype: DType) -> DType:
    """The type eager computes in: float16 and bfloat16 are computed in float32."""
    return DType.float32 if dtype.is_low_precision else dtype


def compute(cv, node, op, args, dtype: DType = None, result: DType = None, exact_scalars: bool = False) -> GraphNode:
    """`op` over `args` (nodes or scalars) broadcast to the node's shape, computed in `dtype`,
    then rounded once to `result`. float16/bfloat16 are computed in float32 (opmath), with
    the operands converted to `dtype` first (int64 -> bfloat16 rounds), as eager's kernels do;
    with `exact_scalars`, a Python scalar or 0-dim tensor as the second operand skips that
    rounding (eager's mul and div kernels read it at float32 precision; add, sub, comparisons,
    fmod, ... round it)."""
    result = result or out_dtype(node)
    dtype = dtype or result
    work = opmath(dtype)
    shape = out_shape(node)
    if work != dtype:
        args = [a if exact_scalars and k == 1 and (_is_number(a) or a.shape == ()) else in_type(cv, a, dtype)
                for k, a in enumerate(args)]
    value = cv.elementwise(op, [operand(cv, a, work, shape) for a in args], work if result == dtype else result)
    return cv.cast(value, result)


def _is_number(x) -> bool:
    return isinstance(x, (int, float))


def is_number_argument(node: fx.Node, position: int) -> bool:
    """The op's argument is a Python number: a literal, or one read from tensor data, which
    the converter passes as a 0-d value but torch's kernels treat as a number."""
    arg = node.args[position] if position < len(node.args) else None
    return not isinstance(arg, fx.Node) or is_symbolic_number(arg.meta.get("val"))


def input_dtypes(node: fx.Node) -> list[torch.dtype]:
    return [a.meta["val"].dtype for a in node.args if isinstance(a, fx.Node)
            and isinstance(a.meta.get("val"), torch.Tensor)]


_CPP_NAMES = {torch.bool: "Bool", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
              torch.float64: "Double", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
              torch.int8: "Char", torch.uint8: "Byte"}


def refuse_dtypes(node: fx.Node, kernel: str, refused, dtypes=None) -> None:
    """Eager's kernels reject some dtypes that torch's meta functions (what tracing runs)
    accept; refuse them the same way instead of computing an answer eager never gives.
    `dtypes`: the types eager's kernel is dispatched on (default: the tensor inputs')."""
    for d in (input_dtypes(node) if dtypes is None else dtypes):
        d = d.torch if isinstance(d, DType) else d
        if d in refused:
            raise UnsupportedOpError(str(node.target), f'"{kernel}" not implemented for \'{_CPP_NAMES.get(d, d)}\' '
                                                       "(eager refuses it too)")


FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_TYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def common_dtype(node: fx.Node, *positions: int) -> DType:
    """torch's promoted type of the given arguments (Python scalars count as wrapped numbers)."""
    if len(positions) == 1:
        return _arg_dtype(node, positions[0])
    vals = [_promotion_stand_in(node.args[p]) for p in positions]
    return DType.from_torch(torch.result_type(*vals))


def _promotion_stand_in(arg):
    """A meta tensor with the argument's dtype and zero-dim-ness: all that promotion reads."""
    if isinstance(arg, fx.Node):
        val = arg.meta["val"]
        if is_symbolic_number(val):  # a number read from tensor data
            return {torch.SymBool: False, torch.SymInt: 0, torch.SymFloat: 0.0}[type(val)]
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
    """`arg` as an X in the op's compute type (float32 for float16/bfloat16 results; a tensor
    of another type is converted to the result type first, as eager's kernels see it)."""
    if dtype is None:
        out = out_dtype(node)
        dtype = opmath(out)
        if dtype != out and isinstance(arg, GraphNode):
            arg = cv.cast(arg, out)
    return X(cv, node, operand(cv, arg, dtype, out_shape(node)), dtype)


def differentiated_as(value: X, surrogate: X) -> X:
    """`value`, whose gradient is `surrogate`'s (straight_through): eager's derivative
    formula, where the IR's derivative of the formula that computes the value differs from it
    at special points (a select's untaken side, a quotient's 0 / 0). The surrogate's own value
    is not used; it is written as x * stop_gradient(slope), or x / stop_gradient(denominator),
    so that its derivative is eager's product or quotient."""
    return surrogate.op("straight_through", value)


# -- arithmetic ---------------------------------------------------------------------------------
def _check_alpha(node, alpha) -> None:
    """eager's add and sub refuse a float alpha for an integer or bool result (torch's meta
    function lets bool through)."""
    float_alpha = isinstance(alpha, float) or (isinstance(alpha, GraphNode) and alpha.dtype.is_float)
    if float_alpha and not out_dtype(node).is_float:
        raise UnsupportedOpError(str(node.target), "For integral input tensors, argument alpha must not be a "
                                                   "floating point number. (eager refuses it too)")
    checked_number(node, alpha)


@register(aten.add)
def _add(cv, node, a, b, alpha=1):
    _check_alpha(node, alpha)
    dtype = out_dtype(node)
    work = opmath(dtype)
    a, b = in_type(cv, a, dtype), in_type(cv, b, dtype)  # scalars too: eager's add rounds them
    if alpha != 1:  # eager computes a + alpha * b as one fused multiply-add, alpha rounded to the type
        return compute(cv, node, "fma", [b, in_type(cv, alpha, dtype), a], work, work)
    return compute(cv, node, "add", [a, b], work, work)


@register(aten.sub)
def _sub(cv, node, a, b, alpha=1):
    if torch.bool in input_dtypes(node) or isinstance(a, bool) or isinstance(b, bool):
        raise UnsupportedOpError(str(node.target), "Subtraction, the `-` operator, with a bool tensor is not "
                                                   "supported (eager refuses it too)")
    _check_alpha(node, alpha)
    dtype = out_dtype(node)
    work = opmath(dtype)
    a, b = in_type(cv, a, dtype), in_type(cv, b, dtype)
    if alpha != 1:  # a - alpha * b, one fused multiply-add as in eager (alpha rounded to the type)
        alpha = in_type(cv, alpha, dtype)
        return compute(cv, node, "fma", [b, cv.elementwise("neg", [alpha], dtype), a], work, work)
    return compute(cv, node, "add", [a, compute(cv, node, "neg", [b], work, work)], work, work)


@register(aten.rsub)
def _rsub(cv, node, a, b, alpha=1):
    return _sub(cv, node, b, a, alpha)


@register(aten.mul)
def _mul(cv, node, a, b):
    return compute(cv, node, "mul", [a, b], exact_scalars=True)


@register(aten.div)
def _div(cv, node, a, b, rounding_mode=None):
    op = {None: "truediv", "trunc": "truncdiv", "floor": "floordiv"}[rounding_mode]
    if rounding_mode is not None:
        refuse_dtypes(node, f"div_{rounding_mode}_cpu", (torch.bool,), [common_dtype(node, 0, 1)])
    if out_dtype(node).is_low_precision and isinstance(b, GraphNode) and b.shape:
        # eager's float16/bfloat16 kernels for two tensors round every step to the type
        # (with a scalar divisor they compute in float32)
        if rounding_mode == "trunc":
            return compute(cv, node, "trunc", [compute(cv, node, "truediv", [a, b])])
        if rounding_mode == "floor":
            return _reduced_floordiv(cv, node, a, b)
    return compute(cv, node, op, [a, b], exact_scalars=True)


def _reduced_floordiv(cv, node, a, b):
    """torch's div_floor_floating in c10::Half / c10::BFloat16 arithmetic: each step rounds
    to the type (2680 // 3.140625 is 852 there, not 853)."""
    def rounded(op, *args):
        return compute(cv, node, op, list(args))

    def where(cond, x, y):
        return select(cv, node, cond, x, y)

    def test(op, *args):
        return compute(cv, node, op, list(args), out_dtype(node), DType.bool)

    a, b = in_type(cv, a, out_dtype(node)), in_type(cv, b, out_dtype(node))
    m = rounded("fmod", a, b)
    div = rounded("truediv", rounded("add", a, rounded("neg", m)), b)
    fix = compute(cv, node, "logical_and", [test("ne", m, 0), test("ne", test("lt", b, 0), test("lt", m, 0))],
                  DType.bool)
    div = where(fix, rounded("add", div, -1.0), div)
    floor = rounded("floor", div)
    floor = where(test("gt", rounded("add", div, rounded("neg", floor)), 0.5), rounded("add", floor, 1.0), floor)
    quotient = rounded("truediv", a, b)
    zero = where(test("signbit", quotient), operand(cv, -0.0, out_dtype(node), out_shape(node)),
                 operand(cv, 0.0, out_dtype(node), out_shape(node)))
    floor = where(test("eq", div, 0), zero, floor)
    return where(test("eq", b, 0), quotient, floor)


@register(aten.floor_divide)
def _floor_divide(cv, node, a, b):
    refuse_dtypes(node, "div_floor_cpu", (torch.bool,), [common_dtype(node, 0, 1)])
    if out_dtype(node).is_low_precision and isinstance(b, GraphNode) and b.shape:
        return _reduced_floordiv(cv, node, a, b)
    return compute(cv, node, "floordiv", [a, b], exact_scalars=True)


@register(aten.remainder)
def _remainder(cv, node, a, b):
    refuse_dtypes(node, "remainder_cpu", (torch.bool,), [common_dtype(node, 0, 1)])
    return compute(cv, node, "rem", [a, b])


@register(aten.fmod)
def _fmod(cv, node, a, b):
    refuse_dtypes(node, "fmod_cpu", (torch.bool,), [common_dtype(node, 0, 1)])
    return compute(cv, node, "fmod", [a, b])


@register(aten.pow)
def _pow(cv, node, base, exponent):
    dtype = out_dtype(node)
    refuse_dtypes(node, "pow", (torch.bool,), [common_dtype(node, 0, 1)])
    if _is_number(exponent):
        if not dtype.is_float or dtype.is_low_precision:  # (eager converts it to the tensor's type, checked)
            checked_number(node, exponent)
        if not dtype.is_float:
            return _int_pow_by_scalar(cv, node, base, int(exponent))
        if dtype.is_low_precision:  # eager converts the exponent to the tensor's type first
            exponent = representable(exponent, dtype)
        special = _pow_by_scalar(cv, node, base, exponent, dtype)
        if special is not None:
            return special
    return compute(cv, node, "pow", [base, exponent])


def _pow_by_scalar(cv, node, base, e, dtype: DType):
    """The exponents eager computes with multiplications or roots (pow_tensor_scalar_kernel);
    float16 has only std::pow there, whose answers differ from sqrt's at -inf and -0."""
    x = x_of(cv, node, base)
    if e == 0:
        return x.wrap(1).value  # even NaN ** 0 is 1
    table = {1: lambda: x, 2: lambda: x * x, 3: lambda: x * x * x, -1: lambda: x.op("recip"),
             -2: lambda: differentiated_as((x * x).op("recip"), x.op("pow", -2.0))}  # (eager's -2 x^-3: inf at 0)
    if dtype is not DType.float16:
        table.update({0.5: lambda: x.op("sqrt"), -0.5: lambda: x.op("rsqrt")})
    return table[e]().value if e in table else None


def _int_pow_by_scalar(cv, node, base, e: int):
    if e < 0:
        raise UnsupportedOpError("aten.pow", "Integers to negative integer powers are not allowed. (as in eager)")
    x = x_of(cv, node, base)
    if e == 0:
        return x.wrap(1).value
    result, power = None, x
    while e:  # square and multiply; integer products wrap as eager's do
        if e & 1:
            result = power if result is None else result * power
        e >>= 1
        if e:
            power = power * power
    return result.value


# -- aten ops that are one IR op (the registry's OpDef.aten) ----------------------------------------
NO_BOOL_KERNEL = frozenset({"abs", "floor", "ceil", "trunc"})  # eager has none for these (meta accepts bool)


def translate(op: OpDef) -> None:
    """Registers the handlers of the aten ops that are `op`."""
    for name in op.aten:
        register(getattr(aten, name))(_direct(op, name))


def _direct(op: OpDef, name: str):
    def handler(cv, node, *args):
        if name in NO_BOOL_KERNEL:
            refuse_dtypes(node, f"{name}_cpu", (torch.bool,))
        if op.operand_typed:  # computed in the operands' promoted type (comparisons, predicates)
            return compute(cv, node, op.name, list(args), common_dtype(node, *range(len(args))))
        return compute(cv, node, op.name, list(args))
    return handler


for _op in OPS.values():
    translate(_op)


@register(aten.round)
def _round(cv, node, x, decimals=0):
    refuse_dtypes(node, "round_cpu", (torch.bool,))
    if decimals:
        refuse_dtypes(node, "round_cpu", INT_TYPES)
        # eager: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d for d < 0, in opmath
        v = x_of(cv, node, x)
        if decimals > 0:
            return (v * 10.0 ** decimals).op("round").op("truediv", 10.0 ** decimals).value
        return v.op("truediv", 10.0 ** -decimals).op("round").op("mul", 10.0 ** -decimals).value
    return compute(cv, node, "round", [x])


@register(aten.log10)
def _log10(cv, node, x):
    return (x_of(cv, node, x).op("log2") * math.log10(2.0)).value


@register(aten.relu)
def _relu(cv, node, x):
    if node.args[0].meta["val"].dtype == torch.bool:
        raise UnsupportedOpError("aten.relu", "Boolean inputs not supported for relu (as in eager)")
    return _bounded(cv, node, x, 0, "le")


def _bounded(cv, node, value, bound, bites: str) -> GraphNode:
    """`bound` where `value bites bound` ("lt": clamp from below, "gt": from above), else
    value: max/min written as a select, so NaN passes through and the gradient is eager's
    (all of it to value where the bound does not bite, ties included; relu's "le" gives
    none at 0, as eager's relu backward does)."""
    dtype, shape = out_dtype(node), out_shape(node)
    work = opmath(dtype)
    nan_bound = work.is_float and not (_is_number(bound) and bound == bound)  # a NaN bound gives NaN
    value, bound = (operand(cv, in_type(cv, a, dtype), work, shape) for a in (value, bound))
    test = cv.elementwise(bites, [value, bound], DType.bool)
    if nan_bound:
        test = cv.elementwise("logical_or", [test, cv.elementwise("isnan", [bound], DType.bool)], DType.bool)
    return cv.cast(cv.elementwise("where", [test, bound, value], work), dtype)


@register(aten.gelu)
def _gelu(cv, node, x, approximate="none"):
    refuse_dtypes(node, "GeluKernelImpl", INT_TYPES)
    v = x_of(cv, node, x)
    if approximate == "tanh":
        inner = (v + v * v * v * 0.044715) * math.sqrt(2.0 / math.pi)
        return (v * 0.5 * (inner.op("tanh") + 1)).value
    return (v * 0.5 * ((v * (1.0 / math.sqrt(2.0))).op("erf") + 1)).value


# The activations below are decomposed by tjit's tracer today (torch's core decompositions),
# so these handlers run once the tracer keeps the ops whole; they follow eager's kernels,
# including the integer and bool inputs eager refuses and the decompositions accept.
def _float_activation(kernel):
    def wrap(fn):
        def handler(cv, node, x, *args, **kwargs):
            refuse_dtypes(node, kernel, INT_TYPES)
            return fn(cv, node, x, *args, **kwargs)
        return functools.wraps(fn)(handler)
    return wrap


@register(aten.silu)
@_float_activation("silu_cpu")
def _silu(cv, node, x):
    v = x_of(cv, node, x)
    return (v * v.op("sigmoid")).value


@register(aten.softplus)
@_float_activation("softplus_cpu")
def _softplus(cv, node, x, beta=1, threshold=20):
    v = x_of(cv, node, x)
    return _softplus_of(v, beta, threshold).value


def _softplus_of(v: X, beta=1, threshold=20) -> X:
    """log1p(exp(v * beta)) / beta, v itself above the threshold. The exponential is taken of 0
    where it is not used: exp(89) is inf, and its derivative, inf times the select's 0, made
    the gradient NaN (eager's is 1)."""
    scaled = v * beta
    above = scaled > threshold
    soft = above.where(scaled.wrap(0.0), scaled).op("exp").op("log1p") / beta
    return above.where(v, soft)


@register(aten.mish)
@_float_activation("mish_cpu")
def _mish(cv, node, x):
    # (softplus above 20 is v in float32 and float64 alike, and so is tanh of it: 1; its
    # gradient is eager's, not exp(v) / (1 + exp(v)), NaN past 88.7)
    v = x_of(cv, node, x)
    return (v * _softplus_of(v).op("tanh")).value


@register(aten.hardsigmoid)
@_float_activation("hardsigmoid_cpu")
def _hardsigmoid(cv, node, x):
    # (eager's gradient is 1/6 strictly inside (-3, 3) only: 0 at NaN too, which the clamp passes)
    t = x_of(cv, node, x) + 3.0
    inside = (t > 0.0).op("logical_and", t < 6.0, result=DType.bool)
    return (inside.where(t, _clamped_by_selects(t, 0.0, 6.0).op("stop_gradient")) / 6.0).value


@register(aten.hardswish)
@_float_activation("hardswish_cpu")
def _hardswish(cv, node, x):
    v = x_of(cv, node, x)
    return (v * _clamped_by_selects(v + 3.0, 0.0, 6.0) / 6.0).value


def _clamped_by_selects(t: X, low: float, high: float) -> X:
    """t clamped to [low, high] by two selects in t's own (computing) type, a bound taken
    where t reaches it: the gradient at x = +-3 is eager's (hardsigmoid's 0 there, not a
    min/max tie's half), and NaN passes through."""
    t = t.op("le", low, result=DType.bool).where(t.wrap(low), t)
    return t.op("ge", high, result=DType.bool).where(t.wrap(high), t)


@register(aten.frac)
@_float_activation("frac_cpu")
def _frac(cv, node, x):
    v = x_of(cv, node, x)
    return (v - v.op("trunc")).value


@register(aten.elu)
@_float_activation("elu_cpu")
def _elu(cv, node, x, alpha=1, scale=1, input_scale=1):
    v = x_of(cv, node, x)
    positive = v > 0
    # (the exponential of 0 where it is not used: its derivative at v = 89, inf, made the gradient NaN)
    neg = (positive.where(v.wrap(0.0), v) * input_scale).op("expm1") * (alpha * scale)
    return positive.where(v * scale, neg).value


@register(aten.celu)
@_float_activation("elu_cpu")
def _celu(cv, node, x, alpha=1.0):
    return _elu(cv, node, x, alpha, 1.0, 1.0 / alpha)


@register(aten.selu)
@_float_activation("elu_cpu")
def _selu(cv, node, x):
    return _elu(cv, node, x, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946)


@register(aten.lerp)
def _lerp(cv, node, start, end, weight):
    """eager: |weight| < 0.5 ? start + weight * (end - start) : end - (end - start) * (1 - weight)"""
    dtypes = input_dtypes(node)
    if any(d != dtypes[0] for d in dtypes):
        raise UnsupportedOpError("aten.lerp", f"expected dtype {dtypes[0]} for `end` but got dtype "
                                              f"{next(d for d in dtypes if d != dtypes[0])} (eager refuses it too)")
    refuse_dtypes(node, "lerp_kernel_tensor" if isinstance(weight, GraphNode) else "lerp_kernel_scalar", INT_TYPES)
    a, b = x_of(cv, node, start), x_of(cv, node, end)
    # a Python number weight (read by .item() too) is not rounded to the type first; a tensor is
    w = x_of(cv, node, weight, opmath(out_dtype(node))) if is_number_argument(node, 2) else x_of(cv, node, weight)
    diff = b - a
    return (w.op("abs") < 0.5).where(a + w * diff, b - diff * (1.0 - w)).value


@register(aten.addcmul)
def _addcmul(cv, node, x, t1, t2, value=1):
    """eager: self + value * t1 * t2 with one rounding for the last multiply-add (an fma)."""
    refuse_dtypes(node, "addcmul_cpu_out", (torch.bool,), [out_dtype(node)])  # dispatched on the result type
    dtype = out_dtype(node)
    work = opmath(dtype)
    a, b, c = (in_type(cv, v, dtype) for v in (x, t1, t2))
    scaled = compute(cv, node, "mul", [b, value], work, work)
    return compute(cv, node, "fma", [scaled, c, a], work, work)


@register("prims::fma")  # (by name: Inductor defines the op when it is imported, after tjit may be)
def _fma(cv, node, a, b, c):
    """a * b + c rounded once (Dynamo writes `x.addcdiv_(t1, t2, value=v)` and
    `x.addcmul_(..., value=v)` as this Inductor prim: a single-tensor Adam step has three)."""
    return compute(cv, node, "fma", [a, b, c])


@register(aten.addcdiv)
def _addcdiv(cv, node, x, t1, t2, value=1):
    """eager: self + (value * t1) / t2; integer tensors are refused."""
    if not out_dtype(node).is_float:
        raise UnsupportedOpError("aten.addcdiv", "Integer division with addcdiv is no longer supported "
                                                 "(eager refuses it too)")
    dtype = out_dtype(node)
    work = opmath(dtype)
    a, b, c = (in_type(cv, v, dtype) for v in (x, t1, t2))
    scaled = compute(cv, node, "mul", [b, value], work, work)
    quotient = compute(cv, node, "truediv", [scaled, c], work, work)
    return compute(cv, node, "add", [a, quotient], work, work)


@register(aten.leaky_relu)
def _leaky_relu(cv, node, x, negative_slope=0.01):
    v = x_of(cv, node, x)
    return (v > 0).where(v, v * negative_slope).value


@register(aten.hardtanh)
def _hardtanh(cv, node, x, min_val=-1.0, max_val=1.0):
    # clamp's values; eager's hardtanh gradient stops at the bounds themselves (clamp's passes)
    value = _bounded(cv, node, operand(cv, x, out_dtype(node), out_shape(node)), min_val, "le")
    return _bounded(cv, node, value, max_val, "ge")


@register(aten.clamp, aten.clamp_min, aten.clamp_max)
def _clamp(cv, node, x, min=None, max=None):
    if node.target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        min, max = None, min
    min, max = checked_number(node, min), checked_number(node, max)
    given = operand(cv, x, out_dtype(node), out_shape(node))
    value = given
    if min is not None:
        value = _bounded(cv, node, value, min, "lt")
    if max is not None:
        value = _bounded(cv, node, value, max, "gt")
    if given.dtype.is_float:  # eager's gradient is 0 at NaN (x >= min and x <= max fails there)
        nan = cv.elementwise("isnan", [given], DType.bool)
        value = cv.elementwise("where", [nan, cv.elementwise("stop_gradient", [given], given.dtype), value],
                               value.dtype)
    return value


@register(aten.fmax, aten.fmin)
def _fmax_fmin(cv, node, a, b):
    """Like maximum/minimum, but a NaN loses to a number: a where(a >= b or b is NaN, a, b)
    for fmax, as eager's derivative has it (a tie's gradient all to a, not split as
    maximum's; ties are common in 16-bit types)."""
    fmax = node.target.overloadpacket is aten.fmax
    if not out_dtype(node).is_float:
        return compute(cv, node, "max" if fmax else "min", [a, b])
    x, y = x_of(cv, node, a), x_of(cv, node, b)
    keeps_x = x.op("ge" if fmax else "le", y, result=DType.bool).op("logical_or", y.op("isnan", result=DType.bool),
                                                                    result=DType.bool)
    return keeps_x.where(x, y).value


@register(aten.xlogy)
def _xlogy(cv, node, a, b):
    """x * log(y), 0 where x == 0 unless y is NaN, written so that the IR's derivative is
    eager's: d/dx is log(y) at x == 0 too (0 only where y <= 0 there), d/dy is x / y."""
    x, y = x_of(cv, node, a), x_of(cv, node, b)
    outside_log = y.op("le", 0.0, result=DType.bool).op("logical_or", y.op("eq", math.inf, result=DType.bool),
                                                        result=DType.bool)
    at_zero = x.op("eq", 0.0, result=DType.bool).op("logical_and", outside_log, result=DType.bool)
    # (log of 1 where the product is not taken: its gradient there is 0, not 0 * NaN)
    product = x * at_zero.where(y.wrap(1.0), y).op("log")
    return at_zero.where(x.wrap(0.0), product).value


@register(aten.special_xlog1py)
def _xlog1py(cv, node, a, b):
    """x * log1p(y), 0 where x == 0 unless y is NaN, written as xlogy is so that the IR's
    derivative is eager's: d/dx is log1p(y) at x == 0 too (0 only where y <= -1 there; the
    decomposition's select gave 0 wherever x == 0), d/dy is x / (1 + y)."""
    x, y = x_of(cv, node, a), x_of(cv, node, b)
    outside_log = y.op("le", -1.0, result=DType.bool).op("logical_or", y.op("eq", math.inf, result=DType.bool),
                                                         result=DType.bool)
    at_zero = x.op("eq", 0.0, result=DType.bool).op("logical_and", outside_log, result=DType.bool)
    product = x * at_zero.where(y.wrap(0.0), y).op("log1p")
    return at_zero.where(x.wrap(0.0), product).value


@register(aten.special_entr)
def _entr(cv, node, a):
    """eager's -x log(x) for x > 0, 0 at 0, -inf below 0 and x itself where NaN; its gradient
    eager's -(log(x) + 1): +inf at 0, where the selects' derivative was 0 * -inf (NaN)."""
    x = x_of(cv, node, a)
    below = x.op("eq", 0.0, result=DType.bool).where(x.wrap(0.0), x.wrap(-math.inf))
    value = x.op("isnan", result=DType.bool).where(x, (x > 0).where(-x * x.op("log"), below))
    slope = -(x.op("log") + 1.0)
    return differentiated_as(value, x * slope.op("stop_gradient")).value


@register(aten.logit)
def _logit(cv, node, a, eps=None):
    """log(x / (1 - x)), x first clamped to [eps, 1 - eps] given an eps (the values of torch's
    decomposition); the gradient eager's logit_backward: g / (x (1 - x)), inf at 0 and 1
    (the quotient's derivative gave NaN there), NaN outside [0, 1] without an eps (it gave
    a finite slope of the NaN value), 0 outside [eps, 1 - eps] with one."""
    x = x_of(cv, node, a)
    lo, hi, off = (0.0, 1.0, math.nan) if eps is None else (eps, 1.0 - eps, math.inf)
    z = x if eps is None else _clamped_by_selects(x, lo, hi)
    value = (z / (1.0 - z)).op("log")
    outside = (x < lo).op("logical_or", x > hi, result=DType.bool)
    denominator = outside.where(x.wrap(off), x * (1.0 - x))
    return differentiated_as(value, x / denominator.op("stop_gradient")).value


@register(aten.sinc)
def _sinc(cv, node, a):
    """sin(a) / a for a = pi x, and its Taylor series where |a| < 1/2 (to a^8: exact in
    float32 there). The series' derivative is well conditioned near 0, where the quotient
    rule's (and eager's formula's) a cos(a) - sin(a) cancels, and it is 0 at x == 0 (the
    quotient, taken at a = 1 there, gets no gradient; eager's is 0 too)."""
    angle = x_of(cv, node, a) * math.pi
    small = angle.op("abs") < 0.5
    t = angle * angle
    series = 1.0 + t * (-1 / 6 + t * (1 / 120 + t * (-1 / 5040 + t * (1 / 362880))))
    safe = small.where(angle.wrap(1.0), angle)
    return small.where(series, safe.op("sin") / safe).value


@register(aten.copysign)
def _copysign(cv, node, a, b):
    magnitude = x_of(cv, node, a).op("abs")
    negative = X(cv, node, compute(cv, node, "signbit", [b], _arg_dtype(node, 1), DType.bool), DType.bool)
    return negative.where(-magnitude, magnitude).value


@register(aten.hypot)
def _hypot(cv, node, a, b):
    """max * sqrt(1 + (min/max)^2): no overflow or underflow in the squares; inf wins over NaN."""
    refuse_dtypes(node, "hypot_cpu", INT_TYPES, [out_dtype(node)])
    p, q = x_of(cv, node, a), x_of(cv, node, b)
    x, y = p.op("abs"), q.op("abs")
    hi, lo = x.op("max", y), x.op("min", y)
    ratio = (hi > 0).where(lo / hi, hi.wrap(0.0))
    r = hi * (ratio * ratio + 1.0).op("sqrt")
    is_inf = x.op("isinf", result=DType.bool).op("logical_or", y.op("isinf", result=DType.bool), result=DType.bool)
    value = is_inf.where(hi.wrap(math.inf), r)
    # eager's gradient, g * a / result: the ratio's derivative overflowed where the squares
    # of a tiny max underflow (NaN where eager's is finite)
    result = value.op("stop_gradient")
    slopes = p * (p / result).op("stop_gradient") + q * (q / result).op("stop_gradient")
    return differentiated_as(value, slopes).value


@register(aten.where)
def _where(cv, node, cond, a, b):
    a, b = checked_number(node, a), checked_number(node, b)
    return select(cv, node, operand(cv, cond, DType.bool, out_shape(node)), a, b)


def select(cv, node, cond: GraphNode, a, b) -> GraphNode:
    dtype, shape = out_dtype(node), out_shape(node)
    return cv.elementwise("where", [cond, operand(cv, a, dtype, shape), operand(cv, b, dtype, shape)], dtype)


# -- comparisons, logic, bits -------------------------------------------------------------------------
def _logical(ir_op):
    def handler(cv, node, *args):
        # operands are converted to their common type first, as eager's kernels see them
        # (an int64 0-dim INT64_MIN beside an int8 tensor wraps to 0 there: False)
        common = common_dtype(node, *range(len(args)))
        operands = [compute(cv, node, "ne", [a, 0], common, DType.bool) for a in args]
        return compute(cv, node, ir_op, operands, DType.bool)
    return handler


for _name in ("logical_and", "logical_or", "logical_xor", "logical_not"):
    register(getattr(aten, _name))(_logical(_name))


def _bitwise(ir_op, logical_op):
    def handler(cv, node, *args):
        if out_dtype(node).is_float:
            refuse_dtypes(node, f"{ir_op}_cpu", FLOAT_TYPES)
            raise UnsupportedOpError(str(node.target), f"{ir_op} of floating-point values (eager refuses it too)")
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
@register(aten.detach)
def _detach(cv, node, x):
    """The same values, through which no gradient flows (x.detach(), x.data)."""
    if not isinstance(x, GraphNode) or not x.dtype.is_float:
        return x
    return cv.elementwise("stop_gradient", [x], x.dtype)


@register(aten._to_copy, aten.clone, aten.lift_fresh_copy, aten.alias, aten.positive)
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
    return operand(cv, checked_fill_value(node, value), out_dtype(node), out_shape(node))


def checked_fill_value(node: fx.Node, value):
    """eager refuses to fill a tensor with a value its type cannot hold (1e6 as float16,
    300 as int8: eager checks only when it fills two or more elements); so does tjit."""
    return checked_number(node, value, min(math.prod(out_shape(node)), 2))


def checked_number(node: fx.Node, value, elements: int = 2):
    """A Python number the op converts to its result's type with eager's overflow check (a
    clamp's bounds, where's and add's alpha: 300 for int8 raises): refused as eager refuses it."""
    if _is_number(value):
        try:
            torch.empty((elements,), dtype=out_dtype(node).torch).fill_(value)
        except RuntimeError as e:
            raise UnsupportedOpError(str(node.target), f"{e} (eager refuses it too)") from None
    return value


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
    return operand(cv, checked_fill_value(node, value), out_dtype(node), out_shape(node))


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


@register(aten.split_with_sizes, aten.split)
def _split(cv, node, x, sizes, dim=0):
    """chunk / split: consecutive slices along dim (the last may be shorter)."""
    extent = x.shape[dim] if x.shape else 1
    if isinstance(sizes, int):
        sizes = [min(sizes, extent - start) for start in range(0, extent, sizes)] if sizes else [extent]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return tuple(cv.view(x, ("slice", dim, start, start + size, 1)) for start, size in zip(starts, sizes))


@register(aten.diagonal)
def _diagonal(cv, node, x, offset=0, dim1=0, dim2=1):
    return cv.view(x, ("diagonal", offset, dim1, dim2))


@register(aten.unbind)
def _unbind(cv, node, x, dim=0):
    return tuple(cv.view(x, ("select", dim, k)) for k in range(x.shape[dim]))


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


# -- multi-output ops --------------------------------------------------------------------------
@register(operator.getitem)
def _getitem(cv, node, values, index):
    return values[index]


from . import reduce_ops  # noqa: E402,F401  (registers the reduction handlers)
from . import index_ops  # noqa: E402,F401  (registers the indexed reads)
from . import shape_ops  # noqa: E402,F401  (registers arange, cat, pad, repeat)
from . import matmul  # noqa: E402,F401  (registers mm, bmm, addmm, baddbmm)

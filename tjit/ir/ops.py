"""The op registry: every elementwise op of the IR, defined once with all tjit knows of it.

An `OpDef` holds an op's arity, its Triton expression by operand kind (lower/elementwise.py
renders it), its gradient rule or the explicit mark `NO_GRAD`, and the aten ops that
translate to it one to one (frontend/aten_ops.py registers them). The vocabulary is kept
small because everything fuses later: subtraction is add+neg; casts are `cast` (the target
is the node's dtype). Operands of an op have the node's compute dtype (the frontend inserts
casts), except where `operand_typed` says the result type differs from theirs (comparisons,
predicates, cast) and `where`'s condition.

Gradient rules live in autograd/vjp.py (they build IR through autograd's Algebra, which ir
does not import): an op whose `grad` is None here gets its rule there, by `define_gradient`
under the op's name. An op with neither a rule nor NO_GRAD is a compile-time error when a
gradient flows through it, never a silent zero gradient (tests/test_op_registry.py checks
that none is left without).

Adding an op: an OpDef in OPS below, its rule in autograd/vjp.py (or NO_GRAD), and tests
(docs/architecture.md, "Ops").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

from .dtype import DType


class _NoGrad:
    def __repr__(self) -> str:
        return "NO_GRAD"


# The mark of an op through which no gradient flows, by its nature: piecewise constant
# (rounding, sign, floor division), comparisons and predicates (bool results), bit ops
# (integers), and stop_gradient by definition.
NO_GRAD = _NoGrad()

# rule(alg, g, y, *xs) -> one gradient (or None) per operand: g the gradient of the op's
# value y, xs its operands' values, alg an autograd Algebra to build them with
GradRule = Callable[..., tuple]


@dataclass(frozen=True)
class OpDef:
    """One elementwise op. Triton templates are Python format strings over the operand
    variables {0}, {1}, ...; the one used is the first present of, by the compute type:
    float32: `float32`, `floats`, `any_type`; other floats: `floats`, `any_type`; ints:
    `ints`, `any_type`; bool: `bools`, `ints`, `any_type`. A type with none is refused."""
    name: str
    arity: int
    floats: Optional[str] = None
    float32: Optional[str] = None  # float32's own, where Triton's generic one is not IEEE (/, sqrt)
    ints: Optional[str] = None
    bools: Optional[str] = None
    any_type: Optional[str] = None
    # the result type is not the operands': the op is computed in its operands' type
    operand_typed: bool = False
    # float16/bfloat16 are computed in float32 and rounded once, as eager does (not for a select)
    opmath: bool = True
    # an integer src[1] is a divisor, which may be zero (CPU eager raises ZeroDivisionError)
    divides: bool = False
    # src[0] is an index that must lie in [0, src[1]) (src[1] a literal): the kernel reports
    # one out of range (IndexError, as eager's indexed reads raise) and passes it on as it is
    checks_index: bool = False
    # operands only the gradient rule reads (its value ignores them)
    gradient_only: tuple[int, ...] = ()
    grad: Union[GradRule, _NoGrad, None] = None
    aten: tuple[str, ...] = ()  # aten ops (by name) that are this op, computed in torch's result type

    def template(self, compute: DType) -> Optional[str]:
        """The Triton template for operands of type `compute`, or None: refused."""
        if compute is DType.bool:
            kinds = (self.bools, self.ints)
        elif compute.is_float:
            kinds = (self.float32 if compute is DType.float32 else None, self.floats)
        else:
            kinds = (self.ints,)
        return next((t for t in kinds + (self.any_type,) if t is not None), None)


# Boolean and/or/xor go through int8: Triton's interpreter cannot combine a block of bools
# with a bool scalar (it broadcasts the scalar to float32 and numpy rejects `bool | float`).
_AND, _OR, _XOR = ("(({0}).to(tl.int8) " + o + " ({1}).to(tl.int8)) != 0" for o in "&|^")
_IDENTITY = "{0}"
_FALSE = "tl.zeros_like({0}) != 0"


def _float_unary(name: str, triton: str) -> OpDef:
    """A differentiable math function of floats (its rule in autograd/vjp.py), aten's op of its name."""
    return OpDef(name, 1, floats=triton, aten=(name,))


def _rounding(name: str, triton: str) -> OpDef:
    """Rounds floats to an integer value; the identity on integers and bools."""
    return OpDef(name, 1, floats=triton, ints=_IDENTITY, grad=NO_GRAD, aten=(name,))


def _comparison(name: str, symbol: str) -> OpDef:
    return OpDef(name, 2, any_type=f"{{0}} {symbol} {{1}}", operand_typed=True, grad=NO_GRAD, aten=(name,))


def _logical(name: str, bools: str) -> OpDef:
    """Truth of operands of any type (nonzero), combined."""
    return OpDef(name, 2, bools=bools, any_type=bools.format("{0} != 0", "{1} != 0"), operand_typed=True,
                 grad=NO_GRAD)


def _bitwise(name: str, ints: str, bools: str) -> OpDef:
    return OpDef(name, 2, ints=ints, bools=bools, grad=NO_GRAD)


_DEFS = [
    # -- arithmetic
    OpDef("add", 2, any_type="{0} + {1}", bools=_OR),
    OpDef("mul", 2, any_type="{0} * {1}", bools=_AND),
    OpDef("neg", 1, any_type="-{0}", aten=("neg",)),
    OpDef("abs", 1, any_type="tl.abs({0})", bools=_IDENTITY, aten=("abs",)),
    OpDef("recip", 1, floats="1.0 / {0}", float32="tl.div_rn(tl.full([], 1.0, tl.float32), {0})",
          aten=("reciprocal",)),
    OpDef("sign", 1, floats="tm.sign({0})", ints="tm.int_sign({0})", bools=_IDENTITY, grad=NO_GRAD,
          aten=("sign", "sgn")),
    OpDef("truediv", 2, floats="{0} / {1}", float32="tl.div_rn({0}, {1})"),
    OpDef("floordiv", 2, floats="tm.float_floordiv({0}, {1})", ints="tm.int_floordiv({0}, {1})", divides=True,
          grad=NO_GRAD),
    OpDef("truncdiv", 2, floats="tm.truncdiv({0}, {1})", ints="{0} // {1}", divides=True, grad=NO_GRAD),
    OpDef("rem", 2, floats="tm.float_rem({0}, {1})", ints="tm.int_rem({0}, {1})", divides=True),
    OpDef("fmod", 2, floats="tm.fmod({0}, {1})", ints="{0} % {1}", divides=True),
    OpDef("index_in_range", 2, ints="{0}", checks_index=True, grad=NO_GRAD),
    OpDef("pow", 2, floats="tm.pow({0}, {1})", ints="tm.int_pow({0}, {1})"),
    OpDef("max", 2, floats="tm.float_max({0}, {1})", ints="tl.maximum({0}, {1})", bools=_OR, aten=("maximum",)),
    OpDef("min", 2, floats="tm.float_min({0}, {1})", ints="tl.minimum({0}, {1})", bools=_AND, aten=("minimum",)),
    OpDef("fma", 3, floats="tl.fma({0}, {1}, {2})", ints="{0} * {1} + {2}",
          bools="((({0}).to(tl.int8) & ({1}).to(tl.int8)) | ({2}).to(tl.int8)) != 0"),
    OpDef("where", 3, any_type="tl.where({0}, {1}, {2})", opmath=False),
    OpDef("cast", 1, operand_typed=True),  # its Triton depends on both types: lower/elementwise.py _cast
    OpDef("stop_gradient", 1, any_type=_IDENTITY, grad=NO_GRAD),  # the identity (a value chosen for precision)
    # the value of its second operand, whose gradient goes to its first: contents written through
    # x.detach(), which eager's autograd does not see (x's later reads pass their gradient to x's history)
    OpDef("straight_through", 2, any_type="{1}", opmath=False, gradient_only=(0,)),
    # -- math of floats
    _float_unary("exp", "tl.exp({0})"),
    _float_unary("exp2", "tl.exp2({0})"),
    _float_unary("expm1", "tm.expm1({0})"),
    _float_unary("log", "tl.log({0})"),
    _float_unary("log2", "tl.log2({0})"),
    _float_unary("log1p", "tm.log1p({0})"),
    OpDef("sqrt", 1, floats="tl.sqrt({0})", float32="tl.sqrt_rn({0})", aten=("sqrt",)),
    _float_unary("rsqrt", "tl.rsqrt({0})"),
    _float_unary("sin", "tl.sin({0})"),
    _float_unary("cos", "tl.cos({0})"),
    _float_unary("tan", "tm.tan({0})"),
    _float_unary("asin", "tm.asin({0})"),
    _float_unary("acos", "tm.acos({0})"),
    _float_unary("atan", "tm.atan({0})"),
    _float_unary("sinh", "tm.sinh({0})"),
    _float_unary("cosh", "tm.cosh({0})"),
    _float_unary("tanh", "tm.tanh({0})"),
    _float_unary("asinh", "tm.asinh({0})"),
    _float_unary("acosh", "tm.acosh({0})"),
    _float_unary("atanh", "tm.atanh({0})"),
    _float_unary("sigmoid", "tl.sigmoid({0})"),
    _float_unary("erf", "tl.erf({0})"),
    _float_unary("erfc", "tm.erfc({0})"),
    OpDef("atan2", 2, floats="tm.atan2({0}, {1})", aten=("atan2",)),
    _rounding("floor", "tl.floor({0})"),
    _rounding("ceil", "tl.ceil({0})"),
    _rounding("trunc", "tm.trunc({0})"),
    OpDef("round", 1, floats="tm.round_half_even({0})", ints=_IDENTITY, grad=NO_GRAD),  # aten.round: decimals
    # -- comparisons and predicates (bool results)
    _comparison("eq", "=="),
    _comparison("ne", "!="),
    _comparison("lt", "<"),
    _comparison("le", "<="),
    _comparison("gt", ">"),
    _comparison("ge", ">="),
    OpDef("isnan", 1, floats="{0} != {0}", ints=_FALSE, operand_typed=True, grad=NO_GRAD, aten=("isnan",)),
    OpDef("isinf", 1, floats="tm.isinf({0})", ints=_FALSE, operand_typed=True, grad=NO_GRAD, aten=("isinf",)),
    OpDef("signbit", 1, floats="tm.signbit({0})", ints="{0} < 0", bools=_FALSE, operand_typed=True,
          grad=NO_GRAD, aten=("signbit",)),
    _logical("logical_and", _AND),
    _logical("logical_or", _OR),
    _logical("logical_xor", _XOR),
    OpDef("logical_not", 1, any_type="{0} == 0", operand_typed=True, grad=NO_GRAD),
    # -- bits (integers)
    _bitwise("bitwise_and", "{0} & {1}", _AND),
    _bitwise("bitwise_or", "{0} | {1}", _OR),
    _bitwise("bitwise_xor", "{0} ^ {1}", _XOR),
    OpDef("bitwise_not", 1, ints="~{0}", bools="{0} == 0", grad=NO_GRAD),
    _bitwise("shl", "tm.shl({0}, {1})", None),
    _bitwise("shr", "tm.shr({0}, {1})", None),
]
OPS: dict[str, OpDef] = {op.name: op for op in _DEFS}


def op_def(name: str) -> OpDef:
    op = OPS.get(name)
    if op is None:
        raise KeyError(f"unknown elementwise op {name!r} (not registered in tjit/ir/ops.py OPS)")
    return op


def define_gradient(name: str, rule: GradRule) -> None:
    """Gives a registered op without one its gradient rule (autograd/vjp.py does, at import)."""
    op = op_def(name)
    if op.grad is not None:
        raise ValueError(f"elementwise op {name!r} has a gradient rule already, or is marked NO_GRAD")
    OPS[name] = replace(op, grad=rule)


# Reductions: max/min propagate NaN as torch does; argmax/argmin pick the first extreme
# (NaN counts as the largest), as torch does. lower/reduction.py and autograd/vjp.py
# handle each by name.
REDUCE_OPS = frozenset({"add", "mul", "max", "min", "argmax", "argmin"})
# Scans: argmax/argmin give the running extreme's index (ties and NaN as torch.cummax),
# logaddexp is logcumsumexp's log(exp(a) + exp(b)).
SCAN_OPS = frozenset({"add", "mul", "max", "min", "argmax", "argmin", "logaddexp"})

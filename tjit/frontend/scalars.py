"""Python numbers read from tensor data (`.item()`), kept as values computed at run time.

A learning rate that changes every step reaches a compiled optimizer step as a 0-d tensor
read by `.item()` (Dynamo passes a float attribute that changed that way). Baked in as a
literal it would need a compile per value; so the trace gives `.item()` a symbol, and here
the number is the 0-d tensor it was read from, converted to Python's type (float64, int64,
bool) and cut from the gradient (eager's number carries none). Python arithmetic on it
(`1 - lr * wd`) is computed in that type too, and the ops that take a Python number as an
operand (add, mul, addcdiv's value, a fill, ...) take the value instead: torch's promotion
already treated the symbol as a Python number, so the result types are eager's.

Any other use (a size, a branch, an op that reads the number in Python) raises
DataDependentError: tjit.compile then splits the function there, as for any data-dependent
value."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from ..errors import DataDependentError, NumberNeededError
from ..ir import DType, GraphNode

aten = torch.ops.aten


@dataclass(frozen=True)
class RuntimeScalar:
    """A Python number read from tensor data: a 0-d value of Python's type, computed at run time."""
    value: GraphNode


def is_symbolic_number(value) -> bool:
    """A symbol make_fx stands in for a Python number that only tensor data gives (.item())."""
    return isinstance(value, (torch.SymBool, torch.SymInt, torch.SymFloat))


def python_type(symbol) -> DType:
    """The IR type of a Python number of the symbol's kind."""
    if isinstance(symbol, torch.SymBool):
        return DType.bool
    return DType.float64 if isinstance(symbol, torch.SymFloat) else DType.int64


def read_number(cv, tensor: GraphNode, symbol) -> RuntimeScalar:
    """`.item()`: the tensor's one element as a Python number, without a gradient."""
    if tensor.dtype.library_only:
        raise DataDependentError("aten._local_scalar_dense", f".item() of a {tensor.dtype!r} tensor")
    value = cv.cast(tensor, python_type(symbol))
    if value.shape != ():  # (.item() of a one-element tensor of any rank)
        value = cv.view(value, ("reshape", ()))
    if value.dtype.is_float:
        value = cv.elementwise("stop_gradient", [value], value.dtype)
    return RuntimeScalar(value)


# Python's arithmetic on numbers (make_fx records it as calls of the operator functions)
_ARITHMETIC = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "truediv",
               operator.floordiv: "floordiv", operator.mod: "rem", operator.pow: "pow", operator.neg: "neg"}


# math functions make_fx records on numbers (float // float is floor(a / b))
_FUNCTIONS = {math.floor: "floor", math.ceil: "ceil", math.trunc: "trunc", operator.abs: "abs",
              torch._sym_sqrt: "sqrt", math.sqrt: "sqrt"}


def is_arithmetic(target) -> bool:
    return target in _ARITHMETIC or target in _FUNCTIONS or target is torch.sym_float


def arithmetic(cv, node, *args) -> RuntimeScalar:
    """One step of Python arithmetic on runtime numbers and literals, in the result's Python
    type (int / int is a float; an int power is refused: its type depends on the exponent's sign)."""
    result = python_type(node.meta["val"])
    if node.target is operator.pow and not result.is_float:
        raise NumberNeededError(str(node.target), "an integer power of a number read from tensor data")
    if node.target is torch.sym_float:
        return RuntimeScalar(_operand(cv, args[0], result))
    if node.target in _FUNCTIONS:  # computed in float64 (an int's abs in int64), then Python's result type
        work = DType.int64 if node.target is operator.abs and not result.is_float else DType.float64
        value = cv.elementwise(_FUNCTIONS[node.target], [_operand(cv, args[0], work)], work)
        return RuntimeScalar(cv.cast(value, result))
    values = [_operand(cv, a, result) for a in args]
    if node.target is operator.sub:
        values[1] = cv.elementwise("neg", [values[1]], result)
    name = "add" if node.target is operator.sub else _ARITHMETIC[node.target]
    return RuntimeScalar(cv.elementwise(name, values, result))


def _operand(cv, x, dtype: DType) -> GraphNode:
    if isinstance(x, RuntimeScalar):
        return cv.cast(x.value, dtype)
    if isinstance(x, (bool, int, float)):
        return cv.const(x, dtype)
    raise DataDependentError("a Python number read from tensor data", f"combined with {type(x).__name__}")


# ops whose handlers take a 0-d tensor wherever they take a Python number, as eager does
TAKES_RUNTIME_NUMBERS = {aten.add, aten.sub, aten.rsub, aten.mul, aten.div, aten.addcmul, aten.addcdiv,
                         aten.lerp, aten.where, aten.fill, aten.full, aten.full_like, aten.new_full,
                         aten.scalar_tensor, aten.clamp, aten.clamp_min, aten.clamp_max, aten.pow}
# (prims.fma is looked up by name: Inductor defines it when imported)
_TAKES_BY_NAME = {"prims::fma"}
# ops whose eager kernels convert the number to the result's type with an overflow check (300
# into int8 raises, as 1e6 into float16 does; add and sub check their alpha): a runtime number
# only where its type's values fit (a float into float32, bfloat16 or float64: only a number
# beyond 3.4e38, which eager refuses, becomes inf there)
CONVERTED_WITH_CHECK = {aten.fill, aten.full, aten.full_like, aten.new_full, aten.where, aten.scalar_tensor,
                        aten.clamp, aten.clamp_min, aten.clamp_max}
_HOLD_FLOATS = {DType.float32, DType.bfloat16, DType.float64}
_HOLD_INTS = {DType.int64, DType.float32, DType.bfloat16, DType.float64}


def with_runtime_numbers(node, args, kwargs):
    """The op's arguments with each runtime number as its 0-d value, for an op that takes
    those; NumberNeededError for any other op (it would read the number as a literal)."""
    flat = torch.utils._pytree.tree_flatten((args, kwargs))[0]
    numbers = [a for a in flat if isinstance(a, RuntimeScalar)]
    if not numbers:
        return args, kwargs
    packet = getattr(node.target, "overloadpacket", node.target)
    name = getattr(packet, "__name__", "")
    functional = getattr(aten, name[:-1], None) if name.endswith("_") else packet  # x.add_(...) is add
    if functional not in TAKES_RUNTIME_NUMBERS and getattr(packet, "_qualified_op_name", None) not in _TAKES_BY_NAME:
        raise NumberNeededError(str(node.target), "takes a Python number read from tensor data (.item()) that tjit "
                                "can only bake in as a literal")
    result = node.meta.get("val")
    result = DType.from_torch(result.dtype) if isinstance(result, torch.Tensor) else None
    checked = numbers if functional in CONVERTED_WITH_CHECK else [kwargs[k] for k in ("alpha",)
                                                                    if isinstance(kwargs.get(k), RuntimeScalar)]
    if any(not _fits(n.value.dtype, result, functional) for n in checked) or \
            (functional is aten.pow and not result.is_float):
        raise NumberNeededError(str(node.target), "a Python number read from tensor data, which eager checks "
                                f"against the result's type ({result!r}) or reads by value")
    unwrap = lambda a: a.value if isinstance(a, RuntimeScalar) else a  # noqa: E731
    return torch.utils._pytree.tree_map(unwrap, args), torch.utils._pytree.tree_map(unwrap, kwargs)


def _fits(number: DType, result, op) -> bool:
    """Every value of the number's type converts to the result's type as op converts it in
    eager, without an overflow error (up to the float range for floats: see CONVERTED_WITH_CHECK)."""
    if number is DType.bool:
        return True
    if op is aten.scalar_tensor:  # (it checks integer results only: 1e6 is inf as float16, 300 raises as int8)
        return result.is_float or (result is DType.int64 and not number.is_float)
    return result in (_HOLD_FLOATS if number.is_float else _HOLD_INTS)

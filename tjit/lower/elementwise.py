"""Triton expressions for the IR's elementwise ops.

Operands arrive as variables holding values of the node's compute dtype. float16 and
bfloat16 are computed in float32 and rounded back per op, as eager does, so fused
results match eager's rounding (the frontend normally does this explicitly already).
Conversions to and from bfloat16 go through `tm.bf16_to_f32` / `tm.f32_to_bf16`, and every
conversion between a 16-bit float and anything but float32 goes through float32, as
eager's c10::Half / c10::BFloat16 conversions do (int64 -> bfloat16 rounds twice there).
"""
from __future__ import annotations

from ..ir import DType, GraphNode

FLOAT_ONLY_UNARY = {
    "exp": "tl.exp({0})", "exp2": "tl.exp2({0})", "log": "tl.log({0})", "log2": "tl.log2({0})",
    "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})",
    "erf": "tl.erf({0})", "erfc": "tm.erfc({0})", "sigmoid": "tl.sigmoid({0})", "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})", "expm1": "tm.expm1({0})", "log1p": "tm.log1p({0})", "tan": "tm.tan({0})",
    "tanh": "tm.tanh({0})", "sinh": "tm.sinh({0})", "cosh": "tm.cosh({0})", "asin": "tm.asin({0})",
    "acos": "tm.acos({0})", "atan": "tm.atan({0})", "asinh": "tm.asinh({0})", "acosh": "tm.acosh({0})",
    "atanh": "tm.atanh({0})", "trunc": "tm.trunc({0})", "round": "tm.round_half_even({0})",
    "sign": "tm.sign({0})", "recip": "1.0 / {0}", "abs": "tl.abs({0})", "signbit": "tm.signbit({0})",
}
FLOAT_ONLY_TERNARY = {"fma": "tl.fma({0}, {1}, {2})"}
FLOAT_ONLY_BINARY = {
    "truediv": "{0} / {1}", "pow": "tm.pow({0}, {1})", "atan2": "tm.atan2({0}, {1})",
    "floordiv": "tm.float_floordiv({0}, {1})", "rem": "tm.float_rem({0}, {1})", "fmod": "tm.fmod({0}, {1})",
    "truncdiv": "tm.truncdiv({0}, {1})", "max": "tm.float_max({0}, {1})", "min": "tm.float_min({0}, {1})",
}
INT_ONLY = {
    "floordiv": "tm.int_floordiv({0}, {1})", "rem": "tm.int_rem({0}, {1})", "fmod": "{0} % {1}",
    "truncdiv": "{0} // {1}", "max": "tl.maximum({0}, {1})", "min": "tl.minimum({0}, {1})",
    "sign": "tm.int_sign({0})", "floor": "{0}", "ceil": "{0}", "trunc": "{0}", "round": "{0}",
    "bitwise_and": "{0} & {1}", "bitwise_or": "{0} | {1}", "bitwise_xor": "{0} ^ {1}", "bitwise_not": "~{0}",
    "shl": "tm.shl({0}, {1})", "shr": "tm.shr({0}, {1})", "pow": "tm.int_pow({0}, {1})", "fma": "{0} * {1} + {2}",
    "signbit": "{0} < 0",
}
# Boolean and/or/xor go through int8: Triton's interpreter cannot combine a block of bools
# with a bool scalar (it broadcasts the scalar to float32 and numpy rejects `bool | float`).
_AND, _OR, _XOR = ("(({0}).to(tl.int8) " + o + " ({1}).to(tl.int8)) != 0" for o in "&|^")
BOOL_ARITH = {"add": _OR, "mul": _AND, "max": _OR, "min": _AND, "abs": "{0}", "sign": "{0}",
              "logical_and": _AND, "logical_or": _OR, "logical_xor": _XOR, "logical_not": "{0} == 0",
              "bitwise_and": _AND, "bitwise_or": _OR, "bitwise_xor": _XOR, "bitwise_not": "{0} == 0",
              "floor": "{0}", "ceil": "{0}", "trunc": "{0}", "round": "{0}", "signbit": "tl.zeros_like({0}) != 0",
              "eq": "{0} == {1}", "ne": "{0} != {1}", "lt": "{0} < {1}", "le": "{0} <= {1}", "gt": "{0} > {1}",
              "ge": "{0} >= {1}",
              "fma": "((({0}).to(tl.int8) & ({1}).to(tl.int8)) | ({2}).to(tl.int8)) != 0"}
ANY_TYPE = {
    "add": "{0} + {1}", "mul": "{0} * {1}", "neg": "-{0}", "abs": "tl.abs({0})",
    "eq": "{0} == {1}", "ne": "{0} != {1}", "lt": "{0} < {1}", "le": "{0} <= {1}", "gt": "{0} > {1}",
    "ge": "{0} >= {1}", "where": "tl.where({0}, {1}, {2})",
    "logical_and": _AND.format("{0} != 0", "{1} != 0"), "logical_or": _OR.format("{0} != 0", "{1} != 0"),
    "logical_xor": _XOR.format("{0} != 0", "{1} != 0"), "logical_not": "{0} == 0", "isnan": "{0} != {0}",
    "isinf": "tm.isinf({0})", "stop_gradient": "{0}",
}
# ops whose operands' type is not the result type: they are rendered in the operand type
OPERAND_TYPED = {"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "cast", "signbit",
                 "logical_and", "logical_or", "logical_xor", "logical_not"}


def tl_dtype(dtype: DType) -> str:
    return f"tl.{dtype.triton}"


def to_f32(arg: str, dtype: DType) -> str:
    """A float16/bfloat16 value widened to float32 (exactly)."""
    if dtype is DType.bfloat16:
        return f"tm.bf16_to_f32({arg})"
    return f"{arg}.to(tl.float32)"


def from_f32(expr: str, dtype: DType) -> str:
    """A float32 value rounded to float16/bfloat16 (to nearest even)."""
    if dtype is DType.bfloat16:
        return f"tm.f32_to_bf16({expr})"
    return f"({expr}).to({tl_dtype(dtype)})"


def render(node: GraphNode, args: list[str]) -> str:
    """A Triton expression computing `node` from operand variables `args`."""
    op = node.op.op
    if op == "cast":
        return _cast(args[0], node.src[0].dtype, node.dtype)
    compute = node.src[-1].dtype if op in OPERAND_TYPED or op == "where" else node.dtype
    if op in ("isnan", "isinf") and not compute.is_float:
        return f"tl.zeros_like({args[0]}) != 0"
    if compute is DType.bool and op in BOOL_ARITH:
        return BOOL_ARITH[op].format(*args)
    if compute.is_float:
        template = FLOAT_ONLY_UNARY.get(op) or FLOAT_ONLY_BINARY.get(op) or FLOAT_ONLY_TERNARY.get(op) \
            or ANY_TYPE.get(op)
    else:
        template = INT_ONLY.get(op) or ANY_TYPE.get(op)
    if template is None:
        raise NotImplementedError(f"elementwise op {op!r} has no Triton rendering for {compute!r}")
    if compute.is_low_precision and op != "where":
        # computed in float32 and rounded once, as eager does; Triton's interpreter also
        # compares bfloat16 as raw bits, so predicates widen their operands too
        expr = template.format(*[to_f32(a, compute) for a in args])
        return expr if op in OPERAND_TYPED else from_f32(expr, node.dtype)
    if op == "truediv" and compute is DType.float32:
        return f"tl.div_rn({args[0]}, {args[1]})"  # IEEE division, as eager computes it
    if op == "sqrt" and compute is DType.float32:
        return f"tl.sqrt_rn({args[0]})"
    if op == "recip" and compute is DType.float32:
        return f"tl.div_rn(tl.full([], 1.0, tl.float32), {args[0]})"
    return template.format(*args)


def _cast(arg: str, src: DType, dst: DType) -> str:
    if src == dst:
        return arg
    if src.is_low_precision:  # widen first: exact, and the interpreter cannot convert bfloat16 otherwise
        arg, src = to_f32(arg, src), DType.float32
        if dst is DType.float32:
            return arg
    if dst is DType.bool:
        return f"{arg} != 0"
    if src is DType.bool:
        arg, src = f"{arg}.to(tl.int8)", DType.int8
    if dst.is_low_precision:
        if src is not DType.float32:
            arg = f"{arg}.to(tl.float32)"
        return from_f32(arg, dst)
    return f"{arg}.to({tl_dtype(dst)})"


def literal(value, dtype: DType) -> str:
    if dtype is DType.bool:
        text = repr(bool(value))
    elif dtype.is_float:
        value = _round_to(float(value), dtype)
        text = repr(value) if value == value and abs(value) != float("inf") else f'float("{value}")'
    else:
        text = repr(_wrap_int(int(value), dtype))
    return f"tl.full([], {text}, {tl_dtype(dtype)})"


def _round_to(value: float, dtype: DType) -> float:
    """A float literal rounded to the dtype here, so Triton need not round it (its
    interpreter truncates to bfloat16, and float32 literals must not be rounded twice)."""
    if dtype is DType.float64 or value != value or abs(value) == float("inf"):
        return value
    import torch
    return float(torch.tensor(value, dtype=torch.float64).to(dtype.torch))


def _wrap_int(value: int, dtype: DType) -> int:
    """Integer literals wrap into the type, as eager's scalar conversions do (uint8 -3 = 253)."""
    bits = dtype.itemsize * 8
    value &= (1 << bits) - 1
    if dtype.is_signed_int and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value

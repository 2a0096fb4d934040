"""Triton expressions for the IR's elementwise ops, from each op's templates in the op
registry (ir/ops.py OPS), and for casts and literals.

Operands arrive as variables holding values of the node's compute dtype. float16 and
bfloat16 are computed in float32 and rounded back per op, as eager does, so fused
results match eager's rounding (the frontend normally does this explicitly already).
Conversions to and from bfloat16 go through `tm.bf16_to_f32` / `tm.f32_to_bf16`, and every
conversion between a 16-bit float and anything but float32 goes through float32, as
eager's c10::Half / c10::BFloat16 conversions do (int64 -> bfloat16 rounds twice there).
"""
from __future__ import annotations

from ..ir import DType, GraphNode
from ..ir.ops import op_def


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
    op = op_def(node.op.op)
    if op.name == "cast":
        return _cast(args[0], node.src[0].dtype, node.dtype)
    compute = node.src[-1].dtype if op.operand_typed else node.dtype
    template = op.template(compute)
    if template is None:
        raise NotImplementedError(f"elementwise op {op.name!r} has no Triton rendering for {compute!r} "
                                  "(tjit/ir/ops.py OPS)")
    if compute.is_low_precision and op.opmath:
        # computed in float32 and rounded once, as eager does; Triton's interpreter also
        # compares bfloat16 as raw bits, so predicates widen their operands too
        expr = template.format(*[to_f32(a, compute) for a in args])
        return expr if op.operand_typed else from_f32(expr, node.dtype)
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

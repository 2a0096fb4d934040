"""The elementwise op vocabulary of the IR.

Kept small because everything fuses later: subtraction is add+neg; casts are `cast`
(the target is the node's dtype). Operands of an op have the node's compute dtype
(the frontend inserts casts), except comparisons, predicates, `where`'s condition and
`cast`, whose result type differs from their operands'.
"""

UNARY = frozenset({
    "neg", "abs", "recip", "sign", "cast",
    "exp", "exp2", "expm1", "log", "log2", "log1p", "sqrt", "rsqrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "sigmoid", "erf", "erfc", "floor", "ceil", "trunc", "round",
    "logical_not", "bitwise_not", "isnan", "isinf", "signbit",
    "stop_gradient",  # the identity, through which no gradient flows (a value chosen for precision only)
})
BINARY = frozenset({
    "add", "mul", "truediv", "floordiv", "truncdiv", "rem", "fmod", "pow", "atan2",
    "max", "min", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_xor", "shl", "shr",
})
TERNARY = frozenset({"where", "fma"})
PREDICATES = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "signbit",
                        "logical_and", "logical_or", "logical_xor", "logical_not"})
ELEMENTWISE_OPS = UNARY | BINARY | TERNARY
# Elementwise ops with no gradient, by their nature: piecewise constant (rounding, sign,
# floor division), comparisons and predicates (bool results), bit ops (integers), and
# stop_gradient by definition. Every other op has its rule in autograd/vjp.py; an op with
# neither is a compile-time error there, never a silent zero gradient (tests/test_ir.py
# checks that the two tables cover the vocabulary).
NO_GRADIENT = frozenset({
    "floor", "ceil", "trunc", "round", "sign", "signbit", "floordiv", "truncdiv",
    "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "logical_and", "logical_or", "logical_xor", "logical_not",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "shl", "shr",
    "stop_gradient",
})
# Reductions: max/min propagate NaN as torch does; argmax/argmin pick the first extreme
# (NaN counts as the largest), as torch does.
REDUCE_OPS = frozenset({"add", "mul", "max", "min", "argmax", "argmin"})
# Scans: argmax/argmin give the running extreme's index (ties and NaN as torch.cummax),
# logaddexp is logcumsumexp's log(exp(a) + exp(b)).
SCAN_OPS = frozenset({"add", "mul", "max", "min", "argmax", "argmin", "logaddexp"})


def arity(op: str) -> int:
    if op in UNARY:
        return 1
    if op in BINARY:
        return 2
    if op in TERNARY:
        return 3
    raise KeyError(f"unknown elementwise op {op!r}")

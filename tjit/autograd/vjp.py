"""Vector-Jacobian products of the IR's ops.

vjp(alg, node, grad, value) gives, for each source of a forward node, the gradient it gets
from `grad` (the gradient of the node's value), or None. `value(n)` is forward node n as
the backward graph sees it (recomputed there, or read from what the forward saved), so a
rule may use any forward value it needs. The rules follow eager's derivative formulas,
including how ties, zeros and NaN are treated where they differ from the textbook one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..errors import UnsupportedOpError
from ..frontend.dot import dot, is_prologue, library_product, nests_products, tileable
from ..frontend.library import in_memory
from ..ir import (Const, Contiguous, Cumulative, Dot, DType, Elementwise, Extern, Gather, GraphNode, Input, Iota, Operand,
                  Reduce, Scatter, ViewOp, Window, toposort)
from ..ir.ops import NO_GRAD, define_gradient, op_def
from .algebra import LN2, TWO_OVER_SQRT_PI, Algebra
from .library_grad import library_gradient
from .views import view_transpose

aten = torch.ops.aten


@dataclass(frozen=True)
class ScatterGrad:
    """A gradient that is a scatter-add: zeros of the source's shape, plus `values` added at
    `index` along `axis` (None: into the elements in row-major order). Moved back through
    views to the value they read, where it becomes an IR Scatter (autograd/scatter.py)."""
    axis: Optional[int]
    index: GraphNode  # int64, in range
    values: GraphNode
    what: str


Grads = list[Optional[Union[GraphNode, ScatterGrad]]]
ValueOf = Callable[[GraphNode], GraphNode]

# A gather's gradient as one-hot selects costs (indices per line) x (table extent) per line,
# against a scatter-add's (indices per line): one index per line is the dense gradient itself
# (cross-entropy's target), more are one-hot only while the product stays this small (an
# embedding's one-hot over its vocabulary would evaluate the incoming gradient vocab times).
MAX_ONE_HOT_WORK = 64


def _dot(alg: Algebra, node: GraphNode, grad: GraphNode, value: ValueOf) -> Grads:
    """As eager's matmul backward: grad @ b.T and a.T @ grad, in the operands' type, by
    library products, or generated ones where grad or a computes a product
    (_generated_gradients). A shared b's gradient is one product over all of a's rows. An operand
    that is a transposed view of its memory (a linear's weight) gets its gradient as the
    transposed product, transposed back, as ATen's mm backward does: written in the layout of
    the operand's memory, it needs no transposing copy to become the parameter's gradient."""
    a, b = (value(s) for s in node.src)
    g = alg.cast(grad, a.dtype)
    # (where the gradients' operands cannot compute the products on their tiles, too many
    # columns or reads, g is written once and both products read it, as below)
    wide = _accumulates_in_memory(a, b)
    nested = _computes_products(g) and (wide or nests_products(a.shape[-1])) and is_prologue(g, nests=True) or \
        _computes_products(a) and (wide or nests_products(g.shape[-1])) and is_prologue(a, nests=True)
    if nested and tileable(a.shape) and tileable(b.shape):
        return _generated_gradients(alg, g, a, b, wide)
    return list(_library_products(alg, g, a, b, (True, True)))


def _library_products(alg: Algebra, g: GraphNode, a: GraphNode, b: GraphNode,
                      wanted: tuple[bool, bool]) -> tuple[Optional[GraphNode], Optional[GraphNode]]:
    """The wanted ones of a @ b's gradients g @ b.T and a.T @ g (g in the operands' type) as
    library products, each written in the layout of its operand's memory (ATen's
    mm_mat1_backward and mm_mat2_backward: a transposed operand gets the transposed product)."""
    vb = alg.vb
    last_two = lambda x: _last_two_swapped(vb, x)
    # both products read g: in memory once, then through views (a transposed view of an
    # expression would be written again, transposed)
    g = in_memory(vb, g)
    grad_a = grad_b = None
    if wanted[0]:
        if _columns_in_memory(a) and len(b.shape) == len(a.shape):
            grad_a = last_two(library_product(vb, b, last_two(g)))
        else:
            grad_a = library_product(vb, g, last_two(b))
    if wanted[1]:
        if len(b.shape) == 2 < len(a.shape):
            a, g = (vb.view(x, ("reshape", (math.prod(x.shape[:-1]), x.shape[-1]))) for x in (a, g))
        if _columns_in_memory(b):
            grad_b = last_two(library_product(vb, last_two(g), a))
        else:
            grad_b = library_product(vb, last_two(a), g)
    return grad_a, grad_b


# library calls whose gradients are library products (_library_call_product), not a traced formula
LIBRARY_PRODUCTS = {aten.mm.default: 2, aten.bmm.default: 2, aten.addmm.default: 3}


def _library_call_product(alg: Algebra, node: GraphNode, grad: GraphNode, value: ValueOf,
                          wanted: Callable[[GraphNode], bool]) -> Optional[Grads]:
    """The gradients of a library mm, bmm or addmm(bias, a, b, beta=, alpha=) of real
    floating values, as ATen's derivative formulas give them: alpha * (g @ b.T) and
    alpha * (a.T @ g) by _library_products, beta * g summed to the bias's shape; only those
    of the operands `wanted`. None for any other call (its traced formula gives them): this
    rule saves the formula's trace (tens of milliseconds each, for a model's every shape)."""
    call = node.op.call
    arity = LIBRARY_PRODUCTS.get(call.target)
    scale = {name: call.kwargs.get(name, 1) for name in ("beta", "alpha")}
    if arity is None or call.writes or node.dtype.is_complex or not node.dtype.is_float or \
            tuple(call.args) != tuple(Operand(k) for k in range(arity)) or set(call.kwargs) - set(scale) or \
            any(type(v) not in (int, float) for v in scale.values()):
        return None
    *bias, a, b = node.src
    want = [differentiable(s) and wanted(s) for s in node.src]
    for operand, read in zip((b, a), want[-2:]):  # (g @ b.T reads b, a.T @ g reads a)
        if read and hasattr(value, "note_operand"):
            value.note_operand(operand)
    grad_a, grad_b = _library_products(alg, alg.cast(grad, a.dtype), value(a) if want[-1] else a,
                                       value(b) if want[-2] else b, tuple(want[-2:]))
    scaled = lambda x, k: x if x is None or k == 1 else alg.mul(x, k)
    grads = [scaled(grad_a, scale["alpha"]), scaled(grad_b, scale["alpha"])]
    if bias:
        grads.insert(0, _summed_to(alg, scaled(alg.cast(grad, bias[0].dtype), scale["beta"]), bias[0].shape)
                     if want[0] else None)
    return grads


def _summed_to(alg: Algebra, g: GraphNode, shape: tuple[int, ...]) -> GraphNode:
    """g summed over the axes it broadcast `shape` along (autograd's sum_to)."""
    lead = len(g.shape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + k for k, n in enumerate(shape) if n == 1 and g.shape[lead + k] != 1)
    total = alg.sum(g, axes) if axes else g
    return alg.view(total, "reshape", tuple(shape)) if total.shape != tuple(shape) else total


def _last_two_swapped(vb, x: GraphNode) -> GraphNode:
    """x viewed with its last two axes swapped (a matrix, or a batch of them, transposed)."""
    rank = len(x.shape)
    return vb.view(x, ("permute", tuple(range(rank - 2)) + (rank - 1, rank - 2)))


def _generated_gradients(alg: Algebra, g: GraphNode, a: GraphNode, b: GraphNode, wide: bool) -> Grads:
    """A product's gradients where g or a computes a product itself (a product of the
    forward recomputed rather than saved: cross-entropy's logits, attention's scores under
    its probabilities): generated products whose a operand computes it on its tiles, so
    neither it nor g is written. a's gradient is g @ b.T, left a product that what reads it
    can compute on its tiles too (attention's dP = dO @ V.T, read by the scores' gradient);
    b's is a.T @ g, or (g.T @ a).T where g computes the products (over all of a's rows where
    one b serves every batch index), the transposed operand computing them transposed
    (frontend/dot.py); `wide`: over more columns than a tile holds, they accumulate in memory
    (_accumulates_in_memory)."""
    vb = alg.vb
    last_two = lambda x: _last_two_swapped(vb, x)
    grad_a = dot(vb, g, last_two(b), accumulates=wide)
    if len(b.shape) == 2 < len(a.shape):
        a, g = (vb.view(x, ("reshape", (math.prod(x.shape[:-1]), x.shape[-1]))) for x in (a, g))
    # (cast before the transposing view: the product is written once, in b's type)
    grad_b = last_two(alg.cast(dot(vb, last_two(g), a, accumulates=wide), b.dtype)) if _computes_products(g) else \
        alg.cast(dot(vb, last_two(a), g, accumulates=wide), b.dtype)
    return [alg.cast(grad_a, a.dtype), grad_b]


def _accumulates_in_memory(a: GraphNode, b: GraphNode) -> bool:
    """Whether the gradients of a @ b may be products over more columns than a tile holds
    (an LM head's hidden size) whose operand computes products on its tiles: float32
    gradients, which such a product accumulates in their own memory
    (dot.accumulates_in_memory). 16-bit ones would need float32 buffers of their size to
    accumulate in: at an LM head's sizes, [tokens + vocabulary, hidden] in float32 is about
    the 16-bit logits' size, what writing g once costs, so they keep that form."""
    return a.dtype is DType.float32 and b.dtype is DType.float32


def _computes_products(x: GraphNode) -> bool:
    """Whether x's expression computes a matrix product (not read from memory)."""
    return any(isinstance(n.op, Dot) for n in toposort([x], stop=lambda n: n.is_leaf or isinstance(n.op, Contiguous)))


def _columns_in_memory(x: GraphNode) -> bool:
    """Whether a matrix operand's memory runs down its columns (a transposed view)."""
    (rows, columns), (row_stride, column_stride) = x.shape[-2:], x.view.strides[-2:]
    return isinstance(x.op, ViewOp) and rows > 1 and columns > 1 and row_stride == 1 != column_stride


def differentiable(node: GraphNode) -> bool:
    return node.dtype.is_float


def vjp(alg: Algebra, node: GraphNode, grad: GraphNode, value: ValueOf,
        wanted: Callable[[GraphNode], bool] = lambda src: True) -> Grads:
    """`wanted(src)`: whether a source's gradient is used (a library call computes only
    those: torch refuses some, a batch norm's running statistics)."""
    op = node.op
    if isinstance(op, (Input, Const, Iota)):
        return []
    if isinstance(op, Window):  # the shifted read's transpose: the gradient read back, 0 where nothing was read
        return [alg.vb.window(grad, tuple(-lo for lo in op.low), node.src[0].shape, 0)]
    if isinstance(op, Scatter):
        return _scatter(alg, node, grad, value)
    if isinstance(op, Contiguous):
        return [grad]
    if isinstance(op, ViewOp):
        if _rounded(grad):
            # (a float16 weight widened to float32 and broadcast: a cast of a view, whose
            # gradient is rounded to float16) the transpose's sums add the unrounded values,
            # rounded once after them
            return [alg.cast(view_transpose(alg, grad.src[0], node.view, node.src[0]), grad.dtype)]
        return [view_transpose(alg, grad, node.view, node.src[0])]
    if isinstance(op, Elementwise):
        return _elementwise(alg, node, grad, value)
    if isinstance(op, Reduce):
        return [_reduce(alg, node, grad, value)]
    if isinstance(op, Cumulative):
        return [_cumulative(alg, node, grad, value)]
    if isinstance(op, Gather):
        return [_gather(alg, node, grad, value), None]
    if isinstance(op, Extern):
        return _library_call_product(alg, node, grad, value, wanted) or library_gradient(alg.vb, node, grad, value,
                                                                                          wanted)
    if isinstance(op, Dot):
        return _dot(alg, node, grad, value)
    raise UnsupportedOpError(type(op).__name__, "no gradient rule for this IR op")


def _rounded(g: GraphNode) -> bool:
    """g is a float value rounded from a wider float type."""
    return isinstance(g.op, Elementwise) and g.op.op == "cast" and g.dtype.is_float and g.src[0].dtype.is_float \
        and g.src[0].dtype.itemsize > g.dtype.itemsize


# -- elementwise -------------------------------------------------------------------------------
def _elementwise(alg: Algebra, node: GraphNode, g: GraphNode, value: ValueOf) -> Grads:
    name = node.op.op
    rule = op_def(name).grad
    if rule is NO_GRAD:  # piecewise constant (floor, sign, comparisons, bit ops...)
        return [None] * len(node.src)
    if rule is None:
        raise UnsupportedOpError(name, "no gradient rule for this elementwise op (and it is not marked NO_GRAD in "
                                 "ir/ops.py OPS)")
    args = [value(s) for s in node.src]
    grads = rule(alg, g, value(node), *args)
    return [gs if gs is not None and differentiable(s) else None for s, gs in zip(node.src, grads)]


def _unary(formula):
    return lambda alg, g, y, x: (formula(alg, g, y, x),)


def _rsqrt_of(alg, v):
    return alg.ew("rsqrt", v)


UNARY_RULES = {
    "cast": _unary(lambda a, g, y, x: a.cast(g, x.dtype) if x.dtype.is_float else None),
    "neg": _unary(lambda a, g, y, x: a.neg(g)),
    "abs": _unary(lambda a, g, y, x: a.mul(g, a.ew("sign", x))),
    "recip": _unary(lambda a, g, y, x: a.mul(a.neg(g), a.square(y))),
    "exp": _unary(lambda a, g, y, x: a.mul(g, y)),
    "exp2": _unary(lambda a, g, y, x: a.mul(g, a.mul(y, LN2))),
    "expm1": _unary(lambda a, g, y, x: a.mul(g, a.add(y, 1))),
    "log": _unary(lambda a, g, y, x: a.div(g, x)),
    "log2": _unary(lambda a, g, y, x: a.div(g, a.mul(x, LN2))),
    "log1p": _unary(lambda a, g, y, x: a.div(g, a.add(x, 1))),
    "sqrt": _unary(lambda a, g, y, x: a.div(g, a.mul(y, 2))),
    "rsqrt": _unary(lambda a, g, y, x: a.mul(g, a.mul(a.mul(a.square(y), y), -0.5))),
    "sin": _unary(lambda a, g, y, x: a.mul(g, a.ew("cos", x))),
    "cos": _unary(lambda a, g, y, x: a.mul(g, a.neg(a.ew("sin", x)))),
    "tan": _unary(lambda a, g, y, x: a.mul(g, a.add(a.square(y), 1))),
    "asin": _unary(lambda a, g, y, x: a.mul(g, _rsqrt_of(a, a.sub(1, a.square(x))))),
    "acos": _unary(lambda a, g, y, x: a.neg(a.mul(g, _rsqrt_of(a, a.sub(1, a.square(x)))))),
    "atan": _unary(lambda a, g, y, x: a.div(g, a.add(a.square(x), 1))),
    "sinh": _unary(lambda a, g, y, x: a.mul(g, a.ew("cosh", x))),
    "cosh": _unary(lambda a, g, y, x: a.mul(g, a.ew("sinh", x))),
    "tanh": _unary(lambda a, g, y, x: a.mul(g, a.sub(1, a.square(y)))),
    "asinh": _unary(lambda a, g, y, x: a.mul(g, _rsqrt_of(a, a.add(a.square(x), 1)))),
    "acosh": _unary(lambda a, g, y, x: a.mul(g, _rsqrt_of(a, a.sub(a.square(x), 1)))),
    "atanh": _unary(lambda a, g, y, x: a.div(g, a.sub(1, a.square(x)))),
    "sigmoid": _unary(lambda a, g, y, x: a.mul(g, a.mul(y, a.sub(1, y)))),
    "erf": _unary(lambda a, g, y, x: a.mul(g, a.mul(a.ew("exp", a.neg(a.square(x))), TWO_OVER_SQRT_PI))),
    "erfc": _unary(lambda a, g, y, x: a.mul(g, a.mul(a.ew("exp", a.neg(a.square(x))), -TWO_OVER_SQRT_PI))),
}


def _pow(a: Algebra, g, y, base, exponent):
    # eager: no gradient where the exponent is 0; for the exponent, none where base == 0 and
    # exponent >= 0 (where 0 ** e is flat or its log is -inf)
    d_base = a.where(a.test("eq", exponent, 0), 0.0, a.mul(g, a.mul(exponent, a.ew("pow", base, a.sub(exponent, 1)))))
    flat = a.both(a.test("eq", base, 0), a.test("ge", exponent, 0))
    d_exp = a.mul(g, a.where(flat, 0.0, a.mul(y, a.ew("log", base))))
    return d_base, d_exp


def _extreme(loses: str):
    """maximum/minimum: the gradient goes to the operand that wins, shared on a tie (and to
    both where one is NaN, as eager's formula gives)."""
    def rule(a: Algebra, g, y, p, q):
        share = a.where(a.test("eq", p, q), a.mul(g, 0.5), g)
        return a.where(a.test(loses, p, q), 0.0, share), a.where(a.test(loses, q, p), 0.0, share)
    return rule


def _rounded_quotient(rounding: str):
    """fmod / remainder: d/da = 1, d/db = -(a / b rounded toward zero / down)."""
    def rule(a: Algebra, g, y, p, q):
        return g, a.mul(a.neg(g), a.ew(rounding, a.div(p, q)))
    return rule


def _atan2(a: Algebra, g, y, p, q):
    # eager's: g q / (p^2 + q^2) and -g p / (p^2 + q^2), the reciprocal taken as 0 where the
    # sum is 0 (at (0, 0), and where the squares underflow): 0 there, not NaN or inf
    squares = a.add(a.square(p), a.square(q))
    recip = a.where(a.test("eq", squares, 0.0), 0.0, a.ew("recip", squares))
    return a.mul(a.mul(g, q), recip), a.mul(a.mul(g, a.neg(p)), recip)


BINARY_RULES = {
    "add": lambda a, g, y, p, q: (g, g),
    "mul": lambda a, g, y, p, q: (a.mul(g, q), a.mul(g, p)),
    "truediv": lambda a, g, y, p, q: (a.div(g, q), a.div(a.mul(a.neg(g), p), a.square(q))),
    "pow": _pow,
    "max": _extreme("lt"),
    "min": _extreme("gt"),
    "fmod": _rounded_quotient("trunc"),
    "rem": _rounded_quotient("floor"),
    "atan2": _atan2,
    "straight_through": lambda a, g, y, p, q: (g, None),
}

TERNARY_RULES = {
    "where": lambda a, g, y, c, p, q: (None, a.where(c, g, 0.0), a.where(c, 0.0, g)),
    "fma": lambda a, g, y, p, q, r: (a.mul(g, q), a.mul(g, p), g),
}

# each rule above is given to the op of its name in the registry (ir/ops.py OPS)
for _name, _rule in {**UNARY_RULES, **BINARY_RULES, **TERNARY_RULES}.items():
    define_gradient(_name, _rule)


# -- reductions ----------------------------------------------------------------------------------
def _reduce(alg: Algebra, node: GraphNode, g: GraphNode, value: ValueOf) -> Optional[GraphNode]:
    op, src = node.op, node.src[0]
    if op.op in ("argmax", "argmin") or not differentiable(src):
        return None
    shape = src.shape
    if op.op == "add":
        return alg.expand(g, shape)
    x, y = value(src), alg.expand(value(node), shape)
    if op.op == "mul":
        return _prod_grad(alg, op.axes, g, x, y)
    if op.grad_to_first:  # torch.max(x, dim): all of it to the index eager returns
        first = alg.vb.reduce("arg" + op.op, x, op.axes, DType.int64)
        hit = alg.test("eq", alg.coordinate(shape, op.axes[0]), alg.expand(first, shape))
        return alg.where(hit, alg.expand(g, shape), 0.0)
    # amax / max of everything: shared evenly among the elements equal to the result
    hit = alg.cast(alg.test("eq", x, y), x.dtype)
    return alg.mul(alg.expand(alg.div(g, alg.sum(hit, op.axes)), shape), hit)


def _prod_grad(alg: Algebra, axes, g, x, y) -> GraphNode:
    """d prod / d x_i: prod / x_i without zeros; with one zero in the line, the product of
    the others at the zero and 0 elsewhere; with two or more, 0 everywhere."""
    shape = x.shape
    zero = alg.test("eq", x, 0)
    zeros = alg.expand(alg.sum(alg.cast(zero, DType.int64), axes), shape)
    others = alg.expand(alg.vb.reduce("mul", alg.where(zero, 1.0, x), axes), shape)
    at_lone_zero = alg.both(alg.test("eq", zeros, 1), zero)
    local = alg.where(alg.test("eq", zeros, 0), alg.div(y, x), alg.where(at_lone_zero, others, 0.0))
    return alg.mul(alg.expand(g, shape), local)


# -- scans -------------------------------------------------------------------------------------
def _cumulative(alg: Algebra, node: GraphNode, g: GraphNode, value: ValueOf):
    op, src = node.op, node.src[0]
    if op.op in ("argmax", "argmin") or not differentiable(src):
        return None
    axis = op.axis
    if op.op == "add":
        return alg.reverse_scan("add", g, axis)
    if op.op == "mul":
        return _cumprod_grad(alg, axis, g, value(src), value(node))
    if op.op == "logaddexp":
        return _logcumsumexp_grad(alg, axis, g, value(src), value(node))
    # cummax/cummin: each element gets the gradient of the positions whose running extreme it is
    index = alg.vb.scan("arg" + op.op, value(src), axis, DType.int64)
    return ScatterGrad(axis, index, g, f"cum{op.op}")


def _cumprod_grad(alg: Algebra, axis: int, g, x, y) -> GraphNode:
    """Before the first zero of the line: sum_{k>=i} g_k y_k / x_i. At the first zero z:
    prod(x before z) * sum_{k>=z} g_k prod(x_{z+1..k}). After it: 0 (eager's formula)."""
    zero = alg.test("eq", x, 0)
    zeros_so_far = alg.vb.scan("add", alg.cast(zero, DType.int64), axis)
    before = alg.test("eq", zeros_so_far, 0)
    at_first_zero = alg.both(zero, alg.test("eq", zeros_so_far, 1))
    simple = alg.div(alg.reverse_scan("add", alg.mul(g, y), axis), x)
    zeros_before = alg.sub(zeros_so_far, alg.cast(zero, DType.int64))
    after_zero_product = alg.vb.scan("mul", alg.where(alg.test("le", zeros_before, 0), 1.0, x), axis)
    prefix = alg.vb.reduce("mul", alg.where(before, x, 1.0), (axis,))
    tail = alg.sum(alg.where(alg.test("ge", zeros_so_far, 1), alg.mul(g, after_zero_product), 0.0), (axis,))
    at_zero = alg.expand(alg.mul(prefix, tail), x.shape)
    return alg.where(before, simple, alg.where(at_first_zero, at_zero, 0.0))


def _logcumsumexp_grad(alg: Algebra, axis: int, g, x, y) -> GraphNode:
    """eager's stable form: the positive and negative parts of g each as a reverse
    logcumsumexp in log space."""
    lowest = float(-3.4028234663852886e38) if x.dtype is not DType.float64 else -1.7976931348623157e308
    log_abs = alg.ew("log", alg.ew("abs", g))
    parts = []
    for sign in ("gt", "lt"):
        log_part = alg.where(alg.test(sign, g, 0), log_abs, lowest)
        parts.append(alg.ew("exp", alg.add(alg.reverse_scan("logaddexp", alg.sub(log_part, y), axis), x)))
    return alg.sub(parts[0], parts[1])


# -- indexed reads ---------------------------------------------------------------------------------
def _scatter(alg: Algebra, node: GraphNode, g: GraphNode, value: ValueOf) -> Grads:
    """index_put: the base gets the gradient where no value overwrote it (all of it when the
    values were added); each value gets the gradient at its offset, a repeated offset's
    values each the whole of it (as eager's formula gives)."""
    base, offsets, values = node.src
    where = value(offsets)  # in range: the forward checked them
    d_base = g
    if not node.op.accumulate:
        zeros = alg.zeros(values.shape, g.dtype)
        d_base = alg.vb.b.node(Scatter(checked=False, what=node.op.what), g.dtype, (g, where, zeros), node.view)
    count = math.prod(values.shape)
    line = alg.view(g, "reshape", (math.prod(node.shape),))
    picked = alg.vb.gather(line, 0, alg.view(where, "reshape", (count,)), what=node.op.what)
    return [d_base if differentiable(base) else None, None,
            alg.view(picked, "reshape", values.shape) if differentiable(values) else None]


def _gather(alg: Algebra, node: GraphNode, g: GraphNode, value: ValueOf):
    """table[..., j, ...] gets the sum of g over the positions whose index is j: for each of
    the (few) indices per line, a one-hot select over the table, all fused; with more, or
    over a long table axis, a scatter-add."""
    table, index = node.src
    if not differentiable(table):
        return None
    axis, n = node.op.axis, table.shape[node.op.axis]
    count = index.shape[axis]
    idx = value(index)
    if node.op.wrap_negative:
        idx = alg.where(alg.test("lt", idx, 0), alg.add(idx, n), idx)
    if node.op.flat or count > 1 and count * n > MAX_ONE_HOT_WORK:  # one-hot sums would cost too much: scatter
        return ScatterGrad(axis, idx, g, node.op.what)
    where_j = alg.coordinate(table.shape, axis)
    total = None
    for k in range(count):
        pick = alg.view(alg.view(idx, "select", axis, k), "unsqueeze", axis)
        part = alg.view(alg.view(g, "select", axis, k), "unsqueeze", axis)
        term = alg.where(alg.test("eq", where_j, alg.expand(pick, table.shape)), alg.expand(part, table.shape), 0.0)
        total = term if total is None else alg.add(total, term)
    return total if total is not None else alg.zeros(table.shape, g.dtype)

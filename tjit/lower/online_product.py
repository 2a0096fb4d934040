"""Products whose a is a softmax over the contraction, computed in one pass (flash attention's
forward): the row statistics the softmax needs are reductions along the product's own k,
so the product's kernel computes them in its k loop instead of reading them from a buffer
that an earlier kernel wrote.

The form recognised: a = exp(t - c) * f (or / f; then cast to the operand's type), where t
is computed on a's tiles without reading a reduction (the scores: nested products, a scale,
a mask), c and f are row values of reductions over a's last axis (softmax's max and sum),
and each of those reductions is one the looped accumulators compute online from a's tiles
(lower/reduction.py: a plain max or sum, or sum(exp(x - c)) with a running max). The
kernel keeps a running max m of t and accumulates exp(t - m) @ b, rescaling the
accumulator by exp(m_old - m_new) whenever m grows; after the loop

    sum_k exp(t - c) f b = exp(m - c) f * sum_k exp(t - m) b,

an exact rewrite for any c (where m or c is infinite, as OnlineExpSum does, 0 stands in for
it in the exponents). The probabilities are cast to the operand's type before f is applied
(f after the product), so 16-bit products round them before the division, as flash
attention does, where eager rounds after it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..ir import Elementwise, GraphNode, Reduce, View, ViewOp, toposort
from .domains import at_product, is_kernel_input
from .reduction import minus_row_value, online_accumulator


@dataclass(frozen=True)
class OnlineProduct:
    """How a product's a = exp(exponent - shift) * factor (or / factor) is computed online."""
    exponent: GraphNode  # t: varies along k, reads no reduction
    shift: GraphNode  # c: a row value
    factor: Optional[GraphNode]  # f: a row value (None: 1)
    divides: bool  # a = exp(t - c) / f
    reductions: tuple[GraphNode, ...]  # the Reduce nodes the kernel computes, in dependency order


def online_product(dot: GraphNode) -> Optional[OnlineProduct]:
    """The online form of `dot`, or None where its a is not of that form."""
    a = dot.src[0]
    if not isinstance(a.op, Elementwise):
        return None
    reductions = [n for n in toposort([a], stop=at_product) if isinstance(n.op, Reduce)]
    if not reductions or not all(_along_k(r, a.shape) for r in reductions):
        return None
    value = a.src[0] if _is(a, "cast") else a
    exp, factor, divides = value, None, False
    if _is(value, "mul") or _is(value, "truediv"):
        exp, factor = value.src
        if _is(factor, "exp") and not _is(exp, "exp") and value.op.op == "mul":
            exp, factor = factor, exp
        divides = value.op.op == "truediv"
    if not _is(exp, "exp") or factor is not None and not row_value(factor):
        return None
    found = minus_row_value(exp.src[0], row_value)
    if found is None or _reads_reduction(found[0]):
        return None
    if not all(online_accumulator(r, row_value) is not None and not any(_reads_reduction(s) for s in
               online_inputs(r)) for r in reductions):
        return None
    return OnlineProduct(found[0], found[1], factor, divides, tuple(reductions))


def online_inputs(reduce: GraphNode) -> tuple[GraphNode, ...]:
    """The values a reduction's accumulator reads on each tile."""
    return online_accumulator(reduce, row_value)


def _is(node: GraphNode, op: str) -> bool:
    return isinstance(node.op, Elementwise) and node.op.op == op


def _along_k(reduce: GraphNode, shape: tuple) -> bool:
    """A reduction of a value of a's shape over its last axis alone (a row statistic)."""
    src = reduce.src[0]
    return src.shape == shape and tuple(reduce.op.axes) == (len(shape) - 1,) and reduce.shape == shape[:-1] + (1,)


def row_value(node: GraphNode) -> bool:
    """An expression of reductions' results broadcast along k (and literals), reading nothing
    else: the same for every step of the loop."""
    nodes = toposort([node], stop=lambda n: isinstance(n.op, Reduce) or is_kernel_input(n))
    if not any(isinstance(n.op, Reduce) for n in nodes):
        return False
    for n in nodes:
        if isinstance(n.op, ViewOp) and isinstance(n.src[0].op, Reduce):
            if not _broadcast_along_k(n):
                return False
        elif not (isinstance(n.op, (Reduce, Elementwise)) or n.is_literal):
            return False
    return True


def _broadcast_along_k(view: GraphNode) -> bool:
    """A reduction's [.., m, 1] result read as [.., m, k]: each row its own value, the same
    along k (the kernel reads it from the same registers; a view that moved rows or batch
    indices would need another row's value)."""
    own = View.contiguous(view.src[0].shape)
    return view.view.offset == 0 and view.view.strides[-1] == 0 and all(
        n == 1 or st == expected for n, st, expected in zip(view.shape[:-1], view.view.strides[:-1], own.strides[:-1]))


def _reads_reduction(node: GraphNode) -> bool:
    return any(isinstance(n.op, Reduce) for n in toposort([node], stop=at_product))

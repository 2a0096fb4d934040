"""Bounds of index values computed from coordinates and literals (no data), so an indexed
read whose index is in range by construction needs no check and can be composed with the
read it feeds: roll's fmod(arange(n) + s, n), a reflection pad's n - |n - |i||, nearest
upsampling's trunc(i * scale). Float values are widened by a relative margin before they
are truncated, so rounding can never make a bound unsound."""
from __future__ import annotations

import math
from typing import Optional

from ..ir import Const, Elementwise, GraphNode, Iota, ViewOp

Range = Optional[tuple[float, float]]  # inclusive; None: unknown
MARGIN = 2.0 ** -20  # relative widening of float bounds (far above float32's rounding error)


def value_range(node: GraphNode, memo: Optional[dict] = None) -> Range:
    memo = {} if memo is None else memo
    if id(node) not in memo:
        memo[id(node)] = _range(node, memo)
    return memo[id(node)]


def _range(node: GraphNode, memo: dict) -> Range:
    op = node.op
    if isinstance(op, Const) or isinstance(op, ViewOp) and isinstance(node.src[0].op, Const):
        value = (node.src[0] if node.src else node).op.value
        return (value, value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    if isinstance(op, Iota):
        v = node.view
        if v.numel == 0:
            return None
        return (v.offset + sum(min(0, (n - 1) * st) for n, st in zip(v.shape, v.strides)),
                v.offset + sum(max(0, (n - 1) * st) for n, st in zip(v.shape, v.strides)))
    if not isinstance(op, Elementwise) or node.dtype.is_low_precision:
        return None
    args = [value_range(s, memo) for s in node.src]
    if op.op == "where":
        args = args[1:]
        if all(a is not None for a in args):
            clamped = _clamp_range(node, *args)
            if clamped is not None:
                return clamped
    if any(a is None for a in args):
        return None
    found = _elementwise_range(op.op, args, node)
    if found is None:
        return None
    lo, hi = found
    if node.dtype.is_float:  # every step may round: widen
        lo, hi = lo - abs(lo) * MARGIN - MARGIN, hi + abs(hi) * MARGIN + MARGIN
    elif node.dtype.is_int and not _fits(lo, hi, node):
        return None  # it may wrap
    return lo, hi


def _fits(lo, hi, node: GraphNode) -> bool:
    bits = node.dtype.itemsize * 8
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if node.dtype.is_signed_int else (0, (1 << bits) - 1)
    return low <= lo and hi <= high


def _elementwise_range(name: str, args, node: GraphNode) -> Range:
    if name in ("cast", "stop_gradient"):
        (lo, hi), = args
        if node.dtype.is_float or node.dtype.is_int and not node.src[0].dtype.is_float:
            return lo, hi
        if node.dtype.is_int:  # a float truncated toward zero
            return math.trunc(lo), math.trunc(hi)
        return None
    if name == "neg":
        (lo, hi), = args
        return -hi, -lo
    if name == "abs":
        (lo, hi), = args
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if name in ("floor", "trunc", "ceil"):
        (lo, hi), = args
        f = {"floor": math.floor, "trunc": math.trunc, "ceil": math.ceil}[name]
        return f(lo), f(hi)
    if name in ("add", "mul", "min", "max", "where"):
        (a, b), (c, d) = args
        if name == "add":
            return a + c, b + d
        if name == "mul":
            products = [a * c, a * d, b * c, b * d]
            return min(products), max(products)
        if name == "min":
            return min(a, c), min(b, d)
        if name == "max":
            return max(a, c), max(b, d)
        return min(a, c), max(b, d)
    if name == "fma":
        (a, b), (c, d), (e, f) = args
        products = [a * c, a * d, b * c, b * d]
        return min(products) + e, max(products) + f
    if name in ("fmod", "rem", "floordiv") and not node.dtype.is_float:
        (lo, hi), (c, d) = args
        if c != d or c <= 0:  # only by a positive literal
            return None
        if name == "floordiv":
            return lo // c, hi // c
        if name == "rem":
            return (lo, hi) if 0 <= lo and hi < c else (0, c - 1)
        return (lo, hi) if -c < lo and hi < c else ((0, c - 1) if lo >= 0 else (-(c - 1), c - 1))
    return None


def _clamp_range(node: GraphNode, bound: tuple, value: tuple) -> Range:
    """where(v < b, b, v) is max(v, b) and where(v > b, b, v) is min(v, b): clamp's form."""
    cond, b, v = node.src
    if not (isinstance(cond.op, Elementwise) and cond.op.op in ("lt", "le", "gt", "ge") and cond.src == (v, b)):
        return None
    if cond.op.op in ("lt", "le"):
        return max(value[0], bound[0]), max(value[1], bound[1])
    return min(value[0], bound[0]), min(value[1], bound[1])

"""Triton text for reductions: over a block (persistent) and with running accumulators
across the steps of a loop (looped).

Torch's semantics that Triton's built-ins lack are added here: max/min propagate NaN,
argmax/argmin count NaN as the extreme and pick the first index, masked lanes hold the
op's identity. float16/bfloat16 max/min are compared in float32 (exact), bools as int8.

Two sums are computed online in a loop, so their input is read once: sum(exp(a - c)) with
c a row value that depends on another reduction (softmax, logsumexp) keeps a running max
of a and a rescaled running sum; sum((a - c)^2) (variance around a mean) keeps Welford's
count, mean and M2 of a. Both are exact rewrites for any c.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..ir import DType, Elementwise, GraphNode, Reduce
from .elementwise import tl_dtype

INF = 'float("inf")'
NEG_INF = '-float("inf")'
NAN = 'float("nan")'


def work_dtype(dtype: DType) -> DType:
    """The type a reduction runs in: 16-bit floats widen to float32, bools to int8."""
    if dtype.is_low_precision:
        return DType.float32
    return DType.int8 if dtype is DType.bool else dtype


def identity(op: str, dtype: DType) -> str:
    """The value masked lanes hold."""
    if op == "add":
        return "0.0" if dtype.is_float else "0"
    if op == "mul":
        return "1.0" if dtype.is_float else "1"
    largest = op in ("min", "argmin")
    if dtype is DType.bool:  # any/all: False is max's identity, True is min's
        return "1" if largest else "0"
    if dtype.is_float:
        return INF if largest else NEG_INF
    bits = dtype.itemsize * 8
    if not dtype.is_signed_int:
        return str((1 << bits) - 1) if largest else "0"
    return str((1 << (bits - 1)) - 1) if largest else str(-(1 << (bits - 1)))


def over_axes(fn: str, value: str, axes: list[int]) -> str:
    """fn reduced over each block axis in turn, keeping them as size-1 axes."""
    for axis in axes:
        value = f"{fn}({value}, {axis}, keep_dims=True)" if fn != "tl.reduce_mul" else \
            f"tl.reduce({value}, {axis}, tm.mul_combine, keep_dims=True)"
    return value


def block_reduce(op: str, masked: str, dtype: DType, axes: list[int], fresh: Callable[[], str],
                 lines: list[str]) -> str:
    """`op` over `axes` of the variable `masked` (masked lanes already hold the identity);
    appends lines, returns the variable holding the result."""
    out = fresh()
    # Triton widens small integers in reductions; keep the reduction's own type
    narrow = f".to({tl_dtype(dtype)})" if not dtype.is_float and dtype.itemsize < 4 else ""
    if op in ("add", "mul"):
        lines.append(f"{out} = {over_axes('tl.sum' if op == 'add' else 'tl.reduce_mul', masked, axes)}{narrow}")
    elif op in ("max", "min"):
        lines.append(f"{out} = {over_axes('tl.' + op, masked, axes)}{narrow}")
        if dtype.is_float:  # Triton's max ignores NaN where the GPU's max.f32 does
            nan = over_axes("tl.max", f"({masked} != {masked}).to(tl.int8)", axes)
            lines.append(f"{out} = tl.where({nan} > 0, {NAN}, {out})")
    else:
        assert len(axes) == 1, "argmax/argmin reduce one block axis"
        axis = axes[0]
        plain = masked
        if dtype.is_float:  # NaN is handled below (and numpy's argmax in the interpreter rejects all-NaN rows)
            plain = f"tl.where({masked} != {masked}, {identity(op, dtype)}, {masked})"
        lines.append(f"{out} = tl.{op}({plain}, {axis}, keep_dims=True).to(tl.int64)")
        if dtype.is_float:
            isnan = f"({masked} != {masked}).to(tl.int8)"
            lines.append(f"{out} = tl.where(tl.max({isnan}, {axis}, keep_dims=True) > 0, "
                         f"tl.argmax({isnan}, {axis}, keep_dims=True).to(tl.int64), {out})")
    return out


def combine(op: str, dtype: DType, a: str, b: str) -> str:
    """Two partial results of an add/mul/max/min reduction combined (NaN propagates)."""
    if op in ("max", "min"):
        return f"tm.float_{op}({a}, {b})" if dtype.is_float else f"tl.{op}imum({a}, {b})"
    return f"{a} {'+' if op == 'add' else '*'} {b}"


def arg_value(op: str, masked: str, dtype: DType, axes: list[int], fresh, lines) -> str:
    """The extreme value an argmax/argmin picks (NaN if the block has one)."""
    return block_reduce("max" if op == "argmax" else "min", masked, dtype, axes, fresh, lines)


# -- looped accumulators -------------------------------------------------------------------------
@dataclass
class LoopContext:
    """What an accumulator needs from the kernel emitter."""
    row_shape: str  # e.g. "[BLOCK_0, 1]"
    axes: list[int]  # the block axes reduced
    mask: str  # the full mask inside the loop
    fresh: Callable[[], str]  # a new variable name
    chunk_start: str  # index of the first reduced element of this step (one reduced axis)
    # float sums carry Kahan's compensation from step to step (off where registers are dear: a
    # kernel with a tl.dot tile)
    compensated: bool = False


class Accumulator:
    """A reduction computed over the steps of a loop: init() before it, update() in its
    body, finalize() after it. `inputs` are the full values the loop evaluates; `after`
    the row values finalize() needs."""
    inputs: tuple[GraphNode, ...] = ()
    after: tuple[GraphNode, ...] = ()

    def __init__(self, node: GraphNode, ctx: LoopContext):
        self.node, self.ctx = node, ctx
        self.dtype = work_dtype(node.src[0].dtype) if node.op.op.startswith("arg") else work_dtype(node.dtype)
        self.t = tl_dtype(self.dtype)
        self.ident = identity(node.op.op, node.src[0].dtype)  # bools keep 0/1 identities in int8

    def _masked(self, value: str, lines: list[str]) -> str:
        """The step's values, with the op's identity in masked lanes."""
        masked = self.ctx.fresh()
        lines.append(f"{masked} = tl.where({self.ctx.mask}, {value}.to({self.t}), {self.ident})")
        return masked


class Plain(Accumulator):
    """Each step's block reduced, then combined into a running value. A float sum adds up
    one block total per step; without compensation its error grows with the number of steps
    (a [2000, 77] column sum: twice eager's cascade sum's), so it keeps Kahan's compensation
    where ctx allows (half eager's error there)."""

    def __init__(self, node, ctx):
        super().__init__(node, ctx)
        self.inputs = (node.src[0],)
        self.acc = ctx.fresh()
        self.lost = ctx.fresh() if ctx.compensated and node.op.op == "add" and self.dtype.is_float else None

    def init(self) -> list[str]:
        zero = [f"{self.lost} = tl.zeros({self.ctx.row_shape}, {self.t})"] if self.lost else []
        return [f"{self.acc} = tl.full({self.ctx.row_shape}, {self.ident}, {self.t})"] + zero

    def update(self, values: list[str]) -> list[str]:
        op, ctx = self.node.op.op, self.ctx
        lines: list[str] = []
        chunk = block_reduce(op, self._masked(values[0], lines), self.dtype, ctx.axes, ctx.fresh, lines)
        if self.lost is None:
            lines.append(f"{self.acc} = {combine(op, self.dtype, self.acc, chunk)}")
            return lines
        y, total = ctx.fresh(), ctx.fresh()
        lines += [f"{y} = {chunk} - {self.lost}",
                  f"{total} = {self.acc} + {y}",
                  # what the add rounded away; none once the total is inf or NaN (inf - inf would
                  # make it NaN, and eager's sum stays inf)
                  f"{self.lost} = tl.where({total} - {total} == 0, ({total} - {self.acc}) - {y}, 0.0)",
                  f"{self.acc} = {total}"]
        return lines

    def finalize(self, row_values: list[str]) -> tuple[list[str], str]:
        return [], self.acc


class Arg(Accumulator):
    def __init__(self, node, ctx):
        super().__init__(node, ctx)
        self.inputs = (node.src[0],)
        self.best, self.index = ctx.fresh(), ctx.fresh()

    def init(self) -> list[str]:
        op = self.node.op.op
        return [f"{self.best} = tl.full({self.ctx.row_shape}, {identity(op, self.dtype)}, {self.t})",
                f"{self.index} = tl.full({self.ctx.row_shape}, 0, tl.int64)"]

    def update(self, values: list[str]) -> list[str]:
        op, ctx = self.node.op.op, self.ctx
        lines: list[str] = []
        masked = self._masked(values[0], lines)
        best = arg_value(op, masked, self.dtype, ctx.axes, ctx.fresh, lines)
        index = block_reduce(op, masked, self.dtype, ctx.axes, ctx.fresh, lines)
        better = f"({best} > {self.best})" if op == "argmax" else f"({best} < {self.best})"
        if self.dtype.is_float:  # a NaN beats everything but an earlier NaN
            better = f"({better} | (({best} != {best}) & ({self.best} == {self.best})))"
        take = ctx.fresh()
        lines.append(f"{take} = {better}")
        lines.append(f"{self.index} = tl.where({take}, {index} + {ctx.chunk_start}, {self.index})")
        lines.append(f"{self.best} = tl.where({take}, {best}, {self.best})")
        return lines

    def finalize(self, row_values):
        return [], self.index


class OnlineExpSum(Accumulator):
    """sum(exp(a - c)) as s * exp(m - c), with m the running max of a and
    s = sum(exp(a - m)) rescaled whenever m grows. Where m is infinite, 0 stands in for it
    in the exponents, so no inf - inf arises that the plain formula would not have."""

    def __init__(self, node, ctx, a: GraphNode, c: GraphNode):
        super().__init__(node, ctx)
        self.inputs, self.after = (a,), (c,)
        self.m, self.s = ctx.fresh(), ctx.fresh()

    def init(self):
        shape, t = self.ctx.row_shape, self.t
        return [f"{self.m} = tl.full({shape}, {NEG_INF}, {t})", f"{self.s} = tl.full({shape}, 0.0, {t})"]

    def update(self, values):
        """(`m_new` and `exps` name the step's new running max and its exponentials, which a
        product's online softmax along the same values shares: codegen._online_tile.)"""
        ctx, a = self.ctx, values[0]
        f = ctx.fresh
        top, self.m_new, self.exps, chunk = f(), f(), f(), f()
        return [f"{top} = {over_axes('tl.max', f'tl.where({ctx.mask}, {a}, {NEG_INF})', ctx.axes)}",
                f"{self.m_new} = tl.maximum({self.m}, {top})",
                f"{self.exps} = tl.where({ctx.mask}, tl.exp({a} - {finite(self.m_new)}), 0.0)",
                f"{chunk} = {over_axes('tl.sum', self.exps, ctx.axes)}",
                f"{self.s} = tl.where({self.s} == 0.0, 0.0, {self.s} * tl.exp({finite(self.m)} - {finite(self.m_new)}))"
                f" + {chunk}",
                f"{self.m} = {self.m_new}"]

    def finalize(self, row_values):
        out = self.ctx.fresh()
        return [f"{out} = {self.s} * tl.exp({finite(self.m)} - {row_values[0]})"], out


def finite(m: str) -> str:
    return f"tl.where(tl.abs({m}) == {INF}, 0.0, {m})"


class Welford(Accumulator):
    """sum((a - c)^2) as M2 + n (mean - c)^2 from Welford's running count, mean and M2 of
    a, merged per step with Chan's formula."""

    def __init__(self, node, ctx, a: GraphNode, c: GraphNode):
        super().__init__(node, ctx)
        self.inputs, self.after = (a,), (c,)
        self.n, self.mean, self.m2 = ctx.fresh(), ctx.fresh(), ctx.fresh()

    def init(self):
        return [f"{v} = tl.full({self.ctx.row_shape}, 0.0, {self.t})" for v in (self.n, self.mean, self.m2)]

    def update(self, values):
        ctx, a, f = self.ctx, values[0], self.ctx.fresh
        cnt, mean_c, dev, m2_c, total, delta, frac = (f() for _ in range(7))
        return [
            f"{cnt} = {over_axes('tl.sum', f'tl.where({ctx.mask}, 1.0, 0.0).to({self.t})', ctx.axes)}",
            f"{mean_c} = {over_axes('tl.sum', f'tl.where({ctx.mask}, {a}, 0.0)', ctx.axes)} / tl.maximum({cnt}, 1.0)",
            f"{dev} = tl.where({ctx.mask}, {a} - {mean_c}, 0.0)",
            f"{m2_c} = {over_axes('tl.sum', f'{dev} * {dev}', ctx.axes)}",
            f"{total} = {self.n} + {cnt}",
            f"{delta} = {mean_c} - {self.mean}",
            f"{frac} = {cnt} / tl.maximum({total}, 1.0)",
            f"{self.mean} = {self.mean} + {delta} * {frac}",
            f"{self.m2} = {self.m2} + {m2_c} + {delta} * {delta} * {self.n} * {frac}",
            f"{self.n} = {total}",
        ]

    def finalize(self, row_values):
        out, gap = self.ctx.fresh(), self.ctx.fresh()
        return [f"{gap} = {self.mean} - {row_values[0]}",
                f"{out} = {self.m2} + {self.n} * {gap} * {gap}"], out


# -- recognising the online forms ----------------------------------------------------------------
def _is(node: GraphNode, op: str) -> bool:
    return isinstance(node.op, Elementwise) and node.op.op == op


def minus_row_value(node: GraphNode, is_row_value: Callable[[GraphNode], bool]) -> Optional[tuple]:
    """(a, c) when node is a - c with c a row value computed from another reduction."""
    if not _is(node, "add"):
        return None
    for a, b in (node.src, node.src[::-1]):
        if _is(b, "neg") and is_row_value(b.src[0]):
            return a, b.src[0]
    return None


def _accumulator_form(node: GraphNode, is_row_value) -> tuple[type, tuple]:
    """The accumulator class that computes `node` in a loop and its extra arguments."""
    op, src = node.op.op, node.src[0]
    assert isinstance(node.op, Reduce)
    if op == "add" and node.dtype.is_float:
        if _is(src, "exp") and (found := minus_row_value(src.src[0], is_row_value)):
            return OnlineExpSum, found
        if _is(src, "mul") and src.src[0] is src.src[1] and (found := minus_row_value(src.src[0], is_row_value)):
            return Welford, found
    return (Arg if op in ("argmax", "argmin") else Plain), ()


def accumulator_for(node: GraphNode, ctx: LoopContext, is_row_value) -> Accumulator:
    """The accumulator that computes `node` in a loop, reading its input once.
    `is_row_value(n)`: n does not vary along the reduced axes and reads a reduction."""
    cls, found = _accumulator_form(node, is_row_value)
    return cls(node, ctx, *found)


def online_accumulator(node: GraphNode, is_row_value) -> Optional[tuple[GraphNode, ...]]:
    """The values `node`'s accumulator reads on each step where it is a plain one or
    sum(exp(a - c)) (the forms a product's k loop computes: lower/online_product.py), else None."""
    cls, found = _accumulator_form(node, is_row_value)
    if cls is Plain:
        return (node.src[0],)
    return (found[0],) if cls is OnlineExpSum else None


# -- scans ----------------------------------------------------------------------------------------
ACCUMULATING_SCANS = ("add", "mul", "logaddexp")  # cummax/cummin (and their indices) are exact


def scan_work_dtype(op: str, dtype: DType, device: str) -> DType:
    """The type a scan of `dtype` runs in on `device` ("cpu" or "cuda"): eager's accumulation
    type there, or a wider one. CPU eager accumulates float32 scans in double (and 16-bit
    floats in float32): so does tjit on CPU. CUDA eager scans float32 in float32, as tjit does
    on CUDA (16-bit floats in float32 on both, which CUDA eager, whose scan state is the
    16-bit type, does not reach)."""
    work = work_dtype(dtype)
    if device == "cpu" and dtype is DType.float32 and op in ACCUMULATING_SCANS:
        return DType.float64
    return work


def scan_identity(op: str, dtype: DType) -> str:
    if op == "logaddexp":
        return NEG_INF
    return identity({"argmax": "max", "argmin": "min"}.get(op, op), dtype)


def _combine_fn(op: str, dtype: DType) -> str:
    if op in ("argmax", "argmin"):
        return f"tm.cum{op[3:]}_combine"
    if op == "mul":
        return "tm.mul_combine"
    if op in ("max", "min") and not dtype.is_float:
        return f"tm.int_{op}_combine"
    return f"tm.{op}_combine"


def scan_lines(op: str, masked: str, dtype: DType, axis: int, index: str, carry: Optional[list[str]],
               fresh, lines: list[str]) -> str:
    """The running `op` of `masked` along block axis `axis`; with `carry` (variables holding
    the running value of earlier loop steps, updated here), continued from it. `index` is
    the position along the axis (for argmax/argmin)."""
    out = fresh()
    if op in ("add", "mul"):
        narrow = f".to({tl_dtype(dtype)})" if not dtype.is_float and dtype.itemsize < 4 else ""
        lines.append(f"{out} = tl.{'cumsum' if op == 'add' else 'cumprod'}({masked}, {axis}){narrow}")
        if carry:
            total = f"tl.sum({masked}, {axis}, keep_dims=True)" if op == "add" else \
                f"tl.reduce({masked}, {axis}, tm.mul_combine, keep_dims=True)"
            sign = "+" if op == "add" else "*"
            lines += [f"{out} = {out} {sign} {carry[0]}", f"{carry[0]} = {carry[0]} {sign} {total}"]
        return out
    fn = _combine_fn(op, dtype)
    if op in ("argmax", "argmin"):
        value = fresh()
        positions = f"tl.zeros({masked}.shape, tl.int64) + {index}"
        lines.append(f"{value}, {out} = tl.associative_scan(({masked}, {positions}), {axis}, {fn})")
        if carry:
            last_v, last_i = fresh(), fresh()
            lines += [f"{value}, {out} = {fn}({carry[0]}, {carry[1]}, {value}, {out})",
                      f"{last_v}, {last_i} = tl.reduce(({masked}, {positions}), {axis}, {fn}, keep_dims=True)",
                      f"{carry[0]}, {carry[1]} = {fn}({carry[0]}, {carry[1]}, {last_v}, {last_i})"]
        return out
    lines.append(f"{out} = tl.associative_scan({masked}, {axis}, {fn})")
    if carry:
        lines += [f"{out} = {fn}({carry[0]}, {out})",
                  f"{carry[0]} = {fn}({carry[0]}, tl.reduce({masked}, {axis}, {fn}, keep_dims=True))"]
    return out


def scan_carry_init(op: str, dtype: DType, row_shape: str, fresh) -> tuple[list[str], list[str]]:
    """(init lines, carry variables) for a scan continued across loop steps."""
    value = fresh()
    lines = [f"{value} = tl.full({row_shape}, {scan_identity(op, dtype)}, {tl_dtype(dtype)})"]
    if op not in ("argmax", "argmin"):
        return lines, [value]
    index = fresh()
    return lines + [f"{index} = tl.full({row_shape}, 0, tl.int64)"], [value, index]

"""Reductions finished across programs, as part of the kernel emitter (codegen._Emitter).

Two forms share one mechanism. A split reduction (ThreadGroup on the reduced axis of a full
reduction) gives each program a chunk of the axis; a grid total (a scalar made from totals
of a reduction kernel's row values, e.g. cross-entropy's mean) gives each program its rows.
Each program writes its partial into a scratch buffer, counts itself done with an atomic,
and the last program to finish combines the partials in program order (deterministic),
computes the stores from the combined values, and resets the count for the next call.
"""
from __future__ import annotations

from typing import Optional

from ..ir import Const, Cumulative, DType, Elementwise, Gather, GraphNode, Reduce, ViewOp, toposort
from .domains import GRID_OPS, is_kernel_input, is_value_ref, kernel_expressions
from .elementwise import _cast, literal, render, tl_dtype
from .reduction import LoopContext, Plain, combine, identity, work_dtype

COUNTER_PARAM = "counter_ptr"  # the parameter of codegen.COUNTER


class GridReductionEmitter:
    """Mixed into codegen._Emitter, whose state (group, domain, space, totals, scratch, ...)
    and helpers (_row, _full, _loop, _fresh, ...) these methods use."""

    def _splittable(self) -> bool:
        """A reduction over every axis whose results the last program can finish: plain
        add/mul/max/min reductions that read no other reduction, stores computed from
        their results by elementwise ops and literals only."""
        if len(self.domain.axes) != len(self.shape) or any(s.totals for s in self.group.stores):
            return False
        reduces = [n for n in kernel_expressions(self._store_values()) if isinstance(n.op, Reduce)]
        if not reduces or any(r.op.op not in GRID_OPS or self._nested(r) for r in reduces):
            return False
        stop = lambda n: is_kernel_input(n) or isinstance(n.op, Reduce)  # noqa: E731
        above = toposort(self._store_values(), stop=stop)
        return all(isinstance(n.op, (Reduce, Elementwise, Const)) or (isinstance(n.op, ViewOp) and
                   isinstance(n.src[0].op, (Const, Reduce))) for n in above)

    def _nested(self, r: GraphNode) -> bool:
        stop = lambda n: is_kernel_input(n) or (isinstance(n.op, Reduce) and n is not r)  # noqa: E731
        return any(isinstance(n.op, (Reduce, Cumulative, Gather)) and n is not r for n in toposort([r], stop=stop))

    def _split_values(self, inner: list[str], sizes) -> list[str]:
        """Each program reduces its chunk of the (one) reduced axis; the last program to
        finish combines the partials and writes every store (see _grid_epilogue)."""
        d = self.space.loop_dims[self.red_dims[0]]
        chunk = -(-self.space.sizes[d.axes[0]] // d.programs)
        self._scalar("split_chunk", -(-chunk // d.width) * d.width)
        ctx = LoopContext(self._row_shape(), list(self.red_dims), "mask", self._fresh, "0", compensated=not self._has_dot())
        lines, body, full, row = [], [], {}, {}
        partials = {}
        for r in self.totals:
            acc = Plain(r, ctx)
            lines += acc.init()
            body += acc.update([_cast(self._full(r.src[0], body, full, lines, row), r.src[0].dtype, acc.dtype)])
            partials[id(r)] = acc.acc
        lines += self._loop(inner + body, sizes)
        return lines + self._grid_epilogue(lines, row, partials)

    def _roots(self) -> list[GraphNode]:
        """What every program computes: the stores' values, but for a store of grid
        reductions only their inputs (the last program combines them)."""
        return [s.value for s in self.group.stores if not s.totals and s.online_of is None] + \
            [t.src[0] for t in self.totals]

    def _grid_epilogue(self, lines: list[str], memo: dict, partials: Optional[dict] = None) -> list[str]:
        """Each program writes its partial of every grid reduction; the last program to
        finish (an atomic count) combines the partials in program order, which keeps the
        result deterministic, writes the grid stores and resets the count for the next call."""
        if not self.totals:
            return []
        out = []
        for j, total in enumerate(self.totals):
            work = work_dtype(total.src[0].dtype)
            if partials is not None:  # a split reduction: the program's accumulator
                masked = partials[id(total)]
            else:  # a total over rows: this program's rows
                value = self._row(total.src[0], lines, memo)
                masked = self._fresh()
                out.append(f"{masked} = tl.where(row_mask, {_cast(value, total.src[0].dtype, work)}, "
                           f"{identity(total.op.op, total.src[0].dtype)})")
            out.append(f"tl.store({self.scratch[j].param} + pid_grid, {self._reduce_all(total.op.op, masked, work, out)})")
        out += ["tl.debug_barrier()",  # every thread's partial is written before the count moves
                f"done = tl.atomic_add({COUNTER_PARAM}, 1, sem='acq_rel')",
                "if done == tl.num_programs(0) - 1:"]
        body, totals = [], {}
        for j, total in enumerate(self.totals):
            totals[id(total)] = self._combine_partials(j, total, body)
        for store, n in zip(self.group.stores, self.store_access):
            if store.totals or self.split:
                value = self._grid_value(store.value, totals, body)
                if store.value.dtype != self.accesses[n].buffer.dtype:
                    value = f"{value}.to({tl_dtype(self.accesses[n].buffer.dtype)})"
                body.append(f"tl.store({self._address(n)}, {value})")
        body.append(f"tl.atomic_xchg({COUNTER_PARAM}, 0)")
        return out + ["    " + ln for ln in body]

    def _reduce_all(self, op: str, block: str, work: DType, lines: list[str]) -> str:
        """`op` over every element of a block, as a scalar (NaN propagates for max/min)."""
        fn = {"add": "tl.sum({0})", "mul": "tl.reduce(tl.reshape({0}, [{0}.numel]), 0, tm.mul_combine)",
              "max": "tl.max({0})", "min": "tl.min({0})"}[op]
        var = self._fresh()
        narrow = f".to({tl_dtype(work)})" if not work.is_float and work.itemsize < 4 else ""  # Triton widens
        lines.append(f"{var} = {fn.format(block)}{narrow}")
        if op in ("max", "min") and work.is_float:
            lines.append(f"{var} = tl.where(tl.max(({block} != {block}).to(tl.int8)) > 0, float('nan'), {var})")
        return var

    def _combine_partials(self, j: int, total: GraphNode, lines: list[str]) -> str:
        op, work = total.op.op, work_dtype(total.src[0].dtype)
        acc, chunk, part = self._fresh(), self._fresh(), self._fresh()
        ident = identity(op, total.src[0].dtype)
        lines += [f"{acc} = tl.full([], {ident}, {tl_dtype(work)})",
                  "for first in range(0, tl.num_programs(0), 1024):",
                  f"    {chunk} = first + tl.arange(0, 1024)",
                  f"    {part} = tl.load({self.scratch[j].param} + {chunk}, mask={chunk} < tl.num_programs(0), "
                  f"other={ident}, volatile=True)"]
        step: list[str] = []
        value = self._reduce_all(op, part, work, step)
        step.append(f"{acc} = {combine(op, work, acc, value)}")
        lines += ["    " + ln for ln in step]
        result = self._fresh()
        lines.append(f"{result} = {_cast(acc, work, total.dtype)}")
        return result

    def _grid_value(self, node: GraphNode, totals: dict, lines: list[str]) -> str:
        """A grid store's scalar value from the combined totals (literals and elementwise
        ops on top of them: grid_totals admits nothing else)."""
        if is_value_ref(node):
            node = node.src[0]
        if id(node) in totals:
            return totals[id(node)]
        if isinstance(node.op, Elementwise):
            args = [self._grid_value(s, totals, lines) for s in node.src]
            var = self._fresh()
            lines.append(f"{var} = {render(node, args)}")
            totals[id(node)] = var
            return var
        const = node if isinstance(node.op, Const) else node.src[0]
        return literal(const.op.value, const.dtype)

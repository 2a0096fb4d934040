"""Building IR values: the operations the frontend's op table and the autograd rules share.

Views are pushed to the leaves (a movement op on an elementwise value is applied to its
operands instead, since elementwise ops commute with index remapping), so inside the IR a
ViewOp only ever reads an Input, a Const or a materialised buffer; indexed reads are pushed
the same way. Both are memoised, so the same view of the same value is one node.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..ir import (Const, Contiguous, Cumulative, Dot, DType, Elementwise, Extern, Gather, GraphBuilder, GraphNode, Input, Iota,
                  Reduce, View, ViewOp, Window, toposort)
from ..ir.ops import op_def
from ..ir.view import _infer_reshape
from .dot import view_of_dot

ViewFn = tuple  # ("permute", dims) etc.: a hashable description of a movement op


def apply_view_desc(view: View, desc: ViewFn) -> Optional[View]:
    kind, *args = desc
    return getattr(view, kind)(*args)


def inverse_views(shape: tuple[int, ...], views: tuple) -> Optional[list[ViewFn]]:
    """The views that undo `views` (applied in turn to a value of this shape), in the order
    they apply; None if one drops or repeats elements (a slice, an expand) or has no strided
    form. Only permute, reshape, squeeze, unsqueeze and flip are undone."""
    shapes = [tuple(shape)]
    for desc in views:
        after = apply_view_desc(View.contiguous(shapes[-1]), desc)
        if after is None:
            return None
        shapes.append(after.shape)
    undone = [_undo(desc, before) for desc, before in zip(reversed(views), reversed(shapes[:-1]))]
    return None if None in undone else undone


def _undo(desc: ViewFn, before: tuple[int, ...]) -> Optional[ViewFn]:
    """The view that undoes `desc` on a value of shape `before`; None for one that drops or
    repeats elements."""
    kind, *args = desc
    if kind == "permute":
        dims = [d % len(args[0]) for d in args[0]]
        return ("permute", tuple(dims.index(d) for d in range(len(dims))))
    if kind in ("reshape", "squeeze", "unsqueeze"):
        return ("reshape", before)
    return desc if kind == "flip" else None


class ValueBuilder:
    """Creates IR values in one GraphBuilder."""

    def __init__(self, builder: Optional[GraphBuilder] = None, indices_checked: bool = False):
        """indices_checked: every index an indexed read will use is known to be in range (a
        backward graph: its forward checked them)."""
        self.b = builder or GraphBuilder()
        self.indices_checked = indices_checked
        self._view_memo: dict[tuple, GraphNode] = {}
        # id of an expression a view was pushed into -> (the viewed value, the view): the
        # expression computes that view of the value from the value's own leaves
        self.view_sources: dict[int, tuple[GraphNode, ViewFn]] = {}
        self._copies = 0  # materialisations made so far (a view pushed into an expression counts them)
        # whether a view that swaps a product's rows and columns builds the transposed
        # product (frontend/dot.py's view_of_dot); only while view_transposing_products runs
        self.transposing_products = False

    def const(self, value, dtype: DType) -> GraphNode:
        return self.b.const(_coerce_scalar(value, dtype), dtype)

    def elementwise(self, op: str, operands: list[GraphNode], dtype: DType) -> GraphNode:
        shape = operands[0].shape
        assert all(o.shape == shape for o in operands), f"{op}: operand shapes differ {[o.shape for o in operands]}"
        return self.b.node(Elementwise(op), dtype, tuple(operands), View.contiguous(shape))

    def cast(self, node: GraphNode, dtype: DType) -> GraphNode:
        if node.dtype == dtype:
            return node
        if isinstance(node.op, Const):
            return self.const(node.op.value, dtype)
        return self.elementwise("cast", [node], dtype)

    def reduce(self, op: str, value: GraphNode, axes, dtype: Optional[DType] = None,
               grad_to_first: bool = False) -> GraphNode:
        """`op` over `axes` of value, keeping them as size-1 axes. Reducing only size-1 axes
        is the identity (argmax: index 0), so a Reduce node never has the shape of its input."""
        rank = len(value.shape)
        axes = tuple(sorted({a % rank for a in axes})) if rank else ()
        dtype = dtype or value.dtype
        if all(value.shape[a] == 1 for a in axes):
            return self.const(0, dtype) if op in ("argmax", "argmin") else self.cast(value, dtype)
        shape = tuple(1 if d in axes else s for d, s in enumerate(value.shape))
        return self.b.node(Reduce(op, axes, grad_to_first=grad_to_first), dtype, (value,), View.contiguous(shape))

    def scan(self, op: str, value: GraphNode, axis: int, dtype: Optional[DType] = None) -> GraphNode:
        """The running `op` of value along `axis` (same shape). Along a size-1 axis it is the
        identity (argmax: index 0)."""
        dtype = dtype or value.dtype
        if not value.shape or value.shape[axis % len(value.shape)] == 1:
            if op in ("argmax", "argmin"):
                return self.expand_to(self.const(0, dtype), value.shape)
            return self.cast(value, dtype)
        return self.b.node(Cumulative(op, axis % len(value.shape)), dtype, (value,), View.contiguous(value.shape))

    def gather(self, node: GraphNode, axis: int, index: GraphNode, wrap_negative: bool = False,
               what: str = "gather") -> GraphNode:
        """node[i with coordinate `axis` replaced by index[i]], shaped like index (whose other
        sizes are at most node's). Pushed through elementwise ops, like views, so the read
        lands on the leaves: a gathered log_softmax gathers its input and reuses the row
        values (cross-entropy stays one kernel)."""
        key = (id(node), "gather", axis, id(index), wrap_negative)
        found = self._view_memo.get(key)
        if found is None:
            found = self._view_memo[key] = self._gather_uncached(node, axis, index, wrap_negative, what)
        return found

    def _gather_uncached(self, node, axis, index, wrap_negative, what) -> GraphNode:
        shape = index.shape
        in_range = self.indices_checked or known_in_range(index, node.shape[axis])
        if isinstance(node.op, Iota) and in_range:  # arithmetic: the coordinate replaced
            v = node.view
            rest = self.iota(View(shape, tuple(0 if d == axis else st for d, st in enumerate(v.strides)), v.offset),
                             DType.int64)
            step = self.elementwise("mul", [self.cast(index, DType.int64),
                                            self.expand_to(self.const(v.strides[axis], DType.int64), shape)], DType.int64)
            return self.cast(self.elementwise("add", [rest, step], DType.int64), node.dtype)
        if isinstance(node.op, Gather) and not node.op.checked and _reads_memory(node.src[0]) and \
                (in_range or node.op.axis != axis):
            return self._gather_of_gather(node, axis, index, wrap_negative, what, in_range)
        if isinstance(node.op, Elementwise):
            src = [self.gather(s, axis, index, wrap_negative, what) for s in node.src]
            return self.b.node(node.op, node.dtype, tuple(src), View.contiguous(shape))
        if isinstance(node.op, Window):  # a padded value gathered: its source read at the coordinates
            index = self.cast(index, DType.int64)
            coords = [(index if in_range else in_range_or_minus_one(self, index, node.shape[axis], wrap_negative))
                      if d == axis else self.cast(self.coordinate(shape, d), DType.int64) for d in range(len(shape))]
            return self._read_window_at(node, coords, not in_range, what)
        if isinstance(node.op, ViewOp) and node.view.strides[axis] == 0 and \
                (isinstance(node.src[0].op, (Const, Reduce)) or self.indices_checked):
            # a literal or a row value, constant along the axis: any in-range index reads the
            # same value (a broadcast input is still gathered, so its index is checked, unless
            # that was done before)
            view = View(shape, node.view.strides, node.view.offset)
            base = node.src[0]
            if view == base.view and isinstance(base.op, Reduce):
                return base
            return self.b.node(ViewOp(), node.dtype, (base,), view)
        if node.is_literal:  # (a view of) a literal with extent along the axis (a 0-d one read as a line)
            if in_range:  # every element is the literal: nothing to read
                return self.expand_to(node.src[0] if node.src else node, shape)
            # a gather's table must be memory (materialize keeps a literal as it is): a buffer
            # the literal is written to, whose read checks the index as eager does
            node = self.b.node(Contiguous(), node.dtype, (node,), View.contiguous(node.shape))
        if isinstance(node.op, Dot) and axis == len(shape) - 1 and shape == node.shape[:-1] + (1,):
            return self._picked_from_rows(node, index, wrap_negative, in_range)
        if not (node.is_leaf and not isinstance(node.op, (Const, Iota))) and not isinstance(node.op, Contiguous):
            node = self.materialize(node)
        return self.b.node(Gather(axis, wrap_negative, what, checked=not in_range), node.dtype, (node, index),
                           View.contiguous(shape))

    def _picked_from_rows(self, product: GraphNode, index: GraphNode, wrap_negative: bool, in_range: bool):
        """One element per row of a product (cross-entropy's target logit): the row's sum of
        the one element whose column is the index, so the kernel that reduces the product's
        rows computes it too and the product need not be in memory; the index is checked
        in range as a read of memory would check it."""
        columns = product.shape[-1]
        index = self.cast(index, DType.int64)
        if wrap_negative:
            index = wrapped(self, index, columns)
        if not in_range:
            size = self.expand_to(self.const(columns, DType.int64), index.shape)
            index = self.elementwise("index_in_range", [index, size], DType.int64)
        hit = self.elementwise("eq", [self.coordinate(product.shape, len(product.shape) - 1, DType.int64),
                                      self.expand_to(index, product.shape)], DType.bool)
        zero = self.expand_to(self.const(0, product.dtype), product.shape)
        return self.reduce("add", self.elementwise("where", [hit, product, zero], product.dtype),
                           (len(product.shape) - 1,))

    def _gather_of_gather(self, inner: GraphNode, axis: int, index: GraphNode, wrap_negative: bool, what: str,
                          in_range: bool) -> GraphNode:
        """An indexed read of an indexed read whose index is in range by construction (roll
        along two dims, a pad by reflection): one read of the inner table, at the inner
        index read at the outer one (so the inner value need not be in memory)."""
        table, inner_index = inner.src
        shape = index.shape
        index = self.cast(index, DType.int64)
        coords = []
        for d in range(len(shape)):
            if d == inner.op.axis:
                coords.append(self.cast(self.gather(inner_index, axis, index, wrap_negative, what), DType.int64))
            elif d == axis:
                coords.append(index if in_range else in_range_or_minus_one(self, index, inner.shape[axis],
                                                                           wrap_negative))
            else:
                coords.append(self.cast(self.coordinate(shape, d), DType.int64))
        return self.read_at(table, coords, checked=not in_range, what=what)

    def loads(self, node: GraphNode, up_to: Optional[int] = None) -> int:
        """How many leaves in memory node's fused expression reads; with `up_to`, counted only
        until that many are found (an unrolled loop's gradient pieces each read every step
        before them: a test against a limit need not walk them all)."""
        found, seen, stack = 0, set(), [node]
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if _reads_memory(n):
                found += 1
                if found == up_to:
                    break
            else:
                stack.extend(n.src)
        return found

    def reshaped_from(self, node: GraphNode) -> Optional[GraphNode]:
        """The computed value whose reshape node's expression is (built by pushing the reshape
        into it), if it is one."""
        found = self.view_sources.get(id(node))
        return found[0] if found is not None and found[1][0] == "reshape" else None

    def _viewed_from(self, node: GraphNode, source: GraphNode) -> bool:
        """Whether node is (a view of a view of...) source: then source is not recorded as a
        view of node (x.reshape(a).reshape(b) is x itself again; a cycle of view sources would
        send library.in_memory round it forever)."""
        while id(node) in self.view_sources:
            node = self.view_sources[id(node)][0]
            if node is source:
                return True
        return False

    def view_chains(self, nodes: set[int]) -> dict[int, list[tuple[GraphNode, tuple]]]:
        """Graph.view_chains for the graph of these nodes (ids), from view_sources: a chain
        may pass through values that are not nodes of the graph."""
        chains = {}
        for key in nodes:
            found, views, seen, current = [], (), {key}, key
            while current in self.view_sources:
                value, desc = self.view_sources[current]
                views = (desc, *views)
                current = id(value)
                if current in seen:  # (hash-consing can make two values views of each other)
                    break
                seen.add(current)
                if current in nodes:
                    found.append((value, views))
            if found:
                chains[key] = found
        return chains

    def materialize(self, node: GraphNode) -> GraphNode:
        if isinstance(node.op, (Contiguous, Input, Const, Extern)):
            return node
        self._copies += 1
        return self.b.node(Contiguous(), node.dtype, (node,), View.contiguous(node.shape))

    def view(self, node: GraphNode, desc: ViewFn) -> GraphNode:
        """Apply a movement op, pushing it through elementwise nodes to the leaves."""
        key = (id(node), desc)
        found = self._view_memo.get(key)
        if found is None:
            found = self._view_memo[key] = self._view_uncached(node, desc)
            if isinstance(found.op, Elementwise) and found is not node and not self._viewed_from(node, found):
                self.view_sources.setdefault(id(found), (node, desc))
            if desc[0] == "permute":  # permuted back, it is the node itself (not a copy of its expression)
                dims = [d % len(desc[1]) for d in desc[1]] if desc[1] else []
                back = tuple(dims.index(d) for d in range(len(dims)))
                self._view_memo.setdefault((id(found), ("permute", back)), node)
        return found

    def view_transposing_products(self, node: GraphNode, desc: ViewFn) -> GraphNode:
        """The view of node's expression with the products in it computed transposed
        (b.T @ a.T) where the view swaps their rows and columns, instead of written to memory
        and read through the view. The memo is left as it was: other views of those products
        still read them from memory."""
        memo = dict(self._view_memo)
        self.transposing_products = True
        try:
            return self._view_uncached(node, desc)
        finally:
            self._view_memo, self.transposing_products = memo, False

    def _view_uncached(self, node: GraphNode, desc: ViewFn) -> GraphNode:
        if isinstance(node.op, Iota):
            new = apply_view_desc(node.view, desc)
            if new is not None:
                return self.b.node(Iota(), node.dtype, (), new)
            return self._reshaped_iota(node, desc[1])
        if isinstance(node.op, Window):
            found = self.view_window(node, desc)
            if found is not None:
                return found
            node = self.materialize(node)
        if isinstance(node.op, Elementwise):
            copies, memo = self._copies, len(self._view_memo)
            pushed = [self._try_view(s, desc) for s in node.src]
            # pushing the view down may copy parts of the expression that cannot take it; more
            # than one such copy costs more than copying the whole expression once (a sum of
            # gradient terms, each copied to be reshaped, held one buffer per term). The count
            # keeps the copies of the parts given up on below (a residual stream's nested sums
            # are then copied once, at the outermost sum that needs several), whose memo entries
            # are forgotten, so no later view of a part reuses an unused copy
            if all(p is not None for p in pushed) and self._copies - copies <= 1:
                shape = pushed[0].shape
                return self.b.node(node.op, node.dtype, tuple(pushed), View.contiguous(shape))
            for key in list(self._view_memo)[memo:]:
                del self._view_memo[key]
            node = self.materialize(node)
        if isinstance(node.op, ViewOp):
            new = apply_view_desc(node.view, desc)
            base = node.src[0]
            if new is not None and (not isinstance(base.op, Gather) or _keeps_elements(base.view, new)):
                # (a view back to the base's own is the base: hash-consing then finds the
                # expressions over it equal, as a backward's formulas read saved values twice)
                return base if new == base.view else self.b.node(ViewOp(), node.dtype, node.src, new)
            node = self.materialize(node)
        if isinstance(node.op, Gather) and not node.op.checked and _reads_memory(node.src[0]) and \
                not _keeps_elements(node.view, apply_view_desc(node.view, desc)):
            # an in-range indexed read, viewed: one read of its table at viewed coordinates
            coords = [self.view(self.cast(node.src[1] if d == node.op.axis else self.coordinate(node.shape, d),
                                          DType.int64), desc) for d in range(len(node.shape))]
            return self.read_at(node.src[0], coords, checked=False, what=node.op.what)
        if isinstance(node.op, Gather) and _keeps_elements(node.view, apply_view_desc(node.view, desc)):
            # a gathered value squeezed, unsqueezed or broadcast stays in registers (cross-entropy's row)
            return self.b.node(ViewOp(), node.dtype, (node,), apply_view_desc(node.view, desc))
        if isinstance(node.op, Dot):
            found = view_of_dot(self, node, desc)
            if found is not None:
                return found
        if not isinstance(node.op, (Input, Const, Contiguous, Reduce, Extern)):
            node = self.materialize(node)
        new = apply_view_desc(node.view, desc)
        if new is None:  # an input whose layout cannot be reshaped as a view: copy it dense
            node = self.b.node(Contiguous(), node.dtype, (node,), View.contiguous(node.shape))
            new = apply_view_desc(node.view, desc)
        return node if new == node.view else self.b.node(ViewOp(), node.dtype, (node,), new)

    def _reshaped_iota(self, node: GraphNode, shape) -> GraphNode:
        """A reshape no strided view expresses (merging permuted axes), as arithmetic: each
        old coordinate from the row-major position in the new shape."""
        shape = _infer_reshape(tuple(shape), node.view.numel)
        position = self.iota(View.contiguous(shape), DType.int64)
        value, inner = self.expand_to(self.const(node.view.offset, DType.int64), shape), 1
        for n, st in reversed(list(zip(node.shape, node.view.strides))):
            if st and n > 1:
                c = self.elementwise("floordiv", [position, self.expand_to(self.const(inner, DType.int64), shape)],
                                     DType.int64) if inner > 1 else position
                c = self.elementwise("rem", [c, self.expand_to(self.const(n, DType.int64), shape)], DType.int64)
                value = self.elementwise("add", [value, self.elementwise(
                    "mul", [c, self.expand_to(self.const(st, DType.int64), shape)], DType.int64)], DType.int64)
            inner *= n
        return self.cast(value, node.dtype)

    def _try_view(self, node: GraphNode, desc: ViewFn) -> Optional[GraphNode]:
        if isinstance(node.op, Iota):
            return self.view(node, desc)
        if isinstance(node.op, (ViewOp, Input, Const, Contiguous, Reduce, Extern)):
            return None if apply_view_desc(node.view, desc) is None else self.view(node, desc)
        if isinstance(node.op, Window):
            return self.view(node, desc) if self.view_window(node, desc) is not None else None
        if isinstance(node.op, Dot):
            # a product the view cannot be pushed into is written with the expression around
            # it (its bias, activation), which then is the copy the view reads
            key = (id(node), desc)
            if key not in self._view_memo:
                found = view_of_dot(self, node, desc)
                if found is None:
                    return None
                self._view_memo[key] = found
            return self._view_memo[key]
        return self.view(node, desc)

    def expand_to(self, node: GraphNode, shape: tuple[int, ...]) -> GraphNode:
        shape = tuple(shape)
        if node.shape == shape:
            return node
        return self.view(node, ("expand", shape))

    # -- index arithmetic: coordinates, shifted reads, reads at computed coordinates -----------
    def iota(self, view: View, dtype: DType) -> GraphNode:
        """The offset `view` maps each index to, as a value (no memory is read)."""
        return self.b.node(Iota(), dtype, (), view)

    def coordinate(self, shape, axis: int, dtype: Optional[DType] = None) -> GraphNode:
        """Each element's index along `axis` of `shape` (int32 when it fits, else int64)."""
        shape = tuple(shape)
        dtype = dtype or (DType.int32 if shape[axis] <= INT32_MAX else DType.int64)
        return self.iota(View(shape, tuple(int(d == axis) for d in range(len(shape)))), dtype)

    def before(self, shape, axis: int, bound: int) -> GraphNode:
        """Where the index along `axis` is below `bound`: a coordinate offset by -bound against
        0, so the bound is a kernel argument (one kernel source serves every size)."""
        dtype = DType.int64 if max(abs(bound), shape[axis]) > INT32_MAX // 2 else DType.int32
        c = self.iota(View(tuple(shape), tuple(int(d == axis) for d in range(len(shape))), -bound), dtype)
        return self.elementwise("lt", [c, self.expand_to(self.const(0, dtype), tuple(shape))], DType.bool)

    def in_window(self, low, src_shape, shape) -> Optional[GraphNode]:
        """Where out index i - low is an index of a `src_shape` value (None: everywhere)."""
        test = None
        for d, (lo, n, size) in enumerate(zip(low, src_shape, shape)):
            parts = ([self.elementwise("logical_not", [self.before(shape, d, lo)], DType.bool)] if lo > 0 else []) + \
                ([self.before(shape, d, lo + n)] if lo + n < size else [])
            for part in parts:
                test = part if test is None else self.elementwise("logical_and", [test, part], DType.bool)
        return test

    def window(self, node: GraphNode, low, shape, fill) -> GraphNode:
        """out[i] = node[i - low] where that is an index of node, else `fill` (a pad: low is
        the pad before each axis, negative to crop)."""
        shape, low = tuple(shape), tuple(low)
        reach = [(max(lo, 0), min(lo + n, size)) for lo, n, size in zip(low, node.shape, shape)]
        fill_value = self.expand_to(self.const(fill, node.dtype), shape)
        if math.prod(shape) == 0 or any(a >= b for a, b in reach):
            return fill_value  # nothing of node is read
        if all(lo <= 0 and lo + n >= size for lo, n, size in zip(low, node.shape, shape)):
            for d, (lo, size) in enumerate(zip(low, shape)):  # a crop: a plain view
                if (lo, size) != (0, node.shape[d]):
                    node = self.view(node, ("slice", d, -lo, -lo + size, 1))
            return node
        if _reads_memory(node):
            return self._window_node(node, low, shape, fill)
        inside = self.in_window(low, node.shape, shape)
        return self.elementwise("where", [inside, self.shifted(node, low, shape), fill_value], node.dtype)

    def shifted(self, node: GraphNode, low, shape) -> GraphNode:
        """node[i - low] wherever that is an index of node; any value elsewhere (the caller
        selects those lanes away), but never a read outside node's memory. Pushed through
        elementwise ops to the leaves, so the shifted expression fuses into its reader."""
        key = (id(node), "shifted", tuple(low), tuple(shape))
        found = self._view_memo.get(key)
        if found is None:
            found = self._view_memo[key] = self._shifted_uncached(node, tuple(low), tuple(shape))
        return found

    def _shifted_uncached(self, node: GraphNode, low, shape) -> GraphNode:
        if all(lo == 0 for lo in low) and node.shape == shape:
            return node
        if node.is_literal:
            return self.expand_to(node.src[0] if node.src else node, shape)
        if isinstance(node.op, Iota):
            v = node.view
            return self.iota(View(shape, v.strides, v.offset - sum(lo * st for lo, st in zip(low, v.strides))),
                             node.dtype)
        if isinstance(node.op, Window):
            low = tuple(a + b for a, b in zip(node.op.low, low))
            return self._window_node(node.src[0], low, shape, node.op.fill)
        if isinstance(node.op, Elementwise) and not _checked_division(node):
            src = [self.shifted(s, low, shape) for s in node.src]
            return self.b.node(node.op, node.dtype, tuple(src), View.contiguous(shape))
        if not _reads_memory(node):  # a reduction, an indexed read, an integer division that checks
            node = self.materialize(node)  # its divisor: read from memory, so no lane computes garbage
        return self._window_node(node, low, shape, 0)

    def _read_window_at(self, node: GraphNode, coords: list[GraphNode], checked: bool, what: str) -> GraphNode:
        """A Window read at computed coordinates: its source read there, shifted and clamped
        into range (the lanes outside the window take the fill; a checked read's -1 stays)."""
        shape = coords[0].shape
        src, low = node.src[0], node.op.low

        def num(v):
            return self.expand_to(self.const(v, DType.int64), shape)

        def ew(op, *xs, dtype=DType.int64):
            return self.elementwise(op, list(xs), dtype)

        bad = ew("lt", self.elementwise("min", list(_lowest(self, coords)), DType.int64), num(0), dtype=DType.bool) \
            if checked else None
        inside, moved = None, []
        for c, lo, n in zip(coords, low, src.shape):
            c = ew("add", c, num(-lo)) if lo else c
            test = ew("logical_and", ew("ge", c, num(0), dtype=DType.bool), ew("lt", c, num(n), dtype=DType.bool),
                      dtype=DType.bool)
            inside = test if inside is None else ew("logical_and", inside, test, dtype=DType.bool)
            c = ew("min", ew("max", c, num(0)), num(n - 1))
            moved.append(ew("where", bad, num(-1), c) if checked else c)
        value = self.read_at(src, moved, checked, what)
        fill = self.expand_to(self.const(node.op.fill, node.dtype), shape)
        return self.elementwise("where", [inside, value, fill], node.dtype)

    def view_window(self, node: GraphNode, desc: ViewFn) -> Optional[GraphNode]:
        """A movement op applied to a Window: to its source and its offsets, axis by axis
        (None when the op mixes a shifted axis with others: the caller materialises)."""
        kind, *args = desc
        src, low, shape, fill = node.src[0], list(node.op.low), list(node.shape), node.op.fill
        if kind == "permute":
            dims = [d % len(shape) for d in args[0]]
            return self.window(self.view(src, desc), [low[d] for d in dims], [shape[d] for d in dims], fill)
        if kind == "unsqueeze":
            d = args[0] % (len(shape) + 1)
            return self.window(self.view(src, desc), low[:d] + [0] + low[d:], shape[:d] + [1] + shape[d:], fill)
        if kind == "flip":
            dims = {d % len(shape) for d in args[0]}
            low = [shape[d] - src.shape[d] - lo if d in dims else lo for d, lo in enumerate(low)]
            return self.window(self.view(src, desc), low, shape, fill)
        if kind == "slice":
            return self._slice_window(node, *args)
        if kind == "select":
            d, index = args[0] % len(shape), args[1] % max(shape[args[0] % len(shape)], 1)
            return self._select_window(node, d, index)
        if kind == "squeeze":
            dims = range(len(shape)) if args[0] is None else {d % len(shape) for d in args[0]}
            for d in sorted((d for d in dims if shape[d] == 1), reverse=True):
                node = self.view(node, ("select", d, 0))
            return node
        if kind == "expand":
            return self._expand_window(node, tuple(args[0]))
        if kind == "reshape":
            return self._reshape_window(node, tuple(args[0]))
        return None

    def _slice_window(self, node, d, start, stop, step):
        src, low, shape, fill = node.src[0], list(node.op.low), list(node.shape), node.op.fill
        d %= len(shape)
        start, stop, _ = slice(start, stop, step).indices(shape[d])
        shape[d] = len(range(start, stop, step))
        first = (start - low[d]) % step  # the first source index a lane reads
        if shape[d] == 0 or first >= src.shape[d]:
            return self.expand_to(self.const(fill, node.dtype), tuple(shape))
        src = self.view(src, ("slice", d, first, src.shape[d], step))
        low[d] = (low[d] + first - start) // step
        return self.window(src, low, shape, fill)

    def _select_window(self, node, d, index):
        src, low, shape, fill = node.src[0], list(node.op.low), list(node.shape), node.op.fill
        shape.pop(d)
        at = index - low.pop(d)
        if not 0 <= at < src.shape[d]:
            return self.expand_to(self.const(fill, node.dtype), tuple(shape))
        return self.window(self.view(src, ("select", d, at)), low, shape, fill)

    def _expand_window(self, node, target):
        lead = len(target) - len(node.shape)
        for _ in range(lead):
            node = self.view(node, ("unsqueeze", 0))
        for d, (n, t) in enumerate(zip(node.shape, target)):
            if isinstance(node.op, Window) and n == 1 and t not in (1, -1) and \
                    (node.op.low[d], node.src[0].shape[d]) != (0, 1):
                node = self.view(self.view(node, ("select", d, 0)), ("unsqueeze", d))  # the one lane, read once
        if not isinstance(node.op, Window):
            return self.expand_to(node, target)
        src, low = node.src[0], node.op.low
        shape = tuple(n if t == -1 else t for n, t in zip(node.shape, target))
        wide = tuple(s if (lo, s) != (0, n) else t for lo, s, n, t in zip(low, src.shape, node.shape, shape))
        return self.window(self.expand_to(src, wide), low, shape, node.op.fill)

    def _reshape_window(self, node, target):
        """A reshape that keeps each shifted axis whole, or splits one into (k, n, ...) where
        the source is whole rows of the inner sizes at a row boundary (stack's cat then
        view); the other axes regroup freely. None otherwise."""
        target = _infer_reshape(target, node.view.numel)
        for d in reversed(range(len(node.shape))):  # drop size-1 axes
            if node.shape[d] == 1:
                node = self.view(node, ("select", d, 0))
        if not isinstance(node.op, Window):
            return self.view(node, ("reshape", target))
        sizes, low, src = node.shape, node.op.low, node.src[0]
        dense = [n for n in target if n != 1]
        src_sizes, new_low = [], []
        for group_a, group_b in _reshape_groups(sizes, dense):
            outer = [dense[b] for b in group_b]
            shifted = [a for a in group_a if (low[a], src.shape[a]) != (0, sizes[a])]
            if not shifted:
                src_sizes += outer
                new_low += [0] * len(outer)
                continue
            a = group_a[0]
            if len(group_a) != 1:
                return None
            if len(outer) == 1:
                src_sizes.append(src.shape[a])
                new_low.append(low[a])
                continue
            inner = math.prod(outer[1:])
            if src.shape[a] != inner or low[a] % inner:
                return None
            src_sizes += [1] + outer[1:]
            new_low += [low[a] // inner] + [0] * (len(outer) - 1)
        result = self.window(self.view(src, ("reshape", tuple(src_sizes))), new_low, dense, node.op.fill)
        for k, n in enumerate(target):  # put back the size-1 axes
            if n == 1:
                result = self.view(result, ("unsqueeze", k))
        return result

    def _window_node(self, src: GraphNode, low, shape, fill) -> GraphNode:
        """A Window of memory leaf src, cropped first to the part of src some lane reads."""
        low = list(low)
        for d, (lo, n, size) in enumerate(zip(low, src.shape, shape)):
            first, stop = max(lo, 0) - lo, min(lo + n, size) - lo  # of src's indices, the ones read
            if first >= stop:  # no lane reads src: every lane has the fill
                return self.expand_to(self.const(fill, src.dtype), tuple(shape))
            if (first, stop) != (0, n):
                src = self.view(src, ("slice", d, first, stop, 1))
                low[d] = lo + first
        if not any(low) and src.shape == tuple(shape):
            return src
        return self.b.node(Window(tuple(low), _coerce_scalar(fill, src.dtype)), src.dtype, (src,),
                           View.contiguous(tuple(shape)))

    def read_at(self, node: GraphNode, coords: list[GraphNode], checked: bool, what: str) -> GraphNode:
        """node[coords[0], coords[1], ...] (each an int64 value of the result's shape): one
        indexed read of node's memory at the element's storage offset. `checked`: an offset
        out of range (coordinates that were out of range arrive as -1) is reported; without
        it, the coordinates are in range by construction."""
        shape = coords[0].shape
        if node.is_literal:
            return self.expand_to(node.src[0] if node.src else node, shape)  # (a checked read checks elsewhere)
        if isinstance(node.op, Iota) and not checked:
            terms = [self.expand_to(self.const(node.view.offset, DType.int64), shape)]
            terms += [self.elementwise("mul", [c, self.expand_to(self.const(st, DType.int64), shape)], DType.int64)
                      for c, st in zip(coords, node.view.strides) if st]
            total = terms[0]
            for t in terms[1:]:
                total = self.elementwise("add", [total, t], DType.int64)
            return self.cast(total, node.dtype)
        if isinstance(node.op, Elementwise) and not _checked_division(node):
            src = [self.read_at(s, coords, checked, what) for s in node.src]
            found = self.b.node(node.op, node.dtype, tuple(src), View.contiguous(shape))
            if not checked or _checks_an_index(found):
                return found
        if isinstance(node.op, Window):
            return self._read_window_at(node, coords, checked, what)
        if not _reads_memory(node):
            node = self.materialize(node)
        view = node.view
        if not checked and not any(st and size > 1 for size, st in zip(view.shape, view.strides)):
            for d in reversed(range(len(view.shape))):  # every coordinate reads the same element
                node = self.view(node, ("select", d, 0))
            return self.expand_to(node, shape)
        base = node.src[0] if isinstance(node.op, ViewOp) else node
        offset = self.element_offset(coords, view, checked)
        extent = _extent(base.view)
        axis = len(shape) - 1
        if not shape:  # a 0-d result: read as a line of one
            line = self.read_at(node, [self.view(c, ("reshape", (1,))) for c in coords], checked, what)
            return self.view(line, ("reshape", ()))
        table = self.b.node(ViewOp(), node.dtype, (base,),
                            View(tuple(extent if d == axis else 1 for d in range(len(shape))), (0,) * axis + (1,)))
        table = self.expand_to(table, tuple(extent if d == axis else n for d, n in enumerate(shape)))
        return self.b.node(Gather(axis, False, what, checked, flat=view), node.dtype, (table, offset), View.contiguous(shape))


    def element_offset(self, coords: list[GraphNode], view: View, checked: bool) -> GraphNode:
        """The storage offset `view` maps coordinates `coords` (int64 values of one shape) to;
        -1 where `checked` and a coordinate is -1 (was out of range)."""
        shape = coords[0].shape
        offset = None
        for c, size, st in zip(coords, view.shape, view.strides):
            if st and size > 1:
                step = c if st == 1 else \
                    self.elementwise("mul", [c, self.expand_to(self.const(st, DType.int64), shape)], DType.int64)
                offset = step if offset is None else self.elementwise("add", [offset, step], DType.int64)
        if offset is None or view.offset:
            start = self.expand_to(self.const(view.offset, DType.int64), shape)
            offset = start if offset is None else self.elementwise("add", [offset, start], DType.int64)
        if checked:  # a coordinate out of range arrives as -1: keep it out of range
            bad = self.elementwise("lt", [self.elementwise("min", list(_lowest(self, coords)), DType.int64),
                                          self.expand_to(self.const(0, DType.int64), shape)], DType.bool)
            offset = self.elementwise("where", [bad, self.expand_to(self.const(-1, DType.int64), shape), offset],
                                      DType.int64)
        return offset


def _reshape_groups(old, new):
    """Pairs (old axes, new axes) of consecutive axes with equal products (no size-1 axes)."""
    groups, i, j = [], 0, 0
    while i < len(old):
        a, b, pa, pb = [i], [j], old[i], new[j]
        while pa != pb:
            if pa < pb:
                i += 1
                a.append(i)
                pa *= old[i]
            else:
                j += 1
                b.append(j)
                pb *= new[j]
        groups.append((a, b))
        i, j = i + 1, j + 1
    return groups


def _keeps_elements(dense: View, view: Optional[View]) -> bool:
    """`view` of a dense value only inserts, removes or broadcasts axes: every element keeps
    its place among the others."""
    def placed(v):
        return [(n, s) for n, s in zip(v.shape, v.strides) if n != 1 and s != 0]
    return view is not None and view.offset == 0 and placed(view) == placed(dense)


def _coerce_scalar(value, dtype: DType):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if dtype is DType.bool:
        return bool(value)
    if dtype.is_int:
        return int(value)
    return float(value)


INT32_MAX = 2**31 - 1
MEMORY = (Input, Contiguous, Extern)


def _reads_memory(node: GraphNode) -> bool:
    """An input, buffer or call result, or a view of one: a leaf a kernel loads."""
    base = node.src[0] if isinstance(node.op, ViewOp) else node
    return isinstance(base.op, MEMORY)


def _checked_division(node: GraphNode) -> bool:
    """An integer division whose divisor the kernel checks for zero (codegen's rule): a
    shifted read must not compute it on lanes that read no element."""
    if not (isinstance(node.op, Elementwise) and op_def(node.op.op).divides):
        return False
    if node.dtype.is_float or node.dtype is DType.bool:
        return False
    divisor = node.src[1]
    if isinstance(divisor.op, ViewOp) and isinstance(divisor.src[0].op, Const):
        divisor = divisor.src[0]
    return not isinstance(divisor.op, Const) or divisor.op.value == 0


def _extent(view: View) -> int:
    """Elements of the buffer a memory node's view spans (its strides are not negative)."""
    if view.numel == 0:
        return 1
    return view.offset + sum((n - 1) * abs(st) for n, st in zip(view.shape, view.strides)) + 1


def _lowest(vb: ValueBuilder, coords: list[GraphNode]):
    """The coordinates pairwise reduced with min, as two operands (repeats the last)."""
    low = coords[0]
    for c in coords[1:-1]:
        low = vb.elementwise("min", [low, c], DType.int64)
    return low, coords[-1]


def known_in_range(index: GraphNode, size: int) -> bool:
    """The index is computed from coordinates and literals, within [0, size)."""
    from .ranges import value_range
    found = value_range(index)
    return found is not None and found[0] >= 0 and found[1] < size


def in_range_or_minus_one(vb: ValueBuilder, index: GraphNode, size: int, wrap: bool = True) -> GraphNode:
    """index (int64), wrapped when negative (as eager's indexing does); -1 where it is out of
    range, or as it is when it is known to be in range."""
    if known_in_range(index, size):
        return index
    shape = index.shape

    def num(v):
        return vb.expand_to(vb.const(v, DType.int64), shape)

    if wrap:
        index = wrapped(vb, index, size)
    ok = vb.elementwise("logical_and", [vb.elementwise("ge", [index, num(0)], DType.bool),
                                        vb.elementwise("lt", [index, num(size)], DType.bool)], DType.bool)
    return vb.elementwise("where", [ok, index, num(-1)], DType.int64)


def wrapped(vb: ValueBuilder, index: GraphNode, size: int) -> GraphNode:
    """index (int64) with size added where it is negative, as eager's indexing wraps it."""
    def num(v):
        return vb.expand_to(vb.const(v, DType.int64), index.shape)
    negative = vb.elementwise("lt", [index, num(0)], DType.bool)
    return vb.elementwise("where", [negative, vb.elementwise("add", [index, num(size)], DType.int64), index],
                          DType.int64)


def _checks_an_index(value: GraphNode) -> bool:
    """Some indexed read in value's expression checks its index."""
    stop = lambda n: n.is_leaf or isinstance(n.op, (Contiguous, Gather))  # noqa: E731
    return any(isinstance(n.op, Gather) and n.op.checked for n in toposort([value], stop=stop))


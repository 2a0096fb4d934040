"""Arithmetic on IR values for writing gradient rules: operands broadcast (Python numbers
become constants of the other operand's type), results are dense nodes built through the
frontend's ValueBuilder, so views and indexed reads are pushed to the leaves exactly as in a
forward graph and the backward fuses the same way."""
from __future__ import annotations

import math
from typing import Callable, Union

import torch

from ..analysis.addresses import extent as address_extent
from ..frontend.build import ValueBuilder
from ..ir import DType, GraphNode, View

Value = Union[GraphNode, int, float, bool]


def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    first = tuple(shapes[0])
    if all(tuple(s) == first for s in shapes[1:]):  # (most calls: torch.broadcast_shapes costs 40 us each)
        return first
    return tuple(torch.broadcast_shapes(*shapes))


class Algebra:
    """Elementwise math, reductions, scans and views over one ValueBuilder."""

    def __init__(self, vb: ValueBuilder):
        self.vb = vb
        self.constants: dict[str, torch.Tensor] = {}  # index tables the rules read (see positions)
        # A partial view's gradient by id: (that gradient, the piece it places into the source's
        # shape with zeros elsewhere, how to place another piece the same way); see
        # accumulate.total_gradient, which may place a stored copy of the piece instead.
        self.placements: dict[int, tuple[GraphNode, GraphNode, Callable[[GraphNode], GraphNode]]] = {}

    # -- elementwise ---------------------------------------------------------------------
    def ew(self, op: str, *operands: Value, dtype: DType = None) -> GraphNode:
        """`op` over the operands broadcast together, computed in the first node's type;
        the result is `dtype` (comparisons: bool) or that type."""
        nodes = [o for o in operands if isinstance(o, GraphNode)]
        work = next((n.dtype for n in nodes if n.dtype.is_float), nodes[0].dtype)
        if op == "where":
            work = next(n.dtype for n in operands[1:] if isinstance(n, GraphNode))
        shape = broadcast_shape(*(n.shape for n in nodes))
        typed = []
        for k, o in enumerate(operands):
            want = DType.bool if op == "where" and k == 0 else work
            node = self.vb.const(o, want) if not isinstance(o, GraphNode) else self.vb.cast(o, want)
            typed.append(self.vb.expand_to(node, shape))
        return self.vb.elementwise(op, typed, dtype or work)

    def add(self, a, b): return self.ew("add", a, b)
    def mul(self, a, b): return self.ew("mul", a, b)
    def div(self, a, b): return self.ew("truediv", a, b)
    def neg(self, a): return self.ew("neg", a)
    def sub(self, a, b): return self.add(a, self.neg(b) if isinstance(b, GraphNode) else -b)
    def square(self, a): return self.mul(a, a)
    def where(self, cond, a, b): return self.ew("where", cond, a, b)

    def test(self, op: str, a, b=None) -> GraphNode:
        return self.ew(op, a, dtype=DType.bool) if b is None else self.ew(op, a, b, dtype=DType.bool)

    def both(self, a, b): return self.ew("logical_and", a, b, dtype=DType.bool)

    def cast(self, node: GraphNode, dtype: DType) -> GraphNode:
        return self.vb.cast(node, dtype)

    def placed(self, piece: GraphNode, place: Callable[[GraphNode], GraphNode]) -> GraphNode:
        """place(piece), remembered as a placement of piece (see placements)."""
        value = place(piece)
        self.placements[id(value)] = (value, piece, place)
        return value

    def zeros(self, shape, dtype: DType) -> GraphNode:
        return self.vb.expand_to(self.vb.const(0, dtype), tuple(shape))

    # -- reductions, scans and views ---------------------------------------------------------
    def sum(self, node: GraphNode, axes) -> GraphNode:
        return self.vb.reduce("add", node, tuple(axes))

    def expand(self, node: GraphNode, shape) -> GraphNode:
        return self.vb.expand_to(node, tuple(shape))

    def view(self, node: GraphNode, *desc) -> GraphNode:
        return self.vb.view(node, tuple(desc))

    def reverse_scan(self, op: str, node: GraphNode, axis: int) -> GraphNode:
        """The running `op` from the end of `axis` backwards (reverse cumsum and the like)."""
        flipped = self.view(node, "flip", (axis,))
        return self.view(self.vb.scan(op, flipped, axis), "flip", (axis,))

    def positions(self, view: View) -> GraphNode:
        """The storage offset each element of `view` reads, as int64: an index table (an
        arange over the view's extent) read through the view itself."""
        extent = 1 + address_extent(view)[1] if view.numel else 1  # (its highest: a flip reads below its offset)
        name = f"_arange{extent}"
        self.constants.setdefault(name, torch.arange(extent, dtype=torch.int64))
        return self.vb.b.input(name, DType.int64, view)

    def coordinate(self, shape, axis: int) -> GraphNode:
        """Each element's index along `axis` of `shape` (int64)."""
        strides = tuple(1 if d == axis else 0 for d in range(len(shape)))
        return self.positions(View(tuple(shape), strides))


LN2 = math.log(2.0)
TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

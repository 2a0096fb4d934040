"""A value's gradient: the sum of the contributions of its uses.

A weight used at every step of an unrolled loop (a recurrent cell's) gets one matmul
contribution per step. Summed by a kernel, all of them are alive until the last one is
computed: memory that grows with the number of steps. Eager's autograd adds each one into
the gradient as it arrives. Here each matmul contribution is accumulated by the library
call itself, `addmm(total, a, b)`, as soon as its operands exist: two partial totals alive
at a time, and no kernel for the sum.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..frontend.library import in_memory
from ..ir import DType, Elementwise, Extern, ExternCall, GraphNode, Operand, View, ViewOp
from .algebra import Algebra
from .complex import complex_sum

aten = torch.ops.aten

PLACED_PIECE_LOADS = 4  # see _pieces_from_buffers (a SwiGLU's halves read 3)


def total_gradient(alg: Algebra, contributions: list[GraphNode], dtype: DType,
                   depths: dict[int, int]) -> Optional[GraphNode]:
    """The sum of a value's gradient contributions (None if there are none). Rounded ones
    (casts from one wider type) are summed before rounding, once; matmuls are accumulated
    by addmm calls after the others are summed, the first computable first (by `depth`;
    depths memoises it across calls)."""
    if not contributions:
        return None
    if dtype.is_complex:  # no kernel adds complex values: a library call does
        return complex_sum(alg.vb, contributions)
    wider = {c.src[0].dtype for c in contributions if isinstance(c.op, Elementwise) and c.op.op == "cast"}
    if len(contributions) > 1 and len(wider) == 1 and all(isinstance(c.op, Elementwise) and c.op.op == "cast"
                                                          for c in contributions):
        contributions = [c.src[0] for c in contributions]
    products = [matmul_operands(alg.vb, c) for c in contributions]
    matmuls = sorted((k for k, ab in enumerate(products) if ab is not None), key=lambda k: depth(contributions[k], depths))
    accumulated = matmuls[1:]  # (by position: one node may be a contribution twice)
    if accumulated and isinstance(contributions[matmuls[0]].op, ViewOp):
        # the first matmul in the total's layout (not transposed from mm's): the addmm calls
        # then accumulate into its memory (tjit.memory.liveness.accumulated_in_place)
        contributions = list(contributions)
        contributions[matmuls[0]] = _mm(alg.vb, *products[matmuls[0]])
    added = _pieces_from_buffers(alg, [c for k, c in enumerate(contributions) if k not in accumulated])
    total = added[0]
    for c in added[1:]:
        total = alg.add(total, c)
    for k in accumulated:
        total = _addmm(alg.vb, total, *products[k])
    return alg.cast(total, dtype)


def _pieces_from_buffers(alg: Algebra, contributions: list[GraphNode]) -> list[GraphNode]:
    """Contributions that place pieces into a wider tensor (a GRU's three gate gradients into
    the gates' [b, 3d], an unrolled loop's x[:, t] slices into x's) are computed, summed, in
    the wider tensor's kernel, each piece's expression shifted to its place: a value no later
    kernel can read back. A recurrence's gradient would then be computed again by every later
    step, from every step before it. So a piece that reads more than PLACED_PIECE_LOADS
    leaves is written to a buffer of its own (by the kernel of its shape that computes it) and
    placed from there."""
    if len(contributions) < 2:
        return contributions
    stored = []
    for c in contributions:
        _, piece, place = alg.placements.get(id(c), (None, None, None))  # (which keeps c alive: ids are c's)
        if piece is not None and alg.vb.loads(piece, up_to=PLACED_PIECE_LOADS + 1) > PLACED_PIECE_LOADS:
            c = place(alg.vb.materialize(piece))
        stored.append(c)
    return stored


def matmul_operands(vb, node: GraphNode) -> Optional[tuple[GraphNode, GraphNode]]:
    """(a, b) with node = a @ b when node is a 2-d mm call's result, or its transpose
    (b.T @ a.T: torch's matmul backward returns a weight's gradient transposed to the
    weight's layout), of a floating dtype."""
    transposed = isinstance(node.op, ViewOp) and len(node.shape) == 2 and \
        node.view == View((node.shape[0], node.shape[1]), (1, node.shape[0]))
    call_result = node.src[0] if transposed else node
    if not (isinstance(call_result.op, Extern) and call_result.op.index == 0 and node.dtype.is_float):
        return None
    call = call_result.op.call
    if call.target is not aten.mm.default or call.args != (Operand(0), Operand(1)) or call.kwargs \
            or call_result.view != View.contiguous(call_result.shape):
        return None
    a, b = call_result.src
    if transposed:
        return vb.view(b, ("permute", (1, 0))), vb.view(a, ("permute", (1, 0)))
    return a, b


def depth(node: GraphNode, depths: dict[int, int]) -> int:
    """The longest path from the graph's leaves to the node: how late it can be computed."""
    stack = [node]
    while stack:
        n = stack[-1]
        pending = [s for s in n.src if id(s) not in depths]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        depths[id(n)] = 1 + max((depths[id(s)] for s in n.src), default=0)
    return depths[id(node)]


def _mm(vb, a: GraphNode, b: GraphNode) -> GraphNode:
    """a @ b, by one library call."""
    call = ExternCall(aten.mm.default, (Operand(0), Operand(1)), {})
    call.results[0] = vb.b.node(Extern(call, 0), a.dtype, (a, b), View.contiguous((a.shape[0], b.shape[1])))
    return call.results[0]


def _addmm(vb, total: GraphNode, a: GraphNode, b: GraphNode) -> GraphNode:
    """total + a @ b, by one library call."""
    call = ExternCall(aten.addmm.default, (Operand(0), Operand(1), Operand(2)), {})
    operands = (in_memory(vb, total), a, b)
    call.results[0] = vb.b.node(Extern(call, 0), total.dtype, operands, View.contiguous(total.shape))
    return call.results[0]

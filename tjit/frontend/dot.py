"""Building IR Dots: a matrix product, its operands (memory, or prologues: elementwise work
its kernel computes on the tiles it loads), and the movement ops pushed into them.

A Dot's a is [.., m, k] and its b [.., k, n] with the same batch axes, or [k, n]: one
matrix shared by every batch index (linear's weight under a [b, t, d] input), which the
kernel reads at stride 0 along the batch and whose gradient is then one product over all
rows, not one per batch index summed after."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..ir import (Contiguous, DType, Dot, Elementwise, Extern, ExternCall, GraphNode, Iota, Operand, Reduce,
                  View, ViewOp, copies_its_source, toposort)
from ..ir.ops import op_def
from .library import in_memory

aten = torch.ops.aten


def tileable(shape: tuple) -> bool:
    """A product tl.dot's tiles fit: rows and columns (a side of 1 is a matrix-vector
    product, whose axis the kernel's schedule would drop)."""
    return len(shape) >= 2 and shape[-2] != 1 and shape[-1] != 1


def dot(vb, a: GraphNode, b: GraphNode, nests: bool = True, recomputed: bool = False,
        nests_recomputed_only: bool = False, accumulates: bool = False) -> GraphNode:
    """a @ b over the last two axes, batched over the others (broadcast to one batch shape),
    as an IR Dot: float32, its operands read from memory or computed on their tiles (a's
    computing products too where `nests` and b's columns are few: `nests_products`, or any
    number of them with `accumulates`, the product then written to memory of its own by a
    kernel that accumulates it there: `accumulates_in_memory`; only products the backward
    recomputes, with `nests_recomputed_only`: a differentiated product's, whose operand's
    other products the forward writes for the backward anyway); `recomputed`: see Dot."""
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    a = _operand(vb, a, nests and (accumulates or nests_products(b.shape[-1])), nests_recomputed_only)
    a = vb.expand_to(a, batch + a.shape[-2:])
    b = _operand(vb, b, nests=False)
    if all(n == 1 or st == 0 for n, st in zip(b.shape[:-2], b.view.strides[:-2])):
        while len(b.shape) > 2:  # the same matrix for every batch index
            b = vb.view(b, ("select", 0, 0))
    else:
        b = vb.expand_to(b, batch + b.shape[-2:])
    shape = batch + (a.shape[-2], b.shape[-1])
    assert a.shape[-1] == b.shape[-2] and tileable(shape), (a.shape, b.shape)
    product = vb.b.node(Dot(recomputed), DType.float32, (a, b), View.contiguous(shape))
    # (what reads it reads its memory: its kernel computes it alone)
    return vb.materialize(product) if accumulates_in_memory(product) else product


PROLOGUE_LOADS = 6  # the most memory reads an operand computed on its tiles makes
NESTED_PRODUCTS = 2  # the most products an operand computes on its tiles (attention's backward: scores and dP)
# the most columns a product whose a computes products on its tiles may have: its kernel holds
# them in one tile, so each nested product is computed once per row tile (attention's head
# dimension); with more, a nested product would be computed again for every column tile
# (relu(x @ w1) @ w2 over 4096 columns: 64 times)
NESTED_COLUMNS = 128


def nests_products(columns: int) -> bool:
    """Whether a product of `columns` columns may compute products in its a's prologue."""
    return columns <= NESTED_COLUMNS


def accumulates_in_memory(product: GraphNode) -> bool:
    """Whether a product's kernel accumulates it in the memory it writes, a chunk of columns
    at a time (lower/codegen.py): its a computes products on its tiles and its columns are
    more than one tile holds (NESTED_COLUMNS). Its kernel then computes the nested products
    once per row tile and step of k, as with few columns, rather than once per column tile:
    the gradients of linear + cross-entropy over an LM head's hidden size (768-4096), which
    never write the logits (Cut Cross-Entropy's form, without its atomics: each program
    owns its rows). The cost is the accumulator's trips through memory, [rows, n] float32
    read and written once per step of k."""
    return isinstance(product.op, Dot) and not nests_products(product.shape[-1]) and \
        any(isinstance(n.op, Dot) for n in toposort([product.src[0]], stop=_prologue_leaf)[:-1])


def _operand(vb, x: GraphNode, nests: bool, recomputed_only: bool = False) -> GraphNode:
    """x as a product reads it: memory, or an elementwise expression of a few reads of memory,
    literals and row values of reductions (a cast, a scale, a norm's normalisation from its
    row statistics: a prologue), which the product's kernel computes on each tile it loads
    (the statistics come from a buffer their reduction's kernel writes); in a's prologue,
    also of products whose rows are a's rows and whose columns are a's k (attention's
    probabilities computed from the scores q @ k.T tile by tile: `nests`)."""
    computed = lambda y: is_prologue(y, nests) and (not recomputed_only or recomputed_by_backward(y))  # noqa: E731
    transposed = _products_transposed(vb, x) if nests else None
    if transposed is not None and computed(transposed):
        return transposed
    # (a generated product's operand is written as the product reads it: written in its own
    # shape instead, phi's MLP kernel nested six products and spilled registers at sm_90)
    return x if computed(x) else in_memory(vb, x, own_shape=False)


def _products_transposed(vb, x: GraphNode) -> Optional[GraphNode]:
    """x's expression with each read of a product's result through a transposed view (the
    view could not be pushed into the product, so its expression was written to memory)
    replaced by that expression computed transposed, its products as b.T @ a.T, which x's
    product can then compute on its tiles: the gradient of a linear's weight under
    cross-entropy, softmax(h @ w.T).T @ h, never writes the logits. None where x reads no
    such view."""
    if not isinstance(x.op, Elementwise):
        return None
    nodes = toposort([x], stop=_prologue_leaf)
    reads = {id(n) for n in nodes if _prologue_leaf(n) and _transposed_product_read(n)}
    if not reads:  # (every product's operand passes here: nothing is rebuilt for most)
        return None
    new: dict[int, GraphNode] = {}
    for n in nodes:
        if id(n) in reads:
            rank = len(n.shape)
            new[id(n)] = vb.view_transposing_products(n.src[0].src[0], ("permute", (*range(rank - 2), rank - 1, rank - 2)))
        elif _prologue_leaf(n):
            new[id(n)] = n
        else:
            new[id(n)] = vb.b.node(n.op, n.dtype, tuple(new[id(s)] for s in n.src), n.view)
    return new[id(x)]


def _transposed_product_read(n: GraphNode) -> bool:
    """n reads a written expression that computes a product, through a view that swaps its
    last two axes."""
    if not (isinstance(n.op, ViewOp) and copies_its_source(n.src[0]) and len(n.shape) >= 2):
        return False
    written = n.src[0]
    rank = len(n.shape)
    if len(written.shape) != rank:
        return False
    swapped = View.contiguous(written.shape).permute((*range(rank - 2), rank - 1, rank - 2))
    return n.view == swapped and any(isinstance(m.op, Dot) for m in toposort([written.src[0]], stop=_prologue_leaf))


def is_prologue(x: GraphNode, nests: bool = False) -> bool:
    """An elementwise expression whose leaves are memory (read in tiles), literals,
    coordinates (a causal mask's) or a reduction's row values, and where `nests`, products of x's shape whose own operands are
    memory or prologues (computed on each of x's tiles: a nested k loop)."""
    if not isinstance(x.op, Elementwise):
        return False
    nodes = toposort([x], stop=_prologue_leaf)
    products = [n for n in nodes if isinstance(n.op, Dot)]
    if products and not (nests and len(products) <= NESTED_PRODUCTS and all(_nestable(p, x.shape) for p in products)):
        return False
    leaves = [n for n in nodes if _prologue_leaf(n) and not isinstance(n.op, Dot)]
    inner = [n for n in nodes if not _prologue_leaf(n)]
    return all(isinstance(n.op, Elementwise) and not op_def(n.op.op).divides and not op_def(n.op.op).checks_index
               for n in inner) and \
        sum(not (n.is_literal or isinstance(n.op, Iota)) for n in leaves) <= PROLOGUE_LOADS and \
        all(_rows_computed_on_tiles(n) for n in leaves if isinstance(n.op, ViewOp))


def _rows_computed_on_tiles(row_values: GraphNode) -> bool:
    """Whether the kernel can compute a reduction's row values (softmax's max and sum) from
    the tiles of memory it loads: elementwise work and reductions over memory, not a gather
    (LeViT's attention biases, `table[:, idx]`) or another op whose table is read at
    addresses of its own."""
    nodes = toposort([row_values], stop=lambda n: n.is_leaf or isinstance(n.op, (Contiguous, Dot)))
    return all(n.is_leaf or isinstance(n.op, (Elementwise, Reduce, ViewOp, Contiguous, Dot)) for n in nodes)


def _nestable(product: GraphNode, shape: tuple) -> bool:
    """A product an operand of `shape` computes on its tiles: of that shape (its rows the
    outer product's rows, its columns the outer k), its operands memory or prologues that
    compute no product themselves."""
    return product.shape == shape and all(not isinstance(s.op, Elementwise) or is_prologue(s) for s in product.src)


def recomputed_by_backward(x: GraphNode) -> bool:
    """Whether every product x's expression computes is one the backward computes again
    (Dot.recomputed): a differentiated product may then compute them on its tiles too
    (attention's probabilities from its scores), as the forward need not write them."""
    return all(n.op.recomputed for n in toposort([x], stop=_prologue_leaf) if isinstance(n.op, Dot))


def _prologue_leaf(n: GraphNode) -> bool:
    return n.is_leaf or isinstance(n.op, (Contiguous, Dot)) or isinstance(n.op, ViewOp) and isinstance(n.src[0].op, Reduce)


def larger_than_operands(a_shape: tuple, b_shape: tuple) -> bool:
    """Whether a @ b has more elements than a and b together (cross-entropy's logits over a
    vocabulary, attention's scores over more keys than twice the head width): recomputing
    it from them in the backward then reads less than saving it would write."""
    rows, k, columns = math.prod(a_shape[:-1]), a_shape[-1], b_shape[-1]
    return rows * columns > rows * k + math.prod(b_shape)


def view_of_dot(vb, node: GraphNode, desc: tuple) -> Optional[GraphNode]:
    """The movement op `desc` applied to a Dot's operands, as another Dot (None where it has
    no such form, or the result would not be tileable: the caller materialises the
    product). A view of the batch axes applies to both operands; slicing rows slices a,
    columns b (an RNN cell's gates: each its own product, all in the cell's kernel, which an
    eval forward measured at 20 kernels for the zoo's GRU against 36 with the projection
    written once and sliced); a reshape that keeps the columns splits or merges a's rows
    where b is shared (linear's [b*t, n] read as [b, t, n])."""
    new = getattr(node.view, desc[0])(*desc[1:])
    if new is None or not tileable(new.shape):
        return None
    a, b = node.src
    recomputed = node.op.recomputed
    rank, shared = len(node.shape), len(b.shape) == 2 < len(node.shape)
    kind, *args = desc
    if kind == "permute":
        dims = tuple(d % rank for d in args[0])
        batch = dims[:-2]
        if any(d >= rank - 2 for d in batch):
            return None
        if dims[-2:] != (rank - 2, rank - 1):
            # a transposed product (b.T @ a.T) is built only for an operand that computes it on
            # its tiles (_operand): elsewhere, where the product is also read as it is (a
            # residual stream read by a norm, and transposed by token mixing), it would be
            # computed twice, where its memory read through a transposed view is free
            if not vb.transposing_products or dims[-2:] != (rank - 1, rank - 2):
                return None
            b_transposed = vb.view(b, ("permute", (1, 0))) if len(b.shape) == 2 else vb.view(b, desc)
            return dot(vb, b_transposed, vb.view(a, desc), recomputed=recomputed)
        return dot(vb, vb.view(a, desc), b if shared else vb.view(b, desc), recomputed=recomputed)
    if kind in ("slice", "select"):
        d = args[0] % rank
        if kind == "select" and d >= rank - 2:  # a row or column, keeping the operands matrices
            index = args[1] % node.shape[d]
            kept = view_of_dot(vb, node, ("slice", d, index, index + 1, 1))
            return None if kept is None else vb.view(kept, ("squeeze", (d,)))
        if d < rank - 2:
            return dot(vb, vb.view(a, desc), b if shared else vb.view(b, desc), recomputed=recomputed)
        if d == rank - 2:
            return dot(vb, vb.view(a, desc), b, recomputed=recomputed)
        return dot(vb, a, vb.view(b, (kind, len(b.shape) - 1, *args[1:])), recomputed=recomputed)
    if kind in ("reshape", "unsqueeze", "squeeze"):
        return _reshaped(vb, a, b, node.shape, new.shape, shared, recomputed)
    return None


def _reshaped(vb, a: GraphNode, b: GraphNode, shape: tuple, new: tuple, shared: bool,
              recomputed: bool) -> Optional[GraphNode]:
    """The product of `shape` reshaped to `new`: its batch axes alone (both operands'), or
    its rows split or merged with the columns kept, where b is one matrix for every row."""
    if new[-2:] == shape[-2:]:  # the batch axes only
        return dot(vb, vb.view(a, ("reshape", new[:-2] + a.shape[-2:])),
                   b if shared or len(b.shape) == 2 else vb.view(b, ("reshape", new[:-2] + b.shape[-2:])), recomputed=recomputed)
    if new[-1] != shape[-1] or not (shared or len(b.shape) == 2):
        return None
    return dot(vb, vb.view(a, ("reshape", new[:-1] + a.shape[-1:])), b, recomputed=recomputed)


def library_product(vb, x: GraphNode, y: GraphNode) -> GraphNode:
    """x @ y ([.., m, k] @ [.., k, n] or [k, n]) by one library call, in x's type: mm, with
    a shared y over all of x's rows at once, else bmm over the flattened batch axes."""
    batch, (m, k), n = x.shape[:-2], x.shape[-2:], y.shape[-1]
    if len(y.shape) == 2:
        rows = vb.view(x, ("reshape", (math.prod(batch) * m, k))) if batch else x
        return vb.view(_call(vb, aten.mm.default, rows, y), ("reshape", batch + (m, n)))
    flat = (math.prod(batch),)
    product = _call(vb, aten.bmm.default, vb.view(x, ("reshape", flat + (m, k))),
                    vb.view(vb.expand_to(y, batch + (k, n)), ("reshape", flat + (k, n))))
    return vb.view(product, ("reshape", batch + (m, n)))


def _call(vb, target, x: GraphNode, y: GraphNode) -> GraphNode:
    call = ExternCall(target, (Operand(0), Operand(1)), {})
    shape = x.shape[:-1] + y.shape[-1:]
    call.results[0] = vb.b.node(Extern(call, 0), x.dtype, (in_memory(vb, x), in_memory(vb, y)), View.contiguous(shape))
    return call.results[0]

"""Which reductions a kernel keeps in registers, and the iteration domain of each store.

A kernel iterates over a Domain: a full shape D and the axes R it reduces or scans
(none for a pointwise kernel). Its values live in one of three spaces: full (shape D), row (D with R
as size-1 axes: a Reduce node's own keepdim shape) and squeezed (D without R: torch's
shape for a reduction without keepdim). A Reduce node stays in registers when every use
of it is in its own domain: directly in row space, or through a view that is exactly its
broadcast back over D or its squeeze. Anything else (a transposed read of a reduction's
result, two reductions of different domains in one expression) materialises the reduction
into a buffer that a later kernel loads.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..ir import (Const, Contiguous, Cumulative, Dot, Elementwise, Extern, Gather, GraphBuilder, GraphNode, Input, Iota, Reduce,
                  View, ViewOp, per_node, toposort)


@dataclass(frozen=True)
class Domain:
    shape: tuple[int, ...]
    axes: tuple[int, ...] = ()  # the reduced axes
    # a domain whose kernel computes matrix products (Dot nodes of its shape): the last two
    # axes are tiled for tl.dot (a reduction's reduced last axis walked in column tiles), and
    # it shares a kernel with no other domain's stores
    dot: bool = False

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(1 if d in self.axes else s for d, s in enumerate(self.shape))

    @property
    def squeezed_shape(self) -> tuple[int, ...]:
        return tuple(s for d, s in enumerate(self.shape) if d not in self.axes)

    def space_of(self, shape: tuple[int, ...]) -> Optional[str]:
        """"full", "row" or "squeezed" for a value of this shape, None if it has none here."""
        if shape == self.shape:
            return "full"
        if shape == self.row_shape:
            return "row"
        if shape == self.squeezed_shape:
            return "squeezed"
        return None

    def to_domain(self, view: View) -> View:
        """A view over a value's own shape, re-expressed over D (row values get stride 0
        along R: they do not vary along the reduced axes)."""
        space = self.space_of(view.shape)
        strides = list(view.strides)
        if space == "squeezed":
            for axis in self.axes:
                strides.insert(axis, 0)
        elif space == "row":
            for axis in self.axes:
                strides[axis] = 0
        elif space is None:
            raise AssertionError(f"shape {list(view.shape)} is not in domain {self}")
        return View(self.shape, tuple(strides), view.offset)


def domain_of_reduce(node: GraphNode) -> Domain:
    """A reduction's domain is its input's shape and its axes; a scan's, its shape and axis."""
    if isinstance(node.op, Cumulative):
        return Domain(node.shape, (node.op.axis,))
    return Domain(node.src[0].shape, node.op.axes)


def normal(view: View) -> View:
    """Strides of size-1 axes never matter: zero them so equal layouts compare equal."""
    return View(view.shape, tuple(0 if s == 1 else st for s, st in zip(view.shape, view.strides)), view.offset)


def reference_space(ref: GraphNode) -> Optional[str]:
    """How a ViewOp of a Reduce node reads it: "full" (its broadcast over the reduce's
    input), "squeezed", or None for any other view (which needs the value in memory)."""
    reduce_node = ref.src[0]
    domain = domain_of_reduce(reduce_node)
    dense = reduce_node.view.strides
    if normal(ref.view) == normal(View(domain.shape, tuple(0 if d in domain.axes else st
                                                            for d, st in enumerate(dense)))):
        return "full"
    squeezed = tuple(st for d, st in enumerate(dense) if d not in domain.axes)
    if normal(ref.view) == normal(View(domain.squeezed_shape, squeezed)):
        return "squeezed"
    return None


def is_reduce_ref(node: GraphNode) -> bool:
    return isinstance(node.op, ViewOp) and isinstance(node.src[0].op, Reduce)


def is_value_ref(node: GraphNode) -> bool:
    """A view of a value the kernel computes (a reduction or a gather), not of memory."""
    return isinstance(node.op, ViewOp) and isinstance(node.src[0].op, (Reduce, Gather))


def _is_row_alias(ref: GraphNode, domain: Domain) -> bool:
    """A gathered row value squeezed, unsqueezed or broadcast over the reduced axes: the same
    registers in every space (the frontend only makes such views of a Gather)."""
    spaces = (domain.space_of(ref.src[0].shape), domain.space_of(ref.shape))
    if not (domain.axes and spaces[0] in ("row", "squeezed") and spaces[1] in ("row", "squeezed", "full")):
        return False
    # each element where the row value has it over D (shapes can match by chance: a gathered
    # line viewed along the reduced axis is no row value)
    return normal(domain.to_domain(ref.view)) == normal(domain.to_domain(ref.src[0].view))


def is_kernel_input(node: GraphNode) -> bool:
    """What a fused expression reads from memory or takes as a literal: leaves and
    materialised buffers (Contiguous nodes are written by an earlier kernel)."""
    return node.is_leaf or isinstance(node.op, Contiguous)


@per_node
def kernel_expression(value: GraphNode) -> list[GraphNode]:
    """What a store of `value` computes and reads, producers first: toposort down to the
    kernel inputs, which are listed. One walk per node, shared by lowering's questions about
    an expression (its reductions, leaves, gathers, ...): a deep model's stores have
    expressions of thousands of nodes before placement cuts them, each walked again for
    every question."""
    return toposort([value], stop=is_kernel_input)


def kernel_expressions(values) -> list[GraphNode]:
    """kernel_expression of several values, each node once: toposort(values, stop=is_kernel_input)."""
    seen, order = set(), []
    for value in values:
        for node in kernel_expression(value):
            if id(node) not in seen:
                seen.add(id(node))
                order.append(node)
    return order


@per_node
def reduces_in(value: GraphNode) -> list[GraphNode]:
    """Reductions and scans a store's fused expression computes, nearest the store first."""
    nodes = kernel_expression(value)
    return [n for n in reversed(nodes) if isinstance(n.op, (Reduce, Cumulative))]


@per_node
def dots_in(value: GraphNode) -> list[GraphNode]:
    """The matrix products a store's fused expression computes (a product that an operand
    computes on its tiles is part of that product's work: not listed)."""
    if not any(isinstance(n.op, Dot) for n in kernel_expression(value)):  # (the walk below sees fewer)
        return []
    return [n for n in toposort([value], stop=at_product) if isinstance(n.op, Dot)]


def at_product(node: GraphNode) -> bool:
    """Where a walk of what a kernel computes at its own index stops: its leaves, and its
    products, whose operands it computes on the products' tiles instead."""
    return is_kernel_input(node) or isinstance(node.op, Dot)


def reduces_in_epilogue(value: GraphNode) -> list[GraphNode]:
    """The reductions a store's expression computes outside its products' operands."""
    return [n for n in toposort([value], stop=at_product) if isinstance(n.op, (Reduce, Cumulative))]


def operand_leaves(operand: GraphNode) -> list[GraphNode]:
    """What a product's operand reads: itself (memory), or the leaves of the expression its
    kernel computes on each tile (a prologue)."""
    return [n for n in kernel_expression(operand) if is_kernel_input(n)]


def leaf_view(leaf: GraphNode) -> View:
    """How a kernel reads a leaf's memory: through its view (an input, a view, a call's
    result) or densely (a buffer)."""
    return leaf.view if isinstance(leaf.op, (ViewOp, Input, Extern)) else View.contiguous(leaf.shape)


def product_key(node: GraphNode) -> Optional[tuple]:
    """What a Dot computes, in its elements' row-major order: the memory its operands read,
    a's rows flattened over the batch and b's columns over the batch (b's columns alone where
    one b serves every row), k; None for operands computed on their tiles. Two Dots with one key
    are one product under two shapes (a reshape pushed into the operands: attention's scores
    as [b*h, s, s] and as [b, h, s, s]); None where the rows or columns do not flatten."""
    a, b = node.src
    if not (is_kernel_input(a) and is_kernel_input(b)):  # (an operand computed on its tiles)
        return None
    *batch, m, n = node.shape
    a_view, b_view = leaf_view(a), leaf_view(b)
    # (an operand with fewer batch dimensions than the product is broadcast over the others)
    batch_strides = lambda view: (0,) * (len(batch) + 2 - len(view.shape)) + view.strides[:-2]  # noqa: E731
    rows = View((*batch, m), (*batch_strides(a_view), a_view.strides[-2]), a_view.offset).reshape((math.prod(batch) * m,))
    if len(b.shape) == 2:  # one b for every row: the rows may be split or merged in any way
        m, columns = None, View((n,), b_view.strides[-1:], b_view.offset)
    else:
        columns = View((*batch, n), (*batch_strides(b_view), b_view.strides[-1]), b_view.offset).reshape((math.prod(batch), n))
    if rows is None or columns is None:
        return None
    base = lambda x: id(x.src[0] if isinstance(x.op, ViewOp) else x)
    return base(a), base(b), a.shape[-1], a_view.strides[-1], b_view.strides[-2], m, rows, columns


@dataclass
class Placement:
    domain: Domain
    foreign: list[GraphNode]  # reductions/gathers to read from buffers instead
    totals: list[GraphNode] = field(default_factory=list)  # grid reductions (see grid_totals)


GRID_OPS = ("add", "mul", "max", "min")


def store_domain(value: GraphNode) -> Placement:
    """The domain of a store of `value`, and the reductions it reaches that cannot stay in
    registers in that domain (they must be materialised first)."""
    reduces = reduces_in(value)
    dots = dots_in(value)
    computed_twice = _nested_products_read_again(dots)
    if computed_twice:  # (written once and read: a kernel computes a product in one role only)
        return Placement(Domain(value.shape), computed_twice)
    if dots and reduces and all(d.shape == value.shape for d in dots) and not reduces_in_epilogue(value):
        # only the products' prologues reduce (a norm's statistics): read from buffers, unless
        # the product's k loop computes them (a softmax along its k: lower/online_product.py)
        from .online_product import online_product  # (which imports this module)
        online = {id(r) for d in dots if (form := online_product(d)) is not None for r in form.reductions}
        return Placement(Domain(value.shape, dot=True), [r for r in reduces if id(r) not in online])
    if dots and reduces:
        nested = nested_products(dots)
        if nested:
            # (each pass over a row's column tiles would compute them again: written once
            # instead, or where they are no smaller, the products themselves, by a kernel of
            # their own that computes the nested ones on its tiles: an LM head's final norm's
            # backward reads the gradient of its output, dlogits @ w, not the logits)
            size = lambda nodes: sum(math.prod(n.shape) for n in nodes)  # noqa: E731
            return Placement(Domain(value.shape), dots if size(dots) <= size(nested) else nested)
        placement = _reduction_placement(value, reduces)
        # (a norm's statistics in a product's prologue are read from buffers in the k loop,
        # even where this domain could compute them: layer_norm(h + linear(h)) with h itself
        # a layer norm had its statistics computed in the kernel, which tl.dot's tiles never read)
        statistics = [r for d in dots for operand in d.src for r in reduces_in(operand)]
        if statistics:
            placement.foreign = list({id(r): r for r in [*placement.foreign, *statistics]}.values())
        if placement.foreign or not _reduces_product_rows(placement.domain, dots):
            # (a product is computed in a tiled kernel of its own shape: one that reduces
            # its rows or has another shape reads it from a buffer)
            return Placement(Domain(value.shape), dots)
        return dataclasses.replace(placement, domain=dataclasses.replace(placement.domain, dot=True))
    if dots and any(d.shape != value.shape for d in dots):
        return Placement(Domain(value.shape), dots)
    if not reduces:
        refs = [n for n in kernel_expression(value) if is_value_ref(n)]
        return Placement(Domain(value.shape, dot=bool(dots)), [r.src[0] for r in refs])
    return _reduction_placement(value, reduces)


def _nested_products_read_again(dots: list[GraphNode]) -> list[GraphNode]:
    """Products that an operand computes on its tiles (nested) and that the store reads
    elsewhere too: in its epilogue (gelu(x @ w1) @ w2 + gelu(x @ w1)) or in another product's
    operand. Codegen computes a product either as the kernel's own tile or inside an operand's
    k loop, not both (it failed on the nested product's b, which the kernel's index cannot
    address)."""
    seen: dict[int, int] = {id(d): 1 for d in dots}
    nested = nested_products(dots)
    for n in nested:
        seen[id(n)] = seen.get(id(n), 0) + 1
    return list({id(n): n for n in nested if seen[id(n)] > 1}.values())


def nested_products(dots: list[GraphNode]) -> list[GraphNode]:
    """The products the dots' a operands compute on their tiles, once per dot that does."""
    return [n for d in dots for n in kernel_expression(d.src[0]) if isinstance(n.op, Dot)]


def _reduces_product_rows(domain: Domain, dots: list[GraphNode]) -> bool:
    """Whether a reduction domain computes its products in its own kernel: products of its
    shape whose rows it reduces (over the columns, the last axis), tiled over programs by
    rows and walking the columns in steps (softmax of a product, its cross-entropy, a norm
    of a linear's output)."""
    return domain.axes == (len(domain.shape) - 1,) and all(d.shape == domain.shape for d in dots)


def _reduction_placement(value: GraphNode, reduces: list[GraphNode]) -> Placement:
    found = grid_totals(value)
    if found is not None:
        domain, totals = found
        inner = [n for t in totals for n in reduces_in(t.src[0])]
        return Placement(domain, _foreign((t.src[0] for t in totals), domain) if inner else [], totals)
    domain = domain_of_reduce(reduces[0])
    if domain.space_of(value.shape) is None:
        return Placement(domain, [reduces[0]])
    return Placement(domain, _foreign([value], domain))


def _foreign(values, domain: Domain = None) -> list[GraphNode]:
    """Reductions and gathers in `values` that `domain` (default: the nearest reduction's)
    cannot keep in registers."""
    values = list(values)
    reduces = [r for v in values for r in reduces_in(v)]
    domain = domain or domain_of_reduce(reduces[0])
    foreign = [r for r in reduces if domain_of_reduce(r) != domain]
    for node in kernel_expressions(values):
        if is_reduce_ref(node) and node.src[0] not in foreign and reference_space(node) is None:
            foreign.append(node.src[0])
        if is_value_ref(node) and isinstance(node.src[0].op, Gather) and not _is_row_alias(node, domain):
            foreign.append(node.src[0])
    return list({id(f): f for f in foreign}.values())


def grid_totals(value: GraphNode):
    """(inner domain, totals) when `value` is a scalar computed from total reductions
    (add/mul/max/min over every axis) of row values of one reduction domain, e.g.
    cross-entropy's mean over rows of per-row losses: the kernel that computes the rows
    also combines them across its programs (the last program to finish does). None when
    the value has another form."""
    totals = totals_of(value)
    inner = [r for t in totals or () for r in reduces_in(t.src[0]) if isinstance(r.op, Reduce)]
    if not totals or not inner:
        return None
    domain = domain_of_reduce(inner[0])
    return (domain, totals) if totals_fit(totals, domain) else None


def totals_of(value: GraphNode) -> Optional[list[GraphNode]]:
    """The total reductions a scalar value is computed from, or None if it has another form."""
    if math.prod(value.shape) != 1:
        return None
    totals, stack, seen = [], [value], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if is_value_ref(node):
            node = node.src[0]
        if isinstance(node.op, Reduce):
            if node.op.op not in GRID_OPS or node.op.axes != tuple(range(len(node.src[0].shape))):
                return None
            totals.append(node)
        elif isinstance(node.op, Elementwise):
            stack.extend(node.src)
        elif not node.is_literal:
            return None
    return list({id(t): t for t in totals}.values()) or None


def totals_fit(totals: list[GraphNode], domain: Domain) -> bool:
    """Each total's source is a row value of `domain` (its rows, squeezed or keepdim)."""
    return bool(domain.axes) and domain.squeezed_shape != () and \
        all(t.src[0].shape in (domain.squeezed_shape, domain.row_shape) for t in totals)


def splits_into(shape: tuple[int, ...], finer: tuple[int, ...]) -> bool:
    """Each axis of `shape` is a run of consecutive axes of `finer` (a reshape that only splits
    axes: any strided view of `shape` has one of `finer`)."""
    if shape == finer or math.prod(shape) != math.prod(finer) or 0 in shape:
        return False
    k = 0
    for n in shape:
        run = 1
        while run < n and k < len(finer):
            run *= finer[k]
            k += 1
        if run != n:
            return False
    return all(m == 1 for m in finer[k:])


def reshaped_expression(value: GraphNode, shape: tuple[int, ...], dims: Optional[tuple[int, ...]] = None,
                        copies: Optional[Copies] = None) -> Optional[GraphNode]:
    """The value's fused expression computed in `shape`, an axis split of its own (a norm's
    output read as [b*t, d] computed over the norm's [b, t, d]) or, with `dims`, its own axes
    in another order (value.permute(dims) has `shape`: a norm's output read as [t, b, d]):
    each read through the split or permuted view, elementwise work as it is, a product with
    only its batch axes split (attention's scores as [b*h, s, s] computed as [b, h, s, s]) as
    the product of its operands' batch axes split; None where a part has no such form (a
    gather, a window, a scan over the value's shape). copies notes each node it computes in
    the new layout (Copies.relay)."""
    new: dict[int, GraphNode] = {}
    relaid = (lambda view: view.reshape(shape)) if dims is None else (lambda view: view.permute(dims))

    def leaf(node: GraphNode, view: Optional[View]) -> Optional[GraphNode]:
        if view is None:
            return None
        return GraphNode(node.op, node.dtype, node.src, view) if isinstance(node.op, (ViewOp, Iota)) else \
            GraphNode(ViewOp(), node.dtype, (node,), view)

    def split(node: GraphNode) -> Optional[GraphNode]:
        if id(node) in new:
            return new[id(node)]
        found = None
        if isinstance(node.op, Elementwise):
            src = [split(s) for s in node.src]
            if all(s is not None for s in src):
                found = GraphNode(node.op, node.dtype, tuple(src), View.contiguous(shape))
        elif isinstance(node.op, Dot) and dims is None and shape[-2:] == node.shape[-2:] and \
                all(is_kernel_input(s) for s in node.src):
            src = [s if len(s.shape) == 2 else leaf(s, s.view.reshape(shape[:-2] + s.shape[-2:])) for s in node.src]
            if all(s is not None for s in src):
                found = GraphNode(node.op, node.dtype, tuple(src), View.contiguous(shape))
        elif isinstance(node.op, (ViewOp, Iota, Input, Const, Contiguous, Extern)):
            found = leaf(node, relaid(node.view))
        if found is not None and copies is not None and isinstance(node.op, (Elementwise, Dot)):
            copies.relay(found, node, relaid)
        new[id(node)] = found
        return found

    return split(value)


def aligned_permutation(value: GraphNode, domain: Domain) -> Optional[tuple[int, ...]]:
    """The axis order `dims` in which value (a full-shape value whose shape is a permutation of
    the domain's, as a norm's output read transposed) reads each reduction of `domain` as its
    broadcast over the domain: value.permute(dims) is then computed in the reduction's
    kernel. None when no order does (or value reads none of domain's reductions)."""
    shape = value.shape
    if len(shape) != len(domain.shape) or sorted(shape) != sorted(domain.shape) or len(shape) > 6:
        return None
    # (the views of the value's own expression; a reduction's input is in the domain's shape)
    refs = [n for n in toposort([value], stop=lambda n: is_kernel_input(n) or is_reduce_ref(n))
            if is_reduce_ref(n) and domain_of_reduce(n.src[0]) == domain]
    if not refs:
        return None
    for dims in itertools.permutations(range(len(shape))):
        if all(shape[d] == n for d, n in zip(dims, domain.shape)) and \
                all(reference_space(GraphNode(ViewOp(), r.dtype, r.src, r.view.permute(dims))) == "full" for r in refs):
            return None if dims == tuple(range(len(shape))) else dims  # (in order already: nothing to permute)
    return None


class Copies:
    """The copies read_from_buffers makes during one lowering, hash-consed (a part two stores
    copy alike is one node, computed once in their kernel) and each mapped to the node it
    copies: a copy computes its original's value, so the two share one buffer. Also the
    nodes reshaped_expression makes, each the value of a node of the graph in another layout
    (a norm backward's rows as [t, b, d] where the graph has [b, t, d]): such a node is read
    from its source's buffer through that layout's view (relaid_from)."""

    def __init__(self):
        self._builder = GraphBuilder()
        self._origin: dict[int, GraphNode] = {}  # id of a copy -> the graph's node it copies
        self._relaid: dict[int, tuple[GraphNode, Callable]] = {}  # id -> (source, its view -> this node's)
        self._kept: list[GraphNode] = []  # (the relaid nodes, so no id above names another node)

    def original(self, node: GraphNode) -> GraphNode:
        return self._origin.get(id(node), node)

    def copy(self, node: GraphNode, src: tuple[GraphNode, ...]) -> GraphNode:
        made = self._builder.node(node.op, node.dtype, src, node.view)
        self._origin[id(made)] = self.original(node)  # (the builder keeps `made`: its id names no other)
        if id(node) in self._relaid:
            self._relaid[id(made)] = self._relaid[id(node)]
        return made

    def relay(self, made: GraphNode, node: GraphNode, layout: Callable) -> None:
        """Note that `made` computes node's value viewed by `layout` (a View -> View)."""
        source, before = self.relaid_from(node) or (self.original(node), None)
        self._relaid[id(made)] = (source, layout if before is None else lambda view: layout(before(view)))
        self._kept.append(made)

    def relaid_from(self, node: GraphNode) -> Optional[tuple[GraphNode, Callable]]:
        """(the graph's node, the view of its value this node is) for a relaid node."""
        return self._relaid.get(id(node))

    def source(self, node: GraphNode) -> GraphNode:
        """The graph's node whose value this node computes, in its layout or another."""
        found = self._relaid.get(id(node))
        return found[0] if found is not None else self.original(node)


def read_through(buffer: GraphNode, layout: Callable) -> Optional[GraphNode]:
    """A read of a buffer (or of a view of one) through `layout` of its view; None where
    no strided view expresses it."""
    view = layout(buffer.view)
    if view is None:
        return None
    return GraphNode(ViewOp(), buffer.dtype, buffer.src, view) if isinstance(buffer.op, ViewOp) else \
        GraphNode(ViewOp(), buffer.dtype, (buffer,), view)


def read_from_buffers(value: GraphNode, buffers: dict[int, GraphNode], copies: Optional[Copies] = None) -> GraphNode:
    """A copy of value's expression in which each node with an entry in `buffers` (its id ->
    a Contiguous node of it) is read from that buffer instead of computed. The value itself
    is always computed: its store may be the one that fills its buffer. A buffer the
    expression already reads stays that node, even when its source was rewritten on another
    path: a copy of it would be a buffer no store fills. With `copies` (shared by the stores
    of one lowering), `buffers` is keyed by original nodes and a copy reads its original's."""
    key = (lambda node: id(copies.original(node))) if copies is not None else id
    new: dict[int, GraphNode] = {}
    for node in kernel_expression(value):
        if key(node) in buffers and node is not value:
            new[id(node)] = buffers[key(node)]
            continue
        relaid = copies.relaid_from(node) if copies is not None and node is not value else None
        if relaid is not None and id(relaid[0]) in buffers:
            read = read_through(buffers[id(relaid[0])], relaid[1])
            if read is not None:
                new[id(node)] = read
                continue
        if is_kernel_input(node):
            new[id(node)] = node
            continue
        src = tuple(new.get(id(s), s) for s in node.src)
        if all(a is b for a, b in zip(src, node.src)):
            new[id(node)] = node
        else:
            new[id(node)] = copies.copy(node, src) if copies is not None else GraphNode(node.op, node.dtype, src, node.view)
    return new[id(value)]

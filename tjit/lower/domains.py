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

from dataclasses import dataclass
from typing import Optional

from ..ir import Contiguous, Cumulative, Gather, GraphNode, Reduce, View, ViewOp, toposort


@dataclass(frozen=True)
class Domain:
    shape: tuple[int, ...]
    axes: tuple[int, ...] = ()  # the reduced axes

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


def _normal(view: View) -> View:
    """Strides of size-1 axes never matter: zero them so equal layouts compare equal."""
    return View(view.shape, tuple(0 if s == 1 else st for s, st in zip(view.shape, view.strides)), view.offset)


def reference_space(ref: GraphNode) -> Optional[str]:
    """How a ViewOp of a Reduce node reads it: "full" (its broadcast over the reduce's
    input), "squeezed", or None for any other view (which needs the value in memory)."""
    reduce_node = ref.src[0]
    domain = domain_of_reduce(reduce_node)
    dense = reduce_node.view.strides
    if _normal(ref.view) == _normal(View(domain.shape, tuple(0 if d in domain.axes else st
                                                            for d, st in enumerate(dense)))):
        return "full"
    squeezed = tuple(st for d, st in enumerate(dense) if d not in domain.axes)
    if _normal(ref.view) == _normal(View(domain.squeezed_shape, squeezed)):
        return "squeezed"
    return None


def is_reduce_ref(node: GraphNode) -> bool:
    return isinstance(node.op, ViewOp) and isinstance(node.src[0].op, Reduce)


def is_value_ref(node: GraphNode) -> bool:
    """A view of a value the kernel computes (a reduction or a gather), not of memory."""
    return isinstance(node.op, ViewOp) and isinstance(node.src[0].op, (Reduce, Gather))


def _is_row_alias(ref: GraphNode, domain: Domain) -> bool:
    """A gathered row value squeezed or unsqueezed: the same registers in row and squeezed
    space (the frontend only makes such views of a Gather)."""
    spaces = (domain.space_of(ref.src[0].shape), domain.space_of(ref.shape))
    return bool(domain.axes) and all(s in ("row", "squeezed") for s in spaces)


def is_kernel_input(node: GraphNode) -> bool:
    """What a fused expression reads from memory or takes as a literal: leaves and
    materialised buffers (Contiguous nodes are written by an earlier kernel)."""
    return node.is_leaf or isinstance(node.op, Contiguous)


def reduces_in(value: GraphNode) -> list[GraphNode]:
    """Reductions and scans a store's fused expression computes, nearest the store first."""
    nodes = toposort([value], stop=is_kernel_input)
    return [n for n in reversed(nodes) if isinstance(n.op, (Reduce, Cumulative))]


def store_domain(value: GraphNode) -> tuple[Domain, list[GraphNode]]:
    """The domain of a store of `value`, and the reductions it reaches that cannot stay in
    registers in that domain (they must be materialised first)."""
    reduces = reduces_in(value)
    if not reduces:
        refs = [n for n in toposort([value], stop=is_kernel_input) if is_value_ref(n)]
        return Domain(value.shape), [r.src[0] for r in refs]
    domain = domain_of_reduce(reduces[0])
    if domain.space_of(value.shape) is None:
        return domain, [reduces[0]]
    foreign = [r for r in reduces if domain_of_reduce(r) != domain]
    for node in toposort([value], stop=is_kernel_input):
        if is_reduce_ref(node) and node.src[0] not in foreign and reference_space(node) is None:
            foreign.append(node.src[0])
        if is_value_ref(node) and isinstance(node.src[0].op, Gather) and not _is_row_alias(node, domain):
            foreign.append(node.src[0])
    return domain, foreign


def read_from_buffers(value: GraphNode, buffers: dict[int, GraphNode]) -> GraphNode:
    """A copy of value's expression in which each node with an entry in `buffers` (its id ->
    a Contiguous node of it) is read from that buffer instead of computed."""
    new: dict[int, GraphNode] = {}
    for node in toposort([value], stop=is_kernel_input):
        if id(node) in buffers:
            new[id(node)] = buffers[id(node)]
            continue
        src = tuple(new.get(id(s), s) for s in node.src)
        same = all(a is b for a, b in zip(src, node.src))
        new[id(node)] = node if same else GraphNode(node.op, node.dtype, src, node.view)
    return new[id(value)]

"""Write-after-read hazards between the programs of one kernel.

A kernel's programs run in any order (the interpreter runs them one after another, a GPU
all at once), so a kernel that writes an input in place may read that input's older
contents only where each address is read by the very program that writes it, before it
writes it. That holds when the read and the write reach the same address at every point of
the kernel's iteration domain (x.mul_(2), softmax written back into x: a row is read and
written by one program). It does not hold for a flipped, transposed or shifted view of the
written tensor, or for an indexed read of it: another program may already have
overwritten the element. Such reads are staged: copied into a slab buffer by an earlier
kernel, which the writing kernel then reads.
"""
from __future__ import annotations

from ..analysis.addresses import disjoint, meets_only_where_tied
from ..ir import Contiguous, Dot, Gather, GraphNode, Input, View, ViewOp, Window, nested_axes
from .domains import Domain, kernel_expression, normal, operand_leaves


def reads_older_version(leaf: GraphNode, name: str, version: int) -> bool:
    """The leaf reads input `name` as it was before write number `version`."""
    base = leaf.src[0] if isinstance(leaf.op, ViewOp) else leaf
    return isinstance(base.op, Input) and base.op.name == name and base.op.version < version


def reads_apart(leaf: GraphNode, written: View) -> bool:
    """The leaf reads none of the addresses the write reaches (x[:, 1::2] beside a write into
    x[:, ::2]): whichever program writes first, it reads what it would have read before. Its
    gathers and windows stay inside its view, so the view bounds what it reads."""
    return disjoint(leaf.view, written)


def gather_tables(value: GraphNode) -> set[int]:
    """ids of the leaves a store's expression reads at addresses other than their own view's:
    data-dependent ones (Gather), shifted ones (Window), and a matrix product's operands
    (each program reads whole rows of one and columns of the other)."""
    nodes = kernel_expression(value)
    return {id(n.src[0]) for n in nodes if isinstance(n.op, (Gather, Window))} | \
        {id(leaf) for n in nodes if isinstance(n.op, Dot) for s in n.src for leaf in operand_leaves(s)}


def same_program_access(read: View, write: View, domain: Domain) -> bool:
    """Every address the write reaches at a point of `domain` is read only at points of the
    same row, so by the program that writes it: at the very point, where the write moves
    along the row (a looped row stores tile after tile), anywhere in the row for a row value
    (written once, after the row's reads). (Along the reduced axes a row is one program's:
    persistent or looped, never split when it also stores a full-shape value.) A rule over
    strides answers the common layouts; integer sets answer the others exactly."""
    if domain.space_of(read.shape) is None or domain.space_of(write.shape) is None:
        return False
    r, w = normal(domain.to_domain(read)), normal(domain.to_domain(write))
    if _same_layout_per_row(r, w, domain):
        return True
    tied = [d for d in range(len(domain.shape)) if d not in domain.axes or w.strides[d] != 0]
    return meets_only_where_tied(r, w, tied)


def _same_layout_per_row(r: View, w: View, domain: Domain) -> bool:
    """The rule: the read and the write address each point alike (a row value's write
    standing still along the reduced axes), and no two rows' reads meet."""
    if r.offset != w.offset:
        return False
    for d in range(len(domain.shape)):
        if d in domain.axes:
            if w.strides[d] not in (0, r.strides[d]):
                return False
        elif r.strides[d] != w.strides[d]:
            return False
    if not domain.axes:
        return True
    # a row value (a running mean written from the batch mean) is read and written at one
    # address per row: the reduced axes along which the read does not move address nothing
    # another program reaches, so they are left out of the check; no two rows' reads meet
    # where the moving axes nest (a cheap sufficient test: the exact one follows otherwise)
    moving = [d for d in range(len(r.shape)) if d not in domain.axes or r.strides[d] != 0]
    moved = View(tuple(r.shape[d] for d in moving), tuple(abs(r.strides[d]) for d in moving))
    return nested_axes(moved) is not None


def stage(leaf: GraphNode) -> GraphNode:
    """A slab buffer holding a copy of what `leaf` reads."""
    return GraphNode(Contiguous(), leaf.dtype, (leaf,), View.contiguous(leaf.shape))

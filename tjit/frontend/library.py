"""Aten ops tjit does not generate run as library calls: the op itself, on memory.

An op with no IR translation (a sort, a matmul, a convolution, ...) becomes an ExternCall:
its tensor operands are read from memory (an input or a view of one, a buffer a kernel
writes, another call's result), so values computed by fused kernels are materialised
first; its results are Extern nodes that later kernels load like any buffer. The fused
work before and after the call still fuses: only the call itself is a boundary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import UnsupportedOpError
from ..ir import Contiguous, DType, Extern, ExternCall, GraphNode, Input, Operand, View, ViewOp, contiguous_strides
from .overlap import is_non_overlapping_and_dense

MEMORY = (Input, Contiguous, Extern)  # nodes whose value lives in memory a library call can read


def reads_memory(node: GraphNode) -> bool:
    """The node is memory (an input, a buffer, a call's result) or a strided view of one
    that torch can express (torch has no negative strides: a flipped view is copied)."""
    base = node.src[0] if isinstance(node.op, ViewOp) else node
    return isinstance(base.op, MEMORY) and all(stride >= 0 for stride in node.view.strides)


aten = torch.ops.aten

# Ops that address their operand's storage rather than the operand (as_strided reads any
# element of the storage, at offsets from its start). An input's memory is the caller's
# storage, as in eager; any other operand is handed to them as the whole of a storage of
# its own (runtime/library.py copies it), which is exact only where the traced operand was
# its whole storage too.
STORAGE_ADDRESSED = frozenset({aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default})


def reads_an_input(node: GraphNode) -> bool:
    base = node.src[0] if isinstance(node.op, ViewOp) else node
    return isinstance(base.op, Input)


def check_whole_storage(target, operand: GraphNode, meta, fx_node: fx.Node) -> None:
    if reads_an_input(operand) or not isinstance(meta, torch.Tensor):
        return
    if not (meta.storage_offset() == 0 and is_non_overlapping_and_dense(meta)
            and meta.untyped_storage().nbytes() == meta.numel() * meta.element_size()):
        raise UnsupportedOpError(str(target), "addresses the storage of an operand that is only part of its "
                                 "storage (as_strided of a view of a computed value)", target=fx_node.target)


def library_call(cv, node: fx.Node, target, args: tuple, kwargs: dict) -> Any:
    """Run `target` (an aten OpOverload) as a library call on the converted args: returns
    its results as Extern nodes, in the structure the op returns them. Arguments the op
    writes in place are written as an in-place op writes them (Converter.assign), from the
    copies the call writes; a call that returns nothing and writes nothing is kept as one of
    the graph's effects."""
    if not isinstance(target, torch._ops.OpOverload):
        raise UnsupportedOpError(str(target), "not an aten op (tjit runs aten ops it does not generate as library "
                                 "calls)", target=node.target)
    written = written_arguments(node, target)
    operands: list[GraphNode] = []
    traced = iter(leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
                  for leaf in tree_flatten((node.args, node.kwargs))[0])

    def placeholder(value):
        meta = next(traced)
        if not isinstance(value, GraphNode):
            return value
        operands.append(in_traced_layout(cv, value, meta))
        if target in STORAGE_ADDRESSED:
            check_whole_storage(target, operands[-1], meta, node)
        return Operand(len(operands) - 1)

    bound_args, bound_kwargs = tree_map(placeholder, (tuple(args), dict(kwargs)))
    writes = tuple((bound_args[k] if k < len(bound_args) else bound_kwargs[arg.name]).index
                   for k, arg, _ in written)
    seed = None
    if _differentiable_random(target, operands, writes) and not _without_dropout(target, args, kwargs):
        operands.append(draw_seed(cv, operands))
        seed = len(operands) - 1
    returns_nothing = not target._schema.returns
    call = ExternCall(target, bound_args, bound_kwargs, writes, tuple(cv.version.items()) if returns_nothing else (),
                      seed)
    if returns_nothing and not written:  # (a check: linalg's errors)
        cv.settle_writes_before_check()
        cv.effects.append(cv.b.node(Extern(call, None), DType.bool, tuple(operands), View((), ())))
        return None
    # (a call that returns nothing but writes arguments, a custom op with mutates_args, is its writes)
    results, spec = tree_flatten(node.meta.get("val"))
    copies = _write_back(cv, call, operands, written, sum(isinstance(r, torch.Tensor) for r in results))
    nodes, k = [], 0
    for result, returned in zip(results, _returns_per_result(target, results)):
        if not isinstance(result, torch.Tensor):
            nodes.append(result)
            continue
        alias = returned.alias_info if returned is not None else None
        if alias is not None and alias.is_write:  # an in-place op returns the tensor it wrote
            nodes.append(copies[frozenset(alias.before_set)])
        else:
            view = View(tuple(result.shape), tuple(result.stride()))
            call.results[k] = cv.b.node(Extern(call, k), DType.from_torch(result.dtype), tuple(operands), view)
            nodes.append(call.results[k])
        k += 1
    return tree_unflatten(nodes, spec)


def _write_back(cv, call: ExternCall, operands: list[GraphNode], written: list, n_results: int) -> dict:
    """Each written argument gets the call's copy of it (results n_results, n_results + 1, ...)
    written back as an in-place op writes (Converter.assign); returns alias set -> copy."""
    copies = {}
    for j, ((_, arg, fx_arg), k) in enumerate(zip(written, call.writes)):
        src = operands[k]
        copies[frozenset(arg.alias_info.before_set) if arg.alias_info else None] = copy = \
            cv.b.node(Extern(call, n_results + j), src.dtype, tuple(operands), View.contiguous(src.shape))
        cv.assign(fx_arg, copy)
    return copies


def _differentiable_random(target, operands: list[GraphNode], writes: tuple[int, ...]) -> bool:
    """A random op with a float operand it reads (rrelu's input): its derivative runs it
    again, which must draw the same numbers."""
    return torch.Tag.nondeterministic_seeded in target.tags and \
        any(o.dtype.is_float for k, o in enumerate(operands) if k not in writes)


def _without_dropout(target, args, kwargs) -> bool:
    """A random op whose only randomness is a dropout of probability 0 (attention's
    dropout_p=0.0): it draws nothing."""
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return False
    k = names.index("dropout_p")
    return (args[k] if k < len(args) else kwargs.get("dropout_p", target._schema.arguments[k].default_value)) == 0


@dataclass(frozen=True)
class DrawSeed:
    """A seed for one random call, drawn from torch's generator of the device of its operand
    (the random op's input, read for nothing else: a call's result computed from an operand is
    saved for backward, where a value computed from nothing would be drawn again)."""

    def __call__(self, operand: torch.Tensor) -> torch.Tensor:
        return torch.randint(0, 2 ** 62, (), dtype=torch.int64, device=operand.device)

    def __str__(self) -> str:
        return "draw_seed"


def draw_seed(cv, operands: list[GraphNode]) -> GraphNode:
    anchor = next(o for o in operands if o.dtype.is_float)
    return cv.b.node(Extern(ExternCall(DrawSeed(), (Operand(0),), {}), 0), DType.int64, (anchor,), View((), ()))


def written_arguments(node: fx.Node, target) -> list[tuple[int, Any, fx.Node]]:
    """(position, schema argument, FX node passed for it) for each tensor argument the op writes in
    place; None arguments (an optional output) are written by no one."""
    schema = target._schema
    values = [node.args[k] if k < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
              for k, arg in enumerate(schema.arguments)]
    found = []
    for position, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = values[position]
        if value is None:
            continue
        if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
            raise UnsupportedOpError(str(target), f"writes its argument {arg.name!r} ({arg.type}) in place: tjit "
                                     "functionalises only single tensor arguments", target=node.target)
        found.append((position, arg, value))
    return found


def _returns_per_result(target, results: list) -> list:
    """The schema return each flattened result comes from (None where a return is a list)."""
    returns = target._schema.returns
    if len(returns) == len(results):
        return list(returns)
    return [None] * len(results)


def in_traced_layout(vb, value: GraphNode, meta) -> GraphNode:
    """The value as memory a library call can read, in the layout the trace gave it: tjit drops
    copies that change only the layout (`.contiguous()`), but an op may rely on one it was
    handed (embedding_bag's indices), so a dense traced layout is written out as such. A
    computed value is written once, straight in that layout (the permutation is pushed into
    its computation), rather than written dense and then copied."""
    strides = value.view.strides if reads_memory(value) else contiguous_strides(value.shape)
    if not isinstance(meta, torch.Tensor) or meta.numel() <= 1 or not is_non_overlapping_and_dense(meta) \
            or _same_strides(strides, meta):
        return in_memory(vb, value)  # (a strided window is read through its strides)
    order = sorted(range(meta.dim()), key=lambda d: (-meta.stride(d), d))  # outermost first
    permuted = vb.view(value, ("permute", tuple(order)))
    dense = vb.b.node(Contiguous(), value.dtype, (permuted,), View.contiguous(permuted.shape)) \
        if reads_memory(permuted) else in_memory(vb, permuted)
    back = tuple(order.index(d) for d in range(meta.dim()))
    return vb.view(dense, ("permute", back))


def _same_strides(strides: tuple[int, ...], meta: torch.Tensor) -> bool:
    return all(size == 1 or a == b for size, a, b in zip(meta.shape, strides, meta.stride()))


def in_memory(vb, value: GraphNode, own_shape: bool = True) -> GraphNode:
    """The value as memory a library call can read: as it is when it already is memory (or a
    view of it), else written to a buffer by a kernel (literals too). own_shape: a reshape
    of a computed value is written in the value's shape (below)."""
    if reads_memory(value):
        return value
    if value.is_literal:
        return vb.b.node(Contiguous(), value.dtype, (value,), View.contiguous(value.shape))
    source = vb.reshaped_from(value) if own_shape else None
    if source is not None:
        # a reshape of a computed value (a linear's [b*t, d] operand of [b, t, d] activations)
        # is written in the value's own shape and read through the reshape: a kernel that needs
        # the value itself then reads this buffer (lower/fusion.py: _read_earlier_buffers)
        # rather than computing it again (a residual stream's gradient, from every layer above)
        return vb.view(in_memory(vb, source), ("reshape", value.shape))
    return vb.materialize(value)


@dataclass(frozen=True)
class WriteThroughView:
    """`base` (a storage's flat contents) with `src` written through the view (size, stride,
    offset) of it: torch's as_strided_scatter, except for its derivative, which torch gets
    wrong (the base's gradient is kept inside the view rather than outside it); here torch
    differentiates a copy written through a view."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def __call__(self, base: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        out = base.clone()
        out.as_strided(self.size, self.stride, self.offset).copy_(src)
        return out

    def box(self, numel: int) -> Optional[tuple[list[int], tuple[int, ...], tuple[int, ...]]]:
        """Whether the view is a box of `numel` contents seen as a dense array of some shape (a
        slice with step 1 on every axis): (its axes outermost first, that shape, the box's
        first index), or None (a view with a step, or one that wraps)."""
        order = sorted((d for d, n in enumerate(self.size) if n != 1), key=lambda d: -self.stride[d])
        strides = [self.stride[d] for d in order]
        if math.prod(self.size) == 0 or any(st <= 0 for st in strides) or len(set(strides)) < len(strides):
            return None
        bounds = [numel] + strides + ([1] if not strides or strides[-1] != 1 else [])
        if any(outer % inner for outer, inner in zip(bounds, bounds[1:])):
            return None
        shape = tuple(outer // inner for outer, inner in zip(bounds, bounds[1:]))
        low, rest = [], self.offset
        for inner in bounds[1:]:
            low.append(rest // inner)
            rest %= inner
        sizes = [self.size[d] for d in order] + [1] * (len(shape) - len(order))
        if any(lo + n > size for lo, n, size in zip(low, sizes, shape)):
            return None
        return order, shape, tuple(low)

    def as_kernels(self, vb, base: GraphNode, value: GraphNode) -> GraphNode:
        """The write as IR, for a view that is a box (see box): the flat contents `base` with
        the box at its place in the dense shape selected from a window of `value`."""
        order, shape, low = self.box(base.shape[0])
        kept = [d for d in order if self.size[d] != 1]
        src = vb.view(value, ("permute", tuple(kept + [d for d in range(len(self.size)) if self.size[d] == 1])))
        box = tuple(self.size[d] for d in kept) + (1,) * (len(shape) - len(kept))
        src = vb.view(src, ("reshape", box))
        grid = vb.view(base, ("reshape", shape))
        inside = vb.in_window(low, box, shape)
        written = vb.window(src, low, shape, 0)
        merged = vb.elementwise("where", [inside, written, grid], base.dtype) if inside is not None else written
        # (in memory: later reads are strided views of the contents, which kernels read from memory)
        return vb.view(in_memory(vb, merged), ("reshape", (base.shape[0],)))

    def as_call(self, vb, base: GraphNode, value: GraphNode) -> GraphNode:
        """The write as a library call: a copy of the flat contents `base` with `value`
        written through the view."""
        call = ExternCall(self, (Operand(0), Operand(1)), {})
        operands = (in_memory(vb, base), in_memory(vb, value))
        return vb.b.node(Extern(call, 0), base.dtype, operands, View.contiguous(base.shape))

    def __str__(self) -> str:
        return "write_through_view"


def view_of_contents(b, contents: GraphNode, view: View) -> GraphNode:
    """`view` (in elements of a storage's flat contents, 1-d memory or a 1-d view of it) as a
    view of the memory that holds the contents."""
    memory = contents.src[0] if isinstance(contents.op, ViewOp) else contents
    step, start = contents.view.strides[0], contents.view.offset
    composed = View(view.shape, tuple(st * step for st in view.strides), start + view.offset * step)
    return memory if composed == memory.view else b.node(ViewOp(), contents.dtype, (memory,), composed)


def write_through_view_gradient(vb, node: GraphNode, grad: GraphNode, wanted) -> list[Optional[GraphNode]]:
    """The gradients of a WriteThroughView's operands (the contents before the write, the values
    written): the result's gradient with the view's elements zeroed (the same write, of zeros,
    into the gradient), and those elements read through the view. Not torch's derivative run
    as a call, which runs the write again and differentiates it."""
    write: WriteThroughView = node.op.call.target
    base, src = node.src
    flat = in_memory(vb, grad)
    grads: list[Optional[GraphNode]] = [None, None]
    if src.dtype.has_gradient and wanted(src):
        grads[1] = view_of_contents(vb.b, flat, View(write.size, write.stride, write.offset))
    if base.dtype.has_gradient and wanted(base):
        zeros = vb.expand_to(vb.const(0, grad.dtype), src.shape)
        grads[0] = write.as_kernels(vb, flat, zeros) if write.box(base.shape[0]) and not grad.dtype.is_complex \
            else write.as_call(vb, flat, zeros)
    return grads


@dataclass(frozen=True, eq=False)
class ExternGradient:
    """The gradient of result `index` (or of each of the results in a tuple `index`, jointly)
    of a library call with respect to its operands `wrt`, computed by torch's own derivative
    formula for the op (torch.autograd.grad), itself run as a library call: called with the
    call's operands and the results' gradients, it returns one gradient per operand in `wrt`."""
    call: ExternCall
    index: Union[int, tuple[int, ...]]
    wrt: tuple[int, ...]

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from ..runtime.library import call_results  # the runtime runs calls; the frontend only describes them
        indices = self.index if isinstance(self.index, tuple) else (self.index,)
        operands, grads = tensors[:len(tensors) - len(indices)], tensors[len(tensors) - len(indices):]
        with torch.enable_grad():
            # the op runs again: operands without a gradient are copies, since the op may write
            # into them (rrelu_with_noise its noise)
            leaves = [t.detach().requires_grad_() if k in self.wrt else t.clone() for k, t in enumerate(operands)]
            results = call_results(self.call, leaves)
            outs = [(results[k], g) for k, g in zip(indices, grads) if results[k].requires_grad]
            wrt = [leaves[k] for k in self.wrt]
            found = torch.autograd.grad([o for o, _ in outs], wrt, [g for _, g in outs], allow_unused=True) \
                if outs else [None] * len(wrt)
        return tuple(torch.zeros_like(w) if g is None else g for w, g in zip(wrt, found))

    def __str__(self) -> str:
        return f"grad{list(self.index) if isinstance(self.index, tuple) else [self.index]} of {self.call.name}"


def library_call_gradient(vb, node: GraphNode, grad: GraphNode, value, wanted) -> list[Optional[GraphNode]]:
    """Gradients of a library call's result `node` (an Extern node) for each of its operands
    whose gradient is `wanted`, given the result's gradient: one library call running torch's
    derivative formula on the operands' forward values (`value`: forward node -> its value
    in the backward graph)."""
    return joint_library_call_gradient(vb, [(node, grad)], value, wanted, node.op.index)


def joint_library_call_gradient(vb, results: list[tuple[GraphNode, GraphNode]], value, wanted,
                                index=None) -> list[Optional[GraphNode]]:
    """The same for several results of one call and their gradients, in one run of torch's
    derivative (whose checks may read the results' gradients together: svd's)."""
    node = results[0][0]
    wrt = tuple(k for k, s in enumerate(node.src) if s.dtype.has_gradient and wanted(s))
    if not wrt:
        return [None] * len(node.src)
    # (the derivative runs the op again: a random op draws the same numbers from its seed, or
    # has no operand it reads besides those it overwrites, whose gradient is zero whatever it draws)
    operands = tuple(in_memory(vb, value(s)) for s in node.src) + \
        tuple(in_memory(vb, grad) for _, grad in results)
    index = index if index is not None else tuple(n.op.index for n, _ in results)
    call = ExternCall(ExternGradient(node.op.call, index, wrt), tuple(Operand(k) for k in range(len(operands))), {})
    grads: list[Optional[GraphNode]] = [None] * len(node.src)
    for j, k in enumerate(wrt):
        src = node.src[k]
        grads[k] = vb.b.node(Extern(call, j), src.dtype, operands, View.contiguous(src.shape))
    return grads

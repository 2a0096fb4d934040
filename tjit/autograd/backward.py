"""Reverse mode over the IR: the backward of a forward Graph is another Graph.

plan_autograd decides, once per compiled form, what the forward keeps for backward. The
backward graph reads forward values through `value(n)`, which recomputes them from the
forward's inputs unless the forward saved them. Which values to save is a minimum cut (as
torch's partitioner makes): between the forward inputs and the values the gradient
formulas read, cut where the fewest bytes cross (totals over a whole tensor are not
recomputed: each would cost the backward a kernel). Inputs are kept by reference and
recomputing elementwise math from them is free in a memory-bound kernel, so ties go to the
inputs, then to the forward's outputs, and only then to intermediates, which cost a store
in the forward and tape memory until backward.

backward_graph builds the backward for one layout of the incoming gradients (their strides
are baked into the kernels, like any input's), then it is lowered like any forward graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import UnsupportedOpError
from ..frontend.build import ValueBuilder, apply_view_desc, inverse_views
from ..frontend.library import joint_library_call_gradient
from ..ir import (Contiguous, Dot, DType, Elementwise, Extern, Graph, GraphBuilder, GraphNode, Input, Iota, Reduce, View,
                  ViewOp, contiguous_strides, copies_its_source, covered_memory, toposort)
from .accumulate import total_gradient
from .algebra import Algebra
from .complex import as_call_result, complex_vjp, touches_complex
from .library_grad import takes_joint_gradient
from .scatter import scatter_added, scatter_into_source
from .vjp import ScatterGrad, differentiable, vjp

# input names of a backward graph besides the forward's (chosen not to meet a user's argument name)
SAVED_PREFIX = "tjit_saved"


def incoming_grad_name(output: str) -> str:
    return f"tjit_grad_{output}"


WRITTEN_PREFIX = "tjit_written_"


def written_output_name(name: str) -> str:
    """The result that stands for the new contents of input `name`, written in place."""
    return WRITTEN_PREFIX + name


def with_written_inputs(graph: Graph, written: tuple[str, ...]) -> Graph:
    """The graph with the new contents of each written input that requires grad as one more
    result (its gradient flows back like any result's; see trace._write_back): the value of
    the input's one mutation, which writes all of it."""
    if not written:
        return graph
    extra = {}
    for name in written:
        (mutation,) = [m for m in graph.mutations if m.name == name]
        assert mutation.value.shape == mutation.view.shape and mutation.view.offset == 0, (name, mutation.view)
        extra[written_output_name(name)] = mutation.value
    return Graph(graph.input_names, {**graph.outputs, **extra}, graph.mutations, graph._inputs, graph.effects,
                 graph.view_sources, graph.view_chains)


GradLayout = Optional[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]  # None: no gradient arrives


@dataclass
class AutogradPlan:
    graph: Graph  # the forward graph
    grad_inputs: tuple[str, ...]  # inputs that get a gradient
    differentiable_outputs: tuple[str, ...]  # forward outputs whose gradient flows back
    saved: dict[str, GraphNode]  # extra forward outputs kept for backward (SAVED_PREFIX + k)
    saved_outputs: tuple[str, ...]  # forward outputs the backward reads
    saved_inputs: tuple[str, ...]  # forward inputs the backward reads
    # differentiable output -> the inputs eager's gradient reaches from it, where that was
    # asked (see plan_autograd): those the IR does not reach get a zero gradient, as in eager
    eager_reaches: dict[str, frozenset] = field(default_factory=dict)
    _saved_ids: dict[int, str] = field(default_factory=dict, repr=False)  # forward node -> name it is read by
    # saved intermediates kept compact (_Compacting): the value's shape with 1 along the axes it
    # is constant on, read back broadcast
    compact: frozenset = frozenset()

    def forward_graph(self) -> Graph:
        """The forward graph with the saved intermediates as extra outputs."""
        return Graph(self.graph.input_names, {**self.graph.outputs, **self.saved}, self.graph.mutations,
                     self.graph._inputs, self.graph.effects, view_chains=self.graph.view_chains)


def may_differ_from_eager(conversion, grad_inputs) -> bool:
    """Whether eager's autograd may disagree with the IR on which results require grad: a
    float result with no differentiable path to an input (a fill or zero_ of an input is a
    literal in the IR, a norm of order 0 a count; eager's require grad, with a zero
    gradient), or a result that is a view of an input or of another result (eager's does
    not require grad when it was taken through detach())."""
    graph = conversion.graph
    needs = _needs_grad(graph, set(grad_inputs))
    reached = _reached_through_floats(list(graph.outputs.values()), needs)
    if any(all(id(n) not in reached for n in graph.input_nodes(name)) for name in grad_inputs):
        return True  # (an input whose only use is a fill's shape: eager gives it a zero gradient)
    computed = [s for s in conversion.outputs if s.kind == "computed" and graph.outputs[s.name].dtype.is_float]
    if len(computed) > 1:
        return True  # an op's side results may be non-differentiable in eager (layer norm's mean, lu's P)
    for spec in conversion.outputs:
        if spec.kind == "output_alias" or spec.kind == "input_alias" and spec.name in grad_inputs:
            return True
        if spec.kind == "computed":
            node = conversion.graph.outputs[spec.name]
            if node.dtype.is_float and id(node) not in needs:
                return True
    return False


def plan_autograd(graph: Graph, grad_inputs, eager: Optional[dict[str, frozenset]] = None) -> AutogradPlan:
    """eager: per output, None if it does not require grad in eager, else the inputs eager's
    backward gives a gradient from it, when that was asked because the IR may disagree (see
    may_differ_from_eager); the outputs that require grad are then eager's."""
    mutated = {m.name: m.version for m in graph.mutations}  # (each input's last version)
    seen = {m.name for m in graph.mutations if not m.unseen}  # (the others stay leaves, as eager's do)
    refused = sorted(name for name in seen & set(grad_inputs) if written_output_name(name) not in graph.outputs)
    if refused:
        raise UnsupportedOpError("in-place write", f"the function writes into input(s) {refused}, which require "
                                 "grad, with grad mode on (eager refuses in-place writes into leaves that require "
                                 "grad)")
    needs = _needs_grad(graph, set(grad_inputs))
    if eager is None:
        outputs = tuple(name for name, node in graph.outputs.items() if id(node) in needs)
    else:
        outputs = tuple(name for name in graph.outputs if eager.get(name) is not None)
    plan = AutogradPlan(graph, tuple(grad_inputs), outputs, {}, (), (),
                        {name: eager[name] for name in outputs} if eager is not None else {})
    contiguous = {name: (graph.outputs[name].shape, None, graph.outputs[name].dtype.torch) for name in outputs}
    recomputing = _Recompute(_ViewTracking(), {}, view_sources=graph.view_sources)  # (reads as the backward's)
    grads = _sweep(Algebra(recomputing.vb), plan, contiguous, recomputing, needs)
    roots = [n for dense, scattered in grads.values()
             for n in [dense] + [v for s in scattered for v in (s.index, s.values)] if n is not None]
    read = _read_by_backward(roots + recomputing.viewed_values, recomputing.vb.origin)
    read = list({id(n): n for n in read + recomputing.operands}.values())
    _choose_saved(plan, read, {name: last for name, last in mutated.items() if name not in _written(graph)})
    return plan


def _written(graph: Graph) -> set[str]:
    """The inputs whose new contents are results (with_written_inputs)."""
    return {name[len(WRITTEN_PREFIX):] for name in graph.outputs if name.startswith(WRITTEN_PREFIX)}


@dataclass
class BackwardGraph:
    graph: Graph
    constants: dict[str, torch.Tensor]  # index tables the graph reads
    # inputs an output depends on only through piecewise-constant ops (round, floor...):
    # their gradient is zeros, as eager's is
    zeros: tuple[str, ...] = ()


def backward_graph(plan: AutogradPlan, layouts: dict[str, GradLayout],
                   output_strides: Optional[dict[str, tuple[int, ...]]] = None) -> BackwardGraph:
    """The backward graph for gradients arriving with these layouts: inputs are the
    gradients (incoming_grad_name), the saved values and forward inputs it reads, and index
    tables; outputs are "grad_<input>" for each input that gets a gradient (scatter-adds into
    it included, as IR Scatters)."""
    vb = ValueBuilder(indices_checked=True)
    alg = Algebra(vb)
    needs = _needs_grad(plan.graph, set(plan.grad_inputs))
    strides = {**saved_layouts(plan), **(output_strides or {})}
    compact = {name: node.shape for name, node in plan.saved.items() if name in plan.compact}
    recompute = _Recompute(vb, plan._saved_ids, strides, _saved_copies(plan), plan.graph.view_sources, compact)
    grads = _sweep(alg, plan, layouts, recompute, needs)
    outputs = {}
    for name, (dense, scattered) in grads.items():
        node = plan.graph.input_node(name)
        if scattered:
            outputs[f"grad_{name}"] = scatter_added(alg, node, scattered, dense)
        elif dense is not None:
            outputs[f"grad_{name}"] = as_call_result(vb, dense) if node.dtype.is_complex else alg.cast(dense, node.dtype)
    names = sorted({n.op.name for n in toposort(outputs.values()) if isinstance(n.op, Input)})
    arriving = [n for n in plan.differentiable_outputs if layouts.get(n) is not None]
    reached = _reached_through_floats([plan.graph.outputs[n] for n in arriving], needs)
    eager = {name for n in arriving for name in plan.eager_reaches.get(n, ())}
    zeros = tuple(name for name in plan.grad_inputs if name not in grads
                  and (any(id(n) in reached for n in plan.graph.input_nodes(name)) or name in eager))
    graph = vb.b.finish(names, outputs)
    graph.view_chains = vb.view_chains({id(n) for n in graph.nodes()})
    return BackwardGraph(graph, alg.constants, zeros)


def _saved_copies(plan: AutogradPlan) -> dict[int, GraphNode]:
    """id(n) -> a saved contiguous(n) (or a reshape of it): n's values, kept anyway. A
    recurrent state written for the next step's matmul (which the matmul's gradient reads)
    is then read back by the backward, not recomputed from every earlier step's saved
    values: work and source that would grow with the square of the steps."""
    kept = [*plan.saved.values(), *(plan.graph.outputs[name] for name in plan.saved_outputs)]
    found = {}
    for c in kept:  # (c may be a reshape of the copy: _buffer_of_reshape)
        buffer = _buffer_of_reshape(c)
        if copies_its_source(buffer) and c.dtype == buffer.src[0].dtype:
            found[id(buffer.src[0])] = c
    return found


def _buffer_of_reshape(node: GraphNode) -> GraphNode:
    """The buffer that node reshapes (a linear's [b*t, d] operand written as [b, t, d]
    activations: frontend/library.py's in_memory), or node itself."""
    if isinstance(node.op, ViewOp) and isinstance(node.src[0].op, Contiguous) and \
            node.view == View.contiguous(node.shape) and node.view.numel == node.src[0].view.numel:
        return node.src[0]
    return node


def saved_layouts(plan: AutogradPlan) -> dict[str, tuple[int, ...]]:
    """The strides each saved intermediate is kept in: a value that lives in memory (a library
    call's result, a buffer written for a call) as that memory is laid out, any other value
    contiguous. A call's result or operand is what the backward's calls read again (its
    derivative formula was traced with it), in the layout they were traced for: kept in
    that layout, the backward reads it as it is, with no copy (attention's q, k, v, written
    [b, s, h, d] for the forward's call and read [b, h, s, d]). A copy of an input (one the
    function writes in place) is contiguous."""
    return {name: node.view.strides if covered_memory(node) is not None and not isinstance(node.op, Input)
            else contiguous_strides(node.shape) for name, node in plan.saved.items()}


def _reached_through_floats(roots: list[GraphNode], needs: set[int]) -> set[int]:
    """Nodes a gradient could flow to from `roots` along differentiable values only (eager
    gives zeros where such a path crosses round() or floor(), nothing where it crosses a
    comparison)."""
    reached, stack = set(), [r for r in roots if id(r) in needs]
    while stack:
        node = stack.pop()
        if id(node) in reached:
            continue
        reached.add(id(node))
        stack.extend(s for s in node.src if id(s) in needs)
    return reached


# -- the reverse sweep -----------------------------------------------------------------------------
class _Recompute:
    """value(n): forward node n rebuilt in the backward builder from the forward's inputs,
    or read from what the forward saved."""

    def __init__(self, vb: ValueBuilder, saved: dict[int, str], output_strides: Optional[dict] = None,
                 copies: Optional[dict[int, GraphNode]] = None, view_sources: Optional[dict] = None,
                 compact_shapes: Optional[dict[str, tuple[int, ...]]] = None):
        """output_strides: the layout each forward output is returned in (eager's, not always
        contiguous): a saved output is read in it. copies: see _saved_copies; a value with a
        saved copy is read from the copy. view_sources: Graph.view_sources; a node that
        computes a view of a value from the value's leaves is built as that view of the
        value, as the value is got (a saved copy of a residual stream's value, read through
        the view that picks a norm's shift, rather than the stream recomputed from every
        layer below). compact_shapes: the saved values kept compact (see _Compacting), by name:
        the shape they are kept in, read back broadcast to the value's."""
        self.vb, self.saved, self.output_strides = vb, saved, output_strides or {}
        self.compact_shapes = compact_shapes or {}
        self.copies = copies or {}
        self.view_sources = view_sources or {}
        self._viewing: set[int] = set()  # nodes being built as views of their sources
        self.memo: dict[int, GraphNode] = {}
        # the values rebuilt whole to be viewed: the backward builds each before the view is
        # pushed into it, so what they read is read (the plan's cut must cover it)
        self.viewed_values: list[GraphNode] = []
        # forward values a library call's derivative formula reads (note_operand): read, even
        # where the formula's work on one comes out equal to another value's copy (the
        # transpose of a product's operand x[:70].t() is x[:70]), which the cut would otherwise
        # take for the read, while the backward built on saved values rebuilds the operand
        self.operands: list[GraphNode] = []

    def note_operand(self, node: GraphNode) -> None:
        self.operands.append(node)

    def _view_of(self, node: GraphNode) -> Optional[tuple]:
        """(value, view) when node computes a view of a value and is not kept itself."""
        if id(node) in self.saved or id(node) in self.copies:
            return None
        found = self.view_sources.get(id(node))
        # (hash-consing can make two values views of each other: a squeeze of an unsqueeze)
        return None if found is None or id(found[0]) in self._viewing else found

    def __call__(self, node: GraphNode) -> GraphNode:
        found = self.memo.get(id(node))
        if found is not None:
            return found
        done = lambda n: id(n) in self.memo or id(n) in self.saved or id(n) in self.copies or \
            self._view_of(n) is not None  # noqa: E731
        for n in toposort([node], stop=done):
            if id(n) in self.memo:
                continue
            viewed = self._view_of(n)
            if viewed is not None:
                self._viewing.add(id(n))
                try:
                    whole = self(viewed[0])
                    self.viewed_values.append(whole)
                    copy = self.vb.view(whole, viewed[1])
                finally:
                    self._viewing.discard(id(n))
            elif id(n) in self.copies and id(n) not in self.saved:
                copy = self(self.copies[id(n)])  # (saved: read as an input, no deeper)
                if copy.shape != n.shape:  # (a copy written for a reshape of n: _saved_copies)
                    copy = self.vb.view(copy, ("reshape", n.shape))
            elif id(n) in self.saved:
                name = self.saved[id(n)]
                copy = self.vb.b.input(name, n.dtype, _saved_view(n, self.output_strides.get(name),
                                                                  self.compact_shapes.get(name)))
            elif isinstance(n.op, Input):
                copy = self.vb.b.input(n.op.name, n.dtype, n.view, n.op.version)
            elif isinstance(n.op, Elementwise) and n.op.op == "index_in_range":
                copy = self.memo[id(n.src[0])]  # (the forward checked it: the backward runs after it did)
            else:
                copy = self.vb.b.node(n.op, n.dtype, [self.memo[id(s)] for s in n.src], n.view)
            self.memo[id(n)] = copy
            if isinstance(self.vb, _ViewTracking):
                self.vb.note_origin(copy, [n])
        return self.memo[id(node)]


class _ViewTracking(ValueBuilder):
    """A builder that knows which nodes are forward values (recomputed) or views of them,
    so the cut sees a view of a cast of a total as a read of the cast, not of the total the
    view was pushed through.

    One node can stand for several forward values: the builder merges equal nodes, and a
    view pushed through elementwise ops (a view of an exp is the exp of a view) can be the
    recomputed copy of another forward value. A read of it is a read of each: the real
    backward, built on saved values, rebuilds each from its own sources."""

    def __init__(self):
        super().__init__(indices_checked=True)
        self.origin: dict[int, list[GraphNode]] = {}  # backward node -> the forward values it is (a view of)

    def note_origin(self, node: GraphNode, forward: list[GraphNode]) -> None:
        found = self.origin.setdefault(id(node), [])
        found.extend(f for f in forward if all(f is not g for g in found))

    def view(self, node: GraphNode, desc) -> GraphNode:
        found = super().view(node, desc)
        if id(node) in self.origin:
            self.note_origin(found, self.origin[id(node)])
        return found


def _saved_view(node: GraphNode, strides: Optional[tuple[int, ...]] = None,
                 compact_shape: Optional[tuple[int, ...]] = None) -> View:
    """How the backward reads a saved value: an input as the caller passed it, an output in
    the layout it is returned in, an intermediate (or a copy of an input written in place) as
    the tape holds it; one kept compact (compact_shape) broadcast along the axes it was
    compacted on."""
    if isinstance(node.op, Input) and strides is None:
        return node.view
    view = View(node.shape, tuple(strides)) if strides is not None else View.contiguous(node.shape)
    if compact_shape is not None:
        view = View(node.shape, tuple(0 if kept == 1 else st for kept, st in zip(compact_shape, view.strides)))
    return view


def _needs_grad(graph: Graph, grad_inputs: set[str]) -> set[int]:
    needs = set()
    for node in graph.nodes():
        if not (differentiable(node) or node.dtype.is_complex) or \
                isinstance(node.op, Elementwise) and node.op.op == "stop_gradient":
            continue  # (complex values carry gradients too: autograd/complex.py, library calls only)
        if isinstance(node.op, Input) and node.op.name in grad_inputs or any(id(s) in needs for s in node.src):
            needs.add(id(node))
    return needs


def _sweep(alg: Algebra, plan: AutogradPlan, layouts: dict[str, GradLayout], value: _Recompute,
           needs: set[int]) -> dict[str, tuple[Optional[GraphNode], list[ScatterGrad]]]:
    """Gradients of the grad inputs, given each differentiable output's incoming gradient:
    per input, its dense part (or None) and the scatter-adds into it."""
    pending: dict[int, list[GraphNode]] = {}
    for name in plan.differentiable_outputs:
        layout = layouts.get(name)
        if layout is None:
            continue
        node = plan.graph.outputs[name]
        shape, strides, dtype = layout
        view = View(tuple(shape), tuple(strides)) if strides is not None else View.contiguous(shape)
        incoming = alg.vb.b.input(incoming_grad_name(name), DType.from_torch(dtype), view)
        pending.setdefault(id(node), []).append(alg.cast(incoming, node.dtype))
    found = {}
    depths: dict[int, int] = {}  # (memo of accumulate.depth)
    roots = [plan.graph.outputs[name] for name in plan.differentiable_outputs]
    wanted = lambda s: id(s) in needs  # noqa: E731

    def settle(node: GraphNode) -> Optional[GraphNode]:
        """The node's gradient (its contributions' total), None if it has none or it is an
        input (whose gradient is found) or its scatter-adds moved on to its source."""
        contributions = pending.pop(id(node), None)
        if not contributions or id(node) not in needs or node.view.numel == 0:
            return None  # (a value with no elements passes no gradient on: its sources' part is zero)
        dense = [c for c in contributions if isinstance(c, GraphNode)]
        scattered = [c for c in contributions if isinstance(c, ScatterGrad)]
        if isinstance(node.op, Input):  # (and its reads after writes autograd does not see: every version)
            found.setdefault(node.op.name, ([], [], node.dtype))[0].extend(dense)
            found[node.op.name][1].extend(scattered)
            return None
        for s in scattered:  # moved back through views and copies to the input they read
            moved = scatter_into_source(alg, node, s)
            if moved is None:  # a computed value: the scatter-add is part of its gradient
                dense.append(scatter_added(alg, node, [s]))
            else:
                pending.setdefault(id(node.src[0]), []).append(moved)
        return total_gradient(alg, dense, node.dtype, depths) if dense else None

    # a value computed again in another layout (a norm's output permuted for a linear,
    # nn.MultiheadAttention's [t, b, d]) passes its gradient on to the value, so the value's
    # gradient is one sum, differentiated once (as eager's): one set of row statistics and
    # weight-gradient totals, not one per layout. (Graph.view_sources names values of the
    # graph only, whose gradients the sweep settles.)
    forward, as_views = _sweep_order(roots, lambda n: _permuted_from(n, plan.graph.view_sources, needs))
    order = list(reversed(forward))
    # results of a call whose gradients are taken jointly: at the last of them (in this order
    # every use of every one of them has given its contribution by then)
    last = {id(n.op.call): n for n in order if takes_joint_gradient(n)}
    held: dict[int, list[tuple[GraphNode, GraphNode]]] = {}
    for node in order:
        grad = settle(node)
        if takes_joint_gradient(node):
            call = node.op.call
            if grad is not None:
                held.setdefault(id(call), []).append((node, grad))
            if last[id(call)] is not node or not held.get(id(call)):
                continue
            grads = joint_library_call_gradient(alg.vb, held.pop(id(call)), value, wanted)
        elif grad is None:
            continue
        elif id(node) in as_views:
            viewed, undo = as_views[id(node)]
            for desc in undo:
                grad = alg.vb.view(grad, desc)
            pending.setdefault(id(viewed), []).append(grad)
            continue
        else:
            grads = complex_vjp(alg.vb, node, grad, value, wanted) if touches_complex(node) else \
                vjp(alg, node, grad, value, wanted)
        for src, g in zip(node.src, grads):
            if g is not None and id(src) in needs:
                pending.setdefault(id(src), []).append(g)
    return {name: (total_gradient(alg, dense, dtype, depths), scattered)
            for name, (dense, scattered, dtype) in found.items()}


def _permuted_from(node: GraphNode, view_sources: dict, needs: set[int]) -> Optional[tuple[GraphNode, list]]:
    """(value, the views that undo node's) when node computes a permutation, reshape or flip
    of another value from that value's leaves (Graph.view_sources): one that keeps every
    element once (inverse_views), so its gradient is the value's, viewed."""
    found = view_sources.get(id(node))
    if found is None or node.dtype.is_complex or id(node) not in needs or id(found[0]) not in needs:
        return None
    value, desc = found
    undo = inverse_views(value.shape, (desc,))
    viewed = apply_view_desc(View.contiguous(value.shape), desc)
    if undo is None or viewed is None or viewed.shape != node.shape or value.dtype != node.dtype:
        return None
    return value, undo


def _sweep_order(roots: list[GraphNode], view_of: Callable[[GraphNode], Optional[tuple[GraphNode, list]]]
                 ) -> tuple[list[GraphNode], dict[int, tuple[GraphNode, list]]]:
    """The forward's nodes, producers first, each node that is a view of a value (view_of)
    after that value (the sweep must settle the node's gradient before the value's), and
    those views by node id. If the order puts a node before one of its sources or its value
    (hash-consing can make two values views of each other: a cycle), no view is taken: a
    contribution must never arrive after its node is settled."""
    views = {}

    def after(node: GraphNode) -> tuple[GraphNode, ...]:
        entry = view_of(node)
        if entry is None:
            return node.src
        views[id(node)] = entry
        return (*node.src, entry[0])

    order = toposort(roots, sources=after)
    position = {id(n): k for k, n in enumerate(order)}
    if all(position[id(s)] < k for k, n in enumerate(order) for s in n.src) and \
            all(position[id(value)] < position[key] for key, (value, _) in views.items()):
        return order, views
    return toposort(roots), {}


# -- what the forward keeps ---------------------------------------------------------------------------
INFINITE = 1 << 62


def _read_by_backward(roots: list[GraphNode], origin: dict[int, list[GraphNode]]) -> list[GraphNode]:
    """Forward nodes whose recomputed copies the gradient formulas read directly."""
    copies = [r for r in roots if id(r) in origin]
    for node in toposort(roots, stop=lambda n: id(n) in origin):
        if id(node) not in origin:
            copies += [s for s in node.src if id(s) in origin]
    return list({id(f): f for copy in copies for f in origin[id(copy)]}.values())


def _choose_saved(plan: AutogradPlan, read: list[GraphNode], mutated: dict[str, int]) -> None:
    """mutated: the inputs written in place, with their last versions: their values from
    before the last write cannot be kept by reference (an input whose new contents are a
    result is kept as a copy, like an intermediate).

    Two cuts where some value could be kept compact (_constant_axes): with and without
    compact values. The cut's costs count an input kept by reference at its bytes (so that
    ties go to the inputs), though the tape holds nothing for it: a compact row statistic can
    then win a cut that keeps full-size intermediates instead of the residual stream's input
    (more tape, fewer loads). The one whose tape is smaller is taken (ties: without)."""
    graph = plan.graph
    written = _written(graph)
    output_of = {id(node): name for name, node in graph.outputs.items()}
    order = toposort(read)
    none = {id(n): frozenset() for n in order}
    costs = lambda constant: {id(n): _cost(n, output_of, mutated, written, constant[id(n)]) for n in order}  # noqa: E731
    constant, kept = none, _minimum_cut(order, read, costs(none), mutated)
    if kept is None:  # the formulas read no forward value at all
        return
    found = _constant_axes(order)
    if any(found.values()):
        compacted = _minimum_cut(order, read, costs(found), mutated)
        tape = lambda cut, constant: sum(_tape_bytes(n, constant[id(n)], output_of, written) for n in cut)  # noqa: E731
        if tape(compacted, found) < tape(kept, none):
            constant, kept = found, compacted
    saved_outputs, saved_inputs, compact = [], [], set()
    compacting = _Compacting()
    for node in kept:
        key = id(node)
        if isinstance(node.op, Input) and node.op.name not in written:
            saved_inputs.append(node.op.name)
            plan._saved_ids[key] = node.op.name
        elif key in output_of:
            saved_outputs.append(output_of[key])
            plan._saved_ids[key] = output_of[key]
        else:
            name = f"{SAVED_PREFIX}{len(plan.saved)}"
            plan.saved[name] = compacting(node, constant[key]) if constant[key] else node
            plan._saved_ids[key] = name
            if constant[key]:
                compact.add(name)
    plan.saved_inputs, plan.saved_outputs = tuple(saved_inputs), tuple(saved_outputs)
    plan.compact = frozenset(compact)


def _minimum_cut(order: list[GraphNode], read: list[GraphNode], cost: dict[int, int], mutated: dict[str, int]
                 ) -> Optional[list[GraphNode]]:
    """The nodes (in `order`) a minimum cut in `cost` keeps, between the forward's inputs and
    the values the gradient formulas `read`; None if they read no forward value."""
    import networkx as nx  # (here: importing it costs 0.15 s, which a call without gradients need not pay)
    flow = nx.DiGraph()
    for node in order:
        flow.add_edge(("in", id(node)), ("out", id(node)), capacity=cost[id(node)])
        for s in node.src:
            flow.add_edge(("out", id(s)), ("in", id(node)))  # no capacity: never cut
        if isinstance(node.op, Input) or isinstance(node.op, Dot) and not node.op.recomputed or \
                _is_total(node) or _is_library_result(node) or _is_kept_buffer(node):
            # a total, a matrix product, a library call's result or a buffer: saved (or what
            # it feeds), never recomputed (a product would cost the backward its multiply-adds
            # again, as a library call's would), but for a product marked recomputed (Dot) and
            # a buffer of elementwise math over library results (_is_kept_buffer)
            flow.add_edge("inputs", ("in", id(node)))
    for node in read:
        flow.add_edge(("out", id(node)), "backward")
    if "inputs" not in flow:
        return None
    # (Boykov-Kolmogorov: 5x faster than the default preflow-push on a 16-layer transformer's
    # graph; the source side, what the residual graph reaches from the source, is the same
    # for every maximum flow)
    cut, (reachable, _) = nx.minimum_cut(flow, "inputs", "backward", flow_func=nx.algorithms.flow.boykov_kolmogorov)
    if cut >= INFINITE:
        raise UnsupportedOpError("in-place write", f"the backward needs values of input(s) {sorted(mutated)} from "
                                 "before the function wrote into them")
    return [n for n in order if ("in", id(n)) in reachable and ("out", id(n)) not in reachable]


def _tape_bytes(node: GraphNode, constant: frozenset[int], output_of: dict[int, str], written: set[str]) -> int:
    """Bytes the tape holds to keep a node: none for an input kept by reference or an output
    (the caller's), a compact node's (constant along `constant`) for one kept compact."""
    if isinstance(node.op, Input) and node.op.name not in written or id(node) in output_of:
        return 0
    return math.prod(_compact_shape(node.shape, constant)) * node.dtype.itemsize


def _compact_shape(shape: tuple[int, ...], axes: frozenset[int]) -> tuple[int, ...]:
    """The shape a value constant along `axes` is kept in: 1 along them."""
    return tuple(1 if d in axes else size for d, size in enumerate(shape))


def _constant_axes(order: list[GraphNode]) -> dict[int, frozenset[int]]:
    """Per node (producers first in `order`), the axes longer than 1 along which its value
    is the same by construction: a view's or coordinate's that step 0 along them, and an
    elementwise op's that all its operands are constant along (a batch norm's per-channel
    mean and inverse std, broadcast over batch and pixels). Saved for the backward, such a
    value is kept compact (_Compacting): its bytes are those of one element along them, as
    eager saves a norm's statistics."""
    found: dict[int, frozenset[int]] = {}
    for node in order:
        if isinstance(node.op, (ViewOp, Iota)):
            axes = frozenset(d for d, (size, stride) in enumerate(zip(node.shape, node.view.strides))
                             if size > 1 and stride == 0)
        elif isinstance(node.op, Elementwise) and node.src:
            axes = frozenset.intersection(*(found.get(id(s), frozenset()) for s in node.src))
        else:
            axes = frozenset()
        found[id(node)] = axes
    return found


class _Compacting:
    """node, axes -> the node's value with 1 along those axes (where it is constant:
    _constant_axes): its expression rebuilt over views that read one element along them."""

    def __init__(self):
        self.builder = GraphBuilder()

    def __call__(self, node: GraphNode, axes: frozenset[int]) -> GraphNode:
        shape = _compact_shape(node.shape, axes)
        memo: dict[int, GraphNode] = {}
        for n in toposort([node], stop=lambda n: not isinstance(n.op, Elementwise)):
            if isinstance(n.op, Elementwise):
                memo[id(n)] = self.builder.node(n.op, n.dtype, tuple(memo[id(s)] for s in n.src),
                                                View.contiguous(shape))
                continue
            view = View(shape, n.view.strides, n.view.offset)
            base = n.src[0] if isinstance(n.op, ViewOp) else None
            if base is not None and base.shape == shape and view.is_contiguous() and base.view.is_contiguous():
                memo[id(n)] = base  # (a row statistic's broadcast read: the statistic itself)
            else:
                memo[id(n)] = self.builder.node(n.op, n.dtype, n.src, view)
        return memo[id(node)]


def _is_total(node: GraphNode) -> bool:
    """A reduction (a loss's mean, a norm's row statistics, softmax's row max and sum).
    Recomputing it would cost the backward a pass over its whole source, and a kernel level
    before any element can use it (a norm's variance waits for its mean); saving it costs
    its bytes, a fraction of its source's (eager saves a norm's mean and rstd too)."""
    return isinstance(node.op, Reduce) and node.view.numel < node.src[0].view.numel


def _is_library_result(node: GraphNode) -> bool:
    """A library call's result computed from operands: recomputing it would run the call
    again (a matmul, a sort) in the backward; saving it costs its bytes."""
    return isinstance(node.op, Extern) and bool(node.src)


def _is_kept_buffer(node: GraphNode) -> bool:
    """A value the forward writes to memory anyway (a library call's operand): keeping it
    costs no store, and recomputing it would cost the backward a kernel that writes it again
    when the backward hands it to a library call too (a linear's input, for the weight's
    gradient). But for elementwise math over library results of its size (an MLP's
    gelu(x @ w1 + b1), the second linear's input): those results are saved anyway where the
    math's own gradient reads them (gelu's derivative reads x @ w1 + b1), so the cut may keep
    them alone and the backward write the value again right before the call that reads it
    (fusion._sink_buffers), rather than the tape holding both from the forward on, the
    first layer's until the backward's end (the zoo's training-step peaks: Llama -7%, the
    MLP-Mixer -7%, ViT -2%, GPT-2 -1%, for a pointwise kernel more per MLP block)."""
    return isinstance(node.op, Contiguous) and not _elementwise_of_library_results(node)


def _elementwise_of_library_results(node: GraphNode) -> bool:
    """A dense buffer (not a scatter's) of elementwise math and views over library results
    of its own number of elements, and literals."""
    if type(node.op) is not Contiguous:
        return False
    through = lambda n: isinstance(n.op, (Elementwise, ViewOp))  # noqa: E731
    leaves = [n for n in toposort(node.src, stop=lambda n: not through(n)) if not through(n)]
    results = [n for n in leaves if _is_library_result(n)]
    literals = [n for n in leaves if not n.src and not isinstance(n.op, Input)]
    return bool(results) and len(results) + len(literals) == len(leaves) and \
        all(n.view.numel == node.view.numel for n in results)


def _cost(node: GraphNode, output_of: dict[int, str], mutated: dict[str, int], written: set[str],
          constant: frozenset[int] = frozenset()) -> int:
    """Bytes to keep the node for backward, scaled so ties prefer inputs (but those written in
    place, kept as copies), then outputs, then buffers the forward wrote, then other
    intermediates, then those kept compact
    (constant along some axes: _constant_axes)."""
    if isinstance(node.op, Input) and node.op.version < mutated.get(node.op.name, -1):
        return INFINITE
    if not node.src and not isinstance(node.op, Input):  # literals are never saved
        return INFINITE
    if node.dtype.library_only and not isinstance(node.op, (Input, Extern)) and id(node) not in output_of:
        return INFINITE  # a view of a complex value: no kernel can copy it out; its source is saved
    kept_by_reference = isinstance(node.op, Input) and node.op.name not in written
    # (a buffer before another intermediate: the forward wrote it, and the backward need not)
    preference = 0 if kept_by_reference else 1 if id(node) in output_of else 2 if isinstance(node.op, Contiguous) else 3
    numel = node.view.numel
    if preference >= 2 and constant:  # (after a value of its size it is computed from: a row's max)
        numel, preference = math.prod(_compact_shape(node.shape, constant)), 4
    return (numel * node.dtype.itemsize) * 1000 + preference

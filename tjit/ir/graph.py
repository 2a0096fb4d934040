"""The graph IR: immutable nodes (op, dtype, src, view) and a Graph of named inputs,
named outputs and input mutations.

Nodes are hash-consed by a GraphBuilder, so building the same expression twice gives the
same node (common subexpressions are free) and nodes compare by identity, which keeps
hashing O(1) however deep the DAG is.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from .dtype import DType
from .strategy import AxisStrategy
from .view import View

Scalar = Union[bool, int, float]
Strategies = Optional[tuple[AxisStrategy, ...]]


# -- ops -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Input:
    name: str
    version: int = 0  # bumped by each in-place write to the input; reads see that version


@dataclass(frozen=True)
class Const:
    value: Scalar


@dataclass(frozen=True)
class ViewOp:
    """Reads src's buffer through node.view (index -> element offset in that buffer)."""


@dataclass(frozen=True)
class Contiguous:
    """Materialises src as a dense row-major buffer (a kernel boundary)."""
    axis_strategies: Strategies = None


@dataclass(frozen=True)
class Scatter(Contiguous):
    """index_put: materialises src[0] as a dense row-major buffer, as Contiguous does, then
    writes src[2] into it (or adds it: `accumulate`) at the element offsets src[1] (int64, of
    src[2]'s shape; -1 marks an index that was out of range). Two kernels: the first fills
    the buffer, the second writes the values (`checked`: reporting an offset of -1 as an
    error). Offsets that repeat keep one of their values unless accumulated, as on a GPU."""
    accumulate: bool = False
    checked: bool = True
    what: str = "index_put"


def copies_its_source(node: "GraphNode") -> bool:
    """Whether node's buffer holds exactly its source's values (a Contiguous), so a read of
    one may stand for the other. Not a Scatter's: it holds src[0] with values written over
    it, though it is a Contiguous too."""
    return isinstance(node.op, Contiguous) and not isinstance(node.op, Scatter)


@dataclass(frozen=True)
class Elementwise:
    op: str  # a name in the op registry, tjit.ir.ops.OPS
    axis_strategies: Strategies = None


@dataclass(frozen=True)
class Reduce:
    """Reduces src over `axes`; the result keeps them as size-1 axes (keepdim), so it
    broadcasts back over src's shape with a plain expand view. `op` is one of
    REDUCE_OPS; max/min propagate NaN, argmax/argmin give int64 indices (first wins).
    `grad_to_first`: the gradient of max/min goes to the first extreme (torch.max(x, dim)),
    not shared among ties (amax, torch.max(x))."""
    op: str
    axes: tuple[int, ...]
    axis_strategies: Strategies = None
    grad_to_first: bool = False


@dataclass(frozen=True)
class Cumulative:
    op: str
    axis: int
    axis_strategies: Strategies = None


@dataclass(frozen=True)
class Gather:
    """out[i] = table[i with coordinate `axis` replaced by index[i]]: the one data-dependent
    read of the IR (gather, embedding, index_select, x[idx]). src = (table, index): the table
    is a leaf read from memory whose shape equals out's except along `axis`; index has out's
    shape. An index outside [0, table size) (or [-size, size) with `wrap_negative`) is an
    error the kernel reports, and is never used as an address."""
    axis: int
    wrap_negative: bool = False
    what: str = "gather"  # the user's op, for the error message
    checked: bool = True  # False: the index is in range by construction (repeat), no check is made
    # a line of storage for a table, the index an element's offset there (several coordinates): the
    # view (of the line's memory) whose elements' offsets the index holds, which bounds the addresses read
    flat: Optional[View] = None


@dataclass(frozen=True)
class Iota:
    """A leaf that reads no memory: its value at index i is the offset its view maps i to,
    view.offset + sum(i_k * stride_k), in the node's integer type (arange, a coordinate).
    Movement ops apply to the view as for an input, so they cost nothing."""


@dataclass(frozen=True)
class Window:
    """out[i] = src[i - low] where i - low is an index of src on every axis, else `fill`: a
    read at a shifted coordinate (constant_pad_nd, each operand of cat). src[0] is a leaf
    read from memory (an input, a buffer, a call's result or a view of one) and is read at
    addresses its own view does not reach, only where they hold src's elements; the
    node's shape is out's."""
    low: tuple[int, ...]  # per axis: the out index of src's element 0 (a pad before it)
    fill: Scalar


@dataclass(frozen=True)
class Dot:
    """out[..., m, n] = sum over k of a[..., m, k] * b[..., k, n], src = (a, b): a matrix
    product over the last two axes, batched over the others (a broadcast batch axis is a
    stride-0 axis of an operand's view). Both operands are leaves read from memory, of one
    floating type; the node's type is float32, the accumulator's (the frontend casts the
    result to torch's type, after the fused epilogue). Lowered to tl.dot over tiles of m
    and n with k looped (lower/codegen.py), in a kernel of its own domain (lower/domains.py).

    `recomputed`: the backward computes it again from its operands instead of reading it
    saved (autograd/backward.py's cut): the frontend sets it on a product a reduction of its
    rows reads, larger than its operands, which are memory (cross-entropy's logits,
    attention's scores): no forward kernel then needs to write it."""
    recomputed: bool = False


@dataclass(frozen=True, eq=False)
class ExternCall:
    """One call of an aten op that tjit does not generate: at run time the op itself runs (a
    library call: cuBLAS, a sort, ... ) on its operands' memory. `args`/`kwargs` are the
    call's arguments with each tensor operand replaced by `Operand(k)`, the node's src[k].

    An op that writes some of its operands in place (bernoulli_, a batch norm's running
    statistics) runs functionalised: the operands in `writes` are copied first, the op
    writes the copies, and the copies are results of the call after the op's own."""
    target: Any  # the aten OpOverload
    args: tuple
    kwargs: dict
    writes: tuple[int, ...] = ()  # operand indices the op writes in place
    # a call that returns nothing (a check): each input's version where eager runs it; a later
    # write into an input waits for the check, which eager never reaches if the check raises
    versions: tuple[tuple[str, int], ...] = ()
    # a random op whose derivative runs it again: the operand holding the seed it runs with
    # (drawn by a call of its own), so the derivative draws the same numbers
    seed: Optional[int] = None
    # the call's result nodes by index, as the frontend made them: the gradient of one result
    # may read the others (a sort's indices) as the forward computed them
    results: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def name(self) -> str:
        return str(self.target)


@dataclass(frozen=True)
class Operand:
    """Placeholder for tensor operand k of an ExternCall (src[k] of each of its nodes)."""
    index: int


def bind_operands(value, operands: Sequence):
    """A call's arguments (or one of them) with each Operand replaced by operands[index], in
    lists and tuples too (cat's). Plain lists, tuples and dicts are walked directly: through
    pytree this cost tens of microseconds per library call."""
    if isinstance(value, Operand):
        return operands[value.index]
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(bind_operands(v, operands) for v in value)
    if kind is dict:
        return {k: bind_operands(v, operands) for k, v in value.items()}
    if isinstance(value, (tuple, list, dict)):  # (a namedtuple or another container type)
        from torch.utils._pytree import tree_map
        return tree_map(lambda v: operands[v.index] if isinstance(v, Operand) else v, value)
    return value


@dataclass(frozen=True)
class Extern:
    """Tensor result `index` (in pytree order) of an ExternCall. The node's src are the
    call's tensor operands, each read from memory (an input, a buffer or another call's
    result, possibly through a view); its view is the layout torch gives the result.

    A call that returns nothing (a check that raises on bad data) has one node with index
    None: no tensor, only the call having run; the graph keeps it among its effects."""
    call: ExternCall
    index: Optional[int]


GraphOp = Union[Input, Const, ViewOp, Contiguous, Scatter, Elementwise, Reduce, Cumulative, Gather, Extern, Iota, Window,
                Dot]


@dataclass(frozen=True, eq=False)
class GraphNode:
    op: GraphOp
    dtype: DType
    src: tuple["GraphNode", ...]
    view: View  # for ViewOp / Input: how the buffer is read; else the dense output layout

    @property
    def shape(self) -> tuple[int, ...]:
        return self.view.shape

    @property
    def is_literal(self) -> bool:
        """A literal or a view of one: every element is the same value, and no memory holds it."""
        return isinstance(self.op, Const) or isinstance(self.op, ViewOp) and isinstance(self.src[0].op, Const)

    @property
    def is_leaf(self) -> bool:
        """Leaves are read from memory (or are literals) inside a kernel. A view of a
        reduction's result is not: the kernel that reduces may hold it in registers."""
        if isinstance(self.op, ViewOp):
            return not isinstance(self.src[0].op, (Reduce, Cumulative, Gather))
        return isinstance(self.op, (Input, Const, Extern, Iota))


@dataclass(frozen=True)
class Mutation:
    """An in-place write of `value` into input `name` through `view`, producing `version`.
    unseen: a write eager's autograd does not see (through x.detach(), or under no_grad):
    an input requiring grad keeps its history, and stays a leaf where it is one."""
    name: str
    view: View
    value: GraphNode
    version: int
    unseen: bool = False


@dataclass
class Graph:
    input_names: tuple[str, ...]
    outputs: dict[str, GraphNode]
    mutations: tuple[Mutation, ...] = ()
    # Inputs are held weakly: the graph is kept alive by what it computes, not by its inputs.
    # Per name, its nodes in the order made (an input written in place is read at each version)
    _inputs: dict[str, tuple["weakref.ref[GraphNode]", ...]] = field(default_factory=dict, repr=False)
    effects: tuple[GraphNode, ...] = ()  # calls that return nothing, run for their checks (Extern index None)
    # id of a node that computes a view of another value from that value's leaves (the view
    # was pushed into the value's expression) -> (the value, the view): the backward builds
    # it as that view of the value, which a saved copy may hold (autograd/backward.py)
    view_sources: dict[int, tuple[GraphNode, tuple]] = field(default_factory=dict, repr=False)
    # id of such a node -> [(a value of this graph it is a view of, the views that make its
    # value from that value's, in order)], nearest first, through values that are not nodes
    # of the graph (a slice of a sum of residual-stream terms is the sum of their slices):
    # a kernel reads it through those views from the value's buffer, if one is written
    # (lower/fusion.py), rather than computing it again from every term
    view_chains: dict[int, list[tuple[GraphNode, tuple]]] = field(default_factory=dict, repr=False)

    def input_node(self, name: str) -> Optional[GraphNode]:
        """The input's first node that the graph still holds (None if it holds none)."""
        return next(iter(self.input_nodes(name)), None)

    def input_nodes(self, name: str) -> list[GraphNode]:
        """The input's nodes that the graph still holds: one per version read."""
        return [node for node in (ref() for ref in self._inputs.get(name, ())) if node is not None]

    def roots(self) -> list[GraphNode]:
        return list(self.outputs.values()) + [m.value for m in self.mutations] + list(self.effects)

    def nodes(self) -> list[GraphNode]:
        return toposort(self.roots())

    def __str__(self) -> str:
        return format_graph(self)

    # (pickled into the disk cache, runtime/disk_cache.py: the inputs held weakly are written as
    # the nodes themselves, which the graph's other fields hold too)
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_inputs": {n: self.input_nodes(n) for n in self._inputs}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._inputs = {n: tuple(weakref.ref(node) for node in nodes) for n, nodes in state["_inputs"].items()}


class GraphBuilder:
    """Creates hash-consed nodes for one graph."""

    def __init__(self):
        self._interned: dict[tuple, GraphNode] = {}
        self._inputs: dict[str, list[GraphNode]] = {}

    def node(self, op: GraphOp, dtype: DType, src: Sequence[GraphNode], view: View) -> GraphNode:
        key = (op, dtype, tuple(id(s) for s in src), view)
        found = self._interned.get(key)
        if found is None:
            found = self._interned[key] = GraphNode(op, dtype, tuple(src), view)
        return found

    def adopt(self, node: GraphNode) -> GraphNode:
        """node, made by another builder, as this builder's node of its key (the one it
        already has, if any)."""
        return self._interned.setdefault((node.op, node.dtype, tuple(id(s) for s in node.src), node.view), node)

    def input(self, name: str, dtype: DType, view: View, version: int = 0) -> GraphNode:
        node = self.node(Input(name, version), dtype, (), view)
        made = self._inputs.setdefault(name, [])
        if not any(n is node for n in made):
            made.append(node)
        return node

    def const(self, value: Scalar, dtype: DType) -> GraphNode:
        return self.node(Const(value), dtype, (), View((), ()))

    def finish(self, input_names: Iterable[str], outputs: dict[str, GraphNode],
               mutations: Sequence[Mutation] = (), effects: Sequence[GraphNode] = ()) -> Graph:
        graph = Graph(tuple(input_names), dict(outputs), tuple(mutations), effects=tuple(effects))
        graph._inputs = {n: tuple(weakref.ref(node) for node in nodes) for n, nodes in self._inputs.items()}
        return graph


def value_graph(graph: Graph) -> Graph:
    """The graph with each straight_through(surrogate, value) replaced by its value: what
    kernels compute. The surrogate is there for the gradient only (autograd differentiates
    the graph itself, before this); computed, it would cost a kernel work and loads for
    nothing, and hide a looped variance's form from the Welford pass that reads its input
    once (lower/reduction.py)."""
    order = graph.nodes()
    if not any(_is_straight_through(n) for n in order):
        return graph
    builder, new = GraphBuilder(), {}
    for node in order:
        if _is_straight_through(node):
            new[id(node)] = new[id(node.src[1])]
        elif any(new[id(s)] is not s for s in node.src):
            new[id(node)] = builder.node(node.op, node.dtype, [new[id(s)] for s in node.src], node.view)
        else:
            new[id(node)] = builder.adopt(node)
    moved = lambda n: new.get(id(n), n)  # noqa: E731
    return Graph(graph.input_names, {name: moved(n) for name, n in graph.outputs.items()},
                 tuple(replace(m, value=moved(m.value)) for m in graph.mutations), graph._inputs,
                 tuple(moved(n) for n in graph.effects),
                 {id(new[key]): (moved(value), desc) for key, (value, desc) in graph.view_sources.items() if key in new},
                 {id(new[key]): [(moved(value), views) for value, views in chain]
                  for key, chain in graph.view_chains.items() if key in new})


def _is_straight_through(node: GraphNode) -> bool:
    return isinstance(node.op, Elementwise) and node.op.op == "straight_through"


def toposort(roots: Iterable[GraphNode], stop: Optional[Callable[[GraphNode], bool]] = None,
             sources: Optional[Callable[[GraphNode], Sequence[GraphNode]]] = None) -> list[GraphNode]:
    """Producers before consumers; an explicit stack so deep graphs do not recurse.
    Nodes for which `stop` holds are listed but their sources are not visited. `sources`:
    what a node comes after (its src by default)."""
    order, seen = [], set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            if stop is None or not stop(node):
                after = node.src if sources is None else sources(node)
                stack.extend((s, False) for s in reversed(after) if id(s) not in seen)
    return order


def per_node(walk: Callable[[GraphNode], list]) -> Callable[[GraphNode], list]:
    """`walk` computed once per node: nodes are immutable, so what a walk down from one finds
    never changes (lowering asks the same of a store's expression many times). The cache
    holds nodes weakly, and each call gets its own list."""
    found: "weakref.WeakKeyDictionary[GraphNode, tuple]" = weakref.WeakKeyDictionary()

    @functools.wraps(walk)
    def cached(node: GraphNode) -> list:
        result = found.get(node)
        if result is None:
            result = found[node] = tuple(walk(node))
        return list(result)
    return cached


def covered_memory(node: GraphNode) -> Optional[GraphNode]:
    """The memory (a buffer, or a library call's result) that the node is, or views whole,
    each element once (its dims reordered or reshaped); None for anything else."""
    base = node.src[0] if isinstance(node.op, ViewOp) else node
    if isinstance(base.op, (Contiguous, Extern)) and node.view.is_dense() and node.view.numel == base.view.numel:
        return base
    return None


# -- text form -------------------------------------------------------------------------
def describe_op(node: GraphNode) -> str:
    op = node.op
    if isinstance(op, Input):
        return f"input {op.name}" + (f"@v{op.version}" if op.version else "")
    if isinstance(op, Const):
        return f"const {op.value!r}"
    if isinstance(op, ViewOp):
        return "view"
    if isinstance(op, Scatter):
        return "scatter" + (".add" if op.accumulate else "") + ("" if op.checked else " unchecked")
    if isinstance(op, Contiguous):
        return "contiguous"
    if isinstance(op, Reduce):
        return f"reduce.{op.op} axes={list(op.axes)}"
    if isinstance(op, Cumulative):
        return f"cumulative.{op.op} axis={op.axis}"
    if isinstance(op, Gather):
        return f"gather axis={op.axis}" + ("" if op.checked else " unchecked")
    if isinstance(op, Iota):
        return "iota"
    if isinstance(op, Window):
        return f"window low={list(op.low)} fill={op.fill!r}"
    if isinstance(op, Dot):
        return "dot"
    if isinstance(op, Extern):
        return f"library {op.call.name}" + ("" if op.index is None else f"[{op.index}]")
    return op.op


def format_node(node: GraphNode, names: dict[int, str]) -> str:
    args = ", ".join(names[id(s)] for s in node.src)
    layout = ""
    if isinstance(node.op, (ViewOp, Input, Extern, Iota)) and not node.view.is_contiguous():
        layout = f" strides={list(node.view.strides)}" + (f" offset={node.view.offset}" if node.view.offset else "")
    strategies = getattr(node.op, "axis_strategies", None)
    forced = f" strategies={list(strategies)}" if strategies else ""
    return f"{names[id(node)]} = {describe_op(node)}({args}) : {node.dtype!r}{list(node.shape)}{layout}{forced}"


def format_graph(graph: Graph) -> str:
    names: dict[int, str] = {}
    lines = [f"graph({', '.join(graph.input_names)}) {{"]
    for k, node in enumerate(graph.nodes()):
        names[id(node)] = f"%{k}"
        lines.append("  " + format_node(node, names))
    for m in graph.mutations:
        lines.append(f"  {m.name}@v{m.version}[{m.view}] <- {names[id(m.value)]}")
    lines += [f"  check {names[id(node)]}" for node in graph.effects]
    outs = ", ".join(f"{name}={names[id(node)]}" for name, node in graph.outputs.items())
    lines.append(f"  return {outs}")
    lines.append("}")
    return "\n".join(lines)

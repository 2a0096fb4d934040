"""Group the graph's stores into kernels.

A store writes one value into memory: a graph output, a materialised (Contiguous)
buffer, or an in-place write into an input. Every store is a root whose expression DAG is
fused into the kernel that runs it; its leaves are loads (inputs, buffers) and literals.
Stores with the same iteration space and no ordering constraint between them share one
kernel, so a function's pointwise work over one shape is one kernel.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Union

from ..analysis.addresses import disjoint
from ..errors import TjitError
from ..ir import (Contiguous, Cumulative, Dot, Elementwise, Extern, ExternCall, Gather, Graph, GraphNode, Input, Mutation,
                  Reduce, Scatter, View, ViewOp, copies_its_source, per_node, toposort)
from ..frontend.build import apply_view_desc, inverse_views
from ..frontend.dot import accumulates_in_memory
from .domains import (Copies, Domain, Placement, aligned_permutation, domain_of_reduce, dots_in, is_kernel_input,
                      kernel_expression, nested_products, product_key, read_from_buffers, read_through, reduces_in,
                      reshaped_expression, splits_into, store_domain, totals_fit, totals_of)
from .hazards import gather_tables, reads_apart, reads_older_version, same_program_access, stage
from .online_product import online_product


@dataclass(frozen=True)
class OutputTarget:
    name: str


@dataclass(frozen=True)
class BufferTarget:
    node: GraphNode  # a Contiguous node: its buffer is dense in the node's shape


@dataclass(frozen=True)
class InputTarget:
    mutation: Mutation


@dataclass(frozen=True)
class ScatterTarget:
    """The second store of a Scatter node's buffer (the first, a BufferTarget, fills it):
    its value is a PutAt node, written at data-dependent element offsets. With a mutation:
    an in-place scatter into that input (x[i] = v), which holds the rest already: no buffer,
    no fill, no copy back."""
    node: GraphNode
    mutation: Optional[Mutation] = None


@dataclass(frozen=True)
class PutAt:
    """The value of a ScatterTarget store, and only that: src[1] written (or added) at the
    element offsets src[0]. Kernel-internal: no graph holds one."""


Target = Union[OutputTarget, BufferTarget, InputTarget, ScatterTarget]


@dataclass(eq=False)
class Store:
    target: Target
    value: GraphNode
    domain: Domain = None
    totals: tuple = ()  # grid reductions: the store is written once all programs are done
    # the target's own shape, when the value is computed in an axis split of it or in its
    # axes permuted by target_dims (the shape of the reduction it reads: see
    # in_reduction_shape); None when the value has the target's shape
    target_shape: Optional[tuple[int, ...]] = None
    target_dims: Optional[tuple[int, ...]] = None
    note: str = ""  # why the store is where it is, where explain should say (an in-place write's copies)
    # a row statistic (value: a Reduce node) that this product's k loop computes online
    # (lower/online_product.py): the product's kernel writes it (_host_online_statistics)
    online_of: Optional[GraphNode] = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape


@dataclass(eq=False)
class KernelGroup:
    domain: Domain
    stores: list[Store] = field(default_factory=list)
    level: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.domain.shape


@dataclass(eq=False)
class ExternStep:
    """A library call (see frontend/library.py): it runs after the kernels that write its
    operands and before those that read its results."""
    call: ExternCall
    operands: tuple[GraphNode, ...]
    results: list[GraphNode]  # the call's Extern nodes the graph reads
    level: int = 0


@per_node
def expression_leaves(value: GraphNode) -> list[GraphNode]:
    """The kernel inputs a store's fused expression reads."""
    return [n for n in kernel_expression(value) if is_kernel_input(n)]


def buffer_of(leaf: GraphNode) -> Optional[GraphNode]:
    """The Input, Contiguous or Extern node whose memory a leaf reads (None for literals)."""
    base = leaf.src[0] if isinstance(leaf.op, ViewOp) else leaf
    return base if isinstance(base.op, (Input, Contiguous, Extern)) else None


def collect_stores(graph: Graph, unstored: frozenset = frozenset()) -> list[Store]:
    """unstored: outputs that need no store (a library call's result, returned as it is)."""
    stores: list[Store] = []
    in_place = scatters_in_place(graph)
    for node in toposort(graph.roots()):
        if isinstance(node.op, Contiguous) and id(node) not in in_place:
            stores.append(Store(BufferTarget(node), node.src[0]))
        if isinstance(node.op, Scatter):
            offsets, values = node.src[1:]
            stores.append(Store(ScatterTarget(node, in_place.get(id(node))),
                                GraphNode(PutAt(), values.dtype, (offsets, values), View.contiguous(values.shape))))
    stores += [Store(OutputTarget(name), node) for name, node in graph.outputs.items() if name not in unstored]
    stores += [Store(InputTarget(m), m.value) for m in graph.mutations if id(m.value) not in in_place]
    for store in stores:  # what reads an in-place scatter's value reads the input it wrote
        store.value = _reading_written_inputs(store.value, in_place)
    return stores


def scatters_in_place(graph: Graph) -> dict[int, Mutation]:
    """Scatters that can write straight into the input they update (x[i] = v on an input):
    the scatter's base is the input as it was, through the view the write goes to, which is
    row-major (the offsets are row-major element offsets, and readers of the scatter's value
    read the input in its place); its values and indices read no version of that input
    (another program could have overwritten what they read); and no library call reads its
    value (a call's operands are memory of the graph's values, which an in-place scatter's
    has none of: it writes the input's)."""
    found = {}
    read_by_calls = {id(buffer_of(operand)) for node in toposort(graph.roots()) if isinstance(node.op, Extern)
                     for operand in node.src}
    for m in graph.mutations:
        node, base = m.value, m.value.src[0] if m.value.src else None
        if isinstance(node.op, Scatter) and isinstance(base.op, Input) and base.op.name == m.name \
                and base.op.version == m.version - 1 and base.view == m.view and m.view.is_contiguous() \
                and not _reads_input(node.src[1:], m.name) and id(node) not in read_by_calls:
            found[id(node)] = m
    return found


def _reading_written_inputs(value: GraphNode, in_place: dict[int, Mutation]) -> GraphNode:
    """value with each read of an in-place scatter's value (directly or through a view) made
    a read of the input version the scatter writes, through the same view."""
    replaced = {}
    for leaf in expression_leaves(value):
        base = leaf.src[0] if isinstance(leaf.op, ViewOp) else leaf
        m = in_place.get(id(base))
        if m is not None:
            written = GraphNode(Input(m.name, m.version), base.dtype, (), m.view)
            replaced[id(leaf)] = written if leaf is base else GraphNode(ViewOp(), leaf.dtype, (written,), leaf.view)
    return read_from_buffers(value, replaced) if replaced and id(value) not in replaced else replaced.get(id(value), value)


def _reads_input(values, name: str) -> bool:
    bases = [buffer_of(leaf) for value in values for leaf in expression_leaves(value)]
    return any(base is not None and isinstance(base.op, Input) and base.op.name == name for base in bases)


def written_input(store: Store) -> Optional[Mutation]:
    """The write into an input a store makes (an InputTarget, or a scatter into the input)."""
    t = store.target
    return t.mutation if isinstance(t, (InputTarget, ScatterTarget)) else None


def collect_externs(graph: Graph) -> list[ExternStep]:
    """One step per library call the graph reads a result of, or keeps as an effect (a
    call that returns nothing: a step with no results, run for its check)."""
    steps: dict[int, ExternStep] = {}
    for node in toposort(graph.roots()):
        if isinstance(node.op, Extern):
            step = steps.setdefault(id(node.op.call), ExternStep(node.op.call, node.src, []))
            if node.op.index is not None:
                step.results.append(node)
    return list(steps.values())


def place_in_domains(stores: list[Store], copies: Copies) -> list[Store]:
    """Give every store its domain. A reduction (or gather) a store cannot keep in registers
    in its domain is written to a buffer by a store of its own, and that store reads the
    buffer; stores that can keep it in registers still do (softmax's max stays fused with
    its sum even when another kernel also needs it). copies: where the expressions it
    rewrites note their originals."""
    buffers: dict[int, GraphNode] = {}  # the graph's node (a copy's original) -> the buffer it is written to
    products: dict[tuple, GraphNode] = {}  # product_key -> the buffer a Dot is written to
    pending, placed = list(stores), []
    while pending:
        store = pending.pop(0)
        in_reduction_shape(store, copies)
        placement = store_domain(store.value)
        if isinstance(store.target, ScatterTarget) and (placement.domain.axes or placement.domain.dot):
            # a scatter writes from a plain pointwise kernel: what its values reduce or
            # multiply comes from buffers
            placement = Placement(Domain(store.shape), (reduces_in(store.value) or dots_in(store.value))[:1])
        if not placement.foreign:
            store.domain, store.totals = placement.domain, tuple(placement.totals)
            placed.append(store)
            continue
        for node in placement.foreign:
            key = id(copies.original(node))
            if key in buffers:
                continue
            same = products.get(product_key(node)) if isinstance(node.op, Dot) else None
            if same is not None:  # one product under another shape: read as a reshape of its buffer
                buffers[key] = GraphNode(ViewOp(), node.dtype, (same,), same.view.reshape(node.shape))
                continue
            buffers[key] = GraphNode(Contiguous(), node.dtype, (node,), node.view)
            pending.append(Store(BufferTarget(buffers[key]), node))
            if isinstance(node.op, Dot) and product_key(node) is not None:
                products[product_key(node)] = buffers[key]
        store.value = read_from_buffers(store.value, buffers, copies)
        pending.append(store)
    order = {id(s): k for k, s in enumerate(stores)}
    return sorted(placed, key=lambda s: order.get(id(s), len(order)))


def in_product_layouts(stores: list[Store], externs: list[ExternStep], graph: Graph,
                       unstored: frozenset) -> list[Store]:
    """in_product_layout for every store; a buffer a store stopped reading is not written
    where nothing else reads it."""
    bypassed = [b for s in stores if (b := in_product_layout(s)) is not None]
    return _without_unread_buffers(stores, externs, graph, unstored, bypassed) if bypassed else stores


def _without_unread_buffers(stores: list[Store], externs: list[ExternStep], graph: Graph, unstored: frozenset,
                            candidates: list[GraphNode]) -> list[Store]:
    """The stores without those of the candidate buffers that no store, call or output reads
    (an output no store writes is memory the graph holds: a buffer, a view of one, or the
    value a buffer holds, whose buffer lives in the output's memory: lower.returned_buffers)."""
    held = [graph.outputs[name] for name in unstored]
    read = set().union(*map(_memory_read, [*stores, *externs]), _memory_of(held))
    values_held = {id(node) for node in held}
    unread = {id(b) for b in candidates if id(b) not in read and id(b.src[0]) not in values_held}
    return [s for s in stores if not (isinstance(s.target, BufferTarget) and id(s.target.node) in unread)]


def in_reduction_shape(store: Store, copies: Copies) -> None:
    """A store of a full-shape value of a reduction whose input has an axis split of the
    value's shape (layer_norm over [b, t, d] read by a matmul as [b*t, d]; softmax over
    [b, h, s, s] read as [b*h, s, s]) or the value's axes in another order (layer_norm's
    output read as [t, b, d] by nn.MultiheadAttention) computes the value in the reduction's
    shape, so it joins the reduction's kernel instead of reading its results from a buffer."""
    reduces = reduces_in(store.value)
    if not reduces or not _reshapeable(store):
        return
    domain = domain_of_reduce(reduces[0])
    dims = None
    if not splits_into(store.shape, domain.shape):
        dims = aligned_permutation(store.value, domain)
        if dims is None:
            return
    _express_in(store, domain.shape, dims, copies)


def in_product_layout(store: Store) -> Optional[GraphNode]:
    """A store of a product's result with its axes in another order (attention's output
    [b, h, s, d] returned as [b, s, h, d], for the heads to be joined) writes the product's
    tiles through that order of its target, in the product's kernel, instead of a kernel of
    its own copying the product's buffer into the target's layout. Returns the buffer the
    store no longer reads, if it read one (group_kernels drops its store if nothing else
    reads it)."""
    value = store.value
    if not (_reshapeable(store) and isinstance(value.op, ViewOp)):
        return None
    buffer = value.src[0] if copies_its_source(value.src[0]) else None
    product = buffer.src[0] if buffer is not None else value.src[0]
    if not _of_a_product(product):
        return None
    order = _axis_order(value.view, value.src[0].view)
    if order is None or order == tuple(range(len(order))):
        return None
    inverse = tuple(sorted(range(len(order)), key=order.__getitem__))  # (value.permute(inverse) is the product)
    store.target_shape, store.target_dims, store.value = store.shape, inverse, product
    store.note = (f"writes {_target_name(store.target)} from the product's tiles through its axes in the order "
                  f"{list(order)}: no copy of the product's result")
    return buffer


REDUCTION_NAMES = {"add": "sum", "mul": "product"}  # (what explain calls a reduction by its op)


def _target_name(target: Target) -> str:
    return f"output {target.name}" if isinstance(target, OutputTarget) else "a buffer"


def _of_a_product(value: GraphNode) -> bool:
    """A product, or one-input elementwise work on it (a cast to the operands' type)."""
    while isinstance(value.op, Elementwise) and len(value.src) == 1 and value.src[0].shape == value.shape:
        value = value.src[0]
    return isinstance(value.op, Dot)


def _axis_order(view: View, of: View) -> Optional[tuple[int, ...]]:
    """The order p of `of`'s axes that `view` is (view == of.permute(p) on every axis of more
    than one element), or None."""
    if view.offset != of.offset or sorted(view.shape) != sorted(of.shape) or len(view.shape) > 6:
        return None
    for order in itertools.permutations(range(len(of.shape))):
        permuted = of.permute(order)
        if permuted.shape == view.shape and all(n == 1 or a == b for n, a, b in
                                                zip(view.shape, view.strides, permuted.strides)):
            return order
    return None


def _reshapeable(store: Store) -> bool:
    """The store writes a whole target it may write through another view (not an input's or
    a scatter's) and is not computed in another shape already."""
    return not isinstance(store.target, (InputTarget, ScatterTarget)) and store.target_shape is None


def _express_in(store: Store, shape: tuple[int, ...], dims: Optional[tuple[int, ...]], copies: Copies) -> bool:
    """Compute the store's value in `shape` (an axis split of its own, or its axes permuted
    by dims), written through that view of its target; False (the store as it was) where
    its expression has no such form."""
    value = reshaped_expression(store.value, shape, dims, copies)
    if value is None:
        return False
    store.target_shape, store.target_dims, store.value = store.shape, dims, value
    return True


def stage_hazardous_reads(stores: list[Store]) -> list[Store]:
    """A write into an input whose own value reads that input's older contents where
    another program of its kernel may write them first (x.add_(x.flip(0))) reads a copy
    staged by an earlier kernel instead (see hazards.py), or, where the value is smaller
    than what it would copy (a row sum of shifted rows written into a column), writes a
    copy of its value computed by an earlier kernel."""
    staged: list[Store] = []
    for store in stores:
        if isinstance(store.target, InputTarget):
            name = store.target.mutation.name
            hazardous = _hazardous_reads(store, store)
            if hazardous and math.prod(store.shape) < sum(math.prod(leaf.shape) for leaf in hazardous):
                staged.append(_value_staged(store))
                staged.append(store)
                continue
            for leaf in hazardous:
                buffer = stage(leaf)
                staged.append(Store(BufferTarget(buffer), leaf, Domain(leaf.shape),
                                    note=f"copies {name} {_shown(leaf.view)} before a later kernel writes {name} "
                                         f"{_shown(store.target.mutation.view)}: a program there could overwrite "
                                         "what another still has to read"))
                _read_copy(store, leaf, buffer)
            store.note = _in_place_note(store, bool(hazardous))
        staged.append(store)
    return staged


def _read_copy(store: Store, leaf: GraphNode, buffer: GraphNode) -> None:
    """The store reads `buffer`, a staged copy of `leaf`, wherever it read `leaf`."""
    store.value = buffer if store.value is leaf else read_from_buffers(store.value, {id(leaf): buffer})


def _value_staged(store: Store) -> Store:
    """The store that computes `store`'s value into a buffer, before `store` (now a copy of
    that buffer into the input) runs."""
    mutation = store.target.mutation
    buffer = stage(store.value)
    computed = Store(BufferTarget(buffer), store.value, store.domain,
                     note=f"computes the value written into {mutation.name} {_shown(mutation.view)} by a later "
                          f"kernel: it reads {mutation.name} where a program there could overwrite what another "
                          "still has to read, and the value is smaller than those reads")
    store.value, store.domain = buffer, Domain(store.shape)
    store.note = f"writes {mutation.name} {_shown(mutation.view)} in place from the value computed before (above)"
    return computed


def _in_place_note(store: Store, staged: bool) -> str:
    """What explain says of a write into an input: whether it reads that input in place."""
    mutation = store.target.mutation
    views = [leaf.view for leaf in expression_leaves(store.value)
             if reads_older_version(leaf, mutation.name, mutation.version)]
    if not views:
        return ""
    apart = sum(disjoint(v, mutation.view) for v in views)
    return (f"writes {mutation.name} {_shown(mutation.view)} in place and reads it through {len(views)} view(s) "
            f"without a copy: {apart} reaching none of the written addresses, {len(views) - apart} reading each "
            "address in the program that writes it" + ("; its other reads are copies (above)" if staged else ""))


def _shown(view: View) -> str:
    return f"[shape {list(view.shape)}, strides {list(view.strides)}, offset {view.offset}]"


def _stage_older_reads(stores: list[Store]) -> list[Store]:
    """Every read of an input as it was before a write that reaches the read's addresses is
    staged (copied into a buffer by a kernel of its own before the write). Only where the
    kernels would have no order otherwise: a store that computes from the input's
    older contents (a value written through one view, read again through that view, is its
    expression, not a memory read) while it also reads the newer contents directly or
    through a reduction of them: `x.mul_(2); x * x[1:].sum()`. The staged copy runs before
    the write, its reader after it."""
    writes = [m for s in stores if (m := written_input(s))]
    buffers: dict[int, GraphNode] = {}
    staged: list[Store] = []
    for store in stores:
        older = [leaf for leaf in expression_leaves(store.value)
                 if any(reads_older_version(leaf, m.name, m.version) and not reads_apart(leaf, m.view) for m in writes)]
        for leaf in dict.fromkeys(older):
            if id(leaf) not in buffers:
                buffers[id(leaf)] = stage(leaf)
                staged.append(Store(BufferTarget(buffers[id(leaf)]), leaf, Domain(leaf.shape),
                                    note=f"copies {buffer_of(leaf).op.name} {_shown(leaf.view)} as it was before "
                                         "a write: a kernel reads both this and the written contents"))
            _read_copy(store, leaf, buffers[id(leaf)])
        staged.append(store)
    return staged


def _hazardous_reads(reader: Store, writer: Store) -> list[GraphNode]:
    """Leaves of `reader` that read the input `writer` overwrites, as it was before, at an
    address some other program of a kernel running both may have written already."""
    mutation = writer.target.mutation
    tables = gather_tables(reader.value)
    return [leaf for leaf in expression_leaves(reader.value)
            if reads_older_version(leaf, mutation.name, mutation.version) and not reads_apart(leaf, mutation.view)
            and (id(leaf) in tables or reader.domain != writer.domain
                 or not same_program_access(leaf.view, mutation.view, writer.domain))]


def group_kernels(graph: Graph, unstored: frozenset = frozenset(),
                  output_strides: Optional[dict[str, tuple[int, ...]]] = None
                  ) -> tuple[list[Union[KernelGroup, ExternStep]], dict[str, GraphNode]]:
    """Stores with the same domain and level share a kernel; library calls run between the
    kernels, in level order. unstored: outputs no kernel writes (see collect_stores).
    Also returns the outputs that are now the memory of a buffer grouping added (output name
    -> the Contiguous node: _store_shared_values), which lower returns as that buffer."""
    externs = collect_externs(graph)
    copies = Copies()  # (so a later pass knows the copies placing makes for their originals)
    stores = in_product_layouts(collect_stores(graph, unstored), externs, graph, unstored)
    stores = stage_hazardous_reads(place_in_domains(stores, copies))
    stores = without_overwritten_writes(stores, externs)
    edges = _dependencies(stores, externs)
    try:
        levels = _levels([*stores, *externs], edges)
    except OrderCycle:
        stores = _stage_older_reads(stores)
        edges = _dependencies(stores, externs)
        levels = _levels([*stores, *externs], edges)
    # the passes below move stores between kernels; with a write into an input, kernel order
    # also protects the input from early overwrites: the stores then stay as placed
    if not any(written_input(s) for s in stores):
        if _read_earlier_buffers(stores, levels, copies, externs, graph.view_chains):  # (the levels still hold: each buffer read is of an earlier one)
            edges = _dependencies(stores, externs)
        levels = _sink_buffers(stores, edges, levels, copies)
        # (outputs sink once the shared values are read from buffers: until then each later
        # kernel computes them again, so an output looks free to wait for the last kernel,
        # and the last kernel computing them makes each earlier kernel's reads look free)
        shared, shared_outputs = _store_shared_values(stores, levels, output_strides or {})
        if shared:
            stores = [*(s for s in stores if id(s) not in shared_outputs), *shared]
            _read_earlier_buffers(stores, levels, copies, externs, graph.view_chains)
        levels = _sink_outputs(stores, externs, levels)
        # (statistics first: a store joined to a product's row kernel whose statistics then
        # moved would be left there alone, in a kernel with no product to compute)
        hosts = _host_online_statistics(stores, externs, levels)
        _join_reduction_kernels(stores, levels, copies)
    else:
        hosts, shared_outputs = {}, {}
    groups: dict[tuple, KernelGroup] = {}
    group_of: dict[int, KernelGroup] = {}  # id of a store -> its kernel
    for store in stores:
        if id(store) in hosts:
            continue
        alone = _accumulates(store)  # (a kernel of its own: no other store's key is this one)
        if alone:
            _note_accumulation(store)
        key = (levels[id(store)], store.domain, ("accumulates", id(store)) if alone else 0)
        while key in groups and _computes_a_product_in_two_roles(groups[key].stores, store):
            key = (*key[:2], key[2] + 1)
        group_of[id(store)] = groups.setdefault(key, KernelGroup(store.domain, level=key[0]))
        group_of[id(store)].stores.append(store)
    for store in stores:
        if id(store) in hosts:
            group_of[id(hosts[id(store)])].stores.append(store)
    for step in externs:
        step.level = levels[id(step)]
    # at one level nothing depends on anything else; calls first, so their results die early
    ordered = sorted([*externs, *groups.values()], key=lambda g: (g.level, isinstance(g, KernelGroup)))
    return ordered, {name: buffer for name, buffer in shared_outputs.values()}


def _host_online_statistics(stores: list[Store], externs: list[ExternStep], levels: dict[int, int]
                            ) -> dict[int, Store]:
    """A row statistic that a product's kernel computes online anyway (attention's softmax
    max and sum along the keys, saved for the backward) is written by that kernel, instead of
    a kernel of its own that computes the scores once more: id of the statistic's store ->
    the product's store, whose kernel then writes it (Store.online_of; `levels` updated).
    The statistic's rows must be the product's rows, and its readers must run after it."""
    computed = _computed_online(stores)
    readers = _readers([*stores, *externs], levels)
    hosts: dict[int, Store] = {}
    for s in stores:
        if not _hostable_statistic(s) or id(s.value) not in computed:
            continue
        host, product = computed[id(s.value)]
        level = levels[id(host)]
        if s.value.shape == product.shape[:-1] + (1,) and \
                all(lv > level for key in _memory_written(s) for lv, _ in readers.get(key, [])):
            s.domain, s.online_of, levels[id(s)] = host.domain, product, level
            op = s.value.op.op
            s.note = (f"writes {_target_name(s.target)}, the rows' {REDUCTION_NAMES.get(op, op)} its product's k "
                      "loop computes online: no kernel of its own computes the scores again")
            hosts[id(s)] = host
    return hosts


def _hostable_statistic(store: Store) -> bool:
    """A plain store of a reduction's value: a whole output or buffer, not a grid reduction."""
    return isinstance(store.value.op, Reduce) and isinstance(store.target, (OutputTarget, BufferTarget)) \
        and store.target_shape is None and not store.totals and not store.value.op.axis_strategies


def _computed_online(stores: list[Store]) -> dict[int, tuple[Store, GraphNode]]:
    """id of each reduction that a product kernel's k loop computes online -> (the store of
    the product, computed on the kernel's own tiles, the product)."""
    found: dict[int, tuple[Store, GraphNode]] = {}
    for host in stores:
        if not host.domain.dot or host.domain.axes:
            continue
        for product in dots_in(host.value):
            form = online_product(product) if product.shape == host.domain.shape else None
            for reduction in form.reductions if form is not None else ():
                found.setdefault(id(reduction), (host, product))
    return found


def _memory_written(store: Store) -> list:
    """The keys (_memory_of's) under which stores and calls read what the store writes."""
    return [id(store.target.node)] if isinstance(store.target, BufferTarget) else []


def _computes_a_product_in_two_roles(group: list[Store], store: Store) -> bool:
    """Whether a product kernel of these stores would compute one product both as its own
    tile and inside another product's operand (attention's scores, stored, and summed into
    its output, when the keys are as many as the head dimension): codegen computes a
    product in one role only (store_domain's rule for one store), so such a store gets a
    kernel of its own."""
    if not store.domain.dot:
        return False
    outer = lambda stores: {id(d) for s in stores for d in dots_in(s.value)}  # noqa: E731
    nested = lambda stores: {id(n) for s in stores for n in nested_products(dots_in(s.value))}  # noqa: E731
    return bool(outer(group) & nested([store]) or nested(group) & outer([store]))


def _accumulates(store: Store) -> bool:
    """Whether the store writes a product its kernel accumulates in that memory (codegen's
    accumulating form computes that one product and nothing else)."""
    return store.domain.dot and any(accumulates_in_memory(d) for d in dots_in(store.value))


def _note_accumulation(store: Store) -> None:
    store.note = "; ".join(filter(None, [
        store.note, f"accumulates the product in {_target_name(store.target)}, a chunk of its columns per step of k: "
                    "the products its operand computes are computed once per row tile and step, not once per column tile"]))


def _sink_outputs(stores: list[Store], externs: list[ExternStep], levels: dict[int, int]) -> dict[int, int]:
    """An output store may run in any kernel from its earliest level on (no store reads an
    output), so it joins a later kernel of its domain where that costs no memory: a
    layer_norm backward's bias gradient shares the weight gradient's kernel, which must wait
    for the row statistics. Waiting keeps what it reads alive for it alone from that
    memory's last other reader on (each layer's gradient rows until the backward's end, were
    it the last kernel), while the output itself is allocated only when its kernel runs: so
    it joins the latest kernel for which what it keeps alive is no larger than itself."""
    readers = _readers([*stores, *externs], levels)
    kernel_levels: dict[Domain, set[int]] = {}
    for s in stores:
        kernel_levels.setdefault(s.domain, set()).add(levels[id(s)])
    sunk = dict(levels)
    for s in stores:
        if not isinstance(s.target, OutputTarget):
            continue
        level, reads = levels[id(s)], _memory_read(s)
        free_until = {key: max(level, _latest_reader_but(s, readers, key)) for key in reads}
        own_bytes = math.prod(s.target_shape or s.shape) * s.value.dtype.itemsize

        def kept_alive(k: int) -> int:
            return sum(nbytes for key, nbytes in reads.items() if free_until[key] < k)

        sunk[id(s)] = max(k for k in kernel_levels[s.domain] if k == level or (k > level and kept_alive(k) <= own_bytes))
    return sunk


RECOMPUTED_LOADS = 4  # a value computed from more loads than this is read from its buffer where one is written


def _read_earlier_buffers(stores: list[Store], levels: dict[int, int], copies: Copies,
                          externs: list[ExternStep], chains: dict[int, list]) -> bool:
    """A store whose expression computes a value that an earlier kernel writes to a buffer
    anyway (a matmul's operand) reads the buffer instead: an unrolled RNN's step computes
    its hidden state from the previous one, which the step's matmul read from memory, and
    recomputed, each step would compute every step before it. A product is never computed
    again where its value is in a buffer. A copy that placing made (reading a row statistic
    from a buffer where its kernel cannot compute it) computes its original's value, so it
    reads its original's buffer too, and a node computed in another layout reads it through
    that layout's view (`copies`), and a node that computes a view of a value from the
    value's own terms (Graph.view_chains: a slice of a residual stream's gradient, the sum
    of every layer's terms sliced) reads the value's buffer through that view, so the terms
    can be freed where the value is written; a buffer that holds a value permuted or
    reshaped holds the value too (_filled_buffers). Then a read that holds its buffer alive
    for this store alone, while everything its value is computed from is read at that level
    or later anyway, computes the value again instead: that costs no memory
    (_reads_to_give_up).
    Whether any store changed."""
    filled = _filled_buffers(stores, levels, copies, chains)
    reading: dict[int, tuple[Store, GraphNode, dict]] = {}  # id of a store -> (it, its value before, reads)
    for store in stores:
        # (a pointwise product kernel that computes a softmax along its k keeps computing it:
        # reading one of its row statistics from a buffer would break the online form,
        # lower/online_product.py)
        online = store.domain.dot and not store.domain.axes
        earlier = {key: buffer for key, (buffer, lv) in filled.items() if lv < levels[id(store)]
                   and not (online and isinstance(buffer_of(buffer).src[0].op, Reduce))}
        found = _outermost_matches(store.value, earlier, copies, chains) if earlier else {}
        if found:
            reading[id(store)] = (store, store.value, found)
            _read(store, {key: buffer for key, (buffer, _) in found.items()}, copies)
    readers = _readers([*stores, *externs], levels)
    for store, before, found in reading.values():
        given_up = _reads_to_give_up(store, found, readers, levels[id(store)])
        if given_up:
            _read(store, {key: buffer for key, (buffer, _) in found.items() if key not in given_up}, copies, before)
    return bool(reading)


def _filled_buffers(stores: list[Store], levels: dict[int, int], copies: Copies, chains: dict[int, list]
                    ) -> dict[int, tuple[GraphNode, int]]:
    """Key of a node computed from more than RECOMPUTED_LOADS loads, or a product -> (a read
    of a buffer that holds its value, the level of the store that writes it). A buffer of a
    permuted or reshaped value (a layer's gradient in nn.MultiheadAttention's [t, b, d]) holds
    the value too, read through the inverse views."""
    filled = {id(copies.original(s.target.node.src[0])): (s.target.node, levels[id(s)]) for s in stores
              if isinstance(s.target, BufferTarget) and copies_its_source(s.target.node)  # (a scatter's: written over)
              and (len(expression_leaves(s.value)) > RECOMPUTED_LOADS or dots_in(s.value))}
    for key, (buffer, level) in list(filled.items()):
        for value, views in chains.get(key, ()):
            read = _read_back(buffer, value.shape, views)
            if read is not None:
                filled.setdefault(id(value), (read, level))
    return filled


def _read_back(buffer: GraphNode, shape: tuple[int, ...], views: tuple) -> Optional[GraphNode]:
    """A read of the value (of this shape) whose `views` the buffer holds, if each view
    can be undone (inverse_views)."""
    undone = inverse_views(shape, views)
    read = read_through(buffer, lambda view: _through(view, undone)) if undone is not None else None
    return read if read is not None and read.shape == shape else None


def _through(view: Optional[View], views) -> Optional[View]:
    """The view after each of `views` in turn; None where one has no strided form."""
    for desc in views:
        view = apply_view_desc(view, desc) if view is not None else None
    return view


def _read(store: Store, buffers: dict[int, GraphNode], copies: Copies, value: Optional[GraphNode] = None) -> None:
    """The store computes `value` (its own by default) with these nodes read from buffers."""
    store.value = read_from_buffers(value if value is not None else store.value, buffers, copies)
    if store.totals:  # (the grid reductions of the new expression)
        store.totals = tuple(totals_of(store.value))
    if store.domain.dot and not dots_in(store.value):  # (its products are read instead)
        store.domain = dataclasses.replace(store.domain, dot=False)


def _outermost_matches(value: GraphNode, earlier: dict[int, GraphNode], copies: Copies,
                       chains: dict[int, list]) -> dict[int, tuple[GraphNode, GraphNode]]:
    """Key -> (buffer read, node) for the nodes of value's expression (not value itself)
    that `earlier` (a node's key -> its buffer) holds, or that are views of a node it holds
    (`chains`, Graph.view_chains: read through those views), outside any other such node."""
    found: dict[int, tuple[GraphNode, GraphNode]] = {}
    seen: set[int] = set()

    def visit(node: GraphNode) -> None:
        if id(node) in seen or is_kernel_input(node):
            return
        seen.add(id(node))
        key = next((k for k in (id(copies.original(node)), id(copies.source(node))) if k in earlier), None)
        if node is not value and key is not None:
            found[key] = (earlier[key], node)
            return
        # (a node placing computes in another layout is read as its source's value, through
        # that layout: read_from_buffers)
        source = copies.source(node)
        viewed = _viewed_buffer(source, earlier, chains.get(id(source), ())) if node is not value else None
        if viewed is not None:
            found[id(source)] = (viewed, node)
            return
        for src in node.src:
            visit(src)

    visit(value)
    return found


def _viewed_buffer(node: GraphNode, earlier: dict[int, GraphNode], chain: list) -> Optional[GraphNode]:
    """A read of node's value as a view of an earlier buffer's value (chain: its
    Graph.view_chains entry), nearest value first; None if no strided view of a buffer is it."""
    for value, views in chain:
        buffer = earlier.get(id(value))
        read = read_through(buffer, lambda view: _through(view, views)) if buffer is not None else None
        if read is not None and read.shape == node.shape and read.dtype == node.dtype:
            return read
    return None


def _readers(items: list, levels: dict[int, int]) -> dict[object, list[tuple[int, int]]]:
    """Memory -> (level, id) of each store or call that reads it."""
    found: dict[object, list[tuple[int, int]]] = {}
    for item in items:
        for key in _memory_read(item):
            found.setdefault(key, []).append((levels[id(item)], id(item)))
    return found


def _reads_to_give_up(store: Store, found: dict[int, tuple[GraphNode, GraphNode]],
                      readers: dict[object, list[tuple[int, int]]], level: int) -> set[int]:
    """The keys of `found` whose buffer no other store or call reads at the store's level or
    later, while every load of the node it stands for is (a transformer's recomputed
    residual stream, read by a backward's last kernel): computed again, the node holds
    nothing that is not held anyway, where read, it holds its buffer. A product is kept."""
    return {key for key, (buffer, node) in found.items()
            if not dots_in(node) and _latest_reader_but(store, readers, id(buffer_of(buffer))) < level
            and all(_latest_reader_but(store, readers, k) >= level for k in _memory_of(expression_leaves(node)))}


def _latest_reader_but(item, readers: dict[object, list[tuple[int, int]]], key) -> int:
    """The latest level of a memory's readers (_readers) other than `item` (-1 if none)."""
    return max((lv for lv, reader in readers.get(key, []) if reader != id(item)), default=-1)


def _store_shared_values(stores: list[Store], levels: dict[int, int], output_strides: dict[str, tuple[int, ...]]
                         ) -> tuple[list[Store], dict[int, tuple[str, GraphNode]]]:
    """Buffer stores for pointwise values of a recurrence computed from more than
    RECOMPUTED_LOADS loads by stores of several levels (an LSTM's cell state: every later
    step's kernel would compute it again from the gates of every step before), each in a
    kernel over its shape at the first level that computes it (so no kernel is added);
    _read_earlier_buffers then makes the later ones read it. Only the largest such values
    of each first level: the rest follow from reading them. Not a value that is the same
    along an axis (_broadcast: a norm's shifted mean, expanded to its rows), which its
    kernels compute from row statistics: its buffer would hold it once per column. (Levels
    of the new stores are added to `levels`.)
    A value that is also an output in the buffer's layout (a training forward's residual
    stream, saved for the backward) is stored whether or not it is the largest, into the
    output's memory: the output's own store, which would compute it again from every term
    since the last buffer (and keep those terms alive for it), goes; a value computed from
    such an output alone is left to its kernels. Returns the new stores, and id of each
    output store that goes -> (its output's name, the buffer)."""
    hosts = {}  # level -> domain of a kernel over each full shape
    for s in stores:
        if not s.domain.axes or s.domain.squeezed_shape != ():
            hosts.setdefault(levels[id(s)], {}).setdefault(s.domain.shape, s.domain)
    found: dict[int, GraphNode] = {}
    levels_of: dict[int, set[int]] = {}
    for store in stores:
        for node in kernel_expression(store.value):
            if not is_kernel_input(node) and node.dtype.is_float:
                levels_of.setdefault(id(node), set()).add(levels[id(store)])
                found.setdefault(id(node), node)
    shared = {key: (node, min(levels_of[key])) for key, node in found.items()
              if len(levels_of[key]) > 1 and node.shape in hosts.get(min(levels_of[key]), {})
              and not _reduces_or_multiplies(node) and _loads(node) > RECOMPUTED_LOADS and not _broadcast(node)}
    within = {key: [id(n) for n in kernel_expression(node) if n is not node]
              for key, (node, _) in shared.items()}
    # a recurrence: a value computed again from an earlier such value (each step's state from
    # the one before) costs every later step more; a value two kernels compute once each is
    # left to them (a transformer's recomputed activations: a buffer would hold its memory)
    chained = set()
    for key, (node, first) in shared.items():
        earlier = [k for k in within[key] if k in shared and shared[k][1] < first]
        if earlier:
            chained.update([key, *earlier])
    inner = {(k, first) for key, (_, first) in shared.items() if key in chained for k in within[key]}
    outputs: dict[int, Store] = {}  # id of a value -> the first store of an output that is it
    for s in stores:
        if isinstance(s.target, OutputTarget) and s.target_shape is None:
            outputs.setdefault(id(s.value), s)
    buffers: dict[int, GraphNode] = {}  # key -> its buffer
    added, returned = [], {}

    def add(key: int) -> GraphNode:
        node, first = shared[key]
        buffers[key] = GraphNode(Contiguous(), node.dtype, (node,), View.contiguous(node.shape))
        added.append(Store(BufferTarget(buffers[key]), node, hosts[first][node.shape]))
        levels[id(added[-1])] = first
        return buffers[key]

    candidates = [key for key in shared if key in chained]  # (producers first)
    for key in candidates:  # outputs first: their memory is written anyway
        output = outputs.get(key)
        strides = output_strides.get(output.target.name) if output is not None else None
        if strides is not None and same_layout(View.contiguous(shared[key][0].shape), strides):
            returned[id(output)] = (output.target.name, add(key))
    in_outputs = dict(buffers)
    for key in candidates:
        node, first = shared[key]
        # (not a value computed from one output's buffer alone: a norm's shifted rows of one)
        if key not in buffers and (key, first) not in inner and _loads_beyond(node, in_outputs) > 1:
            add(key)
    return added, returned


def _loads_beyond(value: GraphNode, buffers: dict[int, GraphNode]) -> int:
    """The memory reads of a value's expression where the nodes `buffers` holds (by key) are
    read from their buffers, one read each."""
    if not buffers:
        return _loads(value)
    held = lambda n: n is not value and id(n) in buffers  # noqa: E731
    nodes = toposort([value], stop=lambda n: is_kernel_input(n) or held(n))
    return sum(held(n) or (is_kernel_input(n) and buffer_of(n) is not None) for n in nodes)


def same_layout(view: View, strides: tuple[int, ...]) -> bool:
    """Whether memory with these strides holds the view (strides of size-1 axes aside)."""
    return view.offset == 0 and all(size == 1 or a == b for size, a, b in zip(view.shape, view.strides, strides))


def _broadcast(value: GraphNode) -> bool:
    """Whether a pointwise value is the same all along one of its axes (every leaf it reads
    is broadcast there: a norm's row statistic, expanded to its rows): a buffer of it would
    repeat each value along that axis, as large as the rows themselves."""
    leaves = expression_leaves(value)
    return any(value.shape[a] > 1 and all(leaf.view is not None and len(leaf.view.strides) == len(value.shape)
                                          and leaf.view.strides[a] == 0 for leaf in leaves)
               for a in range(len(value.shape)))


def _loads(value: GraphNode) -> int:
    """The memory reads (not literals) of a value's expression."""
    return sum(buffer_of(leaf) is not None for leaf in expression_leaves(value))


def _reduces_or_multiplies(value: GraphNode) -> bool:
    """Whether a value's expression reduces, scans or multiplies matrices (a kernel over its
    shape may not compute those); a gather it may (a transformer's residual stream is its
    token embedding's lookup plus every layer's outputs)."""
    return any(isinstance(n.op, (Reduce, Cumulative, Dot)) for n in kernel_expression(value))


def _computes_non_pointwise(value: GraphNode) -> bool:
    return any(isinstance(n.op, (Reduce, Cumulative, Gather, Dot)) for n in kernel_expression(value))


def _sink_buffers(stores: list[Store], edges: dict[int, list], levels: dict[int, int], copies: Copies) -> dict[int, int]:
    """A buffer written early and read late holds its memory in between (a backward that
    recomputes forward values at its start for its last kernels): its store joins the
    latest kernel that still runs before its first reader, if there is one (so no kernel is
    added, and its own may go): one of its domain, or, for a value that needs no reduction
    of its own, one over its elements in another order or split (a layer's input read
    transposed by a linear, as nn.MultiheadAttention's [t, b, d], computed in a norm
    backward's [b, t, d] rows; _computed_in). A fill that reads no memory (the zeros an
    embedding's gradient is scattered into) runs right before its first reader, as eager
    allocates it, sharing a pointwise kernel's launch there if one runs (horizontal.py):
    held from an earlier kernel on, the table would be alive under everything allocated
    in between (BERT's first layer's weight gradients, where its backward peaks). So does
    a pointwise store that reads only inputs, which the call holds to its end anyway, where
    no reduction kernel of its level may take it in: it joins a kernel of its domain one
    level before its first reader's at the earliest, else runs in one of its own right before
    it (a backward that writes each MLP's gelu(x @ w1 + b1) again, from the saved product,
    for the second linear's weight gradient: a kernel per layer rather than one for all of
    them at the backward's start, or one several levels early, whose buffers would be alive
    from there on)."""
    readers: dict[int, list[tuple[int, bool]]] = {}  # store id -> (id of a store or call reading it, strict?)
    for item, deps in edges.items():
        for dep, strict in deps:
            readers.setdefault(id(dep), []).append((item, strict))
    levels = dict(levels)
    kernels: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)  # level -> domains
    for s in stores:
        kernels[levels[id(s)]][s.domain] += 1
    plain = lambda domain: not domain.axes and not domain.dot  # noqa: E731  (a pointwise kernel's)
    buffers = [s for s in stores if isinstance(s.target, BufferTarget) and id(s) in readers]
    for store in sorted(buffers, key=lambda s: -levels[id(s)]):  # the last first: what it reads may follow it
        level, old = levels[id(store)], store.domain
        latest = min(levels[reader] - strict for reader, strict in readers[id(store)])
        leaves = expression_leaves(store.value)
        fill = plain(store.domain) and all(buffer_of(leaf) is None for leaf in leaves)
        relaid = _reshapeable(store) and not _computes_non_pointwise(store.value)
        waits = latest > level and plain(store.domain) and _no_row_host_at(store, kernels[level]) \
            and all(_held_for_the_run(leaf) for leaf in leaves)
        lowest = max(level, latest - 2) if waits else level  # (one that waits joins a kernel one level early at most)
        to = latest if fill and latest > level else next(
            (k for k in range(latest, lowest, -1) if kernels[k][store.domain]
             or (relaid and _joined_in_another_order(store, kernels[k], copies))), latest if waits else None)
        if to is not None:
            kernels[level][old] -= 1
            kernels[to][store.domain] += 1
            levels[id(store)] = to
    return levels


def _no_row_host_at(store: Store, domains: collections.Counter) -> bool:
    """Whether no reduction kernel of the store's level runs over its elements (in any
    order): one that might compute it with its rows, at no kernel of its own
    (_join_reduction_kernels), as a norm's output recomputed for a weight gradient is."""
    size = math.prod(store.domain.shape)
    return not any(count and domain.axes and math.prod(domain.shape) == size for domain, count in domains.items())


def _held_for_the_run(leaf: GraphNode) -> bool:
    """Whether a kernel input is a literal or an input's memory: no step writes it
    (_sink_buffers runs only where no store writes an input; a library call that writes an
    operand writes a copy of it), and none frees it before its last reader, wherever that
    runs (a backward frees a saved value after the step that reads it last)."""
    buffer = buffer_of(leaf)
    return buffer is None or isinstance(buffer.op, Input)


def _joined_in_another_order(store: Store, domains: collections.Counter, copies: Copies) -> bool:
    """Whether the store, whose value needs no reduction, product or gather of its own, now
    runs in a kernel of one of these domains over its elements in another order or axis
    split (its domain and value changed to that kernel's: _computed_in)."""
    for domain, count in domains.items():
        if count and not domain.dot and domain.squeezed_shape != () and domain.shape != store.shape \
                and math.prod(domain.shape) == math.prod(store.shape) and _computed_in(store, domain.shape, copies):
            store.domain = domain
            return True
    return False


def _join_reduction_kernels(stores: list[Store], levels: dict[int, int], copies: Copies) -> None:
    """Stores that need no reduction of their own are computed by a reduction kernel whose
    rows they are: a value per row (a gathered value kept for a later kernel) once per row;
    a full-shape value over the same rows that reads an input the kernel reads (a sibling:
    `x + x` beside `x.sum(-1)`), so each row is loaded once; and a scalar of totals over
    plain row values (cross-entropy's count of targets, kept for backward) with the totals
    that kernel already combines."""
    hosts: dict[tuple, list[Store]] = {}
    for s in stores:
        if s.domain.axes:
            hosts.setdefault((levels[id(s)], s.domain), []).append(s)
    for store in stores:
        level, computed = levels[id(store)], reduces_in(store.value)
        if store.totals or isinstance(store.target, ScatterTarget) or store.domain.dot:
            continue
        if not computed and not store.domain.axes:
            host = _row_host(store, level, hosts, copies)
            if host is not None:
                levels[id(store)], store.domain = host
            continue
        totals = totals_of(store.value)
        if totals and not any(reduces_in(t.src[0]) for t in totals):
            combining = [d for (lv, d), members in hosts.items()
                         if any(m.totals for m in members) and lv == level and totals_fit(totals, d)]
            if combining:
                store.domain, store.totals = combining[0], tuple(totals)


def _row_host(store: Store, level: int, hosts: dict[tuple, list[Store]], copies: Copies
              ) -> Optional[tuple[int, Domain]]:
    """(level, domain) of a row-reduction kernel that can compute this reduction-free store:
    one of its level whose rows or row values it is, or one over its full shape (or a split or
    permutation of it, at its level) that reads one of the same inputs (an output, which no
    store reads, may wait for a later level) or whose rows are short."""
    for lv, d in hosts:
        if lv == level and store.shape in (d.row_shape, d.squeezed_shape) and d.squeezed_shape != ():
            return lv, d
    reads = _memory_read(store).keys()
    for (lv, d), members in sorted(hosts.items(), key=lambda item: item[0][0]):
        later = lv > level and isinstance(store.target, OutputTarget)
        if not (lv == level or later) or d.squeezed_shape == () or (store.shape != d.shape and lv != level):
            continue
        if not (any(reads & _memory_read(m).keys() for m in members) or (lv == level and _short_rows(d))):
            continue
        if store.shape == d.shape or _computed_in(store, d.shape, copies):
            return lv, d
    return None


SHORT_ROW = 1024  # a row-reduction kernel over rows this short has about a pointwise kernel's programs


def _short_rows(domain: Domain) -> bool:
    """A store over the domain's full shape that reads nothing the kernel reads saves a launch
    there, and loses no parallelism: each row is about one pointwise block."""
    return math.prod(domain.shape[a] for a in domain.axes) <= SHORT_ROW


def _computed_in(store: Store, shape: tuple[int, ...], copies: Copies) -> bool:
    """Make the store compute its value in `shape`, an axis split or a permutation of its own
    (the same rows in a norm's [b, t, d] as a matmul's [b*t, d], or as attention's [t, b, d]),
    written through the split or permuted view of its target. False (the store as it was)
    where it has no such form."""
    if not _reshapeable(store) or 0 in shape:
        return False
    dims = None
    if not splits_into(store.shape, shape):
        if sorted(store.shape) != sorted(shape) or len(shape) > 6:
            return False
        dims = next(p for p in itertools.permutations(range(len(shape))) if tuple(store.shape[k] for k in p) == shape)
    return _express_in(store, shape, dims, copies)


def _memory_read(item: Union[Store, ExternStep]) -> dict[object, int]:
    """The memory a store's expression or a call loads (_memory_of)."""
    return _memory_of(expression_leaves(item.value) if isinstance(item, Store) else item.operands)


def _memory_of(leaves) -> dict[object, int]:
    """The inputs (by name and version) and buffers these leaves load, with the bytes of each."""
    found = {}
    for leaf in leaves:
        base = buffer_of(leaf)
        if base is not None:
            key = (base.op.name, base.op.version) if isinstance(base.op, Input) else id(base)
            found[key] = math.prod(base.shape) * base.dtype.itemsize
    return found


def without_overwritten_writes(stores: list[Store], externs: list[ExternStep]) -> list[Store]:
    """Drop a write into an input that a later write overwrites through the same view while
    nothing reads the version it writes from memory (x.mul_(a); ...; x.add_(b): the second
    write computes from the first's value, not from memory). Kept, the earlier write would
    also be a dependency of the later one both ways: its readers of the older version must
    run first, and the later write after it. Writes before a check eager runs (a call that
    returns nothing) are kept: eager makes them even when the check raises."""
    read = {(base.op.name, base.op.version) for s in stores for leaf in expression_leaves(s.value)
            if (base := buffer_of(leaf)) is not None and isinstance(base.op, Input)}
    read |= {(op.op.name, op.op.version) for e in externs for op in map(buffer_of, e.operands)
             if op is not None and isinstance(op.op, Input)}
    checked = {name for e in externs for name, _ in e.call.versions}
    writes = [(s.target.mutation, isinstance(s.target, InputTarget)) for s in stores if written_input(s)]

    def overwritten(m: Mutation) -> bool:
        """The next write into the input is a whole write through the same view (an in-place
        scatter between would write into the memory this write leaves), and no version
        in between is read."""
        later = [(w.version, whole and w.view == m.view) for w, whole in writes
                 if w.name == m.name and w.version > m.version]
        if not later or m.name in checked or not min(later)[1]:
            return False
        return not any((m.name, v) in read for v in range(m.version, min(later)[0]))

    return [s for s in stores if not (isinstance(s.target, InputTarget) and overwritten(s.target.mutation))]


def _dependencies(stores: list[Store], externs: list[ExternStep] = ()) -> dict[int, list[tuple[object, bool]]]:
    """Per store or library call (by id), what it depends on: (store or call, strict?) pairs.

    Strict dependencies (the store must run in a later kernel): reading a buffer another
    store writes or a library call's result; reading an input version a mutation produces;
    writing an input that another store or a library call reads (an older version of)
    through a different view or iteration space, or that eager writes after a check (a call
    that returns nothing) that may raise; a check waits for the writes eager makes before it
    (Converter.settle_writes_before_check keeps later values from reading the input as it was
    before those). Reading through the same view in the same iteration space is safe in one
    kernel: each lane loads its elements before it stores them. A library call depends
    strictly on whatever writes what it reads.
    """
    producer: dict[tuple, object] = {("extern", id(e.call)): e for e in externs}
    fills: dict[int, Store] = {}
    for s in stores:
        if isinstance(s.target, BufferTarget):
            fills[id(s.target.node)] = s
            producer.setdefault(("buffer", id(s.target.node)), s)
        elif isinstance(s.target, ScatterTarget) and not s.target.mutation:  # read once its values are written
            producer[("buffer", id(s.target.node))] = s
        if written_input(s):
            producer[("input", s.target.mutation.name, s.target.mutation.version)] = s
    reads = {id(s): [(leaf, buffer_of(leaf)) for leaf in expression_leaves(s.value)] for s in stores}
    reads.update({id(e): [(op, buffer_of(op)) for op in e.operands] for e in externs})
    def deps(item):
        """(store or call it depends on, strict?) pairs."""
        for leaf, base in reads[id(item)]:
            if base is None:
                continue
            if isinstance(base.op, Contiguous):
                yield producer[("buffer", id(base))], True
            elif isinstance(base.op, Extern):
                yield producer[("extern", id(base.op.call))], True
            elif base.op.version:
                yield producer[("input", base.op.name, base.op.version)], True
        if isinstance(item, Store) and isinstance(item.target, ScatterTarget) and not item.target.mutation:
            yield fills[id(item.target.node)], True  # the values overwrite the filled buffer
        if isinstance(item, ExternStep) and item.call.versions:  # a check runs after the writes eager made first
            versions = dict(item.call.versions)
            yield from ((s, True) for s in stores if written_input(s)
                        and s.target.mutation.version <= versions.get(s.target.mutation.name, 0))
        if isinstance(item, Store) and written_input(item):
            yield from _write_after_read(item, stores, reads)
            name, version = item.target.mutation.name, item.target.mutation.version
            yield from ((e, True) for e in externs
                        if any(reads_older_version(op, name, version) for op, _ in reads[id(e)])
                        or version > dict(e.call.versions).get(name, version))  # a check eager runs first

    return {id(item): list(deps(item)) for item in [*stores, *externs]}


def _levels(items: list, edges: dict[int, list[tuple[object, bool]]]) -> dict[int, int]:
    """Level of a store or library call = the earliest slot its dependencies allow: the
    longest path, by relaxation. Two stores that each read what the other overwrites, in
    the same program (a momentum buffer and its parameter), depend on each other without
    strictness and share a level; a cycle through a strict dependency has no order."""
    level = {id(item): 0 for item in items}
    for _ in range(len(items) + 1):
        changed = False
        for item in items:
            new = max((level[id(d)] + strict for d, strict in edges[id(item)]), default=0)
            if new > level[id(item)]:
                level[id(item)], changed = new, True
        if not changed:
            return level
    raise OrderCycle("internal error: the kernels' dependencies form a cycle through a strict one: no order exists")


class OrderCycle(TjitError):
    """The stores' dependencies leave them no order."""


def _write_after_read(store: Store, stores: list[Store], reads):
    """(store, strict?) for each store that reads or writes an older version of the input
    `store` writes: strict (an earlier kernel) unless every such access meets the write in
    the same program."""
    mutation = store.target.mutation
    scattered = isinstance(store.target, ScatterTarget)  # data-dependent addresses: no program meets another's
    for other in stores:
        if other is store:
            continue
        # (a read that reaches none of the written addresses may run before or after the write)
        if any(reads_older_version(leaf, mutation.name, mutation.version) and not reads_apart(leaf, mutation.view)
               for leaf, _ in reads[id(other)]):
            yield other, scattered or bool(_hazardous_reads(other, store))
        earlier = written_input(other)
        if earlier and earlier.name == mutation.name and earlier.version < mutation.version:
            # (writes that reach no common address keep their order only so that a reader of
            # the later version, which may read both, runs after both)
            yield other, not disjoint(earlier.view, mutation.view) and (
                scattered or isinstance(other.target, ScatterTarget)
                or not (other.domain == store.domain and earlier.view == mutation.view))

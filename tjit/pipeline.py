"""The compiler's passes, in order. Every compiled form goes through them: a function's
forward, its backward (autograd/backward.py builds the backward's IR graph, which enters at
`partition`), and what `tjit.explain` shows.

    trace      fn + example args  -> aten FX graph         frontend/trace.py (make_fx); once
                                                           per shape class: shape_class.py
    convert    aten FX graph      -> IR Graph, outputs     frontend/convert.py + op tables
    partition  IR Graph           -> ordered steps:        lower/fusion.py
                                     KernelGroups (fused) and ExternSteps (library calls)
    codegen    each step          -> KernelPlan (axis      lower/schedule.py, codegen.py;
                                     mapping, Triton text)  lower/library.py for calls
               or LibraryPlan
    memory     the steps          -> slab offsets of every memory/liveness.py, planner.py,
                                     intermediate; donated  donation.py
                                     memory
    Program    all of the above, which the runtime runs (runtime/executor.py) and nothing
               else decides: the runtime only binds memory and launches.

Each pass is a function from one stage's data to the next. With TJIT_VERIFY=1 (the test
suite sets it) a verifier checks each stage's data before the next pass reads it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence, Union

from .analysis.addresses import extent
from .analysis.bounds import outside, reached
from .errors import TjitError
from .frontend.convert import Conversion
from .frontend.trace import Traced, convert_traced, trace
from .ir.graph import format_graph, value_graph
from .ir import (AxisStrategy, Contiguous, Cumulative, Elementwise, Extern, Graph, GraphNode, Input, Reduce, View,
                 ViewOp, toposort)
from .ir.ops import OPS, REDUCE_OPS, SCAN_OPS
from .lower import HasSteps, LibraryPlan, lower
from .lower.codegen import KernelPlan
from .lower.fusion import KernelGroup
from .memory import MemoryPlan
from .memory.donation import last_read_step, place_in_regions
from .memory.liveness import SlabBuffer, plan_memory, plan_slab

StrategyMap = Mapping[str, Sequence[AxisStrategy]]
Step = Union[KernelPlan, LibraryPlan]


@dataclass
class Program(HasSteps):
    """What runs for one compiled form: the steps in order and where their memory is."""
    graph: Graph
    steps: list[Step]  # kernels and library calls, in the order they run (each writes something)
    groups: list[KernelGroup]  # the fused stores of each kernel
    buffers: list[GraphNode]  # materialised intermediates
    memory: MemoryPlan  # the slab: offsets of the buffers that live there
    slab_buffers: list[SlabBuffer]
    # a buffer that lives in another's memory (an accumulated total's) -> that buffer's key
    aliases: dict[tuple, tuple] = field(default_factory=dict)
    # donated input name -> (buffer, byte offset in its memory) for the buffers placed there
    donated: dict[str, list[tuple[SlabBuffer, int]]] = field(default_factory=dict)
    # outputs returned as the library call that computes them left them (name -> Extern node)
    call_outputs: dict[str, GraphNode] = field(default_factory=dict)
    # the slab's buffers each in memory of its own instead, allocated right before the step
    # that writes it and freed after its last reader, as eager's intermediates are
    # (with_buffers_apart); `memory` is then the plan they would have in a slab
    buffers_apart: bool = False
    # outputs whose memory is a buffer the kernels write and read (name -> Contiguous node)
    buffer_outputs: dict[str, GraphNode] = field(default_factory=dict)


# -- the passes ------------------------------------------------------------------------------------
def trace_and_convert(fn: Callable, args: tuple, kwargs: dict, requires_grad: frozenset = frozenset(),
                      check: Optional[Callable[[Traced], None]] = None) -> Conversion:
    """trace + convert: the function's IR graph and how its results are made (the tensors
    named in requires_grad traced as requiring grad; check: called with the trace first)."""
    conversion = trace(fn, args, kwargs, requires_grad, check)
    verify("convert", verify_graph, conversion.graph)
    verify("convert", verify_constants, conversion)
    return conversion


def convert(traced: Traced, retrace: Optional[Callable[[], Conversion]] = None,
            check: Optional[Callable[[Traced], None]] = None) -> Conversion:
    """convert alone: the IR graph of a trace with concrete sizes (a shape class's symbolic
    trace specialised to a call's sizes: frontend/shape_class.py). retrace: the conversion of
    a trace at those sizes, which the verifier compares it with; check: called with the trace
    first."""
    if check is not None:
        check(traced)
    conversion = convert_traced(traced)
    verify("convert", verify_graph, conversion.graph)
    verify("convert", verify_constants, conversion)
    if retrace is not None:
        verify("specialise", verify_specialised, conversion, retrace)
    return conversion


def build_program(graph: Graph, output_strides: dict[str, tuple[int, ...]], strategies: Optional[StrategyMap] = None,
                  device: str = "cuda", donated: Optional[dict[str, int]] = None) -> Program:
    """partition + codegen + memory: the Program of an IR graph. output_strides: the layout
    of each graph output; donated: input name -> bytes of its memory the caller gives up."""
    verify("convert", verify_graph, graph)
    graph = value_graph(graph)
    lowered = lower(graph, output_strides, strategies, device)
    steps = [s for s in lowered.steps if s.writes_anything]
    verify("codegen", verify_steps, graph, steps)
    verify("codegen", verify_bounds, graph, steps, output_strides)
    outside = torch_allocated(steps) | frozenset(id(node) for node in lowered.buffer_outputs.values())
    memory, slab_buffers, aliases = plan_memory(steps, outside)
    program = Program(graph, steps, lowered.groups, lowered.buffers, memory, slab_buffers, aliases=aliases,
                      call_outputs=lowered.call_outputs, buffer_outputs=lowered.buffer_outputs)
    if donated:
        place_donated(program, donated)
    verify("memory", verify_memory, program)
    return program


def torch_allocated(steps: list[Step]) -> frozenset[int]:
    """Ids of the library calls' results that live outside the planned memory."""
    return frozenset(id(r) for step in steps if isinstance(step, LibraryPlan) for r in step.torch_allocated)


def with_tape_donated(program: Program, tape: dict[str, int]) -> Program:
    """The program of a backward that runs once, given the tape blocks (saved value name ->
    bytes), each freed after the last step that needs it (see place_donated); the program
    itself unchanged."""
    found = replace(program, donated={})
    place_donated(found, tape, freed_when_read=True)
    return found


def with_library_results_apart(program: Program) -> Optional[Program]:
    """The program with every library call's results in memory torch allocates at the call
    and frees after their last reader, as eager's are, rather than in the slab (which holds
    its largest moment for the whole step: a pooling backward's result, live for two
    steps, sizes a backward's slab); None if no result is in the slab."""
    if not any(isinstance(step, LibraryPlan) and step.in_slab for step in program.steps):
        return None
    steps = [replace(step, in_slab=()) if isinstance(step, LibraryPlan) else step for step in program.steps]
    outside = torch_allocated(steps) | frozenset(id(node) for node in program.buffer_outputs.values())
    memory, slab_buffers, aliases = plan_memory(steps, outside)
    return replace(program, steps=steps, memory=memory, slab_buffers=slab_buffers, aliases=aliases, donated={})


def with_buffers_apart(program: Program) -> Optional[Program]:
    """The program with no slab: every buffer in memory of its own, allocated at the step
    that writes it and freed after its last reader (library results included, which the
    calls write through out= there). A training step holds the slabs of its forward and
    backward from its start to its end, though most of their bytes are idle at the step's
    peak (a backward's largest buffers live for a few steps); allocated this way, each
    buffer counts only while it lives. None if the slab holds nothing (or a donated input
    hosts some of it)."""
    if not program.slab_buffers or program.donated:
        return None
    return replace(program, buffers_apart=True)


def place_donated(program: Program, donated: dict[str, int], freed_when_read: bool = False) -> None:
    """Buffers born after the last read of a donated input live in its memory (see
    place_in_regions); the slab is planned again without them."""
    regions = {name: (last_read_step(program.steps, name) + 1, capacity) for name, capacity in donated.items()}
    placed = place_in_regions(program.slab_buffers, regions, freed_when_read)
    for name in donated:
        offsets = placed.get(name, {})
        program.donated[name] = [(b, offsets[b.key]) for b in program.slab_buffers if b.key in offsets]
    hosted = {key for offsets in placed.values() for key in offsets}
    program.slab_buffers = [b for b in program.slab_buffers if b.key not in hosted]
    program.memory = plan_slab(program.slab_buffers)


# -- verifiers between the passes ---------------------------------------------------------------------
class VerifyError(TjitError, AssertionError):
    """A pass handed the next one data that breaks an invariant: a bug in tjit."""


def verifying() -> bool:
    return os.environ.get("TJIT_VERIFY") == "1"


def verify(stage: str, check: Callable, *data) -> None:
    if verifying():
        problem = check(*data)
        if problem:
            raise VerifyError(f"after {stage}: {problem}")


def verify_graph(graph: Graph) -> Optional[str]:
    """IR invariants: views read only leaves (inputs, literals, buffers, calls' results),
    elementwise operands have the node's shape, every input read is a declared input, every
    op is a registered one."""
    declared = set(graph.input_names)
    for node in toposort(graph.roots()):
        problem = unregistered_op(node)
        if problem:
            return problem
        if isinstance(node.op, Input) and node.op.name not in declared:
            return f"input {node.op.name!r} is read but not an input of the graph"
        if isinstance(node.op, Elementwise) and any(s.shape != node.shape for s in node.src):
            return f"{node.op.op}: operand shapes {[s.shape for s in node.src]} differ from {node.shape}"
        if isinstance(node.op, ViewOp) and isinstance(node.src[0].op, (Elementwise, ViewOp)):
            return f"a view of a {type(node.src[0].op).__name__} (views are pushed to the leaves)"
        if isinstance(node.op, (Contiguous, Extern)) and node.view.numel != math.prod(node.shape):
            return f"{type(node.op).__name__} node with view {node.view} of another size than its shape"
    return None


def verify_constants(conversion: Conversion) -> Optional[str]:
    """Every read of a tensor the conversion made itself (an index table, a literal tensor)
    stays inside that tensor: the bounds proofs (verify_bounds) take an input's view as its
    memory, which for these the conversion chose, not the caller."""
    for name, tensor in conversion.constants.items():
        elements = tensor.untyped_storage().nbytes() // max(1, tensor.element_size()) - tensor.storage_offset()
        for node in conversion.graph.input_nodes(name):
            if node.view.numel == 0:
                continue
            low, high = extent(node.view)
            if low < 0 or high >= elements:
                return f"constant {name} of {elements} elements is read at offsets {low} to {high} ({node.view})"
    return None


def unregistered_op(node: GraphNode) -> Optional[str]:
    """An elementwise op missing from the op registry (or with another number of operands
    than its arity there), or a reduction or scan tjit does not know."""
    op = node.op
    if isinstance(op, Elementwise):
        known = OPS.get(op.op)
        if known is None:
            return f"elementwise op {op.op!r} is not registered (tjit/ir/ops.py OPS)"
        if len(node.src) != known.arity:
            return f"{op.op} has {len(node.src)} operands, its arity is {known.arity}"
    if isinstance(op, Reduce) and op.op not in REDUCE_OPS:
        return f"reduction {op.op!r} is not one of ir/ops.py REDUCE_OPS"
    if isinstance(op, Cumulative) and op.op not in SCAN_OPS:
        return f"scan {op.op!r} is not one of ir/ops.py SCAN_OPS"
    return None


def verify_specialised(conversion: Conversion, retrace: Callable[[], Conversion]) -> Optional[str]:
    """A graph specialised from a symbolic trace is the graph a trace at its sizes gives."""
    expected = format_graph(retrace().graph)
    if format_graph(conversion.graph) != expected:
        return f"the specialised graph differs from a trace at its sizes:\n{format_graph(conversion.graph)}\n" \
               f"traced:\n{expected}"
    return None


def verify_steps(graph: Graph, steps: list[Step]) -> Optional[str]:
    """Every buffer a step reads was written by an earlier step, or earlier in the step by
    the programs its last program waits for (inputs are bound by the caller); no step writes
    an input the graph does not write."""
    written: set[int] = set()
    mutated = {m.name for m in graph.mutations}

    def note_stores(accesses):
        written.update(id(a.buffer.node) for a in accesses if a.store and a.buffer.kind == "buffer")

    for k, step in enumerate(steps):
        waited = len(step.accesses) - getattr(step, "last_program_accesses", 0)
        for n, access in enumerate(step.accesses):
            if n == waited:
                note_stores(step.accesses[:n])
            if n > waited:  # the last program runs those members one after another
                note_stores([step.accesses[n - 1]])
            ref = access.buffer
            if ref.kind == "buffer" and not access.store and id(ref.node) not in written \
                    and math.prod(ref.node.shape):  # (no kernel writes a buffer of no elements: none needs to)
                return f"step {k} ({step.name}) reads buffer {ref.name or ref.node.op} before any step writes it"
            if ref.kind == "input" and access.store and ref.name not in mutated:
                return f"step {k} ({step.name}) writes input {ref.name!r}, which the function does not write"
        note_stores(step.accesses)
    return None


def verify_bounds(graph: Graph, steps: list[Step], output_strides: dict[str, tuple[int, ...]]) -> Optional[str]:
    """Every access of every kernel stays inside the memory its pointer is bound to: an
    input's layout, an output's, a slab buffer's elements (analysis/bounds.py)."""
    for k, step in enumerate(steps):
        for n, access in enumerate(step.accesses if isinstance(step, KernelPlan) else ()):
            ref = access.buffer
            allowed = _bound_layout(graph, ref, output_strides)
            if allowed is None:
                continue
            problem = outside(reached(access.counted, access.gather, access.offsets_of), allowed)
            if problem:
                return (f"step {k} ({step.name}), access {n}: the {'store to' if access.store else 'load of'} "
                        f"{ref.kind} {ref.name or ref.node.op} can leave its memory: {problem}")
    return None


def _bound_layout(graph: Graph, ref, output_strides) -> Optional[View]:
    """The layout a pointer is bound to, where the compiled form knows it (not the runtime's
    status words and scratch)."""
    if ref.kind == "input" and graph.input_node(ref.name) is not None:
        return graph.input_node(ref.name).view
    if ref.kind == "output" and ref.name in graph.outputs:
        shape = tuple(graph.outputs[ref.name].shape)
        return View(shape, tuple(output_strides.get(ref.name) or View.contiguous(shape).strides))
    if ref.kind == "buffer":
        return View.contiguous((math.prod(ref.node.shape),))
    return None


def verify_memory(program: Program) -> Optional[str]:
    """The slab plan keeps every two buffers that are live at once apart (planner's check),
    and every buffer a step reads lives somewhere (the slab, a donated input, an output, or
    memory a library call allocates)."""
    try:
        program.memory.check()
    except Exception as e:
        return f"slab plan: {e}"
    placed = {b.key for b in program.slab_buffers} | {b.key for v in program.donated.values() for b, _ in v}
    placed |= program.aliases.keys()
    outside = torch_allocated(program.steps) | {id(node) for node in program.buffer_outputs.values()}
    for k, step in enumerate(program.steps):
        for access in step.accesses:
            ref = access.buffer
            if ref.kind == "buffer" and id(ref.node) not in outside and ("buffer", id(ref.node)) not in placed:
                return f"step {k} ({step.name}) accesses a buffer that has no place in memory"
    return None

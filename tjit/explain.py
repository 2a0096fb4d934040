"""tjit.explain(fn, *args): what tjit generates for these arguments, without running it."""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import Optional

from .frontend.trace import argument_copies
from .ir import Graph
from .lower import LibraryPlan
from .lower.codegen import KernelPlan
from .memory import MemoryPlan
from .memory.peak import PeakMemory
from .runtime.split import SplitFunction


@dataclass
class KernelReport:
    name: str
    shape: tuple[int, ...]
    source: str
    strategies: list[str]
    bytes_read: int
    bytes_written: int
    grid: tuple[int, ...]
    notes: tuple[str, ...] = ()  # its in-place writes, and the copies made for them
    tensors: dict[str, str] = field(default_factory=dict)  # its pointer arguments' names -> the tensors they are


@dataclass
class LibraryCallReport:
    """An aten op run as itself (a library call), between the kernels, and where its
    results go: through its out= form into the slab, or allocated by torch."""
    name: str
    op: str
    bytes_read: int
    bytes_written: int
    results_memory: str

    @staticmethod
    def of(plan: LibraryPlan) -> "LibraryCallReport":
        return LibraryCallReport(plan.name, plan.call.name, plan.bytes_read, plan.bytes_written, results_memory(plan))


def results_memory(plan: LibraryPlan) -> str:
    if plan.out_form is None:
        return "it has no out= form tjit can use: torch allocates its results"
    parts = []
    if plan.in_slab:
        parts.append(f"{len(plan.in_slab)} result(s) into the slab")
    if plan.torch_allocated:
        parts.append(f"{len(plan.torch_allocated)} into memory of their own (returned, or in a layout the slab "
                     "does not hold)")
    return f"through {plan.out_form}: " + (", ".join(parts) or "no result is read")


@dataclass
class Explanation:
    graph: Graph
    kernels: list[KernelReport]
    eager_ops: int
    memory: Optional[MemoryPlan] = None  # the slab: every intermediate at its offset
    # with inputs that require grad: the backward for dense incoming gradients, and the
    # values the forward keeps for it (input, output and saved intermediate names)
    backward: Optional["Explanation"] = None
    saved: tuple[str, ...] = ()
    library_calls: list[LibraryCallReport] = field(default_factory=list)
    steps: list = field(default_factory=list)  # kernels and library calls, in the order they run
    # the predicted peak of a call, or of a training step (forward + backward) when inputs
    # require grad: memory held between calls plus what the call allocates (tjit.memory.peak)
    peak_memory: Optional[PeakMemory] = None
    # float or int argument -> how the kernels get it: a runtime number (a 0-d tensor they read,
    # a new value compiles nothing) or specialised (baked in; why)
    numbers: dict[str, str] = field(default_factory=dict)
    # input name -> the buffers that live in its memory once it has been read (a donated
    # input; in a backward, a saved value's tape block), as (buffer name, bytes)
    hosted: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    # how each matrix product of the traced function is computed, and why (frontend/matmul.py)
    matmuls: list[str] = field(default_factory=list)
    # the buffers of `memory` each in memory of its own, allocated and freed around the steps
    # that use it, rather than in a slab (pipeline.with_buffers_apart)
    buffers_apart: bool = False
    disk: str = ""  # whether the entry was loaded from the disk cache, stored there, or why not (runtime/disk_cache.py)

    @property
    def bytes_moved(self) -> int:
        return sum(k.bytes_read + k.bytes_written for k in self.kernels)

    def __str__(self) -> str:
        calls = f" and {len(self.library_calls)} library call(s)" if self.library_calls else ""
        lines = [str(self.graph), "",
                 f"{len(self.kernels)} kernel(s){calls} (eager: {self.eager_ops} op(s)), {self.bytes_moved} bytes moved"]
        for k in self.steps or self.kernels:
            if isinstance(k, LibraryCallReport):
                lines += ["", f"library call {k.op}: reads {k.bytes_read} B, writes {k.bytes_written} B; "
                              f"{k.results_memory}"]
                continue
            lines += ["", f"kernel {k.name}: shape {list(k.shape)}, grid {k.grid}, "
                          f"reads {k.bytes_read} B, writes {k.bytes_written} B"]
            lines += [f"  {s}" for s in k.strategies]
            lines += [f"  {note}" for note in k.notes]
            if k.tensors:
                lines.append("  " + ", ".join(f"{param.removesuffix('_ptr')}: {name}" for param, name in k.tensors.items()))
            lines.append(k.source)
        lines += [f"number argument {name}: {how}" for name, how in self.numbers.items()]
        lines += [f"matrix product {how}" for how in self.matmuls]
        if self.disk:
            lines.append(f"disk cache: {self.disk}")
        if self.memory is not None and self.memory.intervals:
            lines += ["", "memory plan (steps are kernel launches and library calls, in order):", self.memory.format()]
            if self.buffers_apart:
                lines.append("its buffers live apart, not in a slab: each is allocated right before the step that "
                             "writes it and freed after its last read (this lowers the training step's peak)")
        for name, buffers in self.hosted.items():
            lines.append(f"in {name}'s memory after its last read: " + ", ".join(f"{b} ({n} B)" for b, n in buffers))
        if self.peak_memory is not None:
            lines += ["", str(self.peak_memory)]
        if self.backward is not None:
            lines += ["", f"saved for backward: {', '.join(self.saved) or 'nothing'}", "", "backward:",
                      str(self.backward)]
        return "\n".join(lines)


@dataclass
class SplitExplanation:
    """A function one trace cannot hold (it needs tensor data to go on), run split by
    Dynamo's graph breaks: per graph between the breaks, tjit's Explanation, or why that
    graph runs eagerly. The data-dependent ops themselves run eagerly between the graphs."""
    reason: str
    graphs: list  # Explanation, or str: why the graph runs eagerly
    eager: bool = False  # the whole function runs eagerly, without Dynamo (reason says why)

    @property
    def kernels(self) -> list[KernelReport]:
        return [k for g in self.graphs if isinstance(g, Explanation) for k in g.kernels]

    @property
    def library_calls(self) -> list[LibraryCallReport]:
        return [c for g in self.graphs if isinstance(g, Explanation) for c in g.library_calls]

    def __str__(self) -> str:
        if self.eager:
            return f"runs eagerly, neither traced nor run by Dynamo: {self.reason}"
        lines = [f"split by Dynamo into {len(self.graphs)} graph(s), what one trace cannot hold runs eagerly between "
                 f"them; first: {self.reason}"]
        for k, g in enumerate(self.graphs):
            lines += ["", f"graph {k}:", str(g) if isinstance(g, Explanation) else f"runs eagerly: {g}"]
        return "\n".join(lines)


def report(plan: KernelPlan) -> KernelReport:
    # (a kernel's source names its inputs and outputs by their places: in0, out0, ...)
    tensors = {param: buffer.name for param, buffer in zip(plan.param_names, plan.buffers) if buffer.label}
    return KernelReport(plan.name, plan.shape, plan.source, [d.describe() for d in plan.space.loop_dims],
                        plan.bytes_read, plan.bytes_written, plan.grid, plan.notes, tensors)


def explain(fn, *args, **kwargs) -> Explanation:
    from .runtime.compiled import CompiledFunction
    compiled = fn if isinstance(fn, CompiledFunction) else CompiledFunction(fn)
    entry = compiled.entry_for(*args, **kwargs)
    if isinstance(entry.executable, SplitFunction):
        return _explain_split(entry.executable, args, kwargs)
    explanation = _explain_entry(entry, _device_type(args, kwargs))
    explanation.numbers = _numbers(compiled, entry, args, kwargs)
    explanation.disk = _disk(compiled, entry)
    return explanation


def _explain_entry(entry, device_type: str) -> Explanation:
    """A compiled entry's kernels and memory; with inputs that require grad (a GradExecutable),
    its backward, what the forward saves for it, and the training step's peak too."""
    plan = getattr(entry.executable, "plan", None)
    # (compiling the backward chooses how the forward's buffers are held too)
    backward = entry.executable.backward_executable(entry.executable.dense_layouts()) if plan is not None else None
    explanation = _explain(entry.executable, entry.eager_ops)
    forward = getattr(entry.executable, "forward", entry.executable)  # (a GradExecutable's forward)
    explanation.matmuls = [c.describe() for c in forward.conversion.matmul_choices]
    if plan is not None:
        explanation.backward = _explain(backward, 0)
        explanation.saved = plan.saved_inputs + plan.saved_outputs + tuple(plan.saved)
        explanation.peak_memory = entry.executable.training_step_memory(device_type)
    else:
        explanation.peak_memory = entry.executable.call_memory(device_type)
    return explanation


def _numbers(compiled, entry, args, kwargs) -> dict[str, str]:
    """Per float or int argument: a runtime number, or specialised and why."""
    found = {}
    for name, v in compiled._flatten(args, kwargs):
        if type(v) not in (float, int):
            continue
        if name in entry.numbers:
            found[name] = (f"a runtime number (a 0-d {'float64' if type(v) is float else 'int64'} tensor the kernels "
                           "read; a new value compiles nothing)")
            continue
        if name not in compiled._number_parameters:
            why = "passed in *args or **kwargs"
        elif type(v) is float:
            why = compiled.literal_numbers
        else:
            why = compiled.literal_ints.get(name, "an int is specialised on its first value; a call with another value "
                                                  "makes it a runtime number where the function allows it")
        found[name] = f"specialised ({type(v).__name__} {v} is in the kernels): {why}"
    return found


def _disk(compiled, entry) -> str:
    from .runtime import disk_cache
    if not disk_cache.enabled():
        return "off (TJIT_DISK_CACHE=0)"
    if entry.from_disk:
        return "loaded: an earlier process compiled it, so it was not traced"
    if compiled.not_on_disk:
        return f"not stored: {compiled.not_on_disk}"
    return f"stored in {disk_cache.programs_dir()}: a fresh process that makes this call loads it"


def _device_type(args, kwargs) -> str:
    """The device type of the call's tensors (the CPU without tensors, as the runtime)."""
    import torch
    tensors = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    return tensors[0].device.type if tensors else "cpu"


def _explain_split(split: SplitFunction, args, kwargs) -> SplitExplanation:
    """Dynamo finds the graphs by running the function: it runs on copies of the arguments."""
    if split.eager:
        return SplitExplanation(split.reason, [], eager=True)
    copies = argument_copies(args, kwargs)
    known = len(split.graphs)
    split(*copies)
    graphs = []
    for graph in split.graphs[known:] or split.graphs:
        graphs += _explain_graph(graph, _device_type(args, kwargs))
    return SplitExplanation(split.reason, graphs)


def _explain_graph(graph, device_type: str) -> list:
    """A graph Dynamo handed over: its Explanation, why it runs eagerly, or (a graph cut
    around custom autograd.Functions) each compiled part's and a note for the Functions."""
    if graph.parts:
        return [g for part in graph.parts for g in _explain_graph(part, device_type)] + \
            ["the custom autograd.Function(s) between the parts above (their backward is the user's Python)"]
    if graph.eager_because is not None:
        return [graph.eager_because]
    return [_explain_entry(next(reversed(graph.compiled._cache.values())), device_type)]


def _explain(executable, eager_ops: int) -> Explanation:
    steps = [LibraryCallReport.of(p) if isinstance(p, LibraryPlan)
             else report(p) for p in executable.program.steps]
    return Explanation(executable.graph, [s for s in steps if isinstance(s, KernelReport)], eager_ops,
                       executable.memory_plan,
                       library_calls=[s for s in steps if isinstance(s, LibraryCallReport)], steps=steps,
                       hosted={name: [(b.name, b.nbytes) for b, _ in placed]
                               for name, placed in executable.program.donated.items() if placed},
                       buffers_apart=executable.program.buffers_apart)

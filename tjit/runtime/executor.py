"""Run a lowered graph: allocate outputs and buffers, bind pointers, launch, assemble outputs.

Everything that does not depend on the call's tensors (scalar arguments, grids, output
layouts) was computed at trace time; a call only allocates and binds pointers.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

import numpy as np
import torch

from .. import debug
from ..analysis.addresses import tensors_meet
from ..autograd import tape
from ..errors import CompileArgumentError
from ..frontend.convert import Conversion, OutputSpec
from ..ir import GraphNode, ViewOp
from ..lower import LibraryPlan
from ..lower.codegen import ZERO_DIV_FLAG, BufferRef, KernelPlan
from ..lower import gpu_compile
from ..memory.donation import give_up
from ..pipeline import Program
from ..memory.peak import Allocation, PeakMemory, allocated_bytes, relabel, release, strided_bytes
from ..memory.slab import POOL, Slab
from .counters import counters
from . import precompile
from .interpreter import interpreting
from .library import call_allocations, memory_key, run_library_call
from .loader import load_kernel, note_launch_config
from .relaunch import Binaries


# Triton's interpreter is not thread-safe: a launch patches triton.language and keeps the
# running program's id in process-wide state. So interpreted launches run one at a time,
# under the lock gpu_compile holds while it swaps interpreted functions for compiler ones
# (everything else a call touches is its thread's own: slab, status and counter words).
INTERPRETER_LOCK = gpu_compile._lock


@dataclass
class RunAllocations:
    """What one run allocates (Executable.allocations): `during` the run, in order; `at_end`,
    the releases when the run's memory is dropped (library results no output holds);
    `outputs` (by graph output name, library results returned as they are among them) and
    the `tape` (saved value name -> its allocation) outlive the run."""
    during: list = field(default_factory=list)
    at_end: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)
    tape: dict = field(default_factory=dict)


@dataclass
class Launch:
    plan: KernelPlan
    fn: Any
    args_template: list  # BufferRefs (bound per call) followed by ints
    constexprs: dict  # the plan's, with ZERO_DIV_FLAG set when the interpreter runs it
    step: int  # its place among the steps (where its status and counter words are)
    # per argument, (the memory key a call binds it to, None) or (None, the int itself): the
    # binding precomputed, since every launch of every call pays for it
    bound: list = field(init=False)
    pointers: list = field(init=False)  # the arguments that are tensors
    # the alignments of its pointers for which Triton's specialisation was noted already
    noted: set = field(init=False, default_factory=set)
    binaries: Optional[Binaries] = field(init=False, default=None)  # on a GPU: launched again directly

    def __post_init__(self):
        self.bound = [(memory_key_of(a, self.step), None) if isinstance(a, BufferRef) else (None, a)
                      for a in self.args_template]
        self.pointers = [j for j, (key, _) in enumerate(self.bound) if key is not None]


class Executable:
    """Runs a Program (tjit/pipeline.py): binds memory, launches its steps in order."""

    def __init__(self, conversion: Conversion, program: Program, tape: Optional[Mapping[str, tuple[int, ...]]] = None):
        """tape: graph outputs that are kept for backward rather than returned (name -> the
        strides they are kept in); each call allocates each of them as an output (see
        tjit.autograd.tape), so that a backward can free each once it has read it."""
        self.conversion, self.program = conversion, program
        self._tape_strides = dict(tape or {})
        self.graph = conversion.graph
        self.tape = [(name, TapeValue(self.graph.outputs[name], strides)) for name, strides in (tape or {}).items()
                     if name not in program.call_outputs]
        self._constant_copies: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._interpreting = interpreting()
        # the steps in order: kernel launches, and library calls (LibraryPlans, run as they are)
        self.launches = [p if isinstance(p, LibraryPlan) else
                         Launch(p, load_kernel(p), list(p.buffers) + list(p.scalar_args), self._constexprs(p), k)
                         for k, p in enumerate(program.steps)]
        if not self._interpreting:
            for launch in self.launches:
                if isinstance(launch, Launch) and launch.pointers:
                    binaries = Binaries(launch.fn, launch.plan.param_names, launch.constexprs, launch.plan.grid)
                    launch.binaries = binaries if binaries.usable() else None
        self._slabs: dict[tuple, Slab] = {}
        self._precompiled: set = set()  # devices whose kernels were compiled before the first launch there
        self._status: dict[torch.device, torch.Tensor] = {}
        self._counters: dict[torch.device, torch.Tensor] = {}
        # the launches that take a status or a counter word, in the order of their words: only
        # those (a function whose kernels check nothing and reduce over no grid holds none)
        self._word_users = {kind: [step for step in self.launches if isinstance(step, Launch)
                                   and any(ref.kind == kind for ref in step.plan.buffers)]
                            for kind in ("status", "counter")}
        # kernels with checks take a status word; it is read after the call (one sync) when a
        # check is made: always in the interpreter, only index checks in compiled kernels
        # (integer division by zero is not checked there: CUDA eager does not raise)
        self._reads_status = any(self._interpreting or not check.interpreted_only
                                 for step in self._word_users["status"] for check in step.plan.checks)
        self._words: dict[tuple, dict] = {}  # (device, thread) -> each launch's status and counter views
        self._dead_after = _dead_library_results(program)
        # buffers in memory of their own (Program.buffers_apart): allocated right before the
        # step that writes them, with the buffers that accumulate in their memory (aliases), and
        # let go of after their last reader
        self._apart_before: list[list] = [[] for _ in self.launches]
        self._apart_dead_after: list[list] = [[] for _ in self.launches]
        for buffer in program.slab_buffers if program.buffers_apart else ():
            self._apart_before[buffer.first].append(buffer)
            self._apart_dead_after[buffer.end - 1].append(buffer)
        self._aliases_of: dict[tuple, list] = {}
        for key, home in program.aliases.items():
            self._aliases_of.setdefault(home, []).append(key)
        # each computed output is allocated right before the first step that touches it (a
        # backward's gradients as they are computed, not all before the first kernel)
        self._outputs_before: list[list[int]] = [[] for _ in self.launches]
        self._outputs_at_start: list[int] = []  # (those no step touches: a zero-size output)
        first = {**_first_access(program.steps, "output"), **_first_buffer_access(program.steps, program.buffer_outputs)}
        for k, spec in enumerate(conversion.outputs):
            if spec.kind == "computed" and spec.name not in program.call_outputs:
                (self._outputs_before[first[spec.name]] if spec.name in first else self._outputs_at_start).append(k)
        # so is each saved value, in a tape block of its own
        self._tape_before: list[list[tuple]] = [[] for _ in self.launches]
        self._tape_at_start: list[tuple] = []
        for name, value in self.tape:
            (self._tape_before[first[name]] if name in first else self._tape_at_start).append((name, value))
        # the last step that needs each input's memory: its last reader, or for a donated input,
        # the last reader of a buffer living there (a consumable input is freed after it)
        self._last_input_read = _last_read_of_inputs(program.steps)
        for name, placed in program.donated.items():
            self._last_input_read[name] = max([self._last_input_read.get(name, 0)] + [b.end - 1 for b, _ in placed])

    # (pickled into the disk cache, runtime/disk_cache.py: what it was made from; loading
    # makes it again, so its kernels are loaded and its per-device state starts empty)
    def __getstate__(self) -> tuple:
        return self.conversion, self.program, self._tape_strides

    def __setstate__(self, state: tuple) -> None:
        self.__init__(*state)

    def __call__(self, tensors: dict[str, torch.Tensor], out=None):
        destinations = self._destinations(out, tensors, self.device_of(tensors)) if out is not None else {}
        result = self.assemble(self.run(tensors, destinations))
        return result if out is None else self._into(out, result)

    def run(self, tensors: dict[str, torch.Tensor], destinations: Optional[dict] = None,
            consumable: frozenset = frozenset()) -> dict:
        """Launch every kernel; returns the call's memory: ("output", name) -> each computed
        output (tape outputs included), plus the inputs and this call's buffers. consumable:
        inputs the caller gives up (values saved for a backward that runs once): the memory
        of each is freed after the last step that reads it, unless another input shares it."""
        device = self.device_of(tensors)
        where = (device, threading.get_ident())  # (the slab and words are kept per device and thread)
        poison = debug.poisoning()  # (read once per run: an environment read costs a microsecond)
        memory = dict(tensors)
        memory.update(self.constants_on(device))
        slab = self._slab_for(where)
        try:
            memory.update(self._allocate(device, destinations or {}, slab, poison))
            if self.donated:
                memory.update(self._donated_views(tensors))
            for key, home in self.program.aliases.items():  # (an accumulated total, in its chain's memory)
                if home in memory:  # (a buffer apart binds its aliases when it is allocated)
                    memory[key] = memory[home]
            memory.update(self._words_on(where))
            if not self._interpreting and device not in self._precompiled and precompile.enabled():
                self._precompiled.add(device)
                precompile.precompile([s for s in self.launches if isinstance(s, Launch)], memory)
            # numpy computes the interpreter's blocks: inf, NaN and integer overflow are results
            # there, as in eager, not warnings for the user (set once per run: 1.5 us a launch)
            with np.errstate(all="ignore") if self._interpreting else contextlib.nullcontext():
                self._run_steps(memory, device, destinations or {}, self._consumed_after(tensors, consumable),
                                poison)
            for name, node in self.program.call_outputs.items():
                memory[("output", name)] = self._as_output(name, memory[("buffer", id(node))])
            if self._reads_status:
                self._raise_failed_checks(memory[("status",)])
        finally:
            if slab.arena is not None:
                POOL.done(slab.arena)  # (its views in `memory` are dead now: the next run may reuse them)
            # the caller gave the donated inputs up: they may hold intermediates now, even when
            # the call raises, so a later use fails loudly rather than reading other values
            for name in self.donated:
                give_up(tensors[name])
        return memory

    def _as_output(self, name: str, result: torch.Tensor) -> torch.Tensor:
        """A library call's result as the output it is: itself, or reshaped. Not a view of
        the result (eager's linear returns an _unsafe_view too): autograd forbids writing in
        place into a view that a Function returns, and the caller may write into the output."""
        out = self.graph.outputs[name]
        if isinstance(out.op, ViewOp):  # a view of the result over its memory (a reshape, a permutation)
            shape, strides, offset = out.shape, out.view.strides, out.view.offset
        elif not result._is_view():
            return result
        else:
            shape, strides, offset = out.shape, result.stride(), 0
        return torch.empty(0, dtype=result.dtype, device=result.device).set_(
            result.untyped_storage(), result.storage_offset() + offset, shape, strides)

    def _run_steps(self, memory: dict, device, destinations: dict, consumed_after: dict, poison: bool) -> None:
        try:
            for k, step in enumerate(self.launches):
                for name, value in self._tape_before[k]:
                    self._bind_output(memory, name, _tape_memory(value, device, poison))
                for index in self._outputs_before[k]:
                    self._bind_output(memory, self.conversion.outputs[index].name,
                                      self._output_memory(index, device, destinations, poison))
                for buffer in self._apart_before[k]:
                    self._bind_apart(memory, buffer, device, poison)
                if isinstance(step, LibraryPlan):
                    run_library_call(step, memory)
                else:
                    self._launch(step, memory)
                for key in self._dead_after[k]:  # a library result in memory of its own, read for the last time
                    del memory[key]
                for buffer in self._apart_dead_after[k]:  # a buffer apart, read for the last time
                    for key in [buffer.key] + self._aliases_of.get(buffer.key, []):
                        del memory[key]
                for storage in consumed_after.get(k, ()):  # a value saved for backward, read for the last time
                    storage.resize_(0)
        except BaseException:
            if ("counter",) in memory:  # a grid reduction cut short must not skew the next call's count
                memory[("counter",)].zero_()
            raise

    # what explain(), the logs and the benchmarks read
    @property
    def memory_plan(self):
        return self.program.memory

    @property
    def slab_buffers(self):
        """The buffers that live in the slab (none when they are apart: Program.buffers_apart)."""
        return [] if self.program.buffers_apart else self.program.slab_buffers

    @property
    def donated(self) -> dict:
        return self.program.donated

    # -- what a call allocates, predicted from the plan (tjit.memory.peak) ----------------------
    def held_bytes(self, device_type: str) -> dict[str, int]:
        """Memory this function keeps between calls, per device and thread: its slab (the arena
        of the thread holds it, shared with the other graphs the thread runs: it is at least
        this large), and one int32 per launch that checks (its status word) or counts its
        finished programs (a grid reduction's counter word)."""
        words = sum(allocated_bytes(4 * len(users), device_type) for users in self._word_users.values())
        return {"slab": allocated_bytes(self.slab_size, device_type), "status words": words}

    def allocations(self, device_type: str, phase: str = "call", consumable: Optional[dict] = None) -> "RunAllocations":
        """The allocations and releases of one run, predicted from the plan, in the order run()
        makes them (see tjit.memory.peak). Without out=. consumable: input name -> the
        allocation holding it, for the inputs run() is told it may free (run's consumable)."""
        found = RunAllocations()

        def output(index: int, where: str) -> Allocation:
            spec = self.conversion.outputs[index]
            nbytes = strided_bytes(spec.shape, spec.stride, self.graph.outputs[spec.name].dtype.itemsize)
            found.outputs[spec.name] = Allocation((phase, "output", spec.name), allocated_bytes(nbytes, device_type),
                                                  "output", f"output {spec.name}", where)
            return found.outputs[spec.name]

        def saved(name: str, value: "TapeValue", where: str) -> Allocation:
            found.tape[name] = Allocation((phase, "tape", name), allocated_bytes(tape_bytes(value), device_type),
                                          "tape", f"saved value {name}", where)
            return found.tape[name]

        # _allocate: the saved values and outputs no step touches
        found.during += [saved(name, value, f"{phase} start") for name, value in self._tape_at_start]
        found.during += [output(index, f"{phase} start") for index in self._outputs_at_start]
        consumed: dict[int, list] = {}  # step -> the consumable allocations it reads last (_consumed_after)
        last: dict[object, tuple[int, Allocation]] = {}
        for name, allocation in (consumable or {}).items():
            step = self._last_input_read.get(name, 0)
            if allocation.key not in last or step > last[allocation.key][0]:
                last[allocation.key] = (step, allocation)
        for step, allocation in last.values():
            consumed.setdefault(step, []).append(allocation)
        results = {}  # memory key -> the library result in memory of its own
        apart = {}  # (phase, buffer key) -> the allocation of a buffer apart (Program.buffers_apart)
        for k, step in enumerate(self.launches):
            where = f"{phase} step {k} ({step.call.name if isinstance(step, LibraryPlan) else step.plan.name})"
            found.during += [saved(name, value, where) for name, value in self._tape_before[k]]
            found.during += [output(index, where) for index in self._outputs_before[k]]
            allocated = [Allocation((phase, b.key), allocated_bytes(b.nbytes, device_type), "buffer",
                                    f"buffer {b.name}", where) for b in self._apart_before[k]]
            found.during += [a for a in allocated if a.bytes]
            apart.update((a.key, a) for a in allocated)
            if isinstance(step, LibraryPlan):
                during, kept = call_allocations(step, device_type, where)
                found.during += during
                results.update({memory_key(node): kept[node.op.index] for node in step.results if node.op.index in kept})
            found.during += release([results.pop(key) for key in self._dead_after[k] if key in results], where)
            found.during += release([apart.pop((phase, b.key)) for b in self._apart_dead_after[k]], where)
            found.during += release(consumed.get(k, []), where)
        for name, node in self.program.call_outputs.items():  # returned as the call left them
            result = results.pop(memory_key(node), None)  # (None: a view of an operand, nothing allocated)
            if result is not None:
                found.outputs[name] = replace(result, kind="output")
        found.during = relabel(found.during, {a.key for a in found.outputs.values()}, "output")
        # the rest (results no step reads: in the slab, so none today) lives in the call's
        # memory (the dict run() returns) until the caller drops it
        found.at_end = release(results.values(), f"{phase} end")
        return found

    def call_memory(self, device_type: str) -> PeakMemory:
        """The predicted peak of a call (without out=): what this function holds between calls
        plus the most its run's allocations hold at once."""
        run = self.allocations(device_type)
        return PeakMemory(self.held_bytes(device_type), run.during + run.at_end, device_type, "call")

    def _donated_views(self, tensors) -> dict:
        views = {}
        for name, placed in self.donated.items():
            x = tensors[name]
            raw = torch.empty(0, dtype=torch.uint8, device=x.device).set_(
                x.untyped_storage(), x.storage_offset() * x.element_size(), (x.numel() * x.element_size(),))
            views.update(_typed_views(raw, placed))
        return views

    @property
    def slab_size(self) -> int:
        """Bytes of the slab a run binds (0 when the buffers are apart: Program.buffers_apart)."""
        return 0 if self.program.buffers_apart else self.memory_plan.slab_size

    def _slab_for(self, key: tuple) -> Slab:
        """This run's slab on device key[0] for thread key[1]: the start of its thread's arena
        (tjit/memory/slab.py), held until the run ends; the typed views are made on the first
        run (and again after the arena grew), then reused."""
        plan, device = self.memory_plan, key[0]
        if not self.slab_size:  # (no buffers, zero-size ones, or buffers apart: views of nothing, made once)
            slab = self._slabs.get(key)
            if slab is None:
                memory = torch.empty(0, dtype=torch.uint8, device=device)
                slab = self._slabs[key] = Slab(memory, _typed_views(memory, zip(self.slab_buffers, plan.offsets)))
            return slab
        arena = POOL.acquire(self.slab_size, device, self)
        if arena is None:  # a run on this thread holds the arena: a slab of its own for this run
            memory = torch.empty(self.slab_size, dtype=torch.uint8, device=device)
            return Slab(memory, _typed_views(memory, zip(self.slab_buffers, plan.offsets)))
        slab = self._slabs.get(key)
        if slab is None or slab.arena is not arena:
            memory = arena.memory[:self.slab_size]
            slab = self._slabs[key] = Slab(memory, _typed_views(memory, zip(self.slab_buffers, plan.offsets)), arena)
        return slab

    def slabs(self) -> list[Slab]:
        """This function's slabs (one per device and thread it ran on; each the start of that
        thread's arena, shared with the other compiled graphs the thread runs)."""
        return [s for s in list(self._slabs.values()) if s.memory.numel()]  # (other threads may add one)

    def forget_slab(self, key) -> None:
        """Drop the views into the arena of (device, thread) `key` (None: every arena's): the
        pool lets go of it."""
        if key is None:
            self._slabs.clear()
        else:
            self._slabs.pop(key, None)

    def _status_on(self, device) -> torch.Tensor:
        """One int32 per launch with checks, where its kernel reports a failed one (index out
        of range); zero while all is well, so it is allocated once (per device and thread) and kept."""
        return self._per_thread(self._status, device, len(self._word_users["status"]))

    def _counters_on(self, device) -> torch.Tensor:
        """One int32 per launch that counts finished programs (a grid reduction's); the last
        program resets it, so it is zeroed once (per device and thread, like the slab) and kept."""
        return self._per_thread(self._counters, device, len(self._word_users["counter"]))

    def _words_on(self, key: tuple) -> dict:
        """The status and counter words, and each launch's views of them (at its step), as a
        call's memory binds them, for device key[0] and thread key[1]: made once per both."""
        found = self._words.get(key)
        if found is None:
            device = key[0]
            # (keyed by tuples, as every key but an input's: an argument may be named "status")
            found = {}
            for kind, words in (("status", self._status_on), ("counter", self._counters_on)):
                if self._word_users[kind]:
                    found[(kind,)] = words(device)
                for slot, launch in enumerate(self._word_users[kind]):
                    found[(kind, launch.step)] = found[(kind,)][slot:]  # (its word, where it writes)
            self._words[key] = found
        return found

    def _per_thread(self, table: dict, device, words: int) -> torch.Tensor:
        key = (torch.device(device), threading.get_ident())
        found = table.get(key)
        if found is None:
            found = table[key] = torch.zeros(words, dtype=torch.int32, device=device)
            POOL.register(self)  # (memory held between calls: tjit.memory.stats() counts it)
        return found

    def words_bytes(self) -> int:
        """Bytes of the status and counter words this function holds (all devices and threads)."""
        return sum(t.untyped_storage().nbytes() for table in (self._status, self._counters)
                   for t in list(table.values()))

    def _raise_failed_checks(self, status: torch.Tensor) -> None:
        """The first launch's failed check raises as eager would: IndexOutOfBoundsError (an
        IndexError and a RuntimeError) for an index out of range, RuntimeError("ZeroDivisionError")
        for an integer division by zero."""
        codes = status.tolist()  # one sync, as eager's checked indexing needs
        for step, code in zip(self._word_users["status"], codes):
            if code:
                status.zero_()
                check = step.plan.checks[code - 1]
                raise check.error(check.message)

    def _constexprs(self, plan: KernelPlan) -> dict:
        if ZERO_DIV_FLAG in plan.constexprs and self._interpreting:
            return {**plan.constexprs, ZERO_DIV_FLAG: True}
        return plan.constexprs

    def device_of(self, tensors: dict[str, torch.Tensor]) -> torch.device:
        """Where the kernels run: on the arguments' device; without tensor arguments, where
        the tensors the function closes over live (a GPU one before CPU ones, which may be
        tensors it made from Python data)."""
        if tensors:
            return next(iter(tensors.values())).device
        devices = {t.device for t in self.conversion.constants.values()}
        return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))

    def constants_on(self, device) -> dict[str, torch.Tensor]:
        """Tensors the function created from Python data (torch.tensor([...])) live on the
        CPU; kernels on another device get a copy made once. A tensor it closes over and
        writes in place is never copied: its writes would land in the copy."""
        copies = self._constant_copies.get(device)
        if copies is None:
            written = {m.name for m in self.conversion.graph.mutations}
            for name, t in self.conversion.constants.items():
                if name in written and t.device != device:
                    raise CompileArgumentError(f"the function writes in place a tensor it closes over ({t.dtype}, "
                                               f"{tuple(t.shape)}) on {t.device}, but runs on {device}: eager "
                                               "raises for tensors on different devices too")
            copies = self._constant_copies[device] = {name: t.to(device) for name, t in self.conversion.constants.items()}
        return copies

    # -- destination passing ------------------------------------------------------------------
    def _expected(self, tensors) -> list[tuple[int, tuple, torch.dtype]]:
        """(flat index, shape, dtype) of each tensor result."""
        found = []
        for k, spec in enumerate(self.conversion.outputs):
            if spec.kind == "constant":
                continue
            if spec.kind == "computed":
                dtype = self.graph.outputs[spec.name].dtype.torch
                shape = spec.view[0] if spec.view is not None else spec.shape
            elif spec.kind == "input_alias":
                dtype, shape = tensors[spec.name].dtype, spec.shape
            else:
                dtype, shape = found[[i for i, *_ in found].index(spec.index)][2], spec.shape
            found.append((k, tuple(shape), dtype))
        return found

    def _destinations(self, out, tensors, device) -> dict[int, torch.Tensor]:
        """Check out= before anything runs (the caller's tensors stay untouched on an error);
        returns the out tensors the kernels can write directly, by flat result index."""
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        expected = self._expected(tensors)
        if len(outs) != len(expected) or not all(isinstance(o, torch.Tensor) for o in outs):
            raise CompileArgumentError(f"out= needs {len(expected)} tensor(s), one per tensor result; got "
                                       f"{[type(o).__name__ for o in outs]}")
        direct = {}
        for n, (o, (k, shape, dtype)) in enumerate(zip(outs, expected)):
            if tuple(o.shape) != shape or o.dtype != dtype or o.device != device:
                raise CompileArgumentError(f"out[{n}] is {o.dtype} {list(o.shape)} on {o.device}; the result is "
                                           f"{dtype} {list(shape)} on {device}")
            for name, t in list(tensors.items()) + [(f"out[{m}]", p) for m, p in enumerate(outs[:n])]:
                if tensors_meet(o, t):
                    raise CompileArgumentError(f"out[{n}] overlaps {'input ' + repr(name) if '[' not in name else name}"
                                               "; the results must go to memory of their own")
            spec = self.conversion.outputs[k]
            if spec.kind == "computed" and spec.view is None and o.stride() == spec.stride:
                direct[k] = o
        return direct

    def _into(self, out, result):
        """Copy the results the kernels did not write in place into out; return out."""
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        flat = torch.utils._pytree.tree_flatten(result)[0]
        tensors = [r for r in flat if isinstance(r, torch.Tensor)]
        for o, r in zip(outs, tensors):
            if o is not r:
                o.copy_(r)
        return out

    def _allocate(self, device, destinations: dict, slab: Slab, poison: bool) -> dict[str, torch.Tensor]:
        """The memory a run binds before its first step: the slab (the outputs and saved
        values are allocated right before the first step that touches each: _run_steps; a
        call's result is the output, bound after the call)."""
        out = dict(slab.views)
        if poison:
            for t in out.values():
                debug.poison(t)
        for name, value in self._tape_at_start:
            self._bind_output(out, name, _tape_memory(value, device, poison))
        for k in self._outputs_at_start:
            self._bind_output(out, self.conversion.outputs[k].name, self._output_memory(k, device, destinations, poison))
        return out

    def _bind_output(self, memory: dict, name: str, tensor: torch.Tensor) -> None:
        """Output `name`'s memory, which is also the memory of the buffer it is (if it is one:
        the steps write and read it as that buffer, the output may be a view of it in another
        dim order)."""
        memory[("output", name)] = tensor
        node = self.program.buffer_outputs.get(name)
        if node is not None:
            memory[("buffer", id(node))] = tensor.as_strided(node.shape, node.view.strides, tensor.storage_offset())

    def _bind_apart(self, memory: dict, buffer, device, poison: bool) -> None:
        """A buffer apart's memory, which the buffers accumulated in it share."""
        found = torch.empty(buffer.shape, dtype=buffer.dtype.torch, device=device)
        if poison:
            debug.poison(found)
        for key in [buffer.key] + self._aliases_of.get(buffer.key, []):
            memory[key] = found

    def _output_memory(self, index: int, device, destinations: dict, poison: bool) -> torch.Tensor:
        """Computed output `index`: the caller's out= tensor for it, or new memory."""
        if index in destinations:
            found = destinations[index]
        else:
            spec = self.conversion.outputs[index]
            found = torch.empty_strided(spec.shape, spec.stride, dtype=self.graph.outputs[spec.name].dtype.torch,
                                        device=device)
        if poison:
            debug.poison(found)
        return found

    def _consumed_after(self, tensors: dict, consumable: frozenset) -> dict[int, list]:
        """Step -> the storages of consumable inputs that step reads for the last time (a
        storage that an input the caller keeps shares is not freed; one that several
        consumable inputs share is freed after the last of them)."""
        if not consumable:
            return {}
        kept = {t.untyped_storage().data_ptr() for name, t in tensors.items() if name not in consumable}
        last: dict[int, tuple] = {}
        for name in consumable & tensors.keys():
            storage = tensors[name].untyped_storage()
            key = storage.data_ptr()
            if key in kept or not storage.nbytes():
                continue
            step = self._last_input_read.get(name, 0)
            last[key] = (max(step, last[key][0]) if key in last else step, storage)
        found: dict[int, list] = {}
        for step, storage in last.values():
            found.setdefault(step, []).append(storage)
        return found

    def _launch(self, launch: Launch, memory) -> None:
        args = [value if key is None else memory[key] for key, value in launch.bound]
        if not self._interpreting:
            return self._start(launch, args)
        with INTERPRETER_LOCK:
            self._start(launch, args)

    @staticmethod
    def _start(launch: Launch, args: list) -> None:
        aligned = tuple(args[j].data_ptr() % 16 == 0 for j in launch.pointers)  # (its ints are fixed)
        if aligned not in launch.noted:
            note_launch_config(launch.plan, args)
            launch.noted.add(aligned)
        start = time.perf_counter() if debug.level() >= 4 else 0.0
        binaries = launch.binaries if Binaries.enabled else None
        key = (args[launch.pointers[0]].get_device(), aligned) if binaries is not None else None
        if binaries is None or not binaries.launch(key, args):
            kernel = launch.fn[launch.plan.grid](*args, num_warps=launch.plan.num_warps,
                                                 num_stages=launch.plan.num_stages, **launch.constexprs)
            if binaries is not None:
                binaries.keep(key, kernel)
        counters.launches += 1
        if start:
            debug.log_launch(launch.plan, time.perf_counter() - start)


    def assemble(self, memory):
        """The function's results, in its own structure, from a call's memory."""
        flat = []
        for spec in self.conversion.outputs:
            flat.append(self._output(spec, memory, flat))
        return torch.utils._pytree.tree_unflatten(flat, self.conversion.output_tree)

    @staticmethod
    def _output(spec: OutputSpec, memory, done: list):
        if spec.kind == "constant":
            return spec.value
        if spec.kind == "computed":
            out = memory[("output", spec.name)]
            return spec.returned(out if spec.view is None else out.as_strided(*spec.view))
        base = memory[spec.name] if spec.kind == "input_alias" else done[spec.index]
        return alias_view(spec, base)


def alias_view(spec: OutputSpec, base: torch.Tensor) -> torch.Tensor:
    """An output that aliases `base` (an input, or an earlier output), as eager's view of it:
    its layout (_view_of) and its lazy conjugate and negative bits."""
    offset = base.storage_offset() + spec.offset if spec.kind == "input_alias" else spec.offset
    return spec.with_lazy_bits(_view_of(base, tuple(spec.shape), tuple(spec.stride), offset))


def _view_of(base: torch.Tensor, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
    """base viewed with this layout: base itself, a broadcast of it (base.view(...).expand:
    autograd then sums the gradient over the broadcast axes as eager's expand does, in
    float32 for 16-bit types) or as_strided (whose gradient scatters into the storage in
    the tensor's own dtype)."""
    if offset != base.storage_offset():
        return base.as_strided(shape, stride, offset)
    if (tuple(base.shape), base.stride()) == (shape, stride):
        return base
    unbroadcast = [1 if st == 0 else n for n, st in zip(shape, stride)]
    if math.prod(unbroadcast) == base.numel():
        try:
            broadcast = base.view(unbroadcast).expand(shape)
        except RuntimeError:  # base's layout cannot take that view
            broadcast = None
        if broadcast is not None and broadcast.stride() == stride:
            return broadcast
    return base.as_strided(shape, stride, offset)


def _dead_library_results(program: Program) -> list[list]:
    """Per step, the memory keys of library results in memory of their own (not the slab's,
    and not returned) that no later step reads: the run lets go of them after that step, so
    they are freed then rather than when the run ends."""
    returned = {id(node) for node in program.call_outputs.values()}
    last: dict[int, int] = {}
    nodes: dict[int, object] = {}
    for k, step in enumerate(program.steps):
        if isinstance(step, LibraryPlan):
            for node in step.torch_allocated:
                if id(node) not in returned:
                    last[id(node)], nodes[id(node)] = k, node
        for access in step.accesses:
            if access.buffer.kind == "buffer" and id(access.buffer.node) in last and not access.store:
                last[id(access.buffer.node)] = k
    dead: list[list] = [[] for _ in program.steps]
    for key, k in last.items():
        dead[k].append(memory_key(nodes[key]))
    return dead


def _first_access(steps, kind: str) -> dict[str, int]:
    """Name -> the first step that reads or writes that input or output."""
    found: dict[str, int] = {}
    for k, step in enumerate(steps):
        for access in step.accesses:
            if access.buffer.kind == kind:
                found.setdefault(access.buffer.name, k)
    return found


def _first_buffer_access(steps, buffer_outputs: dict) -> dict[str, int]:
    """Output name -> the first step that writes or reads the buffer that output is."""
    names = {id(node): name for name, node in buffer_outputs.items()}
    found: dict[str, int] = {}
    for k, step in enumerate(steps):
        for access in step.accesses:
            if access.buffer.kind == "buffer" and id(access.buffer.node) in names:
                found.setdefault(names[id(access.buffer.node)], k)
    return found


def _last_read_of_inputs(steps) -> dict[str, int]:
    """Input name -> the last step that reads it."""
    found: dict[str, int] = {}
    for k, step in enumerate(steps):
        for access in step.accesses:
            if access.buffer.kind == "input" and not access.store:
                found[access.buffer.name] = k
    return found


def memory_key_of(ref: BufferRef, k: int):
    """The key of a call's memory that launch k binds `ref` to."""
    if ref.kind in ("status", "counter"):
        return (ref.kind, k)  # (its view at the launch's own word)
    if ref.kind == "scratch":
        return ("scratch", k, ref.name)
    if ref.kind == "input":
        return ref.name
    if ref.kind == "output":
        return ("output", ref.name)
    return ("buffer", id(ref.node))


def _typed_views(raw: torch.Tensor, placed) -> dict:
    """Each (buffer, byte offset) as a tensor of the buffer's type and shape inside raw (uint8)."""
    return {b.key: raw[offset:offset + b.nbytes].view(b.dtype.torch).view(b.shape) for b, offset in placed}


@dataclass(frozen=True)
class TapeValue:
    node: GraphNode  # the graph output saved
    strides: tuple[int, ...]  # the layout it is kept in: dense (contiguous, or its dims in another order)


def tape_bytes(saved: TapeValue) -> int:
    return saved.node.view.numel * saved.node.dtype.itemsize


def _tape_memory(saved: TapeValue, device, poison: bool) -> torch.Tensor:
    """A saved value's memory: a block of its own (tjit.autograd.tape tracks it)."""
    node = saved.node
    found = tape.allocate(tape_bytes(saved), device).view(node.dtype.torch).as_strided(node.shape, saved.strides)
    if poison:
        debug.poison(found)
    return found

"""tjit.compile: a callable that traces on a cache miss and launches kernels on every call.

The cache key is everything that changes the generated code (guards.py): per tensor its
shape, strides, dtype, device and requires_grad; per other argument its type and value; the
torch state the trace runs under (grad mode, autocast, the default dtype); and the objects
the function's globals and closed-over variables hold. An nn.Module, whose forward reads
state none of these show, runs through Dynamo, which guards it. A Python
float is the exception: it is passed to the kernels as a 0-d float64 tensor (the trace reads
it with `.item()`, which frontend/scalars.py keeps a runtime value), so a new learning rate
reuses everything. A float the function branches on, or passes where an op needs a literal,
fails that trace; the function's floats are then specialised (part of the key) from then
on. An int is specialised on its first value (most ints are dims, sizes or counts that the
trace needs); once a call passes another value, it is a runtime number too (a 0-d int64
tensor), unless that trace fails, when it stays specialised. Bools and other arguments are
always specialised. A new size of a shape class is specialised from the class's symbolic
trace (frontend/shape_class.py), and its kernels are found again by source, so no new kernel
is generated or compiled.
"""
from __future__ import annotations

import functools
import inspect
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .. import debug
from ..analysis.addresses import tensors_meet
from ..autograd.backward import may_differ_from_eager, plan_autograd, with_written_inputs, written_output_name
from ..autograd.function import GradExecutable
from ..errors import CompileArgumentError, NumberNeededError, SplitError, UnsupportedOpError
from ..frontend.number_check import same_as_literal_trace
from ..frontend.trace import CONTAINERS, eager_gradient_paths, flatten_arguments, holds_tensors, trace_concrete
from ..ir import AxisStrategy
from ..memory.donation import DonatedTensor
from ..frontend.shape_class import ShapeClasses
from ..pipeline import VerifyError, build_program, convert, trace_and_convert
from . import disk_cache
from .counters import compiling, counters
from .executor import Executable, alias_view
from .guards import (OutsideState, guard_key, random_objects_read, shape_class_key, state_read, state_written,
                     type_questions, volatile_read)
from .interpreter import check_device
from .split import SplitFunction


@dataclass
class CompiledEntry:
    executable: Executable  # or a GradExecutable, when inputs require grad
    trace_seconds: float
    lower_seconds: float
    load_seconds: float
    eager_ops: int
    numbers: tuple[str, ...] = ()  # the float and int arguments passed as 0-d tensors (runtime numbers)
    # 0-d CPU tensor arguments beside GPU ones (an optimizer's step counts): run on copies
    cpu_scalars: tuple[str, ...] = ()
    written_cpu_scalars: tuple[str, ...] = ()  # those the function writes in place: copied back
    cpu_outputs: tuple = ()  # (index, OutputSpec) of the flattened results eager makes on the CPU
    from_disk: bool = False  # loaded from the disk cache (runtime/disk_cache.py), not compiled here


@dataclass
class PreparedCall:
    """A call's compiled entry and its arguments (CompiledFunction.prepare, then .run)."""
    entry: CompiledEntry
    args: tuple
    kwargs: dict
    flat: list
    tensors: dict


class CompiledFunction:
    def __init__(self, fn: Callable, axis_strategies: Optional[Mapping[str, Sequence[AxisStrategy]]] = None,
                 donate: Sequence[str] = (), split_data_dependent: bool = True, dynamic: Optional[bool] = None,
                 size_positions: frozenset[int] = frozenset(), dynamic_dims: Optional[Mapping[int, tuple]] = None):
        """size_positions: the positional int arguments that are sizes (a Dynamo graph's
        symbols): symbols in a symbolic trace, so that new values are new sizes of one class.
        dynamic_dims: positional tensor argument -> which of its sizes are symbols in a
        symbolic trace (a Dynamo graph's: the sizes Dynamo made symbols; the others, its
        parameters' among them, stay as they are); all of them where not given."""
        functools.update_wrapper(self, fn)
        self.fn = fn
        # a function that needs tensor data to go on runs split by Dynamo (split.py); off for
        # the graphs Dynamo itself hands over
        self.split_data_dependent = split_data_dependent
        self._split: Optional[SplitFunction] = None
        # a module's forward reads state its arguments do not show (training mode, parameters,
        # attributes), which a trace would bake in: Dynamo guards it and hands tjit its graphs
        self._guarded_by_dynamo = isinstance(fn, torch.nn.Module) and split_data_dependent
        # the globals and closed-over variables a trace bakes in (a Dynamo graph has none of its own)
        outside = OutsideState(fn) if split_data_dependent else None
        self._outside = outside if outside else None
        self.donate = tuple(donate)
        self.axis_strategies = dict(axis_strategies or {})
        self._cache: dict[tuple, CompiledEntry] = {}
        self._shape_classes = ShapeClasses(dynamic)  # a new size lowered from its class's symbolic trace
        self._size_positions = size_positions
        self._dynamic_dims = dict(dynamic_dims or {})
        self._lock = threading.Lock()
        self._positional_names = _plain_positional_names(fn)
        self._var_positional = _var_positional_name(fn)  # `args` of fn(*args): a Dynamo graph's forward
        self._takes_out = _has_parameter(fn, "out")  # then out= is the function's own argument
        # why float arguments are specialised (a runtime number failed the trace), or None
        self.literal_numbers: Optional[str] = None
        self._number_parameters = _named_parameters(fn)  # those a number can be passed to as a runtime number
        # int arguments: specialised on their first value (most are dims, sizes or counts a trace
        # needs); one seen with a second value is a runtime number from then on, unless that trace
        # fails (literal_ints: why)
        self._first_ints: dict[str, int] = {}
        self.runtime_ints: set[str] = set()
        self._type_questions: Optional[list] = None  # (guards.type_questions, once read)
        # (shape class, numbers) whose trace with those runtime numbers was checked against their values
        self._numbers_checked: set[tuple] = set()
        self.literal_ints: dict[str, str] = {}
        self.not_on_disk: Optional[str] = None  # why the last entry compiled is not in the disk cache
        # called while another function is traced (a compiled helper of a compiled function):
        # the function itself runs, so that the trace records its ops
        self._inlined = CompiledEntry(_Inlined(fn), 0.0, 0.0, 0.0, 0)

    def _flatten(self, args, kwargs) -> list[tuple[str, Any]]:
        # The common calls (all parameters given positionally, or a Dynamo graph's forward(*args))
        # skip inspect's binding, which costs tens of microseconds.
        if kwargs or any(isinstance(a, CONTAINERS) and holds_tensors(a) for a in args):  # (those are flattened)
            return flatten_arguments(self.fn, args, kwargs)
        if self._positional_names is not None and len(args) == len(self._positional_names):
            return list(zip(self._positional_names, args))
        if self._var_positional is not None:
            return [(f"{self._var_positional}{k}", a) for k, a in enumerate(args)]
        return flatten_arguments(self.fn, args, kwargs)

    def __call__(self, *args, **kwargs):
        """Run the compiled function. `out=` (a tensor or a tuple of tensors, one per tensor
        result, unless the function takes an `out` argument itself) receives the results in
        place: they are written straight into it when its layout is the result's, else
        copied; the call returns the out tensors."""
        if torch.compiler.is_compiling():  # (Dynamo tracing a caller: the function's ops join its graph,
            return self.fn(*args, **kwargs)  # where it would otherwise trace tjit's own runtime)
        out = kwargs.pop("out", None) if not self._takes_out else None
        return self.run(self.prepare(args, kwargs), out)

    def prepare(self, args: tuple, kwargs: dict) -> "PreparedCall":
        """The compiled entry for these arguments, compiled on a miss (which raises tjit's
        errors before anything runs), and the arguments as run() takes them."""
        flat = self._flatten(args, kwargs)
        tensors = {name: v for name, v in flat if isinstance(v, torch.Tensor)}
        if any(type(t) not in _DATA_TENSOR_TYPES and _being_traced(t) for t in tensors.values()):
            return PreparedCall(self._inlined, args, kwargs, flat, tensors)
        if torch._C._functorch.maybe_current_level() is not None and _transformed(self.fn, tensors):
            return PreparedCall(self._inlined, args, kwargs, flat, tensors)
        _check_not_donated(tensors)
        numbers = self._numbers(flat)
        entry = self._cache.get(self._key(flat, numbers))
        if entry is None:
            _check_call(self.fn, tensors)
            with self._lock, compiling():
                entry = self._entry(args, kwargs, flat, numbers)
        else:
            counters.cache_hits += 1
        return PreparedCall(entry, args, kwargs, flat, tensors)

    def run(self, call: "PreparedCall", out=None):
        """Run a prepared call (see __call__ for `out`)."""
        entry, tensors = call.entry, call.tensors
        if isinstance(entry.executable, (SplitFunction, _Inlined)):
            return _into_out(entry.executable(call.args, call.kwargs), out)
        if entry.numbers:
            tensors.update(_as_tensors(call.flat, entry.numbers))
        if not entry.cpu_scalars:
            return entry.executable(tensors, out)
        originals = {name: tensors[name] for name in entry.cpu_scalars}
        device = _run_device(tensors.values())
        tensors.update({name: t.to(device, non_blocking=True) for name, t in originals.items()})
        result = entry.executable(tensors, out)
        for name in entry.written_cpu_scalars:
            originals[name].copy_(tensors[name])
        return _cpu_results(entry, result, originals)

    def entry_for(self, *args, **kwargs) -> CompiledEntry:
        """The compiled form for these arguments (compiling it if needed), without running it."""
        flat = self._flatten(args, kwargs)
        with self._lock, compiling():
            return self._entry(args, kwargs, flat, self._numbers(flat))

    def _key(self, flat, numbers: tuple[str, ...] = ()) -> tuple:
        """The cache key of a call: its arguments and torch state, and the objects the
        function's globals and closed-over variables hold (guards.py)."""
        key = guard_key(flat, numbers)
        return key if self._outside is None else key + (self._outside.key(),)

    def _numbers(self, flat) -> tuple[str, ...]:
        """The arguments (the function's own parameters) to pass as runtime numbers: its floats
        (none once one failed), and the ints that have taken a second value (not sizes: those
        are a shape class's symbols)."""
        return tuple(name for k, (name, v) in enumerate(flat)
                     if (type(v) is float and not self.literal_numbers or
                         type(v) is int and k not in self._size_positions and self._int_varies(name, v))
                     and name in self._number_parameters)

    def _int_varies(self, name: str, value: int) -> bool:
        """Whether int argument `name` is a runtime number: it has taken two values (this one
        among them), and no trace with it as a runtime number has failed. A value no int64
        holds is a literal, even for an int that is a runtime number."""
        if not _INT64_MIN <= value <= _INT64_MAX:
            return False
        if name in self.runtime_ints:
            return True
        if name in self.literal_ints:
            return False
        if self._first_ints.setdefault(name, value) == value:
            return False
        self.runtime_ints.add(name)
        return True

    def _entry(self, args, kwargs, flat, numbers) -> CompiledEntry:
        """The cached entry, or a new one: with `numbers` (floats, ints that vary) as runtime
        numbers where the trace allows it, else with those that fail it specialised."""
        found = self._cache.get(self._key(flat, numbers))
        if found is not None:
            return found
        gone = set(self._outside.evicted()) if self._outside is not None else ()
        if gone:  # (entries of states long gone: their objects are let go)
            self._cache = {key: entry for key, entry in self._cache.items() if key[-1] not in gone}
        if numbers:
            try:
                return self._compile(args, kwargs, self._key(flat, numbers), numbers)
            except UnsupportedOpError as e:  # (the function needs a number's value: a branch, a size, a dim,
                # or an op that takes a literal float: a Dynamo graph's SymFloat in native_dropout_backward's scale)
                ints = [name for name in numbers if name in self.runtime_ints]
                # the ints that no cached entry takes as runtime numbers failed it (the floats were
                # runtime numbers in an earlier trace, or are specialised already)
                proven = {name for entry in self._cache.values() for name in entry.numbers}
                ints = [name for name in ints if name not in proven] or ints
                lines = str(e).split("\n")
                why = " ".join(lines[:2] if lines[0].endswith(":") else lines[:1]).split(" (unhinted")[0]  # (a schema's mismatch)
                debug.log(1, f"{getattr(self.fn, '__name__', self.fn)}: arguments {ints or numbers} are specialised: {e}")
                if ints:
                    self.runtime_ints.difference_update(ints)
                    self.literal_ints.update(dict.fromkeys(ints, why))
                    return self._entry(args, kwargs, flat, self._numbers(flat))
                self.literal_numbers = why
        return self._cache.get(self._key(flat)) or self._compile(args, kwargs, self._key(flat))

    def _compile(self, args, kwargs, key, numbers: tuple[str, ...] = ()) -> CompiledEntry:
        t0 = time.perf_counter()
        if self._guarded_by_dynamo:
            return self._split_entry(key, "an nn.Module: Dynamo guards its state (training mode, parameters, "
                                          "attributes) and tjit compiles the graphs it captures", t0)
        why, eager = self._outside_one_trace_because(args, kwargs)
        if why is not None and self.donate:  # (Dynamo's graphs do not donate; one trace would differ from eager)
            raise CompileArgumentError(f"donate={self.donate}: {getattr(self.fn, '__name__', self.fn)} cannot be "
                                       f"compiled as one trace: {why}; compile it without donate")
        if why is not None:
            return self._split_entry(key, why, t0, eager)
        flat = self._flatten(args, kwargs)
        disk_key = self._disk_key(flat, numbers)
        stored = disk_cache.load(disk_key) if disk_key is not None else None
        if stored is not None:
            counters.disk_loads += 1
            stored.from_disk = True
            self._cache[key] = stored
            self._store_backwards(disk_key, stored)
            return stored
        grad_inputs = _grad_inputs(flat)
        device = _device_type(flat)
        traced = (self.fn, args, kwargs)
        if numbers:  # (the floats as 0-d tensors, read back with .item())
            traced = (_reading_numbers(self.fn, numbers), *_with_number_tensors(self.fn, args, kwargs, numbers, flat))
        try:
            # the forward only (tjit differentiates it), traced as eager runs it: the inputs that get a
            # gradient require grad (an op's Python wrapper may skip work for inputs that do not)
            check = self._numbers_check(args, kwargs, key, flat, numbers, frozenset(grad_inputs))
            conversion = self._conversion(*traced, key, flat, frozenset(grad_inputs), check)
            if grad_inputs:  # (a custom autograd.Function is a SplitError: Dynamo cuts the graph around it)
                self._check_differentiable(conversion, flat, grad_inputs)
        except SplitError as e:
            if not self.split_data_dependent or self.donate or numbers:
                raise
            return self._split_entry(key, str(e), t0)
        t1 = time.perf_counter()
        if grad_inputs:
            eager = None
            if may_differ_from_eager(conversion, grad_inputs):
                eager = eager_gradient_paths(self.fn, *_detached((args, kwargs)), grad_inputs)
            graph = with_written_inputs(conversion.graph, conversion.written_grad_inputs)
            executable = GradExecutable(conversion, plan_autograd(graph, grad_inputs, _by_output(conversion, eager)),
                                        self.axis_strategies, device, eager)
            t2 = time.perf_counter()
        else:
            strides = {s.name: s.stride for s in conversion.outputs if s.kind == "computed"}
            program = build_program(conversion.graph, strides, self.axis_strategies, device,
                                    self._donations(conversion, args, kwargs))
            t2 = time.perf_counter()
            executable = Executable(conversion, program)
        t3 = time.perf_counter()
        entry = CompiledEntry(executable, t1 - t0, t2 - t1, t3 - t2, conversion.eager_ops, numbers,
                              **_cpu_scalar_fields(flat, conversion))
        self._cache[key] = entry
        _log_compile(self.fn, entry)
        if disk_key is not None:
            self._store(disk_key, entry)
            self._store_backwards(disk_key, entry)
        return entry

    def _disk_key(self, flat, numbers: tuple[str, ...]) -> Optional[disk_cache.EntryKey]:
        """The key of the call's entry on disk (runtime/disk_cache.py); None where the disk
        cache is off or the key cannot be written out (not_on_disk says why)."""
        self.not_on_disk = None  # (it describes this compile: an earlier entry's reason no longer holds)
        if not disk_cache.enabled():
            return None
        if self.axis_strategies:
            self.not_on_disk = "axis_strategies are given"
            return None
        try:
            settings = (self.donate, sorted(self._size_positions), sorted(self._dynamic_dims.items()))
            return disk_cache.entry_key(self.fn, guard_key(flat, numbers), flat, settings)
        except disk_cache.NotCacheable as e:
            self.not_on_disk = str(e)
            return None
        except Exception as e:  # (an object the key's description did not foresee: compiled here only)
            self.not_on_disk = f"its key could not be made: {type(e).__name__}: {e}"
            return None

    def _store_backwards(self, disk_key: disk_cache.EntryKey, entry: CompiledEntry) -> None:
        """Store the entry again once a backward is compiled for it (a GradExecutable compiles
        each at the first backward that needs it), so that a fresh process finds it too."""
        if isinstance(entry.executable, GradExecutable):
            entry.executable.on_backward_compiled = functools.partial(self._store, disk_key, entry)

    def _store(self, disk_key: disk_cache.EntryKey, entry: CompiledEntry) -> None:
        try:
            disk_cache.store(disk_key, entry)
        except disk_cache.NotCacheable as e:
            self.not_on_disk = str(e)
        except OSError as e:  # (a read-only or full disk: the entry stays in this process)
            self.not_on_disk = f"writing it failed: {e}"

    def _outside_one_trace_because(self, args: tuple, kwargs: dict) -> tuple[Optional[str], bool]:
        """Why the function runs through Dynamo rather than one trace, if it does, which runs
        its Python as eager does and guards what it reads: where its code may ask what a
        tensor of this call is (guards.type_questions: of a parameter holding no tensor, it
        asks nothing a trace changes), which a trace would answer for its stand-in tensors
        (FakeTensor); where it reads an object's state that the key holds by identity
        (guards.state_read); where it reads what changes between calls, random numbers, the
        clock (guards.volatile_read); or where it changes Python state (guards.state_written).
        And whether it runs eagerly instead: where it draws from a random.Random object, which
        Dynamo bakes in too (guards.random_objects_read)."""
        if not self.split_data_dependent:  # (a Dynamo graph: straight-line code)
            return None, False
        if self._type_questions is None:
            self._type_questions = type_questions(self.fn)
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
            bound.apply_defaults()  # (a default is an argument too: `def f(x, seen=[])`)
            values = bound.arguments
        except (TypeError, ValueError):  # (no signature to read: every question is about anything)
            values = {}
        for where, subject in self._type_questions:
            value = values.get(subject)
            if subject not in values or isinstance(value, torch.Tensor) or holds_tensors(value):
                return f"its code asks what a tensor is ({where}), which a trace would answer for its stand-in " \
                       "tensors (FakeTensor), not the caller's", False
        where = random_objects_read(self.fn, values)
        if where is not None:
            return f"its code draws from a random.Random object ({where}), whose numbers one trace and Dynamo " \
                   "would both bake in: it runs eagerly", True
        checks = ((lambda: state_read(self.fn, values),
                   "reads an object's state ({}), which a trace would bake in: Dynamo guards it (as for an nn.Module)"),
                  (lambda: volatile_read(self.fn, values),
                   "reads what changes between calls ({}), which a trace would bake in: Dynamo reads it at every call"),
                  (lambda: state_written(self.fn, values),
                   "changes Python state ({}), which a trace would do once: Dynamo replays it after every call, as "
                   "eager does"))
        for check, why in checks:  # (each walks the code; the first that finds something answers)
            where = check()
            if where is not None:
                return "its code " + why.format(where), False
        return None, False

    def _numbers_check(self, args, kwargs, key: tuple, flat, numbers: tuple[str, ...],
                       requires_grad: frozenset) -> Optional[Callable]:
        """For the first trace with these runtime numbers in a shape class: a check that it is
        the trace of their values (frontend/number_check.py: a function that asks a number's
        type, `isinstance(p, float)`, takes another branch with a symbol), which raises
        NumberNeededError where it is not, so that the numbers are specialised. None where
        there is nothing to check: no numbers, a Dynamo graph (straight-line code), or a
        class checked before."""
        if not numbers or isinstance(self.fn, torch.fx.GraphModule):
            return None
        checked_as = (shape_class_key(key, flat, self._size_names(flat)) or key, numbers)
        if checked_as in self._numbers_checked:
            return None
        values = {name: v for name, v in flat if name in numbers}
        detached = _detached((args, kwargs))

        def check(traced):
            counters.number_checks += 1
            literal = trace_concrete(self.fn, *detached, requires_grad)  # (its errors are the function's)
            try:
                why = same_as_literal_trace(traced, literal, values)
            except Exception as e:  # (a graph the check cannot read: the numbers are specialised)
                why = f"the check could not compare them: {type(e).__name__}: {e}"
            if why is not None:
                raise NumberNeededError(getattr(self.fn, "__name__", str(self.fn)),
                                        f"arguments {list(numbers)} as runtime numbers give another trace than "
                                        f"their values ({why}): the function asks their type, or reads them "
                                        "in Python")
            self._numbers_checked.add(checked_as)
        return check

    def _size_names(self, flat) -> tuple[str, ...]:
        """The int arguments that are sizes (a Dynamo graph's), by flattened name."""
        return tuple(flat[k][0] for k in sorted(self._size_positions) if k < len(flat) and type(flat[k][1]) is int)

    def _conversion(self, fn, args, kwargs, key: tuple, flat, requires_grad: frozenset,
                    check: Optional[Callable] = None):
        """The call's IR graph: from its shape class's symbolic trace, or traced for its sizes
        (check: called with the trace before it is converted)."""
        args, kwargs = _detached((args, kwargs))
        sizes = self._size_names(flat)
        classed = shape_class_key(key, flat, sizes)
        if classed is not None:
            traces = self._shape_classes.traces
            dims = {flat[k][0]: d for k, d in self._dynamic_dims.items() if k < len(flat)} or None
            found = self._shape_classes.traced(classed, fn, args, kwargs, requires_grad, sizes, dims)
            counters.traces += self._shape_classes.traces - traces
            if found is not None:
                try:
                    conversion = convert(found, lambda: trace_and_convert(fn, args, kwargs, requires_grad), check)
                    counters.specialised += 1
                    return conversion
                except (VerifyError, NumberNeededError):
                    raise
                except Exception as e:  # (traced for its sizes below: the error, if it is the function's)
                    debug.log(1, f"{getattr(self.fn, '__name__', self.fn)}: a specialised trace failed to convert "
                                 f"({type(e).__name__}: {e})")
        counters.traces += 1
        return trace_and_convert(fn, args, kwargs, requires_grad, check)

    def _split_entry(self, key, reason: str, t0: float, eager: bool = False) -> CompiledEntry:
        """The entry of a function one trace cannot hold, or a module: Dynamo runs it (one
        SplitFunction for every key: Dynamo keeps its own guards), or eager does (eager)."""
        if eager:
            split = SplitFunction(self.fn, reason, eager=True)
            warnings.warn(f"tjit runs {getattr(self.fn, '__name__', self.fn)} eagerly: {reason}", stacklevel=4)
        else:
            self._split = split = self._split or SplitFunction(self.fn, reason)
        entry = CompiledEntry(split, time.perf_counter() - t0, 0.0, 0.0, 0)
        self._cache[key] = entry
        debug.log(1, f"{getattr(self.fn, '__name__', self.fn)} runs {'eagerly' if eager else 'split by Dynamo'}: "
                     f"{reason}")
        return entry

    def _check_differentiable(self, conversion, flat, grad_inputs) -> None:
        """What tjit's backward cannot follow is refused before anything runs."""
        _check_no_shared_memory(self.fn, flat, grad_inputs, conversion.shared_inputs)
        _check_written_alone(self.fn, flat, conversion.written_grad_inputs)
        if conversion.gradient_unknown:
            error, reason = conversion.gradient_unknown
            raise error(getattr(self.fn, "__name__", str(self.fn)),
                        f"{reason}, in a function whose inputs {grad_inputs} require grad: tjit's backward cannot "
                        "follow it")
        if self.donate:
            raise CompileArgumentError(f"donate={self.donate}: inputs {grad_inputs} require grad, and backward may "
                                       "need them; donate only under torch.no_grad()")

    def _donations(self, conversion, args, kwargs) -> dict:
        """Donated input name -> its bytes, after checking that donating it is sound."""
        if not self.donate:
            return {}
        flat = dict(self._flatten(args, kwargs))
        found = {}
        for name in self.donate:
            x = flat.get(name)
            if not isinstance(x, torch.Tensor):
                raise CompileArgumentError(f"donate={self.donate}: {name!r} is not a tensor argument of "
                                           f"{getattr(self.fn, '__name__', self.fn)}")
            why = _cannot_donate(name, x, conversion, flat)
            if why:
                raise CompileArgumentError(f"cannot donate {name!r}: {why}")
            found[name] = x.numel() * x.element_size()
        return found

    def __get__(self, obj, objtype=None):  # methods decorated with @tjit.compile
        return self if obj is None else functools.partial(self, obj)


def _cannot_donate(name, x, conversion, flat) -> Optional[str]:
    if not x.is_contiguous():
        return "only a contiguous tensor can be donated"
    if any(m.name == name for m in conversion.graph.mutations):
        return "the function writes into it, so its contents are a result"
    if any(s.kind == "input_alias" and s.name == name for s in conversion.outputs):
        return "a result is a view of it"
    others = _sharing_memory(flat, name)
    if others:
        return f"it shares memory with {others}"
    return None


def _sharing_memory(tensors: dict, name: str) -> list[str]:
    """The other tensor arguments whose memory meets argument `name`'s."""
    return [n for n, t in tensors.items() if n != name and isinstance(t, torch.Tensor) and tensors_meet(t, tensors[name])]


class _Inlined:
    """The entry of a call made inside another function's trace: the function runs as it is."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, args: tuple, kwargs: dict):
        return self.fn(*args, **kwargs)


_DATA_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})  # (the common case, checked first: no call)


def _being_traced(t: torch.Tensor) -> bool:
    """Whether t is a tracer's stand-in (a fake or functional tensor), not data kernels can read."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(t, (FakeTensor, FunctionalTensor))


def _transformed(fn: Callable, tensors: dict) -> bool:
    """Whether a tensor is one of torch.func's wrappers (grad, vmap, jacrev, ...: a call
    inside a transform), whose memory kernels cannot read: the function then runs as it is,
    under the transform, as eager's ops (torch.compile(fn, backend="tjit") compiles it
    there, as Dynamo sees through the transforms)."""
    if not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors.values()):
        return False
    warnings.warn(f"tjit runs {getattr(fn, '__name__', fn)} as eager does inside a torch.func transform (its "
                  "tensors are the transform's wrappers); torch.compile(fn, backend=\"tjit\") compiles it there",
                  stacklevel=4)
    return True


def _reading_numbers(fn, numbers: tuple[str, ...]) -> Callable:
    """fn called with the number arguments named in `numbers` passed as 0-d tensors: each is read
    back with .item() (in the trace, a runtime number). Its signature is fn's (inspect follows
    __wrapped__), so its arguments flatten to the same names."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def reading(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        for name in numbers:
            bound.arguments[name] = bound.arguments[name].item()
        return fn(*bound.args, **bound.kwargs)
    return reading


def _with_number_tensors(fn, args, kwargs, numbers: tuple[str, ...], flat) -> tuple[tuple, dict]:
    """The call's arguments with each number named in `numbers` as its 0-d tensor."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.arguments.update(_as_tensors(flat, numbers))
    return bound.args, bound.kwargs


def _as_tensors(flat, numbers: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The numbers named in `numbers` as 0-d float64 (a float) or int64 (an int) tensors, on the
    device of the call's tensors (filled there: on a GPU a fill is queued, where torch.tensor
    would wait for a copy)."""
    device = _run_device(v for _, v in flat if isinstance(v, torch.Tensor))
    return {name: torch.full((), v, dtype=torch.float64 if type(v) is float else torch.int64, device=device)
            for name, v in flat if name in numbers}


_INT64_MIN, _INT64_MAX = -2 ** 63, 2 ** 63 - 1  # (an int beyond them stays a literal: no int64 tensor holds it)


def _check_not_donated(tensors) -> None:
    for name, t in tensors.items():
        if isinstance(t, DonatedTensor):
            raise CompileArgumentError(f"input {name!r} has no memory left: it was donated to an earlier call of a "
                                       "compiled function (donate=...) and may not be used again")


def _has_parameter(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _named_parameters(fn) -> frozenset[str]:
    """The parameters an argument binds to by name (not *args or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def _plain_positional_names(fn) -> Optional[tuple[str, ...]]:
    """Parameter names when every parameter is plain positional-or-keyword, else None."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return tuple(p.name for p in params)
    return None


def _var_positional_name(fn) -> Optional[str]:
    """The name of fn's *args when that is its only positional parameter (fn(*args) or
    fn(*args, **kwargs)), else None."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].kind is params[0].VAR_POSITIONAL and all(p.kind is p.VAR_KEYWORD for p in params[1:]):
        return params[0].name
    return None


def _is_cpu_scalar(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 0


def _run_device(tensors) -> torch.device:
    """Where a call's kernels run: its tensors' device (a GPU's, beside 0-d CPU tensors)."""
    return next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))


def _cpu_scalar_fields(flat, conversion) -> dict:
    """CompiledEntry's fields for a call with 0-d CPU tensors beside GPU ones, which eager
    reads as numbers there (an optimizer's step counts, a learning rate Dynamo passes)."""
    tensors = [(name, v) for name, v in flat if isinstance(v, torch.Tensor)]
    if _run_device(v for _, v in tensors).type == "cpu":
        return {}
    scalars = tuple(name for name, v in tensors if _is_cpu_scalar(v))
    written = {m.name for m in conversion.graph.mutations}
    return dict(cpu_scalars=scalars, written_cpu_scalars=tuple(n for n in scalars if n in written),
                cpu_outputs=tuple((k, spec) for k, spec in enumerate(conversion.outputs) if spec.device == "cpu"))


def _cpu_results(entry: CompiledEntry, result, originals: dict[str, torch.Tensor]):
    """The results eager makes on the CPU (computed from 0-d CPU tensors alone) moved there:
    a view of a CPU argument is that view of the argument itself."""
    if not entry.cpu_outputs:
        return result
    flat, tree = torch.utils._pytree.tree_flatten(result)
    for k, spec in entry.cpu_outputs:
        if spec.kind == "input_alias" and spec.name in originals:
            flat[k] = alias_view(spec, originals[spec.name])
        else:
            flat[k] = flat[k].to("cpu")
    return torch.utils._pytree.tree_unflatten(flat, tree)


def _check_call(fn, tensors: dict[str, torch.Tensor]) -> None:
    devices = {t.device for t in tensors.values() if not _is_cpu_scalar(t)} or {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise CompileArgumentError(f"{getattr(fn, '__name__', fn)}: tensors on several devices {sorted(map(str, devices))}")
    for device in devices:
        check_device(device)


def _device_type(flat: list[tuple[str, Any]]) -> str:
    """The device type the kernels run on (the tensors', all on one device; CPU without
    tensors, as the executor): the lowering follows that device's eager numerics."""
    return _run_device(v for _, v in flat if isinstance(v, torch.Tensor)).type


def _grad_inputs(flat: list[tuple[str, Any]]) -> list[str]:
    """Tensor arguments that get a gradient: those that require grad, while grad mode is on."""
    if not torch.is_grad_enabled():
        return []
    return [name for name, v in flat if isinstance(v, torch.Tensor) and v.requires_grad]


def _check_no_shared_memory(fn, flat, grad_inputs, shared_inputs) -> None:
    """Arguments that share a storage the function writes into, and whose memory meets, are
    one input to the kernels (frontend Converter.storage_owner); their gradients could not be
    told apart, so that is refused when gradients are wanted (the same tensor passed twice is
    fine: its gradient is the sum either way)."""
    tensors = dict(flat)
    for names in shared_inputs:
        layouts = {(tuple(tensors[n].shape), tensors[n].stride(), tensors[n].storage_offset()) for n in names}
        if len(layouts) > 1 and set(names) & set(grad_inputs):
            raise UnsupportedOpError(getattr(fn, "__name__", str(fn)), f"inputs {names} are different views of one "
                                     "tensor whose memory meets, the function writes into it, and one requires "
                                     "grad; pass separate tensors (e.g. .clone())")


def _check_written_alone(fn, flat, written: tuple[str, ...]) -> None:
    """An input requiring grad that the function writes, or one it writes values with a
    gradient into, is traced through a copy of its own (trace._write_back), so another
    argument in its memory would not see the writes: that is refused (the same tensor passed
    twice, or overlapping views of it)."""
    tensors = dict(flat)
    for name in written:
        others = _sharing_memory(tensors, name)
        if others:
            raise UnsupportedOpError(getattr(fn, "__name__", str(fn)), f"the function writes into input {name!r}, "
                                     f"whose new contents carry a gradient, and which shares memory with {others}; "
                                     "pass separate tensors (e.g. .clone())")


def _by_output(conversion, eager) -> Optional[dict]:
    """Computed output name -> eager's gradient paths from it (see eager_gradient_paths), the
    new contents of each written input that requires grad included, or None when they were
    not asked."""
    written = [written_output_name(name) for name in conversion.written_grad_inputs]
    if eager is None or len(eager) != len(conversion.outputs) + len(written):
        return None
    found = {s.name: paths for s, paths in zip(conversion.outputs, eager) if s.kind == "computed"}
    return {**found, **dict(zip(written, eager[len(conversion.outputs):]))}


def _into_out(result, out):
    """Results of a split function copied into out= (one tensor per tensor result); out."""
    if out is None:
        return result
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    results = [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    if len(outs) != len(results):
        raise CompileArgumentError(f"out= needs {len(results)} tensor(s), one per tensor result; got {len(outs)}")
    for o, r in zip(outs, results):
        if o.shape != r.shape or o.dtype != r.dtype:
            raise CompileArgumentError(f"out is {o.dtype} {list(o.shape)}; the result is {r.dtype} {list(r.shape)}")
    for o, r in zip(outs, results):
        o.copy_(r)
    return out


def _detached(tree):
    return torch.utils._pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree)


def _log_compile(fn, entry: CompiledEntry) -> None:
    program = entry.executable.program
    debug.log(1, f"compiled {getattr(fn, '__name__', fn)}: {len(program.kernels)} kernel(s) for {entry.eager_ops} eager "
                 f"op(s); trace {entry.trace_seconds * 1e3:.1f} ms, lower {entry.lower_seconds * 1e3:.1f} ms, "
                 f"load {entry.load_seconds * 1e3:.1f} ms")
    debug.log_program(entry.executable.graph, program)

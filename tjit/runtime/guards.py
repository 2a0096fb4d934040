"""What a compiled entry is guarded by: what its trace depends on, checked on every call.

guard_key: the arguments (per tensor its shape, strides, dtype, device, requires_grad, its
negative bit and which others share its memory; per other argument its type and value)
and the torch state the trace computes under (grad mode, autocast, the default dtype, the
float32 matmul precision). OutsideState: the globals the function's code names and the
variables it closes over, by identity: a trace bakes in what they held (a Python number, a
tensor it reads as a constant, a helper function), so a name bound to another object is a
miss and a new trace, where eager would read the new object. State further away is not
in the key: a function that reads a mutable object's state (state_read: an attribute of an
object of the user's class, a namespace, a module, an iterator), asks what a tensor is
(type_questions), reads what changes between calls (volatile_read: random numbers, the
clock) or changes Python state (state_written: a global, a list it appends to, a print)
runs through Dynamo instead, which guards what it reads and replays what it writes, as it
does for an nn.Module; one that draws from a random.Random object (random_objects_read)
runs eagerly. A list or dict among the globals and closed-over variables is in the key by
its elements (tensors and objects by identity, numbers by value).
"""
from __future__ import annotations

import array
import collections
import dis
import enum
import functools
import inspect
import operator
import random
import sys
import types
from typing import Any, Callable, Iterator, Optional

import numpy
import torch

_UNBOUND = object()  # (a global name the code reads that is not bound, or an empty cell)
MAX_OUTSIDE_STATES = 8  # per function: the states whose entries are kept (each keeps its objects alive)


GUARD_KEY_HEAD = 5  # guard_key's entries before the arguments


def guard_key(flat: list[tuple[str, Any]], numbers: tuple[str, ...] = ()) -> tuple:
    """numbers: the float and int arguments passed as runtime numbers (their values are not part of it)."""
    # (the float32 matmul precision: a generated float32 product uses tf32 where it allows;
    # autocast and the default dtype decide the dtypes the trace computes in)
    key = [torch.is_grad_enabled(), numbers, torch.get_float32_matmul_precision(), torch.get_default_dtype(),
           _autocast_state() if torch._C._is_any_autocast_enabled() else None]  # (GUARD_KEY_HEAD entries)
    storages: dict[int, tuple[int, int]] = {}  # which tensors share memory is traced in
    for k, (name, v) in enumerate(flat):
        if isinstance(v, torch.Tensor) and v.layout != torch.strided:  # (no storage: a sparse tensor)
            key.append((name, tuple(v.shape), v.layout, v.dtype, v.device, v.requires_grad))
        elif isinstance(v, torch.Tensor):
            first, offset = storages.setdefault(v.untyped_storage().data_ptr(), (k, v.storage_offset()))
            alias = (first, v.storage_offset() - offset) if first != k else None
            key.append((name, v.shape, v.stride(), v.dtype, v.device, v.requires_grad, alias, v.is_neg()))
        elif name in numbers:  # (its type decides the trace's result types)
            key.append((name, type(v)))
        else:
            value = _exact(v)
            try:
                hash(value)
                key.append((name, value))
            except TypeError:
                key.append((name, type(v), repr(v)))
    return tuple(key)


def _exact(v: Any) -> Any:
    """A key for a specialised value that tells apart what == does not: -0.0 from 0.0, and
    1 from 1.0 and True inside a tuple (each traces to other results); a NaN equals a NaN."""
    kind = type(v)
    if kind is float:
        return kind, v.hex()
    if kind is complex:
        return kind, v.real.hex(), v.imag.hex()
    if kind in (tuple, list):
        return kind, tuple(map(_exact, v))
    return kind, v


def shape_class_key(key: tuple, flat: list[tuple[str, Any]], sizes: tuple[str, ...] = ()) -> Optional[tuple]:
    """The shape class of a call (frontend/shape_class.py) from its guard_key: each size as
    0, 1 or 2 (more), strides left out (the symbolic trace's guards decide); None for a call
    whose inputs share memory. sizes: the int arguments that are sizes, classed alike."""
    classed = list(key)
    for k, (name, v) in enumerate(flat):
        if name in sizes:
            classed[GUARD_KEY_HEAD + k] = (name, int, min(v, 2))
        elif isinstance(v, torch.Tensor):
            entry = classed[GUARD_KEY_HEAD + k]
            if v.layout != torch.strided or entry[6] is not None:
                return None
            classed[GUARD_KEY_HEAD + k] = (name, tuple(min(n, 2) for n in v.shape), *entry[3:])
    return tuple(classed)


def _autocast_state() -> tuple:
    """Where autocast is on, and to which dtype (torch.autocast regions the call is made in)."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


class OutsideState:
    """The globals fn's code (nested code included: lambdas, comprehensions) names and the
    cells it closes over. `key()` is their objects' ids, for the cache key; the objects of
    the last MAX_OUTSIDE_STATES keys are kept alive, so that no other object takes one of
    their ids while an entry is cached under it (`evicted` names the keys let go)."""

    def __init__(self, fn: Callable):
        self.globals = getattr(fn, "__globals__", {})
        code = getattr(fn, "__code__", None)
        names = {name for c in nested_code(code) for name in c.co_names}
        self.names = tuple(sorted(n for n in names if n in self.globals))
        self.cells = tuple(getattr(fn, "__closure__", None) or ())
        # one C call reads the globals on every call (the first name twice, so that it returns a
        # tuple even for one name); a name unbound since raises KeyError
        self._read_globals = operator.itemgetter(*self.names, *self.names[:1]) if self.names else lambda g: ()
        self._kept: dict[tuple, tuple] = {}  # key -> the objects it names, oldest first
        # a list or dict among them whose contents the code reads has its elements in the key
        # too: held by identity alone, a list whose element was replaced would give the old
        # answer (a list the code only appends to, a trace-time side effect, is not read; the
        # code is read only where a list or dict is found)
        positions = list(self.names) + list(self.names[:1]) + list(getattr(code, "co_freevars", ()))
        containers = [(k, name) for k, (name, o) in enumerate(zip(positions, self._read()))
                      if isinstance(o, _MUTABLE_CONTAINERS)]
        read = _contents_read(code) if containers else set()
        self._read_positions = tuple(k for k, name in containers if name in read)

    def __bool__(self) -> bool:
        return bool(self.names or self.cells)

    def key(self) -> tuple:
        found = self._read()
        key = tuple(map(id, found))
        if self._read_positions:
            elements: list = []
            key += tuple(_elements_key(found[k], elements) for k in self._read_positions)
            found += tuple(elements)
        if key not in self._kept:
            self._kept[key] = found
        return key

    def _read(self) -> tuple:
        try:
            found = self._read_globals(self.globals)
        except KeyError:  # (the same layout, an unbound name as _UNBOUND)
            found = tuple(self.globals.get(n, _UNBOUND) for n in (*self.names, *self.names[:1]))
        if self.cells:
            found += tuple(map(_contents, self.cells))
        return found

    def evicted(self) -> list[tuple]:
        """The keys let go beyond the last MAX_OUTSIDE_STATES (their entries must go too)."""
        gone = list(self._kept)[:-MAX_OUTSIDE_STATES]
        for key in gone:
            del self._kept[key]
        return gone


_MUTABLE_CONTAINERS = (list, dict, collections.deque)  # (and their subclasses: OrderedDict, Counter)
_MUTATORS = frozenset({"append", "extend", "insert", "clear", "update", "add", "discard", "remove", "__setitem__"})


def _contents_read(code: Optional[types.CodeType]) -> set[str]:
    """The global and closed-over names the code (nested code included) loads other than to
    call a method that only writes into it (`calls.append(1)`)."""
    read = set()
    for c in nested_code(code):
        instructions = instructions_of(c)
        for ins, following in zip(instructions, instructions[1:] + (None,)):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF") and not (
                    following is not None and following.opname in ("LOAD_METHOD", "LOAD_ATTR")
                    and following.argval in _MUTATORS):
                read.add(ins.argval)
    return read


_VALUES = (int, float, complex, bool, str, bytes, type(None))


def _elements_key(container, objects: list, depth: int = 4) -> tuple:
    """A list's or dict's contents for the key: numbers and strings by value, nested lists,
    dicts and tuples followed (`depth` levels), anything else by identity (appended to
    `objects`, which the key keeps alive so that no other object takes its id)."""
    def element(v):
        kind = type(v)
        if kind in _VALUES:
            return _exact(v)
        if isinstance(v, (tuple, *_MUTABLE_CONTAINERS)) and depth > 0:
            return kind, _elements_key(v, objects, depth - 1)
        objects.append(v)
        return id(v)
    if isinstance(container, dict):
        return tuple((element(k), element(v)) for k, v in container.items())
    return tuple(map(element, container))


def _contents(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (a variable not assigned yet)
        return _UNBOUND


@functools.lru_cache(maxsize=4096)
def instructions_of(code: types.CodeType) -> tuple[dis.Instruction, ...]:
    """The code's instructions, read once per code object: each compile walks the user's code
    several times (the questions below, the disk cache's key)."""
    return tuple(dis.get_instructions(code))


def nested_code(code: Optional[types.CodeType]) -> Iterator[types.CodeType]:
    """code and the code nested in it (lambdas, comprehensions, inner functions); nothing for
    an object without code (a builtin, a callable object)."""
    stack = [code] if isinstance(code, types.CodeType) else []
    while stack:
        c = stack.pop()
        yield c
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


# What a function may ask that a trace answers otherwise than eager: the trace calls the
# function with stand-in tensors (FakeTensor), so `type(x) is torch.Tensor` and `x.__class__`
# name another class, and torch's "am I traced" questions say yes. (isinstance(x,
# torch.Tensor) holds for both; a number's type is frontend/number_check.py's.)
_TYPE_BUILTINS = frozenset({"type"})  # (as a global: `x.device.type` is an attribute)
_TYPE_QUESTIONS = frozenset({"__class__", "is_fx_tracing", "has_torch_function", "has_torch_function_unary",
                             "has_torch_function_variadic"})
# packages whose objects are named, not read: torch's own code is written for its tracers, and
# a library's version is in the disk cache's key
_LIBRARIES = frozenset({"torch", "triton", "tjit", "numpy", "sympy"})


def type_questions(fn: Callable) -> list[tuple[str, Optional[str]]]:
    """The questions above that fn's code asks, or a function of the user's it reaches
    (_user_code): (where, e.g. "type() in f (file:line)"; the parameter of fn it asks
    about, when the code asks it of fn's own parameter right away, `type(p)` or
    `p.__class__`, else None: anything)."""
    found = []
    for f, c, instructions in _user_code(fn):
        own = c is f.__code__ and f is fn
        parameters = c.co_varnames[:c.co_argcount + c.co_kwonlyargcount]
        for k, ins in enumerate(instructions):
            if ins.argval in _TYPE_BUILTINS and ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                subject = _loaded_parameter(instructions[k + 1:k + 3], parameters, own)
                found.append((_where(ins.argval + "()", c), subject))
            elif ins.argval in _TYPE_QUESTIONS and ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR",
                                                                 "LOAD_METHOD"):
                subject = _loaded_parameter(instructions[k - 1:k], parameters, own) if ins.argval == "__class__" \
                    else None
                found.append((_where(ins.argval, c), subject))
    return found


def state_read(fn: Callable, arguments: dict[str, Any]) -> Optional[str]:
    """Where fn's code, or a function of the user's it reaches (_user_code), reads
    mutable state that the cache key does not hold: an object of a user's class, an
    nn.Module, a namespace, or a list or dict holding such, through a global or a
    closed-over variable, or as one of fn's arguments (`arguments`, by parameter name); or
    a data attribute of a user's module (`config.SCALE`). A trace bakes in what it read
    there, and the key holds such an object by identity, so a changed attribute would give
    the old answer; None where it reads none. (A list or dict of tensors and numbers is in
    the key by its elements: OutsideState.)"""
    for f, c, instructions in _user_code(fn):
        parameters = arguments if f is fn and c is f.__code__ else {}
        for k, ins in enumerate(instructions):
            value = _loaded(ins, f, parameters)
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and _module_data(value, instructions[k + 1:k + 2]):
                return _where(f"{ins.argval}.{instructions[k + 1].argval}", c)
            if ins.opname == "LOAD_FAST" and _held_by_value(value):
                continue
            if value is not _NOT_READ and _is_state(value):
                return _where(ins.argval, c)
    return None


def volatile_read(fn: Callable, arguments: dict[str, Any]) -> Optional[str]:
    """Where fn's code, or a function of the user's it reaches (_user_code), reads what
    changes from call to call without any argument or variable being bound anew: Python's
    or numpy's random numbers, the clock, the environment (`x * random.random()`,
    `rng.random()` of a generator among its globals, cells or `arguments`, `time.time()`,
    `os.environ["S"]`). A trace would bake in the value it read; Dynamo reads it at every
    call. None where it reads none."""
    return next((where for where, value in _outside_loads(fn, arguments) if _volatile(value)), None)


def random_objects_read(fn: Callable, arguments: dict[str, Any]) -> Optional[str]:
    """Where fn's code (as volatile_read) draws from a random.Random object of its globals,
    cells or arguments (`rng.random()`, `rng.randint(...)`), which Dynamo bakes in as a
    trace would: the function runs eagerly. (Python's own `random.random()` Dynamo draws at
    every call.)"""
    return next((where for where, value in _outside_loads(fn, arguments) if isinstance(value, random.Random)),
                None)


def _outside_loads(fn: Callable, arguments: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(where, value) for each load in fn's code or a function of the user's it reaches
    (_user_code) of a global, a closed-over variable or one of fn's `arguments`, or of an
    attribute of such a module (`np.random`)."""
    for f, c, instructions in _user_code(fn):
        parameters = arguments if f is fn and c is f.__code__ else {}
        for k, ins in enumerate(instructions):
            value = _loaded(ins, f, parameters)
            if value is _NOT_READ:
                continue
            following = instructions[k + 1] if k + 1 < len(instructions) else None
            if isinstance(value, types.ModuleType) and value.__name__ not in _VOLATILE_MODULES:
                if following is None or following.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                    continue
                yield _where(f"{ins.argval}.{following.argval}", c), getattr(value, following.argval, None)
            else:
                yield _where(ins.argval, c), value


# modules whose every use reads what changes between calls; os's functions and objects too
# (os.environ, os.getenv), but not its other modules (os.path)
_VOLATILE_MODULES = frozenset({"random", "time", "datetime", "secrets", "uuid", "numpy.random"})


def _volatile(value) -> bool:
    if isinstance(value, types.ModuleType):
        modules = [value.__name__]
    else:
        modules = [getattr(value, "__module__", None), type(getattr(value, "__self__", None)).__module__,
                   type(value).__module__]
    return any(m and (m in ("os", "posix") or m in _VOLATILE_MODULES or m.startswith("numpy.random."))
               for m in modules if isinstance(m, str))


def state_written(fn: Callable, arguments: dict[str, Any]) -> Optional[str]:
    """Where fn's code, or a function of the user's it reaches (_user_code), changes Python
    state that outlives the call: binds a global or a variable it closes over, calls a
    method that writes into a list, dict or set held by a global, a closed-over variable or
    one of fn's arguments (`calls.append(1)`), assigns or deletes an item of one
    (`cache["y"] = x * 3`), or prints. A trace runs the code once: eager does it on every
    call, and a tensor the trace stored would be its stand-in (FakeTensor). Dynamo replays
    such writes after each call (and runs a print eagerly). A helper that writes into a
    container it was passed (`def record(acc, v): acc.append(v)`) counts where the code also
    loads such a container of the outside, which it may have passed. None where it writes
    none."""
    helper_write, outside_loaded = None, False
    for f, c, instructions in _user_code(fn):
        outer = set(f.__code__.co_freevars)
        own = f is fn and c is f.__code__
        parameters = arguments if own else {}
        passed = set() if own else set(c.co_varnames[:_parameter_count(c)])

        def container(ins) -> bool:  # (whether the load reads a list, dict or set of the outside)
            return isinstance(_loaded(ins, f, parameters), _WRITABLE_CONTAINERS)

        outside_loaded = outside_loaded or any(map(container, instructions))
        for k, ins in enumerate(instructions):
            if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL") or (
                    ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in outer):
                return _where(f"binding {ins.argval}", c)
            root = _written_container(instructions, k)
            if root is _UNKNOWN:  # (any list, dict or set of the outside the code loads)
                root = next(filter(container, instructions), None)
            if root is not None and container(root):
                return _where(f"{root.argval}.{ins.argval}()" if ins.opname in ("LOAD_METHOD", "LOAD_ATTR")
                              else f"an item of {root.argval} written", c)
            if root is not None and root.opname == "LOAD_FAST" and root.argval in passed and helper_write is None:
                helper_write = _where(f"{root.argval} written, an argument of {c.co_name}", c)
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == "print" and "print" not in f.__globals__:
                return _where("print()", c)
            if _sets_random_state(f, parameters, instructions, k):
                return _where(f"{ins.argval}()", c)
    return helper_write if outside_loaded else None


def _parameter_count(code: types.CodeType) -> int:
    return code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS) + \
        bool(code.co_flags & inspect.CO_VARKEYWORDS)


_UNKNOWN = object()


def _written_container(instructions: list, k: int):
    """Where instructions[k] writes into a container (a writing method's name, or an item's
    assignment or deletion), the load that put the container on the stack (`cache` in
    `cache.append` or `cache[key] = v`), or _UNKNOWN where the walk back cannot tell; None
    where it writes into none."""
    ins = instructions[k]
    if ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and ins.argval in _WRITING_METHODS and k > 0:
        return instructions[k - 1]
    if ins.opname in ("STORE_SUBSCR", "DELETE_SUBSCR"):
        return _subscript_container(instructions, k) or _UNKNOWN
    return None


_WRITABLE_CONTAINERS = (list, dict, set, bytearray, collections.deque)
_WRITING_METHODS = _MUTATORS | {"pop", "popitem", "popleft", "appendleft", "extendleft", "setdefault", "sort",
                                "reverse", "rotate", "difference_update", "intersection_update",
                                "symmetric_difference_update", "__delitem__"}


# torch's functions that set its random number generators' state, by module and name (Dynamo
# wraps torch.manual_seed when it is imported): a trace would set it once, and the kernels draw
# from wherever the generator then stands
_RANDOM_STATE_SETTERS = frozenset({("torch.random", name) for name in ("manual_seed", "seed", "set_rng_state")} |
                                  {("torch.cuda.random", name) for name in ("manual_seed", "manual_seed_all", "seed",
                                                                           "seed_all", "set_rng_state",
                                                                           "set_rng_state_all")})
_GENERATOR_SETTERS = frozenset({"manual_seed", "seed", "set_state"})


def _sets_random_state(f: Callable, parameters: dict, instructions: list, k: int) -> bool:
    """Whether instructions[k] names a function of _RANDOM_STATE_SETTERS (`torch.manual_seed`,
    a global bound to one, `torch.random.manual_seed` two attributes deep) or a method of
    _GENERATOR_SETTERS of a torch.Generator (`gen.manual_seed`)."""
    ins = instructions[k]
    if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
        return _sets_state(f.__globals__.get(ins.argval))
    if ins.opname not in ("LOAD_ATTR", "LOAD_METHOD") or k == 0:
        return False
    holder = _loaded(instructions[k - 1], f, parameters)
    if instructions[k - 1].opname == "LOAD_ATTR" and k > 1:  # (`torch.random`.manual_seed)
        holder = getattr(_loaded(instructions[k - 2], f), instructions[k - 1].argval, None)
    if isinstance(holder, torch.Generator):
        return ins.argval in _GENERATOR_SETTERS
    return isinstance(holder, types.ModuleType) and _sets_state(getattr(holder, ins.argval, None))


def _sets_state(value) -> bool:
    """Whether value is one of _RANDOM_STATE_SETTERS (through any wrappers)."""
    if not callable(value):
        return False
    try:
        found = inspect.unwrap(value)
    except ValueError:  # (a cycle of __wrapped__)
        return False
    return (getattr(found, "__module__", None), getattr(found, "__qualname__", None)) in _RANDOM_STATE_SETTERS


def _subscript_container(instructions: list, k: int):
    """The load at the root of the container expression that STORE_SUBSCR or DELETE_SUBSCR
    at instructions[k] writes into (`cache` in `cache[key, 1] = v`, `self` in
    `self.cache[key] = v`), found by walking back over the stack effects of the straight-line
    code before it; None where a jump or an unknown instruction is in the way."""
    wanted = 2  # (the container is the second item from the top: the key is above it)
    for ins in reversed(instructions[:k]):
        if ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs or \
                ins.opname.startswith(("SWAP", "COPY", "ROT_", "DUP_TOP")):  # (`cache[k] += 1` reorders)
            return None
        try:
            wanted -= dis.stack_effect(ins.opcode, ins.arg)
        except ValueError:
            return None
        if wanted <= 0:
            return ins if wanted == 0 and ins.opname.startswith("LOAD_") and ins.opname != "LOAD_ATTR" else None
        if ins.is_jump_target:  # (what is below on the stack came by more than one path)
            return None
    return None


_NOT_READ = object()


def _loaded(ins, f: Callable, parameters: Optional[dict] = None) -> Any:
    """The value the instruction loads where it loads a global, a variable f closes over or
    one of `parameters` (name -> value); _NOT_READ for any other instruction."""
    if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in f.__globals__:
        return f.__globals__[ins.argval]
    if ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and ins.argval in f.__code__.co_freevars:
        return _contents(f.__closure__[f.__code__.co_freevars.index(ins.argval)])
    if ins.opname == "LOAD_FAST" and parameters and ins.argval in parameters:
        return parameters[ins.argval]
    return _NOT_READ
_IMMUTABLE = (int, float, complex, bool, str, bytes, range, slice, type(None), type(Ellipsis), torch.dtype,
              torch.device, torch.Size, torch.layout, torch.memory_format, enum.Enum)
_BUFFERS = (bytearray, memoryview, array.array, numpy.ndarray)  # (read by element, written in place)
_CODE = (types.FunctionType, types.BuiltinFunctionType, types.BuiltinMethodType, type, types.ModuleType,
         functools.partial)


def _module_data(value, following: list) -> bool:
    """Whether a global's load, and the instruction after it, read a data attribute of a
    user's module (anything but code: a function, a class, a module), which the module's
    code may bind to another value."""
    if isinstance(value, types.ModuleType) and not is_library(value.__name__) and following \
            and following[0].opname in ("LOAD_ATTR", "LOAD_METHOD"):
        return not isinstance(getattr(value, following[0].argval, None), _CODE)
    return False


def _is_state(value) -> bool:
    if isinstance(value, (torch.Tensor, *_IMMUTABLE)):
        return False
    if isinstance(value, (tuple, frozenset, list)):
        return any(_is_state(v) for v in value)
    if isinstance(value, dict):
        return any(_is_state(v) for v in value.values())
    if isinstance(value, types.MethodType):  # (a bound method reads its object)
        return _is_state(value.__self__)
    if isinstance(value, _CODE):
        return False
    if isinstance(value, (torch.nn.Module, types.SimpleNamespace, set, *_BUFFERS)) or hasattr(type(value), "__next__"):
        return True  # (an iterator's state is where it stands: `next(it)`; a buffer's is its bytes)
    return not is_library(type(value).__module__)


def _held_by_value(value) -> bool:
    """An argument the key holds by its value: one whose class defines equality and hashing
    (a frozen dataclass), besides numbers, strings and containers of them."""
    kind = type(value)
    return kind.__eq__ is not object.__eq__ and kind.__hash__ not in (None, object.__hash__)


def _user_code(fn: Callable, depth: int = 4) -> Iterator[tuple[Callable, types.CodeType, list]]:
    """(function, code, its instructions) for fn's code and the code nested in it, and the
    same for each function of the user's it reaches by a global, a closed-over variable or a
    user module's attribute (`depth` calls deep). Library code is not read: torch's own code
    is written for its tracers, and its state is not the user's."""
    seen, todo = set(), [(fn, 0)]
    while todo:
        f, level = todo.pop()
        code = getattr(f, "__code__", None)
        if not isinstance(code, types.CodeType) or code in seen or level > depth or \
                is_library(getattr(f, "__module__", None)):
            continue
        seen.add(code)
        for c in nested_code(code):
            yield f, c, instructions_of(c)
        names = [n for c in nested_code(code) for n in c.co_names]
        reached = [getattr(f, "__globals__", {}).get(name) for name in names]
        reached += [getattr(m, name, None) for m in reached if isinstance(m, types.ModuleType)
                    and not is_library(m.__name__) for name in names]
        reached += [_contents(cell) for cell in getattr(f, "__closure__", None) or ()]
        todo += [(g, level + 1) for g in reached if isinstance(g, types.FunctionType)]


def _where(name: str, code: types.CodeType) -> str:
    return f"{name} in {code.co_name} ({code.co_filename}:{code.co_firstlineno})"


def _loaded_parameter(instructions: list, parameters: tuple, own: bool) -> Optional[str]:
    """The parameter the first of these instructions (skipping a PUSH_NULL) loads, in the
    function's own code; None otherwise."""
    loads = [ins for ins in instructions if ins.opname != "PUSH_NULL"][:1]
    if own and loads and loads[0].opname == "LOAD_FAST" and loads[0].argval in parameters:
        return loads[0].argval
    return None


def is_library(module: Optional[str]) -> bool:
    """A module of the libraries above or of Python's standard library."""
    root = (module or "").split(".")[0]
    return root in _LIBRARIES or root in sys.stdlib_module_names

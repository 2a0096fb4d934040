"""Compiled entries on disk: a fresh process calling a function an earlier one compiled
loads its entry (graph, kernels' plans, memory plan) instead of tracing and lowering it.

The key is known before tracing, so a hit costs no trace: it is the call's guard_key (its
tensors' shapes, strides, dtypes, devices; its other arguments' values; the torch state
the trace runs under) with every part written out as text, the function's content
(`function_content`: its code, and what the globals and closed-over variables it reads
hold, the functions it calls followed into theirs; for a graph Dynamo captured, its code
and the attributes it reads), and the environment (tjit's own
source, the torch, triton and Python versions, the device, the TJIT_* settings). A call
whose key cannot be written out faithfully (an argument or a global that is an object of a
user's class, a large tensor constant, a user module passed around) is compiled as before
and not stored: `CompiledFunction.not_on_disk` says why.

A file holds the full key text and a SHA-256 of its payload; one whose key differs or
whose checksum fails is deleted and the entry rebuilt, never unpickled. The kernels
themselves are in the same directory as Python modules (loader.py) and Triton's own cache
holds their binaries. TJIT_CACHE_DIR sets the directory; TJIT_DISK_CACHE=0 turns it off.

The Programs name graph nodes by `id()` in places (a buffer's memory key, the aliases of
the slab), which a new process cannot keep: `dumps` writes each int that is the id of an
object in the entry as a reference to that object, and `loads` writes the id of its copy.
An int that looks like an address but is the id of no object in the entry makes the entry
one that is not stored.
"""
from __future__ import annotations

import builtins
import functools
import hashlib
import io
import os
import pickle
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import debug
from .guards import instructions_of, is_library as _is_library, nested_code
from .loader import cache_dir

MAGIC = b"tjit-entry-1\n"
MAX_TENSOR_CONSTANT_BYTES = 1 << 20  # a tensor a function reads from a global: hashed into the key up to this
# ints that may be addresses of objects (16-byte aligned, between these): one that is no
# object's of the entry is refused
_ADDRESSES = (1 << 32, 1 << 48)
# modules and builtins that read what a process does not share with the one that stored an
# entry (the environment, the clock, files, random state, object ids, the hash seed): a trace
# bakes what they gave in, so a function that uses them is not stored
_OUTSIDE_STATE_MODULES = frozenset({"os", "sys", "time", "random", "datetime", "secrets", "uuid", "socket",
                                    "subprocess", "pathlib", "io", "shutil", "glob", "tempfile", "platform",
                                    "getpass", "posix", "threading", "multiprocessing", "numpy.random"})
_OUTSIDE_STATE_BUILTINS = frozenset({"open", "input", "id", "hash", "globals", "locals", "vars", "eval", "exec",
                                     "compile", "__import__"})


class NotCacheable(Exception):
    """What keeps a call's entry off the disk."""


@dataclass(frozen=True)
class EntryKey:
    text: str  # everything the entry depends on, written out
    # the tensors the function reads from its globals and closed-over variables: storage
    # address -> the name read. An entry that holds one (a trace's constant) is not stored: a
    # fresh process would load a copy, which the function's writes and later changes miss
    tensors_read: dict[int, str]


def enabled() -> bool:
    return os.environ.get("TJIT_DISK_CACHE", "1") not in ("0", "")


# -- the key -------------------------------------------------------------------------------------
def entry_key(fn: Callable, guard_key: tuple, flat: list[tuple[str, Any]], settings: tuple) -> EntryKey:
    """The full key text of a call's entry (NotCacheable when a part cannot be written out).
    flat: the call's arguments (each not a tensor must be plain data: guard_key holds it);
    settings: the CompiledFunction's own (donated names, size positions, dynamic dims)."""
    for name, v in flat:
        if not isinstance(v, torch.Tensor) and not _is_plain(v):
            raise NotCacheable(f"argument {name} holds a {type(_first_opaque(v)).__qualname__}, which the key "
                               "cannot hold by content")
    tjit_settings = sorted((k, v) for k, v in os.environ.items()  # (those that change what is generated, and more)
                           if k.startswith("TJIT_") and k not in ("TJIT_CACHE_DIR", "TJIT_DISK_CACHE", "TJIT_DEBUG"))
    content, tensors_read = function_content(fn)
    text = "\n".join((environment(), repr(tjit_settings), content, repr(guard_key), repr(settings)))
    return EntryKey(text, tensors_read)


@functools.lru_cache(maxsize=None)
def environment() -> str:
    """What every key shares in this process: tjit's source, the libraries' versions and the
    device kernels are generated for."""
    import triton
    from .interpreter import interpreting
    source = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        source.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    device = "interpreter" if interpreting() else (
        f"cuda {torch.cuda.get_device_name()} {torch.cuda.get_device_capability()}" if torch.cuda.is_available() else "cpu")
    return repr((source.hexdigest(), sys.version, torch.__version__, triton.__version__, device))


_PLAIN_TYPES = (type(None), type(Ellipsis), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                torch.layout, torch.memory_format)
_PLAIN_CLASSES = frozenset(_PLAIN_TYPES) | {tuple, list, torch.Size}  # (guard_key names an argument's type)


def _is_plain(value: Any) -> bool:
    """Whether value is data whose repr is its whole content."""
    if type(value) in _PLAIN_TYPES or isinstance(value, type) and value in _PLAIN_CLASSES:
        return True
    if type(value) in (tuple, list, torch.Size, frozenset, set):
        return all(map(_is_plain, value))
    return False


def _first_opaque(value: Any) -> Any:
    if type(value) in (tuple, list, torch.Size, frozenset, set):
        return next(_first_opaque(v) for v in value if not _is_plain(v))
    return value


def function_content(fn: Callable) -> tuple[str, dict[int, str]]:
    """A digest of what a trace of fn reads besides its arguments: its code, and what its
    globals and closed-over variables hold (NotCacheable when one cannot be written out);
    and the tensors among them (EntryKey.tensors_read)."""
    describer = _Describer()
    if isinstance(fn, types.MethodType) and isinstance(fn.__self__, torch.fx.GraphModule):
        text = lambda: describer.graph_module(fn.__self__)  # (a graph Dynamo captured)
    elif isinstance(fn, types.FunctionType):
        text = lambda: describer.function(fn)
    else:
        raise NotCacheable(f"a {type(fn).__qualname__} is compiled, not a function: the key holds functions by code")
    try:
        digest = hashlib.sha256(text().encode()).hexdigest()
    except RecursionError:  # (a container that holds itself)
        raise NotCacheable(f"what {fn.__qualname__} reads is nested too deep to write out") from None
    describer.tensors.pop(None, None)
    return digest, describer.tensors


class _Describer:
    """The text of the objects a function's code reaches: values as themselves, library
    functions and modules by name, the user's functions by their code and what it reads."""

    def __init__(self):
        self._functions: dict[int, str] = {}  # id -> its name in the text (a recursion refers to it)
        self.tensors: dict[int, str] = {}  # storage address -> name, of the tensors met

    def function(self, fn) -> str:
        if id(fn) in self._functions:
            return self._functions[id(fn)]
        self._functions[id(fn)] = f"<function {len(self._functions)}>"
        code = fn.__code__
        cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
        parts = [_code_text(code), self.value(fn.__defaults__, "defaults"), self.value(fn.__kwdefaults__, "defaults")]
        for (name, is_global), attributes in sorted(_names_read(code).items()):
            if not is_global:  # (a closed-over variable, or a local variable of fn that nested code reads)
                if name in cells:
                    parts.append(f"{name}={self.read(_cell_contents(cells[name]), name, attributes)}")
            elif name in fn.__globals__:
                parts.append(f"{name}={self.read(fn.__globals__[name], name, attributes)}")
            elif name in _OUTSIDE_STATE_BUILTINS:
                raise NotCacheable(f"it calls {name}(), which reads state a fresh process may not share")
            elif not hasattr(builtins, name):
                parts.append(f"{name}=<unbound>")
        return "(" + ", ".join(parts) + ")"

    def graph_module(self, gm: torch.fx.GraphModule) -> str:
        """An FX graph, node by node, and the attributes it reads. (Not its forward's code: a
        graph Dynamo captured generates that at its first call, and until then its forward is
        one function that every such graph shares.)"""
        parts = []
        for node in gm.graph.nodes:
            target = node.target if isinstance(node.target, str) else self.value(node.target, node.name)
            arguments = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _NodeName(n.name))
            parts.append(f"{node.op} {node.name} {target} {self.argument(arguments, node.name)}")
            if node.op in ("get_attr", "call_module"):
                value = gm
                for attribute in node.target.split("."):
                    value = getattr(value, attribute)
                parts.append(f"  {node.target}={self.value(value, node.target)}")
        # (how forward takes and returns its values, where it flattens pytrees itself)
        codegen = gm.graph._codegen
        parts.append(f"{type(codegen).__qualname__} {getattr(codegen, 'pytree_info', None)!r}")
        return "graph(" + "\n".join(parts) + ")"

    def argument(self, value, name: str) -> str:
        """A node's argument: other nodes by name, containers and slices by what they hold."""
        if isinstance(value, _NodeName):
            return f"%{value.name}"
        if isinstance(value, (tuple, list)):  # (FX's immutable_list and immutable_dict among them)
            return f"{type(value).__name__}(" + ", ".join(self.argument(v, name) for v in value) + ")"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {self.argument(v, name)}" for k, v in value.items()) + "}"
        if type(value) is slice:
            return f"slice({self.argument((value.start, value.stop, value.step), name)})"
        return self.value(value, name)

    def read(self, value, name: str, attributes: set[tuple[str, ...]]) -> str:
        """A global or a closed-over variable; of a user's module, the attributes read of it."""
        if not isinstance(value, types.ModuleType) or _is_library(value.__name__) and not _outside_state(value.__name__):
            return self.value(value, name)
        if _outside_state(value.__name__):
            raise NotCacheable(f"it reads module {value.__name__}, whose state a fresh process may not share")
        if () in attributes:
            raise NotCacheable(f"module {value.__name__} ({name}) is used other than by reading its attributes")
        found = []
        for chain in sorted(attributes):
            target = value
            for k, attribute in enumerate(chain):
                target = getattr(target, attribute, _UNBOUND)
                if not isinstance(target, types.ModuleType):
                    chain = chain[:k + 1]  # (the rest: attributes of what it holds, read by the trace)
                    break
            found.append(f"{'.'.join(chain)}={self.value(target, name + '.' + '.'.join(chain))}")
        return f"<module {value.__name__}: {', '.join(found)}>"

    def value(self, value, name: str) -> str:
        if _is_plain(value):
            return repr(value)
        if isinstance(value, (tuple, list)):  # (a list as it holds now: the key is made at each trace)
            return f"{type(value).__name__}(" + ", ".join(self.value(v, name) for v in value) + ")"
        if isinstance(value, dict) and all(type(k) is str for k in value):
            return "{" + ", ".join(f"{k!r}: {self.value(v, name)}" for k, v in sorted(value.items())) + "}"
        if isinstance(value, torch.Tensor):
            self.tensors[_storage_address(value)] = name
            return _tensor_text(value, name)
        if isinstance(value, torch.fx.GraphModule):  # (a subgraph: a higher-order op's body)
            return self.graph_module(value)
        if isinstance(value, types.ModuleType) and _is_library(value.__name__):  # (its version is in environment())
            return f"<module {value.__name__}>"
        # (a library's function by name, unless it closes over something: a decorator's wrapper
        # of the user's function, which is named as every other such wrapper is)
        if isinstance(value, types.FunctionType) and (not _is_library(value.__module__) or value.__closure__):
            return self.function(value)
        from .compiled import CompiledFunction  # (a function compiled by tjit, which this one calls)
        if isinstance(value, CompiledFunction) and isinstance(value.fn, types.FunctionType):
            return f"<tjit.compile {self.function(value.fn)}>"
        found = _library_name(value)
        if found is None:
            raise NotCacheable(f"{name} holds a {type(value).__qualname__}, which the key cannot hold by content")
        return found


def _library_name(value) -> Optional[str]:
    """The name of a library's function, class or op; None for anything else (a bound method
    of an object, whose state a name does not show, among them)."""
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"<op {value}>"
    if isinstance(value, (type, types.FunctionType)):
        module = value.__module__
    elif isinstance(value, types.BuiltinFunctionType) and (value.__self__ is None or
                                                            isinstance(value.__self__, (types.ModuleType, type))):
        module = value.__module__ or getattr(value.__self__, "__module__", None)
    elif isinstance(value, (types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType)):
        module = value.__objclass__.__module__
    else:
        return None
    if not (_is_library(module) or module == "builtins") or _outside_state(module):
        return None
    return f"<{module}.{getattr(value, '__qualname__', value)}>"


_UNBOUND = object()


@dataclass(frozen=True)
class _NodeName:
    name: str


def _outside_state(module: Optional[str]) -> bool:
    module = module or ""
    return any(module == m or module.startswith(m + ".") for m in _OUTSIDE_STATE_MODULES)


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # (a variable not assigned yet)
        return _UNBOUND


def _code_text(code: types.CodeType) -> str:
    """A code object's content (its bytecode, names and constants, nested code included);
    not its file or line numbers."""
    consts = tuple(_code_text(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return repr((code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
                 getattr(code, "co_exceptiontable", b"")))


def _names_read(code: types.CodeType) -> dict[tuple[str, bool], set[tuple[str, ...]]]:
    """The global and cell variable names fn's code (nested code included) reads, as (name,
    whether it is a global), each with the attribute chains read from it (() where it is
    used otherwise)."""
    found: dict[tuple[str, bool], set[tuple[str, ...]]] = {}
    for c in nested_code(code):
        instructions = instructions_of(c)
        for k, ins in enumerate(instructions):
            if ins.opname not in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_NAME"):
                continue
            chain = []
            for following in instructions[k + 1:]:
                if following.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                    break
                chain.append(following.argval)
            found.setdefault((ins.argval, ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")), set()).add(tuple(chain))
    return found


def _storage_address(t: torch.Tensor) -> Optional[int]:
    """Where t's memory is (None for a tensor without memory: meta, sparse, a tracer's)."""
    try:
        return t.untyped_storage().data_ptr() or None
    except Exception:  # (no storage to ask)
        return None


def _tensor_text(t: torch.Tensor, name: str) -> str:
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_TENSOR_CONSTANT_BYTES or t.layout != torch.strided or t.is_meta:
        raise NotCacheable(f"{name} holds a tensor of {nbytes} bytes, over the {MAX_TENSOR_CONSTANT_BYTES} bytes "
                           "the key holds by content")
    data = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return repr(("tensor", tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad, digest))


# -- the files -------------------------------------------------------------------------------------
def programs_dir() -> Path:
    """The entries' directory: the user's own, which no one else may write (an entry is
    unpickled, which can run code)."""
    path = cache_dir() / "programs"
    path.mkdir(mode=0o700, exist_ok=True)
    status = path.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise NotCacheable(f"{path} is not the user's own directory, or others may write to it")
    return path


def _path(key: str) -> Path:
    return programs_dir() / f"{hashlib.sha256(key.encode()).hexdigest()}.entry"


def load(key: EntryKey):
    """The entry stored under key, or None (no file, or one that fails its checks: deleted)."""
    try:
        path = _path(key.text)
        data = path.read_bytes()
    except (OSError, NotCacheable):
        return None
    try:
        return _parse(data, key.text)
    except Exception as e:  # (a corrupt or mismatched file: rebuilt)
        debug.log(1, f"disk cache: {path.name} is not used and is rebuilt: {type(e).__name__}: {e}")
        path.unlink(missing_ok=True)
        return None


def _parse(data: bytes, key: str):
    if not data.startswith(MAGIC):
        raise ValueError("not a tjit entry")
    header_end = data.index(b"\n", len(MAGIC))
    key_length, checksum = data[len(MAGIC):header_end].split(b" ")
    stored_key = data[header_end + 1:header_end + 1 + int(key_length)]
    payload = data[header_end + 1 + int(key_length):]
    if stored_key != key.encode():
        raise ValueError("stored under another key")
    if hashlib.sha256(payload).hexdigest().encode() != checksum:
        raise ValueError("checksum mismatch")
    return loads(payload)


def store(key: EntryKey, entry) -> None:
    """Write entry under key (atomically: a reader sees the old file or the new one)."""
    payload = dumps(entry, key.tensors_read)
    encoded = key.text.encode()
    path = _path(key.text)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(MAGIC + f"{len(encoded)} {hashlib.sha256(payload).hexdigest()}\n".encode() + encoded + payload)
    tmp.replace(path)


# -- pickling with ids ----------------------------------------------------------------------------
def dumps(entry, tensors_read: Optional[dict[int, str]] = None) -> bytes:
    """The entry pickled, each int that is the id of one of its objects written as a
    reference to it (NotCacheable if it cannot be pickled, holds an address-like int that is
    no object's of it, or holds a tensor in tensors_read's memory)."""
    try:
        objects, ints = _contents(entry)
        for t in (v for v in objects.values() if isinstance(v, torch.Tensor)):
            read = (tensors_read or {}).get(_storage_address(t))
            if read is not None:
                raise NotCacheable(f"the kernels read {read}, a tensor of the function's globals or closed-over "
                                   "variables: a fresh process would load a copy of it, not it")
        stray = [i for i in ints if _ADDRESSES[0] <= i < _ADDRESSES[1] and i % 16 == 0 and i not in objects]
        if stray:
            raise NotCacheable(f"the entry holds ints that may be ids of objects outside it ({stray[:3]})")
        referenced = sorted(i for i in ints if i in objects)
        buffer = io.BytesIO()
        writer = _IdWriter(buffer, {i: k for k, i in enumerate(referenced)})
        writer.dump([objects[i] for i in referenced])  # (first: loading them precedes every reference)
        writer.dump_references = True
        writer.dump(entry)
    except NotCacheable:
        raise
    except Exception as e:
        raise NotCacheable(f"the entry cannot be pickled: {type(e).__name__}: {e}") from None
    return buffer.getvalue()


def loads(payload: bytes):
    reader = _IdReader(io.BytesIO(payload))
    reader.referenced = reader.load()
    return reader.load()


class _Pickler(pickle.Pickler):
    """Pickles torch's ops (which pickle cannot) by their names."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _torch_op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _torch_op, (obj._qualified_op_name, None)
        return NotImplemented


def _torch_op(qualified_name: str, overload: Optional[str]):
    namespace, name = qualified_name.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


class _Collector(_Pickler):
    """Records every object an entry pickles (by id), and the ints it holds."""

    def __init__(self):
        super().__init__(io.BytesIO())
        self.objects: dict[int, Any] = {}
        self.ints: set[int] = set()

    def persistent_id(self, obj):
        if type(obj) is int:
            self.ints.add(obj)
        elif type(obj) not in (str, bytes, float, bool, type(None)):
            self.objects[id(obj)] = obj
        return None


def _contents(entry) -> tuple[dict[int, Any], set[int]]:
    """The objects an entry pickles (by id, the entry's own left out) and the ints it holds."""
    collector = _Collector()
    collector.dump(entry)
    collector.objects.pop(id(entry), None)
    return collector.objects, collector.ints


class _IdWriter(_Pickler):
    """Writes the objects named by id, then the entry, each int naming one as a reference."""

    def __init__(self, file, references: dict[int, int]):
        super().__init__(file)
        self.references = references
        self.dump_references = False  # (not among the objects named by id, which load before any reference)

    def persistent_id(self, obj):
        if type(obj) is int and obj in self.references:
            if not self.dump_references:
                raise NotCacheable("an object named by id names another by id")
            return f"id {self.references[obj]}"  # (a str: an int here would come back to this method)
        return None


class _IdReader(pickle.Unpickler):
    """Reads the objects named by id (into `referenced`), then the entry, each reference
    as the id of its copy."""

    def __init__(self, file):
        super().__init__(file)
        self.referenced: list = []

    def persistent_load(self, pid):
        return id(self.referenced[int(pid.split(" ")[1])])

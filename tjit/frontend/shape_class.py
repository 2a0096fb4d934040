"""Trace once per shape class: one symbolic trace, a concrete graph per size from it.

A function called at a new size needs a new IR graph (tjit's IR has concrete sizes), but not
a new trace. make_fx traced once with symbolic sizes (frontend/trace.py, `symbolic=True`)
records the function's aten graph for every size at once, and torch's ShapeEnv records the
guards it needed to (a broadcast needs two sizes equal, a branch on a size needs it on one
side). For a call whose sizes pass those guards, `ShapeClass.specialise` evaluates every
size, stride and Python number of the graph at the call's sizes: a concrete graph, with the
metadata make_fx would have given, for the converter. That costs a fraction of a trace (no
dispatch, no decompositions, no Python function run) and runs none of the user's code.

What counts as one class (guards.shape_class_key): the call's key with each size reduced to
0, 1 or "more" (torch specialises 0 and 1) and strides left out; the guards then decide,
and a class may hold a few traces (MAX_TRACES), e.g. one per stride pattern. Calls whose
inputs share memory are not classed (their traces stay per size).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import sympy
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from .. import debug
from .scalars import is_symbolic_number
from .trace import Traced, flatten_arguments, trace_symbolic

MAX_TRACES = 4  # symbolic traces per shape class; past them a new size is traced concretely


class NotConcrete(Exception):
    """A value of the symbolic graph that the call's sizes do not make concrete (a size
    mixed with a number read from tensor data)."""


class ShapeClass:
    """One symbolic trace and the guards its graph holds under."""

    def __init__(self, traced: Traced):
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
        self.traced = traced
        self._mode = traced.inputs[0].fake_mode  # (tensors come first)
        self._env = self._mode.shape_env
        code = guards_expression(self._env, traced.inputs)
        self._guards = compile(code, "<tjit shape guards>", "eval") if code else None
        self._globals = SYMPY_INTERP

    def admits(self, inputs: list) -> bool:
        """Whether the trace's guards hold for these inputs (tensors and sizes, in the trace's order)."""
        if self._guards is None:
            return True
        return bool(eval(self._guards, self._globals, {"L": {f"t{k}": v for k, v in enumerate(inputs)}}))

    def specialise(self, inputs: list) -> Optional[Traced]:
        """The trace at the sizes of these inputs (None if its guards do not hold for them)."""
        if not self.admits(inputs):
            return None
        # (a size the trace specialised, 0 or 1, is a plain int: its guard checked it, and it binds nothing)
        placeholders = [None if isinstance(t, int) else t for t in self.traced.inputs]
        try:
            bindings = self._env.bind_symbols(placeholders, inputs)
            return _concrete_trace(self.traced, Evaluator(bindings), self._mode)
        except Exception as e:  # (NotConcrete, or a graph this copy does not know: traced for its sizes instead)
            debug.log(1, f"a symbolic trace not specialised: {type(e).__name__}: {e}")
            return None


def guards_expression(shape_env, placeholders: list) -> Optional[str]:
    """The conjunction of the shape environment's guards on the placeholders, as Python over
    `L['t<k>']` (the k-th placeholder's value), or None if there are none. Each guard is
    parenthesised: ShapeEnv.produce_guards_expression joins them with a bare " and ", so a
    guard that prints as `a == 1 or a == 2` would swallow the others (a Mistral graph traced
    at 13 tokens then admitted 30). Static sizes are guarded too: a size the trace
    specialised must be that size."""
    from torch._dynamo.source import LocalSource
    sources = [LocalSource(f"t{k}") for k in range(len(placeholders))]
    guards = shape_env.produce_guards(placeholders, sources, ignore_static=False)
    return " and ".join(f"({guard})" for guard in guards) if guards else None


class Evaluator:
    """Symbolic sizes, strides and numbers at one call's values of the trace's symbols."""

    def __init__(self, bindings: dict[sympy.Symbol, int]):
        self.bindings = {symbol: sympy.Integer(n) for symbol, n in bindings.items()}
        self._known: dict[sympy.Expr, Any] = {}

    def __call__(self, value):
        if not is_symbolic_number(value):
            return value
        expr = value.node.expr
        found = self._known.get(expr)
        if found is None:
            found = self._known[expr] = self._evaluate(expr, value)
        return found

    def _evaluate(self, expr, value):
        concrete = sympy.sympify(expr).xreplace(self.bindings)
        if not (concrete.is_number or concrete in (sympy.true, sympy.false)):
            raise NotConcrete(f"{expr} at {self.bindings}")
        kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)]
        return kind(concrete)


def _is_size_symbolic(value) -> bool:
    """A Python number the sizes decide (not one read from tensor data, which the IR keeps
    as a runtime value)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    if not is_symbolic_number(value):
        return False
    unbacked = free_unbacked_symbols(value)
    if unbacked and unbacked != value.node.expr.free_symbols:
        raise NotConcrete(f"{value.node.expr}: sizes mixed with a number read from tensor data")
    return not unbacked


def _concrete_trace(traced: Traced, evaluate: Evaluator, mode) -> Traced:
    """A copy of the trace's graph with every size-decided number a literal and every node's
    metadata concrete (the storages of views shared as in the trace)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    metas = ConcreteMetas(evaluate, mode)
    for node in traced.gm.graph.nodes:
        val = node.meta.get("val")
        if _is_size_symbolic(val):  # (sym_size, and arithmetic on sizes): a literal where it is read
            env[node] = evaluate(val)
            continue
        if _whole_slice(node, env, evaluate):
            env[node] = env[node.args[0]]
            continue
        copy = graph.node_copy(node, lambda n: env[n])
        copy.meta = {key: v for key, v in node.meta.items() if key in KEPT_META}
        if "val" in node.meta:
            copy.meta["val"] = metas(val) if not isinstance(val, (tuple, list)) else tree_map(metas, val)
        env[node] = copy
    return Traced(ConcreteModule(graph, traced.gm), traced.tensor_names, traced.requires_grad, [],
                  traced.gradient_unknown, traced.written_grad_inputs, traced.returned_written, traced.returned)


KEPT_META = ("val", "stack_trace")


def _whole_slice(node: torch.fx.Node, env: dict, evaluate: Evaluator) -> bool:
    """A slice of a whole dimension (x[:, 0]'s ':') that only other ops read. Python indexing
    skips it where it knows the sizes (a trace at those sizes has none); with symbolic sizes
    it cannot, and a view read that way would be a second value to the converter."""
    if node.target is not torch.ops.aten.slice.Tensor or any(user.op != "call_function" for user in node.users):
        return False
    source, dim, start, end, step = [env[a] if isinstance(a, torch.fx.Node) else evaluate(a)
                                     for a in (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]]
    if not all(isinstance(v, int) for v in (dim, start or 0, step, end or 0)):  # (a number read from data)
        return False
    size = evaluate(node.args[0].meta["val"].shape[dim])
    return (start or 0) == 0 and step == 1 and (end is None or end >= size)


class ConcreteMetas:
    """Concrete fake tensors for symbolic ones: one storage per storage of the trace."""

    def __init__(self, evaluate: Evaluator, mode):
        self.evaluate = evaluate
        self.mode = mode
        self._storages: dict[int, torch.UntypedStorage] = {}

    def __call__(self, value):
        from torch._subclasses.fake_tensor import FakeTensor
        if not isinstance(value, FakeTensor):
            return self.evaluate(value) if _is_size_symbolic(value) else value
        if value.is_conj() or value.is_neg():
            raise NotConcrete("a lazily conjugated or negated value")
        ev = self.evaluate
        storage = value.untyped_storage()
        key = StorageWeakRef(storage).cdata
        if key not in self._storages:
            self._storages[key] = torch.UntypedStorage(ev(storage.nbytes()), device="meta")
        elem = torch.empty(0, dtype=value.dtype, device="meta")
        elem.set_(self._storages[key], ev(value.storage_offset()), [ev(s) for s in value.shape],
                  [ev(s) for s in value.stride()])
        concrete = FakeTensor(self.mode, elem, value.device)
        if value.requires_grad:
            concrete.requires_grad_(True)
        return concrete


class ConcreteModule:
    """What the converter reads of a GraphModule: the graph, and the tensors it holds
    (get_attr: real tensors the function closes over), here the symbolic trace's."""

    def __init__(self, graph: torch.fx.Graph, holder: torch.fx.GraphModule):
        self.graph = graph
        self._holder = holder

    def __getattr__(self, name: str):
        return getattr(self._holder, name)


def _changed_sizes(first: dict[str, tuple[int, ...]], flat: list) -> dict[str, tuple[bool, ...]]:
    """Per tensor argument, which of its sizes differ from the class's first call: the sizes a
    symbolic trace at the class's second size makes symbols (the others, a function's weights'
    among them, stay as they are and are guarded; as symbols they can cost seconds of torch's
    symbolic reasoning)."""
    return {name: tuple(a != b for a, b in zip(first[name], v.shape)) for name, v in flat
            if isinstance(v, torch.Tensor) and name in first}


class ShapeClasses:
    """A compiled function's symbolic traces, by shape class. dynamic: True traces
    symbolically from a class's first call, None from its second size (its first was traced
    with concrete sizes: most functions are called at one size; the sizes that changed are
    the symbols, as in Dynamo's automatic dynamic), False never."""

    def __init__(self, dynamic: Optional[bool] = None):
        self.dynamic = dynamic
        self._traces: dict[tuple, list[ShapeClass]] = {}
        # classes traced with concrete sizes: the sizes of each one's first call, per tensor
        self._seen: dict[tuple, dict[str, tuple[int, ...]]] = {}
        self._refused: set[tuple] = set()  # classes whose symbolic trace failed
        self.traces = 0  # symbolic traces made

    def traced(self, key: Optional[tuple], fn: Callable, args: tuple, kwargs: dict, requires_grad: frozenset,
               sizes: tuple[str, ...] = (), dynamic_dims: Optional[dict] = None) -> Optional[Traced]:
        """A concrete trace of the call from its class's symbolic trace (made now if it is
        time), or None: then the call is traced with its own sizes. sizes: the int arguments
        that are sizes (a Dynamo graph's), symbols in the trace; dynamic_dims: the tensors'
        sizes that are symbols (trace_symbolic)."""
        flat = flatten_arguments(fn, args, kwargs)
        tensors = [v for _, v in flat if isinstance(v, torch.Tensor)]
        if key is None or self.dynamic is False or not tensors:  # (no tensor: no size to make a symbol of)
            return None
        inputs = tensors + [dict(flat)[name] for name in sizes]
        for shape_class in self._traces.get(key, ()):
            found = shape_class.specialise(inputs)
            if found is not None:
                return found
        if not self._time_to_trace(key):
            self._seen.setdefault(key, {name: tuple(v.shape) for name, v in flat if isinstance(v, torch.Tensor)})
            return None
        if dynamic_dims is None and key in self._seen:  # (Dynamo's automatic dynamic, too)
            dynamic_dims = _changed_sizes(self._seen[key], flat)
        self.traces += 1
        try:
            shape_class = ShapeClass(trace_symbolic(fn, args, kwargs, requires_grad, sizes, dynamic_dims))
        except Exception as e:  # (the concrete trace gives the error, if it is the function's)
            debug.log(1, f"{getattr(fn, '__name__', fn)}: no symbolic trace ({type(e).__name__}: {e})")
            self._refused.add(key)
            return None
        self._traces.setdefault(key, []).append(shape_class)
        return shape_class.specialise(inputs)

    def _time_to_trace(self, key: tuple) -> bool:
        if key in self._refused or len(self._traces.get(key, ())) >= MAX_TRACES:
            return False
        return bool(self.dynamic) or key in self._seen

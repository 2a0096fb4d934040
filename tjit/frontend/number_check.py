"""Whether a trace with number arguments as runtime numbers is the trace of their values.

tjit.compile passes a function's float arguments (and ints that change) as runtime numbers:
the function receives a SymFloat or SymInt where eager gives it a float or an int, so that
one trace serves every value. Arithmetic cannot tell the two apart, but Python can:
`isinstance(p, float)`, `type(n) is int` and `isinstance(p, numbers.Real)` are False for a
symbol, and the function then takes a branch that eager does not, with no error anywhere (a
silent wrong answer). A branch on the number's value is no such risk: the trace raises there.

So the first trace with runtime numbers is checked against a trace with the numbers as the
literals they are (`same_as_literal_trace`): the two graphs must run the same ops, in the
same order, on the same tensors, with every number the runtime trace computes from the
arguments equal to the literal trace's at their values (a number read from tensor data,
`.item()`, is the same symbol in both where it is read from the same tensor). A difference,
or a number the check cannot decide, keeps the numbers literal.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import sympy
import torch
from torch.utils._pytree import tree_flatten

from .scalars import is_symbolic_number
from .trace import Traced

aten = torch.ops.aten
_ASSERTIONS = {aten._assert_scalar.default, aten.sym_constrain_range.default,
               aten.sym_constrain_range_for_size.default, aten._assert_async.msg}
_PYTHON_TYPE = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


class Undecided(Exception):
    """A value the check cannot compare."""


def same_as_literal_trace(runtime: Traced, literal: Traced, numbers: dict[str, Any]) -> Optional[str]:
    """None if `runtime` (traced with the arguments named in `numbers` as runtime numbers,
    read by `.item()` from 0-d tensors) is `literal` (traced with them as Python numbers,
    of the values given), else where they first differ."""
    ours, theirs = _ops(runtime.gm.graph), _ops(literal.gm.graph)
    if len(ours) != len(theirs):
        return f"{len(ours)} ops with runtime numbers, {len(theirs)} with their values"
    compare = _Comparison(runtime, literal, numbers)
    try:
        for a, b in zip(ours, theirs):
            if a.target != b.target or not compare.arguments((a.args, a.kwargs), (b.args, b.kwargs)):
                return f"{_describe(a)} with runtime numbers, {_describe(b)} with their values"
            compare.same[a] = b
    except Undecided as e:
        return str(e)
    return None


class _Comparison:
    """The two traces' nodes matched so far, and the runtime trace's symbols as the literal
    trace's values: a number argument's symbol as its value, a symbol read from a tensor
    (`.item()`) as the literal trace's read of the matching tensor."""

    def __init__(self, runtime: Traced, literal: Traced, numbers: dict[str, Any]):
        ours, theirs = _placeholders(runtime), _placeholders(literal)
        self.same: dict[torch.fx.Node, torch.fx.Node] = {ours[name]: node for name, node in theirs.items()}
        number_inputs = {node: name for name, node in ours.items() if name in numbers}
        read = _reads(runtime.gm.graph)
        self._values = {symbol: sympy.sympify(numbers[number_inputs[source]]) for symbol, source in read.items()
                        if source in number_inputs}
        self._read_from = {symbol: source for symbol, source in read.items() if source not in number_inputs}
        self._reads_of = {source: symbol for symbol, source in _reads(literal.gm.graph).items()}

    def arguments(self, ours, theirs) -> bool:
        flat_ours, spec_ours = tree_flatten(ours)
        flat_theirs, spec_theirs = tree_flatten(theirs)
        return spec_ours == spec_theirs and all(self._same(a, b) for a, b in zip(flat_ours, flat_theirs))

    def _same(self, a, b) -> bool:
        if isinstance(a, torch.fx.Node) and a in self.same:
            return self.same[a] is b
        (kind_a, a), (kind_b, b) = self._ours(a), _value(b)
        if kind_a is not kind_b:
            return False
        if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
            return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0 if kind_a is not bool else a == b
        if kind_a is float:  # (Python's arithmetic and sympy's may round the last bit apart)
            return a == b or math.isnan(a) and math.isnan(b) or math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
        return a == b

    def _ours(self, value) -> tuple[type, Any]:
        """A runtime trace's argument as (Python type, value) in the literal trace's terms."""
        kind, value = _value(value)
        if not isinstance(value, sympy.Basic):
            return kind, value
        replaced = {}
        for symbol in value.free_symbols:
            if symbol in self._values:
                replaced[symbol] = self._values[symbol]
            elif self.same.get(self._read_from.get(symbol)) in self._reads_of:
                replaced[symbol] = self._reads_of[self.same[self._read_from[symbol]]]
            else:
                raise Undecided(f"a number the check cannot follow ({value})")
        value = value.xreplace(replaced)
        if value.is_number or value in (sympy.true, sympy.false):
            return kind, kind(value)
        return kind, value


def _value(value) -> tuple[type, Any]:
    """(Python type, value) of a call's argument that is not a tensor of the trace: a
    symbolic number as its sympy expression."""
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if not is_symbolic_number(val) and type(val) not in (int, float, bool):
            raise Undecided(f"an argument {value.name} that is neither a tensor of the trace nor a number")
        value = val
    if is_symbolic_number(value):
        return _PYTHON_TYPE[type(value)], value.node.expr
    return type(value), value


def _reads(graph: torch.fx.Graph) -> dict[sympy.Symbol, torch.fx.Node]:
    """symbol -> the tensor `.item()` read it from."""
    return {node.meta["val"].node.expr: node.args[0] for node in graph.nodes
            if node.target is aten._local_scalar_dense.default and is_symbolic_number(node.meta.get("val"))}


def _placeholders(traced: Traced) -> dict[str, torch.fx.Node]:
    """The tensor placeholders by argument name."""
    return dict(zip(traced.tensor_names, (n for n in traced.gm.graph.nodes if n.op == "placeholder")))


def _ops(graph: torch.fx.Graph) -> list:
    """The graph's calls that make tensors or run for their effect, the tensors it holds
    (get_attr, compared by name) and its output: the numbers computed between them (sizes,
    arithmetic on runtime numbers) are compared where the calls take them, and the runtime
    trace's assertions on its symbols are its own."""
    return [n for n in graph.nodes if n.op in ("output", "get_attr") or n.op == "call_function"
            and n.target not in _ASSERTIONS and not _is_number(n.meta.get("val"))]


def _is_number(value) -> bool:
    return is_symbolic_number(value) or type(value) in (int, float, bool)


def _describe(node: torch.fx.Node) -> str:
    return "the output" if node.op == "output" else f"{getattr(node.target, '__name__', node.target)}"

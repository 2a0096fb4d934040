"""Gradients of library calls from torch's own derivative formulas, traced into aten ops.

For a library call `op(operands) -> results` and the gradient of one result, make_fx traces
`torch.autograd.grad(op(operands)[k], operands, grad)` on fake tensors (as AOTAutograd
does): torch's derivative formula for the op, as aten ops (mm's backward is two mm's,
convolution's is convolution_backward, sort's is a scatter by its indices). That graph is
converted into the backward IR graph like any traced function, so the formula's pointwise
work fuses with the rest of the backward and the ops tjit does not generate are library
calls of their own. The op itself appears in the traced graph only when the formula reads
its results; the result whose gradient this is is then the forward's value (saved or
recomputed), not a second run of the op. A formula that is one call of a backward op (a
convolution's, flash attention's, a max pool's) is built as that graph directly, without the
trace (direct_formulas.py).

Where the formula cannot be traced that way (an op that writes its arguments, a formula
that needs tensor data), the op's gradient is one library call that runs torch's backward
on real tensors (frontend/library.py: ExternGradient).
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import debug
from ..errors import TjitError
from ..frontend.convert import Converter
from ..frontend.library import WriteThroughView, library_call_gradient, write_through_view_gradient
from ..frontend.trace import lazy_make_fx
from ..ir import Extern, GraphNode, Operand, bind_operands
from .direct_formulas import direct_formula, fake_like

ValueOf = Callable[[GraphNode], GraphNode]

aten = torch.ops.aten
# Results whose derivative formula checks the data only on real tensors: that the loss does not
# depend on the phases of complex eigen- or singular vectors (FunctionsManual.cpp skips the
# check where at::isTensorSubclassLike, as fake tensors are), so a traced formula would give a
# gradient where eager raises. Op -> the results (pytree index) concerned, when complex: their
# gradient is torch's backward run as one call, which checks as eager does.
CHECKED_ON_REAL_TENSORS = {
    aten.linalg_eig.default: (1,),
    aten._linalg_eigh.default: (1,),
    aten._linalg_svd.default: (0, 2),
}


def takes_joint_gradient(node: GraphNode) -> bool:
    """A result of a call whose results' gradients are computed together, by one run of
    torch's backward (CHECKED_ON_REAL_TENSORS: the check reads them together; backward.py
    gathers them)."""
    if not isinstance(node.op, Extern) or node.op.index is None:
        return False
    call = node.op.call
    concerned = CHECKED_ON_REAL_TENSORS.get(call.target, ()) if isinstance(call.target, torch._ops.OpOverload) else ()
    return any(call.results.get(k) is not None and call.results[k].dtype.is_complex for k in concerned)


def library_gradient(vb, node: GraphNode, grad: GraphNode, value: ValueOf, wanted) -> list[Optional[GraphNode]]:
    """Gradients of the library call's result `node` for each of its operands whose gradient
    is `wanted` (None for the others), given the result's gradient `grad`."""
    wrt = tuple(k for k, s in enumerate(node.src) if s.dtype.has_gradient and wanted(s))
    if not wrt:
        return [None] * len(node.src)
    call = node.op.call
    if isinstance(call.target, WriteThroughView):
        return write_through_view_gradient(vb, node, grad, wanted)
    checked = node.dtype.is_complex and node.op.index in CHECKED_ON_REAL_TENSORS.get(call.target, ())
    # (a write the op makes in place would be traced as one)
    if isinstance(call.target, torch._ops.OpOverload) and not call.target._schema.is_mutable \
            and not getattr(call, "writes", ()) and not checked:
        try:
            formula = direct_formula(node, wrt, grad) or traced_formula(node, wrt, grad)
            # (what a failed conversion built is unreachable from the backward's outputs)
            return FormulaConverter(formula, vb, node, value).gradients(grad, wrt)
        except Exception as e:  # not traceable on fake tensors, or not convertible: torch's backward runs as a call
            debug.log(2, f"gradient of {call.name} runs as one library call: its formula does not trace: {e}")
    return library_call_gradient(vb, node, grad, value, wanted)


_FORMULAS: dict[tuple, fx.GraphModule] = {}  # formula key -> its traced graph (only read once traced)
_MOST_FORMULAS = 1024


def traced_formula(node: GraphNode, wrt: tuple[int, ...], grad: GraphNode) -> fx.GraphModule:
    """trace_formula, traced once per op, arguments and operand layouts: a model's layers call
    the same matmuls and norms on the same shapes, and each trace costs tens of milliseconds."""
    key = _formula_key(node, wrt, grad)
    if key is None:
        return trace_formula(node, wrt, grad)
    found = _FORMULAS.get(key)
    if found is None:
        if len(_FORMULAS) >= _MOST_FORMULAS:
            _FORMULAS.clear()
        found = _FORMULAS[key] = trace_formula(node, wrt, grad)
    return found


def _formula_key(node: GraphNode, wrt: tuple[int, ...], grad: GraphNode) -> Optional[tuple]:
    """What trace_formula's graph depends on, or None where an argument is not a plain value."""
    call = node.op.call

    def layout(n: GraphNode):
        return n.shape, (n.view.strides if all(s >= 0 for s in n.view.strides) else None), n.dtype

    def typed(value):  # (1, 1.0 and True are equal keys, but not the same argument)
        return value if isinstance(value, Operand) else (type(value), value)

    arguments = tree_flatten((call.args, call.kwargs))
    if any(isinstance(a, torch.Tensor) for a in arguments[0]):
        return None
    key = (call.target, tuple(typed(a) for a in arguments[0]), str(arguments[1]), node.op.index, wrt,
           tuple(layout(s) for s in node.src), layout(grad))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def trace_formula(node: GraphNode, wrt: tuple[int, ...], grad: GraphNode) -> fx.GraphModule:
    """The aten graph of (operands..., grad) -> gradients of the operands in `wrt`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    call, index = node.op.call, node.op.index

    def formula(*tensors):
        *operands, g = tensors
        leaves = [t.detach().requires_grad_() if k in wrt else t for k, t in enumerate(operands)]
        result = call.target(*bind_operands(call.args, leaves), **bind_operands(call.kwargs, leaves))
        out = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)][index]
        if not out.requires_grad:
            return [None] * len(wrt)
        return list(torch.autograd.grad(out, [leaves[k] for k in wrt], g, allow_unused=True))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [fake_like(mode, s) for s in node.src] + [fake_like(mode, grad)]
    with torch.enable_grad():
        gm = lazy_make_fx(formula)(*fakes)
    _drop_detaches(gm)
    gm.graph.eliminate_dead_code()
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    if any(free_unbacked_symbols(n.meta.get("val")) for n in gm.graph.nodes):
        raise TjitError("the formula's sizes depend on tensor data")
    return gm


def _same_arguments(args, call_args, kwargs, call_kwargs) -> bool:
    """Two argument lists of one op are the same call (keyword arguments left at their
    defaults by one side and given by the other compare by value)."""
    if len(args) != len(call_args) or tree_flatten(args)[1] != tree_flatten(call_args)[1]:
        return False
    if any(not _equal(a, b) for a, b in zip(tree_flatten(args)[0], tree_flatten(call_args)[0])):
        return False
    keys = set(kwargs) | set(call_kwargs)
    return all(_equal(kwargs.get(k), call_kwargs.get(k)) for k in keys)


def _equal(a, b) -> bool:
    if isinstance(a, Operand) or isinstance(b, Operand):
        return isinstance(a, Operand) and isinstance(b, Operand) and a.index == b.index
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return False
    return type(a) is type(b) and a == b


def _drop_detaches(gm: fx.GraphModule) -> None:
    """The formula detaches its operands to make them leaves of autograd; inside the
    backward graph that would only stop gradients that are never taken, and costs copies."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)


class FormulaConverter(Converter):
    """Converts a traced derivative formula into the backward graph being built: its
    placeholders are the operands' and the gradient's values there; the op's own call in the
    formula gives the forward's value for the result being differentiated."""
    is_gradient_formula = True

    def __init__(self, gm: fx.GraphModule, vb, node: GraphNode, value: ValueOf):
        super().__init__(gm, [])
        # (the formula's indexed reads are its own: their indices are checked, and negative
        # ones wrapped, as in any traced function; a backward's own gathers are known in range)
        self.b = vb.b
        self.view_sources = vb.view_sources  # (a reshaped gradient is written in its own shape: library.in_memory)
        self.forward_node, self.forward_value = node, value

    def gradients(self, grad: GraphNode, wrt: tuple[int, ...]) -> list[Optional[GraphNode]]:
        bound = iter(list(self.forward_node.src) + [None])
        nodes = list(self.gm.graph.nodes)
        self.position = {n: k for k, n in enumerate(nodes)}
        result: list[Optional[GraphNode]] = [None] * len(self.forward_node.src)
        for n in nodes:
            self.current = n
            if n.op == "placeholder":  # an operand's forward value is read only if the formula uses it
                src = next(bound)
                self.env[n] = None if not n.users else grad if src is None else self.forward_value(src)
                if n.users and src is not None and hasattr(self.forward_value, "note_operand"):
                    self.forward_value.note_operand(src)
            elif n.op == "get_attr":
                raise TjitError(f"derivative formula of {self.forward_node.op.call.name} holds a tensor constant")
            elif n.op == "call_function":
                self.env[n] = self._forward_call(n) if self._is_forward_call(n) else self.call(n)
            elif n.op == "output":
                flat, _ = tree_flatten(n.args[0])
                for k, item in zip(wrt, flat):
                    if isinstance(item, fx.Node):
                        src = self.forward_node.src[k]
                        result[k] = self.expand_to(self.cast(self.value(item), src.dtype), src.shape)
        return result

    def _is_forward_call(self, n: fx.Node) -> bool:
        """The op itself on the formula's operands, with the forward's arguments: the same
        target, each operand in its place, every other argument equal (a formula may call
        the op on other arguments: polygamma(n + 1, x), a transposed triangular_solve)."""
        call = self.forward_node.op.call
        if n.target is not call.target:
            return False
        placeholders = {p: k for k, p in enumerate(n.graph.find_nodes(op="placeholder"))}

        def as_call_argument(a):
            if isinstance(a, fx.Node):
                return Operand(placeholders[a]) if a in placeholders else a  # (a computed value: never equal)
            return a

        args, kwargs = tree_map(as_call_argument, (tuple(n.args), dict(n.kwargs)))
        return _same_arguments(args, call.args, kwargs, call.kwargs)

    def _forward_call(self, n: fx.Node):
        """The op's results as the forward computed them (saved or recomputed there), not a
        second run of the op: running it again could repeat a write it makes unseen (a batch
        norm's running statistics). A formula that reads a result the forward did not make
        is not converted: the caller runs torch's backward as one call instead."""
        results = n.meta["val"]
        if isinstance(results, torch.Tensor):
            return self.forward_value(self.forward_node)
        made = self.forward_node.op.call.results
        flat, spec = tree_flatten(results)
        if not isinstance(results, (tuple, list)) or len(flat) != len(results):
            raise TjitError(f"the results of {self.forward_node.op.call.name} are nested")
        index = {k: j for j, k in enumerate(k for k, r in enumerate(flat) if isinstance(r, torch.Tensor))}
        bound = list(flat)
        for user in n.users:
            k = user.args[1] if user.target is operator.getitem else None
            node = made.get(index.get(k)) if k is not None else None
            if node is None:
                raise TjitError(f"the derivative formula of {self.forward_node.op.call.name} reads a result of the "
                                "op the forward does not make")
            bound[k] = self.forward_value(node)
        return tree_unflatten(bound, spec)

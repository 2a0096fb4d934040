"""Derivative formulas that are one call of the op's own backward op, built as graphs directly.

For a convolution, flash attention or a max pool, torch's derivative formula
(derivatives.yaml) is a single call of a backward op: `convolution_backward(grad, input,
weight, ...)`. library_grad.py traces every formula with make_fx through
torch.autograd.grad, 10-30 ms per (op, shape, layout); a CNN's training step has one per
convolution shape. Here those formulas are written as the graph that trace gives (the same
backward op and arguments, the forward op itself where the formula reads its other results),
each node's value computed by the op's fake kernel, so FormulaConverter converts it as it
would the traced one. Only real floating-point calls of the gradient of the first result,
with every operand an argument of its own; anything else is traced.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from ..ir import GraphNode, Operand

aten = torch.ops.aten


def fake_like(mode, node: GraphNode) -> torch.Tensor:
    """A fake tensor of the node's shape, type and strides (contiguous where one is negative)."""
    strides = node.view.strides if all(s >= 0 for s in node.view.strides) else None
    with mode:
        if strides is None:
            return torch.empty(node.shape, dtype=node.dtype.torch)
        return torch.empty_strided(node.shape, strides, dtype=node.dtype.torch)


class _FormulaGraph:
    """An FX graph under construction whose nodes carry their fake values (meta "val")."""

    def __init__(self, node: GraphNode, grad: GraphNode):
        from torch._subclasses.fake_tensor import FakeTensorMode
        self.graph = fx.Graph()
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.operands = [self._placeholder(f"operand{k}", fake_like(self.mode, s)) for k, s in enumerate(node.src)]
        self.grad = self._placeholder("grad", fake_like(self.mode, grad))

    def _placeholder(self, name: str, value: torch.Tensor) -> fx.Node:
        p = self.graph.placeholder(name)
        p.meta["val"] = value
        return p

    def call(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        value = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
        with self.mode:
            node.meta["val"] = target(*tree_map(value, args), **tree_map(value, kwargs))
        return node

    def item(self, results: fx.Node, k: int) -> fx.Node:
        node = self.graph.call_function(operator.getitem, (results, k))
        node.meta["val"] = results.meta["val"][k]
        return node

    def module(self, gradients: list[Optional[fx.Node]]) -> fx.GraphModule:
        self.graph.output(gradients)
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _convolution(f: _FormulaGraph, a: dict, wanted: set[str]) -> dict[str, fx.Node]:
    """convolution's formula: convolution_backward, its output mask the gradients wanted."""
    names = ("input", "weight", "bias")
    bias = a["bias"]
    bias_sizes = None if bias is None else list(bias.meta["val"].shape)
    results = f.call(aten.convolution_backward.default, f.grad, a["input"], a["weight"], bias_sizes, a["stride"],
                     a["padding"], a["dilation"], a["transposed"], a["output_padding"], a["groups"],
                     [name in wanted for name in names])
    return {name: f.item(results, k) for k, name in enumerate(names) if name in wanted}


def _flash_attention_for_cpu(f: _FormulaGraph, a: dict, wanted: set[str]) -> dict[str, fx.Node]:
    """CPU flash attention's formula: its backward op, reading the forward's output and
    logsumexp (the forward call's results: FormulaConverter binds them to the forward's)."""
    forward = f.call(aten._scaled_dot_product_flash_attention_for_cpu.default, *a["args"], **a["kwargs"])
    results = f.call(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, f.grad, a["query"], a["key"],
                     a["value"], f.item(forward, 0), f.item(forward, 1), a["dropout_p"], a["is_causal"],
                     attn_mask=a["attn_mask"], scale=a["scale"])
    return {name: f.item(results, k) for k, name in enumerate(("query", "key", "value")) if name in wanted}


def _max_pool2d_with_indices(f: _FormulaGraph, a: dict, wanted: set[str]) -> dict[str, fx.Node]:
    """max_pool2d's formula: its backward op, reading the forward's indices."""
    forward = f.call(aten.max_pool2d_with_indices.default, *a["args"], **a["kwargs"])
    return {"self": f.call(aten.max_pool2d_with_indices_backward.default, f.grad, a["self"], a["kernel_size"],
                           a["stride"], a["padding"], a["dilation"], a["ceil_mode"], f.item(forward, 1))}


# op -> (its formula, the arguments it differentiates)
FORMULAS: dict[object, tuple[Callable, frozenset[str]]] = {
    aten.convolution.default: (_convolution, frozenset({"input", "weight", "bias"})),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (_flash_attention_for_cpu,
                                                               frozenset({"query", "key", "value"})),
    aten.max_pool2d_with_indices.default: (_max_pool2d_with_indices, frozenset({"self"})),
}


def direct_formula(node: GraphNode, wrt: tuple[int, ...], grad: GraphNode) -> Optional[fx.GraphModule]:
    """The graph of (operands..., grad) -> gradients of the operands in `wrt` (the module
    text), or None where the call is not one of these formulas' plain cases."""
    call = node.op.call
    found = FORMULAS.get(call.target)
    if found is None or node.op.index != 0 or call.writes or call.seed is not None or \
            not node.dtype.is_float or node.dtype.is_complex:
        return None
    formula, differentiable = found
    schema = call.target._schema.arguments
    if len(call.args) > len(schema) or set(call.kwargs) - {s.name for s in schema}:
        return None
    given = dict(zip((s.name for s in schema), call.args)) | dict(call.kwargs)
    values = {s.name: given.get(s.name, s.default_value) for s in schema}
    operand_of = {v.index: name for name, v in values.items() if isinstance(v, Operand)}
    # (an operand inside a list or given twice, attention's q as its k, or a gradient the formula does not give)
    if sorted(operand_of) != list(range(len(node.src))) or \
            sum(isinstance(v, Operand) for v in values.values()) != len(node.src) or \
            any(operand_of[k] not in differentiable for k in wrt):
        return None
    f = _FormulaGraph(node, grad)
    bound = lambda v: f.operands[v.index] if isinstance(v, Operand) else v  # noqa: E731
    arguments = {name: bound(v) for name, v in values.items()}
    arguments["args"], arguments["kwargs"] = tree_map(bound, (tuple(call.args), dict(call.kwargs)))
    gradients = formula(f, arguments, {operand_of[k] for k in wrt})
    return f.module([gradients.get(operand_of[k]) for k in wrt])

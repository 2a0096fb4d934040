"""Functions that need tensor data to go on, run split at those points.

One trace cannot hold a function whose sizes, Python numbers or branches come from tensor
data (`x[x > 0]`, `nonzero`, `.item()`, `if x.sum() > 0:`, `torch.equal`). Dynamo can: it
runs the function's bytecode and breaks its graph where a value must be read, runs that
part eagerly, and hands each graph in between to a backend. So tjit.compile gives such a
function to Dynamo with tjit as the backend: every graph is compiled by tjit (kernels and
library calls), only the data-dependent ops themselves run eagerly, and Dynamo's guards
re-check the branches on every call. A graph that still needs tensor data inside one
torch call (torch.cov calls aten.equal) runs eagerly as a whole, and `graphs` says so.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import DataDependentError, UnsupportedOpError


@dataclass
class SplitGraph:
    """One graph Dynamo handed over: compiled by tjit, or run eagerly because tjit refused it,
    or cut into parts around the custom autograd.Functions it applies."""
    compiled: Any  # a CompiledFunction of the graph (None when it is cut into parts)
    eager_because: Optional[str] = None  # why the graph runs eagerly (tjit's refusal), if it does
    parts: list = field(default_factory=list)  # the SplitGraphs of the parts tjit compiles


@dataclass
class SplitFunction:
    """fn run by Dynamo with tjit compiling each graph between its breaks."""
    fn: Callable
    reason: str  # why one trace could not hold fn: the data-dependent op
    graphs: list[SplitGraph] = field(default_factory=list)

    def __post_init__(self):
        self._run = torch.compile(self.fn, backend=self._backend, dynamic=False)

    def __call__(self, args: tuple, kwargs: dict):
        return self._run(*args, **kwargs)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        graph = graph_backend(gm, example_inputs)
        self.graphs.append(graph.split_graph)
        return graph


def graph_backend(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    """A Dynamo graph compiled by tjit on its first call; a graph tjit refuses (checked before
    anything runs, so no tensor was touched) runs eagerly instead, with a warning."""
    if any(_is_custom_function(node) for node in gm.graph.nodes):
        return _around_custom_functions(gm)
    from .compiled import CompiledFunction
    graph = SplitGraph(CompiledFunction(gm.forward, split_data_dependent=False))

    def run(*args):
        if graph.eager_because is None:
            try:
                graph.compiled.entry_for(*args)
            except UnsupportedOpError as e:
                graph.eager_because = f"{type(e).__name__}: {e}"
                if not isinstance(e, DataDependentError):
                    warnings.warn(f"tjit runs a graph of {len(gm.graph.nodes)} nodes eagerly: {e}", stacklevel=2)
        if graph.eager_because is not None:
            return gm(*args)
        return graph.compiled(*args)

    run.split_graph = graph
    return run


def _is_custom_function(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.higher_order.autograd_function_apply


def _around_custom_functions(gm: torch.fx.GraphModule) -> Callable:
    """The graph cut before and after each custom autograd.Function it applies (Dynamo's
    autograd_function_apply, with the Function's forward and backward as subgraphs): the
    Functions run eagerly, so their backward is the user's, as eager's; tjit compiles the
    parts between them (a Function on a gradient path would make tjit refuse the whole graph)."""
    from torch.fx.passes.split_module import split_module
    part_of: dict[torch.fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        source = node.args[0] if node.op == "call_function" and node.args else None
        if _is_custom_function(node):
            current += 1
            part_of[node] = current
            current += 1
        elif isinstance(source, torch.fx.Node) and _is_custom_function(source):
            part_of[node] = part_of[source]  # (a result taken out of the Function's tuple)
        else:
            part_of[node] = current
    split = split_module(gm, None, lambda node: part_of[node], keep_original_order=True)
    graph = SplitGraph(None)
    for name, part in list(split.named_children()):
        if not any(_is_custom_function(node) for node in part.graph.nodes):
            compiled = graph_backend(part, None)
            graph.parts.append(compiled.split_graph)
            setattr(split, name, _Called(compiled))

    def run(*args):
        return split(*args)

    run.split_graph = graph
    return run


class _Called(torch.nn.Module):
    """A compiled part of a cut graph, as the module the cut graph calls."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)

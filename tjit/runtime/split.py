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

import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import DataDependentError, NumberNeededError, UnsupportedOpError


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
    eager: bool = False  # run by eager instead, without Dynamo (reason says why)

    def __post_init__(self):
        self._run = self.fn if self.eager else torch.compile(self.fn, backend=self._backend, dynamic=False)

    def __call__(self, args: tuple, kwargs: dict):
        return self._run(*args, **kwargs)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        graph = graph_backend(gm, example_inputs)
        self.graphs.append(graph.split_graph)
        return graph


def graph_backend(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    """A Dynamo graph compiled by tjit on its first call; a graph tjit refuses (checked before
    anything runs, so no tensor was touched) runs eagerly instead, with a warning, unless what
    it refused can run as it is between compiled parts (_around: custom autograd.Functions, a
    higher-order op tjit's trace has no rule for, torch.func transforms it cannot follow)."""
    if any(_is_custom_function(node) for node in gm.graph.nodes):
        return _around(gm, {node for node in gm.graph.nodes if _is_custom_function(node)})
    from .compiled import CompiledFunction
    # (Dynamo passes each symbol of a dynamic graph as an int: the graph is traced with
    # symbolic sizes at once, and a new size is specialised from that trace)
    sizes = frozenset(k for k, v in enumerate(example_inputs or ()) if isinstance(v, torch.SymInt))
    # (the sizes Dynamo left static, its parameters' among them, stay so in tjit's symbolic trace:
    # Dynamo's guards keep them; as symbols they made that trace a hundred times slower on ViT)
    dims = _dynamic_dims(gm)

    def compiled(forward: Callable) -> CompiledFunction:
        return CompiledFunction(forward, split_data_dependent=False, dynamic=True if sizes else None,
                                size_positions=sizes, dynamic_dims=dims)
    graph = SplitGraph(compiled(gm.forward))
    by_values: dict[tuple, SplitGraph] = {}  # per tuple of values read by .item(), once they are specialised
    reads = _item_reads(gm)
    cut: list[Callable] = []  # the graph cut around what tjit refused in it (_around), once it has

    def run(*args):
        if cut:
            return cut[0](*args)
        if by_values:
            return _specialised(gm, reads, by_values, graph, args, compiled)
        if graph.eager_because is None:
            try:
                prepared = graph.compiled.prepare(args, {})
            except DataDependentError as e:
                if reads and _branched_on_data(e):  # on a number read from an input: specialise on it
                    return _specialised(gm, reads, by_values, graph, args, compiled)
                graph.eager_because = f"{type(e).__name__}: {e}"
                # (Dynamo keeps data-dependent ops in its graphs under capture_scalar_outputs and
                # capture_dynamic_output_shape_ops; torch.cov's aten.equal is inside one call)
                warnings.warn(f"tjit runs a graph of {len(gm.graph.nodes)} nodes eagerly: {e}", stacklevel=2)
            except UnsupportedOpError as e:
                if reads:  # (an op that takes the number read as a literal: a float where its schema has one)
                    return _specialised(gm, reads, by_values, graph, args, compiled)
                eager = _refused_higher_order_op(gm, e) or _function_transforms(gm)
                if eager:  # (flex_attention, torch.cond, torch.func.grad: run as they are, the rest compiled)
                    cut.append(_around(gm, eager))
                    graph.compiled, graph.parts = None, cut[0].split_graph.parts
                    return cut[0](*args)
                graph.eager_because = f"{type(e).__name__}: {e}"
                warnings.warn(f"tjit runs a graph of {len(gm.graph.nodes)} nodes eagerly: {e}", stacklevel=2)
        if graph.eager_because is not None:
            return gm(*args)
        return graph.compiled.run(prepared)

    run.split_graph = graph
    return run


def _dynamic_dims(gm: torch.fx.GraphModule) -> dict[int, tuple[bool, ...]]:
    """Per tensor input (by position), which of its sizes Dynamo made symbols (its graph's
    placeholders hold the fake tensors it traced with; the example inputs are real ones)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int
    found = {}
    for k, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):  # (a size Dynamo has specialised may be a SymInt of a constant)
            found[k] = tuple(not is_concrete_int(n) for n in value.shape)
    return found


def _item_reads(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.GraphModule, torch.fx.Node, int]]:
    """`.item()` calls on the graph's inputs: (the module whose graph makes the call, the
    call, the input's position), in graph order, the subgraphs of WRAPPERS included. With
    dynamic=True, Dynamo passes a module's float attributes (attention's scale, a norm's
    eps) as 0-d tensors read by .item(), and Python code that branches on such a number
    cannot be traced without its value."""
    positions = {node: k for k, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return list(_item_reads_in(gm, positions))


# higher-order ops that run one subgraph on the operands after it, as a function call would
# (activation checkpointing; regions under another grad mode or autocast)
WRAPPERS = ("tag_activation_checkpoint", "wrap_with_set_grad_enabled", "wrap_with_autocast")


def _item_reads_in(gm: torch.fx.GraphModule, positions: dict[torch.fx.Node, int]):
    """_item_reads in gm, whose placeholders `positions` maps to the outer graph's inputs."""
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "item" and node.args[0] in positions:
            yield gm, node, positions[node.args[0]]
        body = _wrapped_body(gm, node)
        if body is not None:
            subgraph, operands = body
            inner = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
            yield from _item_reads_in(subgraph, {p: positions[a] for p, a in zip(inner, operands) if a in positions})


def _wrapped_body(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """(subgraph, operands) of a call of one of WRAPPERS, else None."""
    if node.op != "call_function" or getattr(node.target, "__name__", None) not in WRAPPERS:
        return None
    bodies = [k for k, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a.op == "get_attr"
              and isinstance(getattr(gm, a.target, None), torch.fx.GraphModule)]
    if len(bodies) != 1:
        return None
    subgraph, operands = getattr(gm, node.args[bodies[0]].target), node.args[bodies[0] + 1:]
    return (subgraph, operands) if len(operands) == sum(n.op == "placeholder" for n in subgraph.graph.nodes) else None


def _branched_on_data(error: DataDependentError) -> bool:
    """Python code branched on a number read from a tensor (the trace could not go on), or an
    op needs it as a literal. (A number that only feeds arithmetic, a learning rate that
    changes every step, needs neither: it is a runtime value in the kernels.)"""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    return isinstance(error, NumberNeededError) or isinstance(error.__cause__, GuardOnDataDependentSymNode)


def _specialised(gm, reads: list, by_values: dict, graph: SplitGraph, args, compiled: Callable) -> Any:
    """The graph with each .item() of an input replaced by its value in this call, compiled
    once per tuple of values (a new value compiles anew; `graph` shows the latest; a dynamic
    graph's sizes stay symbols); eager where that is refused too."""
    values = tuple(args[k].item() for _, _, k in reads)
    found = by_values.get(values)
    if found is None:
        found = by_values[values] = SplitGraph(compiled(_with_values(gm, values).forward))
        try:
            found.compiled.entry_for(*args)
        except UnsupportedOpError as e:
            # eager from now on: the values were not what it needs, or it is refused whatever they
            # are (each new value, a learning rate's every step, would otherwise compile again)
            found.eager_because = f"{type(e).__name__}: {e}"
            by_values.clear()
            if not isinstance(e, DataDependentError):
                warnings.warn(f"tjit runs a graph of {len(gm.graph.nodes)} nodes eagerly: {e}", stacklevel=3)
    graph.compiled, graph.eager_because = found.compiled, found.eager_because
    return gm(*args) if found.eager_because is not None else found.compiled(*args)


def _with_values(gm, values: tuple) -> torch.fx.GraphModule:
    """A copy of gm whose .item() reads of inputs are the given Python numbers (in the order
    _item_reads lists them)."""
    copied = _copied(gm)
    changed = set()
    for (owner, node, _), value in zip(_item_reads(copied), values):
        for user in list(node.users):
            user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
            user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
        owner.graph.erase_node(node)
        changed.add(owner)
    for owner in changed:
        owner.recompile()
    return copied


def _copied(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm's graph and of its subgraphs' (the nodes' metadata shared)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copied = torch.fx.GraphModule(gm, graph)
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(copied, node.target, None), torch.fx.GraphModule):
            setattr(copied, node.target, _copied(getattr(copied, node.target)))
    return copied


def _function_transforms(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of the torch.func transforms (grad, vmap, jacrev) Dynamo inlined: each level
    entered and left by plain calls (`_grad_increment_nesting` ... `_grad_decrement_nesting`,
    saved-tensor hooks off around them), the ops between run on the level's wrapped tensors.
    (tjit's trace follows vmap, as HF models build their masks, but not grad.)"""
    if not any(_is_function_transform(node) for node in gm.graph.nodes):
        return set()
    found, depth = set(), 0
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        depth += name.endswith("_increment_nesting") or name == "_saved_tensors_hooks_disable"
        if depth > 0 or _is_function_transform(node):
            found.add(node)
        depth -= name.endswith("_decrement_nesting") or name == "_saved_tensors_hooks_enable"
    return found


def _is_function_transform(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and \
        getattr(node.target, "__module__", "").startswith(("torch._C._functorch", "torch._functorch"))


def _is_custom_function(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.higher_order.autograd_function_apply


def _refused_higher_order_op(gm: torch.fx.GraphModule, e: UnsupportedOpError) -> set[torch.fx.Node]:
    """The calls of the higher-order op that tjit's trace refused (torch.cond, flex_attention:
    tjit traces none), if that is what it refused."""
    prefix = "torch.ops.higher_order."
    return {node for node in gm.graph.nodes if e.op.startswith(prefix) and node.op == "call_function"
            and getattr(node.target, "__name__", None) == e.op[len(prefix):]}


def _around(gm: torch.fx.GraphModule, eager: set[torch.fx.Node]) -> Callable:
    """The graph cut before and after each run of `eager` nodes, which run as they are; tjit
    compiles the parts between them. Custom autograd.Functions (Dynamo's
    autograd_function_apply, the Function's forward and backward as subgraphs) run so, their
    backward the user's, as eager's (a Function on a gradient path would make tjit refuse the
    whole graph); so do torch.func transforms and higher-order ops tjit's trace refuses."""
    from torch.fx.passes.split_module import split_module
    part_of: dict[torch.fx.Node, int] = {}
    eager, eager_parts, current, in_eager = set(eager), set(), 0, False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in eager:
            eager.add(node)  # (a result taken out of the op's tuple)
        if (node in eager) != in_eager:
            current, in_eager = current + 1, not in_eager
        part_of[node] = current
        if in_eager:
            eager_parts.add(current)
    split = split_module(gm, None, lambda node: part_of[node], keep_original_order=True)
    graph = SplitGraph(None)
    for name, part in list(split.named_children()):
        if int(name[len("submod_"):]) not in eager_parts:
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

"""Lowering: group the graph's stores into kernels, schedule their axes, emit Triton."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from ..errors import TjitError
from ..ir import (AxisStrategy, Contiguous, Extern, Graph, GraphNode, ViewOp, copies_its_source, covered_memory,
                  toposort)
from .codegen import KernelPlan, plan_kernel
from .fusion import BufferTarget, ExternStep, KernelGroup, OutputTarget, group_kernels, same_layout
from .horizontal import merge_independent_kernels
from .library import LibraryPlan, plan_library_call

StrategyMap = Mapping[str, Sequence[AxisStrategy]]


class HasSteps:
    """Kernels and library calls, in the order they run (`steps`), and each kind apart."""
    steps: list[Union[KernelPlan, LibraryPlan]]

    @property
    def kernels(self) -> list[KernelPlan]:
        return [s for s in self.steps if isinstance(s, KernelPlan)]

    @property
    def library_calls(self) -> list[LibraryPlan]:
        return [s for s in self.steps if isinstance(s, LibraryPlan)]


@dataclass
class LoweredGraph(HasSteps):
    steps: list[Union[KernelPlan, LibraryPlan]]  # in the order they run
    groups: list[KernelGroup]  # one per kernel
    buffers: list[GraphNode]  # materialised intermediates, in the order kernels first write them
    # outputs that are a library call's result in the output's layout: returned as the call
    # left them (output name -> the Extern node), with no kernel copying them
    call_outputs: dict[str, GraphNode] = field(default_factory=dict)
    # outputs that are a buffer in the output's layout: the buffer is the output's memory (the
    # kernel that writes it writes the output; later steps read it there), not a slab buffer
    buffer_outputs: dict[str, GraphNode] = field(default_factory=dict)


def lower(graph: Graph, output_strides: dict[str, tuple[int, ...]],
          strategies: Optional[StrategyMap] = None, device: str = "cuda") -> LoweredGraph:
    """The graph's kernels, generated for the device type their tensors live on ("cpu", run by
    Triton's interpreter, or "cuda"): where eager's numerics differ between the two (a float32
    scan accumulates in double on CPU, in float32 on CUDA), the kernels follow the device's."""
    call_outputs = returned_call_results(graph, output_strides)
    buffer_outputs = returned_buffers(graph, output_strides, call_outputs)
    ordered, shared_outputs = group_kernels(graph, frozenset(call_outputs) | frozenset(buffer_outputs), output_strides)
    buffer_outputs.update(shared_outputs)
    returned = frozenset(id(node) for node in call_outputs.values())
    steps = [plan_library_call(g, returned) if isinstance(g, ExternStep) else
             plan_kernel(g, output_strides, forced_strategies(g, strategies or {}), device) for g in ordered]
    steps, groups = merge_independent_kernels(ordered, steps)
    buffers = [s.target.node for g in groups for s in g.stores if isinstance(s.target, BufferTarget)]
    return LoweredGraph(steps, groups, buffers, call_outputs, buffer_outputs)


def returned_call_results(graph: Graph, output_strides: dict[str, tuple[int, ...]]) -> dict[str, GraphNode]:
    """Outputs whose value is a library call's whole result, or a view of it that only
    reshapes it (logits [b*t, v] returned as [b, t, v]), in the output's layout: the call's
    tensor is the output (a copy kernel would only move its bytes). Output name -> the
    Extern node. The first output of each result only: two outputs eager returns as two
    tensors stay two tensors."""
    found, taken = {}, set()
    for name, node in graph.outputs.items():
        strides = output_strides.get(name)
        result = node.src[0] if isinstance(node.op, ViewOp) else node
        if isinstance(result.op, Extern) and result.op.index is not None and id(result) not in taken \
                and strides is not None and same_layout(node.view, strides) \
                and (node is result or (node.view.numel == result.view.numel and result.view.is_contiguous())):
            found[name] = result
            taken.add(id(result))
    return found


def returned_buffers(graph: Graph, output_strides: dict[str, tuple[int, ...]],
                     taken: dict[str, GraphNode]) -> dict[str, GraphNode]:
    """Outputs whose value is a buffer, the value a buffer holds (a library call's operand,
    a value autograd saves that the forward writes anyway) or a view that covers a buffer
    (attention's q written [b, s, h, d] for the call, saved as the [b, h, s, d] view the call
    read), in the output's layout: the buffer lives in the output's memory, so it is written
    once. The first output of each buffer only."""
    written = {id(n.src[0]): n for n in toposort(graph.roots()) if copies_its_source(n)}
    found, seen = {}, set()
    for name, node in graph.outputs.items():
        covered = covered_memory(node)
        if isinstance(node.op, ViewOp) and covered is not None and isinstance(covered.op, Contiguous):
            buffer, layout = covered, node
        else:
            buffer = node if isinstance(node.op, Contiguous) else written.get(id(node))  # (the value a buffer holds)
            layout = buffer
        strides = output_strides.get(name)
        if name not in taken and buffer is not None and id(buffer) not in seen and strides is not None \
                and same_layout(layout.view, strides):
            found[name] = buffer
            seen.add(id(buffer))
    return found


def forced_strategies(group: KernelGroup, strategies: StrategyMap) -> Optional[tuple[AxisStrategy, ...]]:
    """Strategies the user forced for this kernel: on an IR node it stores, by the name of
    an output it writes, or for every kernel under the key "*"."""
    found = []
    for store in group.stores:
        node_level = getattr(store.value.op, "axis_strategies", None)
        if node_level:
            found.append(tuple(node_level))
        if isinstance(store.target, OutputTarget) and store.target.name in strategies:
            found.append(tuple(strategies[store.target.name]))
    if not found and "*" in strategies:
        found.append(tuple(strategies["*"]))
    if len(set(found)) > 1:
        raise TjitError(f"conflicting axis strategies {sorted(set(found), key=str)} for one kernel of shape "
                        f"{list(group.shape)}")
    return found[0] if found else None


__all__ = ["lower", "LoweredGraph", "HasSteps", "KernelPlan", "LibraryPlan"]

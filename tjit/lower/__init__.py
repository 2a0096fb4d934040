"""Lowering: group the graph's stores into kernels, schedule their axes, emit Triton."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from ..errors import TjitError
from ..ir import AxisStrategy, Extern, Graph, GraphNode
from .codegen import KernelPlan, plan_kernel
from .fusion import BufferTarget, ExternStep, KernelGroup, OutputTarget, group_kernels
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


def lower(graph: Graph, output_strides: dict[str, tuple[int, ...]],
          strategies: Optional[StrategyMap] = None, device: str = "cuda") -> LoweredGraph:
    """The graph's kernels, generated for the device type their tensors live on ("cpu", run by
    Triton's interpreter, or "cuda"): where eager's numerics differ between the two (a float32
    scan accumulates in double on CPU, in float32 on CUDA), the kernels follow the device's."""
    call_outputs = returned_call_results(graph, output_strides)
    ordered = group_kernels(graph, frozenset(call_outputs))
    returned = frozenset(id(node) for node in call_outputs.values())
    steps = [plan_library_call(g, returned) if isinstance(g, ExternStep) else
             plan_kernel(g, output_strides, forced_strategies(g, strategies or {}), device) for g in ordered]
    steps, groups = merge_independent_kernels(ordered, steps)
    buffers = [s.target.node for g in groups for s in g.stores if isinstance(s.target, BufferTarget)]
    return LoweredGraph(steps, groups, buffers, call_outputs)


def returned_call_results(graph: Graph, output_strides: dict[str, tuple[int, ...]]) -> dict[str, GraphNode]:
    """Outputs whose value is a library call's result with the output's layout: the call's
    tensor is the output (a copy kernel would only move its bytes). The first output of
    each result only: two outputs eager returns as two tensors stay two tensors."""
    found, taken = {}, set()
    for name, node in graph.outputs.items():
        strides = output_strides.get(name)
        if isinstance(node.op, Extern) and node.op.index is not None and id(node) not in taken \
                and strides is not None and node.view.offset == 0 and all(
                    size == 1 or a == b for size, a, b in zip(node.shape, node.view.strides, strides)):
            found[name] = node
            taken.add(id(node))
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

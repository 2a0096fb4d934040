"""Lowering: group the graph's stores into kernels, schedule their axes, emit Triton."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from ..errors import TjitError
from ..ir import AxisStrategy, Graph, GraphNode
from .codegen import KernelPlan, plan_kernel
from .fusion import BufferTarget, ExternStep, KernelGroup, OutputTarget, group_kernels
from .library import LibraryPlan, plan_library_call

StrategyMap = Mapping[str, Sequence[AxisStrategy]]


@dataclass
class LoweredGraph:
    steps: list[Union[KernelPlan, LibraryPlan]]  # in the order they run
    groups: list[KernelGroup]  # one per kernel
    buffers: list[GraphNode]  # materialised intermediates, in the order kernels first write them

    @property
    def kernels(self) -> list[KernelPlan]:
        return [s for s in self.steps if isinstance(s, KernelPlan)]

    @property
    def library_calls(self) -> list[LibraryPlan]:
        return [s for s in self.steps if isinstance(s, LibraryPlan)]


def lower(graph: Graph, output_strides: dict[str, tuple[int, ...]],
          strategies: Optional[StrategyMap] = None, device: str = "cuda") -> LoweredGraph:
    """The graph's kernels, generated for the device type their tensors live on ("cpu", run by
    Triton's interpreter, or "cuda"): where eager's numerics differ between the two (a float32
    scan accumulates in double on CPU, in float32 on CUDA), the kernels follow the device's."""
    ordered = group_kernels(graph)
    steps = [plan_library_call(g) if isinstance(g, ExternStep) else
             plan_kernel(g, output_strides, forced_strategies(g, strategies or {}), device) for g in ordered]
    groups = [g for g in ordered if isinstance(g, KernelGroup)]
    buffers = [s.target.node for g in groups for s in g.stores if isinstance(s.target, BufferTarget)]
    return LoweredGraph(steps, groups, buffers)


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


__all__ = ["lower", "LoweredGraph", "KernelPlan", "LibraryPlan"]

"""Run a library call step: bind its operands from the call's memory, call the aten op,
and leave its results where the kernels after it read them."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten

from ..errors import TjitError
from ..ir import ExternCall, GraphNode, Input, ViewOp, bind_operands
from ..lower.fusion import buffer_of, same_layout
from ..frontend.library import STORAGE_ADDRESSED, reads_an_input
from ..lower.library import LibraryPlan
from ..memory.peak import Allocation, allocated_bytes, release, strided_bytes
from .counters import counters


def memory_key(base: GraphNode):
    """How a call's memory names the tensor behind an Input, Contiguous or Extern node."""
    return base.op.name if isinstance(base.op, Input) else ("buffer", id(base))


def operand_tensor(node: GraphNode, memory: dict) -> torch.Tensor:
    """The tensor a library call reads for `node`: its memory, through its view."""
    base = buffer_of(node)
    tensor = memory[memory_key(base)]
    if not isinstance(node.op, ViewOp):
        return tensor
    view = node.view
    return tensor.as_strided(view.shape, view.strides, tensor.storage_offset() + view.offset)


def call_results(call: ExternCall, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the call on these operand tensors: its tensor results (pytree order), then a
    copy of each operand it writes in place, as the op left it (the op writes the copies:
    the operands themselves stay as they were)."""
    copies = {k: operands[k].clone(memory_format=torch.contiguous_format) for k in call.writes}
    bound = [copies.get(k, t) for k, t in enumerate(operands)] if copies else operands
    if call.seed is None:
        result = call.target(*bind_operands(call.args, bound), **bind_operands(call.kwargs, bound))
    else:
        with seeded(operands[call.seed], operands):
            result = call.target(*bind_operands(call.args, bound), **bind_operands(call.kwargs, bound))
    return [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)] + [copies[k] for k in call.writes]


def results_into(plan: LibraryPlan, operands: list[torch.Tensor], memory: dict) -> list[torch.Tensor]:
    """Run the call's out= form, writing each result into memory tjit gives it: its place
    in the slab, or memory of its own in the traced layout (a result the function returns).
    A result no step reads gets an empty tensor the op resizes (tracing may not know its
    size: embedding_bag's unused offset2bag)."""
    device = operands[0].device if operands else torch.device("cpu")
    placed, read = _placed_and_read(plan)
    outs = []
    for k in range(len(plan.out_names)):
        node = read.get(k, plan.call.results[k])
        if k in placed:
            outs.append(_in_layout(memory[memory_key(node)], node))
        elif k in read:
            outs.append(torch.empty_strided(node.shape, node.view.strides, dtype=node.dtype.torch, device=device))
        else:
            outs.append(torch.empty(0, dtype=node.dtype.torch, device=device))
    plan.out_form(*bind_operands(plan.call.args, operands), **bind_operands(plan.call.kwargs, operands), **dict(zip(plan.out_names, outs)))
    for node in plan.results:
        out = outs[node.op.index]
        if tuple(out.shape) != node.shape:  # the op resized it: tracing was wrong
            raise TjitError(f"{plan.out_form} resized its result {node.op.index} to {list(out.shape)}; "
                            f"tracing said {list(node.shape)}")
        if not same_layout(node.view, out.stride()):
            # (the kernels after the call read it in the traced layout)
            raise TjitError(f"{plan.out_form} gave its result {node.op.index} strides {list(out.stride())}; "
                            f"tracing said {list(node.view.strides)}")
    return outs


def _placed_and_read(plan: LibraryPlan) -> tuple[set[int], dict[int, GraphNode]]:
    """The indices of the call's results placed in the slab, and its results later steps
    read, by index. By index, not by node: the call's own map of its results can hold nodes
    of the graph before a rewrite (ir.graph.value_graph builds a result anew where an
    operand changed), while the plan holds the lowered graph's."""
    return {node.op.index for node in plan.in_slab}, {node.op.index: node for node in plan.results}


def _in_layout(t: torch.Tensor, node: GraphNode) -> torch.Tensor:
    """A result's memory in its traced layout: the tensor itself where it has it. So a result
    placed in the memory of the total it accumulates into (tjit.memory.liveness.accumulated_in_place:
    the executor binds both keys to one tensor) is the very tensor the call reads as that
    total, as the op's in-place form (addmm_) hands it: its out= code reads and writes it as one."""
    if tuple(t.shape) == node.shape and tuple(t.stride()) == tuple(node.view.strides):
        return t
    return t.as_strided(node.shape, node.view.strides)


@contextlib.contextmanager
def seeded(seed: torch.Tensor, operands: list[torch.Tensor]):
    """Torch's generators of the operands' devices seeded with `seed` inside, as they were
    outside: a random call run again with the same seed (its derivative) draws the same numbers."""
    cuda = sorted({t.device.index or 0 for t in operands if t.is_cuda})
    with torch.random.fork_rng(devices=cuda):
        value = int(seed)
        torch.default_generator.manual_seed(value)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(value)
        yield


def run_library_call(plan: LibraryPlan, memory: dict) -> None:
    operands = [operand_tensor(op, memory) for op in plan.operands]
    if plan.call.target in STORAGE_ADDRESSED:  # an operand not in the caller's memory: a storage of its own
        operands = [t if reads_an_input(op) else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                      device=t.device).copy_(t)
                    for op, t in zip(plan.operands, operands)]
    counters.library_calls += 1
    # (the trace ran under the caller's autocast and holds its casts: the call runs the op
    # as traced, not cast again, which gave a bfloat16 result where its memory is float32)
    with torch._C._DisableAutocast():
        if plan.out_form is not None and not _records_gradients(operands):
            tensors = results_into(plan, operands, memory)
            for node in plan.results:
                memory[memory_key(node)] = tensors[node.op.index]
            return
        tensors = call_results(plan.call, operands)
    for node in plan.results:
        memory[memory_key(node)] = _as_planned(tensors[node.op.index], node, operands, plan.call.name)


def _records_gradients(operands: list[torch.Tensor]) -> bool:
    """Autograd would record the call (a backward run with create_graph): out= forms have
    no derivative, so the functional form runs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in operands)


def _as_planned(t: torch.Tensor, node: GraphNode, operands: list[torch.Tensor], op: str) -> torch.Tensor:
    """The result in the layout the kernels after the call were generated for, in memory of
    its own (a result that views an operand would die with that operand's slab buffer)."""
    if t.dtype != node.dtype.torch or tuple(t.shape) != node.shape:
        raise TjitError(f"{op} returned {t.dtype} {list(t.shape)}; tracing said {node.dtype.torch} {list(node.shape)}")
    aliases = any(t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in operands if o.numel())
    if same_layout(node.view, t.stride()) and not aliases:
        return t
    out = torch.empty_strided(node.shape, node.view.strides, dtype=t.dtype, device=t.device)
    # a layout broadcast along some axes (view_as_real of an expanded input): the one element
    # each such line holds, where the result also repeats it (copy_ refuses overlapping writes)
    repeated = [d for d, (size, want) in enumerate(zip(node.shape, node.view.strides)) if size > 1 and want == 0]
    if repeated and all(t.stride(d) == 0 for d in repeated):
        out_line, t_line = out, t
        for d in repeated:
            out_line, t_line = out_line.narrow(d, 0, 1), t_line.narrow(d, 0, 1)
        out_line.copy_(t_line)
        return out
    return out.copy_(t)


def call_allocations(plan: LibraryPlan, device_type: str, where: str) -> tuple[list[Allocation], dict[int, Allocation]]:
    """What run_library_call allocates, predicted from the plan: the allocations and releases
    made during the call, in order, and by result index the results it leaves in the call's
    memory (they live until the run ends, or longer when the function returns or saves them).
    Not known here: memory the op allocates and frees inside itself (a convolution's
    workspace, the result an out= form that torch generates from the functional op computes
    before copying it out: convolution.out), and what a derivative run by torch on real
    tensors (ExternGradient) allocates."""
    call = plan.call

    def block(key, nbytes: int, what: str, kind: str = "library result") -> Allocation:
        return Allocation((where, key), allocated_bytes(nbytes, device_type), kind, f"{call.name} {what}", where)

    during: list[Allocation] = []
    if call.target in STORAGE_ADDRESSED:  # operands copied into storages of their own (run_library_call)
        during += [block(("operand", k), strided_bytes(node.view.shape, node.view.strides, node.dtype.itemsize),
                         f"operand {k} copy", "library operand copy")
                   for k, node in enumerate(plan.operands) if not reads_an_input(node)]
    used = {node.op.index: node for node in plan.results}
    made: dict[int, Allocation] = {}
    if plan.out_form is not None:  # results_into: every result in memory tjit gives it
        placed = _placed_and_read(plan)[0]
        for k, node in sorted(call.results.items()):
            made[k] = block(("result", k), 0 if k in placed else _node_bytes(node), f"result {k}")
    elif not isinstance(call.target, torch._ops.OpOverload):  # a seed draw, a derivative run by torch
        made = {k: block(("result", k), _node_bytes(node), f"result {k}") for k, node in sorted(used.items())}
    else:  # call_results: copies of the operands the op writes, then the op's own results
        returns = call.target._schema.returns
        first_copy = max(len(returns) if all(str(r.type) == "Tensor" for r in returns) else 0,
                         max(call.results, default=-1) + 1)
        for j, k in enumerate(call.writes):
            operand = plan.operands[k]
            made[first_copy + j] = block(("result", first_copy + j), operand.view.numel * operand.dtype.itemsize,
                                         f"written copy of operand {k}")
        for k, node in sorted(call.results.items()):
            view = k < len(returns) and returns[k].alias_info is not None  # _as_planned copies a used view
            made[k] = block(("result", k), _node_bytes(node) if not view or k in used else 0, f"result {k}")
    during += made.values()
    kept = {k: made[k] for k in used if k in made}  # (a view the op returns of an operand allocates nothing)
    # operand copies, results no later step reads and written copies nobody reads die with the call
    during += release([a for a in during if a not in kept.values()], where)
    return [a for a in during if a.bytes], kept  # (a result in the slab allocates nothing)


def _node_bytes(node: GraphNode) -> int:
    """Bytes of a result in the layout tracing gave it (the op's own, or the one out= gets)."""
    return strided_bytes(node.shape, node.view.strides, node.dtype.itemsize)

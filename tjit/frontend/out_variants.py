"""Ops called with out= (`torch.add(x, y, out=o)`, aten.add.out in a trace): as eager defines
them, the op's functional form computes the result, which is then copied into each out tensor
(cast to its type). The converter knows the functional forms and in-place copies, so a trace's
out= nodes are rewritten into those two before conversion. An out= call that would resize its
out tensor is refused while tracing (GradModeWatch): the trace's record of that tensor then has
the new shape from its start."""
from __future__ import annotations

import math
import operator
from functools import lru_cache
from typing import Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from ..errors import UnsupportedOpError
from .overlap import bytes_meet, check_in_place, has_internal_overlap


def as_functional_and_copies(gm: fx.GraphModule) -> None:
    """Rewrite each out= node of the graph whose op has a functional form (in place)."""
    changed = False
    for node in list(gm.graph.nodes):
        if _rewritable(node):
            _rewrite(gm.graph, node)
            changed = True
    if changed:
        gm.recompile()


# what a factory's functional form takes that its out= form does not: the out tensor's
FACTORY_ARGUMENTS = ("dtype", "layout", "device", "pin_memory")


@lru_cache(maxsize=None)
def functional_overload(op: torch._ops.OpOverload) -> Optional[torch._ops.OpOverload]:
    """The overload of op's packet that takes op's arguments but the out tensors (and, for a
    factory, the type and device the out tensor gives) and returns one result per out tensor
    (add.Tensor for add.out, max.dim for max.dim_max, arange.default for arange.out)."""
    outs = out_names(op)
    wanted = [(a.name, str(a.type)) for a in op._schema.arguments if a.name not in outs]
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        schema = candidate._schema
        if torch.Tag.out in candidate.tags or schema.is_mutable or len(schema.returns) != len(outs):
            continue
        if [(a.name, str(a.type)) for a in schema.arguments
                if a.name not in FACTORY_ARGUMENTS or a.name in dict(wanted)] == wanted:
            return candidate
    return None


def out_names(op: torch._ops.OpOverload) -> tuple[str, ...]:
    """The names of the out tensors an out= overload writes."""
    return tuple(a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write)


def _rewritable(node: fx.Node) -> bool:
    """An out= node with a functional form, whose results (several: max.dim_max's) are used
    by index only."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
            or torch.Tag.out not in node.target.tags or functional_overload(node.target) is None:
        return False
    if any(not isinstance(node.kwargs.get(name), fx.Node) for name in out_names(node.target)):
        return False  # (a list of out tensors: unbind_copy's)
    return len(out_names(node.target)) == 1 or all(user.target is operator.getitem for user in node.users)


def _rewrite(graph: fx.Graph, node: fx.Node) -> None:
    functional = functional_overload(node.target)
    outs = out_names(node.target)
    kwargs = {k: v for k, v in node.kwargs.items() if k not in outs}
    written = [node.kwargs[name].meta["val"] for name in outs]
    factory = {"dtype": written[0].dtype, "layout": written[0].layout, "device": written[0].device}
    given = {a.name for a in node.target._schema.arguments}
    kwargs.update({a.name: factory[a.name] for a in functional._schema.arguments
                   if a.name in factory and a.name not in given})
    values = fx.node.map_arg((node.args, kwargs), lambda a: a.meta["val"])  # (the traced arguments)
    read = [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]
    check_out_overlaps(node.target, functional, written, read)
    with graph.inserting_before(node):
        result = graph.call_function(functional, node.args, kwargs)
        result.meta["val"] = _result_meta(functional, values, read + written)
        copies = []
        for k, name in enumerate(outs):
            value = result
            if len(outs) > 1:
                value = graph.call_function(operator.getitem, (result, k))
                value.meta["val"] = result.meta["val"][k]
            if _scratch(node.kwargs[name], node):  # (nothing else sees it: the result is the tensor)
                copies.append(value)
                continue
            if written[k].shape != value.meta["val"].shape:
                raise UnsupportedOpError(str(node.target), f"it resizes its out= tensor {name!r} (inside "
                                         f"{node.target.overloadpacket.__name__}): tjit writes out= tensors of "
                                         "the result's shape only", target=node.target)
            copied = graph.call_function(torch.ops.aten.copy_.default, (node.kwargs[name], value))
            copied.meta["val"] = written[k]
            copies.append(copied)
    if len(outs) == 1:
        node.replace_all_uses_with(copies[0])
    else:  # (the node's users take its results by index)
        for user in list(node.users):
            user.replace_all_uses_with(copies[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)


def _scratch(out: fx.Node, node: fx.Node) -> bool:
    """An out tensor that a composite op made empty for this call alone (linalg.det's LU and
    pivots into _linalg_det.result), resized by it: its result takes its place."""
    return out.op == "call_function" and out.target is torch.ops.aten.empty.memory_format \
        and math.prod(out.args[0]) == 0 and list(out.users) == [node]


def check_out_overlaps(op, functional, written: list[torch.Tensor], read: list[torch.Tensor]) -> None:
    """Eager's checks of an out= tensor against the op's inputs: for an elementwise op, those
    of an in-place write (the out tensor may be an input itself, not part of one); for any
    other, memory an input shares with it is refused (eager's rules vary by op, and the
    rewritten op reads every input before it writes)."""
    for out in written:
        if torch.Tag.pointwise in functional.tags:
            check_in_place(str(op), out, read)
        elif has_internal_overlap(out) or any(bytes_meet(out, t) for t in read):
            raise UnsupportedOpError(str(op), "its out= tensor shares memory with an input (or with itself)",
                                     target=op)


def _result_meta(functional: torch._ops.OpOverload, values: tuple, tensors: list[torch.Tensor]):
    """The fake result the functional form gives for the node's traced (args, kwargs), in
    the trace's fake mode, found from `tensors` (the inputs and the out tensors: a factory
    has no tensor argument)."""
    from torch._guards import detect_fake_mode
    with detect_fake_mode(tensors):
        return functional(*values[0], **values[1])

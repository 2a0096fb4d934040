"""`torch._foreach_*` ops (what optimizers' foreach implementations call) as one op per
tensor of their lists, so each update is ordinary elementwise work that fuses.

torch has no decompositions for them (Inductor lowers them itself). `_foreach_<op>(lists,
...)` is `<op>(list[i], ...)` for each i, with a list of Python scalars read at i as well;
the in-place forms write each tensor in place. Ops whose per-tensor op has another name
are listed in PER_TENSOR_NAME.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten
PREFIX = "_foreach_"
# _foreach_<name> whose per-tensor op is not aten.<name>
PER_TENSOR_NAME = {"norm": "linalg_vector_norm", "max": "amax"}
# ... and those whose overloads taking a Python scalar (or a list of them) have another one
PER_TENSOR_NAME_WITH_SCALARS = {"maximum": "clamp_min", "minimum": "clamp_max"}


def foreach_decompositions() -> dict:
    """OpOverload -> its decomposition, for every overload of every aten._foreach_* op."""
    table = {}
    names = {s.name[len("aten::"):] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::" + PREFIX)}
    for name in sorted(names):  # (dir(aten) lists only the ops loaded so far)
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            per_tensor = _per_tensor_op(name[len(PREFIX):], _takes_scalars(op))
            if per_tensor is None or not _returns_list_or_nothing(op) or _scalars_in_a_tensor(op):
                continue
            table[op] = _decomposition(op, per_tensor)
    return table


def _per_tensor_op(name: str, scalars: bool):
    in_place, base = name.endswith("_"), name.rstrip("_")
    base = (scalars and PER_TENSOR_NAME_WITH_SCALARS.get(base)) or PER_TENSOR_NAME.get(base, base)
    return getattr(aten, base + ("_" if in_place else ""), None)


def _takes_scalars(op) -> bool:
    return any(str(a.type) in ("number", "List[number]") for a in op._schema.arguments)


def _returns_list_or_nothing(op) -> bool:
    returns = op._schema.returns
    return not returns or (len(returns) == 1 and str(returns[0].type) == "List[Tensor]")


def _scalars_in_a_tensor(op) -> bool:
    """The overloads that take one scalar per tensor as a 1-d tensor (addcmul's `scalars`):
    those run as library calls."""
    return any(a.name == "scalars" and not isinstance(a.type, torch.ListType) for a in op._schema.arguments)


def _decomposition(op, per_tensor) -> Callable:
    list_args = [isinstance(a.type, torch.ListType) for a in op._schema.arguments]
    names = [a.name for a in op._schema.arguments]
    returns = bool(op._schema.returns)
    schema = getattr(per_tensor, "default", None) or getattr(per_tensor, per_tensor.overloads()[0])
    schema = schema._schema
    positional = sum(not a.kwarg_only for a in schema.arguments)
    keyword_only = [a.name for a in schema.arguments if a.kwarg_only]

    def run(*args, **kwargs):
        lengths = {len(a) for a, is_list in zip(args, list_args) if is_list}
        lengths |= {len(v) for k, v in kwargs.items() if list_args[names.index(k)]}
        if len(lengths) != 1:
            raise RuntimeError(f"{op}: tensor lists of different lengths {sorted(lengths)}")
        results = []
        for i in range(lengths.pop()):
            a, kw = _at(args, list_args, i), _at_kwargs(kwargs, names, list_args, i)
            # a scalar the foreach op takes positionally may be keyword-only per tensor
            # (_foreach_addcmul(self, t1, t2, scalars) is addcmul(self, t1, t2, value=s))
            kw.update(zip(keyword_only, a[positional:]))
            results.append(per_tensor(*a[:positional], **kw))
        return results if returns else None

    run.__name__ = f"decompose_{op.__name__}"
    return run


def _at(args: tuple, list_args: list[bool], i: int) -> list[Any]:
    return [a[i] if is_list else a for a, is_list in zip(args, list_args)]


def _at_kwargs(kwargs: dict, names: list[str], list_args: list[bool], i: int) -> dict:
    return {k: v[i] if list_args[names.index(k)] else v for k, v in kwargs.items()}

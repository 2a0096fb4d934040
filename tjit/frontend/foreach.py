"""`torch._foreach_*` ops (what optimizers' foreach implementations call) as one op per
tensor of their lists, so each update is ordinary elementwise work that fuses.

torch has no decompositions for them (Inductor lowers them itself). `_foreach_<op>(lists,
...)` is `<op>(list[i], ...)` for each i, with a list of Python scalars read at i as well;
the in-place forms write each tensor in place. Ops whose per-tensor op has another name
are listed in PER_TENSOR_NAME. The `_out` overloads and those taking their scalars as one
tensor (capturable optimizers' `scalars`) are left to run as they are.
"""
from __future__ import annotations

from typing import Callable

import torch

aten = torch.ops.aten
PREFIX = "_foreach_"
# _foreach_<name> whose per-tensor op is not aten.<name>
PER_TENSOR_NAME = {"norm": "linalg_vector_norm", "max": "amax"}
# ... and those whose overloads taking a Python scalar (or a list of them) have another one
PER_TENSOR_NAME_WITH_SCALARS = {"maximum": "clamp_min", "minimum": "clamp_max"}


# in-place overloads whose CPU kernel converts the Python scalar to the tensors' type before it
# multiplies (x.mul_(0.9) does not: a bfloat16 x times 0.9 differs by an ulp from x times
# bfloat16(0.9)); measured against eager, the other ops read their scalars as x.op_(s) does,
# and so do these on CUDA (whose foreach kernels compute in float32, measured on an H100)
SCALAR_IN_THE_TENSORS_TYPE = {aten._foreach_mul_.Scalar, aten._foreach_mul_.ScalarList}


def foreach_decompositions() -> dict:
    """OpOverload -> its decomposition, for every overload of every aten._foreach_* op."""
    table = {}
    names = {s.name[len("aten::"):] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::" + PREFIX)}
    for name in sorted(names):  # (dir(aten) lists only the ops loaded so far)
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            per_tensor = _per_tensor_op(name[len(PREFIX):], _takes_scalars(op))
            if per_tensor is None or overload.endswith("out") or not _returns_list_or_nothing(op) \
                    or _scalars_in_a_tensor(op):
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
    """`per_tensor` called for each index: the first argument positionally, the others by the
    per-tensor op's names: the foreach op's argument of that name, else its unmatched
    arguments in order (`scalars` is addcmul's `value`, `tensors1` lerp's `end`)."""
    arguments = op._schema.arguments
    per_names = _argument_names(per_tensor)[1:]
    returns = bool(op._schema.returns)

    def run(*args, **kwargs):
        values = {a.name: v for a, v in zip(arguments, args)} | kwargs
        lists = {a.name for a in arguments if a.name in values and isinstance(a.type, torch.ListType)}
        lengths = {len(values[name]) for name in lists}
        if len(lengths) != 1:
            raise RuntimeError(f"{op}: tensor lists of different lengths {sorted(lengths)}")
        results = []
        for i in range(lengths.pop()):
            at = {name: v[i] if name in lists else v for name, v in values.items()}
            head = at.pop(arguments[0].name)
            named = {n: at.pop(n) for n in list(at) if n in per_names}
            named.update(zip([n for n in per_names if n not in named], at.values()))
            if op in SCALAR_IN_THE_TENSORS_TYPE and head.is_floating_point() and head.device.type == "cpu":
                named = {n: torch.scalar_tensor(v, dtype=head.dtype) for n, v in named.items()}
            results.append(per_tensor(head, **named))
        return results if returns else None

    run.__name__ = f"decompose_{op.__name__}"
    return run


def _argument_names(packet) -> list[str]:
    """The argument names of a packet's first tensor overload (aten.add.default is the one
    for two Python numbers)."""
    for name in packet.overloads():
        schema = getattr(packet, name)._schema
        if "out" not in name and any(isinstance(a.type, torch.TensorType) for a in schema.arguments):
            return [a.name for a in schema.arguments]
    raise RuntimeError(f"{packet} has no overload that takes a tensor")

"""Horizontal fusion: independent pointwise kernels of one level run as one launch.

Kernels that fusion puts at the same level depend on nothing the others write (a
dependency between stores of different domains is always strict: a later level). An
optimizer step over parameters of different shapes is such a set: one kernel per shape,
each updating its parameters and their state. Merged, their programs are concatenated:
program `pid` runs the member whose range holds it, as `pid - start` of that member, so
the launch does exactly the work of the separate kernels, in one grid.

A kernel of one program that follows such a run (an optimizer's step counters, which the
update reads and then increments) joins it too, although it depends on the run: the last
program to finish (an atomic count, as a grid reduction's) runs it after every program has
done its loads and stores, so it reads what they wrote and overwrites what they read
without a second launch.

Only plain pointwise kernels merge (no reduction, no check reported through the status
word, no scratch, no zero-division flag): their source is a body over `pid` and their own
arguments, which are renamed apart (a prefix per member).
"""
from __future__ import annotations

import builtins
import hashlib
import keyword
import math
import re
from typing import Union

from .codegen import COUNTER, ZERO_DIV_FLAG, KernelPlan
from .fusion import ExternStep, KernelGroup
from .library import LibraryPlan
from .schedule import AUTO_WARPS, IterationSpace

Step = Union[KernelPlan, LibraryPlan]
_KEEP = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"tl", "tm", "triton"}
# a string literal (kept as it is: float("inf")), or a name that is not an attribute or a
# keyword argument (renamed)
_STRING_OR_NAME = re.compile(r"(\"[^\"]*\"|'[^']*')|(?<![\w.])([A-Za-z_]\w*)\b(?!=[^=])")
_PROGRAM_ID = "tl.program_id(0)"


def merge_independent_kernels(ordered: list[Union[KernelGroup, ExternStep]], steps: list[Step]
                              ) -> tuple[list[Step], list[KernelGroup]]:
    """`steps` (planned from `ordered`, one each) with each run of mergeable kernels of one
    level, and the one-program kernels right after it (run by its last program), made one
    kernel; the groups, one per kernel, the merged ones joined."""
    out_steps, out_groups, run, last = [], [], [], []

    def flush():
        if len(run) + len(last) > 1:
            out_steps.append(merge([plan for _, plan in run], [plan for _, plan in last]))
            out_groups.append(KernelGroup(run[0][0].domain, [s for g, _ in run + last for s in g.stores],
                                          run[0][0].level))
        else:
            out_steps.extend(plan for _, plan in run)
            out_groups.extend(group for group, _ in run)
        run.clear()
        last.clear()

    for item, step in zip(ordered, steps):
        if isinstance(step, KernelPlan) and not step.writes_anything:  # never launched: apart, in any place
            out_steps.append(step)
            out_groups.append(item)
            continue
        if not isinstance(step, KernelPlan):
            flush()
            out_steps.append(step)
            continue
        joins = mergeable(step)
        if joins and run and (last or item.level != run[0][0].level):
            if step.grid == (1,) and sum(plan.grid[0] for _, plan in run) > 0:
                last.append((item, step))  # the run's last program runs it
                continue
            flush()  # (and it starts the next run)
        elif run and not joins:
            flush()
        run.append((item, step))
        if not joins:
            flush()
    flush()
    return out_steps, out_groups


def mergeable(plan: KernelPlan) -> bool:
    return (not plan.reduced_axes and not plan.checks and not plan.scratch and ZERO_DIV_FLAG not in plan.constexprs
            and plan.dot_tiles is None
            and len(plan.grid) == 1 and _PROGRAM_ID in plan.source and _program_count(plan) == plan.grid[0])


def _program_count(plan: KernelPlan) -> int:
    """`programs(plan)` evaluated for the plan's own arguments."""
    args = dict(zip(plan.param_names[len(plan.buffers):], plan.scalar_args))
    try:
        return math.prod(-(-math.prod(args[f"size{a}"] for a in d.axes) // plan.constexprs[f"BLOCK_{j}"])
                         for j, d in enumerate(plan.space.loop_dims) if d.kind == "group")
    except KeyError:  # (a dimension without a size argument of that name)
        return -1


def merge(plans: list[KernelPlan], last: list[KernelPlan] = ()) -> KernelPlan:
    """One kernel running each plan's programs in turn over one grid, then, in the last
    program to finish, each of `last` (one program each) in order."""
    pointers, scalars, values, body, constexprs = [], [], [], ["pid = tl.program_id(0)"], {}

    def member(k: int, plan: KernelPlan, program: str) -> list[str]:
        prefix = f"m{k}_"
        n = len(plan.buffers)  # a plan's parameters are its pointers, then its scalars
        pointers.extend(prefix + p for p in plan.param_names[:n])
        scalars.extend(prefix + p for p in plan.param_names[n:])
        values.extend(plan.scalar_args)
        constexprs.update({prefix + name: value for name, value in plan.constexprs.items()})
        return _member_body(plan, prefix, program)

    start = "0"
    for k, plan in enumerate(plans):
        # its range of programs, computed from its sizes as its grid is (no new argument,
        # so a new size changes neither the source nor Triton's specialisation)
        end = f"m{k}_end"
        body.append(f"{end} = {start} + {programs(plan, f'm{k}_')}")
        body.append(f"if (pid >= {start}) & (pid < {end}):")
        body += ["    " + line for line in member(k, plan, f"(pid - {start})")]
        start = end
    if last:
        body += ["tl.debug_barrier()",  # every thread's loads and stores are done before the count moves
                 f"done = tl.atomic_add({COUNTER.param}, 1, sem='acq_rel')",
                 "if done == tl.num_programs(0) - 1:"]
        for k, plan in enumerate(last, start=len(plans)):
            body += ["    " + line for line in member(k, plan, "0")]
            body.append("    tl.debug_barrier()")  # (the next one may read what this one stored)
        body.append(f"    tl.atomic_xchg({COUNTER.param}, 0)")  # for the next call
        pointers.append(COUNTER.param)
    params = pointers + scalars + [f"{name}: tl.constexpr" for name in constexprs]
    source = "\n".join(["@triton.jit", f"def KERNEL({', '.join(params)}):"] + ["    " + ln for ln in body])
    name = f"tjit_horizontal_{hashlib.sha1(source.encode()).hexdigest()[:12]}"
    members = list(plans) + list(last)
    dims = tuple(d for plan in members for d in plan.space.loop_dims)
    return KernelPlan(name, source.replace("def KERNEL(", f"def {name}(", 1),
                      [b for plan in members for b in plan.buffers] + ([COUNTER] if last else []), values,
                      constexprs, (sum(plan.grid[0] for plan in plans),), (sum(plan.numel for plan in members),),
                      IterationSpace((), (), dims),
                      [a for plan in members for a in plan.accesses], pointers + scalars,
                      min(AUTO_WARPS, max(plan.num_warps for plan in members)),
                      last_program_accesses=sum(len(plan.accesses) for plan in last),
                      notes=tuple(note for plan in members for note in plan.notes))


def programs(plan: KernelPlan, prefix: str = "") -> str:
    """The plan's number of programs as a Triton expression of its (prefixed) size
    arguments and blocks: one per block of each grid dimension (codegen's grid)."""
    return " * ".join([f"tl.cdiv({' * '.join(f'{prefix}size{a}' for a in d.axes)}, {prefix}BLOCK_{j})"
                       for j, d in enumerate(plan.space.loop_dims) if d.kind == "group"] or ["1"])


def _member_body(plan: KernelPlan, prefix: str, program: str) -> list[str]:
    """The plan's body with its names prefixed, `program` as its program id."""
    lines = plan.source.splitlines()[2:]  # after "@triton.jit" and the def line
    out = []
    for line in lines:
        code, hash_, comment = line.partition("#")
        code = _STRING_OR_NAME.sub(lambda m: _renamed(m, prefix), code)
        code = code.replace(_PROGRAM_ID, program)
        out.append((code + hash_ + comment)[4:] if line.startswith("    ") else code + hash_ + comment)
    return out


def _renamed(match: re.Match, prefix: str) -> str:
    string, name = match.groups()
    if string is not None:
        return string
    return name if name in _KEEP else prefix + name

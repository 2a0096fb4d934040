"""tjit.memory: static memory planning, every intermediate in one slab.

plan_offsets packs buffers given as (size_bytes, first_step, end_step) into one slab;
first_fit_by_start (the seed's) and greedy_by_size (TFLite's) are the baselines it is measured
against, lower_bound the floor no plan can beat, check_plan the checker every plan must pass.
MemoryPlan (from make_plan) keeps a plan with its text form (format_plan) and picture (plot,
which needs matplotlib). A compiled function's intermediates live in one slab per device and
thread (liveness.py plans it, slab.py holds it); stats() and release() manage the pool.
peak.py predicts a call's or training step's peak memory from the plan (what explain shows),
measure.py measures it with the allocator (measure_peak).
"""
from .planner import (
    MemoryPlan,
    check_plan,
    first_fit_by_start,
    greedy_by_size,
    lower_bound,
    make_plan,
    plan_offsets,
)
from .measure import measure_peak
from .peak import PeakMemory
from .plot import format_plan, plot
from .slab import release, stats

__all__ = [
    "MemoryPlan",
    "check_plan",
    "first_fit_by_start",
    "format_plan",
    "greedy_by_size",
    "lower_bound",
    "make_plan",
    "measure_peak",
    "PeakMemory",
    "plan_offsets",
    "plot",
    "release",
    "stats",
]

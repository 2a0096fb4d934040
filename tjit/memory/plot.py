"""A memory plan for people: the text form and a picture (time x offset, lower bound marked).

format_plan needs nothing; plot needs matplotlib, an optional extra (`pip install matplotlib`),
imported only when called; it draws on a bare Figure (the Agg renderer): no display needed, and
pyplot's global state is left alone.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from .planner import Interval, MemoryPlan, lower_bound


def format_plan(intervals: Sequence[Interval], offsets: Sequence[int], slab_size: int,
                names: Sequence[str] | None = None) -> str:
    """The slab against the lower bound, then one line per buffer (in the given order): name,
    size, lifetime [first_step, end_step) and byte range in the slab."""
    bound = lower_bound(intervals)
    versus = f" = {slab_size / bound:.4f} x" if bound else ","
    header = (f"memory plan: {len(intervals)} buffers, slab {_bytes(slab_size)}{versus} "
              f"lower bound {_bytes(bound)} (largest total live at one step)")
    lines = [header]
    width = max([len(str(n)) for n in names or ()] + [6])
    lines.append(f"  {'#':>5}  {'buffer':<{width}}  {'size':>10}  {'steps':>15}  {'offset':>12}  {'end':>12}")
    for i, ((size, first, end), offset) in enumerate(zip(intervals, offsets)):
        name = names[i] if names is not None else ""
        where = f"{offset:>12}  {offset + size:>12}" if size and end > first else f"{'-':>12}  {'(no space)':>12}"
        lines.append(f"  {i:>5}  {name:<{width}}  {_bytes(size):>10}  {f'[{first}, {end})':>15}  {where}")
    return "\n".join(lines)


def plot(plan: MemoryPlan, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Draw `plan` into the image file `path` (format from its suffix, e.g. plan.png): each
    buffer a rectangle over its steps (x) and bytes (y), named when there is room; a dashed
    line at the lower bound and a solid one at the slab size.

    Raw offsets draw too: plot(MemoryPlan(intervals, offsets, slab_size, names), path)."""
    try:  # a bare Figure renders with Agg and leaves pyplot alone
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("tjit.memory.plot needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(10, 6))
    ax = fig.subplots()
    _draw_buffers(ax, plan)
    ax.axhline(plan.lower_bound, color="black", linestyle="--", linewidth=1,
               label=f"lower bound {_bytes(plan.lower_bound)}")
    ax.axhline(plan.slab_size, color="red", linewidth=1, label=f"slab {_bytes(plan.slab_size)}")
    ax.set_ylim(0, max(plan.slab_size, 1) * 1.05)
    ax.set_xlabel("step")
    ax.set_ylabel("offset (bytes)")
    ax.set_title(title or f"{sum(1 for _ in _occupying(plan))} buffers, slab = {plan.ratio:.4f} x lower bound")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _draw_buffers(ax, plan: MemoryPlan) -> None:
    """One rectangle per buffer that occupies space, in one collection (10^5 still draw)."""
    from matplotlib import colormaps
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    drawn = list(_occupying(plan))
    colors = colormaps["tab20"].colors
    ax.add_collection(PatchCollection(
        [Rectangle((first, offset), end - first, size) for _, (size, first, end), offset in drawn],
        facecolors=[colors[i % len(colors)] for i, _, _ in drawn], edgecolors="black",
        linewidths=0.3 if len(drawn) <= 1000 else 0.0))
    if plan.names is not None and len(drawn) <= 60:
        for i, (size, first, end), offset in drawn:
            ax.text(first + (end - first) / 2, offset + size / 2, plan.names[i], ha="center", va="center", fontsize=6)
    first_step = min((first for _, (_, first, _), _ in drawn), default=0)
    ax.set_xlim(first_step, max((end for _, (_, _, end), _ in drawn), default=first_step + 1))


def _occupying(plan: MemoryPlan):
    """(index, interval, offset) of the buffers that take space."""
    return ((i, iv, o) for i, (iv, o) in enumerate(zip(plan.intervals, plan.offsets)) if iv[0] and iv[2] > iv[1])


def _bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

"""Offset planning: place buffers that are live at different steps in one slab.

Input: intervals, a sequence of (size_bytes, first_step, end_step) triples, end exclusive: a
buffer is live at the steps first_step <= t < end_step. Output: (offsets, slab_size), byte
offsets aligned to `alignment` such that two buffers live at a common step never share a
byte, and slab_size, the bytes the slab needs. Buffers of size 0 or with an empty lifetime
occupy nothing and get offset 0.

Seen as geometry each buffer is a rectangle, time by address, whose time position is fixed;
the planner chooses its height. No slab can be smaller than the largest total of bytes live
at one step (lower_bound); the planners here are judged by slab / lower_bound.

    first_fit_by_start   the seed's baseline: sweep by start time, lowest free offset
    greedy_by_size       TFLite's GreedyBySize: largest first, into the smallest gap that fits
    plan_offsets         tjit's planner: a portfolio of the two above, ordered fits and a
                         skyline fill, then a randomised search while the time budget lasts

Every engine works in units of `alignment` bytes on compressed time (the distinct start and
end steps renumbered 0..T), so the slab in units times the alignment is the slab in bytes.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Interval = tuple[int, int, int]  # (size_bytes, first_step, end_step), end exclusive

DEFAULT_ALIGNMENT = 64
# plan_offsets' default time budget: 0.2 s, plus 25 us per buffer up to 0.5 s more, so that a
# skyline fill still fits for graphs of ~20,000 buffers (on 10^5 none fits in a second).
DEFAULT_TIME_BUDGET_S = 0.2
EXTRA_BUDGET_PER_BUFFER_S, MAX_EXTRA_BUDGET_S = 25e-6, 0.5
# Ordered fits (greedy_by_size and its variants) look at every pair of buffers live at a
# common step, at about 1 us a pair. Above this many pairs (~5,000 buffers with 100 live at
# once) plan_offsets leaves them out: the 100,000-buffer synthetic trace has ~10^7 pairs, and
# greedy-by-size alone takes ~15 s there.
MAX_PAIRS_FOR_ORDERED_FITS = 500_000
# A skyline fill takes about this many times as long as the first-fit sweep on the same buffers
# (measured: 4-6x); plan_offsets times the sweep and skips a skyline that cannot end in time.
SKYLINE_VS_SWEEP = 4.0


# ---------------------------------------------------------------------------------------------
# Input: validation and the compressed form every engine works on
# ---------------------------------------------------------------------------------------------

@dataclass
class _Problem:
    """The buffers that occupy space, renumbered 0..m-1, on compressed time.

    ids[k] is buffer k's index in the caller's list; size is in alignment units; start/end
    are ranks among the distinct start and end steps, so 0 <= start < end <= T.
    """
    n: int  # buffers in the caller's list, including the ones that occupy nothing
    alignment: int
    ids: list[int]
    nbytes: list[int]
    size: list[int]
    start: list[int]
    end: list[int]
    T: int
    steps: list[int]  # lifetime in the caller's steps, for priorities

    @property
    def m(self) -> int:
        return len(self.ids)

    def to_bytes(self, offsets: Sequence[int]) -> tuple[list[int], int]:
        """Unit offsets of the m buffers -> byte offsets of all n, and the slab in bytes."""
        out = [0] * self.n
        top = 0
        for k, o in enumerate(offsets):
            out[self.ids[k]] = o * self.alignment
            top = max(top, o + self.size[k])
        return out, top * self.alignment


def _validate(intervals: Sequence[Interval]) -> np.ndarray:
    """Intervals as an (n, 3) int64 array; a ValueError names the first bad one."""
    try:
        arr = np.asarray(intervals, dtype=np.int64).reshape(-1, 3)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"intervals must be (size_bytes, first_step, end_step) integer triples: {e}") from None
    if len(arr) != len(intervals):
        raise ValueError(f"intervals must be (size_bytes, first_step, end_step) triples, got {len(intervals)} "
                         f"entries for {arr.size} numbers")
    bad = np.nonzero((arr[:, 0] < 0) | (arr[:, 2] < arr[:, 1]))[0]
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"buffer {i}: {tuple(int(x) for x in arr[i])} needs size_bytes >= 0 and "
                         "end_step >= first_step")
    return arr


def _check_alignment(alignment: int) -> int:
    if not isinstance(alignment, (int, np.integer)) or alignment < 1:
        raise ValueError(f"alignment must be a positive integer, got {alignment!r}")
    return int(alignment)


def _problem(intervals: Sequence[Interval], alignment: int) -> _Problem:
    arr = _validate(intervals)
    alignment = _check_alignment(alignment)
    live = (arr[:, 0] > 0) & (arr[:, 2] > arr[:, 1])
    ids = np.nonzero(live)[0]
    size, first, end = arr[ids, 0], arr[ids, 1], arr[ids, 2]
    steps = np.unique(np.concatenate([first, end]))
    return _Problem(n=len(arr), alignment=alignment, ids=ids.tolist(), nbytes=size.tolist(),
                    size=(-(-size // alignment)).tolist(),
                    start=np.searchsorted(steps, first).tolist(),
                    end=np.searchsorted(steps, end).tolist(), T=max(len(steps) - 1, 0),
                    steps=(end - first).tolist())


# ---------------------------------------------------------------------------------------------
# The lower bound and the checker
# ---------------------------------------------------------------------------------------------

def lower_bound(intervals: Sequence[Interval]) -> int:
    """The largest total of bytes live at one step: no valid slab is smaller."""
    arr = _validate(intervals)
    if not len(arr):
        return 0
    steps = np.concatenate([arr[:, 1], arr[:, 2]])
    delta = np.concatenate([arr[:, 0], -arr[:, 0]])
    # At one step, ends (negative deltas) come before starts: [a, t) and [t, b) never meet.
    order = np.lexsort((delta, steps))
    return int(max(0, np.cumsum(delta[order]).max()))


def check_plan(intervals: Sequence[Interval], offsets: Sequence[int], slab_size: int,
               alignment: int = DEFAULT_ALIGNMENT, names: Sequence[str] | None = None) -> None:
    """Raise ValueError unless the plan is valid: every offset aligned, every buffer inside the
    slab, and no two buffers live at a common step sharing a byte. The message names the buffer
    (or the two buffers) at fault. Sweeps time once: O(n log n)."""
    arr = _validate(intervals)
    alignment = _check_alignment(alignment)
    offsets = [int(o) for o in offsets]

    def name(i: int) -> str:
        size, first, end = (int(x) for x in arr[i])
        label = f"buffer {i}" + (f" ({names[i]})" if names is not None else "")
        return f"{label} [size {size}, steps {first}..{end}) at offset {offsets[i]}"

    if len(offsets) != len(arr):
        raise ValueError(f"{len(offsets)} offsets for {len(arr)} buffers")
    occupying = [i for i in range(len(arr)) if arr[i, 0] > 0 and arr[i, 2] > arr[i, 1]]
    for i, o in enumerate(offsets):
        if o < 0 or o % alignment:
            raise ValueError(f"{name(i)}: offset is not a non-negative multiple of {alignment}")
    for i in occupying:
        if offsets[i] + arr[i, 0] > slab_size:
            raise ValueError(f"{name(i)}: ends at {offsets[i] + int(arr[i, 0])}, past the slab of {slab_size} bytes")
    # Events at one step: ends before starts (end is exclusive).
    events = sorted([(int(arr[i, 2]), 0, i) for i in occupying] + [(int(arr[i, 1]), 1, i) for i in occupying])
    live: list[tuple[int, int]] = []  # (offset, buffer) of the live buffers, sorted
    for _, is_start, i in events:
        key = (offsets[i], i)
        if not is_start:
            del live[bisect.bisect_left(live, key)]
            continue
        # Live buffers never overlap, so only the neighbours in address order can collide.
        k = bisect.bisect_left(live, key)
        if k > 0 and live[k - 1][0] + arr[live[k - 1][1], 0] > offsets[i]:
            raise ValueError(f"{name(live[k - 1][1])} and {name(i)} overlap")
        if k < len(live) and offsets[i] + arr[i, 0] > live[k][0]:
            raise ValueError(f"{name(i)} and {name(live[k][1])} overlap")
        live.insert(k, key)


# ---------------------------------------------------------------------------------------------
# Engines. Each takes a _Problem and returns (unit offsets of its m buffers, slab in units), or
# None once it is beaten: its slab exceeds the bound's limit (a better plan is known) or the
# clock passes the bound's deadline.
# ---------------------------------------------------------------------------------------------

_Result = tuple[list[int], int] | None
_INF = float("inf")
_CLOCK_EVERY = 256  # engines look at the clock once per this many steps


@dataclass(frozen=True)
class _Bound:
    """When an engine gives up: past `limit` slab units, or past `deadline` (perf_counter)."""
    limit: float = _INF
    deadline: float = _INF

    def late(self, step: int) -> bool:
        return step % _CLOCK_EVERY == 0 and time.perf_counter() > self.deadline


_UNBOUNDED = _Bound()


def _sweep_first_fit(p: _Problem) -> tuple[list[int], int]:
    """The seed's allocator: in order of start step, free the buffers that died, then take the
    lowest free offset where the new buffer fits. Free space is a sorted list of gaps, the last
    one open-ended, so an allocation looks at gaps rather than at every live buffer. Unbounded:
    it is the fallback every other engine must beat."""
    size, end = p.size, p.end
    offsets = [0] * p.m
    gap_lo, gap_hi = [0], [_INF]  # free gaps [lo, hi), sorted, disjoint, never adjacent
    dying: list[tuple[int, int]] = []  # heap of (end step, buffer)
    top = 0
    for i in sorted(range(p.m), key=lambda i: (p.start[i], i)):
        while dying and dying[0][0] <= p.start[i]:
            j = heapq.heappop(dying)[1]
            _free(gap_lo, gap_hi, offsets[j], offsets[j] + size[j])
        k = 0
        while gap_hi[k] - gap_lo[k] < size[i]:
            k += 1
        o = offsets[i] = gap_lo[k]
        if gap_hi[k] - o == size[i]:
            del gap_lo[k], gap_hi[k]
        else:
            gap_lo[k] = o + size[i]
        top = max(top, o + size[i])
        heapq.heappush(dying, (end[i], i))
    return offsets, top


def _free(gap_lo: list, gap_hi: list, lo: int, hi: int) -> None:
    """Return [lo, hi) to the free list, merging it with the gaps it touches."""
    k = bisect.bisect_left(gap_lo, lo)  # the gap above the freed block
    joins_below = k > 0 and gap_hi[k - 1] == lo
    joins_above = gap_lo[k] == hi
    if joins_below and joins_above:
        gap_hi[k - 1] = gap_hi[k]
        del gap_lo[k], gap_hi[k]
    elif joins_below:
        gap_hi[k - 1] = hi
    elif joins_above:
        gap_lo[k] = lo
    else:
        gap_lo.insert(k, lo)
        gap_hi.insert(k, hi)


def _overlap_pairs(p: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """Every unordered pair of buffers live at a common step, as two index arrays.

    With buffers sorted by start, the partners of the buffer at sorted position q that start
    no earlier are the contiguous positions q+1 .. (first start >= its end) - 1."""
    start, end = np.asarray(p.start), np.asarray(p.end)
    by_start = np.argsort(start, kind="stable")
    sorted_start = start[by_start]
    stop = np.searchsorted(sorted_start, end[by_start], side="left")
    count = np.maximum(stop - np.arange(p.m) - 1, 0)
    first = np.repeat(np.arange(p.m), count)
    # position of each partner: q + 1 + (its rank among q's partners)
    rank_in_row = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    second = first + 1 + rank_in_row
    return by_start[first], by_start[second]


def _pair_count(p: _Problem) -> int:
    """How many pairs _overlap_pairs would return, without building them: the buffer at sorted
    position q has stop[q] - q - 1 partners, and the sum of stop[q] needs no sorted ends."""
    start = np.sort(np.asarray(p.start))
    stop = np.searchsorted(start, np.asarray(p.end), side="left")
    return int(stop.sum()) - p.m * (p.m + 1) // 2


def _neighbours(p: _Problem) -> list[list[int]]:
    """For each buffer, the buffers live at a common step with it."""
    a, b = _overlap_pairs(p)
    rows, cols = np.concatenate([a, b]), np.concatenate([b, a])
    by_row = np.argsort(rows, kind="stable")
    bounds = np.searchsorted(rows[by_row], np.arange(p.m + 1)).tolist()
    cols = cols[by_row].tolist()
    return [cols[bounds[i]:bounds[i + 1]] for i in range(p.m)]


def _ordered_fit(p: _Problem, order: Sequence[int], neighbours: list[list[int]], best_fit: bool,
                 bound: _Bound = _UNBOUNDED) -> _Result:
    """Place buffers one by one in `order`, each among the already placed buffers it meets in
    time: into the smallest gap that holds it (best_fit, as TFLite's GreedyBySize) or the
    lowest one (first fit); above all of them when no gap does."""
    size = p.size
    offsets, tops = [-1] * p.m, [0] * p.m  # -1: not placed yet
    slab = 0
    for step, i in enumerate(order):
        occupied = sorted([(offsets[j], tops[j]) for j in neighbours[i] if offsets[j] >= 0])
        o = _best_gap(occupied, size[i]) if best_fit else _lowest_gap(occupied, size[i])
        offsets[i], tops[i] = o, o + size[i]
        slab = max(slab, tops[i])
        if slab > bound.limit or bound.late(step):
            return None
    return offsets, slab


def _best_gap(occupied: list[tuple[int, int]], need: int) -> int:
    """TFLite's rule: the smallest gap between occupied ranges (sorted) that holds `need`, the
    lowest of equals; else just above the highest range."""
    prev, best, best_gap = 0, -1, _INF
    for lo, hi in occupied:
        if need <= lo - prev < best_gap:
            best, best_gap = prev, lo - prev
        prev = max(prev, hi)
    return prev if best < 0 else best


def _lowest_gap(occupied: list[tuple[int, int]], need: int) -> int:
    prev = 0
    for lo, hi in occupied:
        if lo - prev >= need:
            return prev
        prev = max(prev, hi)
    return prev


def _skyline(p: _Problem, priority: Sequence[int], bound: _Bound = _UNBOUNDED) -> _Result:
    """Fill the slab from the bottom up, keeping only the skyline: the height of the highest
    placed buffer at each step, as maximal segments of equal height.

    Take a segment lower than both its neighbours and put on it the buffer that lies within
    its steps and touches most of its ends (both: an exact fit), then has the highest
    priority. When none fits, raise the segment to its lower neighbour: that space stays
    empty. Touching the ends keeps the skyline coarse, which is what lets later buffers fit.
    (The best-fit heuristic of Burke et al. for strip packing, with every rectangle's x fixed;
    Sekiyama et al. use it for DNN memory.) The classic takes the lowest segment first; any
    local minimum gives the same plan, since work on one never changes another's choice, so
    a stack replaces the heap."""
    T, size, start, end = p.T, p.size, p.start, p.end
    candidates = _Candidates(p, priority)
    offsets = [0] * p.m
    # A segment [a, seg_end[a]) at seg_height[a] starts at each step a with is_start[a];
    # seg_prev[a] starts the segment before it (-1: none).
    seg_end, seg_height, seg_prev, is_start = [T] * (T + 1), [0] * (T + 1), [-1] * (T + 1), bytearray(T + 1)
    is_start[0] = 1
    sky = _Skyline(seg_end, seg_height, seg_prev, is_start, T)
    stack = [0]  # segments that may be local minima
    left, slab = p.m, 0
    while left:
        a = stack.pop()
        if not sky.is_local_minimum(a):
            continue
        b, h = seg_end[a], seg_height[a]
        i = candidates.pick(a, b)
        if i < 0:  # nothing fits: the segment's space is lost, up to its lower neighbour
            prev = seg_prev[a]
            seg_height[a] = min(seg_height[prev] if prev >= 0 else _INF, seg_height[b] if b < T else _INF)
            stack.append(sky.merge(a))
            continue
        left -= 1
        offsets[i] = h
        slab = max(slab, h + size[i])
        if slab > bound.limit or bound.late(left):
            return None
        stack.extend(sky.raise_part(a, start[i], end[i], h + size[i]))
    return offsets, slab


@dataclass
class _Skyline:
    """The skyline's segments as arrays indexed by first step (see _skyline)."""
    seg_end: list
    seg_height: list
    seg_prev: list
    is_start: bytearray
    T: int

    def is_local_minimum(self, a: int) -> bool:
        if not self.is_start[a]:
            return False
        h, prev, b = self.seg_height[a], self.seg_prev[a], self.seg_end[a]
        return (prev < 0 or self.seg_height[prev] > h) and (b >= self.T or self.seg_height[b] > h)

    def raise_part(self, a: int, s: int, e: int, new_height: int) -> list[int]:
        """Raise [s, e), inside segment [a, b), to new_height; what is left of [a, b) on
        either side stays. Returns the segments that may now be local minima."""
        seg_end, seg_height, seg_prev = self.seg_end, self.seg_height, self.seg_prev
        b, h = seg_end[a], seg_height[a]
        touched = []
        if s > a:  # [a, s) stays
            seg_end[a], seg_prev[s] = s, a
            self.is_start[s] = 1
            touched.append(a)
        elif seg_prev[a] >= 0:
            touched.append(seg_prev[a])  # its right neighbour rose
        seg_end[s], seg_height[s] = e, new_height
        if e < b:  # [e, b) stays
            seg_end[e], seg_height[e], seg_prev[e] = b, h, s
            self.is_start[e] = 1
            touched.append(e)
            if b < self.T:
                seg_prev[b] = e
        else:
            if b < self.T:
                seg_prev[b] = s
                touched.append(b)  # its left neighbour rose
        touched.append(self.merge(s))
        return touched

    def merge(self, a: int) -> int:
        """Merge segment a with neighbours of equal height; returns the merged segment."""
        seg_end, seg_height, seg_prev = self.seg_end, self.seg_height, self.seg_prev
        h, b = seg_height[a], seg_end[a]
        if b < self.T and seg_height[b] == h:  # absorb the right neighbour
            self.is_start[b] = 0
            b = seg_end[a] = seg_end[b]
            if b < self.T:
                seg_prev[b] = a
        prev = seg_prev[a]
        if prev >= 0 and seg_height[prev] == h:  # be absorbed by the left neighbour
            self.is_start[a] = 0
            a, seg_end[prev] = prev, b
            if b < self.T:
                seg_prev[b] = prev
        return a


class _Candidates:
    """The unplaced buffers, for the skyline's choice on a segment [a, b): of those with
    a <= start and end <= b, the one touching most of a and b, then of highest priority.

    Arrays sorted by (start, -priority) hold them: the buffers starting at a come first and
    best first, the ones strictly inside follow. A second order, by (end, -priority), finds the
    ones ending at b. Most segments have nothing inside that fits: the smallest end among the
    buffers starting inside, kept per block of positions, says so without a scan. Placed
    buffers get an end past every segment and are dropped whenever they make up half."""

    NARROW = 32  # below this many buffers starting inside a segment, a Python loop is faster
    BLOCK = 64  # positions per block of the smallest-end summary

    def __init__(self, p: _Problem, priority: Sequence[int]):
        self.m, self.T, self.start_of, self.priority_of = p.m, p.T, p.start, priority
        self.placed = bytearray(p.m)
        self.position = [0] * p.m  # buffer -> its index in the arrays
        start, end, rank = np.asarray(p.start), np.asarray(p.end), np.asarray(priority, dtype=np.int64)
        by_start = np.lexsort((-rank, start))
        self._keep(by_start, start[by_start], end[by_start], rank[by_start])
        by_end = np.lexsort((-rank, end))
        self.ending = by_end.tolist()
        self.first_ending_at = np.searchsorted(end[by_end], np.arange(p.T + 2)).tolist()

    def _keep(self, ids, start, end, priority) -> None:
        """Hold these unplaced buffers (sorted) in the arrays and nothing else."""
        self.ids, self.start, self.end, self.priority = ids, start, end, priority
        self.ids_l, self.end_l, self.priority_l = ids.tolist(), end.tolist(), priority.tolist()
        for k, i in enumerate(self.ids_l):
            self.position[i] = k
        self.first_at = np.searchsorted(start, np.arange(self.T + 1)).tolist()  # first k: start >= t
        self.block_min = [min(self.end_l[k:k + self.BLOCK]) for k in range(0, len(self.end_l), self.BLOCK)]
        self.dropped = 0

    def pick(self, a: int, b: int) -> int:
        """Remove and return the buffer to put on [a, b), or -1 if none lies within it."""
        i = self._touching(a, b)
        if i < 0:
            i = self._inside(a, b)
            if i < 0:
                return -1
        self._drop(i)
        return i

    def _drop(self, i: int) -> None:
        self.placed[i] = 1
        k = self.position[i]
        self.end[k] = self.end_l[k] = self.T + 1  # fits no segment
        first = k - k % self.BLOCK
        self.block_min[k // self.BLOCK] = min(self.end_l[first:first + self.BLOCK])
        self.dropped += 1
        if 2 * self.dropped > len(self.ids):
            alive = self.end <= self.T
            self._keep(self.ids[alive], self.start[alive], self.end[alive], self.priority[alive])

    def _touching(self, a: int, b: int) -> int:
        """The best buffer within [a, b) that starts at a or ends at b, or -1."""
        ids, end = self.ids_l, self.end_l
        left = right = -1
        for k in range(self.first_at[a], self.first_at[a + 1]):  # starting at a, best first
            if end[k] <= b:
                if end[k] == b:
                    return ids[k]  # touches both ends
                if left < 0:
                    left = ids[k]
        ending, start_of, placed = self.ending, self.start_of, self.placed
        for k in range(self.first_ending_at[b], self.first_ending_at[b + 1]):  # ending at b
            i = ending[k]
            if start_of[i] >= a and not placed[i]:
                right = i
                break
        if left < 0 or right < 0:
            return max(left, right)
        return left if self.priority_of[left] > self.priority_of[right] else right

    def _inside(self, a: int, b: int) -> int:
        """The best buffer with a < start and end <= b, or -1."""
        lo, hi = self.first_at[a + 1], self.first_at[b]
        if hi - lo <= self.NARROW:
            best, best_priority, ids, end, priority = -1, -1, self.ids_l, self.end_l, self.priority_l
            for k in range(lo, hi):
                if end[k] <= b and priority[k] > best_priority:
                    best, best_priority = ids[k], priority[k]
            return best
        if self._smallest_end(lo, hi) > b:
            return -1
        key = np.where(self.end[lo:hi] <= b, self.priority[lo:hi], -1)
        k = int(key.argmax())
        return int(self.ids[lo + k])

    def _smallest_end(self, lo: int, hi: int) -> int:
        """min(end_l[lo:hi]) from whole blocks' summaries and the partial blocks at the ends."""
        end, B = self.end_l, self.BLOCK
        first_block, last_block = lo // B + 1, hi // B  # whole blocks in between
        if first_block >= last_block:
            return min(end[lo:hi])
        return min(min(end[lo:first_block * B]), min(self.block_min[first_block:last_block]),
                   min(end[last_block * B:hi], default=self.T + 1))


# ---------------------------------------------------------------------------------------------
# The public planners
# ---------------------------------------------------------------------------------------------

def first_fit_by_start(intervals: Sequence[Interval], alignment: int = DEFAULT_ALIGNMENT) -> tuple[list[int], int]:
    """The seed's planner (seed 002, phase 3): buffers in order of start step (then index);
    those that died are freed first; each takes the lowest offset where it fits among the live
    ones. Returns (offsets, slab_size)."""
    p = _problem(intervals, alignment)
    return p.to_bytes(_sweep_first_fit(p)[0])


def greedy_by_size(intervals: Sequence[Interval], alignment: int = DEFAULT_ALIGNMENT) -> tuple[list[int], int]:
    """TFLite's GreedyBySize offset assignment (delegates/gpu/common/memory_management/
    greedy_by_size_assignment.cc): largest buffer first (ties by index); each goes into the
    smallest gap, lowest of equals, between the placed buffers that meet it in time, or above
    the highest of them. Returns (offsets, slab_size). Looks at every pair of buffers that meet
    in time: fine for thousands of buffers, seconds for 10^5 buffers with ~100 live at once."""
    p = _problem(intervals, alignment)
    return p.to_bytes(_ordered_fit(p, _order(p, "size"), _neighbours(p), best_fit=True)[0])


def plan_offsets(intervals: Sequence[Interval], *, alignment: int = DEFAULT_ALIGNMENT,
                 time_budget_s: float | None = None, seed: int = 0) -> tuple[list[int], int]:
    """Plan byte offsets in one slab for buffers given as (size_bytes, first_step, end_step).

    Returns (offsets, slab_size): offsets aligned to `alignment`, buffers live at a common step
    never overlap (check_plan holds), and the slab is never larger than first_fit_by_start's,
    nor than greedy_by_size's when at most MAX_PAIRS_FOR_ORDERED_FITS pairs of buffers meet
    in time (graphs of a few thousand buffers): both always run (greedy-by-size only until it
    falls behind the best plan so far).

    Then, while `time_budget_s` lasts (counted from the call; by default 0.2 s plus 25 us per
    buffer, at most 0.7 s): skyline fills and ordered fits under several priorities, then a
    randomised search over skyline priorities (seeded: the same inputs, budget and machine give
    the same plan). A heuristic still running at the deadline is abandoned, a skyline fill
    (~15 us per buffer) is not started when it cannot end in time, and the search stops when a
    plan reaches the lower bound. So the budget bounds the call but for the baselines: about
    3 us per buffer for first fit, about 1 us per pair of buffers meeting in time for
    greedy-by-size. On 10^5 buffers the default budget leaves first fit's plan (~0.5 s); a
    budget of a few seconds lets the skyline run (~2 s).
    """
    started = time.perf_counter()
    p = _problem(intervals, alignment)
    if time_budget_s is None:
        time_budget_s = DEFAULT_TIME_BUDGET_S + min(MAX_EXTRA_BUDGET_S, EXTRA_BUDGET_PER_BUFFER_S * p.m)
    search = _Search(p, started + time_budget_s)
    sweep_started = time.perf_counter()
    search.consider(lambda bound: _sweep_first_fit(p))
    # A skyline fill costs about SKYLINE_VS_SWEEP first-fit sweeps: don't start one that cannot end.
    search.skyline_cost = SKYLINE_VS_SWEEP * (time.perf_counter() - sweep_started)
    if not search.out_of_time(skyline=True):  # first: it bounds what follows
        search.consider(lambda bound: _skyline(p, _priority(p, "area"), bound))
    neighbours = _neighbours(p) if _pair_count(p) <= MAX_PAIRS_FOR_ORDERED_FITS else None
    if neighbours is not None:
        search.consider(lambda bound: _ordered_fit(p, _order(p, "size"), neighbours, True,
                                                   _Bound(limit=bound.limit)))
    for name, engine in _portfolio(p, neighbours):
        if search.done() or search.out_of_time():
            break
        if not (name.startswith("skyline") and search.out_of_time(skyline=True)):
            search.consider(engine)
    rng = random.Random(seed)
    while not (search.done() or search.out_of_time(skyline=True)):
        priority = _random_priority(p, rng)
        search.consider(lambda bound, priority=priority: _skyline(p, priority, bound))
    return p.to_bytes(search.offsets)


def _portfolio(p: _Problem, neighbours: list[list[int]] | None):
    """(name, engine) in the order tried; an engine maps a _Bound to a _Result. The skyline
    fills are strongest on fragmented instances, the ordered fits on model graphs."""
    if neighbours is not None:
        yield "size-first-fit", lambda bound: _ordered_fit(p, _order(p, "size"), neighbours, False, bound)
    for key in ("size", "steps"):
        yield f"skyline-{key}", lambda bound, key=key: _skyline(p, _priority(p, key), bound)
    if neighbours is not None:
        for key in ("area", "steps"):
            for best_fit in (True, False):
                yield (f"{key}-{'best' if best_fit else 'first'}-fit",
                       lambda bound, key=key, best_fit=best_fit: _ordered_fit(p, _order(p, key), neighbours,
                                                                              best_fit, bound))


def _order(p: _Problem, key: str) -> list[int]:
    """Buffers sorted by a key, largest first, ties by index."""
    value = {"size": p.nbytes,
             "area": [s * d for s, d in zip(p.nbytes, p.steps)],
             "steps": p.steps}[key]
    return sorted(range(p.m), key=lambda i: (-value[i], i))


def _priority(p: _Problem, key: str) -> list[int]:
    """Rank of each buffer under `key`: the largest gets m - 1."""
    rank = [0] * p.m
    for r, i in enumerate(reversed(_order(p, key))):
        rank[i] = r
    return rank


def _random_priority(p: _Problem, rng: random.Random) -> list[int]:
    """A random blend of size and lifetime, jittered: size * steps^mix * noise."""
    mix, noise = rng.random(), rng.choice((0.0, 0.1, 0.3))
    value = [s * d ** mix * rng.lognormvariate(0.0, noise) for s, d in zip(p.nbytes, p.steps)]
    rank = [0] * p.m
    for r, i in enumerate(sorted(range(p.m), key=value.__getitem__)):
        rank[i] = r
    return rank


class _Search:
    """The best plan found so far, the lower bound it is measured against, and the clock."""

    def __init__(self, p: _Problem, deadline: float):
        self.deadline = deadline
        self.offsets: list[int] = [0] * p.m
        self.slab: float = _INF
        self.bound = _unit_lower_bound(p)
        self.skyline_cost = 0.0  # expected seconds for one skyline fill

    def consider(self, engine) -> None:
        """Run an engine bounded by the best slab so far and the deadline; keep a better plan."""
        result = engine(_Bound(limit=self.slab - 1, deadline=self.deadline))
        if result is not None and result[1] < self.slab:
            self.offsets, self.slab = result

    def done(self) -> bool:
        return self.slab <= self.bound

    def out_of_time(self, skyline: bool = False) -> bool:
        """True once the deadline has passed, or for a skyline fill, once it would pass first."""
        return time.perf_counter() + (self.skyline_cost if skyline else 0.0) > self.deadline


def _unit_lower_bound(p: _Problem) -> int:
    """lower_bound in alignment units on compressed time: what the engines can reach."""
    if not p.m:
        return 0
    steps = np.concatenate([p.start, p.end])
    delta = np.concatenate([p.size, -np.asarray(p.size)])
    return int(np.cumsum(delta[np.lexsort((delta, steps))]).max())


# ---------------------------------------------------------------------------------------------
# A plan with its context
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryPlan:
    """Buffers (size_bytes, first_step, end_step), their byte offsets in one slab, and the slab.

    names label the buffers in the text form and the picture (the compiler passes the values'
    names). Build one with make_plan, or around any offsets, e.g. a baseline's:
    MemoryPlan(intervals, *first_fit_by_start(intervals))."""
    intervals: tuple[Interval, ...]
    offsets: tuple[int, ...]
    slab_size: int
    names: tuple[str, ...] | None = None
    alignment: int = DEFAULT_ALIGNMENT

    def __post_init__(self):
        object.__setattr__(self, "intervals", tuple(tuple(int(x) for x in iv) for iv in self.intervals))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        if self.names is not None:
            object.__setattr__(self, "names", tuple(str(n) for n in self.names))
            if len(self.names) != len(self.intervals):
                raise ValueError(f"{len(self.names)} names for {len(self.intervals)} buffers")

    @functools.cached_property
    def lower_bound(self) -> int:
        """The largest total of bytes live at one step."""
        return lower_bound(self.intervals)

    @property
    def ratio(self) -> float:
        """slab_size / lower_bound (1.0 for an empty plan)."""
        return self.slab_size / self.lower_bound if self.lower_bound else 1.0

    def check(self) -> None:
        """Raise ValueError unless the plan is valid (see check_plan)."""
        check_plan(self.intervals, self.offsets, self.slab_size, self.alignment, self.names)

    def format(self) -> str:
        """The text form: the slab against the lower bound, then one line per buffer."""
        from .plot import format_plan
        return format_plan(self.intervals, self.offsets, self.slab_size, self.names)

    def plot(self, path, *, title: str | None = None) -> None:
        """Draw the plan into an image file (needs matplotlib; see tjit.memory.plot)."""
        from .plot import plot
        plot(self, path, title=title)

    def __str__(self) -> str:
        return self.format()


def make_plan(intervals: Sequence[Interval], names: Sequence[str] | None = None, *,
              alignment: int = DEFAULT_ALIGNMENT, time_budget_s: float | None = None) -> MemoryPlan:
    """plan_offsets, wrapped in a MemoryPlan."""
    offsets, slab = plan_offsets(intervals, alignment=alignment, time_budget_s=time_budget_s)
    return MemoryPlan(tuple(intervals), tuple(offsets), slab, None if names is None else tuple(names), alignment)

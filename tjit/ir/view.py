"""A View maps a logical index to an element offset: offset + sum(i_k * strides[k]).

Views are immutable and every movement op returns a new View, so graph nodes can
share them and use them as dict keys. Sizes and strides are ints here; symbolic
(sympy) sizes are where dynamic shapes will plug in, which is why nothing below
needs more than +, * and comparisons with 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


def _normalize_dim(dim: int, ndim: int, op: str) -> int:
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise IndexError(f"{op}: dim {dim} out of range for a {ndim}-d view")
    return dim % max(ndim, 1)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def nested_axes(view: "View"):
    """(axis order by decreasing stride, sizes, strides) of the view's non-unit axes, or None
    unless each stride is positive and steps past everything the smaller ones reach (then no
    two indices share an address, and the axes nest as a dense tensor's do, with gaps). Not
    nested: two elements share memory (an expanded tensor, overlapping windows), or the
    strides interleave (as_strided((3, 3), (2, 3)) reaches 9 addresses, none twice)."""
    kept = [d for d, n in enumerate(view.shape) if n != 1]
    if any(view.strides[d] <= 0 for d in kept):
        return None
    order = sorted(kept, key=lambda d: -view.strides[d])
    sizes = [view.shape[d] for d in order]
    strides = [view.strides[d] for d in order]
    return (order, sizes, strides) if strides_nest(sizes, strides) else None


def strides_nest(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Sorted by decreasing stride, no two index tuples reach the same offset: every stride
    is larger than the span of the axes after it."""
    span = 0
    for n, s in reversed(list(zip(sizes, strides))):
        if s <= span:
            return False
        span += (n - 1) * s
    return True


@dataclass(frozen=True)
class View:
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    def __post_init__(self):
        if len(self.shape) != len(self.strides):
            raise ValueError(f"View: shape {self.shape} and strides {self.strides} differ in length")

    @staticmethod
    def contiguous(shape: Sequence[int]) -> "View":
        return View(tuple(shape), contiguous_strides(shape), 0)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """Row-major dense with zero offset (size-1 dims may have any stride; an empty
        view is contiguous, as torch says)."""
        if self.numel == 0:
            return True
        if self.offset != 0:
            return False
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.strides))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def is_dense(self) -> bool:
        """Covers numel consecutive elements from offset 0, in any dim order (contiguous or a
        permutation of it: channels-last, a transpose)."""
        if self.numel == 0:
            return True
        expected = 1
        for stride, size in sorted((st, sz) for sz, st in zip(self.shape, self.strides) if sz != 1):
            if stride != expected:
                return False
            expected *= size
        return self.offset == 0

    # -- movement ops -------------------------------------------------------------
    def permute(self, dims: Sequence[int]) -> "View":
        dims = [_normalize_dim(d, self.ndim, "permute") for d in dims]
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not a permutation of {self.ndim} dims")
        return View(tuple(self.shape[d] for d in dims), tuple(self.strides[d] for d in dims), self.offset)

    def unsqueeze(self, dim: int) -> "View":
        dim = _normalize_dim(dim, self.ndim + 1, "unsqueeze")
        stride = self.strides[dim] * self.shape[dim] if dim < self.ndim else 1
        return View(self.shape[:dim] + (1,) + self.shape[dim:], self.strides[:dim] + (stride,) + self.strides[dim:], self.offset)

    def squeeze(self, dims: Optional[Sequence[int]] = None) -> "View":
        if dims is None:
            dims = [d for d, s in enumerate(self.shape) if s == 1]
        dims = {_normalize_dim(d, self.ndim, "squeeze") for d in dims}
        keep = [d for d in range(self.ndim) if not (d in dims and self.shape[d] == 1)]
        return View(tuple(self.shape[d] for d in keep), tuple(self.strides[d] for d in keep), self.offset)

    def flip(self, dims: Sequence[int]) -> "View":
        shape, strides, offset = self.shape, list(self.strides), self.offset
        for d in {_normalize_dim(d, self.ndim, "flip") for d in dims}:
            if shape[d] > 0:
                offset += (shape[d] - 1) * strides[d]
            strides[d] = -strides[d]
        return View(shape, tuple(strides), offset)

    def expand(self, shape: Sequence[int]) -> "View":
        """Broadcast to `shape` (torch rules: new leading dims, size-1 dims to any size)."""
        shape = tuple(shape)
        lead = len(shape) - self.ndim
        if lead < 0:
            raise ValueError(f"expand: cannot expand {self.shape} to fewer dims {shape}")
        strides = [0] * lead
        for k, (old, stride) in enumerate(zip(self.shape, self.strides)):
            new = shape[lead + k]
            if new == -1 or new == old:
                strides.append(stride)
            elif old == 1:
                strides.append(0)
            else:
                raise ValueError(f"expand: size {old} of dim {k} cannot become {new} (shape {self.shape} -> {shape})")
        out_shape = tuple(self.shape[k - lead] if s == -1 else s for k, s in enumerate(shape))
        return View(out_shape, tuple(strides), self.offset)

    def slice(self, dim: int, start: int, stop: int, step: int = 1) -> "View":
        """Python slicing semantics for `start`/`stop` (clamped, negatives wrap); step > 0."""
        if step <= 0:
            raise ValueError(f"slice: step must be positive, got {step}")
        dim = _normalize_dim(dim, self.ndim, "slice")
        start, stop, _ = slice(start, stop, step).indices(self.shape[dim])
        size = max(0, -(-(stop - start) // step))
        shape = self.shape[:dim] + (size,) + self.shape[dim + 1:]
        strides = self.strides[:dim] + (self.strides[dim] * step,) + self.strides[dim + 1:]
        offset = self.offset + (start * self.strides[dim] if size > 0 else 0)
        return View(shape, strides, offset)

    def select(self, dim: int, index: int) -> "View":
        dim = _normalize_dim(dim, self.ndim, "select")
        if not -self.shape[dim] <= index < self.shape[dim]:
            raise IndexError(f"select: index {index} out of range for dim {dim} of size {self.shape[dim]}")
        index %= self.shape[dim]
        return View(self.shape[:dim] + self.shape[dim + 1:], self.strides[:dim] + self.strides[dim + 1:],
                    self.offset + index * self.strides[dim])

    def diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1) -> "View":
        """torch.diagonal: dims dim1 and dim2 replaced by their diagonal, appended last."""
        d1, d2 = _normalize_dim(dim1, self.ndim, "diagonal"), _normalize_dim(dim2, self.ndim, "diagonal")
        if d1 == d2:
            raise ValueError(f"diagonal: dim1 and dim2 are both {d1}")
        n1, n2 = self.shape[d1], self.shape[d2]
        size = max(min(n1, n2 - offset), 0) if offset >= 0 else max(min(n1 + offset, n2), 0)
        start = offset * self.strides[d2] if offset >= 0 else -offset * self.strides[d1]
        keep = [d for d in range(self.ndim) if d not in (d1, d2)]
        return View(tuple(self.shape[d] for d in keep) + (size,),
                    tuple(self.strides[d] for d in keep) + (self.strides[d1] + self.strides[d2],),
                    self.offset + (start if size > 0 else 0))

    def reshape(self, shape: Sequence[int]) -> Optional["View"]:
        """The same elements in row-major order under a new shape, or None when no single
        strided view can express it (the caller then materialises with Contiguous)."""
        shape = _infer_reshape(tuple(shape), self.numel)
        if math.prod(shape) == 0 or self.numel == 0:
            return View(shape, contiguous_strides(shape), self.offset)
        strides = _reshape_strides(self.shape, self.strides, shape)
        return None if strides is None else View(shape, strides, self.offset)

    def __repr__(self) -> str:
        off = f", offset={self.offset}" if self.offset else ""
        return f"View({list(self.shape)}, strides={list(self.strides)}{off})"


def _infer_reshape(shape: tuple[int, ...], numel: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: only one dim may be -1, got {shape}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or numel % known:
            raise ValueError(f"reshape: shape {shape} is invalid for {numel} elements")
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if math.prod(shape) != numel:
        raise ValueError(f"reshape: shape {shape} is invalid for {numel} elements")
    return shape


def _reshape_strides(old_shape, old_strides, new_shape) -> Optional[tuple[int, ...]]:
    """torch's computeStride: walk chunks of old dims that are contiguous with each other
    and split each chunk over the new dims that multiply up to it."""
    old = [(s, st) for s, st in zip(old_shape, old_strides) if s != 1]
    new_strides = [0] * len(new_shape)
    new_dim = len(new_shape) - 1
    i = len(old) - 1
    while i >= 0:
        # gather the chunk [j..i] of old dims that are mutually contiguous
        chunk_numel, j = old[i][0], i
        while j > 0 and old[j - 1][1] == old[j][1] * old[j][0]:
            j -= 1
            chunk_numel *= old[j][0]
        stride, covered = old[i][1], 1
        while new_dim >= 0 and (covered < chunk_numel or new_shape[new_dim] == 1):
            new_strides[new_dim] = stride * covered
            covered *= new_shape[new_dim]
            new_dim -= 1
        if covered != chunk_numel:
            return None
        i = j - 1
    while new_dim >= 0:  # leftover size-1 dims
        new_strides[new_dim] = 1
        new_dim -= 1
    return tuple(new_strides)

"""How each axis of a kernel's iteration space maps onto Triton (DESIGN.md's table).

ThreadGroup(simd): the axis is split across programs (a grid axis); each program covers
    `simd` consecutive indices with the lanes of its block (1 when simd is None).
Thread(simd): one program's block covers the whole axis; `simd` is the number of
    contiguous elements per lane, passed to Triton as contiguity hints.
Sequential(simd): a `for` loop inside the program walks the axis, `simd` indices per step.
Auto: the scheduler decides from sizes, contiguity and the op kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AxisStrategy:
    simd: Optional[int] = None

    def __post_init__(self):
        if self.simd is not None and (self.simd < 1 or self.simd & (self.simd - 1)):
            raise ValueError(f"{type(self).__name__}: simd width must be a power of two, got {self.simd}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'' if self.simd is None else self.simd})"


class Auto(AxisStrategy):
    pass


class Sequential(AxisStrategy):
    pass


class Thread(AxisStrategy):
    pass


class ThreadGroup(AxisStrategy):
    pass

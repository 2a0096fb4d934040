"""Graph-level element types (no pointers or vectors exist at this level).

Complex types and uint64 have no Triton type: only library calls compute them (they are
read and written as memory, never loaded by a kernel)."""
from __future__ import annotations

import enum

import torch

from ..errors import UnsupportedOpError


class DType(enum.Enum):
    bool = "bool"
    int8 = "int8"
    int16 = "int16"
    int32 = "int32"
    int64 = "int64"
    uint8 = "uint8"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"
    float64 = "float64"
    complex32 = "complex32"
    complex64 = "complex64"
    complex128 = "complex128"
    uint64 = "uint64"

    @staticmethod
    def from_torch(dtype: torch.dtype) -> "DType":
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            raise UnsupportedOpError(f"dtype {dtype}", "tjit has no element type for it yet") from None

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)

    @property
    def triton(self) -> str:
        """The `tl.<name>` spelling of this type."""
        if self.library_only:
            raise UnsupportedOpError(f"dtype {self.torch}", "a kernel would compute it: tjit computes this type in "
                                     "library calls only")
        return "int1" if self is DType.bool else self.value

    @property
    def library_only(self) -> bool:
        """A type no kernel computes: library calls produce and consume it."""
        return self.is_complex or self is DType.uint64

    @property
    def is_complex(self) -> bool:
        return self in (DType.complex32, DType.complex64, DType.complex128)

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize

    @property
    def is_float(self) -> bool:
        return self in (DType.float16, DType.bfloat16, DType.float32, DType.float64)

    @property
    def has_gradient(self) -> bool:
        """Values of this type carry gradients (floating point, real or complex)."""
        return self.is_float or self.is_complex

    @property
    def is_low_precision(self) -> bool:
        """Types that are computed in float32 and rounded back, as eager does."""
        return self in (DType.float16, DType.bfloat16)

    @property
    def is_signed_int(self) -> bool:
        return self in (DType.int8, DType.int16, DType.int32, DType.int64)

    @property
    def is_int(self) -> bool:
        return self.is_signed_int or self is DType.uint8

    def __repr__(self) -> str:
        return self.value


_FROM_TORCH = {d.torch: d for d in DType}

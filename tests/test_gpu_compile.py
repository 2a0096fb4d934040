"""Kernels compile for Hopper (sm_90a) without a GPU; registers, spills and load widths are reported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the suite runs kernels in the interpreter; must precede triton


import pytest
import torch
import triton
import triton.language as tl

from tjit.lower.gpu_compile import GpuCompileReport, compile_for_gpu, triton_type_of


@triton.jit
def _scale(x, factor: tl.constexpr):  # a helper, to check that called @triton.jit functions compile too
    return x * factor


@triton.jit
def masked_add(x_ptr, y_ptr, out_ptr, n, x_stride, y_stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * x_stride, mask=mask, other=0.0)
    y = tl.load(y_ptr + offs * y_stride, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _scale(x + y, 2.0), mask=mask)


@triton.jit
def contiguous_copy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def row_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + tl.program_id(0) * n + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x, axis=0))


@triton.jit
def shape_mismatch(x_ptr, BLOCK: tl.constexpr):
    a = tl.arange(0, BLOCK)
    b = tl.arange(0, BLOCK * 2)
    tl.store(x_ptr + a, a + b)


ADD_SIG = {"x_ptr": "*fp32", "y_ptr": "*fp16", "out_ptr": "*fp32", "n": "i32", "x_stride": "i32", "y_stride": "i32"}


def test_masked_elementwise_compiles_without_spills():
    r = compile_for_gpu(masked_add, ADD_SIG, {"BLOCK": 1024})
    assert isinstance(r, GpuCompileReport)
    assert r.kernel_name == "masked_add" and r.arch == 90
    assert r.registers > 0
    assert r.spills == 0 and r.local_memory == 0
    assert r.scalar_loads > 0  # strided loads cannot be vectorised
    assert ".target sm_90a" in r.ptx


def test_contiguous_aligned_load_vectorises():
    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    aligned = compile_for_gpu(contiguous_copy, sig, {"BLOCK": 1024}, divisible_by_16=("x_ptr", "out_ptr", "n"))
    assert aligned.vector_loads > 0 and aligned.scalar_loads == 0
    # Without the divisibility hints the mask may split any 16-byte group, so every load is scalar.
    unaligned = compile_for_gpu(contiguous_copy, sig, {"BLOCK": 1024})
    assert unaligned.vector_loads == 0 and unaligned.scalar_loads > 0


def test_reduction_compiles():
    r = compile_for_gpu(row_sum, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, {"BLOCK": 256}, num_warps=8)
    assert r.registers > 0 and r.spills == 0


def test_bad_kernel_raises_with_its_name():
    with pytest.raises(RuntimeError, match="shape_mismatch"):
        compile_for_gpu(shape_mismatch, {"x_ptr": "*i32"}, {"BLOCK": 64})


def test_argument_mismatch_is_reported():
    with pytest.raises(ValueError, match="missing arguments"):
        compile_for_gpu(row_sum, {"x_ptr": "*fp32"}, {"BLOCK": 256})


def test_second_call_hits_the_cache():
    sig = {"x_ptr": "*fp16", "out_ptr": "*fp16", "n": "i32"}
    first = compile_for_gpu(contiguous_copy, sig, {"BLOCK": 512})
    second = compile_for_gpu(contiguous_copy, dict(sig), {"BLOCK": 512})
    assert second is first  # the very same report object: nothing was compiled again


def test_kernel_still_runs_in_the_interpreter_after_compiling():
    # Compiling must not disturb interpreted execution of the same kernel (skipped on a real GPU run).
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter not enabled")
    compile_for_gpu(masked_add, ADD_SIG, {"BLOCK": 128})
    x, y = torch.randn(300), torch.randn(300, dtype=torch.float16)
    out = torch.empty(300)
    masked_add[(3,)](x, y, out, 300, 1, 1, BLOCK=128)
    torch.testing.assert_close(out, (x + y.float()) * 2)


@pytest.mark.parametrize("dtype,expected", [(torch.bool, "i1"), (torch.uint8, "u8"), (torch.int64, "i64"),
                                            (torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float64, "fp64")])
def test_triton_type_of(dtype, expected):
    assert triton_type_of(dtype, pointer=False) == expected
    assert triton_type_of(dtype, pointer=True) == "*" + expected


@triton.jit
def center(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, x - tl.sum(x, axis=0) / n, mask=mask)


def test_spills_are_detected():
    # 8192 floats held live across a reduction by one warp: 256 values a thread, more than 255 registers.
    r = compile_for_gpu(center, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, {"BLOCK": 8192}, num_warps=1)
    assert r.registers == 255
    assert r.spill_stores > 0 and r.spill_loads > 0 and r.spills == r.spill_stores + r.spill_loads
    assert r.stack_frame > 0  # spill slots live in the stack frame ...
    assert r.local_memory == 0  # ... not in cuobjdump's LOCAL


def test_shape_op_kernels_compile_without_spills():
    """Kernels with coordinates, shifted (masked) reads and in-range indexed reads (cat, pad,
    arange, tril, repeat, roll, several index tensors) compile for sm_90 as launched."""
    import torch.nn.functional as F

    import tjit
    from tjit.lower.gpu_compile import compile_launched
    from tjit.runtime.loader import launched_kernels

    x, y, i, j = torch.randn(37, 1100), torch.randn(21, 1100), torch.randint(0, 37, (5, 1)), torch.randint(0, 1100, (3,))
    programs = [(lambda x, y: torch.cat([x * 2, y + 1]).sum(1), (x, y)),
                (lambda x: F.pad(x, (1, 2, -1, 3), value=2.5) * torch.arange(1103.), (x,)),
                (lambda x: torch.roll(x.tril(3), (2, -5), (0, 1)) + x.repeat(1, 2)[:, 7:1107], (x,)),
                (lambda x, i, j: x[i, j] * 2 + x[i, j.flip(0)], (x, i, j))]
    names = set()
    for fn, args in programs:
        names |= {k.name for k in tjit.explain(fn, *args).kernels}
        tjit.compile(fn)(*args)
    reports = [compile_launched(plan, args) for plan, args in launched_kernels() if plan.name in names]
    assert len(reports) >= len(programs)
    assert all(r.spills == 0 and r.registers > 0 for r in reports)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_scatter_kernels_compile(dtype):
    """index_put's scatter kernels (tl.store and tl.atomic_add at data-dependent offsets)
    compile for sm_90 as launched, for every type an accumulating index_put fuses."""
    import tjit
    from tjit.lower.gpu_compile import compile_launched
    from tjit.runtime.loader import launched_kernels

    x, i, j = torch.ones(300, 7, dtype=dtype), torch.randint(0, 300, (500,)), torch.randperm(300)[:100]
    programs = [(lambda x, i: torch.ops.aten.index_put(x, [i], x[:1] * 2, True), (x, i)),
                (lambda x, j: torch.ops.aten.index_put(x, [j], x[:100] + 1), (x, j))]
    names = set()
    for fn, args in programs:
        names |= {k.name for k in tjit.explain(fn, *args).kernels}
        tjit.compile(fn)(*args)
    launched = [(plan, args) for plan, args in launched_kernels() if plan.name in names]
    assert sum("tl.atomic_add" in plan.source for plan, _ in launched) >= 1  # the accumulating scatter
    assert all(compile_launched(plan, args).registers > 0 for plan, args in launched)

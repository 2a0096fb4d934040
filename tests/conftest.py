"""Test harness: interpreter mode, poisoned outputs, and an sm_90 compile of every kernel.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
Every kernel a test launches is also compiled for Hopper (sm_90) after the test and must
compile with no register spills.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["TJIT_POISON"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tjit.runtime.loader import launched_kernels, load_kernel  # noqa: E402

_checked: set = set()


def gpu_signature(plan, args):
    """Triton's JIT specialisations, mimicked: ints equal to 1 become constexprs,
    ints and pointers divisible by 16 are marked so loads can vectorise."""
    from tjit.lower.gpu_compile import triton_type_of
    signature, constexprs, divisible = {}, dict(plan.constexprs), []
    for name, arg in zip(plan.param_names, args):
        if isinstance(arg, tuple):  # (dtype, data_ptr) of a tensor
            dtype, ptr = arg
            signature[name] = triton_type_of(dtype, pointer=True)
            if ptr % 16 == 0:
                divisible.append(name)
        elif arg == 1:
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -2**31 <= arg < 2**31 else "i64"
            if arg % 16 == 0:
                divisible.append(name)
    return signature, constexprs, tuple(divisible)


def check_gpu_compiles():
    from tjit.lower.gpu_compile import compile_for_gpu
    for plan, args in launched_kernels():
        key = (plan.name, tuple(sorted(plan.constexprs.items())), tuple(a if not isinstance(a, tuple) else a[0] for a in args))
        if key in _checked:
            continue
        _checked.add(key)
        signature, constexprs, divisible = gpu_signature(plan, args)
        report = compile_for_gpu(load_kernel(plan), signature, constexprs, divisible_by_16=divisible,
                                 num_warps=plan.num_warps)
        assert report.spills == 0, f"{plan.name} spills {report.spills} bytes at sm_90:\n{plan.source}"


@pytest.fixture(autouse=True)
def _every_kernel_compiles_for_sm90():
    yield
    check_gpu_compiles()

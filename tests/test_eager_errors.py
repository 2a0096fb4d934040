"""Errors eager raises, raised by tjit too; and one compiled function called from several threads.

CPU eager raises RuntimeError("ZeroDivisionError") for an integer floor_divide, remainder,
fmod or div with rounding_mode "trunc"/"floor" (so `//` and `%`) whose divisor has a zero
(true division `/` promotes to float and gives inf). tjit's kernels check the divisor in the
interpreter (CPU tensors) and the runtime raises the same after the call, as it does for
indices out of range; compiled CUDA kernels do not check (CUDA eager does not raise).
"""
from __future__ import annotations

import contextlib
import operator
import re
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import tjit
from tests.helpers import assert_matches_eager, check_against_eager
from tjit import Sequential, Thread, ThreadGroup
from tjit.lower.codegen import ZERO_DIV_FLAG
from tjit.lower.gpu_compile import compile_launched
from tjit.runtime.loader import launched_kernels

INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
OPS = {
    "floor_divide": torch.floor_divide,
    "floordiv_operator": operator.floordiv,
    "remainder": torch.remainder,
    "mod_operator": operator.mod,
    "fmod": torch.fmod,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
}
N = 5000  # five programs of 1024 lanes; the last one partly masked


def operands(dtype, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    low = 0 if dtype == torch.uint8 else -100
    x = torch.randint(low, 100, (n,), generator=g).to(dtype)
    y = torch.randint(1, 12, (n,), generator=g).to(dtype)
    if dtype != torch.uint8:
        y = torch.where(torch.rand(n, generator=g) < 0.5, -y, y)  # every sign combination
    return x, y


def eager_error(fn, *args) -> BaseException:
    with pytest.raises(Exception) as caught:
        fn(*args)
    return caught.value


def assert_raises_like_eager(compiled, fn, *args, quiet=True):
    """compiled(*args) raises what fn(*args) raises; with `quiet`, with no warning on the way
    (numpy's, from inside the interpreter; not in threads: the warnings filter is global)."""
    expected = eager_error(fn, *args)
    with warnings.catch_warnings() if quiet else contextlib.nullcontext():
        if quiet:
            warnings.simplefilter("error")
        with pytest.raises(type(expected)) as got:
            compiled(*args)
    assert str(got.value) == str(expected) == "ZeroDivisionError"


@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_tensor_divisor_with_a_zero_raises(name, dtype):
    op = OPS[name]
    cf = tjit.compile(op)
    x, y = operands(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # masked lanes (zeros) make no numpy warning either
        check_against_eager(op, x, y, compiled=cf)
    for at in (N - 1, 1025, 0):
        z = y.clone()
        z[at] = 0
        assert_raises_like_eager(cf, op, x, z)
    check_against_eager(op, x, y, compiled=cf)  # the failed check left nothing behind


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_scalar_divisors(dtype):
    x, y = operands(dtype, 300)
    for name, op in OPS.items():
        check_against_eager(lambda x: op(x, 3), x)  # a nonzero literal divisor: nothing to check
        assert_raises_like_eager(tjit.compile(lambda x: op(x, 0)), lambda x: op(x, 0), x)
        zero = torch.zeros((), dtype=dtype)  # a 0-d tensor divisor
        cf = check_against_eager(op, x, zero + 5)
        assert_raises_like_eager(cf, op, x, zero)
        # a scalar dividend, the tensor divides
        if name in ("floordiv_operator", "mod_operator", "remainder"):
            rop = (lambda y: op(7, y)) if name != "remainder" else (lambda y: torch.remainder(7, y))
            cf = check_against_eager(rop, y)
            z = y.clone()
            z[-1] = 0
            assert_raises_like_eager(cf, rop, z)


def test_true_division_of_integers_does_not_raise():
    x, y = operands(torch.int32)
    y[3] = 0
    check_against_eager(lambda x, y: x / y, x, y)
    check_against_eager(lambda x: torch.div(x, 0), x)


def test_float_division_by_zero_does_not_raise():
    x, y = operands(torch.int32)
    x, y = x.float(), y.float()
    y[3] = 0
    for op in OPS.values():
        check_against_eager(op, x, y)


def test_fused_with_other_ops():
    def fn(x, y, w):
        q = (x * 3 + 1) // (y - 2)  # the divisor is computed in the kernel
        return torch.where(q > 0, q, x % y).abs() + torch.fmod(w, y).to(torch.int64), (x + y) * 2

    x, y = operands(torch.int32)
    y = torch.where(y == 2, 5, y)
    w = torch.randint(-50, 50, (N,), dtype=torch.int16)
    before = tjit.counters.launches
    cf = check_against_eager(fn, x, y, w)
    assert tjit.counters.launches - before == 1  # one kernel, the checks included
    for z in (torch.where(torch.arange(N) == 1025, 2, y), torch.where(torch.arange(N) == N - 1, 0, y)):
        assert_raises_like_eager(cf, fn, x, z, w)


@pytest.mark.parametrize("mapping", [None, (ThreadGroup(), Thread()), (ThreadGroup(), Sequential(128))],
                         ids=["auto", "persistent", "looped"])
def test_inside_reduction_kernels(mapping):
    def fn(x, y, w):
        q = x // y
        return q.sum(1), x.sum(1) % w.sum(1), q.cumsum(1)  # full-shape, row and scanned values

    options = {} if mapping is None else {"axis_strategies": {"*": mapping}}
    x, y = operands(torch.int64, 4 * 1250)
    x, y = x.view(4, 1250), y.view(4, 1250)
    w = y.abs()  # rows of positive numbers
    cf = check_against_eager(fn, x, y, w, **options)
    for at in ((3, 1249), (0, 1025)):
        z = y.clone()
        z[at] = 0
        assert_raises_like_eager(cf, fn, x, z, w)
    w = w.clone()
    w[2] = 0  # a row value's divisor is zero
    assert_raises_like_eager(cf, fn, x, y, w)


def test_split_reduction_totals():
    def fn(x, y):
        return x.sum() // y.sum(), (x // y).sum()

    x, y = operands(torch.int64, 3000)
    cf = check_against_eager(fn, x, y, axis_strategies={"*": (ThreadGroup(64),)})
    assert_raises_like_eager(cf, fn, x, torch.zeros_like(y))  # both divisors zero
    z = y.clone()
    z[2999] = 0
    assert_raises_like_eager(cf, fn, x, z)
    z = y.clone()
    z[0] -= y.sum()  # only the totals' divisor is zero
    assert_raises_like_eager(cf, fn, x, z)


def test_in_place_write_raises():
    """Eager's CPU kernel has written the elements before the zero (in each of its parallel
    chunks) when it raises; tjit's kernel has written every element when the check raises."""
    def fn(x, y):
        x.floor_divide_(y)
        return x

    x, y = operands(torch.int32)
    cf = check_against_eager(fn, x, y)
    z = y.clone()
    z[7] = 0
    eager_x, tjit_x = x.clone(), x.clone()
    assert_raises_like_eager(lambda: cf(tjit_x, z), lambda: fn(eager_x, z))
    assert torch.equal(tjit_x[:7], eager_x[:7])


def test_gpu_kernels_leave_the_check_out():
    """The check is a constexpr flag: off in the plan (as a GPU runs it: CUDA eager does not
    raise), on in the interpreter's launches. Off, the sm_90 code never reads the status pointer."""
    cf = tjit.compile(lambda x, y: x // y)
    x, y = operands(torch.int32, 100)
    cf(x, y)
    (launch,) = cf.entry_for(x, y).executable.launches
    assert launch.plan.constexprs[ZERO_DIV_FLAG] is False
    assert launch.constexprs[ZERO_DIV_FLAG] is True
    assert [c.error for c in launch.plan.checks] == [RuntimeError]
    # (the first launch of its source: an earlier test's kernel of the same source may have made it)
    args = next(args for plan, args in launched_kernels() if plan.name == launch.plan.name)
    ptx = compile_launched(launch.plan, args).ptx
    status = launch.plan.param_names.index("status_ptr")
    assert f"_param_{status - 1}]" in ptx and f"_param_{status}]" not in ptx  # (the one before is read)


# -- threads ---------------------------------------------------------------------------------------
def in_threads(work, threads=4) -> list[str]:
    """work(k) in `threads` threads released together (their first calls race); what failed."""
    start, errors = threading.Barrier(threads), []

    def run(k):
        try:
            start.wait()
            work(k)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return errors


def test_threads_call_one_compiled_function():
    def fn(x, y):
        z = torch.sigmoid(x) * y + 1
        return z.softmax(1), (z - z.mean(1, keepdim=True)).abs().sum(1), z.cumsum(1)

    cf = tjit.compile(fn)

    def work(k):
        for n in range(6):
            g = torch.Generator().manual_seed(1000 * k + n)
            x, y = torch.randn(8, 300, generator=g), torch.randn(8, 300, generator=g) * (k + 1)
            assert_matches_eager(cf(x, y), fn(x, y), f"thread {k} call {n}")

    errors = in_threads(work)
    assert not errors, "\n".join(errors)


def test_threads_with_failing_checks():
    """Each thread's status word is its own: the thread whose divisors have a zero raises
    every time, the others never see its failures."""
    def fn(x, y, idx):
        return x // y, x % y, x[idx]

    cf = tjit.compile(fn)

    def work(k):
        for n in range(6):
            x, y = operands(torch.int32, 2000, seed=10 * k + n)
            idx = torch.randint(0, 2000, (50,))
            if k == 0:
                y[n * 300] = 0
                assert_raises_like_eager(cf, fn, x, y, idx, quiet=False)
            else:
                assert_matches_eager(cf(x, y, idx), fn(x, y, idx), f"thread {k} call {n}")

    errors = in_threads(work)
    assert not errors, "\n".join(errors)


def test_threads_with_autograd():
    """Forward and backward from several threads; the first backward compiles (racing too)."""
    def fn(x, w):
        return torch.nn.functional.layer_norm(x * w, (300,)).tanh().sum()

    cf = tjit.compile(fn)

    def work(k):
        for n in range(3):
            g = torch.Generator().manual_seed(100 * k + n)
            x, w = torch.randn(8, 300, generator=g), torch.randn(300, generator=g)
            got = [t.clone().requires_grad_() for t in (x, w)]
            expected = [t.clone().requires_grad_() for t in (x, w)]
            cf(*got).backward()
            fn(*expected).backward()
            for a, b in zip(got, expected):
                assert_matches_eager(a.grad, b.grad, f"thread {k} call {n}")

    errors = in_threads(work)
    assert not errors, "\n".join(errors)
    assert tjit.memory.stats()["tape_bytes"] == 0


def test_a_call_missing_an_argument_raises_eagers_type_error():
    """Called with arguments that do not fit its signature, a compiled function raises a
    TypeError as eager does (not a refusal): eager's own message for positional arguments,
    inspect.signature's (which names the argument too) where keywords are given."""
    def add(a, b):
        return a + b
    compiled = tjit.compile(add)
    for args in ((torch.randn(3),), (torch.randn(3), torch.randn(3), torch.randn(3))):
        with pytest.raises(TypeError) as raised:
            add(*args)
        with pytest.raises(TypeError, match=re.escape(str(raised.value))):
            compiled(*args)
    with pytest.raises(TypeError, match="'b'"):
        compiled(torch.randn(3), c=torch.randn(3))
    check_against_eager(add, torch.randn(3), torch.randn(3))


def _needs_four_rows(x):
    if x.shape[0] != 4:
        raise ValueError("needs 4 rows")
    return x * 2


EAGER_ERRORS = {
    "the function's own": (_needs_four_rows, (torch.randn(3, 4),)),
    "a method's arguments": (lambda a: a.view("not a shape"), (torch.randn(3),)),
    "sizes that do not broadcast": (lambda a, b: a + b, (torch.randn(3, 4), torch.randn(5))),
    "a dimension out of range": (lambda a: a.sum(5), (torch.randn(3, 4),)),
    "a view across strides": (lambda a: a.t().view(-1), (torch.randn(3, 4),)),
    "a matrix product's sizes": (lambda a, b: a @ b, (torch.randn(3, 4), torch.randn(5, 2))),
    # (torch's decomposition checks the number of indices only: it broadcast the source into a result)
    "index_add's source shape": (lambda a, i, s: a.index_add(0, i, s),
                                 (torch.randn(3, 2), torch.tensor([0, 2]), torch.randn(2))),
    "index_add_'s source shape": (lambda a, i, s: a.index_add_(1, i, s),
                                  (torch.randn(3, 4), torch.tensor([0, 2]), torch.randn(2, 2))),
    # (max and min over no elements were tjit's refusal, a RuntimeError, where eager raises IndexError)
    "max over an empty dim": (lambda a: a.max(-1), (torch.randn(7, 0),)),
    "min over an empty dim": (lambda a: a.min(1).values * 2, (torch.randn(7, 0),)),
    "max of an empty tensor": (lambda a: a.max(), (torch.randn(7, 0),)),
    # (torch's decompositions and meta functions of upsampling compute any size: an empty result was returned)
    **{f"interpolate {mode} to no rows": (lambda a, mode=mode: F.interpolate(a, scale_factor=0.5, mode=mode),
                                          (torch.randn(2, 3, 1, 7),))
       for mode in ("nearest", "nearest-exact", "bilinear", "bicubic")},
    "interpolate linear to no columns": (lambda a: F.interpolate(a, scale_factor=0.1, mode="linear"),
                                         (torch.randn(2, 3, 7),)),
    "interpolate nearest 3d to no depth": (lambda a: F.interpolate(a, scale_factor=0.5), (torch.randn(1, 2, 1, 4, 4),)),
    "interpolate of no channels": (lambda a: F.interpolate(a, scale_factor=2.0), (torch.randn(2, 0, 3, 4),)),
    "interpolate of an empty row": (lambda a: F.interpolate(a, size=(4, 4), mode="bilinear"), (torch.randn(1, 2, 0, 5),)),
}


@pytest.mark.parametrize("case", EAGER_ERRORS)
def test_an_error_eager_raises_for_the_arguments_is_eagers(case):
    """The function's own errors were tjit's refusal (UnsupportedOpError, "tracing failed:
    ValueError: ..."), or the error of a reference implementation that differs from eager's
    (a ValueError where eager's view raises RuntimeError). Where a trace fails, the function
    runs eagerly on copies of the arguments; its exception, where it raises one, is raised,
    and the arguments are untouched. It is a TjitError too (EagerError for a RuntimeError,
    EagerValueError for a ValueError, ...)."""
    fn, args = EAGER_ERRORS[case]
    with pytest.raises(Exception) as eager:
        fn(*args)
    before = [a.clone() for a in args]
    with pytest.raises(type(eager.value)) as raised:
        tjit.compile(fn)(*args)
    assert isinstance(raised.value, tjit.TjitError) and str(raised.value) == str(eager.value)
    for a, b in zip(args, before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_trace_that_fails_where_eager_runs_stays_a_refusal():
    """A function eager runs and tjit's trace cannot take (it returns a generator) is tjit's
    refusal, naming what the trace stopped at."""
    def generates(a):
        yield a * 2
    with pytest.raises(tjit.UnsupportedOpError, match="tracing failed"):
        tjit.compile(generates)(torch.randn(3))


@pytest.mark.parametrize("dtype, exponent", [(torch.int8, 300), (torch.int8, 128), (torch.int32, 2 ** 31 + 5),
                                             (torch.float16, 70000), (torch.bfloat16, 1e39)], ids=str)
def test_a_power_that_does_not_fit_the_tensors_type_raises_as_eager(dtype, exponent):
    """eager's pow converts a number exponent to an integer or 16-bit float tensor's type,
    with an overflow check (3 ** (2**31 + 5) as int32 raises); tjit computed a wrapped power."""
    def power(x):
        return x.pow(exponent)
    x = torch.arange(-3, 60).to(dtype)
    with pytest.raises(RuntimeError) as raised:
        power(x)
    with pytest.raises(tjit.UnsupportedOpError, match=re.escape(str(raised.value))):
        tjit.compile(power)(x)
    check_against_eager(lambda x: x.pow(2) + x.pow(3), x)  # (exponents that fit still compute)

"""Python numbers read from tensor data by `.item()` are runtime values (frontend/scalars.py):
a kernel reads the 0-d tensor, so a new value traces and generates nothing, and every use
that computes with the number matches eager (result types as a Python number gives them)."""
import pytest
import torch

import tjit
from tjit.errors import DataDependentError
from tjit.frontend.trace import trace

from helpers import assert_matches_eager, check_against_eager

N = 5000  # elementwise kernels span several programs


def _x(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, generator=g) * 3).to(dtype)


USES = {  # name -> (fn(x, s), the 0-d tensor s is read from)
    "scale": (lambda x, s: x * s.item(), torch.tensor(0.37, dtype=torch.float64)),
    "python_arithmetic": (lambda x, s: x * (1 - s.item() * 0.01) + 2 ** s.item() / (s.item() + 3),
                          torch.tensor(1.25, dtype=torch.float64)),
    "divide": (lambda x, s: x / s.item() - s.item() // 0.5 + s.item() % 0.3, torch.tensor(-0.7)),
    # (sub with alpha: torch's own meta function branches on alpha != 1, so that one splits)
    "alpha": (lambda x, s: torch.add(x, x.flip(0), alpha=-s.item()) * 2, torch.tensor(0.3)),
    "addcdiv_value": (lambda x, s: torch.addcdiv(x, x, x.abs() + 1, value=s.item()), torch.tensor(2.5)),
    "fill_and_where": (lambda x, s: torch.where(x > 0, x, s.item()) + torch.full_like(x, s.item()),
                       torch.tensor(-1.5)),
    "clamp_and_pow": (lambda x, s: torch.clamp(x, max=s.item()) + x.abs() ** s.item(), torch.tensor(0.5)),
    "lerp": (lambda x, s: torch.lerp(x, x.flip(0), s.item()), torch.tensor(0.8)),
    "int_count": (lambda x, s: x * s.item() + s.item() // 3, torch.tensor(7)),
    "int_divides": (lambda x, s: (x * 10).int() // s.item() + x / s.item(), torch.tensor(-3, dtype=torch.int32)),
    "bool_flag": (lambda x, s: x * s.item(), torch.tensor(True)),
    "reduced_in_the_function": (lambda x, s: x * x.abs().max().item() + s.item(), torch.tensor(1.0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("use", sorted(USES))
def test_a_number_read_by_item_matches_eager(use, dtype):
    fn, s = USES[use]
    check_against_eager(fn, _x(dtype), s)


@pytest.mark.parametrize("use", sorted(USES))
def test_a_new_value_traces_and_generates_nothing(use):
    fn, s = USES[use]
    compiled = tjit.compile(fn)
    check_against_eager(fn, _x(), s, compiled=compiled)
    traces, generated = tjit.counters.traces, tjit.counters.kernels_generated
    for k, factor in enumerate([3.0, -2.0, 11.0]):  # (an int stays nonzero: the divisor in int_divides)
        new = (s * factor).to(s.dtype) if s.dtype != torch.bool else ~s
        check_against_eager(fn, _x(seed=k + 1), new, compiled=compiled)
    assert (tjit.counters.traces, tjit.counters.kernels_generated) == (traces, generated)


def test_the_number_carries_no_gradient():
    """eager's .item() leaves autograd: x's gradient is s, and s gets none."""
    def fn(x, s):
        return (x * s.item()).sin()

    x, s = _x().requires_grad_(), torch.tensor(0.6, requires_grad=True)
    x2, s2 = x.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    expected, got = fn(x, s), tjit.compile(fn)(x2, s2)
    assert_matches_eager(got, expected)
    torch.autograd.backward([expected, got], [torch.ones_like(expected)] * 2)
    assert_matches_eager(x2.grad, x.grad)
    assert s.grad is None and s2.grad is None


def test_a_number_an_op_reads_as_a_literal_splits_the_function():
    """leaky_relu's slope is read in Python by tjit's translation: DataDependentError at the
    trace, and tjit.compile's Dynamo split runs it (the number read eagerly) with eager's answer."""
    def fn(x, s):
        return torch.nn.functional.leaky_relu(x, s.item()) * 2

    with pytest.raises(DataDependentError, match="leaky_relu"):
        trace(fn, (_x(), torch.tensor(0.2)), {})
    check_against_eager(fn, _x(), torch.tensor(0.2))


def test_a_returned_number_splits_the_function():
    def fn(x):
        return x * 2, x.sum().item()

    with pytest.raises(DataDependentError, match="returned Python number"):
        trace(fn, (_x(),), {})
    (doubled, total), x = tjit.compile(fn)(_x()), _x()
    assert_matches_eager(doubled, x * 2)
    assert total == pytest.approx(x.sum().item(), rel=1e-5, abs=1e-3)  # (summed in another order than eager's)

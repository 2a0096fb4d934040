"""Horizontal fusion (lower/horizontal.py): independent pointwise kernels of one level,
over different shapes, run as one launch whose programs are the members' in turn."""
import pytest
import torch

import tjit

from helpers import check_against_eager, launches

# each test runs with the programs of every launch in order and last to first (conftest.program_order)
pytestmark = pytest.mark.usefixtures("program_order")


def _three_shapes(a, b, c):
    return a * 2, b.exp(), (c + 1).t()


def _in_place_updates(x, y, z):
    x.mul_(0.5)
    y.add_(1)
    z[:, ::2].neg_()


@pytest.mark.parametrize("fn, shapes", [
    (_three_shapes, [(3000,), (17, 5), (40, 70)]),
    (_three_shapes, [(1025,), (1,), (2049, 3)]),
    (_in_place_updates, [(5000,), (33, 7), (64, 10)]),
])
def test_independent_kernels_of_different_shapes_are_one_launch(fn, shapes):
    g = torch.Generator().manual_seed(len(shapes[0]))
    args = [torch.randn(s, generator=g) for s in shapes]
    compiled = check_against_eager(fn, *args)
    assert launches(compiled, *args) == 1
    assert len(tjit.explain(fn, *args).kernels) == 1


def test_a_member_with_no_elements_is_left_out():
    a, b, c = torch.randn(300), torch.randn(0, 5), torch.randn(4, 7)
    compiled = check_against_eager(_three_shapes, a, b, c)
    assert launches(compiled, a, b, c) == 1


def test_non_contiguous_members():
    a, b, c = torch.randn(64, 40)[:, ::3], torch.randn(9, 13).t(), torch.randn(6, 70)[:, 1::2]
    compiled = check_against_eager(_three_shapes, a, b, c)
    assert launches(compiled, a, b, c) == 1


def _checked_gather(t, i, y):
    return t[i] * 2, y + 1


def test_a_kernel_with_a_check_runs_on_its_own():
    """A kernel that reports a check (an index out of range) is not merged: its status
    word and error stay its own."""
    t, i, y = torch.randn(50, 3), torch.randint(0, 50, (40,)), torch.randn(7, 9)
    compiled = check_against_eager(_checked_gather, t, i, y)
    assert launches(compiled, t, i, y) == 2
    with pytest.raises(IndexError):
        compiled(t, torch.full((40,), 50), y)


def test_an_sgd_step_over_parameters_of_several_shapes_is_one_launch():
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 33), (33,), (17, 5, 3)]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True) for ps in (params, ref)]

    @torch.compile(backend="tjit")
    def step():
        opts[0].step()

    for k in range(3):
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        before = tjit.counters.launches
        step()
        if k:  # (the first step fills the momentum buffers: another graph)
            assert tjit.counters.launches - before == 1
        opts[1].step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q)


def _with_infinities(a, b):
    return a.masked_fill(a > 1, float("inf")), torch.where(b < 0, float("-inf"), b)


def test_members_with_string_literals_keep_them():
    """A member's source spells infinities as float("inf"): renaming its names apart must
    leave the string alone."""
    a, b = torch.randn(3000), torch.randn(17, 5)
    compiled = check_against_eager(_with_infinities, a, b)
    assert launches(compiled, a, b) == 1


def _read_then_bump(x, y, count):
    """Every program of the update reads `count`; the bump overwrites it afterwards."""
    x.mul_(count)
    y.add_(count)
    count.add_(1)


def _read_then_two_bumps(x, count, total):
    x.add_(count)
    count.add_(1)
    total.copy_(count * 2 + total)  # reads what the first one-program kernel wrote


def _scalar_from_updated(x, first):
    x.mul_(3)
    first.copy_(x[0, 0] + x[-1, -1])  # reads what two of the update's programs wrote


@pytest.mark.parametrize("fn, shapes", [
    (_read_then_bump, [(5000,), (33, 70), ()]),
    (_read_then_two_bumps, [(70, 45), (), ()]),
    (_scalar_from_updated, [(3000, 3), ()]),
])
def test_a_one_program_kernel_after_an_update_runs_in_its_last_program(fn, shapes):
    """A kernel of one program that writes what the programs before it read (or reads what
    they wrote) runs after all of them, in the last program to finish: one launch, and
    the same results as eager at sizes of several programs, called twice (the count of
    finished programs starts at zero again)."""
    g = torch.Generator().manual_seed(len(shapes))
    args = [torch.randn(s, generator=g) for s in shapes]
    compiled = tjit.compile(fn)
    for _ in range(2):
        want = [a.clone() for a in args]
        fn(*want)
        compiled(*args)
        for got, expected in zip(args, want):
            torch.testing.assert_close(got, expected)
    assert launches(compiled, *args) == 1


def test_an_update_with_no_programs_leaves_the_one_program_kernel_to_itself():
    x, count = torch.randn(0, 5), torch.tensor(2.0)
    compiled = tjit.compile(_read_then_bump)
    compiled(x, torch.randn(0), count)
    assert count.item() == 3.0

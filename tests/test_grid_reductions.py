"""Reductions finished across programs: split full reductions (ThreadGroup on the reduced
axis) and totals of a reduction kernel's rows (cross-entropy's mean). The last program to
finish combines the partials in program order, so results are deterministic."""
import pytest
import torch
import torch.nn.functional as F

import tjit
from tjit import Auto, Sequential, Thread, ThreadGroup
from helpers import check_against_eager, launches

# fresh random inputs each run (a failure prints the seed); each test runs with the programs of every
# launch in order and last to first (conftest.program_order): partials are combined by the last to finish
pytestmark = pytest.mark.usefixtures("fresh_seed", "program_order")

SPLIT = {
    "sum": lambda x: x.sum(),
    "mean_then_math": lambda x: (x.mean() * 2 + 1).sqrt(),
    "amax_and_amin": lambda x: (x.amax(), x.amin()),
    "sum_of_squares_2d": lambda x: (x * x).sum(),
    "prod": lambda x: (1 + x * 1e-3).prod(),
    "count_positive": lambda x: (x > 0).sum(),
    "any": lambda x: (x > 3).any(),
}


@pytest.mark.parametrize("name", SPLIT)
def test_forced_split_reduction(name):
    fn = SPLIT[name]
    x = torch.randn(37, 29) if name == "sum_of_squares_2d" else torch.randn(1000 + 3)
    if x.dim() == 2:
        x = x.reshape(-1)  # one contiguous run of the reduced axis
    cf = check_against_eager(fn, x, axis_strategies={"*": (ThreadGroup(64),)})
    assert launches(cf, x) == 1
    (kernel,) = tjit.explain(cf, x).kernels
    assert kernel.grid[0] > 1 and "split" in kernel.strategies[0]


def test_auto_splits_a_large_full_sum_and_is_deterministic():
    fn = lambda x: x.sum()  # noqa: E731
    x = torch.randn(1 << 17)
    cf = tjit.compile(fn)
    # 2^17 float32 terms summed in another order than eager's: compare with the exact sum,
    # within a few times fp32's rounding of a sum this long (a wrong term would be off by ~1)
    bound = 8 * torch.finfo(torch.float32).eps * x.numel() ** 0.5 * x.abs().max().item()
    assert abs(cf(x).item() - x.double().sum().item()) <= bound
    assert launches(cf, x) == 1 and tjit.explain(cf, x).kernels[0].grid[0] > 1
    assert torch.equal(cf(x), cf(x))  # the count resets; partials combine in a fixed order


def test_split_max_propagates_nan():
    fn = lambda x: x.amax()  # noqa: E731
    x = torch.randn(3000)
    x[2500] = float("nan")
    check_against_eager(fn, x, axis_strategies={"*": (ThreadGroup(128),)})


def test_split_needs_a_full_plain_reduction():
    with pytest.raises(tjit.TjitError, match="split reduction"):
        tjit.compile(lambda x: x.sum(1), axis_strategies={"*": (Auto(), ThreadGroup(16))})(torch.randn(4, 100))
    with pytest.raises(tjit.TjitError, match="split reduction"):
        tjit.compile(lambda x: x.softmax(0), axis_strategies={"*": (ThreadGroup(16),)})(torch.randn(100))


# the totals are finished by the last program to finish: (rows, mapping), rows over two or
# more programs under Auto, and one or 16 rows a program when forced
CROSS_ENTROPY_CASES = {
    "auto_37": (37, None),
    "auto_300": (300, None),
    "looped_1_row_a_program": (37, (ThreadGroup(), Sequential(8))),
    "looped_16_rows_a_program": (300, (ThreadGroup(16), Sequential(8))),
    "persistent_16_rows_a_program": (300, (ThreadGroup(16), Thread())),
}


@pytest.mark.parametrize("case", CROSS_ENTROPY_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_is_one_kernel(case, reduction):
    rows, mapping = CROSS_ENTROPY_CASES[case]
    fn = lambda x, t: F.cross_entropy(x, t, ignore_index=1, reduction=reduction)  # noqa: E731
    x, t = torch.randn(rows, 21), torch.randint(0, 21, (rows,))
    cf = check_against_eager(fn, x, t, axis_strategies=None if mapping is None else {"*": mapping})
    assert launches(cf, x, t) == 1
    assert tjit.explain(cf, x, t).kernels[0].grid[0] > 1
    assert torch.equal(cf(x, t), cf(x, t))


@pytest.mark.parametrize("rows", [50, 300])
def test_mean_of_row_norms_is_one_kernel(rows):
    fn = lambda x: x.norm(dim=1).mean()  # noqa: E731
    x = torch.randn(rows, 30)
    cf = check_against_eager(fn, x)
    assert launches(cf, x) == 1
    assert (tjit.explain(cf, x).kernels[0].grid[0] > 1) == (rows == 300)  # 64 rows a program
    assert torch.equal(cf(x), cf(x))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_totals_over_no_rows_are_still_written(reduction):
    fn = lambda x, t: F.cross_entropy(x, t, reduction=reduction)  # noqa: E731
    check_against_eager(fn, torch.randn(0, 5), torch.empty(0, dtype=torch.long))
    check_against_eager(lambda x: x.norm(dim=1).sum() + 1, torch.randn(0, 4))

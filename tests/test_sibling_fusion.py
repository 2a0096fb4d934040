"""Sibling fusion: consumers of the same inputs over the same rows share one kernel, so each
input is read once per row (a row reduction and a full-shape elementwise output; several
reductions of the same rows)."""
import pytest
import torch

import tjit
from tjit.ir import Sequential, Thread, ThreadGroup

from helpers import check_against_eager


def launches(fn, *args):
    before = tjit.counters.launches
    fn(*args)
    return tjit.counters.launches - before


def rms_norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def issue_example(x):
    return rms_norm(x.float()).to(torch.bfloat16), x + x, x.float().sum(-1)


def test_rms_norm_with_siblings_is_one_kernel_reading_x_once(fresh_seed):
    x = torch.randn(128, 768).to(torch.bfloat16)
    cf = check_against_eager(issue_example, x)
    assert launches(cf, x) == 1
    (kernel,) = tjit.explain(cf, x).kernels
    outputs = 128 * 768 * 2 * 2 + 128 * 4  # two bf16 outputs and a float32 row sum
    assert kernel.bytes_read == x.numel() * x.element_size()
    assert kernel.bytes_written == outputs


SIBLINGS = {
    "reduction_and_pointwise": lambda x, y: (x.sum(1), x * y),
    "softmax_and_relu": lambda x, y: (x.softmax(-1), torch.relu(x) + y),
    "several_reductions": lambda x, y: (x.amax(1), x.sum(1), (x * y).mean(1), x.var(1)),
    "keepdim_and_pointwise": lambda x, y: (x.amin(1, keepdim=True), x.exp()),
}
MAPPINGS = {"auto": None, "persistent": (ThreadGroup(), Thread()), "looped": (ThreadGroup(), Sequential(64))}


# (a 5000-wide row needs several programs' rows and a looped reduction; it does not fit
# one persistent block)
CASES = [(shape, mapping) for shape in [(3, 37), (67, 300), (5, 5000)] for mapping in MAPPINGS
         if not (mapping == "persistent" and shape[1] > 4096)]


@pytest.mark.parametrize("shape, mapping", CASES)
@pytest.mark.parametrize("name", SIBLINGS)
def test_siblings_share_a_kernel(name, shape, mapping, fresh_seed):
    # positive values: sums of 5000 terms that do not cancel, so another summation order
    # than eager's stays within float32 tolerance
    x, y = torch.rand(shape) + 0.5, torch.rand(shape) + 0.5
    strategies = None if MAPPINGS[mapping] is None else {"*": MAPPINGS[mapping]}
    cf = check_against_eager(SIBLINGS[name], x, y, axis_strategies=strategies)
    assert launches(cf, x, y) == 1


def test_a_sibling_that_reads_nothing_in_common_keeps_its_own_kernel_over_long_rows(fresh_seed):
    """Over rows longer than fusion.SHORT_ROW the reduction kernel has far fewer programs than
    a pointwise kernel would: an unrelated sibling would lose its parallelism there."""
    # (positive values: a sum of 5000 normal terms near zero differs from eager's by more than
    # float32's tolerance in another summation order, now and then)
    x, y = torch.rand(8, 5000) + 0.5, torch.randn(8, 5000)
    cf = check_against_eager(lambda x, y: (x.sum(1), y * 2), x, y)
    assert launches(cf, x, y) == 2


def test_a_sibling_that_reads_nothing_in_common_joins_over_short_rows(fresh_seed):
    x, y = torch.randn(64, 300), torch.randn(64, 300)
    cf = check_against_eager(lambda x, y: (x.sum(1), y * 2), x, y)
    assert launches(cf, x, y) == 1


# the same rows in another layout: attention's [t, b, d] beside a norm's [b, t, d], a matmul
# operand's [b*t, d]; outputs of odd sizes over several programs, one of them non-contiguous
LAYOUTS = {
    "permuted": lambda x, y: (x.softmax(-1), (y.transpose(0, 1) * 2).contiguous()),
    "split": lambda x, y: (x.softmax(-1), y.reshape(-1, y.shape[-1]).exp()),
    "permuted_output": lambda x, y: (x.sum(-1), y.transpose(0, 1) + 1),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_sibling_in_another_layout_of_the_same_rows_joins(name, fresh_seed):
    x, y = torch.randn(3, 37, 70), torch.randn(3, 37, 70)
    cf = check_against_eager(LAYOUTS[name], x, y)
    assert launches(cf, x, y) == 1


def test_a_full_reduction_keeps_its_split_mapping(fresh_seed):
    """A large full reduction is split across programs; a pointwise sibling over the same
    elements would serialise it, so it stays apart."""
    x = torch.rand(70_000) + 0.5
    cf = check_against_eager(lambda x: (x.sum(), x * 2), x)
    strategies = [s for k in tjit.explain(cf, x).kernels for s in k.strategies]
    assert any("split" in s for s in strategies)


def test_sibling_after_a_later_level(fresh_seed):
    """layer_norm's backward-like shape: an output pointwise sibling joins a reduction kernel
    that must wait for an earlier one."""
    def fn(x, y):
        centered = x - x.mean(0, keepdim=True)  # a column reduction: its own kernel
        return (centered * y).sum(1), y * 3
    x, y = torch.randn(40, 300), torch.randn(40, 300)
    cf = check_against_eager(fn, x, y)
    assert launches(cf, x, y) == 2

"""Indexed reads (gather, index_select, embedding, x[idx]) and cross-entropy against eager.
Indices are checked as eager checks them: out of range raises, never reads wild memory."""
import pytest
import torch
import torch.nn.functional as F

import tjit
from helpers import check_against_eager


def _rows(n, high):
    return torch.randint(0, high, (n,))


CASES = {
    "gather_dim1": (lambda x, i: torch.gather(x, 1, i), lambda: (torch.randn(5, 9), torch.randint(0, 9, (5, 4)))),
    "gather_dim0_then_math": (lambda x, i: torch.gather(x.exp(), 0, i) * 2,
                              lambda: (torch.randn(6, 3), torch.randint(0, 6, (4, 3)))),
    "index_select": (lambda x, i: torch.index_select(x, 1, i), lambda: (torch.randn(4, 7), _rows(5, 7))),
    "embedding": (lambda w, i: F.embedding(i, w) + 1, lambda: (torch.randn(11, 6), torch.randint(0, 11, (2, 3)))),
    "embedding_int32_fp16": (lambda w, i: F.embedding(i, w),
                             lambda: (torch.randn(11, 6).half(), torch.randint(0, 11, (7,), dtype=torch.int32))),
    "index_rows": (lambda x, i: x[i] * x[i], lambda: (torch.randn(5, 3), _rows(8, 5))),
    "index_negative": (lambda x, i: x[i - 5], lambda: (torch.randn(5, 3), _rows(8, 5))),
    "index_columns": (lambda x, i: x[:, i], lambda: (torch.randn(4, 6), _rows(3, 6))),
    "index_transposed_table": (lambda x, i: x.t()[i], lambda: (torch.randn(6, 4), _rows(5, 4))),
    # one input gathered directly and through a broadcast view in one kernel: the view's
    # source is not a load of its own
    "same_table_twice": (lambda x, i: (x.gather(1, i), x[:, :1].expand(4, 9).gather(1, i)),
                         lambda: (torch.randn(4, 9), torch.randint(0, 9, (4, 1)))),
}


@pytest.mark.parametrize("name", CASES)
def test_indexed_read_matches_eager(name):
    fn, make = CASES[name]
    check_against_eager(fn, *make())


@pytest.mark.parametrize("name", ["gather_dim1", "index_select", "embedding", "index_rows", "index_negative"])
def test_out_of_range_index_raises(name):
    fn, make = CASES[name]
    table, index = make()
    bad = index.clone()
    bad.view(-1)[-1] = 1000
    with pytest.raises(IndexError, match="out of bounds"):
        tjit.compile(fn)(table, bad)
    # the same compiled function still works (and the error state was reset)
    cf = tjit.compile(fn)
    with pytest.raises(IndexError):
        cf(table, bad)
    check_against_eager(fn, table, index, compiled=cf)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_cross_entropy(reduction, ignore_index):
    fn = lambda x, t: F.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction)  # noqa: E731
    x, t = torch.randn(6, 10), _rows(6, 10)
    t[1] = 2
    check_against_eager(fn, x, t)


def test_cross_entropy_long_rows_is_looped():
    fn = lambda x, t: F.cross_entropy(x, t)  # noqa: E731
    check_against_eager(fn, torch.randn(2, 5000), _rows(2, 5000))


def test_cross_entropy_all_ignored_is_nan_as_eager():
    fn = lambda x, t: F.cross_entropy(x, t, ignore_index=3)  # noqa: E731
    check_against_eager(fn, torch.randn(3, 5), torch.full((3,), 3))


def test_cross_entropy_rows_fuse_with_their_gather():
    """log_softmax's row max and sum and the gathered logit stay in one kernel."""
    fn = lambda x, t: F.cross_entropy(x, t, reduction="none")  # noqa: E731
    x, t = torch.randn(6, 10), _rows(6, 10)
    cf = check_against_eager(fn, x, t)
    assert len(tjit.explain(cf, x, t).kernels) == 1


@pytest.mark.parametrize("fn, make", [
    # a one-element index: the index is a scalar while the table's view is a block
    (lambda x, i: x[i % x.shape[0]] + 1, lambda: (torch.randn(3, 35), torch.randint(0, 50, (1,)))),
    # a gathered value that varies along a reduced axis, inside a reduction's kernel
    (lambda x, i: x[::2].norm(dim=0, keepdim=True).amax(0, keepdim=True)[i % 1].mean(1),
     lambda: (torch.randn(5, 19), torch.randint(0, 50, (4,)))),
    (lambda x, i: torch.gather(x, 1, i.view(1, -1).expand(x.shape[0], -1) % x.shape[1]).softmax(1),
     lambda: (torch.randn(6, 9), torch.randint(0, 50, (7,)))),
])
def test_gathers_whose_index_and_table_vary_differently(fn, make):
    check_against_eager(fn, *make())


def test_gather_along_a_broadcast_axis_still_checks_its_index():
    fn = lambda b, t: torch.gather(b.expand(4, 6), 0, t) * 2  # noqa: E731
    b, t = torch.randn(6), torch.randint(0, 4, (3, 6))
    check_against_eager(fn, b, t)
    with pytest.raises(IndexError, match="out of bounds"):
        tjit.compile(fn)(b, t + 10)


def test_a_gathered_row_joins_the_reduction_kernel_of_its_rows():
    fn = lambda x, i: (x.softmax(1), torch.gather(x, 1, i) * 2)  # noqa: E731
    x, i = torch.randn(6, 40), torch.randint(0, 40, (6, 1))
    cf = check_against_eager(fn, x, i)
    assert len(tjit.explain(cf, x, i).kernels) == 1

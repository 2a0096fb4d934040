"""In-place writes into an intermediate through one view while other views of its storage
are read later (circular pad, quantile, instance norm's running statistics): every later read
of any view sees the write, every earlier read the values before it, as in eager."""
import pytest
import torch
import torch.nn.functional as F

import tjit

from helpers import check_against_eager


def write_a_slice_read_the_whole(x):
    y = x * 2
    y[:, 1:4].mul_(0)
    return y.sum(1), y.t() + 1


def reads_before_and_after_several_writes(x):
    y = x + 1
    a = y[0] * 1  # before the writes: the old row
    y[0].copy_(y[1])
    b = y.sum(0)
    y[2:].add_(a)
    return a, b, y


def write_through_a_transposed_view(x):
    base = x + 1
    y = base.t()
    y[0].fill_(7)
    return base * 2, y[1:].sum(0)


def write_then_read_through_a_reshape(x):
    y = x.exp()
    flat = y.view(-1)
    flat[::3].zero_()
    return y.sum(1), flat[1::3] * 2


PROGRAMS = {
    # positive inputs: long row sums that do not cancel, within tolerance in any order
    "slice": (write_a_slice_read_the_whole, lambda: (torch.rand(70, 1100) + 0.5,)),
    "several": (reads_before_and_after_several_writes, lambda: (torch.randn(5, 1301),)),
    "transposed": (write_through_a_transposed_view, lambda: (torch.randn(1030, 7),)),
    "reshape": (write_then_read_through_a_reshape, lambda: (torch.randn(33, 65),)),
    "pad_circular_1d": (lambda x: F.pad(x, (3, 5), mode="circular") * 2, lambda: (torch.randn(2, 3, 1500),)),
    "pad_circular_2d": (lambda x: F.pad(x, (1, 2, 2, 1), mode="circular"), lambda: (torch.randn(2, 3, 40, 37),)),
    "pad_circular_int": (lambda x: F.pad(x, (1, 1), mode="circular"), lambda: (torch.randint(-9, 9, (4, 3, 9)),)),
    "quantile": (lambda x: torch.quantile(x, 0.3, dim=1), lambda: (torch.randn(50, 1201),)),
    "quantile_of_many": (lambda x, q: torch.quantile(x, q, dim=0, keepdim=True), lambda: (torch.randn(31, 9),
                                                                                          torch.rand(4))),
    "nanquantile": (lambda x: torch.nanquantile(x.masked_fill(x > 1, float("nan")), 0.75, dim=-1),
                    lambda: (torch.randn(7, 301),)),
    "instance_norm_running_stats": (lambda x, m, v: F.instance_norm(x, m, v, use_input_stats=True, momentum=0.3),
                                    lambda: (torch.randn(4, 3, 50), torch.randn(3), torch.rand(3) + 0.5)),
    "fp16": (write_a_slice_read_the_whole, lambda: (torch.rand(9, 1030, dtype=torch.float16) + 0.5,)),
    "empty": (write_a_slice_read_the_whole, lambda: (torch.randn(0, 6),)),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_writes_into_an_intermediate_through_a_view_match_eager(name, fresh_seed):
    fn, make = PROGRAMS[name]
    check_against_eager(fn, *make())


def test_resize_of_an_intermediate_to_fewer_elements(fresh_seed):
    check_against_eager(lambda x: (x * 2).resize_(3, 5) + 1, torch.randn(4, 6))
    check_against_eager(lambda x: (x.t() * 2).resize_(12) + 1, torch.randn(3, 4))


def test_resize_of_an_input_is_refused_before_it_runs():
    x = torch.randn(3, 4)
    before = x.clone()
    with pytest.raises(tjit.UnsupportedOpError, match="resize_.*shape of an input"):
        tjit.compile(lambda x: x.resize_(2, 3))(x)
    assert x.shape == (3, 4) and torch.equal(x, before)


@pytest.mark.parametrize("name", ["slice", "several", "pad_circular_2d"])
def test_gradients_through_writes_into_an_intermediate(name, fresh_seed):
    fn, make = PROGRAMS[name]
    (x,) = make()
    w = [torch.randn(r.shape) for r in torch.utils._pytree.tree_leaves(fn(x))]

    def loss(x):
        return sum((r * k).sum() for r, k in zip(torch.utils._pytree.tree_leaves(fn(x)), w))
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    tjit.compile(loss)(ours).backward()
    loss(theirs).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-4)

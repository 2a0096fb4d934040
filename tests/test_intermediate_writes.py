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


def gates_written_in_place(x, w):
    """A GRU cell's decomposition: chunks of one matmul's result updated in place."""
    g = x @ w
    k = g.shape[1] // 3
    r, z, n = g[:, :k], g[:, k:2 * k], g[:, 2 * k:]  # (eager's autograd refuses in-place writes into chunk's views)
    r.add_(x[:, :1]).sigmoid_()
    z.sigmoid_()
    n.mul_(r)
    return g * 2, (1 - z) * n.tanh()


def gate_updates(x, w):
    """Updates of a matmul's chunks that eager's autograd accepts (none saves a view of it)."""
    g = x @ w
    k = g.shape[1] // 3
    g[:, :k].add_(x[:, :1])
    g[:, k:2 * k].mul_(3)
    g[:, 2 * k:].copy_(g[:, :k] * 2)
    return g.sigmoid(), g[:, k:].amax(1)  # (amax: exact in any order; a 1400-long sum is not)


def boxes_of_a_3d_intermediate(x):
    y = x * 1.5 + 0.25
    y[1:3, 5:20, 10:40].mul_(-2)
    y[:, 2].add_(1)  # a select: a box of size 1 on one axis
    y[..., -1:].zero_()
    return y.sum(2), y[:, 1:] * 3


def write_through_a_wrapping_stride(x):
    y = x * 2 + 1  # (saves nothing for backward: eager's autograd allows the write)
    flat = y.view(-1)
    flat[::7].zero_()  # 2145 elements: no dense shape has these as a box
    return y.sum(1), flat[1::7] * 2


PROGRAMS = {
    "gates": (gates_written_in_place, lambda: (torch.randn(40, 30), torch.randn(30, 3 * 700) / 5)),
    "gate_updates": (gate_updates, lambda: (torch.randn(40, 30), torch.randn(30, 3 * 700) / 5)),
    "boxes_3d": (boxes_of_a_3d_intermediate, lambda: (torch.randn(4, 30, 50),)),
    "wrapping_stride": (write_through_a_wrapping_stride, lambda: (torch.randn(33, 65),)),
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
    with pytest.raises(tjit.UnsupportedOpError, match="resize_.*shape of argument x"):
        tjit.compile(lambda x: x.resize_(2, 3))(x)
    assert x.shape == (3, 4) and torch.equal(x, before)


@pytest.mark.parametrize("name", ["slice", "several", "pad_circular_2d", "gate_updates", "boxes_3d",
                                  "wrapping_stride"])
def test_gradients_through_writes_into_an_intermediate(name, fresh_seed):
    fn, make = PROGRAMS[name]
    args = make()
    w = [torch.randn(r.shape) for r in torch.utils._pytree.tree_leaves(fn(*args))]

    def loss(*args):
        return sum((r * k).sum() for r, k in zip(torch.utils._pytree.tree_leaves(fn(*args)), w))
    ours, theirs = [a.clone().requires_grad_() for a in args], [a.clone().requires_grad_() for a in args]
    tjit.compile(loss)(*ours).backward()
    loss(*theirs).backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["slice", "gates", "gate_updates", "boxes_3d", "several", "reshape"])
def test_a_write_through_a_box_of_the_storage_is_a_kernel(name):
    """A view that is a box of the storage seen as a dense array (a slice with step 1 on each
    axis, a chunk, a select) is written by a kernel (a select between the old contents and
    the new values), not by a library call that copies the whole storage first. (Not yet
    where a gradient flows through the write: see storage_after_write.)"""
    fn, make = PROGRAMS[name]
    calls = [str(c) for c in tjit.explain(fn, *make()).library_calls]
    assert not any("write_through_view" in c for c in calls), calls


def test_a_write_through_a_view_that_is_no_box_is_a_library_call():
    """flat[::7] of 2145 elements is no box of the storage (flat[::3] is: the first column of
    a [715, 3] array): a library call writes it (checked against eager)."""
    fn, make = PROGRAMS["wrapping_stride"]
    calls = [str(c) for c in tjit.explain(fn, *make()).library_calls]
    assert any("write_through_view" in c for c in calls), calls
    check_against_eager(fn, *make())


@pytest.mark.parametrize("name, calls", [("gate_updates", set()), ("wrapping_stride", {"write_through_view"})])
def test_the_gradient_of_a_write_through_a_view_is_not_the_write_run_again(name, calls):
    """The backward of a write through a view zeroes the view in the incoming gradient (kernels
    for a box, the same write of zeros as a call otherwise) and reads the written values'
    gradient through the view; torch's derivative of the write is not run as a call."""
    fn, make = PROGRAMS[name]
    args = [a.requires_grad_() for a in make()]
    backward = tjit.explain(lambda *a: sum(r.sum() for r in torch.utils._pytree.tree_leaves(fn(*a))), *args).backward
    # (a weight read by several products gets their gradients summed by addmm calls)
    assert {c.op for c in backward.library_calls} - {"aten.mm.default", "aten.addmm.default"} == calls

"""Where library calls' results live: an op with an out= form writes the results the steps
after it read into the slab (planned by liveness like any intermediate); a returned result
gets memory of its own; an op without one allocates its results itself. Against eager at
sizes that span many Triton programs, with the slab poisoned before every call."""
import pytest
import torch
import torch.nn.functional as F

import tjit
from tjit.lower.library import out_overload

from helpers import check_against_eager

# these tests use matrix products as their library calls
pytestmark = pytest.mark.usefixtures("library_matmuls")

aten = torch.ops.aten


def program(cf):
    return next(reversed(cf._cache.values())).executable.program


def slab_keys(prog) -> set:
    return {b.key for b in prog.slab_buffers}


@pytest.mark.parametrize("functional, out, names", [
    (aten.mm.default, aten.mm.out, ("out",)),
    (aten.sort.stable, aten.sort.values_stable, ("values", "indices")),
    (aten.max.dim, aten.max.dim_max, ("max", "max_values")),
    (aten.convolution.default, aten.convolution.out, ("out",)),
])
def test_the_out_form_of_an_op_is_found_by_its_schema(functional, out, names):
    assert out_overload(functional) == (out, names)


def test_ops_without_an_out_form_have_none():
    assert out_overload(aten._scaled_dot_product_flash_attention_for_cpu.default) is None
    assert out_overload(aten.split.Tensor) is None  # a list of views: no out tensors to hand it


def test_a_matmul_read_by_a_kernel_writes_into_the_slab(fresh_seed):
    f = lambda x, w, y: torch.relu(x @ w) + y  # noqa: E731
    x, w, y = torch.randn(70, 50), torch.randn(50, 130), torch.randn(70, 130)
    cf = check_against_eager(f, x, w, y)
    prog = program(cf)
    (call,) = prog.library_calls
    assert call.out_form is aten.mm.out
    assert {("buffer", id(r)) for r in call.in_slab} == {("buffer", id(r)) for r in call.results} <= slab_keys(prog)
    # a second call reuses the slab the first one's result lived in, and still matches
    check_against_eager(f, torch.randn(70, 50), torch.randn(50, 130), torch.randn(70, 130), compiled=cf)


def test_one_result_of_a_sort_lives_in_the_slab_the_other_in_memory_of_its_own(fresh_seed):
    # (out= code may take other paths when its results share a storage: linalg_qr.out fails)
    def f(x):
        values, indices = torch.sort(2 * x + 1, dim=1)
        return torch.exp(values) * indices
    cf = check_against_eager(f, torch.randn(40, 300))
    (call,) = program(cf).library_calls
    assert len(call.in_slab) == 1 and len(call.torch_allocated) == 1


def test_results_of_a_qr_do_not_share_a_storage(fresh_seed):
    f = lambda x: [t * 2 for t in torch.linalg.qr(x @ x.t())]  # noqa: E731
    check_against_eager(f, torch.randn(30, 20))


def test_a_channels_last_convolution_result_lives_in_the_slab_in_its_layout(fresh_seed):
    x = torch.randn(2, 3, 40, 40).to(memory_format=torch.channels_last)
    w = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
    cf = check_against_eager(lambda x, w: F.conv2d(x, w).sigmoid().sum((2, 3)), x, w)
    (call,) = program(cf).library_calls
    assert call.in_slab and not call.results[0].view.is_contiguous()


def _product_and_row_sums(a, b):
    m = a @ b
    return m, m.sum(1)


def test_a_returned_result_gets_memory_of_its_own_each_call(fresh_seed):
    a, b = torch.rand(60, 40), torch.rand(40, 70)  # positive: row sums that do not cancel
    cf = tjit.compile(_product_and_row_sums)
    first = cf(a, b)
    kept = first[0].clone()
    check_against_eager(_product_and_row_sums, torch.rand(60, 40), torch.rand(40, 70), compiled=cf)
    torch.testing.assert_close(first[0], kept, rtol=0, atol=0)  # the next call wrote elsewhere
    (call,) = program(cf).library_calls
    assert call.out_form is aten.mm.out and not call.in_slab


def test_the_slab_holds_the_results_of_a_chain_of_calls(fresh_seed):
    def f(x, w1, w2, w3):
        h = torch.tanh(x @ w1)
        h = torch.relu(h @ w2) * 2
        return (h @ w3).softmax(-1)
    # weights scaled by 1/sqrt(fan-in), as a model's: unscaled, the logits reach the hundreds
    # and a tanh one ulp from eager's moved a softmax output past the tolerance (1 seed in ~60)
    args = torch.randn(90, 64), torch.randn(64, 96) / 8, torch.randn(96, 80) / 10, torch.randn(80, 40) / 9
    cf = check_against_eager(f, *args)
    prog = program(cf)
    in_slab = [r for call in prog.library_calls for r in call.in_slab]
    assert len(in_slab) == 3  # each matmul's result is read by a kernel after it
    assert {("buffer", id(r)) for r in in_slab} <= slab_keys(prog)
    # (how close the slab comes to its lower bound is the memory benchmark's business: the
    # planner's search has a time budget, which a loaded machine may cut short)


def test_an_op_without_an_out_form_is_allocated_by_torch_and_explain_says_so(fresh_seed):
    f = lambda x: (x * 2).to(torch.complex64).sqrt().abs() + 1  # noqa: E731 (_to_copy has no out= form)
    x = torch.randn(50, 70)
    check_against_eager(f, x)
    ex = tjit.explain(f, x)
    assert [c.op for c in ex.library_calls][0] == "aten._to_copy.default"
    assert "no out= form tjit can use: torch allocates its results" in str(ex)


def test_explain_names_the_out_form_a_call_writes_through(fresh_seed):
    x, w = torch.randn(30, 20), torch.randn(20, 10)
    text = str(tjit.explain(lambda x, w: (x @ w).relu(), x, w))
    assert "through aten.mm.out: 1 result(s) into the slab" in text


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_typed_results_in_the_slab(dtype, fresh_seed):
    if dtype.is_floating_point:
        a, b = torch.randn(33, 40).to(dtype), torch.randn(40, 70).to(dtype)
    else:
        a, b = torch.randint(-5, 5, (33, 40)), torch.randint(-5, 5, (40, 70))
    cf = check_against_eager(lambda a, b: (a @ b) * 3 + 1, a, b)
    assert program(cf).library_calls[0].in_slab


def test_zero_size_results(fresh_seed):
    cf = check_against_eager(lambda a, b: torch.relu(a @ b) + 1, torch.randn(0, 30), torch.randn(30, 10))
    assert program(cf).library_calls[0].out_form is aten.mm.out


def test_gradients_through_calls_that_write_into_the_slab(fresh_seed):
    x = torch.randn(70, 50, requires_grad=True)
    w = torch.randn(50, 130, requires_grad=True)
    # (what is sorted is the call's result, the same bits as eager's: a value computed by a
    # kernel one ulp from eager's could break a near-tie the other way, and the positions'
    # cumsum weights would swap between those two elements' gradients)
    f = lambda x, w: torch.tanh(torch.sort(x @ w, 1).values).cumsum(1).sum()  # noqa: E731
    expected = torch.autograd.grad(f(x, w), (x, w))
    got = torch.autograd.grad(tjit.compile(f)(x, w), (x, w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-3)

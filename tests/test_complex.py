"""Complex and uint64 tensors: types only library calls compute. Inputs, outputs, views and
intermediates of those types never reach a kernel; the real-valued work around them still
fuses. Gradients through them: tests/test_complex_grad.py."""
import pytest
import torch

import tjit
from tjit.ir import DType

from helpers import check_against_eager


def cplx(*shape, dtype=torch.complex64):
    return torch.randn(*shape, dtype=dtype)


PROGRAMS = {
    "fft": (lambda x: torch.fft.fft(x), lambda: (torch.randn(7, 1201),)),
    "rfft_of_transposed": (lambda x: torch.fft.rfft(x.t() * 2), lambda: (torch.randn(301, 9),)),
    "irfft": (lambda x: torch.fft.irfft(torch.fft.rfft(x), n=x.shape[-1]) - x, lambda: (torch.randn(5, 1031),)),
    "fft2_abs_fuses_around": (lambda x: torch.fft.fft2(x + 1).abs() * 2 + x, lambda: (torch.randn(3, 33, 35),)),
    "conj_product": (lambda c: c * c.conj() + 1, lambda: (cplx(40, 37),)),
    "real_and_imag": (lambda c: c.real * 2 + c.imag, lambda: (cplx(1100, 3),)),
    "view_as_real_sum": (lambda c: torch.view_as_real(c).sum(-1), lambda: (cplx(50, 41),)),
    "view_as_complex": (lambda x: torch.view_as_complex(x.view(x.shape[0], -1, 2)) * (1 + 2j),
                        lambda: (torch.randn(30, 42),)),
    "views_of_a_complex_input": (lambda c: (c.t()[1], c[:, ::2].t()), lambda: (cplx(9, 11),)),
    "complex128": (lambda c: (c * c).sum(0), lambda: (cplx(17, 5, dtype=torch.complex128),)),
    "to_complex": (lambda x: x.cfloat() * 1j + x.cdouble().real.float(), lambda: (torch.randn(20, 3),)),
    "chalf": (lambda x: x.chalf(), lambda: (torch.randn(20, 3),)),
    "polar": (lambda a, t: torch.polar(a, t), lambda: (torch.rand(7, 9), torch.randn(7, 9))),
    "write_a_row_of_a_complex_intermediate": (lambda c: _row_write(c), lambda: (cplx(6, 37),)),
    "write_a_whole_complex_intermediate": (lambda c: (c * 2).mul_(1j) + 1, lambda: (cplx(6, 37),)),
    "empty": (lambda c: c * 2, lambda: (cplx(0, 5),)),
    # view_as_real of a broadcast input, laid out with a stride 0 (copy_ refused the layout)
    "logaddexp_of_broadcast_operands": (torch.logaddexp, lambda: (cplx(300, 1), cplx(1, 70))),
    # a lazily conjugated result of a call (svd's Vh) returned: view_as_real refused it
    "conjugated_call_result": (torch.svd, lambda: (cplx(0, 0),)),
    "hash_tensor": (lambda x: torch.hash_tensor(x * 2, dim=1), lambda: (torch.randn(9, 300),)),
}


def _row_write(c):
    d = c * 2
    first = d[0]
    d[0].mul_(3)
    return first + 1, d.sum(0)


@pytest.mark.parametrize("name", PROGRAMS)
def test_programs_with_complex_and_uint64_values_match_eager(name, fresh_seed):
    fn, make = PROGRAMS[name]
    check_against_eager(fn, *make())


@pytest.mark.parametrize("fn", [torch.conj, lambda c: c.mH, lambda c: (c.conj().t(), c), torch._neg_view],
                         ids=["conj", "mH", "conj_t_and_itself", "neg_view"])
def test_a_lazily_conjugated_view_of_an_input_keeps_its_bit(fn):
    """conj() of an input returns a view with the conjugate bit, as eager's (it was returned
    without it: the input's values, unconjugated)."""
    c = cplx(40, 37)
    for got, expected in zip(torch.utils._pytree.tree_leaves(tjit.compile(fn)(c)),
                             torch.utils._pytree.tree_leaves(fn(c))):
        assert (got.is_conj(), got.is_neg()) == (expected.is_conj(), expected.is_neg())
        assert got.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
        assert torch.equal(got.resolve_conj().resolve_neg(), expected.resolve_conj().resolve_neg())


def test_complex_outputs_have_eagers_layout(fresh_seed):
    c = cplx(9, 11)
    got, expected = tjit.compile(lambda c: (c * 2).t())(c), (c * 2).t()
    assert got.dtype == torch.complex64 and got.stride() == expected.stride()
    torch.testing.assert_close(got, expected)


def test_real_work_around_a_complex_call_still_fuses(fresh_seed):
    x = torch.randn(30, 64)
    cf = check_against_eager(lambda x: torch.fft.rfft(x * 2 + 1).abs().sum(1), x)
    before, calls = tjit.counters.launches, tjit.counters.library_calls
    cf(x)
    # the call, its abs (a call: it reads complex values), one kernel before and one after
    assert (tjit.counters.launches - before, tjit.counters.library_calls - calls) == (2, 2)


def test_no_kernel_is_generated_for_a_library_only_type():
    for dtype in (DType.complex64, DType.complex128, DType.complex32, DType.uint64):
        with pytest.raises(tjit.UnsupportedOpError, match="library calls only"):
            dtype.triton


def test_a_write_into_a_complex_input_is_refused():
    c = cplx(4, 3)
    with pytest.raises(tjit.UnsupportedOpError, match="complex64 input"):
        tjit.compile(lambda c: c.mul_(2))(c)


@pytest.mark.parametrize("write", [lambda z: z.real.mul_(3), lambda z: z.diagonal().real.zero_()],
                         ids=["real_mul_", "diagonal_real_zero_"])
def test_a_write_through_a_real_view_of_a_complex_intermediate_is_refused_by_name(write):
    """(it failed inside as_strided with a RuntimeError: the view counts in float units)"""
    def fn(c):
        z = c * 2
        write(z)
        return z.abs()
    with pytest.raises(tjit.UnsupportedOpError, match="float32 view of a torch.complex64 intermediate"):
        tjit.compile(fn)(cplx(5, 3))


def test_a_write_into_an_input_also_read_as_another_dtype_is_refused():
    def f(x):
        c = torch.view_as_complex(x.view(4, 3, 2))
        x.mul_(2)
        return c
    with pytest.raises(tjit.UnsupportedOpError, match="another dtype"):
        tjit.compile(f)(torch.randn(4, 6))


# (gradients through complex values, refused before: tests/test_complex_grad.py)


def test_complex_work_without_gradients_beside_a_differentiated_value(fresh_seed):
    """Complex values on inputs that need no gradient do not stop the rest from differentiating."""
    x, y = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8)
    ours = x.detach().clone().requires_grad_()
    f = lambda x, y: (x * torch.fft.rfft(y, n=14).abs()).sum()  # noqa: E731
    f(x, y).backward()
    tjit.compile(f)(ours, y).backward()
    torch.testing.assert_close(ours.grad, x.grad)


def test_a_kernel_that_would_copy_a_complex_value_is_refused_by_name():
    """A plain copy converts nothing, so no dtype check of codegen's met it: the kernel failed
    in Triton's argument handling (KeyError 'complex64'). Any kernel access of a type only
    library calls compute is refused."""
    from tjit.ir import Contiguous, GraphBuilder, View, ViewOp
    from tjit.pipeline import build_program
    b = GraphBuilder()
    z = b.input("z", DType.complex64, View.contiguous((4, 6)))
    transposed = b.node(ViewOp(), DType.complex64, (z,), View((6, 4), (1, 6)))
    copy = b.node(Contiguous(), DType.complex64, (transposed,), View.contiguous((6, 4)))
    graph = b.finish(["z"], {"out0": copy})
    with pytest.raises(tjit.UnsupportedOpError, match="complex64.*library calls only"):
        build_program(graph, {"out0": (4, 1)}, device="cpu")

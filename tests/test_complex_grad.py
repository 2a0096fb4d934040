"""Gradients through complex values against eager's (torch's convention: the conjugate
Wirtinger derivative torch.autograd gives). Complex values are computed by library calls
only, and so are their gradients (autograd/complex.py): real losses of complex
intermediates, complex results, complex inputs that require grad, views of complex values,
several uses of one complex value."""
import pytest
import torch

import tjit

C = torch.complex64


def gradients(fn, args, compiled=None, seed=5):
    """fn's results and the gradients of its inputs that require grad, for fixed random
    cotangents (complex for complex results)."""
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = (compiled or fn)(*leaves)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    g = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, dtype=C if o.is_complex() else torch.float32, generator=g).to(o.dtype)
                  for o in outs]
    grads = torch.autograd.grad(outs, [a for a in leaves if a.requires_grad], cotangents)
    return [o.detach() for o in outs], list(grads)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.complex128 if t.is_complex() else torch.float64).requires_grad_(t.requires_grad)


def check(fn, *args, atol=1e-5, rtol=1.3e-6):
    """Results and gradients as eager's: within the tolerances, or (sums in another order: a
    gradient's contributions, a formula's terms) as close to eager's float64 answer as eager's
    float32 one is (at most 1.5 times eager's worst error)."""
    expected = gradients(fn, args)
    before = tjit.counters.library_calls
    got = gradients(fn, args, tjit.compile(fn))
    assert tjit.counters.library_calls > before  # (the complex work ran as calls)
    reference = None
    for j, (what, gs, es) in enumerate(zip(("result", "gradient"), got, expected)):
        assert len(gs) == len(es)
        for k, (g, e) in enumerate(zip(gs, es)):
            assert g.dtype == e.dtype and g.shape == e.shape, \
                f"{what} {k}: {g.dtype} {g.shape}, eager's {e.dtype} {e.shape}"
            try:
                torch.testing.assert_close(g, e, atol=atol, rtol=rtol)
            except AssertionError:
                reference = reference or gradients(fn, [_wide(a) for a in args])
                r = reference[j][k]
                error = lambda t: (t.to(r.dtype) - r).abs().max().item()  # noqa: E731
                assert error(g) <= 1.5 * error(e), f"{what} {k}: tjit's error {error(g)}, eager's {error(e)}"


def real(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def cplx(*shape, seed=0):
    return torch.randn(*shape, dtype=C, generator=torch.Generator().manual_seed(seed)).requires_grad_()


REAL_INPUT = {
    # a real loss of a complex intermediate, with real work around the calls (fused kernels)
    "rfft_abs_sum": (lambda x: torch.fft.rfft(x * 2 + 1).abs().sum(), [(8, 3000)]),
    "rfft_abs_exp": (lambda x: (torch.fft.rfft(x.tanh(), dim=0).abs() * 0.01).exp(), [(300, 7)]),
    "view_as_real_fft": (lambda x: torch.view_as_real(torch.fft.fft(x)) * 2, [(16, 520)]),
    "complex_result": (lambda x: torch.fft.fft(x * 3), [(4000,)]),
    "fft_roundtrip": (lambda x, w: torch.fft.irfft(torch.fft.rfft(x) * w, n=x.shape[-1]).sigmoid(),
                      [(6, 1000), (501,)]),
    "fft2_real_imag": (lambda x: torch.fft.fft2(x).real * torch.fft.fft2(x).imag, [(3, 40, 50)]),
    "slice_of_fft": (lambda x: torch.fft.fft(x)[:, 3:900:2].abs(), [(5, 2000)]),
    "transposed_fft": (lambda x: torch.fft.fft(x, dim=0).t().angle(), [(64, 70)]),
    "one_value_used_twice": (lambda x: (torch.fft.fft(x) * torch.fft.fft(x).conj() + torch.fft.fft(x)).abs(),
                             [(1500,)]),
    "hfft": (lambda x: torch.fft.hfft(x.to(C) * 2, n=300), [(151,)]),
    "stft": (lambda x: torch.stft(x, 64, hop_length=16, window=torch.hann_window(64), return_complex=True).abs(),
             [(2, 2000)]),
    "view_as_complex": (lambda x: torch.view_as_complex(x).t().abs() * torch.view_as_complex(x).angle().t(),
                        [(30, 40, 2)]),
    "complex_of_parts": (lambda a, b: torch.complex(a, b.exp()).abs(), [(5000,), (5000,)]),
    "polar": (lambda a, b: torch.fft.ifft(torch.polar(a.abs(), b)).real, [(5, 700), (5, 700)]),
    "flipped": (lambda x: torch.fft.fft(x).flip(0).abs(), [(2000,)]),
    "cat_of_complex": (lambda x: torch.cat([torch.fft.fft(x), torch.fft.fft(x * 2)]).abs(), [(1500,)]),
    "sum_of_complex": (lambda x: torch.fft.fft(x).sum(0).abs(), [(20, 300)]),
    "eig_values": (lambda a: torch.linalg.eig(a).eigenvalues.abs(), [(3, 6, 6)]),
    # |v| of an eigenvector does not depend on its phase: a well-defined loss (eager's
    # backward refuses one that does)
    "eig_vectors": (lambda a: torch.linalg.eig(a).eigenvectors.abs().sum(-2), [(4, 5, 5)]),
}


@pytest.mark.parametrize("name", REAL_INPUT)
def test_gradient_through_complex_intermediates(name):
    fn, shapes = REAL_INPUT[name]
    check(fn, *[real(*s, seed=k) for k, s in enumerate(shapes)])


COMPLEX_INPUT = {
    "abs": (lambda z: (z * z).abs(), [(5000,)]),
    "ifft": (lambda z: torch.fft.ifft(z), [(7, 600)]),
    "irfft": (lambda z: torch.fft.irfft(z, n=1000) * 2, [(3, 501)]),
    "view_as_real": (lambda z: torch.view_as_real(z).sin(), [(3000,)]),
    "product_of_two": (lambda z, w: (z * w.conj()).real.sum(0), [(40, 90), (40, 90)]),
    "strided_view": (lambda z: z[1::2, ::3].t().abs() + z[0].abs().sum(), [(9, 1200)]),
    "real_and_imag": (lambda z: z.real * z.imag.sin(), [(3000,)]),
    "conj": (lambda z: torch.view_as_real(z.conj() * 3), [(2000,)]),
    "returned_as_it_is": (lambda z: (z, z.abs()), [(1200,)]),
    "svdvals": (lambda z: torch.linalg.svdvals(z), [(3, 5, 4)]),
    # its backward formula writes through a real view of a complex intermediate, which tjit
    # refuses by name, so torch's backward runs it (a RuntimeError from as_strided before);
    # q = the rank: the values do not depend on the random projection it draws
    "svd_lowrank": (lambda z: torch.svd_lowrank(z, q=6)[1], [(40, 6)]),
    "mixed_real_and_complex": (lambda z, x: torch.fft.fft(x) * z, [(2500,), (2500,)]),
}


@pytest.mark.parametrize("name", COMPLEX_INPUT)
def test_gradient_of_complex_inputs(name):
    fn, shapes = COMPLEX_INPUT[name]
    args = [cplx(*s, seed=k) for k, s in enumerate(shapes)]
    if name == "mixed_real_and_complex":
        args[1] = real(*shapes[1], seed=9)
    check(fn, *args)


def test_complex_input_without_gradient_and_real_input_with_one():
    z = torch.randn(3000, dtype=C, generator=torch.Generator().manual_seed(3))
    check(lambda x, z: (torch.fft.fft(x) * z).abs(), real(3000), z)


def test_saved_eigenvectors_are_read_in_their_own_layout():
    """linalg.eig's eigenvectors are column-major: the backward reads the saved result in the
    layout its formula was traced for (a contiguous copy would need a kernel that copies complex
    values, and reading it as contiguous would transpose it)."""
    a = real(6, 6, seed=4)
    vectors = torch.linalg.eig(a.detach()).eigenvectors
    assert vectors.stride() != (6, 1)  # (what the test is about)
    check(lambda a: torch.linalg.eig(a * 2).eigenvectors.abs() * 3, a)


def _svd_product(z):
    u, s, vh = torch.linalg.svd(z, full_matrices=False)
    return torch.view_as_real(u @ torch.diag_embed(s).to(z.dtype) @ vh)


@pytest.mark.parametrize("fn, make", [
    (lambda a: torch.view_as_real(torch.linalg.eig(a).eigenvectors), lambda: real(6, 6)),
    (lambda z: torch.view_as_real(torch.linalg.eigh(z @ z.mH).eigenvectors), lambda: cplx(5, 4)),
    (lambda z: torch.view_as_real(torch.linalg.svd(z, full_matrices=False).U), lambda: cplx(5, 4)),
], ids=["eig", "eigh", "svd"])
def test_a_loss_that_depends_on_the_phase_of_complex_vectors_raises_as_eager(fn, make):
    """torch's derivative checks that the loss does not depend on the vectors' phases only on
    real tensors (not on the fake ones its formula is traced on): the gradient is torch's
    backward run as one call, which raises eager's error rather than giving a gradient."""
    a = make()
    with pytest.raises(RuntimeError, match="specified up to multiplication by e\\^{i phi}"):
        gradients(fn, [a])
    with pytest.raises(RuntimeError, match="specified up to multiplication by e\\^{i phi}"):
        gradients(fn, [a], tjit.compile(fn))


@pytest.mark.parametrize("name", ["svd_product", "eig_both"])
def test_phase_invariant_losses_of_several_results_match_eager(name):
    """The check reads the gradients of U and Vh together (U's and Vh's phases cancel in
    U S Vh): the results' gradients are one call of torch's backward, not one per result."""
    fn, arg = {
        "svd_product": (_svd_product, cplx(3, 7, 5)),
        "eig_both": (lambda a: (torch.linalg.eig(a).eigenvectors.abs().sum(0) * torch.linalg.eig(a).eigenvalues).abs(),
                     real(7, 7)),
    }[name]
    check(fn, arg)

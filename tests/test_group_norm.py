"""Group norm of a 16-bit input with float32 weight and bias on the CPU, as a convolution's
output meets a GroupNorm under torch.autocast: eager accepts the mix, but the op's meta
function gives its mean and rstd the input's type where the CPU kernel writes float32, so
the op run as a library call failed (frontend/decompositions.py: it is torch's decomposition
now, computed in float32). Output and gradients against eager, on fresh random inputs."""
import pytest
import torch
import torch.nn.functional as F

import tjit

from helpers import assert_as_accurate_as_eager


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,groups", [((2, 8, 4, 4), 2), ((3, 12, 37, 29), 4)], ids=["small", "several_programs"])
def test_a_16_bit_input_with_float32_parameters_matches_eager(dtype, shape, groups, fresh_seed):
    def f(x, w, b):
        return F.group_norm(x, groups, w, b)
    channels = shape[1]
    x, w, b = torch.randn(shape).to(dtype) * 2 + 1, torch.rand(channels) + 0.5, torch.randn(channels)
    cotangent = torch.randn(shape).to(dtype)

    def run(fn, *args):
        args = [a.detach().clone().requires_grad_() for a in args]
        y = fn(*args)
        return [y.detach()] + list(torch.autograd.grad(y, args, cotangent.to(y.dtype)))
    ours, eager = run(tjit.compile(f), x, w, b), run(f, x, w, b)
    exact = run(f, x.double(), w.double(), b.double())
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for name, got, expected, want in zip(("output", "x grad", "weight grad", "bias grad"), ours, eager, exact):
        assert_as_accurate_as_eager(got, expected, want, rtol=tol, atol=tol, msg=name)


def test_under_autocast_through_torch_compile(fresh_seed):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(2, 8))
    x = torch.randn(2, 3, 9, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = torch.compile(model, backend="tjit")(x), model(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=8e-3, atol=8e-3)

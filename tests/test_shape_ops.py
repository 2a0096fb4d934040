"""Shape ops as index arithmetic inside the fused kernels (arange, cat/stack, constant_pad_nd,
roll, tril/triu, repeat, indexing with several index tensors): values, kernel counts and
gradients against eager, under every axis mapping."""
import pytest
import torch
import torch.nn.functional as F

import tjit
from tjit import Auto, Sequential, Thread, ThreadGroup
from helpers import assert_matches_eager, check_against_eager, launches

pytestmark = pytest.mark.usefixtures("fresh_seed")


def small_ints(*shape):
    """float32 with small integer values: sums of thousands of them are exact in any order."""
    return torch.randint(-8, 9, shape).float()


def assert_fused(fn, *args, kernels=1):
    cf = check_against_eager(fn, *args)
    ex = tjit.explain(cf, *args)
    assert not ex.library_calls, [c for c in ex.library_calls]
    assert launches(cf, *args) == kernels, [k.source for k in ex.kernels]
    return cf


def check_grads(fn, *args, atol=1e-5):
    """Outputs and the gradients of every float input against eager, for a random incoming
    gradient."""
    eager = [a.detach().clone().requires_grad_(a.dtype.is_floating_point) for a in args]
    mine = [a.detach().clone().requires_grad_(a.dtype.is_floating_point) for a in args]
    expected, got = fn(*eager), tjit.compile(fn)(*mine)
    assert_matches_eager(got.detach(), expected.detach())
    g = torch.randn_like(expected)
    want = torch.autograd.grad(expected, [a for a in eager if a.requires_grad], g)
    have = torch.autograd.grad(got, [a for a in mine if a.requires_grad], g)
    for w, h in zip(want, have):
        torch.testing.assert_close(h, w, atol=atol, rtol=1e-5)


# -- arange ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_integer_arange(dtype):
    check_against_eager(lambda: torch.arange(3, 2000, 7, dtype=dtype))
    check_against_eager(lambda: torch.arange(1500, -7, -3, dtype=torch.int64).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", [(0.1, 1000, 0.3), (-5.5, 300.2, 0.7), (3, -50, -0.37), (0.001, 3, 0.0013),
                                  (0, 70001, 1.0001)], ids=str)
def test_float_arange_is_eagers_bit_for_bit(dtype, spec):
    start, end, step = spec
    fn = lambda: torch.arange(start, end, step, dtype=dtype)  # noqa: E731
    assert torch.equal(tjit.compile(fn)(), fn())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", [torch.linspace, lambda *args, **kw: torch.logspace(*args, base=1.01, **kw)],
                         ids=["linspace", "logspace"])
def test_linspace_and_logspace_in_integer_and_16_bit_types_are_eagers_bit_for_bit(op, dtype):
    """Eager's kernel rounds a float start to the integer type and steps in the output's own
    type; torch's decomposition is exact and differed by one (integers) or up to 4%
    (bfloat16) at some points: these run as library calls."""
    signed = [(4.3, -3.0, 50), (-2.5, 90.7, 1)] if dtype != torch.uint8 else []
    for start, end, steps in [(4.3, 97.0, 50), (0, 255, 3000), *signed]:
        fn = lambda: op(start, end, steps, dtype=dtype)  # noqa: E731
        assert torch.equal(tjit.compile(fn)(), fn())


def test_arange_fuses_into_its_reader():
    x = torch.randn(3, 1537)
    assert_fused(lambda x: torch.arange(1537) * x, x)
    assert_fused(lambda x: torch.arange(0.5, 2.0, 0.5).view(-1, 1) * x, x)
    assert_fused(lambda x: (x * torch.arange(1537, 0, -1)).sum(1), torch.randint(-9, 9, (3, 1537)))  # exact sums


# -- cat and stack --------------------------------------------------------------------------------
def test_cat_fuses_into_a_reduction():
    a, b = small_ints(37, 1100), small_ints(21, 1100)  # integer values: the long sums are exact in any order
    assert_fused(lambda a, b: torch.cat([a * 2, b + 1]).sum(1), a, b)
    assert_fused(lambda a, b: torch.cat([a * 2, b + 1], 0).sum(0), a, b)


def test_one_kernel_source_serves_every_size():
    """Offsets and bounds are kernel arguments, not literals."""
    def sources(fn, *args):
        return [k.source for k in tjit.explain(fn, *args).kernels]
    cat = lambda a, b: torch.cat([a, b * 2]).exp()  # noqa: E731
    assert sources(cat, torch.randn(37, 50), torch.randn(21, 50)) == sources(cat, torch.randn(5, 50),
                                                                            torch.randn(60, 50))
    pad = lambda x: F.pad(x, (3, -1)) + 1  # noqa: E731
    assert sources(pad, torch.randn(4, 50)) == sources(pad, torch.randn(9, 77))


def test_bytes_read_count_only_the_elements_a_shifted_read_loads():
    a, b = torch.randn(37, 1100), torch.randn(21, 1100)
    (kernel,) = tjit.explain(lambda a, b: torch.cat([a, b]) * 2, a, b).kernels
    assert kernel.bytes_read == kernel.bytes_written == (37 + 21) * 1100 * 4
    (kernel,) = tjit.explain(lambda a: F.pad(a, (2, 3, -1, 1)) + 1, a).kernels
    assert kernel.bytes_read == 36 * 1100 * 4


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_cat_along_each_dim(dim):
    shapes = [[5, 7, 9], [5, 7, 9], [5, 7, 9]]
    for k, s in enumerate(shapes):
        s[dim] = [3, 1, 1029][k]
    a, b, c = (torch.randn(s) for s in shapes)
    assert_fused(lambda a, b, c: torch.cat([a, b.exp(), c], dim), a, b, c)


def test_cat_of_non_contiguous_and_broadcast_operands():
    a = torch.randn(40, 33).T  # (33, 40), transposed
    b = torch.randn(33, 1).expand(33, 7)
    c = torch.randn(33, 100)[:, ::3]
    assert_fused(lambda a, b, c: torch.cat([a, b, c], 1), a, b, c)


def test_cat_of_a_broadcast_scalar():
    """A shifted read whose address is the same for every lane (all strides 0)."""
    check_against_eager(lambda a, x: torch.cat([a.expand(1, 3), x, a.expand(2, 3)]) * 2, torch.randn(()),
                        torch.randn(4, 3))
    check_against_eager(lambda a, x: torch.gradient(x, spacing=[a], dim=(0,))[0], torch.tensor([1.1, 2.0, 3.5]),
                        torch.randn(3, 3, 3))


def test_cat_with_empty_operands():
    a, b = torch.randn(4, 5), torch.randn(3, 5)
    check_against_eager(lambda a, b: torch.cat([a, torch.empty(0, 5), b, torch.empty(0)]) + 1, a, b)
    check_against_eager(lambda a: torch.cat([a[:0], a[:0]]) + 1, a)


def test_cat_promotes_and_keeps_negative_zero_and_nan():
    a = torch.tensor([[-0.0, float("nan"), 1.5]], dtype=torch.float16).repeat(3, 1)
    b = torch.randint(-5, 5, (2, 3), dtype=torch.int32)
    out = tjit.compile(lambda a, b: torch.cat([a, b]))(a, b)
    expected = torch.cat([a, b])
    assert out.dtype == expected.dtype and torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(torch.signbit(out), torch.signbit(expected))
    check_against_eager(lambda a, b: torch.cat([a, b]), a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.bool])
def test_cat_of_small_types(dtype):
    a = torch.randn(6, 301).to(dtype)
    b = torch.randn(6, 77).to(dtype)
    check_against_eager(lambda a, b: torch.cat([b, a, b], 1), a, b)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_stack_is_one_kernel(dim):
    x, y = torch.randn(9, 131), torch.randn(9, 131)
    assert_fused(lambda x, y: torch.stack([x, y * 2, x + y], dim), x, y)


def test_views_of_a_cat():
    x, y = torch.randn(9, 13), torch.randn(9, 6)
    check_against_eager(lambda x, y: torch.cat([x, y], 1).T[::2, 1:] * 2, x, y)
    check_against_eager(lambda x, y: torch.cat([x, y], 1).flip(1).reshape(-1) + 1, x, y)
    check_against_eager(lambda x, y: torch.cat([x, y], 1)[3, :9] + torch.cat([x, y], 1)[:, 14], x, y)
    check_against_eager(lambda x, y: torch.cat([x[:, :1], y[:, :1]], 1).expand(3, 9, 2) + 1, x, y)


# -- constant_pad_nd ----------------------------------------------------------------------------
@pytest.mark.parametrize("pad", [(1, 1), (2, -3), (-1, 0, 3, 2), (0, 0, 0, 0, 1, 2), (5, 1, 0, -2, 1, 1)], ids=str)
def test_pad(pad):
    x = torch.randn(4, 6, 1031)
    assert_fused(lambda x: F.pad(x, pad, value=-2.5) * 3, x)


def test_pad_fuses_with_its_consumer():
    x, y = small_ints(7, 1100), small_ints(7, 1102)
    assert_fused(lambda x, y: F.pad(x, (1, 1)) * y, x, y)
    assert_fused(lambda x, y: F.pad(x * 2 + 1, (1, 1), value=7.0).sum(1), x, y)


def test_pad_of_integers_bools_and_16_bit_floats():
    check_against_eager(lambda x: F.pad(x, (2, 1, 1, 0), value=9), torch.randint(0, 9, (5, 7), dtype=torch.int16))
    check_against_eager(lambda x: F.pad(x, (2, 1), value=True), torch.rand(5, 7) > 0.5)
    check_against_eager(lambda x: F.pad(x, (3, -1), value=0.1), torch.randn(5, 7, dtype=torch.float16))


def test_pad_corner_cases():
    x = torch.randn(5, 7)
    check_against_eager(lambda x: F.pad(x, (-7, 2)) + 1, x)  # nothing of x is left
    check_against_eager(lambda x: F.pad(x[:, :0], (2, 1)) + 1, x)  # a zero-size input
    check_against_eager(lambda x: F.pad(F.pad(x, (1, 2), value=1.0), (0, 0, 2, 1), value=3.0) * 2, x)
    check_against_eager(lambda x: F.pad(x.T, (1, 1)).T.reshape(-1)[3:40] + 1, x)


# -- roll, tril/triu, repeat ---------------------------------------------------------------------
def test_roll_tril_triu_repeat():
    x = torch.randn(6, 19, 133)
    assert_fused(lambda x: torch.roll(x, 5, 2) * 2, x)
    assert_fused(lambda x: torch.roll(x, (-3, 7), (0, -1)) * 2, x)
    assert_fused(lambda x: torch.roll(x, 1000) * 2, x)
    for k in (-3, 0, 2, 200):
        assert_fused(lambda x: x.tril(k) + 1, x)
        assert_fused(lambda x: x.triu(k) + 1, x)
    assert_fused(lambda x: x.repeat(2, 1, 3) + 1, x)
    assert_fused(lambda x: (x * 2).repeat(2, 3, 1, 1), x)
    assert_fused(lambda x: x.permute(2, 1, 0).repeat(1, 2, 1) + 1, x)


def test_repeat_corner_cases():
    x = torch.randint(0, 100, (3, 5), dtype=torch.int32)
    check_against_eager(lambda x: x.repeat(0, 2), x)
    check_against_eager(lambda x: x[:, :0].repeat(3, 2), x)
    check_against_eager(lambda x: x[0, 0].repeat(4), x)
    check_against_eager(lambda x: x[0, 0].repeat(()), x)


# -- indexing with several index tensors --------------------------------------------------------------
def test_index_with_several_tensors():
    x = torch.randn(7, 9, 11)
    i, j, k = torch.randint(-7, 7, (5, 1)), torch.randint(-11, 11, (4,)), torch.randint(0, 9, (4,))
    assert_fused(lambda x, i, j: x[i, :, j], x, i, j)  # not adjacent: index dims first
    assert_fused(lambda x, i, k: x[i, k] * 2, x, i, k)
    assert_fused(lambda x, k, j: x[:, k, j], x, k, j)  # adjacent: in place
    assert_fused(lambda x, i, k, j: x[i, k, j], x, i, k, j)
    assert_fused(lambda x, i, j: x.transpose(0, 2)[j, :, i] + 1, x, i, j)
    assert_fused(lambda x, i, j: (x + 1)[i.int(), 3, j], x, i, j)


def test_index_out_of_range_is_an_error():
    x = torch.randn(7, 9)
    cf = tjit.compile(lambda x, i, j: x[i, j])
    for i, j in ((7, 0), (0, 9), (-8, 0)):
        with pytest.raises(IndexError, match="out of bounds"):
            cf(x, torch.tensor([0, i]), torch.tensor([1, j]))


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_padding_modes_are_indexed_reads(mode):
    x = torch.randn(2, 3, 29, 31)
    assert_fused(lambda x: F.pad(x, (2, 3, 1, 2), mode=mode), x)
    check_against_eager(lambda x: F.pad(x, (2, 3, 1, 2), mode="circular"), x)


def test_upsampling_and_unfold():
    x = torch.randn(2, 3, 17, 19)
    assert_fused(lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), x)
    assert_fused(lambda x: F.interpolate(x, size=(25, 30), mode="nearest-exact"), x)
    assert_fused(lambda x: F.unfold(x, (2, 3), padding=1), x)  # permuted coordinates reshaped: arithmetic


# -- every axis mapping ---------------------------------------------------------------------------------
STRATEGIES = [(ThreadGroup(), ThreadGroup(16)), (ThreadGroup(), Thread()), (Sequential(), Thread(2)),
              (Sequential(4), Sequential(8)), (Thread(), Sequential()), (Auto(), Thread())]


@pytest.mark.parametrize("strategies", STRATEGIES, ids=str)
def test_forced_strategies(strategies):
    x, y, i = torch.randn(13, 37), torch.randn(13, 5), torch.randint(0, 37, (13,))
    options = {"axis_strategies": {"*": strategies}}
    check_against_eager(lambda x, y: torch.cat([x, y.exp()], 1)[:, 1:] * 2, x, y, **options)
    check_against_eager(lambda x: F.pad(x, (3, -2, 1, 0), value=1.0) + torch.arange(38.), x, **options)
    check_against_eager(lambda x: x.tril(2) - 1, x, **options)
    check_against_eager(lambda x: x.repeat(1, 2)[:, 3:] + 1, x, **options)


@pytest.mark.parametrize("shape", [(3, 50), (5, 5000)])
def test_reductions_over_shifted_reads(shape):
    """Persistent and looped reductions read the shifted operands in their passes."""
    x, y = small_ints(*shape), torch.randn(shape[0], 7)
    check_against_eager(lambda x, y: torch.cat([x, y], 1).softmax(1), x, y)
    check_against_eager(lambda x: F.pad(x, (4, 1), value=-1.0).cumsum(1), x)
    check_against_eager(lambda x: (F.pad(x, (2, 2)) * torch.arange(shape[1] + 4)).sum(), x)


def test_split_reduction_over_a_cat():
    x, y = small_ints(70001), small_ints(33)
    check_against_eager(lambda x, y: torch.cat([x, y]).sum(), x, y, axis_strategies={"*": (ThreadGroup(64),)})


def test_in_place_write_of_a_shifted_read_of_itself():
    def shift(x):
        x.copy_(F.pad(x, (1, -1)) * 2)
        return x
    check_against_eager(shift, torch.randn(5000))


# -- gradients ------------------------------------------------------------------------------------------
def test_gradients():
    x, y = torch.randn(7, 9, 11), torch.randn(7, 3, 11)
    i, j = torch.randint(-7, 7, (5, 1)), torch.randint(-11, 11, (4,))
    check_grads(lambda x, y: torch.cat([x.exp(), y * 2], 1), x, y)
    check_grads(lambda x, y: torch.stack([x[:, :3], y * 3], 2).sum(0), x, y)
    check_grads(lambda x: F.pad(x, (2, -3, 1, 1)) * 2, x)
    check_grads(lambda x: F.pad(x, (1, 1), value=3.0).softmax(-1), x)
    check_grads(lambda x: x.repeat(2, 1, 3), x)
    check_grads(lambda x, i, j: x[i, :, j], x, i, j)
    check_grads(lambda x: torch.roll(x, 2, 1) * torch.arange(11.), x)
    check_grads(lambda x: x.tril(-1).triu(-3), x)
    check_grads(lambda x: F.pad(x, (2, 3, 1, 2), mode="reflect"), x)


def test_gradients_into_non_contiguous_inputs():
    x = torch.randn(11, 9, 7).permute(2, 1, 0)
    i, j = torch.randint(-7, 7, (5, 1)), torch.randint(-11, 11, (4,))
    check_grads(lambda x, i, j: x[i, :, j] * 2, x, i, j)
    check_grads(lambda x: x.repeat(2, 1, 1), x)
    check_grads(lambda x: torch.cat([x, x * 2], 1), x)
    check_grads(lambda x: F.unfold(x[None], (2, 3)), x)
    check_grads(lambda x: F.unfold(x[None], (3, 2), padding=(1, 2)), x)
    check_grads(lambda x, i: F.pad(x, (1, 2), value=0.5)[:, :, i.squeeze(1) % 14], x, i)


def test_cat_trains_in_fp16():
    x, y = torch.randn(4, 300, dtype=torch.float16), torch.randn(4, 5, dtype=torch.float16)
    check_grads(lambda x, y: torch.cat([x, y], 1).float().sum(1), x, y, atol=1e-3)

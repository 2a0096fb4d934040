"""The fusion, view, aliasing and in-place families again at sizes that need many Triton
programs (and, for reductions and scans, the looped mapping): the interpreter runs programs
one after another, so a hazard between programs or a wrong tile/loop boundary shows only
here, never at the one-program sizes most tests use."""
import random

import pytest
import torch

import tjit

from helpers import check_against_eager
from test_random_compositions import random_function

# each test runs with the programs of every launch in order and last to first (conftest.program_order)
pytestmark = pytest.mark.usefixtures("program_order")

# a pointwise program covers 1024 elements; a tile 32 x 32; a looped row steps by 1024
SHAPES = [(3, 1025), (70, 300), (5, 5000)]


def launches(fn, *args):
    before = tjit.counters.launches
    fn(*args)
    return tjit.counters.launches - before


@pytest.mark.parametrize("shape", SHAPES)
def test_a_fused_chain_over_several_programs(shape, fresh_seed):
    def chain(a, b, c):
        t = torch.sigmoid(a * b + c) - a
        u = torch.relu(t) * 0.5 - b.t().t()
        return t * 2, torch.where(u > 0, u, c.exp())
    args = [torch.randn(shape) for _ in range(3)]
    cf = check_against_eager(chain, *args)
    assert launches(cf, *args) == 1


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded", "offset", "flipped"])
def test_strided_inputs_over_several_programs(layout, fresh_seed):
    base = torch.randn(200, 300)
    x = {"transposed": base.t(), "sliced": base[1::3, ::2], "expanded": base[:1].expand(200, 300),
         "offset": base[2:, 3:], "flipped": base.flip(0)}[layout]
    cf = check_against_eager(lambda x, y: (x * y + 1, x - 1), x, torch.randn(x.shape))
    assert launches(cf, x, torch.randn(x.shape)) == 1


def test_in_place_writes_through_views_over_several_programs(fresh_seed):
    def f(x, y):
        v = x[0]
        before = x * 1
        x.add_(y)
        x[:, ::2].mul_(2)
        x[1:].sub_(y[1:])
        x.t()[0].fill_(7.0)
        x.clamp_(min=-1)
        return v * 2, before, x + 1
    check_against_eager(f, torch.randn(40, 3000), torch.randn(40, 3000))


def test_copy_with_cast_and_broadcast_over_several_programs(fresh_seed):
    def f(x, y):
        x.copy_(y)
        return x * 2
    check_against_eager(f, torch.randn(40, 3000), torch.randn(3000).half())


def test_outputs_viewing_each_other_over_several_programs(fresh_seed):
    def f(x):
        z = x * 2
        return z, z.t(), z[1], (x + 1).reshape(-1)[::3]
    check_against_eager(f, torch.randn(300, 301))


def test_destination_passing_over_several_programs(fresh_seed):
    x = torch.randn(70, 300)
    cf = tjit.compile(lambda x: (x.softmax(1), x * 2))
    outs = (torch.full((70, 300), float("nan")), torch.full((70, 300), float("nan")))
    cf(x, out=outs)
    torch.testing.assert_close(outs[0], x.softmax(1))
    torch.testing.assert_close(outs[1], x * 2)


@pytest.mark.parametrize("seed", range(30))
def test_random_composition_over_several_programs(seed):
    """Error against a float64 reference within a small factor of eager's own float32
    error (summation orders differ, so elementwise equality to eager is not the test)."""
    rng = random.Random(seed)
    fn, steps = random_function(rng)
    shape = (rng.choice([1, 3, 70]), rng.choice([1, 1025, 3000, 5000]))
    # inputs drawn from the seed too: an exp of a norm of 3000 values reaches 1e22, where one
    # ulp of difference in the norm is a relative error eager's own may happen to be far below
    draw = torch.Generator().manual_seed(seed)
    x, y = torch.randn(shape, generator=draw), torch.randn(shape, generator=draw)
    i = torch.randint(0, 50, (rng.randint(1, 5),), generator=draw)
    try:
        reference = fn(x.double(), y.double(), i)
        eager = fn(x, y, i)
    except (RuntimeError, IndexError):
        pytest.skip(f"eager refuses {steps}")
    got = tjit.compile(fn)(x, y, i)
    for g, e, r in zip(got, eager, reference):
        assert g.shape == e.shape and g.dtype == e.dtype, f"steps {steps}"
        finite = torch.isfinite(r)
        agree = finite == torch.isfinite(e)  # where eager's float32 overflows, either answer will do
        assert torch.equal(torch.isfinite(g)[agree], finite[agree]), f"steps {steps}: non-finite values differ"
        eager_error = (e.double() - r)[finite].abs().max().item() if finite.any() else 0.0
        error = (g.double() - r)[finite].abs().max().item() if finite.any() else 0.0
        scale = r[finite].abs().max().item() if finite.any() else 0.0
        assert error <= 4 * eager_error + 1e-6 * (1 + scale), f"steps {steps}: error {error} vs eager's {eager_error}"


@pytest.mark.parametrize("shape", [(70, 3000), (300, 2000), (5000, 40)])
def test_column_reductions_over_many_programs(shape, fresh_seed):
    """Rows contiguous along the kept axis: a block takes many rows and whole (or looped)
    columns, and must still fit in registers at sm_90 (the conftest compiles it)."""
    x = torch.randn(shape)
    cf = check_against_eager(lambda x: (x.softmax(0), x.logsumexp(0), x.amax(0)), x)
    assert launches(cf, x) == 1

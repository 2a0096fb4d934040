"""index_put (x[idx] = v, x[i, j] += v, index_add-style accumulation) as fused kernels: one
kernel fills the result with x, a second writes the values at their offsets. Against eager
at sizes that span many Triton programs, with outputs poisoned: unique indices where the
write is not accumulated (eager leaves the winner of a repeat undefined), repeats where it is."""
import pytest
import torch

import tjit
from helpers import assert_matches_eager, check_against_eager, launches

pytestmark = pytest.mark.usefixtures("fresh_seed")
aten = torch.ops.aten


def small_ints(*shape):
    """float32 with small integer values: accumulated sums are exact in any order."""
    return torch.randint(-8, 9, shape).float()


def assert_fused(fn, *args, kernels):
    cf = check_against_eager(fn, *args)
    ex = tjit.explain(cf, *args)
    assert not ex.library_calls, [c.op for c in ex.library_calls]
    assert launches(cf, *args) == kernels, [k.source for k in ex.kernels]
    return cf


def unique(n, k):
    return torch.randperm(n)[:k]


def test_rows_written_then_read_is_a_fill_a_scatter_and_the_reader():
    f = lambda x, i, v: x.index_put((i,), v * 2) + 1  # noqa: E731
    assert_fused(f, torch.randn(3000, 5), unique(3000, 1500), torch.randn(1500, 5), kernels=3)


def test_a_returned_index_put_is_a_fill_and_a_scatter_into_the_output():
    # the scattered buffer is the returned tensor itself: no copy out
    f = lambda x, i, v: aten.index_put(x, [i], v.exp())  # noqa: E731
    assert_fused(f, torch.randn(900, 7), unique(900, 400), torch.randn(400, 7), kernels=2)


@pytest.mark.parametrize("name, shape, make_indices, values_shape", [
    ("dim1", (40, 300), lambda: [None, unique(300, 120)], (40, 120)),
    ("two_adjacent", (40, 50, 6), lambda: [unique(40, 30), torch.randint(0, 50, (30,))], (30, 6)),
    ("two_apart", (40, 5, 60), lambda: [unique(40, 30), None, torch.randint(0, 60, (30,))], (30, 5)),
    ("2d_index", (500, 4), lambda: [unique(500, 300).view(20, 15)], (20, 15, 4)),
    ("negative", (700, 3), lambda: [unique(700, 300) - 700], (300, 3)),
    ("broadcast_value", (700, 3), lambda: [unique(700, 300)], (3,)),
    ("scalar_value", (700, 3), lambda: [unique(700, 300)], ()),
    ("empty_index", (70, 3), lambda: [torch.zeros(0, dtype=torch.long)], (0, 3)),
    ("int32_index", (700, 3), lambda: [unique(700, 300).int()], (300, 3)),
    ("uint8_mask", (70, 3), lambda: [(torch.rand(70) > 0.5).to(torch.uint8)], (3,)),
])
def test_written_values_match_eager(name, shape, make_indices, values_shape):
    indices = make_indices()
    f = lambda x, v: aten.index_put(x, indices, v * 3)  # noqa: E731
    check_against_eager(f, torch.randn(shape), torch.randn(values_shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_accumulated_values_sum_over_repeated_indices(dtype):
    x = small_ints(600, 7).to(dtype)
    i = torch.randint(0, 600, (2000,))  # many repeats
    f = lambda x, v: aten.index_put(x, [i], v, True) * 2  # noqa: E731
    assert_fused(f, x, small_ints(2000, 7).to(dtype), kernels=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8])
def test_adds_of_types_without_an_atomic_add_stay_library_calls(dtype):
    x, i = small_ints(60, 3).to(dtype), torch.randint(0, 60, (100,))
    f = lambda x, v: aten.index_put(x, [i], v, True) + 1  # noqa: E731
    cf = check_against_eager(f, x, small_ints(100, 3).to(dtype))
    assert [c.op for c in tjit.explain(cf, x, small_ints(100, 3).to(dtype)).library_calls] == ["aten.index_put.default"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8, torch.bool])
def test_writes_of_every_type(dtype):
    x = torch.randn(800, 3).to(dtype)
    f = lambda x, i, v: aten.index_put(x, [i], v)  # noqa: E731
    check_against_eager(f, x, unique(800, 500), torch.randn(500, 3).to(dtype))


def test_setitem_on_an_input_writes_the_callers_tensor():
    def f(x, i, v):
        x[i] = v
        return x.sum(1)
    check_against_eager(f, small_ints(2000, 3), unique(2000, 900), small_ints(900, 3))


def test_augmented_setitem_on_a_column_slice():
    def f(x, i):
        x[:, i] += 1  # index, add, and index_put written back
        return x
    check_against_eager(f, torch.randn(30, 400), unique(400, 150))


def test_a_boolean_mask_stays_a_library_call():
    x, m = torch.randn(70, 30), torch.rand(70, 30) > 0.5
    f = lambda x, m: aten.index_put(x, [m], torch.tensor(5.0))  # noqa: E731
    check_against_eager(f, x, m)


@pytest.mark.parametrize("bad", [3000, -3001])
def test_an_index_out_of_range_raises_index_error(bad):
    i = unique(3000, 100)
    i[57] = bad
    f = lambda x, i, v: aten.index_put(x, [i], v) + 1  # noqa: E731
    x, v = torch.randn(3000, 2), torch.randn(100, 2)
    if not x.is_cuda:  # (CUDA eager's check is a device-side assert, which ends the process's CUDA context)
        with pytest.raises(IndexError):
            f(x, i, v)
    with pytest.raises(IndexError, match="out of bounds"):
        tjit.compile(f)(x, i, v)


def test_gradients_of_written_and_accumulated_values():
    i, j = unique(300, 100), torch.randint(0, 50, (70,))

    def f(x, v, w):
        y = aten.index_put(x, [i], v * 2)  # x's gradient is 0 where v overwrote it
        return (aten.index_put(y, [None, j], w.exp(), True) * x).sum()
    args = [torch.randn(300, 50), torch.randn(100, 50), torch.randn(300, 70)]
    eager = [a.clone().requires_grad_() for a in args]
    mine = [a.clone().requires_grad_() for a in args]
    expected = torch.autograd.grad(f(*eager), eager)
    got = torch.autograd.grad(tjit.compile(f)(*mine), mine)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_repeated_indices_each_get_the_gradient_of_the_written_element():
    i = torch.tensor([3, 3, 7, 3])
    f = lambda x, v: aten.index_put(x, [i], v).pow(2).sum()  # noqa: E731
    x, v = torch.randn(10, 4), torch.ones(4, 4)  # equal values: any winner gives eager's result
    eager = [x.clone().requires_grad_(), v.clone().requires_grad_()]
    mine = [x.clone().requires_grad_(), v.clone().requires_grad_()]
    expected = torch.autograd.grad(f(*eager), eager)
    got = torch.autograd.grad(tjit.compile(f)(*mine), mine)
    for g, e in zip(got, expected):
        assert_matches_eager(g, e)


def _grads_match(f, args, rtol=1e-5, atol=1e-5):
    eager = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    mine = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    wanted = [a for a in eager if a.requires_grad]
    expected = torch.autograd.grad(f(*eager), wanted)
    got = torch.autograd.grad(tjit.compile(f)(*mine), [a for a in mine if a.requires_grad])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name, f, make", [
    ("embedding_of_a_computed_table", lambda w, idx: torch.nn.functional.embedding(idx, w * 2).sin().sum(),
     lambda: (torch.randn(100, 16), torch.randint(0, 100, (64, 32)))),
    ("gather_of_a_computed_value", lambda x, idx: x.exp().gather(1, idx).sum(),
     lambda: (torch.randn(50, 40), torch.randint(0, 40, (50, 30)))),
    ("cummax_of_a_computed_value", lambda x: torch.cummax(x * 3, 1).values.pow(2).sum(),
     lambda: (torch.randn(30, 300),)),
    ("half_table", lambda w, idx: torch.nn.functional.embedding(idx, (w * 2).half()).float().sum(),
     lambda: (small_ints(100, 16), torch.randint(0, 100, (64, 32)))),
])
def test_gather_gradients_into_computed_values_are_scatters(name, f, make):
    """(eager's scatter-add of a gather's gradient, into a value tjit computes: an IR Scatter
    in the backward, where it was a refusal before)"""
    _grads_match(f, make(), rtol=1e-4, atol=1e-4)


def test_a_view_of_an_index_put_returned_is_the_written_values():
    # index_copy / index_add of a 0-d tensor: unsqueeze, index_put, squeeze (the returned view
    # must read the scattered buffer, not the value it was filled with)
    check_against_eager(lambda x, i, s: x.index_copy(0, i, s), torch.tensor(-8.5), torch.tensor([0]),
                        torch.tensor(-1.75))
    check_against_eager(lambda x, i, s: x.index_add(0, i, s, alpha=-1), torch.tensor(-8.5), torch.tensor([0]),
                        torch.tensor(-1.75))
    check_against_eager(lambda x, i, v: aten.index_put(x, [i], v).t(), torch.randn(300, 5), unique(300, 100),
                        torch.randn(100, 5))


def test_a_gathers_gradient_through_an_index_put():
    # a scatter-add arriving at the index_put's result goes through its gradient rule (the
    # values it wrote), not to the tensor it was filled with
    i, j = unique(60, 20), torch.randint(0, 40, (60, 30))
    f = lambda x, v: aten.index_put(x * 1, [i], v * 2).gather(1, j).sum()  # noqa: E731
    _grads_match(f, (torch.randn(60, 40), torch.randn(20, 40)))


@pytest.mark.parametrize("name, f", [
    ("scatter", lambda x, j, s: x.scatter(0, j, s * 2)),
    ("scatter_value", lambda x, j, s: x.scatter(1, j.t()[:, :5] % 8, 2.5)),
    ("scatter_add", lambda x, j, s: x.scatter_add(0, j, s)),
    ("scatter_reduce_sum", lambda x, j, s: x.scatter_reduce(0, j, s, "sum")),
    ("index_add", lambda x, j, s: x.index_add(0, j[:, 0], s, alpha=2)),
    ("index_copy", lambda x, j, s: x.index_copy(0, torch.arange(299, -1, -1), s[:300])),
])
def test_scatters_are_fused(name, f):
    x, j, s = small_ints(300, 8), torch.randint(0, 300, (400, 8)), small_ints(500, 9)
    if name == "scatter":  # one write per element: unique targets in each column
        j = torch.stack([torch.randperm(300)[:200] for _ in range(8)], 1)
    if name == "index_copy":
        s = small_ints(300, 8)
    if name == "index_add":
        s = small_ints(400, 8)
    assert_fused(f, x, j, s, kernels=2)  # a fill and the scatter into the output (as index_put's)


def test_scatter_gradients():
    j = torch.stack([torch.randperm(300)[:200] for _ in range(8)], 1)
    f = lambda x, s: (x.scatter(0, j, s * 2) * x).sum() + x.scatter_add(0, j, s.exp()).pow(2).sum()  # noqa: E731
    # (src of index's shape: eager's own backward rejects a larger one)
    _grads_match(f, (torch.randn(300, 8), torch.randn(200, 8)), rtol=1e-4, atol=1e-4)


def test_a_scatter_index_out_of_range_raises_index_error():
    j = torch.randint(0, 30, (40, 4))
    j[17, 2] = 30
    f = lambda x, j, s: x.scatter_add(0, j, s) + 1  # noqa: E731
    with pytest.raises(IndexError, match="out of bounds"):
        tjit.compile(f)(torch.randn(30, 4), j, torch.randn(40, 4))


# -- scatters straight into the input they update -------------------------------------------------------
def test_setitem_on_an_input_is_one_kernel():
    def f(x, i, v):
        x[i] = v * 2
    assert_fused(f, torch.randn(3000, 5), unique(3000, 1500), torch.randn(1500, 5), kernels=1)


def test_an_accumulating_index_put_into_an_input_is_one_kernel():
    def f(x, i, v):
        x.index_put_((i,), v, accumulate=True)
    assert_fused(f, small_ints(500, 4), torch.randint(0, 500, (3000,)), small_ints(3000, 4), kernels=1)


def test_a_cache_update_then_a_read_of_the_cache():
    def f(cache, pos, k):
        cache.index_copy_(1, pos, k)
        return (cache * 2).sum(-1)
    assert_fused(f, torch.randn(4, 300, 8), torch.tensor([5, 9, 299]), torch.randn(4, 3, 8), kernels=2)


@pytest.mark.parametrize("matmuls", ["library", "generated"])
def test_a_key_value_cache_written_in_place_then_attended_over(monkeypatch, matmuls):
    """A decoder's step: this token's keys and values copied into the caches (inputs), then
    attention over the caches. A library product reading a cache written in place had
    crashed the compile (KeyError: the scattered buffer it reads was never written, as the
    scatter wrote into the input): such a scatter writes a buffer of its own now."""
    monkeypatch.setenv("TJIT_MATMUL", matmuls)

    def step(x, pos, keys, values, w):
        q, k, v = (x @ w).chunk(3, -1)
        keys.index_copy_(1, pos, k)
        values.index_copy_(1, pos, v)
        scores = (q @ keys.transpose(1, 2)).masked_fill(torch.arange(keys.shape[1]) > pos.max(), float("-inf"))
        return scores.softmax(-1) @ values
    check_against_eager(step, torch.randn(3, 1, 40), torch.tensor([70]), torch.randn(3, 300, 40),
                        torch.randn(3, 300, 40), torch.randn(40, 120))


def test_reads_before_and_after_an_in_place_scatter_see_the_old_and_new_values():
    def f(x, i, v):
        before = x * 3
        x[i] = v
        return before + x, x.t()
    check_against_eager(f, torch.randn(2000, 3), unique(2000, 700), torch.randn(700, 3))


def test_two_scatters_into_one_input():
    def f(x, i, j, v):
        x[i] = v
        x[j] += 1  # reads x: the second write goes through a buffer
        return x
    check_against_eager(f, torch.randn(2000, 3), unique(2000, 700), unique(2000, 300), torch.randn(700, 3))


def test_values_that_read_the_input_go_through_a_buffer():
    def f(x, i):
        x[i] = x[i.flip(0)] * 2  # another program could overwrite what a program reads
    x, i = torch.randn(3000, 2), unique(3000, 1400)
    assert_fused(f, x, i, kernels=3)


def test_a_transposed_input_is_written_through_a_buffer():
    def f(x, i, v):
        x[i] = v
    check_against_eager(f, torch.randn(5, 3000).t(), unique(3000, 1000), torch.randn(1000, 5))


# A Scatter is a Contiguous in the IR (it materialises its base, then writes over it): each
# function below read a scatter's buffer where it meant the base's values, or the reverse.
def written_over_and_returned(x, idx, v):
    y = x * 2
    return y, y.index_put((idx,), v, accumulate=True)


def overwritten_and_returned(x, idx, v):
    y = x.sin()
    return y, y.index_put((idx,), v)


@pytest.mark.parametrize("f", [written_over_and_returned, overwritten_and_returned])
def test_the_base_of_an_index_put_returned_beside_it_keeps_its_own_values(f):
    """The base's output had been given the scatter's buffer (the value a buffer holds), so
    it came back with the scattered rows in it."""
    x, idx = torch.randn(300, 70), unique(300, 40)
    check_against_eager(f, x, idx, torch.randn(40, 70))


def product_base_read_after_a_reduction_of_the_scatter(a, b, v, idx):
    y = a @ b
    return y - y.index_put((idx,), v).amax(1, keepdim=True)


def expensive_base_read_after_a_reduction_of_the_scatter(a, b, v, idx, c, d, e, f):
    y = a * b + c * d + e - f * a  # (more loads than a kernel computes again where a buffer holds the value)
    return y * y.index_put((idx,), v).sum(1, keepdim=True)


@pytest.mark.parametrize("f", [product_base_read_after_a_reduction_of_the_scatter,
                               expensive_base_read_after_a_reduction_of_the_scatter])
def test_a_base_read_after_its_scatter_is_read_as_it_was(f):
    """A value worth reading from a buffer rather than computing again (a product, or one of
    many loads) had been read from the buffer its scatter writes over, after the scatter.
    (Small integers: the products and row sums are exact in any order.)"""
    if f is product_base_read_after_a_reduction_of_the_scatter:
        args = (small_ints(300, 64), small_ints(64, 70), small_ints(40, 70), unique(300, 40))
    else:
        args = (small_ints(300, 70), small_ints(300, 70), small_ints(40, 70), unique(300, 40),
                *(small_ints(300, 70) for _ in range(4)))
    check_against_eager(f, *args)


@pytest.mark.parametrize("name, f", [
    # the backward read the saved index_add result wherever it needed the zeros it started
    # from: relu's test against 0 became agg <= agg, and every gradient was 0
    ("relu_of_index_add", lambda x, v, idx: torch.relu(torch.zeros_like(x).index_add(0, idx, v)) + x),
    ("index_put_times_its_base", lambda x, v, idx: (lambda y: y.index_put((idx,), v) * y)(x.sin())),
    ("scatter_add_times_its_base",
     lambda x, v, idx: (lambda y: y.scatter_add(0, idx[:, None].expand(-1, 70), v).relu() * y)(x.exp())),
])
def test_gradients_that_read_an_index_puts_base_read_the_base(name, f):
    x, weights = torch.randn(300, 70), torch.randn(300, 70)
    args = (x, torch.randn(40, 70), unique(300, 40)) if name == "index_put_times_its_base" else \
        (x, torch.randn(120, 70), torch.randint(0, 300, (120,)))
    _grads_match(lambda *a: (f(*a) * weights).sum(), args, rtol=1e-4, atol=1e-4)


def test_a_message_passing_layer_trains_as_eager():
    """A graph network's layer (the sweep that found the two bugs above): messages gathered
    along the edges, summed and maxed into each node, averaged by degree, through relu."""
    nodes, edges, dim = 301, 1200, 24
    src, dst = torch.randint(0, nodes, (edges,)), torch.randint(0, nodes, (edges,))

    def layer(x, w, b):
        m = torch.nn.functional.linear(x, w, b)[src]
        agg = torch.zeros_like(x).index_add_(0, dst, m)
        top = torch.full_like(x, -1e9).scatter_reduce(0, dst[:, None].expand(-1, dim), m, "amax", include_self=True)
        degree = torch.zeros(nodes, 1).index_add_(0, dst, torch.ones(edges, 1)).clamp(min=1)
        return torch.relu(agg / degree + top.clamp(min=-10)).square().mean()
    _grads_match(layer, (torch.randn(nodes, dim), torch.randn(dim, dim) / 5, torch.randn(dim)), rtol=1e-4, atol=1e-5)

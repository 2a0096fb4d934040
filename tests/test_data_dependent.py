"""Functions that need tensor data to go on (output sizes, Python numbers, branches read from
data) run split by Dynamo's graph breaks, each graph compiled by tjit (runtime/split.py)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import tjit
from tjit.errors import DataDependentError, GradientStateError
from tjit.frontend.trace import trace
from tjit.runtime import split
from helpers import check_against_eager


def close(got, expected):
    got, expected = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if isinstance(e, torch.Tensor):
            assert g.dtype == e.dtype and g.shape == e.shape
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
        else:
            assert type(g) is type(e) and g == e


def masked_sum(x):
    y = torch.tanh(x * 2)
    return (y[y > 0] * 3).sum() + y.sum()


def rows_of_nonzero(x):
    return torch.nonzero(x > 0.5) * 2


def scaled_by_item(x):
    return x * x.abs().max().item() + 1


def branch(x):
    if x.sum() > 0:
        return x * 2
    return x - 1


def uniques(x):
    values, counts = torch.unique(x.floor(), return_counts=True)
    return values * counts


def exact_equal(x, y):
    return torch.equal(x * 1, y)


@pytest.mark.parametrize("fn, args", [
    (masked_sum, lambda: [torch.randn(5000)]),
    (rows_of_nonzero, lambda: [torch.rand(37, 41)]),
    (scaled_by_item, lambda: [torch.randn(3000)]),
    (uniques, lambda: [torch.randn(2000) * 4]),
    (exact_equal, lambda: [torch.arange(7.0)] * 2),
], ids=lambda v: getattr(v, "__name__", ""))
def test_matches_eager(fn, args):
    torch.manual_seed(0)
    inputs = args()
    compiled = tjit.compile(fn)
    close(compiled(*inputs), fn(*inputs))
    close(compiled(*inputs), fn(*inputs))  # the second call reuses what Dynamo and tjit compiled


def test_trace_raises_data_dependent_error():
    with pytest.raises(DataDependentError, match="depends on tensor data"):
        trace(masked_sum, (torch.randn(8),), {})
    with pytest.raises(DataDependentError, match="tracing failed"):
        trace(branch, (torch.randn(8),), {})


def test_branch_follows_the_data_on_every_call():
    compiled = tjit.compile(branch)
    for sign in (1, -1, 1):
        x = torch.rand(3000) * sign
        close(compiled(x), branch(x))


def test_graphs_between_breaks_are_fused_by_tjit():
    x = torch.randn(5000)
    explained = tjit.explain(masked_sum, x)
    assert "depends on tensor data" in explained.reason
    assert len(explained.graphs) == 2 and all(isinstance(g, tjit.Explanation) for g in explained.graphs)
    before = tjit.counters.launches
    compiled = tjit.compile(masked_sum)
    close(compiled(x), masked_sum(x))
    assert tjit.counters.launches > before  # the graphs ran as tjit kernels, not eagerly


def test_gradients_through_a_mask():
    torch.manual_seed(1)
    x, w = torch.randn(3000, requires_grad=True), torch.randn(3000, requires_grad=True)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def f(x, w):
        y = torch.tanh(x * w)
        z = y[y > 0]
        return (z * z).sum() + y.sum() * 0.5

    tjit.compile(f)(x, w).backward()
    f(x2, w2).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_in_place_write_after_a_break():
    def f(x):
        x.add_(x.sum().item())
        return x[x > 0].mul_(2)

    torch.manual_seed(2)  # (a fixed draw: no element sits where another summation order would flip the mask)
    x = torch.randn(2000)
    x2 = x.clone()
    close(tjit.compile(f)(x), f(x2))
    torch.testing.assert_close(x, x2)


def test_out_receives_the_results():
    x = torch.rand(4000)
    out = torch.full((1,), float("nan"))
    got = tjit.compile(lambda x: (x[x > 0.5] + 1).sum(0, keepdim=True))(x, out=out)
    assert got is out
    torch.testing.assert_close(out, (x[x > 0.5] + 1).sum(0, keepdim=True))


def test_a_refused_dynamo_graph_runs_eagerly_with_a_warning(monkeypatch):
    """A graph tjit refuses is refused before anything runs, so running it eagerly is safe."""
    def refuse(self, *args, **kwargs):
        raise tjit.UnsupportedOpError("some_op", "refused for this test")

    monkeypatch.setattr(tjit.runtime.compiled.CompiledFunction, "prepare", refuse)
    x = torch.randn(300)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(lambda x: F.gelu(x) * 2, backend=split.graph_backend)(x)
    torch.testing.assert_close(got, F.gelu(x) * 2)
    assert any("runs a graph" in str(w.message) and "refused for this test" in str(w.message) for w in caught)


def test_sparse_tensors_run_split_their_graphs_eagerly():
    """Sparse tensors have no strided memory for kernels: the graphs that hold one run
    eagerly (with a warning), the rest is compiled."""
    torch.manual_seed(0)
    a, b = torch.randn(40, 50).relu().to_sparse_csr(), torch.randn(50, 30)

    def f(a, b):
        return torch.sparse.mm(a, b, "sum") * 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own: sparse CSR is in beta)
        close(tjit.compile(f)(a, b), f(a, b))
        dense = torch.randn(30, 20).relu()
        got = tjit.compile(lambda x: (x * 2).to_sparse())(dense)
    assert got.layout == torch.sparse_coo
    torch.testing.assert_close(got.to_dense(), dense * 2)


def test_a_lazily_negated_input_is_never_read_as_its_memory():
    """x.conj().imag is a view with the negative bit set: its memory holds the values
    unnegated, and make_fx's graph does not show the bit. Such an input is refused by the
    trace (its graph runs eagerly, with a warning), and it is a cache key of its own, so a
    call with it never reuses an entry traced for a plain tensor."""
    def f(x):
        return x * 2 + 1
    z = torch.randn(300, dtype=torch.complex64)
    negated = z.conj().imag
    assert negated.is_neg()
    compiled = tjit.compile(f)
    close(compiled(negated.clone()), f(negated.clone()))  # (a plain tensor first: its entry is cached)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        close(compiled(negated), f(negated))
        close(tjit.compile(f)(negated), f(negated))


def test_a_number_read_from_a_closed_over_tensor_is_read_on_every_call():
    """make_fx reads a tensor the function closes over for real: a Python number taken from it
    would be a constant of the trace, which no guard checks. It is read on every call instead
    (the function runs split by Dynamo)."""
    scale = torch.tensor(2.0)
    f = tjit.compile(lambda x: x * scale.item() + 1)
    x = torch.randn(10)
    torch.testing.assert_close(f(x), x * 2 + 1)
    scale.fill_(3.0)
    torch.testing.assert_close(f(x), x * 3 + 1)


class _ScaledAttention(torch.nn.Module):
    """Attention with a float attribute as its scale: with dynamic=True, Dynamo passes the
    attribute as a 0-d tensor read by .item(), and attention's Python code branches on it."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(self.proj(q), k, v, scale=self.scale)


def test_a_number_read_from_an_input_that_the_trace_branches_on_is_specialised():
    """The graph is compiled with the number's value (as HF models with dynamic=True), once per
    value, rather than run eagerly."""
    model = _ScaledAttention(0.125)
    graphs = []

    def backend(gm, example_inputs):
        run = split.graph_backend(gm, example_inputs)
        graphs.append(run.split_graph)
        return run
    compiled = torch.compile(model, backend=backend, dynamic=True)
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    for scale in (0.125, 0.3, 0.125):
        model.scale = scale
        steps = tjit.counters.library_calls + tjit.counters.launches
        with torch.no_grad():
            close(compiled(q, k, v), model(q, k, v))
        # the linear (a kernel) and attention (a library call): compiled, not eager
        assert tjit.counters.library_calls + tjit.counters.launches - steps == 2
    assert graphs and all(graph.eager_because is None for graph in graphs)


class _SlopeAndScale(torch.nn.Module):
    """Float attributes that dynamic=True passes as 0-d tensors read by .item(): one only
    scales (a runtime number in the kernels), one is leaky_relu's slope (which tjit bakes in)."""

    def __init__(self):
        super().__init__()
        self.scale, self.slope = 0.5, 0.1
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return F.leaky_relu(self.proj(x) * self.scale, self.slope) if self.slope is not None else self.proj(x) * self.scale


def test_float_attributes_read_as_numbers_stay_compiled():
    """The slope makes the graph specialised on the numbers read (once per tuple of values:
    a tuple seen before compiles nothing); every call matches eager and no graph runs eagerly
    (before, the slope's graph ran eagerly)."""
    model, graphs = _SlopeAndScale(), []

    def backend(gm, example_inputs):
        run = split.graph_backend(gm, example_inputs)
        graphs.append(run.split_graph)
        return run
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(300, 16)
    for scale, slope in [(0.5, 0.1), (0.25, 0.1), (3.0, 0.2), (0.5, 0.1)]:
        model.scale, model.slope = scale, slope
        launches, traces = tjit.counters.launches, tjit.counters.traces
        with torch.no_grad():
            close(compiled(x), model(x))
        assert tjit.counters.launches > launches  # compiled, not eager
    assert tjit.counters.traces == traces  # (the first tuple again)
    assert graphs and all(graph.eager_because is None for graph in graphs)


def test_a_size_read_from_a_tensor_made_of_python_numbers():
    """LED/Longformer compute a chunk count as `torch.div(12, 4, rounding_mode="trunc")`, a
    tensor of Python numbers, and take a size from it: the trace knows its value (the read
    is left without a fake value, unused); a KeyError in the converter before."""
    def f(x):
        n = torch.div(x.shape[1] * 3, 4, rounding_mode="trunc")
        return x.new_zeros((x.shape[0], n + 1)) + x

    check_against_eager(f, torch.randn(300, 4))
    torch._dynamo.reset()
    x = torch.randn(300, 4)
    torch.testing.assert_close(torch.compile(f, backend="tjit")(x), f(x))


def clip_gradients(params):
    """What a training loop compiles around its optimizer: the gradients' norm, read from
    and written back to each parameter's .grad."""
    return torch.nn.utils.clip_grad_norm_(params, 1.0)


def parameters_with(grads):
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_a_function_that_reads_and_writes_gradients_runs_split_by_dynamo():
    """A tensor's .grad is state the trace's copies of the inputs do not carry (traced, the
    norm would be 0 and nothing clipped). Reading or writing it takes the Dynamo path, which
    passes the gradients to the compiled graphs as inputs, read on every call."""
    compiled = tjit.compile(clip_gradients)
    for scale in (3.0, 0.01):  # (clipped, then not)
        grads = [torch.randn(n) * scale for n in (7, 300, 33)]
        params, expected_params = parameters_with(grads), parameters_with(grads)
        torch.testing.assert_close(compiled(params), clip_gradients(expected_params))
        for p, e in zip(params, expected_params):
            torch.testing.assert_close(p.grad, e.grad)
    assert "grad" in tjit.explain(clip_gradients, params).reason


def test_gradient_hooks_registered_inside_run_as_eagers():
    """A hook on an intermediate (register_hook) changes the gradients eager computes, and
    retain_grad keeps one: tjit's own backward would do neither, so such a function runs
    through Dynamo, which keeps them."""
    def hooked(x):
        y = x * 2
        y.register_hook(lambda g: g * 0.5)
        return (y * y).sum()

    def retained(x):
        y = torch.tanh(x)
        y.retain_grad()
        return (y * y).sum(), y
    x = torch.randn(300, requires_grad=True)
    expected = torch.autograd.grad(hooked(x), x)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the graph that holds the hook runs eagerly, and says so)
        torch.testing.assert_close(torch.autograd.grad(tjit.compile(hooked)(x), x)[0], expected)
        loss, y = tjit.compile(retained)(x)
    loss.backward()
    torch.testing.assert_close(y.grad, 2 * y.detach())


def test_trace_refuses_a_read_or_write_of_a_gradient():
    def reads(x):
        return x * 2 if x.grad is None else x.grad * 2

    def writes(x):
        x.grad = x * 2
        return x + 1
    x = torch.randn(5, requires_grad=True)
    x.grad = torch.ones(5)
    for fn in (reads, writes):
        with pytest.raises(GradientStateError, match=r"\.grad"):
            trace(fn, (x,), {})

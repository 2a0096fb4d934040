"""tjit's autograd against eager: gradients of every op family, the torch autograd
semantics a user relies on, the tape's lifetime, and a training loop whose memory stays
flat. Every comparison runs eager and tjit on separate copies of fresh random inputs."""
import pytest
import torch
import torch.nn.functional as F

import tjit
from helpers import assert_as_accurate_as_eager, train_beside_eager

pytestmark = pytest.mark.usefixtures("fresh_seed")  # fresh random inputs each run; a failure prints the seed

inf = float("inf")


def leaves(args, requires=None):
    """Copies of args; floating tensors require grad (or those whose index is in `requires`)."""
    return [a.detach().clone().requires_grad_(a.is_floating_point() if requires is None else k in requires)
            if isinstance(a, torch.Tensor) else a for k, a in enumerate(args)]


def check_grads(fn, *args, requires=None, rtol=None, atol=None, incoming=None, low_precision=False):
    """Outputs and the gradients of every input that requires grad, tjit against eager, for
    a random incoming gradient on each differentiable output. low_precision: a value may also
    pass by being about as close to the exact answer (fn in float64) as eager's."""
    ours, theirs = leaves(args, requires), leaves(args, requires)
    exact = [a.detach().double().requires_grad_(o.requires_grad) if isinstance(a, torch.Tensor) and
             a.is_floating_point() else a for a, o in zip(args, ours)]
    expected = fn(*theirs)
    got = tjit.compile(fn)(*ours)
    exact_out = fn(*exact) if low_precision else expected
    expected, got, exact_out = ((v if isinstance(v, tuple) else (v,)) for v in (expected, got, exact_out))
    incoming = incoming or [torch.randn(e.shape, dtype=e.dtype) for e in expected]

    def close(g, e, x, what):
        if low_precision:
            assert_as_accurate_as_eager(g, e, x, rtol, atol, what)
        else:
            torch.testing.assert_close(g, e, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}\n{m}")

    for k, (g, e, x) in enumerate(zip(got, expected, exact_out)):
        close(g, e, x, f"output {k}")
        assert g.requires_grad == e.requires_grad, "differentiable outputs differ from eager's"
    pairs = [(g, e, x, w) for g, e, x, w in zip(got, expected, exact_out, incoming) if e.requires_grad]
    torch.autograd.backward([e for _, e, _, _ in pairs], [w for *_, w in pairs])
    torch.autograd.backward([g for g, *_ in pairs], [w for *_, w in pairs])
    if low_precision:
        torch.autograd.backward([x for _, _, x, _ in pairs], [w.double() for *_, w in pairs])
    for k, (a, b) in enumerate(zip(ours, theirs)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert (a.grad is None) == (b.grad is None), f"input {k}: gradient {a.grad} where eager's is {b.grad}"
            if b.grad is not None:
                close(a.grad, b.grad, exact[k].grad, f"gradient of input {k}")


def randn(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


# -- elementwise -------------------------------------------------------------------------------
UNARY = {
    "exp": torch.exp, "log": lambda x: torch.log(x.abs() + 0.1), "sqrt": lambda x: (x.abs() + 0.1).sqrt(),
    "rsqrt": lambda x: (x.abs() + 0.1).rsqrt(), "sin": torch.sin, "cos": torch.cos,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "erf": torch.erf, "erfc": torch.erfc, "abs": torch.abs,
    "neg": torch.neg, "reciprocal": lambda x: (x.abs() + 0.5).reciprocal(), "expm1": torch.expm1,
    "log1p": lambda x: torch.log1p(x.abs()), "asin": lambda x: torch.asin(x.clamp(-0.9, 0.9)),
    "acos": lambda x: torch.acos(x.clamp(-0.9, 0.9)), "atan": torch.atan, "sinh": torch.sinh, "cosh": torch.cosh,
    "asinh": torch.asinh, "acosh": lambda x: torch.acosh(x.abs() + 1.5),
    "atanh": lambda x: torch.atanh(x.clamp(-0.9, 0.9)),
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "softplus": F.softplus,
    "relu": F.relu, "relu_relu": lambda x: F.relu(F.relu(x) - 0.5), "leaky_relu": F.leaky_relu, "elu": F.elu,
    "mish": F.mish, "hardtanh": F.hardtanh, "clamp": lambda x: x.clamp(-0.5, 0.5).clamp(-0.5, 0.5),
    "pow_scalar": lambda x: x.abs() ** 1.5, "square": lambda x: x ** 2, "exp2": torch.exp2,
    "log2": lambda x: torch.log2(x.abs() + 1),
    "floor_mix": lambda x: torch.floor(x) * x, "sign_mix": lambda x: torch.sign(x) * x * 2,
}


@pytest.mark.parametrize("name", UNARY)
def test_unary_gradients(name):
    x = randn(3, 37)
    x[0, :4] = torch.tensor([0.0, 0.5, -0.5, 1.0])  # exact zeros and clamp bounds
    check_grads(UNARY[name], x)


BINARY = {
    "add": lambda a, b: a + b * 2, "sub": lambda a, b: a - b, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 0.5),
    "maximum_ties": torch.maximum, "minimum_ties": lambda a, b: torch.minimum(b, a),
    "pow": lambda a, b: (a.abs() + 0.1) ** b, "pow_base_zero": lambda a, b: (a * (a > 0)) ** b.abs(),
    "atan2": torch.atan2, "fmod": lambda a, b: torch.fmod(a, b.abs() + 0.5),
    "remainder": lambda a, b: torch.remainder(a, b.abs() + 0.5),
    "where": lambda a, b: torch.where(a > b, a * 2, b.exp()),
    "lerp": lambda a, b: torch.lerp(a, b, 0.3), "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.5),
    "hypot_like": lambda a, b: (a * a + b * b).sqrt(),
}


@pytest.mark.parametrize("name", BINARY)
def test_binary_gradients(name):
    a, b = randn(4, 9), randn(4, 9)
    a[0, :3] = b[0, :3]  # exact ties for maximum/minimum, both sides carrying gradient
    check_grads(BINARY[name], a, b)


@pytest.mark.parametrize("shapes", [((4, 5), (5,)), ((4, 1), (1, 5)), ((2, 3, 4), ()), ((3, 1, 5), (4, 1))])
def test_broadcast_gradients_are_reduced_over_expanded_dims(shapes):
    a, b = randn(*shapes[0]), randn(*shapes[1])
    check_grads(lambda a, b: torch.sigmoid(a * b) + b, a, b)


# -- reductions, normalisations, losses -----------------------------------------------------------
REDUCTIONS = {
    "sum_dim": lambda x: x.sum(1), "sum_all": lambda x: x.sum(), "mean": lambda x: x.mean(0, keepdim=True),
    "prod": lambda x: x.prod(1), "amax": lambda x: x.amax(1), "amin": lambda x: x.amin(0),
    "max_dim": lambda x: torch.max(x, 1)[0], "max_all": lambda x: x.max(),
    "var": lambda x: x.var(1), "std_correction0": lambda x: x.std(0, correction=0), "norm": lambda x: x.norm(dim=1),
    "norm_all": lambda x: torch.linalg.vector_norm(x), "logsumexp": lambda x: x.logsumexp(1),
    "softmax": lambda x: x.softmax(1), "log_softmax": lambda x: x.log_softmax(0),
    "layer_norm": lambda x: F.layer_norm(x, (x.shape[-1],)), "var_mean": lambda x: torch.var_mean(x, 1),
}


@pytest.mark.parametrize("name", REDUCTIONS)
def test_reduction_gradients(name):
    check_grads(REDUCTIONS[name], randn(5, 33))


def with_tied_extremes(shape, dim):
    """Random values whose maximum and minimum along `dim` (None: over everything) each occur
    at two or three positions, exactly: built in the input itself, so the tied elements
    carry gradient (ties made by round() would get none, and test nothing)."""
    x = randn(*shape)
    big = x.abs().max().item() + 1
    if dim is None:
        flat = x.view(-1)
        n = flat.numel()
        flat[[1, n // 2, n - 1]] = big  # a three-way tie for the maximum
        flat[[0, n // 3]] = -big  # a two-way tie for the minimum
        return x
    lines = x.movedim(dim, -1)  # a view: each line along dim is a row of it
    offsets = torch.rand(lines.shape[:-1])  # a different extreme per line
    n = lines.shape[-1]
    lines[..., 1] = lines[..., n - 2] = big + offsets
    lines[..., 0] = lines[..., n // 2] = -big - offsets
    lines[0, n - 1] = big + offsets[0]  # three-way in the first line
    return x


TIES = {  # name -> (fn, the reduced dim the ties are along)
    "max": (lambda x: x.max(), None),
    "min": (lambda x: x.min(), None),
    "amax_all": (lambda x: x.amax((0, 1)), None),
    "amax": (lambda x: x.amax(1), 1),
    "amax_dim0": (lambda x: x.amax(0, keepdim=True), 0),
    "amin": (lambda x: x.amin(1), 1),
    "amin_dim0": (lambda x: x.amin(0), 0),
    "max_dim": (lambda x: torch.max(x, 1), 1),  # values and (not differentiable) indices
    "max_dim0_keepdim": (lambda x: torch.max(x, 0, keepdim=True).values * 2, 0),
    "min_dim": (lambda x: torch.min(x, 1), 1),
    "min_dim0": (lambda x: torch.min(x, 0)[0], 0),
    "norm_inf": (lambda x: torch.linalg.vector_norm(x, inf, dim=1), 1),
}


def check_tie_grads(fn, *args):
    """check_grads, and exactly the elements that eager gives gradient get one (a tie's
    gradient split wrongly, or given to the wrong one of the tied elements, fails here)."""
    ours, theirs = leaves(args), leaves(args)
    expected, got = fn(*theirs), tjit.compile(fn)(*ours)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)  # ties are exact: so are the values and indices
    pairs = [(g, e, torch.randn(e.shape)) for g, e in zip(got, expected) if e.requires_grad]
    torch.autograd.backward([e for _, e, _ in pairs], [w for *_, w in pairs])
    torch.autograd.backward([g for g, _, _ in pairs], [w for *_, w in pairs])
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a.grad != 0, b.grad != 0), f"input {k}: gradient where eager has none, or none where it has"
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"gradient of input {k}\n{m}")


@pytest.mark.parametrize("shape", [(5, 7), (3, 5000)], ids=["small", "long_rows"])
@pytest.mark.parametrize("name", TIES)
def test_gradients_of_tied_extremes(name, shape):
    fn, dim = TIES[name]
    if shape == (3, 5000) and dim == 0:
        shape = (5000, 3)  # the reduced dim is the long one
    check_tie_grads(fn, with_tied_extremes(shape, dim))


def test_gradient_of_a_full_max_over_many_programs_with_ties():
    x = with_tied_extremes((70_000,), None)  # split across programs under Auto
    check_tie_grads(lambda x: (x.max(), x.amin()), x)


def ties_between(a, b, every=2):
    """a with exact copies of b's elements (same shape) at every `every`-th position."""
    a = a.clone()
    a.view(-1)[::every] = b.reshape(-1)[::every]
    return a, b


@pytest.mark.parametrize("op", [torch.maximum, torch.minimum, torch.max, torch.min], ids=lambda f: f.__name__)
def test_gradients_of_binary_extremes_at_ties(op):
    check_tie_grads(op, *ties_between(randn(4, 9), randn(4, 9)))
    check_tie_grads(op, *ties_between(randn(3, 3000), randn(3, 3000), every=3))  # several programs
    # broadcast: a tie's half-gradients of b are summed over the broadcast dim
    b = randn(9)
    a = randn(4, 9)
    a[1:3] = b
    check_tie_grads(op, a, b)
    check_tie_grads(lambda x: op(x, x) * 3, randn(4, 9))  # every element ties with itself
    check_tie_grads(lambda x: op(x, x.flip(0)), randn(5, 9))  # the middle row ties with itself


@pytest.mark.parametrize("zeros", [0, 1, 2])
def test_prod_and_cumprod_with_zeros(zeros):
    x = randn(3, 8)
    x[1, 2:2 + zeros] = 0.0
    check_grads(lambda x: (x.prod(1), x.cumprod(1)), x)


def test_layer_norm_and_rms_norm_with_parameters():
    x, w, b = randn(6, 40), randn(40), randn(40)
    check_grads(lambda x, w, b: F.layer_norm(x, (40,), w, b), x, w, b)
    check_grads(lambda x, w: F.rms_norm(x, (40,), w), x, w)


@pytest.mark.parametrize("options", [{}, {"ignore_index": 2}, {"reduction": "sum"}, {"reduction": "none"},
                                     {"label_smoothing": 0.1}])
def test_cross_entropy_and_nll(options):
    x, t = randn(7, 11), torch.randint(0, 11, (7,))
    t[0] = 2
    check_grads(lambda x, t: F.cross_entropy(x, t, **options), x, t)
    check_grads(lambda x, t: F.nll_loss(x.log_softmax(1), t, **{k: v for k, v in options.items()
                                                                  if k != "label_smoothing"}), x, t)


# -- scans -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [lambda x: x.cumsum(1), lambda x: x.cumsum(0) * x, lambda x: torch.logcumsumexp(x, 1),
                                lambda x: torch.cummax(x, 1)[0], lambda x: torch.cummin(x, 0)[0]])
def test_scan_gradients(fn):
    check_grads(fn, randn(4, 19))


def test_cummax_of_a_computed_value():
    check_grads(lambda x: torch.cummax(x * 2, 1)[0], randn(3, 5))


# -- views and layouts ---------------------------------------------------------------------------------
VIEWS = {
    "transpose": lambda x: x.t() * 2, "slice_steps": lambda x: x[1::2, ::3].exp(),
    "select": lambda x: x[2] + x[:, 1].sum(),
    "narrow": lambda x: x.narrow(1, 2, 5), "glu": lambda x: (lambda a, b: a * torch.sigmoid(b))(*x.chunk(2, -1)),
    "flip": lambda x: x.flip(0, 1) * x, "expand": lambda x: x[:, :1].expand(6, 10) * x,
    "reshape": lambda x: x.reshape(3, 20).softmax(1), "diagonal": lambda x: torch.diagonal(x, 1),
    "t_slice": lambda x: x.t()[1:3], "split": lambda x: torch.split(x, [3, 7], 1)[1].tanh(),
}


@pytest.mark.parametrize("name", VIEWS)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "gaps"])
def test_view_gradients(name, layout):
    x = {"contiguous": randn(6, 10), "transposed": randn(10, 6).t(), "gaps": randn(6, 21)[:, ::2][:, :10]}[layout]
    check_grads(VIEWS[name], x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients(dtype):
    x, w = randn(4, 64, dtype=dtype), randn(64, dtype=dtype)
    check_grads(lambda x, w: F.gelu(F.layer_norm(x, (64,), w)) * x, x, w, rtol=2e-2, atol=2e-2, low_precision=True)


GRADCHECK = {  # one function per op family, in float64 against finite differences
    "elementwise": lambda x, w: torch.atan2(F.gelu(x), w.exp()) * torch.maximum(x, w),
    "reductions": lambda x, w: (x.prod(1, keepdim=True) + x.amax(0) * w).var(1) + x.norm(dim=0).sum(),
    "normalisations": lambda x, w: F.layer_norm(x, (6,), w) * x.softmax(1) + F.rms_norm(x, (6,), w).log_softmax(0),
    "scans": lambda x, w: x.cumprod(1) + torch.logcumsumexp(x * w, 0) + torch.cummax(x, 1)[0],
    "views": lambda x, w: (x.t()[1:4, ::2].sum(1) * torch.diagonal(x) + x.flip(1)[2, :3] * w[1:4]
                           + x.reshape(2, 9)[1, :3]),
    "indexed": lambda x, w: F.embedding(torch.tensor([0, 2, 2, 1] * 5), x) * w + torch.gather(x, 1, torch.tensor(
        [[0, 0], [5, 1], [2, 2]])).sum(),
}


@pytest.mark.parametrize("family", GRADCHECK)
def test_gradcheck_in_float64(family):
    x, w = randn(3, 6, dtype=torch.float64).requires_grad_(), randn(6, dtype=torch.float64).requires_grad_()
    f = tjit.compile(GRADCHECK[family])
    assert torch.autograd.gradcheck(lambda x, w: f(x, w), (x, w))


# -- indexed reads ---------------------------------------------------------------------------------------
def test_gather_with_duplicate_indices():
    x, i = randn(5, 9), torch.tensor([[0, 0, 3], [8, 8, 8], [1, 2, 1], [4, 4, 0], [5, 6, 5]])
    check_grads(lambda x, i: torch.gather(x.exp(), 1, i) * 2, x, i)


@pytest.mark.parametrize("count", [5, 40])
def test_index_select_and_embedding_scatter_duplicates(count):
    w, i = randn(11, 6), torch.randint(0, 11, (count,))
    i[:3] = 4
    check_grads(lambda w, i: torch.index_select(w, 0, i).sigmoid(), w, i)
    check_grads(lambda w, i: F.embedding(i.int(), w) * 3, w, i)
    check_grads(lambda w, i: w[i - 11], w, i)


def test_embedding_of_a_scaled_table_scatters_into_the_input():
    check_grads(lambda w, i: F.embedding(i, w * 2 + 1), randn(11, 6), torch.randint(0, 11, (40,)))


def test_embedding_of_a_computed_table_with_many_indices():
    check_grads(lambda w, i: F.embedding(i, w.cumsum(0)), randn(11, 6), torch.randint(0, 11, (40,)))


# -- in-place ops ---------------------------------------------------------------------------------------
def test_in_place_ops_on_intermediates():
    def f(x):
        h = x * 2
        h.add_(1)
        h.relu_()
        out = h * x
        return out.sigmoid_()
    check_grads(f, randn(4, 7))


def test_in_place_write_into_an_input_that_does_not_require_grad():
    def f(x, buf):
        buf.copy_(x.detach() * 0 + 1)
        return (x * 3).sum()
    x, buf = randn(3, 4), torch.zeros(3, 4)
    ours = leaves([x, buf], requires={0})
    tjit.compile(f)(*ours).backward()
    assert torch.equal(ours[1], torch.ones(3, 4))
    torch.testing.assert_close(ours[0].grad, torch.full((3, 4), 3.0))


# -- torch autograd semantics -------------------------------------------------------------------------------
def test_autograd_grad_accumulation_and_retain_graph():
    f = tjit.compile(lambda x, w: ((x * w).tanh() ** 2).sum())
    x, w = randn(3, 5).requires_grad_(), randn(5).requires_grad_()
    (gx,) = torch.autograd.grad(f(x, w), x)
    expected = torch.autograd.grad(((x * w).tanh() ** 2).sum(), x)[0]
    torch.testing.assert_close(gx, expected)
    loss = f(x, w)
    loss.backward(retain_graph=True)
    once = w.grad.clone()
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * once)
    f(x, w).backward()
    torch.testing.assert_close(w.grad, 3 * once)


def test_outputs_only_some_used_views_of_inputs_and_integer_outputs():
    def f(x):
        return x.exp(), x.t(), x.argmax(1), x.sum(0)
    x = randn(4, 6).requires_grad_()
    a, b, idx, s = tjit.compile(f)(x)
    assert not idx.requires_grad and b.requires_grad
    (a[:, 1].sum() + b.sum() * 2).backward()
    expected = torch.full((4, 6), 2.0)
    expected[:, 1] += x.detach()[:, 1].exp()
    torch.testing.assert_close(x.grad, expected)


def test_inputs_without_grad_and_no_grad_mode():
    f = tjit.compile(lambda x, w: x * w)
    x, w = randn(3, 4), randn(4).requires_grad_()
    f(x, w).sum().backward()
    assert x.grad is None and w.grad is not None
    with torch.no_grad():
        assert f(x, w).grad_fn is None


def test_double_backward_and_out_are_refused():
    f = tjit.compile(lambda x: (x ** 3).sum())
    x = randn(4).requires_grad_()
    with pytest.raises(RuntimeError, match="double backward"):  # never a silently constant gradient
        torch.autograd.grad(f(x), x, create_graph=True)
    with pytest.raises(tjit.CompileArgumentError, match="out="):
        tjit.compile(lambda x: x * 2)(x, out=torch.empty(4))


def test_detach_and_no_grad_inside_the_function():
    check_grads(lambda x: x * x.detach() + x.data.t() * 2 + (x * 2).detach()[1:].sum(), randn(3, 3))
    check_grads(lambda x: torch.zeros_like(x) + x.detach().exp(), randn(3, 3))  # no gradient at all

    def with_no_grad(x):  # what the block computes is detached, as eager's (HF rotary embeddings)
        with torch.no_grad():
            y = (x * 2).cos()[:, :1] + x.amax(0)  # (amax: exact in any order)
        return x * y
    check_grads(with_no_grad, randn(300, 70))  # (several programs)

    def writes_under_no_grad(x):  # y's new values, whose gradient eager passes to y's history (x * 2)
        y = x * 2
        with torch.no_grad():
            y.mul_(3)
        return x * y
    check_grads(writes_under_no_grad, randn(300, 70))
    with torch.no_grad():
        torch.testing.assert_close(tjit.compile(writes_under_no_grad)(randn(3)).shape, torch.Size([3]))


def _reads_itself_under_no_grad(x, w):
    with torch.no_grad():
        same = x.contiguous()  # (x itself: it keeps its gradient)
        typed = w.to(torch.float32)  # (w itself)
        other = x.t().contiguous()  # (a copy: no gradient)
    return (same * same).sum() + (typed * w).sum() + (other * 2).sum()


def test_an_op_under_no_grad_that_returns_its_input_returns_it_with_its_gradient():
    """Eager's x.contiguous() of a contiguous x is x itself, even under no_grad: its
    gradient flows. tjit detached every result under no_grad (found by a random program
    fuzzer; x's gradient was missing its term)."""
    check_grads(_reads_itself_under_no_grad, randn(300, 70), randn(300, 70))


def _updates_its_statistics(x, w, running_mean, running_var):
    """A norm whose running statistics are updated by hand (custom batch-norm layers): the
    second update reads var, which requires grad, and running_var is read after it."""
    mean, var = x.mean(0), x.var(0, unbiased=False)
    with torch.no_grad():
        running_mean.mul_(0.9).add_(0.1 * mean)
        running_var.mul_(0.9).add_(var, alpha=0.1)
        running_mean[:3] = x[0, :3]  # (a write through a view, of values that require grad)
    return (x - mean) / (var + 1e-5).sqrt() * w + running_var * running_mean


def _rescales_a_copy_of_its_weight(x, w):
    with torch.no_grad():
        scaled = w * 0.5  # (a new tensor: no gradient)
        scaled.add_(w)
    return x * scaled + x * w


@pytest.mark.parametrize("fn", [_updates_its_statistics, _rescales_a_copy_of_its_weight])
def test_writes_under_no_grad_into_tensors_that_carry_no_gradient_match_eager(fn):
    """Every write under no_grad in a function with grad inputs was refused (a model whose
    norm updates its statistics so ran its whole graph eagerly). Eager's write there passes no
    gradient, neither through the written values nor through what they were computed from:
    the tensors an op under no_grad reads are detached in the trace, so the written tensor's
    later reads carry none either. Rows span several programs."""
    args = (randn(300, 70), randn(70), randn(70), torch.rand(70) + 0.5)[:fn.__code__.co_argcount]
    ours, theirs = leaves(args, requires={0, 1}), leaves(args, requires={0, 1})
    expected, got = fn(*theirs), tjit.compile(fn)(*ours)
    torch.testing.assert_close(got, expected)
    incoming = torch.randn(expected.shape)
    expected.backward(incoming)
    got.backward(incoming)
    torch.testing.assert_close([a.grad for a in ours[:2]], [a.grad for a in theirs[:2]])
    torch.testing.assert_close(ours[2:], theirs[2:])  # (the statistics as eager updated them)


def _rescales_its_weight_through_a_view(x, w):
    with torch.no_grad():
        w[:10].mul_(2)  # (a parameter rescaled in place: RWKV's layers in training mode)
    return x * w


def _rescales_its_weight_between_reads(x, w):
    first = (w * 3).sum(0)  # (read before the write: MulBackward saves no w)
    with torch.no_grad():
        w.mul_(0.5)
    middle = x * w
    with torch.no_grad():
        w[5:].add_(1)
    return first, middle + w.exp()  # (w's last version read from memory, not forwarded)


def _fills_its_weight(x, w):
    with torch.no_grad():
        w[3:].fill_(1.0)  # (new values that read none of the old)
    return x * w


def _renorms_rows_of_a_table(table, index):
    """nn.Embedding(max_norm=...): the rows looked up are renormed in place under no_grad."""
    with torch.no_grad():
        torch.embedding_renorm_(table, index, 1.0, 2.0)
    return torch.embedding(table, index) * 2


@pytest.mark.parametrize("fn", [_rescales_its_weight_through_a_view, _rescales_its_weight_between_reads,
                                _fills_its_weight])
def test_a_write_under_no_grad_into_a_leaf_that_requires_grad_matches_eager(fn):
    """Eager allows it: the leaf stays a leaf, its new values are read after, and every read
    passes its gradient to the leaf. tjit refused it (such a model ran its graph eagerly).
    Now the write is unseen by tjit's autograd too: reads of the written versions give their
    gradients to the input. Rows span several programs; the weight must equal eager's."""
    x, w = randn(300, 70), randn(70)
    ours, theirs = leaves((x, w), requires={1}), leaves((x, w), requires={1})
    expected, got = fn(*theirs), tjit.compile(fn)(*ours)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ours[1], theirs[1])
    assert ours[1].is_leaf and ours[1].grad_fn is None
    incoming = [torch.randn(e.shape) for e in (expected if isinstance(expected, tuple) else (expected,))]
    torch.autograd.backward(expected, incoming)
    torch.autograd.backward(got, incoming)
    torch.testing.assert_close(ours[1].grad, theirs[1].grad, rtol=1e-4, atol=1e-4)  # (sums of 300 rows)


def _writes_a_result_and_a_leaf_through_detach(h, w):
    h[1::3].clamp_(-0.7, 0.9)  # (a write autograd sees, into a result of earlier ops)
    w.detach()[:4].add_(h.detach()[:4] * 2)  # (one it does not see, into a leaf)
    return (h * w).sum(0) + (w * w).sum(0)


def test_a_leaf_written_through_detach_beside_a_written_result_stays_a_leaf():
    """The write into h makes the trace copy every input requiring grad (its inputs are
    leaves); w's copy was then written back as a write autograd sees, and tjit raised eager's
    leaf error where eager raises none (found by a random program fuzzer). A copy that only
    unseen writes reached is written back unseen."""
    h, w = randn(130, 70), randn(130, 70)
    ours, theirs = leaves((h, w)), leaves((h, w))
    got = tjit.compile(_writes_a_result_and_a_leaf_through_detach)(ours[0] * 1, ours[1])
    expected = _writes_a_result_and_a_leaf_through_detach(theirs[0] * 1, theirs[1])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ours[1], theirs[1])
    assert ours[1].is_leaf
    (got * torch.arange(70.0)).sum().backward()
    (expected * torch.arange(70.0)).sum().backward()
    torch.testing.assert_close([a.grad for a in ours], [a.grad for a in theirs], rtol=1e-4, atol=1e-4)


def test_a_table_renormed_under_no_grad_matches_eager():
    table, index = randn(500, 24) * 3, torch.randint(0, 500, (40, 9))
    ours, theirs = leaves((table, index), requires={0}), leaves((table, index), requires={0})
    expected, got = _renorms_rows_of_a_table(*theirs), tjit.compile(_renorms_rows_of_a_table)(*ours)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ours[0], theirs[0])
    incoming = torch.randn(expected.shape)
    expected.backward(incoming)
    got.backward(incoming)
    torch.testing.assert_close(ours[0].grad, theirs[0].grad)


def test_writes_that_the_trace_cannot_follow_are_refused():
    """Through .data (unversioned: eager's backward would read the new values where an op
    saved the old), or through a view of another type (y.view(torch.int32) was taken for y
    itself, whose later reads then read the integers as its values: 6 off in the forward
    alone, silently)."""
    def through_data(x, w):
        w.data.mul_(2)
        return x * w

    def as_integers(x, w):
        y = x * w
        y.view(torch.int32).add_(1)
        return y * x

    def as_integers_under_no_grad(x, w):
        y = x * w
        with torch.no_grad():
            y.view(torch.int32).add_(1)
        return y * x
    x, w = randn(300, 70), randn(70)
    for fn, reason in [(through_data, "x.data"), (as_integers, "int32"), (as_integers_under_no_grad, "int32")]:
        for requires_grad in (True, False):
            kept = w.clone().requires_grad_(requires_grad)
            if requires_grad or fn is not through_data:  # (.data of a tensor without a gradient is itself)
                with pytest.raises(tjit.UnsupportedOpError, match=reason):
                    tjit.compile(fn)(x, kept)
            torch.testing.assert_close(kept, w, rtol=0, atol=0)  # (untouched)


def _written_through_detach(x):
    y = x * 3
    y.detach().mul_(2)  # (the whole tensor)
    return y * x


def _written_through_a_view_of_detach(x):
    y = x * 3
    y.detach()[0].mul_(2)
    return y[:5] * x[:5] + y.t()[:3, :4].sum()


def _columns_zeroed_through_detach(x):
    y = x * 3
    y.detach()[:, :5].zero_()
    return (y * x).sum(0)


def _detach_written_with_a_gradient(x):
    y = x * 3
    d = y.detach()
    d.add_(x)  # (d now carries x's gradient; y's reads pass theirs to y's history only)
    return y * x + d * 2


def _written_then_read_through_detach(x):
    y = x * 2
    y[0] = 5.0
    return y.detach()[1:] * x[1:]


def _detached_before_a_write(x):
    y = x * 3
    d = y.detach()
    y.mul_(2)  # (d sees the doubled values, without their gradient)
    return d * x


def _detached_view_before_a_write_of_a_row(x):
    y = x * 3
    d = y.detach()[:, :5]
    y[0].mul_(2)
    return d * x[:, :5]


def _detached_before_a_write_of_rows(x):
    y = x * 1.5
    d = y.detach()
    y[:5].mul_(x[:5])
    e = d.detach()  # (taken after the write: its values too)
    return (y * y).sum() + (d * d).sum() * 5.5 + (e * e).sum() * 6.5


def _added_its_own_detach_then_read_through_a_view(x):
    y = x * 2
    v = y.view(-1)
    y.add_(y.detach())  # (a write eager sees: the detach is its operand, not what it writes)
    y.mul_(3)
    return v * 1, y[1:] * x[1:]


def _added_its_own_detach_then_read(x):
    y = x * 2
    y[:5].add_(y.detach()[:5])
    return y * x


@pytest.mark.parametrize("fn", [_written_through_detach, _written_through_a_view_of_detach,
                                _columns_zeroed_through_detach, _detach_written_with_a_gradient,
                                _written_then_read_through_detach, _detached_before_a_write,
                                _detached_view_before_a_write_of_a_row, _detached_before_a_write_of_rows,
                                _added_its_own_detach_then_read_through_a_view, _added_its_own_detach_then_read])
def test_writes_and_reads_through_detach_pass_gradients_as_eager(fn):
    """Eager's autograd does not see a write through x.detach(): x's later reads pass their
    gradient to x's history. tjit passed it to the written values instead (4 to 10 off,
    silently); a tensor read through x.detach() after a write into x passed the write's
    gradient too (20 to 27 off), or kept the values from before a write of some rows
    (found by a random program fuzzer). An in-place op one of whose other operands is the
    written tensor's detach is a write eager sees (4 off, silently, before the walk back to a
    detach followed only the memory's own source)."""
    # (atol: a sum's gradient is the total of 21000 incoming values)
    check_grads(fn, randn(300, 70), rtol=1e-5, atol=1e-4)


def _detached_in_place(x, w):
    y = x * w
    y.detach_()  # (eager: y's later reads pass no gradient)
    return y * x


def _stops_requiring_grad(x, w):
    w.requires_grad_(False)
    return x * w


def test_a_gradient_turned_off_in_place_is_refused():
    """x.detach_(), x.requires_grad_(False): the aten graph records nothing of them, so tjit
    passed gradients through (x's 6 off and w given one, silently). Refused by name; the
    out-of-place y = x.detach() is compiled, as before."""
    for fn in (_detached_in_place, _stops_requiring_grad):
        x, w = randn(300, 70).requires_grad_(), randn(70).requires_grad_()
        with pytest.raises(tjit.UnsupportedOpError, match="detach_"):
            tjit.compile(fn)(x, w)
        assert w.requires_grad
    check_grads(lambda x, w: (x * w).detach() * x, randn(300, 70), randn(70))


def _written_through_data(x):
    y = x.exp()
    y.data.mul_(2)  # (ExpBackward then reads the doubled values it saved)
    return y * x


def test_a_write_through_data_into_a_result_with_a_history_is_refused():
    """Unlike detach(), .data does not count the write in the tensor's version: eager's
    backward silently reads the written values where an op saved the old ones, which tjit's
    gradient would not; refused, not answered otherwise."""
    with pytest.raises(tjit.UnsupportedOpError, match="x.data"):
        tjit.compile(_written_through_data)(randn(300, 70).requires_grad_())
    check_grads(lambda x, w: x * w.data, randn(300, 70), randn(70))  # (a read through .data is compiled)


def _writes_rows_with_a_gradient_into_a_buffer(buf, x):
    buf[:5] = x[:5] * 2
    return buf * 3


def _adds_a_gradient_into_a_buffer(buf, x):
    buf.add_(x)
    return buf.sum(0)


@pytest.mark.parametrize("fn", [_writes_rows_with_a_gradient_into_a_buffer, _adds_a_gradient_into_a_buffer])
def test_values_with_a_gradient_written_into_an_input_without_one_pass_it_on_as_eager(fn):
    """Eager's buffer carries the written values' gradient after the write (CopySlices,
    AddBackward), in the function's later reads and the caller's. tjit read the written
    memory back (x's gradient 6 off for the rows, silently) and returned the buffer without
    a history. Now it is traced through a copy, written back whole, and rebased onto the new
    contents, as an input requiring grad is."""
    buf, x = torch.zeros(300, 70), randn(300, 70).requires_grad_()
    ours, theirs, x2 = buf.clone(), buf.clone(), x.detach().clone().requires_grad_()
    got, expected = tjit.compile(fn)(ours, x2), fn(theirs, x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ours, theirs)
    assert ours.requires_grad and ours.grad_fn is not None
    (got.sum() + (ours * 2).sum()).backward()  # (the caller's later use of the buffer)
    (expected.sum() + (theirs * 2).sum()).backward()
    torch.testing.assert_close(x2.grad, x.grad)


def test_a_buffer_read_through_detach_after_values_with_a_gradient_are_written_matches_eager():
    def fn(x, buf):
        y = x * 1.5
        seen = buf.detach()
        buf[:, :3] = y[:, :3]  # (buf carries y's gradient after, seen the values only)
        return (buf * buf).sum() * 1.5 + (seen * seen).sum() * 4.5
    check_grads(fn, randn(300, 70), randn(300, 70), requires={0})


def test_values_with_a_gradient_written_through_detach_into_an_input_are_refused():
    """Eager: only that detached tensor carries their gradient, the input none; tjit's later
    reads of the input passed it on (found by a random program fuzzer)."""
    def fn(x, w, buf):
        buf.detach().add_(w)
        return (buf * buf).sum() + (x * w).sum()
    with pytest.raises(tjit.UnsupportedOpError, match="through x.detach.. of values that carry a gradient"):
        tjit.compile(fn)(randn(300, 70), randn(300, 70).requires_grad_(), randn(300, 70))


def test_values_without_a_gradient_written_into_an_input_are_compiled():
    def writes_a_mask_and_a_detached_value(buf, mask, x):
        mask.copy_(x > 0)
        buf.copy_(x.detach() * 2)
        return x * mask + buf
    check_grads(writes_a_mask_and_a_detached_value, torch.zeros(300, 70), torch.zeros(300, 70), randn(300, 70),
                requires={2})


def test_backward_reads_only_what_the_forward_saved():
    """Attention scores as BLOOM makes them (a broadcast bias added, viewed per head, a mask
    added): the softmax's exp is computed in two shapes, and while the saved values were
    chosen the builder merged one into the other, so the backward rebuilt the second from an
    input it was never given (KeyError). Rows span several programs."""
    def scores(bias, mask, x, v):
        s = (bias + x).view(4, 8, 33, 33) + mask
        return F.softmax(s, dim=-1).view(32, 33, 33) * v
    check_grads(scores, randn(32, 1, 33), randn(4, 1, 33, 33), randn(32, 33, 33), randn(32, 33, 33),
                requires=[2, 3])


class _TripledGradient(torch.autograd.Function):
    """x * x whose backward is deliberately not its derivative: eager runs the backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * grad


def test_custom_autograd_function_runs_eagerly_between_compiled_parts():
    """tjit's backward would differentiate the Function's forward (or nothing: it ran under
    no_grad) and miss its own backward. So on a gradient path the Function runs eagerly, its
    backward the user's, and Dynamo's graph is cut around it: tjit compiles the parts before
    and after it (tjit.compile hands such a function to Dynamo, as a data-dependent one)."""
    fn = lambda x: _TripledGradient.apply(x * 2).sin().sum()  # noqa: E731
    x = randn(2000)  # (several programs: 3000 makes the sum a 4096-lane block that spills 8 bytes at sm_90)
    leaf = x.clone().requires_grad_()
    expected = torch.autograd.grad(fn(leaf), leaf)[0]
    torch.testing.assert_close(expected, (4 * x * x).cos() * 12 * x)  # the Function's backward: 3 * 2x * 2
    for compiled in (tjit.compile(fn), torch.compile(fn, backend="tjit")):
        leaf = x.clone().requires_grad_()
        launches = tjit.counters.launches
        got = torch.autograd.grad(compiled(leaf), leaf)[0]
        torch.testing.assert_close(got, expected)
        assert tjit.counters.launches - launches >= 3  # x * 2; sin and sum; their backward
    parts = [part for graph in compiled_graphs(tjit.compile(fn), x.clone().requires_grad_()) for part in graph.parts]
    assert len(parts) == 2 and not any(part.eager_because for part in parts)
    explained = tjit.explain(fn, x.clone().requires_grad_())  # each part's kernels, and a note for the Function
    assert explained.kernels and any("custom autograd.Function" in g for g in explained.graphs if isinstance(g, str))
    with torch.no_grad():  # no gradient wanted: its forward is traced like any code
        torch.testing.assert_close(tjit.compile(fn)(x), fn(x))
    torch.testing.assert_close(tjit.compile(fn)(x), fn(x))  # (x does not require grad)


def compiled_graphs(compiled, *args):
    """The graphs Dynamo handed tjit for a function tjit.compile runs split (runtime/split.py)."""
    compiled(*args)
    return compiled._split.graphs


# -- kernels and the tape ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,fn,make", [
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (64,), w, b), lambda: (randn(8, 64), randn(64), randn(64))),
    ("rms_norm", lambda x, w: F.rms_norm(x, (64,), w), lambda: (randn(8, 64), randn(64))),
    ("softmax", lambda x: x.softmax(-1), lambda: (randn(8, 64),)),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t), lambda: (randn(8, 64), torch.randint(0, 64, (8,)))),
])
def test_backward_runs_in_at_most_two_kernels(name, fn, make):
    args = leaves(make())
    f = tjit.compile(fn)
    out = f(*args)
    out.backward(torch.randn(out.shape))  # compiles the backward
    out = f(*args)
    before = tjit.counters.launches
    out.backward(torch.randn(out.shape))
    assert tjit.counters.launches - before <= 2, name


def tape_bytes() -> int:
    """No gc.collect() here: the tape must be freed by reference counting alone."""
    return tjit.memory.stats()["tape_bytes"]


def test_tape_is_freed_after_backward_and_when_outputs_are_dropped():
    f = tjit.compile(lambda x, t: F.cross_entropy(x, t))  # keeps a count of targets on the tape
    x, t = randn(6, 9).requires_grad_(), torch.randint(0, 9, (6,))
    start = tape_bytes()
    loss = f(x, t)
    assert tape_bytes() > start
    loss.backward()
    assert tape_bytes() == start
    loss = f(x, t)
    del loss
    assert tape_bytes() == start
    loss = f(x, t)
    loss.backward(retain_graph=True)
    assert tape_bytes() > start
    loss.backward()
    del loss
    assert tape_bytes() == start


def test_a_thousand_training_steps():
    """1000 SGD steps: the tape is freed every step, resident memory stays flat, nothing is
    traced or compiled twice, and every step's loss, gradients and update are eager's at the
    same parameters (compared step by step, so no threshold depends on the random data and
    rounding differences cannot accumulate over the steps)."""
    def loss_fn(x, w, b, target):
        return F.cross_entropy(F.gelu(F.layer_norm(x, (16,), w, b)), target)

    def sgd(w, b, gw, gb):
        w.sub_(gw * 0.1)
        b.sub_(gb * 0.1)

    x, target = randn(8, 16), torch.randint(0, 16, (8,))
    w, b = torch.ones(16).requires_grad_(), torch.zeros(16).requires_grad_()
    step_loss, update = tjit.compile(loss_fn), tjit.compile(sgd)
    traces, start, rss = tjit.counters.traces, tape_bytes(), {}
    for k in range(1000):
        ew, eb = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        expected = loss_fn(x, ew, eb, target)
        expected.backward()
        loss = step_loss(x, w, b, target)
        loss.backward()
        torch.testing.assert_close(loss, expected, msg=lambda m: f"loss at step {k}\n{m}")
        torch.testing.assert_close((w.grad, b.grad), (ew.grad, eb.grad), msg=lambda m: f"gradients at step {k}\n{m}")
        with torch.no_grad():
            update(w, b, w.grad, b.grad)
            sgd(ew, eb, ew.grad, eb.grad)
        torch.testing.assert_close((w, b), (ew, eb), msg=lambda m: f"parameters after step {k}\n{m}")
        w.grad = b.grad = None
        del loss
        if k % 200 == 199:
            assert tape_bytes() == start, f"tape bytes after step {k}"
            rss[k] = _resident_bytes()
    assert tjit.counters.traces - traces == 2, "traced more than once"
    assert len(step_loss._cache) == 1 and len(update._cache) == 1
    assert len(step_loss.entry_for(x, w, b, target).executable._backward) == 1, "backward compiled more than once"
    assert rss[999] - rss[399] < 4 << 20, f"resident memory grew {(rss[999] - rss[399]) >> 10} KiB"


def _resident_bytes() -> int:
    import resource
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _RescalesItsLayersWhenTraining(torch.nn.Module):
    """RWKV's `_rescale_layers`: under no_grad, each layer's output weight is rescaled in
    place before the forward reads it (RWKV does it when the mode changes); an embedding
    renorms the rows it looks up (nn.Embedding(max_norm=...))."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(300, 48, max_norm=1.0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(48, 48) for _ in range(2))

    def forward(self, index):
        with torch.no_grad():
            for k, layer in enumerate(self.layers):
                layer.weight.mul_(1.5 ** k)
        h = self.embedding(index)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h.sum(-1)


def test_a_model_that_writes_its_parameters_under_no_grad_trains_through_torch_compile_as_eager():
    """Such a model ran its graph eagerly, with a warning (a no_grad write into a parameter
    was refused); now it is compiled, and its weights and gradients match eager's over two
    steps. Rows of the table span several programs."""
    eager = _RescalesItsLayersWhenTraining()
    with torch.no_grad():
        eager.embedding.weight.mul_(4)  # (norms above max_norm: the renorm writes)
    ours, _ = train_beside_eager(eager, lambda: torch.randint(0, 300, (6, 40)))
    for (name, a), b in zip(ours.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}\n{m}")
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}.grad\n{m}")


def test_explain_of_a_split_function_shows_each_graphs_backward_and_training_step_peak():
    """A function Dynamo splits (a branch on data) with an input that requires grad: each
    graph's explanation has its backward, what its forward saves for it, and the training
    step's predicted peak, as a function compiled whole has."""
    def fn(x, w):
        h = torch.softmax(x * w, -1)
        if h.sum() > 0:  # (data: a graph break)
            h = h.exp()
        return (h * w).sum()
    x, w = torch.randn(6, 40), torch.randn(40, requires_grad=True)
    explained = tjit.explain(fn, x, w)
    graphs = [g for g in explained.graphs if not isinstance(g, str)]  # (a str: why a graph runs eagerly)
    assert len(graphs) == 2
    for g in graphs:
        assert g.backward is not None and g.backward.kernels and g.saved
        assert g.peak_memory.what == "training step"
    assert "saved for backward" in str(explained) and "backward:" in str(explained)
    got = torch.autograd.grad(tjit.compile(fn)(x, w), w)[0]  # (and the graphs explained compute eager's)
    torch.testing.assert_close(got, torch.autograd.grad(fn(x, w), w)[0])

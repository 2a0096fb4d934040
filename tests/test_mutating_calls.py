"""Library calls to ops that write their arguments in place with no functional form
(bernoulli_ in dropout, normal_, rrelu's noise), run functionalised: the op writes copies,
which are written back where eager writes; calls that return nothing (linalg's error
checks), kept as steps that raise eager's error; and a batch norm's running statistics,
written in place by tjit's own kernels (frontend/batch_norm.py; tests/test_batch_norm.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import tjit

from helpers import assert_as_accurate_as_eager, check_against_eager, clone_args


@pytest.mark.parametrize("shape", [(37, 61), (3001,), (5, 0, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_in_training_mode_keeps_and_scales_like_eager(shape, dtype, fresh_seed):
    x = torch.rand(shape, dtype=dtype) + 0.5  # no zeros of its own
    f = tjit.compile(lambda x: F.dropout(x * 2, 0.3, training=True))
    y = f(x)
    assert y.shape == x.shape and y.dtype == dtype and not y.isnan().any()
    kept = y != 0
    torch.testing.assert_close(y[kept], (x * 2 / 0.7).to(dtype)[kept])
    if x.numel() > 1000:
        assert abs(kept.float().mean().item() - 0.7) < 0.05
        assert not torch.equal(f(x) != 0, kept), "each call draws a new mask"


def test_dropout_gradient_flows_through_the_kept_elements(fresh_seed):
    x = torch.randn(40, 70, requires_grad=True)
    y = tjit.compile(lambda x: F.dropout(x, 0.4, training=True) * 3)(x)
    y.sum().backward()
    expected = (y != 0).float() * 3 / 0.6
    torch.testing.assert_close(x.grad, expected)


def test_normal_into_an_input_writes_the_callers_tensor(fresh_seed):
    x = torch.zeros(3001)
    out = tjit.compile(lambda x: x.normal_(2.0, 0.5))(x)
    assert out is x and not x.isnan().any()
    assert abs(x.mean().item() - 2.0) < 0.1 and abs(x.std().item() - 0.5) < 0.1


def test_normal_into_an_intermediate_is_what_later_ops_read(fresh_seed):
    x = torch.randn(50, 61)

    def f(x):
        y = x * 2
        y.normal_(10.0, 0.01)
        return y + x, y.sum(1)
    a, s = tjit.compile(f)(x)
    torch.testing.assert_close(a - x, torch.full_like(x, 10.0), atol=0.1, rtol=0)
    torch.testing.assert_close(s, (a - x).sum(1))


def test_rrelu_in_training_mode_scales_negatives_within_bounds(fresh_seed):
    x = torch.randn(2001)
    y = tjit.compile(lambda x: F.rrelu(x, 0.1, 0.3, training=True))(x)
    neg = x < 0
    assert torch.equal(y[~neg], x[~neg])
    ratio = y[neg] / x[neg]
    assert ratio.min() >= 0.1 - 1e-6 and ratio.max() <= 0.3 + 1e-6 and ratio.std() > 0.01


def test_rrelu_gradient_uses_the_slopes_of_the_forward(fresh_seed):
    """The derivative runs rrelu_with_noise again with the seed the forward ran with."""
    x = torch.randn(50, 41, requires_grad=True)
    f = tjit.compile(lambda x: F.rrelu(x, 0.1, 0.3, training=True) * 2)
    y = f(x)
    y.sum().backward()
    neg = x < 0
    torch.testing.assert_close(x.grad[neg], (y / x).detach()[neg])
    torch.testing.assert_close(x.grad[~neg], torch.full_like(x.grad[~neg], 2.0))
    assert not torch.equal(f(x), y), "each call draws new slopes"


def test_the_gradient_through_what_a_random_op_overwrites_is_zero(fresh_seed):
    x = torch.randn(30, 7, requires_grad=True)
    ours = x.detach().clone().requires_grad_()

    def f(x):
        return ((x * 2).normal_() + x).sum()
    f(x).backward()
    tjit.compile(f)(ours).backward()
    torch.testing.assert_close(ours.grad, x.grad)


def _batch_norm_args(c=5):
    return (torch.randn(4, c, 33), torch.randn(c), torch.rand(c) + 0.5, torch.randn(c), torch.randn(c))


@pytest.mark.parametrize("op", ["legit", "with_update", "native"])
def test_batch_norm_updates_running_statistics_as_eager(op, fresh_seed):
    aten = torch.ops.aten
    fns = {
        "legit": lambda x, m, v, w, b: aten._native_batch_norm_legit(x, w, b, m, v, True, 0.1, 1e-5),
        "with_update": lambda x, m, v, w, b: aten._batch_norm_with_update(x, w, b, m, v, 0.2, 1e-5)[:3],
        "native": lambda x, m, v, w, b: aten.native_batch_norm(x, w, b, m, v, True, 0.1, 1e-5),
    }
    check_against_eager(fns[op], *_batch_norm_args())


def test_running_statistics_reads_before_and_after_the_update_are_ordered(fresh_seed):
    """Reads of the running mean before the batch norm see the old values, reads after it
    the updated ones (the write is a Mutation ordered like any in-place write)."""
    def f(x, m, v, w, b):
        before = m * 1
        y = F.batch_norm(x, m, v, w, b, training=True, momentum=0.3)
        return y, before, m + v, torch.sort(m).values
    check_against_eager(f, *_batch_norm_args(37))


def test_running_statistics_of_an_intermediate(fresh_seed):
    """The running statistics are computed values: the update rebinds them."""
    def f(x, m, v, w, b):
        m2, v2 = m * 2, v + 1
        y = torch.ops.aten._native_batch_norm_legit(x, w, b, m2, v2, True, 0.1, 1e-5)[0]
        return y, m2, v2
    check_against_eager(f, *_batch_norm_args())


@pytest.mark.filterwarnings("error:tjit runs a graph")  # compiled, not run eagerly
def test_batch_norm_module_trains_as_eager(fresh_seed):
    """BatchNorm2d in training mode through torch.compile(backend='tjit'): outputs, running
    statistics and parameters after a few SGD steps agree with eager."""
    torch._dynamo.reset()
    make = lambda: torch.nn.Sequential(torch.nn.BatchNorm2d(6), torch.nn.Tanh())  # noqa: E731
    eager, ours = make(), make()
    with torch.no_grad():
        for m in (eager, ours):
            m[0].weight.copy_(torch.linspace(0.5, 2, 6))
    _train_alike(eager, ours, [torch.randn(4, 6, 9, 11) for _ in range(3)], torch.arange(11.0))


LINALG = {  # name -> (fn, its number of operands, eager's message on a bad matrix)
    "inv": (torch.linalg.inv, 1, "singular"),
    "solve": (lambda a, b: torch.linalg.solve(a, b), 2, "singular"),
    "cholesky": (torch.linalg.cholesky, 1, "positive-definite"),
    "matrix_power": (lambda a: torch.linalg.matrix_power(a, -2), 1, "singular"),
}


@pytest.mark.parametrize("name", LINALG)
def test_linalg_checks_raise_eagers_error_on_bad_data(name, fresh_seed):
    fn, arity, message = LINALG[name]
    good = torch.randn(3, 6, 6)
    good = good @ good.transpose(1, 2) + 6 * torch.eye(6)  # positive definite
    args = (good, torch.randn(3, 6, 2))[:arity]
    f = check_against_eager(fn, *args)
    bad = clone_args(args)
    bad[0][1] = 0  # the second matrix is singular
    with pytest.raises(torch.linalg.LinAlgError, match=message):
        fn(*clone_args(bad))
    with pytest.raises(torch.linalg.LinAlgError, match=message):
        f(*bad)


def test_a_check_is_kept_when_its_result_is_differentiated(fresh_seed):
    a = torch.randn(6, 6) + 6 * torch.eye(6)
    f = tjit.compile(lambda a: torch.linalg.inv(a * 2).sum())
    ours, theirs = a.clone().requires_grad_(), a.clone().requires_grad_()
    f(ours).backward()
    torch.linalg.inv(theirs * 2).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad)
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        f(torch.zeros(6, 6, requires_grad=True))


def test_a_check_is_listed_by_explain():
    ex = tjit.explain(torch.linalg.inv, torch.randn(4, 4))
    assert "aten._linalg_check_errors.default" in [c.op for c in ex.library_calls]


def _write_then_check_then_write(a, x):
    y = x * 3  # read before every write, used after the check
    x.mul_(2)
    z = x + 1  # read between the first write and the check
    r = torch.linalg.inv(a)
    x.add_(z)
    return r, y + x


@pytest.mark.parametrize("fn", [lambda a, x: (torch.linalg.inv(a), x.mul_(2))[0],
                                lambda a, x: (torch.linalg.inv(a), x.mul_(2), x.add_(1))[0],
                                lambda a, x: (x.mul_(2), torch.linalg.inv(a))[1],
                                lambda a, x: (x.mul_(2), torch.linalg.inv(a), x.add_(1))[1],
                                _write_then_check_then_write])
def test_a_failing_check_leaves_inputs_as_eager_does(fn):
    """Eager makes the writes that come before a check that raises, and none after it: so
    does tjit."""
    bad, ours, theirs = torch.zeros(4, 4), torch.ones(1030), torch.ones(1030)
    with pytest.raises(torch.linalg.LinAlgError):
        fn(bad, theirs)
    with pytest.raises(torch.linalg.LinAlgError):
        tjit.compile(fn)(bad, ours)
    assert torch.equal(ours, theirs)
    good = torch.eye(4) * 2
    check_against_eager(fn, good, torch.randn(1030))




def test_tracing_leaves_a_closed_over_buffer_alone():
    """make_fx computes ops on small real tensors for real while tracing: a module's
    num_batches_tracked, closed over, must be incremented by the call only, once."""
    ours, eager = torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    compiled = tjit.compile(lambda x: ours(x))
    for _ in range(2):
        compiled(x)
        eager(x)
    assert ours.num_batches_tracked.item() == eager.num_batches_tracked.item() == 2
    torch.testing.assert_close(ours.running_mean, eager.running_mean)


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
@pytest.mark.parametrize("op", ["legit", "native", "functional"])
def test_batch_norm_gradients_and_running_statistics_as_eager(op, training):
    """Gradients of the input, weight and bias match eager's, and the running statistics are
    updated (training) or left alone (eval) as eager does. In eval mode the gradient reads
    the running statistics, which _native_batch_norm_legit's schema marks as written although
    it only reads them: its decomposition reads them and writes nothing (refused once: 'the
    backward needs values of input(s) from before the function wrote into them')."""
    aten = torch.ops.aten
    fn = {
        "legit": lambda x, m, v, w, b: aten._native_batch_norm_legit(x, w, b, m, v, training, 0.1, 1e-5)[0],
        "native": lambda x, m, v, w, b: aten.native_batch_norm(x, w, b, m, v, training, 0.1, 1e-5)[0],
        "functional": lambda x, m, v, w, b: F.batch_norm(x * 1.5 + 0.25, m, v, w, b, training=training,
                                                         momentum=0.3) * 2,
    }[op]
    torch.manual_seed(7)
    args = (torch.randn(8, 6, 700), torch.randn(6), torch.rand(6) + 0.5, torch.randn(6), torch.randn(6))
    cotangent = torch.randn(8, 6, 700)
    results = []
    for run in (fn, tjit.compile(fn)):
        x, m, v, w, b = clone_args(args)
        for t in (x, w, b):
            t.requires_grad_()
        y = run(x, m, v, w, b)
        grads = torch.autograd.grad(y, (x, w, b), cotangent)
        results.append((y.detach(), m, v) + grads)
    for got, expected, what in zip(*results, ["output", "running mean", "running var", "x grad", "w grad", "b grad"]):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")
    assert not training or not torch.equal(results[0][1], args[1])  # (the update is seen)


def test_batch_norm_module_in_eval_mode_trains_as_eager():
    """A BatchNorm2d in eval mode (frozen statistics, learned affine) through torch.compile."""
    torch._dynamo.reset()
    torch.manual_seed(11)
    make = lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6), torch.nn.Tanh())  # noqa: E731
    eager, ours = make(), make()
    ours.load_state_dict(eager.state_dict())
    with torch.no_grad():
        for m in (eager, ours):
            m[1].running_mean.copy_(torch.linspace(-1, 1, 6))
            m[1].running_var.copy_(torch.linspace(0.5, 2, 6))
            m.eval()
    _train_alike(eager, ours, [torch.randn(4, 3, 20, 21) for _ in range(2)], torch.arange(19.0))


def _train_alike(eager, ours, inputs, weights):
    """SGD steps on a weighted sum of each model's output, `ours` through torch.compile;
    then every parameter and buffer (running statistics) must match eager's, or be no less
    accurate than eager's against the same steps in float64. A parameter's gradient sums a
    weighted term per element of a channel; float32 rounds such a sum by up to about
    eps * (the terms' absolute sum), and a step moves it by lr times that: the tolerance."""
    lr = 0.1
    terms = inputs[0].numel() // inputs[0].shape[1] * weights.abs().max().item()
    atol = len(inputs) * lr * torch.finfo(torch.float32).eps * terms
    exact = copy.deepcopy(eager).double()
    compiled = torch.compile(ours, backend="tjit")
    runs = ((eager, eager, torch.float32), (ours, compiled, torch.float32), (exact, exact, torch.float64))
    for model, run, dtype in runs:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for x in inputs:
            loss = (run(x.to(dtype)) * weights.to(dtype)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    states = (ours.state_dict(), eager.state_dict(), exact.state_dict())
    for name, got in states[0].items():
        expected, x = states[1][name], states[2][name]
        if not expected.is_floating_point():
            assert torch.equal(got, expected), name
            continue
        assert_as_accurate_as_eager(got, expected, x, rtol=1e-4, atol=atol, msg=name)


@torch.library.custom_op("tjit_tests::add_into", mutates_args=("target",))
def _add_into(source: torch.Tensor, target: torch.Tensor) -> None:
    target.add_(source)


@_add_into.register_fake
def _(source, target):
    return None


def _writes_through_a_custom_op(x, y):
    torch.ops.tjit_tests.add_into(x * 2, y)  # (into an input)
    z = y * 1
    torch.ops.tjit_tests.add_into(x[:5].exp(), z[:5])  # (into rows of an intermediate)
    return z * 3 + y


@pytest.mark.parametrize("compile", ["tjit.compile", "torch.compile"])
def test_a_custom_op_that_writes_its_argument_and_returns_nothing_writes_it(compile, fresh_seed):
    """torch.library.custom_op(..., mutates_args=...) returning None: tjit kept the call as a
    check with no results, so its writes were lost (the function's result 25 off and the
    caller's tensor unwritten, silently). A call that returns nothing but writes is now its
    writes, as any library call that writes its arguments."""
    x, y = torch.randn(300, 70), torch.randn(300, 70)
    ours, theirs = y.clone(), y.clone()
    compiled = tjit.compile(_writes_through_a_custom_op) if compile == "tjit.compile" else \
        torch.compile(_writes_through_a_custom_op, backend="tjit")
    torch.testing.assert_close(compiled(x, ours), _writes_through_a_custom_op(x, theirs))
    torch.testing.assert_close(ours, theirs)

"""Optimizer steps compiled by tjit: `torch._foreach_*` ops (decomposed one op per tensor),
state the function closes over and updates in place (Dynamo passes an optimizer's
parameters and state as graph attributes), and whole `opt.step()` calls through
`torch.compile(..., backend="tjit")` against eager's optimizer on copies."""
import pytest
import torch

import tjit

from helpers import assert_matches_eager, clone_args

SHAPES = [(64, 33), (33,), (17, 5, 3), (0, 4)]


def _tensors(seed: int, positive: bool = False):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(s, generator=g) + 0.5 if positive else torch.randn(s, generator=g) for s in SHAPES]


def test_a_closed_over_tensor_written_in_place_is_read_back():
    """make_fx reads an attribute anew at each use: the read after the write must see it."""
    state = torch.zeros(3)

    def bump():
        state.add_(1)
        return state * 2

    with torch.no_grad():
        out = tjit.compile(bump)()
    assert torch.equal(out, torch.full((3,), 2.0)) and torch.equal(state, torch.ones(3))


def test_foreach_in_place_on_closed_over_tensors_runs_once():
    """The trace writes real tensors it closes over and puts them back: lists too."""
    steps = [torch.tensor(0.0), torch.tensor(5.0)]

    def count():
        torch._foreach_add_(steps, 1)

    with torch.no_grad():
        tjit.compile(count)()
    assert [s.item() for s in steps] == [1.0, 6.0]


def _adam_like(params, grads, exp_avg, exp_avg_sq):
    torch._foreach_mul_(params, 0.99)
    torch._foreach_lerp_(exp_avg, grads, 0.1)
    torch._foreach_mul_(exp_avg_sq, 0.999)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, 0.001)
    denom = torch._foreach_add(torch._foreach_sqrt(exp_avg_sq), 1e-8)
    torch._foreach_addcdiv_(params, exp_avg, denom, -0.01)


def _norms_and_clip(grads, scales):
    norms = torch._foreach_norm(grads, 2)
    torch._foreach_mul_(grads, scales)
    return torch._foreach_maximum(norms, 0.5), torch._foreach_pow(0.9, grads)


def _check_lists_against_eager(fn, *args):
    """check_against_eager for arguments that are lists of tensors (each run gets its own)."""
    copies = [[clone_args(a) if isinstance(a, list) and isinstance(a[0], torch.Tensor) else a for a in args]
              for _ in range(2)]
    with torch.no_grad():
        expected, got = fn(*copies[0]), tjit.compile(fn)(*copies[1])
    assert_matches_eager(got, expected, f"{fn.__name__} outputs")
    assert_matches_eager(copies[1], copies[0], f"{fn.__name__} inputs after the call")


@pytest.mark.parametrize("fn, positive", [(_adam_like, (False, False, False, True)),
                                          (_norms_and_clip, (False,))])
def test_foreach_ops_match_eager(fn, positive):
    lists = [_tensors(k, p) for k, p in enumerate(positive)]
    _check_lists_against_eager(fn, *lists) if fn is _adam_like else \
        _check_lists_against_eager(fn, lists[0], [0.5, 2.0, -1.0, 3.0])


def _addcmul_(x, y):
    torch._foreach_addcmul_(x, y, y, 0.5)


def test_foreach_on_non_contiguous_tensors():
    a = [t.t() for t in _tensors(0)[:1]] + [torch.randn(8, 6)[:, ::2]]
    _check_lists_against_eager(_addcmul_, a, [torch.randn_like(t) for t in a])


OPTIMIZERS = {
    "sgd": lambda ps, foreach: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=foreach),
    "adam": lambda ps, foreach: torch.optim.Adam(ps, lr=0.01, foreach=foreach),
    "adamw": lambda ps, foreach: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=foreach),
}


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single_tensor"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_optimizer_step_matches_eager(name, foreach):
    params = [torch.nn.Parameter(t) for t in _tensors(1)[:3]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref_opt = OPTIMIZERS[name](params, foreach), OPTIMIZERS[name](ref, foreach)

    @torch.compile(backend="tjit")
    def step():
        opt.step()

    for k in range(3):
        for p, q, g in zip(params, ref, _tensors(10 + k)):
            p.grad, q.grad = g.clone(), g.clone()
        step()
        ref_opt.step()
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, msg=lambda m: f"{name} step {k}: {m}")
        for p, q in zip(params, ref):
            for key, value in ref_opt.state[q].items():
                torch.testing.assert_close(opt.state[p][key], value, msg=lambda m: f"{name} state {key}: {m}")


def test_a_whole_training_step_compiled_matches_eager():
    """torch.compile of a step that runs forward, `loss.backward()` and `opt.step()`. Dynamo's
    graph breaks at backward, and its frame hook is still on when the autograd engine calls
    tjit's backward: Dynamo traced tjit's runtime as user code, and the step failed inside
    the graphs it made of it (a reshape of a kernel's buffer). tjit's backwards now run
    outside Dynamo."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(40), torch.nn.Linear(40, 70), torch.nn.GELU(),
                                torch.nn.Linear(70, 40))
    ref = __import__("copy").deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))

    def step(model, opt, x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    compiled = torch.compile(step, backend="tjit")
    for k in range(3):
        x = torch.randn(300, 40, generator=torch.Generator().manual_seed(k))
        torch.testing.assert_close(compiled(model, opt, x), step(ref, ref_opt, x))
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {k}: {m}")


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single_tensor"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_optimizer_step_updates_every_parameter_in_one_launch(name, foreach):
    """All parameters, their gradients and states in one kernel, no library call (the
    single-tensor Adam's addcdiv_ reaches tjit as Inductor's prims.fma). Adam's and AdamW's
    step counters, which the update reads, are incremented by the last program to finish."""
    params = [torch.nn.Parameter(t) for t in _tensors(3)[:3]]
    opt = OPTIMIZERS[name](params, foreach)

    @torch.compile(backend="tjit")
    def step():
        opt.step()

    for k in range(3):
        for p, g in zip(params, _tensors(30 + k)):
            p.grad = g
        launches, calls = tjit.counters.launches, tjit.counters.library_calls
        step()
    assert (tjit.counters.launches - launches, tjit.counters.library_calls - calls) == (1, 0)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single_tensor"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_learning_rate_schedule_stays_in_one_kernel_and_never_recompiles(name, foreach):
    """After its first recompile Dynamo passes a learning rate that changes between calls as a
    0-d tensor read by .item(): tjit keeps it a tensor, a kernel argument, so every later step
    is one launch of the same kernel (no trace, no new kernel source) and matches eager."""
    params = [torch.nn.Parameter(t) for t in _tensors(2)[:3]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [OPTIMIZERS[name](ps, foreach) for ps in (params, ref)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]

    @torch.compile(backend="tjit")
    def step():
        opts[0].step()

    for k in range(10):
        if k == 3:  # (Dynamo's recompile for the changing number comes in the first steps)
            generated, traces = tjit.counters.kernels_generated, tjit.counters.traces
        for p, q, g in zip(params, ref, _tensors(20 + k)):
            p.grad, q.grad = g.clone(), g.clone()
        launches, calls = tjit.counters.launches, tjit.counters.library_calls
        step()
        if k >= 3:
            assert (tjit.counters.launches - launches, tjit.counters.library_calls - calls) == (1, 0), f"step {k}"
        opts[1].step()
        for s in schedules:
            s.step()
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, msg=lambda m: f"{name} step {k}: {m}")
    assert (tjit.counters.kernels_generated, tjit.counters.traces) == (generated, traces)


aten = torch.ops.aten
FOREACH_CASES = [  # (op, arguments after the first list, keyword arguments)
    (aten._foreach_add.List, ("other",), {"alpha": 2}), (aten._foreach_add.Scalar, (3.0,), {}),
    (aten._foreach_add.Tensor, (torch.tensor(2.0),), {"alpha": 3}), (aten._foreach_mul.ScalarList, ([2.0, 3.0, -1.0],), {}),
    (aten._foreach_addcmul.ScalarList, ("other", "other", [0.5, 2.0, 1.5]), {}),
    (aten._foreach_lerp.Scalar, ("other", 0.3), {}), (aten._foreach_norm.Scalar, (1,), {}),
    (aten._foreach_norm.Scalar, (2, torch.float64), {}), (aten._foreach_max.default, (), {}),
    (aten._foreach_maximum.Scalar, (0.1,), {}), (aten._foreach_minimum.ScalarList, ([0.1, -0.2, 0.0],), {}),
    (aten._foreach_clamp_max.Scalar, (0.0,), {}), (aten._foreach_abs.default, (), {}),
]


@pytest.mark.parametrize("op, rest, kwargs", FOREACH_CASES, ids=lambda c: str(c) if isinstance(c, torch._ops.OpOverload) else "")
def test_foreach_decompositions_match_torch(op, rest, kwargs):
    """Each decomposition (one per-tensor op per element, arguments mapped by name) against
    the foreach op itself, on real tensors."""
    from tjit.frontend.foreach import foreach_decompositions
    g = torch.Generator().manual_seed(0)
    first, other = ([torch.randn(s, generator=g) for s in [(3,), (2, 4), (1,)]] for _ in range(2))
    args = [first] + [other if a == "other" else a for a in rest]
    expected, got = op(*args, **kwargs), foreach_decompositions()[op](*args, **kwargs)
    assert_matches_eager(got, expected, str(op))


@pytest.mark.parametrize("op", [aten._foreach_addcdiv_.Scalar, aten._foreach_copy_.default])
def test_in_place_foreach_decompositions_match_torch(op):
    from tjit.frontend.foreach import foreach_decompositions
    g = torch.Generator().manual_seed(1)
    a, b, c = ([torch.rand(s, generator=g) + 0.5 for s in [(3,), (2, 4)]] for _ in range(3))
    args = (b, c, 0.1) if op is aten._foreach_addcdiv_.Scalar else (b,)
    expected, got = clone_args(a), clone_args(a)
    op(expected, *args)
    assert foreach_decompositions()[op](got, *args) is None
    assert_matches_eager(got, expected, str(op))


@pytest.mark.parametrize("number_is", ["literal", "argument"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op, rest", [
    (aten._foreach_mul_.Scalar, (0.9,)), (aten._foreach_mul_.ScalarList, ([0.9, 0.999],)),
    (aten._foreach_add_.List, ("other",)), (aten._foreach_lerp_.Scalar, ("other", 0.1)),
    (aten._foreach_addcmul_.Scalar, ("other", "other", 0.001)),
], ids=lambda c: str(c) if isinstance(c, torch._ops.OpOverload) else "")
def test_in_place_foreach_scalars_round_as_eager_does_in_half_precision(op, rest, dtype, number_is):
    """eager's in-place foreach mul converts its scalar to the tensors' type first (unlike
    x.mul_(0.9)); an optimizer's momentum drifts by an ulp a step from eager's otherwise. The
    number as a literal, or as a float argument (a runtime number)."""
    g = torch.Generator().manual_seed(2)
    first, other = ([(torch.randn(s, generator=g) * 3).to(dtype) for s in [(3000,), (40, 33)]] for _ in range(2))
    number = next((a for a in rest if isinstance(a, float)), None)

    def step(tensors, other, number):
        given = number if number_is == "argument" else next((a for a in rest if isinstance(a, float)), None)
        op(tensors, *[other if a == "other" else given if isinstance(a, float) else a for a in rest])

    expected, got = clone_args(first), clone_args(first)
    step(expected, other, number)
    compiled = tjit.compile(step)
    with torch.no_grad():
        compiled(got, other, number)
    for e, t in zip(expected, got):
        assert torch.equal(t, e), f"{op} {dtype}: {int((t != e).sum())} elements differ"
    assert not compiled.literal_numbers

"""Batch norm as tjit's own kernels (frontend/batch_norm.py): in training mode the batch
statistics are reductions and the running statistics in-place writes, and the gradient is
tjit's autograd over them; no library call either way. Compared with eager on fresh random
inputs: outputs, running statistics, and the gradients of input, weight and bias."""
import pytest
import torch
import torch.nn.functional as F

import tjit

from helpers import assert_as_accurate_as_eager, clone_args, launches, train_beside_eager

aten = torch.ops.aten

# name -> (input shape, input dtype, parameter dtype, affine, running statistics, channels_last)
CASES = {
    "1d": ((16, 5), torch.float32, torch.float32, True, True, False),
    "3d": ((4, 6, 33), torch.float32, torch.float32, True, True, False),
    "4d": ((4, 6, 9, 11), torch.float32, torch.float32, True, True, False),
    "5d": ((2, 3, 4, 5, 6), torch.float32, torch.float32, True, True, False),
    "channels_last": ((4, 6, 9, 11), torch.float32, torch.float32, True, True, True),
    # 4440 values per channel over 5 channels: more than one block per row, rows over programs
    "several_programs": ((3, 5, 40, 37), torch.float32, torch.float32, True, True, False),
    "batch_of_one": ((1, 3, 5, 7), torch.float32, torch.float32, True, True, False),
    "no_affine": ((4, 6, 9, 11), torch.float32, torch.float32, False, True, False),
    "no_running_stats": ((4, 6, 9, 11), torch.float32, torch.float32, True, False, False),
    "float64": ((4, 6, 9, 11), torch.float64, torch.float64, True, True, False),
    # 16-bit inputs: eager computes the statistics in float32; with float32 parameters and
    # running statistics ("mixed"), its batch mean and invstd results are float32 too
    "float16_mixed": ((4, 6, 9, 11), torch.float16, torch.float32, True, True, False),
    "float16": ((4, 6, 9, 11), torch.float16, torch.float16, True, True, False),
    "bfloat16_mixed": ((4, 6, 9, 11), torch.bfloat16, torch.float32, True, True, True),
    "bfloat16": ((4, 6, 9, 11), torch.bfloat16, torch.bfloat16, True, True, False),
}


def _arguments(shape, dtype, param_dtype, affine, stats, channels_last):
    c = shape[1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtype)  # not already normalised
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = (torch.rand(c, dtype=param_dtype) + 0.5, torch.randn(c, dtype=param_dtype)) if affine else (None, None)
    m, v = (torch.randn(c, dtype=param_dtype), torch.rand(c, dtype=param_dtype) + 0.5) if stats else (None, None)
    return [x, m, v, w, b]


def _run(fn, args, cotangent) -> dict:
    """fn's output, the running statistics after it, and the gradients of x, weight, bias."""
    x, m, v, w, b = args = clone_args(args)
    wrt = {name: t.requires_grad_() for name, t in (("x grad", x), ("weight grad", w), ("bias grad", b))
           if t is not None}
    y = fn(*args)
    grads = torch.autograd.grad(y, list(wrt.values()), cotangent.to(y.dtype))
    found = {"output": y.detach(), "running mean": m, "running var": v, **dict(zip(wrt, grads))}
    return {name: t for name, t in found.items() if t is not None}


def _compare(fn, args, what):
    """tjit against eager: each value within tolerance of eager's, or no further from the
    exact answer (fn in float64 on the same values) than twice eager's error."""
    cotangent = torch.randn(args[0].shape, dtype=args[0].dtype)  # (the float64 run takes the same values)
    exact = _run(fn, [a.double() if a is not None else None for a in args], cotangent)
    eager = _run(fn, args, cotangent)
    ours = _run(tjit.compile(fn), args, cotangent)
    assert ours.keys() == eager.keys()
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(args[0].dtype, 1e-5)
    allowance = _rounding_allowance(exact, args, cotangent)
    for name, expected in eager.items():
        assert_as_accurate_as_eager(ours[name], expected, exact[name], rtol=tol, atol=tol + allowance.get(name, 0),
                                    msg=f"{what}: {name}")
    assert ours["output"].stride() == eager["output"].stride(), f"{what}: output layout"


def _rounding_allowance(exact, args, cotangent) -> dict:
    """The weight and bias gradients are per-channel sums of cotangent * xhat and of the
    cotangent, thousands of terms of size ~3 that cancel to ~1: added in any order, their
    rounding error is a fraction of the terms' sizes, not of the sum's (one seed in a few
    hundred put tjit's blocked sum 4e-5 from the exact one and eager's 4e-6). Allowed per
    channel: the type's eps times the sum of the terms' magnitudes (xhat is (y - bias) /
    weight, from the float64 run). A term dropped or counted twice is still far outside."""
    x, _, _, w, b = args
    if w is None:
        return {}
    eps = torch.finfo(w.dtype).eps
    channels = [-1 if d == 1 else 1 for d in range(x.dim())]
    others = [d for d in range(x.dim()) if d != 1]
    size = cotangent.double().abs()
    xhat = (exact["output"] - b.double().view(channels)) / w.double().view(channels)
    return {"weight grad": eps * (size * xhat.abs()).sum(others), "bias grad": eps * size.sum(others)}


@pytest.mark.parametrize("case,training", [(case, training) for training in (True, False) for case in CASES
                                           if training or CASES[case][4]],  # (eval mode reads running statistics)
                         ids=lambda v: v if isinstance(v, str) else "training" if v else "eval")
def test_batch_norm_matches_eager(case, training, fresh_seed):
    shape, dtype, param_dtype, affine, stats, channels_last = CASES[case]

    def fn(x, m, v, w, b):
        return F.batch_norm(x, m, v, w, b, training=training, momentum=0.3, eps=1e-4)
    _compare(fn, _arguments(shape, dtype, param_dtype, affine, stats, channels_last), case)


OPS = {  # every batch norm op the decomposition table takes, with all of its results
    "native": lambda x, m, v, w, b: aten.native_batch_norm(x, w, b, m, v, True, 0.2, 1e-5),
    "native_eval": lambda x, m, v, w, b: aten.native_batch_norm(x, w, b, m, v, False, 0.2, 1e-5),
    "legit": lambda x, m, v, w, b: aten._native_batch_norm_legit(x, w, b, m, v, True, 0.2, 1e-5),
    "legit_no_stats": lambda x, m, v, w, b: aten._native_batch_norm_legit(x, w, b, True, 0.2, 1e-5),
    "legit_no_training": lambda x, m, v, w, b: aten._native_batch_norm_legit_no_training(x, w, b, m, v, 0.2, 1e-5),
    "legit_functional": lambda x, m, v, w, b: aten._native_batch_norm_legit_functional(x, w, b, m, v, True, 0.2,
                                                                                        1e-5),
    "with_update": lambda x, m, v, w, b: aten._batch_norm_with_update(x, w, b, m, v, 0.2, 1e-5),
    "with_update_functional": lambda x, m, v, w, b: aten._batch_norm_with_update_functional(x, w, b, m, v, 0.2,
                                                                                             1e-5),
    "no_update": lambda x, m, v, w, b: aten._batch_norm_no_update(x, w, b, m, v, 0.2, 1e-5),
}


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.float16)], ids=["float32", "bfloat16_mixed", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_aten_batch_norm_ops_return_and_write_what_eager_does(op, dtypes, fresh_seed):
    """Every result (the batch mean and invstd in eager's type: float32 for a 16-bit input
    with float32 parameters, the input's type otherwise; empty in eval mode on CPU) and
    every running statistic after the call."""
    fn, args = OPS[op], _arguments((4, 6, 9, 11), *dtypes, True, True, False)

    def results_and_arguments(run, args):
        args = clone_args(args)
        return list(run(*args)) + args
    exact = results_and_arguments(fn, [a.double() for a in args])
    eager = results_and_arguments(fn, args)
    ours = results_and_arguments(tjit.compile(fn), args)
    assert len(ours) == len(eager)
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(dtypes[0], 1e-5)
    for k, (got, expected, reference) in enumerate(zip(ours, eager, exact)):
        assert_as_accurate_as_eager(got, expected, reference, rtol=tol, atol=tol, msg=f"{op}: result or argument {k}")


def test_one_value_per_channel_makes_the_running_variance_nan_as_eager():
    """Eager's unbiased variance is var_sum / (n - 1): 0 / 0 with one value per channel (F.batch_norm
    refuses such an input; the aten op does not)."""
    args = _arguments((1, 5), torch.float32, torch.float32, True, True, False)
    ours, eager = clone_args(args), clone_args(args)
    got, expected = tjit.compile(OPS["native"])(*ours), OPS["native"](*eager)
    # (the output is the bias: eager's x * invstd - mean * invstd, with invstd 1 / sqrt(eps) = 316,
    # leaves rounding of a few units of x * invstd's last place, up to 2.4e-4 here; tjit's (x - mean) none)
    x, w = args[0], args[3]
    rounding = 4 * torch.finfo(torch.float32).eps * (x.abs().max() / 1e-5 ** 0.5 * w.abs().max()).item()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=max(1e-4, rounding))
    torch.testing.assert_close(ours[1], eager[1])
    assert ours[2].isnan().all() and eager[2].isnan().all()


def test_one_value_per_channel_in_training_raises_eagers_error():
    x, m, v, w, b = _arguments((1, 5), torch.float32, torch.float32, True, True, False)
    message = "Expected more than 1 value per channel when training"
    with pytest.raises(ValueError, match=message):
        F.batch_norm(x, m, v, w, b, training=True)
    with pytest.raises(Exception, match=message):
        tjit.compile(lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=True))(x, m, v, w, b)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message):
        torch.compile(torch.nn.BatchNorm1d(5), backend="tjit")(x)


def test_an_empty_input_raises_eagers_error():
    args = _arguments((0, 5, 3), torch.float32, torch.float32, True, True, False)
    with pytest.raises(RuntimeError, match="input tensor must have at least one element") as eager:
        OPS["native"](*clone_args(args))
    with pytest.raises(RuntimeError) as ours:
        tjit.compile(OPS["native"])(*args)
    assert str(ours.value) == str(eager.value)


def test_eval_mode_without_running_statistics_raises():
    """F.batch_norm's error (the aten op called directly crashes eager's process)."""
    x = torch.randn(2, 3, 4)
    with pytest.raises(RuntimeError, match="running_mean must be defined in evaluation mode"):
        tjit.compile(lambda x: aten._native_batch_norm_legit(x, None, None, False, 0.1, 1e-5))(x)


def test_training_forward_and_backward_are_a_kernel_each_and_no_library_call(fresh_seed):
    """The batch statistics, the normalisation and the running statistics' update are one
    kernel; the backward (the statistics recomputed, the sums of the gradient formulas, the
    input's gradient) another."""
    def f(x, m, v, w, b):
        return torch.relu(F.batch_norm(x, m, v, w, b, training=True))
    x, m, v, w, b = _arguments((4, 6, 9, 11), torch.float32, torch.float32, True, True, False)
    compiled = tjit.compile(f)
    assert launches(compiled, x, m, v, w, b) == 1
    for t in (x, w, b):
        t.requires_grad_()
    calls, before = tjit.counters.library_calls, tjit.counters.launches
    y = compiled(x, m, v, w, b)
    assert tjit.counters.launches - before == 1
    y.sum().backward()
    assert tjit.counters.launches - before == 2
    assert tjit.counters.library_calls == calls


@pytest.mark.parametrize("entry", ["tjit.compile", "torch.compile"])
def test_cumulative_average_running_statistics_as_eager(entry, fresh_seed):
    """momentum=None: the module divides by float(num_batches_tracked), a number that changes
    every call, read from the buffer on each call (Dynamo runs such a module eagerly)."""
    torch._dynamo.reset()
    ours, eager = torch.nn.BatchNorm2d(3, momentum=None), torch.nn.BatchNorm2d(3, momentum=None)
    run = tjit.compile(lambda x: ours(x)) if entry == "tjit.compile" else torch.compile(ours, backend="tjit")
    for step in range(3):
        x = torch.randn(2, 3, 4, 5) + step
        torch.testing.assert_close(run(x), eager(x))
    for (name, a), b in zip(ours.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    assert ours.num_batches_tracked.item() == 3


def test_looped_training_reads_input_and_gradient_twice():
    """5120 values per channel: the kernels loop over each channel. The forward reads x twice
    (Welford's statistics, then the normalisation), writes the output and keeps only the
    per-channel statistics for the backward, which reads x and the gradient of the output
    twice each: the sums of the formulas, then the input's gradient. (With the variance's
    gradient going through the mean it subtracts, the backward took a pass more, and the
    forward kept x - mean for it.)"""
    def f(x, m, v, w, b):
        return F.batch_norm(x, m, v, w, b, training=True)
    x, m, v, w, b = _arguments((2, 3, 64, 40), torch.float32, torch.float32, True, True, False)
    for t in (x, w, b):
        t.requires_grad_()
    ex = tjit.explain(f, x, m, v, w, b)
    tensor = x.numel() * x.element_size()
    assert len(ex.kernels) == 1
    assert ex.kernels[0].bytes_read < 2.01 * tensor and ex.kernels[0].bytes_written < 1.01 * tensor
    assert len(ex.backward.kernels) == 1 and ex.backward.kernels[0].bytes_read < 4.01 * tensor


class _HandWrittenNorm(torch.nn.Module):
    """A batch norm written by hand, as custom layers are: its running statistics updated
    in place under torch.no_grad()."""

    def __init__(self, channels):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.rand(channels) + 0.5), torch.nn.Parameter(torch.randn(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x):
        if self.training:
            mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * mean)
                self.running_var.mul_(0.9).add_(var, alpha=0.1)
        else:
            mean, var = self.running_mean, self.running_var
        x = (x - mean[:, None, None]) / (var[:, None, None] + 1e-5).sqrt()
        return x * self.weight[:, None, None] + self.bias[:, None, None]


def test_a_hand_written_norm_that_updates_its_statistics_under_no_grad_is_compiled(fresh_seed):
    """Its training graph ran eagerly (tjit refused every write under no_grad in a function
    with grad inputs); now it is compiled, and trains and updates its statistics as eager."""
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), _HandWrittenNorm(8), torch.nn.ReLU())
    ours, compiled = train_beside_eager(eager, lambda: torch.randn(4, 3, 22, 21))
    for (name, a), b in zip(ours.named_parameters(), eager.parameters()):
        if name == "0.bias":  # (the norm subtracts each channel's mean: the conv bias's exact
            # gradient is 0: both are rounding noise, of order 1e-4, over 1,520 positions)
            assert a.grad.abs().max() < 1e-3 and b.grad.abs().max() < 1e-3, (a.grad, b.grad)
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}.grad\n{m}")
    torch.testing.assert_close(list(ours.buffers()), list(eager.buffers()))
    eager.eval(), ours.eval()
    x = torch.randn(4, 3, 22, 21)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(4, 6, 9, 11), (3, 5, 40, 37)], ids=["one_block", "several_programs"])
def test_training_keeps_eagers_float32_statistics_for_the_backward(shape, fresh_seed):
    """Besides its arguments, the backward reads only each channel's mean and inverse std in
    float32, the bytes eager's saves: the variance is accumulated in double on the CPU, but
    its gradient centres on the float32 mean as eager's does, and a per-channel value
    broadcast over the batch is kept compact. (It kept the double sums: twice eager's.)"""
    def f(x, m, v, w, b):
        return torch.relu(F.batch_norm(x, m, v, w, b, training=True))
    x, m, v, w, b = _arguments(shape, torch.float32, torch.float32, True, True, False)
    for t in (x, w, b):
        t.requires_grad_()
    y = tjit.compile(f)(x, m.clone(), v.clone(), w, b)
    arguments = {t.data_ptr() for t in (x, w, b)}
    kept = [t for t in y.grad_fn.saved_tensors if t.data_ptr() not in arguments]
    assert sorted((t.numel(), t.dtype) for t in kept) == [(shape[1], torch.float32)] * 2
    cotangent = torch.randn(shape)
    ours = torch.autograd.grad(y, (x, w, b), cotangent)
    eager = torch.autograd.grad(f(x, m.clone(), v.clone(), w, b), (x, w, b), cotangent)
    for name, a, e in zip(("x", "weight", "bias"), ours, eager):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda s: f"grad {name}: {s}")

"""Python numbers read from tensor data by `.item()` are runtime values (frontend/scalars.py):
a kernel reads the 0-d tensor, so a new value traces and generates nothing, and every use
that computes with the number matches eager (result types as a Python number gives them)."""
import copy

import pytest
import torch

import tjit
from tjit.errors import DataDependentError
from tjit.frontend.trace import trace

from helpers import assert_matches_eager, check_against_eager

N = 5000  # elementwise kernels span several programs


def _x(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, generator=g) * 3).to(dtype)


USES = {  # name -> (fn(x, s), the 0-d tensor s is read from)
    "scale": (lambda x, s: x * s.item(), torch.tensor(0.37, dtype=torch.float64)),
    "python_arithmetic": (lambda x, s: x * (1 - s.item() * 0.01) + 2 ** s.item() / (s.item() + 3),
                          torch.tensor(1.25, dtype=torch.float64)),
    "divide": (lambda x, s: x / s.item() - s.item() // 0.5 + s.item() % 0.3, torch.tensor(-0.7)),
    # (sub with alpha: torch's own meta function branches on alpha != 1, so that one splits)
    "alpha": (lambda x, s: torch.add(x, x.flip(0), alpha=-s.item()) * 2, torch.tensor(0.3)),
    "addcdiv_value": (lambda x, s: torch.addcdiv(x, x, x.abs() + 1, value=s.item()), torch.tensor(2.5)),
    "fill_and_where": (lambda x, s: torch.where(x > 0, x, s.item()) + torch.full_like(x, s.item()),
                       torch.tensor(-1.5)),
    "clamp_and_pow": (lambda x, s: torch.clamp(x, max=s.item()) + x.abs() ** s.item(), torch.tensor(0.5)),
    "lerp": (lambda x, s: torch.lerp(x, x.flip(0), s.item()), torch.tensor(0.8)),
    "int_count": (lambda x, s: x * s.item() + s.item() // 3, torch.tensor(7)),
    "int_divides": (lambda x, s: (x * 10).int() // s.item() + x / s.item(), torch.tensor(-3, dtype=torch.int32)),
    "bool_flag": (lambda x, s: x * s.item(), torch.tensor(True)),
    "reduced_in_the_function": (lambda x, s: x * x.abs().max().item() + s.item(), torch.tensor(1.0)),
    "one_element_of_rank_2": (lambda x, s: x * (s.item() * 2) + torch.full((), s.item()), torch.tensor([[0.5]])),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("use", sorted(USES))
def test_a_number_read_by_item_matches_eager(use, dtype):
    fn, s = USES[use]
    check_against_eager(fn, _x(dtype), s)


@pytest.mark.parametrize("use", sorted(USES))
def test_a_new_value_traces_and_generates_nothing(use):
    fn, s = USES[use]
    compiled = tjit.compile(fn)
    check_against_eager(fn, _x(), s, compiled=compiled)
    traces, generated = tjit.counters.traces, tjit.counters.kernels_generated
    for k, factor in enumerate([3.0, -2.0, 11.0]):  # (an int stays nonzero: the divisor in int_divides)
        new = (s * factor).to(s.dtype) if s.dtype != torch.bool else ~s
        check_against_eager(fn, _x(seed=k + 1), new, compiled=compiled)
    assert (tjit.counters.traces, tjit.counters.kernels_generated) == (traces, generated)


def test_the_number_carries_no_gradient():
    """eager's .item() leaves autograd: x's gradient is s, and s gets none."""
    def fn(x, s):
        return (x * s.item()).sin()

    x, s = _x().requires_grad_(), torch.tensor(0.6, requires_grad=True)
    x2, s2 = x.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    expected, got = fn(x, s), tjit.compile(fn)(x2, s2)
    assert_matches_eager(got, expected)
    torch.autograd.backward([expected, got], [torch.ones_like(expected)] * 2)
    assert_matches_eager(x2.grad, x.grad)
    assert s.grad is None and s2.grad is None


def test_a_number_an_op_reads_as_a_literal_splits_the_function():
    """leaky_relu's slope is read in Python by tjit's translation: DataDependentError at the
    trace, and tjit.compile's Dynamo split runs it (the number read eagerly) with eager's answer."""
    def fn(x, s):
        return torch.nn.functional.leaky_relu(x, s.item()) * 2

    with pytest.raises(DataDependentError, match="leaky_relu"):
        trace(fn, (_x(), torch.tensor(0.2)), {})
    check_against_eager(fn, _x(), torch.tensor(0.2))


def test_a_returned_number_splits_the_function():
    def fn(x):
        return x * 2, x.sum().item()

    with pytest.raises(DataDependentError, match="returned Python number"):
        trace(fn, (_x(),), {})
    (doubled, total), x = tjit.compile(fn)(_x()), _x()
    assert_matches_eager(doubled, x * 2)
    assert total == pytest.approx(x.sum().item(), rel=1e-5, abs=1e-3)  # (summed in another order than eager's)


# -- Python float arguments of a compiled function ------------------------------------------------
def scaled_softmax(x, w, lr):
    return torch.softmax(x * w, -1) * lr


def test_a_float_argument_is_a_runtime_number():
    """A new learning rate reuses the trace and the kernels (issue 15's softmax example)."""
    x, w = torch.randn(300, 700), torch.randn(700)
    compiled = tjit.compile(scaled_softmax)
    check_against_eager(scaled_softmax, x, w, 0.1, compiled=compiled)
    traces, generated = tjit.counters.traces, tjit.counters.kernels_generated
    for lr in [0.2, -3.5, 1e-4, 7.0]:
        check_against_eager(scaled_softmax, x, w, lr, compiled=compiled)
    assert (tjit.counters.traces, tjit.counters.kernels_generated) == (traces, generated)
    assert not compiled.literal_numbers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32], ids=str)
def test_float_arguments_keep_eager_types_and_rounding(dtype):
    """A float beside float16 rounds as eager's scalar does (add rounds it to the type, mul
    reads it at float32 precision); beside integers it makes the result float32."""
    def fn(x, a, b=0.1):
        return (x + a) * b - x / a

    x = (_x() * 10).to(dtype)
    compiled = tjit.compile(fn)
    for a, b in [(0.3, 1.7), (-2.2, 0.01)]:
        check_against_eager(fn, x, a, b=b, compiled=compiled)
    assert not compiled.literal_numbers


def test_a_float_the_function_branches_on_is_specialised():
    def fn(x, p):
        return x * 2 if p > 0.5 else torch.nn.functional.leaky_relu(x, p)

    compiled = tjit.compile(fn)
    for p in [0.1, 0.9, 0.2, 0.1]:
        check_against_eager(fn, _x(), p, compiled=compiled)
    assert compiled.literal_numbers and tjit.counters.traces >= 3


def test_a_specialised_value_is_told_apart_from_one_that_only_compares_equal():
    """-0.0 == 0.0 and (2,) == (2.0,), but x / -0.0 is -inf and an int tensor times 2.0 is a
    float tensor: each is a trace of its own (the old key reused the first one's)."""
    def divide(x, s):
        return x / s if s < 5 else x  # (the branch specialises s)

    compiled = tjit.compile(divide)
    for s in [0.0, -0.0, float("nan"), float("nan")]:
        check_against_eager(divide, _x(), s, compiled=compiled)

    def times_first(x, t):
        return x * t[0]

    compiled = tjit.compile(times_first)
    ints = (_x() * 10).int()
    for t in [(2,), (2.0,), (True,)]:
        check_against_eager(times_first, ints, t, compiled=compiled)


def test_a_float_argument_with_gradients():
    def fn(x, scale):
        return (x.sin() * scale + scale).sum()

    compiled = tjit.compile(fn)
    for scale in [0.5, -1.25]:
        x, x2 = _x().requires_grad_(), _x().requires_grad_()
        expected, got = fn(x, scale), compiled(x2, scale)
        expected.backward(), got.backward()
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-3)  # (a sum of 5000)
        assert_matches_eager(x2.grad, x.grad)
    assert not compiled.literal_numbers


def test_explain_says_which_floats_are_runtime_numbers():
    explained = tjit.explain(scaled_softmax, torch.randn(8, 40), torch.randn(40), 0.5)
    assert "runtime number" in explained.numbers["lr"] and "number argument lr: a runtime number (a 0-d float64" in str(explained)

    def branching(x, p):
        return x * 2 if p > 0.5 else x

    explained = tjit.explain(branching, torch.randn(8), 0.7)
    assert explained.numbers["p"].startswith("specialised") and "> 0.5" in explained.numbers["p"]  # (why: the branch)


@pytest.mark.parametrize("fn, x, s", [
    (lambda x, s: torch.full_like(x, s.item()), torch.ones(3000, dtype=torch.float16), torch.tensor(1e6)),
    (lambda x, s: torch.clamp(x, max=s.item()), torch.ones(3000, dtype=torch.int8), torch.tensor(300)),
    (lambda x, s: torch.add(x, x, alpha=s.item()), torch.ones(3000, dtype=torch.float16), torch.tensor(1e6)),
], ids=["full_like_float16", "clamp_int8", "alpha_float16"])
def test_a_number_eager_checks_against_a_narrow_type_gets_eager_error(fn, x, s):
    """eager refuses a number that overflows the result's type in these ops; tjit does not
    make it a runtime value there (it would become inf or wrap): the function splits, and the
    error is eager's. A number that fits gives eager's answer."""
    with pytest.raises(DataDependentError):
        trace(fn, (x, s), {})
    with pytest.raises(RuntimeError, match="overflow"):
        tjit.compile(fn)(x, s)
    check_against_eager(fn, x, torch.tensor(2, dtype=s.dtype))


# -- Python int arguments: specialised on their first value, runtime numbers from a second -------
def scaled_by_step(x, w, step):
    return torch.softmax(x * w, -1) * step + (step // 3 - step % 2)


def test_an_int_argument_that_changes_is_a_runtime_number():
    """A step count passed as an int: its first value is baked in (an int is most often a dim,
    a size or a count the trace needs); a second value traces once with it as a runtime
    number; no later value traces or generates anything."""
    x, w = torch.randn(300, 700), torch.randn(700)
    compiled = tjit.compile(scaled_by_step)
    check_against_eager(scaled_by_step, x, w, 1, compiled=compiled)
    check_against_eager(scaled_by_step, x, w, 2, compiled=compiled)
    assert compiled.runtime_ints == {"step"}
    traces, generated = tjit.counters.traces, tjit.counters.kernels_generated
    for step in [3, 1, -40, 10 ** 12, 7]:
        check_against_eager(scaled_by_step, x, w, step, compiled=compiled)
    assert (tjit.counters.traces, tjit.counters.kernels_generated) == (traces, generated)


def test_an_int_argument_that_changes_with_gradients():
    def fn(x, k):
        return (x.sin() * k).sum(-1)

    compiled = tjit.compile(fn)
    for k in [2, -3, 5]:
        x, x2 = _x().view(50, 100).requires_grad_(), _x().view(50, 100).requires_grad_()
        expected, got = fn(x, k), compiled(x2, k)
        expected.sum().backward(), got.sum().backward()
        assert_matches_eager(got.detach(), expected.detach())
        assert_matches_eager(x2.grad, x.grad)
    assert compiled.runtime_ints == {"k"}


INT_NEEDED = {  # an int the trace needs as a value (a dim, a size, a loop count, an index): its values
    "dim": (lambda x, k: x.sum(k) * 2, [0, 1, 0, -1]),
    "size_of_a_slice": (lambda x, k: x[:, :k] + 1, [1, 2, 1, 70]),
    "loop_count": (lambda x, k: sum(x * i for i in range(k)), [1, 2, 1, 4]),
    "view_size": (lambda x, k: x.reshape(k, -1).cumsum(0), [1, 2, 1, 10]),
    "index": (lambda x, k: x[k] * 3, [1, 2, 1, -3]),
    "pad": (lambda x, k: torch.nn.functional.pad(x, (k, k)), [1, 2, 1, 3]),
    "remainder": (lambda x, k: x % k, [1, 2, 1, 7]),  # (tjit reads a remainder's number as a literal)
}


@pytest.mark.parametrize("use", sorted(INT_NEEDED))
def test_an_int_the_trace_needs_stays_specialised(use):
    """The trace with the int as a runtime number fails (once): it is specialised from then on,
    each value traced once, with eager's answers; explain says why."""
    (fn, values), x = INT_NEEDED[use], _x().view(50, 100)
    compiled = tjit.compile(fn)
    for k in values:
        check_against_eager(fn, x, k, compiled=compiled)
    assert not compiled.runtime_ints and set(compiled.literal_ints) == {"k"}
    traces = tjit.counters.traces
    check_against_eager(fn, x, values[-1], compiled=compiled)
    assert tjit.counters.traces == traces
    assert tjit.explain(fn, x, values[1]).numbers["k"].startswith(f"specialised (int {values[1]} is in the kernels)")


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.bool, torch.float16,
                                   torch.bfloat16], ids=str)
def test_runtime_ints_keep_eager_types_overflow_and_errors(dtype):
    """As a runtime number an int still acts as eager's Python int: the result's type, wrapping
    in a small integer type, and the error eager raises where it converts one that does not fit
    (torch.where's 300 into int8)."""
    x = _x() > 0 if dtype == torch.bool else (_x() * 40).to(dtype)
    uses = {"add": lambda x, k: x + k, "mul_sub": lambda x, k: k - x * k, "divide": lambda x, k: x / k,
            "where": lambda x, k: torch.where(x > 3, x, k)}
    for fn in uses.values():
        compiled = tjit.compile(fn)
        for k in [3, -7, 300, 100000]:
            try:
                expected = fn(x, k)
            except RuntimeError as e:
                with pytest.raises(RuntimeError, match=str(e)):
                    compiled(x, k)
                continue
            assert_matches_eager(compiled(x, k), expected)


def test_a_number_read_by_item_that_overflows_where_raises_as_eager():
    """torch.where(x, y, n) converts n to the result's type, checking it fits; eager raises for
    100000 into int16. A number read by .item() must not be wrapped to -31072 instead."""
    def fn(x, s):
        return torch.where(x > 3, x, s.item())

    x = (_x() * 40).to(torch.int16)
    with pytest.raises(RuntimeError, match="cannot be converted to type int16_t without overflow"):
        fn(x, torch.tensor(100000))
    with pytest.raises(RuntimeError, match="cannot be converted to type int16_t without overflow"):
        tjit.compile(fn)(x, torch.tensor(100000))
    check_against_eager(fn, x, torch.tensor(1000))


def test_an_int_that_fails_as_a_runtime_number_leaves_the_others_runtime():
    """step has been a runtime number; then dim takes a second value, and that trace fails on
    dim: dim alone is specialised, step stays a runtime number."""
    def fn(x, w, step, dim=-1):
        return torch.softmax(x * w, dim) * step

    compiled, x, w = tjit.compile(fn), torch.randn(300, 70), torch.randn(70)
    for step, dim in [(1, -1), (2, -1), (3, 0), (4, -1), (5, 0)]:
        check_against_eager(fn, x, w, step, dim, compiled=compiled)
    assert compiled.runtime_ints == {"step"} and set(compiled.literal_ints) == {"dim"}
    traces = tjit.counters.traces
    check_against_eager(fn, x, w, 6, 0, compiled=compiled)
    assert tjit.counters.traces == traces


def test_an_int_beyond_int64_is_a_literal_even_after_it_became_a_runtime_number():
    """No int64 tensor holds 2**70: that call traces with the value baked in (eager's Python
    arithmetic takes it), and the runtime number stays for the values that fit."""
    def fn(x, k):
        return x * (k // 2 ** 66) + k % 5

    compiled, x = tjit.compile(fn), _x()
    for k in [1, 2, 2 ** 70, 7, -(2 ** 69)]:
        check_against_eager(fn, x, k, compiled=compiled)
    assert compiled.runtime_ints == {"k"}


def test_explain_says_which_ints_are_runtime_numbers():
    compiled = tjit.compile(scaled_by_step)
    x, w = torch.randn(8, 40), torch.randn(40)
    assert "specialised (int 5 is in the kernels): an int is specialised on its first value" in \
        str(tjit.explain(compiled, x, w, 5))
    compiled(x, w, 5), compiled(x, w, 6)
    assert "number argument step: a runtime number (a 0-d int64" in str(tjit.explain(compiled, x, w, 7))


def _scaled_if_float(x, w, p):
    return x * p if isinstance(p, float) else x + p


def _scaled_if_exactly_float(x, w, p):
    return x * p if type(p) is float else x + p


def _scaled_if_real(x, w, p):
    import numbers
    return x * p if isinstance(p, numbers.Real) else x - p


def _a_scale_only_a_float_sets(x, w, p):
    scale = p if isinstance(p, float) else 1.0  # (the same ops either way: only the number differs)
    return x * scale


def _another_tensor_unless_a_float(x, w, p):
    return (x if isinstance(p, float) else w) * p  # (the same ops on another tensor)


def _scaled_if_int(x, w, p):
    return x * p if isinstance(p, int) else x + p


TYPE_ASKED = [_scaled_if_float, _scaled_if_exactly_float, _scaled_if_real, _a_scale_only_a_float_sets,
              _another_tensor_unless_a_float]


@pytest.mark.parametrize("fn", TYPE_ASKED + [_scaled_if_int], ids=lambda f: f.__name__)
def test_a_number_whose_type_the_function_asks_is_specialised(fn):
    """A runtime number is a symbol (SymFloat, SymInt), and `isinstance(p, float)` is False
    for it: the runtime trace took the branch eager does not take, and every value got that
    wrong answer silently. The first trace with runtime numbers is now checked against the
    trace of their values (frontend/number_check.py); it differs, so they are specialised."""
    x, w = _x(), _x(seed=1)
    values = [3, 5, -2, 5] if fn is _scaled_if_int else [0.5, 2.5, -1.25, 2.5]
    compiled = tjit.compile(fn)
    for p in values:
        check_against_eager(fn, x, w, p, compiled=compiled)
    assert compiled.literal_numbers or compiled.literal_ints
    assert "runtime numbers give another trace than their values" in (compiled.literal_numbers or
                                                                      compiled.literal_ints["p"])


def _reads_data_and_a_number(x, w, p):
    return x * (x.abs().max().item() * p) + w.sum().item()


def _asks_the_type_of_something_else(x, w, p):
    return x * p if isinstance(w, torch.Tensor) and isinstance(3, int) else x


@pytest.mark.parametrize("fn", [_reads_data_and_a_number, _asks_the_type_of_something_else],
                         ids=lambda f: f.__name__)
def test_a_number_the_check_finds_the_same_stays_a_runtime_number(fn):
    """The check matches numbers read from tensor data (`.item()`) in both traces by the
    tensor they are read from, and type questions about other values change nothing: the
    float stays a runtime number, and new values trace nothing."""
    x, w = _x(), _x(seed=1)
    compiled = tjit.compile(fn)
    check_against_eager(fn, x, w, 0.5, compiled=compiled)
    traces = tjit.counters.traces
    for p in [2.5, -1.25]:
        check_against_eager(fn, x, w, p, compiled=compiled)
    assert not compiled.literal_numbers and tjit.counters.traces == traces


def _dropout_backward(g, mask, scale):
    """An op whose schema takes a Python float: a runtime number's symbol does not fit it."""
    return torch.ops.aten.native_dropout_backward(g, mask, scale) + 1


def test_a_float_argument_an_ops_schema_takes_as_a_literal_is_specialised():
    """A float argument passed where an op's schema has a float (native_dropout_backward's
    scale, batch norm's momentum) was a refusal: traced as a runtime number it is a SymFloat,
    which the schema does not take. The failed trace now specialises the floats, as a branch
    on one does."""
    g, mask = _x(), _x(seed=1) > 0
    compiled = tjit.compile(_dropout_backward)
    for scale in [2.0, 1.25, 2.0]:
        check_against_eager(_dropout_backward, g, mask, scale, compiled=compiled)
    assert compiled.literal_numbers and "native_dropout_backward" in compiled.literal_numbers


def test_a_dynamic_graphs_float_an_ops_schema_takes_is_compiled_per_value():
    """With dynamic=True, Dynamo passes a float argument as a 0-d tensor that the graph reads
    by .item(); where an op's schema takes it as a float, the graph ran eagerly (a warning:
    "Expected a value of type 'float' ... found type 'SymFloat'"). It is now compiled with the
    value (runtime/split.py, as for a number Python code branches on)."""
    import warnings
    g, mask = _x(), _x(seed=1) > 0
    compiled = torch.compile(_dropout_backward, backend="tjit", dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no graph runs eagerly)
        for scale in [2.0, 1.25]:
            before = tjit.counters.launches
            assert_matches_eager(compiled(g, mask, scale), _dropout_backward(g, mask, scale))
            assert tjit.counters.launches > before


class _CheckpointedNorm(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.linear = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)

    def block(self, x):
        return x + self.linear(self.norm(x))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def test_a_number_read_inside_a_checkpointed_block_is_compiled_per_value():
    """With dynamic=True, a checkpointed block's LayerNorm reads its eps by .item() inside the
    checkpoint's subgraph, where split.py did not look: the whole graph ran eagerly, without
    a warning. The read is now specialised as one in the graph itself is."""
    import warnings
    torch.manual_seed(0)
    model = _CheckpointedNorm(70)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tjit", dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no graph runs eagerly)
        for rows in (300, 130):
            x = torch.randn(2, rows, 70)
            before = tjit.counters.launches
            got, want = compiled(x), eager(x)
            assert tjit.counters.launches > before
            got.square().sum().backward()
            want.square().sum().backward()
            torch.testing.assert_close(got, want)
            for p, q in zip(model.parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


def test_a_graph_that_runs_eagerly_for_its_data_dependent_ops_says_so():
    """Under capture_scalar_outputs Dynamo keeps .item() in its graphs; a graph tjit cannot
    hold runs eagerly, as it did silently."""
    def f(x):
        n = (x > 0).sum().item()
        return x[:n] * 2
    x = torch.randn(300, 70)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        with pytest.warns(UserWarning, match="tjit runs a graph of .* nodes eagerly"):
            got = torch.compile(f, backend="tjit")(x)
    assert_matches_eager(got, f(x))

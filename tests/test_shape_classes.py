"""Compile once per shape class (frontend/shape_class.py): one symbolic trace, and every new
size of the class lowered from it without tracing. Each call is checked against eager on
fresh inputs (outputs poisoned: conftest), at sizes of one and of many programs, sizes that
are multiples of no block, above every block size, and transposed; the counters show what
was traced and what was specialised."""
import random
import sys

import pytest
import torch
import torch.nn.functional as F

import tjit
from tjit.frontend.shape_class import ShapeClasses
from tjit.frontend.trace import trace
from tjit.ir.graph import format_graph
from tjit.pipeline import convert

from helpers import assert_matches_eager, check_against_eager
from test_autograd import check_grads

pytestmark = pytest.mark.usefixtures("fresh_seed")

# rows x columns: one program, several, a prime, above every block size, one column past 1024
SIZES = [(37, 300), (5, 40), (1500, 7), (3, 4097), (130, 1025), (64, 64)]


def scaled_softmax_plus_half_row_sum(x, w):
    """Sizes as Python numbers too: a slice to half the columns."""
    return torch.softmax(x * w, -1) * 0.5 + x[:, : x.shape[1] // 2].sum(1, keepdim=True)


def norm_and_scan(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b) * torch.sigmoid(torch.cumsum(x, -1))


def reshaped_by_its_sizes(x, w, b):
    """view, arange and new_zeros sized by the input: numbers computed from sizes."""
    rows, cols = x.shape
    y = (x * w + b).view(rows * cols // cols, cols, 1).squeeze(-1)
    return y + torch.arange(rows, dtype=x.dtype)[:, None] + x.new_zeros(cols)


def counted(before: dict) -> dict:
    now = tjit.counters.snapshot()
    return {k: now[k] - before[k] for k in ("traces", "specialised")}


def arguments(fn, rows: int, cols: int):
    x = torch.randn(rows, cols)
    if fn is scaled_softmax_plus_half_row_sum:
        return x, torch.randn(cols)
    return x, torch.randn(cols), torch.randn(cols)


@pytest.mark.parametrize("fn", [scaled_softmax_plus_half_row_sum, norm_and_scan, reshaped_by_its_sizes],
                         ids=lambda f: f.__name__)
def test_every_size_of_a_class_after_the_first_trace_is_specialised_not_traced(fn):
    compiled = tjit.compile(fn, dynamic=True)
    before = tjit.counters.snapshot()
    for rows, cols in SIZES:
        check_against_eager(fn, *arguments(fn, rows, cols), compiled=compiled)
    assert counted(before) == {"traces": 1, "specialised": len(SIZES)}


def test_by_default_the_second_size_of_a_class_is_traced_symbolically():
    """The first size is traced as it is (most functions see one size); the second traces the
    class; the rest are specialised. Size 1 is a class of its own (torch specialises it)."""
    fn = norm_and_scan
    compiled = tjit.compile(fn)
    before = tjit.counters.snapshot()
    for rows, cols in SIZES[:4]:
        check_against_eager(fn, *arguments(fn, rows, cols), compiled=compiled)
    assert counted(before) == {"traces": 2, "specialised": 3}
    check_against_eager(fn, *arguments(fn, 1, 300), compiled=compiled)
    assert counted(before) == {"traces": 3, "specialised": 3}
    off = tjit.compile(fn, dynamic=False)
    before = tjit.counters.snapshot()
    for rows, cols in SIZES[:3]:
        check_against_eager(fn, *arguments(fn, rows, cols), compiled=off)
    assert counted(before) == {"traces": 3, "specialised": 0}


def test_a_specialised_size_runs_none_of_the_functions_python(monkeypatch):
    """(Without TJIT_VERIFY, whose check traces each specialised size again to compare.) The
    function's frames are counted by a profile hook: a side effect in its code (a list it
    appends to) would send it through Dynamo, which runs its Python at every call as eager
    does."""
    monkeypatch.setenv("TJIT_VERIFY", "0")
    calls = []

    def fn(x, w):
        return torch.softmax(x * w, -1)

    def count_calls(frame, event, arg):
        if event == "call" and frame.f_code is fn.__code__:
            calls.append(1)
    compiled = tjit.compile(fn, dynamic=True)
    sys.setprofile(count_calls)
    try:
        for rows, cols in SIZES:
            x, w = arguments(scaled_softmax_plus_half_row_sum, rows, cols)
            torch.testing.assert_close(compiled(x, w), torch.softmax(x * w, -1))
    finally:
        sys.setprofile(None)
    assert len(calls) == 1  # (the symbolic trace)


def branches_on_a_size(x):
    return x.sum(0) if x.shape[0] > 64 else x.cumsum(0) * 2


def test_a_branch_on_a_size_is_guarded():
    """The trace at 100 rows took the sum: its guard (rows > 64) sends 30 rows to a trace of
    their own, which took the scan; later sizes each find the trace whose guards they pass."""
    compiled = tjit.compile(branches_on_a_size, dynamic=True)
    before = tjit.counters.snapshot()
    for rows in (100, 30, 65, 64, 2000, 3):
        # (small integers, whose sums are exact: a float32 sum of 2000 random normals, added in
        # another order than eager's, missed the tolerance in 1 run of 10, by rounding alone)
        x = torch.randint(-8, 9, (rows, 77)).float()
        check_against_eager(branches_on_a_size, x, compiled=compiled)
    assert counted(before) == {"traces": 2, "specialised": 6}


def test_a_broadcast_needs_its_sizes_equal_and_another_layout_its_own_trace():
    """x * w guards w's length equal to x's columns (not assumed from one call where they
    were equal to the rows too); a transposed x fails the stride guards and is traced again."""
    fn = scaled_softmax_plus_half_row_sum
    compiled = tjit.compile(fn, dynamic=True)
    before = tjit.counters.snapshot()
    for rows, cols in [(40, 40), (7, 40), (40, 9)]:
        check_against_eager(fn, *arguments(fn, rows, cols), compiled=compiled)
    x, w = torch.randn(300, 37).t(), torch.randn(300)
    check_against_eager(fn, x, w, compiled=compiled)
    check_against_eager(fn, torch.randn(500, 70).t(), torch.randn(500), compiled=compiled)
    assert counted(before) == {"traces": 2, "specialised": 5}
    with pytest.raises(RuntimeError):  # (eager's error: the sizes do not broadcast)
        compiled(torch.randn(7, 40), torch.randn(41))


def test_gradients_of_every_size_match_eager():
    fn = norm_and_scan
    compiled = tjit.compile(fn, dynamic=True)
    before = tjit.counters.snapshot()
    for rows, cols in SIZES[:4]:
        check_grads(fn, *arguments(fn, rows, cols), compiled=compiled)
    assert counted(before) == {"traces": 1, "specialised": 4}


def test_a_float_argument_stays_a_runtime_number_across_sizes():
    def fn(x, w, lr: float):
        return torch.softmax(x * w, -1) * lr
    compiled = tjit.compile(fn, dynamic=True)
    before, generated = tjit.counters.snapshot(), tjit.counters.kernels_generated
    for (rows, cols), lr in zip(SIZES[:4], (0.1, 2.5, -1.0, 1e-3)):
        check_against_eager(fn, torch.randn(rows, cols), torch.randn(cols), lr, compiled=compiled)
    assert counted(before) == {"traces": 1, "specialised": 4}


@pytest.mark.parametrize("fn", [scaled_softmax_plus_half_row_sum, norm_and_scan, reshaped_by_its_sizes,
                                branches_on_a_size], ids=lambda f: f.__name__)
def test_a_specialised_trace_converts_to_the_graph_a_trace_at_that_size_gives(fn):
    """The specialised aten graph carries what the converter reads (sizes, strides, storages)
    as a trace at those sizes gives it: the two IR graphs print the same."""
    classes = ShapeClasses(dynamic=True)
    for rows, cols in [(37, 300), (100, 41), (2, 5000)]:
        args = arguments(fn, rows, cols) if fn is not branches_on_a_size else (torch.randn(rows, cols),)
        specialised = classes.traced(("class",), fn, args, {}, frozenset())
        assert specialised is not None
        assert format_graph(convert(specialised).graph) == format_graph(trace(fn, args, {}).graph)


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
def test_a_dynamo_graph_with_symbolic_sizes_is_traced_once(dynamic):
    """Dynamo passes a dynamic graph's sizes as ints: they are symbols of the one trace too
    (a view sized by them, and a size added to the result). Automatic dynamic: Dynamo's
    first graph is static, its second (from the second size) dynamic."""
    def fn(x, w):
        y = torch.softmax(x * w, -1)
        return y.view(x.shape[0] * 2, -1).sum(1) + x.shape[0]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tjit", dynamic=dynamic)
    before = tjit.counters.snapshot()
    for rows in (37, 5, 1000, 6):
        x, w = torch.randn(rows, 300), torch.randn(300)
        check_against_eager(fn, x, w, compiled=compiled)
    assert counted(before) == ({"traces": 1, "specialised": 4} if dynamic else {"traces": 2, "specialised": 3})


def shifted_label_loss(logits, labels, ignore_index: int = -100):
    """transformers' causal-LM loss: labels padded with ignore_index and shifted by one."""
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=ignore_index)


class DropoutFromAttribute(torch.nn.Module):
    """A float attribute (a dropout probability) that Dynamo passes, with dynamic=True, as a
    0-d tensor read by .item(): the graph is specialised on its value, and stays symbolic in
    its sizes."""

    def __init__(self):
        super().__init__()
        self.p = 0.0

    def forward(self, x):
        return F.dropout(torch.softmax(x, -1), self.p, self.training) * x.shape[0]


@pytest.mark.parametrize("fn", [shifted_label_loss, DropoutFromAttribute()], ids=["padded_loss", "dropout_attribute"])
def test_a_dynamo_graph_with_pads_negative_ints_and_item_reads_is_traced_once(fn):
    """GPT-2's loss and dropout graphs with dynamic=True were traced at every size: F.pad's
    C++ kernel read the sizes (specialising all of them) where torch's Python dispatcher has
    a symbolic one, ignore_index=-100 made a symbol assumed positive (an assertion), and a
    graph specialised on its .item() values was compiled without its size symbols."""
    torch._dynamo.reset()
    optimized = torch.compile(fn, backend="tjit", dynamic=True)
    compiled = lambda *args: optimized(*args)  # noqa: E731 (a module's wrapper has no truth value)
    for k, tokens in enumerate((7, 13, 300, 41)):
        logits, labels = torch.randn(2, tokens, 97), torch.randint(0, 97, (2, tokens))
        labels[0, :3] = -100
        args = (logits, labels) if fn is shifted_label_loss else (logits,)
        check_against_eager(fn, *args, compiled=compiled)
        if k == 0:  # (the dropout graph's first call also traces to find that it reads p's value)
            before = tjit.counters.snapshot()
    assert counted(before) == {"traces": 0, "specialised": 3}


def test_a_guard_that_is_a_disjunction_keeps_the_other_guards():
    """A branch on `n == 13 or n == 14` is one guard that prints as a disjunction. torch's
    produce_guards_expression joins guards with a bare `and`, so `y == 7 and ... and n == 13
    or n == 14 and ...` admitted a call with 9 rows of y and 14 of x, and the graph traced for
    7 rows of y (its sum not scaled by 10) ran on it: a wrong answer, 57 off. Each guard is
    parenthesised now; the second call is traced for its own sizes."""
    def fn(y, x):
        n = x.shape[0]
        return y.sum(0) if y.shape[0] == 7 else y.sum(0) * 10, x * (2.0 if (n == 13) | (n == 14) else 3.0)
    compiled = tjit.compile(fn, dynamic=True)
    for y, x in ((torch.randn(7, 40), torch.randn(13, 40)), (torch.randn(9, 40), torch.randn(14, 40)),
                 (torch.randn(7, 40), torch.randn(40, 14).t())):
        check_against_eager(fn, y, x, compiled=compiled)


def test_a_dynamo_size_of_one_is_a_class_of_its_own_and_specialised_in_it():
    """A size Dynamo passes as an int (a SymInt in its graph: funnel's pooled lengths) may be 1
    at a call: the trace then holds it as the int 1, guarded, and a later call of that class
    is specialised from it (this once failed binding the trace's symbols)."""
    from tjit.runtime.compiled import CompiledFunction

    def fn(x, n):
        return x.reshape(n, -1).sum(0) * 2
    compiled = CompiledFunction(fn, dynamic=True, size_positions=frozenset({1}), split_data_dependent=False)
    before = tjit.counters.snapshot()
    for n, rows in [(1, 6), (1, 40), (3, 6), (4, 1000), (1, 1030), (2, 8)]:
        check_against_eager(fn, torch.randn(rows, 5), n, compiled=compiled)
    assert counted(before) == {"traces": 2, "specialised": 6}


@pytest.mark.parametrize("seed", range(20))
def test_random_compositions_specialised_at_other_sizes_match_eager(seed):
    """test_random_compositions' functions (views, reductions, scans, gathers by an index
    tensor taken modulo a size, totals), traced once with symbolic sizes and run at sizes of
    one and of several programs."""
    from test_random_compositions import random_function
    rng = random.Random(seed)
    fn, steps = random_function(rng)
    dtype = rng.choice([torch.float32, torch.float64])  # (a 16-bit sum of 77000 values: its rounding, not the trace)
    compiled = tjit.compile(fn, dynamic=True)
    before = tjit.counters.snapshot()
    for shape in [(rng.randint(2, 9), rng.randint(2, 40)), (70, 1100), (rng.randint(2, 9), rng.randint(2, 40))]:
        x, y = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        i = torch.randint(0, 50, (rng.randint(2, 5),))
        try:
            fn(x, y, i)
        except RuntimeError:
            pytest.skip(f"eager refuses {steps}")
        check_against_eager(fn, x, y, i, compiled=compiled)
    assert counted(before)["specialised"] == 3  # (none traced for its own sizes)


@pytest.mark.parametrize("seed", range(4))
def test_random_model_blocks_specialised_at_other_sizes_have_eagers_gradients(seed):
    """test_random_compositions' model blocks (norms, activations, softmax, products,
    attention), x and the weights requiring grad, traced once with symbolic sizes and
    differentiated at three batch and sequence sizes."""
    from test_random_compositions import D, evaluate, random_block
    rng = random.Random(seed)
    tree = random_block(rng)
    while "linear" not in str(tree) and "attention" not in str(tree):
        tree = random_block(rng)

    def block(x, w0, w1):
        return evaluate(tree, x, [w0, w1], {})
    compiled = tjit.compile(block, dynamic=True)
    before = tjit.counters.snapshot()
    for batch, seq in [(2, 24), (3, 7), (2, 70)]:
        check_grads(block, torch.randn(batch, seq, D), torch.randn(D, D) / 7, torch.randn(D, D) / 7,
                    compiled=compiled, atol=1e-4, rtol=1e-4)
    assert counted(before) == {"traces": 1, "specialised": 3}


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(24, 40), torch.nn.Linear(40, 24)

    def forward(self, x):
        return self.down(F.gelu(self.up(F.layer_norm(x, (24,))))).softmax(-1) * x.shape[0]


def test_a_dynamo_graphs_static_sizes_stay_static_in_its_symbolic_trace():
    """Dynamo makes symbols of the sizes it saw change (dynamic=True: the inputs', not the
    parameters'); tjit's symbolic trace of the graph made every size a symbol, and ViT's took
    16 s of torch's symbolic reasoning for one trace (0.4 s now). Only Dynamo's symbols are
    symbols there now."""
    from tjit.runtime import split
    runs = []

    def backend(gm, example_inputs):
        runs.append(split.graph_backend(gm, example_inputs))
        return runs[-1]
    torch._dynamo.reset()
    model = TwoLinears()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for batch, rows in ((3, 5), (4, 1000), (7, 33)):
        x = torch.randn(batch, rows, 24)
        with torch.no_grad():
            assert_matches_eager(compiled(x), model(x))
    (run,) = runs
    (shape_class,) = [c for classes in run.split_graph.compiled._shape_classes._traces.values() for c in classes]
    symbolic = [tuple(isinstance(n, torch.SymInt) for n in t.shape) for t in shape_class.traced.inputs
                if isinstance(t, torch.Tensor)]
    assert sorted(symbolic) == sorted([(True, True, False), (False, False), (False,), (False, False), (False,)])


def test_a_static_size_that_changes_is_not_specialised_from_another_trace():
    """A size kept static in a symbolic trace (dynamic_dims) is guarded: a call where it
    differs gets a trace of its own, never the other trace's graph."""
    from tjit.runtime.compiled import CompiledFunction

    def fn(x, w):
        return (x * w).sum(-1) + x.shape[1]
    compiled = CompiledFunction(fn, dynamic=True, dynamic_dims={0: (True, False), 1: (False,)},
                                split_data_dependent=False)
    for rows, cols in ((5, 7), (6, 8), (9, 7), (300, 8), (4, 7)):
        check_against_eager(fn, torch.randn(rows, cols), torch.randn(cols), compiled=compiled)
    traces = [c.traced for classes in compiled._shape_classes._traces.values() for c in classes]
    assert sorted(t.inputs[0].shape[1] for t in traces) == [7, 8]


def test_the_second_sizes_symbolic_trace_makes_symbols_of_the_sizes_that_changed():
    """As Dynamo's automatic dynamic: at a class's second size only the sizes that changed
    since its first call are symbols (a weight's stay as they are: a transformer block's
    second size took 2.4 s to trace with every size a symbol, 0.9 s now); a later call that
    changes another size gets a symbolic trace of its own, with that size a symbol too."""
    def fn(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b).softmax(-1) @ w.expand(4, -1).t()
    compiled = tjit.compile(fn)
    for rows, cols in ((16, 64), (24, 64), (40, 64), (24, 96), (50, 80)):
        check_against_eager(fn, torch.randn(rows, cols), torch.randn(cols), torch.randn(cols), compiled=compiled)
    traces = [c.traced for classes in compiled._shape_classes._traces.values() for c in classes]
    symbolic = [[tuple(isinstance(n, torch.SymInt) for n in t.shape) for t in traced.inputs] for traced in traces]
    assert symbolic == [[(True, False), (False,), (False,)], [(True, True), (True,), (True,)]]


SYMBOLIC_META_CASES = {
    "cumsum": lambda x: torch.cumsum(x, 1),
    "cumsum_of_ints": lambda x: torch.cumsum((x > 0).to(torch.int32), -1),
    "cumsum_of_bools": lambda x: torch.cumsum(x > 0, 0),
    "cumsum_to_a_dtype": lambda x: torch.cumsum(x, 0, dtype=torch.float64),
    "cumprod": lambda x: torch.cumprod(x, -1),
    "softmax": lambda x: torch.softmax(x, 1),
    "log_softmax": lambda x: F.log_softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-2:]),
    "layer_norm_with_parameters": lambda x: F.layer_norm(x, x.shape[-1:], torch.ones(x.shape[-1], dtype=x.dtype),
                                                         torch.zeros(x.shape[-1], dtype=x.dtype)),
    # (outside the plain cases in bfloat16: the fake mode's own computation)
    "layer_norm_with_float32_parameters": lambda x: F.layer_norm(x, x.shape[-1:], torch.ones(x.shape[-1])),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", SYMBOLIC_META_CASES)
def test_ops_computed_directly_in_a_symbolic_trace_give_the_concrete_traces_results(name, dtype, monkeypatch):
    """frontend/symbolic_metas.py builds a few ops' fake results without their Python
    decompositions: in each layout (contiguous, transposed, with a size of 1) the symbolic
    fake result has the concrete fake mode's shape, strides and dtype."""
    import tjit.frontend.trace as trace_module
    from torch._subclasses.fake_tensor import FakeTensorMode
    direct, built = trace_module.symbolic_meta, []

    def counted(mode, func, args, kwargs):
        result = direct(mode, func, args, kwargs)
        built.append(result is not NotImplemented)
        return result
    monkeypatch.setattr(trace_module, "symbolic_meta", counted)
    fn = SYMBOLIC_META_CASES[name]
    for x in (torch.randn(5, 6, 7), torch.randn(6, 5, 7).transpose(0, 1), torch.randn(5, 1, 7).permute(2, 0, 1)):
        x = x.to(dtype)
        results = []
        for mode in (FakeTensorMode(), trace_module._fake_mode(symbolic=True)):
            fake = mode.from_tensor(x, static_shapes=mode.static_shapes)
            with mode:
                out = fn(fake)
            results.append((tuple(int(n) for n in out.shape), tuple(int(s) for s in out.stride()), out.dtype))
        assert results[0] == results[1]
    assert any(built) == (name != "layer_norm_with_float32_parameters" or dtype == torch.float32)

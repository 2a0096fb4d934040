"""What a compiled function returns is what eager returns: the same gradients where eager's
formulas differ from differentiating tjit's IR naively, the same `requires_grad` on every
result, the same result types (torch.return_types named tuples), and tensors nested in list
arguments treated as inputs. Each case is a bug found by running torch's OpInfo samples
through tjit ("No op left behind").

Every comparison runs eager and tjit on separate copies of fresh random inputs and
backpropagates the same random incoming gradients through both.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_structure

import tjit
from helpers import clone_args

pytestmark = [
    pytest.mark.usefixtures("fresh_seed"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy, inside the interpreter, on inf/nan
]

inf, nan = math.inf, math.nan


def check(fn, *args, requires=None, compiled=None):
    """fn compiled against eager on copies of args (floating tensors require grad, or those
    at the positions in `requires`; tensors inside lists and dicts too): result structure
    and types, values, which results require grad, and every input's .grad (None included)
    after backward of random incoming gradients on the results eager differentiates."""
    def copies():
        def leaf(k, a):
            if not isinstance(a, torch.Tensor):
                return a
            c = clone_args([a])[0]
            return c.requires_grad_(a.is_floating_point() if requires is None else k in requires)
        return [[leaf(k, v) for v in a] if isinstance(a, list) else
                {n: leaf(k, v) for n, v in a.items()} if isinstance(a, dict) else leaf(k, a)
                for k, a in enumerate(args)]

    theirs, ours = copies(), copies()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = fn(*theirs)
        got = (compiled or tjit.compile(fn))(*ours)
    assert tree_structure(got) == tree_structure(expected), f"{type(got)} where eager returns {type(expected)}"
    got_leaves, expected_leaves = tree_leaves(got), tree_leaves(expected)
    for k, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        if not isinstance(e, torch.Tensor):
            assert g == e, f"result {k}: {g!r}, eager's {e!r}"
            continue
        torch.testing.assert_close(g, e, equal_nan=True, msg=lambda m: f"result {k}\n{m}")
        assert g.requires_grad == e.requires_grad, \
            f"result {k}: requires_grad {g.requires_grad}, eager's {e.requires_grad}"
    pairs = [(g, e) for g, e in zip(got_leaves, expected_leaves) if isinstance(e, torch.Tensor) and e.requires_grad]
    if pairs:
        incoming = [torch.randn_like(e) for _, e in pairs]
        torch.autograd.backward([e for _, e in pairs], incoming)
        torch.autograd.backward([g for g, _ in pairs], incoming)
    for k, (a, b) in enumerate(zip(tree_leaves(ours), tree_leaves(theirs))):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert (a.grad is None) == (b.grad is None), f"input {k}: .grad {a.grad} where eager's is {b.grad}"
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, equal_nan=True, msg=lambda m: f"gradient of input {k}\n{m}")
    return got


# -- embedding and other gathers with many indices per line: a scatter-add through a view ------------------
@pytest.mark.parametrize("shape", [(64, 32), (8, 16), (3, 17), (200,)])
def test_embedding_gradient_with_many_indices_per_line(shape):
    # the table is gathered through an unsqueezed, broadcast view of the input: its scatter-add
    # gradient (more than 16 indices per line) used to be refused as "into a computed value"
    weight = torch.randn(50, 8)
    check(lambda i, w: F.embedding(i, w), torch.randint(0, 50, shape), weight, requires=(1,))


SCATTERS_THROUGH_VIEWS = {
    "embedding_of_a_slice": (lambda i, w: F.embedding(i, w[3:]) * 2, (0, 47)),
    "embedding_of_a_transpose": (lambda i, w: F.embedding(i, w.t()), (0, 8)),
    "embedding_of_a_reshape": (lambda i, w: F.embedding(i, w.reshape(25, 16)), (0, 25)),
    "embedding_of_a_cast": (lambda i, w: F.embedding(i, w.double()), (0, 50)),
    "embedding_of_a_copied_transpose": (lambda i, w: F.embedding(i, w.t().reshape(50, 8)), (0, 50)),
    "index_select_columns": (lambda i, w: w.index_select(1, i[0]), (0, 8)),
    "index_of_a_transpose": (lambda i, w: w.t()[i[0]], (0, 8)),
    "negative_index_plus_a_sum": (lambda i, w: w[i[0]] + w.sum(0), (-50, 50)),
    "gather_along_rows": (lambda i, w: torch.gather(w.t(), 1, i[:8]), (0, 50)),
}


@pytest.mark.parametrize("name", SCATTERS_THROUGH_VIEWS)
def test_scatter_gradient_through_a_view_of_the_input(name):
    fn, (low, high) = SCATTERS_THROUGH_VIEWS[name]
    check(fn, torch.randint(low, high, (9, 40)), torch.randn(50, 8), requires=(1,))


def test_scatter_gradient_into_a_non_contiguous_input():
    table = torch.randn(8, 50).t()  # (50, 8), column-major
    check(lambda i, w: F.embedding(i, w), torch.randint(0, 50, (4, 30)), table, requires=(1,))
    check(lambda i, w: F.embedding(i, w[5:, 1:]), torch.randint(0, 45, (4, 30)), table, requires=(1,))


@pytest.mark.parametrize("index", [torch.tensor(0), torch.tensor([0]), torch.tensor([0, 0, 0])])
def test_gather_of_a_zero_dim_input(index):
    # a 0-d index used to give a (1,)-shaped value where eager's is 0-d (its gradient failed)
    check(lambda x, i: torch.gather(x, 0, i) * 2, torch.randn(()), index)


@pytest.mark.parametrize("op", [torch.cummax, torch.cummin])
def test_cummax_gradient_through_a_view(op):
    x = torch.randn(30, 40)
    check(lambda x: op(x.t(), 1), x)
    check(lambda x: op(x[:, 1:], 0), x)


# -- zero-size parts ------------------------------------------------------------------------------
ZERO_SIZE = {
    "split_with_an_empty_part": lambda x: [t * 2 for t in torch.split(x, [1, 4, 0])],
    "split_with_sizes_copy": lambda x: torch.split_with_sizes_copy(x, [1, 4, 0]),
    "split_with_sizes_copy_empty_ends": lambda x: torch.split_with_sizes_copy(x, [0, 5, 0], 1),
    "empty_slice_beside_another": lambda x: (x[:, 2:2] * 3, x[1:] + 1),
    "empty_middle_part": lambda x: torch.split(x, [2, 0, 3], 2)[1].exp(),
    "cumsum_of_nothing": lambda x: torch.cumsum(x[:0], 0),
    "sum_over_an_empty_axis": lambda x: x[:, :0].sum(1),
}


@pytest.mark.parametrize("name", ZERO_SIZE)
def test_gradient_with_zero_size_parts(name):
    # a zero-size output's gradient used to be read back (an indexed read of an empty
    # buffer: an out-of-bounds load, or a crash in the backward's compile)
    check(ZERO_SIZE[name], torch.randn(5, 5, 5))


def test_gradient_of_a_zero_size_input():
    check(lambda x, y: (x.sum(0) + y, x * 2), torch.randn(0, 3), torch.randn(3))


@pytest.mark.parametrize("shape", [(1, 4, 0, 6), (0, 4, 4, 6), (2, 0, 4, 6)])
def test_pixel_unshuffle_of_an_empty_tensor(shape):
    """Eager's CPU kernel returns a copy of an empty input, in its shape; torch's decomposition
    gave the unshuffled one ([1, 16, 0, 3] for [1, 4, 0, 6]). (No gradient: eager's backward
    of it fails, unshuffled gradient against the input's shape.)"""
    assert check(lambda x: F.pixel_unshuffle(x, 2) * 2, torch.randn(shape), requires=()).shape == shape


def test_gather_from_an_empty_axis_raises_instead_of_reading_out_of_bounds():
    program = textwrap.dedent("""
        import torch, tjit
        f = tjit.compile(lambda x, i: x.index_select(1, i) + 1)
        try:
            f(torch.randn(4, 0, 3), torch.tensor([0, 1]))
        except IndexError as e:
            print("IndexError", e)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "IndexError" in done.stdout, (done.returncode, done.stderr[-2000:])


# -- results that require grad as eager's do -----------------------------------------------------------
REQUIRES_GRAD = {
    "fill": (lambda x, y: torch.fill(x, 2.0), ()),
    "fill_times_another": (lambda x, y: torch.fill(x, 2.0) * y, ()),
    "zero_": (lambda x, y: (x * 1).zero_(), ()),
    "fill_": (lambda x, y: x.clone().fill_(3.0) + 1, ()),
    "norm_of_order_0": (lambda x, y: x.norm(p=0), ()),
    "vector_norm_of_order_0": (lambda x, y: torch.linalg.vector_norm(x, 0, dim=1), ()),
    "pow_0": (lambda x, y: x ** 0 * 3, ()),
    "detached_and_not": (lambda x, y: (torch.zeros_like(x), x.detach(), x.detach()[1:], x.data, x, x[1:]), ()),
    "detached_result": (lambda x, y: (x * 2, (x * 2).detach()), ()),
    # an op's side results eager does not differentiate: layer norm's mean and rstd, lu's P
    "native_layer_norm": (lambda x, y: torch.native_layer_norm(x, (5,), y, y, 1e-5), ()),
    "lu": (lambda x, y: torch.linalg.lu(x), ()),
}


@pytest.mark.parametrize("name", REQUIRES_GRAD)
def test_results_require_grad_as_in_eager(name):
    # eager's fill/zero_/norm(p=0)/x**0 require grad (with a zero or no gradient); tjit's IR
    # holds a literal or a count there, and a detach() of an input is the input itself
    fn, _ = REQUIRES_GRAD[name]
    check(fn, torch.randn(4, 5), torch.randn(5))


LIST_ARGUMENTS = {
    "einsum_outer": (lambda ts: torch.einsum("i,j->ij", ts[0], ts[1]), lambda: [[torch.randn(5), torch.randn(3)]]),
    "einsum_list": (lambda ts: torch.einsum("ij,j->ij", ts), lambda: [[torch.randn(4, 5), torch.randn(5)]]),
    "einsum_sum": (lambda ts: torch.einsum("ij->j", ts), lambda: [[torch.randn(4, 5)]]),
    "einsum_diagonal": (lambda ts: torch.einsum("iji->j", ts), lambda: [[torch.randn(3, 4, 3)]]),
    "meshgrid_ij": (lambda ts: torch.meshgrid(ts, indexing="ij"), lambda: [[torch.randn(5), torch.randn(()),
                                                                            torch.randn(3)]]),
    "meshgrid_xy": (lambda ts: torch.meshgrid(*ts, indexing="xy"), lambda: [[torch.randn(5), torch.randn(3)]]),
    "dict": (lambda d: d["a"] * d["b"], lambda: [{"a": torch.randn(4, 5), "b": torch.randn(5)}]),
}


@pytest.mark.parametrize("name", LIST_ARGUMENTS)
def test_tensors_in_list_arguments_are_inputs(name):
    # they used to be baked into the trace as constants (no gradient, a retrace per value)
    fn, make = LIST_ARGUMENTS[name]
    compiled = tjit.compile(fn)
    check(fn, *make(), compiled=compiled)
    traces = tjit.counters.traces
    check(fn, *make(), compiled=compiled)  # new values, same layouts: no retrace
    assert tjit.counters.traces == traces


def test_list_argument_without_grad_follows_new_values():
    f = tjit.compile(lambda ts, scale: (ts[0] + ts[1]) * scale)
    for _ in range(2):
        a, b = torch.randn(3000), torch.randn(3000)
        torch.testing.assert_close(f([a, b], 2.0), (a + b) * 2.0)


# -- result types ------------------------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "first second")
RETURN_TYPES = {
    "max": lambda x: x.max(1),
    "min_keepdim": lambda x: torch.min(x, 0, keepdim=True),
    "cummax": lambda x: x.cummax(1),
    "cummin": lambda x: torch.cummin(x, 0),
    "aminmax": lambda x: torch.aminmax(x, dim=1),
    "values_attribute": lambda x: x.max(1).values * 2 + x.min(0).indices.sum(),
    "nested": lambda x: {"a": [x.max(1)], "b": (torch.cummin(x, 1), 3)},
    # a named tuple of the user's: FX wrote it as a call of its class, which tjit refused as no aten op
    "users_named_tuple": lambda x: Pair(x.max(1).values, x * 2),
    "users_named_tuple_nested": lambda x: {"p": [Pair(x.exp(), Pair(x.sum(0), 3))]},
}
NO_GRAD_RETURN_TYPES = {  # library calls: no gradient through them yet
    "sort": lambda x: x.sort(1),
    "topk": lambda x: x.topk(3),
    "kthvalue": lambda x: x.kthvalue(2, 1),
    "median": lambda x: x.median(1),
}


@pytest.mark.parametrize("name", RETURN_TYPES)
def test_results_have_eager_types(name):
    check(RETURN_TYPES[name], torch.randn(6, 7))


@dataclasses.dataclass
class Outputs:
    hidden: torch.Tensor
    loss: torch.Tensor
    steps: int = 3


def _returns_a_dataclass(x):
    return Outputs(x.tanh() * 2, x.square().mean())


def test_a_dataclass_result_is_built_as_eager_builds_it():
    """A dataclass holding tensors among the results: the trace refused it (FX writes it as a
    call of its class). Such a function runs through Dynamo, which builds the object around
    its graph's tensors."""
    x, y = (torch.randn(300, 70, generator=torch.Generator().manual_seed(0)).requires_grad_() for _ in range(2))
    got, expected = tjit.compile(_returns_a_dataclass)(x), _returns_a_dataclass(y)
    assert type(got) is Outputs and got.steps == expected.steps
    torch.testing.assert_close((got.hidden, got.loss), (expected.hidden, expected.loss))
    (got.hidden.sum() + got.loss).backward()
    (expected.hidden.sum() + expected.loss).backward()
    torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("name", NO_GRAD_RETURN_TYPES)
def test_results_have_eager_types_without_grad(name):
    check(NO_GRAD_RETURN_TYPES[name], torch.randn(6, 7), requires=())


@pytest.mark.parametrize("requires", [(), (0,)])
def test_results_have_eager_types_through_torch_compile(requires):
    import torch._dynamo  # noqa: F401
    from tjit.runtime.dynamo_backend import register_dynamo_backend
    register_dynamo_backend()
    fn = lambda x: (x.max(1), torch.aminmax(x, dim=0), x.cummin(1).values * 2)  # noqa: E731
    got = check(fn, torch.randn(6, 7), requires=requires, compiled=torch.compile(fn, backend="tjit"))
    assert got[0].values.shape == (6,)


# -- gradients where eager's formula is not the naive derivative ------------------------------------------
def test_safe_softmax_gradient_of_fully_masked_rows():
    x = torch.randn(6, 7)
    x[1] = -inf  # a row masked out entirely: eager's output and gradient are 0 there
    x[2, :3] = -inf
    x[3, 2] = inf
    x[4, 1] = nan
    x[5] = inf
    check(lambda x: torch.ops.aten._safe_softmax(x, 1), x)
    check(lambda x: torch.ops.aten._safe_softmax(x, 0), x.t().contiguous())
    check(lambda x: torch.ops.aten._safe_softmax(x, -1, torch.float64), x)
    big = torch.randn(3, 5000)  # rows looped over
    big[1] = -inf
    check(lambda x: torch.ops.aten._safe_softmax(x, 1), big)
    check(lambda x: torch.ops.aten._safe_softmax(x, 1, torch.float32), big.half(), requires=())


@pytest.mark.parametrize("value", [1.5, -inf, inf, nan])
def test_softmax_of_one_element(value):
    x = torch.tensor(value)
    check(lambda x: torch.ops.aten._safe_softmax(x, 0), x)
    check(lambda x: (torch.softmax(x, 0), torch.log_softmax(x, 0)), x)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("large", [True, False])
def test_logcumsumexp_gradient_on_opinfo_samples(dim, large):
    # OpInfo's samples: uniform in [-9, 9), the first slice set to 10000 (float32 rounds the
    # results there to 1e-3, which the backward's reverse scans amplify unless they
    # accumulate as eager's do)
    x = torch.rand(5, 5, 5) * 18 - 9
    if large:
        x[0] = 10000
    check(lambda x: torch.logcumsumexp(x, dim), x)


NORM_ORDERS = [2, None, 0.5, 1, 3.5, inf, -inf, -0.5, -1, -2, -3.5]


@pytest.mark.parametrize("ord", NORM_ORDERS)
@pytest.mark.parametrize("keepdim", [False, True])
def test_vector_norm_subgradient_at_zero(ord, keepdim):
    # eager's formulas give 0 where the norm is 0 (and, for orders below 1, at each zero
    # element); differentiating the root of a sum gives inf * 0 = NaN there
    x = torch.randn(4, 6)
    x[0] = 0.0  # a row of zeros
    x[1, :2] = 0.0  # zeros in a row that is not
    check(lambda x: torch.linalg.norm(x, ord, dim=1, keepdim=keepdim), x)
    check(lambda x: torch.linalg.norm(x[0], ord, keepdim=keepdim), x)


def test_norms_of_zero_rows():
    x = torch.randn(3, 6)
    x[0] = 0.0
    check(lambda x: x.norm(dim=1), x)
    check(lambda x: (x * 0).norm() + x.sum(), x)
    check(lambda x: x.norm(p=3, dim=1), x)
    check(lambda x: F.normalize(x, dim=1), x)


# -- a gathered line read along a kernel's reduced axis ------------------------------------------------------
@pytest.mark.parametrize("n", [5, 1031])
def test_gathered_line_along_the_reduced_axis(n):
    # x[t] viewed along the reduced axis of a (n, n) reduction has the reduction's row shape
    # (n,) by chance: it was taken for a row value and gathered at the row's coordinate (a
    # wrong answer, forward and backward; multilabel_margin_loss's gradient met it). Maxima
    # and integer-valued sums are exact in any order.
    x, t = torch.randn(n), torch.randint(0, n, (n,))
    check(lambda x, t: ((x[t][:, None] + x[None, :]).amax(0), x[t] * 2), x, t)
    check(lambda x, t: (x[t][:, None] * x[None, :]).clamp(max=0).sum(0), x.round(), t, requires=())


def test_multilabel_margin_loss_gradient():
    # targets repeated in a row: the gradient's reduction reads a gathered line along its reduced axis
    check(lambda x, t: F.multilabel_margin_loss(x, t), torch.randn(5), torch.tensor([1, 1, 0, 1, 4]))
    check(lambda x, t: F.multilabel_margin_loss(x, t), torch.randn(3, 7), torch.randint(0, 7, (3, 7)))


# -- gradients of library calls from their traced derivative formulas ---------------------------------------
LIBRARY_FORMULAS = {
    # the formula calls the op itself on other arguments: polygamma(n + 1, x) (it was taken
    # for the forward call and replaced by the forward's result)
    **{f"polygamma_{n}": (lambda x, n=n: torch.polygamma(n, x), lambda: torch.rand(1500) + 0.5) for n in range(3)},
    # the matrices are scaled to stay well conditioned (condition number about 3 for any seed):
    # x + 5 * eye reached 2.5e4 on some seeds, and a float32 gradient then differs from eager's
    # by more than the tolerance
    "triangular_solve": (lambda a, b: torch.linalg.solve_triangular(a.tril() / 37**0.5 + 2 * torch.eye(37), b, upper=False),
                         lambda: (torch.randn(3, 37, 37), torch.randn(3, 37, 5))),
    # the result is column-major as eager returns it, and the formula reads it (the backward
    # read the saved result as row-major)
    "inv": (lambda x: torch.linalg.inv(x / 37**0.5 + 3 * torch.eye(37)), lambda: torch.randn(3, 37, 37)),
    "cholesky": (lambda x: torch.linalg.cholesky(x @ x.mT + 37 * torch.eye(37)), lambda: torch.randn(2, 37, 37)),
}


@pytest.mark.parametrize("name", LIBRARY_FORMULAS)
def test_library_call_gradients(name):
    fn, make = LIBRARY_FORMULAS[name]
    args = make()
    check(fn, *(args if isinstance(args, tuple) else (args,)))

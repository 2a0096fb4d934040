"""Matrix products generated as tl.dot kernels with their epilogues fused (frontend/matmul.py,
the IR Dot, lower/codegen.py), against eager: layouts, sizes past every tile, low-precision
types, gradients, the generated-or-library rule, and in-place writes of an operand."""
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tjit
from helpers import assert_as_accurate_as_eager, clone_args, launches

LOW_PRECISION = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _generated_float32_on_the_gpu(request, monkeypatch):
    """With CUDA tensors (TJIT_TEST_DEVICE=cuda) on a GPU without tf32 the rule gives float32
    products to the library (frontend/matmul.py: exact float32 is FMA work for tl.dot there):
    these tests generate them as on the CPU, so that the GPU runs the same kernels and counts,
    checked against eager."""
    if os.environ.get("TJIT_TEST_DEVICE") == "cuda" and "matmul_precision" not in request.node.name:
        monkeypatch.setattr("tjit.frontend.matmul.float32_by_fma_on_gpu", lambda node: False)


def steps(compiled, *args) -> tuple[int, int]:
    """(kernels launched, library calls made) by one call."""
    calls = tjit.counters.library_calls
    kernels = launches(compiled, *args)
    return kernels, tjit.counters.library_calls - calls


def check(fn, *args):
    """Against eager, outputs and inputs written in place: a product's sums run in another
    order than eager's (k in steps of a tile), so float32 is held to rtol 1e-4 (over sums of
    hundreds of terms, torch's default 1.3e-6 is below that order's own effect) and to an
    atol of 1e-5 times the result's largest magnitude (a sum near 0 of terms of size 40
    carries their rounding: cuBLAS sums in yet another order), integers exactly, and 16-bit
    types to no further from the float64 answer than twice eager's own largest error (a
    result rounded to 16 bits then rounds either way)."""
    if args[0].dtype not in LOW_PRECISION:
        compiled = tjit.compile(fn)
        eager_args, tjit_args = clone_args(args), clone_args(args)
        expected, got = fn(*eager_args), compiled(*tjit_args)
        for g, e in zip([got, *tjit_args], [expected, *eager_args]):
            assert g.dtype == e.dtype
            scale = max(1.0, _largest(e.abs().nan_to_num(posinf=0, neginf=0))) if e.is_floating_point() else 1.0
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5 * scale, equal_nan=True)
        return compiled
    compiled = tjit.compile(fn)
    got, eager = compiled(*clone_args(args)), fn(*clone_args(args))
    exact = fn(*[a.double() if a.is_floating_point() else a for a in args])
    assert got.dtype == eager.dtype and got.shape == eager.shape
    tjit_error, eager_error = (_largest((r.double() - exact).abs()) for r in (got, eager))
    assert tjit_error <= 2 * eager_error + 1e-3, (tjit_error, eager_error)
    return compiled


def _largest(errors: torch.Tensor) -> float:
    return errors.max().item() if errors.numel() else 0.0


def gelu_linear(x, w, b):
    return F.gelu(F.linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_gelu_of_linear_is_one_kernel(dtype):
    # [3, 137, 200] @ [200, 150]: rows, columns and k each span several tiles (k steps too)
    x, w, b = torch.randn(3, 137, 200, dtype=dtype), torch.randn(150, 200, dtype=dtype), torch.randn(150, dtype=dtype)
    compiled = check(gelu_linear, x, w, b)
    assert steps(compiled, x, w, b) == (1, 0)


def mlp_block(x, w1, b1, w2, b2):
    return x + F.linear(F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],)), w1, b1)), w2, b2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 300])
def test_a_transformer_mlp_block_is_three_kernels_or_fewer(dtype, width):
    """layer_norm; the first linear with its bias and gelu; the second with its bias and the
    residual add. Where the block's width is at most NESTED_COLUMNS, the second linear
    computes the first on its tiles (its hidden activations are never written): 2 kernels."""
    args = [torch.randn(2, 45, width), torch.randn(200, width) / 10, torch.randn(200), torch.randn(width, 200) / 10,
            torch.randn(width)]
    args = [a.to(dtype) for a in args]
    compiled = check(mlp_block, *args)
    assert steps(compiled, *args) == (2 if width <= 128 else 3, 0)


def scaled_scores(q, k):
    return q @ k.transpose(-1, -2) * 0.125


def relu_matmul(x, w):
    return torch.relu(torch.matmul(x, w))


def relu_addmm(b, x, w):
    return torch.relu(torch.addmm(b, x, w, beta=0.5, alpha=2.0))


def relu_addmm_without_bias(b, x, w):
    return torch.relu(torch.addmm(b, x, w, beta=0))  # eager reads no bias: its NaN goes nowhere


def relu_bmm(x, y):
    return torch.relu(torch.bmm(x, y))


def add_baddbmm(b, x, y):
    return torch.baddbmm(b, x, y, alpha=0.5) + 1


LAYOUTS = {  # name: (function, inputs); one kernel each, and no library call
    "transposed_operands": (scaled_scores, lambda: (torch.randn(2, 3, 70, 24), torch.randn(2, 3, 90, 24))),
    "shared_matrix": (relu_matmul, lambda: (torch.randn(4, 33, 40), torch.randn(40, 70))),
    "strided_and_transposed": (relu_addmm, lambda: (torch.randn(40), torch.randn(70, 33).t(),
                                                    torch.randn(70, 80)[:, ::2])),
    "nan_bias_unread": (relu_addmm_without_bias, lambda: (torch.full((33, 40), float("nan")), torch.randn(33, 70),
                                                          torch.randn(70, 40))),
    "k_of_zero": (relu_matmul, lambda: (torch.randn(33, 0), torch.randn(0, 40))),
    "rows_of_zero": (relu_matmul, lambda: (torch.randn(0, 20), torch.randn(20, 40))),
    "size_one_batch": (relu_bmm, lambda: (torch.randn(1, 33, 17), torch.randn(1, 17, 20))),
    "sliced_operand_views": (relu_bmm, lambda: (torch.randn(3, 40, 50)[:, 5:38, ::3], torch.randn(3, 40, 20)[:, 2:19])),
    "baddbmm": (add_baddbmm, lambda: (torch.randn(3, 1, 20), torch.randn(3, 33, 17), torch.randn(3, 17, 20))),
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layouts_and_sizes(name, dtype):
    fn, make = LAYOUTS[name]
    args = [a.to(dtype) for a in make()]
    compiled = check(fn, *args)
    kernels, calls = steps(compiled, *args)
    assert calls == 0 and kernels <= 1


def test_a_batch_broadcast_on_both_sides_is_copied_once_as_in_eager():
    """[2, 1, m, k] @ [3, k, n]: matmul expands a to [2, 3, m, k] and merges the batch axes,
    which no view of a expresses: a copy (eager's too), then the product."""
    x, w = torch.randn(2, 1, 33, 40), torch.randn(3, 40, 70)
    assert steps(check(relu_matmul, x, w), x, w) == (2, 0)


def softmax_of_linear(x, w, b):
    return torch.softmax(F.linear(x, w, b), -1)


def norm_of_residual_linear(x, h, w, b):
    return F.layer_norm(x + F.linear(h, w, b), (x.shape[-1],))


@pytest.mark.parametrize("columns", [50, 300])  # a whole row in one tile; rows walked in column tiles
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_a_products_rows_are_reduced_in_its_own_kernel(columns, dtype):
    """A row reduction of a product (softmax, a norm of a linear's output) tiles the rows
    over programs (150 rows: several programs) and walks the columns, computing the product
    tile by tile in the reduction's own kernel: no product in memory."""
    x, w, b = (t.to(dtype) for t in (torch.randn(150, 40), torch.randn(columns, 40) / 6, torch.randn(columns)))
    compiled = check(softmax_of_linear, x, w, b)
    assert steps(compiled, x, w, b) == (1, 0)
    assert dot_kernels(compiled, x, w, b) == 1
    args = [t.to(dtype) for t in (torch.randn(3, 50, columns), torch.randn(3, 50, 40), torch.randn(columns, 40) / 6,
                                  torch.randn(columns))]
    assert steps(check(norm_of_residual_linear, *args), *args) == (1, 0)


def test_attention_weights_are_one_kernel():
    """softmax of scaled scores, batched over [b, h]: the product and its softmax in one kernel."""
    def attention_weights(q, k):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1)
    q, k = torch.randn(2, 3, 70, 24), torch.randn(2, 3, 90, 24)
    compiled = check(attention_weights, q, k)
    assert steps(compiled, q, k) == (1, 0)


def test_a_product_read_under_two_shapes_is_computed_once():
    """Attention: the scores are [b*h, s, s] for bmm and [b, h, s, s] for the softmax, and the
    probabilities go back to [b*h, s, s] for the second bmm (a library call: v's 150 columns
    are too many to compute the scores on its tiles). The probabilities' store is computed in
    the softmax's shape, its product with its batch axes split: one kernel (the scores,
    their softmax, the probabilities), then the call."""
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
    q, k, v = torch.randn(2, 3, 70, 16), torch.randn(2, 3, 90, 16), torch.randn(2, 3, 90, 150)
    compiled = check(attention, q, k, v)
    assert steps(compiled, q, k, v) == (1, 1)


# -- products computed on another product's tiles (a nested k loop) ------------------------------
def _causal(scores):
    """Each query sees the keys up to its own position counted from the end (every query at
    least the first key: no row of -inf only, which eager's softmax makes NaN)."""
    keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril(max(0, scores.shape[-1] - scores.shape[-2]))
    return scores.masked_fill(~keep, float("-inf"))


def _scaled_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def _strided(q, k, v):
    """q, k and v laid out [b, s, h, d] (as a projection writes them), read as [b, h, s, d]."""
    return [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]


ATTENTION = {  # (function, shapes of any further inputs, what makes the inputs' layout, kernels)
    "scaled": (_scaled_attention, (), None, 1),
    "additive_mask": (lambda q, k, v, m: torch.softmax(q @ k.transpose(-1, -2) / 8 + m, -1) @ v, ((70, 150),), None, 1),
    "causal": (lambda q, k, v: torch.softmax(_causal(q @ k.transpose(-1, -2) * 0.2), -1) @ v, (), None, 1),
    # (a [b, s, h, d] layout: eager's matmul reshapes q, k and v to [b*h, s, d] for bmm, which
    # copies them; tjit copies them too, the three in one kernel)
    "strided_inputs": (_scaled_attention, (), _strided, 2),
    "fewer_value_columns": (lambda q, k, v: _scaled_attention(q, k, v[..., :29]), (), None, 1),
    # exp(log_softmax): the exponent reads the row max, so it is not computed online: a kernel
    # for the rows' max and sum, then the output's
    "log_softmax_weights": (lambda q, k, v: torch.log_softmax(q @ k.transpose(-1, -2), -1).exp() @ v, (), None, 2),
}


@pytest.mark.parametrize("name", ATTENTION)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_attention_never_writes_its_probabilities(name, dtype):
    """softmax(q @ k.T * scale + mask) @ v in one kernel, as flash attention: each step of
    the output's k loop computes a tile of the scores (a product nested in the operand's
    prologue, a k loop of its own), updates the rows' max and sum and the running max, and
    rescales the accumulator (lower/online_product.py). Queries span several row tiles and
    keys several steps; nothing of the (queries x keys) probabilities is written, and no
    library call runs."""
    fn, more, layout, kernels = ATTENTION[name]
    q, k, v = torch.randn(2, 3, 70, 40), torch.randn(2, 3, 150, 40), torch.randn(2, 3, 150, 40)
    if layout is not None:
        q, k, v = layout(q, k, v)
    args = [t.to(dtype) for t in (q, k, v, *[torch.randn(shape) for shape in more])]
    compiled = check(fn, *args)
    assert steps(compiled, *args) == (kernels, 0)
    copies = 0 if layout is None else sum(t.numel() * t.element_size() for t in args[:3])
    _assert_probabilities_never_written(compiled, args, copies)


@pytest.mark.parametrize("batch", [(2, 1), (1, 1), (1, 2)])
@pytest.mark.parametrize("mask", ["causal", "tril_times"])
def test_attention_with_batch_axes_of_size_one(batch, mask):
    """A coordinate on a nested product's tile (a causal mask from tril) with a batch axis of
    size 1: the kernel drops that axis, and the coordinate's batch terms took the names of
    the rows' and columns' indices (wrong results with size 1 before the rows, a crash
    after them)."""
    def causal(q, k, v):
        return torch.softmax(_causal(q @ k.transpose(-1, -2) * 0.2), -1) @ v

    def tril_times(q, k, v):
        return ((q @ k.transpose(-1, -2)) * torch.ones(q.shape[-2], k.shape[-2]).tril()) @ v
    fn = causal if mask == "causal" else tril_times
    args = [torch.randn(*batch, 70, 40), torch.randn(*batch, 150, 40), torch.randn(*batch, 150, 40)]
    compiled = check(fn, *args)
    assert steps(compiled, *args) == (1, 0)


def _assert_probabilities_never_written(compiled, args, copies=0):
    """Beside the output and `copies` (bytes of copied inputs), the kernels write the rows'
    max and sum only: less than 1/8 of the (queries x keys) probabilities."""
    explanation = tjit.explain(compiled, *args)
    probabilities, out = 2 * 3 * 70 * 150 * args[0].element_size(), compiled(*args)
    written = sum(kernel.bytes_written for kernel in explanation.kernels)
    assert written - copies - out.numel() * out.element_size() < probabilities / 8
    assert explanation.memory.slab_size - copies < probabilities / 8


def _gradients(fn, args, grad_inputs: int, incoming, precision=None) -> list:
    """The gradients of fn's first `grad_inputs` arguments (in `precision`, where given) for
    the incoming gradient `incoming`."""
    leaves = [a.to(precision, copy=True) if precision and a.is_floating_point() else a.clone() for a in args]
    for leaf in leaves[:grad_inputs]:
        leaf.requires_grad_()
    fn(*leaves).backward(incoming.to(precision or incoming.dtype))
    return [leaf.grad for leaf in leaves[:grad_inputs]]


def _assert_gradients_match(got: list, eager: list, exact: list = ()) -> None:
    """float32 gradients within rtol 1e-4 of eager's and 1e-5 of their largest magnitude;
    16-bit ones no further from the float64 answer (`exact`) than twice eager's own largest
    error, plus 1e-3."""
    for k, (g, e) in enumerate(zip(got, eager)):
        assert g.dtype == e.dtype
        if g.dtype is torch.float32:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5 * e.abs().max().item())
        else:
            x = exact[k]
            assert _largest((g.double() - x).abs()) <= 2 * _largest((e.double() - x).abs()) + 1e-3


def _trained_without_library_calls(fn, args: list, grad_inputs: int, incoming) -> "tjit.Explanation":
    """fn compiled: the gradients of its first `grad_inputs` arguments match eager's
    (_assert_gradients_match) and no library call ran; returns its explanation."""
    compiled = tjit.compile(fn)
    calls = tjit.counters.library_calls
    got = _gradients(compiled, args, grad_inputs, incoming)
    assert tjit.counters.library_calls == calls
    _assert_gradients_match(got, _gradients(fn, args, grad_inputs, incoming),
                            _gradients(fn, args, grad_inputs, incoming, torch.float64))
    return tjit.explain(compiled, *[a.clone().requires_grad_(n < grad_inputs) for n, a in enumerate(args)])


# (function, forward kernels, backward kernels): with fewer value columns the forward saves
# v's slice by a kernel of its own, and the backward places dV into v's gradient by a kernel
# of its own (a product's store into a slice of a wider buffer is not built), and dV, narrower
# than dK, takes a kernel of its own too. (A head width of 24 was not used: the forward's
# float32 kernel spills 8 bytes at sm_90 there, with or without gradients.)
ATTENTION_TRAINING = {"scaled": (ATTENTION["scaled"][0], 1, 3), "additive_mask": (ATTENTION["additive_mask"][0], 1, 3),
                      "causal": (ATTENTION["causal"][0], 1, 3),
                      "fewer_value_columns": (lambda q, k, v: _scaled_attention(q, k, v[..., :17]), 2, 5)}


@pytest.mark.parametrize("name", ATTENTION_TRAINING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_training_never_writes_its_probabilities(name, dtype):
    """Flash attention's training step, found by fusion: the scores are recomputed instead of
    saved (Dot.recomputed), so the forward's kernels write the output and the rows' max and
    sum, and the backward's products compute the scores and dP = dO @ V.T on their tiles
    (dV = P.T @ dO and dK = dS.T @ Q with them transposed, in one kernel; dQ = dS @ K; the
    rows' sum of dP * P): 3 backward kernels, no library call, and nothing of the (queries x
    keys) probabilities written or held; the forward is one kernel, which writes the rows'
    max and sum as its k loop computes them. Gradients of q, k and v match eager (16-bit: no
    further from float64 than twice eager's own error). Queries span several row tiles, keys
    several steps and the head width two inner steps, and the scores are larger than q and
    k together (what makes recomputing them worth it). Small: the interpreter runs these
    kernels slowly."""
    fn, forward_kernels, kernels = ATTENTION_TRAINING[name]
    # (fixed inputs: drawn from whatever state earlier tests left the generator in, one draw
    # in many put bfloat16's gradient error just past twice eager's, with the same values
    # before and after a change that left them bit for bit equal)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 64, 32), torch.randn(1, 2, 96, 32), torch.randn(1, 2, 96, 32)
    args = [t.to(dtype) for t in (q, k, v, *[torch.randn(64, 96) for _ in ATTENTION[name][1]])]
    explanation = _trained_without_library_calls(fn, args, 3, torch.randn(fn(*args).shape).to(dtype))
    probabilities = 2 * 64 * 96 * args[0].element_size()
    assert len(explanation.kernels) == forward_kernels
    assert len(explanation.backward.kernels) == kernels
    assert not explanation.backward.library_calls
    # the kernels over the scores' shape write rows' values only
    over_scores = [k for kernel in (explanation.kernels, explanation.backward.kernels) for k in kernel
                   if k.shape[-2:] == (64, 96)]
    assert over_scores and sum(k.bytes_written for k in over_scores) < probabilities / 8
    if name != "fewer_value_columns":  # (which holds v's slice, and dV before it is placed: v's size)
        alive = explanation.peak_memory.alive_at_peak
        extra = explanation.peak_memory.peak - sum(alive.get(kind, 0) for kind in ("gradient", "output", "incoming gradient"))
        assert extra < probabilities / 8, alive


def _padding_masked_attention(q, k, v, lengths):
    """BERT's attention over a batch of padded sequences: keys past each sequence's length
    masked from the scores."""
    kept = torch.arange(k.shape[-2]) < lengths[:, None]
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~kept[:, None, None, :], float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_attention_with_a_padding_mask_trains_as_in_eager():
    """The mask's own store (a kernel over the scores' shape, which the backward reads) is not
    joined into a product's kernel: there it was left as that kernel's only store once the
    rows' statistics moved into the product's own kernel, and no kernel computed it (a crash in
    codegen). Queries and keys span several tiles."""
    q, k, v = (torch.randn(2, 3, 70, 32) for _ in range(3))
    lengths = torch.tensor([35, 70])
    eager_args, tjit_args = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
    expected = _padding_masked_attention(*eager_args, lengths)
    got = tjit.compile(_padding_masked_attention)(*tjit_args, lengths)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    incoming = torch.randn_like(expected)
    for g, e in zip(torch.autograd.grad(got, tjit_args, incoming), torch.autograd.grad(expected, eager_args, incoming)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def _heads_joined(q, k, v):
    """BERT's and GPT-2's attention: the output [b, h, s, d] made [b, s, h * d]."""
    out = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v
    return out.permute(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True], ids=["eval", "training"])
def test_attention_writes_its_output_with_the_heads_joined(dtype, grad):
    """The attention's output permuted to [b, s, h, d] for its heads to be joined is written by
    the product's kernel through that permutation of the output: one forward kernel, with or
    without gradients, and no buffer of the product in [b, h, s, d] (it was written there,
    then copied by a kernel of its own). Queries span several row tiles and the value's
    width several column tiles (the output's permuted store and the row statistics' first
    column tile); gradients match eager's."""
    q, k, v = torch.randn(2, 3, 70, 16), torch.randn(2, 3, 150, 16), torch.randn(2, 3, 150, 80)
    args = [t.to(dtype) for t in (q, k, v)]
    compiled = tjit.compile(_heads_joined)
    explanation = tjit.explain(compiled, *[a.clone().requires_grad_(grad) for a in args])
    assert len(explanation.kernels) == 1 and not explanation.library_calls
    assert explanation.memory is None or explanation.memory.slab_size == 0
    notes = explanation.kernels[0].notes  # (explain says why the kernel writes what it writes)
    assert any("through its axes in the order [0, 2, 1, 3]" in note for note in notes), notes
    assert sum("computes online" in note for note in notes) == (2 if grad else 0), notes
    if not grad:
        check(_heads_joined, *args)
        return
    incoming = torch.randn(2, 70, 3 * 80).to(dtype)
    got, eager = _gradients(compiled, args, 3, incoming), _gradients(_heads_joined, args, 3, incoming)
    _assert_gradients_match(got, eager, _gradients(_heads_joined, args, 3, incoming, torch.float64))


def test_a_product_read_in_its_own_layout_too_keeps_its_buffer():
    """The product returned as it is and with its heads joined: its kernel writes both, the
    permuted output and the product's own (nothing is dropped that a result needs)."""
    def both(q, k, v):
        out = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
        return out, out.permute(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1), out.sum(-1)
    args = (torch.randn(2, 3, 70, 16), torch.randn(2, 3, 150, 16), torch.randn(2, 3, 150, 80))
    compiled = tjit.compile(both)
    for got, expected in zip(compiled(*args), both(*args)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def _rms_normed_sum_then_linear(ids, embedding, a, w_o, w):
    """A decoder's first layer at a batch of one (Mistral, Qwen2, Gemma under torch.compile):
    the norm's input a sum of an embedding and a linear of [1, t, d], the next linear's
    product [1, t, n] computed from [t, d] operands (the batch of one dropped by a reshape)."""
    h = F.embedding(ids, embedding) + F.linear(a, w_o)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return F.silu(F.linear(h, w))


def test_a_product_with_fewer_batch_dimensions_in_its_operands():
    """A product whose operands have fewer batch dimensions than it (broadcast over them) is
    keyed (domains.product_key) with its rows' strides over the batch: the key was built
    from the operands' own strides, one short, and lowering failed ("View: shape (1, 20) and
    strides (32,) differ in length")."""
    args = (torch.randint(0, 97, (1, 70)), torch.randn(97, 40), torch.randn(1, 70, 40), torch.randn(40, 40),
            torch.randn(150, 40))
    check(_rms_normed_sum_then_linear, *args)
    eager_args, tjit_args = ([a.clone().requires_grad_(a.is_floating_point()) for a in args] for _ in range(2))
    incoming = torch.randn(1, 70, 150)
    _rms_normed_sum_then_linear(*eager_args).backward(incoming)
    tjit.compile(_rms_normed_sum_then_linear)(*tjit_args).backward(incoming)
    for got, expected in zip(tjit_args[1:], eager_args[1:]):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-4, atol=1e-4)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_attention_shapes(data):
    """Attention over drawn sizes (1 to 300 queries and keys, head and value widths from 1 to
    128, batch axes or none), scales, types and masks (none, causal, additive, boolean),
    against eager: one kernel wherever neither product has a side of 1."""
    draw = data.draw
    sq, sk = draw(st.sampled_from([1, 16, 70, 300])), draw(st.sampled_from([1, 33, 150, 300]))
    d, dv = draw(st.sampled_from([1, 16, 40, 128])), draw(st.sampled_from([2, 29, 64, 128]))
    batch = draw(st.sampled_from([(), (3,), (2, 2)]))
    dtype = draw(st.sampled_from([torch.float32, *LOW_PRECISION]))
    scale, masking = draw(st.sampled_from([0.05, 1.0, 4.0])), draw(st.sampled_from(["none", "causal", "additive", "boolean"]))
    mask = torch.randn(sq, sk).to(dtype) if masking == "additive" else torch.rand(sq, sk) > 0.3

    def attention(q, k, v, mask):
        scores = q @ k.transpose(-1, -2) * scale
        if masking == "causal":
            scores = _causal(scores)
        elif masking == "additive":
            scores = scores + mask
        elif masking == "boolean":
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, -1) @ v
    args = [torch.randn(batch + shape).to(dtype) for shape in ((sq, d), (sk, d), (sk, dv))] + [mask]
    if masking == "boolean":
        args[-1][:, 0] = True  # (no row of -inf only: eager's NaN rows are checked elsewhere)
    if dtype in LOW_PRECISION:
        compiled = check(attention, *args)
    else:  # (scores of tens carry float32 rounding of 1e-5 into the exponents, in an order that
        # differs from eager's: each element as accurate as eager's against float64, or near it)
        compiled = tjit.compile(attention)
        exact = attention(*[t.double() if t.is_floating_point() else t for t in args])
        assert_as_accurate_as_eager(compiled(*clone_args(args)), attention(*clone_args(args)), exact, 1e-4, 1e-5)
    if sq > 1 and sk > 1:  # (a side of 1: matrix-vector products, the library's)
        assert steps(compiled, *args) == (1, 0)


def test_online_attention_on_extreme_rows():
    """The running max's rescaling against eager on rows eager's softmax makes NaN (every key
    masked with -inf, a NaN query), on scores in the thousands (exp overflows without the
    shift) whose max moves from step to step (keys in rising order), and with -inf on
    the first keys of a row only (the running max starts infinite)."""
    def attention(q, k, v, m):
        return torch.softmax(q @ k.transpose(-1, -2) + m, -1) @ v
    q, k, v = torch.randn(2, 70, 24) * 8, torch.randn(2, 150, 24) * 8, torch.randn(2, 150, 40)
    k[1] = k[1][(q[1, 0] @ k[1].T).argsort()]  # (row 0's scores rise along the keys, from about -700)
    q[0, 5, 3] = float("nan")
    mask = torch.zeros(70, 150)
    mask[7] = float("-inf")
    mask[9, :100] = float("-inf")
    compiled = tjit.compile(attention)
    # (scores of hundreds carry float32 rounding errors of about 1e-4 into the exponents, which
    # depend on the order of the products' sums: within 1e-3 of eager, or as accurate against
    # float64; a NaN or an overflow where eager has none fails either way)
    exact = attention(*[t.double() for t in (q, k, v, mask)])
    assert_as_accurate_as_eager(compiled(q, k, v, mask), attention(q, k, v, mask), exact, 1e-3, 1e-3)
    assert steps(compiled, q, k, v, mask) == (1, 0)


def test_row_statistics_of_other_rows_are_not_computed_online():
    """exp(s - max(s) flipped over the rows) @ v: each row is shifted by another row's max. The
    online form reads a row's statistics from its own registers, so it must not take a view
    that moves rows (it did, and each row came out scaled by exp(own max - other max)): the
    max is computed by a kernel of its own and read through the flip."""
    def shifted_by_other_rows(q, k, v):
        s = q @ k.transpose(-1, -2)
        return torch.exp(s - s.amax(-1, keepdim=True).flip(-2)) @ v
    args = (torch.randn(2, 70, 16) / 4, torch.randn(2, 90, 16) / 4, torch.randn(2, 90, 20))
    compiled = check(shifted_by_other_rows, *args)
    assert steps(compiled, *args) == (2, 0)


def test_attention_returning_its_probabilities_too():
    """The probabilities are an output: one kernel writes them (the scores' softmax), and
    the output's kernel computes its own online."""
    def attention_and_weights(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.2, -1)
        return p @ v, p
    args = (torch.randn(2, 3, 70, 40), torch.randn(2, 3, 150, 40), torch.randn(2, 3, 150, 40))
    compiled = tjit.compile(attention_and_weights)
    for got, expected in zip(compiled(*args), attention_and_weights(*args)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert steps(compiled, *args) == (2, 0)


def test_attention_returning_its_scores_with_as_many_keys_as_head_dimensions():
    """The scores have the output's shape (70 x 40): a product kernel of that shape would
    compute them both as its own tile (stored) and inside the output's k loop, which codegen
    cannot; the stores take a kernel each (an assertion in codegen before)."""
    def attention_and_scores(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.2
        return torch.softmax(s, -1) @ v, s
    args = (torch.randn(2, 3, 70, 40), torch.randn(2, 3, 40, 40), torch.randn(2, 3, 40, 40))
    compiled = tjit.compile(attention_and_scores)
    for got, expected in zip(compiled(*args), attention_and_scores(*args)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert steps(compiled, *args) == (2, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_by_broadcasting(dtype):
    """One head of keys and values for three query heads, broadcast: eager's bmm copies the
    broadcast keys and values (an expand cannot merge with the batch), and so does tjit, in
    one kernel for both, then the attention's kernel; the probabilities are never written."""
    def grouped(q, k, v):
        return _scaled_attention(q, k.expand(-1, 3, -1, -1), v.expand(-1, 3, -1, -1))
    args = [t.to(dtype) for t in (torch.randn(2, 3, 200, 40), torch.randn(2, 1, 150, 40), torch.randn(2, 1, 150, 40))]
    compiled = check(grouped, *args)
    assert steps(compiled, *args) == (2, 0)
    buffers = [size for size, *_ in tjit.explain(compiled, *args).memory.intervals]
    assert max(buffers) == 2 * 3 * 150 * 40 * args[0].element_size()  # a copy of k or v, nothing larger
    assert 2 * 3 * 200 * 150 * args[0].element_size() > 4 * max(buffers)  # (the probabilities' size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prologue_computing_two_products(dtype, monkeypatch):
    """An operand computed from two products of its shape (attention's backward: the
    probabilities times dP minus a row value), each its own k loop inside the outer one's;
    k not a multiple of the step, the outer k spanning several steps."""
    monkeypatch.setenv("TJIT_MATMUL", "generated")

    def two(x, y, z, w, v):
        return ((x @ y).sigmoid() * (z @ w - 1)) @ v
    args = [torch.randn(shape).to(dtype) / 3 for shape in [(2, 70, 33), (2, 33, 150), (2, 70, 20), (2, 20, 150),
                                                             (2, 150, 48)]]
    compiled = check(two, *args)
    assert steps(compiled, *args) == (1, 0)


NESTED_AND_READ_AGAIN = {
    "epilogue": lambda x, w1, w2: F.gelu(x @ w1) @ w2 + F.gelu(x @ w1),
    "shared_weight": lambda x, w1, w2: (x @ w1) @ w1 * 0.5 + x @ w1,
    "two_products": lambda x, w1, w2: ((x @ w1).relu() @ w2) * ((x @ w1).sigmoid() @ w2),
}


@pytest.mark.parametrize("name", NESTED_AND_READ_AGAIN)
def test_a_nested_product_read_again_is_written_once(name):
    """A product that the next one's operand computes on its tiles and that the store reads
    again, in its epilogue or in another product's operand, is written once and read. Found
    by random compositions: the first two crashed codegen, which could not address the
    nested product's b from the kernel's index."""
    x, w1, w2 = torch.randn(2, 70, 48), torch.randn(48, 48) / 7, torch.randn(48, 48) / 7
    check(NESTED_AND_READ_AGAIN[name], x, w1, w2)


def test_a_product_with_many_columns_does_not_compute_its_operands_products():
    """relu(x @ w1) @ w2 over 300 columns: computing x @ w1 on w2's tiles would compute it again
    for every column tile of the result, so it is written once and read (NESTED_COLUMNS)."""
    x, w1, w2 = torch.randn(70, 40), torch.randn(40, 90), torch.randn(90, 300)
    compiled = check(lambda x, w1, w2: torch.relu(x @ w1) @ w2, x, w1, w2)
    explanation = tjit.explain(compiled, x, w1, w2)
    assert sum(kernel.bytes_written for kernel in explanation.kernels) >= 70 * 90 * 4


def test_the_rule_leaves_a_product_with_nothing_to_fuse_to_the_library(monkeypatch):
    def product(x, w):
        return x @ w

    def matrix_vector(x, v):
        return torch.relu(x @ v)

    def integers(x, w):
        return torch.relu(x @ w)

    x, w = torch.randn(50, 40), torch.randn(40, 30)
    assert steps(check(product, x, w), x, w) == (0, 1)
    v = torch.randn(40, 1)
    assert steps(check(matrix_vector, x, v), x, v)[1] == 1
    xi, wi = torch.randint(-5, 5, (50, 40)), torch.randint(-5, 5, (40, 30))
    if not xi.is_cuda:  # (CUDA eager has no integer matmul)
        assert steps(check(integers, xi, wi), xi, wi)[1] == 1
    explanation = str(tjit.explain(tjit.compile(product), x, w))
    assert "library call, nothing to fuse" in explanation
    monkeypatch.setenv("TJIT_MATMUL", "generated")
    assert steps(check(product, x, w), x, w) == (1, 0)
    assert "generated (tl.dot), TJIT_MATMUL=generated" in str(tjit.explain(tjit.compile(product), x, w))


def write_product_into_operand(x, w):
    x.copy_(torch.relu(x @ w))
    return x


def add_product_into_operand(x, w):
    return x.add_(x @ w)


@pytest.mark.parametrize("fn", [write_product_into_operand, add_product_into_operand])
def test_writing_an_operand_in_place_reads_its_old_rows(fn):
    """Each program reads whole rows of x while others write their tiles of x: the product
    reads a copy made before (in the interpreter, programs run in turn, so an unstaged read
    sees rows already overwritten)."""
    x, w = torch.randn(150, 150), torch.randn(150, 150) / 10
    check(fn, x, w)


GRADIENT_CASES = {
    "gelu_linear": (lambda x, w, b: F.gelu(F.linear(x, w, b)),
                    lambda: (torch.randn(3, 37, 70), torch.randn(150, 70), torch.randn(150))),
    "mlp_block": (mlp_block, lambda: (torch.randn(2, 45, 96), torch.randn(200, 96) / 10, torch.randn(200),
                                      torch.randn(96, 200) / 10, torch.randn(96))),
    "attention_weights": (lambda q, k: torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1),
                          lambda: (torch.randn(2, 3, 40, 24), torch.randn(2, 3, 50, 24))),
    "broadcast_batch": (relu_matmul, lambda: (torch.randn(2, 1, 33, 40), torch.randn(3, 40, 70))),
    # operands whose memory runs down their columns: their gradients are transposed products
    "transposed_operands": (lambda x, w: torch.relu(x.t() @ w.t()), lambda: (torch.randn(70, 33), torch.randn(50, 70))),
    "batched_transposed_operands": (lambda q, k: torch.relu(q.transpose(-1, -2) @ k.transpose(-1, -2)),
                                    lambda: (torch.randn(2, 40, 33), torch.randn(2, 50, 40))),
}


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_gradients_match_eager(name, monkeypatch):
    """Generated forwards (which the rule leaves to the library when a gradient flows), and
    their gradients."""
    monkeypatch.setenv("TJIT_MATMUL", "generated")
    fn, make = GRADIENT_CASES[name]
    inputs = make()
    eager_args = [a.clone().requires_grad_() for a in inputs]
    tjit_args = [a.clone().requires_grad_() for a in inputs]
    out = fn(*eager_args)
    g = torch.randn_like(out)
    expected = torch.autograd.grad(out, eager_args, g)
    got = torch.autograd.grad(tjit.compile(fn)(*tjit_args), tjit_args, g)
    for k, (a, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"gradient {k}: {m}")


def test_a_product_a_gradient_flows_through_is_a_library_call():
    x, w, b = torch.randn(3, 37, 70), torch.randn(150, 70).requires_grad_(), torch.randn(150).requires_grad_()
    explanation = str(tjit.explain(tjit.compile(gelu_linear), x, w, b))
    assert "library call, a gradient flows through it" in explanation
    with torch.no_grad():
        assert steps(tjit.compile(gelu_linear), x, w, b) == (1, 0)


def dot_kernels(compiled, *args) -> int:
    return sum("tl.dot(" in k.source for k in tjit.explain(compiled, *args).kernels)


def test_a_products_column_blocks_read_by_one_kernel_are_computed_there():
    """An RNN cell's gates: column blocks of one projection, each a product of its own in
    the kernel that combines them, so the projection is never written."""
    def gates(x, w, b):
        i, f, g = F.linear(x, w, b).chunk(3, -1)
        return torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f)
    x, w, b = torch.randn(70, 40), torch.randn(150, 40) / 6, torch.randn(150)
    compiled = check(gates, x, w, b)
    assert steps(compiled, x, w, b) == (1, 0)


def test_a_product_read_as_it_is_and_transposed_is_computed_once():
    def both_ways(x, w, b):
        y = torch.relu(x @ w + b)
        return y + y.t() * 2
    x, w, b = torch.randn(70, 40), torch.randn(40, 70), torch.randn(70)
    compiled = check(both_ways, x, w, b)
    # (computed twice, b.T @ a.T beside a @ b, the two products shared one kernel)
    assert sum(k.source.count("tl.dot(") for k in tjit.explain(compiled, x, w, b).kernels) == 1


def test_a_shared_weights_product_read_with_its_rows_split_and_merged_is_computed_once():
    """A linear over [b, t, d] is one product over b*t rows: read as [b, t, n] and as
    [b*t, n] (by two reductions, which read it from memory) it is written once."""
    def two_softmaxes(x, w, b):
        y = F.linear(x, w, b)
        return y.softmax(-1) + y.reshape(-1, y.shape[-1]).softmax(0).view(y.shape)
    x, w, b = torch.randn(2, 50, 40), torch.randn(60, 40), torch.randn(60)
    compiled = check(two_softmaxes, x, w, b)
    assert dot_kernels(compiled, x, w, b) == 1


def test_a_linear_weights_gradient_is_written_in_the_weights_layout(monkeypatch):
    """x @ w.t(): w's gradient is computed as (grad.t() @ x), in w's own [n, k] layout, as
    ATen's mm backward does; as x.t() @ grad it came out [k, n] and took a transposing copy
    kernel per weight."""
    monkeypatch.setenv("TJIT_MATMUL", "generated")
    fn, make = GRADIENT_CASES["mlp_block"]
    x, w1, b1, w2, b2 = make()
    leaves = [t.requires_grad_() for t in (w1, b1, w2, b2)]
    explanation = tjit.explain(tjit.compile(lambda *a: fn(*a).sum()), x, *leaves)
    backward_kernels = [k.source for k in explanation.backward.kernels]
    # the layer-norm input's rows for b2's sum... : a kernel for the bias sums and gelu's
    # backward, one for the first bias sum; no copies
    assert len(backward_kernels) == 2, backward_kernels


def linear_cross_entropy(h, w, target):
    return F.cross_entropy(F.linear(h, w).flatten(0, -2), target.flatten())


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_linear_cross_entropy_never_writes_the_logits(dtype):
    """cross_entropy(h @ w.T): the logits' rows are reduced tile by tile where they are
    computed (an online logsumexp, the target's logit picked in the same pass): one kernel,
    which writes the loss and its partial sums, nothing of the (tokens x vocab) logits. The
    vocabulary (300) spans several column tiles, the 2 x 75 tokens several row tiles, and
    ignored targets (-100) are left out of the mean as eager does."""
    h, w = torch.randn(2, 75, 40, dtype=dtype), torch.randn(300, 40, dtype=dtype) / 6
    target = torch.randint(0, 300, (2, 75))
    target[0, ::7] = -100
    if dtype is torch.float32:
        compiled = check(linear_cross_entropy, h, w, target)
    else:  # a 16-bit loss near 5.7 is one of values 1/32 apart: within one of them of float64's
        compiled = tjit.compile(linear_cross_entropy)
        exact = linear_cross_entropy(h.double(), w.double(), target)
        got = compiled(h, w, target)
        assert got.dtype == dtype and abs(got.double() - exact) <= exact.abs() * torch.finfo(dtype).eps
    assert steps(compiled, h, w, target) == (1, 0)
    explanation = tjit.explain(compiled, h, w, target)
    (kernel,) = explanation.kernels
    assert kernel.bytes_written < 150 * 300 * h.element_size() / 8
    # the rule: a product whose rows a reduction reads is generated (at any size: it is never written)
    assert "generated (tl.dot), fuses _log_softmax over its rows" in str(explanation)


def _probabilities(scores, lse):
    return torch.exp(scores - lse[..., None])


TRANSPOSED_NESTED = {  # (function, input shapes, the nested product's elements)
    # a linear's weight gradient under cross-entropy: (softmax(h @ w.T) - one-hot).T @ h
    "weight_gradient": (lambda h, w, lse, target: ((_probabilities(h @ w.T, lse) - F.one_hot(target, w.shape[0]))
                                                   / h.shape[0]).T @ h,
                        [(150, 40), (300, 40), (150,), (150,)], 150 * 300),
    # attention's dV = P.T @ dO, the probabilities recomputed from the scores and the rows' logsumexp
    "attention_values": (lambda q, k, lse, do: _probabilities(q @ k.transpose(-1, -2) * 0.15, lse).transpose(-1, -2) @ do,
                         [(2, 3, 70, 40), (2, 3, 150, 40), (2, 3, 70), (2, 3, 70, 24)], 2 * 3 * 70 * 150),
    # a batched input under one shared weight: the transposed product reads the weight at every batch index
    "shared_weight": (lambda h, w, lse: torch.sigmoid(h @ w.T - lse[..., None]).transpose(1, 2) @ h,
                      [(2, 75, 40), (300, 40), (2, 75)], 2 * 75 * 300),
}


@pytest.mark.parametrize("name", TRANSPOSED_NESTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transposed_product_is_computed_on_the_next_products_tiles(name, dtype):
    """f(a @ b).T @ c, where the transpose cannot be pushed into a @ b as it is: the operand
    computes the transposed product, b.T @ a.T, on its tiles (a nested k loop), so nothing of
    the product is written (the backward of linear + cross-entropy and of attention need this
    form: their gradients' rows are the product's columns). Rows, columns and both k loops
    span several tiles and steps."""
    fn, shapes, product_elements = TRANSPOSED_NESTED[name]
    args = [torch.randn(shape).to(dtype) / 3 for shape in shapes]
    if name == "weight_gradient":
        args[-1] = torch.randint(0, 300, (150,))
        args[2] = torch.logsumexp((args[0] @ args[1].T).float(), -1).to(dtype)
    compiled = check(fn, *args)
    assert steps(compiled, *args) == (1, 0)
    explanation = tjit.explain(compiled, *args)
    out = compiled(*args)
    (kernel,) = explanation.kernels
    assert kernel.source.count("tl.dot(") == 2
    assert kernel.bytes_written == out.numel() * out.element_size()  # the result, nothing of the product
    assert explanation.memory.slab_size < product_elements * args[0].element_size() / 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_training_never_writes_the_logits(dtype):
    """Forward and backward of cross_entropy(h @ w.T): the logits are not saved for the
    backward (only the rows' statistics); each gradient is a generated product whose operand
    recomputes the logits on its tiles (dlogits @ w, and dlogits.T @ h with the logits
    computed transposed): 1 kernel forward, 2 backward, no library call, and the step's
    writes and extra memory beside the gradients under 1/8 of the logits. Gradients match
    eager (16-bit: no further from float64 than twice eager's own error)."""
    h, w = torch.randn(2, 75, 40).to(dtype), (torch.randn(300, 40) / 6).to(dtype)
    target = torch.randint(0, 300, (2, 75))
    target[0, ::7] = -100
    explanation = _trained_without_library_calls(linear_cross_entropy, [h, w, target], 2, torch.tensor(1.0).to(dtype))
    logits = 150 * 300 * h.element_size()
    assert len(explanation.kernels) == 1 and len(explanation.backward.kernels) == 2
    assert all("tl.dot(" in k.source for k in explanation.backward.kernels)
    gradients = (h.numel() + w.numel()) * h.element_size()
    written = sum(k.bytes_written for k in explanation.kernels + explanation.backward.kernels)
    assert written - gradients < logits / 8
    alive = explanation.peak_memory.alive_at_peak
    extra = explanation.peak_memory.peak - sum(alive.get(kind, 0) for kind in ("gradient", "output", "incoming gradient"))
    assert extra < logits / 8, alive
    assert "its gradients recompute it" in str(explanation)


def _rotary(x):
    """Rotary position embeddings (Llama's), computed in the function."""
    half = x.shape[-1] // 2
    angles = torch.outer(torch.arange(x.shape[-2]).float(), 1.0 / 10000 ** (torch.arange(half).float() / half))
    angles = torch.cat((angles, angles), -1)
    first, second = x.chunk(2, -1)
    return x * angles.cos().to(x.dtype) + torch.cat((-second, first), -1) * angles.sin().to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_attention_training_never_writes_its_probabilities(dtype):
    """Attention over rotary-embedded queries and keys (computed operands): they are written
    once, so the scores' operands are memory and the scores are recomputed, not saved, as
    for plain q and k (before, the products were library calls and the probabilities were
    saved, [queries x keys] in the tape). No library call, nothing of the probabilities
    written or held; gradients match eager."""
    fn = lambda q, k, v: _scaled_attention(_rotary(q), _rotary(k), v)  # noqa: E731
    args = [t.to(dtype) for t in (torch.randn(1, 2, 64, 32), torch.randn(1, 2, 96, 32), torch.randn(1, 2, 96, 32))]
    explanation = _trained_without_library_calls(fn, args, 3, torch.randn(1, 2, 64, 32).to(dtype))
    probabilities = 2 * 64 * 96 * args[0].element_size()
    over_scores = [k for kernel in (explanation.kernels, explanation.backward.kernels) for k in kernel
                   if k.shape[-2:] == (64, 96)]
    assert sum(k.bytes_written for k in over_scores) < probabilities / 8
    alive = explanation.peak_memory.alive_at_peak
    extra = explanation.peak_memory.peak - sum(alive.get(kind, 0) for kind in ("gradient", "output", "incoming gradient"))
    rotated = 2 * (64 + 96) * 32  # (elements of q and k rotated: saved, and their gradients, in float32)
    assert extra < rotated * (args[0].element_size() + 4) + probabilities / 8, alive


def test_linear_cross_entropy_training_over_a_wide_hidden_size_never_writes_the_logits():
    """With more hidden columns than one tile holds (NESTED_COLUMNS; an LM head's 768-4096),
    each gradient product accumulates in the gradient's own memory, a chunk of columns per
    step of k, its operand recomputing the logits once per row tile and step
    (frontend/dot.py's accumulates_in_memory): forward 1 kernel, backward 2, no library
    call, nothing of the logits or their gradient written. The hidden size spans 3 chunks
    (the last partial), the vocabulary several steps, the rows several programs; the
    batched input shares one weight, and some targets are ignored."""
    h, w = torch.randn(2, 150, 160), torch.randn(1200, 160) / 13
    target = torch.randint(0, 1200, (2, 150))
    target[1, ::5] = -100
    explanation = _trained_without_library_calls(linear_cross_entropy, [h, w, target], 2, torch.tensor(1.0))
    logits = 300 * 1200 * 4
    assert len(explanation.kernels) == 1 and len(explanation.backward.kernels) == 2
    assert all("accumulated in memory" in k.source for k in explanation.backward.kernels)
    assert all(any(n.startswith("accumulates the product in ") for n in k.notes) for k in explanation.backward.kernels)
    gradients = (h.numel() + w.numel()) * 4
    written = sum(k.bytes_written for k in explanation.kernels + explanation.backward.kernels)
    assert written - gradients < logits / 8
    assert explanation.backward.memory.slab_size < logits / 8


def test_linear_cross_entropy_training_over_a_wide_hidden_size_in_bfloat16_writes_the_logits_gradient_once():
    """16-bit gradients over a wide hidden size keep the other form (vjp.py's
    _accumulates_in_memory: float32 buffers to accumulate them in would cost about what
    this does): the backward writes the logits' gradient once, recomputing the logits in
    that kernel, and both gradient products read it (it was written twice, once per
    product, the second transposed); the forward saves no logits."""
    h, w = torch.randn(300, 160).bfloat16(), (torch.randn(1200, 160) / 13).bfloat16()
    target = torch.randint(0, 1200, (300,))
    compiled = tjit.compile(linear_cross_entropy)
    args, incoming = [h, w, target], torch.tensor(1.0).bfloat16()
    _assert_gradients_match(_gradients(compiled, args, 2, incoming),
                            _gradients(linear_cross_entropy, args, 2, incoming),
                            _gradients(linear_cross_entropy, args, 2, incoming, torch.float64))
    explanation = tjit.explain(compiled, h.clone().requires_grad_(), w.clone().requires_grad_(), target)
    logits = 300 * 1200 * 2
    assert sum(k.bytes_written for k in explanation.kernels) < logits / 8
    assert explanation.backward.memory.slab_size == logits


def lm_head_after_its_norm(x, weight, w, target):
    h = F.layer_norm(x, (x.shape[-1],), weight)
    return F.cross_entropy((h @ w.T).flatten(0, -2), target.flatten())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_lm_head_after_its_final_norm_never_writes_the_logits(dtype):
    """cross_entropy(layer_norm(x) @ w.T), a decoder's last steps: the norm's output is
    written once ([tokens, hidden], saved for the weight's gradient), so the product's
    operands are memory and the logits are recomputed rather than saved; the norm's
    backward reads its output's gradient, dlogits @ w, from a product kernel of its own
    that computes the logits on its tiles (a reduction that computed the product would
    have to read the logits from memory). No library call; neither pass writes the logits
    or their gradient, and the tape holds no logits."""
    x, weight = torch.randn(2, 75, 40).to(dtype), (1 + torch.randn(40) / 4).to(dtype)
    w, target = (torch.randn(600, 40) / 6).to(dtype), torch.randint(0, 600, (2, 75))
    explanation = _trained_without_library_calls(lm_head_after_its_norm, [x, weight, w, target], 3,
                                                 torch.tensor(1.0).to(dtype))
    logits = 150 * 600 * x.element_size()
    written = sum(k.bytes_written for k in explanation.kernels + explanation.backward.kernels)
    gradients = (x.numel() + weight.numel() + w.numel()) * x.element_size()
    # (the norm's output, written once, and its gradient, once, in float32)
    normalised, its_gradient = x.numel() * x.element_size(), x.numel() * 4
    assert written - gradients - normalised - its_gradient < logits / 8
    assert explanation.backward.memory.slab_size <= its_gradient
    assert explanation.peak_memory.alive_at_peak.get("tape", 0) < logits / 8


def test_a_target_out_of_range_raises_as_in_eager():
    h, w, target = torch.randn(2, 75, 40), torch.randn(300, 40), torch.randint(0, 300, (2, 75))
    target[1, 40] = 300
    if not h.is_cuda:  # (CUDA eager's check is a device-side assert, which ends the process's CUDA context)
        with pytest.raises(IndexError):
            linear_cross_entropy(h, w, target)
    with pytest.raises(IndexError, match="out of bounds"):
        tjit.compile(linear_cross_entropy)(h, w, target)


PROLOGUE_CASES = {
    # elementwise work on an operand, computed on each tile the product loads: k (70) is not a
    # multiple of the step, and past k the prologue's value is not 0 (x + 1, a log's -inf)
    "scaled_input": (lambda x, w, b: F.gelu(F.linear(x * 0.5, w, b)),
                     lambda: (torch.randn(3, 37, 70), torch.randn(150, 70), torch.randn(150))),
    "both_operands": (lambda x, w: torch.relu((x + 1) @ w.exp()), lambda: (torch.randn(70, 70), torch.randn(70, 90) / 4)),
    "a_log": (lambda x, w: torch.relu(torch.log(x.abs()) @ w), lambda: (torch.randn(70, 70), torch.randn(70, 90))),
    "scaled_queries": (lambda q, k: torch.softmax((q * 0.125) @ k.transpose(-1, -2), -1),
                       lambda: (torch.randn(2, 3, 70, 24), torch.randn(2, 3, 90, 24))),
    "widened_16_bit": (lambda x, w: torch.relu(x.float() @ w.float()),
                       lambda: (torch.randn(70, 70, dtype=torch.bfloat16), torch.randn(70, 90, dtype=torch.bfloat16))),
    "read_by_the_epilogue_too": (lambda x, w: torch.relu((x + 1) @ w) + (x + 1),
                                 lambda: (torch.randn(150, 150), torch.randn(150, 150) / 10)),
}


@pytest.mark.parametrize("name", PROLOGUE_CASES)
def test_an_operands_elementwise_work_is_a_prologue_of_the_products_kernel(name):
    fn, make = PROLOGUE_CASES[name]
    args = make()
    compiled = check(fn, *args)
    assert steps(compiled, *args) == (1, 0)


def test_an_operand_with_a_prologue_written_in_place_reads_its_old_rows():
    def add_scaled_product(x, w):
        return x.add_((x * 2) @ w)
    x, w = torch.randn(150, 150), torch.randn(150, 150) / 10
    check(add_scaled_product, x, w)


def rms_norm_linear(x, g, w):
    return torch.relu(F.linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g, w))


NORM_PROLOGUE_CASES = {
    "layer_norm": (lambda x, w, b: F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],)), w, b)),
                   lambda: (torch.randn(3, 37, 70), torch.randn(150, 70) / 8, torch.randn(150))),
    "rms_norm": (rms_norm_linear, lambda: (torch.randn(2, 45, 96), torch.randn(96), torch.randn(200, 96) / 10)),
}


@pytest.mark.parametrize("name", NORM_PROLOGUE_CASES)
def test_a_norms_normalisation_is_a_prologue_of_the_next_linear(name):
    """The norm's row statistics in one reduction kernel (a few bytes per row), the
    normalisation computed on the linear's tiles: the normalised [rows, d] is never written.
    The statistics are loaded once per program, ahead of the k loop, which loads only the
    operands' tiles (per step, a [rows, 1] value loaded as a [rows, step] tile ran a
    layer-norm prologue's product at 14 TFLOP/s on an H100)."""
    fn, make = NORM_PROLOGUE_CASES[name]
    args = make()
    compiled = check(fn, *args)
    assert steps(compiled, *args) == (2, 0)
    x = args[0]
    explanation = tjit.explain(compiled, *args)
    assert explanation.memory.slab_size < x.numel() * x.element_size() / 8
    [product] = [k.source for k in explanation.kernels if "tl.dot(" in k.source]
    assert loads_in_k_loop(product, moving_along_k=False) == 0
    assert loads_in_k_loop(product, moving_along_k=True) == (2 if name == "layer_norm" else 3)  # (rms_norm: its weight)


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


ROW_REDUCED_PRODUCTS_OF_NORMS = {  # (x [.., d], w [d, d], b [d], *the norms' weight and bias)
    "post_norm_residual": lambda x, w, b, *p: F.layer_norm(
        F.layer_norm(x, (96,), *p) + F.linear(F.layer_norm(x, (96,), *p), w, b), (96,), *p),
    "post_norm_residual_affine": lambda x, w, b, *p: F.layer_norm(
        F.layer_norm(x, (96,), *p) + F.linear(F.layer_norm(x, (96,), *p), w, b), (96,), *p),
    "post_norm_mlp": lambda x, w, b: F.layer_norm(
        F.layer_norm(x, (96,)) + F.gelu(F.linear(F.layer_norm(x, (96,)), w, b)), (96,)),
    "rms_norm_residual": lambda x, w, b: _rms(_rms(x) + F.linear(_rms(x), w, b)),
    "softmax_of_linear_of_norm": lambda x, w, b: torch.softmax(F.linear(F.layer_norm(x, (96,)), w, b), -1),
    "row_sum_of_linear_of_norm": lambda x, w, b: F.linear(F.layer_norm(x, (96,)), w, b).sum(-1),
    "norm_of_softmax_product": lambda x, w, b: F.layer_norm(torch.softmax(x, -1) @ w + b, (96,)),
}


@pytest.mark.parametrize("name", ROW_REDUCED_PRODUCTS_OF_NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_reduction_of_a_product_whose_prologue_reads_a_norm(name, dtype):
    """A product whose prologue reads row statistics (a norm's), reduced along its rows
    by another norm, a softmax or a sum (a post-norm transformer block, an LM head): the
    prologue's statistics are written by their own kernel, also where the row reduction's
    kernel could compute them (it reduces the same rows). Each case crashed codegen before
    (a Reduce in a product's operand; a pointwise kernel asked to fuse an input)."""
    d = 96
    args = [t.to(dtype) for t in (torch.randn(3, 70, d), torch.randn(d, d) / 10, torch.randn(d))]
    args += [torch.randn(d).to(dtype), torch.randn(d).to(dtype)] if name.endswith("affine") else []
    compiled = check(ROW_REDUCED_PRODUCTS_OF_NORMS[name], *args)
    assert steps(compiled, *args)[1] == 0  # (no library call: the product is generated)


def loads_in_k_loop(source: str, moving_along_k: bool) -> int:
    """The tl.load calls inside a product kernel's k loop (from its `for` to its tl.dot) whose
    address moves along k (uses the step's index range), or does not."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("for "))
    end = next(i for i, line in enumerate(lines) if "tl.dot(" in line)
    k_range = lines[start + 1].split("=")[0].strip()  # (`rK = r0 + tl.arange(0, BLOCK_K0)`)
    addresses = [line.split("tl.load(")[1].split(", mask=")[0] for line in lines[start:end] if "tl.load(" in line]
    return sum((f"{k_range}[" in address) == moving_along_k for address in addresses)


def test_the_rule_generates_a_product_whose_operand_is_computed():
    """Nothing reads (x * 0.5) @ w but the caller: the scale fuses as the product's prologue,
    where a library call would read it from memory. (In a library call's gradient formula
    the rule leaves such products to the library: the zoo's training peaks rose with them.)"""
    def scaled_product(x, w):
        return (x * 0.5) @ w
    x, w = torch.randn(50, 40), torch.randn(40, 30)
    compiled = check(scaled_product, x, w)
    assert steps(compiled, x, w) == (1, 0)
    assert "fuses its operand's elementwise work (a prologue)" in str(tjit.explain(compiled, x, w))


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_a_prologue_reading_a_scalar_tensor(dtype):
    """(x * s) @ w with s a 0-d tensor: s is the same at every k step and every row, loaded once
    ahead of the k loop (as a block: Triton refuses a block mask on a scalar address)."""
    def scaled(x, s, w):
        return (x * s) @ w
    x, s, w = torch.randn(3, 50, 70, dtype=dtype), torch.tensor(0.5, dtype=dtype), torch.randn(70, 30, dtype=dtype)
    compiled = check(scaled, x, s, w)
    assert steps(compiled, x, s, w) == (1, 0)


K_INVARIANT_PROLOGUES = {
    "rows_of_a": lambda x, w, r, c, s, col: (x * r + c) @ w,
    "columns_of_b": lambda x, w, r, c, s, col: x @ (w * col + s),
    "both": lambda x, w, r, c, s, col: ((x - r) * s) @ (torch.exp(w * 0.1) * col),
    # a whole operand that does not vary along k: computed, and read from memory as it is
    "whole_operand_computed": lambda x, w, r, c, s, col: (r * 2).expand(x.shape) @ w,
    "whole_operand_in_memory": lambda x, w, r, c, s, col: x @ col.expand(w.shape),
}


@pytest.mark.parametrize("name", K_INVARIANT_PROLOGUES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,batch", [(70, 100, 90, None), (130, 257, 65, 3)])
def test_prologue_values_that_do_not_vary_along_k(name, dtype, m, k, n, batch, monkeypatch):
    """A row's value in a's prologue, a column's in b's and a scalar are loaded once ahead of
    the k loop and broadcast against each step's tiles: rows, columns and k over several tiles
    (k not a multiple of the step), with a batch axis."""
    monkeypatch.setenv("TJIT_MATMUL", "generated")
    fn = K_INVARIANT_PROLOGUES[name]
    shape = (m, k) if batch is None else (batch, m, k)
    args = (torch.randn(*shape, dtype=dtype), torch.randn(k, n, dtype=dtype) / 8,
            torch.randn(*shape[:-1], 1, dtype=dtype), torch.randn(k, dtype=dtype), torch.tensor(0.7, dtype=dtype),
            torch.randn(1, n, dtype=dtype))
    compiled = check(fn, *args)
    [product] = [kernel.source for kernel in tjit.explain(compiled, *args).kernels if "tl.dot(" in kernel.source]
    assert loads_in_k_loop(product, moving_along_k=False) == 0


PROLOGUE_UNARY = {"exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "half": lambda t: t * 0.5,
                  "neg": torch.neg, "abs": torch.abs}
PROLOGUE_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum}


def _prologue_expression(draw, leaves: list[str], depth: int):
    """A random elementwise expression over named leaves (a function of the leaves' dict)."""
    if depth == 0 or draw(st.booleans()):
        name = draw(st.sampled_from(leaves))
        return lambda env: env[name]
    if draw(st.booleans()):
        f = PROLOGUE_UNARY[draw(st.sampled_from(sorted(PROLOGUE_UNARY)))]
        a = _prologue_expression(draw, leaves, depth - 1)
        return lambda env: f(a(env))
    f = PROLOGUE_BINARY[draw(st.sampled_from(sorted(PROLOGUE_BINARY)))]
    a, b = _prologue_expression(draw, leaves, depth - 1), _prologue_expression(draw, leaves, depth - 1)
    return lambda env: f(a(env), b(env))


@settings(max_examples=12, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])  # (the same env each example)
@given(data=st.data())
def test_random_prologues_on_both_operands(monkeypatch, data):
    """Random elementwise expressions over a's tile, its rows' values, a k-vector and a
    scalar (a) and over b's tile, its rows' and columns' values and the scalar (b), on odd
    sizes with and without a batch axis: against eager, and every kernel compiles for sm_90."""
    monkeypatch.setenv("TJIT_MATMUL", "generated")
    draw = data.draw
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    m, k, n = draw(st.sampled_from([3, 17, 70])), draw(st.sampled_from([16, 33, 100])), draw(st.sampled_from([5, 17, 65]))
    batch = draw(st.sampled_from([(), (2,)]))
    shapes = {"x": batch + (m, k), "row_a": batch + (m, 1), "k_vector": (k,), "scalar": (),
              "w": (k, n), "row_b": (k, 1), "column_b": (1, n)}
    a = _prologue_expression(draw, ["x", "row_a", "k_vector", "scalar"], 3)
    b = _prologue_expression(draw, ["w", "row_b", "column_b", "scalar"], 3)
    names = list(shapes)

    def product(*args):
        env = dict(zip(names, args))
        return a(env).expand(batch + (m, k)) @ b(env).expand(k, n)
    check(product, *[torch.randn(shape).to(dtype) / 2 for shape in shapes.values()])


def test_float32_products_on_a_gpu_follow_torchs_matmul_precision(monkeypatch):
    """At torch's default ("highest") float32 precision eager's GPU product is exact float32:
    tl.dot emulates it by three tf32 products ("tf32x3", as fast and as accurate as cuBLAS's,
    measured on an H100), or, on a GPU without tf32, computes it by FMA, 12x slower than
    cuBLAS: the library's then. Under "high", eager's cuBLAS uses tf32, and so may tl.dot. In
    the interpreter, exact always."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tjit.frontend.matmul import float32_by_fma_on_gpu
    from tjit.lower import codegen
    graph = torch.fx.Graph()
    on_gpu, on_cpu = graph.call_function(torch.ops.aten.mm.default), graph.call_function(torch.ops.aten.mm.default)
    with FakeTensorMode():
        on_gpu.meta["val"], on_cpu.meta["val"] = torch.empty(8, 8, device="cuda"), torch.empty(8, 8, device="cpu")
    before = torch.get_float32_matmul_precision()
    try:
        for tf32 in (True, False):
            monkeypatch.setattr(codegen, "_has_tf32", lambda tf32=tf32: tf32)
            torch.set_float32_matmul_precision("highest")
            assert float32_by_fma_on_gpu(on_gpu) is not tf32 and not float32_by_fma_on_gpu(on_cpu)
            assert codegen.float32_dot_precision("cuda") == ("tf32x3" if tf32 else "ieee")
            assert codegen.float32_dot_precision("cpu") == "ieee"
            torch.set_float32_matmul_precision("high")
            assert not float32_by_fma_on_gpu(on_gpu)
            assert codegen.float32_dot_precision("cuda") == "tf32" and codegen.float32_dot_precision("cpu") == "ieee"
    finally:
        torch.set_float32_matmul_precision(before)


def test_float32_products_as_three_tf32_products_compile_without_spills(monkeypatch):
    """The "tf32x3" kernels a GPU with tf32 gets for float32 products (tensor-core tiles, three
    tl.dot per step) compile for sm_90 without spills (the suite's check after each test);
    the interpreter computes them exactly."""
    from tjit.lower import codegen
    monkeypatch.setattr(codegen, "float32_dot_precision", lambda device: "tf32x3")
    monkeypatch.setenv("TJIT_MATMUL", "generated")
    q, k, v = (torch.randn(1, 2, 150, 64) / 3 for _ in range(3))
    mask = torch.ones(150, 150, dtype=torch.bool).tril()
    x, w, b = torch.randn(2, 70, 200), torch.randn(150, 200) / 10, torch.randn(150)
    h, target = torch.randn(90, 200), torch.randint(0, 150, (90,))
    cases = [(gelu_linear, (x, w, b)),
             (lambda q, k, v: (q @ k.transpose(-1, -2) / 8).masked_fill(~mask, float("-inf")).softmax(-1) @ v,
              (q, k, v)),
             (lambda h, w, t: F.cross_entropy(h @ w.t(), t), (h, w, target))]
    for fn, args in cases:
        check(fn, *args)
        sources = [kernel.source for kernel in tjit.explain(fn, *args).kernels]
        assert any('input_precision="tf32x3"' in source for source in sources)


def test_a_new_float32_matmul_precision_compiles_again():
    """The precision is in the call's guard: a function compiled under "highest" is not reused
    under "high" (whose generated float32 products, on a GPU, would use tf32)."""
    compiled = tjit.compile(lambda x: torch.relu(x) * 2)
    x = torch.randn(5, 3)
    before = torch.get_float32_matmul_precision()
    try:
        compiled(x)
        torch.set_float32_matmul_precision("high" if before == "highest" else "highest")
        compiled(x)
    finally:
        torch.set_float32_matmul_precision(before)
    assert len(compiled._cache) == 2


def test_tiles_follow_what_computes_the_product():
    """Tensor-core products (16-bit, or float32 as tf32 on a GPU) take 128x64 tiles, exact
    float32 (FMA) 32x32; a product whose rows are reduced over more columns than one tile
    holds walks 64x128 tiles on the tensor cores (measured 1.5x faster than 64x64 on an H100)."""
    from tjit.lower.schedule import dot_row_tiles, dot_tiles
    assert (dot_tiles(4096, 4096, 4096, 2).rows, dot_tiles(4096, 4096, 4096, 2).columns) == (128, 64)
    assert (dot_tiles(4096, 4096, 4096, 4).rows, dot_tiles(4096, 4096, 4096, 4).columns) == (32, 32)
    tf32 = dot_tiles(4096, 4096, 4096, 4, tensor_cores=True)
    assert (tf32.rows, tf32.columns, tf32.step, tf32.warps) == (128, 64, 32, 8)
    walked = dot_row_tiles(4096, 32000, 1024, 2)
    assert (walked.rows, walked.columns) == (64, 128)
    assert (dot_row_tiles(4096, 32000, 1024, 4).rows, dot_row_tiles(4096, 32000, 1024, 4).columns) == (16, 32)
    assert (dot_row_tiles(4096, 100, 1024, 2).rows, dot_row_tiles(4096, 100, 1024, 2).columns) == (64, 128)


@pytest.mark.parametrize("queries", [4, 70])
def test_attention_with_a_bias_table_gathered_by_an_index_buffer(queries):
    """LeViT's attention adds biases gathered from a table by an index buffer before the
    softmax: the softmax's row values, which a product's prologue computes on its tiles,
    would read the table at gathered addresses, which tiles do not hold (an internal error
    in codegen before); the probabilities are written by a kernel first."""
    def attention(scores, biases, idxs, value):
        return (scores + biases[:, idxs]).softmax(dim=-1) @ value

    keys = queries
    args = (torch.randn(2, 3, queries, keys), torch.randn(3, 50), torch.randint(0, 50, (queries, keys)),
            torch.randn(2, 3, keys, 16))
    check(attention, *args)


SELECTED_FROM_PRODUCTS = {
    # (mamba under autocast: a row of a product of computed operands, sliced and broadcast)
    "row_shared_b": (lambda h, w, b: ((h * 2).transpose(1, 2) @ (w * 2))[:, 0, :1, None] * b[:, :4],
                     ((2, 64, 11), (64, 10), (64, 40))),
    "row_batched_b": (lambda h, w, b: ((h * 2) @ (w * 2))[:, 3] + b[0, :10], ((3, 70, 64), (3, 64, 10), (1, 40))),
    "column_shared_b": (lambda h, w, b: ((h * 2) @ (w * 2))[..., 7] * b[0, 0], ((3, 70, 64), (64, 10), (1, 40))),
    "column_batched_b": (lambda h, w, b: ((h * 2) @ (w * 2))[:, :, -1].sum(-1), ((3, 70, 64), (3, 64, 10), (1, 40))),
}


@pytest.mark.parametrize("name", sorted(SELECTED_FROM_PRODUCTS))
def test_a_row_or_column_selected_from_a_product(name):
    """x[:, i] of a product selects a row (or a column) of each matrix: built as a slice of
    a's rows (b's columns), then squeezed, so both operands stay matrices (a select
    dropped the row axis of a and multiplied the wrong shapes: a ValueError in the frontend)."""
    fn, shapes = SELECTED_FROM_PRODUCTS[name]
    check(fn, *[torch.randn(s) for s in shapes])


# a max of a product's rows, differentiated: its gradient goes to the elements equal to the max
TIE_TESTED = {
    "amax": lambda x, y: (x @ y).amax(-1),
    "amin_keepdim": lambda x, y: (x @ y).amin(-1, keepdim=True),
    "relu_amax": lambda x, y: (x @ y).relu().amax(-1),
    "softmax_amax": lambda x, y: (x @ y).softmax(-1).amax(-1),
    "linear_amax": lambda x, y: F.linear(x, y.t()).amax(-1),
    "logsumexp": lambda x, y: (x @ y).logsumexp(-1),
    # (each side of a tie of maximum(z, z.flip(-1)), the middle column, computed on other tiles)
    "logsumexp_and_maximum_of_its_flip": lambda x, y: (x @ y).logsumexp(-1)[:, None] + torch.maximum(x @ y, (x @ y).flip(-1)),
    "logsumexp_by_hand": lambda x, y: ((x @ y) - (x @ y).amax(-1, keepdim=True)).exp().sum(-1).log()
    + (x @ y).amax(-1),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.spills_at_sm90(
    "the recomputed product's gradient kernel beside saved ones: 8 bytes"))
    if name in ("logsumexp_by_hand", "logsumexp_and_maximum_of_its_flip") else name for name in TIE_TESTED])
def test_a_max_of_a_products_rows_is_differentiated_at_the_elements_equal_to_it(name):
    """A product whose rows a reduction reads is computed again by the backward on its own tiles
    (Dot.recomputed), rounded otherwise than the forward's: where an amax's gradient then looked
    for the elements equal to the forward's max, a row could have none (rows of 33 columns,
    two tiles of the backward's). amax's gradient was 0 for those rows (1.4 off), logsumexp's
    NaN (0/0 over the tie count, through the max its decomposition shifts by). Such a product
    is saved now (the library's, frontend/matmul.py: _tested_for_ties), and logsumexp's shift
    is detached (frontend/decompositions.py: its gradient is exp(x - result), eager's), so
    logsumexp's product is still recomputed, never written."""
    fn = TIE_TESTED[name]
    x, y = torch.randn(33, 16), torch.randn(16, 33)
    incoming = torch.randn(fn(x, y).shape)
    got = _gradients(tjit.compile(fn), [x, y], 2, incoming)
    assert not any(g.isnan().any() for g in got)
    _assert_gradients_match(got, _gradients(fn, [x, y], 2, incoming))
    if name == "logsumexp":
        explanation = tjit.explain(tjit.compile(fn), x.clone().requires_grad_(), y.clone().requires_grad_())
        assert len(explanation.matmuls) == 1 and "never written" in explanation.matmuls[0]

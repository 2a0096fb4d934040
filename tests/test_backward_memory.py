"""What a backward keeps alive: its slab does not grow with the number of uses of a weight
or the number of layers, as eager's autograd memory does not.

A weight used at every step of a loop gets one matmul gradient contribution per step: each
is accumulated by an addmm call as soon as it can be computed (accumulate.py), into the
memory of the total before it, not summed by a kernel at the end that keeps every one alive. A layer's bias or norm-weight gradient
(an output of the backward) joins a later kernel only while what it reads is alive anyway
(fusion._sink_outputs), not the backward's last kernel.
"""
import unittest.mock

import pytest
import torch
import torch.nn.functional as F

import tjit
from helpers import assert_as_accurate_as_eager, assert_matches_eager

pytestmark = pytest.mark.usefixtures("fresh_seed")


def recurrent(x, w, v):
    """A tanh RNN: w and v are read at every step (v transposed, as F.linear reads it)."""
    h = torch.tanh(x[0] @ w)
    for t in range(1, x.shape[0]):
        h = torch.tanh(x[t] @ w + F.linear(h, v))
    return h.sum()


def recurrent_args(steps, dtype=torch.float32, dim=48):
    x = torch.randn(steps, 3, 20, dtype=dtype)
    w = torch.randn(20, dim, dtype=dtype) / 5
    v = torch.randn(dim, dim, dtype=dtype) / 8
    return x, w.requires_grad_(), v.requires_grad_()


def gradients(fn, args):
    for a in args:
        a.grad = None
    fn(*args).backward()
    return [a.grad for a in args if a.requires_grad]


def backward_slab(compiled, args) -> int:
    """The backward slab of a fresh compile of compiled's function, in the plan that keeps
    its library calls' results and its buffers in the slab (the compiler may take another
    by predicted peak: GradExecutable._compile_backward), so that compiles compare like
    with like."""
    import tjit.autograd.function as function
    with unittest.mock.patch.object(function, "with_library_results_apart", lambda program: None), \
            unittest.mock.patch.object(function, "with_buffers_apart", lambda program: None):
        return tjit.explain(tjit.compile(compiled.fn), *args).backward.memory.slab_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_of_a_weight_read_at_every_step_match_eager(dtype):
    args = recurrent_args(7, dtype)
    compiled = tjit.compile(recurrent)
    got = gradients(compiled, args)
    expected = gradients(recurrent, args)
    if dtype == torch.float32:
        for g, e in zip(got, expected):
            assert_matches_eager(g, e)
    else:  # the partial sums are rounded to bfloat16 per step, as eager's are: where the steps'
        # terms cancel, either may be the luckier, so the tolerance is relative to the terms' size
        exact = gradients(recurrent, [a.detach().double().requires_grad_(a.requires_grad) for a in args])
        for g, e, x in zip(got, expected, exact):
            assert_as_accurate_as_eager(g, e, x, rtol=1.6e-2, atol=1.6e-2 * x.abs().max().item())
    calls = [c.op for c in tjit.explain(compiled, *args).backward.library_calls]
    assert calls.count("aten.addmm.default") == (7 - 1) + (6 - 1)  # w read 7 times, v 6: a call per read after the first


def test_a_weight_read_at_every_step_accumulates_its_gradient_in_one_buffer():
    """Each addmm writes the new partial gradient into the memory of the one it reads (its
    last reader: tjit.memory.liveness.accumulated_in_place), starting from a first product
    computed in the total's layout: one weight-sized buffer per weight, as eager's autograd
    accumulates into .grad, not two (the total read and the total written) or one per step."""
    weight_bytes = (20 * 48 + 48 * 48) * 4  # w's and v's
    short, long = backward_slab(tjit.compile(recurrent), recurrent_args(3)), \
        backward_slab(tjit.compile(recurrent), recurrent_args(12))
    # the backward's own rows ([3, 48] per step) may add a little; a second partial
    # gradient per weight would add weight_bytes
    assert long < 1.5 * weight_bytes and short < 1.5 * weight_bytes, (short, long)


def prenorm_layers(x, weights, norm_weights, norm_biases):
    """A transformer's residual stream: x + linear(layer_norm(x)) per layer."""
    for w, g, b in zip(weights, norm_weights, norm_biases):
        x = x + F.linear(F.layer_norm(x, x.shape[-1:], g, b), w)
    return x.sum()


def layer_args(layers, shape=(64, 40)):
    x = torch.randn(*shape)
    weights = [(torch.randn(40, 40) / 7).requires_grad_() for _ in range(layers)]
    norm_weights = [torch.randn(40).requires_grad_() for _ in range(layers)]
    norm_biases = [torch.randn(40).requires_grad_() for _ in range(layers)]
    return x, weights, norm_weights, norm_biases


def assert_layers_match_eager_in_a_slab_that_does_not_grow(layers_fn, shape=(64, 40), depths=(2, 6)):
    """Gradients of the deeper stack against eager's; the backward slab of the two depths
    (six layers against two, unless told)."""
    shallow, deep = depths
    compiled = tjit.compile(layers_fn)
    args = layer_args(deep, shape)
    params = [p for group in args[1:] for p in group]
    compiled(*args).backward()
    got = [p.grad for p in params]
    for p in params:
        p.grad = None
    layers_fn(*args).backward()
    for g, p in zip(got, params):  # (sums over rows in another order than eager's)
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)
    rows = 64 * 40 * 4
    few, many = backward_slab(compiled, layer_args(shallow, shape)), backward_slab(compiled, args)
    # held to the end, each layer's [64, 40] gradient rows would add 4 * rows at least
    assert many - few < 2 * rows, (few, many)


def test_each_layers_norm_gradients_do_not_wait_for_the_last_layer():
    assert_layers_match_eager_in_a_slab_that_does_not_grow(prenorm_layers)


def test_one_matmul_result_contributing_twice_to_a_gradient():
    def twice(x, w, v):  # the gradient of x @ w: y's gradient (an mm result) from both operands of the add
        y = x @ w
        return ((y + y) @ v).sum()
    args = (torch.randn(5, 4), torch.randn(4, 3, requires_grad=True), torch.randn(3, 6, requires_grad=True))
    got = gradients(tjit.compile(twice), args)
    expected = gradients(twice, args)
    for g, e in zip(got, expected):
        assert_matches_eager(g, e)


def residual_layers(x, *weights):
    """Residual layers whose backward reads each layer's saved values early and makes
    [rows, dim] buffers (matmul results, norm rows) for the layers below later."""
    for w in weights:
        x = F.layer_norm(torch.tanh(x @ w), (x.shape[-1],)) + x
    return x.square().mean()


def residual_args():
    return [torch.randn(100, 64, requires_grad=True)] + [(torch.randn(64, 64) / 8).requires_grad_() for _ in range(3)]


def step_peak(compiled, args) -> int:
    """The measured peak of a training step (after two that warm up), plus the slabs held."""
    from test_peak_memory import measured, training_step
    return measured(training_step(compiled, args), compiled, args)


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_a_backward_that_runs_once_keeps_buffers_in_the_tape_blocks_it_has_read(monkeypatch):
    """Each saved value's tape block is free once the backward has read it; the buffers the
    backward makes after that may live there instead of the slab. Measured against the same
    backward without that (the slab holds every buffer), the training step peaks lower."""
    import tjit.autograd.function as function
    args = residual_args()
    compiled = tjit.compile(residual_layers)
    explained = tjit.explain(compiled, *args)
    assert explained.backward.hosted, "no buffer lives in a tape block"
    hosted = step_peak(compiled, args)
    assert abs(hosted - explained.peak_memory.peak) <= 0.01 * hosted, (hosted, str(explained.peak_memory))
    got = [a.grad for a in args]
    for g, want in zip(got, torch.autograd.grad(residual_layers(*args), args)):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)
    tjit.memory.release()
    monkeypatch.setattr(function, "with_tape_donated", lambda program, tape: program)
    for form in ("with_library_results_apart", "with_buffers_apart"):  # (the slab holds every buffer)
        monkeypatch.setattr(function, form, lambda program: None)
    plain = tjit.compile(residual_layers)
    assert not tjit.explain(plain, *args).backward.hosted
    assert hosted <= step_peak(plain, args) - 100 * 64 * 4, "the step should peak at least one [100, 64] buffer lower"


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_a_backward_that_keeps_the_graph_leaves_the_tape_as_it_found_it():
    """retain_graph=True (and autograd.grad's default when asked to keep it) runs a backward
    that hosts nothing in the tape: a second backward reads the saved values intact."""
    args = residual_args()
    compiled = tjit.compile(residual_layers)
    assert tjit.explain(compiled, *args).backward.hosted
    want = torch.autograd.grad(residual_layers(*args), args)
    out = compiled(*args)
    first = torch.autograd.grad(out, args, retain_graph=True)
    second = torch.autograd.grad(out, args)  # runs once: its tape blocks host buffers
    third = torch.autograd.grad(compiled(*args), args)
    for grads in (first, second, third):
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def embedded_products(i, table, w2, w3):
    return ((F.embedding(i, table) @ w2).sin() @ w3).sin().sum()


def test_an_embedding_gradient_is_allocated_after_the_layers_above_it_are_differentiated():
    """The zeros an embedding's gradient is scattered into read no memory: they are written
    right before the scatter, not at the backward's start, nor by the launch of a pointwise
    kernel before the last layer's products (the table would be alive under their
    results), so the table is not alive while the layers above are differentiated, as in
    eager, which allocates it in the embedding's backward."""
    table = torch.randn(300, 40, requires_grad=True)  # (several programs for the fill)
    w2, w3 = ((torch.randn(40, 40) / 6).requires_grad_() for _ in range(2))
    i = torch.randint(0, 300, (4, 50))  # (repeated rows among 200 indices)
    compiled = tjit.compile(embedded_products)
    args = (i, table, w2, w3)
    got = gradients(compiled, args)
    for g, want in zip(got, gradients(embedded_products, args)):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)
    events = [e for e in tjit.explain(compiled, *args).peak_memory.events if "backward step" in e.where]
    allocated = [e.what for e in events if e.bytes > 0]
    products = [k for k, what in enumerate(allocated) if what.startswith("aten.mm")]
    assert len(products) >= 2 and allocated.index("output grad_table") > max(products), allocated


def postnorm_layers(x, weights, norm_weights, norm_biases):
    """A post-norm residual stream (BERT's): x = layer_norm(x + linear(x)) per layer."""
    for w, g, b in zip(weights, norm_weights, norm_biases):
        x = F.layer_norm(x + F.linear(x, w), x.shape[-1:], g, b)
    return x.sum()


@pytest.mark.usefixtures("library_matmuls")  # (about the buffers written for library calls)
@pytest.mark.parametrize("shape", [(64, 40), (4, 16, 40)], ids=["rows", "batch_rows"])
def test_a_residual_streams_values_and_gradients_are_read_from_the_buffers_written_for_its_linears(shape):
    """Each layer's input (and the gradient flowing down the stream) is written to memory for
    a linear (as [b*t, d] where the stream is [b, t, d]). The backward reads each layer's
    value and gradient there, and each row's first element (layer_norm's shift) through a
    view of it, rather than computing them again from the saved values of every layer below
    (or above): its slab then does not grow with the depth, as each layer's gradient rows
    and norm-weight gradients are done with at that layer."""
    assert_layers_match_eager_in_a_slab_that_does_not_grow(postnorm_layers, shape)


def postnorm_layers_read_transposed(x, weights, norm_weights, norm_biases):
    """Post-norm layers whose linear reads the stream as [t, b, d] (as nn.MultiheadAttention
    with batch_first=True reads its [b, t, d] input)."""
    for w, g, b in zip(weights, norm_weights, norm_biases):
        x = F.layer_norm(x + F.linear(x.transpose(0, 1), w).transpose(0, 1), x.shape[-1:], g, b)
    return x.sum()


@pytest.mark.usefixtures("library_matmuls")  # (about the buffers written for library calls)
@pytest.mark.spills_at_sm90("a forward norm kernel of the ten layers' stack spills 16 B at sm_90 (before this test too)")
def test_a_layer_input_read_transposed_is_written_just_before_its_linear_reads_it():
    """The backward writes each layer's input, transposed, for its linear's weight gradient.
    Every one can be computed from the tape at the backward's start; each is computed in
    the kernel that runs just before its linear (a norm backward's, over the same elements
    in [b, t, d] order), so the slab stops growing after the first layers rather than
    holding one input per layer from the start."""
    assert_layers_match_eager_in_a_slab_that_does_not_grow(postnorm_layers_read_transposed, (4, 16, 40), (6, 10))


def test_a_stream_read_transposed_by_its_linears_is_differentiated_as_one_value():
    """The linears read each layer's normed stream as [t, b, d], a copy of the norm's
    expression in that layout; the backward differentiates the norm once, as it does for a
    stream its linears read as it is: the same kernels and reductions (before, each norm's
    row statistics and weight gradients were reduced once per layout: twice the kernels)."""
    def backward_of(fn):
        explained = tjit.explain(tjit.compile(fn), *layer_args(3, (4, 16, 40)))
        return len(explained.backward.kernels), str(explained.backward.graph).count(" = reduce.")

    assert backward_of(postnorm_layers_read_transposed) == backward_of(postnorm_layers)
    x, *params = layer_args(3, (4, 16, 40))
    leaves = [x.requires_grad_(), *(p for group in params for p in group)]
    compiled = tjit.compile(lambda x, *flat: postnorm_layers_read_transposed(x, flat[:3], flat[3:6], flat[6:]))
    eager = lambda x, *flat: postnorm_layers_read_transposed(x, flat[:3], flat[3:6], flat[6:])  # noqa: E731
    for got, expected in zip(gradients(compiled, leaves), gradients(eager, leaves)):  # (sums in another order)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

"""Recurrent cells (nn.GRUCell, nn.LSTMCell, torch.gru_cell, torch.lstm_cell) unrolled over
time steps, against eager: traced as functional code (tjit/frontend/rnn_cells.py), their gates
fuse into one kernel per step between the matmuls, with no library call copying a gate buffer
to write it in place."""
import pytest
import torch
import torch.nn.functional as F

import tjit
from helpers import check_against_eager, clone_args, launches

pytestmark = pytest.mark.usefixtures("fresh_seed")

BATCH, INPUT, HIDDEN, STEPS = 30, 40, 36, 4  # (3 * HIDDEN * BATCH gate elements: several programs)


def weights(gates: int):
    return (torch.randn(gates * HIDDEN, INPUT) / 6, torch.randn(gates * HIDDEN, HIDDEN) / 6,
            torch.randn(gates * HIDDEN), torch.randn(gates * HIDDEN))


def unrolled_gru(xs, h, w_ih, w_hh, b_ih, b_hh):
    for t in range(xs.shape[1]):
        h = torch.gru_cell(xs[:, t], h, w_ih, w_hh, b_ih, b_hh)
    return h


def unrolled_lstm(xs, h, c, w_ih, w_hh, b_ih, b_hh):
    for t in range(xs.shape[1]):
        h, c = torch.lstm_cell(xs[:, t], (h, c), w_ih, w_hh, b_ih, b_hh)
    return h, c


def check_gradients(fn, *args):
    """Every input's gradient, compiled against eager, after backward of a random weighting of
    the outputs."""
    outputs = fn(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    weighting = [torch.randn(o.shape) for o in outputs]
    grads = []
    for run in (fn, tjit.compile(fn)):
        leaves = [a.detach().requires_grad_() for a in clone_args(args)]
        result = run(*leaves)
        result = result if isinstance(result, tuple) else (result,)
        sum((r * w).sum() for r, w in zip(result, weighting)).backward()
        grads.append([a.grad for a in leaves])
    for k, (want, got) in enumerate(zip(*grads)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"gradient of input {k}: {m}")


def library_ops(compiled, *args) -> set:
    return {call.op for call in tjit.explain(compiled, *args).library_calls}


def most_pointers(compiled, *args) -> int:
    """The most tensors one kernel reads or writes: a step that recomputed the hidden states
    before it, instead of reading the one its matmul read, would read one more per step."""
    return max(k.source.split(")")[0].count("_ptr") for k in tjit.explain(compiled, *args).kernels)


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_gru_cell_steps_are_one_kernel_each_between_the_matmuls():
    args = (torch.randn(BATCH, STEPS, INPUT), torch.randn(BATCH, HIDDEN), *weights(3))
    cf = check_against_eager(unrolled_gru, *args)
    assert launches(cf, *args) == STEPS
    assert library_ops(cf, *args) == {"aten.addmm.default"}
    assert most_pointers(cf, *args) <= 4  # the two gate buffers, the previous state, the new one


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_lstm_cell_steps_are_one_kernel_each_between_the_matmuls():
    args = (torch.randn(BATCH, STEPS, INPUT), torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN), *weights(4))
    cf = check_against_eager(unrolled_lstm, *args)
    assert launches(cf, *args) == STEPS
    assert library_ops(cf, *args) == {"aten.addmm.default"}


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_lstm_cell_steps_read_the_previous_cell_state_from_memory():
    """The cell state c, which no matmul reads, is written by the step that computes it
    (fusion._store_shared_values); recomputed, each step would read every earlier step's gates."""
    args = (torch.randn(BATCH, STEPS, INPUT), torch.randn(BATCH, HIDDEN), torch.randn(BATCH, HIDDEN), *weights(4))
    assert most_pointers(tjit.compile(unrolled_lstm), *args) <= 5  # gates, h and c before, h and c after


def test_gru_cell_gradients():
    check_gradients(unrolled_gru, torch.randn(BATCH, STEPS, INPUT), torch.randn(BATCH, HIDDEN), *weights(3))


def test_lstm_cell_gradients():
    check_gradients(unrolled_lstm, torch.randn(BATCH, STEPS, INPUT), torch.randn(BATCH, HIDDEN),
                    torch.randn(BATCH, HIDDEN), *weights(4))


def test_modules_without_biases_and_with_unbatched_inputs():
    gru, lstm = torch.nn.GRUCell(INPUT, HIDDEN, bias=False), torch.nn.LSTMCell(INPUT, HIDDEN)

    def fn(x, h):  # (nn's cells give 1-d inputs a batch axis of their own before the aten op)
        return gru(x, h), lstm(x)
    check_against_eager(fn, torch.randn(INPUT), torch.randn(HIDDEN))



def tanh_loop(xs, h, w):
    for t in range(xs.shape[1]):
        h = torch.tanh(xs[:, t] * torch.sigmoid(h @ w) + h)
    return h


def backward_loads(fn, *args) -> int:
    """The loads in the source of the backward's kernels."""
    leaves = [a.detach().requires_grad_() for a in args]
    return sum(k.source.count("tl.load") for k in tjit.explain(tjit.compile(fn), *leaves).backward.kernels)


@pytest.mark.parametrize("cell", ["gru", "tanh"])
def test_backward_work_grows_linearly_with_the_steps(cell):
    """Each backward step reads the state its forward step wrote (saved for the matmul's
    gradient anyway: backward._saved_copies), and a gate gradient placed into the gates'
    wider tensor is written once by the step that computes it (accumulate's
    _pieces_from_buffers). Either recomputed, every step's kernel would compute every step
    before it again: loads that grow with the square of the steps (1250 -> 4418 for a GRU
    from 8 to 16 steps before both)."""
    def args(steps):
        if cell == "gru":
            return (torch.randn(BATCH, steps, INPUT), torch.randn(BATCH, HIDDEN), *weights(3))
        return (torch.randn(BATCH, steps, HIDDEN), torch.randn(BATCH, HIDDEN), torch.randn(HIDDEN, HIDDEN) / 6)
    fn = unrolled_gru if cell == "gru" else tanh_loop
    check_gradients(fn, *args(16))
    assert backward_loads(fn, *args(16)) <= 2.2 * backward_loads(fn, *args(8))


def embedded_residual_stack(ids, table, ws):
    x = table[ids]  # a token embedding's lookup, under the residual stream
    for w in ws:
        x = x + F.layer_norm(x, x.shape[-1:]) @ w
    return F.layer_norm(x, x.shape[-1:])


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_a_residual_stream_over_an_embedding_is_read_from_memory_not_recomputed():
    """Each layer's norm kernel reads the residual stream an earlier kernel wrote: with the
    embedding lookup (a gather) under it, the stream counted as non-pointwise, and every
    layer's kernel summed the lookup and all earlier layers' outputs again (the last of 12
    layers' kernels read 16 tensors: quadratic in depth; now at most 8, whatever the depth)."""
    layers, d = 12, 40
    args = (torch.randint(0, 50, (3, 37)), torch.randn(50, d), [torch.randn(d, d) / d for _ in range(layers)])
    cf = check_against_eager(embedded_residual_stack, *args)
    assert most_pointers(cf, *args) <= 8


def embedded_residual_layers(ids, table, *ws):
    return embedded_residual_stack(ids, table, ws).square().mean()


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_a_training_forward_writes_each_saved_residual_stream_once():
    """In training each layer's residual stream is saved for the backward (an output of the
    forward). Its store ran in the forward's last kernel, which computed every layer's stream
    again from the lookup and the layers' outputs, and, since that kernel read them all
    anyway, each layer's norm kernel computed its stream from them too rather than read an
    earlier one (the 12th layer's kernel loaded 9 tensors, the last kernel 23). Now the
    kernel that first computes a layer's stream writes it into the saved output's memory,
    and the next layer's reads it."""
    layers, d = 12, 40
    ids, table = torch.randint(0, 50, (3, 37)), torch.randn(50, d)
    ws = [torch.randn(d, d) / d for _ in range(layers)]
    grads = []
    for run in (embedded_residual_layers, tjit.compile(embedded_residual_layers)):
        leaves = [a.clone().requires_grad_() for a in (table, *ws)]
        grads.append(torch.autograd.grad(run(ids, *leaves), leaves))
    for got, want in zip(*reversed(grads)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    leaves = [a.clone().requires_grad_() for a in (table, *ws)]
    forward = tjit.explain(tjit.compile(embedded_residual_layers), ids, *leaves).kernels
    assert max(k.source.count("tl.load") for k in forward) <= 6  # (the stream, a layer's output, ...)

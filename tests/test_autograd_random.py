"""Gradients of random compositions (elementwise ops, reductions, scans, views, gathers,
totals) and of random chains of view ops on inputs of random layouts, against eager.
The functions are fixed by seed; their inputs and incoming gradients are fresh each run."""
import random

import pytest
import torch

import tjit
from test_random_compositions import random_function

def grads_of(fn, inputs, incoming):
    """(outputs, gradients of the inputs) after backward of sum(out * incoming)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    total = sum((o.float() * w).sum() for o, w in zip(outs, incoming) if o.requires_grad)
    total.backward()
    return outs, [t.grad for t in leaves if t.requires_grad]


def assert_grads_match(got, expected, what):
    assert len(got) == len(expected), what
    for g, e in zip(got, expected):
        if e is None:
            assert g is None or not g.any(), what
            continue
        torch.testing.assert_close(g, e, equal_nan=True, msg=lambda m: f"{what}\n{m}")


@pytest.mark.parametrize("seed", range(24))
def test_gradient_of_random_composition_matches_eager(seed):
    rng = random.Random(1000 + seed)
    fn, steps = random_function(rng)
    shape = (rng.randint(1, 7), rng.randint(2, 30))
    dtype = rng.choice([torch.float32, torch.float32, torch.float64])
    x, y = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    i = torch.randint(0, 50, (rng.randint(1, 5),))
    try:
        outs = fn(x, y, i)
    except RuntimeError:
        pytest.skip(f"eager refuses {steps}")
    incoming = [torch.randn(o.shape) for o in (outs if isinstance(outs, tuple) else (outs,))]
    expected_outs, expected = grads_of(fn, (x, y, i), incoming)
    compiled = tjit.compile(fn)
    got_outs, got = grads_of(compiled, (x, y, i), incoming)
    for g, e in zip(got_outs, expected_outs):
        torch.testing.assert_close(g, e, equal_nan=True)
    assert_grads_match(got, expected, f"steps {steps}")


VIEW_OPS = [
    lambda a, r: a.t() if a.dim() == 2 else a.flip(0),
    lambda a, r: a[r.randrange(a.shape[0]):] if a.shape[0] > 1 else a,
    lambda a, r: a[..., ::2],
    lambda a, r: a.flip(-1),
    lambda a, r: a.reshape(-1) if a.dim() > 1 else a.unsqueeze(0),
    lambda a, r: a.unsqueeze(1).expand(a.shape[0], 3, *a.shape[1:]),
    lambda a, r: a.select(0, r.randrange(a.shape[0])) if a.dim() > 1 else a,
    lambda a, r: a.narrow(-1, 1, a.shape[-1] - 1) if a.shape[-1] > 1 else a,
    lambda a, r: torch.diagonal(a) if a.dim() == 2 else a,
    lambda a, r: a.permute(*reversed(range(a.dim()))),
    lambda a, r: a.chunk(2, 0)[-1],
    lambda a, r: a * 2,
]


def view_chain(seed: int):
    rng = random.Random(seed)
    picks = [rng.randrange(len(VIEW_OPS)) for _ in range(rng.randint(1, 4))]
    choices = random.Random(seed + 1)

    def fn(x):
        r = random.Random(choices.random())
        a = x
        for k in picks:
            a = VIEW_OPS[k](a, r)
        return a.exp() if a.numel() else a

    return fn, picks


def random_layout(rng: random.Random, shape):
    """A tensor of `shape`: contiguous, transposed, or a strided slice of a larger one."""
    kind = rng.choice(["contiguous", "transposed", "sliced"])
    if kind == "transposed":
        return torch.randn(*reversed(shape)).t() if len(shape) == 2 else torch.randn(shape)
    if kind == "sliced":
        return torch.randn(shape[0], 2 * shape[1] + 1)[:, 1::2]
    return torch.randn(shape)


@pytest.mark.parametrize("seed", range(30))
def test_gradient_through_random_view_chains_matches_eager(seed):
    fn, picks = view_chain(seed)
    rng = random.Random(seed)
    x = random_layout(rng, (rng.randint(2, 6), rng.randint(2, 9)))
    # one function per call: the chain draws its slice positions from a fixed stream
    out = view_chain(seed)[0](x)
    incoming = [torch.randn(out.shape)]
    _, expected = grads_of(view_chain(seed)[0], (x,), incoming)
    _, got = grads_of(tjit.compile(view_chain(seed)[0]), (x,), incoming)
    assert_grads_match(got, expected, f"views {picks} on a {tuple(x.shape)} input with strides {x.stride()}")

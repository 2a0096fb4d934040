"""Random compositions of elementwise ops, reductions, scans, views, gathers and totals,
against eager: the shapes of code no hand-written test thought of. The functions are fixed
by seed; their inputs are fresh each run."""
import random

import pytest
import torch

import tjit
from helpers import assert_matches_eager

UNARY = [lambda a: a.exp(), lambda a: a.tanh(), lambda a: a * 2 + 1, lambda a: a.abs().sqrt(), lambda a: a.sigmoid(),
         lambda a: -a]
REDUCE = [
    lambda a, d: a.sum(d, keepdim=True), lambda a, d: a.amax(d, keepdim=True), lambda a, d: a.mean(d, keepdim=True),
    lambda a, d: a.softmax(d), lambda a, d: a.log_softmax(d), lambda a, d: a.cumsum(d),
    lambda a, d: a.var(d, keepdim=True), lambda a, d: a.logsumexp(d, keepdim=True),
    lambda a, d: a.max(d, keepdim=True)[0], lambda a, d: a.cummax(d)[0], lambda a, d: a.norm(dim=d, keepdim=True),
]  # no argmax: after arithmetic, a one-ulp difference between near-ties would change the index
VIEW = [lambda a: a.t() if a.dim() == 2 else a, lambda a: a.flip(0), lambda a: a[::2], lambda a: a.contiguous()]


def random_function(rng: random.Random):
    steps = [(rng.choice(["unary", "reduce", "view", "binary", "index", "total"]), rng.randrange(100))
             for _ in range(rng.randint(2, 6))]

    def fn(x, y, i):
        a, extra = x, []
        for kind, k in steps:
            if kind == "unary":
                a = UNARY[k % len(UNARY)](a)
            elif kind == "reduce" and a.dim():
                a = REDUCE[k % len(REDUCE)](a, k % a.dim())
            elif kind == "view":
                a = VIEW[k % len(VIEW)](a)
            elif kind == "binary":
                a = a + (y if a.shape == y.shape else y.sum())
            elif kind == "index" and a.dim() == 2:
                a = a[i % a.shape[0]]
            elif kind == "total":
                extra.append(a.mean())
        return (a, *extra)
    return fn, steps


@pytest.mark.parametrize("seed", range(30))
def test_random_composition_matches_eager(seed):
    rng = random.Random(seed)
    fn, steps = random_function(rng)
    shape = (rng.randint(1, 9), rng.randint(1, 40))
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.float16, torch.bfloat16])
    x, y = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    i = torch.randint(0, 50, (rng.randint(1, 5),))
    try:
        expected = fn(x, y, i)
    except RuntimeError:
        pytest.skip(f"eager refuses {steps}")
    assert_matches_eager(tjit.compile(fn)(x, y, i), expected, f"steps {steps}")

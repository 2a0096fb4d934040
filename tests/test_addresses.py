"""The integer-set answers about views (tjit/analysis/addresses.py, bounds.py) against brute
force: every address each view reaches, enumerated."""
import ast
import itertools

import islpy as isl
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tjit
from tjit.analysis.addresses import (disjoint, meets_only_where_tied, overlaps_itself, pairwise_disjoint,
                                     shared_addresses, within)
from tjit.analysis.bounds import outside, reached
from tjit.ir.view import View


def enumerated(view: View) -> list[int]:
    """Every address the view reaches, once per index."""
    return [view.offset + sum(i * s for i, s in zip(index, view.strides))
            for index in itertools.product(*(range(n) for n in view.shape))]


def points(isl_set) -> set[int]:
    """The addresses in an isl set, enumerated."""
    found = set()
    isl_set.foreach_point(lambda p: found.add(p.get_coordinate_val(isl.dim_type.set, 0).to_python()))
    return found


def random_view(rng: np.random.Generator, negative: bool) -> View:
    """Sizes 0..5 (0 and 1 often), strides of any sign pattern (negative: tjit's flipped
    views; torch's own strides are >= 0), offsets that keep addresses near one another."""
    ndim = int(rng.integers(0, 4))
    shape = tuple(int(rng.choice([0, 1, 1, 2, 3, 4, 5])) for _ in range(ndim))
    low = -6 if negative else 0
    strides = tuple(int(rng.integers(low, 7)) for _ in range(ndim))
    return View(shape, strides, int(rng.integers(0, 25)))


def test_ten_thousand_random_view_pairs_agree_with_brute_force():
    rng = np.random.default_rng(0)
    for k in range(10_000):
        a, b = random_view(rng, negative=k % 2 == 1), random_view(rng, negative=k % 3 == 1)
        ea, eb = enumerated(a), enumerated(b)
        assert overlaps_itself(a) == (len(set(ea)) < len(ea)), a
        assert disjoint(a, b) == (not set(ea) & set(eb)), (a, b)
        assert within(a, b) == (set(ea) <= set(eb)), (a, b)


def test_meets_only_where_tied_agrees_with_brute_force():
    rng = np.random.default_rng(2)
    for k in range(2000):
        read = random_view(rng, negative=k % 2 == 1)
        write = View(read.shape, tuple(int(rng.integers(-6 if k % 3 else 0, 7)) for _ in read.shape),
                     int(rng.integers(0, 25)))
        tied = [d for d in range(read.ndim) if rng.random() < 0.6]
        indices = list(itertools.product(*(range(n) for n in read.shape)))
        address = lambda v, i: v.offset + sum(a * s for a, s in zip(i, v.strides))  # noqa: E731
        expected = all(all(i[d] == j[d] for d in tied) for i in indices for j in indices
                       if address(read, i) == address(write, j))
        assert meets_only_where_tied(read, write, tied) == expected, (read, write, tied)


views = st.integers(0, 3).flatmap(lambda ndim: st.builds(
    View, st.tuples(*[st.integers(0, 6)] * ndim), st.tuples(*[st.integers(-8, 8)] * ndim), st.integers(0, 40)))


@settings(max_examples=300, deadline=None)
@given(views, views)
def test_the_shared_addresses_are_exactly_those_both_views_reach(a, b):
    assert points(shared_addresses(a, b)) == set(enumerated(a)) & set(enumerated(b))


def test_known_layouts():
    x = View.contiguous((64, 300))
    even, odd = View((64, 150), (300, 2)), View((64, 150), (300, 2), 1)
    assert disjoint(even, odd) and within(even, x) and within(odd, x) and not within(x, even)
    assert pairwise_disjoint([View((3, 40), (40, 1)), View((3, 40), (40, 1), 120)])
    assert not pairwise_disjoint([View((4, 40), (40, 1)), View((3, 40), (40, 1), 120)])
    assert overlaps_itself(View((5, 4), (2, 1)))  # sliding windows
    assert overlaps_itself(View((3, 4), (0, 1)))  # expanded
    assert not overlaps_itself(View((4, 4), (1, 4)))  # a transpose
    assert not overlaps_itself(View((4, 4), (-4, -1), 15))  # flipped both ways
    assert not overlaps_itself(View((0, 4), (0, 0)))  # empty
    # strides 2 and 3 interleave: 2i + 3j collides first at i = 3 (2*3 = 3*2), so a 3x3 view
    # reaches 9 addresses and a 4x3 view does not (a rule over sorted strides says both overlap)
    assert not overlaps_itself(View((3, 3), (2, 3))) and len(set(enumerated(View((3, 3), (2, 3))))) == 9
    assert overlaps_itself(View((4, 3), (2, 3)))


# -- bounds proofs (tjit/analysis/bounds.py) ---------------------------------------------------
def test_outside_agrees_with_brute_force():
    rng = np.random.default_rng(1)
    for k in range(3000):
        view, allowed = random_view(rng, negative=k % 2 == 1), random_view(rng, negative=False)
        stray = set(enumerated(view)) - set(enumerated(allowed))
        problem = outside(view, allowed)
        assert (problem is None) == (not stray), (view, allowed, problem)
        if problem:  # the counterexample is real: that index of the view reaches that stray address
            index = ast.literal_eval("[" + problem.split("[")[1].split("]")[0] + "]")
            address = view.offset + sum(i * s for i, s in zip(index, view.strides))
            assert address in stray and f"element {address}," in problem


def test_a_gathered_axis_reaches_every_row_of_the_table():
    table = View.contiguous((150, 64))
    assert outside(reached(View((7, 64), (0, 1)), (64, 150, 7 * 64)), table) is None
    assert outside(reached(View((7, 64), (0, 1), 64), (64, 150, 7 * 64)), table) is not None


def test_the_verifier_names_an_access_that_leaves_its_buffer(monkeypatch):
    """Every kernel the suite builds passes verify_bounds (TJIT_VERIFY=1, conftest); a view
    moved one element past its buffer is caught, with the access and a counterexample."""
    import dataclasses
    import torch
    import tjit.pipeline as pipeline
    from tjit.lower.codegen import KernelPlan

    def shift_loads(graph, steps, output_strides):
        for step in steps:
            if isinstance(step, KernelPlan):
                step.accesses = [a if a.store else dataclasses.replace(a, view=dataclasses.replace(a.view, offset=a.view.offset + 1))
                                 for a in step.accesses]
        return checked(graph, steps, output_strides)

    checked = pipeline.verify_bounds
    monkeypatch.setattr(pipeline, "verify_bounds", shift_loads)
    with pytest.raises(pipeline.VerifyError, match=r"load of input x can leave its memory: index \[.*\] reaches element 3000,"):
        tjit.compile(lambda x: x.exp())(torch.randn(3000))

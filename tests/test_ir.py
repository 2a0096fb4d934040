"""The IR's View against torch's own view semantics, and the graph's text form."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tjit.ir import DType, GraphBuilder, View
from tjit.ir.graph import Elementwise

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def torch_view(t: torch.Tensor) -> View:
    return View(tuple(t.shape), tuple(t.stride()), t.storage_offset())


@st.composite
def strided_tensor(draw):
    """A tensor viewing a larger buffer through a random permute / slice / expand."""
    shape = draw(shapes)
    t = torch.empty(max(1, math.prod(s + 3 for s in shape)) * 4)[: max(1, math.prod(shape))]
    t = t[: math.prod(shape)].view(shape) if math.prod(shape) else torch.empty(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        perm = draw(st.permutations(range(t.dim())))
        t = t.permute(*perm)
    if t.dim() >= 1 and draw(st.booleans()):
        d = draw(st.integers(0, t.dim() - 1))
        step = draw(st.integers(1, 3))
        t = t.narrow(d, 0, t.shape[d]).__getitem__((slice(None),) * d + (slice(draw(st.integers(0, 2)), None, step),))
    return t


@given(strided_tensor(), st.data())
@settings(max_examples=200, deadline=None)
def test_movement_ops_match_torch(t, data):
    v = torch_view(t)
    assert v.is_contiguous() == (t.is_contiguous() and (t.storage_offset() == 0 or t.numel() == 0))
    if t.dim():
        perm = data.draw(st.permutations(range(t.dim())))
        assert v.permute(perm) == torch_view(t.permute(*perm))
        d = data.draw(st.integers(0, t.dim() - 1))
        assert v.flip([d]).shape == t.shape
        start, stop, step = data.draw(st.integers(-6, 6)), data.draw(st.integers(-6, 6)), data.draw(st.integers(1, 3))
        sl = (slice(None),) * d + (slice(start, stop, step),)
        assert v.slice(d, start, stop, step) == torch_view(t[sl]) or t[sl].numel() == 0
        if t.shape[d]:
            idx = data.draw(st.integers(-t.shape[d], t.shape[d] - 1))
            assert v.select(d, idx) == torch_view(t.select(d, idx))
    u = data.draw(st.integers(-t.dim() - 1, t.dim()))
    assert v.unsqueeze(u) == torch_view(t.unsqueeze(u))
    assert v.squeeze() == torch_view(t.squeeze())


@given(strided_tensor(), st.data())
@settings(max_examples=200, deadline=None)
def test_reshape_is_a_view_exactly_when_torch_can_view(t, data):
    n = t.numel()
    divisors = [k for k in range(1, n + 1) if n % k == 0] or [1]
    a = data.draw(st.sampled_from(divisors))
    new_shape = (a, n // a) if n else (0, data.draw(st.integers(1, 3)))
    got = torch_view(t).reshape(new_shape)
    try:
        expected = t.view(new_shape)
    except RuntimeError:
        assert got is None
        return
    assert got is not None
    if n:
        assert got.shape == tuple(expected.shape)
        # strides of size-1 dims are irrelevant; compare the elements each index reaches
        for idx in [(i, j) for i in range(new_shape[0]) for j in range(new_shape[1])][:50]:
            assert got.offset + sum(i * s for i, s in zip(idx, got.strides)) == \
                expected.storage_offset() + sum(i * s for i, s in zip(idx, expected.stride()))


def test_expand_follows_broadcasting():
    v = View.contiguous((3, 1))
    assert v.expand((2, 3, 4)) == View((2, 3, 4), (0, 1, 0))
    with pytest.raises(ValueError, match="cannot become"):
        v.expand((2, 4))


def test_flip_reads_backwards():
    t = torch.arange(12.).view(3, 4)
    v = View.contiguous((3, 4)).flip([1])
    flat = t.flatten()
    for i in range(3):
        for j in range(4):
            assert flat[v.offset + i * v.strides[0] + j * v.strides[1]] == t.flip(1)[i, j]


def test_nodes_are_hash_consed_and_printable():
    b = GraphBuilder()
    x = b.input("x", DType.float32, View.contiguous((2, 3)))
    one = b.node(Elementwise("neg"), DType.float32, (x,), View.contiguous((2, 3)))
    assert one is b.node(Elementwise("neg"), DType.float32, (x,), View.contiguous((2, 3)))
    graph = b.finish(["x"], {"out0": one})
    text = str(graph)
    assert "input x" in text and "neg(%0)" in text and "return out0=%1" in text
    assert graph.input_node("x") is x


@given(st.lists(st.tuples(st.sampled_from(["add", "mul"]), st.integers(0, 9), st.integers(0, 9)), min_size=1,
                max_size=12))
@settings(max_examples=100, deadline=None)
def test_loads_counted_up_to_a_limit_agree_with_every_read_counted(steps):
    """ValueBuilder.loads(n, up_to=k) == min(reads, k), on expressions over shared inputs,
    where reads counts the distinct memory reads the fused expression makes (a toposort)."""
    from tjit.frontend.build import ValueBuilder, _reads_memory
    from tjit.ir.graph import toposort
    vb = ValueBuilder()
    values = [vb.b.input(f"x{k}", DType.float32, View.contiguous((3,))) for k in range(4)]
    for op, i, j in steps:
        values.append(vb.elementwise(op, [values[i % len(values)], values[j % len(values)]], DType.float32))
    top = values[-1]
    reads = sum(_reads_memory(n) for n in toposort([top], stop=_reads_memory))
    assert vb.loads(top) == reads
    for limit in range(1, 6):
        assert vb.loads(top, up_to=limit) == min(reads, limit)

"""Ops called with out= (`torch.add(x, y, out=o)`), against eager: the result, the out tensor
after the call, and eager's errors. Every out= call crashed tjit with a TypeError (the
converter's handlers take no `out`), through tjit.compile and torch.compile alike, and
`torch.mm(a, b, out=o)` returned garbage silently. Sizes span several programs; out tensors
hold fresh values before the call, so a write that misses shows."""
import pytest
import torch

import tjit

pytestmark = pytest.mark.usefixtures("fresh_seed")

ROWS, COLUMNS = 300, 70

CASES = {
    "add": lambda x, y, o, i: torch.add(x, y, out=o) * 2,
    "add a number with alpha": lambda x, y, o, i: torch.add(x, 3, alpha=2, out=o) - y,
    "exp into a column": lambda x, y, o, i: torch.exp(x[:, 0], out=o[:, 3]) + y[:, 0],
    "sum into a row": lambda x, y, o, i: torch.sum(x, 0, out=o[5]) * y[0],
    "clamp": lambda x, y, o, i: torch.clamp(x, -0.5, 0.5, out=o) + o,
    "where": lambda x, y, o, i: torch.where(x > 0, x, y, out=o),
    "cumsum": lambda x, y, o, i: torch.cumsum(x, 1, out=o) * 2,
    "cat": lambda x, y, o, i: torch.cat([x[:100], y[:200]], out=o) + 1,
    "mm": lambda x, y, o, i: torch.mm(x, y.t()[:, :COLUMNS], out=o) + 1,
    "max with indices": lambda x, y, o, i: torch.max(x, 1, out=(o[:, 0], i[:, 0])),
    "arange": lambda x, y, o, i: torch.arange(float(COLUMNS), out=o[0]) + x,
    "zeros into a row": lambda x, y, o, i: torch.zeros(COLUMNS, out=o[7]) + x,
    "integers into floats": lambda x, y, o, i: torch.add(i, 3, out=o) * x,
    "the out tensor is the input": lambda x, y, o, i: torch.mul(x, y, out=x) + 1,
    "into an intermediate": lambda x, y, o, i: torch.add(x, y, out=torch.empty(ROWS, COLUMNS)).sum(0),
    # (ops whose out= forms call others with out tensors of their own: _linalg_det.result, sort.values)
    "det": lambda x, y, o, i: torch.linalg.det(x[:COLUMNS] + torch.eye(COLUMNS) * 8, out=o[0, 0]) * y,
    "msort": lambda x, y, o, i: torch.msort(x, out=o) + y,
}


def _arguments():
    return (torch.randn(ROWS, COLUMNS), torch.randn(ROWS, COLUMNS), torch.randn(ROWS, COLUMNS),
            torch.randint(0, 9, (ROWS, COLUMNS)))


@pytest.mark.parametrize("compile", ["tjit.compile", "torch.compile"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_op_called_with_out_matches_eager(case, compile):
    fn = CASES[case]
    arguments = _arguments()
    ours, theirs = [a.clone() for a in arguments], [a.clone() for a in arguments]
    compiled = tjit.compile(fn) if compile == "tjit.compile" else torch.compile(fn, backend="tjit")
    expected, got = fn(*theirs), compiled(*ours)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ours, theirs)  # (the out tensors, and an input written as one)


def test_an_out_tensor_that_partially_overlaps_an_input_gets_eagers_error():
    x = torch.randn(ROWS, COLUMNS)
    with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
        torch.add(x[1:], 1, out=x[:-1])
    kept = x.clone()
    with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
        tjit.compile(lambda x: torch.add(x[1:], 1, out=x[:-1]))(x)
    torch.testing.assert_close(x, kept, rtol=0, atol=0)


def test_an_out_tensor_of_a_type_the_result_cannot_be_cast_to_gets_eagers_error():
    x, i = torch.randn(ROWS, COLUMNS), torch.zeros(ROWS, COLUMNS, dtype=torch.long)
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type Long"):
        tjit.compile(lambda x, i: torch.add(x, 1, out=i))(x, i)
    assert not i.any()


@pytest.mark.parametrize("out_rows", [0, 5])
def test_an_out_tensor_the_call_would_resize_is_refused(out_rows):
    """Eager resizes it (and warns, when it had elements); tjit's trace would record the new
    shape from the tensor's start, so the resize is refused by name, the tensors untouched."""
    x, o = torch.randn(ROWS, COLUMNS), torch.randn(out_rows, COLUMNS)
    kept = o.clone()
    with pytest.raises(tjit.UnsupportedOpError, match="resizes its out= tensor"):
        tjit.compile(lambda x, o: torch.add(x, 1, out=o))(x, o)
    torch.testing.assert_close(o, kept, rtol=0, atol=0)


def test_a_product_into_an_out_tensor_that_is_one_of_its_inputs_is_refused():
    """A product reads its inputs while it writes: eager's rules for that vary by op, so a
    non-elementwise op whose out tensor shares memory with an input is refused, not guessed."""
    x, w = torch.randn(ROWS, COLUMNS), torch.randn(COLUMNS, COLUMNS)
    with pytest.raises(tjit.UnsupportedOpError, match="shares memory with an input"):
        tjit.compile(lambda x, w: torch.addmm(x, x, w, out=x))(x, w)


def test_an_out_form_whose_trace_drops_its_write_is_refused():
    """torch's trace of linalg.matrix_rank(..., out=o) computes the rank and never writes o:
    tjit returned o's old value (0 for a rank of 70), silently. A call whose out tensor the
    trace did not write is refused; without out= it compiles."""
    x, o = torch.randn(ROWS, COLUMNS), torch.zeros((), dtype=torch.long)
    with pytest.raises(tjit.UnsupportedOpError, match="records no write into its out= tensor"):
        tjit.compile(lambda x, o: torch.linalg.matrix_rank(x, out=o))(x, o)
    assert o == 0
    assert tjit.compile(lambda x: torch.linalg.matrix_rank(x))(x) == torch.linalg.matrix_rank(x)


def _opinfos_with_out() -> list[str]:
    from test_opinfo import OPINFOS
    return sorted(name for name, op in OPINFOS.items() if op.supports_out)


@pytest.mark.parametrize("name", _opinfos_with_out())
def test_an_opinfo_called_with_out_matches_eager_or_is_refused(name):
    """torch's OpInfo database, each OpInfo that supports out= on its first sample eager runs
    (seeded per OpInfo: the same inputs on every run): the result and the out tensors, which
    hold 7s before the call, match eager's, or tjit refuses by name. Random ops and
    uninitialised memory are compared by shape and dtype."""
    from torch.utils._pytree import tree_leaves, tree_map

    from test_opinfo import OPINFOS, _seeded_call, _values_compared, samples_of
    op = OPINFOS[name]
    for sample in samples_of(name):
        try:
            expected = _seeded_call(lambda: op(sample.input, *sample.args, **sample.kwargs), [])
        except Exception:  # noqa: BLE001 (a sample eager cannot run)
            continue
        if all(isinstance(t, torch.Tensor) for t in tree_leaves(expected)):
            break
    else:
        pytest.skip("no sample eager runs with tensor results")
    inputs = [t for t in tree_leaves((sample.input, sample.args)) if isinstance(t, torch.Tensor)]

    def call(*tensors, into):
        it = iter(tensors)
        given = tree_map(lambda v: next(it) if isinstance(v, torch.Tensor) else v, (sample.input, sample.args))
        return op(given[0], *given[1], **sample.kwargs, out=into)

    def outs():
        return tree_map(lambda t: torch.full_like(t, 7), expected)
    theirs, ours = outs(), outs()
    try:
        want = _seeded_call(lambda *t: call(*t, into=theirs), [t.clone() for t in inputs])
    except Exception:  # noqa: BLE001 (eager refuses out= for this sample)
        pytest.skip("eager refuses out= here")
    try:
        got = _seeded_call(lambda *t: tjit.compile(call)(*t, into=ours), [t.clone() for t in inputs])
    except tjit.TjitError:
        return  # (refused by name)
    values = _values_compared(name, sample)
    for g, e in zip(tree_leaves((got, ours)), tree_leaves((want, theirs))):
        assert g.shape == e.shape and g.dtype == e.dtype
        if values:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, equal_nan=True)

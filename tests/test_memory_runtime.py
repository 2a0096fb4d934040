"""The slab at run time: intermediates at planned offsets in one slab per graph, device and
thread, allocated once; stats, release, TJIT_PREALLOCATE_MB; results unchanged."""
import threading

import pytest
import torch

import tjit
from helpers import check_against_eager


def three_kernels(x):
    """softmax over dim 0 feeds a transposed copy and a cumulative sum: intermediates in buffers."""
    a = x.softmax(0)
    b = a.t().contiguous() + 1
    return b.sum(0), x.cumsum(0).t().contiguous().sum(1) * b.amax()


@pytest.fixture(autouse=True)
def fresh_pool():
    tjit.memory.release()
    yield
    tjit.memory.release()


def test_intermediates_live_in_one_planned_slab():
    x = torch.randn(9, 7)
    cf = check_against_eager(three_kernels, x)
    plan = tjit.explain(cf, x).memory
    plan.check()
    assert len(plan.intervals) >= 2 and plan.slab_size >= plan.lower_bound > 0
    stats = tjit.memory.stats()
    assert stats["slab_count"] == 1 and stats["in_use_bytes"] == plan.slab_size


def test_steady_state_calls_allocate_no_intermediates():
    x = torch.randn(9, 7)
    cf = tjit.compile(three_kernels)
    cf(x)
    before = tjit.memory.stats()
    for _ in range(3):
        check_against_eager(three_kernels, torch.randn(9, 7), compiled=cf)  # fresh values, same slab
    after = tjit.memory.stats()
    assert after["allocations"] == before["allocations"]
    assert after["reuse_hits"] == before["reuse_hits"] + 3


def test_each_thread_gets_its_own_slab():
    x = torch.randn(9, 7)
    cf = tjit.compile(three_kernels)
    results, a_called, b_called = {}, threading.Event(), threading.Event()

    def a():
        results["a"] = cf(x)
        a_called.set()
        b_called.wait()  # stay alive while b calls, so the two threads are distinct

    def b():
        a_called.wait()  # call one after the other: Triton's interpreter is not thread-safe
        results["b"] = cf(x)
        b_called.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tjit.memory.stats()["slab_count"] == 2
    for got in results.values():
        torch.testing.assert_close(got, three_kernels(x))


def test_release_gives_back_and_the_next_call_allocates_again():
    x = torch.randn(9, 7)
    cf = tjit.compile(three_kernels)
    cf(x)
    tjit.memory.release()
    assert tjit.memory.stats()["slab_count"] == 0
    allocations = tjit.memory.stats()["allocations"]
    check_against_eager(three_kernels, x, compiled=cf)
    assert tjit.memory.stats()["allocations"] == allocations + 1


def test_preallocated_pool_holds_the_slabs(monkeypatch):
    monkeypatch.setenv("TJIT_PREALLOCATE_MB", "1")
    x = torch.randn(9, 7)
    cf = check_against_eager(three_kernels, x)  # kept: slabs live as long as their function
    stats = tjit.memory.stats()
    assert stats["reserved_bytes"] == 1 << 20
    assert stats["in_use_bytes"] == tjit.explain(cf, x).memory.slab_size > 0


def buffered(x):
    return (x.t().contiguous() * 2).t().cumsum(1) + x


def test_zero_size_allocates_and_launches_nothing():
    x = torch.randn(0, 7)
    cf = tjit.compile(buffered)
    before_launches, before = tjit.counters.launches, tjit.memory.stats()["allocations"]
    check_against_eager(buffered, x, compiled=cf)
    assert tjit.memory.stats()["allocations"] == before
    assert tjit.counters.launches == before_launches


def test_a_reduction_over_an_empty_axis_still_writes_its_identity():
    fn = lambda x: (x.t().contiguous() + 1).sum(1)  # noqa: E731
    check_against_eager(fn, torch.randn(0, 7))


def test_the_plan_is_in_the_explanation_text():
    x = torch.randn(9, 7)
    text = str(tjit.explain(tjit.compile(three_kernels), x))
    assert "memory plan" in text and "lower bound" in text


def two_results(x, y):
    return x * y + 1, (x - y).sum(1)


def test_out_receives_the_results_in_place():
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    o1, o2 = torch.full((4, 5), float("nan")), torch.full((4,), float("nan"))
    cf = tjit.compile(two_results)
    got = cf(x, y, out=(o1, o2))
    assert got[0] is o1 and got[1] is o2
    torch.testing.assert_close((o1, o2), two_results(x, y))


def test_out_with_another_layout_is_filled_too():
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    o1, o2 = torch.empty(5, 4).t(), torch.empty(8)[::2]
    tjit.compile(two_results)(x, y, out=(o1, o2))
    torch.testing.assert_close((o1, o2), two_results(x, y))


@pytest.mark.parametrize("bad, message", [
    (lambda x, o1, o2: (o1,), "needs 2 tensor"),
    (lambda x, o1, o2: (torch.empty(5, 4), o2), "result is torch.float32 \\[4, 5\\]"),
    (lambda x, o1, o2: (o1.double(), o2), "float64"),
    (lambda x, o1, o2: (x, o2), "overlaps input 'x'"),
    (lambda x, o1, o2: (o1, o1[:, 0]), "overlaps out\\[0\\]"),
])
def test_bad_out_is_refused_before_anything_runs(bad, message):
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    o1, o2 = torch.zeros(4, 5), torch.zeros(4)
    x_before = x.clone()
    with pytest.raises(tjit.CompileArgumentError, match=message):
        tjit.compile(two_results)(x, y, out=bad(x, o1, o2))
    assert torch.equal(x, x_before) and not o1.any() and not o2.any()


def test_a_function_with_its_own_out_parameter_keeps_it():
    def fn(x, out):
        return x + out
    x, o = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(tjit.compile(fn)(x, out=o), x + o)


def scan_of_row_sums(x):
    """x is last read by the first kernel; the scan's buffer is born after that."""
    return x.sum(1).cumsum(0).flip(0) * 2


def test_a_donated_input_holds_intermediates_and_is_unusable_after():
    x = torch.randn(64, 32)
    expected = scan_of_row_sums(x.clone())
    plain = tjit.explain(tjit.compile(scan_of_row_sums), x).memory.slab_size
    cf = tjit.compile(scan_of_row_sums, donate=("x",))
    assert cf.entry_for(x).executable.memory_plan.slab_size < plain
    torch.testing.assert_close(cf(x), expected)
    with pytest.raises(RuntimeError, match="donated"):
        x + 1
    with pytest.raises(tjit.CompileArgumentError, match="donated"):
        cf(x)


@pytest.mark.parametrize("fn, arg, message", [
    (lambda x: x * 2, "y", "not a tensor argument"),
    (lambda x: x.add_(1), "x", "writes into it"),
    (lambda x: x[0], "x", "a result is a view of it"),
])
def test_unsound_donations_are_refused(fn, arg, message):
    x = torch.randn(4, 5)
    with pytest.raises(tjit.CompileArgumentError, match=message):
        tjit.compile(fn, donate=(arg,))(x)


def test_only_contiguous_tensors_can_be_donated():
    with pytest.raises(tjit.CompileArgumentError, match="contiguous"):
        tjit.compile(scan_of_row_sums, donate=("x",))(torch.randn(32, 64).t())

"""The disk cache (runtime/disk_cache.py): a compiled entry an earlier process stored is
loaded instead of traced, and only where everything the trace read is the same.

A new CompiledFunction of the same function has an empty in-memory cache, as a fresh
process has: its first call goes to the disk. One test runs real fresh processes."""
import dataclasses
import functools
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F

import tjit
from tjit.runtime import disk_cache

from helpers import check_against_eager

ROWS, COLS = 300, 130  # several programs per kernel, sizes no block size divides


@pytest.fixture(autouse=True)
def disk(monkeypatch, tmp_path):
    """The disk cache on (the suite turns it off), in a directory of the test's own."""
    monkeypatch.setenv("TJIT_DISK_CACHE", "1")
    monkeypatch.setenv("TJIT_CACHE_DIR", str(tmp_path))
    return tmp_path / "programs"


def _x(*shape, seed=0, **kw):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **kw)


SCALE = 0.5


def helper(z):
    return z.exp().clamp(max=10.0)


def scaled_softmax(x, y, lr: float):
    z = torch.softmax(x * SCALE, -1) * y + lr
    return helper(z), z.cumsum(0)


def _loaded(fn, *args, **compile_options):
    """fn compiled anew (an empty in-memory cache, as in a fresh process) and checked against
    eager; whether its entry was loaded from the disk rather than traced."""
    traces, loads = tjit.counters.traces, tjit.counters.disk_loads
    check_against_eager(fn, *args, **compile_options)
    assert tjit.counters.disk_loads - loads + tjit.counters.traces - traces == 1
    return tjit.counters.disk_loads > loads


def test_a_new_compiled_function_loads_what_an_earlier_one_stored(disk):
    args = (_x(ROWS, COLS), _x(ROWS, COLS, seed=1), 0.25)
    assert not _loaded(scaled_softmax, *args)
    assert len(list(disk.glob("*.entry"))) == 1
    assert "disk cache: loaded: an earlier process compiled it" in str(tjit.explain(scaled_softmax, *args))
    generated = tjit.counters.kernels_generated
    assert _loaded(scaled_softmax, _x(ROWS, COLS, seed=2), _x(ROWS, COLS, seed=3), -1.5)  # (a runtime number)
    assert tjit.counters.kernels_generated == generated
    assert not _loaded(scaled_softmax, _x(ROWS + 1, COLS), _x(ROWS + 1, COLS), 0.25)  # (another size: its own)


def linear_relu_sum(x, w, b):
    return F.relu(F.linear(x, w, b)).sum(0)


@pytest.mark.parametrize("matmul", ["library", "auto"])
def test_a_loaded_entry_runs_library_calls_and_backward(matmul, monkeypatch):
    """The Programs name graph nodes by id() (buffers' memory keys, the slab's aliases): a
    loaded copy names its own nodes. The entry is stored again once its backward is
    compiled, and loaded with it. Gradients are compared with eager's."""
    monkeypatch.setenv("TJIT_MATMUL", matmul)
    disk_cache.environment.cache_clear()  # (the TJIT_* settings are in the key)

    def run(backward_loaded: bool):
        x, w, b = (_x(70, 90), _x(40, 90, seed=1), _x(40, seed=2))
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        compiled = tjit.compile(linear_relu_sum)
        out = compiled(*leaves)
        [entry] = compiled._cache.values()
        assert bool(entry.executable._backward) == backward_loaded
        out.sum().backward()
        eager_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        linear_relu_sum(*eager_leaves).sum().backward()
        torch.testing.assert_close(out, linear_relu_sum(x, w, b))
        for got, expected in zip(leaves, eager_leaves):
            torch.testing.assert_close(got.grad, expected.grad)
    try:
        loads = tjit.counters.disk_loads
        run(backward_loaded=False)
        run(backward_loaded=True)
        assert tjit.counters.disk_loads == loads + 1
    finally:
        disk_cache.environment.cache_clear()


def _wrapped_in_a_library(fn):
    def wrapper(z):
        return fn(z)
    wrapper.__module__ = "torch.utils"  # (as a library's factory that does not copy fn's makes it)
    return wrapper


def test_a_changed_global_helper_or_closure_is_a_new_entry(monkeypatch):
    args = (_x(ROWS, COLS), _x(ROWS, COLS, seed=1), 0.25)
    assert not _loaded(scaled_softmax, *args)
    monkeypatch.setitem(globals(), "SCALE", 2.0)  # (a global the function reads)
    assert not _loaded(scaled_softmax, *args)
    monkeypatch.setitem(globals(), "helper", lambda z: z.sin())  # (a function it calls: other code)
    assert not _loaded(scaled_softmax, *args)
    assert _loaded(scaled_softmax, *args)
    # (a library's wrapper around it, named by the library's module, as every other one is)
    monkeypatch.setitem(globals(), "helper", _wrapped_in_a_library(lambda z: z.cos()))
    assert not _loaded(scaled_softmax, *args)
    monkeypatch.setitem(globals(), "helper", _wrapped_in_a_library(lambda z: z.tanh()))
    assert not _loaded(scaled_softmax, *args)

    def closing_over(k):
        return lambda x: x * k
    assert not _loaded(closing_over(3.0), args[0])
    assert not _loaded(closing_over(4.0), args[0])
    assert _loaded(closing_over(3.0), args[0])


def test_a_graph_dynamo_captured_is_loaded_with_its_backward_after_dynamo_captures_it_again():
    """torch.compile(model, backend="tjit") in a fresh process: Dynamo captures the graph
    again, and tjit loads its entry (forward and backward) instead of compiling it."""
    import torch._dynamo
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(90, 130), torch.nn.GELU(), torch.nn.LayerNorm(130),
                                torch.nn.Linear(130, 7))
    x = _x(70, 90)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    for loaded in (False, True):
        torch._dynamo.reset()  # (Dynamo captures it again, as in a fresh process)
        model.zero_grad()
        traces, loads = tjit.counters.traces, tjit.counters.disk_loads
        torch.compile(model, backend="tjit")(x).square().mean().backward()
        assert (tjit.counters.traces - traces, tjit.counters.disk_loads - loads) == ((0, 1) if loaded else (1, 0))
        for got, grad in zip(model.parameters(), expected):
            torch.testing.assert_close(got.grad, grad)


def test_graphs_dynamo_captured_are_keyed_by_their_nodes():
    """Until its first call, every graph Dynamo captures has the same forward (a _LazyGraphModule
    generates its code then): keyed by that, the second graph loaded the first's entry (its
    results, silently). The key holds the graph's nodes."""
    x = _x(ROWS, COLS)
    for fn in (lambda t: t[1:-1][::2] + 1, lambda t: torch.cat([t[:1] * 2, t[-1:]]), lambda t: t.sin().sum(0)):
        loads = tjit.counters.disk_loads
        torch.testing.assert_close(torch.compile(fn, backend="tjit")(x), fn(x))
        assert tjit.counters.disk_loads == loads


SETTINGS = types.ModuleType("settings")  # (a user's module: its attributes the function reads are in the key)
SETTINGS.scale = 2.0


@tjit.compile
def compiled_helper(z):
    return z.sigmoid() * 2


def reads_a_modules_attribute_and_calls_a_compiled_function(x):
    return compiled_helper(x * SETTINGS.scale) + 1


def test_a_user_modules_attribute_and_a_compiled_helper_are_read_into_the_key(monkeypatch):
    """(The compiled helper runs inside the function's trace as itself: its ops are traced.)"""
    x = _x(ROWS, COLS)
    compiled_helper(x)  # (compiled once here: eager's reference calls it too)
    assert not _loaded(reads_a_modules_attribute_and_calls_a_compiled_function, x)
    assert _loaded(reads_a_modules_attribute_and_calls_a_compiled_function, x)
    monkeypatch.setattr(SETTINGS, "scale", -3.0)
    assert not _loaded(reads_a_modules_attribute_and_calls_a_compiled_function, x)


TABLE = torch.arange(COLS, dtype=torch.float32)


def add_table(x):
    return x + TABLE


def table_shaped(x):
    return x.reshape(TABLE.shape[0], -1).cos()


def test_a_global_tensor_is_in_the_key_by_content_and_one_the_kernels_read_stays_off_the_disk(monkeypatch):
    """A tensor the kernels read (a trace's constant) would be a copy in a fresh process,
    which neither sees the user's later writes nor takes the function's: not stored. One
    read for its shape alone is in the key by content."""
    x = _x(ROWS, COLS)
    assert not _loaded(table_shaped, x)
    assert _loaded(table_shaped, x)
    monkeypatch.setitem(globals(), "TABLE", torch.arange(2 * COLS, dtype=torch.float32))
    assert not _loaded(table_shaped, x)
    compiled = check_against_eager(add_table, _x(ROWS, 2 * COLS))
    assert "the kernels read TABLE, a tensor of the function's globals" in compiled.not_on_disk
    assert not _loaded(add_table, _x(ROWS, 2 * COLS))


class Config:
    scale = 3.0


CONFIG = Config()


@dataclasses.dataclass(frozen=True)
class FrozenConfig:  # (held by value in the in-memory key, so compiled there, but not written out)
    scale: float = 3.0


def scaled_by_config(x):
    return x * CONFIG.scale


def test_what_the_key_cannot_hold_by_content_stays_off_the_disk(disk):
    """An object of a user's class as an argument (its attributes could change between
    processes unseen), a partial, or state a fresh process may not share (the environment)
    keeps the entry off the disk, and says why. (A function that reads a mutable object's
    attributes runs through Dynamo, which guards them: not stored either.)"""
    compiled = check_against_eager(lambda x, c: x * (c if type(c) is int else c.scale), _x(ROWS, COLS),
                                   FrozenConfig())
    assert "argument c holds a FrozenConfig" in compiled.not_on_disk
    assert "disk cache: not stored: argument c holds a FrozenConfig" in str(tjit.explain(compiled, _x(ROWS, COLS),
                                                                                          FrozenConfig()))
    compiled = check_against_eager(functools.partial(add_table, x=_x(ROWS, COLS)))
    assert "a partial is compiled, not a function" in compiled.not_on_disk
    compiled = check_against_eager(lambda x: x * len(sys.argv), _x(ROWS, COLS))
    assert "it reads module sys, whose state a fresh process may not share" in compiled.not_on_disk
    assert not list(disk.glob("*.entry"))
    # (the environment may change between calls too: such a function runs through Dynamo, which
    # reads it at every call)
    compiled = check_against_eager(lambda x: x * float(os.environ.get("TJIT_TEST_SCALE", "2")), _x(ROWS, COLS))
    assert "reads what changes between calls (os.environ" in compiled._split.reason
    compiled = check_against_eager(scaled_by_config, _x(ROWS, COLS))  # (Dynamo's graph is stored, and guarded)
    assert "reads an object's state (CONFIG in scaled_by_config" in compiled._split.reason


def test_why_an_entry_is_off_the_disk_is_about_the_last_compile():
    """A call whose key can be written out, after one whose key cannot: the reason is gone
    (it stayed, and explain said "not stored" of an entry that was)."""
    compiled = check_against_eager(lambda x, c: x * (c if type(c) is int else c.scale), _x(ROWS, COLS),
                                   FrozenConfig())
    assert "argument c holds a FrozenConfig" in compiled.not_on_disk
    check_against_eager(compiled.fn, _x(ROWS, COLS), 3, compiled=compiled)
    assert compiled.not_on_disk is None and "disk cache: stored in" in str(tjit.explain(compiled, _x(ROWS, COLS), 3))


def test_the_off_switch(monkeypatch, disk):
    monkeypatch.setenv("TJIT_DISK_CACHE", "0")
    check_against_eager(scaled_softmax, _x(ROWS, COLS), _x(ROWS, COLS, seed=1), 0.25)
    assert not disk.exists() or not list(disk.glob("*.entry"))


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "another_key", "garbage"])
def test_a_damaged_or_mismatched_file_is_rebuilt_not_loaded(damage, disk):
    args = (_x(ROWS, COLS), _x(ROWS, COLS, seed=1), 0.25)
    assert not _loaded(scaled_softmax, *args)
    [path] = disk.glob("*.entry")
    data = path.read_bytes()
    if damage == "flipped_byte":
        data = data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]
    elif damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "another_key":  # (another call's entry, under this call's file name)
        assert not _loaded(table_shaped, _x(ROWS, COLS))
        [other] = [p for p in disk.glob("*.entry") if p != path]
        data = other.read_bytes()
    else:
        data = b"\x80\x04not a pickle at all"
    path.write_bytes(data)
    assert not _loaded(scaled_softmax, *args)  # (traced again, and stored again)
    assert _loaded(scaled_softmax, *args)


class Node:
    pass


def test_ids_of_the_entrys_objects_name_their_copies():
    nodes = [Node(), Node()]
    entry = {"nodes": nodes, "by_id": {id(n): k for k, n in enumerate(nodes)}, "keys": [("buffer", id(nodes[1]))]}
    loaded = disk_cache.loads(disk_cache.dumps(entry))
    copies = loaded["nodes"]
    assert loaded["by_id"] == {id(copies[0]): 0, id(copies[1]): 1}
    assert loaded["keys"] == [("buffer", id(copies[1]))]


def test_an_int_that_may_be_an_id_of_an_object_outside_the_entry_keeps_it_off_the_disk():
    with pytest.raises(disk_cache.NotCacheable, match="ids of objects outside it"):
        disk_cache.dumps({"key": ("buffer", id(Node()) + 16)})


SCRIPT = textwrap.dedent("""
    import torch, tjit
    def f(x, lr: float):
        return torch.softmax(x, -1).cumsum(0) * lr
    x = torch.randn(300, 130, generator=torch.Generator().manual_seed(0))
    out = tjit.compile(f)(x, 0.5)
    torch.testing.assert_close(out, f(x, 0.5))
    print(tjit.counters.traces, tjit.counters.disk_loads)
""")


def test_a_fresh_process_traces_nothing_an_earlier_one_compiled(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TJIT_DISK_CACHE": "1", "TJIT_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    assert [r.stdout.split() for r in runs] == [["1", "0"], ["0", "1"]]

"""Caching, counters, torch.compile integration, insight and errors."""
import ast
import collections
import contextlib
import itertools
import os
import random
import subprocess
import sys

import numpy
import pytest
import torch

import tjit
from helpers import assert_as_accurate_as_eager, check_against_eager, launches


def fresh_function():
    def f(x, y, scale: float):
        z = torch.sigmoid(x) * y + scale
        return torch.where(z > 0, z, 0.1 * z), (z * 2).exp().clamp(max=10.0)
    return tjit.compile(f)


def delta(before):
    now = tjit.counters.snapshot()
    return {k: now[k] - before[k] for k in now}


def test_same_shapes_hit_the_cache_and_new_sizes_reuse_kernels():
    f = fresh_function()
    x, y = torch.randn(32, 48), torch.randn(32, 48)
    before = tjit.counters.snapshot()
    f(x, y, 0.5)
    first = delta(before)
    assert first["traces"] == 1 and first["kernel_compiles"] >= 1

    before = tjit.counters.snapshot()
    f(torch.randn(32, 48), torch.randn(32, 48), 0.5)
    again = delta(before)
    assert again["traces"] == 0 and again["kernel_compiles"] == 0 and again["cache_hits"] == 1

    before = tjit.counters.snapshot()
    out = f(torch.randn(48, 64), torch.randn(48, 64), 0.5)
    resized = delta(before)
    assert resized["traces"] == 1  # a new size of the class traces it with symbolic sizes (cheap) ...
    assert resized["kernels_generated"] == 0 and resized["kernel_compiles"] == 0  # ... but builds no kernel
    assert out[0].shape == (48, 64)

    # Triton's JIT builds one binary per 16-divisibility of each size argument: a size
    # that changes it costs one more binary of the same source, and only the first time.
    before = tjit.counters.snapshot()
    f(torch.randn(43, 57), torch.randn(43, 57), 0.5)
    f(torch.randn(45, 59), torch.randn(45, 59), 0.5)
    odd = delta(before)
    assert odd["kernels_generated"] == 0 and odd["kernel_compiles"] == 1


def test_layout_dtype_and_scalar_type_changes_retrace_and_stay_correct():
    f = fresh_function()
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    for args in [(x, y, 0.5), (x.t().contiguous().t(), y, 0.5), (x.half(), y.half(), 0.5), (x, y, 2),
                 (x.double(), y, -1.5)]:
        before = tjit.counters.traces
        if args[0].dtype == torch.half:  # (eager rounds to half after each op, tjit once: CUDA's z near 0 differs)
            exact = f.__wrapped__(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
            for got, eager, wide in zip(f(*args), f.__wrapped__(*args), exact):
                assert_as_accurate_as_eager(got, eager, wide, rtol=1e-3, atol=1e-5)
        else:
            check_against_eager(f.__wrapped__, *args, compiled=f)
        assert tjit.counters.traces == before + 1


@pytest.mark.usefixtures("fresh_seed")
def test_autocast_and_the_default_dtype_are_part_of_the_cache_key():
    """The trace computes in the dtypes autocast and the default dtype choose: a call in
    another autocast region, or after torch.set_default_dtype, is another entry, as eager's
    results change with them (a reused entry would return float32 under autocast)."""
    def f(a, b):
        return a @ b + torch.ones(b.shape[-1])  # (in the default dtype)
    compiled = tjit.compile(f)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    regions = [contextlib.nullcontext, lambda: torch.autocast("cpu", dtype=torch.bfloat16),
               lambda: torch.autocast("cpu", dtype=torch.float16), contextlib.nullcontext]
    for region in regions:
        with region():
            got, want = compiled(a, b), f(a, b)
        assert got.dtype == want.dtype, (region, got.dtype, want.dtype)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # (16-bit products, summed in another order)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert compiled(a, b).dtype == f(a, b).dtype == torch.float64
        torch.testing.assert_close(compiled(a, b), f(a, b), rtol=1e-5, atol=1e-5)  # (a float32 product)
    finally:
        torch.set_default_dtype(previous)
    assert compiled(a, b).dtype == torch.float32


class ScaledBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)
        self.dropout, self.scale = torch.nn.Dropout(0.5), 1.5

    def forward(self, x):
        return self.dropout(self.norm(self.linear(x))) * self.scale


@pytest.mark.usefixtures("fresh_seed")
def test_a_compiled_module_follows_its_state_as_eager_does():
    """tjit.compile(module): the forward reads state its arguments do not show (training
    mode, parameters, plain attributes). Dynamo guards that state and hands tjit its graphs,
    so model.eval() after training, a parameter replaced and an attribute changed all give
    eager's results (a trace would have kept dropout, batch statistics and the old values),
    and the graphs run as tjit's kernels."""
    model = ScaledBlock()
    compiled = tjit.compile(model)
    x = torch.randn(12, 16)
    model.train()
    torch.manual_seed(1)
    got = compiled(x)
    torch.manual_seed(1)
    want = model(x)
    assert got.shape == want.shape and torch.isfinite(got).all()  # (dropout: drawn apart from eager's)
    launches = tjit.counters.launches
    changes = [lambda: model.eval(), lambda: setattr(model, "scale", 4.0),
               lambda: setattr(model.linear, "weight", torch.nn.Parameter(torch.randn(16, 16))),
               lambda: model.norm.running_mean.add_(1.0)]
    for change in changes:
        change()
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert tjit.counters.launches > launches
    assert "nn.Module" in tjit.explain(model, x).reason


SHIFT = 0.5


def shifted(x):
    return torch.tanh(x) + SHIFT


@pytest.mark.usefixtures("fresh_seed")
def test_globals_and_closed_over_variables_rebound_are_traced_anew():
    """A trace bakes in what the function's globals and closed-over variables held (a
    number, a tensor read as a constant): a name bound to another object since is a miss
    and a new trace, as eager reads the new object; the same objects are a hit."""
    global SHIFT
    compiled, x = tjit.compile(shifted), torch.randn(300)
    previous = SHIFT
    try:
        for value in (0.5, 2.0, -1.0):
            SHIFT = value
            torch.testing.assert_close(compiled(x), shifted(x))
    finally:
        SHIFT = previous
    table = torch.randn(300)

    def closes_over(x):
        return x * table
    compiled = tjit.compile(closes_over)
    torch.testing.assert_close(compiled(x), closes_over(x))
    table.mul_(2)  # (the same tensor, written in place: read as it is now, no new trace)
    before = tjit.counters.traces
    torch.testing.assert_close(compiled(x), closes_over(x))
    assert tjit.counters.traces == before
    table = torch.randn(300)  # (another tensor)
    torch.testing.assert_close(compiled(x), closes_over(x))
    assert tjit.counters.traces == before + 1


def test_the_states_kept_per_function_are_bounded(monkeypatch):
    """Each state of the globals keeps its objects alive (so no other object takes their
    ids while an entry is cached under them); past MAX_OUTSIDE_STATES the oldest states'
    entries go, and with them the objects."""
    import tjit.runtime.guards as guards
    monkeypatch.setattr(guards, "MAX_OUTSIDE_STATES", 2)
    global SHIFT
    compiled, x = tjit.compile(shifted), torch.randn(5)
    previous = SHIFT
    try:
        for value in (1.0, 2.0, 3.0, 4.0):
            SHIFT = value
            torch.testing.assert_close(compiled(x), shifted(x))
    finally:
        SHIFT = previous
    assert len(compiled._cache) == len(compiled._outside._kept) == 2


def test_keyword_arguments_and_decorator_forms():
    @tjit.compile
    def plain(x, *, alpha=2.0):
        return x * alpha

    @tjit.compile(axis_strategies={"*": (tjit.ThreadGroup(), tjit.Thread())})
    def configured(x, bias):
        return x + bias

    x = torch.randn(3, 5)
    torch.testing.assert_close(plain(x, alpha=3.0), x * 3.0)
    torch.testing.assert_close(plain(x), x * 2.0)
    b = torch.randn(5)
    torch.testing.assert_close(configured(x, b), x + b)


def test_torch_compile_backend():
    def f(x, y):
        z = torch.sigmoid(x) * y.t() + 0.5
        return torch.where(z > 0, z, 0.1 * z), z.exp().clamp(max=10.0)
    x, y = torch.randn(16, 24), torch.randn(24, 16)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="tjit")
    before = tjit.counters.launches
    out = compiled(x, y)
    expected = f(x, y)
    for o, e in zip(out, expected):
        torch.testing.assert_close(o, e)
    assert tjit.counters.launches - before == 1


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_torch_compile_modes_and_inductors_options_compile_with_tjit(mode):
    """torch.compile passes `mode` and `options` to the backend as keywords (tjit's backend took
    neither: a TypeError for every mode but "default"). Every mode compiles as the default does;
    options, which are Inductor's configuration, are ignored with a warning that names them."""
    def f(x):
        return torch.softmax(x * 2, -1).cumsum(0)
    x = torch.randn(70, 33)
    torch._dynamo.reset()
    before = tjit.counters.launches
    torch.testing.assert_close(torch.compile(f, backend="tjit", mode=mode)(x), f(x))
    assert tjit.counters.launches > before
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"ignores options \['triton.cudagraphs'\]"):
        got = torch.compile(f, backend="tjit", options={"triton.cudagraphs": True})(x)
    torch.testing.assert_close(got, f(x))


def test_torch_compile_refuses_a_mode_it_does_not_know_by_name():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unrecognized mode='fastest'"):
        torch.compile(lambda x: x + 1, backend="tjit", mode="fastest")(torch.randn(3))


def test_a_call_through_dynamo_looks_its_compiled_entry_up_once(monkeypatch):
    """A steady call of a Dynamo graph binds its arguments (without inspect: a graph's forward
    takes *args) and computes its guard key once. (Twice before: a 1-kernel function's host
    overhead through torch.compile went from 74-97 us to 36-39 us, bench/compile.py.)"""
    import tjit.runtime.compiled as compiled_module
    keys = []
    real = compiled_module.guard_key
    monkeypatch.setattr(compiled_module, "guard_key", lambda *a, **k: keys.append(1) or real(*a, **k))
    monkeypatch.setattr(compiled_module, "flatten_arguments", None)  # (inspect's binding is not needed)

    def f(x, y):
        return torch.softmax(x * y, -1)
    x, y = torch.randn(16, 24), torch.randn(24)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="tjit")
    compiled(x, y)
    keys.clear()
    torch.testing.assert_close(compiled(x, y), f(x, y))
    assert len(keys) == 1


def test_torch_compile_backend_differentiates_with_tjit():
    def loss_fn(x, w, b, target):
        h = torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b)
        return torch.nn.functional.cross_entropy(torch.nn.functional.gelu(h), target)
    args = [torch.randn(6, 12), torch.randn(12), torch.randn(12)]
    target = torch.randint(0, 12, (6,))
    ours, theirs = ([a.clone().requires_grad_() for a in args] for _ in range(2))
    torch._dynamo.reset()
    before = tjit.counters.launches
    torch.compile(loss_fn, backend="tjit")(*ours, target).backward()
    assert tjit.counters.launches - before == 3  # one forward kernel, two backward kernels
    loss_fn(*theirs, target).backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_explain_reports_graph_kernels_and_bytes():
    def f(x, y):
        return torch.relu(x + y) * 2
    x, y = torch.randn(30, 20), torch.randn(20)
    e = tjit.explain(f, x, y)
    assert len(e.kernels) == 1 and e.eager_ops == 3
    k = e.kernels[0]
    assert "@triton.jit" in k.source and "tl.store" in k.source
    assert k.bytes_read == (600 + 20) * 4 and k.bytes_written == 600 * 4
    text = str(e)
    assert "input x" in text and "1 kernel(s) (eager: 3 op(s))" in text


def test_debug_levels_print_ir_sources_and_launches():
    script = (
        "import torch, tjit\n"
        "f = tjit.compile(lambda x: (x * 2).exp())\n"
        "f(torch.randn(10, device='cuda' if torch.cuda.is_available() else 'cpu'))\n"
    )
    out = {}
    for level in (1, 2, 3, 4):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={**__import__("os").environ, "TJIT_DEBUG": str(level)})
        assert proc.returncode == 0, proc.stderr
        out[level] = proc.stderr
    assert "compiled" in out[1] and "IR:" not in out[1]
    assert "IR:" in out[2] and "exp(" in out[2] and "@triton.jit" not in out[2]
    assert "@triton.jit" in out[3] and "launch " not in out[3]
    assert "launch tjit_pointwise_" in out[4] and "grid=" in out[4]


def test_unsupported_ops_raise_naming_the_op_and_leave_inputs_untouched():
    def f(x):
        x.mul_(2)
        return x.unsqueeze_(0) * 2  # an input's shape changed in place: the caller's, refused
    x = torch.randn(5, 2)
    original = x.clone()
    with pytest.raises(tjit.UnsupportedOpError, match="changes the shape of argument x in place") as info:
        tjit.compile(f)(x)
    assert "test_runtime.py" in str(info.value)  # where it was called
    assert torch.equal(x, original)


def test_methods_can_be_compiled():
    class Scale:
        def __init__(self, k):
            self.k = k

        @tjit.compile
        def apply(self, x):
            return x * self.k

    x = torch.randn(4)
    torch.testing.assert_close(Scale(3.0).apply(x), x * 3.0)


@tjit.compile
def _compiled_gate(z):
    return torch.sigmoid(z) * z


def _calls_a_compiled_function(x, y):
    return _compiled_gate(x * y).sum(-1)


def test_a_compiled_function_called_inside_another_ones_trace_is_traced_into_it():
    """The helper gets the trace's fake tensors: it runs as itself, so its ops join the
    caller's kernel (the old code launched its kernels on the fake tensors' memory: a crash)."""
    x, y = torch.randn(300, 130), torch.randn(300, 130)
    compiled = check_against_eager(_calls_a_compiled_function, x, y)
    assert launches(compiled, x, y) == 1


def _branches_with_cond(x):
    return torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, (x,))


def test_a_higher_order_op_runs_as_it_is_and_the_rest_compiles():
    """torch.cond compiles its own call (fullgraph); run inside tjit's trace that compile failed
    and Dynamo kept the failure: the user's later eager torch.cond calls failed too, until
    torch._dynamo.reset(). The trace runs such compiles as plain calls, so the op is recorded
    and named. A higher-order op tjit's trace has no rule for (cond, while_loop,
    flex_attention) refused the whole graph, which ran eagerly with a warning; the graph is
    now cut around it: the op runs as it is, tjit compiles the rest (tjit.compile, too,
    through Dynamo), gradients included."""
    import warnings
    x = torch.randn(300, 70)
    expected = _branches_with_cond(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no graph runs eagerly)
        torch.testing.assert_close(tjit.compile(_branches_with_cond)(x), expected)
        torch.testing.assert_close(torch.compile(_branches_with_cond, backend="tjit")(x), expected)
    torch.testing.assert_close(_branches_with_cond(x), expected)  # (eager, after both)

    def around_cond(x, w):
        h = torch.tanh(x * w + 1)
        y = torch.cond(h.sum() > 0, lambda h: h.sin(), lambda h: h.cos() * 2, (h,))
        return (y * w).softmax(-1).square().sum()
    for sign in (1, -1):  # (both branches)
        x, w = (torch.randn(300, 70) * sign).requires_grad_(), torch.randn(70, requires_grad=True)
        torch._dynamo.reset()
        before = tjit.counters.launches
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            got = torch.compile(around_cond, backend="tjit")(x, w)
            got_grads = torch.autograd.grad(got, (x, w))
        assert tjit.counters.launches > before
        want = around_cond(x, w)
        torch.testing.assert_close(got, want)
        for g, e in zip(got_grads, torch.autograd.grad(want, (x, w))):
            torch.testing.assert_close(g, e)


def test_indexing_switches_to_int64_past_two_to_the_31():
    from tjit.lower.gpu_compile import compile_for_gpu
    from tjit.runtime.loader import load_kernel
    big = torch.randn(1, 3).expand(2**30, 3)  # 3.2e9 elements: offsets overflow int32, memory does not grow
    small = torch.randn(1, 3).expand(2**10, 3)
    f = tjit.compile(lambda x: x * 2)
    wide, narrow = f.entry_for(big).executable.program.kernels[0], f.entry_for(small).executable.program.kernels[0]
    assert ".to(tl.int64)" in wide.source and "int64" not in narrow.source
    signature = {name: "*fp32" if name.endswith("_ptr") else "i64" for name in wide.param_names}
    report = compile_for_gpu(load_kernel(wide), signature, wide.constexprs, num_warps=wide.num_warps)
    assert report.spills == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA, kernels compile: no interpreter to choose")
def test_the_backend_works_by_its_name_in_a_process_that_imported_only_torch():
    """Dynamo imports triton before it loads the backend by its entry point, without the
    interpreter chosen: tjit imports triton again in interpreter mode."""
    script = "\n".join([
        "import torch",
        "f = torch.compile(lambda x: (x * 2).sin().softmax(-1) + 1, backend='tjit')",
        "x = torch.randn(100, 300)",
        "torch.testing.assert_close(f(x), (x * 2).sin().softmax(-1) + 1)",
        "import tjit",
        "assert tjit.counters.launches == 1, tjit.counters.launches",
        "print('ok')",
    ])
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA, kernels compile: no interpreter")
def test_a_launch_patches_the_language_once_for_all_its_helper_calls():
    """Triton's interpreter patches the language for a launch and for each call of a helper
    (tl.max, tl.sum: functions of triton.language.standard, which name triton.language.core),
    restoring it after each: a softmax's launch patched it 13 times. tjit's launch patches
    both language modules, so the helpers find them patched and patch nothing; after the
    launch both are as they were (a later compile for a GPU needs them unpatched)."""
    from triton.runtime import interpreter as ti
    softmax = tjit.compile(lambda x: torch.softmax(x, -1))
    x = torch.randn(64, 100)
    softmax(x)
    patches, patch = [], ti._patch_lang

    def counted(fn):
        patches.append(fn)
        return patch(fn)
    ti._patch_lang = counted
    try:
        torch.testing.assert_close(softmax(x), torch.softmax(x, -1))
    finally:
        ti._patch_lang = patch
    assert tjit.counters.snapshot()["launches"] and len(patches) == 1, len(patches)
    assert ti.tl.static_assert.__name__ != "_new_static_assert"
    assert ti.tl.core.static_assert.__name__ != "_new_static_assert"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU beside the CPU")
def test_zero_dim_cpu_tensors_beside_gpu_tensors_run_as_in_eager():
    """An optimizer's step count lives on the CPU as a 0-d tensor beside GPU parameters, and
    Dynamo passes a changing learning rate so: eager computes with them on the GPU. tjit runs
    on GPU copies, writes an in-place update back to the CPU tensor, and returns on the CPU
    what eager computes there from those alone."""
    def step(p, g, count, lr):
        count.add_(1)
        p.sub_(g * lr / count)
        return count * 2, p.sum(), count.view(1)

    p, g = torch.randn(300, 70, device="cuda"), torch.randn(300, 70, device="cuda")
    compiled = tjit.compile(step)
    with torch.no_grad():
        for k in range(3):
            count, lr = torch.tensor(float(k), device="cpu"), torch.tensor(0.1 * (k + 1), device="cpu")
            expected_p, expected_count = p.clone(), count.clone()
            expected = step(expected_p, g, expected_count, lr)
            got = compiled(p, g, count, lr)
            torch.testing.assert_close(p, expected_p)
            assert count.item() == expected_count.item() == k + 1
            for t, e in zip(got, expected):
                assert t.device == e.device, (t.device, e.device)
                torch.testing.assert_close(t, e)
            assert got[2].untyped_storage().data_ptr() == count.untyped_storage().data_ptr()
    with pytest.raises(tjit.errors.CompileArgumentError, match="several devices"):
        compiled(p, g, torch.ones(2, device="cpu"), lr)


def test_a_kernel_is_launched_again_through_the_binary_triton_compiled(monkeypatch):
    """relaunch.Binaries: after the first launch of a (device, pointer alignment), the binary
    JITFunction.run returned is launched straight through its launcher, with the arguments
    JITFunction.run passes it (grid, stream, function, metadata, no hooks, the runtime
    arguments, then the constexprs in the kernel's order); none while launch hooks are set,
    none for a kernel whose parameters are not tjit's arguments then its constexprs."""
    from tjit.runtime import relaunch
    calls = []

    class Kernel:  # (what Triton's CompiledKernel offers a launcher)
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            calls.append(args)

    class Fn:
        arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: f"stream{device}", raising=False)
    monkeypatch.setattr(relaunch, "knobs", type("knobs", (), {"runtime": type("runtime", (), {
        "launch_enter_hook": None, "launch_exit_hook": None})}))
    binaries = relaunch.Binaries(Fn(), ["x_ptr", "n"], {"FLAG": True, "BLOCK": 64}, (5,))
    assert binaries.usable() and not binaries.launch((0, (True,)), ["x", 10])
    binaries.keep((0, (True,)), Kernel())
    assert binaries.launch((0, (True,)), ["x", 10]) and not binaries.launch((0, (False,)), ["y", 10])
    assert calls == [(5, 1, 1, "stream0", "function", "metadata", None, None, None, "x", 10, 64, True)]
    relaunch.knobs.runtime.launch_enter_hook = print
    assert not binaries.launch((0, (True,)), ["x", 10])
    assert not relaunch.Binaries(Fn(), ["x_ptr", "m"], {"FLAG": True, "BLOCK": 64}, (5,)).usable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_calls_launched_again_through_the_binary_match_eager():
    """Each call after the first of a pointer alignment launches the kept binary: pointwise,
    reduction, scan and product kernels, with aligned and unaligned inputs, match eager."""
    def f(x, w):
        return torch.softmax(x @ w, -1).cumsum(-1) * x.sum(-1, keepdim=True)

    compiled = tjit.compile(f)
    x, w = torch.randn(301, 130, device="cuda"), torch.randn(130, 130, device="cuda")
    for call in range(3):
        for a in (x[1:], x[:-1]):  # (an input 4 bytes past an aligned address, and one at it)
            torch.testing.assert_close(compiled(a, w), f(a, w), rtol=1e-4, atol=1e-4)
    launches = [s for s in compiled.entry_for(x[1:], w).executable.launches if hasattr(s, "binaries")]
    assert launches and all(s.binaries is not None and s.binaries.found for s in launches)


def test_arguments_named_like_the_kernels_status_and_counter_words():
    """A call's memory holds its arguments by name beside tjit's own words: an argument named
    "status" or "counter" read those words instead of itself (a wrong answer, fixed)."""
    def f(status, counter, index):
        return status.sum(-1) + counter[:, 0] + status[index, 1]

    status, counter, index = torch.randn(300, 700), torch.randn(300, 700), torch.randint(0, 300, (300,))
    check_against_eager(f, status, counter, index)


def _doubled_if_a_plain_tensor(x, ws):
    return x * 2 if type(x) is torch.Tensor else x * 3


def _doubled_if_its_class_is_named_tensor(x, ws):
    return x * 2 if x.__class__.__name__ == "Tensor" else x * 3


def _doubled_unless_traced(x, ws):
    return x * 2 if not torch.fx._symbolic_trace.is_fx_tracing() else x * 3


def _doubled_unless_it_overrides_torch(x, ws):
    return x * 2 if not torch.overrides.has_torch_function((x,)) else x * 3


def _kind(t):
    return type(t).__name__


def _doubled_if_a_helper_calls_it_a_tensor(x, ws):
    return x * 2 if _kind(x) == "Tensor" else x * 3


def _doubled_if_the_list_holds_plain_tensors(x, ws):
    return x * 2 if all(type(w) is torch.Tensor for w in ws) else x * 3


@pytest.mark.parametrize("fn", [_doubled_if_a_plain_tensor, _doubled_if_its_class_is_named_tensor,
                                _doubled_unless_traced, _doubled_unless_it_overrides_torch,
                                _doubled_if_a_helper_calls_it_a_tensor, _doubled_if_the_list_holds_plain_tensors],
                         ids=lambda f: f.__name__)
def test_a_function_that_asks_what_a_tensor_is_gets_eager_answer(fn):
    """The trace calls the function with stand-in tensors (FakeTensor): `type(x) is
    torch.Tensor` was False there, and the function returned x * 3 where eager returns x * 2,
    silently. A function whose code (or a helper's) asks that runs through Dynamo, which runs
    its Python as eager does."""
    x, ws = torch.randn(300, 70), [torch.randn(3), torch.randn(4)]
    got = tjit.compile(fn)(x, ws)
    torch.testing.assert_close(got, fn(x, ws), rtol=0, atol=0)


def test_a_type_asked_of_an_argument_that_is_no_tensor_keeps_one_trace():
    """`type(c)` of a number or a config object asks nothing a trace changes: one trace, no
    Dynamo."""
    def scaled(x, c):
        return x * (c if type(c) is int else 0.5)

    compiled = tjit.compile(scaled)
    x = torch.randn(300, 70)
    for c in (3, "a"):
        torch.testing.assert_close(compiled(x, c), scaled(x, c), rtol=0, atol=0)
    assert not any(isinstance(entry.executable, tjit.runtime.split.SplitFunction)
                   for entry in compiled._cache.values())


class _Settings:
    def __init__(self):
        self.scale, self.activation = 1.5, "relu"


SETTINGS = _Settings()
NAMESPACE = __import__("types").SimpleNamespace(k=2)
SETTINGS_MODULE = __import__("types").ModuleType("user_settings")  # (a user's module of settings)
SETTINGS_MODULE.SCALE = 2.0


def _scaled_by_a_global_object(x):
    return x * SETTINGS.scale


def _activation_a_global_object_names(x):
    return torch.relu(x) if SETTINGS.activation == "relu" else torch.tanh(x)


def _scaled_by_a_namespace(x):
    return x * NAMESPACE.k


def _scaled_by_a_module_attribute(x):
    return x * SETTINGS_MODULE.SCALE


def _reads_settings(x):
    return x * SETTINGS.scale


def _scaled_by_a_helper_that_reads_a_global(x):
    return _reads_settings(x) + 1


def _change_settings():
    SETTINGS.scale, SETTINGS.activation, NAMESPACE.k, SETTINGS_MODULE.SCALE = 3.0, "tanh", 5, -1.0


@pytest.mark.parametrize("fn", [_scaled_by_a_global_object, _activation_a_global_object_names, _scaled_by_a_namespace,
                                _scaled_by_a_module_attribute, _scaled_by_a_helper_that_reads_a_global],
                         ids=lambda f: f.__name__)
def test_a_function_that_reads_an_objects_attributes_sees_them_change(fn):
    """The trace baked in what `SETTINGS.scale` held, and the key held the object by identity:
    after `SETTINGS.scale = 3.0` the function returned the old answer, silently (as
    jax.jit would; torch.compile guards the attribute). Such a function now runs through
    Dynamo, which guards what it reads."""
    x = torch.randn(300, 70)
    compiled = tjit.compile(fn)
    saved = (SETTINGS.scale, SETTINGS.activation, NAMESPACE.k, SETTINGS_MODULE.SCALE)
    try:
        torch.testing.assert_close(compiled(x), fn(x))
        _change_settings()
        torch.testing.assert_close(compiled(x), fn(x))
    finally:
        SETTINGS.scale, SETTINGS.activation, NAMESPACE.k, SETTINGS_MODULE.SCALE = saved


def test_a_compiled_method_sees_its_objects_attributes_change():
    class Scaler:
        def __init__(self):
            self.s = 1.0

        @tjit.compile
        def run(self, x):
            return x * self.s

        def closure(self):
            return tjit.compile(lambda x: x * self.s)

    x, scaler = torch.randn(300, 70), Scaler()
    closed = scaler.closure()
    for s in (1.0, 3.0):
        scaler.s = s
        torch.testing.assert_close(scaler.run(x), x * s, rtol=0, atol=0)
        torch.testing.assert_close(closed(x), x * s, rtol=0, atol=0)


WEIGHTS = [torch.randn(70), torch.randn(70)]
TABLE = {"w": torch.randn(70), "scale": 2.0}


def _scaled_by_a_global_list(x):
    for w in WEIGHTS:
        x = x * w
    return x


def _scaled_by_a_global_dict(x):
    return x * TABLE["w"] * TABLE["scale"]


def _scaled_by_container_kinds(x):
    return x * ORDERED["scale"] * COUNTS["k"] * QUEUE[0] * NESTED[0]["s"]


def _scaled_by_buffers(x):
    return x * float(ARRAY[0]) * BYTES[0]


ORDERED, COUNTS = collections.OrderedDict(scale=2.0), collections.Counter(k=3)
QUEUE, ARRAY, BYTES = collections.deque([1.5]), numpy.array([0.5]), bytearray([2])
NESTED = [collections.OrderedDict(s=1.25)]


def _change_the_containers():
    WEIGHTS[0] = torch.randn(70)
    TABLE["scale"] = 5.0
    ORDERED["scale"], COUNTS["k"], QUEUE[0], ARRAY[0], BYTES[0], NESTED[0]["s"] = 3.0, 4, 2.5, 1.5, 3, 0.75
    yield
    WEIGHTS.append(torch.randn(70))
    TABLE["w"] = torch.randn(70)
    yield


@pytest.mark.parametrize("fn", [_scaled_by_a_global_list, _scaled_by_a_global_dict, _scaled_by_container_kinds,
                                _scaled_by_buffers], ids=lambda f: f.__name__)
def test_a_global_list_or_dict_changed_in_place_is_a_new_key(fn):
    """A list or dict the function reads was held by identity: after `WEIGHTS[0] = ...` the
    function returned the old answer, silently. Its elements are in the key now (tensors by
    identity, numbers by value), for their subclasses (OrderedDict, Counter) and deques too;
    a function that reads a buffer's elements (a numpy array, a bytearray) runs through
    Dynamo."""
    x = torch.randn(300, 70)
    compiled = tjit.compile(fn)
    saved = (list(WEIGHTS), dict(TABLE), dict(ORDERED), dict(COUNTS), list(QUEUE), ARRAY.copy(), bytearray(BYTES),
             dict(NESTED[0]))
    try:
        torch.testing.assert_close(compiled(x), fn(x))
        for _ in _change_the_containers():
            torch.testing.assert_close(compiled(x), fn(x))
        through_dynamo = [isinstance(entry.executable, tjit.runtime.split.SplitFunction)
                          for entry in compiled._cache.values()]
        assert all(through_dynamo) if fn is _scaled_by_buffers else not any(through_dynamo)
    finally:
        WEIGHTS[:] = saved[0]
        for container, contents in zip((TABLE, ORDERED, COUNTS, NESTED[0]), (saved[1], saved[2], saved[3], saved[7])):
            container.clear()
            container.update(contents)
        QUEUE[0], ARRAY[:], BYTES[:] = saved[4][0], saved[5], saved[6]


def _scaled_by_pythons_random(x):
    return x * random.random() + random.gauss(0, 1)


def _scaled_by_numpys_random(x):
    return x * float(numpy.random.rand())


def _scaled_by_the_environment(x):
    return x * float(os.environ.get("TJIT_TEST_SCALE", "1"))


@pytest.mark.parametrize("fn", [_scaled_by_pythons_random, _scaled_by_numpys_random, _scaled_by_the_environment],
                         ids=lambda f: f.__name__)
def test_a_function_that_reads_random_numbers_or_the_environment_reads_them_at_every_call(fn, monkeypatch):
    """`x * random.random()` multiplied by the number its trace drew, at every call (and
    `os.environ` as the trace read it). Such a function now runs through Dynamo, which draws
    from Python's and numpy's generators at every call, as eager does: seeded alike, both give
    the same numbers."""
    x, compiled = torch.randn(300, 70), tjit.compile(fn)
    for seed in (1, 2, 3):
        monkeypatch.setenv("TJIT_TEST_SCALE", str(seed))
        results = []
        for run in (fn, compiled):
            random.seed(seed), numpy.random.seed(seed)
            results.append(run(x))
        torch.testing.assert_close(results[1], results[0])


ROWS = random.Random(7)


def _slices_at_a_random_row(x, choices):
    return x[choices.randrange(200):] * choices.random()


def _slices_at_a_global_streams_row(x, choices):
    return x[ROWS.randrange(200):] * 2


def _slices_at_a_row_from_a_stream_it_seeds(x, choices):
    r = random.Random(choices.random())  # (Dynamo fails on this line: an internal error)
    return x[r.randrange(200):] * 2


@pytest.mark.parametrize("fn", [_slices_at_a_random_row, _slices_at_a_global_streams_row,
                                _slices_at_a_row_from_a_stream_it_seeds], ids=lambda f: f.__name__)
def test_a_function_that_draws_from_a_random_object_runs_eagerly(fn):
    """`rng.random()` of a random.Random object: a trace drew once, and so does Dynamo (it
    bakes the draw into its graph and guards the object), so every call sliced the same rows;
    Dynamo fails outright on `random.Random(rng.random())`. Such a function runs eagerly,
    with a warning: seeded alike, eager and the compiled function slice alike at every call."""
    x, compiled = torch.randn(300, 70), tjit.compile(fn)
    theirs, ours = random.Random(5), random.Random(5)
    for _ in range(3):
        ROWS.seed(11)
        expected = fn(x, theirs)
        ROWS.seed(11)
        with pytest.warns(UserWarning, match="runs .* eagerly: its code draws from a random.Random object") \
                if not compiled._cache else contextlib.nullcontext():
            got = compiled(x, ours)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert str(tjit.explain(compiled, x, ours)).startswith("runs eagerly, neither traced nor run by Dynamo: its code "
                                                             "draws from a random.Random object")


CALLS, CACHE, COUNT = [], {}, 0


def _appends_to_a_global_list(x, state):
    CALLS.append(x.shape[0])
    return x * 2


def _stores_a_tensor_in_a_global_dict(x, state):
    CACHE["y"] = x.exp()
    return x * 2


def _counts_in_a_global(x, state):
    global COUNT
    COUNT += 1
    return x * COUNT


def _appends_to_its_argument(x, state):
    state.append(x.sum())
    return x * 2


def _appends_to_its_default_list(x, state, seen=CALLS):
    seen.append(x.shape[0])
    return x * 2


def _counts_in_its_argument(x, state):
    state["n"] = state.get("n", 0) + 1
    return x + 1


def _record(into, value):
    into.append(value)


def _count(into):
    into["n"] = into.get("n", 0) + 1
    return into["n"]


def _appends_to_its_argument_in_a_helper(x, state):
    _record(state, x.sum())
    return x * 2


def _counts_in_its_argument_in_a_helper(x, state):
    return x * _count(state)


def _closure_counter():
    count = 0

    def counts_in_a_closed_over_variable(x, state):
        nonlocal count
        count += 1
        return x * count
    return counts_in_a_closed_over_variable


def _states():
    """The outside state the functions above write: snapshots to compare."""
    return list(CALLS), {k: v.clone() for k, v in CACHE.items()}, COUNT


@pytest.mark.parametrize("make, argument", [
    (lambda: _appends_to_a_global_list, dict), (lambda: _stores_a_tensor_in_a_global_dict, dict),
    (lambda: _counts_in_a_global, dict), (lambda: _appends_to_its_argument, list),
    (lambda: _counts_in_its_argument, dict), (_closure_counter, dict), (lambda: _appends_to_its_default_list, dict),
    (lambda: _appends_to_its_argument_in_a_helper, list), (lambda: _counts_in_its_argument_in_a_helper, dict)],
    ids=["global list", "global dict", "global int", "argument list", "argument dict", "closed-over int",
         "default list", "argument list in a helper", "argument dict in a helper"])
def test_a_function_that_changes_python_state_changes_it_on_every_call_as_eager_does(make, argument):
    """A trace runs the function's Python once: `CALLS.append(...)` happened at the first
    call only, and `CACHE["y"] = x.exp()` left the trace's stand-in tensor (a FakeTensor) in
    the dict. Such a function now runs through Dynamo, which replays the writes after each
    call. A helper that appended to the list it was passed appended to none of the caller's:
    the trace's argument was another list."""
    global COUNT
    results = []
    for run in (make(), tjit.compile(make())):
        CALLS.clear(), CACHE.clear()
        COUNT, state = 0, argument()
        outputs = [run(torch.randn(300 + k, 70, generator=torch.Generator().manual_seed(k)), state)
                   for k in range(3)]
        results.append((outputs, _states(), state))
    (eager, eager_state, eager_argument), (compiled, compiled_state, compiled_argument) = results
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_state, eager_state)
    torch.testing.assert_close(compiled_argument, eager_argument)
    assert all(type(v) is torch.Tensor for v in compiled_state[1].values())


def test_a_function_that_takes_from_an_iterator_takes_the_next_value_at_every_call():
    """`next(it)` ran once, in the trace: every call multiplied by the iterator's first
    value. An iterator is state (where it stands), read through Dynamo now."""
    steps = itertools.count(1)

    def scaled_by_a_closed_over_iterator(x):
        return x * next(steps)

    def scaled_by_an_argument_iterator(x, it):
        return x * next(it)

    x, it = torch.randn(300, 70), iter([2.0, 3.0, 4.0])
    closed, argument = tjit.compile(scaled_by_a_closed_over_iterator), tjit.compile(scaled_by_an_argument_iterator)
    for k in (1, 2, 3):
        torch.testing.assert_close(closed(x), x * k, rtol=0, atol=0)
        torch.testing.assert_close(argument(x, it), x * (k + 1), rtol=0, atol=0)


def _seeds_and_draws(x):
    torch.manual_seed(7)
    return x + torch.rand(x.shape)


def test_a_function_that_seeds_torchs_generator_seeds_it_at_every_call():
    """`torch.manual_seed(7)` ran in the trace only: the second call drew other numbers than
    the first, where eager draws the same ones."""
    x, compiled = torch.randn(300, 70), tjit.compile(_seeds_and_draws)
    first, second = compiled(x), compiled(x)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    after_compiled = torch.rand(5)
    _seeds_and_draws(x)
    torch.testing.assert_close(after_compiled, torch.rand(5), rtol=0, atol=0)  # (the generator stands where eager's does)


def test_a_function_that_prints_prints_on_every_call(capsys):
    def prints(x):
        print("called with", tuple(x.shape))
        return x * 2

    compiled = tjit.compile(prints)
    for n in (300, 300, 301):
        torch.testing.assert_close(compiled(torch.ones(n, 70)), torch.full((n, 70), 2.0))
    assert capsys.readouterr().out.splitlines() == ["called with (300, 70)"] * 2 + ["called with (301, 70)"]


def _prints_and_writes_its_argument(h):
    print("called")
    return h.relu_() * 2


def test_explain_of_a_function_dynamo_runs_writes_into_copies_as_the_call_would():
    """explain runs such a function (Dynamo finds its graphs by running it) on copies of the
    arguments; it made every copy a leaf, so an in-place write into an argument that is the
    result of earlier ops, which the call allows, failed with the leaf error."""
    w = torch.randn(300, 70, requires_grad=True)
    compiled = tjit.compile(_prints_and_writes_its_argument)
    h = w * 1.5
    before = h.detach().clone()
    explained = str(tjit.explain(compiled, h))
    assert explained.startswith("split by Dynamo") and "graph 0:" in explained and "kernel" in explained
    torch.testing.assert_close(h, before, rtol=0, atol=0)  # (the caller's tensor untouched)
    torch.testing.assert_close(compiled(h), before.relu() * 2)


def _writes_its_own_tensors(x, index):
    parts = []
    for k in range(2):
        parts.append(x * k)
    out = torch.cat(parts)
    out[index] += 1
    out[:, 0] = 0
    return out


def _writes_its_own_list_in_a_helper(x, index):
    parts = []
    for k in range(2):
        _record(parts, x * k)
    return torch.cat(parts)[index]


@pytest.mark.parametrize("fn", [_writes_its_own_tensors, _writes_its_own_list_in_a_helper])
def test_writes_into_local_lists_and_tensors_do_not_send_a_function_to_dynamo(fn):
    x, index = torch.randn(300, 70), torch.tensor([1, 5, 299])
    compiled = tjit.compile(fn)
    torch.testing.assert_close(compiled(x, index), fn(x, index))
    assert not any(isinstance(entry.executable, tjit.runtime.split.SplitFunction)
                   for entry in compiled._cache.values())


@tjit.compile
def _compiled_helper(z):
    return z.sigmoid() * 2


def _calls_a_compiled_helper(x):
    return _compiled_helper(x * 3) + 1


@pytest.mark.parametrize("backend", ["tjit", "eager"])
def test_a_compiled_function_called_where_dynamo_traces_joins_the_callers_graph(backend):
    """Dynamo traced into tjit's runtime (the helper's __call__, its executor, Triton's
    launcher), breaking its graph at every step and compiling the pieces: the call never
    finished. The helper's own function is traced instead, into the caller's graph."""
    x = torch.randn(300, 70)
    torch.testing.assert_close(torch.compile(_calls_a_compiled_helper, backend=backend)(x),
                               _calls_a_compiled_helper(x))
    torch.testing.assert_close(tjit.compile(_calls_a_compiled_helper)(x), _calls_a_compiled_helper(x))


def test_torch_func_transforms_inside_a_compiled_function_run_as_they_are_and_the_rest_compiles():
    """Dynamo inlines torch.func.grad and jacrev into its graph (functorch's levels entered and
    left by plain calls): tjit's trace of it failed inside a level, which it left broken, and
    reported the next eager run's internal assert as eager's own error; tjit.compile refused
    the function. The graph is now cut around each transform, which runs as Dynamo captured
    it, and tjit compiles the ops around it."""
    import warnings
    from torch.func import grad, jacrev

    def gradient(x, w):
        h = torch.tanh(x * 2)
        g = grad(lambda w: torch.tanh(h @ w).pow(2).sum())(w)
        return (g * 3).softmax(-1)

    def jacobian(x, w):
        return jacrev(lambda x: torch.tanh(x @ w) * x)(x.exp()).cumsum(0)
    x, w = torch.randn(40), torch.randn(40, 40)
    for f in (gradient, jacobian):
        for compiled in (lambda f: torch.compile(f, backend="tjit"), tjit.compile):
            torch._dynamo.reset()
            before = tjit.counters.launches
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # (no graph runs eagerly)
                got = compiled(f)(x, w)
            assert tjit.counters.launches > before
            torch.testing.assert_close(got, f(x, w))


def test_flex_attention_runs_as_it_is_between_compiled_ops():
    """flex_attention (a higher-order op, with a score_mod whose block mask torch builds under
    vmap) and the work around it: the op and the transform run as they are, tjit compiles the
    rest (the whole graph ran eagerly, with a warning). Forward only: eager has no
    flex_attention backward on the CPU."""
    import warnings
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, 40, 40, device="cpu")

    def relative(x, w):
        q, k, v = (torch.tanh(x * w[j]) for j in range(3))
        return flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + (i - j) * 0.1).softmax(-1)

    def masked(x, w):
        q, k, v = (torch.tanh(x * w[j]) for j in range(3))
        return flex_attention(q, k, v, block_mask=causal).square().sum(-1)
    x, w = torch.randn(2, 2, 40, 16), torch.randn(3, 16)
    for f in (relative, masked):
        torch._dynamo.reset()
        before = tjit.counters.launches
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            got = torch.compile(f, backend="tjit")(x, w)
        assert tjit.counters.launches > before
        torch.testing.assert_close(got, f(x, w))


def normed_residual_layers(x, *ws):
    for w in ws:
        x = x + torch.tanh(torch.nn.functional.layer_norm(x, x.shape[-1:], w[0]) @ w)  # (a kernel reads w)
    return x


@pytest.mark.usefixtures("library_matmuls")  # (a matmul is a library call: the layers' kernels are their norms)
@pytest.mark.parametrize("grad", [False, True])
def test_the_layers_of_a_model_share_their_kernels_sources(grad):
    """A kernel's source names its inputs and outputs by their places among its arguments
    (in0, out0, ...), not by the graph's names, so layers that differ only in the tensors they
    read and write share one source: one kernel loaded (and on a GPU compiled) for all of them.
    With the graph's names each layer's kernels were sources of their own (a GPT-2 training
    step's 107 kernel sources at 8 layers, 30 now). (With gradients: the forward's kernels;
    the backward's still differ per layer, each reading more of the layers above it.)"""
    def sources(layers: int) -> tuple[int, int]:
        args = [torch.randn(70, 40)] + [torch.randn(40, 40) / 8 for _ in range(layers)]
        args = [a.requires_grad_(grad) for a in args]
        check_against_eager(normed_residual_layers, *args)
        kernels = tjit.explain(normed_residual_layers, *args).kernels
        return len(kernels), len({k.name for k in kernels})
    (kernels8, sources8), (kernels12, sources12) = sources(8), sources(12)
    assert kernels12 >= kernels8 + 4 and sources12 == sources8


KERNELS_OF_EVERY_KIND = [  # (pointwise with comparisons, looped reductions, a scan, a tl.dot, a gather, an argmax)
    (lambda x, w, idx: (torch.where(x > 0, x, 0.1 * x).softmax(-1) + x.cumsum(-1)).gather(1, idx).argmax(1),
     (torch.randn(37, 700), None, torch.randint(0, 700, (37, 5)))),
    (lambda x, w, idx: (torch.relu(x @ w) + 1, x.cumsum(0)), (torch.randn(20, 24), torch.randn(24, 12), None)),
    (lambda x, w, idx: (x // 3 + (x % 5 == 1)) * 2, (torch.randint(-50, 50, (300, 7)), None, None)),
]


def test_tjits_kernels_skip_tritons_own_rewrite_for_the_interpreter_and_get_its_tree(monkeypatch):
    """The interpreter's rewrite of tjit's kernels (runtime/interpreter.py:
    load_for_interpreter) makes the tree Triton's own rewrite makes, and Triton's
    is not run for them (it is for Triton's and tjit's helpers)."""
    from triton.runtime import interpreter as ti
    from tjit.runtime.interpreter import interpreted_tree
    from tjit.runtime.loader import module_source
    tritons = ti.FunctionRewriter.rewrite_ast

    def only_helpers(self):
        assert not self.fn.__name__.startswith("tjit_"), f"Triton rewrote tjit's kernel {self.fn.__name__}"
        return tritons(self)
    monkeypatch.setattr(ti.FunctionRewriter, "rewrite_ast", only_helpers)
    kernels = []
    for fn, args in KERNELS_OF_EVERY_KIND:
        check_against_eager(fn, *args)
        kernels += tjit.explain(fn, *args).kernels
    assert {k.name.split("_")[1] for k in kernels} >= {"pointwise", "reduce", "dot"}
    for k in kernels:
        text = module_source(k)
        ours = interpreted_tree(text, k.name)
        fdef = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == k.name)
        fdef.decorator_list = []
        assert ours is not None and ast.dump(ours) == ast.dump(ti.ASTTransformer().visit(fdef)), k.name


@pytest.mark.parametrize("body, ours", [
    ("    x = a + 1\n    y = tl.where(x > 0, x, 0)\n    return y\n", True),
    ("    x = 0 < a < 4\n    return x\n", False),  # (a chained comparison: Triton's rewrite spells it out)
    ("    if a > 0:\n        x = y = a\n    return a\n", False),  # (several targets: Triton refuses them)
])
def test_a_kernel_is_rewritten_for_the_interpreter_by_tjit_only_where_the_trees_agree(body, ours):
    from triton.runtime import interpreter as ti
    from tjit.runtime.interpreter import interpreted_tree
    text = "import triton\nimport triton.language as tl\n\n@triton.jit\ndef k(a):\n" + body
    found = interpreted_tree(text, "k")
    assert (found is not None) == ours
    if ours:
        fdef = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef))
        fdef.decorator_list = []
        assert ast.dump(found) == ast.dump(ti.ASTTransformer().visit(fdef))


def test_the_cyclic_collector_is_paused_while_compiling_and_restored_after(monkeypatch):
    """A compile runs with the cyclic garbage collector off (its full collections walk the
    whole heap and free almost nothing of a compile's garbage: counters.collection_paused),
    and leaves it as it found it: on, or off where the user turned it off, also when the
    compile fails."""
    import gc
    from tjit.runtime.compiled import CompiledFunction
    seen = []
    compile_entry = CompiledFunction._compile

    def watched(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return compile_entry(self, *args, **kwargs)

    monkeypatch.setattr(CompiledFunction, "_compile", watched)
    assert gc.isenabled()
    f = tjit.compile(lambda x: x.sin() + 1)
    x = torch.randn(70)
    torch.testing.assert_close(f(x), x.sin() + 1)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        f(torch.randn(3, 5))
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(tjit.TjitError):
        tjit.compile(lambda x: x.sin().numpy())(torch.randn(4))
    assert len(seen) == 3 and gc.isenabled()


def test_compile_seconds_grow_on_compiles_and_not_on_cached_calls(monkeypatch):
    """tjit.counters.compile_seconds (bench/models.py's first-call compile time) grows when a
    call compiles, forward and backward, not when a compiled one runs again; a compile phase
    inside another is counted once."""
    from tjit.runtime import counters as counting
    f = tjit.compile(lambda x: (x.sin() * 2).sum())
    x = torch.randn(1000, requires_grad=True)
    start = tjit.counters.compile_seconds
    f(x).backward()
    compiled = tjit.counters.compile_seconds
    assert compiled > start
    f(x).backward()
    assert tjit.counters.compile_seconds == compiled
    clock = iter([10.0, 15.0])  # the outer phase's start and end (the inner one reads no clock)
    monkeypatch.setattr(counting, "_clock", lambda: next(clock))
    with counting.compiling(), counting.compiling():
        pass
    assert tjit.counters.compile_seconds == compiled + 5.0

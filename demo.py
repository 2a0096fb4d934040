#!/usr/bin/env python
"""tjit demo (`make demo`): compile a few real functions, check them against eager PyTorch,
and show what tjit made of each: the IR, the Triton source, kernels against eager's op count,
bytes moved against the minimum, and the compile time. Then a loss differentiated by tjit
(forward and backward kernels, what it saves for backward against eager autograd), and the
same functions through torch.compile(fn, backend="tjit").

Without CUDA the kernels run on CPU through Triton's interpreter (tjit arranges that itself).
"""
from __future__ import annotations

import math
import sys
import time

import torch

import tjit
from tjit.explain import LibraryCallReport

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDTH = 100


# -- the functions ---------------------------------------------------------------------------

def issue_example(x, y, scale):
    z = torch.sigmoid(x) * y.t() + scale
    return torch.where(z > 0, z, 0.1 * z), z.exp().clamp(max=10)


def chain20(a, b, c):
    t = a * b                   # 1
    t = t + c                   # 2
    t = torch.sin(t)            # 3
    t = t * 1.5                 # 4
    t = t - a                   # 5
    t = torch.abs(t)            # 6
    t = torch.sqrt(t + 1.0)     # 7, 8
    t = t / (b * b + 1.0)       # 9, 10, 11
    t = torch.tanh(t)           # 12
    u = t * c                   # 13
    u = torch.exp(-u)           # 14, 15
    u = u.clamp(0.0, 4.0)       # 16
    v = torch.maximum(u, a)     # 17
    w = v * t + b               # 18, 19
    return torch.sigmoid(w), u  # 20


def inplace_update(x, a, b):
    return x.mul_(a).add_(b)


def interleaved_update(x):
    return x[:, ::2].mul_(2).add_(x[:, 1::2])


def view_output(x):
    return x.t(), x * 2


def layer_norm_gelu(x, w, b):
    return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, x.shape[-1:], w, b))


def softmax_long_rows(x):
    return torch.softmax(x * 0.5, dim=-1)


def cross_entropy_loss(logits, target):
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=0)


def two_stage(x):
    """a transposed copy between two reductions: an intermediate in the slab"""
    a = x.softmax(0)
    return (a.t().contiguous() + 1).sum(0)


def log_cumulative_probs(logits):
    """log of the running probability mass: a reduction, a scan and their neighbours."""
    return torch.logcumsumexp(logits.log_softmax(-1), -1).exp()


def loss_fn(x, w, b, target):
    """the autograd issue's example: layer_norm -> gelu -> cross-entropy, differentiated"""
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b)
    return torch.nn.functional.cross_entropy(torch.nn.functional.gelu(h), target)


def matmul_epilogue(x, w, b):
    """the matmul generated as tl.dot, its bias, gelu and the softmax of its rows in the same kernel"""
    return torch.softmax(torch.nn.functional.gelu(x @ w + b), dim=-1)


def causal_attention(q, k, v):
    """softmax(q @ k.T * scale + causal mask) @ v: one flash-style kernel, the probabilities never written"""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def sorted_probs(x):
    """work on both sides of a sort (a library call): one kernel before it, one after"""
    return torch.exp(torch.sort(2 * x + 1, dim=-1).values)


def padded_concat(a, b):
    """cat and pad are index arithmetic inside the kernel, not copies"""
    return torch.nn.functional.pad(torch.cat([a * 2, b.exp()], dim=1), (1, 1)).sum(dim=1)


def scatter_rows(x, index, rows):
    """x[index] = 2 * rows, then a row sum: one kernel copies x, one writes the rows at
    their offsets (the doubling fused in), one sums"""
    return torch.ops.aten.index_put(x, [index], rows * 2).sum(dim=1)


def rand(*shape):
    return torch.randn(*shape, device=DEVICE)


M, N = 64, 96
EXAMPLES = [
    ("issue example: z = sigmoid(x) * y.t() + scale; where(z > 0, z, 0.1 z), exp(z).clamp(max=10)",
     issue_example, lambda: (rand(M, N), rand(N, M), 0.5)),
    ("a chain of 20 pointwise ops over 3 inputs, 2 outputs", chain20, lambda: (rand(M, N), rand(M, N), rand(M, N))),
    ("in-place update of an input: x.mul_(a).add_(b)", inplace_update, lambda: (rand(M, N), rand(M, N), rand(M, N))),
    ("x[:, ::2].mul_(2).add_(x[:, 1::2]): the reads meet no written address (integer sets), one kernel, no copy",
     interleaved_update, lambda: (rand(M, N),)),
    ("a view output: return x.t(), x * 2", view_output, lambda: (rand(M, N),)),
    ("layer_norm(x, w, b) then gelu: a persistent reduction with prologue and epilogue",
     layer_norm_gelu, lambda: (rand(M, N), rand(N), rand(N))),
    ("softmax over rows of 8192 (looped: online max and sum, then the output pass)",
     softmax_long_rows, lambda: (rand(2, 8192),)),
    ("exp(logcumsumexp(log_softmax(x))): a reduction, a scan and elementwise work", log_cumulative_probs,
     lambda: (rand(8, N),)),
    ("cross_entropy(logits, target, ignore_index=0): row reductions, a gather and the mean, one kernel",
     cross_entropy_loss, lambda: (rand(M, N), torch.randint(0, N, (M,), device=DEVICE))),
    ("softmax over dim 0, a transposed copy, a sum: buffers planned in one slab", two_stage,
     lambda: (rand(M, N),)),
    ("softmax(gelu(x @ w + b)): the matmul (tl.dot), bias, gelu and softmax in one kernel",
     matmul_epilogue, lambda: (rand(M, N), rand(N, 48), rand(48))),
    ("causal attention softmax(q @ k.T * scale + mask) @ v: one kernel (scores, online softmax, output)",
     causal_attention, lambda: (rand(2, 4, 80, 32), rand(2, 4, 80, 32), rand(2, 4, 80, 32))),
    ("exp(sort(2x + 1).values): a kernel, the sort as a library call, a kernel", sorted_probs,
     lambda: (rand(M, N),)),
    ("pad(cat([a * 2, exp(b)], 1), (1, 1)).sum(1): cat and pad fused into the reduction, one kernel",
     padded_concat, lambda: (rand(M, N), rand(M, 40))),
    ("index_put(x, [index], rows * 2).sum(1): a fill, a scatter (tl.store at data offsets), a sum",
     scatter_rows, lambda: (rand(M, N), torch.randperm(M, device=DEVICE)[:20], rand(20, N))),
]


# -- helpers ------------------------------------------------------------------------------------

def clone_args(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def leaves(value):
    return torch.utils._pytree.tree_leaves(value)


def check_matches_eager(fn, got, got_args, args, what: str):
    """Outputs and every input (in-place writes) must match eager; raises with a clear message."""
    eager_args = clone_args(args)
    expected = fn(*eager_args)
    pairs = list(zip(leaves(got), leaves(expected))) + list(zip(got_args, eager_args))
    if len(leaves(got)) != len(leaves(expected)):
        raise AssertionError(f"{what}: {len(leaves(got))} outputs, eager returns {len(leaves(expected))}")
    # an output that is a view of an input in eager (x.t()) must be a view of that input here too
    eager_storage = {a.untyped_storage().data_ptr(): j for j, a in enumerate(eager_args) if isinstance(a, torch.Tensor)}
    for k, (g, e) in enumerate(zip(leaves(got), leaves(expected))):
        j = eager_storage.get(e.untyped_storage().data_ptr()) if isinstance(e, torch.Tensor) else None
        if j is not None and g.untyped_storage().data_ptr() != got_args[j].untyped_storage().data_ptr():
            raise AssertionError(f"{what}: output {k} is a view of input {j} in eager, but a copy here")
    for k, (g, e) in enumerate(pairs):
        if isinstance(e, torch.Tensor):
            try:
                torch.testing.assert_close(g, e, equal_nan=True)
                assert g.stride() == e.stride() or g.numel() <= 1, f"strides {g.stride()} != eager {e.stride()}"
            except AssertionError as err:
                raise AssertionError(f"{what}: {'output' if k < len(leaves(expected)) else 'input'} {k} differs "
                                     f"from eager:\n{err}") from None


def real_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (a broadcast dimension counts once)."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size() if t.numel() else 0


def minimum_bytes(fn, args) -> int:
    """Each input read once, each output written once (of an input written in place, the
    elements the write changed; an output that is a view of an input costs nothing)."""
    args = clone_args(args)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    result = fn(*args)
    total = sum(real_bytes(t) for t in tensors)
    total += sum(int((t != old).sum()) * t.element_size() for t, old in zip(tensors, before) if t.is_floating_point())
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    for t in leaves(result):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
            storages.add(t.untyped_storage().data_ptr())
            total += real_bytes(t)
    return total


def header(text: str, char: str = "=") -> None:
    print()
    print(char * WIDTH)
    print(text)
    print(char * WIDTH)


# -- the demo -----------------------------------------------------------------------------------

def demo_one(k: int, title: str, fn, make_args) -> None:
    header(f"{k}. {fn.__name__}: {title}")
    args = make_args()
    compiled = tjit.compile(fn)

    before = tjit.counters.snapshot()
    t0 = time.perf_counter()
    call_args = clone_args(args)
    got = compiled(*call_args)
    first_call = time.perf_counter() - t0
    launches = tjit.counters.launches - before["launches"]
    check_matches_eager(fn, got, call_args, args, f"tjit.compile({fn.__name__})")

    entry = compiled.entry_for(*args)  # the cached entry the call used
    ex = tjit.explain(compiled, *args)
    minimum = minimum_bytes(fn, args)

    print("-- IR " + "-" * (WIDTH - 6))
    print(ex.graph)
    for kernel in ex.steps:
        if isinstance(kernel, LibraryCallReport):
            print(f"-- library call {kernel.op}: the op itself runs here " + "-" * max(0, WIDTH - 45 - len(kernel.op)))
            print(f"# {kernel.results_memory}")
            continue
        print(f"-- Triton kernel {kernel.name}: shape {list(kernel.shape)}, grid {kernel.grid} "
              + "-" * max(0, WIDTH - 40 - len(kernel.name)))
        for s in kernel.strategies:
            print(f"# {s}")
        print(kernel.source.rstrip())
    if not ex.steps:
        print("-- no kernels: every output is a view of an input")
    print("-- summary " + "-" * (WIDTH - 11))
    print("matches eager:   yes (outputs and inputs after the call, torch.testing.assert_close)")
    calls = f" and {len(ex.library_calls)} library call(s)" if ex.library_calls else ""
    print(f"kernels:         {len(ex.kernels)} tjit kernel(s){calls}, {launches} launched per call; eager runs "
          f"{ex.eager_ops} op(s)")
    ratio = f"{ex.bytes_moved / minimum:.2f}x" if minimum else "-"
    print(f"bytes moved:     {ex.bytes_moved:,} B per call; minimum {minimum:,} B ({ratio})")
    compile_s = entry.trace_seconds + entry.lower_seconds + entry.load_seconds
    loaded = " when an earlier run compiled it; this run loaded it from the disk cache" if entry.from_disk else ""
    print(f"compile time:    {compile_s * 1e3:.1f} ms (trace {entry.trace_seconds * 1e3:.1f}, lower + codegen "
          f"{entry.lower_seconds * 1e3:.1f}, load {entry.load_seconds * 1e3:.1f}){loaded}; first call "
          f"{first_call * 1e3:.0f} ms including the run" + (" in Triton's interpreter" if DEVICE == "cpu" else ""))

    plan = ex.memory
    if plan.intervals:
        print(f"memory:          {len(plan.intervals)} intermediate(s) in one slab of {plan.slab_size:,} B "
              f"(lower bound {plan.lower_bound:,} B); outputs are the caller's")
    else:
        print("memory:          no intermediates: every value stays in registers")

    # A second call with the same shapes reuses everything, the slab included.
    before, slabs = tjit.counters.snapshot(), tjit.memory.stats()["allocations"]
    call_args = clone_args(args)
    check_matches_eager(fn, compiled(*call_args), call_args, args, f"tjit.compile({fn.__name__}), 2nd call")
    assert tjit.counters.traces == before["traces"], "a second call with the same shapes retraced"
    print(f"second call:     no retrace, {tjit.counters.launches - before['launches']} launch(es), "
          f"{tjit.memory.stats()['allocations'] - slabs} allocation(s) for intermediates")

    # A float argument is a runtime number (a 0-d tensor the kernels read): a new value reuses everything.
    for name, how in ex.numbers.items():
        print(f"float {name}:{' ' * max(1, 10 - len(name))}{how}")
    if entry.numbers:
        new_args = tuple(a * 3 if type(a) is float else a for a in args)
        before, call_args = tjit.counters.snapshot(), clone_args(new_args)
        check_matches_eager(fn, compiled(*call_args), call_args, new_args, f"tjit.compile({fn.__name__}), new floats")
        assert tjit.counters.traces == before["traces"], "a new float value retraced"
        assert tjit.counters.kernels_generated == before["kernels_generated"], "a new float value made a kernel"
        print("new float value: no retrace, no new kernel, matches eager")


def demo_autograd() -> None:
    header("autograd: loss = loss_fn(x, w, b, target); loss.backward() with x, w, b requiring grad")
    args = (rand(M, N), 1 + 0.1 * rand(N), 0.1 * rand(N), torch.randint(0, N, (M,), device=DEVICE))
    leaves_ = lambda: [a.clone().requires_grad_(a.is_floating_point()) for a in args]  # noqa: E731
    compiled = tjit.compile(loss_fn)
    mine, theirs = leaves_(), leaves_()
    before = tjit.counters.launches
    loss = compiled(*mine)
    forward_launches = tjit.counters.launches - before
    ex = tjit.explain(compiled, *mine)
    tape_held = tjit.memory.stats()["tape_bytes"]
    loss.backward()
    backward_launches = tjit.counters.launches - before - forward_launches
    expected = loss_fn(*theirs)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for name, a, b in zip("xwb", mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"grad of {name}: {m}")
    for kernel in ex.backward.kernels:
        print(f"-- backward kernel {kernel.name}: shape {list(kernel.shape)} " + "-" * 20)
        for s in kernel.strategies:
            print(f"# {s}")
        print(kernel.source.rstrip())
    executable = compiled.entry_for(*mine).executable
    saved = executable.saved_bytes(dict(zip(("x", "w", "b", "target"), mine)))
    eager_saved = _eager_saved_bytes(loss_fn, leaves_())
    del loss
    print("-- summary " + "-" * (WIDTH - 11))
    print("matches eager:   yes (the loss and the gradients of x, w and b)")
    print(f"kernels:         forward {forward_launches}, backward {backward_launches} (eager: "
          f"{_eager_ops(loss_fn, leaves_())} aten op(s) forward and backward)")
    print(f"saved:           {', '.join(ex.saved)}: {saved:,} B (eager autograd saves {eager_saved:,} B); "
          "cheap values are recomputed in the backward kernels")
    print(f"tape:            {tape_held:,} B held between forward and backward, "
          f"{tjit.memory.stats()['tape_bytes']:,} B after backward")
    torch._dynamo.reset()
    through_dynamo, before = leaves_(), tjit.counters.launches
    torch.compile(loss_fn, backend="tjit")(*through_dynamo).backward()
    for name, a, b in zip("xwb", through_dynamo, theirs):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"torch.compile: grad of {name}: {m}")
    print(f"torch.compile:   backend='tjit' gives the same gradients; "
          f"{tjit.counters.launches - before} launch(es) forward and backward")


def lm_head_loss(x, w, target):
    """an LM head's loss after its final norm: the (tokens x vocab) logits only reduced"""
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],))
    return torch.nn.functional.cross_entropy(h @ w.t(), target)


def demo_fused_training() -> None:
    header("training without the logits: cross_entropy(layer_norm(x) @ w.T, target).backward(), x and w "
           "requiring grad")
    tokens, vocab, width = 256, 1000, 160  # (wider than a tile holds: the gradients accumulate in memory)
    args = (rand(tokens, width), 0.1 * rand(vocab, width), torch.randint(0, vocab, (tokens,), device=DEVICE))
    leaves_ = lambda: [a.clone().requires_grad_(a.is_floating_point()) for a in args]  # noqa: E731
    compiled = tjit.compile(lm_head_loss)
    mine, theirs = leaves_(), leaves_()
    before = tjit.counters.snapshot()
    loss = compiled(*mine)
    tape = tjit.memory.stats()["tape_bytes"]
    loss.backward()
    lm_head_loss(*theirs).backward()
    for name, a, b in zip("xw", mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"grad of {name}: {m}")
    ex = tjit.explain(compiled, *leaves_())
    logits, normalised = tokens * vocab * 4, tokens * width * 4
    written = sum(k.bytes_written for k in ex.kernels + ex.backward.kernels)
    print("\n".join(ex.matmuls))
    print("matches eager:   yes (the loss and the gradients of x and w)")
    print(f"kernels:         forward {len(ex.kernels)}, backward {len(ex.backward.kernels)}, library calls "
          f"{tjit.counters.library_calls - before['library_calls']} (the backward's product kernels compute the "
          "logits again on their tiles: dlogits @ w, and dlogits.T @ h with the logits computed transposed, "
          f"each accumulating its {width} columns in memory, 64 at a time)")
    print(f"memory:          the logits are {logits:,} B; the kernels wrote {written:,} B in all (the gradients "
          f"{(tokens + vocab) * width * 4:,} B of it, the normalised x and its gradient {2 * normalised:,} B); "
          f"the tape held {tape:,} B between forward and backward")


def _eager_saved_bytes(fn, args) -> int:
    seen = {}
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: seen.setdefault((t.data_ptr(), tuple(t.shape), t.stride()), t.numel() * t.element_size()) and t,
            lambda t: t):
        fn(*args)
    return sum(seen.values())


def _eager_ops(fn, args) -> int:
    """aten ops eager runs for fn and its backward, views excluded (each launches a kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            view = isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor) and \
                out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr() and not func._schema.is_mutable
            Count.ops += not view
            return out

    with Count():
        fn(*args).backward()
    return Count.ops


def demo_dynamo(fn, make_args) -> None:
    torch._dynamo.reset()
    args = make_args()
    compiled = torch.compile(fn, backend="tjit")
    before = tjit.counters.snapshot()
    call_args = clone_args(args)
    t0 = time.perf_counter()
    got = compiled(*call_args)
    seconds = time.perf_counter() - t0
    check_matches_eager(fn, got, call_args, args, f"torch.compile({fn.__name__}, backend='tjit')")
    launches = tjit.counters.launches - before["launches"]
    print(f"{fn.__name__:<16} matches eager; {launches} tjit kernel launch(es); first call {seconds * 1e3:.0f} ms "
          f"(Dynamo + tjit compile + run)")


def main() -> int:
    start = time.perf_counter()
    print(f"tjit demo on {DEVICE}" + ("" if DEVICE == "cuda" else " (kernels run in Triton's interpreter)")
          + f", shapes {M}x{N}")
    t0 = time.perf_counter()
    import torch._inductor  # noqa: F401  make_fx imports it on its first use; done here so compile times below are tjit's
    print(f"(one-time: importing torch._inductor, which make_fx loads on first use: {time.perf_counter() - t0:.1f} s)")
    for k, (title, fn, make_args) in enumerate(EXAMPLES, 1):
        demo_one(k, title, fn, make_args)
    demo_autograd()
    demo_fused_training()

    header('the same functions through torch.compile(fn, backend="tjit")')
    for _, fn, make_args in EXAMPLES:
        demo_dynamo(fn, make_args)

    print()
    print(f"all {len(EXAMPLES)} functions match eager, directly and through torch.compile; "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

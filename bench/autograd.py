#!/usr/bin/env python
"""Autograd benchmark: forward + backward kernels, bytes, saved bytes and peak memory per step.

    python bench/autograd.py [--quick] [--json PATH] [--only NAME[,NAME...]] [--steps N]

For layer_norm, rms_norm, softmax, cross-entropy, a gelu MLP without matmuls and a small
training step (layer_norm -> gelu -> cross-entropy, then an SGD update), one step is the
forward, the backward (a dense random incoming gradient for non-scalar outputs) and, for the
training step, the update. Counts are measured while the code runs (bench/measure.py says how),
and tjit's plan is checked against them. Per workload it reports
  * kernels: tjit's forward and backward kernels, measured over a step after the first (the
    Triton launches Triton itself saw, plus any aten op tjit's runtime ran outside them: a zero
    gradient, a scatter_add_), and eager's forward and backward kernels, measured (the aten ops
    eager dispatches to a backend kernel, views and allocations excluded);
  * bytes moved by tjit's kernels in a step (explain's bytes_read + bytes_written, forward and
    backward), and without CUDA the distinct..issued bytes their loads and stores were measured
    to move in the interpreter, against the minimum: each input read once, each output written
    once, each incoming gradient read once, each input gradient written once;
  * bytes saved for backward, tjit's and eager's measured alike: every tensor autograd saves
    (tjit hands torch its inputs and outputs by reference and its intermediates in a tape
    block), counted once per distinct tensor, through torch.autograd.graph.saved_tensors_hooks;
  * peak memory of a step: the most bytes of tensors allocated during the step and alive at
    once (tracked op by op with a dispatch mode; on CPU the garbage collector runs at each op,
    so no reference cycle of Triton's interpreter holds memory longer than on a GPU). tjit's
    column adds the slabs its compiled forward and backward keep between calls (the larger of
    the two: they start one arena, which a thread's compiled graphs share);
  * whether the output and the gradients match eager's (torch.allclose, rtol 1e-4, atol 1e-5);
  * the training loop: tape bytes after the last step (tjit.memory.stats), resident memory
    growth between a warm step and the last one, and the kernels of the last step (forward,
    backward and update), measured.
With CUDA: triton.testing.do_bench medians of a step in eager, torch.compile and tjit.

Checked, and the script exits 1 with the failures listed when one does not hold: the output and
gradients match eager's; the forward and backward kernels tjit.explain plans are the launches
tjit.counters counted and Triton saw (and so for the training loop's last step); explain's bytes
per kernel lie between the measured distinct and issued bytes (interpreter only); the bytes
saved for backward are what tjit's plan says it saves (GradExecutable.saved_bytes).

Targets (printed, not enforced): backward of layer_norm, rms_norm, softmax and cross-entropy in
at most 2 kernels; saved bytes <= eager's for every workload; zero memory growth over the loop.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pointwise import DEVICE, HAS_CUDA, MB, fmt_table  # noqa: E402  (sets up triton first)
from measure import AtenKernels, TjitKernels, check_bytes, check_launches, print_failures  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import tjit  # noqa: E402


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- workloads -----------------------------------------------------------------------------------
def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w)


def softmax(x):
    return torch.softmax(x, -1)


def cross_entropy(x, target):
    return F.cross_entropy(x, target)


def gelu_mlp(x, w1, b1, w2, b2):
    """Two elementwise 'layers' (scale and shift per feature) around a gelu: no matmul."""
    return F.gelu(x * w1 + b1) * w2 + b2


def loss_fn(x, w, b, target):
    """The issue's example: layer_norm -> gelu -> cross-entropy."""
    h = F.layer_norm(x, (x.shape[-1],), w, b)
    return F.cross_entropy(F.gelu(h), target)


def sgd(w, b, gw, gb, lr: float):
    w.sub_(gw * lr)
    b.sub_(gb * lr)


@dataclass
class Workload:
    name: str
    fn: Callable
    make: Callable[[int, int], tuple]  # (rows, cols) -> args (float tensors require grad)


def _inputs(rows, cols, *, weights=0, biases=0, target=False):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    args = [torch.randn(rows, cols, generator=g)]
    args += [1 + 0.1 * torch.randn(cols, generator=g) for _ in range(weights)]
    args += [0.1 * torch.randn(cols, generator=g) for _ in range(biases)]
    args = [a.to(DEVICE).requires_grad_() for a in args]
    if target:
        args.append(torch.randint(0, cols, (rows,), generator=g).to(DEVICE))
    return tuple(args)


def _mlp_inputs(rows, cols):
    x, w1, w2, b1, b2 = _inputs(rows, cols, weights=2, biases=2)
    return x, w1, b1, w2, b2


WORKLOADS = [
    Workload("layer_norm", layer_norm, lambda r, c: _inputs(r, c, weights=1, biases=1)),
    Workload("rms_norm", rms_norm, lambda r, c: _inputs(r, c, weights=1)),
    Workload("softmax", softmax, lambda r, c: _inputs(r, c)),
    Workload("cross_entropy", cross_entropy, lambda r, c: _inputs(r, c, target=True)),
    Workload("gelu_mlp", gelu_mlp, _mlp_inputs),
    Workload("train_step", loss_fn, lambda r, c: _inputs(r, c, weights=1, biases=1, target=True)),
]


# -- measuring -------------------------------------------------------------------------------------
def clone(args):
    return tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args)


def incoming_gradient(out: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(out.shape, generator=g).to(out.device, out.dtype) if out.dim() else torch.ones_like(out)


def step(fn, args, grad=None):
    """Forward and backward; returns the output and the incoming gradient used."""
    out = fn(*args)
    grad = incoming_gradient(out) if grad is None else grad
    out.backward(grad)
    return out, grad


class Allocations(TorchDispatchMode):
    """Tracks storages allocated while active: live bytes after every op, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {_storage_of(a).data_ptr() for a in tree_leaves((args, kwargs)) if _storage_of(a) is not None}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in given:  # a view or an in-place op's result: not an allocation
                    continue
                if key not in self.live or self.live[key][0].expired():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.live_bytes())
        return out

    def live_bytes(self) -> int:
        if not HAS_CUDA:
            gc.collect()
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())


def _storage_of(a):
    if isinstance(a, torch.Tensor):
        return a.untyped_storage()
    return a if isinstance(a, torch.UntypedStorage) else None


class SavedTensors:
    """Bytes of the distinct tensors autograd is handed to save for backward while active
    (eager's and a tjit function's alike: both hand their tensors to torch), through
    torch.autograd.graph.saved_tensors_hooks."""

    def __init__(self):
        self.seen, self.bytes = set(), 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def peak_bytes(fn, args, grad) -> int:
    gc.collect()
    mode = Allocations()
    with mode:
        step(fn, args, grad)
        for a in args:
            if isinstance(a, torch.Tensor) and a.grad is not None:
                a.grad = None  # the grads were counted while alive
    return mode.peak


def minimum_step_bytes(args, out) -> int:
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    read = sum(size(a) for a in args if isinstance(a, torch.Tensor))
    grads = sum(size(a) for a in args if isinstance(a, torch.Tensor) and a.requires_grad)
    return read + 2 * size(out) + grads  # inputs, output, its gradient, the inputs' gradients


@dataclass
class Row:
    name: str
    shape: str
    fwd_kernels: int  # measured: Triton launches + aten kernels tjit ran outside them
    bwd_kernels: int
    fwd_planned: int  # tjit.explain
    bwd_planned: int
    tjit_aten_kernels: list  # aten kernels tjit ran beside its Triton kernels in the step
    eager_fwd_kernels: list  # measured: the aten kernels eager ran
    eager_bwd_kernels: list
    mb_moved: float  # explain, forward + backward
    mb_distinct: float | None  # measured (interpreter only)
    mb_issued: float | None
    mb_min: float
    saved_mb: float  # measured, as eager's
    planned_saved_mb: float  # GradExecutable.saved_bytes
    eager_saved_mb: float
    peak_mb: float
    eager_peak_mb: float
    matches: bool
    saved: str
    failures: list
    times_ms: dict


def close(got, want) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def measure(w: Workload, rows: int, cols: int) -> Row:
    args = w.make(rows, cols)
    compiled = tjit.compile(w.fn)
    explanation = tjit.explain(compiled, *args)
    bwd = explanation.backward
    executable = compiled.entry_for(*args).executable

    # eager: the kernels of its forward and of its backward, measured
    eager_args = clone(args)
    with AtenKernels() as eager_fwd, SavedTensors() as eager_saved:
        out = w.fn(*eager_args)
    grad = incoming_gradient(out)
    with AtenKernels() as eager_bwd:
        out.backward(grad)

    # tjit: a first step compiles the backward for this gradient layout, the second is measured
    step(compiled, clone(args), grad)
    tjit_args = clone(args)
    with TjitKernels() as fwd, SavedTensors() as tjit_saved:
        tjit_out = compiled(*tjit_args)
    with TjitKernels() as back:
        tjit_out.backward(grad)
    where = f"{w.name} {rows}x{cols}"
    failures = check_launches(f"{where} forward", len(explanation.kernels), fwd)
    failures += check_launches(f"{where} backward", len(bwd.kernels), back)
    failures += check_bytes(f"{where} forward", explanation.kernels, fwd.triton.launches)
    failures += check_bytes(f"{where} backward", bwd.kernels, back.triton.launches)
    distinct = issued = None
    if fwd.triton.record_bytes:
        measured = [a + b for a, b in zip(fwd.triton.bytes(), back.triton.bytes())]
        issued, distinct = (measured[0] + measured[1]) / MB, (measured[2] + measured[3]) / MB

    wrong = [] if close(tjit_out.detach(), out.detach()) else ["output"]
    wrong += [f"grad of argument {k}" for k, (a, e) in enumerate(zip(tjit_args, eager_args))
              if isinstance(a, torch.Tensor) and a.requires_grad
              and (a.grad is None or e.grad is None or not close(a.grad, e.grad))]
    if wrong:
        failures.append(f"{where}: tjit's {', '.join(wrong)} do(es) not match eager's (rtol 1e-4, atol 1e-5)")

    saved = tjit_saved.bytes
    planned_saved = executable.saved_bytes({n: a for n, a in zip(_names(w.fn), args)})
    if saved != planned_saved:
        failures.append(f"{where}: tjit's plan saves {planned_saved} B for backward (GradExecutable.saved_bytes), "
                        f"autograd was handed {saved} B")
    # the forward's and backward's slabs start one arena (a thread's graphs share it): the larger counts
    slabs = max((s.memory.numel() for ex in [executable.forward, *executable._backward.values()] for s in ex.slabs()),
                default=0)
    return Row(
        w.name, f"{rows}x{cols}", fwd.total, back.total, len(explanation.kernels), len(bwd.kernels),
        fwd.aten.kernels + back.aten.kernels, eager_fwd.kernels, eager_bwd.kernels,
        (explanation.bytes_moved + bwd.bytes_moved) / MB, distinct, issued, minimum_step_bytes(args, out) / MB,
        saved / MB, planned_saved / MB, eager_saved.bytes / MB,
        (peak_bytes(compiled, clone(args), grad) + slabs) / MB, peak_bytes(w.fn, clone(args), grad) / MB,
        not wrong, ",".join(explanation.saved), failures, timings(w.fn, compiled, args, grad))


def _names(fn) -> list[str]:
    import inspect
    return list(inspect.signature(fn).parameters)


def timings(fn, compiled, args, grad) -> dict:
    if not HAS_CUDA:
        return {}
    from triton.testing import do_bench
    found = {}
    for label, f in (("eager", fn), ("torch.compile", torch.compile(fn)), ("tjit", compiled)):
        a = clone(args)
        found[label] = do_bench(lambda: step(f, a, grad))
    return found


# -- the training loop -----------------------------------------------------------------------------
def training_loop(steps: int, rows: int, cols: int) -> dict:
    """`steps` SGD steps of loss_fn with tjit forward, backward and update; the last step's
    kernels measured and checked against the plan (explain of both functions, made first)."""
    x, w, b, target = _inputs(rows, cols, weights=1, biases=1, target=True)
    x = x.detach()
    loss_c, sgd_c = tjit.compile(loss_fn), tjit.compile(sgd)
    forward = tjit.explain(loss_c, x, w, b, target)
    with torch.no_grad():
        update = tjit.explain(sgd_c, w, b, torch.zeros_like(w), torch.zeros_like(b), 0.1)
    planned = (len(forward.kernels), len(forward.backward.kernels), len(update.kernels))
    one = torch.ones((), device=x.device)  # loss.backward() would make it inside the measured step
    traces = tjit.counters.traces
    losses, rss = [], {}
    for k in range(steps):
        measuring = k == steps - 1
        with TjitKernels(bytes=False) if measuring else contextlib.nullcontext() as measured:
            loss = loss_c(x, w, b, target)
            loss.backward(one)
            with torch.no_grad():
                sgd_c(w, b, w.grad, b.grad, 0.1)
        w.grad = b.grad = None
        losses.append(loss.item())
        del loss
        if k in (steps // 5, steps - 1):
            gc.collect()
            rss[k] = resource_rss()
        if k % max(steps // 10, 1) == 0:
            progress(f"  training step {k}/{steps}: loss {losses[-1]:.4f}")
    gc.collect()
    stats = tjit.memory.stats()
    first, last = sorted(rss)
    return {"steps": steps, "shape": f"{rows}x{cols}", "first_loss": losses[0], "last_loss": losses[-1],
            "tape_bytes_after": stats["tape_bytes"], "tape_blocks_after": stats["tape_blocks"],
            "rss_growth_mb": (rss[last] - rss[first]) / MB, "rss_window": f"steps {first}..{last}",
            "new_traces": tjit.counters.traces - traces, "planned_per_step": list(planned),
            "kernels_last_step": measured.total, "aten_kernels_last_step": measured.aten.kernels,
            "failures": check_launches(f"training loop, step {steps - 1} (forward, backward, update)", sum(planned),
                                       measured)}


def resource_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- report ------------------------------------------------------------------------------------------
def print_rows(rows: list[Row]) -> None:
    headers = ["workload", "shape", "fwd k", "bwd k", "eager fwd/bwd", "MB moved", "measured MB", "MB min", "ratio",
               "saved MB", "eager saved", "peak MB", "eager peak", "ok", "saved for backward"]
    table = [[r.name, r.shape, r.fwd_kernels, r.bwd_kernels, f"{len(r.eager_fwd_kernels)}/{len(r.eager_bwd_kernels)}",
              f"{r.mb_moved:.3f}", "-" if r.mb_issued is None else f"{r.mb_distinct:.3f}..{r.mb_issued:.3f}",
              f"{r.mb_min:.3f}", f"{r.mb_moved / r.mb_min:.2f}", f"{r.saved_mb:.3f}",
              f"{r.eager_saved_mb:.3f}", f"{r.peak_mb:.3f}", f"{r.eager_peak_mb:.3f}", "yes" if r.matches else "NO",
              r.saved] for r in rows]
    print(fmt_table(headers, table, "ll" + "r" * 12 + "l"))
    print("  fwd k / bwd k: kernels tjit's forward and backward ran in a step, measured (Triton's launches + aten kernels "
          "outside them), checked against tjit.explain and tjit.counters;\n  eager fwd/bwd: kernels eager ran, "
          "measured (aten ops dispatched to a backend kernel; views and allocations excluded);\n"
          "  MB moved: explain's kernel reads + writes, forward + backward; measured: distinct..issued bytes of the "
          "kernels' loads and stores (interpreter; explain is checked to lie between);\n"
          "  MB min: inputs + output + incoming gradient + input gradients, each once; saved: bytes autograd was handed "
          "for backward (tjit: inputs/outputs by reference + tape), measured;\n  peak: most bytes allocated in a step "
          "alive at once (tjit: + its slabs); ok: output and gradients match eager's")
    if any(r.times_ms for r in rows):
        print("\ntimings (ms, do_bench median of one step):")
        labels = list(rows[0].times_ms)
        print(fmt_table(["workload"] + labels, [[r.name] + [f"{r.times_ms[k]:.4f}" for k in labels] for r in rows]))
    else:
        print("\ntimings: no CUDA device here, so no kernel timings (the kernels ran in Triton's interpreter)")


def print_targets(rows: list[Row], loop: dict) -> None:
    print("\n== targets ==")
    for r in rows:
        if r.name in ("layer_norm", "rms_norm", "softmax", "cross_entropy"):
            print(f"  {r.name}: backward in {r.bwd_kernels} kernel(s) (target <= 2): "
                  f"{'met' if r.bwd_kernels <= 2 else 'MISSED'}")
    worse = [r.name for r in rows if r.saved_mb > r.eager_saved_mb + 1e-9]
    print(f"  saved bytes <= eager's for every workload: {'met' if not worse else 'MISSED for ' + ', '.join(worse)}")
    print(f"  training loop, {loop['steps']} steps ({loop['shape']}): loss {loop['first_loss']:.4f} -> "
          f"{loop['last_loss']:.4f}; tape bytes after: {loop['tape_bytes_after']}; resident memory growth "
          f"{loop['rss_growth_mb']:+.2f} MB over {loop['rss_window']}; kernels in the last step: "
          f"{loop['kernels_last_step']} measured (planned forward, backward, update: {loop['planned_per_step']}); "
          f"traces during the loop: {loop['new_traces']}")
    extra = [f"{r.name}: tjit ran {len(r.tjit_aten_kernels)} aten kernel(s) beside its Triton kernels: "
             f"{', '.join(r.tjit_aten_kernels)}" for r in rows if r.tjit_aten_kernels]
    if loop["aten_kernels_last_step"]:
        extra.append(f"training loop: tjit ran aten kernel(s) beside its Triton kernels in the last step: "
                     f"{', '.join(loop['aten_kernels_last_step'])}")
    if extra:
        print("\n".join(f"  note: {e}" for e in extra))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes and a short loop")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--only", help="comma-separated workload names")
    parser.add_argument("--steps", type=int, help="training loop steps (default 1000, 200 with --quick)")
    args = parser.parse_args()
    rows_cols = (4, 1024) if args.quick else (64, 2048)
    if HAS_CUDA:
        rows_cols = (4096, 4096)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for w in WORKLOADS:
        if only and w.name not in only:
            continue
        progress(f"{w.name} {rows_cols[0]}x{rows_cols[1]} ...")
        start = time.perf_counter()
        row = measure(w, *rows_cols)
        rows.append(row)
        progress(f"  done in {time.perf_counter() - start:.1f} s" +
                 (f": {len(row.failures)} check(s) failed" if row.failures else ""))
    steps = args.steps or (200 if args.quick else 1000)
    progress(f"training loop: {steps} steps ...")
    loop = training_loop(steps, 8, 16)
    print_rows(rows)
    print_targets(rows, loop)
    failures = [f for r in rows for f in r.failures] + loop["failures"]
    print_failures(failures)
    if args.json:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "training_loop": loop}, indent=2))
        progress(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

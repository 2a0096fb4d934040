#!/usr/bin/env python
"""Whole models: tjit against Inductor (Triton for CPU tensors) on the zoo of tests/zoo.py.

    python bench/models.py [--models a,b] [--quick] [--cold] [--warm-start] [--batch N] [--layers N]
                           [--json PATH] [--plot PATH]

Per model (tests/zoo.py's ZOO, same weights and inputs for every compiler) and per compiler:
`torch.compile(..., backend=...)` with tjit's Dynamo backend (tjit_backend) and Inductor's (compile_fx, what
backend="inductor" runs), each compiled graph wrapped so the counters can run inside it, with
`torch._inductor.config.cpu_backend = "triton"`. Without CUDA both run their Triton kernels in
Triton's interpreter (TRITON_INTERPRET=1, which tjit sets before triton is imported).

What runs:
  * eval forward: `compiled(x)` under torch.no_grad(), model.eval();
  * training step: model.train(), `loss = compiled(x, target)` where the compiled module is the
    model followed by its loss (F.cross_entropy, the zoo's loss with a fixed target), then
    `loss.backward()`; gradients are set to None between steps; no optimizer step (it is outside
    the compiled region and the same eager ops for both).

What is counted, the same way for both compilers (bench/measure.py's instruments), over one call
after the first two (steady state):
  * launches: Triton kernel launches, counted inside Triton (the interpreter's
    GridExecutor.__call__ is wrapped), whoever launched them;
  * aten: the aten ops dispatched outside those launches that run a kernel (a TorchDispatchMode,
    measure.runs_kernel: views, allocations and aliases excluded). For tjit these are its library
    calls (mm, convolution, ...) and the runtime's own ops (zeroing a gradient); for Inductor its
    extern kernels (extern_kernels.mm, convolution, ...) and fallbacks. In a training step both
    also include autograd's own eager ops (the seed gradient of loss.backward()), identical for
    both;
  * kernels = launches + aten (the column the targets use); tjit's lib column is
    tjit.counters.library_calls over the same call;
  * bytes: what the launches' masked loads and stores moved, measured in the interpreter
    (distinct addresses read + written, i.e. traffic with a perfect cache; "issued" bytes, every
    active lane's access, are in the JSON). Bytes of aten ops outside launches are not included.
    Inductor's torch._inductor.metrics.num_bytes_accessed stays 0 on this path, so it is not used.
Compile time of the first call (eval: the first forward; train: the first forward+backward, both
graphs compiled), "without the kernels' run" as issue 13 states it: the seconds each compiler
spends compiling during that call, as it times itself: Dynamo's frame compiles
(`_compile.compile_inner` in torch._dynamo.utils.compilation_time_metrics: capture, and the
backend's compile where it compiles inside it, all of Inductor's forward with AOTAutograd's joint
trace), AOTAutograd's lazy backward compile (`backward._backward_impl`), and tjit's
counters.compile_seconds (tjit compiles a Dynamo graph at its first run and its backward at the
first backward: tracing, planning, lowering, loading kernels). Also shown: the wall time of the
first call minus the median of three later calls ("first - steady"), each call timed from a
collected heap (gc.collect() first); it holds everything a first call costs but swings by seconds
with Inductor's slow steady calls through the interpreter. Both in this process after a warm-up
compile of a small function by each backend (imports and one-time set-up paid: "warm"). With
--cold, each (model, compiler) is also run in a fresh subprocess that imported only torch, tjit and
the zoo, and the same is taken there ("cold": includes Dynamo's and the compiler's lazy imports).
Inductor's on-disk caches point at a fresh temporary directory per process, so nothing is reused
from an earlier run; it compiles in-process (compile_threads=1). tjit's disk cache is off
likewise. With --warm-start, the same is taken in the second of two fresh processes that share one
cache directory: each compiler finds what the first compiled (Inductor's FX graph and AOTAutograd
caches; tjit's disk cache, runtime/disk_cache.py).

Peak memory of a training step (forward + loss + backward), eager, tjit and Inductor: the peak of
the bytes allocated during the step and alive at once, as the allocator counts them
(tjit.memory.measure_peak: torch's profiler's record of every CPU allocation and release, whoever
makes it: tjit's runtime, Inductor's empty_strided_cpu, autograd, the library calls), plus for tjit
the arena its compiled graphs' slabs share between calls (tjit.memory.stats()["in_use_bytes"],
after the eval graphs are gone). Parameters and inputs, alive before the step, are not counted.
tjit.explain(...).peak_memory predicts the same from the plan (tests/test_peak_memory.py).

Correctness is checked too (max abs difference to eager of the eval output, the loss and every
gradient of the first training step); a compiler that fails on a model has its error in the row.

Inductor through Triton's interpreter needs two shims, applied only in this script: torch asks the
active Triton driver for a backend hash (there is none without a GPU: the hash is made from
triton_key and "interpreter"), and Inductor's kernels call libdevice functions, which the
interpreter has none of (tanh, erf, rsqrt, ... are mapped to numpy / tl.math in the interpreter).

Targets (issue 13), printed, not enforced: kernels per training step <= Inductor's on every model;
first-call compile time <= 1/5 of Inductor's; peak training-step memory <= eager's.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))  # the zoo's definitions live with the tests
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A fresh Inductor cache per process (before torch._inductor reads its config), and tjit's disk
# cache off: the compile times and traces measured here are each process's own (bench/compile.py
# measures warm starts from the disk cache separately).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="tjit_bench_inductor_"))
os.environ.setdefault("TJIT_DISK_CACHE", "0")

import tjit  # noqa: E402  (before triton: chooses the interpreter without CUDA)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import measure  # noqa: E402
from measure import AtenKernels, TritonLaunches  # noqa: E402
from zoo import ZOO, TransformerConfig, WithLoss  # noqa: E402

COMPILERS = ("tjit", "inductor")
QUICK = ("resnet", "mixer")  # the fastest two in the interpreter (a transformer takes ~10 min)
MB = 2 ** 20


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- Inductor's Triton on CPU, in the interpreter ----------------------------------------------------

def setup_inductor() -> None:
    import hashlib
    import types

    import numpy as np
    import torch._inductor.config as ic
    import torch.utils._triton as ut
    import triton.language as tl
    from torch._inductor.runtime import triton_compat, triton_helpers
    from triton.runtime.interpreter import TensorHandle

    ic.cpu_backend = "triton"
    ic.compile_threads = 1

    def backend_hash():
        from torch._inductor.runtime.triton_compat import triton_key
        return hashlib.sha256(f"{triton_key()}-interpreter".encode()).hexdigest().upper()
    ut.triton_hash_with_backend = backend_hash

    numpy_fns = {"tanh": np.tanh, "log1p": np.log1p, "expm1": np.expm1, "isnan": np.isnan, "isinf": np.isinf,
                 "signbit": np.signbit, "nearbyint": np.rint, "round": np.rint, "trunc": np.trunc, "pow": np.power,
                 "atan": np.arctan, "atan2": np.arctan2, "asin": np.arcsin, "acos": np.arccos, "sinh": np.sinh,
                 "cosh": np.cosh, "tan": np.tan, "log10": np.log10, "fmod": np.fmod, "copysign": np.copysign,
                 "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda a: 1 / np.sqrt(a)}

    def numpy_fn(name, f):
        def fn(*args, _semantic=None, **kwargs):
            first = next(a for a in args if isinstance(a, tl.tensor))
            dt = first.handle.data.dtype
            data = f(*[a.handle.data if isinstance(a, tl.tensor) else np.asarray(a, dtype=dt) for a in args])
            if data.dtype == np.bool_:
                return tl.tensor(TensorHandle(data, tl.int1), first.type.with_element_ty(tl.int1)
                                 if hasattr(first.type, "with_element_ty") else tl.int1)
            return tl.tensor(TensorHandle(data.astype(dt), first.handle.dtype), first.type)
        fn.__name__ = name
        return fn

    class Libdevice(types.ModuleType):
        def __getattr__(self, name):
            if name in numpy_fns:
                return numpy_fn(name, numpy_fns[name])
            if hasattr(tl.math, name):  # looked up per call: the interpreter patches tl.math
                return getattr(tl.math, name)
            raise AttributeError(f"libdevice.{name} has no equivalent in Triton's interpreter (bench shim)")

    triton_helpers.libdevice = triton_compat.libdevice = Libdevice("libdevice_for_the_interpreter")


# -- measuring ----------------------------------------------------------------------------------------


_MODES: list = []  # dispatch modes to enter inside compiled calls (see backend)


def backend(name: str):
    """The compiler's Dynamo backend, its compiled graphs wrapped so a dispatch mode can be
    entered inside them: Dynamo runs a frame eagerly when a dispatch mode is already active, so a
    mode entered around the compiled call would measure eager instead."""
    if name == "tjit":
        from tjit.runtime.dynamo_backend import tjit_backend as compile_graph
    else:
        from torch._inductor.compile_fx import compile_fx as compile_graph

    def compile_wrapped(gm, example_inputs):
        fn = compile_graph(gm, example_inputs)

        def run(*args):
            if not _MODES:
                return fn(*args)
            with contextlib.ExitStack() as stack:
                for mode in _MODES:
                    stack.enter_context(mode)
                return fn(*args)
        return run
    return compile_wrapped


@contextlib.contextmanager
def inside_compiled(*modes):
    """Enter modes inside compiled graphs (backend) and around everything else (eager code,
    autograd's backward)."""
    _MODES[:] = modes
    try:
        yield
    finally:
        _MODES.clear()


def train_step_measured(fn, params, x, target, modes):
    """train_step with modes active inside the compiled forward and around the backward."""
    for p in params:
        p.grad = None
    with inside_compiled(*modes):
        loss = fn(x, target)
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        loss.backward()
    return loss


def target_for(spec, x, model) -> torch.Tensor:
    with torch.no_grad():
        shape = model.eval()(x).shape
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, shape[-1], shape[:-1], generator=g)


def train_step(fn, params, x, target):
    for p in params:
        p.grad = None
    loss = fn(x, target)
    loss.backward()
    return loss


def peak_step_bytes(fn, params, x, target) -> int:
    """The allocator's peak over one training step (see the module text)."""
    for p in params:
        p.grad = None
    gc.collect()
    with tjit.memory.measure_peak(x.device) as meter:
        train_step(fn, params, x, target)
    for p in params:
        p.grad = None
    return meter.peak


def counted(call, record_bytes: bool = True) -> dict:
    """Kernels, library calls and bytes of one call (see the module text); call(modes) enters
    the modes where they see what runs (inside_compiled, train_step_measured). Recording bytes
    runs every access through the meter (minutes on the larger models): record_bytes=False
    counts kernels only."""
    lib0 = tjit.counters.library_calls
    aten = AtenKernels()
    with TritonLaunches(bytes=record_bytes) as launches:
        call([aten])
    row = {"launches": launches.count, "aten": len(aten.kernels), "kernels": launches.count + len(aten.kernels),
           "aten_ops": dict(sorted(collections.Counter(aten.kernels).items())),
           "tjit_library_calls": tjit.counters.library_calls - lib0}
    if record_bytes:
        r_iss, w_iss, r_dis, w_dis = launches.bytes()
        row.update(bytes_distinct=r_dis + w_dis, bytes_issued=r_iss + w_iss, bytes_written=w_dis)
    return row


def timed(call) -> float:
    gc.collect()
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def compiler_seconds() -> float:
    """Seconds Dynamo and the compilers have spent compiling in this process, as they time it
    themselves (see the module text)."""
    from torch._dynamo.utils import compilation_time_metrics as timed_by_torch
    return sum(timed_by_torch.get("_compile.compile_inner", ())) + \
        sum(timed_by_torch.get("backward._backward_impl", ())) + tjit.counters.compile_seconds


def compile_seconds(call) -> dict:
    """compiler_s: the compilers' own time in the first call; compile_s: the first call's wall
    time minus a steady call's (the median of three)."""
    before = compiler_seconds()
    first = timed(call)
    compiler = compiler_seconds() - before
    steady = statistics.median(timed(call) for _ in range(3))
    return {"first_s": first, "steady_s": steady, "compile_s": max(first - steady, 0.0), "compiler_s": compiler}


def maxdiff(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def build(spec, layers: Optional[int] = None) -> nn.Module:
    """The zoo's model; with `layers`, a transformer of the zoo (GPT-2, Llama, BERT) with that
    many layers (its other sizes as the zoo's): how compile time and kernels grow with depth."""
    if layers is None:
        return spec.build()
    config = inspect.signature(spec.build).parameters.get("c")
    if config is None or not isinstance(config.default, TransformerConfig):
        raise SystemExit(f"--layers: {spec.name} is not one of the zoo's transformers (gpt2, llama, bert)")
    return spec.build(dataclasses.replace(config.default, layers=layers))


def run_one(name: str, compiler: str, memory: bool = True, timing_only: bool = False,
            record_bytes: bool = True, batch: int = 2, layers: Optional[int] = None) -> dict:
    """Everything measured for one model and one compiler; errors recorded, not raised."""
    import torch._dynamo
    torch._dynamo.reset()
    spec = ZOO[name]
    torch.manual_seed(0)
    model = build(spec, layers)
    eager = copy.deepcopy(model)
    x = spec.inputs(torch.Generator().manual_seed(1), batch)
    target = target_for(spec, x, eager)
    row: dict = {"model": name, "compiler": compiler}
    stage = "eval"
    try:
        model.eval(), eager.eval()
        compiled = torch.compile(model, backend=backend(compiler))

        def forward():
            with torch.no_grad():
                return compiled(x)
        row["eval_time"] = compile_seconds(forward)
        if timing_only:
            model.train()
            wrapped = torch.compile(WithLoss(model), backend=backend(compiler))
            params = list(model.parameters())
            row["train_time"] = compile_seconds(lambda: train_step(wrapped, params, x, target))
            return row
        with torch.no_grad():
            row["eval_maxdiff"] = maxdiff(forward(), eager(x))
        def forward_measured(modes):
            with inside_compiled(*modes), torch.no_grad():
                return compiled(x)
        row["eval"] = counted(forward_measured, record_bytes)

        stage = "train"
        del compiled  # its graphs' slabs are not the training step's
        torch._dynamo.reset()
        gc.collect()
        tjit.memory.release()  # (the arena is allocated again at the size the training graphs need)
        model.train(), eager.train()
        wrapped = torch.compile(WithLoss(model), backend=backend(compiler))
        eager_loss_fn = WithLoss(eager)
        params, eager_params = list(model.parameters()), list(eager.parameters())
        row["train_time"] = compile_seconds(lambda: train_step(wrapped, params, x, target))
        # against eager (weights unchanged: no optimizer step; train mode normalises by batch statistics)
        loss = train_step(wrapped, params, x, target)
        want = train_step(eager_loss_fn, eager_params, x, target)
        row["train_maxdiff"] = max([maxdiff(loss, want)] + [maxdiff(p.grad, q.grad) for p, q in zip(params, eager_params)
                                                             if p.grad is not None and q.grad is not None])
        row["train_missing_grads"] = sum((p.grad is None) != (q.grad is None) for p, q in zip(params, eager_params))
        row["train"] = counted(lambda modes: train_step_measured(wrapped, params, x, target, modes), record_bytes)
        if memory:
            stage = "memory"
            row["eager_peak_bytes"] = peak_step_bytes(eager_loss_fn, eager_params, x, target)
            row["peak_bytes"] = peak_step_bytes(wrapped, params, x, target)
            if compiler == "tjit":
                slabs = tjit.memory.stats()["in_use_bytes"]  # the arena the step's graphs share
                row["slab_bytes"] = slabs
                row["peak_bytes"] += slabs
    except Exception as e:  # noqa: BLE001  (recorded in the row)
        row["error"] = f"{stage}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        row["traceback"] = traceback.format_exc()[-3000:]
    return row


def warm_up() -> None:
    """Pay imports and one-time set-up of both backends before timing anything."""
    import torch._dynamo
    for name in COMPILERS:
        torch._dynamo.reset()
        lin = nn.Linear(4, 4)
        f = torch.compile(lambda a: F.gelu(lin(a)).sum(), backend=globals()["backend"](name))
        f(torch.randn(3, 4, requires_grad=True)).backward()
    torch._dynamo.reset()


def cold(name: str, compiler: str, cache_dir: Optional[str] = None) -> dict:
    """The first-call compile times in a fresh process (see the module text); with
    cache_dir, both compilers' caches on disk there (Inductor's, tjit's)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_cold", f"{name}:{compiler}"]
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if cache_dir is not None:
        env.update(TORCHINDUCTOR_CACHE_DIR=cache_dir, TJIT_CACHE_DIR=cache_dir, TJIT_DISK_CACHE="1")
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            found = json.loads(line)
            found["process_wall_s"] = wall
            return found
    return {"error": f"cold subprocess exited {p.returncode}: {p.stderr.strip().splitlines()[-1:] }"}


def warm_start(name: str, compiler: str) -> dict:
    """The first-call compile times in a fresh process whose compiler finds on disk what an
    earlier process compiled (Inductor's FX graph and AOTAutograd caches, tjit's disk cache)."""
    with tempfile.TemporaryDirectory(prefix="tjit_bench_warm_") as directory:
        cold(name, compiler, directory)
        return cold(name, compiler, directory)


def cold_main(spec: str) -> None:
    name, compiler = spec.split(":")
    setup_inductor()
    row = run_one(name, compiler, memory=False, timing_only=True)
    print(json.dumps({k: row.get(k) for k in ("eval_time", "train_time", "error")}))


# -- report -------------------------------------------------------------------------------------------

def cell(row, *path, fmt="{}"):
    v = row
    for p in path:
        if not isinstance(v, dict) or v.get(p) is None:
            return "err" if "error" in row and path[0] not in row else "n/a"
        v = v[p]
    return fmt.format(v)


def print_table(results: dict, with_cold: bool) -> None:
    cols = [("eval kernels", ("eval", "kernels"), "{}"), ("train kernels", ("train", "kernels"), "{}"),
            ("(launch+aten)", None, None), ("tjit lib", ("train", "tjit_library_calls"), "{}"),
            ("train MB moved", ("train", "bytes_distinct"), None),
            ("eval compile s", ("eval_time", "compiler_s"), "{:.2f}"),
            ("train compile s", ("train_time", "compiler_s"), "{:.2f}"),
            ("train first-steady s", ("train_time", "compile_s"), "{:.1f}")]
    if with_cold:
        cols += [("cold train s", ("cold", "train_time", "compiler_s"), "{:.2f}")]
    if any("warm_start" in r for per in results.values() for r in per.values()):
        cols += [("warm-start train s", ("warm_start", "train_time", "compiler_s"), "{:.2f}")]
    header = ["model"]
    for title, _, _ in cols:
        header += [f"{title} tjit", "ind"] if title != "tjit lib" else ["tjit lib (train)"]
    header += ["peak MB eager", "tjit", "ind", "ok"]
    rows = []
    for name, per in results.items():
        t, i = per.get("tjit", {}), per.get("inductor", {})
        line = [name]
        for title, path, fmt in cols:
            if title == "tjit lib":
                line.append(cell(t, *path))
                continue
            for r in (t, i):
                if title == "(launch+aten)":
                    line.append(f"{cell(r, 'train', 'launches')}+{cell(r, 'train', 'aten')}")
                elif title == "train MB moved":
                    b = r.get("train", {}).get("bytes_distinct") if isinstance(r.get("train"), dict) else None
                    line.append(f"{b / MB:.2f}" if b is not None else ("err" if "error" in r else "n/a"))
                else:
                    line.append(cell(r, *path, fmt=fmt))
        line.append(f"{t['eager_peak_bytes'] / MB:.3f}" if t.get("eager_peak_bytes") else "n/a")
        line.append(f"{t['peak_bytes'] / MB:.3f}" if t.get("peak_bytes") else "n/a")
        line.append(f"{i['peak_bytes'] / MB:.3f}" if i.get("peak_bytes") else "n/a")
        oks = []
        for comp, r in (("tjit", t), ("ind", i)):
            if "error" in r:
                oks.append(f"{comp} ERR")
            elif max(r.get("eval_maxdiff", 0), r.get("train_maxdiff", 0)) > 1e-3 or r.get("train_missing_grads"):
                oks.append(f"{comp} DIFF")
        line.append(",".join(oks) or "yes")
        rows.append(line)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for line in rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    print("\nkernels = Triton launches (counted in Triton) + aten ops run outside them (library / extern calls and "
          "autograd's eager ops), one steady-state call; train = forward+loss+backward.\nMB moved: distinct bytes the "
          "Triton launches loaded+stored (interpreter, measured). compile s: the compilers' own time in the first call "
          "(Dynamo + AOTAutograd + Inductor, Dynamo + tjit, as each times itself); first-steady: the first call's wall time "
          "minus the median of 3 steady calls (warm process). peak: the allocator's peak over a train step (tjit.memory.measure_peak) + tjit's arena.")
    for name, per in results.items():
        for comp, r in per.items():
            if "error" in r:
                print(f"  {name}/{comp} error: {r['error']}")


def print_targets(results: dict) -> None:
    print("\n== targets (issue 13) ==")
    for name, per in results.items():
        t, i = per.get("tjit", {}), per.get("inductor", {})
        notes = []
        try:
            tk, ik = t["train"]["kernels"], i["train"]["kernels"]
            notes.append(f"train kernels {tk} vs {ik}: {'held' if tk <= ik else 'NOT held'}")
        except (KeyError, TypeError):
            notes.append("train kernels: n/a (" + (t.get("error") or i.get("error") or "missing") + ")")
        try:
            tc, ic_ = t["train_time"]["compiler_s"], i["train_time"]["compiler_s"]
            notes.append(f"compile {tc:.2f}s vs {ic_:.2f}s (ratio {tc / ic_:.2f}, target <= 0.2): "
                         f"{'held' if tc <= ic_ / 5 else 'NOT held'}")
        except (KeyError, TypeError, ZeroDivisionError):
            notes.append("compile: n/a")
        if t.get("peak_bytes") and t.get("eager_peak_bytes"):
            notes.append(f"peak {t['peak_bytes'] / MB:.3f} vs eager {t['eager_peak_bytes'] / MB:.3f} MB: "
                         f"{'held' if t['peak_bytes'] <= t['eager_peak_bytes'] else 'NOT held'}")
        else:
            notes.append("peak: n/a")
        print(f"  {name}: " + "; ".join(notes))


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed (pip install -e '.[plot]'); no plot written to {path}")
        return
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(names) * 2), 4))
    for ax, (key, sub, title) in zip(axes, (("train", "kernels", "kernels per training step"),
                                           ("train_time", "compiler_s", "first-call compile time, train step (s)"))):
        for k, comp in enumerate(COMPILERS):
            vals = [(results[n].get(comp, {}).get(key) or {}).get(sub) or 0 for n in names]
            ax.bar([j + (k - 0.5) * 0.4 for j in range(len(names))], vals, width=0.4, label=comp)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help=f"comma-separated, from {','.join(ZOO)}")
    ap.add_argument("--quick", action="store_true", help=f"only {','.join(QUICK)}")
    ap.add_argument("--cold", action="store_true", help="also time the first call in fresh processes (slow)")
    ap.add_argument("--warm-start", action="store_true", help="also time the first call in a fresh process "
                    "after another filled the compilers' caches on disk (slow)")
    ap.add_argument("--no-bytes", action="store_true", help="count kernels without recording the bytes they move "
                    "(much faster on the larger models)")
    ap.add_argument("--batch", type=int, default=2, help="inputs per batch (default 2: the parameters' memory "
                    "dominates a step's; at 16 its activations do)")
    ap.add_argument("--layers", type=int, help="the transformers (gpt2, llama, bert) with this many layers "
                    "(the zoo's have 2; not with --cold or --warm-start)")
    ap.add_argument("--compilers", default=",".join(COMPILERS), help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    ap.add_argument("--plot", metavar="PATH", help="bar chart of kernels per training step and compile time")
    ap.add_argument("--load", metavar="PATH[,PATH]", help="print (and plot) the results of earlier --json runs, "
                    "merged, instead of measuring")
    ap.add_argument("--_cold", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts._cold:
        cold_main(opts._cold)
        return 0
    if opts.load:
        results = {}
        for path in opts.load.split(","):
            for name, per in json.loads(Path(path).read_text())["results"].items():
                results.setdefault(name, {}).update(per)
        results = {n: results[n] for n in ZOO if n in results}
        report(results, opts)
        return 0
    names = opts.models.split(",") if opts.models else list(QUICK if opts.quick else ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; the zoo has {list(ZOO)}")
    if opts.layers is not None and (opts.cold or opts.warm_start):
        ap.error("--layers measures in this process only (not with --cold or --warm-start)")
    compilers = opts.compilers.split(",")
    setup_inductor()
    progress("warming up both backends ...")
    warm_up()
    results: dict = {}
    for name in names:
        results[name] = {}
        for comp in compilers:
            progress(f"{name} / {comp} ...")
            t = time.perf_counter()
            row = run_one(name, comp, record_bytes=not opts.no_bytes, batch=opts.batch, layers=opts.layers)
            if opts.cold:
                progress(f"{name} / {comp}: cold process ...")
                row["cold"] = cold(name, comp)
            if opts.warm_start:
                progress(f"{name} / {comp}: two processes over one cache directory ...")
                row["warm_start"] = warm_start(name, comp)
            results[name][comp] = row
            brief = ", ".join(f"{k} {cell(row, *path, fmt=f)}" for k, path, f in (
                ("eval kernels", ("eval", "kernels"), "{}"), ("train kernels", ("train", "kernels"), "{}"),
                ("train compile s", ("train_time", "compiler_s"), "{:.2f}"), ("peak B", ("peak_bytes",), "{}"),
                ("eager peak B", ("eager_peak_bytes",), "{}")))
            progress(f"{name} / {comp}: {time.perf_counter() - t:.0f}s: {brief}"
                     + (f"  ERROR {row['error']}" if "error" in row else ""))
            if opts.json:  # written as it goes: a long run interrupted keeps what it measured
                Path(opts.json).write_text(json.dumps({"results": results, "torch": torch.__version__,
                                                       "batch": opts.batch}, indent=1, default=str))
    report(results, opts)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"results": results, "torch": torch.__version__, "batch": opts.batch},
                                              indent=1, default=str))
        print(f"JSON written to {opts.json}")
    return 0


def report(results: dict, opts) -> None:
    with_cold = any("cold" in r for per in results.values() for r in per.values())
    print_table(results, with_cold)
    print_targets(results)
    if opts.plot:
        plot(results, opts.plot)


if __name__ == "__main__":
    sys.exit(main())

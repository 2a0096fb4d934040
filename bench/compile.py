#!/usr/bin/env python
"""Compiling once per shape class: traces, kernels and compile time over sizes and scalar
values, per-call host overhead; tjit beside torch.compile (Inductor emitting Triton for CPU
tensors, as in bench/models.py). Issue 15's benchmark.

    python bench/compile.py [--quick] [--functions softmax,layer_norm,...] [--json PATH]

Per function (FUNCTIONS) and compiler, in one process after a warm-up compile of another
function by each (imports and one-time set-up paid):
  * sizes: the function called at each row count of SIZES (the first 100; 1, sizes that are not multiples of
    any block, sizes above every block size): traces (tjit: its trace counter; Inductor: the
    graphs Dynamo hands its backend), kernel sources generated (tjit: distinct sources loaded;
    Inductor: torch._inductor.metrics.generated_kernel_count), tjit's kernel compiles (distinct
    source + constexprs + argument specialisations: one Triton build each on a GPU), and the
    compile time of the first call and of each new size (that call minus a steady call at the
    same size);
  * numbers: a Python float argument (a learning rate) given NUMBERS different values at one
    size: traces and kernel sources added; then the same argument given NUMBERS int values (a
    step count: tjit specialises an int's first value, and traces once more at its second);
  * overhead: the host time of one call with every Triton launch replaced by a no-op (tjit
    only: Executable._start patched; library calls still run), for the 1-kernel and the
    10-kernel function, called directly (tjit.compile) and through torch.compile(backend="tjit"),
    where Dynamo's guards run first;
  * cold: `import tjit` and the first call of each function (these and demo.py's) in a fresh
    process, twice over one empty cache directory: the first traces and stores each entry
    on disk (runtime/disk_cache.py), the second (a warm start) loads them.
Targets (issue 15): 16 sizes -> 1 trace, at most 3 mapping variants; 100 floats -> 0 retraces,
0 new kernels; compile time (warm process) <= 1/10 of Inductor's; warm start (fresh process,
disk cache filled) <= 50 ms per first call plus the kernels' run; per-call overhead <= 20 us
for a 1-kernel function.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import models  # noqa: E402  (Inductor's set-up for the interpreter; imports tjit before triton)
import tjit  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SIZES = [100, 1, 3, 7, 16, 31, 64, 128, 255, 500, 1000, 1024, 1500, 2048, 4097, 5000]
QUICK_SIZES = [100, 1, 7, 1024, 4097]
COLS = 256
NUMBERS = 100
OVERHEAD_CALLS = 2000


def softmax_scaled(x, w, lr: float):
    return torch.softmax(x * w, -1) * lr


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def cumsum_gate(x, w, b):
    return torch.cumsum(x, -1) * torch.sigmoid(x * w + b)


def ten_scans(x, w, b):
    """Ten scans along alternating axes: each needs the one before it whole (10 kernels)."""
    for k in range(10):
        x = torch.cumsum(x, k % 2) * w if k % 2 == 0 else torch.cumsum(x, k % 2) + b
    return x


FUNCTIONS = {"softmax_scaled": softmax_scaled, "layer_norm": layer_norm, "cumsum_gate": cumsum_gate}
# (ten_scans only for the overhead: Inductor's scans over these sizes take minutes in the interpreter)
OVERHEAD_FUNCTIONS = {"layer_norm": layer_norm, "ten_scans": ten_scans}


def arguments(name: str, rows: int, lr: float = 0.1, generator=None) -> tuple:
    g = generator or torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, COLS, generator=g), torch.randn(COLS, generator=g), torch.randn(COLS, generator=g)
    return (x, w, lr) if name == "softmax_scaled" else (x, w / 4, b)


# -- per compiler: counting what compiling costs -----------------------------------------------

class Tjit:
    """tjit.compile as a user calls it: a shape class traced with symbolic sizes at its second
    size (the first is traced with its own)."""
    name = "tjit"
    dynamic = None

    def compile(self, fn):
        return tjit.compile(fn, dynamic=self.dynamic)

    def counts(self) -> dict:
        c = tjit.counters
        return {"traces": c.traces, "specialised": c.specialised, "kernel_sources": c.kernels_generated,
                "kernel_compiles": c.kernel_compiles}


class TjitDynamic(Tjit):
    """tjit.compile(fn, dynamic=True): traced with symbolic sizes from the first call."""
    name = "tjit-dynamic"
    dynamic = True


class Inductor:
    name = "inductor"

    def __init__(self):
        from torch._inductor import metrics
        self.metrics, self.graphs = metrics, 0

    def compile(self, fn):
        from torch._inductor.compile_fx import compile_fx

        def backend(gm, example_inputs):
            self.graphs += 1
            return compile_fx(gm, example_inputs)
        torch._dynamo.reset()
        return torch.compile(fn, backend=backend)

    def counts(self) -> dict:
        return {"traces": self.graphs, "specialised": None, "kernel_sources": self.metrics.generated_kernel_count,
                "kernel_compiles": None}


def compile_seconds(fn, args) -> float:
    """A call that compiles minus a steady call on the same arguments."""
    return models.compile_seconds(lambda: fn(*args))["compile_s"]


def added(before: dict, after: dict) -> dict:
    return {k: None if after[k] is None else after[k] - before[k] for k in after}


def check(name: str, fn, args) -> float:
    """The largest difference from eager (compiled results must match it, to 1e-4 of the
    results' size: ten_scans' sums grow to 1e5, where float32 rounding is about 0.01)."""
    want, got = FUNCTIONS[name](*args), fn(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(float(want.abs().max()), 1.0))
    return float((got - want).abs().max())


def sizes_and_numbers(compiler, name: str, sizes: list[int]) -> dict:
    fn = compiler.compile(FUNCTIONS[name])
    before = compiler.counts()
    first = compile_seconds(fn, arguments(name, sizes[0]))
    new_size, maxdiff = [], check(name, fn, arguments(name, sizes[0]))
    for rows in sizes[1:]:
        new_size.append(compile_seconds(fn, arguments(name, rows)))
        maxdiff = max(maxdiff, check(name, fn, arguments(name, rows)))
    row = {"first_compile_s": first, "new_size_compile_s": new_size, "sizes": added(before, compiler.counts()),
           "maxdiff": maxdiff}
    if name == "softmax_scaled":
        before = compiler.counts()
        for k in range(NUMBERS):
            fn(*arguments(name, sizes[2], lr=0.001 * (k + 1)))
        row["numbers"] = added(before, compiler.counts())
        before = compiler.counts()
        for k in range(NUMBERS):
            fn(*arguments(name, sizes[2], lr=k + 1))
        row["ints"] = added(before, compiler.counts())
    return row


# -- per-call overhead --------------------------------------------------------------------------

def overhead_us(fn, args) -> float:
    """Host time of one call with Triton launches replaced by no-ops (best of 3 runs)."""
    from tjit.runtime import executor
    start = executor.Executable.__dict__["_start"]  # (the staticmethod itself)

    def no_launch(launch, launch_args):
        tjit.counters.launches += 1
    fn(*args)  # compiled (and launched once for real)
    executor.Executable._start = staticmethod(no_launch)
    try:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(OVERHEAD_CALLS):
                fn(*args)
            best = min(best, (time.perf_counter() - t) / OVERHEAD_CALLS)
    finally:
        executor.Executable._start = start
    return best * 1e6


def overheads() -> dict:
    rows = {}
    for name, f in OVERHEAD_FUNCTIONS.items():
        args = arguments(name, 64)
        direct = tjit.compile(f)
        before = tjit.counters.launches
        direct(*args)
        launches = tjit.counters.launches - before
        torch._dynamo.reset()
        dynamo = torch.compile(f, backend="tjit")
        rows[name] = {"launches": launches, "tjit_compile_us": overhead_us(direct, args),
                      "torch_compile_tjit_us": overhead_us(dynamo, args)}
        models.progress(f"overhead {name}: {rows[name]}")
    return rows


# -- cold processes ----------------------------------------------------------------------------

COLD = """
import time, json, sys
t = time.perf_counter()
import tjit, torch
imported = time.perf_counter() - t
sys.path[:0] = [{here!r}, {root!r}]
import compile as bench, demo
cases = [(name, fn, lambda name=name: bench.arguments(name, 100)) for name, fn in bench.FUNCTIONS.items()]
cases += [(fn.__name__, fn, make) for _, fn, make in demo.EXAMPLES]
firsts = {{}}
for name, fn, make in cases:
    compiled, args = tjit.compile(fn), make()
    before = tjit.counters.snapshot()
    t = time.perf_counter(); call = compiled.prepare(demo.clone_args(args), {{}}); prepared = time.perf_counter() - t
    compiled.run(call); first = time.perf_counter() - t
    again = demo.clone_args(args)
    t = time.perf_counter(); compiled(*again); steady = time.perf_counter() - t
    after = tjit.counters.snapshot()
    firsts[name] = {{"compile_s": first - steady, "prepare_s": prepared, "traces": after["traces"] - before["traces"],
                    "disk_loads": after["disk_loads"] - before["disk_loads"]}}
print(json.dumps({{"import_s": imported, "first_calls": firsts}}))
"""
WARM_START_TARGET_S = 0.050


def cold() -> list[dict]:
    """Two fresh processes over one empty cache directory: the first traces every function and
    stores its entry on disk, the second (a warm start) loads them."""
    runs = []
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "TJIT_CACHE_DIR": directory, "TJIT_DISK_CACHE": "1"}
        for label in ("cold (empty cache directory)", "warm start (disk cache filled)"):
            out = subprocess.run([sys.executable, "-c", COLD.format(here=str(HERE), root=str(HERE.parent))],
                                 capture_output=True, text=True, check=True, env=env).stdout
            runs.append({"label": label, **json.loads(out.strip().splitlines()[-1])})
            models.progress(f"{label}: import {runs[-1]['import_s']:.2f} s")
    return runs


# -- report ------------------------------------------------------------------------------------

def print_report(results: dict) -> None:
    print(f"\nsizes: {results['sizes']} rows x {COLS} (float32)")
    print(f"{'function':>15} {'compiler':>12} {'traces':>7} {'specialised':>12} {'sources':>8} {'compiles':>9} "
          f"{'first s':>8} {'new size s (mean)':>18} {'floats: traces':>15} {'new sources':>12} "
          f"{'ints: traces':>13} {'new sources':>12}")
    for name, per in results["functions"].items():
        for compiler, row in per.items():
            s, n, i = row["sizes"], row.get("numbers", {}), row.get("ints", {})
            mean = sum(row["new_size_compile_s"]) / max(len(row["new_size_compile_s"]), 1)
            print(f"{name:>15} {compiler:>12} {s['traces']:>7} {_or_na(s['specialised']):>12} "
                  f"{s['kernel_sources']:>8} {_or_na(s['kernel_compiles']):>9} "
                  f"{row['first_compile_s']:>8.3f} {mean:>18.3f} {n.get('traces', ''):>15} "
                  f"{n.get('kernel_sources', ''):>12} {i.get('traces', ''):>13} {i.get('kernel_sources', ''):>12}")
    print("\nper-call host overhead (Triton launches replaced by no-ops), microseconds:")
    for name, row in results["overhead"].items():
        print(f"  {name} ({row['launches']} launches): tjit.compile {row['tjit_compile_us']:.0f} us, "
              f"torch.compile(backend='tjit') {row['torch_compile_tjit_us']:.0f} us")
    for run in results.get("cold", []):
        print(f"\nfresh process, {run['label']}: import tjit {run['import_s']:.2f} s; per function, the first "
              "call minus a steady call (ms), of which finding or compiling its entry (prepare), traces, disk loads:")
        for name, row in run["first_calls"].items():
            print(f"  {name:>22} {row['compile_s'] * 1e3:8.1f} {row['prepare_s'] * 1e3:8.1f} {row['traces']:>3} "
                  f"{row['disk_loads']:>3}")
    print("\n== targets (issue 15) ==")
    classes = len({min(rows, 2) for rows in results["sizes"]})  # (torch specialises size 1: a class of its own)
    for name, per in results["functions"].items():
        t, i = per.get("tjit"), per.get("inductor")
        for label, row in (("", t), (" (dynamic=True)", per.get("tjit-dynamic"))):
            if row:
                traces = row["sizes"]["traces"]
                print(f"  {name}{label}: {len(results['sizes'])} sizes in {classes} shape classes -> {traces} traces "
                      f"(target 1 per class: {'held' if traces <= classes else 'NOT held'})")
        if t and i and i["first_compile_s"] > 0:
            ratio = t["first_compile_s"] / i["first_compile_s"]
            print(f"  {name}: first call's compile {ratio:.2f} of Inductor's "
                  f"(target <= 0.1: {'held' if ratio <= 0.1 else 'NOT held'})")
    if "softmax_scaled" in results["functions"] and "tjit" in results["functions"]["softmax_scaled"]:
        n = results["functions"]["softmax_scaled"]["tjit"]["numbers"]
        print(f"  {NUMBERS} learning rates: {n['traces']} traces, {n['kernel_sources']} new kernel sources "
              f"(target 0, 0: {'held' if n['traces'] == n['kernel_sources'] == 0 else 'NOT held'})")
        n = results["functions"]["softmax_scaled"]["tjit"]["ints"]
        print(f"  {NUMBERS} int values of the same argument: {n['traces']} traces (the first value, then the "
              f"second as a runtime number), {n['kernel_sources']} new kernel sources")
    if results.get("cold"):
        warm = results["cold"][-1]["first_calls"]
        worst = max(warm, key=lambda name: warm[name]["prepare_s"])
        traced = sum(row["traces"] for row in warm.values())
        print(f"  warm start (fresh process, disk cache filled): {traced} traces; finding an entry at most "
              f"{warm[worst]['prepare_s'] * 1e3:.1f} ms ({worst}) (target <= {WARM_START_TARGET_S * 1e3:.0f} ms "
              f"plus the kernels' run: {'held' if warm[worst]['prepare_s'] <= WARM_START_TARGET_S else 'NOT held'})")
    for name, row in results["overhead"].items():
        if row["launches"] == 1:
            print(f"  overhead of a 1-kernel function: {row['tjit_compile_us']:.0f} us "
                  f"(target <= 20: {'held' if row['tjit_compile_us'] <= 20 else 'NOT held'})")


def _or_na(value) -> str:
    return "n/a" if value is None else str(value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} only, no cold processes")
    ap.add_argument("--functions", default=",".join(FUNCTIONS))
    ap.add_argument("--compilers", default="tjit,tjit-dynamic,inductor")
    ap.add_argument("--json", help="write the results here")
    opts = ap.parse_args()
    models.setup_inductor()
    models.warm_up()
    sizes = QUICK_SIZES if opts.quick else SIZES
    compilers = {"tjit": Tjit, "tjit-dynamic": TjitDynamic, "inductor": Inductor}
    results = {"sizes": sizes, "functions": {}}
    for name in opts.functions.split(","):
        for cname in opts.compilers.split(","):
            models.progress(f"{name} / {cname} ...")
            row = sizes_and_numbers(compilers[cname](), name, sizes)
            results["functions"].setdefault(name, {})[cname] = row
            models.progress(f"{name} / {cname}: {row['sizes']}, first {row['first_compile_s']:.2f} s")
    results["overhead"] = overheads()
    if not opts.quick:
        results["cold"] = cold()
    print_report(results)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))
        print(f"JSON written to {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Pointwise fusion benchmark: kernels, bytes moved, compile latency and caching, per workload.

    python bench/pointwise.py [--quick | --full] [--json PATH] [--only NAME[,NAME...]]

Counts are measured while the code runs (bench/measure.py says how), and tjit's plan is checked
against them. For every workload it prints
  * kernels per call: tjit's, measured over a call with the same shapes as the first (the
    Triton launches Triton itself saw, plus any aten op tjit's runtime ran outside them), and
    eager's, measured (the aten ops eager dispatches to a backend kernel, views and
    allocations excluded: AtenKernels);
  * bytes moved per call: tjit's by tjit.explain (each kernel's bytes_read + bytes_written),
    and without CUDA measured in the interpreter: distinct bytes the kernels' loads and
    stores touched, and bytes they issued; eager's, measured (every kernel's tensor inputs and
    outputs); the minimum (every distinct input read once, every output written once); and
    tjit (explain) / minimum;
  * compile time of the first call (CompiledEntry: trace = make_fx + conversion to tjit's IR,
    lower = passes + fusion + scheduling + Triton source emission, load = writing and importing
    the kernel modules), and per kernel the Triton sm_90 binary compile (compile_for_gpu, no GPU
    needed): wall time, registers per thread, spill bytes and vector/scalar global loads;
  * caching: tjit.counters over a second call with the same shapes (new traces / kernel
    compiles) and over a call with every dimension +16 (same 16-divisibility, so the same Triton
    specialisation: new kernels generated / kernel compiles);
  * with CUDA present, eager / torch.compile (inductor) / tjit times (triton.testing.do_bench,
    median).

and the compile-latency target (first call to a 20-op pointwise function under 0.5 s, excluding
Triton's binary compile), measured cold (the first compile of a fresh process, in a subprocess:
once as is, once with the torch._inductor import that make_fx does on its first call moved out)
and warm (a new function after others were compiled).

Checked, and the script exits 1 with the failures listed when one does not hold: every call's
outputs (and inputs written in place) match eager's (torch.testing.assert_close); the kernels
tjit.explain plans are the launches tjit.counters counted on the first call, the measured one
and the +16 one, and the launches Triton saw on the measured one; explain's bytes per kernel
lie between the measured distinct and issued bytes (interpreter only); a second call with the same shapes adds 0 traces and 0
kernel compiles; the +16 call adds 0 generated kernels and 0 kernel compiles. Targets (the
expected kernel count, minimum bytes, no spills, the latency) are reported, not enforced; so is
a difference between Explanation.eager_ops (tjit's estimate of eager's kernels) and the measured
count.

Without CUDA the kernels run on CPU through Triton's interpreter, whose cost is per program of
1024 elements, so small (--quick) sizes are used there unless --full is given.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A fresh Triton cache, so that the sm_90 compile times below are real compiles and not hits in
# ~/.triton/cache. Must be set before triton is imported (tjit imports it).
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="tjit-bench-triton-"))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as the test suite; silences Triton 3.9's warning

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import tjit  # noqa: E402  (chooses Triton's interpreter on machines without CUDA)
from tjit.lower.gpu_compile import compile_launched  # noqa: E402
from tjit.runtime.loader import launched_kernels  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import (TjitKernels, check_bytes, check_launches, eager_kernels, print_failures,  # noqa: E402
                     real_bytes)

_IMPORT_SECONDS = time.perf_counter() - _T0

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
MB = 1e6


# -- workloads ---------------------------------------------------------------------------------

def issue_example(x, y, scale):
    z = torch.sigmoid(x) * y.t() + scale
    return torch.where(z > 0, z, 0.1 * z), z.exp().clamp(max=10)


def make_chain20(k: float = 0.0) -> Callable:
    """20 pointwise ops over 3 same-shape inputs, 2 outputs. Different k, different constants
    (so a different kernel source): used to measure the compile of a *new* function."""
    c1, c2 = 1.5 + k, 1.0 + k

    def chain20(a, b, c):
        t = a * b                   # 1
        t = t + c                   # 2
        t = torch.sin(t)            # 3
        t = t * c1                  # 4
        t = t - a                   # 5
        t = torch.abs(t)            # 6
        t = torch.sqrt(t + c2)      # 7, 8
        t = t / (b * b + 1.0)       # 9, 10, 11
        t = torch.tanh(t)           # 12
        u = t * c                   # 13
        u = torch.exp(-u)           # 14, 15
        u = u.clamp(0.0, 4.0)       # 16
        v = torch.maximum(u, a)     # 17
        w = v * t + b               # 18, 19
        return torch.sigmoid(w), u  # 20
    return chain20


chain20 = make_chain20()


def gelu_bias(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def strided_input(xs, y):
    return torch.relu(xs * 2.0 + y)


def fp16_casts(a, b):
    return a.float() * torch.sigmoid(b.float()) + 1.0


def inplace_update(x, a, b):
    return x.mul_(a).add_(b)


def two_output_shapes(x, v):
    return x * v + 1.0, torch.exp(v) * 2.0


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@dataclass
class Workload:
    name: str
    fn: Callable
    make_args: Callable[[int, int], tuple]  # (M, N) -> arguments
    expect_kernels: int = 1
    note: str = ""


WORKLOADS = [
    Workload("issue_example", issue_example, lambda m, n: (rand(m, n), rand(n, m), 0.5),
             note="sigmoid(x)*y.t()+scale; where(z>0,z,0.1z), exp(z).clamp(max=10)"),
    Workload("chain20", chain20, lambda m, n: (rand(m, n), rand(m, n), rand(m, n)),
             note="20 pointwise ops, 3 inputs, 2 same-shape outputs"),
    Workload("gelu_bias", gelu_bias, lambda m, n: (rand(m, n), rand(n)),
             note="gelu(x + bias[N], tanh): bias broadcast over rows"),
    Workload("strided_input", strided_input, lambda m, n: (rand(2 * n, m).t()[:, ::2], rand(m, n)),
             note="relu(xs*2 + y), xs = base.t()[:, ::2] (transposed, step 2)"),
    Workload("fp16_casts", fp16_casts,
             lambda m, n: (rand(m, n, dtype=torch.float16), rand(m, n, dtype=torch.float16)),
             note="fp16 in, fp32 out: a.float()*sigmoid(b.float())+1"),
    Workload("inplace_update", inplace_update, lambda m, n: (rand(m, n), rand(m, n), rand(m, n)),
             note="x.mul_(a).add_(b)"),
    Workload("two_output_shapes", two_output_shapes, lambda m, n: (rand(m, n), rand(n)), expect_kernels=2,
             note="x*v+1 [M,N] and exp(v)*2 [N]: two iteration spaces"),
]


def clone_args(args):
    """Copies with the same shapes, strides and storage offsets (a sliced input stays sliced)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            storage = a.untyped_storage().clone()
            out.append(torch.empty(0, dtype=a.dtype, device=a.device).set_(
                storage, a.storage_offset(), a.shape, a.stride()))
        else:
            out.append(a)
    return out


def minimum_bytes(fn, args) -> tuple[int, Any]:
    """Every distinct input read once (its distinct elements), every output written once; an
    input written in place counts as an output, an output that is a view of an input is free.
    Returns (bytes, eager result) for the run on copies of `args`."""
    args = clone_args(args)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    versions = [t._version for t in tensors]
    result = fn(*args)
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            total += real_bytes(t)
    input_storages = {t.untyped_storage().data_ptr() for t in tensors}
    for t, v in zip(tensors, versions):
        if t._version != v:  # mutated in place
            total += real_bytes(t)
    written = set()
    for t in tree_leaves(result):
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage().data_ptr()
        if storage in input_storages or storage in written:
            continue
        written.add(storage)
        total += real_bytes(t)
    return total, result


# -- sm_90 compile -----------------------------------------------------------------------------

_ST_GLOBAL = re.compile(r"^\s*(?:@!?%\w+\s+)?st\.global(\S*)", re.MULTILINE)


def ptx_store_bytes_per_element(ptx: str, plan, num_warps: int = 4) -> float | None:
    """Bytes the PTX stores per element of the iteration space: each st.global instruction runs
    once per thread (32 * num_warps) and stores vector width x type width. Compared with
    explain's bytes_written / numel, it catches a kernel that stores the same output twice.
    Only meaningful when a program covers at least one element per thread."""
    per_program = math.prod(v for k, v in plan.constexprs.items() if k.startswith("BLOCK"))
    threads = 32 * num_warps
    if per_program < threads:
        return None
    total = 0
    for suffix in _ST_GLOBAL.findall(ptx):
        vec = re.search(r"\.v(\d+)", suffix)
        bits = re.search(r"\.[bfsu](\d+)\b", suffix)
        total += (int(vec.group(1)) if vec else 1) * (int(bits.group(1)) // 8 if bits else 4)
    return total * threads / per_program


def sm90_reports(plans) -> list[dict]:
    launched = {plan.name: args for plan, args in launched_kernels()}
    out = []
    for plan in plans:
        args = launched.get(plan.name)
        if args is None:  # never launched (zero-size): nothing to compile
            continue
        try:
            r = compile_launched(plan, args)
        except Exception as e:  # report, don't abort the whole benchmark
            out.append(dict(kernel=plan.name, error=f"{type(e).__name__}: {e}"))
            continue
        out.append(dict(kernel=plan.name, compile_s=r.compile_seconds, registers=r.registers,
                        spills=r.spills, stack_frame=r.stack_frame, vector_loads=r.vector_loads,
                        scalar_loads=r.scalar_loads, ptx_store_bytes_per_elem=ptx_store_bytes_per_element(r.ptx, plan, plan.num_warps),
                        explain_write_bytes_per_elem=plan.bytes_written / plan.numel if plan.numel else 0.0))
    return out


# -- one workload --------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    shape: list
    tjit_kernels: int = 0  # measured: Triton launches + aten kernels tjit ran outside them, one call
    tjit_aten_kernels: list = field(default_factory=list)  # those aten kernels (normally none)
    tjit_planned: int = 0  # len(tjit.explain(...).kernels)
    expect_kernels: int = 1
    eager_kernels: int = 0  # measured: aten ops eager ran that run a kernel (measure.AtenKernels)
    eager_kernel_names: list = field(default_factory=list)
    explain_eager_ops: int = 0  # Explanation.eager_ops: tjit's estimate of eager_kernels
    tjit_bytes: int = 0  # tjit.explain: sum of each kernel's bytes_read + bytes_written
    tjit_bytes_distinct: int | None = None  # measured in the interpreter (None with CUDA)
    tjit_bytes_issued: int | None = None
    eager_bytes: int = 0  # measured
    min_bytes: int = 0
    tjit_over_min: float = 0.0
    trace_s: float = 0.0
    lower_s: float = 0.0
    load_s: float = 0.0
    first_call_s: float = 0.0  # wall time of the first call (compile + run; the interpreter's run on CPU)
    sm90: list = field(default_factory=list)
    same_shape: dict = field(default_factory=dict)  # counter deltas over a 2nd call, same shapes
    new_sizes: dict = field(default_factory=dict)  # counter deltas over a call with every dim +16
    matches_eager: bool = False
    failures: list = field(default_factory=list)  # checks that did not hold (see the module text)
    error: str = ""
    times_ms: dict = field(default_factory=dict)  # eager / inductor / tjit, CUDA only
    note: str = ""


def delta(before: dict) -> dict:
    now = tjit.counters.snapshot()
    return {k: now[k] - before[k] for k in now}


def check_close(got, expected) -> None:
    got_l, exp_l = tree_leaves(got), tree_leaves(expected)
    assert len(got_l) == len(exp_l), f"{len(got_l)} outputs, eager has {len(exp_l)}"
    for g, e in zip(got_l, exp_l):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(g, e, equal_nan=True)
        else:
            assert g == e, (g, e)


def check_call(got, call_args, expected, eager_args) -> None:
    """Raises unless a tjit call's results, and the inputs it wrote in place, match eager's
    (`eager_args`: copies of the same inputs after eager ran on them)."""
    check_close(got, expected)
    for e, g in zip(eager_args, call_args):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(g, e, equal_nan=True)


def run_workload(w: Workload, m: int, n: int, timings: bool) -> Row:
    args = w.make_args(m, n)
    row = Row(w.name, [m, n], expect_kernels=w.expect_kernels, note=w.note)
    compiled = tjit.compile(w.fn)

    # eager: kernels and traffic, measured (on copies: in-place workloads must see fresh inputs)
    eager_args = clone_args(args)
    row.eager_kernel_names, row.eager_bytes, expected = eager_kernels(w.fn, eager_args)
    row.eager_kernels = len(row.eager_kernel_names)
    row.min_bytes, _ = minimum_bytes(w.fn, args)

    # first call: compile + run, checked against eager (on copies of the same inputs)
    tjit_args = clone_args(args)
    before = tjit.counters.snapshot()
    t0 = time.perf_counter()
    got = compiled(*tjit_args)
    row.first_call_s = time.perf_counter() - t0
    first = delta(before)
    check_call(got, tjit_args, expected, eager_args)

    entry = compiled.entry_for(*args)
    row.trace_s, row.lower_s, row.load_s = entry.trace_seconds, entry.lower_seconds, entry.load_seconds
    ex = tjit.explain(compiled, *args)
    row.tjit_planned, row.explain_eager_ops, row.tjit_bytes = len(ex.kernels), ex.eager_ops, ex.bytes_moved
    row.tjit_over_min = row.tjit_bytes / row.min_bytes if row.min_bytes else float("nan")
    if first["launches"] != row.tjit_planned:
        row.failures.append(f"{w.name}: the first call launched {first['launches']} kernel(s) "
                            f"(tjit.counters.launches), tjit.explain plans {row.tjit_planned}")
    row.sm90 = sm90_reports(entry.executable.program.kernels)

    # second call, same shapes: kernels and bytes measured, the plan checked against them
    call_args = clone_args(args)
    before = tjit.counters.snapshot()
    with TjitKernels() as measured:
        got = compiled(*call_args)
    row.same_shape = delta(before)
    check_call(got, call_args, expected, eager_args)
    row.matches_eager = True
    row.tjit_kernels, row.tjit_aten_kernels = measured.total, measured.aten.kernels
    row.failures += check_launches(w.name, row.tjit_planned, measured)
    row.failures += check_bytes(w.name, ex.kernels, measured.triton.launches)
    if measured.triton.record_bytes:
        read, written, read_distinct, written_distinct = measured.triton.bytes()
        row.tjit_bytes_distinct, row.tjit_bytes_issued = read_distinct + written_distinct, read + written
    if row.same_shape["traces"] or row.same_shape["kernel_compiles"]:
        row.failures.append(f"{w.name}: a 2nd call with the same shapes retraced/recompiled: {row.same_shape}")

    new_args = w.make_args(m + 16, n + 16)
    new_call, new_eager = clone_args(new_args), clone_args(new_args)
    before = tjit.counters.snapshot()
    got = compiled(*new_call)
    row.new_sizes = delta(before)
    check_call(got, new_call, w.fn(*new_eager), new_eager)
    planned = len(tjit.explain(compiled, *new_args).kernels)
    if row.new_sizes["launches"] != planned:
        row.failures.append(f"{w.name}: the +16 call launched {row.new_sizes['launches']} kernel(s) "
                            f"(tjit.counters.launches), tjit.explain plans {planned}")
    if row.new_sizes["kernels_generated"] or row.new_sizes["kernel_compiles"]:
        row.failures.append(f"{w.name}: new sizes generated/compiled new kernels: {row.new_sizes}")

    if timings:
        row.times_ms = gpu_times(w.fn, compiled, args)
    return row


def gpu_times(fn, compiled, args) -> dict:
    from triton.testing import do_bench
    inductor = torch.compile(fn)
    out = {}
    for label, f in (("eager", fn), ("inductor", inductor), ("tjit", compiled)):
        call_args = clone_args(args)
        out[label] = do_bench(lambda: f(*call_args), return_mode="median")
    return out


# -- compile latency ---------------------------------------------------------------------------

LATENCY_TARGET_S = 0.5


def compile_seconds(fn, args) -> dict:
    """Compile (trace, lower, load; no run, so no Triton binary compile) a new function."""
    compiled = tjit.compile(fn)
    t0 = time.perf_counter()
    entry = compiled.entry_for(*args)
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, trace_s=entry.trace_seconds, lower_s=entry.lower_seconds, load_s=entry.load_seconds)


def warm_latency(m: int, n: int, repeats: int = 5) -> dict:
    """Median over `repeats` new 20-op functions (new constants, so new kernel sources)."""
    args = (rand(m, n), rand(m, n), rand(m, n))
    runs = [compile_seconds(make_chain20(0.125 * (k + 1)), args) for k in range(repeats)]
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def cold_latency(m: int, n: int, preimport: bool) -> dict:
    """The first compile of a fresh process, measured in a subprocess. make_fx imports
    torch._inductor (and with it torch._dynamo, sympy, ...) on its first call, which costs
    seconds; with `preimport` that import is done (and timed) before the compile, so the two
    runs separate the import from tjit's own first-compile cost."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    proc = subprocess.run([sys.executable, __file__, "--_cold", f"{m},{n},{int(preimport)}"], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        return dict(error=proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cold_main(spec: str) -> None:
    m, n, preimport = map(int, spec.split(","))
    args = (rand(m, n), rand(m, n), rand(m, n))
    dynamo_loaded = "torch._dynamo" in sys.modules
    preimport_s = 0.0
    if preimport:
        t0 = time.perf_counter()
        import torch._inductor  # noqa: F401  what make_fx imports on its first call
        preimport_s = time.perf_counter() - t0
    result = compile_seconds(make_chain20(0.0625), args)
    result.update(import_s=_IMPORT_SECONDS, dynamo_loaded_by_import=dynamo_loaded, preimport_s=preimport_s)
    print(json.dumps(result))


# -- printing ----------------------------------------------------------------------------------

def fmt_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(vals):
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(vals, widths, align))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def print_report(rows: list[Row], sizes_note: str, cold: list[dict], warm: dict, timings: bool) -> None:
    print()
    print(f"== pointwise workloads ({sizes_note}) ==")
    print(fmt_table(
        ["workload", "shape", "tjit k", "exp", "eager k", "tjit MB", "measured MB", "eager MB", "min MB",
         "tjit/min", "eager/min", "ok"],
        [[r.name, "x".join(map(str, r.shape)), r.tjit_kernels, r.expect_kernels, r.eager_kernels,
          f"{r.tjit_bytes / MB:.3f}", measured_mb(r), f"{r.eager_bytes / MB:.3f}", f"{r.min_bytes / MB:.3f}",
          f"{r.tjit_over_min:.2f}", f"{r.eager_bytes / r.min_bytes:.2f}" if r.min_bytes else "-",
          "yes" if r.matches_eager else "NO"] for r in rows if not r.error]))
    print("  tjit k: kernels one call ran, measured (Triton's launches + aten kernels outside them), checked against "
          "tjit.explain and tjit.counters; exp: expected;\n"
          "  eager k: kernels eager ran, measured (aten ops dispatched to a backend kernel; views and allocations "
          "excluded); MB per call: tjit = explain's kernel reads + writes,\n"
          "  measured = distinct..issued bytes of the kernels' loads and stores (interpreter; explain is checked to "
          "lie between), eager = each eager kernel's tensor inputs + outputs,\n"
          "  min = distinct inputs read once + outputs written once; ok: matches eager")

    print()
    print("== compile (first call) and cache ==")
    table = []
    for r in rows:
        if r.error:
            continue
        good = [k for k in r.sm90 if "error" not in k]
        sm90 = "; ".join(f"{k['compile_s'] * 1e3:.0f}ms r{k['registers']} s{k['spills']} "
                         f"ld v{k['vector_loads']}/s{k['scalar_loads']} st {k['ptx_store_bytes_per_elem'] or 0:.0f}B/el"
                         for k in good)
        sm90 += "".join(f" ERROR {k['error'][:60]}" for k in r.sm90 if "error" in k)
        table.append([r.name, ms(r.trace_s), ms(r.lower_s), ms(r.load_s), ms(r.trace_s + r.lower_s + r.load_s),
                      ms(r.first_call_s),
                      f"{r.same_shape['traces']}/{r.same_shape['kernel_compiles']}",
                      f"{r.new_sizes['kernels_generated']}/{r.new_sizes['kernel_compiles']}"
                      f" (tr {r.new_sizes['traces']})", sm90])
    print(fmt_table(["workload", "trace ms", "lower ms", "load ms", "total ms", "1st call ms", "2nd: tr/kc", "+16: gen/kc",
                     "sm_90 per kernel: compile, regs, spill B, ld.global vector/scalar, PTX store B/elem"], table,
                    align="lrrrrrrll"))
    print("  trace = make_fx + IR conversion; lower = passes, fusion, scheduling, Triton source; load = "
          "write + import kernel modules (codegen+load);\n  1st call = wall time of the first call: compile + "
          f"{'Triton binary compile + run' if HAS_CUDA else 'run in the interpreter'}\n"
          "  2nd: new traces / kernel compiles over a 2nd call, same shapes (want 0/0); +16: new kernels "
          "generated / kernel compiles over a call with every dim +16 (want 0/0), tr = retraces")

    print()
    if timings:
        print("== GPU time per call (triton.testing.do_bench, median, ms) ==")
        print(fmt_table(["workload", "eager", "inductor", "tjit", "inductor/tjit", "tjit GB/s (min bytes)"],
                        [[r.name, f"{r.times_ms['eager']:.4f}", f"{r.times_ms['inductor']:.4f}",
                          f"{r.times_ms['tjit']:.4f}", f"{r.times_ms['inductor'] / r.times_ms['tjit']:.2f}x",
                          f"{r.min_bytes / r.times_ms['tjit'] / 1e6:.0f}"]
                         for r in rows if r.times_ms]))
    else:
        print("timings: no CUDA device here, so no kernel timings (they need a GPU; on CPU the kernels run "
              "in Triton's interpreter, which measures nothing useful)")

    print()
    print(f"== compile latency target: first call to a 20-op pointwise function < {LATENCY_TARGET_S} s "
          f"(trace + passes + codegen + load, excluding Triton's binary compile) ==")
    print("  (make_fx imports torch._inductor/torch._dynamo on its first call in a process: the cold number "
          "pays that import; the second line moves it out)")
    for label, d in (("cold: first compile in a fresh process", cold[0]),
                     ("cold, torch._inductor imported beforehand", cold[1]),
                     ("warm: a new function after others were compiled (median of 5)", warm)):
        if "error" in d:
            print(f"  {label}: failed: {d['error']}")
            continue
        verdict = "PASS" if d["wall_s"] < LATENCY_TARGET_S else "MISS"
        extra = ""
        if "import_s" in d:
            extra = f"; not counted: import torch+tjit {d['import_s']:.2f} s"
            extra += f", import torch._inductor {d['preimport_s']:.2f} s" if d.get("preimport_s") else ""
            extra += "; Dynamo already loaded by `import tjit`" if d.get("dynamo_loaded_by_import") else ""
        print(f"  {label}: {d['wall_s'] * 1e3:.0f} ms [{verdict}]  (trace {ms(d['trace_s'])}, lower "
              f"{ms(d['lower_s'])}, load {ms(d['load_s'])} ms{extra})")

    problems = []
    for r in rows:
        if r.error:
            continue
        if r.tjit_kernels > r.expect_kernels:
            problems.append(f"{r.name}: {r.tjit_kernels} kernels, expected {r.expect_kernels}")
        if r.tjit_bytes > r.min_bytes:
            problems.append(f"{r.name}: moves {r.tjit_bytes} B, minimum {r.min_bytes} B ({r.tjit_over_min:.4f}x)")
        if r.tjit_bytes < r.min_bytes:
            problems.append(f"{r.name}: explain reports {r.tjit_bytes} B, below the minimum {r.min_bytes} B")
        if r.tjit_aten_kernels:
            problems.append(f"{r.name}: tjit ran {len(r.tjit_aten_kernels)} aten kernel(s) beside its Triton "
                            f"kernels: {', '.join(r.tjit_aten_kernels)}")
        if r.explain_eager_ops != r.eager_kernels:
            problems.append(f"{r.name}: Explanation.eager_ops = {r.explain_eager_ops}, eager ran {r.eager_kernels} "
                            f"kernel(s): {', '.join(r.eager_kernel_names)}")
        for k in r.sm90:
            if "error" in k:
                problems.append(f"{r.name}: {k['kernel']} does not compile for sm_90: {k['error']}")
            elif k["spills"]:
                problems.append(f"{r.name}: {k['kernel']} spills {k['spills']} B at sm_90")
            if k.get("ptx_store_bytes_per_elem") and \
                    k["ptx_store_bytes_per_elem"] > 1.01 * k["explain_write_bytes_per_elem"]:
                problems.append(f"{r.name}: {k['kernel']} PTX stores {k['ptx_store_bytes_per_elem']:.1f} B per element, "
                                f"explain counts {k['explain_write_bytes_per_elem']:.1f} (an output stored twice?)")
    print()
    print("== findings (targets and notes, not enforced) ==")
    print("\n".join(f"  - {p}" for p in problems) if problems else "  none: every workload at its expected "
          "kernel count, at minimum bytes, no spills")
    print_failures([f for r in rows for f in r.failures] + [f"{r.name}: FAILED: {r.error}" for r in rows if r.error])


def measured_mb(r: Row) -> str:
    if r.tjit_bytes_issued is None:
        return "-"
    return f"{r.tjit_bytes_distinct / MB:.3f}..{r.tjit_bytes_issued / MB:.3f}"


# -- main ----------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (256x512)")
    ap.add_argument("--full", action="store_true", help="moderate sizes (1024x2048) even without CUDA (slow: "
                                                        "the interpreter runs them)")
    ap.add_argument("--json", metavar="PATH", help="write every row as JSON")
    ap.add_argument("--only", help="comma-separated workload names")
    ap.add_argument("--_cold", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts._cold:
        _cold_main(opts._cold)
        return 0

    quick = opts.quick or (not HAS_CUDA and not opts.full)
    m, n = (256, 512) if quick else (1024, 2048)
    if opts.quick:
        sizes_note = f"--quick: {m}x{n} = {m * n / 1e6:.2f}M elements"
    elif quick:
        sizes_note = (f"no CUDA: quick sizes {m}x{n} = {m * n / 1e6:.2f}M elements, since Triton's interpreter "
                      f"runs the kernels; --full for 1024x2048")
    else:
        sizes_note = f"{m}x{n} = {m * n / 1e6:.2f}M elements"
    print(f"tjit pointwise benchmark on {DEVICE} "
          f"({torch.cuda.get_device_name() if HAS_CUDA else 'Triton interpreter'}), {sizes_note}")

    # Cold compile latency first, in a fresh process, while nothing else competes for the CPU.
    print("compile latency, cold (two fresh subprocesses) ...", flush=True)
    cold = [cold_latency(m, n, preimport=False), cold_latency(m, n, preimport=True)]

    chosen = [w for w in WORKLOADS if not opts.only or w.name in opts.only.split(",")]
    rows = []
    for k, w in enumerate(chosen, 1):
        t0 = time.perf_counter()
        print(f"[{k}/{len(chosen)}] {w.name:<18} ...", end=" ", flush=True)
        try:
            row = run_workload(w, m, n, timings=HAS_CUDA)
        except Exception as e:
            row = Row(w.name, [m, n], expect_kernels=w.expect_kernels, note=w.note,
                      error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(f"FAILED ({row.error})")
        else:
            print(f"{row.tjit_kernels} kernel(s), {row.tjit_over_min:.2f}x min bytes, "
                  f"{time.perf_counter() - t0:.1f} s")
        rows.append(row)

    print("compile latency, warm ...", flush=True)
    warm = warm_latency(m, n)
    print_report(rows, sizes_note, cold, warm, timings=HAS_CUDA)

    if opts.json:
        doc = dict(device=DEVICE, sizes=[m, n], sizes_note=sizes_note, rows=[asdict(r) for r in rows],
                   compile_latency=dict(target_s=LATENCY_TARGET_S, cold=cold[0], cold_inductor_preimported=cold[1], warm=warm))
        Path(opts.json).write_text(json.dumps(doc, indent=2, default=str))
        print(f"\nwrote {opts.json}")
    return 1 if any(r.error or r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

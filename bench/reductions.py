#!/usr/bin/env python
"""Reduction and scan benchmark: kernels, bytes moved, mapping, registers and spills, per workload.

    python bench/reductions.py [--quick] [--json PATH] [--only NAME[,NAME...]]

Every workload (softmax, log_softmax, layer_norm, rms_norm, var_mean, cumsum, logcumsumexp, a
fused logcumsumexp, a full sum, cross-entropy) runs at two row sizes: one whose reduced extent
fits a block (held whole in registers: a persistent kernel) and one that does not (a looped
kernel). Counts are measured while the code runs (bench/measure.py says how), and tjit's plan is
checked against them. For each it reports
  * kernels per call: tjit's, measured over one call (the Triton launches Triton itself saw,
    plus any aten op tjit's runtime ran outside them), and eager's, measured (the aten ops
    eager dispatches to a backend kernel, views and allocations excluded: F.layer_norm is one
    native_layer_norm, F.cross_entropy a _log_softmax and an nll_loss_forward);
  * bytes moved per call: tjit.explain's (each kernel's bytes_read + bytes_written) and, without
    CUDA, the distinct and issued bytes the kernels' loads and stores were measured to move in
    the interpreter; the minimum (each distinct input read once, each output written once), and
    explain / minimum;
  * the mapping tjit chose per kernel (its axis strategies, abbreviated: TG = ThreadGroup,
    T = Thread, Seq = Sequential, with the width; r: marks reduced/scanned axes);
  * max registers per thread and total spill bytes of the sm_90 compile of each kernel
    (tjit.lower.gpu_compile, no GPU needed);
  * whether the output matches eager (torch.testing.assert_close, dtype tolerances; or within
    fp32 rounding of a float64 run, see check_close);
  * with CUDA present only: triton.testing.do_bench medians of eager, torch.compile and tjit, and
    tjit's achieved GB/s (minimum bytes / time).

The measured call is the second with these inputs: a first one, whose Triton launches are
counted but not run (measure.TritonLaunches(execute=False); on CUDA it runs), does tjit's
first-call set-up, so that the measured one is a steady-state call without the interpreter's
cost of running every kernel twice (minutes for the scans).

Checked, and the script exits 1 with the failures listed when one does not hold: the output
matches eager; the kernels tjit.explain plans are the launches tjit.counters counted and Triton
saw; explain's bytes per kernel lie between the measured distinct and issued bytes (interpreter
only). Targets are printed beside the table, not enforced, and so is a difference between
Explanation.eager_ops (tjit's estimate of eager's kernels) and the measured count. Without CUDA
the kernels run in Triton's interpreter, which is slow for scans with a custom combine
(logcumsumexp): those workloads use fewer rows there. Progress goes to stderr, the tables to
stdout.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

# pointwise sets TRITON_CACHE_DIR / TRITON_DEFAULT_FP_FUSION before triton is imported, and imports
# tjit, which sets TRITON_INTERPRET=1 when there is no CUDA.
from pointwise import (DEVICE, HAS_CUDA, MB, clone_args, fmt_table,  # noqa: E402
                       minimum_bytes, sm90_reports)
from measure import (TjitKernels, TritonLaunches, check_bytes, check_launches,  # noqa: E402
                     eager_kernels, print_failures)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import tjit  # noqa: E402

# -- workloads -----------------------------------------------------------------------------------


def softmax(x):
    return torch.softmax(x, -1)


def log_softmax(x):
    return torch.log_softmax(x, -1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w)


def var_mean(x):
    return torch.var_mean(x, -1)


def cumsum(x):
    return torch.cumsum(x, -1)


def logcumsumexp(x):
    return torch.logcumsumexp(x, -1)


def logcumsumexp_fused(x):
    return torch.logcumsumexp(x.log_softmax(-1), -1).exp()


def full_sum(x):
    return x.sum()


def cross_entropy(x, target):
    return F.cross_entropy(x, target)


def rand(*shape):
    return torch.randn(*shape, device=DEVICE)


def x_only(m, n):
    return (rand(m, n),)


@dataclass
class Workload:
    name: str
    fn: Callable
    make_args: Callable[[int, int], tuple]  # (rows, row length) -> arguments
    one_kernel: bool = False  # target: one kernel per call
    slow_scan: bool = False  # a custom-combine scan: the interpreter runs it element by element
    flat: bool = False  # a 1-d input of rows * n elements (full sum)
    note: str = ""


WORKLOADS = [
    Workload("softmax", softmax, x_only, one_kernel=True),
    Workload("log_softmax", log_softmax, x_only, one_kernel=True),
    Workload("layer_norm", layer_norm, lambda m, n: (rand(m, n), rand(n), rand(n)), one_kernel=True,
             note="weight + bias"),
    Workload("rms_norm", rms_norm, lambda m, n: (rand(m, n), rand(n)), one_kernel=True, note="weight"),
    Workload("var_mean", var_mean, x_only, one_kernel=True, note="last dim, 2 outputs"),
    Workload("cumsum", cumsum, x_only),
    Workload("logcumsumexp", logcumsumexp, x_only, one_kernel=True, slow_scan=True),
    Workload("lcse_fused", logcumsumexp_fused, x_only, one_kernel=True, slow_scan=True,
             note="logcumsumexp(x.log_softmax(-1), -1).exp()"),
    Workload("full_sum", full_sum, lambda m, n: (rand(m * n),), flat=True,
             note="x.sum(): split across up to 1024 programs (ThreadGroup), the last one combines"),
    Workload("cross_entropy", cross_entropy,
             lambda m, n: (rand(m, n), torch.randint(0, n, (m,), device=DEVICE)),
             note="mean reduction, ignore_index: row reductions, the gather and the mean in one kernel"),
]


def sizes(quick: bool) -> dict:
    """(rows, row length) per case. 'fit': the reduced extent fits a block (persistent, at most
    4096 fp32); 'loop': it does not. The full sum uses its own (1, numel)."""
    if quick:
        s = dict(fit=(4, 1024), loop=(2, 8192), sum_fit=(1, 4096), sum_loop=(1, 1 << 18))
    else:
        # 2^24 elements take ~40 s in the interpreter (which runs the programs one by one): 2^22 there
        s = dict(fit=(64, 2048), loop=(4, 65536), sum_fit=(1, 4096), sum_loop=(1, 1 << (24 if HAS_CUDA else 22)))
    if HAS_CUDA:
        s.update(scan_fit=s["fit"], scan_loop=s["loop"])
    else:  # the interpreter's logcumsumexp costs ~1.5 ms per element
        # (4097: just over the 4096-element persistent limit, so it loops)
        s.update(scan_fit=(1, 1024), scan_loop=(1, 4097)) if quick else \
            s.update(scan_fit=(4, 1024), scan_loop=(1, 16384))  # 65536 takes 5+ minutes per workload
    return s


def shape_for(w: Workload, case: str, s: dict) -> tuple[int, int]:
    if w.flat:
        return s["sum_" + case]
    if w.slow_scan:
        return s["scan_" + case]
    return s[case]


# -- one row -------------------------------------------------------------------------------------

BYTES_TARGET = dict(fit=1.1, loop=2.1)


@dataclass
class Row:
    name: str
    case: str  # fit | loop
    shape: list
    kernels: int = 0  # measured: Triton launches + aten kernels tjit ran outside them, one call
    tjit_aten_kernels: list = field(default_factory=list)  # those aten kernels (normally none)
    planned: int = 0  # len(tjit.explain(...).kernels)
    eager_kernels: int = 0  # measured: aten ops eager ran that run a kernel (measure.AtenKernels)
    eager_kernel_names: list = field(default_factory=list)
    explain_eager_ops: int = 0  # Explanation.eager_ops: tjit's estimate of eager_kernels
    tjit_bytes: int = 0  # tjit.explain
    bytes_distinct: int | None = None  # measured in the interpreter (None with CUDA)
    bytes_issued: int | None = None
    min_bytes: int = 0
    ratio: float = 0.0
    mapping: list = field(default_factory=list)  # per kernel, abbreviated strategies
    strategies: list = field(default_factory=list)  # per kernel, the full strings
    max_registers: int = 0
    spills: int = 0
    sm90: list = field(default_factory=list)
    matches_eager: bool = False
    mismatch: str = ""
    rounding: str = ""  # passed on the float64 rounding check only (see check_close)
    unsupported: str = ""
    failures: list = field(default_factory=list)  # checks that did not hold (see the module text)
    error: str = ""
    run_s: float = 0.0  # wall time of the measured call (the kernels' run)
    times_ms: dict = field(default_factory=dict)  # CUDA only: eager / inductor / tjit
    gbps: float = 0.0  # CUDA only: min bytes / tjit time
    note: str = ""


_STRATEGY = re.compile(r"^(reduced |scanned |)?\s*axes \[([^\]]*)\] -> (\w+)\(width=(\d+)\)")
_SHORT = {"ThreadGroup": "TG", "Thread": "T", "Sequential": "Seq", "Auto": "A"}


def abbreviate(strategy: str) -> str:
    """'reduced axes [1] -> Sequential(width=1024): ...' -> 'r1:Seq1024'."""
    m = _STRATEGY.match(strategy.strip())
    if not m:
        return strategy.split(":")[0]
    kind, axes, name, width = m.groups()
    prefix = "r" if kind.strip() else ""
    return f"{prefix}{axes.replace(' ', '')}:{_SHORT.get(name, name)}{width}"


def max_error(got, ref) -> float:
    return (got.double() - ref.double()).abs().nan_to_num(0.0).max().item() if got.numel() else 0.0


def check_close(fn, args, got, expected) -> tuple[str, str]:
    """(mismatch, note): mismatch '' when every output matches eager. assert_close's dtype
    tolerances first. A reduction or scan summed in another order than eager's (which on CPU
    accumulates fp32 sums in float64) can miss them by rounding alone, so an output that fails
    them still passes, noted, when its max error against a float64 run of `fn` is within
    max(2 x eager's, 4 sqrt(n) eps max|ref|), n the reduced extent (the last dim of the input):
    typical fp32 rounding, while a wrong result is off by O(1)."""
    got_l, exp_l = tree_leaves(got), tree_leaves(expected)
    if len(got_l) != len(exp_l):
        return f"{len(got_l)} outputs, eager has {len(exp_l)}", ""
    ref_l, notes = None, []
    for i, (g, e) in enumerate(zip(got_l, exp_l)):
        try:
            torch.testing.assert_close(g, e, equal_nan=True)
            continue
        except AssertionError as err:
            first = " ".join(str(err).split())[:160]
        if not e.is_floating_point():
            return first, ""
        if ref_l is None:
            ref_l = tree_leaves(fn(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                     for a in clone_args(args)]))
        n = args[0].shape[-1]
        bound = max(2 * max_error(e, ref_l[i]),
                    4 * n ** 0.5 * torch.finfo(e.dtype).eps * ref_l[i].abs().nan_to_num(0.0).max().item())
        tjit_err = max_error(g, ref_l[i])
        summary = (f"output {i}: max error vs float64 {tjit_err:.3g}, eager's {max_error(e, ref_l[i]):.3g}, "
                   f"rounding bound {bound:.3g}")
        if tjit_err > bound:
            return f"{summary}; {first}", ""
        notes.append(summary)
    return "", "; ".join(notes)


def run_case(w: Workload, case: str, m: int, n: int, timings: bool) -> Row:
    shape = [m * n] if w.flat else [m, n]
    row = Row(w.name, case, shape, note=w.note)
    args = w.make_args(m, n)
    compiled = tjit.compile(w.fn)
    try:
        ex = tjit.explain(compiled, *args)
    except tjit.UnsupportedOpError as e:
        row.unsupported = str(e).splitlines()[0]
        return row
    row.planned, row.explain_eager_ops, row.tjit_bytes = len(ex.kernels), ex.eager_ops, ex.bytes_moved
    row.strategies = [k.strategies for k in ex.kernels]
    row.mapping = [" ".join(abbreviate(s) for s in k.strategies) for k in ex.kernels]
    row.eager_kernel_names, _, expected = eager_kernels(w.fn, clone_args(args))
    row.eager_kernels = len(row.eager_kernel_names)
    row.min_bytes, _ = minimum_bytes(w.fn, args)
    row.ratio = row.tjit_bytes / row.min_bytes if row.min_bytes else float("nan")

    call_args = clone_args(args)
    with TritonLaunches(bytes=False, execute=False):  # tjit's first-call set-up; kernels not run
        compiled(*call_args)
    call_args = clone_args(args)
    t0 = time.perf_counter()
    with TjitKernels() as measured:  # only the call: copies made inside would count as kernels
        got = compiled(*call_args)
    row.run_s = time.perf_counter() - t0
    row.mismatch, row.rounding = check_close(w.fn, args, got, expected)
    row.matches_eager = not row.mismatch
    if row.mismatch:
        row.failures.append(f"{w.name} [{case}]: does not match eager: {row.mismatch}")
    row.kernels, row.tjit_aten_kernels = measured.total, measured.aten.kernels
    row.failures += check_launches(f"{w.name} [{case}]", row.planned, measured)
    row.failures += check_bytes(f"{w.name} [{case}]", ex.kernels, measured.triton.launches)
    if measured.triton.record_bytes:
        read, written, read_distinct, written_distinct = measured.triton.bytes()
        row.bytes_distinct, row.bytes_issued = read_distinct + written_distinct, read + written

    row.sm90 = sm90_reports(compiled.entry_for(*args).executable.program.kernels)
    good = [k for k in row.sm90 if "error" not in k]
    row.max_registers = max((k["registers"] for k in good), default=0)
    row.spills = sum(k["spills"] for k in good)

    if timings:
        row.times_ms = gpu_times(w.fn, compiled, args)
        row.gbps = row.min_bytes / row.times_ms["tjit"] / 1e6
    return row


# -- CUDA only -----------------------------------------------------------------------------------

def gpu_times(fn, compiled, args) -> dict:
    """do_bench medians (ms) of eager, torch.compile (inductor) and tjit on the same inputs."""
    from triton.testing import do_bench
    out = {}
    for label, f in (("eager", fn), ("inductor", torch.compile(fn)), ("tjit", compiled)):
        call_args = clone_args(args)
        out[label] = do_bench(lambda: f(*call_args), return_mode="median")
    return out


# -- printing ------------------------------------------------------------------------------------

def status(r: Row) -> str:
    if r.unsupported:
        return "unsupported"
    if r.error:
        return "FAILED"
    if not r.matches_eager:
        return "MISMATCH"
    if r.failures:
        return "CHECK FAILED"
    return "yes*" if r.rounding else "yes"


def main_table(rows: list[Row]) -> str:
    body = []
    for r in rows:
        if r.unsupported or r.error:
            body.append([r.name, r.case, "x".join(map(str, r.shape))] + ["-"] * 9 + [status(r)])
            continue
        measured = "-" if r.bytes_issued is None else f"{r.bytes_distinct / MB:.3f}..{r.bytes_issued / MB:.3f}"
        body.append([r.name, r.case, "x".join(map(str, r.shape)), r.kernels, r.eager_kernels,
                     f"{r.tjit_bytes / MB:.3f}", measured, f"{r.min_bytes / MB:.3f}", f"{r.ratio:.2f}",
                     " | ".join(r.mapping), r.max_registers, r.spills, status(r)])
    return fmt_table(["workload", "case", "shape", "tjit k", "eager k", "tjit MB", "measured MB", "min MB", "ratio",
                      "mapping per kernel", "regs", "spill B", "ok"], body, align="lllrrrrrrlrrl")


def targets_text() -> str:
    one = ", ".join(w.name for w in WORKLOADS if w.one_kernel)
    return ("targets (not asserted): 1 kernel per call for " + one + "; bytes <= "
            f"{BYTES_TARGET['fit']}x min when a row fits a block (fit), <= {BYTES_TARGET['loop']}x for "
            "looped rows (loop); 0 spill bytes at sm_90; matches eager")


def findings(rows: list[Row], by_name: dict) -> list[str]:
    out = []
    for r in rows:
        where = f"{r.name} [{r.case} {'x'.join(map(str, r.shape))}]"
        if r.unsupported:
            out.append(f"{where}: unsupported: {r.unsupported}")
            continue
        if r.error:
            out.append(f"{where}: FAILED: {r.error}")
            continue
        if r.rounding:
            out.append(f"{where}: outside assert_close's tolerance against eager, within fp32 rounding: {r.rounding}")
        if by_name[r.name].one_kernel and r.kernels != 1:
            out.append(f"{where}: {r.kernels} kernels, target 1")
        if r.tjit_aten_kernels:
            out.append(f"{where}: tjit ran {len(r.tjit_aten_kernels)} aten kernel(s) beside its Triton kernels: "
                       f"{', '.join(r.tjit_aten_kernels)}")
        if r.explain_eager_ops != r.eager_kernels:
            out.append(f"{where}: Explanation.eager_ops = {r.explain_eager_ops}, eager ran {r.eager_kernels} "
                       f"kernel(s): {', '.join(r.eager_kernel_names)}")
        if r.ratio > BYTES_TARGET[r.case]:
            out.append(f"{where}: moves {r.ratio:.2f}x the minimum bytes, target <= {BYTES_TARGET[r.case]}x")
        if r.spills:
            out.append(f"{where}: spills {r.spills} B at sm_90")
        out += [f"{where}: {k['kernel']} does not compile for sm_90: {k['error'][:120]}"
                for k in r.sm90 if "error" in k]
    return out


def print_report(rows: list[Row], sizes_note: str, timings: bool) -> None:
    print()
    print(f"== reductions and scans ({sizes_note}) ==")
    print(main_table(rows))
    print("  tjit k: kernels one call ran, measured (Triton's launches + aten kernels outside them), checked against "
          "tjit.explain and tjit.counters;\n  eager k: kernels eager ran, measured (aten ops dispatched to a backend "
          "kernel; views and allocations excluded);\n  MB per call: tjit = sum of kernel reads + writes (explain), "
          "measured = distinct..issued bytes of the kernels' loads and stores (interpreter; explain is checked to lie "
          "between),\n  min = distinct inputs read once + outputs written once; mapping: axes:strategy+width per kernel "
          "(r = reduced/scanned axes; TG ThreadGroup, T Thread, Seq Sequential); regs: max registers per "
          "thread, spill B: total spill bytes (sm_90 compile);\n  ok: matches eager (assert_close), yes*: "
          "only within fp32 rounding of a float64 reference (see findings)")
    print("  " + targets_text())

    print()
    if timings:
        print("== GPU time per call (triton.testing.do_bench, median, ms) ==")
        print(fmt_table(["workload", "case", "eager", "inductor", "tjit", "inductor/tjit", "tjit GB/s (min bytes)"],
                        [[r.name, r.case, f"{r.times_ms['eager']:.4f}", f"{r.times_ms['inductor']:.4f}",
                          f"{r.times_ms['tjit']:.4f}", f"{r.times_ms['inductor'] / r.times_ms['tjit']:.2f}x",
                          f"{r.gbps:.0f}"] for r in rows if r.times_ms]))
    else:
        print("timings: no CUDA device here, so no kernel timings (the kernels ran in Triton's interpreter)")

    problems = findings(rows, {w.name: w for w in WORKLOADS})
    print()
    print("== findings (targets and notes, not enforced) ==")
    print("\n".join(f"  - {p}" for p in problems) if problems else "  none: every target met")
    print_failures([f for r in rows for f in r.failures] +
                   [f"{r.name} [{r.case}]: FAILED: {r.error}" for r in rows if r.error])


# -- main ----------------------------------------------------------------------------------------

def progress(msg: str, end: str = "\n") -> None:
    print(msg, end=end, file=sys.stderr, flush=True)


def run_all(chosen: list[Workload], s: dict, timings: bool) -> list[Row]:
    rows = []
    total = 2 * len(chosen)
    for k, (w, case) in enumerate(((w, c) for w in chosen for c in ("fit", "loop")), 1):
        m, n = shape_for(w, case, s)
        progress(f"[{k}/{total}] {w.name:<14} {case:<4} {m}x{n} ...", end=" ")
        t0 = time.perf_counter()
        try:
            row = run_case(w, case, m, n, timings)
        except Exception as e:  # report and go on
            msg = str(e).strip().splitlines()
            row = Row(w.name, case, [m * n] if w.flat else [m, n], note=w.note,
                      error=f"{type(e).__name__}: {msg[-1] if msg else ''}"[:200])
        took = time.perf_counter() - t0
        if row.unsupported or row.error:
            progress(f"{status(row)} ({row.unsupported or row.error}), {took:.1f} s")
        else:
            progress(f"{row.kernels} kernel(s), {row.ratio:.2f}x min bytes, {status(row)}, {took:.1f} s")
        rows.append(row)
    return rows


def describe_sizes(s: dict, quick: bool) -> str:
    def fmt(key):
        return "x".join(map(str, s[key]))
    text = (f"{'--quick' if quick else 'full'}: fit {fmt('fit')}, loop {fmt('loop')}; logcumsumexp "
            f"fit {fmt('scan_fit')}, loop {fmt('scan_loop')}; full sum {s['sum_fit'][1]} / {s['sum_loop'][1]} elements")
    if not HAS_CUDA:
        text += ("; interpreter: smaller logcumsumexp rows (~4 ms per element there)" +
                 ("" if quick else ", full sum over 2^22 not 2^24 (the interpreter runs its programs one by one)"))
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, about a minute in the interpreter")
    ap.add_argument("--json", metavar="PATH", help="write every row as JSON")
    ap.add_argument("--only", help="comma-separated workload names")
    opts = ap.parse_args()

    s = sizes(opts.quick)
    sizes_note = describe_sizes(s, opts.quick)
    chosen = [w for w in WORKLOADS if not opts.only or w.name in opts.only.split(",")]
    print(f"tjit reductions benchmark on {DEVICE} "
          f"({torch.cuda.get_device_name() if HAS_CUDA else 'Triton interpreter'}), {sizes_note}")
    t0 = time.perf_counter()
    rows = run_all(chosen, s, timings=HAS_CUDA)
    progress(f"done in {time.perf_counter() - t0:.1f} s")
    print_report(rows, sizes_note, timings=HAS_CUDA)

    if opts.json:
        doc = dict(device=DEVICE, sizes=s, sizes_note=sizes_note, bytes_target=BYTES_TARGET,
                   one_kernel_target=[w.name for w in WORKLOADS if w.one_kernel], rows=[asdict(r) for r in rows])
        Path(opts.json).write_text(json.dumps(doc, indent=2, default=str))
        print(f"\nwrote {opts.json}")
    return 1 if any(r.error or r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

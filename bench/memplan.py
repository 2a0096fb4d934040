#!/usr/bin/env python
"""Memory-planner benchmark: slab size against the lower bound, and planning time, per trace.

    python bench/memplan.py [--quick] [--json PATH] [--budget SECONDS] [--skip-greedy-100k]

Traces (each a list of buffers (size_bytes, first_step, end_step), end exclusive):
  * model graphs traced with make_fx on fake tensors (nothing big is allocated): an MLP, a
    ResNet-style conv stack (bottleneck blocks, batch norm) and a GPT-2-style decoder stack
    (attention by matmul + softmax), each forward and forward+backward (loss and
    torch.autograd.grad w.r.t. the parameters inside the trace). Every intermediate tensor of
    the aten graph is a buffer of its storage's bytes rounded up to 64, live from the node
    that produces it to its last user; a view (an output sharing its input's storage) extends
    its base's lifetime instead of being a buffer; parameters, inputs and graph outputs are not
    buffers (they live outside the slab);
  * a synthetic trace of 100,000 buffers (seeded; 10,000 with --quick): one buffer born per
    step, 70% living 1-4 steps, 25% ~30 steps, 5% 100-4000 steps (saved activations), sizes
    from a palette of 400 tensor sizes between 256 B and 32 MiB: ~100 live at once, ~140 at most;
  * the 11 MiniMalloc "challenging" instances (../shared/memplan/minimalloc-challenging),
    whose known optimal capacity is reported beside the lower bound.

For each trace: buffers, lower bound (the largest total of bytes live at one step), and for
the seed's first fit, TFLite's greedy-by-size and tjit's plan_offsets the slab / lower bound
and the planning time; geomeans per group at the bottom. Wall-clock times: a busy machine
inflates them.

Then three small compiled functions whose tjit graphs have intermediates, in steady state (a
call after the first): the slab tjit planned against its lower bound, the slab bytes the call
really holds (its Executable's slabs), the kernels a call runs, measured (Triton's launches +
aten kernels tjit ran outside them, bench/measure.py), and the slab allocations per call
(tjit.memory.stats; with CUDA also the caching allocator's count, which includes the outputs,
allocated per call by design).

Checked, and the script exits 1 with the failures listed when one does not hold: every plan is
valid (check_plan: aligned, inside the slab, no two live buffers sharing a byte; the planners'
and tjit's compiled plans alike); a compiled function holds the slab it planned; its launches
are the kernels tjit.explain plans (counted by tjit.counters and seen by Triton); a
steady-state call allocates no slab.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from tjit.memory import (
    check_plan,
    first_fit_by_start,
    greedy_by_size,
    lower_bound,
    plan_offsets,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import TjitKernels, check_launches, print_failures  # noqa: E402

MINIMALLOC = ROOT.parent / "shared" / "memplan" / "minimalloc-challenging"


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

class MLP(nn.Module):
    """Widths that differ layer to layer, so buffer sizes do too."""

    def __init__(self, widths=(784, 3072, 1536, 2560, 1024, 10)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.layer_norm(F.gelu(layer(x)), (layer.out_features,))
        return self.layers[-1](x)


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, cout, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.shortcut = (None if cin == cout and stride == 1 else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    def __init__(self, stages=((64, 256, 2), (128, 512, 2), (256, 1024, 2))):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for i, (mid, cout, n) in enumerate(stages):
            for j in range(n):
                blocks.append(Bottleneck(cin, mid, cout, 2 if i and not j else 1))
                cin = cout
        self.body, self.fc = nn.Sequential(*blocks), nn.Linear(cin, 1000)

    def forward(self, x):
        return self.fc(self.body(self.stem(x)).mean((2, 3)))


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in self.qkv(x).split(D, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.heads)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = att.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class DecoderBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=5000, d=384, heads=6, layers=6, T=200):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(DecoderBlock(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def models():
    """name -> (module, example input), built on the meta device: no memory is allocated."""
    with torch.device("meta"):
        return {"mlp": (MLP(), torch.randn(512, 784)),
                "resnet": (ResNet(), torch.randn(8, 3, 160, 160)),
                "gpt2": (GPT(), torch.randint(0, 5000, (4, 200)))}


# ---------------------------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------------------------

def trace_model(model: nn.Module, x: torch.Tensor, backward: bool) -> torch.fx.GraphModule:
    """The aten graph of a forward (or forward + gradients) pass, parameters as inputs."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())

    def step(params, x):
        out = functional_call(model, params, (x,))
        if not backward:
            return out
        loss = out.float().pow(2).mean()
        return loss, torch.autograd.grad(loss, [p for p in params.values() if p.requires_grad])

    return make_fx(step, tracing_mode="fake")(params, x)


def buffers_of(graph: torch.fx.GraphModule) -> tuple[list[tuple[int, int, int]], list[str]]:
    """(size_bytes, first_step, end_step) and a name for every intermediate storage.

    A storage is born at the node that first produces a tensor on it and dies after the last
    node using any tensor on it, so views and in-place results extend their base's life."""
    born: dict[int, int] = {}
    last: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    name: dict[int, str] = {}
    outside: set[int] = set()  # placeholders and graph outputs: not in the slab
    for step, node in enumerate(graph.graph.nodes):
        for t in _tensors(node.meta.get("val")):
            key = t.untyped_storage()._cdata
            if key not in born:
                born[key], last[key], nbytes[key], name[key] = step, step, t.untyped_storage().nbytes(), node.name
                if node.op == "placeholder":
                    outside.add(key)
        for arg in node.all_input_nodes:
            for t in _tensors(arg.meta.get("val")):
                key = t.untyped_storage()._cdata
                if node.op == "output":
                    outside.add(key)
                else:
                    last[key] = step
    keys = [k for k in born if k not in outside]
    return [(-(-nbytes[k] // 64) * 64, born[k], last[k] + 1) for k in keys], [name[k] for k in keys]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def synthetic(n: int = 100_000, seed: int = 0) -> list[tuple[int, int, int]]:
    """One buffer born per step: mostly short-lived temporaries, some saved for long."""
    rng = np.random.default_rng(seed)
    palette = np.unique((2 ** rng.uniform(8, 25, 400)).astype(np.int64) // 64 * 64 + 64)
    size = rng.choice(palette, n)
    kind = rng.random(n)
    steps = np.where(kind < 0.7, rng.integers(1, 5, n),
                     np.where(kind < 0.95, rng.geometric(1 / 30, n), rng.integers(100, 4000, n)))
    first = np.arange(n)
    return list(zip(size.tolist(), first.tolist(), (first + steps).tolist()))


def minimalloc(path: Path) -> list[tuple[int, int, int]]:
    with open(path) as f:
        return [(int(r["size"]), int(r["lower"]), int(r["upper"])) for r in csv.DictReader(f)]


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------

@dataclass
class Row:
    trace: str
    group: str
    buffers: int
    lower_bound: int
    optimum: int | None = None  # known optimal slab (MiniMalloc)
    ratio: dict[str, float] = field(default_factory=dict)  # planner -> slab / lower bound
    seconds: dict[str, float] = field(default_factory=dict)


def measure(trace: str, group: str, intervals, planners: dict[str, Callable], optimum=None) -> Row:
    bound = lower_bound(intervals)
    row = Row(trace, group, len(intervals), bound, optimum)
    for name, plan in planners.items():
        progress(f"  {trace}: {name} ...")
        start = time.perf_counter()
        offsets, slab = plan(intervals)
        row.seconds[name] = time.perf_counter() - start
        check_plan(intervals, offsets, slab)
        row.ratio[name] = slab / bound if bound else 1.0
    return row


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def print_table(rows: list[Row], planners: list[str]) -> None:
    head = f"{'trace':<22} {'buffers':>8} {'lower bound':>12}" + "".join(f" {p:>22}" for p in planners)
    print(head)
    print(" " * 44 + "".join(f" {'slab/LB':>11}{'time':>11}" for _ in planners))
    for group in dict.fromkeys(r.group for r in rows):
        grouped = [r for r in rows if r.group == group]
        for r in grouped:
            cells = "".join(f" {r.ratio[p]:>11.4f}{_time(r.seconds[p]):>11}" if p in r.ratio else f" {'-':>22}"
                            for p in planners)
            print(f"{r.trace:<22} {r.buffers:>8} {_mib(r.lower_bound):>12}{cells}")
        if len(grouped) > 1:
            means = "".join(f" {_ratio(geomean(r.ratio[p] for r in grouped if p in r.ratio)):>11}{'':>11}"
                            for p in planners)
            print(f"{'geomean ' + group:<44}{means}")
        optimal = [r for r in grouped if r.optimum]
        if optimal:
            vs = "".join(f" {_ratio(geomean(r.ratio[p] * r.lower_bound / r.optimum for r in optimal if p in r.ratio)):>11}"
                         f"{'':>11}" for p in planners)
            print(f"{'  vs known optimum':<44}{vs}")
        print()


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.4f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def compiled_functions() -> dict[str, tuple[Callable, tuple]]:
    """Small functions whose tjit graphs have intermediates (run in the interpreter without CUDA)."""
    def two_stage(x):
        return (x.softmax(0).t().contiguous() + 1).sum(0)

    def scan_of_row_sums(x):
        return x.sum(1).cumsum(0).flip(0) * 2

    def norm_then_mix(x, w):
        h = torch.nn.functional.layer_norm(x, x.shape[-1:])
        return (h.t().contiguous() * w[:, None]).sum(1).softmax(0)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, w = torch.randn(64, 48, device=dev), torch.randn(48, device=dev)
    return {"two_stage": (two_stage, (x,)), "scan_of_row_sums": (scan_of_row_sums, (x,)),
            "norm_then_mix": (norm_then_mix, (x, w))}


def steady_state(calls: int = 5) -> tuple[list[dict], list[str]]:
    """Per compiled function: its slab against the lower bound, the slab it holds, the kernels
    a steady-state call runs and what such a call allocates (see the module text). Returns the
    rows and the checks that failed."""
    import tjit
    rows, failures = [], []
    for name, (fn, args) in compiled_functions().items():
        cf = tjit.compile(fn)
        cf(*args)
        explanation = tjit.explain(cf, *args)
        plan = explanation.memory
        try:
            plan.check()
        except ValueError as e:
            failures.append(f"{name}: tjit's slab plan is invalid: {e}")
        held = sum(s.memory.numel() * s.memory.element_size() for s in cf.entry_for(*args).executable.slabs())
        if held != plan.slab_size:
            failures.append(f"{name}: holds {held} B of slab, planned {plan.slab_size} B")
        with TjitKernels(bytes=False) as measured:
            cf(*args)
        failures += check_launches(name, len(explanation.kernels), measured)
        before = tjit.memory.stats()["allocations"]
        cuda_before = torch.cuda.memory_stats().get("allocation.all.allocated", 0) if torch.cuda.is_available() else 0
        for _ in range(calls):
            cf(*args)
        cuda = (torch.cuda.memory_stats().get("allocation.all.allocated", 0) - cuda_before) / calls \
            if torch.cuda.is_available() else None
        allocations = (tjit.memory.stats()["allocations"] - before) / calls
        if allocations:
            failures.append(f"{name}: a steady-state call allocates {allocations} slab(s)")
        rows.append({"function": name, "buffers": len(plan.intervals), "slab_bytes": plan.slab_size,
                     "lower_bound": plan.lower_bound, "held_slab_bytes": held, "kernels": measured.total,
                     "aten_kernels": measured.aten.kernels, "planned_kernels": len(explanation.kernels),
                     "intermediate_allocations_per_call": allocations, "cuda_allocations_per_call": cuda})
    return rows, failures


def print_steady_state(rows: list[dict]) -> None:
    print("\ncompiled functions in steady state: slab planned against the lower bound and held, kernels and "
          "allocations per call")
    print(f"{'function':<18} {'buffers':>7} {'slab B':>8} {'bound B':>8} {'held B':>8} {'kernels':>7} "
          f"{'slab allocs/call':>16} {'CUDA allocs/call (incl. outputs)':>33}")
    for r in rows:
        cuda = "-" if r["cuda_allocations_per_call"] is None else f"{r['cuda_allocations_per_call']:.1f}"
        print(f"{r['function']:<18} {r['buffers']:>7} {r['slab_bytes']:>8} {r['lower_bound']:>8} "
              f"{r['held_slab_bytes']:>8} {r['kernels']:>7} {r['intermediate_allocations_per_call']:>16.1f} {cuda:>33}")
    print("  kernels: measured over one call (Triton's launches + aten kernels tjit ran outside them), checked against "
          "tjit.explain; held: the slab bytes the call's Executable holds")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a synthetic trace of 10,000 buffers, not 100,000")
    ap.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    ap.add_argument("--budget", type=float, default=None,
                    help="time_budget_s for plan_offsets (default: plan_offsets' own)")
    ap.add_argument("--skip-greedy-100k", action="store_true",
                    help="leave greedy-by-size out on the 100,000-buffer trace (it takes ~15 s)")
    args = ap.parse_args()
    tjit_kw = {} if args.budget is None else {"time_budget_s": args.budget}
    planners = {"first-fit (seed)": first_fit_by_start, "greedy-by-size": greedy_by_size,
                "tjit": lambda iv: plan_offsets(iv, **tjit_kw)}
    rows = []

    for name, (model, x) in models().items():
        for backward in (False, True):
            trace = f"{name}-{'fwd+bwd' if backward else 'fwd'}"
            progress(f"tracing {trace} ...")
            intervals, _ = buffers_of(trace_model(model, x, backward))
            rows.append(measure(trace, "model traces", intervals, planners))

    progress("synthetic trace ...")
    big = dict(planners)
    if args.skip_greedy_100k and not args.quick:
        del big["greedy-by-size"]
    if not args.quick:
        big["tjit, 5 s budget"] = lambda iv: plan_offsets(iv, time_budget_s=5.0)
    n = 10_000 if args.quick else 100_000
    rows.append(measure(f"synthetic-{n // 1000}k", "synthetic", synthetic(n), big))

    instances = sorted(MINIMALLOC.glob("*.csv"))
    missing = [] if len(instances) == 11 else [f"found {len(instances)} MiniMalloc instances in {MINIMALLOC}, not 11"]
    for path in instances:
        rows.append(measure(f"minimalloc-{path.stem.split('.')[0]}", "MiniMalloc", minimalloc(path), planners,
                            optimum=int(path.stem.split(".")[1])))

    print_table(rows, list(dict.fromkeys(p for r in rows for p in r.ratio)))
    progress("compiled functions, steady state ...")
    compiled, failures = steady_state()
    failures = missing + failures
    print_steady_state(compiled)
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}: other work on the machine inflates the times")
    print_failures(failures, "every plan valid; each compiled function holds the slab it planned, launches the "
                             "kernels it plans and allocates no slab per call")
    if args.json:
        Path(args.json).write_text(json.dumps({"traces": [asdict(r) for r in rows], "compiled": compiled,
                                               "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

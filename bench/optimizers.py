#!/usr/bin/env python
"""Compiled optimizer steps with a learning-rate schedule: tjit against Inductor (Triton for
CPU tensors, as in bench/models.py).

    python bench/optimizers.py [--steps 100] [--optimizers sgd,adam,adamw] [--json PATH]

Per optimizer (SGD with momentum and weight decay, Adam, AdamW), implementation (foreach,
single-tensor) and compiler: `torch.compile(step, backend=...)` of a function that runs
`opt.step()`, over --steps steps, with a LambdaLR schedule that changes the learning rate
after every step, on PARAMETERS (float32 and bfloat16 tensors of several shapes, larger than
any block: two dtype groups). Eager's optimizer runs beside it on copies with the same
gradients.

Counted per step, after WARM_UP steps (Dynamo recompiles once in the first steps, when the
learning rate first changes and it starts passing it as a 0-d tensor):
  * launches (Triton launches, counted inside Triton) and aten kernels outside them
    (bench/measure.py's instruments), the largest count over the measured steps;
  * recompiles: graphs the backend was handed after the warm-up (Dynamo's recompiles), and
    for tjit its traces and kernel sources generated after the warm-up;
  * the largest difference from eager's parameters over all steps, per dtype (bfloat16's is a
    few units in the last place: eager rounds every foreach op's result to bfloat16, the fused
    kernels round once per parameter update, so the two drift apart over the steps, as
    Inductor's does).
Target (issue 13): at most one launch per dtype/device group (here 2) for SGD, Adam and AdamW,
no library call, and 0 recompiles over the schedule.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import models  # noqa: E402  (Inductor's set-up for the interpreter; imports tjit before triton)
import tjit  # noqa: E402
import torch  # noqa: E402
from measure import AtenKernels, TritonLaunches  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda ps, foreach: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=foreach),
    "adam": lambda ps, foreach: torch.optim.Adam(ps, lr=0.01, foreach=foreach),
    "adamw": lambda ps, foreach: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=foreach),
}
PARAMETERS = [((256, 33), torch.float32), ((1000,), torch.float32), ((7, 5, 64), torch.float32),
              ((128, 40), torch.bfloat16), ((3000,), torch.bfloat16)]
DTYPE_GROUPS = len({dtype for _, dtype in PARAMETERS})
WARM_UP = 3


def gradients(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=g).to(dtype) for shape, dtype in PARAMETERS]


def run_one(name: str, foreach: bool, compiler: str, steps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape, dtype in PARAMETERS]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [OPTIMIZERS[name](ps, foreach) for ps in (params, ref)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s)) for o in opts]
    graphs = [0]
    compile_graph = models.backend(compiler)

    def counting_backend(gm, example_inputs):
        graphs[0] += 1
        return compile_graph(gm, example_inputs)

    torch._dynamo.reset()

    @torch.compile(backend=counting_backend)
    def step():
        opts[0].step()

    row = {"launches": 0, "aten": 0, "max_diff_float32": 0.0, "max_diff_bfloat16": 0.0}
    first_s = None
    for k in range(steps):
        if k == WARM_UP:
            before = (graphs[0], tjit.counters.traces, tjit.counters.kernels_generated)
        for p, q, grad in zip(params, ref, gradients(k)):
            p.grad, q.grad = grad.clone(), grad.clone()
        t = time.perf_counter()
        if k >= WARM_UP:
            aten = AtenKernels()
            with TritonLaunches(bytes=False) as launches:
                with models.inside_compiled(aten):
                    step()
            row["launches"] = max(row["launches"], launches.count)
            row["aten"] = max(row["aten"], len(aten.kernels))
        else:
            step()
        if k == 0:
            first_s = time.perf_counter() - t
        opts[1].step()
        for s in schedules:
            s.step()
        for p, q in zip(params, ref):
            column = f"max_diff_{str(p.dtype)[6:]}"
            row[column] = max(row[column], float((p.float() - q.float()).abs().max()))
    after = (graphs[0], tjit.counters.traces, tjit.counters.kernels_generated)
    row["recompiles"] = after[0] - before[0]
    if compiler == "tjit":
        row["tjit_traces"], row["tjit_kernels_generated"] = after[1] - before[1], after[2] - before[2]
    row["first_step_s"] = first_s
    return row


def print_table(results: dict) -> None:
    print(f"\n{'optimizer':<20}{'compiler':<10}{'launches':>9}{'aten':>6}{'recompiles':>11}{'traces':>8}"
          f"{'new kernels':>12}{'|diff| f32':>12}{'|diff| bf16':>12}{'first step s':>13}")
    for key, per in results.items():
        for comp, r in per.items():
            if "error" in r:
                print(f"{key:<20}{comp:<10}  ERROR {r['error']}")
                continue
            print(f"{key:<20}{comp:<10}{r['launches']:>9}{r['aten']:>6}{r['recompiles']:>11}"
                  f"{r.get('tjit_traces', '-'):>8}{r.get('tjit_kernels_generated', '-'):>12}"
                  f"{r['max_diff_float32']:>12.2e}{r['max_diff_bfloat16']:>12.2e}"
                  f"{r['first_step_s']:>13.2f}")
    tjit_rows = [per["tjit"] for per in results.values() if "tjit" in per and "error" not in per["tjit"]]
    met = tjit_rows and all(r["launches"] <= DTYPE_GROUPS and r["aten"] == 0 and r["recompiles"] == 0
                            and r["tjit_traces"] == 0 for r in tjit_rows)
    print(f"\ntarget: <= {DTYPE_GROUPS} launches ({DTYPE_GROUPS} dtype groups), no aten kernel, 0 recompiles "
          f"after warm-up, on every tjit row: {'met' if met else 'NOT met'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--compilers", default=",".join(models.COMPILERS))
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    opts = ap.parse_args()
    models.setup_inductor()
    results: dict = {}
    for name in opts.optimizers.split(","):
        for foreach in (True, False):
            key = f"{name}/{'foreach' if foreach else 'single'}"
            results[key] = {}
            for comp in opts.compilers.split(","):
                models.progress(f"{key} / {comp}: {opts.steps} steps ...")
                try:
                    results[key][comp] = run_one(name, foreach, comp, opts.steps)
                except Exception as e:  # a compiler that fails has its error in the row
                    results[key][comp] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                models.progress(f"{key} / {comp}: {results[key][comp]}")
    print_table(results)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"results": results, "torch": torch.__version__}, indent=1))
        print(f"JSON written to {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The first call's kernel compiles on a GPU: one after another, or side by side (runtime/precompile.py).

    python bench/precompile.py [--models vit,bert] [--threads 1,2] [--json PATH]

Per zoo model (tests/zoo.py) and thread count, in a fresh process with an empty Triton cache:
the model's training step (forward + loss + backward, through torch.compile(backend="tjit"))
runs once in Triton's interpreter, then every kernel of its compiled graphs is compiled for
sm_90 through Triton's own JIT path (gpu_compile.jit_as_on_gpu: the machine has no GPU, so
Triton's driver is told of one) by precompile.precompile, on a pool of that many threads
(TJIT_COMPILE_THREADS). One thread is what the first call cost before precompiling: each
launch compiled its kernel, one after another. Seconds are wall time on this machine's CPU;
a GPU machine's CPU compiles faster, and has more cores.
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
ROOT = HERE.parent


def measure(name: str) -> dict:
    """In this process: the training step once, then its kernels precompiled for sm_90."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(HERE))
    import copy
    import dataclasses

    import torch
    from models import target_for, train_step
    from zoo import ZOO, WithLoss
    from tjit.lower import gpu_compile
    from tjit.runtime import executor, precompile

    runs = []
    run_steps = executor.Executable._run_steps

    def recording(self, memory, *args, **kwargs):
        runs.append((self, dict(memory)))
        return run_steps(self, memory, *args, **kwargs)

    executor.Executable._run_steps = recording
    spec = ZOO[name]
    torch.manual_seed(0)
    model = spec.build().train()
    x = spec.inputs(torch.Generator().manual_seed(1))
    train_step(torch.compile(WithLoss(model), backend="tjit"), list(model.parameters()), x,
               target_for(spec, x, copy.deepcopy(model)))
    executor.Executable._run_steps = run_steps
    kernels = [(e, m, [s for s in e.launches if isinstance(s, executor.Launch)]) for e, m in runs]
    first = next(launches[0].fn for _, _, launches in kernels if launches)
    with gpu_compile.jit_as_on_gpu(first) as jit:
        start, compiled = time.perf_counter(), 0
        for _, memory, launches in kernels:
            compiled += precompile.precompile([dataclasses.replace(s, fn=jit(s.fn)) for s in launches], memory)
        seconds = time.perf_counter() - start
    return {"model": name, "threads": precompile.workers(), "launches": compiled, "seconds": seconds}


def in_fresh_process(name: str, threads: int) -> dict:
    env = dict(os.environ, TJIT_COMPILE_THREADS=str(threads), TJIT_DISK_CACHE="0",
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="tjit_bench_triton_"))
    out = subprocess.run([sys.executable, __file__, "--_one", name], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{name} with {threads} threads failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vit,bert")
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--_one", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts._one:
        print(json.dumps(measure(opts._one)))
        return 0
    rows = []
    for name in opts.models.split(","):
        for threads in map(int, opts.threads.split(",")):
            print(f"[{time.strftime('%H:%M:%S')}] {name}, {threads} thread(s) ...", file=sys.stderr, flush=True)
            rows.append(in_fresh_process(name, threads))
    print(f"{'model':8s} {'kernel launches':>15s} {'threads':>7s} {'compile s':>9s} {'speed-up':>8s}")
    one_thread = {r["model"]: r["seconds"] for r in rows if r["threads"] == 1}
    for row in rows:
        speedup = f"{one_thread[row['model']] / row['seconds']:.2f}x" if row["model"] in one_thread else "n/a"
        print(f"{row['model']:8s} {row['launches']:15d} {row['threads']:7d} {row['seconds']:9.2f} {speedup:>8s}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
        print(f"JSON written to {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

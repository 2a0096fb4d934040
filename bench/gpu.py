#!/usr/bin/env python
"""On a CUDA GPU: tjit, Inductor and eager PyTorch on the same work, checked and timed.

    python bench/gpu.py [--sections functions,models,profile,tiles,launches] [--functions a,b] [--dtypes float32,...]
                        [--models a,b] [--json PATH]

models: tests/zoo.py's zoo on the GPU (same weights and inputs for every compiler), each through
  `torch.compile(..., backend=...)` (tjit's Dynamo backend, Inductor's compile_fx): the eval
  forward and a training step (forward + cross-entropy + backward, gradients set to None
  between steps). Per compiler: the first call's wall time minus a steady call's (compile
  time, in this process after a warm-up), the steady time per call (triton.testing.do_bench
  median), the peak of the CUDA allocator over a training step above what was allocated before
  it (for tjit plus its slab arena, as bench/models.py counts it), and the largest difference to
  eager of the output, the loss and every gradient.
profile: one steady call of each function (in the last of --dtypes) and of each model's eval
  forward under torch's profiler: wall time against the sum of its GPU kernels' times (a call
  far above its kernels' time is bound by host work) and the longest kernels.
tiles: every product generated, at each of TILES' tile sizes, timed.
launches: the time per call of each function (in the last of --dtypes) and each model's eval
  forward, with tjit's launches after the first going straight through Triton's binary
  (runtime/relaunch.py) against every launch through JITFunction.run, alternating.
functions: matrix products with fused work around them at sizes that fill the GPU, in float32,
  float16 and bfloat16: time per call, TFLOP/s (2*m*n*k per product over the time) and the
  relative error ||out - ref|| / ||ref|| against a float64 reference, for eager, Inductor and
  tjit (tjit.compile); tjit's kernels and library calls per call.

The zoo's models are small (batch 2, sequences of 16): their steady times are mostly launch and
host overhead. Progress goes to stderr, tables to stdout.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tjit  # noqa: E402
from matmul import attention, gelu_linear, mlp_block  # noqa: E402
from models import maxdiff, peak_step_bytes, train_step  # noqa: E402
from zoo import ZOO, WithLoss  # noqa: E402

COMPILERS = ("eager", "tjit", "inductor")


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_ms(call) -> float:
    from triton.testing import do_bench
    return do_bench(call, warmup=25, rep=100, return_mode="median")


def wall(call) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def record_error(row: dict, error: Exception) -> None:
    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    row["traceback"] = traceback.format_exc()[-3000:]


def compiled_with(compiler: str, module):
    if compiler == "eager":
        return module
    if compiler == "tjit":
        from tjit.runtime.dynamo_backend import tjit_backend
        return torch.compile(module, backend=tjit_backend)
    return torch.compile(module)


# -- models --------------------------------------------------------------------------------------

def run_model(name: str, compiler: str) -> dict:
    import torch._dynamo
    torch._dynamo.reset()
    spec = ZOO[name]
    torch.manual_seed(0)
    model = spec.build().cuda()
    eager = copy.deepcopy(model)
    x = spec.inputs(torch.Generator().manual_seed(1)).cuda()
    row: dict = {"model": name, "compiler": compiler}
    try:
        model.eval(), eager.eval()
        with torch.no_grad():
            out = eager(x)
            target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=torch.Generator().manual_seed(0)).cuda()
            compiled = compiled_with(compiler, model)
            first = wall(lambda: compiled(x))
            row["eval_compile_s"] = max(first - wall(lambda: compiled(x)), 0.0)
            row["eval_maxdiff"] = maxdiff(compiled(x), out)
            row["eval_ms"] = median_ms(lambda: compiled(x))
        del compiled
        torch._dynamo.reset()
        gc.collect()
        tjit.memory.release()
        model.train(), eager.train()
        wrapped = compiled_with(compiler, WithLoss(model))
        params, eager_params = list(model.parameters()), list(eager.parameters())
        first = wall(lambda: train_step(wrapped, params, x, target))
        row["train_compile_s"] = max(first - wall(lambda: train_step(wrapped, params, x, target)), 0.0)
        loss = train_step(wrapped, params, x, target)
        want = train_step(WithLoss(eager), eager_params, x, target)
        row["train_maxdiff"] = max([maxdiff(loss, want)] + [maxdiff(p.grad, q.grad) for p, q in zip(params, eager_params)
                                                             if p.grad is not None and q.grad is not None])
        row["train_ms"] = median_ms(lambda: train_step(wrapped, params, x, target))
        row["peak_bytes"] = peak_step_bytes(wrapped, params, x, target)
        if compiler == "tjit":
            row["peak_bytes"] += tjit.memory.stats()["in_use_bytes"]
            before = tjit.counters.launches
            train_step(wrapped, params, x, target)
            row["train_launches"] = tjit.counters.launches - before
    except Exception as e:  # noqa: BLE001  (recorded in the row)
        record_error(row, e)
    return row


MODEL_HEADER = (f"{'model':<10} {'compiler':<9} {'eval c.s':>8} {'eval ms':>8} {'train c.s':>9} {'train ms':>9} "
                f"{'peak MB':>8} {'diff':>8} {'tjit launches':>13}")


def model_line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<10} {r['compiler']:<9} ERROR {r['error']}"
    return (f"{r['model']:<10} {r['compiler']:<9} {r['eval_compile_s']:>8.2f} {r['eval_ms']:>8.3f} "
            f"{r['train_compile_s']:>9.2f} {r['train_ms']:>9.3f} {r['peak_bytes'] / 2**20:>8.2f} "
            f"{max(r['eval_maxdiff'], r['train_maxdiff']):>8.1e} {r.get('train_launches', ''):>13}")


# -- functions -----------------------------------------------------------------------------------

def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def linear_ce(h, w, target):
    """(bench/matmul.py's, with the logits in float32 as LLM training code computes its loss)"""
    return F.cross_entropy(F.linear(h, w).float(), target)


def function_inputs(name: str, dtype: torch.dtype) -> tuple[tuple, float]:
    """The inputs and the products' floating-point operations."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)
    if name == "gelu_linear":
        return (randn(4096, 4096), randn(4096, 4096, scale=0.02), randn(4096)), 2 * 4096 ** 3
    if name == "mlp_block":
        return ((randn(8, 512, 1024), randn(4096, 1024, scale=0.03), randn(4096), randn(1024, 4096, scale=0.02),
                 randn(1024)), 2 * 2 * 4096 * 4096 * 1024)
    if name in ("attention", "causal_sdpa"):
        q, k, v = (randn(8, 16, 1024, 64) for _ in range(3))
        flops = 2 * 2 * 8 * 16 * 1024 * 1024 * 64
        return (q, k, v), flops / (2 if name == "causal_sdpa" else 1)
    target = torch.randint(0, 32000, (4096,), generator=g, device="cuda")
    return (randn(4096, 1024), randn(32000, 1024, scale=0.03), target), 2 * 4096 * 32000 * 1024


FUNCTIONS = {"gelu_linear": gelu_linear, "mlp_block": mlp_block, "attention": attention,
             "causal_sdpa": causal_sdpa, "linear_ce": linear_ce}


def relative_error(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def run_function(name: str, dtype: torch.dtype) -> list[dict]:
    import torch._dynamo
    fn = FUNCTIONS[name]
    args, flops = function_inputs(name, dtype)
    wide = [a.double() if a.is_floating_point() else a for a in args]
    with torch.no_grad():
        ref = fn(*wide) if name != "causal_sdpa" else fn(*[a.float() for a in args]).double()
    rows = []
    for compiler in COMPILERS:
        torch._dynamo.reset()
        row = {"function": name, "dtype": str(dtype).removeprefix("torch."), "compiler": compiler}
        try:
            f = {"eager": fn, "tjit": tjit.compile(fn), "inductor": torch.compile(fn)}[compiler]
            with torch.no_grad():
                row["first_s"] = wall(lambda: f(*args))
                out = f(*args)
                row["rel_error"] = relative_error(out, ref)
                if compiler == "tjit":
                    launches, calls = tjit.counters.launches, tjit.counters.library_calls
                    f(*args)
                    row["launches"] = tjit.counters.launches - launches
                    row["library_calls"] = tjit.counters.library_calls - calls
                row["ms"] = median_ms(lambda: f(*args))
                row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001  (recorded in the row)
            record_error(row, e)
        rows.append(row)
    return rows


FUNCTION_HEADER = (f"{'function':<12} {'dtype':<9} {'compiler':<9} {'first s':>8} {'ms':>8} {'TFLOP/s':>8} "
                   f"{'rel err':>8} {'tjit kernels+lib':>16}")


def function_line(r: dict) -> str:
    if "error" in r:
        return f"{r['function']:<12} {r['dtype']:<9} {r['compiler']:<9} ERROR {r['error']}"
    kernels = f"{r['launches']}+{r['library_calls']}" if "launches" in r else ""
    return (f"{r['function']:<12} {r['dtype']:<9} {r['compiler']:<9} {r['first_s']:>8.2f} {r['ms']:>8.3f} "
            f"{r['tflops']:>8.1f} {r['rel_error']:>8.1e} {kernels:>16}")


# -- generated products' tiles --------------------------------------------------------------------

# (rows, columns, k step, warps, stages): tjit's own choice first
TILES = {"bfloat16": [None, (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
                      (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (256, 128, 64, 8, 3)],
         "float32": [None, (64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (128, 128, 32, 8, 3), (64, 128, 32, 4, 4)]}
TILED_FUNCTIONS = {"gelu_linear": gelu_linear, "norm_linear": lambda x, w, b: gelu_linear(
    F.layer_norm(x, (x.shape[-1],)), w, b), "linear_ce": linear_ce}


def run_tiles(dtype_name: str) -> list[dict]:
    """Every product generated (TJIT_MATMUL=generated), at each tile of TILES (forced by
    replacing lower/schedule.py's choice), timed; float32 under torch's "high" precision (tf32,
    as eager's cuBLAS then) and "highest" (exact, FMA) for tjit's own tiles."""
    from tjit.lower import codegen, schedule
    chosen = schedule.dot_tiles
    dtype = getattr(torch, dtype_name)
    rows = []
    os.environ["TJIT_MATMUL"] = "generated"
    precisions = ["high", "highest"] if dtype_name == "float32" else ["highest"]
    try:
        for name, fn in TILED_FUNCTIONS.items():
            args, flops = function_inputs("linear_ce" if name == "linear_ce" else "gelu_linear", dtype)
            if name == "norm_linear":
                args = (args[0][:, :1024].contiguous(), args[1][:, :1024].contiguous(), args[2])
                flops = 2 * 4096 * 4096 * 1024
            for precision in precisions:
                torch.set_float32_matmul_precision(precision)
                base = median_ms(lambda: fn(*args))
                for tiles in TILES[dtype_name] if precision == "high" or dtype_name != "float32" else [None]:
                    seen = []

                    def recorded(*a, **k):
                        seen.append(chosen(*a, **k))
                        return seen[-1]
                    forced = (lambda *a, **k: schedule.DotTiles(*tiles)) if tiles else recorded
                    schedule.dot_tiles = codegen.dot_tiles = forced
                    row = {"function": name, "dtype": dtype_name, "precision": precision,
                           "tiles": list(tiles) if tiles else "tjit's", "eager_ms": base}
                    try:
                        f = tjit.compile(fn)
                        with torch.no_grad():
                            out, want = f(*args), fn(*args)
                        row["rel_diff"] = float((out.float() - want.float()).norm() / want.float().norm())
                        row["ms"] = median_ms(lambda: f(*args))
                        row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                        row["chosen"] = seen[-1].describe() if seen else ""
                    except Exception as e:  # noqa: BLE001  (recorded in the row)
                        record_error(row, e)
                    rows.append(row)
                    print(tiles_line(row), flush=True)
    finally:
        schedule.dot_tiles = codegen.dot_tiles = chosen
        torch.set_float32_matmul_precision("highest")
        del os.environ["TJIT_MATMUL"]
    return rows


TILES_HEADER = f"{'function':<12} {'dtype':<9} {'precision':<9} {'tiles':<22} {'ms':>8} {'TFLOP/s':>8} {'eager ms':>8} {'diff':>8}"


def tiles_line(r: dict) -> str:
    head = f"{r['function']:<12} {r['dtype']:<9} {r['precision']:<9} {str(r['tiles']):<22}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    return f"{head} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['eager_ms']:>8.3f} {r['rel_diff']:>8.1e} {r['chosen']}"


# -- where a call's time goes ------------------------------------------------------------------------

def profile_call(call, top: int = 8) -> dict:
    """One steady call under torch's profiler: the GPU time of each kernel (Triton's and the
    library's), their sum against the call's wall time (a call whose wall time is far above
    its kernels' is bound by host work: tjit's Python, Triton's launcher, library calls'
    dispatch), and the kernels that took longest."""
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s = wall(call)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    times: dict = {}
    for e in kernels:
        times[e.name] = times.get(e.name, 0.0) + e.device_time_total
    if not kernels:  # (a build whose events() lists no device events: the ops' own device time)
        for e in prof.events():
            if e.self_device_time_total:
                times[e.name] = times.get(e.name, 0.0) + e.self_device_time_total
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {"wall_us": wall_s * 1e6, "kernels_us": sum(times.values()), "kernel_count": len(kernels),
            "top": [(name[:60], us) for name, us in ranked]}


def run_profiles(functions: list[str], dtype: torch.dtype, models: list[str]) -> list[dict]:
    import torch._dynamo
    rows = []
    for name in functions:
        args, _ = function_inputs(name, dtype)
        for compiler in COMPILERS:
            torch._dynamo.reset()
            f = {"eager": FUNCTIONS[name], "tjit": tjit.compile(FUNCTIONS[name]),
                 "inductor": torch.compile(FUNCTIONS[name])}[compiler]
            with torch.no_grad():
                rows.append({"what": f"{name} {str(dtype).removeprefix('torch.')}", "compiler": compiler,
                             **profile_call(lambda: f(*args))})
            print(profile_line(rows[-1]), flush=True)
    for name in models:
        torch.manual_seed(0)
        model = ZOO[name].build().cuda().eval()
        x = ZOO[name].inputs(torch.Generator().manual_seed(1)).cuda()
        for compiler in COMPILERS:
            torch._dynamo.reset()
            compiled = compiled_with(compiler, model)
            with torch.no_grad():
                rows.append({"what": f"{name} eval", "compiler": compiler, **profile_call(lambda: compiled(x))})
            print(profile_line(rows[-1]), flush=True)
    return rows


# -- launching kernels again through their binaries ----------------------------------------------

def host_us(call, calls: int = 100) -> float:
    """Time per call of a loop of calls, synchronised once at its end: the host's time where
    the GPU waits for it (a small model), else the GPU's."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def run_launches(functions: list[str], dtype: torch.dtype, models: list[str], rounds: int = 5) -> list[dict]:
    """Per function and zoo model (eval), the time per call with each launch after the first
    of a pointer alignment going straight through the binary Triton compiled (tjit's
    runtime/relaunch.py) and with every launch through JITFunction.run: the two alternate
    for `rounds` rounds and each keeps its median (single loops varied by 30% on an H100)."""
    import torch._dynamo
    from tjit.runtime.relaunch import Binaries
    label = str(dtype).removeprefix("torch.")
    calls = {f"{name} {label}": (tjit.compile(FUNCTIONS[name]), function_inputs(name, dtype)[0]) for name in functions}
    for name in models:
        torch.manual_seed(0)
        torch._dynamo.reset()
        x = ZOO[name].inputs(torch.Generator().manual_seed(1)).cuda()
        calls[f"{name} eval"] = (compiled_with("tjit", ZOO[name].build().cuda().eval()), (x,))
    rows = []
    for what, (f, args) in calls.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        try:
            with torch.no_grad():
                for _ in range(rounds):
                    for relaunching in (True, False):
                        Binaries.enabled = relaunching
                        times[relaunching].append(host_us(lambda: f(*args)))
        finally:
            Binaries.enabled = True
        row = {"what": what, "relaunch_us": sorted(times[True])[rounds // 2],
               "run_us": sorted(times[False])[rounds // 2]}
        rows.append(row)
        print(f"{what:<24} {row['relaunch_us']:>10.0f} {row['run_us']:>10.0f}", flush=True)
    return rows


def profile_line(r: dict) -> str:
    top = "; ".join(f"{name} {us:.0f}" for name, us in r["top"][:4])
    return (f"{r['what']:<20} {r['compiler']:<9} wall {r['wall_us']:>8.0f} us, {r['kernel_count']:>3} GPU kernels "
            f"{r['kernels_us']:>8.0f} us | {top}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="functions,models")
    parser.add_argument("--models", default=",".join(ZOO))
    parser.add_argument("--functions", default=",".join(FUNCTIONS))
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    results: dict = {"device": torch.cuda.get_device_name(), "models": [], "functions": []}

    def save():  # after every row: a run stopped at its time limit keeps what it measured
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(results, f, indent=1)
    sections = opts.sections.split(",")
    if "functions" in sections:
        print("\n== matrix products with fused work: first call s, steady ms, TFLOP/s, rel. error vs float64 ==")
        print(FUNCTION_HEADER, flush=True)
        for name in opts.functions.split(","):
            for dtype in opts.dtypes.split(","):
                progress(f"function {name} {dtype}")
                for row in run_function(name, getattr(torch, dtype)):
                    results["functions"].append(row)
                    print(function_line(row), flush=True)
                save()
    if "profile" in sections:
        print("\n== one call profiled: wall time against the GPU kernels' time, longest kernels (us) ==", flush=True)
        progress("profiles")
        results["profiles"] = run_profiles(opts.functions.split(","), getattr(torch, opts.dtypes.split(",")[-1]),
                                           opts.models.split(","))
        save()
    if "launches" in sections:
        print("\n== us per call: launches again through Triton's binary | through JITFunction.run (medians) ==",
              flush=True)
        progress("launches")
        results["launches"] = run_launches(opts.functions.split(","), getattr(torch, opts.dtypes.split(",")[-1]),
                                           opts.models.split(","))
        save()
    if "tiles" in sections:
        print("\n== generated products at forced tiles (TJIT_MATMUL=generated) ==")
        print(TILES_HEADER, flush=True)
        results["tiles"] = []
        for dtype in opts.dtypes.split(","):
            progress(f"tiles {dtype}")
            results["tiles"].extend(run_tiles(dtype))
            save()
    if "models" in sections:
        print("\n== zoo (eval forward; training step): compile s, steady ms, step peak MB, max diff to eager ==")
        print(MODEL_HEADER, flush=True)
        for name in opts.models.split(","):
            for compiler in COMPILERS:
                progress(f"model {name}: {compiler}")
                row = run_model(name, compiler)
                results["models"].append(row)
                print(model_line(row), flush=True)
                save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

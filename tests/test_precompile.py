"""A Program's kernels compiled in parallel before its first launch on a GPU (runtime/precompile.py).

With no GPU here, Triton's own JIT path is pointed at an sm_90 target (gpu_compile.jit_as_on_gpu):
`warmup` then specialises, compiles and caches binaries exactly as on a GPU machine, and the
test checks that the binaries precompile made are the ones the launches, with the arguments a
real call gave them, find in the kernel's cache.
"""
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
import triton
from triton.runtime.jit import JITFunction

import tjit
from tjit.lower import gpu_compile
from tjit.runtime import executor, precompile

pytestmark = pytest.mark.usefixtures("fresh_seed")


def norm_softmax_scan(x, w, b, g):
    h = F.layer_norm(x, (x.shape[-1],), w, b)
    return (torch.softmax(h * g, -1).cumsum(-1) * x).sum()


def training_step_args():
    x = torch.randn(300, 70, requires_grad=True)  # rows over several programs
    w, b, g = (torch.randn(70, requires_grad=True) for _ in range(3))
    return x, w, b, g


class Runs(list):
    def __repr__(self):  # (pytest prints a failed test's arguments: memory freed since must not be read)
        return f"<{len(self)} runs>"


@pytest.fixture
def first_runs(monkeypatch):
    """Each Executable run, with the memory bound before its first step (what run() hands
    precompile) and the arguments of each of its kernel launches."""
    runs = Runs()
    run_steps, start = executor.Executable._run_steps, executor.Executable._start

    def recording_run_steps(self, memory, *args, **kwargs):
        runs.append((self, dict(memory), {}))
        return run_steps(self, memory, *args, **kwargs)

    def recording_start(launch, args):
        runs[-1][2][launch.step] = list(args)
        return start(launch, args)

    monkeypatch.setattr(executor.Executable, "_run_steps", recording_run_steps)
    monkeypatch.setattr(executor.Executable, "_start", staticmethod(recording_start))
    return runs


def kernel_launches(executable, jit=None) -> list:
    launches = [step for step in executable.launches if isinstance(step, executor.Launch)]
    return launches if jit is None else [dataclasses.replace(launch, fn=jit(launch.fn)) for launch in launches]


def launched_again(launch, args):
    """What the launch's JITFunction.run does with these arguments, short of launching."""
    return launch.fn.run(*args, grid=launch.plan.grid, warmup=True, num_warps=launch.plan.num_warps,
                         num_stages=launch.plan.num_stages, **launch.constexprs)


def test_the_binaries_precompiled_are_the_ones_the_launches_find(first_runs):
    args = training_step_args()
    tjit.compile(norm_softmax_scan)(*args).backward()
    runs = [(e, memory, launch_args) for e, memory, launch_args in first_runs if kernel_launches(e)]
    assert len(runs) == 2  # the forward, then the backward
    first_kernel = kernel_launches(runs[0][0])[0].fn
    with gpu_compile.jit_as_on_gpu(first_kernel) as jit:
        for executable, memory, launch_args in runs:
            launches = kernel_launches(executable, jit)
            assert precompile.precompile(launches, memory) == len(launches)
            for launch in launches:
                cache = launch.fn.device_caches[0][0]  # (its keys only: a binary's repr would load it on a GPU)
                keys = set(cache)
                cubin = launched_again(launch, launch_args[launch.step]).asm["cubin"]
                compiled_anew = len(set(cache) - keys)
                assert compiled_anew == 0, f"{launch.plan.name}: its launch compiled a binary precompile did not make"
                assert len(cubin) > 0, launch.plan.name
        # (the check sees a compile where there was none before: a fresh JITFunction's first launch)
        launch = kernel_launches(runs[0][0], jit)[0]
        fresh = dataclasses.replace(launch, fn=JITFunction(launch.fn.fn))
        launched_again(fresh, runs[0][2][launch.step])
        assert len(fresh.fn.device_caches[0][0]) == 1


def test_a_callers_own_async_compile_is_left_to_it(first_runs):
    x = torch.randn(300, 70)
    tjit.compile(lambda x: torch.softmax(x, -1))(x)
    executable, memory, _ = first_runs[0]
    with ThreadPoolExecutor(1) as pool, triton.AsyncCompileMode(pool):
        assert precompile.precompile(kernel_launches(executable), memory) == 0  # (it cannot be nested)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy's, off the interpreter's errstate: see Executable.run)
@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_program_is_precompiled_at_its_first_run_off_the_interpreter(monkeypatch, switch):
    monkeypatch.setenv("TJIT_PRECOMPILE", switch)
    calls = []
    monkeypatch.setattr(precompile, "precompile", lambda launches, memory: calls.append(len(launches)))
    compiled = tjit.compile(lambda x: torch.softmax(x, -1) * x.sum(0))
    x = torch.randn(300, 70)
    executable = compiled.entry_for(x).executable
    launches = len(kernel_launches(executable))
    executable._interpreting = False  # (as on a GPU: its launches still run in the interpreter here)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), torch.softmax(x, -1) * x.sum(0))
    assert calls == ([launches] if switch == "1" else [])

"""Compile a Triton kernel for an NVIDIA GPU without having one, and report what ptxas made of it.

Used by tests to prove that generated kernels lower all the way to a cubin for Hopper (sm_90a)
and do not spill, on a machine with no GPU and under ``TRITON_INTERPRET=1``.

Where each number comes from:
  * ``registers``, ``local_memory``, ``stack_frame``: ``cuobjdump --dump-resource-usage`` run on
    the cubin Triton produced (REG / LOCAL / STACK), so they describe the binary Triton would
    launch. Spilled registers go to the stack frame, not to LOCAL, which stays 0 when spilling.
  * ``spill_stores``, ``spill_loads``: ptxas' verbose ``-v`` log ("N bytes spill stores, M bytes
    spill loads": bytes moved by the spill instructions in the code, not the frame size). Triton
    runs ptxas with ``-v`` but deletes the log, and on an on-disk cache hit it skips ptxas
    altogether, so we run the same ptxas again on Triton's PTX with Triton's flags (~50 ms) and
    check that it allocates as many registers as Triton's cubin has. cuobjdump has no spill
    counts, and ``CompiledKernel.metadata.n_regs/n_spills`` are only filled in when the kernel is
    loaded on a real device.
  * ``vector_loads``, ``scalar_loads``: a count of ``ld.global`` instructions in the PTX.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction


class GpuCompileError(RuntimeError):
    """Triton (or ptxas) rejected a kernel; the message names the kernel and quotes the compiler."""


@dataclass(frozen=True)
class GpuCompileReport:
    kernel_name: str
    arch: int  # compute capability, e.g. 90
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    local_memory: int  # LOCAL: bytes per thread of .local variables; spill slots are NOT counted here
    stack_frame: int  # STACK: bytes per thread of stack frame, where spill slots live
    vector_loads: int  # ld.global.v2/.v4/.v8 instructions in the PTX
    scalar_loads: int  # other ld.global instructions in the PTX
    ptx: str
    compile_seconds: float = 0.0  # wall time of the (uncached) compile

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


_TORCH_TO_TRITON: dict[torch.dtype, str] = {
    torch.bool: "i1",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


def triton_type_of(dtype: torch.dtype, pointer: bool) -> str:
    """The Triton signature string for a scalar of `dtype`, or a pointer to one."""
    try:
        ty = _TORCH_TO_TRITON[dtype]
    except KeyError:
        raise TypeError(f"no Triton type for torch dtype {dtype}") from None
    return "*" + ty if pointer else ty


_cache: dict[tuple, GpuCompileReport] = {}


def compile_for_gpu(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, object],
    *,
    arch: int = 90,
    num_warps: int = 4,
    num_stages: int = 3,
    divisible_by_16: tuple[str, ...] = (),
) -> GpuCompileReport:
    """Compile `fn` (a JITFunction or, under TRITON_INTERPRET=1, an InterpretedFunction) to a cubin.

    `signature` gives a Triton type per runtime argument ("*fp32", "i32", ...), `constexprs` a value
    per constexpr argument; `divisible_by_16` names arguments to mark ``tt.divisibility=16``, as the
    JIT does for 16-byte-aligned pointers and multiples of 16, which is what lets masked loads
    vectorise.
    """
    with _compiler_view(fn) as jit_fn:
        name = jit_fn.__name__
        # Order matters: ASTSource identifies arguments by position.
        params = list(inspect.signature(jit_fn.fn).parameters.values())
        arg_names = [p.name for p in params]
        constexprs = dict(constexprs)
        for p in params:  # constexprs left at their defaults, as a normal launch would
            if p.name not in signature and p.name not in constexprs and p.default is not p.empty:
                constexprs[p.name] = p.default
        unknown = (set(signature) | set(constexprs) | set(divisible_by_16)) - set(arg_names)
        missing = [n for n in arg_names if n not in signature and n not in constexprs]
        if unknown or missing:
            raise ValueError(f"kernel {name!r}: unknown arguments {sorted(unknown)}, missing arguments {missing}")

        # cache_key hashes the source of the kernel and of the jit functions it calls.
        key = (jit_fn.cache_key, tuple(sorted(signature.items())),
               tuple(sorted((k, repr(v)) for k, v in constexprs.items())), arch, num_warps,
               num_stages, tuple(sorted(divisible_by_16)))
        if key in _cache:
            return _cache[key]

        # A constexpr's signature entry is the string "constexpr"; its value goes in `constexprs`.
        full_sig = {n: signature.get(n, "constexpr") for n in arg_names}
        # attrs: {(arg index,): [[attribute, value], ...]}, the form JITFunction._pack_args builds.
        attrs = {(arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}
        start = time.perf_counter()
        try:
            kernel = triton.compile(ASTSource(jit_fn, full_sig, constexprs, attrs),
                                    target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})
        except Exception as e:  # CompilationError, PTXASError, MLIR pass failures, ...
            raise GpuCompileError(f"Triton failed to compile kernel {name!r} for sm_{arch}: "
                                  f"{type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - start

    ptx: str = kernel.asm["ptx"]
    usage = _resource_usage(kernel.asm["cubin"], kernel.metadata.name)
    regs, spill_stores, spill_loads = _ptxas_verbose(ptx, arch, kernel.metadata)
    if regs != usage["REG"]:  # our ptxas run did not reproduce Triton's: its spill counts may not apply
        raise GpuCompileError(f"kernel {name!r}: ptxas -v used {regs} registers but Triton's cubin has "
                              f"{usage['REG']}; gpu_compile's ptxas flags no longer match Triton's")
    vector, scalar = _count_global_loads(ptx)
    report = GpuCompileReport(kernel_name=kernel.metadata.name, arch=arch, registers=usage["REG"],
                              spill_stores=spill_stores, spill_loads=spill_loads, local_memory=usage["LOCAL"],
                              stack_frame=usage["STACK"], vector_loads=vector, scalar_loads=scalar, ptx=ptx,
                              compile_seconds=seconds)
    _cache[key] = report
    return report


# Compiling under the interpreter -----------------------------------------------------------------
#
# With TRITON_INTERPRET=1 set when triton.language is imported, every @triton.jit function is an
# InterpretedFunction: the user's kernel and its helpers, but also triton's own library (tl.sum,
# tl.max, tl.cdiv, ... and their tensor-method forms x.sum()). The code generator only lowers
# calls to JITFunctions; handed an InterpretedFunction it *calls* it, which patches triton.language
# for the interpreter and never restores it, breaking every later compile in the process. So for
# the duration of a compile we swap each InterpretedFunction reachable from the kernel (through
# module globals) and from triton.language for a JITFunction of the same Python function, switch
# the interpreter knob off (constexpr functions consult it), and put everything back afterwards.
# The swap is in place and process-wide, hence the lock; an interpreted kernel running on another
# thread meanwhile would see compiler objects.

_lock = threading.Lock()
_jit_of: "weakref.WeakKeyDictionary[Any, JITFunction]" = weakref.WeakKeyDictionary()


def _jit_for(fn: Any) -> JITFunction:
    """The JITFunction standing in for InterpretedFunction `fn` (memoised: it caches its hash)."""
    if fn not in _jit_of:
        _jit_of[fn] = JITFunction(fn.fn, **fn.kwargs)  # same decorator options (noinline, ...)
    return _jit_of[fn]


@contextmanager
def _compiler_view(fn: Any) -> Iterator[JITFunction]:
    """Yield a JITFunction for `fn` with the interpreter out of the way (see above)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(fn, JITFunction):
        kernel_globals = fn.__globals__
    elif isinstance(fn, InterpretedFunction):
        kernel_globals = fn.fn.__globals__
    else:
        raise TypeError(f"expected a @triton.jit function, got {type(fn).__name__}")
    undo: list[Callable[[], None]] = []
    with _lock, triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        try:
            # Walk module globals from the kernel's and triton.language's, following the globals
            # of each interpreted function found (its helpers may live in other modules).
            # Modules the kernel names (e.g. tjit's `tm` helpers) are walked one level deep.
            todo = [kernel_globals] + [vars(m) for n, m in list(sys.modules.items())
                                       if n.startswith("triton.language") and m is not None]
            todo += [vars(v) for v in kernel_globals.values() if inspect.ismodule(v)]
            done: set[int] = set()
            while todo:
                scope = todo.pop()
                if id(scope) in done:
                    continue
                done.add(id(scope))
                for name, value in list(scope.items()):
                    if isinstance(value, InterpretedFunction):
                        scope[name] = _jit_for(value)
                        undo.append(functools.partial(scope.__setitem__, name, value))
                        todo.append(value.fn.__globals__)
            # Tensor methods like x.sum() are closures over the interpreted function; without the
            # interpreter triton installs the JITFunction itself as the method.
            for name, method in list(vars(tl.core.tensor).items()):
                target = next((c.cell_contents for c in getattr(method, "__closure__", None) or ()
                               if isinstance(c.cell_contents, InterpretedFunction)), None)
                if target is not None:
                    setattr(tl.core.tensor, name, _jit_for(target))
                    undo.append(functools.partial(setattr, tl.core.tensor, name, method))
            yield fn if isinstance(fn, JITFunction) else _jit_for(fn)
        finally:
            for restore in reversed(undo):
                restore()


class _CompileOnlyDriver:
    """Triton's driver as its JIT asks it while compiling (warmup): device 0 of an sm_`arch`
    GPU. Nothing can be launched through it."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@contextmanager
def jit_as_on_gpu(kernel: Any, arch: int = 90) -> Iterator[Callable[[Any], JITFunction]]:
    """Inside, Triton's own JIT path compiles for sm_`arch` as on a GPU machine: the function
    yielded turns an interpreted tjit kernel into its JITFunction, whose `warmup` (and
    `run(..., warmup=True)`) specialises, compiles and caches its binary as a launch would.
    `kernel` is any generated kernel: the swap of interpreted functions it needs is
    process-wide, and so is the driver's (tjit's generated kernels share their helpers)."""
    with _compiler_view(kernel):
        previous = triton.runtime.driver._active  # (None where no driver was made: none is active here)
        triton.runtime.driver.set_active(_CompileOnlyDriver(arch))
        try:
            yield _jit_for
        finally:
            triton.runtime.driver.set_active(previous)


def _run_tool(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise GpuCompileError(f"{what} failed ({proc.returncode}): {proc.stderr or proc.stdout}")
    return proc.stdout + proc.stderr


def _resource_usage(cubin: bytes, kernel_name: str) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL, ... for `kernel_name` from ``cuobjdump --dump-resource-usage``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = _run_tool([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path], "cuobjdump")
    # "Function add_kernel:\n  REG:29 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:576 ..."
    m = re.search(rf"Function {re.escape(kernel_name)}:\s*\n(.*)", out)
    if m is None:
        raise GpuCompileError(f"cuobjdump printed no resource usage for {kernel_name!r}:\n{out}")
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", m.group(1))}


def _ptxas_verbose(ptx: str, arch: int, opts: Any) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v`` with Triton's flags."""
    flags = ["-v", "--regAllocOptLevel=2"]  # as NVIDIA's make_cubin; changes register allocation
    if not opts.enable_fp_fusion:
        flags.append("--fmad=false")
    if opts.ptx_options:
        flags += opts.ptx_options.split()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = _run_tool([get_ptxas(arch).path, *flags, f"--gpu-name={sm_arch_from_capability(arch)}", src,
                         "-o", os.path.join(tmp, "kernel.cubin")], "ptxas")
    # "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n ... Used 28 registers"
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    if spills is None or regs is None:
        raise GpuCompileError(f"no register or spill counts in the ptxas log:\n{log}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


# An ld.global opcode, after an optional predicate: "@%p1 ld.global.L1::evict_last.v4.b32 {...}, [...]".
_LD_GLOBAL = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld\.global\S*)", re.MULTILINE)


def _count_global_loads(ptx: str) -> tuple[int, int]:
    """(vector, scalar) ld.global instruction counts."""
    ops = _LD_GLOBAL.findall(ptx)
    vector = sum(1 for op in ops if re.search(r"\.v\d+\.", op))
    return vector, len(ops) - vector


def launch_signature(plan, described_args) -> tuple[dict[str, str], dict[str, Any], tuple[str, ...]]:
    """Triton's JIT specialisations for one launch of a tjit kernel, mimicked: ints equal to 1
    become constexprs, ints and pointers divisible by 16 are marked so loads can vectorise.
    `described_args` are as tjit.runtime.loader.describe_arg gives them."""
    signature, constexprs, divisible = {}, dict(plan.constexprs), []
    for name, arg in zip(plan.param_names, described_args):
        if isinstance(arg, tuple):  # (dtype, data_ptr) of a tensor
            dtype, ptr = arg
            signature[name] = triton_type_of(dtype, pointer=True)
            if ptr % 16 == 0:
                divisible.append(name)
        elif arg == 1:
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -2**31 <= arg < 2**31 else "i64"
            if arg % 16 == 0:
                divisible.append(name)
    return signature, constexprs, tuple(divisible)


def compile_launched(plan, described_args, arch: int = 90) -> GpuCompileReport:
    """Compile a tjit kernel for a GPU exactly as it was launched (specialisations, warps)."""
    from ..runtime.loader import load_kernel
    signature, constexprs, divisible = launch_signature(plan, described_args)
    return compile_for_gpu(load_kernel(plan), signature, constexprs, arch=arch, num_warps=plan.num_warps,
                           num_stages=plan.num_stages, divisible_by_16=divisible)

"""How the benchmarks count kernels and bytes: measured while the code runs, never read from
tjit's plans (those are what the measurements check).

* Kernels eager runs (AtenKernels, a TorchDispatchMode). The mode sees every aten op that
  eager PyTorch dispatches to a backend kernel: below autograd and after the
  CompositeImplicitAutograd decompositions, so F.layer_norm is one native_layer_norm,
  F.cross_entropy is _log_softmax + nll_loss_forward, torch.var_mean one var_mean, and
  F.rms_norm whatever this build runs for it on this device. One such op counts as one
  kernel unless it runs none: a view or alias (t, expand, slice, detach, _unsafe_view: an
  op that writes nothing and returns tensors on its inputs' storage), an in-place metadata
  change (t_, as_strided_), an allocation that leaves memory unwritten (empty,
  empty_strided, empty_like, new_empty), set_/resize_, a scalar read to the host
  (_local_scalar_dense: a copy, not a kernel) or an op whose tensor outputs are all empty.
  The count is eager's own dispatch on this device, not a reading of any graph; on CUDA an
  aten op may launch more than one kernel (a fill before a reduction), so it is a lower
  bound there.
* Triton launches (TritonLaunches): counted inside Triton, independently of tjit's own
  counter. In the interpreter (no CUDA) GridExecutor.__call__, which runs one launch's
  grid, is wrapped; with CUDA, knobs.runtime.launch_enter_hook is called on every launch.
* Kernels tjit runs per call (TjitKernels): the Triton launches, plus the aten ops tjit's
  runtime dispatches itself outside them that run a kernel by the rule above (a zero
  gradient, a scatter_add_ into one): work tjit hands to torch is counted too. In the
  interpreter, the torch ops Triton's interpreter makes inside a launch (copying arguments
  to the host and back) belong to that launch and are not counted again.
* Bytes tjit's kernels move (interpreter only): every masked load and store the
  interpreter executes is recorded, per launch, as bytes issued (active lanes x element
  size, so a value loaded twice or a broadcast operand loaded by every program counts each
  time) and distinct bytes (distinct addresses read, written: the traffic with a perfect
  cache). What a GPU moves from DRAM lies between the two, so tjit.explain's bytes_read /
  bytes_written for a kernel must too: check_bytes. Atomic read-modify-writes (the 4-byte
  counter a split reduction's programs share) are not recorded.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tjit  # noqa: F401  (imported before triton: it chooses the interpreter when there is no CUDA)
from tjit.runtime.interpreter import interpreting

# -- which aten ops run a kernel ----------------------------------------------------------------

NO_KERNEL = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::empty_permuted", "aten::set_", "aten::resize_", "aten::_local_scalar_dense", "aten::lift_fresh",
})


def runs_kernel(func, args, kwargs, out) -> bool:
    """Whether an aten op, as a TorchDispatchMode sees it, runs a kernel (see the module text)."""
    schema = func._schema
    if schema.name in NO_KERNEL or func.is_view or torch.Tag.inplace_view in func.tags:
        return False
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if outs and all(t.numel() == 0 for t in outs):
        return False
    if outs and not schema.is_mutable:  # returns its inputs' storage without writing: an alias
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()}
        if all(t.untyped_storage().data_ptr() in given for t in outs):
            return False
    return True


def real_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses: a broadcast (stride-0) dimension
    counts once, so an expanded bias counts its real elements."""
    elems = math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) if t.numel() else 0
    return elems * t.element_size()


_inside_launch = 0  # > 0 while Triton's interpreter runs a launch (see TritonLaunches)


class AtenKernels(TorchDispatchMode):
    """The aten ops that run a kernel (runs_kernel) while active, and their traffic: each
    tensor input read once (a broadcast input counting its distinct elements), each tensor
    output written once; an in-place op reads and writes `self`, an out= argument is only
    written. Ops made by Triton's interpreter inside a launch are left out."""

    def __init__(self):
        super().__init__()
        self.kernels: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _inside_launch or not runs_kernel(func, args, kwargs, out):
            return out
        write_only = {a.name for a in func._schema.arguments
                      if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write}
        reads = [t for t in tree_leaves(list(args)) if isinstance(t, torch.Tensor)]
        reads += [t for k, v in kwargs.items() if k not in write_only
                  for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        writes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.kernels.append(str(func))
        self.bytes += sum(map(real_bytes, reads)) + sum(map(real_bytes, writes))
        return out


def eager_kernels(fn, args, kwargs=None) -> tuple[list[str], int, object]:
    """(the kernels eager runs for fn(*args), their bytes, the result)."""
    with AtenKernels() as mode:
        result = fn(*args, **(kwargs or {}))
    return mode.kernels, mode.bytes, result


# -- Triton launches and their memory accesses ----------------------------------------------------

@dataclass
class Launch:
    name: str
    # interpreter only (None with CUDA): bytes issued by loads / stores, and distinct bytes
    read_issued: Optional[int] = None
    written_issued: Optional[int] = None
    read_distinct: Optional[int] = None
    written_distinct: Optional[int] = None
    _reads: list = field(default_factory=list, repr=False)  # (addresses, element size)
    _writes: list = field(default_factory=list, repr=False)

    def finish(self) -> None:
        self.read_distinct, self.written_distinct = _distinct(self._reads), _distinct(self._writes)
        self._reads, self._writes = [], []


def _distinct(chunks) -> int:
    import numpy as np
    by_size: dict[int, list] = {}
    for addresses, size in chunks:
        by_size.setdefault(size, []).append(addresses)
    return sum(size * np.unique(np.concatenate(parts)).size for size, parts in by_size.items())


class TritonLaunches:
    """Counts the Triton kernel launches made while active (any kernel: tjit's or another's),
    in Triton itself; in the interpreter also each launch's loads and stores (see the module
    text). bytes=False skips the access records (they cost ~30% of the interpreter's time).
    execute=False (interpreter only) counts each launch without running it: a call made so
    only does what the caller does around its kernels (first-call set-up, allocations), and
    its results are garbage."""

    _active = False

    def __init__(self, bytes: bool = True, execute: bool = True):
        self.record_bytes = bytes and execute and interpreting()
        self.execute = execute
        self.launches: list[Launch] = []
        self._current: Optional[Launch] = None
        self._restore = []

    @property
    def count(self) -> int:
        return len(self.launches)

    def bytes(self) -> tuple[int, int, int, int]:
        """(read issued, written issued, read distinct, written distinct), summed over launches."""
        if not self.record_bytes:
            raise RuntimeError("memory accesses are recorded only in Triton's interpreter (with bytes=True)")
        return tuple(sum(getattr(k, f) for k in self.launches)
                     for f in ("read_issued", "written_issued", "read_distinct", "written_distinct"))

    def __enter__(self):
        if TritonLaunches._active:
            raise RuntimeError("TritonLaunches is already active")
        TritonLaunches._active = True
        if interpreting():
            self._patch_interpreter()
        else:
            from triton import knobs
            hook = lambda metadata: self.launches.append(Launch(_launch_name(metadata)))  # noqa: E731
            knobs.runtime.launch_enter_hook.add(hook)
            self._restore.append(lambda: knobs.runtime.launch_enter_hook.remove(hook))
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._restore):
            undo()
        self._restore = []
        TritonLaunches._active = False
        return False

    def _patch_interpreter(self) -> None:
        import numpy as np
        from triton.runtime import interpreter as ti
        me = self
        call, load, store = ti.GridExecutor.__call__, ti.InterpreterBuilder.create_masked_load, \
            ti.InterpreterBuilder.create_masked_store

        def run_grid(executor, *args, **kwargs):
            global _inside_launch
            launch = Launch(executor.fn.__name__)
            if not me.execute:
                me.launches.append(launch)
                return None
            if me.record_bytes:
                launch.read_issued = launch.written_issued = 0
            outer, me._current = me._current, launch
            _inside_launch += 1
            try:
                return call(executor, *args, **kwargs)
            finally:
                _inside_launch -= 1
                me._current = outer
                if me.record_bytes:
                    launch.finish()
                me.launches.append(launch)

        def accessed(ptrs, mask):
            size = ti._get_np_dtype(ptrs.get_element_ty()).itemsize
            addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
            return addresses, size

        def masked_load(builder, ptrs, mask, other, *rest, **kw):
            launch = me._current
            if launch is not None and me.record_bytes:
                addresses, size = accessed(ptrs, mask)
                launch.read_issued += addresses.size * size
                launch._reads.append((addresses, size))
            return load(builder, ptrs, mask, other, *rest, **kw)

        def masked_store(builder, ptrs, value, mask, *rest, **kw):
            launch = me._current
            if launch is not None and me.record_bytes:
                addresses, size = accessed(ptrs, mask)
                launch.written_issued += addresses.size * size
                launch._writes.append((addresses, size))
            return store(builder, ptrs, value, mask, *rest, **kw)

        ti.GridExecutor.__call__ = run_grid
        ti.InterpreterBuilder.create_masked_load = masked_load
        ti.InterpreterBuilder.create_masked_store = masked_store

        def undo():
            ti.GridExecutor.__call__ = call
            ti.InterpreterBuilder.create_masked_load = load
            ti.InterpreterBuilder.create_masked_store = store
        self._restore.append(undo)


def _launch_name(metadata) -> str:
    try:
        return str(metadata.get().get("name", "?"))
    except Exception:  # the metadata's form differs between Triton versions: the count is what matters
        return "?"


class TjitKernels:
    """The kernels a tjit call runs, measured: Triton's launches (TritonLaunches) and the aten
    ops that run a kernel dispatched outside them (AtenKernels), plus tjit.counters.launches
    over the same span, to check tjit's own count against Triton's."""

    def __init__(self, bytes: bool = True):
        self.triton = TritonLaunches(bytes=bytes)
        self.aten = AtenKernels()
        self.counted = 0  # tjit.counters.launches delta

    def __enter__(self):
        self._before = tjit.counters.launches
        self.triton.__enter__()
        try:
            self.aten.__enter__()
        except BaseException:
            self.triton.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.aten.__exit__(*exc)
        finally:
            self.triton.__exit__(*exc)
            self.counted = tjit.counters.launches - self._before
        return False

    @property
    def total(self) -> int:
        return self.triton.count + len(self.aten.kernels)


def check_launches(where: str, planned: int, measured: TjitKernels) -> list[str]:
    """Failures (empty when none): the planned kernels (tjit.explain) must be what tjit's
    counter counted and what Triton saw launched."""
    seen = measured.triton.count
    if planned == measured.counted == seen:
        return []
    names = ", ".join(k.name for k in measured.triton.launches)
    return [f"{where}: tjit.explain plans {planned} kernel(s), tjit.counters.launches counted {measured.counted}, "
            f"Triton saw {seen} launch(es) [{names}]"]


def check_bytes(where: str, kernels, launches: list[Launch]) -> list[str]:
    """Failures (empty when none): per kernel, explain's bytes_read and bytes_written must lie
    within the measured [distinct, issued] of the launch that ran it (interpreter only).
    `kernels`: explain's KernelReports, in launch order."""
    if not launches or launches[0].read_issued is None:
        return []
    if [k.name for k in kernels] != [k.name for k in launches]:
        return [f"{where}: explain lists kernels {[k.name for k in kernels]}, Triton launched "
                f"{[k.name for k in launches]}"]
    out = []
    for k, run in zip(kernels, launches):
        for what, planned, low, high in (("reads", k.bytes_read, run.read_distinct, run.read_issued),
                                         ("writes", k.bytes_written, run.written_distinct, run.written_issued)):
            if not low <= planned <= high:
                out.append(f"{where}: {k.name} {what} {planned} B by tjit.explain, measured {low} B distinct, "
                           f"{high} B issued (explain must lie between)")
    return out


def print_failures(failures: list[str], held: str = "every count measured agrees with tjit's plan, every "
                                                     "result matches eager") -> None:
    """The checks that did not hold, on stdout under the tables and on stderr (the scripts then
    exit 1); `held` says what was checked when they all hold."""
    print()
    if not failures:
        print(f"== checks ==\n  all held: {held}")
        return
    print(f"== FAILED CHECKS ({len(failures)}) ==")
    print("\n".join(f"  - {f}" for f in failures))
    print(f"{len(failures)} check(s) failed: see FAILED CHECKS above", file=sys.stderr)

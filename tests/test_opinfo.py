"""Every op in torch's OpInfo database (op_db), forward and backward, float32 on CPU: tjit
against eager.

As Inductor's test/inductor/test_torchinductor_opinfo.py does: for each OpInfo and each of
its sample inputs, compile `lambda *tensors: op(input, *args, **kwargs)` (the sample's tensors,
nested in lists too, are the compiled function's arguments; its other values are closed over,
since tjit specialises on Python values), run tjit and eager on clones of the same inputs and
compare the outputs and every input afterwards (in-place writes) with torch's float32
tolerances (TOLERANCES: the few looser ones, with their causes), NaNs equal. Random ops (names
with "rand", "normal", "dropout", ... and RANDOM_SAMPLES) are compared by shape and dtype, and
must hold no NaN where eager has none (TJIT_POISON fills what tjit allocates with NaN, so an
element never written shows); UNSPECIFIED_VALUES (empty, ...) by shape and dtype only. A sample
eager itself cannot run is skipped. A value outside the tolerances passes if it is as close
to eager's float64 answer as eager's own is (_as_accurate): sums in another order, formulas in
another form, an intermediate kept in float32 where eager rounds it. Each OpInfo draws its
samples from a seed of its own, so every run sees the same inputs and the expected failures
below cannot flake.

Backward (BACKWARD_OPINFOS: those eager differentiates in float32): the same closure, on leaf
copies of the samples drawn with requires_grad=True; every float result that requires grad
in eager (of those the sample's output_process_fn_grad keeps, as torch's gradient tests)
gets a fixed random cotangent, and torch.autograd.grad of tjit's results must match eager's
gradients (run_backward_sample: which results require grad too; None and zeros are the same
gradient), with the same float64 fallback.

pytest (the default): one test per OpInfo (name.variant) on its first SAMPLES (3;
TJIT_OPINFO_SAMPLES=n) samples that eager runs; TJIT_OPINFO_ALL=1 runs every sample.
EXPECTED_FAILURES lists the OpInfos that fail on those samples and EXPECTED_FAILURES_LATER the
ones that fail only on later samples (with TJIT_OPINFO_ALL=1), each with its cause, as strict
xfails so a fix is noticed; NEVER_RUN would list samples that kill the process. Backward:
test_opinfo_backward on the first BACKWARD_SAMPLES (1; TJIT_OPINFO_BACKWARD_SAMPLES=n),
EXPECTED_BACKWARD_FAILURES(_LATER) and NEVER_RUN_BACKWARD likewise; an OpInfo whose forward
is an expected failure and fails there is skipped (test_opinfo lists it).

`python tests/test_opinfo.py` runs the whole sweep (every sample) in worker processes, so a
crash is caught and named, and prints the outcome per category and every failing OpInfo:
  pass            some kernel or library call ran and the results match eager
  pass (nothing)  the results match and nothing was launched (views, metadata, empty results)
  error           tjit raised (by exception type and reason)
  mismatch        tjit returned a different answer than eager: a silent wrong answer
  crash           the process died (segfault, abort) or a sample ran past SAMPLE_SECONDS
An OpInfo's outcome is its worst sample's (crash > mismatch > error > pass). Failures missing
from the expected lists are marked [NEW], and expected failures that passed are listed; either
makes the exit status 1. `--ops a,b` limits the sweep to some OpInfos, `--json FILE` writes
every sample's outcome, `--jobs n` sets the number of worker processes, `--backward` sweeps
the gradients instead (a failure is named "forward:" where the compiled call itself failed),
`--dtype bfloat16` (float16, int64, bool, ...) draws the samples in another dtype (the expected
failures listed are float32's), `--samples n` runs only each OpInfo's first n samples.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it under pytest)
os.environ["TJIT_POISON"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
import zlib  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Optional  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: E402

import tjit  # noqa: E402

RANDOM_WORDS = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential", "geometric",
                "cauchy", "log_normal")
# Names with those words whose values are deterministic: compared in full.
NOT_RANDOM = {"nn.functional.normalize", "masked.normalize", "native_dropout_backward",
              "signal.windows.exponential", "nn.functional.feature_alpha_dropout.without_train"}
# Ops whose values eager itself does not determine, also compared by shape and dtype only.
UNSPECIFIED_VALUES = {
    **dict.fromkeys(("empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"),
                    "uninitialised memory"),
    **dict.fromkeys(("nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d"),
                    "pooling regions drawn at random inside the op"),
    **dict.fromkeys(("svd_lowrank", "pca_lowrank"), "a random projection drawn inside the op"),
}
SAMPLES = int(os.environ.get("TJIT_OPINFO_SAMPLES", "3"))  # samples per OpInfo in the default run
BACKWARD_SAMPLES = int(os.environ.get("TJIT_OPINFO_BACKWARD_SAMPLES", "1"))  # the same, for gradients
SAMPLE_SECONDS = 120  # a sample that runs longer is counted as a crash (a hang) by the sweep


def opinfo_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


# The dtype of the samples' floating-point tensors: float32 under pytest; the sweep's --dtype
# (through this variable, so its worker processes see it too) runs the others.
DTYPE = getattr(torch, os.environ.get("TJIT_OPINFO_DTYPE", "float32"))
OPINFOS = {opinfo_id(op): op for op in op_db if DTYPE in op.supported_dtypes("cpu")}
# torch.testing's tolerances for each result's dtype (float32: atol 1e-5, rtol 1.3e-6; exact
# for integers and bool).
DEFAULT_TOLERANCE = (None, None)

# Looser tolerances than torch's defaults, each with its cause.
TOLERANCES: dict[str, tuple[float, float]] = {  # opinfo id -> (atol, rtol)
    # eager's fused CPU attention kernel sums in another order: both are up to 2e-5 from float64
    "nn.functional.scaled_dot_product_attention": (5e-5, 1.3e-6),
    # sample 126: inputs and weights up to 9 give scores of size 1e5, whose rounding moves the
    # softmax by |s| * eps ~ 1%; eager's own error is 0.012 at outputs of size 600, tjit's 0.037
    "nn.functional.multi_head_attention_forward": (1e-5, 1e-4),
}

# Expected failures, grouped by cause. "(bug)" marks a cause that is tjit's fault rather than a
# form it refuses on purpose: an internal exception instead of UnsupportedOpError, or a wrong answer.
# OpInfo id -> why it fails on its first SAMPLES samples (strict xfail in the default run).
EXPECTED_FAILURES: dict[str, str] = {
}
# OpInfo id -> why a later sample fails (strict xfail only with TJIT_OPINFO_ALL=1).
EXPECTED_FAILURES_LATER: dict[str, str] = {
}

# (opinfo id, sample index) -> why the sample is never run: it kills the process. None does
# today (the sweep runs every sample in worker processes and would name it).
NEVER_RUN: dict[tuple[str, int], str] = {}

# --- backward expectations ---
# OpInfos whose gradients are compared: eager differentiates them in float32 on CPU.
BACKWARD_OPINFOS = [name for name, op in OPINFOS.items()
                    if op.supports_autograd and DTYPE in op.supported_backward_dtypes("cpu")]
# OpInfo id -> (the results whose gradients are compared, why not all of them).
BACKWARD_OUTPUTS = {
    "native_group_norm": (lambda r: r[0], "eager's formula drops the gradients of mean and rstd (torch's own "
                          "OpInfo marks TestBwdGradients.test_fn_grad an expected failure); tjit's are gradcheck's"),
}
# A value outside the tolerances still passes if its worst error from eager's float64 result
# is at most this many times eager's float32 worst error (as Inductor's fp64 check).
FLOAT64_MULTIPLIER = 3.0
# Looser gradient tolerances than the forward's, each with its cause.
BACKWARD_TOLERANCES: dict[str, tuple[float, float]] = {}
# OpInfo id -> why its gradients fail on the first BACKWARD_SAMPLES samples (strict xfail); an
# OpInfo whose forward is an expected failure (EXPECTED_FAILURES*) and fails there is skipped.
EXPECTED_BACKWARD_FAILURES: dict[str, str] = {
}
# OpInfo id -> why its backward kernels spill registers when compiled for sm_90 (a known gap).
BACKWARD_SPILLS: dict[str, str] = {
    "sinc": "sin and cos of pi * x in one backward kernel: libdevice's slow paths spill 8 bytes",
}
# OpInfo id -> why a later sample's gradients fail (strict xfail only with TJIT_OPINFO_ALL=1).
EXPECTED_BACKWARD_FAILURES_LATER: dict[str, str] = {
}
# (opinfo id, sample index) -> why its backward sample is never run: it kills the process.
NEVER_RUN_BACKWARD: dict[tuple[str, int], str] = {}

_CANCELLATION = ("a 1-element normalisation's exact gradient is 0, which eager's 16-bit arithmetic hits exactly, "
                 "tjit's float32 one (another algebraic form) misses by 1e-5 to 2e-4 at terms of size 0.1; eager's "
                 "own gradient of cosine_similarity's other input misses it by 2e-3 in bfloat16")
# The sweep in other dtypes (--dtype; test_opinfo_in_other_dtypes): (dtype, "forward" or
# "backward") -> {OpInfo id -> why it fails}, beside float32's lists above.
OTHER_DTYPE_FAILURES: dict[tuple[str, str], dict[str, str]] = {
    ("bfloat16", "backward"): {
        **dict.fromkeys(("masked.normalize", "nn.functional.cosine_similarity"), "(later samples) " + _CANCELLATION),
    },
    ("complex64", "forward"): {
        "item": "torch's fake tensors cannot trace it (local_scalar_dense/item NYI for torch.complex64): "
                "UnsupportedOpError names it",
        **dict.fromkeys(("normal.in_place", "uniform"), "an in-place write into a complex input: library calls "
                        "compute complex values and write no inputs yet (UnsupportedOpError says so)"),
    },
    ("float16", "backward"): dict.fromkeys(("masked.normalize", "nn.functional.cosine_similarity",
                                            "nn.functional.normalize"), "(later samples) " + _CANCELLATION),
}

# Samples that draw random numbers although their OpInfo's name does not say so.
RANDOM_SAMPLES = {
    "nn.functional.scaled_dot_product_attention": lambda s: s.kwargs.get("dropout_p", 0.0) > 0,
    "nn.functional.multi_head_attention_forward": lambda s: bool(s.kwargs.get("training")) and s.args[9] > 0,
    "nn.functional.rrelu": lambda s: s.kwargs.get("training", False),
}


# --- one sample ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    op: str
    sample: int
    category: str  # "pass", "pass (nothing)", "error", "mismatch", "crash", "skip" (eager cannot run it)
    detail: str = ""  # the exception type and reason, or the mismatch
    kernels: int = 0
    calls: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.category in ("error", "mismatch", "crash")


class Mismatch(AssertionError):
    pass


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides and storage offset as the original."""
    if t.layout != torch.strided:
        return t.clone()
    storage = t.untyped_storage().clone()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def sample_program(op, sample, in_place: bool = False):
    """(fn, tensors): fn(*tensors) calls op (its in-place variant, `x.op_(...)`, if in_place) on
    the sample, its non-tensor values closed over."""
    leaves, spec = tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    where = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[k] for k in where]
    constants = [None if k in where else leaf for k, leaf in enumerate(leaves)]
    target = op.inplace_variant if in_place else op.op

    def fn(*ts, dtype=None):
        """op on ts; `dtype` replaces the sample's DTYPE where it is an argument (linspace's
        float64 reference)."""
        values = [dtype if dtype is not None and c is DTYPE else c for c in constants]
        for k, t in zip(where, ts):
            values[k] = t
        x, args, kwargs = tree_unflatten(values, spec)
        return target(x, *args, **kwargs)

    return fn, tensors


def compare(got, expected, what: str, atol: float, rtol: float, values: Optional[bool]) -> None:
    """Same structure, types, shapes and dtypes; values within tolerance (NaNs must match) if
    `values`; if None (random values), no NaN where eager has none."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise Mismatch(f"{what}: {type(got).__name__} of {len(got) if isinstance(got, (tuple, list)) else '-'}, "
                           f"expected {type(expected).__name__} of {len(expected)}")
        for k, (g, e) in enumerate(zip(got, expected)):
            compare(g, e, f"{what}[{k}]", atol, rtol, values)
        return
    if not isinstance(expected, torch.Tensor):
        if isinstance(got, torch.Tensor) or type(got) is not type(expected):
            raise Mismatch(f"{what}: {type(got).__name__}, expected {type(expected).__name__} {expected!r}")
        if values and got != expected and not (got != got and expected != expected):
            raise Mismatch(f"{what}: {got!r}, expected {expected!r}")
        return
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: {type(got).__name__}, expected a tensor")
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise Mismatch(f"{what}: {got.dtype} {list(got.shape)}, expected {expected.dtype} {list(expected.shape)}")
    if values is None and expected.is_floating_point() and not expected.isnan().any() and got.isnan().any():
        raise Mismatch(f"{what}: NaN where eager has none (an element tjit never wrote holds its poison)")
    if values:
        try:
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, equal_nan=True, check_device=False,
                                       check_stride=False)
        except AssertionError as e:
            raise Mismatch(f"{what}: " + " ".join(str(e).split("\n")[:4])) from None


def _reason(e: BaseException) -> str:
    if isinstance(e, tjit.UnsupportedOpError):
        text = f"{e.op}: {e.reason}"
    else:
        text = str(e).strip()
    text = text.split("\n")[0]
    return f"{type(e).__name__}: {text[:200]}"


def _values_compared(name: str, sample) -> Optional[bool]:
    """How a sample's values are compared: True in full; None for a random op (shape, dtype
    and no NaN where eager has none); False for values eager leaves unspecified."""
    random = ((name not in NOT_RANDOM and any(w in name for w in RANDOM_WORDS))
              or RANDOM_SAMPLES.get(name, lambda s: False)(sample))
    return False if name in UNSPECIFIED_VALUES else None if random else True


def _seeded_call(fn, inputs: list):
    """fn on the inputs from torch's seed 0 (eager and tjit draw the same random numbers where
    they can), its warnings silenced (eager shows them once already)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*inputs)


def run_sample(name: str, index: int, sample, in_place: bool = False) -> Outcome:
    """Run one sample through eager and tjit (the op's in-place variant if in_place); its outcome."""
    op = OPINFOS[name]
    fn, tensors = sample_program(op, sample, in_place)
    values = _values_compared(name, sample)
    atol, rtol = TOLERANCES.get(name, DEFAULT_TOLERANCE)
    start = time.perf_counter()
    eager_inputs = [_clone(t) for t in tensors]
    try:
        expected = _seeded_call(fn, eager_inputs)
    except Exception as e:  # eager cannot run this sample: not tjit's to run either
        return Outcome(name, index, "skip", _reason(e))
    tjit_inputs = [_clone(t) for t in tensors]
    kernels, calls = tjit.counters.launches, tjit.counters.library_calls
    try:
        got = _seeded_call(tjit.compile(fn), tjit_inputs)
    except Exception as e:
        return Outcome(name, index, "error", _reason(e), seconds=time.perf_counter() - start)
    kernels, calls = tjit.counters.launches - kernels, tjit.counters.library_calls - calls
    seconds = time.perf_counter() - start
    eager = _Eager(name, index, sample, fn, tensors)
    try:
        compare(got, expected, "output", atol, rtol, False)  # structure, shapes, dtypes
        for k, (g, e) in enumerate(zip(tree_flatten(got)[0], tree_flatten(expected)[0])):
            eager.check(g, e, f"output {k}", atol, rtol, values, lambda: eager.float64()[0][k])
        for k, (g, e) in enumerate(zip(tjit_inputs, eager_inputs)):
            eager.check(g, e, f"input {k} after the call", atol, rtol, values, lambda: eager.float64()[2][k])
    except Mismatch as e:
        return Outcome(name, index, "mismatch", str(e), kernels, calls, seconds)
    except Exception as e:  # results the comparison cannot even read are not eager's either
        return Outcome(name, index, "mismatch", f"cannot compare: {_reason(e)}", kernels, calls, seconds)
    return Outcome(name, index, "pass" if kernels + calls else "pass (nothing)", _aliasing(got, tjit_inputs, expected,
                   eager_inputs), kernels, calls, seconds)


# --- backward: one sample -------------------------------------------------------------------------

def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf copy (same strides and offset) that requires grad where the sample's tensor does."""
    return _clone(t.detach()).requires_grad_(t.requires_grad)


def _cotangents(name: str, index: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A fixed random gradient per differentiable output, drawn from a generator of their own
    (the op's random draws, seeded by manual_seed, are left alone)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}@{index}".encode()))
    return [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outputs]


def _requiring_grad(result) -> list[bool]:
    return [isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(result)[0]]


def run_backward_sample(name: str, index: int, sample) -> Outcome:
    """Gradients of one sample through eager and tjit: the same closure as the forward, called
    on leaf copies of the sample's tensors (those that require grad in the sample get a
    gradient), then torch.autograd.grad of every float output that requires grad in eager with
    a fixed random cotangent. The results must require grad where eager's do (and only there);
    the gradients must match eager's (None, as torch.autograd.grad gives for an input the
    outputs do not reach, compared as zeros: eager itself gives zeros or None for the same
    gradient depending on whether the path crosses an op that returns zeros; a difference in
    which is None is a note, not a failure). A value outside the tolerances that is as close to
    eager's float64 result as eager's float32 one passes (see _as_accurate)."""
    op = OPINFOS[name]
    fn, tensors = sample_program(op, sample)
    values = _values_compared(name, sample)
    atol, rtol = BACKWARD_TOLERANCES.get(name, TOLERANCES.get(name, DEFAULT_TOLERANCE))
    start = time.perf_counter()
    eager = _Eager(name, index, sample, fn, tensors)
    try:
        expected, expected_grads = eager.run(DTYPE)
    except Exception as e:  # eager cannot run this sample (or differentiate it): not tjit's to run either
        return Outcome(name, index, "skip", _reason(e))
    if not expected_grads:
        return Outcome(name, index, "skip", "no differentiable output or input in eager")
    tjit_inputs = [_grad_leaf(t) for t in tensors]
    kernels, calls = tjit.counters.launches, tjit.counters.library_calls
    try:
        got = _seeded_call(tjit.compile(fn), tjit_inputs)
    except Exception as e:
        return Outcome(name, index, "error", "forward: " + _reason(e), seconds=time.perf_counter() - start)
    try:
        compare(got, expected, "output", atol, rtol, False)  # structure, shapes, dtypes
        for k, (g, e) in enumerate(zip(tree_flatten(got)[0], tree_flatten(expected)[0])):
            eager.check(g, e, f"output {k}", atol, rtol, values, lambda: eager.float64()[0][k])
        requires, got_requires = _requiring_grad(expected), _requiring_grad(got)
        if got_requires != requires:
            k = next(k for k, (a, b) in enumerate(zip(got_requires, requires)) if a != b)
            raise Mismatch(f"output {k} {'does not require' if requires[k] else 'requires'} grad, eager's "
                           f"{'does' if requires[k] else 'does not'}")
    except Mismatch as e:
        return Outcome(name, index, "mismatch", f"forward: {e}", seconds=time.perf_counter() - start)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grads = torch.autograd.grad(_differentiated(name, sample, got), [tjit_inputs[k] for k in eager.wrt],
                                        eager.cotangents, allow_unused=True)
    except Exception as e:
        return Outcome(name, index, "error", "backward: " + _reason(e), seconds=time.perf_counter() - start)
    kernels, calls = tjit.counters.launches - kernels, tjit.counters.library_calls - calls
    seconds = time.perf_counter() - start
    notes = []
    try:
        for j, (k, g, e) in enumerate(zip(eager.wrt, grads, expected_grads)):
            if (g is None) != (e is None):
                notes.append(f"gradient of input {k} is {'None' if g is None else 'zeros'} in tjit, "
                             f"{'None' if e is None else 'a tensor'} in eager")
            eager.check(_or_zeros(g, tjit_inputs[k]), _or_zeros(e, tjit_inputs[k]), f"gradient of input {k}", atol,
                        rtol, values, lambda: _or_zeros(eager.float64()[1][j], tjit_inputs[k]))
    except Mismatch as e:
        return Outcome(name, index, "mismatch", str(e), kernels, calls, seconds)
    except Exception as e:  # results the comparison cannot even read are not eager's either
        return Outcome(name, index, "mismatch", f"cannot compare: {_reason(e)}", kernels, calls, seconds)
    return Outcome(name, index, "pass" if kernels + calls else "pass (nothing)", "; ".join(notes[:1]), kernels,
                   calls, seconds)


class _Eager:
    """Eager's results and gradients for one sample, in DTYPE and (when a comparison needs it)
    float64 on the same inputs and cotangents."""

    def __init__(self, name: str, index: int, sample, fn, tensors: list):
        self.name, self.index, self.sample, self.fn, self.tensors = name, index, sample, fn, tensors
        self.wrt = [k for k, t in enumerate(tensors) if t.requires_grad]
        self.cotangents: list[torch.Tensor] = []
        self._float64 = None

    def run(self, dtype: torch.dtype) -> tuple:
        """(the results, the gradients of the inputs in wrt; empty if nothing is differentiable),
        with the sample's DTYPE tensors and dtype arguments in `dtype`."""
        inputs = [_grad_leaf(t.to(dtype) if t.dtype == DTYPE else t) for t in self.tensors]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            result = self.fn(*inputs, dtype=dtype)
            self.inputs = inputs  # after the call (in-place writes)
            outs = _differentiated(self.name, self.sample, result)
            if not self.wrt or not outs:
                return result, []
            if not self.cotangents:
                self.cotangents = _cotangents(self.name, self.index, outs)
            cotangents = [c.to(o.dtype) for c, o in zip(self.cotangents, outs)]
            return result, torch.autograd.grad(outs, [inputs[k] for k in self.wrt], cotangents, allow_unused=True)

    def float64(self) -> Optional[tuple]:
        """(flattened results, gradients, inputs after the call) in float64, or None where
        eager cannot."""
        if self._float64 is None:
            try:
                result, grads = self.run(torch.float64)
                self._float64 = (tree_flatten(result)[0], grads, [t.detach() for t in self.inputs])
            except Exception:
                self._float64 = False
        return self._float64 or None

    def check(self, got, expected, what: str, atol: float, rtol: float, values: Optional[bool], reference) -> None:
        """compare(); a float tensor outside the tolerances passes if it is as accurate as
        eager's (`reference()`: the float64 value)."""
        try:
            compare(got, expected, what, atol, rtol, values)
        except Mismatch:
            if not (values and isinstance(expected, torch.Tensor) and expected.is_floating_point()
                    and self.float64() is not None and _as_accurate(got, expected, reference())):
                raise


def _as_accurate(got: torch.Tensor, expected: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether tjit's value, further from eager's than the tolerance allows, is as
    close to the float64 value as eager's is (its worst element no more than
    FLOAT64_MULTIPLIER times eager's worst error from it, plus one unit in the last place for
    16-bit types), with NaN and infinities where eager has them or float64 has them: the two
    round differently (a sum in another order, a formula in another form), neither is wrong."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    # NaN and infinities where eager has them, or where float64 rounded to the dtype has them
    # (eager overflowed an intermediate that tjit keeps in float32: float16's soft_margin_loss).
    for truth in (expected, reference.to(expected.dtype)):
        finite = truth.isfinite()
        if torch.equal(got.isfinite(), finite) and torch.equal(got[~finite].nan_to_num(), truth[~finite].nan_to_num()):
            break
    else:
        return False
    # (eager's NaN where float64 has a number is an infinite error)
    error = lambda t: ((t.double() - reference)[finite].abs().nan_to_num(nan=math.inf).max().item()  # noqa: E731
                       if finite.any() else 0.0)
    # 16-bit types: one more unit in the last place at the result's largest magnitude (an
    # intermediate rounded to 16 bits in another place than eager's moves the result by one)
    slack = torch.finfo(expected.dtype).eps * reference[finite].abs().max().item() \
        if expected.dtype.itemsize == 2 and finite.any() else 0.0
    return error(got) <= FLOAT64_MULTIPLIER * error(expected) + slack


def _differentiated(name: str, sample, result) -> list[torch.Tensor]:
    """The float results that require grad, of those the OpInfo differentiates (the sample's
    output_process_fn_grad, as torch's own gradient tests; BACKWARD_OUTPUTS)."""
    chosen = BACKWARD_OUTPUTS.get(name, (lambda r: r, ""))[0](sample.output_process_fn_grad(result))
    return [t for t in tree_flatten(chosen)[0]
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def _or_zeros(grad: Optional[torch.Tensor], input: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(input) if grad is None else grad


def _aliasing(got, tjit_inputs, expected, eager_inputs) -> str:
    """A note (not a failure) where an output is a view of an input in one of eager and tjit
    but not in the other: a caller that writes into the output sees the difference."""
    def views(outputs, inputs):
        storages = {t.untyped_storage().data_ptr() for t in inputs if t.layout == torch.strided and t.numel()}
        return [isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() > 0
                and t.untyped_storage().data_ptr() in storages for t in tree_flatten(outputs)[0]]
    e, g = views(expected, eager_inputs), views(got, tjit_inputs)
    if e == g:
        return ""
    k = next(k for k, (a, b) in enumerate(zip(e, g)) if a != b)
    return f"output {k} is {'' if e[k] else 'not '}a view of an input in eager, {'' if g[k] else 'not '}in tjit"


def samples_of(name: str, backward: bool = False):
    """The OpInfo's samples, drawn from a seed of its own (the same inputs on every run); for
    backward, with requires_grad=True (the tensors the OpInfo differentiates require grad)."""
    torch.manual_seed(zlib.crc32(name.encode()))
    return OPINFOS[name].sample_inputs("cpu", DTYPE, requires_grad=backward)


def run_opinfo(name: str, limit: Optional[int] = None, backward: bool = False, in_place: bool = False
               ) -> list[Outcome]:
    """Outcomes of the OpInfo's samples (the first `limit` that eager runs), in process; of its
    in-place variant's (on the same samples) if in_place."""
    outcomes = []
    never = NEVER_RUN_BACKWARD if backward else NEVER_RUN
    for index, sample in enumerate(samples_of(name, backward)):
        if (name, index) in never:
            outcomes.append(Outcome(name, index, "crash", never[name, index]))
            continue
        outcome = run_backward_sample(name, index, sample) if backward else run_sample(name, index, sample, in_place)
        outcomes.append(outcome)
        if limit is not None and sum(o.category != "skip" for o in outcomes) >= limit:
            break
    return outcomes


# --- pytest -------------------------------------------------------------------------------------

ALL = os.environ.get("TJIT_OPINFO_ALL") == "1"


def _params():
    for name in OPINFOS:
        reason = EXPECTED_FAILURES.get(name) or (EXPECTED_FAILURES_LATER.get(name) if ALL else None)
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", list(_params()))
def test_opinfo(name):
    with torch.random.fork_rng():  # the samples' fixed seeds leave other tests' draws alone
        outcomes = run_opinfo(name, None if ALL else SAMPLES)
    ran = [o for o in outcomes if o.category != "skip"]
    if not ran:
        pytest.skip(f"eager runs none of its samples ({outcomes[0].detail if outcomes else 'no samples'})")
    failed = [o for o in ran if o.failed]
    assert not failed, "\n".join(f"sample {o.sample}: {o.category}: {o.detail}" for o in failed)


_CHANGES_SHAPE = "changes the shape of an argument in place: refused by name (the caller's tensor keeps its shape)"
EXPECTED_IN_PLACE_FAILURES = {
    **dict.fromkeys(["as_strided", "as_strided.partial_views", "resize_", "squeeze", "squeeze.multiple",
                     "unsqueeze", "t", "transpose"], _CHANGES_SHAPE),
    "addbmm": "eager's addbmm_ resizes a [1] input to the result's shape; torch's meta function (the trace) "
              "raises: refused with that error",
}


def _in_place_params():
    for name, op in OPINFOS.items():
        if op.inplace_variant is not None:
            reason = EXPECTED_IN_PLACE_FAILURES.get(name)
            yield pytest.param(name, id=name, marks=[pytest.mark.xfail(reason=reason, strict=True)] if reason else [])


@pytest.mark.parametrize("name", list(_in_place_params()))
def test_opinfo_in_place(name):
    """`x.op_(...)` on the first samples: the value written into x and the result, against eager's."""
    with torch.random.fork_rng():
        outcomes = run_opinfo(name, SAMPLES, in_place=True)
    ran = [o for o in outcomes if o.category != "skip"]
    if not ran:
        pytest.skip(f"eager runs none of its samples in place ({outcomes[0].detail if outcomes else 'no samples'})")
    failed = [o for o in ran if o.failed]
    assert not failed, "\n".join(f"sample {o.sample}: {o.category}: {o.detail}" for o in failed)


def _backward_params():
    for name in BACKWARD_OPINFOS:
        reason = EXPECTED_BACKWARD_FAILURES.get(name) or (EXPECTED_BACKWARD_FAILURES_LATER.get(name) if ALL else None)
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        if name in BACKWARD_SPILLS:
            marks.append(pytest.mark.spills_at_sm90(reason=BACKWARD_SPILLS[name]))
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", list(_backward_params()))
def test_opinfo_backward(name):
    with torch.random.fork_rng():
        outcomes = run_opinfo(name, None if ALL else BACKWARD_SAMPLES, backward=True)
    ran = [o for o in outcomes if o.category != "skip"]
    if not ran:
        pytest.skip(f"eager differentiates none of its samples ({outcomes[0].detail if outcomes else 'no samples'})")
    failed = [o for o in ran if o.failed]
    forward_expected = name in EXPECTED_FAILURES or ALL and name in EXPECTED_FAILURES_LATER
    if failed and forward_expected and name not in EXPECTED_BACKWARD_FAILURES \
            and all(o.category == "error" and o.detail.startswith("forward:") for o in failed):
        pytest.skip(f"the forward fails (test_opinfo[{name}]): {failed[0].detail}")
    assert not failed, "\n".join(f"sample {o.sample}: {o.category}: {o.detail}" for o in failed)


def test_expectations_name_real_opinfos():
    names = set(EXPECTED_FAILURES) | set(EXPECTED_FAILURES_LATER) | set(TOLERANCES) | set(UNSPECIFIED_VALUES)
    names |= {name for failures in OTHER_DTYPE_FAILURES.values() for name in failures}
    names |= NOT_RANDOM | set(RANDOM_SAMPLES) | {n for n, _ in NEVER_RUN}
    assert not names - set(OPINFOS)
    assert not set(EXPECTED_FAILURES) & set(EXPECTED_FAILURES_LATER)
    backward = set(EXPECTED_BACKWARD_FAILURES) | set(EXPECTED_BACKWARD_FAILURES_LATER) | set(BACKWARD_TOLERANCES)
    backward |= set(BACKWARD_OUTPUTS) | set(BACKWARD_SPILLS)
    assert not (backward | {n for n, _ in NEVER_RUN_BACKWARD}) - set(BACKWARD_OPINFOS)
    assert not set(EXPECTED_BACKWARD_FAILURES) & set(EXPECTED_BACKWARD_FAILURES_LATER)


@pytest.mark.parametrize("dtype, backward", [("bfloat16", False), ("float16", False), ("int64", False),
                                             ("bool", False), ("complex64", False), ("bfloat16", True)])
def test_opinfo_in_other_dtypes(dtype, backward):
    """The sweep (below) in another dtype, on each OpInfo's first sample: no failure but
    those OTHER_DTYPE_FAILURES lists. (Every sample, which also reports listed ones that
    pass: python tests/test_opinfo.py --dtype bfloat16 [--backward].)"""
    import subprocess
    args = [sys.executable, __file__, "--dtype", dtype, "--samples", "1", "--jobs", "1"]
    run = subprocess.run(args + (["--backward"] if backward else []), capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]


# --- the sweep (script mode) --------------------------------------------------------------------

def worker(names: list[str], skip: set, backward: bool = False, limit: Optional[int] = None) -> None:
    """Run every sample of the named OpInfos, one JSON line per sample on stdout (a "start"
    line before each, so the parent can name a sample that kills the process)."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the ops print stays off the protocol
    torch.set_num_threads(1)
    for name in names:
        try:
            samples = list(samples_of(name, backward))
        except Exception as e:
            print(json.dumps({"op": name, "sample": -1, "category": "skip", "detail": _reason(e)}), file=out,
                  flush=True)
            continue
        for index, sample in enumerate(samples[:limit]):
            if (name, index) in skip or (name, index) in (NEVER_RUN_BACKWARD if backward else NEVER_RUN):
                continue
            print(json.dumps({"start": name, "sample": index}), file=out, flush=True)
            outcome = (run_backward_sample if backward else run_sample)(name, index, sample)
            print(json.dumps(asdict(outcome)), file=out, flush=True)
        print(json.dumps({"done": name}), file=out, flush=True)


def sweep(names: list[str], jobs: int, backward: bool = False, limit: Optional[int] = None) -> list[Outcome]:
    """Every sample of the named OpInfos in `jobs` worker processes; a worker that dies (or a
    sample that runs past SAMPLE_SECONDS) is restarted after the sample it was running."""
    import selectors
    import subprocess
    outcomes: list[Outcome] = []
    shards = [names[k::jobs] for k in range(jobs)]
    running = {}  # process -> [remaining names, skip set, current (name, index), started at]
    sel = selectors.DefaultSelector()
    done = 0

    def spawn(todo, skip):
        args = [sys.executable, __file__, "--worker", ",".join(todo)] + (["--backward"] if backward else [])
        args += ["--samples", str(limit)] if limit else []
        if skip:
            args += ["--skip", ",".join(f"{n}@{i}" for n, i in skip)]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        running[p] = [list(todo), set(skip), None, time.monotonic()]
        sel.register(p.stdout, selectors.EVENT_READ, p)

    for shard in shards:
        if shard:
            spawn(shard, set())
    while running:
        events = sel.select(timeout=5)
        for key, _ in events:
            p = key.data
            state = running[p]
            line = p.stdout.readline()
            if line:
                msg = json.loads(line)
                if "start" in msg:
                    state[2], state[3] = (msg["start"], msg["sample"]), time.monotonic()
                elif "done" in msg:
                    state[0].remove(msg["done"])
                    state[2] = None
                    done += 1
                    if done % 50 == 0:
                        print(f"{done}/{len(names)} OpInfos", file=sys.stderr, flush=True)
                else:
                    outcomes.append(Outcome(**msg))
                    state[2] = None
                continue
            sel.unregister(p.stdout)
            code = p.wait()
            del running[p]
            todo, skip, current = state[0], state[1], state[2]
            if current is not None:
                outcomes.append(Outcome(current[0], current[1], "crash", f"the process died (exit code {code})"))
                skip.add(current)
            if todo:
                spawn(todo, skip)
        for p, state in list(running.items()):
            if state[2] is not None and time.monotonic() - state[3] > SAMPLE_SECONDS:
                outcomes.append(Outcome(state[2][0], state[2][1], "crash", f"ran past {SAMPLE_SECONDS} s"))
                state[1].add(state[2])
                state[2] = None
                p.kill()  # its end of file restarts it after this sample
    return outcomes


def opinfo_category(outcomes: list[Outcome]) -> Optional[str]:
    ran = [o for o in outcomes if o.category != "skip"]
    if not ran:
        return None
    for c in ("crash", "mismatch", "error"):
        if any(o.category == c for o in ran):
            return c
    return "pass" if any(o.category == "pass" for o in ran) else "pass (nothing)"


def summarize(outcomes: list[Outcome], backward: bool = False, partial: bool = False) -> int:
    """Print the sweep's numbers and failures; the number of surprises (new failures, fixes;
    not fixes if `partial`: only some samples ran)."""
    by_op: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_op.setdefault(o.op, []).append(o)
    cats: dict[str, list[str]] = {}
    for name, os_ in by_op.items():
        c = opinfo_category(os_)
        if c is not None:
            cats.setdefault(c, []).append(name)
    ran = sum(len(v) for v in cats.values())
    samples = [o for o in outcomes if o.category != "skip"]
    if backward:
        print(f"{len(BACKWARD_OPINFOS)} OpInfos support autograd in {DTYPE} on CPU; {ran} run (eager "
              "differentiates a sample)")
    else:
        print(f"{len(OPINFOS)} OpInfos support {DTYPE} on CPU; {ran} run on CPU {DTYPE} (eager runs a sample)")
    for c in ("pass", "pass (nothing)", "error", "mismatch", "crash"):
        print(f"  {c:15s} {len(cats.get(c, [])):4d} OpInfos   "
              f"{sum(o.category == c for o in samples):6d} samples")
    errors: dict[str, int] = {}
    for name in cats.get("error", []):
        first = next(o for o in by_op[name] if o.category == "error")
        parts = first.detail.split(": ")
        kind = " ".join(parts[:2]) if parts[0] in ("forward", "backward") else parts[0]
        errors[kind] = errors.get(kind, 0) + 1
    print("  errors by type: " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items(), key=lambda kv: -kv[1])))
    print(f"  library calls in passing samples: {sum(o.calls > 0 for o in samples if o.category == 'pass')} samples")
    notes = sorted({o.op: o for o in samples if o.category.startswith("pass") and o.detail}.values(), key=lambda o: o.op)
    if notes:
        print(f"\n{'None-ness of gradients' if backward else 'aliasing'} differences in passing samples "
              f"(not failures): {len(notes)} OpInfos")
        for o in notes:
            print(f"  {o.op}  (sample {o.sample}) {o.detail}")
    expected = {**EXPECTED_FAILURES_LATER, **EXPECTED_FAILURES, **_other_dtype_failures(False)}
    if backward:  # (a forward that fails fails the gradients too: that is test_opinfo's to list)
        expected = {**EXPECTED_BACKWARD_FAILURES_LATER, **EXPECTED_BACKWARD_FAILURES, **_other_dtype_failures(True)}
        forward = {n for n in {**EXPECTED_FAILURES_LATER, **EXPECTED_FAILURES} if n in by_op and all(
            o.category != "error" or o.detail.startswith("forward:") for o in by_op[n] if o.failed)}
    else:
        forward = set()
    for c in ("crash", "mismatch", "error"):
        if not cats.get(c):
            continue
        print(f"\n{c}:")
        for name in sorted(cats[c]):
            bad = [o for o in by_op[name] if o.category == c]
            n = sum(o.category != "skip" for o in by_op[name])
            new = "" if name in expected or name in forward else "[NEW] "
            print(f"  {new}{name}  ({len(bad)}/{n} samples; first: sample {bad[0].sample}) {bad[0].detail}")
    failing = {n for c in ("crash", "mismatch", "error") for n in cats.get(c, [])}
    fixed = [] if partial else sorted(n for n in expected if n in by_op and n not in failing)
    if fixed:
        print(f"\nexpected to fail but passed (remove from EXPECTED_FAILURES*): {', '.join(fixed)}")
    return len(failing - set(expected) - forward) + len(fixed)


def _other_dtype_failures(backward: bool) -> dict[str, str]:
    return OTHER_DTYPE_FAILURES.get((str(DTYPE).removeprefix("torch."), "backward" if backward else "forward"), {})


def main(argv: list[str]) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help=argparse.SUPPRESS)
    parser.add_argument("--ops", help="comma-separated OpInfo ids (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="write every sample's outcome here")
    parser.add_argument("--backward", action="store_true", help="compare gradients (OpInfos with autograd)")
    parser.add_argument("--dtype", help="the samples' dtype (float16, bfloat16, int64, bool, ...; default float32); "
                        "the expected failures are float32's")
    parser.add_argument("--samples", type=int, help="only each OpInfo's first n samples")
    a = parser.parse_args(argv)
    if a.dtype and a.dtype != os.environ.get("TJIT_OPINFO_DTYPE", "float32"):  # OPINFOS depends on it: start over
        os.environ["TJIT_OPINFO_DTYPE"] = a.dtype
        os.execv(sys.executable, [sys.executable, __file__] + argv)
    if a.worker is not None:
        skip = {(s.rsplit("@", 1)[0], int(s.rsplit("@", 1)[1])) for s in a.skip.split(",") if s}
        worker([n for n in a.worker.split(",") if n], skip, a.backward, a.samples)
        return 0
    known = BACKWARD_OPINFOS if a.backward else list(OPINFOS)
    names = a.ops.split(",") if a.ops else known
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown OpInfo ids: {unknown}")
    start = time.perf_counter()
    outcomes = sweep(names, a.jobs, a.backward, a.samples)
    surprises = summarize(outcomes, a.backward, partial=a.samples is not None)
    print(f"\n{time.perf_counter() - start:.0f} s with {a.jobs} worker(s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=0)
    return 1 if surprises else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

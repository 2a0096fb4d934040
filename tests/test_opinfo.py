"""Every op in torch's OpInfo database (op_db), forward, float32 on CPU: tjit against eager.

As Inductor's test/inductor/test_torchinductor_opinfo.py does: for each OpInfo and each of
its sample inputs, compile `lambda *tensors: op(input, *args, **kwargs)` (the sample's tensors,
nested in lists too, are the compiled function's arguments; its other values are closed over,
since tjit specialises on Python values), run tjit and eager on clones of the same inputs and
compare the outputs and every input afterwards (in-place writes) with torch's float32
tolerances (TOLERANCES: the few looser ones, with their causes), NaNs equal. Random ops (names
with "rand", "normal", "dropout", ... and RANDOM_SAMPLES) are compared by shape and dtype, and
must hold no NaN where eager has none (TJIT_POISON fills what tjit allocates with NaN, so an
element never written shows); UNSPECIFIED_VALUES (empty, ...) by shape and dtype only. A sample
eager itself cannot run is skipped. Each OpInfo draws its samples from a seed of its own, so
every run sees the same inputs and the expected failures below cannot flake.

pytest (the default): one test per OpInfo (name.variant) on its first SAMPLES (3;
TJIT_OPINFO_SAMPLES=n) samples that eager runs; TJIT_OPINFO_ALL=1 runs every sample.
EXPECTED_FAILURES lists the OpInfos that fail on those samples and EXPECTED_FAILURES_LATER the
ones that fail only on later samples (with TJIT_OPINFO_ALL=1), each with its cause, as strict
xfails so a fix is noticed; NEVER_RUN would list samples that kill the process.

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
every sample's outcome, `--jobs n` sets the number of worker processes.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it under pytest)
os.environ["TJIT_POISON"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import json  # noqa: E402
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
SAMPLE_SECONDS = 120  # a sample that runs longer is counted as a crash (a hang) by the sweep


def opinfo_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


OPINFOS = {opinfo_id(op): op for op in op_db if torch.float32 in op.supported_dtypes("cpu")}

# Looser tolerances than torch's float32 defaults (rtol 1.3e-6, atol 1e-5), each with its cause.
TOLERANCES: dict[str, tuple[float, float]] = {  # opinfo id -> (atol, rtol)
    # eager's fused CPU attention kernel sums in another order: both are up to 2e-5 from float64
    "nn.functional.scaled_dot_product_attention": (5e-5, 1.3e-6),
}

# Expected failures, grouped by cause. "(bug)" marks a cause that is tjit's fault rather than a
# form it refuses on purpose: an internal exception instead of UnsupportedOpError, or a wrong answer.
# OpInfo id -> why it fails on its first SAMPLES samples (strict xfail in the default run).
EXPECTED_FAILURES: dict[str, str] = {
    "nn.functional.rrelu": "(bug) its empty sample: pipeline.verify_steps says the library call reads a buffer no "
                           "step writes (no kernel writes a buffer of no elements, and none need)",
}
# OpInfo id -> why a later sample fails (strict xfail only with TJIT_OPINFO_ALL=1).
EXPECTED_FAILURES_LATER: dict[str, str] = {
}

# (opinfo id, sample index) -> why the sample is never run: it kills the process. None does
# today (the sweep runs every sample in worker processes and would name it).
NEVER_RUN: dict[tuple[str, int], str] = {}

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


def sample_program(op, sample):
    """(fn, tensors): fn(*tensors) calls op on the sample, its non-tensor values closed over."""
    leaves, spec = tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    where = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[k] for k in where]
    constants = [None if k in where else leaf for k, leaf in enumerate(leaves)]
    target = op.op

    def fn(*ts):
        values = list(constants)
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


def run_sample(name: str, index: int, sample) -> Outcome:
    """Run one sample through eager and tjit; its outcome."""
    op = OPINFOS[name]
    fn, tensors = sample_program(op, sample)
    random = ((name not in NOT_RANDOM and any(w in name for w in RANDOM_WORDS))
              or RANDOM_SAMPLES.get(name, lambda s: False)(sample))
    values = False if name in UNSPECIFIED_VALUES else None if random else True
    atol, rtol = TOLERANCES.get(name, (1e-5, 1.3e-6))
    start = time.perf_counter()
    eager_inputs = [_clone(t) for t in tensors]
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = fn(*eager_inputs)
    except Exception as e:  # eager cannot run this sample: not tjit's to run either
        return Outcome(name, index, "skip", _reason(e))
    tjit_inputs = [_clone(t) for t in tensors]
    kernels, calls = tjit.counters.launches, tjit.counters.library_calls
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tjit.compile(fn)(*tjit_inputs)
    except Exception as e:
        return Outcome(name, index, "error", _reason(e), seconds=time.perf_counter() - start)
    kernels, calls = tjit.counters.launches - kernels, tjit.counters.library_calls - calls
    seconds = time.perf_counter() - start
    try:
        compare(got, expected, "output", atol, rtol, values)
        for k, (g, e) in enumerate(zip(tjit_inputs, eager_inputs)):
            compare(g, e, f"input {k} after the call", atol, rtol, values)
    except Mismatch as e:
        return Outcome(name, index, "mismatch", str(e), kernels, calls, seconds)
    except Exception as e:  # results the comparison cannot even read are not eager's either
        return Outcome(name, index, "mismatch", f"cannot compare: {_reason(e)}", kernels, calls, seconds)
    return Outcome(name, index, "pass" if kernels + calls else "pass (nothing)", _aliasing(got, tjit_inputs, expected,
                   eager_inputs), kernels, calls, seconds)


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


def samples_of(name: str):
    """The OpInfo's samples, drawn from a seed of its own (the same inputs on every run)."""
    torch.manual_seed(zlib.crc32(name.encode()))
    return OPINFOS[name].sample_inputs("cpu", torch.float32, requires_grad=False)


def run_opinfo(name: str, limit: Optional[int] = None) -> list[Outcome]:
    """Outcomes of the OpInfo's samples (the first `limit` that eager runs), in process."""
    outcomes = []
    for index, sample in enumerate(samples_of(name)):
        if (name, index) in NEVER_RUN:
            outcomes.append(Outcome(name, index, "crash", NEVER_RUN[name, index]))
            continue
        outcome = run_sample(name, index, sample)
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


def test_expectations_name_real_opinfos():
    names = set(EXPECTED_FAILURES) | set(EXPECTED_FAILURES_LATER) | set(TOLERANCES) | set(UNSPECIFIED_VALUES)
    names |= NOT_RANDOM | set(RANDOM_SAMPLES) | {n for n, _ in NEVER_RUN}
    assert not names - set(OPINFOS)
    assert not set(EXPECTED_FAILURES) & set(EXPECTED_FAILURES_LATER)


# --- the sweep (script mode) --------------------------------------------------------------------

def worker(names: list[str], skip: set) -> None:
    """Run every sample of the named OpInfos, one JSON line per sample on stdout (a "start"
    line before each, so the parent can name a sample that kills the process)."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the ops print stays off the protocol
    torch.set_num_threads(1)
    for name in names:
        try:
            samples = list(samples_of(name))
        except Exception as e:
            print(json.dumps({"op": name, "sample": -1, "category": "skip", "detail": _reason(e)}), file=out,
                  flush=True)
            continue
        for index, sample in enumerate(samples):
            if (name, index) in skip or (name, index) in NEVER_RUN:
                continue
            print(json.dumps({"start": name, "sample": index}), file=out, flush=True)
            outcome = run_sample(name, index, sample)
            print(json.dumps(asdict(outcome)), file=out, flush=True)
        print(json.dumps({"done": name}), file=out, flush=True)


def sweep(names: list[str], jobs: int) -> list[Outcome]:
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
        args = [sys.executable, __file__, "--worker", ",".join(todo)]
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


def summarize(outcomes: list[Outcome]) -> int:
    """Print the sweep's numbers and failures; the number of surprises (new failures, fixes)."""
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
    print(f"{len(OPINFOS)} OpInfos support float32 on CPU; {ran} run on CPU float32 (eager runs a sample)")
    for c in ("pass", "pass (nothing)", "error", "mismatch", "crash"):
        print(f"  {c:15s} {len(cats.get(c, [])):4d} OpInfos   "
              f"{sum(o.category == c for o in samples):6d} samples")
    errors: dict[str, int] = {}
    for name in cats.get("error", []):
        first = next(o for o in by_op[name] if o.category == "error")
        kind = first.detail.split(":")[0]
        errors[kind] = errors.get(kind, 0) + 1
    print("  errors by type: " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items(), key=lambda kv: -kv[1])))
    print(f"  library calls in passing samples: {sum(o.calls > 0 for o in samples if o.category == 'pass')} samples")
    notes = sorted({o.op: o for o in samples if o.category.startswith("pass") and o.detail}.values(), key=lambda o: o.op)
    if notes:
        print(f"\naliasing differences in passing samples (not failures): {len(notes)} OpInfos")
        for o in notes:
            print(f"  {o.op}  (sample {o.sample}) {o.detail}")
    expected = {**EXPECTED_FAILURES_LATER, **EXPECTED_FAILURES}
    for c in ("crash", "mismatch", "error"):
        if not cats.get(c):
            continue
        print(f"\n{c}:")
        for name in sorted(cats[c]):
            bad = [o for o in by_op[name] if o.category == c]
            n = sum(o.category != "skip" for o in by_op[name])
            new = "" if name in expected else "[NEW] "
            print(f"  {new}{name}  ({len(bad)}/{n} samples; first: sample {bad[0].sample}) {bad[0].detail}")
    failing = {n for c in ("crash", "mismatch", "error") for n in cats.get(c, [])}
    fixed = sorted(n for n in expected if n in by_op and n not in failing)
    if fixed:
        print(f"\nexpected to fail but passed (remove from EXPECTED_FAILURES*): {', '.join(fixed)}")
    return len(failing - set(expected)) + len(fixed)


def main(argv: list[str]) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help=argparse.SUPPRESS)
    parser.add_argument("--ops", help="comma-separated OpInfo ids (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="write every sample's outcome here")
    a = parser.parse_args(argv)
    if a.worker is not None:
        skip = {(s.rsplit("@", 1)[0], int(s.rsplit("@", 1)[1])) for s in a.skip.split(",") if s}
        worker([n for n in a.worker.split(",") if n], skip)
        return 0
    names = a.ops.split(",") if a.ops else list(OPINFOS)
    unknown = [n for n in names if n not in OPINFOS]
    if unknown:
        parser.error(f"unknown OpInfo ids: {unknown}")
    start = time.perf_counter()
    outcomes = sweep(names, a.jobs)
    surprises = summarize(outcomes)
    print(f"\n{time.perf_counter() - start:.0f} s with {a.jobs} worker(s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=0)
    return 1 if surprises else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

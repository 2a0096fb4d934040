"""Test harness: interpreter mode, poisoned outputs, the pipeline's verifiers between its
passes (TJIT_VERIFY, tjit/pipeline.py), and an sm_90 compile of every kernel.

TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
Every kernel a test launches is also compiled for Hopper (sm_90) after the test and must
compile with no register spills.
"""
import os

# TJIT_TEST_DEVICE=cuda (on a machine with a GPU): the tests' tensors are made on the GPU (torch's
# default device and generators), kernels are compiled and run there, and the sm_90 compile
# check below is left out (every kernel is compiled for the device it runs on). Tests that
# measure the interpreter (bytes moved, errors raised from inside kernels) fail there by design.
ON_CUDA = os.environ.get("TJIT_TEST_DEVICE") == "cuda"
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["TJIT_POISON"] = "1"
os.environ["TJIT_VERIFY"] = "1"
# (each test compiles its own: an entry an earlier run stored on disk would skip the traces tests count;
# test_disk_cache.py turns it on in directories of its own)
os.environ["TJIT_DISK_CACHE"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (never a flaky CI), with no example
# database and no deadline (the interpreter's speed varies with the machine's load).
# HYPOTHESIS_PROFILE=explore draws fresh examples, for hunting bugs by hand.
settings.register_profile("tjit", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "tjit"))

from tjit.runtime.loader import launched_kernels  # noqa: E402

if ON_CUDA:
    torch.set_default_device("cuda")

    class GeneratorOnTheGPU(torch.Generator):
        """torch.Generator() makes a CPU generator whatever the default device, and torch.randn
        refuses a CPU generator for a CUDA tensor: the tests' generators are made on the GPU.
        (A subclass, not a function: torch's code annotates with `torch.Generator | None`.)"""
        def __new__(cls, device=None):
            return super().__new__(cls, device if device is not None else "cuda")

        def __init__(self, device=None):
            pass
    torch.Generator = GeneratorOnTheGPU

_checked: set = set()


def check_gpu_compiles(allow_spills: bool = False):
    from tjit.lower.gpu_compile import compile_launched, launch_signature
    for plan, args in launched_kernels():
        # (what Triton would specialise the binary on: launches that differ only in offsets
        # or sizes of the same class compile to the same binary, checked once)
        signature, constexprs, divisible = launch_signature(plan, args)
        key = (plan.name, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())), divisible,
               plan.num_warps, plan.num_stages)
        if key in _checked:
            continue
        _checked.add(key)
        report = compile_launched(plan, args)
        assert allow_spills or report.spills == 0, f"{plan.name} spills {report.spills} bytes at sm_90:\n{plan.source}"


@pytest.fixture
def fresh_seed():
    """A new torch seed per test (printed, so a failure can be replayed): test modules that
    draw their inputs from torch's global generator use it."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")  # shown with a failure
    yield


def pytest_generate_tests(metafunc):
    """A test that uses `program_order` runs twice: its launches' programs in the interpreter's
    order, then last to first."""
    if "program_order" in metafunc.fixturenames:
        metafunc.parametrize("program_order", ["forward", "reverse"], indirect=True)


@pytest.fixture
def program_order(request):
    """Modules whose hazards are between the programs of one launch use it
    (`pytestmark = pytest.mark.usefixtures("program_order")`): the interpreter runs a launch's
    programs one after another, so a race on a GPU between two of them passes in one order
    and shows in the other (runtime/interpreter.py, TJIT_PROGRAM_ORDER=reverse for a whole run)."""
    if request.param == "reverse" and not ON_CUDA:
        from tjit.runtime.interpreter import programs_in_reverse
        with programs_in_reverse():
            yield request.param
    else:
        yield request.param


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with Dynamo's caches empty: tests that compile the same code object
    (a function defined in a parametrized test) would otherwise pile up recompiles until
    Dynamo's limit, after which it runs that code eagerly and the test checks eager against
    eager. (Dynamo is not imported for tests that do not use it.)"""
    import sys
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    yield


@pytest.fixture
def library_matmuls(monkeypatch):
    """Matrix products run as library calls (frontend/matmul.py's rule forced): for tests of
    the library-call machinery that use a matmul as their call."""
    monkeypatch.setenv("TJIT_MATMUL", "library")


@pytest.fixture(autouse=True)
def _every_kernel_compiles_for_sm90(request):
    yield
    if ON_CUDA:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            # a device-side assert (eager's, on an index out of range) leaves this process's
            # CUDA context unusable: end the worker, so xdist starts a fresh one for the tests after
            os._exit(1)
        return
    # a test marked spills_at_sm90 (a known gap, with its reason) must still compile
    check_gpu_compiles(allow_spills=request.node.get_closest_marker("spills_at_sm90") is not None)


def pytest_runtest_logreport(report):
    """TJIT_FAILURE_LOG=PATH: each failure's report appended to PATH as it happens, for runs
    that a time limit may stop before pytest prints its summary (bench/gpu_session.sh)."""
    path = os.environ.get("TJIT_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")

"""Differential checks against eager PyTorch."""
import torch
from torch.testing._comparison import default_tolerances

import tjit


def assert_matches_eager(got, expected, msg=""):
    """Exact for integers and bools, torch's per-dtype tolerances for floats; NaNs must match."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(expected), msg
        for g, e in zip(got, expected):
            assert_matches_eager(g, e, msg)
        return
    if not isinstance(expected, torch.Tensor):
        assert got == expected, msg
        return
    assert isinstance(got, torch.Tensor), f"{msg}: expected a tensor, got {type(got)}"
    assert got.shape == expected.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert got.dtype == expected.dtype, f"{msg}: dtype {got.dtype} != {expected.dtype}"
    torch.testing.assert_close(got, expected, equal_nan=True, msg=lambda m: f"{msg}\n{m}")


def clone_args(args):
    """Fresh copies with the same strides and storage offsets as the originals."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            storage = a.untyped_storage()
            base = torch.empty(0, dtype=a.dtype, device=a.device).set_(
                storage.clone(), a.storage_offset(), a.shape, a.stride())
            out.append(base)
        else:
            out.append(a)
    return out


def check_against_eager(fn, *args, compiled=None, **compile_options):
    """Run fn eagerly and compiled on separate copies of args; outputs and every input
    (in-place writes included) must match. A float result outside torch's tolerance still
    passes if it is as accurate as eager's against fn run in float64 on the same inputs (a
    sum of hundreds of float32 values, added in another order, can miss the tolerance by
    rounding alone). Returns the compiled function."""
    compiled = compiled or tjit.compile(fn, **compile_options)
    eager_args, tjit_args = clone_args(args), clone_args(args)
    rng = torch.get_rng_state()
    expected = fn(*eager_args)
    got = compiled(*tjit_args)
    name = getattr(fn, "__name__", fn)
    pairs = [(got, expected, f"{name} outputs")]
    pairs += [(g, e, f"{name} input {k} after the call")
              for k, (e, g) in enumerate(zip(eager_args, tjit_args)) if isinstance(e, torch.Tensor)]
    exact = None
    for k, (g, e, msg) in enumerate(pairs):
        try:
            assert_matches_eager(g, e, msg)
        except AssertionError:
            exact = exact or _in_float64(fn, args, rng)
            if exact is None or not _all_floating(g, e):
                raise
            _assert_as_accurate_by_dtype(g, e, exact[k], msg)
    return compiled


def _in_float64(fn, args, rng_state):
    """fn's outputs, then each argument after the call, computed with every floating argument
    in float64 (complex in complex128), from the random state eager's call started with;
    None if fn does not run that way."""
    widened = [_widened(a) for a in args]
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        try:
            outputs = fn(*widened)
        except Exception:
            return None
    return [outputs] + [a for a in widened if isinstance(a, torch.Tensor)]


def _widened(a):
    if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.is_complex()):
        return a
    wide = torch.complex128 if a.is_complex() else torch.float64
    elements = a.untyped_storage().nbytes() // a.element_size()
    storage = torch.empty(0, dtype=a.dtype).set_(a.untyped_storage(), 0, (elements,), (1,))
    return torch.empty(0, dtype=wide).set_(storage.to(wide).untyped_storage(), a.storage_offset(), a.shape, a.stride())


def _all_floating(got, expected):
    if isinstance(expected, (tuple, list)):
        return all(_all_floating(g, e) for g, e in zip(got, expected))
    return isinstance(expected, torch.Tensor) and expected.is_floating_point()


def _assert_as_accurate_by_dtype(got, eager, exact, msg):
    if isinstance(eager, (tuple, list)):
        for g, e, x in zip(got, eager, exact):
            _assert_as_accurate_by_dtype(g, e, x, msg)
        return
    try:
        assert_matches_eager(got, eager, msg)
    except AssertionError:
        rtol, atol = default_tolerances(eager.dtype)
        assert_as_accurate_as_eager(got, eager, exact, rtol, atol, msg)


def launches(compiled, *args, **kwargs) -> int:
    """The kernels one call of compiled launches (on copies of args, so in-place writes and
    donations leave the caller's tensors alone): what kernel counts are about, rather than
    the plans tjit.explain lists (a plan that writes nothing is never launched)."""
    before = tjit.counters.launches
    compiled(*clone_args(args), **kwargs)
    return tjit.counters.launches - before


def assert_as_accurate_as_eager(got, eager, exact, rtol, atol, msg=""):
    """For float16/bfloat16 results, where eager's own rounding (its backward formulas run in the
    16-bit type) can exceed any fixed tolerance while tjit accumulates in float32: each element
    of got must be within tolerance of eager's, or no further from the exact answer (`exact`:
    the same function in float64 on the same inputs) than twice eager's error, plus tolerance."""
    assert got.dtype == eager.dtype and got.shape == eager.shape, \
        f"{msg}: {got.dtype} {tuple(got.shape)}, eager's {eager.dtype} {tuple(eager.shape)}"
    g, e, x = got.double(), eager.double(), exact.double()
    # (an infinity is near only itself: a tolerance relative to it would admit any value, the
    # other infinity among them; eager's error where it overflowed bounds nothing)
    near_eager = (g == e) | e.isfinite() & ((g - e).abs() <= atol + rtol * e.abs())
    eager_error = torch.where(e.isfinite(), (e - x).abs(), 0.0)
    as_accurate = (g == x) | x.isfinite() & ((g - x).abs() <= 2 * eager_error + atol + rtol * x.abs())
    ok = near_eager | as_accurate | (g.isnan() & e.isnan())
    if not ok.all():
        k = (~ok).nonzero()[0].tolist()
        raise AssertionError(f"{msg}: {int((~ok).sum())} of {ok.numel()} elements differ, e.g. at {k}: tjit "
                             f"{g[tuple(k)].item()}, eager {e[tuple(k)].item()}, exact {x[tuple(k)].item()}")


def train_beside_eager(eager: torch.nn.Module, make_input, steps: int = 2):
    """A copy of the module through torch.compile(..., backend="tjit"), run beside eager for
    `steps` forwards on fresh inputs (make_input()) and backwards of one random incoming
    gradient each: the outputs match, and no graph runs eagerly (its warning is an error).
    Returns (the copy, its compiled form), their gradients accumulated, for the caller's
    comparisons."""
    import copy
    import warnings
    ours = copy.deepcopy(eager)
    compiled = torch.compile(ours, backend="tjit")
    for _ in range(steps):
        x = make_input()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (a graph run eagerly warns)
            got = compiled(x)
        expected = eager(x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        incoming = torch.randn(expected.shape)
        got.backward(incoming)
        expected.backward(incoming)
    return ours, compiled

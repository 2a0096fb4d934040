"""Differential checks against eager PyTorch."""
import torch

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
    (in-place writes included) must match. Returns the compiled function."""
    compiled = compiled or tjit.compile(fn, **compile_options)
    eager_args, tjit_args = clone_args(args), clone_args(args)
    expected = fn(*eager_args)
    got = compiled(*tjit_args)
    assert_matches_eager(got, expected, f"{getattr(fn, '__name__', fn)} outputs")
    for k, (e, g) in enumerate(zip(eager_args, tjit_args)):
        if isinstance(e, torch.Tensor):
            assert_matches_eager(g, e, f"{getattr(fn, '__name__', fn)} input {k} after the call")
    return compiled


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
    near_eager = (g - e).abs() <= atol + rtol * e.abs()
    as_accurate = (g - x).abs() <= 2 * (e - x).abs() + atol + rtol * x.abs()
    ok = near_eager | as_accurate | (g.isnan() & e.isnan())
    if not ok.all():
        k = (~ok).nonzero()[0].tolist()
        raise AssertionError(f"{msg}: {int((~ok).sum())} of {ok.numel()} elements differ, e.g. at {k}: tjit "
                             f"{g[tuple(k)].item()}, eager {e[tuple(k)].item()}, exact {x[tuple(k)].item()}")

"""Differential coverage of pointwise math against eager PyTorch.

Every op runs on fresh random inputs (the seed is printed with any failure) that mix
ordinary values with NaN, +-inf, +-0, integers and half-integers (rounding ties), values
at domain edges (+-1 for asin/atanh, 1 for acosh, ...), tiny and huge magnitudes, and for
integers the type's extremes and negative operands; binary ops also meet every pair of edge
values. For each dtype (combination) the ops eager accepts are compiled a few at a time into
one function (one fused kernel each: the interpreter is slow per program, and every kernel is
compiled for sm_90 after the test), and every op eager rejects must make tjit raise a
TjitError rather than return an answer.

Where eager's CPU kernels depart from the math (EAGER_QUIRKS: sinh overflowing early,
vectorised gelu at +-inf, ...) tjit is compared with a float64 reference instead. What
tracing refuses while eager computes it is listed (TRACING_STRICTER).

Known, documented gap: integer division by zero (eager raises ZeroDivisionError from
inside its kernel) is not checked, so integer divisors are never zero here.
"""
from __future__ import annotations

import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from torch.testing._comparison import default_tolerances

import tjit
from tests.helpers import assert_matches_eager, check_against_eager

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.int32, torch.int64, torch.int8, torch.uint8)
ALL = FLOATS + INTS + (torch.bool,)
# eager's verdict on rejected ops is checked here; fake tensors log each rejection loudly
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter, on inf/nan
CHUNK = 8  # weight of the ops in one compiled function (see _chunks)
N = 512  # elements per test input: small, the interpreter runs every program in numpy

inf, nan = math.inf, math.nan
SPECIAL = [nan, inf, -inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 3.5, 2.0, -2.0, 3.0, -3.0,
           0.999, -0.999, 1.001, -1.001, 1e-6, -1e-6, 1e-30, -1e-30, 1e-40, -1e-40, 0.25, -0.125,
           20.0, 20.5, -20.0, 30.0, 88.0, -88.0, 89.0, -104.0, 710.0, -745.0, 1e4, -1e4, 65504.0, 65520.0,
           1e30, -1e30, 3e38, -3e38, 1e300, math.pi / 2, -math.pi / 2, math.pi, 1e8 + 0.5, 4194304.5,
           8388609.0, 2.0 ** 53 + 2, 0.1, -0.1, 7.0, 6.0, -6.0, 4.0]


def new_generator() -> tuple[torch.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


def float_values(n: int, g: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """A shuffled mix of typical, edge and special values (computed in float64, then rounded)."""
    k = n // 8
    parts = [
        torch.randn(3 * k, generator=g, dtype=torch.float64) * 3,
        torch.rand(k, generator=g, dtype=torch.float64) * 2.4 - 1.2,  # around the +-1 domain edges
        torch.randint(-12, 13, (k,), generator=g).double() * 0.5,  # integers and ties
        (torch.rand(k, generator=g, dtype=torch.float64) * 40 - 20).exp2()
        * (torch.randint(0, 2, (k,), generator=g).double() * 2 - 1),  # tiny to huge magnitudes
    ]
    specials = torch.tensor(SPECIAL, dtype=torch.float64)
    rest = n - sum(p.numel() for p in parts)
    parts.append(specials[torch.randint(0, len(SPECIAL), (rest,), generator=g)])
    parts[-1][:min(rest, len(SPECIAL))] = specials[:min(rest, len(SPECIAL))]
    x = torch.cat(parts)
    return x[torch.randperm(n, generator=g)].to(dtype)


def int_values(n: int, g: torch.Generator, dtype) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -12), min(info.max, 12)
    k = n // 4
    small = torch.randint(lo, hi + 1, (2 * k,), generator=g, dtype=torch.int64)
    wide = torch.randint(max(info.min, -2**62), min(info.max, 2**62), (k,), generator=g, dtype=torch.int64)
    extremes = torch.tensor([info.min, info.max, info.min + 1, info.max - 1, 0, 1, lo, hi], dtype=torch.int64)
    extremes = extremes[torch.randint(0, len(extremes), (n - 3 * k,), generator=g)]
    x = torch.cat([small, wide, extremes])
    return x[torch.randperm(n, generator=g)].to(dtype)


def values(dtype, g, n=N, shape=None) -> torch.Tensor:
    x = float_values(n, g, dtype) if dtype.is_floating_point else int_values(n, g, dtype)
    return x.reshape(shape) if shape is not None else x


def nonzero_divisor(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Integer divisors must not be zero in the type the division is computed in (eager raises
    ZeroDivisionError: a documented gap); an int64 0-dim 256 is 0 beside an int8 tensor."""
    if y.dtype is torch.bool:
        return torch.ones_like(y)
    common = torch.result_type(x, y)
    if common.is_floating_point:
        return y  # float division by zero is well defined: inf, NaN
    return torch.where(y.to(common) == 0, torch.ones_like(y), y)


def no_int_min(x: torch.Tensor) -> torch.Tensor:
    """INT_MIN // -1 traps (SIGFPE) inside eager's kernel, so dividends avoid INT_MIN."""
    if x.dtype.is_floating_point or x.dtype in (torch.bool, torch.uint8):
        return x
    info = torch.iinfo(x.dtype)
    return torch.where(x == info.min, torch.full_like(x, info.min + 1), x)


# -- where eager is not the reference ------------------------------------------------------------
def _overflowed(e, x, *rest):
    return torch.isinf(e) & torch.isfinite(x.double())


def _low_precision(e, x, *rest):
    return torch.full_like(e, x.dtype in (torch.float16, torch.bfloat16), dtype=torch.bool)


def _elementwise_libm(f):
    """A float64 reference from Python's libm, for where float64 eager is inexact too
    (on the inputs converted to the result type first, as eager's kernel sees them)."""
    def ref(e, *args):
        ts = torch.broadcast_tensors(*[a.to(e.dtype).double() for a in args])
        return torch.tensor([f(*v) for v in zip(*[t.flatten().tolist() for t in ts])],
                            dtype=torch.float64).reshape(ts[0].shape)
    return ref


def _sinh(v):
    try:
        return math.sinh(v)
    except OverflowError:
        return math.copysign(inf, v)


def _cosh(v):
    try:
        return math.cosh(v)
    except OverflowError:
        return inf


def _remainder(a, b):
    if b == 0 or math.isinf(a) or math.isnan(a) or math.isnan(b):
        return nan
    m = math.fmod(a, b)
    return m + b if m != 0 and (m < 0) != (b < 0) else m


def _huge_quotient(e, x, y):
    """eager's vectorised float fmod computes a - trunc(a / b) * b: inexact once a / b has
    more digits than the type, NaN once it overflows"""
    if not e.dtype.is_floating_point:
        return torch.zeros_like(e, dtype=torch.bool)
    a, b = x.to(e.dtype).double(), y.to(e.dtype).double()
    mantissa = {torch.float64: 2.0 ** 52}.get(e.dtype, 2.0 ** 23)
    return torch.isfinite(a) & torch.isfinite(b) & (b != 0) & ((a / b).abs() >= mantissa)


# Elements where eager's CPU kernel for a dtype departs from the math (and from eager's own
# float64 answer); there tjit is compared with a float64 reference rounded to the dtype:
# name -> (which elements, given eager's answer and the inputs; the reference, or None for
# eager's answer on float64 inputs)
EAGER_QUIRKS = {
    # sinh/cosh: eager's exp(|x|) overflows just below where the result does (float32
    # sinh(89) = 2.2e38 is finite; float64 sinh(710) = 1.1e308 too)
    "sinh": (_overflowed, _elementwise_libm(_sinh)), "cosh": (_overflowed, _elementwise_libm(_cosh)),
    # vectorised gelu: NaN at +inf (float32, float16), 0 or NaN at -inf depending on the
    # dtype, and x * (1 + erf) overflowing near the largest float32
    "gelu": (lambda e, x: ~torch.isfinite(x.double()) | (x.double().abs() > 1e38), None),
    # eager's low-precision logit rounds x / (1 - x) to the tensor's type before the log
    # (bfloat16 logit(0.5234) = 0.0967 instead of 0.0938), and with eps it rounds eps and
    # 1 - eps to the type (bfloat16: 1 - 1e-3 == 1, so logit is inf above it)
    "logit": (_low_precision, None), "logit_eps": (_low_precision, None),
    "fmod": (_huge_quotient, _elementwise_libm(lambda a, b: math.fmod(a, b) if b and not math.isinf(a) else nan)),
    "remainder": (_huge_quotient, _elementwise_libm(_remainder)),
    "mod_op": (_huge_quotient, _elementwise_libm(_remainder)),
}

# What tracing refuses (torch's meta functions) while eager computes it: tjit raises a
# clear TjitError there. Bool shifts: the meta function wants integers.
TRACING_STRICTER = {"shl_2", "shr_1"}


def eager_answer(name, fn, args, quirks=None):
    expected = fn(*args)
    quirk = (EAGER_QUIRKS if quirks is None else quirks).get(name)
    if quirk is not None and isinstance(expected, torch.Tensor) and expected.dtype.is_floating_point:
        where, reference = quirk
        mask = where(expected, *args)
        if mask.any():
            ref = reference(expected, *args) if reference else fn(*[a.double() if isinstance(a, torch.Tensor)
                                                                    else a for a in args])
            expected = torch.where(mask, ref.to(expected.dtype), expected)
    return expected


# -- the differential runner -------------------------------------------------------------------
def _mismatch_examples(got, expected, args, limit=4) -> str:
    """A few elements where got and expected differ, with the inputs that produced them."""
    try:
        if expected.dtype.is_floating_point:
            rtol, atol = default_tolerances(expected)
            bad = ~torch.isclose(got.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=True)
        else:
            bad = got != expected
        idx = bad.nonzero()[:limit]
        lines = []
        for i in idx.tolist():
            ins = []
            for a in args:
                if isinstance(a, torch.Tensor):
                    v = a.expand(expected.shape)[tuple(i)] if a.dim() else a
                    ins.append(repr(v.item()))
                else:
                    ins.append(repr(a))
            lines.append(f"    at {i}: inputs ({', '.join(ins)}) -> tjit {got[tuple(i)].item()!r}, "
                         f"eager {expected[tuple(i)].item()!r}")
        return "\n".join(lines)
    except Exception as e:  # the shape or dtype itself is wrong: the assertion message says so
        return f"    ({type(e).__name__}: {e})"


def _compare(name, got, expected, args) -> list[str]:
    try:
        assert_matches_eager(got, expected, name)
    except AssertionError as e:
        first = str(e).strip().splitlines()
        detail = _mismatch_examples(got, expected, args) if isinstance(got, torch.Tensor) and \
            got.shape == expected.shape and got.dtype == expected.dtype else ""
        return [f"{name}: {' | '.join(first[:4])}\n{detail}"]
    return []


def _differential_chunk(ops, names, expected, args) -> list[str]:
    def group(*a):
        return tuple(ops[n](*a) for n in names)

    failures = []
    try:
        got = tjit.compile(group)(*args)
    except Exception:  # noqa: BLE001 - find out which ops are at fault, one by one
        got = None
    if got is not None:
        for n, g in zip(names, got):
            failures += _compare(n, g, expected[n], args)
        return failures
    for n in names:
        try:
            g = tjit.compile(ops[n])(*args)
        except Exception as e:  # noqa: BLE001
            if not (n in TRACING_STRICTER and isinstance(e, tjit.TjitError)
                    and "tracing failed" in str(e)):
                failures.append(f"{n}: tjit raised {type(e).__name__}: {str(e)[:300]}")
            continue
        failures += _compare(n, g, expected[n], args)
    return failures


CALLS = ("sin", "cos", "tan")  # libdevice with a slow-path call: a few other outputs beside it can spill
HEAVY = ("sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf",
         "gelu", "mish", "softplus", "selu", "celu", "elu", "logit", "pow", "rpow", "atan2", "hypot", "exp", "log",
         "div", "mod", "floordiv", "fmod", "remainder", "rdiv", "reciprocal", "rsqrt", "sigmoid", "silu", "addcdiv")


def _chunks(names: list[str], args) -> list[list[str]]:
    """Ops grouped into compiled functions (one kernel each) small enough for sm_90 registers:
    every kernel the suite launches is compiled for sm_90 and must not spill."""
    f64 = any(isinstance(a, torch.Tensor) and a.dtype is torch.float64 for a in args)
    chunks, current, weight = [], [], 0
    for n in names:
        head = n.split("_")[0]
        w = 5 if head in CALLS else (4 if f64 else 2) if head in HEAVY else 1
        if current and weight + w > CHUNK:
            chunks.append(current)
            current, weight = [], 0
        current.append(n)
        weight += w
    return chunks + [current] if current else chunks


def differential(ops: dict, args: tuple, context: str, quirks: dict = None) -> None:
    """Compile every op eager accepts (all in one function) and compare outputs; every op
    eager rejects must make tjit raise a TjitError."""
    expected, rejected = {}, {}
    for name, fn in ops.items():
        try:
            expected[name] = eager_answer(name, fn, args, quirks)
        except Exception as e:  # noqa: BLE001 - eager's verdict, whatever it is
            rejected[name] = e
    failures: list[str] = []
    for chunk in _chunks(list(expected), args):
        failures += _differential_chunk(ops, chunk, expected, args)
    for n, err in rejected.items():
        try:
            tjit.compile(ops[n])(*args)
        except tjit.TjitError:
            continue
        except Exception as e:  # noqa: BLE001
            failures.append(f"{n}: eager raises {type(err).__name__}; tjit raised a non-tjit "
                            f"{type(e).__name__}: {str(e)[:200]}")
            continue
        failures.append(f"{n}: eager raises {type(err).__name__}: {str(err)[:120]!r} but tjit returned a value")
    assert not failures, f"{context}: {len(failures)} op(s) differ from eager\n" + "\n".join(failures)


def dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- unary ops (and ops with Python-scalar operands) ------------------------------------------------
def _pow(e):
    return lambda x: x ** e


def _rpow(b):
    return lambda x: b ** x


UNARY = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "sgn": torch.sgn, "square": torch.square,
    "reciprocal": torch.reciprocal, "positive": lambda x: +x,
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log, "log2": torch.log2,
    "log10": torch.log10, "log1p": torch.log1p, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "sin": torch.sin, "cos": torch.cos, "tan": torch.tan, "asin": torch.asin, "acos": torch.acos,
    "atan": torch.atan, "sinh": torch.sinh, "cosh": torch.cosh, "tanh": torch.tanh, "asinh": torch.asinh,
    "acosh": torch.acosh, "atanh": torch.atanh,
    "sigmoid": torch.sigmoid, "erf": torch.erf, "erfc": torch.erfc,
    "floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc, "frac": torch.frac,
    "round_decimals2": lambda x: torch.round(x, decimals=2),
    "round_decimals-1": lambda x: torch.round(x, decimals=-1),
    "relu": torch.relu, "relu6": F.relu6,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "softplus": F.softplus, "softplus_beta2_thr5": lambda x: F.softplus(x, beta=2.0, threshold=5.0),
    "softplus_beta0.5": lambda x: F.softplus(x, beta=0.5, threshold=30.0),
    "elu": F.elu, "elu_alpha0.5": lambda x: F.elu(x, alpha=0.5), "selu": F.selu, "celu": F.celu,
    "leaky_relu": F.leaky_relu, "leaky_relu_0.2": lambda x: F.leaky_relu(x, 0.2),
    "hardtanh": F.hardtanh, "hardtanh_-2_3": lambda x: F.hardtanh(x, -2.0, 3.0),
    "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish, "mish": F.mish,
    "logit": torch.logit, "logit_eps": lambda x: torch.logit(x, eps=1e-3),
    "nan_to_num": torch.nan_to_num,
    "nan_to_num_args": lambda x: torch.nan_to_num(x, nan=0.5, posinf=100.0, neginf=-100.0),
    "isnan": torch.isnan, "isinf": torch.isinf, "isfinite": torch.isfinite,
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not,
    "clamp_min": lambda x: torch.clamp(x, min=-0.5), "clamp_max": lambda x: torch.clamp(x, max=0.5),
    "clamp_both": lambda x: torch.clamp(x, -0.5, 2.0), "clamp_int_bounds": lambda x: torch.clamp(x, -3, 5),
    "clamp_min_int": lambda x: torch.clamp_min(x, 2), "clamp_max_int": lambda x: torch.clamp_max(x, 2),
    **{f"pow_{e}": _pow(e) for e in (2, 3, 0.5, -1, -2, 0, 1, 2.5, -0.5, 4, 5, 7, 0.0, 1.0, 2.0, -3, 1.5, 13)},
    **{f"rpow_{b}": _rpow(b) for b in (2, 2.5, 0.5, -2, 3, 1, 0)},
    "add_int": lambda x: x + 3, "add_float": lambda x: x + 1.5, "add_bool": lambda x: x + True,
    "rsub_int": lambda x: 2 - x, "sub_float": lambda x: x - 0.25, "mul_int": lambda x: x * 3,
    "mul_float": lambda x: x * 0.1, "mul_big_int": lambda x: x * 1000, "div_int": lambda x: x / 3,
    "div_float": lambda x: x / 0.3, "rdiv": lambda x: 1 / x, "add_alpha": lambda x: torch.add(x, 2, alpha=3),
    "floordiv_3": lambda x: x // 3, "floordiv_-2": lambda x: x // -2, "floordiv_-2.5": lambda x: x // -2.5,
    "mod_3": lambda x: x % 3, "mod_-3": lambda x: x % -3, "mod_2.5": lambda x: x % 2.5,
    "fmod_3": lambda x: torch.fmod(x, 3), "fmod_-2.5": lambda x: torch.fmod(x, -2.5),
    "div_trunc_3": lambda x: torch.div(x, 3, rounding_mode="trunc"),
    "div_floor_-3": lambda x: torch.div(x, -3, rounding_mode="floor"),
    "div_trunc_0.7": lambda x: torch.div(x, 0.7, rounding_mode="trunc"),
    "gt_0": lambda x: x > 0, "le_1.5": lambda x: x <= 1.5, "eq_1": lambda x: x == 1, "ne_0": lambda x: x != 0,
    "lt_-2": lambda x: x < -2, "ge_true": lambda x: x >= True,
    "and_3": lambda x: x & 3, "or_4": lambda x: x | 4, "xor_5": lambda x: x ^ 5, "xor_true": lambda x: x ^ True,
    "shl_2": lambda x: x << 2, "shr_1": lambda x: x >> 1,
    "where_scalar": lambda x: torch.where(x > 0, x, 0.5), "where_both_scalars": lambda x: torch.where(x > 1, 2, -1),
    "maximum_scalar_t": lambda x: torch.maximum(x, torch.tensor(0.5)),
    "lerp_scalar": lambda x: torch.lerp(x, torch.ones_like(x), 0.3),
    "float": lambda x: x.float(), "half": lambda x: x.half(), "double": lambda x: x.double(),
    "bfloat16": lambda x: x.bfloat16(), "bool": lambda x: x.bool(),
    "full_like": lambda x: torch.full_like(x, 2.5) + x, "full_like_300": lambda x: torch.full_like(x, 300) * x,
    "full_like_f16_1e5": lambda x: torch.full_like(x, 1e5, dtype=torch.float16),
    "masked_fill": lambda x: x.masked_fill(x > 1, 7), "masked_fill_1000": lambda x: x.masked_fill(x > 1, 1000),
}


@pytest.mark.parametrize("dtype", ALL, ids=dname)
def test_unary_and_scalar_ops(dtype):
    g, seed = new_generator()
    x = values(dtype, g)
    differential(UNARY, (x,), f"{dname(dtype)} seed={seed}")


# -- binary ops over dtype pairs (type promotion included) -------------------------------------------
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "rdiv": lambda x, y: y / x,
    "add_alpha": lambda x, y: torch.add(x, y, alpha=2), "sub_alpha": lambda x, y: torch.sub(x, y, alpha=3),
    # (an alpha that float16 / bfloat16 cannot hold: eager rounds it to the type first)
    "add_alpha_0.3": lambda x, y: torch.add(x, y, alpha=0.3), "sub_alpha_0.3": lambda x, y: torch.sub(x, y, alpha=0.3),
    "rsub": lambda x, y: y - x, "sq_diff": lambda x, y: (x - y) * (x - y),
    "maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax, "fmin": torch.fmin,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or, "logical_xor": torch.logical_xor,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
    "atan2": torch.atan2, "pow": torch.pow, "rpow": lambda x, y: y ** x, "hypot": torch.hypot,
    "copysign": torch.copysign, "where_gt": lambda x, y: torch.where(x > y, x, y),
    "where_nan": lambda x, y: torch.where(torch.isnan(y), x, y),
    "clamp_min_t": lambda x, y: torch.clamp(x, min=y), "clamp_max_t": lambda x, y: torch.clamp(x, max=y),
    "lerp_0.3": lambda x, y: torch.lerp(x, y, 0.3), "lerp_0.7": lambda x, y: torch.lerp(x, y, 0.7),
}
DIVISIONS = {
    "floor_divide": torch.floor_divide, "floordiv_op": lambda x, y: x // y, "remainder": torch.remainder,
    "mod_op": lambda x, y: x % y, "fmod": torch.fmod, "true_divide": torch.true_divide,
    "div_trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
    "div_floor": lambda x, y: torch.div(x, y, rounding_mode="floor"),
}
SHIFTS = {"shl": lambda x, y: x << y, "shr": lambda x, y: x >> y, "bitwise_left_shift": torch.bitwise_left_shift,
          "bitwise_right_shift": torch.bitwise_right_shift}

EDGE_FLOATS = [nan, inf, -inf, 0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, -3.0, 1e30]
EDGE_INTS = [0, 1, -1, 2, -2, 3, 7, -7, 100, -100, "min", "max"]


def pair_values(dx, dy, g, shape_x, shape_y):
    """Random x and y with every pair of edge values (NaN, inf, -0, ...) among the first
    elements, so special cases meet systematically, not only by chance."""
    x, y = values(dx, g, math.prod(shape_x)), values(dy, g, math.prod(shape_y))
    edges_x, edges_y = _edges(dx), _edges(dy)
    pairs = [(a, b) for a in edges_x for b in edges_y][:min(x.numel(), y.numel())]
    if x.numel() == y.numel():
        x[:len(pairs)] = torch.stack([a for a, _ in pairs])
        y[:len(pairs)] = torch.stack([b for _, b in pairs])
    return x.reshape(shape_x), y.reshape(shape_y)


def _edges(dtype) -> list[torch.Tensor]:
    if dtype.is_floating_point:
        return [torch.tensor(v, dtype=torch.float64).to(dtype) for v in EDGE_FLOATS]
    if dtype is torch.bool:
        return [torch.tensor(v) for v in (True, False)]
    info = torch.iinfo(dtype)
    vals = [info.min if v == "min" else info.max if v == "max" else v for v in EDGE_INTS]
    return [torch.tensor(v, dtype=torch.int64).to(dtype) for v in vals]  # wraps into uint8


PAIRS = [(d, d) for d in ALL] + [
    (torch.int32, torch.int64), (torch.float16, torch.float32), (torch.bfloat16, torch.float16),
    (torch.bool, torch.int32), (torch.int8, torch.uint8), (torch.uint8, torch.bool), (torch.int64, torch.float32),
    (torch.int32, torch.float64), (torch.bfloat16, torch.int64), (torch.float32, torch.float64),
    (torch.bool, torch.float16), (torch.int8, torch.bfloat16)]
ZERO_DIM = [(torch.float16, torch.float32), (torch.int8, torch.int64), (torch.int32, torch.float64),
            (torch.bool, torch.int32), (torch.uint8, torch.int8), (torch.bfloat16, torch.float64),
            (torch.float32, torch.bool)]
PAIR_CASES = [(dx, dy, False) for dx, dy in PAIRS] + [(dx, dy, True) for dx, dy in ZERO_DIM]


def _pair_id(case):
    dx, dy, zero_dim = case
    return f"{dname(dx)}-{dname(dy)}" + ("-0dim" if zero_dim else "")


@pytest.mark.parametrize("case", PAIR_CASES, ids=_pair_id)
def test_binary_ops(case):
    dx, dy, zero_dim = case
    g, seed = new_generator()
    shape_y = () if zero_dim else (16, 24)
    x, y = pair_values(dx, dy, g, (16, 24), shape_y)
    context = f"{_pair_id(case)} seed={seed}"
    differential(BINARY, (x, y), context)
    # integer divisors are never 0, and INT_MIN // -1 (a trap inside eager) never happens
    differential(DIVISIONS, (no_int_min(x), nonzero_divisor(y, x)), context)


@pytest.mark.parametrize("case", [(torch.int32, torch.int32), (torch.int64, torch.int64), (torch.int8, torch.int8),
                                  (torch.uint8, torch.uint8), (torch.int8, torch.int64), (torch.uint8, torch.int32),
                                  (torch.int16, torch.int16), (torch.float32, torch.int32)], ids=lambda c: _pair_id(c + (0,)))
def test_shifts(case):
    """Shift amounts from negative to past the width: torch defines all of them."""
    dx, dy = case
    g, seed = new_generator()
    x = values(dx, g, 24 * 16).reshape(16, 24) if dx is not torch.int16 else \
        values(torch.int32, g, 24 * 16).reshape(16, 24).to(torch.int16)
    bits = torch.promote_types(dx, dy).itemsize * 8
    lo = 0 if dy is torch.uint8 else -3
    y = torch.randint(lo, bits + 4, (24,), generator=g).to(dy)
    differential(SHIFTS, (x, y), f"{_pair_id(case + (0,))} seed={seed}")


# -- ternary ops -------------------------------------------------------------------------------
TERNARY = {
    "where": lambda c, x, y: torch.where(c, x, y), "where_scalar_x": lambda c, x, y: torch.where(c, 2.5, y),
    "where_scalar_y": lambda c, x, y: torch.where(c, x, -1), "where_not": lambda c, x, y: torch.where(~c, x, y),
    "clamp_t": lambda c, x, y: torch.clamp(x, y, y + 2), "clamp_t_min_only": lambda c, x, y: torch.clamp(x, min=y),
    "clamp_t_max_only": lambda c, x, y: torch.clamp(x, max=y), "clamp_crossed": lambda c, x, y: torch.clamp(x, y, y - 1),
    "lerp_t": lambda c, x, y: torch.lerp(x, y, torch.where(c, 0.25, 0.75).to(x.dtype)),
    "lerp_w": lambda c, x, y: torch.lerp(x, y, y),
    "addcmul": lambda c, x, y: torch.addcmul(x, y, x, value=0.5),
    "addcmul_int": lambda c, x, y: torch.addcmul(x, y, y, value=2),
    "addcdiv": lambda c, x, y: torch.addcdiv(x, x, y, value=2),
    "addcdiv_default": lambda c, x, y: torch.addcdiv(y, x, y),
}


@pytest.mark.parametrize("case", [(d, d) for d in ALL] + [(torch.float16, torch.float32), (torch.int32, torch.float64),
                                                            (torch.bool, torch.int8), (torch.int64, torch.uint8)],
                         ids=lambda c: _pair_id(c + (0,)))
def test_ternary_ops(case):
    dx, dy = case
    g, seed = new_generator()
    x, y = pair_values(dx, dy, g, (12, 32), (12, 32))
    c = torch.randint(0, 2, (32,), generator=g).bool()  # broadcast condition
    differential(TERNARY, (c, x, y), f"{_pair_id(case + (0,))} seed={seed}")


# -- casts -------------------------------------------------------------------------------------
def _cast_to(dtype):
    """x.to(dtype), from the input whose values the target type can hold (see test_casts)."""
    def cast(a, s, u, b):
        src = a if dtype.is_floating_point or dtype is torch.bool else u if dtype is torch.uint8 else s
        return src.to(dtype)
    return cast


CASTS = {
    **{f"to_{dname(d)}": _cast_to(d) for d in ALL},
    "to_int32_big": lambda a, s, u, b: b.to(torch.int32), "to_int64_big": lambda a, s, u, b: b.to(torch.int64),
    "float": lambda a, s, u, b: a.float(), "half": lambda a, s, u, b: a.half(), "double": lambda a, s, u, b: a.double(),
    "bool": lambda a, s, u, b: a.bool(), "int": lambda a, s, u, b: s.int(), "long": lambda a, s, u, b: b.long(),
    "byte": lambda a, s, u, b: u.byte(), "char": lambda a, s, u, b: s.char(),
    "type_as": lambda a, s, u, b: s.type_as(u), "round_trip": lambda a, s, u, b: a.to(torch.float16).to(a.dtype),
    "to_int_then_float": lambda a, s, u, b: s.to(torch.int8).to(torch.float32) + a.to(torch.float32),
}


@pytest.mark.parametrize("dtype", ALL, ids=dname)
def test_casts(dtype):
    """x.to(every dtype). Float -> int truncates toward zero; values a float -> int cast cannot
    represent are undefined behaviour in eager, so each int target gets in-range values."""
    g, seed = new_generator()
    a = values(dtype, g, 384)
    if dtype.is_floating_point:
        frac = torch.rand(384, generator=g, dtype=torch.float64)
        s = ((frac * 255.8 - 127.9).to(dtype)).clamp(-127.9, 127.9)  # int8 range, fractions both signs
        s[:8] = torch.tensor([-0.0, 0.0, 0.5, -0.5, 0.99, -0.99, 127.5, -128.5], dtype=dtype)
        u = (frac * 255.9).to(dtype).clamp(0, 255)
        big = torch.finfo(dtype).max if dtype is torch.float16 else 2.0e9
        b = ((torch.rand(384, generator=g, dtype=torch.float64) * 2 - 1) * big).to(dtype)
    else:
        s = u = b = a
    differential(CASTS, (a, s, u, b), f"{dname(dtype)} seed={seed}")


# -- type promotion with 0-dim tensors and Python scalars --------------------------------------------
ZERO_DIM_TYPES = (torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
                  torch.float64)


def _with_zero_dim(k, op):
    return lambda x, *zs: op(x, zs[k])


def _with_scalar(v, op):
    return lambda x, *zs: op(x, v)


def _promotion_ops():
    ops = {}
    for k, d in enumerate(ZERO_DIM_TYPES):
        n = dname(d)
        ops[f"add_0d_{n}"] = _with_zero_dim(k, lambda x, z: x + z)
        ops[f"rmul_0d_{n}"] = _with_zero_dim(k, lambda x, z: z * x)
        ops[f"div_0d_{n}"] = _with_zero_dim(k, lambda x, z: x / z)
        ops[f"maximum_0d_{n}"] = _with_zero_dim(k, torch.maximum)
        ops[f"where_0d_{n}"] = _with_zero_dim(k, lambda x, z: torch.where(x != 0, z, x))
    for v in (3, -2.5, True, 2 ** 40, 1e10):
        ops[f"add_py_{v}"] = _with_scalar(v, lambda x, v: x + v)
        ops[f"rsub_py_{v}"] = _with_scalar(v, lambda x, v: v - x)
        ops[f"div_py_{v}"] = _with_scalar(v, lambda x, v: x / v)
        ops[f"mul_py_{v}"] = _with_scalar(v, lambda x, v: x * v)
    return ops


PROMOTION = _promotion_ops()


@pytest.mark.parametrize("dtype", ALL, ids=dname)
def test_type_promotion(dtype):
    """Tensors with 0-dim tensors of every type (they promote only within their category) and
    with Python scalars (int tensor + float -> float32, int / int -> float32, bool + int -> int64)."""
    g, seed = new_generator()
    x = values(dtype, g, 256).reshape(8, 32)
    zs = [values(d, g, 1).reshape(()) for d in ZERO_DIM_TYPES]
    differential(PROMOTION, (x, *zs), f"{dname(dtype)} seed={seed}")


# -- property test: random chains over broadcast, non-contiguous inputs --------------------------------
def _to_int(dtype):
    """A cast to an integer type that is defined for every input (float -> int is undefined
    behaviour outside the target's range, and for NaN)."""
    def cast(a):
        if a.dtype.is_floating_point:
            a = torch.nan_to_num(a, nan=0.0, posinf=100.0, neginf=-100.0).clamp(-100, 100)
        return a.to(dtype)
    return cast


# Ops whose results tjit and eager compute bit-identically (IEEE add/mul/div/sqrt in the same
# type, integer wrap-around, exact rounding functions), so comparisons, floor, casts... may
# follow them without a one-ulp difference flipping a result.
CHAIN_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "square": lambda a: a * a, "floor": torch.floor, "ceil": torch.ceil,
    "trunc": torch.trunc, "round": torch.round, "sign": torch.sign, "relu": torch.relu,
    "clamp": lambda a: a.clamp(-2, 3), "not": torch.logical_not, "half_of": lambda a: a * 0.5,
    "plus_one": lambda a: a + 1, "minus_2.5": lambda a: a - 2.5, "sqrt": torch.sqrt, "recip": torch.reciprocal,
    "to_f32": lambda a: a.float(), "to_f16": lambda a: a.half(), "to_bf16": lambda a: a.bfloat16(),
    "to_f64": lambda a: a.double(), "to_bool": lambda a: a.bool(), "to_i32": _to_int(torch.int32),
    "to_i8": _to_int(torch.int8), "to_u8": lambda a: _to_int(torch.int16)(a).abs().to(torch.uint8),
    "isnan": torch.isnan, "floordiv_3": lambda a: a // 3, "mod_-3": lambda a: a % -3,
}
CHAIN_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "minimum": torch.minimum, "max_by_where": lambda a, b: torch.where(a > b, a, b), "eq": torch.eq,
    "lt": torch.lt, "and": torch.logical_and, "xor": torch.bitwise_xor, "fmax": torch.fmax,
    "safe_floordiv": lambda a, b: a // torch.where((b == 0) | (b == -1), 2, b),  # no /0, no INT_MIN // -1
    "safe_mod": lambda a, b: a % torch.where(b == 0, 3, b),
}
CHAIN_TERNARY = {"where": lambda a, b, c: torch.where(a > 0, b, c), "clamp_t": lambda a, b, c: a.clamp(b, c)}
# approximate math, only ever the last step (one ulp of difference may not feed a comparison)
CHAIN_FINAL = {"exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin,
               "log1p": torch.log1p, "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"), "atan": torch.atan, "erf": torch.erf, "pow_1.5": lambda a: a ** 1.5}

LAYOUTS = ("contiguous", "transposed", "strided", "offset", "expanded")


def make_input(shape, dtype, layout, g) -> torch.Tensor:
    """A tensor of `shape` with the given memory layout (values as in the op tests)."""
    shape = tuple(shape)
    n = math.prod(shape)
    if layout == "transposed" and len(shape) >= 2:
        return values(dtype, g, n, shape[::-1]).permute(*reversed(range(len(shape))))
    if layout == "strided" and shape:
        wide = shape[:-1] + (2 * shape[-1] + 1,)
        return values(dtype, g, math.prod(wide), wide)[..., 1::2]
    if layout == "offset" and shape:
        tall = (shape[0] + 1,) + shape[1:]
        return values(dtype, g, math.prod(tall), tall)[1:]
    if layout == "expanded" and any(s > 1 for s in shape):
        axis = max(k for k, s in enumerate(shape) if s > 1)
        small = shape[:axis] + (1,) + shape[axis + 1:]
        return values(dtype, g, math.prod(small), small).expand(shape)
    return values(dtype, g, n, shape)


@settings(max_examples=int(os.environ.get("CHAIN_EXAMPLES", "40")), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_random_pointwise_chains(data):
    draw = data.draw
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    base = draw(st.lists(st.sampled_from([1, 2, 3, 5, 8, 13, 0]), max_size=3), label="shape")
    inputs = []
    for _ in range(draw(st.integers(1, 3), label="inputs")):
        drop = draw(st.integers(0, len(base)))
        shape = [s if draw(st.booleans()) else 1 for s in base[drop:]]
        inputs.append(make_input(shape, draw(st.sampled_from(ALL)), draw(st.sampled_from(LAYOUTS)), g))
    steps, pool = [], list(inputs)
    tables = {1: CHAIN_UNARY, 2: CHAIN_BINARY, 3: CHAIN_TERNARY}
    for _ in range(draw(st.integers(1, 6), label="steps")):
        arity = draw(st.sampled_from([1, 1, 2, 2, 3]), label="arity")
        table = tables[arity]
        name = draw(st.sampled_from(sorted(table)))
        picks = [draw(st.integers(0, len(pool) - 1)) for _ in range(arity)]
        try:
            value = table[name](*[pool[k] for k in picks])
        except Exception:  # noqa: BLE001 - eager refuses this combination (dtype, ...); try another
            continue
        steps.append((name, table[name], picks))
        pool.append(value)
    final = draw(st.sampled_from([None] + sorted(CHAIN_FINAL)))
    if final is not None:
        try:
            CHAIN_FINAL[final](pool[-1])
            steps.append((final, CHAIN_FINAL[final], [len(pool) - 1]))
        except Exception:  # noqa: BLE001
            pass
    if not steps:
        return
    outputs = sorted({len(inputs) + len(steps) - 1, draw(st.integers(len(inputs), len(inputs) + len(steps) - 1))})

    def chain(*args):
        vals = list(args)
        for _, fn, picks in steps:
            vals.append(fn(*[vals[k] for k in picks]))
        return tuple(vals[k] for k in outputs)

    note(f"inputs {[(tuple(t.shape), t.dtype, t.stride()) for t in inputs]}, steps {[(n, p) for n, _, p in steps]}, outputs {outputs}")
    event(f"{len(steps)} steps")
    check_against_eager(chain, *inputs)

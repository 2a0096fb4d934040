"""Triton helpers for math that `triton.language` lacks or gets subtly different from torch.

Generated kernels import this module as `tm`. Everything is written with core `tl` ops
only, because Triton's interpreter (how kernels run on CPU) has no libdevice; the same
source then compiles for the GPU. Each helper follows torch's definition for edge cases
(NaN, +-inf, +-0, domain edges) and is accurate to torch's float32/float64 tolerances.

Two Triton rules shape the code:
* A Python float literal is a float32 constant, even next to a float64 tensor, so any
  constant that float32 cannot hold exactly is written `tl.full([], c, x.dtype)`.
* Triton's interpreter broadcasts a 0-d boolean to float32 when it meets a block, and then
  `block & scalar` raises; binary helpers broadcast their (float) operands first.
"""
import os

import triton
import triton.language as tl

# Triton's interpreter stores bfloat16 as raw uint16 and converts it with a generic routine
# that truncates float32 -> bfloat16 (the GPU rounds to nearest even) and mangles bfloat16
# subnormals. Under the interpreter, conversions are done here bit-exactly instead (both
# branches are valid GPU code: a process that interprets also compiles this one for sm_90).
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


# -- conversions ---------------------------------------------------------------------------------
@triton.jit
def bf16_to_f32(x):
    if INTERPRETING:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def f32_to_bf16(x):
    """Round to nearest even, as eager and the GPU do."""
    if INTERPRETING:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + (0x7FFF + ((bits >> 16) & 1))
        rounded = tl.where(x != x, bits | 0x400000, rounded)  # NaN stays a (quiet) NaN
        return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


# -- rounding and signs ----------------------------------------------------------------------------
@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def round_half_even(x):
    f = tl.floor(x)
    d = x - f  # exact for floats
    f_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0
    up = (d > 0.5) | ((d == 0.5) & f_odd)
    r = tl.where(up, f + 1.0, f)
    return tl.where(r == 0, x * 0.0, r)  # nearbyint keeps the sign of zero: round(-0.3) = -0.0


@triton.jit
def sign(x):
    # torch: (0 < x) - (x < 0), so sign(NaN) = 0
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0)).to(x.dtype)


@triton.jit
def int_sign(x):
    return ((x > 0).to(x.dtype) - (x < 0).to(x.dtype)).to(x.dtype)


@triton.jit
def signbit(x):
    """The sign bit: true for negative numbers, -0.0 and NaNs with the sign bit set."""
    if x.dtype == tl.float64:
        return x.to(tl.int64, bitcast=True) < 0
    elif x.dtype == tl.float32:
        return x.to(tl.int32, bitcast=True) < 0
    else:
        return x.to(tl.int16, bitcast=True) < 0


@triton.jit
def isinf(x):
    return tl.abs(x) == float("inf")


# -- exponentials and logarithms -----------------------------------------------------------------
@triton.jit
def log1p(x):
    # log(u) * x / (u - 1) cancels the rounding error of u = 1 + x (Goldberg's trick).
    u = 1.0 + x
    small = u == 1.0
    safe = tl.where(small, 2.0, u)
    r = tl.log(safe) * (x / (safe - 1.0))
    r = tl.where(small, x, r)
    return tl.where(u == float("inf"), u, r)


@triton.jit
def expm1(x):
    # (u - 1) * x / log(u) with u = exp(x), exact near 0 (Kahan's trick).
    u = tl.exp(x)
    um1 = u - 1.0
    tiny = u == 1.0
    safe_log = tl.where(tiny | (um1 == -1.0), 1.0, tl.log(u))
    r = um1 * (x / safe_log)
    r = tl.where(tiny, x, r)
    r = tl.where(um1 == -1.0, -1.0, r)
    return tl.where(u == float("inf"), u, r)


@triton.jit
def _half_exp_squared(a):
    # exp(a) / 2 for large a without overflowing before the result does
    h = tl.exp(0.5 * a)
    return (0.5 * h) * h


# -- hyperbolic ------------------------------------------------------------------------------
@triton.jit
def tanh(x):
    a = tl.minimum(tl.abs(x), 40.0)
    e = expm1(2.0 * a)
    t = e / (e + 2.0)
    return tl.where(x < 0, -t, tl.where(x == x, t, x))


@triton.jit
def sinh(x):
    a = tl.abs(x)
    e = expm1(a)
    s = 0.5 * (e + e / (e + 1.0))
    s = tl.where(a > 20.0, _half_exp_squared(a), s)  # e^-a is below rounding there; no inf/inf
    return tl.where(x < 0, -s, s)


@triton.jit
def cosh(x):
    a = tl.abs(x)
    e = tl.exp(a)
    c = 0.5 * (e + 1.0 / e)
    return tl.where(a > 20.0, _half_exp_squared(a), c)


@triton.jit
def asinh(x):
    a = tl.abs(x)
    big = a > 1e8  # 1 + a*a is a*a there (and would overflow for huge a)
    safe = tl.where(big, 1.0, a)
    r = log1p(safe + safe * safe / (1.0 + tl.sqrt(1.0 + safe * safe)))
    r = tl.where(big, tl.log(tl.where(big, a, 1.0)) + tl.full([], 0.6931471805599453, x.dtype), r)
    return tl.where(x < 0, -r, tl.where(x == x, r, x))


@triton.jit
def acosh(x):
    big = x > 1e8
    t = tl.where(big, 0.0, x - 1.0)
    r = log1p(t + tl.sqrt(2.0 * t + t * t))
    r = tl.where(big, tl.log(tl.where(big, x, 1.0)) + tl.full([], 0.6931471805599453, x.dtype), r)
    return tl.where(x < 1.0, float("nan"), r)


@triton.jit
def atanh(x):
    # 0.5 * log1p(2a / (1 - a)) on a = |x|: for negative x the argument of log1p would
    # approach -1, where log1p magnifies rounding errors, so use the odd symmetry.
    a = tl.abs(x)
    r = 0.5 * log1p(2.0 * a / (1.0 - a))
    r = tl.where(a > 1.0, float("nan"), r)
    return tl.where(x < 0, -r, tl.where(x == x, r, x))


# -- trigonometric -----------------------------------------------------------------------------
@triton.jit
def tan(x):
    return tl.sin(x) / tl.cos(x)


@triton.jit
def atan(x):
    # Cephes atan.c: reduction to |r| <= 0.66 and the degree 4/5 rational x + x^3 P(x^2)/Q(x^2)
    # (relative error 2.6e-18), evaluated in the input's type. Plain arithmetic: no calls.
    a = tl.abs(x)
    big = a > 2.41421356237309504880  # tan(3 pi / 8)
    mid = a > 0.66
    r = tl.where(big, -1.0 / tl.where(big, a, 1.0), tl.where(mid, (a - 1.0) / (a + 1.0), a))
    z = r * r
    p = ((((tl.full([], -8.750608600031904122785E-1, x.dtype) * z - 1.615753718733365076637E1) * z
           - 7.500855792314704667340E1) * z - 1.228866684490136173410E2) * z - 6.485021904942025371773E1)
    q = (((((z + tl.full([], 2.485846490142306297962E1, x.dtype)) * z + 1.650270098316988542046E2) * z
           + 4.328810604912902668951E2) * z + 4.853903996359136964868E2) * z + 1.945506571482613964425E2)
    more_bits = tl.full([], 6.123233995736765886130E-17, x.dtype)
    base = tl.where(big, tl.full([], 1.5707963267948966, x.dtype), tl.where(mid, tl.full([], 0.7853981633974483,
                                                                                       x.dtype), 0.0))
    tail = tl.where(big, more_bits, tl.where(mid, 0.5 * more_bits, 0.0))  # the rest of pi/2, pi/4
    y = base + (r * (z * p / q) + r + tail)
    return tl.where(x < 0, -y, tl.where(x == x, y, x))


@triton.jit
def atan2(y, x):
    # C99 atan2: the first-quadrant angle atan(min/max) (no overflow), reflected by the
    # signs of x and y, with signed zeros and infinities as torch (std::atan2) treats them.
    y, x = tl.broadcast(y, x)
    ax = tl.abs(x)
    ay = tl.abs(y)
    hi = tl.maximum(ax, ay)
    lo = tl.minimum(ax, ay)
    t = tl.where(hi == lo, 1.0, lo / tl.where(hi == 0, 1.0, hi))  # both inf: pi/4
    t = tl.where(hi == 0, 0.0, t)
    half_pi = tl.full([], 1.5707963267948966, x.dtype)
    pi = tl.full([], 3.141592653589793, x.dtype)
    r = atan(t)
    r = tl.where(ay > ax, half_pi - r, r)
    r = tl.where(signbit(x), pi - r, r)
    r = tl.where(signbit(y), -r, r)
    return tl.where((x != x) | (y != y), x + y, r)


@triton.jit
def asin(x):
    return atan2(x, tl.sqrt((1.0 - x) * (1.0 + x)))


@triton.jit
def acos(x):
    return atan2(tl.sqrt((1.0 - x) * (1.0 + x)), x)


# -- error function ----------------------------------------------------------------------------
@triton.jit
def _erfc_f64(a):
    # Cephes ndtr.c erfc (relative error < 6e-14 on [0, 26.6]), in float64.
    x = tl.abs(a)
    z = tl.exp(-a * a)
    p8 = ((((((((tl.full([], 2.46196981473530512524E-10, tl.float64) * x + 5.64189564831068821977E-1) * x
                + 7.46321056442269912687E0) * x + 4.86371970985681366614E1) * x + 1.96520832956077098242E2) * x
             + 5.26445194995477358631E2) * x + 9.34528527171957607540E2) * x + 1.02755188689515710272E3) * x
          + 5.57535335369399327526E2)
    q8 = ((((((((x + tl.full([], 1.32281951154744992508E1, tl.float64)) * x + 8.67072140885989742329E1) * x
                + 3.54937778887819891062E2) * x + 9.75708501743205489753E2) * x + 1.82390916687909736289E3) * x
             + 2.24633760818710981792E3) * x + 1.65666309194161350182E3) * x + 5.57535340817727675546E2)
    p5 = (((((tl.full([], 5.64189583547755073984E-1, tl.float64) * x + 1.27536670759978104416E0) * x
             + 5.01905042251180477414E0) * x + 6.16021097993053585195E0) * x + 7.40974269950448939160E0) * x
          + 2.97886665372100240670E0)
    q6 = ((((((x + tl.full([], 2.26052863220117276590E0, tl.float64)) * x + 9.39603524938001434673E0) * x
              + 1.20489539808096656605E1) * x + 1.70814450747565897222E1) * x + 9.60896809063285878198E0) * x
          + 3.36907645100081516050E0)
    y = tl.where(x < 8.0, z * p8 / q8, z * p5 / q6)
    y = tl.where(x > 27.0, 0.0, y)  # exp(-x*x) underflows (and p/q would be inf/inf)
    y = tl.where(a < 0, 2.0 - y, y)
    y = tl.where(x < 1.0, 1.0 - tl.erf(a), y)
    return tl.where(a != a, a, y)


@triton.jit
def erfc(x):
    """Computed in float64 (also for float32 inputs): 1 - erf(x) cancels for x > 1 and
    the float32 product x*x alone would lose 1e-5 of exp(-x*x) near x = 10."""
    return _erfc_f64(x.to(tl.float64)).to(x.dtype)


# -- powers ------------------------------------------------------------------------------------
@triton.jit
def pow(a, b):
    """std::pow (C99 Annex F special cases), as torch computes float powers. float32 is
    computed in float64: exp2(b * log2|a|) in float32 loses |b log2 a| ulps of the result."""
    a, b = tl.broadcast(a, b)
    if a.dtype == tl.float64:
        wa = a
        wb = b
    else:
        wa = a.to(tl.float64)
        wb = b.to(tl.float64)
    aa = tl.abs(wa)
    mag = tl.exp2(wb * tl.log2(aa))
    b_inf = tl.abs(wb) == float("inf")
    b_int = (tl.floor(wb) == wb) & ~b_inf
    b_odd = b_int & ((wb - 2.0 * tl.floor(wb * 0.5)) != 0)
    r = tl.where(signbit(wa) & b_odd, -mag, mag)  # (-0)^-1 = -inf, (-inf)^3 = -inf
    r = tl.where((wa < 0) & (aa != float("inf")) & ~b_int & ~b_inf, float("nan"), r)
    r = tl.where(b_inf & (aa == 1.0), 1.0, r)  # (-1)^inf = 1 (else 0 * inf = NaN)
    r = tl.where((wb == 0) | (wa == 1.0), 1.0, r)  # x^0 = 1^y = 1, even for NaN
    return r.to(a.dtype)


@triton.jit
def int_pow(a, b):
    """torch's integer power: repeated squaring with wrap-around; negative exponents give
    1 for a base of 1, +-1 for -1 (by parity) and 0 otherwise."""
    a, b = tl.broadcast(a, b)
    e = tl.where(b < 0, tl.zeros_like(b), b)
    result = tl.full(a.shape, 1, a.dtype)
    base = a
    for _ in range(a.dtype.primitive_bitwidth):  # a loop, not unrolled: 64 steps of int64 math spill
        result = tl.where((e & 1) != 0, result * base, result)
        base = base * base
        e = e >> 1
    if a.dtype.is_int_signed():
        odd = (b & 1) != 0
        negative = tl.where(a == 1, tl.full(a.shape, 1, a.dtype), tl.zeros_like(a))
        negative = tl.where(a == -1, tl.where(odd, a, -a), negative)
        result = tl.where(b < 0, negative, result)
    return result.to(a.dtype)


# -- division and remainders -------------------------------------------------------------------
@triton.jit
def div_rn(a, b):
    """IEEE division: Triton's float32 `/` is an approximate division on NVIDIA GPUs, and a
    quotient that should be an exact integer must not come out one ulp short of it."""
    if a.dtype == tl.float32:
        a, b = tl.broadcast(a, b)
        return tl.div_rn(a, b)
    else:
        return a / b


@triton.jit
def truncdiv(a, b):
    return trunc(div_rn(a, b))


@triton.jit
def fmod(a, b):
    return a % b


@triton.jit
def float_rem(a, b):
    # Python's sign rule: the result takes the divisor's sign.
    a, b = tl.broadcast(a, b)
    m = a % b
    return tl.where((m != 0) & ((m < 0) != (b < 0)), m + b, m)


@triton.jit
def float_floordiv(a, b):
    # torch's div_floor_floating: exact quotient from fmod, then floor and round.
    a, b = tl.broadcast(a, b)
    m = a % b
    div = div_rn(a - m, b)
    div = tl.where((m != 0) & ((b < 0) != (m < 0)), div - 1.0, div)
    q = tl.floor(div)
    q = tl.where(div - q > 0.5, q + 1.0, q)
    q = tl.where(div == 0, tl.where(signbit(a) != signbit(b), -0.0, 0.0), q)  # copysign(0, a / b)
    return tl.where(b == 0, a / b, q)


@triton.jit
def nonzero_divisor(b, mask, status_ptr, code, CHECK: tl.constexpr):
    """An integer divisor made safe: with CHECK (kernels run by Triton's interpreter, i.e.
    on CPU tensors, where eager raises ZeroDivisionError), a zero in a lane of `mask` is
    reported as `code` in the status word (the runtime raises after the call) and every
    zero is replaced by 1, so numpy never divides by zero (masked lanes load 0). Without it
    (compiled kernels) the divisor is used as it is: CUDA eager neither checks nor raises."""
    if CHECK:
        zero = (tl.where(mask, 1, 0) * tl.where(b == 0, 1, 0)) != 0  # ints: see the module notes
        tl.store(status_ptr + tl.where(zero, 0, 0), code, mask=zero)
        b = tl.where(b == 0, tl.full([], 1, b.dtype), b)
    return b


@triton.jit
def int_floordiv(a, b):
    a, b = tl.broadcast(a, b)
    q = a // b  # truncates toward zero, as C does
    fix = ((a % b) != 0) & ((a < 0) != (b < 0))
    return q - fix.to(q.dtype)


@triton.jit
def int_rem(a, b):
    a, b = tl.broadcast(a, b)
    m = a % b
    fix = (m != 0) & ((m < 0) != (b < 0))
    return tl.where(fix, m + b, m)


# -- shifts -------------------------------------------------------------------------------------
@triton.jit
def shl(a, b):
    # torch: a shift by a negative amount or by the width or more gives 0 (C leaves it undefined)
    a, b = tl.broadcast(a, b)
    ok = (b >= 0) & (b < a.dtype.primitive_bitwidth)
    return tl.where(ok, a << tl.where(ok, b, tl.zeros_like(b)), tl.zeros_like(a))


@triton.jit
def shr(a, b):
    # torch: out-of-range shifts fill with the sign bit (0 for unsigned types)
    a, b = tl.broadcast(a, b)
    ok = (b >= 0) & (b < a.dtype.primitive_bitwidth)
    if a.dtype.is_int_signed():
        return a >> tl.where(ok, b, tl.full(b.shape, a.dtype.primitive_bitwidth - 1, b.dtype))
    else:
        return tl.where(ok, a >> tl.where(ok, b, tl.zeros_like(b)), tl.zeros_like(a))


# -- NaN-propagating extrema -----------------------------------------------------------------------
@triton.jit
def float_max(a, b):
    a, b = tl.broadcast(a, b)
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def float_min(a, b):
    a, b = tl.broadcast(a, b)
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def mul_combine(a, b):
    """The combine function of a product reduction (tl.reduce)."""
    return a * b


# -- combine functions of scans (tl.associative_scan) and their carries (tl.reduce) ---------------
@triton.jit
def max_combine(a, b):
    return float_max(a, b)


@triton.jit
def min_combine(a, b):
    return float_min(a, b)


@triton.jit
def int_max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def int_min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def logaddexp_combine(a, b):
    """log(exp(a) + exp(b)) without overflow; -inf is the identity, inf + inf is inf."""
    hi = float_max(a, b)
    lo = float_min(a, b)
    both = hi + 0.6931471805599453
    return tl.where(lo == -float("inf"), hi, tl.where(lo == hi, both, hi + log1p(tl.exp(lo - hi))))


@triton.jit
def cummax_combine(v1, i1, v2, i2):
    """(value, index) of a running max, (v2, i2) the later: NaN wins, ties go to the later
    index, as torch.cummax."""
    take = (v2 != v2) | ((v1 == v1) & (v2 >= v1))
    return tl.where(take, v2, v1), tl.where(take, i2, i1)


@triton.jit
def cummin_combine(v1, i1, v2, i2):
    take = (v2 != v2) | ((v1 == v1) & (v2 <= v1))
    return tl.where(take, v2, v1), tl.where(take, i2, i1)

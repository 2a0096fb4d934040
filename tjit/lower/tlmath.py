"""Triton helpers for math that `triton.language` lacks or gets subtly different from torch.

Generated kernels import this module as `tm`. Everything is written with core `tl` ops
only, because Triton's interpreter (how kernels run on CPU) has no libdevice; the same
source then compiles for the GPU. Each helper follows torch's definition for edge cases.
"""
import triton
import triton.language as tl


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def round_half_even(x):
    f = tl.floor(x)
    d = x - f  # exact for floats
    f_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0
    up = (d > 0.5) | ((d == 0.5) & f_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, x)).to(x.dtype)


@triton.jit
def int_sign(x):
    return ((x > 0).to(x.dtype) - (x < 0).to(x.dtype)).to(x.dtype)


@triton.jit
def isinf(x):
    return (x == x) & ((x - x) != (x - x))


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
    return tl.where(x < 0, -s, s)


@triton.jit
def cosh(x):
    e = tl.exp(tl.abs(x))
    return 0.5 * (e + 1.0 / e)


@triton.jit
def tan(x):
    return tl.sin(x) / tl.cos(x)


@triton.jit
def atan(x):
    # Cephes atanf range reduction and polynomial, then one Newton step on
    # sin(y) - x cos(y) = 0, which doubles the correct digits (enough for float64).
    a = tl.abs(x)
    big = a > 2.414213562373095
    mid = a > 0.4142135623730950
    base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    r = tl.where(big, -1.0 / tl.where(big, a, 1.0), tl.where(mid, (a - 1.0) / (a + 1.0), a))
    z = r * r
    y = base + ((((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z
                 - 3.33329491539e-1) * z * r + r)
    s = tl.sin(y)
    c = tl.cos(y)
    y = y - (s - a * c) / (c + a * s)
    y = tl.where(a == float("inf"), 1.5707963267948966, y)
    return tl.where(x < 0, -y, tl.where(x == x, y, x))


@triton.jit
def atan2(y, x):
    safe_x = tl.where(x == 0, 1.0, x)
    a = atan(y / safe_x)
    pi = 3.141592653589793
    a = tl.where(x < 0, tl.where(y < 0, a - pi, a + pi), a)
    on_axis = tl.where(y > 0, 0.5 * pi, tl.where(y < 0, -0.5 * pi, 0.0))
    return tl.where(x == 0, on_axis, a)


@triton.jit
def asin(x):
    return atan2(x, tl.sqrt((1.0 - x) * (1.0 + x)))


@triton.jit
def acos(x):
    return atan2(tl.sqrt((1.0 - x) * (1.0 + x)), x)


@triton.jit
def asinh(x):
    a = tl.abs(x)
    r = log1p(a + a * a / (1.0 + tl.sqrt(1.0 + a * a)))
    big = a > 1e15
    r = tl.where(big, tl.log(tl.where(big, a, 1.0)) + 0.6931471805599453, r)
    return tl.where(x < 0, -r, r)


@triton.jit
def acosh(x):
    t = x - 1.0
    return log1p(t + tl.sqrt(2.0 * t + t * t))


@triton.jit
def atanh(x):
    return 0.5 * log1p(2.0 * x / (1.0 - x))


@triton.jit
def pow(a, b):
    # exp2(b * log2|a|) with torch's rules for negative bases, zeros and integer exponents.
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    b_int = tl.floor(b) == b
    b_odd = b_int & ((b - 2.0 * tl.floor(b * 0.5)) != 0)
    r = tl.where((a < 0) & b_odd, -mag, mag)
    r = tl.where((a < 0) & (~b_int), float("nan"), r)
    r = tl.where(b == 0, 1.0, r)
    return tl.where(a == 1.0, 1.0, r)


@triton.jit
def fmod(a, b):
    return a % b


@triton.jit
def float_rem(a, b):
    # Python's sign rule: the result takes the divisor's sign.
    m = a % b
    return tl.where((m != 0) & ((m < 0) != (b < 0)), m + b, m)


@triton.jit
def float_floordiv(a, b):
    # torch's div_floor_floating: exact quotient from fmod, then floor and round.
    m = a % b
    div = (a - m) / b
    div = tl.where((m != 0) & ((b < 0) != (m < 0)), div - 1.0, div)
    q = tl.floor(div)
    q = tl.where(div - q > 0.5, q + 1.0, q)
    q = tl.where(div == 0, 0.0 * (a / b), q)
    return tl.where(b == 0, a / b, q)


@triton.jit
def int_floordiv(a, b):
    q = a // b  # truncates toward zero, as C does
    fix = ((a % b) != 0) & ((a < 0) != (b < 0))
    return q - fix.to(q.dtype)


@triton.jit
def int_rem(a, b):
    m = a % b
    fix = (m != 0) & ((m < 0) != (b < 0))
    return tl.where(fix, m + b, m)


@triton.jit
def float_max(a, b):
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def float_min(a, b):
    return tl.where((a < b) | (a != a), a, b)

"""aten shape ops that are index arithmetic: arange, cat, constant_pad_nd, repeat.

None of them reads memory of its own: arange is a coordinate (an Iota leaf), cat and
constant_pad_nd read their operands at shifted coordinates (ValueBuilder.window and
.shifted, masked loads in the kernel), repeat reads its operand at each coordinate modulo
its size. So each fuses into the kernel that reads its result (torch.cat([a * 2, b + 1])
.sum(1) is one kernel). stack, roll, tril/triu reach tjit decomposed into these (and
where, index_select) by torch's decompositions.
"""
from __future__ import annotations

import math

import torch

from ..ir import DType, GraphNode, View
from .aten_ops import operand, out_dtype, out_shape, register, representable

aten = torch.ops.aten

# eager's CPU arange (RangeFactoriesKernel.cpp): chunks of GRAIN elements per thread, each
# filled by 256-bit vectors (start + step * i0 for the vector's first index i0, then + k *
# step per lane) and scalars for the chunk's tail, all as fused multiply-adds
ARANGE_GRAIN = 32768
VECTOR_BYTES = 32


@register(aten.arange)
def _arange(cv, node, *args, **kwargs):
    start, step = 0, 1
    if node.target._overloadname == "start_step":
        start, _, step = (list(args) + [1])[:3]
    elif node.target._overloadname == "start":
        start = args[0]
    dtype, (n,) = out_dtype(node), out_shape(node)
    if not dtype.is_float:
        return cv.iota(View((n,), (int(step),), int(start)), DType.int64)
    device = node.meta["val"].device.type
    return _float_arange(cv, n, float(start), float(step), dtype, device)


def _float_arange(cv, n: int, start: float, step: float, dtype: DType, device: str) -> GraphNode:
    """The values eager computes: on CUDA, start + i * step in the type's accumulate type
    (float32 for 16-bit floats) as one fma; on CPU, as its vectorised loop does."""
    acc = DType.float32 if dtype.itemsize <= 4 and (device != "cpu" or dtype.is_low_precision) else DType.float64
    idx = cv.iota(View((n,), (1,)), DType.int64)

    def num(v, t=DType.int64):
        return cv.expand_to(cv.const(representable(v, t), t), (n,))

    def ew(op, *xs, t=DType.int64):
        return cv.elementwise(op, list(xs), t)

    def fma(a, b, c):
        return ew("fma", a, b, c, t=acc)

    def as_acc(x):
        return cv.cast(x, acc)

    s, st = num(start, acc), num(step, acc)
    if device != "cpu":
        return cv.cast(fma(as_acc(idx), st, s), dtype)
    width = VECTOR_BYTES // dtype.itemsize
    threads = max(1, min(torch.get_num_threads(), -(-n // ARANGE_GRAIN)))
    chunk = max(1, -(-n // threads))
    begin = ew("mul", ew("floordiv", idx, num(chunk)), num(chunk)) if threads > 1 else num(0)
    local = ew("add", idx, ew("neg", begin))
    length = ew("min", ew("add", num(n), ew("neg", begin)), num(chunk))
    full = ew("mul", ew("floordiv", length, num(2 * width)), num(2 * width))
    first = ew("add", begin, ew("mul", ew("floordiv", local, num(width)), num(width)))  # the vector's first index
    base = cv.cast(cv.cast(fma(st, as_acc(first), s), dtype), acc)
    lane = fma(as_acc(ew("add", idx, ew("neg", first))), st, base)
    scalar = fma(st, as_acc(idx), s)
    vector = ew("lt", local, full, t=DType.bool)
    return cv.cast(ew("where", vector, lane, scalar, t=acc), dtype)


# Each lane of a cat's kernel selects one operand, but the kernel's code computes every
# operand's fused expression (masked): past this many loads in all, an operand that reads
# more than one leaf is read from a buffer of its own (shared with any other reader's).
MAX_CAT_LOADS = 64


@register(aten.cat)
def _cat(cv, node, tensors, dim=0):
    """A where-chain over the coordinate along dim, each operand read shifted to its place
    (a select, not a sum of zero-filled windows: -0.0 and NaN stay as they are)."""
    shape, dtype = out_shape(node), out_dtype(node)
    parts = [cv.cast(t, dtype) for t in tensors if math.prod(t.shape) > 0]  # (0,)-shaped legacy operands too
    if not parts or math.prod(shape) == 0:
        return operand(cv, 0, dtype, shape)
    dim %= len(shape)
    if len(parts) == 1:
        return parts[0]
    loads = [cv.loads(p) for p in parts]
    if sum(loads) > MAX_CAT_LOADS:  # (an unrolled RNN's stacked hidden states, each read from its buffer)
        parts = [cv.materialize(p) if n > 1 else p for p, n in zip(parts, loads)]
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + p.shape[dim])

    def placed(k):
        return cv.shifted(parts[k], tuple(starts[k] if d == dim else 0 for d in range(len(shape))), shape)

    value = placed(len(parts) - 1)
    for k in reversed(range(len(parts) - 1)):
        value = cv.elementwise("where", [cv.before(shape, dim, starts[k + 1]), placed(k), value], dtype)
    return value


@register(aten.constant_pad_nd)
def _constant_pad_nd(cv, node, x, pad, value=0):
    shape, dtype = out_shape(node), out_dtype(node)
    low = [0] * len(shape)
    for k in range(len(pad) // 2):
        low[len(shape) - 1 - k] = pad[2 * k]
    return cv.window(x, tuple(low), shape, representable(value, dtype))


@register(aten.repeat)
def _repeat(cv, node, x, repeats):
    """out[i] = x[i mod x's size], axis by axis: one read at computed coordinates, which are
    in range by construction (no check)."""
    shape = out_shape(node)
    if not shape:  # a 0-d tensor repeated zero times along no axis
        return x
    lead = len(shape) - len(x.shape)
    for _ in range(lead):
        x = cv.view(x, ("unsqueeze", 0))
    if math.prod(shape) == 0:
        return operand(cv, 0, x.dtype, shape)
    coords = []
    for d, n in enumerate(x.shape):
        c = cv.cast(cv.coordinate(shape, d), DType.int64)
        coords.append(c if n == shape[d] else cv.elementwise("rem", [c, operand(cv, n, DType.int64, shape)],
                                                             DType.int64))
    return cv.read_at(x, coords, checked=False, what="repeat")

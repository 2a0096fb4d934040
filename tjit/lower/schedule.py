"""Choose the iteration space of a kernel and map each of its axes to an AxisStrategy.

The kernel's logical shape is first simplified: size-1 axes are dropped (their index is
always 0) and, under Auto, adjacent axes that every access walks as one (stride[d] ==
stride[d+1] * size[d+1]) are merged. Then each axis, or a run of axes flattened into
one, becomes a LoopDim realised as DESIGN.md's table says.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import TjitError
from ..ir import Auto, AxisStrategy, Sequential, Thread, ThreadGroup

AUTO_WARPS = 8  # warps of an Auto pointwise program
AUTO_BLOCK = 1024  # its lanes with float32 values and few accesses: 4 per thread, one 128-bit load
TILE = 32  # the side of an Auto 2-d tile (a transposed access)
MAX_BLOCK_NUMEL = 1 << 20  # Triton's limit on the elements of one block


@dataclass(frozen=True)
class LoopDim:
    axes: tuple[int, ...]  # iteration axes covered, outermost first (flattened when several)
    kind: str  # "group" (grid axis) | "thread" (whole axis in the block) | "loop" (for loop)
    width: int  # block width of this dim: lanes per program (group/loop) or next pow2 (thread)
    simd: Optional[int] = None
    reason: str = ""
    reduce: bool = False  # the axes are reduced
    programs: int = 0  # kind "split": programs sharing the axis, each looping over its chunk

    def describe(self) -> str:
        name = {"group": "ThreadGroup", "thread": "Thread", "loop": "Sequential", "split": "ThreadGroup"}[self.kind]
        simd = f", simd={self.simd}" if self.simd else ""
        what = "reduced axes" if self.reduce else "axes"
        return f"{what} {list(self.axes)} -> {name}(width={self.width}{simd}){': ' + self.reason if self.reason else ''}"


@dataclass(frozen=True)
class IterationSpace:
    sizes: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]  # per access, per axis
    loop_dims: tuple[LoopDim, ...]


def simplify(shape: Sequence[int], access_strides: Sequence[Sequence[int]], merge: bool,
             reduced: Sequence[int] = ()):
    """Drop size-1 axes and (when `merge`) merge axes every access walks contiguously (a
    reduced axis only with another reduced axis). Returns (sizes, strides per access,
    original axes of each kept axis)."""
    keep = [d for d, s in enumerate(shape) if s != 1]
    sizes = [shape[d] for d in keep]
    strides = [[st[d] for d in keep] for st in access_strides]
    origin = [[d] for d in keep]
    if merge:
        d = len(sizes) - 2
        while d >= 0:
            same_kind = (origin[d][0] in reduced) == (origin[d + 1][0] in reduced)
            if same_kind and all(st[d] == st[d + 1] * sizes[d + 1] for st in strides):
                sizes[d:d + 2] = [sizes[d] * sizes[d + 1]]
                for st in strides:
                    st[d:d + 2] = [st[d + 1]]
                origin[d:d + 2] = [origin[d] + origin[d + 1]]
            d -= 1
    return tuple(sizes), tuple(tuple(st) for st in strides), origin


def memory_order(strides: Sequence[int]) -> list[int]:
    """Axes from the largest stride to the smallest: walking the iteration space in this
    order walks that access's memory in order (stable, so row-major stays as it is)."""
    return sorted(range(len(strides)), key=lambda d: -abs(strides[d]))


def schedule(shape: Sequence[int], access_strides: Sequence[Sequence[int]],
             forced: Optional[Sequence[AxisStrategy]] = None, primary: int = -1,
             widest_itemsize: int = 4, reduced: Sequence[int] = (), reduced_primary: int = -1,
             splittable: bool = False, coordinates: int = 0) -> IterationSpace:
    """`primary` is the access whose memory order Auto follows (the first store);
    `widest_itemsize` the widest element the kernel computes with (sizes Auto's block).
    `reduced` are the axes the kernel reduces (they come last, innermost, in the order the
    access `reduced_primary`, the reduction's main input, walks memory). `splittable`: the
    kernel may split a reduced axis across programs (a full reduction whose results the last
    program can finish). The last `coordinates` entries of `access_strides` are index values
    the kernel computes (no memory): they keep axes from merging, but choose no tile."""
    if forced is not None and len(forced) != len(shape):
        raise TjitError(f"axis strategies {list(forced)} do not match the kernel's {len(shape)}-d shape {list(shape)}")
    if reduced:
        return _schedule_reduction(shape, access_strides, forced, primary, widest_itemsize, reduced,
                                   reduced_primary, splittable)
    if not _is_forced(forced):
        order = memory_order(access_strides[primary]) if access_strides else list(range(len(shape)))
        shape = [shape[d] for d in order]
        access_strides = [[st[d] for d in order] for st in access_strides]
        sizes, strides, _ = simplify(shape, access_strides, merge=True)
        block = 32 * AUTO_WARPS * lanes_per_thread(widest_itemsize, len(access_strides))
        return IterationSpace(sizes, strides, auto_dims(sizes, strides[:len(strides) - coordinates], block))
    sizes, strides, origin = simplify(shape, access_strides, merge=False)
    dims = tuple(_forced_dim(k, forced[origin[k][0]], sizes[k]) for k in range(len(sizes)))
    _check_block(dims, forced, shape)
    return IterationSpace(sizes, strides, dims)


def lanes_per_thread(widest_itemsize: int, accesses: int) -> int:
    """Elements each thread computes: one 128-bit vector of the widest type (4 float32, 2
    float64), fewer in a kernel that reads and writes many tensors, whose long fused chains
    keep many values live: at 4 lanes per thread, chains of 22 and of 34 accesses (an
    unrolled GRU's backward) spilled at sm_90; at 2 and at 1 lane they used 60 and 48
    registers."""
    lanes = max(1, min(4, 16 // widest_itemsize))
    for many in (16, 32):
        if accesses > many:
            lanes = max(1, lanes // 2)
    return lanes


def _is_forced(forced) -> bool:
    """Some axis strategy other than Auto was asked for."""
    return forced is not None and not all(isinstance(s, Auto) for s in forced)


def auto_dims(sizes: Sequence[int], strides: Sequence[Sequence[int]], block: int = AUTO_BLOCK) -> tuple[LoopDim, ...]:
    """One flat group of AUTO_BLOCK lanes, unless an access is contiguous along another axis
    than the output: then a TILE x TILE tile over those two axes, so both sides load and
    store whole contiguous runs (Triton moves the tile through shared memory)."""
    if not sizes:
        return ()
    inner = len(sizes) - 1
    crossing = _crossing_axis(sizes, strides, inner)
    if crossing is None:
        return (LoopDim(tuple(range(len(sizes))), "group", block,
                        reason="Auto: pointwise, all axes flattened over programs"),)
    rest = tuple(a for a in range(len(sizes)) if a not in (crossing, inner))
    dims = [LoopDim(rest, "group", 1, reason="Auto: outer axes, one index per program")] if rest else []
    dims.append(LoopDim((crossing,), "group", TILE, reason="Auto: tile, an input is contiguous along this axis"))
    dims.append(LoopDim((inner,), "group", TILE, reason="Auto: tile, the output is contiguous along this axis"))
    return tuple(dims)


def _crossing_axis(sizes, strides, inner: int) -> Optional[int]:
    """An axis other than `inner` along which some access has unit stride, when both that
    axis and `inner` are long enough for a tile to pay off."""
    if sizes[inner] < TILE // 2:
        return None
    for access in strides:
        for axis, stride in enumerate(access):
            if axis != inner and abs(stride) == 1 and sizes[axis] >= TILE // 2:
                return axis
    return None


def _forced_dim(axis: int, strategy: AxisStrategy, size: int) -> LoopDim:
    simd = strategy.simd
    if isinstance(strategy, Thread):
        return LoopDim((axis,), "thread", max(1 << (size - 1).bit_length(), simd or 1), simd, "forced")
    if isinstance(strategy, Sequential):
        return LoopDim((axis,), "loop", simd or 1, simd, "forced")
    # ThreadGroup, and Auto next to forced axes: split across programs
    return LoopDim((axis,), "group", simd or 1, simd, "forced" if isinstance(strategy, ThreadGroup) else "Auto")


# -- reduction kernels ------------------------------------------------------------------------
PERSISTENT_LIMIT = 4096  # a reduced extent up to this is held whole in registers (4-byte values)
REDUCTION_BLOCK = 2048  # elements of one program's block in a reduction kernel (4-byte values)
LOOP_CHUNK = 1024  # elements per step of a looped reduction over a contiguous axis


def _schedule_reduction(shape, access_strides, forced, primary, widest, reduced, reduced_primary, splittable):
    kept = [d for d in range(len(shape)) if d not in reduced]
    kept_order = sorted(kept, key=lambda d: -abs(access_strides[primary][d])) if access_strides else kept
    red_order = sorted(reduced, key=lambda d: -abs(access_strides[reduced_primary][d]))
    order = kept + list(reduced) if _is_forced(forced) else kept_order + red_order
    shape = [shape[d] for d in order]
    access_strides = [[st[d] for d in order] for st in access_strides]
    is_reduced = [k for k, d in enumerate(order) if d in reduced]
    if _is_forced(forced):
        forced = [forced[d] for d in order]
        sizes, strides, origin = simplify(shape, access_strides, merge=False)
        dims = tuple(_forced_reduction_dim(k, forced[origin[k][0]], sizes[k], origin[k][0] in is_reduced)
                     for k in range(len(sizes)))
        _check_block(dims, forced, shape)
        if any(d.kind == "split" for d in dims) and (not splittable or len(dims) != 1):
            raise TjitError("ThreadGroup on a reduced axis (a split reduction) needs a reduction over every axis "
                            "of one contiguous run whose results are plain sums/products/max/min; "
                            f"got strategies {list(forced)} for shape {list(shape)}")
        return IterationSpace(sizes, strides, dims)
    sizes, strides, origin = simplify(shape, access_strides, merge=True, reduced=is_reduced)
    if splittable and len(sizes) == 1 and sizes[0] >= SPLIT_MIN:
        return IterationSpace(sizes, strides, (_split_dim(0, sizes[0], LOOP_CHUNK // (2 if widest >= 8 else 1),
                                                          "Auto: a large full reduction, split across programs"),))
    return IterationSpace(sizes, strides, _auto_reduction_dims(sizes, strides, origin, is_reduced, widest,
                                                               reduced_primary, len(access_strides)))


SPLIT_MIN = 1 << 16  # a full reduction this long is split across programs
SPLIT_PROGRAMS = 1024  # at most this many programs share a split reduction


def _split_dim(axis: int, size: int, width: int, reason: str) -> LoopDim:
    return LoopDim((axis,), "split", width, None, reason, True, max(1, min(SPLIT_PROGRAMS, -(-size // width))))


def _auto_reduction_dims(sizes, strides, origin, is_reduced, widest, reduced_primary,
                         accesses: int = 0) -> tuple[LoopDim, ...]:
    """Rows over programs, the reduced axes in registers (persistent) when they fit, else
    walked by a loop. When the reduction's input is contiguous along a kept axis (a column
    reduction), a program takes many rows and few reduced elements per step. A kernel with
    many accesses (a backward's) takes fewer rows per program, as a pointwise one takes fewer
    lanes per thread: at 2048 elements per program, training steps' backward kernels of 17
    to 40 accesses spilled up to 57 KB at sm_90."""
    scale = 2 if widest >= 8 else 1
    pressure = 4 // lanes_per_thread(4, accesses)
    red = [k for k in range(len(sizes)) if origin[k][0] in is_reduced]
    kept = [k for k in range(len(sizes)) if k not in red]
    red_numel = math.prod(sizes[k] for k in red)
    kept_numel = math.prod(sizes[k] for k in kept)
    across_rows = any(strides[reduced_primary][k] in (1, -1) for k in kept)
    red_block = math.prod(_pow2(sizes[k]) for k in red)
    persistent = red_block <= PERSISTENT_LIMIT // scale
    dims = []
    if kept:
        if across_rows:
            rows = min(_pow2(kept_numel), 128 // scale)
            if persistent and rows * red_block > PERSISTENT_LIMIT // scale:
                # whole columns for many rows would not fit in registers (spills): fewer rows
                # while each still loads 128 contiguous bytes, else a looped reduction
                fitting = PERSISTENT_LIMIT // scale // red_block
                rows, persistent = (fitting, True) if fitting >= 32 // scale else (rows, False)
        elif persistent:
            rows = max(1, min(_pow2(kept_numel), REDUCTION_BLOCK // scale // pressure // _pow2(red_numel)))
        else:
            rows = 1
        dims.append(LoopDim(tuple(kept), "group", rows, reason="Auto: rows over programs"))
    for n, k in enumerate(red):
        if persistent:
            dims.append(LoopDim((k,), "thread", _pow2(sizes[k]), reduce=True,
                                reason="Auto: persistent reduction, the whole extent in registers"))
        else:
            inner = n == len(red) - 1
            chunk = (REDUCTION_BLOCK // scale // dims[0].width if across_rows and kept else LOOP_CHUNK // scale)
            width = min(_pow2(sizes[k]), chunk) if inner else 1
            dims.append(LoopDim((k,), "loop", width, reduce=True,
                                reason=f"Auto: looped reduction, {width} elements per step"))
    return tuple(dims)


def _forced_reduction_dim(axis: int, strategy: AxisStrategy, size: int, reduce: bool) -> LoopDim:
    if isinstance(strategy, Sequential) and not reduce:
        raise TjitError("Sequential on a kept axis of a reduction kernel is not supported; "
                        "use ThreadGroup or Thread")
    if isinstance(strategy, ThreadGroup) and reduce:
        return _split_dim(axis, size, strategy.simd or LOOP_CHUNK, "forced: a split reduction")
    if isinstance(strategy, Auto) and reduce:
        strategy = Thread() if _pow2(size) <= PERSISTENT_LIMIT else Sequential()
    if isinstance(strategy, Sequential) and strategy.simd is None:
        return LoopDim((axis,), "loop", min(_pow2(size), LOOP_CHUNK), None, "forced", reduce)
    dim = _forced_dim(axis, strategy, size)
    return LoopDim(dim.axes, dim.kind, dim.width, dim.simd, dim.reason, reduce)


def _check_block(dims, forced, shape) -> None:
    block = math.prod(d.width for d in dims)
    if block > MAX_BLOCK_NUMEL:
        raise TjitError(f"axis strategies {list(forced)} on shape {list(shape)} need a block of {block} elements; "
                        f"Triton allows {MAX_BLOCK_NUMEL}")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# -- matrix-product kernels ---------------------------------------------------------------------
@dataclass(frozen=True)
class DotTiles:
    """The tile of a kernel that computes matrix products: rows x columns of the result per
    program, the contraction's step, and the launch's warps and software-pipeline stages."""
    rows: int
    columns: int
    step: int
    warps: int
    stages: int

    def describe(self) -> str:
        return f"tl.dot tiles {self.rows}x{self.columns}, k step {self.step}, {self.warps} warps, {self.stages} stages"


def dot_tiles(m: int, n: int, k: int, itemsize: int, products: float = 1, accesses: int = 3,
              tensor_cores: Optional[bool] = None) -> DotTiles:
    """Per size class and register pressure: each side a power of two from 16 (tl.dot's
    least), the contraction stepping 64 (16-bit operands) or 32 (float32) at a time, operand
    tiles pipelined 3 stages deep, 8 warps from 2048 tile elements on (FMA products: 4).
    `tensor_cores`: whether tl.dot runs on the tensor cores (16-bit operands, or float32 as
    tf32; by default 16-bit only) or computes exact float32 by FMA, as eager's float32 matmul
    does at torch's default precision.

    One product alone takes up to 128x64 on the tensor cores, 32x32 by FMA; a kernel of
    several products (an LSTM's gates) or of many loads and stores in its epilogue takes
    each product's share of that, so its tile shrinks, the larger side first (an operand
    computed on its tiles, a prologue, counts half a product). These were the largest that
    compiled for sm_90 without spills over the tests' kernels: 128x128 with a gelu epilogue
    spilled (16-bit; with 4 warps, or 8 in float16), FMA products at 64x64 with 4 or 8 warps
    and at 32x64 with 8. Measured on an H100 (bench/gpu.py, 4096-row products, 2026-11-27):
    128x64 ran bfloat16 gelu(linear) at 399 TFLOP/s (cuBLAS and the epilogue: 650; 128x256,
    which spills, 544); tf32 products at 128x64 208 TFLOP/s against 69 at 32x32; FMA
    products run ~12x slower than cuBLAS at any tile (the rule gives them to the library on
    a GPU)."""
    wide = itemsize <= 2 if tensor_cores is None else tensor_cores
    pressure = products + max(0, accesses - 3) / 8  # (a bias, a residual and the output come free)
    budget = max(256, int((128 * 64 if wide else 32 * 32) / pressure))  # accumulator elements per program
    rows, columns = min(128 if wide else 32, max(16, _pow2(m))), min(64 if wide else 32, max(16, _pow2(n)))
    while rows * columns > budget and max(rows, columns) > 16:
        if rows >= columns:
            rows //= 2
        else:
            columns //= 2
    step = min(64 if itemsize <= 2 else 32, max(16, _pow2(k)))
    return DotTiles(rows, columns, step, 8 if wide and rows * columns >= 32 * 64 else 4, 3)


WHOLE_ROWS = 128  # the longest reduced row of a product held in one tile (a power of two)


def dot_row_tiles(m: int, n: int, k: int, itemsize: int, products: float = 1, accesses: int = 3,
                  tensor_cores: Optional[bool] = None, tile_loads: int = 0) -> DotTiles:
    """The tiles of a kernel that reduces its products' rows: a row that fits the tile's
    accumulator budget with 16 rows (up to WHOLE_ROWS columns) is one tile (each product
    computed once, the reductions over registers); a longer one is walked in column tiles
    (each pass of the reduction computes its tiles again: softmax's two, cross-entropy's
    one), half as many rows per program, and on the tensor cores twice as many columns
    (128x64 -> 64x128: cross_entropy(linear) over 32000 columns in bfloat16 ran 1.5x as
    fast on an H100 as at 64x64, bench/gpu.py), unless the epilogue loads tiles of its own
    (`tile_loads`: attention's additive mask, whose softmax at 64x128 spilled 1.8 KB at
    sm_90). float32's budget (32x32) holds rows of 64: at 16x128 a softmax spilled at sm_90."""
    tiles = dot_tiles(m, n, k, itemsize, products, accesses, tensor_cores)
    whole, budget = max(16, _pow2(n)), tiles.rows * tiles.columns
    if whole > min(WHOLE_ROWS, budget // 16):  # (half the rows: a float32 softmax at 32x32 spilled)
        wide = itemsize <= 2 if tensor_cores is None else tensor_cores
        columns = min(2 * tiles.columns, WHOLE_ROWS, whole) if wide and tiles.rows > 16 and not tile_loads \
            else tiles.columns
        rows = max(16, tiles.rows // 2)
        # (32x128 stepping 64 with 8 warps: bfloat16 cross_entropy(h @ w.T) over 1200 columns
        # spilled 68 bytes at sm_90 at 128 registers; stepping 32, 123 and none; 64x128 did not)
        step = min(32, tiles.step) if wide and rows == 32 and columns == 2 * tiles.columns else tiles.step
        return dataclasses.replace(tiles, rows=rows, columns=columns, step=step)
    return dataclasses.replace(tiles, rows=max(16, min(tiles.rows, budget // whole)), columns=whole)


ACCUMULATED_COLUMNS = 64  # the chunk of columns a product accumulated in memory adds per step


def dot_step(tiles: DotTiles, k: int) -> int:
    """One product's contraction step in a kernel of `tiles`: the tiles' step, or a shorter
    k's own (at least 16, tl.dot's least): a nested product's k (attention's head dimension)
    is not the outer one's."""
    return min(tiles.step, max(16, _pow2(k)))


def nested_dot_tiles(tiles: DotTiles, m: int, n: int, tensor_cores: bool, nested: int,
                     extra_loads: int = 0) -> DotTiles:
    """The tiles of a kernel whose product's a computes products on its tiles (attention's
    probabilities from its scores): all n columns in one tile (at most NESTED_COLUMNS, the
    frontend's rule), so each nested product is computed once per row tile.

    On the tensor cores, 64 rows stepping 32 along k, 4 warps, 3 stages: measured on an H100
    (attention in bfloat16, [8, 16, 1024, 64], 2026-11-27) 0.326 ms, against 0.616 ms at the
    32x64 stepping 64 with 8 warps and 3 stages that the budget below gave (eager 0.647;
    cuDNN's flash kernel, Inductor's, 0.086). Faster ones spilled at sm_90 with a head
    dimension of 40 (masked): 64x64 stepping 64 with 4 warps (0.328 ms; 976 bytes), 64x64
    stepping 128 with 4 warps (0.277 ms; 2888 bytes). Over 64 columns, with two nested
    products, or with `extra_loads` (tiles a prologue loads beside the products' operands:
    an additive mask spilled 60 bytes), 8 warps (for the registers; compiled, not timed).

    By FMA (exact float32 in the interpreter and on GPUs without tf32): the columns the
    accumulator budget takes with 16 rows (else each nested product is computed once per
    column tile), and the rows it leaves. With two `nested` products the step is 16: at
    16x16 stepping 32 they spilled 48 bytes at sm_90 (255 registers; 96 at 16). One steps
    32 (attention at 16x64: 152 registers; stepping 16 made the interpreter's attention 4x
    slower)."""
    if tensor_cores:
        columns = max(16, _pow2(n))
        narrow = columns <= 64 and nested < 2 and extra_loads <= 0
        return DotTiles(rows=min(64, max(16, _pow2(m))), columns=columns, step=32, warps=4 if narrow else 8, stages=3)
    budget = tiles.rows * tiles.columns
    columns = min(max(16, _pow2(n)), max(64, budget // 16))
    return dataclasses.replace(tiles, rows=max(16, min(tiles.rows, budget // columns)), columns=columns,
                               step=tiles.step if nested < 2 else 16)


def dot_schedule(shape: Sequence[int], access_strides: Sequence[Sequence[int]], tiles: DotTiles,
                 reduces_rows: bool = False, accumulates: bool = False) -> IterationSpace:
    """The last two axes (the product's rows and columns, never of size 1) tiled over
    programs, or with reduces_rows, the rows tiled over programs and the columns reduced:
    in one tile (a whole row) or walked by a loop; each other axis (a batch axis) one index
    per program. `accumulates`: the columns walked in chunks inside each step of k, the
    product accumulated in memory (frontend/dot.py's accumulates_in_memory)."""
    sizes, strides, _ = simplify(shape, access_strides, merge=False)
    dims = [LoopDim((k,), "group", 1, reason="Dot: a batch index per program") for k in range(len(sizes) - 2)]
    dims.append(LoopDim((len(sizes) - 2,), "group", tiles.rows, reason="Dot: the result's rows, tiled"))
    columns = (len(sizes) - 1,)
    if accumulates:
        dims.append(LoopDim(columns, "loop", tiles.columns, reason="Dot: the result's columns, walked in chunks "
                            "inside each step of k, accumulated in memory"))
    elif not reduces_rows:
        dims.append(LoopDim(columns, "group", tiles.columns, reason="Dot: the result's columns, tiled"))
    elif tiles.columns >= sizes[-1]:
        dims.append(LoopDim(columns, "thread", tiles.columns, reduce=True,
                            reason="Dot: the reduced columns, a whole row in one tile"))
    else:
        dims.append(LoopDim(columns, "loop", tiles.columns, reduce=True,
                            reason=f"Dot: the reduced columns, walked {tiles.columns} at a time"))
    return IterationSpace(sizes, strides, tuple(dims))

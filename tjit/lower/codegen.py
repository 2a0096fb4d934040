"""Emit one readable @triton.jit kernel for a KernelGroup.

Sizes, strides and offsets are kernel arguments, not literals, so the same source serves
every size with the same layout class (unit strides and zero strides are structural and
spelled out, which is also what lets Triton prove contiguity and vectorise). Kernel names
are a hash of the source, so identical kernels share one compiled binary.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..ir import (AxisStrategy, Const, Cumulative, Dot, DType, Elementwise, Extern, Gather, GraphNode, Input, Iota, Reduce, View,
                  ViewOp, Window, toposort)
from ..errors import IndexOutOfBoundsError, UnsupportedOpError
from ..ir.ops import op_def
from ..frontend.dot import accumulates_in_memory
from .domains import at_product, dots_in, is_value_ref, kernel_expression, kernel_expressions, leaf_view
from .elementwise import _cast, literal, render, tl_dtype
from .fusion import (BufferTarget, InputTarget, KernelGroup, OutputTarget, PutAt, ScatterTarget, buffer_of,
                     expression_leaves, is_kernel_input)
from .grid_reduction import GridReductionEmitter
from .online_product import OnlineProduct, online_product, row_value
from .reduction import (NEG_INF, LoopContext, OnlineExpSum, accumulator_for, block_reduce, finite, identity,
                        scan_carry_init, scan_identity, scan_lines, scan_work_dtype, work_dtype)
from .schedule import (ACCUMULATED_COLUMNS, AUTO_WARPS, DotTiles, IterationSpace, LoopDim, dot_row_tiles, dot_schedule,
                       dot_step, dot_tiles, lanes_per_thread, nested_dot_tiles, schedule)

INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class BufferRef:
    """A pointer argument: kind is "input" (by name), "output" (by name) or "buffer" (a node)."""
    kind: str
    name: str
    dtype: DType
    node: Optional[GraphNode] = None
    # the kernel's own name for an input or output (in0, out0, ...: its place among the
    # kernel's), so the graph's names stay out of the source: the layers of a model, which
    # differ only in the tensors they read and write, share one kernel source, loaded and
    # compiled once (explain lists which tensor each is)
    label: str = ""

    @property
    def param(self) -> str:
        return (self.label or "".join(c if c.isalnum() else "_" for c in self.name)) + "_ptr"


@dataclass
class Access:
    buffer: BufferRef
    view: View  # over the kernel's logical shape
    store: bool
    gather: Optional[tuple[int, int, int]] = None  # gathered axis (stride, size), elements read
    # the addresses an access loads where its view over the kernel's shape does not say them:
    # fewer (a Window reads its source's elements only) or more (a product's operand, read
    # along k as well): what byte counts count, and what an int64 index must reach
    reads: Optional[View] = None
    # a flat gather's (Gather.flat): the view whose elements' offsets its index holds, the
    # addresses it reaches (the table, a line of the storage, has the gaps of a strided view)
    offsets_of: Optional[View] = None

    @property
    def counted(self) -> View:
        return self.reads or self.view


@dataclass(frozen=True)
class TileAxis:
    """One axis of a product operand's tile: a kernel axis (index i{d}, which the access's
    view over the kernel's shape addresses) or a contraction's steps (`stepped`: an arange
    per step, the operand's stride along it added to each load's address)."""
    index: str  # the index, broadcast at its position among the kernel's axes
    size: str  # its bound
    width: str  # the tile's extent along it
    stepped: bool = False

    @property
    def mask(self) -> str:
        return f"({self.index} < {self.size})"


STATUS = BufferRef("status", "status", DType.int32)  # where kernels report a failed check (1 + its number)
COUNTER = BufferRef("counter", "counter", DType.int32)  # programs done, for a grid reduction (0 between calls)
# a kernel's constexpr: integer divisors are checked for zero (tm.nonzero_divisor); the runtime
# sets it when the kernel runs in Triton's interpreter (CPU tensors), as CPU eager raises there
ZERO_DIV_FLAG = "CHECK_ZERO_DIV"


@dataclass(frozen=True)
class Check:
    """A check a kernel reports through STATUS; the runtime raises error(message) after the call."""
    error: type
    message: str
    interpreted_only: bool = False  # made only when the kernel runs in the interpreter (ZERO_DIV_FLAG)


@dataclass
class KernelPlan:
    name: str
    source: str
    buffers: list[BufferRef]
    scalar_args: list[int]  # sizes, then per-access offsets and strides, in parameter order
    constexprs: dict[str, int]
    grid: tuple[int]
    shape: tuple[int, ...]
    space: IterationSpace
    accesses: list[Access]
    param_names: list[str] = field(default_factory=list)
    num_warps: int = 4
    load_passes: dict[int, int] = field(default_factory=dict)  # access -> times a looped kernel reads it
    checks: list[Check] = field(default_factory=list)  # the checks reported through STATUS
    # scratch buffers of a grid reduction: one element per program (the grid's size)
    scratch: list[BufferRef] = field(default_factory=list)
    reduced_axes: tuple[int, ...] = ()  # of `shape`: reduced or scanned
    # the last accesses, made by the last program to finish once every program has made the
    # others (a horizontal kernel's one-program members: lower/horizontal.py)
    last_program_accesses: int = 0
    num_stages: int = 3  # software-pipeline depth of the kernel's loops (Triton's default)
    dot_tiles: Optional[DotTiles] = None  # a kernel that computes matrix products: its tiles
    notes: tuple[str, ...] = ()  # what explain says of its stores (in-place writes and their copies)
    reads_back: tuple[int, ...] = ()  # stores whose memory it reads too (a product accumulated there)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def constexpr_key(self) -> tuple:
        """The constexprs as a key (runtime/loader.py's count of launch configurations, per launch)."""
        return tuple(sorted(self.constexprs.items()))

    @property
    def writes_anything(self) -> bool:
        """A kernel with no element to write need not launch (a reduction over an empty axis
        still writes its identity, once per kept index)."""
        return bool(self.scratch) or math.prod(s for d, s in enumerate(self.shape) if d not in self.reduced_axes) > 0

    @functools.cached_property
    def bytes_read(self) -> int:
        """Bytes of distinct elements loaded: an element read through two views (x and
        x.flip(0)) or broadcast over many lanes counts once, as it comes from cache."""
        loads = [(a, self.load_passes.get(n, 1)) for n, a in enumerate(self.accesses)
                 if not a.store or n in self.reads_back]
        direct = [(a, p) for a, p in loads if not a.gather]
        gathered = sum(a.gather[2] * a.buffer.dtype.itemsize * p for a, p in loads if a.gather)
        return _distinct_bytes([a for a, _ in direct], [p for _, p in direct]) + gathered + self._scratch_bytes

    @property
    def _scratch_bytes(self) -> int:
        """A grid reduction's partials: written once by their programs, read once by the last."""
        return sum(self.grid[0] * ref.dtype.itemsize for ref in self.scratch)

    @functools.cached_property
    def bytes_written(self) -> int:
        stores = [a for a in self.accesses if a.store]
        scattered = sum(a.gather[2] * a.buffer.dtype.itemsize for a in stores if a.gather)
        return _distinct_bytes([a for a in stores if not a.gather]) + scattered + self._scratch_bytes


def _reach(view: View) -> int:
    """The farthest element offset a view addresses, from its storage's start."""
    return abs(view.offset) + sum((s - 1) * abs(st) for s, st in zip(view.shape, view.strides))


def float32_dot_precision(device: str) -> str:
    """tl.dot's input_precision for float32 operands: tf32 on a GPU where torch's float32
    matmul precision lets eager's cuBLAS products use it. At torch's default ("highest"),
    "tf32x3" on a GPU with tensor cores for tf32 (three tf32 products of each operand's high
    and low parts, Triton's float32 emulation, which zeroes the low parts' NaNs so that inf
    operands give eager's infs). Measured on an H100 (gelu(linear) 4096^3, against float64):
    relative error 2.1e-7 against cuBLAS's exact float32 9.5e-7, 2.4 ms against its 2.7;
    "ieee" (FMA, no tensor cores) ran 19 ms. Exact "ieee" in the interpreter (as eager on
    the CPU) and on GPUs before Ampere."""
    if device == "cpu":
        return "ieee"
    if torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "tf32x3" if _has_tf32() else "ieee"


@functools.lru_cache(maxsize=None)
def _has_tf32() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def plan_kernel(group: KernelGroup, output_strides: dict[str, tuple[int, ...]],
                forced: Optional[Sequence[AxisStrategy]] = None, device: str = "cuda") -> KernelPlan:
    """The kernel for `group`, generated for `device` ("cpu": Triton's interpreter, or
    "cuda"), whose eager numerics it follows where they differ (scan accumulation)."""
    plan = _Emitter(group, output_strides, forced, device).emit()
    plan.notes = tuple(s.note for s in group.stores if s.note)
    return plan


class _Emitter(GridReductionEmitter):
    def __init__(self, group: KernelGroup, output_strides, forced, device: str = "cuda"):
        self.group, self.shape, self.domain = group, group.shape, group.domain
        self.device = device
        self.accesses: list[Access] = []
        self.buffers: dict[tuple, BufferRef] = {}
        self.leaf_access: dict[int, int] = {}
        self.coords: list[View] = []  # affine index values the kernel computes (Iota leaves, window bounds)
        self._collect(output_strides)
        library_only = next((a.buffer.dtype for a in self.accesses if a.buffer.dtype.library_only), None)
        if library_only is not None:  # (a copy converts nothing: it would reach Triton's argument types only)
            raise UnsupportedOpError(f"dtype {library_only.torch}", "a kernel would load or store it: tjit "
                                     "computes this type in library calls only")
        self.widest = max(n.dtype.itemsize for s in group.stores for n in kernel_expression(s.value))
        self.accumulated = self._accumulated_product() if group.domain.dot else None
        strides = [a.view.strides for a in self.accesses]
        self.tiles = self._dot_tiles() if group.domain.dot else None
        if self.tiles is not None:
            self.space = dot_schedule(self.shape, strides + [c.strides for c in self.coords], self.tiles,
                                      reduces_rows=bool(self.domain.axes), accumulates=self.accumulated is not None)
        else:
            # the coordinates take part in the schedule like accesses: axes merge only where
            # every access and every coordinate walks them as one
            self.space = schedule(self.shape, strides + [c.strides for c in self.coords], forced,
                                  self.store_access[0], self.widest, self.domain.axes,
                                  self._reduction_input(strides), self._splittable(), len(self.coords))
        self.split = any(d.kind == "split" for d in self.space.loop_dims)
        self.red_dims = [k for k, d in enumerate(self.space.loop_dims) if d.reduce]
        self.red_axes = [a for k in self.red_dims for a in self.space.loop_dims[k].axes]
        self.params: list[str] = [b.param for b in self.buffers.values()]
        self.scalar_args: list[int] = []
        self._scalar_values: dict[str, int] = {}  # scalar argument name -> its value
        self.int64 = self._needs_int64()
        self.load_passes: dict[int, int] = {}
        self._counter = 0
        self._varies: dict[int, bool] = {}
        self._addresses: dict[int, str] = {}
        self._coord_exprs: dict[int, str] = {}
        self._window_bounds: dict[int, list] = {}
        self._gather_steps: dict[int, Optional[str]] = {}
        self._dot_steps: dict[str, int] = {}  # constexpr name -> the contraction step of one product
        self._online_rows: dict[int, str] = {}  # a Reduce a product's k loop computes -> its value's name
        self.checks: list[Check] = []
        self._zero_div_code = 0  # the status code of this kernel's integer divisions (0: none yet)
        divides = any(_checked_division(n) or _checks_index(n)
                      for n in kernel_expressions(self._store_values()))
        scatters = [s.target.node for s in group.stores if isinstance(s.target, ScatterTarget)]
        if any(n.op.checked for n in self._gathers() + scatters) or divides:
            self.buffers[("status",)] = STATUS
            self.params.append(STATUS.param)
        self.totals = list({id(t): t for s in group.stores for t in s.totals}.values())
        if self.split:  # every reduction is finished by the last program
            self.totals = [n for n in kernel_expressions(self._store_values()) if isinstance(n.op, Reduce)]
        self.scratch = [BufferRef("scratch", f"partial{j}", work_dtype(t.dtype)) for j, t in enumerate(self.totals)]
        if self.totals:
            for ref in [COUNTER] + self.scratch:
                self.buffers[(ref.kind, ref.name)] = ref
                self.params.append(ref.param)

    def _store_values(self) -> list[GraphNode]:
        """What the kernel computes at its index (a row statistic a product's k loop computes
        online is part of that product's work)."""
        return [s.value for s in self.group.stores if s.online_of is None]

    def _reduction_input(self, strides) -> int:
        """The access whose memory order orders the reduced axes: the first that walks them."""
        for n, st in enumerate(strides):
            if not self.accesses[n].store and any(st[a] for a in self.domain.axes):
                return n
        return 0

    def _fresh(self) -> str:
        self._counter += 1
        return f"r{self._counter}"

    # -- what the kernel touches --------------------------------------------------------
    def _buffer(self, kind: str, name: str, dtype: DType, node=None) -> BufferRef:
        key = (kind, name) if node is None else (kind, id(node))
        if key not in self.buffers:
            ordinal = sum(1 for k in self.buffers if k[0] == kind)
            if node is not None:
                name = f"buf{ordinal}"
            label = {"input": f"in{ordinal}", "output": f"out{ordinal}"}.get(kind, "")
            self.buffers[key] = BufferRef(kind, name, dtype, node, label)
        return self.buffers[key]

    def _buffer_for_node(self, base: GraphNode) -> BufferRef:
        if isinstance(base.op, Input):
            return self._buffer("input", base.op.name, base.dtype)
        return self._buffer("buffer", "", base.dtype, base)

    def _gathers(self) -> list[GraphNode]:
        return [n for n in kernel_expressions(self._store_values()) if isinstance(n.op, Gather)]

    def _collect(self, output_strides):
        self.gather_access: dict[int, int] = {}
        self.window_access: dict[int, int] = {}
        self.coord_index: dict[tuple, int] = {}
        read_directly = {id(s.value) for s in self.group.stores}  # leaves loaded at the kernel's own index
        self.dot_access: dict[int, tuple[dict, dict]] = {}  # a Dot -> per operand, its leaves' accesses
        for node in toposort(self._store_values(), stop=at_product):
            if isinstance(node.op, Dot) and id(node) not in self.dot_access:
                self._collect_dot(node)
                continue  # its operands are read in tiles along the contraction, not at the lane's index
            if isinstance(node.op, Gather) and id(node) not in self.gather_access:
                self._collect_gather(node)
            if isinstance(node.op, Window) and id(node) not in self.window_access:
                self._collect_window(node)
            if isinstance(node.op, Iota):
                self._coordinate(node.view)
            if is_kernel_input(node):
                continue  # what a leaf views is read through the leaf
            # src[0] of a Gather or Window is read at its own addresses
            table_slot = isinstance(node.op, (Gather, Window))
            read_directly.update(id(s) for k, s in enumerate(node.src) if not (table_slot and k == 0))
        for store in self.group.stores:
            for leaf in expression_leaves(store.value):
                base = buffer_of(leaf)
                if base is None or id(leaf) in self.leaf_access or id(leaf) not in read_directly:
                    continue
                view = leaf_view(leaf)
                self.leaf_access[id(leaf)] = len(self.accesses)
                self.accesses.append(Access(self._buffer_for_node(base), self.domain.to_domain(view), False))
        self.store_access = []
        for store in self.group.stores:
            t = store.target
            self.store_access.append(len(self.accesses))
            if isinstance(t, ScatterTarget):  # at data-dependent offsets: each lane's one element
                ref = self._buffer("input", t.mutation.name, t.node.dtype) if t.mutation else \
                    self._buffer_for_node(t.node)
                self.accesses.append(Access(ref, View(self.shape, (0,) * len(self.shape)), True,
                                            (1, math.prod(t.node.shape), math.prod(store.shape))))
                continue
            shape = store.target_shape or store.shape
            if isinstance(t, OutputTarget):
                ref = self._buffer("output", t.name, store.value.dtype)
                view = View(shape, output_strides[t.name])
            elif isinstance(t, BufferTarget):
                ref, view = self._buffer_for_node(t.node), View.contiguous(shape)
            else:
                m = t.mutation
                ref, view = self._buffer("input", m.name, m.value.dtype), m.view
            if store.online_of is not None:  # a row value: the same along the product's columns
                view = View(self.shape, view.strides[:-1] + (0,), view.offset)
            elif store.target_dims is not None:
                view = view.permute(store.target_dims)
            elif store.target_shape is not None:
                view = view.reshape(store.shape)  # (an axis split: always a strided view)
            if store.totals:  # one element, written by the last program: no index reaches it
                view = View(self.shape, (0,) * len(self.shape), view.offset)
            else:
                view = self.domain.to_domain(view)
            self.accesses.append(Access(ref, view, True))

    def _collect_gather(self, node: GraphNode) -> None:
        """The table of a Gather is read at the node's own index on every axis but the gathered
        one, whose coordinate is data: its stride is left out of the view and added per load."""
        table, axis = node.src[0], node.op.axis
        view = leaf_view(table)
        strides = tuple(0 if d == axis else st for d, st in enumerate(view.strides))
        self.gather_access[id(node)] = len(self.accesses)
        self.accesses.append(Access(self._buffer_for_node(buffer_of(table)),
                                    self.domain.to_domain(View(node.shape, strides, view.offset)), False,
                                    (view.strides[axis], table.shape[axis], math.prod(node.shape)),
                                    offsets_of=node.op.flat))

    def _collect_dot(self, node: GraphNode, nested: bool = False) -> None:
        """A product's operands a [.., m, k] and b [.., k, n] (or [k, n]) are read over the kernel's
        [.., m, n] as a (stride 0 along n) and b (stride 0 along m), the contraction's
        stride added per step; what they read in all is their own views. An operand computed
        on its tiles (a prologue) is read so through each of its leaves in memory, and a
        product it computes (`nested`: [.., m, k], its columns the outer k) reads its b at
        stride 0 along n too, the outer k's stride added per outer step."""
        found, batch = [], len(node.shape) - 2
        for operand, kept in zip(node.src, ((1, 0), (0, 0 if nested else 1))):
            found.append({})
            for leaf in toposort([operand], stop=at_product):  # (an operand computed on its tiles reads several)
                if isinstance(leaf.op, Dot):
                    self._collect_dot(leaf, nested=True)
                if not is_kernel_input(leaf) or buffer_of(leaf) is None:  # a product, computed; a literal
                    continue
                view = leaf_view(leaf)
                # (a shared b, [k, n], is read at stride 0 along the batch axes)
                strides = (view.strides[:-2] or (0,) * batch) + tuple(st * keep for st, keep in zip(view.strides[-2:], kept))
                found[-1][id(leaf)] = len(self.accesses)
                self.accesses.append(Access(self._buffer_for_node(buffer_of(leaf)),
                                            self.domain.to_domain(View(self.shape, strides, view.offset)), False,
                                            reads=view))
        self.dot_access[id(node)] = tuple(found)

    def _accumulated_product(self) -> Optional[GraphNode]:
        """The product this kernel accumulates in the memory it writes (frontend/dot.py's
        accumulates_in_memory), which fusion gives a kernel of its own: its one store writes
        it, as it is, to float32 memory."""
        dots = [d for s in self.group.stores for d in dots_in(s.value) if accumulates_in_memory(d)]
        if not dots:
            return None
        (store,) = self.group.stores
        written = self.accesses[self.store_access[0]].buffer.dtype
        assert store.value is dots[0] and written is DType.float32 and not self.domain.axes \
            and online_product(store.value) is None, "a product accumulated in memory"
        return store.value

    def _dot_tiles(self) -> DotTiles:
        dots = [n for n in kernel_expressions(self._store_values()) if isinstance(n.op, Dot)]
        *_, m, n = self.shape
        k = max(d.src[0].shape[-1] for d in dots)
        computed = sum(not is_kernel_input(s) for d in dots for s in d.src)  # (prologues)
        itemsize = max(d.src[0].dtype.itemsize for d in dots)
        tensor_cores = itemsize <= 2 or float32_dot_precision(self.device) != "ieee"
        pressure = (m, n, k, itemsize, len(dots) + computed / 2, len(self.accesses) - 2 * len(dots), tensor_cores)
        if self.domain.axes:  # (loads of [rows, columns] tiles in the epilogue: an attention mask)
            operands = {j for found in self.dot_access.values() for side in found for j in side.values()}
            tile_loads = sum(not a.store and j not in operands and all(a.view.strides[-2:])
                             for j, a in enumerate(self.accesses))
            tiles = dot_row_tiles(*pressure, tile_loads=tile_loads)
        else:
            tiles = dot_tiles(*pressure)
        outermost = toposort(self._store_values(), stop=at_product)
        nested = len(dots) - sum(isinstance(d.op, Dot) for d in outermost)
        if not nested:
            return tiles
        # (loads beside the products' operands: an attention mask read in a's prologue)
        extra_loads = sum(not a.store for a in self.accesses) - (2 * len(dots) - computed)
        if self.accumulated is not None:  # (a chunk of the columns at a time)
            n = min(n, ACCUMULATED_COLUMNS)
        return nested_dot_tiles(tiles, m, n, tensor_cores, nested, extra_loads)

    def _coordinate(self, view: View) -> int:
        """The index of the coordinate that computes `view`'s offset for each kernel index."""
        view = self.domain.to_domain(view)
        key = (view.strides, view.offset)
        if key not in self.coord_index:
            self.coord_index[key] = len(self.coords)
            self.coords.append(view)
        return self.coord_index[key]

    def _collect_window(self, node: GraphNode) -> None:
        """A Window loads its source's memory through the source's view shifted by `low`
        (addresses off the source only on lanes its bounds mask off); each shifted axis's
        bounds test a coordinate along it."""
        src, low = node.src[0], node.op.low
        view = leaf_view(src)
        offset = view.offset - sum(lo * st for lo, st in zip(low, view.strides))
        self.window_access[id(node)] = len(self.accesses)
        self.accesses.append(Access(self._buffer_for_node(buffer_of(src)),
                                    self.domain.to_domain(View(node.shape, view.strides, offset)), False,
                                    reads=view))
        for d in self._window_axes(node):
            self._coordinate(View(node.shape, tuple(int(k == d) for k in range(len(node.shape)))))

    @staticmethod
    def _window_axes(node: GraphNode) -> list[int]:
        return [d for d, (lo, n, size) in enumerate(zip(node.op.low, node.src[0].shape, node.shape))
                if lo > 0 or lo + n < size]

    def _needs_int64(self) -> bool:
        if any(_reach(c) > INT32_LIMIT for c in self.coords):
            return True
        for a in self.accesses:
            gathered = (a.gather[1] - 1) * abs(a.gather[0]) if a.gather else 0
            views = (a.view,) if a.reads is None else (a.view, a.reads)  # (a product's operand reaches along k too)
            if any(_reach(view) + gathered > INT32_LIMIT for view in views):
                return True
        return math.prod(self.shape) > INT32_LIMIT

    # -- source ---------------------------------------------------------------------------
    def emit(self) -> KernelPlan:
        body = self._body()
        constexprs = {f"BLOCK_{k}": d.width for k, d in enumerate(self.space.loop_dims)} | self._dot_steps
        if self._zero_div_code:
            constexprs[ZERO_DIV_FLAG] = False  # as compiled for a GPU; the interpreter's launches set it
        params = self.params + [f"{name}: tl.constexpr" for name in constexprs]
        source = "\n".join(["@triton.jit", f"def KERNEL({', '.join(params)}):"] + ["    " + ln for ln in body])
        digest = hashlib.sha1(source.encode()).hexdigest()[:12]
        kind = "reduce" if self.red_dims else "dot" if self.tiles else "pointwise"
        name = f"tjit_{kind}_{digest}"
        source = source.replace("def KERNEL(", f"def {name}(", 1)
        grid = math.prod(-(-self.space.sizes[d.axes[0]] // d.width) if len(d.axes) == 1 else
                         -(-math.prod(self.space.sizes[a] for a in d.axes) // d.width)
                         for d in self.space.loop_dims if d.kind == "group")
        grid *= math.prod(d.programs for d in self.space.loop_dims if d.kind == "split")
        if self.totals:  # no rows: one program still finishes the totals (over nothing)
            grid = max(grid, 1)
        warps = self.tiles.warps if self.tiles else num_warps(self.space, self.widest)
        return KernelPlan(name, source, list(self.buffers.values()), self.scalar_args, constexprs, (grid,),
                          self.shape, self.space, self.accesses, self.params, warps,
                          self.load_passes, self.checks, self.scratch, self.domain.axes,
                          num_stages=self.tiles.stages if self.tiles else 3, dot_tiles=self.tiles,
                          reads_back=(self.store_access[0],) if self.accumulated is not None else ())

    def _scalar(self, name: str, value: int) -> str:
        """A kernel argument, declared once however often it is used (a checked gather read
        in several passes of a looped kernel asks for its size in each)."""
        if name in self._scalar_values:
            assert self._scalar_values[name] == value, name
            return name
        self._scalar_values[name] = value
        self.params.append(name)
        self.scalar_args.append(value)
        return name

    def _body(self) -> list[str]:
        sizes = [self._scalar(f"size{k}", s) for k, s in enumerate(self.space.sizes)]
        lines = ["pid = tl.program_id(0)" + (".to(tl.int64)" if self.int64 else "")]
        if self.totals:
            lines.append("pid_grid = pid  # this program's slot for its partials")
        lines += self._grid_decomposition(sizes)
        if self.red_dims:
            return lines + self._reduction_body(sizes)
        if self.accumulated is not None:
            return lines + self._accumulated_body(sizes)
        loops, indent = [], ""
        for k, d in enumerate(self.space.loop_dims):
            if d.kind == "loop":
                extent = self._extent(d, sizes)
                loops.append(f"{indent}for step{k} in range(0, tl.cdiv({extent}, BLOCK_{k})):")
                indent += "    "
        lines += loops
        inner = self._indices(sizes)
        inner += self._values()
        return lines + [indent + ln for ln in inner]

    def _accumulated_body(self, sizes) -> list[str]:
        """A product accumulated in the memory it writes: its rows' indices, then the product
        (_dot), whose k loop adds each step's chunks of columns to that memory."""
        dims = self.space.loop_dims
        lines = []
        masks = [self._dim_indices(k, sizes, lines) for k in range(len(dims) - 1)]
        lines.append("row_mask = " + " & ".join(masks))
        chunk = []  # the indices of a chunk of columns
        chunk.append(f"mask = row_mask & {self._dim_indices(len(dims) - 1, sizes, chunk)}")
        self._dot(self.accumulated, lines, into=(chunk, self.store_access[0]))
        return lines

    def _extent(self, d: LoopDim, sizes) -> str:
        return " * ".join(sizes[a] for a in d.axes)

    def _grid_decomposition(self, sizes) -> list[str]:
        groups = [(k, d) for k, d in enumerate(self.space.loop_dims) if d.kind == "group"]
        lines = [f"# {d.describe()}" for d in self.space.loop_dims] + ([f"# {self.tiles.describe()}"] if self.tiles else [])
        for n, (k, d) in enumerate(reversed(groups)):
            tiles = f"tl.cdiv({self._extent(d, sizes)}, BLOCK_{k})"
            if n == len(groups) - 1:
                lines.append(f"tile{k} = pid")
            else:
                lines.append(f"tile{k} = pid % {tiles}")
                lines.append(f"pid = pid // {tiles}")
        return lines

    def _indices(self, sizes) -> list[str]:
        lines, masks = [], []
        for k in range(len(self.space.loop_dims)):
            masks.append(self._dim_indices(k, sizes, lines))
        lines.append("mask = " + (" & ".join(masks) if masks else "True"))
        return lines

    def _dim_indices(self, k: int, sizes, lines: list[str]) -> str:
        """Index lines of loop dim k (its lanes, then each axis it covers); returns its mask."""
        dims = self.space.loop_dims
        d = dims[k]
        shape = ", ".join(":" if j == k else "None" for j in range(len(dims)))
        base = {"group": f"tile{k} * BLOCK_{k} + ", "loop": f"step{k} * BLOCK_{k} + ", "thread": "",
                "split": f"pid_grid * split_chunk + step{k} * BLOCK_{k} + "}[d.kind]
        arange = f"tl.arange(0, BLOCK_{k})" + (".to(tl.int64)" if self.int64 else "")
        lines.append(f"lin{k} = {base}{arange}")
        if d.simd:  # groups of `simd` lanes start at multiples of simd: the width is a multiple of it
            lines.append(f"lin{k} = tl.max_contiguous(tl.multiple_of(lin{k}, {d.simd}), {d.simd})")
        if len(dims) > 1:
            lines.append(f"lin{k} = lin{k}[{shape}]")
        rest = f"lin{k}"
        for j, a in enumerate(reversed(d.axes)):
            if j == len(d.axes) - 1:
                lines.append(f"i{a} = {rest}")
            else:
                lines.append(f"i{a} = {rest} % {sizes[a]}")
                lines.append(f"rest{k} = {rest} // {sizes[a]}")
                rest = f"rest{k}"
        return f"(lin{k} < {self._extent(d, sizes)})"

    # -- reduction kernels -----------------------------------------------------------------
    def _reduction_body(self, sizes) -> list[str]:
        """Rows (the kept axes) first, masked by row_mask; the reduced axes either in the
        block (persistent: straight-line code) or walked by loops, one pass per level of
        reductions that read other reductions, and a last pass for the full-shape stores."""
        dims = self.space.loop_dims
        lines, row_masks = [], []
        for k in range(len(dims)):
            if k not in self.red_dims:
                row_masks.append(self._dim_indices(k, sizes, lines))
        lines.append("row_mask = " + (" & ".join(row_masks) if row_masks else "True"))
        inner, red_masks = [], []
        for k in self.red_dims:
            red_masks.append(self._dim_indices(k, sizes, inner))
        inner.append("mask = row_mask & " + " & ".join(red_masks))
        if all(dims[k].kind == "thread" for k in self.red_dims):
            return lines + inner + self._values()
        if self.split:
            return lines + self._split_values(inner, sizes)
        return lines + self._looped_values(inner, sizes)

    def _row_shape(self) -> str:
        return "[" + ", ".join("1" if d.reduce else f"BLOCK_{k}" for k, d in enumerate(self.space.loop_dims)) + "]"

    def _loop(self, body: list[str], sizes) -> list[str]:
        header, indent = [], ""
        for k in self.red_dims:
            d = self.space.loop_dims[k]
            if d.kind == "loop":
                header.append(f"{indent}for step{k} in range(0, tl.cdiv({self._extent(d, sizes)}, BLOCK_{k})):")
                indent += "    "
            elif d.kind == "split":  # this program's chunk of the axis
                header.append(f"{indent}for step{k} in range(0, split_chunk // BLOCK_{k}):")
                indent += "    "
        return header + [indent + ln for ln in body]

    def _varies_along_reduction(self, node: GraphNode) -> bool:
        if id(node) not in self._varies:
            if id(node) in self.leaf_access:
                found = any(self.space.strides[self.leaf_access[id(node)]][a] for a in self.red_axes)
            elif isinstance(node.op, Iota):
                found = any(self._coord_strides(node.view)[a] for a in self.red_axes)
            elif isinstance(node.op, Window):
                found = any(self.space.strides[self.window_access[id(node)]][a] for a in self.red_axes) or \
                    any(self._coord_strides(self._axis_view(node, d))[a]
                        for d in self._window_axes(node) for a in self.red_axes)
            elif isinstance(node.op, Gather):
                found = self._varies_along_reduction(node.src[1]) or \
                    any(self.space.strides[self.gather_access[id(node)]][a] for a in self.red_axes)
            elif is_value_ref(node):
                found = self._varies_along_reduction(node.src[0])
            elif isinstance(node.op, Elementwise):
                found = any(self._varies_along_reduction(s) for s in node.src)
            else:  # literals, reductions and their broadcasts; scans and products (of the domain's shape) vary
                found = isinstance(node.op, (Cumulative, Dot))
            self._varies[id(node)] = found
        return self._varies[id(node)]

    def _has_dot(self) -> bool:
        """The kernel computes a product (its tl.dot tiles hold many registers)."""
        return any(dots_in(s.value) for s in self.group.stores)

    def _reduces_read(self, node: GraphNode) -> list[GraphNode]:
        stop = lambda n: is_kernel_input(n) or isinstance(n.op, Reduce)  # noqa: E731
        return [n for n in toposort([node], stop=stop) if isinstance(n.op, Reduce)]

    def _looped_values(self, inner: list[str], sizes) -> list[str]:
        stores = [(s, n) for s, n in zip(self.group.stores, self.store_access) if not s.totals]
        reduces = [n for n in kernel_expressions(self._roots()) if isinstance(n.op, Reduce)]
        red_loop = [k for k in self.red_dims if self.space.loop_dims[k].kind == "loop"]
        start = f"step{red_loop[0]} * BLOCK_{red_loop[0]}" if len(self.red_dims) == 1 and red_loop else "0"
        ctx = LoopContext(self._row_shape(), list(self.red_dims), "mask", self._fresh, start,
                          compensated=not self._has_dot())
        is_row_value = lambda n: not self._varies_along_reduction(n) and bool(self._reduces_read(n))  # noqa: E731
        accs = {id(r): accumulator_for(r, ctx, is_row_value) for r in reduces}
        depth: dict[int, int] = {}

        def level(r: GraphNode) -> int:
            if id(r) not in depth:
                acc = accs[id(r)]
                reads = max((level(x) for n in acc.inputs for x in self._reduces_read(n)), default=0)
                after = max((level(x) for n in acc.after for x in self._reduces_read(n)), default=0)
                depth[id(r)] = max(reads + 1, after)
            return depth[id(r)]

        lines: list[str] = []
        row: dict[int, str] = {}
        for p in sorted({level(r) for r in reduces}):
            these = [r for r in reduces if depth[id(r)] == p]
            body, full = [], {}
            for r in these:
                acc = accs[id(r)]
                lines += acc.init()
                values = [_cast(self._full(n, body, full, lines, row), n.dtype, acc.dtype) for n in acc.inputs]
                body += acc.update(values)
            lines += self._loop(inner + body, sizes)
            for r in these:
                fin, var = accs[id(r)].finalize([self._row(n, lines, row) for n in accs[id(r)].after])
                lines += fin
                row[id(r)] = self._reduce_result(r, var, lines)
        full_stores = [(s, n) for s, n in stores if not self._is_row_access(n)]
        full_stores.sort(key=lambda p: isinstance(p[0].target, InputTarget))  # input writes last
        if full_stores:
            body, full = [], {}
            for s, n in full_stores:
                body.append(self._store_var(s, n, self._full(s.value, body, full, lines, row)))
            lines += self._loop(inner + body, sizes)
        for s, n in stores:
            if self._is_row_access(n):
                lines.append(self._store_var(s, n, self._row(s.value, lines, row)))
        return lines + self._grid_epilogue(lines, row)

    def _full(self, node, body, names, pre, row) -> str:
        """A value inside the loop body (row values are computed before the loop, in `pre`)."""
        if not self._varies_along_reduction(node):
            return self._row(node, pre, row)
        if id(node) in names:
            return names[id(node)]
        if isinstance(node.op, Cumulative):
            var = self._scan(node, self._full(node.src[0], body, names, pre, row), body, pre)
        elif isinstance(node.op, Gather):
            self._count_pass(self.gather_access[id(node)])
            var = self._gather(node, self._full(node.src[1], body, names, pre, row), body)
        elif is_value_ref(node):
            var = self._full(node.src[0], body, names, pre, row)
        else:
            args = [self._full(s, body, names, pre, row) for s in node.src] if isinstance(node.op, Elementwise) else []
            if id(node) in self.leaf_access:
                self._count_pass(self.leaf_access[id(node)])
            var = self._fresh()
            body.append(f"{var} = {self._expr(node, args, body, 'mask')}")
        names[id(node)] = var
        return var

    def _count_pass(self, n: int) -> None:
        """Access n is read once more (by another pass of a looped kernel)."""
        self.load_passes[n] = self.load_passes.get(n, 0) + 1

    def _row(self, node, lines, row) -> str:
        """A value that does not vary along the reduced axes, computed once per row."""
        if is_value_ref(node):
            node = node.src[0]
        if id(node) not in row and isinstance(node.op, Gather):
            row[id(node)] = self._gather(node, self._row(node.src[1], lines, row), lines)
        if id(node) not in row:
            assert not isinstance(node.op, Reduce), "a reduction is read before the pass that computes it"
            args = [self._row(s, lines, row) for s in node.src] if isinstance(node.op, Elementwise) else []
            var = self._fresh()
            lines.append(f"{var} = {self._expr(node, args, lines, 'row_mask')}")
            row[id(node)] = var
        return row[id(node)]

    def _expr(self, node: GraphNode, args: list[str], lines: list[str], mask: str) -> str:
        """A leaf's load or literal, or an elementwise op over argument variables (checks it
        needs go to `lines`, for the lanes of `mask`)."""
        if isinstance(node.op, Elementwise):
            return self._elementwise(node, args, lines, mask)
        return self._value(node, {}, lines)

    def _elementwise(self, node: GraphNode, args: list[str], lines: list[str], mask: str) -> str:
        """render(), with an integer divisor that may be zero made safe and checked first,
        and an index checked to be in range."""
        if _checks_index(node):
            size = node.src[1].src[0] if isinstance(node.src[1].op, ViewOp) else node.src[1]  # (a literal)
            self.checks.append(Check(IndexOutOfBoundsError,
                                     f"an index is out of bounds (valid: 0 to {size.op.value - 1})"))
            failed = f"(tl.where({mask}, 1, 0) * tl.where(({args[0]} >= 0) & ({args[0]} < {args[1]}), 0, 1)) != 0"
            lines.append(f"tl.store({STATUS.param} + tl.where({mask}, 0, 0), {len(self.checks)}, mask={failed})")
            return args[0]
        if _checked_division(node):
            if not self._zero_div_code:
                self.checks.append(Check(RuntimeError, "ZeroDivisionError", interpreted_only=True))  # eager's words
                self._zero_div_code = len(self.checks)
            safe = self._fresh()
            lines.append(f"{safe} = tm.nonzero_divisor({args[1]}, {mask}, {STATUS.param}, {self._zero_div_code}, "
                         f"{ZERO_DIV_FLAG})")
            args = [args[0], safe] + list(args[2:])
        return render(node, args)

    def _grid_value(self, node: GraphNode, totals: dict, lines: list[str]) -> str:
        """As GridReductionEmitter's, with integer divisions of the (scalar) totals checked."""
        if id(node) not in totals and _checked_division(node):
            args = [self._grid_value(s, totals, lines) for s in node.src]
            var = self._fresh()
            lines.append(f"{var} = {self._elementwise(node, args, lines, 'True')}")
            totals[id(node)] = var
            return var
        return super()._grid_value(node, totals, lines)

    def _reduce_result(self, node: GraphNode, var: str, lines: list[str], work: Optional[DType] = None) -> str:
        """The accumulator's value in the node's type (bools and 16-bit floats were widened;
        a scan's `work` type may be wider still)."""
        if work is None:
            work = work_dtype(node.dtype) if not node.op.op.startswith("arg") else node.dtype
        if work == node.dtype:
            return var
        out = self._fresh()
        lines.append(f"{out} = {_cast(var, work, node.dtype)}")
        return out

    def _is_row_access(self, n: int) -> bool:
        return bool(self.red_axes) and not any(self.space.strides[n][a] for a in self.red_axes)

    def _mask_for(self, n: int) -> str:
        return "row_mask" if self._is_row_access(n) else "mask"

    def _address(self, n: int) -> str:
        """The pointer expression of access n (its offset and stride arguments are made once,
        however often a looped kernel reads it)."""
        if n not in self._addresses:
            self._addresses[n] = self._new_address(n)
        return self._addresses[n]

    def _new_address(self, n: int) -> str:
        access = self.accesses[n]
        terms = []
        if access.view.offset:
            terms.append(self._scalar(f"a{n}_offset", access.view.offset))
        for axis, stride in enumerate(self.space.strides[n]):
            if stride == 1:
                terms.append(f"i{axis}")
            elif stride != 0:
                terms.append(f"i{axis} * " + self._scalar(f"a{n}_stride{axis}", stride))
        return f"{access.buffer.param} + " + (" + ".join(terms) if terms else "0")

    def _values(self) -> list[str]:
        """Compute each store's value and store it as soon as it is ready, so outputs do not
        all stay live in registers to the end. Writes into inputs come last: every load of
        an input in this kernel must see its old contents."""
        lines, names = [], {}
        pending = [(s, n) for s, n in zip(self.group.stores, self.store_access) if not s.totals]
        statistics = [(s, n) for s, n in pending if s.online_of is not None]
        pending = [p for p in pending if p not in statistics]
        for node in toposort(self._roots(), stop=at_product):
            if is_kernel_input(node) and buffer_of(node) is not None and id(node) not in self.leaf_access:
                continue  # a table only a Gather reads, at its own addresses
            if is_value_ref(node):  # the reduced value broadcasts over the block by itself
                names[id(node)] = names[id(node.src[0])]
            elif isinstance(node.op, Reduce):
                names[id(node)] = self._block_reduce(node, names[id(node.src[0])], lines)
            elif isinstance(node.op, Cumulative):
                names[id(node)] = self._scan(node, names[id(node.src[0])], lines)
            elif isinstance(node.op, Gather):
                names[id(node)] = self._gather(node, names[id(node.src[1])], lines)
            else:
                var = f"v{len(names)}"
                names[id(node)] = var
                lines.append(f"{var} = {self._value(node, names, lines)}")
            ready = [(s, n) for s, n in pending if s.value is node and not isinstance(s.target, InputTarget)]
            for s, n in ready:
                lines += self._store(s, n, names)
            pending = [p for p in pending if p not in ready]
            done = [(s, n) for s, n in statistics if s.online_of is node]
            lines += [ln for s, n in done for ln in self._store_statistic(s, n)]
            statistics = [p for p in statistics if p not in done]
        assert not statistics, "a row statistic whose product this kernel does not compute"
        for s, n in pending:
            lines += self._store(s, n, names)
        return lines + self._grid_epilogue(lines, names)

    def _block_reduce(self, node: GraphNode, src: str, lines: list[str]) -> str:
        """A reduction over the whole reduced extent, held in the block (persistent)."""
        op = node.op.op
        work = work_dtype(node.src[0].dtype)
        masked = self._fresh()
        lines.append(f"{masked} = tl.where(mask, {_cast(src, node.src[0].dtype, work)}, "
                     f"{identity(op, node.src[0].dtype)})")
        return self._reduce_result(node, block_reduce(op, masked, work, self.red_dims, self._fresh, lines), lines)

    def _gather(self, node: GraphNode, index: str, lines: list[str]) -> str:
        """Load the table at a data-dependent coordinate. An index out of range is reported
        through the status buffer (the runtime raises) and replaced by 0, so it is never
        used as an address."""
        n = self.gather_access[id(node)]
        stride, size, _ = self.accesses[n].gather
        op = node.op
        mask = "mask" if self._varies_along_reduction(node) else self._mask_for(n)
        if not op.checked:  # in range by construction
            idx = self._fresh()
            lines.append(f"{idx} = {index}.to(tl.int64)")
            if n not in self._gather_steps:
                self._gather_steps[n] = self._scalar(f"a{n}_gather_stride", stride) if stride != 1 else None
            step = f"{idx} * {self._gather_steps[n]}" if self._gather_steps[n] else idx
            out = self._fresh()
            # (through tl.where: a block even where the index is one value for all lanes)
            lines.append(f"{out} = tl.load({self._address(n)} + tl.where({mask}, {step}, 0), mask={mask})")
            return out
        size_arg = self._scalar(f"a{n}_gather_size", size)
        low = -size if op.wrap_negative else 0
        valid = "" if op.flat else f" (valid: {low} to {size - 1})"  # a flat read's range is of offsets
        self.checks.append(Check(IndexOutOfBoundsError, f"{op.what}: an index is out of bounds{valid}"))
        idx, ok, out = self._fresh(), self._fresh(), self._fresh()
        lines.append(f"{idx} = {index}.to(tl.int64)")
        if op.wrap_negative:
            lines.append(f"{idx} = tl.where({idx} < 0, {idx} + {size_arg}, {idx})")
        lines.append(f"{ok} = ({idx} >= 0) & ({idx} < {size_arg})")
        # the index may vary where the table's view does not (and the reverse): the full mask
        # when it varies along the reduced axes; tl.where broadcasts pointer and mask alike
        mask = "mask" if self._varies_along_reduction(node) else self._mask_for(n)
        # (ints, not bools: Triton's interpreter cannot combine a bool block with a bool scalar)
        failed = f"(tl.where({mask}, 1, 0) * tl.where({ok}, 0, 1)) != 0"
        lines.append(f"tl.store({STATUS.param} + tl.where({mask}, 0, 0), {len(self.checks)}, mask={failed})")
        step = f"{idx} * {self._scalar(f'a{n}_gather_stride', stride)}" if stride != 1 else idx
        # an index out of range loads nothing (index 0 may itself be out of range: an empty axis)
        lines.append(f"{out} = tl.load({self._address(n)} + tl.where({mask}, tl.where({ok}, {step}, 0), 0), "
                     f"mask=(tl.where({mask}, 1, 0) * tl.where({ok}, 1, 0)) != 0)")
        return out

    def _scan(self, node: GraphNode, src: str, lines: list[str], pre: Optional[list[str]] = None) -> str:
        """A scan along the kernel's scanned axis; in a looped kernel (`pre` given: the lines
        before the loop) continued from a carry across loop steps."""
        op, k = node.op.op, self.red_dims[0]
        work = scan_work_dtype(op, node.src[0].dtype, self.device)
        carry = None
        if pre is not None:
            init, carry = scan_carry_init(op, work, self._row_shape(), self._fresh)
            pre += init
        masked = self._fresh()
        lines.append(f"{masked} = tl.where(mask, {_cast(src, node.src[0].dtype, work)}, {scan_identity(op, work)})")
        result = scan_lines(op, masked, work, k, f"lin{k}", carry, self._fresh, lines)
        if op in ("argmax", "argmin"):  # the index, in its own type
            return self._reduce_result(node, result, lines)
        return self._reduce_result(node, result, lines, work)

    def _coord_strides(self, view: View) -> tuple[int, ...]:
        """A coordinate's strides over the kernel's (simplified) axes."""
        return self.space.strides[len(self.accesses) + self._coordinate(view)]

    @staticmethod
    def _axis_view(node: GraphNode, d: int) -> View:
        return View(node.shape, tuple(int(k == d) for k in range(len(node.shape))))

    def _coordinate_value(self, view: View, dtype: DType, lines: list[str]) -> str:
        """offset + sum(i_a * stride_a) over the kernel's axes, in `dtype`."""
        j = self._coordinate(view)
        if j not in self._coord_exprs:  # its offset and stride arguments are made once
            terms = []
            for axis, stride in enumerate(self._coord_strides(view)):
                if stride == 1:
                    terms.append(f"i{axis}")
                elif stride != 0:
                    terms.append(f"i{axis} * " + self._scalar(f"c{j}_stride{axis}", stride))
            if self.coords[j].offset:
                terms.append(self._scalar(f"c{j}_offset", self.coords[j].offset))
            if not terms or not terms[0].startswith("i"):  # a tensor to start from (an argument may be a constexpr)
                terms.insert(0, f"tl.full([], 0, {'tl.int64' if self.int64 else 'tl.int32'})")
            self._coord_exprs[j] = " + ".join(terms)
        var = self._fresh()
        lines.append(f"{var} = ({self._coord_exprs[j]}).to({tl_dtype(dtype)})")
        return var

    def _window_load(self, node: GraphNode, lines: list[str], mask: str) -> str:
        """The source's element where the lane's index lies in its window, else the fill."""
        n = self.window_access[id(node)]
        if n not in self._window_bounds:  # (the bounds a lane can cross, as arguments)
            self._window_bounds[n] = []
            for d in self._window_axes(node):
                low, high = node.op.low[d], node.op.low[d] + node.src[0].shape[d]
                self._window_bounds[n].append((
                    self._axis_view(node, d),
                    self._scalar(f"a{n}_low{d}", low) if low > 0 else None,
                    self._scalar(f"a{n}_high{d}", high) if high < node.shape[d] else None))
        test = [mask]
        for view, low, high in self._window_bounds[n]:
            c = self._coordinate_value(view, DType.int64 if self.int64 else DType.int32, lines)
            test += ([f"({c} >= {low})"] if low else []) + ([f"({c} < {high})"] if high else [])
        out, test = self._fresh(), " & ".join(test)
        # an address the same for every lane is made a block like the mask (tl.load needs that)
        spread = "" if any(self.space.strides[n]) else f" + tl.where({test}, 0, 0)"
        lines.append(f"{out} = tl.load({self._address(n)}{spread}, mask={test}, "
                     f"other={literal(node.op.fill, node.dtype)})")
        return out

    def _value(self, node: GraphNode, names: dict[int, str], lines: list[str]) -> str:
        if isinstance(node.op, PutAt):  # the values; their store reads the offsets
            return names[id(node.src[1])]
        if isinstance(node.op, Iota):
            return self._coordinate_value(node.view, node.dtype, lines)
        if isinstance(node.op, Window):
            n = self.window_access[id(node)]
            mask = "mask" if self._varies_along_reduction(node) else self._mask_for(n)
            return self._window_load(node, lines, mask)
        if isinstance(node.op, Dot):
            return self._dot(node, lines)
        if id(node) in self.leaf_access:
            n = self.leaf_access[id(node)]
            # a load that no index reaches (a broadcast scalar) is one unmasked scalar load
            masked = f", mask={self._mask_for(n)}" if any(self.space.strides[n]) else ""
            return f"tl.load({self._address(n)}{masked})"
        if node.is_literal:
            const = node if isinstance(node.op, Const) else node.src[0]
            return literal(const.op.value, const.dtype)
        if isinstance(node.op, Elementwise):
            return self._elementwise(node, [names[id(s)] for s in node.src], lines, "mask")
        raise NotImplementedError(f"cannot fuse {node.op} into a pointwise kernel")

    def _dot(self, node: GraphNode, lines: list[str], columns: Optional["TileAxis"] = None,
             into: Optional[tuple[list[str], int]] = None) -> str:
        """The product's tile [.., rows, columns] of this program, accumulated in float32
        over steps of the contraction: each step loads a [rows, step] tile of a (masked past
        m and k) and a [step, columns] tile of b, as 2-d blocks for tl.dot. The columns are
        the kernel's, or for a product an outer product's operand computes (`columns`), the
        outer contraction's step: this product's loop runs inside the outer one's.

        `into` (the lines that index a chunk of columns, and the access of the memory the
        product is written to): accumulated there instead (_accumulate_chunks)."""
        rank = len(self.space.sizes)
        rows, cols = rank - 2, rank - 1
        row_axis = TileAxis(f"i{rows}", f"size{rows}", f"BLOCK_{rows}")
        columns = columns or TileAxis(f"i{cols}", f"size{cols}", f"BLOCK_{cols}")
        j = len(self._dot_steps)
        step, k = f"BLOCK_K{j}", node.src[0].shape[-1]
        self._dot_steps[step] = dot_step(self.tiles, k)
        size = self._scalar(f"dot{j}_k", k)
        acc, k0, rk = self._fresh(), self._fresh(), self._fresh()

        def k_axis(position: int) -> TileAxis:
            return TileAxis(f"{rk}[{', '.join(':' if d == position else 'None' for d in range(rank))}]", size, step,
                            stepped=True)
        body = [f"{rk} = {k0} + tl.arange(0, {step})" + (".to(tl.int64)" if self.int64 else "")]
        tiles, before, after = [], [], []
        b_lines = body if into is None else []  # (accumulated: b's tiles are loaded per chunk of columns)
        online = online_product(node) if not columns.stepped and not self.domain.axes and into is None else None
        for operand, accesses, axes, k_at in zip(node.src, self.dot_access[id(node)],
                                                 ((row_axis, k_axis(cols)), (k_axis(rows), columns)), (1, 0)):
            loads, ahead = (body, before) if k_at == 1 or into is None else (b_lines, b_lines)
            if online is not None and k_at == 1:
                tile, result = self._online_tile(online, operand, accesses, axes, acc, body, before, after)
            else:
                tile = self._operand_tile(operand, accesses, axes, k_at, loads, ahead)
            if rank > 2:
                loads.append(f"{tile} = tl.reshape({tile}, ({axes[0].width}, {axes[1].width}))")
            tiles.append(tile)
        precision = f', input_precision="{float32_dot_precision(self.device)}"' \
            if node.src[0].dtype is DType.float32 else ""
        if into is not None:
            lines += self._accumulate_chunks(tiles, precision, b_lines, body, before, into)
            lines += [f"for {k0} in range(0, {size}, {step}):"] + ["    " + ln for ln in body]
            return ""
        body.append(f"{acc} = tl.dot({tiles[0]}, {tiles[1]}, {acc}{precision})")
        lines += before
        lines.append(f"{acc} = tl.zeros((BLOCK_{rows}, {columns.width}), tl.float32)")
        lines.append(f"for {k0} in range(0, {size}, {step}):")
        lines += ["    " + ln for ln in body]
        lines += after
        if online is None:
            result = acc
        if rank == 2:
            return result
        shape = ", ".join("1" for _ in range(rank - 2))
        return f"tl.reshape({result}, ({shape}, BLOCK_{rows}, {columns.width}))"

    def _accumulate_chunks(self, tiles: list[str], precision: str, b_lines: list[str], body: list[str],
                           before: list[str], into: tuple[list[str], int]) -> list[str]:
        """A product accumulated in the memory it is written to, chunk by chunk of its
        columns: that memory zeroed first; each step of k computes a's tile once (its nested
        products included) and, for each chunk, loads b's tile and adds their product to
        the chunk. Each program owns its rows, so no atomics; a barrier after each pass
        orders one thread's stores before another's loads of the same addresses on a GPU
        (the interpreter runs a program's lanes in step). Appends the k loop's body to
        `body`; returns the lines ahead of the loop."""
        chunk, n = into
        rank = len(self.space.sizes)
        address, part = self._address(n), self._fresh()
        block = ", ".join(f"BLOCK_{d}" for d in range(rank))
        walk = f"for step{rank - 1} in range(0, tl.cdiv(size{rank - 1}, BLOCK_{rank - 1})):"
        add = [f"{part} = tl.dot({tiles[0]}, {tiles[1]}{precision})"]
        if rank > 2:
            add.append(f"{part} = tl.reshape({part}, ({block}))")
        add.append(f"tl.store({address}, tl.load({address}, mask=mask, other=0.0) + {part}, mask=mask)")
        body += [walk] + ["    " + ln for ln in chunk + b_lines + add]
        body.append("tl.debug_barrier()")
        zero = [f"tl.store({address}, tl.zeros(({block},), tl.float32), mask=mask)"]
        zero = [walk] + ["    " + ln for ln in chunk + zero]
        return ["# the product accumulated in the memory it is written to, a chunk of its columns at a time"] + \
            zero + ["tl.debug_barrier()"] + before

    def _online_tile(self, online: OnlineProduct, operand: GraphNode, accesses: dict[int, int],
                     axes: tuple["TileAxis", "TileAxis"], acc: str, body: list[str], before: list[str],
                     after: list[str]) -> tuple[str, str]:
        """a's tile for a product whose a is exp(t - c) * f with c and f row values of
        reductions along k (lower/online_product.py): each step updates the reductions'
        accumulators and a running max m of t from the step's tiles, rescales the product's
        accumulator `acc` by exp(m_old - m_new) and computes exp(t - m) for tl.dot; `after`
        computes the product, acc * exp(m - c) * f (or / f). Returns (the tile, the product)."""
        rank = len(self.space.sizes)
        row_shape = "[" + ", ".join([f"BLOCK_{d}" for d in range(rank - 1)] + ["1"]) + "]"
        mask = f"{axes[0].mask} & {axes[1].mask}"
        ctx = LoopContext(row_shape, [rank - 1], mask, self._fresh, "")
        accumulators = [accumulator_for(r, ctx, row_value) for r in online.reductions]
        names = self._tile_values([online.exponent] + [i for a in accumulators for i in a.inputs],
                                  accesses, axes, 1, body, before)
        t, m, grown = names[id(online.exponent)], self._fresh(), self._fresh()
        for accumulator in accumulators:
            before += accumulator.init()
            body += accumulator.update([names[id(i)] for i in accumulator.inputs])
        before.append(f"# a's softmax along k, online: its rows' statistics and a running max {m} of its exponent, "
                      "the accumulator rescaled as it grows (flash attention)")
        before.append(f"{m} = tl.full({row_shape}, {NEG_INF}, tl.float32)")
        # the sum of exp(t - c) keeps a running max of t and its exponentials already: shared
        shared = next((a for a in accumulators if isinstance(a, OnlineExpSum) and names[id(a.inputs[0])] == t), None)
        if shared is not None:
            top, exps = shared.m_new, shared.exps
        else:
            top, exps = self._fresh(), self._fresh()
            body += [f"{top} = tl.maximum({m}, tl.max(tl.where({mask}, {t}, {NEG_INF}), {rank - 1}, keep_dims=True))",
                     f"{exps} = tl.where({mask}, tl.exp({t} - {finite(top)}), 0.0)"]
        # (1 where the max stays, -inf included; 0 from -inf to a finite max: a finite stand-in
        # for -inf here overflowed exp when the first scores were far below 0)
        body += [f"{acc} = {acc} * tl.reshape(tl.where({m} == {top}, 1.0, tl.exp({m} - {top})), (BLOCK_{rank - 2}, 1))",
                 f"{grown} = {exps}.to({tl_dtype(operand.dtype)})",
                 f"{m} = {top}"]
        rows: dict[int, str] = {}
        for accumulator in accumulators:
            lines, rows[id(accumulator.node)] = accumulator.finalize(
                [self._row_expression(n, rows, after) for n in accumulator.after])
            after += lines
        self._online_rows.update(rows)
        scale, out = self._fresh(), self._fresh()
        after.append(f"{scale} = tl.exp({finite(m)} - {self._row_expression(online.shift, rows, after)})")
        if online.factor is not None:
            factor = self._row_expression(online.factor, rows, after)
            after.append(f"{scale} = " + (f"tl.div_rn({scale}, {factor})" if online.divides else f"{scale} * {factor}"))
        after.append(f"{out} = {acc} * tl.reshape({scale}, (BLOCK_{rank - 2}, 1))")
        return grown, out

    def _row_expression(self, node: GraphNode, names: dict[int, str], lines: list[str]) -> str:
        """A row value after a loop: an expression of reductions' results (`names`, by node;
        what is computed is added) and literals, computed on [.., rows, 1] values."""
        for n in toposort([node], stop=lambda x: isinstance(x.op, Reduce) or is_kernel_input(x)):
            if id(n) in names:
                continue
            if isinstance(n.op, ViewOp) and id(n.src[0]) in names:  # (broadcast along k: the same registers)
                names[id(n)] = names[id(n.src[0])]
            elif is_kernel_input(n):
                names[id(n)] = self._value(n, names, lines)
            else:
                names[id(n)] = self._fresh()
                lines.append(f"{names[id(n)]} = {self._elementwise(n, [names[id(s)] for s in n.src], lines, 'mask')}")
        return names[id(node)]

    def _operand_tile(self, operand: GraphNode, accesses: dict[int, int], axes: tuple["TileAxis", "TileAxis"],
                      k_at: int, body: list[str], before: list[str]) -> str:
        """One step's tile of a product's operand over `axes` (its own axes -2 and -1; the
        contraction's steps at axes[k_at]): its memory loaded (0 past its rows or columns and
        past k), or its expression computed over its leaves' tiles (_tile_values), then 0
        where the mask is off, so steps past k add nothing (a prologue's value there need
        not be 0: x + 1, or a log's -inf)."""
        fixed: set[int] = set()
        tile = self._tile_values([operand], accesses, axes, k_at, body, before, fixed)[id(operand)]
        if not is_kernel_input(operand) or id(operand) in fixed:
            # (a new name: a value computed ahead of the loop and assigned again in it would be a
            # loop-carried variable changing shape, which Triton refuses; and a [rows, 1] value
            # is broadcast to the step's tile here)
            masked = self._fresh()
            body.append(f"{masked} = tl.where({axes[0].mask} & {axes[1].mask}, {tile}, 0.0).to({tile}.dtype)")
            return masked
        return tile

    def _tile_values(self, roots: list[GraphNode], accesses: dict[int, int], axes: tuple["TileAxis", "TileAxis"],
                     k_at: int, body: list[str], before: list[str], fixed: Optional[set[int]] = None) -> dict[int, str]:
        """The values of `roots` (expressions over an operand's tile) on one step's tile:
        leaves loaded (0 past the mask), and the products they compute, each a loop of its
        own. What does not vary along k (a norm's row statistics, literals, and what is
        computed from them alone; in `fixed`) is loaded and computed once, in `before`
        (ahead of the k loop), on [.., rows, 1] (or [.., 1, columns]) tiles that broadcast
        against the step's."""
        rank = len(self.space.sizes)
        kept = axes[1 - k_at]
        mask = f"{axes[0].mask} & {axes[1].mask}"
        names: dict[int, str] = {}
        fixed = set() if fixed is None else fixed  # the nodes that do not vary along k
        for node in toposort(roots, stop=at_product):
            lines, node_mask = body, mask
            if isinstance(node.op, Dot):  # its columns are this k
                expr = self._dot(node, body, columns=axes[k_at])
            elif id(node) in accesses:
                n = accesses[id(node)]
                strides = leaf_view(node).strides[-2:]
                moves = [st != 0 if axis.stepped else self.space.strides[n][rank - 2 + p] != 0
                         for p, (axis, st) in enumerate(zip(axes, strides))]
                offset = "".join(f" + {axis.index}" + ("" if st == 1 else f" * {self._scalar(self._step_stride(n, p, k_at), st)}")
                                 for p, (axis, st) in enumerate(zip(axes, strides)) if axis.stepped and st)
                # (an address that does not move along a tile's kept axis is spread over it, as the mask is)
                full = ["1"] * (rank - 2) + [a.width if p != k_at or moves[p] else "1" for p, a in enumerate(axes)]
                spread = "" if moves[1 - k_at] else f" + tl.zeros(({', '.join(full)},), tl.int32)"
                if not moves[k_at]:
                    fixed.add(id(node))
                    lines, expr = before, f"tl.load({self._address(n)}{offset}{spread}, mask={kept.mask}, other=0.0)"
                else:
                    expr = f"tl.load({self._address(n)}{offset}{spread}, mask={mask}, other=0.0)"
            elif isinstance(node.op, Iota):  # coordinates on the tile (a causal mask's)
                expr = self._tile_coordinate(node, axes)
                if node.view.strides[len(node.shape) - 2 + k_at] == 0:
                    fixed.add(id(node))
                    lines = before
            elif is_kernel_input(node):  # a literal
                fixed.add(id(node))
                lines = before
                expr = self._value(node, names, before)
            else:
                # (a reduction's value is read from a buffer, or computed by the k loop's online form)
                assert isinstance(node.op, Elementwise), f"{node.op} in a product's operand"
                if all(id(s) in fixed for s in node.src):
                    fixed.add(id(node))
                    lines, node_mask = before, kept.mask
                expr = self._elementwise(node, [names[id(s)] for s in node.src], lines, node_mask)
            names[id(node)] = self._fresh()
            lines.append(f"{names[id(node)]} = {expr}")
        return names

    def _tile_coordinate(self, node: GraphNode, axes: tuple["TileAxis", "TileAxis"]) -> str:
        """An Iota's value on an operand's tile: its offset plus each index times its stride,
        the tile's own indices on its last two axes (the contraction's steps on one)."""
        # (the batch axes by their index in the kernel, which drops axes of size 1: the names
        # i0, i1, .. count the kept axes only)
        kept = [d for d in range(len(node.shape) - 2) if node.shape[d] != 1]
        indices = [(f"i{j}", node.view.strides[d]) for j, d in enumerate(kept)]
        indices += [(axis.index, st) for axis, st in zip(axes, node.view.strides[-2:])]
        terms = [f"tl.full([], {node.view.offset}, {'tl.int64' if self.int64 else 'tl.int32'})"]
        terms += [index if st == 1 else f"{index} * {st}" for index, st in indices if st]
        return f"({' + '.join(terms)}).to({tl_dtype(node.dtype)})"

    @staticmethod
    def _step_stride(n: int, position: int, k_at: int) -> str:
        """The name of access n's stride along a stepped tile axis: its own product's k, or
        (a nested product's b) the outer product's."""
        return f"a{n}_kstride" if position == k_at else f"a{n}_outer_kstride"

    def _store(self, store, n: int, names: dict[int, str]) -> list[str]:
        if isinstance(store.target, ScatterTarget):
            return self._scatter(store, n, names)
        return [self._store_var(store, n, names[id(store.value)])]

    def _scatter(self, store, n: int, names: dict[int, str]) -> list[str]:
        """Write (tl.store) or add (tl.atomic_add) each lane's value at its element offset. An
        offset of -1 (an index that was out of range) is reported through the status buffer
        and writes nothing."""
        op, ref = store.target.node.op, self.accesses[n].buffer
        offsets, value = (names[id(s)] for s in store.value.src)
        if store.value.dtype != ref.dtype:
            value = f"{value}.to({tl_dtype(ref.dtype)})"
        idx, lines, write = self._fresh(), [], "mask"
        lines.append(f"{idx} = tl.where(mask, {offsets}.to(tl.int64), 0)")  # (a block, even for one offset)
        if op.checked:
            self.checks.append(Check(IndexOutOfBoundsError, f"{op.what}: an index is out of bounds"))
            failed = f"(tl.where(mask, 1, 0) * tl.where({idx} < 0, 1, 0)) != 0"
            lines.append(f"tl.store({STATUS.param} + tl.where(mask, 0, 0), {len(self.checks)}, mask={failed})")
            write = self._fresh()
            lines.append(f"{write} = (tl.where(mask, 1, 0) * tl.where({idx} >= 0, 1, 0)) != 0")
        put = "tl.atomic_add" if op.accumulate else "tl.store"
        lines.append(f"{put}({ref.param} + tl.where({write}, {idx}, 0), {value}, mask={write})")
        return lines

    def _store_statistic(self, store, n: int) -> list[str]:
        """A row statistic the product's k loop computed (_online_tile), written by the
        programs of the first column tile only: each row once."""
        value = f"{self._online_rows[id(store.value)]}.to({tl_dtype(store.value.dtype)})"
        rank = len(self.space.sizes)
        dims = self.space.loop_dims
        assert all(d.axes == (a,) for a, d in enumerate(dims)), "a product kernel's axes are one loop dim each"
        row_shape = "[" + ", ".join([f"BLOCK_{a}" for a in range(rank - 1)] + ["1"]) + "]"
        rows = [f"(lin{a} < size{a})" for a in range(rank - 1)]
        if dims[-1].kind == "group":  # (a block: Triton's interpreter rejects a scalar term in a mask)
            rows.append(f"(tl.zeros({row_shape}, tl.int32) + tile{rank - 1} == 0)")
        mask = self._fresh()
        return [f"{mask} = {' & '.join(rows)}",
                f"tl.store({self._address(n)} + tl.zeros({row_shape}, tl.int32), {value}, mask={mask})"]

    def _store_var(self, store, n: int, value: str) -> str:
        dtype = self.accesses[n].buffer.dtype
        if store.value.dtype != dtype:
            value = f"{value}.to({tl_dtype(dtype)})"
        address = self._address(n)
        if self.red_dims and not any(self.space.strides[n]):  # one value per program: a 1-element block
            address += f" + tl.zeros({self._row_shape()}, tl.int32)"
        return f"tl.store({address}, {value}, mask={self._mask_for(n)})"


def _checks_index(node: GraphNode) -> bool:
    return isinstance(node.op, Elementwise) and op_def(node.op.op).checks_index


def _checked_division(node: GraphNode) -> bool:
    """An integer division or remainder whose divisor may be zero (a literal other than 0
    cannot): CPU eager raises ZeroDivisionError for those."""
    if not (isinstance(node.op, Elementwise) and op_def(node.op.op).divides) or node.dtype.is_float \
            or node.dtype is DType.bool:
        return False
    divisor = node.src[1]
    if isinstance(divisor.op, ViewOp) and isinstance(divisor.src[0].op, Const):
        divisor = divisor.src[0]
    return not isinstance(divisor.op, Const) or divisor.op.value == 0


def num_warps(space: IterationSpace, widest_itemsize: int) -> int:
    """Warps enough for each thread to compute `lanes_per_thread` elements, at most 8: long
    fused chains then fit in registers (8 fp32 per thread spilled on sm_90)."""
    per_thread = lanes_per_thread(widest_itemsize, len(space.strides))
    block = math.prod(d.width for d in space.loop_dims)
    return max(1, min(AUTO_WARPS, block // (32 * per_thread)))


EXACT_COUNT_LIMIT = 1 << 24


def _distinct_bytes(accesses: list[Access], passes: Optional[list[int]] = None) -> int:
    """Per buffer, the number of distinct addresses its accesses reach, times the item size
    and the number of passes a looped kernel makes over it. Counted exactly (the addresses
    are enumerated) up to EXACT_COUNT_LIMIT elements."""
    by_buffer: dict[int, list[Access]] = {}
    repeats: dict[int, int] = {}
    for k, a in enumerate(accesses):
        by_buffer.setdefault(id(a.buffer), []).append(a)
        repeats[id(a.buffer)] = max(repeats.get(id(a.buffer), 1), passes[k] if passes else 1)
    total = 0
    for key, group in by_buffer.items():
        itemsize = group[0].buffer.dtype.itemsize * repeats[key]
        if sum(math.prod(a.counted.shape) for a in group) > EXACT_COUNT_LIMIT:
            total += itemsize * max(_touched(a.counted) for a in group)  # estimate: the largest access
            continue
        addresses = [_addresses(a.counted) for a in group]
        total += itemsize * torch.cat(addresses).unique().numel()
    return total


def _addresses(view: View) -> torch.Tensor:
    shape = view.shape
    index = torch.zeros(shape, dtype=torch.int64) + view.offset
    for d, (size, stride) in enumerate(zip(shape, view.strides)):
        index += (torch.arange(size) * stride).view([size if k == d else 1 for k in range(len(shape))])
    return index.flatten()


def _touched(view: View) -> int:
    """Distinct elements a view reads: broadcast (stride-0) axes read their data once."""
    return math.prod(s for s, st in zip(view.shape, view.strides) if st != 0)

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

from ..ir import AxisStrategy, Const, DType, Elementwise, GraphNode, Input, View, ViewOp, toposort
from .elementwise import literal, render, tl_dtype
from .fusion import BufferTarget, InputTarget, KernelGroup, OutputTarget, buffer_of, expression_leaves, is_kernel_input
from .schedule import IterationSpace, LoopDim, schedule

INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class BufferRef:
    """A pointer argument: kind is "input" (by name), "output" (by name) or "buffer" (a node)."""
    kind: str
    name: str
    dtype: DType
    node: Optional[GraphNode] = None

    @property
    def param(self) -> str:
        prefix = {"input": "in_", "output": "", "buffer": ""}[self.kind]
        return prefix + "".join(c if c.isalnum() else "_" for c in self.name) + "_ptr"


@dataclass
class Access:
    buffer: BufferRef
    view: View  # over the kernel's logical shape
    store: bool


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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def bytes_read(self) -> int:
        """Bytes of distinct elements loaded: an element read through two views (x and
        x.flip(0)) or broadcast over many lanes counts once, as it comes from cache."""
        return _distinct_bytes([a for a in self.accesses if not a.store])

    @functools.cached_property
    def bytes_written(self) -> int:
        return _distinct_bytes([a for a in self.accesses if a.store])


def plan_kernel(group: KernelGroup, output_strides: dict[str, tuple[int, ...]],
                forced: Optional[Sequence[AxisStrategy]] = None) -> KernelPlan:
    return _Emitter(group, output_strides, forced).emit()


class _Emitter:
    def __init__(self, group: KernelGroup, output_strides, forced):
        self.group, self.shape = group, group.shape
        self.accesses: list[Access] = []
        self.buffers: dict[tuple, BufferRef] = {}
        self.leaf_access: dict[int, int] = {}
        self._collect(output_strides)
        self.widest = max(n.dtype.itemsize for s in group.stores for n in toposort([s.value], stop=is_kernel_input))
        self.space = schedule(self.shape, [a.view.strides for a in self.accesses], forced, self.store_access[0],
                              self.widest)
        self.lines: list[str] = []
        self.params: list[str] = [b.param for b in self.buffers.values()]
        self.scalar_args: list[int] = []
        self.int64 = self._needs_int64()

    # -- what the kernel touches --------------------------------------------------------
    def _buffer(self, kind: str, name: str, dtype: DType, node=None) -> BufferRef:
        key = (kind, name) if node is None else (kind, id(node))
        if key not in self.buffers:
            if node is not None:
                name = f"buf{sum(1 for k in self.buffers if k[0] == 'buffer')}"
            self.buffers[key] = BufferRef(kind, name, dtype, node)
        return self.buffers[key]

    def _buffer_for_node(self, base: GraphNode) -> BufferRef:
        if isinstance(base.op, Input):
            return self._buffer("input", base.op.name, base.dtype)
        return self._buffer("buffer", "", base.dtype, base)

    def _collect(self, output_strides):
        for store in self.group.stores:
            for leaf in expression_leaves(store.value):
                base = buffer_of(leaf)
                if base is None or id(leaf) in self.leaf_access:
                    continue
                view = leaf.view if isinstance(leaf.op, ViewOp) or isinstance(leaf.op, Input) else View.contiguous(leaf.shape)
                self.leaf_access[id(leaf)] = len(self.accesses)
                self.accesses.append(Access(self._buffer_for_node(base), view, False))
        self.store_access = []
        for store in self.group.stores:
            t = store.target
            if isinstance(t, OutputTarget):
                ref = self._buffer("output", t.name, store.value.dtype)
                view = View(self.shape, output_strides[t.name])
            elif isinstance(t, BufferTarget):
                ref, view = self._buffer_for_node(t.node), View.contiguous(self.shape)
            else:
                m = t.mutation
                ref, view = self._buffer("input", m.name, m.value.dtype), m.view
            self.store_access.append(len(self.accesses))
            self.accesses.append(Access(ref, view, True))

    def _needs_int64(self) -> bool:
        for a in self.accesses:
            reach = abs(a.view.offset) + sum((s - 1) * abs(st) for s, st in zip(a.view.shape, a.view.strides))
            if reach > INT32_LIMIT:
                return True
        return math.prod(self.shape) > INT32_LIMIT

    # -- source ---------------------------------------------------------------------------
    def emit(self) -> KernelPlan:
        body = self._body()
        constexprs = {f"BLOCK_{k}": d.width for k, d in enumerate(self.space.loop_dims)}
        params = self.params + [f"{name}: tl.constexpr" for name in constexprs]
        source = "\n".join(["@triton.jit", f"def KERNEL({', '.join(params)}):"] + ["    " + ln for ln in body])
        digest = hashlib.sha1(source.encode()).hexdigest()[:12]
        name = f"tjit_pointwise_{digest}"
        source = source.replace("def KERNEL(", f"def {name}(", 1)
        grid = math.prod(-(-self.space.sizes[d.axes[0]] // d.width) if len(d.axes) == 1 else
                         -(-math.prod(self.space.sizes[a] for a in d.axes) // d.width)
                         for d in self.space.loop_dims if d.kind == "group")
        return KernelPlan(name, source, list(self.buffers.values()), self.scalar_args, constexprs, (grid,),
                          self.shape, self.space, self.accesses, self.params, num_warps(self.space, self.widest))

    def _scalar(self, name: str, value: int) -> str:
        self.params.append(name)
        self.scalar_args.append(value)
        return name

    def _body(self) -> list[str]:
        sizes = [self._scalar(f"size{k}", s) for k, s in enumerate(self.space.sizes)]
        lines = ["pid = tl.program_id(0)" + (".to(tl.int64)" if self.int64 else "")]
        lines += self._grid_decomposition(sizes)
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

    def _extent(self, d: LoopDim, sizes) -> str:
        return " * ".join(sizes[a] for a in d.axes)

    def _grid_decomposition(self, sizes) -> list[str]:
        groups = [(k, d) for k, d in enumerate(self.space.loop_dims) if d.kind == "group"]
        lines = [f"# {d.describe()}" for d in self.space.loop_dims]
        for n, (k, d) in enumerate(reversed(groups)):
            tiles = f"tl.cdiv({self._extent(d, sizes)}, BLOCK_{k})"
            if n == len(groups) - 1:
                lines.append(f"tile{k} = pid")
            else:
                lines.append(f"tile{k} = pid % {tiles}")
                lines.append(f"pid = pid // {tiles}")
        return lines

    def _indices(self, sizes) -> list[str]:
        dims = self.space.loop_dims
        lines, masks = [], []
        for k, d in enumerate(dims):
            shape = ", ".join(":" if j == k else "None" for j in range(len(dims)))
            base = {"group": f"tile{k} * BLOCK_{k} + ", "loop": f"step{k} * BLOCK_{k} + ", "thread": ""}[d.kind]
            arange = f"tl.arange(0, BLOCK_{k})" + (".to(tl.int64)" if self.int64 else "")
            lines.append(f"lin{k} = {base}{arange}")
            if d.simd:  # groups of `simd` lanes start at multiples of simd: the width is a multiple of it
                lines.append(f"lin{k} = tl.max_contiguous(tl.multiple_of(lin{k}, {d.simd}), {d.simd})")
            if len(dims) > 1:
                lines.append(f"lin{k} = lin{k}[{shape}]")
            masks.append(f"(lin{k} < {self._extent(d, sizes)})")
            rest = f"lin{k}"
            for j, a in enumerate(reversed(d.axes)):
                if j == len(d.axes) - 1:
                    lines.append(f"i{a} = {rest}")
                else:
                    lines.append(f"i{a} = {rest} % {sizes[a]}")
                    lines.append(f"rest{k} = {rest} // {sizes[a]}")
                    rest = f"rest{k}"
        lines.append("mask = " + (" & ".join(masks) if masks else "True"))
        return lines

    def _address(self, n: int) -> str:
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
        pending = list(zip(self.group.stores, self.store_access))
        for node in toposort([s.value for s in self.group.stores], stop=is_kernel_input):
            var = f"v{len(names)}"
            names[id(node)] = var
            lines.append(f"{var} = {self._value(node, names)}")
            ready = [(s, n) for s, n in pending if s.value is node and not isinstance(s.target, InputTarget)]
            lines += [self._store(s, n, names) for s, n in ready]
            pending = [p for p in pending if p not in ready]
        return lines + [self._store(s, n, names) for s, n in pending]

    def _value(self, node: GraphNode, names: dict[int, str]) -> str:
        if id(node) in self.leaf_access:
            n = self.leaf_access[id(node)]
            # a load that no index reaches (a broadcast scalar) is one unmasked scalar load
            masked = ", mask=mask" if any(self.space.strides[n]) else ""
            return f"tl.load({self._address(n)}{masked})"
        if isinstance(node.op, Const) or (isinstance(node.op, ViewOp) and isinstance(node.src[0].op, Const)):
            const = node if isinstance(node.op, Const) else node.src[0]
            return literal(const.op.value, const.dtype)
        if isinstance(node.op, Elementwise):
            return render(node, [names[id(s)] for s in node.src])
        raise NotImplementedError(f"cannot fuse {node.op} into a pointwise kernel")

    def _store(self, store, n: int, names: dict[int, str]) -> str:
        value = names[id(store.value)]
        dtype = self.accesses[n].buffer.dtype
        if store.value.dtype != dtype:
            value = f"{value}.to({tl_dtype(dtype)})"
        return f"tl.store({self._address(n)}, {value}, mask=mask)"


def num_warps(space: IterationSpace, widest_itemsize: int) -> int:
    """One 128-bit vector of the widest type per thread and access (4 fp32, 2 fp64): long
    fused chains then fit in registers (8 fp32 per thread spilled on sm_90)."""
    per_thread = max(1, min(4, 16 // widest_itemsize))
    block = math.prod(d.width for d in space.loop_dims)
    return max(1, min(8, block // (32 * per_thread)))


EXACT_COUNT_LIMIT = 1 << 24


def _distinct_bytes(accesses: list[Access]) -> int:
    """Per buffer, the number of distinct addresses its accesses reach, times the item size.
    Counted exactly (the addresses are enumerated) up to EXACT_COUNT_LIMIT elements."""
    by_buffer: dict[int, list[Access]] = {}
    for a in accesses:
        by_buffer.setdefault(id(a.buffer), []).append(a)
    total = 0
    for group in by_buffer.values():
        itemsize = group[0].buffer.dtype.itemsize
        if sum(math.prod(a.view.shape) for a in group) > EXACT_COUNT_LIMIT:
            total += itemsize * max(_touched(a.view) for a in group)  # estimate: the largest access
            continue
        addresses = [_addresses(a.view) for a in group]
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

"""Convert a traced aten FX graph into a tjit Graph.

Three things happen here besides a per-op translation (the op table is in aten_ops.py):

* Views are pushed to the leaves. A movement op on an elementwise value is applied to
  its operands instead (elementwise ops commute with index remapping), so inside the IR
  a ViewOp only ever reads an Input, a Const or a materialised (Contiguous) buffer. When
  a reshape cannot be expressed on some operand's layout, that value is materialised.
* Values that live in an input's storage are always re-derived from the input's current
  version and the view torch reports for them, so reads after an in-place write see it.
* In-place writes into inputs become Mutations: the kernels store into the caller's
  tensor exactly where eager would.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import UnsupportedOpError
from ..ir import (Const, Contiguous, Cumulative, DType, Elementwise, Gather, GraphBuilder, GraphNode, Input, Mutation, Reduce,
                  View, ViewOp, Graph)

ViewFn = tuple  # ("permute", dims) etc.: a hashable description of a movement op


def apply_view_desc(view: View, desc: ViewFn) -> Optional[View]:
    kind, *args = desc
    return getattr(view, kind)(*args)


@dataclass(frozen=True)
class OutputSpec:
    """How the runtime produces one flattened output of the compiled function."""
    kind: str  # "computed" | "input_alias" | "output_alias" | "constant"
    name: str = ""  # graph output name (computed) or input name (input_alias)
    index: int = -1  # the aliased computed output (output_alias)
    shape: tuple = ()
    stride: tuple = ()
    offset: int = 0  # storage offset relative to the aliased tensor's
    value: Any = None  # constant outputs
    # computed outputs returned as a view of what the kernel writes (shape, stride, offset),
    # when the value is a view of a materialised buffer: the kernel writes the buffer's
    # dense layout straight into the output's memory instead of a second copy kernel
    view: Optional[tuple] = None


@dataclass
class Conversion:
    graph: Graph
    outputs: list[OutputSpec]
    output_tree: Any  # pytree spec of the outputs
    constants: dict[str, torch.Tensor]  # get_attr tensors, bound as extra inputs
    eager_ops: int  # kernels eager would launch: one per non-view aten op


def storage_key(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage()).cdata


class Converter:
    def __init__(self, gm: fx.GraphModule, input_names: list[str]):
        from .aten_ops import HANDLERS  # the op table imports Converter's helpers
        self.handlers = HANDLERS
        self.gm = gm
        self.b = GraphBuilder()
        self.env: dict[fx.Node, Any] = {}
        self.input_names = list(input_names)
        self.input_storage: dict[int, str] = {}
        self.input_meta: dict[str, torch.Tensor] = {}
        self.version: dict[str, int] = {}
        self.forwarded: dict[str, Optional[GraphNode]] = {}
        self.mutations: list[Mutation] = []
        self.constants: dict[str, torch.Tensor] = {}
        self._view_memo: dict[tuple, GraphNode] = {}
        self.current: Optional[fx.Node] = None

    # -- entry ---------------------------------------------------------------------
    def run(self) -> Conversion:
        nodes = list(self.gm.graph.nodes)
        self.position = {n: k for k, n in enumerate(nodes)}
        placeholders = [n for n in nodes if n.op == "placeholder"]
        for name, ph in zip(self.input_names, placeholders):
            self.add_placeholder(name, ph)
        for node in nodes:
            self.current = node
            if node.op == "get_attr":
                self.add_constant(node)
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                return self.finish(node)
        raise AssertionError("FX graph has no output node")

    def add_placeholder(self, name: str, ph: fx.Node):
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor):
            self.env[ph] = val  # python scalars were specialised by the tracer
            return
        self.input_storage[storage_key(val)] = name
        self.input_meta[name] = val
        self.version[name] = 0
        self.forwarded[name] = None
        self.env[ph] = self.b.input(name, DType.from_torch(val.dtype), View(tuple(val.shape), tuple(val.stride())))

    def add_constant(self, node: fx.Node):
        value = getattr(self.gm, node.target)
        if not isinstance(value, torch.Tensor):
            self.env[node] = value
            return
        name = f"_const{len(self.constants)}"
        self.constants[name] = value
        self.input_names.append(name)
        node.meta["val"] = value
        self.add_placeholder(name, node)

    def call(self, node: fx.Node):
        handler = self.handler_for(node)
        args = fx.node.map_arg(node.args, self.value)
        kwargs = fx.node.map_arg(node.kwargs, self.value)
        try:
            return handler(self, node, *args, **kwargs)
        except UnsupportedOpError as e:
            if e.target is None:  # tag the aten op, so trace() can find the user's line
                raise UnsupportedOpError(e.op, e.reason, e.where, node.target) from None
            raise

    def handler_for(self, node: fx.Node):
        packet = getattr(node.target, "overloadpacket", node.target)
        handler = self.handlers.get(node.target) or self.handlers.get(packet)
        if handler is not None:
            return handler
        name = getattr(packet, "__name__", "")
        functional = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
        if functional is not None and functional in self.handlers:
            # x.op_(...) is x = op(x, ...) written back into x's memory
            def in_place(cv, node, *args, **kwargs):
                return cv.assign(node.args[0], self.handlers[functional](cv, node, *args, **kwargs))
            return in_place
        raise UnsupportedOpError(str(node.target), "no IR translation for this op", target=node.target)

    # -- values ----------------------------------------------------------------------
    def meta(self, node: fx.Node) -> torch.Tensor:
        return node.meta["val"]

    def value(self, node: fx.Node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and storage_key(val) in self.input_storage:
            return self.read_input_storage(node, val)
        return self.env[node]

    def input_view(self, name: str, val: torch.Tensor) -> View:
        base = self.input_meta[name]
        if val.dtype != base.dtype:
            raise UnsupportedOpError("view(dtype)", f"reinterpreting {base.dtype} input {name!r} as {val.dtype}")
        return View(tuple(val.shape), tuple(val.stride()), val.storage_offset() - base.storage_offset())

    def read_input_storage(self, node: fx.Node, val: torch.Tensor) -> GraphNode:
        name = self.input_storage[storage_key(val)]
        view = self.input_view(name, val)
        base = self.input_meta[name]
        own = View(tuple(base.shape), tuple(base.stride()))
        if view == own and self.forwarded[name] is not None:
            return self.forwarded[name]
        src = self.b.input(name, DType.from_torch(base.dtype), own, self.version[name])
        return src if view == own else self.b.node(ViewOp(), src.dtype, (src,), view)

    # -- building blocks used by the op table ------------------------------------------
    def const(self, value, dtype: DType) -> GraphNode:
        return self.b.const(_coerce_scalar(value, dtype), dtype)

    def elementwise(self, op: str, operands: list[GraphNode], dtype: DType) -> GraphNode:
        shape = operands[0].shape
        assert all(o.shape == shape for o in operands), f"{op}: operand shapes differ {[o.shape for o in operands]}"
        return self.b.node(Elementwise(op), dtype, tuple(operands), View.contiguous(shape))

    def cast(self, node: GraphNode, dtype: DType) -> GraphNode:
        if node.dtype == dtype:
            return node
        if isinstance(node.op, Const):
            return self.const(node.op.value, dtype)
        return self.elementwise("cast", [node], dtype)

    def reduce(self, op: str, value: GraphNode, axes, dtype: Optional[DType] = None) -> GraphNode:
        """`op` over `axes` of value, keeping them as size-1 axes. Reducing only size-1 axes
        is the identity (argmax: index 0), so a Reduce node never has the shape of its input."""
        rank = len(value.shape)
        axes = tuple(sorted({a % rank for a in axes})) if rank else ()
        dtype = dtype or value.dtype
        if all(value.shape[a] == 1 for a in axes):
            return self.const(0, dtype) if op in ("argmax", "argmin") else self.cast(value, dtype)
        shape = tuple(1 if d in axes else s for d, s in enumerate(value.shape))
        return self.b.node(Reduce(op, axes), dtype, (value,), View.contiguous(shape))

    def scan(self, op: str, value: GraphNode, axis: int, dtype: Optional[DType] = None) -> GraphNode:
        """The running `op` of value along `axis` (same shape). Along a size-1 axis it is the
        identity (argmax: index 0)."""
        dtype = dtype or value.dtype
        if not value.shape or value.shape[axis % len(value.shape)] == 1:
            if op in ("argmax", "argmin"):
                return self.expand_to(self.const(0, dtype), value.shape)
            return self.cast(value, dtype)
        return self.b.node(Cumulative(op, axis % len(value.shape)), dtype, (value,), View.contiguous(value.shape))

    def gather(self, node: GraphNode, axis: int, index: GraphNode, wrap_negative: bool = False,
               what: str = "gather") -> GraphNode:
        """node[i with coordinate `axis` replaced by index[i]], shaped like index (whose other
        sizes are at most node's). Pushed through elementwise ops, like views, so the read
        lands on the leaves: a gathered log_softmax gathers its input and reuses the row
        values (cross-entropy stays one kernel)."""
        key = (id(node), "gather", axis, id(index), wrap_negative)
        found = self._view_memo.get(key)
        if found is None:
            found = self._view_memo[key] = self._gather_uncached(node, axis, index, wrap_negative, what)
        return found

    def _gather_uncached(self, node, axis, index, wrap_negative, what) -> GraphNode:
        shape = index.shape
        if isinstance(node.op, Elementwise):
            src = [self.gather(s, axis, index, wrap_negative, what) for s in node.src]
            return self.b.node(node.op, node.dtype, tuple(src), View.contiguous(shape))
        if isinstance(node.op, ViewOp) and node.view.strides[axis] == 0 and \
                isinstance(node.src[0].op, (Const, Reduce)):
            # a literal or a row value, constant along the axis: any in-range index reads the
            # same value (a broadcast input is still gathered, so its index is checked)
            view = View(shape, node.view.strides, node.view.offset)
            base = node.src[0]
            if view == base.view and isinstance(base.op, Reduce):
                return base
            return self.b.node(ViewOp(), node.dtype, (base,), view)
        if not (node.is_leaf and not isinstance(node.op, Const)) and not isinstance(node.op, Contiguous):
            node = self.materialize(node)
        return self.b.node(Gather(axis, wrap_negative, what), node.dtype, (node, index), View.contiguous(shape))

    def materialize(self, node: GraphNode) -> GraphNode:
        if isinstance(node.op, (Contiguous, Input, Const)):
            return node
        return self.b.node(Contiguous(), node.dtype, (node,), View.contiguous(node.shape))

    def view(self, node: GraphNode, desc: ViewFn) -> GraphNode:
        """Apply a movement op, pushing it through elementwise nodes to the leaves."""
        key = (id(node), desc)
        found = self._view_memo.get(key)
        if found is None:
            found = self._view_memo[key] = self._view_uncached(node, desc)
        return found

    def _view_uncached(self, node: GraphNode, desc: ViewFn) -> GraphNode:
        if isinstance(node.op, Elementwise):
            pushed = [self._try_view(s, desc) for s in node.src]
            if all(p is not None for p in pushed):
                shape = pushed[0].shape
                return self.b.node(node.op, node.dtype, tuple(pushed), View.contiguous(shape))
            node = self.materialize(node)
        if isinstance(node.op, ViewOp):
            new = apply_view_desc(node.view, desc)
            if new is not None:
                base = node.src[0]
                return base if new == base.view and isinstance(base.op, (Reduce, Gather)) else \
                    self.b.node(ViewOp(), node.dtype, node.src, new)
            node = self.materialize(node)
        if isinstance(node.op, Gather) and _only_unit_axes_change(node.shape, desc):
            # a gathered value squeezed or unsqueezed stays in registers (cross-entropy's row)
            return self.b.node(ViewOp(), node.dtype, (node,), apply_view_desc(node.view, desc))
        if not isinstance(node.op, (Input, Const, Contiguous, Reduce)):
            node = self.materialize(node)
        new = apply_view_desc(node.view, desc)
        if new is None:  # an input whose layout cannot be reshaped as a view: copy it dense
            node = self.b.node(Contiguous(), node.dtype, (node,), View.contiguous(node.shape))
            new = apply_view_desc(node.view, desc)
        return node if new == node.view else self.b.node(ViewOp(), node.dtype, (node,), new)

    def _try_view(self, node: GraphNode, desc: ViewFn) -> Optional[GraphNode]:
        if isinstance(node.op, (ViewOp, Input, Const, Contiguous, Reduce)):
            return None if apply_view_desc(node.view, desc) is None else self.view(node, desc)
        return self.view(node, desc)

    def expand_to(self, node: GraphNode, shape: tuple[int, ...]) -> GraphNode:
        shape = tuple(shape)
        if node.shape == shape:
            return node
        return self.view(node, ("expand", shape))

    # -- in-place writes ---------------------------------------------------------------
    def assign(self, target: fx.Node, value: GraphNode) -> GraphNode:
        """Write `value` into the tensor `target` as an in-place op does."""
        val = self.meta(target)
        value = self.expand_to(self.cast(value, DType.from_torch(val.dtype)), tuple(val.shape))
        key = storage_key(val)
        if key in self.input_storage:
            name = self.input_storage[key]
            view = self.input_view(name, val)
            self.materialize_readers_of(name)
            self.version[name] += 1
            self.mutations.append(Mutation(name, view, value, self.version[name]))
            base = self.input_meta[name]
            self.forwarded[name] = value if view == View(tuple(base.shape), tuple(base.stride())) else None
            return value
        for node in self.same_tensor_nodes(target, key):
            self.env[node] = value
        return value

    def materialize_readers_of(self, name: str) -> None:
        """Values computed from an input that is about to be overwritten, and still needed
        later, are materialised now: they must not be recomputed from the new contents."""
        here = self.position[self.current]
        for fx_node, value in list(self.env.items()):
            if not isinstance(value, GraphNode) or isinstance(value.op, (Input, Const)):
                continue
            if self.position[fx_node] < here and any(self.position[u] > here for u in fx_node.users) \
                    and _reads_input(value, name):
                self.env[fx_node] = self.materialize(value)

    def same_tensor_nodes(self, target: fx.Node, key: int) -> list[fx.Node]:
        """An in-place write into an intermediate rebinds it; other FX values that are the
        very same tensor are rebound too, and any other view of it read later is refused."""
        here, tval = self.position[self.current], self.meta(target)
        same = (tuple(tval.shape), tuple(tval.stride()), tval.storage_offset())
        found = [target]
        for other in self.gm.graph.nodes:
            val = other.meta.get("val")
            if other is target or not isinstance(val, torch.Tensor) or storage_key(val) != key:
                continue
            if (tuple(val.shape), tuple(val.stride()), val.storage_offset()) == same:
                found.append(other)
            elif any(self.position[u] > here for u in other.users):
                raise UnsupportedOpError(str(self.current.target),
                                         "in-place write into an intermediate tensor that other views still read")
        return found

    # -- outputs -------------------------------------------------------------------------
    def finish(self, out_node: fx.Node) -> Conversion:
        flat, tree = torch.utils._pytree.tree_flatten(out_node.args[0])
        outputs: dict[str, GraphNode] = {}
        specs: list[OutputSpec] = []
        computed_storage: dict[int, int] = {}
        for k, item in enumerate(flat):
            val = item.meta.get("val") if isinstance(item, fx.Node) else item
            if not isinstance(val, torch.Tensor):
                specs.append(OutputSpec("constant", value=self.env.get(item, item) if isinstance(item, fx.Node) else item))
                continue
            key = storage_key(val)
            layout = dict(shape=tuple(val.shape), stride=tuple(val.stride()))
            if key in self.input_storage:
                name = self.input_storage[key]
                rel = self.input_view(name, val).offset
                specs.append(OutputSpec("input_alias", name=name, offset=rel, **layout))
            elif key in computed_storage:
                j = computed_storage[key]
                specs.append(OutputSpec("output_alias", index=j, offset=val.storage_offset(), **layout))
            else:
                name = f"out{k}"
                value = self.value(item)
                if _is_dense_view_of_buffer(value, val):
                    base = value.src[0]
                    outputs[name] = base.src[0]
                    specs.append(OutputSpec("computed", name=name, shape=base.shape, stride=base.view.strides,
                                            view=(layout["shape"], layout["stride"], value.view.offset)))
                    continue
                outputs[name] = value
                if _covers_storage(val):  # later outputs in the same storage become views of it
                    computed_storage[key] = k
                specs.append(OutputSpec("computed", name=name, **layout))
        graph = self.b.finish(self.input_names, outputs, self.mutations)
        return Conversion(graph, specs, tree, self.constants, count_eager_kernels(self.gm))


def _only_unit_axes_change(shape, desc: ViewFn) -> bool:
    """The movement op only inserts or removes size-1 axes."""
    view = apply_view_desc(View.contiguous(tuple(shape)), desc)
    return view is not None and [s for s in view.shape if s != 1] == [s for s in shape if s != 1] \
        and view.offset == 0


def _reads_input(value: GraphNode, name: str) -> bool:
    stack, seen = [value], set()
    while stack:
        node = stack.pop()
        if isinstance(node.op, Input) and node.op.name == name:
            return True
        if id(node) not in seen and not isinstance(node.op, Contiguous):
            seen.add(id(node))
            stack.extend(node.src)
    return False


def count_eager_kernels(gm: fx.GraphModule) -> int:
    """Eager runs one kernel per aten op that writes memory; pure views write nothing."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val, first = node.meta.get("val"), node.args[0] if node.args else None
        src = first.meta.get("val") if isinstance(first, fx.Node) else None
        inplace = getattr(getattr(node.target, "overloadpacket", None), "__name__", "").endswith("_")
        is_view = isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor) and \
            storage_key(val) == storage_key(src) and not inplace
        count += not is_view
    return count


def _is_dense_view_of_buffer(value: GraphNode, val: torch.Tensor) -> bool:
    """A view of a Contiguous buffer with eager's strides for this output (so the buffer's
    memory, viewed, is exactly the tensor eager returns)."""
    return (isinstance(value.op, ViewOp) and isinstance(value.src[0].op, Contiguous) and val.numel() > 0
            and value.view.strides == tuple(val.stride()))


def _covers_storage(val: torch.Tensor) -> bool:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(val.shape, val.stride())) if val.numel() else 0
    return val.storage_offset() == 0 and extent * val.element_size() >= val.untyped_storage().nbytes()


def _coerce_scalar(value, dtype: DType):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if dtype is DType.bool:
        return bool(value)
    if dtype.is_int:
        return int(value)
    return float(value)

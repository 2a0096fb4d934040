"""Convert a traced aten FX graph into a tjit Graph.

Three things happen here besides a per-op translation (the op table is in aten_ops.py):

* Views are pushed to the leaves (build.py): inside the IR a ViewOp only ever reads an
  Input, a Const or a materialised buffer.
* Values that live in an input's storage are always re-derived from the input's current
  version and the view torch reports for them, so reads after an in-place write see it.
* In-place writes into inputs become Mutations: the kernels store into the caller's
  tensor exactly where eager would.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..analysis.addresses import disjoint, pairwise_disjoint, within
from ..errors import DataDependentError, LayoutError, UnsupportedOpError
from ..ir import (Const, Contiguous, DType, Elementwise, Extern, ExternCall, Graph, GraphNode, Input, Mutation, Operand,
                  View, ViewOp, nested_axes, toposort)
from .build import ValueBuilder
from .library import WriteThroughView, in_memory, library_call, view_of_contents
from .scalars import (RuntimeScalar, arithmetic, is_arithmetic, is_symbolic_number, read_number,
                      with_runtime_numbers)
from .overlap import (WRITES_OF_ONE_CONSTANT, addressed_once, check_in_place, check_no_overlap_at_all,
                      is_non_overlapping_and_dense)

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
    device: str = ""  # the device type of a tensor output in the trace (a call's 0-d CPU tensors: see compiled.py)
    # computed outputs returned as a view of what the kernel writes (shape, stride, offset),
    # when the value is a view of a materialised buffer: the kernel writes the buffer's
    # dense layout straight into the output's memory instead of a second copy kernel
    view: Optional[tuple] = None
    # a computed output of a type no kernel writes (complex, uint64): the kernel writes its
    # bits as another type (Converter.carrier), and the output is returned as this dtype
    returned_as: Optional[torch.dtype] = None
    # an alias returned with its values lazily conjugated or negated (conj() of an input):
    # the bits eager's view carries
    conj: bool = False
    neg: bool = False

    def with_lazy_bits(self, view: torch.Tensor) -> torch.Tensor:
        """An alias view with the conjugate and negative bits this output has."""
        if view.is_conj() != self.conj:
            view = view.conj()
        if view.is_neg() != self.neg:
            view = torch._neg_view(view)
        return view

    def returned(self, out: torch.Tensor) -> torch.Tensor:
        """The computed output as the function returns it, from what the kernel wrote."""
        if self.returned_as is None:
            return out
        return torch.view_as_complex(out) if self.returned_as.is_complex else out.view(self.returned_as)


@dataclass
class Conversion:
    graph: Graph
    outputs: list[OutputSpec]
    output_tree: Any  # pytree spec of the outputs
    constants: dict[str, torch.Tensor]  # get_attr tensors, bound as extra inputs
    eager_ops: int  # kernels eager would launch: one per non-view aten op
    gradient_unknown: Optional[tuple] = None  # (error type, reason): what the trace saw that tjit's backward cannot follow
    matmul_choices: list = field(default_factory=list)  # frontend/matmul.py MatmulChoice, per product
    # arguments in one storage that are one input (Converter.storage_owner)
    shared_inputs: list = field(default_factory=list)
    # inputs requiring grad that the function writes in place (trace._write_back): each is a
    # result of the differentiable call too, its new contents the value of its one mutation
    written_grad_inputs: tuple[str, ...] = ()
    returned_written: dict[int, str] = field(default_factory=dict)  # result position -> the written input it is

    # (pickled into the disk cache, runtime/disk_cache.py: the outputs' pytree spec as an
    # example tree with ints for leaves, its containers being what pickle knows how to write)
    def __getstate__(self) -> dict:
        example = torch.utils._pytree.tree_unflatten(range(self.output_tree.num_leaves), self.output_tree)
        return {**self.__dict__, "output_tree": example}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, output_tree=torch.utils._pytree.tree_structure(state["output_tree"]))


def storage_key(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage()).cdata


class Converter(ValueBuilder):
    is_gradient_formula = False  # (FormulaConverter: a library call's derivative formula)

    def __init__(self, gm: fx.GraphModule, input_names: list[str], requires_grad: frozenset = frozenset()):
        """requires_grad: the inputs (by name) that get a gradient."""
        from .aten_ops import HANDLERS  # the op table imports Converter's helpers
        self.handlers = HANDLERS
        super().__init__()
        self.gm = gm
        self.env: dict[fx.Node, Any] = {}
        self.input_names = list(input_names)
        self.requires_grad = frozenset(requires_grad)
        self._reads_grad: dict[int, bool] = {}  # node -> whether it reads an input in requires_grad
        self.input_storage: dict[int, str] = {}
        # arguments that share a storage: all of them, by storage; and the storages whose
        # arguments stay apart, each its own input (Converter.storage_owner)
        self.storage_inputs: dict[int, list[str]] = {}
        self.apart: dict[int, bool] = {}
        self.placeholder_names: dict[fx.Node, str] = {}
        self._copy_needed: dict[str, bool] = {}  # per input: read through a copy (_read_as_copy)
        self._copies_of_inputs: dict[str, GraphNode] = {}
        self.input_meta: dict[str, torch.Tensor] = {}
        self.version: dict[str, int] = {}
        # per input: the value last written through each view no later write has touched,
        # which a read through that very view takes instead of reading memory
        self.forwarded: dict[str, dict[View, GraphNode]] = {}
        self.written_views: dict[str, list[View]] = {}  # per input: the view of each write, in order
        self.mutations: list[Mutation] = []
        self.effects: list[GraphNode] = []  # library calls that return nothing (checks)
        self.matmul_choices: list = []  # how each product is computed (frontend/matmul.py)
        # intermediate storages written through a view while other views of them are read
        # later: storage key -> its current contents, a flat buffer read through each view
        self.storages: dict[int, GraphNode] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.current: Optional[fx.Node] = None
        # per argument an in-place view op changed the shape of (x.unsqueeze_(0)): the node of its last shape
        self.argument_layouts: dict[str, fx.Node] = {}

    # -- entry ---------------------------------------------------------------------
    def run(self) -> Conversion:
        nodes = list(self.gm.graph.nodes)
        self.position = {n: k for k, n in enumerate(nodes)}
        placeholders = [n for n in nodes if n.op == "placeholder"]
        for name, ph in zip(self.input_names, placeholders):
            self.add_placeholder(name, ph)
        for node in nodes:
            self.current = node
            _check_layout(node)
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
        self.storage_inputs.setdefault(storage_key(val), []).append(name)
        self.placeholder_names[ph] = name
        self.input_meta[name] = val
        self.version[name] = 0
        self.forwarded[name] = {}
        self.written_views[name] = []
        self.env[ph] = self.b.input(name, DType.from_torch(val.dtype), View(tuple(val.shape), tuple(val.stride())))

    def add_constant(self, node: fx.Node):
        value = getattr(self.gm, node.target)
        if not isinstance(value, torch.Tensor):
            self.env[node] = value
            return
        known = self.input_storage.get(storage_key(value))
        if known is not None and self.input_meta[known].dtype == value.dtype:
            # make_fx reads an attribute anew at each use: every read of its memory (an input's,
            # or an earlier constant's) is one input, whose in-place writes later reads see
            node.meta["val"] = value
            self.env[node] = self.read_input_storage(node, value)
            return
        name = f"_const{len(self.constants)}"
        self.constants[name] = value
        self.input_names.append(name)
        node.meta["val"] = value
        self.add_placeholder(name, node)

    def call(self, node: fx.Node):
        args = fx.node.map_arg(node.args, self.value)
        kwargs = fx.node.map_arg(node.kwargs, self.value)
        if node.target is torch.ops.aten._local_scalar_dense.default:
            if "val" not in node.meta and not node.users:
                # a number read from a tensor the function made from Python numbers
                # (`torch.div(12, 4)` as a size): the trace computed it and used its value
                return None
            return read_number(self, args[0], node.meta["val"])
        if node.target in AS_STRIDED and self._of_a_computed_storage(node):
            return self.read_computed_storage(node.meta["val"])
        if is_arithmetic(node.target):
            return arithmetic(self, node, *args)
        handler = self.handler_for(node)
        args, kwargs = with_runtime_numbers(node, args, kwargs)
        if any(is_symbolic_number(a) for a in torch.utils._pytree.tree_flatten((args, kwargs))[0]):
            raise UnsupportedOpError(str(node.target), "an argument is a Python number computed from tensor data "
                                     "(.item(), .tolist()): tjit compiles no data-dependent values yet",
                                     target=node.target)
        try:
            return handler(self, node, *args, **kwargs)
        except UnsupportedOpError as e:
            if e.target is None:  # tag the aten op, so trace() can find the user's line
                raise UnsupportedOpError(e.op, e.reason, e.where, node.target) from None
            raise

    def handler_for(self, node: fx.Node):
        if torch.Tag.out in getattr(node.target, "tags", ()):  # (the others are rewritten: out_variants.py)
            raise UnsupportedOpError(str(node.target), "an out= form tjit knows no functional form of",
                                     target=node.target)
        if _computes_library_dtype(node):
            return _library(node.target)
        packet = getattr(node.target, "overloadpacket", node.target)
        handler = self.handlers.get(node.target) or self.handlers.get(packet) or \
            self.handlers.get(getattr(packet, "_qualified_op_name", None))
        if handler is not None:
            return handler
        overload = functional_overload(node.target)
        if overload is not None:
            # x.op_(...) is x = op(x, ...) written back into x's memory
            handler = self.handlers.get(overload) or self.handlers.get(overload.overloadpacket) or _library(overload)

            def compute(cv, node, *args, **kwargs):
                # (the functional op's handler tells its ops apart by node.target: clamp_max from
                # clamp_min, cumsum from cumprod, scatter_add from scatter)
                with _targeting(node, overload):
                    return handler(cv, node, *args, **kwargs)

            def in_place(cv, node, *args, **kwargs):
                return cv.assign(node.args[0], compute(cv, node, *args, **kwargs))

            def in_place_view(cv, node, *args, **kwargs):
                # x.squeeze_(0) changes x's shape, not its data: the result is the view (make_fx
                # routes later uses through this node)
                cv.note_layout_change(node)
                return compute(cv, node, *args, **kwargs)
            return in_place_view if torch.Tag.inplace_view in node.target.tags else in_place
        return _library(node.target)  # an op with no functional form is functionalised by the call

    # -- values ----------------------------------------------------------------------
    def meta(self, node: fx.Node) -> torch.Tensor:
        return node.meta["val"]

    def value(self, node: fx.Node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and (val.is_conj() or val.is_neg()):
            return self.env[node]  # a lazily conjugated (negated) view: a library call made its values
        in_input = isinstance(val, torch.Tensor) and storage_key(val) in self.input_storage
        name = self.storage_owner(node, val) if in_input else None
        if name is not None and val.dtype == self.input_meta[name].dtype:
            if self._read_as_copy(name):
                return self._logical_copy(name) if self.placeholder_names.get(node) == name else self.env[node]
            return self._read_through(node, self.read_input_storage(node, val))
        if isinstance(val, torch.Tensor) and storage_key(val) in self.storages:
            return self._read_through(node, self.read_storage(val))
        return self.env[node]

    def _read_through(self, node: fx.Node, found: GraphNode) -> GraphNode:
        """A read of memory (an input's, or a written intermediate storage's contents, which
        carry the gradients of what wrote them) as the node reads it: without a gradient
        through a view of x.detach()."""
        if found.dtype.is_float and self._detached(node):
            return self.elementwise("stop_gradient", [found], found.dtype)
        return found

    def _detached(self, node: fx.Node) -> bool:
        """The value is read through a detach (x.detach().t(), ...): it carries no gradient.
        Followed back through the tensors the node's memory comes from (_memory_source): an
        in-place op's other operands (`y.add_(y.detach())`) are not what it returns."""
        while node is not None:
            if node.target is torch.ops.aten.detach.default:
                return True
            node = _memory_source(node)
        return False

    def input_view(self, name: str, val: torch.Tensor) -> View:
        base = self.input_meta[name]
        if val.dtype != base.dtype:
            raise UnsupportedOpError("view(dtype)", f"reinterpreting {base.dtype} input {name!r} as {val.dtype}")
        return View(tuple(val.shape), tuple(val.stride()), val.storage_offset() - base.storage_offset())

    def _read_as_copy(self, name: str) -> bool:
        """An input that requires grad and whose axes do not nest (its elements share memory:
        an expanded tensor, overlapping windows; or its strides interleave) is read once, into
        a buffer of its own logical layout, and its views are views of that copy: a view's
        gradient is then laid out by the input's elements, not by its memory, where two
        elements may be one (eager's gradient is per element)."""
        if name not in self._copy_needed:
            meta = self.input_meta[name]
            self._copy_needed[name] = name in self.requires_grad and meta.numel() > 0 and \
                not DType.from_torch(meta.dtype).library_only and \
                nested_axes(View(tuple(meta.shape), tuple(meta.stride()))) is None  # (complex: see autograd/complex.py)
        return self._copy_needed[name]

    def _logical_copy(self, name: str) -> GraphNode:
        if name not in self._copies_of_inputs:
            source = self.read_input_storage(None, self.input_meta[name])
            self._copies_of_inputs[name] = self.b.node(Contiguous(), source.dtype, (source,),
                                                       View.contiguous(source.shape))
        return self._copies_of_inputs[name]

    def storage_owner(self, node: Optional[fx.Node], val: torch.Tensor) -> str:
        """The input whose memory `val` (the value of `node`) is in. Arguments that share a
        storage are one input, so that reads after a write through one see the write, unless
        they stay apart: the function writes nothing into that storage, or their memory is
        disjoint (exactly, analysis/addresses.py). Then each view is its own argument's, the
        one its view ops lead back to, and each argument gets a gradient of its own."""
        key = storage_key(val)
        names = self.storage_inputs[key]
        if len(names) == 1 or not self._apart(key):
            return self.input_storage[key]
        name = self._argument_of(node)
        if name is None:  # (no view op leads back: an attribute of the module in that memory)
            within_ones = [n for n in names if within(_absolute_view(val), _absolute_view(self.input_meta[n]))]
            name = within_ones[0] if len(within_ones) == 1 or not self.requires_grad & set(names) else None
        if name is None or not within(_absolute_view(val), _absolute_view(self.input_meta[name])):
            raise UnsupportedOpError(str(node.target) if node is not None else "a view",
                                     f"a view of arguments {names} (one storage) whose memory is not one argument's")
        return name

    def _apart(self, key: int) -> bool:
        if key not in self.apart:
            metas = [self.input_meta[n] for n in self.storage_inputs[key]]
            self.apart[key] = len({m.dtype for m in metas}) == 1 and (
                key not in _written_storages(self.gm) or pairwise_disjoint([_absolute_view(m) for m in metas]))
        return self.apart[key]

    def _argument_of(self, node: Optional[fx.Node]) -> Optional[str]:
        """The argument a view is taken from, following its view ops (and the
        in-place ops that return their first argument) back."""
        while node is not None and (source := _memory_source(node)) is not None:
            node = source
        return self.placeholder_names.get(node)

    def shared_inputs(self) -> list[list[str]]:
        """Arguments that share a storage and are one input to the kernels."""
        return [names for key, names in self.storage_inputs.items() if len(names) > 1 and not self._apart(key)]

    def read_input_storage(self, node: fx.Node, val: torch.Tensor) -> GraphNode:
        name = self.storage_owner(node, val)
        view = self.input_view(name, val)
        base = self.input_meta[name]
        own = View(tuple(base.shape), tuple(base.stride()))
        if view in self.forwarded[name]:
            return self.forwarded[name][view]
        src = self.b.input(name, DType.from_torch(base.dtype), own, self.version_holding(name, view))
        return src if view == own else self.b.node(ViewOp(), src.dtype, (src,), view)

    def version_holding(self, name: str, view: View) -> int:
        """The oldest version of the input whose contents under `view` are its current ones:
        writes since then reached none of the view's addresses (x[:, ::2].mul_(2) leaves
        x[:, 1::2] as it was), so reading that version ties the read to none of them."""
        version = self.version[name]
        while version and disjoint(view, self.written_views[name][version - 1]):
            version -= 1
        return version

    # -- in-place writes ---------------------------------------------------------------
    def assign(self, target: fx.Node, value: GraphNode) -> GraphNode:
        """Write `value` into the tensor `target` as an in-place op does."""
        val = self.meta(target)
        check_in_place(str(self.current.target), val, self._tensor_operands(self.current, skip=target))
        if isinstance(self.current.target, torch._ops.OpOverload):
            check_no_overlap_at_all(self.current.target, val, self._tensor_operands(self.current, skip=target,
                                                                                    written_too=True))
        value = self.expand_to(self.cast(value, DType.from_torch(val.dtype)), tuple(val.shape))
        written, written_value = val, value
        if str(self.current.target) in WRITES_OF_ONE_CONSTANT and value.is_literal:
            # a fill of an expanded view writes its number once to each address the view holds
            written = addressed_once(val)
            literal = value.src[0] if isinstance(value.op, ViewOp) else value
            written_value = self.expand_to(literal, tuple(written.shape))
        key = storage_key(val)
        # a write through x.detach() is not seen by eager's autograd: x's later reads pass their
        # gradient to x's history, not to what was written (reads through the detached view do)
        unseen = value.dtype.is_float and self._detached(target)
        if key in self.input_storage:
            name = self.storage_owner(target, val)
            self._check_input_write(name, key)
            if unseen and self._carries_gradient(value):  # (eager: only that detached tensor carries it)
                raise UnsupportedOpError(str(self.current.target), f"an in-place write through x.detach() of values "
                                         f"that carry a gradient into input {name!r}")
            view = self.input_view(name, written)
            self.materialize_readers_of(name, view)
            self.version[name] += 1
            self.written_views[name].append(view)
            self.mutations.append(Mutation(name, view, written_value, self.version[name], unseen))
            self.forwarded[name] = {v: known for v, known in self.forwarded[name].items()
                                    if disjoint(v, view) and not _reads_input(known, name, view)}
            if not (unseen and name in self.requires_grad):
                # (a leaf written under no_grad is read back from memory: that read passes its
                # gradient to the leaf, and the backward can read it there too)
                self.forwarded[name][view] = written_value
            return value
        if val.numel() and (key in self.storages or self._other_views_read_later(target, key)):
            contents = self.storage_after_write(written, key, written_value)
            if unseen:
                contents = self._written_unseen(key, contents, value)
            self.storages[key] = contents
            return value
        for node in self.same_tensor_nodes(target, key):
            before = self.env.get(node)
            if node is target or not value.dtype.is_float:
                self.env[node] = value
            elif self._detached(node):  # (another tensor read through x.detach(): the values, not their gradient)
                self.env[node] = self.elementwise("stop_gradient", [value], value.dtype)
            elif unseen and before is not None:
                self.env[node] = self.straight_through(before, value)
            else:
                self.env[node] = value
        return value

    def _written_unseen(self, key: int, contents: GraphNode, value: GraphNode) -> GraphNode:
        """An intermediate storage's contents after a write through x.detach() (see assign):
        the new contents, whose gradient goes to the old."""
        before = self.storages.get(key)
        if before is None:
            before = self._owner_contents(key)
        if self._carries_gradient(value):  # (their gradient reaches only the detached tensor's later
            # reads, which read the contents here)
            raise UnsupportedOpError(str(self.current.target), "an in-place write through x.detach() of values that "
                                     "carry a gradient into an intermediate that other views read")
        if before is None:
            raise UnsupportedOpError(str(self.current.target), "an in-place write through x.detach() into an "
                                     "intermediate that other views read, whose storage no tensor of the trace "
                                     "holds whole")
        return in_memory(self, self.straight_through(before, contents))

    def straight_through(self, before: GraphNode, after: GraphNode) -> GraphNode:
        """The contents `after` a write eager's autograd does not see, whose gradient goes to
        the contents `before` it."""
        return self.elementwise("straight_through", [before, after], after.dtype)

    def _check_input_write(self, name: str, key: int) -> None:
        """Writes into an input that only library calls can compute, or that the function
        also reads as another dtype (a library call's copy, which would not see the write),
        are refused."""
        dtype = self.input_meta[name].dtype
        if DType.from_torch(dtype).library_only:
            raise UnsupportedOpError(str(self.current.target), f"an in-place write into {dtype} input {name!r}: tjit "
                                     "computes that type in library calls only, which write no inputs yet")
        if any(n.meta["val"].dtype != dtype for n in self._storage_nodes(key)):
            raise UnsupportedOpError(str(self.current.target), f"an in-place write into input {name!r}, which the "
                                     "function also reads as another dtype (view_as_real, view_as_complex, "
                                     "view(dtype))")

    def settle_writes_before_check(self) -> None:
        """A check (a call that returns nothing) runs after the input writes eager makes before
        it and before those it makes after (fusion levels, ExternCall.versions). So no value
        read after the check may still compute from an input as it was before a write that
        precedes the check (a write after the check would have to wait for that read, which
        waits for the write): such values are materialised now, and later reads of a written
        input read its memory."""
        for name, version in self.version.items():
            if version:
                self.materialize_readers_of(name)
                self.forwarded[name] = {}

    def _tensor_operands(self, node: fx.Node, skip: fx.Node, written_too: bool = False) -> list[torch.Tensor]:
        """The tensors an FX node reads, other than `skip` (the tensor it writes, its first
        argument): with written_too, `skip` read as another argument too."""
        found = []
        flat, _ = torch.utils._pytree.tree_flatten((node.args[1:] if written_too else node.args, node.kwargs))
        for arg in flat:
            val = arg.meta.get("val") if isinstance(arg, fx.Node) and (written_too or arg is not skip) else None
            if isinstance(val, torch.Tensor):
                found.append(val)
        return found

    def materialize_readers_of(self, name: str, written: Optional[View] = None) -> None:
        """Values computed from an input that is about to be overwritten (through `written`;
        anywhere, without it), and still needed later, are materialised now: they must not be
        recomputed from the new contents. Values that read none of the written addresses
        keep computing from the input."""
        here = self.position[self.current]
        for fx_node, value in list(self.env.items()):
            if not isinstance(value, GraphNode) or isinstance(value.op, (Input, Const)):
                continue
            if self.position[fx_node] < here and any(self.position[u] > here for u in fx_node.users) \
                    and _reads_input(value, name, written):
                self.env[fx_node] = self.materialize(value)

    def same_tensor_nodes(self, target: fx.Node, key: int) -> list[fx.Node]:
        """An in-place write into an intermediate that no other view of reads later rebinds
        it, and the other FX values that are the very same tensor."""
        same = _layout(self.meta(target))
        return [target] + [other for other in self._storage_nodes(key)
                           if other is not target and _layout(other.meta["val"]) == same]

    def _storage_nodes(self, key: int) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes
                if isinstance(n.meta.get("val"), torch.Tensor) and storage_key(n.meta["val"]) == key]

    def _other_views_read_later(self, target: fx.Node, key: int) -> bool:
        here, same = self.position[self.current], _layout(self.meta(target))
        return any(_layout(n.meta["val"]) != same and any(self.position[u] > here for u in n.users)
                   for n in self._storage_nodes(key))

    # -- intermediate storages written through views -----------------------------------------
    # As functionalisation does: the storage's contents are a value (a flat buffer); a write
    # through a view makes a new one (a library call, WriteThroughView), and every later read
    # of any view of the storage reads that view of the newest contents.
    def read_storage(self, val: torch.Tensor) -> GraphNode:
        flat = self.storages[storage_key(val)]
        if val.dtype != flat.dtype.torch:
            raise UnsupportedOpError("view(dtype)", f"reinterpreting a written {flat.dtype!r} intermediate as "
                                     f"{val.dtype}")
        return view_of_contents(self.b, flat, View(tuple(val.shape), tuple(val.stride()), val.storage_offset()))

    def _of_a_computed_storage(self, node: fx.Node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and storage_key(val) not in self.input_storage and \
            not DType.from_torch(val.dtype).library_only

    def read_computed_storage(self, val: torch.Tensor) -> GraphNode:
        """A view that addresses a computed value's storage (as_strided of a slice of it:
        fill_diagonal_ of `block[0]`), read from the storage's contents, written to memory."""
        key = storage_key(val)
        if key not in self.storages:
            contents = self._owner_contents(key)
            if contents is None or contents.dtype.torch != val.dtype:
                raise UnsupportedOpError("aten.as_strided", "a view of a computed value's storage that no tensor "
                                         "of the trace holds all of (or holds as another dtype)")
            self.storages[key] = contents
        return self.read_storage(val)

    def _owner_contents(self, key: int) -> Optional[GraphNode]:
        """The flat contents of an intermediate's storage, from a tensor computed before the
        current node that covers all of it densely; None if there is none."""
        owner = next((n for n in self._storage_nodes(key) if self.position.get(n, -1) < self.position[self.current]
                      and _covers_storage(n.meta["val"]) and is_non_overlapping_and_dense(n.meta["val"])), None)
        return None if owner is None else self.flat(self.env[owner], owner.meta["val"])

    def storage_after_write(self, val: torch.Tensor, key: int, value: GraphNode) -> GraphNode:
        """The storage's contents after `value` is written through the view `val`."""
        if _covers_storage(val) and is_non_overlapping_and_dense(val):
            return self.flat(value, val)  # the whole storage is written
        base = self.storages.get(key)
        if base is None:
            base = self._owner_contents(key)
            if base is None:
                raise UnsupportedOpError(str(self.current.target), "in-place write into an intermediate tensor that "
                                         "other views still read, and no tensor of the trace holds all its storage")
        if base.dtype.torch != val.dtype:  # (the write's view counts in its own type's units)
            raise UnsupportedOpError(str(self.current.target), f"an in-place write through a {val.dtype} view of a "
                                     f"{base.dtype.torch} intermediate (x.real of a complex tensor)")
        # kernels write a box of the storage: a select between the old contents and a window of
        # the value (not yet where a gradient flows through the write: the gradient of each later
        # read of a view of the contents is an indexed read of its own, and a chain of such writes
        # makes backward kernels with hundreds of stores; nor complex values: calls only)
        write = WriteThroughView(tuple(val.shape), tuple(val.stride()), val.storage_offset())
        if not base.dtype.is_complex and not self.reads_grad_inputs(base, value) and write.box(base.shape[0]):
            return write.as_kernels(self, base, value)
        return write.as_call(self, base, value)

    def reads_grad_inputs(self, *values: GraphNode) -> bool:
        """Whether a gradient may flow through these values: they read an input that gets one.
        (Memoised per node: a loop of writes asks it of ever longer chains.)"""
        if not self.requires_grad:
            return False
        known = self._reads_grad
        for n in toposort(values, stop=lambda n: id(n) in known):
            if id(n) not in known:
                known[id(n)] = isinstance(n.op, Input) and n.op.name in self.requires_grad or \
                    any(known[id(s)] for s in n.src)
        return any(known[id(v)] for v in values)

    def _carries_gradient(self, value: GraphNode) -> bool:
        """Whether the value carries a gradient as eager's tensor would (requires grad): it is
        computed from an input that gets one, other than through a stop_gradient or a value
        of a type without gradients (a comparison's)."""
        stopped = lambda n: not (n.dtype.is_float or n.dtype.is_complex) or \
            isinstance(n.op, Elementwise) and n.op.op == "stop_gradient"  # noqa: E731
        return any(isinstance(n.op, Input) and n.op.name in self.requires_grad and not stopped(n)
                   for n in toposort([value], stop=stopped))

    def flat(self, value: GraphNode, val: torch.Tensor) -> GraphNode:
        """A dense value laid out as `val` is in its storage, as the storage's flat contents."""
        order = sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))  # outermost first
        permuted = self.view(value, ("permute", tuple(order)))
        return in_memory(self, self.view(permuted, ("reshape", (val.numel(),))))

    # -- outputs -------------------------------------------------------------------------
    def carrier(self, value: GraphNode, val: torch.Tensor) -> tuple[GraphNode, dict]:
        """A result of a type only library calls compute, as a value of a type kernels can
        copy, and its layout: a complex tensor as its (real, imaginary) pairs (view_as_real),
        uint64 as int64; OutputSpec.returned_as turns the output back."""
        if value.dtype.is_complex:
            if val.is_conj():  # (view_as_real refuses a lazily conjugated tensor: svd's Vh of an empty input)
                resolve = ExternCall(torch.ops.aten.resolve_conj.default, (Operand(0),), {})
                value = self.b.node(Extern(resolve, 0), value.dtype, (in_memory(self, value),),
                                    View.contiguous(val.shape))
            call = ExternCall(torch.ops.aten.view_as_real.default, (Operand(0),), {})
            dtype, shape = DType.from_torch(val.real.dtype), tuple(val.shape) + (2,)
            stride = tuple(2 * st for st in val.stride()) + (1,)
        else:
            call = ExternCall(torch.ops.aten.view.dtype, (Operand(0), torch.int64), {})
            dtype, shape, stride = DType.int64, tuple(val.shape), tuple(val.stride())
        node = self.b.node(Extern(call, 0), dtype, (in_memory(self, value),), View.contiguous(shape))
        return node, dict(shape=shape, stride=stride)

    def note_layout_change(self, node: fx.Node) -> None:
        """An in-place view op (x.unsqueeze_(0)) on an argument changes the caller's tensor's
        shape, which a compiled call does not: allowed where later ones change it back
        (dropout3d of an unbatched input: unsqueeze_, dropout, squeeze_), as finish checks."""
        name = self.placeholder_names.get(_same_tensor_before(node.args[0]))
        if name is not None:
            self.argument_layouts[name] = node

    def _check_argument_layouts(self) -> None:
        for name, node in self.argument_layouts.items():
            if _layout(node.meta["val"]) != _layout(self.input_meta[name]):
                raise UnsupportedOpError(str(node.target), f"changes the shape of argument {name} in place (a "
                                         "compiled call leaves the caller's tensor as it is)", target=node.target)

    def finish(self, out_node: fx.Node) -> Conversion:
        self._check_argument_layouts()
        flat, tree = torch.utils._pytree.tree_flatten(out_node.args[0])
        outputs: dict[str, GraphNode] = {}
        specs: list[OutputSpec] = []
        computed_storage: dict[int, int] = {}
        for k, item in enumerate(flat):
            val = item.meta.get("val") if isinstance(item, fx.Node) else item
            if not isinstance(val, torch.Tensor):
                value = self.env.get(item, item) if isinstance(item, fx.Node) else item
                if isinstance(value, RuntimeScalar):
                    raise DataDependentError("a returned Python number", "it is read from tensor data (.item())")
                if is_symbolic_number(value):
                    raise UnsupportedOpError("a returned Python number", "it is computed from tensor data (.item(), "
                                             ".tolist()): return the tensor instead")
                specs.append(OutputSpec("constant", value=value))
                continue
            key = storage_key(val)
            layout = dict(shape=tuple(val.shape), stride=tuple(val.stride()))
            lazy = dict(conj=val.is_conj(), neg=val.is_neg())
            owner = self.storage_owner(item, val) if key in self.input_storage else None
            if owner is not None and val.dtype == self.input_meta[owner].dtype:
                specs.append(OutputSpec("input_alias", name=owner, offset=self.input_view(owner, val).offset, **layout,
                                        **lazy))
            elif key in computed_storage:
                j = computed_storage[key]
                specs.append(OutputSpec("output_alias", index=j, offset=val.storage_offset(), **layout, **lazy))
            else:
                name = f"out{k}"
                value = self.value(item)
                if _is_dense_view_of_buffer(value, val):
                    base = value.src[0]
                    outputs[name] = base.src[0]
                    specs.append(OutputSpec("computed", name=name, shape=base.shape, stride=base.view.strides,
                                            view=(layout["shape"], layout["stride"], value.view.offset)))
                    continue
                if _covers_storage(val):  # later outputs in the same storage become views of it
                    computed_storage[key] = k
                if value.dtype.library_only:  # no kernel writes it: a kernel writes its bits as another type
                    outputs[name], carrier = self.carrier(value, val)
                    specs.append(OutputSpec("computed", name=name, returned_as=val.dtype, **carrier))
                    continue
                outputs[name] = value
                specs.append(OutputSpec("computed", name=name, **layout))
        specs = [replace(spec, device=item.meta["val"].device.type) if spec.kind != "constant" else spec
                 for spec, item in zip(specs, flat)]
        graph = self.b.finish(self.input_names, outputs, self.mutations, self.effects)
        # (the graph's own nodes only: an id of a node that is gone may name a new one; and
        # views of values the graph computes: a backward that rebuilt a value the forward never
        # computed, nanquantile's mask before its broadcast, recomputed it from inputs the
        # forward had not saved)
        nodes = {id(n) for n in graph.nodes()}
        graph.view_sources = {key: (value, view) for key, (value, view) in self.view_sources.items()
                              if key in nodes and id(value) in nodes}
        graph.view_chains = self.view_chains(nodes)
        return Conversion(graph, specs, tree, self.constants, count_eager_kernels(self.gm),
                          matmul_choices=self.matmul_choices, shared_inputs=self.shared_inputs())


def _check_layout(node: fx.Node) -> None:
    """Sparse (and other non-strided) tensors have no strided memory for kernels or calls to
    read: refused by name, as an input or as an op's operand or result."""
    for value in torch.utils._pytree.tree_flatten(node.meta.get("val"))[0]:
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            what = f"input {node.target}" if node.op == "placeholder" else str(node.target)
            raise LayoutError(what, f"a tensor of layout {value.layout}: tjit compiles strided tensors only",
                                     target=node.target if node.op == "call_function" else None)


def _computes_library_dtype(node: fx.Node) -> bool:
    """The op reads or makes a tensor of a type only library calls compute (complex, uint64),
    and is not a view that keeps its dtype (a view computes nothing)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False  # operator.getitem picks a result
    metas = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    dtypes = {t.dtype for t in torch.utils._pytree.tree_flatten(metas)[0] if isinstance(t, torch.Tensor)}
    if not any(d in LIBRARY_DTYPES for d in dtypes):
        return False
    tags = getattr(node.target, "tags", ())
    returns = getattr(getattr(node.target, "_schema", None), "returns", ())
    is_view = torch.Tag.inplace_view in tags or (len(returns) == 1 and returns[0].alias_info is not None
                                                  and not returns[0].alias_info.is_write)
    return not (is_view and len(dtypes) == 1) or node.target in LAZY_VIEWS


LIBRARY_DTYPES = {d.torch for d in DType if d.library_only}
# views that mark their values conjugated or negated rather than move them: the IR's views
# only move values, so a library call makes them
LAZY_VIEWS = (torch.ops.aten._conj.default, torch.ops.aten._neg_view.default)
# (x.as_strided_ is x's view as as_strided makes it: both read the storage, wherever they reach)
AS_STRIDED = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default)


def functional_overload(in_place) -> Optional[torch._ops.OpOverload]:
    """The functional overload of an in-place aten op (`clamp_max_.Tensor` -> `clamp_max.Tensor`):
    the overload of the op without the trailing underscore whose arguments have the same names
    and types. (Not the overload of the same name: `pow_.Scalar` is `pow.Tensor_Scalar`, while
    `pow.Scalar` raises a number to tensor powers; `ldexp.default` takes Python numbers.)"""
    name = getattr(getattr(in_place, "overloadpacket", None), "__name__", "")
    functional = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
    if not isinstance(functional, torch._ops.OpOverloadPacket):
        return None
    wanted = _arguments(in_place)
    return next((overload for overload in (getattr(functional, o) for o in functional.overloads())
                 if _arguments(overload) == wanted), None)


def _arguments(op: torch._ops.OpOverload) -> list[tuple]:
    """An op's arguments by name, type and whether they are keyword-only (not by alias
    annotation: an in-place op's `Tensor(a!) self` is its functional form's `Tensor self`)."""
    return [(a.name, str(a.type), a.kwarg_only, repr(a.default_value)) for a in op._schema.arguments]


@contextlib.contextmanager
def _targeting(node: fx.Node, target):
    """node.target is `target` inside (for a handler of another op than the node's)."""
    saved = node.target
    node.target = target
    try:
        yield
    finally:
        node.target = saved


def _same_tensor_before(node: fx.Node) -> fx.Node:
    """The first node of the tensor `node` is: in-place ops (x.mul_(2), x.unsqueeze_(0))
    return the tensor they were given, which make_fx records as a new node."""
    while node.op == "call_function" and _returns_its_first_argument(node.target):
        node = node.args[0]
    return node


def _returns_its_first_argument(op) -> bool:
    schema = getattr(op, "_schema", None)
    if schema is None or len(schema.returns) != 1 or not schema.arguments:
        return False
    returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return returned is not None and first is not None and first.is_write and returned.before_set == first.before_set


def _library(target):
    """The handler that runs `target` as a library call (see library.py)."""
    def call(cv, node, *args, **kwargs):
        return library_call(cv, node, target, args, kwargs)
    return call


def _layout(t: torch.Tensor) -> tuple:
    """What makes two tensors of one storage the same tensor: their elements, where they lie,
    and their type (y.view(torch.int32) is another tensor: a write through it is not y's)."""
    return tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype


def _memory_source(node: fx.Node) -> Optional[fx.Node]:
    """The tensor whose memory the node's tensor is: a view op's or an in-place op's first
    argument (detach, t, add_, ...), where that is in the same storage; through the item of a
    view op with several results (split, unbind) to that op's argument. None for a tensor of
    memory of its own."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    first = node.args[0]
    if node.target is operator.getitem and isinstance(first.meta.get("val"), (list, tuple)):
        first = first.args[0] if first.op == "call_function" and first.args else None
    val, source = node.meta.get("val"), first.meta.get("val") if isinstance(first, fx.Node) else None
    if isinstance(val, torch.Tensor) and isinstance(source, torch.Tensor) and storage_key(val) == storage_key(source):
        return first
    return None


def _absolute_view(t: torch.Tensor) -> View:
    """The tensor's view of its storage, offset from the storage's start."""
    return View(tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _written_storages(gm: fx.GraphModule) -> set[int]:
    """The storages an op of the graph writes into (its schema marks the argument written)."""
    written = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        for k, argument in enumerate(schema.arguments if schema is not None else ()):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            arg = node.args[k] if k < len(node.args) else node.kwargs.get(argument.name)
            for a in (arg if isinstance(arg, (list, tuple)) else [arg]):
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                    written.add(storage_key(a.meta["val"]))
    return written


def _reads_input(value: GraphNode, name: str, written: Optional[View] = None) -> bool:
    """`value` is computed from input `name`'s memory (from addresses `written` reaches,
    where given: a read through a view of the input reaches only that view's addresses)."""
    stack, seen = [value], set()
    while stack:
        node = stack.pop()
        through_view = isinstance(node.op, ViewOp) and isinstance(node.src[0].op, Input)
        if (through_view or isinstance(node.op, Input)) and (node.src[0] if through_view else node).op.name == name:
            if written is None or not disjoint(node.view, written):
                return True
            continue
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
    memory, viewed, is exactly the tensor eager returns). Not a Scatter's: its value is not
    its source's."""
    return (isinstance(value.op, ViewOp) and type(value.src[0].op) is Contiguous and val.numel() > 0
            and value.view.strides == tuple(val.stride()))


def _covers_storage(val: torch.Tensor) -> bool:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(val.shape, val.stride())) if val.numel() else 0
    return val.storage_offset() == 0 and extent * val.element_size() >= val.untyped_storage().nbytes()



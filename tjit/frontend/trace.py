"""Trace a Python function into an aten FX graph with torch's own machinery.

make_fx runs the function on fake tensors (no real compute), records every aten op after
torch's core decompositions, and annotates each node with torch's own answer for its
dtype, shape, strides and storage, which the converter relies on. Python scalars and
other non-tensor arguments are specialised: they are part of the cache key.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map, tree_unflatten

from ..errors import (CustomFunctionError, DataDependentError, EagerError, GradientStateError, HigherOrderOpError,
                      LayoutError, SplitError, UnsupportedOpError, as_eager_error)
from .batch_norm import batch_norm_decompositions
from .convert import Conversion, Converter, storage_key
from .decompositions import UPSAMPLES, check_upsample_sizes, tjit_decompositions, wrapped
from .foreach import foreach_decompositions
from .out_variants import as_functional_and_copies
from .overlap import EagersOverlapChecks
from .rnn_cells import FunctionalCells
from .scalars import is_symbolic_number
from .symbolic_metas import symbolic_meta


@functools.lru_cache(maxsize=None)
def decomposition_table():
    from torch._decomp import core_aten_decompositions
    table = dict(core_aten_decompositions())
    # tjit translates these directly: with fewer and more exact IR ops than their
    # decompositions, and with eager's dtype checks, which the decompositions skip (silu of
    # an int tensor must raise as eager does, not return a value)
    for op in KEPT_WHOLE:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    table.update(foreach_decompositions())  # optimizers' _foreach_* ops: one op per tensor, fused
    # batch norm (which the core table keeps whole): reductions and elementwise work, the running
    # statistics written in place, the gradient tjit's own
    table.update(batch_norm_decompositions())
    table.update(tjit_decompositions(table))  # (logsumexp's gradient without a tie test, index_add's shape check)
    table.update(wrapped(table, (aten.linspace, aten.logspace), _in_eagers_precision_only))
    return table


def _in_eagers_precision_only(decomposition: Callable) -> Callable:
    """linspace and logspace decomposed only into float32/float64 (and complex) results:
    in integer and 16-bit types eager's kernel rounds start, end and step its own way (the
    decomposition, exact, differs from it by one unit), so they stay whole, library calls."""
    def decompose(*args, **kwargs):
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        if dtype.is_complex or dtype in (torch.float32, torch.float64):
            return decomposition(*args, **kwargs)
        return NotImplemented
    return decompose


aten = torch.ops.aten
KEPT_WHOLE = (aten.clamp_min, aten.clamp_max, aten.silu, aten.softplus, aten.mish, aten.hardsigmoid, aten.hardswish,
              aten.frac, aten.elu, aten.celu, aten.selu, aten.lerp, aten.addcmul, aten.addcdiv,
              aten.xlogy,  # its decomposition's where() gives no gradient to x at x == 0; eager's is log(y)
              aten.sinc,  # its decomposition's where() differentiates 0 / 0 at x == 0 (NaN; eager's is 0)
              # their decompositions' selects differentiate otherwise than eager's formulas at 0
              # (xlog1py's d/dx, entr's, logit's; logit's outside [0, 1] too)
              aten.special_xlog1py, aten.special_entr, aten.logit,
              aten.std, aten.std_mean,  # sqrt(var) differentiated at var == 0 is inf * 0 (NaN; eager's is 0)
              aten._safe_softmax,  # its decomposition's backward meets softmax's NaN in fully masked rows
              aten.baddbmm,  # its decomposition computes 16-bit products in float32 operands (frontend/matmul.py)
              aten.detach,  # its decomposition (alias) would lose where the gradient stops
              # a fill of an expanded view runs in eager (a constant written twice to one address
              # is one write); its decomposition, copy_ of a full_like, is refused there
              aten.fill_, aten.zero_,
              # library calls rather than their decompositions, which differ from eager: multilabel
              # margin loss's ignores a -1 inside a target row, index_fill's gradient counts a
              # repeated index once per repeat, log_ndtr's where() sends NaN into the gradient
              aten.multilabel_margin_loss_forward, aten.index_fill, aten.special_log_ndtr,
              # attention as eager runs it on the CPU (flash attention, which never holds the
              # (seq x seq) scores), forward and backward, until tjit generates it (tl.dot)
              aten._scaled_dot_product_flash_attention_for_cpu)


def fake_trace(fn: Callable, inputs: list, symbolic: bool = False,
               dynamic_dims: Optional[list] = None) -> tuple[torch.fx.GraphModule, list]:
    """make_fx on fake copies of the tensors among the inputs (and, symbolic, a symbol for each
    int among them: a size Dynamo passes); the graph and those copies. symbolic: each size of
    an input other than 0 and 1 a symbol, and a view's strides and offset (torch's ShapeEnv
    keeps the guards the trace needed; frontend/shape_class.py specialises the graph per
    size); dynamic_dims: per tensor input, which of its sizes are symbols (None: all). (The
    first call in a process also imports torch._dynamo, which make_fx uses internally: about
    a second, once.)"""
    mode = _fake_mode(symbolic)
    keep = KeepRealTensors()
    dims = iter(dynamic_dims or ())
    levels = torch._C._functorch.get_dynamic_layer_stack_depth()
    try:
        # (force_eager: what the function compiles with torch.compile runs as it is, traced;
        # torch.cond compiles its own call, which failing inside this trace left Dynamo
        # refusing the user's later eager torch.cond calls)
        with keep, torch.compiler.set_stance("force_eager"):
            fakes = [_fake_input(mode, v, symbolic, next(dims, None)) if isinstance(v, torch.Tensor)
                     else _size_symbol(mode.shape_env, v, k) for k, v in enumerate(inputs)]
            return lazy_make_fx(fn)(*fakes), fakes
    finally:
        keep.restore()
        # (a Dynamo graph enters and leaves torch.func's levels by plain calls: a trace that
        # stops inside one must not leave it entered, which breaks every later transform)
        torch._C._functorch.pop_dynamic_layer_stack_and_undo_to_depth(levels)


def lazy_make_fx(fn: Callable) -> Callable:
    """make_fx with tjit's decompositions, its graph module lazy: tjit reads the graph, and
    the Python code FX would write and compile for it (milliseconds a trace: a few for a
    derivative formula's) is written only if the module is called."""
    trace_fn = make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake", _allow_non_fake_inputs=True)

    def traced(*inputs):
        with _use_lazy_graph_module(True):
            return trace_fn(*inputs)
    return traced


def _fake_input(mode, tensor: torch.Tensor, symbolic: bool, dynamic: Optional[tuple[bool, ...]]):
    """A fake copy of an input: its sizes symbols where `dynamic` says so (all of them when
    it is None), the others as they are."""
    if not symbolic or dynamic is None:
        return mode.from_tensor(tensor, static_shapes=not symbolic)
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic])
    return mode.from_tensor(tensor, symbolic_context=context)


def _size_symbol(shape_env, value: int, position: int) -> torch.SymInt:
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic
    if value < 0:  # (no size: a loss's ignore_index of -100, kept as it is, and guarded so)
        return value
    source = LocalSource(f"size{position}")
    symbol = shape_env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
    return shape_env.create_symintnode(symbol, hint=value, source=source)


# Ops whose fake result, in a symbolic trace, is computed with torch's Python dispatcher (as
# make_fx's own symbolic mode computes every op): their C++ kernels read concrete sizes, which
# specialises every size they touch (F.pad of GPT-2's labels), where the Python meta keeps
# them symbols. Only these: for other ops the Python metas can differ from the C++ ones in
# details a concrete trace shows (the stride of a size-1 dimension of an expand), and a
# specialised trace must equal a trace at its sizes. (Which ops the trace records is decided
# above the fake mode either way.)
SYMBOLIC_META_IN_PYTHON = frozenset({torch.ops.aten.constant_pad_nd.default})


def _fake_mode(symbolic: bool = False):
    """The fake tensor mode make_fx would make (static sizes unless symbolic; a symbol for each size or
    Python number that only tensor data gives: the converter keeps a number read by `.item()`
    as a runtime value, and refuses the sizes), with the changes below."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    class NumbersFromDataStayFake(FakeTensorMode):
        """Fake tensor mode computes an op on real tensors only (ones the function closes
        over) for real; with a number read from tensor data among its arguments (an SGD
        step's p.add_(buf, alpha=-lr)) there is no value to compute with, so their fake
        copies compute it (the trace has already recorded the op on the real tensors)."""

        def _dispatch_impl(self, func, types, args, kwargs):
            if _reads_a_symbol((args, kwargs)):
                args, kwargs = tree_map(lambda t: self.from_tensor(t) if _is_real(t) else t, (args, kwargs))
            result = NotImplemented if self.static_shapes else symbolic_meta(self, func, args, kwargs)
            if result is not NotImplemented:
                return result
            if self.static_shapes or func not in SYMBOLIC_META_IN_PYTHON:
                result = super()._dispatch_impl(func, types, args, kwargs)
            else:
                with enable_python_dispatcher():
                    result = super()._dispatch_impl(func, types, args, kwargs)
            return _as_eager_computes(func, args, kwargs, result)

    # (no duck sizing: two sizes equal in one call are not assumed equal in the next; where
    # the trace needs them equal, broadcasting, it guards that)
    shape_env = ShapeEnv(duck_shape=False) if symbolic else ShapeEnv()
    return NumbersFromDataStayFake(allow_fallback_kernels=True, allow_non_fake_inputs=True, shape_env=shape_env,
                                   static_shapes=not symbolic)


EMBEDDING_BAG = (torch.ops.aten._embedding_bag.default, torch.ops.aten._embedding_bag_forward_only.default)


def _as_eager_computes(func, args, kwargs, result):
    """An op's fake result as eager's kernel gives it, where torch's meta function differs:
    - CPU embedding_bag in "sum" mode skips its offset2bag result (size 0) for bfloat16
      weights as for float32 and float16 ones (EmbeddingBag.cpp's is_fast_path_index_select);
      the meta leaves bfloat16 out (a library call's result must have its traced size);
    - an upsample kept whole gives any size, where eager refuses some (check_upsample_sizes).
    """
    if getattr(func, "overloadpacket", None) in UPSAMPLES:
        check_upsample_sizes(args[0] if args else kwargs["input"], result)
    if func not in EMBEDDING_BAG:
        return result
    names = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
             "include_last_offset", "padding_idx")
    bound = {**dict(zip(names, args)), **kwargs}
    weight, scale = bound["weight"], bound.get("per_sample_weights")
    fast = weight.device.type == "cpu" and weight.dtype is torch.bfloat16 and bound.get("mode", 0) == 0 \
        and weight.stride(1) == 1 and bound.get("padding_idx", -1) < 0 and (scale is None or scale.stride(0) == 1)
    return (result[0], result[1].new_empty(0), *result[2:]) if fast else result


class KeepRealTensors(TorchDispatchMode):
    """make_fx computes ops on small real tensors the function closes over (a module's
    num_batches_tracked) for real, to know their values while tracing; an in-place op then
    changes the caller's tensor during the trace, and again when the compiled function runs.
    This notes each such tensor before an op writes it and puts the values back after the
    trace (the trace itself saw the written values, as eager's first call does)."""

    def __init__(self):
        super().__init__()
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and _is_real(args[0]):
            # a Python number read from such a tensor (a BatchNorm with momentum=None divides by
            # float(num_batches_tracked)) would be baked into the trace, and tjit's guards do not
            # check the tensors a function closes over: Dynamo's split reads it on every call
            raise DataDependentError(str(func), "a Python number read from a tensor the function closes over "
                                     "(its value may change between calls)")
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
            for value, arg in zip(values, schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                for tensor in value if isinstance(value, (list, tuple)) else [value]:  # (_foreach_add_'s lists)
                    if _is_real(tensor) and id(tensor) not in self.before:
                        with torch._C._DisableTorchDispatch():  # (not traced)
                            self.before[id(tensor)] = (tensor, tensor.clone())
        return func(*args, **kwargs)

    def restore(self) -> None:
        with torch._C._DisableTorchDispatch():
            for tensor, value in self.before.values():
                tensor.copy_(value)


def _reads_a_symbol(arguments) -> bool:
    return any(is_symbolic_number(a) for a in tree_leaves(arguments))


def _is_real(value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and value.layout == torch.strided


# what a function asks of autograd for its own tensors, which tjit's own backward does not do
GRADIENT_HOOKS = (torch.Tensor.register_hook, torch.Tensor.retain_grad, torch.Tensor.register_post_accumulate_grad_hook)


class GradModeWatch(TorchFunctionMode):
    """Follows what the aten graph does not show of autograd, in a function traced in grad mode.

    A `torch.no_grad()` block: each result computed with grad mode off is detached in the
    trace (aten.detach: tjit's backward stops there, as eager's does), and so is each tensor
    an op there reads that requires grad. So a write there is a write through x.detach(),
    which the converter follows as eager's autograd does: into a tensor that carries no
    gradient (a running statistic updated by hand: `self.running_mean.mul_(0.9).add_(0.1 *
    mean)`), values no gradient flows through; into one that carries a gradient (a parameter
    rescaled in place), new values whose gradient goes to the tensor as it was. What cannot be
    shown that way: a write there of values of another type into such a tensor's memory (the
    converter follows floating values only), a custom autograd.Function (eager runs its
    Python backward, not the derivative of its forward), and a write through `.data` into a
    tensor that requires grad (eager's backward then reads the written values where ops
    saved the old ones, with no version counted), and x.detach_() or x.requires_grad_(False)
    of a tensor with a gradient (the aten graph records nothing of them): `gradient_unknown`
    holds the error to raise (its type and reason) for a function with grad inputs. A read
    or write of a tensor's .grad, or a gradient hook (register_hook, retain_grad), raises
    GradientStateError at once, in any grad mode: the traced copies of the inputs carry no
    gradients, and tjit's backward runs no hooks. A call with out= whose out tensors the
    trace cannot follow raises UnsupportedOpError at once (_check_out_tensors)."""

    def __init__(self):
        super().__init__()
        self.grad_enabled = torch.is_grad_enabled()  # the caller's mode: the trace runs in it
        self.gradient_unknown: Optional[tuple[type, str]] = None
        self._carrying_gradients: set[int] = set()  # the storages of the tensors seen that require grad
        self._data_of_gradients: set[int] = set()  # the storages of tensors requiring grad read through .data

    def note_gradients(self, values) -> None:
        """Notes the memory of each tensor among `values` that requires grad (an input, or a
        result of an op in grad mode): a write under no_grad into it is not followed."""
        found = (_memory(v) for v in tree_leaves(values) if isinstance(v, torch.Tensor) and v.requires_grad)
        self._carrying_gradients.update(m for m in found if m is not None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outs = [t for t in tree_leaves(kwargs["out"]) if isinstance(t, torch.Tensor)] if "out" in kwargs else []
        before = [(t.shape, t._version) for t in outs]
        # (eager's overlap checks, on the aten ops of a call that may write: a dispatch mode
        # around every call would cost a trace a fifth of its time)
        with EagersOverlapChecks() if outs or _may_write(func, kwargs) else contextlib.nullcontext():
            result = self._call(func, args, kwargs)
        if outs:
            _check_out_tensors(func, outs, before)
        return result

    def _call(self, func, args: tuple, kwargs: dict):
        if getattr(func, "__self__", None) is torch.Tensor.grad:  # (its __get__, __set__ or __delete__)
            raise GradientStateError("Tensor.grad", "the function reads or writes a tensor's gradient, which the "
                                                    "traced copies of its inputs do not carry")
        if func in GRADIENT_HOOKS:
            raise GradientStateError(f"Tensor.{func.__name__}", "tjit's backward would not run the hook or keep "
                                                                "the gradient")
        if not self.grad_enabled or func is torch._C._set_grad_enabled:  # (tracing toggles grad mode too)
            return func(*args, **kwargs)
        if _turns_gradient_off(func, args, kwargs):
            self.gradient_unknown = (UnsupportedOpError, "x.detach_() or x.requires_grad_(False) of a tensor with a "
                                                         "gradient: the trace does not show it (use y = x.detach())")
        if getattr(func, "__self__", None) is torch.Tensor.data and args[0].requires_grad and \
                _memory(args[0]) is not None:
            self._data_of_gradients.add(_memory(args[0]))
        if torch.is_grad_enabled():
            self.note_custom_functions((args, kwargs))
            with WritesSeen() if self._data_of_gradients else contextlib.nullcontext() as writes:
                result = func(*args, **kwargs)
            if writes is not None:
                self._check_writes(writes.written)
            self.note_gradients(result)
            return result
        originals = {}  # id(detached copy) -> the tensor it was made from

        def detached(v):
            if isinstance(v, torch.Tensor) and v.requires_grad:
                copy = v.detach()
                originals[id(copy)] = v
                return copy
            return v
        args, kwargs = tree_map(detached, (args, kwargs))
        with WritesSeen() as writes:
            result = func(*args, **kwargs)
        self._check_writes(writes.written)
        if writes.written:
            return result
        # (an op that returns its input itself, x.contiguous() of a contiguous x, returns it with its gradient)
        return tree_map(lambda v: originals.get(id(v), v.detach()) if isinstance(v, torch.Tensor) else v, result)

    def _check_writes(self, written: list[torch.Tensor]) -> None:
        """Notes in gradient_unknown a write that the trace cannot show as eager's autograd
        sees it (see the class)."""
        if any(_memory(t) in self._data_of_gradients for t in written):
            self.gradient_unknown = (UnsupportedOpError, "a write through x.data into a tensor that requires grad: "
                                                         "eager's backward would read the written values where ops "
                                                         "saved the old ones")
            return
        other_type = [t.dtype for t in written if _memory(t) in self._carrying_gradients and not t.is_floating_point()]
        if other_type:
            self.gradient_unknown = (UnsupportedOpError, f"a write of {other_type[0]} values, unseen by autograd, "
                                                         "into the memory of a tensor that carries a gradient (tjit "
                                                         "follows such writes of real floating values only)")

    def note_custom_functions(self, values) -> None:
        """Notes a value among `values` made by a custom autograd.Function (its forward ran
        with grad mode off, so its results were detached above; its backward is the grad_fn)."""
        for v in tree_leaves(values):
            if isinstance(v, torch.Tensor) and isinstance(v.grad_fn, torch.autograd.function.BackwardCFunction):
                self.gradient_unknown = (CustomFunctionError, f"a custom autograd.Function ({type(v.grad_fn).__name__}): "
                                                              "eager runs its Python backward, which tjit does not trace")


def _may_write(func, kwargs: dict) -> bool:
    """A call that may write into a tensor argument: an in-place method or function
    (`x.add_`, `x += y`, `x[i] = v`, `torch.relu_`) or one asked to (`inplace=True`)."""
    return getattr(func, "__name__", "").endswith("_") or bool(kwargs.get("inplace"))


def _turns_gradient_off(func, args: tuple, kwargs: dict) -> bool:
    """x.detach_(), x.requires_grad_(False) or `x.requires_grad = False` of a tensor that
    requires grad: eager's later reads of x pass no gradient, but the aten graph records
    nothing of it."""
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
        return False
    if func is torch.Tensor.detach_:
        return True
    if func is torch.Tensor.requires_grad_:
        return not (args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return getattr(func, "__name__", "") == "__set__" and getattr(func, "__self__", None) is torch.Tensor.requires_grad \
        and len(args) > 1 and not args[1]


def _check_out_tensors(func, outs: list[torch.Tensor], before: list[tuple]) -> None:
    """A call with out= whose out tensors the trace cannot follow is refused (see
    out_variants.py): one that resized them (the trace's record of such a tensor has the new
    shape from its start), and one whose trace recorded no write into them (torch's trace of
    some ops' out= forms computes the result and drops it: linalg.matrix_rank)."""
    name = getattr(func, "__name__", str(func))
    if [t.shape for t in outs] != [shape for shape, _ in before]:
        raise UnsupportedOpError(name, f"it resizes its out= tensor (from {[list(s) for s, _ in before]} to "
                                       f"{[list(t.shape) for t in outs]}): tjit writes out= tensors of the result's "
                                       "shape only")
    if any(t.numel() and t._version == version for t, (_, version) in zip(outs, before)):
        raise UnsupportedOpError(name, "its trace records no write into its out= tensor (torch's tracing of this "
                                       "op's out= form); call it without out=")


def _memory(t: torch.Tensor) -> Optional[int]:
    """The tensor's storage (convert.storage_key); None for a layout without one (sparse)."""
    return storage_key(t) if t.layout == torch.strided else None


class WritesSeen(TorchDispatchMode):
    """Notes the tensors that the aten ops that ran wrote into (their arguments marked as
    written in their schemas)."""

    def __init__(self):
        super().__init__()
        self.written: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            for k, argument in enumerate(func._schema.arguments):
                value = args[k] if k < len(args) else kwargs.get(argument.name)
                if argument.alias_info is not None and argument.alias_info.is_write:
                    self.written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        return func(*args, **kwargs)


def flatten_arguments(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) per argument, in the order the function declares them. A list, tuple
    or dict that holds tensors (torch.einsum's operands, torch.meshgrid's) is flattened into
    its leaves, named `<argument>_<k>` in pytree order: its tensors are inputs like any
    other, not values baked into the trace."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        if kwargs:
            raise
        return [e for k, a in enumerate(args) for e in _entries(f"arg{k}", a)]
    flat = []
    for name, value in bound.arguments.items():
        param = bound.signature.parameters[name]
        if param.kind is param.VAR_POSITIONAL:
            flat += [e for k, v in enumerate(value) for e in _entries(f"{name}{k}", v)]
        elif param.kind is param.VAR_KEYWORD:
            flat += [e for k, v in value.items() for e in _entries(f"{name}_{k}", v)]
        else:
            flat += _entries(name, value)
    return flat


CONTAINERS = (list, tuple, dict)


def holds_tensors(value) -> bool:
    """A container (list, tuple, dict, nested) with a tensor among its leaves."""
    return isinstance(value, CONTAINERS) and any(isinstance(v, torch.Tensor) for v in tree_leaves(value))


def _object_holding_tensors(value) -> bool:
    """An object (a dataclass's, a user class's) with a tensor among its attributes."""
    attributes = getattr(value, "__dict__", None)
    return isinstance(attributes, dict) and not isinstance(value, (torch.Tensor, type, types.ModuleType)) and \
        any(isinstance(v, torch.Tensor) or holds_tensors(v) for v in attributes.values())


def _holds_named_tuples(value) -> bool:
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_holds_named_tuples, value))
    return isinstance(value, dict) and any(map(_holds_named_tuples, value.values()))


def _entries(name: str, value) -> list[tuple[str, Any]]:
    if holds_tensors(value):
        return [(f"{name}_{k}", v) for k, v in enumerate(tree_leaves(value))]
    return [(name, value)]


def _rebuilt(name: str, value, values: dict):
    """The argument `name` (originally `value`) with its flattened entries taken from `values`."""
    if holds_tensors(value):
        leaves, spec = tree_flatten(value)
        return tree_unflatten([values[f"{name}_{k}"] for k in range(len(leaves))], spec)
    return values[name]


@dataclass
class Traced:
    """One trace: the aten graph, and what it does not show of the function."""
    gm: torch.fx.GraphModule
    tensor_names: list[str]  # the graph's tensor inputs, in order
    requires_grad: frozenset  # the inputs traced as requiring grad
    inputs: list  # the fake tensors traced (symbolic sizes in a symbolic trace), then its size symbols
    gradient_unknown: Optional[tuple] = None  # GradModeWatch's
    written_grad_inputs: tuple[str, ...] = ()  # the inputs requiring grad the function writes
    returned_written: dict = field(default_factory=dict)  # result position -> the written input it is
    returned: Optional[TreeSpec] = None  # the pytree spec of what the function returns


def trace(fn: Callable, args: tuple, kwargs: dict, requires_grad: frozenset = frozenset(),
          check: Optional[Callable[[Traced], None]] = None) -> Conversion:
    """requires_grad: the tensor arguments (by flattened name) that get a gradient: they are
    traced requiring grad, as eager runs them (Python code may branch on it). check: called
    with the trace before it is converted (it raises to refuse it)."""
    traced, with_tensors, tensors = _trace_graph(fn, args, kwargs, requires_grad)
    if check is not None:
        check(traced)
    try:
        return convert_traced(traced)
    except UnsupportedOpError as e:
        if e.where or e.target is None:
            raise
        raise type(e)(e.op, e.reason, locate_call(with_tensors, tensors, e.target)) from None


def trace_concrete(fn: Callable, args: tuple, kwargs: dict, requires_grad: frozenset = frozenset()) -> Traced:
    """The function traced at its arguments' sizes, not converted."""
    return _trace_graph(fn, args, kwargs, requires_grad)[0]


def trace_symbolic(fn: Callable, args: tuple, kwargs: dict, requires_grad: frozenset = frozenset(),
                   sizes: tuple[str, ...] = (), dynamic_dims: Optional[dict[str, tuple[bool, ...]]] = None) -> Traced:
    """The function traced with symbolic sizes (see fake_trace), not converted: sizes are
    not in tjit's IR, so frontend/shape_class.py makes a concrete graph of it per size.
    sizes: the int arguments (by flattened name) that are symbols too (a Dynamo graph's
    sizes), after the tensors among the trace's inputs. dynamic_dims: tensor argument name ->
    which of its sizes are symbols (a Dynamo graph's: the others are static there, its
    parameters' among them); a tensor not named has all its sizes symbols."""
    return _trace_graph(fn, args, kwargs, requires_grad, symbolic=True, sizes=sizes, dynamic_dims=dynamic_dims)[0]


def convert_traced(traced: Traced) -> Conversion:
    """The IR graph of a trace with concrete sizes."""
    as_functional_and_copies(traced.gm)
    conversion = Converter(traced.gm, traced.tensor_names, traced.requires_grad).run()
    conversion.gradient_unknown = traced.gradient_unknown
    conversion.written_grad_inputs = traced.written_grad_inputs
    conversion.returned_written = traced.returned_written
    if traced.returned is not None and traced.returned.num_leaves == conversion.output_tree.num_leaves:
        # eager's own structure: torch.return_types named tuples (x.max(1).values) stay named
        conversion.output_tree = traced.returned
    return conversion


def _trace_graph(fn: Callable, args: tuple, kwargs: dict, requires_grad: frozenset, symbolic: bool = False,
                 sizes: tuple[str, ...] = (), dynamic_dims: Optional[dict[str, tuple[bool, ...]]] = None):
    """The trace, the function as make_fx called it, and the tensors it was called with."""
    flat = flatten_arguments(fn, args, kwargs)
    tensor_names = [name for name, v in flat if isinstance(v, torch.Tensor)]
    tensors = [v for _, v in flat if isinstance(v, torch.Tensor)]
    size_values = [dict(flat)[name] for name in sizes]
    for name, t in zip(tensor_names, tensors):
        if t.layout != torch.strided:
            raise LayoutError(f"input {name}", f"a tensor of layout {t.layout}: tjit compiles strided tensors only")
        if t.is_neg():  # (make_fx's graph does not show the bit: kernels would read the values unnegated)
            raise LayoutError(f"input {name}", "a lazily negated view (its negative bit is set, as x.conj().imag's "
                                               "is): kernels read memory as it is")
    returned = []  # the pytree spec of what fn returns (make_fx's output loses named tuples)
    # the inputs traced through copies of their own (_write_back): those requiring grad, where
    # the function writes into one; those that do not, where it writes values with a gradient
    copied: set[str] = set()
    written_grad_inputs = []  # the copied inputs that fn wrote
    returned_written = {}  # result position -> the written input it is (`return x.relu_()`)

    def with_tensors(*traced):
        it = iter(traced)
        values = {name: (next(it) if isinstance(v, torch.Tensor) else v) for name, v in flat}
        values.update(zip(sizes, it))
        copies = {name: values[name].clone() for name in tensor_names if name in copied}
        cloned_by = {name: copy.grad_fn for name, copy in copies.items()}
        values.update(copies)
        watch.note_gradients([values[name] for name in tensor_names])
        # the modes watch the function's own calls only: around make_fx's set-up (fake copies of
        # the inputs) they would see hundreds of calls per trace
        with watch, FunctionalCells():
            result = _call_with(fn, args, kwargs, flat, values)
            watch.note_custom_functions(result)
        gained = [name for name in tensor_names if name not in requires_grad and name not in copied
                  and values[name].requires_grad]
        if gained:  # (eager's input now carries the written values' gradient: autograd rebased it)
            raise _GainedAGradient(gained)
        written_grad_inputs.extend(_write_back(copies, cloned_by, traced, tensor_names))
        leaves, spec = tree_flatten(result)
        returned_written.update({k: name for k, leaf in enumerate(leaves) for name, copy in copies.items()
                                 if leaf is copy and name in written_grad_inputs})
        objects = [type(v).__name__ for v in leaves if _object_holding_tensors(v)]
        if objects:
            raise SplitError(name, f"it returns a {objects[0]} that holds tensors, which one trace's output cannot "
                                   "hold (Dynamo's graphs return its tensors, and Dynamo builds the object)")
        returned.append(spec)
        # (the graph's output is built from its leaves: FX writes a named tuple of the user's as
        # a call of its class, which is no op; the spec above gives it back)
        return tuple(leaves) if _holds_named_tuples(result) else result

    name = getattr(fn, "__name__", str(fn))
    # in the caller's grad mode: under torch.no_grad() (an optimizer step) eager updates
    # parameters that require grad in place, which grad mode forbids
    grad_mode = torch.enable_grad() if torch.is_grad_enabled() else torch.no_grad()
    while True:
        watch = GradModeWatch()
        try:
            with grad_mode:
                gm, fakes = fake_trace(with_tensors, [t.detach().requires_grad_(name in requires_grad)
                                                      for name, t in zip(tensor_names, tensors)] + size_values,
                                       symbolic, [(dynamic_dims or {}).get(name) for name in tensor_names])
            break
        except (UnsupportedOpError, EagerError):  # (EagerError: eager's error for these inputs, from a decomposition)
            raise
        except _GainedAGradient as e:
            copied.update(e.names)
            returned.clear()
            continue
        except Exception as e:
            if not copied.issuperset(requires_grad) and _writes_a_leaf(e):
                copied.update(requires_grad)  # the trace's inputs are leaves; the caller's need not be
                returned.clear()
                continue
            if isinstance(e, TypeError) and not _fits_signature(fn, args, kwargs):
                raise TypeError(str(e)) from None  # eager's: the call itself does not fit (a missing argument)
            if _needs_tensor_data(e):
                raise DataDependentError(name, f"tracing failed: {type(e).__name__}: {str(e).strip()}") from e
            if "TensorWrapper" in str(e) or "BatchedTensor" in str(e):  # (a grad or vmap level's tensors)
                raise SplitError(name, "it applies a torch.func transform (grad, vmap, jacrev, ...), whose tensors "
                                       "kernels cannot read: Dynamo inlines it, and tjit compiles the ops around "
                                       "it") from e
            higher_order = _higher_order_op(e)
            if higher_order is not None:
                raise HigherOrderOpError(f"torch.ops.higher_order.{higher_order}", "a higher-order op (torch.cond, "
                                         "while_loop, ...): tjit traces none yet") from e
            eager = _eager_error(fn, args, kwargs)
            if eager is not None:  # (the function's own error for these arguments: `raise ValueError(...)`)
                error = as_eager_error(eager)
                error.add_note(f"(eager raises this for these arguments; tjit's trace of {name} stopped at it too)")
                raise error from (eager if error is not eager else None)
            raise UnsupportedOpError(name, f"tracing failed: {type(e).__name__}: {str(e).strip()}") from e
    check_no_data_dependence(gm, name)
    traced = Traced(gm, tensor_names, frozenset(requires_grad), fakes, watch.gradient_unknown,
                    tuple(written_grad_inputs), returned_written, returned[-1] if returned else None)
    return traced, with_tensors, tensors


def argument_copies(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with each tensor copied, the caller's left untouched: a leaf as a new
    leaf (requiring grad where it does), a result of earlier ops as its clone, which is a
    result too (an in-place write into it is allowed, as into the caller's)."""
    def copy(v):
        if not isinstance(v, torch.Tensor):
            return v
        return v.detach().clone().requires_grad_(v.requires_grad) if v.is_leaf else v.clone()
    return tree_map(copy, (args, kwargs))


def _eager_error(fn: Callable, args: tuple, kwargs: dict) -> Optional[Exception]:
    """The exception eager raises for these arguments, run on copies of their tensors (leaves
    where they are leaves, so that an in-place write is refused as it would be) with torch's
    random generators put back after; None where it raises none: then the trace's failure is
    tjit's. (Called where a trace failed, so the function's Python runs once more: a function
    that changes Python state runs through Dynamo and is not traced.)"""
    copies = argument_copies(args, kwargs)
    cuda = sorted({t.device.index or 0 for t in tree_leaves(copies) if isinstance(t, torch.Tensor) and t.is_cuda})
    try:  # (random numbers drawn from generators put back as they were: the call has not happened)
        with warnings.catch_warnings(), torch.random.fork_rng(devices=cuda), _grad_mode_kept():
            warnings.simplefilter("ignore")
            fn(*copies[0], **copies[1])
    except Exception as e:  # noqa: BLE001 (the function's own error, whatever it is)
        return e
    return None


def _grad_mode_kept():
    """The caller's grad mode, back after running a function that may stop midway (an error,
    or locate_call's stop at an op): a Dynamo graph turns grad mode off and on again by plain
    calls (torch._C._set_grad_enabled), with no block that restores it when an exception
    leaves between them. A graph refused inside its no_grad region left grad mode off, and
    the graph then run eagerly computed its first ops without gradients."""
    return torch.set_grad_enabled(torch.is_grad_enabled())


def _writes_a_leaf(e: Exception) -> bool:
    """The function writes in place into an input that requires grad: the trace's inputs are
    leaves, where eager refuses that; the caller's may be results of earlier ops (a graph that
    Dynamo cut before `h.relu_()`), where eager allows it."""
    return isinstance(e, RuntimeError) and "leaf Variable that requires grad" in str(e)


class _GainedAGradient(Exception):
    """The function wrote values with a gradient into inputs that require none (`buf.add_(x)`):
    they are traced again through copies (_write_back), as inputs requiring grad are."""

    def __init__(self, names: list[str]):
        super().__init__(f"inputs {names} written with values that carry a gradient")
        self.names = names


def _write_back(copies: dict, cloned_by: dict, traced: tuple, tensor_names: list) -> list[str]:
    """Each copied input that the function wrote (through its stand-in copy) gets the copy's
    final contents, in one write the trace records outside grad mode (the gradient of the new
    contents flows through the copy: tjit's autograd returns the input as a result of the
    call, marked dirty, as eager rebases its history, where the input requires grad or the
    written values carry a gradient). The names of those inputs. A copy of an input requiring
    grad that autograd saw no write into (its grad_fn still the clone's: writes through
    detach() or under no_grad only) is written back through detach(), unseen as those writes
    were: eager leaves that input's history (a leaf stays a leaf)."""
    written = []
    for name, copy in copies.items():
        if not copy._version:
            continue
        target = traced[tensor_names.index(name)]
        with torch.no_grad():
            if target.requires_grad and copy.grad_fn is cloned_by[name]:
                target.detach().copy_(copy.detach())
            else:
                target.copy_(copy)
                written.append(name)
    return written


def _higher_order_op(e: Exception) -> Optional[str]:
    """The higher-order op (torch.cond's `cond`) the trace stopped at: tjit's own tracing mode
    has no rule for it."""
    found = re.search(r"no rule registered for HigherOrderOperator (\w+)", str(e))
    return found.group(1) if isinstance(e, NotImplementedError) and found else None


def _needs_tensor_data(e: Exception) -> bool:
    """The trace stopped because the function needs a value that only tensor data gives: a
    branch or a size computed from data, an op whose output size or Python result depends on
    data (fake tensors have no data to read)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)):
        return True
    return isinstance(e, RuntimeError) and "data is not allocated yet" in str(e)


def check_no_data_dependence(gm: torch.fx.GraphModule, name: str) -> None:
    """Raise DataDependentError at the first value the trace could only describe by a symbol
    standing for tensor data: a size (nonzero's row count), a Python number (.item()). tjit's
    IR has concrete sizes and no such numbers."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if is_symbolic_number(val):
            continue  # a Python number: the converter keeps it as a value where ops only compute with it
        if node.op == "call_function" and free_unbacked_symbols(val):
            raise DataDependentError(str(node.target), f"in {name}: its result depends on tensor data (an output size "
                                     "or a Python number read from a tensor)", target=node.target)


def eager_gradient_paths(fn: Callable, args: tuple, kwargs: dict, grad_inputs) -> Optional[list]:
    """What eager's autograd makes of fn's results: per flattened result (pytree order), then
    per input requiring grad that fn writes in place (its new contents), None
    if it does not require grad (or is not a tensor), else the names of the inputs in
    `grad_inputs` that get a gradient from it (possibly none: a norm of order 0).

    tjit's IR can lose what eager keeps (a fill or zero_ of an input is a literal there, yet
    requires grad with a zero gradient in eager) and keep what eager drops (an input returned
    through detach() is the input itself), so where the two may differ, this runs fn and
    eager's backward on fake copies of the inputs: no real compute. None if fn cannot run
    that way."""
    flat = flatten_arguments(fn, args, kwargs)
    for written in (False, True):
        try:
            return _eager_gradient_paths(fn, args, kwargs, flat, grad_inputs, written)
        except Exception as e:
            if written or not _writes_a_leaf(e):
                return None
    return None


def _eager_gradient_paths(fn, args, kwargs, flat, grad_inputs, writes_grad_inputs: bool) -> list:
    """writes_grad_inputs: fn writes into inputs that require grad, so it gets non-leaf
    copies of them (as the trace does), the paths lead to the copies' sources, and the new
    contents of each written input follow the results, as trace._write_back lists them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values, names, inputs, copies = {}, {}, [], []
    for name, v in flat:
        if isinstance(v, torch.Tensor):
            v = mode.from_tensor(v.detach())
            if name in grad_inputs:
                v.requires_grad_()
                names[id(v)] = name
                inputs.append((name, v))
                if writes_grad_inputs:
                    with mode, torch.enable_grad():
                        v = v.clone()
                    copies.append(v)
        values[name] = v
    with mode, torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trace already showed the function's warnings once
        result = _call_with(fn, args, kwargs, flat, values)
        results = tree_leaves(result) + [copy for copy in copies if copy._version]
        return [_reached_inputs(t, inputs, names) if isinstance(t, torch.Tensor) and t.requires_grad else None
                for t in results]


def _reached_inputs(t: torch.Tensor, inputs: list, names: dict[int, str]) -> frozenset:
    """The inputs (by name) that get a gradient from t: those eager's backward (run on the
    fakes) gives a defined gradient, which leaves out inputs whose formula gives none (a
    norm of order 0); where that backward cannot run on fakes, those its graph ends in."""
    try:
        with torch.enable_grad():
            grads = torch.autograd.grad(t, [v for _, v in inputs], torch.ones_like(t), retain_graph=True,
                                        allow_unused=True)
        return frozenset(name for (name, _), g in zip(inputs, grads) if g is not None)
    except Exception:
        pass
    if t.grad_fn is None:
        return frozenset({names[id(t)]}) if id(t) in names else frozenset()
    found, seen, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: the leaf it accumulates into
        if variable is not None and id(variable) in names:
            found.add(names[id(variable)])
        stack.extend(f for f, _ in node.next_functions)
    return frozenset(found)


class _Found(Exception):
    pass


def locate_call(fn: Callable, tensors: list, target) -> str:
    """The user's line that calls aten op `target`: re-run fn on fake copies of its tensors
    (the real ones stay untouched) and stop at the first dispatch of that op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    import traceback

    packet = getattr(target, "overloadpacket", target)

    class Locator(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is target or getattr(func, "overloadpacket", None) is packet:
                frames = [f for f in traceback.extract_stack()
                          if "/torch/" not in f.filename and "/tjit/" not in f.filename]
                raise _Found(f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "")
            return func(*args, **(kwargs or {}))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fakes = [mode.from_tensor(t) for t in tensors]
        with mode, Locator(), _grad_mode_kept():
            fn(*fakes)
    except _Found as found:
        return str(found)
    except Exception:
        return ""
    return ""


def _fits_signature(fn, args, kwargs) -> bool:
    """Whether the arguments bind to fn's signature (True where it has none to check)."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _call_with(fn, args, kwargs, flat, values):
    """Call fn with the traced tensors in place of the real ones, keeping its call shape."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return fn(*[_rebuilt(f"arg{k}", a, values) for k, a in enumerate(args)])
    new_args, new_kwargs = [], {}
    for name, value in bound.arguments.items():
        param = bound.signature.parameters[name]
        if param.kind is param.VAR_POSITIONAL:
            new_args += [_rebuilt(f"{name}{k}", v, values) for k, v in enumerate(value)]
        elif param.kind is param.VAR_KEYWORD:
            new_kwargs.update({k: _rebuilt(f"{name}_{k}", v, values) for k, v in value.items()})
        elif param.kind is param.KEYWORD_ONLY:
            new_kwargs[name] = _rebuilt(name, value, values)
        else:
            new_args.append(_rebuilt(name, value, values))
    return fn(*new_args, **new_kwargs)

"""A compiled form connected to torch's autograd.

The forward kernels run inside a torch.autograd.Function; what backward needs is handed to
torch as saved tensors (inputs and outputs by reference, intermediates in tape blocks), so
torch's own rules decide their lifetime: freed right after backward unless retain_graph,
freed with the graph when the outputs die without backward, and checked against in-place
changes between forward and backward. Backward runs the backward graph's fused kernels,
compiled on the first backward for each layout of the incoming gradients.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable, Optional

import torch

from .. import debug
from ..errors import CompileArgumentError
from ..frontend.convert import Conversion, OutputSpec
from ..ir import contiguous_strides
from ..pipeline import (build_program, verify, verify_constants, with_buffers_apart, with_library_results_apart,
                        with_tape_donated)
from ..memory.peak import Allocation, PeakMemory, allocated_bytes, relabel, release
from ..memory.slab import POOL
from ..runtime.counters import compiling
from ..runtime.executor import Executable, tape_bytes
from .backward import (AutogradPlan, GradLayout, backward_graph, incoming_grad_name, saved_layouts,
                       written_output_name)


class GradExecutable:
    """Runs like an Executable, with outputs that carry a grad_fn."""

    def __init__(self, conversion: Conversion, plan: AutogradPlan, strategies=None, device: str = "cuda",
                 eager: Optional[list] = None):
        """eager: per flattened result, whether it requires grad in eager and which inputs
        get a gradient from it (see trace.eager_gradient_paths), when that was asked. Results
        that are views of inputs or of other results and do not require grad in eager (taken
        through detach()) are returned detached."""
        self.plan, self.device = plan, device  # the device type kernels are generated for
        self._detach = [k for k, (spec, paths) in enumerate(zip(conversion.outputs, eager or ()))
                        if spec.kind in ("input_alias", "output_alias") and paths is None] if eager else []
        graph = plan.forward_graph()
        strides = {s.name: s.stride for s in conversion.outputs if s.kind == "computed"}
        # (the new contents of a written input are in a block of their own, as a saved value's:
        # the input itself is written by the graph's mutation)
        self.written = {written_output_name(name): name for name in conversion.written_grad_inputs}
        kept = {**saved_layouts(plan),
                **{out: contiguous_strides(plan.graph.outputs[out].shape) for out in self.written}}
        strides.update(kept)
        forward = Conversion(graph, conversion.outputs, conversion.output_tree, conversion.constants,
                             conversion.eager_ops, matmul_choices=conversion.matmul_choices)
        self._kept = kept
        self.forward = self._plain_forward = Executable(forward, build_program(graph, strides, strategies, device),
                                                        tape=kept)
        self._apart_forward: Optional[Executable] = None  # (made when a backward is compiled: _forward_forms)
        self.output_names = [s.name for s in conversion.outputs if s.kind == "computed"] + list(self.written)
        self._returned_written = conversion.returned_written  # (eager returns the input itself, rebased)
        self._backward: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.on_backward_compiled: Optional[Callable[[], None]] = None  # (the disk cache's: stores the entry again)

    # (pickled into the disk cache, runtime/disk_cache.py, with the backwards compiled so far;
    # on_backward_compiled is the cache's, which stores it again)
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "on_backward_compiled")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), on_backward_compiled=None)

    # what explain() and the logs read
    @property
    def graph(self):
        return self.forward.graph

    @property
    def program(self):
        return self.forward.program

    @property
    def memory_plan(self):
        return self.forward.memory_plan

    def __call__(self, tensors: dict[str, torch.Tensor], out=None):
        if out is not None:
            raise CompileArgumentError("out= is not differentiable: call the function without out=, or under "
                                       "torch.no_grad() (eager refuses out= with inputs that require grad too)")
        for name in self.written.values():
            _check_writable(name, tensors[name])
        names = tuple(tensors)
        _backwards_outside_dynamo()
        outs = _Compiled.apply(self, names, *tensors.values())
        if self.written:
            for name, value in zip(self.output_names, outs):
                if name in self.written:
                    _Rebase.apply(tensors[self.written[name]], value)
        memory = dict(tensors)
        memory.update({("output", name): t for name, t in zip(self.output_names, outs)})
        result = self.forward.assemble(memory)
        if self._detach or self._returned_written:
            flat, tree = torch.utils._pytree.tree_flatten(result)
            for k in self._detach:
                flat[k] = flat[k].detach()
            for k, name in self._returned_written.items():
                flat[k] = tensors[name]
            result = torch.utils._pytree.tree_unflatten(flat, tree)
        return result

    def saved_bytes(self, tensors: dict[str, torch.Tensor]) -> int:
        """Bytes a call with these inputs keeps for backward (inputs and outputs included)."""
        nodes = [self.plan.graph.outputs[n] for n in self.plan.saved_outputs] + list(self.plan.saved.values())
        held = sum(n.view.numel * n.dtype.itemsize for n in nodes)
        known = {**self.forward.conversion.constants, **tensors}
        return held + sum(known[n].numel() * known[n].element_size() for n in self.plan.saved_inputs)

    def training_step_memory(self, device_type: str) -> PeakMemory:
        """The predicted peak of a training step: this call, then backward from every
        differentiable output with a dense incoming gradient (`loss.backward()` of a scalar
        loss), the gradients handed back to the caller (and kept: autograd moves them into
        .grad without a copy when they have the input's layout). Counted as in
        tjit.memory.peak: what the forward and backward hold between calls, plus what the step
        allocates and has not released yet; inputs and parameters are not counted."""
        return self._step_memory(self.backward_executable(self.dense_layouts()), device_type)

    def _step_memory(self, backward: "_Backward", device_type: str, forward_run: Optional[Executable] = None
                     ) -> PeakMemory:
        """training_step_memory with this backward (and this forward, if not the one chosen)."""
        forward_run = forward_run or self.forward
        forward = forward_run.allocations(device_type, "forward")
        saved = [a for name, a in forward.outputs.items() if name in self.plan.saved]
        # the backward frees each saved intermediate once it has read it (_Compiled.backward):
        # the library results saved as they are and the tape's blocks, one by one
        consumable = {name: forward.outputs.get(name) or forward.tape[name]
                      for name in self.plan.saved if name in forward.outputs or name in forward.tape}
        run = backward.executable.allocations(device_type, "backward", consumable)
        outputs = self.plan.graph.outputs
        incoming = [Allocation(("incoming", name), allocated_bytes(outputs[name].view.numel * outputs[name].dtype.itemsize,
                                                                   device_type),
                               "incoming gradient", f"gradient of output {name}", "backward start")
                    for name in self.plan.differentiable_outputs]
        grads = {name[len("grad_"):]: a for name, a in run.outputs.items() if name.startswith("grad_")}
        zeros = []  # _Backward.run: a zero gradient for each input no path reaches
        for name in backward.zeros:
            node = self.plan.graph.input_node(name)
            if node is None:  # an input no op reads (x ** 0): the graph keeps no node, so no size, of it
                continue
            zeros.append(Allocation(("zeros", name), allocated_bytes(node.view.numel * node.dtype.itemsize, device_type),
                                    "gradient", f"zero gradient of {name}", "backward end"))
        freed = {a.key for a in run.during if a.bytes < 0}
        events = (forward.during + forward.at_end + incoming + run.during + zeros
                  + run.at_end
                  # torch lets go of the saved tensors once the backward has run (those it read are freed)
                  + release([a for a in list(forward.tape.values()) + saved if a.key not in freed], "after backward")
                  + release(incoming, "after backward"))
        # the gradients are the caller's (as eager's are), whether a kernel or a call wrote them
        events = relabel(events, {a.key for a in grads.values()}, "gradient")
        events = relabel(events, {a.key for a in saved}, "saved library result")
        forward_held, backward_held = forward_run.held_bytes(device_type), backward.executable.held_bytes(device_type)
        if device_type == "cpu":  # autograd runs a CPU backward on the calling thread: one arena for both
            held = {"slab": max(forward_held["slab"], backward_held["slab"])}
        else:  # a device's backward runs on autograd's thread for that device: an arena there too
            held = {"forward slab": forward_held["slab"], "backward slab": backward_held["slab"]}
        held["status words"] = forward_held["status words"] + backward_held["status words"]
        return PeakMemory(held, events, device_type, "training step")

    def dense_layouts(self) -> dict[str, GradLayout]:
        """Gradients arriving dense (as loss.backward() gives a scalar loss's)."""
        outputs = self.plan.graph.outputs
        return {name: (outputs[name].shape, contiguous_strides(outputs[name].shape), outputs[name].dtype.torch)
                for name in self.plan.differentiable_outputs}

    def backward_executable(self, layouts: dict[str, GradLayout]):
        key = tuple(sorted(layouts.items()))
        found = self._backward.get(key)
        if found is None:
            with self._lock, compiling():
                found = self._backward.get(key) or self._compile_backward(key, layouts)
        return found

    def _compile_backward(self, key, layouts):
        returned = {s.name: s.stride for s in self.forward.conversion.outputs if s.kind == "computed"}
        found = backward_graph(self.plan, layouts, returned)
        graph = found.graph
        specs = [OutputSpec("computed", name=name, shape=node.shape, stride=contiguous_strides(node.shape))
                 for name, node in graph.outputs.items()]
        tree = torch.utils._pytree.tree_flatten([0] * len(specs))[1]
        program = build_program(graph, {s.name: s.stride for s in specs}, device=self.device)
        conversion = Conversion(graph, specs, tree, found.constants, 0)
        verify("autograd", verify_constants, conversion)
        retained = Executable(conversion, program)
        # a backward that runs once may give the tape up as it goes: buffers born after a
        # saved value's last read can live in its tape block, so the slab need not hold them;
        # but a block that hosts a buffer is held until that buffer dies, not freed when read.
        # Its library calls' results may also live apart from the slab, allocated as eager's
        # are, or all its buffers (no slab), and the forward's too. Each plan is taken, with a
        # form of the forward, where that lowers the predicted peak of a training step
        tape = {name: tape_bytes(saved) for name, saved in self.forward.tape if name in graph.input_names}
        plans = []
        for form in filter(None, (program, with_library_results_apart(program))):
            plans.append(_Backward(retained if form is program else Executable(conversion, form), retained, found.zeros))
            hosting = with_tape_donated(form, tape)
            if any(hosting.donated.values()):
                plans.append(_Backward(Executable(conversion, hosting), retained, found.zeros))
        apart = with_buffers_apart(program)
        if apart is not None:
            plans.append(_Backward(Executable(conversion, apart), retained, found.zeros))
        pairs = [(forward, plan) for forward in self._forward_forms() for plan in plans]
        # (a tie: the first, plain)
        forward, chosen = min(pairs, key=lambda pair: self._step_memory(pair[1], self.device, pair[0]).peak)
        if forward is not self.forward:  # the form that ran so far holds an arena no run needs now
            POOL.withdraw(self.forward)
            self.forward = forward
        debug.log(1, f"compiled a backward: {len(program.kernels)} kernel(s)")
        debug.log_program(graph, chosen.program)
        self._backward[key] = chosen
        if self.on_backward_compiled is not None:
            self.on_backward_compiled()
        return chosen

    def _forward_forms(self) -> list[Executable]:
        """The forward with its slab, and with its buffers apart (pipeline.with_buffers_apart):
        the same kernels and tape; a backward's compile chooses between them."""
        if self._apart_forward is None:
            apart = with_buffers_apart(self._plain_forward.program)
            if apart is None:
                return [self._plain_forward]
            plain = self._plain_forward
            self._apart_forward = Executable(plain.conversion, apart, tape=self._kept)
        return [self._plain_forward, self._apart_forward]


class _Backward:
    """The backward kernels, and zero gradients for the inputs only piecewise-constant ops reach.
    Two memory plans for the same kernels: `executable` for a backward that runs once (the
    usual loss.backward()), whose buffers may partly live in the tape blocks the forward
    filled, once they have been read (GradExecutable._compile_backward chooses); `retained`
    for one that keeps the graph (retain_graph=True), which leaves the tape as it found it."""

    def __init__(self, executable, retained, zeros: tuple[str, ...]):
        self.executable, self.retained, self.zeros = executable, retained, zeros

    def __getattr__(self, name):  # graph, lowered, launches, slabs...: the kernels'
        return getattr(self.executable, name)

    # (pickled with its GradExecutable; without these, pickle's look-up of __setstate__ on an
    # empty instance would go to __getattr__, which reads an attribute not set yet, and so on)
    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def run(self, tensors: dict[str, torch.Tensor], inputs: dict[str, tuple],
            consumable: frozenset = frozenset()) -> dict[str, torch.Tensor]:
        """Input name -> its gradient. `inputs`: name -> (shape, dtype) of each input;
        consumable: saved values whose memory may be freed once read (see Executable.run),
        given (all of them or none) when this backward runs once."""
        memory = self.executable.run(tensors, consumable=consumable) if consumable else self.retained.run(tensors)
        found = {name[len("grad_"):]: t for (kind, name), t in _outputs(memory) if name.startswith("grad_")}
        for name in self.zeros:
            shape, dtype = inputs[name]
            found[name] = torch.zeros(shape, dtype=dtype, device=_device(tensors))
        return found


def _check_writable(name: str, t: torch.Tensor) -> None:
    """Eager's error for an in-place write into a leaf that requires grad (or into a view of
    one), raised before any kernel writes it."""
    base = t._base if t._is_view() else t
    if base.is_leaf and base.requires_grad:
        view = "a view of " if base is not t else ""
        raise RuntimeError(f"{view}a leaf Variable that requires grad is being used in an in-place operation. "
                           f"(tjit: the function writes into its argument {name!r})")


def _backward_runs_once() -> bool:
    """Whether the backward running now lets go of the graph (no retain_graph): then nothing
    reads the saved values after it."""
    keeps = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keeps is not None and not keeps()


def _backwards_outside_dynamo() -> None:
    """Make Dynamo leave tjit's backwards alone, once it is loaded (a trace loads it, so it is
    by the first forward). torch's autograd engine calls a Function's backward from whatever
    runs `loss.backward()`, and inside a function torch.compile compiles (a training step
    whose graph breaks at backward) Dynamo's frame hook is active there: it traced tjit's
    runtime as user code, compiling its pieces into graphs of their own. (Dynamo's disable
    wrapper turns the hook off for the call and everything it calls.)"""
    if _Compiled.backward is not _BACKWARDS[0] or "torch._dynamo" not in sys.modules:
        return
    import torch._dynamo
    with _LOCK:
        if _Compiled.backward is _BACKWARDS[0]:
            _Rebase.backward = staticmethod(torch._dynamo.disable(_BACKWARDS[1], recursive=True))
            _Compiled.backward = staticmethod(torch._dynamo.disable(_BACKWARDS[0], recursive=True))


def _outputs(memory: dict):
    return [(k, t) for k, t in memory.items() if isinstance(k, tuple) and k[0] == "output"]


def _device(tensors: dict) -> torch.device:
    return next(iter(tensors.values())).device


class _Compiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, compiled: GradExecutable, names: tuple[str, ...], *tensors: torch.Tensor):
        plan = compiled.plan
        inputs = dict(zip(names, tensors))
        memory = compiled.forward.run(inputs)
        outs = tuple(memory[("output", name)] for name in compiled.output_names)
        for m in plan.graph.mutations:  # written in place: autograd nodes that saved it must see that
            torch.autograd.graph.increment_version(inputs[m.name])
        known = {**inputs, **compiled.forward.constants_on(_device(inputs))}  # tensors the function made
        ctx.save_for_backward(*[known[n] for n in plan.saved_inputs],
                              *[memory[("output", n)] for n in plan.saved_outputs + tuple(plan.saved)])
        ctx.compiled, ctx.names = compiled, names
        ctx.input_layouts = {n: (t.shape, t.dtype) for n, t in inputs.items() if n in plan.grad_inputs}
        ctx.set_materialize_grads(False)
        constant = [t for name, t in zip(compiled.output_names, outs) if name not in plan.differentiable_outputs]
        if constant:
            ctx.mark_non_differentiable(*constant)
        return outs

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        if torch.is_grad_enabled():  # create_graph=True: the gradients would be taken as constants
            raise RuntimeError("tjit: double backward (create_graph=True) is not supported; tjit's backward "
                               "kernels are not differentiable themselves")
        compiled: GradExecutable = ctx.compiled
        plan = compiled.plan
        tensors = dict(zip(plan.saved_inputs + plan.saved_outputs + tuple(plan.saved), ctx.saved_tensors))
        layouts = {}
        for name, g in zip(compiled.output_names, grads):
            if g is not None and name in plan.differentiable_outputs:
                layouts[name] = (tuple(g.shape), tuple(g.stride()), g.dtype)
                tensors[incoming_grad_name(name)] = g
        if not layouts:
            return (None, None) + (None,) * len(ctx.names)
        backward = compiled.backward_executable(layouts)
        # the saved intermediates are tjit's alone; a backward that runs once (no retain_graph)
        # frees each as soon as its kernels have read it, as eager's frees an op's saved tensors
        # after that op's backward, rather than all of them once the whole backward is done
        consumable = frozenset(plan.saved) if _backward_runs_once() else frozenset()
        found = backward.run(tensors, ctx.input_layouts, consumable)
        return (None, None) + tuple(found.get(name) for name in ctx.names)


class _Rebase(torch.autograd.Function):
    """An input requiring grad that the call wrote in place gets its new contents' history,
    as eager's in-place op rebases it: its gradient is the gradient of the call's result that
    stands for those contents (`value`, computed in the call's kernels, which wrote them into
    the input too). A Function of its own, because autograd lets a Function that marks a view
    dirty return nothing else."""

    @staticmethod
    def forward(ctx, written: torch.Tensor, value: torch.Tensor):
        ctx.mark_dirty(written)
        return written

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # zeros, not None: for a view, autograd's CopySlices drops the whole base's gradient
        # when the view's is undefined
        return torch.zeros_like(grad), grad


_BACKWARDS = (_Compiled.backward, _Rebase.backward)  # (as defined; _backwards_outside_dynamo wraps them)
_LOCK = threading.Lock()

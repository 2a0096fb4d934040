"""Where kernels run: Triton's interpreter for CPU tensors, compiled kernels for CUDA.

Triton binds `tl.sum`, `tl.max`, ... when it is imported, so the interpreter must be
chosen before that: `tjit` sets TRITON_INTERPRET=1 on import when no CUDA device is
present (and imports triton again if something imported it first).
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import os
import sys
import types
from typing import Optional

import numpy as np
import torch

from ..errors import CompileArgumentError


def choose_interpreter_before_triton_import() -> None:
    """With no CUDA device and no choice made (TRITON_INTERPRET unset), kernels run in the
    interpreter. Triton imported already (Dynamo imports it before it loads a backend by
    name: torch.compile(f, backend="tjit") in a process that imported only torch) is
    imported again in interpreter mode: its language was bound for compiled kernels."""
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        _import_triton_again()


def _import_triton_again() -> None:
    """Forget triton's Python modules (its compiled extension, which cannot be loaded twice,
    stays) and import it anew: modules that hold the old ones (Inductor's) keep them."""
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        if not name.startswith("triton._C"):
            del sys.modules[name]
    import triton  # noqa: F401
    import triton.language  # noqa: F401


def patch_both_language_modules() -> None:
    """A launch patches the language modules its kernel's globals name (triton.language), a
    helper call the ones its own globals name and restores them when it returns: Triton's
    own helpers (tl.max, tl.sum, tl.where's callers in triton.language.standard) name
    triton.language.core, which no kernel names, so every call of one patched it anew and
    restored it (a third of the time of a softmax kernel's launch). A launch patches both
    modules, restored together when it ends, so those helpers find them patched."""
    from triton.runtime import interpreter as ti
    if getattr(ti._patch_lang, "_tjit_both", False):
        return
    patch = ti._patch_lang
    both = types.SimpleNamespace(__globals__={"tl": ti.tl, "core": ti.tl.core})

    def patch_lang(fn):
        return patch(both)

    patch_lang._tjit_both = True
    ti._patch_lang = patch_lang


def restore_patches_after_device_calls() -> None:
    """Work around Triton's interpreter leaving `tl` patched after a call to a @triton.jit
    helper inside a kernel (tl.sigmoid, tl.cdiv, tjit's own helpers): it patches the
    language for the helper and never restores it, which breaks every later compile for a
    real GPU in the same process. Same behaviour, with the patch scope restored. A helper
    whose language modules the calling kernel has patched already is not patched again
    (the same patches; repatching costs milliseconds per call, which a scan's combine
    function calling helpers pays at every step)."""
    from triton.runtime import interpreter as ti
    if getattr(ti.InterpretedFunction.__call__, "_tjit_restores", False):
        return

    def call(self, *args, **kwargs):
        langs = [v for v in self.fn.__globals__.values() if inspect.ismodule(v) and v in (ti.tl, ti.tl.core)]
        scope = None if langs and all(_patched(lang) for lang in langs) else ti._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e
        finally:
            if scope is not None:
                scope.restore()

    call._tjit_restores = True
    ti.InterpretedFunction.__call__ = call


def _patched(lang) -> bool:
    """Whether the interpreter's patches of a language module (triton.language or its core)
    are in place: they replace its static_assert, among the rest."""
    return getattr(getattr(lang, "static_assert", None), "__name__", "") == "_new_static_assert"


def install_patches() -> None:
    """Everything tjit changes in Triton's interpreter (once per process, when interpreting)."""
    restore_patches_after_device_calls()
    patch_both_language_modules()
    pass_cpu_tensors_as_they_are()
    vectorise_custom_reductions_and_scans()
    round_float32_math_from_float64()
    multiply_bfloat16_tiles_as_numbers()
    if os.environ.get("TJIT_PROGRAM_ORDER") == "reverse":
        run_programs_in_reverse()


def run_programs_in_reverse() -> None:
    """TJIT_PROGRAM_ORDER=reverse: each launch runs its programs from the last to the first.
    The interpreter runs them one after another in increasing order, so a kernel whose
    programs read what other programs of the same launch write (a race on a GPU) can give
    the right answer there by the luck of that order; in the other order the same race reads
    the other value. A test suite that passes in both orders has no such pair of programs."""
    from triton.runtime import interpreter as ti
    builder = ti.InterpreterBuilder
    if getattr(builder.set_grid_idx, "_tjit_forward", None) is not None:
        return
    forward = builder.set_grid_idx

    def set_grid_idx(self, x, y, z):
        nx, ny, nz = self.grid_dim
        forward(self, nx - 1 - x, ny - 1 - y, nz - 1 - z)

    set_grid_idx._tjit_forward = forward
    builder.set_grid_idx = set_grid_idx


@contextlib.contextmanager
def programs_in_reverse():
    """Launches inside run their programs last to first (run_programs_in_reverse); the order
    before is restored after."""
    from triton.runtime import interpreter as ti
    builder = ti.InterpreterBuilder
    before = builder.set_grid_idx
    run_programs_in_reverse()
    try:
        yield
    finally:
        builder.set_grid_idx = before


def multiply_bfloat16_tiles_as_numbers() -> None:
    """The interpreter's tl.dot multiplies bfloat16 tiles as their raw 16-bit patterns (numpy
    has no bfloat16): they are widened to float32 first, exactly (a bfloat16 is the top half
    of a float32), and multiplied as tensor cores do, accumulating in float32."""
    from triton.runtime import interpreter as ti
    builder = ti.InterpreterBuilder
    if getattr(builder.create_dot, "_tjit_bfloat16", False):
        return
    dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != ti.tl.bfloat16:
            return handle
        bits = handle.data.view(np.uint16).astype(np.uint32) << 16
        return ti.TensorHandle(bits.view(np.float32), ti.tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    create_dot._tjit_bfloat16 = True
    builder.create_dot = create_dot


def pass_cpu_tensors_as_they_are() -> None:
    """The interpreter hands a kernel host copies of its tensor arguments and copies them back
    after the launch. For CPU tensors the "copy" is a new tensor over the same storage, copied
    back onto itself, and it is made by a recursive closure: a reference cycle that keeps every
    argument's storage alive until the garbage collector next runs, so memory the runtime
    lets go of (a library call's result after its last reader) was not freed when it let go,
    as it is on a GPU. A launch whose tensor arguments are all CPU tensors gets them as they
    are, and nothing is copied back; any other launch (tuples, descriptors, CUDA tensors
    interpreted) converts as before."""
    from triton.runtime import interpreter as ti
    executor = ti.GridExecutor
    if getattr(executor._init_args_hst, "_tjit_as_they_are", False):
        return
    to_host, back = executor._init_args_hst, executor._restore_args_dev

    def plain(arg) -> bool:  # (a Parameter is a CPU tensor too; Triton's TensorWrapper is none)
        return isinstance(arg, torch.Tensor) and arg.device.type == "cpu" if hasattr(arg, "data_ptr") else \
            not isinstance(arg, (tuple, ti.TensorDescriptor))

    def init_args_hst(self, args_dev, kwargs):
        if all(plain(a) for a in args_dev) and all(plain(a) for a in kwargs.values()):
            return list(args_dev), dict(kwargs)
        return to_host(self, args_dev, kwargs)

    def restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
        if all(a is b for a, b in zip(args_dev, args_hst)) and all(kwargs_hst[k] is v for k, v in kwargs.items()):
            return  # the kernel wrote the arguments themselves
        back(self, args_dev, args_hst, kwargs, kwargs_hst)

    init_args_hst._tjit_as_they_are = True
    executor._init_args_hst, executor._restore_args_dev = init_args_hst, restore_args_dev


PRECISE_FUNCTIONS = {"create_exp": np.exp, "create_exp2": np.exp2, "create_log": np.log, "create_log2": np.log2,
                     "create_sin": np.sin, "create_cos": np.cos}


def round_float32_math_from_float64() -> None:
    """The interpreter evaluates tl.exp, tl.log, ... of float32 blocks with numpy's float32
    routines, up to 3-4 ulp off (exp: 2e-7 relative), where CPU eager's are within about
    half an ulp: errors compound through chains such as logcumsumexp's backward. Here they
    are evaluated in float64 and rounded once, so float32 results are (almost always)
    correctly rounded. Other types are as before."""
    from triton.runtime import interpreter as ti
    builder = ti.InterpreterBuilder
    if getattr(builder.create_exp, "_tjit_precise", False):
        return
    for name, fn in PRECISE_FUNCTIONS.items():
        def create(self, arg, fn=fn):
            if arg.data.dtype == np.float32:
                return ti.TensorHandle(fn(arg.data.astype(np.float64)).astype(np.float32), arg.dtype.scalar)
            return self.unary_op(arg, fn)

        create._tjit_precise = True
        setattr(builder, name, create)


def vectorise_custom_reductions_and_scans() -> None:
    """Triton's interpreter runs `tl.reduce` and `tl.associative_scan` with a combine function
    of the kernel's own (tjit's logcumsumexp, cumprod carries, cummax, products) one element
    at a time: a Python call of the combine function per element, minutes for a (64, 513)
    logcumsumexp. Combine functions are elementwise, so these run them on whole blocks
    instead: a scan as Hillis-Steele's (log2(n) calls, each combining every element with the
    one `step` before it), a reduction as a pairwise tree (log2(n) calls). The results are
    those of the same associative combine, in another order (the order a GPU uses is neither);
    `reverse` scans are flipped around this by the interpreter as before."""
    from triton.runtime import interpreter as ti
    if getattr(ti.ScanOps.generic_scan, "_tjit_vectorised", False):
        return
    global _interpreters_reduce, _interpreters_scan
    _interpreters_reduce, _interpreters_scan = ti.ReduceOps.generic_reduce, ti.ScanOps.generic_scan
    ti.ScanOps.generic_scan = _block_scan
    ti.ReduceOps.generic_reduce = _tree_reduce


def _along(axis: int, ndim: int, part: slice) -> tuple:
    """The index of `part` of axis `axis` (all of the other axes)."""
    return tuple(part if d == axis else slice(None) for d in range(ndim))


def _combine_blocks(op, earlier: list, later: list, like: list) -> list:
    """op's combine function applied to two tuples of numpy blocks (earlier values first), as
    numpy arrays of the types of `like` (what the interpreter's own loop stores). Blocks keep
    power-of-two shapes, as Triton's block types must."""
    to = [lambda data, arg=arg: op.to_tensor(data, arg.dtype) for arg in like]
    with np.errstate(all="ignore"):  # lanes whose result is not used may overflow
        found = op.combine_fn.fn(*[t(v) for t, v in zip(to, earlier)], *[t(v) for t, v in zip(to, later)])
    found = found if isinstance(found, tuple) else (found,)
    out = []
    for value, data in zip(found, earlier):
        value = value.handle.data if hasattr(value, "handle") else value
        out.append(np.broadcast_to(np.asarray(value), data.shape).astype(data.dtype))
    return out


def _block_scan(self, input):
    """ScanOps.generic_scan by whole blocks (Hillis-Steele): in the step of width w, each
    element at a position >= w is combined with the one w before it (a rolled copy of the
    block, so shapes stay powers of two; the wrapped lanes are discarded)."""
    axis = self.axis
    values = [arg.handle.data for arg in input]
    n = values[0].shape[axis]
    position = np.arange(n).reshape([n if d == axis else 1 for d in range(values[0].ndim)])
    step = 1
    while step < n:
        combined = _combine_blocks(self, [np.roll(v, step, axis) for v in values], values, input)
        values = [np.where(position >= step, c, v) for v, c in zip(values, combined)]
        step *= 2
    return [self.to_tensor(v, arg.dtype) for v, arg in zip(values, input)]


_block_scan._tjit_vectorised = True
_interpreters_reduce = _interpreters_scan = None  # Triton's own (element by element)


def _tree_reduce(self, input):
    """ReduceOps.generic_reduce by whole blocks: neighbours combined pairwise, earlier element
    first as in the interpreter's own left-to-right loop, halving a power-of-two extent each
    step (another extent, which Triton's blocks never have, takes the interpreter's loop).
    With axis None every operand is flattened (the interpreter's own flattens only the first
    of several)."""
    original_axis = self.axis
    axis = 0 if original_axis is None else original_axis  # None: over all elements, flattened
    values = [arg.handle.data.reshape(-1) if original_axis is None else arg.handle.data for arg in input]
    input_shape = values[0].shape
    n = input_shape[axis]
    if n & (n - 1) or n == 0:
        return _interpreters_reduce(self, input)
    ndim = len(input_shape)
    while values[0].shape[axis] > 1:
        values = _combine_blocks(self, [v[_along(axis, ndim, slice(0, None, 2))] for v in values],
                                 [v[_along(axis, ndim, slice(1, None, 2))] for v in values], input)
    ret = []
    for arg, data in zip(input, values):  # packed as the interpreter's own generic_reduce does
        data = np.squeeze(data, axis)
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(len(input_shape)):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        ret.append(self.to_tensor(data, arg.dtype))
    return ret


def load_for_interpreter(name: str, text: str, path: str):
    """The @triton.jit function `name` of the kernel module `text` (written at `path`),
    rewritten for Triton's interpreter already.

    The interpreter rewrites a kernel's source before its first run: the value of each
    assignment becomes a tensor (`x = v` -> `x = interpreter_semantic.to_tensor(v, False)`)
    and chained comparisons are spelled out (its ASTTransformer). Its rewrite reads the
    source back with inspect and visits every node, about 7 ms a kernel here: a quarter of a
    model's first-call compile. tjit rewrites the tree of the source it has, wrapping the
    assignments in one walk, and compiles the module once, the kernel rewritten (2.6 ms a
    kernel with the module's load; tests/test_runtime.py compares the trees with Triton's)."""
    from triton.runtime import interpreter as ti
    tree = ast.parse(text, filename=path)
    rewritten = _assignments_made_tensors(_function_def(tree, name))
    module = types.ModuleType(name)
    module.__file__ = path
    exec(compile(tree, path, "exec"), module.__dict__)
    kernel = getattr(module, name)
    if rewritten:  # (otherwise Triton's rewrite runs at the first launch)
        for key, value in vars(ti).items():  # (names the rewritten code calls, as Triton's rewrite adds them)
            module.__dict__.setdefault(key, value)
        ti.InterpretedFunction.rewritten_fn[kernel.fn] = kernel.fn
    return kernel


def interpreted_tree(text: str, name: str) -> Optional[ast.FunctionDef]:
    """The function `name` of the module source `text`, without its decorators, as
    load_for_interpreter rewrites it (None: as Triton's rewrite does)."""
    fdef = _function_def(ast.parse(text), name)
    fdef.decorator_list = []
    return fdef if _assignments_made_tensors(fdef) else None


def _function_def(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _assignments_made_tensors(fdef: ast.FunctionDef) -> bool:
    """Rewrites fdef in place as Triton's ASTTransformer does, if that takes no more than
    wrapping each single-target assignment's value (whether it did: a chained comparison, or
    an assignment to several targets, is left to Triton's rewrite)."""
    assignments = []
    for node in ast.walk(fdef):
        kind = type(node)
        if kind is ast.Assign:
            if len(node.targets) > 1:
                return False
            assignments.append(node)
        elif kind is ast.Compare and len(node.ops) > 1:
            return False
    for node in assignments:
        value = node.value
        semantic = _located(ast.Name(id="interpreter_semantic", ctx=ast.Load()), value)
        node.value = _located(ast.Call(func=_located(ast.Attribute(value=semantic, attr="to_tensor", ctx=ast.Load()),
                                                     value),
                                       args=[value, _located(ast.Constant(value=False), value)], keywords=[]), value)
    return True


def _located(node: ast.AST, like: ast.AST) -> ast.AST:
    node.lineno, node.col_offset = like.lineno, like.col_offset
    node.end_lineno, node.end_col_offset = like.end_lineno, like.end_col_offset
    return node


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(device: torch.device) -> None:
    if device.type == "cpu" and not interpreting():
        raise CompileArgumentError(
            "tjit runs CPU tensors through Triton's interpreter, which must be chosen before triton is "
            "imported: set TRITON_INTERPRET=1 in the environment (tjit does so itself on machines without CUDA)")
    if device.type == "cuda" and interpreting():
        return  # the interpreter runs CUDA tensors too (slowly)
    if device.type not in ("cpu", "cuda"):
        raise CompileArgumentError(f"tjit cannot run tensors on device {device}")

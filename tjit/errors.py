"""The errors tjit raises. Each names the op, dtype, shape or argument at fault."""


class TjitError(Exception):
    """Base class of every error tjit raises on purpose."""


class UnsupportedOpError(TjitError, NotImplementedError):
    """An op (or a form of one) that tjit cannot express yet.

    Raised at trace time, before any kernel runs, so the user's tensors are untouched
    and no wrong answer is ever produced.
    """

    def __init__(self, op: str, reason: str = "", where: str = "", target=None):
        self.op, self.reason, self.where = op, reason, where
        self.target = target  # the aten op, so the frontend can find the user's line
        msg = f"tjit cannot compile {op}"
        if reason:
            msg += f": {reason}"
        if where:
            msg += f"\n  called at {where}"
        super().__init__(msg)


class IndexOutOfBoundsError(TjitError, IndexError, RuntimeError):
    """An index out of range, found by a kernel's check (the runtime raises it after the call).
    Eager raises IndexError for some ops (index_select, x[i]) and RuntimeError for others
    (gather, scatter): this is both, so a handler written for either catches it."""


class SplitError(UnsupportedOpError):
    """One trace cannot hold the function; tjit.compile runs it split by Dynamo's graph breaks,
    each graph compiled by tjit where it can be (runtime/split.py)."""


class DataDependentError(SplitError):
    """The function needs a value read from tensor data to go on: an output size (nonzero,
    unique, boolean-mask indexing), a Python number (.item(), torch.equal) or a branch on a
    tensor."""


class NumberNeededError(DataDependentError):
    """A Python number read from tensor data (.item()) goes where tjit needs its value: an
    op whose translation reads it in Python (leaky_relu's slope). Like a branch on it, the
    graph can be compiled with the value in place (once per value)."""


class CustomFunctionError(SplitError):
    """A custom autograd.Function on a gradient path: eager runs its Python backward, which
    tjit does not trace. Dynamo cuts the graph around each such Function, which runs eagerly
    (runtime/split.py)."""


class HigherOrderOpError(SplitError):
    """A higher-order op (torch.cond, while_loop, flex_attention): tjit's trace has no rule
    for one. Dynamo's graph is cut around it, which runs as it is (runtime/split.py)."""


class GradientStateError(SplitError):
    """The function reads or writes a tensor's .grad (clip_grad_norm_, an optimizer step):
    state the trace's copies of the inputs do not carry, so a trace would read None; or it
    registers a gradient hook (register_hook, retain_grad), which tjit's backward would not
    run. Dynamo passes the gradients to its graphs as inputs and keeps the hooks
    (runtime/split.py)."""


class LayoutError(SplitError):
    """A sparse (or other non-strided) tensor: no strided memory for kernels or library calls
    to read; or a lazily negated view, whose memory holds its values unnegated. The graphs
    that hold one run eagerly."""


class CompileArgumentError(TjitError, TypeError):
    """A compiled function was called with arguments tjit cannot accept."""


class EagerError(TjitError, RuntimeError):
    """An error eager PyTorch raises for the same call (an in-place write into memory its
    inputs overlap), raised by tjit at trace time with eager's message, before anything runs."""


_EAGER_KINDS: dict[type, type] = {RuntimeError: EagerError}  # eager's exception type -> its TjitError form


def as_eager_error(e: Exception) -> Exception:
    """Eager's own exception for a call, as tjit raises it: an instance of a class that is both
    a TjitError and e's type (EagerError for a RuntimeError, EagerValueError for a
    ValueError, ...), with e's message, so that `except ValueError` and `except
    tjit.TjitError` both catch it. e itself where no such class can be made (an exception
    type whose layout or constructor does not allow it)."""
    kind = type(e)
    try:
        if kind not in _EAGER_KINDS:
            _EAGER_KINDS[kind] = type(f"Eager{kind.__name__}", (TjitError, kind),
                                      {"__module__": __name__, "__doc__": f"eager's {kind.__name__}, raised by tjit"})
        return _EAGER_KINDS[kind](*e.args)
    except TypeError:
        return e

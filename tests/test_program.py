"""The pipeline (tjit/pipeline.py): Programs, the verifiers between passes, and library-call
results returned as the call left them."""
import pytest
import torch

import tjit
from tjit.ir import DType, Elementwise, GraphBuilder, View, ViewOp
from tjit.pipeline import VerifyError, build_program, trace_and_convert, verify_graph, verify_steps


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_a_program_lists_its_steps_in_order():
    a, b = torch.randn(40, 30), torch.randn(30, 20)
    conversion = trace_and_convert(lambda a, b: torch.relu(a * 2) @ b + 1, (a, b), {})
    strides = {s.name: s.stride for s in conversion.outputs}
    program = build_program(conversion.graph, strides, device="cpu")
    kinds = ["call" if s in program.library_calls else "kernel" for s in program.steps]
    assert kinds == ["kernel", "call", "kernel"]
    assert program.memory.slab_size > 0  # relu(a * 2) lives in the slab until the call reads it


@pytest.mark.usefixtures("library_matmuls")  # (a kernel, then the call that reads its buffer)
def test_verifier_catches_steps_out_of_order():
    a, b = torch.randn(40, 30), torch.randn(30, 20)
    conversion = trace_and_convert(lambda a, b: torch.relu(a * 2) @ b + 1, (a, b), {})
    program = build_program(conversion.graph, {s.name: s.stride for s in conversion.outputs}, device="cpu")
    assert verify_steps(conversion.graph, program.steps) is None
    problem = verify_steps(conversion.graph, program.steps[::-1])
    assert problem is not None and "before any step writes it" in problem


def test_verifier_catches_a_view_of_a_computed_value():
    b = GraphBuilder()
    x = b.input("x", DType.float32, View.contiguous((4, 5)))
    exp = b.node(Elementwise("exp"), DType.float32, (x,), View.contiguous((4, 5)))
    y = b.node(ViewOp(), DType.float32, (exp,), View((5, 4), (1, 5)))
    graph = b.finish(["x"], {"out0": y})
    assert "pushed to the leaves" in verify_graph(graph)
    with pytest.raises(VerifyError, match="after convert"):
        build_program(graph, {"out0": (4, 1)}, device="cpu")


def test_a_call_result_is_returned_without_a_copy():
    a, b = torch.randn(70, 30), torch.randn(30, 50)
    explained = tjit.explain(lambda a, b: a @ b, a, b)
    assert len(explained.kernels) == 0 and len(explained.library_calls) == 1
    torch.testing.assert_close(tjit.compile(lambda a, b: a @ b)(a, b), a @ b)


def test_a_call_result_returned_twice_is_two_tensors():
    """Eager's clone is a new tensor; tjit's IR drops the clone, so the second output is a copy."""
    a, b = torch.randn(70, 30), torch.randn(30, 50)
    first, second = tjit.compile(lambda a, b: ((y := a @ b), y.clone()))(a, b)
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, a @ b)
    torch.testing.assert_close(second, a @ b)


def test_out_receives_a_call_result():
    a, b = torch.randn(70, 30), torch.randn(30, 50)
    out = torch.full((70, 50), float("nan"))
    assert tjit.compile(lambda a, b: a @ b)(a, b, out=out) is out
    torch.testing.assert_close(out, a @ b)


@pytest.mark.usefixtures("library_matmuls")  # (about library calls: a matmul is the call)
def test_saved_call_results_train():
    """A matmul's result saved for backward is the call's tensor itself."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 48, requires_grad=True), torch.randn(48, 40, requires_grad=True)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def f(x, w):
        return torch.tanh(x @ w) @ w.t()

    tjit.compile(f)(x, w).sum().backward()
    f(x2, w2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)


def test_reading_a_reduction_from_its_buffer_keeps_the_other_buffers_read():
    """A store's expression reads a view of a row sum both directly and through a buffer of
    that view (Bert's backward: a select of a layer norm's statistics). Reading the sum from
    its own buffer rewrites the view on the direct path; the buffer of the view must stay the
    node the graph has (its store fills it), not become a copy that no store fills."""
    from tjit.ir import Contiguous, Reduce
    from tjit.lower.domains import read_from_buffers
    b = GraphBuilder()
    x = b.input("x", DType.float32, View.contiguous((2, 16, 48)))
    row_sums = b.node(Reduce("add", (2,)), DType.float32, (x,), View.contiguous((2, 16, 1)))
    first_row = b.node(ViewOp(), DType.float32, (row_sums,), View.contiguous((2, 16, 1)).select(1, 0).expand((2, 48)))
    stored = b.node(Contiguous(), DType.float32, (first_row,), View.contiguous((2, 48)))
    value = b.node(Elementwise("add"), DType.float32, (first_row, stored), View.contiguous((2, 48)))
    sums_buffer = b.node(Contiguous(), DType.float32, (row_sums,), View.contiguous((2, 16, 1)))
    rewritten = read_from_buffers(value, {id(row_sums): sums_buffer})
    assert rewritten.src[1] is stored
    assert rewritten.src[0].src[0] is sums_buffer

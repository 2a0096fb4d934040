"""Gradients of library calls: torch's derivative formulas traced into aten ops (or, where the
formula is one call of a backward op, built directly), converted into the backward graph
(autograd/library_grad.py), so they fuse with the rest of the backward and the op itself is
not run again where the formula does not read its results."""
import pytest
import torch
import torch.nn.functional as F

import tjit
from tjit.autograd.library_grad import trace_formula

# these tests use matrix products as their library calls
pytestmark = pytest.mark.usefixtures("library_matmuls")


def gradients(fn, args, compiled):
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = (compiled or fn)(*leaves)
    torch.manual_seed(3)
    cotangent = torch.rand(out.shape, dtype=out.dtype) + 0.5  # (by shape: the strides of an output may differ)
    out.backward(cotangent)
    return out.detach(), [leaf.grad for leaf in leaves if leaf.requires_grad]


def check(fn, *args, atol=1e-5, rtol=1.3e-6):
    expected, expected_grads = gradients(fn, args, None)
    got, got_grads = gradients(fn, args, tjit.compile(fn))
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)


def backward_calls(fn, *args):
    leaves = [a.detach().clone().requires_grad_() for a in args]
    return [c.op for c in tjit.explain(fn, *leaves).backward.library_calls]


def matmul_relu(x, w, b):
    return torch.relu(x @ w + b) * 2


def conv_relu(x, w):
    return torch.relu(F.conv2d(x, w, padding=1)) + 1


def sorted_exp(x):
    return torch.sort(x * 2 + 1, dim=1).values.exp()


def batched(a, b):
    return torch.tanh(torch.bmm(a, b))


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 3


def max_pool(x):
    return F.max_pool2d(x.sin(), 2) * 2


def heads(x, w, activation):
    """Attention heads as a transformer computes them: [b, s, h, d] values, read by the call
    as the [b, h, s, d] view."""
    b, s, _ = x.shape
    return activation(x @ w).view(b, s, 3, 16).transpose(1, 2)


def heads_attention(x, wq, wk, wv, activation=lambda h: h * 0.5):
    return F.scaled_dot_product_attention(*(heads(x, w, activation) for w in (wq, wk, wv)), is_causal=True)


def tanh_heads_attention(x, wq, wk, wv):  # tanh's derivative saves the heads too
    return heads_attention(x, wq, wk, wv, torch.tanh)


@pytest.mark.parametrize("fn, shapes", [
    (matmul_relu, [(1100, 37), (37, 29), (29,)]),
    (conv_relu, [(2, 3, 17, 19), (5, 3, 3, 3)]),
    (sorted_exp, [(7, 1500)]),
    (batched, [(3, 33, 40), (3, 40, 1030)]),
    (attention, [(2, 3, 40, 16), (2, 3, 40, 16), (2, 3, 40, 16)]),
    (max_pool, [(2, 3, 33, 34)]),
    (tanh_heads_attention, [(2, 40, 24), (24, 48), (24, 48), (24, 48)]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_gradients_match_eager(fn, shapes):
    torch.manual_seed(0)
    check(fn, *[torch.randn(s) for s in shapes], atol=2e-5)


@pytest.mark.parametrize("fn", [
    lambda x, w: (w @ (x[:70] * 2)) @ x[:70].t(),
    lambda x, w: (w @ x[:70]).relu() @ (x[:70].t() + 1),
    lambda x, w: torch.nn.functional.linear(w @ x[:70].t(), x[:70]),
], ids=["scaled", "relu", "linear"])
def test_a_products_operand_whose_transpose_is_another_operand_is_kept_for_backward(fn):
    """The derivative formula of `h @ x[:70].t()` reads x[:70].t() transposed, a value equal
    to x[:70], which the other product reads: the plan took that for the read and kept a
    copy of x[:70], while the backward rebuilt the operand from x itself, which it did not
    have (KeyError 'x' in the backward, for the first of these)."""
    check(fn, torch.randn(300, 70) / 4, torch.randn(300, 70) / 4, atol=1e-4, rtol=1e-4)


def test_matmul_backward_is_two_matmuls_not_a_forward_run_again():
    x, w, b = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16)
    assert backward_calls(matmul_relu, x, w, b) == ["aten.mm.default", "aten.mm.default"]


def test_a_matmul_operand_the_forward_writes_is_kept_for_backward_not_written_again():
    # sin(x) is written to memory for the forward's mm, and the weight's gradient hands it to
    # another mm: the tape keeps that buffer (as eager's autograd keeps it), so the backward's
    # only kernel is cos(x) * (g @ w.T), and the forward writes sin(x) once (no copy of it)
    x, w, g = torch.randn(70, 30, requires_grad=True), torch.randn(30, 50, requires_grad=True), torch.randn(70, 50)
    cf = tjit.compile(lambda x, w: x.sin() @ w)
    before = tjit.counters.launches
    out = cf(x, w)
    forward = tjit.counters.launches - before
    grads = torch.autograd.grad(out, (x, w), g)
    assert (forward, tjit.counters.launches - before - forward) == (1, 1)
    expected = torch.autograd.grad(x.sin() @ w, (x, w), g)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_attention_operands_are_kept_in_the_layout_the_call_read():
    # q, k, v are written [b, s, h, d] for the forward's call, which reads them as [b, h, s, d]
    # views; its backward reads them again as the forward's call did. The tape keeps them in
    # that layout: the forward's kernel writes them straight into their tape blocks (no copy
    # after the call) and the backward's call reads them as they are (no copy before it)
    torch.manual_seed(0)
    args = [torch.randn(2, 40, 24, requires_grad=True)] + [torch.randn(24, 48, requires_grad=True) for _ in range(3)]
    compiled = tjit.compile(heads_attention)
    before = tjit.counters.launches
    out = compiled(*args)
    forward = tjit.counters.launches - before
    g = torch.randn(out.shape)
    grads = torch.autograd.grad(out, args, g)
    assert (forward, tjit.counters.launches - before - forward) == (1, 1)
    for got, want in zip(grads, torch.autograd.grad(heads_attention(*args), args, g)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def packed_heads_attention(x, w):
    """One linear makes q, k and v (a ViT's qkv): its gradient is placed from the three heads'."""
    b, s, _ = x.shape
    q, k, v = F.linear(x, w).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v)


def test_a_gradient_two_calls_read_in_two_layouts_is_written_once():
    # the linear's backward reads the qkv gradient g as g @ w and as g.t() @ x; written for the
    # second in its traced layout (g.t() permuted back to g's own), it is the same buffer as
    # for the first, not a second copy of it (ValueBuilder.view: a permutation permuted back
    # is the node itself)
    from tjit.ir import Contiguous, toposort
    torch.manual_seed(0)
    x, w = torch.randn(3, 40, 16), torch.randn(48, 16)
    check(packed_heads_attention, x, w, atol=2e-5)
    backward = tjit.explain(packed_heads_attention, x.requires_grad_(), w.requires_grad_()).backward
    written = [n.shape for n in toposort(backward.graph.roots()) if isinstance(n.op, Contiguous)]
    assert written == [(120, 48)], written


def test_convolution_backward_does_not_run_the_convolution_again():
    assert backward_calls(conv_relu, torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)) == [
        "aten.convolution_backward.default"]


def test_the_formula_is_aten_ops_of_the_gradient():
    """Traced on fake tensors: mm's formula reads both operands and never calls mm on them
    as the forward does."""
    x, w = torch.randn(64, 32), torch.randn(32, 16)
    explained = tjit.explain(lambda x, w: x @ w, x.requires_grad_(), w.requires_grad_())
    node = next(n for n in explained.graph.nodes() if "library" in str(n.op.__class__).lower()
                or type(n.op).__name__ == "Extern")
    formula = trace_formula(node, (0, 1), node)
    calls = [n.target for n in formula.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.aten.mm.default) == 2


def test_half_precision_matmul():
    torch.manual_seed(0)
    x, w = torch.randn(70, 33, dtype=torch.bfloat16), torch.randn(33, 21, dtype=torch.bfloat16)
    check(lambda x, w: (x @ w).float().sigmoid(), x, w, atol=1e-2, rtol=1e-2)


def test_an_operand_without_gradient_is_not_needed():
    torch.manual_seed(0)
    x, w = torch.randn(50, 20), torch.randn(20, 10).requires_grad_()

    def f(x, w):
        return (x @ w).cos()

    got = tjit.compile(f)(x, w)
    got.sum().backward()
    w2 = w.detach().clone().requires_grad_()
    f(x, w2).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)


@pytest.mark.parametrize("fn, shapes", [
    (lambda x: torch.sort(x, 0).values.t().exp(), [(1500, 7)]),  # a saved output returned transposed
    (lambda a: torch.linalg.inv(a + 6 * torch.eye(37)), [(37, 37)]),  # the call's result is column-major
    (lambda a, b: torch.linalg.solve_triangular(a.triu() + 5 * torch.eye(33), b, upper=True), [(33, 33), (33, 1030)]),
    (lambda x: torch.polygamma(2, x.abs() + 1), [(2000,)]),  # the formula calls polygamma(3, x): not the forward
], ids=["sorted-transposed", "inv", "solve_triangular", "polygamma"])
def test_gradients_read_saved_values_in_their_layout(fn, shapes):
    """A saved forward output is read in the layout it is returned in (eager's, here not
    contiguous); only the op's own call on its own arguments stands for the forward."""
    torch.manual_seed(0)
    check(fn, *[torch.randn(s) for s in shapes], atol=1e-4, rtol=1e-4)


def test_sort_backward_reads_the_forward_indices_instead_of_sorting_again():
    x = torch.randn(7, 1500)
    assert backward_calls(sorted_exp, x) == []  # a scatter by the forward's indices, fused (an IR Scatter)
    assert backward_calls(lambda x: F.max_pool2d(x, 2) * 2, torch.randn(2, 3, 8, 8)) == [
        "aten.max_pool2d_with_indices_backward.default"]


def test_an_indexed_read_in_a_formula_wraps_negative_indices():
    """put's derivative takes the gradient at the indices: negative ones count from the end."""
    torch.manual_seed(0)
    index = torch.tensor([-7, -5, -3, 1100])
    check(lambda x, s: torch.put(x, index, s).exp(), torch.randn(40, 30), torch.randn(4))


def test_as_strided_copy_of_overlapping_windows():
    """as_strided addresses its operand's storage: the call gets an operand that is a whole
    storage, as the trace's was."""
    torch.manual_seed(0)
    check(lambda x: torch.as_strided_copy(x * 2, (1200, 3), (1, 1)).sin(), torch.randn(1300))


def test_ops_whose_decomposition_differs_from_eager_run_whole():
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    target = torch.tensor([[0, -1, 2, 3, 4], [1, 2, -1, 0, 0], [4, 3, 2, 1, 0], [-1, 1, 0, 2, 3]])
    check(lambda x: F.multilabel_margin_loss(x, target), x)  # a -1 inside a row ends the row
    check(lambda x: torch.special.log_ndtr(x * 10), torch.randn(2000))  # finite gradient far out
    index = torch.tensor([0, 2, 2, 5])  # a repeated index fills once
    check(lambda x, v: x.index_fill(1, index, v) * 3, torch.randn(30, 1100), torch.tensor(1.5))


@pytest.mark.parametrize("include_self", [False, True])
@pytest.mark.parametrize("shape", [(), (3000,)])
def test_scatter_reduce_mean_gradient(shape, include_self):
    # the formula gathers a count, a literal for 0-d operands: a gather of a literal read no
    # memory and had no buffer (AttributeError 'NoneType' object has no attribute 'op')
    torch.manual_seed(0)
    n = shape[0] if shape else 1
    index = torch.randint(0, max(n // 4, 1), shape)
    fn = lambda x, src: x.scatter_reduce(0, index, src, "mean", include_self=include_self) * 2  # noqa: E731
    check(fn, torch.randn(shape), torch.randn(shape))


def test_a_formula_is_traced_once_per_op_arguments_and_layouts(monkeypatch):
    """Layers that call the same op on the same shapes share one traced formula; another
    argument value (a sort's dimension) or another layout gets its own, and every gradient is
    eager's."""
    from tjit.autograd import library_grad
    traced = []
    real = library_grad.trace_formula
    monkeypatch.setattr(library_grad, "_FORMULAS", {})
    monkeypatch.setattr(library_grad, "trace_formula", lambda *a: traced.append(a[0].op.call.name) or real(*a))

    def layers(x):
        h = torch.sort(torch.tanh(x), dim=1).values  # the same shapes three times
        h = torch.sort(torch.sin(h), dim=1).values
        h = torch.sort(torch.cos(h), dim=1).values
        return torch.sort(h, dim=2).values.sum() + torch.sort(x.transpose(1, 2), dim=1).values.sum()  # (another layout)

    torch.manual_seed(0)
    check(layers, torch.randn(4, 8, 8), atol=1e-4, rtol=1e-4)
    assert traced.count("aten.sort.default") == 3, traced


def test_one_call_formulas_are_built_without_a_trace(monkeypatch):
    """A convolution's, CPU flash attention's and a max pool's gradient is one call of their
    backward op (autograd/direct_formulas.py), built without tracing torch's formula, and is
    eager's: strides, padding, dilation, groups, a transposed convolution, 1-d and 3-d ones,
    operands without a gradient, a causal mask, a scale, a mask tensor, 16-bit types, sizes
    over several programs."""
    from tjit.autograd import library_grad
    monkeypatch.setattr(library_grad, "_FORMULAS", {})
    monkeypatch.setattr(library_grad, "trace_formula", lambda *a: pytest.fail(f"traced {a[0].op.call.name}'s formula"))
    torch.manual_seed(0)
    tol = dict(atol=1e-4, rtol=1e-4)
    check(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, dilation=2, groups=2).tanh(),
          torch.randn(2, 4, 33, 35), torch.randn(6, 2, 3, 3), torch.randn(6), **tol)
    check(lambda x, w: F.conv1d(x, w, padding=2).sin(), torch.randn(3, 5, 300), torch.randn(7, 5, 5), **tol)
    check(lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, output_padding=1).cos(), torch.randn(2, 3, 9, 10),
          torch.randn(3, 4, 3, 3), torch.randn(4), **tol)
    check(lambda x, w: F.conv3d(x, w).relu(), torch.randn(1, 2, 5, 6, 7), torch.randn(3, 2, 2, 2, 2), **tol)
    x, w = torch.randn(2, 4, 20, 21), torch.randn(6, 4, 3, 3)
    check(lambda x: F.conv2d(x, w, padding=1).sin(), x, **tol)  # the weight without a gradient
    check(lambda w, b: F.conv2d(x, w, b, padding=1).sin(), w, torch.randn(6), **tol)  # the input without one
    for dtype, atol in ((torch.float16, 2e-2), (torch.bfloat16, 0.15)):  # (eager rounds sin's derivative to 16 bits)
        check(lambda x, w, b: F.conv2d(x, w, b).sin(), torch.randn(2, 3, 12, 13, dtype=dtype),
              torch.randn(4, 3, 3, 3, dtype=dtype), torch.randn(4, dtype=dtype), atol=atol, rtol=atol)
    q, k, v = (torch.randn(2, 3, 70, 16) for _ in range(3))
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True) * 3, q, k, v, **tol)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), q, k, v, **tol)
    mask = torch.randn(70, 70)
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sin(), q, k, v, **tol)
    check(lambda q, v: F.scaled_dot_product_attention(q, q, v).sin(), q, v, **tol)  # (q is k too)
    check(lambda x: F.max_pool2d(x.sin(), 3, stride=2, padding=1, ceil_mode=True) * 2, torch.randn(2, 3, 33, 34), **tol)
    check(lambda x: F.max_pool2d(x.sin(), 2, dilation=2) * 2, torch.randn(2, 3, 33, 34), **tol)
    check(lambda x: F.max_pool2d(x, 2) * 2, torch.randn(2, 3, 33, 34, dtype=torch.bfloat16), atol=1e-2, rtol=1e-2)


def test_matrix_products_gradients_without_a_traced_formula(monkeypatch):
    """mm, bmm and addmm (any beta and alpha, a bias of any broadcast shape) get their
    gradients as library products, ATen's formulas, with no formula traced: at sizes over
    several programs, a transposed (column-major) operand, size-1 sides, operands without a
    gradient, 16-bit types."""
    from tjit.autograd import library_grad
    monkeypatch.setattr(library_grad, "_FORMULAS", {})
    monkeypatch.setattr(library_grad, "trace_formula", lambda *a: pytest.fail(f"traced {a[0].op.call.name}'s formula"))
    torch.manual_seed(0)
    check(lambda x, w: torch.tanh(x @ w.t()), torch.randn(70, 300), torch.randn(90, 300), atol=1e-4, rtol=1e-4)
    check(lambda a, b: torch.bmm(a, b).sin(), torch.randn(3, 40, 70), torch.randn(3, 70, 1), atol=1e-4, rtol=1e-4)
    for bias in (torch.randn(90), torch.randn(1, 90), torch.randn(70, 1), torch.randn(())):
        check(lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=-2.0).cos(), bias, torch.randn(70, 300),
              torch.randn(300, 90), atol=1e-4, rtol=1e-4)
    w = torch.randn(90, 300)
    check(lambda b, x: F.linear(x, w, b).relu(), torch.randn(90), torch.randn(1, 300), atol=1e-4, rtol=1e-4)
    for dtype in (torch.float16, torch.bfloat16):
        check(lambda b, x, w: F.linear(x, w, b) * 3, torch.randn(33, dtype=dtype), torch.randn(50, 70, dtype=dtype),
              torch.randn(33, 70, dtype=dtype), atol=2e-2, rtol=2e-2)


def test_a_reshape_of_a_reshape_back_into_a_library_call():
    """x.reshape(a).reshape(b) is x's own expression again, so it was recorded as a view of
    its view, a cycle that sent the operand's placing round it forever (MobileBERT's
    training step: RecursionError)."""
    def f(x, w):
        a = (x * 2).reshape(4, 8, 16)
        return (a.reshape(32, 16) @ w).sin() + a.sum()

    check(f, torch.randn(32, 16), torch.randn(16, 300), atol=1e-4, rtol=1e-4)


def test_a_library_result_returned_reshaped_can_be_written_in_place_as_eagers():
    """wav2vec2 masks time steps of a linear's output in place (`h[mask] = embedding`) after a
    graph break: the mm's [78, 32] result returned as [2, 39, 32] must not be a view of it,
    which autograd forbids writing into (a view a Function returns); eager's linear returns
    an _unsafe_view, which it allows."""
    torch.manual_seed(0)

    def project(x, w):
        return F.linear(F.layer_norm(x.transpose(1, 2), (8,)), w)

    x, w, embedding = torch.randn(2, 8, 39), torch.randn(32, 8), torch.randn(32)
    mask = torch.rand(2, 39) < 0.3
    cotangent = torch.randn(2, 39, 32)
    results = []
    for fn in (project, tjit.compile(project)):
        leaves = [t.clone().requires_grad_() for t in (x, w, embedding)]
        h = fn(*leaves[:2])
        assert not h._is_view()
        h[mask] = leaves[2]
        h.backward(cotangent)
        results.append([h.detach()] + [leaf.grad for leaf in leaves])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1.3e-6)

"""Aten ops tjit does not generate run as library calls (the op itself), and the work around
them still fuses: a program of kernels and calls, against eager on fresh inputs."""
import pytest
import torch
import torch.nn.functional as F

import tjit

from helpers import check_against_eager

# these tests use matrix products as their library calls
pytestmark = pytest.mark.usefixtures("library_matmuls")


def steps(cf, *args):
    """(kernels launched, library calls run) by one call."""
    launches, calls = tjit.counters.launches, tjit.counters.library_calls
    cf(*args)
    return tjit.counters.launches - launches, tjit.counters.library_calls - calls


def test_conv_then_pointwise_is_one_call_and_one_kernel(fresh_seed):
    x, w, y = torch.randn(2, 3, 40, 40), torch.randn(4, 3, 3, 3), torch.randn(2, 4, 38, 38)
    cf = check_against_eager(lambda x, w, y: torch.relu(F.conv2d(x, w)) + y, x, w, y)
    assert steps(cf, x, w, y) == (1, 1)


def test_sort_between_pointwise_work_is_a_kernel_before_and_one_after(fresh_seed):
    x = torch.randn(70, 300)
    cf = check_against_eager(lambda x: torch.exp(torch.sort(2 * x + 1, dim=1).values), x)
    assert steps(cf, x) == (2, 1)


def test_matmul_epilogue_and_reduction_fuse_after_the_call(fresh_seed):
    x, w, b = torch.randn(300, 64), torch.randn(64, 200), torch.randn(200)
    cf = check_against_eager(lambda x, w, b: torch.softmax(F.gelu(x @ w + b), -1), x, w, b)
    assert steps(cf, x, w, b) == (1, 1)


def test_a_transposed_computed_operand_is_written_once_in_the_layout_the_call_reads():
    # the traced mm reads (2x)^T as a transposed view of a dense tensor: the value is computed
    # straight into that layout, not written dense and then copied
    x, y = torch.randn(70, 30), torch.randn(70, 50)
    cf = check_against_eager(lambda x, y: torch.mm((x * 2).t(), y), x, y)
    assert steps(cf, x, y) == (1, 1)


def test_a_norm_feeding_a_matmul_through_merged_axes_is_one_kernel():
    # layer_norm over [b, t, d] handed to mm as [b*t, d]: the normalised value is written by
    # the kernel that reduces, through the merged view
    x, w, b = torch.randn(3, 50, 48), torch.randn(48, 20), torch.randn(48)
    cf = check_against_eager(lambda x, w, b: (F.layer_norm(x, (48,)) + b).reshape(-1, 48) @ w, x, w, b)
    assert steps(cf, x, w, b) == (1, 1)


def test_an_operand_a_late_call_reads_is_written_by_the_last_kernel_of_its_shape_before_it():
    # sin(x) is ready at once but only the last mm reads it: it joins cos(z)'s kernel, the last
    # one over [64, 96] before that mm, instead of a kernel of its own whose buffer would
    # live through the two mm calls between
    def fn(x, w1, w2, v):
        y = torch.relu(x @ w1) @ w2
        return x.sin().t() @ (y.cos() @ v)
    x, w1, w2, v = torch.randn(64, 96), *(torch.randn(96, 96) / 10 for _ in range(3))
    cf = check_against_eager(fn, x, w1, w2, v)
    assert steps(cf, x, w1, w2, v) == (2, 4)


def test_a_call_result_returned_reshaped_is_the_output_itself():
    # logits [b*t, v] returned as [b, t, v]: a view of the call's tensor, no copy kernel
    x, w = torch.randn(2, 35, 30), torch.randn(30, 50)
    cf = check_against_eager(lambda x, w: (x.reshape(-1, 30) @ w).reshape(2, 35, 50), x, w)
    assert steps(cf, x, w) == (0, 1)
    fn = lambda x, w: (x.reshape(-1, 30) @ w).reshape(2, 35, 50).transpose(0, 1)  # noqa: E731
    cf = check_against_eager(fn, x, w)
    assert steps(cf, x, w) == (0, 1)
    assert cf(x, w).stride() == fn(x, w).stride()  # eager's view of the result, as eager returns it


RETURNED_PERMUTED = {
    "square_product_transposed": (lambda a, b: (a @ b).t(), lambda: (torch.randn(70, 40), torch.randn(40, 70))),
    "sorted_square_transposed": (lambda a: torch.sort(a, 1).values.t(), lambda: (torch.randn(70, 70),)),
    "conv_channels_last_view": (lambda y, w: F.conv2d(y, w).permute(0, 2, 3, 1),
                                lambda: (torch.randn(2, 3, 9, 9), torch.randn(9, 3, 1, 1))),
    "conv_transposed_square_image": (lambda y, w: F.conv2d(y, w).transpose(2, 3),
                                     lambda: (torch.randn(2, 3, 40, 40), torch.randn(4, 3, 1, 1))),
}


@pytest.mark.parametrize("name", RETURNED_PERMUTED)
def test_a_call_result_returned_permuted_to_its_own_shape_is_the_permuted_view(name, fresh_seed):
    """A call's result returned through a permutation that keeps its shape (a square product
    transposed, an NCHW result viewed NHWC where C == H == W): the output is the result's
    memory through the permuted view, with eager's strides. It was the result itself
    (the runtime took an output of the result's shape for the result): transposed values."""
    fn, make = RETURNED_PERMUTED[name]
    args = make()
    got = check_against_eager(fn, *args)(*args)
    assert got.stride() == fn(*args).stride()


def test_a_returned_value_a_call_reads_is_written_once():
    # the buffer the mm reads is the returned tensor itself (no kernel copies it out)
    x, w = torch.randn(70, 30), torch.randn(30, 50)
    fn = lambda x, w: (x.sin() @ w, x.sin())  # noqa: E731
    cf = check_against_eager(fn, x, w)
    assert steps(cf, x, w) == (1, 1)
    assert [k.bytes_written for k in tjit.explain(fn, x, w).kernels] == [x.numel() * 4]
    out = (torch.empty(70, 50), torch.empty(70, 30))
    got = cf(x, w, out=out)
    assert got[1] is out[1]
    torch.testing.assert_close(out[1], x.sin())


PROGRAMS = {
    "addmm": (lambda x, w, b: torch.addmm(b, x, w).tanh(), lambda: (torch.randn(70, 30), torch.randn(30, 50),
                                                                      torch.randn(50))),
    "linear_transposed_weight": (lambda x, w: F.linear(x * 2, w.t()), lambda: (torch.randn(70, 30),
                                                                               torch.randn(30, 50))),
    "bmm_attention": (lambda q, k, v: torch.softmax(q @ k.transpose(1, 2) / 8, -1) @ v,
                      lambda: (torch.randn(4, 33, 16), torch.randn(4, 40, 16), torch.randn(4, 40, 16))),
    "cat": (lambda x, y: torch.cat([x.exp(), y, x * y], 1).sum(1), lambda: (torch.rand(70, 30) + 0.5,
                                                                           torch.rand(70, 30) + 0.5)),
    "stack": (lambda x, y: torch.stack([x, y + 1]).amax(0), lambda: (torch.randn(70, 30), torch.randn(70, 30))),
    "arange": (lambda x: x + torch.arange(x.shape[1]), lambda: (torch.randn(70, 300),)),
    "pad": (lambda x: F.pad(x * 2, (1, 2, 0, 3)) + 1, lambda: (torch.randn(70, 30),)),
    # (x * 2 + 1 rounds as eager does: sin() one ulp apart from eager's could break a tie near 1.0 the
    # other way and swap two indices)
    "topk": (lambda x: torch.topk(x * 2 + 1, 5, dim=1), lambda: (torch.randn(70, 300),)),
    "index_put": (lambda x, i: x.index_put((i,), torch.ones(())) * 2, lambda: (torch.randn(70, 30),
                                                                               torch.tensor([0, 3, 69]))),
    "scatter_reduce": (lambda x, i, s: x.scatter_reduce(0, i, s * 2, "amax"),
                       lambda: (torch.randn(10, 30), torch.randint(0, 10, (70, 30)), torch.randn(70, 30))),
    "roll": (lambda x: torch.roll(x, 3, 1) - x, lambda: (torch.randn(70, 30),)),
    "tril": (lambda x: torch.tril(x * x), lambda: (torch.randn(70, 30),)),
    "where_nonzero_free": (lambda x: torch.searchsorted(torch.sort(x.flatten()).values, x), lambda: (torch.randn(70, 30),)),
    "int_matmul_and_cast": (lambda a, b: (a @ b).float() / 3, lambda: (torch.randint(-5, 5, (20, 30)),
                                                                       torch.randint(-5, 5, (30, 10)))),
    "fp16_mm": (lambda a, b: (a @ b).float().sum(1), lambda: (torch.randn(20, 30).half(), torch.randn(30, 10).half())),
    "zero_size": (lambda a, b: torch.relu(a @ b) + 1, lambda: (torch.randn(0, 30), torch.randn(30, 10))),
    "empty_contraction": (lambda a, b: (a @ b) + 1, lambda: (torch.randn(20, 0), torch.randn(0, 10))),
    # a call whose operand a variance (straight_through, which lowering replaces) computes: the
    # call's result was rebuilt after tjit's plan of its memory, which then missed it, and the op
    # wrote it in its own layout, not the channels-last one the kernel after it read (Segformer, VAN)
    "channels_last_norm_then_conv": (
        lambda x, w: F.conv2d(x * torch.rsqrt(x.var((2, 3), keepdim=True, unbiased=False) + 1e-5), w).exp(),
        lambda: (torch.randn(3, 16, 30, 30).contiguous(memory_format=torch.channels_last), torch.randn(5, 16, 1, 1) / 4)),
    "norm_over_channels_last_then_strided_conv": (
        lambda a, w: F.conv2d(F.layer_norm(F.batch_norm(a, None, None, training=True).flatten(2).transpose(1, 2), (8,))
                              .view(3, 20, 20, 8).permute(0, 3, 1, 2), w, None, 2, 1).tanh(),
        lambda: (torch.randn(3, 8, 20, 20), torch.randn(16, 8, 3, 3) / 4)),
}


# index arithmetic inside the kernels (test_shape_ops.py, test_index_put.py)
FUSED = ("arange", "cat", "stack", "pad", "roll", "tril", "index_put")


@pytest.mark.parametrize("name", PROGRAMS)
def test_programs_with_library_calls_match_eager(name, fresh_seed):
    fn, make = PROGRAMS[name]
    cf = check_against_eager(fn, *make())
    calls = tjit.explain(cf, *make()).library_calls
    if name in FUSED:
        assert not calls, f"{name} should be fused, not a library call: {calls}"
    else:
        assert calls, "expected at least one library call"


def test_a_call_reading_an_input_runs_before_the_input_is_overwritten(fresh_seed):
    def f(x):
        y = torch.sort(x, 1).values
        x.mul_(2)
        return y + x
    check_against_eager(f, torch.randn(70, 300))


def test_a_call_reading_an_input_after_it_is_overwritten(fresh_seed):
    def f(x):
        x.mul_(2)
        return torch.sort(x, 1).values + 1
    check_against_eager(f, torch.randn(70, 300))


def test_in_place_library_op_writes_the_callers_tensor(fresh_seed):
    def f(x, i):
        x.index_fill_(0, i, 7.0)  # (a library call: its decomposition's gradient differs from eager's)
        return x.sum(1)
    check_against_eager(f, torch.randn(70, 300), torch.tensor([0, 5, 69]))


def test_a_buffer_read_by_a_call_and_a_later_kernel_lives_until_both_ran(fresh_seed):
    def f(x, w):
        a = x * 2 + 1
        m = a @ w
        return m.sum(1), (a + 1).t() * 3
    # positive values: row sums that do not cancel, within float32 tolerance in any order
    check_against_eager(f, torch.rand(70, 300) + 0.5, torch.rand(300, 20) + 0.5)


def test_a_result_that_views_its_operand_outlives_the_operands_buffer(fresh_seed):
    def f(x):
        windows = (x * 2).unfold(1, 4, 3)   # a view of a computed value, made by the op itself
        return windows.sum(-1) + (x + 1).sum()
    check_against_eager(f, torch.randn(70, 300))


def test_library_call_steps_are_listed_by_explain(fresh_seed):
    x = torch.randn(8, 9)
    ex = tjit.explain(lambda x: torch.exp(torch.sort(x, 1).values), x)
    assert [c.op for c in ex.library_calls] == ["aten.sort.default"]
    assert "library call aten.sort.default" in str(ex)


GRADIENTS = {
    "mlp_cross_entropy": (lambda x, w, b, t: F.cross_entropy(F.gelu(x @ w + b), t),
                          lambda: (torch.randn(70, 100), torch.randn(100, 30), torch.randn(30),
                                   torch.randint(0, 30, (70,)))),
    "linear_after_layer_norm": (lambda x, w, b: F.linear(F.layer_norm(x, (100,)), w, b).pow(2).mean(),
                                lambda: (torch.randn(70, 100), torch.randn(30, 100), torch.randn(30))),
    "sort_then_scan": (lambda x: torch.sort(x * 2, 1).values.cumsum(1).sum(), lambda: (torch.randn(70, 300),)),
    "conv_relu": (lambda x, w: torch.relu(F.conv2d(x, w, padding=1)).sum(),
                  lambda: (torch.randn(2, 3, 16, 16), torch.randn(4, 3, 3, 3))),
    "attention": (lambda q, k, v: (torch.softmax(q @ k.transpose(1, 2) / 4, -1) @ v).sum(),
                  lambda: (torch.randn(2, 10, 8), torch.randn(2, 12, 8), torch.randn(2, 12, 8))),
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).sum(),
                    lambda: (torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8))),
    "cat_of_computed": (lambda a, b: torch.cat([a.exp(), b], 1).pow(2).sum(),
                        lambda: (torch.randn(5, 7), torch.randn(5, 3))),
}


@pytest.mark.parametrize("name", GRADIENTS)
def test_gradients_through_library_calls_match_eager(name, fresh_seed):
    """torch's own derivative formula for each call, run as a library call in the backward."""
    fn, make = GRADIENTS[name]
    args = make()
    eager = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    ours = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    expected = fn(*eager)
    expected.backward()
    got = tjit.compile(fn)(*ours)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # a loss summed in another order
    for e, o in zip(eager, ours):
        if e.requires_grad:
            torch.testing.assert_close(o.grad, e.grad, rtol=1e-4, atol=1e-5)


def test_a_linear_model_trains_as_eager_does(fresh_seed):
    """Five SGD steps of Linear -> gelu -> Linear -> cross-entropy, compiled and eager side by side."""
    torch_model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))
    ours = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))
    ours.load_state_dict(torch_model.state_dict())
    compiled = torch.compile(ours, backend="tjit")
    for model, run in ((torch_model, torch_model), (ours, compiled)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            x, t = torch.randn(16, 20, generator=gen), torch.randint(0, 5, (16,), generator=gen)
            loss = F.cross_entropy(run(x), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
    for p, q in zip(torch_model.parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


def test_library_calls_without_gradients_next_to_differentiable_work(fresh_seed):
    """A call on values that carry no gradient does not stop the rest from differentiating."""
    x = torch.randn(70, 30, requires_grad=True)
    idx = torch.randint(0, 30, (70, 30))

    def f(x, idx):
        order = torch.argsort(idx, 1)       # integers: no gradient flows through the sort
        return (x.gather(1, order) * 2).sum()
    expected_x = x.detach().clone().requires_grad_()
    f(expected_x, idx).backward()
    got = tjit.compile(f)(x, idx)
    got.backward()
    torch.testing.assert_close(x.grad, expected_x.grad)


def _same_training_step(make_model, x):
    """One forward and backward of a model compiled with backend='tjit' and of an eager copy:
    outputs, parameter gradients and buffers (batch norm's running statistics) agree."""
    ours, eager = make_model(), make_model()
    eager.load_state_dict(ours.state_dict())
    got, expected = torch.compile(ours, backend="tjit")(x), eager(x)
    got.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
    for (name, b), c in zip(ours.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, msg=lambda m: f"buffer {name}: {m}")


def test_a_transformer_encoder_layer_trains_as_eager(fresh_seed):
    torch._dynamo.reset()
    _same_training_step(lambda: torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                        torch.randn(2, 10, 32))


def test_a_cnn_with_batch_norm_trains_as_eager(fresh_seed):
    """Convolution and linear layers as library calls around a batch norm of tjit's own kernels
    (running statistics updated once, in the forward)."""
    torch._dynamo.reset()
    _same_training_step(lambda: torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10)), torch.randn(4, 3, 16, 16))


@pytest.mark.parametrize("fn", [lambda x: x.sum().item(), lambda x: x * x.sum().item(), lambda x: x.max().item() > 0])
def test_python_numbers_read_from_tensor_data_are_read_not_faked(fn):
    """make_fx stands a symbolic number in for .item(); the function then runs split at that
    point (tests/test_data_dependent.py), with the number read from the data."""
    x = torch.randn(5)
    got, expected = tjit.compile(fn)(x), fn(x)
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected)
    else:  # (a sum of 5 normal numbers may cancel: its rounding is relative to the terms' size)
        assert type(got) is type(expected)
        assert got == expected if isinstance(expected, bool) else \
            got == pytest.approx(expected, rel=1e-6, abs=1e-6 * x.abs().sum().item())


def test_vector_matrix_product_with_an_in_place_squeeze(fresh_seed):
    """matmul of a 1-d operand decomposes to unsqueeze, mm, squeeze_: an in-place view op on
    the call's result, which changes its shape, not its data."""
    check_against_eager(lambda u, a: (u.exp() @ a).sin(), torch.randn(70), torch.randn(70, 30))
    check_against_eager(lambda x: (x * 2).unsqueeze_(0).t_() + 1, torch.randn(70))


def test_an_in_place_view_op_on_an_input_is_refused():
    with pytest.raises(tjit.UnsupportedOpError, match="shape of argument x in place"):
        tjit.compile(lambda x: x.unsqueeze_(0))(torch.randn(3))


def _attention_cases():
    g = torch.Generator().manual_seed(7)

    def qkv(b, h, hk, s, d, dtype=torch.float32):
        return [torch.randn(b, n, s, d, generator=g).to(dtype) for n in (h, hk, hk)]
    mask = torch.randn(300, 300, generator=g) > -1.0  # a boolean mask, every row keeps something
    return {
        "causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv(2, 3, 3, 300, 16)),
        "mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), qkv(1, 2, 2, 300, 8)),
        "scale": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3) * 2, qkv(2, 2, 2, 90, 24)),
        "gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                qkv(1, 4, 2, 70, 16)),
        "bf16": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), qkv(1, 2, 2, 65, 16,
                                                                                            torch.bfloat16)),
    }


@pytest.mark.parametrize("name", list(_attention_cases()))
def test_attention_is_the_library_call_eager_makes_forward_and_backward(name):
    """F.scaled_dot_product_attention runs as eager runs it on the CPU (flash attention, which
    never holds the (seq x seq) scores): one library call forward, its backward op in the
    backward, with eager's results and gradients; no buffer of the scores in either slab."""
    fn, args = _attention_cases()[name]
    ours = [a.clone().requires_grad_() for a in args]
    theirs = [a.clone().requires_grad_() for a in args]
    compiled = tjit.compile(fn)
    got, want = compiled(*ours), fn(*theirs)
    tol = {"rtol": 2e-2, "atol": 2e-2} if args[0].dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want, **tol)
    seed = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(got.dtype)
    (got * seed).sum().backward()
    (want * seed).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, **tol)
    explained = tjit.explain(fn, *ours)
    assert [c.op for c in explained.library_calls] == ["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert [c.op for c in explained.backward.library_calls] == \
        ["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    scores = args[0][..., 0].numel() * args[1].shape[-2] * args[0].element_size()  # b * h * s * s
    assert max(explained.memory.slab_size, explained.backward.memory.slab_size) < scores


def test_a_call_under_autocast_runs_as_traced():
    """The trace ran under the caller's autocast and holds its casts; the call must not be
    cast again. The encoder layer's fused fast path (eval, no grad) returns float32 by its
    meta function but bfloat16 when run under autocast, so its float32 memory refused the
    result (RuntimeError) before; now it runs as torch's own trace does (aot_eager)."""
    layer = torch.nn.TransformerEncoderLayer(48, 4, 96, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 70, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got = torch.compile(layer, backend="tjit")(x)
        expected = torch.compile(layer, backend="aot_eager")(x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

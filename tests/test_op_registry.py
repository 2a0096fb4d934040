"""The op registry (tjit/ir/ops.py OPS): every elementwise op's facts in one place, each
fact read from there by the frontend, the lowering, autograd and the IR verifier."""
import inspect
from dataclasses import replace

import pytest
import torch

import tjit
import tjit.autograd.vjp  # noqa: F401  (gives the registered ops their gradient rules)
from tjit.frontend import aten_ops
from tjit.ir import NO_GRAD, OPS, DType, GraphBuilder, OpDef, View
from tjit.ir.graph import Cumulative, Elementwise, Reduce
from tjit.lower.elementwise import render
from tjit.pipeline import VerifyError, verify_graph

TYPES = [DType.float16, DType.bfloat16, DType.float32, DType.float64, DType.int8, DType.uint8, DType.int16,
         DType.int32, DType.int64, DType.bool]


def _node(op: OpDef, dtype: DType):
    """`op` over inputs of `dtype` (where's condition: bool), as the frontend builds it."""
    b = GraphBuilder()
    view = View.contiguous((4,))
    operands = [b.input(f"x{k}", DType.bool if op.name == "where" and k == 0 else dtype, view)
                for k in range(op.arity)]
    result = DType.bool if op.operand_typed and op.name != "cast" else dtype
    return b.node(Elementwise(op.name), result, tuple(operands), view)


def _rendered(op: OpDef, dtype: DType):
    """The op's Triton expression for operands of `dtype`, or None where it refuses them."""
    try:
        return render(_node(op, dtype), [f"x{k}" for k in range(op.arity)])
    except NotImplementedError as e:
        assert repr(op.name) in str(e) and repr(dtype) in str(e), str(e)
        return None


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_renders_valid_triton_for_a_type_or_refuses_it_by_name(name):
    op = OPS[name]
    accepted = []
    for dtype in TYPES:
        expr = _rendered(op, dtype)
        if expr is None:
            continue
        compile(expr, f"<{name} {dtype!r}>", "eval")  # a Python expression
        used = 1 if op.checks_index else op.arity  # (the bound is the kernel's check: codegen)
        assert all(f"x{k}" in expr for k in range(used) if k not in op.gradient_only), expr
        accepted.append(dtype)
    assert accepted, f"{name} renders for no type"


def _eager_accepts(fn, dtype: DType, arity: int):
    args = [torch.ones(4, dtype=dtype.torch) for _ in range(arity)]
    try:
        return fn(*args)
    except RuntimeError:  # "... not implemented for 'Bool'" and the like
        return None


DIRECT = sorted((name, aten) for name, op in OPS.items() for aten in op.aten)


@pytest.mark.parametrize("name,aten", DIRECT, ids=[f"{a}->{n}" for n, a in DIRECT])
def test_an_aten_op_translated_to_an_op_is_lowered_for_every_type_eager_accepts(name, aten):
    """The types an op renders cover those its aten ops reach it with: computed in torch's
    result type, or, typed by its operands, in theirs."""
    op = OPS[name]
    fn = getattr(torch.ops.aten, aten)
    for dtype in TYPES:
        result = _eager_accepts(fn, dtype, op.arity)
        if result is None:
            continue
        compute = dtype if op.operand_typed else DType.from_torch(result.dtype)
        assert _rendered(op, compute) is not None, f"aten.{aten} of {dtype!r}: {name} refuses {compute!r}"


def test_every_op_has_a_gradient_rule_or_is_marked_as_having_none():
    for name, op in OPS.items():
        assert op.grad is NO_GRAD or callable(op.grad), f"{name}: no gradient rule and not marked NO_GRAD"
        if op.grad is not NO_GRAD:  # rule(alg, g, y, *operands)
            assert len(inspect.signature(op.grad).parameters) == 3 + op.arity, name


def test_a_rule_for_an_op_that_has_one_or_none_is_refused():
    from tjit.ir.ops import define_gradient
    with pytest.raises(ValueError, match="'sin' has a gradient rule already"):
        define_gradient("sin", lambda a, g, y, x: (g,))
    with pytest.raises(ValueError, match="'floor' has a gradient rule already, or is marked NO_GRAD"):
        define_gradient("floor", lambda a, g, y, x: (g,))
    with pytest.raises(KeyError, match="unknown elementwise op 'nonsense'"):
        define_gradient("nonsense", lambda a, g, y, x: (g,))


def test_an_op_without_a_gradient_rule_is_a_compile_error(monkeypatch):
    """Never a silent zero gradient: an op that lost its rule is refused by name where a
    gradient flows through it; its forward alone still compiles."""
    monkeypatch.setitem(OPS, "sin", replace(OPS["sin"], grad=None))
    x = torch.linspace(-2, 2, 5)
    assert torch.equal(tjit.compile(lambda x: x.sin() * 2)(x), x.sin() * 2)
    with pytest.raises(tjit.UnsupportedOpError, match="sin: no gradient rule"):
        tjit.compile(lambda x: x.sin() * 2)(x.requires_grad_())


def _fake_translation(monkeypatch, aten_op, ir_op: str):
    """aten_op translated to the IR op named `ir_op`, whatever that is."""
    def handler(cv, node, x):
        return cv.elementwise(ir_op, [x], x.dtype)
    monkeypatch.setitem(aten_ops.HANDLERS, aten_op, handler)


@pytest.mark.parametrize("verify", ["1", "0"])
def test_an_unregistered_op_is_a_compile_error(monkeypatch, verify):
    """An op missing from the registry is refused when compiling: by the IR verifier
    (TJIT_VERIFY=1, as in the tests), else where the lowering or autograd looks it up."""
    monkeypatch.setenv("TJIT_VERIFY", verify)
    _fake_translation(monkeypatch, torch.ops.aten.special_erfcx, "erfcx")
    x = torch.linspace(0.5, 1.5, 6, requires_grad=True)
    error = (VerifyError, "not registered") if verify == "1" else (KeyError, "unknown elementwise op 'erfcx'")
    with pytest.raises(error[0], match=error[1]):
        tjit.compile(lambda x: torch.special.erfcx(x) * 2)(x)


def test_the_verifier_checks_arity_and_reduction_and_scan_names():
    b = GraphBuilder()
    view = View.contiguous((4,))
    x = b.input("x", DType.float32, view)
    add = b.node(Elementwise("add"), DType.float32, (x,), view)
    assert verify_graph(b.finish(["x"], {"out0": add})) == "add has 1 operands, its arity is 2"
    b = GraphBuilder()
    x = b.input("x", DType.float32, view)
    median = b.node(Reduce("median", (0,)), DType.float32, (x,), View.contiguous((1,)))
    assert "reduction 'median' is not one of" in verify_graph(b.finish(["x"], {"out0": median}))
    b = GraphBuilder()
    x = b.input("x", DType.float32, view)
    scan = b.node(Cumulative("median", 0), DType.float32, (x,), view)
    assert "scan 'median' is not one of" in verify_graph(b.finish(["x"], {"out0": scan}))


def _erfcx_grad(a, g, y, x):
    """d erfcx(x) / dx = 2 x erfcx(x) - 2 / sqrt(pi)"""
    return (a.mul(g, a.sub(a.mul(a.mul(x, 2.0), y), 1.1283791670955126)),)


def test_an_op_added_in_one_place_works_end_to_end(monkeypatch):
    """A new op, one OpDef: aten.special_erfcx (a library call until then) translates to it,
    fuses with the work around it into one kernel, and trains."""
    erfcx = OpDef("erfcx", 1, floats="tl.exp({0} * {0}) * tm.erfc({0})", grad=_erfcx_grad,
                  aten=("special_erfcx",))
    monkeypatch.setitem(OPS, "erfcx", erfcx)
    monkeypatch.setattr(aten_ops, "HANDLERS", dict(aten_ops.HANDLERS))
    aten_ops.translate(erfcx)

    def fn(x):
        return torch.special.erfcx(x * 0.5) * 3

    x = torch.linspace(0.2, 3.0, 37, dtype=torch.float32).requires_grad_()
    compiled = tjit.compile(fn)
    got = compiled(x)
    expected = fn(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    weights = torch.linspace(-1, 1, 37)
    (grad,) = torch.autograd.grad((got * weights).sum(), x)
    (eager_grad,) = torch.autograd.grad((expected * weights).sum(), x)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-6)
    explained = tjit.explain(fn, x.detach())
    assert len(explained.kernels) == 1 and not explained.library_calls, str(explained)

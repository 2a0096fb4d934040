"""Matrix products: generated (an IR Dot, lowered to tl.dot with its epilogue fused) or a
library call, chosen per call.

The rule (`choose`): a product is generated where that fuses work away, the library runs
it otherwise.
- Generated: float32, float16 or bfloat16 operands, both sides of the result longer than 1
  (a side of 1 is a matrix-vector product, which tl.dot's tiles do not fit), and work to
  fuse: a bias (addmm, baddbmm), a pointwise op or a reduction of the result's rows
  (softmax, log_softmax, sums over the last axis) reading the result (through views), or an
  operand computed by a prologue (outside library calls' gradient formulas).
- Library: float32 products on a GPU at torch's default ("highest") float32 matmul
  precision (tl.dot computes exact float32 without tensor cores: measured 12x slower than
  cuBLAS on an H100); everything else; products above LIBRARY_ABOVE multiply-adds, where a tuned
  library kernel's speed outweighs one trip of the result through memory (a guess, not yet
  measured on a GPU), unless a reduction of their rows reads them (cross-entropy over an LM
  head's logits: the generated kernel never writes the product); and products a gradient
  flows through, whose backward is library products either way: on the zoo's training
  steps, generated forwards gave more kernels and a higher peak (Llama: the product saved
  under two shapes, each differentiated), so training keeps the library's until tjit
  generates the backward's products.
`TJIT_MATMUL=generated` or `=library` forces one side, for comparisons.

A Dot's result is float32 (the accumulator's type); the handler casts it to torch's result
type, as eager rounds a product once, so what reads it sees eager's values.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..ir import DType, GraphNode
from .aten_ops import in_type, out_dtype, register
from .dot import dot, is_prologue, nests_products
from .library import library_call

aten = torch.ops.aten

LIBRARY_ABOVE = 1 << 32  # multiply-adds
TILED_TYPES = (DType.float32, DType.float16, DType.bfloat16)
# ops through which a result is still "the product" for the rule: views of it
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.t.default,
          aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
          aten.slice.Tensor, aten.select.int, aten.alias.default}


@dataclass(frozen=True)
class MatmulChoice:
    """How one product is computed, for explain."""
    op: str
    a_shape: tuple
    b_shape: tuple
    generated: bool
    why: str

    def describe(self) -> str:
        how = "generated (tl.dot)" if self.generated else "library call"
        return f"{self.op} {list(self.a_shape)} @ {list(self.b_shape)}: {how}, {self.why}"


def choose(node: fx.Node, a: GraphNode, b: GraphNode, with_bias: bool, differentiated: bool,
           in_gradient: bool = False) -> tuple[bool, str]:
    """(generated?, why) for the product a @ b made by `node`; `differentiated`: a gradient
    flows through it; `in_gradient`: it is part of a library call's gradient formula."""
    mode = os.environ.get("TJIT_MATMUL", "auto")
    if mode not in ("auto", "generated", "library"):
        raise ValueError(f"TJIT_MATMUL={mode!r}: expected auto, generated or library")
    if a.dtype != b.dtype or a.dtype not in TILED_TYPES:
        return False, f"{a.dtype!r} operands: tl.dot tiles take float32, float16 or bfloat16"
    if a.shape[-2] == 1 or b.shape[-1] == 1:
        return False, "a matrix-vector product (a side of 1)"
    if mode != "auto":
        return mode == "generated", f"TJIT_MATMUL={mode}"
    if a.dtype is DType.float32 and exact_float32_on_gpu(node):
        # (bench/gpu.py on an H100: cross_entropy(h @ w.T) [4096, 1024] x [32000, 1024] ran 75 ms
        # generated, 6 ms as cuBLAS's float32 product, which eager runs without tf32 too)
        return False, ("float32 on a GPU at torch's 'highest' matmul precision: tl.dot would compute it "
                       "exactly by FMA, without tensor cores (12x slower than the library's, measured)")
    if differentiated:
        # (measured on the zoo's training steps, bench/models.py: 6 to 110 more kernels per
        # step and 1.1-1.4x the peak memory with generated forwards; evaluation had fewer)
        return False, "a gradient flows through it: the library's, until tjit generates the backward's products"
    reader, reduces_rows = _fusing_reader(node)
    work = math.prod(a.shape[:-1]) * b.shape[-1] * a.shape[-1]
    if reduces_rows:  # (however large: the product is never written, a (tokens x vocab) logits' worth)
        return True, f"fuses {reader} over its rows"
    if work > LIBRARY_ABOVE:
        return False, f"{work} multiply-adds: above {LIBRARY_ABOVE}, the library's kernel"
    if with_bias:
        return True, "fuses the bias"
    if reader is not None:
        return True, f"fuses {reader}"
    if (is_prologue(a, nests=nests_products(b.shape[-1])) or is_prologue(b)) and not in_gradient:
        # (in gradient formulas, a weight's and an input's gradient products each computing the
        # activation's gradient on their tiles raised the zoo's training peaks: ViT 1.36x ->
        # 1.52x eager's, Llama 1.08x -> 1.24x; what the prologue reads is held until both ran)
        if not (is_prologue(a) or is_prologue(b)):
            return True, "computes its operand on its tiles, products included (attention's probabilities)"
        return True, "fuses its operand's elementwise work (a prologue)"
    return False, "nothing to fuse (no pointwise op or row reduction reads the result, no operand is computed)"


def exact_float32_on_gpu(node: fx.Node) -> bool:
    """Whether node's float32 product runs on a GPU at torch's "highest" float32 matmul
    precision (its default): eager's product is then exact float32 (no tf32), which tl.dot
    computes only by FMA, without tensor cores. (Under "high" or "medium", eager's cuBLAS
    products round their operands to tf32, and so do tjit's tl.dot kernels on a GPU.)"""
    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.device.type == "cuda"
            and torch.get_float32_matmul_precision() == "highest")


def _fusing_reader(node: fx.Node) -> tuple[Optional[str], bool]:
    """(the name of an op that reads node's result, directly or through views, and fuses
    with the product, whether it reduces the product's rows): a reduction of its rows over
    the last axis, else a pointwise op; (None, False) if there is neither."""
    stack, seen, pointwise = list(node.users), set(), None
    while stack:
        user = stack.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if user.target in _VIEWS:
            stack.extend(user.users)
        elif _reduces_rows(user):
            return user.target.overloadpacket.__name__, True
        elif isinstance(user.target, torch._ops.OpOverload) and torch.Tag.pointwise in user.target.tags:
            pointwise = pointwise or user.target.overloadpacket.__name__
    return pointwise, False


def _reduces_rows(user: fx.Node) -> bool:
    """softmax, log_softmax, amax, sum, mean or logsumexp over the last axis alone."""
    if user.target in (aten._softmax.default, aten._log_softmax.default):
        dims = [user.args[1]]
    elif user.target in (aten.amax.default, aten.sum.dim_IntList, aten.mean.dim, aten.logsumexp.default):
        dims = list(user.args[1]) if len(user.args) > 1 and user.args[1] is not None else []
    else:
        return False
    rank = len(user.args[0].meta["val"].shape) if "val" in user.args[0].meta else 0
    return rank > 0 and [d % rank for d in dims] == [rank - 1]


def _product(cv, node: fx.Node, args: tuple, kwargs: dict, a: GraphNode, b: GraphNode, bias=None, beta=1,
             alpha=1) -> GraphNode:
    differentiated = cv.reads_grad_inputs(a, b)
    generated, why = choose(node, a, b, bias is not None and beta != 0, differentiated, cv.is_gradient_formula)
    cv.matmul_choices.append(MatmulChoice(str(node.target), a.shape, b.shape, generated, why))
    if not generated:
        return library_call(cv, node, node.target, args, kwargs)
    # (differentiated, a nested product's value would be saved for the backward anyway; and
    # where a reduction of the rows reads the product, each pass over its column tiles
    # would compute the nested products again)
    value = dot(cv, a, b, nests=not differentiated and not _fusing_reader(node)[1])
    if alpha != 1:
        value = cv.elementwise("mul", [value, cv.expand_to(cv.const(alpha, DType.float32), value.shape)],
                               DType.float32)
    if bias is not None and beta != 0:  # (beta 0: the bias is not read, NaN or not, as in eager)
        bias = cv.expand_to(in_type(cv, bias, DType.float32), value.shape)
        if beta != 1:
            bias = cv.elementwise("mul", [bias, cv.expand_to(cv.const(beta, DType.float32), value.shape)],
                                  DType.float32)
        value = cv.elementwise("add", [bias, value], DType.float32)
    return cv.cast(value, out_dtype(node))


@register(aten.mm, aten.bmm)
def _mm(cv, node, *args, **kwargs):
    a, b = args
    return _product(cv, node, args, kwargs, a, b)


@register(aten.addmm, aten.baddbmm)
def _addmm(cv, node, *args, **kwargs):
    bias, a, b, beta, alpha = _addmm_arguments(*args, **kwargs)
    return _product(cv, node, args, kwargs, a, b, bias, beta, alpha)


def _addmm_arguments(bias, a, b, beta=1, alpha=1):
    return bias, a, b, beta, alpha

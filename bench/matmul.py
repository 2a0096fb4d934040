#!/usr/bin/env python
"""Matrix products with fused epilogues: tjit against Inductor (Triton for CPU tensors).

    python bench/matmul.py [--json PATH] [--training-only]

Per function, the same inputs for both compilers, through `torch.compile(fn, backend=...)`
(bench/models.py's backends and counters): kernels per call (Triton launches + aten ops that
run a kernel: a library matmul is one), tjit's library calls, the distinct bytes the Triton
launches moved (aten ops' bytes are not measured, so a library product's traffic is missing
from a compiler's bytes: the "min bytes" column is what the function must read and write at
least, its inputs and outputs once) and, for tjit, each generated tl.dot kernel compiled for
sm_90: registers per thread and bytes spilled. The issue's kernel targets are printed
after the table. No speed is measured: this machine has no GPU.

Functions:
  gelu_linear  gelu(linear(x, w, b))                        x [8, 128, 256], w [512, 256]
  mlp_block    x + linear(gelu(linear(layer_norm(x))))      x [8, 128, 256], hidden 512
  attention    softmax(q @ k.T * scale) @ v                 [4, 8, 128, 64]
  linear_ce    cross_entropy(linear(h, w), target)          h [512, 256], vocab 2048
  norm_linear  gelu(linear(layer_norm(x), w, b))            x [2, 64, 256], w [512, 256]

For linear_ce (the forward) the Triton launches' bytes written are printed beside the
logits' size (issue 14's target: at most 1/8 of it), and for attention its kernels and what
they wrote beside the output, against the probabilities' size.

Training steps (forward + backward, gradients of every float input), a second table:
  linear_ce_train     h [512, D] and w [2048, D], D = 128 and 256
  attention_train     q, k, v [2, 4, 128, 32]
for tjit, Inductor, eager and (linear_ce) a Liger-style chunked eager step (8 token chunks,
each chunk's logits, loss and gradients computed in the forward, as Liger-Kernel's fused
linear cross-entropy does): kernels per step, MB the Triton launches wrote beside the
gradients and the output, and the step's peak extra memory (the allocator's peak over the
step, plus tjit's arena, minus the gradients and the output), each against the logits' or
the probabilities' size (issue 14's targets: at most 1/8).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tjit  # noqa: E402,F401  (before triton: chooses the interpreter without CUDA)
from models import backend, counted, inside_compiled, progress, setup_inductor  # noqa: E402


def gelu_linear(x, w, b):
    return F.gelu(F.linear(x, w, b))


def mlp_block(x, w1, b1, w2, b2):
    return x + F.linear(F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],)), w1, b1)), w2, b2)


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def linear_ce(h, w, target):
    return F.cross_entropy(F.linear(h, w), target)


def norm_linear(x, w, b):
    return F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],)), w, b))


def inputs(name: str) -> tuple:
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale
    if name == "gelu_linear":
        return randn(8, 128, 256), randn(512, 256, scale=0.05), randn(512)
    if name == "norm_linear":  # (smaller: the interpreter's byte counters are slow on its prologue's loads)
        return randn(2, 64, 256), randn(512, 256, scale=0.05), randn(512)
    if name == "mlp_block":
        return randn(8, 128, 256), randn(512, 256, scale=0.05), randn(512), randn(256, 512, scale=0.05), randn(256)
    if name == "attention":
        return randn(4, 8, 128, 64), randn(4, 8, 128, 64), randn(4, 8, 128, 64)
    return randn(512, 256), randn(2048, 256, scale=0.05), torch.randint(0, 2048, (512,), generator=g)


FUNCTIONS = {"gelu_linear": gelu_linear, "mlp_block": mlp_block, "attention": attention, "linear_ce": linear_ce,
             "norm_linear": norm_linear}
TARGETS = {"gelu_linear": 1, "mlp_block": 3}  # kernels per call, issue 14
LOGITS_BYTES = 512 * 2048 * 4  # linear_ce's (tokens x vocab) float32 logits
PROBABILITY_BYTES, ATTENTION_OUT_BYTES = 4 * 8 * 128 * 128 * 4, 4 * 8 * 128 * 64 * 4  # attention's (seq x seq), output


TRAINING = {  # name: (function, input shapes, bytes of the product the step must not write)
    "linear_ce_train_d128": (linear_ce, [(512, 128), (2048, 128)], 512 * 2048 * 4),
    "linear_ce_train_d256": (linear_ce, [(512, 256), (2048, 256)], 512 * 2048 * 4),
    "attention_train": (attention, [(2, 4, 128, 32)] * 3, 2 * 4 * 128 * 128 * 4),
}


def training_inputs(name: str) -> list:
    g = torch.Generator().manual_seed(0)
    shapes = TRAINING[name][1]
    args = [torch.randn(*shape, generator=g) * (0.05 if k == 1 and "linear" in name else 1.0)
            for k, shape in enumerate(shapes)]
    if "linear" in name:
        args.append(torch.randint(0, shapes[1][0], (shapes[0][0],), generator=g))
    return args


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Liger-Kernel's fused linear cross-entropy, in eager ops: the tokens in chunks, each
    chunk's logits, loss and gradients computed in the forward (the logits of one chunk
    alive at a time), the gradients returned by the backward."""

    @staticmethod
    def forward(ctx, h, w, target, chunks=8):
        valid = (target != -100).sum()
        grad_h, grad_w, loss = torch.empty_like(h), torch.zeros_like(w), h.new_zeros(())
        for rows in torch.arange(h.shape[0]).chunk(chunks):
            logits = h[rows] @ w.T
            lse = logits.logsumexp(-1)
            t = target[rows]
            keep = t != -100
            loss += ((lse - logits.gather(1, t.clamp(min=0)[:, None])[:, 0]) * keep).sum()
            dlogits = (logits - lse[:, None]).exp_()
            dlogits[torch.arange(len(rows)), t.clamp(min=0)] -= 1
            dlogits *= keep[:, None] / valid
            grad_h[rows] = dlogits @ w
            grad_w += dlogits.T @ h[rows]
        ctx.save_for_backward(grad_h, grad_w)
        return loss / valid

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad, grad_w * grad, None, None


def training_step(fn, args, incoming, modes=()) -> torch.Tensor:
    """One forward + backward of the incoming gradient (made beforehand: not the step's
    memory), modes inside compiled graphs and around the backward."""
    for a in args:
        a.grad = None
    with inside_compiled(*modes):
        out = fn(*args)
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        out.backward(incoming)
    return out


def run_training(name: str, compiler: str) -> dict:
    fn, _, product_bytes = TRAINING[name]
    args = training_inputs(name)
    leaves = [a.requires_grad_() for a in args if a.is_floating_point()]
    torch._dynamo.reset()
    tjit.memory.release()
    if compiler == "liger":
        step_fn = lambda h, w, target: ChunkedLinearCrossEntropy.apply(h, w, target)  # noqa: E731
    elif compiler == "eager":
        step_fn = fn
    else:
        step_fn = torch.compile(fn, backend=backend(compiler))
    incoming = torch.ones_like(fn(*args)).detach()
    out = training_step(step_fn, args, incoming)
    grads = [leaf.grad for leaf in leaves]
    reference = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    expected = training_step(fn, reference, incoming)
    row = counted(lambda modes: training_step(step_fn, args, incoming, modes))
    row["max_abs_diff"] = max([float((out - expected).abs().max())] +
                              [float((g - r.grad).abs().max()) for g, r in zip(grads, reference) if r.requires_grad])
    results = out.numel() * out.element_size() + sum(leaf.numel() * leaf.element_size() for leaf in leaves)
    row["written_beside_results"] = row.get("bytes_written", 0) - results
    gc.collect()
    with tjit.memory.measure_peak() as meter:
        training_step(step_fn, args, incoming)
    arena = tjit.memory.stats()["in_use_bytes"] if compiler == "tjit" else 0
    row["peak_extra"] = meter.peak + arena - results
    row["product_bytes"] = product_bytes
    return row


def print_training(results: dict) -> None:
    compilers = ("tjit", "inductor", "eager", "liger")
    print("\ntraining steps: kernels per step (Triton launches + aten ops that run a kernel), and the step's peak "
          "extra memory in MB (tjit/inductor/eager/liger)")
    print(f"{'step':<22}{'kernels':>16}{'peak extra MB':>28}{'tjit wrote MB':>15}{'product MB':>12}")
    for name, rows in results.items():
        found = [rows.get(c) for c in compilers]
        kernels = "/".join("-" if r is None else str(r["kernels"]) for r in found)
        peaks = "/".join("-" if r is None else f"{r['peak_extra'] / 2**20:.2f}" for r in found)
        t = rows["tjit"]
        print(f"{name:<22}{kernels:>16}{peaks:>28}{t['written_beside_results'] / 2**20:>15.3f}"
              f"{t['product_bytes'] / 2**20:>12.2f}")
    print("(tjit wrote: its launches' bytes beside the gradients and the output; the others' products are aten "
          "ops, whose bytes are not metered)")
    print("\ntargets (issue 14), tjit:")
    for name, rows in results.items():
        r = rows["tjit"]
        bound = r["product_bytes"] / 8
        products = [op for op in r["aten_ops"] if op.split(".")[-2] in ("mm", "bmm", "addmm", "baddbmm")]
        held = r["written_beside_results"] <= bound and r["peak_extra"] <= bound and not products
        print(f"  {name}: wrote {r['written_beside_results'] / 2**20:.3f} MB, peak extra {r['peak_extra'] / 2**20:.3f} MB, "
              f"{r['kernels']} kernels (aten: {r['aten_ops'] or 'none'}), max diff {r['max_abs_diff']:.1e}; "
              f"at most 1/8 of the product's {r['product_bytes'] / 2**20:.1f} MB: {'held' if held else 'NOT held'}")


def min_bytes(args, out) -> int:
    return sum(t.numel() * t.element_size() for t in [*args, out] if isinstance(t, torch.Tensor))


def sm90_reports() -> list[dict]:
    """Every tl.dot kernel tjit launched so far, compiled for sm_90 as launched."""
    from tjit.lower.gpu_compile import compile_launched
    from tjit.runtime.loader import launched_kernels
    found = {}
    for plan, args in launched_kernels():
        if plan.dot_tiles is not None and plan.name not in found:
            report = compile_launched(plan, args)
            found[plan.name] = {"kernel": plan.name, "tiles": plan.dot_tiles.describe(),
                                "registers": report.registers, "spills": report.spills}
    return list(found.values())


def run(name: str, compiler: str) -> dict:
    fn, args = FUNCTIONS[name], inputs(name)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend(compiler))
    out = compiled(*args)
    compiled(*args)
    expected = fn(*args)
    row = counted(lambda modes: _call(compiled, args, modes))
    row["max_abs_diff"] = float((out - expected).abs().max())
    row["min_bytes"] = min_bytes(args, out)
    return row


def _call(compiled, args, modes):
    with inside_compiled(*modes):
        return compiled(*args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--training-only", action="store_true", help="only the training steps' table")
    opts = parser.parse_args()
    setup_inductor()
    results = {}
    for name in () if opts.training_only else FUNCTIONS:
        for compiler in ("tjit", "inductor"):
            progress(f"{name}: {compiler}")
            results.setdefault(name, {})[compiler] = run(name, compiler)
    training: dict = {}
    for name in TRAINING:
        for compiler in ("tjit", "inductor", "eager") + (("liger",) if "linear" in name else ()):
            progress(f"{name}: {compiler}")
            training.setdefault(name, {})[compiler] = run_training(name, compiler)
    dot_kernels = sm90_reports()
    if opts.training_only:
        print_training(training)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump({"training": training, "sm90": dot_kernels}, f, indent=1)
        return 0
    print(f"{'function':<12} {'kernels tjit/ind':>16} {'lib tjit':>8} {'MB tjit/ind (min)':>22} {'max diff':>9}")
    for name, row in results.items():
        t, i = row["tjit"], row["inductor"]
        mb = f"{t['bytes_distinct'] / 2**20:.2f}/{i['bytes_distinct'] / 2**20:.2f} ({t['min_bytes'] / 2**20:.2f})"
        print(f"{name:<12} {str(t['kernels']) + '/' + str(i['kernels']):>16} {t['tjit_library_calls']:>8} "
              f"{mb:>22} {t['max_abs_diff']:>9.1e}")
    print("\ntjit's tl.dot kernels at sm_90:")
    for k in dot_kernels:
        print(f"  {k['kernel']}: {k['tiles']}: {k['registers']} registers, {k['spills']} bytes spilled")
    print("\ntargets (issue 14):")
    for name, most in TARGETS.items():
        got = results[name]["tjit"]["kernels"]
        print(f"  {name}: {got} kernel(s), target <= {most}: {'held' if got <= most else 'NOT held'}")
    for compiler in ("tjit", "inductor"):
        row = results["linear_ce"][compiler]
        # (an aten product writes the whole logits itself, which the Triton counters do not see)
        within = row["bytes_written"] <= LOGITS_BYTES / 8 and not row["aten"]
        print(f"  linear_ce forward, {compiler}: Triton launches wrote {row['bytes_written'] / 2**20:.3f} MB"
              + (f" and {row['aten']} aten op(s) wrote the logits" if row["aten"] else "")
              + f"; the logits are {LOGITS_BYTES / 2**20:.1f} MB: written {'<=' if within else '>'} 1/8 of them")
    row = results["attention"]["tjit"]
    extra = row["bytes_written"] - ATTENTION_OUT_BYTES
    print(f"  attention forward, tjit: {row['kernels']} kernel(s), target 1: {'held' if row['kernels'] <= 1 else 'NOT held'}; "
          f"wrote {extra / 2**20:.3f} MB beside its output, the probabilities are {PROBABILITY_BYTES / 2**20:.1f} MB: "
          f"written {'<=' if extra <= PROBABILITY_BYTES / 8 and not row['aten'] else '>'} 1/8 of them")
    print_training(training)
    spills = sum(k["spills"] for k in dot_kernels)
    print(f"  tl.dot kernels with 0 spills at sm_90: {'held' if spills == 0 else 'NOT held'}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"functions": results, "training": training, "sm90": dot_kernels}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

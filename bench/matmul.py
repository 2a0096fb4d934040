#!/usr/bin/env python
"""Matrix products with fused epilogues: tjit against Inductor (Triton for CPU tensors).

    python bench/matmul.py [--json PATH]

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

For linear_ce (a forward: the backward is not generated yet) the Triton launches' bytes
written are printed beside the logits' size (issue 14's target: at most 1/8 of it), and for
attention its kernels and what they wrote beside the output, against the probabilities' size.
"""
from __future__ import annotations

import argparse
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
    opts = parser.parse_args()
    setup_inductor()
    results = {}
    for name in FUNCTIONS:
        for compiler in ("tjit", "inductor"):
            progress(f"{name}: {compiler}")
            results.setdefault(name, {})[compiler] = run(name, compiler)
    dot_kernels = sm90_reports()
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
    spills = sum(k["spills"] for k in dot_kernels)
    print(f"  tl.dot kernels with 0 spills at sm_90: {'held' if spills == 0 else 'NOT held'}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"functions": results, "sm90": dot_kernels}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

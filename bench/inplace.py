#!/usr/bin/env python
"""In-place updates through views of one tensor: tjit against Inductor (Triton for CPU
tensors, as in bench/models.py).

    python bench/inplace.py [--json PATH]

Per function, `torch.compile(fn, backend=...)` on the same input: kernels per call (Triton
launches + aten ops that run a kernel) and the distinct bytes the Triton launches moved
(bench/measure.py), and for tjit the slab (temporary memory) its plan holds. Each result is
checked against eager first.

Functions (issue 16: where reads and the write meet no address another program writes, the
update needs no temporary and one kernel):
  even_from_odd   x[:, ::2].mul_(2).add_(x[:, 1::2])                 x [64, 300]
  half_from_half  x[:150].add_(x[150:].exp())                        x [300, 257]
  thirds          x[::3].sub_(x[1::3] * x[2::3])                      x [9000]
  sum_into_row    x[:, 5:6].copy_(x.sum(1)) beside x * 2 - x.sum(1)  x [16, 5000]
  tail_into_head  x[:, :1].copy_(x[:, 1:].sum(1))                     x [16, 5000]
  flip_add        x.add_(x.flip(0)): a real hazard, one copy         x [64, 3000]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import tjit  # noqa: E402,F401  (before triton: chooses the interpreter without CUDA)
from models import backend, counted, inside_compiled, progress, setup_inductor  # noqa: E402


def sum_into_row(x):
    total = x.sum(1, keepdim=True)
    result = x * 2 - total
    x[:, 5:6].copy_(total)
    return result


FUNCTIONS = {
    "even_from_odd": ((64, 300), lambda x: x[:, ::2].mul_(2).add_(x[:, 1::2])),
    "half_from_half": ((300, 257), lambda x: x[:150].add_(x[150:].exp())),
    "thirds": ((9000,), lambda x: x[::3].sub_(x[1::3] * x[2::3])),
    "sum_into_row": ((16, 5000), sum_into_row),
    "tail_into_head": ((16, 5000), lambda x: x[:, :1].copy_(x[:, 1:].sum(1, keepdim=True))),
    "flip_add": ((64, 3000), lambda x: x.add_(x.flip(0))),
}


def measure(name: str, compiler: str) -> dict:
    shape, fn = FUNCTIONS[name]
    torch._dynamo.reset()
    x = torch.rand(*shape) + 0.5
    compiled = torch.compile(fn, backend=backend(compiler))
    got, expected = x.clone(), x.clone()
    compiled(got)
    fn(expected)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    argument = x.clone()

    def call(modes):
        with inside_compiled(*modes):
            compiled(argument)
    row = counted(call)
    if compiler == "tjit":
        row["slab_bytes"] = tjit.explain(tjit.compile(fn), x.clone()).memory.slab_size
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    setup_inductor()
    results = {}
    for k, name in enumerate(FUNCTIONS):
        progress(f"[{k + 1}/{len(FUNCTIONS)}] {name}")
        results[name] = {compiler: measure(name, compiler) for compiler in ("tjit", "inductor")}
    print(f"{'function':16} {'kernels tjit / ind':>20} {'bytes tjit / ind':>22} {'tjit slab B':>12}")
    for name, row in results.items():
        t, i = row["tjit"], row["inductor"]
        print(f"{name:16} {t['kernels']:>11} / {i['kernels']:<6} {t['bytes_distinct']:>11} / {i['bytes_distinct']:<8} "
              f"{t['slab_bytes']:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""Whole models through `torch.compile(model, backend="tjit")`: the zoo in zoo.py, eval
forward and a training step (loss, backward, SGD with momentum), against eager on a copy
of the same model. Batch norm's running statistics must be updated as eager updates them.
"""
import copy
import os

import pytest
import torch

from zoo import ZOO

# float32 on CPU: the model's outputs and gradients go through matmuls and long sums whose
# order differs between tjit's kernels and eager's (MKL) ones. On a GPU (TJIT_TEST_DEVICE=cuda)
# eager's own error is larger: ViT's eval output was 1.6e-4 from a float64 run, eager's and
# tjit's alike, on an H100.
RTOL, ATOL = (1e-3, 1e-3) if os.environ.get("TJIT_TEST_DEVICE") == "cuda" else (1e-4, 1e-5)


def _close(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}\n{m}")


def _setup(name: str, train: bool):
    """The model (compiled) and an eager copy of it, in train or eval mode, and an input."""
    torch.manual_seed(0)
    model = ZOO[name].build().train(train)
    eager = copy.deepcopy(model)
    x = ZOO[name].inputs(torch.Generator().manual_seed(1))
    return model, torch.compile(model, backend="tjit"), eager, x


# a norm over a linear's output (plus the residual) walks the product once per pass: three
# tl.dot loops in one kernel, whose registers spill 16 B at sm_90 (known gap)
_EVAL_SPILLS = {"bert": pytest.mark.spills_at_sm90("a norm kernel walks its linear's product once per pass (16 B)")}


@pytest.mark.parametrize("name", [pytest.param(name, marks=_EVAL_SPILLS.get(name, ())) for name in sorted(ZOO)])
def test_eval_forward(name):
    _, compiled, eager, x = _setup(name, train=False)
    with torch.no_grad():
        got, expected = compiled(x), eager(x)
    assert not got.requires_grad
    _close(got, expected, f"{name} eval output")


@pytest.mark.spills_at_sm90("training steps' backward reduction kernels with many accesses (17-40 loads) "
                            "spill up to 6.6 KB at sm_90 with their Auto rows per program (known gap)")
@pytest.mark.parametrize("name", sorted(ZOO))
def test_training_step(name):
    spec = ZOO[name]
    model, compiled, eager, x = _setup(name, train=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
    for step in range(2):  # the second step runs the compiled graphs again, with momentum
        losses = []
        for run in (compiled, eager):
            loss = spec.loss(run(x), step)
            loss.backward()
            losses.append(loss)
        _close(losses[0], losses[1], f"{name} loss, step {step}")
        for (pname, p), q in zip(model.named_parameters(), eager.parameters()):
            _close(p.grad, q.grad, f"{name} gradient of {pname}, step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (bname, b), c in zip(model.named_buffers(), eager.buffers()):
        _close(b, c, f"{name} buffer {bname} after training")

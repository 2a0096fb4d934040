"""Recurrent cells traced as functional code.

`torch.gru_cell` and `torch.lstm_cell` (what nn.GRUCell and nn.LSTMCell call) are composite
aten ops whose C++ code runs below any trace and writes the gates in place through chunks
of a matmul's result (`chunked_hgates[0].add_(...).sigmoid_()`). Traced as they are, each
such write into an intermediate is a library call that copies the storage (five per GRU
step), and the work around them cannot fuse. The same computation without writes, in the
C++ code's order of operations (so the same rounding), fuses into one kernel per step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    i_r, i_z, i_n = F.linear(input, w_ih, b_ih).chunk(3, 1)
    h_r, h_z, h_n = F.linear(hx, w_hh, b_hh).chunk(3, 1)
    reset = (h_r + i_r).sigmoid()
    update = (h_z + i_z).sigmoid()
    new = (i_n + h_n * reset).tanh()
    return (hx - new) * update + new


def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    h, c = hx
    gates = F.linear(h, w_hh, b_hh) + F.linear(input, w_ih, b_ih)
    i, f, g, o = gates.chunk(4, 1)
    cy = f.sigmoid() * c + i.sigmoid() * g.tanh()
    return o.sigmoid() * cy.tanh(), cy


FUNCTIONAL = {torch._VF.gru_cell: gru_cell, torch._VF.lstm_cell: lstm_cell}


class FunctionalCells(TorchFunctionMode):
    """Runs the functional form of a recurrent cell called with batched (2-d) inputs; any
    other call (eager's errors for other ranks) goes to torch's own."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        functional = FUNCTIONAL.get(func)
        if functional is not None and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 2:
            return functional(*args, **kwargs)
        return func(*args, **kwargs)

"""Every axis strategy, with and without SIMD widths, forced on 1-, 2- and 3-d kernels."""
import pytest
import torch

import tjit
from tjit import Auto, Sequential, Thread, ThreadGroup
from helpers import check_against_eager


def body(x, y):
    return torch.sigmoid(x) * y + 1.0, (x - y).abs()


STRATEGIES_2D = [
    (ThreadGroup(), ThreadGroup()),
    (ThreadGroup(), ThreadGroup(16)),
    (ThreadGroup(4), ThreadGroup(8)),
    (ThreadGroup(), Thread()),
    (ThreadGroup(), Thread(4)),
    (Thread(), Thread()),
    (ThreadGroup(), Sequential()),
    (ThreadGroup(), Sequential(16)),
    (Sequential(2), ThreadGroup(32)),
    (Sequential(), Thread(2)),
    (Sequential(4), Sequential(8)),
    (Auto(), Thread()),
]


@pytest.mark.parametrize("strategies", STRATEGIES_2D, ids=str)
def test_forced_2d_strategies(strategies):
    x, y = torch.randn(13, 37), torch.randn(13, 37)
    compiled = check_against_eager(body, x, y, axis_strategies={"*": strategies})
    kernel = tjit.explain(compiled, x, y).kernels[0]
    kinds = [s.split("-> ")[1].split("(")[0] for s in kernel.strategies]
    expected = ["ThreadGroup" if isinstance(s, Auto) else type(s).__name__ for s in strategies]
    assert kinds == expected
    if any(isinstance(s, Sequential) for s in strategies):
        assert "for step" in kernel.source
    if any(s.simd for s in strategies):
        assert "tl.max_contiguous" in kernel.source


@pytest.mark.parametrize("strategies", [
    (ThreadGroup(), Sequential(4), Thread()),
    (Sequential(), ThreadGroup(2), Thread(2)),
    (Thread(), Thread(), Sequential(8)),
], ids=str)
def test_forced_3d_strategies_on_strided_inputs(strategies):
    x = torch.randn(5, 9, 11)
    y = torch.randn(11, 5, 9).permute(1, 2, 0)
    check_against_eager(body, x, y, axis_strategies={"*": strategies})


@pytest.mark.parametrize("strategy", [ThreadGroup(), ThreadGroup(64), Thread(), Thread(8), Sequential(), Sequential(32)],
                         ids=str)
def test_forced_1d_strategies(strategy):
    x, y = torch.randn(777), torch.randn(777)
    check_against_eager(body, x, y, axis_strategies={"out0": (strategy,), "out1": (strategy,)})


def test_strategies_by_output_name_and_conflicts():
    x, y = torch.randn(6, 10), torch.randn(6, 10)
    check_against_eager(body, x, y, axis_strategies={"out0": (ThreadGroup(), Thread())})
    with pytest.raises(tjit.TjitError, match="conflicting"):
        tjit.compile(body, axis_strategies={"out0": (ThreadGroup(), Thread()), "out1": (Thread(), Thread())})(x, y)


def test_wrong_rank_and_oversized_blocks_are_clear_errors():
    x, y = torch.randn(6, 10), torch.randn(6, 10)
    with pytest.raises(tjit.TjitError, match="do not match"):
        tjit.compile(body, axis_strategies={"*": (Thread(),)})(x, y)
    big = torch.randn(2048, 1024)
    with pytest.raises(tjit.TjitError, match="Triton allows"):
        tjit.compile(body, axis_strategies={"*": (Thread(), Thread())})(big, big)


def test_simd_width_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        Thread(3)

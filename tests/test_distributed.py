"""Data parallel training through `torch.compile(model, backend="tjit")`: DistributedDataParallel
(both ways round: the DDP module compiled, and DDP around a compiled module; with a graph break
inside the model) and FSDP2's `fully_shard`, each against the same wrapping of an eager copy of
the model, in two processes on CPU talking through gloo. Each rank trains on its own data shard,
so gradients are only equal to eager's if tjit's gradients were all-reduced as DDP's are.

Dynamo's DDPOptimizer (`torch._dynamo.config.optimize_ddp`) splits a DDP module's graph at DDP's
bucket boundaries and hands each piece to the backend, so that a bucket's all-reduce starts as
soon as its piece's backward is done. It refuses a bucket cap under 1 MiB (it sizes its first
bucket by `torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB, and asserts the first bucket is
no larger than the others, also with backend="eager"), and the zoo's models have parameters of
tens of KiB, so the model here is the zoo's ResNet at width 128 (4.7 MiB of parameters, but
4x4 to 8x8 feature maps: a training step takes well under a second in the interpreter) with a
1 MiB cap: four pieces. Its batch norms also exercise DDP's broadcast of rank 0's buffers.

Each test runs its worker in two processes spawned by torch.multiprocessing; a failure in
either is re-raised here with the rank's traceback (`ProcessRaisedException`), and the process
group's timeout turns a rank left waiting in a collective into an error instead of a hang.
"""
from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zoo import ZOO, ResNet

WORLD = 2
STEPS = 3
BUCKET_CAP_MB = 1  # the smallest cap DDPOptimizer accepts (see above)
# as tests/test_models.py: sums and matmuls run in another order than eager's
RTOL, ATOL = 1e-4, 1e-5
SPEC = ZOO["resnet"]


def _close(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}\n{m}")


def _spawn(worker, tmp_path, *args):
    """Runs worker(rank, *args) in WORLD fresh processes joined in one gloo process group."""
    mp.spawn(_rank_main, args=(worker, f"file://{tmp_path / 'rendezvous'}", args), nprocs=WORLD, join=True)


def _rank_main(rank, worker, init_method, args):
    torch.set_num_threads(1)  # two ranks on a shared machine
    # generous, so that a slow compile on a busy machine never times out, but a rank left
    # waiting for a peer that died still fails
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        worker(rank, *args)
        if rank == 0:
            # the kernels ran here, not in pytest's process, whose fixture checks them; the
            # ranks launched the same kernels, so one of them checks
            from conftest import check_gpu_compiles
            check_gpu_compiles()
    finally:
        dist.destroy_process_group()


def _counting_tjit_backend(graphs: list):
    """tjit's Dynamo backend, recording what it returns for every graph it is handed (DDPOptimizer
    calls it once per piece), so a test can count the pieces and see that tjit compiled each."""
    from torch._dynamo import lookup_backend
    tjit_backend = lookup_backend("tjit")

    def backend(gm, example_inputs):
        compiled = tjit_backend(gm, example_inputs)
        graphs.append(compiled)
        return compiled
    return backend


def _shard(rank: int, step: int):
    """This rank's batch and targets for a step: different on every rank and step."""
    x = SPEC.inputs(torch.Generator().manual_seed(1000 * step + rank))
    return x, 1000 * step + rank + 7  # the seed SPEC.loss draws targets from


def _train_alike(compiled, eager, params, eager_params, rank, what):
    """STEPS steps of SGD with momentum on both models, on this rank's shard; gradients after
    every backward, and parameters and buffers after the last step, must be eager's."""
    opts = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in (params, eager_params)]
    for step in range(STEPS):
        x, target_seed = _shard(rank, step)
        losses = []
        for run in (compiled, eager):
            loss = SPEC.loss(run(x), target_seed)
            loss.backward()
            losses.append(loss.detach())
        _close(losses[0], losses[1], f"{what}: rank {rank} loss, step {step}")
        if step == 0:
            # the shards really differ: otherwise gradients would match without an all-reduce
            every = [torch.empty(()) for _ in range(WORLD)]
            dist.all_gather(every, losses[1])
            assert not torch.equal(every[0], every[1]), f"{what}: the ranks' losses are equal: {every}"
        for (name, p), q in zip(params, eager_params):
            assert p.grad is not None, f"{what}: rank {rank} has no gradient for {name} at step {step}"
            _close(_local(p.grad), _local(q.grad), f"{what}: rank {rank} gradient of {name}, step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(params, eager_params):
        _close(_local(p.detach()), _local(q.detach()), f"{what}: rank {rank} parameter {name} after {STEPS} steps")
    for (name, b), c in zip(compiled.named_buffers(), eager.buffers()):
        _close(b, c, f"{what}: rank {rank} buffer {name} after {STEPS} steps")


def _megabytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20


def _local(t):
    """FSDP2's parameters and gradients are DTensors: each rank compares its own shard."""
    return t.to_local() if hasattr(t, "to_local") else t


# -- DistributedDataParallel ---------------------------------------------------------------------

class _WithGraphBreak(torch.nn.Module):
    """The ResNet with a graph break between its stem and its blocks: Dynamo hands over two
    graphs, and DDPOptimizer splits each at the buckets it holds."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, images):
        x = self.net.stem(images)
        torch._dynamo.graph_break()  # noqa: SLF001
        return self.net.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.net.layers(x), 1), 1))


def _ddp_worker(rank, wrap: str, graph_break: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch._dynamo as dynamo
    import tjit  # noqa: F401  registers the "tjit" backend in this fresh process
    assert dynamo.config.optimize_ddp is True, "DDPOptimizer is off: nothing would be split"

    torch.manual_seed(0)
    model = ResNet(width=128)
    if graph_break:
        model = _WithGraphBreak(model)
    eager = DDP(copy.deepcopy(model), bucket_cap_mb=BUCKET_CAP_MB)
    graphs = []
    backend = _counting_tjit_backend(graphs)
    if wrap == "compile(DDP(model))":
        ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
        compiled = torch.compile(ddp, backend=backend)
    else:
        ddp = compiled = DDP(torch.compile(model, backend=backend), bucket_cap_mb=BUCKET_CAP_MB)
    what = f"{wrap}{' with a graph break' if graph_break else ''}"
    _train_alike(compiled, eager, list(ddp.named_parameters()), list(eager.parameters()), rank, what)

    # DDPOptimizer closes a bucket once it holds BUCKET_CAP_MB: the 4.7 MiB make four pieces
    # (with the graph break: the stem's 14 KiB in a graph of their own, the rest in three)
    dynamo_graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    assert dynamo_graphs == (2 if graph_break else 1), f"{what}: Dynamo made {dynamo_graphs} graphs"
    assert len(graphs) >= 4, (
        f"{what}: tjit compiled {len(graphs)} graphs of Dynamo's {dynamo_graphs}; DDPOptimizer should have "
        f"split the model's {_megabytes(model):.1f} MiB of parameters at {BUCKET_CAP_MB} MiB buckets into 4")
    refused = [g.split_graph.eager_because for g in graphs if g.split_graph.eager_because]
    assert not refused, f"{what}: tjit ran graphs eagerly: {refused}"


@pytest.mark.parametrize("wrap", ["compile(DDP(model))", "DDP(compile(model))"], ids=["compile_ddp", "ddp_of_compiled"])
def test_ddp_training_matches_eager(tmp_path, wrap):
    _spawn(_ddp_worker, tmp_path, wrap, False)


def test_ddp_with_graph_break_matches_eager(tmp_path):
    _spawn(_ddp_worker, tmp_path, "compile(DDP(model))", True)


# -- FSDP2 ---------------------------------------------------------------------------------------

def _fsdp_worker(rank):
    from torch.distributed.fsdp import fully_shard
    import tjit  # noqa: F401  registers the "tjit" backend in this fresh process

    torch.manual_seed(0)
    model = ResNet(width=128)
    eager = copy.deepcopy(model)
    for m in (model, eager):
        # each residual block is a unit of its own (gathered before and resharded after it
        # runs), the root holds the stem and the classifier
        for block in m.layers:
            fully_shard(block)
        fully_shard(m)
    graphs = []
    compiled = torch.compile(model, backend=_counting_tjit_backend(graphs))
    _train_alike(compiled, eager, list(model.named_parameters()), list(eager.parameters()), rank, "fully_shard")
    # Dynamo does not trace FSDP2's hooks (torch._dynamo.config.skip_fsdp_hooks): it breaks
    # its graph at every sharded module's call, and tjit compiles the graphs in between
    assert graphs, "fully_shard: tjit compiled no graph"
    refused = [g.split_graph.eager_because for g in graphs if g.split_graph.eager_because]
    assert not refused, f"fully_shard: tjit ran graphs eagerly: {refused}"


def test_fsdp2_training_matches_eager(tmp_path):
    _spawn(_fsdp_worker, tmp_path)

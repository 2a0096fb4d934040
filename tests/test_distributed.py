"""Data parallel training through `torch.compile(model, backend="tjit")`: DistributedDataParallel
(both ways round: the DDP module compiled, and DDP around a compiled module; with a graph break
inside the model) and FSDP2's `fully_shard`, each against the same wrapping of an eager copy of
the model, in two processes on CPU talking through gloo. Each rank trains on its own data shard,
so gradients are only equal to eager's if tjit's gradients were all-reduced as DDP's are. The
weights and the shards are drawn from a fresh seed per test (conftest's fresh_seed, printed).

Dynamo's DDPOptimizer (`torch._dynamo.config.optimize_ddp`) splits a DDP module's graph at DDP's
bucket boundaries and hands each piece to the backend, so that a bucket's all-reduce can start
as soon as its piece's backward is done; a small `bucket_cap_mb` makes several pieces of the
zoo's MLP-Mixer (50 KiB of parameters). The model is smooth (GELU, LayerNorm): a ReLU network's
gradients jump where a pre-activation within rounding of zero changes sides (the zoo's ResNet
did so in about one step in ten, against float64 eager too), so they cannot be compared
elementwise on fresh seeds.

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

from zoo import ZOO

WORLD = 2
STEPS = 3
BUCKET_CAP_MB = 1 / 64  # 16 KiB: DDPOptimizer splits the Mixer into three pieces
# as tests/test_models.py: sums and matmuls run in another order than eager's
RTOL, ATOL = 1e-4, 1e-5
SPEC = ZOO["mixer"]

pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="this torch build has no torch.distributed with gloo"),
    pytest.mark.usefixtures("fresh_seed"),  # fresh weights and shards each run; a failure prints the seed
]


def _close(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}\n{m}")


def _spawn(worker, tmp_path, *args):
    """Runs worker(rank, *args) in WORLD fresh processes joined in one gloo process group, with
    torch seeded as in this process (by the fresh_seed fixture)."""
    # a new file for every test: file:// rendezvous must not find one left by another group
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank_main, args=(worker, init_method, torch.initial_seed(), args), nprocs=WORLD, join=True)


def _rank_main(rank, worker, init_method, seed, args):
    torch.set_num_threads(1)  # two ranks on a shared machine
    torch.manual_seed(seed)  # the same initial weights on every rank
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


def _refused(graphs: list) -> list[str]:
    """Why tjit ran any of the graphs eagerly (split.graph_backend falls back, with a warning)."""
    return [g.split_graph.eager_because for g in graphs if g.split_graph.eager_because]


def _shard(rank: int, step: int):
    """This rank's batch and the seed SPEC.loss draws its targets from, for a step: different on
    every rank and step."""
    seed = torch.initial_seed() + 1000 * step + 10 * rank
    return SPEC.inputs(torch.Generator().manual_seed(seed)), seed + 1


def _local(t):
    """FSDP2's parameters and gradients are DTensors: each rank compares its own shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def _train_alike(compiled, eager, params, eager_params, rank, what):
    """STEPS steps of SGD with momentum on both models, on this rank's shard; the loss and the
    gradients after every backward, and the parameters after the last step, must be eager's."""
    opts = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in ([p for _, p in params], eager_params)]
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


# -- DistributedDataParallel ---------------------------------------------------------------------

class _WithGraphBreak(torch.nn.Module):
    """The Mixer with a graph break between its two blocks: Dynamo hands over two graphs, and
    DDPOptimizer splits each at the buckets it holds."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, images):
        net = self.net
        x = net.blocks[0](net.patch(images).flatten(2).transpose(1, 2))
        torch._dynamo.graph_break()
        x = net.blocks[1](x)
        return net.head(net.norm(x).mean(1))


def _ddp_worker(rank, wrap: str, graph_break: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch._dynamo as dynamo
    import tjit  # noqa: F401  registers the "tjit" backend in this fresh process
    assert dynamo.config.optimize_ddp is True, "DDPOptimizer is off: nothing would be split"
    # DDP given a bucket_cap_mb makes its first bucket that size too, but DDPOptimizer sizes its
    # first piece by this constant (1 MiB) and refuses a cap under it ("First bucket should be
    # smaller/equal to other buckets", an AssertionError with backend="eager" too): it would only
    # split models of megabytes, which take minutes in the interpreter. Make it DDP's cap.
    assert hasattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES"), "torch renamed DDPOptimizer's first bucket size"
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(BUCKET_CAP_MB * 2 ** 20)

    model = SPEC.build()
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

    dynamo_graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    assert dynamo_graphs == (2 if graph_break else 1), f"{what}: Dynamo made {dynamo_graphs} graphs"
    # a piece closes once it holds 16 KiB, and the largest parameter is 8 KiB: 50 KiB make at
    # least three pieces (three, and four with the graph break, in torch 2.13)
    kib = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024
    assert len(graphs) >= 3, (
        f"{what}: tjit compiled {len(graphs)} graphs of Dynamo's {dynamo_graphs}: DDPOptimizer did not split "
        f"the model's {kib:.0f} KiB of parameters at {BUCKET_CAP_MB * 1024:.0f} KiB buckets")
    assert not _refused(graphs), f"{what}: tjit ran graphs eagerly: {_refused(graphs)}"


@pytest.mark.parametrize("wrap", ["compile(DDP(model))", "DDP(compile(model))"], ids=["compile_ddp", "ddp_of_compiled"])
def test_ddp_training_matches_eager(tmp_path, wrap):
    _spawn(_ddp_worker, tmp_path, wrap, False)


def test_ddp_with_graph_break_matches_eager(tmp_path):
    _spawn(_ddp_worker, tmp_path, "compile(DDP(model))", True)


# -- FSDP2 ---------------------------------------------------------------------------------------

def _fsdp_worker(rank):
    from torch.distributed.fsdp import fully_shard
    import tjit  # noqa: F401  registers the "tjit" backend in this fresh process

    model = SPEC.build()
    eager = copy.deepcopy(model)
    for m in (model, eager):
        # each block is a unit of its own (its parameters gathered before it runs and resharded
        # after), the root holds the patch embedding and the head
        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)
    graphs = []
    compiled = torch.compile(model, backend=_counting_tjit_backend(graphs))
    _train_alike(compiled, eager, list(model.named_parameters()), list(eager.parameters()), rank, "fully_shard")
    # Dynamo does not trace FSDP2's hooks (torch._dynamo.config.skip_fsdp_hooks): it breaks its
    # graph at every sharded module's call, and tjit compiles the graphs in between
    assert graphs, "fully_shard: tjit compiled no graph"
    assert not _refused(graphs), f"fully_shard: tjit ran graphs eagerly: {_refused(graphs)}"


def test_fsdp2_training_matches_eager(tmp_path):
    _spawn(_fsdp_worker, tmp_path)

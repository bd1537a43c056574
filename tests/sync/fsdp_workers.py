"""Workers of the FSDP2 tests (run by ``distributed.run_distributed``, each call its own group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

PARTITION = 16  # small partitions: every shard holds several, and a partial last one


def small_model() -> torch.nn.Module:
    """Three units: 40 coordinates, 15 (a multiple of neither 2 nor 4, padded by FSDP2), 24."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3, bias=False),
        torch.nn.Tanh(), torch.nn.Linear(3, 6),
    )  # fmt: skip


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(1000 * step + rank))


def record_reduce_scatters(rank, world, methods, steps):
    """For each (codec name, options) of ``methods`` (None: torch's own reduce-scatter), each
    unit's reduce-scatter input and output on this rank over ``steps`` steps of a small model
    whose layers are FSDP2 units: one spawn for all, which is what such a test costs."""
    return [_record(rank, world, name, options, steps) for name, options in methods]


def _record(rank, world, codec_name, options, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsum.codecs import make_codec
    from gradsum.sync.allreduce import AllReduceAggregator
    from gradsum.sync.fsdp import GradsumReduceScatter, fsdp_units, shard_gradients
    from gradsum.sync.session import Session

    mesh = init_device_mesh("cpu", (world,))
    model = small_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    records: list[dict] = []
    state = None
    if codec_name is not None:
        codec = make_codec(codec_name, workers=world, **options)
        session = Session(codec, AllReduceAggregator(), seed=5, partition_elements=PARTITION)
        state = shard_gradients(model, session)

    class Recording:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner
            self.sizes = getattr(inner, "sizes", ())

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            flat = input_tensor.detach().clone()
            if self.inner is None:
                dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            else:
                self.inner(output_tensor, input_tensor, group, op)
            records.append({"unit": self.name, "input": flat, "sizes": self.sizes,
                            "output": output_tensor.detach().clone()})  # fmt: skip

    for name, module in fsdp_units(model):
        inner = module._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
        module.set_custom_reduce_scatter(
            Recording(name, inner if isinstance(inner, GradsumReduceScatter) else None))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        optimizer.step()
        if state is not None:
            state.step += 1
    return {"records": records, "rounds": None if state is None else state.rounds}


def train_hsdp(rank, world, codecs, steps):
    return [_train_hsdp(rank, world, name, steps) for name in codecs]


def _train_hsdp(rank, world, codec_name, steps):
    """HSDP on a 2x2 mesh (replicas x shards): the shard group's reduce-scatter and the replica
    all-reduce through gradsum's codec. Returns every parameter gathered, and the counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsum.codecs import make_codec
    from gradsum.sync.allreduce import AllReduceAggregator
    from gradsum.sync.fsdp import shard_gradients
    from gradsum.sync.session import Session

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = small_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    session = Session(make_codec(codec_name, workers=world), AllReduceAggregator(), seed=1)
    state = shard_gradients(model, session, replica_group=mesh.get_group("replicate"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(_batch(rank, step)).square().mean()
        loss.backward()
        optimizer.step()
        state.step += 1
        losses.append(float(loss))
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    return {"params": params, "rounds": state.rounds, "replica_rounds": state.replica_rounds,
            "losses": losses}  # fmt: skip


def reference_training(world: int, steps: int) -> list[torch.Tensor]:
    """The same model trained in one process on the exact average of every rank's gradient."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        grads = []
        for rank in range(world):
            model.zero_grad()
            model(_batch(rank, step)).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = torch.stack(gs).mean(dim=0)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]

"""Functions the distributed tests run in each worker process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsum.codecs import make_codec
from gradsum.sync.allreduce import AllReduceAggregator
from gradsum.sync.session import Session


def rank_input(rank: int, length: int) -> torch.Tensor:
    return torch.randn(length, generator=torch.Generator().manual_seed(100 + rank))


def synchronize_codecs(rank, world, names, length, partition_elements):
    aggregator = AllReduceAggregator()
    results = {}
    for name in names:
        session = Session(make_codec(name, workers=world), aggregator,
                          partition_elements=partition_elements)  # fmt: skip
        results[name] = session.synchronize(rank_input(rank, length), key="t", step=0)
    return results


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 3),
    )


def _batches(rank: int, steps: int):
    generator = torch.Generator().manual_seed(7 + rank)
    teacher = torch.Generator().manual_seed(1)
    weights = torch.randn(20, 3, generator=teacher)
    for _ in range(steps):
        x = torch.randn(32, 20, generator=generator)
        yield x, (x @ weights).argmax(dim=1)


def _parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train_steps(rank, steps, model, forward, after_backward=lambda: None, lr=0.1):
    """SGD steps on this rank's batches: the losses, and the parameters after every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, snapshots = [], []
    for x, y in _batches(rank, steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        after_backward()
        optimizer.step()
        losses.append(loss.item())
        snapshots.append(_parameters(model))
    return losses, snapshots


def recording_hook(records: list):
    """gradsum's DDP hook, keeping every bucket's (step, bucket index, this worker's bucket, what
    the hook returned) in ``records``."""
    from gradsum.sync.ddp_hook import gradsum_hook

    def hook(state, bucket):
        step, index, local = state.step, bucket.index(), bucket.buffer().clone()

        def keep(future):
            average = future.value()
            records.append((step, index, local, average.clone()))
            return average

        return gradsum_hook(state, bucket).then(keep)

    return hook


def errors_against_the_exact_average(records: list, world: int) -> list[float]:
    """Per recorded bucket, in (step, bucket) order: |returned - exact| / |exact|, the exact
    average over every worker's bucket (a collective: every worker calls it)."""
    errors = []
    for _, _, local, average in sorted(records, key=lambda r: r[:2]):
        everyone = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        exact = torch.stack(everyone).mean(0)
        errors.append(float((average - exact).norm() / exact.norm()))
    return errors


def train_with_ddp_hook(rank, world, codec_name, steps):
    from torch.nn.parallel import DistributedDataParallel

    from gradsum.sync.ddp_hook import GradsumHookState

    model = DistributedDataParallel(tiny_model(), bucket_cap_mb=0.01)  # several buckets
    state = GradsumHookState(Session(make_codec(codec_name, workers=world), AllReduceAggregator()))
    records = []
    model.register_comm_hook(state, recording_hook(records))
    losses, snapshots = train_steps(rank, steps, model.module, model)
    state.close()
    return {"losses": losses, "snapshots": snapshots, "steps": state.step,
            "errors": errors_against_the_exact_average(records, world)}  # fmt: skip


def train_with_gradient_sync(rank, world, codec_name, steps, fusion_elements, lr=0.1):
    from gradsum.sync.gradient_sync import GradientSync

    model = tiny_model()
    session = Session(make_codec(codec_name, workers=world), AllReduceAggregator())
    sync = GradientSync(model, session, fusion_elements=fusion_elements)
    losses, snapshots = train_steps(rank, steps, model, model, sync.wait, lr=lr)
    sync.close()
    dist.barrier()
    return {"losses": losses, "snapshots": snapshots, "groups": len(sync.groups)}


def train_with_local_steps(rank, world, codec_name, steps, spec, lr, weight_decay=0.0):
    """A user's own loop over ``LocalStepsSync`` (the README's): inner SGD at ``lr``. What the
    model holds before and after ``close``, the start weights, and the decay it took over."""
    from gradsum.sync.gradient_sync import GradientSync
    from gradsum.sync.local_steps import LocalStepsSync

    model = tiny_model()
    session = Session(make_codec(codec_name, workers=world), AllReduceAggregator())
    sync = GradientSync(model, session, on_backward=False)
    local = LocalStepsSync(sync, spec, lambda accumulators: torch.optim.SGD(
        accumulators, lr=lr, weight_decay=weight_decay))  # fmt: skip
    for x, y in _batches(rank, steps):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        local.step()
        model.zero_grad()
    before, in_flight = _parameters(model), local.state.in_flight
    local.close()
    start = torch.cat([s.reshape(-1) for s in local.state.start]).clone()
    dist.barrier()
    return {"before": before, "after": _parameters(model), "start": start,
            "in_flight": in_flight, "decay": (local.state.weight_decay, local.state.decoupled_lr),
            "inner_decay": [g["weight_decay"] for g in local.inner.param_groups]}  # fmt: skip

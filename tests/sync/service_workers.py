"""Worker functions for tests of the switch/PS service aggregator (run in spawned processes)."""

from __future__ import annotations

from gradsum.codecs import make_codec
from gradsum.sync.service import JobSettings, ServiceAggregator
from gradsum.sync.session import Session

from .workers import errors_against_the_exact_average, recording_hook, tiny_model, train_steps


def train_through_service(rank, world, kind, addresses, codec_name, steps, ddp):
    aggregator = ServiceAggregator(kind, addresses, JobSettings(rank, world))
    session = Session(make_codec(codec_name, workers=world), aggregator)
    model = tiny_model()
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        from gradsum.sync.ddp_hook import GradsumHookState, gradsum_hook

        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = GradsumHookState(session)
        wrapped.register_comm_hook(state, gradsum_hook)
    else:
        from gradsum.sync.gradient_sync import GradientSync

        wrapped = model
        sync = GradientSync(model, session)
    losses, snapshots = train_steps(
        rank, steps, model, wrapped, (lambda: None) if ddp else sync.wait
    )
    if ddp:
        state.close()
    else:
        sync.close()
    aggregator.close()
    return {"losses": losses, "snapshots": snapshots}


def warm_up_then_compress(rank, world, kind, addresses, start_step, steps):
    """DDP + gradsum's hook with THC and ``start_step`` warm-up steps through ``kind``; per
    step, the relative error of what the hook returned against the exact average of the
    workers' buckets."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from gradsum.sync.allreduce import AllReduceAggregator
    from gradsum.sync.ddp_hook import GradsumHookState

    if kind == "allreduce":
        aggregator = AllReduceAggregator()
    else:
        aggregator = ServiceAggregator(kind, addresses, JobSettings(rank, world))
    model = tiny_model()
    wrapped = DistributedDataParallel(model, bucket_cap_mb=25)  # one bucket
    state = GradsumHookState(Session(make_codec("thc", workers=world), aggregator),
                             start_step=start_step)  # fmt: skip
    records = []
    wrapped.register_comm_hook(state, recording_hook(records))
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        wrapped.zero_grad()
        wrapped(torch.randn(16, 20, generator=generator)).square().mean().backward()
    state.close()
    if kind != "allreduce":
        aggregator.close()
    return errors_against_the_exact_average(records, world)

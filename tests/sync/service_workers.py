"""Worker functions for tests of the switch/PS service aggregator (run in spawned processes)."""

from __future__ import annotations

from gradsum.codecs import make_codec
from gradsum.sync.service import JobSettings, ServiceAggregator

from .workers import tiny_model, train_steps


def train_through_service(rank, world, kind, addresses, codec_name, steps, ddp):
    codec = make_codec(codec_name, workers=world)
    settings = JobSettings(codec, codec_name, {}, rank, world)
    aggregator = ServiceAggregator(kind, addresses, settings)
    model = tiny_model()
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        from gradsum.sync.ddp_hook import GradsumHookState, gradsum_hook

        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = GradsumHookState(codec, aggregator)
        wrapped.register_comm_hook(state, gradsum_hook)
    else:
        from gradsum.sync.gradient_sync import GradientSync

        wrapped = model
        sync = GradientSync(model, codec, aggregator)
    losses, snapshots = train_steps(
        rank, steps, model, wrapped, (lambda: None) if ddp else sync.wait
    )
    if ddp:
        state.close()
    else:
        sync.close()
    aggregator.close()
    return {"losses": losses, "snapshots": snapshots}

"""Worker functions for tests of the switch/PS service aggregator (run in spawned processes)."""

from __future__ import annotations

import torch

from gradsum.codecs import make_codec
from gradsum.sync.service import JobSettings, ServiceAggregator

from .workers import _batches, _parameters, tiny_model


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
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, snapshots = [], []
    for x, y in _batches(rank, steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        if not ddp:
            sync.wait()
        optimizer.step()
        losses.append(loss.item())
        snapshots.append(_parameters(model))
    if ddp:
        state.close()
    else:
        sync.close()
    aggregator.close()
    return {"losses": losses, "snapshots": snapshots}

"""Worker functions for tests running scheduler plans through real PS shards (spawned)."""

from __future__ import annotations

import torch

from gradsum.codecs import make_codec
from gradsum.sync.gradient_sync import GradientSync
from gradsum.sync.scheduling import agree_on_plan
from gradsum.sync.service import JobSettings
from gradsum.sync.sharded import ShardedServiceAggregator

from .workers import _batches, _parameters, tiny_model


def train_with_plan(rank, world, addresses, scheduler, options, steps):
    codec = make_codec("none", workers=world)
    aggregator = ShardedServiceAggregator(addresses, JobSettings(codec, "none", {}, rank, world))
    model = tiny_model()
    batch = next(_batches(rank, 1))[0]
    chosen = agree_on_plan(scheduler, model, batch, aggregator, codec, options=options)
    sync = GradientSync(model, codec, aggregator, plan=chosen.plan, order=chosen.order, timeout=60)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, snapshots = [], []
    for x, y in _batches(rank, steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        sync.wait()
        optimizer.step()
        losses.append(loss.item())
        snapshots.append(_parameters(model))
    sync.close()
    aggregator.close()
    return {"losses": losses, "snapshots": snapshots, "plan": chosen.plan, "order": chosen.order}

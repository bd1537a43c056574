"""Worker functions for tests running scheduler plans through real PS shards (spawned)."""

from __future__ import annotations

from gradsum.codecs import make_codec
from gradsum.sync.gradient_sync import GradientSync
from gradsum.sync.scheduling import agree_on_plan
from gradsum.sync.service import JobSettings
from gradsum.sync.sharded import ShardedServiceAggregator

from .workers import _batches, tiny_model, train_steps


def train_with_plan(rank, world, addresses, scheduler, options, steps, fit=None):
    codec = make_codec("none", workers=world)
    aggregator = ShardedServiceAggregator(addresses, JobSettings(codec, "none", {}, rank, world))
    model = tiny_model()
    batch = next(_batches(rank, 1))[0]
    chosen = agree_on_plan(scheduler, model, batch, aggregator, codec, options=options, fit=fit)
    sync = GradientSync(model, codec, aggregator, plan=chosen.plan, order=chosen.order, timeout=60)
    losses, snapshots = train_steps(rank, steps, model, model, sync.wait)
    sync.close()
    aggregator.close()
    return {"losses": losses, "snapshots": snapshots, "plan": chosen.plan, "order": chosen.order}

"""Gradient synchronisation as workers see it: the Session, the DDP hook, per-parameter sync,
and the aggregators.

    from gradsum.codecs import make_codec
    from gradsum.sync import AllReduceAggregator, GradientSync, Session

    session = Session(make_codec("thc", workers=world_size), AllReduceAggregator())
    sync = GradientSync(model, session)

The names below load on first use (PEP 562), as ``gradsum.codecs``'s do.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_HOMES = {
    "Aggregator": "aggregator",
    "AllReduceAggregator": "allreduce",
    "Channel": "aggregator",
    "GradientSync": "gradient_sync",
    "GradsumHookState": "ddp_hook",
    "JobSettings": "service",
    "LocalStepsSync": "local_steps",
    "ServiceAggregator": "service",
    "Session": "session",
    "ShardedServiceAggregator": "sharded",
    "gradsum_hook": "ddp_hook",
    "shard_gradients": "fsdp",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)

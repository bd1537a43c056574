"""Worker functions for tests that calibrate, plan and run scheduler plans (spawned)."""

from __future__ import annotations

import warnings

from gradsum.codecs import make_codec
from gradsum.schedule.calibration import CALIBRATION_SIZES
from gradsum.sync.allreduce import AllReduceAggregator
from gradsum.sync.gradient_sync import GradientSync
from gradsum.sync.service import JobSettings
from gradsum.sync.session import Session
from gradsum.sync.sharded import ShardedServiceAggregator
from gradsum.sync.startup import agree_on_plan, calibrate

from .workers import _batches, tiny_model, train_steps


def train_with_plan(rank, world, addresses, scheduler, options, steps, fit=None):
    aggregator = ShardedServiceAggregator(addresses, JobSettings(rank, world))
    session = Session(make_codec("none", workers=world), aggregator)
    model = tiny_model()
    batch = next(_batches(rank, 1))[0]
    chosen = agree_on_plan(scheduler, model, batch, session, options=options, fit=fit)
    sync = GradientSync(model, session, plan=chosen.plan, order=chosen.order, timeout=60)
    losses, snapshots = train_steps(rank, steps, model, model, sync.wait)
    sync.close()
    aggregator.close()
    return {
        "losses": losses,
        "snapshots": snapshots,
        "plan": chosen.plan,
        "order": chosen.order,
        "cost": chosen.cost,
    }


def calibrate_over_allreduce(rank, world, sizes=CALIBRATION_SIZES):
    """``calibrate`` through Gloo all-reduce: the cost model and the warnings this rank saw."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cost = calibrate(Session(make_codec("none", workers=world), AllReduceAggregator()), sizes)
    return {"cost": cost, "warnings": [str(w.message) for w in caught]}

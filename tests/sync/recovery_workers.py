"""Worker functions for the fault tests of the service aggregators (run in spawned processes)."""

from __future__ import annotations

import torch

from gradsum.codecs import make_codec
from gradsum.sync.service import JobSettings, ServiceAggregator
from gradsum.sync.session import Session


def rounds_through_a_switch(rank, world, addresses, steps, elements, standby=()):
    """``steps`` THC rounds (error feedback: state carried from step to step) of seeded
    gradients through a switch job; the averages, and the recoveries this worker took part in."""
    settings = JobSettings(rank, world, silence=0.5, timeout=60.0)
    aggregator = ServiceAggregator("switch", addresses, settings, standby=standby)
    generator = torch.Generator().manual_seed(1000 + rank)
    averages = []
    try:
        session = Session(make_codec("thc", workers=world), aggregator, seed=7)
        for step in range(steps):
            flat = torch.randn(elements, generator=generator)
            averages.append(session.synchronize(flat, key="g", step=step).clone())
    finally:
        aggregator.close()
    return {"averages": averages, "recoveries": aggregator.recovery.recoveries}


def a_worker_dies(rank, world, addresses, steps, elements, die_at):
    """Rounds through a switch until worker 1 kills itself (SIGKILL) at step ``die_at``: what
    the others raised, and how long after the last good round."""
    import os
    import signal
    import time

    from gradsum.failures import describe_failure

    settings = JobSettings(rank, world, silence=0.5, timeout=60.0)
    aggregator = ServiceAggregator("switch", addresses, settings)
    flat = torch.randn(elements, generator=torch.Generator().manual_seed(rank))
    last = time.monotonic()
    try:
        try:
            session = Session(make_codec("thc", workers=world), aggregator, seed=7)
            for step in range(steps):
                if rank == 1 and step == die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                session.synchronize(flat, key="g", step=step)
                last = time.monotonic()
        finally:
            aggregator.close()  # on the error: every worker tears the job down
    except Exception as error:
        return {"failure": describe_failure(error), "after": time.monotonic() - last}
    return {"failure": None}

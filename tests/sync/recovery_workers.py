"""Worker functions for the fault tests of the service aggregators (run in spawned processes)."""

from __future__ import annotations

import torch

from gradsum.codecs import make_codec
from gradsum.sync.service import JobSettings, ServiceAggregator


def rounds_through_a_switch(rank, world, addresses, steps, elements, standby=()):
    """``steps`` THC rounds (error feedback: state carried from step to step) of seeded
    gradients through a switch job; the averages, and the recoveries this worker took part in."""
    codec = make_codec("thc", workers=world)
    settings = JobSettings(codec, "thc", {}, rank, world, silence=0.5, timeout=60.0)
    aggregator = ServiceAggregator("switch", addresses, settings, standby=standby)
    generator = torch.Generator().manual_seed(1000 + rank)
    averages = []
    try:
        for step in range(steps):
            flat = torch.randn(elements, generator=generator)
            averages.append(aggregator.synchronize(flat, codec, key="g", step=step, seed=7).clone())
    finally:
        aggregator.close()
    return {"averages": averages, "recoveries": aggregator.recovery.recoveries}

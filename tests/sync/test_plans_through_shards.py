"""Scheduler plans executed by GradientSync against real PS shards (`gradsum server` daemons)."""

import contextlib

import pytest
import torch

from gradsum.net.loopback import DaemonProcess

from .distributed import run_distributed
from .plan_workers import train_with_plan


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scheduler", "options"),
    [
        ("imerge", {}),
        ("priority", {"slice_elements": 1000, "credit_elements": 3000}),
        ("default", {}),
    ],
)
def test_plans_train_and_keep_replicas_identical(scheduler, options):
    steps = 10
    with contextlib.ExitStack() as stack:
        daemons = [stack.enter_context(DaemonProcess("server")) for _ in range(2)]
        addresses = [f"{d.address[0]}:{d.address[1]}" for d in daemons]
        first, second = run_distributed(
            train_with_plan, 2, addresses, scheduler, options, steps, timeout=180
        )
    assert first["plan"] == second["plan"] and first["order"] == second["order"]
    plan = first["plan"]
    assert plan.policy == scheduler
    if scheduler == "priority":  # slices cut a 4096-element weight: parts of tensors travel
        assert len(plan.groups) > 6 and first["order"] != tuple(range(len(plan.groups)))
    assert {p.shard for g in plan.groups for p in g.parts} == {0, 1}
    for a, b in zip(first["snapshots"], second["snapshots"], strict=True):
        assert torch.equal(a, b)
    assert sum(first["losses"][-3:]) < sum(first["losses"][:3])

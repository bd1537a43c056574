"""Scheduler plans executed by GradientSync against real PS shards (`gradsum server` daemons)."""

import contextlib

import pytest
import torch

from gradsum.net.loopback import DaemonProcess
from gradsum.schedule import AlphaBeta

from .distributed import run_distributed
from .plan_workers import train_with_plan

# imerge's and priority's plans depend on the per-message cost: measured on a loaded machine (α of
# milliseconds) imerge merges this small model into one group on one shard. A fixed cost (100 µs,
# 100 MB/s) makes those plans reproducible; `default` needs none, so start-up measures nothing.
FIXED_COST = AlphaBeta(alpha=1e-4, beta=1e-8)
# Priority's send order pre-empts queued slices only when slices queue: with 100 µs per message a
# slow phase of this VM made backward slower than the queue drains, and the order came out as the
# plan's (seen once in CI). 10 ms per message makes the step communication-bound on any machine.
COMMUNICATION_BOUND = AlphaBeta(alpha=1e-2, beta=1e-7)


@pytest.mark.serial  # imerge plans from a measured profile: a busy host can move it
@pytest.mark.slow
@pytest.mark.parametrize(
    ("scheduler", "options", "fit"),
    [
        ("imerge", {}, FIXED_COST),
        ("priority", {"slice_elements": 1000, "credit_elements": 3000}, COMMUNICATION_BOUND),
        ("default", {}, None),
    ],
)
def test_plans_train_and_keep_replicas_identical(scheduler, options, fit):
    steps = 10
    with contextlib.ExitStack() as stack:
        daemons = [stack.enter_context(DaemonProcess("server")) for _ in range(2)]
        addresses = [f"{d.address[0]}:{d.address[1]}" for d in daemons]
        first, second = run_distributed(
            train_with_plan, 2, addresses, scheduler, options, steps, fit, timeout=180
        )
    assert first["plan"] == second["plan"] and first["order"] == second["order"]
    assert first["cost"] == second["cost"]
    assert first["cost"].source == ("not needed" if fit is None else "given")
    plan = first["plan"]
    assert plan.policy == scheduler
    if scheduler == "priority":  # slices cut a 4096-element weight: parts of tensors travel
        assert len(plan.groups) > 6 and first["order"] != tuple(range(len(plan.groups)))
    assert {p.shard for g in plan.groups for p in g.parts} == {0, 1}
    for a, b in zip(first["snapshots"], second["snapshots"], strict=True):
        assert torch.equal(a, b)
    assert sum(first["losses"][-3:]) < sum(first["losses"][:3])

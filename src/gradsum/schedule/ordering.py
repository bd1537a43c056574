"""The send order a runtime follows: one fixed permutation of a plan's groups, the same on every
worker.

Every worker must issue its transfers in the same order (a shard's job numbers its chunks in
arrival order, a collective matches calls by order). A FIFO plan's order is its list order. A
priority plan's order depends on *when* groups become ready relative to the sender, which differs
between workers from one step to the next; so the runtime does not decide it live but replays the
policy once on the profile: one sender, groups eligible at their profiled ready time, whenever the
sender is free it takes the eligible group with the smallest priority (ties: list order), each
group occupying it for its estimated transfer time. The result is what ByteScheduler would do on
an average step, frozen so that all workers agree.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from .plan import Plan
from .profile import ModelProfile


def group_ready_times(plan: Plan, profile: ModelProfile) -> np.ndarray:
    """When each group may leave, from the start of backward (its last layer's ready time)."""
    ready = profile.ready_times()
    if plan.trigger == "after_backward":
        return np.full(len(plan.groups), float(ready[-1]))
    return np.array([ready[plan.layers_of(g)[-1]] for g in plan.groups], dtype=float)


def send_order(
    plan: Plan, profile: ModelProfile, group_seconds: Callable[[int], float]
) -> tuple[int, ...]:
    """Group indices in the order every worker sends them.

    ``group_seconds(numel)`` estimates how long a group of that many elements keeps the sender
    busy; it only matters for priority plans.
    """
    if plan.order == "fifo":
        return tuple(range(len(plan.groups)))
    ready = group_ready_times(plan, profile)
    arrivals = sorted(range(len(plan.groups)), key=lambda g: (ready[g], g))
    eligible: list[tuple[int, int]] = []  # (priority, index)
    order: list[int] = []
    now, next_arrival = 0.0, 0
    while len(order) < len(plan.groups):
        while next_arrival < len(arrivals) and ready[arrivals[next_arrival]] <= now:
            g = arrivals[next_arrival]
            heapq.heappush(eligible, (plan.groups[g].priority, g))
            next_arrival += 1
        if not eligible:
            now = float(ready[arrivals[next_arrival]])
            continue
        _, g = heapq.heappop(eligible)
        order.append(g)
        now += group_seconds(plan.groups[g].numel)
    return tuple(order)

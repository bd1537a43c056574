"""One meaning of a plan: the simulator and the runtime's ShardSender put the same messages in
flight, in the same order, for the same plans.

The simulator records every release, part start and part return (``Simulation(trace=...)``).
The runtime's sender then replays one worker's iteration against fake shards that return a part
only when told: groups are submitted where the simulator released them, parts are let back where
it got them back, and before every such step the parts the runtime has started must be exactly
the ones the simulator had started by then (so the overlap, not only the order, agrees), and
each shard's stream must have carried them in the simulator's order.
"""

import threading
import time

import pytest
import torch

from gradsum.schedule import ClusterSpec, make_planner, uniform_profile
from gradsum.sim.engine import Simulation
from gradsum.sync.senders import ShardSender

from ..sync.fakes import answering_session

pytestmark = pytest.mark.slow  # tens of seconds on this shared host
SETTLE_S = 0.02  # a start the runtime should not make would show within this


class GatedShards:
    """Fake PS shards: a part's round trip ends only when the test lets it back."""

    def __init__(self, num_shards: int):
        self.num_shards = num_shards
        self.started: list[tuple[int, int]] = []
        self._gates: dict[tuple[int, int], threading.Event] = {}
        self._lock = threading.Lock()

    def __call__(self, flat, *, key, step, shard):
        _, group, part = key
        gate = threading.Event()
        with self._lock:
            self._gates[(group, part)] = gate
            self.started.append((group, part))
        if not gate.wait(10):
            raise TimeoutError(f"part {part} of group {group} was never let back")
        return flat * 2

    def let_back(self, group: int, part: int) -> None:
        with self._lock:
            gate = self._gates.pop((group, part))
        gate.set()

    def started_now(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self.started)


def one_iteration(trace, worker, plan):
    """The worker's events until every part of every group has been back once."""
    left = sum(len(g.parts) for g in plan.groups)
    events = []
    for _, event, w, g, k in trace:
        if w != worker:
            continue
        events.append((event, g, k))
        if event == "back":
            left -= 1
            if left == 0:
                return events
    raise AssertionError("the trace has no complete iteration")


def wait_for(shards, expected):
    deadline = time.monotonic() + 10
    while sorted(shards.started_now()) != sorted(expected):
        if time.monotonic() > deadline:
            raise AssertionError(f"runtime started {shards.started_now()}, simulator {expected}")
        time.sleep(0.001)
    time.sleep(SETTLE_S)
    assert sorted(shards.started_now()) == sorted(expected)


def replay(plan, events, worker):
    shards = GatedShards(1 + max(p.shard for g in plan.groups for p in g.parts))
    session = answering_session(shards, shards=shards.num_shards, rank=worker)
    sender = ShardSender(session, plan, timeout=10)
    expected, futures = [], []
    try:
        for event, g, k in events:
            if event == "release":
                flat = torch.ones(plan.groups[g].numel)
                futures.append(sender.submit(g, flat, step=0))
            elif event == "start":
                expected.append((g, k))
            else:
                wait_for(shards, expected)
                shards.let_back(g, k)
        for future in futures:
            assert torch.equal(future.wait(), 2 * torch.ones(future.wait().numel()))
    finally:
        sender.close()
    by_shard = {}
    for g, k in shards.started:
        by_shard.setdefault(plan.groups[g].parts[k].shard, []).append((g, k))
    return by_shard


def simulated_by_shard(plan, events):
    by_shard = {}
    for event, g, k in events:
        if event == "start":
            by_shard.setdefault(plan.groups[g].parts[k].shard, []).append((g, k))
    return by_shard


def small_setup():
    # Front layers small, back layers big: fusion, partitioning and spans all have work to do.
    sizes = [40_000, 3_000, 250_000, 5_000, 120_000, 2_000, 600_000, 1_000]
    profile = uniform_profile(sizes, [0.002] * len(sizes), [0.001] * len(sizes))
    cluster = ClusterSpec(4, 3, 2, worker_bw=2e9, shard_bw=5e8, nic_bw=4e9,
                          alpha_worker=2e-4, alpha_shard=5e-5)  # fmt: skip
    return profile, cluster


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        ("default", {}),
        ("wfbp", {}),
        ("fusion", {"threshold": 200_000}),
        ("merge", {}),
        ("imerge", {}),
        ("priority", {"slice_elements": 50_000, "credit_elements": 300_000}),
        # one group's round trip at a time (imerge-seed-fit's window)
        ("merge", {"window": "group"}),
        ("imerge", {"window": "group"}),
        # rotated by worker, which imerge asks for only where its play shows a gain
        ("imerge", {"interleave": True}),
        ("imerge", {"interleave": True, "window": "group"}),
    ],
)
def test_simulator_and_runtime_senders_play_a_plan_identically(policy, options):
    profile, cluster = small_setup()
    plan = make_planner(policy, **options)(profile, cluster)
    if options.get("interleave"):  # the case has rotation to compare
        assert plan.interleave and max(len(g.parts) for g in plan.groups) > 1
    trace = []
    Simulation(profile, plan, cluster, trace=trace).run()
    for worker in (0, 3):  # interleaved plans rotate by worker
        events = one_iteration(trace, worker, plan)
        overlapped = any(
            len({(g, k) for e, g, k in events[: i + 1] if e == "start"})
            - sum(1 for e, *_ in events[: i + 1] if e == "back")
            > 1
            for i in range(len(events))
        )
        assert overlapped or plan.credit_bytes is None  # the case has overlap to compare
        assert replay(plan, events, worker) == simulated_by_shard(plan, events)

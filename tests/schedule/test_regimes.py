"""The adaptive planners in the two regimes that matter, played out in the simulator.

24 equal layers (30,000 elements, 0.75 ms of compute each) on 8 workers and 8 shards over two
machines. Where each message costs 1 ms of the worker's thread, start-ups decide the step, so
fusion must beat WFBP and the merge planners, which price a plan as the simulator plays it
(``costs.ps_step_end``), must beat static fusion; where messages are nearly free and the
links fast, communication hides behind backward and the adaptive planners must fall back to
WFBP's one group per layer.
"""

import pytest

from gradsum.schedule import ClusterSpec, make_planner, uniform_profile
from gradsum.sim.engine import simulate

pytestmark = pytest.mark.slow  # tens of seconds on this shared host
LAYERS = 24


def setup(alpha_worker, alpha_shard):
    profile = uniform_profile([30_000] * LAYERS, [0.0005] * LAYERS, [0.00025] * LAYERS)
    cluster = ClusterSpec(8, 8, 2, worker_bw=5e9, shard_bw=2e9, nic_bw=12.5e9,
                          alpha_worker=alpha_worker, alpha_shard=alpha_shard)  # fmt: skip
    return profile, cluster


def step_times(profile, cluster, policies=("wfbp", "fusion", "merge", "imerge")):
    plans = {p: make_planner(p)(profile, cluster) for p in policies}
    return plans, {p: simulate(profile, plan, cluster).iteration_s for p, plan in plans.items()}


@pytest.fixture(scope="module")
def message_bound():
    return step_times(*setup(1e-3, 1e-4))


def test_fusion_beats_wfbp_when_per_message_costs_dominate(message_bound):
    _, t = message_bound
    assert t["fusion"] < 0.75 * t["wfbp"]


def test_merge_planners_beat_static_fusion_and_wfbp_when_per_message_costs_dominate(message_bound):
    plans, t = message_bound
    assert t["merge"] < 0.95 * t["fusion"]
    assert t["imerge"] < 0.95 * t["fusion"]
    assert t["merge"] < 0.95 * 0.95 * t["wfbp"]
    assert len(plans["merge"].groups) < LAYERS / 2
    assert len(plans["imerge"].groups) < LAYERS / 2


@pytest.mark.xfail(
    strict=True,
    reason="every merged group here fits one shard (at most 5 layers, 150,000 elements): "
    "interleaving has no incast to spread, a wider span costs 2 ms of the worker's thread per "
    "part, and in the max-min fluid network a synchronised incast costs only capacity, so "
    "imerge's plan is merge's (8 groups, 23.0 ms)",
)
def test_imerge_beats_merge_when_per_message_costs_dominate(message_bound):
    _, t = message_bound
    assert t["imerge"] < 0.95 * t["merge"]


def test_merge_at_least_as_fast_as_static_fusion_when_per_message_costs_dominate(message_bound):
    _, t = message_bound
    assert t["merge"] <= t["fusion"]


def test_adaptive_planners_collapse_to_wfbp_when_communication_is_hidden():
    profile, cluster = setup(1e-6, 1e-7)
    plans, t = step_times(profile, cluster)
    assert len(plans["merge"].groups) == len(plans["imerge"].groups) == LAYERS
    assert t["merge"] == pytest.approx(t["wfbp"], rel=1e-9)
    assert t["imerge"] <= t["wfbp"] * (1 + 1e-9)
    assert t["imerge"] < 1.06 * profile.compute_s  # communication hidden behind backward


def test_imerge_beats_merge_where_one_shards_incast_dominates():
    # 12 layers of 1 MB on slow shard cores (500 MB/s each, 10 us per message): a layer whole
    # on one shard is an 8-way incast there, which merge (BytePS pieces of 4 MB) cannot avoid
    # and imerge spreads over two shards or more.
    profile = uniform_profile([250_000] * 12, [0.002] * 12, [0.001] * 12)
    cluster = ClusterSpec(8, 8, 2, worker_bw=6e9, shard_bw=0.5e9, nic_bw=12.5e9,
                          alpha_worker=1e-5, alpha_shard=1e-6)  # fmt: skip
    plans, t = step_times(profile, cluster, ("wfbp", "merge", "imerge"))
    assert max(len(g.parts) for g in plans["imerge"].groups) > 1
    assert t["imerge"] < 0.9 * t["merge"]
    assert t["merge"] <= t["wfbp"] * (1 + 1e-9)


def test_imerge_spreads_what_one_group_at_a_time_puts_whole_on_one_shard():
    """The seed's premise at small size: one group's round trip at a time (``window="group"``)
    and the baselines' groups each whole on one shard (``placement="whole"``), 12 layers of
    1 MB on 8 workers: every baseline group is an 8-way incast at one 2 GB/s shard, so merging
    cannot help (a bigger group is a longer incast) and imerge, spreading one group over the
    shards with every worker starting at a different one, takes about half the step
    (2026-12-02: 50.0 ms against 106.6 ms for merge and WFBP, 128.6 ms for default)."""
    profile = uniform_profile([250_000] * 12, [0.002] * 12, [0.001] * 12)
    cluster = ClusterSpec(8, 8, 2, worker_bw=5e9, shard_bw=2e9, nic_bw=12.5e9,
                          alpha_worker=3e-4, alpha_shard=1.5e-4)  # fmt: skip
    t = {}
    for policy in ("default", "wfbp", "merge", "imerge"):
        options = {"window": "group"} | ({} if policy == "imerge" else {"placement": "whole"})
        plan = make_planner(policy, **options)(profile, cluster)
        assert plan.credit_bytes is None
        t[policy] = simulate(profile, plan, cluster).iteration_s
    assert t["wfbp"] < 0.9 * t["default"]
    assert t["merge"] <= t["wfbp"] * (1 + 1e-9)
    assert t["imerge"] < 0.6 * t["merge"]

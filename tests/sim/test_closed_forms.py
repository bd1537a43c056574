"""The simulator against closed forms: one flow, incast, sharded PS, ring all-reduce."""

import numpy as np
import pytest

from gradsum.schedule import ClusterSpec, Group, Part, Plan, make_planner, uniform_profile
from gradsum.schedule.costs import AllReduceCost, AlphaBeta
from gradsum.sim.engine import Simulation, simulate
from gradsum.sim.fluid import FluidNetwork, max_min_rates

MB = 1_000_000


def one_layer(elements):
    return uniform_profile([elements], [0.0], [0.0])


def test_max_min_fair_rates_on_a_textbook_example():
    # Resources: A (cap 10) shared by flows 0,1,2; B (cap 2) also crossed by flow 0.
    paths = np.array([[0, 1], [0, -1], [0, -1]])
    assert max_min_rates(paths, np.array([10.0, 2.0])) == pytest.approx([2, 4, 4])


def test_rates_are_recomputed_when_a_flow_ends():
    network = FluidNetwork(np.array([10.0]))
    network.add("short", (0,), 10.0)
    network.add("long", (0,), 30.0)
    assert network.time_to_next_completion() == pytest.approx(2.0)  # 5 each
    assert network.advance(2.0) == ["short"]
    assert network.time_to_next_completion() == pytest.approx(2.0)  # 20 left at 10


def test_one_flow_each_way():
    cluster = ClusterSpec(1, 1, 1, worker_bw=4e8, shard_bw=1e9, alpha_worker=1e-4, alpha_shard=2e-5)
    profile = one_layer(MB)
    result = simulate(profile, make_planner("wfbp")(profile, cluster), cluster)
    # push: α_w, 4 MB at the slower port, α_s; pull: α_s, 4 MB back, α_w.
    assert result.iteration_s == pytest.approx(2 * (1e-4 + 2e-5 + 4 * MB / 4e8))


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_incast_to_one_ps_shares_its_ingress(workers):
    cluster = ClusterSpec(
        workers, 1, 1, worker_bw=1e10, shard_bw=1e9, alpha_worker=0, alpha_shard=0
    )
    profile = one_layer(MB)
    result = simulate(profile, make_planner("wfbp")(profile, cluster), cluster)
    assert result.iteration_s == pytest.approx(2 * workers * 4 * MB / 1e9)


def test_sharded_push_and_pull_match_the_bottleneck_formula():
    # n = 4 workers, m = 2 shards, group split across both, workers rotate their first shard:
    # push ≈ max(S/B_worker, n·S/(m·B_shard)), pull symmetric.
    n, m, size = 4, 2, 4 * MB
    cluster = ClusterSpec(n, m, 1, worker_bw=1e10, shard_bw=5e8, alpha_worker=0, alpha_shard=0)
    profile = one_layer(MB)
    half = MB // 2
    plan = Plan(
        "sharded",
        (Group(0, MB, (Part(0, 0, half), Part(1, half, MB))),),
        (0, MB),
        ((0,),),
        interleave=True,
    )
    expected = 2 * max(size / 1e10, n * size / (m * 5e8))
    assert simulate(profile, plan, cluster).iteration_s == pytest.approx(expected)


def test_a_groups_parts_are_in_flight_together_with_or_without_interleaving():
    # The window admits a group whole and each part travels on its own shard's stream, so with
    # one group the synchronised plan moves as fast as the rotated one: the bottleneck formula.
    n, m = 4, 2
    cluster = ClusterSpec(n, m, 1, worker_bw=1e10, shard_bw=5e8, alpha_worker=0, alpha_shard=0)
    profile = one_layer(MB)
    half = MB // 2
    groups = (Group(0, MB, (Part(0, 0, half), Part(1, half, MB))),)
    plain = Plan("synchronised", groups, (0, MB), ((0,),))
    rotated = Plan("interleaved", groups, (0, MB), ((0,),), interleave=True)
    expected = 2 * max(4 * MB / 1e10, n * 4 * MB / (m * 5e8))
    assert simulate(profile, plain, cluster).iteration_s == pytest.approx(expected)
    assert simulate(profile, rotated, cluster).iteration_s == pytest.approx(expected)


def test_one_shard_stream_carries_one_part_at_a_time():
    # Two groups on the same shard, both in the window: the second part waits for the first's
    # round trip (push, sum, pull) on the worker's stream to that shard.
    cluster = ClusterSpec(1, 1, 1, worker_bw=1e9, shard_bw=1e9, alpha_worker=0, alpha_shard=0)
    profile = uniform_profile([MB, MB], [0.0, 0.0], [0.0, 0.0])
    groups = (Group(0, MB, (Part(0, 0, MB),)), Group(MB, 2 * MB, (Part(0, MB, 2 * MB),)))
    plan = Plan("one shard", groups, (0, MB, 2 * MB), ((0,), (1,)), credit_bytes=8 * MB)
    trace = []
    Simulation(profile, plan, cluster, trace=trace).run()
    first = [(t, event, g) for t, event, _w, g, _k in trace if event != "release"][:4]
    assert [(event, g) for _, event, g in first] == [
        ("start", 0),
        ("back", 0),
        ("start", 1),
        ("back", 1),
    ]
    assert first[1][0] == first[2][0] == pytest.approx(2 * 4 * MB / 1e9)  # push and pull


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_ring_all_reduce_time(workers):
    cluster = ClusterSpec(workers, 1, 1, worker_bw=1e9, alpha_worker=5e-5)
    profile = one_layer(MB)
    plan = make_planner("wfbp", aggregator="allreduce")(profile, cluster)
    ring = AllReduceCost(AlphaBeta(5e-5, 1 / 1e9), workers)
    assert simulate(profile, plan, cluster).iteration_s == pytest.approx(ring.time(4 * MB))


def test_ring_across_two_machines_is_limited_by_the_nic():
    cluster = ClusterSpec(4, 1, 2, worker_bw=1e9, nic_bw=2.5e8, alpha_worker=0)
    profile = one_layer(MB)
    plan = make_planner("wfbp", aggregator="allreduce")(profile, cluster)
    # Two ring hops cross machines, one flow per NIC direction each step.
    assert simulate(profile, plan, cluster).iteration_s == pytest.approx(6 * MB / 2.5e8)


def test_compute_only_when_communication_is_free():
    profile = uniform_profile([10, 10, 10], [0.01, 0.02, 0.03], [0.005, 0.005, 0.005])
    cluster = ClusterSpec(1, 1, 1, worker_bw=1e15, shard_bw=1e15, alpha_worker=0, alpha_shard=0)
    result = simulate(profile, make_planner("default")(profile, cluster), cluster)
    assert result.iteration_s == pytest.approx(profile.compute_s, rel=1e-6)
    assert result.throughput == pytest.approx(1 / profile.compute_s, rel=1e-6)

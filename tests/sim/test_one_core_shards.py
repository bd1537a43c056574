"""One core per PS shard (``ClusterSpec.shard_one_core``): a shard's per-message and per-byte work
share one server. The bug feared: the option doing nothing (bytes still on a port beside the
core, so a shard's fixed costs and its bytes overlap), or charging bytes twice (on a port and on
the core), or charging anything when one kind of work is absent.

n workers push one part each to one shard, which answers all of them: a shard round. Its time
is simulated time (deterministic), and the shard's throughput is the rounds it serves per
simulated second. With one core a round is exactly 2n·(α_shard + M/B_shard); with a port beside
the core the two overlap, so where both are there the round is shorter, and where either is
absent the two are the same round.
"""

from dataclasses import replace

import pytest

from gradsum.schedule import ClusterSpec, make_planner, uniform_profile
from gradsum.schedule.costs import ps_step_end
from gradsum.sim.engine import simulate

ELEMENTS = 250_000  # 1 MB of fp32
WORKERS = 8


def shard_round(alpha_shard: float, shard_bw: float, one_core: bool) -> tuple[float, int]:
    """The simulated seconds of one shard round, and the messages sent in all iterations."""
    result = shard_result(alpha_shard, shard_bw, one_core)
    return result.iteration_s, result.messages


def shard_result(alpha_shard: float, shard_bw: float, one_core: bool):
    cluster = ClusterSpec(
        WORKERS,
        1,
        1,
        worker_bw=1e15,  # workers' ports never the bottleneck
        shard_bw=shard_bw,
        alpha_worker=0.0,
        alpha_shard=alpha_shard,
        shard_one_core=one_core,
    )
    profile = uniform_profile([ELEMENTS], [0.0], [0.0])
    return simulate(profile, make_planner("wfbp")(profile, cluster), cluster)


def rounds_per_s(alpha_shard: float, shard_bw: float, one_core: bool) -> float:
    return 1 / shard_round(alpha_shard, shard_bw, one_core)[0]


def test_one_core_is_the_sum_of_a_shards_message_and_byte_work():
    alpha, bw = 200e-6, 1e9
    round_s = 2 * WORKERS * (alpha + ELEMENTS * 4 / bw)
    seconds, _ = shard_round(alpha, bw, one_core=True)
    assert seconds == pytest.approx(round_s)
    # In steady state the core bounds the round whether or not a port also carried the bytes;
    # the first round, every worker pushing at once, shows bytes charged once, on the core: a
    # port kept beside it would add the n-way incast's n·M/B before the core starts.
    first = shard_result(alpha, bw, one_core=True).iteration_ends[0]
    assert first == pytest.approx(round_s, rel=1e-6)


def test_one_core_lowers_a_shards_throughput_where_messages_and_bytes_compete():
    alpha, bw = 200e-6, 1e9  # 0.2 ms per message against 1 ms of bytes
    apart = rounds_per_s(alpha, bw, one_core=False)
    shared = rounds_per_s(alpha, bw, one_core=True)
    # apart, the port moves the bytes of the next pushes while the core handles the first
    # ones: a round is the n-way incast each way plus what of the core's work does not overlap
    assert shared < apart / 1.05
    assert 1 / apart < 2 * WORKERS * (alpha + ELEMENTS * 4 / bw)


@pytest.mark.parametrize(
    ("alpha", "bw", "round_s"),
    [
        (0.0, 1e9, 2 * WORKERS * ELEMENTS * 4 / 1e9),  # no per-message work: bytes alone
        (200e-6, 1e18, 2 * WORKERS * 200e-6),  # bytes take no time: messages alone
    ],
    ids=["messages idle", "bytes idle"],
)
def test_one_core_changes_nothing_where_either_kind_of_work_is_idle(alpha, bw, round_s):
    apart, apart_messages = shard_round(alpha, bw, one_core=False)
    shared, shared_messages = shard_round(alpha, bw, one_core=True)
    assert shared == pytest.approx(apart, rel=1e-6)
    assert shared == pytest.approx(round_s, rel=1e-6)
    assert shared_messages == apart_messages == 3 * WORKERS  # a part per worker, 3 iterations


def test_the_planners_play_prices_a_one_core_shard_as_the_simulator_runs_it():
    alpha, bw = 200e-6, 1e9
    cluster = ClusterSpec(
        WORKERS, 1, 1, worker_bw=1e15, shard_bw=bw, alpha_worker=0.0, alpha_shard=alpha
    )
    profile = uniform_profile([ELEMENTS], [0.0], [0.0])
    plan = make_planner("wfbp")(profile, cluster)
    one_core = replace(cluster, shard_one_core=True)
    played = ps_step_end(plan, one_core, profile.ready_times())
    assert played == pytest.approx(shard_round(alpha, bw, one_core=True)[0], rel=1e-6)
    assert played > ps_step_end(plan, cluster, profile.ready_times())


def test_the_prototype_preset_is_one_core_shards_one_group_and_one_slice_in_flight():
    from gradsum.sim.presets import get_preset

    prototype = get_preset("imerge-prototype")
    assert prototype.cluster(32).shard_one_core
    assert not get_preset("imerge-seed").cluster(32).shard_one_core
    assert prototype.planner_options("wfbp")["window"] == "group"
    assert prototype.planner_options("wfbp")["placement"] == "whole"
    # a prototype that waits for each answer sends priority's slices one at a time too
    assert prototype.planner_options("priority")["credit_elements"] is None
    assert "credit_elements" not in get_preset("imerge-seed").planner_options("priority")
    assert "ps-core" in prototype.measured and not prototype.fitted

"""Nodes that share one host's few cores: the PS model queues every node's per-message CPU
on them, so a group spread over shards pays for each part's fixed costs in series."""

import dataclasses

import pytest

from gradsum.schedule import AlphaBeta, ClusterSpec, make_planner, uniform_profile
from gradsum.schedule.calibration import cluster_from_fit
from gradsum.schedule.costs import ps_step_end
from gradsum.schedule.plan import Group, Part, Plan

# digits-cnn's three layers, backward order, as profiled on this host
CNN = uniform_profile([1_290, 4_640, 160], [0.27e-3, 1.0e-3, 0.37e-3], [0.5e-3, 0.3e-3, 0.8e-3])
# a start-up fit of digits-cnn at 100 Mbit/s, 4 workers, 2 shards (docs/scheduling.md)
FIT_100MBIT = AlphaBeta(3.8e-3, 1 / 12e6)


def one_group(elements: int, shards: int) -> Plan:
    """All ``elements`` in one group, cut evenly over ``shards`` parts."""
    cuts = [elements * s // shards for s in range(shards + 1)]
    parts = tuple(Part(s, cuts[s], cuts[s + 1]) for s in range(shards))
    return Plan("test", (Group(0, elements, parts),), (0, elements))


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize("cores", [None, 1, 2, 16])
def test_the_calibration_round_trip_is_played_back_as_measured(workers, cores):
    # one message from every worker to shard 0 and back, nothing else in flight: the fixed
    # time the fit measured, whatever the cores, so the pool prices load, not a single trip
    fit = AlphaBeta(3e-3, 1e-12)
    cluster = cluster_from_fit(fit, workers, 1, shared_cores=cores)
    assert ps_step_end(one_group(1, 1), cluster, [0.0]) == pytest.approx(fit.alpha, rel=1e-3)


def test_a_second_shard_costs_its_parts_cpu_on_shared_cores():
    alone = cluster_from_fit(FIT_100MBIT, 4, 2, remote=3)
    shared = cluster_from_fit(FIT_100MBIT, 4, 2, remote=3, shared_cores=2)
    # one part: nearly the same time either way (the calibration's own case, but the fixed
    # costs split differently between the thread and the shard, so its bytes overlap them
    # differently)
    single = [ps_step_end(one_group(6_090, 1), c, [0.0]) for c in (alone, shared)]
    assert single[0] == pytest.approx(single[1], rel=0.05)
    # two parts on two shards: in parallel on their own cores, one after another on shared ones
    split = [ps_step_end(one_group(6_090, 2), c, [0.0]) for c in (alone, shared)]
    assert split[0] < single[0]  # the links in parallel: spreading pays where cores are free
    assert split[1] > split[0] + 0.5 * FIT_100MBIT.alpha / 2  # ≥ half a part's CPU queued


@pytest.mark.parametrize("fit", [FIT_100MBIT, AlphaBeta(3.7e-3, 1 / 21e6)])
def test_imerge_stops_splitting_where_the_shards_share_the_workers_cores(fit):
    """The testbed's digits-cnn fits: with a core per node imerge cuts the one group over both
    shards; with the 9 processes on 2 cores it sends merge's single message. (The plays taken
    as exact here: a fitted cluster's resolution is the next test's.)"""
    imerge = make_planner("imerge")
    alone = imerge(CNN, dataclasses.replace(cluster_from_fit(fit, 4, 2, remote=3), resolution=0))
    shared = imerge(CNN, cluster_from_fit(fit, 4, 2, remote=3, shared_cores=2))
    assert sum(len(g.parts) for g in alone.groups) > 1
    assert [len(g.parts) for g in shared.groups] == [1]


def test_imerge_keeps_fewer_messages_unless_more_pay_beyond_the_fits_resolution():
    """At 1 Gbit/s two parts end the played step 5 % before one (6.4 against 6.8 ms), less than
    a fitted cluster resolves: imerge sends the one message. At 100 Mbit/s they end it more
    than 10 % sooner, and it still splits."""
    imerge = make_planner("imerge")
    fast = cluster_from_fit(AlphaBeta(3.7e-3, 1 / 21e6), 4, 2, remote=3)
    assert fast.resolution == 0.1
    exact = dataclasses.replace(fast, resolution=0)
    split, kept = imerge(CNN, exact), imerge(CNN, fast)
    assert [len(g.parts) for g in split.groups] == [2]
    assert [len(g.parts) for g in kept.groups] == [1]
    ready = CNN.ready_times()
    assert ps_step_end(split, exact, ready) < ps_step_end(kept, exact, ready)
    assert ps_step_end(kept, exact, ready) <= 1.1 * ps_step_end(split, exact, ready)
    slow = imerge(CNN, cluster_from_fit(FIT_100MBIT, 4, 2, remote=3))
    assert [len(g.parts) for g in slow.groups] == [2]


def test_an_injected_wait_holds_the_thread_not_the_cores():
    base = ClusterSpec(4, 2, alpha_worker=1e-3, shared_cores=1)
    waiting = dataclasses.replace(base, alpha_worker=3e-3, worker_wait=2e-3)
    assert base.worker_message_time() == pytest.approx(4e-3)  # 4 workers' CPU on one core
    assert waiting.worker_cpu == pytest.approx(1e-3)
    assert waiting.worker_message_time() == pytest.approx(2e-3 + 4e-3)
    assert ClusterSpec(4, 2, alpha_worker=1e-3).worker_message_time() == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"shared_cores": 0}, "shared_cores must be at least 1"),
        ({"worker_wait": 1.0}, "worker_wait"),
        ({"worker_wait": -1e-6}, "worker_wait"),
        ({"resolution": 1.0}, "resolution"),
        ({"resolution": -0.1}, "resolution"),
    ],
)
def test_a_cluster_with_impossible_core_settings_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(4, 2, alpha_worker=1e-3, **options)


# digits-wide (4,349,962 parameters in three layers, backward order) as profiled on this host
WIDE = uniform_profile([20_490, 4_196_352, 133_120], [0.5e-3, 30e-3, 3e-3], [3e-3, 30e-3, 0.5e-3])


@pytest.mark.parametrize("fit", [AlphaBeta(7.0e-3, 1 / 39e6), AlphaBeta(4.9e-3, 1 / 34e6)])
def test_imerge_sends_the_4m_parameter_model_as_one_message_per_shard_within_the_resolution(fit):
    """Start-up fits of digits-wide at 1 Gbit/s, 0 ms (docs/scheduling.md, "How is a start-up
    fit judged"): the last layer's 20,490 elements alone first play under 1 % faster, and the
    testbed measured fusion's one group over both shards 2-5 % ahead. imerge now sends that."""
    imerge = make_planner("imerge")
    fitted = cluster_from_fit(fit, 4, 2, remote=3, shared_cores=2)
    exact = dataclasses.replace(fitted, resolution=0)
    split, kept = imerge(WIDE, exact), imerge(WIDE, fitted)
    assert [g.numel for g in split.groups] == [20_490, 4_329_472]
    assert [(g.numel, len(g.parts)) for g in kept.groups] == [(4_349_962, 2)]
    ready = WIDE.ready_times()
    assert ps_step_end(kept, exact, ready) <= 1.01 * ps_step_end(split, exact, ready)

import dataclasses

import pytest

from gradsum.schedule import (
    PLANNER_NAMES,
    AllReduceCost,
    AlphaBeta,
    ClusterSpec,
    Group,
    Part,
    Plan,
    PSCost,
    make_planner,
    parse_scheduler,
    uniform_profile,
)
from gradsum.schedule.calibration import cluster_from_fit
from gradsum.schedule.costs import ps_step_end
from gradsum.schedule.grouping import (
    mgwfbp_groups,
    search_groups,
    threshold_groups,
)
from gradsum.schedule.placement import (
    place_by_layer,
    place_partitioned,
    place_spread,
    place_whole,
)


def linear(alpha, beta):
    return lambda n: alpha + beta * n


# --------------------------------------------------------------------------- fusion rules
def test_static_threshold_keeps_groups_within_the_threshold():
    sizes = [300_000, 300_000, 100_000, 600_000, 50_000]
    assert threshold_groups(sizes, 500_000) == [(0, 1), (1, 3), (3, 4), (4, 5)]


def test_mgwfbp_merges_a_layer_ready_before_the_open_group_can_start():
    # Layer 0's long transfer (10.1 s) delays layer 1's, so layer 2 (ready at 3) joins it free.
    ranges = mgwfbp_groups([1000, 10, 10], [1, 2, 3], linear(0.1, 0.01), alpha=0.1)
    assert ranges == [(0, 1), (1, 3)]


def test_mgwfbp_merges_when_waiting_costs_less_than_alpha():
    # Layer 1 is ready 0.05 s after layer 0 (< α = 0.1): wait for it. Layer 2 is 1 s later.
    ranges = mgwfbp_groups([10, 10, 10], [1, 1.05, 2.05], linear(0.1, 1e-9), alpha=0.1)
    assert ranges == [(0, 2), (2, 3)]


def test_mgwfbp_keeps_layers_apart_when_waiting_costs_more_than_alpha():
    ranges = mgwfbp_groups([10, 10, 10], [1, 1.2, 1.4], linear(0.1, 1e-9), alpha=0.1)
    assert ranges == [(0, 1), (1, 2), (2, 3)]


def test_ring_alpha_grows_with_workers_until_everything_merges():
    link = AlphaBeta(1e-3, 1e-9)
    ready = [0.01 * (i + 1) for i in range(8)]
    sizes = [1000] * 8
    small, large = AllReduceCost(link, 2), AllReduceCost(link, 32)
    assert small.alpha == pytest.approx(2e-3) and large.alpha == pytest.approx(62e-3)
    assert len(mgwfbp_groups(sizes, ready, small.time, small.alpha)) == 8
    assert mgwfbp_groups(sizes, ready, large.time, large.alpha) == [(0, 8)]


def test_search_keeps_the_first_start_on_a_tie_and_takes_a_strictly_better_move():
    # A model where only the group count matters: fewer is better down to 2 groups.
    def evaluate(candidate):
        return abs(len(candidate) - 2) + 1.0, 0.0

    singles = tuple((i, i + 1, 1) for i in range(6))
    best = search_groups(6, [singles], evaluate)
    assert len(best) == 2 and best[0][0] == 0 and best[-1][1] == 6
    flat = lambda candidate: (1.0, 0.0)  # noqa: E731 (nothing is better than anything)
    assert search_groups(6, [singles, ((0, 6, 1),)], flat) == singles
    # equal ends: the smaller tie-break wins
    assert search_groups(6, [singles, ((0, 6, 1),)], lambda c: (1.0, -len(c))) == singles
    assert search_groups(6, [singles, ((0, 6, 1),)], lambda c: (1.0, len(c))) == ((0, 6, 1),)


def test_search_steps_spans_to_the_candidates():
    best = search_groups(1, [((0, 1, 1),)], lambda c: (-c[0][2], 0.0), spans=(1, 2, 4, 8))
    assert best == ((0, 1, 8),)


def test_ps_step_end_plays_what_the_simulator_runs():
    from gradsum.schedule.costs import ps_step_end
    from gradsum.sim.engine import simulate

    profile = uniform_profile([30_000] * 12, [0.0005] * 12, [0.00025] * 12)
    cluster = ClusterSpec(8, 8, 2, worker_bw=5e9, shard_bw=2e9, nic_bw=12.5e9,
                          alpha_worker=1e-3, alpha_shard=1e-4)  # fmt: skip
    forward = sum(layer.forward_s for layer in profile.layers)
    cases = [("wfbp", {}, 0.1), ("fusion", {"threshold": 90_000}, 0.1), ("imerge", {}, 0.1)]
    # One group's round trip at a time: the play admits groups as the SendWindow does, and
    # takes the workers' sends after an answer as staggered by one shard core's n answers
    # (the simulator plays each worker's own window): 1% / 9% / 13% off here.
    cases += [(name, {"window": "group"}, 0.15) for name in ("wfbp", "merge", "imerge")]
    for name, options, tolerance in cases:
        plan = make_planner(name, **options)(profile, cluster)
        simulated = simulate(profile, plan, cluster).iteration_s - forward
        assert ps_step_end(plan, cluster, profile.ready_times()) == pytest.approx(
            simulated, rel=tolerance
        ), (name, options)
    # the one-group window serialises the round trips the open window overlaps
    open_window, one = (
        ps_step_end(make_planner("wfbp", window=w)(profile, cluster), cluster,
                    profile.ready_times())
        for w in ("all", "group")
    )  # fmt: skip
    assert one > 1.2 * open_window
    with pytest.raises(ValueError, match="window must be one of"):
        make_planner("wfbp", window="two")(profile, cluster)
    with pytest.raises(ValueError, match="list order"):
        ps_step_end(make_planner("priority")(profile, cluster), cluster, profile.ready_times())


# --------------------------------------------------------------------------- cost models
def test_ps_cost_incast_and_interleaving():
    cluster = ClusterSpec(8, 8, 1, worker_bw=10e9, shard_bw=1e9, alpha_worker=0, alpha_shard=0)
    cost = PSCost(cluster)
    megabyte = 1e6
    # All 8 workers at one shard: each gets 1/8 of its ingress.
    assert cost.time(megabyte, 1, interleaved=False) == pytest.approx(8 * megabyte / 1e9)
    # Spread over 8 shards with rotation: one worker per shard at a time, shard-port bound.
    assert cost.time(megabyte, 8, interleaved=True) == pytest.approx(megabyte / 1e9)


def test_ps_cost_counts_queued_messages_at_a_shard():
    cluster = ClusterSpec(4, 4, 1, alpha_worker=1e-4, alpha_shard=1e-5)
    cost = PSCost(cluster)
    assert cost.time(0, 1, interleaved=False) == pytest.approx(1e-4 + 4 * 1e-5)
    assert cost.time(0, 4, interleaved=True) == pytest.approx(4 * (1e-4 + 1e-5))


def test_ring_allreduce_cost_formula():
    cost = AllReduceCost(AlphaBeta(1e-4, 1e-9), 4)
    assert cost.time(4e6) == pytest.approx(6 * (1e-4 + 1e-9 * 1e6))
    assert AllReduceCost(AlphaBeta(1e-4, 1e-9), 1).time(4e6) == 0


# --------------------------------------------------------------------------- planners
def comm_bound_setup(workers=32):
    """Twelve equal layers computed quickly on a slow, many-worker PS cluster."""
    profile = uniform_profile([250_000] * 12, [0.002] * 12, [0.001] * 12)
    cluster = ClusterSpec(
        workers, workers, 2, worker_bw=6e9, shard_bw=2.5e9, alpha_worker=3e-4, alpha_shard=5e-5
    )
    return profile, cluster


@pytest.mark.parametrize("name", PLANNER_NAMES)
def test_every_planner_covers_the_buffer_and_fits_the_cluster(name):
    profile, cluster = comm_bound_setup(8)
    plan = make_planner(name)(profile, cluster)
    assert plan.total_elements == profile.total_params
    assert sum(g.numel for g in plan.groups) == profile.total_params
    assert all(p.shard < cluster.shards for g in plan.groups for p in g.parts)
    assert plan.policy == name


def test_default_and_wfbp_send_one_group_per_layer_at_different_times():
    profile, cluster = comm_bound_setup(4)
    default = make_planner("default")(profile, cluster)
    wfbp = make_planner("wfbp")(profile, cluster)
    assert len(default.groups) == len(wfbp.groups) == 12
    assert default.trigger == "after_backward" and wfbp.trigger == "when_ready"
    assert [tuple(default.layers_of(g)) for g in default.groups] == [(i,) for i in range(12)]


def test_whole_placement_balances_shards():
    profile, cluster = comm_bound_setup(4)
    plan = make_planner("wfbp")(profile, cluster)
    assert list(plan.shard_load(4)) == [750_000] * 4


def test_all_reduce_model_merges_everything_where_the_ps_model_does_not():
    profile, cluster = comm_bound_setup(32)
    mgwfbp = make_planner("mgwfbp")(profile, cluster)
    merge = make_planner("merge")(profile, cluster)
    assert len(mgwfbp.groups) == 1
    assert len(merge.groups) > 1
    # With 2 workers the ring start-up is small and MG-WFBP keeps groups apart too.
    small_profile, small_cluster = comm_bound_setup(2)
    assert len(make_planner("mgwfbp")(small_profile, small_cluster).groups) > 1


def test_imerge_spreads_groups_and_rotates_each_workers_first_shard_when_asked():
    # Where bytes, not messages, cost (1 µs per message), spreading a group's incast pays.
    profile, cluster = comm_bound_setup(8)
    cluster = dataclasses.replace(cluster, alpha_worker=1e-6, alpha_shard=1e-7)
    plan = make_planner("imerge", interleave=True)(profile, cluster)
    assert plan.interleave
    big = max(plan.groups, key=lambda g: len(g.parts))
    span = len(big.parts)
    assert span > 1
    first_shards = {plan.part_order(big, w)[0].shard for w in range(span)}
    assert len(first_shards) == span  # workers meet at a shard only every `span` workers
    merge = make_planner("merge")(profile, cluster)
    assert all(len(g.parts) == 1 for g in merge.groups)
    assert {merge.part_order(merge.groups[0], w)[0].shard for w in range(8)} == {
        merge.groups[0].parts[0].shard
    }


def _imerge_clusters():
    """Clusters where rotating ties the in-order play, and ones where it loses."""
    profile, cluster = comm_bound_setup(8)
    yield profile, dataclasses.replace(cluster, alpha_worker=1e-6, alpha_shard=1e-7)
    yield profile, cluster
    # digits-wide on the testbed: 4 workers, 2 shards, 9 processes on 2 cores, 2 ms injected
    wide = uniform_profile(
        [20_490, 4_196_352, 133_120], [0.5e-3, 30e-3, 3e-3], [3e-3, 30e-3, 0.5e-3]
    )
    testbed = cluster_from_fit(AlphaBeta(5e-3, 1 / 30e6), 4, 2, remote=3, shared_cores=2)
    yield wide, testbed.with_message_delay(2e-3)


@pytest.mark.parametrize("setup", range(3))
def test_imerge_rotates_only_where_its_play_shows_a_gain(setup):
    profile, cluster = list(_imerge_clusters())[setup]
    ready = profile.ready_times()
    chosen = make_planner("imerge")(profile, cluster)
    rotated = make_planner("imerge", interleave=True)(profile, cluster)
    in_order = make_planner("imerge", interleave=False)(profile, cluster)
    plans = {"chosen": chosen, "rotated": rotated, "in order": in_order}
    ends = {name: ps_step_end(plan, cluster, ready) for name, plan in plans.items()}
    assert ends["chosen"] <= min(ends["rotated"], ends["in order"]) * (1 + 1e-9)
    assert any(len(g.parts) > 1 for g in chosen.groups)  # it still spreads groups over shards
    # a tie keeps the order every worker sends in: the rotation is asked for, not assumed
    assert not chosen.interleave and not in_order.interleave and rotated.interleave
    assert "interleaved" in rotated.summary() and "interleaved" not in chosen.summary()


def test_imerge_without_fusion_keeps_one_group_per_layer_and_searches_spans():
    profile, cluster = comm_bound_setup(8)
    plan = make_planner("imerge", fuse=False, interleave=True)(profile, cluster)
    assert len(plan.groups) == len(profile.layers) and plan.interleave
    assert max(len(g.parts) for g in plan.groups) > 1
    fused = make_planner("imerge", interleave=True)(profile, cluster)
    assert len(fused.groups) < len(profile.layers)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("imerge", ("imerge", {})),
        (
            " imerge(interleave=true,window=group) ",
            ("imerge", {"interleave": True, "window": "group"}),
        ),
        ("priority(credit_elements=1000000)", ("priority", {"credit_elements": 1_000_000})),
        ("priority(credit_elements=none)", ("priority", {"credit_elements": None})),
    ],
)
def test_a_scheduler_spec_gives_its_policy_and_options(spec, expected):
    assert parse_scheduler(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("imerge(bogus=1)", "scheduler 'imerge' has no option bogus; its options are window, "
         "interleave, fuse, max_evaluations"),
        ("imerge(interleave=maybe)", "interleave=maybe is not true or false or none"),
        ("fusion(threshold=0.5)", "threshold=0.5 is not an integer"),
        ("nosuch", "unknown scheduler 'nosuch'; choose one of default, wfbp"),
        ("imerge(window=group", "options go as NAME"),
        ("imerge(window)", "scheduler option 'window' is not of the form name=value"),
    ],
)
def test_a_bad_scheduler_spec_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_scheduler(spec)


def test_priority_slices_front_layers_first_with_a_credit():
    profile = uniform_profile([250_000, 40_000, 100_001], [0.01] * 3)
    cluster = ClusterSpec(4, 4)
    plan = make_planner("priority", slice_elements=100_000, credit_elements=200_000)(
        profile, cluster
    )
    assert [g.numel for g in plan.groups] == [100_000, 100_000, 50_000, 40_000, 100_000, 1]
    # Layer 2 (backward order) is the model's first layer: it gets the most urgent priority.
    assert [g.priority for g in plan.groups] == [2, 2, 2, 1, 0, 0]
    assert plan.order == "priority" and plan.forward_gate == "layer"
    assert plan.credit_bytes == 800_000
    assert all(len(g.parts) == 1 for g in plan.groups)


def test_fusion_threshold_option_is_honoured():
    profile = uniform_profile([100, 100, 100, 100], [0.01] * 4)
    plan = make_planner("fusion", threshold=200)(profile, ClusterSpec(2, 2))
    assert [g.numel for g in plan.groups] == [200, 200]


def test_all_reduce_plans_have_no_parts():
    profile, cluster = comm_bound_setup(4)
    plan = make_planner("wfbp", aggregator="allreduce")(profile, cluster)
    assert plan.aggregator == "allreduce" and all(g.parts == () for g in plan.groups)


def test_unknown_policy_and_option_are_clear_errors():
    with pytest.raises(ValueError, match="imerge"):
        make_planner("bytescheduler")
    with pytest.raises(ValueError, match="threshold"):
        make_planner("fusion", treshold=5)


# --------------------------------------------------------------------------- plan structure
def test_plan_maps_groups_to_layers_and_parameters():
    profile = uniform_profile([10, 20, 30], [0.1] * 3)
    plan = Plan(
        "custom",
        (Group(0, 15, (Part(0, 0, 15),)), Group(15, 60, (Part(1, 15, 60),))),
        (0, 10, 30, 60),
        ((0,), (1,), (2,)),
    )
    assert list(plan.layers_of(plan.groups[0])) == [0, 1]
    assert plan.params_of(plan.groups[1]) == (1, 2)
    del profile


def test_plan_rejects_gaps_overlaps_and_bad_parts():
    offsets = (0, 10, 20)
    with pytest.raises(ValueError, match="cover"):
        Plan("x", (Group(0, 10, (Part(0, 0, 10),)),), offsets)
    with pytest.raises(ValueError, match="tile"):
        Plan("x", (Group(0, 20, (Part(0, 0, 5), Part(1, 6, 20))),), offsets)
    with pytest.raises(ValueError, match="same shard"):
        Plan("x", (Group(0, 20, (Part(0, 0, 5), Part(0, 5, 20))),), offsets)
    with pytest.raises(ValueError, match="trigger"):
        Plan("x", (Group(0, 20, (Part(0, 0, 20),)),), offsets, trigger="sometimes")


def test_spread_placement_continues_around_the_ring():
    parts = place_spread([(0, 10), (10, 20)], [3, 2], 4)
    assert [[p.shard for p in group] for group in parts] == [[0, 1, 2], [3, 0]]
    assert [(p.start, p.stop) for p in parts[0]] == [(0, 3), (3, 7), (7, 10)]
    assert [p[0].shard for p in place_whole([(0, 5), (5, 6), (6, 7)], 2)] == [0, 1, 1]


def test_partitioned_placement_cuts_big_groups_over_distinct_shards():
    parts = place_partitioned([(0, 10), (10, 35)], num_shards=4, partition=10)
    assert [len(p) for p in parts] == [1, 3]
    assert len({part.shard for part in parts[1]}) == 3
    assert max(part.numel for part in parts[1]) <= 10


def test_slices_stay_on_their_layers_shard():
    parts = place_by_layer([(0, 5), (5, 10), (10, 12)], [0, 10, 12], num_shards=4)
    assert parts[0][0].shard == parts[1][0].shard != parts[2][0].shard


def test_all_reduce_fit_through_the_ps_counts_concurrency_twice():
    cluster = ClusterSpec(32, 32, 2, shard_bw=2.5e9, alpha_worker=1e-4, alpha_shard=5e-5)
    fitted = AllReduceCost.fitted_through_ps(cluster)
    assert fitted.link.alpha == pytest.approx(2 * (1e-4 + 32 * 5e-5))
    assert fitted.alpha == pytest.approx(62 * fitted.link.alpha)


def test_baseline_placement_is_a_stated_parameter():
    profile = uniform_profile([3_000_000, 10, 500_000, 20], [0.01] * 4)
    cluster = ClusterSpec(4, 4)
    pieces = make_planner("wfbp", placement="pieces")(profile, cluster)
    whole = make_planner("wfbp", placement="whole")(profile, cluster)
    assert len(pieces.groups[0].parts) == 3  # BytePS: ≤ 1,024,000-element partitions
    assert [[p.shard for p in g.parts] for g in whole.groups] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="placement"):
        make_planner("default", placement="hashed")(profile, cluster)


def test_the_largest_piece_is_a_stated_parameter_merge_places_as_the_baselines():
    profile = uniform_profile([3_000_000, 10, 500_000, 20], [0.01] * 4)
    cluster = ClusterSpec(4, 4)
    for policy in ("default", "wfbp", "fusion", "mgwfbp"):
        plan = make_planner(policy, partition=4_000_000)(profile, cluster)
        assert len(plan.groups[0].parts) == 1, policy  # 3M elements: under one piece
    merge = make_planner("merge", partition=2_000_000)(profile, cluster)
    assert all(len(g.parts) == -(-g.numel // 2_000_000) for g in merge.groups)
    with pytest.raises(ValueError, match="partition"):
        make_planner("wfbp", partition=0)(profile, cluster)


def test_priority_slices_are_placed_as_bytescheduler_or_p3():
    profile = uniform_profile([400_000, 100_000], [0.01] * 2)
    cluster = ClusterSpec(4, 4)
    shards = {
        name: [g.parts[0].shard for g in make_planner("priority", slice_placement=name)(
            profile, cluster).groups]
        for name in ("bytescheduler", "p3", "layer")
    }  # fmt: skip
    assert len(set(shards["bytescheduler"][:4])) == 4  # a key per slice: the layer spreads
    assert shards["p3"] == [0, 1, 2, 3, 0]
    assert len(set(shards["layer"][:4])) == 1  # every slice on its layer's shard


@pytest.mark.parametrize(("gain", "resolution", "rotates"),
                         [(0.05, 0.0, True), (0.05, 0.1, False), (0.2, 0.1, True)])  # fmt: skip
def test_imerge_rotates_only_for_a_gain_beyond_the_clusters_resolution(
    monkeypatch, gain, resolution, rotates
):
    """No realistic cluster plays rotation faster (the test above), so the play is made to:
    a rotated plan ends ``gain`` sooner. A fitted cluster's resolution keeps the plan it makes
    without that gain, in order, for a gain within it."""
    from gradsum.schedule import planners

    profile, cluster = comm_bound_setup(8)
    cluster = dataclasses.replace(cluster, resolution=resolution)
    without = make_planner("imerge")(profile, cluster)
    play = planners._step_and_mean_end

    def rotation_pays(plan, cluster, ready):
        end, mean = play(plan, cluster, ready)
        return (end * (1 - gain), mean) if plan.interleave else (end, mean)

    monkeypatch.setattr(planners, "_step_and_mean_end", rotation_pays)
    plan = make_planner("imerge")(profile, cluster)
    assert plan.interleave is rotates
    if rotates:
        assert any(len(g.parts) > 1 for g in plan.groups)  # spread, so the rotation means something
    else:
        assert plan == without and not without.interleave

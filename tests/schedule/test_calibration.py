"""Start-up's α–β calibration decided from timings alone (``schedule/calibration.py``): fitted,
measured again, or the stated default, never a failure; and the cluster a fit implies."""

import argparse

import numpy as np
import pytest

from gradsum.schedule import (
    PLANNER_NAMES,
    AlphaBeta,
    ClusterSpec,
    calibration,
    make_planner,
    uniform_profile,
)
from gradsum.schedule.calibration import (
    CALIBRATION_ATTEMPTS,
    COST_FREE,
    DEFAULT_COST,
    CostModel,
    cluster_from_fit,
    cost_without_measuring,
    judge_calibration,
)

TRUTH = AlphaBeta(alpha=1e-3, beta=1e-8)  # 1 ms per message, 100 MB/s
SIZES = [4.0 * n for n in calibration.CALIBRATION_SIZES]


def _round(delays=(0.0, 0.0, 0.0)):
    """One transfer of each size, (bytes, seconds): the true cost plus the delays load added."""
    return [(b, TRUTH.time(b) + d) for b, d in zip(SIZES, delays, strict=True)]


# The small transfers were held up (a descheduled peer): 1 MiB looks no slower than 4 KiB.
STALLED = _round((20e-3, 15e-3, 0.0))


def test_a_clean_round_is_fitted_at_once():
    cost = judge_calibration([_round()])
    assert cost.source == "fitted" and cost.reason == ""
    assert (cost.fit.alpha, cost.fit.beta) == pytest.approx((TRUTH.alpha, TRUTH.beta))
    assert "(fitted)" in cost.describe()


def test_time_that_falls_with_size_is_measured_again_and_refitted():
    assert judge_calibration([STALLED]) is None  # measure once more
    cost = judge_calibration([STALLED, _round()])
    assert cost.source == "refitted"
    assert "falls with size" in cost.reason  # why the first round was not used
    # the round held up is left out: the next one is fitted alone
    assert (cost.fit.alpha, cost.fit.beta) == pytest.approx((TRUTH.alpha, TRUTH.beta))
    assert cost.describe().startswith("α 1000 µs, β 100 MB/s per message (refitted: 2 rounds")


# A transfer whose timer broke: no round with it is fitted.
BROKEN = [(b, float("nan")) for b in SIZES]


def test_rounds_that_never_fit_fall_back_to_the_stated_default():
    rounds = [BROKEN, [(SIZES[0], 1e-3)], BROKEN]  # no round with two sizes timed
    assert judge_calibration(rounds[:1]) is None and judge_calibration(rounds[:2]) is None
    cost = judge_calibration(rounds)
    assert cost == CostModel(DEFAULT_COST, "default", cost.reason)
    assert f"{CALIBRATION_ATTEMPTS} rounds of transfers gave no usable fit" in cost.reason
    assert "need at least two transfer sizes" in cost.reason and "was left out" in cost.reason
    assert "(default: 3 rounds" in cost.describe()


@pytest.mark.parametrize("broken", [float("nan"), 0.0, float("inf"), -1e-3])
def test_a_round_with_a_time_that_is_not_one_is_left_out(broken):
    samples = [(SIZES[0], 1e-3), (SIZES[1], broken)]
    with pytest.raises(ValueError, match=f"need at least two .*{broken} s was left out"):
        calibration.fit_measurements([samples])
    cost = judge_calibration([samples, _round()])  # the next round is fitted without it
    assert cost.source == "refitted" and "was left out" in cost.reason
    assert (cost.fit.alpha, cost.fit.beta) == pytest.approx((TRUTH.alpha, TRUTH.beta))


def test_time_that_falls_with_size_in_every_round_is_bounded_as_flat_at_the_last():
    # the smaller transfers slower in every round: systematic, not noise
    rounds = [STALLED, _round((25e-3, 15e-3, 0.0)), _round((20e-3, 12e-3, 0.0))]
    assert judge_calibration(rounds[:1]) is None and judge_calibration(rounds[:2]) is None
    cost = judge_calibration(rounds)
    assert cost.source == "refitted" and "fell with size" in cost.reason
    assert "per-message cost dominates" in cost.reason
    medians = [float(np.median([r[i][1] for r in rounds])) for i in range(len(SIZES))]
    for b, t in zip(SIZES, medians, strict=True):  # the line under every size's median
        assert cost.fit.time(b) <= t * (1 + 1e-12)
    assert cost.fit.time(SIZES[-1]) == pytest.approx(medians[-1])  # and touching it


# digits-cnn on the 1 Gbit/s testbed: its 6,090 gradients fit in 24 KB, and 4 KiB and 24 KB
# took the same ~3.5 ms by their medians (the larger one a little faster).
CNN_SIZES = [4.0 * n for n in calibration.calibration_sizes(6_090)]
FLAT = [(CNN_SIZES[0], 3.52e-3), (CNN_SIZES[1], 3.47e-3)]


def test_time_flat_over_the_sizes_is_a_per_message_cost_not_a_failure():
    cost = judge_calibration([FLAT])
    assert cost.source == "fitted" and "per-message cost dominates" in cost.reason
    assert "per-message cost dominates" in cost.describe()
    # β: the steepest slope the sizes cannot tell from flat (10% of the largest size's time
    # over 20 KB); α: the line through the middle of the transfers
    beta = calibration.RESOLUTION * 3.47e-3 / (CNN_SIZES[1] - CNN_SIZES[0])
    assert cost.fit.beta == pytest.approx(beta)
    assert cost.fit.alpha == pytest.approx(np.median([t - beta * b for b, t in FLAT]))
    assert cost.fit.alpha > 5 * beta * CNN_SIZES[1]  # α dominates the largest message
    barely = [(b, 1e-3 + b * 1e-15) for b in SIZES]  # 1 PB/s: a slope no timing resolves
    assert "per-message cost dominates" in judge_calibration([barely]).reason


def test_a_resolved_slope_is_taken_whatever_its_size():
    grows = [(CNN_SIZES[0], 3.5e-3), (CNN_SIZES[1], 3.9e-3)]  # 10.3% of 3.9 ms: resolved
    cost = judge_calibration([grows])
    assert cost.reason == ""
    assert cost.fit.beta == pytest.approx(0.4e-3 / (CNN_SIZES[1] - CNN_SIZES[0]))


# One round of digits-cnn's calibration on the 1 Gbit/s testbed, 0 ms (2026-12-05, worker 0,
# under the step's load; ms): the medians of five, 4.11 and 6.96 ms, gave β 7 MB/s, and the
# plan split the model into two groups that ran 0.73 of fusion's one.
TESTBED_ROUND = [(CNN_SIZES[0], t * 1e-3) for t in (11.94, 0.73, 2.47, 14.01, 4.11)] + [
    (CNN_SIZES[1], t * 1e-3) for t in (19.18, 8.86, 0.79, 6.96, 5.49)
]


def test_a_slope_the_transfers_noise_cannot_pin_down_is_not_taken():
    cost = judge_calibration([TESTBED_ROUND])
    assert cost.source == "fitted" and "within 10% and its noise" in cost.reason
    assert "medians of 10 transfers: 4,096 B 4.11 ms, 24,360 B 6.96 ms" in cost.reason
    bound = calibration.RESOLUTION * 6.96e-3 / (CNN_SIZES[1] - CNN_SIZES[0])
    assert cost.fit.beta == pytest.approx(bound)  # 29 MB/s, where the medians said 7
    # α: the middle of the ten transfers, not the lower median (4.11 ms) or the lowest (0.73)
    middle = np.median([t - bound * b for b, t in TESTBED_ROUND])
    assert cost.fit.alpha == pytest.approx(middle) and 5e-3 < middle < 6e-3
    profile = uniform_profile([1_290, 4_640, 160], [0.4e-3, 0.8e-3, 0.3e-3])  # backward order
    cluster = cluster_from_fit(cost.fit, 4, 2, remote=3)
    assert len(make_planner("imerge")(profile, cluster).groups) == 1


def _round_under_load(rng, sizes, beta):
    """A round of ``CALIBRATION_REPEATS`` transfers per size: 1 ms plus the bytes at ``beta``,
    plus exponential load with a 3 ms mean (the testbed round above: 0.7–19 ms)."""
    turns = [b for _ in range(calibration.CALIBRATION_REPEATS) for b in sizes]
    return [(b, 1e-3 + beta * b + rng.exponential(3e-3)) for b in turns]


def _calibrated_under_load(rng, sizes, beta) -> CostModel:
    """What start-up settles on: rounds measured until judge_calibration decides."""
    rounds = []
    while (
        cost := judge_calibration(rounds := [*rounds, _round_under_load(rng, sizes, beta)])
    ) is None:
        pass
    return cost


def test_under_load_a_small_models_sizes_are_rarely_told_apart():
    """digits-cnn's sizes at 1 Gbit/s into one shard port of 4 workers (4 × 20 KB more take
    0.65 ms): under the testbed's load the fit takes the bound, and seldom a slope."""
    rng = np.random.default_rng(5)
    costs = [_calibrated_under_load(rng, CNN_SIZES, 4 / LINK) for _ in range(200)]
    sloped = [c for c in costs if "per-message cost dominates" not in c.reason]
    assert len(sloped) <= 10  # at most 5%: what a 95% interval lets through
    typical = 1e-3 + 3e-3 * np.log(2)  # a transfer's median time
    assert np.median([c.fit.alpha for c in costs]) == pytest.approx(typical, rel=0.1)
    profile = uniform_profile([1_290, 4_640, 160], [0.4e-3, 0.8e-3, 0.3e-3])  # backward order
    clusters = [cluster_from_fit(c.fit, 4, 2, remote=3, shared_cores=2) for c in costs]
    groups = [len(make_planner("imerge")(profile, cluster).groups) for cluster in clusters]
    assert groups.count(1) >= 190  # fusion's one message, as measured fastest on the testbed
    by_medians = 0
    for _ in range(200):  # the rule before: a slope wherever the medians differ by 10%
        first = _round_under_load(rng, CNN_SIZES, 4 / LINK)
        small, large = (np.median([t for b, t in first if b == s]) for s in CNN_SIZES)
        by_medians += large - small > calibration.RESOLUTION * large
    assert by_medians > 90  # nearly half of the rounds (110 of 200) took noise for a slope


def test_under_load_a_large_models_slope_is_still_fitted():
    """digits-wide's sizes (4 KiB to 1 MiB) at the same link and load: 4 MiB more take 34 ms,
    far beyond the noise, and the slope comes out near the truth."""
    rng = np.random.default_rng(6)
    truth = 4 / LINK
    costs = [_calibrated_under_load(rng, SIZES, truth) for _ in range(50)]
    assert all(c.source == "fitted" and c.reason == "" for c in costs)
    betas = [c.fit.beta for c in costs]
    assert np.median(betas) == pytest.approx(truth, rel=0.05)
    assert all(abs(b / truth - 1) < 0.25 for b in betas)


@pytest.mark.parametrize("scheduler", ["merge", "imerge"])
def test_a_small_model_on_a_fast_link_plans_one_group(scheduler):
    """With the flat timings of digits-cnn at 1 Gbit/s (4 workers, 2 shards, shard 0 beside
    worker 0) merge and imerge send its three layers as one message; on the stated default
    (what these timings gave before) they kept WFBP's three groups."""
    profile = uniform_profile([1_290, 4_640, 160], [0.4e-3, 0.8e-3, 0.3e-3])  # backward order
    planner = make_planner(scheduler)
    cluster = cluster_from_fit(judge_calibration([FLAT]).fit, 4, 2, remote=3)
    assert len(planner(profile, cluster).groups) == 1
    assert len(planner(profile, cluster_from_fit(DEFAULT_COST, 4, 2, remote=3)).groups) == 3


def test_the_first_usable_round_decides_whatever_follows():
    later = [_round(), STALLED, STALLED]
    assert judge_calibration(later) == judge_calibration(later[:1])


@pytest.mark.parametrize("seed", range(100))
def test_any_noise_gives_a_usable_cost_model_within_the_attempts(seed):
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-5, -1)  # 10 µs to 100 ms of load per transfer
    rounds = [_round(tuple(rng.exponential(scale, 3))) for _ in range(CALIBRATION_ATTEMPTS)]
    decided = [judge_calibration(rounds[:k]) for k in range(1, CALIBRATION_ATTEMPTS + 1)]
    cost = next(d for d in decided if d is not None)  # the last round always decides
    # every round times every size: a fit is always possible, so never the stated default
    assert cost.source in ("fitted", "refitted")
    assert cost.fit.alpha >= 0 and cost.fit.beta > 0
    if scale <= TRUTH.alpha / 10:  # load well below the per-message cost: the truth at once
        assert decided[0] is cost and cost.source == "fitted"
        assert cost.fit.beta == pytest.approx(TRUTH.beta, rel=0.05)
        assert cost.fit.alpha == pytest.approx(TRUTH.alpha, rel=0.3)


@pytest.mark.parametrize("scheduler", sorted(COST_FREE))
def test_cost_free_plans_are_the_same_on_any_cluster_speed(scheduler):
    """What lets start-up skip the calibration for these policies."""
    profile = uniform_profile([4000, 300, 90_000, 50], [1e-3, 4e-3, 2e-3, 1e-4])
    fast, slow = ClusterSpec(workers=4, shards=2), cluster_from_fit(AlphaBeta(0.1, 1e-5), 4, 2)
    planner = make_planner(scheduler)
    assert planner(profile, fast) == planner(profile, slow)
    assert planner(profile, fast).order == "fifo"  # no transfer times needed to order the groups
    assert set(COST_FREE) <= set(PLANNER_NAMES)


LINK = 125e6  # bytes/s each way: a 1 Gbit/s link
CHUNK = 64 * 1024  # bytes per chunk, as large as the protocol's (docs/protocol.md)


def _round_trip(nbytes: float, senders: int, rate: float, fixed: float = 1e-3) -> float:
    """One calibration transfer played chunk by chunk as the protocol runs it: ``senders``
    copies of every chunk queue into the bottleneck port, which answers a chunk (``senders``
    copies out) as soon as all of its copies are in; in and out are the two directions of a
    full-duplex port, each first come, first served."""
    pushed = answered = 0.0
    left = nbytes
    while left > 0:
        chunk = min(CHUNK, left)
        left -= chunk
        pushed += senders * chunk / rate
        answered = max(pushed, answered) + senders * chunk / rate
    return fixed + answered


def _fitted(senders: int, rate: float) -> AlphaBeta:
    cost = judge_calibration([[(b, _round_trip(b, senders, rate)) for b in SIZES]])
    return cost.fit


def test_one_machine_calibration_gives_the_shard_port_rate_not_twice_it():
    # 4 workers on the shard's host: its port carries 4 copies each way, pushes and answers
    # overlapping (read as two stages in series, the port came out twice as fast)
    cluster = cluster_from_fit(_fitted(4, LINK), 4, 2)
    assert cluster.machines == 1
    assert cluster.shard_bw == pytest.approx(LINK, rel=0.05)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_testbed_calibration_gives_the_link_rate(workers):
    # one host per worker, shard 0 beside worker 0: the other workers' copies cross its link
    cluster = cluster_from_fit(_fitted(workers - 1, LINK), workers, 2, remote=workers - 1)
    assert cluster.machines == workers and cluster.nic_bw == pytest.approx(LINK, rel=0.05)
    assert cluster.shard_machine(0) == cluster.worker_machine(0)  # one local worker, as measured
    assert min(cluster.shard_bw, cluster.worker_bw) >= cluster.nic_bw  # the link is the bottleneck


def test_calibration_sizes_stop_at_the_largest_message_a_plan_can_send():
    assert calibration.calibration_sizes(10_000_000) == calibration.CALIBRATION_SIZES
    assert calibration.calibration_sizes(6_090) == (1 << 10, 6_090)  # digits-cnn: all of it
    assert calibration.calibration_sizes(500) == (62, 500)
    with pytest.raises(ValueError, match="at least 2 gradient elements"):
        calibration.calibration_sizes(1)


def test_a_fixed_cost_on_the_command_line_is_two_numbers_that_make_a_cost():
    from gradsum.config import fixed_cost

    assert fixed_cost("1e-3, 3.3e-8") == (1e-3, 3.3e-8)
    for bad in ("1e-3", "1e-3,3e-8,1", "a,b", "-1e-3,3e-8", "1e-3,nan", "1e-3,inf"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"'{bad}'"):
            fixed_cost(bad)


def test_a_given_cost_replaces_the_calibration_and_must_be_a_cost():
    assert cost_without_measuring("imerge", TRUTH) == CostModel(TRUTH, "given")
    assert cost_without_measuring("imerge", None) is None  # measure
    for scheduler in COST_FREE:  # a given cost still stands for a cost-free policy
        assert cost_without_measuring(scheduler, TRUTH) == CostModel(TRUTH, "given")
    with pytest.raises(ValueError, match="a given cost needs α >= 0 s and β > 0 s/byte"):
        cost_without_measuring("imerge", AlphaBeta(1e-3, 0.0))


def test_a_cluster_cannot_have_more_remote_workers_than_workers():
    with pytest.raises(ValueError, match="5 of 4 workers"):
        cluster_from_fit(TRUTH, 4, 2, remote=5)

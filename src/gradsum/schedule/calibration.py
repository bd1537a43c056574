"""The pure half of start-up's planning: fit the timed transfers, judge the rounds, and plan.

``sync/startup.py`` measures (timed transfers through the run's Session, host probes, the
step's load) and makes the workers agree; everything that decides from those measurements lives
here, so every outcome is testable without sockets or processes:

* :func:`fit_measurements`: α, β from rounds of (bytes, seconds) transfers, or why none;
* :func:`judge_calibration`: the :class:`CostModel` a start-up settles on after k rounds (fitted,
  refitted, or ``DEFAULT_COST``), or that it must measure once more;
* :func:`cluster_from_fit`: the :class:`ClusterSpec` a single-shard round trip implies;
* :func:`plan_on`: worker 0's plan, send order and cluster from a profile and a cost model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .cluster import ClusterSpec, crowding
from .costs import AlphaBeta, least_squares, ps_step_seconds
from .ordering import send_order
from .plan import Plan
from .profile import ModelProfile

CALIBRATION_SIZES = (1 << 10, 1 << 15, 1 << 18)  # fp32 elements: 4 KiB, 128 KiB, 1 MiB
CALIBRATION_ATTEMPTS = 3  # rounds of timed transfers before DEFAULT_COST stands
CALIBRATION_REPEATS = 5  # timed transfers of each size per round

# Policies whose plan and send order need no per-message cost: they count elements and shards
# (and keep list order), so start-up neither measures for them nor can fail measuring.
COST_FREE = frozenset({"default", "wfbp", "fusion"})

# The cost a plan is made with when calibration finds none: 1 ms per message, 30 MB/s, the
# order of what start-up fitted through 4 PS shards on the 1 Gbit/s testbed
# (docs/scheduling.md, AlexNet runs: α 0.9–2.2 ms, β 29–33 MB/s). Stated, not measured here.
DEFAULT_COST = AlphaBeta(alpha=1e-3, beta=1 / 30e6)

# Timings of two sizes closer than this fraction of the slower one are not told apart: on the
# shared testbed host a size's median moves by more than a few percent between rounds.
RESOLUTION = 0.1
# How sure the fit must be that time grows with size (or falls) beyond RESOLUTION before it
# takes the slope: the confidence of Theil–Sen's interval. Under the step's load on the testbed
# one transfer of 24 KB took anywhere from 0.8 to 19 ms, so a slope between the medians of five
# is mostly noise (docs/scheduling.md, "A slope told from noise").
CONFIDENCE = 0.95

FIT_RESOLUTION = RESOLUTION

Samples = Sequence[tuple[float, float]]  # (bytes, seconds) of every timed transfer of a round


@dataclass(frozen=True)
class CostModel:
    """The per-message cost a plan was made with, and where it came from.

    ``source``: ``"not needed"`` (a ``COST_FREE`` policy; ``fit`` is None), ``"given"`` by the
    caller, ``"fitted"`` on the first round of transfers, ``"refitted"`` after measuring again,
    or ``"default"`` (``DEFAULT_COST``: no round gave a usable fit). ``reason`` says why no
    measurement was needed, why one was repeated or abandoned, or that time did not grow with
    size, so the per-message cost dominated and β is a bound (:func:`fit_measurements`).
    """

    fit: AlphaBeta | None
    source: str
    reason: str = ""
    loaded: bool = False  # the transfers were timed under the step's load (``step_load``)

    def describe(self) -> str:
        if self.fit is None:
            return f"no α–β calibration ({self.reason})"
        measured = self.loaded and self.source in ("fitted", "refitted")
        how = f"{self.source} under the step's load" if measured else self.source
        why = f": {self.reason}" if self.reason else ""
        return (
            f"α {self.fit.alpha * 1e6:.0f} µs, β {1e-6 / self.fit.beta:.0f} MB/s per message "
            f"({how}{why})"
        )


@dataclass(frozen=True)
class RuntimePlan:
    plan: Plan
    order: tuple[int, ...]
    profile: ModelProfile
    cost: CostModel
    cluster: ClusterSpec
    seconds: float  # how long agreeing took

    def describe(self) -> str:
        return (
            f"plan {self.plan.summary()}; {self.cost.describe()}; "
            f"backward {self.profile.backward_s.sum() * 1e3:.1f} ms (measured{self._crowding()})"
        )

    def _crowding(self) -> str:
        cores, n = self.cluster.shared_cores, self.cluster.workers
        if cores is None:
            return ""
        scaled = f", × {n / cores:.3g}" if n > cores else ""
        return f"{scaled}; {n} workers and {self.cluster.shards} shards on {cores} shared cores"

    def predicted_step_s(self) -> float | None:
        """The PS model's time per step of this plan on the measured cluster: its forward, then
        the backward with every part played out (``costs.ps_step_seconds``). None where there is no
        measured cost (cost-free policies plan without one) or the model does not play the plan
        (all-reduce, priority order)."""
        if self.cost.fit is None:
            return None
        try:
            return ps_step_seconds(self.plan, self.cluster, self.profile)
        except ValueError:
            return None


@dataclass(frozen=True)
class _Timings:
    """Transfers of at least two sizes, summed up: each size's median time, the slope the
    sizes cannot resolve, and the Theil–Sen slope's interval (``CONFIDENCE``) that says
    whether time grows (or falls) with size beyond it."""

    nbytes: np.ndarray  # of every transfer
    seconds: np.ndarray
    sizes: np.ndarray
    medians: np.ndarray
    bound: float  # RESOLUTION of the largest size's time, over the span of sizes
    fit: object  # scipy's TheilslopesResult

    @classmethod
    def of(cls, samples: Samples) -> _Timings:
        nbytes, seconds = np.array(samples, dtype=float).reshape(-1, 2).T
        sizes = np.unique(nbytes)
        medians = np.array([np.median(seconds[nbytes == size]) for size in sizes])
        bound = RESOLUTION * medians[-1] / (sizes[-1] - sizes[0])
        # scipy.stats costs a second to import: every worker imports this module, few fit
        from scipy.stats import theilslopes

        fit = theilslopes(seconds, nbytes, alpha=CONFIDENCE, method="joint")
        return cls(nbytes, seconds, sizes, medians, float(bound), fit)

    @property
    def grows(self) -> bool:
        return self.fit.low_slope > self.bound

    @property
    def falls(self) -> bool:
        return self.fit.high_slope < -self.bound

    def line(self) -> AlphaBeta:
        """Least squares through each size's median: the whole span of sizes sets the slope
        (Theil–Sen's median pair slope would be the middle one of three sizes), and no less
        than the bound the interval cleared."""
        alpha, beta = least_squares(zip(self.sizes, self.medians, strict=True))
        return AlphaBeta(max(float(alpha), 0.0), max(float(beta), self.bound))

    def describe(self) -> str:
        pairs = zip(self.sizes, self.medians, strict=True)
        medians = ", ".join(f"{b:,.0f} B {t * 1e3:.2f} ms" for b, t in pairs)
        return f"medians of {len(self.nbytes)} transfers: {medians}"


def _sizes(samples: Samples) -> int:
    return len({b for b, _ in samples})


def fit_measurements(
    measurements: Sequence[Samples], *, settled: bool = False
) -> tuple[AlphaBeta, str]:
    """α, β from repeated rounds of (bytes, seconds) transfers, and a note on how; ValueError
    when the rounds are unusable.

    The transfers of every usable round count. Whether time grows with size is judged on the
    Theil–Sen slope, the median of the slopes between pairs of transfers of different sizes:
    a transfer held up by load (a descheduled peer, a retransmission) moves it little, and its
    interval (``CONFIDENCE``) says how well the transfers pin it down.

    Where time grows with size beyond doubt and beyond ``RESOLUTION`` (the interval's low end
    exceeds RESOLUTION·t / (largest − smallest size), t the largest size's median time), α and
    β are the least-squares line through each size's median time. Otherwise the data cannot
    tell the sizes apart, which is a measurement, not a failure: at these sizes the
    per-message cost dominates (a small model on a fast link: 4 KiB and 24 KB take the same
    few ms at 1 Gbit/s, give or take the load's jitter). Then β is that bound, the steepest
    slope the resolution cannot see: no plan of this model sends a message larger than the
    largest size (``calibration_sizes``), so a faster true β only makes its messages cheaper
    than planned. The transfers are then one population, whatever their size, and α puts the
    line through its middle (the median of time − β·bytes): the medians of two sizes a few
    transfers each may lie 9× apart (0.7 and 6.6 ms), and the lower one is luck, not the
    per-message cost. The note says so (the plan line shows it).

    A round whose time *falls* with size beyond doubt and beyond ``RESOLUTION`` had its smaller
    transfers held up: it is left out, and with no other round the fit is unusable until
    ``settled`` (the last round). Then the fall is systematic, and the same bound is taken over
    every round, with α the highest intercept that keeps the line under every size's median:
    the least held-up size's.

    A round with a size or time that is not a positive finite number is left out (and named
    when no other round is left); fewer than two sizes cannot separate α from β.
    """
    valid: list[Samples] = []
    invalid = ""
    for samples in measurements:
        bad = [(b, t) for b, t in samples if not (0 < b < math.inf and 0 < t < math.inf)]
        if bad:
            invalid = f"; a round with {bad[0][0]} bytes in {bad[0][1]} s was left out"
        else:
            valid.append(samples)
    pooled = [sample for samples in valid for sample in samples]
    if _sizes(pooled) < 2:
        raise ValueError(
            f"need at least two transfer sizes to separate α from β, got {_sizes(pooled)}{invalid}"
        )
    steady = [s for s in valid if _sizes(s) < 2 or not _Timings.of(s).falls]
    kept = [sample for samples in steady for sample in samples]
    every_round_fell = _sizes(kept) < 2
    timings = _Timings.of(pooled if every_round_fell else kept)
    if timings.grows:
        return timings.line(), invalid.removeprefix("; ")
    flat = not (every_round_fell or timings.falls)
    if flat:
        how = f"time flat within {RESOLUTION:.0%} and its noise over the sizes"
    elif settled:
        how = f"time fell with size by more than {RESOLUTION:.0%} over every round"
    else:
        raise ValueError(
            f"transfer time falls with size by more than {RESOLUTION:.0%} ({timings.describe()})"
        )
    if flat:  # one population: α through the middle of its transfers
        alpha = float(np.median(timings.seconds - timings.bound * timings.nbytes))
    else:  # the small transfers held up: the line under every size's median
        alpha = float(np.min(timings.medians - timings.bound * timings.sizes))
    note = (
        f"{how} ({timings.describe()}): per-message cost dominates, β is the slowest the sizes "
        f"can resolve{invalid}"
    )
    return AlphaBeta(max(alpha, 0.0), timings.bound), note


def judge_calibration(
    measurements: Sequence[Samples], attempts: int = CALIBRATION_ATTEMPTS
) -> CostModel | None:
    """The cost model start-up settles on after these rounds of timed transfers, or None:
    measure once more.

    Pure, so every outcome is testable without sockets; worker 0 calls it after each round and
    broadcasts the answer. Round k is judged on all rounds so far (:func:`fit_measurements`,
    ``settled`` at round ``attempts``); the first usable fit stands. Once ``attempts`` rounds
    gave none (no round with two sizes timed), ``DEFAULT_COST`` does.
    """
    if not measurements:
        raise ValueError("judging a calibration needs at least one round of measurements")
    failure: ValueError | None = None
    for rounds in range(1, min(len(measurements), attempts) + 1):
        try:
            fit, note = fit_measurements(measurements[:rounds], settled=rounds == attempts)
        except ValueError as error:
            failure = error
            continue
        if failure is None:
            return CostModel(fit, "fitted", note)
        reason = f"{rounds} rounds of transfers, {rounds - 1} gave no usable fit: {failure}"
        return CostModel(fit, "refitted", f"{reason}; {note}" if note else reason)
    if len(measurements) < attempts:
        return None
    reason = f"{attempts} rounds of transfers gave no usable fit: {failure}"
    return CostModel(DEFAULT_COST, "default", reason)


def cluster_from_fit(
    fit: AlphaBeta, workers: int, shards: int, remote: int = 0, shared_cores: int | None = None
) -> ClusterSpec:
    """The cluster a measured single-shard round trip implies.

    Calibration sends one message of M bytes from every worker to shard 0 and back; ``remote``
    of the n workers reach that shard over a link (the others share its host). The shard
    answers each chunk as soon as every worker's copy of it is in (docs/protocol.md), so the
    pushes into the shard and the answers out of it overlap on full-duplex ports: the round
    trip moves its bytes through the busiest port once each way *at the same time*, not as a
    push stage and then a pull stage. The busiest port: with every worker on the shard's host
    (``remote`` 0) the shard's own, n·M each way, so B_shard = n/β; otherwise the shard host's
    link, ``remote``·M each way, so the link (NIC) runs at remote/β, with one host per worker
    and the shards beside the first workers (the testbed's layout), and each node's port taken
    at the least the round trip shows it to be, n/β (the shard's port moved n·M in that time).
    The fixed costs do run in series: the worker's thread sends and receives (2 α_worker), the
    shard's core takes the n pushes and sends the n answers (2n α_shard); a worker and a shard
    are taken to spend the same time per message, α_worker = α_shard = α/(2(n+1)).

    With every node on one host of ``shared_cores`` cores, the n workers' sends share those
    cores: each of a worker's two messages takes max(1, n/cores) times its own CPU time, so
    α = a·(2·max(1, n/cores) + 2n) for the per-message time a (``costs.ps_group_ends`` plays
    the same pool).
    """
    n = workers
    if not 0 <= remote <= n:
        raise ValueError(f"{remote} of {n} workers cannot be remote from the calibrated shard")
    per_message = fit.alpha / (2 * crowding(n, shared_cores) + 2 * n)
    port = n / fit.beta
    return ClusterSpec(
        workers=n,
        shards=shards,
        machines=1 if remote == 0 else n,
        worker_bw=port,
        shard_bw=port,
        nic_bw=port * max(n, shards) if remote == 0 else remote / fit.beta,
        alpha_worker=per_message,
        alpha_shard=per_message,
        shared_cores=shared_cores,
        resolution=FIT_RESOLUTION,
    )


def calibration_sizes(elements: int, sizes: Sequence[int] = CALIBRATION_SIZES) -> tuple[int, ...]:
    """The transfer sizes to fit α, β on, no larger than the largest message a plan of this
    model can send (all its gradients in one group): a fit over sizes the plan never sends
    extrapolates, and on a slow link a 1 MiB incast behaves unlike the model's messages (at
    100 Mbit/s, 2 workers: 2 MB/s per message fitted where the link carries 12.5 MB/s)."""
    if elements < 2:
        raise ValueError(f"calibrating needs at least 2 gradient elements, got {elements}")
    capped = sorted({min(size, elements) for size in sizes})
    if len(capped) < 2:  # a model smaller than the smallest size: its whole and a piece of it
        capped = [max(1, elements // 8), elements]
    return tuple(capped)


def cost_without_measuring(scheduler: str, fit: AlphaBeta | None) -> CostModel | None:
    """The cost model a plan needs no transfers for: the caller's ``fit`` (checked), or none at
    all for a ``COST_FREE`` policy; None where start-up must calibrate."""
    if fit is not None:
        if not (fit.alpha >= 0 and fit.beta > 0):
            raise ValueError(
                f"a given cost needs α >= 0 s and β > 0 s/byte, got α {fit.alpha}, β {fit.beta}"
            )
        return CostModel(fit, "given")
    if scheduler in COST_FREE:
        return CostModel(None, "not needed", f"{scheduler} plans from element counts alone")
    return None


def plan_on(
    planner: Callable[[ModelProfile, ClusterSpec], Plan],
    scheduler: str,
    profile: ModelProfile,
    cost: CostModel,
    workers: int,
    shards: int,
    *,
    remote: int = 0,
    cores: int | None = None,
    message_delay: float = 0.0,
) -> tuple[Plan, tuple[int, ...], ClusterSpec]:
    """The plan, send order and cluster worker 0 decides on: the cluster the cost implies
    (:func:`cluster_from_fit`; a cost-free planner reads only its worker and shard counts), with
    ``message_delay`` added to α_worker (calibration times the aggregator, not the senders that
    inject it), the planner's plan on it, and its send order."""
    cluster = (
        ClusterSpec(workers=workers, shards=shards)
        if cost.fit is None
        else cluster_from_fit(cost.fit, workers, shards, remote, cores)
    )
    cluster = cluster.with_message_delay(message_delay)
    plan = planner(profile, cluster)
    order = send_order(plan, profile, _transfer_seconds(cost, cluster, scheduler))
    return plan, order, cluster


def _transfer_seconds(cost: CostModel, cluster: ClusterSpec, scheduler: str):
    """How long a group of n elements keeps the sender busy (only priority orders ask)."""
    fit = cost.fit
    if fit is not None:
        return lambda n: fit.time(n * cluster.bytes_per_element)

    def unknown(_: int) -> float:
        raise RuntimeError(
            f"policy {scheduler!r} orders groups by transfer time, but is listed in COST_FREE "
            "(schedule/calibration.py), so start-up measured none"
        )

    return unknown

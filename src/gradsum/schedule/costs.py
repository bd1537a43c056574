"""Communication cost models that planners reason with.

* :class:`AlphaBeta` — one message of M bytes costs α + β·M; :func:`fit_alpha_beta` fits it by
  least squares to measured (bytes, seconds) samples.
* :class:`AllReduceCost` — ring all-reduce on n workers: 2(n−1) steps of α + β·M/n, so
  T(M) = 2(n−1)·α + 2(n−1)/n·β·M. Its *start-up* term grows with n; that is what makes MG-WFBP's
  rule merge everything into one group on a large cluster.
* :class:`PSCost` — push/pull to sharded parameter servers: n workers share a shard's ingress
  (incast), every message costs the shard's one core α_shard (so n of them queue per part), a
  group may span several shards, and concurrently active senders share each NIC. Push and pull are
  two pipeline stages running in opposite directions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .cluster import ClusterSpec


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # s per message
    beta: float  # s per byte

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


def fit_alpha_beta(samples: Iterable[tuple[float, float]]) -> AlphaBeta:
    """Least-squares α, β from (bytes, seconds) samples; α is clipped at 0 (noise at tiny sizes)."""
    data = np.asarray(list(samples), dtype=float)
    if data.ndim != 2 or data.shape[0] < 2 or data.shape[1] != 2:
        raise ValueError("need at least two (bytes, seconds) samples")
    if np.unique(data[:, 0]).size < 2:
        raise ValueError("need samples of at least two different sizes to separate α from β")
    design = np.column_stack([np.ones(len(data)), data[:, 0]])
    (alpha, beta), *_ = np.linalg.lstsq(design, data[:, 1], rcond=None)
    if beta <= 0:
        raise ValueError("fitted β is not positive: transfer time does not grow with size")
    return AlphaBeta(max(float(alpha), 0.0), float(beta))


@dataclass(frozen=True)
class AllReduceCost:
    """Ring all-reduce among ``workers`` built from a point-to-point α–β."""

    link: AlphaBeta
    workers: int

    @classmethod
    def from_cluster(cls, cluster: ClusterSpec) -> AllReduceCost:
        """The α–β one would fit from single uncontended messages on this cluster."""
        alpha = cluster.alpha_worker + cluster.alpha_shard
        bandwidth = min(cluster.worker_bw, cluster.shard_bw, cluster.nic_bw)
        return cls(AlphaBeta(alpha, 1.0 / bandwidth), cluster.workers)

    @classmethod
    def fitted_through_ps(cls, cluster: ClusterSpec) -> AllReduceCost:
        """The α–β MG-WFBP's regression gets from round trips through the PS, all workers at once.

        Each of the two stages pays α_worker + n·α_shard and moves M at B_shard/n (incast), so the
        fit is α = 2(α_worker + n·α_shard), β = 2n/B_shard. The ring formula then multiplies this
        already n-way start-up by 2(n−1) again — the miscounted concurrency the seed blames.
        """
        n = cluster.workers
        alpha = 2 * (cluster.alpha_worker + n * cluster.alpha_shard)
        return cls(AlphaBeta(alpha, 2 * n / cluster.shard_bw), n)

    @property
    def alpha(self) -> float:
        """Start-up cost of one all-reduce, the saving a merge buys."""
        return 2 * (self.workers - 1) * self.link.alpha

    def time(self, nbytes: float) -> float:
        n = self.workers
        if n == 1:
            return 0.0
        return 2 * (n - 1) * (self.link.alpha + self.link.beta * nbytes / n)


@dataclass(frozen=True)
class PSCost:
    """Push or pull time of a group to sharded parameter servers (both directions are symmetric).

    A group of M bytes is split into ``span`` equal parts on distinct shards, which each worker
    sends one after another. Without interleaving all workers send the same part at the same time,
    so each part is an n-way incast at one shard; with interleaving worker w starts at part w, so
    only ⌈n/span⌉ workers meet at a shard. Per part a worker pays α_worker and waits for the
    shard's core to handle every message queued there (c·α_shard). The byte rate of a worker is the
    smallest of its own port, its share of the shard port, and its share of the NIC.
    """

    cluster: ClusterSpec

    def concurrent_senders(self, span: int, interleaved: bool) -> int:
        n = self.cluster.workers
        return math.ceil(n / span) if interleaved else n

    def nic_rate(self) -> float:
        """A worker's share of its machine's NIC, each way (only remote shards' traffic crosses)."""
        c = self.cluster
        crossing = c.workers_per_machine * c.remote_fraction
        return c.nic_bw / crossing if crossing > 0 else math.inf

    def worker_rate(self, span: int, interleaved: bool) -> float:
        c = self.cluster
        senders = self.concurrent_senders(span, interleaved)
        return min(c.worker_bw, c.shard_bw / senders, self.nic_rate())

    def part_overhead(self, span: int, interleaved: bool) -> float:
        c = self.cluster
        return c.alpha_worker + self.concurrent_senders(span, interleaved) * c.alpha_shard

    def time(self, nbytes: float, span: int = 1, interleaved: bool = False) -> float:
        """One stage (push, or pull) of a group of ``nbytes`` bytes."""
        span = max(1, min(span, self.cluster.shards))
        overhead = span * self.part_overhead(span, interleaved)
        return overhead + nbytes / self.worker_rate(span, interleaved)

    def partitioned_time(self, nbytes: float, partition_bytes: float) -> float:
        """One stage of a group cut into pieces of ≤ ``partition_bytes`` pushed all at once.

        Every worker sends the same pieces (n-way incast per shard), but the pieces' shards work
        in parallel: the worker thread pays α_worker per piece, each core n·α_shard.
        """
        c = self.cluster
        pieces = max(1, min(c.shards, math.ceil(nbytes / partition_bytes)))
        rate = min(c.worker_bw, pieces * c.shard_bw / c.workers, self.nic_rate())
        return pieces * c.alpha_worker + c.workers * c.alpha_shard + nbytes / rate

    def stream_time(self, nbytes: float, partition_bytes: float) -> float:
        """What one stage of a partitioned group adds to the work shared by all groups in flight.

        With a window several groups are in flight and least-loaded placement puts them on
        different shards, so together they move at most min(B_worker, m·B_shard/n, NIC share)
        per worker, whatever each group's own pieces could do alone. The start-up that every
        group pays on shared resources stays: α_worker per piece on the worker's one thread,
        and n·α_shard per piece on the cores, m of which work in parallel.
        """
        c = self.cluster
        pieces = max(1, min(c.shards, math.ceil(nbytes / partition_bytes)))
        start_up = pieces * (c.alpha_worker + c.workers * c.alpha_shard / c.shards)
        rate = min(c.worker_bw, c.shards * c.shard_bw / c.workers, self.nic_rate())
        return start_up + nbytes / rate

    def interleaved_stream_time(self, nbytes: float, span: int) -> float:
        """What one stage of an interleaved group adds to the work all groups in flight share.

        Consecutive groups sit on different shards, so one group's incast and core queueing
        (its :meth:`time`) overlap the next group's; what they share is the worker's one thread
        (α_worker per part), its port, its NIC share and all shards together (m·B_shard/n).
        """
        c = self.cluster
        span = max(1, min(span, c.shards))
        rate = min(c.worker_bw, c.shards * c.shard_bw / c.workers, self.nic_rate())
        return span * c.alpha_worker + nbytes / rate

    def span_candidates(self) -> list[int]:
        """Spans a planner considers: powers of two, the worker count and every shard."""
        candidates = sorted(
            {1, self.cluster.shards, self.cluster.workers}
            | {2**k for k in range(int(math.log2(self.cluster.shards)) + 1)}
        )
        return [s for s in candidates if 1 <= s <= self.cluster.shards]

    def best_span(self, nbytes: float, interleaved: bool) -> int:
        """The span that minimises :meth:`time` alone (1 when not interleaved: parts only add
        α). A group's own optimum; ``plan_imerge`` chooses against the step's end instead."""
        if not interleaved:
            return 1
        return min(self.span_candidates(), key=lambda s: (self.time(nbytes, s, True), s))

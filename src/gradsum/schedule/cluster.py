"""The cluster a plan runs on: who sits on which machine, link speeds, per-message costs.

Shared by the PS cost model (a closed-form estimate used by planners) and the simulator (which
plays the same numbers out event by event), so the two cannot drift apart.

Nodes: ``workers`` workers and ``shards`` PS shards, spread in contiguous blocks over ``machines``
machines (never more machines than nodes). Every node has a full-duplex port (a worker's is its
GPU↔host path, a shard's is what one CPU core can receive and sum per second); every machine has a
full-duplex NIC that only traffic between machines crosses.

A cluster whose nodes all run on one host's few cores (``shared_cores``: the testbed, or a
one-machine run with more processes than cores) has one more resource: every node's
per-message CPU queues on those cores, so parts spread over shards no longer run their fixed
costs in parallel. Only the closed-form play (``costs.ps_group_ends``) prices it; the
simulator's presets are clusters of real machines and leave it unset.

A shard is a port (``shard_bw``, shared max-min by its flows) beside a core (``alpha_shard`` per
message, FIFO): the two work in parallel, so a shard's bytes of one message move while its core
handles another's fixed cost. A PS that is one CPU core (``shard_one_core``) has one server for
both: each message takes α_shard + bytes/shard_bw of it, and bytes no longer cross a shard port.
Where either kind of work is absent the two agree; where both are there the one core is slower.

A cluster fitted from measurements (``calibration.cluster_from_fit``) also carries the
``resolution`` of its play: the relative difference in a step's end below which two plans
count as equal. A planner that picks among plays within it keeps the plan with fewer messages
(``planners.plan_imerge``), since an extra message costs for sure what a gain smaller than the
model's error only might pay. The presets are exact, and their resolution is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


def crowding(workers: int, shared_cores: int | None) -> float:
    """How many times its own CPU time a worker's message takes when all ``workers`` send at
    once on ``shared_cores`` cores (1 where every node has its own)."""
    return 1.0 if shared_cores is None else max(1.0, workers / shared_cores)


@dataclass(frozen=True)
class ClusterSpec:
    workers: int
    shards: int
    machines: int = 1
    worker_bw: float = 10e9  # bytes/s each way, per worker
    shard_bw: float = 10e9  # bytes/s each way, per PS shard
    nic_bw: float = 12.5e9  # bytes/s each way, per machine
    alpha_worker: float = 50e-6  # s the sender spends per message before its bytes flow
    alpha_shard: float = 50e-6  # s of shard CPU per message (serial: one core per shard)
    bytes_per_element: int = 4
    # Cores every node shares (None: each worker and shard has its own), and the seconds of
    # α_worker spent waiting rather than computing (an injected delay: it holds the worker's
    # thread, not a core).
    shared_cores: int | None = None
    worker_wait: float = 0.0
    resolution: float = 0.0  # relative step-time difference the play cannot tell apart
    # One core per shard does all of its work: True puts a message's bytes (what it receives
    # and sums, or sends) on the same serial server as its fixed cost, α_shard + bytes/shard_bw
    # per message, instead of a port that moves bytes while the core handles other messages.
    shard_one_core: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1 or self.shards < 1 or self.machines < 1:
            raise ValueError("workers, shards and machines must be at least 1")
        if min(self.worker_bw, self.shard_bw, self.nic_bw) <= 0:
            raise ValueError("bandwidths must be positive")
        if min(self.alpha_worker, self.alpha_shard) < 0 or self.bytes_per_element < 1:
            raise ValueError("per-message costs must be >= 0 and bytes_per_element >= 1")
        if self.shared_cores is not None and self.shared_cores < 1:
            raise ValueError(f"shared_cores must be at least 1, got {self.shared_cores}")
        if not 0 <= self.resolution < 1:
            raise ValueError(f"resolution must lie in [0, 1), got {self.resolution}")
        if not 0 <= self.worker_wait <= self.alpha_worker:
            raise ValueError(
                f"worker_wait ({self.worker_wait}) must lie between 0 and alpha_worker "
                f"({self.alpha_worker})"
            )

    @property
    def worker_cpu(self) -> float:
        """Seconds of CPU a worker spends per message: α_worker less its wait."""
        return self.alpha_worker - self.worker_wait

    def worker_message_time(self) -> float:
        """How long one message holds a worker's thread when all n workers send at once: on
        shared cores the n workers' CPU takes n/cores of the time it would alone."""
        return self.worker_wait + self.worker_cpu * crowding(self.workers, self.shared_cores)

    def with_message_delay(self, seconds: float) -> ClusterSpec:
        """This cluster with ``seconds`` injected per message on the worker's thread
        (``senders.MessageCost``): a wait, so it holds the thread and not the cores."""
        return replace(
            self,
            alpha_worker=self.alpha_worker + seconds,
            worker_wait=self.worker_wait + seconds,
        )

    def with_workers(self, workers: int, shards_per_worker: float | None = None) -> ClusterSpec:
        """The same hardware with another worker count (and shards scaled 1:1 if asked)."""
        shards = (
            self.shards if shards_per_worker is None else max(1, round(workers * shards_per_worker))
        )
        return replace(self, workers=workers, shards=shards)

    def _machine(self, index: int, count: int) -> int:
        used = min(self.machines, count)
        return index * used // count

    def worker_machine(self, worker: int) -> int:
        return self._machine(worker, self.workers)

    def shard_machine(self, shard: int) -> int:
        return self._machine(shard, self.shards)

    @property
    def machines_used(self) -> int:
        return min(self.machines, max(self.workers, self.shards))

    @property
    def remote_fraction(self) -> float:
        """Share of a worker's shard traffic that crosses a NIC (shards evenly spread)."""
        used = min(self.machines, self.shards)
        return (used - 1) / used

    @property
    def workers_per_machine(self) -> int:
        return math.ceil(self.workers / min(self.machines, self.workers))

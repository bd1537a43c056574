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
* :func:`ps_step_end` — a whole PS plan played out on the resources the simulator has, for the
  planners that search groupings (``merge``, ``imerge``).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..codecs.native_common import enabled as native_enabled
from .cluster import ClusterSpec
from .dispatch import SendWindow

try:  # the play in C (``_play.c``, the same arithmetic), where the extension was built
    from . import _play
except ImportError:  # pragma: no cover - built without a C compiler
    _play = None
from .plan import Plan
from .profile import ModelProfile


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # s per message
    beta: float  # s per byte

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


def least_squares(samples: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """The least-squares line (α, β) through (bytes, seconds) samples, unclipped and unjudged."""
    data = np.asarray(list(samples), dtype=float)
    if data.ndim != 2 or data.shape[0] < 2 or data.shape[1] != 2:
        raise ValueError("need at least two (bytes, seconds) samples")
    if np.unique(data[:, 0]).size < 2:
        raise ValueError("need samples of at least two different sizes to separate α from β")
    design = np.column_stack([np.ones(len(data)), data[:, 0]])
    (alpha, beta), *_ = np.linalg.lstsq(design, data[:, 1], rcond=None)
    return float(alpha), float(beta)


def fit_alpha_beta(samples: Iterable[tuple[float, float]]) -> AlphaBeta:
    """Least-squares α, β from (bytes, seconds) samples; α is clipped at 0 (noise at tiny sizes)."""
    alpha, beta = least_squares(samples)
    if beta <= 0:
        raise ValueError("fitted β is not positive: transfer time does not grow with size")
    return AlphaBeta(max(alpha, 0.0), beta)


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

    def span_candidates(self) -> list[int]:
        """Spans a planner considers: powers of two, the worker count and every shard."""
        candidates = sorted(
            {1, self.cluster.shards, self.cluster.workers}
            | {2**k for k in range(int(math.log2(self.cluster.shards)) + 1)}
        )
        return [s for s in candidates if 1 <= s <= self.cluster.shards]


def ps_step_seconds(plan: Plan, cluster: ClusterSpec, profile: ModelProfile) -> float:
    """The PS model's time per step of ``plan``: the forward, then the backward with every part
    played out (:func:`ps_step_end`); a step ends when both the backward and the last part are
    done."""
    comm = ps_step_end(plan, cluster, profile.ready_times())
    return float(profile.forward_s.sum()) + max(comm, float(profile.backward_s.sum()))


def ps_step_end(plan: Plan, cluster: ClusterSpec, ready: Sequence[float]) -> float:
    """When the last part of a PS plan is back, from the start of backward: the latest of
    :func:`ps_group_ends`."""
    return max(ps_group_ends(plan, cluster, ready))


def ps_group_ends(plan: Plan, cluster: ClusterSpec, ready: Sequence[float]) -> list[float]:
    """When each group of a PS plan is back, from the start of backward (``ready``: when each
    layer's gradient exists), played out on the resources the simulator (``sim/engine.py``) has.

    The planners that search groupings price a candidate with this, so that they weigh what the
    simulator and the runtime run: every part costs α_worker twice on the worker's *one* thread
    (send, receive — pushes and pulls queue on the same thread), n·α_shard twice on its shard's
    core (the n pushes, then the n answers), n × its bytes through its shard's port each way,
    its bytes through the worker's port each way, and the copies of remote workers through the
    NICs (into the shard's machine and out of the others for the pushes, the other way for the
    answers: a NIC direction carries local workers' pushes *and* local shards' answers); a
    worker has one round trip per shard stream at a time, and its parts start as the
    simulator's and the runtime's ``SendWindow`` (``schedule/dispatch.py``) starts them: groups
    in release order while the bytes of admitted groups not yet back plus the next group's fit
    ``credit_bytes``, or when nothing is in flight (``None``: one group at a time, the send
    discipline of a prototype that waits for each group's answer before the next).

    All workers are taken to be alike — same compute, same plan — so one representative worker
    is played, the one its shards answer last. Ports are served first come, first served at full
    rate (the max-min network shares them; the last byte through a port ends at the same time
    either way). With interleaving, a part is complete at its shard once the worker that sends it
    last (rotated order: position (j − w) mod span) has sent it; without it, when its own send is
    through. Every wait is a queue in time order (an event loop), as in the simulator.

    On shared cores (``cluster.shared_cores``) every node's per-message CPU also queues on one
    pool of that many cores: the n workers' sends (n·(α_worker − wait) of CPU), each shard's n
    pushes and n answers. A part on another shard then adds its CPU to the same pool rather
    than running beside the first, which is what spreading a group over shards costs on one
    small host.

    A one-core shard (``cluster.shard_one_core``) has no port: each of its messages takes
    α_shard + bytes/B_shard of its core, pushes and answers alike, as in the simulator.
    """
    if plan.aggregator != "ps" or plan.order != "fifo":
        raise ValueError("ps_step_end plays PS plans sent in list order")
    # The planners' searches play thousands of plans, so the loop below is written for speed:
    # events are flat tuples, ``b if b > a else a`` is ``max(a, b)`` without the call (the same
    # value, ties and all), and what does not change during a play is looked up once.
    n, m = cluster.workers, cluster.shards
    ash, bpe = cluster.alpha_shard, cluster.bytes_per_element
    rate = cluster.worker_bw
    # Workers per machine, and each shard's machine: a part's n pushes cross into its shard's
    # machine from every other one, its n answers back out (the NIC pipes carry all workers).
    machines = cluster.machines_used
    local = [0] * machines
    for w in range(n):
        local[cluster.worker_machine(w)] += 1
    home = [cluster.shard_machine(s) for s in range(m)]
    nic_in, nic_out = [0.0] * machines, [0.0] * machines
    nic_bw = cluster.nic_bw
    senders = [(machine, count) for machine, count in enumerate(local) if count]

    def cross(start: float, shard: int, nbytes: float, inward: bool) -> float:
        """The NIC pipes a part's n copies cross (push: into the shard's machine)."""
        into, out_of = (nic_in, nic_out) if inward else (nic_out, nic_in)
        there, done = home[shard], start
        for machine, count in senders:
            if machine != there:
                free = out_of[machine]
                out_of[machine] = (free if free > start else start) + count * nbytes / nic_bw
                if out_of[machine] > done:
                    done = out_of[machine]
        remote = n - local[there]
        if remote:
            free = into[there]
            into[there] = (free if free > start else start) + remote * nbytes / nic_bw
            if into[there] > done:
                done = into[there]
        return done

    cores, wait, cpu = cluster.shared_cores, cluster.worker_wait, cluster.worker_cpu
    pool = 0.0  # when the shared cores are next free

    def on_cores(start: float, serial: float, work: float) -> float:
        """When CPU work begun at ``start`` ends: ``serial`` s on its own process, ``work``
        CPU-seconds over every node, queued on the shared cores where there are."""
        nonlocal pool
        if cores is None:
            return start + serial
        begin = pool if pool > start else start
        pool = begin + work / cores
        end = begin + serial
        return pool if pool > end else end

    worker_work = n * cpu

    def worker_message(start: float) -> float:
        """The representative worker's thread sends or receives one message, as all do."""
        return on_cores(start + wait, cpu, worker_work)

    shard_rate, one_core = cluster.shard_bw, cluster.shard_one_core
    release = _release_times(plan, ready)
    groups = plan.groups
    part_bytes = [[part.numel * bpe for part in group.parts] for group in groups]
    part_shard = [[part.shard for part in group.parts] for group in groups]
    # Rotated send order (interleaving): which position's send gates part j at its shard, and
    # which parts a part's send can complete (itself, and those its position gates), in order,
    # each with the position that gates it.
    # The loop below in C where it was built (``_play.c``: the same events in the same order,
    # the same arithmetic, the same ends bit for bit; tests/schedule/test_play.py), ~10x faster
    # per play; GRADSUM_NATIVE=0 plays it here.
    if _play is not None and native_enabled() and isinstance(bpe, int):
        return _play.play(
            (ash, rate, cluster.nic_bw, shard_rate, cores, wait, cpu),
            (n, m, int(bool(one_core)), plan.credit_bytes),
            [x for pair in senders for x in pair],
            local,
            home,
            release,
            list(itertools.accumulate((len(g.parts) for g in groups), initial=0)),
            [x for row in part_bytes for x in row],
            [x for row in part_shard for x in row],
            [g.numel * bpe for g in groups],
            [int(plan.interleave and len(g.parts) > 1) for g in groups],
        )
    watchers = []
    for group in groups:
        k = len(group.parts)
        if plan.interleave and k > 1:
            gate = _rotated_gate(k, n)
            watchers.append(
                [[(i, gate[i]) for i in range(k) if i == j or gate[i] == j] for j in range(k)]
            )
        else:
            watchers.append(None)
    thread = egress = ingress = 0.0
    shard_in, shard_core, shard_out = [0.0] * m, [0.0] * m, [0.0] * m
    window = SendWindow(plan, 0, bpe)  # the representative worker sends in list order
    sent = [[None] * len(g.parts) for g in groups]  # when each position's bytes are out
    arrived = [[None] * len(g.parts) for g in groups]  # when the part is in at its shard
    heappush, heappop = heapq.heappush, heapq.heappop
    # (time, sequence, kind, group, part): the sequence number orders equal times as pushed
    events = [(t, g, _RELEASE, g, 0) for g, t in enumerate(release)]
    heapq.heapify(events)
    seq = len(events)
    ends = [0.0] * len(groups)
    leads: dict[tuple[int, int], float] = {}

    # Where a part starts because an answer came back (its stream or the window freed), the
    # workers start it staggered as their answers were: a shard's core answers its n workers
    # one after another, n·α_shard apart in all, and the representative worker (answered last)
    # sends last, so the core has summed the others' pushes by then. Parts started on release
    # (ready times, alike on every worker) arrive together.
    answer_spread = (n - 1) * ash
    spread: dict[tuple[int, int], float] = {}

    while events:
        now, _, kind, g, j = heappop(events)
        if kind == _START:
            nbytes = part_bytes[g][j]
            s = part_shard[g][j]
            # the others' sends lead by the stagger, less what this worker's thread delays
            busy = thread - now
            lead = spread.pop((g, j), 0.0) - (busy if busy > 0.0 else 0.0)
            if not lead > 0.0:
                lead = 0.0
            thread = worker_message(thread if thread > now else now)
            egress = (egress if egress > thread else thread) + nbytes / rate
            if not one_core:  # a one-core shard's bytes are its core's work ("pushed")
                free, begin = shard_in[s], thread - lead
                shard_in[s] = (free if free > begin else begin) + n * nbytes / shard_rate
            crossed = cross(thread, s, nbytes, True)
            sent[g][j] = egress
            done = crossed if crossed > egress else egress
            arrived[g][j] = shard_in[s] if shard_in[s] > done else done
            leads[(g, j)] = lead
            if watchers[g] is None:  # sent in order: the part is complete once it is out
                a, b = arrived[g][j], sent[g][j]
                heappush(events, (b if b > a else a, seq, _PUSHED, g, j))
                seq += 1
            else:
                for i, position in watchers[g][j]:
                    a, b = arrived[g][i], sent[g][position]
                    if a is not None and b is not None:
                        heappush(events, (b if b > a else a, seq, _PUSHED, g, i))
                        seq += 1
        elif kind == _PUSHED:
            nbytes = part_bytes[g][j]
            s = part_shard[g][j]
            lead = leads.pop((g, j), 0.0)
            # a message's time on the shard's core: its fixed cost, and on a one-core shard
            # its bytes too (received and summed, or sent)
            per = ash + (nbytes / shard_rate if one_core else 0.0)
            begin, core = now - lead, shard_core[s]
            queued = on_cores(core if core > begin else begin, n * per, n * per)
            summed = now + per
            if queued > summed:
                summed = queued
            shard_core[s] = on_cores(summed, n * per, n * per)  # the n answers
            if not one_core:
                answer, free = summed + ash, shard_out[s]
                shard_out[s] = (free if free > answer else answer) + n * nbytes / shard_rate
            core = shard_core[s]
            ingress = (ingress if ingress > core else core) + nbytes / rate
            crossed = cross(summed + per, s, nbytes, False)
            back = shard_out[s]
            if ingress > back:
                back = ingress
            if crossed > back:
                back = crossed
            heappush(events, (back, seq, _PULLED, g, j))
            seq += 1
        elif kind == _PULLED:
            thread = worker_message(thread if thread > now else now)
            if thread > ends[g]:
                ends[g] = thread
            heappush(events, (thread, seq, _BACK, g, j))
            seq += 1
        else:
            if kind == _RELEASE:
                starts, staggered = window.release(g), 0.0
            else:  # a part is back: its stream, and with its group's last part the window, free
                freed = part_shard[g][j]
                starts, _ = window.part_back(g, j)
                # At one instant the parts the window admits take the worker's thread before
                # the freed stream's next part: the order the planners' searches are tuned and
                # tested on; the other order moves a step's end by ~1e-7 s and can tip a
                # search's tie.
                starts = [p for p in starts if part_shard[p[0]][p[1]] != freed] + [
                    p for p in starts if part_shard[p[0]][p[1]] == freed
                ]
                staggered = answer_spread
            for part in starts:
                spread[part] = staggered
                heappush(events, (now, seq, _START, *part))
                seq += 1
    return ends


_RELEASE, _START, _PUSHED, _PULLED, _BACK = range(5)  # a play's events


@functools.cache
def _rotated_gate(k: int, n: int) -> tuple[int, ...]:
    """For each part of a group rotated over k parts by n workers, the send position that
    completes it at its shard: the latest of ``(j - w) mod k`` over the workers w that start
    at distinct parts (the first ``min(n, k)``): j itself unless a worker's rotation wraps past
    it, then k - 1."""
    first = min(n, k) - 1
    return tuple(j if j >= first else k - 1 for j in range(k))


def _release_times(plan: Plan, ready: Sequence[float]) -> list[float]:
    """When each group leaves: once its last layer's gradient exists and every group before it
    has left (list order; ``after_backward``: once the whole backward has run)."""
    times, latest = [], 0.0
    offsets = plan.layer_offsets
    for group in plan.groups:
        last = bisect.bisect_left(offsets, group.stop) - 1
        at = ready[-1] if plan.trigger == "after_backward" else ready[last]
        latest = max(latest, at)
        times.append(latest)
    return times

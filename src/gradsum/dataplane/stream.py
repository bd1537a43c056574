"""The worker's side of the protocol, sans-IO: which chunk to send next, when to resend, when done.

A ``ChunkStream`` streams chunks ``first .. first + count - 1`` of a job's stream through the
job's s slots: at most one chunk per slot in flight, and chunk c + s is sent only once c's result
is in (self-clocking). Each outstanding chunk has a deadline; when it passes, the chunk is resent
and its timeout doubles up to a ceiling. Fast retransmit: results come back in chunk order when
nothing is lost (every worker sends its chunks in order over a FIFO path, and a slot completes
with its last contribution), so ``FAST_RETRANSMIT`` results of later chunks (sent after its last
send) while a chunk is outstanding mean it (or its result) was lost: it is resent then, once per
send, rather than after its timeout; once the whole stream is sent, fewer later chunks can follow
a late one and each of them counts (early retransmit), so losses at the tail of a stream are
recovered in one round trip too.
Timers handle what fast retransmit cannot see: when a timer fires while results are still coming
back (one arrived within the late chunk's timeout), the late chunk is queued
behind them on a busy path rather than lost (a loss would be overtaken), so it is not resent and
its timer backs off; when nothing has come back for that long, only the oldest late chunk is
resent, as a probe (a peer may still be encoding, the aggregator descheduled, or the tail of the
stream lost), and the others' timers back off unsent. So a slow path costs no resends and a
silent one one packet per timeout, not a window of them.
Time is passed in; the shell owns sockets and clocks.

``ChunkLayout`` maps chunks to lanes and bytes of the upstream and result buffers, and
``shard_lanes`` spreads a tensor's lanes over several aggregators (multi-PS sharding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

FAST_RETRANSMIT = 3  # results of later chunks that resend an outstanding one (TCP's dupthresh)


class AggregationTimeout(TimeoutError):
    """A chunk got no result within the retry policy's patience."""


class StaleChunkError(RuntimeError):
    """The aggregator no longer keeps a chunk's result (this worker fell behind a quorum)."""


@dataclass(frozen=True)
class RetryPolicy:
    timeout: float = 0.01  # first retransmission timeout, seconds (SwitchML's public code: 10 ms)
    backoff: float = 2.0
    max_timeout: float = 0.25
    give_up_after: float = 30.0  # seconds one chunk may wait for its result in all

    def __post_init__(self):
        if not 0 < self.timeout <= self.max_timeout:
            raise ValueError("retry timeout must be positive and at most max_timeout")
        if self.backoff < 1 or self.give_up_after <= 0:
            raise ValueError("retry backoff must be >= 1 and give_up_after positive")


@dataclass
class StreamStats:
    """Per-job counters, summed over a worker's streams."""

    packets_sent: int = 0
    retransmissions: int = 0
    timeouts: int = 0
    fast_retransmissions: int = 0
    results: int = 0
    duplicate_results: int = 0
    stale: int = 0
    chunks: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class RoundTrip:
    """A job's round-trip estimate, shared by all of a worker's streams through that job so it
    outlives one allreduce: Jacobson's smoothed round trip and variance from chunks never resent
    (Karn), and TCP's rule that after a timeout new chunks keep the backed-off timeout until a
    fresh sample arrives (otherwise a window whose every chunk was resent spuriously never yields
    a sample and keeps resending at the floor) — or until a resent chunk's result comes back
    within srtt + 4 rttvar of its resend: the aggregator answers promptly, the chunk had been
    lost, not delayed. That matters here more than in TCP: a slot completes only with
    every worker's packet, so each worker times out on the others' losses as well as its own,
    and a backoff that stayed until the next clean sample (none in a one-chunk exponent round)
    made every later loss wait up to ``max_timeout``."""

    srtt: float | None = None
    rttvar: float = 0.0
    backoff: float = 0.0  # the last backed-off timeout, until the next clean sample

    def timeout(self, policy: RetryPolicy) -> float:
        adaptive = policy.timeout if self.srtt is None else self.srtt + 4 * self.rttvar
        return min(max(policy.timeout, adaptive, self.backoff), policy.max_timeout)

    def answered(self, waited: float) -> None:
        """A resent chunk's result came ``waited`` seconds after its last sending. Only against
        known round trips: before the first clean sample a prompt answer may be the first
        sending's, late (a slow aggregator, which the backoff is there to spare)."""
        if self.srtt is not None and waited <= self.srtt + 4 * self.rttvar:
            self.backoff = 0.0

    def sample(self, rtt: float) -> None:
        self.backoff = 0.0
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
            return
        self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
        self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def backed_off(self, timeout: float) -> None:
        self.backoff = max(self.backoff, timeout)


@dataclass(slots=True)
class _Outstanding:
    deadline: float
    timeout: float
    first_sent: float
    retries: int = 0
    later: int = 0  # results of later chunks since this chunk was last sent
    last_sent: float = 0.0
    sampled: bool = False  # its round trip was sampled (at its first packet's result)


@dataclass
class ChunkStream:
    first: int
    count: int
    slots: int
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    stats: StreamStats = field(default_factory=StreamStats)
    what: str = "aggregator"  # names the peer in errors
    rtt: RoundTrip = field(default_factory=RoundTrip)  # pass the job's to keep it across streams

    def __post_init__(self):
        if self.count < 0 or self.slots < 1 or self.first < 0:
            raise ValueError("a stream needs first >= 0, count >= 0 and slots >= 1")
        self._end = self.first + self.count
        # chunks below `ready` have their payload; the window may hold later ones back until
        # `release` (a payload encoded part by part while earlier parts are on the wire)
        self.ready = self._end
        self._held: list[int] = []  # window places waiting for their chunk's payload
        self._outstanding: dict[int, _Outstanding] = {}
        self._highest_sent = self.first - 1
        self._received = 0
        self._last_result = float("-inf")
        self._last_send = float("-inf")  # of a chunk's first sending
        self._probed = False  # a tail probe went out since the last result

    @property
    def timeout(self) -> float:
        """The first timeout of a new chunk: the policy's floor, or more when round trips are
        slower (Jacobson: srtt + 4 rttvar) or a timeout just backed off, so a busy aggregator
        is not flooded by resends."""
        return self.rtt.timeout(self.policy)

    @property
    def done(self) -> bool:
        return self._received == self.count

    @property
    def received(self) -> int:
        """Chunks whose result is in."""
        return self._received

    def start(self, now: float) -> list[int]:
        window = range(self.first, min(self.first + self.slots, self._end))
        self._held = [chunk for chunk in window if chunk >= self.ready]
        sent = [chunk for chunk in window if chunk < self.ready]
        for chunk in sent:
            self._send(chunk, now)
        return sent

    def release(self, ready: int, now: float) -> list[int]:
        """Payloads are in place up to chunk ``ready`` (exclusive): send the window places that
        were waiting for them, in chunk order (they were held in the order results came, and
        loss detection reads results out of chunk order as losses)."""
        self.ready = max(self.ready, min(ready, self._end))
        sent = sorted(chunk for chunk in self._held if chunk < self.ready)
        self._held = [chunk for chunk in self._held if chunk >= self.ready]
        for chunk in sent:
            self._send(chunk, now)
        return sent

    def is_outstanding(self, chunk: int) -> bool:
        return chunk in self._outstanding

    def on_result(self, chunk: int, now: float) -> list[int]:
        """A result arrived; return the chunks to send now (empty for a duplicate)."""
        return self.on_results((chunk,), now)

    def on_results(self, chunks: Sequence[int], now: float) -> list[int]:
        """``on_result`` of each of ``chunks`` in turn, all arrived by ``now`` (a batch the
        transport received together): the chunks to send now, in the order decided. One call a
        batch keeps the per-result path to its few dict and arithmetic operations: every result
        of every stream passes here."""
        outstanding, stats = self._outstanding, self.stats
        slots, end = self.slots, self._end
        resend: list[int] = []
        for chunk in chunks:
            state = outstanding.pop(chunk, None)
            if state is None:
                stats.duplicate_results += 1
                continue
            self._sample_once(state, now)
            if state.retries:
                self.rtt.answered(now - state.last_sent)
            self._received += 1
            self._last_result = now
            self._probed = False
            stats.results += 1
            # results come in chunk order unless something was lost: then no earlier chunk is
            # out (a C-speed check that spares the per-result loop over the window)
            if outstanding and min(outstanding) < chunk:
                resend += self._overtaken(chunk, state.last_sent, now)
            following = chunk + slots
            if following < end:
                if following >= self.ready:
                    self._held.append(following)
                else:
                    self._send(following, now)
                    resend.append(following)
        return resend

    def on_progress(self, chunk: int, now: float, holes: bool = False) -> list[int]:
        """A packet of outstanding ``chunk`` (a chunk of several packets) has its result: results
        still flow, and it counts against earlier chunks as a whole result would, so a packet
        lost from one is resent within a few packets instead of after a timer. ``holes``: it is
        the chunk's last packet and earlier ones have no result; a chunk's results come back in
        packet order, so those were lost, and the chunk is resent now (once: after that, later
        chunks' results and the timer recover it) — a loss in a stream's last chunk then costs
        a round trip, not a timeout. Returns the chunks to resend."""
        state = self._outstanding.get(chunk)
        if state is None:
            return []
        self._last_result = now
        self._probed = False
        self._sample_once(state, now)
        lost = self._overtaken(chunk, state.last_sent, now)
        if holes and state.retries == 0:
            lost.append(chunk)
            self._fast_resent([chunk], now)
        return lost

    def _overtaken(self, chunk: int, sent: float, now: float) -> list[int]:
        """Earlier chunks that ``FAST_RETRANSMIT`` later results have now overtaken: resend them
        (their timers restart, their timeouts do not back off). A result counts against an
        earlier chunk only if its own chunk left after that one's last send. At the end of the
        stream fewer later chunks exist, and each may count (TCP's early retransmit): the tail
        of a stream recovers a loss in one round trip instead of one timeout per lost chunk."""
        lost = []
        all_sent = self._highest_sent == self._end - 1
        for earlier, state in self._outstanding.items():
            if earlier < chunk and sent >= state.last_sent:
                state.later += 1
                threshold = FAST_RETRANSMIT
                if all_sent:
                    threshold = min(threshold, self._highest_sent - earlier)
                if state.later >= threshold:  # reset below: once per send
                    lost.append(earlier)
        self._fast_resent(lost, now)
        return lost

    def _fast_resent(self, chunks: list[int], now: float) -> None:
        """Chunks resent now before their timers (their timeouts do not back off)."""
        for chunk in chunks:
            state = self._outstanding[chunk]
            state.retries += 1
            state.later = 0
            state.last_sent = now
            state.deadline = now + state.timeout
        self.stats.fast_retransmissions += len(chunks)
        self.stats.retransmissions += len(chunks)
        self.stats.packets_sent += len(chunks)

    def on_stale(self, chunk: int) -> None:
        if chunk in self._outstanding:
            self.stats.stale += 1
            raise StaleChunkError(
                f"{self.what} no longer keeps the result of chunk {chunk}: the round completed "
                "without this worker (partial aggregation) and its slot was reused"
            )

    def expired(self, now: float) -> list[int]:
        """Chunks to resend now: the oldest late chunk when no result came back within its
        timeout, none while results still flow; all late chunks' timeouts back off. Or, at a
        stream's tail, a probe (below)."""
        late = sorted(c for c, o in self._outstanding.items() if o.deadline <= now)
        for chunk in late:
            self._check_patience(chunk, now)
        silent = late and now - self._last_result >= self._outstanding[late[0]].timeout
        resend = late[:1] if silent else []
        for chunk in late:
            self._back_off(self._outstanding[chunk], now, chunk in resend)
        self.stats.timeouts += len(resend)
        self.stats.retransmissions += len(resend)
        self.stats.packets_sent += len(resend)
        probe = self._probe_due()
        if not resend and probe is not None and now >= probe:
            resend = [min(self._outstanding)]
            self._probed = True
            self._fast_resent(resend, now)
        return resend

    def _probe_due(self) -> float | None:
        """When a tail probe is due (TCP's tail loss probe): every chunk sent, some still out,
        and no result for 2 round trips since the last result or sending. No later chunk is left
        to reveal a loss there, and the timeouts, sized on round trips that include waiting for
        the other workers and backed off by earlier losses, are many round trips long; the
        probe resends the oldest chunk's missing packets once per silence, without backing off.
        """
        if self._probed or not self._outstanding or self._highest_sent != self._end - 1:
            return None
        if self.rtt.srtt is None:  # no round trip known: the timers are all there is
            return None
        pto = max(self.policy.timeout, 2 * self.rtt.srtt)
        return max(self._last_result, self._last_send) + pto

    def _check_patience(self, chunk: int, now: float) -> None:
        state = self._outstanding[chunk]
        if now - state.first_sent >= self.policy.give_up_after:
            raise AggregationTimeout(
                f"no result for chunk {chunk} (slot {chunk % self.slots}, version "
                f"{(chunk // self.slots) % 2}) from {self.what} after {state.retries} "
                f"retransmissions over {now - state.first_sent:.1f} s"
            )

    def _back_off(self, state: _Outstanding, now: float, resent: bool) -> None:
        if resent:
            state.retries += 1
            state.later = 0
            state.last_sent = now
        state.timeout = min(state.timeout * self.policy.backoff, self.policy.max_timeout)
        state.deadline = now + state.timeout
        self.rtt.backed_off(state.timeout)

    def next_deadline(self) -> float | None:
        deadlines = [o.deadline for o in self._outstanding.values()]
        probe = self._probe_due()
        return min(deadlines + ([] if probe is None else [probe]), default=None)

    def _sample_once(self, state: _Outstanding, now: float) -> None:
        """A round trip sample from a chunk's first result (Karn: never from a resent chunk).

        For a chunk of several packets that is its first packet's result: the path's round trip.
        Its last packet may also have waited for another worker's recovery of a lost packet
        (no worker completes a slot alone), which says nothing about this path; with many
        packets per chunk nearly every chunk holds such a wait, and sampled at its end they
        would swell the timeout many times over (1 % loss, 44 packets, loopback: 80-250 ms
        timeouts, against first-packet round trips of 7-12 ms)."""
        if state.retries == 0 and not state.sampled:
            state.sampled = True
            self.rtt.sample(now - state.first_sent)

    def _send(self, chunk: int, now: float) -> None:
        timeout = self.rtt.timeout(self.policy)  # ``timeout``'s, one call fewer a chunk
        self._outstanding[chunk] = _Outstanding(now + timeout, timeout, now, last_sent=now)
        if chunk > self._highest_sent:
            self._highest_sent = chunk
        self._last_send = now
        stats = self.stats
        stats.packets_sent += 1
        stats.chunks += 1


@dataclass(frozen=True)
class ChunkLayout:
    """Lanes of one stream cut into chunks; byte ranges of each chunk at both wire widths."""

    lanes: int
    lanes_per_chunk: int
    in_bits: int
    out_bits: int

    def __post_init__(self):
        if self.lanes_per_chunk < 8 or self.lanes_per_chunk % 8:
            raise ValueError("lanes per chunk must be a positive multiple of 8 (whole bytes)")

    @property
    def chunks(self) -> int:
        return -(-self.lanes // self.lanes_per_chunk)

    def lanes_of(self, index: int) -> tuple[int, int]:
        """(first lane, lane count) of the stream's ``index``-th chunk."""
        start = index * self.lanes_per_chunk
        return start, min(self.lanes_per_chunk, self.lanes - start)

    def upstream_bytes(self, index: int) -> tuple[int, int]:
        return self._bytes(index, self.in_bits)

    def downstream_bytes(self, index: int) -> tuple[int, int]:
        return self._bytes(index, self.out_bits)

    def _bytes(self, index: int, bits: int) -> tuple[int, int]:
        start, count = self.lanes_of(index)
        return start * bits // 8, (start * bits + count * bits + 7) // 8


def shard_lanes(lanes: int, shards: int, align: int) -> list[tuple[int, int]]:
    """Split ``lanes`` into ``shards`` contiguous (start, count) ranges whose boundaries fall on
    multiples of ``align`` (a chunk), as evenly as whole chunks allow."""
    if shards < 1 or align < 1:
        raise ValueError("need at least one shard and a positive alignment")
    units = -(-lanes // align)
    bounds = [min(lanes, (units * s // shards) * align) for s in range(shards + 1)]
    return [(bounds[s], bounds[s + 1] - bounds[s]) for s in range(shards)]

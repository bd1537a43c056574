"""One job's pool of aggregation slots: the SwitchML state machine, with explicit round ids.

Chunk c of a job's stream uses slot ``c mod s`` in version ``(c div s) mod 2``, so each
(version, slot) sees the rounds c, c + 2s, c + 4s, ... in order. A round moves

    EMPTY -> OPEN -(all workers, or a quorum at the deadline)-> COMPLETE
                  \\-(job has a parent)-> WAITING_PARENT -(parent's result)-> COMPLETE

and stays COMPLETE, keeping its result for retransmissions, until the round two chunks of the
stream later (same version) opens it again. Per round: the chunk id, a ``seen`` byte per worker,
the arrival count and the number of workers summed (contributors). Keeping the chunk id (where
SwitchML keeps only counts) lets the pool recognise late duplicates, stragglers of a partial
round and workers out of step exactly, instead of guessing from the count.

Self-clocking makes this safe: a worker sends chunk c + s only after receiving c's result, so no
worker is ever more than one round ahead of another on a slot, and the other version still holds
the previous result for whoever lost it.
"""

from __future__ import annotations

import enum
import hmac

import numpy as np

from . import actions
from .actions import Drop, Send, Store
from .authentication import TAG_SIZE, packet_tag
from .combiners import IntegerSumOp, MaxOp
from .jobspec import JobSpec
from .packet import ANY_WORKER, PARTIAL, PRESUMMED, Flag, Header, Kind, MalformedPacket, Op

ROUND_BYTES = 214  # a Round and its seen bytearray, less the bytes of seen: RSS growth per round
# (tracemalloc sees 186; the allocator's arenas and the lists of rounds add the rest)


def resident_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """An int32 array of zeros whose pages are written now: calloc'd memory becomes resident
    only as slots are first used, so a registration's memory would show up in the RSS some
    time later, and admission by declared memory would not bound what the process holds."""
    array = np.empty(shape, dtype=np.int32)
    array.fill(0)
    return array


class RoundState(enum.Enum):
    EMPTY = "empty"
    OPEN = "open"
    WAITING_PARENT = "waiting-parent"
    COMPLETE = "complete"


class Round:
    """The state of one (version, slot)."""

    __slots__ = (
        "arrivals",
        "chunk",
        "contributors",
        "elements",
        "flags",
        "kept",
        "op",
        "opened_at",
        "result",
        "seen",
        "state",
    )

    def __init__(self, workers: int):
        self.state = RoundState.EMPTY
        self.chunk = -1
        self.seen = bytearray(workers)
        self.arrivals = 0
        self.contributors = 0
        self.op = Op.NONE
        self.elements = 0
        self.flags = 0
        self.kept: list | None = None  # collecting ops: contributions by worker
        self.opened_at = 0.0
        self.result: memoryview | bytes = b""

    def open(self, chunk: int, op: Op, elements: int, now: float) -> None:
        self.state = RoundState.OPEN
        self.chunk = chunk
        self.seen[:] = bytes(len(self.seen))
        self.arrivals = self.contributors = self.flags = 0
        self.op, self.elements, self.opened_at = op, elements, now
        self.kept = None
        self.result = b""


class SlotPool:
    """Data packets of one job in, actions out. The caller has checked job, worker and source."""

    def __init__(self, spec: JobSpec, sum_op):
        self.spec = spec
        self.sum_op = sum_op
        self.max_op = MaxOp()
        self.slots = spec.slots
        # The only large state: an int32 accumulator per (version, slot), k lanes each.
        self.acc = resident_zeros((2, spec.slots, spec.elements))
        self.rounds = [[Round(spec.workers) for _ in range(spec.slots)] for _ in range(2)]
        self._waiting: dict[tuple[int, int], None] = {}  # open rounds with a quorum deadline
        self.stats: dict[str, int] = {}
        # A worker sends contributors = 1; a child switch's partial sum (PRESUMMED) at most
        # what leaves one for each other worker.
        self._most_presummed = spec.max_contributors - (spec.workers - 1)
        self.token = spec.token
        self.mac_key = spec.mac_key

    @staticmethod
    def memory(spec: JobSpec) -> int:
        """Bytes the pool holds: per round of each slot's two, the int32 accumulator, the
        Round object with its seen bytes, and on a server each worker's kept contribution (at
        most a packet's lanes)."""
        lanes = 4 * spec.elements
        kept = 0 if spec.op.kind == "integer-sum" else lanes * spec.workers
        return 2 * spec.slots * (lanes + ROUND_BYTES + spec.workers + kept)

    # -- packets from workers ---------------------------------------------------------------
    def on_data(self, header: Header, payload: memoryview, now: float) -> list:
        if self.mac_key is not None:  # integrity "mac": the token, then the packet's tag
            if header.token != self.token:
                return [self._drop("bad_token", "not the job's data token")]
            body = payload[: len(payload) - TAG_SIZE]
            tag = packet_tag(self.mac_key, header.pack(), body)
            if len(payload) < TAG_SIZE or not hmac.compare_digest(tag, payload[len(body) :]):
                return [self._drop("bad_mac", f"worker {header.worker} chunk {header.chunk}")]
            payload = body
        try:
            op = self._checked(header, payload)
            # Collecting ops parse the whole payload now, before any state changes.
            kept = None if op.accumulating else op.keep(payload, header.elements)
        except MalformedPacket as error:
            return [self._drop(error.reason, str(error))]
        v, i, c, w = header.version, header.slot, header.chunk, header.worker
        r = self.rounds[v][i]
        if c < r.chunk:
            self._count("stale")
            return [self._reply(Kind.STALE, r, header, actions.STALE)]
        if c > r.chunk:
            if not self._may_open(r, c, v, i):
                return [self._drop("out_of_step", f"chunk {c} while slot holds {r.chunk}")]
            r.open(c, header.op, header.elements, now)
        if header.op != r.op or header.elements != r.elements:
            return [self._drop("mismatch", "op/elements differ from the round's first packet")]
        if r.seen[w]:
            return self._on_repeat(r, header)
        r.seen[w] = 1
        if r.state is RoundState.COMPLETE:  # a straggler of a partial round: give it the result
            self._count("late_contributions")
            return [self._reply(Kind.RESULT, r, header, actions.UNICAST)]
        if r.state is RoundState.WAITING_PARENT:
            return [self._drop("late", "round already forwarded to the parent")]
        return self._contribute(r, op, header, payload if kept is None else kept, now)

    def _checked(self, header: Header, payload: memoryview):
        """The op for this packet after every check its header and payload allow."""
        s, nbytes = self.slots, len(payload)
        if header.token != self.token:
            raise MalformedPacket("bad_token", "not the job's data token")
        if header.slot >= s:
            raise MalformedPacket("bad_slot", f"slot {header.slot} >= {s}")
        if header.chunk % (2 * s) != header.slot + header.version * s:
            raise MalformedPacket("bad_chunk", f"chunk {header.chunk} is not slot/version's")
        if not 1 <= header.elements <= self.spec.elements:
            raise MalformedPacket("bad_elements", f"{header.elements} lanes")
        presummed = header.flags & PRESUMMED
        if not 1 <= header.contributors <= (self._most_presummed if presummed else 1):
            raise MalformedPacket("bad_contributors", str(header.contributors))
        if header.flags & PARTIAL:
            raise MalformedPacket("bad_flags", "PARTIAL is a result flag")
        op = self.max_op if header.op is Op.MAX else self.sum_op
        if header.op not in (Op.SUM, Op.MAX):
            raise MalformedPacket("bad_op", str(header.op))
        op.check_payload(nbytes, header.elements, bool(presummed))
        if presummed and op is self.sum_op and isinstance(op, IntegerSumOp):
            op.check_presummed(payload, header.elements, header.contributors)
        return op

    def _may_open(self, r: Round, chunk: int, version: int, slot: int) -> bool:
        if r.state is RoundState.EMPTY:
            return chunk == slot + version * self.slots
        return r.state is RoundState.COMPLETE and chunk == r.chunk + 2 * self.slots

    def _on_repeat(self, r: Round, header: Header) -> list:
        if r.state is RoundState.COMPLETE:
            self._count("retransmissions_answered")
            return [self._reply(Kind.RESULT, r, header, actions.UNICAST)]
        if r.state is RoundState.WAITING_PARENT:  # the worker's timer stands in for ours
            self._count("forwards_repeated")
            return [self._forward(r)]
        return [self._drop("duplicate", f"worker {header.worker} chunk {header.chunk}")]

    def _contribute(self, r: Round, op, header: Header, data, now: float) -> list:
        """Enter one worker's contribution (lanes, or a collecting op's parsed payload)."""
        # Every worker still to come adds at least one: a partial sum that leaves them no room
        # would wedge the round (it could never complete), so it is refused instead.
        still = self.spec.workers - r.arrivals - 1
        if r.contributors + header.contributors + still > self.spec.max_contributors:
            r.seen[header.worker] = 0
            return [self._drop("too_many_contributors", str(header.contributors))]
        v, i = header.version, header.slot
        if op.accumulating:
            store = op.add if r.arrivals else op.first
            store(self.acc[v, i], data, header.elements, bool(header.flags & PRESUMMED))
        else:
            if r.kept is None:
                r.kept = [None] * self.spec.workers
            r.kept[header.worker] = data
        r.arrivals += 1
        r.contributors += header.contributors
        self._count("stored")
        done = [Store(self.spec.job, i, v, r.chunk)]
        if r.arrivals == self.spec.workers:
            self._waiting.pop((v, i), None)
            return done + self._complete(r, v, i, 0)
        if self.spec.quorum:
            self._waiting[(v, i)] = None
            if r.arrivals >= self.spec.quorum and now >= r.opened_at + self.spec.deadline:
                self._waiting.pop((v, i), None)
                return done + self._complete(r, v, i, Flag.PARTIAL)
        return done

    # -- completion -----------------------------------------------------------------------
    def _complete(self, r: Round, version: int, slot: int, flags: int) -> list:
        op = self.max_op if r.op is Op.MAX else self.sum_op
        try:
            if op.accumulating:
                r.result = op.result(self.acc[version, slot], r.elements)
            else:
                kept = [k for k in r.kept if k is not None]
                r.result = op.combine(kept, r.elements, r.contributors, r.chunk)
                r.kept = None
        except (ValueError, RuntimeError, IndexError) as error:
            # Contents the header could not vouch for (e.g. sparse indices out of range).
            r.state = RoundState.OPEN
            return [self._drop("combine_failed", str(error))]
        r.flags = flags
        if self.spec.parent is not None:
            r.state = RoundState.WAITING_PARENT
            return [self._forward(r)]
        r.state = RoundState.COMPLETE
        self._count("completed")
        return [self._multicast(r)]

    def on_parent_result(self, header: Header, payload: memoryview) -> list:
        """The parent switch's result for a round this switch forwarded."""
        if header.token != self.spec.parent.token:
            return [self._drop("bad_token", "parent result")]
        if header.slot >= self.slots:
            return [self._drop("bad_slot", "parent result")]
        r = self.rounds[header.version][header.slot]
        if r.chunk != header.chunk or r.state is not RoundState.WAITING_PARENT:
            what = "duplicate_parent_result" if r.state is RoundState.COMPLETE else "unexpected"
            return [self._drop(what, f"chunk {header.chunk}")]
        if header.op != r.op or header.elements != r.elements or len(payload) != len(r.result):
            return [self._drop("mismatch", "parent result shape")]
        r.result = bytes(payload)
        r.contributors = header.contributors
        r.flags = header.flags & PARTIAL
        r.state = RoundState.COMPLETE
        self._count("completed")
        return [self._multicast(r)]

    def on_tick(self, now: float) -> list:
        """Complete every quorum round whose deadline has passed."""
        done: list = []
        for v, i in list(self._waiting):
            r = self.rounds[v][i]
            if now < r.opened_at + self.spec.deadline:
                break  # insertion order is opening order
            if r.state is RoundState.OPEN and r.arrivals >= self.spec.quorum:
                del self._waiting[(v, i)]
                done += self._complete(r, v, i, Flag.PARTIAL)
        return done

    def next_deadline(self) -> float | None:
        for v, i in self._waiting:
            return self.rounds[v][i].opened_at + self.spec.deadline
        return None

    # -- packets out --------------------------------------------------------------------------
    def _result_header(self, kind: Kind, r: Round, worker: int, version: int, slot: int):
        return Header(
            kind, self.spec.job, worker, slot, version, r.op, r.flags, r.chunk, r.elements,
            r.contributors, self.token,
        ).pack()  # fmt: skip

    def _multicast(self, r: Round) -> Send:
        v, i = self._where(r.chunk)
        self._count("multicasts")
        header = self._result_header(Kind.RESULT, r, ANY_WORKER, v, i)
        group = self.spec.group
        destinations = self.spec.addresses if group is None else (group,)
        return Send(actions.MULTICAST, destinations, header, self._tagged(header, r.result))

    def _tagged(self, header: bytes, payload) -> bytes | memoryview:
        """``payload``, followed by the packet's MAC in integrity-"mac" jobs."""
        if self.mac_key is None:
            return payload
        return bytes(payload) + packet_tag(self.mac_key, header, payload)

    def _reply(self, kind: Kind, r: Round, asked: Header, what: str) -> Send:
        if kind is Kind.STALE:
            header = Header(Kind.STALE, self.spec.job, asked.worker, asked.slot, asked.version,
                            asked.op, 0, asked.chunk, token=self.token).pack()  # fmt: skip
            return Send(what, (self.spec.addresses[asked.worker],), header,
                        self._tagged(header, b""))  # fmt: skip
        header = self._result_header(kind, r, asked.worker, asked.version, asked.slot)
        return Send(what, (self.spec.addresses[asked.worker],), header,
                    self._tagged(header, r.result))  # fmt: skip

    def _forward(self, r: Round) -> Send:
        parent = self.spec.parent
        v, i = self._where(r.chunk)
        # PRESUMMED for MAX too: a packet of several contributors is always a partial sum
        header = Header(Kind.DATA, parent.job, parent.worker, i, v, r.op, PRESUMMED, r.chunk,
                        r.elements, r.contributors, parent.token).pack()  # fmt: skip
        self._count("forwards")
        return Send(actions.FORWARD, (parent.address,), header, r.result)

    def _where(self, chunk: int) -> tuple[int, int]:
        return (chunk // self.slots) % 2, chunk % self.slots

    def _drop(self, reason: str, detail: str = "") -> Drop:
        self._count(f"dropped_{reason}")
        return Drop(reason, detail)

    def _count(self, name: str) -> None:
        self.stats[name] = self.stats.get(name, 0) + 1

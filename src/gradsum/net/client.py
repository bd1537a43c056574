"""The worker client: real sockets and timers around ``dataplane.Collective`` and ``Transfer``.

``SwitchClient(aggregators, job=..., worker=..., workers=..., codec=...)`` is one worker's
connection to a job: ``collective`` is the job's ``codecs.round.Reducer`` (what the training
integration, ``sync.service``, runs its codec rounds through), and ``allreduce(tensor)`` is one
such round with the client's own codec, for tools and tests. It talks to switches and parameter
servers alike (the server decodes for codecs a switch cannot sum).

Receive path: peek a datagram's header, ask the transfer where its payload belongs, and receive
it straight there (``recvmsg_into`` on a memoryview slice of the output); sends gather a header
and a view of the encoded tensor (``sendmsg``), so no payload is copied in Python.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import select
import socket
import time
from collections.abc import Hashable, Sequence

import torch

from ..codecs.registry import make_codec
from ..codecs.round import CodecRound
from ..dataplane.codec_wire import WireFormat, wire_format
from ..dataplane.collective import Collective, JobHandle
from ..dataplane.geometry import aggregator_slots, lanes_fitting, packet_geometry
from ..dataplane.jobspec import Address, JobSpec
from ..dataplane.packet import HEADER_SIZE, Header, Kind, MalformedPacket, parse_header
from ..dataplane.stream import RetryPolicy
from ..dataplane.transfer import Transfer
from . import pump
from .udp import (
    enable_gro,
    local_address,
    multicast_group,
    open_group_socket,
    open_socket,
    resolve,
)

_PEEK = socket.MSG_PEEK | socket.MSG_TRUNC
PAYLOAD_ELEMENTS = 1 << 13  # coordinates per decode-sum-encode payload: one fits a datagram
_request_ids = itertools.count(1)


class ControlError(RuntimeError):
    """An aggregator answered a control request with ERROR, or never answered."""

    def __init__(self, message: str, code: str = "no_reply"):
        super().__init__(message)
        self.code = code


class AggregatorLost(ConnectionError):
    """An aggregator of a job stopped answering, or no longer holds the job (it restarted): the
    job's rounds cannot go on until it is registered again (``sync.recovery``)."""

    def __init__(self, address: Address, job: int, reason: str):
        super().__init__(f"aggregator {address[0]}:{address[1]} lost job {job}: {reason}")
        self.address, self.job, self.reason = address, job, reason


LIVENESS_SILENCE = 3.0  # seconds without a result before a round asks its aggregators
PROBE_TIMEOUT = 1.0  # how long a liveness probe waits for its reply


def probe_job(address: Address, job: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why ``job`` cannot go on at ``address`` (no reply, or the job is not registered), or
    None: the aggregator answers and holds the job. The probe is one small control request
    (STATS naming the job), retried within ``timeout``."""
    try:
        reply = control_request(address, Kind.STATS_REQUEST, job, timeout=timeout,
                                retry_every=timeout / 4)  # fmt: skip
    except ControlError as error:
        if error.code == "no_reply":
            return f"no reply to a liveness probe in {timeout:g} s"
        if error.code == "unknown_job":
            return "the job is not registered there (the aggregator restarted?)"
        return None  # it answers; whatever it refused, it is alive
    jobs = reply.get("jobs")
    if isinstance(jobs, dict) and str(job) not in jobs and job not in jobs:
        return "the job is not registered there (the aggregator restarted?)"
    return None


def control_request(
    address: Address, kind: Kind, job: int, body: dict | None = None, *, timeout: float = 5.0,
    retry_every: float = 0.2,
) -> dict:  # fmt: skip
    """Send a control request (retried) and return the reply's JSON body; ERROR raises."""
    address = resolve(address)
    request = next(_request_ids)
    data = Header(kind, job, chunk=request).pack() + (json.dumps(body).encode() if body else b"")
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sock.sendto(data, address)
            wait = min(retry_every, deadline - time.monotonic())
            reply = _await_reply(sock, address, job, request, wait)
            if reply is not None:
                header, payload = reply
                answer = json.loads(payload) if payload else {}
                if header.kind is Kind.ERROR:
                    code = str(answer.get("code"))
                    message = f"{address[0]}:{address[1]}: {code}: {answer.get('message')}"
                    raise ControlError(message, code)
                return answer
    raise ControlError(
        f"no reply to {kind.name} for job {job} from {address[0]}:{address[1]} in {timeout} s"
    )


def _await_reply(sock, address, job, request, wait: float):
    sock.settimeout(wait)
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            data, source = sock.recvfrom(1 << 16)
        except (TimeoutError, ConnectionRefusedError):
            return None
        try:
            header = parse_header(data)
        except MalformedPacket:
            continue
        if source[:2] == address and header.job == job and header.chunk == request:
            return header, data[HEADER_SIZE:]
    return None


def register_job(address: Address, spec: JobSpec, timeout: float = 5.0) -> dict:
    return control_request(address, Kind.REGISTER, spec.job, spec.to_json(), timeout=timeout)


def teardown_job(address: Address, job: int, timeout: float = 5.0) -> dict:
    """Remove a job; an already removed one is fine (the first reply may have been lost)."""
    try:
        return control_request(address, Kind.TEARDOWN, job, timeout=timeout)
    except ControlError as error:
        if error.code == "unknown_job":
            return {"job": job}
        raise


def aggregator_stats(address: Address, timeout: float = 5.0) -> dict:
    return control_request(address, Kind.STATS_REQUEST, 0, timeout=timeout)


class UdpTransport:
    """Runs transfers to completion over one socket with real timers; results may also arrive
    on ``group_sockets`` (the jobs' multicast groups).

    Liveness: after ``silence`` seconds without a result, ``watchdog(addresses)`` is called
    with the aggregators still owing results (default: ``probe_job`` each, raising
    ``AggregatorLost`` for one that is gone or lost the job), and again after every further
    ``silence`` seconds; whatever it raises ends the run. A silence it lets pass (a slow peer,
    a busy aggregator) goes on up to ``wait_limit``."""

    def __init__(self, sock: socket.socket, wait_limit: float = 60.0, group_sockets: Sequence = (),
                 *, silence: float = LIVENESS_SILENCE, watchdog=None):  # fmt: skip
        self.sock = sock
        self.wait_limit = wait_limit  # longest silence before a run fails, whatever the policy
        self.silence = silence
        self.watchdog = watchdog  # None: probe the aggregators (``probe_jobs``)
        # Groups first: when they are joined, nearly every result arrives there.
        self._receivers = [*group_sockets, sock]
        self._header = bytearray(HEADER_SIZE)
        self._scratch = bytearray(1 << 16)
        self._poll = select.poll()
        for receiver in self._receivers:
            self._poll.register(receiver, select.POLLIN)

    def run(self, pairs: Sequence[tuple[JobHandle, Transfer]], work=None) -> None:
        """Run the transfers to completion; ``work`` (``dataplane.collective.StreamedSum``),
        if given, gets a step between batches of packets while it has any, and may release
        chunks."""
        if pump.serves(pairs):
            self._run_pumped(pairs, work)
            return
        routes = {(job.address, t.job): t for job, t in pairs}
        peers = {id(t): job.address for job, t in pairs}
        now = time.monotonic()
        for job, transfer in pairs:
            for chunk in transfer.start(now):
                self._send(transfer, chunk, job.address)
        pending = [t for _, t in pairs if not t.done]
        next_check = now
        last_progress = now
        alive = _Liveness(self, pairs)
        while pending:
            if any([self._receive_one(r, routes, peers) for r in self._receivers]):
                last_progress = time.monotonic()
            elif work is None or not work.pending:
                self._wait(pending, last_progress)
            now = time.monotonic()
            alive.check(pending, last_progress, now)
            if work is not None and work.pending:
                for transfer, chunk in work.step(now):
                    self._send(transfer, chunk, peers[id(transfer)])
            if now >= next_check:
                for transfer in pending:
                    for chunk in transfer.expired(now):
                        self._send(transfer, chunk, peers[id(transfer)])
                deadlines = [d for t in pending if (d := t.next_deadline()) is not None]
                next_check = min(deadlines, default=now + 0.01)
            pending = [t for t in pending if not t.done]

    def _run_pumped(self, pairs: Sequence[tuple[JobHandle, Transfer]], work=None) -> None:
        """``run`` with the native pump (``net/pump.py``) moving the datagrams in batches: the
        same transfers make the same decisions, per batch of results instead of per datagram."""
        routes = pump.Routes(pairs)
        transfers = routes.transfers
        fds = [receiver.fileno() for receiver in self._receivers]
        fd = self.sock.fileno()
        now = time.monotonic()
        routes.send(fd, [(r, c) for r, t in enumerate(transfers) for c in t.start(now)])
        pending = [r for r, t in enumerate(transfers) if not t.done]
        next_check = last_progress = now
        route_of = {id(t): r for r, t in enumerate(transfers)}
        alive = _Liveness(self, pairs)
        while pending:
            busy = work is not None and work.pending  # then only take what is queued
            events = routes.receive(fds, 0.0 if busy else min(max(0.0, next_check - now), 0.05))
            now = time.monotonic()
            out = []
            if busy:
                out += [(route_of[id(t)], c) for t, c in work.step(now)]
            for r, chunk, contributors, flags, event in events:
                transfer = transfers[r]
                if event == pump.PLACED:
                    last_progress = now
                    out += [(r, c) for c in transfer.accept(chunk, contributors, flags, 0, now)]
                elif event == pump.PROGRESS or event == pump.HOLES:  # a packet of several
                    last_progress = now
                    holes = event == pump.HOLES
                    out += [(r, c) for c in transfer.stream.on_progress(chunk, now, holes)]
                elif event == pump.REPEAT:
                    transfer.stream.stats.duplicate_results += 1
                else:
                    transfer.stream.on_stale(chunk)
            if now >= next_check:
                for r in pending:
                    out += [(r, c) for c in transfers[r].expired(now)]
                deadlines = [d for r in pending if (d := transfers[r].next_deadline()) is not None]
                next_check = min(deadlines, default=now + 0.01)
            routes.send(fd, out)
            alive.check([transfers[r] for r in pending], last_progress, now)
            if now - last_progress > self.wait_limit:
                waiting = ", ".join(transfers[r].stream.what for r in pending)
                raise TimeoutError(f"no result from {waiting} for {self.wait_limit:.0f} s")
            pending = [r for r in pending if not transfers[r].done]

    def _receive_one(self, sock: socket.socket, routes, peers) -> bool:
        """Handle one datagram if one is queued; True if it was a result we waited for."""
        try:
            size, source = sock.recvfrom_into(self._header, HEADER_SIZE, _PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        except ConnectionRefusedError:  # ICMP: nobody listens at the aggregator's port (yet)
            return False
        try:
            header = parse_header(self._header) if size >= HEADER_SIZE else None
        except MalformedPacket:
            header = None
        transfer = None if header is None else routes.get((source[:2], header.job))
        target = None
        if transfer is not None:
            if header.kind is Kind.STALE:
                self._discard(sock)
                transfer.on_stale(header)
                return False
            target = transfer.destination(header, size - HEADER_SIZE)
        if target is None:
            self._discard(sock)
            return False
        received, _, flags, _ = sock.recvmsg_into([self._header, target])
        if flags & socket.MSG_TRUNC or received != size:
            return False  # raced with another datagram; the timer resends
        for chunk in transfer.on_result(header, size - HEADER_SIZE, time.monotonic()):
            self._send(transfer, chunk, peers[id(transfer)])
        return True

    def _discard(self, sock: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError, ConnectionRefusedError):
            sock.recv_into(self._scratch)

    def _wait(self, pending: list[Transfer], last_progress: float) -> None:
        now = time.monotonic()
        if now - last_progress > self.wait_limit:
            waiting = ", ".join(t.stream.what for t in pending)
            raise TimeoutError(f"no result from {waiting} for {self.wait_limit:.0f} s")
        deadlines = [d for t in pending if (d := t.next_deadline()) is not None]
        wait = max(0.0, min(deadlines, default=now + 0.05) - now)
        self._poll.poll(min(wait, 0.05) * 1000)

    def _send(self, transfer: Transfer, chunk: int, address: Address) -> None:
        header, payload = transfer.packet(chunk)
        for attempt in range(2):
            try:
                self.sock.sendmsg([header, payload], (), 0, address)
                return
            except BlockingIOError:
                if attempt == 0:
                    select.select([], [self.sock], [], 0.02)
            except ConnectionRefusedError:
                return  # the timer resends


def probe_jobs(jobs: Sequence[tuple[Address, int]]) -> None:
    """Raise ``AggregatorLost`` for the first (aggregator, job) that cannot go on."""
    for address, job in jobs:
        reason = probe_job(address, job)
        if reason is not None:
            raise AggregatorLost(address, job, reason)


class _Liveness:
    """One run's silence clock: asks the transport's watchdog about the aggregators that owe
    results once every ``silence`` seconds without one."""

    def __init__(self, transport: UdpTransport, pairs):
        self.transport = transport
        self.peers = {id(t): (job.address, t.job) for job, t in pairs}
        self.asked = float("-inf")

    def check(self, pending: Sequence[Transfer], last_progress: float, now: float) -> None:
        silence = self.transport.silence
        if not silence or now - max(last_progress, self.asked) < silence:
            return
        owing = list(dict.fromkeys(self.peers[id(t)] for t in pending))
        (self.transport.watchdog or probe_jobs)(owing)
        self.asked = time.monotonic()


class SwitchClient:
    """One worker's connection to one or more aggregators (switches or servers) for a job.

    Every worker creates one (binding its socket), the addresses are gathered (e.g. with
    ``torch.distributed.all_gather_object(client.address)``), one worker calls ``register``,
    and then all call ``allreduce`` on the same sequence of tensors.
    """

    def __init__(
        self,
        aggregators: Sequence[Address | str],
        *,
        job: int,
        worker: int,
        workers: int,
        codec: str = "bfp",
        codec_options: dict | None = None,
        slots: int = 32,
        elements: int | None = None,
        bind: Address = ("127.0.0.1", 0),
        seed: int = 0,
        rank: int | None = None,
        policy: RetryPolicy | None = None,
        multicast: bool = False,
        mtu: int | None = None,
        silence: float = LIVENESS_SILENCE,
    ):
        self.aggregators = [_address(a) for a in aggregators]
        self.job, self.worker, self.workers = job, worker, workers
        self.codec_name, self.codec_options = codec, dict(codec_options or {})
        self.codec = make_codec(codec, workers=workers, **self.codec_options)
        self.format: WireFormat = wire_format(self.codec, self.codec_options, seed)
        self.slots = slots
        if self.format.lanes:
            bits = max(self.format.in_bits, self.format.out_bits)
            self.elements, self.segments = packet_geometry(
                bits, elements or lanes_fitting(bits), mtu
            )
        else:  # one serialized payload per packet, of at most this many coordinates
            self.elements, self.segments = elements or PAYLOAD_ELEMENTS, 1
        self.sock = open_socket(bind)
        self.address = local_address(self.sock)
        if multicast and self.sock.family != socket.AF_INET:
            raise ValueError("multicast results need IPv4 aggregators")
        self.multicast = multicast
        self.group_sockets = []
        self.silence = silence
        if self.segments > 1:  # the switch answers a chunk in one GSO send: read it as one
            enable_gro(self.sock)
        self.transport = self._connect()
        self.collective = Collective(self.format, self._handles(), self.transport.run,
                                     policy=policy, streaming=True)  # fmt: skip
        self.registered: tuple[tuple, dict] | None = None  # what ``register`` was given
        # ``allreduce``'s round: the codec's per-worker randomness follows the global rank (the
        # job's worker id is local to an aggregator; they differ under a hierarchy of switches)
        self.seed, self.rank = seed, worker if rank is None else rank
        self._steps = itertools.count()

    def _connect(self) -> UdpTransport:
        """The transport to ``self.aggregators``, with their multicast groups joined."""
        try:
            if self.multicast:
                for address in self.aggregators:
                    group = multicast_group(address, self.job)
                    self.group_sockets.append(open_group_socket(group, self.address[0]))
                    if self.segments > 1:
                        enable_gro(self.group_sockets[-1])
        except OSError:
            self.close()
            raise
        watchdog = getattr(self, "transport", None) and self.transport.watchdog
        return UdpTransport(self.sock, group_sockets=self.group_sockets, silence=self.silence,
                            watchdog=watchdog or None)  # fmt: skip

    def _handles(self) -> list[JobHandle]:
        geometry = (self.slots, self.elements, self.workers, self.segments)
        return [JobHandle(a, self.job, self.worker, *geometry) for a in self.aggregators]

    def relocate(self, aggregators: Sequence[Address | str]) -> None:
        """The job was registered afresh (an aggregator restarted, or a standby took over):
        talk to ``aggregators`` from now on, with every stream numbered from chunk 0 again."""
        for sock in self.group_sockets:
            sock.close()
        self.group_sockets = []
        self.aggregators = [_address(a) for a in aggregators]
        self.transport = self._connect()
        self.collective.restart(self._handles(), self.transport.run)

    def job_spec(
        self, worker_addresses: Sequence[Address], aggregator: Address | None = None, **extra
    ) -> JobSpec:
        """The job's registration; for ``aggregator``, it names the multicast group the
        workers joined (when they multicast)."""
        addresses = tuple(resolve(a) for a in worker_addresses)
        if self.multicast and aggregator is not None:
            extra.setdefault("group", multicast_group(resolve(aggregator), self.job))
        if self.segments > 1 and extra.get("quorum"):
            raise ValueError(
                "partial aggregation needs one packet per chunk (no mtu): the "
                "packets of a chunk could complete with different quorums"
            )
        slots = aggregator_slots(self.slots, self.segments)
        return JobSpec(self.job, addresses, slots, self.elements, self.format.op, **extra)

    def register(self, worker_addresses: Sequence[Address], **extra) -> None:
        """Register this job on every aggregator (call from one worker)."""
        self.registered = (tuple(worker_addresses), dict(extra))
        for address in self.aggregators:
            register_job(address, self.job_spec(worker_addresses, address, **extra))

    def register_afresh(self, aggregators: Sequence[Address], worker_addresses=None,
                        **extra) -> None:  # fmt: skip
        """Register the job with empty slots on ``aggregators`` (its chunks numbered from 0
        again), replacing whatever job of this id they hold (a stale one of this job's
        earlier life). Defaults: the addresses and options of the last ``register``."""
        if worker_addresses is None:
            if self.registered is None:
                raise RuntimeError(f"job {self.job} was never registered from this worker")
            worker_addresses, extra = self.registered
        for address in aggregators:
            address = _address(address)
            teardown_job(address, self.job)
            register_job(address, self.job_spec(worker_addresses, address, **extra))

    def teardown(self) -> None:
        for address in self.aggregators:
            teardown_job(address, self.job)

    def allreduce(
        self, tensor: torch.Tensor, key: Hashable = None, step: int | None = None
    ) -> torch.Tensor:
        """The average of ``tensor`` over all workers (float32, same shape): one codec round
        with this client's codec; ``step`` counts this client's calls unless given."""
        step = next(self._steps) if step is None else step
        flat = tensor.detach().reshape(-1).to(torch.float32)
        size = self.collective.partition_size()
        average = CodecRound(self.codec, self.seed, size).run(
            flat, self.collective, worker=self.rank, key=key, step=step
        )
        return average.view(tensor.shape)

    def stats(self) -> dict:
        return {f"{a[0]}:{a[1]}/{j}": s.as_dict() for (a, j), s in self.collective.stats.items()}

    def close(self) -> None:
        for sock in (self.sock, *self.group_sockets):
            sock.close()

    def __enter__(self) -> SwitchClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _address(value: Address | str) -> Address:
    from .udp import parse_bind

    return parse_bind(value, "aggregator") if isinstance(value, str) else resolve(value)

"""The worker client: real sockets and timers around ``dataplane.Collective`` and ``Transfer``.

``SwitchClient(aggregators, wire, job=..., worker=..., workers=...)`` is one worker's connection
to a job of one wire format: ``collective`` is the job's ``codecs.round.Reducer`` (what the
training integration, ``sync.service``, runs its Session's rounds through), and
``allreduce(tensor, codec)`` is one round of the codec that wire format is of, for tools and
tests. It talks to switches and parameter
servers alike (the server decodes for codecs a switch cannot sum).

Receive path: peek a datagram's header, ask the transfer where its payload belongs, and receive
it straight there (``recvmsg_into`` on a memoryview slice of the output); sends gather a header
and a view of the encoded tensor (``sendmsg``), so no payload is copied in Python.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import select
import socket
import time
from collections.abc import Hashable, Sequence

import torch

from ..codecs.base import Codec
from ..codecs.round import CodecRound
from ..dataplane import authentication, bounded_json
from ..dataplane.codec_wire import WireFormat
from ..dataplane.collective import Collective, JobHandle
from ..dataplane.geometry import aggregator_slots, lanes_fitting, packet_geometry, window_slots
from ..dataplane.jobspec import Address, JobSpec
from ..dataplane.packet import (
    HEADER_SIZE,
    MAX_DATAGRAM,
    MAX_PAYLOAD,
    SIGNED,
    Header,
    Kind,
    MalformedPacket,
    parse_header,
)
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


def probe_job(address: Address, job: int, timeout: float = PROBE_TIMEOUT,
              key: bytes | None = None) -> str | None:  # fmt: skip
    """Why ``job`` cannot go on at ``address`` (no reply, or the job is not registered), or
    None: the aggregator answers and holds the job. The probe is one small control request
    (the job's STATS, signed with its ``key`` when it has one), retried within ``timeout``."""
    try:
        control_request(address, Kind.STATS_REQUEST, job, {"job": job}, timeout=timeout,
                        retry_every=timeout / 4, key=key, pad=UNSIGNED_PAD)  # fmt: skip
    except ControlError as error:
        if error.code == "no_reply":
            return f"no reply to a liveness probe in {timeout:g} s"
        # An aggregator that cannot verify the job's key no longer holds the job.
        if error.code == "unknown_job" or (key is not None and error.code == "unauthenticated"):
            return "the job is not registered there (the aggregator restarted?)"
        return None  # it answers; whatever it refused, it is alive
    return None


def control_request(
    address: Address, kind: Kind, job: int, body: dict | None = None, *, timeout: float = 5.0,
    retry_every: float = 0.2, key: bytes | None = None, pad: int = 0,
) -> dict:  # fmt: skip
    """Send a control request (retried) and return the reply's JSON body; ERROR raises.

    With ``key`` (an admission secret or the job's key) each attempt is signed afresh (a new
    timestamp and nonce: the aggregator refuses replays) and only a reply signed with the same
    key counts. Without it the request is padded to ``pad`` bytes, since an aggregator answers
    an unsigned request with no more bytes than it sent, and grown when it asks for more."""
    address = resolve(address)
    request = int.from_bytes(os.urandom(8), "little")  # unguessable: spoofed replies miss it
    flags = SIGNED if key is not None else 0
    message = Header(kind, job, flags=flags, chunk=request).pack()
    message += json.dumps(body).encode() if body else b""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if key is not None:
                data = authentication.sign(message, key, time.time(), address[1])
            else:
                data = message + b" " * max(0, pad - len(message))
            sock.sendto(data, address)
            wait = min(retry_every, deadline - time.monotonic())
            reply = _await_reply(sock, address, job, request, wait, key)
            if reply is None:
                continue
            header, payload = reply
            answer = bounded_json.loads(payload) if payload else {}
            if header.kind is Kind.ERROR:
                code = str(answer.get("code", "refused"))
                if code == "reply_too_large" and key is None and answer.get("need", 0) > pad:
                    pad = min(int(answer["need"]), MAX_DATAGRAM)
                    continue
                message_text = answer.get("message", "(an unsigned request hears no more)")
                raise ControlError(f"{address[0]}:{address[1]}: {code}: {message_text}", code)
            return answer
    raise ControlError(
        f"no reply to {kind.name} for job {job} from {address[0]}:{address[1]} in {timeout} s"
    )


def _await_reply(sock, address, job, request, wait: float, key: bytes | None):
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
        if source[:2] != address or header.job != job or header.chunk != request:
            continue
        if key is None:
            return header, data[HEADER_SIZE:]
        if header.flags & SIGNED and authentication.verifies(data, key, address[1]):
            return header, data[HEADER_SIZE : -authentication.TRAILER_SIZE]
        # Not signed by our key: a spoof, or an aggregator that could not verify us (it
        # echoed our unguessable request id, so it saw the request). It signs every refusal
        # of a request whose signature verified (a replay, say), so an unsigned one names a
        # cause that lies before that check: say the cause it gave.
        if header.kind is Kind.ERROR and not header.flags & SIGNED:
            raise _unsigned_refusal(address, data[HEADER_SIZE:])
    return None


def _unsigned_refusal(address: Address, payload: bytes) -> ControlError:
    """The ControlError of an unsigned ERROR answering our signed request."""
    try:
        answer = bounded_json.loads(payload) if payload else {}
    except bounded_json.JsonRefused:
        answer = {}
    code = str(answer.get("code", "unauthenticated")) if isinstance(answer, dict) else ""
    code = code if code.isidentifier() and len(code) <= 40 else "unauthenticated"
    where = f"{address[0]}:{address[1]}"
    if code == "unauthenticated":
        return ControlError(f"{where}: refused our signed request: unauthenticated (does it "
                            "hold this admission secret, or this job's key?)", code)  # fmt: skip
    text = str(answer.get("message", ""))[:400]
    return ControlError(f"{where}: refused our signed request: {code}: {text}", code)


def register_job(
    address: Address, spec: JobSpec, timeout: float = 30.0, admission: bytes | None = None
) -> dict:
    """Register ``spec`` (signed with the admission secret, given or from the environment:
    ``client_secret``); its key travels wrapped under that secret, or in clear without one.
    The timeout is long because a server's first decode-sum-encode job imports torch there
    (seconds on a loaded host) before it answers."""
    admission = client_secret() if admission is None else admission or None
    body = spec.to_json()
    if spec.key is not None:
        if admission is not None:
            nonce = os.urandom(16)
            wrapped = authentication.wrap_key(spec.key, admission, nonce)
            body["key"] = {"nonce": nonce.hex(), "wrapped": wrapped.hex()}
        else:
            body["key"] = {"clear": spec.key.hex()}
    return control_request(address, Kind.REGISTER, spec.job, body, timeout=timeout, key=admission)


def teardown_job(
    address: Address, job: int, timeout: float = 5.0, key: bytes | None = None
) -> dict:
    """Remove a job (with its key, if it has one); a retry gets the same final counters, and
    an already removed one is fine."""
    try:
        return control_request(address, Kind.TEARDOWN, job, timeout=timeout, key=key,
                               pad=UNSIGNED_PAD)  # fmt: skip
    except ControlError as error:
        if error.code == "unknown_job":
            return {"job": job}
        raise


UNSIGNED_PAD = 2048  # bytes of an unsigned STATS or TEARDOWN: room for a reply of ~20 counters


def aggregator_stats(address: Address, timeout: float = 5.0, secret: bytes | None = None) -> dict:
    """The aggregator's counters and every job's (with admission secrets: the secret's jobs),
    gathered over STATS's pages; ``secret`` defaults to ``client_secret()``."""
    secret = client_secret() if secret is None else secret or None

    def page(number: int) -> dict:
        body = {"page": number} if number else None
        return control_request(address, Kind.STATS_REQUEST, 0, body, timeout=timeout,
                               key=secret, pad=UNSIGNED_PAD)  # fmt: skip

    first = page(0)
    for number in range(1, int(first.get("pages", 1))):
        first["jobs"].update(page(number)["jobs"])
    return first


def job_stats(address: Address, job: int, key: bytes | None = None, timeout: float = 5.0) -> dict:
    """One job's counters, read with its key."""
    reply = control_request(address, Kind.STATS_REQUEST, job, {"job": job}, timeout=timeout,
                            key=key, pad=UNSIGNED_PAD)  # fmt: skip
    return reply["stats"]


def client_secret() -> bytes | None:
    """The admission secret this process signs registrations with: ``GRADSUM_ADMISSION_SECRET``
    or the first secret of ``GRADSUM_ADMISSION_FILE``; None without either."""
    secrets = authentication.load_secrets()
    return next(iter(secrets.values()), None)


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
        self._tag = bytearray(authentication.TAG_SIZE)
        self._scratch = bytearray(1 << 16)
        self._poll = select.poll()
        for receiver in self._receivers:
            self._poll.register(receiver, select.POLLIN)

    def run(self, pairs: Sequence[tuple[JobHandle, Transfer]], work=None) -> None:
        """Run the transfers to completion; ``work`` (``dataplane.collective.StreamedSum`` or
        ``CodedSum``), if given, gets a step between batches of packets while it has any, and
        may release chunks."""
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
            i, count = 0, len(events)
            while i < count:
                r, chunk, _, _, event = events[i]
                transfer = transfers[r]
                i += 1
                if event == pump.PLACED:  # with the results of the same route that follow it
                    last_progress, run = now, i - 1
                    while i < count and events[i][4] == pump.PLACED and events[i][0] == r:
                        i += 1
                    out += [(r, c) for c in transfer.accept_placed(events[run:i], now)]
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
        tag = transfer.tag_size if transfer is not None else 0
        if transfer is not None:
            if header.kind is Kind.STALE:
                received = sock.recv_into(self._scratch)
                raw = memoryview(self._scratch)[:received]
                if transfer.verifies(raw[:HEADER_SIZE], raw[HEADER_SIZE:received - tag],
                                     raw[received - tag:]):  # fmt: skip
                    transfer.on_stale(header)
                return False
            target = transfer.destination(header, size - HEADER_SIZE - tag)
        if target is None:
            self._discard(sock)
            return False
        parts = [self._header, target, self._tag] if tag else [self._header, target]
        received, _, flags, _ = sock.recvmsg_into(parts)
        if flags & socket.MSG_TRUNC or received != size:
            return False  # raced with another datagram; the timer resends
        if tag and not transfer.verifies(self._header, target, self._tag):
            return False  # a forgery landed in the result's place: the real one overwrites it
        for chunk in transfer.on_result(header, size - HEADER_SIZE - tag, time.monotonic()):
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
        parts = [header, payload]
        if transfer.mac_key is not None:
            parts.append(transfer.tag(header, payload))
        for attempt in range(2):
            try:
                self.sock.sendmsg(parts, (), 0, address)
                return
            except BlockingIOError:
                if attempt == 0:
                    select.select([], [self.sock], [], 0.02)
            except ConnectionRefusedError:
                return  # the timer resends


def probe_jobs(jobs: Sequence[tuple[Address, int]], key: bytes | None = None) -> None:
    """Raise ``AggregatorLost`` for the first (aggregator, job) that cannot go on; ``key``:
    the jobs' key (a job's STATS is signed with it)."""
    for address, job in jobs:
        reason = probe_job(address, job, key=key)
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
        wire: WireFormat,
        *,
        job: int,
        worker: int,
        workers: int,
        slots: int = 32,
        window_bytes: int | None = None,
        elements: int | None = None,
        bind: Address = ("127.0.0.1", 0),
        policy: RetryPolicy | None = None,
        multicast: bool = False,
        mtu: int | None = None,
        silence: float = LIVENESS_SILENCE,
        watchdog=None,
        key: bytes | None = None,
        admission: bytes | None = None,
        integrity: str = "token",
    ):
        """``wire``: how the job's payloads travel (``dataplane.codec_wire.wire_format`` of the
        codec its rounds run); ``watchdog``: what the transport asks after ``silence`` seconds
        without a result (default: probe the aggregators)."""
        self.aggregators = [_address(a) for a in aggregators]
        # The job's key, the same on every worker (``sync.service`` agrees on one over
        # torch.distributed): it signs teardown and statistics. None: a protocol-1 job.
        self.key = key
        self.admission = admission  # registration's admission secret (None: client_secret())
        self.integrity = integrity  # "token", or "mac": a keyed MAC on every packet too
        if integrity == "mac" and key is None:
            raise ValueError("integrity 'mac' needs the job's key")
        room = MAX_PAYLOAD - (authentication.TAG_SIZE if integrity == "mac" else 0)
        self.job, self.worker, self.workers = job, worker, workers
        self.format = wire
        self.slots = slots
        if self.format.lanes:
            bits = max(self.format.in_bits, self.format.out_bits)
            self.elements, self.segments = packet_geometry(
                bits, elements or lanes_fitting(bits, room), mtu
            )
        else:  # one serialized payload per packet, of at most this many coordinates
            self.elements, self.segments = elements or PAYLOAD_ELEMENTS, 1
        if window_bytes is not None:  # at most ``slots`` chunks, as many as fit the bytes
            bits = max(self.format.in_bits, self.format.out_bits) if self.format.lanes else 32
            self.slots = window_slots(
                window_bytes, self.elements * self.segments, self.segments, bits, slots
            )
        self.sock = open_socket(bind)
        self.address = local_address(self.sock)
        if multicast and self.sock.family != socket.AF_INET:
            raise ValueError("multicast results need IPv4 aggregators")
        self.multicast = multicast
        self.group_sockets = []
        self.silence = silence
        self._watchdog = watchdog or functools.partial(probe_jobs, key=self.key)
        if self.segments > 1:  # the switch answers a chunk in one GSO send: read it as one
            enable_gro(self.sock)
        self.transport = self._connect()
        self.collective = Collective(self.format, self._handles(), self.transport.run,
                                     policy=policy, streaming=True)  # fmt: skip
        self.registered: tuple[tuple, dict] | None = None  # what ``register`` was given
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
        return UdpTransport(self.sock, group_sockets=self.group_sockets, silence=self.silence,
                            watchdog=self._watchdog)  # fmt: skip

    def _handles(self) -> list[JobHandle]:
        geometry = (self.slots, self.elements, self.workers, self.segments)
        token = 0 if self.key is None else authentication.data_token(self.key)
        mac_key = authentication.packet_mac_key(self.key) if self.integrity == "mac" else None
        return [JobHandle(a, self.job, self.worker, *geometry, token, mac_key)
                for a in self.aggregators]  # fmt: skip

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
        return JobSpec(self.job, addresses, slots, self.elements, self.format.op, key=self.key,
                       integrity=self.integrity, **extra)  # fmt: skip

    def register(self, worker_addresses: Sequence[Address], **extra) -> None:
        """Register this job on every aggregator (call from one worker)."""
        self.registered = (tuple(worker_addresses), dict(extra))
        for address in self.aggregators:
            spec = self.job_spec(worker_addresses, address, **extra)
            register_job(address, spec, admission=self.admission)

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
            try:
                teardown_job(address, self.job, key=self.key)
            except ControlError as error:
                # An aggregator that never held the job (a standby, or one that restarted)
                # cannot verify its key; one that holds another job of this id under another
                # key refuses the registration below, saying so.
                if error.code != "unauthenticated":
                    raise
            spec = self.job_spec(worker_addresses, address, **extra)
            register_job(address, spec, admission=self.admission)

    def teardown(self) -> None:
        for address in self.aggregators:
            teardown_job(address, self.job, key=self.key)

    def allreduce(self, tensor: torch.Tensor, codec: Codec, *, seed: int = 0,
                  rank: int | None = None, key: Hashable = None,
                  step: int | None = None) -> torch.Tensor:  # fmt: skip
        """The average of ``tensor`` over all workers (float32, same shape): one round of
        ``codec``, the codec the job's wire format is of, for tools and tests. ``rank``: the
        worker's global rank, which its randomness follows (the job's worker id is local to an
        aggregator; they differ under a hierarchy of switches); ``step`` counts this client's
        calls unless given."""
        step = next(self._steps) if step is None else step
        flat = tensor.detach().reshape(-1).to(torch.float32)
        size = self.collective.partition_size()
        worker = self.worker if rank is None else rank
        average = CodecRound(codec, seed, size).run(flat, self.collective, worker=worker,
                                                    key=key, step=step)  # fmt: skip
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

"""The aggregator daemon loop: a UDP socket around an ``DataPlane`` (all logic lives there).

Receives into one reused buffer, hands the view to the data plane, sends each action's header and
payload gathered (``sendmsg``, no copy), injects seeded loss both ways if asked, completes quorum
slots at their deadlines, and stops within a fraction of a second of ``stop`` being set. The
packets of native jobs (``dataplane.native_pool``) are received, aggregated and answered by the C
loop, which injects loss itself and hands every other datagram back here; injected duplication
or reordering keeps everything here.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from ..dataplane import native_pool
from ..dataplane.actions import Send
from ..dataplane.plane import DataPlane
from .loss import Impairment
from .udp import enable_gro, receive_datagrams

POLL_CEILING = 0.2  # seconds between checks of the stop flag when idle
SEND_WAIT_MS = 20  # how long a full send buffer may stall one send before it counts as lost


@dataclass
class DaemonStats:
    received: int = 0
    sent: int = 0
    send_failures: int = 0
    handler_errors: int = 0
    started: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict:
        return {
            "received": self.received,
            "sent": self.sent,
            "send_failures": self.send_failures,
            "handler_errors": self.handler_errors,
            "uptime_s": round(time.monotonic() - self.started, 3),
        }


class Daemon:
    def __init__(
        self,
        aggregator: DataPlane,
        sock: socket.socket,
        *,
        drop_rate: float = 0.0,
        duplicate_rate: float = 0.0,
        reorder_rate: float = 0.0,
        seed: int = 0,
        clock=time.monotonic,
    ):
        self.aggregator = aggregator
        self.sock = sock
        rates = (drop_rate, duplicate_rate, reorder_rate)
        self.impair_in = Impairment(*rates, seed=seed)
        self.impair_out = Impairment(*rates, seed=seed + 1)
        self._native_loss = native_pool.Loss(drop_rate, drop_rate, seed=seed + 2)
        self.clock = clock
        self.stop = threading.Event()
        self.stats = DaemonStats()
        self.last_turn = time.monotonic()
        self._buffer = bytearray(1 << 16)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        enable_gro(sock)  # both loops split joined datagrams

    def serve(self) -> None:
        """Serve until ``stop``. Nothing a datagram does ends the loop: the data plane drops
        what breaks a handler, and whatever still escapes (a send, the native loop) is counted
        as a handler error here and the loop goes on."""
        while not self.stop.is_set():
            self.last_turn = time.monotonic()  # what /health reads (net/metrics.py)
            try:
                self._serve_once()
            except Exception:  # the daemon outlives any one datagram
                self.stats.handler_errors += 1

    def _serve_once(self) -> None:
        view = memoryview(self._buffer)
        for _ in range(64):  # then back to the stop flag
            pools = self._native_pools()
            if pools:
                if not self._serve_native(pools, view):
                    return
                continue
            try:
                datagrams, source = receive_datagrams(self.sock, self._buffer)
            except (BlockingIOError, InterruptedError):
                self._idle()
                return
            except ConnectionRefusedError:  # ICMP from an earlier send to a closed port
                continue
            for datagram in datagrams:
                self._on_datagram(view[datagram], source[:2])

    def _on_datagram(self, data: memoryview, source) -> None:
        self.stats.received += 1
        packet = (data, source)
        arrived = self.impair_in(packet, _keep_received) if self.impair_in.active else [packet]
        for data, sender in arrived:
            self._perform(self.aggregator.on_datagram(data, sender, self.clock()))

    def _native_pools(self) -> list:
        """The C pools of the jobs registered now, unless duplicates or reordering are injected
        (the C loop injects loss only)."""
        if self.impair_in.duplicate or self.impair_in.reorder:
            return []
        return self.aggregator.native_pools()

    def _serve_native(self, pools: list, view: memoryview) -> bool:
        """Let the C loop handle the native jobs' packets; Python takes whatever it leaves.
        False when it found nothing to do (and waited)."""
        fd = self.sock.fileno()
        loss = self._native_loss
        before = loss.dropped_in
        handled, sent, failures, size, source = native_pool.serve(fd, pools, self._buffer, loss)
        self.stats.received += handled + (1 if size else 0) + loss.dropped_in - before
        self.stats.sent += sent
        self.stats.send_failures += failures
        if handled:
            self.aggregator.count("datagrams", handled)
        if size:
            self._perform(self.aggregator.on_datagram(view[:size], source, self.clock()))
        elif not handled:
            self._idle()
            return False
        return True

    def _idle(self) -> None:
        now = self.clock()
        deadline = self.aggregator.next_deadline()
        wait = POLL_CEILING if deadline is None else max(0.0, min(deadline - now, POLL_CEILING))
        self._poll.poll(wait * 1000)
        if deadline is not None and self.clock() >= deadline:
            self._perform(self.aggregator.on_tick(self.clock()))

    def _perform(self, actions: list) -> None:
        for action in actions:
            if type(action) is not Send:
                continue
            buffers = [action.header, action.payload] if len(action.payload) else [action.header]
            for destination in action.destinations:
                if not self.impair_out.active:
                    self._send(buffers, destination)
                    continue
                for out, to in self.impair_out((buffers, destination), _keep_sent):
                    self._send(out, to)

    def _send(self, buffers: list, destination) -> None:
        for attempt in range(2):
            try:
                self.sock.sendmsg(buffers, (), 0, destination)
                self.stats.sent += 1
                return
            except BlockingIOError:
                if attempt == 0:
                    select.select([], [self.sock], [], SEND_WAIT_MS / 1000)
            except OSError:  # unreachable destination: the worker's timer recovers
                break
        self.stats.send_failures += 1

    def statistics(self) -> dict:
        daemon = self.stats.as_dict()
        native = {"in": self._native_loss.dropped_in, "out": self._native_loss.dropped_out}
        for direction, impairment in (("in", self.impair_in), ("out", self.impair_out)):
            for name, count in impairment.counts.items():
                extra = native[direction] if name == "dropped" else 0
                daemon[f"injected_{name}_{direction}"] = count + extra
        return {"daemon": daemon, "memory": self.aggregator.memory_usage(),
                **self.aggregator.statistics()}  # fmt: skip

    def statistics_json(self) -> str:
        return json.dumps(self.statistics(), sort_keys=True)


def _keep_received(packet):
    data, source = packet
    return memoryview(bytes(data)), source  # the receive buffer is reused


def _keep_sent(item):
    buffers, destination = item
    return [bytes(b) for b in buffers], destination  # slot results change when reused

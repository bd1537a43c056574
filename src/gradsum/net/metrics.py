"""``--metrics-port``: a daemon's counters as Prometheus text (``/metrics``) and its liveness
(``/health``), over HTTP/1.0 from one background thread (an asyncio loop).

The exposition is small and fixed (the text format 0.0.4, no client library needed): jobs,
datagrams, drops by reason, retransmissions answered, control requests and errors, slot memory
and occupancy. Counters are read from the serving loop's dictionaries while it runs; a read
that races with a registration is simply retried.

The port faces whoever can reach the daemon, so the server is bounded: one thread whatever
the connections; at most ``MAX_CONNECTIONS`` open (a new one closes the oldest still waiting
for its request, so a crowd of half-open connections never locks out a scrape or ``/health``);
a connection that has not sent its request within ``IDLE_TIMEOUT`` seconds is closed; a
request head is at most ``MAX_REQUEST`` bytes; one GET per connection. A failed request
(reset, timed out, malformed) is one log line, at most ``LOG_LINES`` a minute, the rest
counted in the next line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from http import HTTPStatus

HEALTHY_LOOP_S = 5.0  # /health fails once the serving loop has not turned for this long
IDLE_TIMEOUT = 10.0  # seconds a connection may take to send its request
MAX_CONNECTIONS = 64  # open at once; a new one closes the oldest still waiting for a request
MAX_REQUEST = 8192  # bytes of a request's head (request line and headers)
LOG_LINES = 10  # failed requests logged per minute; the rest are counted


def exposition(stats: dict, labels: dict[str, str]) -> str:
    """Prometheus text of one daemon's ``Daemon.statistics()``."""
    base = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        lines.append(f"# HELP gradsum_{name} {help_text}")
        lines.append(f"# TYPE gradsum_{name} {kind}")
        for extra, value in samples:
            inner = ",".join([base] + [f'{k}="{v}"' for k, v in sorted(extra.items())])
            lines.append(f"gradsum_{name}{{{inner.strip(',')}}} {value:g}")

    daemon, aggregator, jobs = stats["daemon"], stats["aggregator"], stats["jobs"]
    memory = stats.get("memory", {})
    job_totals: dict[str, int] = {}
    for counters in jobs.values():
        for name, value in counters.items():
            job_totals[name] = job_totals.get(name, 0) + value
    metric("jobs", "gauge", "Jobs registered.", [({}, len(jobs))])
    metric("datagrams_received_total", "counter", "Datagrams received by the daemon.",
           [({}, daemon["received"])])  # fmt: skip
    metric("datagrams_sent_total", "counter", "Datagrams sent by the daemon.",
           [({}, daemon["sent"])])  # fmt: skip
    metric("send_failures_total", "counter", "Sends that failed (counted as lost).",
           [({}, daemon["send_failures"])])  # fmt: skip
    metric("handler_errors_total", "counter", "Exceptions the serving loop caught.",
           [({}, daemon.get("handler_errors", 0))])  # fmt: skip
    drops = [({"reason": k[len("dropped_"):], "scope": "aggregator"}, v)
             for k, v in sorted(aggregator.items()) if k.startswith("dropped_")]
    drops += [({"reason": k[len("dropped_"):], "scope": "job"}, v)
              for k, v in sorted(job_totals.items()) if k.startswith("dropped_")]  # fmt: skip
    metric("dropped_total", "counter", "Packets dropped, by reason.", drops)
    for name, help_text in (
        ("stored", "Contributions entered into slots."),
        ("completed", "Rounds completed."),
        ("retransmissions_answered", "Kept results re-sent to a worker that asked again."),
        ("stale", "STALE notices sent."),
    ):
        metric(f"{name}_total", "counter", help_text, [({}, job_totals.get(name, 0))])
    requests = [({"kind": k[len("control_"):]}, v) for k, v in sorted(aggregator.items())
                if k.startswith("control_") and not k.startswith("control_error_")]
    metric("control_requests_total", "counter", "Control requests, by kind.", requests)
    errors = [({"code": k[len("control_error_"):]}, v) for k, v in sorted(aggregator.items())
              if k.startswith("control_error_")]  # fmt: skip
    metric("control_errors_total", "counter", "ERROR replies, by code.", errors)
    used, limit = memory.get("used", 0), memory.get("limit", 0)
    metric("slot_memory_bytes", "gauge", "Slot memory held by jobs, and the limit.",
           [({"of": "used"}, used), ({"of": "limit"}, limit)])  # fmt: skip
    metric("slot_occupancy_ratio", "gauge", "Slot memory held over its limit.",
           [({}, used / limit if limit else 0.0)])  # fmt: skip
    metric("uptime_seconds", "gauge", "Seconds since the daemon started.",
           [({}, daemon["uptime_s"])])  # fmt: skip
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``/metrics`` and ``/health`` on ``address`` (bound now, so a daemon binds every
    pipeline's before it forks them) for the daemon given to ``start``."""

    def __init__(self, address: tuple[str, int], *, idle_timeout: float = IDLE_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS,
                 log: Callable[[str], None] | None = None):  # fmt: skip
        self.statistics: Callable[[], dict] = dict
        self.last_turn: Callable[[], float] = time.monotonic
        self.labels: dict[str, str] = {}
        self.idle_timeout, self.max_connections = idle_timeout, max_connections
        self.log = log or _stderr
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.sock = socket.create_server(address, family=family, backlog=128)
        self.address = self.sock.getsockname()[:2]
        self.failures = 0  # failed requests (reset, timed out, malformed), logged or not
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # no request yet, oldest first
        self._logged: list[float] = []  # when the lines of the last minute were written
        self._unlogged = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    def start(self, statistics: Callable[[], dict], last_turn: Callable[[], float],
              labels: dict[str, str]) -> None:  # fmt: skip
        self.statistics, self.last_turn, self.labels = statistics, last_turn, labels
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name="gradsum-metrics")  # fmt: skip
        self._thread.start()
        if not ready.wait(10.0):
            raise TimeoutError("the metrics server's loop did not start in 10 s")

    def _run(self, ready: threading.Event) -> None:
        asyncio.run(self._main(ready))

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        server = await asyncio.start_server(self._serve, sock=self.sock, limit=MAX_REQUEST)
        ready.set()
        async with server:
            await self._stopped.wait()
            server.close()
            for writer in list(self._waiting):
                writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._waiting[writer] = None
        while len(self._waiting) > self.max_connections:  # the oldest silent one makes room
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.close()
            self._failed("closed to make room for a newer connection")
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_timeout)
            finally:
                self._waiting.pop(writer, None)
            status, kind, body = self._answer(head)
            data = body.encode()
            writer.write(
                f"HTTP/1.0 {status.value} {status.phrase}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
            )
            await asyncio.wait_for(writer.drain(), self.idle_timeout)
        except TimeoutError:
            self._failed(f"no request in {self.idle_timeout:g} s")
        except asyncio.IncompleteReadError:
            if not writer.is_closing():  # not one we closed to make room
                self._failed("closed before its request was complete")
        except asyncio.LimitOverrunError:
            self._failed(f"a request head over {MAX_REQUEST} bytes")
        except OSError as error:  # reset, broken pipe
            self._failed(f"{type(error).__name__}: {error.strerror or error}")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[HTTPStatus, str, str]:
        line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(line) != 3 or not line[2].startswith("HTTP/"):
            self._failed("a malformed request line")
            return HTTPStatus.BAD_REQUEST, "text/plain", "bad request\n"
        method, target = line[0], line[1].split("?", 1)[0]
        if method != "GET":
            return HTTPStatus.METHOD_NOT_ALLOWED, "text/plain", "GET only\n"
        if target == "/metrics":
            return HTTPStatus.OK, "text/plain; version=0.0.4", exposition(self._read(),
                                                                        self.labels)
        if target == "/health":
            idle = time.monotonic() - self.last_turn()
            healthy = idle < HEALTHY_LOOP_S
            body = json.dumps({"status": "ok" if healthy else "stalled",
                               "loop_idle_s": round(idle, 3)}) + "\n"  # fmt: skip
            status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
            return status, "application/json", body
        return HTTPStatus.NOT_FOUND, "text/plain", "try /metrics or /health\n"

    def _failed(self, why: str) -> None:
        """One line per failed request, at most ``LOG_LINES`` a minute."""
        self.failures += 1
        now = time.monotonic()
        self._logged = [t for t in self._logged if now - t < 60.0]
        if len(self._logged) >= LOG_LINES:
            self._unlogged += 1
            return
        self._logged.append(now)
        more = f" ({self._unlogged} more not logged)" if self._unlogged else ""
        self._unlogged = 0
        self.log(f"gradsum metrics: a request failed: {why}{more}")

    def _read(self) -> dict:
        for _ in range(5):
            try:
                return self.statistics()
            except RuntimeError:  # a dictionary changed size under us: read again
                time.sleep(0.001)
        return self.statistics()

    def close(self) -> None:
        """Stop serving (if started) and release the port."""
        if self._loop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(5.0)
        self.sock.close()


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()

"""``--metrics-port``: a daemon's counters as Prometheus text (``/metrics``) and its liveness
(``/health``), over the standard library's HTTP server in a background thread.

The exposition is small and fixed (the text format 0.0.4, no client library needed): jobs,
datagrams, drops by reason, retransmissions answered, control requests and errors, slot memory
and occupancy. Counters are read from the serving loop's dictionaries while it runs; a read
that races with a registration is simply retried.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HEALTHY_LOOP_S = 5.0  # /health fails once the serving loop has not turned for this long


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

    def __init__(self, address: tuple[str, int]):
        self.statistics: Callable[[], dict] = dict
        self.last_turn: Callable[[], float] = time.monotonic
        self.labels: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # the http.server interface
                server._answer(self)

            def log_message(self, *args):  # no access log on stderr
                pass

        self.httpd = ThreadingHTTPServer(address, Handler)
        self.httpd.daemon_threads = True
        self.address = self.httpd.server_address[:2]

    def start(self, statistics: Callable[[], dict], last_turn: Callable[[], float],
              labels: dict[str, str]) -> None:  # fmt: skip
        self.statistics, self.last_turn, self.labels = statistics, last_turn, labels
        thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                  name="gradsum-metrics")  # fmt: skip
        thread.start()

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            status, kind, body = 200, "text/plain; version=0.0.4", exposition(
                self._read(), self.labels
            )
        elif path == "/health":
            idle = time.monotonic() - self.last_turn()
            healthy = idle < HEALTHY_LOOP_S
            status, kind = (200 if healthy else 503), "application/json"
            body = json.dumps({"status": "ok" if healthy else "stalled",
                               "loop_idle_s": round(idle, 3)}) + "\n"  # fmt: skip
        else:
            status, kind, body = 404, "text/plain", "try /metrics or /health\n"
        data = body.encode()
        request.send_response(status)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _read(self) -> dict:
        for _ in range(5):
            try:
                return self.statistics()
            except RuntimeError:  # a dictionary changed size under us: read again
                time.sleep(0.001)
        return self.statistics()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

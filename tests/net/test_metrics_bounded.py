"""--metrics-port faces whoever reaches the daemon: resets and half-open connections cost a
bounded number of threads and log lines, idle connections are closed, /health still answers."""

import json
import socket
import struct
import urllib.request
from pathlib import Path

from gradsum.net import metrics
from gradsum.net.loopback import DaemonProcess


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _reset(address) -> None:
    sock = socket.create_connection(address, timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # RST, not FIN


def _health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_resets_and_half_open_connections_cost_bounded_threads_and_lines_and_health_answers():
    with DaemonProcess("switch", "--metrics-port", "0") as switch:
        url = switch.listing.split("metrics on ", 1)[1].split(")", 1)[0]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        address = (host, int(port))
        assert _health(url)["status"] == "ok"
        before = _threads(switch.process.pid)
        for _ in range(200):
            _reset(address)
        held = [socket.create_connection(address, timeout=5) for _ in range(400)]
        try:
            during = _threads(switch.process.pid)
            assert _health(url)["status"] == "ok"  # the crowd of half-open ones makes room
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
                assert b"gradsum_jobs" in response.read()
            # all but the newest MAX_CONNECTIONS were closed by the server: they read EOF
            closed = 0
            for sock in held[: 400 - metrics.MAX_CONNECTIONS]:
                sock.settimeout(30)
                closed += sock.recv(1) == b""
            assert closed == 400 - metrics.MAX_CONNECTIONS
        finally:
            for sock in held:
                sock.close()
        stderr = switch.stop()
    assert during <= before, f"{during} threads with 400 connections open, {before} before"
    lines = [line for line in stderr.splitlines() if "gradsum metrics" in line]
    assert 1 <= len(lines) <= metrics.LOG_LINES, lines
    assert "Traceback" not in stderr


def test_a_connection_that_sends_no_request_is_closed_after_the_idle_timeout():
    logged = []
    server = metrics.MetricsServer(("127.0.0.1", 0), idle_timeout=0.2, log=logged.append)
    server.start(lambda: {}, lambda: 0.0, {})
    try:
        with socket.create_connection(server.address, timeout=30) as silent:
            assert silent.recv(1) == b""  # the server hung up on it
        with socket.create_connection(server.address, timeout=30) as bad:
            bad.sendall(b"NONSENSE\r\n\r\n")
            assert bad.recv(64).startswith(b"HTTP/1.0 400")
    finally:
        server.close()
    assert logged == ["gradsum metrics: a request failed: no request in 0.2 s",
                      "gradsum metrics: a request failed: a malformed request line"]  # fmt: skip
    assert server.failures == 2


def test_failed_requests_log_at_most_their_quota_and_count_the_rest():
    logged = []
    server = metrics.MetricsServer(("127.0.0.1", 0), log=logged.append)
    for _ in range(metrics.LOG_LINES + 5):
        server._failed("reset")
    assert len(logged) == metrics.LOG_LINES and server.failures == metrics.LOG_LINES + 5
    server._logged.clear()  # a minute later
    server._failed("reset")
    assert logged[-1].endswith("reset (5 more not logged)")
    server.close()

"""--metrics-port: Prometheus text and a health check from a live daemon; JSON log lines."""

import json
import re
import urllib.request

from gradsum.dataplane import Header, Kind
from gradsum.net.loopback import DaemonProcess

from .test_daemon_bounded import Honest

SAMPLE = re.compile(r'^gradsum_[a-z_]+\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\} [0-9.e+-]+$')


def test_metrics_and_health_over_http_and_json_logs():
    with DaemonProcess("switch", "--metrics-port", "0", "--log-format", "json") as switch:
        url = switch.listing.split("metrics on ", 1)[1].split(")", 1)[0]
        honest = Honest(switch.address)
        try:
            honest.round()
            honest.socks[0].sendto(Header(Kind.DATA, 77).pack(), switch.address)  # unknown job
            honest.round()
        finally:
            honest.close()
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            health = json.loads(response.read())
        stderr = switch.stop()
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples and all(SAMPLE.match(line) for line in samples), text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in samples}
    base = 'pipeline="0",profile="switch"'
    assert values[f"gradsum_jobs{{{base}}}"] == 1
    assert values[f"gradsum_completed_total{{{base}}}"] == 2
    assert values[f'gradsum_dropped_total{{{base},reason="unknown_job",scope="aggregator"}}'] == 1
    assert values[f'gradsum_control_requests_total{{{base},kind="register"}}'] == 1
    assert values[f'gradsum_slot_memory_bytes{{{base},of="used"}}'] > 0
    assert health["status"] == "ok"
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    events = {r["event"] for r in records}
    assert {"no_admission_secret", "stopped"} <= events
    stopped = next(r for r in records if r["event"] == "stopped")
    assert stopped["statistics"]["jobs"]["5"]["completed"] == 2

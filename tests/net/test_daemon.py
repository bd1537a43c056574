"""The daemons as processes: startup, bad flags, port in use, statistics, signals."""

import json
import signal
import socket

import pytest

from gradsum.cli import main
from gradsum.dataplane import Kind
from gradsum.net.client import ControlError, aggregator_stats, control_request
from gradsum.net.loopback import DaemonProcess


def gradsum(*args) -> tuple[int, str]:
    """Run the CLI in-process (flag errors exit before any socket work); (status, stderr)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code, err.getvalue()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--drop-rate", "1.5"], "--drop-rate must be in [0, 1)"),
        (["--reorder-rate", "-1"], "--reorder-rate must be in [0, 1)"),
        (["--bind", "127.0.0.1:notaport"], "--bind '127.0.0.1:notaport'"),
        (["--job-memory", "0"], "--job-memory must be positive"),
        (["--pipelines", "0"], "--pipelines must be in 1..64"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, message):
    status, stderr = gradsum("switch", *flags)
    assert status == 2
    assert message in stderr


def test_a_port_in_use_is_a_clear_error():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        host, port = taken.getsockname()
        status, stderr = gradsum("server", "--bind", f"{host}:{port}")
    assert status == 2
    assert f"{host}:{port} is already in use" in stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_the_daemon_cleanly_with_statistics(signum):
    daemon = DaemonProcess("switch")
    stats = aggregator_stats(daemon.address)
    assert stats["profile"] == "switch"
    daemon.process.send_signal(signum)
    _, stderr = daemon.process.communicate(timeout=10)
    assert daemon.process.returncode == 0
    final = json.loads(stderr.split("statistics ", 1)[1])
    assert final["aggregator"]["control_stats_request"] == 1


def test_registration_errors_come_back_over_the_wire(tmp_path):
    spec = {"job": 3, "addresses": ["127.0.0.1:1"], "slots": 1, "elements": 8,
            "op": {"kind": "float-sum"}}  # fmt: skip
    refused = pytest.raises(ControlError, match="unsupported: a switch runs integer operations")
    with DaemonProcess("switch") as switch, refused:
        control_request(switch.address, Kind.REGISTER, 3, spec)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    with DaemonProcess("server", "--register", str(path)) as server:
        assert "3" in aggregator_stats(server.address)["jobs"]
    status, stderr = gradsum("switch", "--register", str(path), "--bind", "127.0.0.1:0")
    assert status == 2 and "--register" in stderr

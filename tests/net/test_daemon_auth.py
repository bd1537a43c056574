"""Authenticated control against a live switch: who holds the admission secret registers, who
holds a job's key tears it down and reads it, and nobody else gets more than they send."""

import os
import socket
from dataclasses import replace

import pytest

from gradsum.dataplane import Header, Kind
from gradsum.dataplane.authentication import new_key
from gradsum.net.client import (
    ControlError,
    aggregator_stats,
    job_stats,
    register_job,
    teardown_job,
)
from gradsum.net.loopback import DaemonProcess

from .test_daemon_bounded import HONEST_JOB, Honest

SECRET = b"a-team-secret-of-32-characters!!"


@pytest.fixture(scope="module")
def guarded():
    env = {**os.environ, "GRADSUM_ADMISSION_SECRET": SECRET.decode()}
    with DaemonProcess("switch", env=env) as switch:
        yield switch


def test_without_a_secret_the_daemon_warns_loudly():
    with DaemonProcess("switch") as switch:
        stderr = switch.stop()
    assert "WARNING: no admission secret" in stderr


def test_only_the_secret_registers_and_only_the_key_tears_down(guarded, monkeypatch):
    monkeypatch.delenv("GRADSUM_ADMISSION_SECRET", raising=False)
    monkeypatch.delenv("GRADSUM_ADMISSION_FILE", raising=False)
    address, key = guarded.address, new_key()
    with pytest.raises(ControlError, match="unauthenticated"):
        Honest(address, key=key)  # no secret
    honest = Honest(address, key=key, admission=SECRET)
    try:
        honest.round()
        # each refused with an answer naming why (a request that went unanswered, code
        # "no_reply", is no refusal: the daemon may have died or dropped it)
        unsigned = {"unauthenticated", "forbidden"}  # no signature: nobody's request
        for what, attempt, codes in (
            ("register over the job with another secret and key",
             lambda: register_job(address, replace(honest.spec, key=new_key()), timeout=2,
                                  admission=b"x" * 32), {"unauthenticated"}),
            ("tear down unsigned", lambda: teardown_job(address, HONEST_JOB, timeout=2), unsigned),
            ("tear down with another key",
             lambda: teardown_job(address, HONEST_JOB, timeout=2, key=new_key()),
             {"unauthenticated"}),
            ("read the job unsigned", lambda: job_stats(address, HONEST_JOB, timeout=2), unsigned),
            ("read the aggregator unsigned", lambda: aggregator_stats(address, timeout=2),
             {"unauthenticated"}),
        ):  # fmt: skip
            with pytest.raises(ControlError) as refused:
                attempt()
            assert refused.value.code in codes, (what, refused.value.code, str(refused.value))
        honest.round()  # the job never noticed
        assert job_stats(address, HONEST_JOB, key=key)["completed"] == 2
        assert str(HONEST_JOB) in aggregator_stats(address, secret=SECRET)["jobs"]
        final = teardown_job(address, HONEST_JOB, key=key)
        assert final["stats"]["completed"] == 2
        assert teardown_job(address, HONEST_JOB, key=key) == final  # retried: the same
    finally:
        honest.close()


def test_unsigned_requests_get_replies_no_larger_than_themselves(guarded):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2)
        for kind, job, body in [(Kind.STATS_REQUEST, 0, b""), (Kind.TEARDOWN, 9, b""),
                                (Kind.REGISTER, 3, b'{"job": 3}'),
                                (Kind.STATS_REQUEST, 0, b'{"page": 0}' + b" " * 5000)]:  # fmt: skip
            request = Header(kind, job, chunk=5).pack() + body
            sock.sendto(request, guarded.address)
            reply = sock.recv(1 << 16)
            assert len(reply) <= len(request)


def spoofed(data: bytes, source, destination) -> None:
    """Send ``data`` over UDP from the forged ``source`` (a raw socket: needs root)."""
    import struct

    udp = struct.pack("!HHHH", source[1], destination[1], 8 + len(data), 0) + data
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(source[0]), socket.inet_aton(destination[0]))  # fmt: skip
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
        raw.sendto(ip + udp, destination)


@pytest.mark.skipif(os.geteuid() != 0, reason="forging a source address needs a raw socket")
@pytest.mark.parametrize("native", ["1", "0"], ids=["native-pools", "python-pools"])
def test_a_spoofed_source_without_the_token_cannot_change_a_sum(native):
    import numpy as np

    from gradsum.dataplane import Op
    from gradsum.dataplane.packet import HEADER_SIZE, parse_header

    env = {**os.environ, "GRADSUM_NATIVE": native}
    with DaemonProcess("switch", env=env) as switch:
        for key in (new_key(), None):
            honest = Honest(switch.address, key=key)
            try:
                spec, c = honest.spec, honest.chunk
                for token in (0, 12345, spec.token ^ 1):  # none, a guess, one bit off
                    header = Header(Kind.DATA, HONEST_JOB, 1, c % 4, 0, Op.SUM, 0, c, 64, 1, token)
                    forged = header.pack() + np.full(64, 1000, "<i4").tobytes()
                    spoofed(forged, spec.addresses[1], switch.address)
                if key is None:  # without a token the forgery takes worker 1's place
                    honest.socks[0].sendto(_data(spec, 0, c), switch.address)
                    data = honest.socks[0].recv(1 << 16)
                    assert np.frombuffer(data[HEADER_SIZE:], "<i4")[0] != 2 * c
                    assert parse_header(data).chunk == c
                    continue
                honest.round()  # exact: the forgeries were dropped
                stats = job_stats(switch.address, HONEST_JOB, key=key)
                assert stats["dropped_bad_token"] == 3
                teardown_job(switch.address, HONEST_JOB, key=key)
            finally:
                honest.close()


def _data(spec, worker, chunk):
    import numpy as np

    from gradsum.dataplane import Op

    header = Header(Kind.DATA, spec.job, worker, chunk % 4, 0, Op.SUM, 0, chunk, 64, 1, spec.token)
    return header.pack() + (np.arange(64, dtype="<i4") * (worker + 1) + chunk).tobytes()


@pytest.mark.slow
def test_mac_and_token_jobs_give_the_same_sums_as_a_keyless_job():
    import numpy as np

    from gradsum.net.loopback import WorkerTask, run_workers

    outputs = {}
    with DaemonProcess("switch") as switch:
        for mode, key in (("none", None), ("token", new_key()), ("mac", new_key())):
            task = WorkerTask((switch.address,), job=3, workers=2, codec="bfp", elements=40_000,
                              steps=2, key=key, integrity="mac" if mode == "mac" else "token")
            outputs[mode] = [r.outputs for r in run_workers(task, timeout=120)]
        stats = aggregator_stats(switch.address)
    for mode in ("token", "mac"):
        for mine, theirs in zip(outputs[mode], outputs["none"], strict=True):
            assert all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True)), mode
    assert stats["aggregator"].get("dropped_internal_error", 0) == 0

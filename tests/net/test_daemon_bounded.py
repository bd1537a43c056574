"""Control input against live daemons on loopback: the datagrams that killed them, a fuzz of
the control plane, a serving loop no handler can end, and memory that matches the RSS."""

import itertools
import json
import os
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradsum.dataplane import Header, IntegerSum, JobSpec, Kind, Op
from gradsum.dataplane.packet import HEADER_SIZE, MalformedPacket, parse_header
from gradsum.net.client import aggregator_stats, register_job
from gradsum.net.loopback import DaemonProcess

from ..dataplane.test_bounded_input import CRASHES

ELEMENTS = 64
HONEST_JOB = 5


class Honest:
    """Two worker sockets of an int32 job: each round's sum must come back exact."""

    def __init__(self, address, key=None, admission=None):
        self.address = address
        self.socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
        for sock in self.socks:
            sock.bind(("127.0.0.1", 0))
            sock.settimeout(5)
        addresses = tuple(s.getsockname() for s in self.socks)
        self.spec = JobSpec(HONEST_JOB, addresses, 4, ELEMENTS, IntegerSum(32, 32, True), key=key)
        try:
            register_job(address, self.spec, admission=admission)
        except Exception:
            self.close()
            raise
        self.chunk = 0

    def round(self) -> None:
        c, s = self.chunk, self.spec.slots
        self.chunk += 1
        for worker, sock in enumerate(self.socks):
            header = Header(Kind.DATA, HONEST_JOB, worker, c % s, (c // s) % 2, Op.SUM, 0, c,
                            ELEMENTS, 1, self.spec.token)  # fmt: skip
            lanes = np.arange(ELEMENTS, dtype="<i4") * (worker + 1) + c
            sock.sendto(header.pack() + lanes.tobytes(), self.address)
        want = (np.arange(ELEMENTS) * 3 + 2 * c).tolist()
        for sock in self.socks:
            data = sock.recv(1 << 16)
            assert parse_header(data).chunk == c
            assert np.frombuffer(data[HEADER_SIZE:], "<i4").tolist() == want

    def close(self):
        for sock in self.socks:
            sock.close()


def ask(sock, address, data: bytes, timeout=2.0):
    """Send one control datagram; the reply's (kind, body), or None if none came. The reply is
    the one carrying the request's id (the header's chunk field): a late answer to an earlier
    request on the same socket is skipped, not taken for this one's."""
    request = bytes(data[16:24])
    sock.sendto(data, address)
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            reply = sock.recv(1 << 16)
        except TimeoutError:
            return None
        if reply[16:24] == request:
            return parse_header(reply).kind, json.loads(reply[HEADER_SIZE:] or b"{}")
    return None


@pytest.mark.parametrize("kind", ["switch", "server"])
def test_the_crash_datagrams_get_errors_while_an_honest_job_stays_exact(kind):
    with DaemonProcess(kind) as daemon, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        honest = Honest(daemon.address)
        try:
            honest.round()
            for what, body in CRASHES.items():
                data = Header(Kind.REGISTER, 1, chunk=3).pack() + body
                answer = ask(s, daemon.address, data)
                assert answer is not None, f"no reply to {what}"
                assert answer[0] is Kind.ERROR and answer[1]["code"] in ("bad_request", "bad_spec")
                honest.round()
        finally:
            honest.close()
        assert daemon.process.poll() is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip
SPEC_FIELDS = ["job", "addresses", "slots", "elements", "op", "max_contributors", "quorum",
               "deadline", "parent", "group"]  # fmt: skip
spec_like = st.fixed_dictionaries(
    {}, optional={name: json_values for name in SPEC_FIELDS}
) | st.builds(
    lambda job, slots, elements, bits: {
        "job": job, "addresses": ["127.0.0.1:7001", "127.0.0.1:7002"], "slots": slots,
        "elements": elements,
        "op": {"kind": "integer-sum", "in_bits": bits, "out_bits": 16, "signed": False},
    },
    st.integers(0, 70000), st.integers(-1, 1 << 21), st.integers(-1, 1 << 25), st.integers(0, 33),
)  # fmt: skip
bodies = (
    spec_like.map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda d: json.dumps(d).encode())
    | st.binary(max_size=200)
)
control_messages = st.builds(
    lambda kind, job, flags, chunk, body: bytearray(
        Header(kind, job, chunk=chunk).pack()[:14] + bytes([flags]) + bytes(HEADER_SIZE - 15)
    ) + body,
    st.sampled_from([Kind.REGISTER, Kind.TEARDOWN, Kind.STATS_REQUEST, Kind.STATS, Kind.ERROR]),
    st.integers(0, 0xFFFF).filter(lambda j: j != HONEST_JOB),
    st.sampled_from([0, 0, 0, 1, 4, 128]),
    st.integers(0, 2**64 - 1),
    bodies,
)  # fmt: skip


REQUEST_IDS = itertools.count(1)


@pytest.fixture(scope="module")
def fuzzed_switch():
    with DaemonProcess("switch") as switch, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        honest = Honest(switch.address)
        yield switch, honest, s
        honest.close()
        assert switch.process.poll() is None, "the switch died"


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=st.lists(control_messages, min_size=1, max_size=5))
def test_fuzzed_control_messages_get_an_answer_or_a_counted_drop(fuzzed_switch, messages):
    switch, honest, stranger = fuzzed_switch
    for data in messages:
        data[16:24] = next(REQUEST_IDS).to_bytes(8, "little")  # every request an id of its own
        try:
            header = parse_header(data)
        except MalformedPacket:
            header = None
        answer = ask(stranger, switch.address, bytes(data), timeout=0.5 if header else 0.05)
        if header is not None and header.kind in (
            Kind.REGISTER,
            Kind.TEARDOWN,
            Kind.STATS_REQUEST,
            Kind.STATS,
            Kind.ERROR,
        ):
            assert answer is not None, f"no reply to {bytes(data)[:80]!r}"
            assert answer[0] in (Kind.ERROR, Kind.REGISTERED, Kind.TORN_DOWN, Kind.STATS)
        else:  # a bad header: dropped, or for a control kind an ERROR naming the fault
            assert answer is None or answer[0] is Kind.ERROR
    honest.round()


def test_the_fuzzed_switch_counted_no_handler_error(fuzzed_switch):
    switch, honest, _ = fuzzed_switch
    stats = aggregator_stats(switch.address)
    assert stats["aggregator"].get("dropped_internal_error", 0) == 0
    assert stats["aggregator"].get("control_error_internal_error", 0) == 0
    honest.round()


def test_the_serving_loop_outlives_a_handler_that_raises():
    from gradsum.dataplane.plane import DataPlane, switch_profile
    from gradsum.net.daemon import Daemon
    from gradsum.net.udp import open_socket

    plane = DataPlane(switch_profile())
    calls = {"n": 0}
    real = plane.on_datagram

    def broken(*args):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise RuntimeError("a bug the data plane did not catch")
        return real(*args)

    plane.on_datagram = broken
    sock = open_socket(("127.0.0.1", 0))
    daemon = Daemon(plane, sock)
    thread = threading.Thread(target=daemon.serve, daemon=True)
    thread.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            for _ in range(3):
                client.sendto(Header(Kind.STATS_REQUEST, 0).pack(), sock.getsockname())
            time.sleep(0.3)
            padded = Header(Kind.STATS_REQUEST, 0).pack() + b" " * 4000  # room for the reply
            answer = ask(client, sock.getsockname(), padded)
        assert answer is not None and answer[0] is Kind.STATS
        assert daemon.stats.handler_errors == 3 and thread.is_alive()
    finally:
        daemon.stop.set()
        thread.join(5)
        sock.close()


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("native", "slots", "elements"),
    [("1", 1 << 19, 8), ("1", 1 << 10, 16360), ("0", 1 << 17, 8)],
    ids=["native-small-slots", "native-wide-slots", "python-small-slots"],
)
def test_the_rss_grows_by_the_declared_memory_within_10_percent(native, slots, elements):
    env = {**os.environ, "GRADSUM_NATIVE": native}
    with DaemonProcess("switch", "--job-memory", "512", "--memory", "1024", env=env) as switch:
        aggregator_stats(switch.address)  # every import done, the loop warm
        before = rss(switch.process.pid)
        addresses = (("127.0.0.1", 7001), ("127.0.0.1", 7002), ("127.0.0.1", 7003))
        spec = JobSpec(3, addresses, slots, elements, IntegerSum(32, 32, True))
        register_job(switch.address, spec, timeout=30)
        declared = aggregator_stats(switch.address)["memory"]["used"]
        grown = rss(switch.process.pid) - before
    assert declared > 32 << 20
    assert abs(grown - declared) <= 0.1 * declared, (grown, declared)

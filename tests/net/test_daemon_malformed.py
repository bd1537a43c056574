"""Malformed packets against a real switch daemon over UDP: it never crashes, never lets one
change a slot, and counts each under its reason.

The data plane's own property test (tests/dataplane/test_malformed.py) checks every slot's state
after every packet; here the same generated packets cross real sockets from the job's own
workers and from a stranger, between two contributions to one round, and the round's result and
the daemon's counters show whether anything leaked in.
"""

import collections
import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradsum.dataplane import Header, IntegerSum, JobSpec, Kind, Op
from gradsum.dataplane.packet import HEADER_SIZE, MAX_DATAGRAM, parse_header
from gradsum.net.client import aggregator_stats, register_job, teardown_job
from gradsum.net.loopback import DaemonProcess

from ..dataplane.test_malformed import SPEC, malformed

ELEMENTS = SPEC.elements  # the malformed packets are shaped after SPEC: job 5, 3 workers
SENDABLE = malformed.filter(lambda packet: len(packet) <= MAX_DATAGRAM)  # the rest cannot be sent
JOB_DROPS = collections.Counter()  # the job's drop counters over every registration of it


@pytest.fixture(scope="module")
def cluster():
    """A switch daemon and three worker sockets for SPEC's job, plus a stranger."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(5)
    workers, stranger = sockets[:3], sockets[3]
    with DaemonProcess("switch") as switch:
        addresses = tuple(s.getsockname() for s in workers)
        spec = JobSpec(SPEC.job, addresses, SPEC.slots, ELEMENTS, IntegerSum(32, 32, True))
        yield switch, spec, workers, stranger
        assert switch.process.poll() is None, "the switch died"
    for sock in sockets:
        sock.close()


def contribution(spec: JobSpec, worker: int, chunk: int, value: int) -> bytes:
    s = spec.slots
    header = Header(Kind.DATA, spec.job, worker, chunk % s, (chunk // s) % 2, Op.SUM, 0, chunk,
                    ELEMENTS, 1)  # fmt: skip
    return header.pack() + np.full(ELEMENTS, value, dtype="<i4").tobytes()


def result_of(sock: socket.socket, chunk: int) -> list[int]:
    """The result of ``chunk``: the first datagram that is not an ERROR (the answer to a control
    packet among the malformed ones) must be that chunk's RESULT."""
    while True:
        data = sock.recv(1 << 16)
        header = parse_header(data)
        if header.kind is not Kind.ERROR:
            assert (header.kind, header.chunk) == (Kind.RESULT, chunk)
            return np.frombuffer(data[HEADER_SIZE:], dtype="<i4").tolist()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(packets=st.lists(SENDABLE, min_size=20, max_size=20))
def test_malformed_packets_between_two_contributions_change_nothing(cluster, packets):
    switch, spec, workers, stranger = cluster
    # The malformed packets are variants of worker 2's packet for chunk 0 (slot 0, version 0):
    # each example registers the job afresh, so chunk 0 is the round they land beside and one
    # that slipped through would change its sum, not a round long since finished.
    register_job(switch.address, spec)
    try:
        workers[0].sendto(contribution(spec, 0, 0, 1), switch.address)
        workers[1].sendto(contribution(spec, 1, 0, 10), switch.address)
        for i, packet in enumerate(packets):  # from a worker of the job, then from a stranger
            (workers[2] if i % 2 else stranger).sendto(packet, switch.address)
        workers[2].sendto(contribution(spec, 2, 0, 100), switch.address)
        for sock in workers:
            assert result_of(sock, 0) == [111] * ELEMENTS
    finally:
        final = teardown_job(switch.address, spec.job)
    JOB_DROPS.update({k: v for k, v in final["stats"].items() if "dropped" in k})
    assert final["stats"]["completed"] == 1


def test_the_switch_counted_what_it_dropped(cluster):
    switch, *_ = cluster
    stats = aggregator_stats(switch.address)
    dropped = {k: v for k, v in stats["aggregator"].items() if k.startswith("dropped_")}
    dropped.update(JOB_DROPS)
    for reason in ("truncated", "wrong_source", "unknown_job", "unknown_worker", "bad_magic"):
        assert dropped.get(f"dropped_{reason}", 0) > 0, reason

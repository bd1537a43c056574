"""Property: no malformed packet crashes the aggregator or changes any slot."""

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from gradsum.dataplane import Drop
from gradsum.dataplane.packet import HEADER_SIZE, MAX_DATAGRAM, PROTOCOL

from .helpers import data_packet, int32_job, send, switch_with, worker_address

SPEC = int32_job(workers=3, slots=4, elements=16, job=5)
OTHER = int32_job(workers=2, slots=2, elements=8, job=6)
STRANGER = ("10.7.7.7", 999)


def primed_switch():
    """Two jobs, each with a half-full round, so there is state a bad packet could corrupt."""
    switch = switch_with(SPEC, OTHER)
    send(switch, SPEC, 0, 0, [1] * 16)
    send(switch, SPEC, 1, 0, [2] * 16)
    send(switch, OTHER, 0, 0, [3] * 8)
    return switch


def snapshot(switch):
    state = {}
    for job_id, job in switch.jobs.items():
        if job.native:
            state[job_id] = job.pool.core.snapshot()
            continue
        rounds = [
            (r.state, r.chunk, bytes(r.seen), r.arrivals, r.contributors, r.op, r.elements)
            for row in job.pool.rounds for r in row
        ]  # fmt: skip
        state[job_id] = (job.pool.acc.tobytes(), rounds)
    return state


def valid(worker=2, chunk=0, lanes=16):
    return data_packet(SPEC, worker, chunk, [7] * lanes)


def with_field(packet: bytes, fmt: str, offset: int, value: int) -> bytes:
    data = bytearray(packet)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


malformed = st.one_of(
    # truncated anywhere, header included
    st.integers(0, HEADER_SIZE + 63).map(lambda n: valid()[:n]),
    # oversized, or trailing bytes past the lanes
    st.integers(1, 64).map(lambda n: valid() + b"\0" * n),
    st.just(valid() + b"\0" * (MAX_DATAGRAM - len(valid()) + 1)),
    # wrong payload length for the declared elements
    st.integers(1, 15).map(lambda n: with_field(valid(), "<I", 24, n)),
    st.integers(17, 2**32 - 1).map(lambda n: with_field(valid(), "<I", 24, n)),
    # unknown job, unknown worker
    st.integers(0, 0xFFFF)
    .filter(lambda j: j not in (5, 6))
    .map(lambda j: with_field(valid(), "<H", 4, j)),
    st.integers(3, 0xFFFF).map(lambda w: with_field(valid(), "<H", 6, w)),
    # out-of-range slot, version; chunk that is not the slot's
    st.integers(4, 2**32 - 1).map(lambda s: with_field(valid(), "<I", 8, s)),
    st.integers(2, 255).map(lambda v: with_field(valid(), "<B", 12, v)),
    st.integers(1, 2**63).filter(lambda c: c % 8).map(lambda c: with_field(valid(), "<Q", 16, c)),
    # bad magic, protocol, kind, op, flags, reserved bytes, contributors
    st.binary(min_size=2, max_size=2).filter(lambda m: m != b"GS").map(lambda m: m + valid()[2:]),
    st.integers(0, 255)
    .filter(lambda p: p != PROTOCOL)
    .map(lambda p: with_field(valid(), "<B", 2, p)),
    st.integers(0, 255)
    .filter(lambda k: k not in range(1, 4) and k < 16)
    .map(lambda k: with_field(valid(), "<B", 3, k)),
    st.integers(3, 255).map(lambda o: with_field(valid(), "<B", 13, o)),
    st.integers(2, 255).map(lambda f: with_field(valid(), "<B", 14, f)),
    st.integers(1, 255).map(lambda r: with_field(valid(), "<B", 15, r)),
    st.sampled_from([0, 4, 0xFFFF]).map(lambda c: with_field(valid(), "<H", 28, c)),
    # pure noise
    st.binary(max_size=300),
)


@settings(max_examples=400, deadline=None)
@given(malformed)
def test_malformed_packets_are_dropped_and_change_no_slot(packet):
    switch = primed_switch()
    before = snapshot(switch)
    actions = switch.on_datagram(memoryview(packet), SPEC.addresses[2], 1.0)
    assert all(isinstance(a, Drop) for a in actions), actions
    assert snapshot(switch) == before


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([STRANGER, worker_address(0), OTHER.addresses[1]]))
def test_a_valid_packet_from_the_wrong_source_is_dropped(source):
    switch = primed_switch()
    before = snapshot(switch)
    actions = switch.on_datagram(memoryview(valid(worker=2)), source, 1.0)
    assert [a.reason for a in actions] == ["wrong_source"]
    assert snapshot(switch) == before


def test_drops_are_counted_by_reason():
    switch = primed_switch()
    switch.on_datagram(memoryview(b"junk"), STRANGER, 0.0)
    switch.on_datagram(memoryview(with_field(valid(), "<H", 4, 77)), STRANGER, 0.0)
    assert switch.stats["dropped_truncated"] == 1
    assert switch.stats["dropped_unknown_job"] == 1
    assert all(not k.startswith("dropped") for k in switch.jobs[5].pool.stats)

"""The C slot pools (native_pool) against slots.py's SlotPool: the same packets give the same
actions, counters and slot state, whatever the packets (property-based)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsum.dataplane import DataPlane, Header, IntegerSum, JobSpec, Kind, Op, switch_profile
from gradsum.dataplane.actions import Drop, Send, Store

from .helpers import worker_address

WORKERS, SLOTS, ELEMENTS = 3, 2, 8
OPS = {
    "bfp": IntegerSum(32, 32, True),
    "thc": IntegerSum(4, 8, table=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
    "thc-table": IntegerSum(2, 7, table=(0, 3, 9, 31)),
    "odd-width": IntegerSum(3, 5),
}
STRANGER = ("10.9.9.9", 1)


def spec(op, group=None):
    addresses = tuple(worker_address(w) for w in range(WORKERS))
    return JobSpec(1, addresses, SLOTS, ELEMENTS, OPS[op], group=group)


def lane_bytes(op, kind, elements, flags):
    if kind == Op.MAX or OPS[op].signed:
        return 4 * elements
    bits = OPS[op].out_bits if flags & 1 else OPS[op].in_bits
    return (elements * bits + 7) // 8


@st.composite
def packets(draw, op):
    """Mostly well-formed packets of the job's first rounds, with every field sometimes off."""
    worker = draw(st.integers(0, WORKERS - 1))
    chunk = draw(st.integers(0, 4 * SLOTS + 1))
    slot, version = chunk % SLOTS, (chunk // SLOTS) % 2
    if draw(st.integers(0, 9)) == 0:
        slot, version = draw(st.integers(0, SLOTS)), draw(st.integers(0, 1))
    kind = draw(st.sampled_from([Op.SUM] * 6 + [Op.MAX, Op.NONE]))
    elements = draw(st.sampled_from([ELEMENTS] * 6 + [1, 5, ELEMENTS + 1]))
    contributors = draw(st.sampled_from([1] * 8 + [0, WORKERS + 1]))
    flags = draw(st.sampled_from([0] * 8 + [1, 2]))
    size = lane_bytes(op, kind, elements, flags) + draw(st.sampled_from([0] * 9 + [-1, 1]))
    payload = draw(st.binary(min_size=max(0, size), max_size=max(0, size)))
    header = Header(Kind.DATA, 1, worker, slot, version, kind, flags, chunk, elements,
                    contributors)  # fmt: skip
    source = worker_address(worker) if draw(st.integers(0, 19)) else STRANGER
    return header.pack() + payload, source


def outcome(actions):
    """Actions as comparable values (a drop's detail text may differ)."""
    out = []
    for action in actions:
        if isinstance(action, Send):
            out.append(("send", action.what, action.destinations, action.header,
                        bytes(action.payload)))  # fmt: skip
        elif isinstance(action, Drop):
            out.append(("drop", action.reason))
        else:
            assert isinstance(action, Store)
            out.append(tuple(action))
    return out


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("group", [None, ("239.1.1.1", 4000)])
def test_native_and_python_pools_agree_packet_by_packet(pools, op, group):
    if pools == "python-pools":
        pytest.skip("compares both implementations itself")

    @settings(max_examples=150, deadline=None)
    @given(st.lists(packets(op), min_size=1, max_size=60))
    def check(sequence):
        native, python = DataPlane(switch_profile()), DataPlane(switch_profile(), native=False)
        for aggregator in (native, python):
            aggregator.register(spec(op, group))
        assert native.jobs[1].native and not python.jobs[1].native
        for data, source in sequence:
            got = outcome(native.on_datagram(memoryview(data), source, 0.0))
            want = outcome(python.on_datagram(memoryview(data), source, 0.0))
            assert got == want
        assert native.jobs[1].pool.stats == python.jobs[1].pool.stats
        assert native.statistics() == python.statistics()
        assert (native.jobs[1].pool.acc == python.jobs[1].pool.acc).all()

    check()


def test_a_native_pool_serves_only_what_it_can(pools):
    if pools == "python-pools":
        pytest.skip("about the native pools")
    aggregator = DataPlane(switch_profile())
    addresses = tuple(worker_address(w) for w in range(2))
    cases = {
        2: (JobSpec(2, addresses, 2, 8, IntegerSum(32, 32, True)), True),
        3: (JobSpec(3, addresses, 2, 8, IntegerSum(12, 16)), False),  # indices over 8 bits
        4: (JobSpec(4, addresses, 2, 8, IntegerSum(32, 32, True), quorum=1, deadline=0.1), False),
    }
    for job, (job_spec, native) in cases.items():
        assert aggregator.register(job_spec).native is native, job

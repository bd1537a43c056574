"""The aggregator around the pools: ops against the codecs, control, jobs, profiles, hierarchy."""

import json

import numpy as np
import pytest
import torch

from gradsum.codecs import make_codec, run_round
from gradsum.codecs.base import AGGREGATOR, CodecContext
from gradsum.codecs.round import worker_contexts
from gradsum.dataplane import (
    DataPlane,
    FloatSum,
    Header,
    IntegerSum,
    JobSpec,
    Kind,
    Op,
    ParentLink,
    SpecError,
    parse_header,
    payload_wire,
    server_profile,
    switch_profile,
)
from gradsum.dataplane.codec_wire import wire_format
from gradsum.dataplane.packet import HEADER_SIZE, Flag
from gradsum.dataplane.plane import slot_memory

from .helpers import SWITCH, drops, int32_job, lanes_of, send, sends, switch_with, worker_address


def lane_packet(spec, worker, chunk, data: bytes, elements, op=Op.SUM, flags=0, contributors=1):
    s = spec.slots
    header = Header(Kind.DATA, spec.job, worker, chunk % s, (chunk // s) % 2, op, flags, chunk,
                    elements, contributors)  # fmt: skip
    return header.pack() + data


def deliver(aggregator, spec, worker, packet, now=0.0):
    return aggregator.on_datagram(memoryview(packet), spec.addresses[worker], now)


@pytest.mark.parametrize("name", ["thc", "thc-uniform", "bfp"])
def test_switch_sums_integer_codecs_exactly_like_codec_aggregate(name):
    workers, length = 3, 1000
    codec = make_codec(name, workers=workers)
    inputs = [torch.randn(length, generator=torch.Generator().manual_seed(w)) for w in range(3)]
    expected = run_round(codec, inputs, seed=4)
    fmt = wire_format(codec)
    upstream, downstream = codec.lane_fields
    lanes = codec.lanes(length)
    spec = JobSpec(1, tuple(worker_address(w) for w in range(workers)), 1, lanes + 8, fmt.op)
    switch = switch_with(spec)
    for w, payload in enumerate(expected.payloads):
        data = payload.fields[upstream].contiguous().numpy().tobytes()
        actions = deliver(switch, spec, w, lane_packet(spec, w, 0, data, lanes))
    (multicast,) = sends(actions)
    want = expected.aggregate.fields[downstream].contiguous().numpy().tobytes()
    assert bytes(multicast.payload) == want


def test_server_float_sum_is_the_same_whatever_the_arrival_order():
    spec = JobSpec(1, tuple(worker_address(w) for w in range(3)), 1, 64, FloatSum())
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(64).astype(np.float32) * 10.0 ** (3 * w) for w in range(3)]
    results = set()
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        server = DataPlane(server_profile())
        server.register(spec)
        for w in order:
            actions = deliver(server, spec, w, lane_packet(spec, w, 0, values[w].tobytes(), 64))
        (multicast,) = sends(actions)
        results.add(bytes(multicast.payload))
    assert len(results) == 1
    total = np.frombuffer(results.pop(), dtype=np.float32)
    assert np.allclose(total, values[0] + values[1] + values[2], rtol=1e-6)


@pytest.mark.parametrize("name", ["topk", "terngrad", "qsgd", "dgc", "fp16"])
def test_server_decodes_sums_and_reencodes_like_codec_aggregate(name):
    workers, length = 2, 500
    codec = make_codec(name, workers=workers)
    inputs = [torch.randn(length, generator=torch.Generator().manual_seed(w)) for w in range(2)]
    contexts = worker_contexts(workers, seed=1)
    prepared = [codec.precondition(x, ctx) for x, ctx in zip(inputs, contexts, strict=True)]
    payloads = [codec.encode(x, ctx) for x, ctx in zip(prepared, contexts, strict=True)]
    fmt = wire_format(codec, seed=1)
    spec = JobSpec(1, tuple(worker_address(w) for w in range(workers)), 1, length, fmt.op)
    server = DataPlane(server_profile())
    server.register(spec)
    for w, payload in enumerate(payloads):
        blob = payload_wire.serialize(payload)
        actions = deliver(server, spec, w, lane_packet(spec, w, 0, blob, length))
    (multicast,) = sends(actions)
    got = payload_wire.deserialize(bytes(multicast.payload), length, workers)
    ctx = CodecContext(seed=1, worker=AGGREGATOR, partition=0)
    want = make_codec(name, workers=workers).aggregate(payloads, ctx)
    assert got.fields.keys() == want.fields.keys()
    for key in want.fields:
        assert torch.equal(got.fields[key], want.fields[key].reshape(-1))


def test_switch_refuses_float_and_decoding_ops_and_server_accepts_them():
    spec = JobSpec(1, (worker_address(0),), 1, 8, FloatSum())
    with pytest.raises(Exception, match="integer operations only"):
        DataPlane(switch_profile()).register(spec)
    DataPlane(server_profile()).register(spec)


def test_switch_bounds_the_memory_a_job_may_hold():
    small, large = int32_job(slots=4, elements=8, job=1), int32_job(slots=8, elements=8, job=2)
    switch = DataPlane(switch_profile(job_memory=slot_memory(small)))
    switch.register(small)
    # the accumulators (2 versions x slots x 8 int32) and each round's own state
    assert slot_memory(large) > 2 * 8 * 8 * 4
    with pytest.raises(Exception, match=f"needs {slot_memory(large)} bytes"):
        switch.register(large)


def test_sums_that_could_overflow_the_output_width_are_refused_at_registration():
    with pytest.raises(SpecError, match="out_bits"):
        JobSpec(1, (worker_address(0), worker_address(1)), 1, 8, IntegerSum(4, 4))


def control(aggregator, kind, job, body=None, request=7, source=("10.9.9.9", 1)):
    data = Header(kind, job, chunk=request).pack() + (json.dumps(body).encode() if body else b"")
    data += b" " * (4096 - len(data))  # room for the reply: unsigned requests hear no more
    (reply,) = aggregator.on_datagram(memoryview(data), source, 0.0)
    header = parse_header(reply.header)
    return header, json.loads(bytes(reply.payload))


def test_registration_teardown_and_errors_over_control_messages():
    switch = DataPlane(switch_profile())
    spec = int32_job(workers=2)
    header, body = control(switch, Kind.REGISTER, 1, spec.to_json())
    assert (header.kind, header.chunk, body) == (Kind.REGISTERED, 7, {"job": 1})
    header, _ = control(switch, Kind.REGISTER, 1, spec.to_json())  # retried: same answer
    assert header.kind is Kind.REGISTERED
    other = int32_job(workers=3).to_json()
    header, body = control(switch, Kind.REGISTER, 1, other)
    assert header.kind is Kind.ERROR and body["code"] == "job_exists"
    header, body = control(switch, Kind.REGISTER, 2, {"job": 2, "addresses": "nope"})
    assert header.kind is Kind.ERROR and body["code"] == "bad_spec"
    header, body = control(switch, Kind.STATS_REQUEST, 0)
    assert header.kind is Kind.STATS and "1" in body["jobs"]
    header, final = control(switch, Kind.TEARDOWN, 1)
    assert header.kind is Kind.TORN_DOWN and 1 not in switch.jobs
    header, body = control(switch, Kind.TEARDOWN, 1)  # retried: the same final counters
    assert header.kind is Kind.TORN_DOWN and body == final
    header, body = control(switch, Kind.TEARDOWN, 4)
    assert header.kind is Kind.ERROR and body["code"] == "unknown_job"


def test_two_jobs_share_a_switch_without_touching_each_other():
    first, second = int32_job(workers=2, job=1), int32_job(workers=3, job=2)
    second = JobSpec(2, tuple(("10.0.2.1", 7000 + w) for w in range(3)), 2, 8, second.op)
    switch = switch_with(first, second)
    send(switch, first, 0, 0, [1] * 8)
    send(switch, second, 0, 0, [10] * 8)
    send(switch, second, 1, 0, [10] * 8)
    (result_first,) = sends(send(switch, first, 1, 0, [2] * 8))
    (result_second,) = sends(send(switch, second, 2, 0, [10] * 8))
    assert lanes_of(result_first) == [3] * 8 and lanes_of(result_second) == [30] * 8
    # A worker of job 1 sending as job 2 is refused: its address is not job 2's.
    packet = lane_packet(second, 0, 1, np.ones(8, "<i4").tobytes(), 8)
    assert drops(switch.on_datagram(memoryview(packet), first.addresses[0], 0.0)) == [
        "wrong_source"
    ]


def test_two_level_hierarchy_sums_through_the_parent_and_passes_the_result_down():
    root_address = ("10.0.0.2", 48864)
    leaf_addresses = [("10.0.0.3", 48864), ("10.0.0.4", 48864)]
    op = IntegerSum(32, 32, True)
    root_spec = JobSpec(9, tuple(leaf_addresses), 1, 8, op, max_contributors=4)
    root = switch_with(root_spec)
    leaves, specs = [], []
    for leaf in range(2):
        workers = tuple(("10.0.1.1", 6000 + 10 * leaf + w) for w in range(2))
        spec = JobSpec(1, workers, 1, 8, op, max_contributors=4,
                       parent=ParentLink(root_address, 9, leaf))  # fmt: skip
        leaves.append(switch_with(spec))
        specs.append(spec)
    to_root = []
    for leaf in range(2):
        send(leaves[leaf], specs[leaf], 0, 0, [1 + leaf] * 8)
        (forward,) = sends(send(leaves[leaf], specs[leaf], 1, 0, [10] * 8))
        assert forward.what == "forward" and forward.destinations == (root_address,)
        assert parse_header(forward.header).flags & Flag.PRESUMMED
        to_root.append(forward)
    # A worker retransmitting while its switch waits for the root makes the switch re-forward.
    (again,) = sends(send(leaves[0], specs[0], 0, 0, [1] * 8))
    assert again.what == "forward"
    for leaf, forward in enumerate(to_root):
        data = forward.header + bytes(forward.payload)
        actions = root.on_datagram(memoryview(data), leaf_addresses[leaf], 0.0)
    (down,) = sends(actions)
    assert lanes_of(down) == [23] * 8
    assert parse_header(down.header).contributors == 4
    for leaf in range(2):
        data = down.header + bytes(down.payload)
        (result,) = sends(leaves[leaf].on_datagram(memoryview(data), root_address, 0.0))
        assert result.what == "multicast" and result.destinations == specs[leaf].addresses
        assert lanes_of(result) == [23] * 8
        assert parse_header(result.header).contributors == 4
    # A result from anyone but the parent is refused.
    data = down.header + bytes(down.payload)
    assert drops(leaves[0].on_datagram(memoryview(data), SWITCH, 0.0)) == ["unexpected_result"]


def test_header_round_trip_and_payload_offset():
    header = Header(Kind.DATA, 3, 4, 5, 1, Op.MAX, 0, 2**40, 16, 2, 2**64 - 3)
    data = header.pack() + b"x" * 64
    assert parse_header(data) == header
    assert len(header.pack()) == HEADER_SIZE == 40
    assert data[32:40] == (2**64 - 3).to_bytes(8, "little")  # the token, protocol 2


def test_a_group_must_be_an_ipv4_multicast_address_and_survives_the_json_round_trip():
    spec = int32_job(workers=2, group=("239.7.8.9", 48864))
    assert JobSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    for bad in (("10.0.0.1", 5000), ("ff02::1", 5000), ("239.1.1.1", 0), ("host", 1)):
        with pytest.raises(SpecError, match=r"^group"):
            int32_job(workers=2, group=bad)

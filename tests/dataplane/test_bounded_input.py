"""Bounded, validated input to the data plane: bounded JSON, a schema checked field by field,
handlers that cannot raise past ``on_datagram``, contributors and partial sums that can neither
wedge a round nor wrap a sum, paged statistics and admission limits."""

import json
from dataclasses import replace

import numpy as np
import pytest

from gradsum.dataplane import (
    DataPlane,
    Header,
    IntegerSum,
    JobSpec,
    Kind,
    Op,
    bounded_json,
    switch_profile,
)
from gradsum.dataplane.actions import Drop, Send
from gradsum.dataplane.jobspec import ParentLink, SpecError
from gradsum.dataplane.packet import HEADER_SIZE, PRESUMMED, parse_header
from gradsum.dataplane.plane import STATS_PAGE_JOBS, slot_memory

from .helpers import data_packet, int32_job, send, switch_with

STRANGER = ("10.9.9.9", 1)


def control(aggregator, kind, job, body=b"", request=7, pad=4096):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    data = Header(kind, job, chunk=request).pack() + raw
    data += b" " * max(0, pad - len(data))  # room for an unsigned request's reply
    (reply,) = aggregator.on_datagram(memoryview(data), STRANGER, 0.0)
    return parse_header(reply.header).kind, json.loads(bytes(reply.payload))


SPEC_BODY = int32_job(workers=2).to_json()

# The four datagrams that killed both daemons (issue 17), as REGISTER bodies.
CRASHES = {
    "nested 987 deep": b'{"job": 1, "addresses": ' + b"[" * 987 + b"]" * 987 + b"}",
    "an integer of 4,400 digits": b'{"job": ' + b"7" * 4400 + b"}",
    "an unresolvable host name": json.dumps(
        {**SPEC_BODY, "addresses": ["no-such-host.invalid:5000", "10.0.1.1:5001"]}
    ).encode(),
    "a lone UTF-16 surrogate": json.dumps(
        {**SPEC_BODY, "addresses": ["\ud800:5000", "10.0.1.1:5001"]}
    ).encode(),
}


@pytest.mark.parametrize("what", CRASHES)
def test_each_crash_datagram_gets_an_error_and_the_job_keeps_summing(what):
    spec = int32_job(workers=2, job=3)
    switch = switch_with(spec)
    kind, body = control(switch, Kind.REGISTER, 1, CRASHES[what])
    assert kind is Kind.ERROR and body["code"] in ("bad_request", "bad_spec"), body
    assert 1 not in switch.jobs
    send(switch, spec, 0, 0, [5] * 8)
    (_, result) = send(switch, spec, 1, 0, [6] * 8)
    assert np.frombuffer(bytes(result.payload), "<i4").tolist() == [11] * 8


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        (b"[" * 9 + b"]" * 9, "nested 9 deep"),
        (b'{"a": ' + b"1" * 21 + b"}", "digits"),
        (b'{"a": NaN}', "not a JSON number"),
        (b'{"a": 1e999}', "out of range"),
        (b'["\\udfff"]', "surrogate"),
        (b'"' + b"x" * 2000 + b'"', "characters"),
        (b"\xff", "UTF-8"),
        (b"{", "not JSON"),
    ],
)
def test_bounded_json_refuses_what_breaks_a_limit(text, limit):
    with pytest.raises(bounded_json.JsonRefused, match=limit):
        bounded_json.loads(text)


def test_bounded_json_ignores_brackets_inside_strings():
    assert bounded_json.loads(b'{"a": "[[[[[[[[[[[[", "b": [1, [2]]}') == {
        "a": "[[[[[[[[[[[[", "b": [1, [2]]
    }  # fmt: skip


def mutated(path: str, value) -> dict:
    body = json.loads(json.dumps(SPEC_BODY))
    *outer, last = path.split(".")
    where = body
    for key in outer:
        where = where[key]
    where[last] = value
    return body


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("job", "1", "job"),
        ("job", True, "job"),
        ("job", 70000, "job"),
        ("slots", 1.5, "slots"),
        ("elements", 0, "elements"),
        ("elements", 20000, "elements"),  # 20000 int32 lanes: no datagram carries them
        ("addresses", ["10.0.0.1"], "addresses[0]"),
        ("addresses", ["10.0.0.1:0"], "addresses[0]"),
        ("addresses", ["localhost:5000"], "addresses[0]"),
        ("addresses", [5000], "addresses[0]"),
        ("addresses", "10.0.0.1:1", "addresses"),
        ("max_contributors", 70000, "max_contributors"),
        ("deadline", "soon", "deadline"),
        ("deadline", -1, "deadline"),
        ("op.kind", "xor", "op.kind"),
        ("op.signed", "yes", "op.signed"),
        ("op.in_bits", None, "op.in_bits"),
        ("op.extra", 1, "op.extra"),
        ("surplus", 1, "surplus"),
        ("parent", {"address": "host:1", "job": 1, "worker": 0}, "parent.address"),
        ("parent", {"address": "10.0.0.9:1", "job": 1, "worker": 0, "x": 1}, "parent.x"),
        ("group", "239.1.2.3", "group"),
    ],
)
def test_the_schema_names_the_field_it_refuses(path, value, named):
    with pytest.raises(SpecError, match=f"^(unknown field )?'?{named.replace('[', '.')}"):
        JobSpec.from_json(mutated(path, value))


def test_table_entries_must_be_integers():
    body = {**SPEC_BODY, "op": {"kind": "integer-sum", "in_bits": 2, "out_bits": 8,
                                "table": [0, 1, 2.5, 3]}}  # fmt: skip
    with pytest.raises(SpecError, match=r"op.table\[2\] must be an integer"):
        JobSpec.from_json(body)


def test_addresses_are_normalized_ip_literals():
    body = {**SPEC_BODY, "addresses": ["[0:0::1]:5000", "10.0.1.1:5001"]}
    assert JobSpec.from_json(body).addresses == (("::1", 5000), ("10.0.1.1", 5001))


# -- nothing raises past on_datagram ---------------------------------------------------------
HANDLERS = ["_on_data", "_on_parent_result", "_on_control", "register", "teardown",
            "_stats_reply", "count"]  # fmt: skip


@pytest.mark.parametrize("handler", HANDLERS)
def test_no_handler_raises_past_the_data_plane(handler, monkeypatch):
    spec = int32_job(workers=2)
    switch = switch_with(spec)
    calls = {"n": 0}
    original = getattr(switch, handler)

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return original(*args, **kwargs)

    monkeypatch.setattr(switch, handler, broken)
    packets = [
        (data_packet(spec, 0, 0, [1] * 8), spec.addresses[0]),
        (Header(Kind.RESULT, 9, chunk=0).pack(), STRANGER),
        (Header(Kind.REGISTER, 2).pack() + json.dumps(int32_job(job=2).to_json()).encode(),
         STRANGER),
        (Header(Kind.TEARDOWN, 2).pack(), STRANGER),
        (Header(Kind.STATS_REQUEST, 0).pack(), STRANGER),
    ]  # fmt: skip
    outcomes = [switch.on_datagram(memoryview(p), s, 0.0) for p, s in packets]
    assert calls["n"] >= 1, f"{handler} was never reached"
    flat = [a for out in outcomes for a in out]
    errors = [a for a in flat if isinstance(a, Send) and parse_header(a.header).kind is Kind.ERROR]
    drops = [a for a in flat if isinstance(a, Drop) and a.reason == "internal_error"]
    assert errors or drops
    # the job is unharmed: a fresh round still sums exactly
    send(switch, spec, 0, 1, [2] * 8)
    (_, result) = send(switch, spec, 1, 1, [3] * 8)
    assert np.frombuffer(bytes(result.payload), "<i4").tolist() == [5] * 8


def test_a_pool_that_raises_is_dropped_and_counted(monkeypatch):
    spec = int32_job(workers=2)
    switch = switch_with(spec)
    pool = switch.jobs[spec.job].pool
    monkeypatch.setattr(pool, "on_data", lambda *a: 1 / 0)
    (drop,) = send(switch, spec, 0, 0, [1] * 8)
    assert drop.reason == "internal_error" and "ZeroDivisionError" in drop.detail
    assert switch.stats["dropped_internal_error"] == 1


# -- contributors and partial sums ------------------------------------------------------------
def test_a_worker_claiming_every_contribution_cannot_wedge_its_job():
    spec = int32_job(workers=3)
    switch = switch_with(spec)
    (drop,) = send(switch, spec, 0, 0, [1] * 8, contributors=3)
    assert drop.reason == "bad_contributors"
    send(switch, spec, 0, 0, [1] * 8)
    send(switch, spec, 1, 0, [2] * 8)
    *_, result = send(switch, spec, 2, 0, [3] * 8)
    assert parse_header(result.header).contributors == 3
    assert np.frombuffer(bytes(result.payload), "<i4").tolist() == [6] * 8
    assert switch.jobs[spec.job].pool.stats["dropped_bad_contributors"] == 1


def root_job(out_bits=8, table_top=3):
    """A root switch job over two leaves of two workers each (max_contributors 4), lanes of
    2-bit indices into a table whose largest entry is ``table_top``."""
    op = IntegerSum(2, out_bits, table=(0, 1, 2, table_top))
    leaves = (("10.0.2.1", 6000), ("10.0.2.2", 6000))
    return JobSpec(9, leaves, 1, 8, op, max_contributors=4)


def presummed(spec, worker, values, contributors):
    from gradsum.codecs.lanes import packed_nbytes
    from gradsum.dataplane.combiners import pack_lanes

    lanes = np.asarray(values, dtype=np.int32)
    payload = bytes(memoryview(pack_lanes(lanes, spec.op.out_bits)).cast("B"))
    assert len(payload) == packed_nbytes(lanes.size, spec.op.out_bits)
    header = Header(Kind.DATA, spec.job, worker, 0, 0, Op.SUM, PRESUMMED, 0, lanes.size,
                    contributors)  # fmt: skip
    return header.pack() + payload


def test_partial_sums_that_would_pass_out_bits_are_dropped_never_wrapped():
    spec = root_job(out_bits=4, table_top=3)  # 4 contributions of at most 3: 12 < 16
    switch = switch_with(spec)
    # a leaf claiming 2 contributions whose lanes exceed 2 x 3: the sum could wrap at 4 bits
    bad = presummed(spec, 0, [7] * 8, contributors=2)
    (drop,) = switch.on_datagram(memoryview(bad), spec.addresses[0], 0.0)
    assert drop.reason == "overflow"
    # a partial sum that leaves the other leaf no contributor: bad_contributors
    greedy = presummed(spec, 0, [3] * 8, contributors=4)
    (drop,) = switch.on_datagram(memoryview(greedy), spec.addresses[0], 0.0)
    assert drop.reason == "bad_contributors"
    for worker, value in ((0, 6), (1, 5)):
        out = switch.on_datagram(memoryview(presummed(spec, worker, [value] * 8, 2)),
                                 spec.addresses[worker], 0.0)  # fmt: skip
    result = out[-1]
    assert parse_header(result.header).contributors == 4
    from gradsum.dataplane.combiners import _unpack

    assert _unpack(memoryview(bytes(result.payload)), 4, 8).tolist() == [11] * 8
    stats = switch.jobs[spec.job].pool.stats
    assert stats["dropped_overflow"] == 1 and stats["dropped_bad_contributors"] == 1


def test_three_leaves_cannot_take_more_than_their_share():
    op = IntegerSum(32, 32, signed=True)
    leaves = tuple(("10.0.2.1", 6000 + i) for i in range(3))
    spec = JobSpec(9, leaves, 1, 8, op, max_contributors=6)
    switch = switch_with(spec)

    def leaf(worker, contributors):
        header = Header(Kind.DATA, 9, worker, 0, 0, Op.SUM, PRESUMMED, 0, 8, contributors)
        data = header.pack() + np.ones(8, "<i4").tobytes()
        return switch.on_datagram(memoryview(data), leaves[worker], 0.0)

    leaf(0, 3)  # 3 of 6, leaving one each for the other two
    (drop,) = leaf(1, 3)  # 6 would leave the third none: the round could never complete
    assert drop.reason == "too_many_contributors"
    leaf(1, 2)
    *_, result = leaf(2, 1)
    assert parse_header(result.header).contributors == 6


def test_forwarded_max_rounds_are_marked_presummed():
    link = ParentLink(("10.0.3.1", 48864), 9, 0)
    spec = int32_job(workers=2, parent=link)
    switch = DataPlane(switch_profile())
    switch.register(spec)
    send(switch, spec, 0, 0, [1] * 8, op=Op.MAX)
    *_, forward = send(switch, spec, 1, 0, [2] * 8, op=Op.MAX)
    header = parse_header(forward.header)
    assert header.flags & PRESUMMED and header.contributors == 2


# -- statistics and limits ---------------------------------------------------------------------
def test_stats_come_in_bounded_pages_and_one_job_alone():
    switch = DataPlane(switch_profile())
    for job in range(40):
        switch.register(int32_job(workers=2, job=job))
    seen = {}
    for page in range(3):
        data = Header(Kind.STATS_REQUEST, 0, chunk=1).pack() + json.dumps({"page": page}).encode()
        data += b" " * 30000  # room for the reply: an unsigned request hears no more than it says
        (reply,) = switch.on_datagram(memoryview(data), STRANGER, 0.0)
        body = json.loads(bytes(reply.payload))
        assert body["pages"] == 3 and len(body["jobs"]) <= STATS_PAGE_JOBS
        assert HEADER_SIZE + len(reply.payload) < 32 << 10
        seen.update(body["jobs"])
    assert sorted(map(int, seen)) == list(range(40))
    kind, body = control(switch, Kind.STATS_REQUEST, 5, {"job": 5})
    assert kind is Kind.STATS and body["job"] == 5 and "stats" in body
    kind, body = control(switch, Kind.STATS_REQUEST, 0, {"page": "x"})
    assert kind is Kind.ERROR and body["code"] == "bad_request"


def test_jobs_and_memory_are_limited_per_admission_secret():
    one = slot_memory(int32_job(workers=2))
    switch = DataPlane(switch_profile(tenant_jobs=2, tenant_memory=3 * one))
    switch.register(int32_job(workers=2, job=1), tenant="a")
    switch.register(int32_job(workers=2, job=2), tenant="a")
    with pytest.raises(Exception, match="2 jobs of yours"):
        switch.register(int32_job(workers=2, job=3), tenant="a")
    switch.register(int32_job(workers=2, job=3), tenant="b")  # b has its own quota
    with pytest.raises(Exception, match="needs"):
        switch.register(int32_job(workers=2, slots=8, job=4), tenant="b")
    assert switch.memory_usage()["used"] == 3 * one


def test_declared_memory_counts_each_slots_round_state():
    wide, narrow = int32_job(workers=3, slots=2, elements=1), int32_job(workers=3, elements=8)
    switch = DataPlane(switch_profile())
    # a slot of one lane is mostly round state: its accounting is far above 8 bytes a round
    assert switch.register(wide).memory >= 2 * 2 * (4 + 3 + 40)
    assert switch.register(replace(narrow, job=2)).memory >= 2 * 2 * 8 * 4

"""Replay protection that no principal can exhaust for another, refusals that name their
cause, and the control checks that come before any parsing."""

import json
import os

import pytest

from gradsum.dataplane import DataPlane, Header, Kind, switch_profile
from gradsum.dataplane import authentication as auth
from gradsum.dataplane.jobspec import SpecError, parse_address
from gradsum.dataplane.packet import HEADER_SIZE, SIGNED, parse_header

from .helpers import int32_job

TENANT, OTHER = b"t" * 32, b"o" * 32
JOB_KEY = bytes(range(32))
NOW = 1_700_000_000.0
SOURCE = ("10.0.0.1", 9)
FLOOD = 70_000


def _nonce(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_flood_of_one_principal_leaves_every_other_principal_its_window():
    guard = auth.ReplayGuard()
    for i in range(FLOOD):  # 1 ms apart: 70 s of signing squeezed into the 30 s window
        stamp = int(NOW * 1000) + i // 3
        assert guard.check(stamp, _nonce(i), NOW + 1, b"attacker") is None, i
    assert guard.held(b"attacker") <= auth.MAX_NONCES and guard.forgotten == FLOOD - auth.MAX_NONCES
    for name in (b"tenant", b"job 7"):  # the others still get in, many times over
        for i in range(100):
            assert guard.check(int(NOW * 1000), _nonce(i), NOW + 1, name) is None, (name, i)
    # ... and nothing forgotten opened a replay: the flood's early nonces are below its floor
    for i in (0, 1, FLOOD - auth.MAX_NONCES - 1):
        refusal = guard.check(int(NOW * 1000) + i // 3, _nonce(i), NOW + 1, b"attacker")
        assert refusal is not None and "sign it again" in refusal, i
    assert guard.check(int(NOW * 1000) + (FLOOD - 1) // 3, _nonce(FLOOD - 1), NOW + 1,
                       b"attacker") == "a replayed nonce"  # fmt: skip
    assert guard.check(int(NOW * 1000), _nonce(5), NOW + 1, b"tenant") == "a replayed nonce"


def test_room_is_made_at_the_cost_of_the_principal_holding_the_most():
    guard = auth.ReplayGuard(capacity=10)
    stamp = int(NOW * 1000)
    for i in range(3):
        assert guard.check(stamp + i, _nonce(i), NOW, b"honest") is None
    for i in range(7):
        assert guard.check(stamp + i, _nonce(100 + i), NOW, b"heavy") is None
    # full: a newcomer below its share takes room from the heaviest, not from the honest one
    assert guard.check(stamp, _nonce(0), NOW, b"newcomer") is None
    assert (guard.held(b"honest"), guard.held(b"heavy"), guard.held(b"newcomer")) == (3, 6, 1)
    assert guard.check(stamp + 3, _nonce(3), NOW, b"honest") is None  # honest: still fresh
    assert guard.held(b"honest") == 4 and guard.held(b"heavy") == 5


def test_nonces_expire_with_the_window_and_stamps_outside_it_are_refused():
    guard = auth.ReplayGuard(capacity=4)
    assert guard.check(int(NOW * 1000), _nonce(1), NOW, b"a") is None
    assert guard.check(int(NOW * 1000), _nonce(1), NOW, b"a") == "a replayed nonce"
    assert "off the aggregator's clock" in guard.check(int((NOW - 31) * 1000), _nonce(2), NOW)
    later = NOW + 2 * auth.WINDOW_S + 1
    assert guard.check(int(later * 1000), _nonce(1), later, b"a") is None  # expired: forgotten
    assert guard.held(b"a") == 1


# -- the data plane ------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self):
        return self.now


def _signed(kind, job, body, key, stamp=NOW, request=7):
    data = Header(kind, job, flags=SIGNED, chunk=request).pack()
    data += json.dumps(body).encode() if body is not None else b""
    return auth.sign(data, key, stamp)


def _ask(plane, data):
    (reply,) = [a for a in plane.on_datagram(memoryview(data), SOURCE, 0.0) if hasattr(a, "header")]
    raw = reply.header + bytes(reply.payload)
    header = parse_header(raw)
    signed_by = None
    if header.flags & SIGNED:
        signed_by = next((k for k in (TENANT, OTHER, JOB_KEY) if auth.verifies(raw, k)), "?")
        raw = raw[: -auth.TRAILER_SIZE]
    return header.kind, json.loads(raw[HEADER_SIZE:] or b"{}"), signed_by


def _register_body(spec, secret):
    body = spec.to_json()
    nonce = os.urandom(16)
    body["key"] = {"nonce": nonce.hex(), "wrapped": auth.wrap_key(JOB_KEY, secret, nonce).hex()}
    return body


@pytest.mark.parametrize("flooder", ["tenant", "job key"])
def test_after_70000_signed_requests_of_one_principal_another_registers_and_reads_stats(flooder):
    clock = Clock()
    plane = DataPlane(switch_profile(), secrets={"t": TENANT, "o": OTHER}, wall=clock)
    spec = int32_job(workers=2, job=5)
    kind, _, _ = _ask(plane, _signed(Kind.REGISTER, 5, _register_body(spec, TENANT), TENANT))
    assert kind is Kind.REGISTERED
    # The flood: distinct, valid, signed requests, 70 000 of them within the window. The
    # guard is what such a flood fills; every request also went through the data plane in a
    # smaller flood below, and through a live daemon (tests/net/test_replay_flood.py).
    key, job = (TENANT, 0) if flooder == "tenant" else (JOB_KEY, 5)
    for i in range(FLOOD):
        stamp = int(NOW * 1000) - FLOOD // 3 + i // 3  # the last 23 s up to now
        assert plane.replays.check(stamp, _nonce(i), NOW, key) is None
    for i in range(200):  # and some through the whole path
        body = {"job": 5} if job else None
        kind, reply, _ = _ask(plane, _signed(Kind.STATS_REQUEST, job, body, key, request=i))
        assert kind is Kind.STATS, reply
    kind, reply, signer = _ask(plane, _signed(Kind.REGISTER, 6, _register_body(
        int32_job(workers=2, job=6), OTHER), OTHER))  # fmt: skip
    assert (kind, signer) == (Kind.REGISTERED, OTHER), reply
    kind, reply, signer = _ask(plane, _signed(Kind.STATS_REQUEST, 0, None, OTHER))
    assert (kind, signer) == (Kind.STATS, OTHER) and list(reply["jobs"]) == ["6"], reply
    # the flooder's replays are refused, signed (so its client hears the cause), as replays
    replay = _signed(Kind.STATS_REQUEST, job, {"job": 5} if job else None, key, request=1)
    assert _ask(plane, replay)[0] is not Kind.ERROR
    kind, reply, signer = _ask(plane, replay)
    assert (kind, reply["code"], signer) == (Kind.ERROR, "replayed", key), reply


def test_a_refused_replay_is_signed_so_the_client_names_it_and_not_a_wrong_secret():
    from gradsum.net.client import ControlError, _unsigned_refusal

    plane = DataPlane(switch_profile(), secrets={"t": TENANT}, wall=Clock())
    request = _signed(Kind.STATS_REQUEST, 0, None, TENANT)
    assert _ask(plane, request)[0] is Kind.STATS
    kind, reply, signer = _ask(plane, request)
    assert (kind, reply["code"], signer) == (Kind.ERROR, "replayed", TENANT)
    # an unsigned refusal says what it says; only "unauthenticated" blames the secret
    error = _unsigned_refusal(("h", 1), json.dumps({"code": "too_many_jobs",
                                                    "message": "256 jobs"}).encode())  # fmt: skip
    assert isinstance(error, ControlError) and error.code == "too_many_jobs"
    assert "admission secret" not in str(error) and "256 jobs" in str(error)
    error = _unsigned_refusal(("h", 1), json.dumps({"code": "unauthenticated"}).encode())
    assert error.code == "unauthenticated" and "admission secret" in str(error)


# -- the smaller checks ----------------------------------------------------------------------
def test_an_unsigned_register_is_refused_before_its_body_is_parsed(monkeypatch):
    from gradsum.dataplane import plane as plane_module

    parsed = []
    monkeypatch.setattr(plane_module, "_json_body", lambda payload: parsed.append(1) or {})
    plane = DataPlane(switch_profile(), secrets={"t": TENANT}, wall=Clock())
    data = Header(Kind.REGISTER, 1, chunk=3).pack() + json.dumps(
        int32_job(job=1).to_json()).encode() + b" " * 200  # fmt: skip
    kind, reply, _ = _ask(plane, data)
    assert (kind, reply["code"]) == (Kind.ERROR, "unauthenticated") and parsed == []


@pytest.mark.parametrize("kind, body", [(Kind.TEARDOWN, None), (Kind.STATS_REQUEST, {"job": 5})])
def test_unsigned_teardown_and_stats_of_a_keyed_job_are_unauthenticated_and_others_forbidden(
    kind, body
):
    plane = DataPlane(switch_profile(), secrets={"t": TENANT, "o": OTHER}, wall=Clock())
    spec = int32_job(workers=2, job=5)
    assert _ask(plane, _signed(Kind.REGISTER, 5, _register_body(spec, TENANT), TENANT))[0] \
        is Kind.REGISTERED  # fmt: skip
    unsigned = Header(kind, 5, chunk=4).pack() + (json.dumps(body).encode() if body else b"")
    got, reply, _ = _ask(plane, unsigned + b" " * 400)
    assert (got, reply["code"]) == (Kind.ERROR, "unauthenticated"), reply
    got, reply, _ = _ask(plane, _signed(kind, 5, body, OTHER))  # another tenant's secret
    assert (got, reply["code"]) == (Kind.ERROR, "forbidden"), reply
    assert 5 in plane.jobs


@pytest.mark.parametrize("secrets", [{}, {"t": TENANT}])
def test_a_probe_signed_with_the_key_of_a_job_no_longer_held_hears_unknown_job(secrets):
    plane = DataPlane(switch_profile(), secrets=secrets, wall=Clock())  # "restarted": no jobs
    for kind, body in ((Kind.STATS_REQUEST, {"job": 5}), (Kind.TEARDOWN, None)):
        got, reply, _ = _ask(plane, _signed(kind, 5, body, JOB_KEY))
        assert (got, reply["code"]) == (Kind.ERROR, "unknown_job"), reply
    if secrets:  # the aggregator's own STATS under a wrong secret is still a stranger's
        got, reply, _ = _ask(plane, _signed(Kind.STATS_REQUEST, 0, None, OTHER))
        assert (got, reply["code"]) == (Kind.ERROR, "unauthenticated"), reply


@pytest.mark.parametrize(
    "text", ["[::1:5", "[::1]]:5", "::1:5", "[10.0.0.1:5", "1.2.3.4]:5", "[]:5"]
)
def test_a_malformed_address_is_refused(text):
    with pytest.raises(SpecError):
        parse_address(text)


def test_bracketed_ipv6_and_plain_hosts_still_parse():
    assert parse_address("[::1]:5") == ("::1", 5)
    assert parse_address("10.0.0.1:5") == ("10.0.0.1", 5)
    assert parse_address("localhost:48864") == ("localhost", 48864)

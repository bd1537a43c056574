"""A job's round-trip estimate outlives one stream, and a timeout's backoff holds for new
chunks until a clean sample (TCP's rule with Karn's algorithm)."""

import pytest

from gradsum.dataplane import ChunkStream, RetryPolicy
from gradsum.dataplane.stream import RoundTrip

POLICY = RetryPolicy(timeout=1.0, backoff=2.0, max_timeout=8.0, give_up_after=100.0)


def test_a_new_stream_starts_from_the_round_trips_an_earlier_one_measured():
    rtt = RoundTrip()
    first = ChunkStream(first=0, count=10, slots=1, policy=POLICY, rtt=rtt)
    first.start(0.0)
    now = 0.0
    for chunk in range(10):  # every result takes 3 s, above the 1 s floor
        now += 3.0
        first.on_result(chunk, now)
    second = ChunkStream(first=10, count=1, slots=1, policy=POLICY, rtt=rtt)
    assert second.timeout > 3.0
    assert ChunkStream(first=10, count=1, slots=1, policy=POLICY).timeout == POLICY.timeout


def test_after_a_timeout_new_chunks_keep_the_backed_off_timeout_until_a_clean_sample():
    stream = ChunkStream(first=0, count=4, slots=2, policy=POLICY)
    stream.start(0.0)
    assert stream.expired(1.0) == [0]  # a silent window: 0 probes; both timeouts double to 2 s
    assert stream.timeout == 2.0
    assert stream.on_result(0, 1.5) == [2]  # a resent chunk's result: no sample (Karn)
    assert stream.next_deadline() == pytest.approx(3.0)  # chunk 1 at 1 + 2; chunk 2 at 1.5 + 2
    assert stream.expired(3.0) == []  # a result came 1.5 s ago, within 1's 2 s: it waits
    assert stream.expired(3.4) == []  # chunk 2 got 2 s, not the 1 s floor
    assert stream.on_result(2, 3.6) == []  # sent once, 2.1 s: a clean sample
    assert stream.rtt.backoff == 0.0
    assert stream.timeout == pytest.approx(min(POLICY.max_timeout, 2.1 + 4 * 1.05))


def test_the_backoff_never_passes_the_policy_ceiling():
    rtt = RoundTrip()
    rtt.backed_off(100.0)
    assert rtt.timeout(POLICY) == POLICY.max_timeout


def test_a_prompt_answer_to_a_resend_ends_the_backoff():
    stream = ChunkStream(first=0, count=4, slots=2, policy=POLICY)
    stream.start(0.0)
    assert stream.on_result(0, 0.5) == [2]  # a clean sample: srtt 0.5, timeout 1.5
    assert stream.expired(1.5) == [1]  # silent since 0.5: 1 resent, its timeout doubles to 2
    assert stream.rtt.backoff == 2.0
    # its result 0.4 s after the resend, within srtt + 4 rttvar: it had been lost, and the
    # aggregator answers promptly, so new chunks go back to the round trips' timeout
    assert stream.on_result(1, 1.9) == [3]
    assert stream.rtt.backoff == 0.0
    assert stream.timeout == pytest.approx(1.5)


def test_a_late_answer_to_a_resend_keeps_the_backoff():
    stream = ChunkStream(first=0, count=4, slots=2, policy=POLICY)
    stream.start(0.0)
    stream.on_result(0, 0.5)
    stream.expired(1.5)
    assert stream.on_result(1, 3.2) == [3]  # 1.7 s after the resend: as slow as a timeout
    assert stream.rtt.backoff == 2.0

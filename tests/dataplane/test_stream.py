"""The worker's stream core: window, self-clocking, timers with backoff, layout, sharding."""

import itertools

import pytest

from gradsum.dataplane import AggregationTimeout, ChunkStream, RetryPolicy, StaleChunkError
from gradsum.dataplane.stream import ChunkLayout, RoundTrip, shard_lanes

POLICY = RetryPolicy(timeout=1.0, backoff=2.0, max_timeout=3.0, give_up_after=10.0)


def test_window_holds_one_chunk_per_slot_and_each_result_releases_the_next():
    stream = ChunkStream(first=10, count=7, slots=3, policy=POLICY)
    assert stream.start(0.0) == [10, 11, 12]
    assert stream.on_result(11, 0.1) == [14]
    assert stream.on_result(10, 0.1) == [13]
    assert stream.on_result(10, 0.2) == []  # duplicate
    assert stream.stats.duplicate_results == 1
    for chunk in (12, 13, 14, 15, 16):
        stream.on_result(chunk, 0.3)
    assert stream.done and stream.next_deadline() is None
    assert stream.stats.results == 7 and stream.stats.packets_sent == 7


def test_timeouts_resend_with_backoff_up_to_the_ceiling():
    stream = ChunkStream(first=0, count=3, slots=2, policy=POLICY)  # 2 unsent: no tail probe
    stream.start(0.0)
    assert stream.expired(0.5) == []
    assert stream.expired(1.0) == [0]  # nothing came back yet: probe with the oldest only
    assert stream.next_deadline() == pytest.approx(3.0)  # both timeouts doubled to 2
    stream.on_result(1, 1.5)
    assert stream.expired(3.0) == []  # a result 1.5 s ago, within its 2 s: still flowing
    assert stream.next_deadline() == pytest.approx(6.0)  # capped at 3
    assert stream.expired(6.0) == [0]  # silent for 4.5 s: resend
    assert stream.stats.retransmissions == 2 and stream.stats.timeouts == 2


def test_a_silent_window_is_probed_one_chunk_per_timeout_and_a_flowing_one_waits():
    stream = ChunkStream(first=0, count=6, slots=3, policy=POLICY)
    stream.start(0.0)
    assert stream.expired(1.0) == [0]
    assert stream.expired(3.0) == [0]  # still silent: 1 and 2 back off unsent
    stream.on_result(0, 3.5)  # 3 is sent
    assert stream.expired(6.0) == []  # 1 and 2 late, but a result came 2.5 s ago (< 3 s)
    assert stream.expired(9.0) == [1]  # silent for 5.5 s: probe the oldest
    assert stream.stats.timeouts == 3


def test_three_later_results_resend_an_outstanding_chunk_once_without_waiting_for_its_timer():
    stream = ChunkStream(first=0, count=20, slots=5, policy=POLICY)
    stream.start(0.0)  # chunks 0..4; 0 (or its result) is lost
    assert stream.on_result(1, 0.1) == [6]
    assert stream.on_result(2, 0.1) == [7]
    assert stream.on_result(3, 0.1) == [0, 8]  # third result past chunk 0: resend it now
    assert stream.on_result(4, 0.1) == [9]  # not again for the same send
    assert stream.on_result(6, 0.2) == [11]
    assert stream.stats.fast_retransmissions == 1 and stream.stats.retransmissions == 1
    assert stream.next_deadline() == pytest.approx(1.1)  # its timer restarted at the resend
    assert stream.on_result(0, 0.2) == [5]
    assert stream.stats.timeouts == 0


def test_at_the_end_of_the_stream_each_later_result_may_reveal_a_loss():
    stream = ChunkStream(first=0, count=6, slots=3, policy=POLICY)
    stream.start(0.0)
    assert stream.on_result(0, 0.1) == [3]
    assert stream.on_result(1, 0.1) == [4]
    assert stream.on_result(2, 0.1) == [5]  # everything is sent now
    assert stream.on_result(3, 0.2) == []
    assert stream.on_result(5, 0.2) == [4]  # only one chunk could follow 4: it did, 4 is lost
    assert stream.stats.fast_retransmissions == 1 and stream.stats.timeouts == 0
    assert stream.on_result(4, 0.3) == [] and stream.done


def test_results_of_chunks_sent_before_a_resend_do_not_count_against_it():
    stream = ChunkStream(first=0, count=4, slots=4, policy=POLICY)
    stream.start(0.0)  # all four sent; 0 is lost, then its timer resends it
    assert stream.expired(1.0) == [0]
    assert stream.on_result(1, 1.1) == []  # 1 left before the resend: says nothing about it
    assert stream.on_result(2, 1.1) == [] and stream.on_result(3, 1.1) == []
    assert stream.stats.fast_retransmissions == 0


def test_first_timeout_adapts_to_measured_round_trips_within_the_policy():
    stream = ChunkStream(first=0, count=40, slots=1, policy=POLICY)
    stream.start(0.0)
    assert stream.timeout == POLICY.timeout
    now = 0.0
    for chunk in range(20):  # results take 2 s each: the floor of 1 s would resend every chunk
        now += 2.0
        stream.on_result(chunk, now)
    assert 2.0 < stream.timeout <= POLICY.max_timeout
    assert stream.expired(now + 1.5) == []


def test_giving_up_names_the_chunk_and_how_long_it_waited():
    stream = ChunkStream(first=4, count=1, slots=4, policy=POLICY, what="127.0.0.1:9 job 2")
    stream.start(0.0)
    with pytest.raises(AggregationTimeout, match=r"chunk 4 \(slot 0, version 1\).*job 2"):
        for now in range(1, 20):
            stream.expired(float(now))


def test_stale_for_an_outstanding_chunk_is_an_error_and_otherwise_ignored():
    stream = ChunkStream(first=0, count=2, slots=1, policy=POLICY)
    stream.start(0.0)
    stream.on_stale(1)  # not outstanding: nothing
    with pytest.raises(StaleChunkError):
        stream.on_stale(0)


def test_layout_cuts_packed_lanes_at_byte_boundaries():
    layout = ChunkLayout(lanes=100, lanes_per_chunk=40, in_bits=4, out_bits=7)
    assert layout.chunks == 3
    assert layout.lanes_of(2) == (80, 20)
    assert layout.upstream_bytes(1) == (20, 40)
    assert layout.downstream_bytes(2) == (70, 88)
    with pytest.raises(ValueError, match="multiple of 8"):
        ChunkLayout(100, 12, 4, 7)


def test_shards_are_contiguous_aligned_and_cover_everything():
    shards = shard_lanes(1000, 3, 64)
    assert shards[0][0] == 0 and sum(c for _, c in shards) == 1000
    for (start, count), (following, _) in itertools.pairwise(shards):
        assert start % 64 == 0 and start + count == following
    assert shard_lanes(10, 4, 64) == [(0, 0), (0, 0), (0, 0), (0, 10)]


def test_held_places_go_out_in_chunk_order_whatever_order_results_came_in():
    stream = ChunkStream(first=0, count=6, slots=3)
    stream.ready = 3
    assert stream.start(0.0) == [0, 1, 2]
    for chunk in (2, 0, 1):  # the places of 5, 3 and 4 free up, their payloads not ready
        assert stream.on_result(chunk, 0.1) == []
    # sent in chunk order: results come back in sending order, and one of 4 before 3 would
    # read as 3 lost
    assert stream.release(6, 0.2) == [3, 4, 5]


def test_a_window_place_waits_for_its_chunks_payload_and_release_sends_it():
    stream = ChunkStream(first=10, count=6, slots=2)
    stream.ready = 11  # only chunk 10 has its payload
    assert stream.start(0.0) == [10]
    assert stream.on_result(10, 0.1) == []  # chunk 12's place is free, but 12 is not ready
    assert stream.release(13, 0.2) == [11, 12]  # 11 waited since the start, 12 since 10's result
    assert stream.release(14, 0.3) == []  # 13 is ready, but its place is not free yet
    assert stream.on_result(11, 0.4) == [13]
    assert stream.on_result(12, 0.5) == []  # 14 waits for its payload
    assert stream.release(99, 0.6) == [14]  # bounded by the stream's end
    assert stream.on_result(13, 0.7) == [15]
    for chunk in (14, 15):
        stream.on_result(chunk, 0.8)
    assert stream.done


def test_packets_of_later_chunks_count_against_an_earlier_one_as_results_do():
    stream = ChunkStream(first=0, count=6, slots=4, policy=POLICY)
    assert stream.start(0.0) == [0, 1, 2, 3]
    assert stream.on_progress(1, 0.1) == []
    assert stream.on_progress(0, 0.1) == []  # its own packets count against nothing
    assert stream.on_progress(2, 0.1) == []
    assert stream.on_progress(3, 0.1) == [0]  # three later packets in: 0 lost one
    assert stream.stats.fast_retransmissions == 1
    assert stream.on_progress(5, 0.2) == []  # not outstanding (not even sent): ignored
    assert stream.expired(0.1 + POLICY.timeout / 2) == []  # results flow: no probe


def test_a_chunks_last_packet_past_holes_resends_the_chunk_at_once_and_only_once():
    stream = ChunkStream(first=0, count=1, slots=1, policy=POLICY)  # a stream's one chunk
    assert stream.start(0.0) == [0]
    assert stream.on_progress(0, 0.1) == []  # its first packet
    assert stream.on_progress(0, 0.2, holes=True) == [0]  # its last, with one missing: lost
    assert stream.stats.fast_retransmissions == 1
    # more of its packets past the same holes (answers to its first sending) resend nothing
    assert stream.on_progress(0, 0.25, holes=True) == []
    assert stream.on_result(0, 0.3) == []
    assert stream.stats.fast_retransmissions == 1


def test_a_silent_tail_is_probed_two_round_trips_after_the_last_result_once():
    rtt = RoundTrip(srtt=0.2, rttvar=0.05, backoff=3.0)  # an earlier stream's loss backed off
    stream = ChunkStream(first=0, count=1, slots=1, policy=POLICY, rtt=rtt)  # one chunk
    stream.start(0.0)  # it gets the backed-off 3 s
    assert stream.on_progress(0, 0.3) == []  # a first packet's result, then silence
    assert stream.next_deadline() == pytest.approx(1.3)  # the probe: floor 1 s > 2 srtt
    assert stream.expired(1.3) == [0]  # its missing packets, before the 3 s timer
    assert stream.stats.fast_retransmissions == 1 and stream.stats.timeouts == 0
    assert stream.expired(2.0) == []  # once per silence
    assert stream.next_deadline() == pytest.approx(4.3)  # then the timer, from the probe


def test_no_tail_probe_while_chunks_wait_to_be_sent():
    stream = ChunkStream(first=0, count=3, slots=2, policy=POLICY, rtt=RoundTrip(0.2, 0.05))
    stream.start(0.0)
    stream.on_result(1, 0.3)  # chunk 2 waits for 0's slot: later results will reveal a loss
    assert stream.next_deadline() == pytest.approx(1.0)  # only chunk 0's timer
    assert stream.expired(1.3) == [0] and stream.stats.timeouts == 1


def test_round_trips_are_sampled_at_a_chunks_first_packet():
    stream = ChunkStream(first=0, count=1, slots=1, policy=POLICY)
    stream.start(0.0)
    stream.on_progress(0, 0.2)  # the path's round trip
    stream.on_result(0, 0.9)  # the last packet waited for another worker's recovery
    assert stream.rtt.srtt == pytest.approx(0.2)


def _state(stream):
    return (
        sorted((c, o.deadline, o.retries, o.later, o.sampled)
               for c, o in stream._outstanding.items()),
        sorted(stream._held), stream._received, stream._last_result, stream.stats.as_dict(),
        stream.rtt.srtt, stream.rtt.rttvar,
    )  # fmt: skip


@pytest.mark.parametrize("ready", [40, 23])
def test_a_batch_of_results_is_its_results_one_by_one(ready):
    """``on_results`` (a transport's batch) decides what ``on_result`` decides result by result:
    the same sends in the same order and the same state after, through a lost chunk overtaken
    by later results, a duplicate, results out of order and window places held for payloads.
    Fails with a batch that sends only its first result's next chunk, samples a round trip once
    a batch, or checks for overtaken chunks once a batch."""
    batches = [[1, 2, 3], [4, 4, 6, 5], [7, 9, 8, 10, 11, 12, 13], [0, 14, 15], [16, 17, 18, 19]]
    one, many = (ChunkStream(first=0, count=40, slots=6, policy=POLICY) for _ in range(2))
    for stream in (one, many):
        stream.ready = ready
        assert stream.start(0.0) == list(range(6))
    for k, batch in enumerate(batches):
        now = 0.1 * (k + 1)
        singly = list(itertools.chain.from_iterable(one.on_result(c, now) for c in batch))
        assert many.on_results(batch, now) == singly
        assert _state(many) == _state(one)
    assert one.stats.fast_retransmissions and one.stats.duplicate_results  # both exercised

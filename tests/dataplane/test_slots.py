"""The slot pool state machine, packet by packet - SwitchML's cases and the ones it cannot tell."""

import numpy as np
import pytest

from gradsum.dataplane import Flag, Op, parse_header
from gradsum.dataplane.packet import ANY_WORKER, Kind

from .helpers import drops, int32_job, lanes_of, send, sends, stores, switch_with


def test_basic_reduction_multicasts_the_sum_to_every_worker_once_all_arrived():
    spec = int32_job(workers=3)
    switch = switch_with(spec)
    assert sends(send(switch, spec, 0, 0, [1] * 8)) == []
    assert sends(send(switch, spec, 1, 0, [10] * 8)) == []
    done = send(switch, spec, 2, 0, range(8))
    (multicast,) = sends(done, "multicast")
    assert multicast.destinations == spec.addresses
    assert lanes_of(multicast) == [11 + i for i in range(8)]
    header = parse_header(multicast.header + bytes(multicast.payload))
    assert (header.kind, header.worker, header.chunk, header.contributors) == (
        Kind.RESULT, ANY_WORKER, 0, 3,
    )  # fmt: skip


def test_a_job_with_a_group_multicasts_one_result_there_and_still_answers_retransmissions():
    spec = int32_job(workers=2, group=("239.1.2.3", 5000))
    switch = switch_with(spec)
    send(switch, spec, 0, 0, [3] * 8)
    (multicast,) = sends(send(switch, spec, 1, 0, [4] * 8), "multicast")
    assert multicast.destinations == (("239.1.2.3", 5000),)  # one copy; the network replicates
    (unicast,) = sends(send(switch, spec, 1, 0, [4] * 8))  # its result was lost
    assert unicast.destinations == (spec.addresses[1],)
    assert lanes_of(unicast) == lanes_of(multicast) == [7] * 8


def test_retransmission_after_completion_unicasts_the_same_result_every_time():
    spec = int32_job(workers=2)
    switch = switch_with(spec)
    send(switch, spec, 0, 0, [3] * 8)
    (multicast,) = sends(send(switch, spec, 1, 0, [4] * 8))
    for _ in range(3):
        (unicast,) = sends(send(switch, spec, 0, 0, [3] * 8))
        assert unicast.what == "unicast"
        assert unicast.destinations == (spec.addresses[0],)
        assert lanes_of(unicast) == lanes_of(multicast) == [7] * 8


def test_duplicates_during_aggregation_are_ignored():
    spec = int32_job(workers=3)
    switch = switch_with(spec)
    send(switch, spec, 0, 0, [1] * 8)
    for _ in range(2):
        assert drops(send(switch, spec, 0, 0, [1] * 8)) == ["duplicate"]
    send(switch, spec, 1, 0, [1] * 8)
    (multicast,) = sends(send(switch, spec, 2, 0, [1] * 8))
    assert lanes_of(multicast) == [3] * 8


def test_reduction_in_the_other_version_and_slot_reuse_across_both_versions():
    spec = int32_job(workers=2, slots=2)
    switch = switch_with(spec)
    results = {}
    for chunk in range(8):  # slots 0,1 in version 0, then version 1, then version 0 again ...
        send(switch, spec, 0, chunk, [chunk] * 8)
        (multicast,) = sends(send(switch, spec, 1, chunk, [100] * 8))
        header = parse_header(multicast.header + bytes(multicast.payload))
        assert (header.slot, header.version) == (chunk % 2, (chunk // 2) % 2)
        results[chunk] = lanes_of(multicast)
    assert results == {c: [c + 100] * 8 for c in range(8)}


def test_first_arrival_overwrites_what_the_slot_held_before():
    spec = int32_job(workers=1, slots=1)
    switch = switch_with(spec)
    for chunk, value in enumerate([5, 7, 9]):
        (multicast,) = sends(send(switch, spec, 0, chunk, [value] * 8))
        assert lanes_of(multicast) == [value] * 8


def test_single_worker_completes_every_slot_at_once():
    spec = int32_job(workers=1, slots=3)
    switch = switch_with(spec)
    for chunk in range(6):
        (multicast,) = sends(send(switch, spec, 0, chunk, np.arange(8) * chunk))
        assert lanes_of(multicast) == (np.arange(8) * chunk).tolist()


def test_retransmission_for_previous_version_while_next_one_is_half_full():
    spec = int32_job(workers=2, slots=1)
    switch = switch_with(spec)
    send(switch, spec, 0, 0, [1] * 8)
    (first,) = sends(send(switch, spec, 1, 0, [2] * 8))
    # Worker 1 got the result and moved on to chunk 1 (version 1); worker 0's copy was lost.
    assert stores(send(switch, spec, 1, 1, [50] * 8))
    (unicast,) = sends(send(switch, spec, 0, 0, [1] * 8))
    assert lanes_of(unicast) == lanes_of(first) == [3] * 8
    (second,) = sends(send(switch, spec, 0, 1, [5] * 8))
    assert lanes_of(second) == [55] * 8


def test_a_late_duplicate_of_an_older_round_is_answered_stale_and_changes_nothing():
    spec = int32_job(workers=1, slots=1)
    switch = switch_with(spec)
    for chunk in range(3):
        send(switch, spec, 0, chunk, [chunk] * 8)
    before = switch.jobs[1].pool.acc.copy()
    (stale,) = sends(send(switch, spec, 0, 0, [99] * 8))
    assert stale.what == "stale"
    assert np.array_equal(switch.jobs[1].pool.acc, before)


def test_a_worker_out_of_step_cannot_reopen_an_unfinished_round():
    spec = int32_job(workers=2, slots=1)
    switch = switch_with(spec)
    send(switch, spec, 0, 0, [1] * 8)
    assert drops(send(switch, spec, 1, 2, [1] * 8)) == ["out_of_step"]
    (multicast,) = sends(send(switch, spec, 1, 0, [1] * 8))
    assert lanes_of(multicast) == [2] * 8


def test_max_rounds_take_the_elementwise_maximum():
    spec = int32_job(workers=3)
    switch = switch_with(spec)
    send(switch, spec, 0, 0, [1, -5, 3, 0, 0, 0, 0, 7], op=Op.MAX)
    send(switch, spec, 1, 0, [2, -9, 1, 0, 0, 0, 0, 7], op=Op.MAX)
    (multicast,) = sends(send(switch, spec, 2, 0, [0, -7, 2, 0, 0, 0, 0, 8], op=Op.MAX))
    assert lanes_of(multicast) == [2, -5, 3, 0, 0, 0, 0, 8]


def test_packets_of_another_op_or_length_in_the_same_round_are_dropped():
    spec = int32_job(workers=2)
    switch = switch_with(spec)
    send(switch, spec, 0, 0, [1] * 8)
    assert drops(send(switch, spec, 1, 0, [1] * 8, op=Op.MAX)) == ["mismatch"]
    assert drops(send(switch, spec, 1, 0, [1] * 4)) == ["mismatch"]
    (multicast,) = sends(send(switch, spec, 1, 0, [1] * 8))
    assert lanes_of(multicast) == [2] * 8


def test_short_last_chunk_is_summed_over_its_own_lanes():
    spec = int32_job(workers=2, elements=16)
    switch = switch_with(spec)
    send(switch, spec, 0, 0, [4, 5, 6])
    (multicast,) = sends(send(switch, spec, 1, 0, [1, 1, 1]))
    assert lanes_of(multicast) == [5, 6, 7]


class TestPartialAggregation:
    def spec(self):
        return int32_job(workers=3, slots=1, quorum=2, deadline=0.5)

    def test_a_slot_with_a_quorum_completes_at_the_deadline_carrying_the_count(self):
        spec = self.spec()
        switch = switch_with(spec)
        send(switch, spec, 0, 0, [2] * 8, now=0.0)
        send(switch, spec, 1, 0, [3] * 8, now=0.1)
        assert switch.on_tick(0.4) == []
        assert switch.next_deadline() == pytest.approx(0.5)
        (multicast,) = sends(switch.on_tick(0.5))
        header = parse_header(multicast.header + bytes(multicast.payload))
        assert header.contributors == 2 and header.flags & Flag.PARTIAL
        assert lanes_of(multicast) == [5] * 8

    def test_below_the_quorum_the_slot_keeps_waiting(self):
        spec = self.spec()
        switch = switch_with(spec)
        send(switch, spec, 0, 0, [2] * 8, now=0.0)
        assert switch.on_tick(5.0) == []
        (multicast,) = sends(send(switch, spec, 1, 0, [3] * 8, now=5.0))
        assert lanes_of(multicast) == [5] * 8

    def test_a_straggler_gets_the_partial_result_without_adding_to_it(self):
        spec = self.spec()
        switch = switch_with(spec)
        send(switch, spec, 0, 0, [2] * 8)
        send(switch, spec, 1, 0, [3] * 8)
        (multicast,) = sends(switch.on_tick(1.0))
        (late,) = sends(send(switch, spec, 2, 0, [100] * 8, now=1.1))
        assert late.what == "unicast" and lanes_of(late) == lanes_of(multicast) == [5] * 8

    def test_all_workers_before_the_deadline_complete_at_once_as_usual(self):
        spec = self.spec()
        switch = switch_with(spec)
        for worker in range(3):
            actions = send(switch, spec, worker, 0, [1] * 8)
        (multicast,) = sends(actions)
        assert parse_header(multicast.header).flags == 0
        assert switch.next_deadline() is None

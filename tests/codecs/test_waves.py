"""A streaming reducer's round runs its partitions in waves, preparing the next wave behind the
SUM of the current one (``codecs.round``), with the values of one MAX and one SUM."""

import torch

from gradsum.codecs import make_codec, run_round
from gradsum.codecs.base import combine_summaries
from gradsum.codecs.round import CodecRound, wave_partitions


class StreamingReducer:
    """One worker's round in-process, as a streaming transport drives it: after each piece's
    encode, one item of the work behind the SUM; every step recorded."""

    streams = True

    def __init__(self, codec, events):
        self.codec, self.events = codec, events

    def max(self, summaries):
        self.events.append(("max", len(summaries)))
        return [combine_summaries([s]) for s in summaries]

    def sum(self, phase):
        for i in range(len(phase)):
            payload = phase.encode(i)
            self.events.append(("encode", phase.pieces[i].partition))
            phase.work_behind()
            phase.deliver(i, self.codec.aggregate([payload], phase.aggregator_context(i)))


def test_waves_prepare_the_next_partitions_behind_the_current_sum():
    assert wave_partitions(1) == [[0]]
    assert wave_partitions(7) == [[0], [1, 2], [3, 4, 5, 6]]
    events = []
    # error feedback in the rotated domain: a costly preparation
    codec = make_codec("thc", workers=1, error_feedback=True)
    assert codec.costly_preparation
    precondition = codec.precondition

    def recorded(x, ctx):
        events.append(("prepare", ctx.key[1]))
        return precondition(x, ctx)

    codec.precondition = recorded
    flat = torch.randn(3 * 4096 + 100, generator=torch.Generator().manual_seed(2))
    round_ = CodecRound(codec, 0, 4096)
    prepared = round_.prepare(flat, worker=0, key="t", step=0, lazy=True)
    assert events == []  # nothing before the reducer asks
    average = round_.reduce(prepared, StreamingReducer(codec, events))
    assert events == [
        ("prepare", 0), ("max", 1), ("encode", 0), ("prepare", 1), ("prepare", 2),
        ("max", 2), ("encode", 1), ("prepare", 3), ("encode", 2), ("max", 1), ("encode", 3),
    ]  # fmt: skip
    reference = run_round(make_codec("thc", workers=1, error_feedback=True), [flat], key="t",
                          partition_elements=4096)  # fmt: skip
    assert torch.equal(average, reference.average)


def test_a_cheap_preparation_keeps_one_max_for_all_partitions():
    events = []
    codec = make_codec("bfp", workers=1)
    assert not codec.costly_preparation
    # partitions of 4000 coordinates, not whole blocks: bfp keeps them (it merges whole ones)
    flat = torch.randn(3 * 4000, generator=torch.Generator().manual_seed(3))
    CodecRound(codec, 0, 4000).run(flat, StreamingReducer(codec, events), worker=0, key="b",
                                   step=0)  # fmt: skip
    assert [e for e in events if e[0] == "max"] == [("max", 3)]

"""Aggregators for tests of what sits above a Session (senders, layouts, calibration, the loop):
a real Session over a channel whose rounds are a function or an in-process reducer."""

from __future__ import annotations

from gradsum.codecs import make_codec
from gradsum.sync.aggregator import Aggregator, Channel
from gradsum.sync.session import Session


class Answering(Aggregator):
    """Every round is ``answer(flat, key=, step=, shard=)`` instead of a codec's; ``shards``:
    how many shards a plan may address one by one."""

    def __init__(self, answer, *, shards: int = 0, rank: int = 0, world: int = 1):
        super().__init__(rank, world)
        self.answer, self.shards = answer, shards
        self.connected: list = []  # the wire formats Sessions connected, in order

    def connect(self, wire) -> Channel:
        self.connected.append(wire)
        return _AnsweringChannel(self)


class _AnsweringChannel(Channel):
    def __init__(self, aggregator: Answering):
        super().__init__([None] * (aggregator.shards + 1))
        self.aggregator = aggregator

    def run(self, round_, flat, *, worker, key, step, shard=None):
        self.reducer(shard)  # a shard that does not exist is refused, as on a real channel
        return self.aggregator.answer(flat, key=key, step=step, shard=shard)

    def run_many(self, round_, flats, *, worker, keys, step):
        return [self.run(round_, flat, worker=worker, key=key, step=step)
                for flat, key in zip(flats, keys, strict=True)]  # fmt: skip


class Alone:
    """The in-process reducer of a world of one worker: the codec's own round, exactly."""

    def max(self, summaries):
        return list(summaries)

    def sum(self, phase):
        phase.deliver_all([phase.codec.aggregate([p], phase.aggregator_context(i))
                           for i, p in enumerate(phase.payloads())])  # fmt: skip


class Reducing(Aggregator):
    """One worker's rounds through an in-process reducer (``make()`` builds it per wire)."""

    def __init__(self, make):
        super().__init__(0, 1)
        self.make = make

    def connect(self, wire) -> Channel:
        return Channel([self.make()])


def answering_session(answer, *, shards: int = 0, rank: int = 0, codec: str = "none") -> Session:
    """A Session of ``codec`` whose rounds are ``answer`` (see ``Answering``)."""
    return Session(make_codec(codec), Answering(answer, shards=shards, rank=rank))

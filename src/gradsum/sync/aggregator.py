"""What a Session needs from an aggregator, whatever runs it (all-reduce, switch, parameter server).

``connect(wire)`` is the whole contract: the ``Channel`` that rounds of that wire format take
through the aggregator (a service registers its jobs for it; every worker connects at once).
A channel runs the Session's ``codecs.round.CodecRound`` through a ``Reducer`` (a MAX of
summaries and a SUM of wire payloads), so codec, step, seed and partitioning mean the same on
every aggregator.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..codecs.round import PARTITION_ELEMENTS, CodecRound, Reducer
from ..dataplane.codec_wire import WireFormat


class Channel:
    """The rounds of one wire format through an aggregator: one reducer per shard a plan can
    address by itself, then the one spread over every shard (the only one where there are no
    addressable shards)."""

    def __init__(self, reducers: Sequence[Reducer]):
        if not reducers:
            raise ValueError("a channel needs at least one reducer")
        self.reducers = list(reducers)

    @property
    def shards(self) -> int:
        """How many shards a plan can address one by one (0: none, the whole aggregator)."""
        return len(self.reducers) - 1

    def partition_size(self, requested: int | None) -> int:
        """The partition size its rounds run with: the caller's (2**20 by default), unless the
        transport cannot carry a partition that large."""
        return requested or PARTITION_ELEMENTS

    def reducer(self, shard: int | None) -> Reducer:
        if shard is None:
            return self.reducers[-1]
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} does not exist: this job has {self.shards}")
        return self.reducers[shard]

    def run(self, round_: CodecRound, flat: torch.Tensor, *, worker: int, key: Hashable,
            step: int, shard: int | None = None) -> torch.Tensor:  # fmt: skip
        """This worker's ``round_`` of ``flat`` through the whole aggregator, or through
        ``shard`` alone. Where the codec batches a step (THC on the fused kernels, a reducer
        that does not stream), every partition of ``flat`` is a row of one batched round,
        in launches that do not grow with the partitions (``CodecRound.run_many``; the same
        bits as ``run``); elsewhere it is ``run``."""
        return round_.run_many([flat], self.reducer(shard), worker=worker, keys=[key],
                               step=step)[0]  # fmt: skip

    def run_many(self, round_: CodecRound, flats: Sequence[torch.Tensor], *, worker: int,
                 keys: Sequence[Hashable], step: int) -> list[torch.Tensor]:  # fmt: skip
        """This worker's rounds of several gradients through the whole aggregator, batched
        where the codec batches a step (``CodecRound.run_many``: one MAX and one SUM for all
        it takes; each ``run``'s bits). Every worker must call it with the same gradients."""
        return round_.run_many(flats, self.reducer(None), worker=worker, keys=keys, step=step)


class Aggregator:
    name: str = ""
    # Whether the aggregator sums float32 itself (an all-reduce, a parameter server); a switch
    # adds integers only, so uncompressed gradients cross it as block floating point.
    sums_floats: bool = True

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    def connect(self, wire: WireFormat) -> Channel:
        """Where the rounds of ``wire`` go. Every worker connects the same wire formats in the
        same order (a service registers a job for each)."""
        raise NotImplementedError

    def lossless_codec_name(self) -> str:
        """The codec that carries gradients exactly through this aggregator: fp32 where it sums
        floats, block floating point (fp32's integer carrier) on a switch. Warm-up steps and
        the training loop's uncompressed retries use it."""
        return "none" if self.sums_floats else "bfp"

    def transport_stats(self) -> dict[str, int]:
        """This worker's datagram counters over all its jobs (``dataplane.stream.StreamStats``
        summed: packets sent, retransmissions, timeouts, ...); empty where no gradsum transport
        carries the gradients (all-reduce)."""
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release transport resources (sockets, threads)."""

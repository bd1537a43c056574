"""What a worker needs from an aggregator, whatever runs it (all-reduce, switch, parameter server).

``synchronize(flat, codec, key=, step=, seed=, partition_elements=)`` is the whole contract: the
average over workers of a flat gradient. Every aggregator runs it as the same
``codecs.round.CodecRound`` and contributes only the round's ``Reducer`` (a MAX of summaries and
a SUM of wire payloads), so codec, step, seed and partitioning mean the same everywhere.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..codecs import Codec
from ..codecs.round import PARTITION_ELEMENTS, CodecRound, Reducer


class Aggregator:
    name: str = ""
    # Whether the aggregator sums float32 itself (an all-reduce, a parameter server); a switch
    # adds integers only, so uncompressed gradients cross it as block floating point.
    sums_floats: bool = True

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    def reducer(self, codec: Codec) -> Reducer:
        """The transport that runs a round of ``codec``."""
        raise NotImplementedError

    def synchronize(
        self,
        flat: torch.Tensor,
        codec: Codec,
        *,
        key: Hashable,
        step: int,
        seed: int = 0,
        partition_elements: int | None = None,
    ) -> torch.Tensor:
        """The average of ``flat`` (1-D) over workers, as ``codec`` estimates it."""
        return self.run_round(flat, codec, self.reducer(codec), key, step, seed,
                              partition_elements)  # fmt: skip

    def run_round(
        self, flat: torch.Tensor, codec: Codec, reducer: Reducer, key: Hashable, step: int,
        seed: int, partition_elements: int | None,
    ) -> torch.Tensor:  # fmt: skip
        """This worker's ``CodecRound`` of ``flat`` through ``reducer``."""
        round_ = CodecRound(codec, seed, self.partition_size(codec, partition_elements))
        return round_.run(flat, reducer, worker=self.rank, key=key, step=step)

    def partition_size(self, codec: Codec, requested: int | None) -> int:
        """The partition size a round of ``codec`` runs with: the caller's (2**20 by default),
        unless the transport cannot carry a partition that large."""
        return requested or PARTITION_ELEMENTS

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

    def close(self) -> None:
        """Release transport resources (sockets, threads)."""

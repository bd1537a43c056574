"""What a worker needs from an aggregator, whatever runs it (all-reduce, switch, parameter server).

A round over the partitions of one flat gradient makes two calls, each covering every partition
at once so a transport can batch them:

* ``max_reduce(summaries)``: the preliminary round (elementwise max over workers);
* ``reduce(codec, payloads, contexts, shared)``: sum the payloads over workers and return each
  partition's decoded average.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..codecs import Codec, CodecContext, Payload


class Aggregator:
    name: str = ""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    def max_reduce(self, summaries: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Elementwise max of every partition's summary over all workers."""
        raise NotImplementedError(f"the {self.name} aggregator runs whole rounds: synchronize()")

    def reduce(
        self,
        codec: Codec,
        payloads: Sequence[Payload],
        contexts: Sequence[CodecContext],
        shared: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """The average over workers of every partition, decoded."""
        raise NotImplementedError(f"the {self.name} aggregator runs whole rounds: synchronize()")

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
        """The average of ``flat`` over workers. By default: partition it, then ``max_reduce``
        and ``reduce`` every partition at once (a transport implements those two); a transport
        with its own whole round (the UDP services) overrides this instead."""
        from .pipeline import partitioned_round

        return partitioned_round(
            flat, codec, self, key=key, step=step, seed=seed, partition_elements=partition_elements
        )

    def close(self) -> None:
        """Release transport resources (sockets, threads)."""


def split_like(
    flat: torch.Tensor, parts: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Cut ``flat`` into pieces shaped like the non-None ``parts`` (None stays None)."""
    pieces: list[torch.Tensor | None] = []
    offset = 0
    for part in parts:
        if part is None:
            pieces.append(None)
            continue
        pieces.append(flat[offset : offset + part.numel()].view(part.shape))
        offset += part.numel()
    return pieces

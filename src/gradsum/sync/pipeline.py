"""One synchronisation of a flat gradient: partition, compress, aggregate, decode (transport-free).

The order of calls is the same on every worker, which is what keeps collectives matched.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable

import torch

from ..codecs import Codec, CodecContext
from .aggregator import Aggregator
from .partition import PARTITION_ELEMENTS, partition_bounds


def partitioned_round(
    flat: torch.Tensor,
    codec: Codec,
    aggregator: Aggregator,
    *,
    key: Hashable,
    step: int,
    seed: int = 0,
    partition_elements: int | None = None,
) -> torch.Tensor:
    """The average over workers of ``flat`` (1-D), as the codec estimates it."""
    bounds = partition_bounds(flat.numel(), partition_elements or PARTITION_ELEMENTS)
    contexts = [
        CodecContext(
            seed=seed,
            worker=aggregator.rank,
            step=step,
            partition=partition_id(key, i),
            key=(key, i),
        )
        for i in range(len(bounds))
    ]
    prepared = [
        codec.precondition(flat[start:end], ctx)
        for (start, end), ctx in zip(bounds, contexts, strict=True)
    ]
    summaries = [codec.summarize(x, ctx) for x, ctx in zip(prepared, contexts, strict=True)]
    shared = aggregator.max_reduce(summaries)
    payloads = [
        codec.encode(x, ctx, s) for x, ctx, s in zip(prepared, contexts, shared, strict=True)
    ]
    averages = aggregator.reduce(codec, payloads, contexts, shared)
    return torch.cat(averages) if len(averages) != 1 else averages[0]


def partition_id(key: Hashable, index: int) -> int:
    """A stable integer for (tensor key, partition index), the same in every process, so each
    partition draws its own rounding randomness."""
    return zlib.crc32(repr((key, index)).encode())

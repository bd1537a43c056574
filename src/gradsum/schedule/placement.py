"""Shard placement: which PS shard(s) hold each group.

* :func:`place_whole` — each group lives on one shard, the least loaded so far (ties: lowest
  index). This is the classic PS key→server placement; with equal sizes it is round-robin (P3).
* :func:`place_spread` — group g is cut into ``spans[g]`` near-equal parts on consecutive shards,
  continuing around the ring where the previous group stopped, so consecutive groups — whose push
  and pull overlap in time — land on different shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .plan import Part


def place_whole(ranges: Sequence[tuple[int, int]], num_shards: int) -> list[tuple[Part, ...]]:
    load = np.zeros(num_shards, dtype=np.int64)
    parts = []
    for start, stop in ranges:
        shard = int(np.argmin(load))
        load[shard] += stop - start
        parts.append((Part(shard, start, stop),))
    return parts


def place_spread(
    ranges: Sequence[tuple[int, int]], spans: Sequence[int], num_shards: int
) -> list[tuple[Part, ...]]:
    parts = []
    next_shard = 0
    for (start, stop), span in zip(ranges, spans, strict=True):
        span = max(1, min(span, num_shards, stop - start))
        cuts = np.linspace(start, stop, span + 1).round().astype(np.int64)
        shards = [(next_shard + k) % num_shards for k in range(span)]
        parts.append(
            tuple(
                Part(s, int(a), int(b)) for s, a, b in zip(shards, cuts[:-1], cuts[1:], strict=True)
            )
        )
        next_shard = (next_shard + span) % num_shards
    return parts

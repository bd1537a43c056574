"""Shard placement: which PS shard(s) hold each group.

* :func:`place_whole` — each group lives on one shard, the least loaded so far (ties: lowest
  index). This is the classic PS key→server placement; with equal sizes it is round-robin (P3).
* :func:`place_spread` — group g is cut into ``spans[g]`` near-equal parts on consecutive shards,
  continuing around the ring where the previous group stopped, so consecutive groups — whose push
  and pull overlap in time — land on different shards.
* :func:`place_partitioned` — BytePS-style: a group larger than ``partition`` elements is cut
  into near-equal pieces of at most ``partition`` elements, each on the least-loaded shard, so no
  big tensor sits whole on one server.
* :func:`place_round_robin` — range i whole on shard i mod m: each tensor on one shard in turn
  (a PS without partitioning), or P3's slices dealt over the servers.
* :func:`place_by_layer` — every range on the shard of the layer it belongs to (all of a
  tensor's slices on one server; neither ByteScheduler, whose slices are keys of their own, nor
  P3 does this; kept for comparison).

``PLACEMENTS`` names the ways a baseline places whole-layer groups, ``SLICE_PLACEMENTS`` the ways
priority slices are placed (see :func:`place_groups`, :func:`place_slices`).
"""

from __future__ import annotations

import functools
import itertools
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


def place_round_robin(ranges: Sequence[tuple[int, int]], num_shards: int) -> list[tuple[Part, ...]]:
    return [(Part(i % num_shards, a, b),) for i, (a, b) in enumerate(ranges)]


PLACEMENTS = ("pieces", "whole")  # BytePS partitions; each tensor whole, round-robin
SLICE_PLACEMENTS = ("bytescheduler", "p3", "layer")


def place_groups(
    ranges: Sequence[tuple[int, int]], num_shards: int, placement: str, partition: int
) -> list[tuple[Part, ...]]:
    """Whole-layer groups of a baseline: ``"pieces"`` (BytePS: cut into ≤ ``partition`` elements
    on distinct least-loaded shards) or ``"whole"`` (each group on one shard, round-robin)."""
    if placement == "pieces":
        return place_partitioned(ranges, num_shards, partition)
    if placement == "whole":
        return place_round_robin(ranges, num_shards)
    raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")


def place_slices(
    slices: Sequence[tuple[int, int]],
    layer_offsets: Sequence[int],
    num_shards: int,
    placement: str,
) -> list[tuple[Part, ...]]:
    """Priority slices: ``"bytescheduler"`` (each slice its own key, placed like any key on the
    least-loaded server), ``"p3"`` (dealt round-robin over the servers) or ``"layer"`` (all of a
    layer's slices on its shard)."""
    if placement == "bytescheduler":
        return place_whole(slices, num_shards)
    if placement == "p3":
        return place_round_robin(slices, num_shards)
    if placement == "layer":
        return place_by_layer(slices, layer_offsets, num_shards)
    raise ValueError(f"unknown slice placement {placement!r}; choose one of {SLICE_PLACEMENTS}")


def place_spread(
    ranges: Sequence[tuple[int, int]], spans: Sequence[int], num_shards: int
) -> list[tuple[Part, ...]]:
    parts = []
    next_shard = 0
    for (start, stop), span in zip(ranges, spans, strict=True):
        span = max(1, min(span, num_shards, stop - start))
        exact = type(start) is type(stop) is type(span) is type(num_shards) is int
        spread = _spread if exact else _spread.__wrapped__
        parts.append(spread(start, stop, span, next_shard, num_shards))
        next_shard = (next_shard + span) % num_shards
    return parts


@functools.lru_cache(maxsize=1 << 16)
def _spread(start: int, stop: int, span: int, first: int, num_shards: int) -> tuple[Part, ...]:
    """[start, stop) in ``span`` parts on consecutive shards from ``first``. The planners'
    searches place the same groups in thousands of candidates: the parts (frozen) are shared,
    where the arguments are Python ints (a numpy int equal to one would find its parts)."""
    cuts = even_cuts(start, stop, span)
    return tuple(Part((first + k) % num_shards, cuts[k], cuts[k + 1]) for k in range(span))


def even_cuts(start: int, stop: int, pieces: int) -> list[int]:
    """``pieces + 1`` boundaries cutting [start, stop) into nearly equal pieces: the values of
    ``np.linspace(start, stop, pieces + 1).round()``, computed with the same floating-point
    operations (the planners' searches place thousands of candidate plans, and numpy's call
    costs more than the arithmetic)."""
    if pieces < 1:
        return [start]
    step = float(stop - start) / pieces
    return [start, *(round(i * step + start) for i in range(1, pieces)), stop]


def place_partitioned(
    ranges: Sequence[tuple[int, int]], num_shards: int, partition: int
) -> list[tuple[Part, ...]]:
    load = np.zeros(num_shards, dtype=np.int64)
    parts = []
    for start, stop in ranges:
        pieces = min(num_shards, -(-(stop - start) // partition))
        group = []
        for a, b in itertools.pairwise(even_cuts(start, stop, pieces)):
            free = np.where(np.isin(np.arange(num_shards), [p.shard for p in group]), np.inf, load)
            shard = int(np.argmin(free))
            load[shard] += b - a
            group.append(Part(shard, int(a), int(b)))
        parts.append(tuple(group))
    return parts


def place_by_layer(
    ranges: Sequence[tuple[int, int]], layer_offsets: Sequence[int], num_shards: int
) -> list[tuple[Part, ...]]:
    layers = list(itertools.pairwise(layer_offsets))
    shard_of_layer = [p[0].shard for p in place_whole(layers, num_shards)]
    owner = np.searchsorted(np.asarray(layer_offsets), [a for a, _ in ranges], side="right") - 1
    return [(Part(shard_of_layer[k], a, b),) for (a, b), k in zip(ranges, owner, strict=True)]

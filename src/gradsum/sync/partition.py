"""Cutting a flat gradient into partitions, the unit a codec compresses and an aggregator sums.

THC's authors use partitions of 2**20 coordinates (4 MiB of fp32): large enough to amortise the
preliminary round and keep the rotation's padding small, small enough to pipeline.
"""

from __future__ import annotations

PARTITION_ELEMENTS = 1 << 20


def partition_bounds(total: int, size: int = PARTITION_ELEMENTS) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``total`` elements; the last one may be shorter."""
    if size < 1:
        raise ValueError(f"partition size must be >= 1, got {size}")
    return [(start, min(start + size, total)) for start in range(0, total, size)]

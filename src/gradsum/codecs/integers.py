"""Integer views of homomorphic payloads, for transports that sum integers themselves.

An all-reduce (or any summing transport) needs the exact integers an aggregator would add:
``to_integers`` gives them for one upstream payload (THC: table values of the indices; uniform
THC: the values; bfp: the int32 values), and ``from_integers`` wraps a sum of them, as it is,
into the downstream payload the codec decodes (``Payload.unpacked``: no repacking).
``sum_dtype`` is the narrowest dtype that holds every sum exactly, chosen up front from the
configured worker count, so no sum is checked on the hot path (``check_workers`` refuses more
contributors than that). All of it is read from the codec's declared wire facts
(``lane_fields``, ``lane_widths``, ``integer_op``), so a new integer codec needs nothing here.
"""

from __future__ import annotations

import functools

import torch

from .base import Codec, Payload, WidthOverflowError
from .bits import unpack_bits

FLOAT16_EXACT_BITS = 11
"""float16 holds every integer up to 2**11 = 2048 exactly, and a sum of non-negative integers
never exceeds its total, so sums below 2**11 add exactly in float16 in any order (a ring's)."""


def sum_dtype(codec: Codec) -> torch.dtype:
    """uint8 while the sums fit 8 bits (THC at g = 30: up to 8 workers), float16 integers while
    they stay below 2**11 (up to 68 workers), int32 beyond and for signed lanes (bfp)."""
    op = codec.integer_op()
    if op.signed or op.out_bits > FLOAT16_EXACT_BITS:
        return torch.int32
    return torch.uint8 if op.out_bits <= 8 else torch.float16


def check_workers(codec: Codec, contributors: int) -> None:
    """The sums' width is the configured workers'; more contributors could overflow it."""
    if contributors > codec.workers:
        raise WidthOverflowError(
            f"{contributors} workers sum {codec.name} lanes sized for the {codec.workers} "
            f"workers the codec was configured for; configure it with workers={contributors}"
        )


def to_integers(codec: Codec, payload: Payload) -> torch.Tensor:
    field = payload.fields[_fields(codec)[0]]
    in_bits, _ = codec.lane_widths()
    if in_bits == 32:  # whole int32 lanes, summed as they are
        return field
    op = codec.integer_op()
    values = unpack_bits(field, in_bits, codec.lanes(payload.length))
    if op.table is not None:
        values = _table(op.table, values.device)[values.long()]
    return values.to(sum_dtype(codec))


def from_integers(codec: Codec, sums: torch.Tensor, length: int, contributors: int) -> Payload:
    """The downstream payload of ``contributors`` workers' summed integers (``check_workers``
    ran before the sum: they fit by construction)."""
    _, out_bits = codec.lane_widths()
    if out_bits == 32:  # whole int32 lanes: the packed form is the sums themselves
        return Payload({_fields(codec)[1]: sums}, length, contributors)
    return Payload({_fields(codec)[1]: sums}, length, contributors, unpacked=True)


def _fields(codec: Codec) -> tuple[str, str]:
    if codec.lane_fields is None or not codec.aggregation.integer_only:
        raise TypeError(f"codec {codec.name!r} has no integer form; it is not integer-homomorphic")
    return codec.lane_fields


@functools.lru_cache(maxsize=64)
def _table(table: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.int32, device=device)

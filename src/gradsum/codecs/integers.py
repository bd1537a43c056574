"""Integer views of homomorphic payloads, for transports that sum integers themselves.

An all-reduce (or any summing transport) needs the exact integers an aggregator would add:
``to_integers`` gives them for one upstream payload (THC: table values of the indices; uniform
THC: the values; bfp: the int32 values), and ``from_integers`` wraps a sum of them back into the
downstream payload the codec decodes. ``sum_dtype`` is the narrowest dtype that holds the sum.
All of it is read from the codec's declared wire facts (``lane_fields``, ``lane_widths``,
``integer_op``), so a new integer codec needs nothing here.
"""

from __future__ import annotations

import functools

import torch

from .base import Codec, Payload
from .bits import pack_bits, unpack_bits


def sum_dtype(codec: Codec) -> torch.dtype:
    op = codec.integer_op()
    return torch.uint8 if not op.signed and op.out_bits <= 8 else torch.int32


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
    _, out_bits = codec.lane_widths()
    packed = sums if out_bits == 32 else pack_bits(sums, out_bits)  # packing checks the width
    return Payload({_fields(codec)[1]: packed}, length, contributors)


def _fields(codec: Codec) -> tuple[str, str]:
    if codec.lane_fields is None or not codec.aggregation.integer_only:
        raise TypeError(f"codec {codec.name!r} has no integer form; it is not integer-homomorphic")
    return codec.lane_fields


@functools.lru_cache(maxsize=64)
def _table(table: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.int32, device=device)

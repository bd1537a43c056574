"""Integer views of homomorphic payloads, for transports that sum integers themselves.

An all-reduce (or any summing transport) needs the exact integers an aggregator would add:
``to_integers`` gives them for one upstream payload (THC: table values of the indices; uniform
THC: the values; bfp: the int32 values), and ``from_integers`` wraps a sum of them back into the
downstream payload the codec decodes. ``sum_dtype`` is the narrowest dtype that holds the sum.
"""

from __future__ import annotations

import torch

from .base import Codec, Payload
from .bfp import BlockFloatingPoint
from .bits import pack_bits, unpack_bits
from .feedback import ErrorFeedback
from .thc.codec import DOWNSTREAM, THC, UPSTREAM, GridCodec
from .thc.hadamard import padded_length


def _unwrap(codec: Codec) -> Codec:
    return codec.inner if isinstance(codec, ErrorFeedback) else codec


def integer_count(codec: Codec, length: int) -> int:
    """How many integers stand for ``length`` coordinates (THC pads to its rotation length)."""
    inner = _unwrap(codec)
    if isinstance(inner, THC):
        return padded_length(length, inner.rotation_block)
    return length


def sum_dtype(codec: Codec) -> torch.dtype:
    op = codec.integer_op()
    return torch.uint8 if not op.signed and op.out_bits <= 8 else torch.int32


def to_integers(codec: Codec, payload: Payload) -> torch.Tensor:
    inner = _unwrap(codec)
    if isinstance(inner, BlockFloatingPoint):
        return payload.fields["values"]
    if isinstance(inner, GridCodec):
        op = inner.integer_op()
        count = integer_count(inner, payload.length)
        values = unpack_bits(payload.fields[UPSTREAM], op.in_bits, count)
        if op.table is not None:
            values = torch.tensor(op.table, dtype=torch.int32, device=values.device)[values.long()]
        return values.to(sum_dtype(inner))
    raise TypeError(f"codec {codec.name!r} has no integer form; it is not integer-homomorphic")


def from_integers(codec: Codec, sums: torch.Tensor, length: int, contributors: int) -> Payload:
    inner = _unwrap(codec)
    if isinstance(inner, BlockFloatingPoint):
        return Payload({"values": sums.to(torch.int32)}, length, contributors)
    if isinstance(inner, GridCodec):
        packed = pack_bits(sums, inner.integer_op().out_bits)  # checks the width
        return Payload({DOWNSTREAM: packed}, length, contributors)
    raise TypeError(f"codec {codec.name!r} has no integer form; it is not integer-homomorphic")

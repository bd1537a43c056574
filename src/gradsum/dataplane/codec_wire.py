"""How a codec's payloads travel: the aggregator op a job registers and which fields are lanes.

Homomorphic codecs (bfp, thc, thc-uniform, none) send one packed field as lanes, cut into chunks
and summed slot by slot; the result is the downstream field. Every other codec sends a whole
serialized payload per partition, and a parameter server runs ``codec.aggregate`` on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codecs.base import Aggregation, Codec
from .jobspec import DecodeSumEncode, FloatSum, IntegerSum, OpSpec
from .packet import MAX_PAYLOAD

# Field names of the codecs' payloads, upstream and downstream. The codec interface does not
# expose them yet (asked for: a ``Codec.wire_fields()``); until then they are listed here.
_LANE_FIELDS = {
    "bfp": ("values", "values"),
    "none": ("values", "values"),
    "thc": ("indices", "sums"),
    "thc-uniform": ("indices", "sums"),
}


@dataclass(frozen=True)
class WireFormat:
    op: OpSpec
    in_bits: int = 0
    out_bits: int = 0
    upstream: str | None = None  # None: whole serialized payloads, one per partition
    downstream: str | None = None

    @property
    def lanes(self) -> bool:
        return self.upstream is not None

    def lanes_per_packet(self) -> int:
        """Most lanes (a multiple of 8) whose packed bytes fit one datagram both ways."""
        return lanes_fitting(max(self.in_bits, self.out_bits))


def lanes_fitting(bits: int) -> int:
    return (MAX_PAYLOAD * 8 // bits) // 8 * 8


def wire_format(codec: Codec, options: dict | None = None, seed: int = 0) -> WireFormat:
    if codec.aggregation is Aggregation.DECODE_SUM_ENCODE:
        return WireFormat(DecodeSumEncode(codec.name, dict(options or {}), seed))
    if codec.name not in _LANE_FIELDS:
        raise ValueError(f"codec {codec.name!r}: its payload fields are unknown to the transport")
    upstream, downstream = _LANE_FIELDS[codec.name]
    if codec.aggregation is Aggregation.FLOAT_SUM:
        return WireFormat(FloatSum(), 32, 32, upstream, downstream)
    integer = codec.integer_op()
    op = IntegerSum.from_integer_op(integer)
    return WireFormat(op, integer.in_bits, integer.out_bits, upstream, downstream)

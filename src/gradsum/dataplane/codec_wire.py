"""How a codec's payloads travel: the aggregator operation a job registers, and the lanes.

Everything here is read from the codec's declared wire facts (``Codec.lane_fields``,
``lane_widths``, ``integer_op``, ``aggregation``): homomorphic codecs send one packed field as
lanes, cut into chunks and summed slot by slot, and the result fills the downstream field; every
other codec sends a whole serialized payload per piece, and a parameter server runs
``codec.aggregate`` on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codecs.base import Aggregation, Codec
from .jobspec import DecodeSumEncode, FloatSum, IntegerSum, OpSpec


@dataclass(frozen=True)
class WireFormat:
    op: OpSpec
    in_bits: int = 0
    out_bits: int = 0

    @property
    def lanes(self) -> bool:
        """Whether payloads travel as lanes (homomorphic) or whole (decode-sum-encode)."""
        return self.in_bits > 0


def wire_format(codec: Codec, options: dict | None = None, seed: int = 0) -> WireFormat:
    """The job a codec needs; ``options`` and ``seed`` rebuild it at a decoding server."""
    if codec.lane_fields is None:
        return WireFormat(DecodeSumEncode(codec.name, dict(options or {}), seed))
    in_bits, out_bits = codec.lane_widths()
    if codec.aggregation is Aggregation.FLOAT_SUM:
        return WireFormat(FloatSum(), in_bits, out_bits)
    return WireFormat(IntegerSum.from_integer_op(codec.integer_op()), in_bits, out_bits)

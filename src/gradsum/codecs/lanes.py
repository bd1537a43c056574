"""Integer lanes as an aggregator sees them, importable without torch: the exact integer
operation of a homomorphic codec and the size of packed lanes. A switch needs nothing else from
the codecs, so ``gradsum switch`` starts without loading torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IntegerOp:
    """The exact integer operation an aggregator runs for a homomorphic codec.

    ``table`` maps each upstream value (an index of ``in_bits`` bits) to the integer that is
    summed; ``None`` sums the values themselves. Sums of up to ``workers`` contributions fit in
    ``out_bits`` (unsigned when ``signed`` is false).
    """

    in_bits: int
    out_bits: int
    signed: bool
    table: tuple[int, ...] | None = None


def packed_nbytes(count: int, width: int) -> int:
    """Bytes of ``count`` lanes of ``width`` bits packed back to back."""
    return (count * width + 7) // 8

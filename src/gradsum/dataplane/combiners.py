"""The arithmetic of a slot: how one contribution's lanes enter it and how its result is written.

Two shapes of operation:

* accumulating (``IntegerSumOp``, ``MaxOp``): a running int32 vector per slot; the first
  arrival overwrites, later ones add (or max). Integer-only, bounded memory: what a switch runs.
* collecting (``FloatSumOp``, ``DecodeSumEncodeOp``): each worker's contribution is kept and the
  result is computed at completion, in worker order, so it never depends on arrival order.
  Parameter servers only.

Every ``check_payload`` runs before a slot is touched, so a malformed payload never changes one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..codecs.lanes import packed_nbytes
from ..codecs.thc import switch_kernels
from .jobspec import DecodeSumEncode, IntegerSum
from .packet import MAX_PAYLOAD, MalformedPacket

if TYPE_CHECKING:
    from ..codecs.base import Payload

# torch loads only where a server decodes: the integer ops a switch runs are numpy and C, and
# `gradsum switch` starts without torch.


class IntegerSumOp:
    accumulating = True

    def __init__(self, spec: IntegerSum, elements: int):
        self.spec = spec
        self.in_bits, self.out_bits = spec.in_bits, spec.out_bits
        self._byte_table = _byte_lookup(spec) if 8 % self.in_bits == 0 else None
        self._lane_table = None
        if spec.table is not None:
            self._lane_table = np.asarray(spec.table, dtype=np.int32)
        self._scratch = np.empty(elements + 8, dtype=np.int32)
        values = spec.table if spec.table is not None else range(1 << min(self.in_bits, 8))
        self._index_table = np.asarray(values, dtype=np.int32)

    def check_payload(self, nbytes: int, elements: int, presummed: bool) -> None:
        width = self.out_bits if presummed else self.in_bits
        _expect_bytes(nbytes, packed_nbytes(elements, width))

    def check_presummed(self, payload: memoryview, elements: int, contributors: int) -> None:
        """A child switch's partial sum of ``contributors`` unsigned contributions is at most
        ``max_lane * contributors`` per lane; more would let the job's sum pass ``out_bits``
        (and wrap), so such a packet is refused before it touches a slot. Signed int32 sums
        wrap by design (the codec leaves the headroom), so they are not checked."""
        most = self.spec.max_lane()
        if most is None:
            return
        lanes = _unpack(payload, self.out_bits, elements)
        if lanes.size and int(lanes.max()) > most * contributors:
            raise MalformedPacket(
                "overflow", f"a partial sum of {contributors} exceeds {most * contributors}"
            )

    def first(self, acc: np.ndarray, payload: memoryview, elements: int, presummed: bool):
        if not (self._native_lookup(acc, payload, elements, presummed, first=True)):
            acc[:elements] = self._lanes(payload, elements, presummed)

    def add(self, acc: np.ndarray, payload: memoryview, elements: int, presummed: bool):
        if not (self._native_lookup(acc, payload, elements, presummed, first=False)):
            part = acc[:elements]
            np.add(part, self._lanes(payload, elements, presummed), out=part)

    def result(self, acc: np.ndarray, elements: int) -> memoryview:
        if self.out_bits == 32:
            return memoryview(acc[:elements]).cast("B")
        packed = switch_kernels.pack_int32(acc[:elements], self.out_bits)
        if packed is None:
            packed = pack_lanes(acc[:elements], self.out_bits)
        return memoryview(packed).cast("B")

    def _native_lookup(self, acc, payload, elements: int, presummed: bool, first: bool) -> bool:
        """Table lookup and add of packed indices in THC's native kernel, where it runs."""
        if presummed or self.in_bits == 32:
            return False
        return switch_kernels.lookup_accumulate(
            acc, payload, elements, self.in_bits, self._index_table, first
        )

    def _lanes(self, payload: memoryview, elements: int, presummed: bool) -> np.ndarray:
        """The int32 values one contribution adds, lane by lane."""
        if presummed:
            return _unpack(payload, self.out_bits, elements)
        if self.in_bits == 32:
            return np.frombuffer(payload, dtype="<i4", count=elements)
        if self._byte_table is not None:  # one gather per byte, no unpacking
            raw = np.frombuffer(payload, dtype=np.uint8)
            per_byte = self._byte_table.shape[1]
            out = self._scratch[: raw.size * per_byte].reshape(raw.size, per_byte)
            np.take(self._byte_table, raw, axis=0, out=out)
            return out.reshape(-1)[:elements]
        indices = _unpack(payload, self.in_bits, elements)
        return indices if self._lane_table is None else self._lane_table[indices]


class MaxOp:
    """Elementwise max of int32 lanes (floats travel as ``float_to_ordered_int``)."""

    accumulating = True

    def check_payload(self, nbytes: int, elements: int, presummed: bool) -> None:
        _expect_bytes(nbytes, 4 * elements)

    def first(self, acc: np.ndarray, payload: memoryview, elements: int, presummed: bool):
        acc[:elements] = np.frombuffer(payload, dtype="<i4", count=elements)

    def add(self, acc: np.ndarray, payload: memoryview, elements: int, presummed: bool):
        part = acc[:elements]
        np.maximum(part, np.frombuffer(payload, dtype="<i4", count=elements), out=part)

    def result(self, acc: np.ndarray, elements: int) -> memoryview:
        return memoryview(acc[:elements]).cast("B")


class FloatSumOp:
    accumulating = False

    def check_payload(self, nbytes: int, elements: int, presummed: bool) -> None:
        if presummed:
            raise MalformedPacket("bad_flags", "float-sum takes no presummed lanes")
        _expect_bytes(nbytes, 4 * elements)

    def keep(self, payload: memoryview, elements: int) -> np.ndarray:
        return np.frombuffer(payload, dtype="<f4", count=elements).copy()

    def combine(self, kept: list, elements: int, contributors: int, chunk: int) -> memoryview:
        total = kept[0].copy()
        for values in kept[1:]:
            total += values
        return memoryview(total).cast("B")


class DecodeSumEncodeOp:
    """A whole serialized codec payload per packet; ``codec.aggregate`` at completion."""

    accumulating = False

    def __init__(self, spec: DecodeSumEncode, workers: int):
        from ..codecs.registry import make_codec

        self.spec = spec
        self.codec = make_codec(spec.codec, workers=workers, **spec.options)

    def check_payload(self, nbytes: int, elements: int, presummed: bool) -> None:
        if presummed:
            raise MalformedPacket("bad_flags", "decode-sum-encode takes no presummed payloads")

    def keep(self, payload: memoryview, elements: int) -> tuple[Payload, tuple[int, int]]:
        from . import payload_wire

        data = bytes(payload)
        return payload_wire.deserialize(data, elements, 1), payload_wire.round_of(data)

    def combine(self, kept: list, elements: int, contributors: int, chunk: int) -> memoryview:
        from ..codecs.base import AGGREGATOR, CodecContext
        from . import payload_wire

        # the round named by the lowest worker's payload (every worker's names the same one)
        step, partition = kept[0][1]
        ctx = CodecContext(seed=self.spec.seed, worker=AGGREGATOR, step=step, partition=partition)
        summed = self.codec.aggregate([payload for payload, _ in kept], ctx)
        data = payload_wire.serialize(summed, step, partition)
        if len(data) > MAX_PAYLOAD:
            raise ValueError(f"aggregate of {len(data)} bytes does not fit one packet")
        return memoryview(data)


def _expect_bytes(nbytes: int, expected: int) -> None:
    if nbytes != expected:
        raise MalformedPacket("wrong_length", f"payload of {nbytes} bytes, expected {expected}")


def pack_lanes(values: np.ndarray, width: int) -> np.ndarray:
    """``codecs.bits.pack_bits`` of non-negative int32 lanes below 2**width, in numpy: lanes
    are gathered in groups that fill whole bytes of one little-endian uint64 word (8 lanes of 7
    bits in 7 bytes). A switch packs every result it sends; this is ~50x faster than the torch
    packer on 64 Ki lanes. Widths whose group does not fit a word go bit by bit."""
    group = 8 // np.gcd(width, 8)
    if group * width > 64:
        return _pack_by_bits(values, width)
    count = values.size
    rows = -(-count // group)
    lanes = np.zeros(rows * group, dtype="<u8")
    np.bitwise_and(values, (1 << width) - 1, out=lanes[:count], casting="unsafe")
    lanes = lanes.reshape(rows, group)
    word = lanes[:, 0].copy()
    for j in range(1, group):
        word |= lanes[:, j] << np.uint64(j * width)
    nbytes = group * width // 8
    packed = word.view(np.uint8).reshape(rows, 8)[:, :nbytes].reshape(-1)
    return np.ascontiguousarray(packed[: packed_nbytes(count, width)])


def _unpack(payload: memoryview, width: int, elements: int) -> np.ndarray:
    if width == 32:
        return np.frombuffer(payload, dtype="<i4", count=elements)
    return unpack_lanes(np.frombuffer(payload, dtype=np.uint8), width, elements)


def unpack_lanes(packed: np.ndarray, width: int, count: int) -> np.ndarray:
    """``codecs.bits.unpack_bits`` in numpy, as int32: the inverse of :func:`pack_lanes` (a
    group of lanes that fills whole bytes read as one little-endian uint64 word)."""
    group = 8 // np.gcd(width, 8)
    if group * width > 64:
        return _unpack_by_bits(packed, width, count)
    nbytes = group * width // 8
    rows = -(-count // group)
    padded = np.zeros(rows * nbytes, dtype=np.uint8)
    body = packed[: rows * nbytes]
    padded[: body.size] = body
    words = np.zeros((rows, 8), dtype=np.uint8)
    words[:, :nbytes] = padded.reshape(rows, nbytes)
    word = words.view("<u8").reshape(rows)
    shifts = np.arange(group, dtype=np.uint64) * np.uint64(width)
    lanes = (word[:, None] >> shifts[None, :]) & np.uint64((1 << width) - 1)
    return lanes.reshape(-1)[:count].astype(np.int32)


def _pack_by_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Any width, one bit at a time (lane i at bits i·width.. of a little-endian stream)."""
    bits = (values.astype(np.int64)[:, None] >> np.arange(width)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")


def _unpack_by_bits(packed: np.ndarray, width: int, count: int) -> np.ndarray:
    bits = np.unpackbits(packed, count=count * width, bitorder="little")
    weights = np.left_shift(1, np.arange(width, dtype=np.int64))
    return (bits.reshape(count, width).astype(np.int64) @ weights).astype(np.int32)


def _byte_lookup(spec: IntegerSum) -> np.ndarray:
    """int32 [256, 8 // in_bits]: the table value of every lane packed in a byte."""
    bits = spec.in_bits
    per_byte = 8 // bits
    table = np.asarray(spec.table if spec.table is not None else range(1 << bits), np.int32)
    byte = np.arange(256)[:, None]
    lanes = (byte >> (np.arange(per_byte)[None, :] * bits)) & ((1 << bits) - 1)
    return np.ascontiguousarray(table[lanes])

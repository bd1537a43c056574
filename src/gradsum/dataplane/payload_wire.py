"""Byte format of a whole codec ``Payload`` (for jobs a parameter server decodes).

Homomorphic codecs stream bare lanes; only decode-sum-encode jobs send a serialized payload,
one partition per packet. Layout (little-endian)::

    u64 step, u32 partition             the round it belongs to (what seeds a re-encode)
    u8 field count F, u8 meta count M
    F times: u8 name length, name (UTF-8), u8 dtype code, u32 element count
    M times: u8 name length, name (UTF-8), f64 value
    field data, in the order listed, each packed without padding
"""

from __future__ import annotations

import struct

import torch

from ..codecs.base import Payload
from .packet import MalformedPacket

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.uint8: 1,
    torch.int8: 2,
    torch.int16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_ROUND = struct.Struct("<QI")
_COUNTS = struct.Struct("<BB")
_FIELD = struct.Struct("<BI")
_META = struct.Struct("<d")


def serialize(payload: Payload, step: int = 0, partition: int = 0) -> bytes:
    """The payload's bytes, with the (step, partition) of its round: an aggregator that
    re-encodes draws its randomness from them (``codecs.base.aggregator_context``), so every
    aggregator re-encodes a sum the same way."""
    head = [_ROUND.pack(step, partition), _COUNTS.pack(len(payload.fields), len(payload.meta))]
    data = []
    for name, tensor in payload.fields.items():
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        head += [_name(name), _FIELD.pack(DTYPE_CODES[flat.dtype], flat.numel())]
        data.append(flat.view(torch.uint8).numpy().tobytes())
    for name, value in payload.meta.items():
        head += [_name(name), _META.pack(float(value))]
    return b"".join(head + data)


def deserialize(data: bytes, length: int, contributors: int) -> Payload:
    """Parse ``serialize``'s output; raise ``MalformedPacket("bad_payload")`` on any mismatch."""
    try:
        return _deserialize(data, length, contributors)
    except (struct.error, IndexError, KeyError, ValueError, RuntimeError) as error:
        if isinstance(error, MalformedPacket):
            raise
        raise MalformedPacket("bad_payload", str(error)) from None


def round_of(data: bytes) -> tuple[int, int]:
    """The (step, partition) a serialized payload belongs to."""
    try:
        return _ROUND.unpack_from(data, 0)
    except struct.error as error:
        raise MalformedPacket("bad_payload", str(error)) from None


def _deserialize(data: bytes, length: int, contributors: int) -> Payload:
    field_count, meta_count = _COUNTS.unpack_from(data, _ROUND.size)
    position = _ROUND.size + _COUNTS.size
    layout = []
    for _ in range(field_count):
        name, position = _read_name(data, position)
        code, count = _FIELD.unpack_from(data, position)
        position += _FIELD.size
        layout.append((name, DTYPES[code], count))
    meta = {}
    for _ in range(meta_count):
        name, position = _read_name(data, position)
        (meta[name],) = _META.unpack_from(data, position)
        position += _META.size
    fields = {}
    for name, dtype, count in layout:
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if position + nbytes > len(data):
            raise MalformedPacket("bad_payload", f"field {name!r} runs past the packet end")
        raw = bytearray(data[position : position + nbytes])
        fields[name] = torch.frombuffer(raw, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        position += nbytes
    if position != len(data):
        raise MalformedPacket("bad_payload", f"{len(data) - position} trailing bytes")
    if len(fields) != field_count or len(meta) != meta_count:
        raise MalformedPacket("bad_payload", "repeated field or meta name")
    return Payload(fields, length, contributors, meta)


def _name(name: str) -> bytes:
    encoded = name.encode()
    if len(encoded) > 255:
        raise ValueError(f"payload field name too long: {name!r}")
    return bytes([len(encoded)]) + encoded


def _read_name(data: bytes, position: int) -> tuple[str, int]:
    size = data[position]
    end = position + 1 + size
    if end > len(data):
        raise MalformedPacket("bad_payload", "name runs past the packet end")
    return bytes(data[position + 1 : end]).decode(), end

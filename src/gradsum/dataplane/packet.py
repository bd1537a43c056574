"""The gradsum aggregation packet: a fixed 40-byte little-endian header, then the payload.

One header serves data, results and control messages (see ``docs/protocol.md``)::

    offset size field
     0     2    magic         b"GS"
     2     1    protocol      PROTOCOL (1)
     3     1    kind          Kind
     4     2    job           job id, chosen at registration
     6     2    worker        sender's worker id (data); addressee or ANY_WORKER (results)
     8     4    slot          pool index, < the job's slots
    12     1    version       0 or 1: which of the slot's two copies
    13     1    op            Op: what the aggregator does with the lanes
    14     1    flags         Flag bits
    15     1    reserved      must be 0
    16     8    chunk         job-wide chunk sequence number (control: request id)
    24     4    elements      lanes in the payload (control: 0)
    28     2    contributors  workers summed into this payload
    30     2    reserved      must be 0
    32     8    token         the job's data token (control: 0); a data packet, result or
                              stale notice with another token is not the job's

Little-endian because every host that runs the software aggregator is, so lanes go from the
socket to numpy without byte swapping.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

MAGIC = b"GS"
PROTOCOL = 2  # 1: 32-byte headers without a token, unsigned control
HEADER = struct.Struct("<2sBBHHIBBBBQIHHQ")
HEADER_SIZE = HEADER.size  # 40
MAX_DATAGRAM = 65507  # largest UDP payload over IPv4
MAX_PAYLOAD = MAX_DATAGRAM - HEADER_SIZE
ANY_WORKER = 0xFFFF  # worker field of a multicast result
MAX_WORKERS = 0xFFFF  # worker ids 0..65534


class Kind(enum.IntEnum):
    DATA = 1  # worker -> aggregator: a chunk's contribution
    RESULT = 2  # aggregator -> worker: a completed slot
    STALE = 3  # aggregator -> worker: this chunk's result is no longer kept
    REGISTER = 16  # control, JSON body: create a job
    REGISTERED = 17
    TEARDOWN = 18
    TORN_DOWN = 19
    STATS_REQUEST = 20
    STATS = 21
    ERROR = 31  # control reply, JSON body {"code", "message"}


CONTROL_KINDS = frozenset(k for k in Kind if k >= Kind.REGISTER)


class Op(enum.IntEnum):
    NONE = 0  # control messages
    SUM = 1  # the job's registered combining operation
    MAX = 2  # elementwise max of int32 lanes (preliminary rounds)


class Flag(enum.IntFlag):
    PRESUMMED = 1  # lanes are sums at the op's output width (a child switch's partial sum)
    PARTIAL = 2  # result completed at a deadline with fewer than all workers
    SIGNED = 4  # control only: the message ends in an HMAC trailer (authentication.py)


KNOWN_FLAGS = int(Flag.PRESUMMED | Flag.PARTIAL | Flag.SIGNED)
DATA_FLAGS = int(Flag.PRESUMMED | Flag.PARTIAL)  # what data, result and stale packets may set
# Plain-int masks for per-packet tests: ``int & IntFlag`` builds a Flag object every time.
PRESUMMED = int(Flag.PRESUMMED)
PARTIAL = int(Flag.PARTIAL)
SIGNED = int(Flag.SIGNED)


class MalformedPacket(ValueError):
    """A datagram that is not a valid gradsum packet; ``reason`` is a short counter name."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Header(NamedTuple):
    kind: Kind
    job: int
    worker: int = 0
    slot: int = 0
    version: int = 0
    op: Op = Op.NONE
    flags: int = 0
    chunk: int = 0
    elements: int = 0
    contributors: int = 0
    token: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            PROTOCOL,
            self.kind,
            self.job,
            self.worker,
            self.slot,
            self.version,
            self.op,
            self.flags,
            0,
            self.chunk,
            self.elements,
            self.contributors,
            0,
            self.token,
        )


def parse_header(data: bytes | bytearray | memoryview) -> Header:
    """Parse and check everything a header alone can tell; raise ``MalformedPacket``."""
    if len(data) < HEADER_SIZE:
        raise MalformedPacket("truncated", f"{len(data)} bytes, a header needs {HEADER_SIZE}")
    if len(data) > MAX_DATAGRAM:
        raise MalformedPacket("oversized", f"{len(data)} bytes > {MAX_DATAGRAM}")
    fields = HEADER.unpack_from(data)
    (magic, protocol, kind, job, worker, slot, version, op, flags, pad1, chunk) = fields[:11]
    elements, contributors, pad2, token = fields[11:]
    if magic != MAGIC:
        raise MalformedPacket("bad_magic", repr(magic))
    if protocol != PROTOCOL:
        raise MalformedPacket("bad_protocol", f"protocol {protocol}, expected {PROTOCOL}")
    kind_member, op_member = _KIND_BY_VALUE.get(kind), _OP_BY_VALUE.get(op)
    if kind_member is None:
        raise MalformedPacket("bad_kind", str(kind))
    if op_member is None:
        raise MalformedPacket("bad_op", str(op))
    if version > 1:
        raise MalformedPacket("bad_version", str(version))
    allowed = KNOWN_FLAGS if kind >= Kind.REGISTER else DATA_FLAGS
    if flags & ~allowed or pad1 or pad2:
        raise MalformedPacket("reserved_bits", f"flags {flags:#x}")
    return Header(
        kind_member, job, worker, slot, version, op_member, flags, chunk, elements, contributors,
        token,
    )  # fmt: skip


# dict lookups instead of Kind(value)/Op(value): the enum constructors cost microseconds a packet
_KIND_BY_VALUE = {int(k): k for k in Kind}
_OP_BY_VALUE = {int(o): o for o in Op}

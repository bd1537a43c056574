"""The worker's native datagram pump (``_pump.c``): ``UdpTransport``'s loop with the system calls,
header checks and placement of results done in C, in batches, and every decision left to the
transfers (``dataplane.transfer``/``worker``), exactly as on the Python path.

Per result the Python path costs ~25 us of interpreter time (peek, parse, route, place, pack the
next header, send) on top of the kernel's copy; four workers and a switch share two cores here,
so that overhead, not the copies, bounded a worker. The pump leaves Python only the stream's
bookkeeping per chunk.

A chunk may travel as several packets (``segments``, to fit a path MTU): the pump sends them in
one system call with UDP generic segmentation offload (GSO: the kernel, or the NIC, cuts the
buffer into the datagrams), places each result packet, and reports the chunk once all are in.

Used when the extension is built, neither ``GRADSUM_NATIVE`` nor ``GRADSUM_PUMP`` is 0, and every
transfer streams lanes (``LaneBuffers``) to an IPv4 aggregator; otherwise the Python loop runs.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

import numpy as np

from ..codecs.native_common import enabled
from ..dataplane.geometry import aggregator_slots
from ..dataplane.jobspec import is_ipv4
from ..dataplane.transfer import LaneBuffers, Transfer

try:
    from . import _pump
except ImportError:  # built without a C compiler
    _pump = None

PLACED, REPEAT, STALE, PROGRESS, HOLES = 1, 2, 3, 4, 5  # the events of _pump.receive
BATCH = 32  # results handled per call: fewer delays the next sends of a self-clocked window

# struct route of _pump.c, field by field (network byte order for the address, as in sockaddr)
ROUTE = np.dtype(
    [
        ("ip", ">u4"),
        ("port", ">u2"),
        ("job", "<u2"),
        ("worker", "<u2"),
        ("op", "u1"),
        ("in_bits", "u1"),
        ("out_bits", "u1"),
        ("pad", "V3"),
        ("max_contributors", "<u4"),
        ("first", "<i8"),
        ("count", "<i8"),
        ("lanes", "<i8"),
        ("slots", "<i8"),
        ("base", "<i8"),
        ("segments", "<i8"),
        ("packet_lanes", "<i8"),
        ("packets", "<i8"),
        ("upstream", "<u8"),
        ("downstream", "<u8"),
        ("placed", "<u8"),
        ("token", "<u8"),
        ("source", "<u8"),
        ("target", "<u8"),
        ("exponents", "<u8"),
        ("lane0", "<i8"),
        ("coordinates", "<i8"),
        ("block", "<i8"),
        ("limit", "<f4"),
        ("codec", "u1"),
        ("headroom", "u1"),
        ("pad2", "V2"),
    ],
    align=True,
)


def available() -> bool:
    """Built, matching ROUTE, and not turned off (``GRADSUM_NATIVE=0`` or ``GRADSUM_PUMP=0``)."""
    return (
        _pump is not None
        and enabled()
        and os.environ.get("GRADSUM_PUMP", "1") != "0"
        and _pump.route_size() == ROUTE.itemsize
    )


def serves(pairs: Sequence[tuple]) -> bool:
    """Whether the pump can run these (job handle, transfer) pairs; chunks of several packets
    (``segments``) only it can."""
    ours = available() and all(_pumpable(job, t) for job, t in pairs)
    if not ours and any(t.segments != 1 for _, t in pairs):
        raise RuntimeError(
            "chunks of several packets need the native pump (net/_pump.c) and "
            "IPv4 aggregators; register the job with segments=1"
        )
    return ours


def _pumpable(job, transfer: Transfer) -> bool:
    """Lanes to an IPv4 aggregator, without per-packet MACs (Python's: the pump compares tokens
    only) and, where the transport codes the packets, with a coder the pump has in C."""
    buffers = transfer.buffers
    return (
        isinstance(buffers, LaneBuffers)
        and is_ipv4(job.address[0])
        and transfer.mac_key is None
        and (buffers.coder is None or buffers.coder.native is not None)
    )


class Routes:
    """The route table of one run, and the arrays it points into (kept alive here)."""

    def __init__(self, pairs: Sequence[tuple]):
        self.transfers: list[Transfer] = [t for _, t in pairs]
        self.table = np.zeros(len(pairs), dtype=ROUTE)
        self._keep: list = []
        for row, (job, transfer) in zip(self.table, pairs, strict=True):
            self._fill(row, job.address, transfer)

    def _fill(self, row, address, transfer: Transfer) -> None:
        layout = transfer.buffers.layout
        segments = transfer.segments
        packet_lanes = layout.lanes_per_chunk // segments
        packets = -(-layout.lanes // packet_lanes)
        placed = np.zeros(max(1, packets), dtype=np.uint8)
        upstream = _array(transfer.buffers.upstream_view)
        downstream = _array(transfer.buffers.downstream_view)
        self._keep += [placed, upstream, downstream]
        row["ip"] = int.from_bytes(socket.inet_aton(address[0]), "big")
        row["port"] = address[1]
        row["job"], row["worker"], row["op"] = transfer.job, transfer.worker, int(transfer.op)
        row["in_bits"], row["out_bits"] = layout.in_bits, layout.out_bits
        row["max_contributors"] = transfer.max_contributors
        row["first"], row["count"] = transfer.first, transfer.buffers.chunks
        row["lanes"] = layout.lanes
        row["slots"] = aggregator_slots(transfer.slots, segments)
        row["base"], row["segments"] = transfer.first_packet, segments
        row["packet_lanes"], row["packets"] = packet_lanes, packets
        row["upstream"] = upstream.ctypes.data
        row["downstream"] = downstream.ctypes.data
        row["placed"] = placed.ctypes.data
        row["token"] = transfer.token
        coder = transfer.buffers.coder
        if coder is not None and coder.native is not None:  # packets coded in C, not here
            for field, value in coder.native.items():
                row[field] = value
            row["lane0"] = transfer.buffers.lane0
            transfer.buffers.coded_natively = True

    def receive(self, fds: list[int], wait: float) -> list[tuple]:
        return _pump.receive(fds, self.table, max(0, round(wait * 1000)), BATCH)

    def send(self, fd: int, chunks: list[tuple[int, int]]) -> None:
        if chunks:
            _pump.send(fd, self.table, chunks)


def _array(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8) if len(view) else np.zeros(1, np.uint8)

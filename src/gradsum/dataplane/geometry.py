"""Packet geometry, derived in one place: lanes per packet, packets per chunk, slots at the
aggregator. The worker client registers a job with it, the worker's ``Collective`` and the
native pump cut their streams with it, and the benchmarks count packets with it, so all agree.

* A packet carries at most ``lanes_fitting(bits)`` lanes (whole bytes, a multiple of 8, within
  the largest datagram payload) of the wider of a job's two wire widths, and at most the job's
  registered ``elements``.
* With a path ``mtu``, packets fit one frame (so IP never fragments them) and a chunk of the
  window is a group of them sent in one UDP GSO send; the aggregator holds a slot per packet.
* A window of ``window_bytes`` holds as many chunks as fit those bytes: SwitchML sizes its pool
  to the path, and a window larger than a slow link's queue loses packets every round.
"""

from __future__ import annotations

from ..codecs.lanes import packed_nbytes
from .packet import HEADER_SIZE, MAX_PAYLOAD

IPV4_UDP_HEADERS = 28
MIN_MTU, MAX_MTU = 576, 65535  # IPv4's minimum datagram every host accepts; the largest
MAX_GSO_BYTES = 65507  # one UDP send, GSO or not: 64 KiB less the IPv4 and UDP headers
MAX_SEGMENTS = 64  # packets per GSO send (net/_pump.c)


def lanes_fitting(bits: int, payload: int = MAX_PAYLOAD) -> int:
    """Most lanes of ``bits`` bits, a multiple of 8, whose packed bytes fit ``payload``."""
    return (payload * 8 // bits) // 8 * 8


def window_slots(window_bytes: int, chunk_lanes: int, segments: int, bits: int, most: int) -> int:
    """Chunks in flight whose datagrams (``segments`` packets of ``chunk_lanes`` lanes of
    ``bits`` bits in all, headers included) fit ``window_bytes``: at least one, at most
    ``most``. ``bits`` is the wider of a job's two widths, so the results fit it as well."""
    if window_bytes < 1:
        raise ValueError(f"window_bytes must be positive, got {window_bytes}")
    chunk = packed_nbytes(chunk_lanes, bits) + segments * (HEADER_SIZE + IPV4_UDP_HEADERS)
    return max(1, min(most, window_bytes // chunk))


def packet_lanes(elements: int, bits: int) -> int:
    """Lanes per packet of a job registered with ``elements``, at wire width ``bits``."""
    return min(elements, lanes_fitting(bits)) // 8 * 8


def chunk_lanes(elements: int, segments: int, bits: int) -> int:
    """Lanes per chunk: ``segments`` packets of ``packet_lanes`` each."""
    return packet_lanes(elements, bits) * segments


def aggregator_slots(slots: int, segments: int) -> int:
    """Slots the aggregator holds for a window of ``slots`` chunks: one per packet."""
    return slots * segments


def packet_geometry(bits: int, elements: int, mtu: int | None) -> tuple[int, int]:
    """(lanes per packet, packets per chunk) for lanes of ``bits`` bits (the wider of a job's
    two widths) and a path ``mtu``: packets that fit one frame, since a lost fragment loses its
    whole datagram and each one costs the kernel as much as a packet, sent a chunk at a time
    with GSO by the native pump. Every worker of a job computes the same. Without ``mtu``:
    ``elements`` per packet, one packet per chunk (datagrams of up to 64 KiB)."""
    if mtu is None:
        return elements, 1
    if not MIN_MTU <= mtu <= MAX_MTU:
        raise ValueError(f"mtu {mtu}: must be between {MIN_MTU} and {MAX_MTU}")
    lanes = lanes_fitting(bits, mtu - IPV4_UDP_HEADERS - HEADER_SIZE)
    if lanes < 8:
        raise ValueError(f"mtu {mtu}: no room for a packet of 8 lanes")
    lanes = min(lanes, elements)
    packet = HEADER_SIZE + lanes * bits // 8
    return lanes, max(1, min(MAX_SEGMENTS, MAX_GSO_BYTES // packet))

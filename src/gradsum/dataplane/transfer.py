"""One buffer streamed through one job by one worker, sans-IO: packets out, results placed.

A ``Transfer`` joins a ``ChunkStream`` (what to send when) with the worker's buffers (what the
bytes are and where results go). Two kinds of buffers:

* ``LaneBuffers``: packed lanes cut at chunk boundaries; a result goes straight into its place in
  the output buffer (the shell receives into ``destination(...)``, no copy);
* ``PayloadBuffers``: one serialized codec payload per chunk (decode-sum-encode jobs), results
  into per-chunk buffers of the largest datagram.

The shell peeks a result's header, asks ``destination(header, nbytes)`` where its payload goes
(None: not ours or not expected, discard it), receives it there, then calls ``on_result``.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import numpy as np

from .authentication import TAG_SIZE, packet_tag
from .packet import MAX_PAYLOAD, PARTIAL, Header, Kind, Op
from .stream import ChunkLayout, ChunkStream, RetryPolicy, RoundTrip, StreamStats


class LaneBuffers:
    """``coder`` (``codecs.base.LaneCoder``; its lanes from ``lane0``): each chunk's lanes are
    encoded into the upstream buffer as the chunk is sent, and a result decoded into the round's
    output as it is placed. The native pump codes in C instead and then sets ``coded_natively``.
    """

    def __init__(self, layout: ChunkLayout, upstream: memoryview, downstream: memoryview,
                 coder=None, lane0: int = 0):  # fmt: skip
        need_up = layout.upstream_bytes(layout.chunks - 1)[1] if layout.chunks else 0
        need_down = layout.downstream_bytes(layout.chunks - 1)[1] if layout.chunks else 0
        if len(upstream) < need_up or len(downstream) < need_down:
            raise ValueError(
                f"buffers of {len(upstream)}/{len(downstream)} bytes, need {need_up}/{need_down}"
            )
        self.layout = layout
        self._up = upstream.cast("B") if upstream.format != "B" else upstream
        self._down = downstream.cast("B") if downstream.format != "B" else downstream
        self.coder, self.lane0 = coder, lane0
        self.coded_natively = False

    @property
    def chunks(self) -> int:
        return self.layout.chunks

    @property
    def upstream_view(self) -> memoryview:
        return self._up

    @property
    def downstream_view(self) -> memoryview:
        return self._down

    def elements(self, index: int) -> int:
        return self.layout.lanes_of(index)[1]

    def upstream(self, index: int) -> memoryview:
        start, stop = self.layout.upstream_bytes(index)
        lanes = self._up[start:stop]
        if self.coder is not None:
            first, count = self.layout.lanes_of(index)
            self.coder.encode(self.lane0 + first, count, lanes)
        return lanes

    def destination(self, index: int, nbytes: int) -> memoryview | None:
        start, stop = self.layout.downstream_bytes(index)
        return self._down[start:stop] if nbytes == stop - start else None

    def received(self, index: int, nbytes: int, contributors: int) -> None:
        if self.coder is not None and not self.coded_natively:
            first, count = self.layout.lanes_of(index)
            start, stop = self.layout.downstream_bytes(index)
            self.coder.decode(self.lane0 + first, count, self._down[start:stop], contributors)


class PayloadBuffers:
    def __init__(self, payloads: list[bytes], elements: list[int]):
        if any(len(p) > MAX_PAYLOAD for p in payloads):
            raise ValueError(f"a serialized payload exceeds one packet ({MAX_PAYLOAD} bytes)")
        self._payloads = payloads
        self._elements = elements
        self._results = [bytearray(MAX_PAYLOAD) for _ in payloads]
        self.result_sizes = [0] * len(payloads)

    @property
    def chunks(self) -> int:
        return len(self._payloads)

    def elements(self, index: int) -> int:
        return self._elements[index]

    def upstream(self, index: int) -> memoryview:
        return memoryview(self._payloads[index])

    def destination(self, index: int, nbytes: int) -> memoryview | None:
        return memoryview(self._results[index]) if nbytes <= MAX_PAYLOAD else None

    def received(self, index: int, nbytes: int, contributors: int) -> None:
        self.result_sizes[index] = nbytes

    def result(self, index: int) -> bytes:
        return bytes(self._results[index][: self.result_sizes[index]])


class Transfer:
    def __init__(
        self,
        *,
        job: int,
        worker: int,
        op: Op,
        first_chunk: int,
        slots: int,
        buffers: LaneBuffers | PayloadBuffers,
        max_contributors: int,
        policy: RetryPolicy | None = None,
        stats: StreamStats | None = None,
        what: str = "plane",
        rtt: RoundTrip | None = None,
        segments: int = 1,
        first_packet: int | None = None,
        token: int = 0,
        mac_key: bytes | None = None,
    ):
        self.job, self.worker, self.op = job, worker, op
        self.token = token  # the job's data token: sent on every packet, expected on results
        self.mac_key = mac_key  # integrity "mac": every packet ends in a tag under this key
        self.tag_size = 0 if mac_key is None else TAG_SIZE
        self.first, self.slots = first_chunk, slots
        # the aggregator's view (collective.JobHandle.segments): packets numbered from
        # first_packet, ``segments`` per chunk, in ``slots * segments`` slots
        self.segments = segments
        self.first_packet = first_chunk if first_packet is None else first_packet
        self.buffers = buffers
        self.max_contributors = max_contributors
        self.stream = ChunkStream(
            first_chunk, buffers.chunks, slots, policy or RetryPolicy(), stats or StreamStats(),
            what, rtt or RoundTrip(),
        )  # fmt: skip
        self.contributors = np.zeros(buffers.chunks, dtype=np.int32)  # 0 until a result
        self.partial = False

    @property
    def end_chunk(self) -> int:
        return self.first + self.buffers.chunks

    @property
    def done(self) -> bool:
        return self.stream.done

    def packet(self, chunk: int) -> tuple[bytes, memoryview]:
        """Header and payload view of a chunk's data packet (send them gathered, no copy)."""
        if self.segments != 1:
            raise NotImplementedError("chunks of several packets travel through the native pump")
        index = chunk - self.first
        version, slot = (chunk // self.slots) % 2, chunk % self.slots
        header = Header(Kind.DATA, self.job, self.worker, slot, version, self.op, 0, chunk,
                        self.buffers.elements(index), 1, self.token)  # fmt: skip
        return header.pack(), self.buffers.upstream(index)

    def tag(self, *parts) -> bytes:
        """The MAC that follows a packet of these parts (b"" without MACs)."""
        return b"" if self.mac_key is None else packet_tag(self.mac_key, *parts)

    def verifies(self, header: bytes, payload, tag) -> bool:
        """Whether a received packet's tag is ours (always, without MACs)."""
        return self.mac_key is None or hmac.compare_digest(self.tag(header, payload), tag)

    def start(self, now: float) -> list[int]:
        return self.stream.start(now)

    def destination(self, header: Header, nbytes: int) -> memoryview | None:
        """Where a result's ``nbytes`` of payload go, or None if it is not one we wait for."""
        if header.kind is not Kind.RESULT or header.job != self.job or header.op is not self.op:
            return None
        if header.token != self.token:  # a spoofed result: never placed
            return None
        if not self.stream.is_outstanding(header.chunk):
            if self.first <= header.chunk < self.end_chunk:
                self.stream.stats.duplicate_results += 1
            return None
        index = header.chunk - self.first
        if header.elements != self.buffers.elements(index):
            return None
        if not 1 <= header.contributors <= self.max_contributors:
            return None
        return self.buffers.destination(index, nbytes)

    def on_result(self, header: Header, nbytes: int, now: float) -> list[int]:
        """The payload of an accepted result is in place; return the chunks to send next."""
        return self.accept(header.chunk, header.contributors, header.flags, nbytes, now)

    def accept(self, chunk: int, contributors: int, flags: int, nbytes: int, now: float):
        """``on_result`` from the header's fields (the native pump reports just these)."""
        index = chunk - self.first
        self.contributors[index] = contributors
        self.partial |= bool(flags & PARTIAL)
        self.buffers.received(index, nbytes, contributors)
        return self.stream.on_result(chunk, now)

    def accept_placed(self, events: Sequence[tuple[int, int, int, int, int]],
                      now: float) -> list[int]:  # fmt: skip
        """``accept`` of a run of the native pump's results (its events: route, chunk,
        contributors, flags, kind), in order, each already placed where it landed (the pump
        streams ``LaneBuffers``): the chunks to send next."""
        first, counts, buffers = self.first, self.contributors, self.buffers
        decode = buffers.coder is not None and not buffers.coded_natively
        chunks = []
        for _, chunk, contributors, flags, _ in events:
            counts[chunk - first] = contributors
            if flags & PARTIAL:
                self.partial = True
            if decode:
                buffers.received(chunk - first, 0, contributors)
            chunks.append(chunk)
        return self.stream.on_results(chunks, now)

    def on_stale(self, header: Header) -> None:
        if header.job == self.job and header.token == self.token:
            self.stream.on_stale(header.chunk)

    def release(self, ready: int, now: float) -> list[int]:
        """Chunks below ``ready`` now have their payload (see ``ChunkStream.release``)."""
        return self.stream.release(ready, now)

    def expired(self, now: float) -> list[int]:
        return self.stream.expired(now)

    def next_deadline(self) -> float | None:
        return self.stream.next_deadline()

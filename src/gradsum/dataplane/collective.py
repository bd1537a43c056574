"""One worker's side of a codec round's MAX and SUM through aggregator jobs; transport passed in.

``Collective`` is the ``codecs.round.Reducer`` of gradsum's UDP services (switches, parameter
server shards, pipelines, a hierarchy): ``max`` streams every partition's summary through a MAX
round, ``sum`` streams the round's payloads through a SUM round. Each round is a set of
``Transfer``s, one per aggregator shard, that the caller's ``run`` executes to completion: real
UDP sockets (``net.client``) or an in-memory network in tests. This module never touches a
socket or a clock, and nothing in it depends on which codec it carries: the codec's declared
wire facts (``lane_fields``, ``lane_widths``, ``linear_decode``) say how its payloads travel.

Homomorphic codecs travel as lanes: every piece's packed lanes are laid end to end (each from a
multiple of 8 lanes, so every width starts on a byte), cut into chunks and spread over the jobs'
shards. With a streaming transport (``streaming=True``: ``run(pairs, work=...)``) the pieces are
encoded one by one while earlier chunks are in flight, and each piece is decoded as soon as
every chunk it spans is back (``StreamedSum``). Other codecs send one serialized payload per
piece, which a parameter server decodes, sums and re-encodes; a piece must fit one datagram.

All workers of a job must run the same rounds in the same order (the usual collective
contract): that keeps their chunk numbering, which names the slot rounds at the aggregator, in
step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..codecs.base import Payload, float_to_ordered_int, ordered_int_to_float
from ..codecs.bits import packed_nbytes
from ..codecs.round import PARTITION_ELEMENTS, SumPhase
from . import payload_wire
from .codec_wire import WireFormat
from .device_boundary import DeviceBoundary, pinned_empty
from .geometry import chunk_lanes, packet_lanes
from .jobspec import Address
from .packet import MAX_PAYLOAD, Op
from .stream import ChunkLayout, RetryPolicy, RoundTrip, StreamStats, shard_lanes
from .transfer import LaneBuffers, PayloadBuffers, Transfer


@dataclass(frozen=True)
class JobHandle:
    """A registered job as one of its workers sees it."""

    address: Address
    job: int
    worker: int
    slots: int
    elements: int  # lanes per packet, as registered
    max_contributors: int
    # Packets per chunk: a chunk of the window travels as this many packets, numbered and
    # slotted one after another at the aggregator (which sees ``slots * segments`` slots), and
    # sent in one system call (UDP GSO). Lets packets fit a path MTU without multiplying the
    # worker's per-chunk bookkeeping; needs the native pump (net/pump.py).
    segments: int = 1
    token: int = 0  # the job's data token (JobSpec.token)
    mac_key: bytes | None = None  # integrity "mac": the per-packet MAC key (JobSpec.mac_key)

    def packet_lanes(self, bits: int) -> int:
        return packet_lanes(self.elements, bits)

    def lanes_per_chunk(self, bits: int) -> int:
        return chunk_lanes(self.elements, self.segments, bits)


RunTransfers = Callable[..., None]


class Collective:
    """The reducer of one worker over one or more aggregator jobs of one wire format. Every
    round through it runs the codec ``fmt`` was computed from: the caller pairs them once
    (``sync.session.Session``), so nothing here derives a format from a codec."""

    def __init__(
        self,
        fmt: WireFormat,
        jobs: Sequence[JobHandle],
        run: RunTransfers,
        *,
        policy: RetryPolicy | None = None,
        streaming: bool = False,
    ):
        if not jobs:
            raise ValueError("a collective needs at least one aggregator job")
        if len({j.worker for j in jobs}) != 1:
            raise ValueError("this worker must have the same id in every job")
        self.fmt, self.jobs, self.run = fmt, list(jobs), run
        # ``run(pairs, work=...)`` accepted: pieces encode and decode while chunks stream (the
        # round's Reducer protocol reads ``streams``)
        self.streams = streaming
        # decode-sum-encode jobs: at most this many coordinates per piece (one per packet)
        self.partition_limit = None if fmt.lanes else min(j.elements for j in jobs)
        self.policy = policy or RetryPolicy()
        self.stats = {(j.address, j.job): StreamStats() for j in jobs}
        # round trips are learnt per job and kept across rounds and calls
        self._round_trips = {(j.address, j.job): RoundTrip() for j in jobs}
        self._next_chunk = [0] * len(jobs)  # the transfers' chunk ids
        self._next_packet = [0] * len(jobs)  # the aggregator's chunk ids (segments per chunk)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._boundaries: dict[torch.device, DeviceBoundary] = {}

    def restart(self, jobs: Sequence[JobHandle], run: RunTransfers | None = None) -> None:
        """The jobs were registered afresh (an aggregator restarted, or a standby replaced it):
        every stream's chunks are numbered from 0 again, round trips are learnt anew, and
        ``jobs`` (the same geometry, perhaps other addresses) carry the rounds from now on."""
        if len(jobs) != len(self.jobs):
            raise ValueError(f"{len(jobs)} jobs cannot replace {len(self.jobs)}")
        self.jobs = list(jobs)
        self.run = run or self.run
        for j in self.jobs:
            self.stats.setdefault((j.address, j.job), StreamStats())
        self._round_trips = {(j.address, j.job): RoundTrip() for j in self.jobs}
        self._next_chunk = [0] * len(self.jobs)
        self._next_packet = [0] * len(self.jobs)

    def partition_size(self, requested: int | None = None) -> int:
        """The partition a round through these jobs runs with: ``requested`` (2**20 by
        default), at most ``partition_limit`` where a server decodes whole payloads."""
        size = requested or PARTITION_ELEMENTS
        return size if self.partition_limit is None else min(size, self.partition_limit)

    # -- the Reducer protocol --------------------------------------------------------------
    def max(self, summaries: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every summary's elementwise max over workers, in one MAX round."""
        flat = torch.cat([s.reshape(-1).to(torch.float32) for s in summaries])
        boundary = self._boundary(flat.device)
        host = boundary.to_host(flat)
        boundary.ready()
        ordered = float_to_ordered_int(host).contiguous()
        result = torch.empty_like(ordered)
        layout = self._sharded(Op.MAX, ordered, result, ordered.numel(), 32, 32)
        self.run([(job, transfer) for job, transfer, _ in layout])
        maxima = boundary.to_device(ordered_int_to_float(result))
        out, offset = [], 0
        for summary in summaries:
            out.append(maxima[offset : offset + summary.numel()].view(summary.shape))
            offset += summary.numel()
        return out

    def sum(self, phase: SumPhase) -> None:
        if self.fmt.lanes:
            self._sum_lanes(phase)
        else:
            self._sum_payloads(phase)

    # -- homomorphic codecs: lanes summed slot by slot -----------------------------------------
    def _sum_lanes(self, phase: SumPhase) -> None:
        in_bits, out_bits = self.fmt.in_bits, self.fmt.out_bits
        offsets, lanes = [], 0
        for i in range(len(phase)):
            offsets.append(lanes)
            lanes += -(-phase.lanes(i) // 8) * 8  # every piece from a whole byte at any width
        boundary = self._boundary(phase.out.device)
        boundary.ready()  # the last round's sums have left the host buffers
        # packets coded by the transport as they go and come (host tensors only)
        coder = None if boundary.crosses else phase.lane_coder()
        upstream = self._buffer("up", packed_nbytes(lanes, in_bits))
        result = self._buffer("sum", packed_nbytes(lanes, out_bits))
        shards = self._sharded(Op.SUM, upstream, result, lanes, in_bits, out_bits, coder)
        if coder is None:
            work = StreamedSum(phase, self.fmt, offsets, upstream, result, shards, boundary)
        else:
            work = CodedSum(phase)
        pairs = [(job, transfer) for job, transfer, _ in shards]
        if self.streams:
            work.hold()
            self.run(pairs, work=work)
        else:
            work.encode_all()
            self.run(pairs)
        work.finish()

    def _sharded(self, op, upstream, result, lanes, in_bits, out_bits, coder=None) -> list:
        """Transfers streaming ``lanes`` through the jobs' shards: (job, transfer, first lane);
        ``coder``: the transport codes their packets (``LaneBuffers``)."""
        up = memoryview(upstream.numpy()).cast("B")
        down = memoryview(result.numpy()).cast("B")
        bits = max(in_bits, out_bits)
        shards = shard_lanes(lanes, len(self.jobs), self.jobs[0].lanes_per_chunk(bits))
        planned = []
        for j, (job, (start, count)) in enumerate(zip(self.jobs, shards, strict=True)):
            if count == 0:
                continue
            layout = ChunkLayout(count, job.lanes_per_chunk(bits), in_bits, out_bits)
            buffers = LaneBuffers(
                layout,
                up[start * in_bits // 8 : packed_nbytes(start + count, in_bits)],
                down[start * out_bits // 8 : packed_nbytes(start + count, out_bits)],
                coder=coder,
                lane0=start,
            )
            packets = -(-count // job.packet_lanes(bits))
            transfer = self._transfer(j, job, op, buffers, job.segments, packets)
            planned.append((job, transfer, start))
        return planned

    # -- other codecs: one whole payload per piece, decoded at a server ------------------------
    def _sum_payloads(self, phase: SumPhase) -> None:
        boundary = self._boundary(phase.out.device)
        blobs = []
        for i in range(len(phase)):
            ctx = phase.context(i)
            payload = boundary.payload_to_host(phase.encode(i))
            blob = payload_wire.serialize(payload, ctx.step, ctx.partition)
            if len(blob) > MAX_PAYLOAD:
                raise ValueError(
                    f"{phase.codec.name} payload of a {phase.pieces[i].length}-coordinate "
                    f"partition is {len(blob)} bytes, more than one packet ({MAX_PAYLOAD}); "
                    f"partition it into at most {self.partition_limit} coordinates"
                )
            blobs.append(blob)
        shards = shard_lanes(len(blobs), len(self.jobs), 1)
        planned = []
        for j, (job, (first, count)) in enumerate(zip(self.jobs, shards, strict=True)):
            if count:
                elements = [phase.pieces[i].length for i in range(first, first + count)]
                buffers = PayloadBuffers(blobs[first : first + count], elements)
                planned.append((job, self._transfer(j, job, Op.SUM, buffers), first))
        self.run([(job, transfer) for job, transfer, _ in planned])
        for _, transfer, first in planned:
            for k in range(transfer.buffers.chunks):
                i = first + k
                data = transfer.buffers.result(k)
                contributors = int(transfer.contributors[k])
                summed = payload_wire.deserialize(data, phase.pieces[i].length, contributors)
                phase.deliver(i, boundary.payload_to_device(summed))

    # -- shared --------------------------------------------------------------------------------
    def _transfer(self, index, job: JobHandle, op, buffers, segments=1, packets=None) -> Transfer:
        packets = buffers.chunks if packets is None else packets
        transfer = Transfer(
            job=job.job, worker=job.worker, op=op, first_chunk=self._next_chunk[index],
            slots=job.slots, buffers=buffers, max_contributors=job.max_contributors,
            policy=self.policy, stats=self.stats[(job.address, job.job)],
            what=f"{job.address[0]}:{job.address[1]} job {job.job}",
            rtt=self._round_trips[(job.address, job.job)],
            segments=segments, first_packet=self._next_packet[index], token=job.token,
            mac_key=job.mac_key,
        )  # fmt: skip
        self._next_chunk[index] += buffers.chunks
        self._next_packet[index] += packets
        return transfer

    def _buffer(self, name: str, nbytes: int) -> torch.Tensor:
        """A host byte buffer reused between rounds of the same size (decode copies out of
        it); pinned where a GPU copies to and from it."""
        key = (name, nbytes)
        if key not in self._buffers:
            if len(self._buffers) > 8:
                self._buffers.clear()
            self._buffers[key] = pinned_empty(nbytes)
        return self._buffers[key]

    def _boundary(self, device: torch.device) -> DeviceBoundary:
        """The copies between the round's device and the host buffers (``device_boundary``)."""
        boundary = self._boundaries.get(device)
        if boundary is None:
            boundary = self._boundaries[device] = DeviceBoundary(device)
        return boundary


class CodedSum:
    """The work of a SUM round whose packets the transport codes (``SumPhase.lane_coder``), in
    ``StreamedSum``'s interface: each packet is encoded as it is sent and each result decoded
    where it lands, so no chunk waits and nothing is encoded or decoded here; the phase's work
    behind the round (``SumPhase.work_behind``) still runs between batches of packets."""

    def __init__(self, phase: SumPhase):
        self.phase = phase

    @property
    def pending(self) -> bool:
        return self.phase.has_background

    def hold(self) -> None:
        pass  # every chunk can go at once

    def encode_all(self) -> None:
        pass

    def step(self, now: float) -> list[tuple[Transfer, int]]:
        self.phase.work_behind()
        return []

    def finish(self) -> None:
        self.phase.delivered_by_transport()


class StreamedSum:
    """The lanes of a SUM round, piece by piece (sans-IO).

    ``hold`` keeps every chunk back; then each ``step`` (the transport calls it between batches
    of packets while ``pending``) encodes the next piece into the upstream buffer and releases
    the chunks it completes, or decodes the next piece whose chunks are all back, or else does
    one item of the phase's work behind it (the round's next wave, ``SumPhase.work_behind``).
    ``finish`` decodes what is left once the transfers are done.
    """

    def __init__(self, phase: SumPhase, fmt: WireFormat, offsets: list[int],
                 upstream: torch.Tensor, result: torch.Tensor, shards: list,
                 boundary: DeviceBoundary | None = None):  # fmt: skip
        self.phase, self.fmt, self.offsets = phase, fmt, offsets
        self.boundary = boundary or DeviceBoundary("cpu")
        self.upstream, self.result, self.shards = upstream, result, shards
        self.encoded = self.decoded = 0
        self._dtype: torch.dtype | None = None  # a 32-bit lane's dtype (int32 or float32)
        # results counted when the next piece was last found incomplete: the transport asks
        # between every batch of packets, and nothing can have changed without a new result
        self._checked_at = -1
        self._spans = [self._spans_of(i) for i in range(len(phase))]

    def _spans_of(self, i: int) -> list[tuple[Transfer, int, int, int]]:
        """(transfer, its first lane, a, b): the lanes [a, b) of piece ``i`` each shard carries."""
        low, high = self.offsets[i], self._lane_end(i)
        spans = []
        for _, transfer, first in self.shards:
            a, b = max(low, first), min(high, first + transfer.buffers.layout.lanes)
            if a < b:
                spans.append((transfer, first, a, b))
        return spans

    @property
    def pending(self) -> bool:
        return self.encoded < len(self.phase) or self._decodable() or self.phase.has_background

    def hold(self) -> None:
        for _, transfer, _ in self.shards:
            transfer.stream.ready = transfer.first

    def encode_all(self) -> None:
        while self.encoded < len(self.phase):
            self._encode_next()

    def step(self, now: float) -> list[tuple[Transfer, int]]:
        if self.encoded < len(self.phase):
            self._encode_next()
            return self._release(now)
        if self._decodable():
            self._decode_next()
        elif self.phase.has_background:  # the next wave's preparation, behind these pieces
            self.phase.work_behind()
        return []

    def finish(self) -> None:
        while self.decoded < len(self.phase):
            if not self._decodable():
                raise RuntimeError(f"piece {self.decoded} of the round has chunks without a sum")
            self._decode_next()

    def _encode_next(self) -> None:
        """The next piece, encoded straight into its place in the send buffer."""
        i, bits = self.encoded, self.fmt.in_bits
        start, used = self.offsets[i] * bits // 8, packed_nbytes(self.phase.lanes(i), bits)
        end = self.offsets[i + 1] * bits // 8 if i + 1 < len(self.offsets) else self._total(bits)
        into = self.upstream[start : start + used]
        if self.boundary.crosses:  # encoded on the device, only the packed lanes come down
            payload = self.phase.encode(i)
            field = payload.fields[self.phase.codec.lane_fields[0]]
            if field.numel() * field.element_size() != used:
                raise ValueError(f"{self.phase.codec.name}: {field.nbytes} lane bytes for {used}")
            self.boundary.to_host(field, into=into)
        else:
            payload = self.phase.encode(i, into=into)
        self.upstream[start + used : end].zero_()  # padding lanes add nothing
        self.boundary.ready()  # the lanes are in place before any chunk of them is released
        field = payload.fields[self.phase.codec.lane_fields[0]]
        if field.dtype.itemsize == 4:
            self._dtype = field.dtype
        self.encoded += 1

    def _release(self, now: float) -> list[tuple[Transfer, int]]:
        # lanes in place: every encoded piece, with the padding lanes after it
        pieces = len(self.phase)
        encoded = self.offsets[self.encoded] if self.encoded < pieces else self._total_lanes()
        out = []
        for _, transfer, first in self.shards:
            layout = transfer.buffers.layout
            covered = max(0, min(encoded - first, layout.lanes))
            ready = covered // layout.lanes_per_chunk
            if covered == layout.lanes:
                ready = layout.chunks
            out += [(transfer, c) for c in transfer.release(transfer.first + ready, now)]
        return out

    def _decodable(self) -> bool:
        i = self.decoded
        if i >= self.encoded:
            return False
        received = sum(transfer.stream.received for _, transfer, _ in self.shards)
        if received == self._checked_at:
            return False
        if all(int(c.min()) > 0 for c in self._counts(i)):
            return True
        self._checked_at = received
        return False

    def _decode_next(self) -> None:
        i = self.decoded
        piece = self.phase.pieces[i]
        out_bits = self.fmt.out_bits
        start, end = self.offsets[i] * out_bits // 8, self._end(i, out_bits)
        data = self.boundary.to_device(self.result[start:end])  # decoded on the device
        if out_bits == 32:
            data = data.view(self._dtype or torch.int32)
        counts = self._counts(i)
        low = min(int(c.min()) for c in counts)
        high = max(int(c.max()) for c in counts)
        field = {self.phase.codec.lane_fields[1]: data}
        if low == high:
            summed = Payload(field, piece.length, low)
        else:
            summed = Payload(field, piece.length, 1, counts=self._lane_counts(i))
        self.phase.deliver(i, summed)
        self.decoded += 1

    def _counts(self, i: int) -> list[np.ndarray]:
        """The contributors of every chunk that piece ``i``'s lanes span, shard by shard."""
        counts = []
        for transfer, first, a, b in self._spans[i]:
            per = transfer.buffers.layout.lanes_per_chunk
            counts.append(transfer.contributors[(a - first) // per : -(-(b - first) // per)])
        return counts

    def _lane_counts(self, i: int) -> torch.Tensor:
        """Contributors of every lane of piece ``i`` (``Payload.counts``: THC's lanes are its
        padded rotation, which its decode divides before rotating back)."""
        low = self.offsets[i]
        counts = np.empty(self._lane_end(i) - low, dtype=np.float32)
        for transfer, first, a, b in self._spans[i]:
            per_lane = np.repeat(transfer.contributors, transfer.buffers.layout.lanes_per_chunk)
            counts[a - low : b - low] = per_lane[a - first : b - first]
        return torch.from_numpy(counts)

    def _total_lanes(self) -> int:
        return sum(transfer.buffers.layout.lanes for _, transfer, _ in self.shards)

    def _total(self, bits: int) -> int:
        return packed_nbytes(self._total_lanes(), bits)

    def _lane_end(self, i: int) -> int:
        return self.offsets[i] + self.phase.lanes(i)

    def _end(self, i: int, bits: int) -> int:
        return packed_nbytes(self._lane_end(i), bits)

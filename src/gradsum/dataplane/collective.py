"""One worker's side of an allreduce through aggregators, with a codec; transport passed in.

``Collective.allreduce(tensor)`` runs a codec round (``codecs.base``) over one or more
aggregator jobs: precondition, the preliminary MAX round (if the codec has one), encode, the SUM
round, decode. Each round is a set of ``Transfer``s, one per aggregator shard, that the caller's
``run`` executes to completion: real UDP sockets (``net.client``) or an in-memory network in
tests. This module never touches a socket or a clock.

All workers of a job must call ``allreduce`` with tensors of the same sizes in the same order
(the usual collective contract): that keeps their chunk numbering, which names the slot rounds at
the aggregator, in step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..codecs.base import Codec, CodecContext, Payload, float_to_ordered_int, ordered_int_to_float
from ..codecs.bits import packed_nbytes
from . import payload_wire
from .codec_wire import WireFormat, lanes_fitting
from .jobspec import Address
from .packet import MAX_PAYLOAD, Op
from .pipeline import PartwiseRound
from .transfer import LaneBuffers, PayloadBuffers, Transfer
from .worker import ChunkLayout, RetryPolicy, RoundTrip, StreamStats, shard_lanes


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

    def packet_lanes(self, bits: int) -> int:
        return min(self.elements, lanes_fitting(bits)) // 8 * 8

    def lanes_per_chunk(self, bits: int) -> int:
        return self.packet_lanes(bits) * self.segments


RunTransfers = Callable[[Sequence[tuple[JobHandle, Transfer]]], None]

# Codecs whose decode is a linear function of the sum divided by the contributor count, so
# chunks completed by different quorums can be decoded lane by lane.
_LINEAR = frozenset({"bfp", "none"})


class Collective:
    def __init__(
        self,
        codec: Codec,
        fmt: WireFormat,
        jobs: Sequence[JobHandle],
        run: RunTransfers,
        *,
        seed: int = 0,
        rank: int | None = None,
        policy: RetryPolicy | None = None,
        pipelined: bool = False,
    ):
        if not jobs:
            raise ValueError("a collective needs at least one aggregator job")
        if len({j.worker for j in jobs}) != 1:
            raise ValueError("this worker must have the same id in every job")
        self.codec, self.fmt, self.jobs, self.run = codec, fmt, list(jobs), run
        self.seed = seed
        # ``run(pairs, work=...)`` accepted: blockwise codecs encode and decode part by part
        # while their chunks stream (dataplane/pipeline.py)
        self.pipelined = pipelined
        # decode-sum-encode jobs: one partition of `elements` coordinates per packet
        self.partition_size = min(j.elements for j in jobs)
        self.policy = policy or RetryPolicy()
        # The codec's per-worker randomness follows the global rank; the job's worker id is
        # local to an aggregator (they differ under a hierarchy of switches).
        self.worker = jobs[0].worker if rank is None else rank
        self.step = 0
        self.stats = {(j.address, j.job): StreamStats() for j in jobs}
        # round trips are learnt per job and kept across rounds and calls
        self._round_trips = {(j.address, j.job): RoundTrip() for j in jobs}
        self._next_chunk = [0] * len(jobs)  # the transfers' chunk ids
        self._next_packet = [0] * len(jobs)  # the aggregator's chunk ids (segments per chunk)
        self._buffers: dict[tuple, torch.Tensor] = {}

    def allreduce(self, tensor: torch.Tensor, key: Hashable = None) -> torch.Tensor:
        """The average over all workers of ``tensor`` (float32, same shape)."""
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if self.fmt.lanes:
            average = self._lane_allreduce(flat, key)
        else:
            average = self._payload_allreduce(flat, key)
        self.step += 1
        return average.reshape(tensor.shape)

    # -- homomorphic codecs: lanes summed slot by slot -----------------------------------------
    def _lane_allreduce(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        codec, fmt = self.codec, self.fmt
        ctx = CodecContext(self.seed, self.worker, self.step, 0, key)
        x = codec.precondition(flat, ctx)
        summary = codec.summarize(x, ctx)
        shared = None if summary is None else self.max_reduce(summary)
        if self._partwise(shared):
            return self._partwise_sum(x, shared, ctx)
        payload = codec.encode(x, ctx, shared)
        upstream = payload.fields[fmt.upstream].contiguous()
        lanes = upstream.numel() * upstream.element_size() * 8 // fmt.in_bits
        dtype = upstream.dtype if fmt.out_bits == 32 else torch.uint8
        result = self._buffer("sum", packed_nbytes(lanes, fmt.out_bits), dtype)
        counts = self._sharded(Op.SUM, upstream, result, lanes, fmt.in_bits, fmt.out_bits)
        return self._decode(Payload({fmt.downstream: result}, payload.length), counts, ctx, shared)

    def _partwise(self, shared) -> bool:
        fmt = self.fmt
        return (self.pipelined and shared is not None and hasattr(self.codec, "encode_into")
                and len(self.jobs) == 1 and fmt.in_bits == fmt.out_bits == 32)  # fmt: skip

    def _partwise_sum(self, x: torch.Tensor, shared: torch.Tensor, ctx) -> torch.Tensor:
        """The SUM round of a blockwise codec, encoded and decoded part by part as it streams."""
        job, lanes = self.jobs[0], x.numel()
        per_chunk = job.lanes_per_chunk(32)
        layout = ChunkLayout(lanes, per_chunk, 32, 32)
        upstream = self._buffer("up", lanes * 4, torch.int32)
        result = self._buffer("sum", lanes * 4, torch.int32)
        out = self.codec.new_output(lanes)
        buffers = LaneBuffers(layout, memoryview(upstream.numpy()).cast("B"),
                              memoryview(result.numpy()).cast("B"))  # fmt: skip
        packets = -(-lanes // job.packet_lanes(32))
        transfer = self._transfer(0, job, Op.SUM, buffers, job.segments, packets)
        round_ = PartwiseRound(self.codec, x, shared, upstream, result, out, per_chunk, transfer)
        self.run([(job, transfer)], work=round_)
        if round_.finish():
            return out
        summed = Payload({self.fmt.downstream: result}, lanes)  # a quorum mixed the counts
        return self._decode(summed, [(0, layout, transfer.contributors)], ctx, shared)

    def max_reduce(self, summary: torch.Tensor) -> torch.Tensor:
        ordered = float_to_ordered_int(summary.reshape(-1)).contiguous()
        result = torch.empty_like(ordered)
        self._sharded(Op.MAX, ordered, result, ordered.numel(), 32, 32)
        return ordered_int_to_float(result).reshape(summary.shape)

    def _sharded(self, op, upstream, result, lanes, in_bits, out_bits) -> list:
        """Stream ``lanes`` through the jobs' shards; return each shard's (first lane, layout,
        contributors per chunk)."""
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
            )
            packets = -(-count // job.packet_lanes(bits))
            transfer = self._transfer(j, job, op, buffers, job.segments, packets)
            planned.append((job, transfer, start, layout))
        self.run([(job, transfer) for job, transfer, _, _ in planned])
        return [(start, layout, transfer.contributors) for _, transfer, start, layout in planned]

    def _decode(self, summed: Payload, chunks: list, ctx, shared) -> torch.Tensor:
        """Decode the sum; ``chunks`` holds (first lane, layout, contributors per chunk)."""
        low = min(int(counts.min()) for _, _, counts in chunks)
        high = max(int(counts.max()) for _, _, counts in chunks)
        if low == high:
            whole = Payload(summed.fields, summed.length, low)
            return self.codec.decode(whole, ctx, shared)
        if self.codec.name not in _LINEAR:
            raise NotImplementedError(
                f"chunks of this {self.codec.name} round were summed over {low}..{high} workers "
                "(partial aggregation); decoding that needs per-coordinate counts in the codec"
            )
        sums = self.codec.decode(Payload(summed.fields, summed.length, 1), ctx, shared)
        per_lane = np.empty(sum(layout.lanes for _, layout, _ in chunks), dtype=np.float32)
        for start, layout, counts in chunks:
            lanes = np.repeat(counts, layout.lanes_per_chunk)[: layout.lanes]
            per_lane[start : start + layout.lanes] = lanes
        return sums / torch.from_numpy(per_lane[: summed.length])

    # -- other codecs: one whole payload per partition, decoded at a server --------------------
    def _payload_allreduce(self, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        size = self.partition_size
        parts = [(s, min(size, flat.numel() - s)) for s in range(0, flat.numel(), size)]
        contexts, blobs = [], []
        for p, (start, count) in enumerate(parts):
            ctx = CodecContext(
                self.seed, self.worker, self.step, p, None if key is None else (key, p)
            )
            x = self.codec.precondition(flat[start : start + count], ctx)
            if self.codec.summarize(x, ctx) is not None:
                raise NotImplementedError(f"{self.codec.name}: preliminary rounds per partition")
            blob = payload_wire.serialize(self.codec.encode(x, ctx))
            if len(blob) > MAX_PAYLOAD:
                raise ValueError(
                    f"{self.codec.name} payload of a {count}-coordinate partition is {len(blob)} "
                    f"bytes, more than one packet ({MAX_PAYLOAD}); register fewer elements per slot"
                )
            contexts.append(ctx)
            blobs.append(blob)
        out = torch.empty_like(flat)
        shards = shard_lanes(len(parts), len(self.jobs), 1)
        planned = []
        for j, (job, (first, count)) in enumerate(zip(self.jobs, shards, strict=True)):
            if count:
                elements = [parts[p][1] for p in range(first, first + count)]
                buffers = PayloadBuffers(blobs[first : first + count], elements)
                planned.append((job, self._transfer(j, job, Op.SUM, buffers), first))
        self.run([(job, transfer) for job, transfer, _ in planned])
        for _, transfer, first in planned:
            for i in range(transfer.buffers.chunks):
                start, count = parts[first + i]
                data = transfer.buffers.result(i)
                summed = payload_wire.deserialize(data, count, int(transfer.contributors[i]))
                out[start : start + count] = self.codec.decode(summed, contexts[first + i])
        return out

    # -- shared --------------------------------------------------------------------------------
    def _transfer(self, index, job: JobHandle, op, buffers, segments=1, packets=None) -> Transfer:
        packets = buffers.chunks if packets is None else packets
        transfer = Transfer(
            job=job.job, worker=job.worker, op=op, first_chunk=self._next_chunk[index],
            slots=job.slots, buffers=buffers, max_contributors=job.max_contributors,
            policy=self.policy, stats=self.stats[(job.address, job.job)],
            what=f"{job.address[0]}:{job.address[1]} job {job.job}",
            rtt=self._round_trips[(job.address, job.job)],
            segments=segments, first_packet=self._next_packet[index],
        )  # fmt: skip
        self._next_chunk[index] += buffers.chunks
        self._next_packet[index] += packets
        return transfer

    def _buffer(self, name: str, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A result buffer reused between calls of the same size (decode copies out of it)."""
        count = nbytes // torch.empty((), dtype=dtype).element_size()
        key = (name, count, dtype)
        if key not in self._buffers:
            if len(self._buffers) > 8:
                self._buffers.clear()
            self._buffers[key] = torch.empty(count, dtype=dtype)
        return self._buffers[key]

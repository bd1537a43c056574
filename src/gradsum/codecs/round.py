"""The codec round: the one path a gradient takes through any aggregator.

A worker's round over one flat gradient::

    partitions -> contexts -> precondition -> summarize -> MAX -> encode -> SUM -> decode

``CodecRound`` owns every step that is the codec's: partitioning (2**20 coordinates by
default), the contexts that seed each partition's randomness, error feedback and decoding. An
aggregator contributes only a ``Reducer`` with two operations, so every aggregator runs the same
estimator with the same random streams:

* ``max(summaries)``: the elementwise MAX over workers of every partition's summary (the
  preliminary round; one call for all partitions, so a transport batches them);
* ``sum(phase)``: the SUM over workers of wire payloads. ``phase`` (a ``SumPhase``) hands out
  the payloads to send, ``encode(i)``, and takes each summed payload back, ``deliver(i, sum)``,
  in any order; a transport that streams encodes the next piece while earlier ones are in
  flight and decodes a piece as soon as its sum is in.

Through a reducer that streams, a codec whose preparation costs about its encode
(``codec.costly_preparation``: THC's rotation under error feedback) runs its partitions in
waves of 1, 2, 4, ...: each wave's MAX, then its SUM, while the next wave is preconditioned and
summarized behind the pieces in flight (``SumPhase.work_behind``); the values are those of one
MAX and one SUM.

A codec of several stages (``codec.stages > 1``: PowerSGD sums P = MQ, then Q = M^T P) runs
the MAX and the SUM once per stage, each stage's inputs derived by ``codec.stage_input`` from
the partition and the previous stage's average, and ``codec.finish`` makes the partition's
average from every stage's. A reducer sees only more rounds of the same two operations, so
every aggregator carries such a codec without knowing it; all workers run the same stages
because which partitions take part in a stage depends only on the layout (``codec.partitions``).

What the SUM of payloads is follows from ``codec.aggregation``: an integer or float sum of the
lanes for homomorphic codecs, ``codec.aggregate`` (decode, sum, re-encode) otherwise. Whatever
the transport, it is the value ``codec.aggregate`` defines; ``run_round`` runs the round
in-process for any number of workers and is the reference every aggregator is tested against.

Thread safety: a ``CodecRound`` holds no state between calls; its codec may be driven from
several threads at once (see ``Codec``), each call with its own key.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from .base import (
    Codec,
    CodecContext,
    DeviceChecks,
    LaneCoder,
    Payload,
    aggregator_context,
    combine_summaries,
)
from .buffers import Recycler

PARTITION_ELEMENTS = 1 << 20
"""THC's authors partition gradients into 2**20 coordinates (4 MiB of fp32): large enough to
amortise the preliminary round and keep the rotation's padding small, small enough to pipeline."""

# Rounds' outputs on the CPU, handed out again once the caller has copied the average away
# (into param.grad or a DDP bucket): a fresh 25 MiB output faults in 6,400 pages every step.
_OUTPUTS = Recycler()

PIECE_ELEMENTS = 1 << 18
"""The least a piece of a blockwise codec holds: streamed pieces overlap encode, transfer and
decode, and below this the per-piece overheads outweigh the overlap."""


def partition_bounds(total: int, size: int = PARTITION_ELEMENTS) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``total`` elements; the last one may be shorter."""
    if size < 1:
        raise ValueError(f"partition size must be >= 1, got {size}")
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def partition_id(key: Hashable, index: int) -> int:
    """A stable integer for (tensor key, partition index), the same in every process, so each
    partition draws its own rounding randomness."""
    return zlib.crc32(repr((key, index)).encode())


def wave_partitions(count: int) -> list[list[int]]:
    """Partitions 0..count-1 in waves of 1, 2, 4, ...: a wave's preparation behind the SUM of
    one half its size keeps pace with it (THC prepares a partition in about the CPU time of
    its encode and decode), and a round of P partitions takes log2(P) + 1 MAX rounds."""
    waves, start, size = [], 0, 1
    while start < count:
        waves.append(list(range(start, min(count, start + size))))
        start, size = start + size, size * 2
    return waves


def pipelines(reducer: Reducer, codec: Codec) -> bool:
    """Whether a round of ``codec`` through ``reducer`` runs in waves (``CodecRound.reduce``):
    the reducer streams, so work can run behind pieces in flight, and the codec's preparation
    is worth running there (``Codec.costly_preparation``) in rounds of one stage with a MAX."""
    return (bool(getattr(reducer, "streams", False)) and codec.costly_preparation
            and codec.stages == 1 and codec.needs_summary)  # fmt: skip


class Reducer(Protocol):
    """What an aggregator implements for a round (see the module docstring)."""

    def max(self, summaries: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The elementwise max over workers of every summary, in order."""

    def sum(self, phase: SumPhase) -> None:
        """Sum every piece's payload over workers and ``phase.deliver`` each sum."""

    # Optional: ``streams = True`` where the reducer overlaps encode, transfer and decode piece
    # by piece; a blockwise codec's partitions are then cut into pieces of whole blocks (the
    # same values, bit for bit). Other reducers get one piece per partition.


@dataclass(frozen=True)
class Piece:
    """What one payload carries: coordinates [start, stop) of the flat gradient, which lie in
    partition ``partition``; ``offset`` is where they start within the partition's prepared
    input (a blockwise codec's pieces are whole blocks of it, with their summary entries)."""

    start: int
    stop: int
    partition: int
    offset: int
    context: CodecContext

    @property
    def length(self) -> int:
        return self.stop - self.start


class SumPhase:
    """The SUM half of one worker's round: payloads to send, sums to decode.

    ``encode(i)`` gives piece i's upstream payload (encoding it on first use), ``deliver(i, P)``
    decodes the downstream payload P into the round's output. Every piece must be delivered
    once. ``lanes(i)`` is what piece i's lanes number before it is encoded, so a transport can
    lay its buffers out up front.
    """

    def __init__(self, codec: Codec, pieces: list[Piece], prepared: list[torch.Tensor],
                 shared: list[torch.Tensor | None], out: torch.Tensor,
                 background: Sequence[Callable[[], None]] = ()):  # fmt: skip
        self.codec, self.pieces, self.out = codec, pieces, out
        self._prepared, self._shared = prepared, shared
        # the next wave's preparation (``CodecRound.reduce``), done while this one's pieces
        # are in flight: a streaming transport calls ``work_behind`` when it has nothing else
        # to do, and whatever is left runs once the SUM is back
        self._background = list(background)
        self._payloads: list[Payload | None] = [None] * len(pieces)
        self._delivered = [False] * len(pieces)
        # the round's deferred checks, also where a transport encodes or decodes on a thread
        # of its own (contexts are per thread)
        self._checks = DeviceChecks.current()

    def _deferring(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._checks is None else self._checks.deferring()

    def __len__(self) -> int:
        return len(self.pieces)

    def lanes(self, index: int) -> int:
        return self.codec.lanes(self.pieces[index].length)

    def context(self, index: int) -> CodecContext:
        return self.pieces[index].context

    def aggregator_context(self, index: int) -> CodecContext:
        """The context of the aggregator's side of piece ``index`` (re-encoding randomness)."""
        return aggregator_context(self.pieces[index].context)

    def encode(self, index: int, into: torch.Tensor | None = None) -> Payload:
        """Piece ``index``'s payload; ``into`` (uint8, exactly its lane bytes) is a transport's
        send buffer the codec writes the lanes into (``Codec.encode_into``)."""
        payload = self._payloads[index]
        if payload is None:
            piece = self.pieces[index]
            x, shared = self._inputs(piece)
            with self._deferring():
                if into is None:
                    payload = self.codec.encode(x, piece.context, shared)
                else:
                    payload = self.codec.encode_into(x, piece.context, shared, into)
            self._payloads[index] = payload
        elif into is not None:
            raise RuntimeError(f"piece {index} was encoded before its send buffer was given")
        return payload

    def payloads(self) -> list[Payload]:
        """Every piece's payload, in order (for transports that send them all at once)."""
        return [self.encode(i) for i in range(len(self.pieces))]

    def deliver(self, index: int, summed: Payload) -> None:
        if self._delivered[index]:
            raise RuntimeError(f"piece {index} of the round was delivered twice")
        piece = self.pieces[index]
        shared = self.shared_of(index)
        with self._deferring():
            decode(self.codec, summed, piece.context, shared, self.out[piece.start : piece.stop])
        self._delivered[index] = True
        self._payloads[index] = None  # its buffers may be reused

    def lane_coder(self) -> LaneCoder | None:
        """One coder of all the phase's lanes (``Codec.lane_coder``), for a transport that codes
        packet by packet, where lanes are coordinates end to end: every piece but the last a
        whole number of blocks and of bytes of lanes (no padding between pieces), their inputs
        one contiguous run of memory. None where the codec offers none or this phase is not so
        laid out; then pieces are encoded and delivered as usual."""
        codec, pieces = self.codec, self.pieces
        block = codec.blockwise
        if not pieces or block is None or type(codec).lane_coder is Codec.lane_coder:
            return None
        inputs = [self._inputs(piece) for piece in pieces]
        x0, first = inputs[0][0], pieces[0].start
        for k, (piece, (x, shared)) in enumerate(zip(pieces, inputs, strict=True)):
            last = k == len(pieces) - 1
            if shared is None or codec.lanes(piece.length) != piece.length:
                return None
            if not last and (piece.length % block or piece.length % 8
                             or pieces[k + 1].start != piece.stop):  # fmt: skip
                return None
            if not _follows(x, x0, piece.start - first):
                return None
        length = pieces[-1].stop - first
        x = x0.as_strided((length,), (1,))  # the pieces' inputs, end to end (checked above)
        shared = torch.cat([s.reshape(-1) for _, s in inputs])
        return codec.lane_coder(x, shared, self.out[first : pieces[-1].stop])

    def delivered_by_transport(self) -> None:
        """Every piece's sum was decoded into the output by the transport (``lane_coder``)."""
        self._delivered = [True] * len(self.pieces)
        self._payloads = [None] * len(self.pieces)

    def deliver_all(self, sums: Sequence[Payload]) -> None:
        for index, summed in enumerate(sums):
            self.deliver(index, summed)

    @property
    def has_background(self) -> bool:
        return bool(self._background)

    def work_behind(self) -> None:
        """One item of the work that runs behind this SUM (the next wave's preparation)."""
        if self._background:
            with self._deferring():
                self._background.pop(0)()

    def finish_background(self) -> None:
        while self._background:
            self.work_behind()

    def check_complete(self) -> None:
        missing = [i for i, done in enumerate(self._delivered) if not done]
        if missing:
            raise RuntimeError(f"the reducer never delivered pieces {missing} of the round")

    def shared_of(self, index: int) -> torch.Tensor | None:
        """The preliminary round's result for piece ``index``."""
        return self._inputs(self.pieces[index])[1]

    def _inputs(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, shared = self._prepared[piece.partition], self._shared[piece.partition]
        block = self.codec.blockwise
        if block is None or piece.length == x.numel():
            return x, shared
        x = x[piece.offset : piece.offset + piece.length]
        if shared is not None:
            shared = shared[piece.offset // block : -(-(piece.offset + piece.length) // block)]
        return x, shared


def _follows(x: torch.Tensor, x0: torch.Tensor, offset: int) -> bool:
    """Whether ``x`` is the contiguous run of ``x0``'s memory ``offset`` elements on."""
    return (
        x.is_contiguous()
        and x.dtype == x0.dtype
        and x.device == x0.device
        and x.untyped_storage().data_ptr() == x0.untyped_storage().data_ptr()
        and x.data_ptr() == x0.data_ptr() + offset * x.element_size()
    )


def decode(codec: Codec, summed: Payload, ctx: CodecContext, shared, out: torch.Tensor) -> None:
    """The average a summed payload stands for, into ``out``; per-lane contributor counts
    (partial aggregation by different quorums) divide lane by lane where the codec's decode is
    linear (``Codec.decode_counted``)."""
    if summed.counts is None:
        codec.decode_into(summed, ctx, shared, out)
        return
    if not codec.linear_decode:
        low, high = int(summed.counts.min()), int(summed.counts.max())
        raise NotImplementedError(
            f"chunks of this {codec.name} round were summed over {low}..{high} workers (partial "
            "aggregation); its decode is not linear, so it needs one count for the whole piece"
        )
    codec.decode_counted(summed, ctx, shared, out)


@dataclass(frozen=True)
class CodecRound:
    """One worker's round over a flat gradient (see the module docstring)."""

    codec: Codec
    seed: int = 0
    partition_elements: int = PARTITION_ELEMENTS

    def run(self, flat: torch.Tensor, reducer: Reducer, *, worker: int, key: Hashable,
            step: int, checks: DeviceChecks | None = None) -> torch.Tensor:  # fmt: skip
        """The average over workers of ``flat`` (1-D float32), as the codec estimates it.

        ``checks``: where the round's checks of device values (finiteness, the shared scalars)
        go, for the caller to read once (``raise_if_failed``) when it is ready to wait for the
        device (the hooks read a step's once); without it, those of an enclosing
        ``DeviceChecks.deferring()``, else the round reads its own before it returns."""
        checks = checks or DeviceChecks.current()
        own = checks is None
        checks = DeviceChecks() if own else checks
        with checks.deferring():
            prepared = self.prepare(flat, worker=worker, key=key, step=step,
                                    lazy=pipelines(reducer, self.codec))  # fmt: skip
            result = self.reduce(prepared, reducer)
        if own:
            checks.raise_if_failed()
        return result

    def run_many(self, flats: Sequence[torch.Tensor], reducer: Reducer, *, worker: int,
                 keys: Sequence[Hashable], step: int,
                 checks: DeviceChecks | None = None) -> list[torch.Tensor]:  # fmt: skip
        """The averages of a step's gradients (``flats``, ``keys`` theirs), each ``run``'s bit
        for bit. Where the codec batches a step (``thc.step.StepRound``: THC on the fused
        kernels) and the reducer does not run waves (``pipelines``), one MAX of one summary and
        one SUM of every partition of every gradient the batch takes
        (``StepRound.batched_groups``), in launches that do not grow with them, and a ``run``
        of its own for each of the others (every worker runs the same); where the codec joins
        a step's gradients (``Codec.joins``: bfp on a device), one ``run`` of them end to end;
        otherwise one ``run`` per gradient. ``checks`` as for ``run``."""
        from .thc.step import StepRound, StepSumPhase

        flats, keys = [flat.reshape(-1) for flat in flats], list(keys)
        if self.codec.joins(flats, self.partition_elements) and not pipelines(reducer, self.codec):
            return self._run_joined(flats, reducer, worker=worker, keys=keys, step=step,
                                    checks=checks)  # fmt: skip
        chosen = [] if pipelines(reducer, self.codec) else StepRound.batched_groups(
            self.codec, flats, keys, self.partition_elements)  # fmt: skip
        averages: list[torch.Tensor | None] = [None] * len(flats)
        for g, (flat, key) in enumerate(zip(flats, keys, strict=True)):
            if g not in chosen:  # a round of its own (every worker runs the same ones)
                averages[g] = self.run(flat, reducer, worker=worker, key=key, step=step,
                                       checks=checks)  # fmt: skip
        if not chosen:
            return averages
        batched = StepRound.build(self.codec, [flats[g] for g in chosen], worker=worker,
                                  keys=[keys[g] for g in chosen], step=step, seed=self.seed,
                                  partition_elements=self.partition_elements)  # fmt: skip
        checks = checks or DeviceChecks.current()
        own = checks is None
        checks = DeviceChecks() if own else checks
        with checks.deferring():
            summaries = batched.prepare()
            (shared,) = reducer.max([summaries])
            phase = StepSumPhase(batched, shared)
            reducer.sum(phase)
            phase.check_complete()
            for g, average in zip(chosen, phase.averages(), strict=True):
                averages[g] = average
        if own:
            checks.raise_if_failed()
        return averages

    def _run_joined(self, flats: list[torch.Tensor], reducer: Reducer, *, worker: int,
                    keys: list[Hashable], step: int,
                    checks: DeviceChecks | None) -> list[torch.Tensor]:  # fmt: skip
        """``run_many`` as one round of the gradients end to end (``Codec.joins``), each from a
        whole block on (zeros between them: a block's zeros change neither its exponent nor its
        other values): two launches to join them, one round's to reduce them."""
        block = self.codec.blockwise
        spans, start = [], 0
        for flat in flats:
            spans.append((start, start + flat.numel()))
            start += -(-flat.numel() // block) * block
        zeros = flats[0].new_zeros(block)
        parts = []
        for flat, (a, b) in zip(flats, spans, strict=True):
            parts.append(flat)
            if (b - a) % block:
                parts.append(zeros[: block - (b - a) % block])
        joined = torch.cat(parts)
        average = self.run(joined, reducer, worker=worker, key=tuple(keys), step=step,
                           checks=checks)  # fmt: skip
        return [average[a:b] for a, b in spans]

    def reduce(self, prepared: Prepared, reducer: Reducer) -> torch.Tensor:
        """A prepared round's MAX, SUM and decode, stage after stage. May run again on the same
        ``prepared`` (a transport redoes a round that its aggregator lost): encoding a partition
        again gives the same payload and leaves the codec's state as the first encode did, and a
        codec of several stages starts again from its first."""
        if prepared.stages is not None:
            prepared.stages.rewind()
        streamed = getattr(reducer, "streams", False)
        if pipelines(reducer, self.codec) and prepared.stages is None:
            return self._reduce_in_waves(prepared, reducer)
        prepared.prepare_all()
        current: Prepared | None = prepared
        while True:
            if self.codec.needs_summary:
                current.share(reducer.max(current.summaries))
            phase = current.sum_phase(streamed=streamed)
            reducer.sum(phase)
            phase.check_complete()
            following = current.next_stage(phase)
            if following is None:
                return current.result(phase)
            current = following

    def _reduce_in_waves(self, prepared: Prepared, reducer: Reducer) -> torch.Tensor:
        """The round of one stage through a streaming reducer, its partitions in waves of 1,
        2, 4, ... (``wave_partitions``): each wave's MAX, then its SUM, during which the next
        wave is preconditioned and summarized behind the pieces in flight. So the first chunks leave
        after one partition's preparation instead of the whole tensor's, and a rotation (THC's
        precondition under error feedback) overlaps the wire. Every partition's MAX is its own
        elementwise max whatever wave carries it, so the averages are those of one MAX and one
        SUM bit for bit; the waves follow from the layout alone, so every worker runs the same
        rounds (a redone round too, on the inputs its first try prepared)."""
        waves = wave_partitions(len(prepared.bounds))
        out = prepared.output()
        for k, wave in enumerate(waves):
            for i in wave:
                prepared.prepare_partition(i)  # a redone round's: already there
            prepared.share_some(wave, reducer.max([prepared.summaries[i] for i in wave]))
            following = waves[k + 1] if k + 1 < len(waves) else []
            background = [lambda i=i: prepared.prepare_partition(i) for i in following]
            phase = prepared.sum_phase(streamed=True, partitions=wave, out=out,
                                       background=background)  # fmt: skip
            reducer.sum(phase)
            phase.finish_background()
            phase.check_complete()
        return out

    def prepare(self, flat: torch.Tensor, *, worker: int, key: Hashable, step: int,
                lazy: bool = False) -> Prepared:  # fmt: skip
        """Partition, precondition and summarize: everything before the MAX. ``lazy``: leave
        preconditioning and summaries to ``reduce`` through a streaming reducer, which does
        them partition by partition behind the SUM of earlier ones (see ``pipelines``)."""
        if flat.dim() != 1:
            raise ValueError(f"a round takes a flat gradient, got shape {tuple(flat.shape)}")
        codec = self.codec
        bounds = codec.partitions(key, flat.numel(), self.partition_elements)
        if bounds is None:
            bounds = partition_bounds(flat.numel(), self.partition_elements)
        contexts = [
            CodecContext(self.seed, worker, step, partition_id(key, i), key=(key, i))
            for i in range(len(bounds))
        ]
        if codec.stages == 1:
            count = len(bounds)
            round_ = Prepared(self, flat, bounds, contexts, [None] * count, [None] * count)
            if not lazy:
                round_.prepare_all()
            return round_
        prepared = [
            codec.precondition(flat[a:b], ctx) for (a, b), ctx in zip(bounds, contexts, strict=True)
        ]
        stages = Stages(self, flat, bounds, contexts, prepared)
        return stages.prepare([codec.stage_input(x, ctx, 0, None)
                               for x, ctx in zip(prepared, contexts, strict=True)])  # fmt: skip


@dataclass
class Prepared:
    """A round (or one stage of a codec's several) between its preliminary round and its SUM.
    ``bounds`` place each input's average in the SUM's output; ``stages`` is the state of a
    codec of several stages (None for one)."""

    round: CodecRound
    flat: torch.Tensor
    bounds: list[tuple[int, int]]
    contexts: list[CodecContext]
    inputs: list[torch.Tensor]
    summaries: list[torch.Tensor | None]
    stages: Stages | None = None
    stage: int = 0  # which of the codec's stages this round is
    active: list[int] | None = None  # the partitions taking part in it (a codec of stages)

    def __post_init__(self) -> None:
        self.shared: list[torch.Tensor | None] = [None] * len(self.bounds)
        # partitions not yet preconditioned and summarized (a lazy ``CodecRound.prepare``)
        self._unprepared = {i for i, x in enumerate(self.inputs) if x is None}

    def prepare_partition(self, i: int) -> None:
        """Precondition and summarize partition ``i`` of the flat gradient, once."""
        if i not in self._unprepared:
            return
        codec, (a, b), ctx = self.round.codec, self.bounds[i], self.contexts[i]
        x = codec.precondition(self.flat[a:b], ctx)
        self.inputs[i], self.summaries[i] = x, codec.summarize(x, ctx)
        self._unprepared.discard(i)

    def prepare_all(self) -> None:
        for i in sorted(self._unprepared):
            self.prepare_partition(i)

    def share_some(self, partitions: Sequence[int], shared: Sequence[torch.Tensor]) -> None:
        """The MAX round's result for ``partitions`` (one wave of them)."""
        if len(shared) != len(partitions):
            raise ValueError(f"{len(shared)} summaries back for {len(partitions)} partitions")
        for i, value in zip(partitions, shared, strict=True):
            self.shared[i] = value

    def output(self) -> torch.Tensor:
        """A fresh output for the round's average (recycled on the CPU for a round of one
        stage, whose caller copies it away)."""
        count, device = (self.bounds[-1][1] if self.bounds else 0), self.flat.device
        if self.stages is None:
            return _OUTPUTS.empty_on(device, count, torch.float32)
        return torch.empty(count, dtype=torch.float32, device=device)

    def next_stage(self, phase: SumPhase) -> Prepared | None:
        """The next stage's round, once ``phase`` (this one's SUM) is complete; None: done."""
        return None if self.stages is None else self.stages.advance(self, phase)

    def result(self, phase: SumPhase) -> torch.Tensor:
        """The round's average, after the last stage's ``phase``."""
        return phase.out if self.stages is None else self.stages.finish()

    def share(self, shared: Sequence[torch.Tensor]) -> None:
        """The MAX round's result, one tensor per partition."""
        if len(shared) != len(self.bounds):
            raise ValueError(f"{len(shared)} summaries back for {len(self.bounds)} partitions")
        self.shared = list(shared)

    def sum_phase(self, streamed: bool = False, partitions: Sequence[int] | None = None,
                  out: torch.Tensor | None = None,
                  background: Sequence[Callable[[], None]] = ()) -> SumPhase:  # fmt: skip
        """The SUM half; ``streamed``: a blockwise codec's partitions in pieces of whole blocks.
        ``partitions`` (default all) and ``out`` (default a fresh ``output``): one wave's SUM
        into the round's output; ``background``: work to do behind it (``SumPhase``)."""
        out = self.output() if out is None else out
        chosen = range(len(self.bounds)) if partitions is None else partitions
        return SumPhase(self.round.codec, self._pieces(streamed, chosen), self.inputs,
                        self.shared, out, background)  # fmt: skip

    def _pieces(self, streamed: bool, partitions: Sequence[int]) -> list[Piece]:
        block = self.round.codec.blockwise if streamed else None
        pieces = []
        for p in partitions:
            (start, stop), ctx = self.bounds[p], self.contexts[p]
            size = stop - start
            step = size if block is None else block * max(1, -(-PIECE_ELEMENTS // block))
            for offset in range(0, size, step):
                end = min(size, offset + step)
                pieces.append(Piece(start + offset, start + end, p, offset, ctx))
        return pieces


class Stages:
    """The state of a round of a codec of several stages, between its stages: every partition's
    prepared input and the averages of the stages it took part in."""

    def __init__(self, round_: CodecRound, flat: torch.Tensor, bounds: list[tuple[int, int]],
                 contexts: list[CodecContext], inputs: list[torch.Tensor]):  # fmt: skip
        self.round, self.codec = round_, round_.codec
        self.flat, self.bounds, self.contexts, self.inputs = flat, bounds, contexts, inputs
        self.averages: list[list[torch.Tensor]] = [[] for _ in bounds]

    def rewind(self) -> None:
        """Forget the averages of earlier stages: the round starts again from its first."""
        self.averages = [[] for _ in self.bounds]

    def prepare(self, stage_inputs: Sequence[torch.Tensor | None],
                stage: int = 0) -> Prepared | None:  # fmt: skip
        """Stage ``stage``'s round over the partitions whose ``stage_input`` is not None."""
        active = [i for i, x in enumerate(stage_inputs) if x is not None]
        if not active and stage > 0:
            return None
        inputs = [stage_inputs[i].reshape(-1) for i in active]
        contexts = [self.contexts[i] for i in active]
        ends = torch.tensor([x.numel() for x in inputs]).cumsum(0).tolist()
        placed = list(zip([0, *ends[:-1]], ends, strict=True))  # their averages in the output
        summaries = [self.codec.summarize(x, ctx) for x, ctx in zip(inputs, contexts, strict=True)]
        return Prepared(self.round, self.flat, placed, contexts, inputs, summaries, self,
                        stage, active)  # fmt: skip

    def advance(self, done: Prepared, phase: SumPhase) -> Prepared | None:
        """Keep stage ``done``'s averages; the next stage's round, or None after the last."""
        for i, (a, b) in zip(done.active, done.bounds, strict=True):
            self.averages[i].append(phase.out[a:b])
        stage = done.stage + 1
        if stage >= self.codec.stages:
            return None
        active = set(done.active)  # a partition that sat out a stage is done
        stage_inputs = [
            self.codec.stage_input(self.inputs[i], self.contexts[i], stage,
                                   self.averages[i][-1]) if i in active else None
            for i in range(len(self.bounds))
        ]  # fmt: skip
        return self.prepare(stage_inputs, stage)

    def finish(self) -> torch.Tensor:
        """Every partition's average (``codec.finish``), in place in the round's output."""
        out = _OUTPUTS.empty_on(self.flat.device, self.flat.numel(), torch.float32)
        for (a, b), x, ctx, averages in zip(self.bounds, self.inputs, self.contexts,
                                            self.averages, strict=True):  # fmt: skip
            out[a:b] = self.codec.finish(x, ctx, averages)
        return out


class PhaseClock:
    """Seconds spent in each phase of a reference round, summed over workers: ``encode``
    (precondition, summarize, encode), ``aggregate`` (the MAX and the SUM) and ``decode``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.seconds[name] += self.clock() - start


@dataclass
class RoundResult:
    """An in-process round of every worker: what each worker decodes, and, for a round of one
    piece, its payloads, their aggregate and the preliminary round's result."""

    average: torch.Tensor
    pieces: list[tuple[list[Payload], Payload, torch.Tensor | None]]

    def bits_per_coordinate(self) -> tuple[float, float]:
        """Wire bits per coordinate of one worker's payloads up and of the sums down, over
        every piece (summaries not included)."""
        up = sum(payloads[0].nbytes for payloads, _, _ in self.pieces)
        down = sum(summed.nbytes for _, summed, _ in self.pieces)
        return 8.0 * up / self.average.numel(), 8.0 * down / self.average.numel()

    def _single(self):
        if len(self.pieces) != 1:
            raise ValueError(f"this round has {len(self.pieces)} pieces; read .pieces instead")
        return self.pieces[0]

    @property
    def payloads(self) -> list[Payload]:
        return self._single()[0]

    @property
    def aggregate(self) -> Payload:
        return self._single()[1]

    @property
    def shared(self) -> torch.Tensor | None:
        return self._single()[2]


def run_round(
    codec: Codec,
    inputs: Sequence[torch.Tensor],
    *,
    seed: int = 0,
    step: int = 0,
    key: Hashable = None,
    contributors: Sequence[int] | None = None,
    partition_elements: int = PARTITION_ELEMENTS,
    clock: PhaseClock | None = None,
) -> RoundResult:
    """The reference: every worker's round in-process, ``inputs`` one gradient per worker.

    ``codec`` stands for every worker (its state is keyed by worker). ``contributors`` limits
    whose payloads reach the aggregator (partial aggregation); all workers take part in the
    preliminary round and all decode the same sums, so the result is worker 0's. ``clock``
    collects the seconds of each phase (``gradsum bench codecs``)."""
    checks = DeviceChecks()
    with checks.deferring():
        result = _run_round(codec, inputs, seed, step, key, contributors, partition_elements,
                            clock or PhaseClock())  # fmt: skip
    checks.raise_if_failed()
    return result


def _run_round(codec, inputs, seed, step, key, contributors, partition_elements, clock):
    rounds = CodecRound(codec, seed, partition_elements)
    workers: list[Prepared | None] = []
    for w, x in enumerate(inputs):
        with clock.phase("encode"):
            flat = x.reshape(-1).to(torch.float32)
            workers.append(rounds.prepare(flat, worker=w, key=key, step=step))
    chosen = range(len(inputs)) if contributors is None else contributors
    # one stage: every worker decodes the same sums, so worker 0 decodes them for all; a codec
    # of several stages derives each worker's next inputs from them, so every worker decodes
    deciders = range(len(inputs)) if codec.stages > 1 else [0]
    pieces = []
    while workers[0] is not None:
        if codec.needs_summary:
            with clock.phase("aggregate"):
                summaries = zip(*(w.summaries for w in workers), strict=True)
                shared = [combine_summaries(s) for s in summaries]
            for prepared in workers:
                prepared.share(shared)
        phases = [prepared.sum_phase() for prepared in workers]
        for i in range(len(phases[0])):
            payloads = []
            for w in chosen:
                with clock.phase("encode"):
                    payloads.append(phases[w].encode(i))
            with clock.phase("aggregate"):
                summed = codec.aggregate(payloads, phases[0].aggregator_context(i))
            for w in deciders:
                with clock.phase("decode") if w == 0 else contextlib.nullcontext():
                    phases[w].deliver(i, summed)
            pieces.append((payloads, summed, phases[0].shared_of(i)))
        last = workers
        with clock.phase("encode"):  # the next stage's inputs (per worker, as encodes are)
            workers = [prepared.next_stage(phase)
                       for prepared, phase in zip(workers, phases, strict=True)]  # fmt: skip
    with clock.phase("decode"):
        average = last[0].result(phases[0])
    for w in deciders[1:]:  # each worker's own finish (its error feedback)
        last[w].result(phases[w])
    return RoundResult(average, pieces)


def run_step_round(
    codec: Codec,
    inputs: Sequence[Sequence[torch.Tensor]],
    *,
    keys: Sequence[Hashable] | None = None,
    seed: int = 0,
    step: int = 0,
    partition_elements: int = PARTITION_ELEMENTS,
    clock: PhaseClock | None = None,
) -> list[torch.Tensor]:
    """The reference of a step: every worker's round over all of its gradients at once,
    ``inputs`` one list of gradients per worker (a model's groups, ``keys`` theirs; default
    0, 1, ...), the average of each. Where the codec batches a step (``thc.step.StepRound``:
    THC on the fused kernels) every partition of every gradient it takes
    (``StepRound.batched_groups``) is one row of one round, in a fixed number of launches;
    otherwise, and always in values, it is ``run_round`` of each gradient."""
    from .thc.step import StepRound

    groups = len(inputs[0])
    keys = list(range(groups)) if keys is None else list(keys)
    clock = clock or PhaseClock()
    flats = [x.reshape(-1) for x in inputs[0]]
    chosen = StepRound.batched_groups(codec, flats, keys, partition_elements)
    averages: list[torch.Tensor | None] = [None] * groups
    for g in range(groups):
        if g not in chosen:  # a round of its own
            averages[g] = run_round(codec, [worker[g] for worker in inputs], seed=seed, step=step,
                                    key=keys[g], partition_elements=partition_elements,
                                    clock=clock).average  # fmt: skip
    if chosen:
        checks = DeviceChecks()
        with checks.deferring():
            batched = _run_step_round(codec, [[worker[g] for g in chosen] for worker in inputs],
                                      [keys[g] for g in chosen], seed, step, partition_elements,
                                      clock)  # fmt: skip
        checks.raise_if_failed()
        for g, average in zip(chosen, batched, strict=True):
            averages[g] = average
    return averages


def _run_step_round(codec, inputs, keys, seed, step, partition_elements, clock):
    from .thc.step import StepRound

    rounds = []
    for w, flats in enumerate(inputs):
        with clock.phase("encode"):
            flats = [x.reshape(-1).to(torch.float32) for x in flats]
            batched = StepRound.build(codec, flats, worker=w, keys=keys, step=step, seed=seed,
                                      partition_elements=partition_elements)  # fmt: skip
            batched.prepare()
        rounds.append(batched)
    with clock.phase("aggregate"):
        shared = torch.stack([r.summaries for r in rounds]).amax(dim=0)
    payloads = []
    for batched in rounds:
        with clock.phase("encode"):
            payloads.append(batched.encode(shared))
    first = rounds[0]
    with clock.phase("aggregate"):
        sums = [codec.aggregate([p[i] for p in payloads], aggregator_context(ctx))
                for i, ctx in enumerate(first.contexts)]  # fmt: skip
    if not first.decodes(sums):
        raise RuntimeError("the step's sums are not the packed sums of one contributor count")
    with clock.phase("decode"):
        return first.decode(sums)


def run_quorum_round(
    codec: Codec,
    inputs: Sequence[torch.Tensor],
    present: Sequence[torch.Tensor],
    *,
    seed: int = 0,
    step: int = 0,
    key: Hashable = None,
    partition_elements: int = PARTITION_ELEMENTS,
) -> torch.Tensor:
    """The reference of a round whose chunks completed with different quorums (a switch's
    partial aggregation): lane j of piece i sums the workers w with ``present[i][w, j]`` (one
    bool tensor of (workers, ``codec.lanes``) per piece), and the decode divides each lane by
    its own count (``Payload.counts``). Every worker takes part in the preliminary round, as on
    the switch, where a quorum's MAX waits for all that arrive in time. For integer-summing
    codecs of one stage; ``run_round(contributors=...)`` is the round of one quorum for all."""
    from .integers import from_integers, sum_dtype, to_integers

    if codec.stages != 1 or not codec.aggregation.integer_only:
        raise TypeError(f"a quorum round sums integer lanes; {codec.name!r} has none to sum")
    checks = DeviceChecks()
    with checks.deferring():
        rounds = CodecRound(codec, seed, partition_elements)
        workers = [rounds.prepare(x.reshape(-1).to(torch.float32), worker=w, key=key, step=step)
                   for w, x in enumerate(inputs)]  # fmt: skip
        if codec.needs_summary:
            summaries = zip(*(w.summaries for w in workers), strict=True)
            shared = [combine_summaries(s) for s in summaries]
            for prepared in workers:
                prepared.share(shared)
        phases = [prepared.sum_phase() for prepared in workers]
        if len(present) != len(phases[0]):
            raise ValueError(f"{len(present)} masks for a round of {len(phases[0])} pieces")
        for i, mask in enumerate(present):
            if tuple(mask.shape) != (len(inputs), phases[0].lanes(i)):
                raise ValueError(
                    f"piece {i}'s mask is {tuple(mask.shape)}, not "
                    f"(workers, lanes) = ({len(inputs)}, {phases[0].lanes(i)})"
                )
            total = sum(to_integers(codec, phase.encode(i)).to(torch.int64) * mask[w]
                        for w, phase in enumerate(phases))  # fmt: skip
            counts = mask.sum(dim=0)
            low, high = int(counts.min()), int(counts.max())
            if low < 1:
                raise ValueError(f"piece {i} has lanes that no worker contributed to")
            summed = from_integers(codec, total.to(sum_dtype(codec)), phases[0].pieces[i].length,
                                   low)  # fmt: skip
            if low != high:
                summed = replace(summed, contributors=1, counts=counts.to(torch.float32))
            phases[0].deliver(i, summed)
        average = workers[0].result(phases[0])
    checks.raise_if_failed()
    return average


def worker_contexts(
    workers: int, seed: int = 0, step: int = 0, partition: int = 0
) -> list[CodecContext]:
    """Contexts of one partition for every worker (for driving codec calls by hand)."""
    return [
        CodecContext(seed=seed, worker=w, step=step, partition=partition) for w in range(workers)
    ]


def nmse(estimate: torch.Tensor, inputs: Sequence[torch.Tensor]) -> float:
    """||estimate - mean||^2 / mean_i ||x_i||^2 (the THC paper's normalisation)."""
    stacked = torch.stack([x.reshape(-1).to(torch.float64) for x in inputs])
    truth = stacked.mean(dim=0)
    error = (estimate.reshape(-1).to(torch.float64) - truth).pow(2).sum()
    scale = stacked.pow(2).sum(dim=1).mean()
    return float(error / scale) if scale > 0 else float(error)

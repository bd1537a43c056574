"""A step's THC rounds in a fixed number of launches, whatever its partitions and gradients.

On a GPU a THC round is bound by its launches (~70 per 2**20 partition with error feedback,
``tests/codecs/test_launches.py``), and a step makes one round per partition of each of its
gradients (a GPT's 27 WFBP groups, ready together). Here every partition of every gradient of
the step is one row of [P, N] buffers (N: the longest row's padded length), and each operation
of the round is one launch over all rows, the per-partition scalars (norms, grid scalars, seeds)
[P] device arrays:

    encode: the rows' memory norms (one multi-tensor reduction), the rotation with the bounded
            memory added (2 kernels), the summaries (one multi-tensor reduction), the grid
            scalars from the MAX round's norms (1 kernel), the quantization with the new
            rotated memory (1 kernel), and where memory stays in the gradient's domain
            (padded rows) its residual (2 kernels);
    decode: the sums, one buffer, dequantized and rotated back into the step's output
            (2 kernels).

Each row takes the per-partition round's operations in its order, so the values are the
round's (``codec.round.run_round`` of each gradient) bit for bit: a row's kernels are the fused
kernels of one partition with per-row scalars, a row's rotation stages stop at its own block
(``_triton._stages_upto``), its thresholds are ``base.hashed_uniform`` of its own seed,
computed in the kernel, and its norms come from ``torch._foreach_norm``, whose value for a
tensor does not depend on the others in its list (``base.norms_of``; the per-partition path takes
them from the same call on a list of one).

With tensor scales (``THC.describe``) the rows of several tensors take their pieces' norms
from one segment reduction and their scales from one kernel (``_rows_tensor_scales_kernel``),
and are rotated after the MAX round, divided by them.

What batches (``StepRound.build`` says None otherwise, and the caller runs a round per
gradient): THC with independent rounding and the fixed clamp, of one scale per partition or
tensor scales, with or without error feedback (rotated or in the gradient's domain), on the
fused kernels (a GPU with Triton; the CPU under the interpreter in tests), every row a whole
number of packed bytes. ``decodes`` says whether sums decode together: packed, of one
contributor count for the whole step (a quorum's counts per lane decode row by row).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..base import CodecContext, DeviceChecks, Payload, check_finite, norms_of, require
from ..bits import packed_nbytes
from ..feedback import ErrorFeedback, TransformedErrorFeedback
from ..round import PARTITION_ELEMENTS, Piece, SumPhase, decode, partition_bounds, partition_id
from . import triton_kernels
from .codec import DOWNSTREAM, THC, UPSTREAM, _reads_scalars
from .hadamard import padded_length

KIND_NONE, KIND_ROTATED, KIND_GRADIENT = 0, 1, 2  # where a row's error feedback memory lives


@dataclass(frozen=True)
class Row:
    """Partition ``index`` of gradient ``group``: coordinates [start, stop) of that gradient,
    at ``source`` of the step's flat input and output."""

    group: int
    index: int
    start: int
    stop: int
    source: int
    padded: int
    block: int
    kind: int

    @property
    def length(self) -> int:
        return self.stop - self.start


class StepLayout:
    """The rows of a step's gradients (their lengths and keys) and their device tables: fixed
    for the run, so built once and kept with the codec (``_LAYOUTS``)."""

    def __init__(self, codec, inner: THC, lengths: Sequence[int], keys: Sequence[Hashable],
                 partition_elements: int, device: torch.device, seed: int):  # fmt: skip
        rows, source = [], 0
        self.group_starts = []
        pieces = []  # every row's tensors' pieces; None: one scale
        for g, (total, key) in enumerate(zip(lengths, keys, strict=True)):
            self.group_starts.append(source)
            bounds = codec.partitions(key, total, partition_elements)
            if bounds is None:
                bounds = partition_bounds(total, partition_elements)
            for i, (a, b) in enumerate(bounds):
                padded = padded_length(b - a, inner.rotation_block)
                block = padded if inner.rotation_block is None else inner.rotation_block
                kind = KIND_NONE
                if isinstance(codec, TransformedErrorFeedback):
                    ctx = CodecContext(key=(key, i))
                    kind = (KIND_ROTATED if inner.transform_keeps_length(b - a, ctx)
                            else KIND_GRADIENT)  # fmt: skip
                elif isinstance(codec, ErrorFeedback):
                    kind = KIND_GRADIENT
                rows.append(Row(g, i, a, b, source + a, padded, block, kind))
                pieces.append(inner._pieces(CodecContext(key=(key, i))))
            source += total
        self.total = source
        self.rows_of = rows
        self.rows = len(rows)
        self.width = max((r.padded for r in rows), default=1)
        self.keys = tuple(keys)
        self.partition_ids = [partition_id(keys[r.group], r.index) for r in rows]
        sums = [packed_nbytes(r.padded, inner.sum_bits) for r in rows]
        self.sum_starts = [sum(sums[:i]) for i in range(len(sums))]
        self.sum_bytes = sums
        # every distinct padded length's signs once (a rotation's signs depend on it alone)
        signs, sign_start = [], {}
        for r in rows:
            if r.padded not in sign_start:
                sign_start[r.padded] = sum(s.numel() for s in signs)
                ctx = CodecContext(seed, key=(keys[r.group], r.index))  # the round's signs
                signs.append(inner._rotation(r.length, ctx, device).signs)
        self.signs = torch.cat(signs) if signs else torch.zeros(1, device=device)
        # tensor scales: a row's pieces, or one piece of its length where it has one scale
        self.tensor_scales = any(p is not None for p in pieces)
        lengths, firsts, plain = [], [], []
        for r, p in zip(rows, pieces, strict=True):
            firsts.append(len(lengths))
            plain.append(sum(1 for q in plain if q >= 0) if p is None else -1)
            lengths.extend(p if p is not None else (r.length,))
        self.pieces, self.plain = len(lengths), sum(1 for p in pieces if p is None)
        self.plain_rows = [i for i, p in enumerate(pieces) if p is None]
        meta = [
            [r.source, r.length, r.padded, r.block.bit_length() - 1, sign_start[r.padded],
             r.source, r.kind, start, first, 0 if p is None else len(p), index]
            for r, start, first, p, index in zip(rows, self.sum_starts, firsts, pieces, plain,
                                                 strict=True)
        ]  # fmt: skip
        self.piece_lengths = torch.tensor(lengths, dtype=torch.int64).to(device)
        self.sqrt_lengths = self.piece_lengths.to(torch.float64).sqrt()
        self.meta = torch.tensor(meta, dtype=torch.int64).to(device)
        self.meta_rows = [(m[8], m[9], m[10]) for m in meta]  # PIECE0, NPIECES, SUMMARY
        self.scales = torch.tensor([1.0 / math.sqrt(r.block) for r in rows],
                                   dtype=torch.float32).to(device)  # fmt: skip
        self.sqrt_padded = torch.tensor([math.sqrt(r.padded) for r in rows],
                                        dtype=torch.float64).to(device)  # fmt: skip
        g = inner.granularity
        clamp = inner.threshold
        self.constants = torch.tensor([g, 2 * clamp, 2 * clamp / g, g / 2],
                                      dtype=torch.float64).to(device)  # fmt: skip
        self.kinds = {r.kind for r in rows}
        tile = min(triton_kernels.TILE, self.width)
        self._spans = {select: any(r.block > tile and (select == 0 or (r.kind == KIND_ROTATED)
                                                      == (select == 1)) for r in rows)
                       for select in (0, 1, 2)}  # fmt: skip
        self.zeros = torch.zeros(max(1, inner.workers * self.pieces), device=device)

    def spans(self, select: int) -> bool:
        """Whether a row that a rotation of ``select`` (``_triton._selected``) takes has a block
        across tiles: the cross-tile kernel's launch is needed."""
        return self._spans[select]

    def fits(self, inner: THC) -> bool:
        """Whether the row kernels take this layout (``triton_kernels.rows_fit``)."""
        per = 8 // inner.bits if inner.bits in (1, 2, 4, 8) else 0
        return (self.rows > 0 and per > 0 and all(r.padded % per == 0 for r in self.rows_of)
                and all(r.padded <= self.width for r in self.rows_of)
                and triton_kernels.rows_fit(self.width, inner.bits))  # fmt: skip


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layout(codec, inner: THC, lengths, keys, partition_elements, device, seed) -> StepLayout:
    kept = _LAYOUTS.setdefault(codec, {})
    key = (tuple(lengths), tuple(keys), partition_elements, device, seed)
    layout = kept.get(key)
    if layout is None:
        layout = kept[key] = StepLayout(codec, inner, lengths, keys, partition_elements, device,
                                        seed)  # fmt: skip
    return layout


def _inner(codec) -> THC | None:
    inner = codec.inner if isinstance(codec, ErrorFeedback) else codec
    return inner if isinstance(inner, THC) else None


class StepRound:
    """One worker's batched round over a step's gradients: ``prepare`` (precondition and
    summarize: the summaries, one [P] tensor for the MAX round), ``encode`` (the MAX round's
    [P] result; every row's payload) and ``decode`` (every row's summed payload; the averages,
    one per gradient, views of one output). Error feedback's memory is kept per row as the
    per-partition round keeps it (``ErrorFeedback.memory`` by the row's state key), as views
    of one [P, N] buffer that the next step reads without gathering it."""

    def __init__(self, codec, inner: THC, layout: StepLayout, flats: Sequence[torch.Tensor],
                 worker: int, seed: int, step: int,
                 static: StaticBuffers | None = None):  # fmt: skip
        self.codec, self.inner, self.layout = codec, inner, layout
        self.feedback = isinstance(codec, ErrorFeedback)
        self.worker, self.seed = worker, seed
        self.contexts = self.contexts_of(step)
        self.flats = [f.reshape(-1) for f in flats]
        self.checks = DeviceChecks.current()
        # a recorded step's (``thc.graphs``): its input, seeds and memory at fixed addresses
        self.static = static

    def contexts_of(self, step: int) -> list[CodecContext]:
        """Every row's context at ``step`` (its partition's, as its own round has it)."""
        layout = self.layout
        return [
            CodecContext(self.seed, self.worker, step, pid, key=(layout.keys[r.group], r.index))
            for r, pid in zip(layout.rows_of, layout.partition_ids, strict=True)
        ]

    @classmethod
    def build(cls, codec, flats: Sequence[torch.Tensor], *, worker: int,
              keys: Sequence[Hashable], step: int, seed: int = 0,
              partition_elements: int = PARTITION_ELEMENTS) -> StepRound | None:  # fmt: skip
        """The batched round of these gradients, or None where it does not batch (see the
        module docstring): the caller then runs a round per gradient, the same values."""
        inner = _inner(codec)
        if inner is None or inner.correlated or inner.spread_clamp or codec.stages != 1:
            return None
        if not flats or len({f.device for f in flats}) != 1:
            return None
        device = flats[0].device
        probe = torch.empty(0, device=device)
        if _reads_scalars(probe) or not triton_kernels.use_for(device):
            return None
        layout = _layout(codec, inner, [f.numel() for f in flats], keys, partition_elements,
                         device, seed)  # fmt: skip
        if not layout.fits(inner):
            return None
        return cls(codec, inner, layout, flats, worker, seed, step)

    @staticmethod
    def batched_groups(codec, flats: Sequence[torch.Tensor], keys: Sequence[Hashable],
                       partition_elements: int = PARTITION_ELEMENTS) -> list[int]:  # fmt: skip
        """Which of a step's gradients its batch takes (``build`` of them is not None): all
        where the codec and device batch, but those with a partition too short for a packed
        byte (fewer coordinates than lanes to a byte: a scalar parameter's gradient), which
        run a round of their own; none elsewhere."""
        inner = _inner(codec)
        if inner is None or inner.correlated or inner.spread_clamp or codec.stages != 1:
            return []
        if not flats or len({f.device for f in flats}) != 1:
            return []
        device = flats[0].device
        if _reads_scalars(torch.empty(0, device=device)) or not triton_kernels.use_for(device):
            return []
        per = 8 // inner.bits if inner.bits in (1, 2, 4, 8) else 0
        chosen = []
        for g, (flat, key) in enumerate(zip(flats, keys, strict=True)):
            bounds = codec.partitions(key, flat.numel(), partition_elements)
            if bounds is None:
                bounds = partition_bounds(flat.numel(), partition_elements)
            if per and all(padded_length(b - a, inner.rotation_block) % per == 0
                           for a, b in bounds):  # fmt: skip
                chosen.append(g)
        return chosen

    # -- before the MAX round ------------------------------------------------------------------
    def prepare(self) -> torch.Tensor:
        """Precondition and summarize every row: the summaries for the MAX round, one tensor:
        the [P] norms; with tensor scales, the norms of the rows of one scale, then a (workers
        x pieces) matrix of every piece's norm in this worker's row (zeros elsewhere)."""
        layout, rows = self.layout, self.layout.rows_of
        if self.static is not None:  # filled by the caller (``graphs.StepGraph.prepare``)
            self.src = self.static.src
        else:
            flats = [f.to(torch.float32) for f in self.flats]
            src = flats[0] if len(flats) == 1 else torch.cat(flats)
            self.src = src.contiguous()
        xs = [self.src[r.source : r.source + r.length] for r in rows]
        memory, norms, bound = None, None, None
        if self.feedback:
            memory, errors = self._memory()
            bound = self.codec.bound
            if memory is not None and bound is not None:
                norms = torch.stack(norms_of(xs + errors))
        # with tensor scales the rows of gradient-domain memory are rotated after the MAX round
        # (``encode``), divided by their tensors' scales
        select = 1 if layout.tensor_scales else 0
        w, xp = None, None
        if select == 0 or self.feedback or KIND_ROTATED in layout.kinds:  # else nothing to do
            w, xp = triton_kernels.rows_rotate(layout, self.src, memory, norms, bound,
                                               self.feedback, select=select)  # fmt: skip
        self.w, self.xp = w, xp
        x = self.src if xp is None else xp  # every row's x + e, as the source lies
        summarized = [
            w[i, : rows[i].padded] if rows[i].kind == KIND_ROTATED
            else x[rows[i].source : rows[i].source + rows[i].length]
            for i in (layout.plain_rows if layout.tensor_scales else range(layout.rows))
        ]  # fmt: skip
        plain = (torch.stack(norms_of(summarized, torch.float64)).to(torch.float32) if summarized
                 else torch.empty(0, device=self.src.device))  # fmt: skip
        if not layout.tensor_scales:
            self.summaries = plain
            return plain
        # unsafe: the lengths add up by construction, and checking them reads them on the host
        pieces = torch.segment_reduce(x.square(), "sum", lengths=layout.piece_lengths,
                                      unsafe=True).sqrt_()  # fmt: skip
        slot, q = self.contexts[0].worker % self.inner.workers, layout.pieces
        zeros = layout.zeros
        parts = [plain, zeros[: slot * q], pieces, zeros[: (self.inner.workers - 1 - slot) * q]]
        self.summaries = torch.cat([part for part in parts if part.numel()])
        return self.summaries

    def _memory(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The rows' memory as one [P, N] buffer (the last step's, where every row's memory is
        still its view; else gathered, zero where a row has none), and each row's own."""
        layout, memory = self.layout, self.codec.memory
        kept = [memory.get(ctx.state_key) for ctx in self.contexts]
        if self.static is not None:  # every row's memory is its view (``graphs.StepGraph``)
            return self.static.memory, kept
        if all(e is None for e in kept):
            return None, []
        for i, (e, r) in enumerate(zip(kept, layout.rows_of, strict=True)):
            length = r.padded if r.kind == KIND_ROTATED else r.length
            if e is not None and e.numel() != length:
                raise ValueError(
                    f"error-feedback memory for {self.contexts[i].state_key!r} holds "
                    f"{e.numel()} coordinates, the gradient has {r.length}; call reset() "
                    "after re-bucketing"
                )
        base = kept[0]._base if kept[0] is not None else None
        n = layout.width
        if base is not None and base.shape == (layout.rows, n) and all(
            e is not None and e._base is base and e.storage_offset() == i * n
            for i, e in enumerate(kept)
        ):  # fmt: skip
            return base, kept
        zeros = torch.zeros(n, device=self.src.device)
        rows = [zeros[:1] if e is None else e.reshape(-1) for e in kept]
        pieces = [part for e in rows for part in (e, zeros[: n - e.numel()])]
        return torch.cat(pieces).view(layout.rows, n), rows

    # -- the SUM's two halves -----------------------------------------------------------------
    def encode(self, shared: torch.Tensor) -> list[Payload]:
        """Every row's payload, from the MAX round's [P] norms; error feedback's new memory."""
        layout, inner = self.layout, self.inner
        shared = shared.reshape(-1)
        largest, prior, self.factors, divisors = shared, None, None, None
        if layout.tensor_scales:
            largest, self.factors, divisors, prior = triton_kernels.rows_tensor_scales(
                layout, shared, inner.workers
            )
        elif shared.numel() != layout.rows:
            raise ValueError(f"{shared.numel()} MAX results for a step of {layout.rows} rows")
        a, step, step32, offset, own_offset, ok = triton_kernels.rows_scalars(
            largest, layout.sqrt_padded, layout.constants, prior
        )
        self.step, self.offset = step, offset
        require(ok.all(), lambda: self._invalid(shared))
        if layout.tensor_scales:  # the other rows' rotation, divided by their tensors' scales
            x = self.src if self.xp is None else self.xp
            self.w, _ = triton_kernels.rows_rotate(layout, x, None, None, None, False, divisors,
                                                   select=2, out=self.w)  # fmt: skip
        lookups = inner._tables(self.src.device)
        if self.static is not None:  # the host wrote this step's seeds (``graphs``)
            seeds = self.static.seeds.copy_(self.static.host_seeds, non_blocking=True)
        else:
            seeds = torch.tensor([ctx.worker_seed() for ctx in self.contexts],
                                 dtype=torch.int64)  # fmt: skip
            if self.src.device.type == "cuda":  # from pageable memory a copy waits the stream
                seeds = seeds.pin_memory().to(self.src.device, non_blocking=True)
            elif self.src.device.type != "cpu":
                seeds = seeds.to(self.src.device)
        g = inner.granularity
        new = None
        if self.feedback and self.static is not None:
            # in place: the rotation read the memory before, and no kernel after reads it
            new = self.static.memory
        elif self.feedback:
            new = torch.empty(layout.rows, layout.width, dtype=torch.float32,
                              device=self.src.device)  # fmt: skip
        error = None
        if KIND_ROTATED in layout.kinds:
            error = (lookups.value_of_index, step32, own_offset, new)
        packed = triton_kernels.rows_quantize(layout, self.w, seeds, lookups, a, g / 2, g,
                                              inner.bits, error)  # fmt: skip
        if KIND_GRADIENT in layout.kinds and self.feedback:
            triton_kernels.rows_dequantize_inverse(layout, packed, inner.bits, step, offset, 1,
                                                   new, lookups.value_of_index, self.xp,
                                                   self.factors)  # fmt: skip
        payloads = []
        for i, (r, ctx) in enumerate(zip(layout.rows_of, self.contexts, strict=True)):
            payloads.append(Payload({UPSTREAM: packed[i, : r.padded * inner.bits // 8]},
                                    r.length))  # fmt: skip
            if self.feedback:
                kept = r.padded if r.kind == KIND_ROTATED else r.length
                self.codec.memory[ctx.state_key] = new[i, :kept]
                if isinstance(self.codec, TransformedErrorFeedback):
                    self.codec._lengths[ctx.state_key] = (
                        r.length if r.kind == KIND_ROTATED else None)  # fmt: skip
        return payloads

    def _invalid(self, shared: torch.Tensor) -> None:
        """The failed check: a row's own input (a NaN or Inf names its coordinate), else the
        MAX round's norms."""
        for r in self.layout.rows_of:
            check_finite(self.src[r.source : r.source + r.length])
        raise ValueError(f"{self.inner.name}: invalid max norms {shared.tolist()}")

    def shared_of(self, index: int, shared: torch.Tensor) -> torch.Tensor:
        """Row ``index``'s part of the step's MAX result, as its own round's MAX would give it
        (one norm, or every worker's norms of its pieces): what decodes it alone."""
        layout, row = self.layout, self.layout.meta_rows[index]
        shared = shared.reshape(-1)
        if not layout.tensor_scales:
            return shared[index : index + 1]
        first, count, plain = row
        if count == 0:
            return shared[plain : plain + 1]
        matrix = shared[layout.plain :].view(self.inner.workers, layout.pieces)
        return matrix[:, first : first + count].reshape(-1)

    def decodes(self, sums: Sequence[Payload]) -> bool:
        """Whether ``decode`` takes these sums (else decode them row by row)."""
        counts = {s.contributors for s in sums}
        return (len(sums) == self.layout.rows and len(counts) == 1
                and all(s.counts is None and not s.unpacked and DOWNSTREAM in s.fields
                        and s.fields[DOWNSTREAM].numel() == n
                        for s, n in zip(sums, self.layout.sum_bytes, strict=True)))  # fmt: skip

    def decode(
        self, sums: Sequence[Payload], out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Every gradient's average from every row's summed payload (``decodes``)."""
        fields = [s.fields[DOWNSTREAM].reshape(-1) for s in sums]
        packed = fields[0] if len(fields) == 1 else torch.cat(fields)
        return self.decode_packed(packed, sums[0].contributors, out)

    def decode_packed(self, packed: torch.Tensor, contributors: int,
                      out: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
        """``decode`` of every row's packed sums, end to end in ``packed``."""
        layout = self.layout
        if out is None:
            out = torch.empty(layout.total, dtype=torch.float32, device=packed.device)
        triton_kernels.rows_dequantize_inverse(layout, packed, self.inner.sum_bits, self.step,
                                               self.offset, contributors, out,
                                               factors=self.factors)  # fmt: skip
        ends = [*layout.group_starts[1:], layout.total]
        return [out[a:b] for a, b in zip(layout.group_starts, ends, strict=True)]


@dataclass
class StaticBuffers:
    """A recorded step's inputs and state at fixed addresses (``graphs.StepGraph``): the flat
    input, the seeds (written on the host, copied by the recorded encode) and the memory,
    which the encode updates in place."""

    src: torch.Tensor
    host_seeds: torch.Tensor
    seeds: torch.Tensor
    memory: torch.Tensor | None


class StepSumPhase(SumPhase):
    """The SUM of a batched step through a reducer (``CodecRound.run_many``): one piece per
    row, its coordinates placed in the step's flat input and output. The first ``encode``
    encodes every row (one launch each of the batch), ``deliver`` keeps the sums, and the last
    one decodes them together where they decode together (``StepRound.decodes``), else row by
    row through their own rounds' decode (a quorum's counts per lane), the same values."""

    def __init__(self, batched: StepRound, shared: torch.Tensor):
        layout = batched.layout
        pieces = [Piece(r.source, r.source + r.length, i, 0, ctx)
                  for i, (r, ctx) in enumerate(zip(layout.rows_of, batched.contexts,
                                                   strict=True))]  # fmt: skip
        out = torch.empty(layout.total, dtype=torch.float32, device=batched.src.device)
        super().__init__(batched.codec, pieces, [], [], out)
        self.batched, self.shared = batched, shared
        self._sums: list[Payload | None] = [None] * len(pieces)
        self._all: list[Payload] | None = None

    def encode(self, index: int, into: torch.Tensor | None = None) -> Payload:
        if self._all is None:
            with self._deferring():
                self._all = self.batched.encode(self.shared)
        payload = self._all[index]
        if into is not None:
            field = payload.fields[UPSTREAM]
            if field.numel() != into.numel():
                raise ValueError(f"{field.numel()} payload bytes for {into.numel()}")
            into.copy_(field)
        return payload

    def deliver(self, index: int, summed: Payload) -> None:
        if self._delivered[index]:
            raise RuntimeError(f"piece {index} of the round was delivered twice")
        self._sums[index], self._delivered[index] = summed, True
        if all(self._delivered):
            with self._deferring():
                self._decode()

    def _decode(self) -> None:
        sums = self._sums
        if self.batched.decodes(sums):
            self.batched.decode(sums, out=self.out)
            return
        for i, (piece, summed) in enumerate(zip(self.pieces, sums, strict=True)):
            decode(self.codec, summed, piece.context, self.shared_of(i),
                   self.out[piece.start : piece.stop])  # fmt: skip

    def shared_of(self, index: int) -> torch.Tensor:
        return self.batched.shared_of(index, self.shared)

    def averages(self) -> list[torch.Tensor]:
        """Every gradient's average: views of the step's output."""
        layout = self.batched.layout
        ends = [*layout.group_starts[1:], layout.total]
        return [self.out[a:b] for a, b in zip(layout.group_starts, ends, strict=True)]

"""Tensor Homomorphic Compression: lookup-table THC (Algorithm 2) and uniform THC (Algorithm 1).

Both map every coordinate onto the integer grid [0, g] shared by all workers, round it
stochastically (unbiased, independent randomness per worker) to a table value and send the b-bit
table *index*. The aggregator looks each index up and adds integers; the sum of m contributions
is a point of the grid [0, m*g] that every worker decodes the same way. Nothing is decoded or
re-encoded in between, which is what lets an integer-only switch aggregate THC.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..base import (
    Aggregation,
    Codec,
    CodecContext,
    IntegerOp,
    NonFiniteGradientError,
    Payload,
    WidthOverflowError,
    check_finite,
    check_same_length,
    finite,
    hashed_uniform,
    norms_of,
    require,
    require_finite,
)
from ..bits import bits_for, pack_bits, unpack_bits
from ..buffers import Recycler
from ..native_common import Empty
from . import native, triton_kernels
from .hadamard import Rotation, padded_length
from .tables import (
    SPREADS,
    clamp_threshold,
    correlated_clamp,
    correlated_table,
    default_granularity,
    solve_table,
    spread_clamps,
)

CORRELATED_GRANULARITY = 31
UPSTREAM = "indices"
DOWNSTREAM = "sums"
ROTATIONS_KEPT = 256


# cell, low, up probability, draws, rounds up, indices
_WORKSPACE_DTYPES = (
    torch.int32,
    torch.float32,
    torch.float32,
    torch.float32,
    torch.bool,
    torch.uint8,
)


@dataclass(frozen=True)
class _Lookups:
    """Small per-device tables for one lookup table T over the grid [0, g]."""

    value_of_index: torch.Tensor  # int32 [2**b]: T itself (the aggregator's lookup)
    value_of_byte: torch.Tensor  # int32 [256, 8 // b]: T of every index packed in a byte
    interval_of_cell: torch.Tensor  # uint8 [g]: k with T[k] <= cell < T[k + 1]
    low_of_cell: torch.Tensor  # float32 [g]: T[k]
    inverse_width_of_cell: torch.Tensor  # float32 [g]: 1 / (T[k + 1] - T[k])
    cell_entries: torch.Tensor  # int32 [g + 1]: k | T[k] << 8 | width << 20 (native encode's)

    @classmethod
    def build(cls, table: tuple[int, ...], device: torch.device) -> _Lookups:
        values = torch.tensor(table, dtype=torch.int64)
        interval = torch.searchsorted(values, torch.arange(table[-1]), right=True) - 1
        low = values[interval].to(torch.float32)
        width = (values[interval + 1] - values[interval]).to(torch.float32)
        bits = (len(table) - 1).bit_length()
        per_byte = 8 // bits if 8 % bits == 0 else 1
        lanes = [(torch.arange(256) >> (j * bits)) & (len(table) - 1) for j in range(per_byte)]
        value_of_byte = values[torch.stack(lanes, dim=1)].to(torch.int32)
        entries = interval | values[interval] << 8 | (values[interval + 1] - values[interval]) << 20
        entries = torch.cat([entries, entries[-1:]])  # u == g: the last interval's upper end
        return cls(
            values.to(torch.int32).to(device),
            value_of_byte.to(device),
            interval.to(torch.uint8).to(device),
            low.to(device),
            (1.0 / width).to(device),
            entries.to(torch.int32).to(device),
        )


class GridCodec(Codec):
    """Shared machinery: stochastic rounding onto a table of the grid [0, g], packing, sums."""

    lane_fields = (UPSTREAM, DOWNSTREAM)
    # y = a * S / contributors + c lane by lane before any rotation back: a quorum's lanes
    # decode with counts of their own (``_per_contributor``)
    linear_decode = True

    def __init__(self, workers: int, bits: int, table: Sequence[int], correlated: bool = False):
        super().__init__(workers)
        # correlated rounding: thresholds stratified across workers (``stratified_uniform``)
        self.correlated = correlated
        if bits not in range(1, 9):
            raise ValueError(f"THC bits must be in 1..8, got {bits}")
        self.bits = bits
        self.table = tuple(int(v) for v in table)
        self.granularity = self.table[-1]
        if (
            len(self.table) != 1 << bits
            or self.table[0] != 0
            or list(self.table) != sorted(set(self.table))
        ):
            raise ValueError(
                f"table must hold 2**{bits} increasing integers from 0, got {self.table}"
            )
        self.sum_bits = bits_for(workers * self.granularity)
        self._device_tables: dict[torch.device, _Lookups] = {}
        # the native kernels' outputs, reused so no call faults in fresh pages; a worker's round
        # holds up to ~5 of them at once (rotated input, error, average, the caller's last one)
        self._recycler = Recycler(per_request=8)
        # the torch path's rounding buffers, one set per thread (see ``_workspace``)
        self._local = threading.local()
        self._lock = threading.Lock()

    # -- the aggregator's operation ---------------------------------------------------------
    def integer_op(self) -> IntegerOp:
        identity = self.table == tuple(range(len(self.table)))
        return IntegerOp(
            in_bits=self.bits,
            out_bits=self.sum_bits,
            signed=False,
            table=None if identity else self.table,
        )

    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        length = check_same_length(payloads)
        count = self._coordinates(length)
        contributors = sum(p.contributors for p in payloads)
        if contributors > self.workers:
            raise WidthOverflowError(
                f"{contributors} contributions exceed the {self.workers} workers this codec "
                f"was configured for; sums would overflow {self.sum_bits} bits"
            )
        if all(UPSTREAM in p.fields for p in payloads):
            table = self._tables(_device_of(payloads[0])).value_of_index
            upstream = [p.fields[UPSTREAM] for p in payloads]
            packed = native.lookup_sum(upstream, self.bits, table, count, self.sum_bits)
            if packed is not None:
                return Payload({DOWNSTREAM: packed}, length, contributors)
        total = torch.zeros(count, dtype=torch.int32, device=_device_of(payloads[0]))
        for payload in payloads:
            total += self._grid_values(payload, count)
        return Payload(
            {DOWNSTREAM: pack_bits(total, self.sum_bits, check=False)}, length, contributors
        )

    def _grid_values(self, payload: Payload, count: int) -> torch.Tensor:
        """A payload's contribution on the grid: table lookup of indices, or a partial sum."""
        if UPSTREAM in payload.fields:
            packed = payload.fields[UPSTREAM]
            lookups = self._tables(packed.device)
            if 8 % self.bits == 0:  # one row gather per packed byte: no unpacking
                rows = torch.index_select(lookups.value_of_byte, 0, packed.to(torch.int32))
                return rows.view(-1)[:count]
            indices = unpack_bits(packed, self.bits, count)
            return torch.index_select(lookups.value_of_index, 0, indices)
        sums = payload.fields[DOWNSTREAM]
        if payload.unpacked:  # a summing transport's integers, one per lane
            return sums.reshape(-1)[:count].to(torch.int32)
        return unpack_bits(sums, self.sum_bits, count).to(torch.int32)

    # -- worker side --------------------------------------------------------------------------
    def _encode_grid(
        self,
        x: torch.Tensor,
        a: Scalar,
        c: Scalar,
        ctx: CodecContext,
        rotation: Rotation | None,
        length: int | None = None,
        empty: Empty | None = None,
    ) -> Payload:
        """Payload of u = clamp(a*y + c, 0, g) rounded to table indices; y = x or x rotated.
        ``length``: the input's, where x is already rotated and padded; ``empty``: where the
        native kernel's packed indices go (the recycler's buffers by default). NaN or Inf in x
        raises NonFiniteGradientError."""
        lookups = self._tables(x.device)
        seed = ctx.worker_seed()
        g = self.granularity
        # the kernel draws thresholds of its own, independent or stratified
        packed = native.encode(x, rotation, a, c, g, lookups.cell_entries, seed, self.bits,
                               empty=empty or self._recycler.empty,
                               strata=self._strata(ctx))  # fmt: skip
        if packed is None:
            require_finite(x)
            a, c = _float32(a), _float32(c)
            if self._fused(rotation) if rotation is not None else self._fused_quantize(x):
                # 3 launches (1 unrotated) instead of ~55, on the torch path's draws
                y = (
                    x.contiguous()
                    if rotation is None
                    else triton_kernels.rotate(x, rotation.signs, rotation.padded, rotation.block)
                )
                if self.correlated:
                    draws = self._workspace(y.numel(), y.device)[3]
                    self._draw(ctx, y.numel(), y.device, draws)
                else:  # drawn in the kernel (``_draw``)
                    draws = ctx.worker_seed()
                packed = triton_kernels.quantize(y, draws, lookups, a, c, g, self.bits)
                return Payload({UPSTREAM: packed}, x.numel() if length is None else length)
            y = x.mul(a) if rotation is None else self._rotated(x, rotation).mul_(a)
            indices = self._round_to_table(y.add_(c).clamp_(0, g), ctx)
            packed = pack_bits(indices, self.bits, check=False)
        return Payload({UPSTREAM: packed}, x.numel() if length is None else length)

    def _decode_grid(
        self, payload: Payload, a: Scalar, c: Scalar, rotation: Rotation | None, trim: bool = True,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """y = a*S + c for the payload's grid sums S, rotated back if a rotation is given;
        ``trim=False`` keeps the padding coordinates (of an unrotated y). ``out``: where the
        native kernel writes y when it holds all of it (no padding)."""
        count = self._coordinates(payload.length)
        y = None
        if DOWNSTREAM in payload.fields and isinstance(a, float):  # the CPU's native kernel
            sums, width, empty = payload.fields[DOWNSTREAM], self.sum_bits, self._recycler.empty
            if payload.unpacked:  # the kernel reads packed lanes of up to 16 bits
                if sums.dtype == torch.uint8:
                    width = 8
                else:
                    sums = pack_bits(sums.reshape(-1)[:count], width, check=False)
            if out is not None and out.numel() == count and out.is_contiguous():
                empty = lambda n, dtype: out  # noqa: E731 (the caller's buffer)
            y = native.decode(sums, width, count, a, c, rotation, empty=empty)
        if y is None:
            a, c = _float32(a), _float32(c)
            per_lane = isinstance(a, torch.Tensor) and a.dim() > 0  # a quorum's counts
            if (rotation is not None and DOWNSTREAM in payload.fields and not per_lane
                    and self._fused(rotation)):  # fmt: skip
                sums, width = payload.fields[DOWNSTREAM], 0
                if payload.unpacked:
                    sums = sums.reshape(-1)[:count]
                elif self.sum_bits <= triton_kernels.MAX_PACKED_WIDTH:  # unpacked as loaded
                    width = self.sum_bits
                else:
                    sums = unpack_bits(sums, self.sum_bits, count)
                y = triton_kernels.dequantize_inverse(
                    sums, rotation.signs, rotation.block, a, c, count, width
                )
                return y[: payload.length]
            y = self._grid_values(payload, count).to(torch.float32).mul_(a).add_(c)
            if rotation is not None:
                return rotation.inverse(y)
        return y[: payload.length] if trim else y

    def _strata(self, ctx: CodecContext) -> tuple[int, int, int] | None:
        """Correlated rounding's strata for the native kernel (None: independent rounding)."""
        if not self.correlated:
            return None
        return ctx.stratum_seed(), self.workers, ctx.worker % self.workers

    def _rotated(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        rotated = native.rotate(x, rotation)
        return rotation.forward(x) if rotated is None else rotated

    def _fused(self, rotation: Rotation) -> bool:
        """The fused Triton kernels replace the torch path here (a GPU with Triton), giving
        its values bit for bit (``triton_kernels``)."""
        return triton_kernels.use_for(rotation.device) and triton_kernels.fits(
            rotation.padded, rotation.block, self.bits
        )

    def _fused_quantize(self, y: torch.Tensor) -> bool:
        """The fused rounding takes an unrotated (or already rotated) ``y`` here."""
        return triton_kernels.use_for(y.device) and triton_kernels.quantizes(y.numel(), self.bits)

    def _round_to_table(self, u: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        """Unbiased stochastic rounding of grid positions u in [0, g] to table indices (uint8).

        u lies in cell floor(u) of the unit grid; per-cell lookups give the table interval
        [low, low + width] holding that cell, and the index rounds up with probability
        (u - low) / width. All intermediate buffers are reused between calls.
        """
        lookups = self._tables(u.device)
        work = self._workspace(u.numel(), u.device)
        cell, low, up_probability, draws, rounds_up, indices = work
        # u >= 0: conversion truncates = floor (the lower clamp keeps a NaN's cell, which a
        # deferred finiteness check reports after the round, inside the tables)
        cell.copy_(u).clamp_(0, self.granularity - 1)
        torch.index_select(lookups.low_of_cell, 0, cell, out=low)
        torch.index_select(lookups.inverse_width_of_cell, 0, cell, out=up_probability)
        up_probability.mul_(torch.sub(u, low, out=low))
        self._draw(ctx, u.numel(), u.device, draws)
        torch.lt(draws, up_probability, out=rounds_up)
        torch.index_select(lookups.interval_of_cell, 0, cell, out=indices)
        return indices.add_(rounds_up)

    def _draw(self, ctx: CodecContext, count: int, device: torch.device,
              out: torch.Tensor) -> None:  # fmt: skip
        """The rounding thresholds of the torch path and the fused kernels: stratified across
        the workers (correlated rounding), or independent: ``hashed_uniform`` of the worker's
        seed, which the fused kernels compute in place (``_triton._hashed_uniform``), one
        partition or a step's rows in one launch, each with its own seed (``thc.step``)."""
        if self.correlated:
            ctx.stratified_uniform(count, self.workers, device, out=out)
        else:
            hashed_uniform(ctx.worker_seed(), count, device, out=out)

    def _workspace(self, count: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Reused rounding buffers of this thread: a codec may encode on several shard
        streams at once, and buffers shared between them would mix their payloads."""
        local = self._local
        key = (count, device)
        if getattr(local, "key", None) != key:
            make = lambda dtype: torch.empty(count, dtype=dtype, device=device)  # noqa: E731
            local.work = tuple(make(dtype) for dtype in _WORKSPACE_DTYPES)
            local.key = key
        return local.work

    def _tables(self, device: torch.device) -> _Lookups:
        tables = self._device_tables.get(device)
        if tables is None:
            with self._lock:
                tables = self._device_tables.get(device)
                if tables is None:
                    tables = self._device_tables[device] = _Lookups.build(self.table, device)
        return tables

    def _coordinates(self, length: int) -> int:
        return length

    def lanes(self, length: int) -> int:
        return self._coordinates(length)


SCALES = ("tensor", "partition")


class _RoundScalars:
    """One round's scalars of a partition of ``padded`` rotated coordinates
    (``THC._round_scalars``), each computed on first use."""

    def __init__(self, codec: THC, largest: Scalar, clamp: Scalar, padded: int,
                 rms: torch.Tensor | None, divisor: torch.Tensor | None):  # fmt: skip
        self._codec, self._padded = codec, padded
        self.largest = largest  # the largest norm over the workers (of the normalized partition)
        self.clamp = clamp  # its clamp
        # tensor scales only: float32, one per piece, the decode's factors, and the same with 1
        # where the RMS is 0, the encode's divisors
        self.rms, self.divisor = rms, divisor

    @functools.cached_property
    def a(self) -> Scalar:
        """The encode's grid scale (``THC._grid_scale``)."""
        return self._codec._grid_scale(self.largest, self._padded, self.clamp)

    @functools.cached_property
    def step(self) -> Scalar:
        """The value of one grid step (``THC._step``)."""
        return self._codec._step(self.largest, self._padded, self.clamp)

    @functools.cached_property
    def offset(self) -> Scalar:
        """The decode's -step * g / 2."""
        return -self.step * self._codec.granularity / 2


class THC(GridCodec):
    """Lookup-table THC with a randomized Hadamard rotation and clamping (Algorithm 2).

    ``scales``: what one grid scale covers. ``"partition"`` is the paper's: the rotation spreads
    every coordinate's share of the partition's norm evenly, so the error each coordinate gets
    is the partition's RMS, whatever its own gradient's size. Where a round carries several
    tensors (a fusion group, a DDP bucket), one with large gradients (a token embedding) sets
    the error of all the others; a tensor whose gradients are 10x smaller then receives noise
    larger than its signal, and Adam, which divides each coordinate by its own magnitude,
    turns that noise into full-size steps. ``"tensor"`` (the default) first divides each
    described tensor's coordinates by that tensor's RMS (the largest over the workers, from the
    same MAX round, so every worker uses the same factors and the sum stays homomorphic), rounds
    the result on the partition's grid, and multiplies the decoded average back: each tensor's
    error is then a fraction of its own gradient. It needs the tensors' shapes
    (``Codec.describe``); a buffer nobody described has one scale per partition.
    """

    name = "thc"
    aggregation = Aggregation.LOOKUP_SUM
    # THC's error is a fraction of the gradient's norm, so a bound of 1 never acts in steady
    # state; after a gradient spike it keeps the spike's coarse-grid error out of the next,
    # far smaller gradients (docs/benchmarks.md, "Error feedback after a gradient spike").
    feedback_bound = 1.0

    def __init__(
        self,
        workers: int = 1,
        bits: int = 4,
        granularity: int | None = None,
        p: float | None = None,
        rotation_block: int | None = None,
        correlated: bool = False,
        spread_clamp: bool | None = None,
        scales: str = "tensor",
    ):
        if scales not in SCALES:
            raise ValueError(f"THC scales is one of {', '.join(SCALES)}, got {scales!r}")
        # Correlated rounding's table: 31 grid steps (n * 31 sums need the bits n * 30 do at
        # every n, so the wire is THC's), and the table and clamp that minimise its error.
        if granularity is None:
            granularity = (
                CORRELATED_GRANULARITY if correlated and bits == 4 else default_granularity(bits)
            )
        # spread_clamp: the clamp solved per round for the spread of the workers' norms
        # (``tables.spread_clamps``); correlated rounding's default unless a clamp p is given
        if spread_clamp is None:
            spread_clamp = correlated and p is None
        if spread_clamp and (not correlated or p is not None):
            raise ValueError(
                "spread_clamp solves correlated rounding's clamp per round: it needs "
                "correlated=True and no fixed clamp p"
            )
        if p is None:
            p = correlated_clamp(bits, granularity, workers) if correlated else 1 / 32
        table = self._table(bits, granularity, p, workers if correlated else None)
        super().__init__(workers, bits, table, correlated)
        self.p = p
        self.threshold = clamp_threshold(p)  # the clamp at equal norms
        self.spread_clamp = bool(spread_clamp)
        self._clamps = spread_clamps(bits, granularity, workers) if spread_clamp else None
        self._device_clamps: dict[torch.device, torch.Tensor] = {}
        self.rotation_block = rotation_block
        self._rotations: OrderedDict[tuple, Rotation] = OrderedDict()  # least recently used first
        self.scales = scales
        # tensor scales: the numel of every tensor a key's flat buffer holds (``describe``), and
        # per round key (key, partition) the lengths of the tensors' pieces in that partition
        self._layouts: dict[Hashable, tuple[int, ...]] = {}
        self._segments: dict[Hashable, tuple[int, ...]] = {}
        self._segment_tensors: dict[tuple, torch.Tensor] = {}
        # per MAX-round result: its version and the tensor scales computed from it
        self._scales_of_shared: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # error feedback's inputs made by a kernel that measured them on the way (native
        # ``transform_measured``, ``accumulate_measured``): per input, (its round's context,
        # its summary), taken by ``summarize`` instead of another pass over it. The context
        # (step included) tells a recycled buffer's stale entry from its own
        self._measured: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @staticmethod
    def _table(bits: int, granularity: int, p: float, correlated: int | None) -> tuple[int, ...]:
        """The table for independent rounding, or for correlated rounding over ``correlated``
        workers (the objectives differ: ``tables.correlated_expected_error``)."""
        if correlated is None:
            return solve_table(bits, granularity, p)
        return correlated_table(bits, granularity, p, correlated)

    # -- tensor scales ---------------------------------------------------------------------------
    def describe(self, key: Hashable, shapes: Sequence[tuple[int, ...]]) -> None:
        if self.scales != "tensor":
            return
        sizes = tuple(math.prod(int(d) for d in shape) for shape in shapes)
        with self._lock:
            self._layouts[key] = sizes

    def partitions(self, key: Hashable, total: int, size: int) -> list[tuple[int, int]] | None:
        """The round's partitions of ``size`` coordinates, as for any codec; what tensor scales
        add is the record of which tensors' pieces each partition holds."""
        with self._lock:
            sizes = self._layouts.get(key)
        if sizes is None:
            return None
        if sum(sizes) != total:
            raise ValueError(
                f"thc: the tensors described for {key!r} hold {sum(sizes):,} coordinates, its "
                f"flat gradient {total:,}"
            )
        bounds = [(a, min(a + size, total)) for a in range(0, total, size)]
        ends = list(itertools.accumulate(sizes))
        with self._lock:
            for i, (a, b) in enumerate(bounds):
                cuts = sorted({a, b, *(e for e in ends if a < e < b)})
                pieces = tuple(hi - lo for lo, hi in itertools.pairwise(cuts))
                self._segments[(key, i)] = pieces
        return bounds

    def _pieces(self, ctx: CodecContext | None) -> tuple[int, ...] | None:
        """The lengths of the tensors' pieces in this round's partition; None: one scale."""
        if ctx is None or self.scales != "tensor":
            return None
        with self._lock:
            pieces = self._segments.get(ctx.key)
        return pieces if pieces is not None and len(pieces) > 1 else None

    def _lengths(self, pieces: tuple[int, ...], device: torch.device) -> torch.Tensor:
        key = (pieces, device)
        lengths = self._segment_tensors.get(key)
        if lengths is None:
            lengths = torch.tensor(pieces, dtype=torch.int64, device=device)
            with self._lock:
                self._segment_tensors[key] = lengths
        return lengths

    def _root_lengths(self, pieces: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The square roots of the pieces' lengths (float64), as the tensor scales divide by
        them (kept: a round's scales need them per partition)."""
        key = ("roots", pieces, device)
        roots = self._segment_tensors.get(key)
        if roots is None:
            roots = self._lengths(pieces, device).to(torch.float64).sqrt()
            with self._lock:
                self._segment_tensors[key] = roots
        return roots

    def _ends(self, pieces: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The pieces' ends (int64), as the native encode's division reads them."""
        key = ("ends", pieces, device)
        ends = self._segment_tensors.get(key)
        if ends is None:
            ends = torch.tensor(list(itertools.accumulate(pieces)), dtype=torch.int64,
                                device=device)  # fmt: skip
            with self._lock:
                self._segment_tensors[key] = ends
        return ends

    def _piece_norms(self, flat: torch.Tensor, pieces: tuple[int, ...],
                     ctx: CodecContext) -> torch.Tensor:  # fmt: skip
        """This worker's norm of every piece, in its row of a (workers x pieces) summary."""
        lengths = self._lengths(pieces, flat.device)
        squares = native.piece_squares(flat, pieces, lengths)
        if squares is None:
            # unsafe: the pieces add up to the partition, and checking it reads on the host
            squares = torch.segment_reduce(flat.square(), "sum", lengths=lengths, unsafe=True)
        return self._placed_pieces(squares, flat, pieces, ctx)

    def _placed_pieces(self, squares: torch.Tensor, flat: torch.Tensor, pieces: tuple[int, ...],
                       ctx: CodecContext | None) -> torch.Tensor:  # fmt: skip
        norms = squares.sqrt_()
        if _reads_scalars(norms):  # read here without a wait: no deferred check's small ops
            if not all(math.isfinite(v) for v in norms.tolist()):
                self._norm_overflow(flat)
        else:
            require(finite(norms).all(), lambda: self._norm_overflow(flat))
        placed = norms.new_zeros(self.workers, len(pieces))
        placed[(ctx.worker if ctx is not None else 0) % self.workers] = norms
        return placed.reshape(-1)

    def _keep_summary(self, x: torch.Tensor, squares: torch.Tensor, ctx: CodecContext) -> None:
        """The summary of ``x`` from the sums of squares a kernel measured as it made x (the
        values ``summarize`` would compute: the same kernels' order), kept for ``summarize``.
        Sums that overflowed are not kept: ``summarize`` then reports or handles them."""
        pieces = self._pieces(ctx)
        if not all(math.isfinite(v) for v in squares.tolist()):
            return
        if pieces is not None:
            summary = self._placed_pieces(squares, x, pieces, ctx)
        else:
            summary = self._placed(squares.sqrt_(), ctx)
        self._measured[x] = (ctx, summary)

    def transform_measured(
        self, x: torch.Tensor, ctx: CodecContext, add: torch.Tensor | None
    ) -> tuple[torch.Tensor, float, float] | None:
        """``transform`` on the CPU's native path, with the norms of the rotated x and of
        ``add`` (error feedback's bound compares them; 0 without ``add``) and the result's
        summary (kept for ``summarize``), all from the rotation's own pass. None where the
        native kernel cannot run."""
        flat = x.reshape(-1).to(torch.float32)
        rotation = self._rotation(flat.numel(), ctx, flat.device)
        measured = native.rotate(flat, rotation, add, empty=self._recycler.empty, measure=True)
        if measured is None:
            return None
        rotated, x_squares, e_squares, squares = measured
        self._keep_summary(rotated, torch.tensor([squares], dtype=torch.float32), ctx)
        return rotated, math.sqrt(x_squares), math.sqrt(e_squares)

    def accumulate_measured(
        self, x: torch.Tensor, e: torch.Tensor, ctx: CodecContext
    ) -> tuple[torch.Tensor, float, float] | None:
        """x + e (error feedback outside the rotated domain) on the CPU's native path, with the
        norms of x and e (the bound's) and the summary of x + e (kept for ``summarize``) from
        the same pass. None where the native kernel cannot run."""
        flat = x.reshape(-1).to(torch.float32)
        pieces = self._pieces(ctx)
        ends = None if pieces is None else self._ends(pieces, flat.device)
        measured = native.accumulate(flat, e.reshape(-1), ends, empty=self._recycler.empty)
        if measured is None:
            return None
        total, squares, x_squares, e_squares = measured
        self._keep_summary(total, squares, ctx)
        return total, math.sqrt(x_squares), math.sqrt(e_squares)

    def _round_scalars(self, shared: torch.Tensor | None, pieces: tuple[int, ...] | None,
                       device: torch.device, padded: int) -> _RoundScalars:  # fmt: skip
        """The round's scalars of a partition of ``padded`` rotated coordinates, from the MAX
        round's ``shared`` result, computed once per round: the encode, the decode and error
        feedback's reconstruction of a partition all take them from the same ``shared`` (a new
        tensor every round), so they are kept with it for as long as it lives. On a GPU that
        saves each use's dozen small launches; ``pieces``: the tensor scales' pieces, or None
        for one scale."""
        cache = self._scales_of_shared
        key = (pieces, device, padded)
        with self._lock:
            kept = cache.get(shared) if shared is not None else None
        if kept is not None and kept[0] == shared._version and key in kept[1]:
            return kept[1][key]
        if pieces is None:
            largest, clamp = self._norm_and_clamp(shared)
            rms = divisor = None
        else:
            largest, clamp, rms, divisor = self._tensor_scales(shared, pieces, device)
        scales = _RoundScalars(self, largest, clamp, padded, rms, divisor)
        with self._lock:
            kept = cache.get(shared)
            if kept is None or kept[0] != shared._version:
                kept = cache[shared] = (shared._version, {})
            kept[1][key] = scales
        return scales

    def _tensor_scales(
        self, shared: torch.Tensor | None, pieces: tuple[int, ...], device: torch.device
    ) -> tuple[Scalar, Scalar, torch.Tensor, torch.Tensor]:
        """From every worker's piece norms: the largest norm of the normalized partition and
        its clamp (as ``_norm_and_clamp`` gives them for one scale), and every piece's scale,
        its RMS (the largest over the workers; 0 where all are 0)."""
        count = self.workers * len(pieces)
        if shared is None or shared.numel() != count:
            raise ValueError(
                f"{self.name} with tensor scales needs the preliminary round's {count} norms "
                f"({self.workers} workers x {len(pieces)} tensors); got "
                f"{None if shared is None else shared.numel()}"
            )
        norms = shared.reshape(self.workers, len(pieces)).to(torch.float64)

        def fail() -> None:
            raise ValueError(f"{self.name}: invalid norms {norms.tolist()}")

        if _reads_scalars(shared):  # read here without a wait: no deferred check's small ops
            if not all(math.isfinite(v) and v >= 0 for v in shared.tolist()):
                fail()
        else:
            require(finite(norms).all() & (norms >= 0).all(), fail)
        rms = norms.amax(dim=0) / self._root_lengths(pieces, device)
        inverse = torch.where(rms > 0, 1.0 / rms.clamp(min=1e-300), 0.0)
        # each worker's norm once every piece is divided by its scale: at most sqrt(length)
        normalized = (norms * inverse).square().sum(dim=1).sqrt()
        largest, clamp = self._largest_and_clamp(normalized)
        rms = rms.to(torch.float32)
        # a piece of RMS 0 is 0 on every worker: any positive divisor leaves it 0
        return largest, clamp, rms, torch.where(rms > 0, rms, 1.0)

    def _scale_pieces(self, x: torch.Tensor, pieces: tuple[int, ...], factors: torch.Tensor,
                      divide: bool, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x divided (``divide``) or multiplied piece by piece by each piece's factor, into
        ``out`` (default a new tensor): one pass over x, the values of an elementwise
        operation with the factors repeated over their pieces."""
        lengths = self._lengths(pieces, x.device)
        if out is None:
            out = (self._recycler.empty(x.numel(), torch.float32) if x.device.type == "cpu"
                   else torch.empty_like(x))  # fmt: skip
        if native.scale_pieces(x, pieces, lengths, factors, divide, out):
            return out
        # output_size: the length is known, so the device is not asked for it (a host sync)
        repeated = torch.repeat_interleave(factors, lengths, output_size=x.numel())
        return (torch.div if divide else torch.mul)(x, repeated, out=out)

    def summarize(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        kept = self._measured.pop(x, None)
        if kept is not None and kept[0] == ctx:
            return kept[1]  # measured by the kernel that made x, in this round
        flat = x.reshape(-1).to(torch.float32)
        pieces = self._pieces(ctx)
        if pieces is not None:
            return self._piece_norms(flat, pieces, ctx)
        if _reads_scalars(flat) and flat.dim() == 1:
            # the kernels' order, as a measured input's summary has it (``piece_squares``)
            squares = native.piece_squares(flat, (flat.numel(),), self._lengths((flat.numel(),),
                                                                                  flat.device))
            if squares is not None and math.isfinite(float(squares[0])):
                return self._placed(squares.sqrt_(), ctx)
        if not _reads_scalars(flat):  # checked on the device, read after the round
            # accumulated in float64 (finite coordinates whose squares overflow float32 have a
            # norm), as a step's rows take theirs (``thc.step``): one reduction, no fallback
            norm = norms_of([flat], torch.float64)[0].to(torch.float32)
            require(finite(norm), lambda: self._norm_overflow(flat))
            return self._placed(norm.reshape(1), ctx)
        norm = torch.linalg.vector_norm(flat)
        if not bool(torch.isfinite(norm)):
            check_finite(flat)  # a NaN/Inf coordinate: the error names it
            # Finite coordinates whose squares overflow float32: accumulate in float64.
            norm = torch.linalg.vector_norm(flat, dtype=torch.float64)
            if float(norm) > torch.finfo(torch.float32).max:
                raise NonFiniteGradientError(
                    f"gradient L2 norm {float(norm):.3g} exceeds the float32 range"
                )
        return self._placed(norm.to(torch.float32).reshape(1), ctx)

    def _placed(self, norm: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        """The summary: the norm, or with the spread clamp the norm in this worker's slot of
        one per worker (zeros elsewhere), so the MAX round hands every worker every norm."""
        if not self.spread_clamp:
            return norm
        placed = norm.new_zeros(self.workers)
        placed[(ctx.worker if ctx is not None else 0) % self.workers] = norm[0]
        return placed

    def _norm_and_clamp(self, shared: torch.Tensor | None) -> tuple[Scalar, Scalar]:
        """The round's largest norm, which sets the grid's scale, and its clamp t_p: the fixed
        one, or the one solved for the spread of the norms the MAX round brought (the RMS over
        the largest of those present, to the nearest of ``tables.SPREADS``). Every worker and
        the decode compute it from the same values, so all round on one grid."""
        if not self.spread_clamp:
            return _shared_scalar(shared, self.name, "max norm"), self.threshold
        if shared is None or shared.numel() != self.workers:
            raise ValueError(
                f"{self.name} with spread_clamp needs the preliminary round's {self.workers} "
                f"norms, one per worker; got {None if shared is None else shared.numel()}"
            )
        return self._largest_and_clamp(shared)

    def _largest_and_clamp(self, norms: torch.Tensor) -> tuple[Scalar, Scalar]:
        """The largest of the workers' ``norms`` and the clamp for their spread (the fixed
        clamp without ``spread_clamp``)."""
        if not self.spread_clamp:
            if _reads_scalars(norms):
                largest = max(float(v) for v in norms.reshape(-1))
                if not math.isfinite(largest) or largest < 0:
                    raise ValueError(f"{self.name}: invalid norms {norms.tolist()}")
                return largest, self.threshold
            return norms.reshape(-1).amax().to(torch.float64), self.threshold
        shared = norms
        first, step = SPREADS[0], SPREADS[1] - SPREADS[0]
        if _reads_scalars(shared):
            norms = [float(v) for v in shared.reshape(-1)]
            if not all(math.isfinite(v) and v >= 0 for v in norms):
                raise ValueError(f"{self.name}: invalid norms {norms}")
            largest = max(norms)
            if largest == 0:
                return 0.0, self.threshold
            present = [(v / largest) ** 2 for v in norms if v > 0]
            spread = math.sqrt(sum(present) / len(present))
            index = min(max(round((spread - first) / step), 0), len(SPREADS) - 1)
            return largest, self._clamps[index]
        norms = shared.reshape(-1).to(torch.float64)

        def fail() -> None:
            raise ValueError(f"{self.name}: invalid norms {norms.tolist()}")

        require(finite(norms).all() & (norms >= 0).all(), fail)
        largest = norms.amax()
        present = norms > 0
        relative = torch.where(present, norms / largest.clamp(min=1e-300), 0.0)
        spread = (relative.square().sum() / present.sum().clamp(min=1)).sqrt()
        index = ((spread - first) / step).round().clamp(0, len(SPREADS) - 1).to(torch.int64)
        clamps = self._device_clamps.get(norms.device)
        if clamps is None:
            clamps = torch.tensor(self._clamps, dtype=torch.float64, device=norms.device)
            self._device_clamps[norms.device] = clamps
        return largest, torch.where(largest > 0, clamps[index], self.threshold)

    @staticmethod
    def _norm_overflow(flat: torch.Tensor) -> None:
        check_finite(flat)  # a NaN/Inf coordinate: the error names it
        norm = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
        raise NonFiniteGradientError(f"gradient L2 norm {norm:.3g} exceeds the float32 range")

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        return self._encode(x, ctx, shared)

    def encode_into(self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> Payload:  # fmt: skip
        """The native kernel packs the indices straight into ``out`` (a transport's send
        buffer): no payload buffer to fill and copy. Other paths copy, as every codec does."""

        def into(count: int, dtype: torch.dtype) -> torch.Tensor:
            fits = count == out.numel() and dtype == out.dtype and out.device.type == "cpu"
            return out if fits else self._recycler.empty(count, dtype)

        payload = self._encode(x, ctx, shared, into)
        if payload.fields[UPSTREAM].data_ptr() != out.data_ptr():
            self.copy_lanes(payload, out)
        return payload

    def _encode(self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None,
                empty: Empty | None = None) -> Payload:  # fmt: skip
        """``encode``; ``empty``: where the native kernel's packed indices go."""
        flat = x.reshape(-1).to(torch.float32)
        pieces = self._pieces(ctx)
        rotation = self._rotation(x.numel(), ctx, x.device)
        scalars = self._round_scalars(shared, pieces, flat.device, rotation.padded)
        if pieces is not None:
            if isinstance(scalars.a, float):  # the native encode divides as it reads
                packed = native.encode(
                    flat, rotation, scalars.a, self.granularity / 2, self.granularity,
                    self._tables(flat.device).cell_entries, ctx.worker_seed(), self.bits,
                    empty=empty or self._recycler.empty, strata=self._strata(ctx),
                    pieces=(self._ends(pieces, flat.device), scalars.divisor),
                )  # fmt: skip
                if packed is not None:
                    return Payload({UPSTREAM: packed}, x.numel())
            flat = self._scale_pieces(flat, pieces, scalars.divisor, divide=True)
        return self._encode_grid(flat, scalars.a, self.granularity / 2, ctx, rotation,
                                 empty=empty)  # fmt: skip

    def encode_and_reconstruct(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> tuple[Payload, torch.Tensor]:
        """Error feedback's encode (outside the rotated domain: tensor scales, or a padded
        partition). On the CPU's native path the encode leaves what the payload decodes to,
        still rotated, in the rotation's scratch, and only the rotation back remains: the
        decode's own arithmetic without packing, summing and unpacking the payload again."""
        return self._encode_and_own(x, ctx, shared, residual=False)

    def encode_and_residual(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> tuple[Payload, torch.Tensor]:
        """``encode_and_reconstruct``, and on the native path the tensor scales' multiplication
        of the reconstruction and its subtraction from x in one pass, into a reused buffer."""
        return self._encode_and_own(x, ctx, shared, residual=True)

    def _encode_and_own(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None, residual: bool
    ) -> tuple[Payload, torch.Tensor]:
        flat = x.reshape(-1).to(torch.float32)
        pieces = self._pieces(ctx)
        rotation = self._rotation(x.numel(), ctx, x.device)
        scalars = self._round_scalars(shared, pieces, flat.device, rotation.padded)
        a = scalars.a
        if not (isinstance(a, float) and native.available()):
            return self._encode_and_decode_alone(x, ctx, shared, residual)
        source = flat
        divided = None if pieces is None else (self._ends(pieces, flat.device), scalars.divisor)
        g = self.granularity
        # the decode's scalars of a sum of one contributor (``decode``, ``native.decode``)
        root = math.sqrt(rotation.block)
        own = (_per_contributor(scalars.step, _ONE) / root, scalars.offset / root)
        packed = native.encode(flat, rotation, a, g / 2, g, self._tables(flat.device).cell_entries,
                               ctx.worker_seed(), self.bits, empty=self._recycler.empty,
                               strata=self._strata(ctx), own=own, pieces=divided)  # fmt: skip
        if packed is None:
            return self._encode_and_decode_alone(x, ctx, shared, residual)
        payload = Payload({UPSTREAM: packed}, x.numel())
        if residual:  # the transform back's last pass stores x - own * scale: no own written
            scaled = None if pieces is None else (self._ends(pieces, flat.device), scalars.rms)
            error = native.inverse_residual(rotation, source, scaled, empty=self._recycler.empty)
            if error is not None:
                return payload, error
        y = native.inverse(rotation)
        if residual:
            lengths = None if pieces is None else self._lengths(pieces, y.device)
            error = native.residual(source, y, pieces, lengths, scalars.rms,
                                    empty=self._recycler.empty)  # fmt: skip
            if error is not None:
                return payload, error
        y = y[: x.numel()]
        if pieces is not None:
            y = self._scale_pieces(y, pieces, scalars.rms, divide=False, out=y)
        return payload, (source - y if residual else y)

    def _encode_and_decode_alone(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None,
        residual: bool = False,
    ) -> tuple[Payload, torch.Tensor]:  # fmt: skip
        """The encode, and the decode of its table values as the sum of one contributor, one
        integer per lane: the values ``reconstruct`` gives, without packing that sum (on a
        GPU, the packing alone is ~17 launches) and unpacking it again; ``residual``: x minus
        them instead."""
        payload = self.encode(x, ctx, shared)
        grid = self._grid_values(payload, self._coordinates(payload.length))
        alone = Payload({DOWNSTREAM: grid}, payload.length, unpacked=True)
        own = self.decode(alone, ctx, shared)
        return payload, (x.reshape(-1).to(torch.float32) - own if residual else own)

    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        pieces = self._pieces(ctx)
        device = _device_of(payload)
        rotation = self._rotation(payload.length, ctx, device)
        scalars = self._round_scalars(shared, pieces, device, rotation.padded)
        # y = (S / contributors - g/2) * step
        step = _per_contributor(scalars.step, payload)
        if pieces is not None:
            y = self._decode_scaled(payload, step, scalars.offset, rotation, pieces, scalars.rms,
                                    out)  # fmt: skip
            if y is not None:
                return y
        y = self._decode_grid(payload, step, scalars.offset, rotation, out=out)
        if pieces is None:
            return y
        return self._scale_pieces(y, pieces, scalars.rms, divide=False, out=y)

    def _decode_scaled(
        self, payload: Payload, a: Scalar, c: Scalar, rotation: Rotation,
        pieces: tuple[int, ...], factors: torch.Tensor, out: torch.Tensor | None,
    ) -> torch.Tensor | None:  # fmt: skip
        """The CPU's native decode, each piece multiplied by its tensor scale as the transform
        back stores it (no pass of its own); None where that kernel cannot run."""
        if not (DOWNSTREAM in payload.fields and not payload.unpacked and isinstance(a, float)):
            return None
        count, empty = self._coordinates(payload.length), self._recycler.empty
        if out is not None and out.numel() == count and out.is_contiguous():
            empty = lambda n, dtype: out  # noqa: E731 (the caller's buffer)
        sums = payload.fields[DOWNSTREAM]
        y = native.decode(sums, self.sum_bits, count, a, c, rotation, empty=empty,
                          pieces=(self._ends(pieces, sums.device), factors))  # fmt: skip
        return None if y is None else y[: payload.length]

    def decode_into(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> None:  # fmt: skip
        y = self.decode(payload, ctx, shared, out=out)
        if y.data_ptr() != out.data_ptr():  # padded, or not the native kernel: one copy
            out.copy_(y)

    def decode_counted(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                       out: torch.Tensor) -> None:  # fmt: skip
        self.decode_into(payload, ctx, shared, out)  # the decode divides lane by lane

    # -- error feedback in the rotated domain (feedback.TransformedErrorFeedback) --------------
    def transform_keeps_length(self, length: int, ctx: CodecContext) -> bool:
        # tensor scales are set by norms of the unrotated tensors, after the memory is added:
        # the memory of a partition of several tensors stays in the gradient's own domain
        return self._pieces(ctx) is None and self._coordinates(length) == length

    def transform(
        self, x: torch.Tensor, ctx: CodecContext, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The rotated, padded input (+ ``add``): what encode quantizes. NaN or Inf raises."""
        flat = x.reshape(-1).to(torch.float32)
        rotation = self._rotation(flat.numel(), ctx, flat.device)
        rotated = native.rotate(flat, rotation, add, empty=self._recycler.empty)
        if rotated is None:
            require_finite(flat)
            if self._fused(rotation):  # 2 launches instead of ~40, bit for bit
                rotated = triton_kernels.rotate(
                    flat, rotation.signs, rotation.padded, rotation.block
                )
            else:
                rotated = rotation.forward(flat)
            if add is not None:
                rotated.add_(add)
        return rotated

    def encode_transformed(
        self, w: torch.Tensor, length: int, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> tuple[Payload, torch.Tensor]:
        scalars = self._round_scalars(shared, None, w.device, w.numel())
        a, c, step = scalars.a, self.granularity / 2, scalars.step
        if isinstance(step, float) and w.device.type == "cpu":
            # the residual of the encode's own rounding, in the same pass: the values below
            error = self._recycler.empty(w.numel(), torch.float32)
            packed = native.encode(
                w, None, a, c, self.granularity, self._tables(w.device).cell_entries,
                ctx.worker_seed(), self.bits, error=(error, step, -step * c),
                empty=self._recycler.empty, strata=self._strata(ctx),
            )  # fmt: skip
            if packed is not None:
                return Payload({UPSTREAM: packed}, length), error
        payload = self._encode_grid(w, a, c, ctx, rotation=None, length=length)
        # What this payload alone decodes to, step*T[index] - step*c lane by lane (the decode of
        # its own one-contributor sum, without packing that sum and unpacking it again).
        own = self._grid_values(payload, w.numel()).to(torch.float32)
        return payload, w - own.mul_(_float32(step)).add_(_float32(-step * c))

    def _grid_scale(self, max_norm: Scalar, padded: int, clamp: Scalar) -> Scalar:
        """a in u = a*y + g/2: (clamp(s*y, -t, t) + t) * g / 2t = clamp(a*y + g/2, 0, g) with
        s = sqrt(padded) / max_norm, the scale that makes rotated coordinates ~N(0, 1), and
        t = ``clamp``."""
        if isinstance(max_norm, float) and isinstance(clamp, float):
            scale = math.sqrt(padded) / max_norm if max_norm > 0 else 0.0
            return scale * self.granularity / (2 * clamp)
        scale = torch.where(max_norm > 0, _divide(math.sqrt(padded), max_norm), 0.0)
        return _divide(scale * self.granularity, 2 * clamp)

    def _step(self, max_norm: Scalar, padded: int, clamp: Scalar) -> Scalar:
        """The value of one grid step in the rotated domain."""
        return _divide((2 * clamp / self.granularity) * max_norm, math.sqrt(padded))

    def _coordinates(self, length: int) -> int:
        return padded_length(length, self.rotation_block)

    def _rotation(self, length: int, ctx: CodecContext, device: torch.device) -> Rotation:
        """The cached rotation of a partition length (a model has a handful: its partitions'
        and its tensors' lengths); the least recently used goes past ``ROTATIONS_KEPT``."""
        key = (length, ctx.shared_seed(), device)
        with self._lock:
            rotation = self._rotations.get(key)
            if rotation is not None:
                self._rotations.move_to_end(key)
                return rotation
        rotation = Rotation(length, self.rotation_block, key[1], device)
        with self._lock:
            rotation = self._rotations.setdefault(key, rotation)
            while len(self._rotations) > ROTATIONS_KEPT:
                self._rotations.popitem(last=False)
        return rotation

    def __repr__(self) -> str:
        return (
            f"THC(workers={self.workers}, bits={self.bits}, granularity={self.granularity}, "
            f"p={self.p:g}, rotation_block={self.rotation_block}, correlated={self.correlated}, "
            f"spread_clamp={self.spread_clamp}, scales={self.scales!r})"
        )


class UniformTHC(THC):
    """Uniform THC as its authors define and run it (Algorithm 1; their ``INCACompressor``):
    THC's randomized Hadamard rotation and max-norm scaling, a clamp at t = Phi^-1(1 - p/2)
    (their ``norm.isf(1e-4)`` = 3.72 standard deviations: p = 2e-4), and 2**b uniform levels
    over [-t, t], rounded stochastically; the aggregator sums the level indices themselves."""

    name = "thc-uniform"
    aggregation = Aggregation.INTEGER_SUM

    def __init__(self, workers: int = 1, bits: int = 4, p: float = 2e-4,
                 rotation_block: int | None = None, correlated: bool = False):  # fmt: skip
        # one scale per partition, as the authors run it
        super().__init__(workers, bits, (1 << bits) - 1, p, rotation_block, correlated,
                         scales="partition")  # fmt: skip

    @staticmethod
    def _table(bits: int, granularity: int, p: float, correlated: int | None) -> tuple[int, ...]:
        return tuple(range(1 << bits))  # the authors' uniform levels, correlated or not

    def __repr__(self) -> str:
        return (f"UniformTHC(workers={self.workers}, bits={self.bits}, p={self.p:g}, "
                f"rotation_block={self.rotation_block}, correlated={self.correlated})")  # fmt: skip


class UnrotatedUniformTHC(GridCodec):
    """Uniform THC without the rotation: the grid is [global min, global max] in 2**b - 1 steps.
    Not the authors' method (outliers set the range: on heavy tails almost every coordinate
    rounds to the middle levels); kept, under a name that says so, to show what the rotation
    buys."""

    name = "thc-uniform-unrotated"
    aggregation = Aggregation.INTEGER_SUM

    def __init__(self, workers: int = 1, bits: int = 4, correlated: bool = False):
        super().__init__(workers, bits, range(1 << bits), correlated)

    def summarize(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        require_finite(x)
        low, high = torch.aminmax(x.reshape(-1).to(torch.float32))
        return torch.stack([high, -low])

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        low, span = self._range(shared)
        if isinstance(span, float):
            a = self.granularity / span if span > 0 else 0.0
        else:
            a = torch.where(span > 0, _divide(self.granularity, span), 0.0)
        flat = x.reshape(-1).to(torch.float32).contiguous()
        return self._encode_grid(flat, a, -low * a, ctx, rotation=None)

    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        low, span = self._range(shared)
        a = _per_contributor(_divide(span, self.granularity), payload)
        return self._decode_grid(payload, a, low, rotation=None)

    def decode_counted(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                       out: torch.Tensor) -> None:  # fmt: skip
        out.copy_(self.decode(payload, ctx, shared))  # the decode divides lane by lane

    def _range(self, shared: torch.Tensor | None) -> tuple[Scalar, Scalar]:
        if shared is None or shared.numel() != 2:
            raise ValueError(f"{self.name} needs the preliminary round's [max, -min]")
        if _reads_scalars(shared):
            high, negative_low = (float(v) for v in shared)
        else:
            high, negative_low = shared.to(torch.float64).unbind()
        return -negative_low, high + negative_low


Scalar = float | torch.Tensor
"""A round's shared scalars (scales, offsets): Python floats where the CPU's native kernels take
them, 0-d float64 tensors on the device everywhere else, so no value is read on the host."""


def _reads_scalars(t: torch.Tensor) -> bool:
    """Whether this tensor's round runs on the CPU's native kernels, which take Python floats
    (reading a CPU value waits for nothing). Elsewhere (a GPU, or GRADSUM_NATIVE=0) scalars stay
    0-d device tensors and checks are deferred (``codecs.base.DeviceChecks``)."""
    return t.device.type == "cpu" and native.available()


def _divide(a: Scalar, b: Scalar) -> Scalar:
    """a / b with true division on any device: a CUDA tensor divided by a Python number is
    multiplied by its reciprocal instead, which can differ from the CPU's quotient in the last
    bit; here both sides are tensors."""
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return a / b
    device = (a if isinstance(a, torch.Tensor) else b).device

    def tensor(v: Scalar) -> torch.Tensor:
        if isinstance(v, torch.Tensor):
            return v
        return torch.full((), v, dtype=torch.float64, device=device)

    return torch.div(tensor(a), tensor(b))


def _per_contributor(value: Scalar, payload: Payload) -> Scalar:
    """``value`` / the payload's contributors: lane by lane where chunks of the sum completed
    with different quorums (``Payload.counts``, one per lane), so that each rotated coordinate's
    sum is divided by its own count before the inverse rotation mixes them (a float64 tensor of
    lanes, which also keeps the CPU's native kernels, taking one scalar, off this path)."""
    if payload.counts is None:
        return _divide(value, payload.contributors)
    counts = payload.counts.reshape(-1).to(_device_of(payload), torch.float64)
    return _divide(value, counts)


class _OneContributor:
    """What ``_per_contributor`` reads of the payload of one worker alone."""

    counts = None
    contributors = 1


_ONE = _OneContributor()


def _float32(value: Scalar) -> Scalar:
    """A float64 scalar tensor as the float32 the gradient's ops use (a Python float is
    rounded the same way by torch when it multiplies a float32 tensor)."""
    return value.to(torch.float32) if isinstance(value, torch.Tensor) else value


def _shared_scalar(shared: torch.Tensor | None, codec: str, what: str) -> Scalar:
    if shared is None or shared.numel() != 1:
        raise ValueError(f"{codec} needs the preliminary round's {what} (one value)")
    if not _reads_scalars(shared):
        value = shared.reshape(()).to(torch.float64)

        def fail() -> None:
            raise ValueError(f"{codec}: invalid {what} {float(value)}")

        require(finite(value) & (value >= 0), fail)
        return value
    value = float(shared.reshape(-1)[0])
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{codec}: invalid {what} {value}")
    return value


def _device_of(payload: Payload) -> torch.device:
    return next(iter(payload.fields.values())).device

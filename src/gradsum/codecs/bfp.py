"""SwitchML block floating point: floats carried over integer-only additions.

Every block of ``block_size`` coordinates shares one exponent, the maximum over all workers
(the preliminary round). Each worker scales its block by the same power of two, so that the sum
of ``workers`` values cannot leave int32, and rounds to int32. The aggregator adds int32 vectors;
workers scale the sum back and divide by the number of contributors.

A power-of-two scale keeps the scaling exact. With |x| < 2**e (e from frexp of the block
maximum), the shift s = 30 - e - ceil(log2 n) bounds every sum of n rounded values below 2**31.
An all-zero block reports exponent ``EXPONENT_FLOOR``; it quantizes to zeros with a finite scale.

On the CPU the summary, encode, decode and the aggregator's sum run as native one-pass kernels
(``bfp_native``) when the extension is built; the torch code here is the reference they match bit
for bit, and the path for other devices, dtypes and ``GRADSUM_NATIVE=0``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from . import bfp_native
from .base import (
    Aggregation,
    Codec,
    CodecContext,
    IntegerOp,
    Payload,
    WidthOverflowError,
    check_same_length,
    require_finite,
)

EXPONENT_FLOOR = -126
INT32_MAX = (1 << 31) - 1
MERGED_PARTITION = 1 << 24
"""Coordinates of bfp's partitions (a whole number of the round's): see ``partitions``."""


class BlockFloatingPoint(Codec):
    name = "bfp"
    aggregation = Aggregation.INTEGER_SUM
    lane_fields = ("values", "values")
    linear_decode = True

    def __init__(self, workers: int = 1, block_size: int = 256):
        super().__init__(workers)
        if block_size < 1:
            raise ValueError(f"bfp block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blockwise = block_size
        self.headroom = math.ceil(math.log2(workers)) if workers > 1 else 0
        self.limit = saturation_limit(workers)
        self._recycler = bfp_native.Recycler()  # the native path's outputs

    def partitions(self, key: Hashable, total: int, size: int) -> list[tuple[int, int]] | None:
        """The round's partitions of ``size`` merged, up to ``MERGED_PARTITION`` coordinates:
        where ``size`` is a whole number of blocks, every block starts where it did, so no bit
        changes, and the per-partition work stops growing with the gradient (~24 kernel launches
        a partition on a device; a streaming transport still sends pieces of whole blocks). The
        bound keeps the torch path's temporaries small."""
        if size % self.block_size:
            return None
        merged = size * max(1, MERGED_PARTITION // size)
        return [(start, min(start + merged, total)) for start in range(0, total, merged)]

    def joins(self, flats: Sequence[torch.Tensor], partition_elements: int) -> bool:
        """On the torch path (a device, or without the kernels), where each round's launches
        cost more than one copy of the step: not on the CPU's kernels, which make a round one
        pass whatever its size. Blocks stay where they were only if partitions are whole
        blocks (``partitions`` merges them then)."""
        if len(flats) < 2 or partition_elements % self.block_size:
            return False
        device = flats[0].device
        if any(f.device != device for f in flats):
            return False
        return device.type != "cpu" or not bfp_native.available()

    def integer_op(self) -> IntegerOp:
        return IntegerOp(in_bits=32, out_bits=32, signed=True)

    def summary_bits(self) -> int:
        return 8  # exponents in [-126, 128] travel as int8 offsets in SwitchML; we count 8

    def summarize(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        fast = bfp_native.summarize(x, self.block_size)
        if fast is not None:
            return fast
        require_finite(x)
        low, high = torch.aminmax(self._blocks(x.reshape(-1).to(torch.float32)), dim=1)
        block_max = torch.maximum(high, low.neg_())
        exponents = torch.frexp(block_max).exponent.to(torch.float32)
        return torch.where(block_max > 0, exponents, torch.full_like(exponents, EXPONENT_FLOOR))

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        self._check_shared(shared, x.numel())
        fast = bfp_native.encode(
            x, self.block_size, shared, self.headroom, self.limit, self._recycler.empty
        )
        if fast is not None:
            return Payload({"values": fast}, x.numel())
        require_finite(x)
        scale = torch.exp2(self._shifts(shared, x.numel())).unsqueeze(1)
        scaled = torch.mul(self._blocks(x.reshape(-1).to(torch.float32)), scale)
        # Exponents from the same gradient keep |scaled| < limit by construction; clamping makes
        # a mismatched preliminary round saturate instead of wrapping around in int32.
        limit = self.limit
        values = scaled.round_().clamp_(-limit, limit).view(-1)[: x.numel()].to(torch.int32)
        return Payload({"values": values}, x.numel())

    def encode_into(self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> Payload:  # fmt: skip
        self._check_shared(shared, x.numel())
        values = out.view(torch.int32)
        into = lambda count, dtype: values  # noqa: E731 (the kernel's output: the caller's buffer)
        if bfp_native.encode(x, self.block_size, shared, self.headroom, self.limit, into) is None:
            return super().encode_into(x, ctx, shared, out)
        return Payload({"values": values}, x.numel())

    def lane_coder(self, x: torch.Tensor, shared: torch.Tensor | None,
                   out: torch.Tensor) -> bfp_native.LaneCoder | None:  # fmt: skip
        """The native kernels' coder of any run of lanes (packets coded by the transport)."""
        self._check_shared(shared, x.numel())
        return bfp_native.lane_coder(x, shared, out, self.block_size, self.headroom, self.limit)

    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        length = check_same_length(payloads)
        contributors = sum(p.contributors for p in payloads)
        if contributors > self.workers:
            raise WidthOverflowError(
                f"{contributors} contributions exceed the {self.workers} workers the scale was "
                "chosen for; the int32 sum could overflow"
            )
        values = [p.fields["values"] for p in payloads]
        fast = bfp_native.sum_(values, length, self._recycler.empty)
        if fast is not None:
            return Payload({"values": fast}, length, contributors)
        total = payloads[0].fields["values"].clone()
        for payload in payloads[1:]:
            total += payload.fields["values"]
        return Payload({"values": total}, length, contributors)

    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._check_shared(shared, payload.length)
        fast = bfp_native.decode(
            payload.fields["values"], payload.length, self.block_size, shared, self.headroom,
            payload.contributors, self._recycler.empty,
        )  # fmt: skip
        if fast is not None:
            return fast
        sums = payload.fields["values"][: payload.length].to(torch.float32)
        return self._scaled_back(sums.div_(payload.contributors), shared)

    def decode_into(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> None:  # fmt: skip
        self._check_shared(shared, payload.length)
        into = lambda count, dtype: out  # noqa: E731 (the kernel's output: the caller's buffer)
        fast = bfp_native.decode(
            payload.fields["values"], payload.length, self.block_size, shared, self.headroom,
            payload.contributors, into,
        )  # fmt: skip
        if fast is None:
            out.copy_(self.decode(payload, ctx, shared))

    def decode_counted(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                       out: torch.Tensor) -> None:  # fmt: skip
        """Each lane's sum divided by its own count first, as ``decode`` divides by one count:
        a lane decodes to the same bits whatever counts its neighbours have."""
        counts = payload.counts.reshape(-1)[: payload.length].to(torch.float32)
        sums = payload.fields["values"][: payload.length].to(torch.float32)
        out.copy_(self._scaled_back(sums.div_(counts), shared))

    def _scaled_back(self, averages: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The averages of the int32 lanes times each block's 2**-shift (exact): the division
        comes first, one rounding, and only an average, not a sum, must fit a float."""
        scale = torch.exp2(-self._shifts(shared, averages.numel()))
        return self._blocks(averages).mul_(scale.unsqueeze(1)).view(-1)[: averages.numel()]

    def _check_shared(self, shared: torch.Tensor | None, length: int) -> None:
        blocks = -(-length // self.block_size)
        if shared is None or shared.numel() != blocks:
            raise ValueError(f"bfp needs {blocks} block exponents from the preliminary round")

    def _shifts(self, shared: torch.Tensor | None, length: int) -> torch.Tensor:
        self._check_shared(shared, length)
        return (30 - self.headroom - shared.to(torch.float32)).clamp_(max=120)

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        remainder = flat.numel() % self.block_size
        if remainder:
            flat = torch.cat([flat, flat.new_zeros(self.block_size - remainder)])
        return flat.view(-1, self.block_size)

    def __repr__(self) -> str:
        return f"BlockFloatingPoint(workers={self.workers}, block_size={self.block_size})"


def saturation_limit(workers: int) -> float:
    """The largest float32 at most INT32_MAX // workers: the clamp of a rounded value.

    The quotient itself is not a float32 in general; rounded to the nearest one it can land
    above the quotient (2**31 for one worker, which int32 conversion wraps to -2**31; for three
    workers 715827904 > 715827882, so a sum of three saturated values overflows). Keeping its
    top 24 significant bits rounds it down instead.
    """
    quotient = INT32_MAX // max(workers, 1)
    drop = max(quotient.bit_length() - 24, 0)
    return float(quotient >> drop << drop)

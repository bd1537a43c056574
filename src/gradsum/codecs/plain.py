"""Uncompressed baselines: fp32 (summed as is) and fp16 (halved on the wire)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import (
    Aggregation,
    Codec,
    CodecContext,
    Payload,
    WidthOverflowError,
    check_same_length,
    finite,
    require,
    require_finite,
)
from .buffers import Recycler
from .decoding import DecodingCodec


class NoCompression(Codec):
    """fp32 on the wire; a parameter server sums payloads directly."""

    name = "none"
    aggregation = Aggregation.FLOAT_SUM
    lane_fields = ("values", "values")
    linear_decode = True
    blockwise = 1

    def __init__(self, workers: int = 1):
        super().__init__(workers)
        # payloads, sums and averages on the CPU: a fresh 4 MiB tensor faults in all its pages
        # (a partition's copy into one took 4x the time of a copy into a mapped buffer)
        self._recycler = Recycler()

    def lane_widths(self) -> tuple[int, int]:
        return 32, 32

    def _empty_like(self, x: torch.Tensor) -> torch.Tensor:
        return self._recycler.empty_on(x.device, x.numel(), torch.float32)

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        require_finite(x)
        values = self._empty_like(x)
        values.copy_(x.reshape(-1))
        return Payload({"values": values}, x.numel())

    def encode_into(self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> Payload:  # fmt: skip
        require_finite(x)
        values = out.view(torch.float32)
        values.copy_(x.reshape(-1))
        return Payload({"values": values}, x.numel())

    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        length = check_same_length(payloads)
        first = payloads[0].fields["values"]
        total = self._empty_like(first)
        total.copy_(first)
        for payload in payloads[1:]:
            total += payload.fields["values"]
        return Payload({"values": total}, length, sum(p.contributors for p in payloads))

    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        values = payload.fields["values"]
        average = self._empty_like(values)
        torch.div(values, payload.contributors, out=average)
        return average

    def decode_into(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> None:  # fmt: skip
        torch.div(payload.fields["values"], payload.contributors, out=out)


class FP16(DecodingCodec):
    """IEEE half precision both ways; the server widens, sums in fp32 and narrows the sum."""

    name = "fp16"

    def compress(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        return Payload({"values": x.to(torch.float16)}, x.numel())

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        require_finite(x)
        return self._checked(self.compress(x.reshape(-1).to(torch.float32), ctx), "gradient")

    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        return self._checked(super().aggregate(payloads, ctx), "sum")

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.fields["values"].to(torch.float32)

    @staticmethod
    def _checked(payload: Payload, what: str) -> Payload:
        def fail() -> None:
            raise WidthOverflowError(f"{what} exceeds the fp16 range (|x| > 65504)")

        values = payload.fields["values"]
        if values.numel():  # the extremes: isfinite().all() on fp16 takes 17x as long on a CPU
            low, high = torch.aminmax(values)
            require(finite(low) & finite(high), fail)
        return payload

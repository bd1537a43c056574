"""Codecs a parameter server must decode, sum and re-encode (not homomorphic).

The aggregator's extra work is exactly the cost THC removes: one decode per contributing worker,
a float sum, and a second compression of the sum for the downstream (which adds its own error).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

from .base import Aggregation, Codec, CodecContext, Payload, check_same_length, require_finite


class DecodingCodec(Codec):
    aggregation = Aggregation.DECODE_SUM_ENCODE

    @abstractmethod
    def compress(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        """Stateless compression of a dense float32 vector (used upstream and downstream)."""

    @abstractmethod
    def decompress(self, payload: Payload) -> torch.Tensor:
        """The dense vector a payload stands for (a sum when it has several contributors)."""

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        require_finite(x)
        return self.compress(x.reshape(-1).to(torch.float32), ctx)

    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        check_same_length(payloads)
        total = self.decompress(payloads[0]).clone()
        for payload in payloads[1:]:
            total += self.decompress(payload)
        contributors = sum(p.contributors for p in payloads)
        summed = self.compress(total, ctx)
        return Payload(summed.fields, summed.length, contributors, summed.meta)

    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.decompress(payload) / payload.contributors

    def decode_into(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> None:  # fmt: skip
        torch.div(self.decompress(payload), payload.contributors, out=out)

    def reconstruct(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.decompress(payload)

"""TernGrad (Wen et al., NeurIPS 2017): unbiased ternary quantization with one scale per tensor.

The gradient is first clipped at ``clip`` standard deviations (2.5 in the paper and in GRACE's
implementation): without it the scale s is set by the largest outlier and almost every
coordinate rounds to zero. Each coordinate of the clipped g then becomes s * sign(g) *
Bernoulli(|g| / s) with s = max |g|, sent as 2 bits ({-1, 0, +1} + 1) plus the float32 scale.
The parameter server decodes, sums and ternarizes the sum again (clipped the same way) for the
downstream.
"""

from __future__ import annotations

import torch

from .base import CodecContext, Payload
from .bits import pack_bits, unpack_bits
from .decoding import DecodingCodec


class TernGrad(DecodingCodec):
    name = "terngrad"

    def __init__(self, workers: int = 1, clip: float | None = 2.5,
                 server_feedback: bool | None = None):  # fmt: skip
        super().__init__(workers, server_feedback)
        if clip is not None and clip <= 0:
            raise ValueError(f"terngrad clip must be > 0 standard deviations or none, got {clip}")
        self.clip = clip

    def compress(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        # The bound and the scale stay 0-d tensors on x's device (no host read): float32
        # products and quotients of them round as the Python floats of the same values did.
        if self.clip is not None and x.numel():
            bound = x.std(correction=0).mul_(self.clip)
            x = x.clamp(-bound, bound)
        scale = x.abs().max() if x.numel() else torch.zeros((), device=x.device)
        magnitude = x.abs()
        keep_probability = torch.where(scale > 0, magnitude.div_(scale), 0.0)
        draws = ctx.uniform(x.numel(), x.device)
        ternary = torch.sign(x).mul_(draws.lt_(keep_probability)).add_(1).to(torch.int32)
        return Payload(
            {"ternary": pack_bits(ternary, 2, check=False)}, x.numel(), meta={"scale": scale}
        )

    def decompress(self, payload: Payload) -> torch.Tensor:
        ternary = unpack_bits(payload.fields["ternary"], 2, payload.length)
        return ternary.to(torch.float32).sub_(1).mul_(payload.meta["scale"])

    def __repr__(self) -> str:
        return f"TernGrad(workers={self.workers}, clip={self.clip})"

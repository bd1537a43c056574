"""TernGrad (Wen et al., NeurIPS 2017): unbiased ternary quantization with one scale per tensor.

Each coordinate becomes s * sign(x) * Bernoulli(|x| / s) with s = max |x|, sent as 2 bits
({-1, 0, +1} + 1) plus the float32 scale. The parameter server decodes, sums and ternarizes the
sum again for the downstream.
"""

from __future__ import annotations

import torch

from .base import CodecContext, Payload
from .bits import pack_bits, unpack_bits
from .decoding import DecodingCodec


class TernGrad(DecodingCodec):
    name = "terngrad"

    def compress(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        scale = float(x.abs().max()) if x.numel() else 0.0
        keep_probability = x.abs().div_(scale) if scale > 0 else torch.zeros_like(x)
        draws = ctx.uniform(x.numel(), x.device)
        ternary = torch.sign(x).mul_(draws.lt_(keep_probability)).add_(1).to(torch.int32)
        return Payload(
            {"ternary": pack_bits(ternary, 2, check=False)}, x.numel(), meta={"scale": scale}
        )

    def decompress(self, payload: Payload) -> torch.Tensor:
        ternary = unpack_bits(payload.fields["ternary"], 2, payload.length)
        return ternary.to(torch.float32).sub_(1).mul_(payload.meta["scale"])

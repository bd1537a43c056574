"""Sparsifying baselines: TopK and Deep Gradient Compression (DGC).

Payload: the selected coordinates' int32 indices and float32 values (64 bits per kept coordinate).
A parameter server scatters every worker's selection into a dense sum and keeps the top
coordinates of the sum for the downstream -- the decode/re-encode cost THC avoids.
"""

from __future__ import annotations

import math

import torch

from .base import CodecContext, Payload, require_finite
from .decoding import DecodingCodec


def _ratio(ratio: float) -> float:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"sparsification ratio must be in (0, 1], got {ratio}")
    return ratio


def sparse_payload(x: torch.Tensor, indices: torch.Tensor) -> Payload:
    return Payload({"indices": indices.to(torch.int32), "values": x[indices]}, x.numel())


def densify(payload: Payload) -> torch.Tensor:
    values = payload.fields["values"]
    dense = torch.zeros(payload.length, dtype=torch.float32, device=values.device)
    dense[payload.fields["indices"].to(torch.int64)] = values
    return dense


class TopK(DecodingCodec):
    """Keep the k = ceil(ratio * d) coordinates of largest magnitude (10% by default)."""

    name = "topk"
    server_feedback_default = True  # the re-selection at a server drops what it drops again

    def __init__(self, workers: int = 1, ratio: float = 0.1, server_feedback: bool | None = None):
        super().__init__(workers, server_feedback)
        self.ratio = _ratio(ratio)

    def kept(self, length: int) -> int:
        return max(1, math.ceil(self.ratio * length))

    def compress(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        indices = torch.topk(x.abs(), self.kept(x.numel()), sorted=False).indices
        return sparse_payload(x, indices)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return densify(payload)

    def __repr__(self) -> str:
        return f"TopK(workers={self.workers}, ratio={self.ratio:g})"


class DGC(TopK):
    """Deep Gradient Compression (Lin et al., ICLR 2018) on top of TopK's wire format.

    Worker state per tensor: momentum u and accumulated velocity v (momentum correction and local
    accumulation). Each step u <- m*u + g, v <- v + u; the coordinates of v above a threshold
    estimated from a random sample are sent and cleared in both u and v (momentum factor
    masking). Use it with a momentum-free optimizer: the momentum lives here.
    """

    name = "dgc"
    carries_momentum = True
    server_feedback_default = False  # DGC's paper sums at an all-reduce; nothing re-selects

    def __init__(
        self,
        workers: int = 1,
        ratio: float = 0.1,
        momentum: float = 0.9,
        sample_ratio: float = 0.01,
        server_feedback: bool | None = None,
    ):
        super().__init__(workers, ratio, server_feedback)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"dgc momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.sample_ratio = _ratio(sample_ratio)
        self._state: dict = {}

    def precondition(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        flat = x.reshape(-1).to(torch.float32)
        require_finite(flat)
        key = ctx.state_key
        if key not in self._state:
            self._state[key] = (torch.zeros_like(flat), torch.zeros_like(flat))
        momentum, velocity = self._state[key]
        if momentum.shape != flat.shape:
            raise ValueError(
                f"dgc state for {key!r} holds {momentum.numel()} coordinates, the gradient has "
                f"{flat.numel()}; call reset() after re-bucketing"
            )
        momentum.mul_(self.momentum).add_(flat)
        velocity.add_(momentum)
        return velocity.clone()

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        require_finite(x)
        flat = x.reshape(-1).to(torch.float32)
        indices, sent = self._select(flat, ctx.worker_seed())
        if ctx.state_key in self._state:
            for tensor in self._state[ctx.state_key]:
                tensor[indices] = torch.where(sent, 0.0, tensor[indices])
        payload = sparse_payload(flat, indices)
        payload.fields["values"].mul_(sent)
        return payload

    def _select(self, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DGC's selection: the coordinates at or above a threshold estimated from a sample of
        |x|, at most k of them (the largest). Returned as the k largest coordinates and a mask
        of those at or above the threshold, the others sent as zeros: a fixed-size payload,
        since how many pass the threshold is known only on the device (reading it would wait
        for the device). The set sent is the variable-size selection's."""
        k = self.kept(x.numel())
        magnitude = x.abs()
        sample_size = min(x.numel(), max(k, math.ceil(self.sample_ratio * x.numel()), 256))
        # drawn on the CPU, the same positions on every device (no device generator needed)
        generator = torch.Generator().manual_seed(seed)
        positions = torch.randint(0, x.numel(), (sample_size,), generator=generator)
        sample = magnitude[positions.to(x.device, non_blocking=True)]
        threshold = torch.topk(sample, max(1, math.ceil(self.ratio * sample_size))).values[-1]
        largest = torch.topk(magnitude, k, sorted=False)
        return largest.indices, largest.values >= threshold

    def reset(self, key=None) -> None:
        if key is None:
            self._state.clear()
        else:
            self._state.pop(key, None)

    def state_dict(self) -> dict:
        return {"state": {k: (u.clone(), v.clone()) for k, (u, v) in self._state.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._state = {k: (u.clone(), v.clone()) for k, (u, v) in state.get("state", {}).items()}

    def __repr__(self) -> str:
        return f"DGC(workers={self.workers}, ratio={self.ratio:g}, momentum={self.momentum:g})"

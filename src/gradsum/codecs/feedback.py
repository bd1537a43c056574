"""Error feedback: a wrapper that makes any codec carry its compression error into the next step.

    x'  = x + e                       (precondition)
    e  <- x' - reconstruct(payload)   (after encode: what this worker's payload lost)

State is keyed by the context's ``state_key`` (a tensor name or partition index) and checked for
shape, so a re-bucketed gradient is reported instead of silently mixed with another's error.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from .base import Codec, CodecContext, IntegerOp, Payload


class ErrorFeedback(Codec):
    def __init__(self, inner: Codec):
        super().__init__(inner.workers)
        self.inner = inner
        self.name = inner.name
        self.aggregation = inner.aggregation
        self.memory: dict[Hashable, torch.Tensor] = {}

    def precondition(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        x = self.inner.precondition(x, ctx).reshape(-1).to(torch.float32)
        error = self.memory.get(ctx.state_key)
        if error is None:
            return x.clone()
        if error.shape != x.shape:
            raise ValueError(
                f"error-feedback memory for {ctx.state_key!r} holds {error.numel()} coordinates, "
                f"the gradient has {x.numel()}; call reset() after re-bucketing"
            )
        return x + error

    @property
    def needs_summary(self) -> bool:
        return self.inner.needs_summary

    def summarize(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor | None:
        return self.inner.summarize(x, ctx)

    def summary_bits(self) -> int:
        return self.inner.summary_bits()

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        payload = self.inner.encode(x, ctx, shared)
        own = self.inner.reconstruct(payload, ctx, shared)
        self.memory[ctx.state_key] = x.reshape(-1).to(torch.float32) - own
        return payload

    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        return self.inner.aggregate(payloads, ctx)

    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.inner.decode(payload, ctx, shared)

    def reconstruct(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.inner.reconstruct(payload, ctx, shared)

    def integer_op(self) -> IntegerOp:
        return self.inner.integer_op()

    def reset(self, key: Hashable | None = None) -> None:
        if key is None:
            self.memory.clear()
        else:
            self.memory.pop(key, None)

    def state_dict(self) -> dict:
        return {
            "memory": {k: v.clone() for k, v in self.memory.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.memory = {k: v.clone() for k, v in state.get("memory", {}).items()}
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"

"""Error feedback: a wrapper that makes any codec carry its compression error into the next step.

    x'  = x + e                       (precondition)
    e  <- x' - reconstruct(payload)   (after encode: what this worker's payload lost)

With a ``bound`` b the memory added is at most b times the new gradient's norm (scaled down,
direction kept). In steady state a codec's error is a fraction of the gradient and the bound
never acts. After a gradient spike (a step whose gradient is 100x the next one's, common in
language-model training) the memory holds the spike's quantization error, which plain error
feedback adds in full to a gradient that small; under Adam that is a large step in a random
direction. The bound drops that part instead.

State is keyed by the context's ``state_key`` (a tensor name or partition index) and checked for
shape, so a re-bucketed gradient is reported instead of silently mixed with another's error.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

import torch

from .base import Codec, CodecContext, IntegerOp, Payload, norms_of
from .native_common import enabled


class ErrorFeedback(Codec):
    def __init__(self, inner: Codec, bound: float | None = None):
        super().__init__(inner.workers)
        if bound is not None and not (isinstance(bound, (int, float)) and bound > 0
                                      and math.isfinite(bound)):  # fmt: skip
            raise ValueError(f"feedback_bound is a finite factor > 0 (or none), got {bound!r}")
        self.inner = inner
        self.bound = None if bound is None else float(bound)
        self.name = inner.name
        self.aggregation = inner.aggregation
        # The wire facts are the inner codec's, except ``blockwise``: the memory is kept per
        # partition, so its pieces cannot be encoded one by one.
        self.lane_fields = inner.lane_fields
        self.linear_decode = inner.linear_decode
        self.costly_preparation = inner.costly_preparation
        self.carries_momentum = inner.carries_momentum
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
        return self._with_memory(x, error, ctx)

    def _with_memory(self, x: torch.Tensor, error: torch.Tensor,
                     ctx: CodecContext) -> torch.Tensor:  # fmt: skip
        """x + the memory, scaled to the bound. Where the inner codec has a kernel that adds
        them and measures x, e and the sum in one pass (THC's native ``accumulate_measured``,
        which also keeps the sum's summary), no norm takes a pass of its own."""
        measure = getattr(self.inner, "accumulate_measured", None)
        measured = None if measure is None else measure(x, error, ctx)
        if measured is None:
            return x + self._bounded(error, x)
        total, x_norm, e_norm = measured
        if not self._acts(x_norm, e_norm):
            return total
        # after a spike: the memory scaled to the bound, and the sum made again
        error.mul_(self.bound * x_norm / max(e_norm, 1e-30))
        return measure(x, error, ctx)[0]

    def _acts(self, x_norm: float, e_norm: float) -> bool:
        """Whether the bound scales a memory of norm ``e_norm`` added to a gradient of norm
        ``x_norm`` (norms a kernel measured on the way, read on the CPU without a wait)."""
        return self.bound is not None and e_norm > self.bound * x_norm

    def _bounded(self, error: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The memory scaled to at most ``bound`` times ``x``'s norm, in place (the memory is
        replaced at the encode; a redone round scales it by 1), on the device: no host sync."""
        if self.bound is None:
            return error
        x_norm, norm = norms_of([x, error])  # as a step's rows take them (``thc.step``)
        limit = self.bound * x_norm
        if error.device.type == "cpu" and enabled() and not bool(norm > limit):
            # on the CPU's native path a value is read without waiting (as the codecs read
            # their scalars there): in steady state the bound does not act, and a pass of
            # multiplications by 1 is skipped
            return error
        return error.mul_(torch.where(norm > limit, limit / norm.clamp(min=1e-30), 1.0))

    def describe(self, key: Hashable, shapes: Sequence[tuple[int, ...]]) -> None:
        self.inner.describe(key, shapes)

    def partitions(self, key: Hashable, total: int, size: int) -> list[tuple[int, int]] | None:
        return self.inner.partitions(key, total, size)

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
        payload, self.memory[ctx.state_key] = self.inner.encode_and_residual(x, ctx, shared)
        return payload

    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        return self.inner.aggregate(payloads, ctx)

    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.inner.decode(payload, ctx, shared)

    def decode_into(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> None:  # fmt: skip
        self.inner.decode_into(payload, ctx, shared, out)

    def decode_counted(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                       out: torch.Tensor) -> None:  # fmt: skip
        self.inner.decode_counted(payload, ctx, shared, out)

    def reconstruct(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.inner.reconstruct(payload, ctx, shared)

    def integer_op(self) -> IntegerOp:
        return self.inner.integer_op()

    def lanes(self, length: int) -> int:
        return self.inner.lanes(length)

    def lane_widths(self) -> tuple[int, int]:
        return self.inner.lane_widths()

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
        bound = "" if self.bound is None else f", bound={self.bound}"
        return f"ErrorFeedback({self.inner!r}{bound})"


@runtime_checkable
class FeedbackTransform(Protocol):
    """A codec that encodes an orthogonal transform of its input (THC: the rotation) and can
    keep its error feedback there, saving the inverse transform of every reconstruction."""

    def transform_keeps_length(self, length: int, ctx: CodecContext) -> bool:
        """Whether this round's input of ``length`` coordinates is encoded through a square
        transform alone (THC: no padding, and no scale per tensor set before it)."""

    def transform(
        self, x: torch.Tensor, ctx: CodecContext, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The transformed input, as the encode would compute it, plus ``add`` if given."""

    def encode_transformed(
        self, w: torch.Tensor, length: int, ctx: CodecContext, shared: torch.Tensor | None
    ) -> tuple[Payload, torch.Tensor]:
        """The payload of an input of ``length`` coordinates whose transform is ``w``, and
        w minus what that payload decodes to (still transformed): the new error."""


class TransformedErrorFeedback(ErrorFeedback):
    """Error feedback whose memory lives in the codec's transformed domain where it can.

    With an orthogonal transform R, x' = x + e is encoded as R x' = R x + R e: keeping R e
    instead of e gives the same payloads (up to float rounding) and never transforms back, so
    each step costs one transform less. Where the transform pads (a non-square R), the error's
    component in the padding's directions never reaches the decoded output; only the input's
    own domain drops it, so such tensors keep their memory there. ``precondition`` returns the
    transformed input; ``summarize`` of the inner codec must be invariant under R (THC's norm
    is).
    """

    def __init__(self, inner: Codec, bound: float | None = None):
        if not isinstance(inner, FeedbackTransform):
            raise TypeError(f"{type(inner).__name__} has no transformed domain")
        super().__init__(inner, bound)
        self.costly_preparation = True  # the precondition runs the transform
        self._lengths: dict[Hashable, int | None] = {}  # per key: length, None if untransformed

    def precondition(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        x = self.inner.precondition(x, ctx).reshape(-1).to(torch.float32)
        transformed = self.inner.transform_keeps_length(x.numel(), ctx)
        self._lengths[ctx.state_key] = x.numel() if transformed else None
        error = self.memory.get(ctx.state_key)
        if error is not None and error.numel() != x.numel():
            raise ValueError(
                f"error-feedback memory for {ctx.state_key!r} holds {error.numel()} coordinates, "
                f"the gradient has {x.numel()}; call reset() after re-bucketing"
            )
        if not transformed:
            return x.clone() if error is None else self._with_memory(x, error, ctx)
        # THC's native rotation measures |R x| and |e| on the way (R is orthogonal: the norms
        # the bound compares), and keeps the result's summary
        measure = getattr(self.inner, "transform_measured", None)
        measured = None if measure is None else measure(x, ctx, error)
        if measured is not None:
            rotated, x_norm, e_norm = measured
            if error is None or not self._acts(x_norm, e_norm):
                return rotated
            error.mul_(self.bound * x_norm / max(e_norm, 1e-30))  # after a spike
            return measure(x, ctx, error)[0]
        if error is not None:
            error = self._bounded(error, x)  # the transform is orthogonal: norms are kept
        return self.inner.transform(x, ctx, add=error)

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        if ctx.state_key not in self._lengths:
            raise RuntimeError(f"encode of {ctx.state_key!r} without its precondition")
        length = self._lengths[ctx.state_key]  # kept: a redone round encodes again
        if length is None:
            return super().encode(x, ctx, shared)
        payload, self.memory[ctx.state_key] = self.inner.encode_transformed(x, length, ctx, shared)
        return payload

    def __repr__(self) -> str:
        bound = "" if self.bound is None else f", bound={self.bound}"
        return f"TransformedErrorFeedback({self.inner!r}{bound})"


class FeedbackRefused(ValueError):
    """Error feedback was asked for a codec it makes diverge (``Codec.feedback_refusal``)."""


def feedback_for(codec: Codec, bound: float | None = None) -> ErrorFeedback:
    """The error feedback a codec runs best with: in its transformed domain where it has one;
    ``bound``: ``ErrorFeedback``'s bound on the memory added."""
    if codec.feedback_refusal is not None:
        raise FeedbackRefused(
            f"codec {codec.name!r} refuses error feedback: {codec.feedback_refusal}"
        )
    if isinstance(codec, FeedbackTransform):
        return TransformedErrorFeedback(codec, bound)
    return ErrorFeedback(codec, bound)

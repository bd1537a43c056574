"""Codecs a parameter server must decode, sum and re-encode (not homomorphic).

The aggregator's extra work is exactly the cost THC removes: one decode per contributing worker,
a float sum, and a second compression of the sum for the downstream (which adds its own error).

That second error is fed back at the aggregator where ``server_feedback`` is on (by default
where the method's papers keep one: TopK, whose re-selection otherwise drops the same small
coordinates step after step): the aggregator adds its memory of the partition to the sum before
re-encoding it and keeps what the re-encode lost. The memory is per aggregator (a parameter
server shard) and partition, the size of the partitions it serves (``server_state_nbytes``);
an all-reduce, where every worker runs the aggregator's side, keeps a copy on every worker.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Hashable, Sequence

import torch

from .base import Aggregation, Codec, CodecContext, Payload, check_same_length, require_finite


class DecodingCodec(Codec):
    aggregation = Aggregation.DECODE_SUM_ENCODE
    server_feedback_default = False

    def __init__(self, workers: int = 1, server_feedback: bool | None = None):
        super().__init__(workers)
        self.server_feedback = (
            self.server_feedback_default if server_feedback is None else server_feedback
        )
        self.server_memory: dict[Hashable, torch.Tensor] = {}
        self._server_lock = threading.Lock()

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
        if not self.server_feedback:
            summed = self.compress(total, ctx)
            return Payload(summed.fields, summed.length, contributors, summed.meta)
        with self._server_lock:
            error = self.server_memory.get(ctx.state_key)
        if error is not None and error.numel() == total.numel():
            total += error
        summed = self.compress(total, ctx)
        with self._server_lock:
            self.server_memory[ctx.state_key] = total - self.decompress(summed)
        return Payload(summed.fields, summed.length, contributors, summed.meta)

    def state_dict(self) -> dict:
        with self._server_lock:
            memory = {k: v.clone() for k, v in self.server_memory.items()}
        return {"server_memory": memory} if memory else {}

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state) - {"server_memory"})
        if unknown:
            raise ValueError(f"codec {self.name!r} keeps no state {unknown}")
        with self._server_lock:
            self.server_memory = {k: v.clone() for k, v in state.get("server_memory", {}).items()}

    def server_state_nbytes(self) -> int:
        """Bytes of the aggregator's error-feedback memory (every partition it served)."""
        with self._server_lock:
            return sum(t.numel() * t.element_size() for t in self.server_memory.values())

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

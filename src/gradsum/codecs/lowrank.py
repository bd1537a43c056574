"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r gradients in two linear sums, so any summing
aggregator carries them -- a switch as integers.

Per matrix-shaped gradient M (n x m, a tensor viewed as ``(shape[0], -1)`` as PyTorch's hook
does), with Q (m x r) warm-started from the previous step's average:

    stage 0:  P_i = M_i Q               summed over workers: P = mean_i P_i
    between:  P^ = orthogonalize(P)     (Gram-Schmidt; every worker computes the same bits)
    stage 1:  Q_i = M_i^T P^            summed: Q = mean_i Q_i
    finish:   M^ = P^ Q^T,  e_i <- M_i - M^ (error feedback),  Q kept for the next step

Both stages are sums, so the codec's wire is a *carrier* codec's: block floating point by default
(int32 lanes with one exponent per block of P or Q from the MAX round, as SwitchML does: a
switch, a parameter server and an all-reduce sum the same integers, so every aggregator gives the
same bits), or fp32 with ``floats=True`` (all-reduce and parameter servers sum floats; a switch
cannot).

How a bucket is split (``describe`` gives the tensors a key's flat buffer holds, in order): every
tensor of two or more dimensions whose rank-r factors are at least ``min_compression_rate`` times
smaller than it (PyTorch's test) is a partition of its own; runs of the other tensors (biases,
norms, small matrices) are partitions of at most the round's partition size that stage 0 sends
uncompressed through the carrier, and that sit out stage 1. A flat buffer nobody described is
cut into the round's partitions, each viewed as the most nearly square matrix its length
factors into (a length with no factor pair worth compressing goes uncompressed).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence

import torch

from .base import Codec, CodecContext, Payload, _derive_seed, require_finite
from .bfp import BlockFloatingPoint
from .plain import NoCompression

# where a matrix's first Q comes from: "partition", the run's shared seed and the partition;
# "shape", the run's seed and the matrix's shape (``shape_seeded_q``), as torch's hook draws it
# under ``--powersgd-first-q shape``: common random numbers for comparing the two
FIRST_Q = ("partition", "shape")


class PowerSGD(Codec):
    name = "powersgd"
    stages = 2
    keeps_own_feedback = True
    feedback_refusal = (
        "it keeps its own error feedback (M - P Q^T per matrix, the option error_feedback); the "
        "generic wrapper assumes one encode per round"
    )

    def __init__(
        self,
        workers: int = 1,
        rank: int = 1,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        error_feedback: bool = True,
        floats: bool = False,
        block_size: int = 256,
        first_q: str = "partition",
    ):
        super().__init__(workers)
        if rank < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {rank}")
        if first_q not in FIRST_Q:
            raise ValueError(f"powersgd first_q is one of {', '.join(FIRST_Q)}, got {first_q!r}")
        if first_q == "shape" and not warm_start:
            raise ValueError("powersgd first_q=shape draws the first Q only; it needs warm_start")
        self.first_q = first_q
        self.rank, self.min_compression_rate = rank, min_compression_rate
        self.warm_start, self.error_feedback, self.floats = warm_start, error_feedback, floats
        self.carrier: Codec = (
            NoCompression(workers) if floats else BlockFloatingPoint(workers, block_size)
        )
        carrier = self.carrier
        self.aggregation, self.lane_fields = carrier.aggregation, carrier.lane_fields
        self.linear_decode, self.blockwise = carrier.linear_decode, carrier.blockwise
        self._layouts: dict[Hashable, tuple[tuple[tuple[int, ...], ...], list]] = {}
        self._shapes: dict[Hashable, tuple[int, int] | None] = {}  # (key, partition) -> matrix
        self.memory: dict[Hashable, torch.Tensor] = {}  # error feedback, per worker and matrix
        self.q_memory: dict[Hashable, torch.Tensor] = {}  # warm start, per worker and matrix
        self._lock = threading.Lock()

    # -- the layout ------------------------------------------------------------------------
    def describe(self, key: Hashable, shapes: Sequence[tuple[int, ...]]) -> None:
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        with self._lock:
            known = self._layouts.get(key)
            if known is None or known[0] != shapes:
                self._layouts[key] = (shapes, [])

    def partitions(self, key: Hashable, total: int, size: int) -> list[tuple[int, int]]:
        with self._lock:
            layout = self._layouts.get(key)
        if layout is None:
            bounds = [(a, min(a + size, total)) for a in range(0, total, size)]
            matrices = [self._matrix(_squarest(b - a)) for a, b in bounds]
        else:
            shapes, cached = layout
            described = sum(math.prod(s) for s in shapes)
            if described != total:
                raise ValueError(
                    f"powersgd: the tensors described for {key!r} hold {described:,} "
                    f"coordinates, its flat gradient {total:,}"
                )
            if not cached:
                cached.extend(self._split(shapes, size))
            bounds = [(a, b) for a, b, _ in cached]
            matrices = [m for _, _, m in cached]
        with self._lock:
            for i, matrix in enumerate(matrices):
                self._shapes[(key, i)] = matrix
        return bounds

    def _split(self, shapes, size: int) -> list[tuple[int, int, tuple[int, int] | None]]:
        """(start, end, matrix or None) for every partition of a described buffer."""
        parts, start, rest = [], 0, None  # rest: where the current run of uncompressed begins
        for shape in shapes:
            count = math.prod(shape)
            matrix = self._matrix((shape[0], count // shape[0])) if len(shape) >= 2 else None
            if matrix is None:
                rest = start if rest is None else rest
            else:
                if rest is not None:
                    parts += [(a, min(a + size, start), None) for a in range(rest, start, size)]
                    rest = None
                parts.append((start, start + count, matrix))
            start += count
        if rest is not None:
            parts += [(a, min(a + size, start), None) for a in range(rest, start, size)]
        return parts

    def _matrix(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """The matrix shape if compressing it at this rank pays (PyTorch's test), else None."""
        n, m = shape
        r = min(n, m, self.rank)
        return shape if n * m > 0 and (n + m) * r * self.min_compression_rate < n * m else None

    def _shape_of(self, ctx: CodecContext, length: int) -> tuple[int, int] | None:
        with self._lock:
            if ctx.key in self._shapes:
                return self._shapes[ctx.key]
        return self._matrix(_squarest(length))  # a partition driven by hand

    # -- the stages ----------------------------------------------------------------------------
    def precondition(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        x = x.reshape(-1).to(torch.float32)
        error = self.memory.get(ctx.state_key) if self.error_feedback else None
        if error is None or self._shape_of(ctx, x.numel()) is None:
            return x
        if error.numel() != x.numel():
            raise ValueError(
                f"powersgd error-feedback memory for {ctx.state_key!r} holds {error.numel()} "
                f"coordinates, the gradient has {x.numel()}; call reset() after re-bucketing"
            )
        return x + error

    def stage_input(self, x: torch.Tensor, ctx: CodecContext, stage: int,
                    previous: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        shape = self._shape_of(ctx, x.numel())
        if shape is None:
            return x if stage == 0 else None
        matrix = x.view(shape)
        if stage == 0:
            require_finite(x)
            return (matrix @ self._q(ctx, shape, x.device)).reshape(-1)
        p = orthogonalize(previous.view(shape[0], -1).clone())
        return (matrix.T @ p).reshape(-1)

    def finish(self, x: torch.Tensor, ctx: CodecContext,
               averages: Sequence[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        shape = self._shape_of(ctx, x.numel())
        if shape is None:
            return averages[0]
        p = orthogonalize(averages[0].view(shape[0], -1).clone())
        q = averages[1].view(shape[1], -1)
        estimate = (p @ q.T).reshape(-1)
        if self.warm_start:
            self.q_memory[ctx.state_key] = q.clone()
        if self.error_feedback:
            self.memory[ctx.state_key] = x - estimate
        return estimate

    def _q(self, ctx: CodecContext, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        """This step's orthogonal Q (m x r): the last average (warm start), or drawn from the
        run's shared seed (the same on every worker) on a matrix's first step."""
        r = min(shape[0], shape[1], self.rank)
        q = self.q_memory.get(ctx.state_key) if self.warm_start else None
        if q is None or q.shape != (shape[1], r):
            if self.first_q == "shape":
                return orthogonalize(shape_seeded_q(ctx.seed, *shape, r).to(device))
            step = 0 if self.warm_start else ctx.step
            seed = _derive_seed("powersgd", ctx.shared_seed(), ctx.partition, step)
            generator = torch.Generator().manual_seed(seed)
            q = torch.randn(shape[1], r, generator=generator).to(device)
        return orthogonalize(q.clone())

    # -- the wire: the carrier's ----------------------------------------------------------------
    @property
    def needs_summary(self) -> bool:
        return self.carrier.needs_summary

    def summarize(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor | None:
        return self.carrier.summarize(x, ctx)

    def summary_bits(self) -> int:
        return self.carrier.summary_bits()

    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        return self.carrier.encode(x, ctx, shared)

    def encode_into(self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> Payload:  # fmt: skip
        return self.carrier.encode_into(x, ctx, shared, out)

    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        return self.carrier.aggregate(payloads, ctx)

    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.carrier.decode(payload, ctx, shared)

    def decode_into(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> None:  # fmt: skip
        self.carrier.decode_into(payload, ctx, shared, out)

    def decode_counted(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                       out: torch.Tensor) -> None:  # fmt: skip
        self.carrier.decode_counted(payload, ctx, shared, out)

    def integer_op(self):
        return self.carrier.integer_op()

    def lanes(self, length: int) -> int:
        return self.carrier.lanes(length)

    def lane_widths(self) -> tuple[int, int]:
        return self.carrier.lane_widths()

    # -- state -----------------------------------------------------------------------------------
    def reset(self, key: Hashable | None = None) -> None:
        for memory in (self.memory, self.q_memory):
            if key is None:
                memory.clear()
            else:
                memory.pop(key, None)

    def state_nbytes(self) -> int:
        """Bytes of error-feedback and warm-start memory held (all workers this object serves)."""
        tensors = [*self.memory.values(), *self.q_memory.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict:
        return {
            "memory": {k: v.clone() for k, v in self.memory.items()},
            "q_memory": {k: v.clone() for k, v in self.q_memory.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.memory = {k: v.clone() for k, v in state.get("memory", {}).items()}
        self.q_memory = {k: v.clone() for k, v in state.get("q_memory", {}).items()}

    def __repr__(self) -> str:
        return (
            f"PowerSGD(workers={self.workers}, rank={self.rank}, "
            f"carrier={'fp32' if self.floats else 'bfp'}, warm_start={self.warm_start}, "
            f"error_feedback={self.error_feedback})"
        )


def shape_seeded_q(seed: int, rows: int, columns: int, rank: int) -> torch.Tensor:
    """A first Q (columns x rank, not yet orthogonalized) drawn from the run's seed and the
    matrix's shape alone: what ``first_q="shape"`` gives gradsum's codec and what
    ``train.peers.with_shape_seeded_q`` gives torch's hook, so that a comparison of the two starts
    from the same Q per matrix (matrices of one shape share it)."""
    seed = _derive_seed("powersgd-first-q", seed, rows, columns)
    return torch.randn(columns, rank, generator=torch.Generator().manual_seed(seed))


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``matrix`` (n x r), in place; a zero column stays zero
    (PyTorch's hook would divide by zero there). Deterministic: the same bits on every worker."""
    for i in range(matrix.shape[1]):
        column = matrix[:, i : i + 1]
        norm = torch.linalg.vector_norm(column)
        column.copy_(torch.where(norm > 0, column / norm, torch.zeros_like(column)))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest -= (column * rest).sum(dim=0, keepdim=True) * column
    return matrix


def _squarest(length: int) -> tuple[int, int]:
    """(n, m) with n * m = length, n <= m and n as large as possible."""
    n = math.isqrt(length)
    while n > 1 and length % n:
        n -= 1
    return (max(n, 1), length // max(n, 1)) if length else (0, 0)

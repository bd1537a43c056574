"""The divergence guard: a step whose loss or averaged gradient is non-finite, or whose loss
jumps past ``factor`` times its running mean, stops training with a message naming the step and
the method (``--fallback stop``), or is retried through the aggregator's lossless codec and
counted (``--fallback none``).

The decision is pure (:class:`DivergenceGuard`); the loop feeds it the loss averaged over
workers (one small all-reduce), so every worker takes the same decision, and the gradient after
aggregation, which every worker holds bit for bit alike.
"""

from __future__ import annotations

import math
from collections import deque

FALLBACK_NAMES = ("stop", "none")


class DivergenceError(RuntimeError):
    """Training diverged; the message names the step, the method and what was seen."""


class DivergenceGuard:
    """``factor``: a loss above ``factor`` × the mean of the last ``window`` accepted losses is a
    jump (checked once ``warmup`` losses are in; ``math.inf`` turns the check off)."""

    def __init__(
        self, method: str, factor: float = 3.0, *, fallback: str = "stop", warmup: int = 10,
        window: int = 50,
    ) -> None:  # fmt: skip
        if fallback not in FALLBACK_NAMES:
            raise ValueError(f"--fallback {fallback!r}: choose one of {', '.join(FALLBACK_NAMES)}")
        if not factor > 1.0:
            raise ValueError(f"--divergence-factor must exceed 1, got {factor}")
        self.method, self.factor, self.fallback, self.warmup = method, factor, fallback, warmup
        self._recent: deque[float] = deque(maxlen=window)
        self.fallbacks = 0  # steps retried uncompressed

    @property
    def running_mean(self) -> float | None:
        return sum(self._recent) / len(self._recent) if self._recent else None

    def loss_problem(self, loss: float) -> str | None:
        """What is wrong with a step's (worker-averaged) loss, or None."""
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        mean = self.running_mean
        if len(self._recent) >= self.warmup and loss > self.factor * mean:
            return f"the loss jumped to {loss:.4g}, {loss / mean:.1f}x its running mean {mean:.4g}"
        return None

    def gradient_problem(self, finite: bool) -> str | None:
        return None if finite else "the averaged gradient is not finite"

    def accept(self, loss: float) -> None:
        self._recent.append(loss)

    def diverged(self, step: int, problem: str) -> DivergenceError:
        hint = "; --fallback none retries such steps uncompressed"
        hint = "" if self.fallback == "none" else hint
        return DivergenceError(
            f"training diverged at step {step} with {self.method}: {problem}{hint}"
        )

    def should_retry(self, problem: str) -> bool:
        """Whether the step is retried uncompressed (``--fallback none``); a non-finite loss is
        never: it comes from the weights, which no retry of this step's gradient changes."""
        return self.fallback == "none" and not problem.startswith("the loss is")

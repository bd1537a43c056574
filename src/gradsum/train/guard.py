"""The divergence guard: a step whose loss or averaged gradient is non-finite, or whose loss
stays past ``factor`` times its running mean, stops training with a message naming the step and
the method (``--fallback stop``), or is retried through the aggregator's lossless codec and
counted (``--fallback none``).

One minibatch's loss is a noisy reading: near convergence an ordinary batch can be several times
the mean of the last fifty (a mean of 0.06 and a batch at 0.24 are both healthy). So a jump of one
step alone is not divergence: training stops on a jump only when the median of the last
``patience`` steps' losses is past the factor too, which one noisy batch cannot move and a
diverging run does within a few steps. With ``--fallback none`` a single jump of a compressed
run is still retried uncompressed, since that costs one lossless round.

The decision is pure (:class:`DivergenceGuard`); the loop feeds it the loss averaged over
workers (one small all-reduce), so every worker takes the same decision, and the gradient after
aggregation, which every worker holds bit for bit alike.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

FALLBACK_NAMES = ("stop", "none")


class DivergenceError(RuntimeError):
    """Training diverged; the message names the step, the method and what was seen."""


class DivergenceGuard:
    """``factor``: a loss above ``factor`` × the mean of the last ``window`` accepted losses is a
    jump (checked once ``warmup`` losses are in; ``math.inf`` turns the check off); training
    stops on one when the median of the last ``patience`` losses, this one included, is past it
    too. ``compressed``: whether the method compresses (what a retry uncompressed would change,
    and what the message may blame)."""

    def __init__(
        self, method: str, factor: float = 3.0, *, fallback: str = "stop", warmup: int = 10,
        window: int = 50, patience: int = 5, compressed: bool = True,
    ) -> None:  # fmt: skip
        if fallback not in FALLBACK_NAMES:
            raise ValueError(f"--fallback {fallback!r}: choose one of {', '.join(FALLBACK_NAMES)}")
        if not factor > 1.0:
            raise ValueError(f"--divergence-factor must exceed 1, got {factor}")
        if patience < 1:
            raise ValueError(f"patience must be at least 1, got {patience}")
        self.method, self.factor, self.fallback, self.warmup = method, factor, fallback, warmup
        self.patience, self.compressed = patience, compressed
        self._recent: deque[float] = deque(maxlen=window)
        self._latest: deque[float] = deque(maxlen=patience - 1)  # every step's, jumps included
        self.fallbacks = 0  # steps retried uncompressed
        self.jumps = 0  # single-step jumps seen and let pass

    @property
    def running_mean(self) -> float | None:
        return sum(self._recent) / len(self._recent) if self._recent else None

    def loss_problem(self, loss: float) -> str | None:
        """What is wrong with a step's (worker-averaged) loss, or None. Every step's loss passes
        through here once (a retried step's is not seen again)."""
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        mean = self.running_mean
        latest = [*self._latest, loss]
        self._latest.append(loss)
        if len(self._recent) < self.warmup or not loss > self.factor * mean:
            return None
        median = statistics.median_low(latest)
        if self.patience == 1:  # one step decides
            return f"the loss jumped to {loss:.4g}, {loss / mean:.1f}x its running mean {mean:.4g}"
        if len(latest) == self.patience and median > self.factor * mean:
            return (
                f"the loss rose to {loss:.4g}; the median of the last {self.patience} steps, "
                f"{median:.4g}, is {median / mean:.1f}x the running mean {mean:.4g}"
            )
        if self.fallback == "none" and self.compressed:
            return f"the loss jumped to {loss:.4g}, {loss / mean:.1f}x its running mean {mean:.4g}"
        self.jumps += 1  # one noisy batch: not divergence
        return None

    def gradient_problem(self, finite: bool) -> str | None:
        return None if finite else "the averaged gradient is not finite"

    def accept(self, loss: float) -> None:
        """A step taken with this loss. A jump stays out of the running mean, so a run that
        keeps rising is measured against where it was, not against its own rise."""
        mean = self.running_mean
        if len(self._recent) < self.warmup or not loss > self.factor * mean:
            self._recent.append(loss)

    def diverged(self, step: int, problem: str) -> DivergenceError:
        if not self.compressed:  # nothing to decompress: the usual causes of an fp32 run's
            hint = "; a lower --lr, or --divergence-factor inf to train on regardless"
        elif self.fallback == "none":
            hint = ""
        else:
            hint = "; --fallback none retries such steps uncompressed"
        return DivergenceError(
            f"training diverged at step {step} with {self.method}: {problem}{hint}"
        )

    def should_retry(self, problem: str) -> bool:
        """Whether the step is retried uncompressed (``--fallback none``); a non-finite loss is
        never: it comes from the weights, which no retry of this step's gradient changes."""
        return self.fallback == "none" and not problem.startswith("the loss is")


def all_finite(tensors) -> bool:
    """Whether every entry of ``tensors`` is finite, from one sum per tensor: NaN and inf
    propagate through a sum, and it reads each tensor once without allocating a boolean copy
    (``isfinite().all()`` took several times as long: a twentieth of a compressed step). A sum
    of finite float32 entries can still overflow, so a tensor whose sum is not finite is summed
    again in float64, where none can (summing every tensor in float64 costs three times as
    much, and that is the case that never happens in a healthy run)."""
    import torch

    tensors = list(tensors)
    if not tensors:
        return True
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    if bool(sums.isfinite().all()):
        return True
    finite = sums.isfinite().tolist()
    suspects = (t for t, ok in zip(tensors, finite, strict=True) if not ok)
    return all(bool(t.sum(dtype=torch.float64).isfinite()) for t in suspects)

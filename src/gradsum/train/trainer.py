"""The one training loop. `gradsum train`, `bench train`, `bench tta` and `bench scale` all
drive a :class:`Trainer`; what differs between them is plugged in, not copied:

* :class:`Replicas` computes and averages one step's gradient: a real worker's model and its
  sync over the Session or DDP (``train/loop.py``), or n workers simulated in one process
  through the codec's exact round (``bench/scale.py``);
* :class:`Batches` hands out each epoch's batches and moves one to where it is computed;
* :class:`Report` sees every step and epoch and evaluates the model: epoch metrics and
  checkpoints, or validation losses on a step schedule.

The Trainer owns what every run shares: the steps, the rules that stop them (epochs,
``max_steps``, a time budget, a target loss), when evaluations happen (every K steps, every S
seconds of training, per epoch), the divergence guard with its uncompressed retry, and the
uncompressed warm-up steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .guard import DivergenceGuard


class Replicas(Protocol):
    """One step's gradient, computed and averaged so that every replica holds it alike."""

    step: int  # gradient rounds so far; a resumed run restores it, so warm-up is not repeated
    # steps between a loss and its agreement: 0, or 1 where steps need not wait for each other
    # (local steps), so the agreement travels while the next step computes
    agreement_lag: int

    def forward(self, inputs, labels) -> tuple[Any, Any]:
        """(this worker's loss tensor, the outputs)."""

    def agree(self, loss, stop: bool) -> tuple[float | None, bool]:
        """The loss averaged over workers, and whether any worker asked to stop: this step's,
        or, with ``agreement_lag`` 1, the step before's (None at the first)."""

    def backward(self, loss) -> None:
        """Leave the averaged gradient where the optimizer reads it."""

    def gradients_finite(self) -> bool: ...

    def uncompressed(self) -> contextlib.AbstractContextManager: ...

    def zero_grad(self) -> None: ...

    def apply(self) -> None:
        """The optimizer's step."""


class Batches(Protocol):
    def epoch(self, epoch: int) -> Iterable[tuple[Any, Any]]: ...

    def prepare(self, inputs, labels) -> tuple[Any, Any]:
        """The batch where it is computed; inside the step's timed region, as a step's
        transfer is part of what it costs."""


class EvaluationTimeout(RuntimeError):
    """The step after an evaluation timed out waiting for the other workers: worker 0
    evaluates while they wait for it in that step's agreement, within the collectives'
    timeout."""

    def __init__(self, step: int):
        super().__init__(
            f"timed out in the step after the evaluation at step {step}: worker 0 evaluates "
            "while the other workers wait for it, within --timeout; evaluate fewer samples "
            "(--eval-samples) or raise --timeout"
        )


class Report:
    """What a run records besides training; every hook does nothing unless overridden."""

    def begin_epoch(self, epoch: int) -> None: ...

    def after_step(self, outcome: tuple[Any, Any], labels, index: int) -> None: ...

    def end_epoch(self, epoch: int, durations: Sequence[float]) -> None: ...

    def close_epoch(self) -> None:
        """Also on an error, so that its report starts a line of its own."""

    def evaluate(self, step: int, clock: float) -> float | None:
        """The validation loss, or None where this worker does not evaluate."""
        return None


@dataclass(frozen=True)
class Schedule:
    """When a run stops and evaluates. ``epochs`` None: by steps, until another rule stops it,
    evaluating at the start, every ``eval_every`` steps, every ``eval_seconds`` of training and
    at the end; else by epochs, which the Report sums up."""

    epochs: int | None = None
    max_steps: int | None = None
    time_budget: float | None = None  # seconds of training, the deciding worker's clock
    target_loss: float | None = None
    eval_every: int | None = None
    eval_seconds: float | None = None
    uncompressed_steps: int = 0
    first_epoch: int = 0

    @property
    def stepwise(self) -> bool:
        return self.epochs is None

    def every(self) -> int | None:
        """Steps between evaluations: by default ten over ``max_steps``, unless by seconds."""
        if self.eval_every or self.eval_seconds:
            return self.eval_every
        return max(1, (self.max_steps or 1) // 10)


class Trainer:
    """Runs steps until the schedule stops them. ``decides``: this worker's clock and
    evaluations decide when all stop (worker 0); the others learn it in the next step's
    agreement. ``guard`` None: no divergence checks."""

    def __init__(
        self,
        replicas: Replicas,
        batches: Batches,
        report: Report,
        schedule: Schedule,
        *,
        guard: DivergenceGuard | None = None,
        decides: bool = True,
    ) -> None:
        self.replicas, self.batches, self.report = replicas, batches, report
        self.schedule, self.guard, self.decides = schedule, guard, decides
        self.count = 0  # steps taken
        self.clock = 0.0  # seconds of training, evaluations left out
        self.durations: list[float] = []  # each step's seconds
        self._stop = False  # asked by an evaluation that reached the target loss
        self._evaluated_at: int | None = None
        self._next_eval_at = schedule.eval_seconds

    def run(self) -> Trainer:
        if self.schedule.stepwise:
            self._evaluate()
        epoch = self.schedule.first_epoch
        while self.schedule.epochs is None or epoch < self.schedule.epochs:
            if not self._epoch(epoch):
                break
            epoch += 1
        return self

    def _epoch(self, epoch: int) -> bool:
        """One pass over the epoch's batches; False once a rule stopped training."""
        self.report.begin_epoch(epoch)
        first = len(self.durations)
        try:
            for index, (inputs, labels) in enumerate(self.batches.epoch(epoch)):
                if not self._timed_step(inputs, labels, index) or self._at_max_steps():
                    self._evaluate_last()
                    return False
                self._evaluate_when_due()
        finally:
            self.report.close_epoch()
        if len(self.durations) == first:
            raise ValueError("an epoch without a batch: more samples per step than in training")
        self.report.end_epoch(epoch, self.durations[first:])
        return True

    def _timed_step(self, inputs, labels, index: int) -> bool:
        over = self.schedule.time_budget is not None and self.clock >= self.schedule.time_budget
        start = time.perf_counter()
        inputs, labels = self.batches.prepare(inputs, labels)
        outcome = self.step(inputs, labels, stop=self.decides and (self._stop or over))
        if outcome is None:  # some worker asked to stop: all stop here, together
            return False
        self.durations.append(time.perf_counter() - start)
        self.clock += self.durations[-1]
        self.report.after_step(outcome, labels, index)
        return True

    def _at_max_steps(self) -> bool:
        return self.schedule.max_steps is not None and self.count >= self.schedule.max_steps

    def _evaluate_when_due(self) -> None:
        timely = self._next_eval_at is not None and self.clock >= self._next_eval_at
        if timely:
            while self._next_eval_at <= self.clock:
                self._next_eval_at += self.schedule.eval_seconds
        every = self.schedule.every() if self.schedule.stepwise else None
        if timely or (every is not None and self.count % every == 0):
            self._evaluate()

    def _evaluate_last(self) -> None:
        if self.schedule.stepwise and self._evaluated_at != self.count:
            self._evaluate()  # the deciding worker's final evaluation; the others wait for it

    def _evaluate(self) -> None:
        self._evaluated_at = self.count
        loss = self.report.evaluate(self.count, self.clock)
        target = self.schedule.target_loss
        if loss is not None and target is not None and loss <= target:
            self._stop = True

    def step(self, inputs, labels, stop: bool = False):
        """(loss, outputs) of one step under the divergence guard (train/guard.py), or None when
        a worker asked to stop (nothing taken).

        The loss averaged over workers (the agreement, which also carries a request to stop) is
        checked before backward, the averaged gradient, alike on every worker, after it. A
        problem either ends training (``DivergenceError`` naming the step and the method) or,
        with ``--fallback none``, the step is taken again uncompressed and counted."""
        replicas = self.replicas
        replicas.zero_grad()
        # the first steps go uncompressed; counted in gradient rounds, so a resumed run warms
        # up only where the first one had not. DDP's no_sync must see the forward too.
        warming = replicas.step < self.schedule.uncompressed_steps
        with replicas.uncompressed() if warming else contextlib.nullcontext():
            loss, outputs = replicas.forward(inputs, labels)
            try:
                mean, stopping = replicas.agree(loss, stop)
            except RuntimeError as error:  # the collectives' own words name no cause
                if self._waited_for_evaluation() and "timed out" in str(error).lower():
                    raise EvaluationTimeout(self._evaluated_at) from error
                raise
            if stopping:
                return None
            problem = self._loss_problem(mean)
            if problem is None:
                replicas.backward(loss)
                problem = self._gradient_problem()
        if problem is not None:
            loss, outputs = self._retry(inputs, labels, problem)
        replicas.apply()
        if self.guard is not None and mean is not None:
            self.guard.accept(mean)
        self.count += 1
        return loss, outputs

    def _waited_for_evaluation(self) -> bool:
        """Whether this step's agreement is where the workers wait for worker 0's last
        evaluation: the step after it, or the one after that where agreements lag a step."""
        if self._evaluated_at is None:
            return False
        return 0 <= self.count - self._evaluated_at <= self.replicas.agreement_lag

    def _loss_problem(self, mean: float | None) -> str | None:
        if self.guard is None or mean is None:
            return None
        problem = self.guard.loss_problem(mean)
        lag = self.replicas.agreement_lag
        if problem is None or not lag:
            return problem
        return f"{problem} (the loss of step {self.count + 1 - lag})"

    def _gradient_problem(self) -> str | None:
        if self.guard is None:
            return None
        return self.guard.gradient_problem(self.replicas.gradients_finite())

    def _retry(self, inputs, labels, problem: str):
        guard, replicas = self.guard, self.replicas
        if not guard.should_retry(problem):
            raise guard.diverged(self.count + 1, problem)
        guard.fallbacks += 1
        replicas.zero_grad()
        with replicas.uncompressed():
            loss, outputs = replicas.forward(inputs, labels)
            replicas.backward(loss)
        if not replicas.gradients_finite():
            problem = "the gradient is not finite uncompressed either"
            raise guard.diverged(self.count + 1, problem)
        return loss, outputs

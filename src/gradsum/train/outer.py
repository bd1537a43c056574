"""Local steps with an outer sync (DiLoCo): each worker takes ``h`` steps of its own optimizer
on its own batches, then the workers average the pseudo-gradient (start weights − local
weights) through the run's Session (any codec, any aggregator) and an outer Nesterov SGD applies
it to the start weights, which every worker then holds alike.

    --local-steps 'diloco(h=32,lr=0.7,momentum=0.9)'      # gradsum train, bench train
    --local-steps 'diloco(h=8,overlap=8)'                 # the round beside the next 8 steps
    --methods 'ddp,allreduce:thc+diloco(h=32)'            # bench tta, bench train

The pseudo-gradient is kept exactly as the inner optimizer computes it: the inner optimizer
updates an accumulator ``acc`` that starts each round at zero, and the local weights are
``start + acc``, so the pseudo-gradient is ``−acc``, the sum of the inner updates, not the
difference of two rounded weights. With ``h=1``, an outer SGD at learning rate 1 without momentum
and an inner SGD whose learning rate is a power of two, a run is therefore bit for bit plain data
parallel training with the same codec and aggregator (``tests/train/test_local_steps.py``).

Split in two: :class:`OuterState` is the pure bookkeeping (start, accumulator, the inner and
outer optimizers), tested without a process group; :class:`LocalWorker` is the Trainer's
``Replicas`` for it (train/trainer.py), whose round is the run's ``GradientSync`` driven by hand:
the same plan, keys, steps, tensor descriptions (THC's per-tensor scales), PS shards, recovery
and uncompressed Session as a data-parallel step's, with the pseudo-gradient in ``param.grad``.
The codec's error feedback lives in the Session's codec and so carries across outer rounds; the
inner optimizer's state stays on its worker. Evaluations see the start weights, the model every
worker holds alike (mid-round a worker's own weights have seen its shard only).

``overlap=T`` hides the round behind compute: the next T inner steps run while it travels, from
the weights the round ended at, and it lands T steps late, those steps carried over onto the new
start (the eager update of overlapped DiLoCo). The start weights, what is evaluated, then lag the
local ones by a round; the sender's thread carries the round, and an all-reduce gets a process
group of its own beside the inner steps' loss agreement (train/aggregators.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

LOCAL_STEPS_NAMES = ("diloco",)


@dataclass(frozen=True)
class LocalSteps:
    """``h`` inner steps between outer syncs; the outer SGD's learning rate and momentum
    (Nesterov where momentum > 0), DiLoCo's defaults. ``overlap``: inner steps taken while an
    outer round is in flight (0: none, the workers wait for it)."""

    h: int = 32
    lr: float = 0.7
    momentum: float = 0.9
    overlap: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.h, int) and self.h >= 1):
            raise ValueError(f"local steps: h={self.h} must be an integer >= 1")
        if not (isinstance(self.overlap, int) and 0 <= self.overlap <= self.h):
            raise ValueError(
                f"local steps: overlap={self.overlap} must be an integer from 0 (the round "
                f"lands before the next inner step) to h={self.h} (it lands a whole round later)"
            )
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"local steps: lr={self.lr} must be a positive number")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"local steps: momentum={self.momentum} must be in [0, 1)")


def parse_local_steps(text: str) -> LocalSteps:
    """``diloco(h=32,lr=0.7,momentum=0.9)`` (unnamed options keep their defaults); ValueError
    naming what is wrong and what is valid."""
    from ..spec import check_options, parse_options, signature_options, split_spec

    name, options = split_spec(text)
    if name not in LOCAL_STEPS_NAMES:
        raise ValueError(f"unknown local steps {name!r}; choose {', '.join(LOCAL_STEPS_NAMES)}")
    given = parse_options(options, "local-steps option")
    accepted = signature_options(LocalSteps.__init__)
    return LocalSteps(**check_options("local steps", name, given, accepted))


class OuterState:
    """One worker's side of local steps, without communication.

    ``weights``: the model's parameters (the local weights, overwritten); ``inner``: builds the
    inner optimizer over the accumulators (its own weight decay off: ``weight_decay`` is applied
    here to the weights, coupled into the gradient for SGD, decoupled at ``decoupled_lr`` for
    AdamW, as torch's optimizers apply it to their parameters).

    A round is ``launch``-ed once ``due`` (its pseudo-gradient written out, the accumulator
    zeroed) and ``land``-ed with the workers' average. Without overlap it lands at once. With
    ``overlap`` τ > 0 the next round's first τ inner steps run meanwhile from the weights the
    launched round ended at (``base``): this worker's own updates stand in for the average
    until it lands (the eager update of overlapped DiLoCo). Landing applies the outer step to
    the start weights, which then lag the local ones by the steps taken since the launch, and
    those steps carry over onto the new start. Start weights are what every worker holds alike.
    """

    def __init__(self, weights: Sequence[torch.Tensor], spec: LocalSteps,
                 inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 weight_decay: float = 0.0, decoupled_lr: float | None = None) -> None:  # fmt: skip
        self.weights, self.spec = list(weights), spec
        with torch.no_grad():
            self.start = [w.detach().clone() for w in self.weights]
            self.acc = [torch.zeros_like(w) for w in self.weights]
            # the round in flight's pseudo-gradient, then its average; what the inner steps
            # add to while it is in flight (overlap only)
            self.sent = [torch.zeros_like(w) for w in self.weights] if spec.overlap else None
            self._launched = [torch.zeros_like(w) for w in self.weights] if spec.overlap else None
        self.base = self.start
        self.inner = inner(self.acc)
        momentum = spec.momentum
        self.outer = torch.optim.SGD(self.start, lr=spec.lr, momentum=momentum,
                                     nesterov=momentum > 0)  # fmt: skip
        self.weight_decay, self.decoupled_lr = weight_decay, decoupled_lr
        self.taken = 0  # inner steps of the current round
        self.rounds = 0  # outer steps taken (rounds landed)
        self.in_flight = False  # a round launched and not landed
        self._wait: Callable[[], None] | None = None  # until the round in flight has arrived

    @property
    def due(self) -> bool:
        """Whether the round's inner steps are all taken: the outer sync is next."""
        return self.taken >= self.spec.h

    @property
    def landing(self) -> bool:
        """Whether the round in flight lands now: before the next inner step without overlap,
        after ``overlap`` inner steps of the next round with it."""
        return self.in_flight and self.taken >= self.spec.overlap

    @torch.no_grad()
    def inner_step(self, grads: Sequence[torch.Tensor]) -> None:
        """The inner optimizer's step on this worker's own gradient (``grads``, one per weight;
        modified where weight decay is coupled); the local weights become ``base + acc``."""
        if self.weight_decay:
            for w, g, a in zip(self.weights, grads, self.acc, strict=True):
                if self.decoupled_lr is None:
                    g.add_(w, alpha=self.weight_decay)
                else:
                    a.add_(w, alpha=-self.decoupled_lr * self.weight_decay)
        for a, g in zip(self.acc, grads, strict=True):
            a.grad = g
        self.inner.step()
        for a in self.acc:
            a.grad = None
        self.taken += 1
        if self.sent is not None or not self.due:  # without overlap, landing sets them
            self._local_weights()

    @torch.no_grad()
    def launch(self, into: Sequence[torch.Tensor] | None = None,
               wait: Callable[[], None] | None = None) -> list[torch.Tensor]:  # fmt: skip
        """End the round: write its pseudo-gradient (start − local, the negated sum of its
        inner updates) into ``into`` (with overlap: into ``sent``, which the round's average
        must overwrite), zero the accumulator and count a new round. ``wait``: blocks until
        the average has arrived (``settle`` calls it). Returns the tensors written."""
        if self.in_flight:
            raise RuntimeError("local steps: a round launched while the last is in flight")
        if self.sent is not None:
            into = self.sent
            for launched, w in zip(self._launched, self.weights, strict=True):
                launched.copy_(w)
            self.base = self._launched
        for buffer, a in zip(into, self.acc, strict=True):
            torch.neg(a, out=buffer)
            a.zero_()
        self.taken = 0
        self.in_flight, self._wait = True, wait
        return list(into)

    def settle(self) -> None:
        """Wait until the round in flight's average has arrived (it lands later): what a
        checkpoint does first, so that no round is running while the state is read."""
        wait, self._wait = self._wait, None
        if wait is not None:
            wait()

    @torch.no_grad()
    def land(self, average: Sequence[torch.Tensor] | None = None) -> None:
        """Apply the workers' averaged pseudo-gradient (``average``; with overlap, ``sent``)
        to the start weights with the outer optimizer; the local weights become the new start
        plus the inner updates taken since the launch."""
        self.settle()
        if average is None:
            average = self.sent
        for s, d in zip(self.start, average, strict=True):
            s.grad = d
        self.outer.step()
        for s in self.start:
            s.grad = None
        self.base = self.start
        self.in_flight = False
        self.rounds += 1
        self._local_weights()

    @contextlib.contextmanager
    def synced_weights(self):
        """The start weights in the model while inside, the local ones back after: what is
        evaluated, as every worker holds it alike (a worker's local weights, mid-round, are
        its own shard's model; with overlap the start lags by the round in flight)."""
        if self._at_start():  # a round just landed: the local weights are the start
            yield
            return
        with torch.no_grad():
            for w, s in zip(self.weights, self.start, strict=True):
                w.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                self._local_weights()

    def _at_start(self) -> bool:
        return self.taken == 0 and not self.in_flight

    def _local_weights(self) -> None:
        if self._at_start():
            for w, s in zip(self.weights, self.start, strict=True):
                w.copy_(s)
            return
        for w, b, a in zip(self.weights, self.base, self.acc, strict=True):
            torch.add(b, a, out=w)

    def state_dict(self) -> dict:
        self.settle()
        state = {"start": [s.clone() for s in self.start], "acc": [a.clone() for a in self.acc],
                 "inner": self.inner.state_dict(), "outer": self.outer.state_dict(),
                 "taken": self.taken, "rounds": self.rounds}  # fmt: skip
        if self.in_flight:  # arrived (settled) and not landed: it lands after the resume
            state["in_flight"] = {"base": [b.clone() for b in self.base],
                                  "average": [d.clone() for d in self.sent]}  # fmt: skip
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.settle()
        for mine, saved in ((self.start, state["start"]), (self.acc, state["acc"])):
            for tensor, value in zip(mine, saved, strict=True):
                tensor.copy_(value)
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        self.taken, self.rounds = state["taken"], state["rounds"]
        flight = state.get("in_flight")
        if flight is not None and self.sent is None:
            raise ValueError(
                "this checkpoint holds an outer round in flight: resume with the same "
                "--local-steps overlap"
            )
        self.in_flight, self.base = flight is not None, self.start
        if flight is not None:
            for mine, saved in ((self._launched, flight["base"]), (self.sent, flight["average"])):
                for tensor, value in zip(mine, saved, strict=True):
                    tensor.copy_(value)
            self.base = self._launched
        self._local_weights()


class LocalWorker:
    """The Trainer's ``Replicas`` for local steps (train/trainer.py): ``worker`` (train/loop.py's
    ``Worker``) computes the forward and the loss agreement; backward stays local; ``apply`` takes
    the inner step and, when the round is due, the outer round through ``worker.sync`` (a
    ``GradientSync`` built without backward hooks). Without overlap the pseudo-gradient travels
    in ``param.grad`` and the worker waits for it; with overlap in the state's own buffers,
    while the next inner steps run (the sync's sender runs rounds on its own thread).

    ``step`` counts outer rounds, so ``--uncompressed-steps N`` sends the first N outer rounds
    through the Session's lossless codec; a step the Trainer runs uncompressed (warm-up, or a
    retry) sends its round, when one is due, uncompressed too."""

    def __init__(self, worker, state: OuterState) -> None:
        self.worker, self.state = worker, state
        self.sync = worker.sync
        self._lossless = False

    @property
    def step(self) -> int:
        return self.sync.step

    def forward(self, inputs, labels):
        return self.worker.forward(inputs, labels)

    def agree(self, loss, stop: bool) -> tuple[float, bool]:
        return self.worker.agree(loss, stop)

    def backward(self, loss) -> None:
        loss.backward()  # this worker's own gradient: the inner steps exchange nothing

    def gradients_finite(self) -> bool:
        return self.worker.gradients_finite()

    @contextlib.contextmanager
    def uncompressed(self):
        self._lossless = True  # read by this step's apply, after the Trainer's block
        yield

    def zero_grad(self) -> None:
        # the model's gradients: the worker's optimizer is the inner one, over the accumulators
        self.worker.model.zero_grad(set_to_none=False)

    def apply(self) -> None:
        state = self.state
        grads = [p.grad for p in self.sync.parameters]
        state.inner_step(grads)
        if state.landing:  # with overlap: the last round, after its overlapped steps
            self._land()
        if state.due:
            sent = state.launch(grads, wait=self.sync.wait)
            with self.sync.uncompressed() if self._lossless else contextlib.nullcontext():
                self.sync.release(None if state.sent is None else sent)
            if state.landing:
                self._land()
        self._lossless = False

    def _land(self) -> None:
        from .guard import DivergenceError, all_finite

        state = self.state
        state.settle()
        if state.sent is None:  # the average is in param.grad
            average, finite = [p.grad for p in self.sync.parameters], self.gradients_finite()
        else:
            average, finite = state.sent, all_finite(state.sent)
        if not finite:  # alike on every worker
            raise DivergenceError(
                f"training diverged at outer round {state.rounds + 1}: the averaged "
                "pseudo-gradient is not finite"
            )
        state.land(average)

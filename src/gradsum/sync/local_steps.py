"""Local steps with an outer sync (DiLoCo): each worker takes ``h`` steps of its own optimizer
on its own batches, then the workers average the pseudo-gradient (start weights − local
weights) through the run's Session (any codec, any aggregator) and an outer Nesterov SGD applies
it to the start weights, which every worker then holds alike.

    --local-steps 'diloco(h=32,lr=0.7,momentum=0.9)'      # gradsum train, bench train
    --local-steps 'diloco(h=8,overlap=8)'                 # the round beside the next 8 steps
    --methods 'ddp,allreduce:thc+diloco(h=32)'            # bench tta, bench train
    LocalStepsSync(GradientSync(model, session, on_backward=False), "diloco(h=32)", inner)

The pseudo-gradient is kept exactly as the inner optimizer computes it: the inner optimizer
updates an accumulator ``acc`` that starts each round at zero, and the local weights are
``start + acc``, so the pseudo-gradient is ``−acc``, the sum of the inner updates, not the
difference of two rounded weights. With ``h=1``, an outer SGD at learning rate 1 without momentum
and an inner SGD whose learning rate is a power of two, a run is therefore bit for bit plain data
parallel training with the same codec and aggregator (``tests/train/test_local_steps.py``).

Split in two: :class:`OuterState` is the pure bookkeeping (start, accumulator, the inner and
outer optimizers), tested without a process group; :class:`LocalStepsSync` drives it over a
``GradientSync`` built without backward hooks, whose round it runs by hand: the same plan, keys,
steps, tensor descriptions (THC's per-tensor scales), PS shards, recovery and uncompressed
Session as a data-parallel step's, with the pseudo-gradient in ``param.grad``. A user's own
loop calls it after each backward; ``gradsum train`` through its Trainer (``LocalWorker``,
train/loop.py). The codec's error feedback lives in the Session's codec and so carries across
outer rounds; the inner optimizer's state stays on its worker. Evaluations see the start
weights, the model every worker holds alike (mid-round a worker's own weights have seen its
shard only), and ``close`` leaves them in the model.

``overlap=T`` hides the round behind compute: the next T inner steps run while it travels, from
the weights the round ended at, and it lands T steps late, those steps carried over onto the new
start (the eager update of overlapped DiLoCo). The start weights, what is evaluated, then lag the
local ones by a round; the sender's thread carries the round, and an all-reduce gets a process
group of its own beside the inner steps' loss agreement (train/aggregators.py).

``fragments=F`` streams the sync (Streaming DiLoCo): the model's tensors split into F fragments
of about equal size, contiguous in the model's order and made of whole gradient groups of the
sync's plan, and every h/F inner steps one of them, in turn, takes its outer round. Each tensor
still syncs every h steps, but a round carries 1/F of the model, so the link's peak load and the
round's length (what ``overlap`` must hide, now at most h/F steps) shrink F-fold. With F=1 it
is the whole-model round above, bit for bit.
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
    fragments: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.h, int) and self.h >= 1):
            raise ValueError(f"local steps: h={self.h} must be an integer >= 1")
        if not (isinstance(self.fragments, int) and self.fragments >= 1):
            raise ValueError(f"local steps: fragments={self.fragments} must be an integer >= 1")
        if self.h % self.fragments:
            raise ValueError(
                f"local steps: fragments={self.fragments} must divide h={self.h} (one "
                "fragment's round every h/fragments inner steps)"
            )
        every = self.h // self.fragments
        if not (isinstance(self.overlap, int) and 0 <= self.overlap <= every):
            if self.fragments > 1:
                raise ValueError(
                    f"local steps: overlap={self.overlap} must be an integer from 0 to "
                    f"h/fragments={every}: a fragment's round lands before the next one leaves"
                )
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


def split_fragments(groups: Sequence[Sequence[int]], sizes: Sequence[int],
                    count: int) -> list[list[int]]:  # fmt: skip
    """The tensors of ``count`` fragments: contiguous runs of the model's tensors (``sizes``:
    their element counts) of about equal size, each a union of whole ``groups`` (the sync's
    gradient groups, tensor indices; groups that share a tensor, a tensor cut across them,
    stay in one fragment). ValueError when the groups cannot be cut that many ways."""
    # pieces that cannot be cut: tensors joined by a group that holds them both
    owner = list(range(len(sizes)))

    def root(i: int) -> int:
        while owner[i] != i:
            owner[i] = owner[owner[i]]
            i = owner[i]
        return i

    for group in groups:
        for i in group[1:]:
            owner[root(i)] = root(group[0])
    pieces: dict[int, list[int]] = {}
    for i in range(len(sizes)):
        pieces.setdefault(root(i), []).append(i)
    ordered = sorted(pieces.values())  # by first tensor: the model's order
    # a piece that interleaves with the next (a group of tensors 0 and 2, another of 1) is joined
    # to it, so that every fragment is a contiguous run of tensors
    runs: list[list[int]] = []
    for piece in ordered:
        if runs and piece[0] < runs[-1][-1]:
            runs[-1] = sorted(runs[-1] + piece)
        else:
            runs.append(piece)
    if count > len(runs):
        raise ValueError(
            f"local steps: fragments={count}, but the sync's {len(groups)} gradient groups "
            f"split the model into only {len(runs)} separable runs of tensors: use "
            f"fragments <= {len(runs)} (a fragment is made of whole groups of the plan; "
            "--scheduler fusion with a smaller --fusion-elements makes more)"
        )
    total = sum(sizes)
    fragments: list[list[int]] = [[] for _ in range(count)]
    done, f = 0, 0
    for k, run in enumerate(runs):
        size, target = sum(sizes[i] for i in run), total * (f + 1) / count
        # close the fragment where its end lands nearest its share of the model, keeping a run
        # for each fragment still empty
        nearer = done + size - target >= target - done
        if fragments[f] and (nearer or len(runs) - k < count - f):
            f += 1
        fragments[f] += run
        done += size
    return fragments


class OuterState:
    """One worker's side of local steps, without communication.

    ``weights``: the model's parameters (the local weights, overwritten); ``inner``: builds the
    inner optimizer over the accumulators. Its weight decay is taken out of it (``_taken_decay``)
    and applied here to the weights, coupled into the gradient for SGD, decoupled at its
    learning rate for AdamW, as torch's optimizers apply it to their parameters. ``fragments``:
    the tensors of each fragment (``split_fragments``); by default ``spec.fragments`` runs of
    about equal size.

    A round is ``launch``-ed once ``due`` (its fragment's pseudo-gradient written out, their
    accumulators zeroed) and ``land``-ed with the workers' average. Without overlap it lands at
    once. With ``overlap`` τ > 0 the next τ inner steps run meanwhile from the weights the
    launched round ended at (``base``): this worker's own updates stand in for the average
    until it lands (the eager update of overlapped DiLoCo). Landing applies the outer step to
    the fragment's start weights, which then lag the local ones by the steps taken since the
    launch, and those steps carry over onto the new start. Start weights are what every worker
    holds alike. Fragment f's first round is due after (f + 1) h/F steps, and every h after.
    """

    def __init__(self, weights: Sequence[torch.Tensor], spec: LocalSteps,
                 inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 fragments: Sequence[Sequence[int]] | None = None) -> None:  # fmt: skip
        self.weights, self.spec = list(weights), spec
        if fragments is None:
            sizes = [w.numel() for w in self.weights]
            fragments = split_fragments([[i] for i in range(len(sizes))], sizes, spec.fragments)
        self.fragments = [list(f) for f in fragments]
        if len(self.fragments) != spec.fragments or sorted(
            i for f in self.fragments for i in f
        ) != list(range(len(self.weights))):
            raise ValueError(
                f"local steps: {len(self.fragments)} fragments given for fragments="
                f"{spec.fragments}; together they must hold every tensor once"
            )
        with torch.no_grad():
            self.start = [w.detach().clone() for w in self.weights]
            self.acc = [torch.zeros_like(w) for w in self.weights]
            # the round in flight's pseudo-gradient, then its average; what the inner steps
            # add to while it is in flight (overlap only)
            self.sent = [torch.zeros_like(w) for w in self.weights] if spec.overlap else None
            self._launched = [torch.zeros_like(w) for w in self.weights] if spec.overlap else None
        self.base = list(self.start)  # per tensor: its start, or where its round in flight began
        self.inner = inner(self.acc)
        self.weight_decay, self.decoupled_lr = _taken_decay(self.inner)
        momentum = spec.momentum
        # one outer optimizer per fragment: each steps when its fragment's round lands
        self.outers = [
            torch.optim.SGD(
                [self.start[i] for i in f], lr=spec.lr, momentum=momentum, nesterov=momentum > 0
            )
            for f in self.fragments
        ]
        every = spec.h // spec.fragments
        # inner steps since each fragment's last launch; fragment f is due after (f + 1) h/F
        self.since = [spec.h - (f + 1) * every for f in range(spec.fragments)]
        self.rounds = 0  # outer steps taken (rounds landed)
        self.flight: int | None = None  # the fragment whose round is launched and not landed
        self._wait: Callable[[], None] | None = None  # until the round in flight has arrived

    @property
    def in_flight(self) -> bool:
        return self.flight is not None

    @property
    def taken(self) -> int:
        """Inner steps since the last launch, of any fragment."""
        return min(self.since)

    @property
    def next_fragment(self) -> int:
        """The fragment whose round is due next."""
        return max(range(len(self.since)), key=lambda f: (self.since[f], -f))

    @property
    def due(self) -> bool:
        """Whether a fragment's inner steps are all taken: its outer sync is next."""
        return self.since[self.next_fragment] >= self.spec.h

    @property
    def landing(self) -> bool:
        """Whether the round in flight lands now: before the next inner step without overlap,
        after ``overlap`` inner steps with it."""
        return self.flight is not None and self.since[self.flight] >= self.spec.overlap

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
        self.since = [n + 1 for n in self.since]
        if self.sent is not None or not self.due:  # without overlap, landing sets them
            self._local_weights()

    @torch.no_grad()
    def launch(self, into: Sequence[torch.Tensor] | None = None,
               wait: Callable[[], None] | None = None) -> list[torch.Tensor]:  # fmt: skip
        """End the due fragment's round: write its pseudo-gradient (start − local, the negated
        sum of its inner updates) into its tensors' entries of ``into`` (one per tensor; with
        overlap: into ``sent``, which the round's average must overwrite), zero their
        accumulators and count a new round. ``wait``: blocks until the average has arrived
        (``settle`` calls it). Returns the tensors written into (one per tensor)."""
        if self.in_flight:
            raise RuntimeError("local steps: a round launched while the last is in flight")
        f = self.next_fragment
        mine = self.fragments[f]
        if self.sent is not None:
            into = self.sent
            for i in mine:
                self._launched[i].copy_(self.weights[i])
                self.base[i] = self._launched[i]
        for i in mine:
            torch.neg(self.acc[i], out=into[i])
            self.acc[i].zero_()
        self.since[f] = 0
        self.flight, self._wait = f, wait
        return list(into)

    def settle(self) -> None:
        """Wait until the round in flight's average has arrived (it lands later): what a
        checkpoint does first, so that no round is running while the state is read."""
        wait, self._wait = self._wait, None
        if wait is not None:
            wait()

    @torch.no_grad()
    def land(self, average: Sequence[torch.Tensor] | None = None) -> None:
        """Apply the workers' averaged pseudo-gradient (``average``, one per tensor, read at
        the landing fragment's; with overlap, ``sent``) to its start weights with its outer
        optimizer; the local weights become the new start plus the inner updates taken since
        the launch."""
        self.settle()
        if average is None:
            average = self.sent
        f, self.flight = self.flight, None
        mine = self.fragments[f]
        for i in mine:
            self.start[i].grad = average[i]
        self.outers[f].step()
        for i in mine:
            self.start[i].grad = None
            self.base[i] = self.start[i]
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
        return len(self.fragments) == 1 and self.since[0] == 0 and not self.in_flight

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
                 "inner": self.inner.state_dict(),
                 "outers": [outer.state_dict() for outer in self.outers],
                 "since": list(self.since), "rounds": self.rounds}  # fmt: skip
        if self.in_flight:  # arrived (settled) and not landed: it lands after the resume
            mine = self.fragments[self.flight]
            state["in_flight"] = {"fragment": self.flight,
                                  "base": [self._launched[i].clone() for i in mine],
                                  "average": [self.sent[i].clone() for i in mine]}  # fmt: skip
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.settle()
        since = state.get("since", [state.get("taken", 0)])
        if len(since) != len(self.fragments):
            raise ValueError(
                f"this checkpoint holds local steps of {len(since)} fragments: resume with "
                f"the same --local-steps fragments (not {len(self.fragments)})"
            )
        for mine, saved in ((self.start, state["start"]), (self.acc, state["acc"])):
            for tensor, value in zip(mine, saved, strict=True):
                tensor.copy_(value)
        self.inner.load_state_dict(state["inner"])
        for outer, saved in zip(self.outers, state.get("outers", [state.get("outer")]),
                                strict=True):  # fmt: skip
            outer.load_state_dict(saved)
        self.since, self.rounds = list(since), state["rounds"]
        flight = state.get("in_flight")
        if flight is not None and self.sent is None:
            raise ValueError(
                "this checkpoint holds an outer round in flight: resume with the same "
                "--local-steps overlap"
            )
        self.flight, self.base = None, list(self.start)
        if flight is not None:
            self.flight = flight.get("fragment", 0)
            mine = self.fragments[self.flight]
            for k, i in enumerate(mine):
                self._launched[i].copy_(flight["base"][k])
                self.sent[i].copy_(flight["average"][k])
                self.base[i] = self._launched[i]
        self._local_weights()


class LocalStepsSync:
    """Local steps over a model, from a training loop's own code::

        sync = GradientSync(model, session, on_backward=False)  # nothing sent during backward
        local = LocalStepsSync(sync, "diloco(h=4,lr=1,momentum=0,overlap=2)",
                               inner=lambda params: torch.optim.AdamW(params, lr=1e-3))
        for inputs, labels in batches:
            loss_fn(model(inputs), labels).backward()  # this worker's own gradient
            local.step()  # the inner step, and the outer round when one is due
            model.zero_grad()
        local.close()  # every worker's model ends at the same, synced weights

    ``inner`` builds the inner optimizer over the tensors it steps (the round's accumulators of
    inner updates, not the weights): its weight decay is taken out of it and applied to the
    weights (``OuterState``), coupled into the gradient, or decoupled at its learning rate for
    AdamW (or Adam with ``decoupled_weight_decay``). One decay for every parameter group
    (ValueError otherwise).

    ``step`` counts outer rounds (``sync.step``: a fragment's is one). Inside
    ``uncompressed()`` a round due at the next ``step`` goes through the Session's lossless
    codec. A fragment's round sends the sync's gradient groups that hold its tensors."""

    def __init__(self, sync, spec: LocalSteps | str,
                 inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:  # fmt: skip
        if getattr(sync, "on_backward", False):
            raise ValueError(
                "LocalStepsSync: this GradientSync sends every gradient during backward; "
                "build it with on_backward=False (local steps send only their outer rounds)"
            )
        spec = parse_local_steps(spec) if isinstance(spec, str) else spec
        self.sync = sync
        sizes = [p.numel() for p in sync.parameters]
        fragments = split_fragments(sync.groups, sizes, spec.fragments)
        self.state = OuterState(sync.parameters, spec, inner, fragments=fragments)
        self._lossless = False
        owner = {i: f for f, tensors in enumerate(self.state.fragments) for i in tensors}
        self._groups: list[list[int] | None] = [[] for _ in self.state.fragments]
        for g, tensors in enumerate(sync.groups):
            fragments = {owner[i] for i in tensors}
            if len(fragments) != 1:
                raise ValueError(f"gradient group {g} holds tensors of fragments {fragments}")
            self._groups[fragments.pop()].append(g)
        if len(self._groups) == 1:
            self._groups = [None]  # the whole model: every group, as a plain release sends

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self.state.inner

    @contextlib.contextmanager
    def uncompressed(self):
        self._lossless = True  # read by the next step, after the block
        yield

    def synced_weights(self):
        """A context: the start weights in the model inside it (``OuterState.synced_weights``)."""
        return self.state.synced_weights()

    def step(self) -> None:
        """The inner step on this worker's gradients (``param.grad``), then the round that is
        due: landing the one in flight, launching the next."""
        state = self.state
        for p in self.sync.parameters:
            if p.grad is None:  # a parameter this backward did not reach: its gradient is 0
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.sync.parameters]
        state.inner_step(grads)
        if state.landing:  # with overlap: the last round, after its overlapped steps
            self._land()
        if state.due:
            groups = self._groups[state.next_fragment]
            sent = state.launch(grads, wait=self.sync.wait)
            with self.sync.uncompressed() if self._lossless else contextlib.nullcontext():
                self.sync.release(None if state.sent is None else sent, groups=groups)
            if state.landing:
                self._land()
        self._lossless = False

    def _land(self) -> None:
        from ..train.guard import DivergenceError, all_finite

        state = self.state
        state.settle()
        # without overlap the average is in param.grad; only the landing fragment's tensors
        # hold averages (alike on every worker)
        average = [p.grad for p in self.sync.parameters] if state.sent is None else state.sent
        if not all_finite(average[i] for i in state.fragments[state.flight]):
            raise DivergenceError(
                f"training diverged at outer round {state.rounds + 1}: the averaged "
                "pseudo-gradient is not finite"
            )
        state.land(average)

    @torch.no_grad()
    def finish(self) -> None:
        """Let a round in flight arrive, and leave the start weights in the model: what every
        worker holds alike and what was evaluated (the inner steps since the last round, each
        worker's own, are dropped)."""
        self.state.settle()
        for w, s in zip(self.state.weights, self.state.start, strict=True):
            w.copy_(s)

    def close(self) -> None:
        """``finish``, then close the sync (its sender and hooks)."""
        try:
            self.finish()
        finally:
            self.sync.close()

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)


def _taken_decay(optimizer: torch.optim.Optimizer) -> tuple[float, float | None]:
    """The weight decay of ``optimizer``'s groups, set to 0 there, and the learning rate it is
    applied at where torch decouples it (None: coupled into the gradient)."""
    groups = optimizer.param_groups
    decays = {float(g.get("weight_decay", 0.0)) for g in groups}
    if len(decays) != 1:
        raise ValueError(
            f"local steps: the inner optimizer's parameter groups have weight decays "
            f"{sorted(decays)}; local steps apply one decay to every weight"
        )
    decay = decays.pop()
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        groups[0].get("decoupled_weight_decay", False))  # fmt: skip
    lrs = {float(g["lr"]) for g in groups}
    if decay and decoupled and len(lrs) != 1:
        raise ValueError(
            f"local steps: a decoupled weight decay over parameter groups of learning rates "
            f"{sorted(lrs)}; local steps apply it at one learning rate"
        )
    for g in groups:
        g["weight_decay"] = 0.0
    return decay, (lrs.pop() if decay and decoupled else None)

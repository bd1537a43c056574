"""A DDP communication hook for every codec and aggregator.

    state = GradsumHookState(Session(make_codec("thc", workers=world), AllReduceAggregator()))
    ddp.register_comm_hook(state, gradsum_hook)

DDP hands the hook each bucket (a flat buffer of gradient sums, not yet averaged). The hook queues
the bucket on the state's communication thread, which runs the Session's round on it (compress,
aggregate, decode) while backward continues, and completes the future with the average. Codec
state (error feedback, DGC) is keyed by (bucket index, bucket size), so DDP's bucket rebuild
after the first step starts new state instead of mixing two buckets' errors. ``start_step``
uncompressed steps come first, as in PyTorch's PowerSGD hook, on every aggregator, through the
Session's lossless one (``Session.uncompressed``). On a GPU the round runs on a communication
stream of its own after an event recorded behind backward's writes, and the future is CUDA-aware
(``sync/streams.py``).
"""

# No `from __future__ import annotations` here: DDP inspects the hook's annotations at runtime.
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..codecs.base import DeviceChecks
from .comm import CommunicationThread
from .session import Session
from .streams import CommStream, Handoff


@dataclass
class GradsumHookState:
    session: Session
    start_step: int = 0
    step: int = 0
    _thread: CommunicationThread | None = field(default=None, repr=False)
    # the step's device checks: every bucket's round adds to them, the last bucket reads them
    _checks: DeviceChecks = field(default_factory=DeviceChecks, repr=False)

    def submit(self, fn, handoff: Handoff | None = None) -> torch.futures.Future:
        if self._thread is None:
            self._thread = CommunicationThread("gradsum-ddp-hook")
        return self._thread.submit(fn, handoff)

    def session_for(self, step: int) -> Session:
        """The Session of ``step``: the lossless one during the warm-up (fp32 where the
        aggregator sums floats; block floating point, fp32's integer carrier, on a switch)."""
        return self.session if step >= self.start_step else self.session.uncompressed()

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the steps (the warm-up counts on them) and the codec's
        state. ``torch.save(state.state_dict(), path)``; the state itself holds live sockets
        and threads."""
        return {"step": self.step, "start_step": self.start_step,
                "session": self.session.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.step, self.start_step = state["step"], state["start_step"]
        self.session.load_state_dict(state["session"])

    def __reduce__(self):
        raise TypeError(
            "a GradsumHookState holds a live Session (sockets, a thread) and is not pickled; "
            "save state.state_dict() and restore it with load_state_dict()"
        )

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None


def gradsum_hook(
    state: GradsumHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    step = state.step
    last = bucket.is_last()
    if last:
        state.step += 1
    checks = state._checks
    key = ("ddp-bucket", bucket.index(), buffer.numel())
    session = state.session_for(step)
    session.describe(key, [tuple(g.shape) for g in bucket.gradients()])

    def run() -> torch.Tensor:
        with checks.deferring():
            average = session.synchronize(buffer.reshape(-1), key=key, step=step)
        if last:  # the step's one read of its device checks
            checks.raise_if_failed()
        return buffer.copy_(average.view_as(buffer))

    # On a GPU: the round runs on the device's communication stream once backward's writes to
    # the bucket are done, and the future is the device's (see sync/streams.py).
    return state.submit(run, CommStream.of(buffer.device).handoff([buffer])).then(_unwrapped)


def _unwrapped(future: torch.futures.Future) -> torch.Tensor:
    """The round's average, or its error raised again: DDP reads a Python future's exception
    as a value ("Unable to cast ... to Tensor"), while one raised in a callback reaches
    backward's caller with its type and message."""
    return future.value()

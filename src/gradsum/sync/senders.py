"""How a released gradient group travels: whole through one aggregator, or part by part to shards.

Both senders take groups in the order ``GradientSync`` releases them (the plan's send order,
identical on every worker) and return a future with the group's average.

* :class:`SerialSender` — one FIFO thread; each group is one ``Session.synchronize`` call.
  All-reduce, the switch, or a PS that spreads every tensor over all its servers.
* :class:`ShardSender` — a plan's shard placement: each part of a group goes to its own shard.
  What is in flight is decided by :class:`~gradsum.schedule.dispatch.SendWindow`, the state
  machine the simulator runs too: groups admitted in release order within the plan's credit
  window (``None``: one group at a time; a group's bytes count until its last part is back),
  every part of an admitted group in flight at once on its shard's stream, one part per stream
  at a time in admission order, so every shard sees the parts in the same order on every worker
  and interleaved parts (started from part ``worker mod len(parts)``) cannot deadlock. A thread
  per shard stream is no GIL fight: the transfers' system calls run in the native pump with the
  GIL released (one event loop driving a job spread over all shards instead measured half the
  samples/s in the testbed).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ..codecs.base import DeviceChecks
from ..schedule.dispatch import SendWindow
from ..schedule.plan import Plan
from .comm import CommunicationThread
from .layout import cut_shapes
from .session import Session
from .streams import CommStream


class MessageCost:
    """An injected per-message cost on a worker's *one* communication thread: ``charge()``
    holds one lock for ``seconds``, so the charges of all of a worker's streams queue behind
    each other as the simulator's ``alpha_worker`` does (a send, and the receipt of its answer,
    each pay it). A real delay on the path, for measuring schedules where start-ups dominate."""

    def __init__(self, seconds: float = 0.0) -> None:
        if seconds < 0:
            raise ValueError(f"a per-message delay must be >= 0 s, got {seconds}")
        self.seconds = seconds
        self._thread = threading.Lock()

    def charge(self) -> None:
        if self.seconds:
            with self._thread:
                time.sleep(self.seconds)


class SerialSender:
    """Sends each group whole, through ``session`` (``use`` swaps it for the groups submitted
    after: an uncompressed step's)."""

    def __init__(self, session: Session, *, message_delay: float = 0.0):
        self.session = session
        self._message = MessageCost(message_delay)
        self._thread = CommunicationThread("gradsum-sync")

    def submit(self, group: int, flat: torch.Tensor, step: int,
               shapes: Sequence[tuple[int, ...]] = (),
               checks: DeviceChecks | None = None) -> torch.futures.Future:  # fmt: skip
        """``shapes``: the tensors ``flat`` holds, for codecs that work per tensor; ``checks``:
        the step's device checks, read by the caller once the step is done."""
        session = self.session
        key = ("group", group, flat.numel())
        if shapes:
            session.describe(key, shapes)
        handoff = CommStream.of(flat.device).handoff([flat])  # on the producer's stream

        def run() -> torch.Tensor:
            self._message.charge()
            with _deferring(checks):
                out = session.synchronize(flat, key=key, step=step)
            self._message.charge()
            return out

        return self._thread.submit(run, handoff)

    def submit_many(self, groups: Sequence[int], flats: Sequence[torch.Tensor], step: int,
                    shapes: Sequence[Sequence[tuple[int, ...]]],
                    checks: DeviceChecks | None = None) -> list[torch.futures.Future]:  # fmt: skip
        """Several groups as one job (``Session.synchronize_many``: one batched round where the
        codec batches a step), a future per group. Only for groups every worker releases
        together whatever the timing (``GradientSync.release``)."""
        session = self.session
        keys = [("group", g, flat.numel()) for g, flat in zip(groups, flats, strict=True)]
        for key, tensors in zip(keys, shapes, strict=True):
            if tensors:
                session.describe(key, tensors)
        handoff = CommStream.of(flats[0].device).handoff(list(flats))
        results = [handoff.stream.future() for _ in flats]

        def run() -> None:
            for _ in flats:
                self._message.charge()
            with _deferring(checks):
                averages = session.synchronize_many(list(flats), keys=keys, step=step)
            for _ in flats:
                self._message.charge()
            for result, average in zip(results, averages, strict=True):
                result.set_result(average)  # on the communication stream, as ``submit``'s

        def failed(batch: torch.futures.Future) -> None:
            try:
                batch.wait()
            except BaseException as error:  # every group's future carries the batch's error
                for result in results:
                    if not result.done():
                        result.set_exception(error)

        self._thread.submit(run, handoff).add_done_callback(failed)
        return results

    def close(self) -> None:
        self._thread.close()


class ShardSender:
    """Sends plan groups part by part; ``session.part(shard, tensor, ...)`` runs one part's
    codec round on its shard."""

    def __init__(self, session: Session, plan: Plan, *, timeout: float,
                 message_delay: float = 0.0):  # fmt: skip
        needed = 1 + max(p.shard for g in plan.groups for p in g.parts)
        if needed > session.shards:
            raise ValueError(
                f"the {plan.policy} plan places parts on {needed} shards but only "
                f"{session.shards} parameter servers are given (--servers)"
            )
        self.session, self.plan, self.timeout = session, plan, timeout
        self._message = MessageCost(message_delay)
        self._window = SendWindow(plan, session.rank)
        self._lock = threading.Lock()  # the window and the groups in flight
        self._groups: dict[int, _GroupInFlight] = {}
        self._streams = [CommunicationThread(f"gradsum-shard{s}") for s in range(needed)]

    def submit(self, group: int, flat: torch.Tensor, step: int,
               shapes: Sequence[tuple[int, ...]] = (),
               checks: DeviceChecks | None = None) -> torch.futures.Future:  # fmt: skip
        """``shapes``: the tensors ``flat`` holds, for codecs that work per tensor; ``checks``:
        the step's device checks, read by the caller once the step is done."""
        handoff = CommStream.of(flat.device).handoff([flat])  # on the producer's stream
        out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        state = _GroupInFlight(self.session, flat, out, step, handoff, shapes, checks)
        with self._lock:
            self._groups[group] = state
            starts = self._window.release(group)
        self._start(starts)
        return state.result

    def _start(self, starts: list[tuple[int, int]]) -> None:
        for g, k in starts:
            part = self.plan.groups[g].parts[k]
            run = self._part_job(g, k)
            future = self._streams[part.shard].submit(run, self._groups[g].handoff)
            future.add_done_callback(lambda done, g=g, k=k: self._part_back(g, k, done))

    def _part_job(self, index: int, k: int) -> Callable[[], None]:
        group = self.plan.groups[index]
        part = group.parts[k]
        state = self._groups[index]
        a, b = part.start - group.start, part.stop - group.start
        key = ("part", index, k)
        session = state.session
        if state.shapes:
            session.describe(key, cut_shapes(state.shapes, a, b))

        def run() -> None:
            self._message.charge()
            with _deferring(state.checks):
                state.out[a:b] = session.part(part.shard, state.flat[a:b], key=key,
                                              step=state.step)  # fmt: skip
            self._message.charge()

        return run

    def _part_back(self, g: int, k: int, future: torch.futures.Future) -> None:
        error = None
        try:
            future.wait()
        except BaseException as caught:
            error = caught
        with self._lock:
            starts, done = self._window.part_back(g, k)
            state = self._groups[g]
            state.error = state.error or error
            if done:
                del self._groups[g]
        self._start(starts)
        if done:
            if state.error is None:
                # every part ran on this stream: its events cover them
                with state.handoff.stream.running(None):
                    state.result.set_result(state.out)
            else:
                state.result.set_exception(state.error)

    def close(self) -> None:
        for stream in self._streams:
            stream.close()


def _deferring(checks: DeviceChecks | None) -> contextlib.AbstractContextManager:
    """A round's device checks into the step's (read once by ``GradientSync.wait``)."""
    return contextlib.nullcontext() if checks is None else checks.deferring()


class _GroupInFlight:
    """A submitted group: the Session it goes through, its gradients, where its average goes,
    its step, its hand-off from the producer's stream, its tensors' shapes, its device checks
    and its first error."""

    def __init__(self, session: Session, flat: torch.Tensor, out: torch.Tensor, step: int,
                 handoff, shapes: Sequence[tuple[int, ...]],
                 checks: DeviceChecks | None):  # fmt: skip
        self.session = session
        self.flat, self.out, self.step = flat, out, step
        self.handoff, self.shapes, self.checks = handoff, shapes, checks
        self.result: torch.futures.Future = handoff.stream.future()
        self.error: BaseException | None = None

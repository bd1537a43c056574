"""How a released gradient group travels: whole through one aggregator, or part by part to shards.

Both senders take groups in the order ``GradientSync`` releases them (the plan's send order,
identical on every worker) and return a future with the group's average.

* :class:`SerialSender` — one FIFO thread; each group is one ``aggregator.synchronize`` call.
  All-reduce, the switch, or a PS that spreads every tensor over all its servers.
* :class:`ShardSender` — a plan's shard placement: each part of a group goes to its own shard.
  One FIFO stream per shard, so every shard sees its parts in the same order on every worker
  (what a shard's job needs), while different shards proceed independently. A dispatcher admits
  groups within the plan's credit window (``None``: one group at a time).

  Interleaving, concretely: a part completes only once every worker has contributed to it, so a
  worker cannot finish its parts one after another in a *rotated* order (worker 0 would wait on
  shard 0 for worker 1, which waits on shard 1 for worker 0). Interleaved parts are therefore all
  put in flight at once, starting with part ``worker mod len(parts)``, each on its shard's stream;
  every shard then receives from all workers at a fraction of their rate instead of all of them at
  once. Non-interleaved parts go in the plan's part order on every worker, so each is a
  synchronised incast at its shard; with a credit window they are all in flight at once (BytePS
  pushes a tensor's partitions asynchronously; the simulator's window does the same), without one
  they go one after another (one push at a time). A thread per shard stream is no GIL fight: the
  transfers' system calls run in the native pump with the GIL released (one event loop driving
  a job spread over all shards instead measured half the samples/s in the testbed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import torch

from ..codecs import Codec
from ..codecs.base import DeviceChecks
from ..schedule.plan import Plan
from .aggregator import Aggregator
from .comm import CommunicationThread
from .layout import cut_shapes
from .streams import CommStream


class SerialSender:
    def __init__(self, aggregator: Aggregator, codec: Codec, *, seed: int, partition_elements):
        self.aggregator, self.codec = aggregator, codec
        self.seed, self.partition_elements = seed, partition_elements
        self._thread = CommunicationThread("gradsum-sync")

    def submit(self, group: int, flat: torch.Tensor, step: int,
               shapes: Sequence[tuple[int, ...]] = (),
               checks: DeviceChecks | None = None) -> torch.futures.Future:  # fmt: skip
        """``shapes``: the tensors ``flat`` holds, for codecs that work per tensor; ``checks``:
        the step's device checks, read by the caller once the step is done."""
        key = ("group", group, flat.numel())
        if shapes:
            self.codec.describe(key, shapes)
        handoff = CommStream.of(flat.device).handoff([flat])  # on the producer's stream

        def run() -> torch.Tensor:
            with _deferring(checks):
                return self.aggregator.synchronize(
                    flat,
                    self.codec,
                    key=key,
                    step=step,
                    seed=self.seed,
                    partition_elements=self.partition_elements,
                )

        return self._thread.submit(run, handoff)

    def close(self) -> None:
        self._thread.close()


class ShardSender:
    """Sends plan groups part by part; ``shards.synchronize_part(shard, tensor, codec, ...)``
    runs one part's codec round on its shard."""

    def __init__(self, shards, plan: Plan, worker: int, *, timeout: float, codec: Codec,
                 seed: int = 0, partition_elements: int | None = None):  # fmt: skip
        needed = 1 + max(p.shard for g in plan.groups for p in g.parts)
        if needed > shards.num_shards:
            raise ValueError(
                f"the {plan.policy} plan places parts on {needed} shards but only "
                f"{shards.num_shards} parameter servers are given (--servers)"
            )
        self.shards, self.plan, self.worker, self.timeout = shards, plan, worker, timeout
        self.codec, self.seed, self.partition_elements = codec, seed, partition_elements
        self.window = plan.credit_bytes or 0  # 0: one group in flight at a time
        self._streams = [CommunicationThread(f"gradsum-shard{s}") for s in range(needed)]
        self._dispatcher = CommunicationThread("gradsum-dispatch")
        self._credit = threading.Condition()
        self._in_flight = 0

    def submit(self, group: int, flat: torch.Tensor, step: int,
               shapes: Sequence[tuple[int, ...]] = (),
               checks: DeviceChecks | None = None) -> torch.futures.Future:  # fmt: skip
        """``shapes``: the tensors ``flat`` holds, for codecs that work per tensor; ``checks``:
        the step's device checks, read by the caller once the step is done."""
        handoff = CommStream.of(flat.device).handoff([flat])  # on the producer's stream
        result = handoff.stream.future()

        def dispatch() -> None:
            try:
                self._dispatch(group, flat, step, result, handoff, shapes, checks)
            except BaseException as error:
                result.set_exception(error)

        self._dispatcher.submit(dispatch)
        return result

    def _dispatch(self, index: int, flat: torch.Tensor, step: int,
                  result: torch.futures.Future, handoff, shapes, checks) -> None:  # fmt: skip
        group = self.plan.groups[index]
        nbytes = 4 * flat.numel()
        self._acquire(nbytes, index)
        out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        parts = self.plan.part_order(group, self.worker)
        finished = _Countdown(
            len(parts), lambda error: self._finish(nbytes, out, result, error, handoff.stream)
        )
        previous: threading.Event | None = None
        for k, part in enumerate(parts):
            done = threading.Event()
            gate = None if self.plan.interleave or self.window else previous
            run = self._part_job(index, k, part, flat, out, group.start, gate, step, shapes,
                                 checks)  # fmt: skip
            future = self._streams[part.shard].submit(run, handoff)
            future.add_done_callback(_signal(done, finished))
            previous = done

    def _part_job(self, index, k, part, flat, out, base, gate, step, shapes,
                  checks) -> Callable[[], None]:  # fmt: skip
        a, b = part.start - base, part.stop - base
        key = ("part", index, k)
        if shapes:
            self.codec.describe(key, cut_shapes(shapes, a, b))

        def run() -> None:
            if gate is not None and not gate.wait(self.timeout):
                raise TimeoutError(
                    f"part {k} of group {index} waited {self.timeout:.0f} s for part {k - 1}"
                )
            with _deferring(checks):
                out[a:b] = self.shards.synchronize_part(
                    part.shard, flat[a:b], self.codec, key=key, step=step, seed=self.seed,
                    partition_elements=self.partition_elements,
                )  # fmt: skip

        return run

    def _acquire(self, nbytes: int, index: int) -> None:
        with self._credit:
            admitted = self._credit.wait_for(
                lambda: self._in_flight == 0 or self._in_flight + nbytes <= self.window,
                self.timeout,
            )
            if not admitted:
                raise TimeoutError(
                    f"group {index} waited {self.timeout:.0f} s for room in the credit window "
                    f"({self._in_flight:,} of {self.window:,} bytes in flight)"
                )
            self._in_flight += nbytes

    def _finish(self, nbytes, out, result, error, stream: CommStream) -> None:
        with self._credit:
            self._in_flight -= nbytes
            self._credit.notify_all()
        if error is None:
            with stream.running(None):  # every part ran on this stream: its events cover them
                result.set_result(out)
        else:
            result.set_exception(error)

    def close(self) -> None:
        self._dispatcher.close()
        for stream in self._streams:
            stream.close()


def _deferring(checks: DeviceChecks | None) -> contextlib.AbstractContextManager:
    """A round's device checks into the step's (read once by ``GradientSync.wait``)."""
    return contextlib.nullcontext() if checks is None else checks.deferring()


class _Countdown:
    """Calls ``on_done(first error or None)`` once ``count`` parts have finished."""

    def __init__(self, count: int, on_done: Callable[[BaseException | None], None]):
        self._left, self._error, self._on_done = count, None, on_done
        self._lock = threading.Lock()

    def part_done(self, error: BaseException | None) -> None:
        with self._lock:
            self._left -= 1
            self._error = self._error or error
            last = self._left == 0
        if last:
            self._on_done(self._error)


def _signal(done: threading.Event, finished: _Countdown):
    def callback(future: torch.futures.Future) -> None:
        error = None
        try:
            future.wait()
        except BaseException as caught:
            error = caught
        done.set()
        finished.part_done(error)

    return callback

"""A FIFO communication thread: aggregation overlaps the rest of backward, in a fixed order.

Every worker submits the same jobs in the same order, and one thread runs them one at a time, so
the collectives (or packets) of different groups can never interleave differently on two
workers. Torch and socket calls release the GIL, so backward keeps computing meanwhile.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from .streams import Handoff

_STOP = object()


class CommunicationThread:
    def __init__(self, name: str = "gradsum-comm"):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], handoff: Handoff | None = None) -> torch.futures.Future:
        """Run ``fn`` after every job submitted before; its result or error lands in the future.
        ``handoff``: tensors from another stream that ``fn`` uses; it then runs on their
        device's communication stream and the future is that device's (``streams.py``)."""
        if not self._thread.is_alive():
            raise RuntimeError("the communication thread has stopped")
        future = torch.futures.Future() if handoff is None else handoff.stream.future()
        self._jobs.put((fn, future, handoff))
        return future

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread once the jobs submitted before are done, waiting ``timeout`` seconds
        at most. A run waits for every job it needs before it closes (the training loop waits
        each round before its step), so a job still running here belongs to a run that is
        failing, and is most likely a round waiting on a peer that is gone: the caller goes on
        to tear its jobs down and exit rather than wait for it (the thread is a daemon)."""
        self._jobs.put(_STOP)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, future, handoff = job
            try:
                if handoff is None:
                    future.set_result(fn())
                else:
                    with handoff.stream.running(handoff):
                        future.set_result(fn())  # inside the stream: its events are the result's
            except BaseException as error:  # delivered to whoever waits on the future
                future.set_exception(error)


def wait_all(futures: list[torch.futures.Future], timeout: float, what: str) -> list[Any]:
    """Wait for every future, failing with a message that names what was awaited."""
    done = threading.Event()
    remaining = [len(futures)]
    lock = threading.Lock()

    def count(_: torch.futures.Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

    if not futures:
        return []
    for future in futures:
        future.add_done_callback(count)
    if not done.wait(timeout):
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
    return [future.wait() for future in futures]

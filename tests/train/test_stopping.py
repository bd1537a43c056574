"""A failing run stops at once: the launcher gives its surviving workers one 5 s deadline
together, and a worker's communication thread does not hold its exit for a round that waits
on a peer that is gone. (A worker killed under a switch: its two survivors took 10 s to go, 5 s
each, while each waited 10 s for its round in flight.)"""

import threading

from gradsum.sync.comm import CommunicationThread
from gradsum.train import launch


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Stubborn:
    """A worker process that ignores SIGTERM: ``join`` waits out its timeout on the clock."""

    def __init__(self, clock: _Clock, log: list) -> None:
        self.clock, self.log, self.alive = clock, log, True

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.log.append(("terminate", self.clock.now))

    def join(self, timeout: float | None = None) -> None:
        if self.alive and timeout:
            self.clock.now += timeout

    def kill(self) -> None:
        self.log.append(("kill", self.clock.now))
        self.alive = False


def test_workers_that_ignore_sigterm_are_killed_5_s_after_it_all_of_them(monkeypatch):
    clock, log = _Clock(), []
    monkeypatch.setattr(launch.time, "monotonic", clock.monotonic)
    workers = [_Stubborn(clock, log) for _ in range(3)]
    launch._stop(workers)
    assert log == [("terminate", 0.0)] * 3 + [("kill", 5.0)] * 3  # not at 5, 10 and 15 s


def test_closing_does_not_wait_out_a_round_that_waits_on_a_peer_that_is_gone():
    thread = CommunicationThread("test-comm")
    peer_answers = threading.Event()  # never set: the peer is gone
    started = threading.Event()

    def round_waiting_on_the_peer() -> None:
        started.set()
        peer_answers.wait()

    thread.submit(round_waiting_on_the_peer)
    started.wait()
    waits = []
    join = thread._thread.join
    thread._thread.join = lambda timeout=None: (waits.append(timeout), join(0))
    thread.close()
    assert waits == [1.0]  # bounded: the worker goes on to tear its jobs down and exit
    assert not peer_answers.is_set()
    peer_answers.set()  # let the daemon thread end

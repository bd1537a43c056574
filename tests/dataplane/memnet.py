"""An in-memory lossy network with a virtual clock: the data plane's test shell.

Worker functions run in threads and call ``run(transfers)`` (a ``Collective``'s transport); the
network advances virtual time only when every worker is waiting, so runs are deterministic for a
seed. Packets can be dropped, duplicated and delayed (reordered) independently per direction.
"""

from __future__ import annotations

import heapq
import random
import threading
from dataclasses import dataclass, field

from gradsum.dataplane import DataPlane, Kind, parse_header
from gradsum.dataplane.actions import Send
from gradsum.dataplane.packet import HEADER_SIZE


@dataclass
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    jitter: float = 0.0  # extra uniform delay in seconds: reorders packets
    latency: float = 1e-4


@dataclass
class _Worker:
    address: tuple
    transfers: list = field(default_factory=list)
    work: object = None  # a streaming round's work (dataplane.collective.StreamedSum)
    waiting: bool = False
    finished: bool = False
    error: BaseException | None = None
    wake: threading.Event = field(default_factory=threading.Event)


class MemoryNetwork:
    def __init__(self, seed: int = 0, up: Faults | None = None, down: Faults | None = None):
        self.random = random.Random(seed)
        self.up, self.down = up or Faults(), down or Faults()
        self.now = 0.0
        self.aggregators: dict[tuple, DataPlane] = {}
        self.workers: dict[tuple, _Worker] = {}
        self.events: list = []
        self._sequence = 0
        self._lock = threading.Condition()
        self.delivered = 0

    def add_aggregator(self, address: tuple, aggregator: DataPlane) -> None:
        self.aggregators[address] = aggregator

    # -- a worker's transport ---------------------------------------------------------------
    def transport(self, address: tuple):
        worker = self.workers.setdefault(address, _Worker(address))

        def run(pairs, work=None):
            with self._lock:
                worker.transfers = [t for _, t in pairs]
                worker.work = work
                for job, transfer in pairs:
                    transfer.peer = job.address
                    for chunk in transfer.start(self.now):
                        self._send_data(worker, job.address, transfer, chunk)
                worker.wake.clear()
                worker.waiting = True
                self._lock.notify_all()
            worker.wake.wait(timeout=60)
            if worker.error is not None:
                error, worker.error = worker.error, None
                raise error
            if worker.waiting:
                raise TimeoutError("memory network: worker was never woken")

        return run

    def run_workers(self, functions: dict[tuple, callable], timeout: float = 120.0) -> dict:
        """Run ``functions[address]()`` for every worker; return their results."""
        results, errors = {}, {}

        def body(address, function):
            try:
                results[address] = function()
            except BaseException as error:  # reported to the test below
                errors[address] = error
            finally:
                with self._lock:
                    self.workers[address].finished = True
                    self._lock.notify_all()

        for address in functions:
            self.workers.setdefault(address, _Worker(address))
        threads = [
            threading.Thread(target=body, args=item, daemon=True) for item in functions.items()
        ]
        for thread in threads:
            thread.start()
        self._drive(timeout)
        for thread in threads:
            thread.join(timeout=10)
        if errors:
            raise next(iter(errors.values()))
        return results

    # -- the simulation loop ----------------------------------------------------------------
    def _drive(self, timeout: float) -> None:
        while True:
            with self._lock:
                quiet = self._lock.wait_for(self._quiescent, timeout=timeout)
                if not quiet:
                    raise TimeoutError("memory network: workers neither wait nor finish")
                if all(w.finished for w in self.workers.values()):
                    return
                self._step()

    def _quiescent(self) -> bool:
        return all(w.waiting or w.finished for w in self.workers.values())

    def _step(self) -> None:
        """Advance to the next event (a packet or a timer) and handle everything due then."""
        times = [self.events[0][0]] if self.events else []
        for worker in self._active():
            times += [d for t in worker.transfers if (d := t.next_deadline()) is not None]
        times += [d for a in self.aggregators.values() if (d := a.next_deadline()) is not None]
        if any(w.work is not None and w.work.pending for w in self._active()):
            times.append(self.now)  # a streaming worker has codec work to do now
        if not times:
            raise RuntimeError("memory network: deadlock, nothing in flight and no timer")
        self.now = max(self.now, min(times))
        while self.events and self.events[0][0] <= self.now:
            _, _, destination, source, data = heapq.heappop(self.events)
            self._deliver(destination, source, data)
        for address, aggregator in self.aggregators.items():
            self._perform(address, aggregator.on_tick(self.now))
        for worker in self._active():
            self._expire(worker)
            self._work(worker)

    def _active(self):
        return [w for w in self.workers.values() if w.waiting]

    def _deliver(self, destination, source, data: bytes) -> None:
        self.delivered += 1
        if destination in self.aggregators:
            actions = self.aggregators[destination].on_datagram(memoryview(data), source, self.now)
            self._perform(destination, actions)
            return
        worker = self.workers.get(destination)
        if worker is None or not worker.waiting:
            return
        header = parse_header(data)
        try:
            for transfer in worker.transfers:
                if transfer.peer != source:  # each shard's results come from its own aggregator
                    continue
                if header.kind is Kind.STALE:
                    transfer.on_stale(header)
                    continue
                target = transfer.destination(header, len(data) - HEADER_SIZE)
                if target is None:
                    continue
                target[: len(data) - HEADER_SIZE] = data[HEADER_SIZE:]
                for chunk in transfer.on_result(header, len(data) - HEADER_SIZE, self.now):
                    self._send_data(worker, source, transfer, chunk)
        except Exception as error:
            self._finish(worker, error)
            return
        if all(t.done for t in worker.transfers):
            self._finish(worker, None)

    def _expire(self, worker: _Worker) -> None:
        try:
            for transfer, address in zip(worker.transfers, self._peers(worker), strict=True):
                for chunk in transfer.expired(self.now):
                    self._send_data(worker, address, transfer, chunk)
        except Exception as error:
            self._finish(worker, error)

    def _work(self, worker: _Worker) -> None:
        """One step of a streaming round's codec work, between batches of packets."""
        if worker.work is None or not worker.work.pending or not worker.waiting:
            return
        try:
            for transfer, chunk in worker.work.step(self.now):
                self._send_data(worker, transfer.peer, transfer, chunk)
        except Exception as error:
            self._finish(worker, error)

    def _peers(self, worker):
        return [t.peer for t in worker.transfers]

    def _finish(self, worker: _Worker, error) -> None:
        worker.error = error
        worker.waiting = False
        worker.wake.set()

    def _send_data(self, worker: _Worker, destination, transfer, chunk: int) -> None:
        transfer.peer = destination
        header, payload = transfer.packet(chunk)
        self._post(destination, worker.address, header + bytes(payload), self.up)

    def _perform(self, source, actions) -> None:
        for action in actions:
            if isinstance(action, Send):
                data = action.header + bytes(action.payload)
                for destination in action.destinations:
                    faults = self.up if destination in self.aggregators else self.down
                    self._post(destination, source, data, faults)

    def _post(self, destination, source, data: bytes, faults: Faults) -> None:
        copies = 0 if self.random.random() < faults.drop else 1
        if copies and self.random.random() < faults.duplicate:
            copies = 2
        for _ in range(copies):
            delay = faults.latency + self.random.random() * faults.jitter
            self._sequence += 1
            heapq.heappush(
                self.events, (self.now + delay, self._sequence, destination, source, data)
            )

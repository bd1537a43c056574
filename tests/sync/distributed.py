"""Run a function on n real processes joined in a Gloo group (for tests).

Starting the processes costs a second or more a call (they come from ``gradsum.processes``, as
local workers do), so the group is kept: the
next call of the same size runs on the same processes, in the same group, one function after
another, each with the caller's environment of that moment. A call that fails or times out
ends the group (its state is unknown) and the next one starts afresh; ``fresh=True`` gives a
call processes of its own (a function that kills a worker, or must see a new process).
"""

from __future__ import annotations

import atexit
import os
import queue
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from gradsum import processes

RENDEZVOUS_TIMEOUT = timedelta(seconds=60)


def rendezvous_store() -> dist.TCPStore:
    """The group's store, served from this process on a port the kernel chose and still holds:
    the workers connect to it, so no port is released and taken again by someone else."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=RENDEZVOUS_TIMEOUT)  # fmt: skip


def _join_group(rank: int, world: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=RENDEZVOUS_TIMEOUT)  # fmt: skip


def _run(rank, world, fn, args, environ):
    """``fn`` under the caller's environment, which is restored after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        return fn(rank, world, *args)
    except BaseException:
        return RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _serve(rank, world, port, tasks, results):
    """A kept group's worker: functions from ``tasks`` until None."""
    try:
        _join_group(rank, world, port)
    except BaseException:
        results.put((rank, RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")))
        return
    try:
        while (task := tasks.get()) is not None:
            results.put((rank, _run(rank, world, *task)))
    finally:
        dist.destroy_process_group()


class _Group:
    """``world`` processes in one Gloo group, kept between calls."""

    def __init__(self, world: int):
        context = processes.context()
        self.world = world
        self.store = rendezvous_store()  # held while the group lives
        self.tasks = [context.Queue() for _ in range(world)]
        self.results = context.Queue()
        self.processes = [
            processes.process(context, _serve,
                              (rank, world, self.store.port, self.tasks[rank], self.results),
                              daemon=True)
            for rank in range(world)
        ]  # fmt: skip
        for process in self.processes:
            processes.start(process)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def run(self, fn, args, timeout: float) -> list:
        environ = dict(os.environ)
        for tasks in self.tasks:
            tasks.put((fn, args, environ))
        collected: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(collected) < self.world:
            try:
                left = deadline - time.monotonic()
                rank, value = self.results.get(timeout=max(0.0, min(1.0, left)))
                collected[rank] = value
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.world - len(collected)} distributed test workers did not "
                        f"finish {fn.__name__} within {timeout} s"
                    ) from None
                if not self.alive():
                    raise RuntimeError(
                        f"a distributed test worker died running {fn.__name__}"
                    ) from None
        return [collected[rank] for rank in range(self.world)]

    def close(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        for process in self.processes:
            process.join(10)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(10)


_kept: _Group | None = None  # at most one: a group per size would hold several torch imports


@atexit.register
def _close_kept() -> None:
    global _kept
    if _kept is not None:
        _kept.close()
        _kept = None


def run_distributed(fn, world: int, *args, timeout: float = 120.0, fresh: bool = False):
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results by rank."""
    global _kept
    if fresh:
        return _results(_run_fresh(fn, world, args, timeout))
    if _kept is not None and (_kept.world != world or not _kept.alive()):
        _close_kept()
    if _kept is None:
        _kept = _Group(world)
    try:
        values = _kept.run(fn, args, timeout)
    except BaseException:
        _kept.kill()
        _kept = None
        raise
    if any(isinstance(v, BaseException) for v in values):
        _kept.kill()  # a failed collective may have left the group unusable
        _kept = None
    return _results(values)


def _entry(rank, world, port, fn, args, results):
    try:
        _join_group(rank, world, port)
        results[rank] = fn(rank, world, *args)
    except BaseException:
        results[rank] = RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_fresh(fn, world: int, args, timeout: float) -> list:
    """Processes of this call's own; a worker that died gives None."""
    context = processes.context()
    store = rendezvous_store()
    with context.Manager() as manager:
        results = manager.dict()
        started = [
            processes.process(context, _entry, (rank, world, store.port, fn, args, results))
            for rank in range(world)
        ]
        for process in started:
            processes.start(process)
        for process in started:
            process.join(timeout)
        hung = [p for p in started if p.is_alive()]
        for process in hung:
            process.kill()
        if hung:
            raise TimeoutError(
                f"{len(hung)} distributed test workers did not finish within {timeout} s"
            )
        return [results.get(rank) for rank in range(world)]


def _results(values: list) -> list:
    for value in values:
        if isinstance(value, BaseException):
            raise value
    return values

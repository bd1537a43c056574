"""Run a function on n real processes joined in a Gloo group (for tests)."""

from __future__ import annotations

import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

RENDEZVOUS_TIMEOUT = timedelta(seconds=60)


def rendezvous_store() -> dist.TCPStore:
    """The group's store, served from this process on a port the kernel chose and still holds:
    the workers connect to it, so no port is released and taken again by someone else."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=RENDEZVOUS_TIMEOUT)  # fmt: skip


def _entry(rank, world, port, fn, args, results):
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=RENDEZVOUS_TIMEOUT)  # fmt: skip
        results[rank] = fn(rank, world, *args)
    except BaseException:
        results[rank] = RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = 120.0):
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results by rank."""
    context = mp.get_context("spawn")
    store = rendezvous_store()
    port = store.port
    with context.Manager() as manager:
        results = manager.dict()
        processes = [
            context.Process(target=_entry, args=(rank, world, port, fn, args, results))
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout)
        hung = [p for p in processes if p.is_alive()]
        for process in hung:
            process.kill()
        if hung:
            raise TimeoutError(
                f"{len(hung)} distributed test workers did not finish within {timeout} s"
            )
        collected = [results.get(rank) for rank in range(world)]
    for value in collected:
        if isinstance(value, BaseException):
            raise value
    return collected

"""Run a function on n real processes joined in a Gloo group (for tests)."""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        results[rank] = fn(rank, world, *args)
    except BaseException:
        results[rank] = RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = 120.0):
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results by rank."""
    context = mp.get_context("spawn")
    port = free_port()
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

"""Gloo all-reduce across a testbed's workers: the baseline every gradsum method is compared to.

One torch.distributed process per worker host, rendezvousing (TCP store on ``w0``) over the
testbed's links, each timing ``all_reduce`` of ``elements`` float32 values. ATE/s (aggregated
tensor elements per second, SwitchML's measure) is ``elements / median iteration time``, where an
iteration's time is that of its slowest rank.
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from .shell import TestbedError
from .testbed import Call, Testbed, stop

DEFAULT_PORT = 29500
ELEMENT_BYTES = 4


@dataclass(frozen=True)
class AllreduceResult:
    workers: int
    elements: int
    link_rate: int | None
    seconds: tuple[float, ...]

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def ate_per_s(self) -> float:
        return self.elements / self.median_seconds

    def row(self) -> dict:
        """A JSON row, as ``gradsum bench ate`` writes them."""
        return {
            "method": "allreduce",
            "backend": "gloo",
            "workers": self.workers,
            "elements": self.elements,
            "link_rate": self.link_rate,
            "seconds": list(self.seconds),
            "median_seconds": self.median_seconds,
            "ate_per_s": self.ate_per_s,
        }


def ring_wire_seconds(elements: int, workers: int, rate: int, element_bytes: int = 4) -> float:
    """Payload time on the wire of a ring all-reduce: each link carries 2(n-1)/n of the tensor
    each way (headers not counted, so real runs take a few percent more)."""
    if workers < 2:
        return 0.0
    return 2 * (workers - 1) / workers * elements * element_bytes * 8 / rate


def gloo_allreduce(
    tb: Testbed,
    elements: int,
    *,
    iterations: int = 5,
    warmup: int = 1,
    port: int = DEFAULT_PORT,
    timeout: float = 120.0,
) -> AllreduceResult:
    """Time Gloo ``all_reduce`` of ``elements`` float32 across all of ``tb``'s workers; raises
    TestbedError if any rank fails or the sum is wrong."""
    if elements < 1 or iterations < 1 or warmup < 0:
        raise ValueError("elements and iterations must be positive, warmup not negative")
    master = tb.address(tb.workers[0])
    # by its import path, also when this module runs as __main__ (python -m gradsum.testbed.gloo)
    worker = importlib.import_module(__spec__.name if __spec__ else __name__).allreduce_worker
    calls = [
        tb.start_call(
            name,
            worker,
            args=(rank, len(tb.workers), master, port, elements, iterations, warmup, timeout),
            kwargs={"interface": tb.host(name).interface},
        )
        for rank, name in enumerate(tb.workers)
    ]
    replies = gather(calls, timeout)
    wrong = [r["rank"] for r in replies if not r["correct"]]
    if wrong:
        raise TestbedError(f"Gloo all-reduce gave a wrong sum on ranks {wrong}")
    seconds = tuple(max(r["seconds"][i] for r in replies) for i in range(iterations))
    return AllreduceResult(len(tb.workers), elements, tb.spec.rate, seconds)


def gather(calls: Sequence[Call], timeout: float) -> list:
    """Results of all ``calls``; on the first failure the others are stopped and it is raised."""
    deadline = time.monotonic() + timeout
    try:
        return [call.result(max(0.1, deadline - time.monotonic())) for call in calls]
    except BaseException:
        for call in calls:
            stop(call.process)
        raise


def allreduce_worker(
    rank: int,
    world: int,
    master: str,
    port: int,
    elements: int,
    iterations: int,
    warmup: int,
    timeout: float,
    interface: str = "eth0",
) -> dict:
    """One rank (runs on a testbed host): per-iteration all-reduce times and whether the sum
    of every rank's ``rank + 1`` came out right."""
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    os.environ.setdefault("USE_LIBUV", "0")  # the classic TCPStore (bench/train_testbed.py)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )
    try:
        tensor = torch.empty(elements, dtype=torch.float32)
        seconds = []
        for step in range(warmup + iterations):
            tensor.fill_(rank + 1)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if step >= warmup:
                seconds.append(time.perf_counter() - start)
        correct = bool(torch.all(tensor == world * (world + 1) / 2))
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "seconds": seconds, "correct": correct}


def main(argv: list[str] | None = None) -> int:
    """``python -m gradsum.testbed.gloo``: build a testbed, time Gloo, print a JSON row."""
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python -m gradsum.testbed.gloo", description=main.__doc__
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", default=None, help="link rate, e.g. 1gbit (default unshaped)")
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--id", default="gloo", help="testbed id (default gloo)")
    args = parser.parse_args(argv)
    with Testbed(args.workers, rate=args.rate, id=args.id) as tb:
        result = gloo_allreduce(tb, args.elements, iterations=args.iterations)
    row = result.row()
    if result.link_rate:
        wire = ring_wire_seconds(result.elements, result.workers, result.link_rate)
        row["wire_seconds"] = wire
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

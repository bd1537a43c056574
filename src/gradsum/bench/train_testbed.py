"""`gradsum train` on an emulated cluster: one worker per testbed host, a PS shard beside each.

On loopback the network is never the bottleneck (every process shares the same cores), so
schedules that only move bytes differently look alike. Here every host has one shaped link, PS
shards are colocated with workers (the seed's 1:1 setup: shard i on host w_i shares its link),
and workers run as torchrun-style processes (RANK, WORLD_SIZE, rendezvous on w0) — each scheduler
in turn, against the same shards, inside one testbed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CLI = "import sys; from gradsum.cli import main; sys.exit(main())"


def train_in_testbed(
    schedulers: list[str],
    *,
    rate: str,
    workers: int,
    train_flags: list[str],
    timeout: float = 900.0,
) -> list[dict]:
    """Each scheduler's rank-0 summary, trained with ``--aggregator ps`` on ``workers`` hosts."""
    from ..testbed.aggregation import Daemon
    from ..testbed.testbed import Testbed

    summaries = []
    with Testbed(workers, rate=rate, id="benchsched") as tb:
        daemons = [Daemon(tb, f"w{i}", "server") for i in range(workers)]
        servers = ",".join(f"{host}:{port}" for host, port in (d.address for d in daemons))
        try:
            for k, scheduler in enumerate(schedulers):
                print(f"  training with --scheduler {scheduler} at {rate} ...", flush=True)
                flags = [*train_flags, "--scheduler", scheduler, "--servers", servers]
                summaries.append(_one_job(tb, workers, flags, 29500 + k, timeout))
        finally:
            for daemon in daemons:
                daemon.stop()
    return summaries


def _one_job(tb, workers: int, flags: list[str], port: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "log.jsonl"
        processes, errs = [], []
        for rank in range(workers):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(workers),
                "MASTER_ADDR": tb.address("w0"),
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1",
            }
            argv = [sys.executable, "-c", _CLI, "train", "--aggregator", "ps", *flags]
            if rank == 0:
                argv += ["--log", str(log)]
            # stderr to a file: a pipe nobody reads fills up with progress output and blocks
            errs.append(Path(folder) / f"w{rank}.err")
            with errs[-1].open("w") as err:
                processes.append(
                    tb.popen(f"w{rank}", argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
                )
        _wait(processes, errs, timeout)
        return json.loads(log.read_text().splitlines()[-1])


def _wait(processes, errs, timeout: float) -> None:
    """Wait for every worker; a failure or the timeout stops all and names each failed worker."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in processes):
            break
        time.sleep(0.2)
    for process in processes:
        if process.poll() is None:
            process.kill()
    errors = []
    for rank, (process, err) in enumerate(zip(processes, errs, strict=True)):
        if process.wait() != 0:
            lines = [line for line in err.read_text().splitlines() if line.strip()]
            last = lines[-1] if lines else "no output"
            errors.append(f"worker {rank} (exit {process.returncode}): {last}")
    if errors:
        raise RuntimeError(
            f"training in the testbed failed within {timeout:.0f} s:\n" + "\n".join(errors)
        )

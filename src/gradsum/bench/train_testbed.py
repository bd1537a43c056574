"""`gradsum train` on an emulated cluster: one worker per testbed host, over shaped links.

On loopback the network is never the bottleneck (every process shares the same cores). Here
every host has one shaped link; the switch is the testbed's switch host (one port per worker),
PS shards are colocated with workers (the seed's 1:1 setup: shard i on host w_i shares its link),
and workers run as torchrun-style processes (RANK, WORLD_SIZE, rendezvous on w0) — each scheduler
in turn, against the same aggregators, inside one testbed.
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
    aggregator: str,
    schedulers: list[str],
    *,
    rate: str,
    workers: int,
    train_flags: list[str],
    timeout: float = 900.0,
) -> list[dict]:
    """Each scheduler's rank-0 summary, trained through ``aggregator`` on ``workers`` hosts:
    the switch on the testbed's switch host, PS shards beside the workers, or Gloo all-reduce."""
    from ..testbed.testbed import Testbed

    summaries = []
    with Testbed(workers, rate=rate, switch=aggregator == "switch", id="benchtrain") as tb:
        daemons = _start_aggregators(tb, aggregator, workers)
        try:
            for k, scheduler in enumerate(schedulers):
                print(
                    f"  training with {aggregator}, --scheduler {scheduler} at {rate} ...",
                    flush=True,
                )
                flags = [*train_flags, "--aggregator", aggregator, "--scheduler", scheduler]
                flags += _address_flags(aggregator, daemons)
                summaries.append(_one_job(tb, workers, flags, 29500 + k, timeout))
        finally:
            for daemon in daemons:
                daemon.stop()
    return summaries


def _start_aggregators(tb, aggregator: str, workers: int) -> list:
    from ..testbed.aggregation import Daemon

    if aggregator == "switch":
        return [Daemon(tb, "switch", "switch")]
    if aggregator == "ps":
        return [Daemon(tb, f"w{i}", "server") for i in range(workers)]
    return []


def _address_flags(aggregator: str, daemons: list) -> list[str]:
    addresses = ",".join(f"{host}:{port}" for host, port in (d.address for d in daemons))
    if aggregator == "switch":
        return ["--switch", addresses]
    if aggregator == "ps":
        return ["--servers", addresses]
    return []


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
                # torch's libuv TCPStore aborted rank 0 (std::terminate, no Python frame) early in
                # 2 of 8 runs of the testbed training test; the classic store in none of 12
                "USE_LIBUV": "0",
                "OMP_NUM_THREADS": "1",
            }
            # -X faulthandler: a crash in native code still prints every thread's Python stack
            argv = [sys.executable, "-X", "faulthandler", "-c", _CLI, "train", *flags]
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
            errors.append(f"worker {rank} (exit {process.returncode}): {_cause(err)}")
    if errors:
        raise RuntimeError(
            f"training in the testbed failed within {timeout:.0f} s:\n" + "\n".join(errors)
        )


def _cause(err: Path, context: int = 12) -> str:
    """The end of a worker's stderr from its last Python traceback (stack dumps of other
    threads may follow it), or its last lines: the exception's name and message, and what a
    crash printed after it."""
    lines = [line.rstrip() for line in err.read_text().splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith(("Traceback", "Fatal Python"))]
    tail = lines[starts[-1] :] if starts else lines[-context:]
    return "\n    ".join(tail[-context:] or ["no output"])

"""`gradsum train` on an emulated cluster: one worker per testbed host, over shaped links.

On loopback the network is never the bottleneck (every process shares the same cores). Here
every host has one shaped link; the switch is the testbed's switch host (one port per worker),
PS shards are colocated with workers (the seed's 1:1 setup: shard i on host w_i shares its link),
and workers run as torchrun-style processes (RANK, WORLD_SIZE, rendezvous on w0) — each scheduler
in turn, against the same aggregators, inside one testbed. A job that fails is reported as the
Failure its first failed worker wrote (``GRADSUM_FAILURE_FILE``), and the next job runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ..failures import FAILURE_FILE_ENV, Failure, WorkerFailed, read_failure_file
from ..processes import WORKER_ENVIRONMENT

_CLI = "import sys; from gradsum.cli import main; sys.exit(main())"


def train_in_testbed(
    aggregator: str,
    schedulers: list[str],
    *,
    rate: str,
    workers: int,
    train_flags: list[str],
    timeout: float = 900.0,
    testbed_id: str = "benchtrain",
    shards: int | None = None,
) -> Iterator[tuple[str, dict | Failure]]:
    """Each scheduler's outcome as soon as its job ends: rank 0's summary, or the job's Failure,
    trained through ``aggregator`` on ``workers`` hosts: the switch on the testbed's switch host,
    PS shards beside the first ``shards`` workers (default: one per worker), or Gloo all-reduce.
    An error of the testbed or the aggregators
    themselves is raised."""
    from ..testbed.testbed import Testbed

    shards = workers if shards is None else shards
    if not 1 <= shards <= workers:
        raise ValueError(f"{shards} PS shards on {workers} worker hosts: need 1..{workers}")
    with Testbed(workers, rate=rate, switch=aggregator == "switch", id=testbed_id) as tb:
        daemons = _start_aggregators(tb, aggregator, shards)
        try:
            for k, scheduler in enumerate(schedulers):
                print(
                    f"  training with {aggregator}, --scheduler {scheduler} at {rate} ...",
                    flush=True,
                )
                flags = [*train_flags, "--aggregator", aggregator, "--scheduler", scheduler]
                flags += _address_flags(aggregator, daemons)
                try:
                    outcome: dict | Failure = _one_job(tb, workers, flags, 29500 + k, timeout)
                except Exception as error:  # this job's: the next gets its own chance
                    outcome = Failure.of(error)
                yield scheduler, outcome
                if isinstance(outcome, Failure) and daemons and k + 1 < len(schedulers):
                    # a failed job can leave rounds half-aggregated: the next gets fresh daemons
                    for daemon in daemons:
                        daemon.stop()
                    daemons = _start_aggregators(tb, aggregator, shards)
        finally:
            for daemon in daemons:
                daemon.stop()


def _start_aggregators(tb, aggregator: str, shards: int) -> list:
    from ..testbed.aggregation import NamespaceDaemon

    if aggregator == "switch":
        return [NamespaceDaemon(tb, "switch", "switch")]
    if aggregator == "ps":
        return [NamespaceDaemon(tb, f"w{i}", "server") for i in range(shards)]
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
                **WORKER_ENVIRONMENT,
                # a worker that raises writes its rank, exception type and message here
                FAILURE_FILE_ENV: str(_failure_file(folder, rank)),
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
        _wait(processes, folder, timeout)
        return json.loads(log.read_text().splitlines()[-1])


def _failure_file(folder: str, rank: int) -> Path:
    return Path(folder) / f"w{rank}.failure.json"


def _wait(processes, folder: str, timeout: float) -> None:
    """Wait for every worker. The first to fail stops the others and is raised as WorkerFailed
    (the others' errors are most likely its peers', cut off); running out of time stops all and
    raises TimeoutError."""
    deadline = time.monotonic() + timeout
    failed: list[int] = []  # ranks, in the order they were seen to fail
    while True:
        codes = [process.poll() for process in processes]
        failed += [r for r, code in enumerate(codes) if code not in (None, 0) and r not in failed]
        if failed or None not in codes:
            break
        if time.monotonic() > deadline:
            _stop(processes)
            raise TimeoutError(f"training in the testbed did not finish within {timeout:.0f} s")
        time.sleep(0.2)
    _stop(processes)
    if failed:
        rank = failed[0]
        raise WorkerFailed(_failure(rank, processes[rank].returncode, folder))


def _stop(processes) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def _failure(rank: int, code: int, folder: str) -> Failure:
    """What worker ``rank`` wrote when it raised, or, when it died without writing (a crash in
    native code, a signal), how it ended and the end of its stderr."""
    written = read_failure_file(_failure_file(folder, rank))
    if written is not None:
        return written
    return Failure(_how_it_ended(code), _cause(Path(folder) / f"w{rank}.err"), rank)


def _how_it_ended(code: int) -> str:
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:  # a signal Python has no name for
        return f"killed by signal {-code}"


def _cause(err: Path, context: int = 12) -> str:
    """The end of the stderr of a worker that died without reporting: from the last fatal error
    or traceback it printed (faulthandler's stack dumps of other threads may follow it), or
    its last lines."""
    lines = [line.rstrip() for line in err.read_text().splitlines() if line.strip()]
    # a C++ exception that ends the process says what it was before Python's fatal error does
    openers = ("Traceback", "Fatal Python", "terminate called")
    starts = [i for i, line in enumerate(lines) if line.startswith(openers)]
    if len(starts) > 1 and lines[starts[-2]].startswith("terminate called"):
        starts.pop()
    tail = lines[starts[-1] :] if starts else lines[-context:]
    return "\n    ".join(tail[-context:] or ["no output"])


def train_flags(config) -> list[str]:
    """`gradsum train` flags for ``config`` (all but the aggregator, scheduler and workers,
    which the testbed sets, and the flags that do not apply to its method)."""
    from ..config import to_flags
    from ..train.config import BENCH_SECTIONS, TrainConfig

    # the device always: a worker given none would take cuda when present, whatever the bench's
    return [*to_flags(config, BENCH_SECTIONS, TrainConfig(),
                      skip=("aggregator", "scheduler", "workers", "device")),
            "--device", config.device]  # fmt: skip

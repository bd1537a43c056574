"""Aggregation on one machine: daemons as subprocesses, workers as processes, all on loopback.

Used by `gradsum bench ate` and the network tests. Every wait is bounded and names what it
waited for.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from .. import processes
from ..dataplane.jobspec import Address

_CLI = "import sys; from gradsum.cli import main; sys.exit(main())"


class DaemonProcess:
    """`gradsum switch|server` in a subprocess on 127.0.0.1 with a free port (one per pipeline
    with ``--pipelines N``: ``addresses``; ``address`` is the first)."""

    def __init__(
        self, kind: str, *flags: str, startup_timeout: float = 30.0, env: dict | None = None,
        bind: str = "127.0.0.1:0",
    ):  # fmt: skip
        command = [sys.executable, "-c", _CLI, kind, "--bind", bind, *flags]
        self.kind = kind
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.address = self._await_listening(startup_timeout)
        self.stderr = ""

    def _await_listening(self, timeout: float) -> Address:
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: lines.put(self.process.stdout.readline()))
        reader.daemon = True
        reader.start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            self.process.kill()
            raise TimeoutError(
                f"gradsum {self.kind} did not report listening in {timeout} s"
            ) from None
        if "listening on" not in line:
            self.process.kill()
            error = self.process.stderr.read()
            raise RuntimeError(f"gradsum {self.kind} failed to start: {line}{error}")
        self.listing = line  # the whole line: metrics servers are named in it too
        listed = line.split("listening on ", 1)[1].split(" (", 1)[0]
        self.addresses = tuple(_address(item.strip()) for item in listed.split(","))
        return self.addresses[0]

    def stop(self, timeout: float = 10.0) -> str:
        """SIGTERM, wait; return what it printed to stderr (its final statistics, one line per
        pipeline)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, self.stderr = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, self.stderr = self.process.communicate(timeout=timeout)
            raise TimeoutError(f"gradsum {self.kind} ignored SIGTERM for {timeout} s") from None
        return self.stderr

    def kill(self) -> None:
        """SIGKILL: the daemon dies at once, with every job it held (fault tests)."""
        self.process.kill()
        self.process.communicate(timeout=10)

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) the daemon and its pipelines have used so far; None where
        /proc cannot tell."""
        return tree_cpu_seconds(self.process.pid)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process and its live descendants (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # fields after the parenthesised command: utime and stime are the 12th and 13th
            fields = stat.read().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        children = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                children += [int(c) for c in listed.read().split()]
    except (OSError, ValueError, IndexError):
        return None
    for child in children:
        total += tree_cpu_seconds(child) or 0.0  # a child that just exited: nothing to add
    return total


def _address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    return host, int(port)


@dataclass(frozen=True)
class WorkerTask:
    """What every worker process does: ``steps`` allreduces of a seeded random tensor."""

    aggregators: tuple[Address, ...]
    job: int
    workers: int
    codec: str
    elements: int
    steps: int = 1
    warmup: int = 0
    codec_options: dict = field(default_factory=dict)
    slots: int = 32
    slot_elements: int | None = None
    seed: int = 0
    keep_output: bool = True
    retry_timeout: float = 0.01
    give_up_after: float = 60.0
    groups: int = 1  # hierarchy: worker w talks to aggregators[w // (workers // groups)]
    multicast: bool = False  # results multicast to a group the workers join (a switch's)
    mtu: int | None = None  # packets that fit this path MTU, a chunk's sent with GSO
    key: bytes | None = None  # the job's key: its control is signed, its packets carry its token
    integrity: str = "token"  # or "mac": every packet also ends in a keyed MAC (needs key)

    def codec_and_wire(self):
        """The task's codec, built once per worker, and the wire format its job registers."""
        from ..codecs import make_codec
        from ..dataplane.codec_wire import wire_format

        codec = make_codec(self.codec, workers=self.workers, **self.codec_options)
        return codec, wire_format(codec, self.codec_options, self.seed)

    def route(self, worker: int) -> tuple[tuple[Address, ...], int]:
        """(aggregators, worker id there) of a global worker."""
        if self.groups == 1:
            return self.aggregators, worker
        size = self.workers // self.groups
        return (self.aggregators[worker // size],), worker % size


@dataclass
class WorkerResult:
    worker: int
    outputs: list  # float32 numpy arrays, one per step (if kept)
    seconds: list[float]  # per timed step
    stats: dict
    cpu_seconds: float = 0.0  # this process's CPU time (user + system) over the timed steps


def worker_input(task: WorkerTask, worker: int, step: int):
    import torch

    generator = torch.Generator().manual_seed(task.seed * 1_000_003 + worker * 101 + step)
    return torch.randn(task.elements, generator=generator)


def worker_inputs(task: WorkerTask, worker: int) -> list:
    """The worker's input of every step, made before any is timed. A benchmark that keeps no
    outputs cycles through at most ``DISTINCT_INPUTS`` of them (memory: steps x elements)."""
    distinct = task.steps if task.keep_output else min(task.steps, DISTINCT_INPUTS)
    made = [worker_input(task, worker, step) for step in range(distinct)]
    return [made[step % distinct] for step in range(task.steps)]


DISTINCT_INPUTS = 4


def run_workers(task: WorkerTask, timeout: float = 300.0, register=None) -> list[WorkerResult]:
    """Start the workers, register the job (on every aggregator, or by calling
    ``register(worker_addresses)``), run, tear down, collect."""
    from .client import register_job, teardown_job

    context = processes.context()
    pipes, started = [], []
    for worker in range(task.workers):
        parent, child = context.Pipe()
        process = processes.process(context, _worker_main, (task, worker, child), daemon=True)
        processes.start(process)
        pipes.append(parent)
        started.append(process)
    try:
        addresses = [_receive(p, timeout, f"worker {w}'s address") for w, p in enumerate(pipes)]
        if register is None:
            for aggregator in task.aggregators:
                register_job(aggregator, job_spec(task, addresses, aggregator))
        else:
            register(addresses)
        for pipe in pipes:
            pipe.send("go")
        deadline = time.monotonic() + timeout
        results = [
            _receive(p, deadline - time.monotonic(), f"worker {w}'s result")
            for w, p in enumerate(pipes)
        ]
        if register is None:
            for aggregator in task.aggregators:
                teardown_job(aggregator, task.job, key=task.key)
    finally:
        for process in started:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"a worker failed: {errors[0]}")
    return results


def job_spec(task: WorkerTask, addresses, aggregator=None, **extra):
    """The spec the task's workers expect at ``aggregator`` (``extra``: quorum, parent,
    max_contributors...); without ``aggregator``, results are unicast."""
    from .client import SwitchClient

    _, wire = task.codec_and_wire()
    probe = SwitchClient(task.aggregators[:1], wire, job=task.job, worker=0,
                         workers=task.workers, slots=task.slots, elements=task.slot_elements,
                         multicast=False, mtu=task.mtu, key=task.key,
                         integrity=task.integrity)  # fmt: skip
    probe.multicast = task.multicast
    try:
        return probe.job_spec(addresses, aggregator, **extra)
    finally:
        probe.close()


def _receive(pipe, timeout: float, what: str):
    if not pipe.poll(max(0.0, timeout)):
        raise TimeoutError(f"waited {timeout:.0f} s for {what}")
    value = pipe.recv()
    if isinstance(value, BaseException):
        raise value
    return value


def _worker_main(task: WorkerTask, worker: int, pipe) -> None:
    try:
        pipe.send(_work(task, worker, pipe))
    except BaseException as error:  # the parent reports it
        pipe.send(f"worker {worker} (pid {os.getpid()}): {type(error).__name__}: {error}")


def _work(task: WorkerTask, worker: int, pipe) -> WorkerResult:
    import torch

    from ..dataplane.stream import RetryPolicy
    from .client import SwitchClient

    torch.set_num_threads(1)
    policy = RetryPolicy(timeout=task.retry_timeout, give_up_after=task.give_up_after)
    aggregators, local = task.route(worker)
    codec, wire = task.codec_and_wire()
    client = SwitchClient(aggregators, wire, job=task.job, worker=local, workers=task.workers,
                          slots=task.slots, elements=task.slot_elements, policy=policy,
                          multicast=task.multicast, mtu=task.mtu, key=task.key,
                          integrity=task.integrity)  # fmt: skip

    def allreduce(tensor, key=None):
        return client.allreduce(tensor, codec, seed=task.seed, rank=worker, key=key)

    with client:
        pipe.send(client.address)
        if not pipe.poll(120):
            raise TimeoutError("no 'go' from the parent within 120 s")
        pipe.recv()
        inputs = worker_inputs(task, worker)
        for _ in range(task.warmup):
            allreduce(inputs[0], key="warmup")
        outputs, seconds, cpu = [], [], 0.0
        for step in range(task.steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            out = allreduce(inputs[step])
            seconds.append(time.perf_counter() - start)
            cpu += time.process_time() - start_cpu
            if task.keep_output:  # numpy: torch would pass shared memory that dies with us
                outputs.append(out.numpy().copy())
        return WorkerResult(worker, outputs, seconds, client.stats(), cpu)

"""gradsum's own aggregation inside a testbed: a `gradsum switch|server` daemon on one host, one
``SwitchClient`` worker per worker host, over the testbed's shaped links.

The daemon listens on its host's testbed address; worker ``i`` binds ``10.77.1.(i+1):PORT``, so
every address is known before anything starts and worker 0 registers the job. Workers that send
before the job exists are dropped by the daemon and retransmit (the protocol's loss recovery),
so no other start-up synchronisation is needed.
"""

from __future__ import annotations

import select
import subprocess
import sys
import time
from dataclasses import replace

from .gloo import gather
from .shell import TestbedError
from .testbed import Testbed, stop

DAEMON_PORT = 48864
WORKER_PORT = 48865
_CLI = "import sys; from gradsum.cli import main; sys.exit(main())"


class NamespaceDaemon:
    """A `gradsum switch|server` process on a testbed host; ``stop()`` returns its stderr
    (its final statistics)."""

    def __init__(
        self, tb: Testbed, host: str, kind: str, *flags: str, pipelines: int = 1,
        timeout: float = 60.0,
    ):  # fmt: skip
        self.kind, self.host = kind, host
        self.stderr: str | None = None
        self.address = (tb.address(host), DAEMON_PORT)
        self.addresses = tuple((self.address[0], DAEMON_PORT + i) for i in range(pipelines))
        bind = f"{self.address[0]}:{DAEMON_PORT}"
        argv = [sys.executable, "-c", _CLI, kind, "--bind", bind, "--pipelines", str(pipelines),
                *flags]  # fmt: skip
        self.process = tb.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        self._await_listening(timeout)

    def _await_listening(self, timeout: float) -> None:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if "listening on" not in line:
            stop(self.process)
            what = line.strip() or f"nothing within {timeout:g} s"
            raise TestbedError(f"gradsum {self.kind} on {self.host} did not start: {what}")

    def stop(self, timeout: float = 10.0) -> str:
        """SIGTERM, wait; what it printed to stderr (also kept as ``self.stderr``)."""
        if self.stderr is not None:
            return self.stderr
        if self.process.poll() is None:
            self.process.terminate()
        try:
            _, self.stderr = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(self.process)
            raise TestbedError(f"gradsum {self.kind} ignored SIGTERM for {timeout:g} s") from None
        return self.stderr

    def __enter__(self) -> NamespaceDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def aggregate(tb: Testbed, daemon: NamespaceDaemon, task, timeout: float = 300.0) -> list:
    """Run ``task`` (a ``gradsum.net.loopback.WorkerTask``; its aggregators are replaced by
    ``daemon``) on all of ``tb``'s workers; their ``WorkerResult``s in worker order."""
    task = replace(task, aggregators=daemon.addresses, workers=len(tb.workers))
    addresses = [(tb.address(w), WORKER_PORT) for w in tb.workers]
    calls = [
        tb.start_call(w, aggregation_worker, args=(task, i, addresses))
        for i, w in enumerate(tb.workers)
    ]
    return gather(calls, timeout)


def aggregation_worker(task, worker: int, addresses: list) -> object:
    """One worker (runs on a testbed host): bind its known address, register the job if it is
    worker 0, then all-reduce ``task.steps`` seeded tensors."""
    import torch

    from ..dataplane.stream import RetryPolicy
    from ..net.client import SwitchClient
    from ..net.loopback import WorkerResult, worker_inputs

    torch.set_num_threads(1)
    policy = RetryPolicy(timeout=task.retry_timeout, give_up_after=task.give_up_after)
    codec, wire = task.codec_and_wire()
    client = SwitchClient(task.aggregators, wire, job=task.job, worker=worker,
                          workers=task.workers, slots=task.slots, elements=task.slot_elements,
                          policy=policy, bind=tuple(addresses[worker]),
                          multicast=task.multicast, mtu=task.mtu)  # fmt: skip
    with client:
        if worker == 0:
            client.register(addresses)
        outputs, seconds = [], []
        # made before the first step: a worker drawing its input while the others wait for
        # its contribution would add that to their step times
        inputs = worker_inputs(task, worker)
        for tensor in inputs:
            start = time.perf_counter()
            out = client.allreduce(tensor, codec, seed=task.seed, rank=worker)
            seconds.append(time.perf_counter() - start)
            outputs.append(out.numpy().copy() if task.keep_output else None)
        return WorkerResult(worker, outputs, seconds, client.stats())

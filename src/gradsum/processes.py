"""Where gradsum's local worker processes come from.

A fresh interpreter that imports torch and gradsum costs about two seconds of CPU, most of what
a short run's start costs, paid again by every worker of every run. Workers are therefore forked
from one forkserver per launching process, started once with torch and gradsum imported and
with the workers' environment (``WORKER_ENVIRONMENT``: OpenMP reads ``OMP_NUM_THREADS`` when
torch loads it, so it must be set in the process that imports torch, not after a fork).

A forked worker still behaves as a spawned one: it gets the launcher's ``os.environ`` of the
moment it starts (the forkserver's own would be that of the first run), and multiprocessing
gives it the launcher's working directory and ``sys.path``. Where no forkserver is available,
or one was started by other code with an environment gradsum did not choose, workers are spawned.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys

# What every worker's environment sets before its OpenMP runtime starts (the local launcher's and
# the testbed's; torchrun sets the same). torch.set_num_threads sizes the intra-op pool of the
# thread that calls it; every other thread of a worker (Gloo's callbacks, which run torch's
# PowerSGD hook, and gradsum's communication thread) takes OpenMP's default, one thread per
# core. With several, MKL's matrix products there are not bitwise reproducible, so two workers
# could decompress the same all-reduced P and Q into different gradients: the digits MLP with
# ddp:powersgd2 ended with "replicas diverged" after 4 to 12 steps in every run on 2 workers,
# and in none with this set.
WORKER_ENVIRONMENT = {"OMP_NUM_THREADS": "1"}

# What the forkserver imports before it forks anyone: torch, its process groups, dynamo (which
# torch's optimizers and DDP import on first use, a second of CPU), and the modules every kind
# of gradsum worker (training, benchmarks' senders) starts from. Importing this module loads
# none of them.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "gradsum.train.launch",
           "gradsum.net.client")  # fmt: skip

_ours = False  # whether this process started the forkserver, under WORKER_ENVIRONMENT


@contextlib.contextmanager
def worker_environment():
    """``WORKER_ENVIRONMENT`` in ``os.environ`` while workers start, the launcher's own restored
    afterwards."""
    saved = {name: os.environ.get(name) for name in WORKER_ENVIRONMENT}
    os.environ.update(WORKER_ENVIRONMENT)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def under_torchrun() -> bool:
    """Whether this process is a worker torchrun started (it brings its own processes)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def context(needs: tuple[str, ...] = ()):
    """The multiprocessing context workers start in (torch's, so tensors in its queues travel
    through shared memory): the forkserver where this process can own one, else spawn.
    ``needs``: modules the workers will import beyond ``PRELOAD`` (a dataset's), imported by
    the forkserver too if this call starts it."""
    import torch.multiprocessing as torch_mp

    return torch_mp.get_context("forkserver" if start_forkserver(needs) else "spawn")


def start_forkserver(needs: tuple[str, ...] = ()) -> bool:
    """Start this process's forkserver if none runs yet; whether workers can come from it.

    It imports ``PRELOAD`` and ``needs`` in a process of its own, so a launcher that calls this
    before its own start-up (importing torch, checking data and flags) overlaps the two instead
    of paying one after the other. Imports nothing itself."""
    global _ours
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None:
        return _ours  # started by other code, with its own environment, if not by us
    preload = [*PRELOAD, *needs, "gradsum.forkserver_exit"]  # its exit handler after theirs
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    with worker_environment():
        forkserver.ensure_running()
    _ours = True
    return True


def start(process) -> None:
    """``process.start()`` under ``WORKER_ENVIRONMENT`` (a spawned process copies it; a
    forkserver that died and is started again reads it)."""
    with worker_environment():
        process.start()


def process(ctx, target, args=(), **options):
    """A Process of ``ctx`` that runs ``target(*args)`` under the launcher's environment of
    this moment plus ``WORKER_ENVIRONMENT``, writing to the launcher's standard output and
    error of the moment it starts."""
    environ = dict(os.environ) | WORKER_ENVIRONMENT
    return ctx.Process(target=_in_environment,
                       args=(environ, _Streams(), target, args, os.getpid()),
                       **options)  # fmt: skip


class _Streams:
    """The launcher's file descriptors 1 and 2, handed to the worker as it starts (a forked
    worker's own are the forkserver's: wherever the first run's output went)."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _Streams._received, tuple(DupFd(fd) for fd in (1, 2) if _is_open(fd))

    @staticmethod
    def _received(*descriptors) -> tuple[int, ...]:
        return tuple(d.detach() for d in descriptors)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _in_environment(environ: dict, streams: tuple[int, ...], target, args,
                    launcher: int) -> None:  # fmt: skip
    _stop_with_launcher(launcher)
    os.environ.clear()
    os.environ.update(environ)
    if len(streams) == 2:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, received in zip((1, 2), streams, strict=True):
            os.dup2(received, fd)
    for received in streams:
        os.close(received)
    target(*args)


def _stop_with_launcher(launcher: int) -> None:
    """SIGTERM this worker when its launcher ends, however it ends: one killed outright
    (SIGKILL) runs no handler that could stop its workers, and the forkserver they were forked
    from outlives it (each worker holds the forkserver's liveness pipe open). A worker left
    behind would go on training, holding cores, ports and aggregator jobs, until some timeout.
    A thread waits on the launcher's pidfd (Linux 5.3 and later; elsewhere nothing is
    watched); the signal reaches the worker as the launcher's own stop does (``Terminated``,
    which tears its jobs down)."""
    import signal
    import threading

    try:
        handle = os.pidfd_open(launcher)
    except ProcessLookupError:  # it ended before this worker started
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (AttributeError, OSError):
        return

    def watch() -> None:
        import select

        select.select([handle], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gradsum-launcher-watch", daemon=True).start()


def name_this(name: str) -> None:
    """This process's name as ``ps`` and ``top`` show it (Linux; at most 15 bytes), so that a
    person, or a test, can tell the workers apart from the forkserver and the manager they
    share a command line with. The threads it starts from now on carry it too."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name[:15])

"""Starting workers: locally (``gradsum train`` spawns them) or under torchrun (one per process).

Locally, the launcher starts whatever aggregation service the job needs on loopback, starts one
process per worker (forked from a server that has imported torch: ``gradsum/processes.py``) with
a torch.distributed rendezvous on a free port, and shuts everything down on exit or Ctrl-C.
Under torchrun (RANK/WORLD_SIZE set) it runs this process's worker only, with the aggregator
addresses given by ``--switch``/``--servers``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import processes
from ..failures import Failure, WorkerFailed
from .loop import TrainConfig, train_worker


def backend_for(config: TrainConfig, local_workers: int = 1) -> str:
    """Gloo on the CPU; on GPUs NCCL for device tensors and Gloo for the host values of the
    control plane (sizes, digests, plans), in one default group. Where this host's workers
    outnumber its GPUs, some share one, which NCCL refuses ("Duplicate GPU detected"): Gloo
    then carries the device tensors too (its all-reduce and broadcast take CUDA tensors)."""
    if config.device != "cuda":
        return "gloo"
    if local_workers > torch.cuda.device_count():
        return "gloo"
    return "cuda:nccl,cpu:gloo"


def use_local_gpu(config: TrainConfig, local_rank: int) -> None:
    """One GPU per local rank, set before the process group so NCCL binds to it."""
    if config.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


class Terminated(Exception):
    """The launcher stopped this worker (SIGTERM): another worker failed, or the run was
    cancelled. Raised in the worker's main thread, so its jobs are torn down on the way out."""


def _raise_on_sigterm() -> None:
    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
        raise Terminated("stopped by the launcher (SIGTERM)")

    signal.signal(signal.SIGTERM, terminated)


def _already_failing() -> None:
    """A worker that is describing its own failure ignores the stop the launcher sends once one
    worker fails: raising Terminated there would replace the report it is writing."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_torchrun_worker(config: TrainConfig) -> dict:
    """This process's worker, rendezvousing through torchrun's environment; its error is
    raised as ``WorkerFailed`` with this worker's rank."""
    _raise_on_sigterm()  # torchrun's agent stops the others when one fails: tear down first
    try:
        use_local_gpu(config, int(os.environ.get("LOCAL_RANK", "0")))
        _init_torchrun_group(config)
        try:
            config = resumed_after_restart(config, dist.get_rank())
            return _train(config, dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
    except Exception as error:
        _already_failing()
        raise WorkerFailed(Failure.of(error, int(os.environ["RANK"]))) from error


def _init_torchrun_group(config: TrainConfig) -> None:
    """The process group of torchrun's environment, its keys apart for every restart: the
    agent keeps one store across restarts, and a restarted worker that reached the rendezvous
    before its peer read the previous attempt's address of that peer (Gloo: connection
    refused)."""
    wait = timedelta(seconds=config.timeout)
    store, rank, world = next(dist.rendezvous("env://", timeout=wait))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"gradsum/attempt{attempt}/", store)
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group(backend_for(config, local_workers), store=store, rank=rank,
                            world_size=world, timeout=wait)  # fmt: skip


def resumed_after_restart(config: TrainConfig, rank: int) -> TrainConfig:
    """Under torchrun ``--max-restarts``, a restarted worker group (TORCHELASTIC_RESTART_COUNT
    above 0) resumes from its ``--checkpoint`` when every worker has its part of the same
    epoch's; otherwise (it failed before its first checkpoint) it starts from the beginning.
    The jobs of the attempt before were torn down by its workers as the agent stopped them
    (SIGTERM), and the new attempt registers its own."""
    from dataclasses import replace

    from .loop import checkpoint_epoch

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not restarted or not config.checkpoint or config.resume:
        return config
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, checkpoint_epoch(config.checkpoint, rank))
    if None in everyone or len(set(everyone)) != 1:
        return config  # no checkpoint every worker has: from the beginning
    return replace(config, resume=config.checkpoint)


def run_local(config: TrainConfig) -> dict:
    """Start ``config.workers`` worker processes on this machine and return worker 0's summary."""
    from .config import DATASET_MODULES
    from .services import local_services

    context = processes.context(DATASET_MODULES.get(config.dataset, ()))
    with local_services(config) as addresses, context.Manager() as manager:
        results = manager.dict()
        registered = manager.list()  # (aggregator, job, key) of every job a worker registered
        # The workers' rendezvous: a store this process serves on a port the kernel chose and
        # that it holds until the run ends (a port found free and released could be taken by
        # another program, or another run, before worker 0 bound it).
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=config.timeout))  # fmt: skip
        port = store.port
        workers = [
            processes.process(
                context, _local_entry,
                (config, addresses, rank, config.workers, port, results, registered),
                name=f"gradsum-worker-{rank}",
            )
            for rank in range(config.workers)
        ]  # fmt: skip
        try:
            for worker in workers:
                processes.start(worker)
            _join(workers, results, config)
        except BaseException:
            _stop(workers)
            # The survivors tear their jobs down as they stop; a job whose workers were all
            # killed (or were killed in the middle of it) is torn down here.
            _tear_down(list(registered))
            raise
        finally:
            _stop(workers)
        return dict(results[0])


def _stop(processes) -> None:
    """Stop every worker still running: SIGTERM (it tears its jobs down on the way out), then
    SIGKILL for one that has not ended 5 s later."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 5  # one deadline for all: not 5 s more per worker
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


def _tear_down(registered) -> None:
    """TEARDOWN for every noted job, all at once, 1 s at most (one already gone is fine):
    after a failed run, no job of it stays on an aggregator, whichever workers died."""
    from concurrent.futures import ThreadPoolExecutor

    from ..net.client import ControlError, teardown_job

    def tear_down(record) -> None:
        address, job, key = record
        with contextlib.suppress(ControlError, OSError):
            teardown_job(tuple(address), job, timeout=1.0,
                         key=None if key is None else bytes.fromhex(key))  # fmt: skip

    records = list(dict.fromkeys(registered))
    if records:
        with ThreadPoolExecutor(min(16, len(records))) as pool:
            list(pool.map(tear_down, records))


def _join(processes, results, config: TrainConfig) -> None:
    """Wait for every worker; the first failure stops the others and is raised here.

    A worker that dies after it returned its result does not fail a run whose results are
    all in: that is a library aborting in teardown (gloo's threads have ended a finished
    worker with ``std::terminate``, SIGABRT), and the training it reports is complete. It is
    named in a warning; the others are waited for, not stopped."""

    def returned(rank: int) -> bool:
        return rank in results and not isinstance(results[rank], Failure)

    def failed_early() -> bool:  # a worker gone without a result, or one that reported failure
        return any((p.exitcode not in (None, 0) and not returned(rank))
                   or isinstance(results.get(rank), Failure)
                   for rank, p in enumerate(processes))  # fmt: skip

    while any(p.is_alive() for p in processes) and not failed_early():
        for process in processes:
            process.join(0.2)
    if any(p.exitcode is not None and p.exitcode < 0 for p in processes):
        # Workers killed together (a node lost, a job killed) are reaped one at a time: wait a
        # moment for the others, so the lowest rank among them is named, not whichever the
        # loop saw first.
        deadline = time.monotonic() + 0.5
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    # The manager's dict keeps the order workers wrote in: the first failure is the likeliest
    # cause, the others often only the peers of a worker that had died (a broken connection).
    # A worker killed by a signal before it said anything comes first, though: its peers'
    # errors (a reset connection) are what its death did to them.
    failures = [value for value in results.values() if isinstance(value, Failure)]
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code is not None and code < 0 and rank not in results:
            raise WorkerFailed(Failure("Killed", f"the process ended by {_signal_name(-code)} "
                                       "before it returned a result", rank))  # fmt: skip
    if failures:
        raise WorkerFailed(failures[0])
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code in (None, 0):
            continue
        how = f"ended by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        if not returned(rank):  # killed, or gone, before it could say anything
            kind = "Killed" if code < 0 else "Exited"
            raise WorkerFailed(Failure(kind, f"the process {how} before it returned a result",
                                       rank))  # fmt: skip
        warnings.warn(
            f"worker {rank}'s process {how} after it returned its result (in teardown); "
            "the run's results are complete",
            RuntimeWarning,
            stacklevel=2,
        )
    if not returned(0):
        raise RuntimeError("worker 0 ended without a result and without an error")


def _signal_name(number: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"


def _local_entry(config, addresses, rank, world, port, results, registered=None) -> None:
    """A worker of ``run_local``: its group meets through the launcher's store at ``port``; the
    jobs it registers are noted in ``registered``, which the launcher tears down if the run
    fails."""
    from ..sync import service

    _raise_on_sigterm()
    processes.name_this(f"gradsum-rank{rank}")
    service.job_records = registered
    # Workers share this machine's cores: more intra-op threads than cores only thrash.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    local = TrainConfig(
        **{**config.__dict__, **addresses, "progress": config.progress and rank == 0}
    )
    code = 0
    try:
        use_local_gpu(config, rank)
        wait = timedelta(seconds=config.timeout)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
        dist.init_process_group(backend_for(config, world), store=store, rank=rank,
                                world_size=world, timeout=wait)  # fmt: skip
        results[rank] = _train(local, rank, world)
    except KeyboardInterrupt:
        pass
    except BaseException as error:
        _already_failing()
        code = 1
        results[rank] = Failure.of(error, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit_worker(code)


def _exit_worker(code: int) -> None:
    """End a local worker once everything it started is closed: its jobs torn down and its
    threads joined (the session's ``close``), its process group destroyed, its result with
    the launcher. The interpreter's own finalization is skipped: it would destroy what
    libraries still hold after that in no defined order -- Gloo's transport threads outlive
    ``destroy_process_group``, and a ``std::thread`` destroyed while still joinable is
    ``std::terminate`` ("terminate called without an active exception", SIGABRT in a
    finished worker) -- and on a loaded host it took seconds. The exit handlers still run
    (multiprocessing's among them, which releases the semaphores the worker made)."""
    import atexit

    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _train(config: TrainConfig, rank: int, world: int) -> dict:
    return train_worker(config, rank, world)


"""Start-up: the workers measure, probe their hosts and agree on one communication plan.

Every worker runs :func:`agree_on_plan` together; what decides from the measurements is pure
and lives in ``schedule/calibration.py``:

1. **α–β**, only for policies that reason with a per-message cost (not ``COST_FREE``): a few
   transfers of known sizes through the run's Session (one PS shard when shards are
   addressed one by one; otherwise the whole aggregator), every worker taking part as in
   training, timed while a copy of the model computes beside them (:func:`step_load`). Worker
   0 judges its timings (``judge_calibration``); when noise leaves no usable fit it has every
   worker measure again, and after ``CALIBRATION_ATTEMPTS`` rounds it falls back to the stated
   ``DEFAULT_COST`` with a warning — start-up never fails on a busy machine. A cost given by
   the caller (``fit=``) replaces the measurement.
2. **Hosts**: every worker says whether it reaches the calibrated shard over a link
   (:func:`remote_workers`) and whether all share one host's cores (:func:`shared_host_cores`).
3. **Profile**: worker 0 times each layer's forward and backward with hooks on a copy of the
   model (so no worker's weights, buffers or gradients change) on one real batch.
4. **Plan**: worker 0 plans on the profile and the cluster the cost implies
   (``calibration.plan_on``) and broadcasts the plan and its send order, so every worker
   executes the identical plan. The plan line (:meth:`RuntimePlan.describe`) says where its
   cost model came from.

It needs a Session, a model and a batch, nothing of ``train/``: a user who drives
``GradientSync`` without gradsum's training loop plans the same way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..schedule import AlphaBeta, make_planner
from ..schedule.calibration import (
    CALIBRATION_ATTEMPTS,
    CALIBRATION_REPEATS,
    CALIBRATION_SIZES,
    DEFAULT_COST,
    CostModel,
    RuntimePlan,
    Samples,
    calibration_sizes,
    cost_without_measuring,
    judge_calibration,
    plan_on,
)
from ..schedule.cluster import crowding
from ..schedule.profiling import measure_profile


def time_transfers(
    send: Callable[[torch.Tensor], None], sizes: Sequence[int], repeats: int = CALIBRATION_REPEATS
) -> list[tuple[float, float]]:
    """(bytes, seconds) of every timed ``send(tensor)``, ``repeats`` per fp32 size, after one
    untimed warm-up of each size. The sizes take turns, in alternating order, so load that
    drifts during the round (the step load warming up, a peer descheduled for a while) falls
    on every size alike instead of tilting the slope. All workers must call this together with
    the same sizes."""
    tensors = [torch.zeros(size) for size in sizes]
    for tensor in tensors:
        send(tensor)
    samples = []
    for turn in range(repeats):
        for tensor in tensors if turn % 2 == 0 else reversed(tensors):
            start = time.perf_counter()
            send(tensor)
            samples.append((4.0 * tensor.numel(), time.perf_counter() - start))
    return samples


def shared_host_cores() -> int | None:
    """The cores every worker shares when all run on one host (same kernel boot id: network
    namespaces share it), else None. The shards are taken to be where the workers are, as
    the local launcher and the testbed place them. Every worker asks for itself."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as source:
            mine = (source.read().strip(), len(os.sched_getaffinity(0)))
    except (OSError, AttributeError):
        mine = (None, 0)
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    hosts = {host for host, _ in everyone}
    if len(hosts) != 1 or None in hosts:
        return None
    return min(cores for _, cores in everyone)


def remote_workers(aggregator) -> int:
    """How many workers reach shard 0, the calibrated one, over a link rather than on their
    own host (0 for an aggregator without addressed shards, or on one machine). A host is this
    worker's own when a socket can bind to its address; every worker asks for itself."""
    addresses = getattr(aggregator, "shard_addresses", None)
    if not addresses:
        return 0
    remote = [0 if _is_own_address(addresses[0][0]) else 1]
    if dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, remote[0])
        return sum(everyone)
    return remote[0]


def _is_own_address(host: str) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def step_load(model: torch.nn.Module, batch: torch.Tensor) -> Iterator[None]:
    """A copy of ``model`` running forward and backward on ``batch`` in a thread of its own
    until the block ends: the load a training step puts beside its messages.

    Calibrating under it measures what a message costs while the workers compute. Where the
    workers and servers share a host's few cores (the testbed: 9 processes on 2 cores), every
    hop of a message then waits for its process to be scheduled, a cost a quiet round trip
    never meets: the quiet fit gave 0.5–1.4 ms where an added message cost a step 1–7 ms
    (docs/scheduling.md, "Runtime")."""
    replica = copy.deepcopy(model)
    stop = threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            while True:  # at least one pass: a model that cannot run fails here, not silently
                replica.zero_grad(set_to_none=True)
                replica(batch).float().square().mean().backward()
                if stop.is_set():
                    return
        except Exception as error:  # raised in the caller's thread, below
            failures.append(error)

    worker = threading.Thread(target=run, name="gradsum-calibration-load", daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()
    if failures:
        raise RuntimeError(
            f"the calibration's step load failed: {type(failures[0]).__name__}: {failures[0]}"
        ) from failures[0]


def calibrate(
    session, sizes=CALIBRATION_SIZES, attempts: int = CALIBRATION_ATTEMPTS,
    load: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> CostModel:  # fmt: skip
    """The per-message cost of the Session's rounds (on shard 0 where it addresses shards),
    the same on every worker (all call this together), timed under ``load()`` where given
    (``step_load``: as the step runs). Worker 0's timings decide; measuring again is a
    decision every worker follows, since every transfer needs all of them."""
    if attempts < 1:
        raise ValueError(f"calibration needs at least 1 attempt, got {attempts}")
    step = iter(range(1 << 30))

    def send(tensor: torch.Tensor) -> None:
        key = ("calibrate", tensor.numel())
        if session.shards:
            session.part(0, tensor, key=key, step=next(step))
        else:
            session.synchronize(tensor, key=key, step=next(step))

    rank = dist.get_rank() if dist.is_initialized() else 0
    measurements: list[Samples] = []
    decision: list[CostModel | None] = [None]
    while decision[0] is None:  # judge_calibration decides by round ``attempts`` at the latest
        with load() if load is not None else contextlib.nullcontext():
            measurements.append(time_transfers(send, sizes))
        if rank == 0:
            decision = [judge_calibration(measurements, attempts)]
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0)
    cost = dataclasses.replace(decision[0], loaded=load is not None)
    if cost.source == "default" and rank == 0:
        warnings.warn(
            f"α–β calibration found no usable cost model, planning with the default "
            f"(α {DEFAULT_COST.alpha * 1e6:.0f} µs, β {1e-6 / DEFAULT_COST.beta:.0f} MB/s "
            f"per message): {cost.reason}",
            RuntimeWarning,
            stacklevel=2,
        )
    return cost


def start_up_profile(model, batch, model_name: str, workers: int, cores: int | None):
    """The profile start-up plans with: measured alone on this host, then scaled by how many
    times its CPU time a worker's compute takes when ``workers`` run on ``cores`` shared cores
    (``cluster.crowding``: 1 where each has its own)."""
    return measure_profile(model, batch, model_name=model_name).scaled(crowding(workers, cores))


def agree_on_plan(
    scheduler: str,
    model: torch.nn.Module,
    batch: torch.Tensor,
    session,
    *,
    options: dict | None = None,
    model_name: str = "model",
    fit: AlphaBeta | None = None,
    message_delay: float = 0.0,
) -> RuntimePlan:
    """Worker 0 profiles and plans; every worker returns the same plan and send order. ``fit``
    replaces the start-up calibration with known per-message costs (reproducible plans);
    ``message_delay``, the seconds the senders inject per message (``senders.MessageCost``),
    is added to the cluster's α_worker: calibration measures through the aggregator, not the
    senders, so it cannot see it."""
    planner = make_planner(scheduler, **(options or {}))  # bad options fail on every worker
    started = time.perf_counter()
    elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cost = cost_without_measuring(scheduler, fit) or calibrate(
        session, calibration_sizes(elements), load=lambda: step_load(model, batch)
    )
    remote = remote_workers(session.aggregator) if cost.fit is not None else 0
    cores = shared_host_cores() if cost.fit is not None else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    shards = session.shards or world
    chosen: list = [None]
    if rank == 0:
        profile = start_up_profile(copy.deepcopy(model), batch, model_name, world, cores)
        plan, order, cluster = plan_on(
            planner,
            scheduler,
            profile,
            cost,
            world,
            shards,
            remote=remote,
            cores=cores,
            message_delay=message_delay,
        )
        chosen = [(plan, order, profile, cluster)]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    plan, order, profile, cluster = chosen[0]
    return RuntimePlan(plan, order, profile, cost, cluster, time.perf_counter() - started)

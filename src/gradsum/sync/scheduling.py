"""Choosing a communication plan at the start of training (the shell around ``gradsum.schedule``).

Every worker runs :func:`agree_on_plan` together:

1. **α–β**: a few transfers of known sizes through the actual aggregator (one PS shard when
   shards are addressed one by one; otherwise one aggregator call), every worker taking part as
   in training; worker 0's timings are fitted with :func:`~gradsum.schedule.fit_alpha_beta`.
2. **Profile**: worker 0 times each layer's forward and backward with hooks on a copy of the
   model (so no worker's weights, buffers or gradients change) on one real batch.
3. **Plan**: worker 0 runs the planner on the profile and a :class:`ClusterSpec` derived from the
   fit (:func:`cluster_from_fit`), fixes the send order (``schedule.ordering.send_order``)
   and broadcasts both, so every worker executes the identical plan.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedule import AlphaBeta, ClusterSpec, ModelProfile, Plan, fit_alpha_beta, make_planner
from ..schedule.ordering import send_order
from ..schedule.profiling import measure_profile
from .sharded import time_transfers

CALIBRATION_SIZES = (1 << 10, 1 << 15, 1 << 18)  # fp32 elements: 4 KiB, 128 KiB, 1 MiB


@dataclass(frozen=True)
class RuntimePlan:
    plan: Plan
    order: tuple[int, ...]
    profile: ModelProfile
    fit: AlphaBeta
    cluster: ClusterSpec
    seconds: float  # how long agreeing took

    def describe(self) -> str:
        return (
            f"plan {self.plan.summary()}; α {self.fit.alpha * 1e6:.0f} µs, "
            f"β {1e-6 / self.fit.beta:.0f} MB/s per message (fitted); "
            f"backward {self.profile.backward_s.sum() * 1e3:.1f} ms (measured)"
        )


def cluster_from_fit(fit: AlphaBeta, workers: int, shards: int) -> ClusterSpec:
    """The cluster a measured single-shard round trip implies.

    Calibration sends one message from every worker to one shard and back, which the PS cost
    model describes as two stages of α_worker + n·α_shard + n·M/B_shard (n-way incast). Assumed:
    the shard's port, not the worker's, is the bottleneck, and a worker and a shard spend the same
    time per message; so B_shard = 2n/β, α_worker = α_shard = α/(2(n+1)), and a worker's own port
    is as fast as a shard's. One machine: no NIC is crossed.
    """
    n = workers
    per_message = fit.alpha / (2 * (n + 1))
    bandwidth = 2 * n / fit.beta
    return ClusterSpec(
        workers=n,
        shards=shards,
        machines=1,
        worker_bw=bandwidth,
        shard_bw=bandwidth,
        nic_bw=bandwidth * max(n, shards),
        alpha_worker=per_message,
        alpha_shard=per_message,
    )


def calibrate(aggregator, codec, sizes=CALIBRATION_SIZES) -> AlphaBeta:
    """α, β of one message through the aggregator (all workers call this together)."""
    step = iter(range(1 << 30))
    if hasattr(aggregator, "synchronize_part"):

        def send(tensor: torch.Tensor) -> None:
            key = ("calibrate", tensor.numel())
            aggregator.synchronize_part(0, tensor, codec, key=key, step=next(step))
    else:

        def send(tensor: torch.Tensor) -> None:
            key = ("calibrate", tensor.numel())
            aggregator.synchronize(tensor, codec, key=key, step=next(step))

    return fit_alpha_beta(time_transfers(send, sizes))


def agree_on_plan(
    scheduler: str,
    model: torch.nn.Module,
    batch: torch.Tensor,
    aggregator,
    codec,
    *,
    options: dict | None = None,
    model_name: str = "model",
    fit: AlphaBeta | None = None,
) -> RuntimePlan:
    """Worker 0 profiles and plans; every worker returns the same plan and send order. ``fit``
    replaces the start-up calibration with known per-message costs (reproducible plans)."""
    planner = make_planner(scheduler, **(options or {}))  # bad options fail on every worker
    started = time.perf_counter()
    fit = fit or calibrate(aggregator, codec)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    shards = getattr(aggregator, "num_shards", world)
    chosen: list = [None]
    if rank == 0:
        profile = measure_profile(copy.deepcopy(model), batch, model_name=model_name)
        cluster = cluster_from_fit(fit, world, shards)
        plan = planner(profile, cluster)
        order = send_order(plan, profile, lambda n: fit.time(n * cluster.bytes_per_element))
        chosen = [(plan, order, profile, fit, cluster)]
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    plan, order, profile, fit, cluster = chosen[0]
    return RuntimePlan(plan, order, profile, fit, cluster, time.perf_counter() - started)

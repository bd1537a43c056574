"""Scaling sweeps: every (model, worker count, policy) simulated under one preset.

Speedup is T(1 worker) / T(n workers) for the same number of samples, where T(1 worker) is one
worker training alone with no gradient exchange (its profile's compute time) — the seed's
"single-node training time". Scaling efficiency is speedup / n.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..schedule.planners import make_planner
from .engine import simulate
from .presets import Preset


def sweep(
    preset: Preset,
    models: Iterable[str],
    workers: Iterable[int],
    policies: Iterable[str],
    *,
    iterations: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    rows = []
    for model in models:
        profile = preset.profile(model)
        alone = profile.batch_size / profile.compute_s  # samples/s of one worker, no sync
        for n in workers:
            cluster = preset.cluster(n)
            for policy in policies:
                plan = make_planner(policy)(profile, cluster)
                result = simulate(profile, plan, cluster, iterations)
                speedup = result.throughput / alone
                rows.append(
                    {
                        "model": model,
                        "workers": n,
                        "policy": policy,
                        "throughput": result.throughput,
                        "speedup": speedup,
                        "efficiency": speedup / n,
                        "iteration_s": result.iteration_s,
                        "groups": len(plan.groups),
                        "messages": result.messages,
                    }
                )
                if progress:
                    progress(f"{model} n={n} {policy}")
    return rows

"""Scaling sweeps: every (model, worker count, policy) simulated under one preset.

Speedup is T(1 worker) / T(n workers) for the same number of samples, where T(1 worker) is one
worker training alone with no gradient exchange (its profile's compute time) — the seed's
"single-node training time". Scaling efficiency is speedup / n.

Simulations are independent, so ``processes`` > 1 runs them in that many processes (each row is
the same as in one process: the simulator is deterministic); rows come back in sweep order.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor

from ..schedule.planners import make_planner
from .engine import simulate
from .presets import Preset


def default_processes() -> int:
    """One process per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def simulate_row(preset: Preset, model: str, n: int, policy: str, iterations: int = 3) -> dict:
    """One simulation's row: ``policy`` on ``model`` with ``n`` workers of ``preset``."""
    profile = preset.profile(model)
    alone = profile.batch_size / profile.compute_s  # samples/s of one worker, no sync
    cluster = preset.cluster(n)
    plan = make_planner(policy, **preset.planner_options(policy))(profile, cluster)
    result = simulate(profile, plan, cluster, iterations)
    speedup = result.throughput / alone
    return {
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


def sweep(
    preset: Preset,
    models: Iterable[str],
    workers: Iterable[int],
    policies: Iterable[str],
    *,
    iterations: int = 3,
    progress: Callable[[str], None] | None = None,
    processes: int = 1,
) -> list[dict]:
    cells = [(preset, m, n, p) for m in models for n in list(workers) for p in list(policies)]
    return run_cells(cells, iterations=iterations, progress=progress, processes=processes)


def run_cells(
    cells: list[tuple[Preset, str, int, str]],
    *,
    iterations: int = 3,
    progress: Callable[[str], None] | None = None,
    processes: int = 1,
) -> list[dict]:
    """Each (preset, model, workers, policy) cell's row, in order; one pool for all of them
    (a spawned process pays its imports and profiles once)."""
    if processes <= 1 or len(cells) <= 1:
        rows = []
        for preset, model, n, policy in cells:
            rows.append(simulate_row(preset, model, n, policy, iterations))
            if progress:
                progress(f"{model} n={n} {policy}")
        return rows
    # spawned, not forked: a fork of a process whose torch already ran OpenMP threads can hang
    # in its first convolution (the analytic profile runs one)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(processes, len(cells)), mp_context=spawn) as pool:
        futures = [pool.submit(simulate_row, *cell, iterations) for cell in cells]
        rows = []
        for (_, model, n, policy), future in zip(cells, futures, strict=True):
            rows.append(future.result())
            if progress:
                progress(f"{model} n={n} {policy}")
        return rows

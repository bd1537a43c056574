"""Fit ``imerge-seed-fit``'s free parameters to the seed's findings (``sim/score.py``'s loss).

Free: the per-message cost (α_worker, with α_shard = α_worker / 2 as in ``imerge-seed``), the
baselines' placement ("pieces" or "whole"), the batch per worker and, given ``--shard-gbs``, the
rate one PS core receives and sums at (``shard_bw``: a Python PS process behind TCP over IPoIB
sums well below the 2.5 GB/s of ``imerge-seed``) and, given ``--windows``, what a worker has in
flight (``planners._window``); everything else is ``imerge-seed``'s. One set of values for all
four models (a fit per model would show nothing).
Placement and batch are discrete, so each pair gets its own search over log10 α_worker
(``scipy.optimize.brute`` on a coarse grid: every point is ~40 simulations), and the lowest loss
wins. Run ``python -m gradsum.sim.fit``; it prints every point as it has it, then the best.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from .presets import Preset, get_preset
from .scaling import default_processes
from .score import findings, loss, scored_rows

PLACEMENTS = ("pieces", "whole")
BATCHES = (128, 256)
LOG_ALPHA_RANGE = (-4.0, -2.7)  # 0.1 ms .. 2 ms per message on the worker's thread
GRID_POINTS = 3


def with_parameters(
    base: Preset,
    log_alpha: float,
    placement: str,
    batch: int,
    shard_bw: float | None = None,
    window: str | None = None,
) -> Preset:
    alpha = 10.0**log_alpha
    return dataclasses.replace(
        base,
        alpha_worker=alpha,
        alpha_shard=alpha / 2,
        placement=placement,
        batch_size=batch,
        shard_bw=base.shard_bw if shard_bw is None else shard_bw,
        window=base.window if window is None else window,
    )


def fit(
    base: Preset | None = None,
    processes: int | None = None,
    report=print,
    placements=PLACEMENTS,
    batches=BATCHES,
    alphas_ms=None,
    shard_rates=(None,),
    windows=(None,),
) -> dict:
    """The best point over ``placements`` × ``batches`` × ``shard_rates`` (bytes/s; None keeps
    the base preset's) × ``windows`` (None: the base preset's) × α_worker:
    ``scipy.optimize.brute`` over ``LOG_ALPHA_RANGE``, or exactly the α_worker values
    ``alphas_ms`` (ms) where given, so one grid can be split over several shorter runs."""
    from scipy import optimize

    base = base or get_preset("imerge-seed")
    processes = processes or default_processes()
    best = None
    grid = itertools.product(placements, batches, shard_rates, windows)
    for placement, batch, rate, window in grid:

        def objective(x, placement=placement, batch=batch, rate=rate, window=window):
            preset = with_parameters(base, float(x[0]), placement, batch, rate, window)
            found = findings(scored_rows(preset, processes))
            value = loss(found)
            within = sum(f.within_1_5 for f in found)
            ms = 10 ** x[0] * 1e3
            report(
                f"alpha_worker {ms:.3f} ms, {placement}, batch {batch}, shard "
                f"{preset.shard_bw / 1e9:g} GB/s, window {preset.window}: loss {value:.3f} "
                f"({within} of {len(found)} within 1.5x)"
            )
            return value

        if alphas_ms:
            x, value = min(
                ((math.log10(a * 1e-3), objective([math.log10(a * 1e-3)])) for a in alphas_ms),
                key=lambda point: point[1],
            )
        else:
            x, value, *_ = optimize.brute(
                objective, [LOG_ALPHA_RANGE], Ns=GRID_POINTS, full_output=True, finish=None
            )
        point = {
            "log_alpha": float(x),
            "placement": placement,
            "batch": batch,
            "shard_bw": rate,
            "window": window,
            "loss": value,
        }
        if best is None or value < best["loss"]:
            best = point
    ms = 10 ** best["log_alpha"] * 1e3
    report(
        f"best: alpha_worker {ms:.3f} ms, {best['placement']}, batch {best['batch']}, "
        f"shard {best['shard_bw'] or base.shard_bw:g} B/s, window {best['window'] or base.window}, "
        f"loss {best['loss']:.3f}"
    )
    return best


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--alphas-ms", help="α_worker values to score, e.g. 0.1,0.447 (ms)")
    parser.add_argument("--shard-gbs", help="PS core rates to score, e.g. 0.5,1 (GB/s)")
    parser.add_argument("--windows", help="windows to score: all, group (planners._window)")
    args = parser.parse_args()
    fit(
        report=lambda line: print(line, flush=True),
        placements=args.placements.split(","),
        batches=[int(b) for b in args.batches.split(",")],
        alphas_ms=[float(a) for a in args.alphas_ms.split(",")] if args.alphas_ms else None,
        shard_rates=[float(r) * 1e9 for r in args.shard_gbs.split(",")]
        if args.shard_gbs
        else (None,),
        windows=args.windows.split(",") if args.windows else (None,),
    )

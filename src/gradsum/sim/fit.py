"""Fit ``imerge-seed-fit``'s free parameters to the seed's findings (``sim/score.py``).

Objective: the score's loss over the seed's 16 percentages and 4 implied default efficiencies
plus the order penalty (``score.order_penalty``: every step of imerge > merge > static fusion >
WFBP > default short of the 3 % margin costs as a percentage off by up to 1.5× does), so a
point that gets the percentages but not the seed's ranking scores worse; and the best point is
the one that misses the fewest steps of that order, then the lowest objective (the ranking is
the seed's headline).

Free, with everything else ``imerge-seed``'s: the per-message cost (α_worker, and α_shard:
α_worker / 2 as in ``imerge-seed`` unless given), the baselines' placement ("pieces" or
"whole") and the largest piece a "pieces" placement cuts (``partition_elements``; BytePS's
default is 1,024,000), the batch per worker, the rate one PS core receives and sums at
(``shard_bw``), what a worker has in flight (``window``, ``planners._window``) and what one
message carries before fusion (``unit``: a layer, or each parameter tensor). One set of values
for all four models (a fit per model would show nothing). Every grid point is ~40 simulations;
``--alphas-ms`` and the other lists name the points exactly, so one grid can be split over
several shorter runs. Run ``python -m gradsum.sim.fit --help``; it prints every point as it has
it, then the best.
"""

from __future__ import annotations

import dataclasses
import itertools

from ..schedule.placement import PLACEMENTS
from .presets import Preset, get_preset
from .scaling import default_processes
from .score import findings, loss, order_penalty, order_steps, scored_rows

BATCHES = (128, 256)
ALPHAS_MS = (0.1, 0.3, 1.0)  # α_worker: per message on the worker's thread


def with_parameters(
    base: Preset,
    alpha_worker: float,
    placement: str,
    batch: int,
    shard_bw: float | None = None,
    window: str | None = None,
    *,
    alpha_shard: float | None = None,
    partition: int | None = None,
    unit: str | None = None,
) -> Preset:
    """``base`` with the fit's free parameters (None keeps the base's; α_shard: α_worker / 2)."""
    return dataclasses.replace(
        base,
        alpha_worker=alpha_worker,
        alpha_shard=alpha_worker / 2 if alpha_shard is None else alpha_shard,
        placement=placement,
        batch_size=batch,
        shard_bw=base.shard_bw if shard_bw is None else shard_bw,
        window=base.window if window is None else window,
        partition_elements=base.partition_elements if partition is None else partition,
        unit=base.unit if unit is None else unit,
    )


def objective(preset: Preset, processes: int) -> dict:
    """The score of one point: loss, order penalty, their sum, and how many terms hold."""
    table = scored_rows(preset, processes)
    found, steps = findings(table), order_steps(table)
    return {
        "loss": loss(found),
        "penalty": order_penalty(steps),
        "value": loss(found) + order_penalty(steps),
        "within": sum(f.within_1_5 for f in found),
        "findings": len(found),
        "held": sum(s.holds for s in steps),
        "steps": len(steps),
    }


def describe(preset: Preset) -> str:
    return (
        f"alpha_worker {preset.alpha_worker * 1e3:.3g} ms, alpha_shard "
        f"{preset.alpha_shard * 1e3:.3g} ms, {preset.placement} (partition "
        f"{preset.partition_elements:,}), unit {preset.unit}, batch {preset.batch_size}, shard "
        f"{preset.shard_bw / 1e9:g} GB/s, window {preset.window}"
    )


def fit(
    base: Preset | None = None,
    processes: int | None = None,
    report=print,
    placements=PLACEMENTS,
    batches=BATCHES,
    alphas_ms=ALPHAS_MS,
    shard_rates=(None,),
    windows=(None,),
    alpha_shards_ms=(None,),
    partitions=(None,),
    units=(None,),
) -> dict:
    """The point of the grid (every product of the lists; None keeps the base preset's value,
    for ``alpha_shards_ms`` it is α_worker / 2) that misses the fewest steps of the seed's order,
    and of those the lowest loss + order penalty."""
    base = base or get_preset("imerge-seed")
    processes = processes or default_processes()
    best = None
    grid = itertools.product(
        placements, batches, shard_rates, windows, partitions, units, alpha_shards_ms, alphas_ms
    )
    for placement, batch, rate, window, partition, unit, shard_ms, alpha_ms in grid:
        preset = with_parameters(
            base,
            alpha_ms * 1e-3,
            placement,
            batch,
            rate,
            window,
            alpha_shard=None if shard_ms is None else shard_ms * 1e-3,
            partition=partition,
            unit=unit,
        )
        score = objective(preset, processes)
        report(
            f"{describe(preset)}: loss {score['loss']:.3f} ({score['within']} of "
            f"{score['findings']} within 1.5x), order {score['held']} of {score['steps']} steps "
            f"(penalty {score['penalty']:.3f}), objective {score['value']:.3f}"
        )
        if best is None or _rank(score) < _rank(best["score"]):
            best = {"preset": preset, "score": score}
    report(f"best: {describe(best['preset'])}, objective {best['score']['value']:.3f}")
    return best


def _rank(score: dict) -> tuple[int, float]:
    """The order first (the seed's headline: fewest steps missed), then loss + penalty."""
    return score["steps"] - score["held"], score["value"]


def _floats(text: str | None, scale: float = 1.0):
    return [float(x) * scale for x in text.split(",")] if text else None


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="imerge-seed", help="preset the grid varies")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--alphas-ms", default=",".join(map(str, ALPHAS_MS)),
                        help="α_worker values (ms), e.g. 0.1,0.3")  # fmt: skip
    parser.add_argument("--alpha-shards-ms", help="α_shard values (ms; default α_worker / 2)")
    parser.add_argument("--shard-gbs", help="PS core rates to score, e.g. 2.5,5 (GB/s)")
    parser.add_argument("--windows", help="windows to score: all, group (planners._window)")
    parser.add_argument("--partitions", help="largest pieces (elements), e.g. 1024000,8000000")
    parser.add_argument("--units", help="message units to score: layer, tensor")
    args = parser.parse_args()
    fit(
        base=get_preset(args.base),
        report=lambda line: print(line, flush=True),
        placements=args.placements.split(","),
        batches=[int(b) for b in args.batches.split(",")],
        alphas_ms=_floats(args.alphas_ms),
        shard_rates=_floats(args.shard_gbs, 1e9) or (None,),
        windows=args.windows.split(",") if args.windows else (None,),
        alpha_shards_ms=_floats(args.alpha_shards_ms) or (None,),
        partitions=[int(p) for p in args.partitions.split(",")] if args.partitions else (None,),
        units=args.units.split(",") if args.units else (None,),
    )

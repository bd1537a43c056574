"""`gradsum bench plays`: the PS model's step time of every schedule on a model, static fusion
at every threshold of a fine sweep among them; so, before any run, how much a tuned threshold
leaves to imerge (docs/scheduling.md, "Is imerge ahead of the best tuned baseline?").

Each model is profiled on this host, as `gradsum train` profiles it at start-up (scaled where
the workers outnumber the cores), and every plan is played with ``costs.ps_step_seconds`` on
the cluster start-up makes of ``--fixed-cost`` (``schedule.calibration.cluster_from_fit``: the
testbed's layout, the shards beside the first workers and every node on this host's cores),
with ``--message-delays`` injected per message. Nothing is sent.

    gradsum bench plays --models 'gpt(layers=16,width=128,context=64)',resnet18 \\
        --fixed-cost 0.0046,2.7e-8 --message-delays 0,0.005 --json plays.json

Rows: default, WFBP, static fusion at the best threshold of a sweep by factors of 2 (the sweep a
user runs) and of the finest sweep (``--per-octave`` thresholds to each factor of 2), imerge as
start-up plans it (fewest messages within the fit's resolution) and imerge's search alone (no
resolution). The last line of each model says how far imerge is from the finest sweep's best.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import fixed_cost, positive_int
from ..schedule.placement import PLACEMENTS


@dataclass(frozen=True)
class Play:
    """One plan's play: the PS model's step, its groups and the parts a worker sends a step."""

    schedule: str
    step_s: float
    groups: int
    messages: int


def play(schedule: str, plan, cluster, profile) -> Play:
    from ..schedule.costs import ps_step_seconds

    return Play(
        schedule,
        ps_step_seconds(plan, cluster, profile),
        len(plan.groups),
        sum(len(g.parts) for g in plan.groups),
    )


def best_fusion(profile, cluster, thresholds, label: str, placement: str = "pieces") -> Play:
    """The fastest static fusion over ``thresholds`` by the play; of equal plays, the one with
    fewer messages (a larger threshold), as a user who swept would keep."""
    from ..schedule import make_planner

    best, seen = None, set()
    for threshold in sorted(thresholds, reverse=True):
        plan = make_planner("fusion", threshold=threshold, placement=placement)(profile, cluster)
        groups = tuple((g.start, g.stop) for g in plan.groups)
        if groups in seen:
            continue  # the same groups as a larger threshold: the same play
        seen.add(groups)
        played = play(f"{label} {threshold:,}", plan, cluster, profile)
        if best is None or played.step_s < best.step_s:
            best = played
    return best


# What each row of `plays` is, in order: the policies as `gradsum train --scheduler` plans them,
# static fusion at the best threshold of each sweep, and imerge's search without the
# fewest-messages rule.
ROLES = ("default", "wfbp", "fusion ×2", "fusion finest", "imerge", "imerge search")


def plays(profile, cluster, per_octave: int = 4, placement: str = "pieces") -> dict[str, Play]:
    """Every role's play on ``cluster`` (:data:`ROLES`), the baselines placed by ``placement``
    (``pieces``: BytePS's; ``whole``: each group on one shard, round-robin). imerge places its
    groups over its own spans either way."""
    import dataclasses

    from ..schedule import make_planner
    from ..schedule.grouping import threshold_ladder

    total = profile.total_params
    played = {name: play(name, make_planner(name, placement=placement)(profile, cluster),
                         cluster, profile)
              for name in ("default", "wfbp")}  # fmt: skip
    played["imerge"] = play("imerge", make_planner("imerge")(profile, cluster), cluster, profile)
    for role, ladder in (("fusion ×2", 1), ("fusion finest", per_octave)):
        played[role] = best_fusion(profile, cluster, threshold_ladder(total, ladder), "fusion",
                                   placement)  # fmt: skip
    exact = dataclasses.replace(cluster, resolution=0.0)
    played["imerge search"] = play(
        "imerge, no resolution", make_planner("imerge")(profile, exact), cluster, profile
    )
    return {role: played[role] for role in ROLES}


def parse_model(spec: str) -> tuple[str, dict]:
    """``gpt(layers=16,width=128)`` → the model's name and its size options (checked)."""
    from ..codecs.registry import parse_options, split_spec
    from ..train.models import build_model

    name, text = split_spec(spec)
    options = parse_options(text, what="model size")
    build_model(name, 256, **options)  # an unknown model or size fails here
    return name, options


def profile_model(name: str, options: dict, batch_size: int, workers: int, cores: int | None):
    """The profile start-up would play: measured here, scaled where workers outnumber cores."""
    import torch

    from ..sync.startup import start_up_profile
    from ..train.models import GPTSizes, build_model, input_shape

    torch.manual_seed(0)
    if name == "gpt":
        model = build_model(name, 256, **options)
        context = options.get("context", GPTSizes.context)
        batch = torch.randint(0, 256, (batch_size, context))
    else:
        model = build_model(name, 10)
        batch = torch.randn(batch_size, *input_shape(name))
    return start_up_profile(model, batch, name, workers, cores)


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "plays",
        help="the PS model's step of every schedule on a model: what a tuned threshold leaves",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", required=True,
                        help="comma-separated, sizes in parentheses: "
                        "'gpt(layers=16,width=128,context=64)',resnet18")  # fmt: skip
    parser.add_argument("--batch-size", type=positive_int, default=8, help="per worker")
    parser.add_argument("--fixed-cost", type=fixed_cost, required=True, metavar="ALPHA,BETA",
                        help="the start-up fit to plan with: s per message, s per byte "
                        "(each `gradsum train` plan line prints the one it fitted)")  # fmt: skip
    parser.add_argument("--message-delays", default="0",
                        help="comma-separated seconds injected per message")  # fmt: skip
    parser.add_argument("--workers", type=positive_int, default=4)
    parser.add_argument("--shards", type=positive_int, default=2)
    parser.add_argument("--cores", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="cores every node shares (default: this host's)")  # fmt: skip
    parser.add_argument("--placement", choices=PLACEMENTS, default="pieces",
                        help="where the baselines put a group: BytePS's pieces over the "
                        "least-loaded shards, or whole on one shard, round-robin")  # fmt: skip
    parser.add_argument("--per-octave", type=positive_int, default=4,
                        help="the finest fusion sweep: thresholds per factor of 2")  # fmt: skip
    parser.add_argument("--json", type=Path, help="rows here, one per line, as they come")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from ..schedule import AlphaBeta
    from ..schedule.calibration import cluster_from_fit
    from ..train.methods import split_methods
    from .cli import parse_list

    models = []
    for spec in split_methods(args.models, "--models"):
        try:
            models.append((spec, *parse_model(spec)))
        except (ValueError, TypeError) as error:
            raise UsageError(f"--models {spec}: {error}") from None
    delays = parse_list(args.message_delays, float, "message-delays")
    if any(not 0 <= d < 1 for d in delays):
        raise UsageError(f"--message-delays {args.message_delays}: each in [0, 1) s")
    fit = AlphaBeta(*args.fixed_cost)
    cluster = cluster_from_fit(fit, args.workers, args.shards, args.workers - 1, args.cores)
    for spec, name, options in models:
        # one profile serves every delay: the delay is the cluster's, not the model's
        profile = profile_model(name, options, args.batch_size, args.workers, args.cores)
        for delay in delays:
            rows = plays(
                profile, cluster.with_message_delay(delay), args.per_octave, args.placement
            )
            print(_describe(spec, profile, delay, rows), flush=True)
            if args.json:
                _append(args.json, {
                    "model": spec, "batch_size": args.batch_size, "message_delay": delay,
                    "fixed_cost": list(args.fixed_cost), "workers": args.workers,
                    "shards": args.shards, "cores": args.cores, "placement": args.placement,
                    "params": profile.total_params, "tensors": len(profile.layers),
                    "forward_s": float(profile.forward_s.sum()),
                    "backward_s": float(profile.backward_s.sum()),
                    "plays": {role: asdict(r) for role, r in rows.items()},
                })  # fmt: skip
    return 0


def _append(path: Path, record: dict) -> None:
    """One JSON line, written as soon as its point is played."""
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


def _describe(spec: str, profile, delay: float, rows: dict[str, Play]) -> str:
    compute = (f"forward {profile.forward_s.sum() * 1e3:.0f} ms, backward "
               f"{profile.backward_s.sum() * 1e3:.0f} ms")  # fmt: skip
    lines = [f"{spec}: {profile.total_params:,} parameters in {len(profile.layers)} tensors, "
             f"{compute}; {delay * 1e3:g} ms per message"]  # fmt: skip
    for role, row in rows.items():
        lines.append(f"  {role:<14}{row.step_s * 1e3:9.1f} ms  {row.groups:4d} groups  "
                     f"{row.messages:4d} messages  {row.schedule}")  # fmt: skip
    finest, imerge = rows["fusion finest"].step_s, rows["imerge"].step_s
    lines.append(f"  finest fusion / imerge {finest / imerge:.3f}, / imerge's search "
                 f"{finest / rows['imerge search'].step_s:.3f}; fusion ×2 / imerge "
                 f"{rows['fusion ×2'].step_s / imerge:.3f}")  # fmt: skip
    return "\n".join(lines)

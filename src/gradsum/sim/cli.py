"""`gradsum simulate`: scaling study of scheduling policies on a simulated PS cluster."""

from __future__ import annotations

import argparse

DEFAULT_POLICIES = "default,wfbp,fusion,merge,imerge"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate scheduling policies on a PS cluster and print throughput/speedup tables",
        description="Plan every policy for every worker count with the same planner code a "
        "runtime uses, execute the plans in a discrete-event simulator with a fluid network, and "
        "print throughput and speedup (T(1 worker, no sync) / T(n)).",
    )
    parser.add_argument(
        "--model", default="resnet18", help="model name(s), comma separated (default resnet18)"
    )
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts (default 1,2,4,8)")
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"scheduling policies (default {DEFAULT_POLICIES}); also mgwfbp, priority",
    )
    parser.add_argument(
        "--preset",
        default="imerge-seed",
        help="calibrated cluster and compute model (default imerge-seed)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=3,
        help="iterations simulated; the period is measured from the second on (default 3)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="simulations run in parallel (default 0: one per core)",
    )
    parser.add_argument(
        "--score",
        action="store_true",
        help="score the preset against the IMerge seed's 32-worker findings (all four models; "
        "prints each gain as a percentage and as a throughput ratio, the loss, the order, "
        "the gains with the baselines placed whole and in pieces of at most 1,024,000 and "
        "8,000,000 elements, and priority slicing; --model/--workers/--policies are ignored)",
    )
    parser.add_argument("--json", metavar="PATH", help="write one JSON row per simulation")
    parser.add_argument("--plot", metavar="PATH.png", help="write speedup plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _names(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    from ..cli import UsageError

    names = [item.strip().lower() for item in text.split(",") if item.strip()]
    unknown = [name for name in names if name not in allowed]
    if not names or unknown:
        raise UsageError(f"{flag}: unknown {unknown or text!r}; choose from {', '.join(allowed)}")
    return names


def _worker_counts(text: str) -> list[int]:
    from ..cli import UsageError

    try:
        counts = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"--workers: expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise UsageError(f"--workers: counts must be positive integers, got {text!r}")
    return counts


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from ..schedule.planners import PLANNER_NAMES
    from ..train.config import MODEL_NAMES
    from .presets import PRESET_NAMES, get_preset

    models = _names(args.model, "--model", MODEL_NAMES)
    policies = _names(args.policies, "--policies", PLANNER_NAMES)
    workers = _worker_counts(args.workers)
    if args.preset not in PRESET_NAMES:
        raise UsageError(
            f"--preset: unknown {args.preset!r}; choose from {', '.join(PRESET_NAMES)}"
        )
    if args.processes < 0:
        raise UsageError(f"--processes: expected 0 (one per core) or more, got {args.processes}")
    if args.iterations < 3:
        raise UsageError("--iterations: at least 3 (the first iteration is warm-up)")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise UsageError(f"--plot: expected a .png path, got {args.plot!r}")
    if args.score:
        return _score(get_preset(args.preset), args)
    rows = _run_sweep(get_preset(args.preset), models, workers, policies, args)
    print(format_tables(rows, models, workers, policies))
    if args.json:
        _write_json(args.json, rows, args.preset)
        print(f"wrote {args.json}")
    if args.plot:
        from .plot import plot_speedups

        plot_speedups(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _score(preset, args) -> int:
    from . import score
    from .scaling import default_processes

    processes = args.processes or default_processes()
    table, placed, priority = score.score_tables(preset, processes=processes)
    print(score.format_score(table, score.findings(table), preset.name))
    print(score.format_placements(table, placed, preset))
    print(score.format_priority(table, priority))
    if preset.fitted:
        print(f"\nfitted parameters: {preset.fitted}")
    if preset.measured:
        print(f"\nmeasured parameters: {preset.measured}")
    if args.json:
        _write_json(args.json, list(table.values()), args.preset)
        print(f"wrote {args.json}")
    return 0


def _run_sweep(preset, models, workers, policies, args) -> list[dict]:
    from tqdm import tqdm

    from .scaling import default_processes, sweep

    total = len(models) * len(workers) * len(policies)
    with tqdm(total=total, disable=args.quiet, unit="sim", leave=False) as bar:

        def advance(label: str) -> None:
            bar.set_description(label)
            bar.update()

        return sweep(
            preset,
            models,
            workers,
            policies,
            iterations=args.iterations,
            progress=advance,
            processes=args.processes or default_processes(),
        )


def format_tables(rows: list[dict], models, workers, policies) -> str:
    lookup = {(r["model"], r["workers"], r["policy"]): r for r in rows}
    lines = []
    for model in models:
        for metric, title, fmt in (
            ("throughput", "throughput (samples/s)", "{:>10.0f}"),
            ("speedup", "speedup T(1)/T(n)", "{:>10.2f}"),
        ):
            lines.append(f"\n{model} — {title}")
            lines.append(f"{'workers':>8}" + "".join(f"{p:>10}" for p in policies))
            for n in workers:
                cells = "".join(fmt.format(lookup[(model, n, p)][metric]) for p in policies)
                lines.append(f"{n:>8}" + cells)
    return "\n".join(lines)


def _write_json(path: str, rows: list[dict], preset: str) -> None:
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps([r | {"preset": preset} for r in rows], indent=1) + "\n")

"""The testbed robustness map of the schedules (docs/scheduling.md, "What the testbed measured").

For each point (link rate × injected per-message delay × model) every schedule trains the same
model from the same seed in the testbed, 4 workers and ``--shards`` PS shards, through
``gradsum bench train`` (one call for the PS schedules and one for DDP, each writing its JSON
rows as it goes): default, WFBP, merge, imerge and priority (its default credit); static fusion
at every threshold of ``--thresholds`` (the best is the tuned baseline); and torch DDP
all-reduce (Gloo). With ``--rounds N`` the PS schedules are played N times, the order reversed
every other round (``bench train --rounds``); each round counts as a repeat.

``run`` measures (timing-sensitive: run it with nothing else on the host), ``report`` prints
the table — samples/s per schedule, imerge against the best tuned baseline, whether every
schedule ended with the same parameters (same sums) — and draws the PS model's predicted step
time against the measured one (``--plot``).

    python -m gradsum.bench.robustness run --out map/ --rates 1gbit --delays 0,0.005
    python -m gradsum.bench.robustness report --out map/ --plot predicted.png
    python -m gradsum.bench.robustness report --out r1/ r2/ r3/   # repeats: median, range
    python -m gradsum.bench.robustness run --out duel/ --rounds 6 --schedulers imerge,priority \
        --thresholds '' --no-ddp   # two schedules alternated: A B, B A, ...
    python -m gradsum.bench.robustness run --out gpt/ --models gpt --dataset stdlib \
        --thresholds 400000,800000 --train-flags '--layers 16 --max-steps 40 --batch-size 8'

Over repeats it gives imerge against the best baseline two ways: the median of each repeat's
ratio to that repeat's fastest baseline, and imerge's median over the median of the baseline
that is fastest in the median (``median_ratio``; the first is biased low by noise); each for
the whole run's samples/s and, where the rows carry it, for the median step (``speed``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from ..schedule.placement import PLACEMENTS

PS_SCHEDULES = ("default", "wfbp", "merge", "imerge", "priority")
# PS baselines, with the best static fusion; DDP apart: torch's all-reduce does not go through
# gradsum's senders, so it pays no injected per-message delay
BASELINES = ("default", "wfbp", "priority")
BATCH = 16  # per worker, as `run` trains; rows that carry their own batch size say so


def point_name(rate: str, delay: float, model: str) -> str:
    return f"{model}_{rate}_{delay * 1e3:g}ms"


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    for rate, delay, model in itertools.product(args.rates, args.delays, args.models):
        name = point_name(rate, delay, model)
        common = ["--model", model, "--dataset", args.dataset, "--workers", str(args.workers),
                  "--epochs", str(args.epochs), "--batch-size", str(BATCH), "--lr", str(args.lr),
                  "--link-rate", rate, *args.train_flags]  # fmt: skip
        # the PS path's own: torch DDP's messages do not go through gradsum's senders
        ps_path = ["--message-delay", str(delay), "--window-bytes",
                   str(args.window_bytes or incast_window(rate, args.workers))]  # fmt: skip
        # static fusion at each threshold is one more schedule of the same call, so that rounds
        # alternate it with the others
        fusions = [f"fusion(threshold={threshold})" for threshold in args.thresholds]
        schedules = [placed(s, args.placement) for s in [*args.schedulers, *fusions]]
        calls = [("ps", [*ps_path, "--methods", "ps:none", "--shards", str(args.shards),
                         "--schedulers", ",".join(schedules),
                         "--rounds", str(args.rounds)])]  # fmt: skip
        if args.ddp:
            calls.append(("ddp", ["--methods", "ddp", "--schedulers", "wfbp"]))
        for label, flags in calls:
            path = args.out / f"{name}_{label}.json"
            if path.exists():
                continue  # measured already: a map is built over several calls
            command = [sys.executable, "-m", "gradsum.cli", "bench", "train", *common, *flags,
                       "--json", str(path)]  # fmt: skip
            print(" ".join(command), flush=True)
            if _run_to_the_end(command) in INTERRUPTED:
                raise SystemExit(f"stopped: {path.name} is not complete")


def placed(schedule: str, placement: str) -> str:
    """``schedule`` with the baselines' ``placement`` (docs/scheduling.md, "Partitioning"), where
    its policy takes one and the schedule does not set it: ``fusion(threshold=10000)`` →
    ``fusion(threshold=10000,placement=whole)``. BytePS's ``pieces`` is every policy's default,
    so it leaves the schedule as it is."""
    from ..schedule import parse_scheduler
    from ..schedule.planners import takes_option

    name, options = parse_scheduler(schedule)
    if placement == "pieces" or "placement" in options or not takes_option(name, "placement"):
        return schedule
    inner = schedule.strip()[len(name) :].strip().removeprefix("(").removesuffix(")").strip()
    return f"{name}({inner + ',' if inner else ''}placement={placement})"


# how a `bench train` that was stopped ends: Ctrl-C (130), SIGTERM as SystemExit (143), a signal
INTERRUPTED = {130, 143, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL}


def _run_to_the_end(command: list[str]) -> int:
    """Run ``command``; on Ctrl-C (which reaches it too, in the same process group) wait for it
    to take its testbed down, where ``subprocess.run`` would SIGKILL it after 0.25 s."""
    child = subprocess.Popen(command)
    try:
        return child.wait()
    except KeyboardInterrupt:
        try:
            child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.terminate()  # a testbed that is up comes down on SIGTERM too
            child.wait()
        raise


def incast_window(rate: str, workers: int) -> int:
    """Each worker's window, in bytes: the testbed link's queue over the workers. Every worker
    streams a part to the same PS host at once, so their windows meet in the queue of that
    host's link; larger ones overflow it every round, and a plan of a few large parts, whose
    streams fill the whole window, then pays in retransmissions what a plan of small slices,
    which never fill it, does not (docs/scheduling.md)."""
    from ..testbed.plan import queue_bytes
    from ..testbed.units import parse_rate

    return queue_bytes(parse_rate(rate)) // workers


def load(out: Path) -> list[dict[str, list[dict]]]:
    """Rows by point, one such map per round (``--rounds``; a folder without rounds is one),
    each row labelled with its schedule (static fusion's with its threshold)."""
    from ..schedule import parse_scheduler

    rounds: dict[int, dict[str, list[dict]]] = {}
    for path in sorted(out.glob("*.json")):
        name, _, label = path.stem.rpartition("_")
        for row in json.loads(path.read_text()):
            policy_name, options = parse_scheduler(row["scheduler"])
            if row["aggregator"] == "ddp":
                row["schedule"] = "ddp"
            elif label.startswith("fusion"):  # a folder from before fusion shared the PS call
                row["schedule"] = f"fusion {int(label[6:]):,}"
            elif policy_name == "fusion" and "threshold" in options:
                whole = ", whole" if options.get("placement") == "whole" else ""
                row["schedule"] = f"fusion {int(options['threshold']):,}{whole}"
            else:
                row["schedule"] = row["scheduler"]
            # a point is its shards too: folders of 2 and of 4 are not repeats of each other
            point = f"{name}, {row['shards']} shards" if row.get("shards") else name
            rounds.setdefault(row.get("round", 0), {}).setdefault(point, []).append(row)
    return [rounds[k] for k in sorted(rounds)]


SPEEDS = ("samples", "step")


def speed(row: dict, by: str = "samples") -> float | None:
    """A run's samples/s: over the whole run (``samples``, every stall included), or at its
    median step (``step``, rows that carry ``median_step_s``); None where the run has none."""
    if by == "step":
        median = row.get("median_step_s")
        return samples_per_step(row) / median if median else None
    return row.get("samples_per_s") or None


def samples_per_step(row: dict) -> int:
    """Samples every worker together trains a step: the row's batch size, where it has one
    (`bench train` with the gpt model runs its own), else ``run``'s."""
    return row["workers"] * (row.get("batch_size") or BATCH)


def step_seconds(row: dict, by: str = "samples") -> float | None:
    fast = speed(row, by)
    return samples_per_step(row) / fast if fast else None


def is_baseline(schedule: str) -> bool:
    """A tuned PS baseline: default, WFBP, priority at any credit, or static fusion."""
    return policy(schedule) in BASELINES or schedule.startswith("fusion")


def _schedules(text: str) -> list[str]:
    """``--schedulers``, each checked as ``bench train`` checks it (options in parentheses)."""
    from .train import parse_schedulers

    return parse_schedulers(text)


def policy(schedule: str) -> str:
    """The policy of a schedule label: ``priority(credit_elements=1000000)`` → ``priority``."""
    return schedule.partition("(")[0]


def best_baseline(rows: list[dict], by: str = "samples") -> dict | None:
    """The fastest of default, WFBP, priority (at any credit run) and static fusion at its best
    threshold."""
    fast = [r for r in rows if speed(r, by)]
    fusions = [r for r in fast if r["schedule"].startswith("fusion")]
    baselines = [r for r in fast if policy(r["schedule"]) in BASELINES]
    baselines += [max(fusions, key=lambda r: speed(r, by))] if fusions else []
    return max(baselines, key=lambda r: speed(r, by), default=None)


def imerge_ratio(rows: list[dict], by: str = "samples") -> float | None:
    """imerge's speed over the best tuned PS baseline's at one point."""
    best = best_baseline(rows, by)
    imerge = next((r for r in rows if r["schedule"] == "imerge" and speed(r, by)), None)
    return speed(imerge, by) / speed(best, by) if best and imerge else None


def report(args: argparse.Namespace) -> None:
    measured = []
    for out in args.out:
        rounds = load(out)
        for k, points in enumerate(rounds):
            print(f"\n### {out}" + (f", round {k + 1}" if len(rounds) > 1 else ""))
            for name, rows in points.items():
                report_point(name, rows)
        measured += rounds
    if len(measured) > 1:
        for by in SPEEDS:
            report_repeats(measured, by)
    if args.plot:  # one colour per point, its repeats together
        together: dict[str, list[dict]] = {}
        for points in measured:
            for name, rows in points.items():
                together.setdefault(name, []).extend(rows)
        plot(together, args.plot, args.by)


def report_repeats(measured: list[dict[str, list[dict]]], by: str = "samples") -> None:
    """Per point measured in several folders: each schedule's median speed (``speed``) and
    range, and imerge against the best baseline (each repeat's, and by medians)."""
    names = sorted({name for points in measured for name in points})
    what = "samples/s" if by == "samples" else "samples/s at the median step"
    for name in names:
        repeats = [points[name] for points in measured if name in points]
        if len(repeats) < 2 or not any(speed(r, by) for rows in repeats for r in rows):
            continue
        print(f"\n{name}: {len(repeats)} repeats, median (min-max) {what}")
        schedules = dict.fromkeys(r["schedule"] for rows in repeats for r in rows)
        for schedule in schedules:
            speeds = [speed(r, by) for rows in repeats for r in rows
                      if r["schedule"] == schedule and speed(r, by)]  # fmt: skip
            if speeds:
                print(f"  {schedule:<18}{statistics.median(speeds):8.1f} "
                      f"({min(speeds):.1f}-{max(speeds):.1f}, {len(speeds)} runs)")  # fmt: skip
        ratios = [x for x in (imerge_ratio(rows, by) for rows in repeats) if x is not None]
        if ratios:
            print(f"  imerge / best tuned PS baseline, same repeat: median "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}; "
                  + ", ".join(f"{x:.2f}" for x in ratios) + ")")  # fmt: skip
        medians = median_ratio(repeats, by)
        if medians is not None:
            ratio, best = medians
            print(f"  imerge's median / the best baseline's median ({best}): {ratio:.2f}")


def median_ratio(repeats: list[list[dict]], by: str = "samples") -> tuple[float, str] | None:
    """imerge's median speed over the best tuned baseline's median, and that baseline.

    The per-repeat ratio divides by the fastest of several baselines in each repeat, and the
    fastest of several noisy runs is biased upwards even where every plan runs alike (on this
    host identical plans differ by up to 20 % between runs); choosing the baseline by its
    median over the repeats first is not."""
    speeds: dict[str, list[float]] = {}
    for rows in repeats:
        for r in rows:
            if fast := speed(r, by):
                speeds.setdefault(r["schedule"], []).append(fast)
    medians = {schedule: statistics.median(values) for schedule, values in speeds.items()}
    baselines = {s: m for s, m in medians.items() if is_baseline(s)}
    if "imerge" not in medians or not baselines:
        return None
    best = max(baselines, key=baselines.get)
    return medians["imerge"] / baselines[best], best


def report_point(name: str, rows: list[dict]) -> None:
    print(f"\n{name}")
    by = {r["schedule"]: r for r in rows}
    for schedule, row in by.items():
        fast = row["samples_per_s"]
        cell = f"{fast:8.1f} samples/s" if fast else "  failed"
        predicted, median = row.get("predicted_step_s"), row.get("median_step_s")
        extra = f"  step {step_seconds(row):.3f} s" if fast else ""
        extra += f", median {median:.3f} s" if median else ""
        extra += f", predicted {predicted:.3f} s" if predicted else ""
        print(f"  {schedule:<18}{cell}{extra}  digest {row.get('parameter_digest', '')[:8]}")
        if row.get("plan"):
            print(f"  {'':<18}{row['plan']}")
    best, ratio = best_baseline(rows), imerge_ratio(rows)
    if ratio is not None:
        print(f"  imerge / best tuned PS baseline ({best['schedule']}): {ratio:.2f}")
        ddp = by.get("ddp")
        if ddp and ddp["samples_per_s"]:
            ratio = by["imerge"]["samples_per_s"] / ddp["samples_per_s"]
            print(f"  imerge / DDP all-reduce (no injected delay): {ratio:.2f}")
    ps = [r for r in rows if r["aggregator"] == "ps" and r.get("parameter_digest")]
    same = len({r["parameter_digest"] for r in ps}) == 1
    print(f"  PS schedules ended with the same parameters: {same}")


def plot(points: dict[str, list[dict]], path: Path, by: str = "samples") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(4.8, 4.2))
    top, bottom = 0.0, float("inf")
    for name, rows in points.items():
        pairs = [(r["predicted_step_s"], step_seconds(r, by), r["schedule"]) for r in rows
                 if r.get("predicted_step_s") and step_seconds(r, by)]  # fmt: skip
        if pairs:
            axis.scatter([p for p, _, _ in pairs], [m for _, m, _ in pairs], label=name)
            for p, m, schedule in pairs:
                axis.annotate(schedule, (p, m), fontsize="x-small")
            top = max(top, *(max(p, m) for p, m, _ in pairs))
            bottom = min(bottom, *(min(p, m) for p, m, _ in pairs))
    # steps of 10 ms and of 0.4 s in one plot: on linear axes the short ones are one dot
    spread = top > 10 * bottom
    diagonal = [bottom / 1.5, top * 1.5] if spread else [0, top * 1.1]
    axis.plot(diagonal, diagonal, color="grey", linestyle=":", label="measured = predicted")
    if spread:
        axis.set_xscale("log")
        axis.set_yscale("log")
    axis.set_xlabel("PS model's step time (s)")
    axis.set_ylabel("measured step time (s)" + (", median" if by == "step" else ""))
    axis.legend(fontsize="x-small")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("run")
    measure.add_argument("--out", type=Path, required=True)
    measure.add_argument("--rates", type=lambda t: t.split(","), default=["1gbit"])
    measure.add_argument("--delays", type=lambda t: [float(x) for x in t.split(",")],
                         default=[0.0, 0.005])  # fmt: skip
    measure.add_argument("--models", type=lambda t: t.split(","), default=["digits-wide"])
    measure.add_argument("--thresholds", type=lambda t: [int(x) for x in t.split(",") if x],
                         default=[4_300_000, 5_000_000],
                         help="static fusion's thresholds ('' for none)")  # fmt: skip
    measure.add_argument("--schedulers", type=_schedules, default=list(PS_SCHEDULES),
                         help="the PS schedules, options in parentheses (repeats of a point: "
                         "the contenders; ablations: 'imerge(interleave=true,window=group)'; "
                         "priority at a credit: 'priority(credit_elements=1000000)')")  # fmt: skip
    measure.add_argument("--placement", choices=PLACEMENTS, default="pieces",
                         help="where the baselines (default, WFBP, static fusion, merge) put "
                         "a group: BytePS's pieces, or whole on one shard, round-robin; "
                         "imerge and priority place by their own rules")  # fmt: skip
    measure.add_argument("--dataset", default="digits")
    measure.add_argument("--workers", type=int, default=4)
    measure.add_argument("--shards", type=int, default=2)
    measure.add_argument("--epochs", type=int, default=1)
    measure.add_argument("--lr", type=float, default=0.02)
    measure.add_argument(
        "--window-bytes",
        type=int,
        default=None,
        help="each worker's window per PS stream (default: the testbed "
        "link's queue over the workers, so that their windows fit it)",
    )
    measure.add_argument("--train-flags", type=shlex.split, default=[],
                         help="more `bench train` flags for every run, in one string; later "
                         "ones win: '--layers 16 --width 128 --context 64 --max-steps 40 "
                         "--batch-size 8' with --models gpt --dataset stdlib")  # fmt: skip
    measure.add_argument("--rounds", type=int, default=1,
                         help="play the PS schedules this many times, the order reversed every "
                         "other round; each round is a repeat in the report")  # fmt: skip
    measure.add_argument(
        "--no-ddp",
        dest="ddp",
        action="store_false",
        help="leave out DDP (repeats of a point compare the PS schedules)",
    )
    summary = commands.add_parser("report")
    summary.add_argument(
        "--out",
        type=Path,
        nargs="+",
        required=True,
        help="one folder, or several: repeats of the same points",
    )
    summary.add_argument("--plot", type=Path)
    summary.add_argument(
        "--by", choices=SPEEDS, default="samples",
        help="the plot's measured step: the whole run's mean, or its median step",
    )  # fmt: skip
    args = parser.parse_args(argv)
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()

"""`gradsum bench train`: training throughput per aggregator x codec, side by side in one run.

Every combination trains the same model with the same seed on the same local workers, one after
the other; the table reports samples/s, the ratio to the first row (the baseline), and test
accuracy, so speed never hides a loss of accuracy.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .cli import positive_int

DEFAULT_METHODS = (
    "allreduce:none",
    "allreduce:fp16",
    "allreduce:thc",
    "switch:bfp",
    "switch:thc",
    "ps:none",
    "ps:thc",
    "ps:topk",
)


@dataclass
class TrainRow:
    method: str
    aggregator: str
    codec: str
    scheduler: str
    model: str
    workers: int
    epochs: int
    samples_per_s: float
    test_accuracy: float
    train_seconds: float
    link_rate: str = "loopback"
    plan: str = ""  # what the scheduler chose at start-up (groups, fitted α and β)


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "train",
        help="training samples/s and accuracy per aggregator x codec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated AGGREGATOR:CODEC pairs; the first is the baseline",
    )
    parser.add_argument(
        "--schedulers",
        default="wfbp",
        help="comma-separated communication schedules, each run with every method "
        "(e.g. default,wfbp,imerge; see docs/scheduling.md)",
    )
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--model", default="digits-mlp")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--workers", type=positive_int, default=4)
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=16, help="per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--link-rate",
        help="run inside an emulated cluster (gradsum testbed; root) whose links have this rate, "
        "e.g. 100mbit: a switch host, or one PS shard per worker host",
    )
    parser.add_argument("--json", type=Path, help="write the rows as a JSON list here")
    parser.set_defaults(run=run)


def parse_methods(text: str) -> list[tuple[str, str]]:
    from ..cli import UsageError
    from ..train.aggregators import IncompatibleChoice, check_compatible

    methods = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        aggregator, sep, codec = item.partition(":")
        if not sep:
            raise UsageError(f"--methods: {item!r} is not AGGREGATOR:CODEC")
        try:
            check_compatible(aggregator, codec)
        except (IncompatibleChoice, ValueError) as error:
            raise UsageError(f"--methods {item}: {error}") from None
        methods.append((aggregator, codec))
    if not methods:
        raise UsageError("--methods is empty")
    return methods


def parse_schedulers(text: str) -> list[str]:
    from ..cli import UsageError
    from ..schedule import PLANNER_NAMES

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PLANNER_NAMES]
    if unknown or not names:
        raise UsageError(f"--schedulers {text!r}: choose from {', '.join(PLANNER_NAMES)}")
    return names


def run(args: argparse.Namespace) -> int:

    methods = parse_methods(args.methods)
    schedulers = parse_schedulers(args.schedulers)
    rows = []
    for aggregator, codec in methods:
        summaries = (
            _testbed_summaries(args, aggregator, codec, schedulers)
            if args.link_rate
            else [_local_summary(args, aggregator, codec, s) for s in schedulers]
        )
        for scheduler, summary in zip(schedulers, summaries, strict=True):
            rows.append(
                TrainRow(
                    method=f"{aggregator}:{codec}/{scheduler}",
                    aggregator=aggregator,
                    codec=codec,
                    scheduler=scheduler,
                    model=args.model,
                    workers=args.workers,
                    epochs=args.epochs,
                    samples_per_s=summary["samples_per_s"],
                    test_accuracy=summary["test_accuracy"],
                    train_seconds=summary["train_seconds"],
                    link_rate=args.link_rate or "loopback",
                    plan=summary.get("plan", ""),
                )
            )
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0


def _local_summary(args, aggregator: str, codec: str, scheduler: str) -> dict:
    from ..train.launch import run_local
    from ..train.loop import TrainConfig

    print(f"  training with {aggregator}:{codec}, scheduler {scheduler} ...", flush=True)
    config = TrainConfig(
        aggregator=aggregator,
        codec=codec,
        scheduler=scheduler,
        model=args.model,
        dataset=args.dataset,
        workers=args.workers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        progress=False,
    )
    return run_local(config)


def _testbed_summaries(args, aggregator: str, codec: str, schedulers: list[str]) -> list[dict]:
    from .train_testbed import train_in_testbed

    flags = ["--codec", codec, "--model", args.model, "--dataset", args.dataset]
    flags += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    flags += ["--lr", str(args.lr), "--seed", str(args.seed)]
    return train_in_testbed(
        aggregator, schedulers, rate=args.link_rate, workers=args.workers, train_flags=flags
    )


def format_table(rows: list[TrainRow]) -> str:
    base = rows[0].samples_per_s or 1.0
    lines = [
        f"model={rows[0].model}  workers={rows[0].workers}  epochs={rows[0].epochs}  "
        f"links={rows[0].link_rate}",
        f"{'method':<24} {'samples/s':>10} {'vs ' + rows[0].method:>28} {'test acc':>9}",
    ]
    for row in rows:
        lines.append(
            f"{row.method:<24} {row.samples_per_s:>10,.0f} {row.samples_per_s / base:>27.2f}x "
            f"{row.test_accuracy:>9.4f}"
        )
    plans = [f"  {row.method}: {row.plan}" for row in rows if row.plan]
    if plans:
        lines += ["plans:", *plans]
    return "\n".join(lines)

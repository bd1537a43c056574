"""`gradsum bench train`: training throughput per aggregator x codec, side by side in one run.

Every combination trains the same model with the same seed on the same local workers, one after
the other; the table reports samples/s, the ratio to the first row (the baseline), and test
accuracy, so speed never hides a loss of accuracy.

With ``--rounds N`` the schedulers are played N times, the order reversed every other round
(A B C, C B A, A B C, ...): this host's speed drifts by tens of percent over minutes, and a
comparison of runs in the same round, with the drift falling on each schedule alike over two
rounds, tells apart differences a fixed order would hide. Rows carry their round.

Each row is printed as soon as its run ends (and, with --json, the file rewritten), so a crash
later loses nothing. A run that fails becomes a failed row carrying its error (the failed
worker's rank, its exception's type and message) and the next runs; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..config import positive_int
from ..failures import Failure, report

DEFAULT_METHODS = (
    "allreduce:none",
    "allreduce:fp16",
    "allreduce:thc",
    "switch:bfp",
    "switch:thc",
    "ps:none",
    "ps:thc",
    "ps:topk",
    "allreduce:powersgd",
    "switch:powersgd",
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
    samples_per_s: float | None  # None (and so the two below) when the run failed
    test_accuracy: float | None
    train_seconds: float | None
    link_rate: str = "loopback"
    plan: str = ""  # what the scheduler chose at start-up (groups, fitted α and β)
    error: Failure | None = None  # why the run failed: worker rank, exception type and message
    message_delay: float = 0.0  # s injected per message on each worker's communication thread
    final_loss: float | None = None
    val_loss: float | None = None  # a step-based run's last validation loss (gpt)
    # a digest of the trained parameters: equal across schedules that summed the same gradients
    parameter_digest: str = ""
    # the PS model's time per step for the plan the run made (None where it has none)
    predicted_step_s: float | None = None
    median_step_s: float | None = None  # the training's median step (train/loop.py)
    # worker 0's datagram counters in training (``Aggregator.transport_stats``): what loss
    # recovery cost it
    transport: dict = field(default_factory=dict)
    transport_start_up: dict = field(default_factory=dict)  # the same, sent before training
    round: int = 0  # which of --rounds played this run
    batch_size: int | None = None  # per worker (None in rows written before it was kept)
    # PS shards in the testbed (None: another aggregator, loopback, or a row from before)
    shards: int | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


# a bench's runs: two epochs each, quiet but for their rows
DEFAULTS = dict(epochs=2, progress=False)


def register(benches: argparse._SubParsersAction) -> None:
    from ..config import add_flags
    from ..train.config import BENCH_SECTIONS, METHODS, SCHEDULERS, TrainConfig

    parser = benches.add_parser(
        "train",
        help="training samples/s and accuracy per aggregator x codec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--link-rate",
        help="run inside an emulated cluster (gradsum testbed; root) whose links have this rate, "
        "e.g. 100mbit: a switch host, or one PS shard per worker host",
    )
    parser.add_argument(
        "--shards", type=positive_int,
        help="PS shards in the testbed, beside the first workers (default: one per worker)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=positive_int, default=1,
        help="play the schedulers this many times, the order reversed every other round, so "
        "the host's drift falls on each alike",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows as a JSON list here")
    sweeps = {METHODS: ",".join(DEFAULT_METHODS), SCHEDULERS: "wfbp"}
    add_flags(parser, BENCH_SECTIONS, TrainConfig(**DEFAULTS), sweeps)
    parser.set_defaults(run=run)


def played_order(schedulers: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, scheduler) in the order they run: the list, then reversed, and so on."""
    return [
        (k, scheduler)
        for k in range(rounds)
        for scheduler in (schedulers if k % 2 == 0 else schedulers[::-1])
    ]


def parse_schedulers(text: str) -> list[str]:
    """``--schedulers``: policies, each with its options in parentheses if any
    (``wfbp,imerge(interleave=true)``), checked as ``gradsum train --scheduler`` checks one."""
    from ..cli import UsageError
    from ..schedule import parse_scheduler
    from ..train.methods import split_methods

    specs = split_methods(text, "--schedulers")
    for spec in specs:
        try:
            parse_scheduler(spec)
        except ValueError as error:
            raise UsageError(f"--schedulers {spec!r}: {error}") from None
    return specs


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from ..config import runs_from
    from ..devices import configured_device
    from ..train.config import BENCH_SECTIONS, TrainConfig
    from ..train.methods import parse_methods

    if args.shards is not None and not args.link_rate:
        raise UsageError("--shards places PS shards in the testbed: give --link-rate too")
    methods = parse_methods(args.methods)
    order = played_order(parse_schedulers(args.schedulers), args.rounds)
    schedulers = [scheduler for _, scheduler in order]
    runs = [{**fields, "scheduler": s} for _, fields in methods for s in dict.fromkeys(schedulers)]
    base, _ = runs_from(args, BENCH_SECTIONS, TrainConfig(**DEFAULTS), runs)
    base = configured_device(args, BENCH_SECTIONS, base)
    rows = _Rows(args.json)
    try:
        for name, fields in methods:
            outcomes = (
                _testbed_outcomes(args, base, fields, schedulers)
                if args.link_rate
                else _local_outcomes(base, fields, schedulers)
            )
            with contextlib.closing(outcomes):  # a testbed comes down now, also on a failure
                for (k, _), (scheduler, outcome) in zip(order, outcomes, strict=True):
                    config = replace(base, **fields, scheduler=scheduler)
                    rows.add(replace(_row(args, name, config, outcome), round=k))
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM while a testbed is up
        kept = f", kept in {args.json}" if args.json else ""
        print(
            f"gradsum bench train: stopped with {len(rows.rows)} of "
            f"{len(methods) * len(schedulers)} runs done{kept}",
            file=sys.stderr,
            flush=True,
        )
        raise
    print(format_table(rows.rows))
    if args.json:
        print(f"wrote {len(rows.rows)} rows to {args.json}")
    return 1 if any(row.failed for row in rows.rows) else 0


class _Rows:
    """The rows so far. Each is printed when it comes and the --json file rewritten with all of
    them, so whatever happens to the run later, every finished row is kept."""

    def __init__(self, path: Path | None):
        self.path = path
        self.rows: list[TrainRow] = []

    def add(self, row: TrainRow) -> None:
        self.rows.append(row)
        if row.error is not None:
            report(f"  {row.method}", row.error, file=sys.stdout)
        else:
            print(
                f"  {row.method}: {row.samples_per_s:,.0f} samples/s, {_quality(row)} "
                f"({row.train_seconds:.1f} s training)",
                flush=True,
            )
        if self.path:
            write_rows(self.path, [asdict(r) for r in self.rows])


def write_rows(path: Path, rows: list[dict]) -> None:
    """The rows so far as a JSON list: a sibling then a rename, so a crash mid-write leaves the
    previous file, not half of one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(rows, indent=2, default=str) + "\n")
    os.replace(partial, path)


def _row(args, name: str, config, outcome: dict | Failure) -> TrainRow:
    """The row of one run: from rank 0's summary, or the failure that ended it."""
    error = outcome if isinstance(outcome, Failure) else None
    summary = {} if error else outcome
    testbed_shards = args.shards or config.workers  # train_in_testbed's default: one per worker
    return TrainRow(
        method=f"{name}/{config.scheduler}",
        aggregator=config.aggregator,
        codec=name.partition(":")[2] or "allreduce" if config.aggregator == "ddp" else config.codec,
        scheduler=config.scheduler,
        model=config.model,
        workers=config.workers,
        epochs=config.epochs,
        samples_per_s=summary.get("samples_per_s"),
        test_accuracy=summary.get("test_accuracy"),
        train_seconds=summary.get("train_seconds"),
        link_rate=args.link_rate or "loopback",
        plan=summary.get("plan", ""),
        error=error,
        message_delay=config.message_delay,
        final_loss=summary.get("final_loss"),
        val_loss=summary.get("val_loss"),
        parameter_digest=summary.get("parameter_digest", ""),
        predicted_step_s=summary.get("predicted_step_s"),
        median_step_s=summary.get("median_step_s"),
        transport=summary.get("transport") or {},
        transport_start_up=summary.get("transport_start_up") or {},
        batch_size=config.batch_size,
        shards=testbed_shards if config.aggregator == "ps" and args.link_rate else None,
    )


def _local_outcomes(
    base, fields: dict, schedulers: list[str]
) -> Iterator[tuple[str, dict | Failure]]:
    """Each scheduler's run on local workers: rank 0's summary, or why it failed."""
    from ..train.launch import run_local
    from ..train.methods import method_name

    for scheduler in schedulers:
        config = replace(base, **fields, scheduler=scheduler)
        print(f"  training with {method_name(config)}, scheduler {scheduler} ...", flush=True)
        try:
            outcome: dict | Failure = run_local(config)
        except Exception as error:  # this row fails; the next may well not
            outcome = Failure.of(error)
        yield scheduler, outcome


def _testbed_outcomes(
    args, base, fields: dict, schedulers: list[str]
) -> Iterator[tuple[str, dict | Failure]]:
    """Each scheduler's run in the testbed, as it ends; when the testbed or its aggregators fail,
    that failure is every remaining run's."""
    from .train_testbed import train_flags, train_in_testbed

    config = replace(base, **fields, scheduler=schedulers[0])  # the testbed adds each's scheduler
    jobs = train_in_testbed(
        config.aggregator, schedulers, rate=args.link_rate, workers=config.workers,
        train_flags=train_flags(config), shards=args.shards,
    )  # fmt: skip
    # next() apart from the yield: only the testbed's own errors are caught, never one thrown
    # into this generator (GeneratorExit when the caller stops early)
    done, failure = 0, None
    with contextlib.closing(jobs):
        while done < len(schedulers):
            try:
                scheduler, outcome = next(jobs)
            except Exception as error:
                failure = Failure.of(error)
                break
            done += 1
            yield scheduler, outcome
    for scheduler in schedulers[done:]:  # none are left unless the testbed failed
        yield scheduler, failure


def _quality(row: TrainRow) -> str:
    """What the run reached: test accuracy where the model has one, else its validation loss
    (a step-based run of the gpt model), else its last training loss."""
    if row.test_accuracy is not None:
        return f"test accuracy {row.test_accuracy:.4f}"
    if row.val_loss is not None:
        return f"validation loss {row.val_loss:.4f}"
    if row.final_loss is not None:
        return f"final loss {row.final_loss:.4f}"
    return "no test accuracy"


def format_table(rows: list[TrainRow]) -> str:
    """The rows with their ratio to the baseline: the first row, or the first that ran when it
    failed (the header names it). Failed rows' errors are listed under the table."""
    base = next((row for row in rows if not row.failed), None)
    lines = [
        f"model={rows[0].model}  workers={rows[0].workers}  epochs={rows[0].epochs}  "
        f"links={rows[0].link_rate}",
        f"{'method':<24} {'samples/s':>10} {'vs ' + (base.method if base else '-'):>28} "
        f"{'test acc':>9}",
    ]
    rounds = any(row.round for row in rows)
    for row in rows:
        label = f"{row.method} #{row.round + 1}" if rounds else row.method
        if row.failed:
            lines.append(f"{label:<24} {'failed':>10} {'-':>28} {'-':>9}")
            continue
        ratio = row.samples_per_s / (base.samples_per_s or 1.0)
        accuracy = "-" if row.test_accuracy is None else f"{row.test_accuracy:.4f}"
        lines.append(f"{label:<24} {row.samples_per_s:>10,.0f} {ratio:>27.2f}x {accuracy:>9}")
    plans = [f"  {row.method}: {row.plan}" for row in rows if row.plan]
    if plans:
        lines += ["plans:", *plans]
    failures = [f"  {row.method}: {row.error}" for row in rows if row.error is not None]
    if failures:
        lines += ["failed:", *failures]
    return "\n".join(lines)

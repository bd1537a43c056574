"""`gradsum bench tta`: time to a target validation loss, each method side by side in one run.

Every method trains the same model from the same seed on the same data, through the same
launcher (local workers on loopback, or one worker per host of an emulated cluster with
``--link-rate``), one after the other: gradsum's AGGREGATOR:CODEC pairs and what a PyTorch user
has already (``ddp``: DDP's fp32 all-reduce; ``ddp:fp16``, ``ddp:bf16``: its compress hooks;
``ddp:powersgdR``: torch's PowerSGD hook at rank R with error feedback and warm start; gradsum's
with local steps, ``allreduce:none+diloco(h=32)`` the unquantized DiLoCo peer). Each
run trains for ``--time-budget`` seconds (or ``--max-steps``) and evaluates every
``--eval-every`` steps on the same validation samples, outside the timed region.

Reported per method: the seconds of training until the validation loss first reached ``--target-
loss`` and the baseline's time divided by it (the first method is the baseline), the final
validation loss and bits per byte, the validation loss at the last step every run evaluated (the
same number of steps) and its gap to the baseline's, the steps taken and seconds per step, and
the bytes each worker sends per step (steady state). The header gives the baseline's
communication-to-compute ratio: (seconds per step − seconds of forward and backward alone, every
worker computing at once) / the latter. Rows are printed and (``--json``) written as each run
ends; ``--plot`` draws validation loss against training seconds and against steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..failures import Failure
from ..train.methods import parse_methods
from .cli import parse_list
from .train_testbed import train_flags

DEFAULT_METHODS = (
    "ddp",
    "ddp:fp16",
    "ddp:bf16",
    "ddp:powersgd2",
    "ddp:powersgd4",
    "allreduce:thc",
    "switch:bfp",
    "switch:thc",
)


@dataclass
class TTARow:
    method: str
    link_rate: str
    workers: int
    seed: int = 0
    steps: int | None = None
    train_seconds: float | None = None
    step_s: float | None = None
    compute_s: float | None = None
    comm_to_compute: float | None = None  # (step_s - compute_s) / compute_s
    time_to_target: float | None = None  # None: target not reached
    final_val_loss: float | None = None
    bits_per_byte: float | None = None
    bytes_per_step: int | None = None  # one worker's, sent, in steady state
    fallbacks: int | None = None
    evals: list[dict] = field(default_factory=list)
    error: Failure | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


# a TTA run: AdamW, the gpt model on the stdlib text, an evaluation every 10 steps on 64
# windows, 120 s each, static fusion into groups of a million elements as DDP fuses its buckets
DEFAULTS = dict(model="gpt", dataset="stdlib", batch_size=4, lr=1e-3, optimizer="adamw",
                scheduler="fusion", fusion_elements=1 << 20, eval_every=10, eval_samples=64,
                time_budget=120.0, progress=False)  # fmt: skip


def register(benches: argparse._SubParsersAction) -> None:
    from ..config import add_flags
    from ..train.config import BENCH_SECTIONS, METHODS, SEEDS, TrainConfig

    parser = benches.add_parser(
        "tta",
        help="time to a target validation loss per method (gradsum's and torch DDP's hooks)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--link-rate",
        help="run in an emulated cluster (gradsum testbed; root) with links of this rate, "
        "e.g. 100mbit; default: local workers on loopback",
    )
    parser.add_argument("--stop-at-target", action="store_true",
                        help="end each run once it reaches --target-loss")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows as a JSON list here")
    parser.add_argument("--plot", type=Path, help="PNG: validation loss vs seconds and steps")
    parser.add_argument(
        "--from-json", type=Path,
        help="train nothing: tabulate (and --plot) the rows of an earlier --json, with this "
        "run's --target-loss",
    )  # fmt: skip
    sweeps = {METHODS: ",".join(DEFAULT_METHODS), SEEDS: "0"}
    add_flags(parser, BENCH_SECTIONS, TrainConfig(**DEFAULTS), sweeps)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from ..config import given, runs_from
    from ..devices import configured_device
    from ..train.config import BENCH_SECTIONS, TrainConfig

    target = given(args, BENCH_SECTIONS).get("target_loss")
    if args.from_json:
        rows = [with_target(row_from_dict(r), target)
                for r in json.loads(args.from_json.read_text())]  # fmt: skip
        print(format_table(rows, target))
        if args.plot:
            plot_runs(rows, args.plot, target)
        return 0
    methods = parse_methods(args.methods)
    seeds = parse_seeds(args.seeds)
    # a seed's methods together: one seed's table is whole early
    runs = [(name, {**fields, "seed": seed}) for seed in seeds for name, fields in methods]
    base, configs = runs_from(args, BENCH_SECTIONS, TrainConfig(**DEFAULTS),
                              [fields for _, fields in runs])  # fmt: skip
    base = configured_device(args, BENCH_SECTIONS, base)
    configs = [replace(config, device=base.device) for config in configs]
    if base.time_budget is None and base.max_steps is None:
        raise UsageError("give --time-budget or --max-steps: runs must end")
    if args.stop_at_target and base.target_loss is None:
        raise UsageError("--stop-at-target needs --target-loss")
    rows: list[TTARow] = []
    for (name, _), config in zip(runs, configs, strict=True):
        print(f"  {name} seed {config.seed} ...", flush=True)
        if not args.stop_at_target:
            config = replace(config, target_loss=None)  # measured from the curve; it goes on
        rows.append(run_method(name, config, args.link_rate, base.target_loss))
        _print_row(rows[-1], base.target_loss)
        if args.json:
            from .train import write_rows

            write_rows(args.json, [asdict(row) for row in rows])
    print(format_table(rows, base.target_loss))
    if args.plot:
        plot_runs(rows, args.plot, base.target_loss)
        print(f"plot: {args.plot}")
    return 1 if any(row.failed for row in rows) else 0


def run_method(name: str, config, link_rate: str | None = None,
               target: float | None = None) -> TTARow:  # fmt: skip
    """One method's run of ``config``, as its row (a failed run's carries the failure): local
    workers on loopback, or with ``link_rate`` one worker per host of an emulated cluster."""
    args = argparse.Namespace(link_rate=link_rate)
    return make_row(args, name, config, _outcome(args, config), target)


def _outcome(args, config) -> dict | Failure:
    """Rank 0's summary of one method's run, or the failure that ended it."""
    try:
        if args.link_rate:
            return _in_testbed(args, config)
        from ..train.launch import run_local

        return run_local(config)
    except Exception as error:  # this row fails; the next may well not
        return Failure.of(error)


def _in_testbed(args, config) -> dict | Failure:
    from .train_testbed import train_in_testbed

    jobs = train_in_testbed(
        config.aggregator, [config.scheduler], rate=args.link_rate, workers=config.workers,
        train_flags=train_flags(config), testbed_id="benchtta",
    )  # fmt: skip
    with contextlib.closing(jobs):
        _, outcome = next(jobs)
    return outcome


def parse_seeds(text: str) -> list[int]:
    from ..cli import UsageError

    seeds = parse_list(text, int, "seeds")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r}: give distinct seeds")
    return seeds


def row_from_dict(record: dict) -> TTARow:
    error = record.get("error")
    return TTARow(**{**record, "error": Failure(**error) if error else None})


def first_at_target(evals: list[dict], target: float | None) -> float | None:
    """Seconds of training at the first evaluation whose validation loss is at most ``target``."""
    if target is None:
        return None
    return next((e["seconds"] for e in evals if e["val_loss"] <= target), None)


def with_target(row: TTARow, target: float | None) -> TTARow:
    row.time_to_target = first_at_target(row.evals, target)
    return row


def make_row(args, name: str, config, outcome: dict | Failure, target: float | None) -> TTARow:
    rate = args.link_rate or "loopback"
    if isinstance(outcome, Failure):
        return TTARow(name, rate, config.workers, config.seed, error=outcome)
    evals = outcome.get("evals", [])
    step_s, compute_s = outcome.get("step_s"), outcome.get("compute_s")
    ratio = (step_s - compute_s) / compute_s if step_s and compute_s else None
    return TTARow(
        method=name, link_rate=rate, workers=config.workers, seed=config.seed,
        steps=outcome.get("steps"),
        train_seconds=outcome.get("train_seconds"), step_s=step_s, compute_s=compute_s,
        comm_to_compute=ratio, time_to_target=first_at_target(evals, target),
        final_val_loss=outcome.get("val_loss"), bits_per_byte=outcome.get("bits_per_byte"),
        bytes_per_step=bytes_per_step(config),
        fallbacks=outcome.get("fallbacks"), evals=evals,
    )  # fmt: skip


def bytes_per_step(config) -> int:
    """What one worker sends per step, in steady state: DDP hooks from the tensors' shapes
    (train/peers.py); a gradsum codec from one reference round of the model's gradient, its
    tensors described (wire bits up per coordinate, its summaries included)."""
    import torch

    from ..train.models import build_model, model_sizes
    from ..train.peers import wire_bytes_per_step

    classes = 256 if config.model == "gpt" else 10
    model = build_model(config.model, classes, **model_sizes(config))
    if config.shard != "none":  # the all-gather's bytes and the reduce-scatter's
        from ..train.sharding import sharded_bytes_per_step

        return sharded_bytes_per_step(config, model)
    if config.aggregator == "ddp":
        return wire_bytes_per_step(config, model)
    from ..codecs import make_codec, parse_options
    from ..codecs.round import run_round
    from ..sync.local_steps import parse_local_steps

    size = sum(p.numel() for p in model.parameters())
    codec = make_codec(config.codec, workers=config.workers,
                       **parse_options(config.codec_options))  # fmt: skip
    # the tensors the flat gradient holds, as training's senders describe them: a codec that
    # works per tensor (PowerSGD's matrices) sends what it sends in training, not what it would
    # for one flat buffer viewed as a square matrix
    codec.describe("model", [tuple(p.shape) for p in model.parameters()])
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(size, generator=generator) for _ in range(config.workers)]
    result = run_round(codec, inputs, key="model")
    shared = [s for _, _, s in result.pieces if s is not None]
    summary_bits = sum(s.numel() for s in shared) * codec.summary_bits()
    bits_up, _ = result.bits_per_coordinate()
    # local steps send one round every h steps (sync/local_steps.py)
    every = parse_local_steps(config.local_steps).h if config.local_steps else 1
    return math.ceil((bits_up * size + summary_bits) / 8 / every)


def common_step(rows: list[TTARow]) -> int | None:
    """The last step every run that ran evaluated at: where losses compare step for step."""
    steps = [{e["step"] for e in row.evals} for row in rows if not row.failed and row.evals]
    shared = set.intersection(*steps) if steps else set()
    return max(shared) if shared else None


def loss_at_step(row: TTARow, step: int) -> float | None:
    return next((e["val_loss"] for e in row.evals if e["step"] == step), None)


def _print_row(row: TTARow, target: float | None) -> None:
    if row.failed:
        print(f"  {row.method}: failed: {row.error}", flush=True)
        return
    reached = f"{row.time_to_target:.1f} s" if row.time_to_target is not None else "not reached"
    print(f"  {row.method}: {row.steps} steps in {row.train_seconds:.1f} s, val loss "
          f"{row.final_val_loss:.4f}, target {target}: {reached}", flush=True)  # fmt: skip


def format_table(rows: list[TTARow], target: float | None) -> str:
    """One line per run; with several seeds, each run's comparisons are with the baseline's run
    of the same seed, and a second table gives each method's medians over the seeds."""
    seeds = sorted({row.seed for row in rows})
    several = len(seeds) > 1
    bases = {row.seed: row for row in rows if row.method == rows[0].method and not row.failed}
    head = rows[0]
    lines = [f"workers={head.workers}  links={head.link_rate}  target val loss={target}"
             + (f"  seeds={','.join(map(str, seeds))}" if several else "")]  # fmt: skip
    ratios = [b.comm_to_compute for b in bases.values() if b.comm_to_compute is not None]
    if ratios:
        base = bases[min(bases)]
        lines.append(
            f"baseline {base.method}: {base.step_s:.3f} s per step, {base.compute_s:.3f} s of "
            f"compute: communication-to-compute ratio {statistics.median(ratios):.2f}"
            + (" (median over seeds)" if len(ratios) > 1 else "")
        )
    same = common_step(rows)
    width = max(16, *(len(_label(row, several)) for row in rows))
    lines.append(
        f"{'method':<{width}} {'to target s':>11} {'vs base':>8} {'final loss':>10} {'bpb':>6} "
        f"{f'loss @{same}':>10} {'vs base':>8} {'steps':>6} {'s/step':>7} {'MB/step':>8} "
        f"{'retries':>7}"
    )
    for row in rows:
        if row.failed:
            lines.append(f"{_label(row, several):<{width}} failed")
            continue
        speedup, gap = _against(row, bases.get(row.seed), same)
        lines.append(
            f"{_label(row, several):<{width}} {_num(row.time_to_target, '.1f'):>11} "
            f"{_num(speedup, '.2f', 'x'):>8} {row.final_val_loss:>10.4f} "
            f"{row.bits_per_byte:>6.3f} {_num(loss_at_step(row, same), '.4f'):>10} "
            f"{_num(gap * 100 if gap is not None else None, '+.1f', '%'):>8} {row.steps:>6} "
            f"{row.step_s:>7.3f} {row.bytes_per_step / 1e6:>8.2f} {row.fallbacks:>7}"
        )
    if several:
        lines += _medians(rows, bases, same, width)
    failures = [f"  {_label(row, several)}: {row.error}" for row in rows if row.failed]
    return "\n".join(lines + (["failed:", *failures] if failures else []))


def _label(row: TTARow, several: bool) -> str:
    return f"{row.method} seed {row.seed}" if several else row.method


def _against(row: TTARow, base: TTARow | None, same: int | None):
    """The baseline's time to target over the row's, and the row's loss gap to the baseline's
    at step ``same`` (None where either is missing)."""
    if base is None:
        return None, None
    ttt, base_ttt = row.time_to_target, base.time_to_target
    speedup = base_ttt / ttt if base_ttt is not None and ttt else None
    at_same = loss_at_step(row, same) if same is not None else None
    base_same = loss_at_step(base, same) if same is not None else None
    gap = at_same / base_same - 1 if at_same is not None and base_same else None
    return speedup, gap


def _medians(rows: list[TTARow], bases: dict, same: int | None, width: int) -> list[str]:
    """Per method over the seeds: the median time to target (when every seed reached it), the
    baseline's median over it, the median of the per-seed speed-ups (each seed's baseline over
    its run: a seed the method did not reach counts as none), the median and range of the paired
    loss gaps at step ``same``."""
    lines = [
        "medians over seeds (vs base: the ratio of the median times; paired: the median of each "
        "seed's ratio to its own baseline):",
        f"{'method':<{width}} {'to target s':>11} {'vs base':>8} {'paired':>8} "
        f"{f'gap @{same}':>10} {'gap range':>15} {'reached':>8} {'s/step':>7}",
    ]
    base_times = [b.time_to_target for b in bases.values()]
    base_median = statistics.median(base_times) if None not in base_times else None
    for method in dict.fromkeys(row.method for row in rows):
        runs = [row for row in rows if row.method == method and not row.failed]
        if not runs:
            continue
        times = [row.time_to_target for row in runs]
        reached = sum(t is not None for t in times)
        median = statistics.median(times) if reached == len(times) else None
        speedup = base_median / median if base_median is not None and median else None
        paired = [_against(row, bases.get(row.seed), same)[0] for row in runs]
        paired_median = statistics.median(paired) if None not in paired else None
        gaps = [g for row in runs
                if (g := _against(row, bases.get(row.seed), same)[1]) is not None]  # fmt: skip
        spread = f"{min(gaps) * 100:+.1f}..{max(gaps) * 100:+.1f}%" if gaps else "-"
        gap = statistics.median(gaps) * 100 if gaps else None
        lines.append(
            f"{method:<{width}} {_num(median, '.1f'):>11} {_num(speedup, '.2f', 'x'):>8} "
            f"{_num(paired_median, '.2f', 'x'):>8} {_num(gap, '+.1f', '%'):>10} {spread:>15} "
            f"{f'{reached}/{len(runs)}':>8} "
            f"{statistics.median(r.step_s for r in runs):>7.3f}"
        )
    return lines


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def plot_runs(rows: list[TTARow], path: Path, target: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    seeds = sorted({row.seed for row in rows})
    colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(row.method for row in rows))}
    styles = ("-", "--", ":", "-.")
    for row in rows:
        if row.failed or not row.evals:
            continue
        seconds = [e["seconds"] for e in row.evals]
        steps = [e["step"] for e in row.evals]
        losses = [e["val_loss"] for e in row.evals]
        # a method's seeds share its colour; only its first seed is in the legend
        look = {"color": colours[row.method], "linestyle": styles[seeds.index(row.seed) % 4],
                "label": row.method if row.seed == seeds[0] else None, "marker": "."}  # fmt: skip
        by_time.plot(seconds, losses, **look)
        by_step.plot(steps, losses, **look)
    for axis, label in ((by_time, "seconds of training"), (by_step, "steps")):
        if target is not None:
            axis.axhline(target, color="grey", linestyle="--", linewidth=1)
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    by_time.set_ylabel("validation loss (nats per byte)")
    by_step.legend(fontsize=8)
    over = f", seeds {', '.join(map(str, seeds))} (line styles)" if len(seeds) > 1 else ""
    figure.suptitle(f"{rows[0].workers} workers, links {rows[0].link_rate}{over}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

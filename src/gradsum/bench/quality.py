"""`gradsum bench quality`: does each method learn as much per step as fp32, on models and
optimizers nobody tuned it for?

A grid of configurations (a model and its sizes, an optimizer and its learning rate, a
per-worker batch; the data set follows from the model: gpt trains on the stdlib text, digits-*
on scikit-learn's digits) x methods x seeds, each run as `bench tta` runs a method: local
workers on loopback, the same seed's weights, batches and codec randomness for every method.
Every run trains for --max-steps and evaluates every --eval-every steps on the same
--eval-samples validation samples; every method's first --uncompressed-steps go uncompressed
(2 by default: torch's PowerSGD hook starts after 2 plain steps). The first method is the
baseline (fp32 DDP by default).

Reported per configuration and method: the median over seeds of the validation loss at the last
step every run of the configuration evaluated, its gap to the baseline's median, each seed's gap
to the baseline's run of the same seed, and the runs flagged as plateaus (a method's loss flat
over 50+ steps while the baseline's, same seed, falls; thresholds in PLATEAU_*). A summary gives
each method's worst gap over the configurations; with --max-gap the command exits 1 where one
exceeds it, so a sweep can serve as a check. A run that fails (a divergence stops it) also
exits 1.

Resumable: --json is rewritten after every run, and a run it already holds (same configuration,
method and seed, run with the same settings) is kept, not run again; a failed one is run again.
A file whose run has other settings (another --max-steps, --workers, ...) is refused rather than
mixed into one report. The report (printed, and in the JSON) covers every run the file holds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import tta
from .cli import parse_list

# A plateau: over some window of evaluations at least PLATEAU_WINDOW steps apart, the method's
# validation loss fell by less than PLATEAU_FLAT (relative) while the baseline's, same seed,
# fell by more than PLATEAU_FALLING.
PLATEAU_WINDOW = 50
PLATEAU_FLAT = 0.005
PLATEAU_FALLING = 0.02

DEFAULT_METHODS = ("ddp", "allreduce:thc", "allreduce:powersgd(rank=4)", "ddp:powersgd4")

# What every run shares: bench tta's runs (the workload aside, which each configuration sets),
# by steps; torch's PowerSGD hook starts after 2 plain steps, so every method gets them. The
# guard stops a run only where the loss or gradient is not finite: its jump check stopped a fp32
# run of the digits CNN at step 169 (one batch of 32 at 4x the running mean of 0.14), and with
# it off the same run ended at 96 % validation accuracy; a jump that matters shows in the
# validation loss, which the sweep measures.
DEFAULTS = {**tta.DEFAULTS, "time_budget": None, "max_steps": 200, "eval_every": 25,
            "eval_samples": 256, "uncompressed_steps": 2, "context": 64,
            "divergence_factor": math.inf}  # fmt: skip

# fields each configuration sets: not offered as flags, or a flag would silently rename every
# configuration
CONFIGURATION_FIELDS = ("model", "dataset", "layers", "width", "heads", "optimizer", "lr",
                        "momentum", "batch_size")  # fmt: skip
# fields that would end runs at other steps than --max-steps, or evaluate off the common steps
NOT_OFFERED = (*CONFIGURATION_FIELDS, "time_budget", "target_loss", "eval_seconds", "epochs")


@dataclass(frozen=True)
class Configuration:
    """A model with its sizes, an optimizer with its learning rate, a per-worker batch."""

    model: str
    optimizer: str
    lr: float
    batch_size: int
    layers: int = 0  # gpt's sizes
    width: int = 0
    heads: int = 4
    momentum: float = 0.9  # sgd's

    @property
    def name(self) -> str:
        shape = f"gpt{self.layers}x{self.width}" if self.model == "gpt" else self.model
        return f"{shape}-{self.optimizer}-b{self.batch_size}"

    @property
    def fields(self) -> dict:
        """Its ``TrainConfig`` fields."""
        gpt = self.model == "gpt"
        fields = {"model": self.model, "dataset": "stdlib" if gpt else "digits",
                  "optimizer": self.optimizer, "lr": self.lr,
                  "batch_size": self.batch_size}  # fmt: skip
        if gpt:
            fields.update(layers=self.layers, width=self.width, heads=self.heads)
        if self.optimizer == "sgd":
            fields["momentum"] = self.momentum
        return fields


def _gpt(layers: int, width: int, optimizer: str, batch_size: int) -> Configuration:
    # AdamW at 1e-3 is what bench tta trains gpt with; SGD at 0.1 with momentum 0.9 learned on
    # the 6x192 gpt at batch 1
    lr = 1e-3 if optimizer == "adamw" else 0.1
    return Configuration("gpt", optimizer, lr, batch_size, layers=layers, width=width)


# Shapes of about one cost a step, so a sweep's runs take alike: the gpts at batch 1 hold 2.7 to
# 3.8 M parameters, 2x128 at batch 8 (8x the tokens) 0.4 M. The 6x192 gpt with AdamW at batch 1
# is the shape THC stalled on; 4x256 the benchmarks'; 3x320 wide and shallow; digits-cnn a CNN
# at `gradsum train`'s SGD defaults (lr 0.1, momentum 0.9) and with AdamW.
GRID = (
    _gpt(6, 192, "adamw", 1),
    _gpt(6, 192, "sgd", 1),
    _gpt(4, 256, "adamw", 1),
    _gpt(3, 320, "adamw", 1),
    _gpt(2, 128, "adamw", 8),
    _gpt(2, 128, "sgd", 8),
    Configuration("digits-cnn", "sgd", 0.1, 8),
    Configuration("digits-cnn", "adamw", 1e-3, 1),
)


@dataclass
class Run:
    """One run's row (bench tta's), with its configuration's name and the settings it ran with
    (the flags that rebuild it, less its method and seed): what resuming compares."""

    config: str
    description: str
    setup: list[str]
    row: tta.TTARow

    @property
    def key(self) -> tuple[str, str, int]:
        return self.config, self.row.method, self.row.seed

    def record(self) -> dict:
        return {"config": self.config, "description": self.description, "setup": self.setup,
                **asdict(self.row)}  # fmt: skip

    @classmethod
    def from_record(cls, record: dict) -> Run:
        record = dict(record)
        head = [record.pop(name) for name in ("config", "description", "setup")]
        return cls(*head, tta.row_from_dict(record))


def register(benches: argparse._SubParsersAction) -> None:
    from ..config import add_flags, flags_of
    from ..train.config import BENCH_SECTIONS, METHODS, SEEDS, TrainConfig

    parser = benches.add_parser(
        "quality",
        help="validation loss at equal steps per method against fp32, over a grid of models, "
        "optimizers, batches and seeds, flagging plateaus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--configs", metavar="NAME,...",
        help="run only these configurations of the grid (--list shows them; default: all)",
    )  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument(
        "--json", type=Path,
        help="write the runs and the report here after every run; runs it already holds are "
        "kept, not run again",
    )  # fmt: skip
    parser.add_argument(
        "--plot", type=Path, help="PNG: validation loss vs step, one subplot a configuration"
    )
    parser.add_argument("--from-json", type=Path,
                        help="train nothing: report (and --plot) an earlier --json")  # fmt: skip
    parser.add_argument(
        "--max-gap", type=float, metavar="PCT",
        help="exit 1 if a method's median gap to the baseline exceeds PCT %% in a configuration",
    )  # fmt: skip
    sweeps = {METHODS: ",".join(DEFAULT_METHODS), SEEDS: "0,1,2"}
    offered = [f.field for f in flags_of(BENCH_SECTIONS) if f.field not in NOT_OFFERED]
    add_flags(parser, BENCH_SECTIONS, TrainConfig(**DEFAULTS), sweeps, only=offered)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from ..config import runs_from
    from ..train.config import BENCH_SECTIONS, TrainConfig
    from ..train.methods import parse_methods

    if args.list:
        print(format_grid(GRID))
        return 0
    if args.from_json:
        runs, baseline = load(args.from_json)
        if not runs:
            raise UsageError(f"--from-json {args.from_json}: holds no runs")
        return _report(runs, baseline or runs[0].row.method, args)
    configurations = select(args.configs)
    methods = parse_methods(args.methods)
    seeds = tta.parse_seeds(args.seeds)
    baseline = methods[0][0]
    # a configuration's seeds, each seed's methods together: a configuration's table is whole
    # early, and a stopped sweep has whole seeds
    plan = [(c, name, {**c.fields, **fields, "seed": seed})
            for c in configurations for seed in seeds for name, fields in methods]  # fmt: skip
    _, configs = runs_from(args, BENCH_SECTIONS, TrainConfig(**DEFAULTS),
                           [fields for *_, fields in plan])  # fmt: skip
    held = {}
    if args.json and args.json.exists():
        held = {run.key: run for run in load(args.json)[0]}
    planned = []
    for (configuration, name, _), config in zip(plan, configs, strict=True):
        key, setup = (configuration.name, name, config.seed), setup_of(config)
        kept = held.get(key)
        if kept is not None and not kept.row.failed and kept.setup != setup:
            raise UsageError(
                f"--json {args.json} holds {configuration.name} {name} seed {config.seed} run "
                f"with {' '.join(kept.setup)}; this one would run with {' '.join(setup)}: give "
                "another --json, or the same settings to resume it"
            )
        planned.append((configuration, name, config, setup))
    runs = dict(held)
    for index, (configuration, name, config, setup) in enumerate(planned, 1):
        key = (configuration.name, name, config.seed)
        label = f"[{index}/{len(planned)}] {configuration.name} {name} seed {config.seed}"
        kept = runs.get(key)
        if kept is not None and not kept.row.failed:
            print(f"{label}: kept from {args.json}, val loss {_num(kept.row.final_val_loss)}")
            continue
        print(f"{label} ...", flush=True)
        start = time.perf_counter()
        row = tta.run_method(name, config)
        seconds = time.perf_counter() - start
        runs[key] = Run(configuration.name, describe(config), setup, row)
        if row.failed:
            print(f"  failed after {seconds:.0f} s: {row.error}", flush=True)
        else:
            print(f"  {seconds:.0f} s, {row.steps} steps, val loss {row.final_val_loss:.4f}",
                  flush=True)  # fmt: skip
        if args.json:
            write(args.json, list(runs.values()), baseline)
    if args.json:  # the baseline's, where every run was kept
        write(args.json, list(runs.values()), baseline)
    return _report(list(runs.values()), baseline, args)


def _report(runs: list[Run], baseline: str, args: argparse.Namespace) -> int:
    summary = report(runs, baseline, args.max_gap)
    print(format_report(summary))
    if args.plot:
        plot(runs, baseline, args.plot)
        print(f"plot: {args.plot}")
    return 1 if summary["failed"] or summary["over_max_gap"] else 0


def select(text: str | None) -> list[Configuration]:
    """The grid's configurations named in ``--configs`` (all when None), in the grid's order."""
    from ..cli import UsageError

    if text is None:
        return list(GRID)
    names = parse_list(text, str.strip, "configs")
    known = {c.name: c for c in GRID}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UsageError(f"--configs: no configuration {', '.join(unknown)}; the grid's are "
                         f"{', '.join(known)}")  # fmt: skip
    if len(set(names)) != len(names):
        raise UsageError(f"--configs {text!r}: give distinct configurations")
    return [c for c in GRID if c.name in names]


def describe(config) -> str:
    """A run's configuration in words (a ``TrainConfig``)."""
    if config.model == "gpt":
        model = (f"gpt {config.layers}x{config.width}, {config.heads} heads, context "
                 f"{config.context}")  # fmt: skip
    else:
        model = config.model
    optimizer = f"{config.optimizer} lr {config.lr:g}"
    if config.optimizer == "sgd":
        optimizer += f" momentum {config.momentum:g}"
    return f"{model}; {optimizer}; batch {config.batch_size} per worker, {config.workers} workers"


def format_grid(grid) -> str:
    from ..train.config import TrainConfig

    width = max(len(c.name) for c in grid)
    return "\n".join(f"{c.name:<{width}}  {describe(TrainConfig(**{**DEFAULTS, **c.fields}))}"
                     for c in grid)  # fmt: skip


def setup_of(config) -> list[str]:
    """The flags that rebuild a run's configuration, less its method and seed."""
    from ..config import to_flags
    from ..train.config import BENCH_SECTIONS, TrainConfig

    method = ("aggregator", "codec", "ddp_hook", "powersgd_rank", "seed")
    return to_flags(config, BENCH_SECTIONS, TrainConfig(), skip=method)


def load(path: Path) -> tuple[list[Run], str | None]:
    """The runs of an earlier --json and its baseline."""
    from ..cli import UsageError

    try:
        document = json.loads(path.read_text())
        return [Run.from_record(r) for r in document["rows"]], document.get("baseline")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{path}: not a `bench quality` JSON ({error})") from None


def write(path: Path, runs: list[Run], baseline: str) -> None:
    """The runs and their report; a sibling then a rename, so a sweep stopped mid-write keeps
    the previous file whole."""
    document = {"baseline": baseline, "report": report(runs, baseline),
                "rows": [run.record() for run in runs]}  # fmt: skip
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=1, default=str) + "\n")
    os.replace(partial, path)


def plateau(
    evals: list[dict],
    baseline_evals: list[dict],
    window: int = PLATEAU_WINDOW,
    flat: float = PLATEAU_FLAT,
    falling: float = PLATEAU_FALLING,
) -> dict | None:
    """Whether a run stalled where its baseline learned: over the evaluations both runs made
    (``{"step", "val_loss"}`` each), a pair of steps a < b with b - a >= ``window`` where the
    run's relative fall (L(a) - L(b)) / L(a) is below ``flat`` (a rise counts as a fall below
    it) while the baseline's, over the same steps, exceeds ``falling``. Of all such windows the
    one where the baseline's fall exceeds the run's most, as ``{"start", "end", "change_pct",
    "baseline_change_pct"}`` (L(b) / L(a) - 1 in %: negative where it fell); None if there is
    none (a baseline that is itself flat flags nothing)."""
    run = {e["step"]: e["val_loss"] for e in evals}
    base = {e["step"]: e["val_loss"] for e in baseline_evals}
    steps = sorted(run.keys() & base.keys())
    worst, margin = None, 0.0
    for i, start in enumerate(steps):
        for end in steps[i + 1 :]:
            if end - start < window:
                continue
            fall = 1 - run[end] / run[start]
            base_fall = 1 - base[end] / base[start]
            if fall < flat and base_fall > falling and (worst is None or base_fall - fall > margin):
                margin = base_fall - fall
                worst = {"start": start, "end": end,
                         "change_pct": (run[end] / run[start] - 1) * 100,
                         "baseline_change_pct": (base[end] / base[start] - 1) * 100}  # fmt: skip
    return worst


def report(runs: list[Run], baseline: str, max_gap: float | None = None) -> dict:
    """Per configuration (in the runs' order) and method (the baseline first): the median over
    seeds of the validation loss at the last step every run of the configuration evaluated, its
    gap to the baseline's median in %, each seed's loss and gap to the baseline's run of that
    seed in %, the seeds that failed and the plateaus (:func:`plateau`); then per method other
    than the baseline its worst gap over the configurations, and the configurations where it
    exceeds ``max_gap`` %."""
    configs = []
    for name in dict.fromkeys(run.config for run in runs):
        mine = [run for run in runs if run.config == name]
        rows = [run.row for run in mine]
        step = tta.common_step(rows)
        bases = {row.seed: row for row in rows if row.method == baseline and not row.failed}
        base_losses = _losses(bases.values(), step)
        base_median = statistics.median(base_losses.values()) if base_losses else None
        methods = []
        for method in dict.fromkeys([baseline, *(row.method for row in rows)]):
            runs_of = [row for row in rows if row.method == method]
            if not runs_of:
                continue
            losses = _losses([row for row in runs_of if not row.failed], step)
            median = statistics.median(losses.values()) if losses else None
            seeds = []
            for row in sorted(runs_of, key=lambda row: row.seed):
                loss, base_loss = losses.get(row.seed), base_losses.get(row.seed)
                found = None
                if method != baseline and not row.failed and row.seed in bases:
                    found = plateau(row.evals, bases[row.seed].evals)
                seeds.append({"seed": row.seed, "failed": row.failed, "loss": loss,
                              "gap_pct": _gap(loss, base_loss), "plateau": found})  # fmt: skip
            # the configuration's own stall: the median over seeds at every step, against the
            # baseline's (one seed's noisy window flags a run above, not the configuration)
            kept = [row for row in runs_of if not row.failed]
            found = None
            if method != baseline and kept and bases:
                found = plateau(_as_evals(*median_curve(kept)),
                                _as_evals(*median_curve(list(bases.values()))))  # fmt: skip
            methods.append({"method": method, "median": median,
                            "gap_pct": _gap(median, base_median), "seeds": seeds,
                            "median_plateau": found})  # fmt: skip
        configs.append({"config": name, "description": mine[0].description, "step": step,
                        "methods": methods})  # fmt: skip
    worst: dict[str, dict] = {}
    over = []
    for config in configs:
        for entry in config["methods"]:
            gap = entry["gap_pct"]
            if entry["method"] == baseline or gap is None:
                continue
            held = worst.get(entry["method"])
            if held is None or gap > held["gap_pct"]:
                worst[entry["method"]] = {"gap_pct": gap, "config": config["config"]}
            if max_gap is not None and gap > max_gap:
                over.append({"method": entry["method"], "config": config["config"],
                             "gap_pct": gap})  # fmt: skip
    plateaus = [{"config": config["config"], "method": entry["method"], **seed}
                for config in configs for entry in config["methods"]
                for seed in entry["seeds"] if seed["plateau"]]  # fmt: skip
    stalled = [{"config": config["config"], "method": entry["method"],
                **entry["median_plateau"]}
               for config in configs for entry in config["methods"]
               if entry.get("median_plateau")]  # fmt: skip
    failed = [{"config": run.config, "method": run.row.method, "seed": run.row.seed}
              for run in runs if run.row.failed]  # fmt: skip
    return {
        "baseline": baseline,
        "plateau_rule": {
            "window_steps": PLATEAU_WINDOW,
            "flat": PLATEAU_FLAT,
            "baseline_falling": PLATEAU_FALLING,
        },
        "configs": configs,
        "worst": worst,
        "plateaus": plateaus,
        "median_plateaus": stalled,
        "failed": failed,
        "max_gap_pct": max_gap,
        "over_max_gap": over,
    }


def _as_evals(steps, losses) -> list[dict]:
    return [{"step": step, "val_loss": loss} for step, loss in zip(steps, losses, strict=True)]


def _losses(rows, step: int | None) -> dict[int, float]:
    """Each row's validation loss at ``step``, by seed (rows that did not evaluate it left out)."""
    if step is None:
        return {}
    losses = {row.seed: tta.loss_at_step(row, step) for row in rows}
    return {seed: loss for seed, loss in losses.items() if loss is not None}


def _gap(loss: float | None, base: float | None) -> float | None:
    return (loss / base - 1) * 100 if loss is not None and base else None


def format_report(summary: dict) -> str:
    baseline = summary["baseline"]
    lines = []
    for config in summary["configs"]:
        entries = config["methods"]
        seeds = sorted({s["seed"] for entry in entries for s in entry["seeds"]})
        lines += ["", f"{config['config']}: {config['description']}",
                  f"  validation loss at step {config['step']}, median over seeds "
                  f"{','.join(map(str, seeds))}; per seed: its gap to {baseline}'s run of "
                  "the same seed"]  # fmt: skip
        width = max(16, *(len(entry["method"]) for entry in entries))
        lines.append(f"  {'method':<{width}} {'median':>8} {'gap':>8}  {'per seed':<24} plateau")
        for entry in entries:
            per_seed = " ".join(
                "failed" if s["failed"]
                else _num(s["loss"]) if entry["method"] == baseline
                else _num(s["gap_pct"], "+.1f", "%")
                for s in entry["seeds"]
            )  # fmt: skip
            flags = "; ".join(
                f"seed {s['seed']} steps {p['start']}-{p['end']}: {p['change_pct']:+.1f}% "
                f"({baseline} {p['baseline_change_pct']:+.1f}%)"
                for s in entry["seeds"] if (p := s["plateau"])
            )  # fmt: skip
            gap = None if entry["method"] == baseline else entry["gap_pct"]
            lines.append(
                f"  {entry['method']:<{width}} {_num(entry['median']):>8} "
                f"{_num(gap, '+.1f', '%'):>8}  {per_seed:<24} {flags or '-'}"
            )
    worst = ", ".join(f"{method} {_num(w['gap_pct'], '+.1f', '%')} ({w['config']})"
                      for method, w in summary["worst"].items())  # fmt: skip
    lines += ["", f"worst median gap to {baseline}: {worst or '-'}"]
    plateaus = summary["plateaus"]
    lines.append(
        f"plateaus: {len(plateaus)} run(s): "
        + ", ".join(f"{p['config']} {p['method']} seed {p['seed']}" for p in plateaus)
        if plateaus
        else "plateaus: none"
    )
    stalled = summary.get("median_plateaus", [])
    lines.append(
        "plateaus of a configuration's median over seeds: "
        + ("; ".join(f"{p['config']} {p['method']} steps {p['start']}-{p['end']}: "
                     f"{p['change_pct']:+.1f}% ({baseline} {p['baseline_change_pct']:+.1f}%)"
                     for p in stalled) if stalled else "none")
    )  # fmt: skip
    if summary["failed"]:
        lines.append("failed: " + ", ".join(f"{f['config']} {f['method']} seed {f['seed']}"
                                            for f in summary["failed"]))  # fmt: skip
    if summary["max_gap_pct"] is not None:
        over = summary["over_max_gap"]
        lines.append(
            f"over --max-gap {summary['max_gap_pct']:g}%: "
            + (", ".join(f"{o['method']} {o['gap_pct']:+.1f}% ({o['config']})" for o in over)
               if over else "none")
        )  # fmt: skip
    return "\n".join(lines).lstrip("\n")


def _num(value: float | None, spec: str = ".4f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def median_curve(rows: list[tta.TTARow]) -> tuple[list[int], list[float]]:
    """The median over the rows (one method's seeds) of the validation loss at each step all of
    them evaluated."""
    steps = sorted(set.intersection(*({e["step"] for e in row.evals} for row in rows)))
    return steps, [statistics.median(tta.loss_at_step(row, s) for row in rows) for s in steps]


def plot(runs: list[Run], baseline: str, path: Path) -> None:
    """One subplot a configuration: validation loss against steps, a method's median over seeds
    thick and each seed's run thin, in the method's colour. The y axis starts at the first
    quarter of the steps, where the curves part: the first evaluations' losses would flatten
    gaps of a percent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(run.config for run in runs))
    methods = list(dict.fromkeys([baseline, *(run.row.method for run in runs)]))
    colours = {m: f"C{i}" for i, m in enumerate(methods)}
    columns = min(3, len(names))
    lines = math.ceil(len(names) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(max(6, 5 * columns), 3.8 * lines),
                                squeeze=False)  # fmt: skip
    for axis, name in zip(axes.flat, names, strict=False):
        rows = [run.row for run in runs if run.config == name and not run.row.failed and
                run.row.evals]  # fmt: skip
        last = max((e["step"] for row in rows for e in row.evals), default=0)
        shown = []
        for method in methods:
            mine = [row for row in rows if row.method == method]
            if not mine:
                continue
            for row in mine:
                axis.plot([e["step"] for e in row.evals], [e["val_loss"] for e in row.evals],
                          color=colours[method], linewidth=0.7, alpha=0.35)  # fmt: skip
            steps, losses = median_curve(mine)
            axis.plot(steps, losses, color=colours[method], linewidth=2, label=method)
            shown += [loss for step, loss in zip(steps, losses, strict=True) if step >= last / 4]
        if shown:
            low, high = min(shown), max(shown)
            margin = 0.05 * (high - low) or 0.01 * high
            axis.set_ylim(low - margin, high + margin)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("steps")
        axis.set_ylabel("validation loss")
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(names) :]:
        axis.axis("off")
    labelled = [axis for axis in axes.flat if axis.get_legend_handles_labels()[0]]
    if labelled:
        labelled[0].legend(fontsize=8)
    figure.suptitle(f"baseline {baseline}; median over seeds thick, each seed thin", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

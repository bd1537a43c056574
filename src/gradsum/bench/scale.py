"""`gradsum bench scale`: a codec's accuracy against the number of workers, and under stragglers.

n workers are simulated in one process: the codec round and its aggregation are exact
(``run_round``, the reference every aggregator is tested against bit for bit), only the
transport is skipped. By default the global batch is fixed: every step draws ``--global-batch``
sequences and each of the n workers gets global/n of them, so fp32 (``none``) trains the same
model at every n (up to the order of additions) and any gap to it is the codec's;
``--per-worker-batch B`` scales it instead (n * B, the THC paper's setting), and each n has an
fp32 run of its own. Each worker's gradient
comes from one vectorised call (``torch.func.vmap`` over the workers' micro-batches) or a loop
over them (``--grads``; ``auto`` takes the one measured faster at the worker count).

Stragglers (``--quorums 1,0.9,0.8``): each round aggregates only the ceil(q*n) workers that
arrive first under a seeded straggler model, a worker's step time being ``1 + Exp(mean
--straggler-delay)`` in units of its straggler-free step time, independent over workers and
steps; the round ends at the k-th arrival, and the others' gradients are dropped. The reported
time is that model's (``modelled_time``, in those units), not a measurement.

Reported per (method, n, quorum): the final validation loss (and bits per byte) on a fixed set
of validation windows, its gap to fp32's at the same n and quorum, bits per coordinate up, and
the modelled time. Rows are written to ``--json`` as each run ends; a row of the same settings
already there is kept instead of run again, so a sweep can be split over several invocations.
``--plot`` draws the gap against n per method (and, for several quorums, validation loss
against modelled time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import add_flags, non_negative_float, positive_int
from ..train.config import Optimizer, Steps, Workload
from ..train.trainer import Report
from .cli import parse_list

DEFAULT_WORKERS = (4, 8, 16, 32, 64)
DEFAULT_METHODS = ("none", "thc", "topk", "qsgd")
REFERENCE = "none"
VMAP_FROM = 16  # workers; measured: vmap beats the loop from here (docs/archive/benchmarks-log.md)


@dataclass(frozen=True)
class ScaleSetup:
    """What a row's number depends on besides its method, workers and quorum."""

    steps: int = 120
    global_batch: int = 64
    layers: int = 2
    width: int = 64
    heads: int = 4
    context: int = 64
    lr: float = 3e-3
    seed: int = 0
    eval_every: int = 40
    eval_samples: int = 256
    data_bytes: int = 1 << 20
    straggler_delay: float = 0.2
    # None: the global batch is fixed; B: each worker gets B sequences (global n * B)
    per_worker_batch: int | None = None

    def batch(self, workers: int) -> int:
        """Sequences per step over all workers."""
        return (
            self.global_batch
            if self.per_worker_batch is None
            else (workers * self.per_worker_batch)
        )


@dataclass
class ScaleRow:
    method: str
    workers: int
    quorum: int  # workers aggregated per round
    setup: dict
    val_loss: float
    bits_per_byte: float
    train_loss: float  # mean over the last tenth of the steps
    bits_up: float  # one worker's wire bits per coordinate
    modelled_time: float  # sum over steps of the round's k-th arrival (straggler model units)
    parameters: int
    grads: str  # "vmap" or "loop"
    seconds: float  # this run's wall time on this machine (not a benchmark)
    evals: list[dict] = field(default_factory=list)
    # the round's ||average - true mean||^2 / ||true mean||^2 (mean over the workers that
    # contributed), averaged over steps: the codec's error where the optimizer sees it
    relative_error: float | None = None

    @property
    def key(self) -> tuple:
        return row_key(self.method, self.workers, self.quorum, self.setup)


def row_key(method: str, workers: int, quorum: int, setup: dict) -> tuple:
    """What identifies a row, so a rerun keeps the rows it already has."""
    return (method, workers, quorum, json.dumps(setup, sort_keys=True))


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "scale",
        help="a codec's validation loss against the number of workers (simulated) and quorums",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = ScaleSetup()
    parser.add_argument(
        "--workers",
        default=",".join(map(str, DEFAULT_WORKERS)),
        help="comma-separated worker counts",
    )
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated codecs; {REFERENCE} (fp32) is the reference",
    )
    parser.add_argument(
        "--quorums",
        default="1",
        help="comma-separated fractions of the workers each round waits for",
    )
    parser.add_argument("--steps", type=positive_int, default=defaults.steps)
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        default=defaults.global_batch,
        help="sequences per step over all workers (each n must divide it)",
    )
    parser.add_argument(
        "--per-worker-batch",
        type=positive_int,
        help="scale the global batch instead: each worker gets this many sequences",
    )
    parser.add_argument(
        "--straggler-delay",
        type=non_negative_float,
        default=defaults.straggler_delay,
        help="mean of a worker's exponential delay, in step times",
    )
    parser.add_argument("--grads", choices=("auto", "vmap", "loop"), default="auto")
    parser.add_argument("--json", type=Path, help="rows here, kept across invocations")
    parser.add_argument("--plot", type=Path, help="PNG of the gap to fp32 against workers")
    # the training job's flags where a simulated run has the field: the gpt's sizes, AdamW's
    # rate, the seed and the evaluations
    add_flags(parser, _SECTIONS, defaults, only=_SHARED)
    parser.set_defaults(run=run)


_SHARED = ("layers", "width", "heads", "context", "data_bytes", "seed", "lr", "eval_every",
           "eval_samples")  # fmt: skip
_SECTIONS = (Workload, Optimizer, Steps)


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from ..codecs.registry import make_codec, parse_options
    from ..config import given
    from ..failures import Failure
    from ..train.methods import codec_spec, split_methods

    workers = parse_list(args.workers, int, "workers")
    methods = split_methods(args.methods)
    quorums = parse_list(args.quorums, float, "quorums")
    for n in workers:
        if n < 1 or (args.per_worker_batch is None and args.global_batch % n):
            raise UsageError(f"--workers {n}: must divide --global-batch {args.global_batch}")
    for method in methods:
        try:  # the name, options and values, then the codec's own checks, before any row runs
            name, options = codec_spec(method)
            make_codec(name, workers=max(workers), **parse_options(options))
        except ValueError as error:
            raise UsageError(f"--methods {method}: {error}") from None
    if any(not 0.0 < q <= 1.0 for q in quorums):
        raise UsageError(f"--quorums {args.quorums}: each must be in (0, 1]")
    setup = ScaleSetup(
        steps=args.steps,
        global_batch=args.global_batch,
        per_worker_batch=args.per_worker_batch,
        straggler_delay=args.straggler_delay,
        **given(args, _SECTIONS, only=_SHARED),
    )
    rows = load_rows(args.json) if args.json and args.json.exists() else []
    done = {row.key for row in rows}
    dataset, failed = None, []
    for n in workers:
        for q in quorums:
            for method in methods:
                quorum = quorum_size(n, q)
                if row_key(method, n, quorum, asdict(setup)) in done:
                    print(f"  {method} n={n} quorum={quorum}: kept from {args.json}")
                    continue
                if dataset is None:
                    dataset = lm_dataset(setup)
                print(f"  {method} n={n} quorum={quorum} ...", flush=True)
                try:
                    row = train_simulated(
                        method, n, setup, quorum=quorum, dataset=dataset, grads=args.grads
                    )
                except Exception as error:  # this row fails; the others may well not
                    failed.append(f"{method} n={n} quorum={quorum}: {Failure.of(error)}")
                    print(f"    failed: {Failure.of(error)}", flush=True)
                    continue
                print(
                    f"    val loss {row.val_loss:.4f}, modelled time {row.modelled_time:.1f} "
                    f"({row.seconds:.0f} s)",
                    flush=True,
                )
                rows.append(row)
                done.add(row.key)
                if args.json:
                    from .train import write_rows

                    write_rows(args.json, [asdict(r) for r in rows])
    print(format_table(rows))
    if args.plot:
        for path in plot_rows(rows, args.plot):
            print(f"wrote {path}")
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failed else 0


def quorum_size(workers: int, fraction: float) -> int:
    """The workers a round waits for: ceil(fraction * n), at least one (a tolerance keeps
    0.9 * 10 from rounding up to 10)."""
    return max(1, math.ceil(fraction * workers - 1e-9))


def load_rows(path: Path) -> list[ScaleRow]:
    """Rows of a --json file; a setting that rows written before it existed lack is taken at
    its default (what they ran with)."""
    defaults = asdict(ScaleSetup())
    rows = [ScaleRow(**row) for row in json.loads(path.read_text())]
    for row in rows:
        row.setup = {**defaults, **row.setup}
    return rows


def lm_dataset(setup: ScaleSetup):
    from ..train.data import load_dataset

    return load_dataset("stdlib", input_shape=(setup.context,), max_bytes=setup.data_bytes)


class Stragglers:
    """The seeded straggler model: worker w's time at step s is 1 + Exp(mean ``delay``), in
    units of a straggler-free step; a round of quorum k ends at the k-th arrival."""

    def __init__(self, workers: int, delay: float, seed: int):
        self.workers, self.delay, self.seed = workers, delay, seed

    def round(self, step: int, quorum: int) -> tuple[list[int], float]:
        """The workers that arrive first (sorted) and the time the round ends."""
        import numpy as np

        generator = np.random.Generator(np.random.PCG64([self.seed, step, 0x5CA1E]))
        times = (
            1.0 + generator.exponential(self.delay, self.workers)
            if self.delay
            else (np.ones(self.workers))
        )
        order = np.argsort(times, kind="stable")
        return sorted(int(w) for w in order[:quorum]), float(times[order[quorum - 1]])


class WorkerGradients:
    """Every worker's gradient of its micro-batch, flat, from one model: ``vmap`` over the
    workers (one vectorised forward and backward) or a loop of ordinary backward passes."""

    def __init__(self, model, how: str):
        import torch
        from torch.func import functional_call, grad_and_value, vmap

        from ..train.loop import task_loss

        self.model, self.how = model, how
        self.names = [name for name, _ in model.named_parameters()]

        def loss(parameters, inputs, labels):
            return task_loss(functional_call(model, parameters, (inputs,)), labels)

        self._grad = vmap(grad_and_value(loss), in_dims=(None, 0, 0))
        self._torch = torch

    def __call__(self, inputs, labels) -> tuple[list, float]:
        """``inputs``, ``labels``: (workers, batch, context). One flat gradient per worker, and
        the mean of the workers' losses."""
        torch = self._torch
        if self.how == "vmap":
            parameters = {n: p.detach() for n, p in self.model.named_parameters()}
            grads, losses = self._grad(parameters, inputs, labels)
            flat = torch.cat([grads[n].reshape(len(inputs), -1) for n in self.names], dim=1)
            return list(flat.unbind(0)), float(losses.mean())
        from ..train.loop import task_loss

        out, total = [], 0.0
        for x, y in zip(inputs, labels, strict=True):
            self.model.zero_grad(set_to_none=True)
            loss = task_loss(self.model(x), y)
            loss.backward()
            total += float(loss)
            out.append(torch.cat([p.grad.reshape(-1) for p in self.model.parameters()]))
        return out, total / len(out)


def train_simulated(
    method: str,
    workers: int,
    setup: ScaleSetup,
    *,
    quorum: int | None = None,
    dataset=None,
    grads: str = "auto",
) -> ScaleRow:
    """Train the byte-level GPT with ``workers`` simulated workers through ``method``'s exact
    codec round; ``quorum``: the workers each round aggregates (all when None)."""
    import torch

    from ..train.models import build_model, count_parameters
    from ..train.trainer import Schedule, Trainer

    global_batch = setup.batch(workers)
    if global_batch % workers:
        raise ValueError(f"{workers} workers do not divide a global batch of {global_batch}")
    quorum = workers if quorum is None else quorum
    if not 1 <= quorum <= workers:
        raise ValueError(f"a quorum of {quorum} of {workers} workers")
    how = grads if grads != "auto" else ("vmap" if workers >= VMAP_FROM else "loop")
    dataset = dataset if dataset is not None else lm_dataset(setup)
    started = time.perf_counter()
    torch.manual_seed(setup.seed)
    sizes = dict(layers=setup.layers, width=setup.width, heads=setup.heads, context=setup.context)
    model = build_model("gpt", dataset.num_classes, **sizes)
    replicas = SimulatedWorkers(method, workers, quorum, model, setup, how)
    report = _Report(model, dataset, setup, replicas)
    schedule = Schedule(max_steps=setup.steps, eval_every=setup.eval_every)
    draws = _Draws(dataset.train, workers, global_batch, setup.seed)
    # unguarded: a codec that diverges is a result of the sweep, its row's loss says so
    Trainer(replicas, draws, report, schedule).run()
    val_loss = report.evals[-1]["val_loss"]
    tail = report.losses[-max(1, len(report.losses) // 10) :]
    return ScaleRow(
        method=method,
        workers=workers,
        quorum=quorum,
        setup=asdict(setup),
        val_loss=val_loss,
        bits_per_byte=val_loss / math.log(2),
        train_loss=sum(tail) / len(tail),
        bits_up=replicas.bits_up,
        modelled_time=replicas.modelled,
        parameters=count_parameters(model),
        grads=how,
        seconds=time.perf_counter() - started,
        evals=report.evals,
        relative_error=sum(replicas.errors) / len(replicas.errors),
    )


class SimulatedWorkers:
    """The Trainer's replicas for n workers in one process: every worker's gradient of its
    micro-batch, averaged by the codec's exact in-process round over the quorum the straggler
    model lets in, then applied by AdamW to the one model all of them share."""

    agreement_lag = 0  # its agreement is its own, at once

    def __init__(
        self, method: str, workers: int, quorum: int, model, setup: ScaleSetup, how: str
    ) -> None:
        import torch

        from ..codecs import make_codec, parse_options
        from ..train.methods import codec_spec

        self.model, self.workers, self.quorum, self.seed = model, workers, quorum, setup.seed
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
        name, options = codec_spec(method)
        self.codec = make_codec(name, workers=workers, **parse_options(options))
        # the flat gradient's tensors, in order, as training's senders describe them (PowerSGD
        # factors each weight matrix, not the whole buffer viewed as one)
        self.codec.describe("gpt", [tuple(p.shape) for p in model.parameters()])
        self.gradients = WorkerGradients(model, how)
        self.stragglers = Stragglers(workers, setup.straggler_delay, setup.seed)
        self.step = 0  # rounds
        self.modelled, self.bits_up, self.errors = 0.0, 0.0, []
        self._flat: list = []

    def forward(self, inputs, labels):
        self._flat, loss = self.gradients(inputs, labels)
        return loss, None

    def agree(self, loss: float, stop: bool) -> tuple[float, bool]:
        return loss, stop

    def backward(self, loss) -> None:
        from ..codecs import run_round

        self.step += 1
        chosen, ends = self.stragglers.round(self.step, self.quorum)
        contributors = None if self.quorum == self.workers else chosen
        result = run_round(
            self.codec,
            self._flat,
            seed=self.seed,
            step=self.step,
            key="gpt",
            contributors=contributors,
        )
        self.modelled += ends
        self.bits_up = result.bits_per_coordinate()[0]
        self.errors.append(_relative_error(result.average, [self._flat[w] for w in chosen]))
        offset = 0
        for parameter in self.model.parameters():
            count = parameter.numel()
            parameter.grad = result.average[offset : offset + count].view_as(parameter).clone()
            offset += count

    def gradients_finite(self) -> bool:
        return all(bool(p.grad.isfinite().all()) for p in self.model.parameters())

    def uncompressed(self):
        from ..codecs import make_codec

        return _swapped(self, "codec", make_codec("none", workers=self.workers))

    def zero_grad(self) -> None:
        """Each round assigns the gradient whole."""

    def apply(self) -> None:
        self.optimizer.step()


class _Draws:
    """Each step's global batch, drawn with replacement from one seeded generator and split
    into the workers' micro-batches: (workers, batch / workers, context)."""

    def __init__(self, train, workers: int, global_batch: int, seed: int) -> None:
        import torch

        self.train, self.workers, self.global_batch = train, workers, global_batch
        self.order = torch.Generator().manual_seed(seed)

    def epoch(self, epoch: int):
        import torch

        train, shape = self.train, (self.workers, self.global_batch // self.workers, -1)
        while True:
            batch = torch.randint(0, len(train), (self.global_batch,), generator=self.order)
            yield train.inputs[batch].view(shape), train.labels[batch].view(shape)

    def prepare(self, inputs, labels):
        return inputs, labels


class _Report(Report):
    """The validation loss at the schedule's steps against the modelled time so far, and each
    step's training loss (the workers' mean)."""

    def __init__(self, model, dataset, setup: ScaleSetup, replicas: SimulatedWorkers) -> None:
        self.model, self.dataset, self.setup, self.replicas = model, dataset, setup, replicas
        self.evals: list[dict] = []
        self.losses: list[float] = []

    def after_step(self, outcome, labels, index: int) -> None:
        self.losses.append(outcome[0])

    def evaluate(self, step: int, clock: float) -> float:
        from ..train.loop import validation

        loss, _ = validation(self.model, self.dataset.test, samples=self.setup.eval_samples)
        self.evals.append({"step": step, "val_loss": loss, "modelled_time": self.replicas.modelled})
        self.model.train()
        return loss


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    """``owner.name`` is ``value`` inside."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _relative_error(estimate, contributed) -> float:
    import torch

    truth = torch.stack(contributed).to(torch.float64).mean(dim=0)
    scale = float(truth.pow(2).sum())
    return float((estimate.to(torch.float64) - truth).pow(2).sum()) / scale if scale else 0.0


def gap(row: ScaleRow, rows: list[ScaleRow]) -> float | None:
    """The row's validation loss relative to fp32's at the same workers, quorum and setup."""
    for other in rows:
        if (
            other.method == REFERENCE
            and other.workers == row.workers
            and other.quorum == row.quorum
            and other.setup == row.setup
        ):
            return row.val_loss / other.val_loss - 1.0
    return None


def full_quorum(row: ScaleRow, rows: list[ScaleRow]) -> ScaleRow | None:
    """The same method and setup with every worker in each round."""
    for other in rows:
        if (
            other.method == row.method
            and other.workers == row.workers
            and other.quorum == other.workers
            and other.setup == row.setup
        ):
            return other
    return None


def format_table(rows: list[ScaleRow]) -> str:
    if not rows:
        return "no rows"
    first = rows[0]
    per_worker = first.setup.get("per_worker_batch")
    batch = (f"global batch {first.setup['global_batch']} (fixed)" if per_worker is None
             else f"{per_worker} per worker (global scaled with n)")  # fmt: skip
    width = max(8, *(len(row.method) for row in rows))
    lines = [
        f"gpt {first.parameters:,} parameters, {first.setup['steps']} steps, {batch} x "
        f"{first.setup['context']} tokens, AdamW lr {first.setup['lr']:g}",
        f"{'method':<{width}} {'seed':>4} {'n':>4} {'quorum':>6} {'bits up':>8} {'rel err':>8} "
        f"{'val loss':>9} {'vs fp32':>8} {'modelled t':>11} {'vs full':>8}",
    ]
    order = sorted(rows, key=lambda r: (r.setup["seed"], r.workers, -r.quorum, r.method))
    for row in order:
        relative = gap(row, rows)
        full = full_quorum(row, rows)
        lines.append(
            f"{row.method:<{width}} {row.setup['seed']:>4} {row.workers:>4} {row.quorum:>6} "
            f"{row.bits_up:>8.2f} "
            f"{'-' if row.relative_error is None else f'{row.relative_error:.4f}':>8} "
            f"{row.val_loss:>9.4f} "
            f"{'-' if relative is None else f'{100 * relative:+.2f}%':>8} "
            f"{row.modelled_time:>11.1f} "
            f"{'-' if full is None else f'{row.modelled_time / full.modelled_time:.3f}':>8}"
        )
    return "\n".join(lines)


def plot_rows(rows: list[ScaleRow], path: Path) -> list[Path]:
    """With several worker counts, the gap to fp32 against workers, one line per method and
    quorum, at ``path``; with several quorums, validation loss against modelled time, at
    ``path`` for one worker count, else at ``<path stem>-quorum.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    several_n = len({row.workers for row in rows}) > 1
    if several_n:
        figure, axes = plt.subplots(figsize=(6.4, 4.2))
        series: dict[tuple[str, float], list[tuple[int, float]]] = {}
        for row in rows:
            relative = gap(row, rows)
            if relative is not None and row.method != REFERENCE:
                series.setdefault((row.method, row.quorum / row.workers), []).append(
                    (row.workers, 100 * relative)
                )
        for (method, fraction), points in sorted(series.items()):
            points.sort()
            label = method if fraction == 1 else f"{method}, quorum {fraction:.0%}"
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        axes.axhline(0.0, color="black", linewidth=0.8)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("workers (simulated in one process)")
        axes.set_ylabel("final validation loss vs fp32 (%)")
        axes.legend()
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    if len({row.quorum / row.workers for row in rows}) > 1:
        figure, axes = plt.subplots(figsize=(6.4, 4.2))
        for row in sorted(rows, key=lambda r: (r.method, -r.quorum)):
            points = [(e["modelled_time"], e["val_loss"]) for e in row.evals]
            axes.plot(
                *zip(*points, strict=True),
                marker=".",
                label=f"{row.method} n={row.workers} quorum {row.quorum}",
            )
        axes.set_xlabel("modelled time (straggler-free step times)")
        axes.set_ylabel("validation loss")
        axes.legend(fontsize=8)
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        other = path.with_name(f"{path.stem}-quorum{path.suffix}") if several_n else path
        figure.savefig(other, dpi=110)
        plt.close(figure)
        written.append(other)
    return written

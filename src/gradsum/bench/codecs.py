"""`gradsum bench codecs`: accuracy and CPU cost of every codec on one partition, side by side.

For n simulated workers and one partition, per codec: wire bits per coordinate up and down, the
NMSE of the decoded average, and the time of the three places a codec runs (worker encode,
aggregator op, worker decode), each also as a ratio to a plain copy of the same partition
measured in the same run. For codecs that are not homomorphic the aggregator time and the NMSE
include what a parameter server must do for them: decode every payload, sum, and re-encode.

One seed is one draw of the inputs (for real gradients: one model initialisation and one batch
per worker), and between draws a codec's NMSE moves far more than its rounding noise does within
one. ``--seeds`` measures several draws and summarises each codec over them: the mean and
spread of its NMSE, and its NMSE over the first codec's on the same draw (a paired ratio: the
draw's own difficulty cancels), with the mean ratio's 95 % confidence interval.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import positive_int, refuse_flag
from ..devices import DEVICE_NAMES
from .cli import parse_size

if TYPE_CHECKING:  # torch loads when a benchmark runs, not when `gradsum --help` parses
    import torch


@dataclass
class CodecRow:
    input: str
    codec: str
    workers: int
    size: int
    homomorphic: bool
    nmse: float
    bits_up: float
    bits_down: float
    encode_ms: float  # per worker: precondition + preliminary summary + encode (+ packing)
    aggregate_ms: float  # preliminary max + aggregate of all payloads (+ unpack/pack)
    decode_ms: float  # one worker
    copy_ms: float  # a partition-sized copy into a kept buffer, timed in every round of the codec
    copy_hot_ms: float  # the same copy repeated back to back: source and target in cache
    clock: str = "thread-cpu"  # CPU time of one thread (1 torch thread), "wall", "cuda-events"
    # NMSE of the last timed round: the same as ``nmse`` in distribution for stateless codecs,
    # warmed up (same inputs, ``repeats`` rounds later) for a warm-started one (powersgd)
    nmse_last: float = float("nan")
    seed: int = 0  # the inputs' draw
    # RMS over max of the workers' input norms (1: equal norms). A codec scaled by the largest
    # norm (THC) puts the other workers on fewer of its grid steps
    norm_spread: float = float("nan")

    @property
    def encode_decode_ratio(self) -> float:
        """Encode + decode over the copy in the same rounds (inputs as cold as the codec's)."""
        return (self.encode_ms + self.decode_ms) / self.copy_ms

    @property
    def encode_decode_hot_ratio(self) -> float:
        """Encode + decode over the cached copy: the stricter ratio."""
        return (self.encode_ms + self.decode_ms) / self.copy_hot_ms


def register(benches: argparse._SubParsersAction) -> None:
    from ..codecs import CODEC_NAMES
    from .inputs import INPUT_KINDS

    parser = benches.add_parser(
        "codecs",
        help="NMSE, wire bits and encode/aggregate/decode time per codec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workers", type=positive_int, default=4, help="simulated workers (4)")
    parser.add_argument("--size", type=parse_size, default=1 << 20, help="coordinates (2^20)")
    parser.add_argument(
        "--input",
        default=",".join(INPUT_KINDS),
        help=f"comma-separated inputs among {', '.join(INPUT_KINDS)} (all)",
    )
    parser.add_argument(
        "--codecs",
        default=",".join(CODEC_NAMES),
        help="comma-separated codecs (all), each with options of its own in parentheses if any: "
        "a row per variant, e.g. 'thc,thc(correlated=true,bits=8)'",
    )
    parser.add_argument("--seed", type=int, default=0, help="the inputs' draw (0)")
    refuse_flag(parser, "--options", "give each codec's options with it, --codecs 'thc(...)'")
    parser.add_argument(
        "--seeds", type=seed_list, default=None,
        help="several draws, e.g. 0-19 or 0,4,7 (instead of --seed): rows per draw, then each "
        "codec's NMSE over them and its ratio to the first codec's, draw by draw",
    )  # fmt: skip
    parser.add_argument(
        "--wall-clock",
        action="store_true",
        help="time with the wall clock and torch's default threads instead of the CPU time of "
        "one thread (CPU time is what stays comparable on a shared, loaded machine)",
    )
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed rounds (median)")
    parser.add_argument(
        "--error-feedback",
        action="store_true",
        help="wrap codecs in error feedback as training does (adds a reconstruct to encode)",
    )
    parser.add_argument(
        "--device", choices=DEVICE_NAMES, default=None,
        help="where the rounds run (default: cuda when present, else cpu); on a GPU the phases "
        "are timed with CUDA events on the device's timeline",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows as a JSON list here")
    parser.add_argument("--plot", type=Path, help="write a PNG of NMSE and time ratios here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from .inputs import INPUT_KINDS

    inputs = _choices(args.input, INPUT_KINDS, "--input")
    codecs = _variants(args.codecs)
    from ..devices import resolve_device

    args.device = resolve_device(getattr(args, "device", None))
    clock = time.perf_counter if args.wall_clock else time.thread_time
    if args.device == "cuda":
        clock = cuda_event_clock()
    threads = torch.get_num_threads()
    if not args.wall_clock:
        torch.set_num_threads(1)  # all work on this thread, so its CPU time is all the work
    seeds = args.seeds or [args.seed]
    if args.device == "cpu":  # the same codec is several times faster on one path than another
        from ..codecs.thc import native

        print(f"THC's CPU path: {native.path()}")
    try:
        rows = [row for seed in seeds for row in _measure_all(inputs, codecs, args, clock, seed)]
    finally:
        torch.set_num_threads(threads)
    if len(seeds) > 1:
        print(format_seed_summary(summarize_seeds(rows)))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"wrote {len(rows)} rows to {args.json}")
    if args.plot:
        plot_rows(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _measure_all(inputs, codecs, args, clock, seed: int) -> list[CodecRow]:
    from .inputs import input_shapes

    rows: list[CodecRow] = []
    for kind in inputs:
        made = _make_inputs(kind, args.workers, args.size, seed)
        vectors = [v.to(args.device) for v in made]
        for name in codecs:
            _progress(f"{kind}: {name}")
            if args.error_feedback and _refuses_feedback(name):
                print(f"{name}: skipped, it refuses error feedback", file=sys.stderr)
                continue
            row = measure_codec(
                name,
                kind,
                vectors,
                args.repeats,
                args.error_feedback,
                clock,
                shapes=input_shapes(kind, args.size),
            )
            row.seed = seed
            rows.append(row)
        print(f"seed {seed}")
        print(format_table([r for r in rows if r.input == kind]))
        print()
    return rows


def _refuses_feedback(spec: str) -> bool:
    from ..codecs import make_codec, split_spec

    codec = make_codec(split_spec(spec)[0], error_feedback=False)
    return codec.feedback_refusal is not None and not codec.keeps_own_feedback


def _variants(text: str) -> list[str]:
    """``--codecs``: codecs, each optionally with options of its own (``thc(correlated=true)``:
    a row per variant, side by side with the plain codec), every one checked."""
    from ..cli import UsageError
    from ..spec import split_list
    from ..train.methods import codec_spec

    try:
        chosen = split_list(text, "--codecs")
        for item in chosen:
            try:
                codec_spec(item)
            except ValueError as error:
                raise ValueError(f"--codecs {item}: {error}") from None
    except ValueError as error:
        raise UsageError(str(error)) from None
    return chosen


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    from ..cli import UsageError

    chosen = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        raise UsageError(
            f"{flag}: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(allowed)}"
        )
    return chosen


def _make_inputs(kind: str, workers: int, size: int, seed: int) -> list[torch.Tensor]:
    from .inputs import make_inputs

    return make_inputs(kind, workers, size, seed)


def _progress(message: str) -> None:
    if sys.stderr.isatty():
        print(f"\r\033[K  measuring {message}", end="", file=sys.stderr, flush=True)


# Untimed rounds first: the first allocates the round's buffers, the second reaches the
# recycled ones' steady state. The reference round gives every simulated worker an output
# buffer, and only worker 0's is written; until each has been written once, a buffer recycled
# to worker 0 would fault its pages in during the timed decode (~4 ms at 2^22 coordinates).
WARMUP_ROUNDS = 2


def measure_codec(
    name: str,
    kind: str,
    inputs: list[torch.Tensor],
    repeats: int,
    error_feedback: bool = False,
    clock: Callable[[], float] = time.thread_time,
    options: dict | None = None,
    shapes: list[tuple[int, ...]] | None = None,
) -> CodecRow:
    """``WARMUP_ROUNDS`` untimed rounds, then ``repeats`` timed rounds of the reference round
    (the round every aggregator runs, with ``codec.aggregate`` as its SUM); NMSE from the first
    round.
    ``shapes``: the tensors the input holds (codecs that work per tensor split it by them)."""
    from ..codecs import make_codec, nmse, parse_options, split_spec
    from ..codecs.round import PhaseClock, run_round

    workers = len(inputs)
    base, variant = split_spec(name)  # a variant's own options (``thc(correlated=true)``)
    options = {**parse_options(variant), **(options or {})}
    codec = make_codec(base, workers=workers, error_feedback=error_feedback, **options)
    if shapes:
        codec.describe(None, shapes)
    samples: dict[str, list[float]] = {"encode": [], "aggregate": [], "decode": [], "copy": []}
    # The copy is timed in every round, on a tensor the codec never touches (so its cache state
    # is like the inputs', each touched once a round): load on a shared machine then moves the
    # copy and the codec alike, and their ratio is what the table reports.
    import torch

    probe, destination = torch.randn_like(inputs[0]), torch.empty_like(inputs[0])
    first = result = None
    for step in range(repeats + WARMUP_ROUNDS):
        start = clock()
        destination.copy_(probe)
        copy_time = clock() - start
        phases = PhaseClock(clock)
        # The last round's result is let go first, as a worker lets its last average go: its
        # output buffer is then recycled for this round instead of a fresh one faulted in
        result = None
        result = run_round(codec, inputs, step=step, clock=phases)
        if first is None:  # kept for its NMSE and wire bits, not its (recyclable) output buffer
            first = dataclasses.replace(result, average=result.average.clone())
        if step >= WARMUP_ROUNDS:
            samples["copy"].append(copy_time)
            samples["encode"].append(phases.seconds["encode"] / workers)  # one worker's
            samples["aggregate"].append(phases.seconds["aggregate"])
            samples["decode"].append(phases.seconds["decode"])
    average = first.average
    shared = [s for _, _, s in first.pieces if s is not None]
    summary_bits = sum(s.numel() for s in shared) * codec.summary_bits() / average.numel()
    bits_up, bits_down = first.bits_per_coordinate()
    norms = torch.stack([torch.linalg.vector_norm(x.to(torch.float64)) for x in inputs])
    spread = float(norms.pow(2).mean().sqrt() / norms.max()) if float(norms.max()) > 0 else 1.0
    copy_hot_ms = cached_copy_ms(inputs[0], repeats, clock)
    return CodecRow(
        input=kind,
        codec=name,
        workers=workers,
        size=average.numel(),
        homomorphic=codec.homomorphic,
        nmse=nmse(average, inputs),
        nmse_last=nmse(result.average, inputs),
        bits_up=bits_up + summary_bits,
        bits_down=bits_down + summary_bits,
        encode_ms=_median_ms(samples["encode"]),
        aggregate_ms=_median_ms(samples["aggregate"]),
        decode_ms=_median_ms(samples["decode"]),
        copy_ms=_median_ms(samples["copy"]),
        copy_hot_ms=copy_hot_ms,
        clock=getattr(clock, "name", "wall" if clock is time.perf_counter else "thread-cpu"),
        norm_spread=spread,
    )


def seed_list(text: str) -> list[int]:
    """``--seeds``: ``0-19`` (both ends included) or ``0,4,7``; at least two distinct draws."""
    seeds: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            low, dash, high = part.partition("-")
            seeds.extend(range(int(low), int(high) + 1) if dash else [int(part)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not seeds (0-19 or 0,4,7): {text!r}") from None
    if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"--seeds needs at least two distinct seeds, none repeated: {text!r}"
        )
    return seeds


@dataclass(frozen=True)
class SeedSummary:
    """One codec on one input over several draws; ``ratio_*``: its NMSE over ``baseline``'s on
    the same draw, the mean with the half-width of its 95 % confidence interval (Student's t
    over the draws), and the range."""

    input: str
    codec: str
    baseline: str
    draws: int
    nmse_mean: float
    nmse_sd: float
    ratio_mean: float
    ratio_ci95: float
    ratio_min: float
    ratio_max: float
    norm_spread_mean: float


def summarize_seeds(rows: list[CodecRow]) -> list[SeedSummary]:
    """Every (input, codec) over its seeds, the ratios paired with the input's first codec."""
    from scipy.stats import t as student_t

    summaries = []
    for kind in dict.fromkeys(r.input for r in rows):
        selected = [r for r in rows if r.input == kind]
        baseline = selected[0].codec
        reference = {r.seed: r.nmse for r in selected if r.codec == baseline}
        for codec in dict.fromkeys(r.codec for r in selected):
            mine = [r for r in selected if r.codec == codec and r.seed in reference]
            values = [r.nmse for r in mine]
            ratios = [r.nmse / reference[r.seed] for r in mine]
            count = len(ratios)
            half = (student_t.ppf(0.975, count - 1) * statistics.stdev(ratios) / count**0.5
                    if count > 1 else float("nan"))  # fmt: skip
            summaries.append(
                SeedSummary(
                    input=kind,
                    codec=codec,
                    baseline=baseline,
                    draws=count,
                    nmse_mean=statistics.fmean(values),
                    nmse_sd=statistics.stdev(values) if count > 1 else float("nan"),
                    ratio_mean=statistics.fmean(ratios),
                    ratio_ci95=half,
                    ratio_min=min(ratios),
                    ratio_max=max(ratios),
                    norm_spread_mean=statistics.fmean(r.norm_spread for r in mine),
                )
            )
    return summaries


def format_seed_summary(summaries: list[SeedSummary]) -> str:
    if not summaries:
        return ""
    width = max(12, *(len(s.codec) for s in summaries))
    lines = []
    for kind in dict.fromkeys(s.input for s in summaries):
        selected = [s for s in summaries if s.input == kind]
        head = selected[0]
        lines += [
            f"input={kind} over {head.draws} draws (workers' norms: RMS / max = "
            f"{head.norm_spread_mean:.3f} on average); ratio: NMSE / {head.baseline}'s NMSE "
            "on the same draw",
            f"{'codec':<{width}} {'NMSE mean':>10} {'sd':>9} {'ratio mean':>10} "
            f"{'95% CI':>17} {'min':>6} {'max':>6}",
        ]
        for s in selected:
            low, high = s.ratio_mean - s.ratio_ci95, s.ratio_mean + s.ratio_ci95
            lines.append(
                f"{s.codec:<{width}} {s.nmse_mean:>10.4g} {s.nmse_sd:>9.2g} "
                f"{s.ratio_mean:>10.4f} {f'[{low:.4f}, {high:.4f}]':>17} {s.ratio_min:>6.3f} "
                f"{s.ratio_max:>6.3f}"
            )
        lines.append("")
    return "\n".join(lines)


def cuda_event_clock() -> Callable[[], float]:
    """Seconds on the current CUDA device's timeline: each reading records an event on the
    current stream and waits for it, so the difference of two readings is the GPU time of the
    work queued between them (a CPU clock would time only the launches)."""
    import torch

    base = torch.cuda.Event(enable_timing=True)
    base.record()

    def clock() -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        return base.elapsed_time(event) / 1000.0

    clock.name = "cuda-events"
    return clock


def cached_copy_ms(x: torch.Tensor, repeats: int, clock: Callable[[], float]) -> float:
    """Median ms of copying x into a reused buffer, back to back (both stay in cache)."""
    import torch

    buffer = torch.empty_like(x)
    return _time(lambda: buffer.copy_(x), repeats + 1, clock)


def _time(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return _median_ms(samples)


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def format_table(rows: list[CodecRow]) -> str:
    if not rows:
        return ""
    head = rows[0]
    width = max(12, *(len(r.codec) for r in rows))
    copy = statistics.median(r.copy_ms for r in rows)
    hot = statistics.median(r.copy_hot_ms for r in rows)
    lines = [
        f"input={head.input}  workers={head.workers}  size={head.size}  "
        f"copy={copy:.3f} ms in the rounds, {hot:.3f} ms back to back (cached)  "
        f"[{'wall clock' if head.clock == 'wall' else 'CPU time of one thread'}]",
        f"{'codec':<{width}} {'homo':>4} {'bits up':>8} {'down':>6} {'NMSE':>10} {'last':>9} "
        f"{'encode ms':>15} {'aggregate ms':>15} {'decode ms':>15} {'enc+dec':>8} "
        f"{'vs cached':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r.codec:<{width}} {'yes' if r.homomorphic else 'no':>4} {r.bits_up:>8.2f} "
            f"{r.bits_down:>6.2f} {r.nmse:>10.3g} {r.nmse_last:>9.3g} "
            f"{_timed(r.encode_ms, r.copy_ms):>15} {_timed(r.aggregate_ms, r.copy_ms):>15} "
            f"{_timed(r.decode_ms, r.copy_ms):>15} {r.encode_decode_ratio:>7.1f}x "
            f"{r.encode_decode_hot_ratio:>8.1f}x"
        )
    lines.append(
        "(NMSE: the first round's; 'last': the last timed round's, warm-started where a codec "
        "keeps state; ratios: time / a partition-sized copy timed in every round, its inputs as "
        "cold as the codec's; 'vs cached': encode + decode / the copy repeated back to back)"
    )
    return "\n".join(lines)


def _timed(ms: float, copy_ms: float) -> str:
    return f"{ms:7.2f} ({ms / copy_ms:5.1f}x)"


def plot_rows(rows: list[CodecRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r.input for r in rows))
    figure, axes = plt.subplots(len(kinds), 2, figsize=(12, 3.2 * len(kinds)), squeeze=False)
    for (nmse_axis, time_axis), kind in zip(axes, kinds, strict=True):
        selected = [r for r in rows if r.input == kind]
        names = [r.codec for r in selected]
        nmse_axis.bar(names, [max(r.nmse, 1e-12) for r in selected], color="tab:blue")
        nmse_axis.set_yscale("log")
        nmse_axis.set_title(f"{kind}: NMSE of the average (n={selected[0].workers})")
        parts = (
            ("encode_ms", "tab:green"),
            ("aggregate_ms", "tab:orange"),
            ("decode_ms", "tab:red"),
        )
        width = 0.8 / len(parts)
        for offset, (part, color) in enumerate(parts):
            positions = [i + (offset - 1) * width for i in range(len(selected))]
            ratios = [getattr(r, part) / r.copy_ms for r in selected]
            time_axis.bar(positions, ratios, width, color=color, label=part.removesuffix("_ms"))
        time_axis.set_xticks(range(len(selected)), names)
        time_axis.set_yscale("log")
        time_axis.set_title(f"{kind}: time / copy time of the partition")
        time_axis.legend(fontsize=8)
        for axis in (nmse_axis, time_axis):
            axis.tick_params(axis="x", rotation=45, labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

"""`gradsum train`: a real training job, locally on loopback or under torchrun across machines."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from ..bench.cli import fixed_cost, non_negative_int, positive_float, positive_int
from ..devices import DEVICE_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..codecs import CODEC_NAMES
    from .config import AGGREGATOR_NAMES, DATASET_NAMES, DDP, MODEL_NAMES, TrainConfig

    defaults = TrainConfig()
    parser = subparsers.add_parser(
        "train",
        help="train a model with a chosen aggregator, codec and scheduler",
        description="Train a model data-parallel. With no options: 4 local workers train the "
        "digits MLP with THC through a software switch on loopback. Under torchrun, this "
        "process is one worker; pass the aggregator's address with --switch or --servers.",
    )
    parser.add_argument(
        "--aggregator", choices=(*AGGREGATOR_NAMES, DDP), default=defaults.aggregator,
        help="gradsum's aggregators, or ddp: torch's DistributedDataParallel with --ddp-hook",
    )  # fmt: skip
    parser.add_argument("--codec", choices=CODEC_NAMES, default=defaults.codec)
    parser.add_argument(
        "--codec-options", default="", help="e.g. 'bits=4,granularity=30,p=1/32' (codec defaults)"
    )
    from ..schedule import PLANNER_NAMES

    parser.add_argument(
        "--scheduler",
        type=scheduler_spec,
        default=defaults.scheduler,
        metavar="POLICY[(OPTION=VALUE,...)]",
        help=f"communication plan, made at start-up from a measured profile and α-β "
        f"(docs/scheduling.md): {', '.join(PLANNER_NAMES)}, with the planner's options in "
        f"parentheses, e.g. 'imerge(interleave=true,window=group)' or "
        f"'priority(credit_elements=1000000)'; fusion's threshold defaults to --fusion-elements",
    )
    parser.add_argument("--fusion-elements", type=positive_int, default=defaults.fusion_elements)
    parser.add_argument(
        "--message-delay",
        type=float,
        default=defaults.message_delay,
        metavar="SECONDS",
        help="inject this many seconds per message on each worker's one communication thread "
        "(before a send, after its answer; serial across shards); the planners are told",
    )
    parser.add_argument(
        "--fixed-cost", type=fixed_cost, default=None, metavar="ALPHA,BETA",
        help="plan with this per-message cost instead of measuring it at start-up: α seconds "
        "per message and β seconds per byte (1e-3,3.3e-8 is 1 ms and 30 MB/s); the plan then "
        "does not depend on how loaded the machine was",
    )  # fmt: skip
    parser.add_argument("--model", choices=MODEL_NAMES, default=defaults.model)
    parser.add_argument("--dataset", choices=DATASET_NAMES, default=defaults.dataset)
    parser.add_argument("--data-dir", help="directory holding the dataset files (cifar10)")
    parser.add_argument("--workers", type=positive_int, default=defaults.workers)
    parser.add_argument("--epochs", type=positive_int, default=defaults.epochs)
    parser.add_argument(
        "--batch-size", type=positive_int, default=defaults.batch_size, help="per worker"
    )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--momentum", type=float, default=defaults.momentum)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--log", help="write JSON lines here (last line: the summary)")
    parser.add_argument(
        "--checkpoint", help="save model, optimizer and codec state here each epoch"
    )
    parser.add_argument("--resume", help="resume from a --checkpoint path")
    parser.add_argument("--switch", help="HOST:PORT of a running `gradsum switch` (a comma "
                        "list, one per pipeline, for `gradsum switch --pipelines N`)")  # fmt: skip
    parser.add_argument(
        "--servers", default="", help="comma-separated HOST:PORT of running `gradsum server`s"
    )
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout, help="seconds any wait may take"
    )
    parser.add_argument(
        "--standby", default="",
        help="comma-separated HOST:PORT of standby aggregators, one per --switch/--servers "
        "address: a lost aggregator's jobs move to its standby (default: wait for it to come "
        "back on its address)",
    )  # fmt: skip
    parser.add_argument(
        "--liveness", type=float, default=defaults.liveness, metavar="SECONDS",
        help="seconds without a result before a round checks that its aggregators and the "
        "other workers are alive (default %(default)s; 0: never)",
    )  # fmt: skip
    parser.add_argument(
        "--mtu", type=int, default=None,
        help="path MTU to the switch/servers, e.g. 9000 with jumbo frames: packets that fit one "
        "frame, a chunk of them per UDP GSO send (default: datagrams of up to 64 KiB, which IP "
        "fragments)",
    )  # fmt: skip
    parser.add_argument(
        "--window-bytes", type=positive_int, default=None, metavar="BYTES",
        help="bytes each worker keeps in flight to the switch/servers: as many chunks as fit "
        "(at most 32, the default). Size it to the path's buffer: a window larger than a slow "
        "link's queue loses packets every round (docs/benchmarks.md)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=DEVICE_NAMES, default=None,
        help="where the model trains: one GPU per local rank, gradients over NCCL where the "
        "aggregator is all-reduce (default: cuda when present, else cpu)",
    )  # fmt: skip
    add_workload_flags(parser, defaults)
    parser.set_defaults(run=run)


def add_workload_flags(parser: argparse.ArgumentParser, defaults) -> None:
    """The flags of the DDP peers, the gpt model's sizes, step-based runs and the divergence
    guard (shared with ``gradsum bench tta``)."""
    from .config import DDP_HOOK_NAMES, OPTIMIZER_NAMES
    from .guard import FALLBACK_NAMES

    parser.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default=defaults.optimizer)
    group = parser.add_argument_group("torch DDP (--aggregator ddp)")
    group.add_argument("--ddp-hook", choices=DDP_HOOK_NAMES, default=defaults.ddp_hook)
    group.add_argument("--powersgd-rank", type=positive_int, default=defaults.powersgd_rank)
    group.add_argument(
        "--powersgd-start", type=positive_int, default=defaults.powersgd_start,
        help="uncompressed steps before PowerSGD (at least 2)",
    )  # fmt: skip
    parser.add_argument(
        "--uncompressed-steps", type=non_negative_int, default=defaults.uncompressed_steps,
        metavar="N",
        help="the first N steps go uncompressed (fp32; bfp on a switch), whatever the codec or "
        "hook: what torch's PowerSGD hook does with its own --powersgd-start",
    )  # fmt: skip
    group = parser.add_argument_group("the gpt model (--model gpt --dataset stdlib)")
    group.add_argument("--layers", type=positive_int, default=defaults.layers)
    group.add_argument("--width", type=positive_int, default=defaults.width)
    group.add_argument("--heads", type=positive_int, default=defaults.heads)
    group.add_argument("--context", type=positive_int, default=defaults.context, help="tokens")
    group.add_argument(
        "--data-bytes", type=positive_int, default=defaults.data_bytes,
        help="bytes of training text (stdlib; default 8 MiB, validation an eighth of it)",
    )  # fmt: skip
    group = parser.add_argument_group("step-based runs (instead of --epochs)")
    group.add_argument("--max-steps", type=positive_int, default=defaults.max_steps)
    group.add_argument(
        "--eval-every", type=positive_int, default=defaults.eval_every,
        help="evaluate every N steps, outside the timed region",
    )  # fmt: skip
    group.add_argument(
        "--eval-seconds", type=positive_float, default=defaults.eval_seconds,
        help="also evaluate every S seconds of training, so methods of different step times "
        "are seen at the same wall-clock times",
    )  # fmt: skip
    group.add_argument(
        "--eval-samples", type=positive_int, default=defaults.eval_samples,
        help="validation samples per evaluation (default: all)",
    )  # fmt: skip
    group.add_argument(
        "--time-budget", type=float, default=defaults.time_budget,
        help="stop after this many seconds of training (evaluations not counted)",
    )  # fmt: skip
    group.add_argument(
        "--target-loss", type=float, default=defaults.target_loss,
        help="stop once the validation loss is at most this",
    )  # fmt: skip
    group = parser.add_argument_group("the divergence guard")
    group.add_argument(
        "--divergence-factor", type=float, default=defaults.divergence_factor,
        help="a loss above this times its running mean stops training (or falls back)",
    )  # fmt: skip
    group.add_argument(
        "--fallback", choices=FALLBACK_NAMES, default=defaults.fallback,
        help="on divergence: stop, or retry the step uncompressed (none) and count it",
    )  # fmt: skip


_WORKLOAD_FIELDS = (
    "optimizer", "ddp_hook", "powersgd_rank", "powersgd_start", "uncompressed_steps",
    "layers", "width", "heads",
    "context", "data_bytes", "max_steps", "eval_every", "eval_seconds", "eval_samples",
    "time_budget",
    "target_loss", "divergence_factor", "fallback",
)  # fmt: skip


def scheduler_spec(text: str) -> str:
    """``--scheduler``'s value, checked (``schedule.parse_scheduler``) and kept as given."""
    from ..schedule import parse_scheduler

    try:
        parse_scheduler(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


def workload_fields(args: argparse.Namespace) -> dict:
    """The ``TrainConfig`` fields that :func:`add_workload_flags` set."""
    return {name: getattr(args, name) for name in _WORKLOAD_FIELDS}


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from ..failures import WorkerFailed, report, write_failure_file
    from .aggregators import IncompatibleChoice, check_compatible
    from .launch import run_local, run_torchrun_worker, under_torchrun
    from .loop import TrainConfig

    config = TrainConfig(
        aggregator=args.aggregator,
        codec=args.codec,
        codec_options=args.codec_options,
        scheduler=args.scheduler,
        fusion_elements=args.fusion_elements,
        fixed_cost=args.fixed_cost,
        message_delay=args.message_delay,
        model=args.model,
        dataset=args.dataset,
        data_dir=args.data_dir,
        workers=args.workers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        seed=args.seed,
        log=args.log,
        checkpoint=args.checkpoint,
        resume=args.resume,
        switch=args.switch,
        servers=[s.strip() for s in args.servers.split(",") if s.strip()],
        timeout=args.timeout,
        mtu=args.mtu,
        window_bytes=args.window_bytes,
        device=_device(args.device),
        standby=[s.strip() for s in args.standby.split(",") if s.strip()],
        liveness=args.liveness,
        **workload_fields(args),
    )
    from ..dataplane.geometry import MAX_MTU, MIN_MTU

    if config.mtu is not None and not MIN_MTU <= config.mtu <= MAX_MTU:
        raise UsageError(f"--mtu {config.mtu}: must be between {MIN_MTU} and {MAX_MTU}")
    if not 0 <= config.message_delay < 1:
        raise UsageError(f"--message-delay {config.message_delay}: seconds in [0, 1)")
    try:
        check_compatible(config.aggregator, config.codec)
        _check_data(config)
        _check_reachable(config)
    except (IncompatibleChoice, ValueError, ConnectionError) as error:
        raise UsageError(str(error)) from None
    torchrun = under_torchrun()
    if not torchrun:
        from .methods import method_name

        print(
            f"training {config.model} on {config.dataset}: {config.workers} workers, "
            f"{method_name(config)}, scheduler {config.scheduler}",
            flush=True,
        )
    try:
        summary = run_torchrun_worker(config) if torchrun else run_local(config)
    except WorkerFailed as error:
        report("gradsum train", error.failure)
        write_failure_file(error.failure)
        if torchrun:
            _leave_without_teardown(1)
        return 1
    if summary.get("val_loss") is not None and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"done: validation loss {summary['val_loss']:.4f} ({summary['bits_per_byte']:.3f} "
            f"bits per byte) after {summary['steps']} steps, {summary['train_seconds']:.1f} s "
            f"training, {summary['fallbacks']} uncompressed retries{_resends(summary)}"
        )
    elif summary.get("test_accuracy") is not None and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"done: test accuracy {summary['test_accuracy']:.4f}, "
            f"{summary['samples_per_s']:,.0f} samples/s over {summary['epochs']} epochs "
            f"({summary['train_seconds']:.1f} s training{_resends(summary)})"
        )
    if torchrun:
        _leave_without_teardown(0)
    return 0


def _resends(summary: dict) -> str:
    """Worker 0's loss recovery, where gradsum's transport carried the gradients: datagrams
    resent of those sent, and how many of the resends waited out a timeout."""
    counters = summary.get("transport") or {}
    if not counters.get("packets_sent"):
        return ""
    return (
        f"; worker 0 resent {counters.get('retransmissions', 0):,} of "
        f"{counters['packets_sent']:,} datagrams ({counters.get('timeouts', 0):,} after a timeout)"
    )


def _device(asked: str | None) -> str:
    from ..devices import resolve_device

    return resolve_device(asked)


def _leave_without_teardown(status: int) -> NoReturn:
    """End a torchrun worker whose work is done and written, skipping the interpreter's teardown.

    Torch's gloo threads may still hold objects whose destruction during finalization aborts the
    process (pytorch/pytorch#179291 describes the mechanism): a CI run of the testbed training
    test lost a worker so, with SIGABRT and no Python frame on any thread (its code had ended).
    The process group is destroyed and every log line closed by now; only buffered output is
    left to flush. A failed worker leaves the same way once it has reported, so that its exit
    status is the 1 it reported and not an abort's.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _check_data(config) -> None:
    """Fail before starting any process when the data cannot be loaded."""
    from .data import load_dataset
    from .models import sample_shape

    load_dataset(config.dataset, config.data_dir, sample_shape(config), config.seed,
                 max_bytes=config.data_bytes)  # fmt: skip


def _check_reachable(config, timeout: float = 5.0) -> None:
    """Ask every given aggregator for its statistics, so a wrong address fails in seconds."""
    from ..net.client import ControlError, aggregator_stats
    from ..net.udp import parse_bind

    given = []
    if config.aggregator == "switch" and config.switch:
        given = [("--switch", address) for address in config.switch.split(",")]
    if config.aggregator == "ps":
        given = [("--servers", address) for address in config.servers]
    for flag, text in given:
        address = parse_bind(text, flag)
        try:
            aggregator_stats(address, timeout=timeout)
        except ControlError as error:
            if error.code != "no_reply":  # it answered (refusing us, say, without a secret)
                continue
            raise ConnectionError(
                f"{flag} {text}: no gradsum aggregator answers ({error})"
            ) from None

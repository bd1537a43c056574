"""`gradsum train`: a real training job, locally on loopback or under torchrun across machines."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from ..bench.cli import positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..codecs import CODEC_NAMES
    from .config import AGGREGATOR_NAMES, DATASET_NAMES, MODEL_NAMES, TrainConfig

    defaults = TrainConfig()
    parser = subparsers.add_parser(
        "train",
        help="train a model with a chosen aggregator, codec and scheduler",
        description="Train a model data-parallel. With no options: 4 local workers train the "
        "digits MLP with THC through a software switch on loopback. Under torchrun, this "
        "process is one worker; pass the aggregator's address with --switch or --servers.",
    )
    parser.add_argument("--aggregator", choices=AGGREGATOR_NAMES, default=defaults.aggregator)
    parser.add_argument("--codec", choices=CODEC_NAMES, default=defaults.codec)
    parser.add_argument(
        "--codec-options", default="", help="e.g. 'bits=4,granularity=30,p=1/32' (codec defaults)"
    )
    from ..schedule import PLANNER_NAMES

    parser.add_argument(
        "--scheduler",
        choices=PLANNER_NAMES,
        default=defaults.scheduler,
        help="communication plan, made at start-up from a measured profile and α-β "
        "(docs/scheduling.md); fusion uses --fusion-elements",
    )
    parser.add_argument("--fusion-elements", type=positive_int, default=defaults.fusion_elements)
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
        "--mtu", type=int, default=None,
        help="path MTU to the switch/servers, e.g. 9000 with jumbo frames: packets that fit one "
        "frame, a chunk of them per UDP GSO send (default: datagrams of up to 64 KiB, which IP "
        "fragments)",
    )  # fmt: skip
    parser.set_defaults(run=run)


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
    )
    from ..dataplane.geometry import MAX_MTU, MIN_MTU

    if config.mtu is not None and not MIN_MTU <= config.mtu <= MAX_MTU:
        raise UsageError(f"--mtu {config.mtu}: must be between {MIN_MTU} and {MAX_MTU}")
    try:
        check_compatible(config.aggregator, config.codec)
        _check_data(config)
        _check_reachable(config)
    except (IncompatibleChoice, ValueError, ConnectionError) as error:
        raise UsageError(str(error)) from None
    torchrun = under_torchrun()
    if not torchrun:
        print(
            f"training {config.model} on {config.dataset}: {config.workers} workers, "
            f"{config.aggregator} + {config.codec}, scheduler {config.scheduler}",
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
    if summary.get("test_accuracy") is not None and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"done: test accuracy {summary['test_accuracy']:.4f}, "
            f"{summary['samples_per_s']:,.0f} samples/s over {summary['epochs']} epochs "
            f"({summary['train_seconds']:.1f} s training)"
        )
    if torchrun:
        _leave_without_teardown(0)
    return 0


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
    from .models import input_shape

    load_dataset(config.dataset, config.data_dir, input_shape(config.model), config.seed)


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

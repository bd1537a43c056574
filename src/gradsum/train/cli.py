"""`gradsum train`: a real training job, locally on loopback or under torchrun across machines."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


def register(subparsers: argparse._SubParsersAction) -> None:
    from .config import SECTIONS, TrainConfig

    parser = subparsers.add_parser(
        "train",
        help="train a model with a chosen aggregator, codec and scheduler",
        description="Train a model data-parallel. With no options: 4 local workers train the "
        "digits MLP with THC through a software switch on loopback. Under torchrun, this "
        "process is one worker; pass the aggregator's address with --switch or --servers.",
    )
    from ..config import add_flags, refuse_flag

    add_flags(parser, SECTIONS, TrainConfig())
    refuse_flag(parser, "--codec-options",
                "give the options with the codec, --codec 'thc({})'")  # fmt: skip
    parser.set_defaults(run=run)


def job_config(args: argparse.Namespace):
    """The job the command line asks for, checked: flags that do not apply, bad values, and a
    --resume from another method's checkpoint are usage errors here, before anything starts."""
    from ..config import config_from
    from ..devices import configured_device
    from .config import SECTIONS, TrainConfig

    return configured_device(args, SECTIONS, config_from(args, SECTIONS, TrainConfig()))


def run(args: argparse.Namespace) -> int:
    from .. import processes
    from ..cli import UsageError
    from ..failures import WorkerFailed, report, write_failure_file
    from .checkpoints import epochs_done
    from .config import DATASET_MODULES, stepped
    from .launch import run_local, run_torchrun_worker

    config = job_config(args)
    torchrun = processes.under_torchrun()
    if config.resume is not None and not stepped(config):
        done = epochs_done(config.resume)
        if done >= config.epochs:  # every rank reads the same file: all leave here alike
            if int(os.environ.get("RANK", "0")) == 0:
                print(
                    f"nothing to train: {config.resume} holds {done} epochs and --epochs is "
                    f"{config.epochs}, which counts them all; raise it to train more"
                )
            if torchrun:
                _leave_without_teardown(0)
            return 0
    if not torchrun:  # the workers' imports run while this process checks data and services
        processes.start_forkserver(DATASET_MODULES.get(config.dataset, ()))
    try:
        _check_data(config)
        _check_reachable(config)
    except (ValueError, ConnectionError) as error:
        raise UsageError(str(error)) from None
    if not torchrun:
        from .methods import method_name

        print(
            f"training {config.model} on {config.dataset}: {config.workers} workers, "
            f"{method_name(config)}, scheduler {config.scheduler} (starting the workers: "
            "each imports torch and joins the group, which takes seconds)",
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

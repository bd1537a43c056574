"""`gradsum server`: a parameter server speaking the aggregation protocol, which may decode."""

from __future__ import annotations

import argparse

from .daemon_cli import add_daemon_arguments, run_daemon


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "server",
        help="run a parameter server (integer, float and decode-sum-encode aggregation)",
        description="Aggregate workers' payloads like `gradsum switch`, and also sum float32 and "
        "run decode -> sum -> re-encode for codecs a switch cannot sum (topk, dgc, terngrad, "
        "qsgd, fp16). SIGINT/SIGTERM stop it; SIGUSR1 prints statistics.",
    )
    add_daemon_arguments(parser, job_memory_mib=1024)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..dataplane.plane import server_profile

    return run_daemon(args, server_profile)

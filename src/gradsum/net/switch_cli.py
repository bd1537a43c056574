"""`gradsum switch`: a software switch running the SwitchML data plane (integer ops only)."""

from __future__ import annotations

import argparse

from .daemon_cli import add_daemon_arguments, run_daemon


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "switch",
        help="run a software aggregation switch (SwitchML data plane, integer sums, loss recovery)",
        description="Aggregate workers' integer payloads (bfp, thc) in bounded slot memory, as "
        "a programmable switch would. Jobs are registered over the wire (docs/protocol.md) or "
        "with --register. SIGINT/SIGTERM stop it; SIGUSR1 prints statistics.",
    )
    add_daemon_arguments(parser, job_memory_mib=256)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..dataplane.plane import switch_profile

    return run_daemon(args, switch_profile)

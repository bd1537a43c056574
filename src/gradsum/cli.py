"""The `gradsum` command line: one sub-command per feature module.

Each feature module exposes ``register(subparsers)``, which adds its parser and sets ``run`` to a
function taking the parsed arguments and returning an exit status. Modules import their heavy
dependencies inside ``run`` so that ``gradsum --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .failures import WorkerFailed, report

# Modules that contribute sub-commands, in the order `gradsum --help` lists them.
COMMAND_MODULES = (
    "gradsum.bench.cli",
    "gradsum.codecs.thc.cli",
    "gradsum.net.switch_cli",
    "gradsum.net.server_cli",
    "gradsum.train.cli",
    "gradsum.testbed.cli",
    "gradsum.sim.cli",
)


class UsageError(Exception):
    """A flag or value the user gave is invalid; the message names it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsum",
        description="Gradient aggregation for data-parallel PyTorch: THC, in-network "
        "aggregation (SwitchML), parameter servers and communication scheduling.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except UsageError as error:
        parser.exit(2, f"gradsum {args.command}: error: {error}\n")
    except WorkerFailed as error:  # a worker's error is news, its launcher's traceback is not
        report(f"gradsum {args.command}", error.failure)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m gradsum.cli` (as under torchrun) runs this file as __main__: run the imported
    # module's main, whose UsageError is the class the sub-commands raise
    from gradsum.cli import main as _main

    sys.exit(_main())

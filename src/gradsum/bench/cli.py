"""`gradsum bench WHAT`: benchmarks that compare methods side by side in one run.

Each benchmark module exposes ``register(bench_subparsers)``; add new ones to BENCH_MODULES.
"""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES = (
    "gradsum.bench.codecs",
    "gradsum.bench.ate",
    "gradsum.bench.train",
    "gradsum.bench.tta",
    "gradsum.bench.quality",
    "gradsum.bench.scale",
    "gradsum.bench.plays",
    "gradsum.bench.report",
    "gradsum.bench.ps_core",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: methods side by side in one run, with ratios",
        description="Benchmarks that compare methods side by side in one run and report ratios "
        "(this machine may be shared and noisy: compare ratios, not absolute times).",
    )
    benches = parser.add_subparsers(dest="bench", metavar="WHAT")
    for module_name in BENCH_MODULES:
        importlib.import_module(module_name).register(benches)
    parser.set_defaults(run=lambda args: parser.print_help() or 0)


def parse_size(text: str) -> int:
    """Accept 1048576, 2^20, 2**20, 1M, 4Mi (elements)."""
    cleaned = text.strip().replace("**", "^")
    try:
        if "^" in cleaned:
            base, _, exponent = cleaned.partition("^")
            value = int(base) ** int(exponent)
        elif cleaned[-2:].lower() == "mi" or cleaned[-1:].upper() == "M":
            value = int(cleaned.rstrip("iIMm")) * (1 << 20)
        elif cleaned[-2:].lower() == "ki" or cleaned[-1:].upper() == "K":
            value = int(cleaned.rstrip("iIKk")) * (1 << 10)
        else:
            value = int(cleaned)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1048576 or 2^20)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def parse_list(text: str, convert, flag: str) -> list:
    from ..cli import UsageError

    try:
        values = [convert(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"--{flag} {text!r}: not a comma-separated list") from None
    if not values:
        raise UsageError(f"--{flag} is empty")
    return values

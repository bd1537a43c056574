"""`gradsum thc-table`: print the optimal THC lookup table for (bits, granularity, p)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "thc-table",
        help="print the optimal THC lookup table for given bits, granularity and clamp fraction",
        description="Solve the THC lookup table exactly (dynamic program, milliseconds) and print "
        "it on one line.",
    )
    parser.add_argument("--bits", type=int, default=4, help="index bits b (default 4)")
    parser.add_argument(
        "--granularity",
        type=int,
        default=None,
        help="grid size g (default 2^(b+1) - 2: 30 at 4 bits)",
    )
    parser.add_argument("--p", type=_fraction, default=1 / 32, help="clamp fraction p, e.g. 1/32")
    parser.add_argument("--errors", action="store_true", help="also print the expected errors")
    parser.set_defaults(run=run)


def _fraction(text: str) -> float:
    try:
        if "/" in text:
            numerator, _, denominator = text.partition("/")
            return float(numerator) / float(denominator)
        return float(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number or fraction: {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from ...cli import UsageError
    from .tables import default_granularity, solve_table, table_error

    granularity = args.granularity
    if granularity is None:
        granularity = default_granularity(args.bits)
    try:
        table = solve_table(args.bits, granularity, args.p)
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(" ".join(str(v) for v in table))
    if args.errors:
        rounding, clamp = table_error(table, args.p)
        total = rounding + clamp
        print(f"rounding variance {rounding:.5f}, clamp error {clamp:.5f}, total {total:.5f}")
    return 0

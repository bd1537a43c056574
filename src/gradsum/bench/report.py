"""`gradsum bench report DIR`: the headline tables and plots again, from the JSON files in DIR.

Trains nothing. Each ``*.json`` in DIR (in name order) is told by its shape and rendered by the
bench that wrote it, exactly as that bench's ``--from-json`` renders it:

* a `bench quality` file (an object with "rows" and "report"): its report, and its plot;
* a `bench tta` file (a list of rows with "method" and "evals"): its table, and its plot, with
  the target loss the baseline's own final validation loss (the median over its seeds), the
  target the reference tables in docs/benchmarks.md use.

Each plot is written as ``STEM.png`` into --plots (by default DIR, next to its JSON). A file of
any other shape is an error naming it, so that a table cannot go missing from the report.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from . import quality, tta

KINDS = ("quality", "tta")


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "report",
        help="the headline tables and plots again from a folder of bench JSON files (quality, "
        "tta); trains nothing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", type=Path, metavar="DIR", help="folder of bench JSON files")
    parser.add_argument(
        "--plots", type=Path, metavar="PLOTDIR",
        help="write each file's plot here as STEM.png (default: DIR, next to its JSON)",
    )  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError

    if not args.dir.is_dir():
        raise UsageError(f"bench report {args.dir}: not a folder")
    paths = sorted(args.dir.glob("*.json"))
    if not paths:
        raise UsageError(f"bench report {args.dir}: holds no .json files")
    plots = args.plots if args.plots is not None else args.dir
    plots.mkdir(parents=True, exist_ok=True)
    # every file read and told apart before anything is printed: a bad one fails the command
    # without half a report
    documents = [(path, *_read(path)) for path in paths]
    for index, (path, kind, document) in enumerate(documents):
        plot = plots / f"{path.stem}.png"
        text = render(kind, document, path, plot)
        print(("\n" if index else "") + f"== {path.name} (bench {kind}); plot: {plot}\n{text}")
    return 0


def kind_of(document) -> str | None:
    """Which bench wrote a parsed JSON document: "quality", "tta", or None."""
    if isinstance(document, dict) and "rows" in document and "report" in document:
        return "quality"
    if (
        isinstance(document, list)
        and document
        and all(isinstance(r, dict) and "method" in r and "evals" in r for r in document)
    ):
        return "tta"
    return None


def tta_target(rows: list[tta.TTARow]) -> float | None:
    """The baseline's (the first row's method) final validation loss, median over its seeds."""
    finals = [row.final_val_loss for row in rows
              if row.method == rows[0].method and not row.failed
              and row.final_val_loss is not None]  # fmt: skip
    return statistics.median(finals) if finals else None


def render(kind: str, document, path: Path, plot: Path | None) -> str:
    """One file's table (as its bench's ``--from-json`` prints it), its plot written to
    ``plot`` when given."""
    if kind == "quality":
        runs = [quality.Run.from_record(record) for record in document["rows"]]
        baseline = document.get("baseline") or runs[0].row.method
        if plot is not None:
            quality.plot(runs, baseline, plot)
        return quality.format_report(quality.report(runs, baseline))
    if kind == "tta":
        rows = [tta.row_from_dict(record) for record in document]
        target = tta_target(rows)
        rows = [tta.with_target(row, target) for row in rows]
        if plot is not None:
            tta.plot_runs(rows, plot, target)
        return tta.format_table(rows, target)
    raise ValueError(f"{path}: unknown kind {kind!r}")


def _read(path: Path):
    from ..cli import UsageError

    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"bench report: {path}: not readable JSON ({error})") from None
    kind = kind_of(document)
    if kind is None:
        raise UsageError(
            f"bench report: {path}: not a JSON of a bench it renders ({', '.join(KINDS)}): "
            "move it out of the folder"
        )
    return kind, document

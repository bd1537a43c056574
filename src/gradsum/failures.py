"""How a failed worker is reported: its rank and its exception's type and message, on one line.

Every launcher says it the same way — ``gradsum train`` (locally and under torchrun),
``gradsum bench train`` (per row, also in a testbed) and ``gradsum bench ate``'s Gloo workers::

    gradsum train: worker 1 failed: NonFiniteGradientError: gradient of 4096 coordinates ...

A worker catches its exception and sends the launcher a ``Failure`` (a plain, picklable record:
the exception object itself may not survive pickling, and its traceback never does). The full
traceback is printed only when ``GRADSUM_TRACEBACK=1``. A process that cannot hand a ``Failure``
to its launcher in memory (a worker started under torchrun, or by the testbed bench) writes it as
JSON to the file named by ``GRADSUM_FAILURE_FILE`` when that is set.

This module imports neither torch nor anything heavy: launchers load it before they know whether
they need torch.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

TRACEBACK_ENV = "GRADSUM_TRACEBACK"
FAILURE_FILE_ENV = "GRADSUM_FAILURE_FILE"

# An error raised in (or passed on through) a torch.futures ``then()`` callback reaches whoever
# waits as a RuntimeError whose message is this prefix, then the original's "Type: message", then
# its stack after "\n\nAt:\n"; the original exception object is gone (no __cause__), so its
# message is all that names it. Chained callbacks nest the prefix once per callback.
_TORCH_CALLBACK = "Got the following error when running the callback: "
_TORCH_STACK = "\n\nAt:\n"
_TORCH_EMPTY = "<EMPTY MESSAGE>"  # what torch writes for an exception without a message
_TYPE_THEN_MESSAGE = re.compile(r"([A-Za-z_][\w.]*)(?:: (.*))?\Z", re.DOTALL)


def describe_failure(error: BaseException) -> tuple[str, str]:
    """The type name and message of the exception that really went wrong behind ``error``.

    Unwraps what only carries another exception: torch.futures' callback wrapper (by its message,
    the only place the original survives) and an exception without a message of its own that was
    raised from, or while handling, another. An exception with a message of its own is reported
    as it is, also when it has a cause: whoever raised it chose those words for people.
    """
    seen = {id(error)}  # a chain set by hand can loop
    while not str(error) and (inner := error.__cause__ or _context(error)) is not None:
        if id(inner) in seen:
            break
        seen.add(id(inner))
        error = inner
    name, message = type(error).__name__, str(error)
    while name == "RuntimeError" and message.startswith(_TORCH_CALLBACK):
        original = message[len(_TORCH_CALLBACK) :].split(_TORCH_STACK, 1)[0]
        match = _TYPE_THEN_MESSAGE.match(original)
        if match is None:  # not torch's format after all: keep the wrapper's words
            break
        name, message = match.group(1), match.group(2) or ""
        if message == _TORCH_EMPTY:
            message = ""
    return name, message


def _context(error: BaseException) -> BaseException | None:
    return None if error.__suppress_context__ else error.__context__


@dataclass(frozen=True)
class Failure:
    """One worker's failure: what ``describe_failure`` found, its rank, and the traceback."""

    type: str
    message: str
    rank: int | None = None  # None: not one worker's (the launcher's own, or a whole job's)
    traceback: str = ""

    @classmethod
    def of(cls, error: BaseException, rank: int | None = None) -> Failure:
        """``error`` described; a ``WorkerFailed`` gives back the failure it carries."""
        if isinstance(error, WorkerFailed):
            return error.failure
        name, message = describe_failure(error)
        return cls(name, message, rank, "".join(traceback.format_exception(error)))

    @property
    def what(self) -> str:
        """``Type: message`` (the type alone when there is no message)."""
        return f"{self.type}: {self.message}" if self.message else self.type

    def __str__(self) -> str:
        return self.what if self.rank is None else f"worker {self.rank} failed: {self.what}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> Failure:
        return cls(record["type"], record["message"], record.get("rank"),
                   record.get("traceback", ""))  # fmt: skip


class WorkerFailed(RuntimeError):
    """A worker raised; ``failure`` names the worker and what it raised."""

    def __init__(self, failure: Failure):
        super().__init__(failure)  # the one argument: str() is the failure's, and it pickles
        self.failure = failure

    @property
    def details(self) -> str:
        """The worker's traceback."""
        return self.failure.traceback


def report(prefix: str, failure: Failure, file: TextIO | None = None) -> None:
    """Print ``PREFIX: worker R failed: Type: message`` to ``file`` (default stderr), after the
    traceback (on stderr) when ``GRADSUM_TRACEBACK`` is set, else with a hint that it shows where.
    """
    show = bool(os.environ.get(TRACEBACK_ENV))
    if show and failure.traceback:
        print(failure.traceback.rstrip(), file=sys.stderr, flush=True)
    hint = "" if show or not failure.traceback else f" ({TRACEBACK_ENV}=1 shows where)"
    print(f"{prefix}: {failure}{hint}", file=file or sys.stderr, flush=True)


def write_failure_file(failure: Failure) -> None:
    """Write ``failure`` as JSON where ``GRADSUM_FAILURE_FILE`` says, if it says."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if path:
        Path(path).write_text(json.dumps(failure.to_json()) + "\n")


def read_failure_file(path: Path) -> Failure | None:
    """The failure a worker wrote to ``path``; None when it wrote none (or not all of one: it
    died while writing)."""
    try:
        return Failure.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError):
        return None

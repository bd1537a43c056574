"""Imported by gradsum's forkserver only, last of what it preloads (``processes.start_forkserver``):
when its launcher is gone the forkserver ends at once instead of finalizing an interpreter that
imported torch (1.5 s here), which held the launcher's stderr open that long after every run.
It has nothing to flush: its listener is closed before it exits, and its workers are processes of
their own. The workers it forks inherit the handler and skip it (another pid): they end through
``launch._exit_worker``, which runs the exit handlers and keeps its status."""

import atexit
import os

_FORKSERVER = os.getpid()


def _end_at_once() -> None:
    if os.getpid() == _FORKSERVER:
        os._exit(0)


atexit.register(_end_at_once)  # registered last, run first

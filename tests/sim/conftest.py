"""Simulations several test modules read, computed once per session (in parallel processes).

Each table is kept in pytest's cache folder under a key made of everything that decides it:
gradsum's sources (the simulator, its presets, the planners it plays), the Python and numpy
versions, and the call's arguments. A change to any of them computes it afresh; an unchanged
tree reads it back, and parallel test processes (pytest-xdist) wait for the one computing it
instead of computing it again.
"""

import fcntl
import hashlib
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gradsum
from gradsum.sim.presets import get_preset
from gradsum.sim.scaling import default_processes, sweep

SEED_MODELS = ("resnet18", "vgg16", "alexnet", "resnet50")
SEED_POLICIES = ("default", "wfbp", "fusion", "mgwfbp", "priority", "merge", "imerge")
CACHE_WAIT_S = 900.0  # another process computing the table: at most this long


def table_processes() -> int:
    """Processes to compute a table in: one per core, except under pytest-xdist, whose other
    workers keep the cores busy; there a pool only adds its processes' start (an interpreter,
    torch and the profiles each: ~13 s of CPU for the two tables, on a stage bound by CPU)."""
    return 1 if os.environ.get("PYTEST_XDIST_WORKER") else default_processes()


def _inputs_digest(*arguments) -> str:
    digest = hashlib.sha256(repr((sys.version, np.__version__, arguments)).encode())
    root = Path(gradsum.__file__).parent
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def cached_table(request, name: str, compute, *arguments):
    """``compute()``, or what it returned before for the same sources and ``arguments``."""
    cache = getattr(request.config, "cache", None)
    if cache is None:  # -p no:cacheprovider
        return compute()
    folder = Path(cache.mkdir("gradsum-sim"))
    path = folder / f"{name}-{_inputs_digest(name, *arguments)}.pickle"
    with (folder / f"{name}.lock").open("w") as lock:
        deadline = time.monotonic() + CACHE_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another test process held {folder / name}.lock for {CACHE_WAIT_S} s "
                        "(computing the simulator's table)"
                    ) from None
                time.sleep(0.2)
        if path.is_file():
            return pickle.loads(path.read_bytes())
        table = compute()
        for stale in folder.glob(f"{name}-*.pickle"):  # earlier sources' tables
            stale.unlink()
        partial = path.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(table))
        partial.replace(path)
        return table


@pytest.fixture(scope="session")
def seed_table(request):
    """``imerge-seed`` at 32 workers: every model and policy, by (model, policy)."""

    def compute():
        rows = sweep(get_preset("imerge-seed"), SEED_MODELS, [32], SEED_POLICIES,
                     processes=table_processes())  # fmt: skip
        return {(r["model"], r["policy"]): r for r in rows}

    return cached_table(request, "seed-table", compute, SEED_MODELS, SEED_POLICIES, 32)


@pytest.fixture(scope="session")
def fit_table(request):
    """``imerge-seed-fit`` scored: the five scored policies at 1 and 32 workers (40 runs)."""
    from gradsum.sim.score import scored_rows

    return cached_table(
        request,
        "fit-table",
        lambda: scored_rows(get_preset("imerge-seed-fit"), processes=table_processes()),
    )

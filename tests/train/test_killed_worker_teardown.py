"""A worker killed with SIGKILL leaves no job of its run on an external aggregator: the
survivors, or else the launcher (all workers killed at once), tear them down."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsum.net.client import aggregator_stats
from gradsum.net.loopback import DaemonProcess

from .helpers import descendants, wait_for_rounds

TEARDOWN_BOUND_S = 15.0  # the bound from the kill to an empty job table


def _workers(root: int) -> list[int]:
    """The worker processes of a local `gradsum train` by rank: its descendants named
    ``gradsum-rank<N>`` (forked from its forkserver, beside the manager)."""
    found = {}
    for pid in descendants(root):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("gradsum-rank"):
            found[int(name.removeprefix("gradsum-rank"))] = pid
    return [found[rank] for rank in sorted(found)]


@pytest.mark.slow
@pytest.mark.serial  # within 15 s of the kill: alone on the host
@pytest.mark.parametrize("kind, victim", [("switch", 1), ("server", 0), ("switch", "all")])
def test_a_killed_worker_leaves_no_job_on_an_external_aggregator(kind, victim):
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}  # fmt: skip
    with DaemonProcess(kind) as daemon:
        where = f"{daemon.address[0]}:{daemon.address[1]}"
        flags = ["--aggregator", "switch", "--switch", where] if kind == "switch" else [
            "--aggregator", "ps", "--servers", where]  # fmt: skip
        command = [sys.executable, "-m", "gradsum.cli", "train", *flags, "--workers", "3",
                   "--codec", "thc", "--epochs", "50", "--batch-size", "8", "--liveness", "1"]
        run = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            wait_for_rounds(daemon.address, run)
            assert run.poll() is None, run.communicate()[1][-3000:]
            workers = _workers(run.pid)
            assert len(workers) == 3, workers
            for pid in workers if victim == "all" else [workers[victim]]:
                os.kill(pid, signal.SIGKILL)  # "all": no survivor can tear down
            killed = time.monotonic()
            while aggregator_stats(daemon.address)["jobs"]:
                assert time.monotonic() - killed < TEARDOWN_BOUND_S, (
                    f"jobs still registered {TEARDOWN_BOUND_S:g} s after the kill: "
                    f"{sorted(aggregator_stats(daemon.address)['jobs'])}")  # fmt: skip
                time.sleep(0.2)
            _, err = run.communicate(timeout=120)
        finally:
            if run.poll() is None:  # its workers and manager too, which hold its stderr
                for pid in [*descendants(run.pid), run.pid]:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                run.communicate(timeout=60)
    assert run.returncode != 0
    # the launcher names the killed worker, not a survivor's reset connection to it
    named = 0 if victim == "all" else victim
    assert f"gradsum train: worker {named} failed: Killed: the process ended by SIGKILL" in err, (
        err[-2000:])  # fmt: skip

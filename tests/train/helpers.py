"""What the tests that run training as a command (`gradsum train`, torchrun) share: the
command's process tree, and the wait for its rounds on an aggregator."""

import time
from pathlib import Path

from gradsum.net.client import aggregator_stats


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children before their own children."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def wait_for_rounds(address, run, rounds: int = 20, limit: float = 180.0) -> None:
    """Until a job on the aggregator at ``address`` has completed ``rounds`` rounds (training
    is going through), ``run`` (a Popen) has ended, or ``limit`` seconds have passed; the
    caller asserts which."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and run.poll() is None:
        jobs = aggregator_stats(address)["jobs"]
        if any(counters.get("completed", 0) >= rounds for counters in jobs.values()):
            return
        time.sleep(0.05)

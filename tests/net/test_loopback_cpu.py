"""CPU accounting of daemon processes (`gradsum bench ate`'s CPU column): a process tree's time."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gradsum.net.loopback import tree_cpu_seconds

# A parent that only waits, with a child that spins for 0.5 s of CPU and then waits too.
_TREE = """
import os, sys, time
if os.fork() == 0:
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    print("spun", flush=True)
    time.sleep(30)
    os._exit(0)
time.sleep(30)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_counts_the_live_children_of_a_process():
    process = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        assert process.stdout.readline() == "spun\n"
        time.sleep(0.05)
        own = tree_cpu_seconds(process.pid)
        assert own is not None and own >= 0.45  # the child's 0.5 s, though the parent idled
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the child too
        process.wait(timeout=5)


def test_a_process_that_is_gone_has_no_figure():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    assert tree_cpu_seconds(process.pid) is None

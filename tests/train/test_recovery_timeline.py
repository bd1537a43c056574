"""A switch killed with no restart and no standby ends the run within the documented
timeline (liveness + probe + the wait for a restart), and tells one story."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gradsum.net.client import PROBE_TIMEOUT
from gradsum.net.loopback import DaemonProcess
from gradsum.sync.recovery import FAILOVER_WAIT

from .helpers import wait_for_rounds

LIVENESS = 1.0
SLACK = 5.0  # teardowns and the workers' exits after the decision


@pytest.mark.slow
@pytest.mark.serial  # bounded by the run's timeline: the seconds, alone on the host
def test_a_killed_switch_without_restart_or_standby_ends_the_run_in_time_with_one_story():
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    switch = DaemonProcess("switch")
    where = f"{switch.address[0]}:{switch.address[1]}"
    command = [sys.executable, "-m", "gradsum.cli", "train", "--aggregator", "switch",
               "--switch", where, "--workers", "2", "--codec", "thc", "--epochs", "50",
               "--batch-size", "8", "--liveness", str(LIVENESS), "--timeout", "60"]
    run = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: list[tuple[float, str]] = []  # (when, line) of the launcher's stderr
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line.rstrip())
                                                          for line in run.stderr))  # fmt: skip
    reader.start()
    try:
        wait_for_rounds(switch.address, run)
        assert run.poll() is None, "\n".join(line for _, line in lines[-40:])
        switch.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        run.wait(timeout=120)
        reader.join(10)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        switch.process.kill()
        switch.process.communicate()
    text = "\n".join(line for _, line in lines)
    bound = LIVENESS + PROBE_TIMEOUT + FAILOVER_WAIT + SLACK
    assert run.returncode != 0
    failed = [i for i, (_, line) in enumerate(lines) if "RecoveryFailed" in line]
    assert len(failed) == 1, text[-3000:]
    when, line = lines[failed[0]]
    assert line.startswith("gradsum train: worker") and (
        "did not answer for 10 s and has no standby" in line), line  # fmt: skip
    assert not [x for _, x in lines[: failed[0]] if "registered again" in x], text[-3000:]
    # The report comes once every worker has ended and the run's jobs are torn down: the
    # run is over (the launcher's own interpreter exit follows)
    assert when - killed <= bound, f"the run ended {when - killed:.1f} s after the kill " \
        f"(bound {bound:g} s)"  # fmt: skip

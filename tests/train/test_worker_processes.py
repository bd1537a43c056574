"""Workers forked from the launcher's forkserver (``gradsum.processes``) end with their launcher,
even one killed outright: SIGKILL runs no handler of the launcher's, and a worker left behind
would go on training, holding its cores, ports and aggregator jobs, until some timeout."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

LAUNCHER = textwrap.dedent(
    """
    import os, signal, sys, time
    from gradsum import processes

    def worker(marks):
        def stopped(signum, frame):
            with open(marks, "a") as f:
                f.write("terminated\\n")
            os._exit(0)

        signal.signal(signal.SIGTERM, stopped)
        with open(marks, "a") as f:
            f.write(f"started {os.getpid()}\\n")
        while True:
            time.sleep(0.05)

    if __name__ == "__main__":
        ctx = processes.context()
        child = processes.process(ctx, worker, (sys.argv[1],))
        processes.start(child)
        print(ctx.get_start_method(), flush=True)
        child.join()
    """
)


def _wait_for(predicate, what: str, deadline: float = 60.0):
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"waited {deadline:.0f} s for {what}")
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_forked_worker_stops_when_its_launcher_is_killed(tmp_path):
    script, marks = tmp_path / "launcher.py", tmp_path / "marks"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen([sys.executable, str(script), str(marks)],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert launcher.stdout.readline().strip() == "forkserver"
        _wait_for(lambda: marks.exists() and "started" in marks.read_text(), "the worker")
        pid = int(marks.read_text().split()[1])
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        # the bug feared: the worker trains on with nobody to stop it
        _wait_for(lambda: "terminated" in marks.read_text(), "the worker's SIGTERM")
        _wait_for(lambda: not _alive(pid), "the worker to exit")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if marks.exists() and "started" in marks.read_text():
            pid = int(marks.read_text().split()[1])
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False

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


# A launcher whose forkserver preloads a module that registers an exit handler (as torch's
# modules do), and forks one worker that ends as a local training worker does, with status 3.
FINALIZED = textwrap.dedent(
    """
    import atexit, os, sys

    def note():
        with open(os.environ["MARKS"], "a") as f:
            f.write(f"finalized {os.getpid()}\\n")

    atexit.register(note)
    """
)

EXITING = textwrap.dedent(
    """
    from gradsum import processes

    def worker():
        from gradsum.train.launch import _exit_worker

        _exit_worker(3)  # a local worker's end: the exit handlers, then its status

    if __name__ == "__main__":
        assert processes.start_forkserver(("finalized_marker",))
        ctx = processes.context()
        child = processes.process(ctx, worker, ())
        processes.start(child)
        child.join()
        from multiprocessing import forkserver
        print(child.exitcode, forkserver._forkserver._forkserver_pid, flush=True)
    """
)


def test_the_forkserver_ends_without_finalizing_and_its_workers_keep_their_status(tmp_path):
    """The forkserver imported torch: finalizing that interpreter took 1.5 s after every run,
    with the launcher's stderr held open. Its workers inherit its exit handler and must skip it:
    one that ran it would end with status 0 whatever it exited with."""
    (tmp_path / "finalized_marker.py").write_text(FINALIZED)
    script, marks = tmp_path / "launcher.py", tmp_path / "marks"
    script.write_text(EXITING)
    environment = {**os.environ, "MARKS": str(marks),
                   "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}  # fmt: skip
    run = subprocess.run([sys.executable, str(script)], env=environment, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    status, server = (int(word) for word in run.stdout.split())
    assert status == 3
    _wait_for(lambda: not _alive(server), "the forkserver to exit")
    finalized = marks.read_text().split() if marks.exists() else []
    assert f"{server}" not in finalized  # the forkserver skipped the other exit handlers
    assert len(finalized) == 2  # the worker ran them: "finalized <its pid>"

"""Training that survives faults: a switch killed mid-training and restarted on its port, a
killed worker, a torchrun restart from the last checkpoint."""

import faulthandler
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gradsum.failures import WorkerFailed
from gradsum.net.client import aggregator_stats
from gradsum.net.loopback import DaemonProcess
from gradsum.train.launch import _join, run_local
from gradsum.train.loop import TrainConfig

from ..sync.test_recovery import _kill_when_busy
from .helpers import descendants

COMMON = {"aggregator": "switch", "codec": "thc", "workers": 2, "epochs": 1, "batch_size": 32,
          "progress": False, "liveness": 1.0}  # fmt: skip


def _address(daemon: DaemonProcess) -> str:
    return f"{daemon.address[0]}:{daemon.address[1]}"


def _workers_datagrams(daemon: DaemonProcess) -> int:
    """What the switch has taken from the workers (its own stats requests not counted)."""
    counters = aggregator_stats(daemon.address)["aggregator"]
    return counters.get("datagrams", 0) - counters.get("control_stats_request", 0)


@pytest.mark.slow
def test_a_switch_killed_mid_training_and_restarted_on_its_port_changes_no_parameter(capfd):
    with DaemonProcess("switch") as switch:
        undisturbed = run_local(TrainConfig(switch=_address(switch), **COMMON))
        whole = _workers_datagrams(switch)  # the run's datagrams, registration to teardown
    with DaemonProcess("switch") as switch:
        address = _address(switch)
        restarted = []

        def restart():
            time.sleep(1.0)  # an outage the workers' liveness checks notice (liveness 1 s)
            restarted.append(DaemonProcess("switch", bind=address))

        # killed halfway through the run, counted in datagrams, not seconds: on a machine of
        # any speed, under any load, the kill falls inside training
        killer = threading.Thread(target=_kill_when_busy, args=(switch, restart, whole // 2))
        killer.start()
        try:
            disturbed = run_local(TrainConfig(switch=address, **COMMON))
        finally:
            killer.join()
        try:
            served = aggregator_stats(restarted[0].address)["aggregator"]
        finally:
            restarted[0].stop()
    redone = re.findall(r"job \d+ registered again on [\d.:]+, redoing its round (\d+)",
                        capfd.readouterr().err)  # fmt: skip
    assert redone, "no recovery: the kill fell outside training"
    assert served.get("control_register", 0) >= 1 and served["datagrams"] > 10
    assert disturbed["parameter_digest"] == undisturbed["parameter_digest"]


def _killed():
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_before_it_could_report_is_named_by_the_launcher():
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=time.sleep, args=(30,)), context.Process(target=_killed)]
    for process in processes:
        process.start()
    try:
        with pytest.raises(WorkerFailed) as raised:
            _join(processes, {}, TrainConfig())
    finally:
        processes[0].kill()
        processes[0].join()
    assert str(raised.value.failure) == (
        "worker 1 failed: Killed: the process ended by SIGKILL before it returned a result"
    )


class _ReapedLate:
    """A process killed by SIGKILL that the launcher sees as ended only at its ``joins``-th
    join: workers killed together are reaped one at a time."""

    def __init__(self, joins: int):
        self.joins, self.exitcode = joins, None

    def join(self, timeout=None):
        self.joins -= 1
        if self.joins <= 0:
            self.exitcode = -signal.SIGKILL

    def is_alive(self):
        return self.exitcode is None


def test_workers_killed_together_are_named_by_the_lowest_rank_not_the_first_reaped():
    # worker 1 is reaped at once, worker 0 one join later: the launcher must not name worker 1
    # because it happened to see it first (a job killed whole, every worker SIGKILLed)
    processes = [_ReapedLate(2), _ReapedLate(0), _ReapedLate(3)]
    with pytest.raises(WorkerFailed) as raised:
        _join(processes, {}, TrainConfig())
    assert str(raised.value.failure) == (
        "worker 0 failed: Killed: the process ended by SIGKILL before it returned a result"
    )


def _returns_then_aborts(results, rank):
    results[rank] = {"rank": rank}
    faulthandler.disable()  # pytest's, inherited by the fork: no stack dump in the test's log
    os.kill(os.getpid(), signal.SIGABRT)  # a library's std::terminate in teardown


def _returns_late(results, rank):
    time.sleep(1.0)  # still finishing when its peer has died in teardown
    results[rank] = {"rank": rank}


def _exits_silently():
    os._exit(3)


def test_a_worker_that_dies_in_teardown_after_returning_leaves_a_complete_run():
    context = multiprocessing.get_context("fork")
    with context.Manager() as manager:
        results = manager.dict()
        processes = [context.Process(target=_returns_late, args=(results, 0)),
                     context.Process(target=_returns_then_aborts, args=(results, 1))]  # fmt: skip
        for process in processes:
            process.start()
        with pytest.warns(RuntimeWarning, match=r"worker 1's process ended by SIGABRT after it "
                          r"returned its result \(in teardown\)"):  # fmt: skip
            _join(processes, results, TrainConfig())
        assert dict(results) == {0: {"rank": 0}, 1: {"rank": 1}}  # worker 0 was waited for
        assert processes[0].exitcode == 0


def test_a_worker_that_exits_without_a_result_is_named_with_its_status():
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_exits_silently)]
    processes[0].start()
    with pytest.raises(WorkerFailed) as raised:
        _join(processes, {}, TrainConfig())
    assert str(raised.value.failure) == (
        "worker 0 failed: Exited: the process exited with status 3 before it returned a result"
    )


def _worker_pid(root: int, rank: int, attempt: int) -> int | None:
    """The torchrun worker of ``rank`` in restart ``attempt`` under process ``root``."""
    wanted = {f"RANK={rank}", f"TORCHELASTIC_RESTART_COUNT={attempt}"}
    for pid in descendants(root):
        try:
            environment = set(Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0"))
        except OSError:
            continue
        if wanted <= environment:
            return pid
    return None


@pytest.mark.slow
def test_a_torchrun_restart_after_a_killed_worker_resumes_from_the_checkpoint(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    checkpoint = tmp_path / "ckpt.pt"
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    with DaemonProcess("switch") as switch:
        command = [
            torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
            "-m", "gradsum.cli", "train", "--aggregator", "switch", "--switch",
            _address(switch), "--codec", "thc", "--epochs", "4", "--batch-size", "32",
            "--checkpoint", str(checkpoint), "--liveness", "1",
        ]  # fmt: skip
        run = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            victim = None
            while victim is None and time.monotonic() < deadline and run.poll() is None:
                if Path(f"{checkpoint}.rank1").is_file():  # the first epoch is saved
                    victim = _worker_pid(run.pid, 1, 0)
                time.sleep(0.05)
            assert victim is not None, f"no first checkpoint: {run.communicate()[1][-3000:]}"
            os.kill(victim, signal.SIGKILL)
            out, err = run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
        jobs = aggregator_stats(switch.address)["jobs"]
    assert run.returncode == 0, err[-3000:]
    # worker 0 prints each epoch, then how many epochs its (restarted) group trained, which
    # resumed after the checkpoint it found (torchrun's --log-dir shadows --log)
    epochs = {int(n) for n in re.findall(r"^epoch (\d+)/4 ", out, re.MULTILINE)}
    assert epochs == set(range(1, 5)), epochs
    trained = int(re.search(r"^done: .* over (\d+) epochs", out, re.MULTILINE).group(1))
    assert 1 <= trained < 4, f"started again from the beginning: {trained} epochs"
    # The survivor reports and exits either way the race goes: stopped by the agent's SIGTERM,
    # or first through its own collective, whose peer's socket the kill closed.
    survivor = re.search(r"^gradsum train: worker 0 failed: (.*)$", err, re.MULTILINE)
    assert survivor, err[-3000:]
    assert re.match(
        r"Terminated|RuntimeError: .*Connection (reset|closed) by peer", survivor.group(1)
    ), survivor.group(1)
    assert jobs == {}, "the stale job and the last one were torn down"


def test_a_torchrun_worker_stopped_while_it_reports_its_own_failure_still_reports_it(
    monkeypatch,
):
    """The race behind a lost "worker 0 failed" line: the survivor's collective fails as its
    peer dies, and the agent's SIGTERM lands while it is describing that failure. The stop
    must not replace the report."""
    from gradsum.failures import Failure
    from gradsum.train import launch

    def peer_gone(config):
        raise ConnectionResetError("Connection reset by peer")

    describe = Failure.of

    def stopped_while_describing(error, rank):
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next line
        return describe(error, rank)

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(launch, "_init_torchrun_group", peer_gone)
    monkeypatch.setattr(launch.Failure, "of", staticmethod(stopped_while_describing))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(WorkerFailed) as raised:
            launch.run_torchrun_worker(TrainConfig(**COMMON))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert raised.value.failure.type == "ConnectionResetError"
    assert raised.value.failure.rank == 0

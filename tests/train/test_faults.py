"""Training that survives faults: a switch killed mid-training and restarted on its port, a
killed worker, a torchrun restart from the last checkpoint."""

import multiprocessing
import os
import re
import signal
import threading
import time

import pytest

from gradsum.failures import WorkerFailed
from gradsum.net.client import ControlError, aggregator_stats
from gradsum.net.loopback import DaemonProcess
from gradsum.train.launch import _join, run_local
from gradsum.train.loop import TrainConfig

COMMON = {"aggregator": "switch", "codec": "thc", "workers": 2, "epochs": 1, "batch_size": 32,
          "progress": False, "liveness": 1.0}  # fmt: skip


def _address(daemon: DaemonProcess) -> str:
    return f"{daemon.address[0]}:{daemon.address[1]}"


class _JobWatch(threading.Thread):
    """When a job was first and last seen registered on a switch."""

    def __init__(self, daemon: DaemonProcess):
        super().__init__(daemon=True)
        self.address, self.first, self.last = daemon.address, None, None
        self.stop = threading.Event()
        self.start()

    def run(self):
        while not self.stop.wait(0.1):
            try:
                jobs = aggregator_stats(self.address, timeout=1.0)["jobs"]
            except ControlError:
                continue
            if jobs:
                self.first = self.first or time.monotonic()
                self.last = time.monotonic()

    def wait_for_job(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.first is None and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.mark.slow
def test_a_switch_killed_mid_training_and_restarted_on_its_port_changes_no_parameter(capfd):
    with DaemonProcess("switch") as switch:
        watch = _JobWatch(switch)
        undisturbed = run_local(TrainConfig(switch=_address(switch), **COMMON))
        watch.stop.set()
    training = watch.last - watch.first  # registration to teardown, on this machine now
    with DaemonProcess("switch") as switch:
        address = _address(switch)
        restarted, outage = [], []

        def kill_then_restart():
            watch = _JobWatch(switch)
            watch.wait_for_job()
            time.sleep(training / 2)
            watch.stop.set()
            switch.kill()
            killed = time.monotonic()
            time.sleep(1.0)
            restarted.append(DaemonProcess("switch", bind=address))
            outage.append(time.monotonic() - killed)

        killer = threading.Thread(target=kill_then_restart)
        killer.start()
        try:
            disturbed = run_local(TrainConfig(switch=address, **COMMON))
        finally:
            killer.join()
        try:
            served = aggregator_stats(restarted[0].address)["aggregator"]
        finally:
            restarted[0].stop()
    assert outage[0] < 5.0
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
    assert str(raised.value.failure) == "worker 1 failed: Killed: the process ended by SIGKILL"

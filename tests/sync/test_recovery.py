"""Surviving a lost aggregator: a round redone on the same prepared inputs is the same round,
and a switch killed mid-run (restarted on its port, or replaced by a standby) costs the
workers a recovery, not a result."""

import threading
import time

import pytest
import torch

from gradsum.codecs import make_codec
from gradsum.codecs.round import CodecRound, run_round
from gradsum.net.client import aggregator_stats
from gradsum.net.loopback import DaemonProcess
from gradsum.sync.recovery import DEAD_AFTER

from .distributed import run_distributed
from .recovery_workers import a_worker_dies, rounds_through_a_switch


@pytest.mark.parametrize(("codec_name", "lost_sum"), [("thc", 0), ("bfp", 0), ("powersgd", 1)])
def test_a_redone_round_gives_the_same_average_and_codec_state(codec_name, lost_sum):
    """Encoding again (error feedback's memory written twice) leaves everything as once; a
    codec of several stages lost in its second starts again from its first."""
    elements = 3 * (1 << 18) + 1000  # several pieces and partitions, not a power of two
    x = torch.randn(elements, generator=torch.Generator().manual_seed(3))
    once, twice = (make_codec(codec_name, workers=2) for _ in range(2))
    for codec in (once, twice):  # a step of history: memory to carry
        run_round(codec, [x, x], seed=1, step=0, key="g", partition_elements=1 << 18)
    rounds = CodecRound(once, 1, 1 << 18)
    reference = rounds.run(x, _Peer(once, x), worker=0, key="g", step=1).clone()
    redo = CodecRound(twice, 1, 1 << 18)
    prepared = redo.prepare(x, worker=0, key="g", step=1)
    reducer = _Peer(twice, x, lose_at=lost_sum)
    with pytest.raises(ConnectionError):
        redo.reduce(prepared, reducer)
    assert torch.equal(redo.reduce(prepared, reducer), reference)
    state_once, state_twice = once.state_dict(), twice.state_dict()
    for key, memory in state_once.get("memory", {}).items():
        assert torch.equal(state_twice["memory"][key], memory)


class _Peer:
    """Worker 0's reducer against a worker 1 that sends what worker 0 sends (worker 1's
    payloads are worker 0's, so the sum is twice them); ``lose_at``: that SUM (counted from 0)
    fails after half its pieces were delivered."""

    def __init__(self, codec, x, lose_at=None):
        self.codec, self.lose_at, self.sums = codec, lose_at, 0

    def max(self, summaries):
        return summaries

    def sum(self, phase):
        lose, self.sums = self.sums == self.lose_at, self.sums + 1
        for i in range(len(phase)):
            payload = phase.encode(i)
            summed = self.codec.aggregate([payload, payload], phase.aggregator_context(i))
            if lose and i == len(phase) // 2:
                self.lose_at = None
                raise ConnectionError("lost midway")
            phase.deliver(i, summed)


def _kill_when_busy(daemon, restart, datagrams=20, timeout=60.0):
    """Once the switch has taken ``datagrams`` of the workers' datagrams (its own stats
    requests not counted: about the second of a run's rounds), kill -9 it and call
    ``restart`` at once. Counting progress, not seconds, keeps the kill inside the run on a
    machine of any speed (after 0.5 s, a fast one had finished all 12 rounds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counters = aggregator_stats(daemon.address)["aggregator"]
        if counters.get("datagrams", 0) - counters.get("control_stats_request", 0) >= datagrams:
            break
        time.sleep(0.005)
    daemon.kill()
    restart()


def _reference(steps, elements, world=2):
    """What the workers of ``rounds_through_a_switch`` average, in-process (the switch's
    rounds are the reference's, bit for bit: tests/sync/test_equivalence.py)."""
    codec = make_codec("thc", workers=world)
    generators = [torch.Generator().manual_seed(1000 + rank) for rank in range(world)]
    averages = []
    for step in range(steps):
        inputs = [torch.randn(elements, generator=g) for g in generators]
        averages.append(run_round(codec, inputs, seed=7, step=step, key="g").average.clone())
    return averages


@pytest.mark.slow
def test_a_switch_killed_mid_run_hands_its_job_to_the_standby():
    """No restart: the workers agree on the standby, and every average is the undisturbed
    run's, on both workers."""
    steps, elements = 12, 600_001
    with DaemonProcess("switch") as primary, DaemonProcess("switch") as standby:
        names = [f"{d.address[0]}:{d.address[1]}" for d in (primary, standby)]
        killer = threading.Thread(target=_kill_when_busy, args=(primary, lambda: None))
        killer.start()
        try:
            results = run_distributed(rounds_through_a_switch, 2, names[:1], steps, elements,
                                      names[1:])  # fmt: skip
        finally:
            killer.join()
        assert aggregator_stats(standby.address)["jobs"] == {}  # torn down after the run
    reference = _reference(steps, elements)
    for result in results:
        assert len(result["recoveries"]) >= 1, "the kill fell after the run"
        assert result["recoveries"][0]["addresses"] == [list(standby.address)]
        for expected, got in zip(reference, result["averages"], strict=True):
            assert torch.equal(expected, got)


@pytest.mark.slow
@pytest.mark.serial  # a bound in seconds
def test_a_dead_worker_fails_the_others_in_bounded_time_naming_it_and_the_job_goes():
    with DaemonProcess("switch") as switch:
        address = f"{switch.address[0]}:{switch.address[1]}"
        survivor, dead = run_distributed(a_worker_dies, 2, [address], 20, 100_000, 3,
                                         fresh=True)  # a worker dies: processes of its own
        assert aggregator_stats(switch.address)["jobs"] == {}  # torn down by the survivor
    assert dead is None  # it never returned
    name, message = survivor["failure"]
    assert name == "WorkerLost" and message.startswith("worker 1 stopped"), survivor
    assert survivor["after"] < DEAD_AFTER + 10  # silence, probes, heartbeats: bounded

"""One failure, one story: a recovery that fails ends every later one at once, and worker 0
looks for the aggregator before it waits for the other workers."""

import pytest
import torch.distributed as dist

from gradsum.net.client import AggregatorLost
from gradsum.sync import recovery
from gradsum.sync.recovery import JobRecovery, RecoveryFailed

DEAD = ("127.0.0.1", 9)


class _Client:
    def __init__(self, job):
        self.job, self.aggregators, self.key = job, [DEAD], None
        self.registered = []

    def register_afresh(self, addresses):
        self.registered.append(addresses)

    def relocate(self, addresses):
        raise AssertionError("a failed recovery relocates nothing")


def _recovery(world, log):
    return JobRecovery(0, world, store=dist.HashStore(), failover_wait=0.0, log=log.append)


def test_a_failed_recovery_fails_every_later_one_at_once_with_the_same_story(monkeypatch):
    asked = []
    monkeypatch.setattr(recovery, "_answers", lambda address, within: asked.append(address))
    log: list[str] = []
    jobs = _recovery(1, log)
    try:
        for job in (11, 12, 11):  # another job's, and the same job's next, recovery
            with pytest.raises(RecoveryFailed) as failed:
                jobs.recover(_Client(job), 0, AggregatorLost(DEAD, job, "no reply"))
            assert str(failed.value) == ("job 11 could not be registered again: 127.0.0.1:9 "
                                         "did not answer for 0 s and has no standby")
    finally:
        jobs.close()
    assert asked == [DEAD]  # waited for once, not once per recovery
    assert log == [] and jobs.recoveries == []  # no "registered again" anywhere
    assert jobs.unanswered == {DEAD}


def test_worker_0_decides_on_a_dead_aggregator_without_waiting_for_the_others(monkeypatch):
    """World of 2 where worker 1 never posts (it finished the round and waits on worker 0 in
    a collective): the decision is the dead aggregator, not a wait for that post."""
    monkeypatch.setattr(recovery, "_answers", lambda address, within: False)
    jobs = _recovery(2, [])
    jobs.heartbeat.check = lambda: None  # worker 1 has no heartbeat in this store
    jobs.timeout = 0.0  # a wait for worker 1's post would fail with a TimeoutError at once
    try:
        with pytest.raises(RecoveryFailed, match="did not answer"):
            jobs.recover(_Client(11), 0, AggregatorLost(DEAD, 11, "no reply"))
    finally:
        jobs.close()

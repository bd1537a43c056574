"""Surviving a lost aggregator or a dead worker: liveness, agreement, re-registration.

A round that hears nothing for a while asks its watchdog (``net.client.UdpTransport``): are
the aggregators still there and do they still hold the job, has a peer already started a
recovery of it, and are all workers alive? The watchdog built here answers through the
torch.distributed store the workers already share:

* every worker bumps a heartbeat counter in the store (``Heartbeat``); one whose counter has
  not moved for ``dead_after`` seconds is gone, and the waiting round fails with
  ``WorkerLost`` naming it, instead of after the transport's last timeout;
* an aggregator that does not answer a probe, or answers without the job (it restarted),
  ends the round with ``AggregatorLost``. Then ``JobRecovery.recover`` runs on every worker:
  each posts where it stood (how many rounds of the job it had started), worker 0 waits for
  all of them, checks they stood in the same round, waits for the aggregator to answer again
  (or takes the standby given for it), tears down whatever is left of the job there and
  registers it afresh, with empty slots, on every aggregator of the job, and posts that
  decision; every worker adopts it (chunks numbered from 0 again) and redoes the round from
  its start with the same prepared inputs and random streams (``CodecRound.reduce``), so the
  sums, and the replicas, are what they would have been.

Rounds of one job never overlap on a worker (one FIFO stream per job), so "the round" a worker
stood in is well defined, and no two workers can talk to different aggregators for one round:
nobody sends before worker 0's decision, which it posts only after registering. A worker
that had already finished the round (its last result arrived just before the aggregator died,
another worker's did not) cannot redo it: that is reported, not papered over.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from ..dataplane.jobspec import Address
from .service import note_registered

Watchdog = Callable[[Sequence[tuple[Address, int]]], None]  # the aggregators owing results

HEARTBEAT_INTERVAL = 0.5  # seconds between a worker's heartbeats
DEAD_AFTER = 10.0  # seconds without a heartbeat before a worker counts as gone
FAILOVER_WAIT = 10.0  # how long worker 0 waits for a lost aggregator to answer again
MAX_RECOVERIES = 3  # recoveries of one round before it fails


class WorkerLost(RuntimeError):
    """A peer stopped sending heartbeats: killed, or its host is gone."""

    def __init__(self, rank: int, seconds: float):
        super().__init__(
            f"worker {rank} stopped: no heartbeat for {seconds:.0f} s (killed, or its host is "
            "unreachable)"
        )
        self.rank = rank


class RecoveryFailed(RuntimeError):
    """The workers could not agree on how to go on after losing an aggregator."""


def default_store() -> dist.Store:
    """The store of the default process group (torchrun's rendezvous, or ``init_method``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


class Heartbeat:
    """This worker's heartbeat in the store, and what it knows of the others'."""

    def __init__(self, store: dist.Store, rank: int, world: int, *,
                 interval: float = HEARTBEAT_INTERVAL, dead_after: float = DEAD_AFTER,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.rank, self.world = rank, world
        self.interval, self.dead_after, self.clock = interval, dead_after, clock
        self._store = _own(store)  # its own connection: a blocking call elsewhere never stalls it
        self._reader = _own(store)
        self._reader_lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="gradsum-heartbeat", daemon=True)
        self._thread.start()

    @staticmethod
    def key(rank: int) -> str:
        return f"gradsum/heartbeat/{rank}"

    def _beat(self) -> None:
        self._store.add(self.key(self.rank), 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except RuntimeError:  # the store's host is gone: the peers' checks will say so
                return

    def check(self) -> None:
        """Raise ``WorkerLost`` for a peer whose heartbeat has not moved for ``dead_after``."""
        now = self.clock()
        with self._reader_lock:
            for rank in range(self.world):
                if rank == self.rank:
                    continue
                count = self._reader.add(self.key(rank), 0)
                seen = self._seen.get(rank)
                if seen is None or seen[0] != count:
                    self._seen[rank] = (count, now)
                elif now - seen[1] >= self.dead_after:
                    raise WorkerLost(rank, now - seen[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.interval)


class JobRecovery:
    """The watchdog and the recovery protocol of one worker's jobs (see the module docstring).

    ``standby`` maps an aggregator address to the one that replaces it when it is lost (and
    back); without one, worker 0 waits ``failover_wait`` seconds for the lost one to answer
    again (a restart on the same address)."""

    def __init__(self, rank: int, world: int, *, store: dist.Store | None = None,
                 standby: dict[Address, Address] | None = None, timeout: float = 120.0,
                 failover_wait: float = FAILOVER_WAIT, heartbeat: Heartbeat | None = None,
                 log: Callable[[str], None] | None = None):  # fmt: skip
        store = store or default_store()
        self.rank, self.world, self.timeout = rank, world, timeout
        self.standby = dict(standby or {})
        self.failover_wait = failover_wait
        self.heartbeat = heartbeat or Heartbeat(store, rank, world)
        self._store = _own(store)
        self._lock = threading.Lock()  # shard streams recover their jobs on their own threads
        self._generation: dict[int, int] = {}  # job -> recoveries so far
        self._tries: dict[int, tuple[int, int]] = {}  # job -> (round, its recoveries)
        self.recoveries: list[dict] = []  # what happened, for logs and tests
        # aggregators worker 0 waited for in vain: a teardown there would only wait again
        self.unanswered: set[Address] = set()
        # why the run cannot go on: every later recovery (another stream's, another job's)
        # fails at once with it, instead of waiting for the same dead aggregator again
        self.failed: RecoveryFailed | None = None
        self.log = log or _stderr

    # -- watchdog --------------------------------------------------------------------------
    def watchdog(self, job: int, key: bytes | None) -> Watchdog:
        """What the transport of ``job`` (signed with ``key``) asks after a silence, about the
        aggregators that owe it results."""
        from ..net.client import AggregatorLost, probe_jobs

        def check(owing: Sequence[tuple[Address, int]]) -> None:
            probe_jobs(owing, key=key)
            started = self._peer_started(job)
            if started is not None:
                rank, reason = started
                raise AggregatorLost(owing[0][0], job, f"worker {rank} lost it: {reason}")
            self.heartbeat.check()

        return check

    def _peer_started(self, job: int) -> tuple[int, str] | None:
        """(rank, reason) of a worker that has posted a recovery of ``job``'s current life."""
        generation = self._generation.get(job, 0)
        with self._lock:
            for rank in range(self.world):
                key = self._key(job, generation, f"worker{rank}")
                if rank != self.rank and self._store.check([key]):
                    return rank, json.loads(self._store.get(key))["reason"]
        return None

    # -- recovery --------------------------------------------------------------------------
    def recover(self, client, position: int, lost: Exception) -> None:
        """Agree with every worker on where ``client``'s job goes on, register it there afresh
        (worker 0), and point ``client`` at it; the caller then redoes round ``position``."""
        if self.failed is not None:  # the run is over: one failure, one story
            raise RecoveryFailed(str(self.failed)) from lost
        job = client.job
        generation = self._generation.get(job, 0)
        last, tries = self._tries.get(job, (position, 0))
        tries = tries + 1 if last == position else 1
        if tries > MAX_RECOVERIES:
            self.failed = RecoveryFailed(f"round {position} of job {job} was lost {tries - 1} "
                                         "times; giving up")  # fmt: skip
            raise RecoveryFailed(str(self.failed)) from lost
        self._tries[job] = (position, tries)
        post = {"round": position, "reason": str(getattr(lost, "reason", lost))}
        self._set(self._key(job, generation, f"worker{self.rank}"), post)
        if self.rank == 0:
            self._set(self._key(job, generation, "decision"),
                      self._decide(client, generation, lost))  # fmt: skip
        decision = self._await(self._key(job, generation, "decision"), "worker 0's decision")
        self._generation[job] = generation + 1
        if "error" in decision:
            self.failed = self.failed or RecoveryFailed(decision["error"])
            raise RecoveryFailed(str(self.failed)) from lost
        client.relocate([tuple(a) for a in decision["addresses"]])
        record = {"job": job, "round": position, "lost": str(lost),
                  "addresses": decision["addresses"]}  # fmt: skip
        self.recoveries.append(record)
        if self.rank == 0:
            where = ", ".join(f"{h}:{p}" for h, p in decision["addresses"])
            self.log(f"gradsum: {lost}; job {job} registered again on {where}, redoing its "
                     f"round {position}")  # fmt: skip

    def _decide(self, client, generation: int, lost: Exception) -> dict:
        """Worker 0: where the job goes on, or why it cannot. Where comes first: an
        aggregator that is gone for good (no answer within ``failover_wait``, no standby) ends
        the run then, whatever the other workers are doing (one that had finished the round
        and waits on worker 0 in a collective would never post)."""
        job = client.job
        try:
            addresses = [self._replacement(address) for address in client.aggregators]
        except RecoveryFailed as error:
            return {"error": f"job {job} could not be registered again: {error}"}
        posts = {
            rank: self._await(self._key(job, generation, f"worker{rank}"),
                              f"worker {rank} to join the recovery of job {job}")
            for rank in range(self.world)
        }  # fmt: skip
        rounds = {rank: post["round"] for rank, post in posts.items()}
        if len(set(rounds.values())) != 1:
            return {"error": f"job {job}'s aggregator was lost after some workers had the "
                             f"result of a round and others not (rounds {rounds}); it cannot "
                             "be redone"}  # fmt: skip
        if self.failed is not None:  # another job's recovery ended the run meanwhile
            return {"error": str(self.failed)}
        try:
            note_registered(client, addresses)
            client.register_afresh(addresses)
        except Exception as error:  # a ControlError, or none answers: every worker is told
            return {"error": f"job {job} could not be registered again: {error}"}
        return {"addresses": [list(a) for a in addresses]}

    def _replacement(self, address: Address) -> Address:
        """The lost aggregator once it answers again, else its standby."""
        standby = self.standby.get(address)
        if standby is not None and not _answers(address, 1.0):
            if _answers(standby, self.failover_wait):
                return standby
            self.unanswered.update((address, standby))
            raise RecoveryFailed(f"neither {_name(address)} nor its standby {_name(standby)} "
                                 "answers")  # fmt: skip
        if _answers(address, self.failover_wait):
            return address
        self.unanswered.add(address)
        raise RecoveryFailed(f"{_name(address)} did not answer for {self.failover_wait:g} s "
                             "and has no standby")  # fmt: skip

    def _await(self, key: str, what: str) -> dict:
        """The JSON posted at ``key``, waiting for it (checking the peers' heartbeats)."""
        deadline = time.monotonic() + self.timeout
        while True:
            with self._lock:
                if self._store.check([key]):
                    return json.loads(self._store.get(key))
            self.heartbeat.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout:.0f} s for {what}")
            time.sleep(0.02)

    def _set(self, key: str, value: dict) -> None:
        with self._lock:
            self._store.set(key, json.dumps(value))

    @staticmethod
    def _key(job: int, generation: int, what: str) -> str:
        return f"gradsum/recovery/job{job}/life{generation}/{what}"

    def close(self) -> None:
        self.heartbeat.close()


def _own(store: dist.Store) -> dist.Store:
    """A connection of our own to ``store`` where it has connections (TCPStore), else itself."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):
        return store


def _answers(address: Address, within: float) -> bool:
    """Whether a gradsum aggregator answers a control request at ``address`` within ``within``
    seconds (an ERROR is an answer)."""
    from ..net.client import ControlError, aggregator_stats

    deadline = time.monotonic() + within
    while True:
        try:
            aggregator_stats(address, timeout=min(0.5, max(0.05, deadline - time.monotonic())))
            return True
        except ControlError as error:
            if error.code != "no_reply":
                return True
        if time.monotonic() >= deadline:
            return False


def _name(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)

"""The switch and parameter-server aggregators: gradsum's own UDP services (``gradsum switch``,
``gradsum server``) reached through the worker client of ``gradsum.net``.

Workers agree on a job id and learn each other's UDP addresses over the torch.distributed control
group; worker 0 registers the job on every aggregator address; then every synchronisation is one
codec round whose reducer is the client's ``Collective`` (chunks streamed over the aggregators'
slots, lost packets retransmitted).
"""

from __future__ import annotations

import collections
import contextlib
import random
import socket
import sys
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codecs.round import CodecRound
from ..dataplane.codec_wire import WireFormat
from ..dataplane.jobspec import Address
from .aggregator import Aggregator, Channel


@dataclass(frozen=True)
class JobSettings:
    """What every worker's clients of one training job share."""

    rank: int
    world: int
    mtu: int | None = None  # packets of one frame, sent a chunk at a time (net/client.py)
    window_bytes: int | None = None  # a window of chunks that fits these bytes (else 32 slots)
    silence: float = 3.0  # seconds without a result before a round checks its aggregators
    timeout: float = 120.0  # how long a recovery waits for the other workers


Watchdogs = Callable[[int, bytes], Callable]  # (job, key) -> what its transport asks


def connect_jobs(address_groups: Sequence[Sequence[Address]], wire: WireFormat,
                 settings: JobSettings, *, multicast: bool = False,
                 watchdog: Watchdogs | None = None) -> list:  # fmt: skip
    """One client per group of aggregator addresses, each for its own job of ``wire``; worker
    0 registers every job with all workers' addresses, gathered over the control group.
    ``multicast``: the aggregators multicast results to groups the workers join;
    ``watchdog(job, key)``: what a job's transport asks after a silence (default: probe)."""
    from ..net.client import SwitchClient

    clients = []
    for group in address_groups:
        job, key = _agree_on_job()
        client = SwitchClient(
            group,
            wire,
            multicast=multicast,
            bind=(local_address_towards(group[0]), 0),
            job=job,
            key=key,
            worker=settings.rank,
            workers=settings.world,
            mtu=settings.mtu,
            window_bytes=settings.window_bytes,
            silence=settings.silence,
            watchdog=watchdog(job, key) if watchdog is not None else None,
        )
        clients.append(client)
    everyone: list = [None] * settings.world
    dist.all_gather_object(everyone, [client.address for client in clients])
    if settings.rank == 0:
        for k, client in enumerate(clients):
            note_registered(client, client.aggregators)
            client.register([addresses[k] for addresses in everyone])
    dist.barrier()
    return clients


# Where the worker that registers a job also notes it, before it registers: a list the
# launcher of local workers shares with them (``train.launch.run_local``), so that the jobs of
# a run whose workers were all killed, or killed before they could tear down, are torn down
# by the launcher. None: nobody keeps such notes (torchrun, tests).
job_records = None


def note_registered(client, aggregators) -> None:
    """Note ``client``'s job on ``aggregators`` in ``job_records`` (if kept)."""
    if job_records is None:
        return
    key = None if client.key is None else client.key.hex()
    for address in aggregators:
        job_records.append((tuple(address), client.job, key))


def disconnect_jobs(clients: Sequence, rank: int, everyone: bool = False,
                    skip: Collection[Address] = ()) -> None:  # fmt: skip
    """Worker 0 removes the jobs (every worker, with ``everyone``: after a failure, worker 0
    may be the one that is gone); every worker closes its sockets. An aggregator that does not
    answer keeps its job: a teardown never hides what went wrong before it. ``skip``:
    aggregators known not to answer (the recovery waited for them in vain)."""
    from ..net.client import ControlError, teardown_job

    try:
        if rank == 0 or everyone:
            for client in clients:
                for address in client.aggregators:
                    if tuple(address) in skip:
                        continue
                    with contextlib.suppress(ControlError, OSError):
                        teardown_job(address, client.job, timeout=1.0 if everyone else 5.0,
                                     key=client.key)
    finally:
        for client in clients:
            client.close()


class ServiceChannel(Channel):
    """The jobs of one wire format: one client per shard (where shards are addressed one by
    one), then the one spread over every aggregator. A round whose aggregator is lost is redone
    from its start (same prepared inputs, same random streams) once the job is registered
    afresh (``sync.recovery``)."""

    def __init__(self, clients: Sequence, recovery):
        super().__init__([client.collective for client in clients])
        self.clients = list(clients)
        self.recovery = recovery
        self._rounds = [0] * len(self.clients)  # rounds started through each job

    def partition_size(self, requested: int | None) -> int:
        return self.reducers[-1].partition_size(requested)

    def run(self, round_: CodecRound, flat: torch.Tensor, *, worker: int, key: Hashable,
            step: int, shard: int | None = None) -> torch.Tensor:  # fmt: skip
        from ..codecs.base import DeviceChecks
        from ..codecs.round import pipelines
        from ..net.client import AggregatorLost

        reducer = self.reducer(shard)
        index = len(self.clients) - 1 if shard is None else shard
        checks = DeviceChecks()  # the round's device checks, read once at its end
        with checks.deferring():
            prepared = round_.prepare(flat, worker=worker, key=key, step=step,
                                      lazy=pipelines(reducer, round_.codec))  # fmt: skip
            position = self._rounds[index]  # where a recovery of this job stands
            self._rounds[index] += 1
            while True:
                try:
                    result = round_.reduce(prepared, reducer)
                    break
                except AggregatorLost as lost:
                    self.recovery.recover(self.clients[index], position, lost)
        checks.raise_if_failed()
        return result


class ServiceAggregator(Aggregator):
    """Rounds through jobs on gradsum's UDP services: one job spread over all given aggregators
    (``ShardedServiceAggregator`` adds one job per shard). Jobs are registered per wire format,
    when a Session connects one: the training codec's at start-up, an uncompressed step's
    (``none``, or ``bfp`` on a switch) when the first such step runs. Every worker runs the
    same Sessions in the same order, so all register together."""

    def __init__(self, kind: str, addresses: Sequence[str], settings: JobSettings,
                 *, shards: bool = False, standby: Sequence[str] = ()):  # fmt: skip
        from ..net.udp import is_loopback, parse_bind
        from .recovery import JobRecovery

        super().__init__(settings.rank, settings.world)
        self.name = kind
        self.sums_floats = kind != "switch"
        flag = "--switch" if kind == "switch" else "--servers"
        parsed = [parse_bind(address, flag) for address in addresses]
        if not parsed:
            raise ValueError(f"the {kind} aggregator needs at least one address ({flag})")
        spares = [parse_bind(address, "--standby") for address in standby]
        if spares and len(spares) != len(parsed):
            raise ValueError(f"--standby names {len(spares)} aggregators for {len(parsed)} "
                             f"given with {flag}: one standby each")  # fmt: skip
        # each replaces the other: a standby lost in turn hands the job back
        pairs = {
            **dict(zip(parsed, spares, strict=False)),
            **dict(zip(spares, parsed, strict=False)),
        }
        self.recovery = JobRecovery(settings.rank, settings.world, standby=pairs,
                                    timeout=settings.timeout)  # fmt: skip
        # One job per shard (a plan's parts), plus one spread over all of them for a whole
        # tensor outside any plan.
        self._groups = [[a] for a in parsed] + [parsed] if shards else [parsed]
        # A switch on this host multicasts its results through the kernel's loopback; elsewhere
        # that needs a multicast-capable network, so results stay unicast.
        self._multicast = kind == "switch" and all(is_loopback(host) for host, _ in parsed)
        self._settings = settings
        self._channels: list[tuple[WireFormat, ServiceChannel]] = []

    def connect(self, wire: WireFormat) -> ServiceChannel:
        """The jobs of ``wire``, registered the first time a Session connects it (two codecs
        of one wire format, a training bfp and the lossless one, share them)."""
        for known, channel in self._channels:
            if known == wire:
                return channel
        clients = connect_jobs(self._groups, wire, self._settings, multicast=self._multicast,
                               watchdog=self.recovery.watchdog)  # fmt: skip
        channel = ServiceChannel(clients, self.recovery)
        self._channels.append((wire, channel))
        return channel

    def _clients(self) -> list:
        return [client for _, channel in self._channels for client in channel.clients]

    def transport_stats(self) -> dict[str, int]:
        total: collections.Counter = collections.Counter()
        for client in self._clients():
            for counters in client.stats().values():
                total.update(counters)
        return dict(total)

    def close(self) -> None:
        """Tear the jobs down: worker 0 after training, every worker when closing on an
        error (the job must not outlive a failed run, whoever failed)."""
        failing = sys.exc_info()[0] is not None
        try:
            disconnect_jobs(self._clients(), self.rank, everyone=failing,
                            skip=self.recovery.unanswered)  # fmt: skip
        finally:
            self.recovery.close()


def _agree_on_job() -> tuple[int, bytes]:
    """Worker 0 draws a job id (so two jobs sharing a switch do not collide) and the job's key
    (it signs the job's control messages and gives its data token); all adopt them, over
    torch.distributed's control group (the rendezvous), never the aggregator's network."""
    from ..dataplane.authentication import new_key

    choice = [(random.SystemRandom().randrange(1, 1 << 16), new_key())
              if dist.get_rank() == 0 else None]  # fmt: skip
    dist.broadcast_object_list(choice, src=0)
    job, key = choice[0]
    return int(job), bytes(key)


def local_address_towards(address: tuple[str, int]) -> str:
    """This host's source address for packets to ``address`` (what the aggregator will see as
    our source, so it is what must be registered); no packet is sent."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]

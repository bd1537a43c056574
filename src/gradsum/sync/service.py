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
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch.distributed as dist

from ..codecs import Codec
from ..dataplane.jobspec import Address
from .aggregator import Aggregator


@dataclass(frozen=True)
class JobSettings:
    """What every worker's clients of one training job share."""

    codec: Codec  # the worker's own codec object: its state is what the loop checkpoints
    codec_name: str
    codec_options: dict
    rank: int
    world: int
    seed: int = 0
    mtu: int | None = None  # packets of one frame, sent a chunk at a time (net/client.py)
    window_bytes: int | None = None  # a window of chunks that fits these bytes (else 32 slots)
    silence: float = 3.0  # seconds without a result before a round checks its aggregators
    timeout: float = 120.0  # how long a recovery waits for the other workers


def connect_jobs(
    address_groups: Sequence[Sequence[Address]], settings: JobSettings, multicast: bool = False
) -> list:
    """One client per group of aggregator addresses, each for its own job; worker 0 registers
    every job with all workers' addresses, gathered over the control group. ``multicast``: the
    aggregators multicast results to groups the workers join."""
    from ..net.client import SwitchClient

    clients = []
    for group in address_groups:
        job, key = _agree_on_job()
        client = SwitchClient(
            group,
            multicast=multicast,
            bind=(local_address_towards(group[0]), 0),
            job=job,
            key=key,
            worker=settings.rank,
            workers=settings.world,
            codec=settings.codec_name,
            codec_options=settings.codec_options,
            seed=settings.seed,
            rank=settings.rank,
            mtu=settings.mtu,
            window_bytes=settings.window_bytes,
            silence=settings.silence,
        )
        client.codec = settings.codec
        clients.append(client)
    everyone: list = [None] * settings.world
    dist.all_gather_object(everyone, [client.address for client in clients])
    if settings.rank == 0:
        for k, client in enumerate(clients):
            client.register([addresses[k] for addresses in everyone])
    dist.barrier()
    return clients


def disconnect_jobs(clients: Sequence, rank: int, everyone: bool = False) -> None:
    """Worker 0 removes the jobs (every worker, with ``everyone``: after a failure, worker 0
    may be the one that is gone); every worker closes its sockets. An aggregator that does not
    answer keeps its job: a teardown never hides what went wrong before it."""
    from ..net.client import ControlError, teardown_job

    try:
        if rank == 0 or everyone:
            for client in clients:
                for address in client.aggregators:
                    with contextlib.suppress(ControlError, OSError):
                        teardown_job(address, client.job, timeout=1.0 if everyone else 5.0,
                                     key=client.key)
    finally:
        for client in clients:
            client.close()


class ServiceAggregator(Aggregator):
    """Rounds through jobs on gradsum's UDP services: one job spread over all given aggregators
    (``ShardedServiceAggregator`` adds one job per shard). Jobs are registered per wire format,
    the first time a round needs one: the training codec's at start-up, an uncompressed
    warm-up's (``none``, or ``bfp`` on a switch) when the first warm-up step runs. Every worker
    runs the same rounds in the same order, so all register together."""

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
        self._clients: dict[int, object] = {}  # id(collective) -> its client
        # One job per shard (a plan's parts), plus one spread over all of them for a whole
        # tensor outside any plan.
        self._groups = [[a] for a in parsed] + [parsed] if shards else [parsed]
        # A switch on this host multicasts its results through the kernel's loopback; elsewhere
        # that needs a multicast-capable network, so results stay unicast.
        self._multicast = kind == "switch" and all(is_loopback(host) for host, _ in parsed)
        self._settings = settings
        self._jobs: dict[str, list] = {}
        self.clients_for(settings.codec)

    def clients_for(self, codec: Codec) -> list:
        """The clients of ``codec``'s jobs (per shard, then the spread one), registered on
        first use."""
        from ..dataplane.codec_wire import wire_format

        settings = self._settings
        options = settings.codec_options if codec is settings.codec else {}
        key = repr(wire_format(codec, options, settings.seed))
        if key not in self._jobs:
            own = replace(settings, codec=codec, codec_name=codec.name, codec_options=options)
            clients = connect_jobs(self._groups, own, multicast=self._multicast)
            for client in clients:
                client.transport.watchdog = self.recovery.watchdog(client)
                client.rounds = 0  # rounds started through the job: where a recovery stands
                self._clients[id(client.collective)] = client
            self._jobs[key] = clients
        return self._jobs[key]

    @property
    def client(self):
        """The training codec's job spread over every aggregator."""
        return self.clients_for(self._settings.codec)[-1]

    def reducer(self, codec: Codec):
        return self.clients_for(codec)[-1].collective

    def partition_size(self, codec: Codec, requested: int | None) -> int:
        return self.reducer(codec).partition_size(requested)

    def run_round(self, flat, codec, reducer, key, step, seed, partition_elements):
        """The round, redone from its start (same prepared inputs, same random streams) on
        the job registered afresh when its aggregator is lost (``sync.recovery``)."""
        from ..codecs.base import DeviceChecks
        from ..codecs.round import CodecRound, pipelines
        from ..net.client import AggregatorLost

        client = self._clients[id(reducer)]
        round_ = CodecRound(codec, seed, self.partition_size(codec, partition_elements))
        checks = DeviceChecks()  # the round's device checks, read once at its end
        with checks.deferring():
            prepared = round_.prepare(flat, worker=self.rank, key=key, step=step,
                                      lazy=pipelines(reducer, codec))  # fmt: skip
            position = client.rounds
            client.rounds += 1
            while True:
                try:
                    result = round_.reduce(prepared, reducer)
                    break
                except AggregatorLost as lost:
                    self.recovery.recover(client, position, lost)
        checks.raise_if_failed()
        return result

    def transport_stats(self) -> dict[str, int]:
        total: collections.Counter = collections.Counter()
        for client in self._clients.values():
            for counters in client.stats().values():
                total.update(counters)
        return dict(total)

    def close(self) -> None:
        """Tear the jobs down: worker 0 after training, every worker when closing on an
        error (the job must not outlive a failed run, whoever failed)."""
        failing = sys.exc_info()[0] is not None
        try:
            disconnect_jobs([c for clients in self._jobs.values() for c in clients], self.rank,
                            everyone=failing)  # fmt: skip
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

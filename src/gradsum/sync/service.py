"""The switch and parameter-server aggregators: gradsum's own UDP services (``gradsum switch``,
``gradsum server``) reached through the worker client of ``gradsum.net``.

Workers agree on a job id and learn each other's UDP addresses over the torch.distributed control
group; worker 0 registers the job on every aggregator address; then every synchronisation is one
``allreduce`` through the client (chunks streamed over the aggregators' slots, lost packets
retransmitted).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

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


def connect_jobs(
    address_groups: Sequence[Sequence[Address]], settings: JobSettings, multicast: bool = False
) -> list:
    """One client per group of aggregator addresses, each for its own job; worker 0 registers
    every job with all workers' addresses, gathered over the control group. ``multicast``: the
    aggregators multicast results to groups the workers join."""
    from ..net.client import SwitchClient

    clients = []
    for group in address_groups:
        client = SwitchClient(
            group,
            multicast=multicast,
            bind=(local_address_towards(group[0]), 0),
            job=_agree_on_job_id(),
            worker=settings.rank,
            workers=settings.world,
            codec=settings.codec_name,
            codec_options=settings.codec_options,
            seed=settings.seed,
            rank=settings.rank,
            mtu=settings.mtu,
        )
        client.codec = client.collective.codec = settings.codec
        clients.append(client)
    everyone: list = [None] * settings.world
    dist.all_gather_object(everyone, [client.address for client in clients])
    if settings.rank == 0:
        for k, client in enumerate(clients):
            client.register([addresses[k] for addresses in everyone])
    dist.barrier()
    return clients


def disconnect_jobs(clients: Sequence, rank: int) -> None:
    """Worker 0 removes the jobs; every worker closes its sockets."""
    try:
        if rank == 0:
            for client in clients:
                client.teardown()
    finally:
        for client in clients:
            client.close()


class ServiceAggregator(Aggregator):
    """Every tensor streamed through one job spread over all given aggregators."""

    def __init__(self, kind: str, addresses: Sequence[str], settings: JobSettings):
        from ..net.udp import is_loopback, parse_bind

        super().__init__(settings.rank, settings.world)
        self.name = kind
        flag = "--switch" if kind == "switch" else "--servers"
        parsed = [parse_bind(address, flag) for address in addresses]
        # A switch on this host multicasts its results through the kernel's loopback; elsewhere
        # that needs a multicast-capable network, so results stay unicast.
        local = kind == "switch" and all(is_loopback(host) for host, _ in parsed)
        (self.client,) = connect_jobs([parsed], settings, multicast=local)

    def synchronize(
        self, flat, codec, *, key: Hashable, step: int, seed: int = 0, partition_elements=None
    ):
        return self.client.allreduce(flat, key=key)

    def close(self) -> None:
        disconnect_jobs([self.client], self.rank)


def _agree_on_job_id() -> int:
    """Worker 0 draws a job id (so two jobs sharing a switch do not collide); all adopt it."""
    choice = [random.SystemRandom().randrange(1, 1 << 16) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return int(choice[0])


def local_address_towards(address: tuple[str, int]) -> str:
    """This host's source address for packets to ``address`` (what the aggregator will see as
    our source, so it is what must be registered); no packet is sent."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]

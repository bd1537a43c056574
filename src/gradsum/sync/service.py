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

import torch
import torch.distributed as dist

from ..codecs import Codec, CodecContext, Payload
from .aggregator import Aggregator


class ServiceAggregator(Aggregator):
    def __init__(
        self,
        kind: str,
        addresses: Sequence[str],
        codec: Codec,
        codec_name: str,
        codec_options: dict,
        rank: int,
        world: int,
        seed: int = 0,
        timeout: float = 60.0,
    ):
        from ..net.client import SwitchClient
        from ..net.udp import parse_bind

        super().__init__(rank, world)
        self.name = kind
        parsed = [
            parse_bind(a, f"--{'switch' if kind == 'switch' else 'servers'}") for a in addresses
        ]
        self.client = SwitchClient(
            parsed,
            bind=(local_address_towards(parsed[0]), 0),
            job=_agree_on_job_id(),
            worker=rank,
            workers=world,
            codec=codec_name,
            codec_options=codec_options,
            seed=seed,
            rank=rank,
        )
        # The worker's own codec object does the encoding, so its state (error feedback) is the
        # one the training loop checkpoints.
        self.client.codec = self.client.collective.codec = codec
        addresses_of_workers: list = [None] * world
        dist.all_gather_object(addresses_of_workers, self.client.address)
        if rank == 0:
            self.client.register(addresses_of_workers)
        dist.barrier()

    def synchronize(
        self, flat, codec, *, key: Hashable, step: int, seed: int = 0, partition_elements=None
    ):
        return self.client.allreduce(flat, key=key)

    def max_reduce(self, summaries: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return [None if s is None else self.client.max_reduce(s) for s in summaries]

    def reduce(
        self,
        codec: Codec,
        payloads: Sequence[Payload],
        contexts: Sequence[CodecContext],
        shared: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        raise NotImplementedError("the service aggregator runs whole rounds: use synchronize()")

    def close(self) -> None:
        try:
            if self.rank == 0:
                self.client.teardown()
        finally:
            self.client.close()


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

"""Parameter-server shards addressed one by one, so a plan's parts land on the shards it chose.

``ServiceAggregator`` spreads every tensor evenly over all servers; a scheduler's plan instead puts
each part of a group on one named shard. Here each shard gets its own client (its own socket and
chunk numbering) for a job registered on that shard alone, so a shard's stream of parts is
independent of the others: a worker can have parts in flight on several shards at once, in any
order, as long as every worker gives each shard its parts in the same order (which the plan's
fixed send order guarantees). Aggregation is the usual SUM round with the worker's codec.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Sequence

import torch

from .aggregator import Aggregator
from .service import JobSettings, connect_jobs, disconnect_jobs


class ShardedServiceAggregator(Aggregator):
    name = "ps"

    def __init__(self, addresses: Sequence[str], settings: JobSettings):
        from ..net.udp import parse_bind

        super().__init__(settings.rank, settings.world)
        if not addresses:
            raise ValueError("a sharded parameter server needs at least one shard address")
        parsed = [parse_bind(address, "--servers") for address in addresses]
        # One job per shard (a plan's parts), plus one spread over all of them for a whole
        # tensor outside any plan (`synchronize`, the Aggregator interface).
        *self.clients, self.spread = connect_jobs([[a] for a in parsed] + [parsed], settings)

    @property
    def _all_clients(self) -> list:
        return [*self.clients, self.spread]

    @property
    def num_shards(self) -> int:
        return len(self.clients)

    def synchronize_part(self, shard: int, flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        """The average over workers of ``flat``, aggregated on ``shard`` alone."""
        if not 0 <= shard < len(self.clients):
            raise ValueError(f"shard {shard} does not exist: this job has {len(self.clients)}")
        return self.clients[shard].allreduce(flat, key=key)

    def synchronize(
        self, flat, codec, *, key: Hashable, step: int, seed: int = 0, partition_elements=None
    ):
        """The average of ``flat``, cut into near-equal chunk-aligned parts, one per shard."""
        return self.spread.allreduce(flat, key=key)

    def close(self) -> None:
        disconnect_jobs(self._all_clients, self.rank)


def time_transfers(send, sizes: Sequence[int], repeats: int = 5) -> list[tuple[float, float]]:
    """(bytes, median seconds) of ``send(tensor)`` for fp32 tensors of each size; the first call
    of each size is a warm-up. The median keeps one stalled transfer (a retransmission timer, a
    descheduled peer) from tilting the α–β fit. All workers must call this together with the
    same sizes."""
    samples = []
    for size in sizes:
        tensor = torch.zeros(size)
        send(tensor)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            send(tensor)
            seconds.append(time.perf_counter() - start)
        samples.append((4.0 * size, statistics.median(seconds)))
    return samples

"""Parameter-server shards addressed one by one, so a plan's parts land on the shards it chose.

``ServiceAggregator`` spreads every tensor evenly over all servers; a scheduler's plan instead puts
each part of a group on one named shard. Here each shard gets its own client (its own socket and
chunk numbering) for a job registered on that shard alone, so a shard's stream of parts is
independent of the others: a worker can have parts in flight on several shards at once, in any
order, as long as every worker gives each shard its parts in the same order (which the plan's
fixed send order guarantees). Each part is the usual codec round, through its shard's job
(``Session.part``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .service import JobSettings, ServiceAggregator


class ShardedServiceAggregator(ServiceAggregator):
    name = "ps"

    def __init__(self, addresses: Sequence[str], settings: JobSettings,
                 standby: Sequence[str] = ()):  # fmt: skip
        super().__init__("ps", addresses, settings, shards=True, standby=standby)

    @property
    def num_shards(self) -> int:
        return len(self._groups) - 1

    @property
    def shard_addresses(self) -> list[tuple[str, int]]:
        """(host, port) of each shard, in shard order."""
        return [group[0] for group in self._groups[:-1]]

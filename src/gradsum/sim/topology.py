"""Resources of a cluster: one ingress and one egress per worker, per shard and per machine NIC.

Resource ids: worker w → out 2w, in 2w+1; shard s → after the workers; machine NICs last. A flow's
path is its source's egress, both NICs when it crosses machines, and its destination's ingress.
Where a shard is one core (``ClusterSpec.shard_one_core``) its bytes are the core's work (the
engine charges them there) and flows to and from it cross no shard port.
"""

from __future__ import annotations

import numpy as np

from ..schedule.cluster import ClusterSpec


class Topology:
    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self._shard_base = 2 * cluster.workers
        self._nic_base = self._shard_base + 2 * cluster.shards
        capacity = [cluster.worker_bw] * (2 * cluster.workers)
        capacity += [cluster.shard_bw] * (2 * cluster.shards)
        capacity += [cluster.nic_bw] * (2 * cluster.machines)
        self.capacity = np.array(capacity, dtype=float)

    def _nic(self, machine: int, outgoing: bool) -> int:
        return self._nic_base + 2 * machine + (0 if outgoing else 1)

    def _with_nics(self, src_port, src_machine: int, dst_machine: int, dst_port):
        """A flow's resources; a port that is None (a one-core shard's) is left out."""
        path = [src_port]
        if src_machine != dst_machine:
            path += [self._nic(src_machine, True), self._nic(dst_machine, False)]
        path.append(dst_port)
        return tuple(r for r in path if r is not None)

    def _shard_port(self, shard: int, outgoing: bool):
        if self.cluster.shard_one_core:
            return None
        return self._shard_base + 2 * shard + (0 if outgoing else 1)

    def push_path(self, worker: int, shard: int) -> tuple[int, ...]:
        c = self.cluster
        return self._with_nics(
            2 * worker,
            c.worker_machine(worker),
            c.shard_machine(shard),
            self._shard_port(shard, outgoing=False),
        )

    def pull_path(self, shard: int, worker: int) -> tuple[int, ...]:
        c = self.cluster
        return self._with_nics(
            self._shard_port(shard, outgoing=True),
            c.shard_machine(shard),
            c.worker_machine(worker),
            2 * worker + 1,
        )

    def worker_path(self, src: int, dst: int) -> tuple[int, ...]:
        c = self.cluster
        return self._with_nics(2 * src, c.worker_machine(src), c.worker_machine(dst), 2 * dst + 1)

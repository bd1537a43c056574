"""What one worker has in flight and what it starts next: the one meaning of a PS plan's window.

The simulator (``sim/engine.py``) and the runtime (``sync/senders.py: ShardSender``) both drive
a :class:`SendWindow` per worker, so they cannot disagree about which messages overlap:

* **release**: groups arrive in the send order (``schedule/ordering.py``: list order, or the
  priority replay), each once its gradients exist and every group before it was released.
* **admission**: released groups are admitted in that order while the bytes of admitted groups
  not yet back, plus the next group's, fit ``plan.credit_bytes`` — or when nothing is in
  flight (a group bigger than the window goes alone). ``credit_bytes=None``: one group at a time.
  A group's bytes count until its *last part is back* (pushed, summed by every worker, pulled):
  that is what a worker can observe, and what the runtime's round trip per part is.
* **parts**: an admitted group puts every part in flight at once, in ``plan.part_order`` (rotated
  by worker when interleaving), each on its shard's *stream*: a worker has one stream per shard,
  and a stream carries one part's round trip at a time, in admission order. So every shard sees
  one worker's parts in the same order on every worker (what a shard's job numbering needs), and
  interleaved groups cannot deadlock (no worker waits on a part another worker has not queued).

Parts are named ``(group index, part index in group.parts)``.
"""

from __future__ import annotations

from collections import deque

from .plan import Plan

PartRef = tuple[int, int]


class SendWindow:
    def __init__(self, plan: Plan, worker: int, bytes_per_element: int = 4) -> None:
        if plan.aggregator != "ps":
            raise ValueError("a send window places parts on shards: PS plans only")
        self.plan, self.worker = plan, worker
        self.credit = plan.credit_bytes
        self._bytes = [g.numel * bytes_per_element for g in plan.groups]
        self._waiting: deque[int] = deque()  # released, not yet admitted
        self._in_flight_bytes = 0
        self._groups_in_flight = 0
        self._parts_left = [0] * len(plan.groups)
        self._streams: dict[int, deque[PartRef]] = {}
        self._busy: set[int] = set()  # shards whose stream carries a part now

    @property
    def in_flight_bytes(self) -> int:
        return self._in_flight_bytes

    @property
    def idle(self) -> bool:
        return not self._groups_in_flight and not self._waiting

    def release(self, group: int) -> list[PartRef]:
        """Group ``group`` is released; the parts to start now, in order."""
        if self._parts_left[group]:
            raise ValueError(f"group {group} released again while in flight")
        self._waiting.append(group)
        return self._admit()

    def part_back(self, group: int, index: int) -> tuple[list[PartRef], bool]:
        """Part ``index`` of ``group`` is back; the parts to start now, and whether that was the
        group's last part."""
        shard = self.plan.groups[group].parts[index].shard
        if shard not in self._busy or self._parts_left[group] == 0:
            raise ValueError(f"part {index} of group {group} was not in flight")
        self._busy.discard(shard)
        self._parts_left[group] -= 1
        done = self._parts_left[group] == 0
        starts = self._next_on(shard)
        if done:
            self._in_flight_bytes -= self._bytes[group]
            self._groups_in_flight -= 1
            starts += self._admit()
        return starts, done

    def _fits(self, group: int) -> bool:
        if not self._groups_in_flight:
            return True
        return self.credit is not None and self._in_flight_bytes + self._bytes[group] <= self.credit

    def _admit(self) -> list[PartRef]:
        starts: list[PartRef] = []
        while self._waiting and self._fits(self._waiting[0]):
            g = self._waiting.popleft()
            group = self.plan.groups[g]
            self._in_flight_bytes += self._bytes[g]
            self._groups_in_flight += 1
            self._parts_left[g] = len(group.parts)
            # a part's index in group.parts, by its shard (a PS plan's group has one part per
            # shard: Plan checks it)
            position = {part.shard: index for index, part in enumerate(group.parts)}
            for part in self.plan.part_order(group, self.worker):
                queue = self._streams.get(part.shard)
                if queue is None:
                    queue = self._streams[part.shard] = deque()
                queue.append((g, position[part.shard]))
                starts += self._next_on(part.shard)
        return starts

    def _next_on(self, shard: int) -> list[PartRef]:
        if shard in self._busy:
            return []
        queue = self._streams.get(shard)
        if not queue:
            return []
        self._busy.add(shard)
        return [queue.popleft()]

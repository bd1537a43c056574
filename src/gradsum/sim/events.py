"""A minimal discrete-event clock: callbacks ordered by (time, insertion order)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()
        self.processed = 0

    def __bool__(self) -> bool:
        return bool(self._heap)

    def at(self, time: float, callback: Callable, *args) -> None:
        heapq.heappush(self._heap, (max(time, self.now), next(self._order), callback, args))

    def after(self, delay: float, callback: Callable, *args) -> None:
        self.at(self.now + delay, callback, *args)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def run_due(self) -> None:
        """Run every event due at or before ``now``, including ones they schedule for ``now``."""
        while self._heap and self._heap[0][0] <= self.now:
            _, _, callback, args = heapq.heappop(self._heap)
            self.processed += 1
            callback(*args)

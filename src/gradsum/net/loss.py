"""Seeded network impairments for tests and experiments: loss, duplication, reordering.

The same seed impairs the same packets. Reordering holds a packet back and releases it after the
next one; duplication emits a packet twice.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Impairment:
    def __init__(self, drop: float = 0.0, duplicate: float = 0.0, reorder: float = 0.0,
                 seed: int = 0):  # fmt: skip
        for name, rate in (("drop", drop), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} rate must be in [0, 1), got {rate}")
        self.drop, self.duplicate, self.reorder = drop, duplicate, reorder
        self._random = random.Random(seed)
        self._held = None
        self.counts = {"dropped": 0, "duplicated": 0, "reordered": 0}

    @property
    def active(self) -> bool:
        return bool(self.drop or self.duplicate or self.reorder)

    def __call__(self, item, keep: Callable) -> list:
        """The items to emit now for ``item``; ``keep(item)`` copies one that must be held."""
        draw = self._random.random
        if self.drop and draw() < self.drop:
            self.counts["dropped"] += 1
            return []
        if self.reorder and self._held is None and draw() < self.reorder:
            self.counts["reordered"] += 1
            self._held = keep(item)
            return []
        emit = [item]
        if self.duplicate and draw() < self.duplicate:
            self.counts["duplicated"] += 1
            emit.append(item)
        if self._held is not None:
            emit.append(self._held)
            self._held = None
        return emit

"""Fluid network: flows share capacity-limited resources with max-min fairness.

A resource is one direction of a port (a node's NIC ingress or egress). A flow crosses a fixed set
of resources and gets the max-min fair rate: progressive filling raises every unfrozen flow's rate
together until some resource saturates, freezes the flows crossing it, and repeats. Rates are
recomputed only when the set of flows changes (a flow starts or ends); between changes every flow
drains linearly, so the next completion time is exact.
"""

from __future__ import annotations

import numpy as np

_RELATIVE_TIE = 1e-9
FINISH_SLACK_S = 1e-7
_CACHE_LIMIT = 200_000


def max_min_rates(paths: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates for flows (rows of ``paths``: resource ids, −1 = unused slot)."""
    if paths.shape[0] == 0:
        return np.zeros(0)
    if (paths < 0).all(axis=1).any():
        raise ValueError("a flow crosses no resource")
    spare = len(capacity)  # unused path slots point at a resource that never saturates
    filled = np.where(paths >= 0, paths, spare)
    return _progressive_filling([np.ascontiguousarray(c) for c in filled.T], capacity)


def _progressive_filling(columns: list[np.ndarray], capacity: np.ndarray) -> np.ndarray:
    """Rates of flows given one array of resource ids per path slot (unused = len(capacity))."""
    flows = columns[0].size
    rates = np.zeros(flows)
    spare = len(capacity)
    remaining = np.append(capacity.astype(float), np.inf)
    counts = np.bincount(np.concatenate(columns), minlength=spare + 1).astype(float)
    counts[spare] = 0.0
    live = np.arange(flows)  # frozen flows are dropped, so each round scans only the rest
    share = np.empty_like(remaining)
    while live.size:
        share.fill(np.inf)
        np.divide(remaining, counts, out=share, where=counts > 0)
        level = share.min()
        saturated = share <= level * (1 + _RELATIVE_TIE)
        # One 1-D gather and OR per path slot beats a 2-D ``any`` (hot loop).
        hit = saturated[columns[0]]
        for column in columns[1:]:
            hit |= saturated[column]
        rates[live[hit]] = level
        freed = np.bincount(np.concatenate([c[hit] for c in columns]), minlength=spare + 1)
        freed[spare] = 0
        remaining -= level * freed
        counts -= freed
        keep = ~hit
        live = live[keep]
        columns = [c[keep] for c in columns]
    return rates


class FluidNetwork:
    """The set of active flows; call :meth:`advance` to let time pass.

    Flows live in preallocated arrays that grow by doubling (a flow is added or removed at
    almost every event, so copying every array each time showed in profiles); paths are stored
    one contiguous row per path slot, unused slots already pointing at the spare resource.
    """

    def __init__(self, capacity: np.ndarray, path_width: int = 4) -> None:
        self.capacity = np.asarray(capacity, dtype=float)
        self.width = path_width
        self._spare = len(self.capacity)
        self._count = 0
        self._slots = np.full((path_width, 64), self._spare, dtype=np.int64)
        self._remaining = np.zeros(64)
        self._rates = np.zeros(0)
        self._tokens: list[object] = []
        self._dirty = False
        self._cache: dict[int, np.ndarray] = {}
        self.recomputations = 0

    def __len__(self) -> int:
        return self._count

    def add(self, token: object, path: tuple[int, ...], nbytes: float) -> None:
        if len(path) > self.width:
            raise ValueError("path longer than the network's path width")
        if not path or min(path) < 0 or max(path) >= self._spare:
            raise ValueError("a flow must cross at least one existing resource")
        if self._count == self._remaining.size:
            grown = np.full((self.width, 2 * self._count), self._spare, dtype=np.int64)
            grown[:, : self._count] = self._slots
            self._slots = grown
            self._remaining = np.concatenate([self._remaining, np.zeros(self._count)])
        k = self._count
        self._slots[:, k] = self._spare
        self._slots[: len(path), k] = path
        self._remaining[k] = max(float(nbytes), 0.0)
        self._tokens.append(token)
        self._count += 1
        self._dirty = True

    def rates(self) -> np.ndarray:
        if self._dirty:
            columns = [row[: self._count] for row in self._slots]
            # Steady-state iterations repeat the same flow sets; remember their rates.
            key = hash(b"".join(c.tobytes() for c in columns))  # 64-bit: collisions negligible
            cached = self._cache.get(key)
            if cached is None:
                cached = _progressive_filling(columns, self.capacity)
                self.recomputations += 1
                if len(self._cache) < _CACHE_LIMIT:
                    self._cache[key] = cached
            self._rates = cached
            self._dirty = False
        return self._rates

    def time_to_next_completion(self) -> float:
        if not self._count:
            return np.inf
        rates = self.rates()
        return float(np.min(self._remaining[: self._count] / rates))

    def advance(self, dt: float) -> list[object]:
        """Drain every flow for ``dt`` seconds; return the tokens of flows that finished."""
        if not self._count:
            return []
        n = self._count
        rates = self.rates()
        remaining = self._remaining[:n]
        remaining -= rates * dt
        # A flow is done when what is left would take at most FINISH_SLACK_S at its rate, so
        # flows ending within that slack end together (one rate update instead of many).
        done = remaining <= rates * FINISH_SLACK_S + 1e-6
        if not done.any():
            return []
        index = np.flatnonzero(done)
        finished = [self._tokens[i] for i in index]
        for i in index[::-1]:
            del self._tokens[i]
        keep = ~done
        left = n - index.size
        self._slots[:, :left] = self._slots[:, :n][:, keep]
        self._remaining[:left] = remaining[keep]
        self._count = left
        self._dirty = True
        return finished

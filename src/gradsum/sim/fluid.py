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
    flows = paths.shape[0]
    rates = np.zeros(flows)
    if flows == 0:
        return rates
    if (paths < 0).all(axis=1).any():
        raise ValueError("a flow crosses no resource")
    spare = len(capacity)  # unused path slots point at a resource that never saturates
    # One contiguous array per path slot: 1-D gathers and ORs beat a 2-D ``any`` (hot loop).
    columns = [np.ascontiguousarray(c) for c in np.where(paths >= 0, paths, spare).T]
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
    """The set of active flows; call :meth:`advance` to let time pass."""

    def __init__(self, capacity: np.ndarray, path_width: int = 4) -> None:
        self.capacity = np.asarray(capacity, dtype=float)
        self.width = path_width
        self._paths = np.full((0, path_width), -1, dtype=np.int64)
        self._remaining = np.zeros(0)
        self._rates = np.zeros(0)
        self._tokens: list[object] = []
        self._dirty = False
        self._cache: dict[int, np.ndarray] = {}
        self.recomputations = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, token: object, path: tuple[int, ...], nbytes: float) -> None:
        if len(path) > self.width:
            raise ValueError("path longer than the network's path width")
        row = np.full((1, self.width), -1, dtype=np.int64)
        row[0, : len(path)] = path
        self._paths = np.vstack([self._paths, row])
        self._remaining = np.append(self._remaining, max(float(nbytes), 0.0))
        self._rates = np.append(self._rates, 0.0)
        self._tokens.append(token)
        self._dirty = True

    def rates(self) -> np.ndarray:
        if self._dirty:
            # Steady-state iterations repeat the same flow sets; remember their rates.
            key = hash(self._paths.tobytes())  # 64-bit: collisions are negligible here
            cached = self._cache.get(key)
            if cached is None:
                cached = max_min_rates(self._paths, self.capacity)
                self.recomputations += 1
                if len(self._cache) < _CACHE_LIMIT:
                    self._cache[key] = cached
            self._rates = cached
            self._dirty = False
        return self._rates

    def time_to_next_completion(self) -> float:
        if not self._tokens:
            return np.inf
        rates = self.rates()
        return float(np.min(self._remaining / rates))

    def advance(self, dt: float) -> list[object]:
        """Drain every flow for ``dt`` seconds; return the tokens of flows that finished."""
        if not self._tokens:
            return []
        rates = self.rates()
        self._remaining -= rates * dt
        # A flow is done when what is left would take at most FINISH_SLACK_S at its rate, so
        # flows ending within that slack end together (one rate update instead of many).
        done = self._remaining <= rates * FINISH_SLACK_S + 1e-6
        if not done.any():
            return []
        finished = [self._tokens[i] for i in np.flatnonzero(done)]
        keep = ~done
        self._paths = self._paths[keep]
        self._remaining = self._remaining[keep]
        self._rates = self._rates[keep]
        self._tokens = [t for t, k in zip(self._tokens, keep, strict=True) if k]
        self._dirty = True
        return finished

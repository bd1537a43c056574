"""Fluid network: flows share capacity-limited resources with max-min fairness.

A resource is one direction of a port (a node's NIC ingress or egress). A flow crosses a fixed set
of resources and gets the max-min fair rate: progressive filling raises every unfrozen flow's rate
together until some resource saturates, freezes the flows crossing it, and repeats. Rates are
recomputed only when the set of flows changes (a flow starts or ends); between changes every flow
drains linearly, so the next completion time is exact.

Flows with the same path always get the same rate (progressive filling freezes them in the same
round), so the solver works on *path classes* with their flow counts: a 32-worker priority run
has ~1,200 flows in flight but a few dozen distinct worker → shard paths. The rates are those of
the per-flow computation bit for bit (a resource's load is the same integer either way).

The solver runs in C (``_maxmin.c``, the same arithmetic) when the extension is built and
``GRADSUM_NATIVE`` is not 0; otherwise in numpy (:func:`_progressive_filling`).
"""

from __future__ import annotations

import numpy as np

from ..codecs.native_common import enabled as native_enabled

try:
    from . import _maxmin
except ImportError:  # built without a C compiler
    _maxmin = None

_RELATIVE_TIE = 1e-9
FINISH_SLACK_S = 1e-7


def max_min_rates(paths: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates for flows (rows of ``paths``: resource ids, −1 = unused slot)."""
    if paths.shape[0] == 0:
        return np.zeros(0)
    if (paths < 0).all(axis=1).any():
        raise ValueError("a flow crosses no resource")
    spare = len(capacity)  # unused path slots point at a resource that never saturates
    filled = np.where(paths >= 0, paths, spare)
    columns = [np.ascontiguousarray(c) for c in filled.T]
    return _progressive_filling(columns, np.ones(paths.shape[0]), capacity)


def _progressive_filling(
    columns: list[np.ndarray], flows: np.ndarray, capacity: np.ndarray
) -> np.ndarray:
    """Rates of path classes given one array of resource ids per path slot (unused =
    len(capacity)) and each class's number of flows (classes with none get rate 0)."""
    rates = np.zeros(columns[0].size)
    spare = len(capacity)
    remaining = np.append(capacity.astype(float), np.inf)
    counts = np.zeros(spare + 1)
    for column in columns:
        counts += np.bincount(column, weights=flows, minlength=spare + 1)
    counts[spare] = 0.0
    live = np.flatnonzero(flows > 0)  # frozen classes are dropped: each round scans the rest
    columns = [c[live] for c in columns]
    weights = flows[live]
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
        freed = np.zeros(spare + 1)
        for column in columns:
            freed += np.bincount(column[hit], weights=weights[hit], minlength=spare + 1)
        freed[spare] = 0
        remaining -= level * freed
        counts -= freed
        keep = ~hit
        live, weights = live[keep], weights[keep]
        columns = [c[keep] for c in columns]
    return rates


class FluidNetwork:
    """The set of active flows; call :meth:`advance` to let time pass.

    Flows and path classes live in preallocated arrays that grow by doubling (a flow is added or
    removed at almost every event, so copying every array each time showed in profiles); a
    class's path is one contiguous row per path slot, unused slots pointing at the spare
    resource.
    """

    def __init__(self, capacity: np.ndarray, path_width: int = 4) -> None:
        self.capacity = np.ascontiguousarray(capacity, dtype=float)
        self.width = path_width
        self._native = _maxmin is not None and native_enabled()
        self._spare = len(self.capacity)
        self._class_of: dict[tuple[int, ...], int] = {}
        self._paths = np.full((path_width, 16), self._spare, dtype=np.int64)
        self._flows = np.zeros(16)  # flows in flight per class
        self._count = 0
        self._class = np.zeros(64, dtype=np.int64)  # per flow
        self._remaining = np.zeros(64)
        self._rates = np.zeros(0)
        self._tokens: list[object] = []
        self._dirty = False
        self.recomputations = 0

    def __len__(self) -> int:
        return self._count

    def add(self, token: object, path: tuple[int, ...], nbytes: float) -> None:
        cls = self._class_of.get(path)
        if cls is None:
            cls = self._new_class(path)
        if self._count == self._remaining.size:
            self._class = np.concatenate([self._class, np.zeros(self._count, dtype=np.int64)])
            self._remaining = np.concatenate([self._remaining, np.zeros(self._count)])
        k = self._count
        self._class[k] = cls
        self._flows[cls] += 1
        self._remaining[k] = max(float(nbytes), 0.0)
        self._tokens.append(token)
        self._count += 1
        self._dirty = True

    def _new_class(self, path: tuple[int, ...]) -> int:
        if len(path) > self.width:
            raise ValueError("path longer than the network's path width")
        if not path or min(path) < 0 or max(path) >= self._spare:
            raise ValueError("a flow must cross at least one existing resource")
        cls = len(self._class_of)
        if cls == self._flows.size:
            grown = np.full((self.width, 2 * cls), self._spare, dtype=np.int64)
            grown[:, :cls] = self._paths
            self._paths = grown
            self._flows = np.concatenate([self._flows, np.zeros(cls)])
        self._paths[: len(path), cls] = path
        self._class_of[tuple(path)] = cls
        return cls

    def rates(self) -> np.ndarray:
        if self._dirty:
            classes = len(self._class_of)
            if self._native:
                per_class = np.empty(classes)
                stride = self._paths.shape[1]
                _maxmin.fill(
                    self._paths, self.width, stride, classes, self._flows, self.capacity,
                    per_class,
                )  # fmt: skip
            else:
                columns = [row[:classes] for row in self._paths]
                per_class = _progressive_filling(columns, self._flows[:classes], self.capacity)
            self._rates = per_class[self._class[: self._count]]
            self.recomputations += 1
            self._dirty = False
        return self._rates

    def time_to_next_completion(self) -> float:
        if not self._count:
            return np.inf
        rates = self.rates()
        if self._native:
            return _maxmin.next_completion(self._remaining, rates, self._count)
        return float(np.min(self._remaining[: self._count] / rates))

    def advance(self, dt: float) -> list[object]:
        """Drain every flow for ``dt`` seconds; return the tokens of flows that finished."""
        if not self._count:
            return []
        n = self._count
        rates = self.rates()
        if self._native:
            index = np.empty(n, dtype=np.int64)
            ended = _maxmin.drain(
                self._class, n, self._remaining, rates, dt, FINISH_SLACK_S, index, self._flows
            )
            if not ended:
                return []
            return self._remove(index[:ended], n - ended)
        remaining = self._remaining[:n]
        remaining -= rates * dt
        # A flow is done when what is left would take at most FINISH_SLACK_S at its rate, so
        # flows ending within that slack end together (one rate update instead of many).
        done = remaining <= rates * FINISH_SLACK_S + 1e-6
        if not done.any():
            return []
        index = np.flatnonzero(done)
        np.subtract.at(self._flows, self._class[index], 1.0)
        keep = ~done
        left = n - index.size
        self._class[:left] = self._class[:n][keep]
        self._remaining[:left] = remaining[keep]
        return self._remove(index, left)

    def _remove(self, index: np.ndarray, left: int) -> list[object]:
        """The tokens of the finished flows at ``index`` (ascending), dropped from the rest."""
        finished = [self._tokens[i] for i in index]
        for i in index[::-1]:
            del self._tokens[i]
        self._count = left
        self._dirty = True
        return finished

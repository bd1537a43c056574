"""THC lookup tables: the optimal 2**b-point subset of the integer grid {0, ..., g}.

A coordinate z ~ N(0, 1), clamped to [-t_p, t_p], is mapped linearly onto [0, g] and rounded
stochastically (unbiased) to one of the table's neighbouring values. The table minimises the
expected rounding variance under the constraints T[0] = 0, T[-1] = g and the symmetry
T[i] + T[2**b - 1 - i] = g. The cost is a sum over consecutive table intervals, so a dynamic
program over grid points finds the exact optimum in O(2**b * g**2) -- milliseconds.

Expected rounding variance of X ~ N(0,1) over a grid interval [a, b] (in z units):
    E[(b - X)(X - a); a <= X <= b] = -E[X^2; .] + (a + b) E[X; .] - a b P,
    P = Phi(b) - Phi(a),  E[X; .] = phi(a) - phi(b),  E[X^2; .] = P + a phi(a) - b phi(b).
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import numpy as np

_NORMAL = NormalDist()


def clamp_threshold(p: float) -> float:
    """t_p with P(|X| > t_p) = p for X ~ N(0, 1)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"clamp fraction p must be in (0, 1), got {p}")
    return _NORMAL.inv_cdf(1.0 - p / 2.0)


def interval_variance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Expected variance of unbiased rounding of N(0,1) mass on [a, b] to {a, b}."""
    pdf = lambda v: np.exp(-0.5 * v * v) / math.sqrt(2.0 * math.pi)  # noqa: E731
    cdf = np.vectorize(_NORMAL.cdf)
    mass = cdf(b) - cdf(a)
    first = pdf(a) - pdf(b)
    second = mass + a * pdf(a) - b * pdf(b)
    return -second + (a + b) * first - a * b * mass


def default_granularity(bits: int) -> int:
    """THC's grid for a ``bits``-bit table: 2^(b+1) - 2 steps (30 at the paper's 4 bits), so
    the 2^b entries always sit on a grid twice as fine, whatever the bit width chosen."""
    return (1 << (bits + 1)) - 2


@functools.lru_cache(maxsize=256)
def solve_table(bits: int, granularity: int, p: float) -> tuple[int, ...]:
    """The optimal symmetric table for (b, g, p), as a tuple of 2**bits increasing integers."""
    size = 1 << bits
    if bits < 1 or bits > 8:
        raise ValueError(f"table bits must be in 1..8, got {bits}")
    if granularity < size - 1:
        raise ValueError(f"granularity g={granularity} must be at least 2**bits - 1 = {size - 1}")
    if size == 2:
        return (0, granularity)
    t = clamp_threshold(p)
    grid = -t + np.arange(granularity + 1) * (2.0 * t / granularity)
    # cost[i, j]: variance of the interval between grid points i < j (inf elsewhere)
    a, b = np.meshgrid(grid, grid, indexing="ij")
    cost = np.where(b > a, interval_variance(a, b), np.inf)

    half = size // 2  # table points in the lower half, starting at grid point 0
    best = np.full(granularity + 1, np.inf)
    best[0] = 0.0
    previous = np.zeros((half, granularity + 1), dtype=np.int64)
    for k in range(1, half):
        candidates = best[:, None] + cost  # [i, j]: best path ending at i, then step i -> j
        previous[k] = np.argmin(candidates, axis=0)
        best = candidates[previous[k], np.arange(granularity + 1)]
    # close with the middle interval [j, g - j] (strictly increasing: j < g - j)
    last = np.arange(granularity + 1)
    mirrored = granularity - last
    valid = last < mirrored
    middle = np.full(granularity + 1, np.inf)
    middle[valid] = cost[last[valid], mirrored[valid]]
    total = 2.0 * best + middle
    end = int(np.argmin(total))
    if not np.isfinite(total[end]):
        raise ValueError(f"no table exists for bits={bits}, granularity={granularity}")
    lower = [end]
    for k in range(half - 1, 0, -1):
        lower.append(int(previous[k][lower[-1]]))
    lower.reverse()
    return tuple(lower + [granularity - v for v in reversed(lower)])


def table_error(table: tuple[int, ...], p: float) -> tuple[float, float]:
    """(rounding variance, clamp error) per coordinate for X ~ N(0,1), in z units squared."""
    t = clamp_threshold(p)
    g = table[-1]
    points = -t + np.asarray(table, dtype=np.float64) * (2.0 * t / g)
    rounding = float(interval_variance(points[:-1], points[1:]).sum())
    return rounding, _clamp_error(t)


def correlated_error(table: tuple[int, ...], p: float, workers: int,
                     samples: int | None = None, seed: int = 0,
                     spread: float = 1.0) -> float:  # fmt: skip
    """NMSE of the mean of ``workers`` independent N(0, r_w**2) inputs clamped at t_p, put on
    the table by correlated rounding (thresholds stratified across workers, as ``CodecContext.
    stratified_uniform`` draws them), over ``samples`` coordinates: a seeded Monte Carlo, since
    the rounding errors of different workers are no longer independent and no longer add.
    r_w: ``spread_scales(workers, spread)`` (all 1 by default)."""
    rng = np.random.default_rng(seed)
    samples = samples or max(1 << 11, (1 << 17) // workers)  # 2**17 draws in all
    t, g = clamp_threshold(p), table[-1]
    z = rng.standard_normal((workers, samples)) * spread_scales(workers, spread)[:, None]
    u = (np.clip(z, -t, t) + t) * (g / (2.0 * t))
    values = np.asarray(table, dtype=np.float64)
    k = np.clip(np.searchsorted(values, u, side="right") - 1, 0, len(values) - 2)
    low, width = values[k], values[k + 1] - values[k]
    strata = (rng.integers(0, workers, samples) + np.arange(workers)[:, None]) % workers
    thresholds = (strata + rng.random((workers, samples))) / workers
    rounded = low + width * (thresholds < (u - low) / width)
    decoded = rounded * (2.0 * t / g) - t
    return float(((decoded.mean(axis=0) - z.mean(axis=0)) ** 2).mean())


def correlated_expected_error(table: tuple[int, ...], p: float, workers: int,
                              nodes: int = 1 << 13, spread: float = 1.0) -> float:  # fmt: skip
    """``correlated_error`` in closed form (a quadrature over z, no sampling).

    Worker w rounds u_w up from its table interval [low, low + width] when its threshold
    (s + w mod n + j_w) / n lies below q_w = (u_w - low) / width (s shared, j_w private): with
    F_k(q) = clip(n q - k, 0, 1), P(up | stratum k) = F_k(q). For i.i.d. inputs the error of the
    mean of n workers, in grid units squared, is

        (1/n) [ V + B**2 - (1/n) sum_k A_k**2 ],   V = E[d (width - d)], B = E[d],
                                                   A_k = E[width F_k(q)],  d = u - low,

    V being independent rounding's variance and the rest the strata's (negative) covariance
    summed over every pair of workers; each worker's clamp error adds as it does without
    correlation. This is the objective the correlated table and clamp minimise.

    ``spread`` < 1: the workers' inputs are N(0, r_w**2) instead, r_w from ``spread_scales``
    (one worker at the largest norm, which sets THC's scale, the others equal below it). With
    C_k = A_k - B of each worker and D_s = C_(s + w mod n) its offset when the shared stratum
    is s, the pairs' covariances are (1/n) sum_s D_s D'_s, so the error of the sum is
    sum_w V_w + (1/n) sum_s [(sum_w D_s)**2 - sum_w D_s**2]; with the n - 1 equal workers'
    C_k summing to zero over k, sum_w D_s = C(1)_s - C(r)_s. At spread 1 this is the form
    above."""
    t, g, n = clamp_threshold(p), table[-1], workers
    values = np.asarray(table, dtype=np.float64)

    def moments(scale: float) -> tuple[float, np.ndarray]:
        """V and C_k (grid units) of a worker whose input is N(0, scale**2)."""
        weights, x = _normal_nodes(nodes)
        u = np.clip(x * (scale * g / (2.0 * t)) + g / 2.0, 0.0, g)  # clamped: no rounding error
        k = np.clip(np.searchsorted(values, u, side="right") - 1, 0, len(values) - 2)
        low, width = values[k], values[k + 1] - values[k]
        d = u - low
        # A_k = E[width F_k(q)]: F_k is 1 below stratum m = floor(n q), n q - m at it, 0 above
        scaled = n * d / width
        m = np.minimum(np.floor(scaled).astype(np.int64), n)
        mass = weights * width
        full = np.bincount(m, mass, minlength=n + 1)
        part = np.bincount(m, mass * (scaled - m), minlength=n + 1)
        a = np.cumsum(full[::-1])[::-1][1:] + part[:n]  # sum over m > k, plus m == k's part
        return float(weights @ (d * (width - d))), a - weights @ d

    scales = spread_scales(n, spread)
    top, rest = scales[0], scales[-1]
    v_top, c_top = moments(top)
    if n == 1 or rest == top:
        v_rest, c_rest = v_top, c_top
    else:
        v_rest, c_rest = moments(rest)
    pairs = (c_top - c_rest) @ (c_top - c_rest) - c_top @ c_top - (n - 1) * (c_rest @ c_rest)
    rounding = v_top + (n - 1) * v_rest + pairs / n
    clamp = top * top * _clamp_error(t / top) + (n - 1) * rest * rest * _clamp_error(t / rest)
    return float((rounding * (2.0 * t / g) ** 2 + clamp) / (n * n))


def spread_scales(workers: int, spread: float) -> np.ndarray:
    """Relative norms r_w of ``workers`` inputs, the largest 1, the others equal, whose RMS is
    ``spread``: the model of a round's norms that ``spread_clamps`` solves for. ``spread`` is
    at least 1 / sqrt(workers) (the others at zero)."""
    if not 0.0 < spread <= 1.0:
        raise ValueError(f"norm spread must be in (0, 1], got {spread}")
    if workers == 1:
        return np.ones(1)
    rest = math.sqrt(max(workers * spread * spread - 1.0, 0.0) / (workers - 1))
    return np.array([1.0] + [max(rest, 1e-6)] * (workers - 1))


def _clamp_error(t: float) -> float:
    """E[(|X| - t)**2; |X| > t] over both tails, X ~ N(0, 1)."""
    tail = 1.0 - _NORMAL.cdf(t)
    pdf_t = math.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)
    return 2.0 * ((1.0 + t * t) * tail - t * pdf_t)


@functools.lru_cache(maxsize=8)
def _normal_nodes(nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Midpoint nodes of N(0, 1) on (-8.5, 8.5) and their probabilities. Nodes outside a clamp
    sit on the grid's ends, where rounding is exact, so one set serves every clamp and scale."""
    edges = np.linspace(-8.5, 8.5, nodes + 1)
    weights = np.diff(np.vectorize(_NORMAL.cdf)(edges))
    return weights, 0.5 * (edges[1:] + edges[:-1])


@functools.lru_cache(maxsize=256)
def correlated_table(bits: int, granularity: int, p: float, workers: int) -> tuple[int, ...]:
    """The symmetric table minimising ``correlated_expected_error``. Its pairwise term couples
    every interval with every other, so the interval-by-interval program of ``solve_table``
    does not apply; a descent from that table moves one lower-half point (and its mirror) at a
    time to wherever the error falls most, until none does. At b = 4, g = 31 and n = 4 it stays
    at ``solve_table``'s, which an exhaustive search of all 6,435 symmetric tables confirms is
    the optimum (the strata scale the rounding error's covariances, not where it is least)."""
    table = list(solve_table(bits, granularity, p))
    half = len(table) // 2

    def full(lower: list[int]) -> tuple[int, ...]:
        return tuple(lower + [granularity - v for v in reversed(lower)])

    lower = table[:half]
    best = correlated_expected_error(full(lower), p, workers)
    improved = True
    while improved:
        improved = False
        for i in range(1, half):
            top = lower[i + 1] - 1 if i + 1 < half else (granularity - 1) // 2
            for v in range(lower[i - 1] + 1, top + 1):
                trial = [*lower[:i], v, *lower[i + 1 :]]
                error = correlated_expected_error(full(trial), p, workers)
                if error < best * (1 - 1e-12):
                    best, lower, improved = error, trial, True
    return full(lower)


@functools.lru_cache(maxsize=64)
def correlated_clamp(bits: int, granularity: int, workers: int) -> float:
    """The clamp fraction p whose ``correlated_table`` minimises ``correlated_expected_error``
    for ``workers``: with correlated rounding the rounding error shrinks, so the best clamp
    moves out (n = 4, b = 4, g = 31: t_p = 2.54 against independent rounding's 2.15). A grid
    over t_p, refined once; deterministic (the objective is in closed form)."""

    def error(t: float) -> float:
        p = 2.0 * (1.0 - _NORMAL.cdf(t))
        return correlated_expected_error(correlated_table(bits, granularity, p, workers), p,
                                         workers)  # fmt: skip

    coarse = min(np.arange(1.6, 3.61, 0.1), key=error)
    best = min(np.arange(coarse - 0.08, coarse + 0.081, 0.02), key=error)
    return 2.0 * (1.0 - _NORMAL.cdf(float(best)))


SPREADS = tuple(0.5 + 0.02 * i for i in range(26))
"""The norm spreads (RMS over max of a round's workers' norms) ``spread_clamps`` solves for."""


@functools.lru_cache(maxsize=64)
def spread_clamps(bits: int, granularity: int, workers: int) -> tuple[float, ...]:
    """t_p for each of ``SPREADS``: the clamp that minimises ``correlated_expected_error`` of
    correlated THC's table (``correlated_table`` at ``correlated_clamp``, fixed: it is the
    aggregator's) when the round's norms spread that much. THC scales every worker by the
    largest norm, so a worker of a smaller norm has rotated coordinates of sigma < 1 on the
    grid, and less to clamp: the best clamp moves in as the norms spread (n = 4: from t_p =
    2.54 at equal norms to 2.32 at a spread of 0.9 and 2.18 at 0.8). At spread 1 it is
    ``correlated_clamp``'s own; below 1 / sqrt(workers), where no round's norms can be, the
    least spread's."""
    p = correlated_clamp(bits, granularity, workers)
    table = correlated_table(bits, granularity, p, workers)
    floor = 1.0 / math.sqrt(workers)

    def error(t: float, spread: float) -> float:
        q = 2.0 * (1.0 - _NORMAL.cdf(t))
        return correlated_expected_error(table, q, workers, spread=spread)

    clamps = []
    for spread in SPREADS:
        if spread >= 1.0 - 1e-9 or workers == 1:  # one worker: its norm is the largest
            clamps.append(clamp_threshold(p))
            continue
        spread = max(spread, floor + 1e-6)
        coarse = min(np.arange(1.2, 3.61, 0.1), key=lambda t: error(t, spread))
        fine = np.arange(coarse - 0.08, coarse + 0.081, 0.02)
        clamps.append(float(min(fine, key=lambda t: error(t, spread))))
    return tuple(clamps)

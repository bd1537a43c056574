"""Fusion rules: how consecutive layers (backward order) are merged into groups.

Every rule returns a list of ``(first, stop)`` layer ranges covering ``range(len(params))`` in
order. Layers are indexed in backward order: layer 0's gradient is ready first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

LayerRanges = list[tuple[int, int]]


def single_layers(count: int) -> LayerRanges:
    return [(i, i + 1) for i in range(count)]


def one_group(count: int) -> LayerRanges:
    return [(0, count)]


def threshold_groups(params: Sequence[int], threshold: int) -> LayerRanges:
    """Static fusion: add layers to the open group while it stays within ``threshold`` elements.

    A layer larger than the threshold travels alone; it is never split.
    """
    if threshold < 1:
        raise ValueError("fusion threshold must be at least 1 element")
    ranges: LayerRanges = []
    first, size = 0, 0
    for layer, count in enumerate(params):
        if layer > first and size + count > threshold:
            ranges.append((first, layer))
            first, size = layer, 0
        size += count
    ranges.append((first, len(params)))
    return ranges


def threshold_ladder(total: int, per_octave: int) -> list[int]:
    """Static fusion's thresholds from the whole model (one group) down to one element, each
    2^(1/per_octave) below the last, ascending: per_octave 1 is a sweep by factors of 2."""
    if total < 1 or per_octave < 1:
        raise ValueError(
            f"a ladder needs at least 1 element and per_octave >= 1, got {total}, {per_octave}"
        )
    steps = per_octave * math.ceil(math.log2(total)) + 1
    return sorted({max(1, round(total / 2 ** (k / per_octave))) for k in range(steps)})


def mgwfbp_groups(
    params: Sequence[int],
    ready: Sequence[float],
    message_time: Callable[[int], float],
    alpha: float,
) -> LayerRanges:
    """MG-WFBP's merge rule on an α–β model (one communication stream, WFBP timing).

    The open group's communication would start at s = max(its ready time, end of the previous
    group). The next layer joins it when its gradient is ready by s (merging saves one α for
    nothing), or when the wait ``ready − s`` is shorter than the α it saves. Start times are
    recomputed after every merge because the open group's ready time and size change.
    ``message_time`` maps a group's element count to its communication time.
    """
    ready = np.asarray(ready, dtype=float)
    ranges: LayerRanges = []
    previous_end = 0.0  # when the last closed group's communication ends
    first, size = 0, int(params[0])
    for layer in range(1, len(params)):
        start = max(ready[layer - 1], previous_end)  # open group's comm start if sent now
        if ready[layer] <= start or ready[layer] - start < alpha:
            size += int(params[layer])
            continue
        ranges.append((first, layer))
        previous_end = start + message_time(size)
        first, size = layer, int(params[layer])
    ranges.append((first, len(params)))
    return ranges


Candidate = tuple[tuple[int, int, int], ...]  # (first layer, stop layer, span) per group


def search_groups(
    count: int,
    starts: Sequence[Candidate],
    evaluate: Callable[[Candidate], tuple[float, float]],
    spans: Sequence[int] = (),
    span_of: Callable[[int, int], int] = lambda first, stop: 1,
    max_evaluations: int = 2000,
    regroup: bool = True,
) -> Candidate:
    """The grouping (and, with ``spans``, each group's span) that ends the step earliest by
    ``evaluate``, a model of the whole step that returns (the step's end, a tie-break): the
    best of ``starts``, then improved by local moves until none helps — merge two neighbours,
    move a boundary by one layer, split a group in two, and (given ``spans``) step a group's
    span to the next candidate up or down. A merged or split group takes
    ``span_of(first, stop)``. Only a strictly earlier end is taken, or an equal end (within
    1e-9) with a strictly smaller tie-break; the first of equals wins, so ``starts[0]`` (WFBP's
    one group per layer) stands wherever nothing beats it. ``max_evaluations`` bounds the
    search (each evaluation plays a whole step). ``regroup=False`` keeps the starts' groups and
    moves spans only.
    """
    if count < 1:
        raise ValueError("nothing to group")
    memo: dict[Candidate, tuple[float, float]] = {}

    def cost(candidate: Candidate) -> tuple[float, float]:
        if candidate not in memo:
            memo[candidate] = evaluate(candidate)
        return memo[candidate]

    def better(a: Candidate, b: Candidate) -> bool:
        (end_a, tie_a), (end_b, tie_b) = cost(a), cost(b)
        if end_a < end_b * (1 - 1e-9):
            return True
        return end_a <= end_b * (1 + 1e-9) and tie_a < tie_b * (1 - 1e-9)

    best = starts[0]
    for start in starts[1:]:
        if better(start, best):
            best = start
    improved = True
    while improved and len(memo) < max_evaluations:
        improved = False
        for move in _moves(best, spans, span_of, regroup):
            if len(memo) >= max_evaluations:
                break
            if better(move, best):
                best, improved = move, True
                break
    return best


def _moves(
    candidate: Candidate, spans: Sequence[int], span_of, regroup: bool = True
) -> Iterable[Candidate]:
    groups = candidate

    def swap(i: int, count: int, *new) -> Candidate:  # groups[i : i + count] → new
        return (*groups[:i], *new, *groups[i + count :])

    if regroup:
        yield from _regroupings(groups, swap, span_of)
    for i, (a, b, s) in enumerate(groups):  # a wider or narrower span
        below, above = [x for x in spans if x < s], [x for x in spans if x > s]
        for other in [*below[-1:], *above[:1]]:
            yield swap(i, 1, (a, b, other))


def _regroupings(groups: Candidate, swap, span_of) -> Iterable[Candidate]:
    """The grouping moves: merge two neighbours, move a boundary by one layer, split in two."""
    for i in range(len(groups) - 1):  # merge neighbours
        first, stop = groups[i][0], groups[i + 1][1]
        yield swap(i, 2, (first, stop, span_of(first, stop)))
    for i in range(len(groups) - 1):  # move a boundary by one layer
        (a, b, s), (_, d, t) = groups[i], groups[i + 1]
        for cut in (b - 1, b + 1):
            if a < cut < d:
                yield swap(i, 2, (a, cut, s), (cut, d, t))
    for i, (a, b, _) in enumerate(groups):  # split in two
        if b - a > 1:
            cut = (a + b) // 2
            yield swap(i, 1, (a, cut, span_of(a, cut)), (cut, b, span_of(cut, b)))

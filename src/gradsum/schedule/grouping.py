"""Fusion rules: how consecutive layers (backward order) are merged into groups.

Every rule returns a list of ``(first, stop)`` layer ranges covering ``range(len(params))`` in
order. Layers are indexed in backward order: layer 0's gradient is ready first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def pipeline_groups(
    params: Sequence[int],
    ready: Sequence[float],
    push_time: Callable[[int], float],
    pull_time: Callable[[int], float],
) -> LayerRanges:
    """Merge rule for a parameter server: push and pull are two pipeline stages.

    Group g's push starts at max(ready_g, end of push g−1); its pull at max(end of push g, end of
    pull g−1). The next layer joins the open group when sending them merged finishes both stages
    no later than sending them as two groups. Merging saves a message's start-up cost but delays
    the whole merged pull until the merged push is done; on a communication-bound cluster that lost
    overlap (≈ the smaller group's transfer) outweighs the saved start-up for all but small layers,
    which is why this rule keeps groups apart where an all-reduce model merges everything.
    """
    ready = np.asarray(ready, dtype=float)
    ranges: LayerRanges = []
    closed = (0.0, 0.0)  # (push end, pull end) after the closed groups
    first, size = 0, int(params[0])
    for layer in range(1, len(params)):
        extra = int(params[layer])
        separate = _stage_ends(
            _stage_ends(closed, ready[layer - 1], size, push_time, pull_time),
            ready[layer],
            extra,
            push_time,
            pull_time,
        )
        merged = _stage_ends(closed, ready[layer], size + extra, push_time, pull_time)
        if merged[1] <= separate[1]:
            size += extra
            continue
        closed = _stage_ends(closed, ready[layer - 1], size, push_time, pull_time)
        ranges.append((first, layer))
        first, size = layer, extra
    ranges.append((first, len(params)))
    return ranges


def _stage_ends(state, ready_at, size, push_time, pull_time):
    push_end = max(ready_at, state[0]) + push_time(size)
    pull_end = max(push_end, state[1]) + pull_time(size)
    return push_end, pull_end


def overlapped_pipeline_groups(
    params: Sequence[int],
    ready: Sequence[float],
    own_time: Callable[[int], float],
    stream_time: Callable[[int], float],
) -> LayerRanges:
    """PS merge rule when groups' transfers overlap (groups in flight on distinct shards).

    Each stage (push, then pull) of group g is bounded two ways: by its own transfer,
    ``own_time(size)`` from when it can start (its parts' incast at their shards and its
    start-up), and by the resources every group shares — ``stream_time(size)`` after the work
    of the groups before it (the worker's port and thread, the NIC, all shards together). So
    push_end = max(ready + own, push stream) and pull_end = max(push_end + own, pull stream);
    the step ends when the slowest group's pull does. The next layer joins the open group only
    when sending them merged ends the step strictly earlier than sending them as two groups:
    merging saves a start-up on the shared resources, but puts both layers' bytes on the same
    parts (a longer own transfer) and delays the first layer's send until the second is ready.
    A tie (e.g. both bound by the shared stream) keeps them apart: separate groups sit on more
    shards, which the stream's aggregate rate does not see.
    """
    ranges, _ = overlapped_span_groups(
        params, ready, lambda n, _: own_time(n), lambda n, _: stream_time(n), (1,)
    )
    return ranges


def overlapped_span_groups(
    params: Sequence[int],
    ready: Sequence[float],
    own_time: Callable[[int, int], float],
    stream_time: Callable[[int, int], float],
    spans: Sequence[int],
) -> tuple[LayerRanges, list[int]]:
    """:func:`overlapped_pipeline_groups` with each group's span (shards its parts sit on) chosen
    against the step's end as well: ``own_time(size, span)`` and ``stream_time(size, span)``, and
    every group takes the candidate span that ends its pull earliest given the groups before it
    (ties: the one that leaves the shared streams freest, then the smaller span), the end
    counting what the later layers must still put on the shared stream. A wider span
    shortens a group's own incast but costs α_worker per part on the worker's one thread (the
    stream), which every later group waits behind — so a span that only helps the group itself
    loses here. Returns the layer ranges and their spans.
    """
    ready = np.asarray(ready, dtype=float)
    ranges: LayerRanges = []
    chosen: list[int] = []
    closed = (0.0, 0.0, 0.0)  # push stream free, pull stream free, latest pull end
    # What the layers after k add to the shared stream at the least (each sent alone at its
    # cheapest span): the step cannot end before the pull stream has carried them too. Without
    # this the walk is myopic: early on a group's own incast dominates its end, so merging
    # looks worse even where the start-ups it saves are what later groups wait behind.
    alone = [min(stream_time(int(p), span) for span in spans) for p in params]
    future = np.concatenate([np.cumsum(alone[::-1])[::-1], [0.0]])

    def send(state, ready_at, count, after_layer):
        best = None
        for span in spans:
            sent = _overlapped(state, ready_at, count, own_time, stream_time, span)
            end = max(sent[2], sent[1] + future[after_layer + 1])
            key = (end, sent[1], sent[0], span)
            if best is None or key < best[0]:
                best = (key, sent, span)
        return best[1], best[2], best[0][0]

    first, size = 0, int(params[0])
    for layer in range(1, len(params)):
        extra = int(params[layer])
        open_sent, open_span, _ = send(closed, ready[layer - 1], size, layer - 1)
        _, _, separate = send(open_sent, ready[layer], extra, layer)
        _, _, merged = send(closed, ready[layer], size + extra, layer)
        if merged < separate:
            size += extra
            continue
        closed = open_sent
        ranges.append((first, layer))
        chosen.append(open_span)
        first, size = layer, extra
    _, last_span, _ = send(closed, ready[-1], size, len(params) - 1)
    ranges.append((first, len(params)))
    chosen.append(last_span)
    return ranges, chosen


def _overlapped(state, ready_at, size, own_time, stream_time, span):
    push_stream, pull_stream, latest = state
    own, stream = own_time(size, span), stream_time(size, span)
    push_stream = max(push_stream, ready_at) + stream
    push_end = max(ready_at + own, push_stream)
    pull_stream = max(pull_stream, push_end) + stream
    pull_end = max(push_end + own, pull_stream)
    return push_stream, pull_stream, max(latest, pull_end)

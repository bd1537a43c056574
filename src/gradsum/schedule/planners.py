"""Planners: pure functions ``(profile, cluster, **options) → Plan``, and their registry.

=========  ==============================================================================
default    one group per layer, sent only after the whole backward pass
wfbp       one group per layer, each sent as soon as its gradient is ready
fusion     static fusion: layers merged while a group stays ≤ ``threshold`` elements
mgwfbp     MG-WFBP's merge rule on the ring all-reduce α–β model
priority   slices of ``slice_elements``, most urgent (front) layer first, credit window,
           pre-emption at slice boundaries, next forward gated per layer (ByteScheduler/P3)
merge      groups searched against the PS plan played out on its resources (costs.ps_step_end)
imerge     groups and spans searched the same way, interleaved: groups spread over consecutive
           shards and every worker rotating its starting shard (no synchronised incast)
=========  ==============================================================================

The cost model each adaptive planner reasons with is derived from the ``ClusterSpec`` unless one
is passed as ``cost=``; see :mod:`gradsum.schedule.costs`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from .cluster import ClusterSpec
from .costs import AllReduceCost, PSCost, ps_group_ends
from .grouping import (
    LayerRanges,
    mgwfbp_groups,
    search_groups,
    single_layers,
    threshold_groups,
)
from .placement import place_groups, place_slices, place_spread
from .plan import Group, Plan, plan_skeleton
from .profile import ModelProfile

Planner = Callable[[ModelProfile, ClusterSpec], Plan]

# BytePS's default partition (BYTEPS_PARTITION_BYTES = 4,096,000) in fp32 elements.
PARTITION_ELEMENTS = 1_024_000


def _element_ranges(profile: ModelProfile, layer_ranges: LayerRanges) -> list[tuple[int, int]]:
    offsets = profile.offsets
    return [(int(offsets[a]), int(offsets[b])) for a, b in layer_ranges]


WINDOWS = ("all", "group")


def _window(profile: ModelProfile, cluster: ClusterSpec, window: str) -> int | None:
    """``credit_bytes`` for a PS plan's ``window``: ``"all"`` admits every group as it is
    released (a BytePS client pushes every tensor asynchronously with no credit by default,
    ``BYTEPS_SCHEDULING_CREDIT`` = 0, so only one round trip per shard stream limits what is in
    flight); ``"group"`` admits one group at a time (a prototype that waits for a group's
    answer before it sends the next: blocking send/recv per tensor, as a PS written on
    ``torch.distributed`` point-to-point calls does)."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    return profile.total_params * cluster.bytes_per_element if window == "all" else None


def _layer_plan(
    profile,
    cluster,
    policy,
    layer_ranges,
    aggregator="ps",
    placement="pieces",
    window="all",
    partition=PARTITION_ELEMENTS,
    **fields,
) -> Plan:
    """Groups of whole layers placed over shards (``placement``: BytePS ``"pieces"`` of at most
    ``partition`` elements or each group ``"whole"`` on one shard, round-robin; no parts for
    all-reduce), admitted as ``window`` says (``_window``)."""
    if partition < 1:
        raise ValueError(f"partition must be at least 1 element, got {partition}")
    ranges = _element_ranges(profile, layer_ranges)
    if aggregator != "ps":
        groups = tuple(Group(a, b) for a, b in ranges)
        return Plan(policy, groups, aggregator=aggregator, **plan_skeleton(profile), **fields)
    parts = place_groups(ranges, cluster.shards, placement, partition)
    groups = tuple(Group(a, b, p) for (a, b), p in zip(ranges, parts, strict=True))
    credit = _window(profile, cluster, window)
    return Plan(policy, groups, credit_bytes=credit, **plan_skeleton(profile), **fields)


def plan_default(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    aggregator: str = "ps",
    placement="pieces",
    window: str = "all",
    partition: int = PARTITION_ELEMENTS,
) -> Plan:
    layers = single_layers(len(profile.layers))
    return _layer_plan(
        profile,
        cluster,
        "default",
        layers,
        aggregator,
        placement,
        window,
        partition,
        trigger="after_backward",
    )


def plan_wfbp(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    aggregator: str = "ps",
    placement="pieces",
    window: str = "all",
    partition: int = PARTITION_ELEMENTS,
) -> Plan:
    layers = single_layers(len(profile.layers))
    return _layer_plan(profile, cluster, "wfbp", layers, aggregator, placement, window, partition)


def plan_fusion(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    threshold: int = 500_000,
    aggregator: str = "ps",
    placement: str = "pieces",
    window: str = "all",
    partition: int = PARTITION_ELEMENTS,
) -> Plan:
    layers = threshold_groups(profile.params, threshold)
    return _layer_plan(
        profile,
        cluster,
        "fusion",
        layers,
        aggregator,
        placement,
        window,
        partition,
        options={"threshold": threshold},
    )


def plan_mgwfbp(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    cost: AllReduceCost | None = None,
    aggregator: str = "ps",
    placement: str = "pieces",
    window: str = "all",
    partition: int = PARTITION_ELEMENTS,
) -> Plan:
    if cost is None:
        # MG-WFBP fits α, β on the transfers it actually makes: here, through the PS.
        ps = aggregator == "ps"
        cost = (
            AllReduceCost.fitted_through_ps(cluster) if ps else AllReduceCost.from_cluster(cluster)
        )
    element_bytes = cluster.bytes_per_element
    layers = mgwfbp_groups(
        profile.params, profile.ready_times(), lambda n: cost.time(n * element_bytes), cost.alpha
    )
    return _layer_plan(
        profile,
        cluster,
        "mgwfbp",
        layers,
        aggregator,
        placement,
        window,
        partition,
        options={"alpha": cost.alpha, "workers": cost.workers},
    )


def _search_starts(profile: ModelProfile) -> list[LayerRanges]:
    """Where the merge planners' search starts: WFBP's one group per layer first (it stands on
    ties), then static fusion at thresholds from one layer's worth to everything in one group,
    the fusion baseline's 500,000 among them, so the search starts from the best of both."""
    total = profile.total_params
    thresholds = {500_000} | {max(1, total >> k) for k in range(0, 16)}
    starts = [single_layers(len(profile.layers))]
    starts += [threshold_groups(profile.params, t) for t in sorted(thresholds)]
    return starts


def _step_and_mean_end(plan: Plan, cluster: ClusterSpec, ready) -> tuple[float, float]:
    """What the merge planners minimise: the step's end by the whole-plan play, then (on equal
    ends) the mean time a layer's gradients are back, which is lowest for WFBP's one group per
    layer where communication hides and breaks ties the play cannot see (it serves ports first
    come, first served and so hides what a few messages less save behind a long bottleneck)."""
    ends = ps_group_ends(plan, cluster, ready)
    layers = [len(plan.layers_of(g)) for g in plan.groups]
    return max(ends), sum(e * k for e, k in zip(ends, layers, strict=True)) / sum(layers)


def _pieces(profile: ModelProfile, cluster: ClusterSpec, first: int, stop: int) -> int:
    """BytePS's piece count for layers [first, stop): ⌈elements / 4 MB of fp32⌉, at most m."""
    offsets = profile.offsets
    elements = int(offsets[stop]) - int(offsets[first])
    return max(1, min(cluster.shards, -(-elements // PARTITION_ELEMENTS)))


def plan_merge(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    placement: str = "pieces",
    window: str = "all",
    partition: int = PARTITION_ELEMENTS,
    max_evaluations: int = 2000,
) -> Plan:
    """Groups chosen by playing candidate plans out on the PS's resources (``costs.ps_step_end``:
    per-message costs per part on the worker's one thread and the shards' cores, incast at each
    part's shard, one round trip per shard stream, groups admitted as ``window`` says), placed
    and windowed as the baselines are (``placement``, ``partition``, ``window``). The search
    (``grouping.search_groups``) starts from the best of WFBP's and static fusion's groupings,
    so by its own model merge is never behind either."""
    ready = profile.ready_times()

    def build(candidate) -> Plan:
        layers = [(a, b) for a, b, _ in candidate]
        return _layer_plan(
            profile,
            cluster,
            "merge",
            layers,
            placement=placement,
            window=window,
            partition=partition,
        )

    def evaluate(candidate) -> tuple[float, float]:
        return _step_and_mean_end(build(candidate), cluster, ready)

    starts = [tuple((a, b, 1) for a, b in ranges) for ranges in _search_starts(profile)]
    best = search_groups(len(profile.layers), starts, evaluate, max_evaluations=max_evaluations)
    return build(best)


def plan_imerge(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    window: str = "all",
    interleave: bool | None = None,
    fuse: bool = True,
    max_evaluations: int = 2000,
) -> Plan:
    """Groups *and* their spans chosen by playing candidate plans out on the PS's resources
    (``costs.ps_step_end``), as ``merge`` does, but interleaved: group g over ``span`` consecutive
    shards continuing around the ring, every worker starting at a different part, so a big
    group's n pushes spread over several shards' ports instead of meeting at one. A span costs
    α_worker per part on the worker's one thread, which every later group waits behind, so the
    search weighs each span against the step's end. It starts from merge's starts, each group
    over as many shards as BytePS would cut it into pieces. ``window`` as the baselines'
    (``_window``).

    ``interleave``: ``None`` plays every candidate both ways and rotates only where the play
    shows a gain beyond the cluster's ``resolution``. Sent in order, a part's answers start
    while the next part is pushed; rotated, every part is complete only near the end of the
    group's push phase. Neither the play nor the fluid simulator models the incast collapse
    rotation avoids in a TCP cluster, and on the testbed rotation changed nothing beyond the
    runs' noise (docs/scheduling.md, "Do fusion, interleaving and the window pay?"), so
    ``True`` (the seed's always-rotate) is asked for, not assumed. ``fuse=False`` keeps one
    group per layer and searches spans only (the ablation "interleaving only").

    On a fitted cluster (``cluster.resolution`` > 0) the search's plan is then set against the
    starts, fusion at every threshold: the one with the fewest messages whose play ends within
    that resolution of the best is sent. On the testbed a noisy fit otherwise chose a second
    group, or rotation, for a predicted gain of a few percent that the runs did not show
    (docs/scheduling.md, "How is a start-up fit judged")."""
    ready = profile.ready_times()
    credit = _window(profile, cluster, window)
    span_candidates = PSCost(cluster).span_candidates()

    def build_as(candidate, interleaved: bool) -> Plan:
        ranges = _element_ranges(profile, [(a, b) for a, b, _ in candidate])
        spans = [s for _, _, s in candidate]
        parts = place_spread(ranges, spans, cluster.shards)
        groups = tuple(Group(a, b, p) for (a, b), p in zip(ranges, parts, strict=True))
        return Plan(
            "imerge",
            groups,
            interleave=interleaved,
            credit_bytes=credit,
            **plan_skeleton(profile),
            options={"spans": [len(p) for p in parts]},
        )

    @functools.cache  # the search, the resolution's check and the final build ask again
    def chosen(candidate) -> tuple[tuple[float, float], Plan]:
        """The candidate's plan and its play: sent in order first, so rotation is kept only
        where the play shows a gain."""
        ways = (False, True) if interleave is None else (interleave,)
        if interleave is None and not _rotation_plays_apart(candidate, cluster):
            ways = (False,)  # rotated, the play is the same: in order is kept either way
        best = None
        for way in ways:
            plan = build_as(candidate, way)
            cost = _step_and_mean_end(plan, cluster, ready)
            if best is None or cost[0] < best[0][0] * (1 - max(cluster.resolution, 1e-9)):
                best = (cost, plan)
        return best

    def build(candidate) -> Plan:
        return chosen(candidate)[1]

    def evaluate(candidate) -> tuple[float, float]:
        return chosen(candidate)[0]

    def span_of(first: int, stop: int) -> int:
        return _pieces(profile, cluster, first, stop)

    groupings = _search_starts(profile) if fuse else _search_starts(profile)[:1]
    starts = [tuple((a, b, span_of(a, b)) for a, b in ranges) for ranges in groupings]
    best = search_groups(
        len(profile.layers),
        starts,
        evaluate,
        spans=span_candidates,
        span_of=span_of,
        max_evaluations=max_evaluations,
        regroup=fuse,
    )
    if cluster.resolution > 0:
        best = _fewest_messages_within(best, starts, chosen, cluster.resolution)
    return build(best)


def _rotation_plays_apart(candidate, cluster: ClusterSpec) -> bool:
    """Whether ``ps_group_ends`` can end a candidate's rotated plan otherwise than its plan sent
    in order. The representative worker is worker 0, whose rotation starts at part 0: its send
    order is the same either way, and rotation only moves when a part is complete at its shard
    (``costs._rotated_gate``), which it cannot for a group of one part, nor with one worker
    (every part is gated by its own send). Where it cannot, the rotated play is not run: it
    would end exactly as in order, and in order is kept on ties."""
    return cluster.workers > 1 and any(span > 1 for _, _, span in candidate)


def _fewest_messages_within(best, alternatives, chosen, resolution: float):
    """Of ``best`` and ``alternatives``, the candidate whose plan sends the fewest parts among
    those whose play ends within ``resolution`` of ``best``'s (``chosen``: candidate → (play,
    plan)); the earlier end among equals, and ``best`` where nothing else is that close."""
    limit = chosen(best)[0][0] * (1 + resolution)
    ranked = []
    for candidate in (best, *alternatives):
        (end, _), plan = chosen(candidate)
        if end <= limit:
            ranked.append((sum(len(g.parts) for g in plan.groups), end, candidate))
    return min(ranked, key=lambda r: r[:2])[2]


def plan_priority(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    slice_elements: int = 100_000,
    credit_elements: int | None = 4_000_000,
    slice_placement: str = "bytescheduler",
) -> Plan:
    if slice_elements < 1:
        raise ValueError("slice_elements must be at least 1")
    offsets = profile.offsets
    last = len(profile.layers) - 1
    slices, priorities = [], []
    for layer in range(len(profile.layers)):
        for start in range(int(offsets[layer]), int(offsets[layer + 1]), slice_elements):
            slices.append((start, min(start + slice_elements, int(offsets[layer + 1]))))
            priorities.append(last - layer)  # front layers (highest backward index) first
    parts = place_slices(slices, profile.offsets, cluster.shards, slice_placement)
    groups = tuple(
        Group(a, b, p, prio) for (a, b), p, prio in zip(slices, parts, priorities, strict=True)
    )
    credit = None if credit_elements is None else credit_elements * cluster.bytes_per_element
    return Plan(
        "priority",
        groups,
        order="priority",
        forward_gate="layer",
        credit_bytes=credit,
        options={
            "slice_elements": slice_elements,
            "credit_elements": credit_elements,
            "slice_placement": slice_placement,
        },
        **plan_skeleton(profile),
    )


_PLANNERS: dict[str, Callable[..., Plan]] = {
    "default": plan_default,
    "wfbp": plan_wfbp,
    "fusion": plan_fusion,
    "mgwfbp": plan_mgwfbp,
    "priority": plan_priority,
    "merge": plan_merge,
    "imerge": plan_imerge,
}

PLANNER_NAMES: tuple[str, ...] = tuple(_PLANNERS)


def parse_scheduler(spec: str) -> tuple[str, dict]:
    """A policy with its options, ``imerge(interleave=true,window=group)``: its name and its
    options, checked against the planner's signature: each option one it has, each value of
    its type (ValueError naming what is wrong and listing what is valid)."""
    from ..spec import check_options, parse_options, signature_options, split_spec

    name, text = split_spec(spec)
    options = parse_options(text, what="scheduler option")
    if name not in _PLANNERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(PLANNER_NAMES)}")
    accepted = dict(list(signature_options(_PLANNERS[name]).items())[2:])  # after profile, cluster
    return name, check_options("scheduler", name, options, accepted)


def takes_option(name: str, option: str) -> bool:
    """Whether policy ``name`` has the option ``option`` (``placement``: the baselines do,
    imerge and priority place by their own rules)."""
    return option in inspect.signature(_PLANNERS[name]).parameters


def make_planner(name: str, **options) -> Planner:
    """The planner ``name`` with its keyword options bound: ``planner(profile, cluster) → Plan``."""
    if name not in _PLANNERS:
        raise ValueError(
            f"unknown scheduling policy {name!r}; choose one of: {', '.join(PLANNER_NAMES)}"
        )
    function = _PLANNERS[name]
    try:
        inspect.signature(function).bind(None, None, **options)
    except TypeError:
        allowed = [p for p in inspect.signature(function).parameters][2:]
        unknown = sorted(set(options) - set(allowed))
        raise ValueError(
            f"policy {name!r} takes options {allowed}, got {unknown or sorted(options)}"
        ) from None

    def planner(profile: ModelProfile, cluster: ClusterSpec) -> Plan:
        return function(profile, cluster, **options)

    planner.__name__ = f"plan_{name}"
    return planner

"""A plan: which gradients travel together, when, in which order, and to which PS shard.

Gradients are addressed as element ranges of one conceptual flat buffer that concatenates the
profile's layers in backward order (layer 0 = first gradient ready). A :class:`Group` is a
contiguous range — whole layers for fusion policies, part of a layer for a priority *slice* — and
each group is split into :class:`Part`\\ s, one per PS shard it spans. A runtime firing sends from
autograd hooks needs exactly this: a group may go once every layer it overlaps has its gradient
(:meth:`Plan.layers_of` / :meth:`Plan.params_of`), groups go in plan order (or most urgent first),
and every part goes to its shard.

Execution semantics shared by the simulator and the runtime:

``trigger``      ``"when_ready"``: a group is eligible once its gradients exist;
                 ``"after_backward"``: only once the whole backward pass has finished.
``order``        ``"fifo"``: groups are released strictly in list order;
                 ``"priority"``: in the order of a one-sender replay on the profile that takes
                 the eligible group with the smallest ``priority`` (front layers first) whenever
                 it is free (``schedule/ordering.py: send_order``), fixed so every worker agrees.
``forward_gate`` ``"barrier"``: the next forward starts once every group is back (optimizer
                 step after a full sync); ``"layer"``: each layer's forward waits only for the
                 groups holding its own gradients.
``interleave``   worker w sends the parts of a group starting at part ``w mod len(parts)``, so at
                 any moment different workers talk to different shards (no synchronised incast).
``credit_bytes`` window: bytes of admitted groups a worker may have in flight (a group counts
                 until its last part is back; one group always fits). ``None``: one group at a
                 time. An admitted group has every part in flight at once, one part per shard
                 stream at a time (``schedule/dispatch.py: SendWindow``, which the simulator and
                 the runtime's ``ShardSender`` both run).
``aggregator``   ``"ps"`` (parts go to shards) or ``"allreduce"`` (ring; parts are empty).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from .profile import ModelProfile

TRIGGERS = ("when_ready", "after_backward")
ORDERS = ("fifo", "priority")
FORWARD_GATES = ("barrier", "layer")
AGGREGATORS = ("ps", "allreduce")


@dataclass(frozen=True)
class Part:
    shard: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Group:
    start: int
    stop: int
    parts: tuple[Part, ...] = ()
    priority: int = 0  # smaller = needed sooner by the next forward pass

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    policy: str
    groups: tuple[Group, ...]
    layer_offsets: tuple[int, ...]
    layer_params: tuple[tuple[int, ...], ...] = ()
    aggregator: str = "ps"
    trigger: str = "when_ready"
    order: str = "fifo"
    forward_gate: str = "barrier"
    interleave: bool = False
    credit_bytes: int | None = None
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        self._check_fields()
        self._check_coverage()

    def _check_fields(self) -> None:
        for name, value, allowed in (
            ("trigger", self.trigger, TRIGGERS),
            ("order", self.order, ORDERS),
            ("forward_gate", self.forward_gate, FORWARD_GATES),
            ("aggregator", self.aggregator, AGGREGATORS),
        ):
            if value not in allowed:
                raise ValueError(f"plan {name} {value!r} is not one of {allowed}")
        if self.credit_bytes is not None and self.credit_bytes <= 0:
            raise ValueError("credit_bytes must be positive or None")

    def _check_coverage(self) -> None:
        """Groups tile the buffer exactly once; parts tile their group (PS plans)."""
        spans = sorted((g.start, g.stop) for g in self.groups)
        edge = 0
        for start, stop in spans:
            if start != edge or stop <= start:
                raise ValueError(f"groups do not tile the gradient buffer at element {edge}")
            edge = stop
        if edge != self.layer_offsets[-1]:
            raise ValueError("groups do not cover every gradient element")
        for group in self.groups:
            if self.aggregator == "allreduce":
                continue
            starts = [p.start for p in group.parts]
            stops = [p.stop for p in group.parts]
            if (
                not group.parts
                or starts[0] != group.start
                or stops[-1] != group.stop
                or any(a != b for a, b in zip(stops, starts[1:], strict=False))
            ):
                raise ValueError(f"parts of group [{group.start}, {group.stop}) do not tile it")
            if len({p.shard for p in group.parts}) != len(group.parts):
                raise ValueError("a group puts two parts on the same shard")

    @property
    def total_elements(self) -> int:
        return self.layer_offsets[-1]

    @property
    def num_layers(self) -> int:
        return len(self.layer_offsets) - 1

    def layers_of(self, group: Group) -> range:
        """Profile layers (backward order) whose gradients a group contains, at least partly."""
        first = bisect.bisect_right(self.layer_offsets, group.start) - 1
        last = bisect.bisect_left(self.layer_offsets, group.stop) - 1
        return range(first, last + 1)

    def params_of(self, group: Group) -> tuple[int, ...]:
        """Indices into ``list(model.parameters())`` that a group needs before it can be sent."""
        if not self.layer_params:
            return ()
        return tuple(i for layer in self.layers_of(group) for i in self.layer_params[layer])

    def part_order(self, group: Group, worker: int) -> tuple[Part, ...]:
        """Parts in the order ``worker`` sends them (rotated by worker when interleaving)."""
        if not self.interleave or len(group.parts) < 2:
            return group.parts
        k = worker % len(group.parts)
        return group.parts[k:] + group.parts[:k]

    def shard_load(self, num_shards: int) -> np.ndarray:
        """Elements each shard receives from one worker per iteration."""
        load = np.zeros(num_shards, dtype=np.int64)
        for group in self.groups:
            for part in group.parts:
                load[part.shard] += part.numel
        return load

    def summary(self) -> str:
        sizes = [g.numel for g in self.groups]
        parts = sum(len(g.parts) for g in self.groups)
        into = f" in {parts} parts" if parts > len(self.groups) else ""  # a PS plan's messages
        if into and self.interleave:
            into += ", interleaved"
        return (
            f"{self.policy}: {len(self.groups)} groups{into}, largest {max(sizes):,} elements, "
            f"smallest {min(sizes):,}"
        )


def plan_skeleton(profile: ModelProfile) -> dict:
    """The profile-derived fields every plan carries."""
    offsets = tuple(int(x) for x in profile.offsets)
    params = tuple(layer.param_indices for layer in profile.layers)
    return {"layer_offsets": offsets, "layer_params": params}
